//! IPv6 (conformance D-rows at the packet level): IPv6 frames reach the
//! IPv6 programs by tail call from the IPv4 ones. The paths both families
//! share are rows of tables over [`super::FAMILIES`] (`main.rs`,
//! `lifecycle.rs`, `handover.rs`), and the fuzzer runs both families
//! (`fuzz.rs`); this file holds what only IPv6 has: extension headers
//! walked or passed, fragments, ICMPv6 errors, SCTP's CRC32c over IPv6.
//! Checksums are verified by the kit's checker over the 128-bit
//! pseudo-header.

use std::net::Ipv6Addr;

use proxy_agent::model::{BackendAddr, FrontendKey};
use proxy_common::{conntrack::sctp as chunk, stat, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use super::delta;
use super::{B6, CLIENT6, EXT_CLIENT6, NODE6, REMOTE6, VIP6};
use proxy_testkit::kit::{
    case::Setup,
    check::{parse_checked, quoted_tuple, tuple, tuple_checked, IPPROTO_ICMPV6, NEXTHDR_FRAGMENT},
    frame::{
        frame6, icmp_error, ipv6_fragment_header, ipv6_options_header, ipv6_routing_header,
        sctp_packet, tcp, tcp_segment, udp, L4_OFF6, SYN,
    },
    harness::{be as be6, fe as fe6, fe_ext as fe6_ext, Harness, Prog, TC_ACT_OK},
};

/// What an ICMPv6 error quotes of a packet: as much as a 1,280-byte
/// (minimum MTU) error holds (RFC 4443 2.4 (c)).
const ICMP6_QUOTE: usize = 1280 - 40 - 8;

/// A harness of `frontends`, this node's IPv6 address configured.
fn harness6(frontends: &[(FrontendKey, Vec<BackendAddr>, u16)]) -> Harness {
    Setup {
        node: Some(NODE6.into()),
        ..Setup::new(frontends.to_vec())
    }
    .harness()
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_sctp_is_translated_with_its_crc32c() {
    let h = harness6(&[(
        fe6(VIP6, 5060, IPPROTO_SCTP),
        vec![be6(B6, 5061, IPPROTO_SCTP)],
        0,
    )]);
    let init = [0, 0, 0, 1, 0, 1, 0, 0, 0, 10, 0, 10, 0, 0, 0, 1];
    let seg = sctp_packet(40000, 5060, chunk::INIT, &init);
    let (_, out) = h.run(&frame6(CLIENT6, VIP6, IPPROTO_SCTP, &[], seg));
    assert_eq!(
        tuple_checked(&out, L4_OFF6),
        tuple(CLIENT6, 40000, B6, 5061)
    );
    let seg = sctp_packet(5061, 40000, chunk::INIT_ACK, &init);
    let (_, out) = h.run(&frame6(B6, CLIENT6, IPPROTO_SCTP, &[], seg));
    assert_eq!(
        tuple_checked(&out, L4_OFF6),
        tuple(VIP6, 5060, CLIENT6, 40000)
    );
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_hop_by_hop_options_are_walked_routing_headers_pass() {
    let h = harness6(&[(
        fe6(VIP6, 80, IPPROTO_TCP),
        vec![be6(B6, 8080, IPPROTO_TCP)],
        0,
    )]);
    let seg = || tcp_segment(40000, 80, SYN, b"hello");
    // Hop-by-hop and destination options before TCP: translated.
    let f = frame6(
        CLIENT6,
        VIP6,
        IPPROTO_TCP,
        &[(0, ipv6_options_header(0)), (60, ipv6_options_header(0))],
        seg(),
    );
    let (_, out) = h.run(&f);
    assert_eq!(
        tuple_checked(&out, L4_OFF6 + 16),
        tuple(CLIENT6, 40000, B6, 8080)
    );

    let before = h.stats();
    // A routing header: untouched.
    let routing = frame6(
        CLIENT6,
        VIP6,
        IPPROTO_TCP,
        &[(43, ipv6_routing_header())],
        seg(),
    );
    // Five options headers: more than the datapath walks.
    let deep = frame6(
        CLIENT6,
        VIP6,
        IPPROTO_TCP,
        &(0..5)
            .map(|_| (60, ipv6_options_header(0)))
            .collect::<Vec<_>>(),
        seg(),
    );
    for f in [&routing, &deep] {
        let (rc, out) = h.run(f);
        assert_eq!((rc, &out), (TC_ACT_OK, f));
    }
    assert_eq!(delta(&h, &before, stat::PASS_IPV6_EXT_HEADER), 2);
}

/// A fragmented UDP datagram to an IPv6 ClusterIP (D13's 2,000-byte
/// request over a 1,500-byte MTU): the first fragment is translated (its
/// checksum, over the whole datagram, updated by the change), its ports
/// recorded; the second, with no UDP header, follows it, only its addresses
/// rewritten, its payload untouched; a later fragment whose first was not
/// seen passes untouched.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_fragments_follow_their_first() {
    let h = harness6(&[(
        fe6(VIP6, 53, IPPROTO_UDP),
        vec![be6(B6, 5353, IPPROTO_UDP)],
        0,
    )]);
    // The whole datagram, its checksum computed over all of it, then split
    // after 1,232 bytes of UDP (a multiple of 8).
    let payload: Vec<u8> = (0..2000u32).map(|i| (i * 13) as u8).collect();
    let whole = udp(CLIENT6, 33000, VIP6, 53, &payload);
    let seg = &whole[L4_OFF6..];
    let (head, tail) = seg.split_at(1232);
    let first = frame6(
        CLIENT6,
        VIP6,
        IPPROTO_UDP,
        &[(NEXTHDR_FRAGMENT, ipv6_fragment_header(0, true, 77))],
        head.to_vec(),
    );
    let second = frame6(
        CLIENT6,
        VIP6,
        IPPROTO_UDP,
        &[(NEXTHDR_FRAGMENT, ipv6_fragment_header(1232 / 8, false, 77))],
        tail.to_vec(),
    );
    let before = h.stats();
    let (_, out1) = h.run(&first);
    let (_, out2) = h.run(&second);
    assert_eq!(delta(&h, &before, stat::FRAGMENT_TRACKED), 1);
    // Reassembled, the datagram is the client's to the backend, its UDP
    // checksum valid over the new pseudo-header.
    let l4 = L4_OFF6 + 8;
    let mut joined = out1[..L4_OFF6].to_vec();
    joined[20] = IPPROTO_UDP;
    joined.extend_from_slice(&out1[l4..]);
    joined.extend_from_slice(&out2[l4..]);
    let len = (joined.len() - L4_OFF6) as u16;
    joined[18..20].copy_from_slice(&len.to_be_bytes());
    assert_eq!(
        tuple_checked(&joined, L4_OFF6),
        tuple(CLIENT6, 33000, B6, 5353)
    );
    assert_eq!(&joined[L4_OFF6 + 8..], &payload[..]);
    // The second fragment's addresses were rewritten.
    let dst2 = Ipv6Addr::from(<[u8; 16]>::try_from(&out2[38..54]).unwrap());
    assert_eq!(dst2, B6);

    let stray = frame6(
        CLIENT6,
        VIP6,
        IPPROTO_UDP,
        &[(NEXTHDR_FRAGMENT, ipv6_fragment_header(1232 / 8, false, 78))],
        tail.to_vec(),
    );
    let before = h.stats();
    let (rc, out) = h.run(&stray);
    assert_eq!((rc, &out), (TC_ACT_OK, &stray));
    assert_eq!(delta(&h, &before, stat::PASS_FRAGMENT), 1);
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_what_is_not_a_frontend_passes_untouched() {
    let h = harness6(&[(
        fe6(VIP6, 80, IPPROTO_TCP),
        vec![be6(B6, 8080, IPPROTO_TCP)],
        0,
    )]);
    let other_port = tcp(CLIENT6, 40000, VIP6, 81, SYN, b"hello");
    let pod_to_pod = tcp(CLIENT6, 40000, B6, 8080, SYN, b"hello");
    // A neighbour solicitation (ICMPv6 135).
    let mut ns = vec![135, 0, 0, 0, 0, 0, 0, 0];
    ns.extend_from_slice(&B6.octets());
    let ndp = frame6(CLIENT6, B6, IPPROTO_ICMPV6, &[], ns);
    let mut truncated = tcp(CLIENT6, 40000, VIP6, 80, SYN, b"hello");
    truncated.truncate(L4_OFF6 + 10);
    for f in [&other_port, &pod_to_pod, &ndp, &truncated] {
        for prog in [
            Prog::PodIngress,
            Prog::ExtIngress,
            Prog::Egress,
            Prog::ExtXdp,
        ] {
            let (rc, out) = h.run_prog(prog, f);
            let pass = if prog == Prog::ExtXdp { 2 } else { TC_ACT_OK };
            assert_eq!((rc, &out), (pass, f), "{prog:?}");
        }
    }
}

/// The kit's builders give valid IPv6 checksums (the tests' own check).
#[test]
fn ipv6_test_frames_are_valid() {
    let f = tcp(CLIENT6, 40000, VIP6, 80, SYN, b"hello");
    assert_eq!(tuple_checked(&f, L4_OFF6), tuple(CLIENT6, 40000, VIP6, 80));
    let f = udp(CLIENT6, 40000, VIP6, 80, b"x");
    assert_eq!(tuple_checked(&f, L4_OFF6), tuple(CLIENT6, 40000, VIP6, 80));
    let seg = sctp_packet(40000, 80, chunk::INIT, &[0; 16]);
    let f = frame6(CLIENT6, VIP6, IPPROTO_SCTP, &[], seg);
    assert_eq!(tuple_checked(&f, L4_OFF6), tuple(CLIENT6, 40000, VIP6, 80));
}

/// Path-MTU discovery through an IPv6 ClusterIP: a router's "packet too
/// big" about a packet the client sent (quoting client → backend, as it
/// left) reaches the client from the frontend, quoting client → frontend,
/// every checksum valid — the inner TCP one too, so the client's stack
/// matches it to its socket. Before, it passed untranslated and no socket
/// knew the quoted tuple.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_packet_too_big_reaches_the_client_translated() {
    let h = harness6(&[(
        fe6(VIP6, 80, IPPROTO_TCP),
        vec![be6(REMOTE6, 8080, IPPROTO_TCP)],
        0,
    )]);
    let (_, out) = h.run(&tcp(CLIENT6, 40000, VIP6, 80, SYN, b"hello"));
    assert_eq!(
        tuple_checked(&out, L4_OFF6),
        tuple(CLIENT6, 40000, REMOTE6, 8080)
    );
    let router = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0xfe01);
    let ptb = icmp_error(router, CLIENT6, (2, 0), 1280, &out, ICMP6_QUOTE);
    let before = h.stats();
    for prog in [Prog::ExtIngress, Prog::PodIngress] {
        let (rc, out) = h.run_prog(prog, &ptb);
        assert_eq!(rc, TC_ACT_OK, "{prog:?}");
        // The ICMPv6 message right after the IPv6 header.
        assert_eq!(out[20], IPPROTO_ICMPV6, "{prog:?}");
        let o = parse_checked(&out);
        assert_eq!((o.src, o.dst), (VIP6.into(), CLIENT6.into()), "{prog:?}");
        assert_eq!(
            quoted_tuple(&o),
            tuple(CLIENT6, 40000, VIP6, 80),
            "{prog:?}"
        );
        // The inner TCP segment came whole: its checksum holds too.
        assert_eq!(
            tuple_checked(&o.quoted_frame(), L4_OFF6),
            tuple(CLIENT6, 40000, VIP6, 80)
        );
    }
    assert_eq!(delta(&h, &before, stat::ICMP_ERROR_TO_CLIENT), 2);
}

/// An error about a reply that left through a NodePort SNATed to the node
/// (a router towards the external client): translated on to the backend,
/// quoting the reply as the backend sent it (to the node's address and
/// port), from the node's address.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_error_about_a_reply_goes_on_to_the_backend() {
    let h = harness6(&[(
        fe6_ext(NODE6, 30053, IPPROTO_UDP),
        vec![be6(REMOTE6, 5353, IPPROTO_UDP)],
        0,
    )]);
    let (_, out) = h.run_prog(
        Prog::ExtIngress,
        &udp(EXT_CLIENT6, 40000, NODE6, 30053, b"query"),
    );
    let (_, nat_port, _, _) = tuple_checked(&out, L4_OFF6);
    let (_, reply) = h.run_prog(
        Prog::ExtIngress,
        &udp(REMOTE6, 5353, NODE6, nat_port, b"answer"),
    );
    assert_eq!(
        tuple_checked(&reply, L4_OFF6),
        tuple(NODE6, 30053, EXT_CLIENT6, 40000)
    );
    let router = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0xfe01);
    // Destination unreachable, its unused field as a packet too big's MTU.
    let unreach = icmp_error(router, NODE6, (1, 0), 1280, &reply, ICMP6_QUOTE);
    let (_, out) = h.run_prog(Prog::ExtIngress, &unreach);
    assert_eq!(out[20], IPPROTO_ICMPV6);
    let o = parse_checked(&out);
    assert_eq!((o.src, o.dst), (NODE6.into(), REMOTE6.into()));
    assert_eq!(quoted_tuple(&o), tuple(REMOTE6, 5353, NODE6, nat_port));
    assert_eq!(
        tuple_checked(&o.quoted_frame(), L4_OFF6),
        tuple(REMOTE6, 5353, NODE6, nat_port)
    );
}

// ------------------------------------------------------------ IPv6 fuzzing

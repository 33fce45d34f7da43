//! IPv6 (conformance D-rows at the packet level): IPv6 frames reach the
//! IPv6 programs by tail call from the IPv4 ones. The paths both families
//! share are rows of tables over [`super::FAMILIES`] (`main.rs`,
//! `lifecycle.rs`, `handover.rs`), and the fuzzer runs both families
//! (`fuzz.rs`); this file holds what only IPv6 has: extension headers
//! walked or passed, fragments, ICMPv6 errors, SCTP's CRC32c over IPv6.
//! Checksums are verified by the kit's checker over the 128-bit
//! pseudo-header.

use std::net::{IpAddr, Ipv6Addr};

use proxy_agent::model::{BackendAddr, FrontendKey};
use proxy_common::{
    conntrack::sctp as chunk, stat, Config, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP,
};

use super::delta;
use super::{B6, CLIENT6, EXT_CLIENT6, NODE6, REMOTE6, VIP6};
use proxy_testkit::kit::{
    check::{l4_csum6, parse_checked6, IPPROTO_ICMPV6},
    frame::{frame6, sctp_packet, tcp_segment, udp_segment, L4_OFF6, SYN},
    harness::{
        be as be6, desired, fe as fe6, fe_ext as fe6_ext, Harness, Prog, HAIRPIN6, TC_ACT_OK,
    },
};

fn tcp6(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, flags: u8) -> Vec<u8> {
    frame6(
        src,
        dst,
        IPPROTO_TCP,
        &[],
        tcp_segment(sport, dport, flags, b"hello"),
    )
}

fn udp6(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, payload: &[u8]) -> Vec<u8> {
    frame6(
        src,
        dst,
        IPPROTO_UDP,
        &[],
        udp_segment(sport, dport, payload),
    )
}

/// An 8-byte options header (hop-by-hop or destination options: PadN).
fn options_header() -> Vec<u8> {
    vec![0, 0, 1, 4, 0, 0, 0, 0]
}

/// (source, sport, destination, dport) of an output IPv6 frame whose L4
/// header starts at `l4`, every checksum verified by the kit's
/// [`parse_checked6`].
fn tuple6_checked(f: &[u8], l4: usize) -> (Ipv6Addr, u16, Ipv6Addr, u16) {
    let p = parse_checked6(f);
    assert_eq!(p.l4_off, l4, "where the L4 header starts");
    let v6 = |a: IpAddr| match a {
        IpAddr::V6(a) => a,
        IpAddr::V4(a) => panic!("{a} in an IPv6 frame"),
    };
    (v6(p.src), p.sport, v6(p.dst), p.dport)
}

fn harness6(frontends: &[(FrontendKey, Vec<BackendAddr>, u16)]) -> Harness {
    let mut h = Harness::new();
    h.set_config(
        Config::default()
            .with_hairpin6_addr(HAIRPIN6)
            .with_node6_addr(NODE6),
    );
    h.sync_desired(&desired(frontends, 0));
    h
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
    assert_eq!(tuple6_checked(&out, L4_OFF6), (CLIENT6, 40000, B6, 5061));
    let seg = sctp_packet(5061, 40000, chunk::INIT_ACK, &init);
    let (_, out) = h.run(&frame6(B6, CLIENT6, IPPROTO_SCTP, &[], seg));
    assert_eq!(tuple6_checked(&out, L4_OFF6), (VIP6, 5060, CLIENT6, 40000));
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
        &[(0, options_header()), (60, options_header())],
        seg(),
    );
    let (_, out) = h.run(&f);
    assert_eq!(
        tuple6_checked(&out, L4_OFF6 + 16),
        (CLIENT6, 40000, B6, 8080)
    );

    let before = h.stats();
    // A routing header: untouched.
    let routing = frame6(
        CLIENT6,
        VIP6,
        IPPROTO_TCP,
        &[(43, vec![0, 0, 0, 0, 0, 0, 0, 0])],
        seg(),
    );
    // Five options headers: more than the datapath walks.
    let deep = frame6(
        CLIENT6,
        VIP6,
        IPPROTO_TCP,
        &(0..5).map(|_| (60, options_header())).collect::<Vec<_>>(),
        seg(),
    );
    for f in [&routing, &deep] {
        let (rc, out) = h.run(f);
        assert_eq!((rc, &out), (TC_ACT_OK, f));
    }
    assert_eq!(delta(&h, &before, stat::PASS_IPV6_EXT_HEADER), 2);
}

/// A fragment header (offset field: 13 bits of offset in 8-byte units,
/// then the more-fragments bit) with identification `id`.
fn fragment_header(offset8: u16, more: bool, id: u32) -> Vec<u8> {
    let field = (offset8 << 3) | u16::from(more);
    let mut h = vec![0, 0];
    h.extend_from_slice(&field.to_be_bytes());
    h.extend_from_slice(&id.to_be_bytes());
    h
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
    let whole = udp6(CLIENT6, 33000, VIP6, 53, &payload);
    let seg = &whole[L4_OFF6..];
    let (head, tail) = seg.split_at(1232);
    let first = frame6(
        CLIENT6,
        VIP6,
        IPPROTO_UDP,
        &[(44, fragment_header(0, true, 77))],
        head.to_vec(),
    );
    let second = frame6(
        CLIENT6,
        VIP6,
        IPPROTO_UDP,
        &[(44, fragment_header(1232 / 8, false, 77))],
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
    assert_eq!(tuple6_checked(&joined, L4_OFF6), (CLIENT6, 33000, B6, 5353));
    assert_eq!(&joined[L4_OFF6 + 8..], &payload[..]);
    // The second fragment's addresses were rewritten.
    let dst2 = Ipv6Addr::from(<[u8; 16]>::try_from(&out2[38..54]).unwrap());
    assert_eq!(dst2, B6);

    let stray = frame6(
        CLIENT6,
        VIP6,
        IPPROTO_UDP,
        &[(44, fragment_header(1232 / 8, false, 78))],
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
    let other_port = tcp6(CLIENT6, 40000, VIP6, 81, SYN);
    let pod_to_pod = tcp6(CLIENT6, 40000, B6, 8080, SYN);
    // A neighbour solicitation (ICMPv6 135).
    let mut ns = vec![135, 0, 0, 0, 0, 0, 0, 0];
    ns.extend_from_slice(&B6.octets());
    let ndp = frame6(CLIENT6, B6, IPPROTO_ICMPV6, &[], ns);
    let mut truncated = tcp6(CLIENT6, 40000, VIP6, 80, SYN);
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

/// The builders above give valid checksums (the tests' own check).
#[test]
fn ipv6_test_frames_are_valid() {
    let f = tcp6(CLIENT6, 40000, VIP6, 80, SYN);
    assert_eq!(tuple6_checked(&f, L4_OFF6), (CLIENT6, 40000, VIP6, 80));
    let f = udp6(CLIENT6, 40000, VIP6, 80, b"x");
    assert_eq!(tuple6_checked(&f, L4_OFF6), (CLIENT6, 40000, VIP6, 80));
    let seg = sctp_packet(40000, 80, chunk::INIT, &[0; 16]);
    let f = frame6(CLIENT6, VIP6, IPPROTO_SCTP, &[], seg);
    assert_eq!(tuple6_checked(&f, L4_OFF6), (CLIENT6, 40000, VIP6, 80));
}

/// An ICMPv6 error of `icmp_type` from `src` to `dst`, quoting `quoted`
/// (an IPv6 packet without its Ethernet header), its checksum computed.
fn icmp6_error(src: Ipv6Addr, dst: Ipv6Addr, icmp_type: u8, quoted: &[u8]) -> Vec<u8> {
    let mut msg = vec![icmp_type, 0, 0, 0, 0, 0, 0x05, 0x00];
    msg.extend_from_slice(quoted);
    let c = l4_csum6(src, dst, IPPROTO_ICMPV6, &msg);
    msg[2..4].copy_from_slice(&c.to_be_bytes());
    frame6(src, dst, IPPROTO_ICMPV6, &[], msg)
}

/// The packet an ICMPv6 error quotes, behind the error's Ethernet header.
fn quoted_frame(f: &[u8]) -> Vec<u8> {
    let mut q = f[..14].to_vec();
    q.extend_from_slice(&f[62..]);
    q
}

/// An output ICMPv6 error: (outer source, outer destination, the inner
/// tuple), its ICMPv6 checksum verified (and the inner L4 checksum when
/// the whole inner segment is there).
fn icmp6_checked(f: &[u8]) -> (Ipv6Addr, Ipv6Addr, (Ipv6Addr, u16, Ipv6Addr, u16)) {
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&f[22..38]).unwrap());
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&f[38..54]).unwrap());
    assert_eq!(f[20], IPPROTO_ICMPV6);
    assert_eq!(
        l4_csum6(src, dst, IPPROTO_ICMPV6, &f[54..]),
        0,
        "ICMPv6 checksum"
    );
    let inner = &f[62..];
    let isrc = Ipv6Addr::from(<[u8; 16]>::try_from(&inner[8..24]).unwrap());
    let idst = Ipv6Addr::from(<[u8; 16]>::try_from(&inner[24..40]).unwrap());
    let port = |at: usize| u16::from_be_bytes([inner[40 + at], inner[41 + at]]);
    (src, dst, (isrc, port(0), idst, port(2)))
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
    let (_, out) = h.run(&tcp6(CLIENT6, 40000, VIP6, 80, SYN));
    assert_eq!(
        tuple6_checked(&out, L4_OFF6),
        (CLIENT6, 40000, REMOTE6, 8080)
    );
    let router = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0xfe01);
    let ptb = icmp6_error(router, CLIENT6, 2, &out[14..]);
    let before = h.stats();
    for prog in [Prog::ExtIngress, Prog::PodIngress] {
        let (rc, out) = h.run_prog(prog, &ptb);
        assert_eq!(rc, TC_ACT_OK, "{prog:?}");
        let (src, dst, inner) = icmp6_checked(&out);
        assert_eq!((src, dst), (VIP6, CLIENT6), "{prog:?}");
        assert_eq!(inner, (CLIENT6, 40000, VIP6, 80), "{prog:?}");
        // The inner TCP segment came whole: its checksum holds too.
        assert_eq!(
            tuple6_checked(&quoted_frame(&out), L4_OFF6),
            (CLIENT6, 40000, VIP6, 80)
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
        &udp6(EXT_CLIENT6, 40000, NODE6, 30053, b"query"),
    );
    let (_, nat_port, _, _) = tuple6_checked(&out, L4_OFF6);
    let (_, reply) = h.run_prog(
        Prog::ExtIngress,
        &udp6(REMOTE6, 5353, NODE6, nat_port, b"answer"),
    );
    assert_eq!(
        tuple6_checked(&reply, L4_OFF6),
        (NODE6, 30053, EXT_CLIENT6, 40000)
    );
    let router = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0xfe01);
    let unreach = icmp6_error(router, NODE6, 1, &reply[14..]);
    let (_, out) = h.run_prog(Prog::ExtIngress, &unreach);
    let (src, dst, inner) = icmp6_checked(&out);
    assert_eq!((src, dst), (NODE6, REMOTE6));
    assert_eq!(inner, (REMOTE6, 5353, NODE6, nat_port));
    assert_eq!(
        tuple6_checked(&quoted_frame(&out), L4_OFF6),
        (REMOTE6, 5353, NODE6, nat_port)
    );
}

// ------------------------------------------------------------ IPv6 fuzzing

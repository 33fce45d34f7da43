//! IPv6 (conformance D-rows at the packet level): IPv6 frames reach the
//! IPv6 programs by tail call from the IPv4 ones. The paths both families
//! share are rows of `main.rs`'s tables ([`super::FAMILIES`]); this file
//! holds what only IPv6 has — extension headers walked or passed,
//! fragments, ICMPv6 errors, SCTP's CRC32c over IPv6 — and the IPv6 cases
//! not yet written as rows of a shared table (conntrack expiry, the
//! kernel's masqueraded ports, the SNAT port search: their IPv4 twins read
//! the family's own maps). Checksums are
//! verified by the kit's checker over the 128-bit pseudo-header. The last
//! test fuzzes the IPv6 path as `fuzz.rs` does IPv4's: truncated,
//! malformed and mutated frames never crash a program, never leave a
//! well-formed frame to a frontend untranslated, never break one it
//! rewrites.

use std::net::{IpAddr, Ipv6Addr};

use proxy_agent::model::{BackendAddr, FrontendKey};
use proxy_common::{
    conntrack::sctp as chunk, map_names, stat, Config, Ct6Key, Ct6Value, IPPROTO_SCTP, IPPROTO_TCP,
    IPPROTO_UDP, SCOPE_EXTERNAL, SCOPE_INTERNAL,
};

use super::{delta, fuzz::Rng};
use super::{B6, B6_2, CLIENT6, EXT_CLIENT6, NODE6, REMOTE6, VIP6};
use proxy_testkit::kit::{
    check::{crc32c, fold, l4_csum6, parse_checked6, sum16, IPPROTO_ICMPV6},
    frame::{frame6, sctp_packet, tcp_segment, udp_segment, ACK, ETH_P_IPV6, L4_OFF6, SYN},
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

/// The IPv6 conntrack entries of the harness's pinned map.
fn ct6_entries(h: &Harness) -> usize {
    let ct: aya::maps::HashMap<aya::maps::MapData, Ct6Key, Ct6Value> =
        h.lru_map(map_names::CONNTRACK6);
    ct.keys().count()
}

/// The agent's garbage collector walks the IPv6 conntrack map after the
/// IPv4 one: an unanswered SYN's two entries live the SYN timeout (60 s),
/// then both are deleted; a live flow's are kept.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_conntrack_entries_expire_and_are_collected() {
    let h = harness6(&[(
        fe6(VIP6, 80, IPPROTO_TCP),
        vec![be6(B6, 8080, IPPROTO_TCP)],
        0,
    )]);
    h.run(&tcp6(CLIENT6, 40000, VIP6, 80, SYN));
    assert_eq!(ct6_entries(&h), 2, "SERVICE and REPLY entries");
    let gc_ahead = |secs: u64| {
        let now = proxy_agent::bpf::ktime_ns() + secs * 1_000_000_000;
        let mut gc = proxy_agent::bpf::ConntrackGc::open(h.pin_dir()).expect("open the maps");
        let mut expired = 0;
        for _ in 0..1_000 {
            let r = gc.round(now, 1);
            expired += r.expired;
            if r.pass_done {
                return expired;
            }
        }
        panic!("no end of the pass in 1,000 rounds");
    };
    assert_eq!(gc_ahead(30), 0, "alive for 60 s");
    assert_eq!(ct6_entries(&h), 2);
    assert_eq!(gc_ahead(61), 2);
    assert_eq!(ct6_entries(&h), 0);
}

/// IPv6 twin of `a_port_the_kernel_masqueraded_is_not_given_to_a_new_flow`
/// (handover.rs): a port of the node that a flow kube-proxy masqueraded
/// holds toward its backend is not given to a new flow while its handover
/// entry lasts.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_a_port_the_kernel_masqueraded_is_not_given_to_a_new_flow() {
    use proxy_agent::host::handover::{port_deadline, reply_key6, KernelFlow};
    let mut h = harness6(&[(
        fe6_ext(NODE6, 30080, IPPROTO_TCP),
        vec![be6(REMOTE6, 8080, IPPROTO_TCP)],
        0,
    )]);
    let mut cfg = Config::default()
        .with_hairpin6_addr(HAIRPIN6)
        .with_node6_addr(NODE6);
    (cfg.snat_port_min, cfg.snat_port_max) = (20000, 20000);
    h.set_config(cfg);
    let kernels = KernelFlow {
        proto: IPPROTO_TCP,
        src: std::net::SocketAddr::from((EXT_CLIENT6, 41000)),
        dst: std::net::SocketAddr::from((NODE6, 30080)),
        timeout_s: 300,
        masqueraded: Some((
            std::net::SocketAddr::from((REMOTE6, 8080)),
            std::net::SocketAddr::from((NODE6, 20000)),
        )),
    };
    let k = reply_key6(&kernels).expect("a masqueraded IPv6 flow");
    let mut m: aya::maps::HashMap<aya::maps::MapData, proxy_common::Ct6Key, u64> =
        h.lru_map(map_names::HANDOVER6);
    let now = proxy_agent::bpf::ktime_ns();
    m.insert(k, port_deadline(&kernels, now), 0).unwrap();
    let before = h.stats();
    let (rc, _) = h.run_prog(
        Prog::ExtIngress,
        &tcp6(EXT_CLIENT6, 40000, NODE6, 30080, SYN),
    );
    assert_eq!(
        rc,
        super::Drop.code(Prog::ExtIngress),
        "the range's one port is the kernel's"
    );
    assert_eq!(delta(&h, &before, stat::DROP_NO_FREE_PORT), 1);

    // The kernel's entry has ended: the port is free.
    m.insert(k, now.saturating_sub(1_000_000_000), 0).unwrap();
    let (_, out) = h.run_prog(
        Prog::ExtIngress,
        &tcp6(EXT_CLIENT6, 40001, NODE6, 30080, SYN),
    );
    assert_eq!(tuple6_checked(&out, L4_OFF6), (NODE6, 20000, REMOTE6, 8080));
}

/// IPv6 twin of `the_whole_snat_range_is_searched_once_random_tries_fail`
/// (lifecycle.rs): once a new flow's random source-port tries all hit
/// ports in use, tc searches the whole SNAT range (kernels with
/// `bpf_loop`), so a flow is dropped only when no port is free; XDP hands
/// such a flow to tc. A full range drops the flow after one search, within
/// the back-off without one; a port whose flow expired is found again.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_the_whole_snat_range_is_searched_once_random_tries_fail() {
    use proxy_agent::bpf::PortSearch;
    const MIN: u16 = 20000;
    const N: u16 = 1024;
    const S: u64 = 1_000_000_000;
    let range = MIN..MIN + N;
    let mut h = harness6(&[(
        fe6_ext(NODE6, 30080, IPPROTO_TCP),
        vec![be6(REMOTE6, 8080, IPPROTO_TCP)],
        0,
    )]);
    if h.port_search() == PortSearch::RandomTries {
        eprintln!("this kernel lacks bpf_loop: random tries only (see docs/kernels.md)");
        return;
    }
    let mut cfg = Config::default()
        .with_hairpin6_addr(HAIRPIN6)
        .with_node6_addr(NODE6);
    (cfg.snat_port_min, cfg.snat_port_max) = (MIN, MIN + N - 1);
    h.set_config(cfg);
    let syn = |sport: u16| tcp6(EXT_CLIENT6, sport, NODE6, 30080, SYN);
    let drop = super::Drop.code(Prog::ExtIngress);
    let stat_of = |code: u32| h.stats().get(&code).copied().unwrap_or(0);
    let mut seen = std::collections::BTreeSet::new();
    let mut port_of = std::collections::BTreeMap::new();
    for i in 0..N - 1 {
        let (rc, out) = h.run_prog(Prog::ExtIngress, &syn(30000 + i));
        assert_ne!(rc, drop, "flow {i} dropped with {} ports free", N - i);
        let (src, sport, dst, _) = tuple6_checked(&out, L4_OFF6);
        assert_eq!((src, dst), (NODE6, REMOTE6));
        assert!(range.contains(&sport), "port {sport} outside");
        assert!(seen.insert(sport), "port {sport} given twice");
        port_of.insert(30000 + i, sport);
    }
    assert!(
        stat_of(stat::SNAT_PORT_SEARCH) > 0,
        "the tries failed at times"
    );
    let free = range.clone().find(|p| !seen.contains(p)).unwrap();

    // The last free port, through XDP: handed to tc when its tries fail.
    let last = syn(41000);
    let (rc, out) = h.run_prog(Prog::ExtXdp, &last);
    assert_ne!(
        rc,
        super::Drop.code(Prog::ExtXdp),
        "XDP dropped a flow tc can place"
    );
    let out = if rc == super::Pass.code(Prog::ExtXdp) {
        let (rc, out) = h.run_prog(Prog::ExtIngress, &last);
        assert_ne!(rc, drop, "dropped with port {free} free");
        out
    } else {
        out
    };
    assert_eq!(tuple6_checked(&out, L4_OFF6).1, free, "the one free port");
    assert_eq!(stat_of(stat::DROP_NO_FREE_PORT), 0);

    // Full: dropped after one search, and counted.
    let searches = stat_of(stat::SNAT_PORT_SEARCH);
    let (rc, _) = h.run_prog(Prog::ExtIngress, &syn(41001));
    assert_eq!(rc, drop);
    assert_eq!(stat_of(stat::DROP_NO_FREE_PORT), 1);
    assert_eq!(stat_of(stat::SNAT_PORT_SEARCH), searches + 1);
    // Within the back-off: dropped without a search.
    let (rc, _) = h.run_prog(Prog::ExtIngress, &syn(41002));
    assert_eq!(rc, drop);
    assert_eq!(stat_of(stat::DROP_NO_FREE_PORT), 2);
    assert_eq!(
        stat_of(stat::SNAT_PORT_SEARCH),
        searches + 1,
        "searched again"
    );

    // One flow expires unanswered (60 s): after the back-off a search
    // finds its port, before any garbage collection.
    super::lifecycle::wait_for_uptime();
    let expired = port_of[&30005];
    let mut ct: aya::maps::HashMap<aya::maps::MapData, Ct6Key, Ct6Value> =
        h.lru_map(map_names::CONNTRACK6);
    let all: Vec<(Ct6Key, Ct6Value)> = ct.iter().map(Result::unwrap).collect();
    let mut aged = 0;
    for (k, mut v) in all {
        let service = k.dir == proxy_common::ct_dir::SERVICE && k.sport_be == 30005u16.to_be();
        let reply = k.dir == proxy_common::ct_dir::REPLY && k.dport_be == expired.to_be();
        if service || reply {
            v.last_seen_ns = v.last_seen_ns.saturating_sub(61 * S);
            ct.insert(k, v, 0).unwrap();
            aged += 1;
        }
    }
    assert_eq!(aged, 2, "the flow's two entries");
    std::thread::sleep(std::time::Duration::from_nanos(
        proxy_common::SNAT_SEARCH_BACKOFF_NS + 50_000_000,
    ));
    let (rc, out) = h.run_prog(Prog::ExtIngress, &syn(41003));
    assert_ne!(rc, drop);
    assert_eq!(
        tuple6_checked(&out, L4_OFF6).1,
        expired,
        "the expired flow's port"
    );
    assert_eq!(stat_of(stat::DROP_NO_FREE_PORT), 2);
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

/// A well-formed IPv6 frame: Ethernet + IPv6 whose payload length agrees
/// with the frame, extension headers only hop-by-hop (first) and
/// destination options, at most [`MAX_EXT_FUZZ`] of them, each complete; no
/// fragment header; a complete TCP/UDP/SCTP header (SCTP: common header and
/// a chunk's) with a valid checksum over the pseudo-header (UDP's may not be
/// 0 over IPv6; SCTP: its CRC32c). Returns (source, sport, destination,
/// dport, proto, L4 offset) then.
fn well_formed6(f: &[u8]) -> Option<(Ipv6Addr, u16, Ipv6Addr, u16, u8, usize)> {
    if f.len() < L4_OFF6 || f[12..14] != [0x86, 0xdd] || f[14] >> 4 != 6 {
        return None;
    }
    if 14 + 40 + usize::from(u16::from_be_bytes([f[18], f[19]])) != f.len() {
        return None;
    }
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&f[22..38]).ok()?);
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&f[38..54]).ok()?);
    let mut nh = f[20];
    let mut off = L4_OFF6;
    let mut walked = 0;
    while nh == 0 || nh == 60 {
        if (nh == 0 && walked > 0) || walked == MAX_EXT_FUZZ || off + 8 > f.len() {
            return None;
        }
        let len = (usize::from(f[off + 1]) + 1) * 8;
        if off + len > f.len() {
            return None;
        }
        nh = f[off];
        off += len;
        walked += 1;
    }
    let l4 = &f[off..];
    let csum_ok = |proto: u8| {
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&src.octets());
        pseudo.extend_from_slice(&dst.octets());
        pseudo.extend_from_slice(&(l4.len() as u32).to_be_bytes());
        pseudo.extend_from_slice(&[0, 0, 0, proto]);
        fold(sum16(&pseudo) + sum16(l4)) == 0
    };
    let ok = match nh {
        IPPROTO_TCP => l4.len() >= 20 && csum_ok(nh),
        IPPROTO_UDP => {
            l4.len() >= 8
                && usize::from(u16::from_be_bytes([l4[4], l4[5]])) == l4.len()
                && l4[6..8] != [0, 0]
                && csum_ok(nh)
        }
        IPPROTO_SCTP => {
            let mut p = l4.to_vec();
            if p.len() < 16 {
                return None;
            }
            p[8..12].fill(0);
            l4[8..12] == crc32c(&p).to_le_bytes()
        }
        _ => false,
    };
    ok.then(|| {
        let port = |at: usize| u16::from_be_bytes([l4[at], l4[at + 1]]);
        (src, port(0), dst, port(2), nh, off)
    })
}

/// The extension headers a fuzzed frame may carry and still be well-formed
/// (see [`well_formed6`]); the datapath walks up to 4.
const MAX_EXT_FUZZ: usize = 3;

const LB6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0x64, 0, 0, 0, 0x50);

/// The frontends of the IPv6 fuzz: (address, port, protocol, scope).
fn fuzz_frontends6() -> Vec<(Ipv6Addr, u16, u8, u8)> {
    let (i, e) = (SCOPE_INTERNAL, SCOPE_EXTERNAL);
    vec![
        (VIP6, 80, IPPROTO_TCP, i),
        (VIP6, 53, IPPROTO_UDP, i),
        (NODE6, 30080, IPPROTO_TCP, e),
        (NODE6, 30080, IPPROTO_TCP, i),
        (LB6, 80, IPPROTO_TCP, e),
        (VIP6, 5060, IPPROTO_SCTP, i),
        (NODE6, 30060, IPPROTO_SCTP, e),
    ]
}

/// The fuzz's maps, and the harness namespace's routes and neighbours (so
/// that XDP can deliver to a remote backend and back to a client).
fn fuzz_harness6() -> Harness {
    let tcp2 = vec![be6(B6, 8080, IPPROTO_TCP), be6(B6_2, 8080, IPPROTO_TCP)];
    let h = harness6(&[
        (fe6(VIP6, 80, IPPROTO_TCP), tcp2.clone(), 0),
        (
            fe6(VIP6, 53, IPPROTO_UDP),
            vec![be6(B6, 5353, IPPROTO_UDP)],
            0,
        ),
        (
            fe6_ext(NODE6, 30080, IPPROTO_TCP),
            vec![be6(REMOTE6, 8080, IPPROTO_TCP)],
            0,
        ),
        (fe6(NODE6, 30080, IPPROTO_TCP), tcp2, 0),
        (
            fe6_ext(LB6, 80, IPPROTO_TCP),
            vec![be6(B6, 8080, IPPROTO_TCP)],
            0,
        ),
        // Port translation: the CRC32c must hold after any rewrite.
        (
            fe6(VIP6, 5060, IPPROTO_SCTP),
            vec![be6(B6, 5061, IPPROTO_SCTP), be6(B6_2, 5061, IPPROTO_SCTP)],
            0,
        ),
        (
            fe6_ext(NODE6, 30060, IPPROTO_SCTP),
            vec![be6(REMOTE6, 5061, IPPROTO_SCTP)],
            0,
        ),
    ]);
    h.wire(
        "2001:2::/48",
        &[
            ("2001:2:0:2::10", "02:00:00:00:00:bb"),
            ("2001:2:0:1::10", "02:00:00:00:00:bb"),
            ("2001:2:0:1::11", "02:00:00:00:00:bb"),
            ("2001:2:0:1::2", "02:00:00:00:00:cc"),
            ("2001:2::64", "02:00:00:00:00:cc"),
        ],
    );
    h
}

/// A well-formed IPv6 frame, to a frontend (80 %) or to something else,
/// with up to [`MAX_EXT_FUZZ`] options headers of random lengths.
fn random_valid6(rng: &mut Rng) -> Vec<u8> {
    let fes = fuzz_frontends6();
    let (dst, dport, proto, _) = if rng.chance(80) {
        fes[rng.below(fes.len() as u64) as usize]
    } else {
        (
            Ipv6Addr::new(0x2001, 2, 0, 3, 0, 0, 0, u16::from(rng.byte())),
            rng.below(65535) as u16 + 1,
            IPPROTO_TCP,
            0,
        )
    };
    let src = if rng.chance(50) { CLIENT6 } else { EXT_CLIENT6 };
    let sport = 1024 + rng.below(60000) as u16;
    let payload = rng.some_bytes(48);
    let mut ext = Vec::new();
    for k in 0..rng.below(MAX_EXT_FUZZ as u64 + 1) {
        // Hop-by-hop only first; options of 8 to 24 bytes (PadN).
        let t = if k == 0 && rng.chance(50) { 0 } else { 60 };
        let units = rng.below(3) as usize;
        let mut h = vec![0u8; (units + 1) * 8];
        h[1] = units as u8;
        h[2] = 1;
        h[3] = (h.len() - 4) as u8;
        ext.push((t, h));
    }
    let seg = if proto == IPPROTO_UDP {
        udp_segment(sport, dport, &payload)
    } else if proto == IPPROTO_SCTP {
        let chunk = [1u8, 2, 6, 7, 0, rng.byte()][rng.below(6) as usize];
        sctp_packet(sport, dport, chunk, &payload)
    } else {
        let flags = [SYN, ACK, ACK | 0x08, 0x11, 0x04, rng.byte()][rng.below(6) as usize];
        tcp_segment(sport, dport, flags, &payload)
    };
    frame6(src, dst, proto, &ext, seg)
}

/// `frame` mutated one way (or not at all).
fn mutate6(rng: &mut Rng, frame: &mut Vec<u8>) {
    match rng.below(8) {
        0 => {}
        1 => {
            let n = rng.below(frame.len() as u64) as usize;
            frame.truncate(n.max(14));
        }
        2 => {
            // An IPv6 header field: version/traffic class/flow label,
            // payload length, next header, hop limit.
            let at = 14 + [0usize, 1, 3, 4, 5, 6, 7][rng.below(7) as usize];
            frame[at] = rng.byte();
        }
        3 => {
            let at = rng.below(frame.len() as u64) as usize;
            frame[at] = rng.byte();
        }
        4 => {
            // A header inserted first: a fragment header (first or later
            // fragment), a routing header, or an options header whose
            // length runs past the frame; payload length kept consistent.
            let nh = frame[20];
            let (t, mut h) = match rng.below(4) {
                0 => (44, vec![0, 0, 0, 1, 0, 0, 0, 7]),
                1 => (44, vec![0, 0, 0, 0x20, 0, 0, 0, 7]),
                2 => (43, vec![0, 0, 0, 0, 0, 0, 0, 0]),
                _ => (60, vec![0, 200, 1, 4, 0, 0, 0, 0]),
            };
            h[0] = nh;
            frame[20] = t;
            frame.splice(L4_OFF6..L4_OFF6, h);
            let len = (frame.len() - L4_OFF6) as u16;
            frame[18..20].copy_from_slice(&len.to_be_bytes());
        }
        5 => {
            let extra = rng.some_bytes(32);
            frame.extend(extra);
            frame.push(0);
        }
        6 => {
            let et = [0x0800u16, 0x0806, 0x8100, rng.next() as u16][rng.below(4) as usize];
            frame[12..14].copy_from_slice(&et.to_be_bytes());
        }
        _ => {
            let n = 14 + rng.below(100) as usize;
            let mut f = rng.bytes(n);
            f[12..14].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
            *frame = f;
        }
    }
}

/// Packet fuzzing over IPv6, as `fuzz.rs` does over IPv4: seeded, bounded
/// runs of well-formed frames (options headers included) and mutations of
/// them (truncations, header fields, fragment and routing headers, options
/// running past the frame, stray bytes, other EtherTypes, random bytes)
/// through pod_ingress, ext_ingress, ext_xdp and pod_egress (each tail-calls
/// its IPv6 program) with real maps. Whatever the frame, the program
/// returns; a well-formed frame to a frontend never leaves tc
/// untranslated (XDP may defer to tc); a well-formed reply of a tracked
/// flow never leaves tc with the backend as its source; and every frame
/// rewritten from a well-formed one is well-formed (lengths, checksums over
/// the new pseudo-header, CRC32c). `KPR_FUZZ_SEED` replays a run.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_fuzzed_frames_are_translated_or_left_alone_never_broken() {
    let (seed, frames) = super::fuzz::seed_and_frames();
    for prog in [
        Prog::PodIngress,
        Prog::ExtIngress,
        Prog::ExtXdp,
        Prog::Egress,
    ] {
        let h = fuzz_harness6();
        let mut rng = Rng(seed ^ (prog as u64) << 8 ^ 6);
        let mut violations = Vec::new();
        let (mut translated, mut refused) = (0, 0);
        let frontend = |dst, dport, proto| {
            let scope = match prog {
                Prog::PodIngress => SCOPE_INTERNAL,
                Prog::ExtIngress => SCOPE_EXTERNAL,
                _ => return false,
            };
            fuzz_frontends6().contains(&(dst, dport, proto, scope))
        };
        h.enter(|| {
            for i in 0..frames {
                let (mut frame, reply_of) = if rng.chance(20) {
                    // A reply of a flow opened first through pod_ingress.
                    let sport = 1024 + rng.below(60000) as u16;
                    let syn = tcp6(CLIENT6, sport, VIP6, 80, SYN);
                    let b = h
                        .test_run(Prog::PodIngress, &syn)
                        .ok()
                        .and_then(|r| well_formed6(&r.frame))
                        .map(|t| t.2)
                        .filter(|b| [B6, B6_2].contains(b));
                    let Some(b) = b else { continue };
                    let flags = [SYN | ACK, ACK, ACK | 0x08, 0x11][rng.below(4) as usize];
                    (tcp6(b, 8080, CLIENT6, sport, flags), Some(b))
                } else {
                    (random_valid6(&mut rng), None)
                };
                mutate6(&mut rng, &mut frame);
                let input_ok = well_formed6(&frame);
                let run = match h.test_run(prog, &frame) {
                    Ok(r) => r,
                    Err(_) if super::fuzz::runner_refuses(&frame) => {
                        refused += 1;
                        continue;
                    }
                    Err(e) => {
                        violations.push(format!("#{i}: test run failed: {e} on {frame:02x?}"));
                        continue;
                    }
                };
                let dropped = run.retval == super::Drop.code(prog);
                if dropped || run.frame == frame {
                    if let (false, Some((_, _, dst, dport, proto, _))) = (dropped, input_ok) {
                        if reply_of.is_none() && frontend(dst, dport, proto) {
                            violations.push(format!(
                                "#{i}: {}: to frontend [{dst}]:{dport}/{proto} left untranslated: {frame:02x?}",
                                prog.name()
                            ));
                        }
                        if let Some(b) = reply_of.filter(|_| !prog.is_xdp()) {
                            violations.push(format!("#{i}: {}: reply from backend {b} left untranslated", prog.name()));
                        }
                    }
                    continue;
                }
                if input_ok.is_none() {
                    continue;
                }
                translated += 1;
                match well_formed6(&run.frame) {
                    None => violations.push(format!(
                        "#{i}: {} rewrote a well-formed frame into a broken one: {frame:02x?} -> {:02x?}",
                        prog.name(),
                        run.frame
                    )),
                    Some((src, sport, ..)) => {
                        if reply_of.is_some_and(|b| src == b && sport == 8080) {
                            violations.push(format!("#{i}: {}: reply left with the backend's source {src}", prog.name()));
                        }
                    }
                }
            }
        });
        println!(
            "{} (IPv6): {frames} frames, {translated} rewritten, {refused} refused by the runner, {} violations",
            prog.name(),
            violations.len()
        );
        assert!(
            violations.is_empty(),
            "seed {seed}, {} (IPv6): {} violations, first: {:#?}",
            prog.name(),
            violations.len(),
            &violations[..violations.len().min(5)]
        );
    }
}

/// An IPv6 flow passed to the stack while draining (the agent attaching on
/// a node kube-proxy serves) stays the stack's once draining ends.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_a_flow_passed_while_draining_stays_the_stacks_after() {
    let mut h = harness6(&[(
        fe6(VIP6, 80, IPPROTO_TCP),
        vec![be6(B6, 8080, IPPROTO_TCP)],
        0,
    )]);
    let config = Config::default()
        .with_hairpin6_addr(HAIRPIN6)
        .with_node6_addr(NODE6);
    let mut draining = config;
    draining.flags |= proxy_common::config_flags::DRAINING;
    h.set_config(draining);
    let syn = tcp6(CLIENT6, 47100, VIP6, 80, SYN);
    assert_eq!(h.run(&syn), (TC_ACT_OK, syn), "passed while draining");
    h.set_config(config);
    let before = h.stats();
    let ack = tcp6(CLIENT6, 47100, VIP6, 80, ACK);
    assert_eq!(h.run(&ack), (TC_ACT_OK, ack), "still the stack's after");
    assert_eq!(delta(&h, &before, stat::PASS_HANDOVER), 1);
    let (_, out) = h.run(&tcp6(CLIENT6, 47101, VIP6, 80, SYN));
    assert_eq!(tuple6_checked(&out, L4_OFF6), (CLIENT6, 47101, B6, 8080));
}

/// Issue 39: an IPv6 flow the kernel's conntrack translated (kube-proxy's,
/// listed by the agent in the handover map) passes untouched; a SYN on its
/// tuple is a new connection, translated.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn ipv6_handed_over_flows_pass_untouched_a_syn_does_not() {
    let h = harness6(&[(
        fe6(VIP6, 80, IPPROTO_TCP),
        vec![be6(B6, 8080, IPPROTO_TCP)],
        0,
    )]);
    let flow = |sport: u16| proxy_agent::host::handover::KernelFlow {
        proto: IPPROTO_TCP,
        src: std::net::SocketAddr::from((CLIENT6, sport)),
        dst: std::net::SocketAddr::from((VIP6, 80)),
        timeout_s: 60,
        masqueraded: None,
    };
    let mut m: aya::maps::HashMap<aya::maps::MapData, proxy_common::Ct6Key, u64> =
        h.lru_map(map_names::HANDOVER6);
    let now = proxy_agent::bpf::ktime_ns();
    for sport in [47000, 47001] {
        let f = flow(sport);
        let k = proxy_agent::host::handover::key6(&f).expect("an IPv6 flow");
        m.insert(k, proxy_agent::host::handover::deadline(&f, now), 0)
            .unwrap();
    }
    let before = h.stats();
    let frame = tcp6(CLIENT6, 47000, VIP6, 80, ACK);
    let (rc, out) = h.run(&frame);
    assert_eq!((rc, out), (TC_ACT_OK, frame), "passed untouched");
    assert_eq!(delta(&h, &before, stat::PASS_HANDOVER), 1);
    let (_, out) = h.run(&tcp6(CLIENT6, 47001, VIP6, 80, SYN));
    assert_eq!(tuple6_checked(&out, L4_OFF6), (CLIENT6, 47001, B6, 8080));
}

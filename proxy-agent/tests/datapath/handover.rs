//! Taking a node over from kube-proxy, and handing it back (issue 39):
//! flows the kernel's conntrack translated are listed in the handover map
//! and pass untouched (the kernel's entry keeps their backend), but a new
//! connection on the same tuple is the datapath's; `DRAINING` leaves new
//! flows to the stack while tracked ones stay translated. Every test runs
//! for both families, each with its own handover map.
use aya::maps::{HashMap as AyaHashMap, MapData};
use proxy_agent::host::handover::{key4, key6, KernelFlow};
use proxy_common::{config_flags, ct_dir, Ct4Key, Ct6Key, HANDOVER_REFRESH_NS};

use super::lifecycle::tcp_service_of;
use super::*;
use proxy_testkit::kit::check::tuple;
use proxy_testkit::kit::ct;
use proxy_testkit::kit::harness::{HAIRPIN6, TC_ACT_OK};

const S: u64 = 1_000_000_000;

/// `f`'s ClusterIP `vip`, TCP 80 and UDP 53, one backend `b1`.
fn service(f: &Family) -> Harness {
    let mut h = Harness::new();
    tcp_service_of(&mut h, f);
    h
}

/// The configuration every harness has (both hairpin addresses).
fn config() -> Config {
    Config::default()
        .with_hairpin_addr(HAIRPIN)
        .with_hairpin6_addr(HAIRPIN6)
}

fn draining() -> Config {
    let mut c = config();
    c.flags |= config_flags::DRAINING;
    c
}

fn handover_map(h: &Harness) -> AyaHashMap<MapData, Ct4Key, u64> {
    h.lru_map(map_names::HANDOVER)
}

fn handover6_map(h: &Harness) -> AyaHashMap<MapData, Ct6Key, u64> {
    h.lru_map(map_names::HANDOVER6)
}

/// A kernel flow `client:sport → vip:dport` of `f`, as the agent reads it.
fn kernel_flow(f: &Family, proto: u8, sport: u16, dport: u16) -> KernelFlow {
    KernelFlow {
        proto,
        src: std::net::SocketAddr::from((f.client, sport)),
        dst: std::net::SocketAddr::from((f.vip, dport)),
        timeout_s: 0,
        masqueraded: None,
    }
}

/// Lists a kernel flow of `f` in its family's handover map until `until`,
/// under the key the agent writes.
fn list(h: &Harness, f: &Family, proto: u8, sport: u16, dport: u16, until: u64) {
    let k = kernel_flow(f, proto, sport, dport);
    if let Some(k) = key4(&k) {
        handover_map(h).insert(k, until, 0).unwrap();
    } else {
        let k = key6(&k).expect("a flow of one family");
        handover6_map(h).insert(k, until, 0).unwrap();
    }
}

/// The deadline of a listed flow of `f`, if it is listed.
fn listed(h: &Harness, f: &Family, proto: u8, sport: u16, dport: u16) -> Option<u64> {
    let k = kernel_flow(f, proto, sport, dport);
    match key4(&k) {
        Some(k) => handover_map(h).get(&k, 0).ok(),
        None => handover6_map(h)
            .get(&key6(&k).expect("a flow of one family"), 0)
            .ok(),
    }
}

fn has_service_entry(h: &Harness, sport: u16) -> bool {
    ct::entries(h)
        .iter()
        .any(|e| e.dir == ct_dir::SERVICE && e.sport == sport)
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn a_handed_over_tcp_flow_passes_untouched_until_a_syn_or_its_deadline() {
    for f in &FAMILIES {
        let name = f.name;
        let h = service(f);
        let now = proxy_agent::bpf::ktime_ns();
        list(&h, f, IPPROTO_TCP, 44000, 80, now + 60 * S);
        list(&h, f, IPPROTO_TCP, 44001, 80, now + 60 * S);
        list(&h, f, IPPROTO_TCP, 44002, 80, now.saturating_sub(S));
        let before = h.stats();

        // Mid-stream packets of kube-proxy's connection: the kernel's.
        for flags in [ACK, ACK | PSH, FIN | ACK] {
            let frame = tcp(f.client, 44000, f.vip, 80, flags, b"x");
            let (rc, out) = h.run(&frame);
            assert_eq!(rc, TC_ACT_OK, "{name}");
            assert_eq!(out, frame, "{name}: passed untouched");
        }
        assert_eq!(delta(&h, &before, stat::PASS_HANDOVER), 3, "{name}");
        assert!(
            !has_service_entry(&h, 44000),
            "{name}: no conntrack entry of ours"
        );

        // The client reuses a listed port for a new connection: ours.
        let r = parse_checked(&h.run(&tcp(f.client, 44001, f.vip, 80, SYN, b"")).1);
        assert_eq!(
            (r.dst, r.dport),
            (f.b1, 8080),
            "{name}: a SYN is translated"
        );
        assert!(has_service_entry(&h, 44001), "{name}");

        // Past its deadline the entry is ignored (mid-stream, translated).
        let r = parse_checked(&h.run(&tcp(f.client, 44002, f.vip, 80, ACK, b"x")).1);
        assert_eq!((r.dst, r.dport), (f.b1, 8080), "{name}");
        assert_eq!(delta(&h, &before, stat::PASS_HANDOVER), 3, "{name}");
        assert_eq!(delta(&h, &before, stat::CT_NEW_MIDSTREAM), 1, "{name}");
    }
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn a_handed_over_udp_flow_is_renewed_by_its_packets() {
    for f in &FAMILIES {
        let name = f.name;
        let h = service(f);
        let now = proxy_agent::bpf::ktime_ns();
        list(&h, f, IPPROTO_UDP, 45000, 53, now + S);
        let frame = udp(f.client, 45000, f.vip, 53, b"q");
        let (rc, out) = h.run(&frame);
        assert_eq!((rc, out), (TC_ACT_OK, frame), "{name}: passed untouched");
        let until = listed(&h, f, IPPROTO_UDP, 45000, 53).expect("listed");
        assert!(
            until >= now + HANDOVER_REFRESH_NS,
            "{name}: the deadline moved on by the refresh: {} s left",
            until.saturating_sub(now) / S
        );
        // Another flow of the same client is ours.
        let r = parse_checked(&h.run(&udp(f.client, 45001, f.vip, 53, b"q")).1);
        assert_eq!((r.dst, r.dport), (f.b1, 5353), "{name}");
    }
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn draining_leaves_new_flows_to_the_stack_and_keeps_tracked_ones() {
    for f in &FAMILIES {
        let name = f.name;
        let mut h = service(f);
        // A connection of ours, before the drain.
        let r = parse_checked(&h.run(&tcp(f.client, 46000, f.vip, 80, SYN, b"")).1);
        assert_eq!((r.dst, r.dport), (f.b1, 8080), "{name}");
        h.set_config(draining());
        let before = h.stats();
        let r = parse_checked(&h.run(&tcp(f.client, 46000, f.vip, 80, ACK, b"x")).1);
        assert_eq!(
            (r.dst, r.dport),
            (f.b1, 8080),
            "{name}: a tracked flow stays translated"
        );
        let r = parse_checked(&h.run(&tcp(f.b1, 8080, f.client, 46000, ACK, b"y")).1);
        assert_eq!((r.src, r.sport), (f.vip, 80), "{name}: and its replies");
        for frame in [
            tcp(f.client, 46001, f.vip, 80, SYN, b""),
            udp(f.client, 46002, f.vip, 53, b"q"),
        ] {
            let (rc, out) = h.run(&frame);
            assert_eq!(
                (rc, out),
                (TC_ACT_OK, frame),
                "{name}: a new flow passes untouched"
            );
        }
        assert_eq!(delta(&h, &before, stat::PASS_DRAINING), 2, "{name}");
        assert!(!has_service_entry(&h, 46001), "{name}");
    }
}

/// A flow passed to the stack while draining stays the stack's once
/// draining ends: the agent taking a node over from kube-proxy drains while
/// it attaches and reads the kernel's table, and a connection kube-proxy
/// opened in that moment must not be translated midway (its ACK given a
/// backend of ours, reset) when the agent starts translating.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn a_flow_passed_while_draining_stays_the_stacks_after() {
    for f in &FAMILIES {
        let name = f.name;
        let mut h = service(f);
        h.set_config(draining());
        let opened = [
            tcp(f.client, 48000, f.vip, 80, SYN, b""),
            udp(f.client, 48001, f.vip, 53, b"q"),
        ];
        for frame in &opened {
            let (rc, out) = h.run(frame);
            assert_eq!(
                (rc, &out),
                (TC_ACT_OK, frame),
                "{name}: passed while draining"
            );
        }
        let now = proxy_agent::bpf::ktime_ns();
        let tcp_until = listed(&h, f, IPPROTO_TCP, 48000, 80).expect("the TCP flow listed");
        assert!(
            tcp_until >= now + 4 * 24 * 3600 * S,
            "{name}: a TCP flow stays the stack's as long as the kernel's entry: {} s",
            tcp_until.saturating_sub(now) / S
        );
        assert!(
            listed(&h, f, IPPROTO_UDP, 48001, 53).is_some(),
            "{name}: the UDP flow listed"
        );

        // Draining ends (the agent has listed the kernel's flows).
        h.set_config(config());
        let before = h.stats();
        for frame in [
            tcp(f.client, 48000, f.vip, 80, ACK, b"x"),
            tcp(f.client, 48000, f.vip, 80, ACK | PSH, b"request"),
            udp(f.client, 48001, f.vip, 53, b"q2"),
        ] {
            let (rc, out) = h.run(&frame);
            assert_eq!((rc, out), (TC_ACT_OK, frame), "{name}: still the stack's");
        }
        assert_eq!(delta(&h, &before, stat::PASS_HANDOVER), 3, "{name}");
        assert_eq!(delta(&h, &before, stat::CT_NEW_MIDSTREAM), 0, "{name}");
        assert!(!has_service_entry(&h, 48000), "{name}");
        // A new connection is ours.
        let r = parse_checked(&h.run(&tcp(f.client, 48002, f.vip, 80, SYN, b"")).1);
        assert_eq!((r.dst, r.dport), (f.b1, 8080), "{name}");
    }
}

/// A flow kube-proxy masqueraded before the takeover (a NodePort to a
/// remote backend, `--random-fully` picking a port over the datapath's SNAT
/// range) holds that port of the node toward its backend: while its
/// handover entry lasts, a new flow to the same backend is not given it
/// (the backend would take the new SYN for the old connection, and the old
/// one's replies would go to the new client). A range of one port: random
/// tries and the exhaustive search both pass it over, and the flow is
/// dropped; once the entry has ended the port is given. Both families.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn a_port_the_kernel_masqueraded_is_not_given_to_a_new_flow() {
    for f in &FAMILIES {
        masqueraded_port_is_held(f);
    }
}

fn masqueraded_port_is_held(f: &Family) {
    use proxy_agent::host::handover::{port_deadline, reply_key4, reply_key6, KernelFlow};
    use std::net::SocketAddr;
    let name = f.name;
    let h = super::lifecycle::snat_setup(f, (20000, 20000));
    let kernels = KernelFlow {
        proto: IPPROTO_TCP,
        src: SocketAddr::from((f.ext_client, 41000)),
        dst: SocketAddr::from((f.node, 30080)),
        timeout_s: 300,
        masqueraded: Some((
            SocketAddr::from((f.remote, 8080)),
            SocketAddr::from((f.node, 20000)),
        )),
    };
    // The kernel's flow holds the port until `deadline`, in its family's
    // handover map, as the agent writes it.
    let hold = |deadline: u64| match f.node {
        IpAddr::V4(_) => {
            let k = reply_key4(&kernels).expect("a masqueraded IPv4 flow");
            handover_map(&h).insert(k, deadline, 0).unwrap();
        }
        IpAddr::V6(_) => {
            let k = reply_key6(&kernels).expect("a masqueraded IPv6 flow");
            handover6_map(&h).insert(k, deadline, 0).unwrap();
        }
    };
    let now = proxy_agent::bpf::ktime_ns();
    hold(port_deadline(&kernels, now));
    let before = h.stats();
    let syn = |sport: u16| tcp(f.ext_client, sport, f.node, 30080, SYN, b"");
    let (rc, _) = h.run_prog(ExtIngress, &syn(40000));
    assert_eq!(
        rc,
        Drop.code(ExtIngress),
        "{name}: the range's one port is the kernel's"
    );
    assert_eq!(delta(&h, &before, stat::DROP_NO_FREE_PORT), 1, "{name}");

    // The kernel's entry has ended: the port is free.
    hold(now.saturating_sub(S));
    let o = parse_checked(&h.run_prog(ExtIngress, &syn(40001)).1);
    assert_eq!(
        o.tuple(),
        tuple(f.node, 20000, f.remote, 8080),
        "{name}: the port once the kernel's entry ended"
    );
}

//! Taking a node over from kube-proxy, and handing it back (issue 39):
//! flows the kernel's conntrack translated are listed in the handover map
//! and pass untouched (the kernel's entry keeps their backend), but a new
//! connection on the same tuple is the datapath's; `DRAINING` leaves new
//! flows to the stack while tracked ones stay translated.
use aya::maps::{HashMap as AyaHashMap, MapData};
use proxy_common::{config_flags, ct_dir, Ct4Key, HANDOVER_REFRESH_NS};

use super::*;
use proxy_testkit::kit::check::tuple;
use proxy_testkit::kit::harness::TC_ACT_OK;

const S: u64 = 1_000_000_000;

fn service(h: &mut Harness) {
    h.sync(&[
        (fe(VIP, 80, IPPROTO_TCP), vec![be(B1, 8080, IPPROTO_TCP)], 0),
        (fe(VIP, 53, IPPROTO_UDP), vec![be(B1, 5353, IPPROTO_UDP)], 0),
    ]);
}

fn handover_map(h: &Harness) -> AyaHashMap<MapData, Ct4Key, u64> {
    h.lru_map(map_names::HANDOVER)
}

/// The key the agent writes for a kernel flow `CLIENT:sport → VIP:dport`.
fn key(sport: u16, dport: u16, proto: u8) -> Ct4Key {
    proxy_agent::host::handover::key4(&proxy_agent::host::handover::KernelFlow {
        proto,
        src: std::net::SocketAddr::from((CLIENT, sport)),
        dst: std::net::SocketAddr::from((VIP, dport)),
        timeout_s: 0,
        masqueraded: None,
    })
    .expect("an IPv4 flow")
}

fn has_service_entry(h: &Harness, sport: u16) -> bool {
    h.maps()
        .conntrack()
        .unwrap()
        .into_iter()
        .any(|(k, _)| k.dir == ct_dir::SERVICE && k.sport_be == sport.to_be())
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn a_handed_over_tcp_flow_passes_untouched_until_a_syn_or_its_deadline() {
    let mut h = Harness::new();
    service(&mut h);
    let now = proxy_agent::bpf::ktime_ns();
    let mut m = handover_map(&h);
    m.insert(key(44000, 80, IPPROTO_TCP), now + 60 * S, 0)
        .unwrap();
    m.insert(key(44001, 80, IPPROTO_TCP), now + 60 * S, 0)
        .unwrap();
    m.insert(key(44002, 80, IPPROTO_TCP), now.saturating_sub(S), 0)
        .unwrap();
    let before = h.stats();

    // Mid-stream packets of kube-proxy's connection: the kernel's.
    for flags in [ACK, ACK | PSH, FIN | ACK] {
        let frame = tcp4(CLIENT, 44000, VIP, 80, flags, b"x");
        let (rc, out) = h.run(&frame);
        assert_eq!(rc, TC_ACT_OK);
        assert_eq!(out, frame, "passed untouched");
    }
    assert_eq!(delta(&h, &before, stat::PASS_HANDOVER), 3);
    assert!(!has_service_entry(&h, 44000), "no conntrack entry of ours");

    // The client reuses a listed port for a new connection: ours.
    let r = parse_checked(&h.run(&tcp4(CLIENT, 44001, VIP, 80, SYN, b"")).1);
    assert_eq!((r.dst, r.dport), (B1.into(), 8080), "a SYN is translated");
    assert!(has_service_entry(&h, 44001));

    // Past its deadline the entry is ignored (mid-stream, translated).
    let r = parse_checked(&h.run(&tcp4(CLIENT, 44002, VIP, 80, ACK, b"x")).1);
    assert_eq!((r.dst, r.dport), (B1.into(), 8080));
    assert_eq!(delta(&h, &before, stat::PASS_HANDOVER), 3);
    assert_eq!(delta(&h, &before, stat::CT_NEW_MIDSTREAM), 1);
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn a_handed_over_udp_flow_is_renewed_by_its_packets() {
    let mut h = Harness::new();
    service(&mut h);
    let now = proxy_agent::bpf::ktime_ns();
    let mut m = handover_map(&h);
    let k = key(45000, 53, IPPROTO_UDP);
    m.insert(k, now + S, 0).unwrap();
    let frame = udp4(CLIENT, 45000, VIP, 53, b"q");
    let (rc, out) = h.run(&frame);
    assert_eq!((rc, out), (TC_ACT_OK, frame), "passed untouched");
    let until = m.get(&k, 0).unwrap();
    assert!(
        until >= now + HANDOVER_REFRESH_NS,
        "the deadline moved on by the refresh: {} s left",
        until.saturating_sub(now) / S
    );
    // Another flow of the same client is ours.
    let r = parse_checked(&h.run(&udp4(CLIENT, 45001, VIP, 53, b"q")).1);
    assert_eq!((r.dst, r.dport), (B1.into(), 5353));
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn draining_leaves_new_flows_to_the_stack_and_keeps_tracked_ones() {
    let mut h = Harness::new();
    service(&mut h);
    // A connection of ours, before the drain.
    let r = parse_checked(&h.run(&tcp4(CLIENT, 46000, VIP, 80, SYN, b"")).1);
    assert_eq!((r.dst, r.dport), (B1.into(), 8080));
    let mut c = Config::default().with_hairpin_addr(HAIRPIN);
    c.flags |= config_flags::DRAINING;
    h.set_config(c);
    let before = h.stats();
    let r = parse_checked(&h.run(&tcp4(CLIENT, 46000, VIP, 80, ACK, b"x")).1);
    assert_eq!(
        (r.dst, r.dport),
        (B1.into(), 8080),
        "a tracked flow stays translated"
    );
    let r = parse_checked(&h.run(&tcp4(B1, 8080, CLIENT, 46000, ACK, b"y")).1);
    assert_eq!((r.src, r.sport), (VIP.into(), 80), "and its replies");
    for frame in [
        tcp4(CLIENT, 46001, VIP, 80, SYN, b""),
        udp4(CLIENT, 46002, VIP, 53, b"q"),
    ] {
        let (rc, out) = h.run(&frame);
        assert_eq!((rc, out), (TC_ACT_OK, frame), "a new flow passes untouched");
    }
    assert_eq!(delta(&h, &before, stat::PASS_DRAINING), 2);
    assert!(!has_service_entry(&h, 46001));
}

/// A flow passed to the stack while draining stays the stack's once
/// draining ends: the agent taking a node over from kube-proxy drains while
/// it attaches and reads the kernel's table, and a connection kube-proxy
/// opened in that moment must not be translated midway (its ACK given a
/// backend of ours, reset) when the agent starts translating.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn a_flow_passed_while_draining_stays_the_stacks_after() {
    let mut h = Harness::new();
    service(&mut h);
    let mut c = Config::default().with_hairpin_addr(HAIRPIN);
    c.flags |= config_flags::DRAINING;
    h.set_config(c);
    let opened = [
        tcp4(CLIENT, 48000, VIP, 80, SYN, b""),
        udp4(CLIENT, 48001, VIP, 53, b"q"),
    ];
    for frame in &opened {
        let (rc, out) = h.run(frame);
        assert_eq!((rc, &out), (TC_ACT_OK, frame), "passed while draining");
    }
    let now = proxy_agent::bpf::ktime_ns();
    let m = handover_map(&h);
    let tcp_until = m
        .get(&key(48000, 80, IPPROTO_TCP), 0)
        .expect("the TCP flow listed");
    assert!(
        tcp_until >= now + 4 * 24 * 3600 * S,
        "a TCP flow stays the stack's as long as the kernel's entry: {} s",
        tcp_until.saturating_sub(now) / S
    );
    assert!(
        m.get(&key(48001, 53, IPPROTO_UDP), 0).is_ok(),
        "the UDP flow listed"
    );

    // Draining ends (the agent has listed the kernel's flows).
    h.set_config(Config::default().with_hairpin_addr(HAIRPIN));
    let before = h.stats();
    for frame in [
        tcp4(CLIENT, 48000, VIP, 80, ACK, b"x"),
        tcp4(CLIENT, 48000, VIP, 80, ACK | PSH, b"request"),
        udp4(CLIENT, 48001, VIP, 53, b"q2"),
    ] {
        let (rc, out) = h.run(&frame);
        assert_eq!((rc, out), (TC_ACT_OK, frame), "still the stack's");
    }
    assert_eq!(delta(&h, &before, stat::PASS_HANDOVER), 3);
    assert_eq!(delta(&h, &before, stat::CT_NEW_MIDSTREAM), 0);
    assert!(!has_service_entry(&h, 48000));
    // A new connection is ours.
    let r = parse_checked(&h.run(&tcp4(CLIENT, 48002, VIP, 80, SYN, b"")).1);
    assert_eq!((r.dst, r.dport), (B1.into(), 8080));
}

/// A flow kube-proxy masqueraded before the takeover (a NodePort to a
/// remote backend, `--random-fully` picking a port over the datapath's SNAT
/// range) holds that port of the node toward its backend: while its
/// handover entry lasts, a new flow to the same backend is not given it
/// (the backend would take the new SYN for the old connection, and the old
/// one's replies would go to the new client). A range of one port: random
/// tries and the exhaustive search both pass it over, and the flow is
/// dropped; once the entry has ended the port is given.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn a_port_the_kernel_masqueraded_is_not_given_to_a_new_flow() {
    use proxy_agent::host::handover::{port_deadline, reply_key4, KernelFlow};
    let h = super::lifecycle::snat_setup((20000, 20000));
    let kernels = KernelFlow {
        proto: IPPROTO_TCP,
        src: std::net::SocketAddr::from((EXT_CLIENT, 41000)),
        dst: std::net::SocketAddr::from((NODE, 30080)),
        timeout_s: 300,
        masqueraded: Some((
            std::net::SocketAddr::from((REMOTE, 8080)),
            std::net::SocketAddr::from((NODE, 20000)),
        )),
    };
    let k = reply_key4(&kernels).expect("a masqueraded IPv4 flow");
    let mut m = handover_map(&h);
    let now = proxy_agent::bpf::ktime_ns();
    m.insert(k, port_deadline(&kernels, now), 0).unwrap();
    let before = h.stats();
    let (rc, _) = h.run_prog(ExtIngress, &tcp4(EXT_CLIENT, 40000, NODE, 30080, SYN, b""));
    assert_eq!(
        rc,
        Drop.code(ExtIngress),
        "the range's one port is the kernel's"
    );
    assert_eq!(delta(&h, &before, stat::DROP_NO_FREE_PORT), 1);

    // The kernel's entry has ended: the port is free.
    m.insert(k, now.saturating_sub(S), 0).unwrap();
    let o = parse_checked(
        &h.run_prog(ExtIngress, &tcp4(EXT_CLIENT, 40001, NODE, 30080, SYN, b""))
            .1,
    );
    assert_eq!(
        (o.src, o.sport, o.dst, o.dport),
        tuple(NODE, 20000, REMOTE, 8080)
    );
}

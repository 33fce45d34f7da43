//! Load-balancing algorithms through the real programs: Maglev picks the same
//! backend for a 5-tuple in every program and on two datapaths programmed
//! independently; round robin gives each backend its turn per CPU; source
//! hash keeps a client on one backend; Maglev's handoff forwards a flow to a
//! remote backend's node unchanged.
use std::collections::BTreeMap;

use proxy_agent::model::LbAlgorithm;
use proxy_common::ct_dir;

use super::*;

const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 9, 1);
const R2: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 11);
const R3: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 12);

/// The backend (address) the conntrack SERVICE entry of the flow from
/// `client:sport` names, if the program created one.
fn chosen(h: &Harness, client: Ipv4Addr, sport: u16) -> Option<Ipv4Addr> {
    let maps = h.maps();
    let backends = maps.programmed().expect("maps").backends;
    maps.conntrack()
        .expect("conntrack")
        .into_iter()
        .find(|(k, _)| {
            k.dir == ct_dir::SERVICE && k.saddr() == client && u16::from_be(k.sport_be) == sport
        })
        .map(|(_, v)| backends[&v.backend_id].addr())
}

/// A LoadBalancer frontend `LB_IP:80` (external and, for pods, internal
/// scope) with `alg` over three remote backends given in `order`.
fn lb_setup(alg: LbAlgorithm, order: [Ipv4Addr; 3]) -> Setup {
    let backends: Vec<_> = order.iter().map(|a| be(*a, 8080, IPPROTO_TCP)).collect();
    let mut sorted = backends.clone();
    sorted.sort();
    let mut s = Setup::new(vec![
        (fe_ext(LB_IP, 80, IPPROTO_TCP), sorted.clone(), alg.flags()),
        (fe(LB_IP, 80, IPPROTO_TCP), sorted, alg.flags()),
    ]);
    s.node = Some(NODE.into());
    s
}

/// Pins the calling thread to CPU 0 (a program run counts on its CPU).
fn pin_to_cpu0() {
    let mut set = nix::sched::CpuSet::new();
    set.set(0).expect("cpu 0");
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).expect("pin to cpu 0");
}

/// The same 5-tuples give the same backends through `pod_ingress`,
/// `ext_ingress` and `ext_xdp`, and on a second datapath whose writer got
/// the backends in the reverse order (ids differ; the table follows the
/// addresses). The flows spread over all three backends.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn maglev_picks_the_same_backend_in_every_program_and_on_two_datapaths() {
    let reversed = || {
        // Programmed in another order, with an unrelated frontend first so
        // that backend ids differ.
        let mut s = lb_setup(LbAlgorithm::Maglev, [R3, R2, REMOTE]);
        s.frontends.insert(
            0,
            (fe(VIP, 80, IPPROTO_TCP), vec![be(R3, 8080, IPPROTO_TCP)], 0),
        );
        s.harness()
    };
    // One harness per program: each must choose afresh (a conntrack entry
    // would decide otherwise).
    let runs = [
        (
            lb_setup(LbAlgorithm::Maglev, [REMOTE, R2, R3]).harness(),
            ExtIngress,
        ),
        (
            lb_setup(LbAlgorithm::Maglev, [REMOTE, R2, R3]).harness(),
            ExtXdp,
        ),
        (reversed(), ExtIngress),
        (reversed(), PodIngress),
    ];
    let mut spread: BTreeMap<Ipv4Addr, usize> = BTreeMap::new();
    for sport in 40000..40060u16 {
        let syn = tcp4(EXT_CLIENT, sport, LB_IP, 80, SYN, b"");
        let picks: Vec<Option<Ipv4Addr>> = runs
            .iter()
            .map(|(h, prog)| {
                let _ = h.run_prog(*prog, &syn);
                chosen(h, EXT_CLIENT, sport)
            })
            .collect();
        let tc = picks[0].expect("ext_ingress chose a backend");
        for (i, (_, prog)) in runs.iter().enumerate() {
            assert_eq!(
                picks[i],
                Some(tc),
                "{} (datapath {}), port {sport}",
                prog.name(),
                i / 2 + 1
            );
        }
        *spread.entry(tc).or_default() += 1;
    }
    assert_eq!(spread.len(), 3, "60 flows over 3 backends: {spread:?}");
}

/// Round robin: 300 new flows on one CPU go 100/100/100, in turn.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn round_robin_gives_each_backend_its_turn_per_cpu() {
    let h = lb_setup(LbAlgorithm::RoundRobin, [REMOTE, R2, R3]).harness();
    let picks: Vec<Ipv4Addr> = h.enter(|| {
        pin_to_cpu0();
        (0..300u16)
            .map(|i| {
                let syn = tcp4(EXT_CLIENT, 40000 + i, LB_IP, 80, SYN, b"");
                h.test_run(ExtIngress, &syn).expect("test run");
                chosen(&h, EXT_CLIENT, 40000 + i).expect("a backend")
            })
            .collect()
    });
    let mut count: BTreeMap<Ipv4Addr, usize> = BTreeMap::new();
    for p in &picks {
        *count.entry(*p).or_default() += 1;
    }
    assert_eq!(count.values().copied().collect::<Vec<_>>(), [100, 100, 100]);
    // In turn: no backend twice in a row.
    assert!(picks.windows(2).all(|w| w[0] != w[1]), "{picks:?}");
}

/// Source hash: every flow of one client to one backend; many clients
/// spread over the backends.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn source_hash_keeps_a_client_on_one_backend_and_spreads_clients() {
    let h = lb_setup(LbAlgorithm::SourceHash, [REMOTE, R2, R3]).harness();
    let mut of_client: BTreeMap<Ipv4Addr, std::collections::BTreeSet<Ipv4Addr>> = BTreeMap::new();
    for c in 0..30u8 {
        let client = Ipv4Addr::new(198, 18, 7, 10 + c);
        for sport in 40000..40010u16 {
            let _ = h.run_prog(ExtIngress, &tcp4(client, sport, LB_IP, 80, SYN, b""));
            let b = chosen(&h, client, sport).expect("a backend");
            of_client.entry(client).or_default().insert(b);
        }
    }
    assert!(of_client.values().all(|s| s.len() == 1), "{of_client:?}");
    let used: std::collections::BTreeSet<_> = of_client.values().flatten().collect();
    assert_eq!(used.len(), 3, "30 clients over 3 backends: {of_client:?}");
}

/// Maglev handoff (a load-balancer IP, Cluster policy): a new flow whose
/// backend is on another node goes there unchanged — addresses and ports as
/// the client sent them, TTL decremented, MACs of the backend's next hop —
/// and leaves no conntrack entry here. A local backend is translated here.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn maglev_handoff_sends_flows_unchanged_to_the_backends_node() {
    let flags = LbAlgorithm::Maglev.flags() | svc_flags::HANDOFF;
    let mut s = Setup::new(vec![(
        fe_ext(LB_IP, 80, IPPROTO_TCP),
        vec![be(REMOTE, 8080, IPPROTO_TCP)],
        flags,
    )]);
    s.node = Some(NODE.into());
    s.wire = Some((
        "198.18.0.0/16",
        vec![
            ("198.18.2.10", "02:00:00:00:00:bb"),
            ("198.18.0.100", "02:00:00:00:00:cc"),
        ],
    ));
    let syn = tcp4(EXT_CLIENT, 40000, LB_IP, 80, SYN, b"");
    fn no_conntrack(h: &Harness, _: &Ran) {
        assert!(h.maps().conntrack().unwrap().is_empty());
    }
    let unchanged = vec![
        Field::tuple(EXT_CLIENT, 40000, LB_IP, 80),
        Field::Ttl(63),
        Field::DstMac(MAC_BB),
    ];
    let data = tcp4(EXT_CLIENT, 40000, LB_IP, 80, ACK | PSH, b"more");
    run_cases(&[
        Case::new(
            "Maglev handoff: SYN to a LB IP, remote backend: forwarded unchanged",
            &s,
            syn.clone(),
        )
        .expect(
            ExtIngress,
            Expect::fields(Redirect, unchanged.clone())
                .stats(&[
                    (stat::FWD_HANDOFF, 1),
                    (stat::REDIRECT, 1),
                    (stat::SNAT_NODE, 0),
                ])
                .then(no_conntrack),
        )
        .expect(
            ExtXdp,
            Expect::fields(Redirect, unchanged)
                .stats(&[(stat::FWD_HANDOFF, 1), (stat::SNAT_NODE, 0)])
                .then(no_conntrack),
        ),
        Case::new(
            "Maglev handoff: a later segment, same way, still no state",
            &s,
            data,
        )
        .after(Some(ExtIngress), syn)
        .expect(
            ExtIngress,
            Expect::fields(
                Redirect,
                vec![
                    Field::tuple(EXT_CLIENT, 40000, LB_IP, 80),
                    Field::DstMac(MAC_BB),
                ],
            )
            .stats(&[(stat::FWD_HANDOFF, 2), (stat::CT_NEW_MIDSTREAM, 0)])
            .then(no_conntrack),
        ),
    ]);
    // The backend's node: the same frontend, the backend local there, so it
    // translates (DNAT only, the client's address kept).
    let mut there = s.clone();
    there.local = vec![REMOTE.into()];
    run_cases(&[Case::new(
        "Maglev handoff received: local backend, DNAT keeping the client",
        &there,
        tcp4(EXT_CLIENT, 40000, LB_IP, 80, SYN, b""),
    )
    .expect(
        ExtIngress,
        Expect::fields(
            Redirect,
            vec![Field::tuple(EXT_CLIENT, 40000, REMOTE, 8080)],
        )
        .stats(&[
            (stat::FWD_NEW, 1),
            (stat::FWD_HANDOFF, 0),
            (stat::SNAT_NODE, 0),
        ]),
    )]);
}

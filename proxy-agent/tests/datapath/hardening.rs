//! Hardening of the datapath against hostile traffic (issue 15).
use proxy_common::ratelimit::REJECT_BURST;

use super::*;

/// The ICMP reject is rate-limited per CPU: a flood of SYNs (spoofed sources)
/// to a frontend without endpoints gets a burst of rejects, then the packets
/// are dropped and counted, so the node is no unlimited reflector.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn icmp_reject_is_rate_limited_per_cpu() {
    let h = Setup::new(vec![(fe(VIP, 80, IPPROTO_TCP), vec![], 0)]).harness();
    let runs = 400u16;
    let (rejected, limited, elapsed) = h.enter(|| {
        // One CPU: one bucket.
        let mut set = nix::sched::CpuSet::new();
        set.set(0).expect("cpu 0");
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).expect("pin");
        let t = std::time::Instant::now();
        let mut rejected = 0u64;
        let mut limited = 0u64;
        for i in 0..runs {
            let src = Ipv4Addr::new(198, 18, 7, (i % 250) as u8 + 1);
            let r = h
                .test_run(PodIngress, &tcp4(src, 40000 + i, VIP, 80, SYN, b""))
                .expect("test run");
            if r.retval == Redirect.code(PodIngress) {
                rejected += 1;
            } else if r.retval == Drop.code(PodIngress) {
                limited += 1;
            }
        }
        (rejected, limited, t.elapsed())
    });
    let st = h.stats();
    println!("{runs} SYNs in {elapsed:?}: {rejected} rejected, {limited} dropped by the limit");
    assert_eq!(rejected + limited, u64::from(runs));
    assert_eq!(
        st.get(&stat::REJECT_NO_BACKEND).copied().unwrap_or(0),
        rejected
    );
    assert_eq!(
        st.get(&stat::DROP_REJECT_RATE_LIMITED)
            .copied()
            .unwrap_or(0),
        limited
    );
    // The burst, plus one per millisecond the loop took (1000/s).
    assert!(rejected >= REJECT_BURST, "{rejected} rejected");
    assert!(
        rejected <= REJECT_BURST + elapsed.as_millis() as u64 + 1,
        "{rejected} rejected in {elapsed:?}"
    );
    assert!(limited > 0, "nothing was limited");
}

/// `loadBalancerSourceRanges` filter every source of a load-balancer IP, as
/// kube-proxy's firewall chain does: external clients (ext_ingress, ext_xdp)
/// and pods (pod_ingress) outside the ranges are dropped, those inside are
/// translated.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn source_ranges_filter_pods_as_well_as_external_clients() {
    use proxy_agent::model::Frontend;
    const LB: Ipv4Addr = Ipv4Addr::new(198, 18, 9, 1);
    let allowed = Ipv4Addr::new(198, 18, 4, 7);
    let mut d = proxy_agent::model::DesiredState::default();
    for key in [fe(LB, 80, IPPROTO_TCP), fe_ext(LB, 80, IPPROTO_TCP)] {
        d.frontends.insert(
            key,
            Frontend {
                service: "default/lb".into(),
                backends: vec![be(B1, 8080, IPPROTO_TCP)],
                flags: svc_flags::SOURCE_RANGES,
                source_ranges: vec![(Ipv4Addr::new(198, 18, 4, 0).into(), 24)],
                ..Default::default()
            },
        );
    }
    for prog in Prog::ALL {
        let mut h = Harness::new();
        h.sync_desired(&d);
        for (client, sport, ok) in [
            (CLIENT, 40000, false),
            (EXT_CLIENT, 40001, false),
            (allowed, 40002, true),
        ] {
            let (rc, out) = h.run_prog(prog, &tcp4(client, sport, LB, 80, SYN, b""));
            if ok {
                // Translated (XDP, without a route, hands the translated flow
                // to tc: its conntrack entry says so).
                let ct = h.maps().conntrack().unwrap();
                assert!(
                    ct.iter().any(|(k, _)| k.saddr() == client),
                    "{}: {client} inside the ranges was not translated",
                    prog.name()
                );
                assert_ne!(rc, Drop.code(prog), "{}", prog.name());
                let _ = out;
            } else {
                assert_eq!(
                    rc,
                    Drop.code(prog),
                    "{}: {client} outside the ranges",
                    prog.name()
                );
            }
        }
        assert_eq!(
            h.stats().get(&stat::DROP_SOURCE_RANGE).copied(),
            Some(2),
            "{}",
            prog.name()
        );
    }
}

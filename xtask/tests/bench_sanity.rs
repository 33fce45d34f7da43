//! Sanity of `cargo xtask bench`: every mode (none, iptables-legacy,
//! iptables-nft, nftables, proxy-tc and its variants) delivers traffic and
//! the harness's own checks hold (spread over the backends, replies from
//! the dialled VIP, client address kept, no failed exchange) at N = 1 and
//! N = 100, with few samples; and in IPv6 (a dual-stack lab, all traffic
//! IPv6) the floor, ip6tables-legacy, nftables `ip6` and proxy-tc at N = 1;
//! and the API modes (the real kube-proxy in iptables and nftables mode,
//! the agent with `--source kubernetes`, each on a lab with a real control
//! plane) at N = 10, with every figure of theirs measured.
//! Asserts no timing; prints each run's elapsed time (CI's time is tight:
//! the IPv6 run is kept well under a minute).
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --bins && cargo test -p xtask --test bench_sanity -- --include-ignored`.

use std::sync::Mutex;
use std::time::Instant;

use xtask::bench::{run_config, Config, Family, Results};

/// The two runs one after the other (the test harness runs tests in
/// parallel threads): each lab's traffic is measured alone.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Whether to run: root, or a skip (a failure when root tests are required).
fn as_root() -> bool {
    if xtask::setup::is_root() {
        return true;
    }
    if std::env::var_os("KPR_REQUIRE_ROOT_TESTS").is_some() {
        panic!("this test needs root");
    }
    eprintln!("skipped: not root");
    false
}

/// Runs `cfg`, printing its elapsed time as `<what> took ...`.
fn run(cfg: &Config, what: &str) -> Results {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let t = Instant::now();
    let results = run_config(cfg).expect("the benchmark ran");
    eprintln!("{what} took {:?}", t.elapsed());
    results
}

/// Every mode of `cfg` has a result in each family at each N, with
/// traffic answered, programming measured, and every change reachable;
/// every check holds (see below for the kube-proxy layouts' drops).
fn assert_sane(cfg: &Config, results: &Results) {
    assert_eq!(results.results.len(), cfg.ns.len());
    for r in &results.results {
        for &family in &cfg.families {
            let modes = r.modes_of(family);
            assert_eq!(
                modes.len(),
                cfg.modes.len(),
                "N={} {}: modes {:?}",
                r.n,
                family.label(),
                modes.keys().collect::<Vec<_>>()
            );
            for m in &cfg.modes {
                let name = m.name_in(family);
                let what = format!("N={} {} {name}", r.n, family.label());
                let mr = modes
                    .get(name)
                    .unwrap_or_else(|| panic!("{what}: no result"));
                assert!(!mr.checks.is_empty(), "{what}: no checks");
                let total: usize = mr.conn.values().map(|c| c.ok).sum();
                assert!(total > 0, "{what}: no connection answered");
                if name != "none" {
                    assert!(
                        mr.prog.from_empty_s.is_some() && mr.prog.change_ms.is_some(),
                        "{what}: programming not measured"
                    );
                    assert!(
                        mr.prog.npl_all_ms.iter().all(Option::is_some),
                        "{what}: a change never became reachable"
                    );
                }
            }
        }
        for family in Family::ALL {
            if !cfg.families.contains(&family) {
                assert!(
                    r.modes_of(family).is_empty(),
                    "N={} {family:?}: not asked for",
                    r.n
                );
            }
        }
    }
    // Every check holds for this project's datapath. The kube-proxy layouts
    // and the floor run on the kernel's own conntrack, which now and then
    // loses an exchange when a busy machine reuses a 4-tuple still in
    // TIME_WAIT: their "no drops" failures are printed, not fatal; every
    // other check of theirs must hold.
    let failed = results.failed_checks();
    for f in &failed {
        println!("check failed: {f}");
    }
    let fatal: Vec<&String> = failed
        .iter()
        .filter(|f| f.contains(" proxy-") || !f.contains(": no drops: "))
        .collect();
    assert!(fatal.is_empty(), "harness checks failed:\n{fatal:#?}");
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn every_mode_delivers_and_the_checks_hold() {
    if !as_root() {
        return;
    }
    let cfg = Config::sanity();
    let results = run(&cfg, "sanity run (IPv4)");
    assert_sane(&cfg, &results);
    // The run's charts: latency and programming name every mode measured
    // (the floor has no programming), memory the agent's.
    let charts = xtask::bench::charts::render(&results).expect("the charts");
    let names: Vec<&str> = charts.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(names, ["latency.svg", "programming.svg", "memory.svg"]);
    for (file, svg) in &charts {
        for m in &cfg.modes {
            let name = m.name();
            let shown = match file.as_str() {
                "latency.svg" => true,
                "programming.svg" => name != "none",
                _ => name.starts_with("proxy-tc"),
            };
            if shown {
                assert!(svg.contains(name), "{file} has no line for {name}");
            }
        }
    }
}

/// IPv6: the floor, ip6tables-legacy, nftables `ip6` and proxy-tc at N =
/// 1, each in a dual-stack lab dialling IPv6 addresses only.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn ipv6_modes_deliver_and_the_checks_hold() {
    if !as_root() {
        return;
    }
    let cfg = Config::sanity_ipv6();
    let results = run(&cfg, "sanity run (IPv6)");
    assert_sane(&cfg, &results);
    // Its traffic was IPv6 only: the "client address kept" check compared
    // each server's view of its client with the client's IPv6 address.
    let r = &results.results[0];
    assert!(r.modes.is_empty(), "an IPv6-only run measured IPv4 modes");
    assert!(r.family_target.is_none(), "a comparison without IPv4");
}

/// The API modes at N = 10 beside the floor: every cell, and every figure
/// of theirs (from empty, change to first connection, the proxies' own
/// sync and programming histograms, CPU, peak RSS, churn CPU), so a broken
/// mode fails here rather than in a long run.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn api_modes_deliver_and_report_their_figures() {
    if !as_root() {
        return;
    }
    let cfg = Config::sanity_api();
    let results = run(&cfg, "sanity run (API modes)");
    assert_sane(&cfg, &results);
    let r = &results.results[0];
    for m in cfg.modes.iter().filter(|m| m.is_api()) {
        let mr = &r.modes[m.name()];
        let a = mr
            .api
            .as_ref()
            .unwrap_or_else(|| panic!("{}: no API figures", m.name()));
        assert!(a.sync_rules_all.count > 0.0, "{}: {a:?}", m.name());
        assert!(a.npl_changes.count > 0.0, "{}: {a:?}", m.name());
        assert!(
            a.cpu_s.is_some_and(|c| c > 0.0) && a.peak_rss.is_some_and(|x| x > 0),
            "{}: {a:?}",
            m.name()
        );
        assert!(a.churn_cpu_per_1000_s.is_some(), "{}: {a:?}", m.name());
        // Every round's pod Ready reached a connection, and the control
        // plane's memory was read.
        assert_eq!(
            a.ready_to_conn_ms.len(),
            cfg.ready_rounds,
            "{}: {a:?}",
            m.name()
        );
        assert!(
            a.ready_to_conn_ms.iter().all(|&x| x > 0.0),
            "{}: {a:?}",
            m.name()
        );
        assert!(
            a.apiserver_peak_rss.is_some_and(|x| x > 0) && a.etcd_peak_rss.is_some_and(|x| x > 0),
            "{}: {a:?}",
            m.name()
        );
        for cell in ["conn/s", "TCP RR", "UDP RR", "bulk", "host conn"] {
            let there = match cell {
                "conn/s" => mr.conn_rate.is_some(),
                "TCP RR" => mr.tcp_rr.as_ref().is_some_and(|x| x.ok > 0),
                "UDP RR" => mr.udp_rr.as_ref().is_some_and(|x| x.ok > 0),
                "bulk" => mr.bulk_bps.is_some(),
                _ => mr.host_conn.as_ref().is_some_and(|x| x.ok > 0),
            };
            assert!(there, "{}: no {cell} cell", m.name());
        }
    }
    let md = xtask::bench::report::markdown(&results);
    assert!(md.contains("Against the real kube-proxy"), "{md}");
    assert!(md.contains("Ready written → first connection"), "{md}");
}

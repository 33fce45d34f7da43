//! Sanity of `cargo xtask bench`: every mode (none, iptables-legacy,
//! iptables-nft, nftables, proxy-tc) delivers traffic and the harness's own
//! checks hold (spread over the backends, replies from the dialled VIP,
//! client address kept, no failed exchange) at N = 1 and N = 100, with few
//! samples. Asserts no timing.
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --bins && cargo test -p xtask --test bench_sanity -- --include-ignored`.

use std::time::Instant;

use xtask::bench::{run_config, Config, Mode};

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn every_mode_delivers_and_the_checks_hold() {
    if !xtask::setup::is_root() {
        if std::env::var_os("KPR_REQUIRE_ROOT_TESTS").is_some() {
            panic!("this test needs root");
        }
        eprintln!("skipped: not root");
        return;
    }
    let cfg = Config::sanity();
    let t = Instant::now();
    let results = run_config(&cfg).expect("the benchmark ran");
    eprintln!("sanity run took {:?}", t.elapsed());
    assert_eq!(results.results.len(), cfg.ns.len());
    for r in &results.results {
        for m in Mode::ALL {
            let mr = r
                .modes
                .get(m.name())
                .unwrap_or_else(|| panic!("N={} has no result for {}", r.n, m.name()));
            assert!(!mr.checks.is_empty(), "N={} {}: no checks", r.n, m.name());
            let total: usize = mr.conn.values().map(|c| c.ok).sum();
            assert!(total > 0, "N={} {}: no connection answered", r.n, m.name());
            if m != Mode::None {
                assert!(
                    mr.prog.from_empty_s.is_some() && mr.prog.change_ms.is_some(),
                    "N={} {}: programming not measured",
                    r.n,
                    m.name()
                );
                assert!(
                    mr.prog.npl_all_ms.iter().all(Option::is_some),
                    "N={} {}: a change never became reachable",
                    r.n,
                    m.name()
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

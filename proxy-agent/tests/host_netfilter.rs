//! What the agent writes to the host's netfilter (root), in a network
//! namespace of the test's own: the nftables table that keeps the kernel's
//! conntrack and NAT running while flows are handed over from kube-proxy
//! (`host::conntrack_hold`). Its effect on traffic is the lab's to show
//! (`xtask/tests/takeover.rs`). Run with `cargo xtask test` (`#[ignore]`d
//! under a plain `cargo test`).

use proxy_agent::host::{conntrack_hold, netfilter};
use proxy_testkit::kit::harness::NetNs;

/// The chains of the hold's table in this namespace.
fn hold_chains() -> Vec<String> {
    let mut c: Vec<String> = netfilter::chains()
        .expect("list chains")
        .into_iter()
        .filter(|c| c.table == conntrack_hold::TABLE)
        .map(|c| c.name)
        .collect();
    c.sort();
    c
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn the_conntrack_hold_is_one_table_replaced_in_place_and_removed() {
    let ns = NetNs::new("kpr-cth").expect("netns");
    ns.enter(|| {
        assert!(!conntrack_hold::held().unwrap());
        assert!(
            !conntrack_hold::release().unwrap(),
            "no table: nothing to remove, and no error"
        );
        conntrack_hold::hold().expect("hold");
        let once = hold_chains();
        assert_eq!(
            once,
            [
                "conntrack",
                "nat-input",
                "nat-output",
                "nat-postrouting",
                "nat-prerouting"
            ],
            "one regular chain and an empty nat chain per NAT hook"
        );
        assert!(conntrack_hold::held().unwrap());
        // An agent that restarts holds again: the table is replaced, not
        // doubled (nor refused).
        conntrack_hold::hold().expect("hold again");
        assert_eq!(hold_chains(), once);
        assert!(conntrack_hold::release().unwrap());
        assert!(!conntrack_hold::held().unwrap());
        assert!(hold_chains().is_empty());
    });
    // What an operator sees: the rule (a lone `ct state` load, which nft
    // cannot print) by its comment, and the empty nat chains.
    ns.enter(|| conntrack_hold::hold().expect("hold"));
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns.name(), "nft", "list", "table", "inet"])
        .arg(conntrack_hold::TABLE)
        .output()
        .expect("run nft");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "nft list table: {out:?}");
    assert_eq!(text.matches(conntrack_hold::COMMENT).count(), 1, "{text}");
    assert_eq!(text.matches("type nat hook").count(), 4, "{text}");
    assert_eq!(text.matches("policy accept").count(), 4, "{text}");
}

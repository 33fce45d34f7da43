//! Lab tests of NetworkPolicy safety (issue 15): with `deliveryMode: stack`
//! a real netfilter FORWARD rule that denies pod A → pod B (iptables, and
//! nftables) also denies A → B's ClusterIP, locally and to a backend on
//! another node, as with kube-proxy, whose DNAT comes before the filter;
//! `deliveryMode: auto` turns to the stack when a policy engine's chains
//! appear; `redirect` bypasses the host's filters (the fast path, documented).
//!
//! Rules are added only inside the lab node's own network namespace.
//!
//! Run as root: `cargo xtask test`, or
//! `cargo test -p xtask --test lab_policy -- --include-ignored --test-threads=2`.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::Command;
use std::time::{Duration, Instant};

use xtask::Lab;

mod support;
use support::fixtures::{manifests, Pod, Port, Svc};
use support::LabTest;

fn yaml() -> String {
    manifests(&[
        &Pod::new("guarded-1", "guarded")
            .node("node-1")
            .port(80, "TCP"),
        &Svc::new("guarded")
            .selector("guarded")
            .port(Port::tcp("t", 80)),
        &Pod::new("far-1", "far").node("node-2").port(80, "TCP"),
        &Svc::new("far").selector("far").port(Port::tcp("t", 80)),
        &Pod::new("open-1", "open").node("node-1").port(80, "TCP"),
        &Svc::new("open").selector("open").port(Port::tcp("t", 80)),
    ])
}

/// Runs `f` in a two-node lab with [`yaml`], `args` appended to every
/// agent's command line.
fn with_lab(test: &str, args: &[&str], f: impl FnOnce(&mut Lab)) {
    LabTest::new(test).nodes(2).yaml(&yaml()).args(args).run(f)
}

/// Runs `cmd args` in the network namespace of lab node `node`.
fn in_node(lab: &Lab, node: &str, cmd: &str, args: &[&str]) {
    let ns = &lab.node_named(node).expect("node").netns;
    xtask::netns::run(
        Command::new("ip")
            .args(["netns", "exec", ns, cmd])
            .args(args),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
}

fn pod_ip(lab: &Lab, name: &str) -> Ipv4Addr {
    lab.pod(name).unwrap_or_else(|| panic!("pod {name}")).ip
}

fn vip(lab: &Lab, service: &str) -> SocketAddrV4 {
    support::frontend(lab, service, 80, "TCP")
}

fn answered(lab: &Lab, to: SocketAddrV4, by: &str, what: &str) {
    support::assert_answered_by(&lab.client().netns, to, "TCP", 5, &[by], what);
}

fn dropped(lab: &Lab, to: SocketAddrV4, what: &str) {
    support::assert_tcp_dropped(&lab.client().netns, to, 2, what);
}

/// An iptables rule denying the client → `pod`, on node-1 (the client's).
fn iptables_deny(lab: &Lab, op: &str, pod: &str) {
    let (a, b) = (lab.client().ip.to_string(), pod_ip(lab, pod).to_string());
    in_node(
        lab,
        "node-1",
        "iptables",
        &[op, "FORWARD", "-s", &a, "-d", &b, "-j", "DROP"],
    );
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn stack_delivery_lets_forward_rules_deny_service_traffic() {
    with_lab("policy_stack", &["--delivery-mode", "stack"], |lab| {
        let (guarded, far, open) = (vip(lab, "guarded"), vip(lab, "far"), vip(lab, "open"));
        answered(lab, guarded, "guarded-1", "no rule yet");
        answered(lab, far, "far-1", "no rule yet, backend on node-2");
        // iptables (the machine's iptables: nf_tables or legacy).
        iptables_deny(lab, "-I", "guarded-1");
        iptables_deny(lab, "-I", "far-1");
        let direct = SocketAddrV4::new(pod_ip(lab, "guarded-1"), 80);
        dropped(lab, direct, "iptables: the pod itself (the rule works)");
        dropped(lab, guarded, "iptables: through its ClusterIP");
        dropped(
            lab,
            far,
            "iptables: through a ClusterIP to another node's backend",
        );
        answered(
            lab,
            open,
            "open-1",
            "iptables: another Service is untouched",
        );
        iptables_deny(lab, "-D", "guarded-1");
        iptables_deny(lab, "-D", "far-1");
        answered(lab, guarded, "guarded-1", "rule removed");
        // nftables.
        let (a, b) = (
            lab.client().ip.to_string(),
            pod_ip(lab, "guarded-1").to_string(),
        );
        in_node(lab, "node-1", "nft", &["add", "table", "inet", "kprtest"]);
        in_node(
            lab,
            "node-1",
            "nft",
            &["add chain inet kprtest kprforward { type filter hook forward priority 0 ; }"],
        );
        in_node(
            lab,
            "node-1",
            "nft",
            &[
                "add",
                "rule",
                "inet",
                "kprtest",
                "kprforward",
                "ip",
                "saddr",
                &a,
                "ip",
                "daddr",
                &b,
                "drop",
            ],
        );
        dropped(lab, guarded, "nftables: through its ClusterIP");
        answered(
            lab,
            open,
            "open-1",
            "nftables: another Service is untouched",
        );
        in_node(
            lab,
            "node-1",
            "nft",
            &["delete", "table", "inet", "kprtest"],
        );
        answered(lab, guarded, "guarded-1", "nftables table removed");
    });
}

/// `redirect` is the fast path and never meets FORWARD: the same rule does
/// not stop Service traffic. This is the bypass `stack` and `auto` exist
/// for; the test shows the rule test above can fail.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn redirect_delivery_bypasses_forward_rules() {
    with_lab("policy_redirect", &["--delivery-mode", "redirect"], |lab| {
        let guarded = vip(lab, "guarded");
        iptables_deny(lab, "-I", "guarded-1");
        let direct = SocketAddrV4::new(pod_ip(lab, "guarded-1"), 80);
        dropped(lab, direct, "the pod itself");
        answered(
            lab,
            guarded,
            "guarded-1",
            "redirect: the ClusterIP bypasses FORWARD",
        );
    });
}

/// `auto` (the default): redirect while no policy engine is there; once a
/// Calico chain appears in the node's iptables, the agent turns to the
/// stack within a sync period, and the rule applies to Service traffic.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn auto_delivery_turns_to_the_stack_when_a_policy_engine_appears() {
    with_lab("policy_auto", &["--sync-period", "2s"], |lab| {
        let guarded = vip(lab, "guarded");
        iptables_deny(lab, "-I", "guarded-1");
        answered(
            lab,
            guarded,
            "guarded-1",
            "auto without an engine: redirect",
        );
        in_node(lab, "node-1", "iptables", &["-N", "cali-FORWARD"]);
        let t = Instant::now();
        loop {
            let log = lab.agent_log_on("node-1").unwrap_or_default();
            if log.contains("delivery=\"stack\"") || log.contains("delivery=stack") {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the agent did not turn to the stack: {}",
                log.lines().rev().take(20).collect::<Vec<_>>().join("\n")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        println!("auto: stack after {} ms", t.elapsed().as_millis());
        dropped(
            lab,
            guarded,
            "auto with Calico's chains: through its ClusterIP",
        );
        answered(
            lab,
            vip(lab, "open"),
            "open-1",
            "another Service is untouched",
        );
    });
}

/// Host clients under `stack` (issue 42): the node's own UDP to a
/// ClusterIP is aimed at its backend by the socket hooks, not translated
/// per packet on the host-client device (which delivers by redirect), so it
/// leaves through the host's OUTPUT path with the backend's address, where
/// a policy engine's netfilter rule sees it; a rule denying node → pod
/// stops it through the ClusterIP too. Under `redirect` the same socket's
/// datagrams are translated per packet (counted), past such a rule.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn stack_delivery_leaves_host_udp_to_the_output_path() {
    let yaml = manifests(&[
        &Pod::new("dnsu-1", "dnsu").node("node-1").port(53, "UDP"),
        &Svc::new("dnsu").selector("dnsu").port(Port::udp("u", 53)),
    ]);
    for mode in ["stack", "redirect"] {
        let name = format!("policy_host_udp_{mode}");
        LabTest::new(&name)
            .nodes(1)
            .yaml(&yaml)
            .args(&["--delivery-mode", mode])
            .run(|lab| {
                let vip = support::frontend(lab, "dnsu", 53, "UDP");
                let pod = pod_ip(lab, "dnsu-1").to_string();
                let mut c = lab.host_client("node-1").expect("host client");
                let ask = |c: &mut xtask::HostClient, name: &str| {
                    c.udp_connect(name, vip).expect("open");
                    c.udp_send(name, "hostname").expect("send")
                };
                let r = ask(&mut c, "before");
                assert_eq!(r.text(), Some("dnsu-1"), "{mode}: no rule yet: {r:?}");
                let rule = |op: &str| {
                    in_node(
                        lab,
                        "node-1",
                        "iptables",
                        &[op, "OUTPUT", "-p", "udp", "-d", &pod, "-j", "DROP"],
                    )
                };
                rule("-I");
                let r = ask(&mut c, "denied");
                rule("-D");
                let per_packet = support::stat(lab, "node-1", "sock_per_packet");
                if mode == "stack" {
                    // A datagram the host's OUTPUT path drops fails its
                    // send() with EPERM.
                    assert_eq!(r.error_kind(), Some("denied"), "{mode}: OUTPUT rule: {r:?}");
                    assert_eq!(per_packet, 0, "{mode}: nothing left to the per-packet path");
                } else {
                    assert_eq!(
                        r.text(),
                        Some("dnsu-1"),
                        "{mode}: past the OUTPUT rule: {r:?}"
                    );
                    assert!(per_packet >= 2, "{mode}: per-packet UDP: {per_packet}");
                }
                let r = ask(&mut c, "after");
                assert_eq!(r.text(), Some("dnsu-1"), "{mode}: rule removed: {r:?}");
            });
    }
}

//! Multi-node lab tests: several node namespaces on a switch, one agent per
//! node, pods and clients spread over the nodes. Each test is named after a
//! row of `../shared/conformance/` (from the repository root, as in the
//! README: service-behaviours.md, field-bugs.md) and builds its own lab, torn
//! down at the end, also on failure.
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --bins && cargo test -p xtask --test lab_multinode -- --include-ignored --test-threads=2`.
//!
//! On failure every node's agent log tail and `proxy-agent inspect
//! services|stats|conntrack` of every node are printed before the lab is torn
//! down; `KPR_LAB_DIAG=1` prints them after every test.
//!
//! Not covered here: the NodePort / externalIP / load-balancer rows (S34,
//! S37, S38, S42, ...) are in `lab_northsouth.rs`. Not covered by the lab
//! tests (they need what is not built yet, or are not proxy behaviour): TP*,
//! the NodePort and LB parts of P2, hostNetwork clients and backends (S32,
//! S33: host-originated traffic), service-behaviours K1/K2 (CLOSE_WAIT
//! sysctl, iptables metric).

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use xtask::client::{self, reply_text};

mod support;
use support::fixtures::{manifests, Ep, Pod, Port, Slice, Svc};
use support::flows::{self, Placement};
use support::{
    assert_answered_by, assert_tcp_dropped, client_on, delete_pod, frontend, synced, LabTest, T,
};

/// Connections per client when checking which pods answer.
const N: usize = 30;

// ================================================================ tests

/// Cross-node basics: a Service whose only pod is on node-2, reached from the
/// client on node-1 through the ClusterIP, over TCP and UDP; the pod sees the
/// client's own address (no SNAT across nodes, as S4). Needs the reply's
/// reverse NAT on node-1's external device.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn cross_node_cluster_ip_reaches_pod_on_other_node() {
    let yaml = manifests(&[
        &Svc::new("web").selector("web").port(Port::tcp("p", 80)),
        &Svc::new("webu").selector("web").port(Port::udp("p", 80)),
        &Pod::new("web-2", "web").node("node-2").port(80, "TCP"),
    ]);
    LabTest::new("cross-node").nodes(2).yaml(&yaml).run(|lab| {
        let ns = lab.client().netns.clone();
        let vip = frontend(lab, "web", 80, "TCP");
        assert_answered_by(
            &ns,
            vip,
            "TCP",
            10,
            &["web-2"],
            "cross-node TCP from node-1",
        );
        let peer = client::tcp_request(&ns, vip, b"clientip\n", T).map(|r| reply_text(&r));
        let want = format!("{}:", lab.client().ip);
        assert!(
            matches!(&peer, Ok(p) if p.starts_with(&want)),
            "cross-node: web-2 saw the client as {peer:?}, expected {want}*"
        );
        let uvip = frontend(lab, "webu", 80, "UDP");
        let u = client::udp_request(&ns, uvip, b"hostname", T, None).map(|r| reply_text(&r));
        assert!(
            matches!(&u, Ok(n) if n == "web-2"),
            "cross-node UDP from node-1 to {uvip}: {u:?}"
        );
    });
}

/// S31 — should respect internalTrafficPolicy=Local Pod to Pod: iTP=Local,
/// pods on node-1 and node-2: "node0 client always reaches the webserver"
/// (only its own node's), and a node without a local endpoint "always
/// fails" — kube-proxy drops (hasAnyEndpoints with an empty reachable list),
/// so the connect times out rather than being refused.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s31_internal_traffic_policy_local_pod_to_pod() {
    let yaml = manifests(&[
        &Svc::new("web")
            .selector("web")
            .internal_traffic_policy("Local")
            .port(Port::tcp("p", 80)),
        &Pod::new("web-n1", "web").node("node-1").port(80, "TCP"),
        &Pod::new("web-n2", "web").node("node-2").port(80, "TCP"),
    ]);
    LabTest::new("s31").nodes(3).yaml(&yaml).run(|lab| {
        let vip = frontend(lab, "web", 80, "TCP");
        let c1 = client_on(lab, "node-1").netns;
        let c2 = client_on(lab, "node-2").netns;
        let c3 = client_on(lab, "node-3").netns;
        assert_answered_by(&c1, vip, "TCP", N, &["web-n1"], "S31 client on node-1");
        assert_answered_by(&c2, vip, "TCP", N, &["web-n2"], "S31 client on node-2");
        assert_tcp_dropped(&c3, vip, 3, "S31 client on node-3 (no local endpoint)");
    });
}

/// S36 — should fallback to local terminating endpoints when there are no
/// ready endpoints with internalTrafficPolicy=Local. Slices written directly:
/// the endpoint on node-1 is ready=false serving=true terminating=true, the
/// one on node-2 ready. From node-1, traffic goes to the local terminating
/// endpoint (local fallback), not to the remote ready one; from node-2 to its
/// own ready one. Then, as the row itself: only the terminating endpoint on
/// node-1 is left: node-1 still reaches it, node-2 "always fails" (drop).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s36_itp_local_falls_back_to_local_terminating_endpoint() {
    let yaml = manifests(&[
        &Svc::new("web")
            .internal_traffic_policy("Local")
            .port(Port::tcp("p", 80)),
        &Pod::new("term-n1", "backend")
            .node("node-1")
            .port(80, "TCP"),
        &Pod::new("ready-n2", "backend")
            .node("node-2")
            .port(80, "TCP"),
    ]);
    LabTest::new("s36").nodes(2).yaml(&yaml).run(|lab| {
        let vip = frontend(lab, "web", 80, "TCP");
        let term = Ep::of(lab, "term-n1").terminating_serving();
        let ready = Ep::of(lab, "ready-n2");
        lab.apply(
            &Slice::new("web-1", "web")
                .port("p", 80, "TCP")
                .endpoints(&[term.clone(), ready])
                .yaml(),
        )
        .unwrap();
        synced(lab);
        let c1 = client_on(lab, "node-1").netns;
        let c2 = client_on(lab, "node-2").netns;
        assert_answered_by(
            &c1,
            vip,
            "TCP",
            N,
            &["term-n1"],
            "S36 client on node-1 (local terminating)",
        );
        assert_answered_by(
            &c2,
            vip,
            "TCP",
            N,
            &["ready-n2"],
            "S36 client on node-2 (local ready)",
        );

        lab.apply(
            &Slice::new("web-1", "web")
                .port("p", 80, "TCP")
                .endpoints(&[term])
                .yaml(),
        )
        .unwrap();
        synced(lab);
        assert_answered_by(
            &c1,
            vip,
            "TCP",
            N,
            &["term-n1"],
            "S36 only terminating left, client on node-1",
        );
        assert_tcp_dropped(
            &c2,
            vip,
            3,
            "S36 only terminating left on node-1, client on node-2",
        );
    });
}

/// K1 across nodes — UDP flow keeps using a deleted endpoint: both endpoints
/// on node-2, the client on node-1, D on node-3; see
/// [`flows::k1_udp_flow_leaves_deleted_endpoint`].
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn k1_udp_flow_leaves_deleted_endpoint_on_other_node() {
    let yaml = manifests(&[
        &Svc::new("statsd")
            .selector("statsd")
            .port(Port::udp("p", 8125)),
        &Pod::new("pod-a", "statsd").node("node-2").port(8125, "UDP"),
        &Pod::new("pod-b", "statsd").node("node-2").port(8125, "UDP"),
    ]);
    LabTest::new("k1-cross").nodes(3).yaml(&yaml).run(|lab| {
        flows::k1_udp_flow_leaves_deleted_endpoint(
            lab,
            &Placement {
                what: "K1 across nodes",
                bind_port: 40011,
                new_pod_node: Some("node-3"),
            },
        );
    });
}

/// K2 across nodes — UDP blackhole survives endpoints going 0→N: a client on
/// node-1, the pod appears on node-2; see [`flows::k2_udp_zero_to_one_endpoint`].
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn k2_udp_zero_to_one_endpoint_on_other_node() {
    let yaml = Svc::new("dns")
        .selector("dns")
        .port(Port::udp("p", 53))
        .yaml();
    LabTest::new("k2-cross").nodes(2).yaml(&yaml).run(|lab| {
        flows::k2_udp_zero_to_one_endpoint(
            lab,
            &Placement {
                what: "K2 across nodes",
                bind_port: 40012,
                new_pod_node: Some("node-2"),
            },
        );
    });
}

// ---------------------------------------------------------------- topology

/// T1/T3 layout: zones a, b, c with one node each; servers on node-1 (a)
/// and node-2 (b), zone hints for their own zone; clients on every node.
/// "Client A only reaches server A; client B only B; client C (no
/// local-zone server) reaches both."
fn zone_per_node(test: &str, distribution: &str) {
    let yaml = manifests(&[
        &Svc::new("web")
            .traffic_distribution(distribution)
            .port(Port::tcp("p", 80)),
        &Pod::new("server-a", "backend")
            .node("node-1")
            .port(80, "TCP"),
        &Pod::new("server-b", "backend")
            .node("node-2")
            .port(80, "TCP"),
    ]);
    let lab_test = LabTest::new(test)
        .nodes(3)
        .zones(&["zone-a", "zone-b", "zone-c"])
        .yaml(&yaml);
    lab_test.run(|lab| {
        let eps = [
            Ep::of(lab, "server-a").zone_hint(),
            Ep::of(lab, "server-b").zone_hint(),
        ];
        lab.apply(
            &Slice::new("web-1", "web")
                .port("p", 80, "TCP")
                .endpoints(&eps)
                .yaml(),
        )
        .unwrap();
        synced(lab);
        let vip = frontend(lab, "web", 80, "TCP");
        for (node, want) in [
            ("node-1", &["server-a"][..]),
            ("node-2", &["server-b"][..]),
            ("node-3", &["server-a", "server-b"][..]),
        ] {
            let c = client_on(lab, node).netns;
            assert_answered_by(&c, vip, "TCP", N, want, &format!("{test} client on {node}"));
        }
    });
}

/// T2/T4/T5 layout: 6 nodes, zone-1 = node-1,2; zone-2 = node-3,4;
/// zone-3 = node-5,6. Servers: s1a on node-1, s1b on node-2 (zone-1), s2 on
/// node-4 (zone-2). Clients on node-1, node-2 (zone-1), node-3 (zone-2) and
/// node-5 (zone-3).
fn zones_two_nodes(test: &str, distribution: &str, node_hints: bool, expect: &[(&str, &[&str])]) {
    let yaml = manifests(&[
        &Svc::new("web")
            .traffic_distribution(distribution)
            .port(Port::tcp("p", 80)),
        &Pod::new("s1a", "backend").node("node-1").port(80, "TCP"),
        &Pod::new("s1b", "backend").node("node-2").port(80, "TCP"),
        &Pod::new("s2", "backend").node("node-4").port(80, "TCP"),
    ]);
    let zones = ["zone-1", "zone-1", "zone-2", "zone-2", "zone-3", "zone-3"];
    let lab_test = LabTest::new(test).nodes(6).zones(&zones).yaml(&yaml);
    lab_test.run(|lab| {
        let eps: Vec<Ep> = ["s1a", "s1b", "s2"]
            .iter()
            .map(|p| {
                let e = Ep::of(lab, p);
                if node_hints {
                    e.node_hint()
                } else {
                    e.zone_hint()
                }
            })
            .collect();
        lab.apply(
            &Slice::new("web-1", "web")
                .port("p", 80, "TCP")
                .endpoints(&eps)
                .yaml(),
        )
        .unwrap();
        synced(lab);
        let vip = frontend(lab, "web", 80, "TCP");
        for (node, want) in expect {
            let c = client_on(lab, node).netns;
            assert_answered_by(&c, vip, "TCP", N, want, &format!("{test} client on {node}"));
        }
    });
}

/// T1 — should route traffic to an endpoint in the same zone when using
/// PreferClose.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn t1_prefer_close_same_zone() {
    zone_per_node("T1", "PreferClose");
}

/// T2 — should route traffic correctly between pods on multiple nodes when
/// using PreferClose: "zone1 clients reach both zone1 servers; zone2 client
/// reaches its zone's server; zone3 client reaches all".
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn t2_prefer_close_multiple_nodes_per_zone() {
    zones_two_nodes(
        "T2",
        "PreferClose",
        false,
        &[
            ("node-1", &["s1a", "s1b"]),
            ("node-2", &["s1a", "s1b"]),
            ("node-3", &["s2"]),
            ("node-5", &["s1a", "s1b", "s2"]),
        ],
    );
}

/// T3 — should route traffic to an endpoint in the same zone when using
/// PreferSameZone (as T1).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn t3_prefer_same_zone() {
    zone_per_node("T3", "PreferSameZone");
}

/// T4 — should route traffic correctly between pods on multiple nodes when
/// using PreferSameZone (as T2).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn t4_prefer_same_zone_multiple_nodes_per_zone() {
    zones_two_nodes(
        "T4",
        "PreferSameZone",
        false,
        &[
            ("node-1", &["s1a", "s1b"]),
            ("node-2", &["s1a", "s1b"]),
            ("node-3", &["s2"]),
            ("node-5", &["s1a", "s1b", "s2"]),
        ],
    );
}

/// T5 — should route traffic to an endpoint on the same node or fall back
/// to same zone when using PreferSameNode: "zone1: each client reaches only
/// its own node's server; zone2 client (no same-node server) falls back to
/// its zone's server; zone3 client reaches all".
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn t5_prefer_same_node_falls_back_to_zone() {
    zones_two_nodes(
        "T5",
        "PreferSameNode",
        true,
        &[
            ("node-1", &["s1a"]),
            ("node-2", &["s1b"]),
            ("node-3", &["s2"]),
            ("node-5", &["s1a", "s1b", "s2"]),
        ],
    );
}

/// T6 — should route traffic to an endpoint on the same node when using
/// PreferSameNode and fall back when the endpoint becomes unavailable: 2
/// nodes (one zone), a client and a server on each. "Each client reaches its
/// same-node server; delete server0 → both clients reach server1; recreate a
/// server on node0 → the node0 client again reaches only it." The slices are
/// rewritten as the EndpointSlice controller would (node and zone hints).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn t6_prefer_same_node_fallback_when_endpoint_unavailable() {
    let yaml = manifests(&[
        &Svc::new("web")
            .traffic_distribution("PreferSameNode")
            .port(Port::tcp("p", 80)),
        &Pod::new("server-0", "backend")
            .node("node-1")
            .port(80, "TCP"),
        &Pod::new("server-1", "backend")
            .node("node-2")
            .port(80, "TCP"),
    ]);
    let lab_test = LabTest::new("T6")
        .nodes(2)
        .zones(&["zone-a", "zone-a"])
        .yaml(&yaml);
    lab_test.run(|lab| {
        let vip = frontend(lab, "web", 80, "TCP");
        let s0 = Ep::of(lab, "server-0").node_hint();
        let s1 = Ep::of(lab, "server-1").node_hint();
        lab.apply(
            &Slice::new("web-1", "web")
                .port("p", 80, "TCP")
                .endpoints(&[s0, s1.clone()])
                .yaml(),
        )
        .unwrap();
        synced(lab);
        let c1 = client_on(lab, "node-1").netns;
        let c2 = client_on(lab, "node-2").netns;
        assert_answered_by(&c1, vip, "TCP", N, &["server-0"], "T6 client on node-1");
        assert_answered_by(&c2, vip, "TCP", N, &["server-1"], "T6 client on node-2");

        lab.apply(
            &Slice::new("web-1", "web")
                .port("p", 80, "TCP")
                .endpoints(std::slice::from_ref(&s1))
                .yaml(),
        )
        .unwrap();
        synced(lab);
        delete_pod(lab, "server-0");
        assert_answered_by(
            &c1,
            vip,
            "TCP",
            N,
            &["server-1"],
            "T6 server-0 gone, client on node-1",
        );
        assert_answered_by(
            &c2,
            vip,
            "TCP",
            N,
            &["server-1"],
            "T6 server-0 gone, client on node-2",
        );

        lab.apply(
            &Pod::new("server-0b", "backend")
                .node("node-1")
                .port(80, "TCP")
                .yaml(),
        )
        .unwrap();
        synced(lab);
        let s0b = Ep::of(lab, "server-0b").node_hint();
        lab.apply(
            &Slice::new("web-1", "web")
                .port("p", 80, "TCP")
                .endpoints(&[s0b, s1])
                .yaml(),
        )
        .unwrap();
        synced(lab);
        assert_answered_by(
            &c1,
            vip,
            "TCP",
            N,
            &["server-0b"],
            "T6 server recreated, client on node-1",
        );
        assert_answered_by(
            &c2,
            vip,
            "TCP",
            N,
            &["server-1"],
            "T6 server recreated, client on node-2",
        );
    });
}

/// P2 — internalTrafficPolicy=Local ignored for the ClusterIP (ClusterIP
/// part; no LB or NodePort yet): iTP=Local, the only endpoint on node-2.
/// From a client on node-1 the ClusterIP connect is dropped (times out
/// within ~2 s), not refused and not forwarded; from node-2 it works.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn p2_itp_local_cluster_ip_dropped_without_local_endpoint() {
    let yaml = manifests(&[
        &Svc::new("web")
            .selector("web")
            .internal_traffic_policy("Local")
            .port(Port::tcp("p", 80)),
        &Pod::new("web-n2", "web").node("node-2").port(80, "TCP"),
    ]);
    LabTest::new("p2").nodes(2).yaml(&yaml).run(|lab| {
        let vip = frontend(lab, "web", 80, "TCP");
        let c1 = client_on(lab, "node-1").netns;
        let c2 = client_on(lab, "node-2").netns;
        assert_tcp_dropped(&c1, vip, 2, "P2 client on node-1 (endpoint only on node-2)");
        assert_answered_by(&c2, vip, "TCP", 10, &["web-n2"], "P2 client on node-2");
    });
}

/// The lab itself: pods placed round-robin and by nodeName, every pod on
/// every node reachable directly from the client on node-1 and from the
/// external client (no proxy involved), addresses as documented.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn lab_multinode_layout_and_self_check() {
    let yaml = manifests(&[
        &Pod::new("rr-1", "x").port(80, "TCP"),
        &Pod::new("rr-2", "x").port(80, "TCP"),
        &Pod::new("rr-3", "x").port(80, "TCP"),
        &Pod::new("pinned", "x").node("node-3").port(80, "TCP"),
    ]);
    LabTest::new("self-check")
        .nodes(3)
        .zones(&["zone-a", "zone-b", "zone-c"])
        .yaml(&yaml)
        .run(|lab| {
            let nodes: Vec<(String, Ipv4Addr, String)> = lab
                .nodes()
                .iter()
                .map(|n| (n.name.clone(), n.ip, n.pod_cidr.clone()))
                .collect();
            assert_eq!(
                nodes,
                vec![
                    (
                        "node-1".into(),
                        Ipv4Addr::new(198, 18, 0, 10),
                        "198.18.1.0/24".into()
                    ),
                    (
                        "node-2".into(),
                        Ipv4Addr::new(198, 18, 0, 11),
                        "198.18.2.0/24".into()
                    ),
                    (
                        "node-3".into(),
                        Ipv4Addr::new(198, 18, 0, 12),
                        "198.18.3.0/24".into()
                    ),
                ]
            );
            let placed: BTreeSet<(&str, &str, Ipv4Addr)> = lab
                .pods()
                .iter()
                .map(|p| (p.name.as_str(), p.node.as_str(), p.ip))
                .collect();
            let want: BTreeSet<(&str, &str, Ipv4Addr)> = [
                ("rr-1", "node-1", Ipv4Addr::new(198, 18, 1, 10)),
                ("rr-2", "node-2", Ipv4Addr::new(198, 18, 2, 10)),
                ("rr-3", "node-3", Ipv4Addr::new(198, 18, 3, 10)),
                ("pinned", "node-3", Ipv4Addr::new(198, 18, 3, 11)),
            ]
            .into_iter()
            .collect();
            assert_eq!(
                placed, want,
                "pod placement (round-robin in file order, nodeName)"
            );
            let c3 = lab.add_client_on("c3", "node-3").unwrap();
            assert_eq!(c3.ip, Ipv4Addr::new(198, 18, 3, 3));
            assert_eq!(
                lab.external().map(|e| e.ip),
                Some(Ipv4Addr::new(198, 18, 0, 100))
            );
            xtask::self_check(lab).unwrap_or_else(|e| panic!("{e:#}"));
        });
}

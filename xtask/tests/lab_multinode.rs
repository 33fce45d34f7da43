//! Multi-node lab tests: several node namespaces on a switch, one agent per
//! node, pods and clients spread over the nodes. Each test is named after a
//! row of /work/shared/conformance (service-behaviours.md, field-bugs.md) and
//! builds its own lab, torn down at the end, also on failure.
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --bins && cargo test -p xtask --test lab_multinode -- --include-ignored --test-threads=2`.
//!
//! On failure every node's agent log tail and `proxy-agent inspect
//! services|stats|conntrack` of every node are printed before the lab is torn
//! down; `KPR_LAB_DIAG=1` prints them after every test.
//!
//! Not covered here (they need what is not built yet, or are not proxy
//! behaviour): NodePort / externalIP / load-balancer rows (S34, S37, S38,
//! S42, TP*, the NodePort and LB parts of P2), hostNetwork clients and
//! backends (S32, S33: host-originated traffic), service-behaviours K1/K2
//! (CLOSE_WAIT sysctl, iptables metric).

use std::collections::BTreeSet;
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use xtask::client::{self, reply_text};
use xtask::Lab;

mod support;
use support::{
    assert_tcp_dropped, describe, diagnostics_nodes, frontend, run_lab, wait_veth_gone, Shot,
    UdpProbe, T,
};

/// How long the agents may take to come up, or to sync a change.
const SYNC_TIMEOUT: Duration = Duration::from_secs(15);
/// Connections per client when checking which pods answer.
const N: usize = 30;

// ---------------------------------------------------------------- manifests

/// A Pod on `node` (empty: round-robin) labelled `app: <app>`, its server
/// listening on `port` (TCP and UDP).
fn pod(name: &str, app: &str, node: &str, port: u16, proto: &str) -> String {
    let node_line = if node.is_empty() {
        String::new()
    } else {
        format!("  nodeName: {node}\n")
    };
    format!(
        "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  labels:\n    app: {app}\nspec:\n{node_line}  containers:\n  - name: c\n    image: lab-server\n    ports:\n    - containerPort: {port}\n      protocol: {proto}\n"
    )
}

/// A Service. `selector` None: selector-less (endpoints come from
/// EndpointSlices written by the test). `itp`: internalTrafficPolicy;
/// `distribution`: spec.trafficDistribution (informational: kube-proxy acts
/// on the slices' hints only).
fn svc(
    name: &str,
    selector: Option<&str>,
    port: u16,
    proto: &str,
    itp: Option<&str>,
    distribution: Option<&str>,
) -> String {
    let mut y = format!("---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\nspec:\n");
    if let Some(app) = selector {
        y.push_str(&format!("  selector:\n    app: {app}\n"));
    }
    if let Some(p) = itp {
        y.push_str(&format!("  internalTrafficPolicy: {p}\n"));
    }
    if let Some(d) = distribution {
        y.push_str(&format!("  trafficDistribution: {d}\n"));
    }
    y.push_str(&format!(
        "  ports:\n  - name: p\n    port: {port}\n    targetPort: {port}\n    protocol: {proto}\n"
    ));
    y
}

/// One endpoint of an EndpointSlice written by a test.
#[derive(Clone, Debug)]
struct Ep {
    ip: Ipv4Addr,
    node: String,
    zone: Option<String>,
    ready: bool,
    serving: bool,
    terminating: bool,
    for_zones: Vec<String>,
    for_nodes: Vec<String>,
}

impl Ep {
    /// A ready endpoint at pod `name`'s IP on its node, no zone, no hints.
    fn of(lab: &Lab, name: &str) -> Ep {
        let p = lab
            .pod(name)
            .unwrap_or_else(|| panic!("no pod {name} in the lab"));
        let zone = lab.node_named(&p.node).and_then(|n| n.zone.clone());
        Ep {
            ip: p.ip,
            node: p.node.clone(),
            zone,
            ready: true,
            serving: true,
            terminating: false,
            for_zones: Vec::new(),
            for_nodes: Vec::new(),
        }
    }

    /// ready=false serving=true terminating=true.
    fn terminating(mut self) -> Ep {
        self.ready = false;
        self.serving = true;
        self.terminating = true;
        self
    }

    /// A hint for the endpoint's own zone (what the EndpointSlice controller
    /// writes for PreferClose / PreferSameZone when every zone is covered,
    /// and with per-endpoint zone hints regardless).
    fn zone_hint(mut self) -> Ep {
        self.for_zones = self.zone.iter().cloned().collect();
        self
    }

    /// Hints for the endpoint's own node and zone (PreferSameNode).
    fn node_hint(mut self) -> Ep {
        self.for_nodes = vec![self.node.clone()];
        self.zone_hint()
    }
}

/// An EndpointSlice `name` of Service `service` with port `p`.
fn slice(name: &str, service: &str, port: u16, proto: &str, eps: &[Ep]) -> String {
    let mut y = format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  labels:\n    kubernetes.io/service-name: {service}\naddressType: IPv4\nports:\n- name: p\n  port: {port}\n  protocol: {proto}\nendpoints:\n"
    );
    if eps.is_empty() {
        y = y.replace("endpoints:\n", "endpoints: []\n");
    }
    for e in eps {
        y.push_str(&format!(
            "- addresses: [\"{}\"]\n  conditions: {{ready: {}, serving: {}, terminating: {}}}\n  nodeName: {}\n",
            e.ip, e.ready, e.serving, e.terminating, e.node
        ));
        if let Some(z) = &e.zone {
            y.push_str(&format!("  zone: {z}\n"));
        }
        if !e.for_zones.is_empty() || !e.for_nodes.is_empty() {
            y.push_str("  hints:\n");
            if !e.for_zones.is_empty() {
                let zs: Vec<String> = e
                    .for_zones
                    .iter()
                    .map(|z| format!("{{name: {z}}}"))
                    .collect();
                y.push_str(&format!("    forZones: [{}]\n", zs.join(", ")));
            }
            if !e.for_nodes.is_empty() {
                let ns: Vec<String> = e
                    .for_nodes
                    .iter()
                    .map(|n| format!("{{name: {n}}}"))
                    .collect();
                y.push_str(&format!("    forNodes: [{}]\n", ns.join(", ")));
            }
        }
    }
    y
}

// ---------------------------------------------------------------- lab runner

/// Starts a lab with `nodes` nodes in `zones` and `yaml`, waits for every
/// agent's first sync and attachments, runs `f`; see [`support::run_lab`].
fn with_lab(test: &str, nodes: usize, zones: &[&str], yaml: &str, f: impl FnOnce(&mut Lab)) {
    run_lab(
        test,
        Lab::builder()
            .nodes(nodes)
            .zones(zones)
            .manifests_yaml(yaml),
        &format!(" with {nodes} nodes"),
        |lab| {
            lab.wait_ready(SYNC_TIMEOUT)
                .unwrap_or_else(|e| panic!("agents not ready: {e:#}"));
            attached(lab);
        },
        diagnostics_nodes,
        f,
    )
}

fn attached(lab: &mut Lab) {
    support::attached(lab, SYNC_TIMEOUT)
}

/// `wait_synced` on every agent after a manifest change, then attachments.
fn synced(lab: &mut Lab) {
    support::synced_nodes(lab, SYNC_TIMEOUT)
}

/// A client namespace on `node`: the default client on node-1, else a new
/// one named `client-<node>`. Returns its namespace.
fn client_on(lab: &mut Lab, node: &str) -> String {
    if node == "node-1" {
        return lab.client().netns.clone();
    }
    let name = format!("client-{node}");
    if let Some(c) = lab.client_named(&name) {
        return c.netns.clone();
    }
    let c = lab
        .add_client_on(&name, node)
        .unwrap_or_else(|e| panic!("add_client_on({name}, {node}): {e:#}"));
    attached(lab);
    c.netns
}

/// `lab.delete_pod` (waits for every agent's sync), then waits until the
/// pod's host-side veth is gone from its node (see tests/lab.rs).
fn delete_pod(lab: &mut Lab, name: &str) {
    let (host_if, node_ns) = lab
        .pod(name)
        .map(|p| {
            (
                p.host_if.clone(),
                lab.node_named(&p.node)
                    .map(|n| n.netns.clone())
                    .unwrap_or_default(),
            )
        })
        .unwrap_or_default();
    lab.delete_pod(name)
        .unwrap_or_else(|e| panic!("delete_pod({name}): {e:#}"));
    if host_if.is_empty() {
        return;
    }
    wait_veth_gone(&node_ns, &host_if, name);
}

/// Asserts that `n` connections from `ns` to `addr` all succeed and are
/// answered by exactly the pods `expected`.
fn assert_answered_by(ns: &str, addr: SocketAddrV4, n: usize, expected: &[&str], what: &str) {
    support::assert_answered_by(ns, addr, n, expected, what, true)
}

// ================================================================ tests

/// Cross-node basics: a Service whose only pod is on node-2, reached from the
/// client on node-1 through the ClusterIP, over TCP and UDP; the pod sees the
/// client's own address (no SNAT across nodes, as S4). Needs the reply's
/// reverse NAT on node-1's external device.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn cross_node_cluster_ip_reaches_pod_on_other_node() {
    let yaml = svc("web", Some("web"), 80, "TCP", None, None)
        + &svc("webu", Some("web"), 80, "UDP", None, None)
        + &pod("web-2", "web", "node-2", 80, "TCP");
    with_lab("cross-node", 2, &[], &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let vip = frontend(lab, "web", 80, "TCP");
        assert_answered_by(&ns, vip, 10, &["web-2"], "cross-node TCP from node-1");
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
    let yaml = svc("web", Some("web"), 80, "TCP", Some("Local"), None)
        + &pod("web-n1", "web", "node-1", 80, "TCP")
        + &pod("web-n2", "web", "node-2", 80, "TCP");
    with_lab("s31", 3, &[], &yaml, |lab| {
        let vip = frontend(lab, "web", 80, "TCP");
        let c1 = client_on(lab, "node-1");
        let c2 = client_on(lab, "node-2");
        let c3 = client_on(lab, "node-3");
        assert_answered_by(&c1, vip, N, &["web-n1"], "S31 client on node-1");
        assert_answered_by(&c2, vip, N, &["web-n2"], "S31 client on node-2");
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
    let yaml = svc("web", None, 80, "TCP", Some("Local"), None)
        + &pod("term-n1", "backend", "node-1", 80, "TCP")
        + &pod("ready-n2", "backend", "node-2", 80, "TCP");
    with_lab("s36", 2, &[], &yaml, |lab| {
        let vip = frontend(lab, "web", 80, "TCP");
        let term = Ep::of(lab, "term-n1").terminating();
        let ready = Ep::of(lab, "ready-n2");
        lab.apply(&slice("web-1", "web", 80, "TCP", &[term.clone(), ready]))
            .unwrap();
        synced(lab);
        let c1 = client_on(lab, "node-1");
        let c2 = client_on(lab, "node-2");
        assert_answered_by(
            &c1,
            vip,
            N,
            &["term-n1"],
            "S36 client on node-1 (local terminating)",
        );
        assert_answered_by(
            &c2,
            vip,
            N,
            &["ready-n2"],
            "S36 client on node-2 (local ready)",
        );

        lab.apply(&slice("web-1", "web", 80, "TCP", &[term]))
            .unwrap();
        synced(lab);
        assert_answered_by(
            &c1,
            vip,
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
/// on node-2, the client on node-1 sends from one socket every 100 ms.
/// "Step 1: new datagrams reach B within about 1 s. Step 2: ... the client
/// gets ICMP port-unreachable. Step 3: datagrams reach D within about 1 s"
/// (D on node-3).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn k1_udp_flow_leaves_deleted_endpoint_on_other_node() {
    let yaml = svc("statsd", Some("statsd"), 8125, "UDP", None, None)
        + &pod("pod-a", "statsd", "node-2", 8125, "UDP")
        + &pod("pod-b", "statsd", "node-2", 8125, "UDP");
    with_lab("k1-cross", 3, &[], &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let vip = frontend(lab, "statsd", 8125, "UDP");
        let probe = UdpProbe::start(
            &ns,
            vip,
            40011,
            Duration::from_millis(100),
            Duration::from_secs(30),
        );
        let origin = Instant::now();
        std::thread::sleep(Duration::from_millis(600));
        let first = probe.snapshot();
        let answered: Vec<&str> = first
            .iter()
            .filter_map(|s| s.result.as_deref().ok())
            .collect();
        println!("K1 before any change: {}", describe(&first, origin));
        if answered.len() < 3 {
            let shots = probe.finish();
            panic!(
                "K1: the flow to endpoints on node-2 was not answered before any change: {}",
                describe(&shots, origin)
            );
        }
        let x = answered[0].to_string();
        assert!(
            answered.iter().all(|a| *a == x),
            "K1: one UDP flow was answered by different pods: {answered:?}"
        );
        let y = if x == "pod-a" { "pod-b" } else { "pod-a" }.to_string();

        let t1 = Instant::now();
        delete_pod(lab, &x);
        std::thread::sleep(Duration::from_millis(1200).saturating_sub(t1.elapsed()));
        let t2 = Instant::now();
        delete_pod(lab, &y);
        std::thread::sleep(Duration::from_millis(1500).saturating_sub(t2.elapsed()));
        lab.apply(&pod("pod-d", "statsd", "node-3", 8125, "UDP"))
            .unwrap();
        let t3 = Instant::now();
        std::thread::sleep(Duration::from_millis(1500));
        let shots = probe.finish();
        println!(
            "K1 flow (ms from the first change): {}",
            describe(&shots, t1)
        );

        let step1: Vec<&Shot> = shots
            .iter()
            .filter(|s| s.sent >= t1 && s.sent < t2)
            .collect();
        let Some(reach_y) = step1.iter().find(|s| s.result.as_deref() == Ok(y.as_str())) else {
            panic!("K1 step 1: the flow never reached {y} after {x} was deleted")
        };
        let el1 = reach_y.sent - t1;
        println!(
            "K1 step 1: reached {y} {} ms after {x} was removed",
            el1.as_millis()
        );
        assert!(
            el1 < Duration::from_secs(1),
            "K1 step 1: reached {y} only after {el1:?}"
        );
        assert!(
            step1
                .iter()
                .filter(|s| s.sent >= reach_y.sent)
                .all(|s| s.result.as_deref() == Ok(y.as_str())),
            "K1 step 1: after reaching {y}, the flow did not stay there"
        );

        let step2: Vec<&Shot> = shots
            .iter()
            .filter(|s| s.sent >= t2 && s.sent < t3)
            .collect();
        let Some(refused) = step2
            .iter()
            .position(|s| s.result == Err(io::ErrorKind::ConnectionRefused))
        else {
            panic!("K1 step 2: with 0 endpoints the flow was never refused (ICMP)")
        };
        let el2 = step2[refused].sent - t2;
        println!(
            "K1 step 2: refused {} ms after the last pod was removed",
            el2.as_millis()
        );
        assert!(
            el2 < Duration::from_secs(1),
            "K1 step 2: refused only after {el2:?}"
        );
        let bad: Vec<&&Shot> = step2[refused..]
            .iter()
            .filter(|s| s.result != Err(io::ErrorKind::ConnectionRefused))
            .collect();
        assert!(
            bad.is_empty(),
            "K1 step 2: with 0 endpoints some datagrams were not refused: {bad:?}"
        );

        let Some(reach_d) = shots
            .iter()
            .filter(|s| s.sent >= t3)
            .find(|s| s.result.as_deref() == Ok("pod-d"))
        else {
            panic!("K1 step 3: the flow never reached pod-d on node-3")
        };
        let el3 = reach_d.sent - t3;
        println!(
            "K1 step 3: reached pod-d {} ms after it was added",
            el3.as_millis()
        );
        assert!(
            el3 < Duration::from_secs(1),
            "K1 step 3: reached pod-d only after {el3:?}"
        );
    });
}

/// K2 across nodes — UDP blackhole survives endpoints going 0→N: no
/// endpoint, a client on node-1 sending from a fixed source port (refused);
/// a ready pod appears on node-2: "the first datagram after the change is
/// forwarded to A, within about 1 s".
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn k2_udp_zero_to_one_endpoint_on_other_node() {
    let yaml = svc("dns", Some("dns"), 53, "UDP", None, None);
    with_lab("k2-cross", 2, &[], &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let vip = frontend(lab, "dns", 53, "UDP");
        let probe = UdpProbe::start(
            &ns,
            vip,
            40012,
            Duration::from_millis(100),
            Duration::from_secs(20),
        );
        std::thread::sleep(Duration::from_millis(500));
        lab.apply(&pod("dns-1", "dns", "node-2", 53, "UDP"))
            .unwrap();
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(2000));
        let shots = probe.finish();
        println!(
            "K2 flow (ms from the pod's addition): {}",
            describe(&shots, t)
        );
        let before: Vec<&Shot> = shots.iter().filter(|s| s.sent < t).collect();
        assert!(before.len() >= 3, "K2: too few datagrams before the change");
        assert!(
            before
                .iter()
                .all(|s| s.result == Err(io::ErrorKind::ConnectionRefused)),
            "K2: with 0 endpoints the datagrams were not all refused: {}",
            describe(&shots, t)
        );
        let after: Vec<&Shot> = shots.iter().filter(|s| s.sent >= t).collect();
        let Some(first) = after
            .iter()
            .position(|s| s.result.as_deref() == Ok("dns-1"))
        else {
            panic!("K2: the same source port never reached dns-1 on node-2 after it was added")
        };
        let el = after[first].sent - t;
        println!(
            "K2: first answer from dns-1 {} ms after the change",
            el.as_millis()
        );
        assert!(
            el < Duration::from_secs(1),
            "K2: reached dns-1 only after {el:?}"
        );
        assert!(
            after[first..]
                .iter()
                .all(|s| s.result.as_deref() == Ok("dns-1")),
            "K2: after reaching dns-1 the flow did not stay there"
        );
    });
}

// ---------------------------------------------------------------- topology

/// T1/T3 layout: zones a, b, c with one node each; servers on node-1 (a)
/// and node-2 (b), zone hints for their own zone; clients on every node.
/// "Client A only reaches server A; client B only B; client C (no
/// local-zone server) reaches both."
fn zone_per_node(test: &str, distribution: &str) {
    let yaml = svc("web", None, 80, "TCP", None, Some(distribution))
        + &pod("server-a", "backend", "node-1", 80, "TCP")
        + &pod("server-b", "backend", "node-2", 80, "TCP");
    with_lab(test, 3, &["zone-a", "zone-b", "zone-c"], &yaml, |lab| {
        let eps = [
            Ep::of(lab, "server-a").zone_hint(),
            Ep::of(lab, "server-b").zone_hint(),
        ];
        lab.apply(&slice("web-1", "web", 80, "TCP", &eps)).unwrap();
        synced(lab);
        let vip = frontend(lab, "web", 80, "TCP");
        for (node, want) in [
            ("node-1", &["server-a"][..]),
            ("node-2", &["server-b"][..]),
            ("node-3", &["server-a", "server-b"][..]),
        ] {
            let c = client_on(lab, node);
            assert_answered_by(&c, vip, N, want, &format!("{test} client on {node}"));
        }
    });
}

/// T2/T4/T5 layout: 6 nodes, zone-1 = node-1,2; zone-2 = node-3,4;
/// zone-3 = node-5,6. Servers: s1a on node-1, s1b on node-2 (zone-1), s2 on
/// node-4 (zone-2). Clients on node-1, node-2 (zone-1), node-3 (zone-2) and
/// node-5 (zone-3).
fn zones_two_nodes(test: &str, distribution: &str, node_hints: bool, expect: &[(&str, &[&str])]) {
    let yaml = svc("web", None, 80, "TCP", None, Some(distribution))
        + &pod("s1a", "backend", "node-1", 80, "TCP")
        + &pod("s1b", "backend", "node-2", 80, "TCP")
        + &pod("s2", "backend", "node-4", 80, "TCP");
    let zones = ["zone-1", "zone-1", "zone-2", "zone-2", "zone-3", "zone-3"];
    with_lab(test, 6, &zones, &yaml, |lab| {
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
        lab.apply(&slice("web-1", "web", 80, "TCP", &eps)).unwrap();
        synced(lab);
        let vip = frontend(lab, "web", 80, "TCP");
        for (node, want) in expect {
            let c = client_on(lab, node);
            assert_answered_by(&c, vip, N, want, &format!("{test} client on {node}"));
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
    let yaml = svc("web", None, 80, "TCP", None, Some("PreferSameNode"))
        + &pod("server-0", "backend", "node-1", 80, "TCP")
        + &pod("server-1", "backend", "node-2", 80, "TCP");
    with_lab("T6", 2, &["zone-a", "zone-a"], &yaml, |lab| {
        let vip = frontend(lab, "web", 80, "TCP");
        let s0 = Ep::of(lab, "server-0").node_hint();
        let s1 = Ep::of(lab, "server-1").node_hint();
        lab.apply(&slice("web-1", "web", 80, "TCP", &[s0, s1.clone()]))
            .unwrap();
        synced(lab);
        let c1 = client_on(lab, "node-1");
        let c2 = client_on(lab, "node-2");
        assert_answered_by(&c1, vip, N, &["server-0"], "T6 client on node-1");
        assert_answered_by(&c2, vip, N, &["server-1"], "T6 client on node-2");

        lab.apply(&slice("web-1", "web", 80, "TCP", std::slice::from_ref(&s1)))
            .unwrap();
        synced(lab);
        delete_pod(lab, "server-0");
        assert_answered_by(
            &c1,
            vip,
            N,
            &["server-1"],
            "T6 server-0 gone, client on node-1",
        );
        assert_answered_by(
            &c2,
            vip,
            N,
            &["server-1"],
            "T6 server-0 gone, client on node-2",
        );

        lab.apply(&pod("server-0b", "backend", "node-1", 80, "TCP"))
            .unwrap();
        synced(lab);
        let s0b = Ep::of(lab, "server-0b").node_hint();
        lab.apply(&slice("web-1", "web", 80, "TCP", &[s0b, s1]))
            .unwrap();
        synced(lab);
        assert_answered_by(
            &c1,
            vip,
            N,
            &["server-0b"],
            "T6 server recreated, client on node-1",
        );
        assert_answered_by(
            &c2,
            vip,
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
    let yaml = svc("web", Some("web"), 80, "TCP", Some("Local"), None)
        + &pod("web-n2", "web", "node-2", 80, "TCP");
    with_lab("p2", 2, &[], &yaml, |lab| {
        let vip = frontend(lab, "web", 80, "TCP");
        let c1 = client_on(lab, "node-1");
        let c2 = client_on(lab, "node-2");
        assert_tcp_dropped(&c1, vip, 2, "P2 client on node-1 (endpoint only on node-2)");
        assert_answered_by(&c2, vip, 10, &["web-n2"], "P2 client on node-2");
    });
}

/// The lab itself: pods placed round-robin and by nodeName, every pod on
/// every node reachable directly from the client on node-1 and from the
/// external client (no proxy involved), addresses as documented.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn lab_multinode_layout_and_self_check() {
    let yaml = pod("rr-1", "x", "", 80, "TCP")
        + &pod("rr-2", "x", "", 80, "TCP")
        + &pod("rr-3", "x", "", 80, "TCP")
        + &pod("pinned", "x", "node-3", 80, "TCP");
    with_lab(
        "self-check",
        3,
        &["zone-a", "zone-b", "zone-c"],
        &yaml,
        |lab| {
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
        },
    );
}

//! North-south lab tests: NodePorts, load-balancer IPs, externalIPs,
//! externalTrafficPolicy, health-check node ports and loadBalancerSourceRanges,
//! from the external client on the nodes' switch (198.18.0.100) and from pods.
//! Each test is named after rows of `../shared/conformance/` (from the
//! repository root, as in the README: service-behaviours.md, field-bugs.md)
//! and builds its own multi-node lab, torn down at the end, also on failure.
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --bins && cargo test -p xtask --test lab_northsouth -- --include-ignored --test-threads=2`.
//!
//! Every test runs twice, each time in a fresh lab: with the agent's
//! `--acceleration none` (tc programs only) and `--acceleration xdp` (also
//! the `ext_xdp` program on the nodes' `eth0`); see [`with_lab`].
//!
//! Addresses: load-balancer IPs 198.19.100.x, externalIPs 198.19.200.x. The
//! lab gives the external client routes to the pod CIDRs only; the tests add
//! `<ip>/32 via <node>` routes for LB IPs and externalIPs inside the external
//! client's namespace (it is the lab's; it goes with the lab). Pods reach
//! them through their default lab route (198.18.0.0/15 via their node).
//!
//! The lab does not allocate `healthCheckNodePort`s: the tests choose them
//! (32000 and up).
//!
//! On failure every node's agent log tail and `proxy-agent inspect
//! services|stats|conntrack` of every node are printed before the lab is torn
//! down; `KPR_LAB_DIAG=1` prints them after every test.
//!
//! The file is long (16 scenarios and their north-south-only helpers: NodePort
//! lookup, routes from the external client, HTTP health checks); what other
//! lab tests share lives in `support/`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use xtask::client::{self, reply_text, Request};
use xtask::netns::in_netns;
use xtask::Lab;

mod support;
use support::fixtures::{manifests, Ep, Pod, Port, Slice, Svc};
// `T` (2 s) is also how long a drop takes to show.
use support::{
    apply, assert_answered_by, assert_tcp_dropped, count_answers, frontend as cluster_ip,
    listeners, listens_on, stat, synced, LabTest, T,
};

/// Connections per check of which pods answer.
const N: usize = 30;

// ---------------------------------------------------------------- manifests

/// A Service `name` of type `type_`, `sessionAffinity: None` written out
/// (set ClientIP with [`Svc::client_ip_affinity`]).
fn svc(name: &str, type_: &str) -> Svc {
    Svc::new(name).service_type(type_).no_affinity()
}

/// Port `tcp` `port`/TCP (targetPort `port`).
fn tcp(port: u16) -> Port {
    Port::tcp("tcp", port)
}

/// Port `udp` `port`/UDP (targetPort `port`).
fn udp(port: u16) -> Port {
    Port::udp("udp", port)
}

/// The EndpointSlice `name` of `service` with port `tcp` `port`/TCP and
/// endpoints `(pod, ready, terminating)` at the pods' IPs, on their nodes;
/// serving = ready || terminating.
fn slice(lab: &Lab, name: &str, service: &str, port: u16, eps: &[(&str, bool, bool)]) -> String {
    let slice = Slice::new(name, service).port("tcp", port, "TCP");
    eps.iter()
        .fold(slice, |s, &(pod, ready, terminating)| {
            s.endpoint(Ep::of(lab, pod).cond(ready, ready || terminating, terminating))
        })
        .yaml()
}

// ---------------------------------------------------------------- lab runner

/// Starts a lab with `nodes` nodes, the switch and the external client, and
/// `yaml`; waits for every agent's first sync and attachments (pod veths and
/// `eth0`), runs `f`. On a panic in `f`, prints diagnostics while the lab
/// still exists; the lab is torn down before the panic resumes.
///
/// Every scenario runs twice, in both acceleration modes: tc only
/// (`--acceleration none`) and XDP (`--acceleration xdp`), in a fresh lab each.
fn with_lab(test: &str, nodes: usize, yaml: &str, f: impl Fn(&mut Lab)) {
    for mode in ["none", "xdp"] {
        with_lab_mode(&format!("{test}/{mode}"), mode, nodes, yaml, &f);
    }
}

fn with_lab_mode(test: &str, mode: &str, nodes: usize, yaml: &str, f: &impl Fn(&mut Lab)) {
    LabTest::new(test)
        .nodes(nodes)
        .external(true)
        .yaml(yaml)
        .args(&["--acceleration", mode])
        .run(f)
}

/// The external client's namespace.
fn ext(lab: &Lab) -> String {
    lab.external()
        .expect("the lab has an external client")
        .netns
        .clone()
}

/// A client pod namespace on `node` (see [`support::client_on`]): its
/// namespace and address.
fn client_on(lab: &mut Lab, node: &str) -> (String, Ipv4Addr) {
    let c = support::client_on(lab, node);
    (c.netns, c.ip)
}

/// A route in the external client's namespace: `ip`/32 via `node`'s address
/// (LB IPs and externalIPs are owned by no interface; something must send
/// them to a node, as a cloud LB or a router would).
fn ext_route(lab: &Lab, ip: Ipv4Addr, node: &str) {
    lab.route_from_external(ip, node)
        .unwrap_or_else(|e| panic!("route {ip} via {node}: {e:#}"));
}

/// The address of `node`.
fn node_ip(lab: &Lab, node: &str) -> Ipv4Addr {
    lab.node_named(node).expect("node").ip
}

/// `node`'s address at the NodePort of `service`'s `proto` port `port`.
fn node_port(lab: &Lab, service: &str, port: u16, proto: &str, node: &str) -> SocketAddrV4 {
    let ip = node_ip(lab, node);
    lab.info()
        .frontends_of(service)
        .into_iter()
        .find(|f| {
            f.kind == "NodePort" && f.ip == ip && f.protocol.eq_ignore_ascii_case(proto) && {
                // The NodePort frontend of the port whose service port is `port`.
                lab.info().frontends_of(service).iter().any(|c| {
                    c.kind == "ClusterIP"
                        && c.port == port
                        && c.port_name == f.port_name
                        && c.protocol == f.protocol
                })
            }
        })
        .map(|f| f.addr())
        .unwrap_or_else(|| panic!("no {proto} NodePort of {service}:{port} on {node}"))
}

// ---------------------------------------------------------------- requests

/// `n` new TCP connections sending `req`, one after another: counts per
/// answer, and the errors.
fn tcp_answers(
    ns: &str,
    addr: SocketAddrV4,
    req: &[u8],
    n: usize,
) -> (BTreeMap<String, usize>, Vec<String>) {
    count_answers(ns, (0..n).map(|_| Request::tcp(addr, req, T)).collect())
}

/// One `clientip` request over TCP: (pod answering via hostname is not
/// asked) the source address the backend saw.
fn client_ip_seen(ns: &str, addr: SocketAddrV4) -> io::Result<Ipv4Addr> {
    let r = client::tcp_request(ns, addr, b"clientip\n", T)?;
    let text = reply_text(&r);
    text.parse::<SocketAddrV4>()
        .map(|a| *a.ip())
        .map_err(|_| io::Error::other(format!("unexpected clientip reply {text:?}")))
}

/// Asserts that a TCP request from `ns` to `addr` is answered.
fn assert_tcp_ok(ns: &str, addr: SocketAddrV4, what: &str) -> String {
    let t = Instant::now();
    match client::tcp_request(ns, addr, b"hostname\n", T) {
        Ok(r) => {
            let pod = reply_text(&r);
            println!(
                "{what}: TCP {addr} answered by {pod} in {} ms",
                t.elapsed().as_millis()
            );
            pod
        }
        Err(e) => panic!(
            "{what}: TCP {addr}: {:?} {e} after {} ms",
            e.kind(),
            t.elapsed().as_millis()
        ),
    }
}

/// Asserts that `tries` requests from `ns` to `addr` are refused at once
/// (TCP RST or ICMP port unreachable: `ConnectionRefused`).
fn assert_refused(ns: &str, addr: SocketAddrV4, proto: &str, tries: usize, what: &str) {
    for i in 0..tries {
        let t = Instant::now();
        let r = if proto == "UDP" {
            client::udp_request(ns, addr, b"hostname\n", T, None)
        } else {
            client::tcp_request(ns, addr, b"hostname\n", T)
        }
        .map(|r| reply_text(&r));
        let el = t.elapsed();
        match r {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => println!(
                "{what}: {proto} {addr} try {}: refused in {} ms",
                i + 1,
                el.as_millis()
            ),
            other => panic!(
                "{what}: {proto} {addr} try {}: expected refused, got {other:?} after {} ms",
                i + 1,
                el.as_millis()
            ),
        }
    }
}

/// Asserts that none of `tries` requests from `ns` to `addr` gets an answer
/// from a pod. Refused (the node's stack: nothing listens) and timed out both
/// count as no answer: the kernel rate-limits its ICMP port unreachable
/// messages (about 6 in a burst per destination), so later UDP tries time
/// out instead of being refused.
fn assert_no_answer(ns: &str, addr: SocketAddrV4, proto: &str, tries: usize, what: &str) {
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..tries {
        let r = if proto == "UDP" {
            client::udp_request(ns, addr, b"hostname\n", T, None)
        } else {
            client::tcp_request(ns, addr, b"hostname\n", T)
        }
        .map(|r| reply_text(&r));
        match r {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::TimedOut
                ) =>
            {
                *outcomes.entry(format!("{:?}", e.kind())).or_insert(0) += 1;
            }
            other => panic!(
                "{what}: {proto} {addr} try {}: expected no answer, got {other:?}",
                i + 1
            ),
        }
    }
    println!("{what}: {proto} {addr}: {tries} tries, no answer: {outcomes:?}");
}

/// An HTTP reply: status and body.
#[derive(Debug)]
struct Http {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
}

/// `GET /` from namespace `ns` (HTTP/1.1, `Connection: close`).
fn http_get(ns: &str, addr: SocketAddrV4, path: &str) -> io::Result<Http> {
    let path = path.to_string();
    in_netns(ns, move || -> io::Result<Http> {
        let mut s = TcpStream::connect_timeout(&SocketAddr::V4(addr), T)?;
        s.set_read_timeout(Some(T))?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text
            .split_once("\r\n\r\n")
            .ok_or_else(|| io::Error::other(format!("no header end in {text:?}")))?;
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| io::Error::other(format!("bad status line in {text:?}")))?;
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        Ok(Http {
            status,
            headers,
            body: body.to_string(),
        })
    })?
}

/// Asserts the health-check node port `hcnp` of `node` answers `status` with
/// kube-proxy's body for `service` (`default/<name>`) and `local` endpoints.
fn assert_hcnp(lab: &Lab, node: &str, hcnp: u16, status: u16, service: &str, local: usize) {
    let addr = SocketAddrV4::new(node_ip(lab, node), hcnp);
    let r = http_get(&ext(lab), addr, "/")
        .unwrap_or_else(|e| panic!("HCNP {node} {addr}: {:?} {e}", e.kind()));
    println!(
        "HCNP {node} {addr}: {} {}",
        r.status,
        r.body.replace(['\n', '\t'], "")
    );
    assert_eq!(r.status, status, "HCNP {node} {addr}: {r:?}");
    assert_eq!(
        r.headers.get("content-type").map(String::as_str),
        Some("application/json"),
        "{r:?}"
    );
    assert_eq!(
        r.headers.get("x-content-type-options").map(String::as_str),
        Some("nosniff"),
        "{r:?}"
    );
    let v: serde_json::Value = serde_json::from_str(&r.body)
        .unwrap_or_else(|e| panic!("HCNP {node}: body {:?}: {e}", r.body));
    assert_eq!(
        v,
        serde_json::json!({"service": {"namespace": "default", "name": service}, "localEndpoints": local, "serviceProxyHealthy": true}),
        "HCNP {node} body"
    );
}

/// Asserts that nothing listens on `node`'s `hcnp` any more (refused),
/// waiting up to 2 s for the listener to close.
fn assert_hcnp_closed(lab: &Lab, node: &str, hcnp: u16) {
    let addr = SocketAddrV4::new(node_ip(lab, node), hcnp);
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match http_get(&ext(lab), addr, "/") {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                println!("HCNP {node} {addr}: refused (closed)");
                return;
            }
            other => assert!(
                Instant::now() < deadline,
                "HCNP {node} {addr} still answers: {other:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ================================================================ tests

/// S10: a NodePort Service with 2 pods (node-1, node-2) is reachable from
/// the external client on every node's address, node-3 included (no local
/// backend: eTP Cluster, SNAT to node-3's address), and both pods answer on
/// each; also through the ClusterIP from a pod.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s10_nodeport_reachable_from_external_on_every_node() {
    let yaml = manifests(&[
        &Pod::new("web-1", "web").node("node-1").port(80, "TCP"),
        &Pod::new("web-2", "web").node("node-2").port(80, "TCP"),
        &svc("web", "NodePort").selector("web").ports([tcp(80)]),
    ]);
    with_lab("s10", 3, &yaml, |lab| {
        let x = ext(lab);
        for node in ["node-1", "node-2", "node-3"] {
            let np = node_port(lab, "web", 80, "TCP", node);
            assert_answered_by(
                &x,
                np,
                "TCP",
                N,
                &["web-1", "web-2"],
                &format!("S10 external → {node}"),
            );
        }
        let c = lab.client().netns.clone();
        assert_answered_by(
            &c,
            cluster_ip(lab, "web", 80, "TCP"),
            "TCP",
            N,
            &["web-1", "web-2"],
            "S10 pod → ClusterIP",
        );
        println!(
            "S10 snat_node: node-1 {}, node-2 {}, node-3 {}",
            stat(lab, "node-1", "snat_node"),
            stat(lab, "node-2", "snat_node"),
            stat(lab, "node-3", "snat_node")
        );
    });
}

/// S11: an externalIP (198.19.200.1) that no interface owns is captured,
/// from a pod (node-1) and from the external client (routed to node-1).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s11_external_ip_not_owned_by_any_interface() {
    let eip = Ipv4Addr::new(198, 19, 200, 1);
    let s = svc("web", "ClusterIP")
        .selector("web")
        .ports([tcp(80), udp(80)])
        .external_ips(&[eip]);
    let yaml = manifests(&[
        &Pod::new("web-1", "web").node("node-1").port(80, "TCP"),
        &Pod::new("web-2", "web").node("node-2").port(80, "TCP"),
        &s,
    ]);
    with_lab("s11", 2, &yaml, |lab| {
        for n in lab.nodes() {
            let out = Command::new("ip")
                .args(["-n", &n.netns, "-4", "addr"])
                .output()
                .unwrap();
            assert!(
                !String::from_utf8_lossy(&out.stdout).contains(&eip.to_string()),
                "{} owns {eip}",
                n.name
            );
        }
        let addr = SocketAddrV4::new(eip, 80);
        let (c, _) = client_on(lab, "node-1");
        assert_answered_by(
            &c,
            addr,
            "TCP",
            N,
            &["web-1", "web-2"],
            "S11 pod (node-1) → externalIP",
        );
        assert_answered_by(
            &c,
            addr,
            "UDP",
            N,
            &["web-1", "web-2"],
            "S11 pod (node-1) → externalIP",
        );
        let (c2, _) = client_on(lab, "node-2");
        assert_answered_by(
            &c2,
            addr,
            "TCP",
            N,
            &["web-1", "web-2"],
            "S11 pod (node-2) → externalIP",
        );
        ext_route(lab, eip, "node-1");
        let x = ext(lab);
        assert_answered_by(
            &x,
            addr,
            "TCP",
            N,
            &["web-1", "web-2"],
            "S11 external → externalIP via node-1",
        );
        assert_answered_by(
            &x,
            addr,
            "UDP",
            N,
            &["web-1", "web-2"],
            "S11 external → externalIP via node-1",
        );
    });
}

/// S12 / S39: TCP and UDP on the same service port (80) and the same
/// nodePort number (30080); then TCP only (UDP stops), then UDP only (TCP
/// stops), the other protocol working throughout.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s12_s39_tcp_and_udp_on_same_nodeport_number() {
    let both = svc("dual", "NodePort")
        .selector("dual")
        .ports([tcp(80).node_port(30080), udp(80).node_port(30080)]);
    let yaml = manifests(&[
        &Pod::new("dual-1", "dual").node("node-2").port(80, "TCP"),
        &both,
    ]);
    with_lab("s12_s39", 2, &yaml, |lab| {
        let x = ext(lab);
        let (c, _) = client_on(lab, "node-1");
        let tcp_np = SocketAddrV4::new(node_ip(lab, "node-1"), 30080);
        let tcp_np2 = SocketAddrV4::new(node_ip(lab, "node-2"), 30080);
        for (proto, what) in [("TCP", "S12 both"), ("UDP", "S12 both")] {
            assert_answered_by(
                &x,
                tcp_np,
                proto,
                5,
                &["dual-1"],
                &format!("{what} external → node-1"),
            );
            assert_answered_by(
                &x,
                tcp_np2,
                proto,
                5,
                &["dual-1"],
                &format!("{what} external → node-2"),
            );
            assert_answered_by(
                &c,
                tcp_np,
                proto,
                5,
                &["dual-1"],
                &format!("{what} pod → node-1"),
            );
            assert_answered_by(
                &c,
                cluster_ip(lab, "dual", 80, proto),
                proto,
                5,
                &["dual-1"],
                &format!("S39 {what} pod → ClusterIP"),
            );
        }
        // TCP only: UDP stops on the NodePort and the ClusterIP.
        let tcp_only = svc("dual", "NodePort")
            .selector("dual")
            .ports([tcp(80).node_port(30080)]);
        let cip = lab.service_ip("dual").unwrap();
        let t = Instant::now();
        apply(lab, &tcp_only.yaml());
        println!("S39 TCP only: synced in {} ms", t.elapsed().as_millis());
        assert_answered_by(
            &x,
            tcp_np,
            "TCP",
            5,
            &["dual-1"],
            "S39 TCP only, external → node-1",
        );
        assert_answered_by(
            &c,
            SocketAddrV4::new(cip, 80),
            "TCP",
            5,
            &["dual-1"],
            "S39 TCP only, pod → ClusterIP",
        );
        assert_refused(&x, tcp_np, "UDP", 3, "S39 TCP only: UDP external → node-1");
        // The pod's own namespace has no UDP frontend for the ClusterIP any more.
        let r = client::udp_request(&c, SocketAddrV4::new(cip, 80), b"hostname\n", T, None);
        println!("S39 TCP only: UDP pod → ClusterIP: {r:?}");
        assert!(
            r.is_err(),
            "S39 TCP only: UDP ClusterIP still answered: {r:?}"
        );
        // UDP only.
        let udp_only = svc("dual", "NodePort")
            .selector("dual")
            .ports([udp(80).node_port(30080)]);
        apply(lab, &udp_only.yaml());
        assert_answered_by(
            &x,
            tcp_np,
            "UDP",
            5,
            &["dual-1"],
            "S39 UDP only, external → node-1",
        );
        assert_answered_by(
            &c,
            SocketAddrV4::new(cip, 80),
            "UDP",
            5,
            &["dual-1"],
            "S39 UDP only, pod → ClusterIP",
        );
        assert_refused(&x, tcp_np, "TCP", 3, "S39 UDP only: TCP external → node-1");
    });
}

/// S17: the proxy holds no listening socket for a NodePort (`ss -ltnu` in
/// the node namespace) while the NodePort works; deleted and re-created with
/// the same nodePort, it works again and still nothing listens.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s17_no_listener_on_node_port() {
    let s = svc("web", "NodePort")
        .selector("web")
        .ports([tcp(80).node_port(30017), udp(80).node_port(30017)]);
    let yaml = manifests(&[&Pod::new("web-1", "web").node("node-2").port(80, "TCP"), &s]);
    with_lab("s17", 2, &yaml, |lab| {
        let x = ext(lab);
        let np = SocketAddrV4::new(node_ip(lab, "node-1"), 30017);
        assert_answered_by(&x, np, "TCP", 3, &["web-1"], "S17 before");
        for node in ["node-1", "node-2"] {
            let ss = listeners(lab, node);
            println!("S17 {node} listeners:\n{ss}");
            assert!(
                !listens_on(&ss, 30017),
                "S17: something listens on {node}:30017:\n{ss}"
            );
        }
        lab.delete_service("web").unwrap();
        synced(lab);
        assert_refused(&x, np, "TCP", 2, "S17 deleted");
        apply(lab, &s.yaml());
        assert_answered_by(&x, np, "TCP", 3, &["web-1"], "S17 re-created");
        assert_answered_by(&x, np, "UDP", 3, &["web-1"], "S17 re-created");
        for node in ["node-1", "node-2"] {
            let ss = listeners(lab, node);
            assert!(
                !listens_on(&ss, 30017),
                "S17: something listens on {node}:30017 after re-creation:\n{ss}"
            );
        }
    });
}

/// S24–S26: ClientIP affinity through a NodePort, from the external client,
/// with 3 pods on 3 nodes: sticky (S24, through a node with and one without
/// a local pod); with a 2 s timeout the choice is made again after idle
/// periods (S25); None → spread, back to ClientIP → sticky (S26).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s24_s25_s26_client_ip_affinity_through_nodeport() {
    let s = svc("aff", "NodePort")
        .selector("aff")
        .ports([tcp(80)])
        .client_ip_affinity(Some(10_800));
    let yaml = manifests(&[
        &Pod::new("aff-1", "aff").node("node-1").port(80, "TCP"),
        &Pod::new("aff-2", "aff").node("node-2").port(80, "TCP"),
        &Pod::new("aff-3", "aff").node("node-3").port(80, "TCP"),
        &s,
    ]);
    with_lab("s24_s26", 3, &yaml, |lab| {
        let x = ext(lab);
        // S24.
        for node in ["node-1", "node-3"] {
            let np = node_port(lab, "aff", 80, "TCP", node);
            let (counts, errors) = tcp_answers(&x, np, b"hostname\n", N);
            println!(
                "S24 external → {node} {np}: {counts:?}, {} errors",
                errors.len()
            );
            assert!(errors.is_empty(), "S24: {errors:?}");
            assert_eq!(
                counts.len(),
                1,
                "S24: not sticky through {node}: {counts:?}"
            );
        }
        let np = node_port(lab, "aff", 80, "TCP", "node-1");
        // S26: None spreads.
        let none = s.clone().no_affinity();
        apply(lab, &none.yaml());
        let (counts, errors) = tcp_answers(&x, np, b"hostname\n", N);
        println!("S26 None: {counts:?}, {} errors", errors.len());
        assert!(errors.is_empty(), "S26 None: {errors:?}");
        assert!(
            counts.len() >= 2,
            "S26: affinity None still sticky: {counts:?}"
        );
        // Back to ClientIP: sticky again.
        apply(lab, &s.yaml());
        let (counts, errors) = tcp_answers(&x, np, b"hostname\n", N);
        println!("S26 ClientIP again: {counts:?}, {} errors", errors.len());
        assert!(errors.is_empty(), "S26: {errors:?}");
        assert_eq!(
            counts.len(),
            1,
            "S26: not sticky after switching back: {counts:?}"
        );
        // S25: timeout 2 s. Within the timeout: sticky; after idle periods
        // longer than it: chosen again (3 pods: 8 draws all equal has
        // probability 3^-7).
        let short = s.clone().client_ip_affinity(Some(2));
        apply(lab, &short.yaml());
        let (counts, _) = tcp_answers(&x, np, b"hostname\n", 10);
        println!("S25 within the timeout: {counts:?}");
        assert_eq!(
            counts.len(),
            1,
            "S25: not sticky within the timeout: {counts:?}"
        );
        let mut seen = Vec::new();
        for _ in 0..8 {
            std::thread::sleep(Duration::from_millis(3_200));
            seen.push(assert_tcp_ok(&x, np, "S25 after an idle period"));
        }
        let distinct: BTreeSet<&String> = seen.iter().collect();
        println!("S25 after idle periods > timeout: {seen:?}");
        assert!(
            distinct.len() >= 2,
            "S25: affinity outlived its 2 s timeout: {seen:?}"
        );
        println!(
            "S24-S26 affinity_hit node-1: {}",
            stat(lab, "node-1", "affinity_hit")
        );
    });
}

/// S34 + E3: the health-check node port of an eTP=Local LoadBalancer
/// Service. 200 with kube-proxy's body on the node with the endpoint, 503 on
/// the others; the only local endpoint terminating → 503 while the NodePort
/// still serves it (S34); the backend moved to node-2 → 200 only there (E3);
/// Service deleted → the listener is gone everywhere.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s34_e3_health_check_node_port() {
    const HCNP: u16 = 32000;
    let lb = Ipv4Addr::new(198, 19, 100, 34);
    let s = svc("lb", "LoadBalancer")
        .ports([tcp(80)])
        .external_traffic_policy("Local")
        .health_check_node_port(HCNP)
        .lb_ips(&[lb]);
    let yaml = manifests(&[
        &Pod::new("lb-1", "x").node("node-1").port(80, "TCP"),
        &Pod::new("lb-2", "x").node("node-2").port(80, "TCP"),
        &s,
    ]);
    with_lab("s34_e3", 3, &yaml, |lab| {
        // Slice: lb-1 ready on node-1.
        apply(lab, &slice(lab, "lb-a", "lb", 80, &[("lb-1", true, false)]));
        assert_hcnp(lab, "node-1", HCNP, 200, "lb", 1);
        assert_hcnp(lab, "node-2", HCNP, 503, "lb", 0);
        assert_hcnp(lab, "node-3", HCNP, 503, "lb", 0);
        let ss = listeners(lab, "node-2");
        assert!(listens_on(&ss, HCNP), "no HCNP listener on node-2:\n{ss}");
        let x = ext(lab);
        ext_route(lab, lb, "node-1");
        assert_answered_by(
            &x,
            SocketAddrV4::new(lb, 80),
            "TCP",
            5,
            &["lb-1"],
            "E3 LB IP via node-1",
        );
        // S34: the only local endpoint is terminating.
        apply(lab, &slice(lab, "lb-a", "lb", 80, &[("lb-1", false, true)]));
        assert_hcnp(lab, "node-1", HCNP, 503, "lb", 0);
        let np1 = node_port(lab, "lb", 80, "TCP", "node-1");
        assert_answered_by(
            &x,
            np1,
            "TCP",
            5,
            &["lb-1"],
            "S34 NodePort still serves the terminating endpoint",
        );
        // E3: the backend moves to node-2.
        apply(lab, &slice(lab, "lb-a", "lb", 80, &[("lb-2", true, false)]));
        assert_hcnp(lab, "node-1", HCNP, 503, "lb", 0);
        assert_hcnp(lab, "node-2", HCNP, 200, "lb", 1);
        assert_hcnp(lab, "node-3", HCNP, 503, "lb", 0);
        ext_route(lab, lb, "node-2");
        assert_answered_by(
            &x,
            SocketAddrV4::new(lb, 80),
            "TCP",
            5,
            &["lb-2"],
            "E3 LB IP via node-2",
        );
        // Both nodes: 200 on both.
        apply(
            lab,
            &slice(
                lab,
                "lb-a",
                "lb",
                80,
                &[("lb-1", true, false), ("lb-2", true, false)],
            ),
        );
        assert_hcnp(lab, "node-1", HCNP, 200, "lb", 1);
        assert_hcnp(lab, "node-2", HCNP, 200, "lb", 1);
        // Deleted: no listener left.
        lab.delete_service("lb").unwrap();
        synced(lab);
        for node in ["node-1", "node-2", "node-3"] {
            assert_hcnp_closed(lab, node, HCNP);
            let ss = listeners(lab, node);
            assert!(
                !listens_on(&ss, HCNP),
                "HCNP listener left on {node} after the delete:\n{ss}"
            );
        }
    });
}

/// S37: a NodePort (eTP Cluster) whose only endpoint (node-1) is
/// terminating still serves it, through node-1 and node-2, from the
/// external client and from pods on both nodes, 5 rounds each.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s37_terminating_fallback_through_nodeport_etp_cluster() {
    let s = svc("term", "NodePort").ports([tcp(80)]);
    let yaml = manifests(&[&Pod::new("term-1", "x").node("node-1").port(80, "TCP"), &s]);
    with_lab("s37", 2, &yaml, |lab| {
        apply(
            lab,
            &slice(lab, "term-a", "term", 80, &[("term-1", false, true)]),
        );
        let x = ext(lab);
        let (c1, _) = client_on(lab, "node-1");
        let (c2, _) = client_on(lab, "node-2");
        for node in ["node-1", "node-2"] {
            let np = node_port(lab, "term", 80, "TCP", node);
            assert_answered_by(
                &x,
                np,
                "TCP",
                5,
                &["term-1"],
                &format!("S37 external → {node}"),
            );
        }
        let np1 = node_port(lab, "term", 80, "TCP", "node-1");
        assert_answered_by(
            &c1,
            np1,
            "TCP",
            5,
            &["term-1"],
            "S37 pod on node-1 → node-1",
        );
        assert_answered_by(
            &c2,
            np1,
            "TCP",
            5,
            &["term-1"],
            "S37 pod on node-2 → node-1",
        );
    });
}

/// S38: a NodePort with eTP Local whose only endpoint (node-1) is
/// terminating: node-1's NodePort serves it from a pod on node-2 and from
/// the external client; node-2's NodePort (no local endpoint) fails for a
/// pod on node-1 and for the external client (dropped).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s38_terminating_fallback_through_nodeport_etp_local() {
    let s = svc("term", "NodePort")
        .ports([tcp(80)])
        .external_traffic_policy("Local");
    let yaml = manifests(&[&Pod::new("term-1", "x").node("node-1").port(80, "TCP"), &s]);
    with_lab("s38", 2, &yaml, |lab| {
        apply(
            lab,
            &slice(lab, "term-a", "term", 80, &[("term-1", false, true)]),
        );
        let x = ext(lab);
        let (c1, _) = client_on(lab, "node-1");
        let (c2, _) = client_on(lab, "node-2");
        let np1 = node_port(lab, "term", 80, "TCP", "node-1");
        let np2 = node_port(lab, "term", 80, "TCP", "node-2");
        assert_answered_by(
            &c2,
            np1,
            "TCP",
            5,
            &["term-1"],
            "S38 pod on node-2 → node-1",
        );
        assert_answered_by(&x, np1, "TCP", 5, &["term-1"], "S38 external → node-1");
        let before = stat(lab, "node-2", "drop_no_local_backend");
        assert_tcp_dropped(&c1, np2, 2, "S38 pod on node-1 → node-2");
        assert_tcp_dropped(&x, np2, 2, "S38 external → node-2");
        let after = stat(lab, "node-2", "drop_no_local_backend");
        println!("S38 node-2 drop_no_local_backend: {before} → {after}");
        assert!(
            after > before,
            "S38: node-2's drop_no_local_backend did not move ({before} → {after})"
        );
    });
}

/// S42 / E4 with 3 nodes: an eTP=Local LoadBalancer Service (LB IP
/// 198.19.100.42, HCNP 32042) whose one endpoint is on node-1; the client
/// pod is on node-2. Local: HCNP 200 on node-1, 503 elsewhere; the NodePort
/// answers on node-1 (client address preserved) and on the client's own
/// node-2 (short-circuit), not on node-3; pod → LB IP short-circuits without
/// SNAT (E4). Cluster: no HCNP anywhere; the NodePort answers on all 3.
/// Back to Local with the same HCNP: as before.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s42_e4_etp_local_from_inside_short_circuits() {
    const HCNP: u16 = 32042;
    let lb = Ipv4Addr::new(198, 19, 100, 42);
    let local = svc("esipp", "LoadBalancer")
        .selector("esipp")
        .ports([tcp(80)])
        .external_traffic_policy("Local")
        .health_check_node_port(HCNP)
        .lb_ips(&[lb]);
    let cluster = local
        .clone()
        .external_traffic_policy("Cluster")
        .no_health_check_node_port();
    let yaml = manifests(&[
        &Pod::new("esipp-1", "esipp").node("node-1").port(80, "TCP"),
        &local,
    ]);
    with_lab("s42_e4", 3, &yaml, |lab| {
        let (c, cip) = client_on(lab, "node-2");
        let x = ext(lab);
        let check_local = |lab: &Lab, phase: &str| {
            assert_hcnp(lab, "node-1", HCNP, 200, "esipp", 1);
            assert_hcnp(lab, "node-2", HCNP, 503, "esipp", 0);
            assert_hcnp(lab, "node-3", HCNP, 503, "esipp", 0);
            let np1 = node_port(lab, "esipp", 80, "TCP", "node-1");
            let np2 = node_port(lab, "esipp", 80, "TCP", "node-2");
            let np3 = node_port(lab, "esipp", 80, "TCP", "node-3");
            let seen = client_ip_seen(&c, np1)
                .unwrap_or_else(|e| panic!("S42 {phase}: pod → node-1 NodePort: {e}"));
            println!("S42 {phase}: pod {cip} → node-1 {np1}: backend saw {seen}");
            assert_eq!(
                seen, cip,
                "S42 {phase}: client address not preserved through node-1's NodePort"
            );
            let seen = client_ip_seen(&c, np2)
                .unwrap_or_else(|e| panic!("S42 {phase}: pod → own node-2 NodePort: {e}"));
            println!(
                "S42 {phase}: pod {cip} → own node-2 {np2} (short-circuit): backend saw {seen}"
            );
            assert_eq!(
                seen, cip,
                "S42 {phase}: short-circuit through the own node's NodePort SNATed"
            );
            assert_tcp_dropped(
                &c,
                np3,
                1,
                &format!("S42 {phase}: pod on node-2 → node-3 NodePort"),
            );
            // E4: pod → LB IP short-circuits to the cluster endpoints, no SNAT.
            let seen = client_ip_seen(&c, SocketAddrV4::new(lb, 80))
                .unwrap_or_else(|e| panic!("E4 {phase}: pod → LB IP: {e}"));
            println!("E4 {phase}: pod {cip} → LB IP {lb}: backend saw {seen}");
            assert_eq!(
                seen, cip,
                "E4 {phase}: LB IP from a pod not short-circuited without SNAT"
            );
            // External: node-1 preserves, node-3 drops.
            let seen = client_ip_seen(&x, np1)
                .unwrap_or_else(|e| panic!("S42 {phase}: external → node-1: {e}"));
            assert_eq!(
                seen,
                Ipv4Addr::new(198, 18, 0, 100),
                "S42 {phase}: external client address not preserved"
            );
            assert_tcp_dropped(
                &x,
                np3,
                1,
                &format!("S42 {phase}: external → node-3 NodePort"),
            );
        };
        check_local(lab, "Local");
        apply(lab, &cluster.yaml());
        for node in ["node-1", "node-2", "node-3"] {
            assert_hcnp_closed(lab, node, HCNP);
        }
        for node in ["node-1", "node-2", "node-3"] {
            let np = node_port(lab, "esipp", 80, "TCP", node);
            assert_answered_by(
                &c,
                np,
                "TCP",
                3,
                &["esipp-1"],
                &format!("S42 Cluster: pod on node-2 → {node}"),
            );
            assert_answered_by(
                &x,
                np,
                "TCP",
                3,
                &["esipp-1"],
                &format!("S42 Cluster: external → {node}"),
            );
        }
        apply(lab, &local.yaml());
        check_local(lab, "back to Local");
    });
}

/// E2: eTP Local NodePort: the backend (node-2) sees the external client's
/// own address through node-2; eTP Cluster through node-1 (remote backend):
/// it sees node-1's address (SNAT).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn e2_source_ip_local_preserved_cluster_snat() {
    let s = svc("src", "NodePort")
        .selector("src")
        .ports([tcp(80)])
        .external_traffic_policy("Local");
    let yaml = manifests(&[&Pod::new("src-1", "src").node("node-2").port(80, "TCP"), &s]);
    with_lab("e2", 2, &yaml, |lab| {
        let x = ext(lab);
        let ext_ip = lab.external().unwrap().ip;
        let np2 = node_port(lab, "src", 80, "TCP", "node-2");
        let seen = client_ip_seen(&x, np2).expect("E2 Local: external → node-2");
        println!("E2 Local: external {ext_ip} → node-2 {np2}: backend saw {seen}");
        assert_eq!(seen, ext_ip, "E2 Local: source not preserved");
        let c = s.clone().external_traffic_policy("Cluster");
        apply(lab, &c.yaml());
        let np1 = node_port(lab, "src", 80, "TCP", "node-1");
        let before = stat(lab, "node-1", "snat_node");
        let seen = client_ip_seen(&x, np1).expect("E2 Cluster: external → node-1");
        println!(
            "E2 Cluster: external {ext_ip} → node-1 {np1} (remote backend): backend saw {seen}"
        );
        assert_eq!(
            seen,
            node_ip(lab, "node-1"),
            "E2 Cluster: remote backend should see node-1's address"
        );
        let after = stat(lab, "node-1", "snat_node");
        println!("E2 Cluster: node-1 snat_node {before} → {after}");
        let seen = client_ip_seen(&x, np2).expect("E2 Cluster: external → node-2");
        println!("E2 Cluster: external → node-2 (local backend): backend saw {seen} (no SNAT towards local backends in this datapath; kube-proxy would masquerade)");
    });
}

/// C1: a UDP NodePort flow with a fixed 5-tuple (external client, source
/// port 41000 → node-2:nodePort) reaches backend1; backend2 is added, then
/// backend1 deleted: the same 5-tuple reaches backend2 (no stale NAT entry).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn c1_udp_nodeport_flow_follows_backend_as_backends_cycle() {
    let s = svc("cyc", "NodePort").selector("cyc").ports([udp(80)]);
    let yaml = manifests(&[
        &Pod::new("backend1", "cyc").node("node-2").port(80, "TCP"),
        &s,
    ]);
    with_lab("c1", 2, &yaml, |lab| {
        let x = ext(lab);
        let np = node_port(lab, "cyc", 80, "UDP", "node-2");
        const SPORT: u16 = 41000;
        let ask =
            || client::udp_request(&x, np, b"hostname\n", T, Some(SPORT)).map(|r| reply_text(&r));
        for i in 0..3 {
            let r = ask();
            println!("C1 round {i}: {r:?}");
            assert_eq!(
                r.as_deref().ok(),
                Some("backend1"),
                "C1: before the cycle: {r:?}"
            );
        }
        apply(
            lab,
            &Pod::new("backend2", "cyc")
                .node("node-2")
                .port(80, "TCP")
                .yaml(),
        );
        let r = ask();
        println!("C1 with backend2 added: {r:?}");
        assert_eq!(
            r.as_deref().ok(),
            Some("backend1"),
            "C1: an established UDP flow moved when a backend was added: {r:?}"
        );
        let t = Instant::now();
        lab.delete_pod("backend1").unwrap();
        synced(lab);
        let mut got = Vec::new();
        let ok = loop {
            let r = ask();
            got.push(format!("{r:?}"));
            if r.as_deref().ok() == Some("backend2") {
                break true;
            }
            if t.elapsed() > Duration::from_secs(15) {
                break false;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        println!(
            "C1 after deleting backend1: {} tries over {} ms: {got:?}",
            got.len(),
            t.elapsed().as_millis()
        );
        assert!(ok, "C1: the fixed 5-tuple never reached backend2: {got:?}");
        // The flow stays on backend2. A datagram lost on a busy machine (UDP
        // has no retransmission) is asked again, up to twice; any answer
        // must come from backend2.
        for i in 0..3 {
            let mut r = ask();
            for _ in 0..2 {
                if r.is_ok() {
                    break;
                }
                println!("C1 after the move, ask {i}: {r:?}; asking again");
                r = ask();
            }
            assert_eq!(
                r.as_deref().ok(),
                Some("backend2"),
                "C1: after the move, ask {i}: {r:?}"
            );
        }
    });
}

/// N2 / N3: a pod (node-1) → each node's address at the NodePort, TCP and
/// UDP: every endpoint (one per node) answers through every node.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn n2_n3_pod_to_node_ip_node_port() {
    let s = svc("net", "NodePort")
        .selector("net")
        .ports([tcp(80), udp(80)]);
    let yaml = manifests(&[
        &Pod::new("net-1", "net").node("node-1").port(80, "TCP"),
        &Pod::new("net-2", "net").node("node-2").port(80, "TCP"),
        &Pod::new("net-3", "net").node("node-3").port(80, "TCP"),
        &s,
    ]);
    with_lab("n2_n3", 3, &yaml, |lab| {
        let (c, _) = client_on(lab, "node-1");
        let all = ["net-1", "net-2", "net-3"];
        assert_answered_by(
            &c,
            cluster_ip(lab, "net", 80, "TCP"),
            "TCP",
            N,
            &all,
            "N2 pod → ClusterIP",
        );
        assert_answered_by(
            &c,
            cluster_ip(lab, "net", 80, "UDP"),
            "UDP",
            N,
            &all,
            "N3 pod → ClusterIP",
        );
        for node in ["node-1", "node-2", "node-3"] {
            let tnp = node_port(lab, "net", 80, "TCP", node);
            let unp = node_port(lab, "net", 80, "UDP", node);
            assert_answered_by(
                &c,
                tnp,
                "TCP",
                N,
                &all,
                &format!("N2 pod (node-1) → {node} NodePort"),
            );
            assert_answered_by(
                &c,
                unp,
                "UDP",
                N,
                &all,
                &format!("N3 pod (node-1) → {node} NodePort"),
            );
        }
    });
}

/// N14 / N16: a TCP+UDP NodePort answers from the external client through
/// node-1 and node-2; once the Service is deleted, 10 tries each get no
/// answer (refused by the node's stack, nothing listens; UDP tries past the
/// kernel's ICMP rate limit time out instead).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn n14_n16_nodeport_stops_answering_after_delete() {
    let s = svc("gone", "NodePort")
        .selector("gone")
        .ports([tcp(80), udp(80)]);
    let yaml = manifests(&[
        &Pod::new("gone-1", "gone").node("node-1").port(80, "TCP"),
        &Pod::new("gone-2", "gone").node("node-2").port(80, "TCP"),
        &s,
    ]);
    with_lab("n14_n16", 2, &yaml, |lab| {
        let x = ext(lab);
        let mut addrs = Vec::new();
        for node in ["node-1", "node-2"] {
            for proto in ["TCP", "UDP"] {
                let np = node_port(lab, "gone", 80, proto, node);
                assert_answered_by(
                    &x,
                    np,
                    proto,
                    N,
                    &["gone-1", "gone-2"],
                    &format!("N14/N16 before, {node}"),
                );
                addrs.push((np, proto));
            }
        }
        let t = Instant::now();
        lab.delete_service("gone").unwrap();
        synced(lab);
        println!("N14/N16: delete synced in {} ms", t.elapsed().as_millis());
        for (np, proto) in addrs {
            assert_no_answer(&x, np, proto, 10, "N14/N16 after the delete");
        }
    });
}

/// K4 from the external client: a NodePort with no endpoints is refused at
/// once (TCP and UDP, ICMP port unreachable from the datapath, counted in
/// reject_no_backend); with eTP Local and the only endpoint on node-1,
/// node-2 drops (drop_no_local_backend) while node-1 answers.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn k4_external_nodeport_no_endpoints_refused_etp_local_dropped() {
    let s = svc("empty", "NodePort")
        .selector("nobody")
        .ports([tcp(80), udp(80)]);
    let yaml = manifests(&[&Pod::new("k4-1", "k4").node("node-1").port(80, "TCP"), &s]);
    with_lab("k4", 2, &yaml, |lab| {
        let x = ext(lab);
        let before = stat(lab, "node-2", "reject_no_backend");
        for proto in ["TCP", "UDP"] {
            for node in ["node-1", "node-2"] {
                let np = node_port(lab, "empty", 80, proto, node);
                assert_refused(
                    &x,
                    np,
                    proto,
                    3,
                    &format!("K4 no endpoints, external → {node}"),
                );
            }
        }
        let after = stat(lab, "node-2", "reject_no_backend");
        println!("K4 node-2 reject_no_backend {before} → {after}");
        assert!(
            after > before,
            "K4: refusals not counted by the datapath on node-2 ({before} → {after})"
        );
        let local = svc("empty", "NodePort")
            .selector("k4")
            .ports([tcp(80), udp(80)])
            .external_traffic_policy("Local");
        apply(lab, &local.yaml());
        let np1 = node_port(lab, "empty", 80, "TCP", "node-1");
        let np2 = node_port(lab, "empty", 80, "TCP", "node-2");
        assert_answered_by(
            &x,
            np1,
            "TCP",
            5,
            &["k4-1"],
            "K4 eTP Local, external → node-1",
        );
        let before = stat(lab, "node-2", "drop_no_local_backend");
        assert_tcp_dropped(
            &x,
            np2,
            2,
            "K4 eTP Local, external → node-2 (no local endpoint)",
        );
        let unp2 = node_port(lab, "empty", 80, "UDP", "node-2");
        let r = client::udp_request(&x, unp2, b"hostname\n", T, None);
        println!("K4 eTP Local, UDP external → node-2: {r:?}");
        assert!(
            matches!(&r, Err(e) if e.kind() == io::ErrorKind::TimedOut),
            "K4 eTP Local: UDP to node-2 should be dropped: {r:?}"
        );
        let after = stat(lab, "node-2", "drop_no_local_backend");
        println!("K4 node-2 drop_no_local_backend {before} → {after}");
        assert!(
            after >= before + 3,
            "K4: node-2 drops not counted ({before} → {after})"
        );
    });
}

/// loadBalancerSourceRanges: an LB IP (198.19.100.50, routed via node-1)
/// with ranges containing the external client answers it; the ranges changed
/// live to exclude it → new flows dropped and counted in node-1's
/// drop_source_range, while the NodePort of the same Service (ranges do not
/// apply) still answers; ranges back → answered again.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn lb_source_ranges_inside_allowed_outside_dropped() {
    let lb = Ipv4Addr::new(198, 19, 100, 50);
    let s = svc("ranged", "LoadBalancer")
        .selector("ranged")
        .ports([tcp(80)])
        .lb_ips(&[lb])
        .source_ranges(&["198.18.0.100/32", "198.18.7.0/24"]);
    let yaml = manifests(&[
        &Pod::new("ranged-1", "ranged")
            .node("node-1")
            .port(80, "TCP"),
        &Pod::new("ranged-2", "ranged")
            .node("node-2")
            .port(80, "TCP"),
        &s,
    ]);
    with_lab("source_ranges", 2, &yaml, |lab| {
        ext_route(lab, lb, "node-1");
        let x = ext(lab);
        let vip = SocketAddrV4::new(lb, 80);
        assert_answered_by(
            &x,
            vip,
            "TCP",
            N,
            &["ranged-1", "ranged-2"],
            "source ranges: inside (198.18.0.100/32)",
        );
        let outside = s.clone().source_ranges(&["198.18.7.0/24"]);
        apply(lab, &outside.yaml());
        let before = stat(lab, "node-1", "drop_source_range");
        assert_tcp_dropped(&x, vip, 3, "source ranges: outside (198.18.7.0/24 only)");
        let after = stat(lab, "node-1", "drop_source_range");
        println!("source ranges: node-1 drop_source_range {before} → {after}");
        // A dropped SYN is retransmitted within the 2 s timeout: at least one per try.
        assert!(
            after >= before + 3,
            "source ranges: drops not counted ({before} → {after})"
        );
        let np = node_port(lab, "ranged", 80, "TCP", "node-1");
        // 20 requests: both pods answer but with probability 2^-19.
        assert_answered_by(
            &x,
            np,
            "TCP",
            20,
            &["ranged-1", "ranged-2"],
            "source ranges: the NodePort is not filtered",
        );
        apply(lab, &s.yaml());
        assert_answered_by(
            &x,
            vip,
            "TCP",
            10,
            &["ranged-1", "ranged-2"],
            "source ranges: inside again",
        );
    });
}

/// Waits (up to the lab's [`Lab::sync_timeout`]) until `node`'s agent
/// logged a line with `change` and, after it, a `sync complete`: the sync
/// that programmed the change. Returns how long that took.
fn wait_change_synced(lab: &Lab, node: &str, change: &str) -> Duration {
    let sync_timeout = lab.sync_timeout();
    let t = Instant::now();
    loop {
        let log = lab.agent_log_on(node).expect("agent log");
        if let Some(at) = log.find(change) {
            if log[at..].contains(xtask::lab::SYNC_MARKER) {
                return t.elapsed();
            }
        }
        assert!(
            t.elapsed() < sync_timeout,
            "{node}'s agent did not log {change:?} and a sync after it within {sync_timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An address added to a node's interface after the agents started (a
/// keepalived or kube-vip VIP, 198.18.0.61/24 on node-1's `eth0`) serves
/// the NodePorts from the next sync on, as under kube-proxy's iptables mode
/// (`--dst-type LOCAL`): the external client reaches both pods through it
/// (the local one, and the remote one SNATed to node-1's address). Once
/// removed, it is not served: node-1 no longer owns the address, and the
/// client's connections time out (no refusal: no stack owns the address).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn node_port_on_an_address_added_to_the_node_later_and_removed() {
    let vip = Ipv4Addr::new(198, 18, 0, 61);
    let yaml = manifests(&[
        &Pod::new("vip-1", "vip").node("node-1").port(80, "TCP"),
        &Pod::new("vip-2", "vip").node("node-2").port(80, "TCP"),
        &svc("vip", "NodePort").selector("vip").ports([tcp(80)]),
    ]);
    with_lab("vip", 2, &yaml, |lab| {
        let x = ext(lab);
        let np = node_port(lab, "vip", 80, "TCP", "node-1");
        let at_vip = SocketAddrV4::new(vip, np.port());
        assert_answered_by(
            &x,
            np,
            "TCP",
            N,
            &["vip-1", "vip-2"],
            "VIP: node-1's own address",
        );
        let node1 = lab.node_named("node-1").expect("node-1").clone();
        let cidr = format!("{vip}/24");
        xtask::netns::ip_in(&node1.netns, &["addr", "add", &cidr, "dev", &node1.eth])
            .unwrap_or_else(|e| panic!("ip addr add {cidr}: {e:#}"));
        let took = wait_change_synced(lab, "node-1", &format!("node addresses changed: +{vip}"));
        println!("VIP: added, synced in {} ms", took.as_millis());
        assert_answered_by(
            &x,
            at_vip,
            "TCP",
            N,
            &["vip-1", "vip-2"],
            "VIP: added to eth0",
        );

        xtask::netns::ip_in(&node1.netns, &["addr", "del", &cidr, "dev", &node1.eth])
            .unwrap_or_else(|e| panic!("ip addr del {cidr}: {e:#}"));
        let took = wait_change_synced(lab, "node-1", &format!("node addresses changed: -{vip}"));
        println!("VIP: removed, synced in {} ms", took.as_millis());
        // No answer, not even a refusal: the client's neighbour entry
        // still sends to node-1, which no longer owns the address and
        // forwards it to a neighbour nobody answers for (its host
        // unreachable comes after the client's 2 s).
        for i in 0..5 {
            match client::tcp_request(&x, at_vip, b"hostname\n", T) {
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {}
                other => panic!(
                    "VIP: removed, try {}: expected a timeout, got {other:?}",
                    i + 1
                ),
            }
        }
        println!(
            "VIP: removed from eth0: 5 tries to {at_vip} timed out; the client's neighbour entry: {:?}",
            xtask::netns::ip_in(&x, &["neigh", "show", &vip.to_string()]).unwrap_or_default()
        );
        // node-1's own address still serves it.
        assert_answered_by(&x, np, "TCP", N, &["vip-1", "vip-2"], "VIP: node-1 after");
    });
}

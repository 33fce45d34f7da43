//! Lab tests: real sockets between network namespaces, through the agent's
//! datapath. Each test builds its own lab (unique `kpr-<id>-` namespaces and
//! bpffs directory) and lets it drop at the end, also on failure.
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --bins && cargo test -p xtask --test lab -- --include-ignored --test-threads=2`.
//!
//! On failure the agent's log tail and `proxy-agent inspect services|stats|conntrack`
//! are printed before the lab is torn down; set `KPR_LAB_DIAG=1` to print them
//! after every test.

use std::collections::BTreeMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use xtask::client::{self, reply_text};
use xtask::netns::in_netns;
use xtask::Lab;

mod support;
use support::{
    assert_tcp_refused, describe, frontend, run_lab, tcp_hostname, tcp_hostnames, wait_veth_gone,
    Shot, UdpProbe, T,
};

/// How long the agent may take to come up, or to sync a change.
const SYNC_TIMEOUT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------- manifests

/// A Pod labelled `app: <app>`; `ports` are `(name, containerPort, protocol)`
/// (empty name: unnamed). No ports: the lab's server listens on 80.
fn pod(name: &str, app: &str, ports: &[(&str, u16, &str)]) -> String {
    let mut y = format!(
        "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  labels:\n    app: {app}\nspec:\n  containers:\n  - name: c\n    image: lab-server\n"
    );
    if !ports.is_empty() {
        y.push_str("    ports:\n");
        for (n, p, proto) in ports {
            y.push_str(&format!(
                "    - containerPort: {p}\n      protocol: {proto}\n"
            ));
            if !n.is_empty() {
                y.push_str(&format!("      name: {n}\n"));
            }
        }
    }
    y
}

/// A Service selecting `app: <app>`; `ports` are `(name, port, targetPort,
/// protocol)` where targetPort is a number or a port name.
fn svc(name: &str, app: &str, ports: &[(&str, u16, &str, &str)]) -> String {
    svc_ip(name, app, ports, None)
}

/// [`svc`] with an explicit ClusterIP.
fn svc_ip(
    name: &str,
    app: &str,
    ports: &[(&str, u16, &str, &str)],
    cluster_ip: Option<&str>,
) -> String {
    let mut y = format!(
        "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\nspec:\n  selector:\n    app: {app}\n"
    );
    if let Some(ip) = cluster_ip {
        y.push_str(&format!("  clusterIP: {ip}\n"));
    }
    y.push_str("  ports:\n");
    for (n, p, t, proto) in ports {
        y.push_str(&format!(
            "  - name: {n}\n    port: {p}\n    targetPort: {t}\n    protocol: {proto}\n"
        ));
    }
    y
}

// ---------------------------------------------------------------- lab runner

/// Starts a lab with `yaml`, waits for the agent's first sync and its
/// attachments ([`wait_attached`]), runs `f`; see [`support::run_lab`].
fn with_lab(test: &str, yaml: &str, f: impl FnOnce(&mut Lab)) {
    run_lab(
        test,
        Lab::builder().manifests_yaml(yaml),
        "",
        |lab| {
            lab.wait_ready(SYNC_TIMEOUT)
                .unwrap_or_else(|e| panic!("agent not ready: {e:#}"));
            wait_attached(lab);
        },
        |lab| support::diagnostics(lab, None),
        f,
    )
}

/// Waits until the agent logged `attached pod program` for the host-side
/// veth of every client and pod of the lab. The agent attaches its programs
/// from a netlink watch, independently of its syncs: `sync complete` (what
/// `wait_ready`/`wait_synced` wait for) can come before the attachments, and
/// traffic in between bypasses the datapath.
fn wait_attached(lab: &Lab) {
    let mut ifs: Vec<String> = vec![lab.client().host_if.clone()];
    ifs.extend(lab.info().clients.iter().map(|c| c.host_if.clone()));
    ifs.extend(lab.pods().iter().map(|p| p.host_if.clone()));
    ifs.retain(|i| !i.is_empty());
    let t = Instant::now();
    let deadline = t + SYNC_TIMEOUT;
    loop {
        let log = lab.agent_log();
        let missing: Vec<&String> = ifs
            .iter()
            .filter(|i| {
                !log.lines()
                    .any(|l| l.contains("attached pod program") && l.contains(&format!("\"{i}\"")))
            })
            .collect();
        if missing.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "agent did not attach to {missing:?} within {SYNC_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `wait_synced` after a manifest change, then [`wait_attached`].
fn synced(lab: &mut Lab) {
    lab.wait_synced(SYNC_TIMEOUT)
        .unwrap_or_else(|e| panic!("agent did not sync: {e:#}"));
    wait_attached(lab);
}

/// `lab.delete_pod(name)` (which waits for the agent's sync), then waits
/// until the pod's host-side veth is gone from the node namespace. `ip netns
/// del` returns before the kernel destroyed the namespace's veth, and the lab
/// frees the pod's IP at once: a pod created right after may get the same IP
/// and fail with `route add ...: File exists` while the old veth (and its /32
/// route) linger. Returns how long `lab.delete_pod` took.
fn delete_pod(lab: &mut Lab, name: &str) -> Duration {
    let host_if = lab.pod(name).map(|p| p.host_if.clone()).unwrap_or_default();
    let t = Instant::now();
    lab.delete_pod(name)
        .unwrap_or_else(|e| panic!("delete_pod({name}): {e:#}"));
    let took = t.elapsed();
    if host_if.is_empty() {
        return took;
    }
    let node = lab.node().netns.clone();
    wait_veth_gone(&node, &host_if, name);
    took
}

// ---------------------------------------------------------------- requests

fn udp_hostname(
    ns: &str,
    addr: SocketAddrV4,
    bind_port: Option<u16>,
    timeout: Duration,
) -> io::Result<String> {
    client::udp_request(ns, addr, b"hostname", timeout, bind_port).map(|r| reply_text(&r))
}

/// Asserts that `n` connections to `addr` all succeed and are answered by
/// exactly the pods `expected`.
fn assert_answered_by(ns: &str, addr: SocketAddrV4, n: usize, expected: &[&str], what: &str) {
    support::assert_answered_by(ns, addr, n, expected, what, false)
}

// ================================================================ tests

/// S1 — should serve a basic endpoint from pods: ClusterIP TCP svc port 80;
/// pod1, then pod2 added one after another, then deleted one after another;
/// "the service stays reachable after each add or delete" and serves exactly
/// the pods it has. With no pods left, connects are refused.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s1_basic_endpoint_added_and_removed() {
    let yaml =
        svc("web", "web", &[("http", 80, "80", "TCP")]) + &pod("pod-1", "web", &[("", 80, "TCP")]);
    with_lab("s1", &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let vip = frontend(lab, "web", 80, "TCP");
        assert_answered_by(&ns, vip, 10, &["pod-1"], "S1 pod-1 only");

        lab.apply(&pod("pod-2", "web", &[("", 80, "TCP")])).unwrap();
        synced(lab);
        assert_answered_by(&ns, vip, 60, &["pod-1", "pod-2"], "S1 pod-1 + pod-2");

        let _ = delete_pod(lab, "pod-1");
        assert_answered_by(&ns, vip, 30, &["pod-2"], "S1 pod-1 deleted");

        let _ = delete_pod(lab, "pod-2");
        assert_tcp_refused(&ns, vip, "S1 no pods left");
    });
}

/// S2 — should serve multiport endpoints from pods: svc ports 80 and 81 whose
/// targetPorts are named ports (svc1, svc2); pod1 exposes svc1 on 100, pod2
/// exposes svc2 on 101; "each service port maps only to the pod exposing that
/// named port; both ports reachable".
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s2_multiport_named_target_ports() {
    let yaml = svc(
        "multi",
        "multi",
        &[("p80", 80, "svc1", "TCP"), ("p81", 81, "svc2", "TCP")],
    ) + &pod("pod-1", "multi", &[("svc1", 100, "TCP")])
        + &pod("pod-2", "multi", &[("svc2", 101, "TCP")]);
    with_lab("s2", &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let p80 = frontend(lab, "multi", 80, "TCP");
        let p81 = frontend(lab, "multi", 81, "TCP");
        assert_answered_by(&ns, p80, 20, &["pod-1"], "S2 port 80 -> svc1");
        assert_answered_by(&ns, p81, 20, &["pod-2"], "S2 port 81 -> svc2");
    });
}

/// S4 — should preserve source pod IP for traffic thru service cluster IP:
/// "the source IP seen by the backend equals the client pod IP (no SNAT for
/// pod→ClusterIP)".
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s4_client_ip_preserved_through_cluster_ip() {
    let yaml = svc("echo", "echo", &[("http", 8080, "8080", "TCP")])
        + &pod("echo-1", "echo", &[("", 8080, "TCP")]);
    with_lab("s4", &yaml, |lab| {
        let client = lab.client().clone();
        let vip = frontend(lab, "echo", 8080, "TCP");
        for i in 0..5 {
            let r = client::tcp_request(&client.netns, vip, b"clientip\n", T)
                .map(|r| reply_text(&r))
                .unwrap_or_else(|e| panic!("S4 request {i} to {vip}: {e}"));
            println!("S4: backend saw {r} (client is {})", client.ip);
            let ip = r.rsplit_once(':').map(|(ip, _)| ip).unwrap_or("");
            assert_eq!(
                ip,
                client.ip.to_string(),
                "S4: source IP seen by the backend"
            );
        }
    });
}

/// S5 — should allow pods to hairpin back to themselves through services:
/// ClusterIP svc whose only endpoint is pod P; from P itself to
/// clusterIP:8080 "the connection succeeds".
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s5_hairpin_pod_reaches_itself_through_its_service() {
    let yaml = svc("hairpin", "hp", &[("http", 8080, "8080", "TCP")])
        + &pod("hp-1", "hp", &[("", 8080, "TCP")]);
    with_lab("s5", &yaml, |lab| {
        let p = lab.pod("hp-1").expect("pod hp-1").clone();
        let vip = frontend(lab, "hairpin", 8080, "TCP");
        for i in 0..5 {
            let name = tcp_hostname(&p.netns, vip)
                .unwrap_or_else(|e| panic!("S5 hairpin request {i} from {} to {vip}: {e}", p.ip));
            assert_eq!(name, "hp-1", "S5: hairpin answer");
        }
        let seen = client::tcp_request(&p.netns, vip, b"clientip\n", T)
            .map(|r| reply_text(&r))
            .expect("S5 clientip");
        println!(
            "S5: {} -> {vip} -> itself ok; backend saw source {seen}",
            p.ip
        );
    });
}

/// S6 — should be able to up and down services: 3 services; "after the
/// delete, svc1's VIP refuses or times out while svc2 still works; svc3 gets
/// a different IP and works". S7 — should work after the service has been
/// recreated: "the recreated service works at its new VIP".
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s6_s7_services_up_down_and_recreated() {
    let mut yaml = String::new();
    for s in ["a", "b", "c"] {
        yaml += &svc(&format!("svc-{s}"), s, &[("http", 80, "80", "TCP")]);
        yaml += &pod(&format!("{s}-1"), s, &[]);
        yaml += &pod(&format!("{s}-2"), s, &[]);
    }
    with_lab("s6_s7", &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let vip: BTreeMap<&str, SocketAddrV4> = ["a", "b", "c"]
            .into_iter()
            .map(|s| (s, frontend(lab, &format!("svc-{s}"), 80, "TCP")))
            .collect();
        for (s, addr) in &vip {
            assert_answered_by(
                &ns,
                *addr,
                30,
                &[&format!("{s}-1"), &format!("{s}-2")],
                &format!("S6 svc-{s} up"),
            );
        }

        // Down: delete svc-a and its pods.
        lab.delete_service("svc-a").unwrap();
        synced(lab);
        let _ = delete_pod(lab, "a-1");
        let _ = delete_pod(lab, "a-2");
        let t = Instant::now();
        let r = tcp_hostname(&ns, vip["a"]);
        println!(
            "S6: deleted svc-a {}: {r:?} after {} ms",
            vip["a"],
            t.elapsed().as_millis()
        );
        assert!(
            r.is_err(),
            "S6: deleted svc-a's VIP {} still answers: {r:?}",
            vip["a"]
        );
        assert_answered_by(
            &ns,
            vip["b"],
            30,
            &["b-1", "b-2"],
            "S6 svc-b after svc-a down",
        );
        assert_answered_by(
            &ns,
            vip["c"],
            30,
            &["c-1", "c-2"],
            "S6 svc-c after svc-a down",
        );

        // A new service: the lab's allocator may hand out svc-a's old VIP; only
        // svc-d's pods may answer there.
        lab.apply(
            &(svc("svc-d", "d", &[("http", 80, "80", "TCP")])
                + &pod("d-1", "d", &[])
                + &pod("d-2", "d", &[])),
        )
        .unwrap();
        synced(lab);
        let d = frontend(lab, "svc-d", 80, "TCP");
        println!("S6: new svc-d at {d} (svc-a was at {})", vip["a"]);
        assert_answered_by(&ns, d, 30, &["d-1", "d-2"], "S6 new svc-d");

        // S7: recreate svc-a (and its pods) with a new ClusterIP.
        let new_ip = "198.19.0.200";
        lab.apply(
            &(svc_ip("svc-a", "a", &[("http", 80, "80", "TCP")], Some(new_ip))
                + &pod("a-1", "a", &[])
                + &pod("a-2", "a", &[])),
        )
        .unwrap();
        synced(lab);
        let a2 = frontend(lab, "svc-a", 80, "TCP");
        assert_ne!(
            a2.ip(),
            vip["a"].ip(),
            "S7: recreated service has a new VIP"
        );
        assert_answered_by(&ns, a2, 30, &["a-1", "a-2"], "S7 recreated svc-a");
        assert_answered_by(&ns, vip["b"], 10, &["b-1", "b-2"], "S7 svc-b still up");
    });
}

/// S29 — should be rejected when no endpoints exist: "the error contains
/// REFUSED: an active reject (TCP RST or ICMP unreachable), not a timeout".
/// K4 (from a pod, through its veth) — "immediate ECONNREFUSED (ICMP
/// port-unreachable; TCP RST also acceptable)"; for UDP (C2) "UDP gets
/// ECONNREFUSED on the next recv".
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s29_k4_no_endpoints_rejected_from_pod() {
    let yaml = svc(
        "empty",
        "nobody",
        &[("http", 80, "80", "TCP"), ("dns", 53, "53", "UDP")],
    );
    with_lab("s29_k4", &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let tcp = frontend(lab, "empty", 80, "TCP");
        let udp = frontend(lab, "empty", 53, "UDP");
        let mut worst = Duration::ZERO;
        for _ in 0..5 {
            worst = worst.max(assert_tcp_refused(&ns, tcp, "S29/K4"));
        }
        assert!(
            worst < Duration::from_secs(1),
            "S29/K4: TCP refusal took {worst:?}"
        );
        for i in 0..5 {
            let t = Instant::now();
            let r = udp_hostname(&ns, udp, None, T);
            let el = t.elapsed();
            println!("S29/K4: UDP {udp} try {i}: {r:?} in {} ms", el.as_millis());
            assert!(
                matches!(&r, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused),
                "S29/K4: UDP to a service without endpoints: expected ConnectionRefused, got {r:?} after {} ms",
                el.as_millis()
            );
            assert!(
                el < Duration::from_secs(1),
                "S29/K4: UDP refusal took {el:?}"
            );
        }
    });
}

/// S45 — should support named targetPorts that resolve to different ports on
/// different endpoints: "the proxy must DNAT each backend to its own port,
/// including a mix of 8080 and 8000" (both endpoints must answer, also after
/// an endpoint is replaced by one with the same port name on another port).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s45_named_target_port_differs_per_endpoint() {
    let yaml = svc("mutable", "mut", &[("http", 8001, "http", "TCP")])
        + &pod("pod-1", "mut", &[("http", 8080, "TCP")])
        + &pod("pod-2", "mut", &[("http", 9090, "TCP")]);
    with_lab("s45", &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let vip = frontend(lab, "mutable", 8001, "TCP");
        assert_answered_by(&ns, vip, 60, &["pod-1", "pod-2"], "S45 8080 + 9090");

        let _ = delete_pod(lab, "pod-1");
        lab.apply(&pod("pod-3", "mut", &[("http", 8000, "TCP")]))
            .unwrap();
        synced(lab);
        assert_answered_by(
            &ns,
            vip,
            60,
            &["pod-2", "pod-3"],
            "S45 9090 + 8000 after replacement",
        );
    });
}

fn payload_2000() -> Vec<u8> {
    (0..2000)
        .map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789"[i % 36])
        .collect()
}

/// N19 — should be able to handle large requests (tcp): "echo of a
/// 2,000-byte message via clusterIP: echo intact".
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn n19_large_tcp_request_echoed() {
    let yaml = svc("echo", "echo", &[("tcp", 80, "80", "TCP")]) + &pod("echo-1", "echo", &[]);
    with_lab("n19", &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let vip = frontend(lab, "echo", 80, "TCP");
        let data = payload_2000();
        let mut req = b"echo ".to_vec();
        req.extend_from_slice(&data);
        req.push(b'\n');
        for i in 0..3 {
            let reply = client::tcp_request(&ns, vip, &req, T)
                .unwrap_or_else(|e| panic!("N19 request {i}: {e}"));
            println!("N19: sent {} bytes, got {} bytes", req.len(), reply.len());
            assert_eq!(
                reply.strip_suffix(b"\n"),
                Some(&data[..]),
                "N19: echo not intact"
            );
        }
    });
}

/// N20 — should be able to handle large requests (udp): "2,000-byte UDP
/// datagram echo via clusterIP: echo intact (no truncation or MTU mishandling
/// in the NAT path)".
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn n20_large_udp_datagram_echoed() {
    let yaml = svc("echo", "echo", &[("udp", 80, "80", "UDP")])
        + &pod("echo-1", "echo", &[("", 80, "UDP")]);
    with_lab("n20", &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let vip = frontend(lab, "echo", 80, "UDP");
        // The path works for small datagrams first.
        let small = udp_hostname(&ns, vip, None, T);
        println!("N20: small datagram: {small:?}");
        assert_eq!(
            small.ok().as_deref(),
            Some("echo-1"),
            "N20: small UDP datagram via the VIP"
        );
        let data = payload_2000();
        let mut req = b"echo ".to_vec();
        req.extend_from_slice(&data);
        for i in 0..3 {
            let reply = client::udp_request(&ns, vip, &req, T, None).unwrap_or_else(|e| {
                panic!("N20 datagram {i} of {} bytes to {vip}: {e}", req.len())
            });
            println!(
                "N20: sent {} bytes in one datagram, got {} bytes",
                req.len(),
                reply.len()
            );
            assert_eq!(
                reply.strip_suffix(b"\n"),
                Some(&data[..]),
                "N20: echo not intact"
            );
        }
    });
}

/// K1 — UDP flow keeps using a deleted endpoint. A client binds one socket
/// and sends a datagram to VIP every 100 ms. "Step 1: new datagrams reach B
/// within about 1 s. Step 2: no datagram is forwarded towards any old backend
/// IP. The client gets ICMP port-unreachable, i.e. reject semantics. Step 3:
/// datagrams reach D within about 1 s."
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn k1_udp_flow_leaves_deleted_endpoint() {
    let yaml = svc("statsd", "statsd", &[("udp", 8125, "8125", "UDP")])
        + &pod("pod-a", "statsd", &[("", 8125, "UDP")])
        + &pod("pod-b", "statsd", &[("", 8125, "UDP")]);
    with_lab("k1", &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let vip = frontend(lab, "statsd", 8125, "UDP");
        let interval = Duration::from_millis(100);
        let probe = UdpProbe::start(&ns, vip, 40001, interval, Duration::from_secs(30));
        let origin = Instant::now();
        std::thread::sleep(Duration::from_millis(600));

        // Which pod does the flow use?
        let first = probe.snapshot();
        let answered: Vec<&str> = first
            .iter()
            .filter_map(|s| s.result.as_deref().ok())
            .collect();
        println!("K1 before any change: {}", describe(&first, origin));
        assert!(
            answered.len() >= 3,
            "K1: the flow was not answered before any change: {}",
            describe(&first, origin)
        );
        let x = answered[0].to_string();
        assert!(
            answered.iter().all(|a| *a == x),
            "K1: one UDP flow (same 5-tuple) was answered by different pods: {answered:?}"
        );
        let y = if x == "pod-a" { "pod-b" } else { "pod-a" }.to_string();

        // Step 1: delete the pod the flow uses.
        let t1 = Instant::now();
        let sync1 = delete_pod(lab, &x);
        std::thread::sleep(Duration::from_millis(1200).saturating_sub(t1.elapsed()));

        // Step 2: delete the last pod.
        let t2 = Instant::now();
        let sync2 = delete_pod(lab, &y);
        std::thread::sleep(Duration::from_millis(1500).saturating_sub(t2.elapsed()));

        // Step 3: a new pod.
        lab.apply(&pod("pod-d", "statsd", &[("", 8125, "UDP")]))
            .unwrap();
        let t3 = Instant::now();
        std::thread::sleep(Duration::from_millis(1500));
        let shots = probe.finish();
        println!(
            "K1 flow (ms from first manifest change): {}",
            describe(&shots, t1)
        );
        println!(
            "K1: delete_pod({x}) returned after {} ms, delete_pod({y}) after {} ms",
            sync1.as_millis(),
            sync2.as_millis()
        );

        // Step 1.
        let step1: Vec<&Shot> = shots
            .iter()
            .filter(|s| s.sent >= t1 && s.sent < t2)
            .collect();
        let reach_y = step1.iter().find(|s| s.result.as_deref() == Ok(y.as_str()));
        let Some(reach_y) = reach_y else {
            panic!("K1 step 1: the flow never reached {y} after {x} was deleted")
        };
        let el1 = reach_y.sent - t1;
        println!(
            "K1 step 1: flow reached {y} {} ms after {x} was removed from the manifests",
            el1.as_millis()
        );
        assert!(
            el1 < Duration::from_secs(1),
            "K1 step 1: flow reached {y} only after {el1:?}"
        );
        let after: Vec<&&Shot> = step1.iter().filter(|s| s.sent >= reach_y.sent).collect();
        assert!(
            after.iter().all(|s| s.result.as_deref() == Ok(y.as_str())),
            "K1 step 1: after reaching {y}, the flow did not stay there"
        );

        // Step 2.
        let step2: Vec<&Shot> = shots
            .iter()
            .filter(|s| s.sent >= t2 && s.sent < t3)
            .collect();
        let refused = step2
            .iter()
            .position(|s| s.result == Err(io::ErrorKind::ConnectionRefused));
        let Some(refused) = refused else {
            panic!("K1 step 2: with 0 endpoints the flow was never refused (ICMP)")
        };
        let el2 = step2[refused].sent - t2;
        println!(
            "K1 step 2: flow refused {} ms after the last pod was removed",
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
            "K1 step 2: with 0 endpoints some datagrams were not refused: {:?}",
            bad
        );

        // Step 3.
        let reach_d = shots
            .iter()
            .filter(|s| s.sent >= t3)
            .find(|s| s.result.as_deref() == Ok("pod-d"));
        let Some(reach_d) = reach_d else {
            panic!("K1 step 3: the flow never reached the new pod-d")
        };
        let el3 = reach_d.sent - t3;
        println!(
            "K1 step 3: flow reached pod-d {} ms after it was added to the manifests",
            el3.as_millis()
        );
        assert!(
            el3 < Duration::from_secs(1),
            "K1 step 3: reached pod-d only after {el3:?}"
        );
    });
}

/// K2 — UDP blackhole survives endpoints going 0→N: service with an empty
/// endpoint set, a client sending from a fixed source port; add a ready pod:
/// "the first datagram after the change is forwarded to A, within about 1 s".
/// Also: "the no-backend path must not create a CT entry or any
/// negative-cache state" (before the change, datagrams are refused).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn k2_udp_zero_to_one_endpoint_same_source_port() {
    let yaml = svc("dns", "dns", &[("dns", 53, "53", "UDP")]);
    with_lab("k2", &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let vip = frontend(lab, "dns", 53, "UDP");
        let probe = UdpProbe::start(
            &ns,
            vip,
            40002,
            Duration::from_millis(100),
            Duration::from_secs(20),
        );
        std::thread::sleep(Duration::from_millis(500));
        lab.apply(&pod("dns-1", "dns", &[("", 53, "UDP")])).unwrap();
        let t = Instant::now();
        // About 20 more datagrams after the change.
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
            panic!("K2: the same source port never reached dns-1 after it was added")
        };
        let el = after[first].sent - t;
        println!(
            "K2: first answer from dns-1 {} ms after the change (datagram #{} after it)",
            el.as_millis(),
            first + 1
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

/// Distribution: with 3 endpoints, new connections are spread at random;
/// each pod gets between 25 % and 42 % of 3000 connections.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn distribution_three_pods_3000_connections() {
    let yaml = svc("web", "web", &[("http", 80, "80", "TCP")])
        + &pod("web-1", "web", &[])
        + &pod("web-2", "web", &[])
        + &pod("web-3", "web", &[]);
    with_lab("distribution", &yaml, |lab| {
        let ns = lab.client().netns.clone();
        let vip = frontend(lab, "web", 80, "TCP");
        let n = 3000;
        let t = Instant::now();
        let (counts, errors) = tcp_hostnames(&ns, vip, n);
        let el = t.elapsed();
        println!(
            "distribution: {n} connections in {} ms: {counts:?}, {} errors",
            el.as_millis(),
            errors.len()
        );
        for (pod, c) in &counts {
            println!(
                "distribution: {pod}: {c} ({:.1} %)",
                *c as f64 * 100.0 / n as f64
            );
        }
        assert!(
            errors.is_empty(),
            "distribution: {} errors, e.g. {:?}",
            errors.len(),
            &errors[..errors.len().min(5)]
        );
        assert_eq!(counts.len(), 3, "distribution: pods seen {counts:?}");
        for (pod, c) in &counts {
            let share = *c as f64 / n as f64;
            assert!(
                (0.25..=0.42).contains(&share),
                "distribution: {pod} got {c} of {n} ({:.1} %)",
                share * 100.0
            );
        }
    });
}

/// `GET <path>` on `addr` from inside the node's namespace (the agent's
/// metrics listen on the node's loopback, as kube-proxy's do).
fn http_get_in(ns: &str, addr: SocketAddrV4, path: &str) -> String {
    use std::io::{Read, Write};
    let p = path.to_string();
    in_netns(ns, move || -> io::Result<String> {
        let mut s = std::net::TcpStream::connect_timeout(&addr.into(), T)?;
        s.set_read_timeout(Some(T))?;
        write!(s, "GET {p} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body)
    })
    .and_then(|r| r)
    .unwrap_or_else(|e| panic!("GET {path} from {addr} in {ns}: {e}"))
}

/// The value of the series `name{label="value"}` in Prometheus text, 0 if absent.
fn series(text: &str, name: &str, label: &str, value: &str) -> u64 {
    let prefix = format!("{name}{{{label}=\"{value}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Issue 3: the metrics' datapath counters move with real traffic — per
/// frontend, per backend, and by verdict — and /healthz answers with
/// kube-proxy's body once the agent has synced.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn metrics_counters_move_with_real_traffic() {
    let yaml = svc("web", "web", &[("http", 80, "80", "TCP")]) + &pod("web-1", "web", &[]);
    with_lab("metrics", &yaml, |lab| {
        let node_ns = lab.node().netns.clone();
        let metrics = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10249);
        let vip = frontend(lab, "web", 80, "TCP");
        let pod_ip = lab.pod("web-1").unwrap().ip;
        let fe = format!("{vip}/TCP");
        let be = format!("{pod_ip}:80/TCP");
        let before = http_get_in(&node_ns, metrics, "/metrics");
        let client = lab.client().clone();
        for i in 0..20 {
            client::tcp_request(&client.netns, vip, b"hostname\n", T)
                .unwrap_or_else(|e| panic!("request {i}: {e}"));
        }
        let after = http_get_in(&node_ns, metrics, "/metrics");
        let d = |name: &str, label: &str, value: &str| {
            series(&after, name, label, value) - series(&before, name, label, value)
        };
        let fe_packets = d("proxy_agent_frontend_packets_total", "frontend", &fe);
        let be_packets = d("proxy_agent_backend_packets_total", "backend", &be);
        let fe_bytes = d("proxy_agent_frontend_bytes_total", "frontend", &fe);
        let new_flows = d("proxy_agent_datapath_packets_total", "reason", "fwd_new");
        println!("metrics: +{fe_packets} packets / +{fe_bytes} bytes on {fe}, +{be_packets} on {be}, +{new_flows} new flows");
        // 20 connections, each at least SYN, SYN-ACK, ACK, request, reply, FINs.
        assert!(
            fe_packets >= 20 * 5,
            "frontend packets moved by {fe_packets}"
        );
        assert_eq!(
            fe_packets, be_packets,
            "one frontend, one backend: same packets"
        );
        assert!(fe_bytes >= fe_packets * 54, "bytes count whole frames");
        assert_eq!(new_flows, 20, "one new flow per connection");
        let health = http_get_in(
            &node_ns,
            SocketAddrV4::new(lab.node().ip, 10256),
            "/healthz",
        );
        assert!(
            health.starts_with("HTTP/1.0 200") || health.starts_with("HTTP/1.1 200"),
            "{health}"
        );
        assert!(
            health.contains("\"lastUpdated\"") && health.contains("\"currentTime\""),
            "{health}"
        );
    });
}

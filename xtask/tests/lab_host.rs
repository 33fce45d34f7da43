//! Lab tests of the node's own clients (host processes, hostNetwork pods):
//! socket-level load balancing on cgroup hooks. Each node of the lab has its
//! own cgroup (never the machine's root cgroup); its agent attaches the hooks
//! there, and the host clients here (`lab-host-client`) run in the node's
//! namespace and that cgroup, as a hostNetwork pod does on a node. Named
//! after the rows of `../shared/conformance/service-behaviours.md`.
//!
//! The last section, H6-1 to H6-3 and D4/D5, covers IPv6 sockets: IPv6
//! ClusterIPs in a dual-stack lab, dual-stack sockets to IPv4 ClusterIPs
//! (`::ffff:a.b.c.d`), and a dual-stack Service's secondary ClusterIP and
//! IPv6 NodePort (D4, D5).
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --bins && cargo test -p xtask --test lab_host -- --include-ignored`.
//!
//! Why one file (about 1,200 lines): every test drives `lab-host-client` in
//! a node's namespace and cgroup through the same helpers (`host`,
//! `assert_every`, `svc_and_pods`), and the VM kernel matrix runs the
//! connected-UDP tests from this binary by name (`xtask/src/vm/plan.rs`).
//! The file is in sections: ClusterIPs and NodePorts from the node, UDP
//! sockets across backend changes, DNS, agent restarts, source ranges, then
//! IPv6.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::time::{Duration, Instant};

use xtask::{HostClient, HostReply, Lab};

mod support;
use support::fixtures::{manifests, tcp_and_udp, Ep, Pod, Port, Slice, Svc};
use support::{delete_pod, frontend, frontend6, stat, HostServer, LabTest};

const NODE_PORT: u16 = 30080;
/// Requests per check of "every endpoint answers".
const N: usize = 40;

fn host(lab: &Lab, node: &str) -> HostClient {
    lab.host_client(node)
        .unwrap_or_else(|e| panic!("host client on {node}: {e:#}"))
}

fn node_ip(lab: &Lab, node: &str) -> Ipv4Addr {
    lab.node_named(node).expect("node").ip
}

fn assert_every(
    c: &mut HostClient,
    proto: &str,
    addr: impl Into<SocketAddr>,
    pods: &[&str],
    what: &str,
) {
    let addr: SocketAddr = addr.into();
    let counts = support::host_spread(c, proto, addr, N);
    let want: BTreeMap<String, ()> = pods.iter().map(|p| (p.to_string(), ())).collect();
    let seen: BTreeMap<String, ()> = counts.keys().map(|k| (k.clone(), ())).collect();
    assert_eq!(seen, want, "{what}: {proto} {addr} answered by {counts:?}");
}

fn two_pod_service() -> String {
    manifests(&[
        &Svc::new("web")
            .selector("web")
            .service_type("NodePort")
            .port(Port::tcp("t", 80).node_port(NODE_PORT))
            .port(Port::udp("u", 80).node_port(NODE_PORT)),
        &Pod::new("web-1", "web")
            .node("node-1")
            .port(80, "TCP")
            .port(80, "UDP"),
        &Pod::new("web-2", "web")
            .node("node-2")
            .port(80, "TCP")
            .port(80, "UDP"),
    ])
}

/// C4, N5, N15 (and verifyServeHostnameServiceUp from a hostNetwork pod):
/// from node-1's own namespace, the ClusterIP and node-1's
/// `nodeIP:nodePort`, TCP and UDP, reach every endpoint, on this node and
/// the other; the client sees the frontend as its peer.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn c4_n5_n15_node_reaches_cluster_ip_and_node_port() {
    let lab_test = LabTest::new("c4_n5_n15").nodes(2).yaml(&two_pod_service());
    lab_test.run(|lab| {
        let mut c = host(lab, "node-1");
        let pods = ["web-1", "web-2"];
        for proto in ["TCP", "UDP"] {
            let vip = frontend(lab, "web", 80, proto);
            assert_every(&mut c, proto, vip, &pods, "node → ClusterIP");
            let np = SocketAddrV4::new(node_ip(lab, "node-1"), NODE_PORT);
            assert_every(&mut c, proto, np, &pods, "node → own nodeIP:nodePort");
        }
        // A hostNetwork client of node-2 too.
        let mut c2 = host(lab, "node-2");
        let vip = frontend(lab, "web", 80, "TCP");
        assert_every(&mut c2, "TCP", vip, &pods, "node-2 → ClusterIP");
    });
}

/// N21: endpoints that are hostNetwork (their addresses are the nodes'):
/// node → ClusterIP and nodePort, TCP and UDP, including this node's own
/// address as a backend; a pod client as well.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn n21_service_endpoints_using_host_network() {
    const PORT: u16 = 9376;
    let lab_yaml = manifests(&[&Svc::new("hostnet")
        .service_type("NodePort")
        .port(Port::tcp("t", 80).target_port(PORT).node_port(NODE_PORT))
        .port(Port::udp("u", 80).target_port(PORT).node_port(NODE_PORT))]);
    // The slice names the node addresses: written once the lab is up.
    LabTest::new("n21").nodes(2).yaml(&lab_yaml).run(|lab| {
        let _s1 = HostServer::start(lab, "node-1", "host-node-1", PORT);
        let _s2 = HostServer::start(lab, "node-2", "host-node-2", PORT);
        let slice = Slice::new("hostnet-1", "hostnet")
            .port("t", PORT, "TCP")
            .port("u", PORT, "UDP")
            .endpoint(Ep::new(node_ip(lab, "node-1")).node("node-1"))
            .endpoint(Ep::new(node_ip(lab, "node-2")).node("node-2"));
        support::apply(lab, &manifests(&[&slice]));
        let both = ["host-node-1", "host-node-2"];
        let mut c = host(lab, "node-1");
        for proto in ["TCP", "UDP"] {
            let vip = frontend(lab, "hostnet", 80, proto);
            assert_every(
                &mut c,
                proto,
                vip,
                &both,
                "node → ClusterIP (hostNetwork backends)",
            );
            let np = SocketAddrV4::new(node_ip(lab, "node-1"), NODE_PORT);
            assert_every(
                &mut c,
                proto,
                np,
                &both,
                "node → nodePort (hostNetwork backends)",
            );
        }
        // A pod client reaches them too (the tc path).
        let ns = support::client_on(lab, "node-1").netns;
        let vip = frontend(lab, "hostnet", 80, "TCP");
        support::assert_answered_by(
            &ns,
            vip,
            "TCP",
            N,
            &both,
            "pod → ClusterIP (hostNetwork backends)",
        );
    });
}

/// S29/K4 from the node, and verifyServeHostnameServiceDown: a Service
/// without endpoints refuses at once (`connect()` and an unconnected UDP
/// send fail with ECONNREFUSED, not a timeout); once the Service of a
/// working VIP is deleted, the node's connects to it no longer reach a pod.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s29_k4_node_client_refused_at_once() {
    let yaml = manifests(&[
        &Svc::new("empty")
            .selector("nothing")
            .port(Port::tcp("t", 80))
            .port(Port::udp("u", 80)),
        &Svc::new("web").selector("web").port(Port::tcp("t", 80)),
        &Pod::new("web-1", "web").node("node-1").port(80, "TCP"),
    ]);
    LabTest::new("s29_k4_host").nodes(1).yaml(&yaml).run(|lab| {
        let mut c = host(lab, "node-1");
        let tcp = frontend(lab, "empty", 80, "TCP");
        let udp = frontend(lab, "empty", 80, "UDP");
        for _ in 0..5 {
            let r = c.tcp(tcp, "hostname").expect("host client");
            assert_eq!(r.error_kind(), Some("refused"), "TCP to {tcp}: {r:?}");
            let r = c.udp(udp, "hostname").expect("host client");
            assert_eq!(r.error_kind(), Some("refused"), "UDP to {udp}: {r:?}");
        }
        let vip = frontend(lab, "web", 80, "TCP");
        assert_every(&mut c, "TCP", vip, &["web-1"], "before the delete");
        lab.delete_service("web").expect("delete");
        support::synced(lab);
        for _ in 0..5 {
            let r = c.tcp(vip, "hostname").expect("host client");
            assert!(
                r.text().is_none(),
                "{vip} still answers after its Service's delete: {r:?}"
            );
        }
    });
}

/// L1, L2: `127.0.0.1:nodePort` from the node reaches backends on this node
/// and on the other (not sticky); with ClientIP affinity, 15 consecutive
/// answers come from one backend.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn l1_l2_localhost_node_ports() {
    let yaml = manifests(&[
        &Svc::new("web")
            .selector("web")
            .service_type("NodePort")
            .port(Port::tcp("t", 80).node_port(NODE_PORT)),
        &Svc::new("sticky")
            .selector("web")
            .service_type("NodePort")
            .client_ip_affinity(Some(10_800))
            .port(Port::tcp("t", 80).node_port(NODE_PORT + 1)),
        &Pod::new("web-1", "web").node("node-1").port(80, "TCP"),
        &Pod::new("web-2", "web").node("node-2").port(80, "TCP"),
        &Pod::new("web-3", "web").node("node-2").port(80, "TCP"),
    ]);
    LabTest::new("l1_l2").nodes(2).yaml(&yaml).run(|lab| {
        let mut c = host(lab, "node-1");
        let lo = SocketAddrV4::new(Ipv4Addr::LOCALHOST, NODE_PORT);
        assert_every(
            &mut c,
            "TCP",
            lo,
            &["web-1", "web-2", "web-3"],
            "L1: 127.0.0.1:nodePort",
        );
        let sticky = SocketAddrV4::new(Ipv4Addr::LOCALHOST, NODE_PORT + 1);
        let counts = support::host_spread(&mut c, "TCP", sticky, 15);
        assert_eq!(
            counts.len(),
            1,
            "L2: 15 answers from one backend: {counts:?}"
        );
        assert!(
            !counts.keys().next().expect("one").starts_with("error"),
            "L2: {counts:?}"
        );
    });
}

/// The ClusterIP of `service`'s UDP port `port`, of IPv6 when `six`.
fn udp_vip(lab: &Lab, service: &str, port: u16, six: bool) -> SocketAddr {
    if six {
        frontend6(lab, service, port, "UDP")
    } else {
        frontend(lab, service, port, "UDP").into()
    }
}

/// Which frontend of a UDP Service on port 53 (NodePort [`NODE_PORT`]) a
/// host client of node-1 sends to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Via {
    /// Its ClusterIP.
    ClusterIp,
    /// node-1's `nodeIP:nodePort` (its IPv6 address in IPv6 labs).
    NodePort,
    /// `127.0.0.1:nodePort` (IPv4 only, as kube-proxy's
    /// `localhostNodePorts`).
    LocalhostNodePort,
}

/// The address of `service`'s frontend `via` (of IPv6 when `six`).
fn udp_target(lab: &Lab, service: &str, six: bool, via: Via) -> SocketAddr {
    let node = lab.node_named("node-1").expect("node-1");
    match via {
        Via::ClusterIp => udp_vip(lab, service, 53, six),
        Via::NodePort if six => {
            SocketAddr::new(node.ip6.expect("node-1's IPv6 address").into(), NODE_PORT)
        }
        Via::NodePort => SocketAddr::new(node.ip.into(), NODE_PORT),
        Via::LocalhostNodePort => SocketAddrV4::new(Ipv4Addr::LOCALHOST, NODE_PORT).into(),
    }
}

/// Pod `name` of app `app` on `node`, serving UDP port 53.
fn udp53_pod(app: &str, name: &str, node: &str) -> Pod {
    Pod::new(name, app).node(node).port(53, "UDP")
}

/// A two-node lab `name` (dual-stack, and `6` appended, when `six`) with a
/// UDP Service `app` on port 53 (IPv6-only when `six`; of type NodePort,
/// [`NODE_PORT`], unless `via` is its ClusterIP) and `pods`.
fn udp53_lab(name: &str, app: &str, pods: &[Pod], six: bool, via: Via) -> LabTest {
    let mut svc = Svc::new(app).selector(app);
    svc = if via == Via::ClusterIp {
        svc.port(Port::udp("u", 53))
    } else {
        svc.service_type("NodePort")
            .port(Port::udp("u", 53).node_port(NODE_PORT))
    };
    if six {
        svc = svc.ipv6_only();
    }
    let lab_test = LabTest::new(&format!("{name}{}", if six { "6" } else { "" }))
        .nodes(2)
        .yaml(&svc_and_pods(&svc, pods));
    if six {
        lab_test.dual_stack()
    } else {
        lab_test
    }
}

/// The pod that answered a `hostname` request.
fn answered_by(r: &HostReply) -> Option<&str> {
    r.text().and_then(|t| t.split_whitespace().next())
}

/// Sends `hostname` on the connected socket `name` until `pod` answers
/// (10 s at most), then 10 more times, each answered by `pod`. No send may
/// fail: a datagram may go unanswered (one in flight to a backend just
/// removed), nothing else.
fn until_answered_by(c: &mut HostClient, name: &str, pod: &str, what: &str) -> Duration {
    let t = Instant::now();
    let mut unanswered = 0;
    loop {
        let r = c.udp_send(name, "hostname").expect("send");
        match &r {
            HostReply::Ok { .. } if answered_by(&r) == Some(pod) => break,
            HostReply::Ok { .. } => {}
            HostReply::Err { kind, .. } if kind == "timeout" => unanswered += 1,
            HostReply::Err { .. } => panic!("{what}: a send on the connected socket failed: {r:?}"),
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{what}: {pod} never answered the connected socket in 10 s ({unanswered} unanswered)"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = t.elapsed();
    // Answered by `pod` alone; under a VM's emulation an answer may come
    // after the client's 1.5 s, never from elsewhere, never an error.
    let mut answered = 0;
    for _ in 0..10 {
        let r = c.udp_send(name, "hostname").expect("send");
        match r.error_kind() {
            None => {
                assert_eq!(
                    answered_by(&r),
                    Some(pod),
                    "{what}: after the change: {r:?}"
                );
                answered += 1;
            }
            Some("timeout") => unanswered += 1,
            Some(_) => panic!("{what}: a send on the connected socket failed: {r:?}"),
        }
    }
    assert!(answered >= 5, "{what}: {pod} answered {answered} of 10");
    println!("{what}: {pod} answered after {took:?} ({unanswered} unanswered)");
    took
}

/// The DNS-resolver case (issue 42): a host client's connected UDP socket
/// to a ClusterIP is never reconnected and never sees a failed send, as
/// with kube-proxy. Its datagrams are translated one by one on the
/// host-client device, so across a backend replaced by one on another
/// node, a backend removed, and a scale to zero and back, the next
/// datagram goes to a backend that is there. While the Service has no
/// endpoint, the socket reads ECONNREFUSED (the datapath's ICMP reject, as
/// kube-proxy's), and then it simply goes on. `getpeername()` is the
/// ClusterIP throughout. The agent killed and restarted, the socket goes on
/// with the agent gone and after. The same holds for a socket connected to
/// a NodePort (the node's address, or 127.0.0.1): the socket hooks aim it
/// at the Service's ClusterIP, and its peer is still the NodePort.
fn connected_udp_across_backend_changes(six: bool, via: Via) {
    let pod = |name: &str, node: &str| udp53_pod("dns", name, node);
    let name = match via {
        Via::ClusterIp => "udpc",
        Via::NodePort => "udpcn",
        Via::LocalhostNodePort => "udpcl",
    };
    udp53_lab(name, "dns", &[pod("dns-1", "node-1")], six, via).run(|lab| {
        let vip = udp_target(lab, "dns", six, via);
        let mut c = host(lab, "node-1");
        let r = c.udp_connect("resolver", vip).expect("open");
        assert_eq!(
            r,
            HostReply::Ok {
                peer: vip.to_string(),
                text: String::new()
            },
            "getpeername"
        );
        until_answered_by(&mut c, "resolver", "dns-1", "first answers");

        lab.apply(&manifests(&[&pod("dns-2", "node-2")]))
            .expect("apply");
        support::synced(lab);
        delete_pod(lab, "dns-1");
        until_answered_by(
            &mut c,
            "resolver",
            "dns-2",
            "replaced by a backend on another node",
        );

        lab.apply(&manifests(&[&pod("dns-3", "node-1")]))
            .expect("apply");
        support::synced(lab);
        delete_pod(lab, "dns-2");
        until_answered_by(&mut c, "resolver", "dns-3", "the remote backend removed");

        // Scale to zero: refused, at once, on the same socket.
        delete_pod(lab, "dns-3");
        let t = Instant::now();
        loop {
            let r = c.udp_send("resolver", "hostname").expect("send");
            if r.error_kind() == Some("refused") {
                break;
            }
            assert!(
                matches!(r.error_kind(), Some("timeout") | None),
                "scaled to zero: {r:?}"
            );
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "scaled to zero: never refused in 10 s: {r:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("scaled to zero: refused after {:?}", t.elapsed());

        lab.apply(&manifests(&[&pod("dns-4", "node-2")]))
            .expect("apply");
        support::synced(lab);
        until_answered_by(&mut c, "resolver", "dns-4", "scaled back to one");

        // The agent killed (a crash; an upgrade with `--on-exit keep` leaves
        // the same): the device, its routes, the programs and the flow's
        // conntrack entry stay, so the socket goes on, with the agent gone
        // and once a new one has taken over.
        let pid = lab
            .node_named("node-1")
            .and_then(|n| n.agent.as_ref())
            .expect("node-1's agent")
            .pid;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("kill -9");
        until_answered_by(&mut c, "resolver", "dns-4", "the agent killed");
        lab.stop_agent_on("node-1").expect("reap");
        lab.start_agent_on("node-1").expect("start");
        lab.wait_ready(lab.sync_timeout()).expect("ready");
        until_answered_by(&mut c, "resolver", "dns-4", "a new agent took over");
        assert_eq!(
            c.udp_peer("resolver").expect("getpeername"),
            HostReply::Ok {
                peer: vip.to_string(),
                text: String::new()
            },
            "getpeername after everything"
        );
        assert_eq!(
            stat(lab, "node-1", "sock_sendmsg") + stat(lab, "node-1", "sock_connect"),
            0,
            "no socket was aimed at a backend by the socket hooks"
        );
        assert!(
            stat(lab, "node-1", "redirect_host") > 0,
            "answers were injected at the host-client device"
        );
    });
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn connected_udp_keeps_its_socket_across_backend_changes() {
    connected_udp_across_backend_changes(false, Via::ClusterIp);
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn connected_udp6_keeps_its_socket_across_backend_changes() {
    connected_udp_across_backend_changes(true, Via::ClusterIp);
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn connected_udp_to_localhost_node_port_keeps_its_socket_across_backend_changes() {
    connected_udp_across_backend_changes(false, Via::LocalhostNodePort);
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn connected_udp6_to_a_node_port_keeps_its_socket_across_backend_changes() {
    connected_udp_across_backend_changes(true, Via::NodePort);
}

/// Where host UDP is aimed at `connect()` (here `--host-udp-per-packet
/// false`; also under `deliveryMode: stack`, or a frontend without a host
/// alias), the socket-destroy path is what stands between a connected
/// socket and a void: when the backend it was aimed at leaves the Service,
/// the agent destroys the socket, whose next send fails (`EDESTADDRREQ`,
/// "disconnected") instead of going unanswered forever, and a reconnect
/// reaches the backend that is there.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn without_the_per_packet_path_a_connected_udp_socket_fails_when_its_backend_goes() {
    let pod = |name: &str, node: &str| udp53_pod("dns", name, node);
    udp53_lab(
        "udpd",
        "dns",
        &[pod("dns-1", "node-1")],
        false,
        Via::ClusterIp,
    )
    .args(&["--host-udp-per-packet", "false"])
    .run(|lab| {
        let vip = udp_vip(lab, "dns", 53, false);
        let mut c = host(lab, "node-1");
        c.udp_connect("resolver", vip).expect("open");
        let r = c.udp_send("resolver", "hostname").expect("send");
        assert_eq!(answered_by(&r), Some("dns-1"), "{r:?}");
        assert!(
            stat(lab, "node-1", "sock_connect") >= 1,
            "the socket was aimed at its backend"
        );
        lab.apply(&manifests(&[&pod("dns-2", "node-2")]))
            .expect("apply");
        support::synced(lab);
        delete_pod(lab, "dns-1");
        let t = Instant::now();
        loop {
            let r = c.udp_send("resolver", "hostname").expect("send");
            match r.error_kind() {
                Some("disconnected") => break,
                Some("timeout") => {}
                _ => panic!("before the socket was destroyed: {r:?}"),
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the socket was not destroyed in 10 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("destroyed after {:?}", t.elapsed());
        c.udp_connect("resolver", vip).expect("reopen");
        let r = c.udp_send("resolver", "hostname").expect("send");
        assert_eq!(answered_by(&r), Some("dns-2"), "reconnected: {r:?}");
    });
}

/// An unconnected host socket's `sendto()` to a ClusterIP (issue 42): the
/// socket keeps its own port and every answer comes from the ClusterIP;
/// the backend sees the node's address and a port of the SNAT range (the
/// host's own sockets never use one, so a socket the hooks aimed at the
/// same backend from the same port cannot take this flow's answers). When
/// the backend the flow went to is removed, the same socket's next
/// datagrams go to the other one. Sent to a NodePort, every answer comes
/// from the NodePort.
fn unconnected_udp_keeps_its_port(six: bool, via: Via) {
    let pods = [
        udp53_pod("echo", "echo-1", "node-1"),
        udp53_pod("echo", "echo-2", "node-2"),
    ];
    let name = if via == Via::ClusterIp {
        "udpu"
    } else {
        "udpun"
    };
    udp53_lab(name, "echo", &pods, six, via).run(|lab| {
        let vip = udp_target(lab, "echo", six, via);
        let node = lab.node_named("node-1").expect("node-1");
        let node_ip: std::net::IpAddr = if six {
            node.ip6.expect("node-1's IPv6 address").into()
        } else {
            node.ip.into()
        };
        let mut c = host(lab, "node-1");
        let local = match c.udp_unconnected_open("u", vip).expect("open") {
            HostReply::Ok { peer, .. } => peer.parse::<SocketAddr>().expect("local address"),
            r => panic!("open: {r:?}"),
        };
        let check = |c: &mut HostClient, what: &str| -> String {
            let r = c.udp_sendto("u", vip, "clientip").expect("sendto");
            let HostReply::Ok { peer, text } = &r else {
                panic!("{what}: {r:?}");
            };
            assert_eq!(peer, &vip.to_string(), "{what}: the answer's source");
            let seen: SocketAddr = text
                .parse()
                .unwrap_or_else(|e| panic!("{what}: {text:?}: {e}"));
            assert_eq!(seen.ip(), node_ip, "{what}: the client the backend saw");
            // A port of the SNAT range, never an ephemeral one of the host's.
            assert!(
                !(32768..=60999).contains(&seen.port()) && seen.port() != local.port(),
                "{what}: {seen}: an ephemeral port of the host's own (the socket's is {local})"
            );
            let r = c.udp_sendto("u", vip, "hostname").expect("sendto");
            assert_eq!(r.error_kind(), None, "{what}: {r:?}");
            answered_by(&r).expect("a pod").to_string()
        };
        let first = check(&mut c, "first");
        for i in 0..5 {
            assert_eq!(
                check(&mut c, "again"),
                first,
                "datagram {i}: the flow keeps its backend"
            );
        }
        let other = if first == "echo-1" {
            "echo-2"
        } else {
            "echo-1"
        };
        delete_pod(lab, &first);
        let t = Instant::now();
        loop {
            let r = c.udp_sendto("u", vip, "hostname").expect("sendto");
            match &r {
                HostReply::Ok { peer, .. } => {
                    assert_eq!(peer, &vip.to_string(), "the answer's source");
                    if answered_by(&r) == Some(other) {
                        break;
                    }
                }
                HostReply::Err { kind, .. } => assert_eq!(kind, "timeout", "{r:?}"),
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{other} never answered"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(check(&mut c, "after the removal"), other);
    });
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn unconnected_udp_keeps_its_port_and_sees_the_cluster_ip() {
    unconnected_udp_keeps_its_port(false, Via::ClusterIp);
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn unconnected_udp6_keeps_its_port_and_sees_the_cluster_ip() {
    unconnected_udp_keeps_its_port(true, Via::ClusterIp);
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn unconnected_udp_to_a_node_port_keeps_its_port_and_sees_the_node_port() {
    unconnected_udp_keeps_its_port(false, Via::NodePort);
}

/// A DNS server from Debian (dnsmasq) in pod `pod`'s namespace, on port 53
/// of its address, answering `who.test TXT` with the pod's name; killed on
/// drop.
struct Dnsmasq(std::process::Child);

impl Dnsmasq {
    fn start(lab: &Lab, pod: &str) -> Dnsmasq {
        let p = lab.pod(pod).unwrap_or_else(|| panic!("pod {pod}"));
        let mut cmd = std::process::Command::new("dnsmasq");
        cmd.args([
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--port=53",
            "--bind-interfaces",
            "--user=root",
            "--pid-file",
        ])
        .arg(format!("--listen-address={}", p.ip))
        .arg(format!("--txt-record=who.test,{pod}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
        xtask::netns::enter_netns_on_spawn(&mut cmd, &p.netns).expect("netns");
        let d = Dnsmasq(cmd.spawn().expect("spawn dnsmasq"));
        let server = std::net::IpAddr::V4(p.ip);
        let t = Instant::now();
        while dig(lab, server).as_deref() != Some(pod) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "dnsmasq of {pod} never answered"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        d
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `dig @server who.test TXT` run as a host process of node-1 (its
/// namespace and cgroup): the answer's text, `None` when dig got none.
fn dig(lab: &Lab, server: std::net::IpAddr) -> Option<String> {
    let mut cmd = std::process::Command::new("dig");
    cmd.arg(format!("@{server}"))
        .args(["who.test", "TXT", "+short", "+tries=2", "+time=1"]);
    lab.as_host_process("node-1", &mut cmd)
        .expect("host process");
    let out = cmd.output().expect("run dig");
    let text = String::from_utf8_lossy(&out.stdout)
        .trim()
        .trim_matches('"')
        .to_string();
    (out.status.success() && !text.is_empty() && !text.starts_with(';')).then_some(text)
}

/// Issue 42: a DNS resolver from Debian, `dig`, asked from the node through
/// a ClusterIP whose DNS server (dnsmasq, in a pod) is replaced by one on
/// another node: every query is answered, by the old server, then by the
/// new one. dig's sockets are connected ones, which the hooks leave aimed
/// at the ClusterIP; the datagrams are translated on the host-client device.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn dig_through_a_cluster_ip_while_its_server_is_replaced() {
    let pod = |name: &str, node: &str| Pod::new(name, "dns").node(node);
    let yaml = manifests(&[
        &Svc::new("dns").selector("dns").port(Port::udp("u", 53)),
        &pod("dns-1", "node-1"),
    ]);
    LabTest::new("dig").nodes(2).yaml(&yaml).run(|lab| {
        let vip = std::net::IpAddr::V4(*frontend(lab, "dns", 53, "UDP").ip());
        let old = Dnsmasq::start(lab, "dns-1");
        for _ in 0..5 {
            assert_eq!(dig(lab, vip).as_deref(), Some("dns-1"), "dig @{vip}");
        }
        lab.apply(&manifests(&[&pod("dns-2", "node-2")]))
            .expect("apply");
        support::synced(lab);
        let _new = Dnsmasq::start(lab, "dns-2");
        let mut answers: BTreeMap<String, usize> = BTreeMap::new();
        for _ in 0..10 {
            let a = dig(lab, vip).unwrap_or_else(|| panic!("dig @{vip}: no answer"));
            *answers.entry(a).or_default() += 1;
        }
        drop(old);
        delete_pod(lab, "dns-1");
        let mut after: BTreeMap<String, usize> = BTreeMap::new();
        for _ in 0..10 {
            let a = dig(lab, vip)
                .unwrap_or_else(|| panic!("dig @{vip} after the replacement: no answer"));
            *after.entry(a).or_default() += 1;
        }
        println!("dig @{vip}: with both servers {answers:?}; after the replacement {after:?}");
        assert_eq!(
            after.keys().collect::<Vec<_>>(),
            ["dns-2"],
            "after the replacement"
        );
        assert!(
            stat(lab, "node-1", "sock_per_packet") > 0,
            "dig's sockets were left to the per-packet path"
        );
    });
}

/// S8 for host clients: restarts of the agent (kill -9, then SIGTERM with
/// `--on-exit keep`) keep host clients' established TCP connections working
/// and new connections succeed during and after the restarts (the pinned
/// cgroup links keep the hooks attached, the new agent takes them over).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s8_host_clients_survive_agent_restarts() {
    let yaml = manifests(&[
        &Svc::new("web").selector("web").port(Port::tcp("t", 80)),
        &Pod::new("web-1", "web").node("node-1").port(80, "TCP"),
        &Pod::new("web-2", "web").node("node-1").port(80, "TCP"),
    ]);
    let lab_test = LabTest::new("s8_host")
        .nodes(1)
        .yaml(&yaml)
        .args(&["--on-exit", "keep"]);
    lab_test.run(|lab| {
        let vip = frontend(lab, "web", 80, "TCP");
        let mut c = host(lab, "node-1");
        for i in 0..5 {
            let r = c.tcp_stream_open(&format!("s{i}"), vip).expect("open");
            assert!(r.text().is_some(), "stream {i}: {r:?}");
        }
        let mut exchanges = 0;
        let mut new_ok = 0;
        let mut check = |c: &mut HostClient, what: &str| {
            for i in 0..5 {
                let r = c.tcp_stream_send(&format!("s{i}"), "ping").expect("send");
                assert!(
                    r.text().is_some_and(|t| t.ends_with(" ping")),
                    "{what}: stream {i}: {r:?}"
                );
                exchanges += 1;
            }
            for _ in 0..5 {
                let r = c.tcp(vip, "hostname").expect("tcp");
                assert!(r.text().is_some(), "{what}: new connection: {r:?}");
                new_ok += 1;
            }
        };
        let pid = lab.info().agent.as_ref().expect("agent").pid;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("kill -9");
        std::thread::sleep(Duration::from_millis(200));
        check(&mut c, "agent killed");
        lab.stop_agent().expect("reap");
        lab.start_agent().expect("start");
        lab.wait_ready(lab.sync_timeout()).expect("ready");
        check(&mut c, "after kill -9 and restart");
        lab.stop_agent().expect("SIGTERM");
        check(&mut c, "agent stopped with --on-exit keep");
        lab.start_agent().expect("start");
        lab.wait_ready(lab.sync_timeout()).expect("ready");
        check(&mut c, "after the second restart");
        println!("host clients across restarts: {exchanges} exchanges, {new_ok} new connections, 0 failed");
    });
}

/// `loadBalancerSourceRanges` apply to every source of a load-balancer IP,
/// as kube-proxy's firewall chain filters them: with ranges that hold
/// neither the pod nor the node, a pod's connections are dropped and the
/// node's own client is refused at once (EPERM from the socket hook); with
/// the pod's and the node's addresses in the ranges, both are answered.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn lb_source_ranges_apply_to_pods_and_host_clients() {
    let lb = Ipv4Addr::new(198, 19, 100, 60);
    let svc = |ranges: &[&str]| {
        Svc::new("ranged")
            .selector("ranged")
            .service_type("LoadBalancer")
            .port(Port::tcp("t", 80))
            .lb_ips(&[lb])
            .source_ranges(ranges)
    };
    let yaml = manifests(&[
        &Pod::new("ranged-1", "ranged")
            .node("node-1")
            .port(80, "TCP"),
        &svc(&["198.18.7.0/24"]),
    ]);
    let lab_test = LabTest::new("lb_source_ranges_pods_hosts")
        .nodes(1)
        .yaml(&yaml);
    lab_test.run(|lab| {
        let vip = SocketAddrV4::new(lb, 80);
        let pod = lab.client().clone();
        support::assert_tcp_dropped(&pod.netns, vip, 3, "pod outside the ranges");
        let mut h = host(lab, "node-1");
        for _ in 0..3 {
            let t = Instant::now();
            let r = h.tcp(vip, "hostname").expect("host client");
            assert!(
                r.error_kind().is_some() && r.error_kind() != Some("timeout"),
                "host client outside the ranges must be refused at once: {r:?}"
            );
            assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        }
        let node = format!("{}/32", node_ip(lab, "node-1"));
        let pod_range = format!("{}/32", pod.ip);
        support::apply(lab, &svc(&["198.18.7.0/24", &node, &pod_range]).yaml());
        support::assert_answered_by(
            &pod.netns,
            vip,
            "TCP",
            10,
            &["ranged-1"],
            "pod inside the ranges",
        );
        assert_every(
            &mut h,
            "TCP",
            vip,
            &["ranged-1"],
            "host client inside the ranges",
        );
    });
}

// ---------------------------------------------------------------- IPv6
//
// The IPv6 hooks (`connect6`, `sendmsg6`, `recvmsg6`, `getpeername6`): host
// clients' AF_INET6 sockets, to IPv6 frontends (in a dual-stack lab, see
// `xtask::lab` for its address plan) and to IPv4 frontends through
// IPv4-mapped addresses (`::ffff:a.b.c.d`, a dual-stack socket). Besides
// what the client sees, each test checks the hooks' own counters (`inspect
// stats`), so that an answer reaching the client by another way than the
// socket hooks does not pass for theirs.

/// The port of the IPv6 tests' Services and pods.
const PORT6: u16 = 80;

/// Pods `<app>-1` .. `<app>-n` of app `app` on node-1, serving TCP and UDP
/// on [`PORT6`].
fn pods6(app: &str, n: usize) -> Vec<Pod> {
    (1..=n)
        .map(|i| {
            Pod::new(&format!("{app}-{i}"), app)
                .node("node-1")
                .port(PORT6, "TCP")
                .port(PORT6, "UDP")
        })
        .collect()
}

/// The YAML of `svc` and `pods`.
fn svc_and_pods(svc: &Svc, pods: &[Pod]) -> String {
    let mut objects: Vec<&dyn support::fixtures::Manifest> = vec![svc];
    objects.extend(pods.iter().map(|p| p as &dyn support::fixtures::Manifest));
    manifests(&objects)
}

/// The hooks' counters on node-1: translated `connect()`s, translated
/// unconnected sends, reverse translations (getpeername, recvmsg),
/// refusals for want of an endpoint, and UDP calls to a ClusterIP left to
/// the per-packet path.
#[derive(Clone, Copy, Debug)]
struct SockStats {
    connect: u64,
    sendmsg: u64,
    revnat: u64,
    reject: u64,
    per_packet: u64,
}

impl SockStats {
    fn read(lab: &Lab) -> SockStats {
        SockStats {
            connect: stat(lab, "node-1", "sock_connect"),
            sendmsg: stat(lab, "node-1", "sock_sendmsg"),
            revnat: stat(lab, "node-1", "sock_revnat"),
            reject: stat(lab, "node-1", "sock_reject_no_backend"),
            per_packet: stat(lab, "node-1", "sock_per_packet"),
        }
    }

    /// Each counter's growth since `before`.
    fn since(self, before: SockStats) -> SockStats {
        SockStats {
            connect: self.connect - before.connect,
            sendmsg: self.sendmsg - before.sendmsg,
            revnat: self.revnat - before.revnat,
            reject: self.reject - before.reject,
            per_packet: self.per_packet - before.per_packet,
        }
    }
}

/// H6-1: from a dual-stack node's own namespace, an IPv6-only Service's
/// ClusterIP (3 pods): every pod answers the host client's TCP connections
/// to `[ClusterIP]:80`, and `getpeername()` of each connected socket (and
/// of a long-lived one) shows the ClusterIP, not the pod; unconnected UDP
/// requests are answered by every pod, each reply's source being the
/// ClusterIP; a connected UDP socket's peer is the ClusterIP too. Before
/// that, the client reaches every pod on its own IPv6 address and sees it
/// as its peer (the lab's IPv6 works, and the hooks leave addresses that
/// are no frontend alone). The hooks count a translation for every TCP
/// `connect()` and a reverse one for every TCP peer shown; UDP to the
/// ClusterIP is left to the per-packet path (counted so), which shows the
/// ClusterIP as the source of every answer by itself.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn h6_1_node_reaches_ipv6_cluster_ip() {
    let pods = pods6("web6", 3);
    let svc = Svc::new("web6")
        .selector("web6")
        .ipv6_only()
        .ports(tcp_and_udp(PORT6));
    let lab_test = LabTest::new("h6_1")
        .dual_stack()
        .nodes(1)
        .yaml(&svc_and_pods(&svc, &pods));
    lab_test.run(|lab| {
        let names = ["web6-1", "web6-2", "web6-3"];
        assert!(
            lab.cluster_frontend("web6", PORT6, "TCP").is_none(),
            "an IPv6-only Service has no IPv4 ClusterIP"
        );
        let mut c = host(lab, "node-1");
        for name in names {
            let ip6 = lab
                .pod(name)
                .and_then(|p| p.ip6)
                .unwrap_or_else(|| panic!("pod {name} has no IPv6 address"));
            let direct = SocketAddr::from((ip6, PORT6));
            assert_every(&mut c, "TCP", direct, &[name], "node → pod's own IPv6");
        }

        let before = SockStats::read(lab);
        for proto in ["TCP", "UDP"] {
            let vip = frontend6(lab, "web6", PORT6, proto);
            assert!(vip.is_ipv6(), "{vip}");
            assert_every(&mut c, proto, vip, &names, "node → IPv6 ClusterIP");
        }
        let tcp = frontend6(lab, "web6", PORT6, "TCP");
        let r = c.tcp_stream_open("s", tcp).expect("open");
        match &r {
            HostReply::Ok { peer, text } => {
                assert_eq!(
                    peer,
                    &tcp.to_string(),
                    "getpeername of a long-lived connection"
                );
                assert!(
                    names.iter().any(|n| text.starts_with(n)),
                    "long-lived connection: {r:?}"
                );
            }
            HostReply::Err { .. } => panic!("long-lived connection to {tcp}: {r:?}"),
        }
        let udp = frontend6(lab, "web6", PORT6, "UDP");
        let r = c.udp_connect("u", udp).expect("open");
        assert_eq!(
            r,
            HostReply::Ok {
                peer: udp.to_string(),
                text: String::new()
            },
            "getpeername of a connected UDP socket"
        );
        let r = c.udp_send("u", "hostname").expect("send");
        let answered = r.text().and_then(|t| t.split_whitespace().next());
        assert!(
            answered.is_some_and(|p| names.contains(&p)),
            "connected UDP to {udp}: {r:?}"
        );

        let d = SockStats::read(lab).since(before);
        println!("H6-1: hook counters grew by {d:?}");
        // N TCP connections and the long-lived one; UDP to a ClusterIP is
        // left to the per-packet path: N sends and the connected socket.
        assert!(d.connect > N as u64, "connect6 translations: {d:?}");
        assert!(
            d.per_packet > N as u64,
            "UDP left to the per-packet path: {d:?}"
        );
        assert_eq!(d.sendmsg, 0, "sendmsg6 translations: {d:?}");
        // Every TCP peer shown as the ClusterIP (UDP sources are the
        // ClusterIP's on the wire).
        assert!(d.revnat >= N as u64, "reverse translations: {d:?}");
    });
}

/// H6-2: a dual-stack (AF_INET6) socket of the node sent to an IPv4
/// Service's ClusterIP in its IPv4-mapped form `::ffff:a.b.c.d` (as a Java
/// or Go program on an IPv4 cluster makes one): TCP connections are
/// answered by every pod and `getpeername()` shows `[::ffff:ClusterIP]:80`;
/// unconnected UDP requests are answered by every pod, each reply's source
/// being `[::ffff:ClusterIP]:80`; a connected UDP socket's peer likewise.
/// The hooks count a translation for each TCP connection, and leave UDP to
/// the per-packet path. The same requests from AF_INET sockets are answered
/// as before.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn h6_2_dual_stack_socket_reaches_ipv4_cluster_ip() {
    let pods = pods6("web", 3);
    let svc = Svc::new("web").selector("web").ports(tcp_and_udp(PORT6));
    let lab_test = LabTest::new("h6_2")
        .nodes(1)
        .yaml(&svc_and_pods(&svc, &pods));
    lab_test.run(|lab| {
        let names = ["web-1", "web-2", "web-3"];
        let mut c = host(lab, "node-1");
        let mapped = |v: SocketAddrV4| SocketAddrV6::new(v.ip().to_ipv6_mapped(), v.port(), 0, 0);
        for proto in ["TCP", "UDP"] {
            let vip = frontend(lab, "web", PORT6, proto);
            assert_every(&mut c, proto, vip, &names, "AF_INET socket → ClusterIP");
        }

        let before = SockStats::read(lab);
        for proto in ["TCP", "UDP"] {
            let vip = mapped(frontend(lab, "web", PORT6, proto));
            assert_every(
                &mut c,
                proto,
                vip,
                &names,
                "AF_INET6 socket → [::ffff:ClusterIP]",
            );
        }
        let udp = mapped(frontend(lab, "web", PORT6, "UDP"));
        let r = c.udp_connect("u", udp).expect("open");
        assert_eq!(
            r,
            HostReply::Ok {
                peer: udp.to_string(),
                text: String::new()
            },
            "getpeername of a connected dual-stack UDP socket"
        );
        let r = c.udp_send("u", "hostname").expect("send");
        let answered = r.text().and_then(|t| t.split_whitespace().next());
        assert!(
            answered.is_some_and(|p| names.contains(&p)),
            "connected UDP to {udp}: {r:?}"
        );

        let d = SockStats::read(lab).since(before);
        println!("H6-2: hook counters grew by {d:?}");
        // N TCP connections; UDP to the ClusterIP, N sends and the
        // connected socket, left to the per-packet path.
        assert!(d.connect >= N as u64, "connect6 translations: {d:?}");
        assert!(
            d.per_packet > N as u64,
            "UDP left to the per-packet path: {d:?}"
        );
        assert_eq!(d.sendmsg, 0, "sendmsg6 translations: {d:?}");
        assert!(d.revnat >= N as u64, "reverse translations: {d:?}");
    });
}

/// H6-3: S29/K4 over IPv6: an IPv6 Service without endpoints, in a
/// dual-stack lab: the host client's `connect()` to its ClusterIP and an
/// unconnected UDP send to it fail at once (well under a second, not a
/// timeout) with ECONNREFUSED, and the hooks count each refusal. As S29/K4
/// above, it asserts ECONNREFUSED: kernels before 5.18 (no
/// `bpf_set_retval`) would give EPERM, and fail here.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn h6_3_ipv6_service_without_endpoints_refused_at_once() {
    let svc = Svc::new("empty6")
        .selector("nothing")
        .ipv6_only()
        .ports(tcp_and_udp(PORT6));
    let lab_test = LabTest::new("h6_3")
        .dual_stack()
        .nodes(1)
        .yaml(&svc_and_pods(&svc, &[]));
    lab_test.run(|lab| {
        let mut c = host(lab, "node-1");
        let tcp = frontend6(lab, "empty6", PORT6, "TCP");
        let udp = frontend6(lab, "empty6", PORT6, "UDP");
        let before = SockStats::read(lab);
        for _ in 0..5 {
            let t = Instant::now();
            let r = c.tcp(tcp, "hostname").expect("host client");
            assert_eq!(r.error_kind(), Some("refused"), "TCP to {tcp}: {r:?}");
            assert!(
                t.elapsed() < Duration::from_secs(1),
                "TCP to {tcp}: {:?}",
                t.elapsed()
            );
            let t = Instant::now();
            let r = c.udp(udp, "hostname").expect("host client");
            assert_eq!(r.error_kind(), Some("refused"), "UDP to {udp}: {r:?}");
            assert!(
                t.elapsed() < Duration::from_secs(1),
                "UDP to {udp}: {:?}",
                t.elapsed()
            );
        }
        let d = SockStats::read(lab).since(before);
        println!("H6-3: hook counters grew by {d:?}");
        assert!(d.reject >= 10, "refusals counted: {d:?}");
    });
}

/// D4, D5 — "should function for node-Service: http/udp" on the secondary
/// family: two dual-stack nodes, a dual-stack NodePort Service
/// (`ipFamilies: [IPv4, IPv6]`) over `web-1` on node-1 and `web-2` on
/// node-2. From node-1's own namespace (a hostNetwork client, on the socket
/// hooks), TCP connections and UDP requests to the secondary (IPv6)
/// ClusterIP and to node-1's IPv6 address at the NodePort reach both pods.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d4_d5_node_reaches_secondary_cluster_ip_and_node_port() {
    let svc = Svc::new("web")
        .selector("web")
        .service_type("NodePort")
        .dual_stack()
        .port(Port::tcp("t", 80).node_port(NODE_PORT))
        .port(Port::udp("u", 80).node_port(NODE_PORT));
    let pods = [
        Pod::new("web-1", "web").node("node-1").port(80, "TCP"),
        Pod::new("web-2", "web").node("node-2").port(80, "TCP"),
    ];
    let yaml = svc_and_pods(&svc, &pods);
    LabTest::new("d4_d5")
        .dual_stack()
        .nodes(2)
        .yaml(&yaml)
        .run(|lab| {
            let mut c = host(lab, "node-1");
            let names = ["web-1", "web-2"];
            let node6 = lab
                .node_named("node-1")
                .and_then(|n| n.ip6)
                .expect("node-1 has an IPv6 address");
            for proto in ["TCP", "UDP"] {
                let vip = frontend6(lab, "web", 80, proto);
                assert!(vip.is_ipv6(), "{vip}");
                assert_every(&mut c, proto, vip, &names, "node → secondary ClusterIP");
                let np = SocketAddr::from((node6, NODE_PORT));
                assert_every(&mut c, proto, np, &names, "node → [own IPv6]:nodePort");
            }
        });
}

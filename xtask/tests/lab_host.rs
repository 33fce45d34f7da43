//! Lab tests of the node's own clients (host processes, hostNetwork pods):
//! socket-level load balancing on cgroup hooks. Each node of the lab has its
//! own cgroup (never the machine's root cgroup); its agent attaches the hooks
//! there, and the host clients here (`lab-host-client`) run in the node's
//! namespace and that cgroup, as a hostNetwork pod does on a node. Named
//! after the rows of `../shared/conformance/service-behaviours.md`.
//!
//! Run as root: `cargo xtask test`.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use xtask::{HostClient, HostReply, Lab};

mod support;
use support::fixtures::{manifests, Ep, Pod, Port, Slice, Svc};
use support::{delete_pod, frontend};

const SYNC_TIMEOUT: Duration = Duration::from_secs(15);
const NODE_PORT: u16 = 30080;
/// Requests per check of "every endpoint answers".
const N: usize = 40;

fn with_nodes(test: &str, nodes: usize, yaml: &str, f: impl FnOnce(&mut Lab)) {
    support::with_nodes(
        test,
        Lab::builder().manifests_yaml(yaml),
        nodes,
        SYNC_TIMEOUT,
        f,
    )
}

fn with_nodes_args(test: &str, nodes: usize, yaml: &str, args: &[&str], f: impl FnOnce(&mut Lab)) {
    let mut b = Lab::builder().manifests_yaml(yaml);
    for a in args {
        b = b.agent_arg(*a);
    }
    support::with_nodes(test, b, nodes, SYNC_TIMEOUT, f)
}

fn host(lab: &Lab, node: &str) -> HostClient {
    lab.host_client(node)
        .unwrap_or_else(|e| panic!("host client on {node}: {e:#}"))
}

fn node_ip(lab: &Lab, node: &str) -> Ipv4Addr {
    lab.node_named(node).expect("node").ip
}

/// `n` requests `proto` to `addr` from `c`; answers by pod name (the
/// first word of the reply), errors counted under `error:<kind>`. Asserts
/// that what the client saw as its peer is `addr` (getpeername for TCP,
/// the datagram's source for UDP).
fn spread(
    c: &mut HostClient,
    proto: &str,
    addr: SocketAddrV4,
    n: usize,
) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for _ in 0..n {
        let r = match proto {
            "TCP" => c.tcp(addr, "hostname"),
            _ => c.udp(addr, "hostname"),
        }
        .expect("host client");
        let key = match &r {
            HostReply::Ok { peer, text } => {
                assert_eq!(
                    peer,
                    &addr.to_string(),
                    "{proto} {addr}: the client must see the frontend as its peer, saw {peer}"
                );
                text.split_whitespace().next().unwrap_or("").to_string()
            }
            HostReply::Err { kind, .. } => format!("error:{kind}"),
        };
        *counts.entry(key).or_default() += 1;
    }
    counts
}

fn assert_every(c: &mut HostClient, proto: &str, addr: SocketAddrV4, pods: &[&str], what: &str) {
    let counts = spread(c, proto, addr, N);
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
    with_nodes("c4_n5_n15", 2, &two_pod_service(), |lab| {
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

/// A lab server in a node's own namespace: a hostNetwork endpoint.
struct HostServer(Child);

impl HostServer {
    fn start(lab: &Lab, node: &str, name: &str, port: u16) -> Self {
        let ns = lab.node_named(node).expect("node").netns.clone();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lab-server"));
        cmd.args([
            "--name",
            name,
            "--tcp",
            &port.to_string(),
            "--udp",
            &port.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        xtask::netns::enter_netns_on_spawn(&mut cmd, &ns).expect("netns");
        let mut child = cmd.spawn().expect("spawn lab-server");
        let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).expect("ready line");
        assert_eq!(line.trim(), "ready", "host server {name}");
        HostServer(child)
    }
}

impl Drop for HostServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
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
    with_nodes("n21", 2, &lab_yaml, |lab| {
        let _s1 = HostServer::start(lab, "node-1", "host-node-1", PORT);
        let _s2 = HostServer::start(lab, "node-2", "host-node-2", PORT);
        let slice = Slice::new("hostnet-1", "hostnet")
            .port("t", PORT, "TCP")
            .port("u", PORT, "UDP")
            .endpoint(Ep::new(node_ip(lab, "node-1")).node("node-1"))
            .endpoint(Ep::new(node_ip(lab, "node-2")).node("node-2"));
        support::apply(lab, &manifests(&[&slice]), SYNC_TIMEOUT);
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
        let ns = support::client_on(lab, "node-1", SYNC_TIMEOUT).netns;
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
    with_nodes("s29_k4_host", 1, &yaml, |lab| {
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
        support::synced(lab, SYNC_TIMEOUT);
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
    with_nodes("l1_l2", 2, &yaml, |lab| {
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
        let counts = spread(&mut c, "TCP", sticky, 15);
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

/// The DNS-resolver case: a host client's connected UDP socket to a Service
/// whose backend is replaced keeps getting answers within a few seconds,
/// from the new backend (its socket aimed at the removed one is destroyed,
/// the client reconnects on the error as resolvers do); never a silent
/// black hole.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn connected_udp_follows_backend_replacement() {
    let yaml = manifests(&[
        &Svc::new("dns").selector("dns").port(Port::udp("u", 53)),
        &Pod::new("dns-1", "dns").node("node-1").port(53, "UDP"),
    ]);
    with_nodes("connected_udp", 1, &yaml, |lab| {
        let mut c = host(lab, "node-1");
        let vip = frontend(lab, "dns", 53, "UDP");
        let r = c.udp_connect("resolver", vip).expect("open");
        assert_eq!(
            r,
            HostReply::Ok {
                peer: vip.to_string(),
                text: String::new()
            },
            "getpeername"
        );
        let r = c.udp_send("resolver", "hostname").expect("send");
        assert_eq!(
            r.text().map(|t| t.split_whitespace().next().unwrap_or("")),
            Some("dns-1")
        );

        lab.apply(&manifests(&[&Pod::new("dns-2", "dns")
            .node("node-1")
            .port(53, "UDP")]))
            .expect("apply");
        support::synced(lab, SYNC_TIMEOUT);
        let replaced = Instant::now();
        delete_pod(lab, "dns-1");
        let mut errors: BTreeMap<String, usize> = BTreeMap::new();
        let mut answered_by_new = None;
        let mut reopened = 0;
        while replaced.elapsed() < Duration::from_secs(10) {
            let r = c.udp_send("resolver", "hostname").expect("send");
            match r {
                HostReply::Ok { text, .. } if text.starts_with("dns-2") => {
                    answered_by_new = Some(replaced.elapsed());
                    break;
                }
                HostReply::Ok { .. } => {}
                HostReply::Err { kind, .. } => {
                    *errors.entry(kind).or_default() += 1;
                    // A resolver reopens its socket after an error.
                    if c.udp_connect("resolver", vip)
                        .expect("reopen")
                        .text()
                        .is_some()
                    {
                        reopened += 1;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        println!(
            "connected UDP: new backend answered after {answered_by_new:?}; errors {errors:?}; reopened {reopened}"
        );
        let t = answered_by_new.unwrap_or_else(|| {
            panic!("the connected UDP socket never reached the new backend in 10 s: {errors:?}")
        });
        assert!(t < Duration::from_secs(5), "took {t:?}");
        assert!(
            errors.contains_key("aborted") || errors.contains_key("disconnected"),
            "the socket aimed at the removed backend must be destroyed (ECONNABORTED, or \
             EDESTADDRREQ on the send after it), not time out: {errors:?}"
        );
        assert!(
            !errors.contains_key("timeout"),
            "a send went into the void: {errors:?}"
        );
        // Twenty more answers on the reopened socket, all from the new backend.
        for _ in 0..20 {
            let r = c.udp_send("resolver", "hostname").expect("send");
            assert!(r.text().is_some_and(|t| t.starts_with("dns-2")), "{r:?}");
        }
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
    with_nodes_args("s8_host", 1, &yaml, &["--on-exit", "keep"], |lab| {
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
        lab.wait_ready(SYNC_TIMEOUT).expect("ready");
        check(&mut c, "after kill -9 and restart");
        lab.stop_agent().expect("SIGTERM");
        check(&mut c, "agent stopped with --on-exit keep");
        lab.start_agent().expect("start");
        lab.wait_ready(SYNC_TIMEOUT).expect("ready");
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
    with_nodes("lb_source_ranges_pods_hosts", 1, &yaml, |lab| {
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
        support::apply(
            lab,
            &svc(&["198.18.7.0/24", &node, &pod_range]).yaml(),
            SYNC_TIMEOUT,
        );
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

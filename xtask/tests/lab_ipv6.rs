//! IPv6 and dual-stack lab tests: real TCP and UDP over IPv6 between the
//! namespaces of a dual-stack lab (`LabBuilder::dual_stack`: every pod and
//! client has an address of each family, from 198.18.0.0/15 and
//! 2001:2::/48; see `xtask::lab` for the address plan), through the agent's
//! tc datapath. Each test builds its own lab (one node; two for D-lab-5,
//! D-lab-6 and D14, with the switch and the external client) and lets it drop at
//! the end, also on failure. The IDs name upstream's dual-stack e2e
//! behaviours (test/e2e/network/dual_stack.go, and service.go's where the
//! dual-stack file has none) as the lab reproduces them.
//!
//! D-lab-1 checks the lab's own IPv6 plumbing (no Service): it holds with
//! any datapath that lets IPv6 pass. The others need the agent to serve
//! IPv6 Services. Before each Service check, the test asserts that
//! every pod answers on its own IPv6 address (from where the Service is
//! reached), so a failure there is the IPv6 Service's.
//!
//! The last column maps each test to the rows of section C of
//! `../shared/conformance/service-behaviours.md` (from the repository root,
//! as in the README: dual_stack.go's "Granular Checks: Services Secondary
//! IP Family", D1–D14) it reproduces, wholly or the part named.
//!
//! | ID | what | rows |
//! | --- | --- | --- |
//! | D-lab-1 | the dual-stack lab's addressing; pods answer on their IPv6 addresses | none (dual_stack.go's pod IP checks, before section C) |
//! | D-lab-2 | an IPv6-only Service's ClusterIP, TCP and UDP | D1, D2: pod → ClusterIP (the only one, IPv6) |
//! | D-lab-3 | dual-stack Services answer on both ClusterIPs | D1: pod → secondary ClusterIP, TCP |
//! | D-lab-4 | a deleted pod stops answering on the IPv6 ClusterIP | D8, D9 |
//! | D-lab-5 | two nodes: the IPv6 ClusterIP answered by pods on both, no SNAT | D1, D2: pod → ClusterIP, endpoints on both nodes |
//! | D-lab-6 | two nodes: IPv6 NodePort from the external client, eTP Cluster (SNAT to the node) and Local (client address kept), with and without XDP | D1, D2: the nodePort half, from outside the cluster rather than from a pod |
//! | D-lab-7 | hairpin: a pod reaching itself through its IPv6 ClusterIP (SNAT to the node's IPv6 address, or `--hairpin-snat-ip6`) | D6, D7: endpoint pod → ClusterIP |
//! | D-lab-8 | an IPv6 Service without endpoints refuses TCP and UDP (ICMPv6 port unreachable), not a timeout | none (service.go's "should be rejected when no endpoints exist") |
//! | D10, D11 | ClientIP session affinity on the secondary ClusterIP: 10 TCP and 10 UDP dials land on one pod; without affinity on several | D10, D11 |
//! | D12, D13 | 2,000-byte TCP and UDP echoes through the secondary ClusterIP; the UDP one in IPv6 fragments, both ways | D12, D13 |
//! | D14 | hostNetwork endpoints (the nodes' addresses), two nodes: pod and node (host client) → secondary ClusterIP and node-1's IPv6 NodePort, TCP and UDP, and 2,000-byte echoes | D14 |
//! | D6, D7 | an endpoint pod → its dual-stack Service's secondary ClusterIP and the node's IPv6 NodePort, TCP and UDP, every pod (itself by hairpin) | D6, D7 |
//!
//! The IPv6 runs of rows of sections A and F (same scenarios as their IPv4
//! tests in `lab.rs`, `lab_northsouth.rs`, on IPv6-only or dual-stack
//! Services):
//!
//! | test | rows |
//! | --- | --- |
//! | `s1_ipv6_basic_endpoint_added_and_removed` | S1 |
//! | `s2_ipv6_multiport_named_target_ports` | S2 |
//! | D-lab-7 | S5 (a pod hairpins to itself through its IPv6 ClusterIP) |
//! | `s10_ipv6_node_port_reachable_on_every_node` | S10 |
//! | `s12_s39_ipv6_tcp_and_udp_on_same_node_port_number` | S12, S39 |
//! | `s17_ipv6_no_listener_on_node_port` | S17 |
//! | D-lab-8 | S29 (ClusterIP without endpoints refuses) |
//! | `k4_ipv6_node_port_without_endpoints_refused_etp_local_dropped` | K4 |
//! | `k1_ipv6_udp_flow_leaves_deleted_endpoint` | field-bugs K1 (the UDP flow; service-behaviours' K1, the CLOSE_WAIT timeout, is one conntrack sysctl for both families) |
//!
//! Not covered here:
//! - D3 (SCTP over the secondary family): in `lab_sctp.rs`, which runs where
//!   the kernel has SCTP (the VMs' `lab-sctp` step).
//! - D4, D5 (node → secondary ClusterIP and nodePort, pod endpoints): in
//!   `lab_host.rs` (`d4_d5_node_reaches_secondary_cluster_ip_and_node_port`,
//!   the node's own clients are the socket hooks').
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --bins && cargo test -p xtask --test lab_ipv6 -- --include-ignored`.
//!
//! On failure the agents' log tails and `proxy-agent inspect
//! services|stats|conntrack` (of every node) are printed before the lab is
//! torn down; set `KPR_LAB_DIAG=1` to print them after every test.
//!
//! Why one file (about 1,500 lines): the tables above are one map of section
//! C's rows and of the IPv6 runs of other sections, and the tests share the
//! IPv6 helpers (`pods_answer_directly6` before each Service check,
//! `node_port6`, `service_families`, the large echoes); the VM kernel matrix
//! runs D-lab-3 from this binary by name (`xtask/src/vm/plan.rs`). The file
//! is in sections: the D rows, then the IPv6 runs of S and K rows.

use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use xtask::client::{self, reply_text};
use xtask::manifests::Object;
use xtask::Lab;

mod support;
use support::fixtures::{manifests, tcp_and_udp, Pod, Port, Svc};
use support::{
    all_answered, assert_answered_by, delete_pod, frontend, frontend6, HostServer, LabTest, T,
};

/// Requests per check of which pods answer (3 pods: each is missed by 30
/// random picks with probability 3 × (2/3)^30 ≈ 2e-5).
const N: usize = 30;
/// The pods' port, and the Services'.
const PORT: u16 = 80;
/// How soon a UDP request to a Service without endpoints must be refused
/// (D-lab-8): at once.
const REFUSED_WITHIN: Duration = Duration::from_millis(500);
/// How soon a TCP connect to a Service without endpoints must be refused
/// (D-lab-8): by the answer to the SYN's first retransmission (after 1 s),
/// before the second (3 s) and before the client gives up (2 s). The
/// answer to the first SYN arrives while `connect()` still holds the
/// socket, and Linux keeps an ICMPv6 error arriving then only as a soft
/// error (`TcpExtLockDroppedIcmps`): so does it for ip6tables' `REJECT
/// --reject-with icmp6-port-unreachable`, refused after 1.02 s in the same
/// lab, where IPv4's ICMP is taken at once.
const TCP_REFUSED_WITHIN: Duration = Duration::from_millis(1500);
/// Dials per protocol of the session-affinity checks (D10, D11), as
/// upstream's.
const AFFINITY_DIALS: usize = 10;
/// Bytes echoed by the large-request checks (D12, D13, D14), as upstream's.
const LARGE: usize = 2000;
/// Large requests per protocol and client.
const LARGE_TRIES: usize = 5;
/// The port of the hostNetwork endpoints' servers (D14), in the nodes' own
/// namespaces: upstream's netexec port.
const HOST_PORT: u16 = 9376;

/// Pods `<app>-1` .. `<app>-n` of app `app`, serving TCP and UDP on
/// [`PORT`].
fn pods(app: &str, n: usize) -> Vec<Pod> {
    (1..=n)
        .map(|i| Pod::new(&format!("{app}-{i}"), app).port(PORT, "TCP"))
        .collect()
}

/// The YAML of `svc` and `pods`.
fn yaml(svc: Option<&Svc>, pods: &[Pod]) -> String {
    let mut objects: Vec<&dyn support::fixtures::Manifest> = Vec::new();
    if let Some(s) = svc {
        objects.push(s);
    }
    objects.extend(pods.iter().map(|p| p as &dyn support::fixtures::Manifest));
    manifests(&objects)
}

/// Pod `name`'s IPv6 address at [`PORT`].
fn pod_addr6(lab: &Lab, name: &str) -> SocketAddr {
    let p = lab.pod(name).unwrap_or_else(|| panic!("no pod {name}"));
    let ip6 = p
        .ip6
        .unwrap_or_else(|| panic!("pod {name} has no IPv6 address in lab.json"));
    SocketAddr::new(ip6.into(), PORT)
}

/// The client's IPv6 address, as the pods' servers print a peer (`[ip]`).
fn client_ip6(lab: &Lab) -> IpAddr {
    lab.client()
        .ip6
        .expect("the client of a dual-stack lab has an IPv6 address")
        .into()
}

/// Every pod named answers the client on its own IPv6 address at [`PORT`],
/// over TCP and UDP, with its name, and sees the client's own IPv6 address
/// (nothing translates the direct path): the lab's IPv6 plumbing works, so
/// whatever fails after this is the Service's.
fn pods_answer_directly6(lab: &Lab, pods: &[&str], what: &str) {
    pods_answer_directly6_from(lab, &lab.client().netns, client_ip6(lab), pods, what)
}

/// [`pods_answer_directly6`] from namespace `ns`, whose IPv6 address is
/// `me` (the external client, a client on another node).
fn pods_answer_directly6_from(lab: &Lab, ns: &str, me: IpAddr, pods: &[&str], what: &str) {
    for name in pods {
        let addr = pod_addr6(lab, name);
        let tcp = client::tcp_request(ns, addr, b"hostname\n", T).map(|r| reply_text(&r));
        assert_eq!(
            tcp.as_deref().ok(),
            Some(*name),
            "{what}: TCP straight to {name} at {addr}: {tcp:?}"
        );
        let udp = client::udp_request(ns, addr, b"hostname", T, None).map(|r| reply_text(&r));
        assert_eq!(
            udp.as_deref().ok(),
            Some(*name),
            "{what}: UDP straight to {name} at {addr}: {udp:?}"
        );
        let seen = peer_seen(ns, addr);
        assert_eq!(
            seen.as_ref().ok(),
            Some(&me),
            "{what}: {name} at {addr} saw {ns} as {seen:?}"
        );
    }
    println!("{what}: {pods:?} answer TCP and UDP on their IPv6 addresses (from {me})");
}

/// One `clientip` request over TCP from `ns` to `addr`: the source address
/// the pod that answered saw.
fn peer_seen(ns: &str, addr: SocketAddr) -> io::Result<IpAddr> {
    let text = client::tcp_request(ns, addr, b"clientip\n", T).map(|r| reply_text(&r))?;
    text.parse::<SocketAddr>()
        .map(|a| a.ip())
        .map_err(|_| io::Error::other(format!("unexpected clientip reply {text:?}")))
}

/// Asserts that `n` `clientip` requests over TCP from `ns` to `addr`, each
/// a new connection, all succeed and all saw the source address `want`.
fn assert_peer_seen(ns: &str, addr: SocketAddr, n: usize, want: IpAddr, what: &str) {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for _ in 0..n {
        let got = match peer_seen(ns, addr) {
            Ok(ip) => ip.to_string(),
            Err(e) => format!("{:?}: {e}", e.kind()),
        };
        *seen.entry(got).or_insert(0) += 1;
    }
    println!("{what}: {n} clientip requests to {addr}: the pods saw {seen:?}");
    assert_eq!(
        seen.keys().collect::<Vec<_>>(),
        [&want.to_string()],
        "{what}: source addresses the pods saw through {addr} (counts {seen:?}), expected {want} only"
    );
}

/// `node`'s IPv6 address.
fn node_ip6(lab: &Lab, node: &str) -> IpAddr {
    lab.node_named(node)
        .unwrap_or_else(|| panic!("no node {node}"))
        .ip6
        .unwrap_or_else(|| panic!("{node} has no IPv6 address: is the lab dual-stack?"))
        .into()
}

/// Whether `node`'s `eth0` has an XDP program (`ip link` shows
/// `prog/xdp`).
fn xdp_on_eth0(lab: &Lab, node: &str) -> bool {
    let ns = &lab.node_named(node).expect("node").netns;
    let out = std::process::Command::new("ip")
        .args(["-n", ns, "link", "show", "dev", "eth0"])
        .output()
        .expect("run ip");
    assert!(
        out.status.success(),
        "ip -n {ns} link show dev eth0: {out:?}"
    );
    String::from_utf8_lossy(&out.stdout).contains("prog/xdp")
}

/// `node`'s IPv6 address at the NodePort of `service`'s `proto` port
/// `port`, from lab.json's frontends.
fn node_port6(lab: &Lab, service: &str, port: u16, proto: &str, node: &str) -> SocketAddr {
    let ip = node_ip6(lab, node);
    let fronts = lab.info().frontends_of(service);
    let port_name = fronts
        .iter()
        .find(|f| f.kind == "ClusterIP" && f.port == port && f.protocol.eq_ignore_ascii_case(proto))
        .map(|f| f.port_name.clone())
        .unwrap_or_else(|| panic!("no {proto} port {port} of {service}"));
    fronts
        .iter()
        .find(|f| {
            f.kind == "NodePort"
                && f.ip == ip
                && f.protocol.eq_ignore_ascii_case(proto)
                && f.port_name == port_name
        })
        .map(|f| f.socket_addr())
        .unwrap_or_else(|| panic!("no {proto} IPv6 NodePort of {service}:{port} on {node}"))
}

/// The Service `name`'s `clusterIPs`, `ipFamilies` and `ipFamilyPolicy` as
/// the lab's API server completed them (cluster.yaml).
fn service_families(lab: &Lab, name: &str) -> (Vec<String>, Vec<String>, String) {
    let svc = lab
        .objects()
        .iter()
        .find_map(|o| match o {
            Object::Service(s) if s.metadata.name.as_deref() == Some(name) => Some(s),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no Service {name} in the lab's manifests"));
    let spec = svc.spec.as_ref().expect("spec");
    (
        spec.cluster_ips.clone().unwrap_or_default(),
        spec.ip_families.clone().unwrap_or_default(),
        spec.ip_family_policy.clone().unwrap_or_default(),
    )
}

/// [`LARGE`] bytes of printable text, no space or newline (a TCP request
/// ends at its newline; the host client's at its line's end).
fn large_payload() -> Vec<u8> {
    (0..LARGE)
        .map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789"[i % 36])
        .collect()
}

/// Asserts that `tries` `echo <`[`large_payload`]`>` requests over `proto`
/// from `ns` to `addr` (new connections; UDP: one datagram each, from a new
/// socket) are all answered with exactly the payload and a newline.
fn assert_large_echo(ns: &str, addr: SocketAddr, proto: &str, tries: usize, what: &str) {
    let data = large_payload();
    let mut request = b"echo ".to_vec();
    request.extend_from_slice(&data);
    if proto == "TCP" {
        request.push(b'\n');
    }
    let mut want = data.clone();
    want.push(b'\n');
    for i in 1..=tries {
        let reply = match proto {
            "TCP" => client::tcp_request(ns, addr, &request, T),
            _ => client::udp_request(ns, addr, &request, T, None),
        }
        .unwrap_or_else(|e| {
            panic!(
                "{what}: {proto} request {i} of {} bytes to {addr}: {e}",
                request.len()
            )
        });
        println!(
            "{what}: {proto} request {i} of {} bytes to {addr}: {} bytes back",
            request.len(),
            reply.len()
        );
        assert!(
            reply == want,
            "{what}: {proto} {addr} try {i}: echo not intact: {} bytes back, expected {} ({:?}...)",
            reply.len(),
            want.len(),
            String::from_utf8_lossy(&reply[..reply.len().min(60)])
        );
    }
}

/// The MTU of `dev` in namespace `ns`.
fn link_mtu(ns: &str, dev: &str) -> usize {
    let out = std::process::Command::new("ip")
        .args(["-n", ns, "-o", "link", "show", "dev", dev])
        .output()
        .expect("run ip");
    assert!(
        out.status.success(),
        "ip -n {ns} link show dev {dev}: {out:?}"
    );
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "mtu")
        .nth(1)
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("no mtu in {text:?}"))
}

// ================================================================ tests

/// D-lab-1 — the dual-stack lab's addressing (upstream: "should have ipv4
/// and ipv6 internal node ip" / "should create pod, add ipv6 and ipv4 ip to
/// pod ips" / "should be able to reach pod on ipv4 and ipv6 ip"): two pods
/// each get an IPv4 address and its IPv6 twin (2001:2:0:1::h), recorded in
/// lab.json and in their `podIPs`; the node has an IPv6 address and pod
/// CIDR; from the client pod, each pod answers TCP and UDP on its IPv6
/// address and sees the client's IPv6 address, and still answers on its
/// IPv4 one. No Service: this is the lab's plumbing, which any datapath
/// that lets IPv6 pass leaves working.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d_lab_1_pods_answer_on_their_ipv6_addresses() {
    let yaml = yaml(None, &pods("p", 2));
    LabTest::new("d-lab-1").dual_stack().yaml(&yaml).run(|lab| {
        assert!(lab.is_dual_stack());
        let node = lab.node();
        assert_eq!(node.ip6, Some("2001:2::a".parse().unwrap()), "node-1");
        assert_eq!(node.pod_cidr6.as_deref(), Some("2001:2:0:1::/64"));
        assert_eq!(client_ip6(lab), "2001:2:0:1::2".parse::<IpAddr>().unwrap());
        for name in ["p-1", "p-2"] {
            let p = lab.pod(name).expect("pod");
            let twin = xtask::netns::ipv6_twin(p.ip).expect("a pod address in 198.18.0.0/16");
            assert_eq!(p.ip6, Some(twin), "{name}: IPv6 twin of {}", p.ip);
            let pod = lab
                .objects()
                .iter()
                .find_map(|o| match o {
                    Object::Pod(x) if x.metadata.name.as_deref() == Some(name) => Some(x),
                    _ => None,
                })
                .expect("pod object");
            let ips: Vec<String> = pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ips.clone())
                .unwrap_or_default()
                .into_iter()
                .map(|i| i.ip)
                .collect();
            assert_eq!(ips, [p.ip.to_string(), twin.to_string()], "{name}: podIPs");
        }
        pods_answer_directly6(lab, &["p-1", "p-2"], "D-lab-1");
        let ns = lab.client().netns.clone();
        for name in ["p-1", "p-2"] {
            let addr = std::net::SocketAddrV4::new(lab.pod(name).expect("pod").ip, PORT);
            let got = support::tcp_hostname(&ns, addr);
            assert_eq!(
                got.as_deref().ok(),
                Some(name),
                "D-lab-1: TCP straight to {name} at {addr} (IPv4): {got:?}"
            );
        }
    });
}

/// D-lab-2 — an IPv6-only Service (upstream: "should create a single stack
/// service with cluster ip from primary service range" with the IPv6
/// family, and "should function for pod-Service: tcp/udp" over IPv6):
/// `ipFamilies: [IPv6]`, `ipFamilyPolicy: SingleStack`, three pods. The
/// Service gets one ClusterIP, IPv6, from 2001:2:0:ff::/112; from the client
/// pod, new TCP connections and UDP datagrams (each from a new socket) to
/// [ClusterIP]:80 are answered by every pod.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d_lab_2_ipv6_only_service_tcp_and_udp() {
    let svc = Svc::new("web6")
        .selector("web6")
        .ipv6_only()
        .ports(tcp_and_udp(PORT));
    let yaml = yaml(Some(&svc), &pods("web6", 3));
    LabTest::new("d-lab-2").dual_stack().yaml(&yaml).run(|lab| {
        let (ips, families, policy) = service_families(lab, "web6");
        assert_eq!(families, ["IPv6"]);
        assert_eq!(policy, "SingleStack");
        assert_eq!(ips.len(), 1, "{ips:?}");
        assert!(lab.service_ip("web6").is_none(), "no IPv4 ClusterIP");
        let all = ["web6-1", "web6-2", "web6-3"];
        pods_answer_directly6(lab, &all, "D-lab-2");
        let c = lab.client().netns.clone();
        let tcp = frontend6(lab, "web6", PORT, "TCP");
        let udp = frontend6(lab, "web6", PORT, "UDP");
        assert_eq!(tcp.ip().to_string(), ips[0]);
        assert_answered_by(&c, tcp, "TCP", N, &all, "D-lab-2 TCP → IPv6 ClusterIP");
        assert_answered_by(&c, udp, "UDP", N, &all, "D-lab-2 UDP → IPv6 ClusterIP");
    });
}

/// D-lab-3 — dual-stack Services (upstream: "should create service with
/// ipv4,v6 cluster ip" and "should create service with ipv6,v4 cluster ip",
/// and "should function for service endpoints using hostNetwork"'s pod
/// half): `prefer`, `ipFamilies: [IPv4, IPv6]` with PreferDualStack, and
/// `require`, `ipFamilies: [IPv6, IPv4]` with RequireDualStack, over the
/// same three pods. Each Service gets a ClusterIP of each family, in
/// `ipFamilies` order; from the client pod, both ClusterIPs of each answer
/// TCP, each by every pod. A third, `maglev` (PreferDualStack, annotated
/// `proxy-agent.io/lb-algorithm: maglev`), answers on its IPv6 ClusterIP
/// by every pod too, and `proxy-agent inspect maglev` shows its IPv6
/// frontend's table: every slot filled, shared by the three pods' IPv6
/// addresses.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d_lab_3_dual_stack_service_answers_on_both_cluster_ips() {
    let prefer = Svc::new("prefer")
        .selector("dual")
        .dual_stack()
        .ports(tcp_and_udp(PORT));
    let require = Svc::new("require")
        .selector("dual")
        .ip_families(&["IPv6", "IPv4"])
        .ip_family_policy("RequireDualStack")
        .ports(tcp_and_udp(PORT));
    let maglev = Svc::new("maglev")
        .selector("dual")
        .dual_stack()
        .annotation("proxy-agent.io/lb-algorithm", "maglev")
        .ports(tcp_and_udp(PORT));
    let pods = pods("dual", 3);
    let mut objects: Vec<&dyn support::fixtures::Manifest> = vec![&prefer, &require, &maglev];
    objects.extend(pods.iter().map(|p| p as &dyn support::fixtures::Manifest));
    let yaml = manifests(&objects);
    LabTest::new("d-lab-3").dual_stack().yaml(&yaml).run(|lab| {
        for (name, families, policy) in [
            ("prefer", ["IPv4", "IPv6"], "PreferDualStack"),
            ("require", ["IPv6", "IPv4"], "RequireDualStack"),
        ] {
            let (ips, got_families, got_policy) = service_families(lab, name);
            assert_eq!(got_families, families, "{name}");
            assert_eq!(got_policy, policy, "{name}");
            let got: Vec<bool> = ips
                .iter()
                .map(|ip| ip.parse::<IpAddr>().expect("a clusterIP").is_ipv6())
                .collect();
            assert_eq!(got, families.map(|f| f == "IPv6"), "{name}: {ips:?}");
            assert_eq!(
                lab.service_ips(name)
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>(),
                ips,
                "{name}: lab.json's ClusterIP frontends"
            );
        }
        let all = ["dual-1", "dual-2", "dual-3"];
        pods_answer_directly6(lab, &all, "D-lab-3");
        let c = lab.client().netns.clone();
        for name in ["prefer", "require"] {
            let v4 = frontend(lab, name, PORT, "TCP");
            assert_answered_by(&c, v4, "TCP", N, &all, &format!("D-lab-3 {name} IPv4"));
            let v6 = frontend6(lab, name, PORT, "TCP");
            assert_answered_by(&c, v6, "TCP", N, &all, &format!("D-lab-3 {name} IPv6"));
        }
        let v6 = frontend6(lab, "maglev", PORT, "TCP");
        assert_answered_by(&c, v6, "TCP", N, &all, "D-lab-3 maglev IPv6");
        assert_maglev_table6(lab, v6, &all);
    });
}

/// Asserts that `proxy-agent inspect maglev` lists the IPv6 frontend `vip`
/// (TCP) with a full table (every chunk present) whose slots all name the
/// IPv6 addresses of `pods` at [`PORT`], each of them.
fn assert_maglev_table6(lab: &Lab, vip: SocketAddr, pods: &[&str]) {
    let out = std::process::Command::new(support::agent_bin())
        .args(["inspect", "maglev", "--output", "json", "--bpffs"])
        .arg(&lab.info().bpffs)
        .output()
        .expect("run proxy-agent inspect maglev");
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "inspect maglev --output json: {e}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let want = format!("{vip}/TCP");
    let row = rows
        .iter()
        .find(|r| r["frontend"] == want.as_str())
        .unwrap_or_else(|| panic!("no Maglev row for {want} in inspect maglev: {rows:#?}"));
    println!("D-lab-3 inspect maglev, {want}: {row}");
    let size = row["table_size"].as_u64().expect("table_size");
    let chunks = row["chunks"].as_str().expect("chunks");
    let (have, of) = chunks.split_once('/').expect("chunks as k/n");
    assert_eq!(have, of, "{want}: Maglev chunks present {chunks}");
    let entries = row["entries"].as_object().expect("entries");
    let mut names: Vec<String> = entries.keys().cloned().collect();
    names.sort();
    let mut expected: Vec<String> = pods.iter().map(|p| pod_addr6(lab, p).to_string()).collect();
    expected.sort();
    assert_eq!(names, expected, "{want}: backends in the Maglev table");
    let filled: u64 = entries.values().filter_map(|v| v.as_u64()).sum();
    assert_eq!(filled, size, "{want}: Maglev slots filled of {size}");
}

/// D-lab-4 — an endpoint update on IPv6 (upstream: the dual-stack
/// Service's endpoints follow its pods, as "should serve a basic endpoint
/// from pods" does for IPv4): a dual-stack Service over three pods; both
/// ClusterIPs are answered by all three; one pod deleted, both are
/// answered by the other two only (the IPv4 ClusterIP shows the agent took
/// the update; the IPv6 one must follow it).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d_lab_4_deleted_pod_stops_answering_on_the_ipv6_cluster_ip() {
    let svc = Svc::new("upd")
        .selector("upd")
        .dual_stack()
        .ports(tcp_and_udp(PORT));
    let yaml = yaml(Some(&svc), &pods("upd", 3));
    LabTest::new("d-lab-4").dual_stack().yaml(&yaml).run(|lab| {
        let all = ["upd-1", "upd-2", "upd-3"];
        pods_answer_directly6(lab, &all, "D-lab-4");
        let c = lab.client().netns.clone();
        let v4 = frontend(lab, "upd", PORT, "TCP");
        let v6 = frontend6(lab, "upd", PORT, "TCP");
        assert_answered_by(&c, v4, "TCP", N, &all, "D-lab-4 IPv4, 3 pods");
        assert_answered_by(&c, v6, "TCP", N, &all, "D-lab-4 IPv6, 3 pods");

        delete_pod(lab, "upd-3");
        let rest = ["upd-1", "upd-2"];
        assert_answered_by(&c, v4, "TCP", N, &rest, "D-lab-4 IPv4, upd-3 deleted");
        assert_answered_by(&c, v6, "TCP", N, &rest, "D-lab-4 IPv6, upd-3 deleted");
        let udp6 = frontend6(lab, "upd", PORT, "UDP");
        assert_answered_by(&c, udp6, "UDP", N, &rest, "D-lab-4 UDP IPv6, upd-3 deleted");
    });
}

/// D-lab-5 — an IPv6 Service across nodes (upstream: "should function for
/// pod-Service: tcp/udp" over IPv6, whose pods the e2e framework spreads
/// over the nodes): two nodes, an IPv6-only Service over `x-n1` on node-1
/// and `x-n2a`, `x-n2b` on node-2. From the client pod on node-1, new TCP
/// connections and UDP datagrams to [ClusterIP]:80 are answered by all
/// three (node-2's through node-1's `eth0` both ways: the request
/// translated on node-1 and forwarded, the reply reverse-translated as it
/// arrives on node-1's `eth0`), and every pod answering sees the client's
/// own IPv6 address (a ClusterIP is not SNATed between pods, on either
/// node).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d_lab_5_ipv6_cluster_ip_answered_by_pods_on_both_nodes() {
    let svc = Svc::new("x6")
        .selector("x")
        .ipv6_only()
        .ports(tcp_and_udp(PORT));
    let pods = [
        Pod::new("x-n1", "x").node("node-1").port(PORT, "TCP"),
        Pod::new("x-n2a", "x").node("node-2").port(PORT, "TCP"),
        Pod::new("x-n2b", "x").node("node-2").port(PORT, "TCP"),
    ];
    let yaml = yaml(Some(&svc), &pods);
    let lab_test = LabTest::new("d-lab-5").dual_stack().nodes(2).yaml(&yaml);
    lab_test.run(|lab| {
        let placed: Vec<(&str, &str)> = lab
            .pods()
            .iter()
            .map(|p| (p.name.as_str(), p.node.as_str()))
            .collect();
        assert_eq!(
            placed,
            [("x-n1", "node-1"), ("x-n2a", "node-2"), ("x-n2b", "node-2")],
            "pod placement"
        );
        let all = ["x-n1", "x-n2a", "x-n2b"];
        pods_answer_directly6(lab, &all, "D-lab-5");
        let c = lab.client().netns.clone();
        let tcp = frontend6(lab, "x6", PORT, "TCP");
        let udp = frontend6(lab, "x6", PORT, "UDP");
        assert_answered_by(
            &c,
            tcp,
            "TCP",
            N,
            &all,
            "D-lab-5 TCP → IPv6 ClusterIP from node-1",
        );
        assert_answered_by(
            &c,
            udp,
            "UDP",
            N,
            &all,
            "D-lab-5 UDP → IPv6 ClusterIP from node-1",
        );
        // Two in three land on node-2: (1/3)^30 that none does.
        let me = client_ip6(lab);
        assert_peer_seen(
            &c,
            tcp,
            N,
            me,
            "D-lab-5 client address through the ClusterIP",
        );
    });
}

/// D-lab-6 — an IPv6 NodePort from outside the cluster (upstream: "should
/// function for node-Service: http/udp" over IPv6 for
/// externalTrafficPolicy Cluster, and "ESIPP should work for type=NodePort"
/// for Local, which keeps the client's source address): two nodes,
/// IPv6-only NodePort Services; the external client (2001:2::64) connects
/// to node-1's IPv6 address at their NodePorts.
/// - `far`, eTP Cluster, its only pod `far-n2` on node-2: TCP and UDP are
///   answered by it, and it sees node-1's IPv6 address (the flow is SNATed
///   to the node it entered, so the reply comes back through it).
/// - `near`, eTP Local, pods `near-n1` on node-1 and `near-n2` on node-2:
///   only `near-n1` answers (node-1's local endpoint; Cluster would spread
///   over both), and it sees the external client's own IPv6 address.
///
/// Run twice, each time in a fresh lab, as `lab_northsouth.rs` runs its
/// scenarios: with the agent's `--acceleration none` and `xdp` (the
/// `ext_xdp` program on the nodes' `eth0`, checked to be there, sees the
/// external client's IPv6 packets first).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d_lab_6_ipv6_node_port_from_external_etp_cluster_and_local() {
    let far = Svc::new("far")
        .service_type("NodePort")
        .selector("far")
        .ipv6_only()
        .external_traffic_policy("Cluster")
        .ports(tcp_and_udp(PORT));
    let near = Svc::new("near")
        .service_type("NodePort")
        .selector("near")
        .ipv6_only()
        .external_traffic_policy("Local")
        .ports(tcp_and_udp(PORT));
    let pods = [
        Pod::new("far-n2", "far").node("node-2").port(PORT, "TCP"),
        Pod::new("near-n1", "near").node("node-1").port(PORT, "TCP"),
        Pod::new("near-n2", "near").node("node-2").port(PORT, "TCP"),
    ];
    let mut objects: Vec<&dyn support::fixtures::Manifest> = vec![&far, &near];
    objects.extend(pods.iter().map(|p| p as &dyn support::fixtures::Manifest));
    let yaml = manifests(&objects);
    for mode in ["none", "xdp"] {
        let test = format!("d-lab-6/{mode}");
        let args = ["--acceleration", mode];
        let lab_test = LabTest::new(&test)
            .dual_stack()
            .nodes(2)
            .yaml(&yaml)
            .args(&args);
        lab_test.run(|lab| {
            let eth0 = xdp_on_eth0(lab, "node-1");
            assert_eq!(
                eth0,
                mode == "xdp",
                "{test}: an XDP program on node-1's eth0"
            );
            let ext = lab.external().expect("an external client").clone();
            let me: IpAddr = ext
                .ip6
                .expect("the external client of a dual-stack lab has an IPv6 address")
                .into();
            assert_eq!(me, "2001:2::64".parse::<IpAddr>().unwrap());
            let node1 = node_ip6(lab, "node-1");
            pods_answer_directly6_from(
                lab,
                &ext.netns,
                me,
                &["far-n2", "near-n1", "near-n2"],
                &format!("{test} from the external client"),
            );

            let tcp = node_port6(lab, "far", PORT, "TCP", "node-1");
            let udp = node_port6(lab, "far", PORT, "UDP", "node-1");
            let what = format!("{test} eTP Cluster, external → node-1, pod on node-2");
            assert_answered_by(&ext.netns, tcp, "TCP", N, &["far-n2"], &what);
            assert_answered_by(&ext.netns, udp, "UDP", N, &["far-n2"], &what);
            assert_peer_seen(
                &ext.netns,
                tcp,
                5,
                node1,
                &format!("{what}: SNAT to node-1"),
            );

            let tcp = node_port6(lab, "near", PORT, "TCP", "node-1");
            let udp = node_port6(lab, "near", PORT, "UDP", "node-1");
            let what = format!("{test} eTP Local, external → node-1");
            assert_answered_by(&ext.netns, tcp, "TCP", N, &["near-n1"], &what);
            assert_answered_by(&ext.netns, udp, "UDP", N, &["near-n1"], &what);
            assert_peer_seen(
                &ext.netns,
                tcp,
                5,
                me,
                &format!("{what}: client address kept"),
            );
        });
    }
}

/// D-lab-7 — hairpin over IPv6 (upstream: "should allow pods to hairpin
/// back to themselves through services", with an IPv6-only Service): pod
/// `hp-1`, the only endpoint of IPv6-only `hp`, connects to [ClusterIP]:80
/// and is answered by itself over TCP and UDP; its server sees the hairpin
/// SNAT address (else it would answer itself from its own address, past the
/// reverse NAT): the node's IPv6 address by default, `--hairpin-snat-ip6`
/// when the agent is given one (the twin of the lab's IPv4 hairpin
/// address, 2001:2::fe; a second lab). In the first lab also `hpb-1`, one
/// of two endpoints of `hpb`, reaching `hpb` is answered by both, itself
/// among them.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d_lab_7_pod_hairpins_to_itself_through_ipv6_cluster_ip() {
    let hp = Svc::new("hp")
        .selector("hp")
        .ipv6_only()
        .ports(tcp_and_udp(PORT));
    let hpb = Svc::new("hpb")
        .selector("hpb")
        .ipv6_only()
        .ports(tcp_and_udp(PORT));
    let backends: Vec<Pod> = pods("hp", 1).into_iter().chain(pods("hpb", 2)).collect();
    let mut objects: Vec<&dyn support::fixtures::Manifest> = vec![&hp, &hpb];
    objects.extend(
        backends
            .iter()
            .map(|p| p as &dyn support::fixtures::Manifest),
    );
    let yaml = manifests(&objects);
    let snat6 = xtask::netns::ipv6_twin(xtask::lab::HAIRPIN_SNAT_IP).expect("a lab address");
    let flag = snat6.to_string();
    for (test, args) in [
        ("d-lab-7", Vec::new()),
        ("d-lab-7/flag", vec!["--hairpin-snat-ip6", flag.as_str()]),
    ] {
        let lab_test = LabTest::new(test).dual_stack().yaml(&yaml).args(&args);
        lab_test.run(|lab| {
            let want: IpAddr = if args.is_empty() {
                node_ip6(lab, "node-1")
            } else {
                snat6.into()
            };
            let all = ["hp-1", "hpb-1", "hpb-2"];
            pods_answer_directly6(lab, &all, test);
            let p = lab.pod("hp-1").expect("pod hp-1").netns.clone();
            let tcp = frontend6(lab, "hp", PORT, "TCP");
            let udp = frontend6(lab, "hp", PORT, "UDP");
            let what = format!("{test}: hp-1 → its IPv6 ClusterIP");
            assert_answered_by(&p, tcp, "TCP", 5, &["hp-1"], &what);
            assert_answered_by(&p, udp, "UDP", 5, &["hp-1"], &what);
            assert_peer_seen(&p, tcp, 3, want, &format!("{what}: hairpin SNAT"));
            if args.is_empty() {
                let b = lab.pod("hpb-1").expect("pod hpb-1").netns.clone();
                let vip = frontend6(lab, "hpb", PORT, "TCP");
                // Each of 2 missed by 30 random picks: 2 × 2^-30.
                let what = format!("{test}: hpb-1 → IPv6 ClusterIP of 2 pods");
                assert_answered_by(&b, vip, "TCP", N, &["hpb-1", "hpb-2"], &what);
            }
        });
    }
}

/// D-lab-8 — an IPv6 Service without endpoints is rejected (upstream:
/// "should be rejected when no endpoints exist", with an IPv6-only
/// Service: REFUSED, not a timeout): `empty`, selecting no pod. From the
/// client pod, each of 3 TCP connects to [ClusterIP]:80 fails with
/// connection refused (the datapath's ICMPv6 port unreachable; with no
/// datapath the node has no route to it: unreachable, not refused) within
/// [`TCP_REFUSED_WITHIN`] (the kernel takes the answer to the SYN's first
/// retransmission, see there), before the client's 2 s timeout; each of 3
/// UDP datagrams is refused within [`REFUSED_WITHIN`]. Then a pod matching
/// it is created: the ClusterIP answers, by that pod (the refusal followed
/// the endpoints).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d_lab_8_ipv6_service_without_endpoints_refuses() {
    let empty = Svc::new("empty")
        .selector("late")
        .ipv6_only()
        .ports(tcp_and_udp(PORT));
    let yaml = yaml(Some(&empty), &pods("other", 1));
    LabTest::new("d-lab-8").dual_stack().yaml(&yaml).run(|lab| {
        pods_answer_directly6(lab, &["other-1"], "D-lab-8");
        let c = lab.client().netns.clone();
        let tcp = frontend6(lab, "empty", PORT, "TCP");
        let udp = frontend6(lab, "empty", PORT, "UDP");
        for i in 1..=3 {
            let took = support::assert_tcp_refused(&c, tcp, &format!("D-lab-8 TCP try {i}"));
            assert!(
                took < TCP_REFUSED_WITHIN,
                "D-lab-8 TCP try {i}: refused only after {} ms",
                took.as_millis()
            );
        }
        for i in 1..=3 {
            let t = Instant::now();
            let r = client::udp_request(&c, udp, b"hostname", T, None).map(|r| reply_text(&r));
            let took = t.elapsed();
            println!(
                "D-lab-8 UDP try {i} {udp}: {r:?} after {} ms",
                took.as_millis()
            );
            assert!(
                matches!(&r, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused)
                    && took < REFUSED_WITHIN,
                "D-lab-8 UDP try {i} {udp}: expected refused within {} ms, got {r:?} after {} ms",
                REFUSED_WITHIN.as_millis(),
                took.as_millis()
            );
        }
        println!(
            "D-lab-8: reject_no_backend {} after 3 TCP tries (a SYN and its retransmission each) and 3 UDP",
            support::stat(lab, "node-1", "reject_no_backend")
        );

        let late = Pod::new("late-1", "late").port(PORT, "TCP");
        let took = support::apply(lab, &late.yaml());
        println!(
            "D-lab-8: late-1 created, agent synced in {} ms",
            took.as_millis()
        );
        pods_answer_directly6(lab, &["late-1"], "D-lab-8 late-1");
        assert_answered_by(
            &c,
            tcp,
            "TCP",
            5,
            &["late-1"],
            "D-lab-8 TCP, late-1 created",
        );
        assert_answered_by(
            &c,
            udp,
            "UDP",
            5,
            &["late-1"],
            "D-lab-8 UDP, late-1 created",
        );
    });
}

/// D10, D11 — "should function for client IP based session affinity:
/// http/udp" on the secondary ClusterIP: `sticky`, a dual-stack Service
/// (`ipFamilies: [IPv4, IPv6]`: its IPv6 ClusterIP is `clusterIPs[1]`) with
/// `sessionAffinity: ClientIP` over three pods. From the client pod, 10 new
/// TCP connections to its IPv6 ClusterIP are all answered by one pod, and
/// 10 UDP requests (each from a new socket, so a new flow) by one pod
/// (per protocol: TCP and UDP are frontends of their own, each may pick
/// another pod); the datapath counts an `affinity_hit` for every dial
/// after the first of each. The same 10 dials to `spread`, the same Service
/// without affinity over the same pods, reach more than one pod (3 ×
/// (1/3)^10 ≈ 5e-5 that they do not): the sticky result is the affinity's.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d10_d11_session_affinity_on_the_ipv6_cluster_ip() {
    let sticky = Svc::new("sticky")
        .selector("aff")
        .dual_stack()
        .client_ip_affinity(None)
        .ports(tcp_and_udp(PORT));
    let spread = Svc::new("spread")
        .selector("aff")
        .dual_stack()
        .no_affinity()
        .ports(tcp_and_udp(PORT));
    let pods = pods("aff", 3);
    let mut objects: Vec<&dyn support::fixtures::Manifest> = vec![&sticky, &spread];
    objects.extend(pods.iter().map(|p| p as &dyn support::fixtures::Manifest));
    let yaml = manifests(&objects);
    LabTest::new("d10-d11").dual_stack().yaml(&yaml).run(|lab| {
        let all = ["aff-1", "aff-2", "aff-3"];
        pods_answer_directly6(lab, &all, "D10/D11");
        let c = lab.client().netns.clone();
        let secondary = |name: &str| {
            let (ips, families, _) = service_families(lab, name);
            assert_eq!(families, ["IPv4", "IPv6"], "{name}");
            ips[1].parse::<IpAddr>().expect("a clusterIP")
        };
        let hits = support::stat(lab, "node-1", "affinity_hit");
        for (row, proto) in [("D10", "TCP"), ("D11", "UDP")] {
            let vip = frontend6(lab, "sticky", PORT, proto);
            assert_eq!(vip.ip(), secondary("sticky"), "{row}: clusterIPs[1]");
            let what = format!("{row} {proto} → IPv6 ClusterIP, ClientIP affinity");
            let counts = all_answered(&c, vip, proto, AFFINITY_DIALS, &what);
            assert_eq!(
                counts.len(),
                1,
                "{what}: {AFFINITY_DIALS} dials from one client answered by several pods: {counts:?}"
            );

            let vip = frontend6(lab, "spread", PORT, proto);
            assert_eq!(vip.ip(), secondary("spread"), "{row}: clusterIPs[1]");
            let what = format!("{row} {proto} → IPv6 ClusterIP, no affinity");
            let counts = all_answered(&c, vip, proto, AFFINITY_DIALS, &what);
            assert!(
                counts.len() > 1,
                "{what}: {AFFINITY_DIALS} dials all answered by one pod ({counts:?}): \
                 the affinity check above could not have failed"
            );
        }
        let hits = support::stat(lab, "node-1", "affinity_hit") - hits;
        println!("D10/D11: affinity_hit grew by {hits}");
        assert!(
            hits >= 2 * (AFFINITY_DIALS as u64 - 1),
            "D10/D11: affinity_hit grew by {hits}, expected at least {} (every dial after the first, per protocol)",
            2 * (AFFINITY_DIALS - 1)
        );
    });
}

/// D12, D13 — "should be able to handle large requests: http/udp" on the
/// secondary ClusterIP: a dual-stack Service over three pods. From the
/// client pod, to its IPv6 ClusterIP:
/// - TCP: `echo <2,000 bytes>` on new connections (segments of at most the
///   MSS, no fragments), answered with exactly those bytes.
/// - UDP: first a small datagram is answered (the path works), then
///   `echo <2,000 bytes>` in one datagram, each from a new socket: 2,053
///   bytes of IPv6 packet on the client's 1,500-byte `eth0`, so the client
///   sends it in two fragments, and the pod's 2,049-byte answer comes back
///   in two. The answer must be the payload exactly: the datapath records
///   the first fragment's ports and translates the later one to the same
///   pod (with three pods, a later fragment sent elsewhere would never be
///   reassembled), both ways. `fragment_tracked` grows by at least two
///   per request (the first fragment of the request, and of its answer).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d12_d13_large_requests_through_the_ipv6_cluster_ip() {
    let svc = Svc::new("echo")
        .selector("echo")
        .dual_stack()
        .ports(tcp_and_udp(PORT));
    let yaml = yaml(Some(&svc), &pods("echo", 3));
    LabTest::new("d12-d13").dual_stack().yaml(&yaml).run(|lab| {
        let all = ["echo-1", "echo-2", "echo-3"];
        pods_answer_directly6(lab, &all, "D12/D13");
        let c = lab.client().netns.clone();
        let (ips, _, _) = service_families(lab, "echo");
        let tcp = frontend6(lab, "echo", PORT, "TCP");
        let udp = frontend6(lab, "echo", PORT, "UDP");
        assert_eq!(tcp.ip().to_string(), ips[1], "clusterIPs[1]");
        assert_large_echo(&c, tcp, "TCP", LARGE_TRIES, "D12");

        let mtu = link_mtu(&c, "eth0");
        assert!(
            mtu < LARGE + 5 + 8 + 40,
            "D13: the client's eth0 has MTU {mtu}: a {LARGE}-byte datagram would not be fragmented"
        );
        all_answered(&c, udp, "UDP", 5, "D13 small datagrams first");
        let before = support::stat(lab, "node-1", "fragment_tracked");
        assert_large_echo(&c, udp, "UDP", LARGE_TRIES, "D13");
        let tracked = support::stat(lab, "node-1", "fragment_tracked") - before;
        println!(
            "D13: fragment_tracked grew by {tracked}, pass_fragment is {}",
            support::stat(lab, "node-1", "pass_fragment")
        );
        assert!(
            tracked >= 2 * LARGE_TRIES as u64,
            "D13: fragment_tracked grew by {tracked} over {LARGE_TRIES} fragmented requests \
             and their fragmented answers: expected a first fragment recorded each way"
        );
    });
}

/// D14 — "should function for service endpoints using hostNetwork" on the
/// secondary family (N21 over IPv6): two nodes, a dual-stack NodePort
/// Service (`clusterIPs[1]` IPv6) whose endpoints are the hostNetwork pods
/// `host-1` on node-1 and `host-2` on node-2: their `podIPs` are their
/// nodes' addresses (2001:2::a, 2001:2::b), their servers (started by the
/// test in the nodes' namespaces, TCP and UDP on [`HOST_PORT`], the
/// Service's targetPort) the nodes' own. After checking that the client pod
/// reaches each server straight at its node's IPv6 address, TCP and UDP are
/// answered by both endpoints
/// - from the client pod (node-1), on the IPv6 ClusterIP and on node-1's
///   IPv6 address at the NodePort;
/// - from node-1's host client (its namespace and cgroup: the socket
///   hooks), on the same two, each answer's peer being the address dialled;
///
/// and a 2,000-byte echo over TCP and UDP through the IPv6 ClusterIP is
/// answered intact, from the client pod (the UDP datagram in fragments) and
/// from the host client.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d14_host_network_endpoints_over_ipv6() {
    let svc = Svc::new("hostnet")
        .service_type("NodePort")
        .selector("hostnet")
        .dual_stack()
        .port(Port::tcp("tcp", PORT).target_port(HOST_PORT))
        .port(Port::udp("udp", PORT).target_port(HOST_PORT));
    let pods: Vec<Pod> = ["node-1", "node-2"]
        .iter()
        .enumerate()
        .map(|(i, node)| {
            Pod::new(&format!("host-{}", i + 1), "hostnet")
                .host_network()
                .node(node)
                .port(HOST_PORT, "TCP")
                .port(HOST_PORT, "UDP")
        })
        .collect();
    let yaml = yaml(Some(&svc), &pods);
    let lab_test = LabTest::new("d14").dual_stack().nodes(2).yaml(&yaml);
    lab_test.run(|lab| {
        let both = ["host-1", "host-2"];
        let mut servers = Vec::new();
        for (name, node) in both.iter().zip(["node-1", "node-2"]) {
            let p = lab.pod(name).unwrap_or_else(|| panic!("no pod {name}"));
            let n = lab.node_named(node).expect("node");
            assert_eq!(
                (p.ip, p.ip6, p.netns.as_str()),
                (n.ip, n.ip6, n.netns.as_str()),
                "{name}: a hostNetwork pod has its node's addresses and namespace"
            );
            servers.push(HostServer::start(lab, node, name, HOST_PORT));
        }
        let c = lab.client().netns.clone();
        for (name, node) in both.iter().zip(["node-1", "node-2"]) {
            let direct = SocketAddr::new(node_ip6(lab, node), HOST_PORT);
            let what = format!("D14: straight to {name} at {direct}");
            assert_answered_by(&c, direct, "TCP", 1, &[*name], &what);
            assert_answered_by(&c, direct, "UDP", 1, &[*name], &what);
        }

        let (ips, _, _) = service_families(lab, "hostnet");
        let mut targets = Vec::new();
        for proto in ["TCP", "UDP"] {
            let vip = frontend6(lab, "hostnet", PORT, proto);
            assert_eq!(vip.ip().to_string(), ips[1], "clusterIPs[1]");
            targets.push((proto, "IPv6 ClusterIP", vip));
            let np = node_port6(lab, "hostnet", PORT, proto, "node-1");
            targets.push((proto, "node-1's IPv6 NodePort", np));
        }
        for (proto, what, addr) in &targets {
            let what = format!("D14 pod → {what} (hostNetwork endpoints)");
            assert_answered_by(&c, *addr, proto, N, &both, &what);
        }
        let mut host = lab
            .host_client("node-1")
            .unwrap_or_else(|e| panic!("host client on node-1: {e:#}"));
        for (proto, what, addr) in &targets {
            let what = format!("D14 node-1 → {what} (hostNetwork endpoints)");
            let counts = support::host_spread(&mut host, proto, *addr, N);
            println!("{what}: {N} {proto} requests to {addr}: {counts:?}");
            assert_eq!(
                counts.keys().map(String::as_str).collect::<Vec<_>>(),
                both,
                "{what}: {proto} {addr} answered by {counts:?}"
            );
        }

        let tcp = frontend6(lab, "hostnet", PORT, "TCP");
        let udp = frontend6(lab, "hostnet", PORT, "UDP");
        assert_large_echo(&c, tcp, "TCP", LARGE_TRIES, "D14 pod");
        assert_large_echo(&c, udp, "UDP", LARGE_TRIES, "D14 pod");
        let data = large_payload();
        let request = format!("echo {}", String::from_utf8_lossy(&data));
        for (proto, addr) in [("TCP", tcp), ("UDP", udp)] {
            for i in 1..=LARGE_TRIES {
                let r = match proto {
                    "TCP" => host.tcp(addr, &request),
                    _ => host.udp(addr, &request),
                }
                .expect("host client");
                let text = r.text().map(str::as_bytes);
                let len = text.map(<[u8]>::len);
                println!("D14 node-1 {proto} large request {i} to {addr}: {len:?} bytes back");
                assert!(
                    text == Some(&data[..]),
                    "D14 node-1 {proto} {addr} try {i}: echo not intact ({len:?} bytes back, {:?})",
                    r.error_kind()
                );
            }
        }
        drop(servers);
    });
}

// ------------------------------------------------- IPv6 runs of S and K rows
//
// The rows of `service-behaviours.md` sections A and F that the issue asks
// to run over IPv6 and that no D test above already reproduces: the same
// scenarios as their IPv4 tests (`lab.rs`, `lab_northsouth.rs`), on
// IPv6-only Services of a dual-stack lab.

/// Asserts that `tries` requests over `proto` from `ns` to `addr` are each
/// refused (ICMPv6 port unreachable, or a TCP RST from a node's stack),
/// TCP within [`TCP_REFUSED_WITHIN`] and UDP within [`REFUSED_WITHIN`].
fn assert_refused6(ns: &str, addr: SocketAddr, proto: &str, tries: usize, what: &str) {
    let within = if proto == "TCP" {
        TCP_REFUSED_WITHIN
    } else {
        REFUSED_WITHIN
    };
    for i in 1..=tries {
        let t = Instant::now();
        let r = match proto {
            "TCP" => client::tcp_request(ns, addr, b"hostname\n", T),
            _ => client::udp_request(ns, addr, b"hostname", T, None),
        }
        .map(|r| reply_text(&r));
        let took = t.elapsed();
        println!(
            "{what}: {proto} {addr} try {i}: {r:?} after {} ms",
            took.as_millis()
        );
        assert!(
            matches!(&r, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused) && took < within,
            "{what}: {proto} {addr} try {i}: expected refused within {} ms, got {r:?} after {} ms",
            within.as_millis(),
            took.as_millis()
        );
    }
}

/// S1 over IPv6 — "should serve a basic endpoint from pods": an IPv6-only
/// Service `web6` over `pod-1`; `pod-2` added, then `pod-1` and `pod-2`
/// deleted one after another. After each change new TCP connections to
/// [ClusterIP]:80 are answered by exactly the pods there are; with none
/// left, a connect is refused.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s1_ipv6_basic_endpoint_added_and_removed() {
    let svc = Svc::new("web6")
        .selector("web")
        .ipv6_only()
        .ports(tcp_and_udp(PORT));
    let yaml = yaml(Some(&svc), &[Pod::new("pod-1", "web").port(PORT, "TCP")]);
    LabTest::new("s1-ipv6").dual_stack().yaml(&yaml).run(|lab| {
        pods_answer_directly6(lab, &["pod-1"], "S1 IPv6");
        let c = lab.client().netns.clone();
        let vip = frontend6(lab, "web6", PORT, "TCP");
        assert_answered_by(&c, vip, "TCP", 10, &["pod-1"], "S1 IPv6 pod-1 only");

        let pod2 = Pod::new("pod-2", "web").port(PORT, "TCP");
        support::apply(lab, &pod2.yaml());
        let both = ["pod-1", "pod-2"];
        assert_answered_by(&c, vip, "TCP", N, &both, "S1 IPv6 pod-1 + pod-2");

        delete_pod(lab, "pod-1");
        assert_answered_by(&c, vip, "TCP", N, &["pod-2"], "S1 IPv6 pod-1 deleted");

        delete_pod(lab, "pod-2");
        assert_refused6(&c, vip, "TCP", 2, "S1 IPv6 no pods left");
    });
}

/// S2 over IPv6 — "should serve multiport endpoints from pods": an
/// IPv6-only Service with ports 80 and 81 whose targetPorts are the named
/// ports `svc1` and `svc2`; `pod-1` exposes `svc1` on 100, `pod-2` `svc2`
/// on 101. [ClusterIP]:80 is answered by `pod-1` only (at its port 100),
/// [ClusterIP]:81 by `pod-2` only (at 101).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s2_ipv6_multiport_named_target_ports() {
    let svc = Svc::new("multi")
        .selector("multi")
        .ipv6_only()
        .port(Port::tcp("p80", 80).target_name("svc1"))
        .port(Port::tcp("p81", 81).target_name("svc2"));
    let pods = [
        Pod::new("pod-1", "multi").named_port("svc1", 100, "TCP"),
        Pod::new("pod-2", "multi").named_port("svc2", 101, "TCP"),
    ];
    let yaml = yaml(Some(&svc), &pods);
    LabTest::new("s2-ipv6").dual_stack().yaml(&yaml).run(|lab| {
        let c = lab.client().netns.clone();
        let p80 = frontend6(lab, "multi", 80, "TCP");
        let p81 = frontend6(lab, "multi", 81, "TCP");
        assert!(p80.is_ipv6() && p81.is_ipv6());
        assert_answered_by(&c, p80, "TCP", 20, &["pod-1"], "S2 IPv6 port 80 → svc1");
        assert_answered_by(&c, p81, "TCP", 20, &["pod-2"], "S2 IPv6 port 81 → svc2");
    });
}

/// S10 over IPv6 — "should be able to create a functioning NodePort
/// service": two nodes, an IPv6-only NodePort Service over `web-1` on
/// node-1 and `web-2` on node-2. From the external client, each node's
/// IPv6 address at the NodePort is answered by both pods, TCP and UDP
/// (the other node's through eTP Cluster's SNAT); from the client pod the
/// IPv6 ClusterIP is too.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s10_ipv6_node_port_reachable_on_every_node() {
    let svc = Svc::new("web")
        .service_type("NodePort")
        .selector("web")
        .ipv6_only()
        .ports(tcp_and_udp(PORT));
    let pods = [
        Pod::new("web-1", "web").node("node-1").port(PORT, "TCP"),
        Pod::new("web-2", "web").node("node-2").port(PORT, "TCP"),
    ];
    let yaml = yaml(Some(&svc), &pods);
    let lab_test = LabTest::new("s10-ipv6").dual_stack().nodes(2).yaml(&yaml);
    lab_test.run(|lab| {
        let x = lab.external().expect("an external client").netns.clone();
        let both = ["web-1", "web-2"];
        for node in ["node-1", "node-2"] {
            for proto in ["TCP", "UDP"] {
                let np = node_port6(lab, "web", PORT, proto, node);
                let what = format!("S10 IPv6 {proto} external → {node}");
                assert_answered_by(&x, np, proto, N, &both, &what);
            }
        }
        let c = lab.client().netns.clone();
        let vip = frontend6(lab, "web", PORT, "TCP");
        assert_answered_by(&c, vip, "TCP", N, &both, "S10 IPv6 pod → ClusterIP");
    });
}

/// S12 / S39 over IPv6 — TCP and UDP on the same service port (80) and the
/// same nodePort number (30080) of an IPv6-only Service, its pod on
/// node-2: both protocols answered through node-1's and node-2's IPv6
/// NodePort from the external client, through node-1's from a pod, and
/// through the ClusterIP. Updated to TCP only, UDP stops (refused by
/// node-1's stack: no UDP frontend, nothing listens) while TCP still
/// works; then UDP only, TCP stops (a RST from node-1's stack) while UDP
/// works.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s12_s39_ipv6_tcp_and_udp_on_same_node_port_number() {
    let svc = |ports: &[Port]| {
        Svc::new("dual")
            .service_type("NodePort")
            .no_affinity()
            .selector("dual")
            .ipv6_only()
            .ports(ports.to_vec())
    };
    let tcp = Port::tcp("tcp", PORT).node_port(30080);
    let udp = Port::udp("udp", PORT).node_port(30080);
    let pods = [Pod::new("dual-1", "dual").node("node-2").port(PORT, "TCP")];
    let yaml = yaml(Some(&svc(&[tcp.clone(), udp.clone()])), &pods);
    let lab_test = LabTest::new("s12-s39-ipv6")
        .dual_stack()
        .nodes(2)
        .yaml(&yaml);
    lab_test.run(|lab| {
        let x = lab.external().expect("an external client").netns.clone();
        let c = lab.client().netns.clone();
        let np1 = SocketAddr::new(node_ip6(lab, "node-1"), 30080);
        let np2 = SocketAddr::new(node_ip6(lab, "node-2"), 30080);
        let vip = frontend6(lab, "dual", PORT, "TCP");
        for proto in ["TCP", "UDP"] {
            assert_eq!(node_port6(lab, "dual", PORT, proto, "node-1"), np1);
            let what = format!("S12 IPv6 both, {proto}");
            assert_answered_by(
                &x,
                np1,
                proto,
                5,
                &["dual-1"],
                &format!("{what} external → node-1"),
            );
            assert_answered_by(
                &x,
                np2,
                proto,
                5,
                &["dual-1"],
                &format!("{what} external → node-2"),
            );
            assert_answered_by(
                &c,
                np1,
                proto,
                5,
                &["dual-1"],
                &format!("{what} pod → node-1"),
            );
            assert_answered_by(
                &c,
                vip,
                proto,
                5,
                &["dual-1"],
                &format!("S39 IPv6 both, {proto} pod → ClusterIP"),
            );
        }

        let took = support::apply(lab, &svc(std::slice::from_ref(&tcp)).yaml());
        println!("S39 IPv6 TCP only: synced in {} ms", took.as_millis());
        assert_answered_by(
            &x,
            np1,
            "TCP",
            5,
            &["dual-1"],
            "S39 IPv6 TCP only, external → node-1",
        );
        assert_answered_by(
            &c,
            vip,
            "TCP",
            5,
            &["dual-1"],
            "S39 IPv6 TCP only, pod → ClusterIP",
        );
        assert_refused6(
            &x,
            np1,
            "UDP",
            3,
            "S39 IPv6 TCP only: UDP external → node-1",
        );
        let r = client::udp_request(&c, vip, b"hostname", T, None);
        println!("S39 IPv6 TCP only: UDP pod → ClusterIP: {r:?}");
        assert!(
            r.is_err(),
            "S39 IPv6 TCP only: UDP ClusterIP still answered: {r:?}"
        );

        let took = support::apply(lab, &svc(std::slice::from_ref(&udp)).yaml());
        println!("S39 IPv6 UDP only: synced in {} ms", took.as_millis());
        assert_answered_by(
            &x,
            np1,
            "UDP",
            5,
            &["dual-1"],
            "S39 IPv6 UDP only, external → node-1",
        );
        assert_answered_by(
            &c,
            vip,
            "UDP",
            5,
            &["dual-1"],
            "S39 IPv6 UDP only, pod → ClusterIP",
        );
        assert_refused6(
            &x,
            np1,
            "TCP",
            3,
            "S39 IPv6 UDP only: TCP external → node-1",
        );
    });
}

/// S17 over IPv6 — "should release NodePorts on delete": an IPv6-only
/// NodePort Service (TCP and UDP, nodePort 30017), its pod on node-2. While
/// the NodePort answers from the external client, nothing listens on port
/// 30017 in either node's namespace (`ss -ltnu`: the proxy opens no socket
/// for a NodePort, of either family); deleted, the NodePort is refused;
/// re-created with the same nodePort, it answers TCP and UDP again and
/// still nothing listens.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s17_ipv6_no_listener_on_node_port() {
    let svc = Svc::new("web")
        .service_type("NodePort")
        .selector("web")
        .ipv6_only()
        .ports([
            Port::tcp("tcp", PORT).node_port(30017),
            Port::udp("udp", PORT).node_port(30017),
        ]);
    let pods = [Pod::new("web-1", "web").node("node-2").port(PORT, "TCP")];
    let yaml = yaml(Some(&svc), &pods);
    let lab_test = LabTest::new("s17-ipv6").dual_stack().nodes(2).yaml(&yaml);
    lab_test.run(|lab| {
        let x = lab.external().expect("an external client").netns.clone();
        let np = SocketAddr::new(node_ip6(lab, "node-1"), 30017);
        assert_answered_by(&x, np, "TCP", 3, &["web-1"], "S17 IPv6 before");
        let no_listener = |lab: &Lab, when: &str| {
            for node in ["node-1", "node-2"] {
                let ss = support::listeners(lab, node);
                println!("S17 IPv6 {when}: {node} listeners:\n{ss}");
                assert!(
                    !support::listens_on(&ss, 30017),
                    "S17 IPv6 {when}: something listens on {node}:30017:\n{ss}"
                );
            }
        };
        no_listener(lab, "before");
        lab.delete_service("web")
            .unwrap_or_else(|e| panic!("delete_service: {e:#}"));
        support::synced(lab);
        assert_refused6(&x, np, "TCP", 2, "S17 IPv6 deleted");
        support::apply(lab, &svc.yaml());
        assert_answered_by(&x, np, "TCP", 3, &["web-1"], "S17 IPv6 re-created");
        assert_answered_by(&x, np, "UDP", 3, &["web-1"], "S17 IPv6 re-created");
        no_listener(lab, "re-created");
    });
}

/// K4 over IPv6 (S29's NodePort half) — an IPv6-only NodePort Service
/// without endpoints refuses the external client at once on every node,
/// TCP and UDP (ICMPv6 port unreachable from the datapath, counted in
/// `reject_no_backend`); with eTP Local and its only endpoint on node-1,
/// node-1 answers while node-2 drops (`drop_no_local_backend`), TCP and
/// UDP.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn k4_ipv6_node_port_without_endpoints_refused_etp_local_dropped() {
    let svc = |selector: &str, etp: &str| {
        Svc::new("empty")
            .service_type("NodePort")
            .selector(selector)
            .ipv6_only()
            .external_traffic_policy(etp)
            .ports(tcp_and_udp(PORT))
    };
    let pods = [Pod::new("k4-1", "k4").node("node-1").port(PORT, "TCP")];
    let yaml = yaml(Some(&svc("nobody", "Cluster")), &pods);
    let lab_test = LabTest::new("k4-ipv6").dual_stack().nodes(2).yaml(&yaml);
    lab_test.run(|lab| {
        let x = lab.external().expect("an external client").netns.clone();
        let before = support::stat(lab, "node-2", "reject_no_backend");
        for proto in ["TCP", "UDP"] {
            for node in ["node-1", "node-2"] {
                let np = node_port6(lab, "empty", PORT, proto, node);
                let what = format!("K4 IPv6 no endpoints, external → {node}");
                assert_refused6(&x, np, proto, 3, &what);
            }
        }
        let after = support::stat(lab, "node-2", "reject_no_backend");
        println!("K4 IPv6 node-2 reject_no_backend {before} → {after}");
        assert!(
            after > before,
            "K4 IPv6: refusals not counted by the datapath on node-2 ({before} → {after})"
        );

        support::apply(lab, &svc("k4", "Local").yaml());
        let np1 = node_port6(lab, "empty", PORT, "TCP", "node-1");
        let what = "K4 IPv6 eTP Local, external → node-1";
        assert_answered_by(&x, np1, "TCP", 5, &["k4-1"], what);
        let before = support::stat(lab, "node-2", "drop_no_local_backend");
        let np2 = node_port6(lab, "empty", PORT, "TCP", "node-2");
        let what = "K4 IPv6 eTP Local, external → node-2 (no local endpoint)";
        support::assert_tcp_dropped(&x, np2, 2, what);
        let unp2 = node_port6(lab, "empty", PORT, "UDP", "node-2");
        let r = client::udp_request(&x, unp2, b"hostname", T, None);
        println!("{what}: UDP {unp2}: {r:?}");
        assert!(
            matches!(&r, Err(e) if e.kind() == io::ErrorKind::TimedOut),
            "{what}: UDP should be dropped: {r:?}"
        );
        let after = support::stat(lab, "node-2", "drop_no_local_backend");
        println!("K4 IPv6 node-2 drop_no_local_backend {before} → {after}");
        assert!(
            after >= before + 3,
            "K4 IPv6: node-2 drops not counted ({before} → {after})"
        );
    });
}

/// K1 over IPv6 — a UDP flow leaves a deleted endpoint: the field bug's
/// three steps ([`support::flows::k1_udp_flow_leaves_deleted_endpoint`])
/// through the IPv6 ClusterIP of a dual-stack Service `statsd` (UDP 8125)
/// over `pod-a` and `pod-b`: the flow (one client socket, a fixed source
/// port) moves to the other pod within 1 s of its pod's deletion, is
/// refused (ICMPv6) within 1 s of the last one's, and reaches a new pod
/// within 1 s.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn k1_ipv6_udp_flow_leaves_deleted_endpoint() {
    let svc = Svc::new("statsd")
        .selector("statsd")
        .dual_stack()
        .port(Port::udp("udp", 8125));
    let pods = [
        Pod::new("pod-a", "statsd").port(8125, "UDP"),
        Pod::new("pod-b", "statsd").port(8125, "UDP"),
    ];
    let yaml = yaml(Some(&svc), &pods);
    LabTest::new("k1-ipv6").dual_stack().yaml(&yaml).run(|lab| {
        let vip = frontend6(lab, "statsd", 8125, "UDP");
        support::flows::k1_udp_flow_leaves_deleted_endpoint_via(
            lab,
            &support::flows::Placement {
                what: "K1 IPv6",
                bind_port: 40011,
                new_pod_node: None,
            },
            vip,
        );
    });
}

/// D6, D7 — "should function for endpoint-Service: http/udp" on the
/// secondary family: a dual-stack NodePort Service (`ipFamilies: [IPv4,
/// IPv6]`) over three pods. From one of its own endpoint pods, new TCP
/// connections and UDP datagrams to the secondary (IPv6) ClusterIP and to
/// the node's IPv6 address at the NodePort reach every pod, the sender
/// itself included (hairpin, SNAT to the node's IPv6 address).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d6_d7_endpoint_to_secondary_cluster_ip_and_node_port() {
    let svc = Svc::new("ep")
        .service_type("NodePort")
        .selector("ep")
        .dual_stack()
        .ports(tcp_and_udp(PORT));
    let yaml = yaml(Some(&svc), &pods("ep", 3));
    LabTest::new("d6-d7").dual_stack().yaml(&yaml).run(|lab| {
        let all = ["ep-1", "ep-2", "ep-3"];
        pods_answer_directly6(lab, &all, "D6/D7");
        let from = lab.pod("ep-1").expect("pod ep-1").netns.clone();
        for proto in ["TCP", "UDP"] {
            let vip = frontend6(lab, "ep", PORT, proto);
            let np = node_port6(lab, "ep", PORT, proto, "node-1");
            assert!(vip.is_ipv6() && np.is_ipv6(), "{vip} {np}");
            let what = format!("D6/D7 ep-1 → secondary ClusterIP, {proto}");
            assert_answered_by(&from, vip, proto, N, &all, &what);
            let what = format!("D6/D7 ep-1 → [node IPv6]:nodePort, {proto}");
            assert_answered_by(&from, np, proto, N, &all, &what);
        }
    });
}

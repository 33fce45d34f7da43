//! Real kube-proxy as the conformance oracle (issue 39): one lab with a
//! real control plane, the same Services and Pods, the same client actions,
//! run under kube-proxy v1.37.2 in iptables mode, then in nftables mode,
//! then under the agent. What each client observes is recorded as text
//! (which backends answer; answered, refused or no answer; the source
//! address the backend sees; affinity) and compared, key by key, with
//! kube-proxy's. The families of `shared/conformance/service-behaviours.md`
//! it covers: Services from pods over TCP and UDP (S), without endpoints
//! (S29/K4), terminating and not-ready endpoints (S35/S36), session affinity
//! (S24), NodePorts from outside and on an address added later (S10, N),
//! both traffic policies (E, P), externalIPs and loadBalancerSourceRanges
//! (L), host clients and 127.0.0.1 NodePorts (L1/L2), an unallocated
//! ServiceCIDR address and an undeclared port; `trafficDistribution`
//! PreferClose and PreferSameNode from clients in two zones (T1/T5), a
//! ClusterIP of a second ServiceCIDR object (SC1), Services without
//! endpoints over UDP, from the host and through a NodePort (K4/C2), and
//! conntrack hygiene for UDP clients on one source port: the backend left
//! (C2/K1, and from the host, C4), endpoints went 0→1 (K2) or unready →
//! ready (C5), two ClusterIPs sharing a backend (field bug C6).
//!
//! Dual-stack (D) has a lab and a test of its own
//! ([`kube_proxy_oracle_dual_stack_observations_match_the_agent_or_are_listed`]):
//! a RequireDualStack Service from a pod on its IPv4 and IPv6 ClusterIPs
//! (TCP, UDP, source seen: D1/D2) and on a node's IPv6 NodePort, an
//! IPv6-only Service, an IPv6 NodePort from the external client, a host
//! client to the IPv6 ClusterIP and NodePort (D4) and an IPv6 Service
//! without endpoints; kube-proxy's nodes route the IPv6 ServiceCIDR too
//! ([`Lab::route_service_cidr`]).
//!
//! Every difference is either a failure or listed in [`KEPT`] with its
//! reason, the table of docs/kube-proxy-differences.md; an entry of [`KEPT`] that no
//! longer differs fails too, so the table stays true.
//!
//! Between the phases kube-proxy is stopped and `kube-proxy --cleanup`
//! run; the test fails if any of its rules remain in a node, and checks
//! that the machine's own namespace gained no rule. IPVS mode runs where
//! the kernel has it ([`KubeProxyMode::available`]); the machines' 6.18
//! kernel is built without it.
//!
//! Run with `cargo xtask test` (`#[ignore]`d under a plain `cargo test`).
//!
//! Why one file (about 1,200 lines): both tests run the same phases
//! (`start`, `observe`, `stop` for each proxy, the machine's rules before
//! and after) and compare what they saw against the one table [`KEPT`],
//! whose keys are the observations' own names; most of the rest is
//! `observe`, one client action after another on the one lab.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use support::fixtures::{manifests, Ep, Pod, Port, Slice, Svc};
use support::flows::connect_from;
// `T` (2 s): an answer within it, else "no answer".
use support::{attached, LabTest, T};
use xtask::client::{self, reply_text};
use xtask::lab::kube_proxy::{KubeProxyMode, KubeProxyOptions};
use xtask::lab::HostReply;
use xtask::Lab;

/// How long a proxy may take to come up or to sync.
const SYNC_TIMEOUT: Duration = Duration::from_secs(60);
/// Connections per check of which backends answer.
const N: usize = 12;
/// An address added to node-1's eth0 after the proxy started (a keepalived
/// or kube-vip VIP).
const ADDED_NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 61);
/// `web`'s externalIP, routed to node-1 by the external client.
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 201);
/// `lbr`'s load-balancer IP, routed to node-1 by the external client.
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 202);
/// An address of the ServiceCIDR no Service holds.
const UNALLOCATED_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 255, 254);
/// A second ServiceCIDR object's range (SC1), used nowhere else in the lab.
const SECOND_SERVICE_CIDR: &str = "198.18.240.0/24";
/// `sc1`'s ClusterIP, from [`SECOND_SERVICE_CIDR`].
const SECOND_CIDR_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 240, 10);
/// An address of [`SECOND_SERVICE_CIDR`] no Service holds.
const SECOND_CIDR_UNALLOCATED_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 240, 254);
/// The zones of node-1 and node-2 (T1/T5).
const ZONES: [&str; 2] = ["zone-a", "zone-b"];
/// A client pod on node-2 (zone-b), beside the default one on node-1.
const CLIENT_2: &str = "client-2";
/// Timeout of one datagram of the fixed-source-port UDP checks.
const T_UDP: Duration = Duration::from_millis(500);
/// First fixed UDP source port of the conntrack checks; each proxy gets
/// its own ten ([`observe`]), so that no kernel conntrack entry left by an
/// earlier proxy's flows meets a later one's.
const UDP_PORT_BASE: u16 = 41000;
/// The oracle client's ephemeral ports: above every fixed source port
/// (`UDP_PORT_BASE + 10 * phase + k`, phases of three proxies).
const EPHEMERAL_PORTS: &str = "42000 60999";

/// A difference from kube-proxy kept on purpose: the observation `key`,
/// the mode it differs from, and why: docs/kube-proxy-differences.md.
struct Kept {
    key: &'static str,
    mode: KubeProxyMode,
    reason: &'static str,
}

const KEPT: &[Kept] = &[
    Kept {
        key: "external → NodePort node-1 (Cluster): source seen",
        mode: KubeProxyMode::Iptables,
        reason: SNAT_LOCAL,
    },
    Kept {
        key: "external → NodePort node-1 (Cluster): source seen",
        mode: KubeProxyMode::Nftables,
        reason: SNAT_LOCAL,
    },
    Kept {
        key: "external → NodePort node-2 (Cluster): source seen",
        mode: KubeProxyMode::Iptables,
        reason: SNAT_LOCAL,
    },
    Kept {
        key: "external → NodePort node-2 (Cluster): source seen",
        mode: KubeProxyMode::Nftables,
        reason: SNAT_LOCAL,
    },
    Kept {
        key: "external → NodePort on node-2's IPv6 address (Cluster): source seen",
        mode: KubeProxyMode::Iptables,
        reason: SNAT_LOCAL,
    },
    Kept {
        key: "external → NodePort on node-2's IPv6 address (Cluster): source seen",
        mode: KubeProxyMode::Nftables,
        reason: SNAT_LOCAL,
    },
    Kept {
        key: "host → NodePort on 127.0.0.1",
        mode: KubeProxyMode::Nftables,
        reason: "kube-proxy's nftables mode does not serve NodePorts on 127.0.0.1 on \
                 purpose (they need route_localnet, CVE-2020-8558); its iptables mode, the \
                 default, does, and so does the agent, through its socket hooks, without \
                 route_localnet (rows L1/L2)",
    },
    Kept {
        key: "pod → undeclared port of a ClusterIP",
        mode: KubeProxyMode::Nftables,
        reason: "kube-proxy's nftables mode rejects a packet to a port a ClusterIP does \
                 not declare; its iptables mode, the default, lets it go on unanswered, \
                 as the agent does",
    },
    Kept {
        key: "external → NodePort on an address added later",
        mode: KubeProxyMode::Nftables,
        reason: "kube-proxy's nftables mode serves NodePorts on the node's primary IPs \
                 by default; its iptables mode, the default, serves every local address, \
                 and the agent every address of its external interfaces, also one added \
                 later (a keepalived or kube-vip VIP)",
    },
];

/// Why a backend on the receiving node sees the external client (over
/// IPv4 and IPv6; kube-proxy's IPv6 masquerade picks the node's address
/// towards the pod, the pods' IPv6 gateway 2001:2::1).
const SNAT_LOCAL: &str = "externalTrafficPolicy: Cluster: a backend on the node the \
    packet arrived at sees the client's address (the reply passes this node's reverse \
    NAT anyway, so no SNAT is needed; Cilium does the same); kube-proxy masquerades \
    every such packet, to the address of the interface towards the backend. A backend \
    on another node sees the node's address under both";

/// The proxies in the order they run: kube-proxy's modes first (the
/// agent's programs stay attached to the node's interfaces after it stops,
/// so it goes last).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Proxy {
    KubeProxy(KubeProxyMode),
    Agent,
}

impl std::fmt::Display for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Proxy::KubeProxy(m) => write!(f, "{m}"),
            Proxy::Agent => write!(f, "agent"),
        }
    }
}

fn svc(name: &str, type_: &str) -> Svc {
    Svc::new(name).service_type(type_).no_affinity()
}

fn objects() -> String {
    manifests(&[
        &Pod::new("web-1", "web").node("node-1").port(80, "TCP"),
        &Pod::new("web-2", "web").node("node-2").port(80, "TCP"),
        &Pod::new("loc-2", "loc").node("node-2").port(80, "TCP"),
        &Pod::new("aff-1", "aff").node("node-1").port(80, "TCP"),
        &Pod::new("aff-2", "aff").node("node-2").port(80, "TCP"),
        &svc("web", "NodePort")
            .selector("web")
            .ports([Port::tcp("tcp", 80), Port::udp("udp", 80)])
            .external_ips(&[EXTERNAL_IP]),
        &svc("empty", "NodePort")
            .selector("nothing")
            .ports([Port::tcp("tcp", 80), Port::udp("udp", 80)]),
        &svc("loc", "NodePort")
            .selector("loc")
            .port(Port::tcp("tcp", 80))
            .external_traffic_policy("Local"),
        &svc("aff", "ClusterIP")
            .selector("aff")
            .port(Port::tcp("tcp", 80))
            .client_ip_affinity(None),
        &svc("itp", "ClusterIP")
            .selector("loc")
            .port(Port::tcp("tcp", 80))
            .internal_traffic_policy("Local"),
        // Its endpoints are the test's own slice (no selector).
        &svc("term", "ClusterIP").port(Port::tcp("tcp", 80)),
        &svc("lbr", "LoadBalancer")
            .selector("web")
            .port(Port::tcp("tcp", 80))
            .lb_ips(&[LB_IP])
            .source_ranges(&["198.18.1.0/24"]),
        // T1/T5: web-1 is in zone-a (node-1), web-2 in zone-b (node-2),
        // loc-2 in zone-b only.
        &svc("near", "ClusterIP")
            .selector("web")
            .port(Port::tcp("tcp", 80))
            .traffic_distribution("PreferClose"),
        &svc("near-loc", "ClusterIP")
            .selector("loc")
            .port(Port::tcp("tcp", 80))
            .traffic_distribution("PreferClose"),
        &svc("same-node", "ClusterIP")
            .selector("web")
            .port(Port::tcp("tcp", 80))
            .traffic_distribution("PreferSameNode"),
        // C2/K1, K2, C5: their endpoints are the test's own slices
        // ([`udp_slices`]).
        &svc("k1", "ClusterIP").port(Port::udp("udp", 80)),
        &svc("k2", "ClusterIP").port(Port::udp("udp", 80)),
        &svc("c5", "ClusterIP").port(Port::udp("udp", 80)),
        // Field bug C6: two ClusterIPs whose one backend is loc-2.
        &svc("dup-a", "ClusterIP")
            .selector("loc")
            .ports([Port::tcp("tcp", 80), Port::udp("udp", 80)]),
        &svc("dup-b", "ClusterIP")
            .selector("loc")
            .ports([Port::tcp("tcp", 80), Port::udp("udp", 80)]),
    ])
}

/// SC1: a second ServiceCIDR object, and `sc1` with a ClusterIP from it
/// (applied once the ServiceCIDR is ready).
fn second_service_cidr() -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\n\
         metadata: {{name: second}}\nspec: {{cidrs: [\"{SECOND_SERVICE_CIDR}\"]}}\n"
    )
}

fn sc1_service() -> String {
    manifests(&[&svc("sc1", "ClusterIP")
        .selector("web")
        .port(Port::tcp("tcp", 80))
        .cluster_ip(&SECOND_CIDR_SERVICE_IP.to_string())])
}

/// The slices of `k1`, `k2` and `c5` before the change the conntrack
/// checks make (`after` false): k1 {web-1}, k2 none, c5 {web-2 not ready};
/// and after it: k1 {web-2} (its client's backend left: C2/K1), k2
/// {web-1} (0→1: K2), c5 {web-2 ready} (C5).
fn udp_slices(lab: &Lab, after: bool) -> String {
    let slice = |svc: &str| Slice::new(&format!("{svc}-1"), svc).port("udp", 80, "UDP");
    let (web1, web2) = (Ep::of(lab, "web-1"), Ep::of(lab, "web-2"));
    let (k1, k2, c5) = if after {
        (
            slice("k1").endpoint(web2.clone()),
            slice("k2").endpoint(web1),
            slice("c5").endpoint(web2),
        )
    } else {
        (
            slice("k1").endpoint(web1),
            slice("k2"),
            slice("c5").endpoint(web2.cond(false, false, false)),
        )
    };
    manifests(&[&k1, &k2, &c5])
}

/// `term`'s slice: web-1 terminating but serving, web-2 neither ready nor
/// serving (S35/S36: the terminating one is used when none is ready).
fn term_slice(lab: &Lab) -> String {
    Slice::new("term-1", "term")
        .port("tcp", 80, "TCP")
        .endpoint(Ep::of(lab, "web-1").terminating_serving())
        .endpoint(Ep::of(lab, "web-2").cond(false, false, false))
        .yaml()
}

/// Names the addresses a backend may see: the lab's clients and nodes.
struct Names(BTreeMap<Ipv4Addr, String>);

impl Names {
    fn of(lab: &Lab) -> Names {
        let mut m = BTreeMap::new();
        for n in lab.nodes() {
            m.insert(n.ip, n.name.clone());
        }
        m.insert(lab.client().ip, "client pod".to_string());
        if let Some(x) = lab.external() {
            m.insert(x.ip, "external client".to_string());
        }
        m.insert(ADDED_NODE_IP, "node-1 (added address)".to_string());
        m.insert(
            xtask::lab::GATEWAY_IP,
            "node (pods' gateway address)".to_string(),
        );
        Names(m)
    }

    fn name(&self, seen: &str) -> String {
        let ip = seen
            .parse::<SocketAddrV4>()
            .map(|a| *a.ip())
            .or_else(|_| seen.parse::<Ipv4Addr>());
        match ip {
            Ok(ip) => self.0.get(&ip).cloned().unwrap_or_else(|| ip.to_string()),
            Err(_) => format!("? {seen}"),
        }
    }
}

/// One TCP request's outcome as a client sees it: the reply, `refused`
/// (RST or ICMP unreachable at once), `no answer` (nothing within [`T`]),
/// or the error's kind.
fn outcome(r: std::io::Result<Vec<u8>>) -> String {
    match r {
        Ok(reply) => reply_text(&reply),
        Err(e) => error_class(e.kind()),
    }
}

fn error_class(kind: std::io::ErrorKind) -> String {
    use std::io::ErrorKind::*;
    match kind {
        ConnectionRefused => "refused".to_string(),
        TimedOut | WouldBlock => "no answer".to_string(),
        HostUnreachable | NetworkUnreachable => "unreachable".to_string(),
        k => format!("{k:?}"),
    }
}

/// What `n` new connections got, as a set: `{web-1, web-2}`, `{refused}`.
fn set_of(outcomes: impl IntoIterator<Item = String>) -> String {
    let s: BTreeSet<String> = outcomes.into_iter().collect();
    format!("{{{}}}", s.into_iter().collect::<Vec<_>>().join(", "))
}

fn tcp(ns: &str, addr: SocketAddrV4, req: &str, n: usize) -> String {
    set_of((0..n).map(|_| outcome(client::tcp_request(ns, addr, req.as_bytes(), T))))
}

/// Whether `n` new connections were answered (by any backend), as a set:
/// `{answered}`, `{refused}`, `{answered, no answer}`.
fn reach(ns: &str, addr: SocketAddrV4, n: usize) -> String {
    set_of(
        (0..n).map(|_| match client::tcp_request(ns, addr, b"hostname\n", T) {
            Ok(_) => "answered".to_string(),
            Err(e) => error_class(e.kind()),
        }),
    )
}

fn udp(ns: &str, addr: SocketAddrV4, n: usize) -> String {
    set_of((0..n).map(|_| outcome(client::udp_request(ns, addr, b"hostname", T, None))))
}

/// The sources backends saw over `n` connections, named.
fn sources(ns: &str, addr: SocketAddrV4, n: usize, names: &Names) -> String {
    set_of(
        (0..n).map(|_| match client::tcp_request(ns, addr, b"clientip\n", T) {
            Ok(r) => names.name(&reply_text(&r)),
            Err(e) => error_class(e.kind()),
        }),
    )
}

/// What a UDP client sending from one fixed source `port` hears once it
/// stops changing: a datagram every 200 ms until three answers in a row
/// agree (at most eight); the last answer. A proxy that moves the flow
/// within about a second of its sync settles on the new backend.
fn udp_settled(ns: &str, addr: SocketAddrV4, port: u16) -> String {
    settled(|| {
        outcome(client::udp_request(
            ns,
            addr,
            b"hostname",
            T_UDP,
            Some(port),
        ))
    })
}

fn settled(mut ask: impl FnMut() -> String) -> String {
    let mut seen: Vec<String> = Vec::new();
    for i in 0..8 {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(200));
        }
        seen.push(ask());
        if let [.., a, b, c] = seen.as_slice() {
            if a == b && b == c {
                break;
            }
        }
    }
    seen.pop().expect("at least one answer")
}

/// Two TCP connections from `src` (one address and port, field bug C6),
/// to `a` and to `b`, both established before either asks; what each got.
fn tcp_pair_from(ns: &str, src: SocketAddrV4, a: SocketAddrV4, b: SocketAddrV4) -> String {
    xtask::netns::in_netns(ns, move || {
        let ask = |s: std::io::Result<TcpStream>| -> String {
            let mut s = match s {
                Ok(s) => s,
                Err(e) => return error_class(e.kind()),
            };
            let exchange = |s: &mut TcpStream| -> std::io::Result<Vec<u8>> {
                s.set_read_timeout(Some(T))?;
                s.write_all(b"hostname\n")?;
                s.shutdown(std::net::Shutdown::Write)?;
                let mut reply = Vec::new();
                s.read_to_end(&mut reply)?;
                Ok(reply)
            };
            outcome(exchange(&mut s))
        };
        let sa = connect_from(src, a, T);
        let sb = connect_from(src, b, T);
        let (ra, rb) = (ask(sa), ask(sb));
        format!("first {ra}, second {rb}")
    })
    .expect("enter the client's namespace")
}

fn host_outcome(r: HostReply) -> String {
    match r {
        HostReply::Ok { text, .. } => text,
        HostReply::Err { kind, .. } => match kind.as_str() {
            "timeout" => "no answer".to_string(),
            k => k.to_string(),
        },
    }
}

fn cluster_ip(lab: &Lab, service: &str) -> Ipv4Addr {
    lab.service_ip(service)
        .unwrap_or_else(|| panic!("no ClusterIP of {service}"))
}

fn node_port(lab: &Lab, service: &str, proto: &str) -> u16 {
    let ip = lab.nodes()[0].ip;
    lab.info()
        .frontends_of(service)
        .into_iter()
        .find(|f| f.kind == "NodePort" && f.ip == ip && f.protocol.eq_ignore_ascii_case(proto))
        .unwrap_or_else(|| panic!("no {proto} NodePort of {service}"))
        .port
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Everything the clients observe, by key; the `phase`-th proxy observed.
fn observe(lab: &mut Lab, phase: u16) -> BTreeMap<&'static str, String> {
    let names = Names::of(lab);
    let client = lab.client().netns.clone();
    let ext = lab.external().expect("external client").netns.clone();
    let n1 = lab.nodes()[0].clone();
    let n2 = lab.nodes()[1].clone();
    let web = cluster_ip(lab, "web");
    let web_np = node_port(lab, "web", "TCP");
    let loc_np = node_port(lab, "loc", "TCP");
    let mut o = BTreeMap::new();
    let at = |ip: Ipv4Addr, port: u16| SocketAddrV4::new(ip, port);

    // Pod to Service.
    o.insert(
        "pod → ClusterIP TCP: backends",
        tcp(&client, at(web, 80), "hostname\n", N),
    );
    o.insert(
        "pod → ClusterIP UDP: backends",
        udp(&client, at(web, 80), N),
    );
    o.insert(
        "pod → ClusterIP: source seen",
        sources(&client, at(web, 80), N, &names),
    );
    o.insert(
        "pod → ClusterIP without endpoints",
        reach(&client, at(cluster_ip(lab, "empty"), 80), 2),
    );
    o.insert(
        "pod → undeclared port of a ClusterIP",
        reach(&client, at(web, 81), 2),
    );
    o.insert(
        "pod → unallocated ServiceCIDR address",
        reach(&client, at(UNALLOCATED_SERVICE_IP, 80), 2),
    );
    o.insert(
        "pod → ClusterIP UDP without endpoints",
        udp(&client, at(cluster_ip(lab, "empty"), 80), 2),
    );
    o.insert(
        "external → NodePort without endpoints",
        reach(&ext, at(n1.ip, node_port(lab, "empty", "TCP")), 2),
    );

    // SC1: a ClusterIP of a second ServiceCIDR object.
    o.insert(
        "pod → ClusterIP of a second ServiceCIDR: backends",
        tcp(&client, at(SECOND_CIDR_SERVICE_IP, 80), "hostname\n", N),
    );
    o.insert(
        "pod → unallocated address of a second ServiceCIDR",
        reach(&client, at(SECOND_CIDR_UNALLOCATED_IP, 80), 1),
    );

    // T1/T5: trafficDistribution, from a client in each zone (one node
    // per zone: the same node is the same zone).
    let client2 = lab
        .client_named(CLIENT_2)
        .expect("the client on node-2")
        .netns
        .clone();
    let near = at(cluster_ip(lab, "near"), 80);
    let same_node = at(cluster_ip(lab, "same-node"), 80);
    o.insert(
        "pod in zone-a → PreferClose ClusterIP",
        tcp(&client, near, "hostname\n", N),
    );
    o.insert(
        "pod in zone-b → PreferClose ClusterIP",
        tcp(&client2, near, "hostname\n", N),
    );
    o.insert(
        "pod in zone-a → PreferClose ClusterIP, endpoints in zone-b only",
        tcp(
            &client,
            at(cluster_ip(lab, "near-loc"), 80),
            "hostname\n",
            N,
        ),
    );
    o.insert(
        "pod on node-1 → PreferSameNode ClusterIP",
        tcp(&client, same_node, "hostname\n", N),
    );
    o.insert(
        "pod on node-2 → PreferSameNode ClusterIP",
        tcp(&client2, same_node, "hostname\n", N),
    );

    // Which of the two backends is chance; how many answer is not.
    let aff = at(cluster_ip(lab, "aff"), 80);
    let answered: BTreeSet<String> = (0..N)
        .map(|_| outcome(client::tcp_request(&client, aff, b"hostname\n", T)))
        .collect();
    o.insert(
        "pod → ClientIP affinity: distinct answers of 12",
        format!(
            "{} ({})",
            answered.len(),
            if answered.iter().all(|a| a.starts_with("aff-")) {
                "backends"
            } else {
                "errors"
            }
        ),
    );
    o.insert(
        "pod → NodePort on its own node",
        tcp(&client, at(n1.ip, web_np), "hostname\n", N),
    );

    o.insert(
        "pod → ClusterIP, internalTrafficPolicy Local, no endpoint on its node",
        reach(&client, at(cluster_ip(lab, "itp"), 80), 2),
    );
    o.insert(
        "pod → ClusterIP whose only serving endpoint is terminating",
        tcp(&client, at(cluster_ip(lab, "term"), 80), "hostname\n", N),
    );
    o.insert(
        "pod → LB IP inside loadBalancerSourceRanges",
        reach(&client, at(LB_IP, 80), 2),
    );
    o.insert(
        "external → LB IP outside loadBalancerSourceRanges",
        reach(&ext, at(LB_IP, 80), 2),
    );

    // From outside the cluster.
    o.insert(
        "external → NodePort node-1: backends",
        tcp(&ext, at(n1.ip, web_np), "hostname\n", N),
    );
    o.insert(
        "external → NodePort node-1 (Cluster): source seen",
        sources(&ext, at(n1.ip, web_np), N, &names),
    );
    o.insert(
        "external → NodePort node-2 (Cluster): source seen",
        sources(&ext, at(n2.ip, web_np), N, &names),
    );
    o.insert(
        "external → NodePort node-2 (Local, endpoint here): source seen",
        sources(&ext, at(n2.ip, loc_np), 4, &names),
    );
    o.insert(
        "external → NodePort node-1 (Local, no endpoint here)",
        reach(&ext, at(n1.ip, loc_np), 2),
    );
    o.insert(
        "external → externalIP: backends",
        tcp(&ext, at(EXTERNAL_IP, 80), "hostname\n", N),
    );
    // An address added to node-1 after the proxy started.
    ip(&[
        "-n",
        &n1.netns,
        "addr",
        "add",
        &format!("{ADDED_NODE_IP}/24"),
        "dev",
        &n1.eth,
    ]);
    std::thread::sleep(Duration::from_millis(500));
    o.insert(
        "external → NodePort on an address added later",
        reach(&ext, at(ADDED_NODE_IP, web_np), 2),
    );
    ip(&[
        "-n",
        &n1.netns,
        "addr",
        "del",
        &format!("{ADDED_NODE_IP}/24"),
        "dev",
        &n1.eth,
    ]);

    // Host clients of node-1.
    let mut host = lab.host_client("node-1").expect("host client");
    let mut host_set = |addr: SocketAddrV4, n: usize, names: bool| {
        set_of((0..n).map(|_| {
            match host
                .tcp(SocketAddr::V4(addr), "hostname")
                .expect("host client")
            {
                HostReply::Ok { .. } if !names => "answered".to_string(),
                r => host_outcome(r),
            }
        }))
    };
    o.insert("host → ClusterIP: backends", host_set(at(web, 80), N, true));
    o.insert(
        "host → NodePort on 127.0.0.1",
        host_set(at(Ipv4Addr::LOCALHOST, web_np), 2, false),
    );
    o.insert(
        "host → NodePort on its node address",
        host_set(at(n1.ip, web_np), N, true),
    );
    o.insert(
        "host → NodePort on node-2 (Local, endpoint there)",
        host_set(at(n2.ip, loc_np), 2, false),
    );
    o.insert(
        "host → ClusterIP without endpoints",
        host_set(at(cluster_ip(lab, "empty"), 80), 2, false),
    );
    o.insert(
        "host → ClusterIP of a second ServiceCIDR: backends",
        host_set(at(SECOND_CIDR_SERVICE_IP, 80), N, true),
    );
    observe_udp_flows(lab, phase, &mut o);
    o
}

/// Conntrack hygiene, UDP clients on one source port each (C2/K1, C4, K2,
/// C5, field bug C6): what they hear before and after the slices of `k1`,
/// `k2` and `c5` change ([`udp_slices`]). Leaves the slices as they were.
fn observe_udp_flows(lab: &mut Lab, phase: u16, o: &mut BTreeMap<&'static str, String>) {
    let client = lab.client().netns.clone();
    let at = |ip: Ipv4Addr| SocketAddrV4::new(ip, 80);
    let port = |k: u16| UDP_PORT_BASE + 10 * phase + k;
    let (k1, k2, c5) = (
        at(cluster_ip(lab, "k1")),
        at(cluster_ip(lab, "k2")),
        at(cluster_ip(lab, "c5")),
    );
    let udp1 = |addr, p| {
        outcome(client::udp_request(
            &client,
            addr,
            b"hostname",
            T_UDP,
            Some(p),
        ))
    };

    // C6: TCP connections from one source port to two ClusterIPs with one
    // backend, both open before either asks; then UDP, the same source
    // port to both and back to the first.
    let (a, b) = (at(cluster_ip(lab, "dup-a")), at(cluster_ip(lab, "dup-b")));
    o.insert(
        "pod → two ClusterIPs sharing a backend, one TCP source port",
        tcp_pair_from(&client, SocketAddrV4::new(lab.client().ip, port(4)), a, b),
    );
    o.insert(
        "pod → two ClusterIPs sharing a backend, one UDP source port",
        format!(
            "first {}, second {}, first again {}",
            udp1(a, port(3)),
            udp1(b, port(3)),
            udp1(a, port(3))
        ),
    );

    o.insert(
        "pod → UDP flow, before its backend leaves",
        udp1(k1, port(0)),
    );
    o.insert(
        "pod → UDP flow to a Service without endpoints",
        udp1(k2, port(1)),
    );
    o.insert(
        "pod → UDP flow to a Service whose endpoint is not ready",
        udp1(c5, port(2)),
    );
    let mut host = lab.host_client("node-1").expect("host client");
    // Its socket is connected now, to k1's one backend, web-1.
    let opened = host.udp_connect("k1", k1).expect("host client");
    assert!(
        matches!(opened, HostReply::Ok { .. }),
        "connect a UDP socket to k1: {opened:?}"
    );
    let hear = |host: &mut xtask::lab::HostClient| {
        host_outcome(host.udp_send("k1", "hostname").expect("host client"))
    };
    o.insert(
        "host → connected UDP socket, before its backend leaves",
        hear(&mut host),
    );

    lab.apply(&udp_slices(lab, true)).expect("the slices after");
    lab.write_sync_barrier().expect("barrier");
    lab.wait_synced(lab.sync_timeout()).expect("synced");
    o.insert(
        "pod → UDP flow, after its backend left (C2/K1)",
        udp_settled(&client, k1, port(0)),
    );
    o.insert(
        "pod → UDP flow, after endpoints went 0→1 (K2)",
        udp_settled(&client, k2, port(1)),
    );
    o.insert(
        "pod → UDP flow, after its endpoint became ready (C5)",
        udp_settled(&client, c5, port(2)),
    );
    o.insert(
        "host → connected UDP socket, after its backend left (C4)",
        settled(|| hear(&mut host)),
    );
    drop(host);
    // The next proxy starts from the slices before (its start's barrier
    // waits for them).
    lab.apply(&udp_slices(lab, false))
        .expect("the slices before");
}

fn start(lab: &mut Lab, p: Proxy) {
    let nodes: Vec<String> = lab.nodes().iter().map(|n| n.name.clone()).collect();
    match p {
        Proxy::KubeProxy(mode) => {
            let opts = KubeProxyOptions {
                min_sync_period: Some(Duration::from_millis(100)),
            };
            for n in &nodes {
                lab.start_kube_proxy_on(n, mode, &opts)
                    .unwrap_or_else(|e| panic!("start {mode} on {n}: {e:#}"));
            }
        }
        Proxy::Agent => {
            lab.start_agent().expect("start agent");
            lab.wait_ready(lab.sync_timeout()).expect("agents ready");
            attached(lab);
        }
    }
    // Everything the lab wrote is programmed.
    lab.write_sync_barrier().expect("barrier");
    lab.wait_synced(lab.sync_timeout()).expect("synced");
}

fn stop(lab: &mut Lab, p: Proxy) {
    let nodes: Vec<String> = lab.nodes().iter().map(|n| n.name.clone()).collect();
    if let Proxy::KubeProxy(mode) = p {
        for n in &nodes {
            lab.stop_kube_proxy_on(n)
                .unwrap_or_else(|e| panic!("stop {mode} on {n}: {e:#}"));
        }
    }
}

/// The machine's own namespace's rules, to check nothing leaked there.
fn root_rules() -> String {
    let mut s = String::new();
    for (cmd, args) in [
        ("iptables-save", &[][..]),
        ("ip6tables-save", &[][..]),
        ("nft", &["list", "tables"][..]),
    ] {
        if let Ok(out) = Command::new(cmd).args(args).output() {
            s.push_str(
                &String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .filter(|l| !l.starts_with('#'))
                    // Packet counters move on their own.
                    .map(|l| l.split(" [").next().unwrap_or(l).to_string())
                    .collect::<Vec<_>>()
                    .join("\n"),
            );
        }
    }
    s
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn kube_proxy_oracle_observations_match_the_agent_or_are_listed() {
    let before = root_rules();
    let mut proxies: Vec<Proxy> = KubeProxyMode::available()
        .into_iter()
        .map(Proxy::KubeProxy)
        .collect();
    proxies.push(Proxy::Agent);
    let mut seen: BTreeMap<Proxy, BTreeMap<&'static str, String>> = BTreeMap::new();
    LabTest::new("oracle")
        .yaml(&objects())
        .nodes(2)
        .zones(&ZONES)
        .external(true)
        .proxies_started_by_the_test()
        .sync_timeout(SYNC_TIMEOUT)
        .banner(" with 2 nodes, a real control plane, no proxy yet")
        .run(|lab| {
            // The conntrack observations' fixed source ports (from
            // UDP_PORT_BASE) lie in the kernel's default ephemeral range:
            // an earlier probe's connection left in TIME_WAIT on one of
            // them made their bind fail (EADDRINUSE) now and then. The
            // client's own ephemeral ports start above them.
            xtask::netns::sysctl_in(
                &lab.client().netns,
                "net.ipv4.ip_local_port_range",
                EPHEMERAL_PORTS,
            )
            .expect("the client's ephemeral port range");
            lab.apply(&term_slice(lab)).expect("term's slice");
            lab.apply(&udp_slices(lab, false))
                .expect("the UDP Services' slices");
            lab.add_client_on(CLIENT_2, "node-2")
                .expect("a client on node-2");
            // SC1: the ServiceCIDR, once ready, then a Service from it; each
            // node routes it as it routes the first ServiceCIDR
            // ([`Lab::route_service_cidr`]), via the control plane.
            lab.kubectl(&["apply", "-f", "-"], Some(&second_service_cidr()))
                .expect("the second ServiceCIDR");
            lab.kubectl(
                &[
                    "wait",
                    "--for=condition=Ready",
                    "servicecidr/second",
                    "--timeout=30s",
                ],
                None,
            )
            .expect("the second ServiceCIDR ready");
            lab.apply(&sc1_service()).expect("sc1");
            let via = xtask::lab::control_plane::CONTROL_PLANE_IP.to_string();
            for n in lab.nodes().to_vec() {
                ip(&[
                    "-n",
                    &n.netns,
                    "route",
                    "replace",
                    SECOND_SERVICE_CIDR,
                    "via",
                    &via,
                    "dev",
                    &n.eth,
                ]);
            }
            // The LB IP and the externalIP are owned by no interface: the
            // router sends them to node-1.
            for ip in [LB_IP, EXTERNAL_IP] {
                lab.route_from_external(ip, "node-1")
                    .unwrap_or_else(|e| panic!("route {ip} via node-1: {e:#}"));
            }
            for (phase, p) in (0u16..).zip(&proxies) {
                let t = Instant::now();
                start(lab, *p);
                let o = observe(lab, phase);
                println!("[oracle] {p}: observed in {} ms", t.elapsed().as_millis());
                stop(lab, *p);
                seen.insert(*p, o);
            }
        });
    assert_eq!(
        before,
        root_rules(),
        "the machine's own namespace's rules changed while kube-proxy ran in the lab"
    );
    assert_same_or_kept(&seen);
}

/// The dual-stack lab's Services (family D): `ds`, a NodePort with
/// `ipFamilyPolicy: RequireDualStack` over ds-1 (node-1) and ds-2
/// (node-2); `v6`, an IPv6-only ClusterIP over the same pods; `empty6`, an
/// IPv6-only ClusterIP without endpoints.
fn dual_stack_objects() -> String {
    manifests(&[
        &Pod::new("ds-1", "ds").node("node-1").port(80, "TCP"),
        &Pod::new("ds-2", "ds").node("node-2").port(80, "TCP"),
        &svc("ds", "NodePort")
            .selector("ds")
            .require_dual_stack()
            .ports([Port::tcp("tcp", 80), Port::udp("udp", 80)]),
        &svc("v6", "ClusterIP")
            .selector("ds")
            .ipv6_only()
            .ports([Port::tcp("tcp", 80), Port::udp("udp", 80)]),
        &svc("empty6", "ClusterIP")
            .selector("nothing")
            .ipv6_only()
            .ports([Port::tcp("tcp", 80), Port::udp("udp", 80)]),
    ])
}

/// Names the addresses of both families a backend of the dual-stack lab
/// may see.
fn names6(lab: &Lab) -> BTreeMap<IpAddr, String> {
    let mut m = BTreeMap::new();
    for n in lab.nodes() {
        m.insert(IpAddr::V4(n.ip), n.name.clone());
        if let Some(ip6) = n.ip6 {
            m.insert(IpAddr::V6(ip6), format!("{} (IPv6)", n.name));
        }
    }
    let c = lab.client();
    m.insert(IpAddr::V4(c.ip), "client pod".to_string());
    if let Some(ip6) = c.ip6 {
        m.insert(IpAddr::V6(ip6), "client pod (IPv6)".to_string());
    }
    if let Some(x) = lab.external() {
        m.insert(IpAddr::V4(x.ip), "external client".to_string());
        if let Some(ip6) = x.ip6 {
            m.insert(IpAddr::V6(ip6), "external client (IPv6)".to_string());
        }
    }
    m.insert(
        IpAddr::V6(xtask::lab::GATEWAY_IP6),
        "node (pods' IPv6 gateway address)".to_string(),
    );
    m
}

fn name6(names: &BTreeMap<IpAddr, String>, seen: &str) -> String {
    let ip = seen
        .parse::<SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| seen.parse::<IpAddr>());
    match ip {
        Ok(ip) => names.get(&ip).cloned().unwrap_or_else(|| ip.to_string()),
        Err(_) => format!("? {seen}"),
    }
}

/// Connections per check of which backends answer, in the dual-stack lab:
/// that one of two backends gets them all is 2 × 2⁻¹⁶, about 3e-5 a check.
const N6: usize = 16;

/// What the clients of the dual-stack lab observe (D1, D2, D4, D6, the IPv6
/// NodePort and an IPv6 Service without endpoints), by key.
fn observe_dual_stack(lab: &mut Lab) -> BTreeMap<&'static str, String> {
    let names = names6(lab);
    let client = lab.client().netns.clone();
    let ext = lab.external().expect("external client").netns.clone();
    let (n1, n2) = (lab.nodes()[0].clone(), lab.nodes()[1].clone());
    let n1_6 = IpAddr::V6(n1.ip6.expect("node-1's IPv6 address"));
    let n2_6 = IpAddr::V6(n2.ip6.expect("node-2's IPv6 address"));
    let ds4 = IpAddr::V4(cluster_ip(lab, "ds"));
    let ip6_of = |s: &str| {
        IpAddr::V6(
            lab.service_ip6(s)
                .unwrap_or_else(|| panic!("no IPv6 ClusterIP of {s}")),
        )
    };
    let (ds6, v6, empty6) = (ip6_of("ds"), ip6_of("v6"), ip6_of("empty6"));
    let np = node_port(lab, "ds", "TCP");
    let at = |ip: IpAddr, port: u16| SocketAddr::new(ip, port);
    let tcp_set = |ns: &str, a: SocketAddr, n: usize| {
        set_of((0..n).map(|_| outcome(client::tcp_request(ns, a, b"hostname\n", T))))
    };
    let udp_set = |ns: &str, a: SocketAddr, n: usize| {
        set_of((0..n).map(|_| outcome(client::udp_request(ns, a, b"hostname", T, None))))
    };
    let src_set = |ns: &str, a: SocketAddr, n: usize| {
        set_of(
            (0..n).map(|_| match client::tcp_request(ns, a, b"clientip\n", T) {
                Ok(r) => name6(&names, &reply_text(&r)),
                Err(e) => error_class(e.kind()),
            }),
        )
    };
    let mut o = BTreeMap::new();

    // D1/D2: a pod to both ClusterIPs of a RequireDualStack Service.
    o.insert(
        "pod → dual-stack ClusterIP, IPv4, TCP: backends",
        tcp_set(&client, at(ds4, 80), N6),
    );
    o.insert(
        "pod → dual-stack ClusterIP, IPv6, TCP: backends",
        tcp_set(&client, at(ds6, 80), N6),
    );
    o.insert(
        "pod → dual-stack ClusterIP, IPv6, UDP: backends",
        udp_set(&client, at(ds6, 80), N6),
    );
    o.insert(
        "pod → dual-stack ClusterIP, IPv4: source seen",
        src_set(&client, at(ds4, 80), 4),
    );
    o.insert(
        "pod → dual-stack ClusterIP, IPv6: source seen",
        src_set(&client, at(ds6, 80), N6),
    );
    // D6: an endpoint pod to its own Service's IPv6 ClusterIP (it may
    // hairpin to itself).
    let ds1 = lab.pod("ds-1").expect("pod ds-1").netns.clone();
    o.insert(
        "endpoint pod → dual-stack ClusterIP, IPv6, TCP: backends",
        tcp_set(&ds1, at(ds6, 80), N6),
    );
    o.insert(
        "endpoint pod → dual-stack ClusterIP, IPv6, UDP: backends",
        udp_set(&ds1, at(ds6, 80), N6),
    );
    // An IPv6-only Service.
    o.insert(
        "pod → IPv6-only ClusterIP, TCP: backends",
        tcp_set(&client, at(v6, 80), N6),
    );
    o.insert(
        "pod → IPv6-only ClusterIP, UDP: backends",
        udp_set(&client, at(v6, 80), N6),
    );
    // D1: the secondary nodeIP:nodePort, from a pod.
    o.insert(
        "pod → NodePort on node-2's IPv6 address: backends",
        tcp_set(&client, at(n2_6, np), N6),
    );
    // NodePort over IPv6 from outside the cluster.
    o.insert(
        "external → NodePort on node-1's IPv6 address: backends",
        tcp_set(&ext, at(n1_6, np), N6),
    );
    o.insert(
        "external → NodePort on node-2's IPv6 address (Cluster): source seen",
        src_set(&ext, at(n2_6, np), N6),
    );
    // An IPv6 Service without endpoints.
    o.insert(
        "pod → IPv6 ClusterIP without endpoints, TCP",
        reach_any(&client, at(empty6, 80)),
    );
    o.insert(
        "pod → IPv6 ClusterIP without endpoints, UDP",
        udp_set(&client, at(empty6, 80), 2),
    );

    // D4: a host client of node-1 to the IPv6 ClusterIP and NodePort.
    let mut host = lab.host_client("node-1").expect("host client");
    let mut host_set = |addr: SocketAddr, n: usize| {
        set_of((0..n).map(|_| host_outcome(host.tcp(addr, "hostname").expect("host client"))))
    };
    o.insert(
        "host → dual-stack ClusterIP, IPv6: backends",
        host_set(at(ds6, 80), N6),
    );
    o.insert(
        "host → NodePort on its IPv6 address: backends",
        host_set(at(n1_6, np), N6),
    );
    o.insert(
        "host → IPv6 ClusterIP without endpoints",
        host_set(at(empty6, 80), 2),
    );
    o
}

/// Whether two new TCP connections to `addr` from `ns` were answered.
fn reach_any(ns: &str, addr: SocketAddr) -> String {
    set_of(
        (0..2).map(|_| match client::tcp_request(ns, addr, b"hostname\n", T) {
            Ok(_) => "answered".to_string(),
            Err(e) => error_class(e.kind()),
        }),
    )
}

/// Prints the observations of every proxy as a table and fails on a
/// difference from a kube-proxy mode that [`KEPT`] does not list, or on an
/// entry of [`KEPT`] for a key observed here that no longer differs.
fn assert_same_or_kept(seen: &BTreeMap<Proxy, BTreeMap<&'static str, String>>) {
    let agent = &seen[&Proxy::Agent];
    let mut table = String::from("| observation | ");
    for p in seen.keys() {
        table.push_str(&format!("{p} | "));
    }
    table.push('\n');
    for key in agent.keys() {
        table.push_str(&format!("| {key} | "));
        for o in seen.values() {
            table.push_str(&format!("{} | ", o.get(key).map_or("-", |s| s.as_str())));
        }
        table.push('\n');
    }
    println!("{table}");
    let mut failures = Vec::new();
    for (p, o) in seen {
        let Proxy::KubeProxy(mode) = p else { continue };
        for (key, theirs) in o {
            let ours = &agent[key];
            let kept = KEPT.iter().find(|k| k.key == *key && k.mode == *mode);
            match (ours == theirs, kept) {
                (true, None) => {}
                (false, Some(k)) => println!("kept ({mode}) {key}: {}", k.reason),
                (false, None) => failures.push(format!(
                    "{key}: {mode} {theirs}, the agent {ours} (not in KEPT)"
                )),
                (true, Some(_)) => failures.push(format!(
                    "{key}: KEPT lists a difference from {mode} that is gone: remove the entry (and its row in docs/kube-proxy-differences.md)"
                )),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "differences from kube-proxy:\n{}",
        failures.join("\n")
    );
}

/// Family D (dual-stack): a lab of its own, dual-stack, with a real
/// control plane whose ServiceCIDRs are 198.19.0.0/16 and
/// 2001:2:0:ff::/112; the same observe → compare → [`KEPT`] as
/// [`kube_proxy_oracle_observations_match_the_agent_or_are_listed`], over
/// a representative set of the D rows ([`observe_dual_stack`]).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn kube_proxy_oracle_dual_stack_observations_match_the_agent_or_are_listed() {
    let before = root_rules();
    let mut proxies: Vec<Proxy> = KubeProxyMode::available()
        .into_iter()
        .map(Proxy::KubeProxy)
        .collect();
    proxies.push(Proxy::Agent);
    let mut seen: BTreeMap<Proxy, BTreeMap<&'static str, String>> = BTreeMap::new();
    let t0 = Instant::now();
    LabTest::new("oracle-ds")
        .yaml(&dual_stack_objects())
        .nodes(2)
        .dual_stack()
        .external(true)
        .proxies_started_by_the_test()
        .sync_timeout(SYNC_TIMEOUT)
        .banner(" dual-stack, with 2 nodes, a real control plane, no proxy yet")
        .run(|lab| {
            assert!(lab.is_dual_stack());
            for p in &proxies {
                let t = Instant::now();
                start(lab, *p);
                let o = observe_dual_stack(lab);
                println!(
                    "[oracle-ds] {p}: observed in {} ms",
                    t.elapsed().as_millis()
                );
                stop(lab, *p);
                seen.insert(*p, o);
            }
        });
    println!("[oracle-ds] took {} ms", t0.elapsed().as_millis());
    assert_eq!(
        before,
        root_rules(),
        "the machine's own namespace's rules changed while kube-proxy ran in the lab"
    );
    assert_same_or_kept(&seen);
}

//! IPv6 and dual-stack lab tests: real TCP and UDP over IPv6 between the
//! namespaces of a dual-stack lab (`LabBuilder::dual_stack`: every pod and
//! client has an address of each family, from 198.18.0.0/15 and
//! 2001:2::/48; see `xtask::lab` for the address plan), through the agent's
//! tc datapath. Each test builds its own one-node lab and lets it drop at
//! the end, also on failure. The IDs name upstream's dual-stack e2e
//! behaviours (test/e2e/network/dual_stack.go) as the lab reproduces them.
//!
//! D-lab-1 checks the lab's own IPv6 plumbing (no Service): it holds with
//! any datapath that lets IPv6 pass. D-lab-2 to D-lab-4 need the agent to
//! serve IPv6 ClusterIPs. Before each ClusterIP check, the test asserts that
//! every pod answers on its own IPv6 address, so a failure there is the
//! IPv6 ClusterIP's.
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --bins && cargo test -p xtask --test lab_ipv6 -- --include-ignored`.
//!
//! On failure the agent's log tail and `proxy-agent inspect
//! services|stats|conntrack` are printed before the lab is torn down; set
//! `KPR_LAB_DIAG=1` to print them after every test.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use xtask::client::{self, reply_text};
use xtask::manifests::Object;
use xtask::Lab;

mod support;
use support::fixtures::{manifests, tcp_and_udp, Pod, Svc};
use support::{assert_answered_by, delete_pod, frontend, frontend6, run_lab, T};

/// How long the agent may take to come up, or to sync a change.
const SYNC_TIMEOUT: Duration = Duration::from_secs(15);
/// Requests per check of which pods answer (3 pods: each is missed by 30
/// random picks with probability 3 × (2/3)^30 ≈ 2e-5).
const N: usize = 30;
/// The pods' port, and the Services'.
const PORT: u16 = 80;

// ---------------------------------------------------------------- lab runner

/// Starts a dual-stack one-node lab with `yaml`, waits for the agent's
/// first sync and its attachments, runs `f`; see [`support::run_lab`].
fn with_lab(test: &str, yaml: &str, f: impl FnOnce(&mut Lab)) {
    run_lab(
        test,
        Lab::builder().dual_stack().manifests_yaml(yaml),
        " (dual-stack)",
        |lab| {
            lab.wait_ready(SYNC_TIMEOUT)
                .unwrap_or_else(|e| panic!("agent not ready: {e:#}"));
            lab.wait_attached(SYNC_TIMEOUT)
                .unwrap_or_else(|e| panic!("agent not attached: {e:#}"));
        },
        |lab| support::diagnostics(lab, None),
        f,
    )
}

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
    let ns = &lab.client().netns;
    let me = client_ip6(lab);
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
        let peer = client::tcp_request(ns, addr, b"clientip\n", T).map(|r| reply_text(&r));
        let seen = peer
            .as_ref()
            .ok()
            .and_then(|p| p.parse::<SocketAddr>().ok())
            .map(|p| p.ip());
        assert_eq!(
            seen,
            Some(me),
            "{what}: {name} at {addr} saw the client as {peer:?}"
        );
    }
    println!("{what}: {pods:?} answer TCP and UDP on their IPv6 addresses");
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
    with_lab("d-lab-1", &yaml, |lab| {
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
    with_lab("d-lab-2", &yaml, |lab| {
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
/// TCP, each by every pod.
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
    let pods = pods("dual", 3);
    let mut objects: Vec<&dyn support::fixtures::Manifest> = vec![&prefer, &require];
    objects.extend(pods.iter().map(|p| p as &dyn support::fixtures::Manifest));
    let yaml = manifests(&objects);
    with_lab("d-lab-3", &yaml, |lab| {
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
    });
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
    with_lab("d-lab-4", &yaml, |lab| {
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

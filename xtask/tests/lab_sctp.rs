//! SCTP lab tests: real kernel SCTP associations (one-to-one sockets)
//! between lab namespaces, through the agent's tc datapath. Each test builds
//! its own one-node lab and lets it drop at the end, also on failure.
//!
//! S41 needs no SCTP: it checks that programming an SCTP Service does not
//! load the kernel's sctp module, so nothing in it opens an SCTP socket (its
//! pod declares the SCTP port without a listener). N4, N10 and D3 need SCTP
//! in the kernel and never load it themselves (see `xtask::sctp`): without
//! it they print a `SKIPPED` line and pass, unless `KPR_REQUIRE_SCTP=1`,
//! which makes its absence a failure. This machine's kernel has no SCTP; the
//! VM runner's `lab-sctp` step runs S41 before it loads the module, then N4,
//! N10 and D3 with `KPR_REQUIRE_SCTP=1` (`cargo xtask test --kernel 6.12`).
//! D3 runs in a dual-stack lab (`LabBuilder::dual_stack`, see
//! `tests/lab_ipv6.rs`): SCTP over IPv6, with the port translation.
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --bins && cargo test -p xtask --test lab_sctp -- --include-ignored`.
//!
//! On failure the agent's log tail and `proxy-agent inspect
//! services|stats|conntrack` are printed before the lab is torn down; set
//! `KPR_LAB_DIAG=1` to print them after every test.

use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::process::Command;
use std::time::{Duration, Instant};

use xtask::client::{self, reply_text};
use xtask::Lab;

mod support;
use support::fixtures::{manifests, Pod, Port, Svc};
use support::{assert_answered_by, delete_pod, frontend, frontend6, LabTest, T};

/// How long the agent may take to come up, or to sync a change.
/// Associations per check of which pods answer (3 pods: each is missed by
/// 30 random picks with probability 3 × (2/3)^30 ≈ 2e-5).
const N: usize = 30;
/// The Service's SCTP port (SIP's, as upstream's tests use) and the pods'
/// port behind it: the datapath translates the port.
const SVC_PORT: u16 = 5060;
const TARGET_PORT: u16 = 5061;

// ---------------------------------------------------------------- SCTP or skip

/// Whether the kernel has SCTP for the test; else prints a `SKIPPED` line
/// (past the test harness's capture, so it shows) and returns false, or
/// panics with `KPR_REQUIRE_SCTP=1`.
fn sctp_or_skip(test: &str) -> bool {
    let Some(why) = xtask::sctp::unavailable_reason() else {
        return true;
    };
    if std::env::var("KPR_REQUIRE_SCTP").as_deref() == Ok("1") {
        panic!("[{test}] KPR_REQUIRE_SCTP=1 but {why}");
    }
    skip(test, &why);
    false
}

/// One `[<test>] SKIPPED: <why>` line on stderr, written past the harness's
/// capture of `print!`/`eprint!`.
fn skip(test: &str, why: &str) {
    let _ = writeln!(io::stderr(), "[{test}] SKIPPED: {why}");
}

fn sctp_module_loaded() -> bool {
    xtask::sctp::module_loaded().expect("read /proc/modules")
}

// ---------------------------------------------------------------- lab runner

/// An SCTP NodePort Service `name` selecting `app: <name>`: port
/// [`SVC_PORT`] to targetPort [`TARGET_PORT`].
fn sctp_service(name: &str) -> Svc {
    Svc::new(name)
        .selector(name)
        .service_type("NodePort")
        .port(Port::sctp("sctp", SVC_PORT).target_port(TARGET_PORT))
}

/// Pod `name` of app `app` serving SCTP (and TCP, UDP) on [`TARGET_PORT`].
fn sctp_pod(name: &str, app: &str) -> Pod {
    Pod::new(name, app).port(TARGET_PORT, "SCTP")
}

/// The node's address at the SCTP NodePort of `service`.
fn node_port(lab: &Lab, service: &str) -> SocketAddrV4 {
    let ip = lab.node().ip;
    lab.info()
        .frontends_of(service)
        .into_iter()
        .find(|f| f.kind == "NodePort" && f.ip == ip && f.protocol.eq_ignore_ascii_case("SCTP"))
        .map(|f| f.addr())
        .unwrap_or_else(|| panic!("no SCTP NodePort of {service} on {ip}"))
}

/// The node's IPv6 address at the SCTP NodePort of `service`.
fn node_port6(lab: &Lab, service: &str) -> SocketAddr {
    let ip: IpAddr = lab
        .node()
        .ip6
        .expect("the node of a dual-stack lab has an IPv6 address")
        .into();
    lab.info()
        .frontends_of(service)
        .into_iter()
        .find(|f| f.kind == "NodePort" && f.ip == ip && f.protocol.eq_ignore_ascii_case("SCTP"))
        .map(|f| f.socket_addr())
        .unwrap_or_else(|| panic!("no SCTP NodePort of {service} on {ip}"))
}

/// Every pod named answers SCTP on its own address at [`TARGET_PORT`]
/// (the lab's plumbing, no Service), and nothing listens on [`SVC_PORT`]
/// there: what answers the Service's port went through the port translation.
fn pods_answer_directly(ns: &str, lab: &Lab, pods: &[&str]) {
    let ips: Vec<(&str, IpAddr)> = pods
        .iter()
        .map(|name| (*name, IpAddr::from(lab.pod(name).expect("pod").ip)))
        .collect();
    pods_answer_directly_at(ns, &ips)
}

/// [`pods_answer_directly`] on the pods' IPv6 addresses.
fn pods_answer_directly6(ns: &str, lab: &Lab, pods: &[&str]) {
    let ips: Vec<(&str, IpAddr)> = pods
        .iter()
        .map(|name| {
            let p = lab.pod(name).expect("pod");
            let ip6 = p
                .ip6
                .unwrap_or_else(|| panic!("pod {name} has no IPv6 address"));
            (*name, IpAddr::from(ip6))
        })
        .collect();
    pods_answer_directly_at(ns, &ips)
}

/// [`pods_answer_directly`] for pods at the addresses given.
fn pods_answer_directly_at(ns: &str, pods: &[(&str, IpAddr)]) {
    for (name, ip) in pods {
        let addr = SocketAddr::new(*ip, TARGET_PORT);
        let got = client::sctp_request(ns, addr, b"hostname\n", T).map(|r| reply_text(&r));
        assert_eq!(
            got.as_deref().ok(),
            Some(*name),
            "SCTP straight to {name} at {addr}: {got:?}"
        );
        let svc_port = SocketAddr::new(*ip, SVC_PORT);
        match client::sctp_request(ns, svc_port, b"hostname\n", T) {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
            other => {
                panic!("SCTP straight to {name} at {svc_port}: expected refused, got {other:?}")
            }
        }
    }
}

// ---------------------------------------------------------------- S41

/// The SCTP frontend `vip` in `proxy-agent inspect services`: its backends,
/// or `None` if the agent did not program it. (inspect names the protocol
/// `SCTP`, or its number 132.)
fn sctp_frontend_backends(lab: &Lab, vip: SocketAddrV4) -> Option<Vec<String>> {
    let out = Command::new(support::agent_bin())
        .args(["inspect", "services", "--output", "json", "--bpffs"])
        .arg(&lab.info().bpffs)
        .output()
        .expect("run proxy-agent inspect");
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "proxy-agent inspect services --output json: {e}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let names = [format!("{vip}/SCTP"), format!("{vip}/132")];
    rows.iter()
        .find(|r| {
            r["frontend"]
                .as_str()
                .is_some_and(|f| names.iter().any(|n| n == f))
        })
        .map(|r| {
            r["backends"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|b| b.as_str().map(str::to_string))
                .collect()
        })
}

/// Waits (up to the lab's [`Lab::sync_timeout`]) until `check` holds for
/// the SCTP frontend `vip`'s backends (`None`: not programmed); panics with
/// the agent's SCTP log lines otherwise.
fn wait_frontend(
    lab: &Lab,
    vip: SocketAddrV4,
    what: &str,
    check: impl Fn(&Option<Vec<String>>) -> bool,
) {
    let deadline = Instant::now() + lab.sync_timeout();
    loop {
        let got = sctp_frontend_backends(lab, vip);
        if check(&got) {
            println!("S41 {what}: frontend {vip}/SCTP backends {got:?}");
            return;
        }
        if Instant::now() >= deadline {
            let log = lab.agent_log();
            let sctp_lines: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("SCTP") || l.contains("sctp"))
                .take(10)
                .collect();
            panic!(
                "S41 {what}: SCTP frontend {vip} in `proxy-agent inspect services`: {got:?}; \
                 the agent's log lines naming SCTP: {sctp_lines:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// S41 — should allow creating a basic SCTP service with pod and endpoints:
/// an SCTP Service on 5060 and a pod declaring 5060/SCTP (a pause pod
/// upstream: here the lab's server, without an SCTP listener). The agent
/// programs the SCTP frontend with the pod as its backend; the pod deleted,
/// the backend goes; the Service deleted, the frontend goes. Throughout,
/// **the sctp kernel module does not become loaded**: `/proc/modules` has
/// no `sctp` before the lab and after every step. Needs no SCTP in the
/// kernel and opens no SCTP socket; skipped when sctp is loaded already
/// (the check cannot tell then).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s41_sctp_service_does_not_load_the_sctp_module() {
    if sctp_module_loaded() {
        skip(
            "s41",
            "the sctp module is loaded already: whether the proxy would load it cannot be told",
        );
        return;
    }
    println!("S41: sctp not in /proc/modules before the lab");
    let yaml = manifests(&[
        &Svc::new("sctp")
            .selector("sctp")
            .port(Port::sctp("sctp", SVC_PORT)),
        &Pod::new("sctp-1", "sctp")
            .port(SVC_PORT, "SCTP")
            .without_sctp_listener(),
    ]);
    LabTest::new("s41").yaml(&yaml).run(|lab| {
        let unloaded = |when: &str| {
            assert!(
                !sctp_module_loaded(),
                "S41: the sctp module became loaded {when}"
            );
        };
        let vip = frontend(lab, "sctp", SVC_PORT, "SCTP");
        let backend = format!("{}:{SVC_PORT}", lab.pod("sctp-1").expect("pod").ip);
        wait_frontend(lab, vip, "with its pod", |b| {
            b.as_deref() == Some(std::slice::from_ref(&backend))
        });
        unloaded("once the agent programmed the SCTP Service");

        delete_pod(lab, "sctp-1");
        wait_frontend(lab, vip, "pod deleted", |b| {
            b.as_ref().is_some_and(|b| b.is_empty())
        });
        unloaded("once the agent removed the endpoint");

        lab.delete_service("sctp")
            .unwrap_or_else(|e| panic!("delete_service: {e:#}"));
        support::synced(lab);
        wait_frontend(lab, vip, "Service deleted", Option::is_none);
        unloaded("once the agent removed the SCTP Service");
    });
    assert!(
        !sctp_module_loaded(),
        "S41: the sctp module became loaded by the lab's teardown"
    );
    println!("S41: sctp not in /proc/modules after the lab");
}

// ---------------------------------------------------------------- N4, N10

/// N4 — Granular Checks: Services should function for pod-Service: sctp.
/// An SCTP NodePort Service, port 5060 to targetPort 5061, three pods: from
/// the client pod, new associations to clusterIP:5060 and to
/// nodeIP:nodePort reach every pod; one pod deleted, they reach the other
/// two only.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn n4_pod_to_service_sctp() {
    if !sctp_or_skip("n4") {
        return;
    }
    let yaml = manifests(&[
        &sctp_service("sctp"),
        &sctp_pod("sctp-1", "sctp"),
        &sctp_pod("sctp-2", "sctp"),
        &sctp_pod("sctp-3", "sctp"),
    ]);
    LabTest::new("n4").yaml(&yaml).run(|lab| {
        let c = lab.client().netns.clone();
        let all = ["sctp-1", "sctp-2", "sctp-3"];
        pods_answer_directly(&c, lab, &all);
        let vip = frontend(lab, "sctp", SVC_PORT, "SCTP");
        let np = node_port(lab, "sctp");
        assert_answered_by(&c, vip, "SCTP", N, &all, "N4 pod → ClusterIP");
        assert_answered_by(&c, np, "SCTP", N, &all, "N4 pod → nodeIP:nodePort");

        delete_pod(lab, "sctp-3");
        let rest = ["sctp-1", "sctp-2"];
        assert_answered_by(&c, vip, "SCTP", N, &rest, "N4 sctp-3 deleted → ClusterIP");
        assert_answered_by(
            &c,
            np,
            "SCTP",
            N,
            &rest,
            "N4 sctp-3 deleted → nodeIP:nodePort",
        );
    });
}

/// N10 — Granular Checks: Services should function for endpoint-Service:
/// sctp. From an endpoint pod of the Service itself, new associations to
/// clusterIP:5060 and nodeIP:nodePort reach every pod, itself included
/// (hairpin).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn n10_endpoint_to_service_sctp() {
    if !sctp_or_skip("n10") {
        return;
    }
    let yaml = manifests(&[
        &sctp_service("ep"),
        &sctp_pod("ep-1", "ep"),
        &sctp_pod("ep-2", "ep"),
    ]);
    LabTest::new("n10").yaml(&yaml).run(|lab| {
        let from = lab.pod("ep-1").expect("pod ep-1").netns.clone();
        let all = ["ep-1", "ep-2"];
        let vip = frontend(lab, "ep", SVC_PORT, "SCTP");
        let np = node_port(lab, "ep");
        assert_answered_by(&from, vip, "SCTP", N, &all, "N10 ep-1 → ClusterIP");
        assert_answered_by(&from, np, "SCTP", N, &all, "N10 ep-1 → nodeIP:nodePort");
    });
}

/// D3 — Granular Checks: Services Secondary IP Family should function for
/// pod-Service: sctp. A dual-stack SCTP NodePort Service (`ipFamilies:
/// [IPv4, IPv6]`: its IPv6 ClusterIP is the secondary), port 5060 to
/// targetPort 5061, over three pods. From the client pod, each pod answers
/// SCTP on its own IPv6 address at 5061 and refuses 5060; new associations
/// to [secondary ClusterIP]:5060 and to [node IPv6]:nodePort reach every pod
/// (over IPv6 the datapath rewrites the ports and updates the CRC32c, as
/// over IPv4). The primary (IPv4) ClusterIP is checked as well.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn d3_pod_to_secondary_cluster_ip_and_node_port_sctp() {
    if !sctp_or_skip("d3") {
        return;
    }
    let yaml = manifests(&[
        &sctp_service("sd").dual_stack(),
        &sctp_pod("sd-1", "sd"),
        &sctp_pod("sd-2", "sd"),
        &sctp_pod("sd-3", "sd"),
    ]);
    LabTest::new("d3").dual_stack().yaml(&yaml).run(|lab| {
        let c = lab.client().netns.clone();
        let all = ["sd-1", "sd-2", "sd-3"];
        pods_answer_directly6(&c, lab, &all);
        let vip6 = frontend6(lab, "sd", SVC_PORT, "SCTP");
        let np6 = node_port6(lab, "sd");
        assert!(vip6.is_ipv6() && np6.is_ipv6(), "{vip6} {np6}");
        assert_answered_by(&c, vip6, "SCTP", N, &all, "D3 pod → secondary ClusterIP");
        assert_answered_by(&c, np6, "SCTP", N, &all, "D3 pod → [node IPv6]:nodePort");
        let vip4 = frontend(lab, "sd", SVC_PORT, "SCTP");
        assert_answered_by(&c, vip4, "SCTP", N, &all, "D3 pod → primary ClusterIP");
    });
}

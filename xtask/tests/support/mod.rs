//! Helpers shared by the lab tests (`tests/lab*.rs`): the lab runner with
//! diagnostics on failure, the waits for the agents, requests counting
//! which pod answered, and the assertions built on them. Beside it: the
//! typed builders of the objects the tests write ([`fixtures`]), long-lived
//! connections ([`Stream`], `stream.rs`) and background UDP clients
//! ([`UdpProbe`], `udp_probe.rs`). A test starts its lab with [`LabTest`].
//! Each test file includes it with `mod support;`.

// Each test file is its own crate and uses only part of this module: what one
// file leaves unused would otherwise warn as dead code in that crate.
#![allow(dead_code)]

pub mod bulk;
pub mod fixtures;
pub mod flows;
mod lab_test;
mod stream;
mod udp_probe;

// Not every test file starts its labs with it (some build theirs for
// `run_lab`), holds a stream or runs a probe.
#[allow(unused_imports)]
pub use lab_test::LabTest;
#[allow(unused_imports)]
pub use stream::Stream;
#[allow(unused_imports)]
pub use udp_probe::{describe, ms_since, Shot, UdpProbe};

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, BufRead, BufReader};
use std::net::{SocketAddr, SocketAddrV4};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use xtask::client::{self, reply_text, Request};
use xtask::lab::LabBuilder;
use xtask::{Endpoint, Lab};

/// Timeout of one request.
pub const T: Duration = Duration::from_secs(2);
/// Timeout of one SCTP request: longer than SCTP's first INIT
/// retransmission (`net.sctp.rto_initial`, 3 s), so that one lost or late
/// packet of the association's setup is the protocol's to recover, as it
/// does for a real client (seen once in 30 under emulation, 5.10's VM, in
/// N4: every packet translated, none dropped, one association late).
pub const T_SCTP: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------- lab runner

pub fn agent_bin() -> PathBuf {
    std::env::var_os("KPR_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| xtask::setup::target_dir().join("debug/proxy-agent"))
}

/// `proxy-agent inspect <what> --bpffs <dir>` as text.
pub fn inspect(what: &str, bpffs: &Path) -> String {
    match Command::new(agent_bin())
        .args(["inspect", what, "--bpffs"])
        .arg(bpffs)
        .output()
    {
        Ok(o) => format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => format!("cannot run proxy-agent inspect: {e}"),
    }
}

/// `ss -ltnuH` in `node`'s namespace: the listening sockets.
pub fn listeners(lab: &Lab, node: &str) -> String {
    let ns = lab.node_named(node).expect("node").netns.clone();
    let out = Command::new("ip")
        .args(["netns", "exec", &ns, "ss", "-ltnuH"])
        .output()
        .expect("run ss");
    assert!(
        out.status.success(),
        "ss: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether a socket of `ss`'s output (see [`listeners`]) listens on `port`
/// (any address, either family).
pub fn listens_on(ss: &str, port: u16) -> bool {
    let suffix = format!(":{port}");
    ss.lines().any(|l| {
        l.split_whitespace()
            .nth(4)
            .is_some_and(|local| local.ends_with(&suffix))
    })
}

/// One counter of `proxy-agent inspect stats` on `node` (0 if not listed).
pub fn stat(lab: &Lab, node: &str, name: &str) -> u64 {
    let n = lab.node_named(node).expect("node");
    inspect("stats", &n.bpffs)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            match (w.next(), w.next()) {
                (Some(k), Some(v)) if k == name => v.parse().ok(),
                _ => None,
            }
        })
        .next()
        .unwrap_or(0)
}

/// The agent's log tail and its pinned maps, while the (one-node) lab still
/// exists. `inspect_lines`: print at most the first that many lines of each
/// `inspect` output (None: all of it).
pub fn diagnostics(lab: &Lab, inspect_lines: Option<usize>) {
    let log = lab.agent_log();
    let lines: Vec<&str> = log.lines().collect();
    eprintln!(
        "==== lab {} agent.log (last 60 of {} lines) ====\n{}",
        lab.id(),
        lines.len(),
        lines[lines.len().saturating_sub(60)..].join("\n")
    );
    for what in ["services", "stats", "conntrack"] {
        let out = Command::new(agent_bin())
            .args(["inspect", what, "--bpffs"])
            .arg(&lab.info().bpffs)
            .output();
        match (out, inspect_lines) {
            (Ok(o), None) => eprintln!(
                "==== proxy-agent inspect {what} --bpffs {} ====\n{}{}",
                lab.info().bpffs.display(),
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
            (Ok(o), Some(max)) => {
                let text = String::from_utf8_lossy(&o.stdout);
                let lines: Vec<&str> = text.lines().collect();
                eprintln!(
                    "==== proxy-agent inspect {what} --bpffs {} ({} lines, first {max}) ====\n{}{}",
                    lab.info().bpffs.display(),
                    lines.len(),
                    lines[..lines.len().min(max)].join("\n"),
                    String::from_utf8_lossy(&o.stderr)
                )
            }
            (Err(e), _) => eprintln!("==== proxy-agent inspect {what}: {e}"),
        }
    }
}

/// Every node's agent log tail and pinned maps (multi-node labs).
pub fn diagnostics_nodes(lab: &Lab) {
    for n in lab.nodes() {
        let log = std::fs::read_to_string(&n.agent_log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        eprintln!(
            "==== lab {} {} ({}) {} (last 40 of {} lines) ====\n{}",
            lab.id(),
            n.name,
            n.ip,
            n.agent_log.display(),
            lines.len(),
            lines[lines.len().saturating_sub(40)..].join("\n")
        );
        for what in ["services", "stats", "conntrack"] {
            eprintln!(
                "==== {}: proxy-agent inspect {what} --bpffs {} ====\n{}",
                n.name,
                n.bpffs.display(),
                inspect(what, &n.bpffs)
            );
        }
    }
}

/// Starts the lab `builder` describes (with the lab server), runs `ready`
/// (which waits for the agents), prints `[<test>] lab <id><label> ready in`,
/// runs `f`. On a panic in `ready` or `f`, runs `diagnostics` while the lab
/// still exists (also with `KPR_LAB_DIAG` set); the lab is torn down before
/// the panic resumes.
pub fn run_lab<F: FnOnce(&mut Lab)>(
    test: &str,
    builder: LabBuilder,
    label: &str,
    ready: impl FnOnce(&mut Lab),
    diagnostics: impl FnOnce(&Lab),
    f: F,
) {
    let started = Instant::now();
    let mut lab = builder
        .server_bin(env!("CARGO_BIN_EXE_lab-server"))
        .start()
        .unwrap_or_else(|e| panic!("{test}: lab start: {e:#}"));
    let result = panic::catch_unwind(AssertUnwindSafe(|| {
        ready(&mut lab);
        println!(
            "[{test}] lab {}{label} ready in {} ms",
            lab.id(),
            started.elapsed().as_millis()
        );
        f(&mut lab)
    }));
    if result.is_err() || std::env::var_os("KPR_LAB_DIAG").is_some() {
        diagnostics(&lab);
    }
    drop(lab);
    println!("[{test}] done in {} ms", started.elapsed().as_millis());
    if let Err(e) = result {
        panic::resume_unwind(e);
    }
}

/// Waits (up to the lab's [`Lab::sync_timeout`]) for every agent's sync
/// after the last manifest write, then [`attached`]; returns how long that
/// took. One node or several: [`Lab::wait_synced`] waits for every agent.
pub fn synced(lab: &mut Lab) -> Duration {
    let sync_timeout = lab.sync_timeout();
    let t = Instant::now();
    lab.wait_synced(sync_timeout)
        .unwrap_or_else(|e| panic!("agent did not sync: {e:#}"));
    attached(lab);
    t.elapsed()
}

/// `lab.apply(yaml)` and [`synced`]; returns how long the sync took.
pub fn apply(lab: &mut Lab, yaml: &str) -> Duration {
    lab.apply(yaml).unwrap_or_else(|e| panic!("apply: {e:#}"));
    synced(lab)
}

/// Waits (up to the lab's [`Lab::sync_timeout`]) for every agent's
/// attachments ([`Lab::wait_attached`]: the `attached pod program` line of
/// each pod's and client's host-side veth, and `eth0`'s).
pub fn attached(lab: &mut Lab) {
    let sync_timeout = lab.sync_timeout();
    lab.wait_attached(sync_timeout)
        .unwrap_or_else(|e| panic!("agent not attached: {e:#}"));
}

/// Waits (up to 5 s) until the host-side veth `host_if` of the deleted pod
/// `name` is gone from the node namespace `node_ns`. `ip netns del` returns
/// before the kernel destroyed the namespace's veth.
pub fn wait_veth_gone(node_ns: &str, host_if: &str, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let present = Command::new("ip")
            .args(["-n", node_ns, "link", "show", "dev", host_if])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !present {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "veth {host_if} of deleted pod {name} still in {node_ns} after 5 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `lab.delete_pod(name)` (which waits for every agent's sync), then waits
/// until the pod's host-side veth is gone from its node's namespace ([`wait_veth_gone`]):
/// the lab frees the pod's IP at once, and a pod created right after may get
/// the same IP and fail with `route add ...: File exists` while the old veth
/// (and its /32 route) linger. Returns how long `lab.delete_pod` took.
pub fn delete_pod(lab: &mut Lab, name: &str) -> Duration {
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
    let t = Instant::now();
    lab.delete_pod(name)
        .unwrap_or_else(|e| panic!("delete_pod({name}): {e:#}"));
    let took = t.elapsed();
    if !host_if.is_empty() {
        wait_veth_gone(&node_ns, &host_if, name);
    }
    took
}

/// A client namespace on `node`: the default client on node-1, else one
/// named `client-<node>`, added the first time (then waits, up to the lab's
/// [`Lab::sync_timeout`], for every agent's attachments).
pub fn client_on(lab: &mut Lab, node: &str) -> Endpoint {
    if node == "node-1" {
        return lab.client().clone();
    }
    let name = format!("client-{node}");
    if let Some(c) = lab.client_named(&name) {
        return c.clone();
    }
    let c = lab
        .add_client_on(&name, node)
        .unwrap_or_else(|e| panic!("add_client_on({name}, {node}): {e:#}"));
    attached(lab);
    c
}

/// A lab server in a node's own namespace: a hostNetwork endpoint (the lab
/// starts none for a hostNetwork pod). It answers TCP and UDP on `port` as
/// `name`, on IPv6 too when the lab is dual-stack; killed on drop.
pub struct HostServer(Child);

impl HostServer {
    pub fn start(lab: &Lab, node: &str, name: &str, port: u16) -> Self {
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
        if lab.is_dual_stack() {
            cmd.arg("--ipv6");
        }
        xtask::netns::enter_netns_on_spawn(&mut cmd, &ns).expect("netns");
        let mut child = cmd.spawn().expect("spawn lab-server");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("ready line");
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

/// The (IPv4) ClusterIP frontend of `service`'s `proto` port `port`.
pub fn frontend(lab: &Lab, service: &str, port: u16, proto: &str) -> SocketAddrV4 {
    lab.cluster_frontend(service, port, proto)
        .unwrap_or_else(|| panic!("no {proto} ClusterIP frontend {service}:{port}"))
}

/// The IPv6 ClusterIP frontend of `service`'s `proto` port `port`
/// (dual-stack labs).
pub fn frontend6(lab: &Lab, service: &str, port: u16, proto: &str) -> SocketAddr {
    lab.cluster_frontend6(service, port, proto)
        .unwrap_or_else(|| panic!("no {proto} IPv6 ClusterIP frontend {service}:{port}"))
}

// ---------------------------------------------------------------- requests
//
// Addresses are `impl Into<SocketAddr>`: a `SocketAddrV4`, or a `SocketAddr`
// of either family.

pub fn tcp_hostname(ns: &str, addr: impl Into<SocketAddr>) -> io::Result<String> {
    client::tcp_request(ns, addr, b"hostname\n", T).map(|r| reply_text(&r))
}

/// `reqs` sent from `ns` one after another (within 120 s): counts per
/// answer, and the errors.
pub fn count_answers(ns: &str, reqs: Vec<Request>) -> (BTreeMap<String, usize>, Vec<String>) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let results = client::batch(ns, reqs, Some(deadline)).expect("enter client namespace");
    let mut counts = BTreeMap::new();
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(reply) => *counts.entry(reply_text(&reply)).or_insert(0) += 1,
            Err(e) => errors.push(format!("{:?}: {e}", e.kind())),
        }
    }
    (counts, errors)
}

/// `n` new TCP connections asking `hostname`, one after another on one
/// thread: counts per answer, and the errors.
pub fn tcp_hostnames(
    ns: &str,
    addr: impl Into<SocketAddr>,
    n: usize,
) -> (BTreeMap<String, usize>, Vec<String>) {
    let addr = addr.into();
    count_answers(
        ns,
        (0..n)
            .map(|_| Request::tcp(addr, b"hostname\n", T))
            .collect(),
    )
}

/// `n` requests asking `hostname`, sent one after another: new TCP
/// connections, with `proto` "UDP" datagrams each from a new socket (a new
/// source port, so a new flow), with "SCTP" new SCTP associations.
pub fn hostname_requests(addr: impl Into<SocketAddr>, proto: &str, n: usize) -> Vec<Request> {
    let addr = addr.into();
    (0..n)
        .map(|_| match proto {
            "UDP" => Request::udp(addr, b"hostname", T),
            "SCTP" => Request::sctp(addr, b"hostname\n", T_SCTP),
            _ => Request::tcp(addr, b"hostname\n", T),
        })
        .collect()
}

/// Asserts that `n` `proto` requests from `ns` to `addr`
/// ([`hostname_requests`]) all succeed; returns the answers' counts.
pub fn all_answered(
    ns: &str,
    addr: impl Into<SocketAddr>,
    proto: &str,
    n: usize,
    what: &str,
) -> BTreeMap<String, usize> {
    let addr = addr.into();
    let (counts, errors) = count_answers(ns, hostname_requests(addr, proto, n));
    println!(
        "{what}: {n} {proto} requests to {addr}: {counts:?}, {} errors",
        errors.len()
    );
    assert!(
        errors.is_empty(),
        "{what}: {} of {n} {proto} requests to {addr} failed: {:?} (answers: {counts:?})",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    counts
}

/// Asserts that `n` `proto` requests from `ns` to `addr` all succeed and are
/// answered by exactly the pods `expected`.
pub fn assert_answered_by(
    ns: &str,
    addr: impl Into<SocketAddr>,
    proto: &str,
    n: usize,
    expected: &[&str],
    what: &str,
) {
    let addr = addr.into();
    let counts = all_answered(ns, addr, proto, n, what);
    let seen: BTreeSet<&str> = counts.keys().map(String::as_str).collect();
    let want: BTreeSet<&str> = expected.iter().copied().collect();
    assert_eq!(
        seen, want,
        "{what}: pods answering {proto} {addr} (counts {counts:?})"
    );
}

/// Asserts a TCP connect to `addr` is refused (RST or ICMP) quickly; returns
/// the time it took.
pub fn assert_tcp_refused(ns: &str, addr: impl Into<SocketAddr>, what: &str) -> Duration {
    let addr = addr.into();
    let t = Instant::now();
    let r = tcp_hostname(ns, addr);
    let el = t.elapsed();
    match r {
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            println!("{what}: TCP {addr} refused in {} ms", el.as_millis());
            el
        }
        other => panic!(
            "{what}: TCP {addr}: expected ConnectionRefused, got {other:?} after {} ms",
            el.as_millis()
        ),
    }
}

/// Asserts that `tries` TCP connects from `ns` to `addr` are dropped: each
/// times out after [`T`] (no RST, no ICMP: not "refused", no answer).
pub fn assert_tcp_dropped(ns: &str, addr: impl Into<SocketAddr>, tries: usize, what: &str) {
    let addr = addr.into();
    for i in 0..tries {
        let t = Instant::now();
        let r = client::tcp_request(ns, addr, b"hostname\n", T).map(|r| reply_text(&r));
        let el = t.elapsed();
        match r {
            Err(e) if e.kind() == io::ErrorKind::TimedOut => println!(
                "{what}: TCP {addr} try {}: dropped (timed out after {} ms)",
                i + 1,
                el.as_millis()
            ),
            other => panic!(
                "{what}: TCP {addr} try {}: expected a drop (timeout), got {other:?} after {} ms",
                i + 1,
                el.as_millis()
            ),
        }
    }
}

/// `n` requests `proto` to `addr` from the host client `c`; answers by pod
/// name (the first word of the reply), errors counted under
/// `error:<kind>`. Asserts that what the client saw as its peer is `addr`,
/// as the socket of `addr`'s family prints it (getpeername for TCP, the
/// datagram's source for UDP): the hooks show the frontend, not the
/// endpoint.
#[allow(dead_code)] // Not every lab test file uses it.
pub fn host_spread(
    c: &mut xtask::HostClient,
    proto: &str,
    addr: impl Into<std::net::SocketAddr>,
    n: usize,
) -> std::collections::BTreeMap<String, usize> {
    let addr: std::net::SocketAddr = addr.into();
    let mut counts = std::collections::BTreeMap::new();
    for _ in 0..n {
        let r = match proto {
            "TCP" => c.tcp(addr, "hostname"),
            _ => c.udp(addr, "hostname"),
        }
        .expect("host client");
        let key = match &r {
            xtask::HostReply::Ok { peer, text } => {
                assert_eq!(
                    peer,
                    &addr.to_string(),
                    "{proto} {addr}: the client must see the frontend as its peer, saw {peer}"
                );
                text.split_whitespace().next().unwrap_or("").to_string()
            }
            xtask::HostReply::Err { kind, .. } => format!("error:{kind}"),
        };
        *counts.entry(key).or_default() += 1;
    }
    counts
}

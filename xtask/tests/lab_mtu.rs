//! Packet-size lab tests (issue 15): bulk TCP transfers through translated
//! flows with segments merged by GSO/GRO, and across an MTU step that needs
//! path-MTU discovery through the translation.
//!
//! The lab: two nodes on the switch, the external client, one backend pod
//! (`bulk-2`, the lab server's `sink` and `source`) on node-2 behind a
//! NodePort Service (externalTrafficPolicy Cluster: through node-1 the flow is
//! DNATed and SNATed to node-1's address, then redirected to node-2). The
//! agents run with `--acceleration none` (tc only: the XDP program sees
//! frames before GRO merges them).
//!
//! Transfers are bounded ([`LIMIT`]): a stalled one fails its test, it does
//! not hang it. Throughput is printed (through the proxy and straight to the
//! pod), not asserted.
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --release --bins; cargo build -p xtask --bins;
//! KPR_REQUIRE_ROOT_TESTS=1 KPR_AGENT_BIN=$PWD/target/release/proxy-agent
//! cargo test -p xtask --test lab_mtu -- --include-ignored --test-threads=2`.
//!
//! On failure every node's agent log tail and `proxy-agent inspect
//! services|stats|conntrack` of every node are printed before the lab is torn
//! down; `KPR_LAB_DIAG=1` prints them after every test.

use std::net::SocketAddrV4;
use std::time::Duration;

use xtask::netns::ip_in;
use xtask::Lab;

mod support;
use support::bulk::{self, ethtool_set, offloads, snmp, Transfer};
use support::fixtures::{manifests, Pod, Port, Svc};
use support::{frontend as cluster_ip, stat, LabTest};

/// How long one transfer may take: a few hundred ms when it works, here.
const LIMIT: Duration = Duration::from_secs(20);
/// Bytes of a bulk transfer (enough for GRO to merge thousands of segments).
const BULK: u64 = 64 << 20;
/// Bytes of a transfer across the MTU step (it stalls at its first
/// full-size segment when PMTU discovery does not work).
const STEP_BULK: u64 = 8 << 20;
/// The backend's host-side veth MTU in the MTU-step tests (the pod side keeps
/// 1500, so the backend still advertises MSS 1460).
const STEP_MTU: u16 = 1400;
/// The largest TCP payload of one wire-size segment (MTU 1500).
const MSS: u64 = 1460;

// ---------------------------------------------------------------- lab

/// The backend pod on node-2 and its NodePort Service (eTP Cluster).
fn yaml() -> String {
    manifests(&[
        &Pod::new("bulk-2", "bulk").node("node-2").port(80, "TCP"),
        &Svc::new("bulk")
            .service_type("NodePort")
            .selector("bulk")
            .port(Port::tcp("tcp", 80)),
    ])
}

/// Starts the two-node lab with the external client (tc only), waits for the
/// agents, runs `f`; see [`support::with_nodes`].
fn with_lab(test: &str, f: impl FnOnce(&mut Lab)) {
    LabTest::new(test)
        .nodes(2)
        .external(true)
        .yaml(&yaml())
        .args(&["--acceleration", "none"])
        .run(f)
}

fn ext(lab: &Lab) -> String {
    lab.external().expect("external client").netns.clone()
}

fn node_ns(lab: &Lab, node: &str) -> String {
    lab.node_named(node).expect("node").netns.clone()
}

/// The backend pod's own address and port (straight to the pod, no Service).
fn pod_addr(lab: &Lab) -> SocketAddrV4 {
    SocketAddrV4::new(lab.pod("bulk-2").expect("pod bulk-2").ip, 80)
}

/// node-1's address at the Service's NodePort.
fn node_port(lab: &Lab) -> SocketAddrV4 {
    let ip = lab.node_named("node-1").expect("node-1").ip;
    lab.info()
        .frontends_of("bulk")
        .into_iter()
        .find(|f| f.kind == "NodePort" && f.ip == ip)
        .map(|f| f.addr())
        .expect("NodePort of bulk on node-1")
}

/// Offloads that merge segments, on wherever the kernel allows:
/// - GRO on every node's `eth0`. A veth merges only what comes from a peer
///   without TSO (`veth_skb_is_eligible_for_gro`), so the switch's ports get
///   TSO off: frames on this wire have wire size, as from a NIC, and the
///   receiving node's GRO merges them, as a NIC's driver does.
/// - The pods' `eth0` keep TSO on (the veth default): their packets reach
///   the node's tc ingress as GSO packets of up to 64 KiB.
///
/// TSO on a node's or the external client's `eth0` cannot be turned on:
/// the lab's XDP pass program on the switch side makes the kernel take
/// GSO_SOFTWARE off its veth peer. Prints what is on.
fn merge_offloads_on(lab: &Lab) {
    let sw = lab.info().switch_netns.clone().expect("switch namespace");
    let mut ports = vec!["ext".to_string()];
    for (i, _) in lab.nodes().iter().enumerate() {
        ports.push(format!("n{}", i + 1));
    }
    for p in &ports {
        ethtool_set(&sw, p, &["tso", "off"]);
    }
    for n in lab.nodes() {
        ethtool_set(&n.netns, "eth0", &["gro", "on"]);
    }
    print_offloads(lab, &sw, &ports);
}

fn print_offloads(lab: &Lab, sw: &str, ports: &[String]) {
    println!("offloads: external eth0 {}", offloads(&ext(lab), "eth0"));
    for p in ports {
        println!("offloads: switch port {p} {}", offloads(sw, p));
    }
    for n in lab.nodes() {
        println!("offloads: {} eth0 {}", n.name, offloads(&n.netns, "eth0"));
    }
    let c = lab.client();
    println!("offloads: client pod eth0 {}", offloads(&c.netns, "eth0"));
    let p = lab.pod("bulk-2").expect("pod");
    println!("offloads: pod bulk-2 eth0 {}", offloads(&p.netns, "eth0"));
}

fn up(ns: &str, addr: SocketAddrV4, bytes: u64, what: &str) -> Transfer {
    let t = bulk::upload(ns, addr, bytes, LIMIT)
        .unwrap_or_else(|e| panic!("{what}: upload to {addr}: {:?} {e}", e.kind()));
    println!("{what}: upload to {addr}: {t}");
    t
}

fn down(ns: &str, addr: SocketAddrV4, bytes: u64, what: &str) -> Transfer {
    let t = bulk::download(ns, addr, bytes, LIMIT)
        .unwrap_or_else(|e| panic!("{what}: download from {addr}: {:?} {e}", e.kind()));
    println!("{what}: download from {addr}: {t}");
    t
}

/// The datapath counters a bulk transfer moves on `node`.
#[derive(Debug, Clone, Copy)]
struct Counters {
    /// Translated packets handed to the stack because the FIB refused them.
    pass_fib_miss: u64,
    fwd_established: u64,
    fwd_reply: u64,
}

fn counters(lab: &Lab, node: &str) -> Counters {
    Counters {
        pass_fib_miss: stat(lab, node, "pass_fib_miss"),
        fwd_established: stat(lab, node, "fwd_established"),
        fwd_reply: stat(lab, node, "fwd_reply"),
    }
}

/// Asserts that the packets `seen` of a transfer of `bytes` were merged: on
/// average more than one wire-size segment each (else the lab did not merge
/// and the test would not test what it is for).
fn assert_merged(bytes: u64, seen: u64, what: &str) {
    println!(
        "{what}: the program saw {seen} packets, {} bytes each on average",
        bytes / seen.max(1)
    );
    assert!(
        seen > 0 && bytes / seen > MSS,
        "{what}: {seen} packets for {bytes} bytes: segments were not merged (GSO/GRO off?)"
    );
}

/// Asserts that no translated packet went to the stack on any node between
/// `before` and now.
fn assert_no_fallback(lab: &Lab, before: &[(String, Counters)], what: &str) {
    for (node, b) in before {
        let a = counters(lab, node);
        assert_eq!(
            a.pass_fib_miss - b.pass_fib_miss,
            0,
            "{what}: {node} handed {} translated packets to the stack (pass_fib_miss {} → {})",
            a.pass_fib_miss - b.pass_fib_miss,
            b.pass_fib_miss,
            a.pass_fib_miss
        );
    }
}

fn all_counters(lab: &Lab) -> Vec<(String, Counters)> {
    ["node-1", "node-2"]
        .iter()
        .map(|n| (n.to_string(), counters(lab, n)))
        .collect()
}

// ================================================================ GSO / GRO

/// Issue 15: GRO-merged segments of a NodePort flow (eTP Cluster, backend on
/// the other node: DNAT + SNAT + redirect) are delivered by redirect, never
/// handed to the stack: with the packet's IP length in `bpf_fib_lookup`'s
/// `tot_len`, kernels from 5.12 answer FRAG_NEEDED for a merged packet, and
/// the stack drops a packet whose source is now its own address as a
/// martian. The external client uploads and downloads 64 MiB through
/// node-1's NodePort; every byte arrives, node-1's program saw merged
/// packets, and `pass_fib_miss` stays where it was on both nodes.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn gro_merged_nodeport_transfers_are_redirected_not_handed_to_stack() {
    with_lab("gro-nodeport", |lab| {
        merge_offloads_on(lab);
        let x = ext(lab);
        let np = node_port(lab);
        let pod = pod_addr(lab);
        up(
            &x,
            pod,
            BULK,
            "straight to the pod (external → node-2 → pod)",
        );
        down(
            &x,
            pod,
            BULK,
            "straight to the pod (external → node-2 → pod)",
        );

        let before = all_counters(lab);
        up(&x, np, BULK, "through node-1's NodePort");
        let mid = counters(lab, "node-1");
        assert_merged(
            BULK,
            mid.fwd_established - before[0].1.fwd_established,
            "upload through the NodePort, node-1's eth0",
        );
        down(&x, np, BULK, "through node-1's NodePort");
        assert_merged(
            BULK,
            counters(lab, "node-1").fwd_reply - mid.fwd_reply,
            "download through the NodePort, node-1's eth0",
        );
        assert_no_fallback(lab, &before, "bulk transfers through the NodePort");
    });
}

/// Issue 15, east-west: a pod on node-1 uploads to and downloads from a
/// ClusterIP whose only backend is on node-2; the pod's TSO packets (up to
/// 64 KiB) reach node-1's tc ingress whole, and the replies arrive GRO-merged
/// on node-1's eth0. Every byte arrives and `pass_fib_miss` stays where it
/// was on both nodes.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn gso_cluster_ip_transfers_to_remote_pod_are_redirected_not_handed_to_stack() {
    with_lab("gso-clusterip", |lab| {
        merge_offloads_on(lab);
        let c = lab.client().netns.clone();
        let vip = cluster_ip(lab, "bulk", 80, "TCP");
        let pod = pod_addr(lab);
        up(
            &c,
            pod,
            BULK,
            "straight to the pod (pod on node-1 → pod on node-2)",
        );
        down(
            &c,
            pod,
            BULK,
            "straight to the pod (pod on node-1 → pod on node-2)",
        );

        let before = all_counters(lab);
        up(&c, vip, BULK, "through the ClusterIP");
        let mid = counters(lab, "node-1");
        assert_merged(
            BULK,
            mid.fwd_established - before[0].1.fwd_established,
            "upload through the ClusterIP, node-1's pod veth",
        );
        down(&c, vip, BULK, "through the ClusterIP");
        assert_merged(
            BULK,
            counters(lab, "node-1").fwd_reply - mid.fwd_reply,
            "download through the ClusterIP, node-1's eth0",
        );
        assert_no_fallback(lab, &before, "bulk transfers through the ClusterIP");
    });
}

// ================================================================ MTU step

/// Lowers the MTU of the backend's host-side veth on node-2 to [`STEP_MTU`]:
/// node-2 forwards full-size DF segments into it and answers each with an
/// ICMP fragmentation-needed, from node-2's address, to the segment's source
/// as it was on the wire (the client pod for a ClusterIP; node-1's address
/// for a NodePort flow SNATed there). The ICMP's inner header carries the
/// translated tuple.
fn mtu_step(lab: &Lab) {
    let p = lab.pod("bulk-2").expect("pod bulk-2");
    let ns = node_ns(lab, &p.node);
    ip_in(
        &ns,
        &[
            "link",
            "set",
            "dev",
            &p.host_if,
            "mtu",
            &STEP_MTU.to_string(),
        ],
    )
    .unwrap_or_else(|e| panic!("MTU step on {}: {e:#}", p.host_if));
    println!(
        "MTU step: {} {} mtu {STEP_MTU} (pod side 1500)",
        p.node, p.host_if
    );
}

/// Uploads [`STEP_BULK`] from `ns` to `addr` across the MTU step and checks
/// that node-2 sent fragmentation-needed (the step is there) and that the
/// upload completed within [`LIMIT`] (the sender learned the path MTU).
/// `icmp_to` is the namespace the ICMP is addressed to, where an ICMP error
/// that matches no socket counts as `IcmpInErrors`.
fn assert_upload_across_step(lab: &Lab, ns: &str, addr: SocketAddrV4, icmp_to: &str, what: &str) {
    let n2 = node_ns(lab, "node-2");
    let (sent0, unmatched0, retrans0) = (
        snmp(&n2, "IcmpMsgOutType3"),
        snmp(icmp_to, "IcmpInErrors"),
        snmp(ns, "TcpRetransSegs"),
    );
    let r = bulk::upload(ns, addr, STEP_BULK, LIMIT);
    let sent = snmp(&n2, "IcmpMsgOutType3") - sent0;
    let unmatched = snmp(icmp_to, "IcmpInErrors") - unmatched0;
    let retrans = snmp(ns, "TcpRetransSegs") - retrans0;
    let icmp = format!(
        "node-2 sent {sent} ICMP destination-unreachable; {unmatched} ICMP errors matched no socket where they were addressed; the sender retransmitted {retrans} segments"
    );
    match &r {
        Ok(t) => println!("{what}: upload to {addr} across the MTU step: {t}; {icmp}"),
        Err(e) => println!("{what}: upload to {addr} across the MTU step failed: {e}; {icmp}"),
    }
    assert!(
        sent > 0,
        "{what}: node-2 sent no fragmentation-needed: the lab has no MTU step ({icmp})"
    );
    if let Err(e) = r {
        panic!(
            "{what}: upload of {STEP_BULK} bytes to {addr} did not complete within {} s: {:?} {e} ({icmp})",
            LIMIT.as_secs(),
            e.kind()
        );
    }
}

/// Issue 15, ICMP errors about translated flows: a pod on node-1 uploads to
/// a ClusterIP whose only backend is on node-2, behind an MTU step on
/// node-2. node-2's fragmentation-needed names the backend's address in its
/// inner header; translated back to the ClusterIP it reaches the client's
/// socket, which lowers its segments, and the upload completes.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn pmtu_discovery_completes_cluster_ip_upload_across_mtu_step() {
    with_lab("mtu-clusterip", |lab| {
        mtu_step(lab);
        let c = lab.client().netns.clone();
        let vip = cluster_ip(lab, "bulk", 80, "TCP");
        assert_upload_across_step(lab, &c, vip, &c, "pod on node-1 → ClusterIP");
    });
}

/// Issue 15, ICMP errors about translated flows: the external client uploads
/// through node-1's NodePort (eTP Cluster: SNAT to node-1) to the backend on
/// node-2, behind an MTU step on node-2. node-2's fragmentation-needed goes
/// to node-1's address with the SNATed tuple inside; translated back (outer
/// destination the client, inner the NodePort) it reaches the client's
/// socket, and the upload completes.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn pmtu_discovery_completes_nodeport_upload_across_mtu_step() {
    with_lab("mtu-nodeport", |lab| {
        mtu_step(lab);
        let x = ext(lab);
        let np = node_port(lab);
        let n1 = node_ns(lab, "node-1");
        assert_upload_across_step(lab, &x, np, &n1, "external → node-1's NodePort");
    });
}

//! Lab tests of the load-balancing algorithms (annotation
//! `proxy-agent.io/lb-algorithm`), with real sockets between namespaces:
//!
//! - Maglev: an external client's TCP connections to a load-balancer IP,
//!   established through node-1, keep working when the client's route to the
//!   IP moves to node-2 (which has no conntrack for them): node-2 picks the
//!   same backends and hands the flows to their nodes. With `random` the same
//!   move resets them. Both in tc-only and XDP mode.
//! - Round robin (IPVS `rr`): 300 sequential connections from one client,
//!   on one CPU, give each of 3 backends 100 (±1).
//! - Source hash (IPVS `sh`): every connection of a client goes to one
//!   backend; several clients spread over the backends.
//!
//! Run as root: `cargo xtask test`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddrV4};

use xtask::Lab;

mod support;
use support::fixtures::{manifests, Pod, Port, Svc};
use support::{count_answers, frontend, hostname_requests, LabTest, Stream};

const ANNOTATION: &str = "proxy-agent.io/lb-algorithm";
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 7);

/// Three pods `web-1..3`, one per node, behind Service `web` (port 80/TCP,
/// load-balancer IP [`LB_IP`]) with algorithm `alg`.
fn three_backends(alg: &str, service_type: &str) -> String {
    let svc = Svc::new("web")
        .service_type(service_type)
        .no_affinity()
        .selector("web")
        .port(Port::tcp("tcp", 80))
        .annotation(ANNOTATION, alg);
    let svc = if service_type == "LoadBalancer" {
        svc.lb_ips(&[LB_IP])
    } else {
        svc
    };
    manifests(&[
        &Pod::new("web-1", "web").node("node-1").port(80, "TCP"),
        &Pod::new("web-2", "web").node("node-2").port(80, "TCP"),
        &Pod::new("web-3", "web").node("node-3").port(80, "TCP"),
        &svc,
    ])
}

/// `ip route replace LB_IP/32 via <node>` in the external client's
/// namespace: the router moving the flow.
fn route_lb_via(lab: &Lab, node: &str) {
    lab.route_from_external(LB_IP, node)
        .unwrap_or_else(|e| panic!("route {LB_IP} via {node}: {e:#}"));
}

/// Opens `n` streams from the external client to the LB IP through node-1,
/// moves the route to node-2, and returns how many streams still answer.
fn streams_surviving_a_route_move(
    lab: &mut Lab,
    n: usize,
    what: &str,
) -> (usize, BTreeSet<String>) {
    let x = lab.external().expect("external client").netns.clone();
    route_lb_via(lab, "node-1");
    let vip = SocketAddrV4::new(LB_IP, 80);
    let mut streams: Vec<Stream> = (0..n).map(|_| Stream::open(&x, vip)).collect();
    let pods: BTreeSet<String> = streams.iter().map(|s| s.pod.clone()).collect();
    for (i, s) in streams.iter_mut().enumerate() {
        s.pings(3, &format!("{what} via node-1 #{i}"));
    }
    route_lb_via(lab, "node-2");
    let mut alive = 0;
    for (i, s) in streams.iter_mut().enumerate() {
        match (0..3).try_for_each(|k| s.ping(format!("{what} via node-2 #{i}-{k}"))) {
            Ok(()) => alive += 1,
            Err(e) => println!("{what}: stream #{i} to {} broke after the move: {e}", s.pod),
        }
    }
    println!("{what}: {alive}/{n} streams survived the route move; backends {pods:?}");
    (alive, pods)
}

/// Runs `f` in a lab of three nodes with the external client, `yaml`, and
/// the agents in acceleration `mode`.
fn three_nodes(test: &str, mode: &str, yaml: &str, f: impl FnOnce(&mut Lab)) {
    LabTest::new(test)
        .nodes(3)
        .external(true)
        .yaml(yaml)
        .args(&["--acceleration", mode])
        .run(f)
}

/// Maglev keeps every connection across the route move (in both modes);
/// random resets them all.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn maglev_connection_survives_a_route_move_between_nodes_random_does_not() {
    for mode in ["none", "xdp"] {
        three_nodes(
            &format!("maglev-route-move/{mode}"),
            mode,
            &three_backends("maglev", "LoadBalancer"),
            |lab| {
                let (alive, pods) =
                    streams_surviving_a_route_move(lab, 9, &format!("maglev/{mode}"));
                assert!(
                    pods.len() >= 2,
                    "9 streams should reach several backends: {pods:?}"
                );
                assert_eq!(
                    alive, 9,
                    "maglev/{mode}: every stream must survive the move"
                );
            },
        );
    }
    three_nodes(
        "random-route-move",
        "none",
        &three_backends("random", "LoadBalancer"),
        |lab| {
            let (alive, _) = streams_surviving_a_route_move(lab, 9, "random");
            assert_eq!(
                alive, 0,
                "random: no node-2 state, so no stream can survive the move"
            );
        },
    );
}

/// Pins the calling thread (and the threads it starts) to CPU 0, so every
/// connection is balanced by one CPU's cursor.
fn pin_to_cpu0() {
    let mut set = nix::sched::CpuSet::new();
    set.set(0).expect("cpu 0");
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).expect("pin to cpu 0");
}

/// IPVS-style round robin through a ClusterIP: 300 sequential connections
/// from one client pod, all on one CPU: 100 each (±1).
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn round_robin_gives_each_backend_its_share_of_300_connections() {
    three_nodes(
        "round-robin",
        "none",
        &three_backends("round-robin", "ClusterIP"),
        |lab| {
            let vip = frontend(lab, "web", 80, "TCP");
            let c = lab.client().netns.clone();
            pin_to_cpu0();
            let (counts, errors) = count_answers(&c, hostname_requests(vip, "TCP", 300));
            assert!(errors.is_empty(), "{errors:?}");
            println!("round robin over 300 connections: {counts:?}");
            assert_eq!(counts.len(), 3, "{counts:?}");
            for (pod, n) in &counts {
                assert!((99..=101).contains(n), "{pod} got {n} of 300: {counts:?}");
            }
        },
    );
}

/// IPVS-style source hashing through a ClusterIP: 10 connections from each
/// of 8 client pods; each client's go to one backend, the clients spread.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn source_hash_sends_a_client_to_one_backend_and_spreads_clients() {
    three_nodes(
        "source-hash",
        "none",
        &three_backends("source-hash", "ClusterIP"),
        |lab| {
            let vip = frontend(lab, "web", 80, "TCP");
            let mut by_client: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
            for i in 0..8 {
                let name = format!("sh-client-{i}");
                let c = lab
                    .add_client_on(&name, ["node-1", "node-2", "node-3"][i % 3])
                    .unwrap_or_else(|e| panic!("add client {name}: {e:#}"));
                support::attached(lab);
                let (counts, errors) = count_answers(&c.netns, hostname_requests(vip, "TCP", 10));
                assert!(errors.is_empty(), "{name}: {errors:?}");
                by_client.insert(format!("{name} ({})", c.ip), counts);
            }
            println!("source hash: {by_client:?}");
            for (c, counts) in &by_client {
                assert_eq!(counts.len(), 1, "{c} went to several backends: {counts:?}");
            }
            let used: BTreeSet<&String> = by_client.values().flat_map(|c| c.keys()).collect();
            assert!(used.len() >= 2, "8 clients on one backend: {by_client:?}");
        },
    );
}

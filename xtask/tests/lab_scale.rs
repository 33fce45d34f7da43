//! Issue 13 in the lab: a control plane whose cost does not grow with the
//! cluster. 10,000 Services are programmed beside the one that changes; one
//! endpoint change of that one must move traffic within a second (the
//! issue's bound) while the 10,000 others keep answering, none failing.
//!
//! The 10,000 Services (ClusterIPs 198.19.100.0 onwards, above what the lab
//! allocates) and their EndpointSlices, all naming one pod of the lab, are
//! one JSON manifests file of their own beside the lab's `cluster.yaml`,
//! which the change rewrites: the agent reads only the file that changed.
//!
//! Run as root: `cargo xtask test`, or
//! `cargo build -p proxy-agent --bins && cargo test -p xtask --test lab_scale -- --include-ignored`.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use xtask::client::{self, reply_text};
use xtask::lab::NODE_NAME;
use xtask::netns::in_netns;

mod support;
use support::fixtures::{manifests, Pod, Port, Svc};
use support::{assert_answered_by, frontend, T};

/// Services beside the one that changes.
const BULK: usize = 10_000;
/// The agent's first sync, and each wait below.
const SYNC_TIMEOUT: Duration = Duration::from_secs(120);
/// No probe thread runs longer than this, whatever happens.
const MAX_RUN: Duration = Duration::from_secs(120);
/// Bulk Services probed while the change is made, spread over all of them.
const PROBED: usize = 100;

fn bulk_vip(i: usize) -> SocketAddrV4 {
    let base = u32::from(Ipv4Addr::new(198, 19, 100, 0));
    SocketAddrV4::new(Ipv4Addr::from(base + i as u32), 80)
}

/// The bulk Services and their slices (endpoint `pod_ip`:80 on this node).
fn bulk_manifests(pod_ip: Ipv4Addr) -> String {
    let mut out = String::with_capacity(BULK * 700);
    for i in 0..BULK {
        let vip = bulk_vip(i).ip().to_string();
        let _ = writeln!(
            out,
            r#"---
{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"bulk-{i}","namespace":"default","creationTimestamp":"2026-01-01T00:00:00Z"}},"spec":{{"type":"ClusterIP","clusterIP":"{vip}","clusterIPs":["{vip}"],"ports":[{{"name":"http","port":80,"protocol":"TCP","targetPort":80}}]}}}}
---
{{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{{"name":"bulk-{i}-1","namespace":"default","labels":{{"kubernetes.io/service-name":"bulk-{i}"}}}},"addressType":"IPv4","endpoints":[{{"addresses":["{pod_ip}"],"conditions":{{"ready":true}},"nodeName":"{NODE_NAME}"}}],"ports":[{{"name":"http","port":80,"protocol":"TCP"}}]}}"#
        );
    }
    out
}

fn hostname_here(addr: SocketAddrV4) -> Option<String> {
    client::tcp_request_here(addr, b"hostname\n", T)
        .ok()
        .map(|r| reply_text(&r))
}

/// Polls `addr` from `ns` until `pod` answers; the time that took, or
/// `None` after `limit`.
fn until_answered_by(
    ns: &str,
    addr: SocketAddrV4,
    pod: &'static str,
    limit: Duration,
) -> Option<Duration> {
    in_netns(ns, move || {
        let t = Instant::now();
        while t.elapsed() < limit {
            if hostname_here(addr).as_deref() == Some(pod) {
                return Some(t.elapsed());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    })
    .expect("client namespace")
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn one_endpoint_change_among_10000_services_moves_traffic_while_the_others_answer() {
    let yaml = manifests(&[
        &Svc::new("web").selector("web").port(Port::tcp("http", 80)),
        &Pod::new("web-1", "web").port(80, "TCP"),
        &Pod::new("bulk", "bulk").port(80, "TCP"),
    ]);
    support::with_lab("scale", &yaml, SYNC_TIMEOUT, Some(40), |lab| {
        let ns = lab.client().netns.clone();
        let bulk_ip = lab
            .pods()
            .iter()
            .find(|p| p.name == "bulk")
            .expect("bulk pod")
            .ip;
        let dir = lab.info().manifests_dir.clone();
        let tmp = dir.join(".zz-bulk.json.tmp");
        std::fs::write(&tmp, bulk_manifests(bulk_ip)).expect("write the bulk manifests");
        let t = Instant::now();
        std::fs::rename(&tmp, dir.join("zz-bulk.json")).expect("rename");
        let last = bulk_vip(BULK - 1);
        until_answered_by(&ns, last, "bulk", SYNC_TIMEOUT)
            .unwrap_or_else(|| panic!("{BULK} Services not programmed within {SYNC_TIMEOUT:?}"));
        println!(
            "{BULK} Services programmed from their file in {} ms",
            t.elapsed().as_millis()
        );

        let web = frontend(lab, "web", 80, "TCP");
        assert_answered_by(&ns, web, "TCP", 10, &["web-1"], "before the change");

        // The 10,000 keep answering: 100 of them, spread, probed in turn
        // (a connection every 2 ms) on a thread of their own.
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let ns2 = ns.clone();
        let probes = std::thread::spawn(move || {
            in_netns(&ns2, move || {
                let started = Instant::now();
                let (mut ok, mut failed) = (0usize, Vec::new());
                let mut i = 0;
                while !stop2.load(Ordering::Relaxed) && started.elapsed() < MAX_RUN {
                    let vip = bulk_vip(i % PROBED * (BULK / PROBED));
                    match client::tcp_request_here(vip, b"hostname\n", T) {
                        Ok(r) if reply_text(&r) == "bulk" => ok += 1,
                        other => failed.push(format!(
                            "{vip} at {} ms: {:?}",
                            started.elapsed().as_millis(),
                            other.map(|r| reply_text(&r))
                        )),
                    }
                    i += 1;
                    std::thread::sleep(Duration::from_millis(2));
                }
                (ok, failed)
            })
            .expect("client namespace")
        });
        std::thread::sleep(Duration::from_millis(500));

        // One endpoint change: web-2 joins web (the lab rewrites
        // cluster.yaml once its server is up).
        lab.apply(&Pod::new("web-2", "web").port(80, "TCP").yaml())
            .expect("apply web-2");
        let moved = until_answered_by(&ns, web, "web-2", Duration::from_secs(10))
            .expect("web-2 never answered through the ClusterIP");
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        let (ok, failed) = probes.join().expect("probe thread");
        println!(
            "endpoint change among {BULK} Services: first connection through the new backend {} ms after the manifest write; {ok} probes of other Services answered, {} failed",
            moved.as_millis(),
            failed.len()
        );
        assert!(
            failed.is_empty(),
            "probes of other Services failed: {failed:?}"
        );
        assert!(ok >= PROBED, "only {ok} probes ran");
        // The issue's bound for the change (its own statement, not a speed
        // benchmark: the bench measures the latency).
        assert!(
            moved < Duration::from_secs(1),
            "traffic moved {} ms after the change",
            moved.as_millis()
        );
    });
}

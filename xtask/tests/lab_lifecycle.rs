//! Lab tests of the agent's lifecycle (root): restarts and upgrades keep the
//! datapath and its flows, and a restarted agent reconciles what changed while
//! it was down. Run with `cargo xtask test`.
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use xtask::client::{self, reply_text};

mod support;
use support::fixtures::{self, Pod, Port, Svc};
use support::{LabTest, Stream, T};

/// Service `web` (`http` 80/TCP, `udp` 80/UDP) and its pods web-1 and web-2.
fn manifests() -> String {
    let web = Svc::new("web")
        .selector("web")
        .port(Port::tcp("http", 80))
        .port(Port::udp("udp", 80));
    let pod = |name| Pod::new(name, "web").port(80, "TCP").port(80, "UDP");
    fixtures::manifests(&[&web, &pod("web-1"), &pod("web-2")])
}

/// A lab with [`manifests`] whose agent runs with `--on-exit keep` (what a
/// rolling update uses).
fn lab_test(name: &str) -> LabTest {
    LabTest::new(name)
        .yaml(&manifests())
        .args(&["--on-exit", "keep"])
        .sync_timeout(Duration::from_secs(20))
}

/// Opens new TCP connections to `vip` from `ns` until stopped; counts them.
fn churn(
    ns: String,
    vip: SocketAddrV4,
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let mut errors = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(120);
        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            match client::tcp_request(&ns, vip, b"hostname\n", T) {
                Ok(r) if !reply_text(&r).is_empty() => {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                Ok(_) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    errors.push("empty reply".into());
                }
                Err(e) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    errors.push(e.to_string());
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        errors
    })
}

fn udp_pod(ns: &str, vip: SocketAddrV4, port: u16) -> String {
    client::udp_request(ns, vip, b"hostname", T, Some(port))
        .map(|r| reply_text(&r))
        .unwrap_or_else(|e| panic!("UDP from port {port}: {e}"))
}

/// S8 — should work after restarting kube-proxy: with traffic running, the
/// agent is killed (`kill -9`) and started again, then stopped with SIGTERM
/// under `--on-exit keep` and started again (a rolling update's path). The
/// pinned links keep the programs attached while no agent runs, and the new
/// agent takes them over: established TCP connections keep working with zero
/// loss, a UDP flow keeps its backend, and no new connection fails.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s8_restart_keeps_flows_and_refuses_nothing() {
    lab_test("s8_restart").run(|lab| {
        let ns = lab.client().netns.clone();
        let vip = lab.cluster_frontend("web", 80, "TCP").expect("frontend");
        let vip_udp = lab
            .cluster_frontend("web", 80, "UDP")
            .expect("UDP frontend");

        let mut streams: Vec<Stream> = (0..10).map(|_| Stream::open(&ns, vip)).collect();
        let udp_before = udp_pod(&ns, vip_udp, 41234);
        let stop = Arc::new(AtomicBool::new(false));
        let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let churner = churn(ns.clone(), vip, stop.clone(), ok.clone(), failed.clone());

        let mut exchanges = 0;
        let mut lost = Vec::new();
        let mut exchange_all = |streams: &mut Vec<Stream>, round: usize| {
            for (i, s) in streams.iter_mut().enumerate() {
                exchanges += 1;
                if let Err(e) = s.ping(round) {
                    lost.push(format!("stream {i} round {round}: {e}"));
                }
            }
        };
        exchange_all(&mut streams, 0);

        for (round, how) in [(1, "kill -9"), (2, "SIGTERM --on-exit keep")] {
            let pid = lab.info().agent.as_ref().expect("agent running").pid;
            if how == "kill -9" {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .unwrap();
            }
            lab.stop_agent().expect("stop agent");
            // No agent at all for a while: the datapath alone carries the traffic.
            std::thread::sleep(Duration::from_millis(700));
            exchange_all(&mut streams, round * 10);
            assert_eq!(
                udp_pod(&ns, vip_udp, 41234),
                udp_before,
                "{how}: UDP flow moved while no agent ran"
            );
            let restarted = Instant::now();
            lab.start_agent().expect("start agent");
            lab.wait_ready(lab.sync_timeout())
                .expect("agent ready after restart");
            println!(
                "S8 {how}: agent back in {} ms",
                restarted.elapsed().as_millis()
            );
            exchange_all(&mut streams, round * 10 + 1);
            assert_eq!(
                udp_pod(&ns, vip_udp, 41234),
                udp_before,
                "{how}: UDP flow moved after the restart"
            );
        }
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        let errors = churner.join().unwrap();
        let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
        println!(
            "S8: {exchanges} exchanges on 10 established connections, {} lost; {} new connections, {failed} failed",
            lost.len(),
            ok + failed
        );
        assert!(lost.is_empty(), "established connections lost: {lost:?}");
        assert_eq!(
            failed, 0,
            "new connections failed during restarts: {errors:?}"
        );
        assert!(ok > 20, "too few connections made ({ok}) to say anything");
    });
}

/// State is reconciled after a restart: a Service deleted while the agent was
/// down is removed (its ClusterIP refused), one added meanwhile works.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn restart_reconciles_changes_made_while_down() {
    lab_test("restart_reconciles").run(|lab| {
        let ns = lab.client().netns.clone();
        let old = lab.cluster_frontend("web", 80, "TCP").expect("frontend");
        assert!(client::tcp_request(&ns, old, b"hostname\n", T).is_ok());
        lab.stop_agent().expect("stop");
        lab.delete_service("web").expect("delete web");
        lab.apply(
            &Svc::new("web2")
                .selector("web")
                .port(Port::tcp("", 8080).target_port(80))
                .yaml(),
        )
        .expect("apply web2");
        lab.start_agent().expect("start");
        lab.wait_ready(lab.sync_timeout()).expect("ready");
        let new = lab
            .cluster_frontend("web2", 8080, "TCP")
            .expect("web2 frontend");
        let r = client::tcp_request(&ns, new, b"hostname\n", T).map(|r| reply_text(&r));
        assert!(matches!(&r, Ok(n) if n.starts_with("web-")), "web2: {r:?}");
        let gone = client::tcp_request(&ns, old, b"hostname\n", T);
        assert!(gone.is_err(), "the deleted Service still answers: {gone:?}");
    });
}

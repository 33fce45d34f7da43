//! Lab tests of the agent's lifecycle (root): restarts and upgrades keep the
//! datapath and its flows, and a restarted agent reconciles what changed while
//! it was down. Run with `cargo xtask test`.
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddrV4, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use xtask::client::{self, reply_text};
use xtask::netns::in_netns;
use xtask::Lab;

mod support;
use support::T;

const SYNC_TIMEOUT: Duration = Duration::from_secs(20);

fn manifests() -> String {
    let mut y = String::from(
        "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  selector: {app: web}\n  ports:\n  - {name: http, protocol: TCP, port: 80, targetPort: 80}\n  - {name: udp, protocol: UDP, port: 80, targetPort: 80}\n",
    );
    for i in 1..=2 {
        y.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: web-{i}, labels: {{app: web}}}}\nspec: {{containers: [{{name: c, image: lab-server, ports: [{{containerPort: 80, protocol: TCP}}, {{containerPort: 80, protocol: UDP}}]}}]}}\n"
        ));
    }
    y
}

/// A long-lived connection through the frontend (the lab server's `stream`).
struct Stream {
    pod: String,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Stream {
    fn open(ns: &str, vip: SocketAddrV4) -> Stream {
        let s = in_netns(ns, move || TcpStream::connect_timeout(&vip.into(), T))
            .and_then(|r| r)
            .unwrap_or_else(|e| panic!("stream connect: {e}"));
        s.set_read_timeout(Some(T)).unwrap();
        let mut writer = s.try_clone().unwrap();
        writer.write_all(b"stream\n").unwrap();
        let mut reader = BufReader::new(s);
        let mut greeting = String::new();
        reader.read_line(&mut greeting).unwrap();
        let pod = greeting
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        Stream {
            pod,
            reader,
            writer,
        }
    }

    /// One exchange; the answer must come from the same pod.
    fn ping(&mut self, n: usize) -> Result<(), String> {
        self.writer
            .write_all(format!("ping {n}\n").as_bytes())
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        self.reader
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let expected = format!("{} ping {n}", self.pod);
        if line.trim_end() == expected {
            Ok(())
        } else {
            Err(format!("got {line:?}, expected {expected:?}"))
        }
    }
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
    let mut lab = Lab::builder()
        .manifests_yaml(&manifests())
        .server_bin(env!("CARGO_BIN_EXE_lab-server"))
        .agent_arg("--on-exit")
        .agent_arg("keep")
        .start()
        .expect("lab");
    lab.wait_ready(SYNC_TIMEOUT).expect("agent ready");
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
        lab.wait_ready(SYNC_TIMEOUT)
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
}

/// State is reconciled after a restart: a Service deleted while the agent was
/// down is removed (its ClusterIP refused), one added meanwhile works.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn restart_reconciles_changes_made_while_down() {
    let mut lab = Lab::builder()
        .manifests_yaml(&manifests())
        .server_bin(env!("CARGO_BIN_EXE_lab-server"))
        .agent_arg("--on-exit")
        .agent_arg("keep")
        .start()
        .expect("lab");
    lab.wait_ready(SYNC_TIMEOUT).expect("agent ready");
    let ns = lab.client().netns.clone();
    let old = lab.cluster_frontend("web", 80, "TCP").expect("frontend");
    assert!(client::tcp_request(&ns, old, b"hostname\n", T).is_ok());
    lab.stop_agent().expect("stop");
    lab.delete_service("web").expect("delete web");
    lab.apply("apiVersion: v1\nkind: Service\nmetadata: {name: web2}\nspec:\n  selector: {app: web}\n  ports:\n  - {protocol: TCP, port: 8080, targetPort: 80}\n")
        .expect("apply web2");
    lab.start_agent().expect("start");
    lab.wait_ready(SYNC_TIMEOUT).expect("ready");
    let new = lab
        .cluster_frontend("web2", 8080, "TCP")
        .expect("web2 frontend");
    let r = client::tcp_request(&ns, new, b"hostname\n", T).map(|r| reply_text(&r));
    assert!(matches!(&r, Ok(n) if n.starts_with("web-")), "web2: {r:?}");
    let gone = client::tcp_request(&ns, old, b"hostname\n", T);
    assert!(gone.is_err(), "the deleted Service still answers: {gone:?}");
}

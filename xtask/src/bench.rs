//! `cargo xtask bench`: this project side by side with kube-proxy's
//! iptables (legacy and nft backends) and nftables rule layouts, on the same
//! lab topology, in interleaved rounds.
//!
//! One lab per mode (a node namespace, E pods, a client). In the kube-proxy
//! modes no agent runs: kube-proxy's rules are loaded into the node
//! namespace, which routes the pods' traffic (DNAT in its PREROUTING). In
//! the `proxy-tc` mode the lab runs the agent, programmed through a
//! manifests file of Services and EndpointSlices. `none` dials a pod
//! directly: the floor.
//!
//! Per N: every mode is programmed from empty (timed), then one change is
//! applied a few times (timed, with the network-programming latency to the
//! first successful connection), then the latency, rate and throughput
//! cells run in rounds that interleave the modes. Medians over rounds are
//! reported, absolute and as ratios to iptables-legacy and to the floor.

pub mod layouts;
pub mod load;
pub mod report;
pub mod sys;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;

use crate::lab::Lab;
use crate::netns::in_netns;
use crate::setup;
use layouts::{service_entries, vip, Entry, PORT, TPORT};
use load::Servers;
use sys::Timed;

/// `cargo xtask bench` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Quick mode: N ∈ {1, 1000}, fewer samples, two rounds.
    #[arg(long)]
    pub quick: bool,
    /// Service counts (default: 1,100,1000,10000,50000; quick: 1,1000).
    #[arg(long, value_delimiter = ',')]
    pub n: Vec<usize>,
    /// Endpoints per service.
    #[arg(long, default_value_t = 2)]
    pub endpoints: usize,
    /// Output directory (default: target/bench/<unix time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Modes to run (default all): none, iptables-legacy, iptables-nft, nftables, proxy-tc.
    #[arg(long, value_delimiter = ',')]
    pub modes: Vec<String>,
    /// Connections per latency cell.
    #[arg(long)]
    pub samples: Option<usize>,
    /// Rounds (modes interleaved in each).
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Cap of one single nft transaction loading all N services, seconds.
    #[arg(long)]
    pub nft_cap: Option<u64>,
    /// The proxy-agent binary (default: target/release/proxy-agent if built, else debug).
    #[arg(long, env = "KPR_BENCH_AGENT_BIN")]
    pub agent_bin: Option<PathBuf>,
}

/// A mode of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Mode {
    None,
    IptablesLegacy,
    IptablesNft,
    Nftables,
    ProxyTc,
}

impl Mode {
    pub const ALL: [Mode; 5] = [
        Mode::None,
        Mode::IptablesLegacy,
        Mode::IptablesNft,
        Mode::Nftables,
        Mode::ProxyTc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::IptablesLegacy => "iptables-legacy",
            Mode::IptablesNft => "iptables-nft",
            Mode::Nftables => "nftables",
            Mode::ProxyTc => "proxy-tc",
        }
    }

    pub fn parse(s: &str) -> Result<Mode> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| anyhow!("unknown mode {s:?}"))
    }

    fn restore_bin(self) -> Option<&'static str> {
        match self {
            Mode::IptablesLegacy => Some("iptables-legacy-restore"),
            Mode::IptablesNft => Some("iptables-nft-restore"),
            _ => None,
        }
    }
}

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub ns: Vec<usize>,
    pub endpoints: usize,
    pub modes: Vec<Mode>,
    pub samples: usize,
    pub rr_samples: usize,
    pub rate_threads: usize,
    pub rate_duration: Duration,
    pub bulk_duration: Duration,
    pub rounds: usize,
    pub changes: usize,
    pub nft_chunk: usize,
    /// Cap of the single nft transaction; None: not measured.
    pub nft_cap: Option<Duration>,
    /// Redo a cell whose steal time exceeds this (percent), up to twice.
    pub max_steal_pct: f64,
    /// Redo a cell when other processes used more than this share of the CPUs.
    pub max_other_pct: f64,
    pub agent_bin: Option<PathBuf>,
    pub out: Option<PathBuf>,
    pub quick: bool,
}

impl Config {
    pub fn from_args(a: &BenchArgs) -> Result<Config> {
        let full = !a.quick;
        let modes = if a.modes.is_empty() {
            Mode::ALL.to_vec()
        } else {
            a.modes
                .iter()
                .map(|m| Mode::parse(m))
                .collect::<Result<_>>()?
        };
        Ok(Config {
            ns: if !a.n.is_empty() {
                a.n.clone()
            } else if full {
                vec![1, 100, 1000, 10_000, 50_000]
            } else {
                vec![1, 1000]
            },
            endpoints: a.endpoints.clamp(1, 8),
            modes,
            samples: a.samples.unwrap_or(if full { 3000 } else { 2000 }),
            rr_samples: if full { 3000 } else { 2000 },
            rate_threads: 4,
            rate_duration: Duration::from_millis(if full { 1000 } else { 500 }),
            bulk_duration: Duration::from_millis(if full { 1000 } else { 500 }),
            rounds: a.rounds.unwrap_or(2).max(1),
            changes: if full { 5 } else { 3 },
            nft_chunk: 1000,
            nft_cap: Some(Duration::from_secs(a.nft_cap.unwrap_or(if full {
                30
            } else {
                20
            }))),
            max_steal_pct: 2.0,
            max_other_pct: 10.0,
            agent_bin: a.agent_bin.clone(),
            out: a.out.clone(),
            quick: a.quick,
        })
    }

    /// The sanity test's configuration: every mode, N = 1 and 100, few
    /// samples, one round.
    pub fn sanity() -> Config {
        Config {
            ns: vec![1, 100],
            endpoints: 2,
            modes: Mode::ALL.to_vec(),
            samples: 400,
            rr_samples: 200,
            rate_threads: 2,
            rate_duration: Duration::from_millis(200),
            bulk_duration: Duration::from_millis(200),
            rounds: 1,
            changes: 1,
            nft_chunk: 1000,
            nft_cap: None,
            max_steal_pct: 100.0,
            max_other_pct: 100.0,
            agent_bin: std::env::var_os("KPR_AGENT_BIN").map(PathBuf::from),
            out: None,
            quick: true,
        }
    }
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn catch_interrupts() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic.
        let _ = unsafe { sigaction(sig, &action) };
    }
}

fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

fn log(msg: impl AsRef<str>) {
    eprintln!("[bench] {}", msg.as_ref());
}

// ------------------------------------------------------------------ results

/// One measured cell (medians over rounds where it says so).
#[derive(Debug, Clone, Serialize, Default)]
pub struct ConnStats {
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub ok: usize,
    pub failed: usize,
    pub backends: BTreeMap<usize, usize>,
    pub wrong_client_ip: usize,
    pub wrong_peer: usize,
    pub steal_pct: f64,
    /// CPU share other processes used during the cell (max over rounds).
    pub other_pct: f64,
    pub redone: usize,
    pub first_error: Option<String>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct RrStats {
    pub p50_us: f64,
    pub p99_us: f64,
    pub ok: usize,
    pub failed: usize,
    pub first_error: Option<String>,
}

/// Programming measurements of one mode at one N.
#[derive(Debug, Clone, Serialize, Default)]
pub struct ProgStats {
    /// Time to program N services from empty (nftables: in chunks).
    pub from_empty_s: Option<f64>,
    /// nftables only: one transaction for all N (None if not measured).
    pub single_tx_s: Option<f64>,
    /// The single transaction hit the cap (`single_tx_s` is the cap).
    pub single_tx_capped: bool,
    /// One change at N (median), ms.
    pub change_ms: Option<f64>,
    pub change_all_ms: Vec<f64>,
    /// Change issued -> first successful connection (median), ms.
    pub npl_ms: Option<f64>,
    pub npl_all_ms: Vec<Option<f64>>,
    /// Δ(SUnreclaim + VmallocUsed + Percpu) over the load, bytes.
    pub kernel_mem_delta: Option<i64>,
    /// proxy-tc: bytes_memlock of its pinned maps.
    pub bpf_memlock: Option<u64>,
    /// proxy-tc: agent VmRSS after the load.
    pub agent_rss: Option<u64>,
    pub note: Option<String>,
}

/// Everything measured for one mode at one N.
#[derive(Debug, Clone, Serialize, Default)]
pub struct ModeResult {
    pub prog: ProgStats,
    /// Connection latency per target position (medians over rounds).
    pub conn: BTreeMap<String, ConnStats>,
    pub conn_rate: Option<f64>,
    pub conn_rate_failed: usize,
    pub tcp_rr: Option<RrStats>,
    pub udp_rr: Option<RrStats>,
    pub bulk_bps: Option<f64>,
    /// The harness's own checks.
    pub checks: Vec<Check>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

/// One N.
#[derive(Debug, Clone, Serialize)]
pub struct NResult {
    pub n: usize,
    /// Target service indices per position.
    pub positions: BTreeMap<String, usize>,
    pub modes: BTreeMap<String, ModeResult>,
}

/// A whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Results {
    pub machine: BTreeMap<String, String>,
    pub config: BTreeMap<String, String>,
    pub results: Vec<NResult>,
}

impl Results {
    /// Every failed check, as `N=<n> <mode>: <check>: <detail>`.
    pub fn failed_checks(&self) -> Vec<String> {
        let mut v = Vec::new();
        for r in &self.results {
            for (m, mr) in &r.modes {
                for c in &mr.checks {
                    if !c.ok {
                        v.push(format!("N={} {m}: {}: {}", r.n, c.name, c.detail));
                    }
                }
            }
        }
        v
    }
}

// ---------------------------------------------------------------- mode labs

struct ModeLab {
    mode: Mode,
    lab: Lab,
    servers: Option<Servers>,
    node_ns: String,
    client_ns: String,
    client_ip: Ipv4Addr,
    pod_ips: Vec<Ipv4Addr>,
    /// Entries programmed now.
    entries: Vec<Entry>,
    bench_files: Vec<PathBuf>,
}

fn pods_yaml(e: usize) -> String {
    let mut y = String::new();
    for i in 0..e {
        y.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: bench-{i}\n  labels:\n    app: bench\nspec:\n  containers:\n  - name: c\n    image: lab-server\n"
        ));
    }
    y
}

fn agent_bin(cfg: &Config) -> Result<PathBuf> {
    if let Some(p) = &cfg.agent_bin {
        return Ok(p.clone());
    }
    // The release agent, brought up to date (a no-op when it is).
    setup::build_agent()
}

impl ModeLab {
    fn start(mode: Mode, cfg: &Config) -> Result<ModeLab> {
        let with_agent = mode == Mode::ProxyTc;
        let mut b = Lab::builder()
            .manifests_yaml(&pods_yaml(cfg.endpoints))
            .agent(with_agent);
        if with_agent {
            b = b.agent_bin(agent_bin(cfg)?).rust_log("info");
        }
        let mut lab = b.start()?;
        if with_agent {
            lab.wait_ready(Duration::from_secs(60))?;
            lab.wait_attached(Duration::from_secs(30))?;
        }
        let mut pods: Vec<(String, Ipv4Addr, String)> = lab
            .pods()
            .iter()
            .filter(|p| !p.host_if.is_empty())
            .map(|p| (p.name.clone(), p.ip, p.netns.clone()))
            .collect();
        pods.sort();
        // A wide ephemeral range in the client: fewer reuses of a 4-tuple
        // whose previous connection is still in TIME_WAIT at the pod.
        crate::netns::sysctl_in(
            &lab.client().netns,
            "net.ipv4.ip_local_port_range",
            "1024 65535",
        )?;
        if pods.len() != cfg.endpoints {
            bail!("lab has {} pods, wanted {}", pods.len(), cfg.endpoints);
        }
        let servers = Servers::start(
            &pods
                .iter()
                .enumerate()
                .map(|(i, p)| (p.2.clone(), i))
                .collect::<Vec<_>>(),
        )?;
        Ok(ModeLab {
            mode,
            node_ns: lab.node().netns.clone(),
            client_ns: lab.client().netns.clone(),
            client_ip: lab.client().ip,
            pod_ips: pods.iter().map(|p| p.1).collect(),
            lab,
            servers: Some(servers),
            entries: Vec::new(),
            bench_files: Vec::new(),
        })
    }

    fn down(mut self) -> Result<()> {
        if let Some(s) = self.servers.take() {
            s.stop();
        }
        self.lab.down()
    }

    /// Forgets kernel conntrack (node namespace) and the agent's LRU
    /// conntrack, so every cell starts cold.
    fn reset_state(&self) -> Result<()> {
        let r = in_netns(&self.node_ns, sys::flush_conntrack_here)?;
        if let Err(e) = r {
            // No conntrack in this namespace (no rules loaded): nothing to flush.
            if self.mode != Mode::None && self.mode != Mode::ProxyTc {
                bail!("conntrack flush in {}: {e}", self.node_ns);
            }
        }
        if self.mode == Mode::ProxyTc {
            let ct = self.lab.info().bpffs.join(proxy_ct_map());
            if ct.exists() {
                sys::clear_pinned_map(&ct).with_context(|| format!("clear {}", ct.display()))?;
            }
        }
        Ok(())
    }

    fn agent_log_len(&self) -> u64 {
        std::fs::metadata(self.lab.agent_log_path())
            .map(|m| m.len())
            .unwrap_or(0)
    }

    /// Waits for a `sync complete` line after byte `offset` of the agent's
    /// log reporting `frontends` frontends; returns when it was seen.
    fn wait_frontends(
        &mut self,
        offset: u64,
        frontends: usize,
        t0: Instant,
        timeout: Duration,
    ) -> Result<Duration> {
        let path = self.lab.agent_log_path();
        let mut last = None;
        loop {
            let mut text = String::new();
            if let Ok(mut f) = std::fs::File::open(&path) {
                let _ = f.seek(SeekFrom::Start(offset));
                let _ = f.read_to_string(&mut text);
            }
            for l in text.lines().filter(|l| l.contains(crate::lab::SYNC_MARKER)) {
                let n = l
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("frontends="))
                    .and_then(|v| {
                        v.trim_matches(|c: char| !c.is_ascii_digit())
                            .parse::<usize>()
                            .ok()
                    });
                if n == Some(frontends) {
                    return Ok(t0.elapsed());
                }
                last = n.or(last);
            }
            if !self.lab.agent_running() {
                bail!(
                    "the agent exited; log tail:\n{}",
                    tail_str(&self.lab.agent_log(), 20)
                );
            }
            if t0.elapsed() > timeout {
                bail!(
                    "no sync with {frontends} frontends within {timeout:?} (last seen: {last:?}); log tail:\n{}",
                    tail_str(&self.lab.agent_log(), 10)
                );
            }
            check_interrupted()?;
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn remove_bench_files(&mut self) -> Result<bool> {
        let mut removed = false;
        for f in self.bench_files.drain(..) {
            if f.exists() {
                std::fs::remove_file(&f)?;
                removed = true;
            }
        }
        Ok(removed)
    }

    fn write_bench_file(&mut self, name: &str, text: &str) -> Result<()> {
        let dir = self.lab.info().manifests_dir.clone();
        let tmp = dir.join(format!(".{name}.tmp"));
        let path = dir.join(name);
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &path)?;
        self.bench_files.push(path);
        Ok(())
    }
}

fn proxy_ct_map() -> &'static str {
    "CT4_V1"
}

fn tail_str(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    Some(v[v.len() / 2])
}

fn entries_for(n: usize, targets: &BTreeSet<usize>, pod_ips: &[Ipv4Addr], e: usize) -> Vec<Entry> {
    let dummies: Vec<Ipv4Addr> = (0..e).map(layouts::dummy_ep).collect();
    let mut v = Vec::with_capacity(n + targets.len());
    for i in 0..n {
        if targets.contains(&i) {
            v.extend(service_entries(i, pod_ips, true));
        } else {
            v.extend(service_entries(i, &dummies, false));
        }
    }
    v
}

// -------------------------------------------------------------- programming

fn program(
    ml: &mut ModeLab,
    n: usize,
    targets: &BTreeSet<usize>,
    cfg: &Config,
) -> Result<ProgStats> {
    let mut p = ProgStats::default();
    if ml.mode == Mode::None {
        return Ok(p);
    }
    let entries = entries_for(n, targets, &ml.pod_ips, cfg.endpoints);
    let node = ml.node_ns.clone();
    let settle = Duration::from_millis(300);
    match ml.mode {
        Mode::IptablesLegacy | Mode::IptablesNft => {
            let bin = ml.mode.restore_bin().expect("iptables mode");
            sys::exec_in_timed(&node, bin, &[], layouts::IPT_EMPTY)?;
            std::thread::sleep(settle);
            let m0 = sys::kernel_mem_bytes();
            let text = layouts::ipt_full(&entries);
            let d = sys::exec_in_timed(&node, bin, &[], &text)?;
            drop(text);
            std::thread::sleep(settle);
            p.kernel_mem_delta = Some(sys::kernel_mem_bytes() as i64 - m0 as i64);
            p.from_empty_s = Some(d.as_secs_f64());
        }
        Mode::Nftables => {
            let _ = sys::exec_in(
                &node,
                "nft",
                &["-f", "/dev/stdin"],
                "delete table ip kube-proxy\n",
                None,
            );
            if let Some(cap) = cfg.nft_cap {
                let text = layouts::nft_chunks(&entries, 0).remove(0);
                log(format!(
                    "nftables N={n}: one transaction, capped at {cap:?}"
                ));
                match sys::exec_in(&node, "nft", &["-f", "/dev/stdin"], &text, Some(cap))? {
                    Timed::Done(d) => p.single_tx_s = Some(d.as_secs_f64()),
                    Timed::Capped(_) => {
                        p.single_tx_s = Some(cap.as_secs_f64());
                        p.single_tx_capped = true;
                    }
                }
                let _ = sys::exec_in(
                    &node,
                    "nft",
                    &["-f", "/dev/stdin"],
                    "delete table ip kube-proxy\n",
                    None,
                );
            }
            std::thread::sleep(settle);
            let m0 = sys::kernel_mem_bytes();
            let mut total = Duration::ZERO;
            for chunk in layouts::nft_chunks(&entries, cfg.nft_chunk) {
                check_interrupted()?;
                total += sys::exec_in_timed(&node, "nft", &["-f", "/dev/stdin"], &chunk)?;
            }
            std::thread::sleep(settle);
            p.kernel_mem_delta = Some(sys::kernel_mem_bytes() as i64 - m0 as i64);
            p.from_empty_s = Some(total.as_secs_f64());
        }
        Mode::ProxyTc => {
            if ml.remove_bench_files()? {
                let off = ml.agent_log_len();
                ml.wait_frontends(
                    off.saturating_sub(0),
                    0,
                    Instant::now(),
                    Duration::from_secs(300),
                )
                .or_else(|_| -> Result<Duration> { Ok(Duration::ZERO) })?;
            }
            let text = layouts::manifests(&entries);
            std::thread::sleep(settle);
            let m0 = sys::kernel_mem_bytes();
            let off = ml.agent_log_len();
            let t0 = Instant::now();
            ml.write_bench_file("zz-bench.yaml", &text)?;
            drop(text);
            let d = ml.wait_frontends(off, entries.len(), t0, Duration::from_secs(600))?;
            p.from_empty_s = Some(d.as_secs_f64());
            std::thread::sleep(settle);
            p.kernel_mem_delta = Some(sys::kernel_mem_bytes() as i64 - m0 as i64);
            p.bpf_memlock = sys::pinned_maps_memlock(&ml.lab.info().bpffs).ok();
            p.agent_rss = ml
                .lab
                .info()
                .node
                .agent
                .as_ref()
                .and_then(|a| sys::rss_bytes(a.pid));
        }
        Mode::None => {}
    }
    ml.entries = entries;

    // One change at N: add service n+k (real endpoints), a few times.
    for k in 0..cfg.changes {
        check_interrupted()?;
        std::thread::sleep(Duration::from_millis(150));
        let new = service_entries(n + k, &ml.pod_ips, false);
        let target = SocketAddrV4::new(vip(n + k), PORT);
        let (change, npl) = match ml.mode {
            Mode::IptablesLegacy | Mode::IptablesNft => {
                let bin = ml.mode.restore_bin().expect("iptables mode");
                let text = layouts::ipt_partial_add(&ml.entries, &new);
                let t0 = Instant::now();
                let poll = npl_poller(&ml.client_ns, target, t0);
                let d = sys::exec_in_timed(&node, bin, &["--noflush"], &text)?;
                (d, join_npl(poll))
            }
            Mode::Nftables => {
                let text = layouts::nft_add(&new);
                let t0 = Instant::now();
                let poll = npl_poller(&ml.client_ns, target, t0);
                let d = sys::exec_in_timed(&node, "nft", &["-f", "/dev/stdin"], &text)?;
                (d, join_npl(poll))
            }
            Mode::ProxyTc => {
                let text = layouts::manifests(&new);
                let off = ml.agent_log_len();
                let t0 = Instant::now();
                let poll = npl_poller(&ml.client_ns, target, t0);
                ml.write_bench_file(&format!("zz-bench-change-{k}.yaml"), &text)?;
                let d = ml.wait_frontends(
                    off,
                    ml.entries.len() + new.len(),
                    t0,
                    Duration::from_secs(300),
                )?;
                (d, join_npl(poll))
            }
            Mode::None => unreachable!(),
        };
        ml.entries.extend(new);
        p.change_all_ms.push(change.as_secs_f64() * 1e3);
        p.npl_all_ms.push(npl.map(|d| d.as_secs_f64() * 1e3));
    }
    p.change_ms = median(&mut p.change_all_ms.clone());
    p.npl_ms = median(&mut p.npl_all_ms.iter().flatten().copied().collect::<Vec<_>>());
    if ml.mode == Mode::ProxyTc {
        p.agent_rss = p.agent_rss.max(
            ml.lab
                .info()
                .node
                .agent
                .as_ref()
                .and_then(|a| sys::rss_bytes(a.pid)),
        );
    }
    Ok(p)
}

fn npl_poller(
    ns: &str,
    target: SocketAddrV4,
    t0: Instant,
) -> std::thread::JoinHandle<Option<Duration>> {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        load::first_success(&ns, target, t0, Duration::from_secs(120))
            .ok()
            .flatten()
    })
}

fn join_npl(h: std::thread::JoinHandle<Option<Duration>>) -> Option<Duration> {
    h.join().ok().flatten()
}

// ---------------------------------------------------------------- measuring

fn us(h: &hdrhistogram::Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1e3
}

/// Runs `f` after resetting state; redoes it (once) when steal time
/// or other processes' CPU time during it exceeded the limits. Returns the
/// result, its noise (steal %, others' CPU %) and the number of redos.
fn cell<T>(
    ml: &ModeLab,
    cfg: &Config,
    mut f: impl FnMut() -> Result<T>,
) -> Result<(T, (f64, f64), usize)> {
    let mut redone = 0;
    let pids: Vec<u32> = ml.lab.info().node.agent.iter().map(|a| a.pid).collect();
    loop {
        check_interrupted()?;
        ml.reset_state()?;
        let a = sys::jiffies(&pids);
        let r = f()?;
        let (steal, other) = sys::noise(a, sys::jiffies(&pids));
        if (steal <= cfg.max_steal_pct && other <= cfg.max_other_pct) || redone >= 1 {
            return Ok((r, (steal, other), redone));
        }
        redone += 1;
        log(format!(
            "{}: noisy cell (steal {steal:.1}%, other processes {other:.1}% of the CPUs): redoing it",
            ml.mode.name()
        ));
    }
}

struct RoundData {
    conn: BTreeMap<String, Vec<ConnStats>>,
    rate: Vec<(f64, usize)>,
    tcp_rr: Vec<RrStats>,
    udp_rr: Vec<RrStats>,
    bulk: Vec<f64>,
}

fn targets_for(ml: &ModeLab, index: usize) -> Vec<SocketAddrV4> {
    if ml.mode == Mode::None {
        ml.pod_ips
            .iter()
            .map(|ip| SocketAddrV4::new(*ip, TPORT))
            .collect()
    } else {
        vec![SocketAddrV4::new(vip(index), PORT)]
    }
}

fn measure_round(
    ml: &ModeLab,
    positions: &BTreeMap<String, usize>,
    main_pos: &str,
    cfg: &Config,
    data: &mut RoundData,
) -> Result<()> {
    let pos_list: Vec<(String, usize)> = if ml.mode == Mode::None {
        vec![("direct".to_string(), 0)]
    } else {
        positions.iter().map(|(k, v)| (k.clone(), *v)).collect()
    };
    for (pos, index) in &pos_list {
        let targets = targets_for(ml, *index);
        let (c, (steal, other), redone) = cell(ml, cfg, || {
            load::conn_latency(&ml.client_ns, targets.clone(), cfg.samples, ml.client_ip)
        })?;
        data.conn.entry(pos.clone()).or_default().push(ConnStats {
            p50_us: us(&c.hist, 0.5),
            p99_us: us(&c.hist, 0.99),
            p999_us: us(&c.hist, 0.999),
            ok: c.ok,
            failed: c.failed,
            backends: c.backends,
            wrong_client_ip: c.wrong_client_ip,
            wrong_peer: c.wrong_peer,
            steal_pct: steal,
            other_pct: other,
            redone,
            first_error: c.first_error,
        });
    }
    let index = if ml.mode == Mode::None {
        0
    } else {
        positions[main_pos]
    };
    let targets = targets_for(ml, index);
    let (r, _, _) = cell(ml, cfg, || {
        load::conn_rate(
            &ml.client_ns,
            targets.clone(),
            cfg.rate_threads,
            cfg.rate_duration,
        )
    })?;
    data.rate.push((r.0, r.1));
    let (t, _, _) = cell(ml, cfg, || {
        load::tcp_rr(&ml.client_ns, targets[0], cfg.rr_samples)
    })?;
    data.tcp_rr.push(RrStats {
        p50_us: us(&t.hist, 0.5),
        p99_us: us(&t.hist, 0.99),
        ok: t.ok,
        failed: t.failed,
        first_error: t.first_error,
    });
    let (u, _, _) = cell(ml, cfg, || {
        load::udp_rr(&ml.client_ns, targets[0], cfg.rr_samples)
    })?;
    data.udp_rr.push(RrStats {
        p50_us: us(&u.hist, 0.5),
        p99_us: us(&u.hist, 0.99),
        ok: u.ok,
        failed: u.failed,
        first_error: u.first_error,
    });
    let (b, _, _) = cell(ml, cfg, || {
        load::bulk(&ml.client_ns, targets[0], cfg.bulk_duration)
    })?;
    data.bulk.push(b);
    Ok(())
}

fn merge_conn(v: &[ConnStats]) -> ConnStats {
    let mut out = ConnStats {
        p50_us: median(&mut v.iter().map(|c| c.p50_us).collect::<Vec<_>>()).unwrap_or(0.0),
        p99_us: median(&mut v.iter().map(|c| c.p99_us).collect::<Vec<_>>()).unwrap_or(0.0),
        p999_us: median(&mut v.iter().map(|c| c.p999_us).collect::<Vec<_>>()).unwrap_or(0.0),
        ..Default::default()
    };
    for c in v {
        out.ok += c.ok;
        out.failed += c.failed;
        out.wrong_client_ip += c.wrong_client_ip;
        out.wrong_peer += c.wrong_peer;
        out.steal_pct = out.steal_pct.max(c.steal_pct);
        out.other_pct = out.other_pct.max(c.other_pct);
        out.redone += c.redone;
        for (k, n) in &c.backends {
            *out.backends.entry(*k).or_default() += n;
        }
        if out.first_error.is_none() {
            out.first_error = c.first_error.clone();
        }
    }
    out
}

fn merge_rr(v: &[RrStats]) -> RrStats {
    let mut out = RrStats {
        p50_us: median(&mut v.iter().map(|c| c.p50_us).collect::<Vec<_>>()).unwrap_or(0.0),
        p99_us: median(&mut v.iter().map(|c| c.p99_us).collect::<Vec<_>>()).unwrap_or(0.0),
        ..Default::default()
    };
    for c in v {
        out.ok += c.ok;
        out.failed += c.failed;
        if out.first_error.is_none() {
            out.first_error = c.first_error.clone();
        }
    }
    out
}

fn checks(mr: &ModeResult, endpoints: usize) -> Vec<Check> {
    let mut v = Vec::new();
    let total_ok: usize = mr.conn.values().map(|c| c.ok).sum();
    v.push(Check {
        name: "delivers traffic".into(),
        ok: total_ok > 0
            && mr.conn.values().all(|c| c.ok > 0)
            && mr.tcp_rr.as_ref().is_some_and(|r| r.ok > 0)
            && mr.udp_rr.as_ref().is_some_and(|r| r.ok > 0)
            && mr.bulk_bps.is_some_and(|b| b > 0.0),
        detail: format!("{total_ok} connections answered"),
    });
    let drops: usize = mr.conn.values().map(|c| c.failed).sum::<usize>()
        + mr.conn_rate_failed
        + mr.tcp_rr.as_ref().map_or(0, |r| r.failed)
        + mr.udp_rr.as_ref().map_or(0, |r| r.failed);
    let first = mr
        .conn
        .values()
        .find_map(|c| c.first_error.clone())
        .or_else(|| mr.udp_rr.as_ref().and_then(|r| r.first_error.clone()))
        .or_else(|| mr.tcp_rr.as_ref().and_then(|r| r.first_error.clone()));
    v.push(Check {
        name: "no drops".into(),
        ok: drops == 0,
        detail: format!(
            "{drops} failed exchanges{}",
            first.map(|e| format!(" (first: {e})")).unwrap_or_default()
        ),
    });
    let mut spread_ok = true;
    let mut detail = Vec::new();
    for (pos, c) in &mr.conn {
        let fair = c.ok as f64 / endpoints as f64;
        for b in 0..endpoints {
            let got = c.backends.get(&b).copied().unwrap_or(0) as f64;
            // Within ±50% of a fair share once there are enough samples;
            // every backend reached at all otherwise.
            let ok = if fair >= 100.0 {
                (got - fair).abs() <= fair * 0.5
            } else {
                got > 0.0
            };
            spread_ok &= ok;
        }
        detail.push(format!("{pos}: {:?}", c.backends));
    }
    v.push(Check {
        name: "spread over backends".into(),
        ok: spread_ok,
        detail: detail.join("; "),
    });
    let wrong_peer: usize = mr.conn.values().map(|c| c.wrong_peer).sum();
    let wrong_ip: usize = mr.conn.values().map(|c| c.wrong_client_ip).sum();
    v.push(Check {
        name: "replies from the VIP".into(),
        ok: wrong_peer == 0 && mr.udp_rr.as_ref().is_some_and(|r| r.ok > 0),
        detail: format!("{wrong_peer} TCP peers differ from the dialled address; UDP replies on a connected socket: {}", mr.udp_rr.as_ref().map_or(0, |r| r.ok)),
    });
    v.push(Check {
        name: "client address kept".into(),
        ok: wrong_ip == 0,
        detail: format!("{wrong_ip} replies saw another client address"),
    });
    v
}

// ---------------------------------------------------------------------- run

fn machine() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert("nproc".into(), sys::ncpus().to_string());
    let uname = std::process::Command::new("uname").arg("-r").output();
    if let Ok(o) = uname {
        m.insert(
            "kernel".into(),
            String::from_utf8_lossy(&o.stdout).trim().to_string(),
        );
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default();
    m.insert("cpu".into(), cpu);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("").to_string())
        })
        .unwrap_or_default();
    m.insert("mem_kib".into(), mem);
    m.insert(
        "loadavg_at_start".into(),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
            .to_string(),
    );
    for (k, cmd) in [("iptables", "iptables-legacy"), ("nft", "nft")] {
        if let Ok(o) = std::process::Command::new(cmd).arg("--version").output() {
            m.insert(
                k.into(),
                String::from_utf8_lossy(&o.stdout).trim().to_string(),
            );
        }
    }
    m
}

fn random_index(lo: usize, hi: usize, avoid: &BTreeSet<usize>) -> usize {
    let r = u64::from_le_bytes(crate::netns::random_bytes::<8>());
    let span = hi - lo + 1;
    for k in 0..span as u64 {
        let i = lo + ((r + k) % span as u64) as usize;
        if !avoid.contains(&i) {
            return i;
        }
    }
    lo
}

/// Runs the benchmark with `cfg`; returns the results (also written when
/// `cfg.out` is set).
pub fn run_config(cfg: &Config) -> Result<Results> {
    if !setup::is_root() {
        bail!("the benchmark needs root: it creates network namespaces, loads rules and eBPF programs");
    }
    for m in &cfg.modes {
        let need = match m {
            Mode::IptablesLegacy => Some("iptables-legacy-restore"),
            Mode::IptablesNft => Some("iptables-nft-restore"),
            Mode::Nftables => Some("nft"),
            _ => None,
        };
        if let Some(bin) = need {
            if std::process::Command::new(bin)
                .arg("--version")
                .output()
                .is_err()
            {
                bail!("{bin} is missing: run `cargo xtask setup`");
            }
        }
    }
    let mut results = Results {
        machine: machine(),
        config: BTreeMap::new(),
        results: Vec::new(),
    };
    let agent = if cfg.modes.contains(&Mode::ProxyTc) {
        Some(agent_bin(cfg)?)
    } else {
        None
    };
    for (k, v) in [
        ("n", format!("{:?}", cfg.ns)),
        ("endpoints", cfg.endpoints.to_string()),
        ("samples", cfg.samples.to_string()),
        ("rr_samples", cfg.rr_samples.to_string()),
        ("rounds", cfg.rounds.to_string()),
        ("changes", cfg.changes.to_string()),
        ("rate_threads", cfg.rate_threads.to_string()),
        (
            "rate_duration_ms",
            cfg.rate_duration.as_millis().to_string(),
        ),
        (
            "bulk_duration_ms",
            cfg.bulk_duration.as_millis().to_string(),
        ),
        ("nft_chunk", cfg.nft_chunk.to_string()),
        (
            "nft_cap_s",
            cfg.nft_cap
                .map_or("not measured".into(), |c| c.as_secs().to_string()),
        ),
        (
            "agent_bin",
            agent
                .as_ref()
                .map_or("-".into(), |p| p.display().to_string()),
        ),
        ("quick", cfg.quick.to_string()),
    ] {
        results.config.insert(k.into(), v);
    }
    let mut cfg = cfg.clone();
    cfg.agent_bin = agent;

    let mut labs: Vec<ModeLab> = Vec::new();
    let outcome = (|| -> Result<()> {
        for m in &cfg.modes {
            check_interrupted()?;
            log(format!("starting the lab of {}", m.name()));
            labs.push(ModeLab::start(*m, &cfg)?);
        }
        for &n in &cfg.ns {
            let n_res = run_n(&mut labs, n, &cfg)?;
            results.results.push(n_res);
            if let Some(out) = &cfg.out {
                report::write(out, &results)?;
            }
        }
        Ok(())
    })();
    let mut teardown_errors = Vec::new();
    for ml in labs {
        if let Err(e) = ml.down() {
            teardown_errors.push(format!("{e:#}"));
        }
    }
    outcome?;
    if !teardown_errors.is_empty() {
        bail!("teardown: {}", teardown_errors.join("; "));
    }
    Ok(results)
}

fn run_n(labs: &mut [ModeLab], n: usize, cfg: &Config) -> Result<NResult> {
    let mut positions = BTreeMap::new();
    if n <= 1 {
        positions.insert("all".to_string(), 0);
    } else {
        positions.insert("first".to_string(), 0);
        positions.insert("middle".to_string(), n / 2);
        positions.insert("last".to_string(), n - 1);
        if n >= 4 {
            let avoid: BTreeSet<usize> = positions.values().copied().collect();
            positions.insert("random".to_string(), random_index(1, n - 2, &avoid));
        }
    }
    let main_pos = if n <= 1 { "all" } else { "middle" };
    let targets: BTreeSet<usize> = positions.values().copied().collect();
    let mut out = NResult {
        n,
        positions: positions.clone(),
        modes: BTreeMap::new(),
    };
    let mut progs = BTreeMap::new();
    for ml in labs.iter_mut() {
        check_interrupted()?;
        log(format!("N={n}: programming {}", ml.mode.name()));
        let p = program(ml, n, &targets, cfg)
            .with_context(|| format!("programming {} at N={n}", ml.mode.name()))?;
        log(format!(
            "N={n} {}: from empty {:?} s, single tx {:?}{}, change {:?} ms, npl {:?} ms",
            ml.mode.name(),
            p.from_empty_s,
            p.single_tx_s,
            if p.single_tx_capped { " (capped)" } else { "" },
            p.change_ms,
            p.npl_ms
        ));
        progs.insert(ml.mode, p);
    }
    let mut data: BTreeMap<Mode, RoundData> = BTreeMap::new();
    for r in 0..cfg.rounds {
        let k = labs.len();
        for j in 0..k {
            let ml = &labs[(j + r) % k];
            log(format!(
                "N={n} round {}/{}: {}",
                r + 1,
                cfg.rounds,
                ml.mode.name()
            ));
            let d = data.entry(ml.mode).or_insert_with(|| RoundData {
                conn: BTreeMap::new(),
                rate: Vec::new(),
                tcp_rr: Vec::new(),
                udp_rr: Vec::new(),
                bulk: Vec::new(),
            });
            measure_round(ml, &positions, main_pos, cfg, d)?;
        }
    }
    for ml in labs.iter() {
        let d = &data[&ml.mode];
        let mut mr = ModeResult {
            prog: progs.remove(&ml.mode).unwrap_or_default(),
            conn: d
                .conn
                .iter()
                .map(|(k, v)| (k.clone(), merge_conn(v)))
                .collect(),
            conn_rate: median(&mut d.rate.iter().map(|r| r.0).collect::<Vec<_>>()),
            conn_rate_failed: d.rate.iter().map(|r| r.1).sum(),
            tcp_rr: Some(merge_rr(&d.tcp_rr)),
            udp_rr: Some(merge_rr(&d.udp_rr)),
            bulk_bps: median(&mut d.bulk.clone()),
            checks: Vec::new(),
        };
        mr.checks = checks(&mr, cfg.endpoints);
        for c in mr.checks.iter().filter(|c| !c.ok) {
            log(format!(
                "N={n} {}: check failed: {}: {}",
                ml.mode.name(),
                c.name,
                c.detail
            ));
        }
        out.modes.insert(ml.mode.name().to_string(), mr);
    }
    Ok(out)
}

/// `cargo xtask bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    catch_interrupts();
    let mut cfg = Config::from_args(&args)?;
    let out = cfg.out.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        setup::target_dir().join("bench").join(t.to_string())
    });
    std::fs::create_dir_all(&out)?;
    cfg.out = Some(out.clone());
    let cmdline: Vec<String> = std::env::args().skip(1).collect();
    log(format!("writing to {}", out.display()));
    let mut results = run_config(&cfg)?;
    results.config.insert(
        "command".into(),
        format!("cargo xtask {}", cmdline.join(" ")),
    );
    report::write(&out, &results)?;
    println!("{}", report::markdown(&results));
    println!("results: {}", out.display());
    let failed = results.failed_checks();
    if !failed.is_empty() {
        bail!("harness checks failed:\n{}", failed.join("\n"));
    }
    Ok(())
}

/// Where `path` is relative to the workspace, for messages.
pub fn display_rel(path: &Path) -> String {
    path.strip_prefix(setup::workspace_root())
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| path.display().to_string())
}

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
//!
//! Address families (`--family ipv4,ipv6`, both by default): every mode
//! runs in each, in a lab of its own (IPv6: a dual-stack lab whose traffic
//! is all IPv6, addresses from 2001:2::/48), and the rounds interleave all
//! of them. In IPv6 kube-proxy's modes are `ip6tables-legacy`,
//! `ip6tables-nft` (the same chains, `ip6tables-*-restore`) and `nftables`
//! (the `ip6 kube-proxy` table); the agent serves single-stack IPv6
//! Services. IPv6 results are reported against the IPv6 floor and
//! `ip6tables-legacy`, and per N the agent's ratios to the floor are
//! compared across families (the target: IPv6's no costlier than IPv4's).
//!
//! The API modes (`kube-proxy-iptables`, `kube-proxy-nftables`,
//! `proxy-tc-k8s`; IPv4) run the real kube-proxy v1.37.2 and the agent
//! (`--source kubernetes`) on labs with a real control plane, their
//! Services made through the API server, up to `--api-max-n`; the `api`
//! module says how they are programmed and what they report beyond the
//! cells (the proxies' own sync and programming histograms, CPU, peak RSS,
//! endpoint churn).
//!
//! `results.json` keeps its IPv4 shape: per N, `modes` holds the IPv4
//! modes as before; `modes_ipv6` the IPv6 ones (keyed by their IPv6 names)
//! and `family_target` the comparison, both left out when not measured.
//!
//! This file runs the rounds; the submodules hold the rest:
//!
//! | module | concern |
//! |---|---|
//! | `config` | [`BenchArgs`], [`Mode`], [`Config`] |
//! | `mode_lab` | the lab of one mode |
//! | `program` | programming from empty and one change (timed, with its latency) |
//! | `api` | the API modes: the real kube-proxy and the agent on a real control plane |
//! | `measure` | the traffic cells of one round |
//! | `results` | [`Results`] and the harness's checks |
//! | `layouts` | kube-proxy's rule layouts and the agent's manifests for N services |
//! | `load` | the traffic generators and the pods' servers |
//! | `report` | `results.json` and `results.md` |
//! | `charts` | the SVG charts beside them (latency, programming, memory against N) |
//! | `sys` | commands in namespaces, CPU pinning and noise, kernel memory, conntrack and BPF map resets |

mod api;
pub mod charts;
mod config;
pub mod layouts;
pub mod load;
mod measure;
mod mode_lab;
mod program;
pub mod report;
mod results;
pub mod sys;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context, Result};

use crate::setup;
pub use config::{BenchArgs, Config, Family, Mode};
use measure::{measure_round, RoundData};
use mode_lab::{agent_bin, ModeLab};
use program::program;
use results::{checks, median, merge_conn, merge_rr};
pub use results::{
    ApiStats, Check, ConnStats, FamilyMetric, FamilyTarget, HistSummary, ModeResult, NResult,
    ProgStats, Results, RrStats,
};

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

/// When the bench started: every line says how long it has run.
static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

fn log(msg: impl AsRef<str>) {
    let t = STARTED.get_or_init(std::time::Instant::now).elapsed();
    eprintln!("[bench {}] {}", crate::progress::elapsed(t), msg.as_ref());
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
    for (m, f) in cfg
        .modes
        .iter()
        .flat_map(|m| cfg.families.iter().map(move |f| (*m, *f)))
    {
        let need = match m {
            Mode::Nftables => Some("nft"),
            _ => m.restore_bin(f),
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
    let most = cfg.ns.iter().copied().max().unwrap_or(0);
    if most.saturating_add(cfg.changes) > layouts::MAX_SERVICES {
        bail!(
            "N={most} with {} changes: the layout has {} Services at most",
            cfg.changes,
            layouts::MAX_SERVICES
        );
    }
    let mut results = Results {
        machine: machine(),
        config: BTreeMap::new(),
        results: Vec::new(),
    };
    let agent = if cfg.modes.iter().any(|m| m.is_proxy()) {
        Some(agent_bin(cfg)?)
    } else {
        None
    };
    for (k, v) in [
        ("n", format!("{:?}", cfg.ns)),
        (
            "families",
            cfg.families
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(","),
        ),
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
    if agent.is_some() {
        if let Some(m) = mode_lab::MapSizes::for_config(cfg) {
            results.config.insert("agent_map_sizes".into(), m.summary());
        }
    }
    let mut cfg = cfg.clone();
    cfg.agent_bin = agent;

    let mut labs: Vec<ModeLab> = Vec::new();
    let n_labs = cfg.families.len() * cfg.modes.len();
    let outcome = (|| -> Result<()> {
        for f in &cfg.families {
            for m in &cfg.modes {
                check_interrupted()?;
                if m.is_api() && *f != Family::Ipv4 {
                    log(format!(
                        "{}: IPv4 only (the control-plane lab is single-stack): not run in {}",
                        m.name(),
                        f.label()
                    ));
                    continue;
                }
                log(format!(
                    "starting the lab of {} ({} of {n_labs})",
                    m.name_in(*f),
                    labs.len() + 1
                ));
                let ml = ModeLab::start(*m, *f, &cfg)
                    .with_context(|| format!("the lab of {} ({})", m.name_in(*f), f.label()))?;
                labs.push(ml);
            }
        }
        for (i, &n) in cfg.ns.iter().enumerate() {
            log(format!("N={n} ({} of {} sizes)", i + 1, cfg.ns.len()));
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
        modes_ipv6: BTreeMap::new(),
        family_target: None,
        not_run: BTreeMap::new(),
    };
    // The API modes stop at --api-max-n (their Services go through the API
    // server, which bounds N) and at what the ServiceCIDR holds.
    let api_not_run = api::not_run_reason(cfg, n);
    let runs = |ml: &ModeLab| !ml.mode.is_api() || api_not_run.is_none();
    for ml in labs.iter().filter(|ml| !runs(ml)) {
        out.not_run.insert(
            ml.name().to_string(),
            api_not_run.clone().unwrap_or_default(),
        );
    }
    let mut progs = BTreeMap::new();
    let n_labs = labs.len();
    for (i, ml) in labs.iter_mut().enumerate() {
        check_interrupted()?;
        if !runs(ml) {
            continue;
        }
        log(format!(
            "N={n}: programming {} ({} of {n_labs})",
            ml.label(),
            i + 1
        ));
        // Programming 50,000 Services into iptables takes minutes.
        let beat = crate::progress::Heartbeat::start(
            format!("[bench] N={n}: programming {}", ml.label()),
            std::time::Duration::from_secs(30),
        );
        let p = program(ml, n, &targets, cfg)
            .with_context(|| format!("programming {} at N={n}", ml.label()))?;
        drop(beat);
        log(format!(
            "N={n} {}: from empty {:?} s, single tx {:?}{}, change {:?} ms, npl {:?} ms",
            ml.label(),
            p.from_empty_s,
            p.single_tx_s,
            if p.single_tx_capped { " (capped)" } else { "" },
            p.change_ms,
            p.npl_ms
        ));
        progs.insert((ml.family, ml.mode), p);
    }
    let mut data: BTreeMap<(Family, Mode), RoundData> = BTreeMap::new();
    let active: Vec<usize> = (0..labs.len()).filter(|&i| runs(&labs[i])).collect();
    for r in 0..cfg.rounds {
        let k = active.len();
        for j in 0..k {
            let ml = &labs[active[(j + r) % k]];
            log(format!(
                "N={n} round {}/{}: {} ({} of {k})",
                r + 1,
                cfg.rounds,
                ml.label(),
                j + 1
            ));
            let d = data
                .entry((ml.family, ml.mode))
                .or_insert_with(|| RoundData {
                    conn: BTreeMap::new(),
                    rate: Vec::new(),
                    tcp_rr: Vec::new(),
                    udp_rr: Vec::new(),
                    bulk: Vec::new(),
                    host_conn: Vec::new(),
                    host_rate: Vec::new(),
                    host_udp_rr: Vec::new(),
                    http: Vec::new(),
                });
            measure_round(ml, &positions, main_pos, cfg, d)?;
        }
    }
    let mut api_stats = BTreeMap::new();
    for &i in &active {
        let ml = &mut labs[i];
        if ml.mode.is_api() {
            check_interrupted()?;
            let s = api::finish(ml, cfg)
                .with_context(|| format!("{} at N={n}: churn and cost", ml.label()))?;
            api_stats.insert(ml.mode, s);
        }
    }
    for ml in active.iter().map(|&i| &labs[i]) {
        let d = &data[&(ml.family, ml.mode)];
        let mut mr = ModeResult {
            prog: progs.remove(&(ml.family, ml.mode)).unwrap_or_default(),
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
            host_conn: (!d.host_conn.is_empty()).then(|| merge_conn(&d.host_conn)),
            host_conn_rate: median(&mut d.host_rate.clone()),
            host_udp_rr: (!d.host_udp_rr.is_empty()).then(|| merge_rr(&d.host_udp_rr)),
            http_rps: median(&mut d.http.iter().map(|h| h.0).collect::<Vec<_>>()),
            http_failed: d.http.iter().map(|h| h.1).sum(),
            api: api_stats.remove(&ml.mode),
            checks: Vec::new(),
        };
        mr.checks = checks(&mr, cfg.endpoints);
        for c in mr.checks.iter().filter(|c| !c.ok) {
            log(format!(
                "N={n} {}: check failed: {}: {}",
                ml.label(),
                c.name,
                c.detail
            ));
        }
        match ml.family {
            Family::Ipv4 => out.modes.insert(ml.name().to_string(), mr),
            Family::Ipv6 => out.modes_ipv6.insert(ml.name().to_string(), mr),
        };
    }
    out.family_target = results::family_target(&out);
    if let Some(t) = &out.family_target {
        log(format!("N={n}: {}", t.summary()));
    }
    Ok(out)
}

/// `cargo xtask bench --replot DIR`: `results.md` and the charts again from
/// the `results.json` of an earlier run (after a change to the report or
/// the charts; the measurements are not touched).
fn replot(dir: &Path) -> Result<()> {
    let path = dir.join("results.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let results: Results = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a bench run's results", path.display()))?;
    report::write(dir, &results)?;
    println!("redrawn from {}: results.md and the charts", path.display());
    Ok(())
}

/// `cargo xtask bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    if let Some(dir) = &args.replot {
        return replot(dir);
    }
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
    STARTED.get_or_init(std::time::Instant::now);
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

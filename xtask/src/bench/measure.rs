//! Traffic measurements: one round of a mode's cells (connection latency
//! per target position, connection rate, TCP and UDP request/response,
//! bulk throughput, HTTP requests with wrk), each cell redone when the
//! machine was noisy.
use std::collections::BTreeMap;
use std::net::SocketAddr;

use anyhow::Result;

use super::layouts::{svc_addr, TPORT};
use super::mode_lab::ModeLab;
use super::{check_interrupted, load, log, sys, Config, ConnStats, Mode, RrStats};

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
    let pids: Vec<u32> = ml.own_pids();
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
            ml.label()
        ));
    }
}

pub(super) struct RoundData {
    pub(super) conn: BTreeMap<String, Vec<ConnStats>>,
    pub(super) rate: Vec<(f64, usize)>,
    pub(super) tcp_rr: Vec<RrStats>,
    pub(super) udp_rr: Vec<RrStats>,
    pub(super) bulk: Vec<f64>,
    pub(super) host_conn: Vec<ConnStats>,
    pub(super) host_rate: Vec<f64>,
    pub(super) host_udp_rr: Vec<RrStats>,
    pub(super) http: Vec<(f64, u64)>,
}

/// Runs `f` with this process in the node's cgroup (where the proxy's
/// socket hooks are attached), so that sockets it opens in the node's
/// namespace are the node's own clients; moves back afterwards. Without a
/// lab cgroup, runs `f` as is.
fn as_node_process<T>(ml: &ModeLab, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let Some(cg) = ml.lab.node().cgroup.clone() else {
        return f();
    };
    let own = std::fs::read_to_string("/proc/self/cgroup")?
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_string))
        .unwrap_or_else(|| "/".into());
    let mount = crate::lab::cgroup2_mount().ok_or_else(|| anyhow::anyhow!("no cgroup2"))?;
    let back = mount.join(own.trim_start_matches('/')).join("cgroup.procs");
    let pid = std::process::id().to_string();
    std::fs::write(cg.join("cgroup.procs"), &pid)?;
    let r = f();
    std::fs::write(&back, &pid)?;
    r
}

/// What the client dials: the pods themselves for the floor, else the
/// (VIP, port) of service `index`; in the lab's family.
fn targets_for(ml: &ModeLab, index: usize) -> Vec<SocketAddr> {
    if ml.mode == Mode::None {
        ml.pod_ips
            .iter()
            .map(|ip| SocketAddr::new(*ip, TPORT))
            .collect()
    } else if let Some(vip) = ml.vips.get(&index) {
        vec![*vip]
    } else {
        vec![svc_addr(ml.family, index)]
    }
}

pub(super) fn measure_round(
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
            load::conn_latency(
                &ml.client_ns,
                targets.clone(),
                cfg.samples,
                Some(ml.client_ip),
            )
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
    data.tcp_rr.push(rr_stats(t));
    let (u, _, _) = cell(ml, cfg, || {
        load::udp_rr(&ml.client_ns, targets[0], cfg.rr_samples)
    })?;
    data.udp_rr.push(rr_stats(u));
    let (b, _, _) = cell(ml, cfg, || {
        load::bulk(&ml.client_ns, targets[0], cfg.bulk_duration)
    })?;
    data.bulk.push(b);
    let (h, _, _) = cell(ml, cfg, || {
        load::http_rps(&ml.client_ns, targets[0], cfg.rate_duration)
    })?;
    match h {
        Some(h) => data.http.push(h),
        None => log("wrk is not installed (cargo xtask setup installs it): no HTTP cell"),
    }
    // Host clients: the same target from the node's own namespace.
    let (h, _, _) = cell(ml, cfg, || {
        as_node_process(ml, || {
            load::conn_latency(&ml.node_ns, targets.clone(), cfg.samples, None)
        })
    })?;
    data.host_conn.push(ConnStats {
        p50_us: us(&h.hist, 0.5),
        p99_us: us(&h.hist, 0.99),
        p999_us: us(&h.hist, 0.999),
        ok: h.ok,
        failed: h.failed,
        backends: h.backends,
        wrong_client_ip: 0,
        wrong_peer: h.wrong_peer,
        first_error: h.first_error,
        ..ConnStats::default()
    });
    let (hr, _, _) = cell(ml, cfg, || {
        as_node_process(ml, || {
            load::conn_rate(
                &ml.node_ns,
                targets.clone(),
                cfg.rate_threads,
                cfg.rate_duration,
            )
        })
    })?;
    data.host_rate.push(hr.0);
    // A connected UDP socket of the node's (a DNS forwarder, a metrics
    // agent), request/response at the main target.
    let (hu, _, _) = cell(ml, cfg, || {
        as_node_process(ml, || load::udp_rr(&ml.node_ns, targets[0], cfg.rr_samples))
    })?;
    data.host_udp_rr.push(rr_stats(hu));
    Ok(())
}

/// The medians and counts of one request/response cell.
fn rr_stats(c: load::RrCell) -> RrStats {
    RrStats {
        p50_us: us(&c.hist, 0.5),
        p99_us: us(&c.hist, 0.99),
        ok: c.ok,
        failed: c.failed,
        first_error: c.first_error,
    }
}

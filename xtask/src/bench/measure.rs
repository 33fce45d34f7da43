//! Traffic measurements: one round of a mode's cells (connection latency
//! per target position, connection rate, TCP and UDP request/response,
//! bulk throughput), each cell redone when the machine was noisy.
use std::collections::BTreeMap;
use std::net::SocketAddrV4;

use anyhow::Result;

use super::layouts::{vip, PORT, TPORT};
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

pub(super) struct RoundData {
    pub(super) conn: BTreeMap<String, Vec<ConnStats>>,
    pub(super) rate: Vec<(f64, usize)>,
    pub(super) tcp_rr: Vec<RrStats>,
    pub(super) udp_rr: Vec<RrStats>,
    pub(super) bulk: Vec<f64>,
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
    data.tcp_rr.push(rr_stats(t));
    let (u, _, _) = cell(ml, cfg, || {
        load::udp_rr(&ml.client_ns, targets[0], cfg.rr_samples)
    })?;
    data.udp_rr.push(rr_stats(u));
    let (b, _, _) = cell(ml, cfg, || {
        load::bulk(&ml.client_ns, targets[0], cfg.bulk_duration)
    })?;
    data.bulk.push(b);
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

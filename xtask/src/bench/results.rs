//! What a run yields: the measured cells per mode and N, their medians over
//! rounds, and the harness's own checks of the traffic it saw.
use std::collections::BTreeMap;

use serde::Serialize;

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
    /// Connection latency from the node's own namespace (a host client:
    /// socket hooks in the proxy modes, the OUTPUT chain in kube-proxy's)
    /// at the main target.
    pub host_conn: Option<ConnStats>,
    /// New connections per second from the node's own namespace.
    pub host_conn_rate: Option<f64>,
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

pub(super) fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    Some(v[v.len() / 2])
}

/// The median of `field` over `v`; 0 when `v` is empty.
fn median_of<T>(v: &[T], field: impl Fn(&T) -> f64) -> f64 {
    median(&mut v.iter().map(field).collect::<Vec<_>>()).unwrap_or(0.0)
}

pub(super) fn merge_conn(v: &[ConnStats]) -> ConnStats {
    let mut out = ConnStats {
        p50_us: median_of(v, |c| c.p50_us),
        p99_us: median_of(v, |c| c.p99_us),
        p999_us: median_of(v, |c| c.p999_us),
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

pub(super) fn merge_rr(v: &[RrStats]) -> RrStats {
    let mut out = RrStats {
        p50_us: median_of(v, |c| c.p50_us),
        p99_us: median_of(v, |c| c.p99_us),
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

pub(super) fn checks(mr: &ModeResult, endpoints: usize) -> Vec<Check> {
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
    if let Some(h) = &mr.host_conn {
        v.push(Check {
            name: "host clients".into(),
            ok: h.ok > 0 && h.failed == 0 && h.wrong_peer == 0,
            detail: format!(
                "from the node's namespace: {} answered, {} failed, {} peers differ from the dialled address{}",
                h.ok,
                h.failed,
                h.wrong_peer,
                h.first_error.as_ref().map(|e| format!(" (first: {e})")).unwrap_or_default()
            ),
        });
    }
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

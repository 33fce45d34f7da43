//! What a run yields: the measured cells per mode, family and N, their
//! medians over rounds, the harness's own checks of the traffic it saw,
//! and per N the agent's cost over the floor compared across families.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Family;

/// One measured cell (medians over rounds where it says so).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
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

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct RrStats {
    pub p50_us: f64,
    pub p99_us: f64,
    pub ok: usize,
    pub failed: usize,
    pub first_error: Option<String>,
}

/// Programming measurements of one mode at one N.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
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
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
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
    /// UDP request/response on a connected socket from the node's own
    /// namespace, at the main target (results before it was measured have
    /// none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_udp_rr: Option<RrStats>,
    /// HTTP requests per second with wrk, a connection per request
    /// (`Connection: close`), at the main target; and the requests that
    /// failed over the rounds.
    pub http_rps: Option<f64>,
    pub http_failed: u64,
    /// The API modes' own figures (the real kube-proxy, the agent with
    /// `--source kubernetes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<ApiStats>,
    /// The harness's own checks.
    pub checks: Vec<Check>,
}

/// A Prometheus histogram read from a proxy's /metrics (or the difference
/// of two readings): observations, their sum, and the median estimated
/// from the buckets as `histogram_quantile` does.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct HistSummary {
    pub count: f64,
    pub sum_s: f64,
    pub p50_s: Option<f64>,
}

impl HistSummary {
    pub fn mean_s(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum_s / self.count)
    }
}

/// What an API mode's proxy reported and cost at one N.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct ApiStats {
    /// The proxy's `minSyncPeriod` (kube-proxy: its default; the agent: as
    /// the lab runs it).
    pub min_sync_period: String,
    /// Creating this N's Services through the API server (the proxy
    /// stopped), seconds: what bounds N here.
    pub api_create_s: Option<f64>,
    /// `kubeproxy_sync_proxy_rules_duration_seconds` from the proxy's start
    /// at this N to the end of its rounds (the first full sync included).
    pub sync_rules_all: HistSummary,
    /// The same over the one-change syncs only.
    pub sync_rules_changes: HistSummary,
    /// `kubeproxy_network_programming_duration_seconds` over the changes.
    pub npl_changes: HistSummary,
    /// CPU seconds (user + system) of the proxy's process from its start at
    /// this N to the end of the churn.
    pub cpu_s: Option<f64>,
    /// Peak RSS (VmHWM) of the proxy's process over this N, bytes.
    pub peak_rss: Option<u64>,
    /// Endpoint changes made by the churn (readiness flips × Services).
    pub churn_changes: usize,
    /// CPU seconds of the proxy over the churn, and over as long idle.
    pub churn_cpu_s: Option<f64>,
    pub idle_cpu_s: Option<f64>,
    /// (churn − idle) CPU seconds per 1,000 endpoint changes.
    pub churn_cpu_per_1000_s: Option<f64>,
    /// Peak RSS (VmHWM) of the lab's kube-apiserver and etcd at the end of
    /// this N, bytes (absent in runs before they were measured).
    #[serde(default)]
    pub apiserver_peak_rss: Option<u64>,
    #[serde(default)]
    pub etcd_peak_rss: Option<u64>,
    /// Network programming latency as a user sees it: the churn pod's
    /// Ready condition written (the clock starts before the `kubectl
    /// patch` process) to the first connection through a Service selecting
    /// it, the real EndpointSlice controller in between; one per round, ms.
    #[serde(default)]
    pub ready_to_conn_ms: Vec<f64>,
    /// The `kubectl patch` processes' own durations in those rounds, ms:
    /// the part of the figure above that is the writer's, not the proxy's.
    #[serde(default)]
    pub ready_write_ms: Vec<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

/// One N.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NResult {
    pub n: usize,
    /// Target service indices per position (the same in both families).
    pub positions: BTreeMap<String, usize>,
    /// The IPv4 modes, by name.
    pub modes: BTreeMap<String, ModeResult>,
    /// The IPv6 modes, by their IPv6 names (`ip6tables-legacy`, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub modes_ipv6: BTreeMap<String, ModeResult>,
    /// The agent's ratios to the floor, IPv4 against IPv6 (when both ran).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub family_target: Option<FamilyTarget>,
    /// Modes not run at this N, and why.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub not_run: BTreeMap<String, String>,
}

impl NResult {
    /// The modes of `family`.
    pub fn modes_of(&self, family: Family) -> &BTreeMap<String, ModeResult> {
        match family {
            Family::Ipv4 => &self.modes,
            Family::Ipv6 => &self.modes_ipv6,
        }
    }

    /// The connection cell the tables show for `mode`: the floor's
    /// (`direct`), else the one at the main target (`all` at N = 1,
    /// `middle` above).
    pub fn conn_main<'a>(&self, mode: &str, mr: &'a ModeResult) -> Option<&'a ConnStats> {
        if mode == FLOOR {
            mr.conn.get("direct")
        } else {
            mr.conn.get(if self.n <= 1 { "all" } else { "middle" })
        }
    }
}

/// The floor's name (in both families).
pub const FLOOR: &str = "none";
/// The mode whose families are compared.
pub const TARGET_MODE: &str = "proxy-tc";

/// One metric of [`FamilyTarget`]: the agent's figure over the floor's in
/// each family (as the tables' `×floor`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FamilyMetric {
    pub metric: String,
    pub ipv4_ratio: f64,
    pub ipv6_ratio: f64,
    /// conn/s: more is better, so IPv6 costs no more when its ratio is
    /// at least IPv4's; the latencies: at most.
    pub higher_is_better: bool,
    pub met: bool,
}

/// The target at one N: IPv6 costs no more than IPv4 relative to
/// its floor, for the agent (`proxy-tc`): met when it holds for every
/// metric. Reported, never asserted.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FamilyTarget {
    pub mode: String,
    pub metrics: Vec<FamilyMetric>,
    pub met: bool,
}

impl FamilyTarget {
    /// One line: each metric's ratios and whether IPv6's is within IPv4's.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self
            .metrics
            .iter()
            .map(|m| {
                format!(
                    "{} ×floor IPv4 {:.2}, IPv6 {:.2} ({})",
                    m.metric,
                    m.ipv4_ratio,
                    m.ipv6_ratio,
                    if m.met { "met" } else { "missed" }
                )
            })
            .collect();
        format!(
            "{} IPv6 costs no more than IPv4 over its floor: {} — {}",
            self.mode,
            if self.met { "met" } else { "missed" },
            parts.join("; ")
        )
    }
}

/// [`FamilyTarget`] of `n`, when the agent and the floor ran in both
/// families and every metric was measured.
pub(super) fn family_target(n: &NResult) -> Option<FamilyTarget> {
    type Metric = fn(&NResult, &str, &ModeResult) -> Option<f64>;
    let metrics: [(&str, bool, Metric); 4] = [
        ("conn p50", false, |n, m, mr| {
            n.conn_main(m, mr).map(|c| c.p50_us)
        }),
        ("conn/s", true, |_, _, mr| mr.conn_rate),
        ("TCP RR p50", false, |_, _, mr| {
            mr.tcp_rr.as_ref().map(|r| r.p50_us)
        }),
        ("UDP RR p50", false, |_, _, mr| {
            mr.udp_rr.as_ref().map(|r| r.p50_us)
        }),
    ];
    let ratio = |family: Family, f: Metric| -> Option<f64> {
        let modes = n.modes_of(family);
        let x = f(n, TARGET_MODE, modes.get(TARGET_MODE)?)?;
        let floor = f(n, FLOOR, modes.get(FLOOR)?)?;
        (floor > 0.0 && x > 0.0).then(|| x / floor)
    };
    let mut out = Vec::new();
    for (name, higher_is_better, f) in metrics {
        let (r4, r6) = (ratio(Family::Ipv4, f)?, ratio(Family::Ipv6, f)?);
        out.push(FamilyMetric {
            metric: name.to_string(),
            ipv4_ratio: r4,
            ipv6_ratio: r6,
            higher_is_better,
            met: if higher_is_better { r6 >= r4 } else { r6 <= r4 },
        });
    }
    Some(FamilyTarget {
        mode: TARGET_MODE.to_string(),
        met: out.iter().all(|m| m.met),
        metrics: out,
    })
}

/// A whole run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    pub machine: BTreeMap<String, String>,
    pub config: BTreeMap<String, String>,
    pub results: Vec<NResult>,
}

impl Results {
    /// Every failed check, as `N=<n> <mode>: <check>: <detail>` (IPv6:
    /// `N=<n> IPv6 <mode>: ...`).
    pub fn failed_checks(&self) -> Vec<String> {
        let mut v = Vec::new();
        for r in &self.results {
            for family in Family::ALL {
                let prefix = match family {
                    Family::Ipv4 => "",
                    Family::Ipv6 => "IPv6 ",
                };
                for (m, mr) in r.modes_of(family) {
                    for c in &mr.checks {
                        if !c.ok {
                            v.push(format!("N={} {prefix}{m}: {}: {}", r.n, c.name, c.detail));
                        }
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

/// The nearest-rank `p` percentile of `v` (0 < p ≤ 1); None when empty.
pub(super) fn percentile(v: &[f64], p: f64) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len().max(1)) - 1;
    v.get(i).copied()
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
        + usize::try_from(mr.http_failed).unwrap_or(usize::MAX)
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
    if let Some(a) = &mr.api {
        let p = &mr.prog;
        let mut missing = Vec::new();
        for (what, there) in [
            ("from empty", p.from_empty_s.is_some()),
            ("change → first connection", p.npl_ms.is_some()),
            ("one change's sync", p.change_ms.is_some()),
            (
                "sync_proxy_rules_duration_seconds",
                a.sync_rules_all.count > 0.0,
            ),
            (
                "network_programming_duration_seconds",
                a.npl_changes.count > 0.0,
            ),
            ("CPU seconds", a.cpu_s.is_some()),
            ("peak RSS", a.peak_rss.is_some()),
            ("churn CPU", a.churn_cpu_per_1000_s.is_some()),
            ("Ready → first connection", !a.ready_to_conn_ms.is_empty()),
            (
                "API server and etcd RSS",
                a.apiserver_peak_rss.is_some() && a.etcd_peak_rss.is_some(),
            ),
        ] {
            if !there {
                missing.push(what);
            }
        }
        v.push(Check {
            name: "API mode figures".into(),
            ok: missing.is_empty(),
            detail: if missing.is_empty() {
                "every figure measured".into()
            } else {
                format!("not measured: {}", missing.join(", "))
            },
        });
    }
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
    if let Some(u) = &mr.host_udp_rr {
        v.push(Check {
            name: "host UDP".into(),
            ok: u.ok > 0 && u.failed == 0,
            detail: format!(
                "a connected UDP socket in the node's namespace: {} answered, {} unanswered{}",
                u.ok,
                u.failed,
                u.first_error
                    .as_ref()
                    .map(|e| format!(" (first: {e})"))
                    .unwrap_or_default()
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

#[cfg(test)]
mod tests {
    use super::percentile;

    /// Nearest rank: of 20 rounds, p50 is the 10th and p99 the largest.
    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), Some(10.0));
        assert_eq!(percentile(&v, 0.99), Some(20.0));
        assert_eq!(percentile(&[7.0], 0.5), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
    }
}

//! The API modes (issue 39): the real kube-proxy (iptables, nftables) and
//! the agent with `--source kubernetes`, each on a lab of its own with a
//! real control plane, measured as the other modes are.
//!
//! - **Objects.** The N Services are made through the API server (the
//!   lab's server-side applies), each selecting the E bench pods (TCP
//!   80 → 8080; the targets of this N also UDP), ClusterIPs from the real
//!   allocator, slices from the real EndpointSlice controller. The proxy is
//!   stopped while they are made; how long that took is reported
//!   (`api_create_s`): it is what bounds N here.
//! - **From empty.** The proxy is started on a node it never ran on
//!   (kube-proxy after `kube-proxy --cleanup`; the agent with its pin
//!   directory removed, so it attaches and fills its maps anew); the clock
//!   runs from the start to the first connection through the last target
//!   that succeeds.
//! - **One change.** A new Service (an explicit ClusterIP of the static
//!   band, so the client knows it before it exists) applied through the
//!   API by one `kubectl apply` (not the lab's apply, whose bookkeeping
//!   of N objects would be timed too); the clock runs from that command's
//!   start to the Service's first successful connection. Each change
//!   waits 2 s first, past kube-proxy's default `minSyncPeriod` (1 s): the
//!   change meets an idle proxy. The proxy's own
//!   `kubeproxy_sync_proxy_rules_duration_seconds` and
//!   `kubeproxy_network_programming_duration_seconds` over the changes are
//!   read from its /metrics (the agent exports both under kube-proxy's
//!   names).
//! - **Cost.** CPU seconds (utime + stime) and peak RSS (VmHWM) of the
//!   proxy's process over the N (it is restarted at each N), and endpoint
//!   churn: the readiness of one pod, selected by
//!   [`Config::churn_services`] Services, flipped [`Config::churn_flips`]
//!   times through the API (pod status writes, as its kubelet's), the
//!   proxy's CPU over that, less its CPU over as long idle, per 1,000
//!   endpoint changes.
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::layouts::{PORT, TPORT};
use super::mode_lab::ModeLab;
use super::results::{median, ApiStats, HistSummary};
use super::{check_interrupted, load, log, Config, Mode, ProgStats};
use crate::client::http_get_in;
use crate::lab::kube_proxy::{KubeProxyOptions, HTTP_TIMEOUT, METRICS_ADDR};
use crate::lab::NODE_NAME;

/// The churn pod (label `app: churn`), selected by the churn Services.
pub(super) const CHURN_POD: &str = "churn-0";
/// The bench pods' label (`app: bench`): every bench Service selects them.
const BENCH_APP: &str = "bench";
/// Bound of a proxy's start at N (10,000 Services: tens of seconds).
const START_TIMEOUT: Duration = Duration::from_secs(600);
/// The wait before each change: past kube-proxy's default minSyncPeriod.
const IDLE_BEFORE_CHANGE: Duration = Duration::from_secs(2);
/// After the last readiness flip: the proxy's last sync (minSyncPeriod 1 s
/// and the sync) falls inside the churn window.
const CHURN_SETTLE: Duration = Duration::from_secs(3);
/// kube-proxy's `minSyncPeriod` default; the agent runs as the lab starts
/// it (`--min-sync-period 100ms`, see `lab/process.rs`).
pub(super) const KUBE_PROXY_MIN_SYNC: &str = "1s (default)";
pub(super) const AGENT_MIN_SYNC: &str = "100ms (the lab's)";

/// Change Services of one run (their static ClusterIPs: 198.19.0.10 on).
const MAX_CHANGES: u32 = 240;

/// How many bench Services the lab's IPv4 ServiceCIDR can give a ClusterIP
/// of its own: its addresses, less the network and broadcast addresses,
/// the `kubernetes` Service, the churn Services and the changes' band. The
/// real allocator gives every Service an address (the layout modes reuse a
/// VIP on another port, and so go further).
pub(super) fn service_cidr_capacity(cfg: &Config) -> usize {
    let prefix: u32 = crate::lab::control_plane::SERVICE_CIDR
        .rsplit('/')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the ServiceCIDR has a prefix length");
    (1usize << (32 - prefix)) - 2 - 1 - cfg.churn_services - MAX_CHANGES as usize
}

/// Why the API modes do not run at `n`, if they do not.
pub(super) fn not_run_reason(cfg: &Config, n: usize) -> Option<String> {
    let cap = service_cidr_capacity(cfg);
    if n > cap {
        return Some(format!(
            "N above the {cap} ClusterIPs the lab's IPv4 ServiceCIDR ({}) has for bench Services: \
             the real allocator gives each Service an address of its own",
            crate::lab::control_plane::SERVICE_CIDR
        ));
    }
    (n > cfg.api_max_n).then(|| {
        format!(
            "N above --api-max-n={}: its Services are made through the API server (minutes per 10,000 here)",
            cfg.api_max_n
        )
    })
}

/// What an API mode's lab keeps between N.
#[derive(Debug, Default)]
pub(super) struct ApiLab {
    /// Bench Services `svc-0 .. svc-{created-1}` exist.
    created: usize,
    /// Those carrying a UDP port too (this N's targets).
    udp: BTreeSet<usize>,
    /// Change Services of this N (deleted at the next).
    changes: Vec<String>,
    /// Change Services made so far (their ClusterIPs: 198.19.0.(9 + seq)).
    seq: u32,
    /// Metrics at the end of the changes (the rounds' syncs are after).
    stats: ApiStats,
}

fn svc_name(i: usize) -> String {
    format!("svc-{i}")
}

/// A Service selecting `app`, TCP (and UDP when `udp`) port 80 → 8080.
fn service_json(name: &str, app: &str, udp: bool, cluster_ip: Option<Ipv4Addr>) -> String {
    let mut ports =
        format!(r#"{{"name":"p{PORT}","port":{PORT},"protocol":"TCP","targetPort":{TPORT}}}"#);
    if udp {
        ports.push_str(&format!(
            r#",{{"name":"u{PORT}","port":{PORT},"protocol":"UDP","targetPort":{TPORT}}}"#
        ));
    }
    let ip = cluster_ip.map_or(String::new(), |ip| {
        format!(r#""clusterIP":"{ip}","clusterIPs":["{ip}"],"#)
    });
    format!(
        "---\n{{\"apiVersion\":\"v1\",\"kind\":\"Service\",\"metadata\":{{\"name\":\"{name}\",\"namespace\":\"default\"}},\"spec\":{{{ip}\"selector\":{{\"app\":\"{app}\"}},\"ports\":[{ports}]}}}}\n"
    )
}

/// The lab's objects beside the bench pods: the churn pod and the churn
/// Services selecting it.
pub(super) fn churn_objects(cfg: &Config) -> String {
    let mut y = format!(
        "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {CHURN_POD}\n  labels:\n    app: churn\nspec:\n  containers:\n  - name: c\n    image: lab-server\n"
    );
    for j in 0..cfg.churn_services {
        y.push_str(&service_json(&format!("churn-{j}"), "churn", false, None));
    }
    y
}

/// The pid of the mode's proxy on the node.
fn proxy_pid(ml: &ModeLab) -> Option<u32> {
    let n = ml.lab.node();
    if ml.mode == Mode::ProxyK8s {
        n.agent.as_ref().map(|a| a.pid)
    } else {
        n.kube_proxy.as_ref().map(|k| k.pid)
    }
}

/// CPU seconds (utime + stime) of `pid` so far.
fn cpu_s(pid: u32) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some((utime + stime) as f64 / hz)
}

/// Peak RSS (VmHWM) of `pid`, bytes.
fn peak_rss(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let l = text.lines().find(|l| l.starts_with("VmHWM:"))?;
    l.split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()
        .map(|k| k * 1024)
}

/// A histogram of a /metrics text, its label sets (but `le`) summed:
/// cumulative counts per upper bound, the sum and the count.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Hist {
    buckets: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

impl Hist {
    pub(super) fn parse(text: &str, name: &str) -> Hist {
        let mut buckets: BTreeMap<String, f64> = BTreeMap::new();
        let mut h = Hist::default();
        let value = |l: &str| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        // kube-proxy's dual-stack proxier labels its IPv6 syncs (no IPv6
        // Services here): the IPv4 ones are the measurement.
        for l in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.contains("ip_family=\"IPv6\""))
        {
            let Some(rest) = l.strip_prefix(name) else {
                continue;
            };
            if let Some(b) = rest.strip_prefix("_bucket") {
                let le = b
                    .split("le=\"")
                    .nth(1)
                    .and_then(|x| x.split('"').next())
                    .unwrap_or("")
                    .to_string();
                *buckets.entry(le).or_default() += value(l);
            } else if rest.starts_with("_sum") {
                h.sum += value(l);
            } else if rest.starts_with("_count") {
                h.count += value(l);
            }
        }
        h.buckets = buckets
            .into_iter()
            .filter_map(|(le, c)| {
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, c))
            })
            .collect();
        h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        h
    }

    /// `self − before` (the observations in between).
    pub(super) fn since(&self, before: &Hist) -> Hist {
        let prev = |le: f64| {
            before
                .buckets
                .iter()
                .find(|b| b.0 == le)
                .map_or(0.0, |b| b.1)
        };
        Hist {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, c)| (le, c - prev(le)))
                .collect(),
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }

    /// The `q` quantile as Prometheus' `histogram_quantile` estimates it
    /// (linear within the bucket; the highest finite bound for +Inf).
    pub(super) fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let (mut lo, mut below) = (0.0, 0.0);
        for &(le, c) in &self.buckets {
            if c >= rank {
                if le.is_infinite() {
                    return Some(lo);
                }
                if c <= below {
                    return Some(le);
                }
                return Some(lo + (le - lo) * (rank - below) / (c - below));
            }
            lo = le;
            below = c;
        }
        Some(lo)
    }

    pub(super) fn summary(&self) -> HistSummary {
        HistSummary {
            count: self.count,
            sum_s: self.sum,
            p50_s: self.quantile(0.5),
        }
    }
}

const SYNC_METRIC: &str = "kubeproxy_sync_proxy_rules_duration_seconds";
const NPL_METRIC: &str = "kubeproxy_network_programming_duration_seconds";

/// The proxy's /metrics (kube-proxy's address; the agent's is the same).
fn metrics(ml: &ModeLab) -> Result<String> {
    let (code, body) = http_get_in(&ml.node_ns, METRICS_ADDR, "/metrics", HTTP_TIMEOUT)?;
    if code != 200 {
        bail!("{}: /metrics answered {code}", ml.label());
    }
    Ok(body)
}

fn stop_proxy(ml: &mut ModeLab) -> Result<()> {
    if ml.mode == Mode::ProxyK8s {
        ml.lab.stop_agent_on(NODE_NAME)?;
        // A node the agent never ran on: its links (pinned there) go with
        // the directory, and the next agent attaches and fills maps anew.
        let dir = ml.lab.node().bpffs.clone();
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("remove {}", dir.display()))?;
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    } else {
        ml.lab.stop_kube_proxy_on(NODE_NAME)?;
    }
    Ok(())
}

fn start_proxy(ml: &mut ModeLab) -> Result<()> {
    match ml.mode.real_kube_proxy() {
        Some(mode) => ml
            .lab
            .start_kube_proxy_on(NODE_NAME, mode, &KubeProxyOptions::default()),
        None => {
            ml.lab.start_agent_on(NODE_NAME)?;
            ml.lab.wait_ready(START_TIMEOUT)
        }
    }
}

fn poll(
    ns: &str,
    target: SocketAddr,
    t0: Instant,
    limit: Duration,
) -> std::thread::JoinHandle<Option<Duration>> {
    let ns = ns.to_string();
    std::thread::spawn(move || load::first_success(&ns, target, t0, limit).ok().flatten())
}

/// Programming at N in an API mode: the objects through the API, the
/// proxy from empty, then the changes (see the module's doc).
pub(super) fn program(
    ml: &mut ModeLab,
    n: usize,
    targets: &BTreeSet<usize>,
    cfg: &Config,
) -> Result<ProgStats> {
    let mut p = ProgStats::default();
    let mut st = ml.api.take().unwrap_or_default();
    if n < st.created {
        bail!(
            "the API modes run N in ascending order (N={n} after {})",
            st.created
        );
    }
    stop_proxy(ml)?;

    // This N's objects: the new Services, the targets' UDP ports.
    // The last N's changes (written past the lab's bookkeeping).
    if !st.changes.is_empty() {
        let mut args = vec!["delete", "service", "--wait=false"];
        args.extend(st.changes.iter().map(String::as_str));
        ml.lab.kubectl(&args, None)?;
        st.changes.clear();
    }
    let mut yaml = String::new();
    for i in st.udp.difference(targets).filter(|i| **i < st.created) {
        yaml.push_str(&service_json(&svc_name(*i), BENCH_APP, false, None));
    }
    for i in targets
        .iter()
        .filter(|i| **i < st.created && !st.udp.contains(i))
    {
        yaml.push_str(&service_json(&svc_name(*i), BENCH_APP, true, None));
    }
    let new = n - st.created;
    for i in st.created..n {
        yaml.push_str(&service_json(
            &svc_name(i),
            BENCH_APP,
            targets.contains(&i),
            None,
        ));
    }
    if !yaml.is_empty() {
        log(format!(
            "{}: {new} Services through the API server",
            ml.label()
        ));
        let t = Instant::now();
        ml.lab.apply(&yaml)?;
        if new > 0 {
            st.stats.api_create_s = Some(t.elapsed().as_secs_f64());
        }
        log(format!(
            "{}: applied in {:.1} s",
            ml.label(),
            t.elapsed().as_secs_f64()
        ));
    }
    st.created = n;
    st.udp = targets.clone();
    ml.vips.clear();
    for &i in targets {
        let ip = ml
            .lab
            .service_ip(&svc_name(i))
            .with_context(|| format!("no ClusterIP of {}", svc_name(i)))?;
        ml.vips.insert(i, SocketAddr::new(IpAddr::V4(ip), PORT));
    }

    // From empty: the proxy's start to the first connection through the
    // last target; then every target answers.
    let last = *targets.iter().max().context("no target")?;
    let t0 = Instant::now();
    let h = poll(&ml.client_ns, ml.vips[&last], t0, START_TIMEOUT);
    start_proxy(ml)?;
    let d = h.join().ok().flatten().with_context(|| {
        format!(
            "{}: {} never answered within {START_TIMEOUT:?} of the proxy's start",
            ml.label(),
            ml.vips[&last]
        )
    })?;
    p.from_empty_s = Some(d.as_secs_f64());
    for (i, vip) in &ml.vips {
        let t = Instant::now();
        load::first_success(&ml.client_ns, *vip, t, Duration::from_secs(120))?
            .with_context(|| format!("{}: target {i} ({vip}) never answered", ml.label()))?;
    }

    // One change, a few times. The first sync's histogram observation
    // comes after its rules work (kube-proxy: ~0.2 s after the restore at
    // N = 10,000): read the "before" once it is surely in.
    std::thread::sleep(IDLE_BEFORE_CHANGE);
    let before = metrics(ml)?;
    for _ in 0..cfg.changes {
        check_interrupted()?;
        std::thread::sleep(IDLE_BEFORE_CHANGE);
        st.seq += 1;
        if st.seq > MAX_CHANGES {
            bail!("out of static ClusterIPs for the changes");
        }
        let ip = Ipv4Addr::new(198, 19, 0, 9 + st.seq as u8);
        let name = format!("chg-{}", st.seq);
        let target = SocketAddr::new(IpAddr::V4(ip), PORT);
        // Written straight to the API server, one kubectl apply: the lab's
        // own apply reconciles its whole object set first (~20 s at N =
        // 10,000), which is the harness's time, not the proxy's.
        let yaml = service_json(&name, BENCH_APP, false, Some(ip));
        let t0 = Instant::now();
        let h = poll(&ml.client_ns, target, t0, Duration::from_secs(120));
        ml.lab.kubectl(
            &[
                "apply",
                "--server-side",
                "--field-manager=kpr-bench",
                "-f",
                "-",
            ],
            Some(&yaml),
        )?;
        st.changes.push(name);
        let npl = h.join().ok().flatten();
        p.npl_all_ms.push(npl.map(|d| d.as_secs_f64() * 1e3));
    }
    // The proxy observes its histograms after the sync that made the
    // connection succeed: read them once that is surely over.
    std::thread::sleep(IDLE_BEFORE_CHANGE);
    let after = metrics(ml)?;
    let sync = Hist::parse(&after, SYNC_METRIC).since(&Hist::parse(&before, SYNC_METRIC));
    let npl = Hist::parse(&after, NPL_METRIC).since(&Hist::parse(&before, NPL_METRIC));
    st.stats.sync_rules_changes = sync.summary();
    st.stats.npl_changes = npl.summary();
    // The proxy's own time to apply a change: its mean sync over the
    // changes (the lab's barrier writes are syncs of one Service too).
    p.change_ms = st.stats.sync_rules_changes.mean_s().map(|s| s * 1e3);
    p.npl_ms = median(&mut p.npl_all_ms.iter().flatten().copied().collect::<Vec<_>>());
    if ml.mode == Mode::ProxyK8s {
        p.agent_rss = proxy_pid(ml).and_then(super::sys::rss_bytes);
    }
    st.stats.min_sync_period = if ml.mode == Mode::ProxyK8s {
        AGENT_MIN_SYNC
    } else {
        KUBE_PROXY_MIN_SYNC
    }
    .to_string();
    ml.api = Some(st);
    Ok(p)
}

/// After the rounds at N: the endpoint churn, then the proxy's CPU, peak
/// RSS and sync histogram since its start at this N.
pub(super) fn finish(ml: &mut ModeLab, cfg: &Config) -> Result<ApiStats> {
    let pid = proxy_pid(ml).context("the proxy is not running")?;
    let mut stats = ml.api.as_ref().map(|s| s.stats.clone()).unwrap_or_default();
    // An even number of flips: the pod ends ready.
    let flips = cfg.churn_flips.div_ceil(2) * 2;
    let c0 = cpu_s(pid);
    let t = Instant::now();
    for f in 0..flips {
        check_interrupted()?;
        write_ready(ml, f % 2 == 1)?;
    }
    std::thread::sleep(CHURN_SETTLE);
    let churn_window = t.elapsed();
    let c1 = cpu_s(pid);
    std::thread::sleep(Duration::from_secs(1));
    let c2 = cpu_s(pid);
    std::thread::sleep(churn_window);
    let c3 = cpu_s(pid);
    stats.churn_changes = flips * cfg.churn_services;
    if let (Some(c0), Some(c1), Some(c2), Some(c3)) = (c0, c1, c2, c3) {
        stats.churn_cpu_s = Some(c1 - c0);
        stats.idle_cpu_s = Some(c3 - c2);
        if stats.churn_changes > 0 {
            stats.churn_cpu_per_1000_s =
                Some(((c1 - c0) - (c3 - c2)).max(0.0) * 1000.0 / stats.churn_changes as f64);
        }
    }
    log(format!(
        "{}: churn of {} endpoint changes in {:.1} s: CPU {:?} s (idle as long: {:?} s)",
        ml.label(),
        stats.churn_changes,
        churn_window.as_secs_f64(),
        stats.churn_cpu_s,
        stats.idle_cpu_s
    ));
    stats.cpu_s = cpu_s(pid);
    stats.peak_rss = peak_rss(pid);
    stats.sync_rules_all = Hist::parse(&metrics(ml)?, SYNC_METRIC).summary();
    (stats.ready_to_conn_ms, stats.ready_write_ms) = ready_rounds(ml, cfg)?;
    let cp = ml.lab.control_plane().context("no control plane")?;
    stats.apiserver_peak_rss = cp.apiserver.and_then(peak_rss);
    stats.etcd_peak_rss = cp.etcd.and_then(peak_rss);
    Ok(stats)
}

/// Writes the churn pod's Ready condition through the API, as its kubelet
/// would; how long the `kubectl patch` process took.
fn write_ready(ml: &ModeLab, ready: bool) -> Result<Duration> {
    let patch = format!(
        r#"{{"status":{{"conditions":[{{"type":"Ready","status":"{}","lastTransitionTime":"{}"}}]}}}}"#,
        if ready { "True" } else { "False" },
        jiff::Timestamp::now()
    );
    let t = Instant::now();
    ml.lab.patch_status("pod", CHURN_POD, &patch)?;
    Ok(t.elapsed())
}

/// Network programming latency as a user sees it, `cfg.ready_rounds`
/// times: the churn pod (the only endpoint of the churn Services) made not
/// ready until a connection through `churn-0` fails, then its Ready
/// condition written with a poller already running; the clock runs from
/// before the write to the first connection the pod answers. The real
/// EndpointSlice controller, the watch and the proxy's sync lie between.
/// Returns those latencies and the writes' own durations, ms.
fn ready_rounds(ml: &ModeLab, cfg: &Config) -> Result<(Vec<f64>, Vec<f64>)> {
    let ip = ml
        .lab
        .service_ip("churn-0")
        .context("no ClusterIP of churn-0")?;
    let target = SocketAddr::new(IpAddr::V4(ip), PORT);
    let limit = Duration::from_secs(120);
    let (mut took, mut writes) = (Vec::new(), Vec::new());
    for r in 0..cfg.ready_rounds {
        check_interrupted()?;
        write_ready(ml, false)?;
        if !load::first_failure(&ml.client_ns, target, limit)? {
            bail!(
                "{}: {target} still answered {limit:?} after the churn pod was made not ready",
                ml.label()
            );
        }
        // Past the proxy's minSyncPeriod: the write meets an idle proxy.
        std::thread::sleep(IDLE_BEFORE_CHANGE);
        let t0 = Instant::now();
        let h = poll(&ml.client_ns, target, t0, limit);
        writes.push(write_ready(ml, true)?.as_secs_f64() * 1e3);
        let d = h.join().ok().flatten().with_context(|| {
            format!(
                "{}: {target} never answered within {limit:?} of the churn pod's Ready (round {r})",
                ml.label()
            )
        })?;
        took.push(d.as_secs_f64() * 1e3);
    }
    log(format!(
        "{}: Ready written → first connection, {} rounds: median {:.0} ms (the writes {:.0} ms)",
        ml.label(),
        took.len(),
        median(&mut took.clone()).unwrap_or(f64::NAN),
        median(&mut writes.clone()).unwrap_or(f64::NAN),
    ));
    Ok((took, writes))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP kubeproxy_sync_proxy_rules_duration_seconds [ALPHA] SyncProxyRules latency in seconds
# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="0.001"} 0
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="0.002"} 2
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="0.004"} 6
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="+Inf"} 8
kubeproxy_sync_proxy_rules_duration_seconds_sum 0.05
kubeproxy_sync_proxy_rules_duration_seconds_count 8
kubeproxy_network_programming_duration_seconds_bucket{le="0.25"} 1
kubeproxy_network_programming_duration_seconds_bucket{le="+Inf"} 1
kubeproxy_network_programming_duration_seconds_sum 0.1
kubeproxy_network_programming_duration_seconds_count 1
kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family="IPv6",le="+Inf"} 5
kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv6"} 5
"#;

    /// The median from buckets as `histogram_quantile` gives it, and a
    /// difference of two readings; IPv6's label set left out.
    #[test]
    fn histograms_from_metrics_text() {
        let h = Hist::parse(TEXT, SYNC_METRIC);
        assert_eq!(h.count, 8.0);
        assert_eq!(h.sum, 0.05);
        // rank 4 of 8: in (0.002, 0.004], half-way.
        assert_eq!(h.quantile(0.5), Some(0.003));
        // rank 7.6: in +Inf: the highest finite bound.
        assert_eq!(h.quantile(0.95), Some(0.004));
        let npl = Hist::parse(TEXT, NPL_METRIC);
        assert_eq!(npl.summary().count, 1.0);
        assert_eq!(npl.quantile(0.5), Some(0.125));
        let d = h.since(&h);
        assert_eq!(d.count, 0.0);
        assert_eq!(d.quantile(0.5), None);
        assert_eq!(d.summary().mean_s(), None);
        // The metric names are not prefixes of one another's lines.
        assert_eq!(Hist::parse(TEXT, "kubeproxy_nothing").count, 0.0);
    }

    /// 100,000 Services do not fit the lab's /16 ServiceCIDR: the API
    /// modes say so instead of failing an hour into the creation.
    #[test]
    fn n_beyond_the_service_cidr_is_not_run_and_says_why() {
        let mut cfg = Config::sanity_api();
        cfg.api_max_n = 100_000;
        let cap = service_cidr_capacity(&cfg);
        assert_eq!(cap, 65_536 - 3 - cfg.churn_services - 240);
        assert_eq!(not_run_reason(&cfg, 50_000), None);
        let why = not_run_reason(&cfg, 100_000).expect("not run");
        assert!(
            why.contains("198.19.0.0/16") && why.contains(&cap.to_string()),
            "{why}"
        );
        cfg.api_max_n = 10_000;
        assert!(not_run_reason(&cfg, 50_000)
            .expect("not run")
            .contains("--api-max-n=10000"));
    }

    #[test]
    fn services_are_json_documents_the_lab_parses() {
        let y = service_json("svc-1", "bench", true, Some(Ipv4Addr::new(198, 19, 0, 10)));
        let v: serde_json::Value =
            serde_json::from_str(y.trim_start_matches("---\n")).expect("JSON");
        assert_eq!(v["spec"]["clusterIP"], "198.19.0.10");
        assert_eq!(v["spec"]["ports"][1]["protocol"], "UDP");
        assert_eq!(v["spec"]["ports"][0]["targetPort"], TPORT);
        assert_eq!(v["spec"]["selector"]["app"], "bench");
    }
}

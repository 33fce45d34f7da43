//! The benchmark's outputs: `results.json`, `results.md` and the charts
//! ([`super::charts`]), which `results.md` shows first.
//!
//! Per N, the IPv4 tables as they always were, then (when IPv6 ran) the
//! same tables for IPv6 under `#### IPv6`, with ratios to the IPv6 floor
//! and to `ip6tables-legacy`, then a line comparing the agent's ratios to
//! the floor across families (the target: IPv6's no costlier).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;

use super::results::percentile;
use super::{layouts, Family, ModeResult, NResult, Results};

/// The mode ratios are taken against (IPv4), unless the real kube-proxy ran.
pub const BASE: &str = "iptables-legacy";
/// The mode ratios are taken against when it ran: the real kube-proxy in
/// its default mode.
pub const REAL_BASE: &str = "kube-proxy-iptables";
/// The mode IPv6 ratios are taken against.
pub const BASE6: &str = "ip6tables-legacy";
/// The floor (in both families).
pub const FLOOR: &str = super::results::FLOOR;

/// Writes `results.json`, the charts and `results.md` into `dir`.
pub fn write(dir: &Path, r: &Results) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("results.json"), serde_json::to_string_pretty(r)?)?;
    super::charts::write(dir, r)?;
    let md = markdown(r);
    let images = super::charts::markdown_images(r)?;
    // The charts after the first heading and the run's description.
    let md = match md.find("\n### ") {
        Some(i) if !images.is_empty() => format!("{}\n{images}{}", &md[..i], &md[i + 1..]),
        _ => md,
    };
    std::fs::write(dir.join("results.md"), md)?;
    Ok(())
}

fn conn_main<'a>(n: &NResult, mode: &str, mr: &'a ModeResult) -> Option<&'a super::ConnStats> {
    n.conn_main(mode, mr)
}

fn ratio(x: Option<f64>, base: Option<f64>) -> String {
    match (x, base) {
        (Some(x), Some(b)) if b > 0.0 => format!("{:.2}", x / b),
        _ => "-".into(),
    }
}

fn with_ratios(
    abs: String,
    x: Option<f64>,
    ipt: Option<f64>,
    floor: Option<f64>,
    has_floor: bool,
) -> String {
    if x.is_none() {
        return abs;
    }
    if has_floor {
        format!("{abs} ({}/{})", ratio(x, ipt), ratio(x, floor))
    } else {
        format!("{abs} ({})", ratio(x, ipt))
    }
}

fn fmt_dur_s(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.0} µs", s * 1e6)
    }
}

fn fmt_bytes(b: f64) -> String {
    let a = b.abs();
    if a >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", b / 1024.0 / 1024.0)
    } else if a >= 1024.0 {
        format!("{:.0} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
    }
}

/// The Markdown report.
pub fn markdown(r: &Results) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Machine: {} CPUs, {}, kernel {}. Agent: {}{}. Command: `{}`.\n",
        r.machine.get("nproc").cloned().unwrap_or_default(),
        r.machine.get("cpu").cloned().unwrap_or_default(),
        r.machine.get("kernel").cloned().unwrap_or_default(),
        r.config.get("agent_bin").cloned().unwrap_or_default(),
        r.config
            .get("agent_map_sizes")
            .map_or(String::new(), |m| format!(" (mapSizes: {m})")),
        r.config
            .get("command")
            .cloned()
            .unwrap_or_else(|| "cargo xtask bench".into()),
    );
    let _ = writeln!(
        s,
        "Cells: `abs (×{BASE} / ×floor)`, or `×{REAL_BASE}` at the N where the real kube-proxy ran (IPv6: ×{BASE6} / ×the IPv6 floor); for times, lower is better; for rates, higher. Latencies in µs, medians over {} rounds of {} connections / {} round trips each. Connection latency at the `middle` target (one service, at N = 1); every position below.\n",
        r.config.get("rounds").cloned().unwrap_or_default(),
        r.config.get("samples").cloned().unwrap_or_default(),
        r.config.get("rr_samples").cloned().unwrap_or_default(),
    );
    for n in &r.results {
        let _ = writeln!(
            s,
            "### N = {} services, {} endpoints each\n",
            n.n,
            r.config.get("endpoints").cloned().unwrap_or_default()
        );
        if n.n > layouts::VIPS {
            let _ = writeln!(
                s,
                "Beyond {} Services the VIPs are shared: Service i is VIP i mod {} on port {} + i / {} (ports {}..={}).\n",
                layouts::VIPS,
                layouts::VIPS,
                layouts::PORT,
                layouts::VIPS,
                layouts::PORT,
                layouts::svc_port(n.n - 1)
            );
        }
        for family in Family::ALL {
            if n.modes_of(family).is_empty() {
                continue;
            }
            if family == Family::Ipv6 {
                let _ = writeln!(s, "#### IPv6 (N = {}: ×{BASE6} / ×the IPv6 floor)\n", n.n);
            }
            family_tables(&mut s, n, family);
        }
        api_table(&mut s, n);
        if let Some(t) = &n.family_target {
            let _ = writeln!(
                s,
                "IPv6 against IPv4, {} over its floor (target: IPv6 costs no more): **{}**\n",
                t.mode,
                if t.met { "met" } else { "missed" }
            );
            let _ = writeln!(s, "| metric | IPv4 ×floor | IPv6 ×floor | |");
            let _ = writeln!(s, "|---|---|---|---|");
            for m in &t.metrics {
                let _ = writeln!(
                    s,
                    "| {} | {:.2} | {:.2} | {} ({}) |",
                    m.metric,
                    m.ipv4_ratio,
                    m.ipv6_ratio,
                    if m.met { "met" } else { "missed" },
                    if m.higher_is_better {
                        "IPv6 ≥ IPv4"
                    } else {
                        "IPv6 ≤ IPv4"
                    }
                );
            }
            let _ = writeln!(s);
        }
    }
    s
}

/// The API modes' own figures at one N (the real kube-proxy and the agent
/// on a real control plane), and the modes not run there.
fn api_table(s: &mut String, n: &NResult) {
    let api: Vec<(&String, &ModeResult, &super::results::ApiStats)> = n
        .modes
        .iter()
        .filter_map(|(m, mr)| mr.api.as_ref().map(|a| (m, mr, a)))
        .collect();
    if !api.is_empty() {
        let _ = writeln!(
            s,
            "Against the real kube-proxy (Services through the API server; from empty: the proxy's start to the first connection through the last target; one change: a Service applied through the API to its first connection; the proxies' own histograms from their /metrics, p50 from buckets; CPU and peak RSS of the proxy's process from its start at this N; churn: CPU per 1,000 endpoint changes, idle CPU subtracted):\n"
        );
        let _ = writeln!(
            s,
            "| mode | minSyncPeriod | N through the API | from empty | change → first connection | sync_proxy_rules (changes) p50 / mean | sync_proxy_rules (all) count / sum | network_programming (changes) p50 / mean | CPU s | peak RSS | churn CPU / 1,000 changes |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
        let base = api.iter().find(|(m, _, _)| m.as_str() == REAL_BASE);
        let opt = |x: Option<f64>| x.map_or("-".into(), fmt_dur_s);
        for (m, mr, a) in &api {
            let b = base.map(|(_, bm, ba)| (bm, ba));
            let rat = |x: Option<f64>, y: Option<f64>| match (x, y) {
                (Some(x), Some(y)) if y > 0.0 && base.is_some() && m.as_str() != REAL_BASE => {
                    format!(" (×{:.2})", x / y)
                }
                _ => String::new(),
            };
            let from_empty = mr.prog.from_empty_s;
            let npl = mr.prog.npl_ms.map(|x| x / 1e3);
            let _ = writeln!(
                s,
                "| {m} | {} | {} | {}{} | {}{} | {} / {} | {:.0} / {} | {} / {} | {}{} | {}{} | {}{} |",
                a.min_sync_period,
                opt(a.api_create_s),
                opt(from_empty),
                rat(from_empty, b.and_then(|b| b.0.prog.from_empty_s)),
                opt(npl),
                rat(npl, b.and_then(|b| b.0.prog.npl_ms.map(|x| x / 1e3))),
                opt(a.sync_rules_changes.p50_s),
                opt(a.sync_rules_changes.mean_s()),
                a.sync_rules_all.count,
                fmt_dur_s(a.sync_rules_all.sum_s),
                opt(a.npl_changes.p50_s),
                opt(a.npl_changes.mean_s()),
                a.cpu_s.map_or("-".into(), |c| format!("{c:.2}")),
                rat(a.cpu_s, b.and_then(|b| b.1.cpu_s)),
                a.peak_rss.map_or("-".into(), |x| fmt_bytes(x as f64)),
                rat(
                    a.peak_rss.map(|x| x as f64),
                    b.and_then(|b| b.1.peak_rss.map(|x| x as f64))
                ),
                a.churn_cpu_per_1000_s
                    .map_or("-".into(), |c| format!("{c:.3} s")),
                rat(a.churn_cpu_per_1000_s, b.and_then(|b| b.1.churn_cpu_per_1000_s)),
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "Through the real EndpointSlice controller (Ready written: the churn pod's Ready condition written through the API, the clock started before the `kubectl patch` process, to the first connection it answers through a Service selecting it; the write's own time beside it; the control plane's peak RSS at the end of this N):\n"
        );
        let _ = writeln!(
            s,
            "| mode | Ready written → first connection p50 / p99 (rounds) | the write itself p50 | kube-apiserver peak RSS | etcd peak RSS |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|");
        let ms = |x: Option<f64>| x.map_or("-".into(), |v| fmt_dur_s(v / 1e3));
        let rss = |x: Option<u64>| x.map_or("-".into(), |v| fmt_bytes(v as f64));
        for (m, _, a) in &api {
            let _ = writeln!(
                s,
                "| {m} | {} / {} ({}) | {} | {} | {} |",
                ms(percentile(&a.ready_to_conn_ms, 0.5)),
                ms(percentile(&a.ready_to_conn_ms, 0.99)),
                a.ready_to_conn_ms.len(),
                ms(percentile(&a.ready_write_ms, 0.5)),
                rss(a.apiserver_peak_rss),
                rss(a.etcd_peak_rss),
            );
        }
        let _ = writeln!(s);
    }
    for (m, why) in &n.not_run {
        let _ = writeln!(s, "Not run at N = {}: {m}: {why}.\n", n.n);
    }
}

/// The tables of one family at one N: traffic, host clients, programming,
/// positions, the harness's checks.
fn family_tables(s: &mut String, n: &NResult, family: Family) {
    let modes = n.modes_of(family);
    let base = match family {
        Family::Ipv4 if modes.contains_key(REAL_BASE) => REAL_BASE,
        Family::Ipv4 => BASE,
        Family::Ipv6 => BASE6,
    };
    if base == REAL_BASE {
        let _ = writeln!(
            s,
            "Ratios against the real kube-proxy (iptables mode, its default).\n"
        );
    }
    let get = |m: &str| modes.get(m);
    {
        let _ = writeln!(
            s,
            "| mode | conn p50 | conn p99 | conn p99.9 | conn/s | HTTP req/s (wrk, close) | TCP RR p50 | UDP RR p50 | bulk Gbit/s |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
        let metric = |m: &str, f: &dyn Fn(&ModeResult, &str) -> Option<f64>| -> Option<f64> {
            get(m).and_then(|mr| f(mr, m))
        };
        type F<'a> = Box<dyn Fn(&ModeResult, &str) -> Option<f64> + 'a>;
        let cols: Vec<(F, u8)> = vec![
            (
                Box::new(|mr: &ModeResult, m: &str| conn_main(n, m, mr).map(|c| c.p50_us)),
                1,
            ),
            (
                Box::new(|mr: &ModeResult, m: &str| conn_main(n, m, mr).map(|c| c.p99_us)),
                1,
            ),
            (
                Box::new(|mr: &ModeResult, m: &str| conn_main(n, m, mr).map(|c| c.p999_us)),
                1,
            ),
            (Box::new(|mr: &ModeResult, _: &str| mr.conn_rate), 0),
            (Box::new(|mr: &ModeResult, _: &str| mr.http_rps), 0),
            (
                Box::new(|mr: &ModeResult, _: &str| mr.tcp_rr.as_ref().map(|x| x.p50_us)),
                1,
            ),
            (
                Box::new(|mr: &ModeResult, _: &str| mr.udp_rr.as_ref().map(|x| x.p50_us)),
                1,
            ),
            (
                Box::new(|mr: &ModeResult, _: &str| mr.bulk_bps.map(|b| b / 1e9)),
                2,
            ),
        ];
        for (mode, mr) in modes.iter().chain(std::iter::once((
            &"proxy-xdp".to_string(),
            &ModeResult::default(),
        ))) {
            let mut row = format!("| {mode} |");
            if mode == "proxy-xdp" {
                row.push_str(" n/a (XDP only changes external traffic to backends on other nodes; none in this lab) | | | | | | | |");
                let _ = writeln!(s, "{row}");
                continue;
            }
            for (f, prec) in &cols {
                let x = f(mr, mode);
                let ipt = metric(base, &**f);
                let fl = metric(FLOOR, &**f);
                let abs = x.map_or("-".into(), |v| format!("{v:.*}", *prec as usize));
                let _ = write!(row, " {} |", with_ratios(abs, x, ipt, fl, true));
            }
            let _ = writeln!(s, "{row}");
        }
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "Host clients (the node's own namespace: socket hooks in proxy-tc, the OUTPUT chain in kube-proxy's layouts; floor: the node straight to the pod):\n"
        );
        let _ = writeln!(
            s,
            "| mode | host conn p50 | host conn p99 | host conn/s | host UDP RR p50 |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|");
        let hcols: Vec<(F, u8)> = vec![
            (
                Box::new(|mr: &ModeResult, _: &str| mr.host_conn.as_ref().map(|c| c.p50_us)),
                1,
            ),
            (
                Box::new(|mr: &ModeResult, _: &str| mr.host_conn.as_ref().map(|c| c.p99_us)),
                1,
            ),
            (Box::new(|mr: &ModeResult, _: &str| mr.host_conn_rate), 0),
            (
                Box::new(|mr: &ModeResult, _: &str| mr.host_udp_rr.as_ref().map(|r| r.p50_us)),
                1,
            ),
        ];
        for (mode, mr) in modes {
            let mut row = format!("| {mode} |");
            for (f, prec) in &hcols {
                let x = f(mr, mode);
                let ipt = metric(base, &**f);
                let fl = metric(FLOOR, &**f);
                let abs = x.map_or("-".into(), |v| format!("{v:.*}", *prec as usize));
                let _ = write!(row, " {} |", with_ratios(abs, x, ipt, fl, true));
            }
            let _ = writeln!(s, "{row}");
        }
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "| mode | program N from empty | nft single transaction | one change at N | change → first connection | kernel memory | agent RSS |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|");
        for (mode, mr) in modes {
            if mode == FLOOR {
                continue;
            }
            let b = get(base).map(|m| &m.prog);
            let p = &mr.prog;
            let prog = with_ratios(
                p.from_empty_s.map_or("-".into(), fmt_dur_s),
                p.from_empty_s,
                b.and_then(|b| b.from_empty_s),
                None,
                false,
            );
            let single = match (p.single_tx_s, p.single_tx_capped) {
                (Some(x), true) => format!("> {}", fmt_dur_s(x)),
                (Some(x), false) => fmt_dur_s(x),
                _ => "-".into(),
            };
            let change = with_ratios(
                p.change_ms.map_or("-".into(), |x| fmt_dur_s(x / 1e3)),
                p.change_ms,
                b.and_then(|b| b.change_ms),
                None,
                false,
            );
            let npl = with_ratios(
                p.npl_ms.map_or("-".into(), |x| fmt_dur_s(x / 1e3)),
                p.npl_ms,
                b.and_then(|b| b.npl_ms),
                None,
                false,
            );
            let kmem = match (p.bpf_memlock, p.kernel_mem_delta) {
                (Some(ml), Some(d)) => {
                    format!("maps {} (Δ {})", fmt_bytes(ml as f64), fmt_bytes(d as f64))
                }
                (None, Some(d)) => format!("Δ {}", fmt_bytes(d as f64)),
                _ => "-".into(),
            };
            let rss = p.agent_rss.map_or("-".into(), |x| fmt_bytes(x as f64));
            let _ = writeln!(
                s,
                "| {mode} | {prog} | {single} | {change} | {npl} | {kmem} | {rss} |"
            );
        }
        let _ = writeln!(s);
        if n.positions.len() > 1 {
            let pos: Vec<&String> = n.positions.keys().collect();
            let _ = writeln!(
                s,
                "Connection latency p50 (µs, ×{base}) by the target's position in KUBE-SERVICES ({}):\n",
                n.positions.iter().map(|(k, v)| format!("{k} = #{v}")).collect::<Vec<_>>().join(", ")
            );
            let _ = writeln!(
                s,
                "| mode | {} |",
                pos.iter()
                    .map(|p| p.as_str())
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
            let _ = writeln!(s, "|---|{}", "---|".repeat(pos.len()));
            for (mode, mr) in modes {
                if mode == FLOOR {
                    continue;
                }
                let mut row = format!("| {mode} |");
                for p in &pos {
                    let x = mr.conn.get(*p).map(|c| c.p50_us);
                    let b = get(base).and_then(|m| m.conn.get(*p)).map(|c| c.p50_us);
                    let _ = write!(
                        row,
                        " {} |",
                        with_ratios(
                            x.map_or("-".into(), |v| format!("{v:.1}")),
                            x,
                            b,
                            None,
                            false
                        )
                    );
                }
                let _ = writeln!(s, "{row}");
            }
            let _ = writeln!(s);
        }
        let failed: Vec<String> = modes
            .iter()
            .flat_map(|(m, mr)| {
                mr.checks
                    .iter()
                    .filter(|c| !c.ok)
                    .map(move |c| format!("{m}: {} ({})", c.name, c.detail))
            })
            .collect();
        if failed.is_empty() {
            let _ = writeln!(s, "Harness checks: all hold (traffic delivered in every mode, spread over the backends within ±50% of a fair share, replies from the dialled address, client address kept, no failed exchange).\n");
        } else {
            let _ = writeln!(s, "Harness checks FAILED:\n");
            for f in failed {
                let _ = writeln!(s, "- {f}");
            }
            let _ = writeln!(s);
        }
    }
}

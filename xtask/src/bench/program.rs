//! Programming measurements: N services loaded from empty in each mode,
//! then one change a few times, with the network-programming latency to
//! the first successful connection.
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::Result;

use super::layouts::{self, service_entries, svc_addr, Entry};
use super::mode_lab::ModeLab;
use super::results::median;
use super::sys::{self, Timed};
use super::{check_interrupted, load, log, Config, Family, Mode, ProgStats};

fn entries_for(
    n: usize,
    targets: &BTreeSet<usize>,
    family: Family,
    pod_ips: &[IpAddr],
    e: usize,
) -> Vec<Entry> {
    let dummies: Vec<IpAddr> = (0..e).map(|k| layouts::dummy_ep_in(family, k)).collect();
    let mut v = Vec::with_capacity(n + targets.len());
    for i in 0..n {
        if targets.contains(&i) {
            v.extend(service_entries(i, family, pod_ips, true));
        } else {
            v.extend(service_entries(i, family, &dummies, false));
        }
    }
    v
}

pub(super) fn program(
    ml: &mut ModeLab,
    n: usize,
    targets: &BTreeSet<usize>,
    cfg: &Config,
) -> Result<ProgStats> {
    let mut p = ProgStats::default();
    if ml.mode == Mode::None {
        return Ok(p);
    }
    if ml.mode.is_api() {
        return super::api::program(ml, n, targets, cfg);
    }
    let family = ml.family;
    let entries = entries_for(n, targets, family, &ml.pod_ips, cfg.endpoints);
    let node = ml.node_ns.clone();
    let settle = Duration::from_millis(300);
    match ml.mode {
        Mode::IptablesLegacy | Mode::IptablesNft => {
            let bin = ml.mode.restore_bin(family).expect("iptables mode");
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
            nft_delete_table(&node, family);
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
                nft_delete_table(&node, family);
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
        Mode::ProxyTc | Mode::ProxyMaglev | Mode::ProxyStack => {
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
            let text = layouts::manifests(&entries, ml.mode.lb_algorithm());
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
        Mode::KubeProxyIptables | Mode::KubeProxyNftables | Mode::ProxyK8s => unreachable!(),
    }
    ml.entries = entries;

    // One change at N: add service n+k (real endpoints), a few times.
    for k in 0..cfg.changes {
        check_interrupted()?;
        std::thread::sleep(Duration::from_millis(150));
        let new = service_entries(n + k, family, &ml.pod_ips, false);
        let target = svc_addr(family, n + k);
        let (change, npl) = match ml.mode {
            Mode::IptablesLegacy | Mode::IptablesNft => {
                let bin = ml.mode.restore_bin(family).expect("iptables mode");
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
            Mode::ProxyTc | Mode::ProxyMaglev | Mode::ProxyStack => {
                let text = layouts::manifests(&new, ml.mode.lb_algorithm());
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
            Mode::None | Mode::KubeProxyIptables | Mode::KubeProxyNftables | Mode::ProxyK8s => {
                unreachable!()
            }
        };
        ml.entries.extend(new);
        p.change_all_ms.push(change.as_secs_f64() * 1e3);
        p.npl_all_ms.push(npl.map(|d| d.as_secs_f64() * 1e3));
    }
    p.change_ms = median(&mut p.change_all_ms.clone());
    p.npl_ms = median(&mut p.npl_all_ms.iter().flatten().copied().collect::<Vec<_>>());
    if ml.mode.is_proxy() {
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
    target: SocketAddr,
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

/// Drops kube-proxy's nftables table of `family` in `node`, if there is
/// one (an error, e.g. no such table, is ignored).
fn nft_delete_table(node: &str, family: Family) {
    let table = match family {
        Family::Ipv4 => "delete table ip kube-proxy\n",
        Family::Ipv6 => "delete table ip6 kube-proxy\n",
    };
    let _ = sys::exec_in(node, "nft", &["-f", "/dev/stdin"], table, None);
}

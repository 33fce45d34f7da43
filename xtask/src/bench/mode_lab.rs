//! The lab of one mode in one address family: a node namespace with the
//! pods' servers and a client, the agent for `proxy-tc`, and what the
//! measurements do to it (reset state between cells, follow the agent's
//! syncs, add manifests). An IPv6 mode's lab is dual-stack, and its
//! traffic is all IPv6.
//!
//! The agent runs with its default map capacities unless the run's largest
//! N would not fit them with 25% headroom: then it gets a config file
//! (`--config`) whose `mapSizes` fits that N ([`MapSizes::needed`]).
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::layouts::Entry;
use super::load::Servers;
use super::{check_interrupted, sys, Config, Family, Mode};
use crate::lab::Lab;
use crate::netns::in_netns;
use crate::setup;

pub(super) struct ModeLab {
    pub(super) mode: Mode,
    pub(super) family: Family,
    pub(super) lab: Lab,
    servers: Option<Servers>,
    pub(super) node_ns: String,
    pub(super) client_ns: String,
    /// The client's address in [`family`](ModeLab::family), as the pods see it.
    pub(super) client_ip: IpAddr,
    /// The pods' addresses in [`family`](ModeLab::family).
    pub(super) pod_ips: Vec<IpAddr>,
    /// The pods' network namespaces (their servers' sockets).
    pub(super) pod_ns: Vec<String>,
    /// Entries programmed now.
    pub(super) entries: Vec<Entry>,
    /// API modes: the targets' (ClusterIP, port), by Service index (the
    /// allocator's, where the other modes' follow the layout).
    pub(super) vips: BTreeMap<usize, SocketAddr>,
    /// API modes: what the lab holds between N.
    pub(super) api: Option<super::api::ApiLab>,
    bench_files: Vec<PathBuf>,
    /// The agent's config file, when the bench wrote one (removed with the lab).
    _agent_config: Option<AgentConfigFile>,
}

/// The agent's config file the bench wrote: removed when dropped.
struct AgentConfigFile(PathBuf);

impl Drop for AgentConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The agent's default capacities of the maps `mapSizes` sets
/// (`proxy_common::capacity::{SERVICES, BACKENDS, REV_NAT}`; the test
/// `default_map_sizes_are_the_agents` checks them against that file).
pub(super) const DEFAULT_MAP_SIZES: MapSizes = MapSizes {
    services: 65_536 * 4,
    backends: 65_536 * 2,
    reverse_nat: 65_536,
};

/// Services counted beyond the bench's own when sizing the maps: the
/// lab's own Services (none today), the target Services' UDP ports and
/// slack.
const EXTRA_SERVICES: u64 = 64;

/// The largest value the agent takes in `mapSizes` (2^24 entries).
const MAP_SIZE_MAX: u64 = 1 << 24;

/// The agent's `mapSizes` (entries of its Service maps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MapSizes {
    /// One entry per frontend plus one per backend slot.
    pub(super) services: u32,
    /// One entry per backend.
    pub(super) backends: u32,
    /// One entry (reverse-NAT id) per frontend.
    pub(super) reverse_nat: u32,
}

impl MapSizes {
    /// The sizes `services` Services of `endpoints` endpoints each need
    /// (plus [`EXTRA_SERVICES`]), with 25% headroom: `None` when the
    /// defaults hold them; else every map at the larger of its default and
    /// the need rounded up to a power of two (at most [`MAP_SIZE_MAX`]).
    pub(super) fn needed(services: usize, endpoints: usize) -> Option<MapSizes> {
        let s = services as u64 + EXTRA_SERVICES;
        let e = endpoints.max(1) as u64;
        // × 1.25, rounded up.
        let headroom = |x: u64| x.saturating_mul(5).div_ceil(4);
        let need = [
            headroom(s.saturating_mul(1 + e)),
            headroom(s.saturating_mul(e)),
            headroom(s),
        ];
        let defaults = [
            DEFAULT_MAP_SIZES.services,
            DEFAULT_MAP_SIZES.backends,
            DEFAULT_MAP_SIZES.reverse_nat,
        ];
        if need.iter().zip(defaults).all(|(n, d)| *n <= u64::from(d)) {
            return None;
        }
        let size = |n: u64, d: u32| -> u32 {
            let p = n
                .checked_next_power_of_two()
                .unwrap_or(MAP_SIZE_MAX)
                .min(MAP_SIZE_MAX);
            (p as u32).max(d)
        };
        Some(MapSizes {
            services: size(need[0], defaults[0]),
            backends: size(need[1], defaults[1]),
            reverse_nat: size(need[2], defaults[2]),
        })
    }

    /// The sizes the bench's labs need: the run's largest N, with its
    /// changes, at its endpoints per Service.
    pub(super) fn for_config(cfg: &Config) -> Option<MapSizes> {
        let n = cfg.ns.iter().copied().max().unwrap_or(0);
        MapSizes::needed(n.saturating_add(cfg.changes), cfg.endpoints)
    }

    /// The agent's config file setting them (KubeProxyConfiguration-style).
    pub(super) fn config_yaml(&self) -> String {
        format!(
            "kind: ProxyAgentConfiguration\napiVersion: proxy-agent/v1alpha1\nmapSizes:\n  services: {}\n  backends: {}\n  reverseNat: {}\n",
            self.services, self.backends, self.reverse_nat
        )
    }

    /// `services=… backends=… reverseNat=…`, for the log and the results.
    pub(super) fn summary(&self) -> String {
        format!(
            "services={} backends={} reverseNat={}",
            self.services, self.backends, self.reverse_nat
        )
    }
}

/// Writes the agent's config file for `mode` in `family` when the run
/// needs other map sizes than the defaults.
fn write_agent_config(mode: Mode, family: Family, cfg: &Config) -> Result<Option<AgentConfigFile>> {
    let Some(sizes) = MapSizes::for_config(cfg) else {
        return Ok(None);
    };
    if crate::lab::AgentImage::from_env().is_some() {
        bail!(
            "N={:?} at {} endpoints needs the agent's maps at {} (beyond the defaults), \
             which the bench passes as a config file to the agent's process; under runc \
             (KPR_LAB_AGENT=runc) the agent reads deploy/'s ConfigMap instead: unset \
             KPR_LAB_AGENT or run a smaller N",
            cfg.ns,
            cfg.endpoints,
            sizes.summary()
        );
    }
    let path = std::env::temp_dir().join(format!(
        "kpr-bench-{}-agent-{}-{}.yaml",
        std::process::id(),
        mode.name(),
        family.name()
    ));
    let file = AgentConfigFile(path.clone());
    std::fs::write(&path, sizes.config_yaml())
        .with_context(|| format!("writing {}", path.display()))?;
    super::log(format!(
        "{} ({}): agent map sizes {} ({})",
        mode.name_in(family),
        family.label(),
        sizes.summary(),
        path.display()
    ));
    Ok(Some(file))
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

pub(super) fn agent_bin(cfg: &Config) -> Result<PathBuf> {
    if let Some(p) = &cfg.agent_bin {
        return Ok(p.clone());
    }
    // The release agent, brought up to date (a no-op when it is).
    setup::build_agent()
}

impl ModeLab {
    pub(super) fn start(mode: Mode, family: Family, cfg: &Config) -> Result<ModeLab> {
        if mode.is_api() && family != Family::Ipv4 {
            bail!("{} runs in IPv4 only", mode.name());
        }
        // API modes: the agent's lab starts with it (so the lab keeps its
        // binary), and the first N stops it before programming from empty.
        let with_agent = mode.is_proxy();
        let mut manifests = pods_yaml(cfg.endpoints);
        if mode.is_api() {
            manifests.push_str(&super::api::churn_objects(cfg));
        }
        let mut b = Lab::builder()
            .manifests_yaml(&manifests)
            .ipv6(family == Family::Ipv6)
            .agent(with_agent);
        if mode.is_api() {
            b = b.control_plane(true);
        }
        let mut agent_config = None;
        if mode.is_proxy() {
            b = b
                .agent_bin(agent_bin(cfg)?)
                .rust_log("info")
                .agent_arg("--delivery-mode")
                .agent_arg(mode.delivery_mode());
            agent_config = write_agent_config(mode, family, cfg)?;
            if let Some(f) = &agent_config {
                b = b
                    .agent_arg("--config")
                    .agent_arg(f.0.to_string_lossy().into_owned());
            }
        }
        let mut lab = b.start()?;
        if with_agent && !mode.is_api() {
            lab.wait_ready(Duration::from_secs(60))?;
            lab.wait_attached(Duration::from_secs(30))?;
        }
        let mut pods: Vec<(String, IpAddr, String)> = Vec::new();
        for p in lab
            .pods()
            .iter()
            .filter(|p| !p.host_if.is_empty() && p.name.starts_with("bench-"))
        {
            let ip = match family {
                Family::Ipv4 => p.ip.into(),
                Family::Ipv6 => p
                    .ip6
                    .with_context(|| format!("pod {} has no IPv6 address", p.name))?
                    .into(),
            };
            pods.push((p.name.clone(), ip, p.netns.clone()));
        }
        pods.sort();
        let client_ip: IpAddr = match family {
            Family::Ipv4 => lab.client().ip.into(),
            Family::Ipv6 => lab
                .client()
                .ip6
                .context("the client has no IPv6 address")?
                .into(),
        };
        // A wide ephemeral range in the client: fewer reuses of a 4-tuple
        // whose previous connection is still in TIME_WAIT at the pod.
        crate::netns::sysctl_in(
            &lab.client().netns,
            "net.ipv4.ip_local_port_range",
            "1024 65535",
        )?;
        // The node's own clients (the host-client cells): kube-proxy's OUTPUT
        // chain DNATs after the socket's route lookup, which needs a route to
        // the VIPs (a real node's default route). The socket hooks need none.
        if mode.is_kube_proxy() {
            let r = match family {
                Family::Ipv4 => vec!["route", "add", super::layouts::SVC_CIDR, "dev", "lo"],
                Family::Ipv6 => vec!["-6", "route", "add", super::layouts::SVC_CIDR6, "dev", "lo"],
            };
            crate::netns::ip_in(&lab.node().netns, &r)?;
        }
        if pods.len() != cfg.endpoints {
            bail!("lab has {} pods, wanted {}", pods.len(), cfg.endpoints);
        }
        let mut served = pods
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let bind = match family {
                    Family::Ipv4 => std::net::Ipv4Addr::UNSPECIFIED.into(),
                    Family::Ipv6 => p.1,
                };
                (p.2.clone(), i, bind)
            })
            .collect::<Vec<_>>();
        if mode.is_api() {
            // The churn pod answers too: the Ready rounds connect to it.
            let churn = lab
                .pods()
                .iter()
                .find(|p| p.name == super::api::CHURN_POD)
                .context("the lab has no churn pod")?;
            served.push((
                churn.netns.clone(),
                cfg.endpoints,
                std::net::Ipv4Addr::UNSPECIFIED.into(),
            ));
        }
        let servers = Servers::start(&served)?;
        Ok(ModeLab {
            mode,
            family,
            node_ns: lab.node().netns.clone(),
            client_ns: lab.client().netns.clone(),
            client_ip,
            pod_ips: pods.iter().map(|p| p.1).collect(),
            pod_ns: pods.iter().map(|p| p.2.clone()).collect(),
            lab,
            servers: Some(servers),
            entries: Vec::new(),
            vips: BTreeMap::new(),
            api: None,
            bench_files: Vec::new(),
            _agent_config: agent_config,
        })
    }

    pub(super) fn down(mut self) -> Result<()> {
        if let Some(s) = self.servers.take() {
            s.stop();
        }
        self.lab.down()
    }

    /// The mode's name in its family (`ip6tables-legacy`, ...).
    pub(super) fn name(&self) -> &'static str {
        self.mode.name_in(self.family)
    }

    /// `<mode>` in IPv4, `<mode> (IPv6)` in IPv6: for the log.
    pub(super) fn label(&self) -> String {
        match self.family {
            Family::Ipv4 => self.name().to_string(),
            Family::Ipv6 => format!("{} (IPv6)", self.name()),
        }
    }

    /// Forgets kernel conntrack of the lab's family (node namespace) and
    /// the agent's LRU conntrack, so every cell starts cold.
    pub(super) fn reset_state(&self) -> Result<()> {
        let family = self.family;
        let r = in_netns(&self.node_ns, move || sys::flush_conntrack_here(family))?;
        if let Err(e) = r {
            // No conntrack in this namespace (no rules loaded): nothing to flush.
            if self.mode.is_kube_proxy() || self.mode.real_kube_proxy().is_some() {
                bail!("conntrack flush in {}: {e}", self.node_ns);
            }
        }
        if self.mode.is_proxy() {
            let ct = self.lab.info().bpffs.join(proxy_ct_map(self.family));
            if ct.exists() {
                sys::clear_pinned_map(&ct).with_context(|| format!("clear {}", ct.display()))?;
            }
        }
        self.clear_time_wait()
    }

    /// Closes the pods' TIME_WAIT sockets (`ss -K`, sock_diag's destroy),
    /// with the NAT state above: the servers close first, so each
    /// connection leaves one at the pod, and a later cell's connection to
    /// another VIP may reuse its client port towards the same pod. Without
    /// the NAT's memory of the old flow (flushed), nothing moves the new
    /// one to another port (as nf_nat or the proxy's collision check would
    /// if it were kept), and the pod, seeing TCP timestamps from another
    /// per-destination offset, refuses the SYN (PAWS): the client waits
    /// for a retransmission.
    fn clear_time_wait(&self) -> Result<()> {
        for ns in &self.pod_ns {
            crate::netns::run(std::process::Command::new("ip").args([
                "netns",
                "exec",
                ns,
                "ss",
                "-K",
                "-t",
                "state",
                "time-wait",
            ]))
            .with_context(|| format!("closing the TIME_WAIT sockets of {ns}"))?;
        }
        Ok(())
    }

    /// The lab's own processes: the agent or kube-proxy, and the control
    /// plane's (not counted as other processes' noise).
    pub(super) fn own_pids(&self) -> Vec<u32> {
        let n = self.lab.info().node.clone();
        let mut v: Vec<u32> = n.agent.iter().map(|a| a.pid).collect();
        v.extend(n.kube_proxy.iter().map(|k| k.pid));
        if let Some(cp) = self.lab.control_plane() {
            v.extend(
                [cp.etcd, cp.apiserver, cp.controller_manager]
                    .into_iter()
                    .flatten(),
            );
        }
        v
    }

    pub(super) fn agent_log_len(&self) -> u64 {
        std::fs::metadata(self.lab.agent_log_path())
            .map(|m| m.len())
            .unwrap_or(0)
    }

    /// Waits for a `sync complete` line after byte `offset` of the agent's
    /// log reporting `frontends` frontends; returns when it was seen.
    pub(super) fn wait_frontends(
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

    pub(super) fn remove_bench_files(&mut self) -> Result<bool> {
        let mut removed = false;
        for f in self.bench_files.drain(..) {
            if f.exists() {
                std::fs::remove_file(&f)?;
                removed = true;
            }
        }
        Ok(removed)
    }

    pub(super) fn write_bench_file(&mut self, name: &str, text: &str) -> Result<()> {
        let dir = self.lab.info().manifests_dir.clone();
        let tmp = dir.join(format!(".{name}.tmp"));
        let path = dir.join(name);
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &path)?;
        self.bench_files.push(path);
        Ok(())
    }
}

/// The agent's pinned conntrack map of `family`.
fn proxy_ct_map(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => "CT4_V2",
        Family::Ipv6 => "CT6_V2",
    }
}

fn tail_str(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Up to ~52,000 Services of 2 endpoints the defaults hold them with
    /// 25% headroom: no config file, today's runs unchanged.
    #[test]
    fn no_map_sizes_while_the_defaults_fit() {
        assert_eq!(MapSizes::needed(50_000, 2), None);
        assert_eq!(MapSizes::needed(1, 1), None);
        assert_eq!(MapSizes::needed(10_000, 8), None);
        let cfg = Config::sanity();
        assert_eq!(MapSizes::for_config(&cfg), None);
        let cfg = Config {
            ns: vec![1, 100, 1000, 10_000, 50_000],
            changes: 5,
            ..Config::sanity()
        };
        assert_eq!(MapSizes::for_config(&cfg), None);
    }

    /// Beyond, every map fits N × (1 + E), N × E and N frontends with 25%
    /// headroom, at a power of two no smaller than its default.
    #[test]
    fn map_sizes_fit_large_runs() {
        for (n, e) in [
            (100_000, 2),
            (200_000, 2),
            (65_534, 2),
            (100_000, 1),
            (200_000, 8),
        ] {
            let m = MapSizes::needed(n, e).unwrap_or_else(|| panic!("N={n} E={e}"));
            let fits = |size: u32, need: usize, default: u32| {
                assert!(size.is_power_of_two(), "{size}");
                assert!(size >= default, "{size} < {default}");
                assert!(
                    size as f64 >= need as f64 * 1.25,
                    "N={n} E={e}: {size} < {need} × 1.25"
                );
            };
            fits(m.services, n * (1 + e), DEFAULT_MAP_SIZES.services);
            fits(m.backends, n * e, DEFAULT_MAP_SIZES.backends);
            fits(m.reverse_nat, n, DEFAULT_MAP_SIZES.reverse_nat);
        }
        assert_eq!(
            MapSizes::needed(100_000, 2),
            Some(MapSizes {
                services: 524_288,
                backends: 262_144,
                reverse_nat: 131_072,
            })
        );
        // The run's largest N decides (the labs serve every N).
        let cfg = Config {
            ns: vec![1, 100_000, 1000],
            ..Config::sanity()
        };
        assert_eq!(MapSizes::for_config(&cfg), MapSizes::needed(100_000, 2));
        assert_eq!(
            MapSizes::needed(100_000, 2).unwrap().config_yaml(),
            "kind: ProxyAgentConfiguration\napiVersion: proxy-agent/v1alpha1\nmapSizes:\n  services: 524288\n  backends: 262144\n  reverseNat: 131072\n"
        );
    }

    /// [`DEFAULT_MAP_SIZES`] are the agent's defaults (proxy-common's
    /// `capacity` module, read as text: `a * b` products of literals).
    #[test]
    fn default_map_sizes_are_the_agents() {
        let path = setup::workspace_root().join("proxy-common/src/lib.rs");
        let Ok(text) = std::fs::read_to_string(&path) else {
            eprintln!("skipped: {} missing", path.display());
            return;
        };
        let Some(module) = text.split("pub mod capacity").nth(1) else {
            eprintln!("skipped: no capacity module in {}", path.display());
            return;
        };
        let value = |name: &str| -> Option<u64> {
            let expr = module
                .lines()
                .find_map(|l| l.trim().strip_prefix(&format!("pub const {name}: u32 = ")))?;
            expr.trim_end_matches(';')
                .split('*')
                .map(|f| f.trim().replace('_', "").parse::<u64>().ok())
                .product()
        };
        for (name, mine) in [
            ("SERVICES", DEFAULT_MAP_SIZES.services),
            ("BACKENDS", DEFAULT_MAP_SIZES.backends),
            ("REV_NAT", DEFAULT_MAP_SIZES.reverse_nat),
        ] {
            match value(name) {
                Some(v) => assert_eq!(v, u64::from(mine), "capacity::{name}"),
                None => eprintln!("capacity::{name}: not a product of literals, not compared"),
            }
        }
    }
}

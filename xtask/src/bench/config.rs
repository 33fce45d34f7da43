//! What a run measures: the command's arguments, the modes compared, the
//! address families they are compared in, and the run's [`Config`] (full,
//! quick, or the sanity tests').
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, Result};
use serde::{Deserialize, Serialize};

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
    /// Modes to run (default all): none, iptables-legacy, iptables-nft, nftables, proxy-tc,
    /// proxy-tc-maglev, proxy-tc-stack (ip6tables-legacy and ip6tables-nft name the
    /// iptables modes too: in the IPv6 run they are those); and, on a lab with a real
    /// control plane (IPv4), kube-proxy-iptables and kube-proxy-nftables (the real
    /// kube-proxy v1.37.2) and proxy-tc-k8s (the agent, `--source kubernetes`).
    #[arg(long, value_delimiter = ',')]
    pub modes: Vec<String>,
    /// Address families to run every mode in (default both): ipv4, ipv6.
    #[arg(long, value_delimiter = ',')]
    pub family: Vec<String>,
    /// Connections per latency cell.
    #[arg(long)]
    pub samples: Option<usize>,
    /// Rounds (modes interleaved in each).
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Cap of one single nft transaction loading all N services, seconds.
    #[arg(long)]
    pub nft_cap: Option<u64>,
    /// The largest N the API modes (kube-proxy-*, proxy-tc-k8s) run at: their
    /// Services are created through the API server, ~50 s per 1,000 on a loaded
    /// 2-core machine at 10,000; larger N are reported as not run. The lab's
    /// IPv4 ServiceCIDR (a /16) caps it below 65,536 in any case.
    #[arg(long, default_value_t = 10_000)]
    pub api_max_n: usize,
    /// The proxy-agent binary (default: target/release/proxy-agent if built, else debug).
    #[arg(long, env = "KPR_BENCH_AGENT_BIN")]
    pub agent_bin: Option<PathBuf>,
    /// Run nothing: redraw `results.md` and the charts of an earlier run
    /// from the `results.json` in this directory.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["quick", "n", "modes", "family", "out"])]
    pub replot: Option<PathBuf>,
}

/// The address family a mode's lab carries traffic in.
///
/// IPv4 runs in a single-stack lab, as before there was IPv6; IPv6 in a
/// dual-stack lab ([`crate::lab::LabBuilder::dual_stack`]): the client
/// dials the pods' and the Services' IPv6 addresses (2001:2::/48), and
/// kube-proxy's layouts are its IPv6 ones (ip6tables, nftables `ip6`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::Ipv4, Family::Ipv6];

    /// `ipv4` or `ipv6` (the `--family` values).
    pub fn name(self) -> &'static str {
        match self {
            Family::Ipv4 => "ipv4",
            Family::Ipv6 => "ipv6",
        }
    }

    /// `IPv4` or `IPv6`, for people.
    pub fn label(self) -> &'static str {
        match self {
            Family::Ipv4 => "IPv4",
            Family::Ipv6 => "IPv6",
        }
    }

    pub fn parse(s: &str) -> Result<Family> {
        Family::ALL
            .into_iter()
            .find(|f| f.name() == s.to_ascii_lowercase())
            .ok_or_else(|| anyhow!("unknown family {s:?} (ipv4, ipv6)"))
    }
}

/// A mode of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Mode {
    None,
    IptablesLegacy,
    IptablesNft,
    Nftables,
    ProxyTc,
    /// The same agent, every Service annotated `proxy-agent.io/lb-algorithm:
    /// maglev`: Maglev against random side by side.
    ProxyMaglev,
    /// The same agent with `--delivery-mode stack`: translated packets go
    /// through the host's stack and its FORWARD hook (NetworkPolicy-safe),
    /// against `proxy-tc`'s redirect.
    ProxyStack,
    /// The real kube-proxy, iptables mode, on a lab with a real control
    /// plane: Services made through the API server.
    KubeProxyIptables,
    /// The real kube-proxy, nftables mode, likewise.
    KubeProxyNftables,
    /// The agent with `--source kubernetes` against the same kind of lab.
    ProxyK8s,
}

impl Mode {
    pub const ALL: [Mode; 10] = [
        Mode::None,
        Mode::IptablesLegacy,
        Mode::IptablesNft,
        Mode::Nftables,
        Mode::ProxyTc,
        Mode::ProxyMaglev,
        Mode::ProxyStack,
        Mode::KubeProxyIptables,
        Mode::KubeProxyNftables,
        Mode::ProxyK8s,
    ];

    /// The modes programmed without an API server (rule layouts, the
    /// agent's manifests) and the floor.
    pub const LOCAL: [Mode; 7] = [
        Mode::None,
        Mode::IptablesLegacy,
        Mode::IptablesNft,
        Mode::Nftables,
        Mode::ProxyTc,
        Mode::ProxyMaglev,
        Mode::ProxyStack,
    ];

    /// The modes on a lab with a real control plane.
    pub const API: [Mode; 3] = [
        Mode::KubeProxyIptables,
        Mode::KubeProxyNftables,
        Mode::ProxyK8s,
    ];

    /// The mode's name in IPv4 (and the name it is asked for by).
    pub fn name(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::IptablesLegacy => "iptables-legacy",
            Mode::IptablesNft => "iptables-nft",
            Mode::Nftables => "nftables",
            Mode::ProxyTc => "proxy-tc",
            Mode::ProxyMaglev => "proxy-tc-maglev",
            Mode::ProxyStack => "proxy-tc-stack",
            Mode::KubeProxyIptables => "kube-proxy-iptables",
            Mode::KubeProxyNftables => "kube-proxy-nftables",
            Mode::ProxyK8s => "proxy-tc-k8s",
        }
    }

    /// The mode's name in `family`: kube-proxy's iptables modes are
    /// ip6tables in IPv6; the others keep their names.
    pub fn name_in(self, family: Family) -> &'static str {
        match (self, family) {
            (Mode::IptablesLegacy, Family::Ipv6) => "ip6tables-legacy",
            (Mode::IptablesNft, Family::Ipv6) => "ip6tables-nft",
            _ => self.name(),
        }
    }

    /// Whether this project's agent programs the lab.
    pub fn is_proxy(self) -> bool {
        matches!(
            self,
            Mode::ProxyTc | Mode::ProxyMaglev | Mode::ProxyStack | Mode::ProxyK8s
        )
    }

    /// Whether the mode runs on a lab with a real control plane, its
    /// Services made through the API server.
    pub fn is_api(self) -> bool {
        Mode::API.contains(&self)
    }

    /// The real kube-proxy's mode, for the modes that run it.
    pub fn real_kube_proxy(self) -> Option<crate::lab::kube_proxy::KubeProxyMode> {
        use crate::lab::kube_proxy::KubeProxyMode;
        match self {
            Mode::KubeProxyIptables => Some(KubeProxyMode::Iptables),
            Mode::KubeProxyNftables => Some(KubeProxyMode::Nftables),
            _ => None,
        }
    }

    /// The agent's `--delivery-mode` (explicit, so that no machine's
    /// netfilter changes what a mode measures).
    pub fn delivery_mode(self) -> &'static str {
        if self == Mode::ProxyStack {
            "stack"
        } else {
            "redirect"
        }
    }

    /// The load-balancing algorithm the Services ask for, if not the default.
    pub fn lb_algorithm(self) -> Option<&'static str> {
        (self == Mode::ProxyMaglev).then_some("maglev")
    }

    pub fn parse(s: &str) -> Result<Mode> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s || m.name_in(Family::Ipv6) == s)
            .ok_or_else(|| anyhow!("unknown mode {s:?}"))
    }

    /// kube-proxy's iptables modes: the restore command of `family`.
    pub(super) fn restore_bin(self, family: Family) -> Option<&'static str> {
        match (self, family) {
            (Mode::IptablesLegacy, Family::Ipv4) => Some("iptables-legacy-restore"),
            (Mode::IptablesNft, Family::Ipv4) => Some("iptables-nft-restore"),
            (Mode::IptablesLegacy, Family::Ipv6) => Some("ip6tables-legacy-restore"),
            (Mode::IptablesNft, Family::Ipv6) => Some("ip6tables-nft-restore"),
            _ => None,
        }
    }

    /// Whether kube-proxy's rules (iptables or nftables) run this mode.
    pub(super) fn is_kube_proxy(self) -> bool {
        matches!(
            self,
            Mode::IptablesLegacy | Mode::IptablesNft | Mode::Nftables
        )
    }
}

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub ns: Vec<usize>,
    pub endpoints: usize,
    pub modes: Vec<Mode>,
    /// Every mode runs in each of these families (a lab per mode and family).
    pub families: Vec<Family>,
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
    /// The API modes run at N up to this; above, they are reported as not run.
    pub api_max_n: usize,
    /// The API modes' endpoint churn: Services selecting the churn pod, and
    /// readiness flips of that pod (endpoint changes = their product).
    pub churn_services: usize,
    pub churn_flips: usize,
    /// The API modes' rounds of Ready written → first connection.
    pub ready_rounds: usize,
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
        let mut families: Vec<Family> = if a.family.is_empty() {
            Family::ALL.to_vec()
        } else {
            a.family
                .iter()
                .map(|f| Family::parse(f))
                .collect::<Result<_>>()?
        };
        families.sort();
        families.dedup();
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
            families,
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
            api_max_n: a.api_max_n,
            churn_services: 50,
            churn_flips: 20,
            ready_rounds: if full { 20 } else { 5 },
            max_steal_pct: 2.0,
            max_other_pct: 10.0,
            agent_bin: a.agent_bin.clone(),
            out: a.out.clone(),
            quick: a.quick,
        })
    }

    /// The sanity test's configuration: every mode but the API ones in
    /// IPv4, N = 1 and 100, few samples, one round.
    pub fn sanity() -> Config {
        Config {
            ns: vec![1, 100],
            endpoints: 2,
            modes: Mode::LOCAL.to_vec(),
            families: vec![Family::Ipv4],
            samples: 400,
            rr_samples: 200,
            rate_threads: 2,
            rate_duration: Duration::from_millis(200),
            bulk_duration: Duration::from_millis(200),
            rounds: 1,
            changes: 1,
            nft_chunk: 1000,
            nft_cap: None,
            api_max_n: 10_000,
            churn_services: 10,
            churn_flips: 2,
            ready_rounds: 1,
            max_steal_pct: 100.0,
            max_other_pct: 100.0,
            agent_bin: std::env::var_os("KPR_AGENT_BIN").map(PathBuf::from),
            out: None,
            quick: true,
        }
    }

    /// The sanity test's IPv6 configuration, kept short (CI's time is
    /// tight): the floor, one ip6tables layout, nftables `ip6` and the
    /// agent, at N = 1, with the IPv4 sanity run's samples.
    pub fn sanity_ipv6() -> Config {
        Config {
            ns: vec![1],
            modes: vec![
                Mode::None,
                Mode::IptablesLegacy,
                Mode::Nftables,
                Mode::ProxyTc,
            ],
            families: vec![Family::Ipv6],
            ..Config::sanity()
        }
    }

    /// The sanity test of the API modes: the floor and the real kube-proxy
    /// in both modes and the agent on labs with a real control plane, at
    /// N = 10, one round, few samples.
    pub fn sanity_api() -> Config {
        Config {
            ns: vec![10],
            modes: vec![
                Mode::None,
                Mode::KubeProxyIptables,
                Mode::KubeProxyNftables,
                Mode::ProxyK8s,
            ],
            samples: 200,
            rr_samples: 100,
            ..Config::sanity()
        }
    }
}

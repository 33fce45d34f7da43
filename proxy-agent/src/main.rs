use std::{io::IsTerminal, net::Ipv4Addr, path::PathBuf, time::Duration};

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use proxy_agent::{
    agent::{self, RunConfig},
    bpf::MapSizes,
};
use proxy_common::capacity;

/// eBPF replacement for kube-proxy: Service load-balancing in tc programs,
/// kept in sync with the cluster's Services and EndpointSlices.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Load the datapath, attach it to pod interfaces and keep it in sync.
    Run(RunArgs),
    /// Read the pinned maps of a running agent.
    Inspect(proxy_agent::inspect::InspectArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Source {
    /// Kubernetes YAML files (Services, EndpointSlices, Pods, Nodes), watched.
    Manifests,
}

#[derive(Parser)]
struct RunArgs {
    /// Where desired state comes from.
    #[arg(long, value_enum, default_value = "manifests")]
    source: Source,
    /// Manifest files or directories (with --source manifests); repeatable.
    #[arg(long, required_if_eq("source", "manifests"))]
    manifests: Vec<PathBuf>,
    /// This node's name (endpoints whose nodeName equals it are local).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// Directory on a bpffs mount where maps are pinned and adopted on restart.
    #[arg(long, default_value = "/sys/fs/bpf/proxy-agent")]
    bpffs: PathBuf,
    /// Glob patterns of pod interfaces (host side of pod veths), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "lxc*")]
    pod_interfaces: Vec<String>,
    /// Source address given to hairpin traffic (a pod reaching itself through a
    /// Service); Cilium's default service loopback address.
    #[arg(long, default_value = "169.254.42.1")]
    hairpin_snat_ip: Ipv4Addr,
    /// Minimum time between two syncs (kube-proxy's minSyncPeriod), e.g. 1s, 100ms.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    min_sync_period: Duration,
    /// Full resync period (kube-proxy's syncPeriod).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    sync_period: Duration,
    /// Capacity of the conntrack map (entries; two per flow).
    #[arg(long, default_value_t = capacity::CONNTRACK)]
    conntrack_max: u32,
}

/// Parses `250ms`, `1s`, `2m`, `1h` (kube-proxy's duration style).
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((s, "s"), |i| s.split_at(i));
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 1s, 250ms"))?;
    let secs = match unit {
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => {
            return Err(format!(
                "invalid duration {s:?}: unit must be ms, s, m or h"
            ))
        }
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("invalid duration {s:?}"));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run(a) => {
            let pod_interfaces = a
                .pod_interfaces
                .iter()
                .map(|p| {
                    glob::Pattern::new(p)
                        .with_context(|| format!("--pod-interfaces: bad pattern {p:?}"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let source: Box<dyn proxy_agent::source::Source> = match a.source {
                Source::Manifests => {
                    Box::new(proxy_agent::source::ManifestsSource::new(a.manifests))
                }
            };
            let cfg = RunConfig {
                node_name: a.node_name,
                bpffs: a.bpffs,
                pod_interfaces,
                hairpin_snat_ip: a.hairpin_snat_ip,
                min_sync_period: a.min_sync_period,
                sync_period: a.sync_period,
                map_sizes: MapSizes {
                    conntrack: a.conntrack_max,
                    ..MapSizes::default()
                },
            };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            rt.block_on(agent::run(cfg, source))?;
        }
        Cmd::Inspect(a) => proxy_agent::inspect::run(a)?,
    }
    Ok(())
}

use std::io::IsTerminal;

use anyhow::Context as _;
use clap::Parser;
use proxy_agent::{
    agent,
    cli::{Cli, Cmd, RunArgs},
    config::{Settings, SourceKind},
    sources::kubernetes::{self, KubernetesOptions, KubernetesSource},
    sources::{ManifestsSource, Source},
};
use tracing::{info, warn};

/// mimalloc (see [`proxy_agent::alloc`]).
#[global_allocator]
static ALLOCATOR: proxy_agent::alloc::Allocator = proxy_agent::alloc::Allocator;

async fn run(a: RunArgs) -> anyhow::Result<()> {
    let settings =
        Settings::from_flags(&a, &proxy_agent::host::facts()).context("configuration")?;
    if let Some(cidr) = settings.cluster_cidr {
        warn!(cluster_cidr = %cidr, "clusterCIDR is not used by the datapath yet; ignored");
    }
    info!(
        source = ?settings.source,
        node = %settings.node_name,
        min_sync_period = ?settings.min_sync_period,
        sync_period = ?settings.sync_period,
        "starting"
    );
    let source: Box<dyn Source> = match settings.source {
        SourceKind::Manifests => Box::new(ManifestsSource::new(settings.manifests.clone())),
        SourceKind::Kubernetes => {
            let (client, api_server) =
                kubernetes::client(settings.kubeconfig.as_deref(), settings.master.as_deref())
                    .await
                    .context("connecting to the API server")?;
            info!(api_server = %api_server.url, origin = ?api_server.origin, "API server");
            Box::new(KubernetesSource::new(
                client,
                KubernetesOptions {
                    node_name: settings.node_name.clone(),
                    service_proxy_name: settings.service_proxy_name.clone(),
                    api_server: Some(api_server),
                },
            ))
        }
    };
    agent::run(settings, source).await?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    proxy_agent::alloc::configure();
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
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            if let Err(e) = rt.block_on(run(*a)) {
                // EPERM/EACCES: name the capabilities this process lacks.
                return match proxy_agent::host::privileges::hint(e.as_ref()) {
                    Some(hint) => Err(e.context(hint)),
                    None => Err(e),
                };
            }
        }
        Cmd::Inspect(a) => proxy_agent::inspect::run(a)?,
        Cmd::Cleanup { bpffs } => {
            println!("{}", proxy_agent::cli::cleanup(&bpffs)?);
            let f = proxy_agent::bpf::cleanup_legacy_filters();
            if f > 0 {
                println!("removed legacy tc filters from {f} interfaces");
            }
            use proxy_agent::host::conntrack_hold::{release, TABLE};
            match release() {
                Ok(true) => println!(
                    "removed the nftables table inet {TABLE} (it kept the kernel's conntrack running for flows handed over from kube-proxy)"
                ),
                Ok(false) => {}
                Err(e) => eprintln!("warning: cannot remove the nftables table inet {TABLE}: {e}"),
            }
            let dev = proxy_common::HOST_DEV_NAME;
            match proxy_agent::host::svc_device::remove() {
                Ok(true) => {
                    println!("removed the host-client device {dev} and its ClusterIP routes")
                }
                Ok(false) => {}
                Err(e) => eprintln!("warning: cannot remove the host-client device {dev}: {e}"),
            }
        }
    }
    Ok(())
}

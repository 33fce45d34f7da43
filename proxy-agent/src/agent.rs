//! The agent's run loop: load and pin the datapath, attach it to pod
//! interfaces as they appear, and keep the maps equal to the desired state of
//! the source, with kube-proxy's minimum sync period.
//!
//! In phases, one module each: [`start`] (the datapath loaded and
//! configured, then, once the source is ready ([`ready`]), the first sync
//! and the programs attached), [`serve`] (a sync per change or period,
//! [`sync`]; the interfaces followed, [`links`]), [`shutdown`] (what
//! `--on-exit` says). [`udp_flows`]: the UDP flows a change ended.
mod links;
mod ready;
mod serve;
mod shutdown;
mod start;
mod sync;
mod udp_flows;

use std::time::Duration;

use tokio::sync::mpsc;

use crate::{
    bpf::BpfError,
    config::Settings,
    sources::{Source, SourceError},
};

/// How often expired conntrack entries are deleted.
const CT_GC_INTERVAL: Duration = Duration::from_secs(10);

/// Log line printed after every sync; the lab and tests wait for it.
pub const SYNC_COMPLETE: &str = "sync complete";

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Bpf(#[from] BpfError),
    #[error("dataplane: {0}")]
    Dataplane(#[from] crate::dataplane::DataplaneError),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("netlink: {0}")]
    Netlink(std::io::Error),
    #[error("signal handler: {0}")]
    Signal(std::io::Error),
    #[error(
        "the interface watcher stopped; new pod interfaces and address changes would be missed"
    )]
    LinkWatcherStopped,
    #[error("{0}")]
    Setting(String),
}

/// Runs until SIGTERM or SIGINT; then detaches from every interface. The pinned
/// maps stay, so a restarted agent adopts conntrack and ids.
pub async fn run(cfg: Settings, mut source: Box<dyn Source>) -> Result<(), AgentError> {
    let (mut started, loaded) = start::load(&cfg)?;
    let servers = start::serve_endpoints(&cfg, &started.obs);
    let (tx, mut changes) = mpsc::unbounded_channel();
    source.start(tx)?;
    // Never act on a half-filled cache.
    ready::wait_until_ready(source.as_ref(), &mut changes).await?;
    let mut running = start::attach(&cfg, source.as_mut(), &mut started, loaded).await?;
    let result = serve::serve(
        &cfg,
        source.as_mut(),
        &mut changes,
        &mut started,
        &mut running,
    )
    .await;
    shutdown::shut_down(&cfg, &mut started, running, servers);
    result
}

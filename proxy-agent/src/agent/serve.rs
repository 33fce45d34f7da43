//! Serving: a sync per change (no sooner than `minSyncPeriod` after the
//! last) or per `syncPeriod`, until SIGTERM or SIGINT.
use std::time::Instant;

use tokio::sync::mpsc;
use tracing::debug;

use crate::{config::Settings, sources::Source};

use super::{
    start::{Running, Started},
    sync::{sync_once, SyncScope},
    AgentError,
};

/// Syncs until a signal (`Ok`) or the interface watcher stops (`Err`).
pub(super) async fn serve(
    cfg: &Settings,
    source: &mut dyn Source,
    changes: &mut mpsc::UnboundedReceiver<()>,
    started: &mut Started,
    running: &mut Running,
) -> Result<(), AgentError> {
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(AgentError::Signal)?;
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(AgentError::Signal)?;
    let mut pending = false;
    loop {
        // kube-proxy's minSyncPeriod: a change right after a sync waits for the
        // rest of the period; one after a quiet period is applied at once.
        let wake = if pending {
            running.last_sync + cfg.min_sync_period
        } else {
            running.last_sync + cfg.sync_period
        };
        tokio::select! {
            _ = tokio::time::sleep_until(wake.into()) => {
                started.obs.metrics.set_source_ready(source.ready());
                if source.ready() {
                    // Signals already queued are for changes this sync
                    // reads (a source updates what it holds, then
                    // signals): left queued, they would make a second,
                    // empty sync that moves the minSyncPeriod window, so
                    // that a change a moment later waits for it.
                    while changes.try_recv().is_ok() {}
                    running.model.set_interface_addresses(running.addrs.borrow_and_update().iter().copied());
                    // A change is written alone; a period without one
                    // compares everything (kube-proxy's syncPeriod).
                    let scope = if pending { SyncScope::Changes } else { SyncScope::Full };
                    sync_once(cfg, source, &mut running.model, &mut started.writer, &mut started.obs, scope);
                }
                running.last_sync = Instant::now();
                pending = false;
            }
            Some(()) = changes.recv() => {
                debug!("source changed");
                started.obs.health.queued_update();
                pending = true;
            }
            // The external interfaces' addresses changed (logged where
            // seen): the next sync computes the NodePorts again.
            Ok(()) = running.addrs.changed() => {
                started.obs.health.queued_update();
                pending = true;
            }
            _ = sigterm.recv() => return Ok(()),
            _ = sigint.recv() => return Ok(()),
        }
        if running.links.is_finished() {
            return Err(AgentError::LinkWatcherStopped);
        }
    }
}

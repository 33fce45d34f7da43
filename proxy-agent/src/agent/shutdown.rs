//! Shutting down as `--on-exit` says: detach, keep the datapath attached,
//! or leave it draining for the proxy that takes the node back.
use tokio::task::JoinHandle;
use tracing::{error, info};

use crate::config::Settings;

use super::start::{Running, Started};

/// Stops the watcher, the collector, the servers and the
/// `healthCheckNodePort` listeners, then leaves the datapath as `on_exit`
/// says.
pub(super) fn shut_down(
    cfg: &Settings,
    started: &mut Started,
    running: Running,
    servers: Vec<JoinHandle<()>>,
) {
    running.links.abort();
    if let Some((stop, gc)) = running.ct_gc {
        drop(stop);
        let _ = gc.join();
    }
    for s in servers {
        s.abort();
    }
    started.obs.health_checks.shutdown();
    let mut attacher = running.attacher.lock().expect("attacher lock");
    match cfg.on_exit {
        crate::config::OnExit::Detach => {
            attacher.detach_all();
            remove_host_device(started);
            info!("detached; maps stay pinned under {}", cfg.bpffs.display());
        }
        crate::config::OnExit::Keep => {
            attacher.release_all();
            info!(
                "exiting with the datapath attached (--on-exit keep); pins under {}",
                cfg.bpffs.display()
            );
        }
        crate::config::OnExit::Drain => {
            match crate::host::handover::set_draining(&started.pin_dir) {
                Ok(()) => {
                    attacher.release_all();
                    info!(
                    "exiting with the datapath draining (--on-exit drain): tracked flows stay translated, new ones go to the host's stack; run `proxy-agent cleanup --bpffs {}` once they have ended",
                    cfg.bpffs.display()
                );
                }
                Err(e) => {
                    attacher.detach_all();
                    remove_host_device(started);
                    error!(error = %e, "cannot set the datapath draining: detached instead");
                }
            }
        }
    }
}

/// Deletes the host-client device and its ClusterIP routes once nothing
/// translates there: host clients' UDP to ClusterIPs takes the host's own
/// routes again, for the proxy that takes the node back.
fn remove_host_device(started: &Started) {
    if started.obs.host_device.is_none() {
        return;
    }
    match crate::host::svc_device::remove() {
        Ok(_) => info!(
            device = proxy_common::HOST_DEV_NAME,
            "removed the host-client device and its ClusterIP routes"
        ),
        Err(e) => error!(error = %e, "cannot remove the host-client device"),
    }
}

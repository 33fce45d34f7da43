//! Sources of desired state. A source yields snapshots of the objects the model
//! reads (Services, EndpointSlices, Pods, Nodes) and signals changes; the agent
//! decides when to sync (minimum sync period) and computes the desired state.
use std::path::PathBuf;

use tokio::sync::mpsc::UnboundedSender;
use tracing::{error, warn};

use crate::manifests::{self, Snapshot};

/// A source of cluster state.
pub trait Source: Send {
    /// Starts watching; every change is signalled with `()` on `changes`.
    fn start(&mut self, changes: UnboundedSender<()>) -> Result<(), SourceError>;
    /// Whether the source has a complete view (for the Kubernetes API: every
    /// watch has listed once). The agent programs nothing before.
    fn ready(&self) -> bool;
    /// Why the source is still not ready after `waited`, in words that name
    /// the setting to fix (logged as an error while the agent waits).
    fn not_ready_hint(&self, _waited: std::time::Duration) -> Option<String> {
        None
    }
    /// The current snapshot. Problems with single objects are logged by the
    /// source and counted in the returned number; they never empty the snapshot.
    fn snapshot(&mut self) -> (Snapshot, usize);
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("watching the manifests {paths:?}: {source}")]
    Watch {
        paths: Vec<PathBuf>,
        source: notify::Error,
    },
    #[error("{0}")]
    Other(String),
}

/// Kubernetes YAML files and directories, watched with inotify.
pub struct ManifestsSource {
    paths: Vec<PathBuf>,
    watcher: Option<notify::RecommendedWatcher>,
    changes: Option<UnboundedSender<()>>,
    /// A path went missing: its watch must be made again once it is back.
    rewatch: bool,
    last_good: Snapshot,
}

impl ManifestsSource {
    pub fn new(paths: Vec<PathBuf>) -> Self {
        Self {
            paths,
            watcher: None,
            changes: None,
            rewatch: false,
            last_good: Snapshot::default(),
        }
    }
}

impl Source for ManifestsSource {
    fn start(&mut self, changes: UnboundedSender<()>) -> Result<(), SourceError> {
        let w = manifests::watch(self.paths.clone(), changes.clone()).map_err(|source| {
            SourceError::Watch {
                paths: self.paths.clone(),
                source,
            }
        })?;
        self.watcher = Some(w);
        self.changes = Some(changes);
        Ok(())
    }

    fn ready(&self) -> bool {
        true
    }

    /// Reads every file again. An object whose document turned bad keeps its
    /// last good version.
    fn snapshot(&mut self) -> (Snapshot, usize) {
        // A configured file or directory that is gone (deleted, being
        // replaced) is a mistake or a moment, not "no Services": keep the last
        // good state rather than withdraw everything.
        let missing: Vec<&PathBuf> = self.paths.iter().filter(|p| !p.exists()).collect();
        if !missing.is_empty() {
            error!(paths = ?missing, "manifests path missing; keeping the last good state until it is back");
            self.rewatch = true;
            return (self.last_good.clone(), missing.len());
        }
        if self.rewatch {
            if let Some(tx) = self.changes.clone() {
                match manifests::watch(self.paths.clone(), tx) {
                    Ok(w) => {
                        self.watcher = Some(w);
                        self.rewatch = false;
                    }
                    Err(e) => error!(error = %e, "cannot watch the manifests again"),
                }
            }
        }
        let (mut snapshot, errors) = manifests::load_paths(&self.paths);
        for e in &errors {
            if e.duplicate {
                warn!("{e}");
            } else {
                error!("{e}");
            }
        }
        let kept = manifests::keep_last_good(&self.last_good, &errors, &mut snapshot);
        if kept > 0 {
            warn!(
                objects = kept,
                "kept the last good version of objects whose documents are bad"
            );
        }
        self.last_good = snapshot.clone();
        (snapshot, errors.len())
    }
}

//! Sources of desired state. A source yields snapshots of the objects the model
//! reads (Services, EndpointSlices, Pods, Nodes) and signals changes; the agent
//! decides when to sync (minimum sync period) and computes the desired state.
//!
//! Two sources: the Kubernetes API ([`kubernetes`]) and manifest files
//! ([`manifests`]).
use std::path::PathBuf;

use tokio::sync::mpsc::UnboundedSender;

use crate::objects::{Change, Object, Snapshot};

pub mod kubernetes;
pub mod manifests;

pub use manifests::ManifestsSource;

/// What a source saw since it was last asked.
#[derive(Debug)]
pub enum SourceChanges {
    /// Every object: the model finds what changed by comparison.
    Full(Snapshot),
    /// Every object, shared with the source (an object the model holds
    /// already costs a pointer comparison).
    All(Vec<Object>),
    /// The objects that changed, each as it is now (or gone).
    Changes(Vec<Change>),
}

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
    /// What changed since the last call (everything the first time), with
    /// the number of problems logged, as [`Source::snapshot`]. A source that
    /// cannot tell gives every object.
    fn changes(&mut self) -> (SourceChanges, usize) {
        let (snapshot, errors) = self.snapshot();
        (SourceChanges::Full(snapshot), errors)
    }
    /// Every object, or what changed after a look at everything: the
    /// periodic safety net (`syncPeriod`) against a change the source missed.
    fn resync(&mut self) -> (SourceChanges, usize) {
        self.changes()
    }
    /// For a source with versions (the Kubernetes API's `resourceVersion`):
    /// a lower bound of what the last [`changes`](Source::changes),
    /// [`resync`](Source::resync) or [`snapshot`](Source::snapshot) took,
    /// the newest version that every watch of Services and EndpointSlices
    /// had delivered by then. Every sync logs it (`source_revision`), so
    /// whoever wrote to the API can tell when the agent has programmed what
    /// it wrote. `None` for a source without versions.
    fn revision(&self) -> Option<u64> {
        None
    }
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

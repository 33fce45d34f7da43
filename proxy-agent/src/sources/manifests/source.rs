//! [`ManifestsSource`]: the manifests as a [`Source`], watched, cached, the
//! last good version of an object kept while its file is broken.
use std::path::PathBuf;

use tokio::sync::mpsc::UnboundedSender;
use tracing::{error, warn};

use crate::objects::Snapshot;
use crate::sources::{Source, SourceChanges, SourceError};

use crate::sources::manifests;

/// Kubernetes YAML files and directories, watched with inotify.
pub struct ManifestsSource {
    paths: Vec<PathBuf>,
    watcher: Option<notify::RecommendedWatcher>,
    changes: Option<UnboundedSender<()>>,
    /// A path went missing: its watch must be made again once it is back.
    rewatch: bool,
    /// Set by the watcher when a watched directory was replaced (see
    /// [`manifests::watch_replaced`]): watched again before the next read.
    replaced: std::sync::Arc<std::sync::atomic::AtomicBool>,
    last_good: Snapshot,
    /// The files as last read, for [`Source::changes`].
    cache: manifests::FileCache,
}

impl ManifestsSource {
    pub fn new(paths: Vec<PathBuf>) -> Self {
        Self {
            paths,
            watcher: None,
            changes: None,
            rewatch: false,
            replaced: Default::default(),
            last_good: Snapshot::default(),
            cache: manifests::FileCache::default(),
        }
    }
}

impl Source for ManifestsSource {
    fn start(&mut self, changes: UnboundedSender<()>) -> Result<(), SourceError> {
        let w =
            manifests::watch_replaced(self.paths.clone(), changes.clone(), self.replaced.clone())
                .map_err(|source| SourceError::Watch {
                paths: self.paths.clone(),
                source,
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
        if let Some(missing) = self.missing_paths() {
            return (self.last_good.clone(), missing);
        }
        let (mut snapshot, errors) = manifests::load_paths(&self.paths);
        log_errors(&errors);
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

    /// Compares every file's content with what was read, whatever its
    /// times say, and names the objects that changed.
    fn resync(&mut self) -> (SourceChanges, usize) {
        self.cache.compare_all_next();
        self.changes()
    }

    /// Reads again only the files whose modification time, size, inode or
    /// change time changed, and names the objects that changed in them.
    fn changes(&mut self) -> (SourceChanges, usize) {
        if let Some(missing) = self.missing_paths() {
            return (SourceChanges::Changes(Vec::new()), missing);
        }
        let (changes, errors) = self.cache.refresh(&self.paths);
        log_errors(&errors);
        (SourceChanges::Changes(changes), errors.len())
    }
}

fn log_errors(errors: &[manifests::ManifestError]) {
    for e in errors {
        if e.duplicate {
            warn!("{e}");
        } else {
            error!("{e}");
        }
    }
}

impl ManifestsSource {
    /// How many configured paths are missing, if any. A configured file or
    /// directory that is gone (deleted, being replaced) is a mistake or a
    /// moment, not "no Services": the last good state stays until it is
    /// back. Watches the paths again once they are all back.
    fn missing_paths(&mut self) -> Option<usize> {
        let missing: Vec<&PathBuf> = self.paths.iter().filter(|p| !p.exists()).collect();
        if !missing.is_empty() {
            error!(paths = ?missing, "manifests path missing; keeping the last good state until it is back");
            self.rewatch = true;
            return Some(missing.len());
        }
        if self
            .replaced
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            self.rewatch = true;
        }
        if self.rewatch {
            if let Some(tx) = self.changes.clone() {
                match manifests::watch_replaced(self.paths.clone(), tx, self.replaced.clone()) {
                    Ok(w) => {
                        self.watcher = Some(w);
                        self.rewatch = false;
                    }
                    Err(e) => error!(error = %e, "cannot watch the manifests again"),
                }
            }
        }
        None
    }
}

//! Watching the manifests (inotify through `notify`), and keeping the last
//! good version of an object whose file went bad.

use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use notify::{EventKind, RecursiveMode, Watcher};

use crate::objects::Snapshot;

use super::files::has_manifest_extension;
use super::{ManifestError, ObjectRef};

/// The symlink the kubelet's atomic writer swaps to update a ConfigMap,
/// Secret or projected volume: the volume's files are symlinks through it.
const ATOMIC_DATA: &str = "..data";

/// Watches `paths` (directories non-recursively; for a file, its parent
/// directory filtered by the file's name, because editors replace files) and
/// sends `()` on every change that may alter what [`load_paths`] returns.
pub fn watch(
    paths: Vec<PathBuf>,
    tx: tokio::sync::mpsc::UnboundedSender<()>,
) -> notify::Result<notify::RecommendedWatcher> {
    watch_replaced(paths, tx, Default::default())
}

/// [`watch`], and `replaced` set when an event names a watched directory
/// itself (created, or renamed into place): an inotify watch follows its
/// inode, so a directory swapped in by a rename, or deleted and made again,
/// must be watched again ([`crate::sources::ManifestsSource`] does, before
/// its next read).
pub fn watch_replaced(
    paths: Vec<PathBuf>,
    tx: tokio::sync::mpsc::UnboundedSender<()>,
    replaced: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> notify::Result<notify::RecommendedWatcher> {
    // (directory, file name or None for every manifest file in it)
    let mut rules: Vec<(PathBuf, Option<OsString>)> = Vec::new();
    for path in &paths {
        let abs = std::path::absolute(path)?;
        if abs.is_dir() {
            let dir = abs.canonicalize().unwrap_or(abs);
            rules.push((dir, None));
        } else {
            let name = abs.file_name().map(|n| n.to_os_string());
            let parent = abs
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("/"));
            let dir = parent.canonicalize().unwrap_or(parent);
            rules.push((dir, name));
        }
    }
    let mut dirs: BTreeSet<PathBuf> = rules.iter().map(|(d, _)| d.clone()).collect();
    // A watched directory's parent too, so that the directory being deleted
    // and created again is noticed (its own watch dies with it).
    for (dir, name) in &rules {
        if name.is_none() {
            if let Some(parent) = dir.parent() {
                dirs.insert(parent.to_path_buf());
            }
        }
    }
    let matcher = rules.clone();
    let mut watcher =
        notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
            Ok(event) => {
                // A rename arrives as its names (`From`, `To`) and again as
                // the pair (`Both`): the pair is no change of its own, and a
                // second signal would make a second sync.
                if matches!(
                    event.kind,
                    EventKind::Access(_)
                        | EventKind::Modify(notify::event::ModifyKind::Name(
                            notify::event::RenameMode::Both
                        ))
                ) {
                    return;
                }
                let relevant = event.need_rescan()
                    || event.paths.iter().any(|p| {
                        matcher.iter().any(|(dir, name)| {
                            let in_dir = p.parent() == Some(dir.as_path());
                            // A ConfigMap (or Secret, projected) volume
                            // is updated by renaming a symlink over
                            // `..data`, which its files point through.
                            let swap = in_dir && p.file_name() == Some(OsStr::new(ATOMIC_DATA));
                            swap || match name {
                                Some(name) => in_dir && p.file_name() == Some(name.as_os_str()),
                                None => (in_dir && has_manifest_extension(p)) || p == dir,
                            }
                        })
                    });
                let dir_itself = event
                    .paths
                    .iter()
                    .any(|p| matcher.iter().any(|(dir, name)| name.is_none() && p == dir));
                if dir_itself {
                    replaced.store(true, std::sync::atomic::Ordering::Release);
                }
                if relevant {
                    let _ = tx.send(());
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "manifests: watch error; reloading");
                let _ = tx.send(());
            }
        })?;
    for dir in &dirs {
        if dir.exists() {
            watcher.watch(dir, RecursiveMode::NonRecursive)?;
        }
    }
    Ok(watcher)
}

/// Keeps the last good version of objects whose document turned bad, as an
/// API server keeps an object when an update of it is rejected: an error
/// naming a kind, namespace and name brings that object back from `previous`
/// if it is absent from `snapshot`. Returns how many objects were kept.
pub fn keep_last_good(
    previous: &Snapshot,
    errors: &[ManifestError],
    snapshot: &mut Snapshot,
) -> usize {
    use k8s_openapi::Metadata;
    fn same<T: Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>>(
        o: &T,
        ns: &str,
        name: &str,
    ) -> bool {
        let m = o.metadata();
        m.name.as_deref() == Some(name) && m.namespace.as_deref().unwrap_or("default") == ns
    }
    fn carry<
        T: Clone + Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
    >(
        prev: &[T],
        now: &mut Vec<T>,
        ns: &str,
        name: &str,
    ) -> usize {
        if now.iter().any(|o| same(o, ns, name)) {
            return 0;
        }
        match prev.iter().find(|o| same(*o, ns, name)) {
            Some(o) => {
                now.push(o.clone());
                1
            }
            None => 0,
        }
    }
    let mut kept = 0;
    for e in errors {
        let Some(ObjectRef {
            kind: Some(kind),
            namespace,
            name: Some(name),
        }) = &e.object
        else {
            continue;
        };
        let ns = namespace.as_deref().unwrap_or("default");
        kept += match kind.as_str() {
            "Service" => carry(&previous.services, &mut snapshot.services, ns, name),
            "EndpointSlice" => carry(
                &previous.endpoint_slices,
                &mut snapshot.endpoint_slices,
                ns,
                name,
            ),
            "Pod" => carry(&previous.pods, &mut snapshot.pods, ns, name),
            "Node" => carry(&previous.nodes, &mut snapshot.nodes, ns, name),
            _ => 0,
        };
    }
    kept
}

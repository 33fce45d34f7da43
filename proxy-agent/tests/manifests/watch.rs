//! The watches (tokio and inotify): a changed file, a file renamed into
//! place, a deleted or swapped directory, a ConfigMap volume, and the last
//! good object kept when a document turns bad.
use proxy_agent::objects::Snapshot;
use proxy_agent::sources::manifests;

use super::*;

#[tokio::test]
async fn watch_signals_a_change_of_a_watched_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("svc.yaml");
    std::fs::write(&file, "").unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let _watcher = proxy_agent::sources::manifests::watch(vec![file.clone()], tx).unwrap();
    // A file next to it is not watched.
    std::fs::write(dir.path().join("other.yaml"), "a: 1").unwrap();
    std::fs::write(&file, "apiVersion: v1\nkind: Node\nmetadata: {name: n}\n").unwrap();
    let got = tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv()).await;
    assert!(matches!(got, Ok(Some(()))), "no change signalled");
}

/// A file written beside the manifests and renamed into place (how tools
/// replace a file atomically; the bench does it too) is one change, signalled
/// once: inotify's one rename reaches the watcher as two events (the new
/// name, and the pair of names), and a second signal made the agent run a
/// second, empty sync that moved its `minSyncPeriod` window, so that a change
/// a moment later waited up to 100 ms.
#[tokio::test]
async fn a_file_renamed_into_a_watched_directory_is_signalled_once() {
    let dir = tempfile::tempdir().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let _watcher =
        proxy_agent::sources::manifests::watch(vec![dir.path().to_path_buf()], tx).unwrap();
    let tmp = dir.path().join(".svc.yaml.tmp");
    std::fs::write(&tmp, "apiVersion: v1\nkind: Node\nmetadata: {name: n}\n").unwrap();
    std::fs::rename(&tmp, dir.path().join("svc.yaml")).unwrap();
    let first = tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv()).await;
    assert!(matches!(first, Ok(Some(()))), "no change signalled");
    // Anything more the watcher says about that rename comes within
    // microseconds of the first signal; half a second is plenty.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let mut more = 0;
    while rx.try_recv().is_ok() {
        more += 1;
    }
    assert_eq!(more, 0, "one rename signalled {} times", more + 1);
}

/// A document that turns bad does not take its object away: the last good
/// version stays, as an API server keeps an object whose update it rejects.
#[test]
fn a_document_turned_bad_keeps_the_last_good_object() {
    let good = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 198.19.0.10, ports: [{port: 80}]}\n";
    let bad = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 198.19.0.10, ports: [{port: eighty}]}\n";
    let path = std::path::Path::new("svc.yaml");
    let (mut before, mut errs) = (Snapshot::default(), Vec::new());
    manifests::load_str(path, good, &mut before, &mut errs);
    assert!(errs.is_empty());
    let (mut after, mut errs) = (Snapshot::default(), Vec::new());
    manifests::load_str(path, bad, &mut after, &mut errs);
    assert_eq!(errs.len(), 1);
    assert!(after.services.is_empty());
    assert_eq!(manifests::keep_last_good(&before, &errs, &mut after), 1);
    assert_eq!(after.services[0].metadata.name.as_deref(), Some("web"));
    let port = after.services[0]
        .spec
        .as_ref()
        .unwrap()
        .ports
        .as_ref()
        .unwrap()[0]
        .port;
    assert_eq!(port, 80, "the good version is kept");
}

/// Waits up to 5 s for a change signal, then takes the signals that follow
/// it within 100 ms (one change may be several events).
fn wait_change(rx: &mut tokio::sync::mpsc::UnboundedReceiver<()>) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if rx.try_recv().is_ok() {
            std::thread::sleep(std::time::Duration::from_millis(100));
            while rx.try_recv().is_ok() {}
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    false
}

/// A directory `m` (in the returned temporary directory) holding one
/// Service, watched by a started manifests source.
fn watched_dir_of_one_service() -> (
    tempfile::TempDir,
    PathBuf,
    proxy_agent::sources::ManifestsSource,
    tokio::sync::mpsc::UnboundedReceiver<()>,
) {
    use proxy_agent::sources::{ManifestsSource, Source};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("a.yaml"), service_manifest("a", "198.19.0.10")).unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut source = ManifestsSource::new(vec![dir.clone()]);
    source.start(tx).unwrap();
    assert_eq!(source.snapshot().0.services.len(), 1);
    (tmp, dir, source, rx)
}

/// A third Service's file written to `dir`, whose source holds two: a
/// change is signalled and three are read.
fn a_third_file_is_noticed(
    dir: &Path,
    source: &mut proxy_agent::sources::ManifestsSource,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<()>,
    which: &str,
) {
    use proxy_agent::sources::Source;
    std::fs::write(dir.join("c.yaml"), service_manifest("c", "198.19.0.12")).unwrap();
    assert!(
        wait_change(rx),
        "a new file in the {which} directory was not noticed"
    );
    assert_eq!(source.snapshot().0.services.len(), 3);
}

/// The manifests directory deleted (an operator's mistake, or a directory
/// swap): the last good state is kept rather than every Service withdrawn,
/// and once the directory is back, changes are applied live again.
#[test]
fn a_deleted_manifests_dir_keeps_the_last_good_state_and_is_watched_again() {
    use proxy_agent::sources::Source;
    let (_tmp, dir, mut source, mut rx) = watched_dir_of_one_service();
    // Gone: the last good state, and an error counted.
    std::fs::remove_dir_all(&dir).unwrap();
    let (snap, errors) = source.snapshot();
    assert_eq!((snap.services.len(), errors), (1, 1));
    // Back, with two Services: noticed (through the parent's watch).
    while rx.try_recv().is_ok() {}
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("a.yaml"), service_manifest("a", "198.19.0.10")).unwrap();
    std::fs::write(dir.join("b.yaml"), service_manifest("b", "198.19.0.11")).unwrap();
    assert!(
        wait_change(&mut rx),
        "the directory coming back was not noticed"
    );
    assert_eq!(source.snapshot().0.services.len(), 2);
    // And it is watched again: a third file is a change.
    a_third_file_is_noticed(&dir, &mut source, &mut rx, "recreated");
}

/// The manifests directory replaced by a rename (a new directory prepared
/// beside it, then swapped in): the swap is read, and the new directory is
/// watched from then on. Before, the watch stayed on the old directory (an
/// inotify watch follows its inode), so later changes waited for the
/// periodic full sync.
#[test]
fn a_manifests_dir_swapped_by_a_rename_is_watched_again() {
    use proxy_agent::sources::Source;
    let (tmp, dir, mut source, mut rx) = watched_dir_of_one_service();
    let new = tmp.path().join("m.new");
    std::fs::create_dir(&new).unwrap();
    std::fs::write(new.join("a.yaml"), service_manifest("a", "198.19.0.10")).unwrap();
    std::fs::write(new.join("b.yaml"), service_manifest("b", "198.19.0.11")).unwrap();
    while rx.try_recv().is_ok() {}
    std::fs::rename(&dir, tmp.path().join("m.old")).unwrap();
    std::fs::rename(&new, &dir).unwrap();
    assert!(wait_change(&mut rx), "the swap was not noticed");
    let changes = source.changes();
    assert_eq!(changes.1, 0, "no errors");
    assert_eq!(source.snapshot().0.services.len(), 2);
    // The new directory is the one watched: a file written there is a change.
    a_third_file_is_noticed(&dir, &mut source, &mut rx, "swapped-in");
}

/// Writes `svc.yaml` holding `content` into a ConfigMap volume at `dir` as
/// the kubelet's atomic writer does: into a directory `version` of its own,
/// then a `..data_tmp` symlink to it renamed over `..data`.
fn kubelet_write(dir: &Path, version: &str, content: &str) {
    std::fs::create_dir(dir.join(version)).unwrap();
    std::fs::write(dir.join(version).join("svc.yaml"), content).unwrap();
    std::os::unix::fs::symlink(version, dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
}

/// Manifests mounted from a ConfigMap: the kubelet updates such a volume by
/// writing the new files into a directory of their own and renaming a
/// `..data_tmp` symlink to it over `..data`, which the files (symlinks
/// `svc.yaml -> ..data/svc.yaml`) point through. No event names a manifest
/// file; the swap is signalled all the same, and the new content is read
/// (for the directory and for one file of it). Before, the update waited for
/// the periodic full sync (`syncPeriod`).
#[test]
fn a_configmap_volume_update_is_signalled_and_read() {
    use proxy_agent::sources::{ManifestsSource, Source, SourceChanges};
    use std::os::unix::fs::symlink;
    for watch_file in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        // What the kubelet's atomic writer leaves: a timestamped directory,
        // `..data` pointing to it, each file pointing through `..data`.
        kubelet_write(
            dir,
            "..2026_12_05_v1",
            &service_manifest("web", "198.19.0.10"),
        );
        symlink("..data/svc.yaml", dir.join("svc.yaml")).unwrap();
        let path = if watch_file {
            dir.join("svc.yaml")
        } else {
            dir.to_path_buf()
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut source = ManifestsSource::new(vec![path]);
        source.start(tx).unwrap();
        let cluster_ip = |changes: SourceChanges| -> Vec<String> {
            let SourceChanges::Changes(changes) = changes else {
                panic!("manifests changes come as changes");
            };
            changes
                .iter()
                .filter_map(|c| match c {
                    proxy_agent::model::Change::Applied(proxy_agent::model::Object::Service(s)) => {
                        s.spec.as_ref().map(|spec| format!("{:?}", spec.cluster_ip))
                    }
                    _ => None,
                })
                .collect()
        };
        let first = cluster_ip(source.changes().0);
        assert_eq!(first.len(), 1, "{first:?}");
        assert!(first[0].contains("198.19.0.10"), "{first:?}");
        // The update, as the kubelet makes it.
        kubelet_write(
            dir,
            "..2026_12_05_v2",
            &service_manifest("web", "198.19.0.11"),
        );
        assert!(
            wait_change(&mut rx),
            "watching the file: {watch_file}: the update was not signalled"
        );
        let now = cluster_ip(source.changes().0);
        assert_eq!(now.len(), 1, "watching the file: {watch_file}: {now:?}");
        assert!(now[0].contains("198.19.0.11"), "{now:?}");
    }
}

//! The manifests source: files, directories, multi-document YAML, bad documents.
use std::path::{Path, PathBuf};

use proxy_agent::objects::Snapshot;
use proxy_agent::sources::manifests::{self, load_paths, load_str};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn names<
    T: k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
>(
    objs: &[T],
) -> Vec<String> {
    objs.iter()
        .map(|o| {
            let m = o.metadata();
            format!(
                "{}/{}",
                m.namespace.as_deref().unwrap_or("-"),
                m.name.as_deref().unwrap_or("-")
            )
        })
        .collect()
}

#[test]
fn multi_document_file_loads_every_known_kind_and_skips_others() {
    let (snap, errors) = load_paths(&[data("example.yaml")]);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(names(&snap.services), ["default/my-service"]);
    assert_eq!(names(&snap.pods), ["default/my-app-1", "default/my-app-2"]);
    assert!(snap.endpoint_slices.is_empty() && snap.nodes.is_empty());
}

#[test]
fn directory_reads_yaml_yml_and_json_sorted_and_lists_items() {
    let (snap, errors) = load_paths(&[data("dir")]);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(names(&snap.services), ["prod/api"]);
    assert_eq!(names(&snap.endpoint_slices), ["prod/api-abc"]);
    assert_eq!(names(&snap.pods), ["prod/p1"]);
    assert_eq!(snap.nodes.len(), 1);
}

#[test]
fn bad_documents_are_reported_by_file_and_object_and_the_rest_loads() {
    let path = data("bad.yaml");
    let (snap, errors) = load_paths(std::slice::from_ref(&path));
    let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
    let file = path.display().to_string();

    // The good objects around the bad ones.
    assert_eq!(
        names(&snap.services),
        ["shop/good", "default/headless", "default/external"]
    );
    assert_eq!(names(&snap.pods), ["default/survivor"]);
    assert_eq!(snap.nodes.len(), 1);

    assert_eq!(errors.len(), 4, "{messages:#?}");
    assert_eq!(
        messages[0],
        format!("{file}: document 2 (Service default/web): spec.ports[0].port: invalid type: string \"x\", expected i32")
    );
    assert_eq!(errors[0].document, Some(2));
    assert!(
        messages[1].starts_with(&format!("{file}: document 4: ")),
        "{}",
        messages[1]
    );
    assert!(
        messages[1].contains("line 29 column 18"),
        "syntax error located in the file: {}",
        messages[1]
    );
    assert!(
        messages[2].starts_with(&format!("{file}: document 5")),
        "{}",
        messages[2]
    );
    assert!(messages[2].contains("kind"), "{}", messages[2]);
    assert_eq!(
        messages[3],
        format!(
            "{file}: document 6 (Service default/no-cluster-ip): has no spec.clusterIP \
             (the manifests source does not allocate ClusterIPs)"
        )
    );
}

#[test]
fn service_without_cluster_ip_is_an_error_but_headless_and_external_name_are_not() {
    let yaml = "\
apiVersion: v1
kind: Service
metadata: {name: a}
spec:
  ports: [{port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: b}
spec:
  clusterIP: None
  ports: [{port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: c}
spec:
  type: ExternalName
  externalName: example.invalid
";
    let mut snap = Snapshot::default();
    let mut errors = Vec::new();
    load_str(Path::new("x.yaml"), yaml, &mut snap, &mut errors);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].to_string(), "x.yaml: document 1 (Service default/a): has no spec.clusterIP (the manifests source does not allocate ClusterIPs)");
    assert_eq!(names(&snap.services), ["default/b", "default/c"]);
}

#[test]
fn empty_documents_and_comments_are_skipped_silently() {
    let yaml = "# leading comment\n---\n---\n# only a comment\n---\napiVersion: v1\nkind: Node\nmetadata: {name: n}\n...\n";
    let mut snap = Snapshot::default();
    let mut errors = Vec::new();
    load_str(Path::new("x.yaml"), yaml, &mut snap, &mut errors);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(snap.nodes.len(), 1);
}

#[test]
fn missing_file_is_an_error_naming_it() {
    let (snap, errors) = load_paths(&[data("does-not-exist.yaml"), data("example.yaml")]);
    assert_eq!(errors.len(), 1);
    assert!(errors[0].to_string().contains("does-not-exist.yaml"));
    assert_eq!(snap.services.len(), 1);
}

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

/// A Service manifest named `name` with ClusterIP `ip`.
fn service_manifest(name: &str, ip: &str) -> String {
    format!("apiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n")
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

use proxy_testkit::fuzz;

/// Documents the fuzz tests start from: every kind the source reads, a List,
/// YAML and JSON.
const FUZZ_SEEDS: &[&str] = &[
    "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default, creationTimestamp: \"2024-01-01T00:00:00Z\"}\nspec:\n  type: LoadBalancer\n  clusterIP: 198.19.0.1\n  clusterIPs: [198.19.0.1]\n  externalIPs: [198.18.7.1]\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 300}}\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 30999\n  loadBalancerSourceRanges: [198.18.0.0/15]\n  ports: [{name: http, port: 80, targetPort: http, nodePort: 30080, protocol: TCP}]\nstatus: {loadBalancer: {ingress: [{ip: 198.18.9.1, ipMode: VIP}]}}\n",
    "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080, protocol: TCP}]\nendpoints:\n  - addresses: [198.18.1.1]\n    nodeName: node-a\n    zone: z1\n    conditions: {ready: true, serving: true, terminating: false}\n    hints: {forZones: [{name: z1}], forNodes: [{name: node-a}]}\n",
    "apiVersion: v1\nkind: Pod\nmetadata: {name: p, labels: {app: web}}\nspec:\n  nodeName: node-a\n  containers: [{name: c, image: x, ports: [{name: http, containerPort: 8080}]}]\nstatus: {phase: Running, podIP: 198.18.1.2, podIPs: [{ip: 198.18.1.2}]}\n",
    "apiVersion: v1\nkind: Node\nmetadata: {name: node-a, labels: {topology.kubernetes.io/zone: z1}}\nstatus: {addresses: [{type: InternalIP, address: 198.18.0.11}]}\n",
    "{\"apiVersion\": \"v1\", \"kind\": \"List\", \"items\": [{\"apiVersion\": \"v1\", \"kind\": \"Service\", \"metadata\": {\"name\": \"j\"}, \"spec\": {\"clusterIP\": \"198.19.0.9\", \"ports\": [{\"port\": 53, \"protocol\": \"UDP\"}]}}]}\n",
];

/// A valid Service the fuzzed documents sit between.
const BYSTANDER: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: bystander-a, namespace: keep}\nspec: {clusterIP: 198.19.100.1, ports: [{port: 80}]}\n";

/// Issue 15, input fuzzing: random and mutated documents never panic the
/// manifests parser, every error names the file and document, and valid
/// documents before and after a broken one still load.
#[test]
fn fuzzed_documents_never_panic_and_spare_their_neighbours() {
    let path = Path::new("fuzz.yaml");
    for seed in 0..3000u64 {
        let mut rng = fuzz::Rng::new(seed);
        let doc = match rng.below(4) {
            0 => (0..rng.below(8) + 1)
                .map(|_| fuzz::random_string(&mut rng))
                .collect::<Vec<_>>()
                .join(if rng.below(2) == 0 { "\n" } else { " " }),
            1 => {
                let mut v: serde_json::Value =
                    yaml_serde::from_str(rng.pick::<&str>(FUZZ_SEEDS)).unwrap();
                fuzz::mutate_value(&mut rng, &mut v);
                serde_json::to_string(&v).unwrap()
            }
            _ => {
                let seed_doc = *rng.pick(FUZZ_SEEDS);
                fuzz::mutate_text(&mut rng, seed_doc)
            }
        };
        let text = format!(
            "{BYSTANDER}---\n{doc}\n---\n{}",
            BYSTANDER.replace("bystander-a", "bystander-b")
        );
        let mut snap = Snapshot::default();
        let mut errors = Vec::new();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            load_str(path, &text, &mut snap, &mut errors)
        }));
        assert!(result.is_ok(), "seed {seed}: panicked on {doc:?}");
        let services = names(&snap.services);
        for keep in ["keep/bystander-a", "keep/bystander-b"] {
            assert!(
                services.iter().any(|s| s == keep),
                "seed {seed}: {keep} lost beside {doc:?}: {errors:?}"
            );
        }
        for e in &errors {
            let shown = e.to_string();
            assert!(
                shown.contains("fuzz.yaml") && !e.message.trim().is_empty(),
                "seed {seed}: unclear error {shown:?}"
            );
        }
    }
}

/// The same namespace/name in two files (or twice in one) is a warning naming
/// both files; the first one read (files sorted by name) is kept, whatever
/// order the directory lists them in, and the other objects are untouched.
#[test]
fn a_duplicate_service_is_a_warning_naming_both_files_and_the_first_wins() {
    let svc = |name: &str, ip: &str| {
        format!("apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n")
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // b.yaml written first: the winner is decided by name, not by creation.
    std::fs::write(
        dir.join("b.yaml"),
        format!(
            "{}---\n{}",
            svc("web", "198.19.0.20"),
            svc("other", "198.19.0.30")
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("a.yaml"),
        format!(
            "{}---\n{}",
            svc("web", "198.19.0.10"),
            svc("web", "198.19.0.11")
        ),
    )
    .unwrap();
    let (snap, errors) = load_paths(&[dir.to_path_buf()]);
    assert_eq!(names(&snap.services), ["shop/web", "shop/other"]);
    let ip = |i: usize| snap.services[i].spec.as_ref().unwrap().cluster_ip.clone();
    assert_eq!(
        ip(0).as_deref(),
        Some("198.19.0.10"),
        "a.yaml's first copy wins"
    );
    assert_eq!(
        ip(1).as_deref(),
        Some("198.19.0.30"),
        "its neighbour is untouched"
    );
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors.iter().all(|e| e.duplicate));
    let (a, b) = (dir.join("a.yaml"), dir.join("b.yaml"));
    let within = errors[0].to_string();
    assert!(
        within.contains("Service shop/web")
            && within.contains(&format!("read twice from {}", a.display())),
        "{within}"
    );
    let across = errors[1].to_string();
    assert!(
        across.contains("Service shop/web")
            && across.contains(&format!("already read from {}", a.display()))
            && across.contains(&format!("(in {})", b.display())),
        "{across}"
    );
    // Being reported does not make keep_last_good carry anything.
    let mut again = snap.clone();
    assert_eq!(manifests::keep_last_good(&snap, &errors, &mut again), 0);
    assert_eq!(again.services.len(), 2);
}

/// The file cache behind the agent's manifests source: files whose time,
/// size and inode did not change are not read again, and only the objects
/// of changed files are named; the first file keeps an object two hold; a
/// document turned bad keeps its object; a file gone takes its objects.
#[test]
fn the_file_cache_names_only_what_changed() {
    use proxy_agent::model::{Change, Kind};
    let svc = |name: &str, ip: &str, port: &str| {
        format!("---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{{port: {port}}}]}}\n")
    };
    let named = |changes: &[Change]| -> Vec<String> {
        changes
            .iter()
            .map(|c| match c {
                Change::Applied(o) => format!("{:?} {}", o.kind(), o.key().1),
                Change::Deleted(k, key) => format!("{k:?} {} deleted", key.1),
            })
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let paths = vec![dir.path().to_path_buf()];
    let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
    std::fs::write(
        &a,
        svc("web", "198.19.0.1", "80") + &svc("api", "198.19.0.2", "80"),
    )
    .unwrap();
    std::fs::write(&b, svc("db", "198.19.0.3", "80")).unwrap();
    let mut cache = manifests::FileCache::default();
    let (changes, errors) = cache.refresh(&paths);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        named(&changes),
        ["Service api", "Service db", "Service web"]
    );

    let (changes, errors) = cache.refresh(&paths);
    assert!(changes.is_empty() && errors.is_empty(), "nothing changed");

    // b changes: only its objects; one more, in a file of its own, held by a
    // too (a keeps it, b's copy is reported).
    std::fs::write(
        &b,
        svc("db", "198.19.0.3", "81") + &svc("web", "198.19.0.9", "80"),
    )
    .unwrap();
    let (changes, errors) = cache.refresh(&paths);
    assert_eq!(named(&changes), ["Service db", "Service web"]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].duplicate && errors[0].message.contains("a.yaml"));
    let web = changes.iter().find_map(|c| match c {
        Change::Applied(proxy_agent::model::Object::Service(s)) if &*s.name == "web" => Some(s),
        _ => None,
    });
    assert_eq!(
        web.unwrap().spec.as_ref().unwrap().cluster_ip.as_deref(),
        Some("198.19.0.1"),
        "the first file's copy"
    );

    // api's document turns bad in a: no change for it (kept); web dropped
    // from a: b's copy takes over.
    std::fs::write(&a, svc("api", "198.19.0.2", "eighty")).unwrap();
    let (changes, errors) = cache.refresh(&paths);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(named(&changes), ["Service web"]);
    // Fixed: api applied again.
    std::fs::write(&a, svc("api", "198.19.0.2", "8080")).unwrap();
    let (changes, _) = cache.refresh(&paths);
    assert_eq!(named(&changes), ["Service api"]);

    // b removed: its objects are gone.
    std::fs::remove_file(&b).unwrap();
    let (changes, _) = cache.refresh(&paths);
    assert_eq!(
        named(&changes),
        ["Service db deleted", "Service web deleted"]
    );
    assert!(matches!(changes[0], Change::Deleted(Kind::Service, _)));
}

/// The file cache dedupes within one file as `load_paths` does: of a
/// Service written twice in one file the first copy is kept and the second
/// reported ("read twice"); an object of another kind with the same name is
/// no duplicate; later documents of the file are still read.
#[test]
fn the_file_cache_keeps_the_first_copy_of_an_object_a_file_holds_twice() {
    use proxy_agent::model::{Change, Object};
    let svc = |name: &str, ip: &str| {
        format!("---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n")
    };
    let slice = "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: [{addresses: [198.18.1.1]}]\nports: [{port: 8080}]\n";
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.yaml");
    std::fs::write(
        &a,
        svc("web", "198.19.0.10")
            + slice
            + &svc("web", "198.19.0.11")
            + &svc("web", "198.19.0.12")
            + &svc("zz", "198.19.0.13"),
    )
    .unwrap();
    let mut cache = manifests::FileCache::default();
    let (changes, errors) = cache.refresh(&[dir.path().to_path_buf()]);
    assert_eq!(errors.len(), 2, "two later copies: {errors:?}");
    for e in &errors {
        let text = e.to_string();
        assert!(
            e.duplicate
                && text.contains("Service shop/web")
                && text.contains(&format!("read twice from {}", a.display())),
            "{text}"
        );
    }
    let services: Vec<(String, Option<String>)> = changes
        .iter()
        .filter_map(|c| match c {
            Change::Applied(Object::Service(s)) => Some((
                s.name.to_string(),
                s.spec
                    .as_ref()
                    .and_then(|p| p.cluster_ip.as_deref().map(String::from)),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(
        services,
        [
            ("web".to_string(), Some("198.19.0.10".to_string())),
            ("zz".to_string(), Some("198.19.0.13".to_string()))
        ],
        "the first copy, and the Service after the duplicates"
    );
    assert!(
        changes
            .iter()
            .any(|c| matches!(c, Change::Applied(Object::EndpointSlice(s)) if &*s.name == "web")),
        "the EndpointSlice named as the Service is no duplicate: {changes:?}"
    );
}

/// JSON documents take a faster parser: the same objects as the YAML path,
/// and a bad one still gets the YAML path's error naming the field.
#[test]
fn json_documents_load_as_their_yaml_form_does() {
    let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web","labels":{"a":"b"}},"spec":{"clusterIP":"198.19.0.1","ports":[{"name":"http","port":80,"targetPort":8080}]}}
---
{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"web-1","labels":{"kubernetes.io/service-name":"web"}},"addressType":"IPv4","endpoints":[{"addresses":["198.18.1.1"],"conditions":{"ready":true},"nodeName":"n"}],"ports":[{"name":"http","port":8080}]}
"#;
    let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: web, labels: {a: b}}\nspec: {clusterIP: 198.19.0.1, ports: [{name: http, port: 80, targetPort: 8080}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: [{addresses: [198.18.1.1], conditions: {ready: true}, nodeName: n}]\nports: [{name: http, port: 8080}]\n";
    let load = |text: &str| {
        let (mut snap, mut errs) = (Snapshot::default(), Vec::new());
        load_str(Path::new("x.yaml"), text, &mut snap, &mut errs);
        assert!(errs.is_empty(), "{errs:?}");
        snap
    };
    let (j, y) = (load(json), load(yaml));
    assert_eq!(j.services, y.services);
    assert_eq!(j.endpoint_slices, y.endpoint_slices);
    assert_eq!(j.services[0].metadata.namespace.as_deref(), Some("default"));

    let bad = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web"},"spec":{"clusterIP":"198.19.0.1","ports":[{"port":"eighty"}]}}"#;
    let (mut snap, mut errs) = (Snapshot::default(), Vec::new());
    load_str(Path::new("x.yaml"), bad, &mut snap, &mut errs);
    assert!(snap.services.is_empty());
    assert_eq!(errs.len(), 1);
    assert!(
        errs[0].message.contains("spec.ports[0].port"),
        "{}",
        errs[0]
    );
}

/// Objects dumped with `kubectl get -o yaml` carry `managedFields` and the
/// last applied configuration, often most of their size: the manifests
/// source keeps neither (as the Kubernetes source), in both its JSON and
/// YAML paths, and keeps the annotations the agent reads. Of a slice's
/// endpoints it keeps what the model reads (the first address, no
/// `targetRef`, `hostname` or `deprecatedTopology`).
#[test]
fn objects_are_trimmed_of_what_the_agent_never_reads() {
    let yaml = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  annotations:\n    kubectl.kubernetes.io/last-applied-configuration: '{\"big\": true}'\n    proxy-agent.io/lb-algorithm: maglev\n  managedFields: [{manager: kubectl, operation: Apply}]\nspec: {clusterIP: 198.19.0.1, ports: [{port: 80}]}\n";
    let json = r#"{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"web-1","labels":{"kubernetes.io/service-name":"web"},"annotations":{"endpoints.kubernetes.io/last-change-trigger-time":"2030-01-01T00:00:00Z","other":"x"},"managedFields":[{"manager":"kube-controller-manager","operation":"Update"}]},"addressType":"IPv4","endpoints":[{"addresses":["198.18.1.1","198.18.1.9"],"hostname":"web-0","targetRef":{"kind":"Pod","namespace":"default","name":"web-0"},"deprecatedTopology":{"a":"b"}}],"ports":[]}"#;
    let (mut snap, mut errs) = (Snapshot::default(), Vec::new());
    load_str(Path::new("x.yaml"), yaml, &mut snap, &mut errs);
    load_str(Path::new("y.json"), json, &mut snap, &mut errs);
    assert!(errs.is_empty(), "{errs:?}");
    let svc = &snap.services[0].metadata;
    let slice = &snap.endpoint_slices[0].metadata;
    for m in [svc, slice] {
        assert!(
            m.managed_fields.as_ref().is_none_or(|f| f.is_empty()),
            "{m:?}"
        );
    }
    let keys = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        m.annotations
            .iter()
            .flat_map(|a| a.keys().cloned())
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(svc), ["proxy-agent.io/lb-algorithm"]);
    assert_eq!(
        keys(slice),
        ["endpoints.kubernetes.io/last-change-trigger-time"]
    );
    let e = &snap.endpoint_slices[0].endpoints[0];
    assert_eq!(e.addresses, ["198.18.1.1"]);
    assert!(
        e.target_ref.is_none() && e.hostname.is_none() && e.deprecated_topology.is_none(),
        "{e:?}"
    );
}

/// Found by review of the file cache: a change every stamp but the change
/// time hides (`cp -p`, `rsync -t --inplace`), a removed file whose bad
/// document kept its object, and a JSON document with a key twice (which the
/// YAML path refuses).
#[test]
fn the_file_cache_sees_restored_times_removed_bad_files_and_duplicate_json_keys() {
    use proxy_agent::model::Change;
    let svc = |name: &str, ip: &str, port: &str| {
        format!("---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{{port: {port}}}]}}\n")
    };
    let named = |c: &[Change]| -> Vec<String> {
        c.iter()
            .map(|c| match c {
                Change::Applied(o) => format!("{:?} {}", o.kind(), o.key().1),
                Change::Deleted(k, key) => format!("{k:?} {} deleted", key.1),
            })
            .collect()
    };
    let past = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    let set_mtime = |p: &Path| {
        std::fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_modified(past)
            .unwrap()
    };

    // Same length, modification time restored: the change time moved.
    let dir = tempfile::tempdir().unwrap();
    let paths = vec![dir.path().to_path_buf()];
    let a = dir.path().join("a.yaml");
    std::fs::write(&a, svc("web", "198.19.0.1", "80")).unwrap();
    set_mtime(&a);
    let mut cache = manifests::FileCache::default();
    assert_eq!(named(&cache.refresh(&paths).0), ["Service web"]);
    std::fs::write(&a, svc("web", "198.19.0.2", "80")).unwrap();
    set_mtime(&a);
    assert_eq!(named(&cache.refresh(&paths).0), ["Service web"]);

    // A bad document keeps its object; the file removed takes it.
    std::fs::write(&a, svc("web", "198.19.0.1", "eighty")).unwrap();
    assert!(cache.refresh(&paths).0.is_empty(), "kept");
    std::fs::remove_file(&a).unwrap();
    assert_eq!(named(&cache.refresh(&paths).0), ["Service web deleted"]);

    // JSON with a key twice: refused, as its YAML form is.
    let j = dir.path().join("b.json");
    std::fs::write(&j, r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web"},"spec":{"clusterIP":"198.19.0.1","clusterIP":"198.19.0.2","ports":[{"port":80}]}}"#).unwrap();
    let (snap, errors) = load_paths(std::slice::from_ref(&j));
    assert!(snap.services.is_empty(), "{:?}", snap.services);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].message.contains("duplicate"), "{}", errors[0]);

    // A document with a key twice loads nothing and is reported as such.
    let refused = |doc: &str, what: &str| {
        std::fs::write(&j, doc).unwrap();
        let (snap, errors) = load_paths(std::slice::from_ref(&j));
        assert!(snap.services.is_empty(), "{what}: {:?}", snap.services);
        assert!(
            errors[0].message.contains("duplicate"),
            "{what}: {}",
            errors[0]
        );
    };

    // At the top level too, `kind` (read before the object is) included;
    // an escaped `apiVersion` is still `v1`.
    for doc in [
        r#"{"apiVersion":"v1","kind":"Pod","kind":"Service","metadata":{"name":"web"},"spec":{"clusterIP":"198.19.0.1","ports":[{"port":80}]}}"#,
        r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web"},"spec":{"clusterIP":"198.19.0.1","ports":[{"port":80}]},"spec":{"clusterIP":"198.19.0.2","ports":[{"port":80}]}}"#,
    ] {
        refused(doc, doc);
    }
    std::fs::write(&j, r#"{"apiVersion":"v\u0031","kind":"Service","metadata":{"name":"web"},"spec":{"clusterIP":"198.19.0.1","ports":[{"port":80}]}}"#).unwrap();
    let (snap, errors) = load_paths(std::slice::from_ref(&j));
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(snap.services.len(), 1);

    // In an object of many keys too, and
    // with the second copy escaped: `\u006b0` is `k0`.
    let labels: Vec<String> = (0..40).map(|i| format!(r#""k{i}":"v""#)).collect();
    for dup in [r#""k0":"w""#, r#""\u006b0":"w""#, r#""k39":"w""#] {
        let doc = format!(
            r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"web","labels":{{{},{dup}}}}},"spec":{{"clusterIP":"198.19.0.1","ports":[{{"port":80}}]}}}}"#,
            labels.join(",")
        );
        refused(&doc, dup);
    }
    // Forty distinct keys load.
    std::fs::write(&j, format!(r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"web","labels":{{{}}}}},"spec":{{"clusterIP":"198.19.0.1","ports":[{{"port":80}}]}}}}"#, labels.join(","))).unwrap();
    let (snap, errors) = load_paths(&[j]);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        snap.services[0].metadata.labels.as_ref().map(|l| l.len()),
        Some(40)
    );
}

/// A document of brackets nested thousands deep is refused with an error
/// that says so, at the line where it goes too deep, before the YAML parser
/// reads it (whose scanner takes time growing with the square of the depth
/// to refuse it); the file's other documents load. Neither an odd quote in
/// a plain value nor closing brackets in quoted strings hide the nesting.
#[test]
fn brackets_nested_thousands_deep_are_refused_and_the_other_documents_load() {
    let svc = |name: &str, extra: &str, ports: &str| {
        format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n{extra}spec:\n  clusterIP: 198.19.0.1\n  ports: {ports}\n")
    };
    let deep = svc(
        "deep",
        "",
        &format!("{}{}", "[".repeat(5_000), "]".repeat(5_000)),
    );
    // An apostrophe in a plain value does not open a quoted string.
    let apostrophe = svc(
        "apostrophe",
        "  annotations:\n    owner: o'brien\n",
        &format!("{}{}", "[".repeat(2_000), "]".repeat(2_000)),
    );
    // `"]"` is a string: it closes nothing.
    let quoted_closers = svc("closers", "", &format!("{}]", "[ \"]\", ".repeat(1_500)));
    // Brackets in quoted strings and comments, well under the limit.
    let b = "[".repeat(300);
    let quoted = svc(
        "quoted",
        &format!("  annotations:\n    a: \"{b}\"\n    b: '{b}'\n# {b}\n"),
        "[{port: 80}]",
    );
    let good = svc("good", "", "[{port: 80}]");
    let text = [good.as_str(), &deep, &apostrophe, &quoted_closers, &quoted].join("---\n");
    let mut snap = Snapshot::default();
    let mut errors = Vec::new();
    load_str(Path::new("m.yaml"), &text, &mut snap, &mut errors);
    assert_eq!(names(&snap.services), ["default/good", "default/quoted"]);
    assert_eq!(errors.len(), 3, "{errors:?}");
    let at: Vec<(Option<usize>, &str)> = errors
        .iter()
        .map(|e| (e.document, e.message.as_str()))
        .collect();
    let too_deep = |line: usize| format!("line {line}: brackets nested more than 1000 levels deep");
    assert_eq!(
        at,
        [
            (Some(2), too_deep(15).as_str()),
            (Some(3), too_deep(25).as_str()),
            (Some(4), too_deep(33).as_str()),
        ],
        "{errors:?}"
    );
}

/// A byte-order mark at the start of a file, or of a line where two files
/// were joined, is no content: every document loads.
#[test]
fn a_byte_order_mark_starting_a_file_or_a_joined_one_is_skipped() {
    let svc = |name: &str, ip: &str| {
        format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\nspec:\n  clusterIP: {ip}\n  ports:\n  - port: 80\n")
    };
    let bom = '\u{feff}';
    for text in [
        format!("{bom}{}", svc("a", "198.19.0.1")),
        format!("{bom}---\n{}", svc("a", "198.19.0.1")),
        format!(
            "{bom}{}---\n{bom}{}",
            svc("a", "198.19.0.1"),
            svc("b", "198.19.0.2")
        ),
    ] {
        let mut snap = Snapshot::default();
        let mut errors = Vec::new();
        load_str(Path::new("m.yaml"), &text, &mut snap, &mut errors);
        assert!(errors.is_empty(), "{text:?}: {errors:?}");
        let expected = if text.contains("name: b") {
            vec!["default/a", "default/b"]
        } else {
            vec!["default/a"]
        };
        assert_eq!(names(&snap.services), expected, "{text:?}");
    }
}

/// A file of thousands of documents is read on several threads: the
/// objects keep the file's order, and an error still names its document,
/// whichever chunk read it.
#[test]
fn a_file_of_thousands_of_documents_keeps_their_order_and_numbers() {
    let n = 5_000;
    let bad = 3_777;
    let mut text = String::new();
    for i in 0..n {
        let port = if i + 1 == bad { "eighty" } else { "80" };
        text.push_str(&format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: svc-{i}}}\nspec: {{clusterIP: 198.19.{}.{}, ports: [{{port: {port}}}]}}\n",
            i / 256,
            i % 256
        ));
    }
    let mut snap = Snapshot::default();
    let mut errors = Vec::new();
    load_str(Path::new("many.yaml"), &text, &mut snap, &mut errors);
    let names: Vec<String> = snap
        .services
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    let expected: Vec<String> = (0..n)
        .filter(|i| i + 1 != bad)
        .map(|i| format!("svc-{i}"))
        .collect();
    assert_eq!(names, expected);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].document, Some(bad));
    assert!(
        errors[0].to_string().contains(&format!("svc-{}", bad - 1)),
        "{}",
        errors[0]
    );
}

//! The Kubernetes source against a scripted API server
//! (`proxy_testkit::fake_apiserver`), for the cases a real API server cannot
//! produce on demand. Every other case runs against the lab's real control
//! plane (`lab_k8s_source.rs`); the ones that stay here, and why (one line
//! each):
//! - `not_ready_until_every_collection_has_listed`: only a scripted server holds one list back.
//! - `a_dropped_connection_resumes_and_replays_changes_made_in_between`: only it cuts one watch.
//! - `errors_never_empty_the_snapshot`: a real server answers 500 when broken, not on request.
//! - `a_bookmark_is_neither_a_change_nor_a_relist`: a real one bookmarks on its own clock (~1/min).
//!
//! No root needed: the fake server listens on 127.0.0.1.
use std::time::{Duration, Instant};

use proxy_agent::{
    model,
    objects::Snapshot,
    sources::kubernetes::{self, KubernetesOptions, KubernetesSource},
    sources::{Source, SourceChanges},
};
use proxy_testkit::fake_apiserver::{FakeApiServer, Kind};
use serde_json::{json, Value};
use tokio::sync::mpsc;

const NODE: &str = "node-1";
/// Bound of every wait; nothing here asserts speed.
const PATIENCE: Duration = Duration::from_secs(10);

struct Fixture {
    server: FakeApiServer,
    source: KubernetesSource,
    _changes: mpsc::UnboundedReceiver<()>,
    _dir: tempfile::TempDir,
}

async fn source_for(
    server: &FakeApiServer,
    proxy_name: Option<&str>,
) -> (
    KubernetesSource,
    mpsc::UnboundedReceiver<()>,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    let (client, _) = kubernetes::client(Some(&kubeconfig), None)
        .await
        .expect("client");
    let mut source = KubernetesSource::new(
        client,
        KubernetesOptions {
            node_name: NODE.into(),
            service_proxy_name: proxy_name.map(str::to_string),
            api_server: None,
        },
    );
    let (tx, rx) = mpsc::unbounded_channel();
    source.start(tx).unwrap();
    (source, rx, dir)
}

async fn fixture() -> Fixture {
    let server = FakeApiServer::start().await;
    server.apply(node(NODE));
    let (source, changes, dir) = source_for(&server, None).await;
    let mut f = Fixture {
        server,
        source,
        _changes: changes,
        _dir: dir,
    };
    wait(&mut f.source, "ready", |s, _| s.ready()).await;
    f
}

/// Polls until `cond` holds on the source and its snapshot.
async fn wait(
    source: &mut KubernetesSource,
    what: &str,
    cond: impl Fn(&KubernetesSource, &Snapshot) -> bool,
) -> Snapshot {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (snap, _) = source.snapshot();
        if cond(source, &snap) {
            return snap;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; last snapshot: {}",
            summary(&snap)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_server(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn node(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
           "status": {"addresses": [{"type": "InternalIP", "address": "198.18.0.1"}]}})
}

fn service(name: &str, ip: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "default", "labels": labels},
           "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                    "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}})
}

fn slice(name: &str, service: &str, ips: &[&str], labels: Value) -> Value {
    let mut l = labels.as_object().cloned().unwrap_or_default();
    l.insert("kubernetes.io/service-name".into(), json!(service));
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": name, "namespace": "default", "labels": l,
                        "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2030-01-01T00:00:00Z",
                                        "kubectl.kubernetes.io/last-applied-configuration": "{}"},
                        "managedFields": [{"manager": "kube-controller-manager", "operation": "Update"}]},
           "addressType": "IPv4",
           "endpoints": ips.iter().map(|ip| json!({"addresses": [ip], "conditions": {"ready": true}, "nodeName": NODE,
                                                   "hostname": "pod", "targetRef": {"kind": "Pod", "namespace": "default", "name": "pod", "uid": "0f6e2a48-0000-4000-8000-000000000000"}})).collect::<Vec<_>>(),
           "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]})
}

fn names<
    T: k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
>(
    objs: &[T],
) -> Vec<String> {
    objs.iter()
        .map(|o| o.metadata().name.clone().unwrap_or_default())
        .collect()
}

fn slice_ips(snap: &Snapshot, name: &str) -> Vec<String> {
    snap.endpoint_slices
        .iter()
        .filter(|s| s.metadata.name.as_deref() == Some(name))
        .flat_map(|s| s.endpoints.iter().flat_map(|e| e.addresses.clone()))
        .collect()
}

fn summary(snap: &Snapshot) -> String {
    format!(
        "services {:?}, slices {:?}, nodes {:?}",
        names(&snap.services),
        names(&snap.endpoint_slices),
        names(&snap.nodes)
    )
}

#[tokio::test]
async fn not_ready_until_every_collection_has_listed() {
    for held in Kind::ALL {
        let server = FakeApiServer::start().await;
        server.apply(node(NODE));
        server.hold_lists(held, true);
        let (mut source, _rx, _dir) = source_for(&server, None).await;
        // The other two list and watch; the held one does not answer.
        for k in Kind::ALL.into_iter().filter(|k| *k != held) {
            wait_server("the other watches", || server.open_watches(k) == 1).await;
        }
        assert!(!source.ready(), "ready while the {held:?} list is held");
        server.hold_lists(held, false);
        let snap = wait(&mut source, "ready", |s, _| s.ready()).await;
        assert_eq!(names(&snap.nodes), [NODE]);
    }
}

#[tokio::test]
async fn a_dropped_connection_resumes_and_replays_changes_made_in_between() {
    let mut f = fixture().await;
    f.server
        .apply(slice("web-a", "web", &["198.18.1.1"], json!({})));
    wait(&mut f.source, "web-a", |_, s| s.endpoint_slices.len() == 1).await;
    wait_server("slice watch", || {
        f.server.open_watches(Kind::EndpointSlices) == 1
    })
    .await;
    let (lists, watches) = f.server.counts(Kind::EndpointSlices);

    f.server.set_hidden(true);
    f.server
        .apply(slice("web-a", "web", &["198.18.1.2"], json!({})));
    f.server
        .apply(slice("web-b", "web", &["198.18.1.3"], json!({})));
    f.server.drop_watches(Kind::EndpointSlices);
    f.server.set_hidden(false);

    let snap = wait(&mut f.source, "the replayed changes", |_, s| {
        slice_ips(s, "web-a") == ["198.18.1.2"] && slice_ips(s, "web-b") == ["198.18.1.3"]
    })
    .await;
    assert_eq!(snap.endpoint_slices.len(), 2);
    let (lists_after, watches_after) = f.server.counts(Kind::EndpointSlices);
    assert!(watches_after > watches, "watched again");
    assert_eq!(
        lists_after, lists,
        "resumed from its resourceVersion, no relist"
    );
}

#[tokio::test]
async fn errors_never_empty_the_snapshot() {
    let mut f = fixture().await;
    f.server.apply(service("web", "198.18.100.1", json!({})));
    f.server
        .apply(slice("web-a", "web", &["198.18.1.1"], json!({})));
    let before = wait(&mut f.source, "web", |_, s| {
        s.services.len() == 1 && s.endpoint_slices.len() == 1
    })
    .await;
    let requests_before = f.server.requests().len();

    // An outage: every request fails, every watch expires or breaks.
    f.server.set_failing(true);
    f.server.expire(Kind::Services);
    f.server.expire(Kind::EndpointSlices);
    f.server.drop_watches(Kind::Nodes);
    wait_server("failed retries", || {
        f.server.requests().len() >= requests_before + 3
    })
    .await;
    let (during, _) = f.source.snapshot();
    assert!(f.source.ready(), "stays ready through an outage");
    assert_eq!(summary(&during), summary(&before));
    assert_eq!(slice_ips(&during, "web-a"), ["198.18.1.1"]);

    // Recovery: the change made during the outage arrives.
    f.server
        .apply(slice("web-a", "web", &["198.18.1.9"], json!({})));
    f.server.set_failing(false);
    wait(&mut f.source, "recovery", |_, s| {
        slice_ips(s, "web-a") == ["198.18.1.9"]
    })
    .await;
}

/// A bookmark is neither a change nor a relist: after one on every watch,
/// the source names just the objects changed since, not everything.
#[tokio::test]
async fn a_bookmark_is_neither_a_change_nor_a_relist() {
    let mut f = fixture().await;
    assert!(
        matches!(f.source.changes().0, SourceChanges::All(_)),
        "the first call gives everything"
    );
    f.server.bookmark();
    // Each watch delivers in order: once these show, the bookmarks before
    // them have been taken.
    f.server.apply(service("web", "198.18.100.1", json!({})));
    f.server
        .apply(slice("web-a", "web", &["198.18.1.1"], json!({})));
    let mut n = node(NODE);
    n["metadata"]["labels"] = json!({"changed": "yes"});
    f.server.apply(n);
    wait(&mut f.source, "the three changes", |_, s| {
        names(&s.services) == ["web"]
            && names(&s.endpoint_slices) == ["web-a"]
            && s.nodes.iter().any(|n| {
                n.metadata
                    .labels
                    .as_ref()
                    .is_some_and(|l| l.contains_key("changed"))
            })
    })
    .await;
    let (changes, _) = f.source.changes();
    let SourceChanges::Changes(changes) = changes else {
        panic!("everything again after a bookmark: a relist");
    };
    let mut named: Vec<String> = changes
        .iter()
        .map(|c| match c {
            model::Change::Applied(o) => format!("{:?} {}", o.kind(), o.key().1),
            model::Change::Deleted(k, key) => format!("{k:?} {} deleted", key.1),
        })
        .collect();
    named.sort();
    assert_eq!(named, ["EndpointSlice web-a", "Node node-1", "Service web"]);
}

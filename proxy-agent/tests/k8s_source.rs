//! The Kubernetes source against a scripted API server (tests/common): what
//! it asks for, what its snapshots hold, and how it rides out expired
//! watches, dropped connections and failing requests. Then one table of
//! scenarios run through both sources, which must give the same desired
//! state. No root needed: the fake server listens on 127.0.0.1.
mod common;

use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::{Duration, Instant},
};

use common::fake_apiserver::{FakeApiServer, Kind};
use proxy_agent::{
    k8s::{self, KubernetesOptions, KubernetesSource},
    manifests::Snapshot,
    model::{self, LbAlgorithm, ANNOTATION_LB_ALGORITHM},
    source::{ManifestsSource, Source, SourceChanges},
};
use proxy_common::svc_flags;
use serde_json::{json, Value};
use tokio::sync::mpsc;

const NODE: &str = "node-1";
const SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";
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
    let (client, _) = k8s::client(Some(&kubeconfig), None).await.expect("client");
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
async fn requests_carry_kube_proxys_selectors() {
    let f = fixture().await;
    let requests = f.server.requests();
    for kind in [Kind::Services, Kind::EndpointSlices] {
        let of: Vec<_> = requests.iter().filter(|r| r.kind == Some(kind)).collect();
        assert!(of.iter().any(|r| !r.is_watch()), "{kind:?} listed");
        for r in of {
            assert_eq!(
                r.query.get("labelSelector").map(String::as_str),
                Some(SELECTOR),
                "{r:?}"
            );
            assert_eq!(r.query.get("fieldSelector"), None, "{r:?}");
        }
    }
    let nodes: Vec<_> = requests
        .iter()
        .filter(|r| r.kind == Some(Kind::Nodes))
        .collect();
    assert!(!nodes.is_empty());
    for r in nodes {
        assert_eq!(
            r.query.get("fieldSelector").map(String::as_str),
            Some("metadata.name=node-1"),
            "{r:?}"
        );
        assert_eq!(r.query.get("labelSelector"), None, "{r:?}");
    }
    assert!(
        requests.iter().all(|r| r.kind.is_some()),
        "only the three collections: {requests:?}"
    );
    // The watches start from the list's resourceVersion.
    wait_server("three watches", || {
        Kind::ALL.iter().all(|k| f.server.open_watches(*k) == 1)
    })
    .await;
    assert!(f
        .server
        .requests()
        .iter()
        .filter(|r| r.is_watch())
        .all(|r| r.query.contains_key("resourceVersion")));
}

#[tokio::test]
async fn with_a_proxy_name_only_its_services_are_watched() {
    let server = FakeApiServer::start().await;
    server.apply(node(NODE));
    server.apply(service(
        "mine",
        "198.18.100.1",
        json!({"service.kubernetes.io/service-proxy-name": "ebpf"}),
    ));
    server.apply(service(
        "theirs",
        "198.18.100.2",
        json!({"service.kubernetes.io/service-proxy-name": "other"}),
    ));
    server.apply(service("plain", "198.18.100.3", json!({})));
    let (mut source, _rx, _dir) = source_for(&server, Some("ebpf")).await;
    let snap = wait(&mut source, "ready", |s, _| s.ready()).await;
    assert_eq!(names(&snap.services), ["mine"]);
    let expected = "service.kubernetes.io/service-proxy-name=ebpf,!service.kubernetes.io/headless";
    for r in server
        .requests()
        .iter()
        .filter(|r| r.kind == Some(Kind::Services))
    {
        assert_eq!(
            r.query.get("labelSelector").map(String::as_str),
            Some(expected)
        );
    }
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
async fn adds_modifications_and_deletions_show_up_trimmed() {
    let mut f = fixture().await;
    f.server.apply(service("web", "198.18.100.1", json!({})));
    f.server
        .apply(slice("web-a", "web", &["198.18.1.1"], json!({})));
    let snap = wait(&mut f.source, "web and its slice", |_, s| {
        names(&s.services) == ["web"] && names(&s.endpoint_slices) == ["web-a"]
    })
    .await;
    // Trimmed: no managedFields, only the trigger-time annotation.
    let m = &snap.endpoint_slices[0].metadata;
    assert!(
        m.managed_fields.as_ref().is_none_or(|f| f.is_empty()),
        "{m:?}"
    );
    let annotations: Vec<_> = m.annotations.iter().flat_map(|a| a.keys()).collect();
    assert_eq!(
        annotations,
        ["endpoints.kubernetes.io/last-change-trigger-time"]
    );
    // And of the endpoints' fields the model never reads.
    let e = &snap.endpoint_slices[0].endpoints[0];
    assert!(e.target_ref.is_none() && e.hostname.is_none(), "{e:?}");
    assert_eq!(e.addresses, ["198.18.1.1"]);

    f.server.apply(slice(
        "web-a",
        "web",
        &["198.18.1.1", "198.18.1.2"],
        json!({}),
    ));
    wait(&mut f.source, "the second endpoint", |_, s| {
        slice_ips(s, "web-a").len() == 2
    })
    .await;

    f.server.delete(Kind::EndpointSlices, "default", "web-a");
    f.server.delete(Kind::Services, "default", "web");
    wait(&mut f.source, "deletions", |_, s| {
        s.services.is_empty() && s.endpoint_slices.is_empty()
    })
    .await;
    // A bookmark is not a change.
    f.server.bookmark();
    let snap = wait(&mut f.source, "the node", |_, s| names(&s.nodes) == [NODE]).await;
    assert!(snap.services.is_empty());
}

/// Trimming keeps what the model reads: a Service's load-balancing
/// algorithm annotation reaches the frontend through the Kubernetes source
/// as it does through manifests (the trim once dropped every annotation but
/// the slices' trigger time, so the annotation worked from manifests only).
#[tokio::test]
async fn the_lb_algorithm_annotation_survives_trimming() {
    let mut f = fixture().await;
    let mut svc = service("web", "198.18.100.1", json!({}));
    svc["metadata"]["annotations"] = json!({
        ANNOTATION_LB_ALGORITHM: "round-robin",
        "kubectl.kubernetes.io/last-applied-configuration": "{}",
    });
    f.server.apply(svc);
    f.server.apply(slice(
        "web-a",
        "web",
        &["198.18.1.1", "198.18.1.2"],
        json!({}),
    ));
    let snap = wait(&mut f.source, "web and its slice", |_, s| {
        names(&s.services) == ["web"] && names(&s.endpoint_slices) == ["web-a"]
    })
    .await;
    let annotations: Vec<_> = snap.services[0]
        .metadata
        .annotations
        .iter()
        .flat_map(|a| a.keys())
        .collect();
    assert_eq!(annotations, [ANNOTATION_LB_ALGORITHM]);
    let (state, warnings) = model::desired_state(&snap, NODE);
    assert!(warnings.is_empty(), "{warnings:?}");
    let fe = state
        .frontends
        .values()
        .find(|fe| &*fe.service == "default/web")
        .expect("web's ClusterIP frontend");
    assert_eq!(
        fe.flags & svc_flags::ALG_MASK,
        LbAlgorithm::RoundRobin.flags(),
        "{fe:?}"
    );
}

#[tokio::test]
async fn labelled_services_are_excluded_and_external_name_and_headless_passed_through() {
    let mut f = fixture().await;
    f.server.apply(service(
        "headless-label",
        "198.18.100.1",
        json!({"service.kubernetes.io/headless": ""}),
    ));
    f.server.apply(service(
        "other-proxy",
        "198.18.100.2",
        json!({"service.kubernetes.io/service-proxy-name": "x"}),
    ));
    f.server.apply(slice(
        "headless-label-a",
        "headless-label",
        &["198.18.1.1"],
        json!({"service.kubernetes.io/headless": ""}),
    ));
    f.server.apply(json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "ext", "namespace": "default"},
        "spec": {"type": "ExternalName", "externalName": "example.test"}}));
    f.server.apply(service("none", "None", json!({})));
    f.server.apply(service("web", "198.18.100.3", json!({})));
    let snap = wait(&mut f.source, "the four services", |_, s| {
        s.services.len() == 3
    })
    .await;
    assert_eq!(names(&snap.services), ["ext", "none", "web"]);
    assert!(snap.endpoint_slices.is_empty(), "{}", summary(&snap));
    // The model ignores ExternalName and clusterIP None.
    let (desired, _) = model::desired_state(&snap, NODE);
    let services: Vec<_> = desired
        .frontends
        .values()
        .map(|f| f.service.to_string())
        .collect();
    assert_eq!(services, ["default/web"]);

    // A Service that gains the label leaves the watch (sent as DELETED).
    f.server.apply(service(
        "web",
        "198.18.100.3",
        json!({"service.kubernetes.io/service-proxy-name": "x"}),
    ));
    wait(&mut f.source, "web gone", |_, s| {
        names(&s.services) == ["ext", "none"]
    })
    .await;
    // And comes back when it loses it.
    f.server.apply(service("web", "198.18.100.3", json!({})));
    wait(&mut f.source, "web back", |_, s| {
        names(&s.services) == ["ext", "none", "web"]
    })
    .await;
}

/// Feeds the model what the source says changed until `cond` holds;
/// returns how many times the source gave everything instead of changes.
async fn follow(
    source: &mut KubernetesSource,
    model: &mut model::Incremental,
    what: &str,
    cond: impl Fn(&model::DesiredState) -> bool,
) -> (usize, Vec<String>) {
    let deadline = Instant::now() + PATIENCE;
    let mut full = 0;
    let mut named = Vec::new();
    loop {
        match source.changes() {
            (SourceChanges::Full(snapshot), _) => {
                full += 1;
                model.replace(snapshot);
            }
            (SourceChanges::All(objects), _) => {
                full += 1;
                model.replace_objects(objects);
            }
            (SourceChanges::Changes(changes), _) => {
                named.extend(changes.iter().map(|c| match c {
                    model::Change::Applied(o) => format!("{:?} {:?}", o.kind(), o.key()),
                    model::Change::Deleted(k, key) => format!("{k:?} {key:?} deleted"),
                }));
                model.apply(changes);
            }
        }
        // Whatever the path, the model holds what a computation from the
        // store's whole content gives.
        let (snapshot, _) = source.snapshot();
        let (expected, _) = model::desired_state(&snapshot, NODE);
        if cond(model.desired()) && model.desired() == &expected {
            return (full, named);
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; last snapshot: {}",
            summary(&snapshot)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn watch_events_reach_the_model_as_changes_and_a_relist_as_everything() {
    let mut f = fixture().await;
    let mut m = model::Incremental::new(NODE, model::ModelOptions::default());
    let (full, _) = follow(&mut f.source, &mut m, "the first list", |_| true).await;
    assert_eq!(full, 1, "the first call gives everything");

    let vip: std::net::Ipv4Addr = "198.18.100.1".parse().unwrap();
    let backends = |d: &model::DesiredState| -> Vec<String> {
        d.frontends
            .iter()
            .filter(|(k, _)| k.addr == vip)
            .flat_map(|(_, f)| f.backends.iter().map(|b| b.addr.to_string()))
            .collect()
    };
    f.server.apply(service("web", "198.18.100.1", json!({})));
    f.server
        .apply(slice("web-a", "web", &["198.18.1.1"], json!({})));
    let (full, named) = follow(&mut f.source, &mut m, "web", |d| {
        backends(d) == ["198.18.1.1"]
    })
    .await;
    assert_eq!(full, 0, "{named:?}");
    assert!(
        named.iter().all(|n| n.contains("\"web")),
        "only what changed is named: {named:?}"
    );

    f.server.apply(slice(
        "web-a",
        "web",
        &["198.18.1.1", "198.18.1.2"],
        json!({}),
    ));
    let (full, named) = follow(&mut f.source, &mut m, "the second endpoint", |d| {
        backends(d).len() == 2
    })
    .await;
    assert_eq!(full, 0);
    assert_eq!(
        named,
        ["EndpointSlice (\"default\", \"web-a\")"],
        "the slice alone"
    );

    f.server.delete(Kind::EndpointSlices, "default", "web-a");
    let (full, named) = follow(&mut f.source, &mut m, "the deletion", |d| {
        backends(d).is_empty() && !d.frontends.is_empty()
    })
    .await;
    assert_eq!(full, 0);
    assert_eq!(named, ["EndpointSlice (\"default\", \"web-a\") deleted"]);

    // Changes the watch never carries, then a relist: everything, compared.
    f.server.set_hidden(true);
    f.server.delete(Kind::Services, "default", "web");
    f.server.set_hidden(false);
    f.server.expire(Kind::Services);
    let (full, _) = follow(&mut f.source, &mut m, "the relisted state", |d| {
        d.frontends.is_empty()
    })
    .await;
    assert!(full >= 1, "a relist gives everything");
}

#[tokio::test]
async fn an_expired_watch_relists_and_picks_up_changes_made_meanwhile() {
    let mut f = fixture().await;
    f.server.apply(service("web", "198.18.100.1", json!({})));
    f.server
        .apply(slice("web-a", "web", &["198.18.1.1"], json!({})));
    wait(&mut f.source, "web", |_, s| s.endpoint_slices.len() == 1).await;
    let lists_before = f.server.counts(Kind::EndpointSlices).0;

    // Changes the open watches never carry, then the history is compacted.
    f.server.set_hidden(true);
    f.server
        .apply(slice("web-a", "web", &["198.18.1.7"], json!({})));
    f.server.apply(service("api", "198.18.100.2", json!({})));
    f.server.delete(Kind::Services, "default", "web");
    f.server.set_hidden(false);
    f.server.expire(Kind::Services);
    f.server.expire(Kind::EndpointSlices);

    let snap = wait(&mut f.source, "the relisted state", |_, s| {
        names(&s.services) == ["api"] && slice_ips(s, "web-a") == ["198.18.1.7"]
    })
    .await;
    assert!(
        f.server.counts(Kind::EndpointSlices).0 > lists_before,
        "relisted"
    );
    assert_eq!(names(&snap.nodes), [NODE], "other stores untouched");
    assert!(f.source.ready());
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

// ---------------------------------------------------------------------------
// One table, both sources.
// ---------------------------------------------------------------------------

struct Scenario {
    name: &'static str,
    /// Multi-document YAML: Services, EndpointSlices, Nodes.
    objects: &'static str,
    /// Frontend (`addr:port/proto (scope)`) → backends (`addr:port`).
    expected: &'static [(&'static str, &'static [&'static str])],
}

const NODE_YAML: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus:\n  addresses: [{type: InternalIP, address: 198.18.0.1}]\n";

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "cluster IP with two ready endpoints, one not ready",
        objects: r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec: {type: ClusterIP, clusterIP: 198.18.100.1, clusterIPs: [198.18.100.1], ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [198.18.1.1], conditions: {ready: true}, nodeName: node-1}
- {addresses: [198.18.1.2], conditions: {ready: true}, nodeName: node-2}
- {addresses: [198.18.1.3], conditions: {ready: false}, nodeName: node-2}
"#,
        expected: &[(
            "198.18.100.1:80/TCP (internal)",
            &["198.18.1.1:8080", "198.18.1.2:8080"],
        )],
    },
    Scenario {
        name: "UDP and TCP ports, two slices",
        objects: r#"
apiVersion: v1
kind: Service
metadata: {name: dns, namespace: kube-system}
spec:
  clusterIP: 198.18.100.10
  ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dns-1, namespace: kube-system, labels: {kubernetes.io/service-name: dns}}
addressType: IPv4
ports: [{name: dns, port: 5353, protocol: UDP}, {name: dns-tcp, port: 5353, protocol: TCP}]
endpoints: [{addresses: [198.18.2.1]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dns-2, namespace: kube-system, labels: {kubernetes.io/service-name: dns}}
addressType: IPv4
ports: [{name: dns, port: 5353, protocol: UDP}, {name: dns-tcp, port: 5353, protocol: TCP}]
endpoints: [{addresses: [198.18.2.2]}]
"#,
        expected: &[
            (
                "198.18.100.10:53/TCP (internal)",
                &["198.18.2.1:5353", "198.18.2.2:5353"],
            ),
            (
                "198.18.100.10:53/UDP (internal)",
                &["198.18.2.1:5353", "198.18.2.2:5353"],
            ),
        ],
    },
    Scenario {
        name: "ignored: headless label, other proxy, ExternalName, clusterIP None",
        objects: r#"
apiVersion: v1
kind: Service
metadata: {name: a, namespace: default, labels: {service.kubernetes.io/headless: ""}}
spec: {clusterIP: 198.18.100.20, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: b, namespace: default, labels: {service.kubernetes.io/service-proxy-name: other}}
spec: {clusterIP: 198.18.100.21, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: c, namespace: default}
spec: {type: ExternalName, externalName: example.test}
---
apiVersion: v1
kind: Service
metadata: {name: d, namespace: default}
spec: {clusterIP: None, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: b-1, namespace: default, labels: {kubernetes.io/service-name: b, service.kubernetes.io/service-proxy-name: other}}
addressType: IPv4
ports: [{port: 80}]
endpoints: [{addresses: [198.18.3.1]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: d-1, namespace: default, labels: {kubernetes.io/service-name: d, service.kubernetes.io/headless: ""}}
addressType: IPv4
ports: [{port: 80}]
endpoints: [{addresses: [198.18.3.2]}]
"#,
        expected: &[],
    },
    Scenario {
        name: "a service without endpoints has a frontend without backends",
        objects: r#"
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: default}
spec: {clusterIP: 198.18.100.30, ports: [{port: 8080, protocol: TCP}]}
"#,
        expected: &[("198.18.100.30:8080/TCP (internal)", &[])],
    },
];

type Summary = BTreeMap<String, Vec<String>>;

fn desired(snap: &Snapshot) -> Summary {
    let (d, _) = model::desired_state(snap, NODE);
    d.frontends
        .iter()
        .map(|(k, f)| {
            let mut b: Vec<String> = f
                .backends
                .iter()
                .map(|b| format!("{}:{}", b.addr, b.port))
                .collect();
            b.sort();
            (k.to_string(), b)
        })
        .collect()
}

#[tokio::test]
async fn the_same_scenario_table_runs_through_both_sources() {
    for sc in SCENARIOS {
        let expected: Summary = sc
            .expected
            .iter()
            .map(|(f, b)| (f.to_string(), b.iter().map(|s| s.to_string()).collect()))
            .collect();

        // Manifests: the same objects as files.
        let dir = tempfile::tempdir().unwrap();
        let file: PathBuf = dir.path().join("objects.yaml");
        std::fs::write(&file, format!("{NODE_YAML}---{}", sc.objects)).unwrap();
        let mut manifests = ManifestsSource::new(vec![file]);
        let (snap, errors) = manifests.snapshot();
        assert_eq!(errors, 0, "{}", sc.name);
        let from_manifests = desired(&snap);

        // Kubernetes: the same objects served.
        let server = FakeApiServer::start().await;
        server.apply_yaml(NODE_YAML);
        server.apply_yaml(sc.objects);
        let (mut source, _rx, _dir) = source_for(&server, None).await;
        let snap = wait(&mut source, "ready", |s, _| s.ready()).await;
        let from_kubernetes = desired(&snap);

        assert_eq!(from_manifests, expected, "{}: manifests", sc.name);
        assert_eq!(from_kubernetes, expected, "{}: kubernetes", sc.name);
    }
}

//! The Kubernetes source (`KubernetesSource`, in-process) against a real
//! control plane: etcd, kube-apiserver and kube-controller-manager v1.37.2
//! built by setup, run by the lab (`xtask::Lab` with `control_plane(true)`,
//! no agent, no traffic). The source dials the API server as deploy/'s
//! ServiceAccount from inside the control plane's namespace; its requests
//! are read back from the API server's audit log.
//!
//! These were the cases of `k8s_source.rs` that a real server can produce;
//! the real one adds what a scripted server took on trust: the server's own
//! managedFields and kubectl's annotations to trim, the EndpointSlice
//! controller copying a Service's labels onto its slices (so kube-proxy's
//! selector drops those too; all but the headless label, which it reserves),
//! `DELETED` for an object that leaves a label
//! selector, a watch expired by a restart and etcd's compaction (410 Gone),
//! and the API server's defaults in the table run through both sources.
//!
//! One lab for all of them, so one test (about 20 s here: 5 s for the lab
//! to start, 9 s for the API server's restart): the cases run in order, each
//! in a Kubernetes namespace of its own, the one that restarts the API
//! server last.
//!
//! Run with `cargo xtask test` (`#[ignore]`d under a plain `cargo test`).
//!
//! Why one file (about 1,200 lines): that one test is the file. Its cases
//! share the lab and one harness (`Ctx`: the lab, a runtime in the control
//! plane's namespace, kubectl, the audit log), and the scenario table runs
//! through both sources against the same server. The file is in sections:
//! the harness, objects and snapshots, the cases, the table, the test.

use std::{
    collections::BTreeMap,
    fs::File,
    path::PathBuf,
    time::{Duration, Instant},
};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use proxy_agent::{
    model::{self, LbAlgorithm, ANNOTATION_LB_ALGORITHM},
    objects::Snapshot,
    sources::kubernetes::{self, KubernetesOptions, KubernetesSource},
    sources::{ManifestsSource, Source, SourceChanges},
};
use proxy_common::svc_flags;
use serde_json::{json, Value};
use tokio::{runtime::Runtime, sync::mpsc};
use xtask::{lab::ControlPlaneInfo, Lab};

/// The names of [`Ctx::settle`]'s markers.
const MARKER: &str = "marker-";
/// The lab's node (the Node object the lab writes as its kubelet).
const NODE: &str = "node-1";
const SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";
/// Bound of every wait for the source to see a change.
const PATIENCE: Duration = Duration::from_secs(15);
/// Bound of the wait for a relist after the API server's restart.
const RELIST: Duration = Duration::from_secs(45);

// ---------------------------------------------------------------------------
// The harness: the lab, a runtime in the control plane's namespace, kubectl

/// What every case works with. The runtime runs on the test's own thread
/// (current-thread), so the source's watches make progress only while a
/// case waits on it: between waits, the source is as frozen as a stopped
/// process.
struct Ctx<'a> {
    lab: &'a mut Lab,
    cp: ControlPlaneInfo,
    rt: Runtime,
}

/// A started source and its change signal.
struct Src {
    source: KubernetesSource,
    _changes: mpsc::UnboundedReceiver<()>,
}

impl Ctx<'_> {
    fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> String {
        self.cp
            .kubectl_run(args, stdin)
            .unwrap_or_else(|e| panic!("kubectl {args:?}: {e:#}"))
    }

    /// Creates or updates the objects with `kubectl apply` (as a user
    /// does: kubectl adds its last-applied annotation, the server its
    /// managedFields).
    fn apply(&self, objects: &[Value]) {
        let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
        self.kubectl(&["apply", "-f", "-"], Some(&list.to_string()));
    }

    fn apply_yaml(&self, yaml: &str) {
        self.kubectl(&["apply", "-f", "-"], Some(yaml));
    }

    fn delete(&self, kind: &str, ns: &str, name: &str) {
        self.kubectl(&["delete", "-n", ns, kind, name, "--wait=false"], None);
    }

    /// A source as the agent starts it, as deploy/'s ServiceAccount.
    fn source(&self, proxy_name: Option<&str>) -> Src {
        let (source, rx) = self.rt.block_on(async {
            let (client, _) = kubernetes::client(Some(&self.cp.agent_kubeconfig), None)
                .await
                .expect("a client from the agents' kubeconfig");
            let mut source = KubernetesSource::new(
                client,
                KubernetesOptions {
                    node_name: NODE.into(),
                    service_proxy_name: proxy_name.map(str::to_string),
                    api_server: None,
                },
            );
            let (tx, rx) = mpsc::unbounded_channel();
            source.start(tx).expect("start");
            (source, rx)
        });
        let mut src = Src {
            source,
            _changes: rx,
        };
        self.wait(&mut src, "ready", |s, _| s.ready());
        src
    }

    /// Lets the source run until `cond` holds on it and its snapshot.
    fn wait(
        &self,
        src: &mut Src,
        what: &str,
        cond: impl Fn(&KubernetesSource, &Snapshot) -> bool,
    ) -> Snapshot {
        self.wait_within(src, what, PATIENCE, cond)
    }

    fn wait_within(
        &self,
        src: &mut Src,
        what: &str,
        bound: Duration,
        cond: impl Fn(&KubernetesSource, &Snapshot) -> bool,
    ) -> Snapshot {
        self.rt.block_on(async {
            let deadline = Instant::now() + bound;
            loop {
                let (snap, _) = src.source.snapshot();
                if cond(&src.source, &snap) {
                    return snap;
                }
                assert!(
                    Instant::now() < deadline,
                    "timed out waiting for {what}; last snapshot: {}",
                    summary(&snap)
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    }

    /// Makes the source catch up with everything written to `ns` so far:
    /// writes a marker Service (ExternalName: no frontend) and a marker
    /// EndpointSlice (of it) after it and waits for both. Each watch
    /// delivers in the server's order, so whatever of `ns` the source has
    /// not seen by then, its selector left out. Markers are left in place;
    /// the helpers below do not list them.
    fn settle(&self, src: &mut Src, ns: &str) -> Snapshot {
        let marker = format!("{MARKER}{}", marker_seq());
        self.apply(&[
            json!({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": marker, "namespace": ns},
                   "spec": {"type": "ExternalName", "externalName": "marker.test"}}),
            slice(ns, &marker, &marker, &[], json!({})),
        ]);
        self.wait(src, &format!("the marker {ns}/{marker}"), |_, s| {
            let is_marker = |m: &ObjectMeta| {
                m.namespace.as_deref() == Some(ns) && m.name.as_deref() == Some(marker.as_str())
            };
            s.services.iter().any(|o| is_marker(&o.metadata))
                && s.endpoint_slices.iter().any(|o| is_marker(&o.metadata))
        })
    }

    /// The agents' requests the API server audited, from line `from` on:
    /// each once, as it started (a watch is audited again when it ends, a
    /// watch of an earlier source among them).
    fn audited(&self, from: usize) -> Vec<Audited> {
        std::fs::read_to_string(self.cp.audit_log())
            .unwrap_or_default()
            .lines()
            .skip(from)
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| !(e["verb"] == "watch" && e["stage"] == "ResponseComplete"))
            .map(|e| {
                let uri = e["requestURI"].as_str().unwrap_or("").to_string();
                Audited {
                    verb: e["verb"].as_str().unwrap_or("").to_string(),
                    resource: e["objectRef"]["resource"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                    query: query_of(&uri),
                    uri,
                }
            })
            .collect()
    }

    fn audit_lines(&self) -> usize {
        std::fs::read_to_string(self.cp.audit_log())
            .unwrap_or_default()
            .lines()
            .count()
    }

    /// Waits until the audit log from line `from` on holds a watch of each
    /// of the three collections.
    fn wait_audited_watches(&self, from: usize) -> Vec<Audited> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let a = self.audited(from);
            if ["services", "endpointslices", "nodes"]
                .iter()
                .all(|r| a.iter().any(|x| x.verb == "watch" && x.resource == *r))
            {
                return a;
            }
            assert!(
                Instant::now() < deadline,
                "three watches in the audit log: {a:#?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn marker_seq() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    SEQ.fetch_add(1, Ordering::Relaxed)
}

/// One audited request.
#[derive(Debug)]
struct Audited {
    verb: String,
    resource: String,
    uri: String,
    query: BTreeMap<String, String>,
}

/// The query of a request URI, percent-decoded.
fn query_of(uri: &str) -> BTreeMap<String, String> {
    let decode = |s: &str| {
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'%' if i + 2 < b.len() => {
                    let h = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                    match u8::from_str_radix(h, 16) {
                        Ok(v) => {
                            out.push(v);
                            i += 3;
                            continue;
                        }
                        Err(_) => out.push(b'%'),
                    }
                }
                b'+' => out.push(b' '),
                c => out.push(c),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    uri.split_once('?')
        .map(|(_, q)| q)
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// Runs `f` on a thread inside the network namespace `ns` (the API server
/// is reachable only from lab namespaces); the calling thread, and the
/// lab it owns, stay where they are, and a panic comes back to it.
fn in_namespace<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    let file = File::open(xtask::netns::netns_path(ns)).expect("the namespace");
    std::thread::scope(|s| {
        let h = s.spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            drop(file);
            f()
        });
        h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

// ---------------------------------------------------------------------------
// Objects and what the snapshots hold

/// A Service as a user writes it: the allocator picks its ClusterIP.
/// With `selector`, the EndpointSlice controller publishes its slices
/// (empty: no pod matches); without, slices are written by hand.
fn service(ns: &str, name: &str, labels: Value, selector: bool) -> Value {
    let mut spec = json!({"type": "ClusterIP",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]});
    if selector {
        spec["selector"] = json!({"app": format!("{name}-no-pods")});
    }
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": ns, "labels": labels},
           "spec": spec})
}

/// An EndpointSlice written by hand (no `managed-by` label, so the
/// controllers leave it alone), with fields the source drops.
fn slice(ns: &str, name: &str, service: &str, ips: &[&str], labels: Value) -> Value {
    let mut l = labels.as_object().cloned().unwrap_or_default();
    l.insert("kubernetes.io/service-name".into(), json!(service));
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": name, "namespace": ns, "labels": l,
                        "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2030-01-01T00:00:00Z"}},
           "addressType": "IPv4",
           "endpoints": ips.iter().map(|ip| json!({"addresses": [ip], "conditions": {"ready": true}, "nodeName": NODE,
                                                   "hostname": "pod", "targetRef": {"kind": "Pod", "namespace": ns, "name": "pod", "uid": "0f6e2a48-0000-4000-8000-000000000000"}})).collect::<Vec<_>>(),
           "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]})
}

fn namespace_of<T: k8s_openapi::Metadata<Ty = ObjectMeta>>(o: &T) -> &str {
    o.metadata().namespace.as_deref().unwrap_or("")
}

/// The names of `objects` in `ns`, the test's markers left out, sorted.
fn names_in<T: k8s_openapi::Metadata<Ty = ObjectMeta>>(objects: &[T], ns: &str) -> Vec<String> {
    let mut v: Vec<String> = objects
        .iter()
        .filter(|o| namespace_of(*o) == ns)
        .map(|o| o.metadata().name.clone().unwrap_or_default())
        .filter(|n| !n.starts_with(MARKER))
        .collect();
    v.sort();
    v
}

fn services_in(snap: &Snapshot, ns: &str) -> Vec<String> {
    names_in(&snap.services, ns)
}

fn slices_in(snap: &Snapshot, ns: &str) -> Vec<String> {
    names_in(&snap.endpoint_slices, ns)
}

/// The Services the slices in `ns` are of (`kubernetes.io/service-name`).
fn slice_services_in(snap: &Snapshot, ns: &str) -> Vec<String> {
    let mut v: Vec<String> = snap
        .endpoint_slices
        .iter()
        .filter(|s| namespace_of(*s) == ns)
        .filter_map(|s| {
            s.metadata
                .labels
                .as_ref()?
                .get("kubernetes.io/service-name")
                .cloned()
        })
        .filter(|n| !n.starts_with(MARKER))
        .collect();
    v.sort();
    v
}

fn slice_ips(snap: &Snapshot, ns: &str, name: &str) -> Vec<String> {
    snap.endpoint_slices
        .iter()
        .filter(|s| namespace_of(*s) == ns && s.metadata.name.as_deref() == Some(name))
        .flat_map(|s| s.endpoints.iter().flat_map(|e| e.addresses.clone()))
        .collect()
}

fn node_names(snap: &Snapshot) -> Vec<String> {
    snap.nodes
        .iter()
        .map(|n| n.metadata.name.clone().unwrap_or_default())
        .collect()
}

fn summary(snap: &Snapshot) -> String {
    let keys = |v: Vec<(String, String)>| {
        v.into_iter()
            .map(|(ns, n)| format!("{ns}/{n}"))
            .collect::<Vec<_>>()
    };
    format!(
        "services {:?}, slices {:?}, nodes {:?}",
        keys(
            snap.services
                .iter()
                .map(|s| (
                    namespace_of(s).into(),
                    s.metadata.name.clone().unwrap_or_default()
                ))
                .collect()
        ),
        keys(
            snap.endpoint_slices
                .iter()
                .map(|s| (
                    namespace_of(s).into(),
                    s.metadata.name.clone().unwrap_or_default()
                ))
                .collect()
        ),
        node_names(snap)
    )
}

/// The Services in `ns` that have a frontend in the desired state.
fn served_in(desired: &model::DesiredState, ns: &str) -> Vec<String> {
    let prefix = format!("{ns}/");
    let mut v: Vec<String> = desired
        .frontends
        .values()
        .filter_map(|f| f.service.strip_prefix(&prefix).map(str::to_string))
        .collect();
    v.sort();
    v.dedup();
    v
}

// ---------------------------------------------------------------------------
// The cases

/// kube-proxy's selectors on every request: Services and EndpointSlices
/// listed and watched with the label selector that leaves out other
/// proxies' and headless ones, and no field selector; the Node by its name
/// only; nothing but the three collections; the watches from the list's
/// resourceVersion.
fn requests_carry_kube_proxys_selectors(c: &mut Ctx) {
    let from = c.audit_lines();
    let src = c.source(None);
    let requests = c.wait_audited_watches(from);
    drop(src);
    for r in ["services", "endpointslices"] {
        let of: Vec<_> = requests.iter().filter(|a| a.resource == r).collect();
        assert!(of.iter().any(|a| a.verb == "list"), "{r} listed: {of:#?}");
        for a in of {
            assert_eq!(
                a.query.get("labelSelector").map(String::as_str),
                Some(SELECTOR),
                "{a:?}"
            );
            assert_eq!(a.query.get("fieldSelector"), None, "{a:?}");
        }
    }
    let nodes: Vec<_> = requests.iter().filter(|a| a.resource == "nodes").collect();
    assert!(nodes.iter().any(|a| a.verb == "list"), "{nodes:#?}");
    for a in nodes {
        assert_eq!(
            a.query.get("fieldSelector").map(String::as_str),
            Some("metadata.name=node-1"),
            "{a:?}"
        );
        assert_eq!(a.query.get("labelSelector"), None, "{a:?}");
    }
    assert!(
        requests
            .iter()
            .all(
                |a| ["services", "endpointslices", "nodes"].contains(&a.resource.as_str())
                    && ["list", "watch"].contains(&a.verb.as_str())
            ),
        "only lists and watches of the three collections: {requests:#?}"
    );
    for a in requests.iter().filter(|a| a.verb == "watch") {
        let rv = a.query.get("resourceVersion").map(String::as_str);
        assert!(
            rv.is_some_and(|v| !v.is_empty() && v != "0"),
            "a watch from the list's resourceVersion: {}",
            a.uri
        );
    }
}

/// With `service-proxy-name: ebpf`, only Services labelled so are watched,
/// and only their slices: the EndpointSlice controller copies a Service's
/// labels onto its slices, and the selector drops the others'.
fn with_a_proxy_name_only_its_services_and_their_slices_are_watched(c: &mut Ctx) {
    let ns = "proxy-name";
    let pn = |v: &str| json!({"service.kubernetes.io/service-proxy-name": v});
    c.apply(&[
        service(ns, "mine", pn("ebpf"), true),
        service(ns, "theirs", pn("other"), true),
        service(ns, "plain", json!({}), true),
    ]);
    wait_for_controller_slices(c, ns, &["mine", "plain", "theirs"]);
    let from = c.audit_lines();
    // The slices exist before the source lists: its first list has them.
    let mut src = c.source(Some("ebpf"));
    let (snap, _) = src.source.snapshot();
    let requests = c.wait_audited_watches(from);
    drop(src);
    let all: Vec<String> = snap
        .services
        .iter()
        .map(|s| {
            format!(
                "{}/{}",
                namespace_of(s),
                s.metadata.name.as_deref().unwrap_or("")
            )
        })
        .collect();
    assert_eq!(
        all,
        [format!("{ns}/mine")],
        "only its Services, cluster-wide"
    );
    assert_eq!(slice_services_in(&snap, ns), ["mine"], "only their slices");
    let expected = "service.kubernetes.io/service-proxy-name=ebpf,!service.kubernetes.io/headless";
    for a in requests
        .iter()
        .filter(|a| a.resource == "services" || a.resource == "endpointslices")
    {
        assert_eq!(
            a.query.get("labelSelector").map(String::as_str),
            Some(expected),
            "{a:?}"
        );
    }
}

/// Waits until the EndpointSlice controller has published a slice of each
/// of `services` in `ns` (read from the server, not the source).
fn wait_for_controller_slices(c: &Ctx, ns: &str, services: &[&str]) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let out: Value = serde_json::from_str(
            &c.kubectl(&["get", "endpointslices", "-n", ns, "-o", "json"], None),
        )
        .expect("JSON");
        let mut have: Vec<&str> = out["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["metadata"]["labels"]["kubernetes.io/service-name"].as_str())
            .collect();
        have.sort();
        have.dedup();
        if services.iter().all(|s| have.contains(s)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the controller's slices of {services:?} in {ns}: {have:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Adds, modifications and deletions reach the snapshot, trimmed of what
/// the agent never reads: the server's managedFields, kubectl's
/// last-applied annotation, the endpoints' targetRef and hostname.
fn adds_modifications_and_deletions_show_up_trimmed(c: &mut Ctx) {
    let ns = "changes";
    let mut src = c.source(None);
    c.apply(&[
        service(ns, "web", json!({}), false),
        slice(ns, "web-a", "web", &["198.18.1.1"], json!({})),
    ]);
    let snap = c.wait(&mut src, "web and its slice", |_, s| {
        services_in(s, ns) == ["web"] && slices_in(s, ns) == ["web-a"]
    });
    // What the server stored carries all that the source must drop.
    let stored: Value = serde_json::from_str(&c.kubectl(
        &[
            "get",
            "endpointslice",
            "-n",
            ns,
            "web-a",
            "-o",
            "json",
            "--show-managed-fields",
        ],
        None,
    ))
    .expect("JSON");
    assert!(
        stored["metadata"]["managedFields"]
            .as_array()
            .is_some_and(|m| !m.is_empty())
            && stored["metadata"]["annotations"]
                ["kubectl.kubernetes.io/last-applied-configuration"]
                .is_string()
            && stored["endpoints"][0]["targetRef"].is_object(),
        "the stored slice: {stored}"
    );
    let s = snap
        .endpoint_slices
        .iter()
        .find(|s| namespace_of(*s) == ns)
        .expect("web-a");
    let m = &s.metadata;
    assert!(
        m.managed_fields.as_ref().is_none_or(|f| f.is_empty()),
        "{m:?}"
    );
    let annotations: Vec<_> = m.annotations.iter().flat_map(|a| a.keys()).collect();
    assert_eq!(
        annotations,
        ["endpoints.kubernetes.io/last-change-trigger-time"]
    );
    let e = &s.endpoints[0];
    assert!(e.target_ref.is_none() && e.hostname.is_none(), "{e:?}");
    assert_eq!(e.addresses, ["198.18.1.1"]);

    c.apply(&[slice(
        ns,
        "web-a",
        "web",
        &["198.18.1.1", "198.18.1.2"],
        json!({}),
    )]);
    c.wait(&mut src, "the second endpoint", |_, s| {
        slice_ips(s, ns, "web-a").len() == 2
    });

    c.delete("endpointslice", ns, "web-a");
    c.delete("service", ns, "web");
    let snap = c.wait(&mut src, "deletions", |_, s| {
        services_in(s, ns).is_empty() && slices_in(s, ns).is_empty()
    });
    assert_eq!(node_names(&snap), [NODE], "the Node untouched");
}

/// Trimming keeps what the model reads: a Service's load-balancing
/// algorithm annotation (beside kubectl's, which goes) reaches the
/// frontend through the Kubernetes source.
fn the_lb_algorithm_annotation_survives_trimming(c: &mut Ctx) {
    let ns = "annotation";
    let mut src = c.source(None);
    let mut svc = service(ns, "web", json!({}), false);
    svc["metadata"]["annotations"] = json!({ANNOTATION_LB_ALGORITHM: "round-robin"});
    c.apply(&[
        svc,
        slice(ns, "web-a", "web", &["198.18.1.1", "198.18.1.2"], json!({})),
    ]);
    let snap = c.wait(&mut src, "web and its slice", |_, s| {
        services_in(s, ns) == ["web"] && slices_in(s, ns) == ["web-a"]
    });
    let web = snap
        .services
        .iter()
        .find(|s| namespace_of(*s) == ns)
        .expect("web");
    let annotations: Vec<_> = web
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
        .find(|fe| &*fe.service == "annotation/web")
        .expect("web's ClusterIP frontend");
    assert_eq!(
        fe.flags & svc_flags::ALG_MASK,
        LbAlgorithm::RoundRobin.flags(),
        "{fe:?}"
    );
    assert_eq!(fe.backends.len(), 2, "{fe:?}");
}

/// Services labelled headless or for another proxy never reach the
/// source, nor the slices the controller labels so: those of a Service for
/// another proxy (it copies the Service's labels) and of a `clusterIP:
/// None` Service. It reserves the headless label, so the slice of a
/// Service merely labelled headless does reach the source (as it reaches
/// kube-proxy, through the same selector), and the model serves nothing of
/// it. ExternalName and `clusterIP: None` Services reach the source, and
/// the model ignores them. A Service that gains the proxy-name label leaves
/// the watch (the server sends DELETED), its slice with it; both come back
/// when it loses the label.
fn labelled_services_are_excluded_and_external_name_and_headless_passed_through(c: &mut Ctx) {
    let ns = "labels";
    let mut src = c.source(None);
    let mut none = service(ns, "none", json!({}), true);
    none["spec"]["clusterIP"] = json!("None");
    c.apply(&[
        service(
            ns,
            "headless-label",
            json!({"service.kubernetes.io/headless": ""}),
            true,
        ),
        service(
            ns,
            "other-proxy",
            json!({"service.kubernetes.io/service-proxy-name": "x"}),
            true,
        ),
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "ext", "namespace": ns},
               "spec": {"type": "ExternalName", "externalName": "example.test"}}),
        none,
        service(ns, "web", json!({}), true),
    ]);
    wait_for_controller_slices(c, ns, &["headless-label", "none", "other-proxy", "web"]);
    let snap = c.settle(&mut src, ns);
    assert_eq!(services_in(&snap, ns), ["ext", "none", "web"]);
    assert_eq!(
        slice_services_in(&snap, ns),
        ["headless-label", "web"],
        "{}",
        summary(&snap)
    );
    let (desired, _) = model::desired_state(&snap, NODE);
    assert_eq!(served_in(&desired, ns), ["web"]);

    let labelled = service(
        ns,
        "web",
        json!({"service.kubernetes.io/service-proxy-name": "x"}),
        true,
    );
    c.apply(&[labelled]);
    c.wait(&mut src, "web and its slice gone", |_, s| {
        services_in(s, ns) == ["ext", "none"] && slice_services_in(s, ns) == ["headless-label"]
    });
    c.apply(&[service(ns, "web", json!({}), true)]);
    c.wait(&mut src, "web and its slice back", |_, s| {
        services_in(s, ns) == ["ext", "none", "web"]
            && slice_services_in(s, ns) == ["headless-label", "web"]
    });
}

/// Feeds the model what the source says changed until `cond` holds on the
/// model and the model equals a computation from the source's whole
/// content; returns how many times the source gave everything instead of
/// changes, and the changes it named.
fn follow(
    c: &Ctx,
    src: &mut Src,
    model: &mut model::Incremental,
    what: &str,
    bound: Duration,
    cond: impl Fn(&model::DesiredState) -> bool,
) -> (usize, Vec<String>) {
    c.rt.block_on(async {
        let deadline = Instant::now() + bound;
        let mut full = 0;
        let mut named = Vec::new();
        loop {
            match src.source.changes() {
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
            let (snapshot, _) = src.source.snapshot();
            let (expected, _) = model::desired_state(&snapshot, NODE);
            if cond(model.desired()) && model.desired() == &expected {
                return (full, named);
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; named {named:?}; last snapshot: {}",
                summary(&snapshot)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

/// The backends of `ns/web`'s frontends.
fn web_backends(ns: &str) -> impl Fn(&model::DesiredState) -> Vec<String> {
    let service = format!("{ns}/web");
    move |d| {
        d.frontends
            .values()
            .filter(|f| *f.service == *service)
            .flat_map(|f| f.backends.iter().map(|b| b.addr.to_string()))
            .collect()
    }
}

/// Watch events reach the model as changes naming only what changed: an
/// added Service and slice, a slice modified, a slice deleted. Returns the
/// source and the model, for the relist that follows.
fn watch_events_reach_the_model_as_changes(c: &mut Ctx) -> (Src, model::Incremental) {
    let ns = "model";
    let mut src = c.source(None);
    let mut m = model::Incremental::new(NODE, model::ModelOptions::default());
    let (full, _) = follow(c, &mut src, &mut m, "the first list", PATIENCE, |_| true);
    assert_eq!(full, 1, "the first call gives everything");
    let backends = web_backends(ns);

    c.apply(&[
        service(ns, "web", json!({}), false),
        slice(ns, "web-a", "web", &["198.18.1.1"], json!({})),
    ]);
    let (full, named) = follow(c, &mut src, &mut m, "web", PATIENCE, |d| {
        backends(d) == ["198.18.1.1"]
    });
    assert_eq!(full, 0, "{named:?}");
    assert!(
        !named.is_empty() && named.iter().all(|n| n.contains("(\"model\", \"web")),
        "only what changed is named: {named:?}"
    );

    c.apply(&[slice(
        ns,
        "web-a",
        "web",
        &["198.18.1.1", "198.18.1.2"],
        json!({}),
    )]);
    let (full, named) = follow(c, &mut src, &mut m, "the second endpoint", PATIENCE, |d| {
        backends(d).len() == 2
    });
    assert_eq!(full, 0);
    assert_eq!(
        named,
        ["EndpointSlice (\"model\", \"web-a\")"],
        "the slice alone"
    );

    c.delete("endpointslice", ns, "web-a");
    let (full, named) = follow(c, &mut src, &mut m, "the deletion", PATIENCE, |d| {
        backends(d).is_empty() && !served_in(d, ns).is_empty()
    });
    assert_eq!(full, 0);
    assert_eq!(named, ["EndpointSlice (\"model\", \"web-a\") deleted"]);
    (src, m)
}

/// A watch expired: while the source is frozen, the API server restarts
/// (its watch cache with it), then a slice is changed, a Service added and
/// another deleted, and etcd's history compacted. Its watches, resumed from
/// their old resourceVersion, get 410 Gone and relist: the source gives
/// everything, the model then equals a computation from scratch, the
/// changes the watches never carried are there, the Node is untouched, and
/// the source stayed ready.
fn an_expired_watch_relists_everything_and_picks_up_changes_made_meanwhile(
    c: &mut Ctx,
    (mut src, mut m): (Src, model::Incremental),
) {
    let ns = "model";
    let backends = web_backends(ns);
    c.apply(&[slice(ns, "web-a", "web", &["198.18.1.1"], json!({}))]);
    follow(c, &mut src, &mut m, "web-a again", PATIENCE, |d| {
        backends(d) == ["198.18.1.1"]
    });
    let lists = |c: &Ctx| {
        let a = c.audited(0);
        let of = |r: &str| {
            a.iter()
                .filter(|a| a.verb == "list" && a.resource == r)
                .count()
        };
        (of("services"), of("endpointslices"))
    };
    let lists_before = lists(c);

    // Frozen from here (no runtime polled) until the next wait.
    let t = Instant::now();
    c.lab.stop_apiserver().expect("stop the API server");
    // A write while no API server runs: the restarted one's watch cache
    // starts past anything the old one can have told the watches (in an
    // event or a bookmark), so none of them can resume.
    bump_etcd_revision();
    c.lab.start_apiserver().expect("start the API server");
    c.lab
        .wait_apiserver_ready(Duration::from_secs(120))
        .expect("the API server ready");
    c.apply(&[
        slice(ns, "web-a", "web", &["198.18.1.7"], json!({})),
        service(ns, "api", json!({}), false),
    ]);
    c.delete("service", ns, "web");
    let compacted = c.lab.compact_etcd().expect("compact etcd");
    println!(
        "  API server restarted and etcd compacted at revision {compacted} in {:?}",
        t.elapsed()
    );

    let snap = c.wait_within(&mut src, "the relisted state", RELIST, |_, s| {
        services_in(s, ns) == ["api"] && slice_ips(s, ns, "web-a") == ["198.18.1.7"]
    });
    assert_eq!(node_names(&snap), [NODE], "other stores untouched");
    assert!(src.source.ready(), "ready through the relist");
    let (full, _) = follow(c, &mut src, &mut m, "the relisted state", PATIENCE, |d| {
        served_in(d, ns) == ["api"]
    });
    assert!(full >= 1, "a relist gives everything");
    let lists_after = lists(c);
    assert!(
        lists_after.0 > lists_before.0 && lists_after.1 > lists_before.1,
        "Services and EndpointSlices listed again: (services, slices) lists {lists_before:?} \
         before, {lists_after:?} after"
    );
}

/// Writes a key of its own to etcd (outside the API server's `/registry`),
/// which advances etcd's revision. Runs in the control plane's namespace,
/// where etcd listens on the loopback.
fn bump_etcd_revision() {
    let out = std::process::Command::new("curl")
        .args(["-sS", "-m", "10", "-X", "POST", "-d"])
        // "kpr-test/revision" = "1", base64.
        .arg(r#"{"key":"a3ByLXRlc3QvcmV2aXNpb24=","value":"MQ=="}"#)
        .arg("http://127.0.0.1:2379/v3/kv/put")
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("revision"),
        "etcd put: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---------------------------------------------------------------------------
// One table, both sources

struct Scenario {
    name: &'static str,
    /// Multi-document YAML: Services and EndpointSlices, in the namespace
    /// `NS` (replaced by the scenario's own on the API server).
    objects: &'static str,
    /// Frontend (`addr:port/proto (scope)`) → backends (`addr:port`).
    expected: &'static [(&'static str, &'static [&'static str])],
}

const NODE_YAML: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus:\n  addresses: [{type: InternalIP, address: 198.18.0.1}]\n";

// ClusterIPs from the lab's ServiceCIDR's static band (198.19.0.0/24, which
// the allocator leaves to Services that ask).
const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "cluster IP with two ready endpoints, one not ready",
        objects: r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: NS}
spec: {type: ClusterIP, clusterIP: 198.19.0.201, clusterIPs: [198.19.0.201], ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a, namespace: NS, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [198.18.1.1], conditions: {ready: true}, nodeName: node-1}
- {addresses: [198.18.1.2], conditions: {ready: true}, nodeName: node-2}
- {addresses: [198.18.1.3], conditions: {ready: false}, nodeName: node-2}
"#,
        expected: &[(
            "198.19.0.201:80/TCP (internal)",
            &["198.18.1.1:8080", "198.18.1.2:8080"],
        )],
    },
    Scenario {
        name: "UDP and TCP ports, two slices; protocol and targetPort left to the defaults",
        objects: r#"
apiVersion: v1
kind: Service
metadata: {name: dns, namespace: NS}
spec:
  clusterIP: 198.19.0.210
  ports: [{name: dns, port: 53, protocol: UDP, targetPort: 5353}, {name: dns-tcp, port: 53, targetPort: 5353}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dns-1, namespace: NS, labels: {kubernetes.io/service-name: dns}}
addressType: IPv4
ports: [{name: dns, port: 5353, protocol: UDP}, {name: dns-tcp, port: 5353}]
endpoints: [{addresses: [198.18.2.1]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dns-2, namespace: NS, labels: {kubernetes.io/service-name: dns}}
addressType: IPv4
ports: [{name: dns, port: 5353, protocol: UDP}, {name: dns-tcp, port: 5353, protocol: TCP}]
endpoints: [{addresses: [198.18.2.2]}]
"#,
        expected: &[
            (
                "198.19.0.210:53/TCP (internal)",
                &["198.18.2.1:5353", "198.18.2.2:5353"],
            ),
            (
                "198.19.0.210:53/UDP (internal)",
                &["198.18.2.1:5353", "198.18.2.2:5353"],
            ),
        ],
    },
    Scenario {
        name: "ignored: headless label, other proxy, ExternalName, clusterIP None",
        objects: r#"
apiVersion: v1
kind: Service
metadata: {name: a, namespace: NS, labels: {service.kubernetes.io/headless: ""}}
spec: {clusterIP: 198.19.0.220, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: b, namespace: NS, labels: {service.kubernetes.io/service-proxy-name: other}}
spec: {clusterIP: 198.19.0.221, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: c, namespace: NS}
spec: {type: ExternalName, externalName: example.test}
---
apiVersion: v1
kind: Service
metadata: {name: d, namespace: NS}
spec: {clusterIP: None, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: b-1, namespace: NS, labels: {kubernetes.io/service-name: b, service.kubernetes.io/service-proxy-name: other}}
addressType: IPv4
ports: [{port: 80}]
endpoints: [{addresses: [198.18.3.1]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: d-1, namespace: NS, labels: {kubernetes.io/service-name: d, service.kubernetes.io/headless: ""}}
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
metadata: {name: empty, namespace: NS}
spec: {clusterIP: 198.19.0.230, ports: [{port: 8080, protocol: TCP}]}
"#,
        expected: &[("198.19.0.230:8080/TCP (internal)", &[])],
    },
];

type Summary = BTreeMap<String, Vec<String>>;

/// The frontends of the Services in `ns` (all, when `None`) and their
/// backends.
fn desired(snap: &Snapshot, ns: Option<&str>) -> Summary {
    let (d, _) = model::desired_state(snap, NODE);
    d.frontends
        .iter()
        .filter(|(_, f)| ns.is_none_or(|ns| f.service.starts_with(&format!("{ns}/"))))
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

/// The same objects as manifests and through the API server give the same
/// desired state: what the manifests source defaults (a port's protocol
/// and targetPort, a slice port's protocol) is what the API server does.
fn the_same_scenario_table_runs_through_both_sources(c: &mut Ctx) {
    let mut src = c.source(None);
    for (i, sc) in SCENARIOS.iter().enumerate() {
        let expected: Summary = sc
            .expected
            .iter()
            .map(|(f, b)| (f.to_string(), b.iter().map(|s| s.to_string()).collect()))
            .collect();

        let dir = tempfile::tempdir().unwrap();
        let file: PathBuf = dir.path().join("objects.yaml");
        let objects = sc.objects.replace("namespace: NS", "namespace: default");
        std::fs::write(&file, format!("{NODE_YAML}---{objects}")).unwrap();
        let mut manifests = ManifestsSource::new(vec![file]);
        let (snap, errors) = manifests.snapshot();
        assert_eq!(errors, 0, "{}", sc.name);
        let from_manifests = desired(&snap, None);

        let ns = format!("scenario-{}", i + 1);
        c.apply_yaml(
            &sc.objects
                .replace("namespace: NS", &format!("namespace: {ns}")),
        );
        let snap = c.settle(&mut src, &ns);
        let from_kubernetes = desired(&snap, Some(&ns));

        assert_eq!(from_manifests, expected, "{}: manifests", sc.name);
        assert_eq!(from_kubernetes, expected, "{}: kubernetes", sc.name);
    }
}

// ---------------------------------------------------------------------------
// The test

const NAMESPACES: &[&str] = &[
    "proxy-name",
    "changes",
    "annotation",
    "labels",
    "model",
    "scenario-1",
    "scenario-2",
    "scenario-3",
    "scenario-4",
];

fn case<T>(name: &str, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    println!("case {name}");
    let r = f();
    println!("case {name}: ok in {:?}", t.elapsed());
    r
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn the_kubernetes_source_against_a_real_api_server() {
    let t = Instant::now();
    let mut lab = Lab::builder()
        .control_plane(true)
        .agent(false)
        .start()
        .expect("lab");
    let cp = lab.control_plane().expect("control plane").clone();
    println!(
        "lab {} (API server {}) up in {:?}",
        lab.id(),
        cp.server(),
        t.elapsed()
    );
    let namespaces: Vec<Value> = NAMESPACES
        .iter()
        .map(|n| json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}}))
        .collect();
    let list = json!({"apiVersion": "v1", "kind": "List", "items": namespaces});
    cp.kubectl_run(&["apply", "-f", "-"], Some(&list.to_string()))
        .expect("namespaces");
    let netns = cp.netns.clone();
    let lab = &mut lab;
    in_namespace(&netns, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let mut c = Ctx { lab, cp, rt };
        case("requests_carry_kube_proxys_selectors", || {
            requests_carry_kube_proxys_selectors(&mut c)
        });
        case(
            "with_a_proxy_name_only_its_services_and_their_slices_are_watched",
            || with_a_proxy_name_only_its_services_and_their_slices_are_watched(&mut c),
        );
        case("adds_modifications_and_deletions_show_up_trimmed", || {
            adds_modifications_and_deletions_show_up_trimmed(&mut c)
        });
        case("the_lb_algorithm_annotation_survives_trimming", || {
            the_lb_algorithm_annotation_survives_trimming(&mut c)
        });
        case(
            "labelled_services_are_excluded_and_external_name_and_headless_passed_through",
            || labelled_services_are_excluded_and_external_name_and_headless_passed_through(&mut c),
        );
        case("the_same_scenario_table_runs_through_both_sources", || {
            the_same_scenario_table_runs_through_both_sources(&mut c)
        });
        let state = case("watch_events_reach_the_model_as_changes", || {
            watch_events_reach_the_model_as_changes(&mut c)
        });
        case(
            "an_expired_watch_relists_everything_and_picks_up_changes_made_meanwhile",
            || {
                an_expired_watch_relists_everything_and_picks_up_changes_made_meanwhile(
                    &mut c, state,
                )
            },
        );
    });
    println!("all cases in {:?}", t.elapsed());
}

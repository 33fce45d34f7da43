//! The lab as the kubelet of its real control plane
//! ([`LabBuilder::control_plane`](super::LabBuilder::control_plane)): the
//! lab's objects go to kube-apiserver instead of the agents' manifests.
//!
//! - Nodes: created, then their status written (InternalIPs, Ready,
//!   allocatable CPU for topology hints), as a kubelet registers its node.
//! - Services and EndpointSlices of the manifests: applied as written
//!   (server-side apply, field manager `kpr-lab`); ClusterIPs and NodePorts
//!   come from the API server's allocators and are read back into the lab's
//!   objects. A load balancer's ingress (`status.loadBalancer`) is written
//!   to the status, as a cloud controller would.
//! - Pods: created on their node, then their status written as a kubelet
//!   would (phase, podIPs, hostIP, the Ready condition); a readiness change
//!   is a status write. A pod removed from the manifests is deleted
//!   gracefully (its endpoint turns terminating), and once the agents synced
//!   and its server stopped, deleted for good, as a kubelet confirms.
//!
//! EndpointSlices of selected pods come from the real EndpointSlice
//! controller. Before a change counts as made, the lab waits until the
//! controller's slices hold exactly the endpoints the lab's pods make
//! ([`expected_endpoints`]), then writes a barrier (an annotation of a
//! Service and of an EndpointSlice of its own, [`BARRIER`]): an agent whose
//! sync logged a `source_revision` at or past the barrier's has programmed
//! everything written before it.
//!
//! Why one file (about 1,200 lines): each step of a change pushed to the API
//! server (the applied view, the statuses, the allocations read back, the
//! wait for the controller's slices against [`expected_endpoints`], the
//! deletions a kubelet confirms, the barriers) reads and updates one
//! `ApiState`, what the lab last wrote; `reconcile.rs` runs the steps in that
//! order, and they stay beside the state they share.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

use super::Lab;
use crate::manifests::Object;

/// The field manager of the lab's applies.
pub const FIELD_MANAGER: &str = "kpr-lab";
/// Name (in namespace `default`) of the barrier Service and EndpointSlice.
pub const BARRIER: &str = "kpr-lab-barrier";
/// Name (in namespace `default`) of the barrier Service and EndpointSlice
/// of the nodes that run kube-proxy ([`Lab::write_kube_proxy_barrier`]).
pub const KUBE_PROXY_BARRIER: &str = "kpr-lab-kube-proxy-barrier";
/// The kube-proxy barrier's endpoint: an address of no pod; only its rules
/// name it.
pub const KUBE_PROXY_BARRIER_BACKEND: std::net::Ipv4Addr =
    std::net::Ipv4Addr::new(198, 18, 255, 254);

/// The kube-proxy barrier's port for barrier `n`: a new one each time.
pub fn kube_proxy_barrier_port(n: u64) -> u16 {
    20000 + (n % 40000) as u16
}
/// From this many objects, an apply is split over [`APPLY_PROCESSES`]
/// kubectl processes.
const APPLY_IN_PARALLEL_FROM: usize = 400;
const APPLY_PROCESSES: usize = 4;

/// How long the EndpointSlice controller may take to catch up with a change:
/// this, and [`SETTLE_PER_SERVICE`] for every Service whose endpoints changed
/// (10,000 new Services take it minutes on a loaded 2-core machine).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
const SETTLE_PER_SERVICE: Duration = Duration::from_millis(30);

type Key = (String, String, String);

/// What the lab last wrote to the API server.
#[derive(Debug, Default)]
pub(super) struct ApiState {
    /// Per object: the object as applied (without status).
    applied: BTreeMap<Key, Value>,
    /// Per object: the status written.
    status: BTreeMap<Key, Value>,
    /// Namespaces created.
    namespaces: BTreeSet<String>,
    /// Per Service: what the API server allocated ([`allocation_of`]).
    allocated: BTreeMap<Key, Value>,
    /// Per Service with a selector: the endpoints its slices were last
    /// seen to hold ([`Lab::wait_slices_settled`] checks only the others).
    settled: BTreeMap<(String, String), BTreeSet<ExpectedEndpoint>>,
    /// Pods deleted gracefully whose deletion the lab has still to confirm.
    terminating: BTreeMap<Key, Object>,
    /// Per object and condition type: the status last written and when it
    /// became so (a kubelet's lastTransitionTime).
    transitions: BTreeMap<(Key, String), (String, String)>,
    /// The revision every agent's sync must reach ([`Lab::wait_synced`]).
    pub(super) target: u64,
    barriers: u64,
    /// The kube-proxy barrier last written: its ClusterIP and port.
    kube_proxy_target: Option<(std::net::Ipv4Addr, u16)>,
}

/// An endpoint as the EndpointSlice controller publishes it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ExpectedEndpoint {
    pub ip: String,
    pub ready: bool,
    pub terminating: bool,
    /// `(port, protocol)` of every Service port the pod resolves.
    pub ports: Vec<(i32, String)>,
}

fn key_of(kind: &str, ns: &str, name: &str) -> Key {
    (kind.to_string(), ns.to_string(), name.to_string())
}

fn api_version(kind: &str) -> &'static str {
    match kind {
        "EndpointSlice" => "discovery.k8s.io/v1",
        _ => "v1",
    }
}

/// An object as the lab applies it: its JSON without `status` (and, for a
/// Pod, with a container where the manifest has none, as the API requires).
fn applied_view(o: &Object, allocated: Option<&Value>) -> Result<Value> {
    let mut v = match o {
        Object::Service(s) => serde_json::to_value(s.as_ref())?,
        Object::Pod(p) => serde_json::to_value(p.as_ref())?,
        Object::EndpointSlice(e) => serde_json::to_value(e.as_ref())?,
        Object::Node(n) => serde_json::to_value(n.as_ref())?,
        Object::Other(y) => serde_json::to_value(y)?,
    };
    if let Some(m) = v.as_object_mut() {
        m.remove("status");
        let (kind, _, _) = o.key();
        m.entry("apiVersion")
            .or_insert_with(|| Value::from(api_version(&kind)));
        m.entry("kind").or_insert_with(|| Value::from(kind));
    }
    if let Object::Pod(_) = o {
        let spec = &mut v["spec"];
        let containers = spec["containers"].as_array().cloned().unwrap_or_default();
        let containers: Vec<Value> = if containers.is_empty() {
            vec![json!({"name": "server", "image": "kpr-lab/lab-server"})]
        } else {
            containers
                .into_iter()
                .enumerate()
                .map(|(i, mut c)| {
                    if c["name"].as_str().unwrap_or("").is_empty() {
                        c["name"] = Value::from(format!("c{i}"));
                    }
                    if c["image"].as_str().unwrap_or("").is_empty() {
                        c["image"] = Value::from("kpr-lab/lab-server");
                    }
                    c
                })
                .collect()
        };
        spec["containers"] = Value::Array(containers);
    }
    if let (Object::Service(_), Some(alloc)) = (o, allocated) {
        // What the API server's allocators filled in and the lab read back
        // is theirs, not the manifest's: a field equal to it is left out (a
        // ClusterIP or NodePort the manifest asks for is sent).
        if let Some(spec) = v["spec"].as_object_mut() {
            for f in ALLOCATED_FIELDS {
                if spec.get(f).is_some() && spec.get(f) == alloc.get(f) {
                    spec.remove(f);
                }
            }
            if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
                for p in ports {
                    let id = port_id(p);
                    if let Some(p) = p.as_object_mut() {
                        if p.get("nodePort").is_some()
                            && p.get("nodePort") == alloc["nodePorts"].get(&id)
                        {
                            p.remove("nodePort");
                        }
                    }
                }
            }
        }
    }
    Ok(v)
}

/// The fields of a Service's spec the API server fills in (beside each
/// port's `nodePort`).
const ALLOCATED_FIELDS: [&str; 5] = [
    "clusterIP",
    "clusterIPs",
    "ipFamilies",
    "ipFamilyPolicy",
    "healthCheckNodePort",
];

/// A Service port's identity in [`ApiState::allocated`]: `80/TCP`.
fn port_id(p: &Value) -> String {
    format!(
        "{}/{}",
        p["port"].as_i64().unwrap_or(0),
        p["protocol"].as_str().unwrap_or("TCP")
    )
}

/// What the API server allocated to a Service, as [`applied_view`] compares it.
fn allocation_of(spec: &Value) -> Value {
    let mut a = json!({});
    for f in ALLOCATED_FIELDS {
        if let Some(x) = spec.get(f) {
            a[f] = x.clone();
        }
    }
    let mut ports = json!({});
    for p in spec["ports"].as_array().into_iter().flatten() {
        if let Some(n) = p.get("nodePort") {
            ports[port_id(p)] = n.clone();
        }
    }
    a["nodePorts"] = ports;
    a
}

/// Writes an allocation ([`allocation_of`]) into a Service's spec.
fn fill_allocation(
    spec: &mut k8s_openapi::api::core::v1::ServiceSpec,
    alloc: &Value,
) -> Result<()> {
    let get = |f: &str| alloc.get(f).cloned();
    spec.cluster_ip = get("clusterIP").map(serde_json::from_value).transpose()?;
    spec.cluster_ips = get("clusterIPs").map(serde_json::from_value).transpose()?;
    spec.ip_families = get("ipFamilies").map(serde_json::from_value).transpose()?;
    spec.ip_family_policy = get("ipFamilyPolicy")
        .map(serde_json::from_value)
        .transpose()?;
    spec.health_check_node_port = get("healthCheckNodePort")
        .map(serde_json::from_value)
        .transpose()?;
    for p in spec.ports.iter_mut().flatten() {
        let id = format!("{}/{}", p.port, p.protocol.as_deref().unwrap_or("TCP"));
        p.node_port = alloc["nodePorts"]
            .get(&id)
            .map(|n| serde_json::from_value(n.clone()))
            .transpose()?;
    }
    Ok(())
}

/// The status the lab writes for an object (Pods, Nodes, and Services with
/// a load balancer's ingress), if any.
fn status_view(o: &Object) -> Result<Option<Value>> {
    Ok(match o {
        Object::Pod(p) => {
            let Some(s) = &p.status else { return Ok(None) };
            let ready = s
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let mut s = serde_json::to_value(s)?;
            let now = "2026-01-01T00:00:00Z";
            // The containers' states, as a kubelet reports them (what
            // `kubectl get pods` counts as READY).
            if s.get("containerStatuses").is_none() {
                let containers = applied_view(o, None)?["spec"]["containers"].clone();
                let statuses: Vec<Value> = containers
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| {
                        json!({
                            "name": c["name"], "image": c["image"], "imageID": "",
                            "ready": ready, "started": true, "restartCount": 0,
                            "state": {"running": {"startedAt": now}},
                        })
                    })
                    .collect();
                s["containerStatuses"] = Value::Array(statuses);
            }
            // Conditions get their lastTransitionTime when written
            // ([`Lab::stamp_transitions`]): a view to compare has none.
            Some(s)
        }
        Object::Node(n) => {
            let addresses = n
                .status
                .as_ref()
                .and_then(|s| s.addresses.clone())
                .unwrap_or_default();
            Some(json!({
                "addresses": addresses,
                "conditions": [{
                    "type": "Ready", "status": "True", "reason": "KubeletReady",
                    "message": "the lab plays this node's kubelet",
                    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }],
                "capacity": {"cpu": "2", "memory": "4Gi", "pods": "250"},
                "allocatable": {"cpu": "2", "memory": "4Gi", "pods": "250"},
            }))
        }
        Object::Service(s) => {
            let lb = s
                .status
                .as_ref()
                .and_then(|st| st.load_balancer.as_ref())
                .filter(|lb| lb.ingress.as_ref().is_some_and(|i| !i.is_empty()));
            match lb {
                Some(lb) => Some(json!({ "loadBalancer": serde_json::to_value(lb)? })),
                None => None,
            }
        }
        _ => None,
    })
}

/// A pod's label selector match.
fn selects(selector: &BTreeMap<String, String>, pod: &Pod) -> bool {
    let Some(labels) = &pod.metadata.labels else {
        return false;
    };
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The target port of a Service port on `pod`, as the EndpointSlice
/// controller resolves it (`podutil.FindPort`): a number as it is, a name
/// by the pod's container ports of that name and protocol; `None` when
/// the name is not found (the controller leaves that port out).
fn resolve_port(port: &k8s_openapi::api::core::v1::ServicePort, pod: &Pod) -> Option<i32> {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let protocol = port.protocol.clone().unwrap_or_else(|| "TCP".into());
    match &port.target_port {
        None => Some(port.port),
        Some(IntOrString::Int(n)) => Some(*n),
        Some(IntOrString::String(name)) => {
            if let Ok(n) = name.parse::<i32>() {
                return Some(n);
            }
            pod.spec
                .iter()
                .flat_map(|s| s.containers.iter())
                .flat_map(|c| c.ports.iter().flatten())
                .find(|cp| {
                    cp.name.as_deref() == Some(name.as_str())
                        && cp.protocol.clone().unwrap_or_else(|| "TCP".into()) == protocol
                })
                .map(|cp| cp.container_port)
        }
    }
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let mut v: Vec<IpAddr> = pod
        .status
        .iter()
        .flat_map(|s| {
            s.pod_ips
                .iter()
                .flatten()
                .map(|p| p.ip.clone())
                .chain(s.pod_ip.clone())
        })
        .filter_map(|a| a.parse().ok())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The endpoints the EndpointSlice controller publishes for each Service
/// with a selector (by namespace and name): every selected pod with an IP
/// of a family of the Service and not in a terminal phase, `terminating`
/// when it is being deleted (then never `ready`), `ready` from its Ready
/// condition (always, with `publishNotReadyAddresses`).
pub fn expected_endpoints(
    objects: &[Object],
    terminating: &[&Pod],
) -> BTreeMap<(String, String), BTreeSet<ExpectedEndpoint>> {
    let mut out = BTreeMap::new();
    let pods: Vec<(&Pod, bool)> = objects
        .iter()
        .filter_map(|o| match o {
            Object::Pod(p) => Some((p.as_ref(), false)),
            _ => None,
        })
        .chain(terminating.iter().map(|p| (*p, true)))
        .collect();
    // Pods by namespace and label, so a Service looks at the pods that
    // carry the first label of its selector only (10,000 Services of a pod
    // each are 10,000 lookups, not 10^8 comparisons).
    let mut by_label: BTreeMap<(&str, &str, &str), Vec<usize>> = BTreeMap::new();
    for (i, (pod, _)) in pods.iter().enumerate() {
        let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
        for (k, v) in pod.metadata.labels.iter().flatten() {
            by_label.entry((ns, k, v)).or_default().push(i);
        }
    }
    for o in objects {
        let Object::Service(svc) = o else { continue };
        let Some(spec) = &svc.spec else { continue };
        if spec.type_.as_deref() == Some("ExternalName") {
            continue;
        }
        let Some(selector) = spec.selector.clone().filter(|s| !s.is_empty()) else {
            continue;
        };
        let ns = svc.metadata.namespace.clone().unwrap_or_default();
        let families: Vec<String> = spec.ip_families.clone().unwrap_or_default();
        let publish_not_ready = spec.publish_not_ready_addresses == Some(true);
        let mut eps = BTreeSet::new();
        let (k0, v0) = selector.iter().next().expect("a selector is not empty");
        let candidates = by_label
            .get(&(ns.as_str(), k0.as_str(), v0.as_str()))
            .cloned()
            .unwrap_or_default();
        for (pod, is_terminating) in candidates.iter().map(|&i| &pods[i]) {
            if !selects(&selector, pod) {
                continue;
            }
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if matches!(phase, Some("Succeeded") | Some("Failed")) {
                continue;
            }
            let mut ports: Vec<(i32, String)> = spec
                .ports
                .iter()
                .flatten()
                .filter_map(|p| {
                    resolve_port(p, pod)
                        .map(|n| (n, p.protocol.clone().unwrap_or_else(|| "TCP".into())))
                })
                .collect();
            ports.sort();
            for ip in pod_ips(pod) {
                let family = if ip.is_ipv6() { "IPv6" } else { "IPv4" };
                if !families.iter().any(|f| f == family) {
                    continue;
                }
                eps.insert(ExpectedEndpoint {
                    ip: ip.to_string(),
                    ready: !is_terminating && (publish_not_ready || pod_ready(pod)),
                    terminating: *is_terminating,
                    ports: ports.clone(),
                });
            }
        }
        out.insert((ns, svc.metadata.name.clone().unwrap_or_default()), eps);
    }
    out
}

/// The endpoints of the controller's slices, by Service, from a
/// `kubectl get endpointslices -A -o json` list.
fn published_endpoints(list: &Value) -> BTreeMap<(String, String), BTreeSet<ExpectedEndpoint>> {
    let mut out: BTreeMap<(String, String), BTreeSet<ExpectedEndpoint>> = BTreeMap::new();
    for s in list["items"].as_array().into_iter().flatten() {
        let labels = &s["metadata"]["labels"];
        if labels["endpointslice.kubernetes.io/managed-by"] != "endpointslice-controller.k8s.io" {
            continue;
        }
        let Some(svc) = labels["kubernetes.io/service-name"].as_str() else {
            continue;
        };
        let ns = s["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let mut ports: Vec<(i32, String)> = s["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| {
                Some((
                    i32::try_from(p["port"].as_i64()?).ok()?,
                    p["protocol"].as_str().unwrap_or("TCP").to_string(),
                ))
            })
            .collect();
        ports.sort();
        let entry = out.entry((ns, svc.to_string())).or_default();
        for e in s["endpoints"].as_array().into_iter().flatten() {
            for a in e["addresses"].as_array().into_iter().flatten() {
                let Some(ip) = a.as_str().and_then(|a| a.parse::<IpAddr>().ok()) else {
                    continue;
                };
                entry.insert(ExpectedEndpoint {
                    ip: ip.to_string(),
                    ready: e["conditions"]["ready"].as_bool() == Some(true),
                    terminating: e["conditions"]["terminating"].as_bool() == Some(true),
                    ports: ports.clone(),
                });
            }
        }
    }
    out
}

/// A `List` of objects for one kubectl call.
fn list(items: Vec<Value>) -> String {
    json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
}

impl Lab {
    fn control_plane_info_for_api(&self) -> Result<&super::ControlPlaneInfo> {
        self.control_plane()
            .context("the lab runs no control plane (LabBuilder::control_plane)")
    }

    fn api_state(&mut self) -> &mut ApiState {
        self.api.get_or_insert_with(ApiState::default)
    }

    /// `status` with each condition's `lastTransitionTime` as a kubelet
    /// keeps it: the time of the write that changed the condition's status
    /// (the EndpointSlice controller's trigger time, from which the agent
    /// measures its network programming latency).
    fn stamp_transitions(&mut self, key: &Key, status: &Value) -> Value {
        let mut stamped = status.clone();
        let now = jiff::Timestamp::now().to_string();
        let st = self.api_state();
        for c in stamped["conditions"].as_array_mut().into_iter().flatten() {
            if c.get("lastTransitionTime").is_some() {
                continue;
            }
            let type_ = c["type"].as_str().unwrap_or("").to_string();
            let value = c["status"].as_str().unwrap_or("").to_string();
            let entry = st
                .transitions
                .entry((key.clone(), type_))
                .or_insert_with(|| (value.clone(), now.clone()));
            if entry.0 != value {
                *entry = (value, now.clone());
            }
            c["lastTransitionTime"] = Value::from(entry.1.clone());
        }
        stamped
    }

    /// Makes the API server's objects `new` (which [`reconcile`] then makes
    /// the lab's): namespaces, applies, status writes, graceful deletions
    /// of pods that are gone; reads the Services' allocations back into
    /// `new`. Returns the pods deleted gracefully.
    pub(super) fn push_to_api(&mut self, new: &mut [Object]) -> Result<Vec<Object>> {
        // Namespaces first.
        let wanted: BTreeSet<String> = new
            .iter()
            .map(|o| o.key().1)
            .filter(|ns| !ns.is_empty())
            .collect();
        let missing: Vec<Value> = wanted
            .iter()
            .filter(|ns| !self.api_state().namespaces.contains(*ns))
            .map(|ns| json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))
            .collect();
        if !missing.is_empty() {
            self.kubectl_apply(missing, false)?;
            self.api_state().namespaces.extend(wanted);
        }

        // Objects whose applied view changed, in dependency order.
        let order = |k: &str| match k {
            "Node" => 0,
            "Pod" => 1,
            "Service" => 2,
            _ => 3,
        };
        let mut changed: Vec<(usize, Key, Value)> = Vec::new();
        let mut recreate: Vec<Key> = Vec::new();
        for o in new.iter() {
            let key = o.key();
            let view = applied_view(o, self.api_state().allocated.get(&key))?;
            let prev = self.api_state().applied.get(&key).cloned();
            if prev.as_ref() == Some(&view) {
                continue;
            }
            // A pod's spec is immutable: a changed one is a new pod.
            if let (Object::Pod(_), Some(prev)) = (o, &prev) {
                if prev["spec"] != view["spec"] {
                    recreate.push(key.clone());
                }
            }
            changed.push((order(&key.0), key, view));
        }
        changed.sort_by_key(|(o, _, _)| *o);
        for (_, ns, name) in &recreate {
            self.kubectl(
                &[
                    "delete",
                    "pod",
                    "-n",
                    ns,
                    name,
                    "--grace-period=0",
                    "--force",
                    "--ignore-not-found",
                ],
                None,
            )?;
            self.api_state().status.remove(&key_of("Pod", ns, name));
        }
        let changed_services: BTreeSet<Key> = changed
            .iter()
            .filter(|(_, k, _)| k.0 == "Service")
            .map(|(_, k, _)| k.clone())
            .collect();
        // Two rounds: Nodes and Pods with their statuses (as their kubelets
        // write them), then Services and the rest. A new Service then finds
        // its pods ready, and the EndpointSlice controller writes its slice
        // once, endpoints in it, rather than empty and again when the pods'
        // statuses come: a quarter fewer writes when thousands of Services
        // and their pods are made at once.
        let is_first = |kind: &str| kind == "Node" || kind == "Pod";
        let (pods_and_nodes, rest): (Vec<_>, Vec<_>) =
            changed.into_iter().partition(|(_, k, _)| is_first(&k.0));
        for (round, objects) in [pods_and_nodes, rest].into_iter().enumerate() {
            if !objects.is_empty() {
                let items = objects.iter().map(|(_, _, v)| v.clone()).collect();
                self.kubectl_apply(items, false)?;
                for (_, key, view) in objects {
                    self.api_state().applied.insert(key, view);
                }
            }
            self.push_statuses(new, |kind| is_first(kind) == (round == 0))?;
        }

        // Deletions: what the lab applied before and no longer has.
        let now: BTreeSet<Key> = new.iter().map(Object::key).collect();
        let gone: Vec<Key> = self
            .api_state()
            .applied
            .keys()
            .filter(|k| !now.contains(*k))
            .cloned()
            .collect();
        let mut deleted_pods = Vec::new();
        for key in gone {
            let (kind, ns, name) = &key;
            let mut args = vec!["delete", kind.as_str(), name.as_str(), "--wait=false"];
            if !ns.is_empty() {
                args.extend(["-n", ns.as_str()]);
            }
            args.push("--ignore-not-found");
            self.kubectl(&args, None)?;
            let st = self.api_state();
            st.applied.remove(&key);
            st.status.remove(&key);
            st.allocated.remove(&key);
            if kind == "Pod" {
                if let Some(o) = self.objects.iter().find(|o| o.key() == key).cloned() {
                    self.api_state().terminating.insert(key.clone(), o.clone());
                    deleted_pods.push(o);
                }
            }
        }

        self.read_back_services(new, &changed_services)?;
        Ok(deleted_pods)
    }

    /// Status, as the kubelet (Pods, Nodes) and a load balancer's
    /// controller (Services) write it, of the objects in `new` whose kind
    /// `of_kind` takes and whose status changed.
    fn push_statuses(&mut self, new: &[Object], of_kind: impl Fn(&str) -> bool) -> Result<()> {
        let mut statuses = Vec::new();
        for o in new.iter() {
            let key = o.key();
            if !of_kind(&key.0) {
                continue;
            }
            let Some(status) = status_view(o)? else {
                continue;
            };
            if self.api_state().status.get(&key) == Some(&status) {
                continue;
            }
            let (kind, ns, name) = &key;
            let mut meta = json!({ "name": name });
            if !ns.is_empty() {
                meta["namespace"] = Value::from(ns.as_str());
            }
            let stamped = self.stamp_transitions(&key, &status);
            statuses.push((
                key.clone(),
                status.clone(),
                json!({"apiVersion": api_version(kind), "kind": kind, "metadata": meta, "status": stamped}),
            ));
        }
        // A Node's addresses are a list keyed by type, which a dual-stack
        // node's two InternalIPs break for server-side apply (kubelets
        // patch): Nodes get a merge patch of their status each.
        let (nodes, others): (Vec<_>, Vec<_>) = statuses
            .into_iter()
            .partition(|(key, _, _)| key.0 == "Node");
        for (key, status, _) in &nodes {
            self.patch_status("node", &key.2, &json!({ "status": status }).to_string())?;
        }
        if !others.is_empty() {
            let items = others.iter().map(|(_, _, v)| v.clone()).collect();
            self.kubectl_apply(items, true)?;
        }
        for (key, status, _) in nodes.into_iter().chain(others) {
            self.api_state().status.insert(key, status);
        }
        Ok(())
    }

    /// `kubectl apply --server-side` of `items` (of statuses with `status`):
    /// one List, or [`APPLY_PROCESSES`] Lists side by side when there are
    /// many (kubectl sends one request per object, one after another).
    fn kubectl_apply(&self, items: Vec<Value>, status: bool) -> Result<()> {
        let manager = format!("--field-manager={FIELD_MANAGER}");
        let mut args = vec![
            "apply",
            "--server-side",
            "--force-conflicts",
            manager.as_str(),
            "-f",
            "-",
        ];
        if status {
            args.push("--subresource=status");
        }
        let cp = self.control_plane_info_for_api()?;
        if items.len() < APPLY_IN_PARALLEL_FROM {
            return cp.kubectl_run(&args, Some(&list(items))).map(|_| ());
        }
        let per = items.len().div_ceil(APPLY_PROCESSES);
        let what = format!(
            "lab {}: applying {} {} through the API server",
            self.info.id,
            items.len(),
            if status { "statuses" } else { "objects" }
        );
        eprintln!("{what} ({APPLY_PROCESSES} kubectl processes)");
        let _beat = crate::progress::Heartbeat::start(what, std::time::Duration::from_secs(15));
        let chunks: Vec<String> = items.chunks(per).map(|c| list(c.to_vec())).collect();
        std::thread::scope(|scope| {
            let handles: Vec<_> = chunks
                .iter()
                .map(|text| scope.spawn(|| cp.kubectl_run(&args, Some(text))))
                .collect();
            for h in handles {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a kubectl apply thread panicked"))??;
            }
            Ok(())
        })
    }

    /// Copies what the API server allocated (ClusterIPs, families, NodePorts)
    /// into the lab's Services: read from the API server for the Services
    /// applied now (`changed`), from what was read before for the others.
    fn read_back_services(
        &mut self,
        objects: &mut [Object],
        changed: &BTreeSet<Key>,
    ) -> Result<()> {
        let mut namespaces: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (_, ns, name) in changed {
            namespaces.entry(ns).or_default().push(name);
        }
        let lists: Vec<Value> = if changed.len() > 200 {
            let text = self.kubectl(&["get", "services", "-A", "-o", "json"], None)?;
            vec![serde_json::from_str(&text).context("kubectl get services")?]
        } else {
            let mut v = Vec::new();
            for (ns, names) in &namespaces {
                let mut args = vec!["get", "services", "-n", ns, "-o", "json"];
                args.extend(names.iter().copied());
                let text = self.kubectl(&args, None)?;
                let got: Value = serde_json::from_str(&text).context("kubectl get services")?;
                // One name answers with the object, several with a List.
                v.push(if got["kind"] == "List" {
                    got
                } else {
                    json!({"items": [got]})
                });
            }
            v
        };
        for list in &lists {
            for item in list["items"].as_array().into_iter().flatten() {
                let meta = &item["metadata"];
                let key = key_of(
                    "Service",
                    meta["namespace"].as_str().unwrap_or_default(),
                    meta["name"].as_str().unwrap_or_default(),
                );
                let alloc = allocation_of(&item["spec"]);
                self.api_state().allocated.insert(key, alloc);
            }
        }
        for o in objects.iter_mut() {
            if !matches!(o, Object::Service(_)) {
                continue;
            }
            let key = o.key();
            let Some(alloc) = self.api_state().allocated.get(&key).cloned() else {
                bail!("Service {}/{} is not on the API server", key.1, key.2);
            };
            let Object::Service(svc) = o else { continue };
            let Some(mine) = svc.spec.as_mut() else {
                continue;
            };
            fill_allocation(mine, &alloc)?;
        }
        Ok(())
    }

    /// Waits until the EndpointSlice controller's slices hold exactly the
    /// endpoints of the lab's pods ([`expected_endpoints`]).
    pub(super) fn wait_slices_settled(&mut self) -> Result<()> {
        let terminating: Vec<Pod> = self
            .api_state()
            .terminating
            .values()
            .filter_map(|o| match o {
                Object::Pod(p) => Some((**p).clone()),
                _ => None,
            })
            .collect();
        let refs: Vec<&Pod> = terminating.iter().collect();
        let expected = expected_endpoints(&self.objects, &refs);
        let st = self.api_state();
        st.settled.retain(|k, _| expected.contains_key(k));
        let todo: BTreeMap<(String, String), BTreeSet<ExpectedEndpoint>> = expected
            .into_iter()
            .filter(|(k, eps)| st.settled.get(k) != Some(eps))
            .collect();
        if todo.is_empty() {
            return Ok(());
        }
        let bound =
            SETTLE_TIMEOUT + SETTLE_PER_SERVICE * u32::try_from(todo.len()).unwrap_or(u32::MAX);
        let deadline = Instant::now() + bound;
        loop {
            let published = self.published_for(&todo)?;
            let differing: Vec<String> = todo
                .iter()
                .filter(|(k, eps)| published.get(*k) != Some(*eps))
                .map(|(k, eps)| {
                    format!(
                        "{}/{}: want {:?}, have {:?}",
                        k.0,
                        k.1,
                        eps,
                        published.get(k).cloned().unwrap_or_default()
                    )
                })
                .collect();
            if differing.is_empty() {
                self.api_state().settled.extend(todo);
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "the EndpointSlice controller did not publish the lab's endpoints within \
                     {bound:?} ({} of {} Services differ): {}",
                    differing.len(),
                    todo.len(),
                    differing
                        .iter()
                        .take(5)
                        .cloned()
                        .collect::<Vec<_>>()
                        .join("; ")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The published endpoints of `services`: their slices only (by label,
    /// per namespace), or every slice when they are many.
    fn published_for(
        &self,
        services: &BTreeMap<(String, String), BTreeSet<ExpectedEndpoint>>,
    ) -> Result<BTreeMap<(String, String), BTreeSet<ExpectedEndpoint>>> {
        if services.len() > 50 {
            let text = self.kubectl(&["get", "endpointslices", "-A", "-o", "json"], None)?;
            let list: Value = serde_json::from_str(&text).context("kubectl get endpointslices")?;
            return Ok(published_endpoints(&list));
        }
        let mut by_ns: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (ns, name) in services.keys() {
            by_ns.entry(ns).or_default().push(name);
        }
        let mut out = BTreeMap::new();
        for (ns, names) in by_ns {
            let selector = format!("kubernetes.io/service-name in ({})", names.join(","));
            let text = self.kubectl(
                &[
                    "get",
                    "endpointslices",
                    "-n",
                    ns,
                    "-l",
                    &selector,
                    "-o",
                    "json",
                ],
                None,
            )?;
            let list: Value = serde_json::from_str(&text).context("kubectl get endpointslices")?;
            out.extend(published_endpoints(&list));
        }
        Ok(out)
    }

    /// Confirms the deletion of pods deleted gracefully (the kubelet's
    /// final delete once the containers stopped).
    pub(super) fn confirm_pod_deletions(&mut self, pods: &[Object]) -> Result<()> {
        for p in pods {
            let key = p.key();
            self.kubectl(
                &[
                    "delete",
                    "pod",
                    "-n",
                    &key.1,
                    &key.2,
                    "--grace-period=0",
                    "--force",
                    "--ignore-not-found",
                ],
                None,
            )?;
            self.api_state().terminating.remove(&key);
        }
        Ok(())
    }

    /// Writes a barrier now (with a real control plane; a no-op without):
    /// [`wait_synced`](Lab::wait_synced) then waits for everything the lab
    /// wrote before, for example after a proxy was started.
    /// A merge patch of the status of `kind` `name` (in `default`), written
    /// as its kubelet would: `kubectl patch --subresource=status`.
    pub fn patch_status(&self, kind: &str, name: &str, patch: &str) -> Result<()> {
        self.kubectl(
            &[
                "patch",
                kind,
                name,
                "--subresource=status",
                "--type=merge",
                "-p",
                patch,
            ],
            None,
        )
        .map(|_| ())
    }

    pub fn write_sync_barrier(&mut self) -> Result<()> {
        if self.info.control_plane.is_some() {
            self.write_barrier()?;
        }
        Ok(())
    }

    /// Writes the barrier (see the module's doc) and makes its revision the
    /// one [`wait_synced`](Lab::wait_synced) waits for.
    pub(super) fn write_barrier(&mut self) -> Result<()> {
        let n = {
            let st = self.api_state();
            st.barriers += 1;
            st.barriers
        };
        let svc = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": BARRIER, "namespace": "default",
                         "annotations": {"kpr-lab/barrier": n.to_string()}},
            "spec": {"clusterIP": "None", "ports": [{"port": 1, "protocol": "TCP"}]},
        });
        let slice = json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": BARRIER, "namespace": "default",
                         "labels": {"kubernetes.io/service-name": BARRIER},
                         "annotations": {"kpr-lab/barrier": n.to_string()}},
            "addressType": "IPv4", "endpoints": [],
        });
        let manager = format!("--field-manager={FIELD_MANAGER}");
        let mut first = None;
        for obj in [svc, slice] {
            let out = self.kubectl(
                &[
                    "apply",
                    "--server-side",
                    "--force-conflicts",
                    &manager,
                    "-o",
                    "jsonpath={.metadata.resourceVersion}",
                    "-f",
                    "-",
                ],
                Some(&obj.to_string()),
            )?;
            let rv: u64 = out
                .trim()
                .parse()
                .with_context(|| format!("the barrier's resourceVersion {out:?}"))?;
            first.get_or_insert(rv);
        }
        self.api_state().target = first.expect("two barrier objects");
        if !self.nodes_with_kube_proxy().is_empty() {
            self.write_kube_proxy_barrier(n)?;
        }
        Ok(())
    }

    /// The barrier kube-proxy can be seen to have programmed: a Service
    /// with a ClusterIP and a slice of the lab's own with one endpoint
    /// ([`KUBE_PROXY_BARRIER_BACKEND`], to which nothing is sent), both on
    /// port [`kube_proxy_barrier_port`]`(n)`. The Service's port in its
    /// rules says its Service watch delivered the barrier, the endpoint's
    /// its EndpointSlice watch; the lab wrote everything else before.
    fn write_kube_proxy_barrier(&mut self, n: u64) -> Result<()> {
        let port = kube_proxy_barrier_port(n);
        let svc = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": KUBE_PROXY_BARRIER, "namespace": "default"},
            "spec": {"ports": [{"name": "b", "port": port, "targetPort": port, "protocol": "TCP"}]},
        });
        let slice = json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": KUBE_PROXY_BARRIER, "namespace": "default",
                         "labels": {"kubernetes.io/service-name": KUBE_PROXY_BARRIER,
                                    "endpointslice.kubernetes.io/managed-by": "kpr-lab"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [KUBE_PROXY_BARRIER_BACKEND.to_string()],
                           "conditions": {"ready": true}}],
            "ports": [{"name": "b", "port": port, "protocol": "TCP"}],
        });
        let manager = format!("--field-manager={FIELD_MANAGER}");
        let mut ip = String::new();
        for (obj, path) in [(svc, "{.spec.clusterIP}"), (slice, "{.metadata.name}")] {
            let out = self.kubectl(
                &[
                    "apply",
                    "--server-side",
                    "--force-conflicts",
                    &manager,
                    "-o",
                    &format!("jsonpath={path}"),
                    "-f",
                    "-",
                ],
                Some(&obj.to_string()),
            )?;
            if ip.is_empty() {
                ip = out.trim().to_string();
            }
        }
        let ip: std::net::Ipv4Addr = ip
            .parse()
            .with_context(|| format!("the kube-proxy barrier's ClusterIP {ip:?}"))?;
        self.api_state().kube_proxy_target = Some((ip, port));
        Ok(())
    }

    /// The kube-proxy barrier the lab last wrote: its ClusterIP and port.
    pub(super) fn kube_proxy_target(&self) -> Option<(std::net::Ipv4Addr, u16)> {
        self.api.as_ref().and_then(|a| a.kube_proxy_target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objects(yaml: &str) -> Vec<Object> {
        crate::manifests::parse_yaml(yaml, "test").unwrap()
    }

    const SVC: &str = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  selector: {app: web}
  ipFamilies: [IPv4]
  ports:
  - {name: http, port: 80, targetPort: http}
  - {name: dns, port: 53, protocol: UDP}
";

    fn pod(name: &str, ip: &str, ready: bool) -> String {
        format!(
            "
---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default, labels: {{app: web}}}}
spec:
  containers:
  - name: s
    ports: [{{name: http, containerPort: 8080}}]
status:
  podIPs: [{{ip: {ip}}}]
  conditions: [{{type: Ready, status: '{}'}}]
",
            if ready { "True" } else { "False" }
        )
    }

    #[test]
    fn expected_endpoints_follow_the_controllers_rules() {
        let yaml = format!(
            "{SVC}{}{}",
            pod("a", "198.18.1.10", true),
            pod("b", "198.18.1.11", false)
        );
        let mut objs = objects(&yaml);
        let term = objects(&pod("c", "198.18.1.12", true));
        let Object::Pod(c) = &term[0] else { panic!() };
        let e = expected_endpoints(&objs, &[c.as_ref()]);
        let eps: Vec<_> = e[&("default".to_string(), "web".to_string())]
            .iter()
            .cloned()
            .collect();
        let ports = vec![(53, "UDP".to_string()), (8080, "TCP".to_string())];
        assert_eq!(
            eps,
            vec![
                ExpectedEndpoint {
                    ip: "198.18.1.10".into(),
                    ready: true,
                    terminating: false,
                    ports: ports.clone()
                },
                ExpectedEndpoint {
                    ip: "198.18.1.11".into(),
                    ready: false,
                    terminating: false,
                    ports: ports.clone()
                },
                ExpectedEndpoint {
                    ip: "198.18.1.12".into(),
                    ready: false,
                    terminating: true,
                    ports
                },
            ]
        );
        // An IPv4-only Service publishes no IPv6 endpoint; a pod of another
        // namespace is not selected.
        objs.extend(objects(
            "apiVersion: v1\nkind: Pod\nmetadata: {name: x, namespace: other, labels: {app: web}}\n\
             status: {podIPs: [{ip: '2001:2:0:1::a'}, {ip: 198.18.1.20}]}",
        ));
        let e = expected_endpoints(&objs, &[]);
        assert_eq!(e[&("default".to_string(), "web".to_string())].len(), 2);
    }

    #[test]
    fn published_endpoints_read_only_the_controllers_slices() {
        let list = json!({"items": [
            {"metadata": {"namespace": "default", "labels": {
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                "kubernetes.io/service-name": "web"}},
             "ports": [{"port": 8080, "protocol": "TCP"}],
             "endpoints": [{"addresses": ["198.18.1.10"], "conditions": {"ready": true}}]},
            {"metadata": {"namespace": "default", "labels": {
                "kubernetes.io/service-name": "web"}},
             "endpoints": [{"addresses": ["198.18.1.99"], "conditions": {"ready": true}}]},
        ]});
        let p = published_endpoints(&list);
        let eps = &p[&("default".to_string(), "web".to_string())];
        assert_eq!(eps.len(), 1);
        assert_eq!(eps.iter().next().unwrap().ip, "198.18.1.10");
    }

    #[test]
    fn the_applied_view_leaves_allocations_and_status_to_the_server() {
        let objs = objects(
            "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: default}\n\
             spec: {clusterIP: 198.19.0.10, ports: [{port: 80, nodePort: 30001}]}\n\
             status: {loadBalancer: {ingress: [{ip: 198.18.5.1}]}}\n---\n\
             apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: default}\n",
        );
        // Asked for by the manifest: sent.
        let svc = applied_view(&objs[0], None).unwrap();
        assert_eq!(svc["apiVersion"], "v1");
        assert!(svc.get("status").is_none());
        assert_eq!(svc["spec"]["clusterIP"], "198.19.0.10");
        // Allocated by the API server and read back: left to it.
        let Object::Service(s) = &objs[0] else {
            panic!()
        };
        let alloc = allocation_of(&serde_json::to_value(s.spec.as_ref().unwrap()).unwrap());
        let svc = applied_view(&objs[0], Some(&alloc)).unwrap();
        assert!(svc["spec"].get("clusterIP").is_none());
        assert!(svc["spec"]["ports"][0].get("nodePort").is_none());
        assert_eq!(
            status_view(&objs[0]).unwrap().unwrap()["loadBalancer"]["ingress"][0]["ip"],
            "198.18.5.1"
        );
        let pod = applied_view(&objs[1], None).unwrap();
        assert_eq!(pod["spec"]["containers"][0]["image"], "kpr-lab/lab-server");
    }
}

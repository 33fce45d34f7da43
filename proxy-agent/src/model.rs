//! The model: a pure function from a source's [`Snapshot`] to the desired
//! dataplane state ([`DesiredState`]), with kube-proxy's semantics.
//!
//! The pipeline, per Service port: collect the endpoints of the Service's
//! EndpointSlices (real ones, plus those synthesized from Pods by
//! [`endpoint_slices_from_pods`]), deduplicate them by `ip:port`, then
//! [`categorize`] them into the backends a frontend uses, as kube-proxy's
//! `CategorizeEndpoints` does (traffic policies, topology hints, terminating
//! fallback).
//!
//! Frontends built now: every IPv4 ClusterIP × service port (scope
//! [`SCOPE_INTERNAL`]). NodePort, externalIP and load-balancer frontends come
//! later.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1::{Pod, Service, ServicePort};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use proxy_common::{svc_flags, IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL};

use crate::manifests::Snapshot;

/// Label on an EndpointSlice naming its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Label marking a Service headless (set by the control plane on some objects).
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label naming the proxy that must handle a Service.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Node label naming the node's zone (`v1.LabelTopologyZone`).
pub const LABEL_TOPOLOGY_ZONE: &str = "topology.kubernetes.io/zone";
/// Default ClientIP session-affinity timeout (kube-proxy / API default), seconds.
pub const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;

/// A frontend: what a packet's destination is matched against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendKey {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
}

impl fmt::Display for FrontendKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scope = if self.scope == SCOPE_INTERNAL {
            "internal"
        } else {
            "external"
        };
        write!(
            f,
            "{}:{}/{} ({scope})",
            self.addr,
            self.port,
            proto_name(self.proto)
        )
    }
}

/// A backend: where a packet is translated to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendAddr {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: u8,
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.addr, self.port, proto_name(self.proto))
    }
}

/// `TCP`, `UDP` or the protocol number.
pub fn proto_name(proto: u8) -> String {
    match proto {
        IPPROTO_TCP => "TCP".into(),
        IPPROTO_UDP => "UDP".into(),
        n => n.to_string(),
    }
}

/// What a frontend should do.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frontend {
    /// The Service, `namespace/name`.
    pub service: String,
    /// The service port's name (empty when unnamed).
    pub port_name: String,
    /// The backends new flows are balanced over. Sorted, without duplicates.
    pub backends: Vec<BackendAddr>,
    /// Terminating endpoints of this service port that are not in `backends`:
    /// kept in the backends map, without a slot, so that flows already using
    /// them keep working until they end (field bug C5). Sorted, without
    /// duplicates, disjoint from `backends`. Endpoints that are merely not
    /// ready (not terminating) are not retained.
    pub retained: Vec<BackendAddr>,
    /// [`proxy_common::svc_flags`] bits: [`svc_flags::DROP_NO_BACKEND`] when
    /// `backends` is empty but usable endpoints exist elsewhere in the
    /// cluster (drop, as kube-proxy does, instead of rejecting).
    pub flags: u16,
    /// ClientIP session-affinity timeout in seconds; 0 = none.
    pub affinity_timeout_s: u32,
}

/// Every frontend this node should program.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    pub frontends: BTreeMap<FrontendKey, Frontend>,
}

/// Something in the snapshot the model could not use; the rest is unaffected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelWarning {
    /// The object concerned, e.g. `Service default/web` or `EndpointSlice default/web-abc`.
    pub object: String,
    pub message: String,
}

impl fmt::Display for ModelWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.message)
    }
}

/// Options of the model.
#[derive(Clone, Debug, Default)]
pub struct ModelOptions {
    /// This proxy's name for the `service.kubernetes.io/service-proxy-name`
    /// label. With `None`, every Service carrying the label is ignored (as
    /// kube-proxy does); with `Some(n)`, only those naming another proxy.
    pub service_proxy_name: Option<String>,
    /// Feature gates, as kube-proxy's.
    pub gates: Gates,
}

/// The kube-proxy feature gates the model follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gates {
    /// `PreferSameTrafficDistribution` (default on): node hints
    /// (`hints.forNodes`) select endpoints.
    pub prefer_same_traffic_distribution: bool,
}

impl Default for Gates {
    /// Every gate at kube-proxy's default.
    fn default() -> Self {
        Self {
            prefer_same_traffic_distribution: true,
        }
    }
}

/// One endpoint of a service port, as the EndpointSlices describe it
/// (kube-proxy `pkg/proxy/endpointslicecache.go` `addEndpoints`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    pub addr: BackendAddr,
    /// `conditions.ready` (missing = true).
    pub ready: bool,
    /// `conditions.serving` (missing = true).
    pub serving: bool,
    /// `conditions.terminating` (missing = false).
    pub terminating: bool,
    /// `nodeName`; an endpoint without one is never local.
    pub node_name: Option<String>,
    pub zone: Option<String>,
    /// `hints.forZones[].name`.
    pub zone_hints: Vec<String>,
    /// `hints.forNodes[].name`.
    pub node_hints: Vec<String>,
}

impl EndpointInfo {
    /// Whether the endpoint runs on `node`: its `nodeName` equals the node's name.
    pub fn is_local(&self, node: &str) -> bool {
        self.node_name.as_deref() == Some(node)
    }

    /// Serving and terminating: usable only when nothing ready is
    /// (kube-proxy `CategorizeEndpoints`' fallback).
    pub fn is_serving_terminating(&self) -> bool {
        self.serving && self.terminating
    }

    /// Usable at all: ready, or serving and terminating.
    fn is_usable(&self) -> bool {
        self.ready || self.is_serving_terminating()
    }
}

/// A traffic policy (`internalTrafficPolicy`, `externalTrafficPolicy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TrafficPolicy {
    /// `Cluster`, also when the field is missing or unknown.
    #[default]
    Cluster,
    /// `Local`: only endpoints on this node.
    Local,
}

impl TrafficPolicy {
    /// `Local` for `"Local"`, `Cluster` for anything else (the API default).
    pub fn parse(policy: Option<&str>) -> Self {
        match policy {
            Some("Local") => Self::Local,
            _ => Self::Cluster,
        }
    }
}

/// What one service port looks like to [`categorize`] (kube-proxy
/// `pkg/proxy/serviceport.go` `BaseServicePortInfo`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServicePortInfo {
    /// `spec.internalTrafficPolicy`.
    pub internal_traffic_policy: TrafficPolicy,
    /// `spec.externalTrafficPolicy`.
    pub external_traffic_policy: TrafficPolicy,
    /// The port has a nodePort, or the Service an IPv4 externalIP or an IPv4
    /// VIP-mode load-balancer ingress IP (`ExternallyAccessible`).
    pub externally_accessible: bool,
}

impl ServicePortInfo {
    /// The port of `svc` as kube-proxy's IPv4 proxier sees it
    /// (`newBaseServiceInfo`): `externalIPs` and load-balancer ingress IPs of
    /// the other family do not count; a load-balancer IP counts only in
    /// `VIP` mode (`ipMode` missing or `"VIP"`, `proxyutil.IsVIPMode`).
    pub fn from_service(svc: &Service, port: &ServicePort) -> Self {
        let spec = svc.spec.as_ref();
        let is_v4 = |ip: &str| ip.parse::<Ipv4Addr>().is_ok();
        let node_port = port.node_port.is_some_and(|p| p != 0);
        let external_ip = spec
            .and_then(|s| s.external_ips.as_ref())
            .is_some_and(|ips| ips.iter().any(|ip| is_v4(ip)));
        let lb_vip = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .is_some_and(|ingress| {
                ingress.iter().any(|i| {
                    i.ip.as_deref().is_some_and(is_v4)
                        && i.ip_mode.as_deref().is_none_or(|m| m == "VIP")
                })
            });
        Self {
            internal_traffic_policy: TrafficPolicy::parse(
                spec.and_then(|s| s.internal_traffic_policy.as_deref()),
            ),
            external_traffic_policy: TrafficPolicy::parse(
                spec.and_then(|s| s.external_traffic_policy.as_deref()),
            ),
            externally_accessible: node_port || external_ip || lb_vip,
        }
    }

    /// Cluster endpoints are needed when `internalTrafficPolicy` is not
    /// `Local`, or when the port is externally accessible (even with
    /// `externalTrafficPolicy: Local`, for short-circuited traffic from inside
    /// the cluster). kube-proxy `BaseServicePortInfo.UsesClusterEndpoints`.
    pub fn uses_cluster_endpoints(&self) -> bool {
        self.internal_traffic_policy != TrafficPolicy::Local || self.externally_accessible
    }

    /// Local endpoints are needed when `internalTrafficPolicy` is `Local`, or
    /// `externalTrafficPolicy` is `Local` on an externally accessible port (it
    /// is ignored otherwise). kube-proxy `BaseServicePortInfo.UsesLocalEndpoints`.
    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_traffic_policy == TrafficPolicy::Local
            || (self.external_traffic_policy == TrafficPolicy::Local && self.externally_accessible)
    }
}

/// The node the model runs for, as [`categorize`] needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeTopology<'a> {
    /// The node's name (compared with endpoints' `nodeName` and node hints).
    pub name: &'a str,
    /// The node's `topology.kubernetes.io/zone` label; `None` or empty never
    /// matches a zone hint.
    pub zone: Option<&'a str>,
}

impl<'a> NodeTopology<'a> {
    /// `node_name`, with its zone taken from the snapshot's Node object of
    /// that name (label [`LABEL_TOPOLOGY_ZONE`]); no zone without one.
    pub fn from_snapshot(snapshot: &'a Snapshot, node_name: &'a str) -> Self {
        let zone = snapshot
            .nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(node_name))
            .and_then(|n| n.metadata.labels.as_ref())
            .and_then(|l| l.get(LABEL_TOPOLOGY_ZONE))
            .map(String::as_str)
            .filter(|z| !z.is_empty());
        Self {
            name: node_name,
            zone,
        }
    }
}

/// The endpoints a service port uses from one node, kube-proxy's
/// `CategorizeEndpoints` results. Every list is sorted, without duplicates
/// (given endpoints without duplicates).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Categorized {
    /// For `Cluster` traffic policies; `None` = the port does not use them.
    pub cluster: Option<Vec<BackendAddr>>,
    /// For `Local` traffic policies; `None` = the port does not use them.
    pub local: Option<Vec<BackendAddr>>,
    /// `cluster` ∪ `local`: every endpoint some traffic may reach.
    pub all_reachable: Vec<BackendAddr>,
    /// Whether any usable endpoint (ready, or serving and terminating) exists
    /// anywhere in the cluster. With an empty list in use, `true` means drop,
    /// `false` means reject.
    pub has_any_endpoints: bool,
}

/// Topology mode of a service port's cluster endpoints (kube-proxy
/// `topologyModeFromHints`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TopologyMode {
    /// No filtering.
    None,
    /// `PreferSameNode`: endpoints hinted for this node.
    SameNode,
    /// `PreferSameZone`: endpoints hinted for this node's zone.
    SameZone,
}

/// kube-proxy `pkg/proxy/topology.go` `topologyModeFromHints`: looking at
/// ready endpoints only, node mode when the gate is on, every ready endpoint
/// has a node hint and one is for this node; else zone mode when every ready
/// endpoint has a zone hint and one is for this node's (non-empty) zone; else
/// none. One unhinted ready endpoint turns the mode off.
fn topology_mode(
    endpoints: &[EndpointInfo],
    node: &NodeTopology<'_>,
    gates: &Gates,
) -> TopologyMode {
    let zone = node.zone.filter(|z| !z.is_empty());
    let (mut all_node_hints, mut for_node) = (true, false);
    let (mut all_zone_hints, mut for_zone) = (true, false);
    for e in endpoints.iter().filter(|e| e.ready) {
        if e.zone_hints.is_empty() {
            all_zone_hints = false;
        } else if zone.is_some_and(|z| e.zone_hints.iter().any(|h| h == z)) {
            for_zone = true;
        }
        if e.node_hints.is_empty() {
            all_node_hints = false;
        } else if e.node_hints.iter().any(|h| h == node.name) {
            for_node = true;
        }
    }
    if gates.prefer_same_traffic_distribution && all_node_hints && for_node {
        TopologyMode::SameNode
    } else if all_zone_hints && for_zone {
        TopologyMode::SameZone
    } else {
        TopologyMode::None
    }
}

/// kube-proxy `pkg/proxy/topology.go` `availableForTopology`.
fn available_for_topology(e: &EndpointInfo, mode: TopologyMode, node: &NodeTopology<'_>) -> bool {
    match mode {
        TopologyMode::None => true,
        TopologyMode::SameNode => e.node_hints.iter().any(|h| h == node.name),
        TopologyMode::SameZone => node
            .zone
            .is_some_and(|z| e.zone_hints.iter().any(|h| h == z)),
    }
}

/// The addresses of the endpoints that pass `keep`, sorted, deduplicated.
fn select(endpoints: &[EndpointInfo], keep: impl Fn(&EndpointInfo) -> bool) -> Vec<BackendAddr> {
    let mut out: Vec<BackendAddr> = endpoints
        .iter()
        .filter(|e| keep(e))
        .map(|e| e.addr)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Endpoint categorization, as kube-proxy `pkg/proxy/topology.go`
/// `CategorizeEndpoints` (with the `PreferSameTrafficDistribution` gate):
///
/// - cluster list (when [`ServicePortInfo::uses_cluster_endpoints`]): the
///   ready endpoints the topology mode allows (see `topology_mode`); if none,
///   every serving-and-terminating endpoint cluster-wide, ignoring topology.
///   A terminating endpoint that is not serving is never used.
/// - local list (when [`ServicePortInfo::uses_local_endpoints`]): the local
///   ready endpoints; if none, the local serving-and-terminating ones.
///   Topology hints never apply.
/// - `has_any_endpoints`: any ready, or serving-and-terminating, endpoint
///   anywhere.
pub fn categorize(
    port: &ServicePortInfo,
    endpoints: &[EndpointInfo],
    node: &NodeTopology<'_>,
    gates: &Gates,
) -> Categorized {
    let cluster = port.uses_cluster_endpoints().then(|| {
        let mode = topology_mode(endpoints, node, gates);
        let ready = select(endpoints, |e| {
            e.ready && available_for_topology(e, mode, node)
        });
        // The mode only filters when some ready endpoint passes it, so an
        // empty list here means no ready endpoint anywhere.
        if ready.is_empty() {
            select(endpoints, EndpointInfo::is_serving_terminating)
        } else {
            ready
        }
    });
    let local = port.uses_local_endpoints().then(|| {
        let is_local = |e: &EndpointInfo| e.is_local(node.name);
        let ready = select(endpoints, |e| is_local(e) && e.ready);
        if ready.is_empty() {
            select(endpoints, |e| is_local(e) && e.is_serving_terminating())
        } else {
            ready
        }
    });
    let mut all_reachable: Vec<BackendAddr> = cluster
        .iter()
        .chain(local.iter())
        .flatten()
        .copied()
        .collect();
    all_reachable.sort();
    all_reachable.dedup();
    Categorized {
        has_any_endpoints: endpoints.iter().any(EndpointInfo::is_usable),
        cluster,
        local,
        all_reachable,
    }
}

/// The desired state for `node_name`, with default options.
pub fn desired_state(snapshot: &Snapshot, node_name: &str) -> (DesiredState, Vec<ModelWarning>) {
    desired_state_with(snapshot, node_name, &ModelOptions::default())
}

fn namespace(meta: &ObjectMeta) -> &str {
    meta.namespace
        .as_deref()
        .filter(|ns| !ns.is_empty())
        .unwrap_or("default")
}

fn name(meta: &ObjectMeta) -> &str {
    meta.name.as_deref().unwrap_or("")
}

fn service_id(svc: &Service) -> String {
    format!("{}/{}", namespace(&svc.metadata), name(&svc.metadata))
}

/// Parses a Kubernetes protocol name; `None` protocol is TCP.
fn parse_proto(protocol: Option<&str>) -> Result<u8, String> {
    match protocol.unwrap_or("TCP") {
        "TCP" => Ok(IPPROTO_TCP),
        "UDP" => Ok(IPPROTO_UDP),
        other => Err(format!("protocol {other} is not supported")),
    }
}

/// Why a Service is ignored, if it is.
fn ignored(svc: &Service, opts: &ModelOptions) -> Option<&'static str> {
    let labels = svc.metadata.labels.as_ref();
    if labels.is_some_and(|l| l.contains_key(LABEL_HEADLESS)) {
        return Some("headless label");
    }
    if let Some(proxy) = labels.and_then(|l| l.get(LABEL_SERVICE_PROXY_NAME)) {
        if opts.service_proxy_name.as_deref() != Some(proxy.as_str()) {
            return Some("service-proxy-name names another proxy");
        }
    }
    let Some(spec) = &svc.spec else {
        return Some("no spec");
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Some("ExternalName");
    }
    match spec.cluster_ip.as_deref() {
        Some("None") => return Some("headless"),
        None | Some("") if spec.cluster_ips.as_ref().is_none_or(|ips| ips.is_empty()) => {
            return Some("no clusterIP");
        }
        _ => {}
    }
    None
}

/// The desired state for `node_name`.
pub fn desired_state_with(
    snapshot: &Snapshot,
    node_name: &str,
    opts: &ModelOptions,
) -> (DesiredState, Vec<ModelWarning>) {
    let mut warnings = Vec::new();
    let mut desired = DesiredState::default();
    let node = NodeTopology::from_snapshot(snapshot, node_name);

    // Every slice, real and synthesized, indexed by (namespace, service name),
    // sorted by slice name so that duplicates resolve deterministically.
    let synthesized = endpoint_slices_from_pods(snapshot);
    let mut slices: BTreeMap<(&str, &str), Vec<&EndpointSlice>> = BTreeMap::new();
    for slice in snapshot.endpoint_slices.iter().chain(synthesized.iter()) {
        let Some(svc) = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_SERVICE_NAME))
        else {
            continue;
        };
        // An IPv4 proxier ignores slices of the other family (and FQDN ones).
        if slice.address_type != "IPv4" {
            continue;
        }
        slices
            .entry((namespace(&slice.metadata), svc.as_str()))
            .or_default()
            .push(slice);
    }
    for list in slices.values_mut() {
        list.sort_by(|a, b| name(&a.metadata).cmp(name(&b.metadata)));
    }

    let mut services: Vec<&Service> = snapshot.services.iter().collect();
    services.sort_by(|a, b| {
        (namespace(&a.metadata), name(&a.metadata))
            .cmp(&(namespace(&b.metadata), name(&b.metadata)))
    });
    // Invalid addresses are reported once per slice and address.
    let mut reported: BTreeSet<(String, String)> = BTreeSet::new();

    for svc in services {
        if let Some(why) = ignored(svc, opts) {
            tracing::trace!(service = %service_id(svc), why, "model: service ignored");
            continue;
        }
        let id = service_id(svc);
        let object = format!("Service {id}");
        let Some(spec) = &svc.spec else { continue };

        let ip_strings: Vec<&str> = match &spec.cluster_ips {
            Some(ips) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
            _ => spec.cluster_ip.as_deref().into_iter().collect(),
        };
        let mut cluster_ips = Vec::new();
        let mut bad_ip = None;
        for s in ip_strings {
            match s.parse::<IpAddr>() {
                Ok(IpAddr::V4(ip)) => cluster_ips.push(ip),
                Ok(IpAddr::V6(_)) => {}
                Err(_) => bad_ip = Some(s),
            }
        }
        if let Some(s) = bad_ip {
            warnings.push(ModelWarning {
                object,
                message: format!("invalid clusterIP {s:?}; service skipped"),
            });
            continue;
        }
        if cluster_ips.is_empty() {
            continue;
        }

        let affinity_timeout_s = if spec.session_affinity.as_deref() == Some("ClientIP") {
            spec.session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .and_then(|t| u32::try_from(t).ok())
                .unwrap_or(DEFAULT_AFFINITY_TIMEOUT_S)
        } else {
            0
        };

        let svc_slices = slices
            .get(&(namespace(&svc.metadata), name(&svc.metadata)))
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        for port in spec.ports.iter().flatten() {
            let port_name = port.name.clone().unwrap_or_default();
            let proto = match parse_proto(port.protocol.as_deref()) {
                Ok(p) => p,
                Err(e) => {
                    warnings.push(ModelWarning {
                        object: object.clone(),
                        message: format!("port {:?} ({}): {e}; port skipped", port_name, port.port),
                    });
                    continue;
                }
            };
            let svc_port = match u16::try_from(port.port) {
                Ok(p) if p != 0 => p,
                _ => {
                    warnings.push(ModelWarning {
                        object: object.clone(),
                        message: format!(
                            "port {:?}: invalid port number {}; port skipped",
                            port_name, port.port
                        ),
                    });
                    continue;
                }
            };

            let endpoints = port_endpoints(
                port,
                proto,
                svc_slices,
                node_name,
                &mut warnings,
                &mut reported,
            );
            let info = ServicePortInfo::from_service(svc, port);
            let categorized = categorize(&info, &endpoints, &node, &opts.gates);
            let (backends, flags) = internal_backends(&info, &categorized);
            let retained = retained_backends(&endpoints, &backends);

            for ip in &cluster_ips {
                let key = FrontendKey {
                    addr: *ip,
                    port: svc_port,
                    proto,
                    scope: SCOPE_INTERNAL,
                };
                if let Some(existing) = desired.frontends.get(&key) {
                    warnings.push(ModelWarning {
                        object: object.clone(),
                        message: format!(
                            "frontend {key} already belongs to service {}; skipped",
                            existing.service
                        ),
                    });
                    continue;
                }
                desired.frontends.insert(
                    key,
                    Frontend {
                        service: id.clone(),
                        port_name: port_name.clone(),
                        backends: backends.clone(),
                        retained: retained.clone(),
                        flags,
                        affinity_timeout_s,
                    },
                );
            }
        }
    }
    (desired, warnings)
}

/// The backends and flags of a port's ClusterIP frontends (scope
/// [`SCOPE_INTERNAL`]): the cluster list with `internalTrafficPolicy:
/// Cluster`, the local list with `Local`. An empty list while usable
/// endpoints exist elsewhere sets [`svc_flags::DROP_NO_BACKEND`] (kube-proxy
/// drops: "has no local endpoints"); with no usable endpoint anywhere the
/// flags stay 0 and the datapath rejects.
fn internal_backends(info: &ServicePortInfo, categorized: &Categorized) -> (Vec<BackendAddr>, u16) {
    let list = match info.internal_traffic_policy {
        TrafficPolicy::Cluster => &categorized.cluster,
        TrafficPolicy::Local => &categorized.local,
    };
    let backends = list.clone().unwrap_or_default();
    let flags = if backends.is_empty() && categorized.has_any_endpoints {
        svc_flags::DROP_NO_BACKEND
    } else {
        0
    };
    (backends, flags)
}

/// The terminating endpoints not in `backends` (field bug C5: "Keep
/// terminating backends in the backend map with a flag (excluded from
/// selection, valid for existing flows)"). Sorted, deduplicated.
fn retained_backends(endpoints: &[EndpointInfo], backends: &[BackendAddr]) -> Vec<BackendAddr> {
    select(endpoints, |e| {
        e.terminating && backends.binary_search(&e.addr).is_err()
    })
}

/// Whether an EndpointSlice port serves this service port: same name (empty
/// and missing are equal) and same protocol.
fn port_matches(slice_port: &EndpointPort, port: &ServicePort, proto: u8) -> bool {
    let slice_name = slice_port.name.as_deref().unwrap_or("");
    let svc_name = port.name.as_deref().unwrap_or("");
    slice_name == svc_name && parse_proto(slice_port.protocol.as_deref()).ok() == Some(proto)
}

/// The endpoints of one service port across `slices`, deduplicated by
/// `ip:port` (the first slice by name wins, unless a later copy is local, as in
/// kube-proxy `EndpointSliceCache.addEndpoints`), sorted. As kube-proxy: a
/// slice port with no port number or port 0 is skipped; an endpoint's first
/// address is its address; an endpoint without `nodeName` is never local.
fn port_endpoints(
    port: &ServicePort,
    proto: u8,
    slices: &[&EndpointSlice],
    node_name: &str,
    warnings: &mut Vec<ModelWarning>,
    reported: &mut BTreeSet<(String, String)>,
) -> Vec<EndpointInfo> {
    let mut found: BTreeMap<BackendAddr, EndpointInfo> = BTreeMap::new();
    for slice in slices {
        let Some(slice_port) = slice
            .ports
            .iter()
            .flatten()
            .find(|p| port_matches(p, port, proto))
        else {
            continue;
        };
        let Some(backend_port) = slice_port
            .port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
        else {
            continue;
        };
        let slice_id = format!("{}/{}", namespace(&slice.metadata), name(&slice.metadata));
        for endpoint in &slice.endpoints {
            let Some(address) = endpoint.addresses.first() else {
                continue;
            };
            let addr = match address.parse::<Ipv4Addr>() {
                Ok(a) => a,
                Err(_) => {
                    if reported.insert((slice_id.clone(), address.clone())) {
                        warnings.push(ModelWarning {
                            object: format!("EndpointSlice {slice_id}"),
                            message: format!("invalid IPv4 address {address:?}; endpoint skipped"),
                        });
                    }
                    continue;
                }
            };
            let info = endpoint_info(
                endpoint,
                BackendAddr {
                    addr,
                    port: backend_port,
                    proto,
                },
            );
            if !found.contains_key(&info.addr) || info.is_local(node_name) {
                found.insert(info.addr, info);
            }
        }
    }
    found.into_values().collect()
}

fn endpoint_info(endpoint: &Endpoint, addr: BackendAddr) -> EndpointInfo {
    let c = endpoint.conditions.clone().unwrap_or_default();
    let hints = endpoint.hints.as_ref();
    EndpointInfo {
        addr,
        ready: c.ready.unwrap_or(true),
        serving: c.serving.unwrap_or(true),
        terminating: c.terminating.unwrap_or(false),
        node_name: endpoint.node_name.clone(),
        zone: endpoint.zone.clone(),
        zone_hints: hints
            .and_then(|h| h.for_zones.as_ref())
            .into_iter()
            .flatten()
            .map(|z| z.name.clone())
            .collect(),
        node_hints: hints
            .and_then(|h| h.for_nodes.as_ref())
            .into_iter()
            .flatten()
            .map(|n| n.name.clone())
            .collect(),
    }
}

/// Whether the pod may back a Service: an IPv4 pod IP, not finished
/// (`Succeeded` or `Failed`). Terminating pods may (the EndpointSlice
/// controller's `ShouldPodBeInEndpoints` with `includeTerminating`). Returns
/// its IPv4 address.
fn pod_ipv4(pod: &Pod) -> Option<Ipv4Addr> {
    let status = pod.status.as_ref()?;
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return None;
    }
    let primary = status.pod_ip.as_deref().into_iter();
    let all = status.pod_ips.iter().flatten().map(|p| p.ip.as_str());
    primary
        .chain(all)
        .find_map(|ip| ip.parse::<Ipv4Addr>().ok())
}

/// The pod's Ready condition; a pod without one counts as ready.
fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_none_or(|c| c.status == "True")
}

/// The port a service port's `targetPort` resolves to on `pod`, if any.
fn resolve_target_port(port: &ServicePort, proto_name: &str, pod: &Pod) -> Option<i32> {
    match &port.target_port {
        None => Some(port.port),
        Some(IntOrString::Int(n)) => Some(*n),
        Some(IntOrString::String(s)) => {
            // A numeric string is a number (the API server normalizes these).
            if let Ok(n) = s.parse::<i32>() {
                return Some(n);
            }
            let spec = pod.spec.as_ref()?;
            spec.containers
                .iter()
                .flat_map(|c| c.ports.iter().flatten())
                .find_map(|cp| {
                    (cp.name.as_deref() == Some(s.as_str())
                        && cp.protocol.as_deref().unwrap_or("TCP") == proto_name)
                        .then_some(cp.container_port)
                })
        }
    }
}

/// EndpointSlices standing in for the EndpointSlice controller: for every
/// Service with a selector, one slice per matching Pod in its namespace that
/// has an IPv4 pod IP and has not finished. The slice, named
/// `<svc>-pod-<pod>`, holds one endpoint and one port per service port whose
/// `targetPort` resolves on that Pod.
///
/// The endpoint's conditions follow the controller's `podToEndpoint`
/// (pkg/controller/endpointslice, `endpointslice/util`): serving = the Pod's
/// Ready condition (true when absent, unlike the controller, as manifests
/// often carry no status conditions); terminating = the Pod has a
/// `deletionTimestamp`; ready = `publishNotReadyAddresses || (serving &&
/// !terminating)`.
pub fn endpoint_slices_from_pods(snapshot: &Snapshot) -> Vec<EndpointSlice> {
    let mut out = Vec::new();
    for svc in &snapshot.services {
        let Some(spec) = &svc.spec else { continue };
        let Some(selector) = spec.selector.as_ref().filter(|s| !s.is_empty()) else {
            continue;
        };
        let ns = namespace(&svc.metadata);
        let svc_name = name(&svc.metadata);
        let publish_not_ready = spec.publish_not_ready_addresses == Some(true);
        for pod in &snapshot.pods {
            if namespace(&pod.metadata) != ns {
                continue;
            }
            let labels = pod.metadata.labels.as_ref();
            if !selector
                .iter()
                .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
            {
                continue;
            }
            let Some(ip) = pod_ipv4(pod) else { continue };
            let ports: Vec<EndpointPort> = spec
                .ports
                .iter()
                .flatten()
                .filter_map(|port| {
                    let protocol = port.protocol.clone().unwrap_or_else(|| "TCP".to_string());
                    let target = resolve_target_port(port, &protocol, pod)?;
                    Some(EndpointPort {
                        name: port.name.clone(),
                        port: Some(target),
                        protocol: Some(protocol),
                        app_protocol: port.app_protocol.clone(),
                    })
                })
                .collect();
            let serving = pod_ready(pod);
            let terminating = pod.metadata.deletion_timestamp.is_some();
            let ready = publish_not_ready || (serving && !terminating);
            out.push(EndpointSlice {
                address_type: "IPv4".to_string(),
                metadata: ObjectMeta {
                    name: Some(format!("{svc_name}-pod-{}", name(&pod.metadata))),
                    namespace: Some(ns.to_string()),
                    labels: Some(BTreeMap::from([(
                        LABEL_SERVICE_NAME.to_string(),
                        svc_name.to_string(),
                    )])),
                    ..ObjectMeta::default()
                },
                endpoints: vec![Endpoint {
                    addresses: vec![ip.to_string()],
                    conditions: Some(EndpointConditions {
                        ready: Some(ready),
                        serving: Some(serving),
                        terminating: Some(terminating),
                    }),
                    node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                    ..Endpoint::default()
                }],
                ports: Some(ports),
            });
        }
    }
    out
}

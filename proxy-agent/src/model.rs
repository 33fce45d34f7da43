//! The model: a pure function from a source's [`Snapshot`] to the desired
//! dataplane state ([`DesiredState`]), with kube-proxy's semantics.
//!
//! The pipeline, per Service port: collect the endpoints of the Service's
//! EndpointSlices (real ones, plus those synthesized from Pods by
//! [`endpoint_slices_from_pods`]), deduplicate them by `ip:port`, then
//! [`categorize`] them into the backends a frontend uses.
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
use proxy_common::{IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL};

use crate::manifests::Snapshot;

/// Label on an EndpointSlice naming its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Label marking a Service headless (set by the control plane on some objects).
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label naming the proxy that must handle a Service.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
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
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frontend {
    /// The Service, `namespace/name`.
    pub service: String,
    /// The service port's name (empty when unnamed).
    pub port_name: String,
    /// Sorted, without duplicates.
    pub backends: Vec<BackendAddr>,
    /// [`proxy_common::svc_flags`] bits.
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
}

/// One endpoint of a service port, as the EndpointSlices describe it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    pub addr: BackendAddr,
    /// `conditions.ready` (missing = true).
    pub ready: bool,
    /// `conditions.serving` (missing = true).
    pub serving: bool,
    /// `conditions.terminating` (missing = false).
    pub terminating: bool,
    pub node_name: Option<String>,
    pub zone: Option<String>,
}

impl EndpointInfo {
    /// Whether the endpoint runs on `node`.
    pub fn is_local(&self, node: &str) -> bool {
        self.node_name.as_deref() == Some(node)
    }
}

/// What one service port looks like to [`categorize`]; traffic policies and
/// topology will be added here.
#[derive(Clone, Debug)]
pub struct ServicePortInfo<'a> {
    pub service: &'a str,
    pub port_name: &'a str,
}

/// The endpoints a service port uses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Categorized {
    /// Backends of internal (ClusterIP) frontends; `None` = not used.
    pub cluster: Option<Vec<BackendAddr>>,
    /// Local backends (for `Local` traffic policies); `None` = not used.
    pub local: Option<Vec<BackendAddr>>,
    /// Whether any usable endpoint exists anywhere in the cluster.
    pub has_any: bool,
}

/// Endpoint categorization. For now: every ready endpoint is a cluster
/// backend; local endpoints, terminating fallback and topology come later.
pub fn categorize(
    _port: &ServicePortInfo<'_>,
    endpoints: &[EndpointInfo],
    _node_name: &str,
) -> Categorized {
    let cluster: Vec<BackendAddr> = endpoints
        .iter()
        .filter(|e| e.ready)
        .map(|e| e.addr)
        .collect();
    Categorized {
        has_any: !cluster.is_empty(),
        cluster: Some(cluster),
        local: None,
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
            let info = ServicePortInfo {
                service: &id,
                port_name: &port_name,
            };
            let categorized = categorize(&info, &endpoints, node_name);
            let mut backends = categorized.cluster.unwrap_or_default();
            backends.sort();
            backends.dedup();

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
                        flags: 0,
                        affinity_timeout_s,
                    },
                );
            }
        }
    }
    (desired, warnings)
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
/// kube-proxy), sorted.
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
    EndpointInfo {
        addr,
        ready: c.ready.unwrap_or(true),
        serving: c.serving.unwrap_or(true),
        terminating: c.terminating.unwrap_or(false),
        node_name: endpoint.node_name.clone(),
        zone: endpoint.zone.clone(),
    }
}

/// Whether the pod may back a Service: IPv4 pod IP, not terminating, not
/// finished. Returns its IPv4 address.
fn pod_ipv4(pod: &Pod) -> Option<Ipv4Addr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
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
/// has an IPv4 pod IP, is not terminating and has not finished. The slice,
/// named `<svc>-pod-<pod>`, holds one endpoint (ready = the Pod's Ready
/// condition, true when absent) and one port per service port whose
/// `targetPort` resolves on that Pod.
pub fn endpoint_slices_from_pods(snapshot: &Snapshot) -> Vec<EndpointSlice> {
    let mut out = Vec::new();
    for svc in &snapshot.services {
        let Some(spec) = &svc.spec else { continue };
        let Some(selector) = spec.selector.as_ref().filter(|s| !s.is_empty()) else {
            continue;
        };
        let ns = namespace(&svc.metadata);
        let svc_name = name(&svc.metadata);
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
            let ready = pod_ready(pod);
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
                        serving: Some(ready),
                        terminating: Some(false),
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

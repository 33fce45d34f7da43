//! Services and EndpointSlices as the model keeps them: the fields it
//! reads, nothing else, with the strings many objects repeat (namespaces,
//! node names, zones, protocols, port names, types and policies) interned.
//!
//! A k8s-openapi `Service` is 824 bytes before any of its strings, an
//! `EndpointSlice` 432 bytes plus 352 per endpoint and a `BTreeMap` node for
//! its labels; the model holds one of each per Service for as long as the
//! Service exists. These forms are a fifth of that (issue 13: about 3 kB per
//! Service in all). A source converts an object once, when it reads it
//! (`Object::from(&service)`, see [`super::Object`]), and keeps only the
//! compact form too.
//!
//! Each field keeps the API's meaning, including "missing" where the model
//! tells it from a default (`Option`); a list the model reads the same
//! missing or empty is an empty slice.
use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use k8s_openapi::api::core::v1::{Service, ServicePort};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{
    name, namespace, ObjectKey, ANNOTATION_LAST_CHANGE_TRIGGER_TIME, ANNOTATION_LB_ALGORITHM,
    LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME,
};

/// Strings shared by every object that holds them. Entries no object holds
/// any more are dropped once the set has doubled since the last purge, so a
/// cluster that churns namespaces or nodes does not grow it for ever.
struct Interner {
    set: HashSet<Arc<str>>,
    purge_at: usize,
}

/// The one copy of `s`.
pub fn intern(s: &str) -> Arc<str> {
    static INTERNER: OnceLock<Mutex<Interner>> = OnceLock::new();
    let mut g = INTERNER
        .get_or_init(|| {
            Mutex::new(Interner {
                set: HashSet::new(),
                purge_at: 1024,
            })
        })
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(a) = g.set.get(s) {
        return a.clone();
    }
    if g.set.len() >= g.purge_at {
        g.set.retain(|a| Arc::strong_count(a) > 1);
        g.purge_at = (g.set.len() * 2).max(1024);
    }
    let a: Arc<str> = Arc::from(s);
    g.set.insert(a.clone());
    a
}

fn intern_opt(s: Option<&String>) -> Option<Arc<str>> {
    s.map(|s| intern(s))
}

fn boxed(list: Option<&Vec<String>>) -> Box<[Box<str>]> {
    list.into_iter()
        .flatten()
        .map(|s| Box::from(s.as_str()))
        .collect()
}

/// A Service: `metadata`, `spec` and `status.loadBalancer.ingress` as the
/// model reads them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompactService {
    /// `metadata.namespace` (`default` when unset or empty).
    pub namespace: Arc<str>,
    /// `metadata.name` (empty when unset).
    pub name: Arc<str>,
    pub creation_timestamp: Option<jiff::Timestamp>,
    /// Whether it has the `service.kubernetes.io/headless` label.
    pub headless_label: bool,
    /// Its `service.kubernetes.io/service-proxy-name` label.
    pub service_proxy_name: Option<Arc<str>>,
    /// Its load-balancing algorithm annotation.
    pub lb_algorithm: Option<Box<str>>,
    /// `None`: no `spec` at all.
    pub spec: Option<Box<CompactServiceSpec>>,
    /// `status.loadBalancer.ingress[]`.
    pub lb_ingress: Box<[LbIngress]>,
}

/// One of a Service's `status.loadBalancer.ingress`: its `ip` and `ipMode`.
pub type LbIngress = (Option<Box<str>>, Option<Arc<str>>);

/// A Service's `spec`, the fields the model reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompactServiceSpec {
    pub type_: Option<Arc<str>>,
    pub cluster_ip: Option<Box<str>>,
    pub cluster_ips: Box<[Box<str>]>,
    pub ip_families: Box<[Arc<str>]>,
    pub ip_family_policy: Option<Arc<str>>,
    pub ports: Box<[CompactServicePort]>,
    pub selector: Box<[(Arc<str>, Arc<str>)]>,
    pub publish_not_ready_addresses: Option<bool>,
    pub session_affinity: Option<Arc<str>>,
    /// `sessionAffinityConfig.clientIP.timeoutSeconds`.
    pub affinity_timeout_seconds: Option<i32>,
    pub external_ips: Box<[Box<str>]>,
    pub load_balancer_source_ranges: Box<[Box<str>]>,
    pub external_traffic_policy: Option<Arc<str>>,
    pub internal_traffic_policy: Option<Arc<str>>,
    pub health_check_node_port: Option<i32>,
    pub allocate_load_balancer_node_ports: Option<bool>,
}

/// One of `spec.ports`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompactServicePort {
    pub name: Option<Arc<str>>,
    pub protocol: Option<Arc<str>>,
    pub port: i32,
    pub node_port: Option<i32>,
    pub target_port: Option<IntOrString>,
    pub app_protocol: Option<Arc<str>>,
}

impl CompactServicePort {
    pub(crate) fn of(p: &ServicePort) -> Self {
        Self {
            name: intern_opt(p.name.as_ref()),
            protocol: intern_opt(p.protocol.as_ref()),
            port: p.port,
            node_port: p.node_port,
            target_port: p.target_port.clone(),
            app_protocol: intern_opt(p.app_protocol.as_ref()),
        }
    }
}

impl From<&Service> for CompactService {
    fn from(svc: &Service) -> Self {
        let meta = &svc.metadata;
        let label = |k: &str| meta.labels.as_ref().and_then(|l| l.get(k));
        let spec = svc.spec.as_ref().map(|s| {
            Box::new(CompactServiceSpec {
                type_: intern_opt(s.type_.as_ref()),
                cluster_ip: s.cluster_ip.as_deref().map(Box::from),
                cluster_ips: boxed(s.cluster_ips.as_ref()),
                ip_families: s.ip_families.iter().flatten().map(|f| intern(f)).collect(),
                ip_family_policy: intern_opt(s.ip_family_policy.as_ref()),
                ports: s
                    .ports
                    .iter()
                    .flatten()
                    .map(CompactServicePort::of)
                    .collect(),
                selector: s
                    .selector
                    .iter()
                    .flatten()
                    .map(|(k, v)| (intern(k), intern(v)))
                    .collect(),
                publish_not_ready_addresses: s.publish_not_ready_addresses,
                session_affinity: intern_opt(s.session_affinity.as_ref()),
                affinity_timeout_seconds: s
                    .session_affinity_config
                    .as_ref()
                    .and_then(|c| c.client_ip.as_ref())
                    .and_then(|c| c.timeout_seconds),
                external_ips: boxed(s.external_ips.as_ref()),
                load_balancer_source_ranges: boxed(s.load_balancer_source_ranges.as_ref()),
                external_traffic_policy: intern_opt(s.external_traffic_policy.as_ref()),
                internal_traffic_policy: intern_opt(s.internal_traffic_policy.as_ref()),
                health_check_node_port: s.health_check_node_port,
                allocate_load_balancer_node_ports: s.allocate_load_balancer_node_ports,
            })
        });
        Self {
            namespace: intern(namespace(meta)),
            name: Arc::from(name(meta)),
            creation_timestamp: meta.creation_timestamp.as_ref().map(|t| t.0),
            headless_label: label(LABEL_HEADLESS).is_some(),
            service_proxy_name: intern_opt(label(LABEL_SERVICE_PROXY_NAME)),
            lb_algorithm: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_LB_ALGORITHM))
                .map(|v| Box::from(v.as_str())),
            spec,
            lb_ingress: svc
                .status
                .as_ref()
                .and_then(|s| s.load_balancer.as_ref())
                .and_then(|lb| lb.ingress.as_ref())
                .into_iter()
                .flatten()
                .map(|i| {
                    (
                        i.ip.as_deref().map(Box::from),
                        intern_opt(i.ip_mode.as_ref()),
                    )
                })
                .collect(),
        }
    }
}

impl CompactService {
    /// `namespace/name`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Its key: namespace and name, shared with it.
    pub fn key(&self) -> ObjectKey {
        (self.namespace.clone(), self.name.clone())
    }
}

/// An EndpointSlice as the model reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompactSlice {
    /// `metadata.namespace` (`default` when unset or empty).
    pub namespace: Arc<str>,
    pub name: Arc<str>,
    /// Its `kubernetes.io/service-name` label.
    pub service_name: Option<Arc<str>>,
    pub address_type: Arc<str>,
    /// Its `endpoints.kubernetes.io/last-change-trigger-time` annotation
    /// (the programming-latency metric's start).
    pub trigger_time: Option<Box<str>>,
    pub endpoints: Box<[CompactEndpoint]>,
    pub ports: Box<[CompactEndpointPort]>,
}

/// One of an EndpointSlice's `endpoints`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompactEndpoint {
    /// `addresses[0]`: the endpoint's address (kube-proxy reads no other).
    pub address: Option<Box<str>>,
    /// `conditions.ready`, `.serving`, `.terminating`.
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    pub node_name: Option<Arc<str>>,
    pub zone: Option<Arc<str>>,
    /// `hints`, when it names a zone or a node (most endpoints have none:
    /// a pointer, not two lists, each).
    pub hints: Option<Box<CompactHints>>,
}

/// An endpoint's `hints`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompactHints {
    /// `forZones[].name`.
    pub zones: Box<[Arc<str>]>,
    /// `forNodes[].name`.
    pub nodes: Box<[Arc<str>]>,
}

/// One of an EndpointSlice's `ports`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompactEndpointPort {
    pub name: Option<Arc<str>>,
    pub protocol: Option<Arc<str>>,
    pub port: Option<i32>,
}

impl CompactEndpoint {
    fn of(e: &Endpoint) -> Self {
        let c = e.conditions.as_ref();
        let hints = e.hints.as_ref();
        Self {
            address: e.addresses.first().map(|a| Box::from(a.as_str())),
            ready: c.and_then(|c| c.ready),
            serving: c.and_then(|c| c.serving),
            terminating: c.and_then(|c| c.terminating),
            node_name: intern_opt(e.node_name.as_ref()),
            zone: intern_opt(e.zone.as_ref()),
            hints: hints
                .map(|h| CompactHints {
                    zones: h
                        .for_zones
                        .iter()
                        .flatten()
                        .map(|z| intern(&z.name))
                        .collect(),
                    nodes: h
                        .for_nodes
                        .iter()
                        .flatten()
                        .map(|n| intern(&n.name))
                        .collect(),
                })
                .filter(|h| !h.zones.is_empty() || !h.nodes.is_empty())
                .map(Box::new),
        }
    }
}

impl CompactSlice {
    /// Its key: namespace and name, shared with it.
    pub fn key(&self) -> ObjectKey {
        (self.namespace.clone(), self.name.clone())
    }
}

impl From<&EndpointSlice> for CompactSlice {
    fn from(slice: &EndpointSlice) -> Self {
        let meta = &slice.metadata;
        Self {
            namespace: intern(namespace(meta)),
            name: Arc::from(name(meta)),
            service_name: meta
                .labels
                .as_ref()
                .and_then(|l| l.get(LABEL_SERVICE_NAME))
                .map(|s| Arc::from(s.as_str())),
            address_type: intern(&slice.address_type),
            trigger_time: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_LAST_CHANGE_TRIGGER_TIME))
                .map(|t| Box::from(t.as_str())),
            endpoints: slice.endpoints.iter().map(CompactEndpoint::of).collect(),
            ports: slice
                .ports
                .iter()
                .flatten()
                .map(|p| CompactEndpointPort {
                    name: intern_opt(p.name.as_ref()),
                    protocol: intern_opt(p.protocol.as_ref()),
                    port: p.port,
                })
                .collect(),
        }
    }
}

fn strings(list: &[Box<str>]) -> Option<Vec<String>> {
    (!list.is_empty()).then(|| list.iter().map(|s| s.to_string()).collect())
}

fn owned(s: &Option<Arc<str>>) -> Option<String> {
    s.as_deref().map(String::from)
}

/// The Service as an API object with what the model reads of it (a
/// snapshot of a source that keeps only the compact form): converted back,
/// it gives the same [`CompactService`].
impl From<&CompactService> for Service {
    fn from(c: &CompactService) -> Self {
        use k8s_openapi::api::core::v1::{
            ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, ServiceSpec, ServiceStatus,
            SessionAffinityConfig,
        };
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
        let mut labels = std::collections::BTreeMap::new();
        if c.headless_label {
            labels.insert(LABEL_HEADLESS.to_string(), String::new());
        }
        if let Some(p) = &c.service_proxy_name {
            labels.insert(LABEL_SERVICE_PROXY_NAME.to_string(), p.to_string());
        }
        let annotations = c
            .lb_algorithm
            .as_ref()
            .map(|a| [(ANNOTATION_LB_ALGORITHM.to_string(), a.to_string())].into());
        let spec = c.spec.as_deref().map(|s| ServiceSpec {
            type_: owned(&s.type_),
            cluster_ip: s.cluster_ip.as_deref().map(String::from),
            cluster_ips: strings(&s.cluster_ips),
            ip_families: (!s.ip_families.is_empty())
                .then(|| s.ip_families.iter().map(|f| f.to_string()).collect()),
            ip_family_policy: owned(&s.ip_family_policy),
            ports: (!s.ports.is_empty()).then(|| {
                s.ports
                    .iter()
                    .map(|p| ServicePort {
                        name: owned(&p.name),
                        protocol: owned(&p.protocol),
                        port: p.port,
                        node_port: p.node_port,
                        target_port: p.target_port.clone(),
                        app_protocol: owned(&p.app_protocol),
                    })
                    .collect()
            }),
            selector: (!s.selector.is_empty()).then(|| {
                s.selector
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            }),
            publish_not_ready_addresses: s.publish_not_ready_addresses,
            session_affinity: owned(&s.session_affinity),
            session_affinity_config: s.affinity_timeout_seconds.map(|t| SessionAffinityConfig {
                client_ip: Some(ClientIPConfig {
                    timeout_seconds: Some(t),
                }),
            }),
            external_ips: strings(&s.external_ips),
            load_balancer_source_ranges: strings(&s.load_balancer_source_ranges),
            external_traffic_policy: owned(&s.external_traffic_policy),
            internal_traffic_policy: owned(&s.internal_traffic_policy),
            health_check_node_port: s.health_check_node_port,
            allocate_load_balancer_node_ports: s.allocate_load_balancer_node_ports,
            ..ServiceSpec::default()
        });
        let status = (!c.lb_ingress.is_empty()).then(|| ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(
                    c.lb_ingress
                        .iter()
                        .map(|(ip, mode)| LoadBalancerIngress {
                            ip: ip.as_deref().map(String::from),
                            ip_mode: owned(mode),
                            ..LoadBalancerIngress::default()
                        })
                        .collect(),
                ),
            }),
            ..ServiceStatus::default()
        });
        Service {
            metadata: ObjectMeta {
                namespace: Some(c.namespace.to_string()),
                name: Some(c.name.to_string()),
                creation_timestamp: c.creation_timestamp.map(Time),
                labels: (!labels.is_empty()).then_some(labels),
                annotations,
                ..ObjectMeta::default()
            },
            spec,
            status,
        }
    }
}

/// The EndpointSlice as an API object with what the model reads of it
/// (see the Service's conversion).
impl From<&CompactSlice> for EndpointSlice {
    fn from(c: &CompactSlice) -> Self {
        use k8s_openapi::api::discovery::v1::{
            EndpointConditions, EndpointHints, EndpointPort, ForNode, ForZone,
        };
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        EndpointSlice {
            metadata: ObjectMeta {
                namespace: Some(c.namespace.to_string()),
                name: Some(c.name.to_string()),
                labels: c
                    .service_name
                    .as_ref()
                    .map(|s| [(LABEL_SERVICE_NAME.to_string(), s.to_string())].into()),
                annotations: c.trigger_time.as_ref().map(|t| {
                    [(
                        ANNOTATION_LAST_CHANGE_TRIGGER_TIME.to_string(),
                        t.to_string(),
                    )]
                    .into()
                }),
                ..ObjectMeta::default()
            },
            address_type: c.address_type.to_string(),
            endpoints: c
                .endpoints
                .iter()
                .map(|e| Endpoint {
                    addresses: e.address.iter().map(|a| a.to_string()).collect(),
                    conditions: Some(EndpointConditions {
                        ready: e.ready,
                        serving: e.serving,
                        terminating: e.terminating,
                    }),
                    node_name: owned(&e.node_name),
                    zone: owned(&e.zone),
                    hints: e.hints.as_deref().map(|h| EndpointHints {
                        for_zones: Some(
                            h.zones
                                .iter()
                                .map(|z| ForZone {
                                    name: z.to_string(),
                                })
                                .collect(),
                        ),
                        for_nodes: Some(
                            h.nodes
                                .iter()
                                .map(|n| ForNode {
                                    name: n.to_string(),
                                })
                                .collect(),
                        ),
                    }),
                    ..Endpoint::default()
                })
                .collect(),
            ports: (!c.ports.is_empty()).then(|| {
                c.ports
                    .iter()
                    .map(|p| EndpointPort {
                        name: owned(&p.name),
                        protocol: owned(&p.protocol),
                        port: p.port,
                        app_protocol: None,
                    })
                    .collect()
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field the model reads survives compact → API object →
    /// compact, so a snapshot of a compact store computes what the store
    /// does.
    #[test]
    fn a_compact_object_converted_back_and_again_is_the_same() {
        let svc: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop",
                "creationTimestamp": "2026-01-02T03:04:05Z",
                "labels": {"service.kubernetes.io/headless": "",
                           "service.kubernetes.io/service-proxy-name": "other", "app": "x"},
                "annotations": {ANNOTATION_LB_ALGORITHM: "maglev", "other": "y"}},
            "spec": {"type": "LoadBalancer", "clusterIP": "198.19.0.1",
                "clusterIPs": ["198.19.0.1", "2001:2::1"], "ipFamilies": ["IPv4", "IPv6"],
                "ipFamilyPolicy": "PreferDualStack",
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": "web",
                           "nodePort": 30080, "appProtocol": "http"},
                          {"port": 53, "protocol": "UDP", "targetPort": 5353}],
                "selector": {"app": "web", "tier": "front"}, "publishNotReadyAddresses": true,
                "sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
                "externalIPs": ["198.18.9.9"], "loadBalancerSourceRanges": ["198.18.0.0/16"],
                "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Cluster",
                "healthCheckNodePort": 31000, "allocateLoadBalancerNodePorts": false},
            "status": {"loadBalancer": {"ingress": [{"ip": "198.18.7.7", "ipMode": "Proxy"}, {"hostname": "lb"}]}}
        }))
        .unwrap();
        let c = CompactService::from(&svc);
        assert_eq!(CompactService::from(&Service::from(&c)), c);
        let bare = CompactService::from(&Service::default());
        assert_eq!(CompactService::from(&Service::from(&bare)), bare);

        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-abc", "namespace": "shop",
                "labels": {LABEL_SERVICE_NAME: "web"},
                "annotations": {ANNOTATION_LAST_CHANGE_TRIGGER_TIME: "2026-01-02T03:04:05Z"}},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["198.18.0.1", "198.18.0.2"], "conditions": {"ready": false, "terminating": true},
                 "nodeName": "n1", "zone": "z1",
                 "hints": {"forZones": [{"name": "z1"}], "forNodes": [{"name": "n1"}]}},
                {"addresses": []}
            ],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}, {"port": null}]
        }))
        .unwrap();
        let c = CompactSlice::from(&slice);
        assert_eq!(CompactSlice::from(&EndpointSlice::from(&c)), c);
    }
}

//! Services and EndpointSlices as the model keeps them: the fields it
//! reads, nothing else, with the strings many objects repeat (namespaces,
//! node names, zones, protocols, port names, types and policies) interned.
//!
//! A k8s-openapi `Service` is 824 bytes before any of its strings, an
//! `EndpointSlice` 432 bytes plus 352 per endpoint and a `BTreeMap` node for
//! its labels; the model holds one of each per Service for as long as the
//! Service exists. These forms are a fifth of that (issue 13: about 3 kB per
//! Service in all). A source converts an object once, when it reads it
//! ([`super::Object::service`], [`super::Object::endpoint_slice`]), and
//! keeps only the compact form too.
//!
//! Each field keeps the API's meaning, including "missing" where the model
//! tells it from a default (`Option`); a list the model reads the same
//! missing or empty is an empty slice.
use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use k8s_openapi::api::core::v1::{Service, ServicePort};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::lb::ANNOTATION_LB_ALGORITHM;
use super::services::{name, namespace};
use super::{LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME};
use crate::k8s::ANNOTATION_LAST_CHANGE_TRIGGER_TIME;

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
    pub(super) fn of(p: &ServicePort) -> Self {
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

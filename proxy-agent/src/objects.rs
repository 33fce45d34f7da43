//! The objects every part of the agent speaks of: what a source reads and
//! the model takes ([`Object`], [`Change`], [`Snapshot`]), their compact
//! forms ([`compact`]), their keys and names, and the labels and
//! annotations the agent reads on them.
//!
//! The bottom of the agent's dependencies: the sources (`manifests`, `k8s`)
//! produce these, the model consumes them, and this module imports neither
//! (`cargo xtask lint` checks it, and that the model imports no source).
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

pub mod compact;

pub use compact::{
    intern, CompactEndpoint, CompactEndpointPort, CompactHints, CompactService, CompactServicePort,
    CompactServiceSpec, CompactSlice,
};

/// Label on an EndpointSlice naming its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Label marking a Service headless (set by the control plane on some objects).
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label naming the proxy that must handle a Service.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";

/// The Service annotation choosing its algorithm.
pub const ANNOTATION_LB_ALGORITHM: &str = "proxy-agent.io/lb-algorithm";

/// The EndpointSlice annotation kept in the cache: when the change that the
/// slice reflects happened (network programming latency starts there).
pub const ANNOTATION_LAST_CHANGE_TRIGGER_TIME: &str =
    "endpoints.kubernetes.io/last-change-trigger-time";

/// An object's namespace (`default` when unset; empty for Nodes) and name,
/// shared with the object (a key costs no string of its own).
pub type ObjectKey = (Arc<str>, Arc<str>);

/// The kinds of object the model reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Service,
    EndpointSlice,
    Pod,
    Node,
}

impl Kind {
    /// The kind's name, as in manifests.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Pod => "Pod",
            Kind::Node => "Node",
        }
    }

    /// The kind `name` names, if the model reads it.
    pub fn from_name(name: &str) -> Option<Self> {
        [Kind::Service, Kind::EndpointSlice, Kind::Pod, Kind::Node]
            .into_iter()
            .find(|k| k.name() == name)
    }
}

/// An object as a source has it now. Services and EndpointSlices, which
/// grow with the cluster, in their compact forms ([`CompactService`],
/// [`CompactSlice`]), made once by the source that read them.
///
/// Shared: the model keeps the object a source hands it without a copy.
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    Service(Arc<CompactService>),
    EndpointSlice(Arc<CompactSlice>),
    Pod(Arc<Pod>),
    Node(Arc<Node>),
}

impl From<&Service> for Object {
    fn from(o: &Service) -> Self {
        Object::Service(Arc::new(o.into()))
    }
}

impl From<&EndpointSlice> for Object {
    fn from(o: &EndpointSlice) -> Self {
        Object::EndpointSlice(Arc::new(o.into()))
    }
}

impl From<Pod> for Object {
    fn from(o: Pod) -> Self {
        Object::Pod(Arc::new(o))
    }
}

impl From<Node> for Object {
    fn from(o: Node) -> Self {
        Object::Node(Arc::new(o))
    }
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self {
            Object::Service(_) => Kind::Service,
            Object::EndpointSlice(_) => Kind::EndpointSlice,
            Object::Pod(_) => Kind::Pod,
            Object::Node(_) => Kind::Node,
        }
    }

    /// Its key: namespace (defaulted; empty for a Node) and name.
    pub fn key(&self) -> ObjectKey {
        match self {
            Object::Service(o) => o.key(),
            Object::EndpointSlice(o) => o.key(),
            Object::Pod(o) => meta_key(&o.metadata),
            Object::Node(o) => ("".into(), name(&o.metadata).into()),
        }
    }
}

/// One change a source saw: an object created or updated (`Applied`), or
/// gone.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    Applied(Object),
    Deleted(Kind, ObjectKey),
}

/// A namespaced object's key.
pub fn meta_key(meta: &ObjectMeta) -> ObjectKey {
    (intern(namespace(meta)), name(meta).into())
}

/// Every object a source read, whole (the model's input computed from
/// scratch; the manifests source reads its files into one, in file order).
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    pub pods: Vec<Pod>,
    pub nodes: Vec<Node>,
}

/// An object's namespace: `default` when unset or empty.
pub fn namespace(meta: &ObjectMeta) -> &str {
    meta.namespace
        .as_deref()
        .filter(|ns| !ns.is_empty())
        .unwrap_or("default")
}

/// An object's name (empty when unset).
pub fn name(meta: &ObjectMeta) -> &str {
    meta.name.as_deref().unwrap_or("")
}

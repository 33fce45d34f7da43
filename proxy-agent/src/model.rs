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
//! The model is dual-stack, as kube-proxy's: a Service is served in each
//! family it has a ClusterIP of (`spec.clusterIPs`, `clusterIP` the primary;
//! [`IpFamily`]), and each family's frontends get only that family's
//! endpoints (EndpointSlices of that `addressType`), node addresses,
//! externalIPs, load-balancer IPs and source ranges. The writer programs
//! each family's frontends into that family's maps.
//!
//! Frontends built, per service port and family:
//!
//! - the ClusterIP of the family (scope [`SCOPE_INTERNAL`], `internalTrafficPolicy`);
//! - the north-south addresses: this node's addresses of the family at the
//!   port's `nodePort` (selected by [`ModelOptions::node_port_addresses`]),
//!   every `spec.externalIPs` entry and every VIP-mode
//!   `status.loadBalancer.ingress[].ip` at the service port. Each gets a [`SCOPE_EXTERNAL`] frontend (traffic arriving
//!   on the node's external devices, `externalTrafficPolicy`) and a
//!   [`SCOPE_INTERNAL`] one (traffic from this node's pods, short-circuited to
//!   the cluster list as kube-proxy does).
//!
//! Besides frontends, [`DesiredState`] carries what the datapath and the
//! health-check servers need about this node: its endpoints' addresses, its
//! SNAT address and the `healthCheckNodePort`s to serve.
//!
//! The steps live in submodules, one concern each; everything public is
//! re-exported here, so callers only ever name `model::X`:
//!
//! | module | concern |
//! |---|---|
//! | `state` | the output types ([`DesiredState`], [`Frontend`], [`HealthCheck`]), [`ModelWarning`], [`ModelOptions`], [`Gates`] |
//! | `services` | ignored Services (ExternalName, headless, another proxy's), object names, protocols |
//! | `pods` | EndpointSlices synthesized from Pods |
//! | `endpoints` | a service port's endpoints from its EndpointSlices |
//! | `topology` | [`categorize`]: kube-proxy's `CategorizeEndpoints` (traffic policies, topology hints) |
//! | `addresses` | [`NodePortAddresses`], externalIPs, load-balancer IPs, IPv4/CIDR parsing |
//! | `frontends` | a frontend's backends and flags, ownership conflicts between Services |
//! | `policy` | [`FrontendPolicy`]: addresses that may be frontends, who owns a contested frontend |
//! | `lb` | [`LbAlgorithm`]: each frontend's algorithm (annotation, node default), [`maglev_table`] |
//! | `health_checks` | the `healthCheckNodePort`s this node serves |
//! | `pipeline` | the per-Service step: the steps above for one Service and this node |
//! | `incremental` | [`Incremental`]: every Service's step, kept up to date object by object; who owns a contested frontend; [`desired_state_with`] |
#[cfg(doc)]
use crate::objects::Snapshot;
#[cfg(doc)]
use proxy_common::{SCOPE_EXTERNAL, SCOPE_INTERNAL};

mod addresses;
mod endpoints;
mod frontends;
mod health_checks;
mod incremental;
mod lb;
mod pipeline;
mod pods;
mod policy;
mod services;
mod state;
mod topology;

pub(crate) use addresses::mask;
pub use addresses::NodePortAddresses;
pub use incremental::{Incremental, Update};
pub use lb::{is_prime, maglev_table, LbAlgorithm};
pub use pipeline::{desired_state, desired_state_with};
pub use pods::endpoint_slices_from_pods;
pub use policy::{forbidden_address, FrontendPolicy, DEFAULT_MAX_FRONTENDS_PER_SERVICE};
pub use state::{
    proto_name, BackendAddr, DesiredState, Frontend, FrontendKey, Gates, HealthCheck, IpFamily,
    ModelOptions, ModelWarning, ServiceAge,
};
// The objects the model reads, under the names its callers have used.
pub use crate::objects::{
    intern, Change, CompactEndpoint, CompactEndpointPort, CompactHints, CompactService,
    CompactServicePort, CompactServiceSpec, CompactSlice, Kind, Object, ObjectKey,
    ANNOTATION_LB_ALGORITHM, LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME,
};
pub use topology::{
    categorize, Categorized, EndpointInfo, NodeTopology, ServicePortInfo, TrafficPolicy,
};

/// Node label naming the node's zone (`v1.LabelTopologyZone`).
pub const LABEL_TOPOLOGY_ZONE: &str = "topology.kubernetes.io/zone";
/// Default ClientIP session-affinity timeout (kube-proxy / API default), seconds.
pub const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;
/// Node address type whose IPv4 addresses are the node's NodePort addresses
/// and SNAT source.
pub const NODE_ADDRESS_INTERNAL_IP: &str = "InternalIP";

//! Endpoint categorization: which endpoints of a service port a frontend
//! uses from this node, by traffic policy, topology hints and the
//! terminating fallback (kube-proxy `pkg/proxy/topology.go`
//! `CategorizeEndpoints`, and the service-port view it needs).
use k8s_openapi::api::core::v1::{Service, ServicePort};

use crate::objects::compact::{CompactService, CompactServicePort};

use super::addresses::parse_ip;
use super::{BackendAddr, Gates, IpFamily, LABEL_TOPOLOGY_ZONE};
use crate::objects::Snapshot;

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
    /// The port has a nodePort, or the Service an externalIP or a VIP-mode
    /// load-balancer ingress IP of the family concerned
    /// (`ExternallyAccessible`).
    pub externally_accessible: bool,
}

impl ServicePortInfo {
    /// The port of `svc` as kube-proxy's IPv4 proxier sees it
    /// (`newBaseServiceInfo`): `externalIPs` and load-balancer ingress IPs of
    /// the other family do not count; a load-balancer IP counts only in
    /// `VIP` mode (`ipMode` missing or `"VIP"`, `proxyutil.IsVIPMode`).
    pub fn from_service(svc: &Service, port: &ServicePort) -> Self {
        Self::for_family(
            &CompactService::from(svc),
            &CompactServicePort::of(port),
            IpFamily::V4,
        )
    }

    /// The port of `svc` as kube-proxy's proxier of `family` sees it:
    /// `externalIPs` and load-balancer ingress IPs of the other family do
    /// not count.
    pub(super) fn for_family(
        svc: &CompactService,
        port: &CompactServicePort,
        family: IpFamily,
    ) -> Self {
        let spec = svc.spec.as_deref();
        let of_family = |ip: &str| parse_ip(ip).is_some_and(|a| IpFamily::of(a) == family);
        let node_port = port.node_port.is_some_and(|p| p != 0);
        let external_ip = spec.is_some_and(|s| s.external_ips.iter().any(|ip| of_family(ip)));
        let lb_vip = svc.lb_ingress.iter().any(|(ip, mode)| {
            ip.as_deref().is_some_and(of_family) && mode.as_deref().is_none_or(|m| m == "VIP")
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
pub(super) fn select(
    endpoints: &[EndpointInfo],
    keep: impl Fn(&EndpointInfo) -> bool,
) -> Vec<BackendAddr> {
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

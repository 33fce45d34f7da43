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
//! Frontends built, per IPv4 service port:
//!
//! - every IPv4 ClusterIP (scope [`SCOPE_INTERNAL`], `internalTrafficPolicy`);
//! - the north-south addresses: this node's addresses at the port's
//!   `nodePort` (selected by [`ModelOptions::node_port_addresses`]), every
//!   IPv4 `spec.externalIPs` entry and every IPv4 VIP-mode
//!   `status.loadBalancer.ingress[].ip` at the service port. Each gets a [`SCOPE_EXTERNAL`] frontend (traffic arriving
//!   on the node's external devices, `externalTrafficPolicy`) and a
//!   [`SCOPE_INTERNAL`] one (traffic from this node's pods, short-circuited to
//!   the cluster list as kube-proxy does).
//!
//! Besides frontends, [`DesiredState`] carries what the datapath and the
//! health-check servers need about this node: its endpoints' addresses, its
//! SNAT address and the `healthCheckNodePort`s to serve.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use k8s_openapi::api::core::v1::{Node, Pod, Service, ServicePort};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use proxy_common::{svc_flags, IPPROTO_TCP, IPPROTO_UDP, SCOPE_EXTERNAL, SCOPE_INTERNAL};

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
/// Node address type whose IPv4 addresses are the node's NodePort addresses
/// and SNAT source.
pub const NODE_ADDRESS_INTERNAL_IP: &str = "InternalIP";

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
    /// Endpoints of this service port still listed but not in `backends`
    /// (terminating, not ready, or filtered out by topology or a Local
    /// policy): kept in the backends map, without a slot, so that flows
    /// already using them keep working until they end (field bug C5; as
    /// kube-proxy, whose conntrack keeps established TCP connections to an
    /// endpoint that turned unready). An endpoint removed from the slices is
    /// not retained: its flows move on (UDP) or are reset (TCP). Sorted,
    /// without duplicates, disjoint from `backends`.
    pub retained: Vec<BackendAddr>,
    /// [`proxy_common::svc_flags`] bits: [`svc_flags::DROP_NO_BACKEND`] when
    /// `backends` is empty but usable endpoints exist elsewhere in the
    /// cluster (drop, as kube-proxy does, instead of rejecting);
    /// [`svc_flags::EXTERNAL_LOCAL`] on external frontends of an
    /// `externalTrafficPolicy: Local` port (client address preserved);
    /// [`svc_flags::SOURCE_RANGES`] when `source_ranges` applies.
    pub flags: u16,
    /// ClientIP session-affinity timeout in seconds; 0 = none.
    pub affinity_timeout_s: u32,
    /// The IPv4 `spec.loadBalancerSourceRanges` as (network address, prefix
    /// length), sorted, without duplicates. Set, with
    /// [`svc_flags::SOURCE_RANGES`], on external load-balancer-IP frontends
    /// only: kube-proxy applies the ranges to load-balancer IPs, not to
    /// NodePorts or externalIPs. Empty elsewhere.
    pub source_ranges: Vec<(Ipv4Addr, u8)>,
}

/// A `healthCheckNodePort` this node serves (kube-proxy
/// `pkg/proxy/healthcheck` service health server): `/healthz` answers 200
/// when `local_endpoints > 0`, 503 otherwise.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HealthCheck {
    /// The Service, `namespace/name`.
    pub service: String,
    /// Distinct addresses of the Service's local READY endpoints over all of
    /// its ports (kube-proxy `EndpointsMap.LocalReadyEndpoints`). Terminating
    /// local endpoints do not count, although they still carry traffic when
    /// nothing local is ready: the load balancer must move away from a node
    /// whose endpoints are shutting down.
    pub local_endpoints: usize,
}

/// Every frontend this node should program, and what else the datapath and
/// the health-check servers need to know about this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    pub frontends: BTreeMap<FrontendKey, Frontend>,
    /// The address of every endpoint whose `nodeName` is this node, over all
    /// IPv4 EndpointSlices (real and synthesized from Pods). The writer marks
    /// backends with these addresses local: the datapath SNATs external
    /// traffic only towards non-local backends.
    pub local_endpoints: BTreeSet<Ipv4Addr>,
    /// This node's first IPv4 `InternalIP` (from its Node object): the
    /// datapath's SNAT source. `None` without a Node object or address.
    pub node_addr: Option<Ipv4Addr>,
    /// `healthCheckNodePort` → what it reports, for every `type:
    /// LoadBalancer` Service with `externalTrafficPolicy: Local` and a
    /// `healthCheckNodePort` (kube-proxy `apiservice.NeedsHealthCheck`).
    pub health_checks: BTreeMap<u16, HealthCheck>,
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
    /// kube-proxy's `nodePortAddresses`: which of this node's addresses
    /// NodePorts are served on. See [`NodePortAddresses`].
    pub node_port_addresses: Vec<NodePortAddresses>,
    /// The Service each frontend is programmed for now (`namespace/name`):
    /// when two Services claim one frontend, its current owner keeps it.
    pub current_owners: BTreeMap<FrontendKey, String>,
}

/// One entry of kube-proxy's `--nodeport-addresses` / `nodePortAddresses`.
///
/// The candidate addresses are this node's IPv4 `InternalIP` addresses from
/// its Node object's `status.addresses` (kube-proxy matches the addresses of
/// the host's interfaces instead). A list:
///
/// - empty (the default): every candidate. kube-proxy's default is every
///   local address (`0.0.0.0/0`; `primary` in nftables mode), which amounts to
///   the same on a cluster whose nodes have one `InternalIP` (NodePorts on
///   other interface addresses, e.g. a second NIC or a bridge, are not
///   served here);
/// - otherwise the union of what the entries select; a list holding only
///   IPv6 CIDRs selects every candidate, as kube-proxy's IPv4 proxier falls
///   back to `0.0.0.0/0` when no CIDR of its family is given
///   (`proxyutil.NewNodePortAddresses`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodePortAddresses {
    /// An IPv4 CIDR (network address, prefix length): the candidates in it.
    Cidr(Ipv4Addr, u8),
    /// `primary`: the node's first `InternalIP` (kube-proxy: the node's
    /// primary IP of the family, as `/32`).
    Primary,
    /// An IPv6 CIDR: accepted, selects nothing for this IPv4 proxier.
    Ipv6Cidr,
}

impl NodePortAddresses {
    /// `"primary"`, or a CIDR (IPv4, or IPv6 which selects nothing). Host
    /// bits are cleared (`198.18.0.7/24` is `198.18.0.0/24`), as Go's
    /// `ParseCIDR` does; leading zeros are decimal, as in kube-proxy's
    /// `ParseCIDRSloppy`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "primary" {
            return Ok(Self::Primary);
        }
        match parse_cidr(s)? {
            Some((addr, prefix)) => Ok(Self::Cidr(addr, prefix)),
            None => Ok(Self::Ipv6Cidr),
        }
    }

    /// The addresses of `internal_ips` (the node's IPv4 `InternalIP`s, in
    /// order) this entry selects.
    fn select(&self, internal_ips: &[Ipv4Addr]) -> Vec<Ipv4Addr> {
        match *self {
            Self::Cidr(net, prefix) => internal_ips
                .iter()
                .copied()
                .filter(|ip| in_cidr(*ip, net, prefix))
                .collect(),
            Self::Primary => internal_ips.first().copied().into_iter().collect(),
            Self::Ipv6Cidr => Vec::new(),
        }
    }
}

impl FromStr for NodePortAddresses {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse(s)
    }
}

impl fmt::Display for NodePortAddresses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cidr(addr, prefix) => write!(f, "{addr}/{prefix}"),
            Self::Primary => f.write_str("primary"),
            Self::Ipv6Cidr => f.write_str("(IPv6 CIDR)"),
        }
    }
}

/// The addresses NodePorts are served on: `internal_ips` filtered by
/// `entries` (see [`NodePortAddresses`]). Sorted, without duplicates.
fn node_port_addresses(internal_ips: &[Ipv4Addr], entries: &[NodePortAddresses]) -> Vec<Ipv4Addr> {
    let mut out: Vec<Ipv4Addr> = if entries
        .iter()
        .all(|e| matches!(e, NodePortAddresses::Ipv6Cidr))
    {
        internal_ips.to_vec()
    } else {
        entries
            .iter()
            .flat_map(|e| e.select(internal_ips))
            .collect()
    };
    out.sort();
    out.dedup();
    out
}

/// `addr` with the bits past `prefix` cleared.
fn mask(addr: Ipv4Addr, prefix: u8) -> Ipv4Addr {
    let bits = u32::from(addr);
    let m = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix.min(32)))
    };
    Ipv4Addr::from(bits & m)
}

fn in_cidr(ip: Ipv4Addr, net: Ipv4Addr, prefix: u8) -> bool {
    mask(ip, prefix) == mask(net, prefix)
}

/// An IPv4 address as Go's `netutils.ParseIPSloppy` reads it (what the API
/// server validates Service addresses with): four decimal parts, leading
/// zeros allowed and decimal.
fn parse_ipv4(s: &str) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = s.split('.');
    for o in &mut octets {
        let part = parts.next()?;
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let digits = part.trim_start_matches('0');
        *o = if digits.is_empty() {
            0
        } else if digits.len() > 3 {
            return None;
        } else {
            digits.parse().ok()?
        };
    }
    parts.next().is_none().then(|| Ipv4Addr::from(octets))
}

/// A CIDR as `netutils.ParseCIDRSloppy` reads it: `Some((network, prefix))`
/// for IPv4 (host bits cleared), `None` for a valid IPv6 CIDR.
fn parse_cidr(s: &str) -> Result<Option<(Ipv4Addr, u8)>, String> {
    let (addr, prefix) = s
        .split_once('/')
        .ok_or_else(|| format!("{s:?} is not a CIDR (expected e.g. 198.18.0.0/15)"))?;
    let prefix_ok = !prefix.is_empty() && prefix.bytes().all(|b| b.is_ascii_digit());
    if let Some(ip) = parse_ipv4(addr) {
        let p = prefix
            .parse::<u8>()
            .ok()
            .filter(|p| prefix_ok && *p <= 32)
            .ok_or_else(|| format!("{s:?}: prefix length must be 0..=32"))?;
        return Ok(Some((mask(ip, p), p)));
    }
    if addr.parse::<Ipv6Addr>().is_ok() {
        return match prefix.parse::<u8>() {
            Ok(p) if prefix_ok && p <= 128 => Ok(None),
            _ => Err(format!("{s:?}: prefix length must be 0..=128")),
        };
    }
    Err(format!("{s:?}: {addr:?} is not an IP address"))
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
        let is_v4 = |ip: &str| parse_ipv4(ip).is_some();
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
///
/// Services are taken in `namespace/name` order and, within a Service, port by
/// port: its ClusterIP frontends, then its north-south ones. When two
/// Services claim the same frontend the first keeps it and a warning names
/// the other; within one Service the first claim wins silently (kube-proxy's
/// rule order: clusterIP, externalIPs, then load-balancer IPs).
pub fn desired_state_with(
    snapshot: &Snapshot,
    node_name: &str,
    opts: &ModelOptions,
) -> (DesiredState, Vec<ModelWarning>) {
    let mut warnings = Vec::new();
    let mut desired = DesiredState::default();
    let node = NodeTopology::from_snapshot(snapshot, node_name);

    // A Pod address that is no IP at all would be skipped silently below.
    for pod in &snapshot.pods {
        let Some(status) = pod.status.as_ref() else {
            continue;
        };
        let ips = status
            .pod_ip
            .iter()
            .chain(status.pod_ips.iter().flatten().map(|p| &p.ip));
        for ip in ips.filter(|ip| !ip.is_empty() && ip.parse::<std::net::IpAddr>().is_err()) {
            warnings.push(ModelWarning {
                object: format!("Pod {}/{}", namespace(&pod.metadata), name(&pod.metadata)),
                message: format!("invalid pod IP {ip:?}; the pod is not an endpoint"),
            });
        }
    }

    // This node's addresses: the SNAT source and the NodePort addresses.
    let node_object = snapshot
        .nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(node_name));
    let internal_ips = node_object.map(node_internal_ips).unwrap_or_default();
    desired.node_addr = internal_ips.first().copied();
    let node_port_addrs = node_port_addresses(&internal_ips, &opts.node_port_addresses);
    // Why no NodePort can be served; reported once, when some port has one.
    let mut node_problem = match node_object {
        None => Some("no Node object for this node"),
        Some(_) if internal_ips.is_empty() => Some("the Node has no IPv4 InternalIP address"),
        Some(_) => None,
    };

    // Every slice, real and synthesized, indexed by (namespace, service name),
    // sorted by slice name so that duplicates resolve deterministically.
    let synthesized = endpoint_slices_from_pods(snapshot);
    let all_slices = || {
        snapshot
            .endpoint_slices
            .iter()
            .chain(synthesized.iter())
            // An IPv4 proxier ignores slices of the other family (and FQDN ones).
            .filter(|s| s.address_type == "IPv4")
    };
    desired.local_endpoints = local_endpoint_addresses(all_slices(), node_name);
    let mut slices: BTreeMap<(&str, &str), Vec<&EndpointSlice>> = BTreeMap::new();
    for slice in all_slices() {
        let Some(svc) = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_SERVICE_NAME))
        else {
            continue;
        };
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
        let external = external_addresses(svc, &object, &mut warnings);
        let external_policy = TrafficPolicy::parse(spec.external_traffic_policy.as_deref());
        // Local READY endpoints' addresses over all ports, for the health check.
        let mut local_ready: BTreeSet<Ipv4Addr> = BTreeSet::new();

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
            local_ready.extend(
                endpoints
                    .iter()
                    .filter(|e| e.ready && e.is_local(node_name))
                    .map(|e| e.addr.addr),
            );
            let info = ServicePortInfo::from_service(svc, port);
            let categorized = categorize(&info, &endpoints, &node, &opts.gates);
            let base = Frontend {
                service: id.clone(),
                port_name: port_name.clone(),
                affinity_timeout_s,
                ..Frontend::default()
            };
            // The port's nodePort, if any (0 = none).
            let node_port = port
                .node_port
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0);
            if let (Some(p), Some(why)) = (node_port, node_problem.take()) {
                warnings.push(ModelWarning {
                    object: format!("Node {node_name}"),
                    message: format!(
                        "{why}: no NodePort frontends on this node (first: {id} port {p})"
                    ),
                });
            }
            let mut claim = |key: FrontendKey, fe: Frontend| {
                insert_frontend(
                    &mut desired.frontends,
                    &mut warnings,
                    &object,
                    key,
                    fe,
                    &opts.current_owners,
                );
            };

            // ClusterIP: internalTrafficPolicy.
            let internal_list = match info.internal_traffic_policy {
                TrafficPolicy::Cluster => &categorized.cluster,
                TrafficPolicy::Local => &categorized.local,
            };
            let internal = with_backends(&base, internal_list, &categorized, &endpoints);
            for ip in &cluster_ips {
                claim(
                    frontend_key(*ip, svc_port, proto, SCOPE_INTERNAL),
                    internal.clone(),
                );
            }

            // North-south: (address, port, is a load-balancer IP).
            let targets: Vec<(Ipv4Addr, u16, bool)> = node_port
                .into_iter()
                .flat_map(|p| node_port_addrs.iter().map(move |a| (*a, p, false)))
                .chain(external.external_ips.iter().map(|a| (*a, svc_port, false)))
                .chain(external.lb_ips.iter().map(|a| (*a, svc_port, true)))
                .collect();
            if targets.is_empty() {
                continue;
            }
            // From outside: externalTrafficPolicy (`Local` only matters on an
            // externally accessible port, which this one is).
            let external_list = match external_policy {
                TrafficPolicy::Cluster => &categorized.cluster,
                TrafficPolicy::Local => &categorized.local,
            };
            let mut outside = with_backends(&base, external_list, &categorized, &endpoints);
            if external_policy == TrafficPolicy::Local {
                outside.flags |= svc_flags::EXTERNAL_LOCAL;
            }
            // From this node's pods: short-circuited to the cluster list
            // (kube-proxy's external-traffic chain sends traffic that starts
            // inside the cluster to the cluster endpoints whatever the
            // externalTrafficPolicy: E4, S42). No source ranges here, as the
            // datapath filters external traffic only; note that kube-proxy's
            // firewall chain also filters pods' traffic to a load-balancer IP.
            let short_circuit =
                with_backends(&base, &categorized.cluster, &categorized, &endpoints);
            for (addr, port, is_lb) in targets {
                let mut fe = outside.clone();
                if is_lb && !external.source_ranges.is_empty() {
                    fe.flags |= svc_flags::SOURCE_RANGES;
                    fe.source_ranges = external.source_ranges.clone();
                }
                claim(frontend_key(addr, port, proto, SCOPE_EXTERNAL), fe);
                claim(
                    frontend_key(addr, port, proto, SCOPE_INTERNAL),
                    short_circuit.clone(),
                );
            }
        }

        // kube-proxy `apiservice.NeedsHealthCheck`: type LoadBalancer with
        // externalTrafficPolicy Local (the API server allocates the port).
        let health_check_port = spec
            .health_check_node_port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0);
        if let (Some(hc_port), Some("LoadBalancer"), TrafficPolicy::Local) =
            (health_check_port, spec.type_.as_deref(), external_policy)
        {
            match desired.health_checks.get(&hc_port) {
                Some(existing) => warnings.push(ModelWarning {
                    object: object.clone(),
                    message: format!(
                        "healthCheckNodePort {hc_port} already belongs to service {}; skipped",
                        existing.service
                    ),
                }),
                None => {
                    desired.health_checks.insert(
                        hc_port,
                        HealthCheck {
                            service: id.clone(),
                            local_endpoints: local_ready.len(),
                        },
                    );
                }
            }
        }
    }
    (desired, warnings)
}

fn frontend_key(addr: Ipv4Addr, port: u16, proto: u8, scope: u8) -> FrontendKey {
    FrontendKey {
        addr,
        port,
        proto,
        scope,
    }
}

/// Claims `key` for `fe`, unless already claimed: silently when by the same
/// Service (its first claim wins), with a warning when by another. Between two
/// Services, the one that owns the frontend now (`current_owners`) keeps it —
/// an API server would have refused the newcomer's address — else the first
/// by namespace/name.
fn insert_frontend(
    frontends: &mut BTreeMap<FrontendKey, Frontend>,
    warnings: &mut Vec<ModelWarning>,
    object: &str,
    key: FrontendKey,
    fe: Frontend,
    current_owners: &BTreeMap<FrontendKey, String>,
) {
    match frontends.get(&key) {
        None => {
            frontends.insert(key, fe);
        }
        Some(existing) if existing.service == fe.service => {}
        Some(existing) if current_owners.get(&key) == Some(&fe.service) => {
            warnings.push(ModelWarning {
                object: format!("Service {}", existing.service),
                message: format!(
                    "frontend {key} already belongs to service {}; skipped",
                    fe.service
                ),
            });
            frontends.insert(key, fe);
        }
        Some(existing) => warnings.push(ModelWarning {
            object: object.to_string(),
            message: format!(
                "frontend {key} already belongs to service {}; skipped",
                existing.service
            ),
        }),
    }
}

/// `base` with the backends of `list` (a [`Categorized`] list; `None`, not
/// used, is empty) and their retained terminating endpoints. An empty list
/// while usable endpoints exist elsewhere sets [`svc_flags::DROP_NO_BACKEND`]
/// (kube-proxy drops: "has no local endpoints"); with no usable endpoint
/// anywhere the flags stay 0 and the datapath rejects.
fn with_backends(
    base: &Frontend,
    list: &Option<Vec<BackendAddr>>,
    categorized: &Categorized,
    endpoints: &[EndpointInfo],
) -> Frontend {
    let backends = list.clone().unwrap_or_default();
    let flags = if backends.is_empty() && categorized.has_any_endpoints {
        svc_flags::DROP_NO_BACKEND
    } else {
        0
    };
    Frontend {
        retained: retained_backends(endpoints, &backends),
        backends,
        flags: base.flags | flags,
        ..base.clone()
    }
}

/// A Service's north-south addresses as kube-proxy's IPv4 proxier takes them
/// (`newBaseServiceInfo`), each list sorted, without duplicates.
#[derive(Debug, Default)]
struct ExternalAddresses {
    /// IPv4 `spec.externalIPs`, captured whether or not an interface owns
    /// them (S11).
    external_ips: Vec<Ipv4Addr>,
    /// IPv4 `status.loadBalancer.ingress[].ip` in VIP mode (`ipMode` missing
    /// or `VIP`, `proxyutil.IsVIPMode`); `Proxy`-mode IPs are left to the load
    /// balancer, which sends to the NodePort.
    lb_ips: Vec<Ipv4Addr>,
    /// IPv4 `spec.loadBalancerSourceRanges` (`proxyutil.MapCIDRsByIPFamily`:
    /// trimmed, empty entries ignored, invalid ones ignored with a warning,
    /// host bits cleared). With none of this family, no filtering.
    source_ranges: Vec<(Ipv4Addr, u8)>,
}

/// [`ExternalAddresses`] of `svc`; invalid entries yield warnings on `object`.
/// Entries of the other family are skipped (kube-proxy: logged at V(4)).
fn external_addresses(
    svc: &Service,
    object: &str,
    warnings: &mut Vec<ModelWarning>,
) -> ExternalAddresses {
    let mut out = ExternalAddresses::default();
    let mut warn = |message: String| {
        warnings.push(ModelWarning {
            object: object.to_string(),
            message,
        });
    };
    let is_v6 = |s: &str| s.parse::<Ipv6Addr>().is_ok();
    let spec = svc.spec.as_ref();
    for s in spec
        .and_then(|s| s.external_ips.as_ref())
        .into_iter()
        .flatten()
    {
        match parse_ipv4(s) {
            Some(ip) => out.external_ips.push(ip),
            None if s.trim().is_empty() || is_v6(s) => {}
            None => warn(format!("invalid externalIP {s:?}; ignored")),
        }
    }
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for i in ingress.into_iter().flatten() {
        let Some(s) = i.ip.as_deref().filter(|s| !s.is_empty()) else {
            continue;
        };
        if i.ip_mode.as_deref().is_some_and(|m| m != "VIP") {
            continue;
        }
        match parse_ipv4(s) {
            Some(ip) => out.lb_ips.push(ip),
            None if is_v6(s) => {}
            None => warn(format!("invalid load-balancer ingress IP {s:?}; ignored")),
        }
    }
    let ranges = spec.and_then(|s| s.load_balancer_source_ranges.as_ref());
    for s in ranges.into_iter().flatten().map(|s| s.trim()) {
        if s.is_empty() {
            continue;
        }
        match parse_cidr(s) {
            Ok(Some(cidr)) => out.source_ranges.push(cidr),
            Ok(None) => {}
            Err(e) => warn(format!(
                "invalid loadBalancerSourceRanges entry: {e}; ignored"
            )),
        }
    }
    for list in [&mut out.external_ips, &mut out.lb_ips] {
        list.sort();
        list.dedup();
    }
    out.source_ranges.sort();
    out.source_ranges.dedup();
    out
}

/// The node's IPv4 `InternalIP` addresses, in `status.addresses` order,
/// without duplicates.
fn node_internal_ips(node: &Node) -> Vec<Ipv4Addr> {
    let mut out: Vec<Ipv4Addr> = Vec::new();
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    for a in addresses.into_iter().flatten() {
        if a.type_ != NODE_ADDRESS_INTERNAL_IP {
            continue;
        }
        if let Some(ip) = parse_ipv4(&a.address) {
            if !out.contains(&ip) {
                out.push(ip);
            }
        }
    }
    out
}

/// The addresses (first address of each endpoint, as kube-proxy) of the
/// endpoints of `slices` whose `nodeName` is `node_name`.
fn local_endpoint_addresses<'a>(
    slices: impl Iterator<Item = &'a EndpointSlice>,
    node_name: &str,
) -> BTreeSet<Ipv4Addr> {
    slices
        .flat_map(|s| s.endpoints.iter())
        .filter(|e| e.node_name.as_deref() == Some(node_name))
        .filter_map(|e| e.addresses.first()?.parse::<Ipv4Addr>().ok())
        .collect()
}

/// The listed endpoints not in `backends` (field bug C5: "Keep terminating
/// backends in the backend map with a flag (excluded from selection, valid
/// for existing flows)"; the same holds for endpoints that turned unready, as
/// kube-proxy's conntrack keeps their established connections). Sorted,
/// deduplicated.
fn retained_backends(endpoints: &[EndpointInfo], backends: &[BackendAddr]) -> Vec<BackendAddr> {
    select(endpoints, |e| !backends.contains(&e.addr))
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
        let slice_id = format!("{}/{}", namespace(&slice.metadata), name(&slice.metadata));
        let Some(backend_port) = slice_port
            .port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
        else {
            // kube-proxy skips such a port too; say so, once per slice.
            if reported.insert((slice_id.clone(), "port".to_string())) {
                warnings.push(ModelWarning {
                    object: format!("EndpointSlice {slice_id}"),
                    message: format!(
                        "port {:?} has no usable port number ({:?}); its endpoints are not used",
                        slice_port.name.as_deref().unwrap_or(""),
                        slice_port.port
                    ),
                });
            }
            continue;
        };
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

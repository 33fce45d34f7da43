//! The desired state the model produces ([`DesiredState`]: frontends,
//! backends, health checks), the warnings it reports and its options.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

#[cfg(doc)]
use proxy_common::svc_flags;
use proxy_common::{IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL};

use super::NodePortAddresses;

/// A frontend: what a packet's destination is matched against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendKey {
    /// Either family: the model is dual-stack (see [`FrontendKey::family`]).
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
}

impl FrontendKey {
    /// The family of its address.
    pub fn family(&self) -> IpFamily {
        IpFamily::of(self.addr)
    }
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
            "{}/{} ({scope})",
            std::net::SocketAddr::new(self.addr, self.port),
            proto_name(self.proto)
        )
    }
}

/// A backend: where a packet is translated to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendAddr {
    /// Of the family of the frontends naming it: the model never mixes
    /// families (an IPv4 frontend gets only IPv4 endpoints).
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            std::net::SocketAddr::new(self.addr, self.port),
            proto_name(self.proto)
        )
    }
}

/// An address family, as Kubernetes names them (`ipFamilies`, an
/// EndpointSlice's `addressType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    /// Both, IPv4 first.
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    /// The family of `ip`.
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }

    /// `IPv4` or `IPv6`.
    pub fn name(self) -> &'static str {
        match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        }
    }

    /// The family Kubernetes names `name` (`IPv4`, `IPv6`), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// 0 for IPv4, 1 for IPv6: an index into per-family arrays.
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `TCP`, `UDP`, `SCTP` or the protocol number.
pub fn proto_name(proto: u8) -> String {
    match proto {
        IPPROTO_TCP => "TCP".into(),
        IPPROTO_UDP => "UDP".into(),
        IPPROTO_SCTP => "SCTP".into(),
        n => n.to_string(),
    }
}

/// What a frontend should do.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frontend {
    /// The Service, `namespace/name` (one copy shared by its frontends).
    pub service: Arc<str>,
    /// The service port's name (empty when unnamed; interned).
    pub port_name: Arc<str>,
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
    /// [`svc_flags::SOURCE_RANGES`] when `source_ranges` applies; the
    /// load-balancing algorithm in [`svc_flags::ALG_MASK`], and
    /// [`svc_flags::HANDOFF`] on Maglev load-balancer IPs and externalIPs of
    /// an `externalTrafficPolicy: Cluster` port.
    pub flags: u16,
    /// ClientIP session-affinity timeout in seconds; 0 = none.
    pub affinity_timeout_s: u32,
    /// The `spec.loadBalancerSourceRanges` of the frontend's family as
    /// (network address, prefix length), sorted, without duplicates (with
    /// none of its family, no filtering, as kube-proxy's per-family proxier). Set, with
    /// [`svc_flags::SOURCE_RANGES`], on external load-balancer-IP frontends
    /// only: kube-proxy applies the ranges to load-balancer IPs, not to
    /// NodePorts or externalIPs. Empty elsewhere.
    pub source_ranges: Vec<(IpAddr, u8)>,
    /// Internal-scope UDP NodePort, externalIP and load-balancer-IP
    /// frontends (and localhost NodePorts): the Service's ClusterIP frontend
    /// of the same family, port and protocol, when it balances over the
    /// same backends. A host client's UDP to this frontend is aimed at that
    /// ClusterIP by the socket hooks and translated per packet there
    /// ([`proxy_common::SvcValue::host_alias`]), so its socket keeps working
    /// when a backend goes. `None` elsewhere.
    pub host_alias: Option<FrontendKey>,
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
    /// IPv4 and IPv6 EndpointSlices (real and synthesized from Pods). The writer marks
    /// backends with these addresses local: the datapath SNATs external
    /// traffic only towards non-local backends.
    pub local_endpoints: BTreeSet<IpAddr>,
    /// This node's first IPv4 `InternalIP` (from its Node object): the
    /// datapath's SNAT source. `None` without a Node object or address.
    pub node_addr: Option<Ipv4Addr>,
    /// This node's first IPv6 `InternalIP`: the SNAT source of IPv6
    /// traffic. `None` without one.
    pub node_addr6: Option<Ipv6Addr>,
    /// `healthCheckNodePort` → what it reports, for every `type:
    /// LoadBalancer` Service with `externalTrafficPolicy: Local` and a
    /// `healthCheckNodePort` (kube-proxy `apiservice.NeedsHealthCheck`).
    pub health_checks: BTreeMap<u16, HealthCheck>,
    /// Every Service (`namespace/name`) → its age, which places it in the
    /// order in which the writer serves frontends when capacity runs out
    /// (reverse-NAT and backend ids, map entries, Maglev tables): the oldest
    /// first (`creationTimestamp`; one without comes after every one with),
    /// then `namespace/name`, the rule frontend ownership uses. A Service
    /// created now is served after every older one, whatever its addresses
    /// and however many frontends it has, so it can never take what an older
    /// Service needs. The writer serves a Service missing here last. An age,
    /// not a position: a Service added or removed changes its own entry only.
    pub service_order: BTreeMap<String, ServiceAge>,
}

/// A Service's `creationTimestamp`, ordered for capacity: older first, one
/// without a timestamp after every one with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ServiceAge(pub Option<jiff::Timestamp>);

impl ServiceAge {
    /// Created `secs` seconds after the Unix epoch.
    pub fn at_second(secs: i64) -> Self {
        Self(jiff::Timestamp::from_second(secs).ok())
    }
}

impl Ord for ServiceAge {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        use std::cmp::Ordering;
        match (self.0, other.0) {
            (Some(a), Some(b)) => a.cmp(&b),
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (None, None) => Ordering::Equal,
        }
    }
}

impl PartialOrd for ServiceAge {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
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
    /// when two Services without a `creationTimestamp` claim one frontend
    /// with the same rank, its current owner keeps it (see
    /// [`super::FrontendPolicy`] and [`super::Incremental`]).
    pub current_owners: BTreeMap<FrontendKey, String>,
    /// NodePorts also on `127.0.0.1` for the node's own clients (kube-proxy's
    /// `iptables.localhostNodePorts`); internal scope only, so only the
    /// socket hooks ever see them.
    pub localhost_node_ports: bool,
    /// The node's default load-balancing algorithm (`loadBalancing.algorithm`);
    /// a Service's annotation overrides it.
    pub lb_algorithm: super::LbAlgorithm,
    /// Which addresses may be frontends (externalIPs, node addresses) and
    /// how many frontends one Service may have.
    pub frontend_policy: super::FrontendPolicy,
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

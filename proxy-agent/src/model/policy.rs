//! Which addresses may be frontends, and who owns a frontend two Services
//! claim (the CVE-2020-8554 class: a Service must not take another's
//! traffic by naming its address as an externalIP or load-balancer IP).
use std::cmp::Ordering;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The operator's frontend policy (`frontendPolicy` in the config file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendPolicy {
    /// Whether `spec.externalIPs` are served at all (default: yes, as
    /// kube-proxy does; externalIPs are deprecated from Kubernetes 1.36).
    pub honour_external_ips: bool,
    /// When not empty, only externalIPs in one of these CIDRs are served.
    pub external_ip_allow: Vec<(IpAddr, u8)>,
    /// externalIPs in one of these CIDRs are refused (over `external_ip_allow`).
    pub external_ip_deny: Vec<(IpAddr, u8)>,
    /// Whether an externalIP or load-balancer IP may be one of this node's
    /// own addresses (default: no): for an externalIP, the Node object's
    /// addresses and those on its external interfaces (a VIP included); for
    /// a load-balancer IP, the Node object's (a load-balancer controller
    /// such as kube-vip puts its IPs on the interface itself).
    pub allow_node_addresses: bool,
    /// Frontends one Service may have (default 1024); the rest are refused
    /// with a warning, so that one Service cannot fill the maps.
    pub max_frontends_per_service: usize,
}

/// [`FrontendPolicy::max_frontends_per_service`]'s default.
pub const DEFAULT_MAX_FRONTENDS_PER_SERVICE: usize = 1024;

impl Default for FrontendPolicy {
    fn default() -> Self {
        Self {
            honour_external_ips: true,
            external_ip_allow: Vec::new(),
            external_ip_deny: Vec::new(),
            allow_node_addresses: false,
            max_frontends_per_service: DEFAULT_MAX_FRONTENDS_PER_SERVICE,
        }
    }
}

/// Why `ip` can never be a Service frontend, if so. IPv4: "this network",
/// loopback, link-local (the metadata service), multicast, reserved and
/// broadcast addresses. IPv6: unspecified, loopback, IPv4-mapped,
/// link-local and multicast addresses. (The model's own localhost NodePorts
/// are not checked.)
pub fn forbidden_address(ip: impl Into<IpAddr>) -> Option<&'static str> {
    const RANGES: [((Ipv4Addr, u8), &str); 6] = [
        (
            (Ipv4Addr::new(0, 0, 0, 0), 8),
            "in 0.0.0.0/8 (this network)",
        ),
        (
            (Ipv4Addr::new(127, 0, 0, 0), 8),
            "in 127.0.0.0/8 (loopback)",
        ),
        (
            (Ipv4Addr::new(169, 254, 0, 0), 16),
            "in 169.254.0.0/16 (link-local, the metadata service)",
        ),
        (
            (Ipv4Addr::new(224, 0, 0, 0), 4),
            "in 224.0.0.0/4 (multicast)",
        ),
        (
            (Ipv4Addr::new(255, 255, 255, 255), 32),
            "255.255.255.255 (broadcast)",
        ),
        (
            (Ipv4Addr::new(240, 0, 0, 0), 4),
            "in 240.0.0.0/4 (reserved)",
        ),
    ];
    const RANGES6: [((Ipv6Addr, u8), &str); 5] = [
        ((Ipv6Addr::UNSPECIFIED, 128), ":: (unspecified)"),
        ((Ipv6Addr::LOCALHOST, 128), "::1 (loopback)"),
        (
            (Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0), 96),
            "in ::ffff:0:0/96 (IPv4-mapped)",
        ),
        (
            (Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10),
            "in fe80::/10 (link-local)",
        ),
        (
            (Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8),
            "in ff00::/8 (multicast)",
        ),
    ];
    let ip = ip.into();
    let v4 = RANGES
        .iter()
        .map(|((net, p), why)| ((IpAddr::V4(*net), *p), *why));
    let v6 = RANGES6
        .iter()
        .map(|((net, p), why)| ((IpAddr::V6(*net), *p), *why));
    v4.chain(v6)
        .find(|(cidr, _)| super::addresses::in_cidr(ip, *cidr))
        .map(|(_, why)| why)
}

/// Who a claim of a frontend comes from, for [`super::incremental`]:
/// a ClusterIP claim wins over any other; then the older Service
/// (`metadata.creationTimestamp`; one without wins over none); between two
/// Services without a timestamp (manifests), the current owner; then
/// `namespace/name`. Only the last tie-break depends on anything but the
/// objects, so an owner does not change because the agent restarted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ClaimRank {
    pub(super) cluster_ip: bool,
    pub(super) created: Option<jiff::Timestamp>,
    pub(super) current_owner: bool,
    pub(super) service: String,
}

impl ClaimRank {
    /// `Less`: `self` wins over `other`.
    pub(super) fn cmp_claim(&self, other: &Self) -> Ordering {
        other
            .cluster_ip
            .cmp(&self.cluster_ip)
            .then_with(|| match (self.created, other.created) {
                (Some(a), Some(b)) => a.cmp(&b),
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (None, None) => other.current_owner.cmp(&self.current_owner),
            })
            .then_with(|| self.service.cmp(&other.service))
    }

    /// Why `self` won over `other`, for the loser's warning.
    pub(super) fn why_wins(&self, other: &Self) -> &'static str {
        if self.cluster_ip && !other.cluster_ip {
            "a ClusterIP wins over an externalIP or load-balancer IP"
        } else if self.created.is_some() && self.created != other.created {
            "the older Service keeps it"
        } else if self.created.is_none() && self.current_owner && !other.current_owner {
            "its current owner keeps it"
        } else {
            "the first by namespace/name keeps it"
        }
    }
}

//! The addresses a Service is reachable at besides its ClusterIPs: this
//! node's NodePort addresses (`nodePortAddresses`), `externalIPs` and
//! load-balancer ingress IPs, of both families, with addresses and CIDRs
//! parsed as the API server's Go code reads them.
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use k8s_openapi::api::core::v1::Node;

use crate::objects::compact::CompactService;

use super::{IpFamily, ModelWarning, NODE_ADDRESS_INTERNAL_IP};

/// One entry of kube-proxy's `--nodeport-addresses` / `nodePortAddresses`.
///
/// The candidate addresses of a family are this node's `InternalIP`
/// addresses of that family from its Node object's `status.addresses`,
/// followed by the global-scope addresses configured now on the node's
/// external interfaces (`externalInterfaces`; not on pod interfaces, not
/// link-local or loopback ones), which the agent follows live: an address
/// added later, a keepalived or kube-vip VIP, serves NodePorts from the
/// next sync on, and stops when it is removed (kube-proxy's iptables mode
/// matches every local address, `--dst-type LOCAL`; Cilium serves the
/// addresses of its devices). A family without an `InternalIP` has no
/// candidates (no NodePort is served in it: its SNAT address would be
/// missing). Each family is selected on its own, as kube-proxy's
/// per-family proxiers do. A list:
///
/// - empty (the default): every candidate, as kube-proxy's iptables mode
///   (`0.0.0.0/0` and `::/0`), on the external interfaces only (kube-proxy
///   also matches addresses of other interfaces, e.g. a bridge; kube-proxy's
///   nftables mode defaults to `primary`);
/// - otherwise, per family, the union of what the entries select; a list
///   holding no CIDR of a family selects every candidate of that family, as
///   kube-proxy's proxier of that family falls back to `0.0.0.0/0` (`::/0`)
///   when no CIDR of its family is given (`proxyutil.NewNodePortAddresses`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodePortAddresses {
    /// An IPv4 CIDR (network address, prefix length): the candidates in it
    /// (`InternalIP`s and interface addresses alike).
    Cidr(Ipv4Addr, u8),
    /// An IPv6 CIDR (network address, prefix length): the candidates in it.
    Cidr6(Ipv6Addr, u8),
    /// `primary`: the node's first `InternalIP` of each family (kube-proxy:
    /// the node's primary IP of the family, as `/32` or `/128`); never an
    /// interface address the Node object does not name.
    Primary,
}

impl NodePortAddresses {
    /// `"primary"`, or an IPv4 or IPv6 CIDR. Host bits are cleared
    /// (`198.18.0.7/24` is `198.18.0.0/24`), as Go's `ParseCIDR` does;
    /// leading zeros of IPv4 parts are decimal, as in kube-proxy's
    /// `ParseCIDRSloppy`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "primary" {
            return Ok(Self::Primary);
        }
        match parse_cidr(s)? {
            (IpAddr::V4(addr), prefix) => Ok(Self::Cidr(addr, prefix)),
            (IpAddr::V6(addr), prefix) => Ok(Self::Cidr6(addr, prefix)),
        }
    }

    /// The family of its CIDR; `None` for `primary` (both).
    fn family(&self) -> Option<IpFamily> {
        match self {
            Self::Cidr(..) => Some(IpFamily::V4),
            Self::Cidr6(..) => Some(IpFamily::V6),
            Self::Primary => None,
        }
    }

    /// The addresses of `candidates` (of one family: the node's
    /// `InternalIP`s in order, then its interface addresses) this entry
    /// selects; `primary` is the first `InternalIP`, `internal_ips[0]`.
    fn select(&self, internal_ips: &[IpAddr], candidates: &[IpAddr]) -> Vec<IpAddr> {
        let inside = |net: IpAddr, prefix: u8| -> Vec<IpAddr> {
            candidates
                .iter()
                .copied()
                .filter(|ip| in_cidr(*ip, (net, prefix)))
                .collect()
        };
        match *self {
            Self::Cidr(net, prefix) => inside(IpAddr::V4(net), prefix),
            Self::Cidr6(net, prefix) => inside(IpAddr::V6(net), prefix),
            Self::Primary => internal_ips.first().copied().into_iter().collect(),
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
            Self::Cidr6(addr, prefix) => write!(f, "{addr}/{prefix}"),
            Self::Primary => f.write_str("primary"),
        }
    }
}

/// The addresses NodePorts are served on in `family`: the candidates
/// (`internal_ips`, the node's `InternalIP`s of `family` in order, then the
/// addresses of `iface_addrs` of `family`, the node's external interfaces'
/// usable addresses; none without an `InternalIP`) filtered by `entries`
/// (see [`NodePortAddresses`]). Sorted, without duplicates.
pub(super) fn node_port_addresses(
    family: IpFamily,
    internal_ips: &[IpAddr],
    iface_addrs: &[IpAddr],
    entries: &[NodePortAddresses],
) -> Vec<IpAddr> {
    let candidates: Vec<IpAddr> = if internal_ips.is_empty() {
        Vec::new()
    } else {
        let extra = iface_addrs
            .iter()
            .copied()
            .filter(|ip| IpFamily::of(*ip) == family && !internal_ips.contains(ip));
        internal_ips.iter().copied().chain(extra).collect()
    };
    // The entries for this family: `primary` and its CIDRs.
    let mine: Vec<&NodePortAddresses> = entries
        .iter()
        .filter(|e| e.family().is_none_or(|f| f == family))
        .collect();
    let mut out: Vec<IpAddr> = if mine.is_empty() {
        candidates
    } else {
        mine.iter()
            .flat_map(|e| e.select(internal_ips, &candidates))
            .collect()
    };
    out.sort();
    out.dedup();
    out
}

/// `addr` with the bits past `prefix` cleared.
pub(crate) fn mask(addr: IpAddr, prefix: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let m = u32::MAX
                .checked_shl(32 - u32::from(prefix.min(32)))
                .unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(u32::from(a) & m))
        }
        IpAddr::V6(a) => {
            let m = u128::MAX
                .checked_shl(128 - u32::from(prefix.min(128)))
                .unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(u128::from(a) & m))
        }
    }
}

/// Whether `ip` is in the CIDR `(net, prefix)`; never across families.
pub(super) fn in_cidr(ip: IpAddr, (net, prefix): (IpAddr, u8)) -> bool {
    IpFamily::of(ip) == IpFamily::of(net) && mask(ip, prefix) == mask(net, prefix)
}

/// An IPv4 address as [`parse_ipv4`] reads it, or an IPv6 address.
pub(super) fn parse_ip(s: &str) -> Option<IpAddr> {
    parse_ipv4(s)
        .map(IpAddr::V4)
        .or_else(|| s.parse::<Ipv6Addr>().ok().map(IpAddr::V6))
}

/// An IPv4 address as Go's `netutils.ParseIPSloppy` reads it (what the API
/// server validates Service addresses with): four decimal parts, leading
/// zeros allowed and decimal.
pub(super) fn parse_ipv4(s: &str) -> Option<Ipv4Addr> {
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

/// A CIDR as `netutils.ParseCIDRSloppy` reads it: (network, prefix), host
/// bits cleared, IPv4 or IPv6.
pub(super) fn parse_cidr(s: &str) -> Result<(IpAddr, u8), String> {
    let (addr, prefix) = s
        .split_once('/')
        .ok_or_else(|| format!("{s:?} is not a CIDR (expected e.g. 198.18.0.0/15)"))?;
    let prefix_ok = !prefix.is_empty() && prefix.bytes().all(|b| b.is_ascii_digit());
    let (ip, max) = match parse_ip(addr) {
        Some(ip @ IpAddr::V4(_)) => (ip, 32),
        Some(ip @ IpAddr::V6(_)) => (ip, 128),
        None => return Err(format!("{s:?}: {addr:?} is not an IP address")),
    };
    let p = prefix
        .parse::<u8>()
        .ok()
        .filter(|p| prefix_ok && *p <= max)
        .ok_or_else(|| format!("{s:?}: prefix length must be 0..={max}"))?;
    Ok((mask(ip, p), p))
}

/// A Service's north-south addresses as kube-proxy's proxiers take them
/// (`newBaseServiceInfo`), of both families (each family's proxier takes
/// those of its own), each list sorted, without duplicates.
#[derive(Debug, Default)]
pub(super) struct ExternalAddresses {
    /// `spec.externalIPs`, captured whether or not an interface owns them
    /// (S11).
    pub(super) external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` in VIP mode (`ipMode` missing or
    /// `VIP`, `proxyutil.IsVIPMode`); `Proxy`-mode IPs are left to the load
    /// balancer, which sends to the NodePort.
    pub(super) lb_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges` (`proxyutil.MapCIDRsByIPFamily`:
    /// trimmed, empty entries ignored, invalid ones ignored with a warning,
    /// host bits cleared). With none of a family, no filtering for that
    /// family.
    pub(super) source_ranges: Vec<(IpAddr, u8)>,
}

impl ExternalAddresses {
    /// The source ranges of `family`.
    pub(super) fn source_ranges_of(&self, family: IpFamily) -> Vec<(IpAddr, u8)> {
        self.source_ranges
            .iter()
            .copied()
            .filter(|(a, _)| IpFamily::of(*a) == family)
            .collect()
    }
}

/// [`ExternalAddresses`] of `svc`; invalid entries yield warnings on `object`.
pub(super) fn external_addresses(
    svc: &CompactService,
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
    let spec = svc.spec.as_deref();
    for s in spec.iter().flat_map(|s| s.external_ips.iter()) {
        match parse_ip(s) {
            Some(ip) => out.external_ips.push(ip),
            None if s.trim().is_empty() => {}
            None => warn(format!("invalid externalIP {s:?}; ignored")),
        }
    }
    for (ip, mode) in svc.lb_ingress.iter() {
        let Some(s) = ip.as_deref().filter(|s| !s.is_empty()) else {
            continue;
        };
        if mode.as_deref().is_some_and(|m| m != "VIP") {
            continue;
        }
        match parse_ip(s) {
            Some(ip) => out.lb_ips.push(ip),
            None => warn(format!("invalid load-balancer ingress IP {s:?}; ignored")),
        }
    }
    let ranges = spec
        .iter()
        .flat_map(|s| s.load_balancer_source_ranges.iter());
    for s in ranges.map(|s| s.trim()) {
        if s.is_empty() {
            continue;
        }
        match parse_cidr(s) {
            Ok(cidr) => {
                // Accepted as kube-proxy accepts it (`ParseCIDRSloppy` keeps
                // the network), with the API server's warning for it, which
                // a manifests source has no API server to give.
                let raw = s.split_once('/').and_then(|(a, _)| parse_ip(a));
                if raw != Some(cidr.0) {
                    warn(format!(
                        "loadBalancerSourceRanges entry {s:?} has host bits set; used as {}/{}, as kube-proxy does",
                        cidr.0, cidr.1
                    ));
                }
                out.source_ranges.push(cidr)
            }
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

/// The node's `InternalIP` addresses of both families, each in
/// `status.addresses` order, without duplicates: `[IPv4, IPv6]`.
pub(super) fn node_internal_ips(node: &Node) -> [Vec<IpAddr>; 2] {
    let mut out: [Vec<IpAddr>; 2] = Default::default();
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    for a in addresses.into_iter().flatten() {
        if a.type_ != NODE_ADDRESS_INTERNAL_IP {
            continue;
        }
        if let Some(ip) = parse_ip(&a.address) {
            let list = &mut out[IpFamily::of(ip).index()];
            if !list.contains(&ip) {
                list.push(ip);
            }
        }
    }
    out
}

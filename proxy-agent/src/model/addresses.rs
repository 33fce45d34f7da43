//! The addresses a Service is reachable at besides its ClusterIPs: this
//! node's NodePort addresses (`nodePortAddresses`), `externalIPs` and
//! load-balancer ingress IPs, with IPv4 addresses and CIDRs parsed as the API
//! server's Go code reads them.
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use k8s_openapi::api::core::v1::{Node, Service};

use super::{ModelWarning, NODE_ADDRESS_INTERNAL_IP};

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
pub(super) fn node_port_addresses(
    internal_ips: &[Ipv4Addr],
    entries: &[NodePortAddresses],
) -> Vec<Ipv4Addr> {
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

/// A Service's north-south addresses as kube-proxy's IPv4 proxier takes them
/// (`newBaseServiceInfo`), each list sorted, without duplicates.
#[derive(Debug, Default)]
pub(super) struct ExternalAddresses {
    /// IPv4 `spec.externalIPs`, captured whether or not an interface owns
    /// them (S11).
    pub(super) external_ips: Vec<Ipv4Addr>,
    /// IPv4 `status.loadBalancer.ingress[].ip` in VIP mode (`ipMode` missing
    /// or `VIP`, `proxyutil.IsVIPMode`); `Proxy`-mode IPs are left to the load
    /// balancer, which sends to the NodePort.
    pub(super) lb_ips: Vec<Ipv4Addr>,
    /// IPv4 `spec.loadBalancerSourceRanges` (`proxyutil.MapCIDRsByIPFamily`:
    /// trimmed, empty entries ignored, invalid ones ignored with a warning,
    /// host bits cleared). With none of this family, no filtering.
    pub(super) source_ranges: Vec<(Ipv4Addr, u8)>,
}

/// [`ExternalAddresses`] of `svc`; invalid entries yield warnings on `object`.
/// Entries of the other family are skipped (kube-proxy: logged at V(4)).
pub(super) fn external_addresses(
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
            Ok(Some(cidr)) => {
                // Accepted as kube-proxy accepts it (`ParseCIDRSloppy` keeps
                // the network), with the API server's warning for it, which
                // a manifests source has no API server to give.
                let raw = s.split_once('/').and_then(|(a, _)| parse_ipv4(a));
                if raw != Some(cidr.0) {
                    warn(format!(
                        "loadBalancerSourceRanges entry {s:?} has host bits set; used as {}/{}, as kube-proxy does",
                        cidr.0, cidr.1
                    ));
                }
                out.source_ranges.push(cidr)
            }
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
pub(super) fn node_internal_ips(node: &Node) -> Vec<Ipv4Addr> {
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

//! The values of single fields: the enumerations, Go durations, CIDRs, bind
//! addresses and port ranges, each parsed and checked on its own.
use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use serde::{Deserialize, Deserializer};

use super::{invalid, ConfigError};

/// Where desired state comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    /// Kubernetes YAML files (Services, EndpointSlices, Pods, Nodes), watched.
    Manifests,
    /// The API server: Services, EndpointSlices and this node's Node.
    Kubernetes,
}

/// Acceleration of external traffic (NodePort, load-balancer IPs, externalIPs).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Acceleration {
    /// tc only.
    #[default]
    None,
    /// XDP on the external devices translates and forwards flows to backends
    /// on other nodes at the driver (XDP_TX / XDP_REDIRECT); the rest falls
    /// back to tc.
    Xdp,
}

/// How translated packets reach their backend (`deliveryMode`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryMode {
    /// `stack` when a NetworkPolicy engine's chains are in the host's
    /// iptables or nftables (Calico, Canal, kube-router, Weave Net,
    /// kube-network-policies), else `redirect`; checked at start and at every
    /// periodic sync.
    #[default]
    Auto,
    /// Redirect to the backend's interface: no netfilter on the way (the
    /// fast path). A policy engine in netfilter never sees these packets.
    Redirect,
    /// Hand translated packets to the host's stack, so its forward filtering
    /// (NetworkPolicy) sees the backend, and reverse-translate replies at tc
    /// egress towards the client, after that filtering. Flows whose source
    /// is rewritten (hairpin, external traffic SNATed to a remote backend)
    /// stay redirected.
    Stack,
}

/// What the agent does with the datapath when it exits (SIGTERM / SIGINT).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum OnExit {
    /// Detach every program and remove the link pins: a clean shutdown
    /// (Services stop working on the node until an agent runs again).
    #[default]
    Detach,
    /// Leave the programs attached and the maps pinned: Services keep working
    /// while the agent is down, and the next agent (a restart, a rolling
    /// update) takes them over without losing a flow. `proxy-agent cleanup`
    /// removes what is left.
    Keep,
    /// Hand the node back to kube-proxy without breaking its connections:
    /// the programs stay attached and keep translating the flows they
    /// track, while every new flow (and host client's new connection) goes
    /// to the host's stack, for kube-proxy's rules. Start kube-proxy first;
    /// run `proxy-agent cleanup` once the old flows have ended.
    Drain,
}

/// A Go duration (`time.ParseDuration`): `300ms`, `1.5h`, `2h45m`, `0`.
/// A Go duration in the file (`1s`, `250ms`, `1m30s`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GoDuration(pub Duration);

impl schemars::JsonSchema for GoDuration {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "GoDuration".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "format": "go-duration",
            "description": "A Go duration: 1s, 250ms, 1m30s.",
        })
    }
    fn inline_schema() -> bool {
        true
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s)
            .map(GoDuration)
            .map_err(serde::de::Error::custom)
    }
}

/// Parses a Go duration: a sequence of decimal numbers, each with a unit
/// (`ns`, `us`, `µs`, `ms`, `s`, `m`, `h`), e.g. `1m30s`, `250ms`; `0` alone.
/// Negative durations are refused.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let err = |why: &str| format!("invalid duration {s:?}: {why} (expected e.g. 1s, 250ms, 1m30s)");
    let mut rest = s.trim();
    if let Some(r) = rest.strip_prefix('+') {
        rest = r;
    }
    if rest.starts_with('-') {
        return Err(err("negative"));
    }
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(err("empty"));
    }
    let mut nanos: f64 = 0.0;
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(num_end);
        if num.is_empty() || num == "." {
            return Err(err("missing number"));
        }
        let n: f64 = num.parse().map_err(|_| err("bad number"))?;
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_end);
        let scale = match unit {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            "" => return Err(err("missing unit")),
            _ => return Err(err(&format!("unknown unit {unit:?}"))),
        };
        nanos += n * scale;
        rest = tail;
    }
    if !nanos.is_finite() || nanos > u64::MAX as f64 {
        return Err(err("out of range"));
    }
    Ok(Duration::from_nanos(nanos.round() as u64))
}

/// An IPv4 or IPv6 CIDR, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not a CIDR (expected e.g. 198.18.0.0/15)"))?;
        let addr: IpAddr = a
            .parse()
            .map_err(|_| format!("{s:?}: {a:?} is not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix: u8 = p
            .parse()
            .ok()
            .filter(|p| *p <= max)
            .ok_or_else(|| format!("{s:?}: prefix length must be 0..={max}"))?;
        Ok(Cidr { addr, prefix })
    }
}

impl Cidr {
    /// The network itself (host bits cleared).
    pub fn network(self) -> Cidr {
        Cidr {
            addr: crate::model::mask(self.addr, self.prefix),
            prefix: self.prefix,
        }
    }

    /// `self` if it has no host bits set, else an error saying which network
    /// was probably meant. For the agent's own policy fields, where
    /// `198.18.7.1/24` is more likely a mistyped address than a network:
    /// kube-proxy's fields (`nodePortAddresses`, `clusterCIDR`) keep
    /// kube-proxy's rule, which clears the host bits.
    pub fn exact(self) -> Result<Cidr, String> {
        let net = self.network();
        if net == self {
            Ok(self)
        } else {
            Err(format!(
                "{self} has host bits set (the network is {net}; write that)"
            ))
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Parses a bind address: `ip:port`, or a bare IP with `default_port`, or an
/// empty string for "disabled".
pub fn parse_bind_address(
    field: &str,
    s: &str,
    default_port: u16,
) -> Result<Option<SocketAddr>, ConfigError> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(Some(a));
    }
    if let Ok(ip) = s.parse::<std::net::IpAddr>() {
        return Ok(Some(SocketAddr::new(ip, default_port)));
    }
    Err(invalid(
        field,
        format!(
            "{s:?} is not an address (expected ip:port, e.g. 0.0.0.0:10256, or empty to disable)"
        ),
    ))
}

/// A port range `min-max` (inclusive, 1–65535, min ≤ max).
pub fn parse_port_range(s: &str) -> Result<(u16, u16), String> {
    let (a, b) = s
        .split_once('-')
        .ok_or_else(|| format!("{s:?} is not a range min-max"))?;
    let port = |p: &str| -> Result<u16, String> {
        match p.trim().parse::<u16>() {
            Ok(0) | Err(_) => Err(format!("{p:?} is not a port (1-65535)")),
            Ok(n) => Ok(n),
        }
    };
    let (a, b) = (port(a)?, port(b)?);
    if a > b {
        return Err(format!("{s:?}: the first port is above the second"));
    }
    Ok((a, b))
}

/// The SNAT port range to use beside the host's ephemeral ports
/// (`ip_local_port_range`, `local`): `configured` when it does not overlap
/// them, else an error naming both; unconfigured, the larger span of
/// 1024–65535 outside them.
pub fn snat_ports(configured: Option<(u16, u16)>, local: (u16, u16)) -> Result<(u16, u16), String> {
    let (lo, hi) = local;
    if let Some((a, b)) = configured {
        if a <= hi && lo <= b {
            return Err(format!(
                "snatPortRange {a}-{b} overlaps the host's ip_local_port_range {lo}-{hi}: \
                 SNATed flows would share ports with the node's own connections; \
                 choose a range outside it"
            ));
        }
        return Ok((a, b));
    }
    let below = (lo > 1024).then(|| (1024u16, lo - 1));
    let above = (hi < 65535).then(|| (hi.max(1023) + 1, 65535u16));
    let span = |r: &Option<(u16, u16)>| r.map_or(0, |(a, b)| u32::from(b) - u32::from(a) + 1);
    match (span(&below), span(&above)) {
        (0, 0) => Err(format!(
            "the host's ip_local_port_range {lo}-{hi} leaves no ports for SNAT; \
             narrow it or set snatPortRange"
        )),
        (b, a) if b >= a => Ok(below.unwrap()),
        _ => Ok(above.unwrap()),
    }
}

//! The configuration file (`--config`) and how it merges with the flags.
//!
//! Field names follow kube-proxy's `KubeProxyConfiguration` where the meaning
//! is the same (`healthzBindAddress`, `metricsBindAddress`, `minSyncPeriod`,
//! `syncPeriod`, `hostnameOverride`, `clientConnection.kubeconfig`,
//! `conntrack`, ...); the agent's own fields are camelCase too (`bpffs`,
//! `podInterfaces`, `externalInterfaces`, `hairpinSnatIP`, `source`, `manifests`,
//! `serviceProxyName`). Durations are Go durations (`1s`, `250ms`, `1m30s`).
//! Unknown fields are errors. Flags override the file; the file overrides the
//! defaults.
use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Deserializer};

use crate::bpf::MapSizes;

pub mod flags;

use flags::RunArgs;

/// kube-proxy's default `healthzBindAddress`.
pub const DEFAULT_HEALTHZ_BIND_ADDRESS: &str = "0.0.0.0:10256";
/// kube-proxy's default `metricsBindAddress`.
pub const DEFAULT_METRICS_BIND_ADDRESS: &str = "127.0.0.1:10249";
pub const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/proxy-agent";
pub const DEFAULT_POD_INTERFACES: &str = "lxc*";
/// The node's external devices, by default.
pub const DEFAULT_EXTERNAL_INTERFACES: &str = "eth0";
/// Cilium's default service loopback address.
pub const DEFAULT_HAIRPIN_SNAT_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 42, 1);
/// The `kind` a configuration file may declare.
pub const KIND: &str = "ProxyAgentConfiguration";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading the config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A syntax error, an unknown field or a bad value in the file; the
    /// message names the field and where it is.
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid(field: &str, message: impl fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        message: message.to_string(),
    }
}

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

/// `clientConnection`: how to reach the API server.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientConnection {
    /// Path of a kubeconfig file; empty or missing means in-cluster (or the
    /// usual kubeconfig lookup outside a cluster).
    pub kubeconfig: Option<PathBuf>,
}

/// `hostSocketLB`: socket-level load balancing for the node's own clients
/// (host processes, hostNetwork pods) on cgroup v2 hooks.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HostSocketLbFile {
    /// On by default; off for nodes whose host traffic must not be
    /// load-balanced by socket hooks (a transparent proxy on the host that
    /// reads original destinations). Host clients then do not reach Services.
    pub enabled: Option<bool>,
    /// The cgroup v2 directory the hooks attach to; default: the root of the
    /// cgroup2 hierarchy (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a
    /// hybrid host). In a pod, mount the host's cgroup2 and give its path.
    pub cgroup_root: Option<PathBuf>,
}

/// `conntrack`: the datapath's own connection tracking, with kube-proxy's
/// field names. Sizes the conntrack map and sets its timeouts.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Conntrack {
    /// Entries per CPU; the map holds `maxPerCore × CPUs` (at least `min`).
    /// 0 leaves the default size.
    pub max_per_core: Option<u32>,
    /// Lower bound of the map size when `maxPerCore` is used.
    pub min: Option<u32>,
    /// Idle timeout of established TCP flows.
    pub tcp_established_timeout: Option<GoDuration>,
    /// Idle timeout of half-closed TCP flows (a FIN in one direction; the
    /// kernel's CLOSE_WAIT).
    pub tcp_close_wait_timeout: Option<GoDuration>,
    /// Idle timeout of UDP flows not yet a stream.
    pub udp_timeout: Option<GoDuration>,
    /// Idle timeout of UDP streams (traffic both ways that went on).
    pub udp_stream_timeout: Option<GoDuration>,
    /// Accepted for kube-proxy compatibility (the kernel's window tracking);
    /// the datapath does not track TCP windows.
    pub tcp_be_liberal: Option<bool>,
}

/// `mapSizes`: entries of the load-balancing maps. The defaults hold 65,535
/// frontends, 131,071 backends and 262,144 frontend and backend slots;
/// larger clusters raise them (the maps are allocated at these sizes).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MapSizesFile {
    /// Frontends and their backend slots: one entry per frontend plus one
    /// per backend of it (both families).
    pub services: Option<u32>,
    /// Backends: one per distinct backend address, port and protocol (both
    /// families); backend ids stay below it.
    pub backends: Option<u32>,
    /// Frontends (one reverse-NAT id each, both families); at most
    /// 16,777,216.
    pub reverse_nat: Option<u32>,
}

/// The largest `mapSizes` value: 2^24 entries.
pub const MAP_SIZE_MAX: u32 = 1 << 24;

/// `mapSizes` checked onto `sizes`.
fn checked_map_sizes(file: Option<&MapSizesFile>, sizes: &mut MapSizes) -> Result<(), ConfigError> {
    let Some(file) = file else {
        return Ok(());
    };
    for (field, value, size) in [
        ("mapSizes.services", file.services, &mut sizes.services),
        ("mapSizes.backends", file.backends, &mut sizes.backends),
        ("mapSizes.reverseNat", file.reverse_nat, &mut sizes.rev_nat),
    ] {
        let Some(n) = value else { continue };
        if !(16..=MAP_SIZE_MAX).contains(&n) {
            return Err(invalid(
                field,
                format!("{n} must be between 16 and {MAP_SIZE_MAX}"),
            ));
        }
        *size = n;
    }
    Ok(())
}

/// `loadBalancing`: the node's default algorithm and Maglev's table.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadBalancingFile {
    /// `random` (default), `round-robin`, `source-hash` or `maglev`. A
    /// `maglev` default applies to external frontends only; the Service
    /// annotation `proxy-agent.io/lb-algorithm` overrides it.
    pub algorithm: Option<crate::model::LbAlgorithm>,
    /// Maglev's lookup tables.
    pub maglev: Option<MaglevFile>,
}

/// `loadBalancing.maglev`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MaglevFile {
    /// Entries of each table: a prime, at most 65521 (default 16381). Each
    /// table takes `tableSize × 4` bytes.
    pub table_size: Option<u32>,
    /// Tables programmed at most (default 1024); a frontend beyond is refused
    /// with an error.
    pub max_tables: Option<u32>,
}

/// `frontendPolicy`: which addresses may be frontends and how many one
/// Service may have (docs/security.md, "Frontend ownership and address policy").
#[derive(Clone, Debug, Default, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FrontendPolicyFile {
    /// Serve `spec.externalIPs` (default true, as kube-proxy; externalIPs are
    /// deprecated from Kubernetes 1.36).
    #[serde(rename = "honourExternalIPs")]
    pub honour_external_ips: Option<bool>,
    /// When given, only externalIPs in these CIDRs (IPv4 or IPv6) are served.
    #[serde(rename = "externalIPAllowCIDRs")]
    pub external_ip_allow_cidrs: Option<Vec<String>>,
    /// externalIPs in these CIDRs (IPv4 or IPv6) are refused (over the allow
    /// list).
    #[serde(rename = "externalIPDenyCIDRs")]
    pub external_ip_deny_cidrs: Option<Vec<String>>,
    /// Allow this node's own addresses as externalIP or load-balancer IP
    /// (default false). Own addresses of an externalIP: the Node object's
    /// and those on the external interfaces now (a keepalived VIP
    /// included); of a load-balancer IP: the Node object's only (kube-vip
    /// puts its load-balancer IPs on the interface).
    pub allow_node_addresses: Option<bool>,
    /// Frontends one Service may have (default 1024, at least 1).
    pub max_frontends_per_service: Option<u32>,
}

/// `frontendPolicy` checked: CIDRs parse, the limit is at least 1.
fn frontend_policy(
    file: Option<&FrontendPolicyFile>,
) -> Result<crate::model::FrontendPolicy, ConfigError> {
    let mut p = crate::model::FrontendPolicy::default();
    let Some(file) = file else {
        return Ok(p);
    };
    let cidrs = |field: &str, list: &Option<Vec<String>>| {
        list.iter()
            .flatten()
            .map(|s| {
                s.trim()
                    .parse::<Cidr>()
                    .and_then(Cidr::exact)
                    .map(|c| (c.addr, c.prefix))
                    .map_err(|e| invalid(field, e))
            })
            .collect::<Result<Vec<_>, _>>()
    };
    p.external_ip_allow = cidrs(
        "frontendPolicy.externalIPAllowCIDRs",
        &file.external_ip_allow_cidrs,
    )?;
    p.external_ip_deny = cidrs(
        "frontendPolicy.externalIPDenyCIDRs",
        &file.external_ip_deny_cidrs,
    )?;
    if let Some(b) = file.honour_external_ips {
        p.honour_external_ips = b;
    }
    if let Some(b) = file.allow_node_addresses {
        p.allow_node_addresses = b;
    }
    if let Some(n) = file.max_frontends_per_service {
        if n == 0 {
            return Err(invalid(
                "frontendPolicy.maxFrontendsPerService",
                "must be at least 1",
            ));
        }
        p.max_frontends_per_service = n as usize;
    }
    Ok(p)
}

/// The configuration file. Every field is optional.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConfigFile {
    /// Free-form version of the file format.
    pub api_version: Option<String>,
    /// Must be `ProxyAgentConfiguration` when present.
    pub kind: Option<String>,
    /// Address of `/healthz`, `/livez` and `/proxyMode`; empty disables them
    /// (default `0.0.0.0:10256`, as kube-proxy). Flag `--healthz-bind-address`.
    pub healthz_bind_address: Option<String>,
    /// Address of `/metrics` (Prometheus); empty disables it (default
    /// `127.0.0.1:10249`, as kube-proxy). Flag `--metrics-bind-address`.
    pub metrics_bind_address: Option<String>,
    /// The node addresses NodePorts are served on: CIDRs (IPv4 or IPv6, host
    /// bits cleared as kube-proxy does) or `primary`, per family. The
    /// candidates are the Node's InternalIPs and the global-scope addresses
    /// on the external interfaces (`externalInterfaces`; not pod
    /// interfaces, not link-local), followed live: an address added later
    /// (a keepalived or kube-vip VIP) serves NodePorts from the next sync,
    /// and stops when removed. Default: every candidate (kube-proxy's
    /// iptables mode; its nftables mode defaults to `primary`); a CIDR
    /// selects the candidates inside it; `primary` the first InternalIP of
    /// each family. A family without an InternalIP serves no NodePort.
    pub node_port_addresses: Option<Vec<String>>,
    /// Accepted and checked for kube-proxy compatibility; the datapath does
    /// not use it (a warning says so).
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    /// Minimum time between two syncs (kube-proxy's `minSyncPeriod`;
    /// default `1s`). Flag `--min-sync-period`.
    pub min_sync_period: Option<GoDuration>,
    /// Full resync period: without a change, the writer compares everything
    /// with what is programmed this often (default `30s`). Flag
    /// `--sync-period`.
    pub sync_period: Option<GoDuration>,
    /// This node's name when `--node-name` is not given (default: the host
    /// name).
    pub hostname_override: Option<String>,
    /// How to reach the API server (`--source kubernetes`).
    pub client_connection: Option<ClientConnection>,
    /// The conntrack map's size and the flows' idle timeouts.
    pub conntrack: Option<Conntrack>,
    /// Where desired state comes from (default `manifests`). Flag `--source`.
    pub source: Option<SourceKind>,
    /// Manifest files or directories (`source: manifests`). Flag
    /// `--manifests`.
    pub manifests: Option<Vec<PathBuf>>,
    /// Directory on a bpffs mount where maps and links are pinned and adopted
    /// on restart (default `/sys/fs/bpf/proxy-agent`). Flag `--bpffs`.
    pub bpffs: Option<PathBuf>,
    /// Glob patterns of pod interfaces, the host side of pod veths (default
    /// `lxc*`). Flag `--pod-interfaces`.
    pub pod_interfaces: Option<Vec<String>>,
    /// Glob patterns of the node's external devices (towards other nodes and
    /// external clients): they get the NodePort, load-balancer and
    /// externalIP program and the reverse NAT of replies from other nodes
    /// (default `eth0`). Flag `--external-interfaces`.
    pub external_interfaces: Option<Vec<String>>,
    /// What becomes of the datapath when the agent exits (default
    /// `detach`). Flag `--on-exit`.
    pub on_exit: Option<OnExit>,
    /// Acceleration of external traffic (default `none`). Flag
    /// `--acceleration`.
    pub acceleration: Option<Acceleration>,
    /// How translated packets reach their backend (default `auto`). Flag
    /// `--delivery-mode`.
    pub delivery_mode: Option<DeliveryMode>,
    /// Source ports for SNATed flows, `min-max` (default: the largest span
    /// of 1024–65535 outside the host's `ip_local_port_range`).
    pub snat_port_range: Option<String>,
    /// `auto` (tcx where the kernel has it, else legacy tc), `tcx`, `legacy`.
    pub tc_attach_mode: Option<crate::bpf::TcAttachMode>,
    /// Source address given to hairpin traffic, a pod reaching itself
    /// through a Service (default `169.254.42.1`, Cilium's service loopback
    /// address). Flag `--hairpin-snat-ip`.
    #[serde(rename = "hairpinSnatIP")]
    pub hairpin_snat_ip: Option<Ipv4Addr>,
    /// Source address of IPv6 hairpin traffic (default: the node's IPv6
    /// address).
    #[serde(rename = "hairpinSnatIPv6")]
    pub hairpin_snat_ip6: Option<std::net::Ipv6Addr>,
    /// This proxy's `service.kubernetes.io/service-proxy-name`.
    pub service_proxy_name: Option<String>,
    /// The API server's own address (kube-proxy's `--master`), e.g.
    /// `https://198.18.0.1:6443`: what the agent dials instead of
    /// `KUBERNETES_SERVICE_HOST`, the `kubernetes` Service's ClusterIP that
    /// nothing translates before this agent has programmed the node.
    pub master: Option<String>,
    /// Socket-level load balancing for the node's own clients (host
    /// processes, hostNetwork pods) on cgroup v2 hooks.
    #[serde(rename = "hostSocketLB")]
    pub host_socket_lb: Option<HostSocketLbFile>,
    /// NodePorts on 127.0.0.1 for the node's own clients (kube-proxy's
    /// `iptables.localhostNodePorts`, default true).
    pub localhost_node_ports: Option<bool>,
    /// The node's default load-balancing algorithm and Maglev's tables.
    pub load_balancing: Option<LoadBalancingFile>,
    /// Which addresses may be frontends, and how many per Service.
    pub frontend_policy: Option<FrontendPolicyFile>,
    /// Sizes of the service, backend and reverse-NAT maps (each between 16
    /// and 2^24); a changed size takes effect at the next start.
    pub map_sizes: Option<MapSizesFile>,
}

impl ConfigFile {
    /// Parses YAML (or JSON) text; `path` names the file in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let de = yaml_serde::Deserializer::from_str(text);
        let file: ConfigFile = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            let mut message = e.into_inner().to_string();
            if field != "." && !field.is_empty() {
                // The YAML error may name the (parent) field already.
                let parent = field.rsplit_once('.').map_or("", |(p, _)| p);
                for prefix in [field.as_str(), parent] {
                    if !prefix.is_empty() {
                        if let Some(rest) = message.strip_prefix(&format!("{prefix}: ")) {
                            message = rest.to_string();
                            break;
                        }
                    }
                }
                message = format!("{field}: {message}");
            }
            ConfigError::Parse {
                path: path.to_owned(),
                message,
            }
        })?;
        if let Some(kind) = &file.kind {
            if kind != KIND {
                return Err(ConfigError::Parse {
                    path: path.to_owned(),
                    message: format!("kind: expected {KIND}, found {kind}"),
                });
            }
        }
        Ok(file)
    }

    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(path, &text)
    }
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

/// Conntrack timeouts, seconds; `None` keeps the datapath's default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConntrackTimeouts {
    pub tcp_established_s: Option<u32>,
    pub tcp_close_wait_s: Option<u32>,
    pub udp_s: Option<u32>,
    pub udp_stream_s: Option<u32>,
}

/// Everything `run` needs, merged from the defaults, the file and the flags.
#[derive(Clone, Debug)]
pub struct Settings {
    pub source: SourceKind,
    pub manifests: Vec<PathBuf>,
    pub node_name: String,
    pub kubeconfig: Option<PathBuf>,
    pub service_proxy_name: Option<String>,
    pub bpffs: PathBuf,
    pub pod_interfaces: Vec<glob::Pattern>,
    pub external_interfaces: Vec<glob::Pattern>,
    pub on_exit: OnExit,
    pub acceleration: Acceleration,
    pub delivery_mode: DeliveryMode,
    /// `None`: chosen at start from the host's `ip_local_port_range`.
    pub snat_port_range: Option<(u16, u16)>,
    pub tc_attach_mode: crate::bpf::TcAttachMode,
    pub hairpin_snat_ip: Ipv4Addr,
    /// `None`: the node's IPv6 address.
    pub hairpin_snat_ip6: Option<std::net::Ipv6Addr>,
    pub min_sync_period: Duration,
    pub sync_period: Duration,
    /// `None`: disabled (an empty address).
    pub healthz_bind_address: Option<SocketAddr>,
    pub metrics_bind_address: Option<SocketAddr>,
    pub map_sizes: MapSizes,
    pub conntrack_timeouts: ConntrackTimeouts,
    /// `nodePortAddresses`: CIDRs or `primary` (kube-proxy's values),
    /// selecting among the InternalIPs and the external interfaces'
    /// addresses ([`crate::model::NodePortAddresses`]).
    pub node_port_addresses: Vec<crate::model::NodePortAddresses>,
    /// Accepted and checked; not used by the datapath yet.
    pub cluster_cidr: Option<Cidr>,
    /// The API server URL given (`--master` / `master`), over the
    /// kubeconfig's or the in-cluster one.
    pub master: Option<String>,
    /// The cgroup the socket hooks attach to; `None`: host socket LB off.
    pub host_socket_lb: Option<PathBuf>,
    pub localhost_node_ports: bool,
    /// The node's default load-balancing algorithm.
    pub lb_algorithm: crate::model::LbAlgorithm,
    pub maglev: crate::dataplane::MaglevSettings,
    /// `frontendPolicy`.
    pub frontend_policy: crate::model::FrontendPolicy,
}

/// `loadBalancing.maglev` checked: a prime size the slot 0 field holds, at
/// least one table.
fn maglev_settings(
    file: Option<&MaglevFile>,
) -> Result<crate::dataplane::MaglevSettings, ConfigError> {
    let mut m = crate::dataplane::MaglevSettings::default();
    let Some(file) = file else {
        return Ok(m);
    };
    if let Some(size) = file.table_size {
        if size > u32::from(proxy_common::lb::MAGLEV_MAX_SIZE) || !crate::model::is_prime(size) {
            return Err(invalid(
                "loadBalancing.maglev.tableSize",
                format!(
                    "{size} is not a prime of at most {} (e.g. 251, 1021, 4093, 16381, 65521)",
                    proxy_common::lb::MAGLEV_MAX_SIZE
                ),
            ));
        }
        m.table_size = size as u16;
    }
    if let Some(n) = file.max_tables {
        if n == 0 || n > u32::from(u16::MAX) {
            return Err(invalid(
                "loadBalancing.maglev.maxTables",
                format!("{n} must be between 1 and 65535"),
            ));
        }
        m.max_tables = n as usize;
    }
    Ok(m)
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

fn secs(field: &str, d: Option<GoDuration>) -> Result<Option<u32>, ConfigError> {
    d.map(|GoDuration(d)| {
        u32::try_from(d.as_secs())
            .ok()
            .filter(|s| *s > 0)
            .ok_or_else(|| invalid(field, "must be between 1s and 136 years"))
    })
    .transpose()
}

impl Settings {
    /// Merges: flags over the file over the defaults; then checks the result.
    pub fn resolve(file: &ConfigFile, flags: &RunArgs) -> Result<Self, ConfigError> {
        let source = flags
            .source
            .or(file.source)
            .unwrap_or(SourceKind::Manifests);
        let manifests = if flags.manifests.is_empty() {
            file.manifests.clone().unwrap_or_default()
        } else {
            flags.manifests.clone()
        };
        if source == SourceKind::Manifests && manifests.is_empty() {
            return Err(invalid(
                "manifests",
                "the manifests source needs files or directories (--manifests or `manifests:`)",
            ));
        }
        let node_name = flags
            .node_name
            .clone()
            .filter(|n| !n.is_empty())
            .or_else(|| file.hostname_override.clone().filter(|n| !n.is_empty()))
            .or_else(crate::host::hostname)
            .ok_or_else(|| {
                invalid(
                    "hostnameOverride",
                    "no node name: pass --node-name, set NODE_NAME or hostnameOverride",
                )
            })?;
        let kubeconfig = flags.kubeconfig.clone().or_else(|| {
            file.client_connection
                .as_ref()
                .and_then(|c| c.kubeconfig.clone())
                .filter(|p| !p.as_os_str().is_empty())
        });
        let pod_interfaces = flags
            .pod_interfaces
            .clone()
            .or_else(|| file.pod_interfaces.clone())
            .unwrap_or_else(|| vec![DEFAULT_POD_INTERFACES.to_string()])
            .iter()
            .map(|p| {
                glob::Pattern::new(p)
                    .map_err(|e| invalid("podInterfaces", format!("bad pattern {p:?}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let external_interfaces = flags
            .external_interfaces
            .clone()
            .or_else(|| file.external_interfaces.clone())
            .unwrap_or_else(|| vec![DEFAULT_EXTERNAL_INTERFACES.to_string()])
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| {
                glob::Pattern::new(p)
                    .map_err(|e| invalid("externalInterfaces", format!("bad pattern {p:?}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let min_sync_period = flags
            .min_sync_period
            .or(file.min_sync_period.map(|d| d.0))
            .unwrap_or(DEFAULT_MIN_SYNC_PERIOD);
        let sync_period = flags
            .sync_period
            .or(file.sync_period.map(|d| d.0))
            .unwrap_or(DEFAULT_SYNC_PERIOD);
        if sync_period.is_zero() {
            return Err(invalid("syncPeriod", "must be greater than 0"));
        }
        if min_sync_period > sync_period {
            return Err(invalid(
                "minSyncPeriod",
                format!("{min_sync_period:?} is longer than syncPeriod {sync_period:?}"),
            ));
        }
        let healthz = flags
            .healthz_bind_address
            .clone()
            .or_else(|| file.healthz_bind_address.clone())
            .unwrap_or_else(|| DEFAULT_HEALTHZ_BIND_ADDRESS.to_string());
        let metrics = flags
            .metrics_bind_address
            .clone()
            .or_else(|| file.metrics_bind_address.clone())
            .unwrap_or_else(|| DEFAULT_METRICS_BIND_ADDRESS.to_string());

        let ct = file.conntrack.clone().unwrap_or_default();
        let mut map_sizes = MapSizes::default();
        if let Some(per_core) = ct.max_per_core.filter(|n| *n > 0) {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
            let total = (u64::from(per_core) * cpus).max(u64::from(ct.min.unwrap_or(0)));
            map_sizes.conntrack = u32::try_from(total)
                .map_err(|_| invalid("conntrack.maxPerCore", "the map would be too large"))?;
        }
        if let Some(n) = flags.conntrack_max {
            map_sizes.conntrack = n;
        }
        checked_map_sizes(file.map_sizes.as_ref(), &mut map_sizes)?;
        if map_sizes.conntrack == 0 {
            return Err(invalid("conntrack", "the conntrack map cannot be empty"));
        }
        let lb = file.load_balancing.clone().unwrap_or_default();
        let maglev = maglev_settings(lb.maglev.as_ref())?;
        let frontend_policy = frontend_policy(file.frontend_policy.as_ref())?;
        // Two generations of every table (one being rebuilt).
        map_sizes.maglev_chunks =
            2 * maglev.max_tables as u32 * proxy_common::lb::maglev_chunks(maglev.table_size);
        let conntrack_timeouts = ConntrackTimeouts {
            tcp_established_s: secs(
                "conntrack.tcpEstablishedTimeout",
                ct.tcp_established_timeout,
            )?,
            tcp_close_wait_s: secs("conntrack.tcpCloseWaitTimeout", ct.tcp_close_wait_timeout)?,
            udp_s: secs("conntrack.udpTimeout", ct.udp_timeout)?,
            udp_stream_s: secs("conntrack.udpStreamTimeout", ct.udp_stream_timeout)?,
        };
        let snat_port_range = match flags
            .snat_port_range
            .as_deref()
            .or(file.snat_port_range.as_deref())
        {
            Some(r) => Some(parse_port_range(r).map_err(|e| invalid("snatPortRange", e))?),
            None => None,
        };
        let node_port_addresses = file
            .node_port_addresses
            .clone()
            .unwrap_or_default()
            .iter()
            .map(|s| {
                crate::model::NodePortAddresses::parse(s)
                    .map_err(|e| invalid("nodePortAddresses", e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let master = flags
            .master
            .clone()
            .or_else(|| file.master.clone())
            .filter(|m| !m.trim().is_empty());
        if let Some(m) = &master {
            let ok = m
                .parse::<axum::http::Uri>()
                .ok()
                .is_some_and(|u| u.scheme().is_some() && u.authority().is_some());
            if !ok {
                return Err(invalid(
                    "master",
                    format!("{m:?} is not a URL (expected e.g. https://198.18.0.1:6443)"),
                ));
            }
        }
        let sock = file.host_socket_lb.clone().unwrap_or_default();
        let host_socket_lb = if flags.host_socket_lb.or(sock.enabled).unwrap_or(true) {
            match flags.cgroup_root.clone().or(sock.cgroup_root) {
                Some(p) => Some(p),
                None => Some(crate::bpf::cgroup2_root().ok_or_else(|| {
                    invalid(
                        "hostSocketLB.cgroupRoot",
                        "no cgroup v2 hierarchy found at /sys/fs/cgroup or /sys/fs/cgroup/unified: \
                         give its path, or set hostSocketLB.enabled: false",
                    )
                })?),
            }
        } else {
            None
        };
        let cluster_cidr = file
            .cluster_cidr
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().map_err(|e| invalid("clusterCIDR", e)))
            .transpose()?;
        Ok(Settings {
            source,
            manifests,
            node_name,
            kubeconfig,
            service_proxy_name: flags
                .service_proxy_name
                .clone()
                .or_else(|| file.service_proxy_name.clone())
                .filter(|n| !n.is_empty()),
            bpffs: flags
                .bpffs
                .clone()
                .or_else(|| file.bpffs.clone())
                .unwrap_or_else(|| DEFAULT_BPFFS.into()),
            pod_interfaces,
            external_interfaces,
            on_exit: flags.on_exit.or(file.on_exit).unwrap_or_default(),
            acceleration: flags.acceleration.or(file.acceleration).unwrap_or_default(),
            delivery_mode: flags
                .delivery_mode
                .or(file.delivery_mode)
                .unwrap_or_default(),
            snat_port_range,
            tc_attach_mode: flags
                .tc_attach_mode
                .or(file.tc_attach_mode)
                .unwrap_or_default(),
            hairpin_snat_ip: flags
                .hairpin_snat_ip
                .or(file.hairpin_snat_ip)
                .unwrap_or(DEFAULT_HAIRPIN_SNAT_IP),
            hairpin_snat_ip6: flags.hairpin_snat_ip6.or(file.hairpin_snat_ip6),
            min_sync_period,
            sync_period,
            healthz_bind_address: parse_bind_address("healthzBindAddress", &healthz, 10256)?,
            metrics_bind_address: parse_bind_address("metricsBindAddress", &metrics, 10249)?,
            map_sizes,
            conntrack_timeouts,
            node_port_addresses,
            cluster_cidr,
            master,
            host_socket_lb,
            localhost_node_ports: file.localhost_node_ports.unwrap_or(true),
            lb_algorithm: lb.algorithm.unwrap_or_default(),
            maglev,
            frontend_policy,
        })
    }

    /// Reads `flags.config` when given, then merges.
    pub fn from_flags(flags: &RunArgs) -> Result<Self, ConfigError> {
        let file = match &flags.config {
            Some(path) => ConfigFile::load(path)?,
            None => ConfigFile::default(),
        };
        Self::resolve(&file, flags)
    }
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

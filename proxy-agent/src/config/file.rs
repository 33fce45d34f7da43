//! The configuration file (`--config`): every field optional, unknown
//! fields refused, errors naming the field and where it is.
use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

use serde::Deserialize;

use super::{Acceleration, ConfigError, DeliveryMode, GoDuration, OnExit, SourceKind, KIND};

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
    /// UDP translated per packet (on by default), as kube-proxy does: the
    /// agent routes ClusterIPs to a device of its own where the pod program
    /// translates, and UDP to a NodePort, externalIP or load-balancer IP is
    /// aimed at its Service's ClusterIP, so a connected socket keeps
    /// working when its backend changes. Off: UDP is aimed at a backend at
    /// `connect()` too, and a connected socket whose backend goes is
    /// destroyed.
    pub udp_per_packet: Option<bool>,
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
    /// Address of `/readyz` and `/livez` for the pod's probes, the agent's
    /// own port: while a node is migrated, kube-proxy still holds
    /// `healthzBindAddress`'s port, and a probe there would ask kube-proxy.
    /// Empty disables it (default `127.0.0.1:10266`; the probes then use
    /// `healthzBindAddress`). Flag `--probe-bind-address`.
    pub probe_bind_address: Option<String>,
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

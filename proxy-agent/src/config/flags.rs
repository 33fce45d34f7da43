//! The flags of `proxy-agent run`. Every one is optional: what is not given
//! comes from the config file (`--config`), then from the defaults
//! ([`super::Settings::resolve`]). Here, not in `cli`, so that the
//! configuration depends on no command-line module: `cli` names the
//! commands and takes these flags from here.
use std::{net::Ipv4Addr, path::PathBuf, time::Duration};

use clap::Parser;

use super::{parse_duration, SourceKind};

// `proxy-agent run`'s flags (no doc comment: the `run` command's own is
// its help).
#[derive(Parser, Debug, Default, Clone)]
pub struct RunArgs {
    /// Configuration file (YAML, KubeProxyConfiguration field names where the
    /// meaning is the same). Flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Where desired state comes from [default: manifests].
    #[arg(long, value_enum)]
    pub source: Option<SourceKind>,
    /// Manifest files or directories (with --source manifests); repeatable.
    #[arg(long)]
    pub manifests: Vec<PathBuf>,
    /// kubeconfig file (with --source kubernetes); default: in-cluster, else
    /// $KUBECONFIG or ~/.kube/config.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The API server's own address, e.g. https://198.18.0.1:6443
    /// (kube-proxy's --master): overrides the kubeconfig's and the in-cluster
    /// KUBERNETES_SERVICE_HOST, the `kubernetes` Service's ClusterIP, which
    /// nothing translates on a node before this agent has programmed it.
    #[arg(long)]
    pub master: Option<String>,
    /// Socket-level load balancing for the node's own clients (host
    /// processes, hostNetwork pods) on cgroup v2 hooks [default: true].
    #[arg(long, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub host_socket_lb: Option<bool>,
    /// Host clients' UDP translated per packet (through the ClusterIPs,
    /// routed to a device of the agent's own), not aimed at `connect()`
    /// [default: true].
    #[arg(long, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub host_udp_per_packet: Option<bool>,
    /// The cgroup v2 directory the socket hooks attach to [default: the root
    /// of the cgroup2 hierarchy].
    #[arg(long)]
    pub cgroup_root: Option<PathBuf>,
    /// This node's name (endpoints whose nodeName equals it are local)
    /// [default: hostnameOverride, else the host name].
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// This proxy's name: only Services labelled
    /// service.kubernetes.io/service-proxy-name=<name> are served. Without it,
    /// Services carrying the label are left to their proxy.
    #[arg(long)]
    pub service_proxy_name: Option<String>,
    /// Directory on a bpffs mount where maps are pinned and adopted on restart
    /// [default: /sys/fs/bpf/proxy-agent].
    #[arg(long)]
    pub bpffs: Option<PathBuf>,
    /// Glob patterns of pod interfaces (host side of pod veths), comma
    /// separated [default: lxc*].
    #[arg(long, value_delimiter = ',')]
    pub pod_interfaces: Option<Vec<String>>,
    /// Glob patterns of the node's external devices (towards other nodes and
    /// external clients), comma separated; they get the NodePort /
    /// load-balancer / externalIP program and the reverse NAT of replies from
    /// other nodes [default: eth0].
    #[arg(long, value_delimiter = ',')]
    pub external_interfaces: Option<Vec<String>>,
    /// What to do with the datapath on exit: `detach` (clean shutdown),
    /// `keep` (Services keep working until the next agent takes over; for
    /// restarts and rolling updates) or `drain` (handing the node back to
    /// kube-proxy: tracked flows stay translated, new ones go to its rules)
    /// [default: detach].
    #[arg(long, value_enum)]
    pub on_exit: Option<crate::config::OnExit>,
    /// Acceleration of external traffic: `none` (tc) or `xdp` (XDP on the
    /// external devices, falling back to tc) [default: none].
    #[arg(long, value_enum)]
    pub acceleration: Option<crate::config::Acceleration>,
    /// How translated packets reach their backend: `auto` (`stack` when a
    /// NetworkPolicy engine's chains are in the host's iptables/nftables),
    /// `redirect` (no netfilter: fastest, bypasses such engines) or `stack`
    /// (the host's forward filtering sees the backend) [default: auto].
    #[arg(long, value_enum)]
    pub delivery_mode: Option<crate::config::DeliveryMode>,
    /// Source ports for SNATed flows, `min-max`, outside the host's
    /// ip_local_port_range [default: the larger span of 1024-65535 outside it].
    #[arg(long)]
    pub snat_port_range: Option<String>,
    /// How tc programs are attached: `auto` (tcx links where the kernel has
    /// them, probed, else a clsact qdisc with direct-action cls_bpf
    /// filters), `tcx` or `legacy` [default: auto].
    #[arg(long, value_enum)]
    pub tc_attach_mode: Option<crate::bpf::TcAttachMode>,
    /// Source address given to hairpin traffic (a pod reaching itself through a
    /// Service) [default: 169.254.42.1, Cilium's service loopback address].
    #[arg(long)]
    pub hairpin_snat_ip: Option<Ipv4Addr>,
    /// Source address given to IPv6 hairpin traffic [default: the node's
    /// IPv6 address].
    #[arg(long = "hairpin-snat-ip6")]
    pub hairpin_snat_ip6: Option<std::net::Ipv6Addr>,
    /// Minimum time between two syncs (kube-proxy's minSyncPeriod), a Go
    /// duration: 1s, 100ms [default: 1s].
    #[arg(long, value_parser = parse_duration)]
    pub min_sync_period: Option<Duration>,
    /// Full resync period (kube-proxy's syncPeriod) [default: 30s].
    #[arg(long, value_parser = parse_duration)]
    pub sync_period: Option<Duration>,
    /// Capacity of the conntrack map (entries; two per flow); overrides
    /// conntrack.maxPerCore of the config file.
    #[arg(long)]
    pub conntrack_max: Option<u32>,
    /// Address of /healthz, /livez and /proxyMode; empty disables
    /// [default: 0.0.0.0:10256].
    #[arg(long)]
    pub healthz_bind_address: Option<String>,
    /// Address of /metrics (Prometheus); empty disables [default: 127.0.0.1:10249].
    #[arg(long)]
    pub metrics_bind_address: Option<String>,
    /// Address of /readyz and /livez for the pod's probes (the agent's own
    /// port, free while kube-proxy holds the healthz port); empty disables
    /// [default: 127.0.0.1:10266].
    #[arg(long)]
    pub probe_bind_address: Option<String>,
}

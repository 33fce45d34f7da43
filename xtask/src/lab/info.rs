//! lab.json: what the lab is made of (nodes, clients, pods, frontends,
//! processes), and the accessors of [`Lab`] that read it.
//!
//! The IPv6 fields (`ip6`, `pod_cidr6`, `dual_stack`) are set in a
//! dual-stack lab only, and left out of lab.json otherwise: a lab.json
//! written before they existed still loads.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};

use super::Lab;
use crate::manifests::Object;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NodeInfo {
    pub name: String,
    pub netns: String,
    pub ip: Ipv4Addr,
    /// The node's IPv6 address (dual-stack): `2001:2::<9+i>`, on `lo` or,
    /// with a switch, on `eth0` (/64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip6: Option<Ipv6Addr>,
    /// The node's pod CIDR (`198.18.i.0/24`).
    #[serde(default)]
    pub pod_cidr: String,
    /// The node's IPv6 pod CIDR (dual-stack): `2001:2:0:i::/64`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_cidr6: Option<String>,
    /// `topology.kubernetes.io/zone` of the lab's Node object, if any.
    #[serde(default)]
    pub zone: Option<String>,
    /// The node's running agent.
    #[serde(default)]
    pub agent: Option<AgentInfo>,
    /// The node's agent's log (also while it is not running).
    #[serde(default)]
    pub agent_log: PathBuf,
    /// The node's agent's pin directory.
    #[serde(default)]
    pub bpffs: PathBuf,
    /// Interface towards the switch (`eth0`), empty without a switch.
    #[serde(default)]
    pub eth: String,
    /// The node's own cgroup v2 directory (`<cgroup2>/kpr-lab-<id>/node-i`):
    /// the agent attaches its socket hooks there, never to the machine's
    /// root cgroup, and the node's host clients run in it. `None` where the
    /// machine has no cgroup2 hierarchy (host socket LB off).
    #[serde(default)]
    pub cgroup: Option<PathBuf>,
    /// The real kube-proxy running on the node in the agent's place
    /// ([`super::kube_proxy`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kube_proxy: Option<super::kube_proxy::KubeProxyInfo>,
}

/// A pod-like namespace attached to the node by a veth pair.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Endpoint {
    pub name: String,
    pub netns: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address (dual-stack), the twin of `ip`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip6: Option<Ipv6Addr>,
    /// The host-side veth in the node namespace (`lxc<8 hex>`); for the
    /// external client, its port in the switch namespace.
    pub host_if: String,
    /// The node the endpoint hangs off (empty for the external client).
    #[serde(default)]
    pub node: String,
}

/// A declared container port.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PortInfo {
    pub port: u16,
    pub protocol: String,
}

/// A pod of the lab. hostNetwork pods have the node's namespace and address
/// and an empty `host_if` (and no server).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PodInfo {
    pub name: String,
    pub namespace: String,
    pub node: String,
    pub netns: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address (dual-stack): `podIPs`' IPv6 entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip6: Option<Ipv6Addr>,
    pub host_if: String,
    pub ports: Vec<PortInfo>,
    /// The pod's server does not listen on its SCTP ports (the Pod's
    /// annotation [`SCTP_LISTENER_ANNOTATION`](super::SCTP_LISTENER_ANNOTATION)
    /// is `"false"`): an SCTP socket loads the kernel's sctp module, which a
    /// test of the proxy's own effect on it (S41) must not do.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_sctp_listener: bool,
}

/// A Service frontend: `(ip, port, protocol)`, of either family.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Frontend {
    /// `namespace/name` of the Service.
    pub service: String,
    /// Compares with an `Ipv4Addr` as well (`f.ip == node.ip`).
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: String,
    pub port_name: Option<String>,
    /// `ClusterIP`, `ExternalIP`, `LoadBalancer` or `NodePort`.
    pub kind: String,
}

impl Frontend {
    /// An IPv4 frontend as a socket address. Panics on an IPv6 frontend
    /// (only a dual-stack lab has them): [`socket_addr`](Frontend::socket_addr)
    /// takes both.
    pub fn addr(&self) -> SocketAddrV4 {
        match self.ip {
            IpAddr::V4(ip) => SocketAddrV4::new(ip, self.port),
            IpAddr::V6(ip) => panic!(
                "frontend [{ip}]:{} of {} is IPv6: use Frontend::socket_addr",
                self.port, self.service
            ),
        }
    }

    /// The frontend as a socket address, of either family.
    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, self.port)
    }

    /// Whether the frontend's address is IPv6.
    pub fn is_ipv6(&self) -> bool {
        self.ip.is_ipv6()
    }
}

/// The running agent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AgentInfo {
    pub pid: u32,
    pub log: PathBuf,
    /// The runc container the agent runs in (runc mode), by id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

/// A running pod server.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ServerInfo {
    /// The pod's name.
    pub pod: String,
    /// The pod's Kubernetes namespace.
    pub namespace: String,
    pub pid: u32,
    pub log: PathBuf,
}

/// Everything about a lab: written to `<lab dir>/lab.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LabInfo {
    pub id: String,
    pub dir: PathBuf,
    pub manifests_dir: PathBuf,
    /// Whether every node, pod and client has an IPv6 address too
    /// ([`LabBuilder::dual_stack`](super::LabBuilder::dual_stack)).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dual_stack: bool,
    /// node-1's pin directory.
    pub bpffs: PathBuf,
    /// node-1 (kept in step with `nodes[0]`).
    pub node: NodeInfo,
    /// Every node, node-1 first.
    #[serde(default)]
    pub nodes: Vec<NodeInfo>,
    /// The switch namespace, if the lab has one.
    #[serde(default)]
    pub switch_netns: Option<String>,
    /// The external client on the switch, if the lab has one.
    #[serde(default)]
    pub external: Option<Endpoint>,
    pub client: Endpoint,
    /// Clients added with [`Lab::add_client`].
    pub clients: Vec<Endpoint>,
    pub pods: Vec<PodInfo>,
    pub frontends: Vec<Frontend>,
    /// node-1's agent.
    pub agent: Option<AgentInfo>,
    pub servers: Vec<ServerInfo>,
    /// Every network namespace the lab created (torn down in reverse order).
    pub namespaces: Vec<String>,
    /// The real control plane, if the lab runs one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane: Option<super::ControlPlaneInfo>,
}

impl LabInfo {
    /// Reads a lab.json.
    pub fn load(path: &Path) -> Result<LabInfo> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))
    }

    /// A node by name (`node-1`, ...).
    pub fn node_named(&self, name: &str) -> Option<&NodeInfo> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// A pod by `name` or `namespace/name`.
    pub fn pod(&self, name: &str) -> Option<&PodInfo> {
        let (ns, n) = split_name(name);
        self.pods
            .iter()
            .find(|p| p.name == n && ns.is_none_or(|ns| ns == p.namespace))
    }

    /// Frontends of a Service given as `name` or `namespace/name`.
    pub fn frontends_of(&self, service: &str) -> Vec<&Frontend> {
        let (ns, n) = split_name(service);
        self.frontends
            .iter()
            .filter(|f| {
                let (fns, fname) = f.service.split_once('/').unwrap_or(("default", &f.service));
                fname == n && ns.is_none_or(|ns| ns == fns)
            })
            .collect()
    }

    /// The IPv4 ClusterIP frontend of `service` for `port`/`protocol`.
    pub fn cluster_frontend(&self, service: &str, port: u16, protocol: &str) -> Option<&Frontend> {
        self.cluster_frontend_of(service, port, protocol, false)
    }

    /// The IPv6 ClusterIP frontend of `service` for `port`/`protocol`
    /// (dual-stack labs).
    pub fn cluster_frontend6(&self, service: &str, port: u16, protocol: &str) -> Option<&Frontend> {
        self.cluster_frontend_of(service, port, protocol, true)
    }

    fn cluster_frontend_of(
        &self,
        service: &str,
        port: u16,
        protocol: &str,
        ipv6: bool,
    ) -> Option<&Frontend> {
        self.frontends_of(service).into_iter().find(|f| {
            f.kind == "ClusterIP"
                && f.is_ipv6() == ipv6
                && f.port == port
                && f.protocol.eq_ignore_ascii_case(protocol)
        })
    }
}

pub(super) fn split_name(name: &str) -> (Option<&str>, &str) {
    match name.split_once('/') {
        Some((ns, n)) => (Some(ns), n),
        None => (None, name),
    }
}

pub(super) fn write_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, contents).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))?;
    Ok(())
}

impl Lab {
    /// The lab's description (as in lab.json).
    pub fn info(&self) -> &LabInfo {
        &self.info
    }

    /// The lab's id.
    pub fn id(&self) -> &str {
        &self.info.id
    }

    /// The lab's state directory.
    pub fn dir(&self) -> &Path {
        &self.info.dir
    }

    /// Path of lab.json.
    pub fn json_path(&self) -> PathBuf {
        self.info.dir.join("lab.json")
    }

    /// Path of node-1's agent's log.
    pub fn agent_log_path(&self) -> PathBuf {
        self.info.nodes[0].agent_log.clone()
    }

    /// node-1's agent's log so far.
    pub fn agent_log(&self) -> String {
        std::fs::read_to_string(self.agent_log_path()).unwrap_or_default()
    }

    /// Path of the agent log of node `node` (`node-2`).
    pub fn agent_log_path_on(&self, node: &str) -> Result<PathBuf> {
        Ok(self.node_info(node)?.agent_log.clone())
    }

    /// The agent log of node `node` so far.
    pub fn agent_log_on(&self, node: &str) -> Result<String> {
        Ok(std::fs::read_to_string(self.agent_log_path_on(node)?).unwrap_or_default())
    }

    /// node-1.
    pub fn node(&self) -> &NodeInfo {
        &self.info.node
    }

    /// Every node, node-1 first.
    pub fn nodes(&self) -> &[NodeInfo] {
        &self.info.nodes
    }

    /// A node by name (`node-2`).
    pub fn node_named(&self, name: &str) -> Option<&NodeInfo> {
        self.info.node_named(name)
    }

    pub(super) fn node_index(&self, name: &str) -> Result<usize> {
        self.info
            .nodes
            .iter()
            .position(|n| n.name == name)
            .ok_or_else(|| {
                anyhow!(
                    "no node {name} in lab {} ({})",
                    self.info.id,
                    self.info
                        .nodes
                        .iter()
                        .map(|n| n.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
    }

    pub(super) fn node_info(&self, name: &str) -> Result<&NodeInfo> {
        Ok(&self.info.nodes[self.node_index(name)?])
    }

    /// Whether the lab is dual-stack.
    pub fn is_dual_stack(&self) -> bool {
        self.info.dual_stack
    }

    /// The external client on the switch (198.18.0.100), if the lab has a
    /// switch: it reaches node addresses and pod IPs, not ClusterIPs.
    pub fn external(&self) -> Option<&Endpoint> {
        self.info.external.as_ref()
    }

    /// The default client (198.18.1.2).
    pub fn client(&self) -> &Endpoint {
        &self.info.client
    }

    /// A pod by `name` or `namespace/name`.
    pub fn pod(&self, name: &str) -> Option<&PodInfo> {
        self.info.pod(name)
    }

    /// All pods.
    pub fn pods(&self) -> &[PodInfo] {
        &self.info.pods
    }

    /// All frontends.
    pub fn frontends(&self) -> &[Frontend] {
        &self.info.frontends
    }

    /// The IPv4 ClusterIP frontend of `service` (`name` or `ns/name`) for
    /// `port`/`protocol`.
    pub fn cluster_frontend(
        &self,
        service: &str,
        port: u16,
        protocol: &str,
    ) -> Option<SocketAddrV4> {
        self.info
            .cluster_frontend(service, port, protocol)
            .map(Frontend::addr)
    }

    /// The IPv6 ClusterIP frontend of `service` for `port`/`protocol`
    /// (dual-stack labs).
    pub fn cluster_frontend6(
        &self,
        service: &str,
        port: u16,
        protocol: &str,
    ) -> Option<SocketAddr> {
        self.info
            .cluster_frontend6(service, port, protocol)
            .map(Frontend::socket_addr)
    }

    /// The IPv4 ClusterIP of `service`.
    pub fn service_ip(&self, service: &str) -> Option<Ipv4Addr> {
        self.service_ips(service)
            .into_iter()
            .find_map(|ip| match ip {
                IpAddr::V4(ip) => Some(ip),
                IpAddr::V6(_) => None,
            })
    }

    /// The IPv6 ClusterIP of `service` (dual-stack labs).
    pub fn service_ip6(&self, service: &str) -> Option<Ipv6Addr> {
        self.service_ips(service)
            .into_iter()
            .find_map(|ip| match ip {
                IpAddr::V6(ip) => Some(ip),
                IpAddr::V4(_) => None,
            })
    }

    /// The ClusterIPs of `service`, in `clusterIPs` order.
    pub fn service_ips(&self, service: &str) -> Vec<IpAddr> {
        let mut ips: Vec<IpAddr> = Vec::new();
        for f in self.info.frontends_of(service) {
            if f.kind == "ClusterIP" && !ips.contains(&f.ip) {
                ips.push(f.ip);
            }
        }
        ips
    }

    /// The current manifests (as written to cluster.yaml).
    pub fn objects(&self) -> &[Object] {
        &self.objects
    }

    pub(super) fn save(&mut self) -> Result<()> {
        // node-1 mirrors, for readers of the single-node fields.
        self.info.node = self.info.nodes[0].clone();
        self.info.agent = self.info.nodes[0].agent.clone();
        self.info.bpffs = self.info.nodes[0].bpffs.clone();
        let json = serde_json::to_string_pretty(&self.info)?;
        write_atomic(&self.json_path(), json.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lab.json as an IPv4 lab wrote it before the IPv6 fields existed.
    const OLD: &str = r#"{
  "id": "abc123", "dir": "/run/kpr-lab/abc123", "manifests_dir": "/run/kpr-lab/abc123/manifests",
  "bpffs": "/sys/fs/bpf/kpr-lab-abc123",
  "node": {"name": "node-1", "netns": "kpr-abc123-node", "ip": "198.18.0.10"},
  "client": {"name": "client", "netns": "kpr-abc123-client", "ip": "198.18.1.2", "host_if": "lxc00000001"},
  "clients": [],
  "pods": [{"name": "p", "namespace": "default", "node": "node-1", "netns": "kpr-abc123-p",
            "ip": "198.18.1.10", "host_if": "lxc00000002", "ports": []}],
  "frontends": [{"service": "default/web", "ip": "198.19.0.10", "port": 80, "protocol": "TCP",
                 "port_name": "http", "kind": "ClusterIP"}],
  "agent": null, "servers": [], "namespaces": []
}"#;

    #[test]
    fn an_old_lab_json_loads_and_an_ipv4_lab_writes_no_ipv6_fields() {
        let info: LabInfo = serde_json::from_str(OLD).unwrap();
        assert!(!info.dual_stack);
        assert_eq!(info.pods[0].ip6, None);
        assert_eq!(info.node.ip6, None);
        let f = info.cluster_frontend("web", 80, "TCP").unwrap();
        assert_eq!(f.addr(), "198.19.0.10:80".parse().unwrap());
        assert!(info.cluster_frontend6("web", 80, "TCP").is_none());
        let json = serde_json::to_string(&info).unwrap();
        for key in ["ip6", "pod_cidr6", "dual_stack"] {
            assert!(!json.contains(key), "{key} in {json}");
        }
    }

    #[test]
    fn ipv6_frontends_and_addresses_round_trip() {
        let mut info: LabInfo = serde_json::from_str(OLD).unwrap();
        info.dual_stack = true;
        info.pods[0].ip6 = Some("2001:2:0:1::a".parse().unwrap());
        let mut f6 = info.frontends[0].clone();
        f6.ip = "2001:2:0:ff::a".parse().unwrap();
        info.frontends.push(f6);
        let again: LabInfo = serde_json::from_str(&serde_json::to_string(&info).unwrap()).unwrap();
        assert_eq!(again, info);
        let f = again.cluster_frontend6("default/web", 80, "tcp").unwrap();
        assert_eq!(f.socket_addr(), "[2001:2:0:ff::a]:80".parse().unwrap());
        assert!(f.is_ipv6());
        // The IPv4 accessor still finds the IPv4 frontend, whatever the order.
        info.frontends.reverse();
        assert_eq!(
            info.cluster_frontend("web", 80, "TCP").unwrap().addr(),
            "198.19.0.10:80".parse().unwrap()
        );
    }
}

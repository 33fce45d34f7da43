//! lab.json: what the lab is made of (nodes, clients, pods, frontends,
//! processes), and the accessors of [`Lab`] that read it.

use std::net::{Ipv4Addr, SocketAddrV4};
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
    /// The node's pod CIDR (`198.18.i.0/24`).
    #[serde(default)]
    pub pod_cidr: String,
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
}

/// A pod-like namespace attached to the node by a veth pair.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Endpoint {
    pub name: String,
    pub netns: String,
    pub ip: Ipv4Addr,
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
    pub host_if: String,
    pub ports: Vec<PortInfo>,
    /// The pod's server does not listen on its SCTP ports (the Pod's
    /// annotation [`SCTP_LISTENER_ANNOTATION`](super::SCTP_LISTENER_ANNOTATION)
    /// is `"false"`): an SCTP socket loads the kernel's sctp module, which a
    /// test of the proxy's own effect on it (S41) must not do.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_sctp_listener: bool,
}

/// A Service frontend: `(ip, port, protocol)`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Frontend {
    /// `namespace/name` of the Service.
    pub service: String,
    pub ip: Ipv4Addr,
    pub port: u16,
    pub protocol: String,
    pub port_name: Option<String>,
    /// `ClusterIP`, `ExternalIP`, `LoadBalancer` or `NodePort`.
    pub kind: String,
}

impl Frontend {
    /// The frontend as a socket address.
    pub fn addr(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.ip, self.port)
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

    /// The ClusterIP frontend of `service` for `port`/`protocol`.
    pub fn cluster_frontend(&self, service: &str, port: u16, protocol: &str) -> Option<&Frontend> {
        self.frontends_of(service).into_iter().find(|f| {
            f.kind == "ClusterIP" && f.port == port && f.protocol.eq_ignore_ascii_case(protocol)
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

    /// The ClusterIP frontend of `service` (`name` or `ns/name`) for
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

    /// The ClusterIP of `service`.
    pub fn service_ip(&self, service: &str) -> Option<Ipv4Addr> {
        self.info
            .frontends_of(service)
            .into_iter()
            .find(|f| f.kind == "ClusterIP")
            .map(|f| f.ip)
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

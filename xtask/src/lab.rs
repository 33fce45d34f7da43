//! The lab: network namespaces playing a node, its pods and clients, one
//! proxy-agent per node namespace, one `lab-server` per pod.
//!
//! Topology with one node (the default): `<prefix>-node` holds the gateway
//! 198.18.0.1/32 and the node address on `lo` and one `lxc<8 hex>` veth per
//! pod; each pod namespace has `eth0` with its /32, a link route to the
//! gateway and 198.18.0.0/15 via the gateway (no default route).
//!
//! With [`LabBuilder::nodes`]` > 1` (or [`LabBuilder::external`]), a switch
//! namespace `<prefix>-sw` holds a bridge `br0`; node i (1-based, namespace
//! `<prefix>-node-i`, or `<prefix>-node` for a single node) has `eth0` on the
//! bridge with 198.18.0.(9+i)/24, the pod CIDR 198.18.i.0/24 and routes to the
//! other nodes' pod CIDRs via their node addresses; each node still answers
//! for the gateway 198.18.0.1 of its own pods. An external client
//! `<prefix>-ext` (198.18.0.100/24) sits on the bridge with routes to every
//! pod CIDR but none to ClusterIPs. Every address is in 198.18.0.0/15.
//!
//! A [`Lab`] tears everything down when dropped, unless it was
//! [`detach`](Lab::detach)ed (`cargo xtask lab up`) or [`attach`](Lab::attach)ed;
//! then [`down`](Lab::down) removes it.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::manifests::{self, pod_ports, Allocator, Object};
use crate::netns::{self, check_lab_addr, create_netns, delete_netns, ip_in, sysctl_in};
use crate::setup;

/// Substring the agent logs after every completed sync.
pub const SYNC_MARKER: &str = "sync complete";
/// Where labs keep their state.
pub const LAB_ROOT: &str = "/run/kpr-lab";
/// Prefix of each lab's bpffs pin directory under /sys/fs/bpf.
pub const BPFFS_PREFIX: &str = "/sys/fs/bpf/kpr-lab-";
/// Name of the (only, for now) node.
pub const NODE_NAME: &str = "node-1";
/// The node's address (on its `lo`).
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 10);
/// The pods' gateway, a local address of the node namespace.
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// Source address for hairpin SNAT, passed to the agent.
pub const HAIRPIN_SNAT_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 254);
/// The node's pod CIDR.
pub const POD_CIDR: &str = "198.18.1.0/24";
/// First and last address handed to pods.
pub const POD_IP_FIRST: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 10);
pub const POD_IP_LAST: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 254);
/// The default client's address.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);
/// Range of extra clients ([`Lab::add_client`]).
pub const EXTRA_CLIENT_FIRST: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 3);
pub const EXTRA_CLIENT_LAST: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 9);
/// The lab route every pod namespace has (via the gateway).
pub const LAB_ROUTE: &str = "198.18.0.0/15";
/// Default port of a pod's server when it declares no containerPort.
pub const DEFAULT_POD_PORT: u16 = 80;

/// Most nodes a lab can have.
pub const MAX_NODES: usize = 50;
/// The switch namespace's bridge.
pub const BRIDGE: &str = "br0";
/// The external client's address (on the switch's link).
pub const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
/// Prefix length of the node link (198.18.0.0/24).
pub const NODE_LINK_PREFIX: u8 = 24;

/// The address of node `i` (1-based): 198.18.0.(9+i).
pub fn node_ip(i: usize) -> Ipv4Addr {
    assert!((1..=MAX_NODES).contains(&i), "node index {i} out of range");
    Ipv4Addr::new(198, 18, 0, 9 + i as u8)
}

/// The pod CIDR of node `i` (1-based): 198.18.i.0/24.
pub fn node_pod_cidr(i: usize) -> String {
    assert!((1..=MAX_NODES).contains(&i), "node index {i} out of range");
    format!("198.18.{i}.0/24")
}

/// An address of node `i`'s pod CIDR: 198.18.i.`host`.
pub fn node_pod_addr(i: usize, host: u8) -> Ipv4Addr {
    assert!((1..=MAX_NODES).contains(&i), "node index {i} out of range");
    Ipv4Addr::new(198, 18, i as u8, host)
}

/// A node of the lab.
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

fn split_name(name: &str) -> (Option<&str>, &str) {
    match name.split_once('/') {
        Some((ns, n)) => (Some(ns), n),
        None => (None, name),
    }
}

/// How to start a [`Lab`].
#[derive(Debug, Clone, Default)]
pub struct LabBuilder {
    manifests_path: Option<PathBuf>,
    manifests_yaml: Vec<String>,
    agent: Option<bool>,
    agent_bin: Option<PathBuf>,
    server_bin: Option<PathBuf>,
    agent_args: Vec<String>,
    agent_source_args: Option<Vec<String>>,
    rust_log: Option<String>,
    nodes: Option<usize>,
    zones: Vec<String>,
    external: Option<bool>,
}

impl LabBuilder {
    /// Number of nodes (default 1; at most [`MAX_NODES`]). With more than
    /// one, the lab gets a switch, `eth0` on every node and an external
    /// client.
    pub fn nodes(mut self, n: usize) -> Self {
        self.nodes = Some(n);
        self
    }

    /// Zones of the nodes, in node order (`zones[i]` for node i+1; nodes
    /// beyond the list get none): the `topology.kubernetes.io/zone` label of
    /// the Node objects the lab writes.
    pub fn zones(mut self, zones: &[&str]) -> Self {
        self.zones = zones.iter().map(|z| z.to_string()).collect();
        self
    }

    /// Whether to build the switch, the nodes' `eth0` and the external
    /// client (default: only with more than one node). With a single node,
    /// the node address moves from `lo` to `eth0`.
    pub fn external(mut self, on: bool) -> Self {
        self.external = Some(on);
        self
    }

    /// Manifests from a file or a directory of `*.yaml` files.
    pub fn manifests_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.manifests_path = Some(path.into());
        self
    }

    /// Manifests as YAML text (added after those of the path).
    pub fn manifests_yaml(mut self, yaml: &str) -> Self {
        self.manifests_yaml.push(yaml.to_string());
        self
    }

    /// Whether to start the agent (default: yes).
    pub fn agent(mut self, start: bool) -> Self {
        self.agent = Some(start);
        self
    }

    /// The proxy-agent binary (default: `KPR_AGENT_BIN`, else
    /// the release agent, built or brought up to date first).
    pub fn agent_bin(mut self, path: impl Into<PathBuf>) -> Self {
        self.agent_bin = Some(path.into());
        self
    }

    /// The lab-server binary; tests pass `env!("CARGO_BIN_EXE_lab-server")`.
    pub fn server_bin(mut self, path: impl Into<PathBuf>) -> Self {
        self.server_bin = Some(path.into());
        self
    }

    /// An extra argument appended to the agent's command line.
    pub fn agent_arg(mut self, arg: impl Into<String>) -> Self {
        self.agent_args.push(arg.into());
        self
    }

    /// Arguments that replace the default `--source manifests --manifests
    /// <lab dir>/manifests` of the agent's command line (for example
    /// `--source kubernetes --kubeconfig <file>`). The lab still writes its
    /// manifests and creates pods from them; only the agent reads elsewhere.
    pub fn agent_source_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.agent_source_args = Some(args.into_iter().map(Into::into).collect());
        self
    }

    /// RUST_LOG for the agent (default: inherited, else `info`).
    pub fn rust_log(mut self, filter: impl Into<String>) -> Self {
        self.rust_log = Some(filter.into());
        self
    }

    /// Creates the lab. Does not wait for the agent: call
    /// [`Lab::wait_ready`]. On error everything created so far is removed.
    pub fn start(self) -> Result<Lab> {
        Lab::start(self)
    }
}

/// A running lab. Dropping it tears it down (unless detached or attached).
pub struct Lab {
    info: LabInfo,
    objects: Vec<Object>,
    alloc: Allocator,
    children: HashMap<u32, Child>,
    agent_bin: Option<PathBuf>,
    agent_args: Vec<String>,
    /// Replaces `--source manifests --manifests <dir>` when set.
    agent_source_args: Option<Vec<String>>,
    rust_log: Option<String>,
    server_bin: Option<PathBuf>,
    /// Per node: marker count when its agent was last started.
    agent_start_marks: Vec<usize>,
    /// Per node: marker count when the manifests were last written.
    write_marks: Vec<usize>,
    /// Whether the agent binary knows `--external-interfaces` (asked once).
    agent_has_ext_flag: Option<bool>,
    keep: bool,
}

fn new_allocator(nodes: &[NodeInfo]) -> Allocator {
    let first = &nodes[0];
    let mut a = Allocator::new(&first.name, first.ip, POD_IP_FIRST, POD_IP_LAST);
    for (i, n) in nodes.iter().enumerate().skip(1) {
        let i = i + 1;
        a.add_node(
            &n.name,
            n.ip,
            node_pod_addr(i, POD_IP_FIRST.octets()[3]),
            node_pod_addr(i, POD_IP_LAST.octets()[3]),
        );
    }
    for ip in [GATEWAY_IP, HAIRPIN_SNAT_IP, CLIENT_IP, EXTERNAL_IP] {
        a.reserve_ip(ip);
    }
    for n in nodes {
        a.reserve_ip(n.ip);
    }
    a
}

/// `KPR_AGENT_BIN`, else the release agent, built (or brought up to date —
/// a no-op when it is) first, so that a lab never runs a stale binary.
fn find_agent_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KPR_AGENT_BIN") {
        return Ok(PathBuf::from(p));
    }
    setup::build_agent()
}

fn find_server_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KPR_LAB_SERVER_BIN") {
        return Ok(PathBuf::from(p));
    }
    if let Ok(exe) = std::env::current_exe() {
        let mut dir = exe.parent();
        for _ in 0..2 {
            let Some(d) = dir else { break };
            let p = d.join("lab-server");
            if p.is_file() {
                return Ok(p);
            }
            dir = d.parent();
        }
    }
    let p = setup::target_dir().join("debug/lab-server");
    if p.is_file() {
        return Ok(p);
    }
    setup::build_lab_server()
}

fn count_markers(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .map(|t| t.lines().filter(|l| l.contains(SYNC_MARKER)).count())
        .unwrap_or(0)
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn write_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, contents).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))?;
    Ok(())
}

fn cmdline(pid: u32) -> Option<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
}

fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // Field 3 is the state; Z is a zombie waiting for its parent.
        Ok(s) => s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

fn frontends_of(objects: &[Object], node_ips: &[Ipv4Addr]) -> Vec<Frontend> {
    let mut out = Vec::new();
    for o in objects {
        let Object::Service(svc) = o else { continue };
        let Some(spec) = &svc.spec else { continue };
        if spec.type_.as_deref() == Some("ExternalName")
            || spec.cluster_ip.as_deref() == Some("None")
        {
            continue;
        }
        let service = format!(
            "{}/{}",
            svc.metadata.namespace.as_deref().unwrap_or("default"),
            svc.metadata.name.as_deref().unwrap_or("")
        );
        let parse = |s: &str| s.parse::<Ipv4Addr>().ok();
        let mut addrs: Vec<(Ipv4Addr, &str)> = Vec::new();
        let cluster_ips = spec
            .cluster_ips
            .clone()
            .or_else(|| spec.cluster_ip.clone().map(|c| vec![c]))
            .unwrap_or_default();
        addrs.extend(
            cluster_ips
                .iter()
                .filter_map(|a| parse(a))
                .map(|a| (a, "ClusterIP")),
        );
        addrs.extend(
            spec.external_ips
                .iter()
                .flatten()
                .filter_map(|a| parse(a))
                .map(|a| (a, "ExternalIP")),
        );
        if let Some(ing) = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|l| l.ingress.as_ref())
        {
            addrs.extend(
                ing.iter()
                    .filter_map(|i| i.ip.as_deref().and_then(parse))
                    .map(|a| (a, "LoadBalancer")),
            );
        }
        for p in spec.ports.iter().flatten() {
            let protocol = p.protocol.clone().unwrap_or_else(|| "TCP".to_string());
            let Ok(port) = u16::try_from(p.port) else {
                continue;
            };
            for (ip, kind) in &addrs {
                out.push(Frontend {
                    service: service.clone(),
                    ip: *ip,
                    port,
                    protocol: protocol.clone(),
                    port_name: p.name.clone(),
                    kind: kind.to_string(),
                });
            }
            if let Some(np) = p.node_port.and_then(|n| u16::try_from(n).ok()) {
                for ip in node_ips {
                    out.push(Frontend {
                        service: service.clone(),
                        ip: *ip,
                        port: np,
                        protocol: protocol.clone(),
                        port_name: p.name.clone(),
                        kind: "NodePort".to_string(),
                    });
                }
            }
        }
    }
    out
}

type PodKey = (String, String);

fn pods_of(objects: &[Object]) -> BTreeMap<PodKey, &k8s_openapi::api::core::v1::Pod> {
    objects
        .iter()
        .filter_map(|o| match o {
            Object::Pod(p) => Some((
                (
                    p.metadata.namespace.clone().unwrap_or_default(),
                    p.metadata.name.clone().unwrap_or_default(),
                ),
                p.as_ref(),
            )),
            _ => None,
        })
        .collect()
}

fn object_ips(o: &Object) -> Vec<Ipv4Addr> {
    let mut v = Vec::new();
    match o {
        Object::Pod(p) => v.extend(
            p.status
                .as_ref()
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|a| a.parse::<Ipv4Addr>().ok()),
        ),
        Object::Service(s) => {
            if let Some(spec) = &s.spec {
                v.extend(
                    spec.cluster_ips
                        .iter()
                        .flatten()
                        .filter_map(|a| a.parse::<Ipv4Addr>().ok()),
                );
                v.extend(
                    spec.cluster_ip
                        .iter()
                        .filter_map(|a| a.parse::<Ipv4Addr>().ok()),
                );
            }
        }
        _ => {}
    }
    v
}

impl Lab {
    /// A builder with defaults.
    pub fn builder() -> LabBuilder {
        LabBuilder::default()
    }

    /// Starts a lab from a manifests file or directory, with the agent.
    pub fn up(manifests: impl Into<PathBuf>) -> Result<Lab> {
        Lab::builder().manifests_path(manifests).start()
    }

    fn start(b: LabBuilder) -> Result<Lab> {
        if !setup::is_root() {
            bail!("the lab needs root (network namespaces, bpffs)");
        }
        setup::ensure_bpffs(false)?;
        let mut objects = Vec::new();
        if let Some(p) = &b.manifests_path {
            objects.extend(manifests::load_path(p)?);
        }
        for (i, y) in b.manifests_yaml.iter().enumerate() {
            objects.extend(manifests::parse_yaml(y, &format!("manifests_yaml[{i}]"))?);
        }
        let with_agent = b.agent.unwrap_or(true);
        let agent_bin = match (with_agent, b.agent_bin) {
            (false, _) => None,
            (true, Some(p)) => Some(p),
            (true, None) => Some(find_agent_bin()?),
        };
        if let Some(p) = &agent_bin {
            if !p.is_file() {
                bail!("agent binary {} does not exist", p.display());
            }
        }
        let server_bin = match b.server_bin {
            Some(p) => p,
            None => find_server_bin()?,
        };

        let n_nodes = b.nodes.unwrap_or(1);
        if !(1..=MAX_NODES).contains(&n_nodes) {
            bail!("a lab has 1 to {MAX_NODES} nodes, not {n_nodes}");
        }
        let with_switch = b.external.unwrap_or(n_nodes > 1);

        std::fs::create_dir_all(LAB_ROOT)?;
        let (id, dir) = loop {
            let id = netns::hex(&netns::random_bytes::<3>());
            let dir = Path::new(LAB_ROOT).join(&id);
            let taken = std::fs::read_dir("/run/netns")
                .map(|rd| {
                    rd.flatten().any(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .starts_with(&format!("kpr-{id}-"))
                    })
                })
                .unwrap_or(false);
            if !taken && std::fs::create_dir(&dir).is_ok() {
                break (id, dir);
            }
        };
        let prefix = format!("kpr-{id}");
        let manifests_dir = dir.join("manifests");
        let nodes: Vec<NodeInfo> = (1..=n_nodes)
            .map(|i| {
                let single = n_nodes == 1;
                NodeInfo {
                    name: format!("node-{i}"),
                    netns: if single {
                        format!("{prefix}-node")
                    } else {
                        format!("{prefix}-node-{i}")
                    },
                    ip: node_ip(i),
                    pod_cidr: node_pod_cidr(i),
                    zone: b.zones.get(i - 1).cloned(),
                    agent: None,
                    agent_log: if single {
                        dir.join("agent.log")
                    } else {
                        dir.join(format!("agent-node-{i}.log"))
                    },
                    bpffs: if single {
                        PathBuf::from(format!("{BPFFS_PREFIX}{id}"))
                    } else {
                        PathBuf::from(format!("{BPFFS_PREFIX}{id}-node-{i}"))
                    },
                    eth: if with_switch {
                        "eth0".to_string()
                    } else {
                        String::new()
                    },
                }
            })
            .collect();
        let info = LabInfo {
            id: id.clone(),
            dir: dir.clone(),
            manifests_dir: manifests_dir.clone(),
            bpffs: nodes[0].bpffs.clone(),
            node: nodes[0].clone(),
            nodes: nodes.clone(),
            switch_netns: with_switch.then(|| format!("{prefix}-sw")),
            external: None,
            client: Endpoint {
                name: "client".to_string(),
                netns: format!("{prefix}-client"),
                ip: CLIENT_IP,
                host_if: String::new(),
                node: nodes[0].name.clone(),
            },
            clients: Vec::new(),
            pods: Vec::new(),
            frontends: Vec::new(),
            agent: None,
            servers: Vec::new(),
            namespaces: Vec::new(),
        };
        let mut lab = Lab {
            info,
            objects: Vec::new(),
            alloc: new_allocator(&nodes),
            children: HashMap::new(),
            agent_bin,
            agent_args: b.agent_args,
            agent_source_args: b.agent_source_args,
            rust_log: b.rust_log,
            server_bin: Some(server_bin),
            agent_start_marks: vec![0; n_nodes],
            write_marks: vec![0; n_nodes],
            agent_has_ext_flag: None,
            keep: false,
        };
        // From here on, dropping `lab` on error cleans up.
        std::fs::create_dir_all(&manifests_dir)?;
        lab.save()?;
        if with_switch {
            lab.create_switch()?;
        }
        for i in 0..n_nodes {
            lab.create_node(i)?;
        }
        if with_switch {
            lab.create_external()?;
        }
        let client_ns = lab.info.client.netns.clone();
        lab.info.client.host_if = lab.create_endpoint(0, &client_ns, CLIENT_IP)?;
        lab.save()?;

        lab.add_missing_nodes(&mut objects);
        for o in &mut objects {
            lab.alloc.complete(o, None)?;
        }
        lab.reconcile(objects)?;
        if lab.agent_bin.is_some() {
            lab.start_agent()?;
        }
        Ok(lab)
    }

    /// Inserts a Node object for every lab node the objects do not define.
    fn add_missing_nodes(&self, objects: &mut Vec<Object>) {
        let mut missing = Vec::new();
        for n in &self.info.nodes {
            let defined = objects.iter().any(
                |o| matches!(o, Object::Node(x) if x.metadata.name.as_deref() == Some(&n.name)),
            );
            if !defined {
                missing.push(manifests::node_object(
                    &n.name,
                    n.ip,
                    &n.pod_cidr,
                    n.zone.as_deref(),
                ));
            }
        }
        objects.splice(0..0, missing);
    }

    /// Re-opens a lab from its lab.json (a path, or a lab id under
    /// /run/kpr-lab). The returned lab is NOT torn down on drop; call
    /// [`down`](Lab::down) for that. It can be changed like a started lab
    /// (its processes are known by pid only).
    pub fn attach(target: &str) -> Result<Lab> {
        let path = if Path::new(target).is_file() {
            PathBuf::from(target)
        } else if Path::new(target).is_dir() {
            Path::new(target).join("lab.json")
        } else {
            Path::new(LAB_ROOT).join(target).join("lab.json")
        };
        let mut info = LabInfo::load(&path)?;
        if info.nodes.is_empty() {
            // lab.json of a single-node lab written before nodes were listed.
            let mut n = info.node.clone();
            if n.pod_cidr.is_empty() {
                n.pod_cidr = POD_CIDR.to_string();
            }
            if n.agent_log.as_os_str().is_empty() {
                n.agent_log = info.dir.join("agent.log");
            }
            if n.bpffs.as_os_str().is_empty() {
                n.bpffs = info.bpffs.clone();
            }
            n.agent = info.agent.clone();
            info.nodes.push(n);
        }
        let mut alloc = new_allocator(&info.nodes);
        let cluster = info.manifests_dir.join("cluster.yaml");
        let mut objects = if cluster.is_file() {
            manifests::load_path(&cluster)?
        } else {
            Vec::new()
        };
        for c in &info.clients {
            alloc.reserve_ip(c.ip);
        }
        for o in &mut objects {
            let prev = o.clone();
            alloc.complete(o, Some(&prev))?;
        }
        let marks: Vec<usize> = info
            .nodes
            .iter()
            .map(|n| count_markers(&n.agent_log))
            .collect();
        Ok(Lab {
            info,
            objects,
            alloc,
            children: HashMap::new(),
            agent_bin: None,
            agent_args: Vec::new(),
            agent_source_args: None,
            rust_log: None,
            server_bin: find_server_bin().ok(),
            agent_start_marks: vec![0; marks.len()],
            write_marks: marks,
            agent_has_ext_flag: None,
            keep: true,
        })
    }

    /// Every lab under /run/kpr-lab (paths of their lab.json).
    pub fn list() -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(LAB_ROOT)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path().join("lab.json"))
                    .filter(|p| p.is_file())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

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

    fn node_index(&self, name: &str) -> Result<usize> {
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

    fn node_info(&self, name: &str) -> Result<&NodeInfo> {
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

    fn save(&mut self) -> Result<()> {
        // node-1 mirrors, for readers of the single-node fields.
        self.info.node = self.info.nodes[0].clone();
        self.info.agent = self.info.nodes[0].agent.clone();
        self.info.bpffs = self.info.nodes[0].bpffs.clone();
        let json = serde_json::to_string_pretty(&self.info)?;
        write_atomic(&self.json_path(), json.as_bytes())
    }

    fn create_switch(&mut self) -> Result<()> {
        let Some(sw) = self.info.switch_netns.clone() else {
            return Ok(());
        };
        self.info.namespaces.push(sw.clone());
        self.save()?;
        create_netns(&sw)?;
        ip_in(&sw, &["link", "add", BRIDGE, "type", "bridge"])?;
        ip_in(&sw, &["link", "set", BRIDGE, "up"])?;
        Ok(())
    }

    /// A pinned XDP program that passes every frame (`r0 = XDP_PASS; exit`),
    /// loaded once per lab under its own bpffs directory.
    fn xdp_pass_program(&self) -> Result<PathBuf> {
        let dir = PathBuf::from(format!("{BPFFS_PREFIX}{}", self.info.id));
        let pin = dir.join("xdp_pass");
        if pin.exists() {
            return Ok(pin);
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        // mov r0, 2 (XDP_PASS); exit
        let insns: [u64; 2] = [0x0000_0002_0000_00b7, 0x0000_0000_0000_0095];
        let license = b"GPL\0";
        let mut attr = [0u8; 128];
        attr[0..4].copy_from_slice(&6u32.to_ne_bytes()); // BPF_PROG_TYPE_XDP
        attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
        attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
        attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
        // SAFETY: BPF_PROG_LOAD (5) with a zero-padded attribute pointing at
        // live buffers.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, 5, attr.as_ptr(), attr.len() as u32) };
        if fd < 0 {
            bail!(
                "BPF_PROG_LOAD (XDP pass): {}",
                std::io::Error::last_os_error()
            );
        }
        let path = std::ffi::CString::new(pin.to_string_lossy().as_bytes())?;
        let mut pin_attr = [0u8; 16];
        pin_attr[0..8].copy_from_slice(&(path.as_ptr() as u64).to_ne_bytes());
        pin_attr[8..12].copy_from_slice(&(fd as u32).to_ne_bytes());
        // SAFETY: BPF_OBJ_PIN (6) with the fd just loaded and a C string path.
        let r =
            unsafe { libc::syscall(libc::SYS_bpf, 6, pin_attr.as_ptr(), pin_attr.len() as u32) };
        // SAFETY: our own fd; the pin keeps the program.
        unsafe { libc::close(fd as i32) };
        if r < 0 {
            bail!(
                "pin the XDP pass program at {}: {}",
                pin.display(),
                std::io::Error::last_os_error()
            );
        }
        Ok(pin)
    }

    /// A veth from the switch's bridge (port `port`) to `eth0` in `ns`, with
    /// `ip`/24 on it, up.
    fn plug_into_switch(&mut self, ns: &str, port: &str, ip: Ipv4Addr) -> Result<()> {
        let sw = self
            .info
            .switch_netns
            .clone()
            .ok_or_else(|| anyhow!("the lab has no switch"))?;
        check_lab_addr(ip)?;
        ip_in(
            &sw,
            &[
                "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns,
            ],
        )?;
        ip_in(&sw, &["link", "set", port, "master", BRIDGE])?;
        ip_in(&sw, &["link", "set", port, "up"])?;
        // Frames a node sends with XDP_TX (XDP acceleration) reach the other
        // end of a veth only when that end runs an XDP program too (a real
        // NIC has no such need): the switch side gets one that passes
        // everything. And with TX checksum offload off on `eth0`, frames on
        // this "wire" carry complete checksums, as on a real one (a veth
        // otherwise passes partial checksums, which XDP cannot update).
        let pass = self.xdp_pass_program()?;
        let attach = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{sw}"))
            .args(["ip", "link", "set", "dev", port, "xdpdrv", "pinned"])
            .arg(&pass)
            .output();
        if !attach.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!("lab: could not attach the XDP pass program to {port}: {attach:?}");
        }
        let tx = Command::new("ip")
            .args(["netns", "exec", ns, "ethtool", "-K", "eth0", "tx", "off"])
            .output();
        if !tx.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!("lab: could not turn TX checksum offload off on eth0 in {ns} (is ethtool installed?)");
        }
        ip_in(
            ns,
            &[
                "addr",
                "add",
                &format!("{ip}/{NODE_LINK_PREFIX}"),
                "dev",
                "eth0",
            ],
        )?;
        ip_in(ns, &["link", "set", "eth0", "up"])?;
        Ok(())
    }

    fn create_node(&mut self, i: usize) -> Result<()> {
        let node = self.info.nodes[i].clone();
        let ns = node.netns.clone();
        self.info.namespaces.push(ns.clone());
        self.save()?;
        create_netns(&ns)?;
        for (k, v) in [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ] {
            sysctl_in(&ns, k, v)?;
        }
        check_lab_addr(GATEWAY_IP)?;
        ip_in(
            &ns,
            &["addr", "add", &format!("{GATEWAY_IP}/32"), "dev", "lo"],
        )?;
        if node.eth.is_empty() {
            check_lab_addr(node.ip)?;
            ip_in(
                &ns,
                &["addr", "add", &format!("{}/32", node.ip), "dev", "lo"],
            )?;
            return Ok(());
        }
        self.plug_into_switch(&ns, &format!("n{}", i + 1), node.ip)?;
        sysctl_in(&ns, "net.ipv4.conf.eth0.rp_filter", "0")?;
        sysctl_in(&ns, "net.ipv4.conf.eth0.forwarding", "1")?;
        for (j, other) in self.info.nodes.clone().iter().enumerate() {
            if j == i {
                continue;
            }
            let via = other.ip.to_string();
            ip_in(
                &ns,
                &["route", "add", &other.pod_cidr, "via", &via, "dev", "eth0"],
            )?;
        }
        Ok(())
    }

    fn create_external(&mut self) -> Result<()> {
        if self.info.switch_netns.is_none() {
            return Ok(());
        }
        let ns = format!("kpr-{}-ext", self.info.id);
        self.info.namespaces.push(ns.clone());
        self.save()?;
        create_netns(&ns)?;
        self.plug_into_switch(&ns, "ext", EXTERNAL_IP)?;
        for n in self.info.nodes.clone() {
            let via = n.ip.to_string();
            ip_in(
                &ns,
                &["route", "add", &n.pod_cidr, "via", &via, "dev", "eth0"],
            )?;
        }
        self.info.external = Some(Endpoint {
            name: "external".to_string(),
            netns: ns,
            ip: EXTERNAL_IP,
            host_if: "ext".to_string(),
            node: String::new(),
        });
        self.save()
    }

    fn unique_netns(&self, name: &str) -> String {
        let clean: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        let base = format!("kpr-{}-{clean}", self.info.id);
        let mut candidate = base.clone();
        let mut n = 2;
        while self.info.namespaces.contains(&candidate) || netns::netns_exists(&candidate) {
            candidate = format!("{base}-{n}");
            n += 1;
        }
        candidate
    }

    fn unique_host_if(&self) -> String {
        loop {
            let name = format!("lxc{}", netns::hex(&netns::random_bytes::<4>()));
            // Unique across nodes too (simpler to read in logs).
            let used = self.info.pods.iter().any(|p| p.host_if == name)
                || self.info.clients.iter().any(|c| c.host_if == name)
                || self.info.client.host_if == name;
            if !used {
                return name;
            }
        }
    }

    /// Creates namespace `ns` with `eth0` holding `ip`, wired to node
    /// `node_idx` (0-based) by a veth pair; returns the host-side interface.
    fn create_endpoint(&mut self, node_idx: usize, ns: &str, ip: Ipv4Addr) -> Result<String> {
        check_lab_addr(ip)?;
        let node = self.info.nodes[node_idx].netns.clone();
        let host_if = self.unique_host_if();
        self.info.namespaces.push(ns.to_string());
        self.save()?;
        create_netns(ns)?;
        ip_in(
            &node,
            &[
                "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", ns,
            ],
        )?;
        let cidr = format!("{ip}/32");
        let gw = GATEWAY_IP.to_string();
        ip_in(ns, &["addr", "add", &cidr, "dev", "eth0"])?;
        ip_in(ns, &["link", "set", "eth0", "up"])?;
        ip_in(ns, &["route", "add", &gw, "dev", "eth0", "scope", "link"])?;
        ip_in(ns, &["route", "add", LAB_ROUTE, "via", &gw, "dev", "eth0"])?;
        ip_in(&node, &["link", "set", &host_if, "up"])?;
        ip_in(&node, &["route", "add", &cidr, "dev", &host_if])?;
        sysctl_in(&node, &format!("net.ipv4.conf.{host_if}.rp_filter"), "0")?;
        Ok(host_if)
    }

    fn remove_namespace(&mut self, ns: &str) -> Result<()> {
        delete_netns(ns)?;
        self.info.namespaces.retain(|n| n != ns);
        Ok(())
    }

    /// Adds a client namespace on node-1 (an address from 198.18.1.3-9, not
    /// a backend).
    pub fn add_client(&mut self, name: &str) -> Result<Endpoint> {
        let node = self.info.nodes[0].name.clone();
        self.add_client_on(name, &node)
    }

    /// Adds a client namespace on node `node` (an address from
    /// 198.18.i.3-9 of node i's pod CIDR, not a backend).
    pub fn add_client_on(&mut self, name: &str, node: &str) -> Result<Endpoint> {
        if name == "client" || self.info.clients.iter().any(|c| c.name == name) {
            bail!("client {name} already exists");
        }
        let idx = self.node_index(node)?;
        let ip = self.alloc.allocate_in(
            node_pod_addr(idx + 1, EXTRA_CLIENT_FIRST.octets()[3]),
            node_pod_addr(idx + 1, EXTRA_CLIENT_LAST.octets()[3]),
            "client",
        )?;
        let ns = self.unique_netns(name);
        let host_if = self.create_endpoint(idx, &ns, ip)?;
        let ep = Endpoint {
            name: name.to_string(),
            netns: ns,
            ip,
            host_if,
            node: node.to_string(),
        };
        self.info.clients.push(ep.clone());
        self.save()?;
        Ok(ep)
    }

    /// A client added with [`add_client`](Lab::add_client), or the default one.
    pub fn client_named(&self, name: &str) -> Option<&Endpoint> {
        if name == "client" {
            return Some(&self.info.client);
        }
        self.info.clients.iter().find(|c| c.name == name)
    }

    fn spawn_server(&mut self, pod: &PodInfo) -> Result<()> {
        let bin = match &self.server_bin {
            Some(b) => b.clone(),
            None => find_server_bin()?,
        };
        let mut ports: Vec<u16> = pod.ports.iter().map(|p| p.port).collect();
        if ports.is_empty() {
            ports.push(DEFAULT_POD_PORT);
        }
        ports.sort();
        ports.dedup();
        let log = self.info.dir.join(format!("server-{}.log", pod.netns));
        let mut cmd = Command::new(&bin);
        cmd.args(["--name", &pod.name, "--lab", &self.info.id]);
        for p in &ports {
            cmd.args(["--tcp", &p.to_string(), "--udp", &p.to_string()]);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(File::create(&log)?);
        netns::enter_netns_on_spawn(&mut cmd, &pod.netns)?;
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let pid = child.id();
        let stdout = child.stdout.take().expect("piped stdout");
        self.children.insert(pid, child);
        self.info.servers.push(ServerInfo {
            pod: pod.name.clone(),
            namespace: pod.namespace.clone(),
            pid,
            log: log.clone(),
        });
        self.save()?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(l) if l.trim() == "ready" => Ok(()),
            _ => bail!(
                "server of pod {} did not start: {}",
                pod.name,
                tail(&log, 10)
            ),
        }
    }

    fn stop_server(&mut self, namespace: &str, pod: &str) -> Result<()> {
        let servers: Vec<ServerInfo> = self
            .info
            .servers
            .iter()
            .filter(|s| s.pod == pod && s.namespace == namespace)
            .cloned()
            .collect();
        for s in servers {
            self.kill(s.pid, Duration::ZERO)?;
            self.info.servers.retain(|x| x.pid != s.pid);
        }
        Ok(())
    }

    /// Sends SIGTERM (SIGKILL if `grace` is zero), waits up to `grace`, then
    /// SIGKILL. Processes not started by this Lab value are only signalled if
    /// their command line names this lab's id (guards against pid reuse).
    fn kill(&mut self, pid: u32, grace: Duration) -> Result<()> {
        use nix::sys::signal::{kill, Signal};
        let npid = nix::unistd::Pid::from_raw(pid as i32);
        let first = if grace.is_zero() {
            Signal::SIGKILL
        } else {
            Signal::SIGTERM
        };
        if let Some(mut child) = self.children.remove(&pid) {
            if child.try_wait()?.is_some() {
                return Ok(());
            }
            let _ = kill(npid, first);
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if child.try_wait()?.is_some() {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            child.wait()?;
            return Ok(());
        }
        match cmdline(pid) {
            Some(c) if c.contains(&self.info.id) => {}
            _ => return Ok(()),
        }
        let _ = kill(npid, first);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && !process_gone(pid) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if !process_gone(pid) {
            let _ = kill(npid, Signal::SIGKILL);
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline && !process_gone(pid) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// True if the agent binary lists `--external-interfaces` in
    /// `run --help` (asked once per Lab value).
    fn agent_knows_external_interfaces(&mut self, bin: &Path) -> bool {
        if let Some(k) = self.agent_has_ext_flag {
            return k;
        }
        let known = Command::new(bin)
            .args(["run", "--help"])
            .stdin(Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).contains("--external-interfaces"))
            .unwrap_or(false);
        self.agent_has_ext_flag = Some(known);
        known
    }

    /// Starts every node's agent that is not running (each in its node
    /// namespace, appending to its log).
    pub fn start_agent(&mut self) -> Result<()> {
        if self.info.nodes.iter().all(|n| n.agent.is_some()) {
            bail!("the agent is already running");
        }
        for i in 0..self.info.nodes.len() {
            if self.info.nodes[i].agent.is_none() {
                self.start_agent_idx(i)?;
            }
        }
        Ok(())
    }

    /// Starts the agent of node `node` (`node-2`).
    pub fn start_agent_on(&mut self, node: &str) -> Result<()> {
        let i = self.node_index(node)?;
        self.start_agent_idx(i)
    }

    fn start_agent_idx(&mut self, i: usize) -> Result<()> {
        let node = self.info.nodes[i].clone();
        if node.agent.is_some() {
            bail!("the agent of {} is already running", node.name);
        }
        let bin = match &self.agent_bin {
            Some(b) => b.clone(),
            None => find_agent_bin()?,
        };
        self.agent_bin = Some(bin.clone());
        let log_path = node.agent_log.clone();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let hairpin = HAIRPIN_SNAT_IP.to_string();
        let mut cmd = Command::new(&bin);
        cmd.arg("run");
        match &self.agent_source_args {
            Some(args) => cmd.args(args),
            None => cmd
                .args(["--source", "manifests", "--manifests"])
                .arg(&self.info.manifests_dir),
        };
        cmd.args(["--node-name", &node.name, "--bpffs"])
            .arg(&node.bpffs)
            .args(["--pod-interfaces", "lxc*", "--hairpin-snat-ip", &hairpin])
            .args(["--min-sync-period", "100ms"]);
        if !node.eth.is_empty() && self.agent_knows_external_interfaces(&bin) {
            cmd.args(["--external-interfaces", &node.eth]);
        }
        cmd.args(&self.agent_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let rust_log = self
            .rust_log
            .clone()
            .or_else(|| std::env::var("RUST_LOG").ok())
            .unwrap_or_else(|| "info".to_string());
        cmd.env("RUST_LOG", rust_log);
        netns::enter_netns_on_spawn(&mut cmd, &node.netns)?;
        self.agent_start_marks[i] = count_markers(&log_path);
        self.write_marks[i] = self.agent_start_marks[i];
        let child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let pid = child.id();
        self.children.insert(pid, child);
        self.info.nodes[i].agent = Some(AgentInfo { pid, log: log_path });
        self.save()
    }

    /// Stops every agent: SIGTERM, up to 3 s, then SIGKILL. Pinned maps stay.
    pub fn stop_agent(&mut self) -> Result<()> {
        for i in 0..self.info.nodes.len() {
            self.stop_agent_idx(i)?;
        }
        Ok(())
    }

    /// Stops the agent of node `node` (as [`stop_agent`](Lab::stop_agent)).
    pub fn stop_agent_on(&mut self, node: &str) -> Result<()> {
        let i = self.node_index(node)?;
        self.stop_agent_idx(i)
    }

    fn stop_agent_idx(&mut self, i: usize) -> Result<()> {
        if let Some(a) = self.info.nodes[i].agent.take() {
            self.kill(a.pid, Duration::from_secs(3))?;
            self.save()?;
        }
        Ok(())
    }

    /// Stops and starts every agent (each adopts its pinned state).
    pub fn restart_agent(&mut self) -> Result<()> {
        self.stop_agent()?;
        self.start_agent()
    }

    /// Stops and starts the agent of node `node`.
    pub fn restart_agent_on(&mut self, node: &str) -> Result<()> {
        self.stop_agent_on(node)?;
        self.start_agent_on(node)
    }

    /// True if node-1's agent is running.
    pub fn agent_running(&mut self) -> bool {
        self.agent_running_idx(0)
    }

    /// True if the agent of node `node` is running.
    pub fn agent_running_on(&mut self, node: &str) -> bool {
        match self.node_index(node) {
            Ok(i) => self.agent_running_idx(i),
            Err(_) => false,
        }
    }

    fn agent_running_idx(&mut self, i: usize) -> bool {
        let Some(a) = &self.info.nodes[i].agent else {
            return false;
        };
        let pid = a.pid;
        match self.children.get_mut(&pid) {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => !process_gone(pid),
        }
    }

    /// How many times node-1's agent has logged [`SYNC_MARKER`] (over all runs).
    pub fn sync_count(&self) -> usize {
        count_markers(&self.info.nodes[0].agent_log)
    }

    /// How many times the agent of node `node` has logged [`SYNC_MARKER`].
    pub fn sync_count_on(&self, node: &str) -> Result<usize> {
        Ok(count_markers(&self.node_info(node)?.agent_log))
    }

    /// Waits until, for every node index in `which`, the agent's marker
    /// count exceeds `above[i]`.
    fn wait_markers(
        &mut self,
        which: &[usize],
        above: &[usize],
        timeout: Duration,
        what: &str,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut pending: Vec<usize> = which.to_vec();
        loop {
            pending.retain(|&i| count_markers(&self.info.nodes[i].agent_log) <= above[i]);
            if pending.is_empty() {
                return Ok(());
            }
            for &i in &pending {
                if !self.agent_running_idx(i) {
                    let n = &self.info.nodes[i];
                    bail!(
                        "agent of {} is not running while waiting for {what}; log tail:\n{}",
                        n.name,
                        tail(&n.agent_log, 30)
                    );
                }
            }
            if Instant::now() >= deadline {
                let n = &self.info.nodes[pending[0]];
                bail!(
                    "timed out after {timeout:?} waiting for {what} of {}; log tail of {}:\n{}",
                    pending
                        .iter()
                        .map(|&i| self.info.nodes[i].name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    n.name,
                    tail(&n.agent_log, 30)
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn nodes_with_agent(&self) -> Vec<usize> {
        (0..self.info.nodes.len())
            .filter(|&i| self.info.nodes[i].agent.is_some())
            .collect()
    }

    /// Waits until every agent (since it was last started) logged its first
    /// `sync complete`. Fails if no agent was started.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let which = self.nodes_with_agent();
        if which.is_empty() {
            bail!("no agent was started");
        }
        let marks = self.agent_start_marks.clone();
        self.wait_markers(&which, &marks, timeout, "the agent's first sync")
    }

    /// Waits for every running agent's next `sync complete` after the last
    /// manifest write (`apply`, `delete_*`, `replace_manifests`). Returns at
    /// once without an agent.
    pub fn wait_synced(&mut self, timeout: Duration) -> Result<()> {
        let which = self.nodes_with_agent();
        let marks = self.write_marks.clone();
        self.wait_markers(&which, &marks, timeout, "a sync after the manifest change")
    }

    /// Waits for a sync of node-1's agent after marker count `mark` (see
    /// [`sync_count`](Lab::sync_count)).
    pub fn wait_synced_since(&mut self, mark: usize, timeout: Duration) -> Result<()> {
        let mut marks = vec![0; self.info.nodes.len()];
        marks[0] = mark;
        self.wait_markers(&[0], &marks, timeout, "a sync")
    }

    /// Waits until every running agent logged an attachment (a line
    /// containing `attached`) naming each host-side veth of its node's pods
    /// and clients and, with a switch and an agent that takes
    /// `--external-interfaces`, its `eth0`. The agents attach from a netlink
    /// watch, independently of their syncs: `sync complete` can come before
    /// the attachments, and traffic in between bypasses the datapath.
    pub fn wait_attached(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let ext = self.agent_has_ext_flag == Some(true);
        loop {
            let mut missing = Vec::new();
            for n in &self.info.nodes {
                if n.agent.is_none() {
                    continue;
                }
                let mut ifs: Vec<&str> = Vec::new();
                if self.info.client.node == n.name
                    || (n.name == NODE_NAME && self.info.client.node.is_empty())
                {
                    ifs.push(&self.info.client.host_if);
                }
                ifs.extend(
                    self.info
                        .clients
                        .iter()
                        .filter(|c| c.node == n.name || (c.node.is_empty() && n.name == NODE_NAME))
                        .map(|c| c.host_if.as_str()),
                );
                ifs.extend(
                    self.info
                        .pods
                        .iter()
                        .filter(|p| p.node == n.name)
                        .map(|p| p.host_if.as_str()),
                );
                if ext && !n.eth.is_empty() {
                    ifs.push(&n.eth);
                }
                ifs.retain(|i| !i.is_empty());
                let log = std::fs::read_to_string(&n.agent_log).unwrap_or_default();
                for i in ifs {
                    let quoted = format!("\"{i}\"");
                    let bare = format!("={i}");
                    let found = log.lines().any(|l| {
                        l.contains("attached")
                            && !l.contains("detached")
                            && (l.contains(&quoted)
                                || l.split_whitespace().any(|w| w.ends_with(&bare)))
                    });
                    if !found {
                        missing.push(format!("{}:{i}", n.name));
                    }
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("agents did not attach to {missing:?} within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn write_manifests(&mut self) -> Result<()> {
        let text = manifests::render(&self.objects)?;
        self.write_marks = self
            .info
            .nodes
            .iter()
            .map(|n| count_markers(&n.agent_log))
            .collect();
        write_atomic(
            &self.info.manifests_dir.join("cluster.yaml"),
            text.as_bytes(),
        )
    }

    /// Makes `new` (already completed by the allocator) the lab's objects:
    /// creates namespaces and servers of new pods, restarts servers whose
    /// ports changed, writes cluster.yaml, and after the agent synced removes
    /// pods that are gone.
    fn reconcile(&mut self, new: Vec<Object>) -> Result<()> {
        let old_pods: BTreeMap<PodKey, PodInfo> = self
            .info
            .pods
            .iter()
            .map(|p| ((p.namespace.clone(), p.name.clone()), p.clone()))
            .collect();
        let new_pods: Vec<(PodKey, PodInfo, bool)> = pods_of(&new)
            .into_iter()
            .map(|(key, pod)| {
                let ip: Ipv4Addr = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.pod_ip.as_deref())
                    .and_then(|a| a.parse().ok())
                    .ok_or_else(|| anyhow!("pod {}/{} has no podIP", key.0, key.1))?;
                let host_network = pod.spec.as_ref().and_then(|s| s.host_network) == Some(true);
                let ports = pod_ports(pod)
                    .into_iter()
                    .map(|(port, protocol)| PortInfo { port, protocol })
                    .collect();
                let node = pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.clone())
                    .unwrap_or_else(|| NODE_NAME.to_string());
                let info = PodInfo {
                    name: key.1.clone(),
                    namespace: key.0.clone(),
                    node,
                    netns: String::new(),
                    ip,
                    host_if: String::new(),
                    ports,
                };
                Ok((key, info, host_network))
            })
            .collect::<Result<_>>()?;

        for (key, mut pod, host_network) in new_pods {
            match old_pods.get(&key) {
                Some(old) if old.ip == pod.ip => {
                    if old.ports != pod.ports && !old.host_if.is_empty() {
                        self.stop_server(&key.0, &key.1)?;
                        let i = self
                            .info
                            .pods
                            .iter()
                            .position(|p| p == old)
                            .expect("pod listed");
                        self.info.pods[i].ports = pod.ports.clone();
                        let updated = self.info.pods[i].clone();
                        self.spawn_server(&updated)?;
                    }
                }
                Some(old) => bail!(
                    "pod {}/{}: podIP changed from {} to {}",
                    key.0,
                    key.1,
                    old.ip,
                    pod.ip
                ),
                None if host_network => {
                    pod.netns = self.node_info(&pod.node)?.netns.clone();
                    self.info.pods.push(pod);
                }
                None => {
                    let idx = self.node_index(&pod.node)?;
                    let ns = self.unique_netns(&pod.name);
                    pod.host_if = self.create_endpoint(idx, &ns, pod.ip)?;
                    pod.netns = ns;
                    self.info.pods.push(pod.clone());
                    self.save()?;
                    self.spawn_server(&pod)?;
                }
            }
        }

        // Addresses of objects that disappear are freed after the new ones
        // were allocated, so they are not reused in the same change.
        let gone: Vec<Ipv4Addr> = self
            .objects
            .iter()
            .filter(|o| !new.iter().any(|n| n.key() == o.key()))
            .flat_map(object_ips)
            .collect();
        self.objects = new;
        let node_ips: Vec<Ipv4Addr> = self.info.nodes.iter().map(|n| n.ip).collect();
        self.info.frontends = frontends_of(&self.objects, &node_ips);
        self.write_manifests()?;
        self.save()?;

        let remaining = pods_of(&self.objects)
            .keys()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>();
        let removed: Vec<PodInfo> = self
            .info
            .pods
            .iter()
            .filter(|p| !remaining.contains(&(p.namespace.clone(), p.name.clone())))
            .cloned()
            .collect();
        let mut result = Ok(());
        if !removed.is_empty() {
            result = self.wait_synced(Duration::from_secs(15));
            for p in &removed {
                self.stop_server(&p.namespace, &p.name)?;
                if !p.host_if.is_empty() {
                    self.remove_namespace(&p.netns)?;
                }
                self.info.pods.retain(|x| x != p);
            }
        }
        for ip in gone {
            self.alloc.release_ip(ip);
        }
        self.save()?;
        result
    }

    /// Adds or replaces objects (matched by kind, namespace and name). New
    /// Services get ClusterIPs, new Pods get IPs, namespaces and servers;
    /// existing objects keep their allocations. Rewrites cluster.yaml. Does
    /// not wait for the agent: call [`wait_synced`](Lab::wait_synced).
    pub fn apply(&mut self, yaml: &str) -> Result<()> {
        let incoming = manifests::parse_yaml(yaml, "apply")?;
        let mut new = self.objects.clone();
        for mut o in incoming {
            let key = o.key();
            let pos = new.iter().position(|x| x.key() == key);
            self.alloc.complete(&mut o, pos.map(|i| &new[i]))?;
            match pos {
                Some(i) => new[i] = o,
                None => new.push(o),
            }
        }
        self.reconcile(new)
    }

    /// Replaces all manifests with `yaml`. Objects that keep their key keep
    /// their allocations; pods that are gone are removed after the agent
    /// synced.
    pub fn replace_manifests(&mut self, yaml: &str) -> Result<()> {
        let mut incoming = manifests::parse_yaml(yaml, "replace_manifests")?;
        self.add_missing_nodes(&mut incoming);
        for o in &mut incoming {
            let key = o.key();
            let prev = self.objects.iter().find(|x| x.key() == key);
            self.alloc.complete(o, prev)?;
        }
        self.reconcile(incoming)
    }

    /// Removes objects of `kind` named `name` or `namespace/name`. Pods are
    /// removed from the manifests first; once the agent synced, their server
    /// and namespace go. Fails if nothing matched.
    pub fn delete(&mut self, kind: &str, name: &str) -> Result<()> {
        let (ns, n) = split_name(name);
        let matches = |o: &Object| {
            let (k, ons, oname) = o.key();
            k == kind && oname == n && ns.is_none_or(|ns| ns == ons)
        };
        if !self.objects.iter().any(matches) {
            bail!("no {kind} named {name} in the lab's manifests");
        }
        let new: Vec<Object> = self
            .objects
            .iter()
            .filter(|o| !matches(o))
            .cloned()
            .collect();
        self.reconcile(new)
    }

    /// [`delete`](Lab::delete) of a Pod; waits for the agent's sync.
    pub fn delete_pod(&mut self, name: &str) -> Result<()> {
        self.delete("Pod", name)
    }

    /// [`delete`](Lab::delete) of a Service. Does not wait for the agent.
    pub fn delete_service(&mut self, name: &str) -> Result<()> {
        self.delete("Service", name)
    }

    /// Keeps the lab running after this value is dropped; returns lab.json.
    pub fn detach(mut self) -> Result<PathBuf> {
        self.save()?;
        self.keep = true;
        self.children.clear();
        Ok(self.json_path())
    }

    /// Tears the lab down now, reporting errors.
    pub fn down(mut self) -> Result<()> {
        self.keep = true;
        self.teardown()
    }

    fn teardown(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        for i in 0..self.info.nodes.len() {
            if let Some(a) = self.info.nodes[i].agent.take() {
                if let Err(e) = self.kill(a.pid, Duration::from_secs(3)) {
                    errors.push(format!("agent of {}: {e:#}", self.info.nodes[i].name));
                }
            }
        }
        self.info.agent = None;
        for s in std::mem::take(&mut self.info.servers) {
            if let Err(e) = self.kill(s.pid, Duration::ZERO) {
                errors.push(format!("server of {}: {e:#}", s.pod));
            }
        }
        for ns in self.info.namespaces.clone().iter().rev() {
            // Only namespaces of this lab.
            if !ns.starts_with(&format!("kpr-{}-", self.info.id)) {
                continue;
            }
            match delete_netns(ns) {
                Ok(()) => self.info.namespaces.retain(|n| n != ns),
                Err(e) => errors.push(format!("{e:#}")),
            }
        }
        let own = format!("{BPFFS_PREFIX}{}", self.info.id);
        let mut pin_dirs: Vec<PathBuf> = self.info.nodes.iter().map(|n| n.bpffs.clone()).collect();
        pin_dirs.push(self.info.bpffs.clone());
        pin_dirs.push(PathBuf::from(&own));
        pin_dirs.sort();
        pin_dirs.dedup();
        for bpffs in pin_dirs {
            // Only this lab's pin directories: kpr-lab-<id> or kpr-lab-<id>-node-i.
            let p = bpffs.to_string_lossy().into_owned();
            let ours = p == own
                || p.strip_prefix(&format!("{own}-node-"))
                    .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
            if ours && bpffs.exists() {
                if let Err(e) = std::fs::remove_dir_all(&bpffs) {
                    errors.push(format!("remove {}: {e}", bpffs.display()));
                }
            }
        }
        let dir = &self.info.dir;
        if errors.is_empty() && dir.starts_with(LAB_ROOT) && dir != Path::new(LAB_ROOT) {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                errors.push(format!("remove {}: {e}", dir.display()));
            }
        } else if !errors.is_empty() {
            let _ = self.save();
        }
        if errors.is_empty() {
            Ok(())
        } else {
            bail!("lab {} teardown: {}", self.info.id, errors.join("; "))
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        if let Err(e) = self.teardown() {
            eprintln!("{e:#}");
        }
    }
}

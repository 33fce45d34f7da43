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
//! Dual-stack ([`LabBuilder::dual_stack`]; off by default) adds IPv6 from
//! 2001:2::/48 beside every IPv4 address, each the twin of its IPv4 one
//! ([`crate::netns::ipv6_twin`]: 198.18.x.y is 2001:2:0:x::y):
//!
//! | what | IPv4 | IPv6 |
//! | --- | --- | --- |
//! | node i's address (`lo`, or `eth0` with a switch) | 198.18.0.(9+i) | 2001:2::(9+i) (/64 on `eth0`) |
//! | gateway, on every node's `lo` | 198.18.0.1 | 2001:2::1 |
//! | node i's pod CIDR | 198.18.i.0/24 | 2001:2:0:i::/64 |
//! | a pod, on its `eth0` | 198.18.i.h/32 | 2001:2:0:i::h/128 |
//! | default client | 198.18.1.2 | 2001:2:0:1::2 |
//! | external client | 198.18.0.100 | 2001:2::64 |
//! | ClusterIPs | 198.19.0.0/16 | 2001:2:0:ff::/112 |
//!
//! A pod routes 2001:2::/48 via `fe80::1` on `eth0`: the link-local address
//! every host-side veth holds ([`GATEWAY_LINK_LOCAL6`]); IPv6 answers
//! neighbour solicitations only for addresses of the link they arrive on,
//! so the node's 2001:2::1 on `lo` could not be the next hop as 198.18.0.1
//! is. Nodes forward IPv6 (`net.ipv6.conf.all.forwarding=1`) and route to
//! each pod's /128 over its veth, and with a switch to the other nodes' IPv6
//! pod CIDRs via their IPv6 addresses; the external client routes to every
//! IPv6 pod CIDR. Duplicate address detection is off in every lab
//! namespace, so addresses are usable at once. Services get ClusterIPs of
//! the families they ask for (`ipFamilies`, `ipFamilyPolicy`; IPv4 alone
//! when they ask for none), and Pods `podIPs` of both families, from which
//! the agent makes an EndpointSlice per family. The pods' servers listen on
//! both families.
//!
//! A [`Lab`] tears everything down when dropped, unless it was
//! [`detach`](Lab::detach)ed (`cargo xtask lab up`) or [`attach`](Lab::attach)ed;
//! then [`down`](Lab::down) removes it.
//!
//! | module | what |
//! | --- | --- |
//! | `mod.rs` | constants, [`LabBuilder`], [`Lab`]: start, attach, list, teardown |
//! | `info.rs` | lab.json ([`LabInfo`] and its parts) and the accessors reading it |
//! | `topology.rs` | the switch, node namespaces, the external client, client and pod namespaces |
//! | `process.rs` | the agents and the pods' `lab-server`s: binaries, start, stop |
//! | `container.rs` | runc mode: the agent from the image, configured from `deploy/` |
//! | `reconcile.rs` | manifests: apply, replace, delete; pods and frontends from objects |
//! | `wait.rs` | waiting for the agents' syncs and attachments |
//! | `control_plane.rs` | the real control plane: etcd, kube-apiserver, kube-controller-manager |
//! | `api.rs` | the lab as the kubelet of that control plane: Nodes, Pods, their status |
//! | `kube_proxy.rs` | the real kube-proxy on a node in the agent's place (iptables, nftables) |
//!
//! With a real control plane ([`LabBuilder::control_plane`], or
//! `KPR_LAB_CONTROL_PLANE=1`), the lab has a switch (the control plane sits
//! on it beside the nodes), the agents run `--source kubernetes` as
//! deploy/'s ServiceAccount, ClusterIPs and NodePorts come from the API
//! server and EndpointSlices from the EndpointSlice controller; the lab
//! only plays the kubelet. Everything else, the address plan included, is
//! the same.
//!
//! Why one file (about 900 lines): [`Lab`]'s private fields are filled in
//! two places only, `start` (from a [`LabBuilder`]) and `attach` (from
//! lab.json), and `teardown` undoes what `start` made (kube-proxy and the
//! agents, containers, the control plane, servers, namespaces, cgroups, pin
//! directories), so the three stay beside the struct and its builder. The
//! rest is the address plan above and its constants, which the submodules
//! import from here.

mod api;
mod cgroup;
pub use cgroup::cgroup2_mount;
pub mod container;
pub mod control_plane;
pub use api::{expected_endpoints, ExpectedEndpoint};
pub use container::AgentImage;
pub use control_plane::ControlPlaneInfo;
mod host_client;
mod info;
pub mod kube_proxy;
mod process;
mod reconcile;
pub mod seccomp;
mod topology;
mod wait;

use std::collections::HashMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::manifests::{self, Allocator, Object};
use crate::netns::{self, delete_netns};
use crate::setup;

pub use host_client::{HostClient, HostReply};
pub use info::{AgentInfo, Endpoint, Frontend, LabInfo, NodeInfo, PodInfo, PortInfo, ServerInfo};
use process::{find_agent_bin, find_server_bin};
use wait::count_markers;

/// Substring the agent logs after every completed sync.
pub const SYNC_MARKER: &str = "sync complete";
/// Where labs keep their state.
pub const LAB_ROOT: &str = "/run/kpr-lab";
/// Prefix of each lab's bpffs pin directory under /sys/fs/bpf.
pub const BPFFS_PREFIX: &str = "/sys/fs/bpf/kpr-lab-";
/// Name of node 1 (the node of a one-node lab).
pub const NODE_NAME: &str = "node-1";
/// Node 1's address (on its `lo`, or on `eth0` with a switch): [`node_ip`]`(1)`.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 10);
/// The pods' gateway, a local address of the node namespace.
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// Source address for hairpin SNAT, passed to the agent.
pub const HAIRPIN_SNAT_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 254);
/// Node 1's pod CIDR: [`node_pod_cidr`]`(1)`.
pub const POD_CIDR: &str = "198.18.1.0/24";
/// First and last address handed to node 1's pods (the same hosts on every
/// node's CIDR).
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
/// A Pod annotation: `"false"` starts the pod's server without listeners
/// on its SCTP ports (they stay declared, so the pod still backs SCTP
/// Services). Without it, a pod's SCTP ports are served over SCTP, which
/// needs SCTP loaded in the kernel ([`crate::sctp::available`]).
pub const SCTP_LISTENER_ANNOTATION: &str = "kpr-lab/sctp-listener";

/// Most nodes a lab can have.
pub const MAX_NODES: usize = 50;
/// The switch namespace's bridge.
pub const BRIDGE: &str = "br0";
/// The external client's address (on the switch's link).
pub const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
/// Prefix length of the node link (198.18.0.0/24).
pub const NODE_LINK_PREFIX: u8 = 24;

/// Dual-stack: the IPv6 gateway on every node's `lo` (twin of [`GATEWAY_IP`]).
pub const GATEWAY_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 1);
/// Dual-stack: the pods' IPv6 next hop, a link-local address every
/// host-side veth holds.
pub const GATEWAY_LINK_LOCAL6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// Dual-stack: node 1's IPv6 address: [`node_ip6`]`(1)`.
pub const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 10);
/// Dual-stack: the default client's IPv6 address.
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 1, 0, 0, 0, 2);
/// Dual-stack: the external client's IPv6 address.
pub const EXTERNAL_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 100);
/// Dual-stack: the IPv6 lab route every pod namespace has (via
/// [`GATEWAY_LINK_LOCAL6`]).
pub const LAB_ROUTE6: &str = "2001:2::/48";
/// Prefix length of the IPv6 node link (2001:2::/64).
pub const NODE_LINK_PREFIX6: u8 = 64;

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

/// The IPv6 address of node `i` (1-based): 2001:2::(9+i), the twin of
/// [`node_ip`]`(i)`.
pub fn node_ip6(i: usize) -> Ipv6Addr {
    crate::netns::ipv6_twin(node_ip(i)).expect("a node address is in 198.18.0.0/16")
}

/// The IPv6 pod CIDR of node `i` (1-based): 2001:2:0:i::/64 (`i` as a
/// number: node 10's is 2001:2:0:a::/64).
pub fn node_pod_cidr6(i: usize) -> String {
    assert!((1..=MAX_NODES).contains(&i), "node index {i} out of range");
    format!("{}/64", Ipv6Addr::new(0x2001, 2, 0, i as u16, 0, 0, 0, 0))
}

/// The default of [`Lab::sync_timeout`].
pub const DEFAULT_SYNC_TIMEOUT: Duration = Duration::from_secs(15);

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
    agent_image: Option<AgentImage>,
    without_caps: Vec<String>,
    ipv6: bool,
    control_plane: Option<bool>,
    sync_timeout: Option<Duration>,
}

/// Whether `KPR_LAB_CONTROL_PLANE` asks for a real control plane.
pub fn control_plane_from_env() -> bool {
    std::env::var("KPR_LAB_CONTROL_PLANE").is_ok_and(|v| v == "1" || v == "true")
}

impl LabBuilder {
    /// Runs a real control plane (etcd, kube-apiserver,
    /// kube-controller-manager; see [`control_plane`]) and the agents with
    /// `--source kubernetes` against it; the lab plays the kubelet. Default:
    /// `KPR_LAB_CONTROL_PLANE=1`, else the manifests source.
    pub fn control_plane(mut self, on: bool) -> Self {
        self.control_plane = Some(on);
        self
    }

    /// Dual-stack: IPv6 beside IPv4 everywhere (see the module's address
    /// plan); Services get the families they ask for. Default: IPv4 only.
    pub fn dual_stack(self) -> Self {
        self.ipv6(true)
    }

    /// Whether the lab is dual-stack ([`dual_stack`](LabBuilder::dual_stack)).
    pub fn ipv6(mut self, on: bool) -> Self {
        self.ipv6 = on;
        self
    }

    /// Runs every node's agent from this image under runc, configured from
    /// `deploy/` (default: `KPR_LAB_AGENT=runc` selects the image at
    /// `KPR_LAB_IMAGE`; else the agent runs as a plain process).
    pub fn agent_image(mut self, image: AgentImage) -> Self {
        self.agent_image = Some(image);
        self
    }

    /// In runc mode, leaves these capabilities (`NET_ADMIN`) out of the
    /// DaemonSet's list.
    pub fn without_caps(mut self, caps: &[&str]) -> Self {
        self.without_caps = caps.iter().map(|c| c.to_string()).collect();
        self
    }

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

    /// How long the lab's users wait for the agents to come up or to sync a
    /// change ([`Lab::sync_timeout`]; default [`DEFAULT_SYNC_TIMEOUT`]). The
    /// lab only carries it: its own waits keep their timeouts.
    pub fn sync_timeout(mut self, timeout: Duration) -> Self {
        self.sync_timeout = Some(timeout);
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
    /// Runc mode: the image the agents start from.
    image: Option<AgentImage>,
    /// Runc mode: images unpacked so far, with their rootfs.
    rootfs: Vec<(AgentImage, PathBuf)>,
    /// Runc mode: the `runc run` process of each container, by id.
    runc: HashMap<String, Child>,
    /// Runc mode: containers started so far (for unique ids).
    container_seq: usize,
    without_caps: Vec<String>,
    keep: bool,
    /// With a real control plane: what the lab wrote to the API server.
    api: Option<api::ApiState>,
    /// See [`LabBuilder::sync_timeout`].
    sync_timeout: Duration,
}

fn new_allocator(nodes: &[NodeInfo], dual_stack: bool) -> Allocator {
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
    if dual_stack {
        a.set_dual_stack(true);
        for ip in [GATEWAY_IP, HAIRPIN_SNAT_IP, CLIENT_IP, EXTERNAL_IP] {
            a.reserve_ip(crate::netns::ipv6_twin(ip).expect("a lab address"));
        }
        for n in nodes {
            if let Some(ip6) = n.ip6 {
                a.set_node_ip6(&n.name, ip6);
            }
        }
    }
    a
}

impl Lab {
    /// A builder with defaults.
    pub fn builder() -> LabBuilder {
        LabBuilder::default()
    }

    /// How long the lab's users wait for the agents to come up or to sync a
    /// change: set by [`LabBuilder::sync_timeout`], else
    /// [`DEFAULT_SYNC_TIMEOUT`]. The lab's own waits do not read it.
    pub fn sync_timeout(&self) -> Duration {
        self.sync_timeout
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
        let image = b.agent_image.or_else(AgentImage::from_env);
        let agent_bin = match (with_agent, b.agent_bin) {
            (false, _) => None,
            (true, _) if image.is_some() => None,
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
        let with_control_plane = b.control_plane.unwrap_or_else(control_plane_from_env);
        if with_control_plane && b.external == Some(false) {
            bail!("a lab with a control plane has a switch (the control plane sits on it)");
        }
        // The control plane is a machine on the node network.
        let with_switch = with_control_plane || b.external.unwrap_or(n_nodes > 1);

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
                    ip6: b.ipv6.then(|| node_ip6(i)),
                    pod_cidr: node_pod_cidr(i),
                    pod_cidr6: b.ipv6.then(|| node_pod_cidr6(i)),
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
                    cgroup: cgroup::lab_root(&id).map(|r| r.join(format!("node-{i}"))),
                    kube_proxy: None,
                }
            })
            .collect();
        let info = LabInfo {
            id: id.clone(),
            dir: dir.clone(),
            manifests_dir: manifests_dir.clone(),
            dual_stack: b.ipv6,
            bpffs: nodes[0].bpffs.clone(),
            node: nodes[0].clone(),
            nodes: nodes.clone(),
            switch_netns: with_switch.then(|| format!("{prefix}-sw")),
            external: None,
            client: Endpoint {
                name: "client".to_string(),
                netns: format!("{prefix}-client"),
                ip: CLIENT_IP,
                ip6: b.ipv6.then_some(CLIENT_IP6),
                host_if: String::new(),
                node: nodes[0].name.clone(),
            },
            clients: Vec::new(),
            pods: Vec::new(),
            frontends: Vec::new(),
            agent: None,
            servers: Vec::new(),
            namespaces: Vec::new(),
            control_plane: None,
        };
        let mut alloc = new_allocator(&nodes, b.ipv6);
        alloc.set_services_by_api_server(with_control_plane);
        let mut lab = Lab {
            info,
            objects: Vec::new(),
            alloc,
            children: HashMap::new(),
            agent_bin,
            agent_args: b.agent_args,
            agent_source_args: b.agent_source_args,
            rust_log: b.rust_log,
            server_bin: Some(server_bin),
            agent_start_marks: vec![0; n_nodes],
            write_marks: vec![0; n_nodes],
            agent_has_ext_flag: None,
            image: if with_agent { image } else { None },
            rootfs: Vec::new(),
            runc: HashMap::new(),
            container_seq: 0,
            without_caps: b.without_caps,
            keep: false,
            api: with_control_plane.then(api::ApiState::default),
            sync_timeout: b.sync_timeout.unwrap_or(DEFAULT_SYNC_TIMEOUT),
        };
        // From here on, dropping `lab` on error cleans up.
        std::fs::create_dir_all(&manifests_dir)?;
        lab.save()?;
        if with_switch {
            lab.create_switch()?;
        }
        let mut nodes_made = crate::progress::Counter::new(
            format!("lab {id}: nodes created"),
            n_nodes,
            3,
            Duration::ZERO,
        );
        for i in 0..n_nodes {
            lab.create_node(i)?;
            nodes_made.tick();
        }
        if with_switch {
            lab.create_external()?;
        }
        let client_ns = lab.info.client.netns.clone();
        let client_ip6 = lab.info.client.ip6;
        lab.info.client.host_if = lab.create_endpoint(0, &client_ns, CLIENT_IP, client_ip6)?;
        lab.save()?;
        if with_control_plane {
            eprintln!("lab {id}: starting the control plane (etcd, kube-apiserver, kube-controller-manager)");
            let _beat = crate::progress::Heartbeat::start(
                format!("lab {id}: starting the control plane"),
                Duration::from_secs(15),
            );
            lab.create_control_plane()?;
        }

        lab.add_missing_nodes(&mut objects);
        for o in &mut objects {
            lab.alloc.complete(o, None)?;
        }
        lab.reconcile(objects)?;
        if let Some(img) = &lab.image {
            eprintln!(
                "lab {}: agents from the image {}:{} under runc",
                lab.info.id,
                img.layout.display(),
                img.tag
            );
        }
        if lab.agent_bin.is_some() || lab.image.is_some() {
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
                let ipv6 = n.ip6.zip(n.pod_cidr6.as_deref());
                missing.push(manifests::node_object_dual_stack(
                    &n.name,
                    n.ip,
                    &n.pod_cidr,
                    ipv6,
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
        let mut alloc = new_allocator(&info.nodes, info.dual_stack);
        alloc.set_services_by_api_server(info.control_plane.is_some());
        let cluster = info.manifests_dir.join("cluster.yaml");
        let mut objects = if cluster.is_file() {
            manifests::load_path(&cluster)?
        } else {
            Vec::new()
        };
        for c in &info.clients {
            alloc.reserve_ip(c.ip);
            if let Some(ip6) = c.ip6 {
                alloc.reserve_ip(ip6);
            }
        }
        for o in &mut objects {
            let prev = o.clone();
            alloc.complete(o, Some(&prev))?;
        }
        let info_has_control_plane = info.control_plane.is_some();
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
            image: None,
            rootfs: Vec::new(),
            runc: HashMap::new(),
            container_seq: 0,
            without_caps: Vec::new(),
            keep: true,
            api: info_has_control_plane.then(api::ApiState::default),
            sync_timeout: DEFAULT_SYNC_TIMEOUT,
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
            // Its rules go with the node's namespace.
            if let Some(kp) = self.info.nodes[i].kube_proxy.take() {
                if let Err(e) = self.kill(kp.pid, Duration::from_secs(3)) {
                    errors.push(format!("kube-proxy of {}: {e:#}", self.info.nodes[i].name));
                }
            }
            if let Some(a) = self.info.nodes[i].agent.take() {
                if let Err(e) = self.kill(a.pid, Duration::from_secs(3)) {
                    errors.push(format!("agent of {}: {e:#}", self.info.nodes[i].name));
                }
                if let Some(id) = &a.container {
                    if let Err(e) = self.delete_container(id) {
                        errors.push(format!("{e:#}"));
                    }
                }
            }
        }
        // Containers of this lab that lab.json lost track of.
        for id in container::list(&format!("kpr-{}-", self.info.id)) {
            if let Err(e) = self.delete_container(&id) {
                errors.push(format!("{e:#}"));
            }
        }
        self.info.agent = None;
        if let Err(e) = self.stop_control_plane() {
            errors.push(format!("{e:#}"));
        }
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
        for n in &self.info.nodes {
            if let Some(cg) = &n.cgroup {
                // Runc mode's container cgroup, beside the node's.
                let own = cg.with_file_name(format!("{}-agent", n.name));
                if let Err(e) = cgroup::remove(&own) {
                    errors.push(format!("cgroup {}: {e:#}", own.display()));
                }
                if let Err(e) = cgroup::remove(cg) {
                    errors.push(format!("cgroup {}: {e:#}", cg.display()));
                }
            }
        }
        if let Some(root) = cgroup::lab_root(&self.info.id) {
            if let Err(e) = cgroup::remove(&root) {
                errors.push(format!("cgroup {}: {e:#}", root.display()));
            }
        }
        // Runc mode on a host with cgroup v1 controllers: runc made the
        // container's cgroup in every hierarchy; `runc delete` removed the
        // leaf, the lab's parent is left.
        for mount in cgroup::all_mounts() {
            let root = mount.join(format!("kpr-lab-{}", self.info.id));
            if !root.exists() {
                continue;
            }
            for n in &self.info.nodes {
                let _ = cgroup::remove(&root.join(format!("{}-agent", n.name)));
            }
            if let Err(e) = cgroup::remove(&root) {
                errors.push(format!("cgroup {}: {e:#}", root.display()));
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

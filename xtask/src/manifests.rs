//! Kubernetes manifests of a lab: parsing, the API server's allocators
//! (ClusterIPs, NodePorts, pod IPs, pod status) and rendering to one
//! multi-document YAML file.
//!
//! Dual-stack ([`Allocator::set_dual_stack`]): as an API server with the
//! service CIDRs 198.19.0.0/16 (primary) and [`SERVICE_CIDR6`], Services get
//! `ipFamilyPolicy`, `ipFamilies` and one ClusterIP per family in
//! `clusterIPs` (in `ipFamilies` order; `clusterIP` is the first), and Pods
//! get `podIPs` of both families (the IPv6 one the twin of the IPv4 one,
//! [`crate::netns::ipv6_twin`]). The agent's manifests source makes one
//! EndpointSlice per family of a Pod's `podIPs` (`addressType` IPv4 or IPv6),
//! standing in for the EndpointSlice controller.
//!
//! Why one file (about 1,200 lines): most of it is the [`Allocator`], one set
//! of pools (ClusterIPs of both families, NodePorts, pod IPs per node) that
//! Services and Pods are completed against as an API server fills them in
//! (`ipFamilyPolicy`, `ipFamilies`, `clusterIPs`, allocations kept on
//! update), and its tests, which check those rules case by case. Parsing and
//! rendering, the short part, come first.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::{
    Node, NodeAddress, NodeSpec, NodeStatus, Pod, PodCondition, PodIP, PodStatus, Service,
    ServiceSpec,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

use crate::netns::{check_lab_addr, check_lab_ip, ipv6_twin};

/// First ClusterIP handed out (198.19.0.0/16, from .10 up).
pub const SERVICE_CIDR_FIRST: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
/// Last ClusterIP handed out.
pub const SERVICE_CIDR_LAST: Ipv4Addr = Ipv4Addr::new(198, 19, 255, 254);
/// The IPv6 service CIDR of a dual-stack lab.
pub const SERVICE_CIDR6: &str = "2001:2:0:ff::/112";
/// First IPv6 ClusterIP handed out (from ::a up, as the IPv4 ones).
pub const SERVICE_CIDR6_FIRST: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0xff, 0, 0, 0, 0xa);
/// Last IPv6 ClusterIP handed out.
pub const SERVICE_CIDR6_LAST: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0xff, 0, 0, 0, 0xfffe);
/// First NodePort handed out.
pub const NODE_PORT_FIRST: i32 = 30000;
/// Last NodePort handed out.
pub const NODE_PORT_LAST: i32 = 32767;

/// A Kubernetes object of the lab.
#[derive(Debug, Clone)]
pub enum Object {
    Service(Box<Service>),
    Pod(Box<Pod>),
    EndpointSlice(Box<EndpointSlice>),
    Node(Box<Node>),
    /// Any other kind, passed through untouched.
    Other(yaml_serde::Value),
}

impl Object {
    /// `(kind, namespace, name)`; namespace is empty for cluster-scoped kinds.
    pub fn key(&self) -> (String, String, String) {
        fn ns_name(m: &ObjectMeta) -> (String, String) {
            (
                m.namespace.clone().unwrap_or_default(),
                m.name.clone().unwrap_or_default(),
            )
        }
        let (kind, (ns, name)) = match self {
            Object::Service(s) => ("Service", ns_name(&s.metadata)),
            Object::Pod(p) => ("Pod", ns_name(&p.metadata)),
            Object::EndpointSlice(e) => ("EndpointSlice", ns_name(&e.metadata)),
            Object::Node(n) => (
                "Node",
                (String::new(), n.metadata.name.clone().unwrap_or_default()),
            ),
            Object::Other(v) => {
                let kind = v
                    .get("kind")
                    .and_then(|k| k.as_str())
                    .unwrap_or("")
                    .to_string();
                let meta = v.get("metadata");
                let get = |f: &str| {
                    meta.and_then(|m| m.get(f))
                        .and_then(|x| x.as_str())
                        .unwrap_or("")
                        .to_string()
                };
                return (kind, get("namespace"), get("name"));
            }
        };
        (kind.to_string(), ns, name)
    }

    fn to_yaml(&self) -> Result<String> {
        Ok(match self {
            Object::Service(o) => yaml_serde::to_string(o)?,
            Object::Pod(o) => yaml_serde::to_string(o)?,
            Object::EndpointSlice(o) => yaml_serde::to_string(o)?,
            Object::Node(o) => yaml_serde::to_string(o)?,
            Object::Other(o) => yaml_serde::to_string(o)?,
        })
    }
}

/// Parses multi-document YAML. Empty documents are skipped; a missing
/// `metadata.namespace` becomes `default` for namespaced kinds.
pub fn parse_yaml(text: &str, origin: &str) -> Result<Vec<Object>> {
    let mut out = Vec::new();
    for (i, doc) in yaml_serde::Deserializer::from_str(text).enumerate() {
        let value = yaml_serde::Value::deserialize(doc)
            .with_context(|| format!("{origin}: document {i}"))?;
        if value.is_null() {
            continue;
        }
        let kind = value
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or("")
            .to_string();
        let ctx = || format!("{origin}: document {i} ({kind})");
        let mut obj = match kind.as_str() {
            "Service" => {
                Object::Service(Box::new(yaml_serde::from_value(value).with_context(ctx)?))
            }
            "Pod" => Object::Pod(Box::new(yaml_serde::from_value(value).with_context(ctx)?)),
            "EndpointSlice" => {
                Object::EndpointSlice(Box::new(yaml_serde::from_value(value).with_context(ctx)?))
            }
            "Node" => Object::Node(Box::new(yaml_serde::from_value(value).with_context(ctx)?)),
            "" => bail!("{origin}: document {i} has no kind"),
            _ => Object::Other(value),
        };
        let meta = match &mut obj {
            Object::Service(o) => Some(&mut o.metadata),
            Object::Pod(o) => Some(&mut o.metadata),
            Object::EndpointSlice(o) => Some(&mut o.metadata),
            _ => None,
        };
        if let Some(m) = meta {
            if m.name.as_deref().unwrap_or("").is_empty() {
                bail!("{origin}: document {i} ({kind}) has no metadata.name");
            }
            m.namespace.get_or_insert_with(|| "default".to_string());
        }
        out.push(obj);
    }
    Ok(out)
}

/// Reads a manifest file, or every `*.yaml` / `*.yml` file of a directory in
/// name order (by file stem).
pub fn load_path(path: &Path) -> Result<Vec<Object>> {
    let mut files = Vec::new();
    if path.is_dir() {
        for e in std::fs::read_dir(path).with_context(|| format!("read {}", path.display()))? {
            let p = e?.path();
            let ext = p.extension().and_then(|x| x.to_str()).unwrap_or("");
            if p.is_file() && (ext == "yaml" || ext == "yml") {
                files.push(p);
            }
        }
        // By stem first, so `a.yaml` comes before `a-2.yaml`.
        files.sort_by_key(|p| (p.file_stem().map(|s| s.to_os_string()), p.clone()));
    } else {
        files.push(path.to_path_buf());
    }
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).with_context(|| format!("read {}", f.display()))?;
        out.extend(parse_yaml(&text, &f.display().to_string())?);
    }
    Ok(out)
}

/// Renders objects as one multi-document YAML text.
pub fn render(objects: &[Object]) -> Result<String> {
    let mut out = String::new();
    for o in objects {
        out.push_str("---\n");
        out.push_str(&o.to_yaml()?);
    }
    Ok(out)
}

/// True if the service gets no ClusterIP (ExternalName, headless).
fn wants_no_cluster_ip(svc: &Service) -> bool {
    let Some(spec) = &svc.spec else { return true };
    spec.type_.as_deref() == Some("ExternalName") || spec.cluster_ip.as_deref() == Some("None")
}

/// Every address a service names (ClusterIPs, externalIPs, LB ingress).
fn service_addrs(svc: &Service) -> Vec<String> {
    let mut v = Vec::new();
    if let Some(spec) = &svc.spec {
        v.extend(spec.cluster_ip.iter().cloned());
        v.extend(spec.cluster_ips.iter().flatten().cloned());
        v.extend(spec.external_ips.iter().flatten().cloned());
        v.extend(spec.load_balancer_ip.iter().cloned());
    }
    if let Some(st) = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()) {
        v.extend(st.ingress.iter().flatten().filter_map(|i| i.ip.clone()));
    }
    v.retain(|a| !a.is_empty() && a != "None");
    v
}

/// A node pods can be placed on, with its pod address pool.
#[derive(Debug, Clone)]
pub struct NodePool {
    pub name: String,
    pub ip: Ipv4Addr,
    pub pod_first: Ipv4Addr,
    pub pod_last: Ipv4Addr,
    /// The node's IPv6 address (dual-stack: hostNetwork pods get it).
    pub ip6: Option<Ipv6Addr>,
}

/// An IP family as `ipFamilies` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    fn parse(name: &str) -> Option<Family> {
        match name {
            "IPv4" => Some(Family::V4),
            "IPv6" => Some(Family::V6),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    fn other(self) -> Family {
        match self {
            Family::V4 => Family::V6,
            Family::V6 => Family::V4,
        }
    }
}

/// The lab's stand-in for the API server's allocators (and the scheduler:
/// pods without `spec.nodeName` are placed round-robin over the nodes).
#[derive(Debug, Clone)]
pub struct Allocator {
    nodes: Vec<NodePool>,
    next_node: usize,
    used_ips: BTreeSet<IpAddr>,
    used_node_ports: BTreeSet<i32>,
    /// IPv6 too: ClusterIPs of both families, pods with `podIPs` of both.
    dual_stack: bool,
    /// A real API server allocates ClusterIPs and NodePorts
    /// ([`Allocator::set_services_by_api_server`]): Services are left as
    /// they are.
    services_by_api_server: bool,
}

impl Allocator {
    /// Pod IPs from `pod_first..=pod_last`; pods land on `node_name`.
    pub fn new(
        node_name: &str,
        node_ip: Ipv4Addr,
        pod_first: Ipv4Addr,
        pod_last: Ipv4Addr,
    ) -> Self {
        Allocator {
            nodes: vec![NodePool {
                name: node_name.to_string(),
                ip: node_ip,
                pod_first,
                pod_last,
                ip6: None,
            }],
            next_node: 0,
            services_by_api_server: false,
            used_ips: BTreeSet::new(),
            used_node_ports: BTreeSet::new(),
            dual_stack: false,
        }
    }

    /// Dual-stack (default: IPv4 only): Services get `ipFamilies`,
    /// `ipFamilyPolicy` and ClusterIPs of the families asked for (IPv4, the
    /// primary family, when none is), Pods `podIPs` of both families.
    pub fn set_dual_stack(&mut self, on: bool) {
        self.dual_stack = on;
    }

    /// Whether the allocator is dual-stack.
    pub fn is_dual_stack(&self) -> bool {
        self.dual_stack
    }

    /// Gives node `node` an IPv6 address (for its hostNetwork pods).
    pub fn set_node_ip6(&mut self, node: &str, ip6: Ipv6Addr) {
        if let Some(n) = self.nodes.iter_mut().find(|n| n.name == node) {
            n.ip6 = Some(ip6);
        }
        self.used_ips.insert(ip6.into());
    }

    /// Adds another node. Pods without a nodeName are placed round-robin over
    /// the nodes, in the order they were added.
    pub fn add_node(
        &mut self,
        node_name: &str,
        node_ip: Ipv4Addr,
        pod_first: Ipv4Addr,
        pod_last: Ipv4Addr,
    ) {
        self.nodes.push(NodePool {
            name: node_name.to_string(),
            ip: node_ip,
            pod_first,
            pod_last,
            ip6: None,
        });
    }

    /// The nodes, in order.
    pub fn nodes(&self) -> &[NodePool] {
        &self.nodes
    }

    fn pool(&self, node: &str) -> Option<&NodePool> {
        self.nodes.iter().find(|n| n.name == node)
    }

    /// Marks an address (of either family) as taken (client namespaces,
    /// gateways).
    pub fn reserve_ip(&mut self, ip: impl Into<IpAddr>) {
        self.used_ips.insert(ip.into());
    }

    /// Frees an address (a deleted pod or service).
    pub fn release_ip(&mut self, ip: impl Into<IpAddr>) {
        self.used_ips.remove(&ip.into());
    }

    fn next_ip(&mut self, first: Ipv4Addr, last: Ipv4Addr, what: &str) -> Result<Ipv4Addr> {
        let (first, last) = (u32::from(first), u32::from(last));
        for n in first..=last {
            let ip = Ipv4Addr::from(n);
            if self.used_ips.insert(ip.into()) {
                return Ok(ip);
            }
        }
        bail!("no free {what} address left")
    }

    fn next_ip6(&mut self, first: Ipv6Addr, last: Ipv6Addr, what: &str) -> Result<Ipv6Addr> {
        let (first, last) = (u128::from(first), u128::from(last));
        // Bounded: the taken addresses are at most as many as the set holds.
        for n in (first..=last).take(self.used_ips.len() + 1) {
            let ip = Ipv6Addr::from(n);
            if self.used_ips.insert(ip.into()) {
                return Ok(ip);
            }
        }
        bail!("no free {what} address left")
    }

    /// A free ClusterIP of `family`.
    fn next_cluster_ip(&mut self, family: Family) -> Result<IpAddr> {
        Ok(match family {
            Family::V4 => self
                .next_ip(SERVICE_CIDR_FIRST, SERVICE_CIDR_LAST, "ClusterIP")?
                .into(),
            Family::V6 => self
                .next_ip6(SERVICE_CIDR6_FIRST, SERVICE_CIDR6_LAST, "IPv6 ClusterIP")?
                .into(),
        })
    }

    /// Allocates an address from an arbitrary range (extra clients).
    pub fn allocate_in(&mut self, first: Ipv4Addr, last: Ipv4Addr, what: &str) -> Result<Ipv4Addr> {
        self.next_ip(first, last, what)
    }

    /// Fills in what the API server and kubelet would: ClusterIPs, NodePorts,
    /// pod IPs, node names and Running/Ready status. `previous` holds the
    /// objects as they were, whose allocations are kept (they are immutable in
    /// Kubernetes). All addresses must be in the lab range.
    pub fn complete(&mut self, obj: &mut Object, previous: Option<&Object>) -> Result<()> {
        match obj {
            Object::Service(svc) => self.complete_service(svc, previous),
            Object::Pod(pod) => self.complete_pod(pod, previous),
            _ => Ok(()),
        }
    }

    /// Leaves ClusterIPs and NodePorts to a real API server: Services pass
    /// through [`complete`](Allocator::complete) untouched (Pods still get
    /// their IPs and status, the kubelet's and the network plugin's part).
    pub fn set_services_by_api_server(&mut self, on: bool) {
        self.services_by_api_server = on;
    }

    fn complete_service(&mut self, svc: &mut Service, previous: Option<&Object>) -> Result<()> {
        if self.services_by_api_server {
            return Ok(());
        }
        let name = svc.metadata.name.clone().unwrap_or_default();
        let prev = match previous {
            Some(Object::Service(p)) => Some(p.as_ref()),
            _ => None,
        };
        if !wants_no_cluster_ip(svc) {
            let spec = svc.spec.get_or_insert_with(Default::default);
            if self.dual_stack {
                self.complete_cluster_ips(&name, spec, prev.and_then(|p| p.spec.as_ref()))?;
            } else {
                if let Some(why) = asks_for_ipv6(spec) {
                    bail!(
                        "service {name}: {why}, but the lab is IPv4 only (start it with \
                         LabBuilder::dual_stack)"
                    );
                }
                let kept = prev
                    .and_then(|p| p.spec.as_ref())
                    .and_then(|s| s.cluster_ip.clone())
                    .filter(|ip| ip != "None" && !ip.is_empty());
                if spec.cluster_ip.as_deref().unwrap_or("").is_empty() {
                    let ip = match kept {
                        Some(ip) => ip,
                        None => self
                            .next_ip(SERVICE_CIDR_FIRST, SERVICE_CIDR_LAST, "ClusterIP")?
                            .to_string(),
                    };
                    spec.cluster_ip = Some(ip.clone());
                    spec.cluster_ips = Some(vec![ip]);
                } else if spec.cluster_ips.is_none() {
                    spec.cluster_ips = spec.cluster_ip.clone().map(|ip| vec![ip]);
                }
            }
            spec.type_.get_or_insert_with(|| "ClusterIP".to_string());
            let needs_node_port = matches!(
                spec.type_.as_deref(),
                Some("NodePort") | Some("LoadBalancer")
            );
            let prev_ports = prev
                .and_then(|p| p.spec.as_ref())
                .and_then(|s| s.ports.clone())
                .unwrap_or_default();
            for port in spec.ports.iter_mut().flatten() {
                port.protocol.get_or_insert_with(|| "TCP".to_string());
                if needs_node_port && port.node_port.is_none() {
                    let kept = prev_ports
                        .iter()
                        .find(|p| {
                            p.port == port.port
                                && p.protocol == port.protocol
                                && p.name == port.name
                        })
                        .and_then(|p| p.node_port);
                    port.node_port = Some(match kept {
                        Some(p) => p,
                        None => self.next_node_port(&name)?,
                    });
                }
                if let Some(np) = port.node_port {
                    self.used_node_ports.insert(np);
                }
            }
        }
        for a in service_addrs(svc) {
            let ip: IpAddr = if self.dual_stack {
                a.parse()
                    .with_context(|| format!("service {name}: {a} is not an IP address"))?
            } else {
                a.parse::<Ipv4Addr>()
                    .with_context(|| format!("service {name}: {a} is not an IPv4 address"))?
                    .into()
            };
            check_lab_ip(ip).with_context(|| format!("service {name}"))?;
            self.used_ips.insert(ip);
        }
        Ok(())
    }

    /// Dual-stack: `ipFamilyPolicy`, `ipFamilies`, `clusterIPs` and
    /// `clusterIP` as the API server of a dual-stack cluster (IPv4 primary)
    /// fills them in (`initIPFamilyFields` and the allocators of
    /// pkg/registry/core/service): the families come from the given
    /// clusterIPs, else `ipFamilies`, else the primary family; no policy is
    /// RequireDualStack with two families or clusterIPs given, else
    /// SingleStack; PreferDualStack and RequireDualStack get both families.
    /// ClusterIPs already allocated (`prev`) are kept; a secondary one is
    /// dropped when the Service goes back to SingleStack.
    fn complete_cluster_ips(
        &mut self,
        name: &str,
        spec: &mut ServiceSpec,
        prev: Option<&ServiceSpec>,
    ) -> Result<()> {
        let parse_all = |ips: &[String]| -> Result<Vec<IpAddr>> {
            ips.iter()
                .filter(|ip| !ip.is_empty())
                .map(|ip| {
                    ip.parse::<IpAddr>()
                        .with_context(|| format!("service {name}: clusterIP {ip:?}"))
                })
                .collect()
        };
        let listed = |s: &ServiceSpec| -> Vec<String> {
            match (&s.cluster_ips, &s.cluster_ip) {
                (Some(ips), _) if !ips.is_empty() => ips.clone(),
                (_, Some(ip)) => vec![ip.clone()],
                _ => Vec::new(),
            }
        };
        let explicit = parse_all(&listed(spec))?;
        if let (Some(ip), Some(first)) = (spec.cluster_ip.as_deref(), explicit.first()) {
            if !ip.is_empty() && ip.parse::<IpAddr>().ok() != Some(*first) {
                bail!("service {name}: clusterIP {ip} is not clusterIPs[0] ({first})");
            }
        }
        let previous = prev.map(|p| parse_all(&listed(p))).transpose()?;
        let given: Vec<Family> = spec
            .ip_families
            .iter()
            .flatten()
            .map(|f| {
                Family::parse(f).with_context(|| {
                    format!("service {name}: ipFamilies: {f:?} is neither IPv4 nor IPv6")
                })
            })
            .collect::<Result<_>>()?;
        if given.len() > 2 || (given.len() == 2 && given[0] == given[1]) {
            bail!("service {name}: ipFamilies {given:?}: at most one of each family");
        }
        if explicit.len() > 2
            || (explicit.len() == 2 && Family::of(explicit[0]) == Family::of(explicit[1]))
        {
            bail!("service {name}: clusterIPs {explicit:?}: at most one of each family");
        }
        let base = if explicit.is_empty() {
            previous.unwrap_or_default()
        } else {
            explicit.clone()
        };
        for (f, ip) in given.iter().zip(&base) {
            if Family::of(*ip) != *f {
                bail!(
                    "service {name}: ipFamilies {:?} do not match the clusterIPs {base:?}",
                    spec.ip_families.as_deref().unwrap_or_default()
                );
            }
        }
        let policy = match spec.ip_family_policy.as_deref() {
            None | Some("") if explicit.len() == 2 || given.len() == 2 => "RequireDualStack",
            None | Some("") => "SingleStack",
            Some(p @ ("SingleStack" | "PreferDualStack" | "RequireDualStack")) => p,
            Some(p) => bail!("service {name}: unknown ipFamilyPolicy {p:?}"),
        }
        .to_string();
        if policy == "SingleStack" && (explicit.len() == 2 || given.len() == 2) {
            bail!("service {name}: SingleStack with two families ({given:?}, {explicit:?})");
        }
        let primary = base
            .first()
            .map(|ip| Family::of(*ip))
            .or(given.first().copied())
            .unwrap_or(Family::V4);
        let families = if policy == "SingleStack" {
            vec![primary]
        } else {
            vec![primary, primary.other()]
        };
        let mut ips = Vec::new();
        for (i, f) in families.iter().enumerate() {
            let ip = match base.get(i) {
                Some(ip) => *ip,
                None => self.next_cluster_ip(*f)?,
            };
            ips.push(ip.to_string());
        }
        for dropped in base.iter().skip(families.len()) {
            self.used_ips.remove(dropped);
        }
        spec.cluster_ip = ips.first().cloned();
        spec.cluster_ips = Some(ips);
        spec.ip_families = Some(families.iter().map(|f| f.name().to_string()).collect());
        spec.ip_family_policy = Some(policy);
        Ok(())
    }

    fn next_node_port(&mut self, svc: &str) -> Result<i32> {
        for p in NODE_PORT_FIRST..=NODE_PORT_LAST {
            if self.used_node_ports.insert(p) {
                return Ok(p);
            }
        }
        bail!("service {svc}: no free NodePort left")
    }

    fn complete_pod(&mut self, pod: &mut Pod, previous: Option<&Object>) -> Result<()> {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let (prev_ip, prev_node) = match previous {
            Some(Object::Pod(p)) => (
                p.status.as_ref().and_then(|s| s.pod_ip.clone()),
                p.spec
                    .as_ref()
                    .and_then(|s| s.node_name.clone())
                    .filter(|n| !n.is_empty()),
            ),
            _ => (None, None),
        };
        let prev_ip6 = match previous {
            Some(Object::Pod(p)) => p.status.as_ref().and_then(pod_ip6),
            _ => None,
        };
        let spec = pod.spec.get_or_insert_with(Default::default);
        let node = match spec.node_name.as_deref() {
            None | Some("") => match prev_node {
                Some(n) => n,
                None => {
                    let n = self.nodes[self.next_node % self.nodes.len()].name.clone();
                    self.next_node = (self.next_node + 1) % self.nodes.len();
                    n
                }
            },
            Some(n) => {
                if prev_node.as_deref().is_some_and(|p| p != n) {
                    bail!(
                        "pod {name}: spec.nodeName cannot change ({} -> {n})",
                        prev_node.unwrap_or_default()
                    );
                }
                n.to_string()
            }
        };
        let Some(pool) = self.pool(&node).cloned() else {
            bail!(
                "pod {name}: node {node} is not a node of this lab ({})",
                self.nodes
                    .iter()
                    .map(|n| n.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        };
        spec.node_name = Some(node);
        let host_network = spec.host_network == Some(true);
        let status = pod.status.get_or_insert_with(PodStatus::default);
        let ip = match (status.pod_ip.as_deref(), prev_ip) {
            (Some(ip), prev) if !ip.is_empty() => {
                if prev.as_deref().is_some_and(|p| p != ip) {
                    bail!(
                        "pod {name}: podIP cannot change ({} -> {ip})",
                        prev.unwrap_or_default()
                    );
                }
                let ip: Ipv4Addr = ip
                    .parse()
                    .with_context(|| format!("pod {name}: podIP {ip}"))?;
                ip
            }
            (_, Some(prev)) => prev.parse()?,
            _ if host_network => pool.ip,
            _ => self.next_ip(pool.pod_first, pool.pod_last, "pod")?,
        };
        check_lab_addr(ip).with_context(|| format!("pod {name}"))?;
        self.used_ips.insert(ip.into());
        status.pod_ip = Some(ip.to_string());
        let mut pod_ips = vec![PodIP { ip: ip.to_string() }];
        if self.dual_stack {
            let ip6 = match (pod_ip6(status), prev_ip6) {
                (Some(ip6), prev) => {
                    if prev.is_some_and(|p| p != ip6) {
                        bail!(
                            "pod {name}: IPv6 podIP cannot change ({} -> {ip6})",
                            prev.unwrap_or(ip6)
                        );
                    }
                    ip6
                }
                (None, Some(prev)) => prev,
                (None, None) if host_network => pool.ip6.with_context(|| {
                    format!("pod {name}: node {} has no IPv6 address", pool.name)
                })?,
                (None, None) => ipv6_twin(ip).with_context(|| {
                    format!(
                        "pod {name}: podIP {ip} is outside 198.18.0.0/16 and has no IPv6 \
                         twin; give status.podIPs an IPv6 address"
                    )
                })?,
            };
            check_lab_ip(ip6.into()).with_context(|| format!("pod {name}"))?;
            self.used_ips.insert(ip6.into());
            pod_ips.push(PodIP {
                ip: ip6.to_string(),
            });
        }
        status.pod_ips = Some(pod_ips);
        status.host_ip.get_or_insert_with(|| pool.ip.to_string());
        status.phase.get_or_insert_with(|| "Running".to_string());
        let conds = status.conditions.get_or_insert_with(Vec::new);
        if !conds.iter().any(|c| c.type_ == "Ready") {
            conds.push(PodCondition {
                type_: "Ready".to_string(),
                status: "True".to_string(),
                ..Default::default()
            });
        }
        Ok(())
    }

    /// A Node object for the lab's first node, unless the manifests bring one.
    pub fn node_object(&self, pod_cidr: &str) -> Object {
        let first = &self.nodes[0];
        node_object(&first.name, first.ip, pod_cidr, None)
    }
}

/// The first IPv6 address of a pod's `podIPs` (or `podIP`).
fn pod_ip6(status: &PodStatus) -> Option<Ipv6Addr> {
    status
        .pod_ip
        .iter()
        .chain(status.pod_ips.iter().flatten().map(|p| &p.ip))
        .find_map(|a| a.parse::<Ipv6Addr>().ok())
}

/// Why a Service's spec needs IPv6, if it does: `ipFamilies` naming IPv6,
/// `ipFamilyPolicy: RequireDualStack`, or an IPv6 clusterIP.
/// The first Service of `objects` that an IPv4-only lab refuses (it asks
/// for IPv6), as "service <name>: <why>"; `cargo xtask lab up` checks this
/// before it creates anything, to name its `--dual-stack` flag.
pub fn first_ipv6_request(objects: &[Object]) -> Option<String> {
    objects.iter().find_map(|o| match o {
        Object::Service(svc) if !wants_no_cluster_ip(svc) => {
            let why = asks_for_ipv6(svc.spec.as_ref()?)?;
            let name = svc.metadata.name.as_deref().unwrap_or_default();
            Some(format!("service {name}: {why}"))
        }
        _ => None,
    })
}

fn asks_for_ipv6(spec: &ServiceSpec) -> Option<String> {
    if spec.ip_families.iter().flatten().any(|f| f == "IPv6") {
        return Some(format!(
            "ipFamilies {:?}",
            spec.ip_families.as_deref().unwrap_or_default()
        ));
    }
    if spec.ip_family_policy.as_deref() == Some("RequireDualStack") {
        return Some("ipFamilyPolicy RequireDualStack".to_string());
    }
    spec.cluster_ip
        .iter()
        .chain(spec.cluster_ips.iter().flatten())
        .find(|ip| ip.parse::<Ipv6Addr>().is_ok())
        .map(|ip| format!("IPv6 clusterIP {ip}"))
}

/// A Node object: labels `kubernetes.io/hostname` (and
/// `topology.kubernetes.io/zone` if `zone` is given), `spec.podCIDR`, and the
/// InternalIP and Hostname addresses.
pub fn node_object(name: &str, ip: Ipv4Addr, pod_cidr: &str, zone: Option<&str>) -> Object {
    node_object_dual_stack(name, ip, pod_cidr, None, zone)
}

/// [`node_object`] of a dual-stack node when `ipv6` (its IPv6 address and
/// pod CIDR) is given: a second InternalIP and a second `podCIDRs` entry,
/// IPv6 after IPv4.
pub fn node_object_dual_stack(
    name: &str,
    ip: Ipv4Addr,
    pod_cidr: &str,
    ipv6: Option<(Ipv6Addr, &str)>,
    zone: Option<&str>,
) -> Object {
    let mut labels = std::collections::BTreeMap::new();
    labels.insert("kubernetes.io/hostname".to_string(), name.to_string());
    if let Some(z) = zone {
        labels.insert("topology.kubernetes.io/zone".to_string(), z.to_string());
    }
    Object::Node(Box::new(Node {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: Some(pod_cidr.to_string()),
            pod_cidrs: Some(
                std::iter::once(pod_cidr.to_string())
                    .chain(ipv6.map(|(_, c)| c.to_string()))
                    .collect(),
            ),
            ..Default::default()
        }),
        status: Some(NodeStatus {
            addresses: Some(
                std::iter::once(ip.to_string())
                    .chain(ipv6.map(|(a, _)| a.to_string()))
                    .map(|address| NodeAddress {
                        type_: "InternalIP".to_string(),
                        address,
                    })
                    .chain(std::iter::once(NodeAddress {
                        type_: "Hostname".to_string(),
                        address: name.to_string(),
                    }))
                    .collect(),
            ),
            ..Default::default()
        }),
    }))
}

/// Ports a pod's server listens on: every containerPort (for TCP and UDP
/// alike), or 80 if it declares none. Returned as `(port, protocol)` as declared.
pub fn pod_ports(pod: &Pod) -> Vec<(u16, String)> {
    let mut v: Vec<(u16, String)> = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| {
            let port = u16::try_from(p.container_port).ok()?;
            Some((
                port,
                p.protocol.clone().unwrap_or_else(|| "TCP".to_string()),
            ))
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: pod-1, labels: {app: a}}
spec:
  containers: [{name: c, image: nginx, ports: [{containerPort: 80}]}]
---
apiVersion: v1
kind: Service
metadata: {name: svc}
spec:
  selector: {app: a}
  ports: [{port: 80, targetPort: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: headless}
spec:
  clusterIP: None
  ports: [{port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: np}
spec:
  type: NodePort
  ports: [{port: 81}]
"#;

    #[test]
    fn allocates_like_the_api_server() {
        let mut objs = parse_yaml(YAML, "test").unwrap();
        let mut a = Allocator::new(
            "node-1",
            "198.18.0.10".parse().unwrap(),
            "198.18.1.10".parse().unwrap(),
            "198.18.1.254".parse().unwrap(),
        );
        for o in &mut objs {
            a.complete(o, None).unwrap();
        }
        let Object::Pod(p) = &objs[0] else { panic!() };
        assert_eq!(
            p.status.as_ref().unwrap().pod_ip.as_deref(),
            Some("198.18.1.10")
        );
        assert_eq!(
            p.spec.as_ref().unwrap().node_name.as_deref(),
            Some("node-1")
        );
        assert_eq!(p.metadata.namespace.as_deref(), Some("default"));
        let Object::Service(s) = &objs[1] else {
            panic!()
        };
        assert_eq!(
            s.spec.as_ref().unwrap().cluster_ip.as_deref(),
            Some("198.19.0.10")
        );
        let Object::Service(s) = &objs[2] else {
            panic!()
        };
        assert_eq!(s.spec.as_ref().unwrap().cluster_ip.as_deref(), Some("None"));
        let Object::Service(s) = &objs[3] else {
            panic!()
        };
        let spec = s.spec.as_ref().unwrap();
        assert_eq!(spec.cluster_ip.as_deref(), Some("198.19.0.11"));
        assert_eq!(spec.ports.as_ref().unwrap()[0].node_port, Some(30000));
        // Round trip through rendering.
        let text = render(&objs).unwrap();
        let again = parse_yaml(&text, "rendered").unwrap();
        assert_eq!(again.len(), 4);
        assert!(text.contains("kind: Pod") && text.contains("apiVersion: v1"));
    }

    fn dual_stack_allocator() -> Allocator {
        let mut a = Allocator::new(
            "node-1",
            "198.18.0.10".parse().unwrap(),
            "198.18.1.10".parse().unwrap(),
            "198.18.1.254".parse().unwrap(),
        );
        a.set_dual_stack(true);
        a.set_node_ip6("node-1", "2001:2::a".parse().unwrap());
        a
    }

    fn service(spec: &str) -> Object {
        let yaml = format!(
            "kind: Service\napiVersion: v1\nmetadata: {{name: s}}\nspec: {{{spec}ports: [{{port: 80}}]}}\n"
        );
        parse_yaml(&yaml, "t").unwrap().remove(0)
    }

    /// `(clusterIP, clusterIPs, ipFamilies, ipFamilyPolicy)` of a Service.
    fn families(o: &Object) -> (String, Vec<String>, Vec<String>, String) {
        let Object::Service(s) = o else { panic!() };
        let spec = s.spec.as_ref().unwrap();
        (
            spec.cluster_ip.clone().unwrap_or_default(),
            spec.cluster_ips.clone().unwrap_or_default(),
            spec.ip_families.clone().unwrap_or_default(),
            spec.ip_family_policy.clone().unwrap_or_default(),
        )
    }

    #[test]
    fn dual_stack_services_get_the_families_they_ask_for() {
        let mut a = dual_stack_allocator();
        let cases = [
            (
                "",
                "198.19.0.10",
                &["198.19.0.10"][..],
                &["IPv4"][..],
                "SingleStack",
            ),
            (
                "ipFamilies: [IPv6], ipFamilyPolicy: SingleStack, ",
                "2001:2:0:ff::a",
                &["2001:2:0:ff::a"][..],
                &["IPv6"][..],
                "SingleStack",
            ),
            (
                "ipFamilies: [IPv6], ",
                "2001:2:0:ff::b",
                &["2001:2:0:ff::b"][..],
                &["IPv6"][..],
                "SingleStack",
            ),
            (
                "ipFamilyPolicy: PreferDualStack, ",
                "198.19.0.11",
                &["198.19.0.11", "2001:2:0:ff::c"][..],
                &["IPv4", "IPv6"][..],
                "PreferDualStack",
            ),
            (
                "ipFamilies: [IPv6, IPv4], ",
                "2001:2:0:ff::d",
                &["2001:2:0:ff::d", "198.19.0.12"][..],
                &["IPv6", "IPv4"][..],
                "RequireDualStack",
            ),
            (
                "clusterIP: \"2001:2:0:ff::99\", ipFamilyPolicy: RequireDualStack, ",
                "2001:2:0:ff::99",
                &["2001:2:0:ff::99", "198.19.0.13"][..],
                &["IPv6", "IPv4"][..],
                "RequireDualStack",
            ),
        ];
        for (spec, ip, ips, fams, policy) in cases {
            let mut o = service(spec);
            a.complete(&mut o, None)
                .unwrap_or_else(|e| panic!("{spec}: {e:#}"));
            let (got_ip, got_ips, got_fams, got_policy) = families(&o);
            assert_eq!(got_ip, ip, "{spec}");
            assert_eq!(got_ips, ips, "{spec}");
            assert_eq!(got_fams, fams, "{spec}");
            assert_eq!(got_policy, policy, "{spec}");
        }
        for bad in [
            "ipFamilies: [IPv4, IPv6], ipFamilyPolicy: SingleStack, ",
            "ipFamilies: [IPv6, IPv6], ",
            "ipFamilies: [IPv7], ",
            "ipFamilies: [IPv4], clusterIP: \"2001:2:0:ff::98\", ",
            "clusterIP: \"fd00::1\", ",
        ] {
            let mut o = service(bad);
            assert!(a.complete(&mut o, None).is_err(), "{bad}");
        }
    }

    #[test]
    fn dual_stack_allocations_are_kept_and_a_secondary_is_dropped() {
        let mut a = dual_stack_allocator();
        let mut first = service("ipFamilyPolicy: PreferDualStack, ");
        a.complete(&mut first, None).unwrap();
        assert_eq!(families(&first).1, ["198.19.0.10", "2001:2:0:ff::a"]);
        // The same fixture again: both kept.
        let mut again = service("ipFamilyPolicy: PreferDualStack, ");
        a.complete(&mut again, Some(&first)).unwrap();
        assert_eq!(families(&again).1, families(&first).1);
        // Single-stack again: the primary kept, the secondary dropped and
        // free for the next Service.
        let mut single = service("ipFamilyPolicy: SingleStack, ");
        a.complete(&mut single, Some(&again)).unwrap();
        assert_eq!(families(&single).1, ["198.19.0.10"]);
        let mut other = service("ipFamilies: [IPv6], ");
        a.complete(&mut other, None).unwrap();
        assert_eq!(families(&other).1, ["2001:2:0:ff::a"]);
    }

    #[test]
    fn dual_stack_pods_get_both_families() {
        let mut a = dual_stack_allocator();
        let mut objs = parse_yaml(
            "kind: Pod\napiVersion: v1\nmetadata: {name: p}\nspec: {containers: []}\n---\n\
             kind: Pod\napiVersion: v1\nmetadata: {name: h}\nspec: {hostNetwork: true, containers: []}\n",
            "t",
        )
        .unwrap();
        for o in &mut objs {
            a.complete(o, None).unwrap();
        }
        let ips = |o: &Object| -> Vec<String> {
            let Object::Pod(p) = o else { panic!() };
            let st = p.status.as_ref().unwrap();
            assert_eq!(
                st.pod_ip.as_ref(),
                Some(&st.pod_ips.as_ref().unwrap()[0].ip)
            );
            st.pod_ips.iter().flatten().map(|i| i.ip.clone()).collect()
        };
        assert_eq!(ips(&objs[0]), ["198.18.1.10", "2001:2:0:1::a"]);
        assert_eq!(ips(&objs[1]), ["198.18.0.10", "2001:2::a"]);
        // Kept when completed again against itself.
        let prev = objs[0].clone();
        a.complete(&mut objs[0], Some(&prev)).unwrap();
        assert_eq!(ips(&objs[0]), ["198.18.1.10", "2001:2:0:1::a"]);
    }

    #[test]
    fn ipv4_only_labs_refuse_ipv6_services() {
        let mut a = Allocator::new(
            "node-1",
            "198.18.0.10".parse().unwrap(),
            "198.18.1.10".parse().unwrap(),
            "198.18.1.254".parse().unwrap(),
        );
        for bad in [
            "ipFamilies: [IPv6], ",
            "ipFamilyPolicy: RequireDualStack, ",
            "clusterIP: \"2001:2:0:ff::a\", ",
        ] {
            let mut o = service(bad);
            let e = a.complete(&mut o, None).unwrap_err();
            assert!(format!("{e:#}").contains("IPv4 only"), "{bad}: {e:#}");
        }
        // PreferDualStack is served on the one family there is; nothing is
        // added to what the manifest says.
        let mut o = service("ipFamilyPolicy: PreferDualStack, ");
        a.complete(&mut o, None).unwrap();
        assert_eq!(
            families(&o),
            (
                "198.19.0.10".to_string(),
                vec!["198.19.0.10".to_string()],
                vec![],
                "PreferDualStack".to_string()
            )
        );
    }

    #[test]
    fn dual_stack_node_objects() {
        let Object::Node(n) = node_object_dual_stack(
            "node-1",
            "198.18.0.10".parse().unwrap(),
            "198.18.1.0/24",
            Some(("2001:2::a".parse().unwrap(), "2001:2:0:1::/64")),
            None,
        ) else {
            panic!()
        };
        let spec = n.spec.unwrap();
        assert_eq!(
            spec.pod_cidrs.unwrap(),
            ["198.18.1.0/24", "2001:2:0:1::/64"]
        );
        let addrs: Vec<(String, String)> = n
            .status
            .unwrap()
            .addresses
            .unwrap()
            .into_iter()
            .map(|a| (a.type_, a.address))
            .collect();
        assert_eq!(
            addrs,
            [
                ("InternalIP".to_string(), "198.18.0.10".to_string()),
                ("InternalIP".to_string(), "2001:2::a".to_string()),
                ("Hostname".to_string(), "node-1".to_string()),
            ]
        );
    }

    #[test]
    fn refuses_addresses_outside_the_lab() {
        let mut objs = parse_yaml(
            "kind: Service\napiVersion: v1\nmetadata: {name: s}\nspec: {clusterIP: 10.0.0.1, ports: [{port: 1}]}\n",
            "t",
        )
        .unwrap();
        let mut a = Allocator::new(
            "node-1",
            "198.18.0.10".parse().unwrap(),
            "198.18.1.10".parse().unwrap(),
            "198.18.1.254".parse().unwrap(),
        );
        assert!(a.complete(&mut objs[0], None).is_err());
    }

    /// An IPv4-only lab refuses a Service asking for IPv6: the library's
    /// error names the builder method (the CLI's check names its flag, see
    /// `xtask/tests/cli.rs`), and the check the CLI runs first finds it.
    #[test]
    fn ipv6_service_in_ipv4_lab_names_the_builder_method() {
        let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: v4}
spec: {ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: both}
spec:
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  ports: [{port: 80}]
"#;
        let mut objs = parse_yaml(yaml, "test").unwrap();
        assert_eq!(
            first_ipv6_request(&objs).as_deref(),
            Some(r#"service both: ipFamilies ["IPv4", "IPv6"]"#)
        );
        assert_eq!(first_ipv6_request(&objs[..1]), None);
        let mut a = Allocator::new(
            "node-1",
            "198.18.0.10".parse().unwrap(),
            "198.18.1.10".parse().unwrap(),
            "198.18.1.254".parse().unwrap(),
        );
        a.complete(&mut objs[0], None).unwrap();
        let err = a.complete(&mut objs[1], None).unwrap_err().to_string();
        assert!(err.contains("LabBuilder::dual_stack"), "{err}");
    }
}

//! Kubernetes manifests of a lab: parsing, the API server's allocators
//! (ClusterIPs, NodePorts, pod IPs, pod status) and rendering to one
//! multi-document YAML file.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::Path;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::{
    Node, NodeAddress, NodeSpec, NodeStatus, Pod, PodCondition, PodIP, PodStatus, Service,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

use crate::netns::check_lab_addr;

/// First ClusterIP handed out (198.19.0.0/16, from .10 up).
pub const SERVICE_CIDR_FIRST: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 10);
/// Last ClusterIP handed out.
pub const SERVICE_CIDR_LAST: Ipv4Addr = Ipv4Addr::new(198, 19, 255, 254);
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

/// Every IPv4 address a service names (ClusterIPs, externalIPs, LB ingress).
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
}

/// The lab's stand-in for the API server's allocators (and the scheduler:
/// pods without `spec.nodeName` are placed round-robin over the nodes).
#[derive(Debug, Clone)]
pub struct Allocator {
    nodes: Vec<NodePool>,
    next_node: usize,
    used_ips: BTreeSet<Ipv4Addr>,
    used_node_ports: BTreeSet<i32>,
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
            }],
            next_node: 0,
            used_ips: BTreeSet::new(),
            used_node_ports: BTreeSet::new(),
        }
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
        });
    }

    /// The nodes, in order.
    pub fn nodes(&self) -> &[NodePool] {
        &self.nodes
    }

    fn pool(&self, node: &str) -> Option<&NodePool> {
        self.nodes.iter().find(|n| n.name == node)
    }

    /// Marks an address as taken (client namespaces, gateways).
    pub fn reserve_ip(&mut self, ip: Ipv4Addr) {
        self.used_ips.insert(ip);
    }

    /// Frees an address (a deleted pod or service).
    pub fn release_ip(&mut self, ip: Ipv4Addr) {
        self.used_ips.remove(&ip);
    }

    fn next_ip(&mut self, first: Ipv4Addr, last: Ipv4Addr, what: &str) -> Result<Ipv4Addr> {
        let (first, last) = (u32::from(first), u32::from(last));
        for n in first..=last {
            let ip = Ipv4Addr::from(n);
            if !self.used_ips.contains(&ip) {
                self.used_ips.insert(ip);
                return Ok(ip);
            }
        }
        bail!("no free {what} address left")
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

    fn complete_service(&mut self, svc: &mut Service, previous: Option<&Object>) -> Result<()> {
        let name = svc.metadata.name.clone().unwrap_or_default();
        let prev = match previous {
            Some(Object::Service(p)) => Some(p.as_ref()),
            _ => None,
        };
        if !wants_no_cluster_ip(svc) {
            let spec = svc.spec.get_or_insert_with(Default::default);
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
            let ip: Ipv4Addr = a
                .parse()
                .with_context(|| format!("service {name}: {a} is not an IPv4 address"))?;
            check_lab_addr(ip).with_context(|| format!("service {name}"))?;
            self.used_ips.insert(ip);
        }
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
        self.used_ips.insert(ip);
        status.pod_ip = Some(ip.to_string());
        status.pod_ips = Some(vec![PodIP { ip: ip.to_string() }]);
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

/// A Node object: labels `kubernetes.io/hostname` (and
/// `topology.kubernetes.io/zone` if `zone` is given), `spec.podCIDR`, and the
/// InternalIP and Hostname addresses.
pub fn node_object(name: &str, ip: Ipv4Addr, pod_cidr: &str, zone: Option<&str>) -> Object {
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
            pod_cidrs: Some(vec![pod_cidr.to_string()]),
            ..Default::default()
        }),
        status: Some(NodeStatus {
            addresses: Some(vec![
                NodeAddress {
                    type_: "InternalIP".to_string(),
                    address: ip.to_string(),
                },
                NodeAddress {
                    type_: "Hostname".to_string(),
                    address: name.to_string(),
                },
            ]),
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
}

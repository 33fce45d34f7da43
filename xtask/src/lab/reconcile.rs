//! The lab's manifests: making a new set of objects the lab's (pods'
//! namespaces and servers, cluster.yaml for the agents, lab.json's
//! frontends), and the public ways to change them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use anyhow::{anyhow, bail, Result};

use super::info::{split_name, write_atomic};
use super::wait::count_markers;
use super::{Frontend, Lab, PodInfo, PortInfo, NODE_NAME, SCTP_LISTENER_ANNOTATION};
use crate::manifests::pod_ports;
use crate::manifests::{self, Object};

/// The frontends of the Services of `objects`: every ClusterIP (of either
/// family), externalIP and load-balancer IP at every port, and the NodePort
/// at every node address (`node_ips`, both families) of a family the
/// Service has a ClusterIP of (IPv4 when it has none), as kube-proxy's
/// proxier of each family serves only the Services of its family.
fn frontends_of(objects: &[Object], node_ips: &[IpAddr]) -> Vec<Frontend> {
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
        let parse = |s: &str| s.parse::<IpAddr>().ok();
        let mut addrs: Vec<(IpAddr, &str)> = Vec::new();
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
        let has_v6 = addrs.iter().any(|(a, _)| a.is_ipv6());
        let has_v4 = addrs.iter().any(|(a, _)| a.is_ipv4()) || !has_v6;
        let node_port_ips: Vec<IpAddr> = node_ips
            .iter()
            .copied()
            .filter(|ip| if ip.is_ipv6() { has_v6 } else { has_v4 })
            .collect();
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
                for ip in &node_port_ips {
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

/// The addresses (of both families) an object was allocated: its pod IPs
/// or ClusterIPs.
fn object_ips(o: &Object) -> Vec<IpAddr> {
    let mut v = Vec::new();
    match o {
        Object::Pod(p) => {
            if let Some(s) = p.status.as_ref() {
                v.extend(s.pod_ip.as_deref().and_then(|a| a.parse::<IpAddr>().ok()));
                v.extend(
                    s.pod_ips
                        .iter()
                        .flatten()
                        .filter_map(|a| a.ip.parse::<IpAddr>().ok()),
                );
            }
        }
        Object::Service(s) => {
            if let Some(spec) = &s.spec {
                v.extend(
                    spec.cluster_ips
                        .iter()
                        .flatten()
                        .filter_map(|a| a.parse::<IpAddr>().ok()),
                );
                v.extend(
                    spec.cluster_ip
                        .iter()
                        .filter_map(|a| a.parse::<IpAddr>().ok()),
                );
            }
        }
        _ => {}
    }
    v.sort();
    v.dedup();
    v
}

/// The first IPv6 address of a Pod's `podIPs`.
fn pod_ip6(pod: &k8s_openapi::api::core::v1::Pod) -> Option<Ipv6Addr> {
    pod.status
        .as_ref()
        .and_then(|s| s.pod_ips.as_ref())
        .into_iter()
        .flatten()
        .find_map(|p| p.ip.parse::<Ipv6Addr>().ok())
}

impl Lab {
    pub(super) fn write_manifests(&mut self) -> Result<()> {
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
    pub(super) fn reconcile(&mut self, new: Vec<Object>) -> Result<()> {
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
                let no_sctp_listener = pod
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(SCTP_LISTENER_ANNOTATION))
                    .is_some_and(|v| v == "false");
                let info = PodInfo {
                    name: key.1.clone(),
                    namespace: key.0.clone(),
                    node,
                    netns: String::new(),
                    ip,
                    ip6: pod_ip6(pod),
                    host_if: String::new(),
                    ports,
                    no_sctp_listener,
                };
                Ok((key, info, host_network))
            })
            .collect::<Result<_>>()?;

        // Each new pod is a namespace, a veth and a server: thousands take
        // minutes, so say how far it got.
        let to_start = new_pods
            .iter()
            .filter(|(key, _, host_network)| !host_network && !old_pods.contains_key(key))
            .count();
        let mut started = crate::progress::Counter::new(
            format!("lab {}: pods started", self.info.id),
            to_start,
            100,
            std::time::Duration::from_secs(5),
        );
        for (key, mut pod, host_network) in new_pods {
            match old_pods.get(&key) {
                Some(old) if old.ip == pod.ip => {
                    let changed =
                        old.ports != pod.ports || old.no_sctp_listener != pod.no_sctp_listener;
                    if changed && !old.host_if.is_empty() {
                        self.stop_server(&key.0, &key.1)?;
                        let i = self
                            .info
                            .pods
                            .iter()
                            .position(|p| p == old)
                            .expect("pod listed");
                        self.info.pods[i].ports = pod.ports.clone();
                        self.info.pods[i].no_sctp_listener = pod.no_sctp_listener;
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
                    pod.host_if = self.create_endpoint(idx, &ns, pod.ip, pod.ip6)?;
                    pod.netns = ns;
                    self.info.pods.push(pod.clone());
                    self.save()?;
                    self.spawn_server(&pod)?;
                    started.tick();
                }
            }
        }

        // Addresses of objects that disappear are freed after the new ones
        // were allocated, so they are not reused in the same change.
        let kept: HashSet<_> = new.iter().map(Object::key).collect();
        let gone: Vec<IpAddr> = self
            .objects
            .iter()
            .filter(|o| !kept.contains(&o.key()))
            .flat_map(object_ips)
            .collect();
        drop(kept);
        // With a real control plane, the objects go to the API server (which
        // allocates the Services' addresses, read back into `new`).
        let mut new = new;
        let gracefully_deleted = if self.api.is_some() {
            self.push_to_api(&mut new)?
        } else {
            Vec::new()
        };
        self.objects = new;
        let node_ips: Vec<IpAddr> = self
            .info
            .nodes
            .iter()
            .flat_map(|n| std::iter::once(IpAddr::V4(n.ip)).chain(n.ip6.map(IpAddr::V6)))
            .collect();
        self.info.frontends = frontends_of(&self.objects, &node_ips);
        self.write_manifests()?;
        self.save()?;
        if self.api.is_some() {
            self.wait_slices_settled()?;
            self.write_barrier()?;
        }

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
            // The kubelet confirms the deletions once the containers stopped:
            // the endpoints go from terminating to gone.
            if self.api.is_some() {
                self.confirm_pod_deletions(&gracefully_deleted)?;
                self.wait_slices_settled()?;
                self.write_barrier()?;
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
        // Positions by key: a lab of 100,000 objects is applied to in one
        // pass, not one scan per object.
        let mut pos_of: HashMap<_, usize> =
            new.iter().enumerate().map(|(i, o)| (o.key(), i)).collect();
        for mut o in incoming {
            let key = o.key();
            let pos = pos_of.get(&key).copied();
            self.alloc.complete(&mut o, pos.map(|i| &new[i]))?;
            match pos {
                Some(i) => new[i] = o,
                None => {
                    pos_of.insert(key, new.len());
                    new.push(o);
                }
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
        let current: HashMap<_, &Object> = self.objects.iter().map(|o| (o.key(), o)).collect();
        for o in &mut incoming {
            let prev = current.get(&o.key()).copied();
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
}

//! The pipeline: a [`Snapshot`] to the [`DesiredState`] of one node,
//! Service by Service and port by port, with the steps of the sibling
//! modules.
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proxy_common::{svc_flags, SCOPE_EXTERNAL, SCOPE_INTERNAL};

use super::addresses::{external_addresses, node_internal_ips, node_port_addresses};
use super::endpoints::{local_endpoint_addresses, port_endpoints};
use super::frontends::{frontend_key, insert_frontend, with_backends};
use super::health_checks::claim_health_check;
use super::lb::{service_algorithms, LbAlgorithm};
use super::policy::{forbidden_address, in_cidr, ClaimRank};
use super::services::{ignored, name, namespace, parse_proto, service_id};
use super::{
    categorize, endpoint_slices_from_pods, DesiredState, Frontend, FrontendKey, ModelOptions,
    ModelWarning, NodeTopology, ServicePortInfo, TrafficPolicy, DEFAULT_AFFINITY_TIMEOUT_S,
    LABEL_SERVICE_NAME,
};
use crate::manifests::Snapshot;

/// The desired state for `node_name`, with default options.
pub fn desired_state(snapshot: &Snapshot, node_name: &str) -> (DesiredState, Vec<ModelWarning>) {
    desired_state_with(snapshot, node_name, &ModelOptions::default())
}

/// The desired state for `node_name`.
///
/// Services are taken in `namespace/name` order and, within a Service, port by
/// port: its ClusterIP frontends, then its north-south ones. When two
/// Services claim the same frontend, a ClusterIP wins over an externalIP or
/// load-balancer IP, then the older Service (`creationTimestamp`, then
/// `namespace/name`), and a warning names the other; within one Service the
/// first claim wins silently (kube-proxy's rule order: clusterIP,
/// externalIPs, then load-balancer IPs). Addresses that can never be
/// frontends ([`forbidden_address`]), externalIPs the
/// [`super::FrontendPolicy`] refuses and this node's own addresses as
/// externalIP or load-balancer IP (unless allowed) are refused with a
/// warning naming the Service, as are a Service's frontends beyond
/// `max_frontends_per_service`.
pub fn desired_state_with(
    snapshot: &Snapshot,
    node_name: &str,
    opts: &ModelOptions,
) -> (DesiredState, Vec<ModelWarning>) {
    let mut warnings = Vec::new();
    let mut desired = DesiredState::default();
    let node = NodeTopology::from_snapshot(snapshot, node_name);

    // A Pod address that is no IP at all would be skipped silently below.
    for pod in &snapshot.pods {
        let Some(status) = pod.status.as_ref() else {
            continue;
        };
        let ips = status
            .pod_ip
            .iter()
            .chain(status.pod_ips.iter().flatten().map(|p| &p.ip));
        for ip in ips.filter(|ip| !ip.is_empty() && ip.parse::<std::net::IpAddr>().is_err()) {
            warnings.push(ModelWarning {
                object: format!("Pod {}/{}", namespace(&pod.metadata), name(&pod.metadata)),
                message: format!("invalid pod IP {ip:?}; the pod is not an endpoint"),
            });
        }
    }

    // This node's addresses: the SNAT source and the NodePort addresses.
    let node_object = snapshot
        .nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(node_name));
    let internal_ips = node_object.map(node_internal_ips).unwrap_or_default();
    desired.node_addr = internal_ips.first().copied();
    let node_port_addrs = node_port_addresses(&internal_ips, &opts.node_port_addresses);
    // Every IPv4 address of the Node object: refused as externalIP or
    // load-balancer IP unless the policy allows it.
    let own_addrs: BTreeSet<Ipv4Addr> = node_object
        .and_then(|n| n.status.as_ref())
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|a| super::addresses::parse_ipv4(&a.address))
        .collect();
    let policy = &opts.frontend_policy;
    // Who holds each claimed frontend (see `insert_frontend`).
    let mut ranks = super::frontends::Owners::new();
    // Why no NodePort can be served; reported once, when some port has one.
    let mut node_problem = match node_object {
        None => Some("no Node object for this node"),
        Some(_) if internal_ips.is_empty() => Some("the Node has no IPv4 InternalIP address"),
        Some(_) => None,
    };

    // Every slice, real and synthesized, indexed by (namespace, service name),
    // sorted by slice name so that duplicates resolve deterministically.
    let synthesized = endpoint_slices_from_pods(snapshot);
    let all_slices = || {
        snapshot
            .endpoint_slices
            .iter()
            .chain(synthesized.iter())
            // An IPv4 proxier ignores slices of the other family (and FQDN ones).
            .filter(|s| s.address_type == "IPv4")
    };
    desired.local_endpoints = local_endpoint_addresses(all_slices(), node_name);
    let mut slices: BTreeMap<(&str, &str), Vec<&EndpointSlice>> = BTreeMap::new();
    for slice in all_slices() {
        let Some(svc) = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_SERVICE_NAME))
        else {
            continue;
        };
        slices
            .entry((namespace(&slice.metadata), svc.as_str()))
            .or_default()
            .push(slice);
    }
    for list in slices.values_mut() {
        list.sort_by(|a, b| name(&a.metadata).cmp(name(&b.metadata)));
    }

    let mut services: Vec<&Service> = snapshot.services.iter().collect();
    services.sort_by(|a, b| {
        (namespace(&a.metadata), name(&a.metadata))
            .cmp(&(namespace(&b.metadata), name(&b.metadata)))
    });
    // Invalid addresses are reported once per slice and address.
    let mut reported: BTreeSet<(String, String)> = BTreeSet::new();

    for svc in services {
        if let Some(why) = ignored(svc, opts) {
            tracing::trace!(service = %service_id(svc), why, "model: service ignored");
            continue;
        }
        let id = service_id(svc);
        let object = format!("Service {id}");
        let Some(spec) = &svc.spec else { continue };

        let ip_strings: Vec<&str> = match &spec.cluster_ips {
            Some(ips) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
            _ => spec.cluster_ip.as_deref().into_iter().collect(),
        };
        let mut cluster_ips = Vec::new();
        let mut bad_ip = None;
        for s in ip_strings {
            match s.parse::<IpAddr>() {
                Ok(IpAddr::V4(ip)) => cluster_ips.push(ip),
                Ok(IpAddr::V6(_)) => {}
                Err(_) => bad_ip = Some(s),
            }
        }
        if let Some(s) = bad_ip {
            warnings.push(ModelWarning {
                object,
                message: format!("invalid clusterIP {s:?}; service skipped"),
            });
            continue;
        }
        cluster_ips.retain(|ip| match forbidden_address(*ip) {
            Some(why) => {
                warnings.push(ModelWarning {
                    object: object.clone(),
                    message: format!("clusterIP {ip} is {why}; never a frontend, refused"),
                });
                false
            }
            None => true,
        });
        if cluster_ips.is_empty() {
            continue;
        }
        let created = svc.metadata.creation_timestamp.as_ref().map(|t| t.0);

        let affinity_timeout_s = if spec.session_affinity.as_deref() == Some("ClientIP") {
            spec.session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .and_then(|t| u32::try_from(t).ok())
                .unwrap_or(DEFAULT_AFFINITY_TIMEOUT_S)
        } else {
            0
        };
        let mut external = external_addresses(svc, &object, &mut warnings);
        if !policy.honour_external_ips && !external.external_ips.is_empty() {
            warnings.push(ModelWarning {
                object: object.clone(),
                message: "externalIPs are not honoured on this node \
                          (frontendPolicy.honourExternalIPs: false); ignored"
                    .into(),
            });
            external.external_ips.clear();
        }
        let refuse = |what: &str, ip: &Ipv4Addr, warnings: &mut Vec<ModelWarning>| {
            let why = if let Some(why) = forbidden_address(*ip) {
                format!("is {why}; never a frontend")
            } else if own_addrs.contains(ip) && !policy.allow_node_addresses {
                "is this node's own address (frontendPolicy.allowNodeAddresses: false)".into()
            } else if what == "externalIP"
                && (policy.external_ip_deny.iter().any(|c| in_cidr(*ip, *c))
                    || !(policy.external_ip_allow.is_empty()
                        || policy.external_ip_allow.iter().any(|c| in_cidr(*ip, *c))))
            {
                "is refused by frontendPolicy.externalIPAllowCIDRs / externalIPDenyCIDRs".into()
            } else {
                return false;
            };
            warnings.push(ModelWarning {
                object: object.clone(),
                message: format!("{what} {ip} {why}; refused"),
            });
            true
        };
        external
            .external_ips
            .retain(|ip| !refuse("externalIP", ip, &mut warnings));
        external
            .lb_ips
            .retain(|ip| !refuse("load-balancer IP", ip, &mut warnings));
        // Distinct frontends this Service claimed, and those refused beyond
        // the per-Service limit.
        let mut claimed: BTreeSet<FrontendKey> = BTreeSet::new();
        let mut over_limit = 0usize;
        let external_policy = TrafficPolicy::parse(spec.external_traffic_policy.as_deref());
        let (alg_internal, alg_external) =
            service_algorithms(svc, &object, opts.lb_algorithm, &mut warnings);
        // Local READY endpoints' addresses over all ports, for the health check.
        let mut local_ready: BTreeSet<Ipv4Addr> = BTreeSet::new();

        let svc_slices = slices
            .get(&(namespace(&svc.metadata), name(&svc.metadata)))
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        for port in spec.ports.iter().flatten() {
            let port_name = port.name.clone().unwrap_or_default();
            let proto = match parse_proto(port.protocol.as_deref()) {
                Ok(p) => p,
                Err(e) => {
                    warnings.push(ModelWarning {
                        object: object.clone(),
                        message: format!("port {:?} ({}): {e}; port skipped", port_name, port.port),
                    });
                    continue;
                }
            };
            let svc_port = match u16::try_from(port.port) {
                Ok(p) if p != 0 => p,
                _ => {
                    warnings.push(ModelWarning {
                        object: object.clone(),
                        message: format!(
                            "port {:?}: invalid port number {}; port skipped",
                            port_name, port.port
                        ),
                    });
                    continue;
                }
            };

            let endpoints = port_endpoints(
                port,
                proto,
                svc_slices,
                node_name,
                &mut warnings,
                &mut reported,
            );
            local_ready.extend(
                endpoints
                    .iter()
                    .filter(|e| e.ready && e.is_local(node_name))
                    .map(|e| e.addr.addr),
            );
            let info = ServicePortInfo::from_service(svc, port);
            let categorized = categorize(&info, &endpoints, &node, &opts.gates);
            let base = Frontend {
                service: id.clone(),
                port_name: port_name.clone(),
                affinity_timeout_s,
                ..Frontend::default()
            };
            // The port's nodePort, if any (0 = none).
            let node_port = port
                .node_port
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0);
            if let (Some(p), Some(why)) = (node_port, node_problem.take()) {
                warnings.push(ModelWarning {
                    object: format!("Node {node_name}"),
                    message: format!(
                        "{why}: no NodePort frontends on this node (first: {id} port {p})"
                    ),
                });
            }
            let mut claim = |key: FrontendKey, fe: Frontend, cluster_ip: bool| {
                if !claimed.contains(&key) {
                    if claimed.len() >= policy.max_frontends_per_service {
                        over_limit += 1;
                        return;
                    }
                    claimed.insert(key);
                }
                let rank = ClaimRank {
                    cluster_ip,
                    created,
                    current_owner: opts.current_owners.get(&key) == Some(&id),
                    service: id.clone(),
                };
                insert_frontend(
                    &mut desired.frontends,
                    &mut ranks,
                    &mut warnings,
                    key,
                    fe,
                    rank,
                );
            };

            // ClusterIP: internalTrafficPolicy.
            let internal_list = match info.internal_traffic_policy {
                TrafficPolicy::Cluster => &categorized.cluster,
                TrafficPolicy::Local => &categorized.local,
            };
            let mut internal = with_backends(&base, internal_list, &categorized, &endpoints);
            internal.flags |= alg_internal.flags();
            for ip in &cluster_ips {
                claim(
                    frontend_key(*ip, svc_port, proto, SCOPE_INTERNAL),
                    internal.clone(),
                    true,
                );
            }

            // North-south: (address, port, what it is).
            let targets: Vec<(Ipv4Addr, u16, NorthSouth)> = node_port
                .into_iter()
                .flat_map(|p| {
                    node_port_addrs
                        .iter()
                        .map(move |a| (*a, p, NorthSouth::NodePort))
                })
                .chain(
                    external
                        .external_ips
                        .iter()
                        .map(|a| (*a, svc_port, NorthSouth::ExternalIp)),
                )
                .chain(
                    external
                        .lb_ips
                        .iter()
                        .map(|a| (*a, svc_port, NorthSouth::LoadBalancer)),
                )
                .collect();
            if targets.is_empty() {
                continue;
            }
            // From outside: externalTrafficPolicy (`Local` only matters on an
            // externally accessible port, which this one is).
            let external_list = match external_policy {
                TrafficPolicy::Cluster => &categorized.cluster,
                TrafficPolicy::Local => &categorized.local,
            };
            let mut outside = with_backends(&base, external_list, &categorized, &endpoints);
            outside.flags |= alg_external.flags();
            if external_policy == TrafficPolicy::Local {
                outside.flags |= svc_flags::EXTERNAL_LOCAL;
            }
            // From this node's pods: short-circuited to the cluster list
            // (kube-proxy's external-traffic chain sends traffic that starts
            // inside the cluster to the cluster endpoints whatever the
            // externalTrafficPolicy: E4, S42); a load-balancer IP's source
            // ranges apply here too (below).
            let mut short_circuit =
                with_backends(&base, &categorized.cluster, &categorized, &endpoints);
            short_circuit.flags |= alg_internal.flags();
            for (addr, port, kind) in targets {
                let mut fe = outside.clone();
                // Maglev handoff: addresses every node serves alike (a
                // router may move their flows between nodes; a NodePort is
                // one node's own address), with the client's address kept
                // end to end (Cluster policy would SNAT it otherwise).
                if alg_external == LbAlgorithm::Maglev
                    && kind != NorthSouth::NodePort
                    && external_policy == TrafficPolicy::Cluster
                {
                    fe.flags |= svc_flags::HANDOFF;
                }
                let mut inside = short_circuit.clone();
                // kube-proxy's firewall chain filters every source of a
                // load-balancer IP: pods and the node's own clients too.
                if kind == NorthSouth::LoadBalancer && !external.source_ranges.is_empty() {
                    for f in [&mut fe, &mut inside] {
                        f.flags |= svc_flags::SOURCE_RANGES;
                        f.source_ranges = external.source_ranges.clone();
                    }
                }
                claim(frontend_key(addr, port, proto, SCOPE_EXTERNAL), fe, false);
                claim(
                    frontend_key(addr, port, proto, SCOPE_INTERNAL),
                    inside,
                    false,
                );
            }
            // Localhost NodePorts (L1, L2): the node's own clients only.
            if let (Some(p), true) = (node_port, opts.localhost_node_ports) {
                claim(
                    frontend_key(Ipv4Addr::LOCALHOST, p, proto, SCOPE_INTERNAL),
                    short_circuit.clone(),
                    false,
                );
            }
        }
        if over_limit > 0 {
            warnings.push(ModelWarning {
                object: object.clone(),
                message: format!(
                    "{over_limit} frontends beyond frontendPolicy.maxFrontendsPerService ({}) refused",
                    policy.max_frontends_per_service
                ),
            });
        }

        claim_health_check(
            &mut desired.health_checks,
            &mut warnings,
            &object,
            &id,
            spec,
            external_policy,
            &local_ready,
        );
    }
    (desired, warnings)
}

/// What a north-south frontend address is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum NorthSouth {
    NodePort,
    ExternalIp,
    LoadBalancer,
}

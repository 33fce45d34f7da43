//! The pipeline's per-Service step: one Service, its EndpointSlices and this
//! node's context to what the Service asks for (its frontend claims, its
//! `healthCheckNodePort`, its warnings), with the steps of the sibling
//! modules. Which Service gets a contested frontend or health-check port is
//! decided over all Services by [`super::incremental`].
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::core::v1::Node;
use proxy_common::{svc_flags, SCOPE_EXTERNAL, SCOPE_INTERNAL};

use super::addresses::{external_addresses, in_cidr, node_internal_ips, node_port_addresses};
use super::endpoints::port_endpoints;
use super::frontends::{frontend_key, with_backends, Owned};
use super::health_checks::needs_health_check;
use super::lb::{service_algorithms, LbAlgorithm};
use super::policy::forbidden_address;
use super::services::parse_proto;
use super::{
    categorize, proto_name, DesiredState, Frontend, FrontendKey, IpFamily, ModelOptions,
    ModelWarning, NodeTopology, ServicePortInfo, TrafficPolicy, DEFAULT_AFFINITY_TIMEOUT_S,
    LABEL_TOPOLOGY_ZONE,
};
use crate::objects::compact::{CompactService, CompactServiceSpec, CompactSlice};
use crate::objects::Snapshot;
use crate::vec_set::VecMap;

/// The desired state for `node_name`, with default options.
pub fn desired_state(snapshot: &Snapshot, node_name: &str) -> (DesiredState, Vec<ModelWarning>) {
    desired_state_with(snapshot, node_name, &ModelOptions::default())
}

/// The desired state for `node_name`, computed from scratch: every Service
/// of `snapshot` through [`super::Incremental`], with every warning.
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
    let mut model = super::Incremental::new(node_name, opts.clone());
    model.replace(snapshot.clone());
    (model.desired().clone(), model.warnings())
}

/// What the per-Service step needs to know of this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct NodeContext {
    pub(super) name: String,
    /// Its `topology.kubernetes.io/zone` label (empty: none).
    pub(super) zone: Option<String>,
    /// Its first IPv4 InternalIP: the SNAT source.
    pub(super) node_addr: Option<Ipv4Addr>,
    /// Its first IPv6 InternalIP: the IPv6 SNAT source.
    pub(super) node_addr6: Option<Ipv6Addr>,
    /// The addresses its NodePorts are served on, per family
    /// ([`IpFamily::index`]).
    pub(super) node_port_addrs: [Vec<IpAddr>; 2],
    /// Every address of the Node object and of the node's external
    /// interfaces (the NodePort candidates and more): refused as externalIP
    /// unless the policy allows it.
    pub(super) own_addrs: BTreeSet<IpAddr>,
    /// Every address of the Node object: refused as load-balancer IP unless
    /// the policy allows it. An address only on an interface is not: a
    /// load-balancer controller that announces its IPs from the node
    /// (kube-vip's ARP mode, keepalived) puts them there itself.
    pub(super) node_object_addrs: BTreeSet<IpAddr>,
    /// Why no NodePort of a family can be served, if so, per family.
    pub(super) problems: [Option<&'static str>; 2],
    /// Whether there is no Node object at all (one reason for both
    /// families).
    pub(super) no_node: bool,
}

impl NodeContext {
    /// The context of node `name` from its Node object and `iface_addrs`,
    /// the usable addresses on its external interfaces now (sorted).
    pub(super) fn new(
        name: &str,
        node: Option<&Node>,
        iface_addrs: &[IpAddr],
        opts: &ModelOptions,
    ) -> Self {
        let internal_ips = node.map(node_internal_ips).unwrap_or_default();
        let node_object_addrs: BTreeSet<IpAddr> = node
            .and_then(|n| n.status.as_ref())
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|a| super::addresses::parse_ip(&a.address))
            .collect();
        let own_addrs = node_object_addrs
            .iter()
            .chain(iface_addrs)
            .copied()
            .collect();
        let problems = IpFamily::ALL.map(|f| match node {
            None => Some("no Node object for this node"),
            Some(_) if internal_ips[f.index()].is_empty() => Some(match f {
                IpFamily::V4 => "the Node has no IPv4 InternalIP address",
                IpFamily::V6 => "the Node has no IPv6 InternalIP address",
            }),
            Some(_) => None,
        });
        Self {
            name: name.to_string(),
            zone: node
                .and_then(|n| n.metadata.labels.as_ref())
                .and_then(|l| l.get(LABEL_TOPOLOGY_ZONE))
                .filter(|z| !z.is_empty())
                .cloned(),
            node_addr: internal_ips[0].iter().find_map(|a| match a {
                IpAddr::V4(a) => Some(*a),
                IpAddr::V6(_) => None,
            }),
            node_addr6: internal_ips[1].iter().find_map(|a| match a {
                IpAddr::V6(a) => Some(*a),
                IpAddr::V4(_) => None,
            }),
            node_port_addrs: IpFamily::ALL.map(|f| {
                node_port_addresses(
                    f,
                    &internal_ips[f.index()],
                    iface_addrs,
                    &opts.node_port_addresses,
                )
            }),
            own_addrs,
            node_object_addrs,
            problems,
            no_node: node.is_none(),
        }
    }
}

/// One Service's claims on one address, port and protocol (see
/// [`super::incremental`] for who gets it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct OwnedClaims {
    /// Whether its first claim there was a ClusterIP's: that claim's rank.
    pub(super) cluster_ip: bool,
    /// The key of its first claim there.
    pub(super) first_key: FrontendKey,
    /// Every frontend it claims there, in claim order, keys distinct; none
    /// while the claim owns the address: its frontends are then the desired
    /// state's, moved there (one copy, not two), and `installed` holds their
    /// scopes (bit `1 << scope`) to take them back when it loses the address.
    pub(super) frontends: Vec<(FrontendKey, Frontend)>,
    pub(super) installed: u8,
}

/// What one Service asks for, from itself, its slices and the node alone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct ServiceOutput {
    /// Its claims, by what is owned.
    pub(super) claims: VecMap<Owned, OwnedClaims>,
    pub(super) warnings: Box<[ModelWarning]>,
    /// The `healthCheckNodePort` it needs, with its number of local ready
    /// endpoint addresses.
    pub(super) health_check: Option<(u16, u32)>,
    /// Its first port's nodePort, if any, per family it has
    /// ([`IpFamily::index`]): named when the node cannot serve NodePorts of
    /// that family.
    pub(super) first_node_port: [Option<u16>; 2],
}

/// The Service's ClusterIPs, one per family it has, primary first:
/// `clusterIPs` when set, else `clusterIP`; the first of each family. For
/// what the API server accepts this is what kube-proxy's proxier of each
/// family takes (`proxyutil.GetClusterIPByFamily`, which pairs
/// `ipFamilies[i]` with `clusterIPs[i]`, or without `ipFamilies` takes
/// `clusterIP` alone); where they differ, on input the API server would
/// refuse, this rule serves every family listed. With what the API server would
/// have refused reported (a manifests source has no API server): a
/// `clusterIP` other than `clusterIPs[0]`, two addresses of one family,
/// `ipFamilies` that do not match, two families under `ipFamilyPolicy:
/// SingleStack` (the secondary is not served) and one under
/// `RequireDualStack`. `Err` with the primary address when it is invalid:
/// the Service is skipped; an invalid secondary is warned about and skipped
/// alone.
fn cluster_ips<'a>(
    spec: &'a CompactServiceSpec,
    warn: &mut impl FnMut(String),
) -> Result<Vec<IpAddr>, &'a str> {
    let ips = &spec.cluster_ips;
    let ip_strings: Vec<&str> = if ips.is_empty() {
        spec.cluster_ip.as_deref().into_iter().collect()
    } else {
        if let Some(primary) = spec.cluster_ip.as_deref().filter(|s| !s.is_empty()) {
            if *primary != *ips[0] {
                warn(format!(
                    "clusterIP {primary:?} is not clusterIPs[0] {:?}; clusterIPs used",
                    ips[0]
                ));
            }
        }
        ips.iter().map(|s| &**s).collect()
    };
    let mut out: Vec<IpAddr> = Vec::new();
    for (i, s) in ip_strings.into_iter().enumerate() {
        let Some(ip) = super::addresses::parse_ip(s) else {
            if i == 0 {
                return Err(s);
            }
            // The primary stands: its family is served.
            warn(format!(
                "invalid clusterIPs[{i}] {s:?}; only that address is skipped"
            ));
            continue;
        };
        if out.iter().any(|o| IpFamily::of(*o) == IpFamily::of(ip)) {
            warn(format!(
                "clusterIPs has a second {} address {ip}; only the first of each family is served",
                IpFamily::of(ip)
            ));
            continue;
        }
        out.push(ip);
    }
    let families: Vec<&str> = out.iter().map(|ip| IpFamily::of(*ip).name()).collect();
    let listed: Vec<&str> = spec.ip_families.iter().map(|f| &**f).collect();
    if !listed.is_empty() && listed != families {
        warn(format!(
                "ipFamilies {listed:?} do not match the clusterIPs' families {families:?}; the first clusterIP of each family is served (kube-proxy would pair ipFamilies[i] with clusterIPs[i])"
            ));
    }
    match spec.ip_family_policy.as_deref() {
        Some("SingleStack") if out.len() > 1 => {
            warn(format!(
                "ipFamilyPolicy SingleStack with clusterIPs of two families; only the primary ({}) is served",
                out[0]
            ));
            out.truncate(1);
        }
        Some("RequireDualStack") if out.len() == 1 => {
            warn(format!(
                "ipFamilyPolicy RequireDualStack with one clusterIP; served on {} only",
                IpFamily::of(out[0])
            ));
        }
        _ => {}
    }
    Ok(out)
}

/// The per-Service step: `svc` (not ignored) with `svc_slices`, its IPv4
/// and IPv6 EndpointSlices (real ones and those synthesized from Pods)
/// sorted by name. Each family the Service has a ClusterIP of is served as
/// kube-proxy's proxier of that family serves it: its frontends get only
/// that family's endpoints, node addresses, externalIPs, load-balancer IPs
/// and source ranges.
pub(super) fn service_output(
    svc: &CompactService,
    svc_slices: &[&CompactSlice],
    ctx: &NodeContext,
    opts: &ModelOptions,
) -> ServiceOutput {
    let mut out = ServiceOutput::default();
    let mut warnings = Vec::new();
    let policy = &opts.frontend_policy;
    let node = NodeTopology {
        name: &ctx.name,
        zone: ctx.zone.as_deref(),
    };
    // Invalid addresses are reported once per slice and address.
    let mut reported: BTreeSet<(String, String)> = BTreeSet::new();
    let id = svc.id();
    let service: std::sync::Arc<str> = id.as_str().into();
    let object = format!("Service {id}");
    let Some(spec) = &svc.spec else { return out };

    let mut warn = |message: String| {
        warnings.push(ModelWarning {
            object: object.clone(),
            message,
        })
    };
    let mut cluster_ips = match cluster_ips(spec, &mut warn) {
        Ok(ips) => ips,
        Err(s) => {
            warn(format!("invalid clusterIP {s:?}; service skipped"));
            out.warnings = warnings.into();
            return out;
        }
    };
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
        out.warnings = warnings.into();
        return out;
    }
    let families: Vec<IpFamily> = cluster_ips.iter().map(|ip| IpFamily::of(*ip)).collect();

    let affinity_timeout_s = if spec.session_affinity.as_deref() == Some("ClientIP") {
        spec.affinity_timeout_seconds
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
    // An address of a family the Service has no ClusterIP of is not seen by
    // kube-proxy (its proxier of that family skips the Service).
    let no_family = |what: &str, ip: &IpAddr, warnings: &mut Vec<ModelWarning>| {
        let family = IpFamily::of(*ip);
        if families.contains(&family) {
            return false;
        }
        warnings.push(ModelWarning {
            object: object.clone(),
            message: format!(
                "{what} {ip} is {family} but the Service has no {family} clusterIP; ignored, as kube-proxy does"
            ),
        });
        true
    };
    let refuse = |what: &str, ip: &IpAddr, warnings: &mut Vec<ModelWarning>| {
        let why = if let Some(why) = forbidden_address(*ip) {
            format!("is {why}; never a frontend")
        } else if !policy.allow_node_addresses
            && if what == "externalIP" {
                ctx.own_addrs.contains(ip)
            } else {
                ctx.node_object_addrs.contains(ip)
            }
        {
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
        .retain(|ip| !no_family("externalIP", ip, &mut warnings));
    external
        .lb_ips
        .retain(|ip| !no_family("load-balancer IP", ip, &mut warnings));
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
    // Local READY endpoints' addresses over all ports, for the health
    // check: those of the primary family (kube-proxy's health server of
    // that family reports its own family's endpoints).
    let mut local_ready: BTreeSet<IpAddr> = BTreeSet::new();

    for port in spec.ports.iter() {
        let port_name_shared = port.name.clone().unwrap_or_default();
        let port_name = port_name_shared.to_string();
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
        // The port's nodePort, if any (0 = none). One outside 1-65535 is
        // refused, and a NodePort (or LoadBalancer that allocates them)
        // Service's port without one is reported: the API server would
        // have allocated one, the manifests source does not.
        let node_port = match port.node_port.unwrap_or(0) {
            0 => {
                let type_ = spec.type_.as_deref().unwrap_or("ClusterIP");
                let required = type_ == "NodePort"
                    || (type_ == "LoadBalancer"
                        && spec.allocate_load_balancer_node_ports != Some(false));
                if required {
                    warnings.push(ModelWarning {
                        object: object.clone(),
                        message: format!(
                            "port {port_name:?} ({svc_port}/{}): type {type_} but no nodePort; no NodePort frontends for this port",
                            proto_name(proto)
                        ),
                    });
                }
                None
            }
            p => match u16::try_from(p) {
                Ok(p) => Some(p),
                Err(_) => {
                    warnings.push(ModelWarning {
                        object: object.clone(),
                        message: format!(
                            "port {port_name:?} ({svc_port}/{}): invalid nodePort {p} (not in 1-65535); no NodePort frontends for this port",
                            proto_name(proto)
                        ),
                    });
                    None
                }
            },
        };
        if let Some(p) = node_port {
            for f in &families {
                out.first_node_port[f.index()].get_or_insert(p);
            }
        }
        // Within the Service, the first claim of a key wins, silently.
        let claims = &mut out.claims;
        let mut claim = |key: FrontendKey, fe: Frontend, cluster_ip: bool| {
            if claimed.contains(&key) {
                return;
            }
            if claimed.len() >= policy.max_frontends_per_service {
                over_limit += 1;
                return;
            }
            claimed.insert(key);
            claims
                .get_or_insert_with((key.addr, key.port, key.proto), || OwnedClaims {
                    cluster_ip,
                    first_key: key,
                    frontends: Vec::new(),
                    installed: 0,
                })
                .frontends
                .push((key, fe));
        };

        // Each family as its own proxier serves it, the primary first.
        for (cluster_ip, family) in cluster_ips.iter().zip(families.iter().copied()) {
            let endpoints = port_endpoints(
                family,
                port,
                proto,
                svc_slices,
                &ctx.name,
                &mut warnings,
                &mut reported,
            );
            if family == families[0] {
                local_ready.extend(
                    endpoints
                        .iter()
                        .filter(|e| e.ready && e.is_local(&ctx.name))
                        .map(|e| e.addr.addr),
                );
            }
            let info = ServicePortInfo::for_family(svc, port, family);
            let categorized = categorize(&info, &endpoints, &node, &opts.gates);
            let base = Frontend {
                service: service.clone(),
                port_name: port_name_shared.clone(),
                affinity_timeout_s,
                ..Frontend::default()
            };

            // ClusterIP: internalTrafficPolicy.
            let internal_list = match info.internal_traffic_policy {
                TrafficPolicy::Cluster => &categorized.cluster,
                TrafficPolicy::Local => &categorized.local,
            };
            let mut internal = with_backends(&base, internal_list, &categorized, &endpoints);
            internal.flags |= alg_internal.flags() | svc_flags::CLUSTER_IP;
            let cluster_ip_key = frontend_key(*cluster_ip, svc_port, proto, SCOPE_INTERNAL);
            // Whether the ClusterIP chooses as the short circuit below does
            // (not so under `internalTrafficPolicy: Local` with endpoints
            // elsewhere): the host alias of the north-south frontends.
            let same_choice = *internal_list == categorized.cluster;
            claim(cluster_ip_key, internal, true);

            // North-south: (address, port, what it is), of this family.
            let of_family = |a: &&IpAddr| IpFamily::of(**a) == family;
            let targets: Vec<(IpAddr, u16, NorthSouth)> = node_port
                .into_iter()
                .flat_map(|p| {
                    ctx.node_port_addrs[family.index()]
                        .iter()
                        .map(move |a| (*a, p, NorthSouth::NodePort))
                })
                .chain(
                    external
                        .external_ips
                        .iter()
                        .filter(of_family)
                        .map(|a| (*a, svc_port, NorthSouth::ExternalIp)),
                )
                .chain(
                    external
                        .lb_ips
                        .iter()
                        .filter(of_family)
                        .map(|a| (*a, svc_port, NorthSouth::LoadBalancer)),
                )
                .collect();
            // From this node's pods: short-circuited to the cluster list
            // (kube-proxy's external-traffic chain sends traffic that starts
            // inside the cluster to the cluster endpoints whatever the
            // externalTrafficPolicy: E4, S42); a load-balancer IP's source
            // ranges apply here too (below).
            let mut short_circuit =
                with_backends(&base, &categorized.cluster, &categorized, &endpoints);
            short_circuit.flags |= alg_internal.flags();
            // A host client's UDP to these is aimed at the ClusterIP and
            // translated per packet there (issue 42), when the ClusterIP
            // chooses among the same backends.
            if proto == proxy_common::IPPROTO_UDP && same_choice {
                short_circuit.host_alias = Some(cluster_ip_key);
            }
            if !targets.is_empty() {
                // From outside: externalTrafficPolicy (`Local` only matters
                // on an externally accessible port, which this one is).
                let external_list = match external_policy {
                    TrafficPolicy::Cluster => &categorized.cluster,
                    TrafficPolicy::Local => &categorized.local,
                };
                let mut outside = with_backends(&base, external_list, &categorized, &endpoints);
                outside.flags |= alg_external.flags();
                if external_policy == TrafficPolicy::Local {
                    outside.flags |= svc_flags::EXTERNAL_LOCAL;
                }
                let source_ranges = external.source_ranges_of(family);
                for (addr, port, kind) in targets {
                    let mut fe = outside.clone();
                    // Maglev handoff: addresses every node serves alike (a
                    // router may move their flows between nodes; a NodePort
                    // is one node's own address), with the client's address
                    // kept end to end (Cluster policy would SNAT it
                    // otherwise).
                    if alg_external == LbAlgorithm::Maglev
                        && kind != NorthSouth::NodePort
                        && external_policy == TrafficPolicy::Cluster
                    {
                        fe.flags |= svc_flags::HANDOFF;
                    }
                    let mut inside = short_circuit.clone();
                    // kube-proxy's firewall chain filters every source of a
                    // load-balancer IP: pods and the node's own clients too.
                    if kind == NorthSouth::LoadBalancer && !source_ranges.is_empty() {
                        for f in [&mut fe, &mut inside] {
                            f.flags |= svc_flags::SOURCE_RANGES;
                            f.source_ranges = source_ranges.clone();
                        }
                    }
                    claim(frontend_key(addr, port, proto, SCOPE_EXTERNAL), fe, false);
                    claim(
                        frontend_key(addr, port, proto, SCOPE_INTERNAL),
                        inside,
                        false,
                    );
                }
                // Localhost NodePorts (L1, L2): the node's own clients only;
                // IPv4 only, as kube-proxy's `localhostNodePorts`.
                if let (Some(p), true, IpFamily::V4) =
                    (node_port, opts.localhost_node_ports, family)
                {
                    claim(
                        frontend_key(IpAddr::V4(Ipv4Addr::LOCALHOST), p, proto, SCOPE_INTERNAL),
                        short_circuit.clone(),
                        false,
                    );
                }
            }
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

    out.health_check = needs_health_check(spec, external_policy).map(|port| {
        // Beyond 2^32 - 1 local endpoints, that many (a count no node
        // reaches).
        (port, u32::try_from(local_ready.len()).unwrap_or(u32::MAX))
    });
    out.warnings = warnings.into();
    // Kept until the Service changes: no spare room (a first push reserves
    // four frontends, where most addresses have one or two).
    for claims in out.claims.values_mut() {
        claims.frontends.shrink_to_fit();
    }
    out
}

/// What a north-south frontend address is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum NorthSouth {
    NodePort,
    ExternalIp,
    LoadBalancer,
}

//! Typed builders for the objects the lab tests write: Services, Pods and
//! EndpointSlices (in the style of kube-rs controller-rs `fixtures.rs`). Each
//! builder holds the k8s-openapi object itself and renders it (serde) to one
//! YAML document, `---` first, with [`yaml`](Svc::yaml); [`manifests`] joins
//! several. The lab takes them as manifests (`Lab::builder().manifests_yaml`,
//! `Lab::apply`). A field is written only when a test sets it: what a
//! builder does not set, the lab and the agent default as the API server
//! would.
//!
//! ```ignore
//! let yaml = manifests(&[
//!     &Svc::new("web").selector("web").port(Port::tcp("http", 80)),
//!     &Pod::new("web-1", "web").node("node-2").port(80, "TCP"),
//! ]);
//! let slice = Slice::new("web-1", "web")
//!     .port("http", 80, "TCP")
//!     .endpoint(Ep::of(lab, "web-1").terminating_serving())
//!     .yaml();
//! ```

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1::{
    ClientIPConfig, Container, ContainerPort, LoadBalancerIngress, LoadBalancerStatus,
    Pod as PodObject, PodSpec, Service, ServicePort, ServiceSpec, ServiceStatus,
    SessionAffinityConfig,
};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForNode, ForZone,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Serialize;
use xtask::Lab;

/// The label a Service selects its pods by, and every test pod carries.
const APP: &str = "app";
/// The label tying an EndpointSlice to its Service.
const SERVICE_NAME: &str = "kubernetes.io/service-name";

/// An object the lab takes as a manifest.
pub trait Manifest {
    /// The object as one YAML document, `---` first.
    fn yaml(&self) -> String;
}

/// The YAML documents of `objects`, in order: manifests for
/// `Lab::builder().manifests_yaml` or `Lab::apply`.
pub fn manifests(objects: &[&dyn Manifest]) -> String {
    objects.iter().map(|o| o.yaml()).collect()
}

/// `o` as one YAML document, `---` first.
fn document(o: &impl Serialize) -> String {
    format!(
        "---\n{}",
        yaml_serde::to_string(o).expect("a k8s-openapi object renders to YAML")
    )
}

fn meta(name: &str, labels: &[(&str, &str)]) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        labels: (!labels.is_empty()).then(|| {
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        }),
        ..ObjectMeta::default()
    }
}

fn strings<T: ToString>(items: &[T]) -> Vec<String> {
    items.iter().map(ToString::to_string).collect()
}

// ---------------------------------------------------------------- Service

/// Ports `tcp` `port`/TCP and `udp` `port`/UDP, to targetPort `port`.
pub fn tcp_and_udp(port: u16) -> [Port; 2] {
    [Port::tcp("tcp", port), Port::udp("udp", port)]
}

/// One port of a [`Svc`]: name, port, protocol, targetPort (default: the
/// port's number), nodePort (default: none, the lab allocates one for
/// NodePort and LoadBalancer Services).
#[derive(Clone, Debug)]
pub struct Port(ServicePort);

impl Port {
    /// Port `name` (empty: unnamed) `port`/`protocol` to targetPort `port`.
    pub fn new(name: &str, port: u16, protocol: &str) -> Port {
        Port(ServicePort {
            name: (!name.is_empty()).then(|| name.to_string()),
            port: port.into(),
            protocol: Some(protocol.to_string()),
            target_port: Some(IntOrString::Int(port.into())),
            ..ServicePort::default()
        })
    }

    pub fn tcp(name: &str, port: u16) -> Port {
        Port::new(name, port, "TCP")
    }

    pub fn udp(name: &str, port: u16) -> Port {
        Port::new(name, port, "UDP")
    }

    pub fn sctp(name: &str, port: u16) -> Port {
        Port::new(name, port, "SCTP")
    }

    /// targetPort as a number.
    pub fn target_port(mut self, port: u16) -> Port {
        self.0.target_port = Some(IntOrString::Int(port.into()));
        self
    }

    /// targetPort as the name of a container port.
    pub fn target_name(mut self, name: &str) -> Port {
        self.0.target_port = Some(IntOrString::String(name.to_string()));
        self
    }

    pub fn node_port(mut self, port: u16) -> Port {
        self.0.node_port = Some(port.into());
        self
    }
}

/// A Service, built field by field; [`Svc::yaml`] renders it.
#[derive(Clone, Debug)]
pub struct Svc(Service);

impl Manifest for Svc {
    fn yaml(&self) -> String {
        Svc::yaml(self)
    }
}

impl Svc {
    /// Service `name` (namespace `default`), no selector, no ports.
    pub fn new(name: &str) -> Svc {
        Svc(Service {
            metadata: meta(name, &[]),
            spec: Some(ServiceSpec::default()),
            status: None,
        })
    }

    fn spec(&mut self) -> &mut ServiceSpec {
        self.0.spec.get_or_insert_with(ServiceSpec::default)
    }

    /// Annotation `key: value`.
    pub fn annotation(mut self, key: &str, value: &str) -> Svc {
        self.0
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(key.to_string(), value.to_string());
        self
    }

    /// Selects the pods labelled `app: <app>`. Without it the Service is
    /// selector-less: the test writes its EndpointSlices.
    pub fn selector(mut self, app: &str) -> Svc {
        self.spec().selector = Some(BTreeMap::from([(APP.to_string(), app.to_string())]));
        self
    }

    /// `spec.type` (ClusterIP, NodePort, LoadBalancer).
    pub fn service_type(mut self, type_: &str) -> Svc {
        self.spec().type_ = Some(type_.to_string());
        self
    }

    /// An explicit ClusterIP (default: the lab allocates one).
    pub fn cluster_ip(mut self, ip: &str) -> Svc {
        self.spec().cluster_ip = Some(ip.to_string());
        self
    }

    /// `spec.ipFamilies` (`IPv4`, `IPv6`, in order; default: the lab's API
    /// server picks them, as the policy says). Needs a dual-stack lab when
    /// it names IPv6 (`LabBuilder::dual_stack`).
    pub fn ip_families(mut self, families: &[&str]) -> Svc {
        self.spec().ip_families = Some(strings(families));
        self
    }

    /// `spec.ipFamilyPolicy` (SingleStack, PreferDualStack, RequireDualStack).
    pub fn ip_family_policy(mut self, policy: &str) -> Svc {
        self.spec().ip_family_policy = Some(policy.to_string());
        self
    }

    /// An IPv6-only Service: `ipFamilies: [IPv6]`, `ipFamilyPolicy:
    /// SingleStack`.
    pub fn ipv6_only(self) -> Svc {
        self.ip_families(&["IPv6"]).ip_family_policy("SingleStack")
    }

    /// A dual-stack Service: `ipFamilies: [IPv4, IPv6]`, `ipFamilyPolicy:
    /// PreferDualStack` (a ClusterIP of each family in a dual-stack lab).
    pub fn dual_stack(self) -> Svc {
        self.ip_families(&["IPv4", "IPv6"])
            .ip_family_policy("PreferDualStack")
    }

    /// [`dual_stack`](Svc::dual_stack) with `ipFamilyPolicy:
    /// RequireDualStack`.
    pub fn require_dual_stack(self) -> Svc {
        self.ip_families(&["IPv4", "IPv6"])
            .ip_family_policy("RequireDualStack")
    }

    /// Appends a port.
    pub fn port(mut self, port: Port) -> Svc {
        self.spec().ports.get_or_insert_with(Vec::new).push(port.0);
        self
    }

    /// Appends ports, in order.
    pub fn ports(self, ports: impl IntoIterator<Item = Port>) -> Svc {
        ports.into_iter().fold(self, Svc::port)
    }

    pub fn external_traffic_policy(mut self, policy: &str) -> Svc {
        self.spec().external_traffic_policy = Some(policy.to_string());
        self
    }

    pub fn internal_traffic_policy(mut self, policy: &str) -> Svc {
        self.spec().internal_traffic_policy = Some(policy.to_string());
        self
    }

    /// `spec.trafficDistribution` (PreferClose, PreferSameZone, ...).
    pub fn traffic_distribution(mut self, distribution: &str) -> Svc {
        self.spec().traffic_distribution = Some(distribution.to_string());
        self
    }

    /// `spec.healthCheckNodePort` (the lab does not allocate one).
    pub fn health_check_node_port(mut self, port: u16) -> Svc {
        self.spec().health_check_node_port = Some(port.into());
        self
    }

    /// No `spec.healthCheckNodePort`.
    pub fn no_health_check_node_port(mut self) -> Svc {
        self.spec().health_check_node_port = None;
        self
    }

    /// `spec.externalIPs` (replaces those set before).
    pub fn external_ips(mut self, ips: &[Ipv4Addr]) -> Svc {
        self.spec().external_ips = Some(strings(ips));
        self
    }

    /// `spec.loadBalancerSourceRanges` (replaces those set before).
    pub fn source_ranges(mut self, cidrs: &[&str]) -> Svc {
        self.spec().load_balancer_source_ranges = Some(strings(cidrs));
        self
    }

    /// `status.loadBalancer.ingress`: `ips`, each with `ipMode: VIP` (what a
    /// cloud controller writes; replaces those set before).
    pub fn lb_ips(mut self, ips: &[Ipv4Addr]) -> Svc {
        let ingress = ips
            .iter()
            .map(|ip| LoadBalancerIngress {
                ip: Some(ip.to_string()),
                ip_mode: Some("VIP".to_string()),
                ..LoadBalancerIngress::default()
            })
            .collect();
        self.0.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(ingress),
            }),
            ..ServiceStatus::default()
        });
        self
    }

    /// `sessionAffinity: ClientIP`, with `timeoutSeconds` if given (else the
    /// default, 10800 s).
    pub fn client_ip_affinity(mut self, timeout_seconds: Option<u32>) -> Svc {
        let spec = self.spec();
        spec.session_affinity = Some("ClientIP".to_string());
        spec.session_affinity_config = timeout_seconds.map(|t| SessionAffinityConfig {
            client_ip: Some(ClientIPConfig {
                timeout_seconds: Some(t as i32),
            }),
        });
        self
    }

    /// `sessionAffinity: None`, written out.
    pub fn no_affinity(mut self) -> Svc {
        let spec = self.spec();
        spec.session_affinity = Some("None".to_string());
        spec.session_affinity_config = None;
        self
    }

    pub fn publish_not_ready_addresses(mut self) -> Svc {
        self.spec().publish_not_ready_addresses = Some(true);
        self
    }

    pub fn yaml(&self) -> String {
        document(&self.0)
    }
}

// ---------------------------------------------------------------- Pod

/// A Pod labelled `app: <app>` with one container `c` of image
/// `lab-server`: the lab starts a lab server for it, answering TCP and UDP
/// on every declared port (none declared: on 80), and SCTP on its SCTP
/// ports (unless [`Pod::without_sctp_listener`]).
#[derive(Clone, Debug)]
pub struct Pod(PodObject);

impl Manifest for Pod {
    fn yaml(&self) -> String {
        Pod::yaml(self)
    }
}

impl Pod {
    pub fn new(name: &str, app: &str) -> Pod {
        Pod(PodObject {
            metadata: meta(name, &[(APP, app)]),
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "c".to_string(),
                    image: Some("lab-server".to_string()),
                    ..Container::default()
                }],
                ..PodSpec::default()
            }),
            status: None,
        })
    }

    fn spec(&mut self) -> &mut PodSpec {
        self.0.spec.get_or_insert_with(PodSpec::default)
    }

    /// `spec.nodeName` (default: the lab places the pod round-robin).
    pub fn node(mut self, node: &str) -> Pod {
        self.spec().node_name = Some(node.to_string());
        self
    }

    /// `spec.hostNetwork: true`: the lab gives the pod its node's addresses
    /// as `podIPs` (both families in a dual-stack lab) and its node's
    /// namespace, and starts no server for it (a test starts one there:
    /// [`super::HostServer`]).
    pub fn host_network(mut self) -> Pod {
        self.spec().host_network = Some(true);
        self
    }

    /// Declares container port `port`/`protocol`.
    pub fn port(self, port: u16, protocol: &str) -> Pod {
        self.declare(None, port, protocol)
    }

    /// Declares container port `port`/`protocol` named `name` (for a
    /// Service's named targetPort).
    pub fn named_port(self, name: &str, port: u16, protocol: &str) -> Pod {
        self.declare(Some(name), port, protocol)
    }

    /// Its server does not listen on the pod's SCTP ports (they stay
    /// declared; see `xtask::lab::SCTP_LISTENER_ANNOTATION`): no SCTP socket,
    /// so the kernel's sctp module is not loaded for it (S41).
    pub fn without_sctp_listener(mut self) -> Pod {
        self.0
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(
                xtask::lab::SCTP_LISTENER_ANNOTATION.to_string(),
                "false".to_string(),
            );
        self
    }

    fn declare(mut self, name: Option<&str>, port: u16, protocol: &str) -> Pod {
        let c = &mut self.spec().containers[0];
        c.ports.get_or_insert_with(Vec::new).push(ContainerPort {
            container_port: port.into(),
            name: name.map(str::to_string),
            protocol: Some(protocol.to_string()),
            ..ContainerPort::default()
        });
        self
    }

    pub fn yaml(&self) -> String {
        document(&self.0)
    }
}

// ---------------------------------------------------------------- EndpointSlice

/// One endpoint of a [`Slice`]: one address, its conditions (ready, serving,
/// terminating: always written), node, zone and hints.
#[derive(Clone, Debug)]
pub struct Ep(Endpoint);

impl Ep {
    /// A ready (and serving, not terminating) endpoint at `ip` (either
    /// family: put it in a [`Slice`] of its family), no node.
    pub fn new(ip: impl Into<IpAddr>) -> Ep {
        let ip: IpAddr = ip.into();
        Ep(Endpoint {
            addresses: vec![ip.to_string()],
            ..Endpoint::default()
        })
        .cond(true, true, false)
    }

    /// A ready endpoint at pod `name`'s IP, on its node, in its node's zone
    /// (if the lab gave the node one), no hints.
    pub fn of(lab: &Lab, name: &str) -> Ep {
        let p = lab
            .pod(name)
            .unwrap_or_else(|| panic!("no pod {name} in the lab"));
        let ep = Ep::new(p.ip).node(&p.node);
        match lab.node_named(&p.node).and_then(|n| n.zone.clone()) {
            Some(zone) => ep.zone(&zone),
            None => ep,
        }
    }

    /// [`Ep::of`] at pod `name`'s IPv6 address (dual-stack labs), for an
    /// IPv6 [`Slice`].
    pub fn of6(lab: &Lab, name: &str) -> Ep {
        let p = lab
            .pod(name)
            .unwrap_or_else(|| panic!("no pod {name} in the lab"));
        let ip6 = p
            .ip6
            .unwrap_or_else(|| panic!("pod {name} has no IPv6 address: is the lab dual-stack?"));
        let ep = Ep::new(ip6).node(&p.node);
        match lab.node_named(&p.node).and_then(|n| n.zone.clone()) {
            Some(zone) => ep.zone(&zone),
            None => ep,
        }
    }

    /// The conditions `ready`, `serving`, `terminating`.
    pub fn cond(mut self, ready: bool, serving: bool, terminating: bool) -> Ep {
        self.0.conditions = Some(EndpointConditions {
            ready: Some(ready),
            serving: Some(serving),
            terminating: Some(terminating),
        });
        self
    }

    /// ready=false serving=true terminating=true (deleted, still serving).
    pub fn terminating_serving(self) -> Ep {
        self.cond(false, true, true)
    }

    /// ready=false serving=false terminating=true.
    pub fn terminating_not_serving(self) -> Ep {
        self.cond(false, false, true)
    }

    /// `nodeName`.
    pub fn node(mut self, node: &str) -> Ep {
        self.0.node_name = Some(node.to_string());
        self
    }

    pub fn zone(mut self, zone: &str) -> Ep {
        self.0.zone = Some(zone.to_string());
        self
    }

    /// A hint for the endpoint's own zone, if it has one (what the
    /// EndpointSlice controller writes for PreferClose / PreferSameZone
    /// when every zone is covered, and with per-endpoint zone hints
    /// regardless).
    pub fn zone_hint(mut self) -> Ep {
        if let Some(zone) = self.0.zone.clone() {
            self.hints().for_zones = Some(vec![ForZone { name: zone }]);
        }
        self
    }

    /// Hints for the endpoint's own node and zone (PreferSameNode).
    pub fn node_hint(mut self) -> Ep {
        if let Some(node) = self.0.node_name.clone() {
            self.hints().for_nodes = Some(vec![ForNode { name: node }]);
        }
        self.zone_hint()
    }

    fn hints(&mut self) -> &mut EndpointHints {
        self.0.hints.get_or_insert_with(EndpointHints::default)
    }
}

/// An EndpointSlice of a Service (label `kubernetes.io/service-name`),
/// written by a test for a selector-less Service: IPv4, or IPv6 with
/// [`Slice::ipv6`].
#[derive(Clone, Debug)]
pub struct Slice(EndpointSlice);

impl Manifest for Slice {
    fn yaml(&self) -> String {
        Slice::yaml(self)
    }
}

impl Slice {
    /// Slice `name` of Service `service`, no ports, no endpoints.
    pub fn new(name: &str, service: &str) -> Slice {
        Slice(EndpointSlice {
            metadata: meta(name, &[(SERVICE_NAME, service)]),
            address_type: "IPv4".to_string(),
            endpoints: Vec::new(),
            ports: None,
        })
    }

    /// `addressType: IPv6` (for endpoints at IPv6 addresses, [`Ep::of6`]).
    pub fn ipv6(mut self) -> Slice {
        self.0.address_type = "IPv6".to_string();
        self
    }

    /// Appends port `name` `port`/`protocol`.
    pub fn port(mut self, name: &str, port: u16, protocol: &str) -> Slice {
        self.0
            .ports
            .get_or_insert_with(Vec::new)
            .push(EndpointPort {
                name: Some(name.to_string()),
                port: Some(port.into()),
                protocol: Some(protocol.to_string()),
                ..EndpointPort::default()
            });
        self
    }

    /// Appends ports `tcp` `port`/TCP and `udp` `port`/UDP.
    pub fn tcp_and_udp(self, port: u16) -> Slice {
        self.port("tcp", port, "TCP").port("udp", port, "UDP")
    }

    pub fn endpoint(mut self, ep: Ep) -> Slice {
        self.0.endpoints.push(ep.0);
        self
    }

    /// Appends endpoints, in order.
    pub fn endpoints<'a>(self, eps: impl IntoIterator<Item = &'a Ep>) -> Slice {
        eps.into_iter().cloned().fold(self, Slice::endpoint)
    }

    pub fn yaml(&self) -> String {
        document(&self.0)
    }
}

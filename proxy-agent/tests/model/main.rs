//! The model: Services, EndpointSlices and Pods to frontends and backends.
//!
//! One test binary (`cargo test --test model`), split by concern into the
//! modules below so that each file stays short while the model's tests
//! still build and link once: `services` (Pods and EndpointSlices to a
//! ClusterIP's backends, ignored Services, invalid input), `policies`
//! (traffic policies, terminating endpoints, topology hints),
//! `northsouth` (NodePort, externalIPs, load-balancer IPs),
//! `node_port_addresses` (`nodePortAddresses`, the addresses of the external
//! interfaces) and `health_and_claims` (health checks, this node's
//! endpoints, frontends two Services claim). This file holds the fixtures
//! they share.
use std::path::Path;

use proxy_agent::model::{desired_state, DesiredState, Frontend, FrontendKey};
use proxy_agent::objects::Snapshot;
use proxy_agent::sources::manifests::load_str;
use proxy_common::{IPPROTO_TCP, SCOPE_EXTERNAL, SCOPE_INTERNAL};

mod dualstack;
mod health_and_claims;
mod incremental;
mod lb;
mod mutated;
mod node_port_addresses;
mod northsouth;
mod ownership;
mod policies;
mod services;

fn snap(yaml: &str) -> Snapshot {
    let mut snapshot = Snapshot::default();
    let mut errors = Vec::new();
    load_str(Path::new("test.yaml"), yaml, &mut snapshot, &mut errors);
    assert!(errors.is_empty(), "{errors:?}");
    snapshot
}

fn key(ip: &str, port: u16, proto: u8) -> FrontendKey {
    FrontendKey {
        addr: ip.parse().unwrap(),
        port,
        proto,
        scope: SCOPE_INTERNAL,
    }
}

/// The backends of a frontend as `ip:port` strings; panics if it does not exist.
fn backends(state: &DesiredState, ip: &str, port: u16, proto: u8) -> Vec<String> {
    let fe = state
        .frontends
        .get(&key(ip, port, proto))
        .unwrap_or_else(|| panic!("no frontend {ip}:{port}/{proto}"));
    fe.backends
        .iter()
        .map(|b| std::net::SocketAddr::new(b.addr, b.port).to_string())
        .collect()
}

/// The backends of `web`'s ClusterIP frontend (198.19.0.1:80/TCP) on
/// `node-a` for the objects of `yaml`.
fn web_backends(yaml: &str) -> Vec<String> {
    let (state, _) = desired_state(&snap(yaml), "node-a");
    backends(&state, "198.19.0.1", 80, IPPROTO_TCP)
}

/// The frontend; panics if it does not exist.
fn frontend<'a>(state: &'a DesiredState, ip: &str, port: u16, proto: u8) -> &'a Frontend {
    state
        .frontends
        .get(&key(ip, port, proto))
        .unwrap_or_else(|| panic!("no frontend {ip}:{port}/{proto}"))
}

/// The retained (terminating, not selectable) backends of a frontend as `ip:port`.
fn retained(state: &DesiredState, ip: &str, port: u16, proto: u8) -> Vec<String> {
    frontend(state, ip, port, proto)
        .retained
        .iter()
        .map(|b| std::net::SocketAddr::new(b.addr, b.port).to_string())
        .collect()
}

fn pod(name: &str, labels: &str, ip: &str, ports: &str) -> String {
    format!(
        "---
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  labels: {{{labels}}}
spec:
  nodeName: node-a
  containers:
    - name: c
      image: example
      ports: [{ports}]
status:
  phase: Running
  podIP: {ip}
"
    )
}

fn slice(name: &str, svc: &str, ports: &str, endpoints: &str) -> String {
    format!(
        "---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}
  labels: {{kubernetes.io/service-name: {svc}}}
addressType: IPv4
ports: [{ports}]
endpoints: [{endpoints}]
"
    )
}

const WEB: &str = "
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  clusterIP: 198.19.0.1
  ports: [{name: http, port: 80}]
";

// North-south fixtures: nodes with addresses, a `web` Service with a
// nodePort or external addresses, frontends by scope.

/// The frontend at `ip:port/proto` in `scope`; panics if it does not exist.
fn fe_at<'a>(state: &'a DesiredState, ip: &str, port: u16, proto: u8, scope: u8) -> &'a Frontend {
    let k = FrontendKey {
        scope,
        ..key(ip, port, proto)
    };
    state
        .frontends
        .get(&k)
        .unwrap_or_else(|| panic!("no frontend {k}; have {:?}", state.frontends.keys()))
}

/// Whether a frontend exists at `ip:port/proto` in `scope`.
fn has_fe(state: &DesiredState, ip: &str, port: u16, proto: u8, scope: u8) -> bool {
    state.frontends.contains_key(&FrontendKey {
        scope,
        ..key(ip, port, proto)
    })
}

/// A frontend's backends as `ip:port` strings.
fn addrs(fe: &Frontend) -> Vec<String> {
    fe.backends
        .iter()
        .map(|b| std::net::SocketAddr::new(b.addr, b.port).to_string())
        .collect()
}

/// A Node with `status.addresses` (`type` and address pairs).
fn node_addrs(name: &str, addresses: &[(&str, &str)]) -> String {
    let list: Vec<String> = addresses
        .iter()
        .map(|(t, a)| format!("{{type: {t}, address: \"{a}\"}}"))
        .collect();
    format!(
        "---
apiVersion: v1
kind: Node
metadata: {{name: {name}}}
status:
  addresses: [{}]
",
        list.join(", ")
    )
}

/// Nodes `node-a` (198.18.0.11) and `node-b` (198.18.0.12), one InternalIP each.
fn two_nodes() -> String {
    node_addrs("node-a", &[("InternalIP", "198.18.0.11")])
        + &node_addrs("node-b", &[("InternalIP", "198.18.0.12")])
}

/// Service `web`: clusterIP 198.19.0.1, port `http` 80 (→ 8080) with
/// `port_extra` fields, extra `spec_lines` and a `status` block.
fn web_svc(spec_lines: &str, port_extra: &str, status: &str) -> String {
    format!(
        "---
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
  clusterIP: 198.19.0.1
{spec_lines}  ports: [{{name: http, port: 80{port_extra}}}]
{status}"
    )
}

/// `web`'s endpoints: one per `(ip, node, conditions)`.
fn web_endpoints(endpoints: &[(&str, &str, &str)]) -> String {
    let list: Vec<String> = endpoints
        .iter()
        .map(|(ip, node, cond)| format!("{{addresses: [{ip}], nodeName: {node}{cond}}}"))
        .collect();
    slice("web-1", "web", "{name: http, port: 8080}", &list.join(", "))
}

fn ext(ip: &str, port: u16) -> FrontendKey {
    FrontendKey {
        scope: SCOPE_EXTERNAL,
        ..key(ip, port, IPPROTO_TCP)
    }
}

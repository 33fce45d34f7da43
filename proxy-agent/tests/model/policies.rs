//! Endpoint categorization as kube-proxy's `CategorizeEndpoints`: traffic
//! policies, the terminating fallback, topology hints.
use proxy_agent::model::{
    desired_state, desired_state_with, endpoint_slices_from_pods, Gates, ModelOptions,
    ServicePortInfo, TrafficPolicy,
};
use proxy_common::{svc_flags, IPPROTO_TCP};

use super::*;

/// A Service `web` (198.19.0.1:80 → `http`) with extra spec lines.
fn web_with(spec_lines: &str) -> String {
    WEB.replace(
        "  clusterIP: 198.19.0.1\n",
        &format!("  clusterIP: 198.19.0.1\n{spec_lines}"),
    )
}

fn node(name: &str, zone: &str) -> String {
    format!(
        "---
apiVersion: v1
kind: Node
metadata:
  name: {name}
  labels: {{topology.kubernetes.io/zone: {zone}}}
"
    )
}

#[test]
fn internal_traffic_policy_local_without_local_endpoints_drops_p2() {
    let yaml = web_with("  internalTrafficPolicy: Local\n")
        + &slice(
            "web-1",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1], nodeName: node-b},
             {addresses: [198.18.1.2], nodeName: node-c},
             {addresses: [198.18.1.3]}",
        );
    let snapshot = snap(&yaml);
    // node-a: remote endpoints only (the one without nodeName is never local).
    let (state, _) = desired_state(&snapshot, "node-a");
    let fe = frontend(&state, "198.19.0.1", 80, IPPROTO_TCP);
    assert!(fe.backends.is_empty(), "{fe:?}");
    assert_eq!(fe.flags, svc_flags::DROP_NO_BACKEND | svc_flags::CLUSTER_IP);
    // Listed but not usable from here: kept only for flows that already use them.
    assert_eq!(
        retained(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080", "198.18.1.2:8080", "198.18.1.3:8080"]
    );
    // node-b: its own endpoint only, no flag.
    let (state, _) = desired_state(&snapshot, "node-b");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080"]
    );
    assert_eq!(
        frontend(&state, "198.19.0.1", 80, IPPROTO_TCP).flags,
        svc_flags::CLUSTER_IP
    );
}

#[test]
fn internal_traffic_policy_local_falls_back_to_local_serving_terminating() {
    let yaml = web_with("  internalTrafficPolicy: Local\n")
        + &slice(
            "web-1",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1], nodeName: node-b},
             {addresses: [198.18.1.2], nodeName: node-a,
              conditions: {ready: false, serving: true, terminating: true}}",
        );
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    let fe = frontend(&state, "198.19.0.1", 80, IPPROTO_TCP);
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.2:8080"]
    );
    assert_eq!(fe.flags, svc_flags::CLUSTER_IP);
    assert!(
        fe.retained.iter().all(|r| !fe.backends.contains(r)),
        "a backend is not also retained"
    );
}

#[test]
fn no_endpoint_anywhere_rejects_without_flag() {
    // No slice at all, and a slice with only unready endpoints.
    for yaml in [
        WEB.to_string(),
        WEB.to_string()
            + &slice(
                "web-1",
                "web",
                "{name: http, port: 8080}",
                "{addresses: [198.18.1.1], conditions: {ready: false}}",
            ),
        web_with("  internalTrafficPolicy: Local\n"),
    ] {
        let (state, _) = desired_state(&snap(&yaml), "node-a");
        let fe = frontend(&state, "198.19.0.1", 80, IPPROTO_TCP);
        assert!(fe.backends.is_empty(), "{fe:?}");
        assert_eq!(fe.flags, svc_flags::CLUSTER_IP, "{fe:?}");
        // An unready endpoint is kept for flows that already use it (as
        // kube-proxy's conntrack keeps them), never selected.
        let kept = retained(&state, "198.19.0.1", 80, IPPROTO_TCP);
        assert!(kept.iter().all(|r| r == "198.18.1.1:8080"), "{fe:?}");
    }
}

#[test]
fn no_ready_endpoint_falls_back_to_serving_terminating_s35_s36() {
    let yaml = WEB.to_string()
        + &slice(
            "web-1",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1], conditions: {ready: false, serving: true, terminating: true}},
             {addresses: [198.18.1.2], nodeName: node-b,
              conditions: {ready: false, serving: true, terminating: true}},
             {addresses: [198.18.1.3], conditions: {ready: false, serving: false, terminating: true}},
             {addresses: [198.18.1.4], conditions: {ready: false}}",
        );
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    let fe = frontend(&state, "198.19.0.1", 80, IPPROTO_TCP);
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080", "198.18.1.2:8080"]
    );
    assert_eq!(fe.flags, svc_flags::CLUSTER_IP);
    assert_eq!(
        retained(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.3:8080", "198.18.1.4:8080"]
    );

    // One ready endpoint: the serving-terminating ones leave the selection.
    let yaml = yaml.replace(
        "{addresses: [198.18.1.4], conditions: {ready: false}}",
        "{addresses: [198.18.1.4], conditions: {ready: true}}",
    );
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.4:8080"]
    );
    assert_eq!(
        retained(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080", "198.18.1.2:8080", "198.18.1.3:8080"]
    );
}

#[test]
fn terminating_not_serving_is_never_used_s20() {
    let yaml = WEB.to_string()
        + &slice(
            "web-1",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1], nodeName: node-a,
              conditions: {ready: false, serving: false, terminating: true}}",
        );
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    let fe = frontend(&state, "198.19.0.1", 80, IPPROTO_TCP);
    assert!(fe.backends.is_empty(), "{fe:?}");
    assert_eq!(
        fe.flags,
        svc_flags::CLUSTER_IP,
        "no usable endpoint anywhere: reject"
    );
    assert_eq!(
        retained(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080"]
    );
}

#[test]
fn ready_endpoint_is_used_even_when_not_serving() {
    // publishNotReadyAddresses: the controller writes ready=true; kube-proxy
    // only reads `ready` for the selection.
    let yaml = WEB.to_string()
        + &slice(
            "web-1",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1], conditions: {ready: true, serving: false}}",
        );
    assert_eq!(web_backends(&yaml), ["198.18.1.1:8080"]);
}

#[test]
fn publish_not_ready_addresses_makes_unready_pods_ready() {
    let mut yaml = "
apiVersion: v1
kind: Service
metadata: {name: s}
spec:
  clusterIP: 198.19.0.5
  selector: {app: s}
  publishNotReadyAddresses: true
  ports: [{port: 80}]
"
    .to_string();
    yaml += &pod("unready", "app: s", "198.18.1.42", "").replace(
        "  phase: Running\n",
        "  phase: Running\n  conditions: [{type: Ready, status: \"False\"}]\n",
    );
    let snapshot = snap(&yaml);
    let slices = endpoint_slices_from_pods(&snapshot);
    let c = slices[0].endpoints[0].conditions.clone().unwrap();
    assert_eq!(
        (c.ready, c.serving, c.terminating),
        (Some(true), Some(false), Some(false))
    );
    let (state, _) = desired_state(&snapshot, "node-a");
    assert_eq!(
        backends(&state, "198.19.0.5", 80, IPPROTO_TCP),
        ["198.18.1.42:80"]
    );
}

#[test]
fn terminating_pod_is_a_terminating_endpoint() {
    let mut yaml = "
apiVersion: v1
kind: Service
metadata: {name: s}
spec:
  clusterIP: 198.19.0.5
  selector: {app: s}
  ports: [{port: 80}]
"
    .to_string();
    let deleted = |p: String, name: &str| {
        p.replace(
            &format!("  name: {name}\n"),
            &format!("  name: {name}\n  deletionTimestamp: \"2024-01-01T00:00:00Z\"\n"),
        )
    };
    yaml += &deleted(pod("going", "app: s", "198.18.1.44", ""), "going");
    yaml += &deleted(
        pod("going-unready", "app: s", "198.18.1.45", "").replace(
            "  phase: Running\n",
            "  phase: Running\n  conditions: [{type: Ready, status: \"False\"}]\n",
        ),
        "going-unready",
    );
    let snapshot = snap(&yaml);
    let conditions: Vec<_> = endpoint_slices_from_pods(&snapshot)
        .iter()
        .map(|s| {
            let c = s.endpoints[0].conditions.clone().unwrap();
            (c.ready, c.serving, c.terminating)
        })
        .collect();
    assert_eq!(
        conditions,
        [
            (Some(false), Some(true), Some(true)),
            (Some(false), Some(false), Some(true))
        ]
    );
    // No ready pod: the serving terminating one carries new flows; the other
    // is only kept for existing flows.
    let (state, _) = desired_state(&snapshot, "node-a");
    assert_eq!(
        backends(&state, "198.19.0.5", 80, IPPROTO_TCP),
        ["198.18.1.44:80"]
    );
    assert_eq!(
        retained(&state, "198.19.0.5", 80, IPPROTO_TCP),
        ["198.18.1.45:80"]
    );
}

#[test]
fn zone_hints_select_endpoints_of_the_node_zone_t1() {
    let hinted = |extra: &str| {
        WEB.to_string()
            + &node("node-a", "zone-a")
            + &slice(
                "web-1",
                "web",
                "{name: http, port: 8080}",
                &format!(
                    "{{addresses: [198.18.1.1], hints: {{forZones: [{{name: zone-a}}]}}}},
                     {{addresses: [198.18.1.2], hints: {{forZones: [{{name: zone-b}}]}}}},
                     {{addresses: [198.18.1.3], hints: {{forZones: [{{name: zone-a}}]}}}},
                     {{addresses: [198.18.1.4], conditions: {{ready: false}}}}{extra}"
                ),
            )
    };
    let (state, _) = desired_state(&snap(&hinted("")), "node-a");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080", "198.18.1.3:8080"]
    );
    assert_eq!(
        frontend(&state, "198.19.0.1", 80, IPPROTO_TCP).flags,
        svc_flags::CLUSTER_IP
    );
    // A node without the Node object (no zone): no filtering.
    let (state, _) = desired_state(&snap(&hinted("")), "node-x");
    assert_eq!(backends(&state, "198.19.0.1", 80, IPPROTO_TCP).len(), 3);
    // One unhinted ready endpoint turns topology off for the whole port.
    let (state, _) = desired_state(&snap(&hinted(",\n {addresses: [198.18.1.5]}")), "node-a");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        [
            "198.18.1.1:8080",
            "198.18.1.2:8080",
            "198.18.1.3:8080",
            "198.18.1.5:8080"
        ]
    );
}

#[test]
fn node_hints_prefer_same_node_unless_the_gate_is_off() {
    let yaml = WEB.to_string()
        + &node("node-a", "zone-a")
        + &slice(
            "web-1",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1],
              hints: {forZones: [{name: zone-a}], forNodes: [{name: node-a}]}},
             {addresses: [198.18.1.2],
              hints: {forZones: [{name: zone-a}], forNodes: [{name: node-b}]}},
             {addresses: [198.18.1.3],
              hints: {forZones: [{name: zone-b}], forNodes: [{name: node-c}]}}",
        );
    let snapshot = snap(&yaml);
    let (state, _) = desired_state(&snapshot, "node-a");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080"]
    );
    let opts = ModelOptions {
        gates: Gates {
            prefer_same_traffic_distribution: false,
        },
        ..ModelOptions::default()
    };
    let (state, _) = desired_state_with(&snapshot, "node-a", &opts);
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080", "198.18.1.2:8080"]
    );
}

#[test]
fn external_traffic_policy_local_leaves_cluster_ip_backends_alone() {
    let yaml = web_with("  type: NodePort\n  externalTrafficPolicy: Local\n").replace(
        "{name: http, port: 80}",
        "{name: http, port: 80, nodePort: 30080}",
    ) + &slice(
        "web-1",
        "web",
        "{name: http, port: 8080}",
        "{addresses: [198.18.1.1], nodeName: node-b}",
    );
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    let fe = frontend(&state, "198.19.0.1", 80, IPPROTO_TCP);
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080"]
    );
    assert_eq!(fe.flags, svc_flags::CLUSTER_IP);
}

#[test]
fn service_port_info_externally_accessible() {
    let info = |extra_spec: &str, port: &str, status: &str| {
        let yaml = format!(
            "apiVersion: v1
kind: Service
metadata: {{name: x}}
spec:
  clusterIP: 198.19.0.9
  internalTrafficPolicy: Local
  externalTrafficPolicy: Local
{extra_spec}  ports: [{port}]
{status}"
        );
        let snapshot = snap(&yaml);
        let svc = &snapshot.services[0];
        ServicePortInfo::from_service(svc, &svc.spec.as_ref().unwrap().ports.as_ref().unwrap()[0])
    };
    let plain = info("", "{port: 80}", "");
    assert_eq!(plain.internal_traffic_policy, TrafficPolicy::Local);
    assert_eq!(plain.external_traffic_policy, TrafficPolicy::Local);
    assert!(!plain.externally_accessible);
    assert!(!plain.uses_cluster_endpoints() && plain.uses_local_endpoints());
    let node_port = info("  type: NodePort\n", "{port: 80, nodePort: 30080}", "");
    assert!(node_port.externally_accessible && node_port.uses_cluster_endpoints());
    assert!(info("  externalIPs: [198.18.9.9]\n", "{port: 80}", "").externally_accessible);
    assert!(!info("  externalIPs: [\"2001:2::9\"]\n", "{port: 80}", "").externally_accessible);
    let lb = |ingress: &str| {
        info(
            "  type: LoadBalancer\n  allocateLoadBalancerNodePorts: false\n",
            "{port: 80}",
            &format!("status: {{loadBalancer: {{ingress: [{ingress}]}}}}\n"),
        )
        .externally_accessible
    };
    assert!(lb("{ip: 198.18.9.10}"));
    assert!(lb("{ip: 198.18.9.10, ipMode: VIP}"));
    assert!(!lb("{ip: 198.18.9.10, ipMode: Proxy}"));
    assert!(!lb("{hostname: lb.example.invalid}"));
    // The defaults: Cluster policies, not externally accessible.
    let d = ServicePortInfo::default();
    assert!(d.uses_cluster_endpoints() && !d.uses_local_endpoints());
}

#[test]
fn slice_edge_cases_ipv6_port_zero_and_local_duplicate() {
    let yaml = web_with("  internalTrafficPolicy: Local\n")
        + &slice(
            "web-1",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1], nodeName: node-b}",
        )
        // The same ip:port again, this time local: the local copy wins.
        + &slice(
            "web-2",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1], nodeName: node-a}",
        )
        + &slice(
            "web-zero",
            "web",
            "{name: http, port: 0}",
            "{addresses: [198.18.1.2], nodeName: node-a}",
        )
        + &slice(
            "web-v6",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [\"2001:2::1\"], nodeName: node-a}",
        )
        .replace("addressType: IPv4", "addressType: IPv6");
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    // Port 0 is skipped (as kube-proxy does), and said: one warning, naming the slice.
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].object, "EndpointSlice default/web-zero");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080"]
    );
}

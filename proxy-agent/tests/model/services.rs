//! From Services, Pods and EndpointSlices to a ClusterIP frontend's
//! backends: target ports, conditions, slice ports, ignored Services,
//! invalid input, protocols, affinity and determinism.
use std::path::Path;

use proxy_agent::model::{
    desired_state, desired_state_with, endpoint_slices_from_pods, ModelOptions,
};
use proxy_agent::sources::manifests::load_paths;
use proxy_common::{svc_flags, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use super::*;

#[test]
fn example_service_with_two_pods_has_one_frontend_with_two_backends() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/example.yaml");
    let (snapshot, errors) = load_paths(&[path]);
    assert!(errors.is_empty(), "{errors:?}");
    let (state, warnings) = desired_state(&snapshot, "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(state.frontends.len(), 1);
    assert_eq!(
        backends(&state, "198.19.0.10", 80, IPPROTO_TCP),
        ["198.18.1.1:80", "198.18.1.2:80"]
    );
    let fe = &state.frontends[&key("198.19.0.10", 80, IPPROTO_TCP)];
    assert_eq!(&*fe.service, "default/my-service");
    assert_eq!(
        (fe.flags, fe.affinity_timeout_s),
        (svc_flags::CLUSTER_IP, 0)
    );
}

#[test]
fn named_target_port_resolves_per_pod_s45() {
    let mut yaml = "
apiVersion: v1
kind: Service
metadata: {name: mutable}
spec:
  clusterIP: 198.19.0.2
  selector: {app: m}
  ports: [{port: 8001, targetPort: mutable-port}]
"
    .to_string();
    yaml += &pod(
        "testpod0",
        "app: m",
        "198.18.1.10",
        "{name: mutable-port, containerPort: 8080}",
    );
    yaml += &pod(
        "testpod1",
        "app: m",
        "198.18.1.11",
        "{name: mutable-port, containerPort: 8000}",
    );
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        backends(&state, "198.19.0.2", 8001, IPPROTO_TCP),
        ["198.18.1.10:8080", "198.18.1.11:8000"]
    );
}

#[test]
fn multiport_named_target_ports_map_each_port_to_its_pod_s2() {
    let mut yaml = "
apiVersion: v1
kind: Service
metadata: {name: multi}
spec:
  clusterIP: 198.19.0.3
  selector: {app: multi}
  ports:
    - {name: portname1, port: 80, targetPort: svc1}
    - {name: portname2, port: 81, targetPort: svc2}
"
    .to_string();
    yaml += &pod(
        "pod1",
        "app: multi",
        "198.18.1.21",
        "{name: svc1, containerPort: 100}",
    );
    yaml += &pod(
        "pod2",
        "app: multi",
        "198.18.1.22",
        "{name: svc2, containerPort: 101}",
    );
    let snapshot = snap(&yaml);
    let (state, warnings) = desired_state(&snapshot, "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        backends(&state, "198.19.0.3", 80, IPPROTO_TCP),
        ["198.18.1.21:100"]
    );
    assert_eq!(
        backends(&state, "198.19.0.3", 81, IPPROTO_TCP),
        ["198.18.1.22:101"]
    );
    // The synthesized slices: one per pod, only the ports that resolve.
    let slices = endpoint_slices_from_pods(&snapshot);
    let names: Vec<_> = slices
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["multi-pod-pod1", "multi-pod-pod2"]);
    assert_eq!(slices[0].ports.as_ref().unwrap().len(), 1);
}

#[test]
fn target_port_int_missing_and_unresolvable() {
    let mut yaml = "
apiVersion: v1
kind: Service
metadata: {name: t}
spec:
  clusterIP: 198.19.0.4
  selector: {app: t}
  ports:
    - {name: a, port: 80, targetPort: 8080}
    - {name: b, port: 81}
    - {name: c, port: 82, targetPort: nowhere}
    - {name: d, port: 83, targetPort: dns, protocol: UDP}
"
    .to_string();
    yaml += &pod(
        "p",
        "app: t",
        "198.18.1.30",
        "{name: dns, containerPort: 5353, protocol: TCP}",
    );
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(
        backends(&state, "198.19.0.4", 80, IPPROTO_TCP),
        ["198.18.1.30:8080"]
    );
    assert_eq!(
        backends(&state, "198.19.0.4", 81, IPPROTO_TCP),
        ["198.18.1.30:81"]
    );
    assert!(
        backends(&state, "198.19.0.4", 82, IPPROTO_TCP).is_empty(),
        "unresolved name: no backend"
    );
    assert!(
        backends(&state, "198.19.0.4", 83, IPPROTO_UDP).is_empty(),
        "named port of another protocol"
    );
}

#[test]
fn pods_not_ready_terminating_finished_or_elsewhere_are_not_backends() {
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
    yaml += &pod("ok", "app: s", "198.18.1.40", "");
    yaml += &pod("other-label", "app: x", "198.18.1.41", "");
    yaml += &pod("unready", "app: s", "198.18.1.42", "").replace(
        "  phase: Running\n",
        "  phase: Running\n  conditions: [{type: Ready, status: \"False\"}]\n",
    );
    yaml += &pod("done", "app: s", "198.18.1.43", "").replace("phase: Running", "phase: Succeeded");
    yaml += &pod("going", "app: s", "198.18.1.44", "").replace(
        "  name: going\n",
        "  name: going\n  deletionTimestamp: \"2024-01-01T00:00:00Z\"\n",
    );
    yaml += &pod("elsewhere", "app: s", "198.18.1.45", "").replace(
        "  name: elsewhere\n",
        "  name: elsewhere\n  namespace: other\n",
    );
    yaml += &pod("no-ip", "app: s", "198.18.1.46", "").replace("  podIP: 198.18.1.46\n", "");
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(
        backends(&state, "198.19.0.5", 80, IPPROTO_TCP),
        ["198.18.1.40:80"]
    );
    // The terminating pod (serving: no Ready condition) is kept for its flows.
    assert_eq!(
        retained(&state, "198.19.0.5", 80, IPPROTO_TCP),
        ["198.18.1.42:80", "198.18.1.44:80"]
    );
}

#[test]
fn endpoints_with_ready_false_are_skipped_and_missing_ready_counts_as_ready() {
    let yaml = WEB.to_string()
        + &slice(
            "web-1",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1], conditions: {ready: true}},
             {addresses: [198.18.1.2], conditions: {ready: false}},
             {addresses: [198.18.1.3]},
             {addresses: [198.18.1.4], conditions: {}}",
        );
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080", "198.18.1.3:8080", "198.18.1.4:8080"]
    );
}

#[test]
fn slice_ports_match_by_name_and_protocol() {
    let yaml = WEB.to_string()
        + &slice(
            "web-other-name",
            "web",
            "{name: metrics, port: 9000}",
            "{addresses: [198.18.1.5]}",
        )
        + &slice(
            "web-udp",
            "web",
            "{name: http, port: 9001, protocol: UDP}",
            "{addresses: [198.18.1.6]}",
        )
        + &slice(
            "web-no-port",
            "web",
            "{name: http}",
            "{addresses: [198.18.1.7]}",
        )
        + &slice(
            "web-ok",
            "web",
            "{name: http, port: 9002, protocol: TCP}",
            "{addresses: [198.18.1.8]}",
        )
        + &slice(
            "other-svc",
            "other",
            "{name: http, port: 9003}",
            "{addresses: [198.18.1.9]}",
        );
    assert_eq!(web_backends(&yaml), ["198.18.1.8:9002"]);
}

#[test]
fn unnamed_service_port_matches_unnamed_slice_port() {
    let yaml = WEB.replace("{name: http, port: 80}", "{port: 80}")
        + &slice("web-a", "web", "{port: 8080}", "{addresses: [198.18.1.1]}")
        + &slice(
            "web-b",
            "web",
            "{name: \"\", port: 8080}",
            "{addresses: [198.18.1.2]}",
        );
    assert_eq!(web_backends(&yaml), ["198.18.1.1:8080", "198.18.1.2:8080"]);
}

#[test]
fn ignored_services_produce_no_frontend() {
    let yaml = "
apiVersion: v1
kind: Service
metadata: {name: ext}
spec: {type: ExternalName, externalName: example.invalid, clusterIP: 198.19.0.11, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: headless}
spec: {clusterIP: None, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: headless-label, labels: {service.kubernetes.io/headless: \"\"}}
spec: {clusterIP: 198.19.0.12, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: other-proxy, labels: {service.kubernetes.io/service-proxy-name: other}}
spec: {clusterIP: 198.19.0.13, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: mine, labels: {service.kubernetes.io/service-proxy-name: ebpf}}
spec: {clusterIP: 198.19.0.14, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: kept}
spec: {clusterIP: 198.19.0.15, ports: [{port: 80}]}
";
    let snapshot = snap(yaml);
    let (state, warnings) = desired_state(&snapshot, "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    let services: Vec<_> = state
        .frontends
        .values()
        .map(|f| f.service.as_ref())
        .collect();
    assert_eq!(services, ["default/kept"]);

    // With a proxy name, services labelled with it are ours; others still ignored.
    let opts = ModelOptions {
        service_proxy_name: Some("ebpf".into()),
        ..ModelOptions::default()
    };
    let (state, _) = desired_state_with(&snapshot, "node-a", &opts);
    let services: Vec<_> = state
        .frontends
        .values()
        .map(|f| f.service.as_ref())
        .collect();
    assert_eq!(services, ["default/mine", "default/kept"]);
}

#[test]
fn invalid_ip_in_slice_warns_and_keeps_other_endpoints() {
    let yaml = WEB.to_string()
        + &slice(
            "web-bad",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1]}, {addresses: [not-an-ip]}, {addresses: [198.18.1.2]}",
        );
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080", "198.18.1.2:8080"]
    );
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let w = warnings[0].to_string();
    assert!(
        w.contains("EndpointSlice default/web-bad") && w.contains("not-an-ip"),
        "{w}"
    );
}

#[test]
fn invalid_cluster_ip_or_protocol_warns_and_skips_only_that_and_ipv6_is_served() {
    let yaml = WEB.to_string()
        + "---
apiVersion: v1
kind: Service
metadata: {name: broken}
spec: {clusterIP: 198.19.0.300, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: dual}
spec: {clusterIP: 198.19.0.7, clusterIPs: [198.19.0.7, \"2001:2::7\"], ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: sctp}
spec: {clusterIP: 198.19.0.8, ports: [{name: s, port: 80, protocol: SCTP}, {name: t, port: 81}]}
---
apiVersion: v1
kind: Service
metadata: {name: dccp}
spec: {clusterIP: 198.19.0.9, ports: [{name: d, port: 80, protocol: DCCP}, {name: t, port: 81}]}
";
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    let keys: Vec<_> = state
        .frontends
        .keys()
        .map(|k| (k.addr, k.port, k.proto))
        .collect();
    let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
    // The dual-stack Service has a frontend per family (IPv4 addresses sort
    // first).
    assert_eq!(
        keys,
        [
            (ip("198.19.0.1"), 80, IPPROTO_TCP),
            (ip("198.19.0.7"), 80, IPPROTO_TCP),
            (ip("198.19.0.8"), 80, IPPROTO_SCTP),
            (ip("198.19.0.8"), 81, IPPROTO_TCP),
            (ip("198.19.0.9"), 81, IPPROTO_TCP),
            (ip("2001:2::7"), 80, IPPROTO_TCP)
        ]
    );
    let text: Vec<String> = warnings.iter().map(ToString::to_string).collect();
    assert_eq!(text.len(), 2, "{text:?}");
    assert!(text[0].contains("Service default/broken"), "{text:?}");
    // A protocol Kubernetes does not have skips that port only.
    assert!(
        text[1].contains("Service default/dccp") && text[1].contains("DCCP"),
        "{text:?}"
    );
}

#[test]
fn same_ip_and_port_in_two_slices_is_one_backend() {
    let yaml = WEB.to_string()
        + &slice(
            "web-1",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1]}, {addresses: [198.18.1.2]}",
        )
        + &slice(
            "web-2",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.2]}",
        );
    assert_eq!(web_backends(&yaml), ["198.18.1.1:8080", "198.18.1.2:8080"]);
}

#[test]
fn udp_and_tcp_on_the_same_port_are_two_frontends() {
    let yaml = "
apiVersion: v1
kind: Service
metadata: {name: dns}
spec:
  clusterIP: 198.19.0.53
  ports:
    - {name: dns, port: 53, protocol: UDP}
    - {name: dns-tcp, port: 53, protocol: TCP}
"
    .to_string()
        + &slice(
            "dns-1",
            "dns",
            "{name: dns, port: 5353, protocol: UDP}, {name: dns-tcp, port: 5354, protocol: TCP}",
            "{addresses: [198.18.1.53]}",
        );
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(state.frontends.len(), 2);
    assert_eq!(
        backends(&state, "198.19.0.53", 53, IPPROTO_UDP),
        ["198.18.1.53:5353"]
    );
    assert_eq!(
        backends(&state, "198.19.0.53", 53, IPPROTO_TCP),
        ["198.18.1.53:5354"]
    );
    let udp = state.frontends[&key("198.19.0.53", 53, IPPROTO_UDP)].backends[0];
    assert_eq!(udp.proto, IPPROTO_UDP);
}

#[test]
fn client_ip_affinity_sets_the_timeout() {
    let yaml = WEB.replace(
        "  clusterIP: 198.19.0.1\n",
        "  clusterIP: 198.19.0.1\n  sessionAffinity: ClientIP\n",
    );
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(
        state.frontends[&key("198.19.0.1", 80, IPPROTO_TCP)].affinity_timeout_s,
        10_800
    );
}

#[test]
fn output_is_deterministic_whatever_the_input_order() {
    let a = WEB.to_string()
        + &slice(
            "web-1",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.2]}, {addresses: [198.18.1.1]}",
        )
        + &slice(
            "web-2",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.3]}",
        );
    let b = WEB.to_string()
        + &slice(
            "web-2",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.3]}",
        )
        + &slice(
            "web-1",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [198.18.1.1]}, {addresses: [198.18.1.2]}",
        );
    assert_eq!(
        desired_state(&snap(&a), "n").0,
        desired_state(&snap(&b), "n").0
    );
}

//! The model: Services, EndpointSlices and Pods to frontends and backends.
use std::net::Ipv4Addr;
use std::path::Path;

use proxy_agent::manifests::{load_paths, load_str, Snapshot};
use proxy_agent::model::{
    desired_state, desired_state_with, endpoint_slices_from_pods, DesiredState, Frontend,
    FrontendKey, Gates, ModelOptions, ServicePortInfo, TrafficPolicy,
};
use proxy_common::{svc_flags, IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL};

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
        .map(|b| format!("{}:{}", b.addr, b.port))
        .collect()
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
        .map(|b| format!("{}:{}", b.addr, b.port))
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
    assert_eq!(fe.service, "default/my-service");
    assert_eq!((fe.flags, fe.affinity_timeout_s), (0, 0));
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
        ["198.18.1.44:80"]
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
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.8:9002"]
    );
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
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080", "198.18.1.2:8080"]
    );
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
        .map(|f| f.service.as_str())
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
        .map(|f| f.service.as_str())
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
fn invalid_cluster_ip_warns_and_skips_only_that_service_and_ipv6_is_ignored() {
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
spec: {clusterIP: 198.19.0.7, clusterIPs: [198.19.0.7, \"fd00::7\"], ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: sctp}
spec: {clusterIP: 198.19.0.8, ports: [{name: s, port: 80, protocol: SCTP}, {name: t, port: 81}]}
";
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    let keys: Vec<_> = state.frontends.keys().map(|k| (k.addr, k.port)).collect();
    let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
    assert_eq!(
        keys,
        [
            (ip("198.19.0.1"), 80),
            (ip("198.19.0.7"), 80),
            (ip("198.19.0.8"), 81)
        ]
    );
    let text: Vec<String> = warnings.iter().map(ToString::to_string).collect();
    assert_eq!(text.len(), 2, "{text:?}");
    assert!(text[0].contains("Service default/broken"), "{text:?}");
    assert!(
        text[1].contains("Service default/sctp") && text[1].contains("SCTP"),
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
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080", "198.18.1.2:8080"]
    );
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
    assert_eq!(fe.flags, svc_flags::DROP_NO_BACKEND);
    assert!(fe.retained.is_empty(), "{fe:?}");
    // node-b: its own endpoint only, no flag.
    let (state, _) = desired_state(&snapshot, "node-b");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080"]
    );
    assert_eq!(frontend(&state, "198.19.0.1", 80, IPPROTO_TCP).flags, 0);
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
    assert_eq!(fe.flags, 0);
    assert!(fe.retained.is_empty(), "a backend is not also retained");
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
        assert_eq!(fe.flags, 0, "{fe:?}");
        assert!(fe.retained.is_empty(), "unready is not retained: {fe:?}");
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
    assert_eq!(fe.flags, 0);
    assert_eq!(
        retained(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.3:8080"]
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
    assert_eq!(fe.flags, 0, "no usable endpoint anywhere: reject");
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
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080"]
    );
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
    assert_eq!(frontend(&state, "198.19.0.1", 80, IPPROTO_TCP).flags, 0);
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
    assert_eq!(fe.flags, 0);
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
    assert!(!info("  externalIPs: [\"fd00::9\"]\n", "{port: 80}", "").externally_accessible);
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
            "{addresses: [\"fd00::1\"], nodeName: node-a}",
        )
        .replace("addressType: IPv4", "addressType: IPv6");
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080"]
    );
}

//! The model: Services, EndpointSlices and Pods to frontends and backends.
use std::net::Ipv4Addr;
use std::path::Path;

use proxy_agent::manifests::{load_paths, load_str, Snapshot};
use proxy_agent::model::{
    desired_state, desired_state_with, endpoint_slices_from_pods, DesiredState, Frontend,
    FrontendKey, Gates, HealthCheck, ModelOptions, NodePortAddresses, ServicePortInfo,
    TrafficPolicy,
};
use proxy_common::{svc_flags, IPPROTO_TCP, IPPROTO_UDP, SCOPE_EXTERNAL, SCOPE_INTERNAL};

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
        assert_eq!(fe.flags, 0, "{fe:?}");
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
    assert_eq!(fe.flags, 0);
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
    // Port 0 is skipped (as kube-proxy does), and said: one warning, naming the slice.
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].object, "EndpointSlice default/web-zero");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080"]
    );
}

// ---------------------------------------------------------------------------
// North-south frontends: NodePort, externalIPs, load-balancer IPs.
// ---------------------------------------------------------------------------

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
        .map(|b| format!("{}:{}", b.addr, b.port))
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

/// S10: a NodePort service is served on every InternalIP of this node, with
/// the cluster list, also on a node without a local backend; the same
/// addresses get an internal (pod-originated) entry. Other address types and
/// IPv6 are not NodePort addresses.
#[test]
fn node_port_frontends_on_each_node_address_use_the_cluster_list_s10() {
    let yaml = web_svc("  type: NodePort\n", ", nodePort: 30080", "")
        + &node_addrs(
            "node-a",
            &[
                ("InternalIP", "198.18.0.11"),
                ("InternalIP", "fd00::11"),
                ("ExternalIP", "198.18.0.99"),
                ("InternalIP", "198.18.0.12"),
                ("Hostname", "node-a"),
            ],
        )
        + &web_endpoints(&[("198.18.1.1", "node-b", ""), ("198.18.1.2", "node-c", "")]);
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(state.node_addr, Some(Ipv4Addr::new(198, 18, 0, 11)));
    for ip in ["198.18.0.11", "198.18.0.12"] {
        for scope in [SCOPE_EXTERNAL, SCOPE_INTERNAL] {
            let fe = fe_at(&state, ip, 30080, IPPROTO_TCP, scope);
            assert_eq!(addrs(fe), ["198.18.1.1:8080", "198.18.1.2:8080"]);
            assert_eq!(fe.flags, 0, "{ip} scope {scope}");
            assert_eq!(
                (fe.service.as_str(), fe.port_name.as_str()),
                ("default/web", "http")
            );
            assert!(fe.source_ranges.is_empty());
        }
    }
    // The ClusterIP frontend, and nothing on the ExternalIP address.
    assert_eq!(state.frontends.len(), 5, "{:?}", state.frontends.keys());
    assert!(!has_fe(
        &state,
        "198.18.0.99",
        30080,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
    assert!(!has_fe(
        &state,
        "198.19.0.1",
        80,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
    // No nodePort field (e.g. allocateLoadBalancerNodePorts: false): none.
    let yaml = web_svc("  type: LoadBalancer\n", "", "") + &two_nodes();
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(state.frontends.len(), 1, "{:?}", state.frontends.keys());
}

/// S11: an externalIP is captured whether or not an interface owns it, from
/// outside and from pods; IPv6 externalIPs are not this proxier's, an
/// invalid one warns.
#[test]
fn external_ip_frontend_in_both_scopes_s11() {
    let yaml = web_svc(
        "  externalIPs: [198.18.9.250, \"fd00::fa\", 198.18.9.250, not-an-ip, \"\"]\n",
        "",
        "",
    ) + &web_endpoints(&[("198.18.1.1", "node-b", "")]);
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].message.contains("not-an-ip"), "{warnings:?}");
    for scope in [SCOPE_EXTERNAL, SCOPE_INTERNAL] {
        let fe = fe_at(&state, "198.18.9.250", 80, IPPROTO_TCP, scope);
        assert_eq!(addrs(fe), ["198.18.1.1:8080"]);
        assert_eq!(fe.flags, 0);
    }
    assert_eq!(state.frontends.len(), 3, "{:?}", state.frontends.keys());
}

/// S12 / S39: TCP and UDP on the same service port number, each with its own
/// nodePort, are separate frontends in every scope.
#[test]
fn tcp_and_udp_on_the_same_port_number_are_separate_node_port_frontends_s12_s39() {
    let yaml = "---
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  type: NodePort
  clusterIP: 198.19.0.1
  externalIPs: [198.18.9.250]
  ports:
    - {name: tcp, port: 80, protocol: TCP, nodePort: 30080}
    - {name: udp, port: 80, protocol: UDP, nodePort: 30081}
"
    .to_string()
        + &two_nodes()
        + &slice(
            "web-1",
            "web",
            "{name: tcp, port: 8080, protocol: TCP}, {name: udp, port: 8081, protocol: UDP}",
            "{addresses: [198.18.1.1], nodeName: node-b}",
        );
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    for scope in [SCOPE_EXTERNAL, SCOPE_INTERNAL] {
        let tcp = fe_at(&state, "198.18.0.11", 30080, IPPROTO_TCP, scope);
        assert_eq!(addrs(tcp), ["198.18.1.1:8080"]);
        assert_eq!(tcp.backends[0].proto, IPPROTO_TCP);
        let udp = fe_at(&state, "198.18.0.11", 30081, IPPROTO_UDP, scope);
        assert_eq!(addrs(udp), ["198.18.1.1:8081"]);
        assert_eq!(udp.backends[0].proto, IPPROTO_UDP);
        assert!(!has_fe(&state, "198.18.0.11", 30080, IPPROTO_UDP, scope));
        assert!(!has_fe(&state, "198.18.0.11", 30081, IPPROTO_TCP, scope));
        let ext_tcp = fe_at(&state, "198.18.9.250", 80, IPPROTO_TCP, scope);
        let ext_udp = fe_at(&state, "198.18.9.250", 80, IPPROTO_UDP, scope);
        assert_eq!(addrs(ext_tcp), ["198.18.1.1:8080"]);
        assert_eq!(addrs(ext_udp), ["198.18.1.1:8081"]);
    }
    // 2 ClusterIP + 2 × (NodePort + externalIP) × 2 scopes.
    assert_eq!(state.frontends.len(), 10, "{:?}", state.frontends.keys());
}

/// Load-balancer ingress IPs: captured in VIP mode (`ipMode` missing or
/// `VIP`), not in `Proxy` mode (the load balancer then sends to a NodePort);
/// hostnames and IPv6 are skipped.
#[test]
fn lb_ingress_ip_captured_in_vip_mode_not_in_proxy_mode() {
    let status = "status:
  loadBalancer:
    ingress:
      - {ip: 198.18.9.1}
      - {ip: 198.18.9.2, ipMode: VIP}
      - {ip: 198.18.9.3, ipMode: Proxy}
      - {ip: \"fd00::9\"}
      - {hostname: lb.example.invalid}
";
    let yaml = web_svc(
        "  type: LoadBalancer\n  allocateLoadBalancerNodePorts: false\n",
        "",
        status,
    ) + &web_endpoints(&[("198.18.1.1", "node-b", "")]);
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    for ip in ["198.18.9.1", "198.18.9.2"] {
        for scope in [SCOPE_EXTERNAL, SCOPE_INTERNAL] {
            let fe = fe_at(&state, ip, 80, IPPROTO_TCP, scope);
            assert_eq!(addrs(fe), ["198.18.1.1:8080"]);
            assert_eq!(fe.flags, 0);
        }
    }
    for scope in [SCOPE_EXTERNAL, SCOPE_INTERNAL] {
        assert!(!has_fe(&state, "198.18.9.3", 80, IPPROTO_TCP, scope));
    }
    assert_eq!(state.frontends.len(), 5, "{:?}", state.frontends.keys());
}

/// E2 / S34 / S38 (eTP Local from outside) and E4 / S42 (short-circuit from
/// pods): an `externalTrafficPolicy: Local` LoadBalancer. On the endpoint's
/// node the external frontends carry EXTERNAL_LOCAL and only the local
/// endpoint; on a node without one they drop (DROP_NO_BACKEND) while the
/// internal entries for the same addresses use the whole cluster list.
#[test]
fn external_traffic_policy_local_e2_s34_s42_e4() {
    let yaml = web_svc(
        "  type: LoadBalancer\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 30999\n",
        ", nodePort: 30080",
        "status: {loadBalancer: {ingress: [{ip: 198.18.9.1}]}}\n",
    ) + &two_nodes()
        + &web_endpoints(&[("198.18.1.1", "node-a", ""), ("198.18.1.2", "node-c", "")]);
    let snapshot = snap(&yaml);

    // The endpoint's node: local list, client address kept.
    let (a, warnings) = desired_state(&snapshot, "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    for (ip, port) in [("198.18.0.11", 30080), ("198.18.9.1", 80)] {
        let fe = fe_at(&a, ip, port, IPPROTO_TCP, SCOPE_EXTERNAL);
        assert_eq!(addrs(fe), ["198.18.1.1:8080"], "{ip}");
        assert_eq!(fe.flags, svc_flags::EXTERNAL_LOCAL, "{ip}");
        let inner = fe_at(&a, ip, port, IPPROTO_TCP, SCOPE_INTERNAL);
        assert_eq!(addrs(inner), ["198.18.1.1:8080", "198.18.1.2:8080"]);
        assert_eq!(inner.flags, 0);
    }
    // ClusterIP traffic is not affected by externalTrafficPolicy.
    let cip = fe_at(&a, "198.19.0.1", 80, IPPROTO_TCP, SCOPE_INTERNAL);
    assert_eq!(addrs(cip), ["198.18.1.1:8080", "198.18.1.2:8080"]);
    assert_eq!(a.health_checks[&30999].local_endpoints, 1);

    // A node without a local endpoint: external traffic is dropped, pods'
    // traffic to the same addresses is short-circuited to the cluster list.
    let (b, _) = desired_state(&snapshot, "node-b");
    for (ip, port) in [("198.18.0.12", 30080), ("198.18.9.1", 80)] {
        let fe = fe_at(&b, ip, port, IPPROTO_TCP, SCOPE_EXTERNAL);
        assert!(fe.backends.is_empty(), "{ip}: {:?}", fe.backends);
        assert_eq!(
            fe.flags,
            svc_flags::EXTERNAL_LOCAL | svc_flags::DROP_NO_BACKEND,
            "{ip}"
        );
        let inner = fe_at(&b, ip, port, IPPROTO_TCP, SCOPE_INTERNAL);
        assert_eq!(addrs(inner), ["198.18.1.1:8080", "198.18.1.2:8080"]);
        assert_eq!(inner.flags, 0);
    }
    // Only this node's address carries the NodePort.
    assert!(!has_fe(
        &b,
        "198.18.0.11",
        30080,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
    assert_eq!(b.health_checks[&30999].local_endpoints, 0);

    // No endpoint anywhere: reject (no flag but EXTERNAL_LOCAL).
    let (none, _) = desired_state(
        &snap(
            &(web_svc(
                "  type: NodePort\n  externalTrafficPolicy: Local\n",
                ", nodePort: 30080",
                "",
            ) + &two_nodes()),
        ),
        "node-a",
    );
    let fe = fe_at(&none, "198.18.0.11", 30080, IPPROTO_TCP, SCOPE_EXTERNAL);
    assert_eq!(fe.flags, svc_flags::EXTERNAL_LOCAL);
    let inner = fe_at(&none, "198.18.0.11", 30080, IPPROTO_TCP, SCOPE_INTERNAL);
    assert_eq!(inner.flags, 0);
}

/// S37 / S38: with nothing ready, external frontends fall back to serving
/// terminating endpoints: cluster-wide with eTP Cluster, local ones with eTP
/// Local (a node without one drops).
#[test]
fn external_frontends_fall_back_to_terminating_endpoints_s37_s38() {
    let terminating = ", conditions: {ready: false, serving: true, terminating: true}";
    let endpoints = web_endpoints(&[("198.18.1.1", "node-a", terminating)]);
    let cluster =
        web_svc("  type: NodePort\n", ", nodePort: 30080", "") + &two_nodes() + &endpoints;
    for n in ["node-a", "node-b"] {
        let (state, _) = desired_state(&snap(&cluster), n);
        let ip = if n == "node-a" {
            "198.18.0.11"
        } else {
            "198.18.0.12"
        };
        let fe = fe_at(&state, ip, 30080, IPPROTO_TCP, SCOPE_EXTERNAL);
        assert_eq!(addrs(fe), ["198.18.1.1:8080"], "{n}");
        assert_eq!(fe.flags, 0);
    }
    let local = web_svc(
        "  type: NodePort\n  externalTrafficPolicy: Local\n",
        ", nodePort: 30080",
        "",
    ) + &two_nodes()
        + &endpoints;
    let (a, _) = desired_state(&snap(&local), "node-a");
    let fe = fe_at(&a, "198.18.0.11", 30080, IPPROTO_TCP, SCOPE_EXTERNAL);
    assert_eq!(addrs(fe), ["198.18.1.1:8080"]);
    assert_eq!(fe.flags, svc_flags::EXTERNAL_LOCAL);
    let (b, _) = desired_state(&snap(&local), "node-b");
    let fe = fe_at(&b, "198.18.0.12", 30080, IPPROTO_TCP, SCOPE_EXTERNAL);
    assert!(fe.backends.is_empty());
    assert_eq!(
        fe.flags,
        svc_flags::EXTERNAL_LOCAL | svc_flags::DROP_NO_BACKEND
    );
    // The terminating endpoint stays retained where it is not selectable.
    assert_eq!(
        fe.retained
            .iter()
            .map(|b| format!("{}:{}", b.addr, b.port))
            .collect::<Vec<_>>(),
        ["198.18.1.1:8080"]
    );
}

/// `loadBalancerSourceRanges` apply to the external load-balancer-IP
/// frontends only (not NodePorts, externalIPs or the internal entries):
/// parsed, host bits cleared, deduplicated, IPv6 skipped, an invalid entry
/// ignored with a warning.
#[test]
fn source_ranges_apply_to_lb_frontends_only_and_invalid_entries_warn() {
    let yaml = web_svc(
        "  type: LoadBalancer
  externalIPs: [198.18.9.250]
  loadBalancerSourceRanges: [\"198.18.4.7/24\", \" 198.18.8.0/22 \", \"fd00::/64\", not-a-cidr, \"198.18.4.0/24\", \"\"]
",
        ", nodePort: 30080",
        "status: {loadBalancer: {ingress: [{ip: 198.18.9.1}]}}\n",
    ) + &two_nodes()
        + &web_endpoints(&[("198.18.1.1", "node-a", "")]);
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].object, "Service default/web");
    assert!(warnings[0].message.contains("not-a-cidr"), "{warnings:?}");

    let lb = fe_at(&state, "198.18.9.1", 80, IPPROTO_TCP, SCOPE_EXTERNAL);
    assert_eq!(lb.flags, svc_flags::SOURCE_RANGES);
    assert_eq!(
        lb.source_ranges,
        [
            (Ipv4Addr::new(198, 18, 4, 0), 24),
            (Ipv4Addr::new(198, 18, 8, 0), 22)
        ]
    );
    for (ip, port, scope) in [
        ("198.18.9.1", 80, SCOPE_INTERNAL),
        ("198.18.9.250", 80, SCOPE_EXTERNAL),
        ("198.18.9.250", 80, SCOPE_INTERNAL),
        ("198.18.0.11", 30080, SCOPE_EXTERNAL),
        ("198.18.0.11", 30080, SCOPE_INTERNAL),
        ("198.19.0.1", 80, SCOPE_INTERNAL),
    ] {
        let fe = fe_at(&state, ip, port, IPPROTO_TCP, scope);
        assert_eq!(fe.flags, 0, "{ip}:{port} scope {scope}");
        assert!(fe.source_ranges.is_empty(), "{ip}:{port} scope {scope}");
    }

    // Only IPv6 ranges: nothing of this family, no filtering.
    let yaml = web_svc(
        "  type: LoadBalancer\n  loadBalancerSourceRanges: [\"fd00::/64\"]\n",
        ", nodePort: 30080",
        "status: {loadBalancer: {ingress: [{ip: 198.18.9.1}]}}\n",
    ) + &two_nodes();
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    let lb = fe_at(&state, "198.18.9.1", 80, IPPROTO_TCP, SCOPE_EXTERNAL);
    assert_eq!((lb.flags, lb.source_ranges.len()), (0, 0));
}

#[test]
fn node_port_addresses_parse() {
    assert_eq!(
        NodePortAddresses::parse("primary"),
        Ok(NodePortAddresses::Primary)
    );
    assert_eq!(
        NodePortAddresses::parse("198.18.2.7/24"),
        Ok(NodePortAddresses::Cidr(Ipv4Addr::new(198, 18, 2, 0), 24))
    );
    assert_eq!(
        NodePortAddresses::parse(" 198.18.2.7/32 "),
        Ok(NodePortAddresses::Cidr(Ipv4Addr::new(198, 18, 2, 7), 32))
    );
    assert_eq!(
        NodePortAddresses::parse("0.0.0.0/0"),
        Ok(NodePortAddresses::Cidr(Ipv4Addr::UNSPECIFIED, 0))
    );
    // Leading zeros are decimal, as in Go's ParseCIDRSloppy.
    assert_eq!(
        "198.018.002.0/24".parse::<NodePortAddresses>(),
        Ok(NodePortAddresses::Cidr(Ipv4Addr::new(198, 18, 2, 0), 24))
    );
    assert_eq!(
        NodePortAddresses::parse("fd00::/64"),
        Ok(NodePortAddresses::Ipv6Cidr)
    );
    for bad in [
        "",
        "Primary",
        "198.18.0.0",
        "198.18.0.0/33",
        "198.18.0.0/",
        "198.18.0/16",
        "198.18.0.256/24",
        "fd00::/129",
        "x/8",
    ] {
        assert!(NodePortAddresses::parse(bad).is_err(), "{bad:?} accepted");
    }
    assert_eq!(
        NodePortAddresses::Cidr(Ipv4Addr::new(198, 18, 2, 0), 24).to_string(),
        "198.18.2.0/24"
    );
}

/// `nodePortAddresses`: a CIDR selects the node's InternalIPs inside it,
/// `primary` the first InternalIP; a list of only IPv6 CIDRs falls back to
/// every InternalIP (kube-proxy's IPv4 proxier uses 0.0.0.0/0 then).
#[test]
fn node_port_addresses_cidr_filter_and_primary() {
    let yaml = web_svc("  type: NodePort\n", ", nodePort: 30080", "")
        + &node_addrs(
            "node-a",
            &[
                ("InternalIP", "198.18.0.11"),
                ("InternalIP", "198.18.2.5"),
                ("InternalIP", "198.18.3.5"),
            ],
        );
    let snapshot = snap(&yaml);
    let node_ports = |entries: &[&str]| {
        let opts = ModelOptions {
            node_port_addresses: entries
                .iter()
                .map(|e| NodePortAddresses::parse(e).unwrap())
                .collect(),
            ..ModelOptions::default()
        };
        let (state, warnings) = desired_state_with(&snapshot, "node-a", &opts);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(state.node_addr, Some(Ipv4Addr::new(198, 18, 0, 11)));
        let ext: Vec<String> = state
            .frontends
            .keys()
            .filter(|k| k.scope == SCOPE_EXTERNAL)
            .map(|k| format!("{}:{}", k.addr, k.port))
            .collect();
        let int: Vec<String> = state
            .frontends
            .keys()
            .filter(|k| k.scope == SCOPE_INTERNAL && k.port == 30080)
            .map(|k| format!("{}:{}", k.addr, k.port))
            .collect();
        assert_eq!(ext, int, "{entries:?}: internal entries differ");
        ext
    };
    let all = ["198.18.0.11:30080", "198.18.2.5:30080", "198.18.3.5:30080"];
    assert_eq!(node_ports(&[]), all);
    assert_eq!(node_ports(&["198.18.2.0/24"]), ["198.18.2.5:30080"]);
    assert_eq!(
        node_ports(&["198.18.2.0/24", "198.18.3.5/32", "198.18.0.0/16"]),
        all
    );
    assert_eq!(node_ports(&["primary"]), ["198.18.0.11:30080"]);
    assert_eq!(
        node_ports(&["primary", "198.18.3.0/24", "fd00::/64"]),
        ["198.18.0.11:30080", "198.18.3.5:30080"]
    );
    assert!(node_ports(&["198.18.200.0/24"]).is_empty());
    assert_eq!(node_ports(&["fd00::/64"]), all);
}

/// Without a Node object, or one without an IPv4 InternalIP, there is no
/// NodePort address: no NodePort frontends, one warning however many ports
/// have a nodePort, and no SNAT address; everything else is built.
#[test]
fn node_without_node_object_or_address_has_no_node_ports_and_warns_once() {
    let services = web_svc(
        "  type: NodePort\n  externalIPs: [198.18.9.250]\n",
        ", nodePort: 30080",
        "",
    ) + &web_svc("  type: NodePort\n", ", nodePort: 30081", "")
        .replace("name: web", "name: web2")
        .replace("198.19.0.1", "198.19.0.2");
    for (yaml, why) in [
        (services.clone(), "no Node object"),
        (
            services.clone()
                + &node_addrs(
                    "node-a",
                    &[("ExternalIP", "198.18.0.99"), ("InternalIP", "fd00::11")],
                ),
            "no IPv4 InternalIP",
        ),
        (
            services.clone() + &node_addrs("node-b", &[("InternalIP", "198.18.0.12")]),
            "no Node object",
        ),
    ] {
        let (state, warnings) = desired_state(&snap(&yaml), "node-a");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert_eq!(warnings[0].object, "Node node-a");
        assert!(warnings[0].message.contains(why), "{warnings:?}");
        assert_eq!(state.node_addr, None);
        assert!(state
            .frontends
            .keys()
            .all(|k| k.port != 30080 && k.port != 30081));
        assert!(has_fe(
            &state,
            "198.18.9.250",
            80,
            IPPROTO_TCP,
            SCOPE_EXTERNAL
        ));
        assert!(has_fe(
            &state,
            "198.19.0.2",
            80,
            IPPROTO_TCP,
            SCOPE_INTERNAL
        ));
    }
    // No nodePort anywhere: nothing to warn about.
    let (_, warnings) = desired_state(&snap(WEB), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
}

/// S34 / S42: a LoadBalancer with eTP Local has a health check counting this
/// node's READY endpoints (distinct addresses over all ports). A local
/// endpoint that is only terminating does not count (503) though it still
/// carries the NodePort's traffic. No health check with eTP Cluster, without
/// a healthCheckNodePort, or for a type other than LoadBalancer.
#[test]
fn health_checks_count_ready_local_endpoints_only_s34() {
    let lb = |spec: &str| {
        format!(
            "---
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
  type: LoadBalancer
  clusterIP: 198.19.0.1
{spec}  ports: [{{name: http, port: 80, nodePort: 30080}}, {{name: alt, port: 81, nodePort: 30081}}]
"
        )
    };
    let local = lb("  externalTrafficPolicy: Local\n  healthCheckNodePort: 30999\n");
    let endpoints = |list: &str| {
        slice(
            "web-1",
            "web",
            "{name: http, port: 8080}, {name: alt, port: 8081}",
            list,
        )
    };
    let ready = endpoints(
        "{addresses: [198.18.1.1], nodeName: node-a},
         {addresses: [198.18.1.2], nodeName: node-a, conditions: {ready: false}},
         {addresses: [198.18.1.3], nodeName: node-a, conditions: {ready: false, serving: true, terminating: true}},
         {addresses: [198.18.1.4], nodeName: node-b}",
    );
    let (state, warnings) =
        desired_state(&snap(&(local.clone() + &two_nodes() + &ready)), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(state.health_checks.len(), 1);
    assert_eq!(
        state.health_checks[&30999],
        HealthCheck {
            service: "default/web".into(),
            local_endpoints: 1,
        }
    );

    // The only local endpoint is terminating: 0 (503), while the NodePort
    // still sends to it.
    let terminating = endpoints(
        "{addresses: [198.18.1.3], nodeName: node-a, conditions: {ready: false, serving: true, terminating: true}},
         {addresses: [198.18.1.4], nodeName: node-b}",
    );
    let (state, _) = desired_state(
        &snap(&(local.clone() + &two_nodes() + &terminating)),
        "node-a",
    );
    assert_eq!(state.health_checks[&30999].local_endpoints, 0);
    let fe = fe_at(&state, "198.18.0.11", 30080, IPPROTO_TCP, SCOPE_EXTERNAL);
    assert_eq!(addrs(fe), ["198.18.1.3:8080"]);
    assert_eq!(fe.flags, svc_flags::EXTERNAL_LOCAL);

    // On another node: 0.
    let (state, _) = desired_state(&snap(&(local + &two_nodes() + &ready)), "node-c");
    assert_eq!(state.health_checks[&30999].local_endpoints, 0);

    for spec in [
        "  externalTrafficPolicy: Cluster\n  healthCheckNodePort: 30999\n",
        "  externalTrafficPolicy: Local\n",
    ] {
        let (state, _) = desired_state(&snap(&(lb(spec) + &two_nodes() + &ready)), "node-a");
        assert!(state.health_checks.is_empty(), "{spec}");
    }
    let node_port = web_svc(
        "  type: NodePort\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 30999\n",
        ", nodePort: 30080",
        "",
    );
    let (state, _) = desired_state(&snap(&(node_port + &two_nodes())), "node-a");
    assert!(state.health_checks.is_empty());
}

/// `local_endpoints`: the address of every endpoint on this node, whatever
/// its conditions or Service, from slices and from Pods; none elsewhere.
#[test]
fn local_endpoints_are_every_endpoint_on_this_node() {
    let yaml = WEB.to_string()
        + &web_endpoints(&[
            ("198.18.1.1", "node-a", ""),
            ("198.18.1.2", "node-a", ", conditions: {ready: false}"),
            ("198.18.1.3", "node-b", ""),
        ])
        + &slice(
            "orphan-1",
            "no-such-service",
            "{port: 80}",
            "{addresses: [198.18.1.4], nodeName: node-a}, {addresses: [198.18.1.5]}",
        )
        + &slice(
            "web-v6",
            "web",
            "{name: http, port: 8080}",
            "{addresses: [\"fd00::1\"], nodeName: node-a}",
        )
        .replace("addressType: IPv4", "addressType: IPv6")
        + &pod("p1", "app: web", "198.18.1.6", "")
        + "---
apiVersion: v1
kind: Service
metadata: {name: sel}
spec:
  clusterIP: 198.19.0.2
  selector: {app: web}
  ports: [{port: 80}]
";
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    let expected: Vec<Ipv4Addr> = ["198.18.1.1", "198.18.1.2", "198.18.1.4", "198.18.1.6"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(
        state.local_endpoints.iter().copied().collect::<Vec<_>>(),
        expected
    );
    let (other, _) = desired_state(&snap(&yaml), "node-b");
    assert_eq!(
        other.local_endpoints.iter().copied().collect::<Vec<_>>(),
        [Ipv4Addr::new(198, 18, 1, 3)]
    );
    assert_eq!(other.node_addr, None);
}

/// An externalIP or load-balancer IP equal to another Service's ClusterIP
/// does not take the ClusterIP frontend over: the first Service keeps it and
/// the other's entry is skipped with a warning; its external entry stays.
#[test]
fn external_address_colliding_with_another_service_warns() {
    let yaml = web_svc("", "", "")
        + &web_svc("  externalIPs: [198.19.0.1]\n", "", "")
            .replace("name: web", "name: zz")
            .replace("clusterIP: 198.19.0.1", "clusterIP: 198.19.0.2");
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].object, "Service default/zz");
    assert_eq!(
        fe_at(&state, "198.19.0.1", 80, IPPROTO_TCP, SCOPE_INTERNAL).service,
        "default/web"
    );
    assert_eq!(
        fe_at(&state, "198.19.0.1", 80, IPPROTO_TCP, SCOPE_EXTERNAL).service,
        "default/zz"
    );
    assert!(!state.frontends.contains_key(&ext("198.19.0.2", 80)));
}

/// Two Services claiming one ClusterIP (a mistake an API server would refuse):
/// the one that owns the frontend now keeps it, whatever the names' order;
/// the newcomer is skipped with a warning naming it.
#[test]
fn colliding_cluster_ip_stays_with_its_current_owner() {
    let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: zzz-old}\nspec: {clusterIP: 198.19.0.10, ports: [{port: 80}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: aaa-new}\nspec: {clusterIP: 198.19.0.10, ports: [{port: 80}]}\n";
    let (mut snap, mut errs) = (proxy_agent::manifests::Snapshot::default(), Vec::new());
    proxy_agent::manifests::load_str(std::path::Path::new("c.yaml"), yaml, &mut snap, &mut errs);
    assert!(errs.is_empty());
    let key = proxy_agent::model::FrontendKey {
        addr: "198.19.0.10".parse().unwrap(),
        port: 80,
        proto: proxy_common::IPPROTO_TCP,
        scope: proxy_common::SCOPE_INTERNAL,
    };
    // Nobody owns it yet: the first by namespace/name.
    let (d, w) = proxy_agent::model::desired_state(&snap, "node-1");
    assert_eq!(d.frontends[&key].service, "default/aaa-new");
    assert_eq!(w.len(), 1);
    // zzz-old owns it: it keeps it, and the warning names aaa-new.
    let opts = proxy_agent::model::ModelOptions {
        current_owners: [(key, "default/zzz-old".to_string())].into_iter().collect(),
        ..Default::default()
    };
    let (d, w) = proxy_agent::model::desired_state_with(&snap, "node-1", &opts);
    assert_eq!(d.frontends[&key].service, "default/zzz-old");
    assert_eq!(w.len(), 1);
    assert!(w[0].object.contains("aaa-new"), "{w:?}");
}

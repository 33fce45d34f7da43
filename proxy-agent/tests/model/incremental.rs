//! The incremental model against a computation from scratch: a long seeded
//! random sequence of Service, EndpointSlice, Pod and Node changes, each
//! applied alone to one [`Incremental`]; after every change its desired state
//! must equal [`desired_state_with`] of all its objects, and the change it
//! reports must name every frontend and local endpoint that changed.
//!
//! The objects are drawn from small pools (a few addresses, ports, names,
//! timestamps) so that Services contest frontends and health-check ports,
//! slices move between Services, endpoints move between nodes and the
//! node's own Node object changes under everything.
use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proxy_agent::model::{
    desired_state_with, Change, DesiredState, FrontendPolicy, Incremental, Kind, ModelOptions,
    Object,
};
use serde_json::json;

use crate::fuzz::Rng;

const NAMESPACES: [&str; 3] = ["default", "a", "a-b"];
const SERVICES: [&str; 5] = ["web", "api", "db", "x", "web-2"];
const VIPS: [&str; 5] = [
    "198.19.0.1",
    "198.19.0.2",
    "198.19.0.3",
    "198.19.0.4",
    "not-an-ip",
];
const EXTERNAL: [&str; 3] = ["198.19.1.1", "198.19.1.2", "198.18.9.1"];
const ENDPOINTS: [&str; 6] = [
    "198.18.1.1",
    "198.18.1.2",
    "198.18.1.3",
    "198.18.1.4",
    "198.18.9.1",
    "bad",
];
const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];
const CREATED: [Option<&str>; 3] = [
    None,
    Some("2026-01-01T00:00:00Z"),
    Some("2026-02-01T00:00:00Z"),
];

fn service(r: &mut Rng) -> Service {
    let ns = *r.pick(&NAMESPACES);
    let name = *r.pick(&SERVICES);
    let type_ = *r.pick(&["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]);
    let mut ports = Vec::new();
    for (i, pname) in ["http", "dns"].iter().enumerate().take(1 + r.below(2)) {
        let proto = if r.chance(25) { "UDP" } else { "TCP" };
        let mut p = json!({"name": pname, "port": 80 + i, "protocol": proto, "targetPort": 8080 + r.below(2)});
        if type_ != "ClusterIP" && r.chance(80) {
            p["nodePort"] = json!(30080 + r.below(3));
        }
        ports.push(p);
    }
    let vip = *r.pick(&VIPS);
    let mut spec = json!({
        "type": type_,
        "clusterIP": vip,
        "clusterIPs": [vip],
        "ports": ports,
        "externalTrafficPolicy": *r.pick(&["Cluster", "Local"]),
        "internalTrafficPolicy": *r.pick(&["Cluster", "Local"]),
    });
    if r.chance(30) {
        spec["externalIPs"] = json!([*r.pick(&EXTERNAL)]);
    }
    if r.chance(40) {
        spec["selector"] = json!({"app": *r.pick(&["one", "two"])});
    }
    if r.chance(20) {
        spec["sessionAffinity"] = json!("ClientIP");
    }
    if type_ == "LoadBalancer" && r.chance(60) {
        spec["healthCheckNodePort"] = json!(32000 + r.below(2));
    }
    let mut svc = json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    });
    if let Some(t) = r.pick(&CREATED) {
        svc["metadata"]["creationTimestamp"] = json!(t);
    }
    if type_ == "LoadBalancer" && r.chance(60) {
        svc["status"] = json!({"loadBalancer": {"ingress": [{"ip": *r.pick(&EXTERNAL)}]}});
    }
    if r.chance(10) {
        svc["metadata"]["labels"] = json!({"service.kubernetes.io/headless": ""});
    }
    serde_json::from_value(svc).expect("service")
}

fn slice(r: &mut Rng) -> EndpointSlice {
    let ns = *r.pick(&NAMESPACES);
    let svc = *r.pick(&SERVICES);
    let name = format!("{svc}-{}", r.below(2));
    let mut endpoints = Vec::new();
    for _ in 0..r.below(4) {
        let mut e = json!({
            "addresses": [*r.pick(&ENDPOINTS)],
            "conditions": {"ready": r.chance(70), "serving": r.chance(80), "terminating": r.chance(20)},
        });
        if r.chance(80) {
            e["nodeName"] = json!(*r.pick(&NODES));
        }
        if r.chance(20) {
            e["hints"] = json!({"forZones": [{"name": *r.pick(&["z1", "z2"])}]});
        }
        endpoints.push(e);
    }
    let ports: Vec<_> = ["http", "dns"]
        .iter()
        .take(1 + r.below(2))
        .map(|p| json!({"name": p, "port": 8080, "protocol": if *p == "dns" && r.chance(50) { "UDP" } else { "TCP" }}))
        .collect();
    // A slice may move to another Service (its label changes).
    let label = if r.chance(85) {
        svc
    } else {
        *r.pick(&SERVICES)
    };
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": label}},
        "addressType": if r.chance(90) { "IPv4" } else { "IPv6" },
        "endpoints": endpoints,
        "ports": ports,
    }))
    .expect("slice")
}

fn pod(r: &mut Rng) -> Pod {
    let ns = *r.pick(&NAMESPACES);
    let mut pod = json!({
        "metadata": {"name": format!("p{}", r.below(4)), "namespace": ns, "labels": {"app": *r.pick(&["one", "two"])}},
        "spec": {"nodeName": *r.pick(&NODES), "containers": []},
        "status": {"podIP": *r.pick(&ENDPOINTS), "conditions": [{"type": "Ready", "status": if r.chance(80) { "True" } else { "False" }}]},
    });
    if r.chance(10) {
        pod["metadata"]["deletionTimestamp"] = json!("2026-03-01T00:00:00Z");
    }
    serde_json::from_value(pod).expect("pod")
}

fn node(r: &mut Rng) -> Node {
    let name = *r.pick(&NODES);
    let mut addresses = Vec::new();
    if r.chance(85) {
        addresses
            .push(json!({"type": "InternalIP", "address": *r.pick(&["198.18.9.1", "198.18.9.2"])}));
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": *r.pick(&["z1", "z2"])}},
        "status": {"addresses": addresses},
    }))
    .expect("node")
}

fn change(r: &mut Rng, model: &Incremental) -> Change {
    let snapshot = model.snapshot();
    let key = |meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        (
            meta.namespace.clone().unwrap_or_default(),
            meta.name.clone().unwrap_or_default(),
        )
    };
    if r.chance(25) {
        match r.below(4) {
            0 if !snapshot.services.is_empty() => {
                let s = r.pick(&snapshot.services);
                return Change::Deleted(Kind::Service, key(&s.metadata));
            }
            1 if !snapshot.endpoint_slices.is_empty() => {
                let s = r.pick(&snapshot.endpoint_slices);
                return Change::Deleted(Kind::EndpointSlice, key(&s.metadata));
            }
            2 if !snapshot.pods.is_empty() => {
                let p = r.pick(&snapshot.pods);
                return Change::Deleted(Kind::Pod, key(&p.metadata));
            }
            3 if !snapshot.nodes.is_empty() => {
                let n = r.pick(&snapshot.nodes);
                return Change::Deleted(
                    Kind::Node,
                    (String::new(), n.metadata.name.clone().unwrap()),
                );
            }
            _ => {}
        }
    }
    Change::Applied(match r.below(10) {
        0..=3 => Object::Service(std::sync::Arc::new(service(r))),
        4..=7 => Object::EndpointSlice(std::sync::Arc::new(slice(r))),
        8 => Object::Pod(std::sync::Arc::new(pod(r))),
        _ => Object::Node(std::sync::Arc::new(node(r))),
    })
}

/// What differs between two desired states, by frontend key and local
/// endpoint.
fn differences(a: &DesiredState, b: &DesiredState) -> (BTreeSet<String>, BTreeSet<String>) {
    let keys: BTreeSet<_> = a.frontends.keys().chain(b.frontends.keys()).collect();
    let frontends = keys
        .into_iter()
        .filter(|k| a.frontends.get(k) != b.frontends.get(k))
        .map(|k| k.to_string())
        .collect();
    let local = a
        .local_endpoints
        .symmetric_difference(&b.local_endpoints)
        .map(|a| a.to_string())
        .collect();
    (frontends, local)
}

fn run(seed: u64, steps: usize, opts: ModelOptions) {
    let mut r = Rng::new(seed);
    let mut model = Incremental::new("node-a", opts.clone());
    let mut frontends_seen = 0;
    for step in 0..steps {
        let before = model.desired().clone();
        let c = change(&mut r, &model);
        let what = format!("{c:?}");
        let update = model.apply([c]);
        // From scratch, with the owners the incremental model had before
        // the change (the one input of history: among Services without a
        // creationTimestamp, the current owner keeps a frontend).
        let mut full_opts = opts.clone();
        full_opts.current_owners = before
            .frontends
            .iter()
            .map(|(k, f)| (*k, f.service.clone()))
            .collect();
        let (full, _) = desired_state_with(&model.snapshot(), "node-a", &full_opts);
        let now = model.desired();
        assert_eq!(
            differences(now, &full),
            Default::default(),
            "seed {seed} step {step}: incremental and full differ after {what}"
        );
        assert_eq!(now.node_addr, full.node_addr, "seed {seed} step {step}");
        assert_eq!(
            now.health_checks, full.health_checks,
            "seed {seed} step {step}: {what}"
        );
        assert_eq!(
            now.service_order, full.service_order,
            "seed {seed} step {step}"
        );
        // The update names everything that changed (the writer touches
        // only those).
        let (changed, local) = differences(&before, now);
        let named: BTreeSet<String> = update.frontends.iter().map(|k| k.to_string()).collect();
        assert!(
            changed.is_subset(&named),
            "seed {seed} step {step}: changed {changed:?}, update named {named:?} after {what}"
        );
        let named: BTreeSet<String> = update
            .local_endpoints
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(
            local, named,
            "seed {seed} step {step}: local endpoints after {what}"
        );
        if before.health_checks != now.health_checks || before.node_addr != now.node_addr {
            assert!(update.other, "seed {seed} step {step}: {what}");
        }
        frontends_seen = frontends_seen.max(now.frontends.len());
    }
    // The sequence was not trivial.
    assert!(
        frontends_seen >= 10,
        "seed {seed}: at most {frontends_seen} frontends"
    );
}

#[test]
fn incremental_changes_give_what_a_full_recompute_gives() {
    for seed in [1, 2, 3, 0x5eed, 0xdead_beef] {
        run(seed, 600, ModelOptions::default());
    }
}

#[test]
fn incremental_changes_give_what_a_full_recompute_gives_with_a_frontend_limit() {
    let opts = ModelOptions {
        localhost_node_ports: true,
        frontend_policy: FrontendPolicy {
            max_frontends_per_service: 3,
            ..FrontendPolicy::default()
        },
        ..ModelOptions::default()
    };
    for seed in [7, 8] {
        run(seed, 600, opts.clone());
    }
}

#[test]
fn a_change_recomputes_only_the_services_it_concerns() {
    let mut r = Rng::new(42);
    let mut model = Incremental::new("node-a", ModelOptions::default());
    let mut changes = Vec::new();
    for i in 0..200 {
        let mut svc = service(&mut r);
        svc.metadata.name = Some(format!("svc-{i}"));
        svc.metadata.namespace = Some("default".into());
        changes.push(Change::Applied(Object::Service(std::sync::Arc::new(svc))));
    }
    let update = model.apply(changes);
    assert_eq!(update.services, 200);
    // One slice: its Service alone.
    let mut s = slice(&mut r);
    s.metadata.namespace = Some("default".into());
    s.metadata.labels = Some(
        [(
            "kubernetes.io/service-name".to_string(),
            "svc-7".to_string(),
        )]
        .into(),
    );
    let update = model.apply([Change::Applied(Object::EndpointSlice(std::sync::Arc::new(
        s.clone(),
    )))]);
    assert_eq!(update.services, 1, "{update:?}");
    // The same object again: nothing.
    let update = model.apply([Change::Applied(Object::EndpointSlice(std::sync::Arc::new(
        s,
    )))]);
    assert!(update.is_empty() && update.services == 0, "{update:?}");
    // Another node's Node object: nothing.
    let mut n = node(&mut r);
    n.metadata.name = Some("node-b".into());
    let update = model.apply([Change::Applied(Object::Node(std::sync::Arc::new(n)))]);
    assert_eq!(update.services, 0, "{update:?}");
}

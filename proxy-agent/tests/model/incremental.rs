//! The incremental model against a computation from scratch: a long seeded
//! random sequence of Service, EndpointSlice, Pod and Node changes, each
//! applied alone to one [`Incremental`]; after every change its desired state
//! must equal that of a model built from scratch from all its objects, and the change it
//! reports must name every frontend and local endpoint that changed.
//!
//! The objects are drawn from small pools (a few addresses, ports, names,
//! timestamps) so that Services contest frontends and health-check ports,
//! slices move between Services, endpoints move between nodes and the
//! node's own Node object changes under everything. Both families: IPv4,
//! IPv6 and dual-stack Services (with each `ipFamilyPolicy`), IPv4 and IPv6
//! slices and pods, externalIPs, load-balancer IPs and source ranges of
//! either family, and node addresses of either or both.
use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proxy_agent::model::{
    Change, DesiredState, FrontendPolicy, Incremental, Kind, ModelOptions, Object,
};
use serde_json::json;

use proxy_testkit::fuzz::Rng;

const NAMESPACES: [&str; 3] = ["default", "a", "a-b"];
const SERVICES: [&str; 5] = ["web", "api", "db", "x", "web-2"];
const VIPS: [&str; 5] = [
    "198.19.0.1",
    "198.19.0.2",
    "198.19.0.3",
    "198.19.0.4",
    "not-an-ip",
];
const VIPS6: [&str; 4] = ["2001:2::19:1", "2001:2::19:2", "2001:2::19:3", "bad::v6::"];
const EXTERNAL: [&str; 6] = [
    "198.19.1.1",
    "198.19.1.2",
    "198.18.9.1",
    "2001:2::1:1",
    "2001:2::1:2",
    "2001:2::9:1",
];
const ENDPOINTS6: [&str; 5] = [
    "2001:2::18:1",
    "2001:2::18:2",
    "2001:2::18:3",
    "2001:2::9:1",
    "198.18.1.1",
];
const SOURCE_RANGES: [&str; 4] = [
    "198.18.4.0/24",
    "2001:2::/64",
    "2001:2::4:7/112",
    "0.0.0.0/0",
];
const NODE_PORT_ADDRESSES: [&str; 4] =
    ["198.18.9.0/24", "2001:2::9:0/112", "primary", "2001:2::/48"];
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
    // IPv4, IPv6 or dual-stack (either family first).
    let vip = *r.pick(&VIPS);
    let vip6 = *r.pick(&VIPS6);
    let (ips, families): (Vec<&str>, Vec<&str>) = match r.below(5) {
        0 | 1 => (vec![vip], vec!["IPv4"]),
        2 => (vec![vip6], vec!["IPv6"]),
        3 => (vec![vip, vip6], vec!["IPv4", "IPv6"]),
        _ => (vec![vip6, vip], vec!["IPv6", "IPv4"]),
    };
    let mut spec = json!({
        "type": type_,
        "clusterIP": ips[0],
        "clusterIPs": ips,
        "ports": ports,
        "externalTrafficPolicy": *r.pick(&["Cluster", "Local"]),
        "internalTrafficPolicy": *r.pick(&["Cluster", "Local"]),
    });
    if r.chance(60) {
        spec["ipFamilies"] = json!(families);
        spec["ipFamilyPolicy"] =
            json!(*r.pick(&["SingleStack", "PreferDualStack", "RequireDualStack"]));
    }
    if r.chance(30) {
        spec["externalIPs"] = json!([*r.pick(&EXTERNAL), *r.pick(&EXTERNAL)]);
    }
    if type_ == "LoadBalancer" && r.chance(30) {
        spec["loadBalancerSourceRanges"] = json!([*r.pick(&SOURCE_RANGES)]);
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
    let v6 = r.chance(30);
    let pool: &[&str] = if v6 { &ENDPOINTS6 } else { &ENDPOINTS };
    let mut endpoints = Vec::new();
    for _ in 0..r.below(4) {
        let mut e = json!({
            "addresses": [*r.pick(pool)],
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
        "addressType": match (v6, r.chance(5)) {
            (_, true) => "FQDN",
            (true, _) => "IPv6",
            (false, _) => "IPv4",
        },
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
    // IPv6-only or dual-stack pods.
    match r.below(4) {
        0 => pod["status"]["podIP"] = json!(*r.pick(&ENDPOINTS6)),
        1 => {
            let ips = [pod["status"]["podIP"].clone(), json!(*r.pick(&ENDPOINTS6))];
            pod["status"]["podIPs"] = json!([{"ip": ips[0]}, {"ip": ips[1]}]);
        }
        _ => {}
    }
    if r.chance(10) {
        pod["metadata"]["deletionTimestamp"] = json!("2026-03-01T00:00:00Z");
    }
    serde_json::from_value(pod).expect("pod")
}

fn node(r: &mut Rng) -> Node {
    let name = *r.pick(&NODES);
    let mut addresses = Vec::new();
    if r.chance(75) {
        addresses
            .push(json!({"type": "InternalIP", "address": *r.pick(&["198.18.9.1", "198.18.9.2"])}));
    }
    if r.chance(60) {
        addresses.push(
            json!({"type": "InternalIP", "address": *r.pick(&["2001:2::9:1", "2001:2::9:2"])}),
        );
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": *r.pick(&["z1", "z2"])}},
        "status": {"addresses": addresses},
    }))
    .expect("node")
}

fn change(r: &mut Rng, model: &Incremental) -> Change {
    if r.chance(25) {
        let kind = [Kind::Service, Kind::EndpointSlice, Kind::Pod, Kind::Node][r.below(4)];
        let held: Vec<Object> = model
            .objects()
            .into_iter()
            .filter(|o| o.kind() == kind)
            .collect();
        if !held.is_empty() {
            return Change::Deleted(kind, r.pick(&held).key());
        }
    }
    Change::Applied(match r.below(10) {
        0..=3 => Object::from(&service(r)),
        4..=7 => Object::from(&slice(r)),
        8 => Object::from(pod(r)),
        _ => Object::from(node(r)),
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

/// Addresses on the node's external interfaces: an InternalIP, VIPs of
/// both families (one of them an externalIP of the pool), a link-local one
/// (never used).
const IFACE_ADDRS: [&str; 5] = [
    "198.18.9.1",
    "198.18.9.61",
    "198.19.1.1",
    "2001:2::9:61",
    "169.254.9.9",
];

/// Now and then (its own sequence, so that the objects' stay as they were)
/// a new set of interface addresses: a random subset of [`IFACE_ADDRS`].
fn iface_change(r: &mut Rng) -> Option<Vec<std::net::IpAddr>> {
    r.chance(10).then(|| {
        IFACE_ADDRS
            .iter()
            .filter(|_| r.chance(50))
            .map(|a| a.parse().unwrap())
            .collect()
    })
}

fn run(seed: u64, steps: usize, opts: ModelOptions) {
    let mut r = Rng::new(seed);
    let mut r_iface = Rng::new(seed ^ 0x5eed_1fac);
    let mut model = Incremental::new("node-a", opts.clone());
    let mut iface: Vec<std::net::IpAddr> = Vec::new();
    let mut frontends_seen = 0;
    let mut families_seen = [false; 2];
    for step in 0..steps {
        let before = model.desired().clone();
        let c = change(&mut r, &model);
        let mut what = format!("{c:?}");
        if let Some(addrs) = iface_change(&mut r_iface) {
            what += &format!(" with interface addresses {addrs:?}");
            model.set_interface_addresses(addrs.iter().copied());
            iface = addrs;
        }
        let update = model.apply([c]);
        // From scratch, with the owners the incremental model had before
        // the change (the one input of history: among Services without a
        // creationTimestamp, the current owner keeps a frontend).
        let mut full_opts = opts.clone();
        full_opts.current_owners = before
            .frontends
            .iter()
            .map(|(k, f)| (*k, f.service.to_string()))
            .collect();
        let mut scratch = Incremental::new("node-a", full_opts);
        scratch.set_interface_addresses(iface.iter().copied());
        scratch.replace_objects(model.objects());
        let full = scratch.desired().clone();
        let now = model.desired();
        assert_eq!(
            differences(now, &full),
            Default::default(),
            "seed {seed} step {step}: incremental and full differ after {what}"
        );
        assert_eq!(now.node_addr, full.node_addr, "seed {seed} step {step}");
        assert_eq!(now.node_addr6, full.node_addr6, "seed {seed} step {step}");
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
        // A frontend whose Service won or lost its host alias's ClusterIP
        // is named too: the writer names the alias in its slot 0 only
        // while its own Service owns that ClusterIP.
        for (k, f) in &now.frontends {
            let Some(alias) = f.host_alias else {
                continue;
            };
            let owns = |d: &DesiredState| {
                d.frontends
                    .get(&alias)
                    .is_some_and(|c| c.service == f.service)
            };
            if owns(&before) != owns(now) {
                assert!(
                    update.frontends.contains(k),
                    "seed {seed} step {step}: {k} of {} won or lost its host alias {alias}, not named, after {what}",
                    f.service
                );
            }
        }
        let named: BTreeSet<String> = update
            .local_endpoints
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(
            local, named,
            "seed {seed} step {step}: local endpoints after {what}"
        );
        if before.health_checks != now.health_checks
            || before.node_addr != now.node_addr
            || before.node_addr6 != now.node_addr6
        {
            assert!(update.other, "seed {seed} step {step}: {what}");
        }
        frontends_seen = frontends_seen.max(now.frontends.len());
        for k in now.frontends.keys() {
            families_seen[k.family().index()] = true;
        }
    }
    // The sequence was not trivial, in both families.
    assert!(
        frontends_seen >= 10,
        "seed {seed}: at most {frontends_seen} frontends"
    );
    assert!(
        families_seen == [true, true],
        "seed {seed}: frontends of each family seen: {families_seen:?}"
    );
}

#[test]
fn incremental_changes_give_what_a_full_recompute_gives() {
    for seed in [1, 2, 3, 0x5eed, 0xdead_beef] {
        run(seed, 600, ModelOptions::default());
    }
}

/// With `nodePortAddresses` of both families (and `primary`).
#[test]
fn incremental_changes_give_what_a_full_recompute_gives_with_node_port_addresses() {
    for (seed, entries) in [(11, [0, 1]), (12, [2, 3]), (13, [1, 1])] {
        let opts = ModelOptions {
            node_port_addresses: entries
                .iter()
                .map(|i| NODE_PORT_ADDRESSES[*i].parse().unwrap())
                .collect(),
            ..ModelOptions::default()
        };
        run(seed, 600, opts);
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
        changes.push(Change::Applied(Object::from(&svc)));
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
    let update = model.apply([Change::Applied(Object::from(&s))]);
    assert_eq!(update.services, 1, "{update:?}");
    // The same object again: nothing.
    let update = model.apply([Change::Applied(Object::from(&s))]);
    assert!(update.is_empty() && update.services == 0, "{update:?}");
    // Another node's Node object: nothing.
    let mut n = node(&mut r);
    n.metadata.name = Some("node-b".into());
    let update = model.apply([Change::Applied(Object::from(n))]);
    assert_eq!(update.services, 0, "{update:?}");
}

/// Thousands of Services at once (a start, read from a file of thousands
/// of documents) give what the same objects give applied one by one, each
/// computed alone: contested frontends, slices, pods and the node included.
/// Every Service has an age of its own, so that who owns a contested
/// frontend does not depend on who came first.
#[test]
fn thousands_of_services_at_once_give_what_one_at_a_time_gives() {
    let mut r = Rng::new(77);
    let mut objects = vec![Object::from(node(&mut r))];
    for i in 0..3_000 {
        let mut svc = service(&mut r);
        svc.metadata.name = Some(format!("svc-{i}"));
        svc.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                jiff::Timestamp::from_second(1_700_000_000 + i).unwrap(),
            ));
        let ns = svc.metadata.namespace.clone();
        let mut s = slice(&mut r);
        s.metadata.name = Some(format!("svc-{i}-a"));
        s.metadata.namespace = ns;
        s.metadata.labels =
            Some([("kubernetes.io/service-name".to_string(), format!("svc-{i}"))].into());
        objects.push(Object::from(&svc));
        objects.push(Object::from(&s));
        if i % 100 == 0 {
            objects.push(Object::from(pod(&mut r)));
        }
    }
    let mut at_once = Incremental::new("node-a", ModelOptions::default());
    at_once.apply(objects.iter().cloned().map(Change::Applied));
    let mut one_by_one = Incremental::new("node-a", ModelOptions::default());
    for o in objects {
        one_by_one.apply([Change::Applied(o)]);
    }
    let (a, b) = (at_once.desired(), one_by_one.desired());
    assert!(a.frontends.len() >= 20, "{}", a.frontends.len());
    assert_eq!(differences(a, b), Default::default());
    assert_eq!(a.health_checks, b.health_checks);
    assert_eq!(a.service_order, b.service_order);
    assert_eq!(at_once.warnings(), one_by_one.warnings());
}

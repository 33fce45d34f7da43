//! What the desired state carries besides frontends (`healthCheckNodePort`s,
//! this node's endpoint addresses), and frontends two Services claim.
use std::net::Ipv4Addr;

use proxy_agent::model::{desired_state, HealthCheck};
use proxy_common::{svc_flags, IPPROTO_TCP, SCOPE_EXTERNAL, SCOPE_INTERNAL};

use super::*;

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
            "{addresses: [\"2001:2::1:1\"], nodeName: node-a}",
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
    // IPv6 endpoints are local endpoints too (the IPv6 slice of a Service
    // without an IPv6 clusterIP included: locality is of the address).
    let expected: Vec<std::net::IpAddr> = [
        "198.18.1.1",
        "198.18.1.2",
        "198.18.1.4",
        "198.18.1.6",
        "2001:2::1:1",
    ]
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
        [std::net::IpAddr::from(Ipv4Addr::new(198, 18, 1, 3))]
    );
    assert_eq!(other.node_addr, None);
}

/// An externalIP or load-balancer IP equal to another Service's ClusterIP
/// takes none of that address: not the ClusterIP frontend, and not the
/// external entry either, which would hand the ClusterIP's traffic arriving
/// from outside the node to the other Service (CVE-2020-8554). One warning
/// names the Service that lost.
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
        &*fe_at(&state, "198.19.0.1", 80, IPPROTO_TCP, SCOPE_INTERNAL).service,
        "default/web"
    );
    assert!(
        !has_fe(&state, "198.19.0.1", 80, IPPROTO_TCP, SCOPE_EXTERNAL),
        "the ClusterIP's address, from outside, went to the other Service"
    );
    assert!(!state.frontends.contains_key(&ext("198.19.0.2", 80)));
}

/// Two Services claiming one ClusterIP (a mistake an API server would refuse):
/// the one that owns the frontend now keeps it, whatever the names' order;
/// the newcomer is skipped with a warning naming it.
#[test]
fn colliding_cluster_ip_stays_with_its_current_owner() {
    let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: zzz-old}\nspec: {clusterIP: 198.19.0.10, ports: [{port: 80}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: aaa-new}\nspec: {clusterIP: 198.19.0.10, ports: [{port: 80}]}\n";
    let (mut snap, mut errs) = (proxy_agent::objects::Snapshot::default(), Vec::new());
    proxy_agent::sources::manifests::load_str(
        std::path::Path::new("c.yaml"),
        yaml,
        &mut snap,
        &mut errs,
    );
    assert!(errs.is_empty());
    let key = proxy_agent::model::FrontendKey {
        addr: "198.19.0.10".parse().unwrap(),
        port: 80,
        proto: proxy_common::IPPROTO_TCP,
        scope: proxy_common::SCOPE_INTERNAL,
    };
    // Nobody owns it yet: the first by namespace/name.
    let (d, w) = proxy_agent::model::desired_state(&snap, "node-1");
    assert_eq!(&*d.frontends[&key].service, "default/aaa-new");
    assert_eq!(w.len(), 1);
    // zzz-old owns it: it keeps it, and the warning names aaa-new.
    let opts = proxy_agent::model::ModelOptions {
        current_owners: [(key, "default/zzz-old".to_string())].into_iter().collect(),
        ..Default::default()
    };
    let (d, w) = proxy_agent::model::desired_state_with(&snap, "node-1", &opts);
    assert_eq!(&*d.frontends[&key].service, "default/zzz-old");
    assert_eq!(w.len(), 1);
    assert!(w[0].object.contains("aaa-new"), "{w:?}");
}

/// A slice of one Service (stale, or hostile) that places another
/// Service's remote backend on this node does not make it local for the
/// datapath (whose external traffic to it would then leave without SNAT,
/// its replies never coming back); a backend two slices disagree about is
/// not local (the safe side: external traffic to it is SNATed).
#[test]
fn a_foreign_slice_cannot_make_a_remote_backend_local() {
    let yaml = WEB.to_string()
        + &web_endpoints(&[("198.18.1.1", "node-a", ""), ("198.18.1.3", "node-b", "")])
        + "---
apiVersion: v1
kind: Service
metadata: {name: evil}
spec:
  clusterIP: 198.19.0.66
  ports: [{port: 80}]
" + &slice(
        "evil-1",
        "evil",
        "{port: 80}",
        "{addresses: [198.18.1.3], nodeName: node-a}, {addresses: [198.18.1.1], nodeName: node-b}",
    );
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    assert!(
        !state
            .local_endpoints
            .contains(&Ipv4Addr::new(198, 18, 1, 3).into()),
        "web's backend on node-b claimed local by evil's slice: {:?}",
        state.local_endpoints
    );
    assert!(!state
        .local_endpoints
        .contains(&Ipv4Addr::new(198, 18, 1, 1).into()));
    // Without the foreign slice, web's own view holds.
    let (state, _) = desired_state(
        &snap(
            &(WEB.to_string()
                + &web_endpoints(&[("198.18.1.1", "node-a", ""), ("198.18.1.3", "node-b", "")])),
        ),
        "node-a",
    );
    assert_eq!(
        state.local_endpoints.iter().copied().collect::<Vec<_>>(),
        [Ipv4Addr::new(198, 18, 1, 1)]
    );
}

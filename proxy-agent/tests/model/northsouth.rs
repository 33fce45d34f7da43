//! North-south frontends: NodePort, externalIPs and load-balancer IPs (with
//! their source ranges); `nodePortAddresses` is in `node_port_addresses.rs`.
use std::net::Ipv4Addr;

use proxy_agent::model::{desired_state, desired_state_with, ModelOptions};
use proxy_common::{svc_flags, IPPROTO_TCP, IPPROTO_UDP, SCOPE_EXTERNAL, SCOPE_INTERNAL};

use super::*;

/// S10: a NodePort service is served on every InternalIP of this node, with
/// the cluster list, also on a node without a local backend; the same
/// addresses get an internal (pod-originated) entry. Other address types are
/// not NodePort addresses, nor are IPv6 ones for an IPv4-only Service.
#[test]
fn node_port_frontends_on_each_node_address_use_the_cluster_list_s10() {
    let yaml = web_svc("  type: NodePort\n", ", nodePort: 30080", "")
        + &node_addrs(
            "node-a",
            &[
                ("InternalIP", "198.18.0.11"),
                ("InternalIP", "2001:2::11"),
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
                (fe.service.as_ref(), fe.port_name.as_ref()),
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

/// A nodePort outside 1-65535, or none on a NodePort Service (the manifests
/// source does not allocate them), is a warning naming the Service and the
/// port, never a silent loss of the NodePort; the ClusterIP is still served.
/// A LoadBalancer with `allocateLoadBalancerNodePorts: false` needs none.
#[test]
fn an_invalid_or_missing_node_port_is_a_warning_naming_the_service_and_port() {
    for (spec, extra, what) in [
        (
            "  type: NodePort\n",
            ", nodePort: 70000",
            "invalid nodePort 70000",
        ),
        (
            "  type: NodePort\n",
            ", nodePort: -1",
            "invalid nodePort -1",
        ),
        ("  type: NodePort\n", "", "type NodePort but no nodePort"),
        (
            "  type: NodePort\n",
            ", nodePort: 0",
            "type NodePort but no nodePort",
        ),
        (
            "  type: LoadBalancer\n",
            "",
            "type LoadBalancer but no nodePort",
        ),
    ] {
        let yaml = web_svc(spec, extra, "") + &two_nodes();
        let (state, warnings) = desired_state(&snap(&yaml), "node-a");
        assert_eq!(warnings.len(), 1, "{extra}: {warnings:?}");
        assert_eq!(warnings[0].object, "Service default/web");
        assert!(
            warnings[0].message.contains("port \"http\" (80/TCP)")
                && warnings[0].message.contains(what),
            "{warnings:?}"
        );
        assert_eq!(state.frontends.len(), 1, "{:?}", state.frontends.keys());
    }
    let yaml = web_svc(
        "  type: LoadBalancer\n  allocateLoadBalancerNodePorts: false\n",
        "",
        "",
    ) + &two_nodes();
    let (_, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
}

/// S11: an externalIP is captured whether or not an interface owns it, from
/// outside and from pods; an IPv6 externalIP of an IPv4-only Service is
/// ignored with a warning (kube-proxy's IPv6 proxier never sees the
/// Service), an invalid one warns.
#[test]
fn external_ip_frontend_in_both_scopes_s11() {
    let yaml = web_svc(
        "  externalIPs: [198.18.9.250, \"2001:2::fa\", 198.18.9.250, not-an-ip, \"\"]\n",
        "",
        "",
    ) + &web_endpoints(&[("198.18.1.1", "node-b", "")]);
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings[0].message.contains("not-an-ip"), "{warnings:?}");
    assert!(
        warnings[1]
            .message
            .contains("externalIP 2001:2::fa is IPv6 but the Service has no IPv6 clusterIP"),
        "{warnings:?}"
    );
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
/// hostnames are skipped, and IPv6 ones of an IPv4-only Service (with a
/// warning).
#[test]
fn lb_ingress_ip_captured_in_vip_mode_not_in_proxy_mode() {
    let status = "status:
  loadBalancer:
    ingress:
      - {ip: 198.18.9.1}
      - {ip: 198.18.9.2, ipMode: VIP}
      - {ip: 198.18.9.3, ipMode: Proxy}
      - {ip: \"2001:2::9\"}
      - {hostname: lb.example.invalid}
";
    let yaml = web_svc(
        "  type: LoadBalancer\n  allocateLoadBalancerNodePorts: false\n",
        "",
        status,
    ) + &web_endpoints(&[("198.18.1.1", "node-b", "")]);
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0]
            .message
            .contains("load-balancer IP 2001:2::9 is IPv6"),
        "{warnings:?}"
    );
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

/// `loadBalancerSourceRanges` apply to load-balancer-IP frontends, from
/// outside and from inside (not to NodePorts, externalIPs or ClusterIPs):
/// parsed, host bits cleared (with a warning), deduplicated, IPv6 ones left
/// to IPv6 frontends, an invalid entry ignored with a warning.
#[test]
fn source_ranges_apply_to_lb_frontends_only_and_invalid_entries_warn() {
    let yaml = web_svc(
        "  type: LoadBalancer
  externalIPs: [198.18.9.250]
  loadBalancerSourceRanges: [\"198.18.4.7/24\", \" 198.18.8.0/22 \", \"2001:2::/64\", not-a-cidr, \"198.18.4.0/24\", \"\"]
",
        ", nodePort: 30080",
        "status: {loadBalancer: {ingress: [{ip: 198.18.9.1}]}}\n",
    ) + &two_nodes()
        + &web_endpoints(&[("198.18.1.1", "node-a", "")]);
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings.iter().all(|w| w.object == "Service default/web"));
    // Host bits: accepted and cleared as kube-proxy does, with the API
    // server's warning (`getWarningsForCIDR`).
    assert!(
        warnings[0]
            .message
            .contains("\"198.18.4.7/24\" has host bits set; used as 198.18.4.0/24"),
        "{warnings:?}"
    );
    assert!(warnings[1].message.contains("not-a-cidr"), "{warnings:?}");

    // The load-balancer IP, from outside and from pods and host clients
    // (kube-proxy's firewall chain filters every source).
    for scope in [SCOPE_EXTERNAL, SCOPE_INTERNAL] {
        let lb = fe_at(&state, "198.18.9.1", 80, IPPROTO_TCP, scope);
        assert_eq!(lb.flags, svc_flags::SOURCE_RANGES, "scope {scope}");
        assert_eq!(
            lb.source_ranges,
            [
                (Ipv4Addr::new(198, 18, 4, 0).into(), 24),
                (Ipv4Addr::new(198, 18, 8, 0).into(), 22)
            ]
        );
    }
    for (ip, port, scope, flags) in [
        ("198.18.9.250", 80, SCOPE_EXTERNAL, 0),
        ("198.18.9.250", 80, SCOPE_INTERNAL, 0),
        ("198.18.0.11", 30080, SCOPE_EXTERNAL, 0),
        ("198.18.0.11", 30080, SCOPE_INTERNAL, 0),
        ("198.19.0.1", 80, SCOPE_INTERNAL, svc_flags::CLUSTER_IP),
    ] {
        let fe = fe_at(&state, ip, port, IPPROTO_TCP, scope);
        assert_eq!(fe.flags, flags, "{ip}:{port} scope {scope}");
        assert!(fe.source_ranges.is_empty(), "{ip}:{port} scope {scope}");
    }

    // Only IPv6 ranges: nothing of this family, no filtering.
    let yaml = web_svc(
        "  type: LoadBalancer\n  loadBalancerSourceRanges: [\"2001:2::/64\"]\n",
        ", nodePort: 30080",
        "status: {loadBalancer: {ingress: [{ip: 198.18.9.1}]}}\n",
    ) + &two_nodes();
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    let lb = fe_at(&state, "198.18.9.1", 80, IPPROTO_TCP, SCOPE_EXTERNAL);
    assert_eq!((lb.flags, lb.source_ranges.len()), (0, 0));
}

/// Issue 42: a host client's UDP to a NodePort (localhost's included), an
/// externalIP or a load-balancer IP is aimed at the Service's ClusterIP
/// and translated per packet there: each such internal-scope UDP frontend
/// names the ClusterIP frontend of its family and port as its host alias,
/// while the ClusterIP chooses among the same backends. Not the external
/// scope, not the ClusterIP itself, not TCP (connect time), and not under
/// `internalTrafficPolicy: Local` with endpoints elsewhere (the ClusterIP
/// would then choose among fewer backends than the NodePort's short
/// circuit to the cluster list).
#[test]
fn udp_north_south_frontends_name_the_cluster_ip_as_host_alias() {
    let opts = ModelOptions {
        localhost_node_ports: true,
        ..Default::default()
    };
    let state_of = |proto: &str, itp: &str| {
        let yaml = web_svc(
            &format!("  type: LoadBalancer\n  externalIPs: [198.18.5.5]\n{itp}"),
            &format!(", protocol: {proto}, nodePort: 30080"),
            "status: {loadBalancer: {ingress: [{ip: 198.18.6.6}]}}\n",
        ) + &two_nodes()
            + &slice(
                "web-1",
                "web",
                &format!("{{name: http, port: 8080, protocol: {proto}}}"),
                "{addresses: [198.18.1.1], nodeName: node-a}, \
                 {addresses: [198.18.1.2], nodeName: node-b}",
            );
        let (state, warnings) = desired_state_with(&snap(&yaml), "node-a", &opts);
        assert!(warnings.is_empty(), "{warnings:?}");
        state
    };
    let north_south = [
        ("198.18.0.11", 30080),
        ("127.0.0.1", 30080),
        ("198.18.5.5", 80),
        ("198.18.6.6", 80),
    ];

    let cluster_ip = key("198.19.0.1", 80, IPPROTO_UDP);
    let state = state_of("UDP", "");
    for (ip, port) in north_south {
        let fe = fe_at(&state, ip, port, IPPROTO_UDP, SCOPE_INTERNAL);
        assert_eq!(fe.host_alias, Some(cluster_ip), "{ip}:{port}");
        assert_eq!(addrs(fe), addrs(&state.frontends[&cluster_ip]), "{ip}");
        if ip != "127.0.0.1" {
            let outside = fe_at(&state, ip, port, IPPROTO_UDP, SCOPE_EXTERNAL);
            assert_eq!(outside.host_alias, None, "{ip}:{port} from outside");
        }
    }
    assert_eq!(state.frontends[&cluster_ip].host_alias, None);

    let state = state_of("TCP", "");
    assert_eq!(state.frontends.len(), 8, "{:?}", state.frontends.keys());
    for (k, fe) in &state.frontends {
        assert_eq!(fe.host_alias, None, "{k}: TCP keeps connect time");
    }

    let state = state_of("UDP", "  internalTrafficPolicy: Local\n");
    assert_eq!(addrs(&state.frontends[&cluster_ip]), ["198.18.1.1:8080"]);
    for (ip, port) in north_south {
        let fe = fe_at(&state, ip, port, IPPROTO_UDP, SCOPE_INTERNAL);
        assert_eq!(fe.host_alias, None, "{ip}:{port} under Local");
        assert_eq!(addrs(fe).len(), 2, "{ip}:{port}: the cluster list");
    }
}

//! Dual-stack: a frontend per family a Service has (`clusterIPs`,
//! `ipFamilies`, `ipFamilyPolicy`), each fed only by the EndpointSlices,
//! node addresses, externalIPs, load-balancer IPs and source ranges of its
//! family, as kube-proxy's per-family proxiers. Addresses: 198.18.0.0/15 and
//! 2001:2::/48 only.
use std::net::IpAddr;

use proxy_agent::model::{desired_state, desired_state_with, ModelOptions, NodePortAddresses};
use proxy_common::{svc_flags, IPPROTO_TCP, SCOPE_EXTERNAL, SCOPE_INTERNAL};

use super::*;

/// Service `web` with `cluster` lines (clusterIP, clusterIPs, ipFamilies,
/// ipFamilyPolicy) and `extra` spec lines, port `http` 80 with
/// `port_extra`, and a `status` block.
fn dual_svc(cluster: &str, extra: &str, port_extra: &str, status: &str) -> String {
    format!(
        "---
apiVersion: v1
kind: Service
metadata: {{name: web}}
spec:
{cluster}{extra}  ports: [{{name: http, port: 80{port_extra}}}]
{status}"
    )
}

const DUAL: &str = "  clusterIP: 198.19.0.1\n  clusterIPs: [198.19.0.1, \"2001:2::19:1\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: PreferDualStack\n";

/// `web`'s endpoints of one family: one per `(ip, node)`.
fn family_slice(name: &str, family: &str, endpoints: &[(&str, &str)]) -> String {
    let list: Vec<String> = endpoints
        .iter()
        .map(|(ip, node)| format!("{{addresses: [\"{ip}\"], nodeName: {node}}}"))
        .collect();
    slice(name, "web", "{name: http, port: 8080}", &list.join(", "))
        .replace("addressType: IPv4", &format!("addressType: {family}"))
}

/// Both families' endpoints of `web`: 198.18.1.1 (node-a), 198.18.1.2
/// (node-b), 2001:2::18:1 (node-a), 2001:2::18:2 (node-b).
fn dual_endpoints() -> String {
    family_slice(
        "web-v4",
        "IPv4",
        &[("198.18.1.1", "node-a"), ("198.18.1.2", "node-b")],
    ) + &family_slice(
        "web-v6",
        "IPv6",
        &[("2001:2::18:1", "node-a"), ("2001:2::18:2", "node-b")],
    )
}

/// The ClusterIP frontends' addresses, in key order.
fn cluster_frontends(state: &DesiredState) -> Vec<String> {
    state
        .frontends
        .keys()
        .filter(|k| k.scope == SCOPE_INTERNAL && k.port == 80)
        .map(|k| k.addr.to_string())
        .collect()
}

/// A dual-stack Service has one ClusterIP frontend per family, each with the
/// endpoints of its own family only (kube-proxy never mixes families).
#[test]
fn dual_stack_service_has_a_frontend_per_family_fed_by_its_own_slices() {
    let yaml = dual_svc(DUAL, "", "", "") + &dual_endpoints();
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(cluster_frontends(&state), ["198.19.0.1", "2001:2::19:1"]);
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080", "198.18.1.2:8080"]
    );
    assert_eq!(
        backends(&state, "2001:2::19:1", 80, IPPROTO_TCP),
        ["[2001:2::18:1]:8080", "[2001:2::18:2]:8080"]
    );
    let v6 = frontend(&state, "2001:2::19:1", 80, IPPROTO_TCP);
    assert_eq!(
        (v6.service.as_ref(), v6.port_name.as_ref()),
        ("default/web", "http")
    );
    assert!(v6.backends.iter().all(|b| b.addr.is_ipv6()));
    // Local endpoints of both families.
    let local: Vec<String> = state
        .local_endpoints
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(local, ["198.18.1.1", "2001:2::18:1"]);
}

/// `clusterIPs` order: the primary first, either family; an IPv6-only
/// Service; `clusterIP` alone. Each family gets its frontend whatever the
/// order.
#[test]
fn cluster_ips_order_and_ip_families() {
    let cases: [(&str, &[&str]); 4] = [
        (
            "  clusterIP: \"2001:2::19:1\"\n  clusterIPs: [\"2001:2::19:1\", 198.19.0.1]\n  ipFamilies: [IPv6, IPv4]\n  ipFamilyPolicy: RequireDualStack\n",
            &["198.19.0.1", "2001:2::19:1"],
        ),
        (
            "  clusterIP: \"2001:2::19:1\"\n  clusterIPs: [\"2001:2::19:1\"]\n  ipFamilies: [IPv6]\n  ipFamilyPolicy: SingleStack\n",
            &["2001:2::19:1"],
        ),
        ("  clusterIP: \"2001:2::19:1\"\n", &["2001:2::19:1"]),
        (
            "  clusterIPs: [198.19.0.1, \"2001:2::19:1\"]\n",
            &["198.19.0.1", "2001:2::19:1"],
        ),
    ];
    for (cluster, want) in cases {
        let yaml = dual_svc(cluster, "", "", "") + &dual_endpoints();
        let (state, warnings) = desired_state(&snap(&yaml), "node-a");
        assert!(warnings.is_empty(), "{cluster}: {warnings:?}");
        assert_eq!(cluster_frontends(&state), want, "{cluster}");
        // IPv6-only: the IPv4 slice feeds nothing.
        for k in state.frontends.keys() {
            let fe = &state.frontends[k];
            assert!(
                fe.backends
                    .iter()
                    .all(|b| b.addr.is_ipv4() == k.addr.is_ipv4()),
                "{k}: {:?}",
                fe.backends
            );
        }
    }
}

/// `ipFamilyPolicy` with one or two clusterIPs: SingleStack serves one
/// family (a second clusterIP, which the API server would refuse, is
/// reported and not served); PreferDualStack and RequireDualStack serve
/// every clusterIP; RequireDualStack with one clusterIP is served on that
/// family with a warning; a second address of one family and `ipFamilies`
/// that contradict the clusterIPs are reported.
#[test]
fn ip_family_policies_with_one_or_two_cluster_ips() {
    let one = "  clusterIP: 198.19.0.1\n  clusterIPs: [198.19.0.1]\n";
    let two = "  clusterIP: 198.19.0.1\n  clusterIPs: [198.19.0.1, \"2001:2::19:1\"]\n";
    let cases: [(&str, &str, &[&str], Option<&str>); 7] = [
        (one, "SingleStack", &["198.19.0.1"], None),
        (one, "PreferDualStack", &["198.19.0.1"], None),
        (
            one,
            "RequireDualStack",
            &["198.19.0.1"],
            Some("RequireDualStack with one clusterIP; served on IPv4 only"),
        ),
        (
            two,
            "SingleStack",
            &["198.19.0.1"],
            Some("SingleStack with clusterIPs of two families; only the primary (198.19.0.1)"),
        ),
        (
            two,
            "PreferDualStack",
            &["198.19.0.1", "2001:2::19:1"],
            None,
        ),
        (
            two,
            "RequireDualStack",
            &["198.19.0.1", "2001:2::19:1"],
            None,
        ),
        (two, "", &["198.19.0.1", "2001:2::19:1"], None),
    ];
    for (ips, policy, want, warning) in cases {
        let policy_line = if policy.is_empty() {
            String::new()
        } else {
            format!("  ipFamilyPolicy: {policy}\n")
        };
        let yaml = dual_svc(&(ips.to_string() + &policy_line), "", "", "") + &dual_endpoints();
        let (state, warnings) = desired_state(&snap(&yaml), "node-a");
        assert_eq!(cluster_frontends(&state), want, "{ips} {policy}");
        match warning {
            None => assert!(warnings.is_empty(), "{ips} {policy}: {warnings:?}"),
            Some(w) => {
                assert_eq!(warnings.len(), 1, "{ips} {policy}: {warnings:?}");
                assert_eq!(warnings[0].object, "Service default/web");
                assert!(warnings[0].message.contains(w), "{warnings:?}");
            }
        }
    }

    // What the API server refuses, a manifest may hold: reported, the rest
    // served.
    for (cluster, want, warning) in [
        (
            "  clusterIPs: [198.19.0.1, 198.19.0.2, \"2001:2::19:1\"]\n",
            &["198.19.0.1", "2001:2::19:1"][..],
            "second IPv4 address 198.19.0.2",
        ),
        (
            "  clusterIPs: [198.19.0.1, \"2001:2::19:1\"]\n  ipFamilies: [IPv6, IPv4]\n",
            &["198.19.0.1", "2001:2::19:1"][..],
            "do not match the clusterIPs' families",
        ),
        (
            "  clusterIP: 198.19.0.2\n  clusterIPs: [198.19.0.1]\n",
            &["198.19.0.1"][..],
            "clusterIP \"198.19.0.2\" is not clusterIPs[0]",
        ),
    ] {
        let yaml = dual_svc(cluster, "", "", "") + &dual_endpoints();
        let (state, warnings) = desired_state(&snap(&yaml), "node-a");
        assert_eq!(cluster_frontends(&state), want, "{cluster}");
        assert_eq!(warnings.len(), 1, "{cluster}: {warnings:?}");
        assert!(warnings[0].message.contains(warning), "{warnings:?}");
    }

    // An invalid secondary address is refused alone (see
    // `an_invalid_secondary_cluster_ip_skips_only_that_address`), and so is
    // a forbidden IPv6 one.
    let yaml = dual_svc("  clusterIPs: [198.19.0.1, \"fe80::1\"]\n", "", "", "");
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(cluster_frontends(&state), ["198.19.0.1"]);
    assert!(
        warnings[0]
            .message
            .contains("clusterIP fe80::1 is in fe80::/10"),
        "{warnings:?}"
    );
}

/// IPv6 EndpointSlices feed IPv6 frontends only, and never an IPv4-only
/// Service; an address of the other family in a slice is invalid there
/// (warned, skipped alone); FQDN slices stay ignored.
#[test]
fn ipv6_endpoint_slices_feed_only_ipv6_frontends() {
    let yaml = dual_svc(DUAL, "", "", "")
        + &family_slice(
            "web-v6",
            "IPv6",
            &[("2001:2::18:1", "node-a"), ("198.18.1.9", "node-a")],
        )
        + &family_slice("web-fqdn", "FQDN", &[("web.example.invalid", "node-a")]);
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].object, "EndpointSlice default/web-v6");
    assert!(
        warnings[0]
            .message
            .contains("invalid IPv6 address \"198.18.1.9\"; endpoint skipped"),
        "{warnings:?}"
    );
    assert_eq!(
        backends(&state, "2001:2::19:1", 80, IPPROTO_TCP),
        ["[2001:2::18:1]:8080"]
    );
    // The IPv4 frontend has no IPv4 endpoint: it rejects (no usable endpoint
    // of its family), it does not borrow the IPv6 ones.
    let v4 = frontend(&state, "198.19.0.1", 80, IPPROTO_TCP);
    assert!(v4.backends.is_empty() && v4.retained.is_empty());
    assert_eq!(v4.flags, svc_flags::CLUSTER_IP);

    // An IPv4-only Service ignores IPv6 slices (as before dual-stack).
    let yaml = WEB.to_string() + &dual_endpoints();
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(cluster_frontends(&state), ["198.19.0.1"]);
}

/// Pods with IPv4 and IPv6 pod IPs stand for a slice per family.
#[test]
fn dual_stack_pods_feed_both_families() {
    let pod_yaml = pod("p1", "app: web", "198.18.1.6", "").replace(
        "  podIP: 198.18.1.6\n",
        "  podIP: 198.18.1.6\n  podIPs: [{ip: 198.18.1.6}, {ip: \"2001:2::18:6\"}]\n",
    ) + &pod("p2", "app: web", "2001:2::18:7", "");
    let yaml = dual_svc(DUAL, "  selector: {app: web}\n", "", "") + &pod_yaml;
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.6:80"]
    );
    assert_eq!(
        backends(&state, "2001:2::19:1", 80, IPPROTO_TCP),
        ["[2001:2::18:6]:80", "[2001:2::18:7]:80"]
    );
}

/// Nodes `node-a` (198.18.0.11, 2001:2::11, 2001:2::5:11) and `node-b`.
fn dual_nodes() -> String {
    node_addrs(
        "node-a",
        &[
            ("InternalIP", "198.18.0.11"),
            ("InternalIP", "2001:2::11"),
            ("InternalIP", "2001:2::5:11"),
            ("ExternalIP", "2001:2::99"),
        ],
    ) + &node_addrs(
        "node-b",
        &[("InternalIP", "198.18.0.12"), ("InternalIP", "2001:2::12")],
    )
}

/// The NodePort frontends (external scope) as `ip:port`, in key order.
fn node_ports_of(state: &DesiredState) -> Vec<String> {
    state
        .frontends
        .keys()
        .filter(|k| k.scope == SCOPE_EXTERNAL && k.port == 30080)
        .map(|k| std::net::SocketAddr::new(k.addr, k.port).to_string())
        .collect()
}

/// NodePorts on the node's IPv6 InternalIPs, selected per family by
/// `nodePortAddresses` (IPv6 CIDRs select IPv6 addresses; a list without a
/// CIDR of a family selects all of that family; `primary` the first of
/// each), each with its family's endpoints; the IPv6 SNAT address.
#[test]
fn ipv6_node_ports_with_node_port_addresses() {
    let yaml = dual_svc(DUAL, "  type: NodePort\n", ", nodePort: 30080", "")
        + &dual_nodes()
        + &dual_endpoints();
    let snapshot = snap(&yaml);
    let run = |entries: &[&str]| {
        let opts = ModelOptions {
            node_port_addresses: entries
                .iter()
                .map(|e| NodePortAddresses::parse(e).unwrap())
                .collect(),
            ..ModelOptions::default()
        };
        let (state, warnings) = desired_state_with(&snapshot, "node-a", &opts);
        assert!(warnings.is_empty(), "{warnings:?}");
        state
    };
    let state = run(&[]);
    assert_eq!(
        node_ports_of(&state),
        [
            "198.18.0.11:30080",
            "[2001:2::11]:30080",
            "[2001:2::5:11]:30080"
        ]
    );
    assert_eq!(state.node_addr, Some("198.18.0.11".parse().unwrap()));
    assert_eq!(state.node_addr6, Some("2001:2::11".parse().unwrap()));
    for scope in [SCOPE_EXTERNAL, SCOPE_INTERNAL] {
        let fe = fe_at(&state, "2001:2::5:11", 30080, IPPROTO_TCP, scope);
        assert_eq!(addrs(fe), ["[2001:2::18:1]:8080", "[2001:2::18:2]:8080"]);
        let fe = fe_at(&state, "198.18.0.11", 30080, IPPROTO_TCP, scope);
        assert_eq!(addrs(fe), ["198.18.1.1:8080", "198.18.1.2:8080"]);
    }
    assert_eq!(
        node_ports_of(&run(&["2001:2::5:0/112"])),
        ["198.18.0.11:30080", "[2001:2::5:11]:30080"]
    );
    assert_eq!(
        node_ports_of(&run(&["198.18.0.0/24"])),
        [
            "198.18.0.11:30080",
            "[2001:2::11]:30080",
            "[2001:2::5:11]:30080"
        ]
    );
    assert_eq!(
        node_ports_of(&run(&["primary"])),
        ["198.18.0.11:30080", "[2001:2::11]:30080"]
    );
    assert_eq!(
        node_ports_of(&run(&["198.18.200.0/24", "2001:2::7:0/112"])),
        Vec::<String>::new()
    );
}

/// A family the node has no InternalIP of gets no NodePort frontends, with
/// one warning naming the family (not an error: the other family and every
/// other frontend are served); without any Service of that family with a
/// nodePort, nothing to say.
#[test]
fn a_family_the_node_lacks_gets_no_node_ports_and_one_warning() {
    let services = dual_svc(DUAL, "  type: NodePort\n", ", nodePort: 30080", "")
        + &dual_svc(DUAL, "  type: NodePort\n", ", nodePort: 30081", "")
            .replace("name: web", "name: web2")
            .replace("198.19.0.1", "198.19.0.2")
            .replace("2001:2::19:1", "2001:2::19:2");
    let v4_only = node_addrs("node-a", &[("InternalIP", "198.18.0.11")]);
    let (state, warnings) = desired_state(&snap(&(services.clone() + &v4_only)), "node-a");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].object, "Node node-a");
    assert!(
        warnings[0].message.contains(
            "the Node has no IPv6 InternalIP address: no IPv6 NodePort frontends on this node (first: default/web port 30080)"
        ),
        "{warnings:?}"
    );
    assert_eq!(node_ports_of(&state), ["198.18.0.11:30080"]);
    assert!(has_fe(
        &state,
        "2001:2::19:1",
        80,
        IPPROTO_TCP,
        SCOPE_INTERNAL
    ));
    assert_eq!(state.node_addr6, None);

    // IPv6-only node: the IPv4 NodePorts are missing.
    let v6_only = node_addrs("node-a", &[("InternalIP", "2001:2::11")]);
    let (state, warnings) = desired_state(&snap(&(services.clone() + &v6_only)), "node-a");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].message.contains("no IPv4 InternalIP"),
        "{warnings:?}"
    );
    assert_eq!(node_ports_of(&state), ["[2001:2::11]:30080"]);

    // IPv4-only Services on an IPv4-only node: no IPv6 to miss.
    let yaml = web_svc("  type: NodePort\n", ", nodePort: 30080", "") + &v4_only;
    let (_, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
}

/// externalIPs and load-balancer IPs of either family serve that family's
/// frontends; IPv6 source ranges restrict the IPv6 load-balancer IP, IPv4
/// ones the IPv4 one; a family without ranges is not filtered (kube-proxy's
/// per-family proxier).
#[test]
fn ipv6_external_ips_lb_ips_and_source_ranges() {
    let yaml = dual_svc(
        DUAL,
        "  type: LoadBalancer\n  allocateLoadBalancerNodePorts: false\n  externalIPs: [198.18.9.250, \"2001:2::9:250\"]\n  loadBalancerSourceRanges: [\"2001:2::4:7/112\", \"2001:2:0:8::/64\"]\n",
        "",
        "status: {loadBalancer: {ingress: [{ip: 198.18.9.1}, {ip: \"2001:2::9:1\"}]}}\n",
    ) + &dual_endpoints();
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0]
            .message
            .contains("\"2001:2::4:7/112\" has host bits set; used as 2001:2::4:0/112"),
        "{warnings:?}"
    );
    for scope in [SCOPE_EXTERNAL, SCOPE_INTERNAL] {
        let lb6 = fe_at(&state, "2001:2::9:1", 80, IPPROTO_TCP, scope);
        assert_eq!(lb6.flags, svc_flags::SOURCE_RANGES, "scope {scope}");
        let want: Vec<(IpAddr, u8)> = vec![
            ("2001:2::4:0".parse().unwrap(), 112),
            ("2001:2:0:8::".parse().unwrap(), 64),
        ];
        assert_eq!(lb6.source_ranges, want);
        assert_eq!(addrs(lb6), ["[2001:2::18:1]:8080", "[2001:2::18:2]:8080"]);
        let lb4 = fe_at(&state, "198.18.9.1", 80, IPPROTO_TCP, scope);
        assert_eq!((lb4.flags, lb4.source_ranges.len()), (0, 0));
        assert_eq!(addrs(lb4), ["198.18.1.1:8080", "198.18.1.2:8080"]);
        let ext6 = fe_at(&state, "2001:2::9:250", 80, IPPROTO_TCP, scope);
        assert_eq!(addrs(ext6), ["[2001:2::18:1]:8080", "[2001:2::18:2]:8080"]);
        assert!(ext6.source_ranges.is_empty());
        assert!(has_fe(&state, "198.18.9.250", 80, IPPROTO_TCP, scope));
    }

    // IPv4 ranges restrict the IPv4 load-balancer IP only.
    let yaml = yaml.replace(
        "[\"2001:2::4:7/112\", \"2001:2:0:8::/64\"]",
        "[\"198.18.4.0/24\"]",
    );
    let (state, _) = desired_state(&snap(&yaml), "node-a");
    let lb4 = fe_at(&state, "198.18.9.1", 80, IPPROTO_TCP, SCOPE_EXTERNAL);
    assert_eq!(lb4.source_ranges, [("198.18.4.0".parse().unwrap(), 24)]);
    let lb6 = fe_at(&state, "2001:2::9:1", 80, IPPROTO_TCP, SCOPE_EXTERNAL);
    assert_eq!((lb6.flags, lb6.source_ranges.len()), (0, 0));
}

/// Traffic policies and the health check per family: an
/// `externalTrafficPolicy: Local` dual-stack LoadBalancer keeps each
/// family's local endpoints on its external frontends; the health check
/// counts the primary family's local ready endpoints.
#[test]
fn traffic_policies_per_family() {
    let yaml = dual_svc(
        DUAL,
        "  type: LoadBalancer\n  externalTrafficPolicy: Local\n  internalTrafficPolicy: Local\n  healthCheckNodePort: 30999\n",
        ", nodePort: 30080",
        "status: {loadBalancer: {ingress: [{ip: 198.18.9.1}, {ip: \"2001:2::9:1\"}]}}\n",
    ) + &dual_nodes()
        + &dual_endpoints();
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
    for (ip, port, local, all) in [
        (
            "2001:2::9:1",
            80,
            "[2001:2::18:1]:8080",
            "[2001:2::18:2]:8080",
        ),
        (
            "2001:2::11",
            30080,
            "[2001:2::18:1]:8080",
            "[2001:2::18:2]:8080",
        ),
        ("198.18.9.1", 80, "198.18.1.1:8080", "198.18.1.2:8080"),
    ] {
        let fe = fe_at(&state, ip, port, IPPROTO_TCP, SCOPE_EXTERNAL);
        assert_eq!(addrs(fe), [local], "{ip}");
        assert_eq!(fe.flags, svc_flags::EXTERNAL_LOCAL, "{ip}");
        let inner = fe_at(&state, ip, port, IPPROTO_TCP, SCOPE_INTERNAL);
        assert_eq!(addrs(inner), [local, all], "{ip}");
    }
    // internalTrafficPolicy: Local, per family.
    assert_eq!(
        backends(&state, "2001:2::19:1", 80, IPPROTO_TCP),
        ["[2001:2::18:1]:8080"]
    );
    assert_eq!(state.health_checks[&30999].local_endpoints, 1);
}

/// An unparseable secondary clusterIP (input the API server would refuse)
/// is warned about and skipped alone: the primary's family is still
/// served. An unparseable primary skips the Service, as before.
#[test]
fn an_invalid_secondary_cluster_ip_skips_only_that_address() {
    for (cluster, want, warned) in [
        (
            "  clusterIP: 198.19.0.1\n  clusterIPs: [198.19.0.1, None]\n",
            &["198.19.0.1"][..],
            "invalid clusterIPs[1] \"None\"",
        ),
        (
            "  clusterIPs: [198.19.0.1, \"2001:2::19:zz\"]\n",
            &["198.19.0.1"][..],
            "invalid clusterIPs[1] \"2001:2::19:zz\"",
        ),
        (
            "  clusterIPs: [\"\", \"2001:2::19:1\"]\n",
            &[][..],
            "invalid clusterIP \"\"; service skipped",
        ),
    ] {
        let yaml = dual_svc(cluster, "", "", "") + &dual_endpoints();
        let (state, warnings) = desired_state(&snap(&yaml), "node-a");
        assert_eq!(cluster_frontends(&state), want, "{cluster}");
        let text: Vec<String> = warnings.iter().map(ToString::to_string).collect();
        assert!(
            text.iter().any(|w| w.contains(warned)),
            "{cluster}: {text:?}"
        );
    }
}

/// An EndpointSlice whose `addressType` the API does not have is warned
/// about once and feeds nothing; FQDN slices stay ignored without a word,
/// as kube-proxy ignores them.
#[test]
fn an_unknown_address_type_is_warned_about_and_fqdn_is_ignored() {
    let yaml = dual_svc(DUAL, "", "", "")
        + &dual_endpoints()
        + &family_slice("web-bad", "banana", &[("198.18.1.9", "node-a")])
        + &family_slice("web-fqdn", "FQDN", &[("web.example", "node-a")]);
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    let text: Vec<String> = warnings.iter().map(ToString::to_string).collect();
    assert_eq!(text.len(), 1, "{text:?}");
    assert!(
        text[0].contains("EndpointSlice default/web-bad") && text[0].contains("\"banana\""),
        "{text:?}"
    );
    assert_eq!(
        backends(&state, "198.19.0.1", 80, IPPROTO_TCP),
        ["198.18.1.1:8080", "198.18.1.2:8080"]
    );
}

/// `frontendPolicy`'s externalIP allow and deny lists take CIDRs of both
/// families: an IPv6 allow list serves the IPv6 externalIPs in it, an IPv6
/// deny entry refuses one, and a list of one family says nothing about the
/// other family's externalIPs beyond what an allow list always says (only
/// what it names is served).
#[test]
fn external_ip_policy_cidrs_of_both_families() {
    use proxy_agent::model::FrontendPolicy;
    let yaml = dual_svc(
        DUAL,
        "  externalIPs: [198.18.9.250, \"2001:2::9:250\", \"2001:2::9:251\", \"2001:2:0:7::1\"]\n",
        "",
        "",
    ) + &dual_endpoints();
    let served = |p: FrontendPolicy| {
        let opts = ModelOptions {
            frontend_policy: p,
            ..Default::default()
        };
        let (state, warnings) = desired_state_with(&snap(&yaml), "node-a", &opts);
        let ips: Vec<&str> = [
            "198.18.9.250",
            "2001:2::9:250",
            "2001:2::9:251",
            "2001:2:0:7::1",
        ]
        .into_iter()
        .filter(|ip| has_fe(&state, ip, 80, IPPROTO_TCP, SCOPE_EXTERNAL))
        .collect();
        (ips, warnings)
    };
    let (ips, warnings) = served(FrontendPolicy {
        external_ip_allow: vec![
            ("198.18.9.0".parse().unwrap(), 24),
            ("2001:2::9:0".parse().unwrap(), 112),
        ],
        external_ip_deny: vec![("2001:2::9:251".parse().unwrap(), 128)],
        ..Default::default()
    });
    assert_eq!(ips, ["198.18.9.250", "2001:2::9:250"], "{warnings:?}");
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings.iter().all(|w| w
            .message
            .contains("externalIPAllowCIDRs / externalIPDenyCIDRs")),
        "{warnings:?}"
    );
    // An IPv4-only deny list leaves every IPv6 externalIP served.
    let (ips, _) = served(FrontendPolicy {
        external_ip_deny: vec![("198.18.0.0".parse().unwrap(), 15)],
        ..Default::default()
    });
    assert_eq!(ips, ["2001:2::9:250", "2001:2::9:251", "2001:2:0:7::1"]);
}

//! Issue 15, frontend ownership and address policy (the CVE-2020-8554
//! class): a ClusterIP always wins, the older Service wins between two
//! other claims whatever the agent remembers, addresses that can never be
//! frontends are refused, the operator's externalIP policy, and a limit of
//! frontends per Service.
use proxy_agent::model::{desired_state_with, FrontendPolicy, ModelOptions, ModelWarning};
use proxy_common::{IPPROTO_TCP, SCOPE_EXTERNAL, SCOPE_INTERNAL};

use super::*;

fn svc(
    name: &str,
    created: Option<&str>,
    cluster_ip: &str,
    extra_spec: &str,
    status: &str,
) -> String {
    let created = created
        .map(|c| format!(", creationTimestamp: \"{c}\""))
        .unwrap_or_default();
    format!(
        "---
apiVersion: v1
kind: Service
metadata: {{name: {name}{created}}}
spec:
  type: LoadBalancer
  allocateLoadBalancerNodePorts: false
  clusterIP: {cluster_ip}
{extra_spec}  ports: [{{port: 80}}]
{status}"
    )
}

fn lb_status(ip: &str) -> String {
    format!("status: {{loadBalancer: {{ingress: [{{ip: {ip}}}]}}}}\n")
}

fn run(yaml: &str, opts: &ModelOptions) -> (DesiredState, Vec<ModelWarning>) {
    desired_state_with(&snap(yaml), "node-a", opts)
}

/// CVE-2020-8554: a Service whose externalIP (or load-balancer IP) is
/// another Service's ClusterIP does not take it, even when its name sorts
/// first; the warning names it.
#[test]
fn cluster_ip_always_wins_over_external_ip_and_lb_ip() {
    for (extra, status) in [
        ("  externalIPs: [198.19.0.10]\n".to_string(), String::new()),
        (String::new(), lb_status("198.19.0.10")),
    ] {
        let yaml = svc("kube-dns", None, "198.19.0.10", "", "")
            + &svc("aaa-attacker", None, "198.19.0.99", &extra, &status);
        let (state, warnings) = run(&yaml, &ModelOptions::default());
        let fe = fe_at(&state, "198.19.0.10", 80, IPPROTO_TCP, SCOPE_INTERNAL);
        assert_eq!(&*fe.service, "default/kube-dns", "{warnings:?}");
        assert!(
            warnings
                .iter()
                .any(|w| w.object == "Service default/aaa-attacker"
                    && w.message.contains("ClusterIP wins")),
            "{warnings:?}"
        );
    }
}

/// Two load-balancer IPs claiming one address: the older Service keeps it,
/// whatever the names' order and whoever the agent thinks owns it now (an
/// agent restart, which forgets the owners, changes nothing).
#[test]
fn older_service_wins_and_a_restart_changes_nothing() {
    let yaml = svc(
        "zzz-old",
        Some("2024-01-01T00:00:00Z"),
        "198.19.0.1",
        "",
        &lb_status("198.18.5.5"),
    ) + &svc(
        "aaa-new",
        Some("2025-01-01T00:00:00Z"),
        "198.19.0.2",
        "",
        &lb_status("198.18.5.5"),
    );
    let k = FrontendKey {
        scope: SCOPE_EXTERNAL,
        ..key("198.18.5.5", 80, IPPROTO_TCP)
    };
    let after_restart = ModelOptions::default();
    let remembers_new = ModelOptions {
        current_owners: [(k, "default/aaa-new".to_string())].into_iter().collect(),
        ..Default::default()
    };
    for opts in [after_restart, remembers_new] {
        let (state, warnings) = run(&yaml, &opts);
        assert_eq!(&*state.frontends[&k].service, "default/zzz-old");
        assert!(
            warnings
                .iter()
                .any(|w| w.object == "Service default/aaa-new" && w.message.contains("older")),
            "{warnings:?}"
        );
    }
}

/// Addresses that must never be frontends are refused with a warning naming
/// the Service; the Service's other frontends, and the agent's own localhost
/// NodePorts, stay.
#[test]
fn addresses_that_are_never_frontends_are_refused() {
    let bad = [
        "0.0.0.7",
        "127.0.0.53",
        "169.254.169.254",
        "224.0.0.251",
        "239.1.2.3",
        "240.0.0.1",
        "255.255.255.255",
    ];
    let extra = format!("  externalIPs: [{}]\n", bad.join(", "));
    let yaml = node_addrs("node-a", &[("InternalIP", "198.18.0.11")])
        + &svc(
            "meta",
            None,
            "198.19.0.1",
            &extra,
            &lb_status("169.254.169.254"),
        )
        .replace(
            "ports: [{port: 80}]",
            "ports: [{port: 80, nodePort: 30080}]",
        );
    let opts = ModelOptions {
        localhost_node_ports: true,
        ..Default::default()
    };
    let (state, warnings) = run(&yaml, &opts);
    for ip in bad {
        for scope in [SCOPE_INTERNAL, SCOPE_EXTERNAL] {
            assert!(!has_fe(&state, ip, 80, IPPROTO_TCP, scope), "{ip} served");
        }
        assert!(
            warnings
                .iter()
                .any(|w| w.object == "Service default/meta" && w.message.contains(ip)),
            "no warning for {ip}: {warnings:?}"
        );
    }
    assert!(warnings
        .iter()
        .any(|w| w.message.contains("load-balancer IP 169.254.169.254")));
    assert!(has_fe(
        &state,
        "198.19.0.1",
        80,
        IPPROTO_TCP,
        SCOPE_INTERNAL
    ));
    assert!(has_fe(
        &state,
        "198.18.0.11",
        30080,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
    assert!(has_fe(
        &state,
        "127.0.0.1",
        30080,
        IPPROTO_TCP,
        SCOPE_INTERNAL
    ));

    // A ClusterIP in those ranges is refused too.
    let (state, warnings) = run(&svc("lo", None, "127.0.0.1", "", ""), &opts);
    assert!(state.frontends.is_empty());
    assert!(warnings[0].message.contains("loopback"), "{warnings:?}");
}

/// The node's own address as externalIP or load-balancer IP is refused
/// unless allowed; its NodePorts are not affected.
#[test]
fn node_address_as_external_ip_only_when_allowed() {
    let yaml = node_addrs("node-a", &[("InternalIP", "198.18.0.11")])
        + &svc(
            "web",
            None,
            "198.19.0.1",
            "  externalIPs: [198.18.0.11]\n",
            &lb_status("198.18.0.11"),
        );
    let (state, warnings) = run(&yaml, &ModelOptions::default());
    assert!(!has_fe(
        &state,
        "198.18.0.11",
        80,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
    assert_eq!(
        warnings
            .iter()
            .filter(|w| w.message.contains("this node's own address"))
            .count(),
        2,
        "{warnings:?}"
    );
    let allowed = ModelOptions {
        frontend_policy: FrontendPolicy {
            allow_node_addresses: true,
            ..Default::default()
        },
        ..Default::default()
    };
    let (state, warnings) = run(&yaml, &allowed);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert!(has_fe(
        &state,
        "198.18.0.11",
        80,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
}

/// externalIPs: honoured by default, not at all when switched off; the
/// allow list and the deny list (which wins) apply to externalIPs only.
#[test]
fn external_ip_policy_honour_allow_and_deny() {
    let yaml = svc(
        "web",
        None,
        "198.19.0.1",
        "  externalIPs: [198.18.7.1, 198.18.8.1, 198.18.8.2]\n",
        &lb_status("198.18.9.1"),
    );
    let served = |opts: &ModelOptions| {
        let (state, warnings) = run(&yaml, opts);
        let ips: Vec<String> = ["198.18.7.1", "198.18.8.1", "198.18.8.2", "198.18.9.1"]
            .into_iter()
            .filter(|ip| has_fe(&state, ip, 80, IPPROTO_TCP, SCOPE_EXTERNAL))
            .map(String::from)
            .collect();
        (ips, warnings)
    };
    let (ips, warnings) = served(&ModelOptions::default());
    assert_eq!(ips.len(), 4, "{warnings:?}");

    let policy = |p: FrontendPolicy| ModelOptions {
        frontend_policy: p,
        ..Default::default()
    };
    let (ips, warnings) = served(&policy(FrontendPolicy {
        honour_external_ips: false,
        ..Default::default()
    }));
    assert_eq!(ips, ["198.18.9.1"]);
    assert!(warnings[0].message.contains("not honoured"), "{warnings:?}");

    let (ips, warnings) = served(&policy(FrontendPolicy {
        external_ip_allow: vec![("198.18.8.0".parse().unwrap(), 24)],
        external_ip_deny: vec![("198.18.8.2".parse().unwrap(), 32)],
        ..Default::default()
    }));
    assert_eq!(ips, ["198.18.8.1", "198.18.9.1"]);
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings.iter().all(|w| w.object == "Service default/web"));
}

/// A Service with thousands of ports × IPs is cut at the per-Service limit
/// (default 1024) with one warning; another Service keeps its frontends.
#[test]
fn frontends_per_service_are_limited() {
    let ips: Vec<String> = (1..=20).map(|i| format!("198.18.9.{i}")).collect();
    let ports: Vec<String> = (1..=100)
        .map(|p| format!("{{name: p{p}, port: {p}}}"))
        .collect();
    let hog = format!(
        "---
apiVersion: v1
kind: Service
metadata: {{name: aaa-hog}}
spec:
  clusterIP: 198.19.0.50
  externalIPs: [{}]
  ports: [{}]
",
        ips.join(", "),
        ports.join(", ")
    );
    let yaml = hog
        + &svc(
            "web",
            None,
            "198.19.0.1",
            "  externalIPs: [198.18.10.1]\n",
            "",
        );
    let (state, warnings) = run(&yaml, &ModelOptions::default());
    let hog_count = state
        .frontends
        .values()
        .filter(|f| &*f.service == "default/aaa-hog")
        .count();
    assert_eq!(hog_count, 1024);
    let limit: Vec<_> = warnings
        .iter()
        .filter(|w| w.message.contains("maxFrontendsPerService"))
        .collect();
    assert_eq!(limit.len(), 1, "{warnings:?}");
    assert_eq!(limit[0].object, "Service default/aaa-hog");
    // 100 ports × (1 ClusterIP + 20 externalIPs × 2 scopes) = 4100 wanted.
    assert!(limit[0].message.contains("3076"), "{limit:?}");
    assert!(has_fe(
        &state,
        "198.19.0.1",
        80,
        IPPROTO_TCP,
        SCOPE_INTERNAL
    ));
    assert!(has_fe(
        &state,
        "198.18.10.1",
        80,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
}

/// The order the writer serves capacity in: the oldest Service first, one
/// without a timestamp after every one with, then namespace/name — not the
/// order of names or addresses.
#[test]
fn service_order_is_by_age_then_name() {
    let yaml = svc("a-new", Some("2025-06-01T00:00:00Z"), "198.19.0.1", "", "")
        + &svc("z-old", Some("2020-01-01T00:00:00Z"), "198.19.0.2", "", "")
        + &svc("m-undated", None, "198.19.0.3", "", "")
        + &svc("b-undated", None, "198.19.0.4", "", "");
    let (state, _) = run(&yaml, &ModelOptions::default());
    let mut order: Vec<(proxy_agent::model::ServiceAge, &str)> = state
        .service_order
        .iter()
        .map(|(s, age)| (*age, s.as_str()))
        .collect();
    order.sort();
    let order: Vec<&str> = order.into_iter().map(|(_, s)| s).collect();
    assert_eq!(
        order,
        [
            "default/z-old",
            "default/a-new",
            "default/b-undated",
            "default/m-undated"
        ]
    );
}

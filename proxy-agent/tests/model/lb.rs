//! Load-balancing algorithms: each frontend's algorithm (annotation, node
//! default), the Maglev handoff flag, and Maglev's table (fairness,
//! disruption, independence from order).
use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use proxy_agent::model::{
    desired_state_with, maglev_table, BackendAddr, LbAlgorithm, ModelOptions,
    ANNOTATION_LB_ALGORITHM,
};
use proxy_common::{
    lb::MAGLEV_DEFAULT_SIZE, svc_flags, IPPROTO_TCP, SCOPE_EXTERNAL, SCOPE_INTERNAL,
};

use super::*;

fn backends(n: usize) -> Vec<BackendAddr> {
    (0..n)
        .map(|i| BackendAddr {
            addr: Ipv4Addr::new(198, 18, 1 + (i / 200) as u8, (i % 200) as u8 + 10).into(),
            port: 8080,
            proto: IPPROTO_TCP,
        })
        .collect()
}

/// Entries of the table per backend index.
fn shares(table: &[u16], n: usize) -> Vec<usize> {
    let mut s = vec![0; n];
    for i in table {
        s[*i as usize] += 1;
    }
    s
}

/// Maglev's promise (NSDI 2016 §3.4): each backend gets `M/N` entries or
/// one more. The bar: within 1% of 1/N for every N ≤ 100.
#[test]
fn maglev_table_is_fair_for_every_backend_count_up_to_100() {
    let m = MAGLEV_DEFAULT_SIZE as usize;
    let mut worst = 0.0f64;
    for n in 1..=100 {
        let table = maglev_table(&backends(n), MAGLEV_DEFAULT_SIZE);
        assert_eq!(table.len(), m);
        for (i, c) in shares(&table, n).into_iter().enumerate() {
            let dev = (c as f64 / m as f64 - 1.0 / n as f64).abs();
            worst = worst.max(dev);
            assert!(dev <= 0.01, "N={n}: backend {i} has {c} of {m} entries");
        }
    }
    println!(
        "worst deviation from 1/N over N = 1..100: {:.4}%",
        worst * 100.0
    );
}

/// Removing one of N backends moves its own entries and few others: at most
/// 1/N of the table plus 2% (the paper measures a few percent of churn).
#[test]
fn maglev_removal_of_one_backend_moves_about_its_share() {
    for n in [3usize, 5, 10, 20, 50, 100] {
        let all = backends(n);
        let before = maglev_table(&all, MAGLEV_DEFAULT_SIZE);
        let removed = n / 2;
        let mut rest = all.clone();
        rest.remove(removed);
        let after = maglev_table(&rest, MAGLEV_DEFAULT_SIZE);
        let moved = before
            .iter()
            .zip(&after)
            .filter(|(b, a)| all[**b as usize] != rest[**a as usize])
            .count();
        let frac = moved as f64 / before.len() as f64;
        println!(
            "N={n}: {:.2}% of the table moved (own share {:.2}%)",
            frac * 100.0,
            100.0 / n as f64
        );
        assert!(
            frac <= 1.0 / n as f64 + 0.02,
            "N={n}: {moved} entries moved"
        );
        // Every flow of a backend that stays and was not displaced keeps it.
        let own = before.iter().filter(|b| **b as usize == removed).count();
        assert!(moved >= own, "the removed backend's entries must move");
    }
}

/// Two agents that learnt the backends in another order build the same
/// table (it follows the backends' addresses).
#[test]
fn maglev_table_does_not_depend_on_backend_order() {
    let all = backends(7);
    let mut reversed = all.clone();
    reversed.reverse();
    let a: Vec<BackendAddr> = maglev_table(&all, 251)
        .iter()
        .map(|i| all[*i as usize])
        .collect();
    let b: Vec<BackendAddr> = maglev_table(&reversed, 251)
        .iter()
        .map(|i| reversed[*i as usize])
        .collect();
    assert_eq!(a, b);
    assert!(maglev_table(&[], 251).is_empty());
}

fn annotated_lb(annotation: Option<&str>, policy: &str) -> String {
    let annotations = match annotation {
        Some(a) => format!("\n  annotations: {{{ANNOTATION_LB_ALGORITHM}: {a}}}"),
        None => String::new(),
    };
    format!(
        "---
apiVersion: v1
kind: Service
metadata:
  name: web{annotations}
spec:
  type: LoadBalancer
  clusterIP: 198.19.0.1
  externalTrafficPolicy: {policy}
  externalIPs: [198.18.9.5]
  ports: [{{name: http, port: 80, nodePort: 30080}}]
status:
  loadBalancer:
    ingress: [{{ip: 198.18.9.1}}]
"
    ) + &web_endpoints(&[("198.18.1.1", "node-a", ""), ("198.18.1.2", "node-b", "")])
        + &two_nodes()
}

fn algorithm_at(state: &DesiredState, ip: &str, port: u16, scope: u8) -> LbAlgorithm {
    LbAlgorithm::of_flags(fe_at(state, ip, port, IPPROTO_TCP, scope).flags)
}

/// The annotation sets every frontend of the Service, ClusterIP included;
/// Maglev's handoff is set on load-balancer IPs and externalIPs of a
/// Cluster-policy Service only (never on NodePorts, never under Local).
#[test]
fn annotation_sets_every_frontend_and_handoff_only_where_it_applies() {
    for alg in LbAlgorithm::ALL {
        let yaml = annotated_lb(Some(alg.name()), "Cluster");
        let (state, warnings) = desired_state(&snap(&yaml), "node-a");
        assert!(warnings.is_empty(), "{warnings:?}");
        for fe in state.frontends.values() {
            assert_eq!(LbAlgorithm::of_flags(fe.flags), alg, "{fe:?}");
        }
    }
    let (state, _) = desired_state(&snap(&annotated_lb(Some("maglev"), "Cluster")), "node-a");
    let handoff = |ip: &str, port: u16, scope: u8| {
        fe_at(&state, ip, port, IPPROTO_TCP, scope).flags & svc_flags::HANDOFF != 0
    };
    assert!(handoff("198.18.9.1", 80, SCOPE_EXTERNAL));
    assert!(handoff("198.18.9.5", 80, SCOPE_EXTERNAL));
    assert!(!handoff("198.18.0.11", 30080, SCOPE_EXTERNAL));
    assert!(!handoff("198.18.9.1", 80, SCOPE_INTERNAL));
    assert!(!handoff("198.19.0.1", 80, SCOPE_INTERNAL));
    let (local, _) = desired_state(&snap(&annotated_lb(Some("maglev"), "Local")), "node-a");
    assert!(local
        .frontends
        .values()
        .all(|f| f.flags & svc_flags::HANDOFF == 0));
    assert_eq!(
        algorithm_at(&local, "198.18.9.1", 80, SCOPE_EXTERNAL),
        LbAlgorithm::Maglev
    );
}

/// A node default of `maglev` applies to external frontends only; other
/// defaults to all. The annotation wins over the default.
#[test]
fn node_default_maglev_is_external_only_and_the_annotation_wins() {
    let opts = |a| ModelOptions {
        lb_algorithm: a,
        ..ModelOptions::default()
    };
    let yaml = annotated_lb(None, "Cluster");
    let (state, _) = desired_state_with(&snap(&yaml), "node-a", &opts(LbAlgorithm::Maglev));
    assert_eq!(
        algorithm_at(&state, "198.18.9.1", 80, SCOPE_EXTERNAL),
        LbAlgorithm::Maglev
    );
    assert_eq!(
        algorithm_at(&state, "198.18.0.11", 30080, SCOPE_EXTERNAL),
        LbAlgorithm::Maglev
    );
    assert_eq!(
        algorithm_at(&state, "198.19.0.1", 80, SCOPE_INTERNAL),
        LbAlgorithm::Random
    );
    assert_eq!(
        algorithm_at(&state, "198.18.9.1", 80, SCOPE_INTERNAL),
        LbAlgorithm::Random
    );
    let (rr, _) = desired_state_with(&snap(&yaml), "node-a", &opts(LbAlgorithm::RoundRobin));
    assert!(rr
        .frontends
        .values()
        .all(|f| LbAlgorithm::of_flags(f.flags) == LbAlgorithm::RoundRobin));
    let yaml = annotated_lb(Some("source-hash"), "Cluster");
    let (sh, _) = desired_state_with(&snap(&yaml), "node-a", &opts(LbAlgorithm::Maglev));
    assert!(sh
        .frontends
        .values()
        .all(|f| LbAlgorithm::of_flags(f.flags) == LbAlgorithm::SourceHash));
}

/// An annotation naming no algorithm is reported by name, and the node
/// default applies; nothing else about the Service changes.
#[test]
fn unknown_annotation_is_reported_and_the_default_applies() {
    let yaml = annotated_lb(Some("least-conn"), "Cluster");
    let (state, warnings) = desired_state(&snap(&yaml), "node-a");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].object.contains("default/web"), "{warnings:?}");
    assert!(warnings[0].message.contains("least-conn"), "{warnings:?}");
    let by_alg: BTreeMap<_, usize> = state.frontends.values().fold(BTreeMap::new(), |mut m, f| {
        *m.entry(LbAlgorithm::of_flags(f.flags)).or_default() += 1;
        m
    });
    assert_eq!(by_alg.keys().collect::<Vec<_>>(), [&LbAlgorithm::Random]);
    let (plain, _) = desired_state(&snap(&annotated_lb(None, "Cluster")), "node-a");
    assert_eq!(state.frontends, plain.frontends);
}

//! Conformance: endpoint categorization against kube-proxy's own cases.
//!
//! Loads every `*.json` file of `shared/conformance/topology/` (next to the
//! repository; see its README.md for the format and the comparison rules),
//! runs [`categorize`] on each case and compares. Every failure is collected
//! and reported with its file and case name.
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use proxy_agent::model::{
    categorize, BackendAddr, EndpointInfo, Gates, NodeTopology, ServicePortInfo, TrafficPolicy,
    LABEL_TOPOLOGY_ZONE,
};
use proxy_common::IPPROTO_TCP;
use serde_json::Value;

/// `<repo>/../shared/conformance/topology`.
fn cases_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/conformance/topology")
}

/// The JSON files of the folder, sorted; panics with a clear message when the
/// folder is missing or holds none.
fn case_files() -> Vec<PathBuf> {
    let dir = cases_dir();
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "conformance folder {} is missing or unreadable ({e}); it is expected at \
             <repository>/../shared/conformance/topology",
            dir.display()
        )
    });
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("read_dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no *.json file in {}", dir.display());
    files
}

fn str_field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect()
}

/// A boolean field; `default` when missing or null (README: ready and serving
/// default to true, terminating to false).
fn bool_field(v: &Value, key: &str, default: bool) -> bool {
    v.get(key).and_then(Value::as_bool).unwrap_or(default)
}

/// One endpoint of a case. `nodeName` decides locality; a case giving only
/// `isLocal: true` gets this node's name.
fn endpoint(e: &Value, node_name: &str) -> Result<EndpointInfo, String> {
    let ip = str_field(e, "ip").ok_or("endpoint without ip")?;
    let addr: Ipv4Addr = ip.parse().map_err(|_| format!("bad ip {ip:?}"))?;
    let port = e
        .get("port")
        .and_then(Value::as_u64)
        .and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| format!("endpoint {ip}: bad port"))?;
    let is_local = bool_field(e, "isLocal", false);
    let node = str_field(e, "nodeName")
        .map(str::to_string)
        .or_else(|| is_local.then(|| node_name.to_string()));
    let info = EndpointInfo {
        addr: BackendAddr {
            addr,
            port,
            proto: IPPROTO_TCP,
        },
        ready: bool_field(e, "ready", true),
        serving: bool_field(e, "serving", true),
        terminating: bool_field(e, "terminating", false),
        node_name: node,
        zone: str_field(e, "zone").map(str::to_string),
        zone_hints: strings(e.pointer("/hints/forZones")),
        node_hints: strings(e.pointer("/hints/forNodes")),
    };
    if info.is_local(node_name) != is_local {
        return Err(format!(
            "endpoint {ip}:{port}: isLocal {is_local} contradicts nodeName {:?}",
            info.node_name
        ));
    }
    Ok(info)
}

fn ip_ports(list: &[BackendAddr]) -> BTreeSet<String> {
    list.iter()
        .map(|b| format!("{}:{}", b.addr, b.port))
        .collect()
}

/// README comparison rules: `null` → must be `None`; `[]` → `None` or empty;
/// a list → equal as a set of `ip:port`.
fn compare_list(
    what: &str,
    expected: Option<&Value>,
    got: Option<&Vec<BackendAddr>>,
) -> Option<String> {
    match expected {
        None => Some(format!("{what}: missing in the case")),
        Some(Value::Null) => got.map(|g| format!("{what}: expected not used, got {g:?}")),
        Some(Value::Array(_)) => {
            let want: BTreeSet<String> = strings(expected).into_iter().collect();
            let have = got.map(|g| ip_ports(g)).unwrap_or_default();
            (want != have).then(|| format!("{what}: expected {want:?}, got {have:?}"))
        }
        Some(other) => Some(format!("{what}: unexpected value {other}")),
    }
}

/// Runs one case; the list of its failures (empty = passed).
fn run_case(case: &Value) -> Vec<String> {
    let mut failures = Vec::new();
    let service = &case["service"];
    let port = ServicePortInfo {
        internal_traffic_policy: TrafficPolicy::parse(str_field(service, "internalTrafficPolicy")),
        external_traffic_policy: TrafficPolicy::parse(str_field(service, "externalTrafficPolicy")),
        externally_accessible: bool_field(service, "externallyAccessible", false),
    };
    let gates = Gates {
        prefer_same_traffic_distribution: case
            .pointer("/featureGates/PreferSameTrafficDistribution")
            .and_then(Value::as_bool)
            .unwrap_or(Gates::default().prefer_same_traffic_distribution),
    };
    let Some(node_name) = case.pointer("/node/name").and_then(Value::as_str) else {
        return vec!["node.name missing".into()];
    };
    let node = NodeTopology {
        name: node_name,
        zone: case
            .pointer("/node/labels")
            .and_then(|l| str_field(l, LABEL_TOPOLOGY_ZONE)),
    };

    // The case's derived flags against ours.
    for (key, ours) in [
        ("usesClusterEndpoints", port.uses_cluster_endpoints()),
        ("usesLocalEndpoints", port.uses_local_endpoints()),
    ] {
        match service.get(key).and_then(Value::as_bool) {
            Some(theirs) if theirs != ours => {
                failures.push(format!("service.{key}: case says {theirs}, derived {ours}"))
            }
            _ => {}
        }
    }

    let mut endpoints = Vec::new();
    for e in case["endpoints"].as_array().into_iter().flatten() {
        match endpoint(e, node_name) {
            Ok(info) => endpoints.push(info),
            Err(msg) => failures.push(msg),
        }
    }

    let got = categorize(&port, &endpoints, &node, &gates);
    let expected = &case["expected"];
    failures.extend(compare_list(
        "clusterEndpoints",
        expected.get("clusterEndpoints"),
        got.cluster.as_ref(),
    ));
    failures.extend(compare_list(
        "localEndpoints",
        expected.get("localEndpoints"),
        got.local.as_ref(),
    ));
    failures.extend(compare_list(
        "allReachableEndpoints",
        expected.get("allReachableEndpoints"),
        Some(&got.all_reachable),
    ));
    match expected.get("hasAnyEndpoints").and_then(Value::as_bool) {
        Some(want) if want != got.has_any_endpoints => failures.push(format!(
            "hasAnyEndpoints: expected {want}, got {}",
            got.has_any_endpoints
        )),
        Some(_) => {}
        None => failures.push("expected.hasAnyEndpoints missing".into()),
    }
    failures
}

#[test]
fn kube_proxy_categorize_endpoints_cases() {
    let mut total = 0;
    let mut passed = 0;
    let mut report = String::new();
    for file in case_files() {
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        let file_name = file.file_name().unwrap().to_string_lossy().into_owned();
        let cases: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => {
                writeln!(report, "{file_name}: not JSON: {e}").unwrap();
                continue;
            }
        };
        let Some(cases) = cases.as_array() else {
            writeln!(report, "{file_name}: not a JSON array of cases").unwrap();
            continue;
        };
        for (i, case) in cases.iter().enumerate() {
            total += 1;
            let name = str_field(case, "name").map_or_else(|| format!("#{i}"), str::to_string);
            let failures = run_case(case);
            if failures.is_empty() {
                passed += 1;
            } else {
                writeln!(report, "{file_name}: case {name:?}:").unwrap();
                for f in failures {
                    writeln!(report, "    {f}").unwrap();
                }
            }
        }
    }
    println!("topology conformance: {passed}/{total} cases passed");
    assert!(
        report.is_empty(),
        "topology conformance: {passed}/{total} cases passed; failures:\n{report}"
    );
    assert!(total > 0, "no case loaded from {}", cases_dir().display());
}

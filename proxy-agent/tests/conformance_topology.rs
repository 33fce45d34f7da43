//! Conformance: endpoint categorization against kube-proxy's own cases.
//!
//! Loads every `*.json` file of `shared/conformance/topology/` (next to the
//! repository; see its README.md for the format and the comparison rules),
//! runs [`categorize`] on each case and compares. Every failure is collected
//! and reported with its file and case name.
//!
//! Each case runs twice: as written (IPv4 endpoints), and with every endpoint
//! address mapped into IPv6 ([`to_ipv6`]), which must give the same answers:
//! categorization does not depend on the family.
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
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

/// The address family a case runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// As written.
    V4,
    /// Every address mapped by [`to_ipv6`].
    V6,
}

/// An IPv4 address of a case in 2001:2::/48 (RFC 5180's benchmarking
/// range): 198.18.x.y is 2001:2::x:y (198.19.x.y is 2001:2::1:x:y), any
/// other a.b.c.d (the cases' kube-proxy addresses, 10.x) is
/// 2001:2:0:1:a:b:c:d.
/// One to one: the answers must be the same addresses, mapped.
fn to_ipv6(ip: Ipv4Addr) -> Ipv6Addr {
    let [a, b, c, d] = ip.octets().map(u16::from);
    match (a, b) {
        (198, 18) => Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, c, d),
        (198, 19) => Ipv6Addr::new(0x2001, 2, 0, 0, 0, 1, c, d),
        _ => Ipv6Addr::new(0x2001, 2, 0, 1, a, b, c, d),
    }
}

/// A case's address in `family`.
fn case_ip(ip: &str, family: Family) -> Result<IpAddr, String> {
    let v4: Ipv4Addr = ip.parse().map_err(|_| format!("bad ip {ip:?}"))?;
    Ok(match family {
        Family::V4 => IpAddr::V4(v4),
        Family::V6 => IpAddr::V6(to_ipv6(v4)),
    })
}

/// An expected `ip:port` of a case in `family`, as [`ip_ports`] prints it.
fn case_ip_port(s: &str, family: Family) -> String {
    let Some((ip, port)) = s.rsplit_once(':') else {
        return s.to_string();
    };
    match (case_ip(ip, family), port.parse::<u16>()) {
        (Ok(ip), Ok(port)) => SocketAddr::new(ip, port).to_string(),
        _ => s.to_string(),
    }
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
fn endpoint(e: &Value, node_name: &str, family: Family) -> Result<EndpointInfo, String> {
    let ip = str_field(e, "ip").ok_or("endpoint without ip")?;
    let addr = case_ip(ip, family)?;
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
        .map(|b| SocketAddr::new(b.addr, b.port).to_string())
        .collect()
}

/// README comparison rules: `null` → must be `None`; `[]` → `None` or empty;
/// a list → equal as a set of `ip:port`.
fn compare_list(
    family: Family,
    what: &str,
    expected: Option<&Value>,
    got: Option<&Vec<BackendAddr>>,
) -> Option<String> {
    match expected {
        None => Some(format!("{what}: missing in the case")),
        Some(Value::Null) => got.map(|g| format!("{what}: expected not used, got {g:?}")),
        Some(Value::Array(_)) => {
            let want: BTreeSet<String> = strings(expected)
                .iter()
                .map(|s| case_ip_port(s, family))
                .collect();
            let have = got.map(|g| ip_ports(g)).unwrap_or_default();
            (want != have).then(|| format!("{what}: expected {want:?}, got {have:?}"))
        }
        Some(other) => Some(format!("{what}: unexpected value {other}")),
    }
}

/// Runs one case in `family`; the list of its failures (empty = passed).
fn run_case(case: &Value, family: Family) -> Vec<String> {
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
        match endpoint(e, node_name, family) {
            Ok(info) => endpoints.push(info),
            Err(msg) => failures.push(msg),
        }
    }

    let got = categorize(&port, &endpoints, &node, &gates);
    let expected = &case["expected"];
    failures.extend(compare_list(
        family,
        "clusterEndpoints",
        expected.get("clusterEndpoints"),
        got.cluster.as_ref(),
    ));
    failures.extend(compare_list(
        family,
        "localEndpoints",
        expected.get("localEndpoints"),
        got.local.as_ref(),
    ));
    failures.extend(compare_list(
        family,
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
    run_all(Family::V4);
}

/// The same cases with IPv6 endpoint addresses: the same answers.
#[test]
fn kube_proxy_categorize_endpoints_cases_ipv6() {
    run_all(Family::V6);
}

#[test]
fn ipv6_mapping_is_in_the_benchmarking_range_and_one_to_one() {
    let net = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0);
    let in_range = |a: Ipv6Addr| a.segments()[..3] == net.segments()[..3];
    let samples = [
        "198.18.1.2",
        "198.19.1.2",
        "10.1.2.3",
        "10.0.0.0",
        "0.0.1.2",
    ];
    let mapped: BTreeSet<Ipv6Addr> = samples
        .iter()
        .map(|s| to_ipv6(s.parse().unwrap()))
        .collect();
    assert_eq!(mapped.len(), samples.len());
    assert!(mapped.iter().all(|a| in_range(*a)), "{mapped:?}");
    assert_eq!(
        to_ipv6("198.18.3.4".parse().unwrap()),
        "2001:2::3:4".parse::<Ipv6Addr>().unwrap()
    );
    assert_eq!(
        case_ip_port("10.1.2.3:80", Family::V6),
        "[2001:2:0:1:a:1:2:3]:80"
    );
}

fn run_all(family: Family) {
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
            let failures = run_case(case, family);
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
    println!("topology conformance ({family:?}): {passed}/{total} cases passed");
    assert!(
        report.is_empty(),
        "topology conformance ({family:?}): {passed}/{total} cases passed; failures:\n{report}"
    );
    assert!(total > 0, "no case loaded from {}", cases_dir().display());
}

//! deploy/monitoring: the Grafana dashboard and the Prometheus alerting
//! rules.
//! - `promtool check rules` passes on alerts.yaml, and `promtool test rules`
//!   on its unit tests (alerts.test.yaml), which test every alert;
//! - the dashboard is a well-formed Grafana dashboard (unique ids, every
//!   panel with queries on the data source variable);
//! - every metric the dashboard and the rules name exists in a real agent's
//!   `/metrics` output (a lab, root), and every `reason` they match is a
//!   datapath verdict, so a renamed metric or reason fails here.
//!
//! Needs `cargo xtask setup` (promtool in `<target>/kube/bin`); run by
//! `cargo xtask test`.

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    process::Command,
    time::Duration,
};

use serde::Deserialize;
use serde_json::Value;
use xtask::{client::http_get_in, kube, setup, Lab};

fn dir() -> PathBuf {
    setup::workspace_root().join("deploy/monitoring")
}

fn promtool(args: &[&str]) -> (bool, String) {
    let out = Command::new(kube::bin("promtool"))
        .args(args)
        .current_dir(dir())
        .output()
        .expect("promtool (cargo xtask setup builds it into <target>/kube/bin)");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn yaml(name: &str) -> Value {
    let text = std::fs::read_to_string(dir().join(name)).unwrap();
    Value::deserialize(yaml_serde::Deserializer::from_str(&text)).unwrap()
}

fn rules() -> Vec<Value> {
    yaml("alerts.yaml")["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().clone())
        .collect()
}

fn dashboard() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("dashboard.json")).unwrap()).unwrap()
}

/// Every PromQL expression of the rules and the dashboard (with Grafana's
/// variables replaced by what Prometheus would see), with where it is.
fn expressions() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = rules()
        .iter()
        .map(|r| {
            (
                format!("alert {}", r["alert"].as_str().unwrap()),
                r["expr"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for p in dashboard()["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push((
                format!("panel {:?}", p["title"].as_str().unwrap()),
                t["expr"]
                    .as_str()
                    .unwrap()
                    .replace("$__rate_interval", "5m")
                    .replace("$instance", ".*"),
            ));
        }
    }
    out
}

const KEYWORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
    // Aggregations, which may take `by (...)` before their `(`.
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];

/// The metric names a PromQL expression reads: identifiers that are not
/// functions or aggregations (followed by `(`), keywords, label names (in
/// `{}` and in `by (...)`-style lists), strings or durations.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let b = expr.as_bytes();
    let mut names = BTreeSet::new();
    let mut i = 0;
    // After `by`, `on`, ...: the parenthesised list holds label names.
    let mut label_list = false;
    while i < b.len() {
        let c = b[i] as char;
        match c {
            '"' | '\'' => {
                i += 1;
                while i < b.len() && b[i] as char != c {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                while i < b.len() && b[i] as char != close {
                    if b[i] == b'"' {
                        i += 1;
                        while i < b.len() && b[i] != b'"' {
                            i += if b[i] == b'\\' { 2 } else { 1 };
                        }
                    }
                    i += 1;
                }
                i += 1;
            }
            '(' if label_list => {
                while i < b.len() && b[i] != b')' {
                    i += 1;
                }
                i += 1;
                label_list = false;
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < b.len()
                    && ((b[i] as char).is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b':')
                {
                    i += 1;
                }
                let word = &expr[start..i];
                let next = expr[i..].trim_start().chars().next();
                if [
                    "by",
                    "without",
                    "on",
                    "ignoring",
                    "group_left",
                    "group_right",
                ]
                .contains(&word)
                {
                    label_list = next == Some('(');
                } else if next == Some('(')
                    || KEYWORDS.contains(&word.to_ascii_lowercase().as_str())
                {
                    // A function, an aggregation or a keyword.
                } else if start > 0 && (b[start - 1] as char).is_ascii_digit() {
                    // A duration's unit (5m) or a number's exponent.
                } else {
                    names.insert(word.to_string());
                }
            }
            _ => i += 1,
        }
    }
    names
}

/// The values matched for `label` in an expression: `label="x"` gives x,
/// `label=~"a|b_.*"` gives a and b_.*.
fn label_values(expr: &str, label: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for op in ["=~\"", "=\""] {
        let needle = format!("{label}{op}");
        let mut rest = expr;
        while let Some(at) = rest.find(&needle) {
            // Not a longer label name ending in `label`.
            let before = rest[..at].chars().last();
            rest = &rest[at + needle.len()..];
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue;
            }
            let end = rest.find('"').unwrap();
            out.extend(rest[..end].split('|').map(str::to_string));
        }
    }
    out
}

#[test]
fn the_name_extractor_reads_names_and_skips_the_rest() {
    let e = r#"sum by (reason, instance) (rate(a_total{reason=~"x|y", instance="n:1"}[5m] offset 1h))
        / ignoring (map) b_capacity{map="backends"} > 2 * c and on(instance) histogram_quantile(0.99, d_bucket) > 1e3"#;
    assert_eq!(
        metric_names(e),
        ["a_total", "b_capacity", "c", "d_bucket"]
            .map(String::from)
            .into()
    );
    assert_eq!(
        label_values(e, "reason"),
        ["x", "y"].map(String::from).into()
    );
    assert_eq!(
        label_values(e, "map"),
        ["backends"].map(String::from).into()
    );
}

#[test]
fn promtool_checks_the_rules() {
    let (ok, out) = promtool(&["check", "rules", "alerts.yaml"]);
    assert!(ok, "{out}");
    let n = rules().len();
    assert!(n >= 8, "{n} rules");
    assert!(out.contains(&format!("SUCCESS: {n} rules found")), "{out}");
}

/// `promtool test rules`, and every alert has a test that expects it to
/// fire (and one that expects it not to).
#[test]
fn every_alert_has_a_passing_unit_test() {
    let (ok, out) = promtool(&["test", "rules", "alerts.test.yaml"]);
    assert!(ok, "{out}");
    assert!(out.contains("SUCCESS"), "{out}");
    let tests = yaml("alerts.test.yaml");
    let mut fires = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for t in tests["tests"].as_array().unwrap() {
        for a in t["alert_rule_test"].as_array().into_iter().flatten() {
            let name = a["alertname"].as_str().unwrap().to_string();
            if a["exp_alerts"].as_array().is_some_and(|e| !e.is_empty()) {
                fires.insert(name);
            } else {
                quiet.insert(name);
            }
        }
    }
    let alerts: BTreeSet<String> = rules()
        .iter()
        .map(|r| r["alert"].as_str().unwrap().to_string())
        .collect();
    let untested: Vec<_> = alerts.difference(&fires).collect();
    assert!(untested.is_empty(), "no test fires {untested:?}");
    // Map and conntrack alerts aside, each has a case where it stays quiet.
    let never_quiet: Vec<_> = alerts
        .iter()
        .filter(|a| *a != "ProxyAgentMapNearFull" && !quiet.contains(*a))
        .collect();
    assert!(never_quiet.is_empty(), "no quiet case for {never_quiet:?}");
}

#[test]
fn the_dashboard_is_a_grafana_dashboard() {
    let d = dashboard();
    assert_eq!(d["uid"], "proxy-agent");
    let panels = d["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for p in panels {
        let id = p["id"].as_u64().expect("a panel id");
        assert!(ids.insert(id), "panel id {id} twice");
        let g = &p["gridPos"];
        assert!(
            g["x"].as_u64().unwrap() + g["w"].as_u64().unwrap() <= 24,
            "{p}"
        );
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{}", p["title"]);
        for t in targets {
            assert!(t["expr"].as_str().is_some_and(|e| !e.is_empty()));
            queries += 1;
        }
    }
    let vars: Vec<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(vars, ["datasource", "instance"]);
    // What issue 41 asks the dashboard to show, each by its metric.
    let all: String = expressions().into_iter().map(|(_, e)| e).collect();
    for needed in [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_network_programming_duration_seconds_bucket",
        "proxy_agent_frontend_packets_total",
        "drop_",
        "ct_new_midstream",
        "proxy_agent_map_capacity_entries",
        "snat_port_search",
        "drop_no_free_port",
        "proxy_agent_source_ready",
    ] {
        assert!(all.contains(needed), "nothing shows {needed}");
    }
    println!("{} panels, {queries} queries", panels.len());
}

/// The series names a Prometheus text exposition offers: every sample's
/// name, and for each `# TYPE` the names its samples take (a family with
/// no sample yet still counts).
fn series_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut w = rest.split_whitespace();
            let (name, kind) = (w.next().unwrap(), w.next().unwrap_or(""));
            match kind {
                "counter" => {
                    out.insert(format!("{}_total", name.trim_end_matches("_total")));
                }
                "histogram" => {
                    for s in ["_bucket", "_sum", "_count"] {
                        out.insert(format!("{name}{s}"));
                    }
                }
                _ => {
                    out.insert(name.to_string());
                }
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            out.insert(line[..end].to_string());
        }
    }
    out
}

/// Every metric the dashboard and the rules read is in a real agent's
/// /metrics (after a sync and a connection through a Service), and every
/// `reason` they match is a verdict of the datapath.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn every_metric_named_exists_in_the_agents_metrics() {
    let yaml = "---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\n\
        spec: {selector: {app: web}, ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]}\n\
        ---\napiVersion: v1\nkind: Pod\nmetadata: {name: web-1, namespace: default, labels: {app: web}}\n\
        spec: {containers: [{name: c, image: lab-server, ports: [{containerPort: 8080, protocol: TCP}]}]}\n";
    let mut lab = Lab::builder().manifests_yaml(yaml).start().expect("lab");
    lab.wait_ready(Duration::from_secs(30))
        .expect("the agent's first sync");
    lab.wait_attached(Duration::from_secs(30))
        .expect("the agent attached");
    let vip = lab
        .cluster_frontend("web", 80, "TCP")
        .expect("web's ClusterIP");
    let client = lab.client().netns.clone();
    xtask::client::tcp_request(&client, vip, b"hostname\n", Duration::from_secs(2))
        .expect("a connection through the Service");
    let node = lab.node().netns.clone();
    let (code, text) = http_get_in(
        &node,
        SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10249),
        "/metrics",
        Duration::from_secs(5),
    )
    .expect("GET /metrics");
    assert_eq!(code, 200, "{text}");
    let offered = series_names(&text);
    let mut missing = Vec::new();
    let mut named = BTreeSet::new();
    for (at, e) in expressions() {
        for n in metric_names(&e) {
            if !offered.contains(&n) {
                missing.push(format!("{at}: {n}"));
            }
            named.insert(n);
        }
        for r in label_values(&e, "reason") {
            let known = match r.strip_suffix(".*") {
                Some(prefix) => proxy_common::stat::NAMES
                    .iter()
                    .any(|n| !n.is_empty() && n.starts_with(prefix)),
                None => proxy_common::stat::NAMES.contains(&r.as_str()),
            };
            if !known || r.is_empty() {
                missing.push(format!("{at}: reason {r:?}"));
            }
        }
        for m in label_values(&e, "map") {
            if !text.contains(&format!("map=\"{m}\"")) {
                missing.push(format!("{at}: map {m:?}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not in the agent's /metrics:\n{}\n\noffered: {offered:?}",
        missing.join("\n")
    );
    assert!(named.len() >= 12, "{named:?}");
    println!("{} metrics named, all in /metrics: {named:?}", named.len());
}

//! deploy/helm/proxy-agent, the Helm chart beside the kustomize base:
//! - `helm lint --strict` passes, with the defaults and every case below;
//! - by default `helm template` renders the objects `kubectl kustomize
//!   deploy/` does, object by object (the agent's config file compared as
//!   YAML, not as text);
//! - a matrix of values renders objects that pass kubernetes-validate
//!   (strict) for every Kubernetes version deploy/ supports, parse into
//!   their types, carry each value where it belongs, and whose config file
//!   the agent loads and resolves with the DaemonSet's own flags;
//! - values.schema.json refuses misspelt and ill-typed values, naming the
//!   value, holds `additionalProperties: false` on every object, and names
//!   every field of the agent's config file (the config types' schema);
//! - `helm install` against the lab's real control plane creates the
//!   DaemonSet, ServiceAccount, ClusterRole and binding, and the
//!   ServiceAccount may then list what the agent watches (root: a lab).
//!
//! Needs `cargo xtask setup` (helm and kubectl in `<target>/kube/bin`,
//! kubernetes-validate in `<target>/venv`); run by `cargo xtask test`.
//!
//! Why one file (about 950 lines): every test reads or renders the one
//! chart through the same few helpers (`chart_dir`, `helm`, `template`,
//! `documents`), and over a quarter of the file is [`cases`], the one
//! table of values that both the lint and the render tests walk.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{ConfigMap, Service},
};
use proxy_agent::config::{Acceleration, ConfigFile, DeliveryMode, Settings};
use serde::Deserialize;
use serde_json::{json, Value};
use xtask::{kube, setup};

/// The Kubernetes versions deploy/ is validated for (xtask/tests/deploy_validate.rs).
const VERSIONS: &[&str] = &[
    "1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0",
];

fn chart_dir() -> PathBuf {
    setup::workspace_root().join("deploy/helm/proxy-agent")
}

fn work_dir(name: &str) -> PathBuf {
    let d = setup::target_dir().join(format!("helm-chart-test/{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The built helm, with its cache, config and data under the target
/// directory (never the user's).
fn helm() -> Command {
    let home = setup::target_dir().join("helm-home");
    let mut c = Command::new(kube::bin("helm"));
    c.env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"));
    c
}

/// `helm template proxy-agent <chart> -n kube-system` with `values`
/// (a file each) and `sets` (`--set`): the output, or the error output.
fn template(values: &[&Value], sets: &[&str]) -> Result<String, String> {
    let mut cmd = helm();
    cmd.args(["template", "proxy-agent"])
        .arg(chart_dir())
        .args(["--namespace", "kube-system"]);
    let dir = setup::target_dir().join("helm-chart-test/values");
    std::fs::create_dir_all(&dir).unwrap();
    for v in values {
        let text = serde_json::to_string(v).unwrap();
        let name = format!("{:x}.json", fxhash(&text));
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        cmd.arg("-f").arg(p);
    }
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd
        .output()
        .expect("helm (cargo xtask setup builds it into <target>/kube/bin)");
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// A name for a values file (FNV-1a of its text).
fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    })
}

fn kustomize() -> String {
    let out = Command::new(kube::bin("kubectl"))
        .arg("kustomize")
        .arg(setup::workspace_root().join("deploy"))
        .output()
        .expect("kubectl (cargo xtask setup builds it into <target>/kube/bin)");
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Every document of a multi-document YAML stream (empty ones left out).
fn documents(text: &str) -> Vec<Value> {
    yaml_serde::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// Objects by `kind/namespace/name`, each ConfigMap's `config.yaml` parsed
/// (so that comments, key order and quoting do not count).
fn by_key(text: &str) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for mut v in documents(text) {
        if v["kind"] == "ConfigMap" {
            if let Some(cfg) = v["data"]["config.yaml"].as_str() {
                let parsed: Value = yaml_serde::from_str(cfg).unwrap();
                v["data"]["config.yaml"] = parsed;
            }
        }
        let key = format!(
            "{}/{}/{}",
            v["kind"].as_str().unwrap(),
            v["metadata"]["namespace"].as_str().unwrap_or(""),
            v["metadata"]["name"].as_str().unwrap()
        );
        assert!(out.insert(key.clone(), v).is_none(), "{key} twice");
    }
    out
}

/// The paths where `a` and `b` differ.
fn differences(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys().filter(|k| !x.contains_key(*k))) {
                let p = format!("{path}.{k}");
                differences(
                    &p,
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    out,
                );
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (x, y)) in x.iter().zip(y).enumerate() {
                differences(&format!("{path}[{i}]"), x, y, out);
            }
        }
        _ if a != b => out.push(format!("{path}: {a} != {b}")),
        _ => {}
    }
}

#[test]
fn helm_lint_passes_for_the_defaults_and_every_case() {
    let mut files = vec![None];
    files.extend(cases().into_iter().map(|c| Some(c.values)));
    for values in files {
        let mut cmd = helm();
        cmd.args(["lint", "--strict", "--namespace", "kube-system"])
            .arg(chart_dir());
        if let Some(v) = &values {
            let p = work_dir("lint").join("values.json");
            std::fs::write(&p, v.to_string()).unwrap();
            cmd.arg("-f").arg(p);
        }
        let out = cmd.output().expect("helm");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "helm lint {values:?}: {text}");
        assert!(
            text.contains("1 chart(s) linted, 0 chart(s) failed"),
            "{text}"
        );
    }
}

/// The default render is deploy/'s kustomize output, object by object.
#[test]
fn default_render_is_the_kustomize_base() {
    let helm = by_key(&template(&[], &[]).unwrap());
    let kustomize = by_key(&kustomize());
    assert_eq!(
        helm.keys().collect::<Vec<_>>(),
        kustomize.keys().collect::<Vec<_>>(),
        "the same objects"
    );
    let mut diff = Vec::new();
    for (k, v) in &kustomize {
        differences(k, &helm[k], v, &mut diff);
    }
    assert!(
        diff.is_empty(),
        "helm template (left) and kubectl kustomize deploy/ (right) differ:\n{}",
        diff.join("\n")
    );
}

/// kubernetes-validate --strict: (passed, output).
fn validate(version: &str, file: &Path) -> (bool, String) {
    let out = Command::new(setup::kubernetes_validate_bin())
        .args(["--strict", "--quiet", "-k", version])
        .arg(file)
        .output()
        .expect("kubernetes-validate (cargo xtask setup installs it into <target>/venv)");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// One case of the values matrix and what its render must show.
struct Case {
    name: &'static str,
    values: Value,
    check: fn(&Rendered),
}

/// A render, typed.
struct Rendered {
    objects: Vec<Value>,
    daemon_set: DaemonSet,
    config: ConfigFile,
    settings: Settings,
    api_server: ConfigMap,
}

impl Rendered {
    fn pod(&self) -> &k8s_openapi::api::core::v1::PodSpec {
        self.daemon_set
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
    }

    fn container(&self) -> &k8s_openapi::api::core::v1::Container {
        &self.pod().containers[0]
    }

    fn kind(&self, kind: &str) -> Vec<&Value> {
        self.objects.iter().filter(|o| o["kind"] == kind).collect()
    }
}

fn typed<T: serde::de::DeserializeOwned>(v: &Value) -> T {
    serde_path_to_error::deserialize(v.clone()).unwrap_or_else(|e| panic!("{e}: {v}"))
}

fn rendered(text: &str) -> Rendered {
    let objects = documents(text);
    let one = |kind: &str, name: &str| -> &Value {
        let found: Vec<&Value> = objects
            .iter()
            .filter(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .collect();
        assert_eq!(found.len(), 1, "one {kind} {name}");
        found[0]
    };
    let daemon_set: DaemonSet = typed(one("DaemonSet", "proxy-agent"));
    let pod = daemon_set
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .clone()
        .unwrap();
    let c = &pod.containers[0];
    // The DaemonSet's flags, as the binary parses them.
    let mut argv = vec!["proxy-agent".to_string()];
    argv.extend(c.args.clone().unwrap_or_default());
    let matches = proxy_agent::cli::cli()
        .try_get_matches_from(&argv)
        .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let cli = <proxy_agent::cli::Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap();
    let proxy_agent::cli::Cmd::Run(mut flags) = cli.cmd else {
        panic!("run")
    };
    // The config file the DaemonSet mounts, loaded by the agent's parser.
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "config")
        .unwrap();
    let cm: ConfigMap = typed(one("ConfigMap", &volume.config_map.as_ref().unwrap().name));
    let text = &cm.data.as_ref().unwrap()["config.yaml"];
    let config =
        ConfigFile::parse(Path::new("config.yaml"), text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    flags.node_name = Some("node-1".into());
    let settings = Settings::resolve(&config, &flags, &proxy_agent::host::facts())
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    let env_from = c.env_from.as_ref().unwrap()[0]
        .config_map_ref
        .as_ref()
        .unwrap()
        .name
        .clone();
    let api_server: ConfigMap = typed(one("ConfigMap", &env_from));
    // The probes reach the agent's probe address the config sets (its
    // healthz address when it has none), on loopback when it binds every
    // address.
    let probes = settings
        .probe_bind_address
        .or(settings.healthz_bind_address)
        .expect("a server for the probes");
    let host = if probes.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        probes.ip().to_string()
    };
    for probe in [&c.liveness_probe, &c.readiness_probe] {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(
            get.port,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i32::from(
                probes.port()
            ))
        );
        assert_eq!(get.host.as_deref(), Some(host.as_str()), "{text}");
    }
    Rendered {
        objects,
        daemon_set,
        config,
        settings,
        api_server,
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "defaults",
            values: json!({}),
            check: |r| {
                assert_eq!(r.container().image.as_deref(), Some("proxy-agent:latest"));
                assert_eq!(r.settings.delivery_mode, DeliveryMode::Auto);
                assert!(r.settings.host_socket_lb.is_some());
                assert!(r.kind("ServiceMonitor").is_empty() && r.kind("Service").is_empty());
            },
        },
        Case {
            name: "install",
            values: json!({
                "image": {"repository": "registry.example/proxy-agent", "tag": "v0.1.0", "pullPolicy": "Always"},
                "apiServer": {"host": "198.18.7.1", "port": 443},
                "logLevel": "debug",
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": 2, "memory": "1Gi"}},
                "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}],
                "priorityClassName": "",
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}},
            }),
            check: |r| {
                let c = r.container();
                assert_eq!(
                    c.image.as_deref(),
                    Some("registry.example/proxy-agent:v0.1.0")
                );
                assert_eq!(c.image_pull_policy.as_deref(), Some("Always"));
                let data = r.api_server.data.as_ref().unwrap();
                assert_eq!(data["KUBERNETES_SERVICE_HOST"], "198.18.7.1");
                assert_eq!(data["KUBERNETES_SERVICE_PORT"], "443");
                let log = c
                    .env
                    .iter()
                    .flatten()
                    .find(|e| e.name == "RUST_LOG")
                    .unwrap();
                assert_eq!(log.value.as_deref(), Some("debug"));
                let res = c.resources.as_ref().unwrap();
                assert_eq!(res.limits.as_ref().unwrap()["cpu"].0, "2");
                assert_eq!(res.limits.as_ref().unwrap()["memory"].0, "1Gi");
                let t = &r.pod().tolerations.as_ref().unwrap()[0];
                assert_eq!(t.effect.as_deref(), Some("NoSchedule"));
                assert_eq!(
                    r.pod().priority_class_name,
                    None,
                    "an empty class is left out"
                );
                let s = r
                    .daemon_set
                    .spec
                    .as_ref()
                    .unwrap()
                    .update_strategy
                    .as_ref()
                    .unwrap();
                assert_eq!(
                    s.rolling_update.as_ref().unwrap().max_unavailable,
                    Some(
                        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(
                            "10%".into()
                        )
                    )
                );
            },
        },
        Case {
            name: "datapath",
            values: json!({
                "deliveryMode": "stack",
                "acceleration": "xdp",
                "hostSocketLB": {"enabled": false},
                "loadBalancing": {"algorithm": "maglev", "maglev": {"tableSize": 65521, "maxTables": 64}},
                "updateStrategy": {"type": "OnDelete"},
            }),
            check: |r| {
                assert_eq!(r.settings.delivery_mode, DeliveryMode::Stack);
                assert_eq!(r.settings.acceleration, Acceleration::Xdp);
                assert_eq!(r.settings.host_socket_lb, None);
                assert_eq!(
                    r.settings.lb_algorithm,
                    proxy_agent::model::LbAlgorithm::Maglev
                );
                assert_eq!(
                    r.config
                        .load_balancing
                        .as_ref()
                        .unwrap()
                        .maglev
                        .as_ref()
                        .unwrap()
                        .table_size,
                    Some(65521)
                );
                let s = r
                    .daemon_set
                    .spec
                    .as_ref()
                    .unwrap()
                    .update_strategy
                    .as_ref()
                    .unwrap();
                assert_eq!(s.type_.as_deref(), Some("OnDelete"));
                assert!(
                    s.rolling_update.is_none(),
                    "OnDelete takes no rollingUpdate"
                );
                assert!(
                    !r.pod().volumes.iter().flatten().any(|v| v.name == "cgroup"),
                    "no cgroup mount without host socket LB"
                );
            },
        },
        Case {
            name: "every-config-field",
            values: json!({
                "deliveryMode": "redirect",
                "acceleration": "none",
                "loadBalancing": {"algorithm": "source-hash"},
                "config": {
                    "kind": "ProxyAgentConfiguration",
                    "apiVersion": "proxy-agent/v1alpha1",
                    "source": "kubernetes",
                    "healthzBindAddress": "0.0.0.0:10266",
                    "metricsBindAddress": "0.0.0.0:10249",
                    "probeBindAddress": "198.18.0.10:10267",
                    "nodePortAddresses": ["198.18.0.0/15"],
                    "clusterCIDR": "198.18.128.0/17",
                    "minSyncPeriod": "500ms",
                    "syncPeriod": "1m",
                    "hostnameOverride": "node-x",
                    "clientConnection": {"kubeconfig": ""},
                    "conntrack": {"maxPerCore": 65536, "min": 131072, "tcpEstablishedTimeout": "2h",
                        "tcpCloseWaitTimeout": "20s", "udpTimeout": "30s", "udpStreamTimeout": "2m",
                        "tcpBeLiberal": false},
                    "bpffs": "/sys/fs/bpf/proxy-agent",
                    "podInterfaces": ["lxc*"],
                    "externalInterfaces": ["eth0"],
                    "onExit": "detach",
                    "snatPortRange": "20000-29999",
                    "tcAttachMode": "legacy",
                    "hairpinSnatIP": "169.254.42.2",
                    "hairpinSnatIPv6": "2001:2::42",
                    "serviceProxyName": "proxy-agent",
                    "master": "https://198.18.0.2:6443",
                    "localhostNodePorts": false,
                    "frontendPolicy": {"honourExternalIPs": true, "externalIPAllowCIDRs": ["198.18.64.0/24"],
                        "externalIPDenyCIDRs": ["198.18.64.128/25"], "allowNodeAddresses": false,
                        "maxFrontendsPerService": 64},
                    "mapSizes": {"services": 524288, "backends": 262144, "reverseNat": 131072},
                },
            }),
            check: |r| {
                assert_eq!(r.settings.delivery_mode, DeliveryMode::Redirect);
                assert_eq!(r.config.hostname_override.as_deref(), Some("node-x"));
                assert_eq!(r.settings.map_sizes.services, 524288);
                assert_eq!(r.settings.snat_port_range, Some((20000, 29999)));
                assert_eq!(r.settings.sync_period, Duration::from_secs(60));
                let port = &r.container().ports.as_ref().unwrap()[0];
                assert_eq!(
                    port.container_port, 10266,
                    "the healthz port follows the config"
                );
                assert_eq!(
                    r.settings.probe_bind_address,
                    Some("198.18.0.10:10267".parse().unwrap()),
                    "the probes ask the address set (checked in render)"
                );
            },
        },
        Case {
            name: "probes-on-healthz",
            values: json!({
                "config": {"source": "kubernetes", "healthzBindAddress": "0.0.0.0:10256",
                    "probeBindAddress": ""},
            }),
            check: |r| {
                assert_eq!(r.settings.probe_bind_address, None);
                let get = r
                    .container()
                    .readiness_probe
                    .as_ref()
                    .unwrap()
                    .http_get
                    .clone()
                    .unwrap();
                assert_eq!(
                    get.port,
                    k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(10256),
                    "no probe server: the probes ask the healthz port"
                );
            },
        },
        Case {
            name: "service-monitor",
            values: json!({
                "config": {"source": "kubernetes", "healthzBindAddress": "0.0.0.0:10256",
                    "metricsBindAddress": "0.0.0.0:10249"},
                "serviceMonitor": {"enabled": true, "interval": "15s", "labels": {"release": "kube-prometheus-stack"}},
            }),
            check: |r| {
                let [svc] = &r.kind("Service")[..] else {
                    panic!("one Service")
                };
                let svc: Service = typed(svc);
                let spec = svc.spec.unwrap();
                assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
                let pod_labels = r
                    .daemon_set
                    .spec
                    .as_ref()
                    .unwrap()
                    .template
                    .metadata
                    .as_ref()
                    .unwrap()
                    .labels
                    .clone()
                    .unwrap();
                for (k, v) in spec.selector.as_ref().unwrap() {
                    assert_eq!(pod_labels.get(k), Some(v), "the Service selects the agents");
                }
                let port = &spec.ports.unwrap()[0];
                let metrics = r
                    .container()
                    .ports
                    .iter()
                    .flatten()
                    .find(|p| p.name.as_deref() == Some("metrics"))
                    .expect("a metrics port");
                assert_eq!(metrics.container_port, 10249);
                assert_eq!(port.name.as_deref(), Some("metrics"));
                let [sm] = &r.kind("ServiceMonitor")[..] else {
                    panic!("one ServiceMonitor")
                };
                assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
                assert_eq!(sm["metadata"]["labels"]["release"], "kube-prometheus-stack");
                assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
                assert_eq!(sm["spec"]["endpoints"][0]["interval"], "15s");
                let svc_labels = svc.metadata.labels.unwrap();
                for (k, v) in sm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
                    assert_eq!(
                        svc_labels.get(k).map(String::as_str),
                        v.as_str(),
                        "the ServiceMonitor selects the Service"
                    );
                }
            },
        },
    ]
}

/// Every case renders, validates for every supported version (strict),
/// and shows its values where they belong.
#[test]
fn every_values_case_renders_valid_objects() {
    let dir = work_dir("matrix");
    for case in cases() {
        let text = template(&[&case.values], &[]).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let r = rendered(&text);
        (case.check)(&r);
        // kubernetes-validate knows no CRD: the ServiceMonitor is checked
        // above, the rest here.
        let known: Vec<String> = r
            .objects
            .iter()
            .filter(|o| o["kind"] != "ServiceMonitor")
            .map(|o| yaml_serde::to_string(o).unwrap())
            .collect();
        let file = dir.join(format!("{}.yaml", case.name));
        std::fs::write(&file, known.join("---\n")).unwrap();
        for v in VERSIONS {
            let (ok, out) = validate(v, &file);
            assert!(ok, "{}: Kubernetes {v}: {out}", case.name);
        }
        println!("{}: {} objects valid", case.name, r.objects.len());
    }
}

/// values.schema.json refuses a misspelt or ill-typed value, naming it.
#[test]
fn the_schema_refuses_misspelt_and_ill_typed_values() {
    for (set, says) in [
        ("deliveryMod=stack", "'deliveryMod' not allowed"),
        ("deliveryMode=fast", "/deliveryMode"),
        ("acceleration=ebpf", "/acceleration"),
        ("apiServer.port=https", "/apiServer/port"),
        ("apiServer.hots=198.18.0.9", "'hots' not allowed"),
        ("image.tags=v1", "'tags' not allowed"),
        ("hostSocketLB.enabled=yes", "/hostSocketLB/enabled"),
        (
            "loadBalancing.algorithm=least-conn",
            "/loadBalancing/algorithm",
        ),
        (
            "loadBalancing.maglev.tablesize=7",
            "'tablesize' not allowed",
        ),
        ("updateStrategy.type=Recreate", "/updateStrategy/type"),
        ("config.conntrack.udpTimout=1s", "'udpTimout' not allowed"),
        ("config.syncPeriod=thirty", "/config/syncPeriod"),
        (
            "config.metricsBindAddress=10249",
            "/config/metricsBindAddress",
        ),
        ("config.mapSizes.services=8", "/config/mapSizes/services"),
        // Set in one place only: the value of its own, not inside config.
        ("config.deliveryMode=stack", "'deliveryMode' not allowed"),
        ("serviceMonitor.enabeld=true", "'enabeld' not allowed"),
        ("tolerations[0].operater=Exists", "'operater' not allowed"),
        ("resources.request.cpu=1", "'request' not allowed"),
    ] {
        let err = template(&[], &[set]).expect_err(set);
        assert!(
            err.contains("don't meet the specifications of the schema") && err.contains(says),
            "--set {set}: the error names {says}: {err}"
        );
    }
    // The chart's own check: a ServiceMonitor cannot scrape loopback.
    let err = template(&[], &["serviceMonitor.enabled=true"]).expect_err("loopback metrics");
    assert!(
        err.contains("config.metricsBindAddress is 127.0.0.1:10249"),
        "{err}"
    );
}

/// Every object of the schema refuses properties it does not name (the
/// ServiceMonitor's free-form `labels` map aside, whose values must be
/// strings).
#[test]
fn every_object_of_the_schema_is_closed() {
    fn walk(path: &str, v: &Value, open: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                if m.get("type") == Some(&json!("object")) {
                    match m.get("additionalProperties") {
                        Some(Value::Bool(false)) => {}
                        Some(Value::Object(a)) if a.get("type") == Some(&json!("string")) => {
                            if path != "/properties/serviceMonitor/properties/labels" {
                                open.push(path.to_string());
                            }
                        }
                        _ => open.push(path.to_string()),
                    }
                }
                for (k, v) in m {
                    walk(&format!("{path}/{k}"), v, open);
                }
            }
            Value::Array(a) => {
                for (i, v) in a.iter().enumerate() {
                    walk(&format!("{path}/{i}"), v, open);
                }
            }
            _ => {}
        }
    }
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(chart_dir().join("values.schema.json")).unwrap(),
    )
    .unwrap();
    let mut open = Vec::new();
    walk("", &schema, &mut open);
    assert!(
        open.is_empty(),
        "objects without additionalProperties: false: {open:?}"
    );
    // And the defaults satisfy it: every key of values.yaml is in it.
    let values: Value =
        yaml_serde::from_str(&std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap())
            .unwrap();
    for k in values.as_object().unwrap().keys() {
        assert!(schema["properties"].get(k).is_some(), "values.yaml's {k}");
    }
}

/// `helm install` against the lab's real control plane (etcd,
/// kube-apiserver, kube-controller-manager): the DaemonSet, the
/// ServiceAccount, the ClusterRole and its binding exist afterwards, owned
/// by the release, and the ServiceAccount may list and watch what the agent
/// reads. (No kubelet runs, so no pod starts: the DaemonSet has no node to
/// schedule on and that is all.) `helm uninstall` removes them again.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn helm_install_creates_the_daemonset_and_rbac_on_a_real_control_plane() {
    let lab = xtask::Lab::builder()
        .control_plane(true)
        .agent(false)
        .start()
        .expect("lab with a control plane");
    let cp = lab.control_plane().expect("control plane").clone();
    // The lab applies deploy/'s ServiceAccount and RBAC itself (for its own
    // agents): gone first, so that helm creates them rather than finding
    // them.
    lab.kubectl(
        &[
            "delete",
            "-n",
            "kube-system",
            "serviceaccount/proxy-agent",
            "clusterrole/proxy-agent",
            "clusterrolebinding/proxy-agent",
        ],
        None,
    )
    .expect("delete the lab's copy of deploy/'s RBAC");
    let run_helm = |args: &[&str]| -> String {
        let mut cmd = helm();
        cmd.args(args).arg("--kubeconfig").arg(&cp.admin_kubeconfig);
        xtask::netns::enter_netns_on_spawn(&mut cmd, &cp.netns).expect("netns");
        let out = cmd.output().expect("helm");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "helm {args:?}: {text}");
        text
    };
    let chart = chart_dir();
    let out = run_helm(&[
        "install",
        "proxy-agent",
        chart.to_str().unwrap(),
        "--namespace",
        "kube-system",
        "--set",
        &format!("apiServer.host={}", cp.ip),
        "--wait=hookOnly",
    ]);
    println!("{out}");
    assert!(out.contains("STATUS: deployed"), "{out}");
    let get = |what: &str| -> Value {
        let text = lab
            .kubectl(&["get", "-n", "kube-system", what, "-o", "json"], None)
            .unwrap_or_else(|e| panic!("{what}: {e:#}"));
        serde_json::from_str(&text).unwrap()
    };
    for what in [
        "daemonset/proxy-agent",
        "serviceaccount/proxy-agent",
        "clusterrole/proxy-agent",
        "clusterrolebinding/proxy-agent",
        "configmap/proxy-agent",
        "configmap/proxy-agent-api-server",
    ] {
        let o = get(what);
        assert_eq!(
            o["metadata"]["annotations"]["meta.helm.sh/release-name"], "proxy-agent",
            "{what} is the release's: {o}"
        );
        assert_eq!(
            o["metadata"]["labels"]["app.kubernetes.io/managed-by"], "Helm",
            "{what}: {o}"
        );
    }
    let ds = get("daemonset/proxy-agent");
    assert_eq!(
        ds["spec"]["template"]["spec"]["serviceAccountName"],
        "proxy-agent"
    );
    assert_eq!(
        ds["spec"]["template"]["spec"]["containers"][0]["image"],
        "proxy-agent:latest"
    );
    let api = get("configmap/proxy-agent-api-server");
    assert_eq!(api["data"]["KUBERNETES_SERVICE_HOST"], cp.ip.to_string());
    // The binding works: the API server's authorizer lets the
    // ServiceAccount do what the agent does, and no more.
    let sa = "system:serviceaccount:kube-system:proxy-agent";
    for (verb, resource, allowed) in [
        ("list", "endpointslices.discovery.k8s.io", true),
        ("watch", "services", true),
        ("get", "nodes", true),
        ("create", "services", false),
        ("list", "secrets", false),
    ] {
        // `kubectl auth can-i` answers "yes" (exit 0) or "no" (exit 1).
        let answer = lab.kubectl(&["auth", "can-i", verb, resource, "--as", sa], None);
        match answer {
            Ok(text) => assert!(
                allowed && text.trim() == "yes",
                "{sa} may {verb} {resource}: {text}"
            ),
            Err(e) => {
                let text = format!("{e:#}");
                assert!(
                    !allowed && text.trim().ends_with("no"),
                    "{sa} may not {verb} {resource}: {text}"
                );
            }
        }
    }
    run_helm(&["uninstall", "proxy-agent", "--namespace", "kube-system"]);
    let after = lab
        .kubectl(&["get", "-n", "kube-system", "daemonset/proxy-agent"], None)
        .expect_err("uninstalled");
    assert!(format!("{after:#}").contains("NotFound"), "{after:#}");
}

/// The property names of every object in a JSON schema, by path
/// (`config.conntrack`), following `$ref`s into `$defs`.
fn object_properties(root: &Value) -> BTreeMap<String, Vec<String>> {
    fn resolve<'a>(root: &'a Value, s: &'a Value) -> &'a Value {
        if let Some(r) = s["$ref"].as_str() {
            let name = r.rsplit('/').next().unwrap();
            return resolve(root, &root["$defs"][name]);
        }
        for key in ["anyOf", "oneOf", "allOf"] {
            for alt in s[key].as_array().into_iter().flatten() {
                let alt = resolve(root, alt);
                if alt.get("properties").is_some() {
                    return alt;
                }
            }
        }
        s
    }
    fn walk(root: &Value, path: &str, s: &Value, out: &mut BTreeMap<String, Vec<String>>) {
        let s = resolve(root, s);
        let Some(props) = s["properties"].as_object() else {
            return;
        };
        out.insert(path.to_string(), props.keys().cloned().collect());
        for (k, v) in props {
            walk(root, &format!("{path}.{k}"), v, out);
        }
    }
    let mut out = BTreeMap::new();
    walk(root, "config", root, &mut out);
    out
}

/// Every field of the agent's config file can be set through the chart
/// (its schema refuses what it does not name): `config` names each, but
/// for the four with values of their own, which name theirs. A field added
/// to the config types without the chart fails here.
#[test]
fn the_chart_schema_names_every_config_field() {
    let agent = schemars::schema_for!(ConfigFile).to_value();
    let want = object_properties(&agent);
    assert!(
        want["config"].len() >= 30
            && want.contains_key("config.conntrack")
            && want.contains_key("config.loadBalancing.maglev"),
        "the agent's schema as read: {want:?}"
    );
    let chart: Value = serde_json::from_str(
        &std::fs::read_to_string(chart_dir().join("values.schema.json")).unwrap(),
    )
    .unwrap();
    // The chart's config, with the values of their own put back in.
    let mut config = chart["properties"]["config"].clone();
    for (value, field) in [
        ("deliveryMode", "deliveryMode"),
        ("acceleration", "acceleration"),
        ("hostSocketLB", "hostSocketLB"),
        ("loadBalancing", "loadBalancing"),
    ] {
        assert!(
            config["properties"].get(field).is_none(),
            "{field} is set in one place only"
        );
        config["properties"][field] = chart["properties"][value].clone();
    }
    let got = object_properties(&config);
    let sorted = |m: BTreeMap<String, Vec<String>>| -> BTreeMap<String, Vec<String>> {
        m.into_iter()
            .map(|(k, mut v)| {
                v.sort();
                (k, v)
            })
            .collect()
    };
    assert_eq!(
        sorted(got),
        sorted(want),
        "values.schema.json (left) and the agent's ConfigFile (right) name different fields"
    );
}

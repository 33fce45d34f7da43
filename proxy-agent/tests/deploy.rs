//! deploy/: every manifest parses into its Kubernetes type, the RBAC rules
//! cover exactly what the agent watches, the DaemonSet passes only flags the
//! binary accepts, its probes use the config map's healthz port, and the
//! config map's file loads.
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{ConfigMap, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding},
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use proxy_agent::config::{ConfigFile, Settings, SourceKind};
use serde::Deserialize;
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

#[derive(Default)]
struct Objects {
    files: Vec<String>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    bindings: Vec<ClusterRoleBinding>,
    config_maps: Vec<ConfigMap>,
    daemon_sets: Vec<DaemonSet>,
    kustomization: Option<Value>,
}

fn typed<T: serde::de::DeserializeOwned>(file: &str, v: Value) -> T {
    serde_path_to_error::deserialize(v).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// Every YAML file under deploy/ except examples/.
fn load() -> Objects {
    let mut o = Objects::default();
    let mut paths: Vec<_> = fs::read_dir(deploy_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    paths.sort();
    for path in paths {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        assert!(name.ends_with(".yaml"), "unexpected file deploy/{name}");
        let text = fs::read_to_string(&path).unwrap();
        for doc in yaml_serde::Deserializer::from_str(&text) {
            let v = Value::deserialize(doc).unwrap_or_else(|e| panic!("{name}: {e}"));
            if v.is_null() {
                continue;
            }
            match v["kind"]
                .as_str()
                .unwrap_or_else(|| panic!("{name}: no kind"))
            {
                "ServiceAccount" => o.service_accounts.push(typed(&name, v)),
                "ClusterRole" => o.cluster_roles.push(typed(&name, v)),
                "ClusterRoleBinding" => o.bindings.push(typed(&name, v)),
                "ConfigMap" => o.config_maps.push(typed(&name, v)),
                "DaemonSet" => o.daemon_sets.push(typed(&name, v)),
                "Kustomization" => o.kustomization = Some(v),
                other => panic!("{name}: unexpected kind {other}"),
            }
        }
        o.files.push(name);
    }
    o
}

#[test]
fn kustomization_lists_every_manifest() {
    let o = load();
    let k = o.kustomization.as_ref().expect("kustomization.yaml");
    let listed: BTreeSet<&str> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    let files: BTreeSet<&str> = o
        .files
        .iter()
        .map(String::as_str)
        .filter(|f| *f != "kustomization.yaml")
        .collect();
    assert_eq!(listed, files);
}

#[test]
fn rbac_covers_exactly_what_the_agent_watches() {
    let o = load();
    let [role] = &o.cluster_roles[..] else {
        panic!("one ClusterRole")
    };
    let mut granted = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert!(
            rule.non_resource_urls.is_none() && rule.resource_names.is_none(),
            "{rule:?}"
        );
        for group in rule.api_groups.iter().flatten() {
            for res in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    granted.insert((group.clone(), res.clone(), verb.clone()));
                }
            }
        }
    }
    // What KubernetesSource's reflectors need: list and watch (get for tools).
    let mut needed = BTreeSet::new();
    for (group, res) in [
        ("", "services"),
        ("", "nodes"),
        ("discovery.k8s.io", "endpointslices"),
    ] {
        for verb in ["get", "list", "watch"] {
            needed.insert((group.to_string(), res.to_string(), verb.to_string()));
        }
    }
    assert_eq!(granted, needed);

    let [binding] = &o.bindings[..] else {
        panic!("one ClusterRoleBinding")
    };
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(binding.role_ref.name, role.metadata.name.clone().unwrap());
    let [sa] = &o.service_accounts[..] else {
        panic!("one ServiceAccount")
    };
    let subjects = binding.subjects.as_ref().unwrap();
    assert!(subjects.iter().any(|s| s.kind == "ServiceAccount"
        && Some(&s.name) == sa.metadata.name.as_ref()
        && s.namespace == sa.metadata.namespace));
    let ds = &o.daemon_sets[0];
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name, sa.metadata.name);
}

#[test]
fn daemonset_runs_the_agent_as_a_node_critical_unprivileged_host_network_pod() {
    let o = load();
    let [ds] = &o.daemon_sets[..] else {
        panic!("one DaemonSet")
    };
    let spec = ds.spec.as_ref().unwrap();
    let rolling = spec.update_strategy.as_ref().unwrap();
    assert_eq!(rolling.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(
        rolling.rolling_update.as_ref().unwrap().max_unavailable,
        Some(IntOrString::Int(1))
    );
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations = pod.tolerations.as_ref().unwrap();
    assert!(tolerations
        .iter()
        .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()));
    let [c] = &pod.containers[..] else {
        panic!("one container")
    };
    let sc = c.security_context.as_ref().unwrap();
    assert_ne!(sc.privileged, Some(true));
    let caps = sc.capabilities.as_ref().unwrap();
    let added: BTreeSet<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    assert_eq!(added, BTreeSet::from(["BPF", "NET_ADMIN", "PERFMON"]));
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    // Host bpffs and cgroup.
    let host_paths: BTreeSet<&str> = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.host_path.as_ref().map(|h| h.path.as_str()))
        .collect();
    assert_eq!(
        host_paths,
        BTreeSet::from(["/sys/fs/bpf", "/sys/fs/cgroup"])
    );
    for m in c.volume_mounts.iter().flatten() {
        assert_ne!(
            m.mount_propagation.as_deref(),
            Some("Bidirectional"),
            "needs privileged"
        );
    }
    // NODE_NAME from the downward API.
    let env = c.env.as_ref().unwrap();
    let node = env.iter().find(|e| e.name == "NODE_NAME").unwrap();
    let field = node
        .value_from
        .as_ref()
        .unwrap()
        .field_ref
        .as_ref()
        .unwrap();
    assert_eq!(field.field_path, "spec.nodeName");
}

#[test]
fn daemonset_args_are_flags_the_binary_accepts_and_probes_match_the_config() {
    let o = load();
    let pod = o.daemon_sets[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .clone()
        .unwrap();
    let c = &pod.containers[0];
    let mut argv = vec!["proxy-agent".to_string()];
    argv.extend(c.command.iter().flatten().skip(1).cloned());
    argv.extend(c.args.clone().unwrap_or_default());
    let matches = proxy_agent::cli::cli()
        .try_get_matches_from(&argv)
        .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let (sub, run) = matches.subcommand().unwrap();
    assert_eq!(sub, "run");
    let config_path = run.get_one::<PathBuf>("config").expect("--config");

    // The config file is the ConfigMap's, mounted where --config points.
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| config_path.starts_with(&m.mount_path))
        .expect("the config volume is mounted where --config points");
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap();
    let cm_name = volume.config_map.as_ref().unwrap().name.clone();
    let cm = o
        .config_maps
        .iter()
        .find(|cm| cm.metadata.name.as_deref() == Some(cm_name.as_str()))
        .expect("the ConfigMap the DaemonSet mounts");
    let key = config_path
        .strip_prefix(&mount.mount_path)
        .unwrap()
        .to_string_lossy()
        .to_string();
    let text = &cm.data.as_ref().unwrap()[&key];
    let file = ConfigFile::parse(Path::new(&key), text).unwrap();

    // Resolve as the pod would, with the DaemonSet's flags and a node name.
    let cli = <proxy_agent::cli::Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap();
    let proxy_agent::cli::Cmd::Run(mut flags) = cli.cmd else {
        panic!("run")
    };
    flags.node_name = Some("node-1".into());
    let settings = Settings::resolve(&file, &flags, &proxy_agent::host::facts()).unwrap();
    assert_eq!(settings.source, SourceKind::Kubernetes);
    // The probes ask the agent's own port, not kube-proxy's healthz port
    // (which kube-proxy holds while a node is migrated).
    let probes = settings
        .probe_bind_address
        .expect("the probe server enabled");
    assert_ne!(
        Some(probes.port()),
        settings.healthz_bind_address.map(|a| a.port()),
        "the probes must not ask kube-proxy's port"
    );
    for (what, probe) in [
        ("liveness", &c.liveness_probe),
        ("readiness", &c.readiness_probe),
    ] {
        let get = probe.as_ref().expect(what).http_get.as_ref().unwrap();
        assert_eq!(
            get.port,
            IntOrString::Int(i32::from(probes.port())),
            "{what} probe port"
        );
        assert_eq!(
            get.host.as_deref(),
            Some(probes.ip().to_string().as_str()),
            "{what} probe host"
        );
    }
    // A wrong field name in the ConfigMap's file fails: a misspelt copy.
    for (field, typo) in [
        ("minSyncPeriod:", "minSyncPeriode:"),
        ("cgroupRoot:", "cgroupRot:"),
        ("tcpEstablishedTimeout:", "tcpEstablishedTimout:"),
    ] {
        assert!(text.contains(field), "the ConfigMap sets {field}");
        let bad = text.replacen(field, typo, 1);
        let err = ConfigFile::parse(Path::new(&key), &bad)
            .expect_err("a misspelt field must not parse")
            .to_string();
        assert!(
            err.contains(typo.trim_end_matches(':')),
            "the error names the field: {err}"
        );
    }
    let live = c.liveness_probe.as_ref().expect("a liveness probe");
    assert_eq!(
        live.http_get.as_ref().unwrap().path.as_deref(),
        Some("/livez")
    );
}

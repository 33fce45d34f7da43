//! The lab's runc mode: each node's agent started from the image
//! (`cargo xtask image`) under runc, as the DaemonSet runs it.
//!
//! The runc `config.json` is built from `deploy/` itself: the DaemonSet
//! container's args, env (`NODE_NAME` from the downward API, the
//! `proxy-agent-api-server` ConfigMap's keys), capabilities (drop ALL, add
//! the list), `allowPrivilegeEscalation: false` (no_new_privileges),
//! `readOnlyRootFilesystem`, `runAsUser`, its memory limit,
//! `seccompProfile: RuntimeDefault` (the runtime's default profile resolved
//! for the container's capabilities, see [`super::seccomp`]), and every
//! volumeMount: the ConfigMap's keys as files, the hostPath volumes bound
//! from the node's own stand-ins — the host's bpffs is the node's pin
//! directory, the host's cgroup2 root is the node's cgroup — so that nothing
//! of the machine's own bpffs or root cgroup is touched. The container joins
//! the node's network namespace (hostNetwork) by its path.
//!
//! Where a lab node differs from a real one, lab flags follow the
//! DaemonSet's args (flags override the ConfigMap): the manifests source
//! instead of the API server (the lab's manifests directory bound read-only
//! at the same path), the pin directory (`--bpffs /sys/fs/bpf`, the node's),
//! the lab's hairpin address and a short sync period.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container};
use serde_json::{json, Value};

use crate::setup;

/// The image the lab's agents run from: an OCI layout and its tag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentImage {
    pub layout: PathBuf,
    pub tag: String,
}

impl AgentImage {
    /// `KPR_LAB_AGENT=runc`: the image at `KPR_LAB_IMAGE` (an OCI layout,
    /// default `<target>/image/proxy-agent`), tag `latest`.
    pub fn from_env() -> Option<AgentImage> {
        if std::env::var("KPR_LAB_AGENT").ok()?.trim() != "runc" {
            return None;
        }
        let layout = std::env::var_os("KPR_LAB_IMAGE")
            .map(PathBuf::from)
            .unwrap_or_else(|| setup::target_dir().join("image/proxy-agent"));
        Some(AgentImage {
            layout,
            tag: "latest".to_string(),
        })
    }
}

/// What the lab takes from `deploy/`.
#[derive(Clone, Debug)]
pub struct Deployment {
    pub daemonset: DaemonSet,
    /// ConfigMaps by name.
    pub config_maps: BTreeMap<String, ConfigMap>,
}

fn parse_one<T: serde::de::DeserializeOwned>(dir: &Path, file: &str) -> Result<T> {
    let p = dir.join(file);
    let text = std::fs::read_to_string(&p).with_context(|| format!("read {}", p.display()))?;
    yaml_serde::from_str(&text).with_context(|| format!("parse {}", p.display()))
}

impl Deployment {
    /// Reads `daemonset.yaml`, `configmap.yaml` and `api-server.yaml` of
    /// `dir` (`deploy/`).
    pub fn load(dir: &Path) -> Result<Deployment> {
        let daemonset: DaemonSet = parse_one(dir, "daemonset.yaml")?;
        let mut config_maps = BTreeMap::new();
        for f in ["configmap.yaml", "api-server.yaml"] {
            let cm: ConfigMap = parse_one(dir, f)?;
            let name = cm.metadata.name.clone().unwrap_or_default();
            config_maps.insert(name, cm);
        }
        Ok(Deployment {
            daemonset,
            config_maps,
        })
    }

    /// `deploy/` of this repository.
    pub fn from_repo() -> Result<Deployment> {
        Deployment::load(&setup::workspace_root().join("deploy"))
    }

    /// The agent's container of the DaemonSet.
    pub fn container(&self) -> Result<&Container> {
        let spec = self
            .daemonset
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .context("the DaemonSet has no pod spec")?;
        spec.containers
            .iter()
            .find(|c| c.name == "proxy-agent")
            .context("the DaemonSet has no container named proxy-agent")
    }

    fn config_map(&self, name: &str) -> Result<&ConfigMap> {
        self.config_maps
            .get(name)
            .with_context(|| format!("ConfigMap {name} is not in deploy/"))
    }
}

/// One node's container: what [`runc_config`] needs beyond `deploy/`.
#[derive(Clone, Debug)]
pub struct NodeContainer<'a> {
    pub node_name: &'a str,
    /// `/run/netns/<name>` of the node.
    pub netns_path: PathBuf,
    /// The unpacked image's root (read-only, shared by the nodes).
    pub rootfs: &'a Path,
    /// Where this container's ConfigMap files are written.
    pub bundle: &'a Path,
    /// Stand-in of the host's bpffs (the node's pin directory).
    pub bpffs: &'a Path,
    /// Stand-in of the host's cgroup2 root (the node's cgroup), if any.
    pub cgroup: Option<&'a Path>,
    /// The container's own cgroup (absolute, under the cgroup2 mount).
    pub cgroups_path: String,
    /// The lab's manifests directory (bound read-only at the same path).
    pub manifests_dir: &'a Path,
    /// Lab flags, appended to the DaemonSet's args.
    pub lab_args: Vec<String>,
    pub rust_log: Option<String>,
    /// Capabilities to leave out of the DaemonSet's list (least-privilege
    /// tests), as `NET_ADMIN`.
    pub without_caps: &'a [String],
    /// With a real control plane: the ServiceAccount's files (token,
    /// ca.crt, namespace), bound read-only where a kubelet mounts them.
    pub service_account: Option<&'a Path>,
}

fn quantity_bytes(q: &str) -> Result<u64> {
    let units: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    for (suffix, mult) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            return Ok(n.trim().parse::<u64>()? * mult);
        }
    }
    Ok(q.trim().parse()?)
}

fn bind(dest: &str, source: &Path, read_only: bool, propagation: Option<&str>) -> Value {
    let mut options = vec!["rbind", if read_only { "ro" } else { "rw" }];
    options.extend(propagation);
    json!({"destination": dest, "type": "bind", "source": source, "options": options})
}

/// The DaemonSet's args with `--source <x>` taken out (the lab's source
/// replaces it) and the lab's flags appended.
fn container_args(container: &Container, lab_args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = container.args.iter().flatten();
    while let Some(a) = it.next() {
        if a == "--source" {
            it.next();
            continue;
        }
        if a.starts_with("--source=") {
            continue;
        }
        out.push(a.clone());
    }
    out.extend(lab_args.iter().cloned());
    out
}

/// Builds the runc config.json of one node's agent from `deploy/`, writing
/// the ConfigMap volumes' files into the bundle.
pub fn runc_config(dep: &Deployment, node: &NodeContainer) -> Result<Value> {
    let c = dep.container()?;
    let spec = dep
        .daemonset
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("the DaemonSet has no pod spec")?;
    if spec.host_network != Some(true) {
        bail!("the DaemonSet is not hostNetwork: the lab only runs it in the node's namespace");
    }
    let sc = c
        .security_context
        .as_ref()
        .context("the container has no securityContext")?;
    if sc.privileged == Some(true) {
        bail!("the container is privileged: the lab runs only the least-privilege form");
    }
    let caps = sc.capabilities.as_ref();
    let dropped: Vec<&String> = caps
        .and_then(|c| c.drop.as_ref())
        .into_iter()
        .flatten()
        .collect();
    if !dropped.iter().any(|d| d.as_str() == "ALL") {
        bail!("the container does not drop ALL capabilities");
    }
    let caps: Vec<String> = caps
        .and_then(|c| c.add.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| !node.without_caps.contains(c))
        .map(|c| format!("CAP_{}", c.trim_start_matches("CAP_")))
        .collect();
    // seccompProfile (the container's, else the pod's): RuntimeDefault is the
    // runtime's default profile resolved for these capabilities.
    let seccomp_type = sc
        .seccomp_profile
        .as_ref()
        .or_else(|| {
            spec.security_context
                .as_ref()
                .and_then(|p| p.seccomp_profile.as_ref())
        })
        .map(|p| p.type_.as_str());
    let seccomp = match seccomp_type {
        Some("RuntimeDefault") => Some(super::seccomp::runtime_default(&caps)),
        None | Some("Unconfined") => None,
        Some(other) => bail!("seccompProfile {other}: the lab runs RuntimeDefault or Unconfined"),
    };
    let uid = sc.run_as_user.unwrap_or(0);
    let gid = sc.run_as_group.unwrap_or(0);

    // Env: envFrom ConfigMaps, then env (which wins, as in Kubernetes).
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("PATH".into(), "/usr/local/bin".into());
    for from in c.env_from.iter().flatten() {
        if let Some(r) = &from.config_map_ref {
            let cm = dep.config_map(&r.name)?;
            for (k, v) in cm.data.iter().flatten() {
                env.insert(k.clone(), v.clone());
            }
        }
    }
    for e in c.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), _) => v.clone(),
            (None, Some(from)) => match from.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                Some("spec.nodeName") => node.node_name.to_string(),
                other => bail!("env {}: unsupported valueFrom {other:?}", e.name),
            },
            (None, None) => String::new(),
        };
        env.insert(e.name.clone(), value);
    }
    if let Some(l) = &node.rust_log {
        env.insert("RUST_LOG".into(), l.clone());
    }

    // Standard mounts of a container, then the DaemonSet's volumes.
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
    ];
    let volumes = spec.volumes.iter().flatten();
    let volumes: BTreeMap<&str, _> = volumes.map(|v| (v.name.as_str(), v)).collect();
    for m in c.volume_mounts.iter().flatten() {
        let v = volumes
            .get(m.name.as_str())
            .with_context(|| format!("volumeMount {} names no volume", m.name))?;
        let ro = m.read_only == Some(true);
        let propagation = match m.mount_propagation.as_deref() {
            Some("HostToContainer") => Some("rslave"),
            Some("Bidirectional") => bail!(
                "volumeMount {}: Bidirectional needs a privileged container",
                m.name
            ),
            _ => Some("rprivate"),
        };
        if let Some(cmv) = &v.config_map {
            let cm = dep.config_map(&cmv.name)?;
            let dir = node.bundle.join("volumes").join(&m.name);
            std::fs::create_dir_all(&dir)?;
            for (k, val) in cm.data.iter().flatten() {
                std::fs::write(dir.join(k), val)?;
            }
            // A ConfigMap volume is always read-only.
            mounts.push(bind(&m.mount_path, &dir, true, propagation));
        } else if let Some(hp) = &v.host_path {
            // The host paths the lab stands in for; nothing else of the
            // machine is bound into a lab container.
            let source = match hp.path.as_str() {
                "/sys/fs/bpf" => node.bpffs,
                "/sys/fs/cgroup" => match node.cgroup {
                    Some(cg) => cg,
                    None => continue,
                },
                other => bail!("hostPath {other}: the lab has no stand-in for it"),
            };
            mounts.push(bind(&m.mount_path, source, ro, propagation));
        } else {
            bail!(
                "volume {}: only configMap and hostPath volumes are supported",
                m.name
            );
        }
    }
    let manifests = node.manifests_dir.to_string_lossy().into_owned();
    mounts.push(bind(&manifests, node.manifests_dir, true, Some("rprivate")));
    if let Some(sa) = node.service_account {
        // What the kubelet mounts for the pod's ServiceAccount
        // (automountServiceAccountToken).
        mounts.push(bind(
            "/var/run/secrets/kubernetes.io/serviceaccount",
            sa,
            true,
            Some("rprivate"),
        ));
    }

    let mut args = Vec::new();
    if let Some(cmd) = &c.command {
        args.extend(cmd.iter().cloned());
    } else {
        args.push(format!("/{}", crate::image::BINARY));
    }
    args.extend(container_args(c, &node.lab_args));

    let mut resources = json!({"devices": [{"allow": false, "access": "rwm"}]});
    if let Some(limit) = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
    {
        resources["memory"] = json!({"limit": quantity_bytes(&limit.0)?});
    }

    let mut config = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": uid, "gid": gid},
            "args": args,
            "env": env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
            "cwd": "/",
            "capabilities": {
                "bounding": caps, "effective": caps, "permitted": caps,
                "inheritable": [], "ambient": []
            },
            // A small RLIMIT_MEMLOCK: kernels that charge BPF memory to the
            // memory cgroup (5.11+) must not need more.
            "rlimits": [{"type": "RLIMIT_MEMLOCK", "hard": 65_536, "soft": 65_536}],
            "noNewPrivileges": sc.allow_privilege_escalation == Some(false),
        },
        "root": {"path": node.rootfs, "readonly": sc.read_only_root_filesystem == Some(true)},
        "mounts": mounts,
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "ipc"}, {"type": "mount"},
                {"type": "network", "path": node.netns_path},
            ],
            "cgroupsPath": node.cgroups_path,
            "resources": resources,
            "maskedPaths": [
                "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
                "/proc/scsi", "/sys/firmware"
            ],
            "readonlyPaths": [
                "/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq",
                "/proc/sys", "/proc/sysrq-trigger"
            ]
        }
    });
    if let Some(seccomp) = seccomp {
        config["linux"]["seccomp"] = seccomp;
    }
    Ok(config)
}

/// Unpacks `image` with umoci into `dir` (a bundle; its `rootfs/` is the
/// image's root). `dir` must not exist.
pub fn unpack(image: &AgentImage, dir: &Path) -> Result<PathBuf> {
    let out = Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:{}", image.layout.display(), image.tag))
        .arg(dir)
        .output()
        .context("cannot run umoci (cargo xtask setup installs it)")?;
    if !out.status.success() {
        bail!(
            "umoci unpack {}: {}",
            image.layout.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(dir.join("rootfs"))
}

/// The pid of container `id`'s init (`runc state`), waiting up to `timeout`
/// for it to run; `None` if it ran and stopped already (its log says why).
pub fn wait_running(
    id: &str,
    runc: &mut std::process::Child,
    timeout: Duration,
) -> Result<Option<u32>> {
    let deadline = Instant::now() + timeout;
    loop {
        let exited = runc.try_wait()?;
        if let Ok(o) = Command::new("runc").args(["state", id]).output() {
            if o.status.success() {
                let v: Value = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
                let pid = v["pid"].as_u64().unwrap_or(0);
                if v["status"] == "running" && pid > 0 {
                    return Ok(Some(pid as u32));
                }
                if v["status"] == "stopped" {
                    return Ok(None);
                }
            }
        }
        if exited.is_some() {
            // runc is gone: the agent ran and exited, or runc failed to
            // start it; either way the log (runc's and the agent's) says why.
            return Ok(None);
        }
        if Instant::now() > deadline {
            bail!("container {id} not running after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `runc delete -f <id>` (no error if it is gone).
pub fn delete(id: &str) -> Result<()> {
    let out = Command::new("runc")
        .args(["delete", "-f", id])
        .output()
        .context("cannot run runc")?;
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() || err.contains("does not exist") || err.contains("not exist") {
        return Ok(());
    }
    bail!("runc delete -f {id}: {}", err.trim())
}

/// Ids of runc's containers whose id starts with `prefix`.
pub fn list(prefix: &str) -> Vec<String> {
    Command::new("runc")
        .args(["list", "-q"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with(prefix))
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(quantity_bytes("256Mi").unwrap(), 256 << 20);
        assert_eq!(quantity_bytes("1G").unwrap(), 1_000_000_000);
        assert_eq!(quantity_bytes("4096").unwrap(), 4096);
        assert!(quantity_bytes("lots").is_err());
    }

    #[test]
    fn config_follows_the_daemonset() {
        let dep = Deployment::from_repo().unwrap();
        let tmp = std::env::temp_dir().join(format!("kpr-runc-config-{}", std::process::id()));
        let node = NodeContainer {
            node_name: "node-1",
            netns_path: "/run/netns/kpr-x-node".into(),
            rootfs: Path::new("/nonexistent/rootfs"),
            bundle: &tmp,
            bpffs: Path::new("/sys/fs/bpf/kpr-lab-x"),
            cgroup: Some(Path::new("/sys/fs/cgroup/kpr-lab-x/node-1")),
            cgroups_path: "/kpr-lab-x/node-1-agent".into(),
            manifests_dir: Path::new("/run/kpr-lab/x/manifests"),
            lab_args: vec!["--source".into(), "manifests".into()],
            rust_log: None,
            without_caps: &["NET_ADMIN".to_string()],
            service_account: None,
        };
        let v = runc_config(&dep, &node).unwrap();
        let _ = std::fs::remove_dir_all(&tmp);
        let caps = v["process"]["capabilities"]["bounding"].as_array().unwrap();
        assert!(caps.iter().any(|c| c == "CAP_BPF"));
        assert!(
            !caps.iter().any(|c| c == "CAP_NET_ADMIN"),
            "removed on request"
        );
        assert_eq!(v["process"]["noNewPrivileges"], true);
        // RuntimeDefault: the default profile, with the CAP_BPF rule for the
        // agent's bpf() calls.
        let seccomp = &v["linux"]["seccomp"];
        assert_eq!(seccomp["defaultAction"], "SCMP_ACT_ERRNO", "{seccomp}");
        assert!(super::super::seccomp::allows(seccomp, "bpf"));
        assert!(!super::super::seccomp::allows(seccomp, "mount"));
        assert_eq!(v["root"]["readonly"], true);
        let args: Vec<&str> = v["process"]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(
            args.iter().filter(|a| **a == "--source").count(),
            1,
            "{args:?}"
        );
        let env = v["process"]["env"].as_array().unwrap();
        assert!(env.iter().any(|e| e == "NODE_NAME=node-1"));
        let mounts = v["mounts"].as_array().unwrap();
        let src = |dest: &str| {
            mounts
                .iter()
                .find(|m| m["destination"] == dest)
                .map(|m| m["source"].clone())
        };
        assert_eq!(src("/sys/fs/bpf").unwrap(), "/sys/fs/bpf/kpr-lab-x");
        assert_eq!(
            src("/sys/fs/cgroup").unwrap(),
            "/sys/fs/cgroup/kpr-lab-x/node-1"
        );
    }
}

//! The lab's processes: one proxy-agent per node, one `lab-server` per pod;
//! finding their binaries, starting and stopping them.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::wait::{count_markers, tail};
use super::{
    container, AgentImage, AgentInfo, Lab, PodInfo, ServerInfo, DEFAULT_POD_PORT, HAIRPIN_SNAT_IP,
    SCTP_LISTENER_ANNOTATION,
};
use crate::{netns, setup};

/// `KPR_AGENT_BIN`, else the release agent, built (or brought up to date —
/// a no-op when it is) first, so that a lab never runs a stale binary.
pub(super) fn find_agent_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KPR_AGENT_BIN") {
        return Ok(PathBuf::from(p));
    }
    setup::build_agent()
}

pub(crate) fn find_server_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KPR_LAB_SERVER_BIN") {
        return Ok(PathBuf::from(p));
    }
    if let Ok(exe) = std::env::current_exe() {
        let mut dir = exe.parent();
        for _ in 0..2 {
            let Some(d) = dir else { break };
            let p = d.join("lab-server");
            if p.is_file() {
                return Ok(p);
            }
            dir = d.parent();
        }
    }
    let p = setup::target_dir().join("debug/lab-server");
    if p.is_file() {
        return Ok(p);
    }
    setup::build_lab_server()
}

pub(super) fn cmdline(pid: u32) -> Option<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
}

pub(crate) fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // Field 3 is the state; Z is a zombie waiting for its parent.
        Ok(s) => s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// The ports a pod's server listens on over SCTP: its declared SCTP ports,
/// none with [`SCTP_LISTENER_ANNOTATION`] `"false"`. (Every declared port
/// is also served over TCP and UDP, as before SCTP.)
pub(super) fn sctp_ports(pod: &PodInfo) -> Vec<u16> {
    if pod.no_sctp_listener {
        return Vec::new();
    }
    let mut v: Vec<u16> = pod
        .ports
        .iter()
        .filter(|p| p.protocol.eq_ignore_ascii_case("SCTP"))
        .map(|p| p.port)
        .collect();
    v.sort();
    v.dedup();
    v
}

impl Lab {
    pub(super) fn spawn_server(&mut self, pod: &PodInfo) -> Result<()> {
        let bin = match &self.server_bin {
            Some(b) => b.clone(),
            None => find_server_bin()?,
        };
        let mut ports: Vec<u16> = pod.ports.iter().map(|p| p.port).collect();
        if ports.is_empty() {
            ports.push(DEFAULT_POD_PORT);
        }
        ports.sort();
        ports.dedup();
        let sctp = sctp_ports(pod);
        if !sctp.is_empty() && !crate::sctp::available() {
            bail!(
                "pod {} declares SCTP ports {sctp:?} but this kernel has no SCTP loaded, and \
                 the lab does not load the sctp module (its server's socket would); annotate \
                 the pod {SCTP_LISTENER_ANNOTATION}: \"false\" to start it without SCTP listeners",
                pod.name
            );
        }
        let log = self.info.dir.join(format!("server-{}.log", pod.netns));
        let mut cmd = Command::new(&bin);
        cmd.args(["--name", &pod.name, "--lab", &self.info.id]);
        if pod.ip6.is_some() {
            cmd.arg("--ipv6");
        }
        for p in &ports {
            cmd.args(["--tcp", &p.to_string(), "--udp", &p.to_string()]);
        }
        for p in &sctp {
            cmd.args(["--sctp", &p.to_string()]);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(File::create(&log)?);
        netns::enter_netns_on_spawn(&mut cmd, &pod.netns)?;
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let pid = child.id();
        let stdout = child.stdout.take().expect("piped stdout");
        self.children.insert(pid, child);
        self.info.servers.push(ServerInfo {
            pod: pod.name.clone(),
            namespace: pod.namespace.clone(),
            pid,
            log: log.clone(),
        });
        self.save()?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(l) if l.trim() == "ready" => Ok(()),
            _ => bail!(
                "server of pod {} did not start: {}",
                pod.name,
                tail(&log, 10)
            ),
        }
    }

    pub(super) fn stop_server(&mut self, namespace: &str, pod: &str) -> Result<()> {
        let servers: Vec<ServerInfo> = self
            .info
            .servers
            .iter()
            .filter(|s| s.pod == pod && s.namespace == namespace)
            .cloned()
            .collect();
        for s in servers {
            self.kill(s.pid, Duration::ZERO)?;
            self.info.servers.retain(|x| x.pid != s.pid);
        }
        Ok(())
    }

    /// Sends SIGTERM (SIGKILL if `grace` is zero), waits up to `grace`, then
    /// SIGKILL. Processes not started by this Lab value are only signalled if
    /// their command line names this lab's id (guards against pid reuse).
    pub(super) fn kill(&mut self, pid: u32, grace: Duration) -> Result<()> {
        use nix::sys::signal::{kill, Signal};
        if pid == 0 {
            // An agent that exited before its pid was known (runc mode).
            return Ok(());
        }
        let npid = nix::unistd::Pid::from_raw(pid as i32);
        let first = if grace.is_zero() {
            Signal::SIGKILL
        } else {
            Signal::SIGTERM
        };
        if let Some(mut child) = self.children.remove(&pid) {
            if child.try_wait()?.is_some() {
                return Ok(());
            }
            let _ = kill(npid, first);
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if child.try_wait()?.is_some() {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            child.wait()?;
            return Ok(());
        }
        match cmdline(pid) {
            Some(c) if c.contains(&self.info.id) => {}
            _ => return Ok(()),
        }
        let _ = kill(npid, first);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && !process_gone(pid) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if !process_gone(pid) {
            let _ = kill(npid, Signal::SIGKILL);
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline && !process_gone(pid) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// True if the agent binary lists `--external-interfaces` in
    /// `run --help` (asked once per Lab value).
    fn agent_knows_external_interfaces(&mut self, bin: &Path) -> bool {
        if let Some(k) = self.agent_has_ext_flag {
            return k;
        }
        let known = Command::new(bin)
            .args(["run", "--help"])
            .stdin(Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).contains("--external-interfaces"))
            .unwrap_or(false);
        self.agent_has_ext_flag = Some(known);
        known
    }

    /// Starts every node's agent that is not running (each in its node
    /// namespace, appending to its log).
    pub fn start_agent(&mut self) -> Result<()> {
        if self.info.nodes.iter().all(|n| n.agent.is_some()) {
            bail!("the agent is already running");
        }
        for i in 0..self.info.nodes.len() {
            if self.info.nodes[i].agent.is_none() {
                self.start_agent_idx(i)?;
            }
        }
        Ok(())
    }

    /// Starts the agent of node `node` (`node-2`).
    pub fn start_agent_on(&mut self, node: &str) -> Result<()> {
        let i = self.node_index(node)?;
        self.start_agent_idx(i)
    }

    fn start_agent_idx(&mut self, i: usize) -> Result<()> {
        let node = self.info.nodes[i].clone();
        if node.agent.is_some() {
            bail!("the agent of {} is already running", node.name);
        }
        if let Some(image) = self.image.clone() {
            return self.start_container_idx(i, &image);
        }
        let bin = match &self.agent_bin {
            Some(b) => b.clone(),
            None => find_agent_bin()?,
        };
        self.agent_bin = Some(bin.clone());
        let log_path = node.agent_log.clone();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let hairpin = HAIRPIN_SNAT_IP.to_string();
        let mut cmd = Command::new(&bin);
        cmd.arg("run");
        match (&self.agent_source_args, &self.info.control_plane) {
            (Some(args), _) => cmd.args(args),
            // As the DaemonSet runs it: deploy/'s ServiceAccount.
            (None, Some(cp)) => cmd
                .args(["--source", "kubernetes", "--kubeconfig"])
                .arg(&cp.agent_kubeconfig),
            (None, None) => cmd
                .args(["--source", "manifests", "--manifests"])
                .arg(&self.info.manifests_dir),
        };
        cmd.args(["--node-name", &node.name, "--bpffs"])
            .arg(&node.bpffs)
            .args(["--pod-interfaces", "lxc*", "--hairpin-snat-ip", &hairpin])
            .args(["--min-sync-period", "100ms"]);
        // The socket hooks go to the node's own cgroup, never the machine's.
        match &node.cgroup {
            Some(cg) => cmd.arg("--cgroup-root").arg(cg),
            None => cmd.args(["--host-socket-lb", "false"]),
        };
        if !node.eth.is_empty() && self.agent_knows_external_interfaces(&bin) {
            cmd.args(["--external-interfaces", &node.eth]);
        }
        cmd.args(&self.agent_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let rust_log = self
            .rust_log
            .clone()
            .or_else(|| std::env::var("RUST_LOG").ok())
            .unwrap_or_else(|| "info".to_string());
        cmd.env("RUST_LOG", rust_log);
        netns::enter_netns_on_spawn(&mut cmd, &node.netns)?;
        // The agent is one of the node's own processes, as on a real node.
        if let Some(cg) = &node.cgroup {
            super::cgroup::join_on_spawn(&mut cmd, cg)?;
        }
        self.agent_start_marks[i] = count_markers(&log_path);
        self.write_marks[i] = self.agent_start_marks[i];
        let child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let pid = child.id();
        self.children.insert(pid, child);
        self.info.nodes[i].agent = Some(AgentInfo {
            pid,
            log: log_path,
            container: None,
        });
        self.save()
    }

    /// `program` run as one of node `node`'s own processes (a host process,
    /// or a hostNetwork pod): in its network namespace and its cgroup, so
    /// the agent's socket hooks translate its connections.
    pub fn node_command(
        &self,
        node: &str,
        program: impl AsRef<std::ffi::OsStr>,
    ) -> Result<Command> {
        let n = self.node_info(node)?;
        let mut cmd = Command::new(program);
        netns::enter_netns_on_spawn(&mut cmd, &n.netns)?;
        if let Some(cg) = &n.cgroup {
            super::cgroup::join_on_spawn(&mut cmd, cg)?;
        }
        Ok(cmd)
    }

    /// The files a kubelet mounts at
    /// `/var/run/secrets/kubernetes.io/serviceaccount` for deploy/'s
    /// ServiceAccount: its token (a TokenRequest's), the cluster's CA and
    /// the namespace.
    fn write_service_account_dir(&mut self) -> Result<PathBuf> {
        let cp = self
            .info
            .control_plane
            .clone()
            .context("no control plane")?;
        let dir = cp.dir.join("serviceaccount");
        std::fs::create_dir_all(&dir)?;
        std::fs::copy(cp.agent_token(), dir.join("token")).context("copy the agent's token")?;
        std::fs::copy(cp.ca(), dir.join("ca.crt")).context("copy the CA")?;
        std::fs::write(dir.join("namespace"), super::control_plane::AGENT_NAMESPACE)?;
        Ok(dir)
    }

    /// Stops every agent: SIGTERM, up to 3 s, then SIGKILL. Pinned maps stay.
    pub fn stop_agent(&mut self) -> Result<()> {
        for i in 0..self.info.nodes.len() {
            self.stop_agent_idx(i)?;
        }
        Ok(())
    }

    /// Stops the agent of node `node` (as [`stop_agent`](Lab::stop_agent)).
    pub fn stop_agent_on(&mut self, node: &str) -> Result<()> {
        let i = self.node_index(node)?;
        self.stop_agent_idx(i)
    }

    fn stop_agent_idx(&mut self, i: usize) -> Result<()> {
        if let Some(a) = self.info.nodes[i].agent.take() {
            self.kill(a.pid, Duration::from_secs(3))?;
            if let Some(id) = &a.container {
                self.delete_container(id)?;
            }
            self.save()?;
        }
        Ok(())
    }

    /// Runc mode: the image the agents start from (the next start of an
    /// agent uses it; a running one keeps its own).
    pub fn set_agent_image(&mut self, image: AgentImage) {
        self.image = Some(image);
    }

    /// The rootfs of `image`, unpacked (once per image) under the lab's
    /// directory.
    fn rootfs_of(&mut self, image: &AgentImage) -> Result<PathBuf> {
        if let Some((_, r)) = self.rootfs.iter().find(|(i, _)| i == image) {
            return Ok(r.clone());
        }
        let dir = self
            .info
            .dir
            .join(format!("image-{}", self.rootfs.len() + 1));
        let rootfs = container::unpack(image, &dir)?;
        self.rootfs.push((image.clone(), rootfs.clone()));
        Ok(rootfs)
    }

    /// Starts node `i`'s agent from `image` under runc (see `container.rs`).
    fn start_container_idx(&mut self, i: usize, image: &AgentImage) -> Result<()> {
        let node = self.info.nodes[i].clone();
        if self.agent_source_args.is_some() {
            bail!("runc mode runs the manifests source only");
        }
        let rootfs = self.rootfs_of(image)?;
        self.container_seq += 1;
        let id = format!("kpr-{}-{}-{}", self.info.id, node.name, self.container_seq);
        let bundle = self.info.dir.join("runc").join(&id);
        std::fs::create_dir_all(&bundle)?;
        let cg = node
            .cgroup
            .clone()
            .context("runc mode needs the lab's cgroups (a cgroup2 mount)")?;
        let mount = super::cgroup2_mount().context("no cgroup2 mount")?;
        // The container's own cgroup is a sibling of the node's (the node's
        // holds host clients directly, so it can have no child with
        // controllers); the socket hooks still go to the node's cgroup.
        let own = cg.with_file_name(format!("{}-agent", node.name));
        let cgroups_path = format!(
            "/{}",
            own.strip_prefix(&mount)
                .context("the node's cgroup is not under the cgroup2 mount")?
                .display()
        );
        let manifests = self.info.manifests_dir.to_string_lossy().into_owned();
        let hairpin = HAIRPIN_SNAT_IP.to_string();
        // With a real control plane the container runs as the DaemonSet
        // does: in-cluster, from the ServiceAccount's files and the
        // proxy-agent-api-server ConfigMap's KUBERNETES_SERVICE_HOST/PORT
        // (deploy/api-server.yaml names the lab's API server).
        let service_account = match &self.info.control_plane {
            Some(_) => Some(self.write_service_account_dir()?),
            None => None,
        };
        let source: [&str; 4] = match service_account {
            Some(_) => ["--source", "kubernetes", "", ""],
            None => ["--source", "manifests", "--manifests", &manifests],
        };
        let mut lab_args: Vec<String> = source
            .iter()
            .filter(|s| !s.is_empty())
            .chain(
                [
                    "--bpffs",
                    "/sys/fs/bpf",
                    "--hairpin-snat-ip",
                    &hairpin,
                    "--min-sync-period",
                    "100ms",
                ]
                .iter(),
            )
            .map(|s| s.to_string())
            .collect();
        if !node.eth.is_empty() {
            lab_args.extend(["--external-interfaces".to_string(), node.eth.clone()]);
        }
        lab_args.extend(self.agent_args.iter().cloned());
        let rust_log = self
            .rust_log
            .clone()
            .or_else(|| std::env::var("RUST_LOG").ok());
        let dep = container::Deployment::from_repo()?;
        let spec = container::runc_config(
            &dep,
            &container::NodeContainer {
                node_name: &node.name,
                netns_path: netns::netns_path(&node.netns),
                rootfs: &rootfs,
                bundle: &bundle,
                bpffs: &node.bpffs,
                cgroup: Some(&cg),
                cgroups_path,
                manifests_dir: &self.info.manifests_dir,
                lab_args,
                rust_log,
                without_caps: &self.without_caps,
                service_account: service_account.as_deref(),
            },
        )?;
        std::fs::write(
            bundle.join("config.json"),
            serde_json::to_vec_pretty(&spec)?,
        )?;
        std::fs::create_dir_all(&node.bpffs)?;
        let log_path = node.agent_log.clone();
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        self.agent_start_marks[i] = count_markers(&log_path);
        self.write_marks[i] = self.agent_start_marks[i];
        let child = Command::new("runc")
            .args(["run", "--bundle"])
            .arg(&bundle)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("cannot run runc (cargo xtask setup installs it)")?;
        let mut child = child;
        let waited = container::wait_running(&id, &mut child, Duration::from_secs(10));
        self.runc.insert(id.clone(), child);
        // 0: the agent ran and exited already (agent_running is false).
        let pid = match waited {
            Ok(pid) => pid.unwrap_or(0),
            Err(e) => {
                let _ = self.delete_container(&id);
                bail!("{e:#}: {}", tail(&log_path, 10));
            }
        };
        self.info.nodes[i].agent = Some(AgentInfo {
            pid,
            log: log_path,
            container: Some(id),
        });
        self.save()
    }

    /// Deletes container `id` (`runc delete -f`) and reaps its `runc run`.
    pub(super) fn delete_container(&mut self, id: &str) -> Result<()> {
        let r = container::delete(id);
        if let Some(mut child) = self.runc.remove(id) {
            let deadline = Instant::now() + Duration::from_secs(3);
            while child.try_wait()?.is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        r
    }

    /// Stops and starts every agent (each adopts its pinned state).
    pub fn restart_agent(&mut self) -> Result<()> {
        self.stop_agent()?;
        self.start_agent()
    }

    /// Stops and starts the agent of node `node`.
    pub fn restart_agent_on(&mut self, node: &str) -> Result<()> {
        self.stop_agent_on(node)?;
        self.start_agent_on(node)
    }

    /// True if node-1's agent is running.
    pub fn agent_running(&mut self) -> bool {
        self.agent_running_idx(0)
    }

    /// True if the agent of node `node` is running.
    pub fn agent_running_on(&mut self, node: &str) -> bool {
        match self.node_index(node) {
            Ok(i) => self.agent_running_idx(i),
            Err(_) => false,
        }
    }

    pub(super) fn agent_running_idx(&mut self, i: usize) -> bool {
        let Some(a) = &self.info.nodes[i].agent else {
            return false;
        };
        let pid = a.pid;
        match self.children.get_mut(&pid) {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => !process_gone(pid),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::PortInfo;

    fn pod(ports: &[(u16, &str)], no_sctp_listener: bool) -> PodInfo {
        PodInfo {
            name: "p".into(),
            namespace: "default".into(),
            node: "node-1".into(),
            netns: String::new(),
            ip: "198.18.1.10".parse().unwrap(),
            ip6: None,
            host_if: String::new(),
            ports: ports
                .iter()
                .map(|(port, protocol)| PortInfo {
                    port: *port,
                    protocol: protocol.to_string(),
                })
                .collect(),
            no_sctp_listener,
        }
    }

    #[test]
    fn sctp_listeners_only_for_declared_sctp_ports() {
        let p = pod(
            &[(80, "TCP"), (5061, "SCTP"), (5062, "sctp"), (53, "UDP")],
            false,
        );
        assert_eq!(sctp_ports(&p), [5061, 5062]);
        assert!(sctp_ports(&pod(&[(80, "TCP")], false)).is_empty());
        // Declared, not listened on: the pod still backs SCTP Services.
        assert!(sctp_ports(&pod(&[(5061, "SCTP")], true)).is_empty());
    }
}

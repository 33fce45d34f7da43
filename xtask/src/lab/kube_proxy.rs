//! The real kube-proxy (v1.37.2, built by setup: [`crate::kube`]) on a lab
//! node, in place of the agent: the benchmark's peer and the conformance
//! oracle's reference (issue 39).
//!
//! It needs the lab's real control plane ([`super::control_plane`]): it
//! watches the same API server as the agents, as the user
//! `system:kube-proxy` (a client certificate the lab's CA signs), which the
//! API server's bootstrap policy binds to `system:node-proxier`, as on a
//! kubeadm cluster. It runs in the node's namespace and cgroup with a
//! `KubeProxyConfiguration` of the lab's own:
//!
//! - `mode`: iptables or nftables. IPVS only where the kernel has it
//!   ([`ipvs_available`]; the machines' 6.18 kernel is built without
//!   `CONFIG_IP_VS`).
//! - `conntrack.maxPerCore: 0` and the conntrack timeouts 0: kube-proxy
//!   leaves `nf_conntrack_max` and the timeouts alone (some of those
//!   sysctls are the machine's, not the namespace's).
//! - `detectLocalMode: InterfaceNamePrefix` with `lxc`: the lab's pod veths,
//!   as the agent's `--pod-interfaces lxc*`.
//! - everything else at kube-proxy's defaults (metrics on 127.0.0.1:10249,
//!   healthz on :10256, `nodePortAddresses` unset), unless the caller
//!   passes a shorter `minSyncPeriod`.
//!
//! Its rules live in the node's namespace and go with it; [`Lab::stop_kube_proxy_on`]
//! also runs `kube-proxy --cleanup`, as an operator does before handing a
//! node to a replacement, and reports what it left.

use std::fs::OpenOptions;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::info::write_atomic;
use super::Lab;
use crate::client::http_get_in;
use crate::kube;
use crate::netns;

/// A kube-proxy proxy mode.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum KubeProxyMode {
    Iptables,
    Nftables,
    Ipvs,
}

impl KubeProxyMode {
    /// The value of `mode:` in its configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            KubeProxyMode::Iptables => "iptables",
            KubeProxyMode::Nftables => "nftables",
            KubeProxyMode::Ipvs => "ipvs",
        }
    }

    /// The modes this machine's kernel can run: iptables and nftables, and
    /// IPVS where the kernel has it.
    pub fn available() -> Vec<KubeProxyMode> {
        let mut v = vec![KubeProxyMode::Iptables, KubeProxyMode::Nftables];
        if ipvs_available() {
            v.push(KubeProxyMode::Ipvs);
        }
        v
    }
}

impl std::fmt::Display for KubeProxyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kube-proxy {}", self.as_str())
    }
}

/// Whether the running kernel has IPVS (built in or as a module the lab
/// could load): `/proc/net/ip_vs` exists once it is loaded, and a module
/// tree names it otherwise. The lab never loads modules itself.
pub fn ipvs_available() -> bool {
    if std::path::Path::new("/proc/net/ip_vs").exists() {
        return true;
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let release = release.trim();
    let builtin = std::fs::read_to_string(format!("/lib/modules/{release}/modules.builtin"))
        .unwrap_or_default();
    let modules =
        std::fs::read_to_string(format!("/lib/modules/{release}/modules.dep")).unwrap_or_default();
    builtin.contains("/ip_vs.ko") || modules.contains("/ip_vs.ko")
}

/// A running kube-proxy, in lab.json.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KubeProxyInfo {
    pub pid: u32,
    pub mode: KubeProxyMode,
    /// Its `KubeProxyConfiguration`.
    pub config: PathBuf,
    /// Its log, shared by the node's kube-proxy runs (appended to).
    pub log: PathBuf,
    /// Where this run's lines start in `log`.
    #[serde(default)]
    pub log_start: u64,
}

/// Options of [`Lab::start_kube_proxy_on`] beyond the mode.
#[derive(Debug, Clone, Default)]
pub struct KubeProxyOptions {
    /// `minSyncPeriod` of the mode (kube-proxy's default, 1s, when `None`).
    pub min_sync_period: Option<Duration>,
}

/// Bound of connecting to and reading kube-proxy's /metrics and /healthz.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(2);
/// kube-proxy's metrics address (its default).
pub const METRICS_ADDR: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10249);
/// kube-proxy's healthz port (its default, on every address).
pub const HEALTHZ_PORT: u16 = 10256;
/// Bound of kube-proxy's start: its first sync reported by /healthz.
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// What answers `/proxyMode` on kube-proxy's metrics address in `ns`: its
/// mode (`iptables`, ...), `ebpf` while the agent holds the port, `None`
/// when nothing does.
fn proxy_mode(ns: &str) -> Option<String> {
    match http_get_in(ns, METRICS_ADDR, "/proxyMode", HTTP_TIMEOUT) {
        Ok((200, body)) => Some(body.trim().to_string()),
        _ => None,
    }
}

/// The text of `log` from byte `start` on (empty if unreadable).
fn log_since(log: &std::path::Path, start: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let mut text = Vec::new();
    let _ = std::fs::File::open(log).and_then(|mut f| {
        f.seek(SeekFrom::Start(start))
            .and_then(|_| f.read_to_end(&mut text))
    });
    String::from_utf8_lossy(&text).into_owned()
}

/// Whether kube-proxy's log (`--v=2`) shows a sync of its rules that did
/// not fail: each sync logs `Syncing <mode> rules`, then `Sync failed` if
/// it failed, then `SyncProxyRules complete` either way.
fn log_shows_a_sync(log: &str) -> bool {
    let mut failed = false;
    for line in log.lines() {
        if line.contains("\"Syncing iptables rules\"")
            || line.contains("\"Syncing nftables rules\"")
            || line.contains("\"Syncing ipvs rules\"")
        {
            failed = false;
        } else if line.contains("\"Sync failed\"") {
            failed = true;
        } else if line.contains("\"SyncProxyRules complete\"") && !failed {
            return true;
        }
    }
    false
}

/// Whether kube-proxy in namespace `ns` has synced its rules once
/// (`kubeproxy_sync_proxy_rules_last_timestamp_seconds` set).
fn first_sync_done(ns: &str) -> bool {
    http_get_in(ns, METRICS_ADDR, "/metrics", HTTP_TIMEOUT).is_ok_and(|(code, body)| {
        code == 200
            && body.lines().any(|l| {
                // With or without labels (`{ip_family="IPv4"}`).
                l.strip_prefix("kubeproxy_sync_proxy_rules_last_timestamp_seconds")
                    .filter(|rest| rest.starts_with([' ', '{']))
                    .and_then(|rest| rest.split_whitespace().last())
                    .and_then(|v| v.parse::<f64>().ok())
                    .is_some_and(|v| v > 0.0)
            })
    })
}

impl Lab {
    /// kube-proxy's kubeconfig: a client certificate of `system:kube-proxy`
    /// signed by the lab's CA (made once).
    fn kube_proxy_kubeconfig(&self) -> Result<PathBuf> {
        let cp = self
            .control_plane()
            .context("kube-proxy needs the lab's real control plane (LabBuilder::control_plane(true), `lab up --control-plane`)")?
            .clone();
        let path = cp.dir.join("kube-proxy.kubeconfig");
        if path.is_file() {
            return Ok(path);
        }
        let pki = super::control_plane::Pki {
            dir: cp.dir.join("pki"),
        };
        pki.leaf(
            "kube-proxy",
            "/CN=system:kube-proxy",
            "extendedKeyUsage=clientAuth\n",
        )?;
        let user = super::control_plane::cert_user(
            &pki.path("kube-proxy.crt"),
            &pki.path("kube-proxy.key"),
        );
        write_atomic(
            &path,
            super::control_plane::kubeconfig(&cp.server(), &cp.ca(), &user).as_bytes(),
        )?;
        Ok(path)
    }

    /// Starts the real kube-proxy in `mode` on node `node`, and waits until
    /// it has synced its rules once (/healthz and its metrics). The node's agent may run too:
    /// that is a migration's middle step (its programs see packets before
    /// kube-proxy's rules do).
    pub fn start_kube_proxy_on(
        &mut self,
        node: &str,
        mode: KubeProxyMode,
        opts: &KubeProxyOptions,
    ) -> Result<()> {
        let i = self.node_index(node)?;
        let n = self.info.nodes[i].clone();
        if n.kube_proxy.is_some() {
            bail!("{node} already runs kube-proxy");
        }
        if mode == KubeProxyMode::Ipvs && !ipvs_available() {
            bail!("this kernel has no IPVS (CONFIG_IP_VS): kube-proxy's ipvs mode cannot run here");
        }
        let kubeconfig = self.kube_proxy_kubeconfig()?;
        self.route_service_cidr(node)?;
        let config = self.info.dir.join(format!("kube-proxy-{node}.yaml"));
        let log_path = self.info.dir.join(format!("kube-proxy-{node}.log"));
        let mut text = format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
             kind: KubeProxyConfiguration\n\
             clientConnection:\n  kubeconfig: {}\n\
             hostnameOverride: {node}\n\
             mode: {}\n\
             detectLocalMode: InterfaceNamePrefix\n\
             detectLocal:\n  interfaceNamePrefix: lxc\n\
             conntrack:\n  maxPerCore: 0\n  min: 0\n  tcpEstablishedTimeout: 0s\n  tcpCloseWaitTimeout: 0s\n  udpTimeout: 0s\n  udpStreamTimeout: 0s\n",
            kubeconfig.display(),
            mode.as_str(),
        );
        if let Some(p) = opts.min_sync_period {
            text.push_str(&format!(
                "{}:\n  minSyncPeriod: {}ms\n",
                mode.as_str(),
                p.as_millis()
            ));
        }
        write_atomic(&config, text.as_bytes())?;
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let log_start = log.metadata()?.len();
        let mut cmd = Command::new(kube::bin("kube-proxy"));
        cmd.arg("--config")
            .arg(&config)
            .arg("--v=2")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        netns::enter_netns_on_spawn(&mut cmd, &n.netns)?;
        if let Some(cg) = &n.cgroup {
            super::cgroup::join_on_spawn(&mut cmd, cg)?;
        }
        let child = cmd.spawn().context("spawn kube-proxy")?;
        let pid = child.id();
        self.children.insert(pid, child);
        self.info.nodes[i].kube_proxy = Some(KubeProxyInfo {
            pid,
            mode,
            config,
            log: log_path.clone(),
            log_start,
        });
        self.save()?;
        self.wait_kube_proxy_healthy(node, START_TIMEOUT)
    }

    /// Gives `node` a route for the ServiceCIDR via the control plane's
    /// address, as a real node's default route to its router: kube-proxy
    /// rewrites a host process's packet in OUTPUT, after the route lookup
    /// that `connect()` does first, and a pod's packet to a ClusterIP
    /// without endpoints is rejected in FORWARD, after routing; without a
    /// route both fail as "network unreachable" before kube-proxy's rules
    /// see them. The route stays for whichever proxy runs next, so each is
    /// observed on the same node. (Packets it carries to an address no
    /// Service holds reach the control plane's namespace, which does not
    /// forward: no answer, as a router's blackhole.) In a dual-stack lab
    /// the IPv6 ServiceCIDR is routed the same way.
    pub fn route_service_cidr(&self, node: &str) -> Result<()> {
        let n = self.node_info(node)?;
        if n.eth.is_empty() {
            return Ok(());
        }
        let via = super::control_plane::CONTROL_PLANE_IP.to_string();
        netns::ip_in(
            &n.netns,
            &[
                "route",
                "replace",
                super::control_plane::SERVICE_CIDR,
                "via",
                &via,
                "dev",
                &n.eth,
            ],
        )?;
        // Dual-stack: the IPv6 ServiceCIDR too, via the control plane's
        // IPv6 address.
        if let (true, Some(_)) = (self.info.dual_stack, n.ip6) {
            let via6 = netns::ipv6_twin(super::control_plane::CONTROL_PLANE_IP)
                .context("the control plane's address is in 198.18.0.0/16")?
                .to_string();
            netns::ip_in(
                &n.netns,
                &[
                    "-6",
                    "route",
                    "replace",
                    super::control_plane::SERVICE_CIDR6,
                    "via",
                    &via6,
                    "dev",
                    &n.eth,
                ],
            )?;
        }
        Ok(())
    }

    /// Waits until kube-proxy on `node` answers 200 on /healthz and its
    /// metrics show a first sync of its rules.
    pub fn wait_kube_proxy_healthy(&mut self, node: &str, timeout: Duration) -> Result<()> {
        let n = self.node_info(node)?.clone();
        let kp = n
            .kube_proxy
            .clone()
            .with_context(|| format!("{node} runs no kube-proxy"))?;
        let addr = SocketAddrV4::new(n.ip, HEALTHZ_PORT);
        let deadline = Instant::now() + timeout;
        let mut last;
        loop {
            if super::process::process_gone(kp.pid) {
                bail!(
                    "kube-proxy on {node} exited; its log ({}):\n{}",
                    kp.log.display(),
                    super::wait::tail(&kp.log, 30)
                );
            }
            match proxy_mode(&n.netns) {
                // kube-proxy's own ports. /healthz answers 200 before the
                // first sync too (no update queued yet): the first sync is
                // its metrics' last-sync time.
                Some(m) if m == kp.mode.as_str() => {
                    match http_get_in(&n.netns, addr, "/healthz", HTTP_TIMEOUT) {
                        Ok((200, _)) if first_sync_done(&n.netns) => return Ok(()),
                        Ok((200, _)) => last = "healthy, not synced yet".to_string(),
                        Ok((code, body)) => last = format!("{code} {body}"),
                        Err(e) => last = format!("{e:#}"),
                    }
                }
                // Another proxy (the agent, a migration's middle step)
                // holds kube-proxy's ports: kube-proxy binds them once it
                // exits (it tries every 5 s). Its log says when its rules
                // are in.
                Some(other) => {
                    if log_shows_a_sync(&log_since(&kp.log, kp.log_start)) {
                        return Ok(());
                    }
                    last = format!(
                        "its ports held by a proxy of mode {other:?}; no sync in its log yet"
                    );
                }
                None => last = format!("nothing answers /proxyMode on {METRICS_ADDR}"),
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-proxy on {node} not healthy within {timeout:?} (last: {last}); its log:\n{}",
                    super::wait::tail(&kp.log, 30)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops kube-proxy on `node` (SIGTERM, up to 3 s) and runs
    /// `kube-proxy --cleanup` there, as an operator does when handing the
    /// node to another proxy. Fails if its rules remain.
    pub fn stop_kube_proxy_on(&mut self, node: &str) -> Result<()> {
        let i = self.node_index(node)?;
        let Some(kp) = self.info.nodes[i].kube_proxy.take() else {
            return Ok(());
        };
        self.kill(kp.pid, Duration::from_secs(3))?;
        self.save()?;
        self.kube_proxy_cleanup(node, &kp)?;
        let left = self.kube_proxy_leftovers(node)?;
        if !left.is_empty() {
            bail!("kube-proxy --cleanup on {node} left rules behind: {left:?}");
        }
        Ok(())
    }

    /// Stops kube-proxy on `node` without cleaning up its rules (what a
    /// crash or `kubectl delete ds kube-proxy` leaves).
    pub fn kill_kube_proxy_on(&mut self, node: &str) -> Result<Option<KubeProxyInfo>> {
        let i = self.node_index(node)?;
        let Some(kp) = self.info.nodes[i].kube_proxy.take() else {
            return Ok(None);
        };
        self.kill(kp.pid, Duration::from_secs(3))?;
        self.save()?;
        Ok(Some(kp))
    }

    /// `kube-proxy --cleanup` with `kp`'s configuration, on `node`.
    pub fn kube_proxy_cleanup(&self, node: &str, kp: &KubeProxyInfo) -> Result<()> {
        let mut cmd = self.node_command(node, kube::bin("kube-proxy"))?;
        let out = cmd
            .arg("--config")
            .arg(&kp.config)
            .arg("--cleanup")
            .stdin(Stdio::null())
            .output()
            .context("run kube-proxy --cleanup")?;
        let mut log = OpenOptions::new().append(true).create(true).open(&kp.log)?;
        use std::io::Write;
        let _ = writeln!(log, "--- kube-proxy --cleanup:");
        let _ = log.write_all(&out.stderr);
        if !out.status.success() {
            bail!(
                "kube-proxy --cleanup on {node}: {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// kube-proxy's rules still in `node`'s namespace: iptables chains named
    /// `KUBE-*` (but `KUBE-FIREWALL`, the kubelet's too) and nftables
    /// tables named `kube-proxy`.
    pub fn kube_proxy_leftovers(&self, node: &str) -> Result<Vec<String>> {
        let mut left = Vec::new();
        for save in ["iptables-save", "ip6tables-save"] {
            let out = self
                .node_command(node, save)?
                .output()
                .with_context(|| format!("run {save}"))?;
            left.extend(
                String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .filter(|l| l.starts_with(':') && l.contains("KUBE-"))
                    // Shared with the kubelet, which also creates it: its
                    // `--cleanup` leaves it by design (one rule, dropping
                    // martian packets to 127/8 from outside).
                    .filter(|l| !l.starts_with(":KUBE-FIREWALL "))
                    .map(|l| format!("{save}: {l}")),
            );
        }
        let out = self
            .node_command(node, "nft")?
            .args(["list", "tables"])
            .output()
            .context("run nft")?;
        left.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.contains("kube-proxy"))
                .map(|l| format!("nft: {l}")),
        );
        Ok(left)
    }

    /// kube-proxy's rules on `node`, as text (`iptables-save` or
    /// `nft list table ip kube-proxy`).
    pub fn kube_proxy_rules(&self, node: &str) -> Result<String> {
        let kp = self
            .node_info(node)?
            .kube_proxy
            .clone()
            .with_context(|| format!("{node} runs no kube-proxy"))?;
        let mut cmd = match kp.mode {
            KubeProxyMode::Nftables => {
                let mut c = self.node_command(node, "nft")?;
                c.args(["list", "table", "ip", "kube-proxy"]);
                c
            }
            _ => {
                let mut c = self.node_command(node, "iptables-save")?;
                c.args(["-t", "nat"]);
                c
            }
        };
        let out = cmd.output().context("dump kube-proxy's rules")?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// kube-proxy's `/metrics` on `node`.
    pub fn kube_proxy_metrics(&self, node: &str) -> Result<String> {
        let n = self.node_info(node)?;
        let (code, body) = http_get_in(&n.netns, METRICS_ADDR, "/metrics", HTTP_TIMEOUT)?;
        if code != 200 {
            bail!("kube-proxy's /metrics on {node}: {code}");
        }
        Ok(body)
    }

    /// The nodes running kube-proxy.
    pub fn nodes_with_kube_proxy(&self) -> Vec<String> {
        self.info
            .nodes
            .iter()
            .filter(|n| n.kube_proxy.is_some())
            .map(|n| n.name.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::log_shows_a_sync;

    #[test]
    fn a_failed_sync_is_not_a_sync() {
        let ok = r#"I1206 1 proxier.go:655] "Syncing iptables rules" fullSync=true
I1206 2 proxier.go:649] "SyncProxyRules complete" elapsed="24ms""#;
        let failed = r#"I1206 1 proxier.go:655] "Syncing nftables rules" fullSync=true
E1206 2 proxier.go:1874] "nftables sync failed" err="exit status 1"
I1206 3 proxier.go:1211] "Sync failed" retryingTime="30s"
I1206 4 proxier.go:1200] "SyncProxyRules complete" elapsed="3ms""#;
        assert!(log_shows_a_sync(ok));
        assert!(!log_shows_a_sync(failed));
        assert!(log_shows_a_sync(&format!("{failed}\n{ok}")));
        assert!(!log_shows_a_sync(
            r#"I1206 "Not syncing iptables until Services and Endpoints have been received from master""#
        ));
    }
}

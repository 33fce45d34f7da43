//! The lab's real control plane: etcd, kube-apiserver and
//! kube-controller-manager (built by setup, [`crate::kube`]) in a namespace
//! of their own, `<prefix>-cp`, on the switch at [`CONTROL_PLANE_IP`]
//! (and its IPv6 twin in a dual-stack lab), as a control-plane machine on
//! the node network.
//!
//! - etcd listens on the namespace's loopback only.
//! - kube-apiserver serves on 198.18.0.2:6443 with `--authorization-mode=Node,RBAC`,
//!   the ServiceCIDRs 198.19.0.0/16 (and 2001:2:0:ff::/112 in a dual-stack
//!   lab), client certificates and service-account tokens signed by keys
//!   the lab makes ([`Pki`]). Its `kubernetes` Service gets 198.19.0.1:443
//!   with the API server as its endpoint.
//! - kube-controller-manager runs the controllers a kube-proxy depends on:
//!   EndpointSlice, EndpointSlice mirroring, the garbage collector (slices
//!   of deleted Services), service accounts and namespaces, each with its own
//!   service account's credentials, as kubeadm runs it.
//!
//! The lab plays the kubelet only ([`super::api`]): Node objects, Pods and
//! their status. Every request goes through the built `kubectl` with an
//! admin kubeconfig, run inside the control plane's namespace.
//!
//! Why one file (about 800 lines): the components' command lines
//! (`etcd_args`, `apiserver_args`, `controller_manager_args`) name the
//! certificates and keys [`Pki`] makes and the kubeconfigs
//! `create_control_plane` writes, and starting and stopping them (tests
//! restart kube-apiserver and etcd that way) keeps their pids in the one
//! [`ControlPlaneInfo`] of lab.json. Split apart, a file the lab writes and
//! the flag that reads it would be in different files.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::info::write_atomic;
use super::Lab;
use crate::kube;
use crate::netns::{self, create_netns, ip_in, ipv6_twin};
use crate::setup::workspace_root;

/// The control plane's address on the node network.
pub const CONTROL_PLANE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
/// kube-apiserver's secure port.
pub const API_SERVER_PORT: u16 = 6443;
/// The IPv4 ServiceCIDR.
pub const SERVICE_CIDR: &str = "198.19.0.0/16";
/// The IPv6 ServiceCIDR of a dual-stack lab.
pub const SERVICE_CIDR6: &str = crate::manifests::SERVICE_CIDR6;
/// The `kubernetes` Service's ClusterIP: the first address of the ServiceCIDR.
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 1);
/// The ServiceAccount of deploy/ the agents run as.
pub const AGENT_SERVICE_ACCOUNT: &str = "proxy-agent";
/// The namespace of deploy/.
pub const AGENT_NAMESPACE: &str = "kube-system";
/// Bound of the control plane's start (etcd, the API server's first
/// readiness, the controller manager's first healthz).
const START_TIMEOUT: Duration = Duration::from_secs(180);

/// The control plane of a lab, in lab.json.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ControlPlaneInfo {
    pub netns: String,
    pub ip: Ipv4Addr,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip6: Option<Ipv6Addr>,
    /// Certificates, keys, kubeconfigs, etcd's data and the logs.
    pub dir: PathBuf,
    /// system:masters, for the lab (the kubelet's part) and for people.
    pub admin_kubeconfig: PathBuf,
    /// The agents': deploy/'s ServiceAccount's token.
    pub agent_kubeconfig: PathBuf,
    #[serde(default)]
    pub etcd: Option<u32>,
    #[serde(default)]
    pub apiserver: Option<u32>,
    #[serde(default)]
    pub controller_manager: Option<u32>,
}

impl ControlPlaneInfo {
    /// `https://198.18.0.2:6443`.
    pub fn server(&self) -> String {
        format!("https://{}:{API_SERVER_PORT}", self.ip)
    }

    /// The CA that signed the API server's serving certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("pki/ca.crt")
    }

    /// The service-account token of the agents' kubeconfig.
    pub fn agent_token(&self) -> PathBuf {
        self.dir.join("agent.token")
    }

    /// The API server's audit log: every request of deploy/'s ServiceAccount
    /// (the agents), at the Metadata level, one JSON object a line.
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("audit.log")
    }

    /// A component's log (`etcd`, `kube-apiserver`, `kube-controller-manager`).
    pub fn log(&self, component: &str) -> PathBuf {
        self.dir.join(format!("{component}.log"))
    }

    /// `kubectl` against this control plane as the admin, run in its namespace.
    pub fn kubectl(&self) -> Result<Command> {
        let mut cmd = Command::new(kube::bin("kubectl"));
        cmd.arg("--kubeconfig").arg(&self.admin_kubeconfig);
        netns::enter_netns_on_spawn(&mut cmd, &self.netns)?;
        Ok(cmd)
    }

    /// Runs kubectl with `args` (and `stdin`), returning its standard output;
    /// an error carries its standard error.
    pub fn kubectl_run(&self, args: &[&str], stdin: Option<&str>) -> Result<String> {
        let mut cmd = self.kubectl()?;
        cmd.args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().context("spawn kubectl")?;
        if let Some(text) = stdin {
            use std::io::Write;
            let mut pipe = child.stdin.take().expect("piped stdin");
            let text = text.to_string();
            // A large input is written from a thread, so kubectl's output
            // cannot fill its pipe while we are still writing.
            let writer = std::thread::spawn(move || pipe.write_all(text.as_bytes()));
            let out = child.wait_with_output()?;
            writer
                .join()
                .map_err(|_| anyhow::anyhow!("kubectl stdin writer panicked"))??;
            return kubectl_result(args, out);
        }
        let out = child.wait_with_output()?;
        kubectl_result(args, out)
    }
}

fn kubectl_result(args: &[&str], out: std::process::Output) -> Result<String> {
    if !out.status.success() {
        bail!(
            "kubectl {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The lab's certificates and keys, made with `openssl`.
pub(super) struct Pki {
    pub(super) dir: PathBuf,
}

impl Pki {
    fn openssl(&self, args: &[&str]) -> Result<()> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .output()
            .context("run openssl (setup installs Debian's openssl)")?;
        if !out.status.success() {
            bail!(
                "openssl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    fn make(dir: &Path, sans: &[String]) -> Result<Pki> {
        std::fs::create_dir_all(dir)?;
        let pki = Pki {
            dir: dir.to_path_buf(),
        };
        pki.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "3650",
            "-subj",
            "/CN=kpr-lab-ca",
        ])?;
        let san = sans
            .iter()
            .map(|s| {
                if s.parse::<std::net::IpAddr>().is_ok() {
                    format!("IP:{s}")
                } else {
                    format!("DNS:{s}")
                }
            })
            .collect::<Vec<_>>()
            .join(",");
        pki.leaf(
            "apiserver",
            "/CN=kube-apiserver",
            &format!("extendedKeyUsage=serverAuth\nsubjectAltName={san}\n"),
        )?;
        pki.leaf(
            "admin",
            "/O=system:masters/CN=kpr-lab-admin",
            "extendedKeyUsage=clientAuth\n",
        )?;
        pki.leaf(
            "controller-manager",
            "/CN=system:kube-controller-manager",
            "extendedKeyUsage=clientAuth\n",
        )?;
        // No kubelet serves here, so the API server needs no client
        // certificate of its own; service-account tokens are signed with
        // sa.key.
        pki.openssl(&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            "sa.key",
        ])?;
        pki.openssl(&["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
        Ok(pki)
    }

    pub(super) fn leaf(&self, name: &str, subject: &str, ext: &str) -> Result<()> {
        let ext_file = format!("{name}.ext");
        std::fs::write(self.dir.join(&ext_file), ext)?;
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let crt = format!("{name}.crt");
        self.openssl(&[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            subject,
        ])?;
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "3650",
            "-out",
            &crt,
            "-extfile",
            &ext_file,
        ])
    }

    pub(super) fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }
}

/// A kubeconfig for `server` with the CA and either a client certificate or
/// a token file.
pub(super) fn kubeconfig(server: &str, ca: &Path, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: {server}\n    \
         certificate-authority: {}\ncontexts:\n- name: lab\n  context:\n    cluster: lab\n    \
         user: user\ncurrent-context: lab\nusers:\n- name: user\n  user:\n{user}",
        ca.display()
    )
}

pub(super) fn cert_user(crt: &Path, key: &Path) -> String {
    format!(
        "    client-certificate: {}\n    client-key: {}\n",
        crt.display(),
        key.display()
    )
}

impl Lab {
    /// The control plane, if the lab runs one.
    pub fn control_plane(&self) -> Option<&ControlPlaneInfo> {
        self.info.control_plane.as_ref()
    }

    fn control_plane_info(&self) -> Result<&ControlPlaneInfo> {
        self.info
            .control_plane
            .as_ref()
            .context("the lab runs no control plane (LabBuilder::control_plane)")
    }

    /// kubectl against the lab's API server as its admin (inside the
    /// control plane's namespace): `lab.kubectl(&["get", "svc", "-A"], None)`.
    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Result<String> {
        self.control_plane_info()?.kubectl_run(args, stdin)
    }

    /// Creates the control plane's namespace on the switch and starts etcd,
    /// kube-apiserver and kube-controller-manager; applies deploy/'s
    /// ServiceAccount, ClusterRole and binding and writes the agents'
    /// kubeconfig with that ServiceAccount's token.
    pub(super) fn create_control_plane(&mut self) -> Result<()> {
        kube::ensure_built()?;
        let ns = format!("kpr-{}-cp", self.info.id);
        self.info.namespaces.push(ns.clone());
        self.save()?;
        create_netns(&ns)?;
        let ip6 = self.info.dual_stack.then(|| {
            ipv6_twin(CONTROL_PLANE_IP).expect("the control plane's address is in 198.18.0.0/16")
        });
        if ip6.is_some() {
            netns::sysctls_in(&ns, &super::topology::IPV6_SYSCTLS)?;
        }
        ip_in(&ns, &["link", "set", "lo", "up"])?;
        self.plug_into_switch(&ns, "cp", CONTROL_PLANE_IP, ip6)?;
        self.route_pod_cidrs_via_nodes(&ns, ip6.is_some())?;
        let dir = self.info.dir.join("control-plane");
        let mut sans = vec![
            CONTROL_PLANE_IP.to_string(),
            "127.0.0.1".to_string(),
            KUBERNETES_SERVICE_IP.to_string(),
            "kubernetes".to_string(),
            "kubernetes.default".to_string(),
            "kubernetes.default.svc".to_string(),
            "kubernetes.default.svc.cluster.local".to_string(),
            "localhost".to_string(),
        ];
        if let Some(ip6) = ip6 {
            sans.push(ip6.to_string());
            sans.push(
                first_address6(SERVICE_CIDR6)
                    .expect("the IPv6 ServiceCIDR")
                    .to_string(),
            );
        }
        let pki = Pki::make(&dir.join("pki"), &sans)?;
        let info = ControlPlaneInfo {
            netns: ns.clone(),
            ip: CONTROL_PLANE_IP,
            ip6,
            dir: dir.clone(),
            admin_kubeconfig: dir.join("admin.kubeconfig"),
            agent_kubeconfig: dir.join("agent.kubeconfig"),
            etcd: None,
            apiserver: None,
            controller_manager: None,
        };
        let server = info.server();
        write_atomic(
            &info.admin_kubeconfig,
            kubeconfig(
                &server,
                &pki.path("ca.crt"),
                &cert_user(&pki.path("admin.crt"), &pki.path("admin.key")),
            )
            .as_bytes(),
        )?;
        write_atomic(
            &dir.join("controller-manager.kubeconfig"),
            kubeconfig(
                &server,
                &pki.path("ca.crt"),
                &cert_user(
                    &pki.path("controller-manager.crt"),
                    &pki.path("controller-manager.key"),
                ),
            )
            .as_bytes(),
        )?;
        self.info.control_plane = Some(info);
        self.save()?;
        self.start_etcd()?;
        self.start_apiserver()?;
        self.wait_apiserver_ready(START_TIMEOUT)?;
        self.start_controller_manager()?;
        self.apply_agent_rbac()?;
        self.write_agent_kubeconfig()?;
        let cp = self.control_plane_info()?;
        eprintln!(
            "lab {}: control plane {} (Kubernetes {}, etcd {}); kubectl: ip netns exec {} {} \
             --kubeconfig {}",
            self.info.id,
            cp.server(),
            kube::KUBERNETES_VERSION,
            kube::ETCD_VERSION,
            cp.netns,
            kube::bin("kubectl").display(),
            cp.admin_kubeconfig.display()
        );
        Ok(())
    }

    fn spawn(&mut self, component: &str, args: &[String]) -> Result<u32> {
        let cp = self.control_plane_info()?.clone();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(cp.log(component))?;
        let mut cmd = Command::new(kube::bin(component));
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        netns::enter_netns_on_spawn(&mut cmd, &cp.netns)?;
        let child = cmd.spawn().with_context(|| format!("spawn {component}"))?;
        let pid = child.id();
        self.children.insert(pid, child);
        Ok(pid)
    }

    /// Starts etcd on the control plane's loopback (its data kept across
    /// restarts in `<dir>/etcd`).
    pub fn start_etcd(&mut self) -> Result<()> {
        self.start_component(Component::Etcd)
    }

    /// Starts kube-apiserver (see the module's doc for its settings).
    pub fn start_apiserver(&mut self) -> Result<()> {
        self.start_component(Component::ApiServer)
    }

    /// Starts kube-controller-manager with the controllers kube-proxy's
    /// inputs come from.
    pub fn start_controller_manager(&mut self) -> Result<()> {
        self.start_component(Component::ControllerManager)
    }

    fn start_component(&mut self, c: Component) -> Result<()> {
        let mut cp = self.control_plane_info()?.clone();
        if c.pid(&mut cp).is_some() {
            bail!("{} is already running", c.binary());
        }
        let args = match c {
            Component::Etcd => etcd_args(&cp),
            Component::ApiServer => apiserver_args(&cp)?,
            Component::ControllerManager => controller_manager_args(&cp),
        };
        let pid = self.spawn(c.binary(), &args)?;
        if let Some(cp) = self.info.control_plane.as_mut() {
            *c.pid(cp) = Some(pid);
        }
        self.save()
    }

    fn stop_component(&mut self, pid: Option<u32>, grace: Duration) -> Result<()> {
        if let Some(pid) = pid {
            self.kill(pid, grace)?;
        }
        Ok(())
    }

    /// Stops kube-apiserver (SIGTERM, then SIGKILL after 5 s).
    pub fn stop_apiserver(&mut self) -> Result<()> {
        self.stop(Component::ApiServer)
    }

    /// Stops etcd (SIGTERM, then SIGKILL after 5 s).
    pub fn stop_etcd(&mut self) -> Result<()> {
        self.stop(Component::Etcd)
    }

    fn stop(&mut self, c: Component) -> Result<()> {
        let cp = self
            .info
            .control_plane
            .as_mut()
            .context("no control plane")?;
        let pid = c.pid(cp).take();
        self.stop_component(pid, Duration::from_secs(5))?;
        self.save()
    }

    /// Stops the three components, controller manager first.
    pub(super) fn stop_control_plane(&mut self) -> Result<()> {
        let Some(cp) = self.info.control_plane.as_mut() else {
            return Ok(());
        };
        let pids = [
            cp.controller_manager.take(),
            cp.apiserver.take(),
            cp.etcd.take(),
        ];
        let mut errors = Vec::new();
        for pid in pids {
            if let Err(e) = self.stop_component(pid, Duration::from_secs(3)) {
                errors.push(format!("{e:#}"));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            bail!("control plane: {}", errors.join("; "))
        }
    }

    /// Waits until the API server answers `/readyz` (bounded by `timeout`).
    pub fn wait_apiserver_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let cp = self.control_plane_info()?.clone();
        loop {
            match cp.kubectl_run(&["get", "--raw", "/readyz"], None) {
                Ok(s) if s.trim() == "ok" => return Ok(()),
                r => {
                    if Instant::now() >= deadline {
                        bail!(
                            "kube-apiserver not ready after {timeout:?} ({}); log tail:\n{}",
                            r.err().map(|e| format!("{e:#}")).unwrap_or_default(),
                            super::wait::tail(&cp.log("kube-apiserver"), 20)
                        );
                    }
                    if let Some(pid) = cp.apiserver {
                        if super::process::process_gone(pid) {
                            bail!(
                                "kube-apiserver exited; log tail:\n{}",
                                super::wait::tail(&cp.log("kube-apiserver"), 30)
                            );
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// deploy/'s ServiceAccount, ClusterRole and ClusterRoleBinding, applied
    /// as they are.
    fn apply_agent_rbac(&mut self) -> Result<()> {
        let deploy = workspace_root().join("deploy");
        let mut text = String::new();
        for f in [
            "serviceaccount.yaml",
            "clusterrole.yaml",
            "clusterrolebinding.yaml",
        ] {
            let p = deploy.join(f);
            text.push_str(
                &std::fs::read_to_string(&p).with_context(|| format!("read {}", p.display()))?,
            );
            text.push_str("\n---\n");
        }
        // The ServiceAccount admission and the first request may race the
        // API server's own bootstrap (the kube-system namespace, the RBAC
        // roles): retried briefly.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.kubectl(&["apply", "-f", "-"], Some(&text)) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() < deadline => {
                    eprintln!("lab: applying deploy/'s RBAC: {e:#}; retrying");
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => return Err(e.context("apply deploy/'s ServiceAccount and RBAC")),
            }
        }
    }

    /// A token of deploy/'s ServiceAccount (TokenRequest), in the agents'
    /// kubeconfig.
    pub fn write_agent_kubeconfig(&mut self) -> Result<()> {
        let token = self.kubectl(
            &[
                "create",
                "token",
                AGENT_SERVICE_ACCOUNT,
                "-n",
                AGENT_NAMESPACE,
                "--duration=48h",
            ],
            None,
        )?;
        let cp = self.control_plane_info()?.clone();
        write_atomic(&cp.agent_token(), token.trim().as_bytes())?;
        let user = format!("    tokenFile: {}\n", cp.agent_token().display());
        write_atomic(
            &cp.agent_kubeconfig,
            kubeconfig(&cp.server(), &cp.ca(), &user).as_bytes(),
        )
    }
}

/// A component of the control plane.
#[derive(Clone, Copy, Debug)]
enum Component {
    Etcd,
    ApiServer,
    ControllerManager,
}

impl Component {
    fn binary(self) -> &'static str {
        match self {
            Component::Etcd => "etcd",
            Component::ApiServer => "kube-apiserver",
            Component::ControllerManager => "kube-controller-manager",
        }
    }

    fn pid(self, cp: &mut ControlPlaneInfo) -> &mut Option<u32> {
        match self {
            Component::Etcd => &mut cp.etcd,
            Component::ApiServer => &mut cp.apiserver,
            Component::ControllerManager => &mut cp.controller_manager,
        }
    }
}

fn etcd_args(cp: &ControlPlaneInfo) -> Vec<String> {
    let data = cp.dir.join("etcd");
    [
        "--name",
        "lab",
        "--data-dir",
        &data.to_string_lossy(),
        "--listen-client-urls",
        "http://127.0.0.1:2379",
        "--advertise-client-urls",
        "http://127.0.0.1:2379",
        "--listen-peer-urls",
        "http://127.0.0.1:2380",
        "--initial-advertise-peer-urls",
        "http://127.0.0.1:2380",
        "--initial-cluster",
        "lab=http://127.0.0.1:2380",
        "--listen-metrics-urls",
        "http://127.0.0.1:2381",
        "--quota-backend-bytes",
        "8589934592",
        "--log-level",
        "warn",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn apiserver_args(cp: &ControlPlaneInfo) -> Result<Vec<String>> {
    let pki = cp.dir.join("pki");
    let p = |f: &str| pki.join(f).to_string_lossy().into_owned();
    let mut cidrs = SERVICE_CIDR.to_string();
    if cp.ip6.is_some() {
        cidrs.push(',');
        cidrs.push_str(SERVICE_CIDR6);
    }
    let policy = cp.dir.join("audit-policy.yaml");
    write_atomic(&policy, AUDIT_POLICY.as_bytes())?;
    let args = vec![
        format!("--audit-policy-file={}", policy.display()),
        format!("--audit-log-path={}", cp.audit_log().display()),
        "--audit-log-format=json".into(),
        "--etcd-servers=http://127.0.0.1:2379".into(),
        format!("--advertise-address={}", cp.ip),
        "--bind-address=::".into(),
        format!("--secure-port={API_SERVER_PORT}"),
        format!("--service-cluster-ip-range={cidrs}"),
        format!("--tls-cert-file={}", p("apiserver.crt")),
        format!("--tls-private-key-file={}", p("apiserver.key")),
        format!("--client-ca-file={}", p("ca.crt")),
        format!("--service-account-key-file={}", p("sa.pub")),
        format!("--service-account-signing-key-file={}", p("sa.key")),
        "--service-account-issuer=https://kubernetes.default.svc".into(),
        "--authorization-mode=Node,RBAC".into(),
        "--allow-privileged=true".into(),
        "--profiling=false".into(),
        "--endpoint-reconciler-type=lease".into(),
        "--v=1".into(),
    ];
    Ok(args)
}

fn controller_manager_args(cp: &ControlPlaneInfo) -> Vec<String> {
    let kubeconfig = cp.dir.join("controller-manager.kubeconfig");
    let k = kubeconfig.to_string_lossy().into_owned();
    let args = vec![
        format!("--kubeconfig={k}"),
        format!("--authentication-kubeconfig={k}"),
        format!("--authorization-kubeconfig={k}"),
        "--use-service-account-credentials=true".into(),
        format!(
            "--service-account-private-key-file={}",
            cp.dir.join("pki/sa.key").display()
        ),
        format!("--root-ca-file={}", cp.ca().display()),
        "--controllers=endpointslice-controller,endpointslice-mirroring-controller,\
         garbage-collector-controller,serviceaccount-controller,namespace-controller,\
         service-cidr-controller"
            .into(),
        "--leader-elect=false".into(),
        // The default 20 requests/s would take the EndpointSlice
        // controller minutes for a lab of 10,000 Services (large
        // clusters raise it too).
        "--kube-api-qps=1000".into(),
        "--kube-api-burst=2000".into(),
        "--bind-address=127.0.0.1".into(),
        "--v=1".into(),
    ];
    args
}

/// What the API server audits: the agents' requests (deploy/'s
/// ServiceAccount), so tests can see how they list and watch.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  users: [\"system:serviceaccount:kube-system:proxy-agent\"]
- level: None
";

impl Lab {
    /// A POST to etcd's HTTP gateway on the control
    /// plane's loopback.
    fn etcd_post(&self, path: &str, body: &str) -> Result<serde_json::Value> {
        let cp = self.control_plane_info()?;
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "-m", "10", "-X", "POST", "-d", body])
            .arg(format!("http://127.0.0.1:2379{path}"));
        netns::enter_netns_on_spawn(&mut cmd, &cp.netns)?;
        let out = cmd
            .output()
            .context("curl (setup installs Debian's curl)")?;
        if !out.status.success() {
            bail!(
                "etcd {path}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        serde_json::from_slice(&out.stdout).with_context(|| format!("etcd {path}: not JSON"))
    }

    /// Compacts etcd's history up to its current revision (physically, as
    /// the API server's periodic compaction does), so a watch from an older
    /// resourceVersion can only be answered with 410 Gone. Returns the
    /// revision.
    pub fn compact_etcd(&self) -> Result<u64> {
        // The range of key "\0" answers with the store's revision.
        let range = self.etcd_post("/v3/kv/range", r#"{"key":"AA=="}"#)?;
        let rev: u64 = range["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .with_context(|| format!("etcd's revision in {range}"))?;
        self.etcd_post(
            "/v3/kv/compaction",
            &format!(r#"{{"revision":"{rev}","physical":true}}"#),
        )?;
        Ok(rev)
    }
}

/// The first host address of an IPv6 CIDR (the `kubernetes` Service's
/// IPv6 ClusterIP).
fn first_address6(cidr: &str) -> Option<Ipv6Addr> {
    let net: Ipv6Addr = cidr.split('/').next()?.parse().ok()?;
    Some(Ipv6Addr::from(u128::from(net) + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kubernetes_service_takes_the_first_address_of_each_service_cidr() {
        assert_eq!(
            first_address6(SERVICE_CIDR6),
            Some("2001:2:0:ff::1".parse().unwrap())
        );
        assert!(SERVICE_CIDR.starts_with("198.19.0.0/"));
        assert_eq!(KUBERNETES_SERVICE_IP, Ipv4Addr::new(198, 19, 0, 1));
        assert!(netns::in_lab_range(CONTROL_PLANE_IP));
    }

    #[test]
    fn a_kubeconfig_names_the_server_the_ca_and_the_user() {
        let k = kubeconfig(
            "https://198.18.0.2:6443",
            Path::new("/x/ca.crt"),
            "    tokenFile: /x/t\n",
        );
        let v: serde_json::Value = yaml_serde::from_str(&k).unwrap();
        assert_eq!(
            v["clusters"][0]["cluster"]["server"],
            "https://198.18.0.2:6443"
        );
        assert_eq!(
            v["clusters"][0]["cluster"]["certificate-authority"],
            "/x/ca.crt"
        );
        assert_eq!(v["users"][0]["user"]["tokenFile"], "/x/t");
        assert_eq!(v["current-context"], "lab");
    }
}

//! Lab tests (root) of the `kubernetes` source with real traffic: the agent
//! runs in the lab's node namespace with `--source kubernetes` against the
//! scripted API server of tests/common, which listens on the node
//! namespace's loopback. The lab still creates the pods (namespaces and
//! servers) from its manifests; the Services and EndpointSlices the agent
//! sees come from the fake API server, whose slices mirror the lab's pod IPs.
//!
//! The same scenario table runs through the `manifests` source (changes made
//! with `lab.apply`/`lab.delete`), so each row is shown through both sources:
//! - S27/S28: toggling `service.kubernetes.io/service-proxy-name` /
//!   `service.kubernetes.io/headless` adds and removes the service live;
//! - S13–S16 (proxy side): ExternalName ↔ ClusterIP ↔ NodePort, the VIP and
//!   the NodePort start and stop working;
//! - S7: a service recreated with a new ClusterIP works there;
//! - S9 (kubernetes only): the API server going away and coming back leaves
//!   traffic flowing, and what changed meanwhile is applied afterwards.
//!
//! Run with `cargo xtask test` (they are `#[ignore]`d under a plain `cargo test`).
//!
//! Why one file of about 900 lines: every test here drives the same
//! fixtures (the fake API server inside the node namespace, the two
//! `Driver`s behind one trait, the traffic probes) and every scenario of the
//! table runs through both sources, so the table and the drivers belong
//! together; splitting them into several test binaries would link the lab
//! and the fake API server once per binary and move these fixtures into
//! `tests/common`, which the other test binaries compile too. The file is in
//! sections: the fake API server, the Services and the two drivers, traffic,
//! the scenario table, the tests.
mod common;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddrV4, TcpListener},
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use common::fake_apiserver::{FakeApiServer, Kind};
use serde_json::{json, Value};
use xtask::{
    client::{reply_text, tcp_request_here},
    manifests::Object,
    netns::in_netns,
    Lab,
};

const NAMESPACE: &str = "default";
const SVC_PORT: u16 = 80;
const POD_PORT: u16 = 8080;
/// One probe's connect/read timeout (the lab answers in well under a
/// millisecond; a VIP that is not programmed answers with ICMP unreachable,
/// which the node rate-limits, so some failed probes end in this timeout).
const PROBE: Duration = Duration::from_millis(250);
/// Bound of every wait for a change to show in traffic.
const CHANGE: Duration = Duration::from_secs(15);
/// Bound of the agent's start.
const START: Duration = Duration::from_secs(30);
/// ClusterIPs the fake API server hands out (the lab's allocator starts at
/// 198.19.0.10; these never collide and are never reused).
const KUBE_VIP_FIRST: u32 = u32::from_be_bytes([198, 19, 200, 10]);
const KUBE_NODE_PORT_FIRST: i32 = 30600;

// ---------------------------------------------------------------------------
// The fake API server inside the node namespace

/// The scripted API server with its listener on the node namespace's
/// loopback, served by a runtime of its own: stopping it drops the runtime,
/// which closes the listener and every open connection; restarting binds the
/// same port again over the same objects and change log.
struct NsApiServer {
    netns: String,
    port: u16,
    server: Option<FakeApiServer>,
    rt: Option<tokio::runtime::Runtime>,
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn bind_in(netns: &str, port: u16) -> TcpListener {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match in_netns(netns, move || TcpListener::bind(("127.0.0.1", port))) {
            Ok(Ok(l)) => return l,
            Ok(Err(e)) if Instant::now() < deadline => {
                eprintln!("bind 127.0.0.1:{port} in {netns}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(100));
            }
            r => panic!("bind 127.0.0.1:{port} in {netns}: {r:?}"),
        }
    }
}

impl NsApiServer {
    fn start(netns: &str) -> Self {
        let listener = bind_in(netns, 0);
        let rt = runtime();
        let server = rt.block_on(FakeApiServer::start_on(listener));
        Self {
            netns: netns.to_string(),
            port: server.addr.port(),
            server: Some(server),
            rt: Some(rt),
        }
    }

    fn api(&self) -> &FakeApiServer {
        self.server.as_ref().expect("server")
    }

    fn kubeconfig(&self) -> String {
        self.api().kubeconfig()
    }

    /// The API server goes away: listener closed, connections dropped.
    fn stop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }

    /// The API server comes back on the same address with the same state.
    fn restart(&mut self) {
        assert!(self.rt.is_none(), "stop first");
        let listener = bind_in(&self.netns, self.port);
        let rt = runtime();
        let old = self.server.take().expect("server");
        let new = rt.block_on(old.restart_on(listener));
        drop(old);
        self.server = Some(new);
        self.rt = Some(rt);
    }
}

impl Drop for NsApiServer {
    fn drop(&mut self) {
        self.server.take();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

// ---------------------------------------------------------------------------
// Services and the two ways of applying them

#[derive(Clone, Debug)]
struct Svc {
    name: String,
    /// `ClusterIP`, `NodePort` or `ExternalName`.
    type_: &'static str,
    /// Pods `app-1..` carry `app: <app>`.
    app: String,
    labels: BTreeMap<String, String>,
    /// A ClusterIP to ask for (both sources honour it).
    cluster_ip: Option<Ipv4Addr>,
}

impl Svc {
    fn new(name: &str, type_: &'static str, app: &str) -> Self {
        Svc {
            name: name.into(),
            type_,
            app: app.into(),
            labels: BTreeMap::new(),
            cluster_ip: None,
        }
    }

    fn label(mut self, k: &str, v: &str) -> Self {
        self.labels.insert(k.into(), v.into());
        self
    }

    fn ip(mut self, ip: Ipv4Addr) -> Self {
        self.cluster_ip = Some(ip);
        self
    }

    /// The Service as a user writes it (no allocations unless asked).
    fn object(&self, cluster_ip: Option<Ipv4Addr>, node_port: Option<i32>) -> Value {
        let mut port =
            json!({"name": "http", "protocol": "TCP", "port": SVC_PORT, "targetPort": POD_PORT});
        if let Some(np) = node_port {
            port["nodePort"] = json!(np);
        }
        let mut spec = json!({"type": self.type_, "selector": {"app": self.app}, "ports": [port]});
        if self.type_ == "ExternalName" {
            spec["externalName"] = json!("elsewhere.default.svc.cluster.local");
        } else if let Some(ip) = cluster_ip {
            spec["clusterIP"] = json!(ip.to_string());
            spec["clusterIPs"] = json!([ip.to_string()]);
            spec["ipFamilies"] = json!(["IPv4"]);
        }
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": self.name, "namespace": NAMESPACE, "labels": self.labels},
               "spec": spec})
    }
}

/// Where traffic for a service goes, as allocated.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Addrs {
    vip: Option<SocketAddrV4>,
    node_port: Option<SocketAddrV4>,
}

trait Driver {
    fn source(&self) -> &'static str;
    fn lab(&mut self) -> &mut Lab;
    /// Creates or replaces the Service; returns its addresses.
    fn put(&mut self, svc: &Svc) -> Addrs;
    fn delete(&mut self, name: &str);
}

fn pod_names(lab: &Lab, app: &str) -> Vec<String> {
    let prefix = format!("{app}-");
    lab.pods()
        .iter()
        .filter(|p| {
            p.name
                .strip_prefix(&prefix)
                .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()))
        })
        .map(|p| p.name.clone())
        .collect()
}

/// Changes through the lab's manifests (the agent runs `--source manifests`).
struct ManifestsDriver {
    lab: Lab,
}

impl Driver for ManifestsDriver {
    fn source(&self) -> &'static str {
        "manifests"
    }

    fn lab(&mut self) -> &mut Lab {
        &mut self.lab
    }

    fn put(&mut self, svc: &Svc) -> Addrs {
        // JSON is YAML; the lab's allocator fills in ClusterIP and NodePort.
        let text = svc.object(svc.cluster_ip, None).to_string();
        self.lab.apply(&text).expect("lab.apply");
        let vip = self.lab.cluster_frontend(&svc.name, SVC_PORT, "TCP");
        let node_port = self
            .lab
            .info()
            .frontends_of(&svc.name)
            .into_iter()
            .find(|f| f.kind == "NodePort")
            .map(|f| f.addr());
        Addrs { vip, node_port }
    }

    fn delete(&mut self, name: &str) {
        self.lab.delete_service(name).expect("lab.delete_service");
    }
}

/// Changes through the fake API server (the agent runs `--source
/// kubernetes`); plays the API server's allocators and the EndpointSlice
/// controller.
struct KubeDriver {
    lab: Lab,
    api: NsApiServer,
    next_ip: u32,
    next_node_port: i32,
    /// name → (ClusterIP, NodePort) as allocated.
    services: BTreeMap<String, (Option<Ipv4Addr>, Option<i32>)>,
    slices: BTreeSet<String>,
    _dir: tempfile::TempDir,
}

impl KubeDriver {
    fn slice_name(svc: &str) -> String {
        format!("{svc}-abcde")
    }

    /// The EndpointSlice controller: one slice with every `app` pod, ready.
    fn slice(&self, svc: &Svc) -> Value {
        let endpoints: Vec<Value> = pod_names(&self.lab, &svc.app)
            .iter()
            .map(|n| {
                let p = self.lab.pod(n).expect("pod");
                json!({"addresses": [p.ip.to_string()],
                       "conditions": {"ready": true, "serving": true, "terminating": false},
                       "nodeName": p.node,
                       "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": p.name}})
            })
            .collect();
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": Self::slice_name(&svc.name), "namespace": NAMESPACE,
                            "labels": {"kubernetes.io/service-name": svc.name,
                                       "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
               "addressType": "IPv4",
               "endpoints": endpoints,
               "ports": [{"name": "http", "port": POD_PORT, "protocol": "TCP"}]})
    }

    fn alloc_ip(&mut self) -> Ipv4Addr {
        let ip = Ipv4Addr::from(self.next_ip);
        self.next_ip += 1;
        ip
    }
}

impl Driver for KubeDriver {
    fn source(&self) -> &'static str {
        "kubernetes"
    }

    fn lab(&mut self) -> &mut Lab {
        &mut self.lab
    }

    fn put(&mut self, svc: &Svc) -> Addrs {
        let prev = self.services.get(&svc.name).copied().unwrap_or_default();
        let (ip, np) = if svc.type_ == "ExternalName" {
            (None, None)
        } else {
            let ip = svc.cluster_ip.or(prev.0).unwrap_or_else(|| self.alloc_ip());
            let np = (svc.type_ == "NodePort").then(|| {
                prev.1.unwrap_or_else(|| {
                    self.next_node_port += 1;
                    self.next_node_port - 1
                })
            });
            (Some(ip), np)
        };
        self.api.api().apply(svc.object(ip, np));
        self.services.insert(svc.name.clone(), (ip, np));
        let slice = Self::slice_name(&svc.name);
        if svc.type_ == "ExternalName" {
            if self.slices.remove(&slice) {
                self.api
                    .api()
                    .delete(Kind::EndpointSlices, NAMESPACE, &slice);
            }
        } else {
            self.api.api().apply(self.slice(svc));
            self.slices.insert(slice);
        }
        let node_ip = self.lab.node().ip;
        Addrs {
            vip: ip.map(|ip| SocketAddrV4::new(ip, SVC_PORT)),
            node_port: np.map(|p| SocketAddrV4::new(node_ip, p as u16)),
        }
    }

    fn delete(&mut self, name: &str) {
        assert!(self.services.remove(name).is_some(), "no service {name}");
        self.api.api().delete(Kind::Services, NAMESPACE, name);
        let slice = Self::slice_name(name);
        if self.slices.remove(&slice) {
            self.api
                .api()
                .delete(Kind::EndpointSlices, NAMESPACE, &slice);
        }
    }
}

fn pods_yaml(apps: &[(&str, usize)]) -> String {
    let mut y = String::new();
    for (app, n) in apps {
        for i in 1..=*n {
            y.push_str(&format!(
                "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {app}-{i}, namespace: {NAMESPACE}, labels: {{app: {app}}}}}\n\
                 spec: {{containers: [{{name: c, image: lab-server, ports: [{{containerPort: {POD_PORT}, protocol: TCP}}]}}]}}\n"
            ));
        }
    }
    y
}

fn agent_ready(lab: &mut Lab) {
    lab.wait_ready(START).expect("agent's first sync");
    lab.wait_attached(START).expect("agent attached");
}

fn manifests_lab(apps: &[(&str, usize)]) -> ManifestsDriver {
    let mut lab = Lab::builder()
        .manifests_yaml(&pods_yaml(apps))
        .agent_bin(env!("CARGO_BIN_EXE_proxy-agent"))
        .start()
        .expect("lab");
    agent_ready(&mut lab);
    println!("lab {} (manifests source)", lab.id());
    ManifestsDriver { lab }
}

/// A lab whose agent watches the fake API server in its node namespace.
/// `initial` Services (with their slices) exist before the agent starts.
fn kube_lab(apps: &[(&str, usize)], initial: &[Svc]) -> (KubeDriver, Vec<Addrs>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig: PathBuf = dir.path().join("kubeconfig");
    let lab = Lab::builder()
        .manifests_yaml(&pods_yaml(apps))
        .agent(false)
        .agent_source_args([
            "--source".to_string(),
            "kubernetes".to_string(),
            "--kubeconfig".to_string(),
            kubeconfig.display().to_string(),
        ])
        .start()
        .expect("lab");
    let api = NsApiServer::start(&lab.node().netns);
    std::fs::write(&kubeconfig, api.kubeconfig()).expect("kubeconfig");
    // The lab's own Node object (InternalIP = the node address).
    for o in lab.objects() {
        if let Object::Node(n) = o {
            let mut v = serde_json::to_value(n.as_ref()).expect("node json");
            v["apiVersion"] = json!("v1");
            v["kind"] = json!("Node");
            api.api().apply(v);
        }
    }
    let mut d = KubeDriver {
        lab,
        api,
        next_ip: KUBE_VIP_FIRST,
        next_node_port: KUBE_NODE_PORT_FIRST,
        services: BTreeMap::new(),
        slices: BTreeSet::new(),
        _dir: dir,
    };
    let addrs = initial.iter().map(|s| d.put(s)).collect();
    d.lab.start_agent().expect("start agent");
    agent_ready(&mut d.lab);
    println!(
        "lab {} (kubernetes source, API server at 127.0.0.1:{} in {})",
        d.lab.id(),
        d.api.port,
        d.api.netns
    );
    (d, addrs)
}

// ---------------------------------------------------------------------------
// Traffic

/// One new TCP connection from the lab's client: the answering pod's name.
fn probe(ns: &str, addr: SocketAddrV4) -> Result<String, String> {
    in_netns(ns, move || tcp_request_here(addr, b"hostname\n", PROBE))
        .map_err(|e| format!("netns: {e}"))?
        .map(|r| reply_text(&r))
        .map_err(|e| e.to_string())
}

fn client_ns(lab: &Lab) -> String {
    lab.client().netns.clone()
}

/// Waits until `addr` answers from one of `app`'s pods, then checks that 5
/// more connections do too. Returns how long it took.
fn wait_up(lab: &Lab, addr: SocketAddrV4, app: &str, what: &str) -> Duration {
    let ns = client_ns(lab);
    let pods = pod_names(lab, app);
    let start = Instant::now();
    let mut last: String;
    let mut tries = 0;
    loop {
        tries += 1;
        match probe(&ns, addr) {
            Ok(name) if pods.contains(&name) => break,
            Ok(other) => last = format!("answered by {other:?}, not one of {pods:?}"),
            Err(e) => last = e,
        }
        assert!(
            start.elapsed() < CHANGE,
            "{what}: {addr} not up after {tries} tries in {CHANGE:?}: {last}\nagent log tail:\n{}",
            log_tail(lab)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = start.elapsed();
    let mut seen = BTreeSet::new();
    for _ in 0..5 {
        let name = probe(&ns, addr).unwrap_or_else(|e| panic!("{what}: {addr} flapped: {e}"));
        assert!(pods.contains(&name), "{what}: {addr} answered by {name}");
        seen.insert(name);
    }
    println!(
        "  up   {what:<48} {addr:<20} after {:>5} ms ({tries} tries; pods {seen:?})",
        took.as_millis()
    );
    took
}

/// Waits until connections to `addr` fail, then checks that 3 more do.
fn wait_down(lab: &Lab, addr: SocketAddrV4, what: &str) -> Duration {
    let ns = client_ns(lab);
    let start = Instant::now();
    let mut tries = 0;
    let err = loop {
        tries += 1;
        match probe(&ns, addr) {
            Err(e) => break e,
            Ok(name) => assert!(
                start.elapsed() < CHANGE,
                "{what}: {addr} still answered by {name} after {CHANGE:?}\nagent log tail:\n{}",
                log_tail(lab)
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = start.elapsed();
    assert_down(lab, addr, 3, what);
    println!(
        "  down {what:<48} {addr:<20} after {:>5} ms ({tries} tries; {err})",
        took.as_millis()
    );
    took
}

/// `n` new connections to `addr` all fail.
fn assert_down(lab: &Lab, addr: SocketAddrV4, n: usize, what: &str) {
    let ns = client_ns(lab);
    for _ in 0..n {
        if let Ok(name) = probe(&ns, addr) {
            panic!("{what}: {addr} answered by {name}; it must not be served");
        }
    }
}

fn log_tail(lab: &Lab) -> String {
    let log = lab.agent_log();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(25)..].join("\n")
}

// ---------------------------------------------------------------------------
// The scenario table, run through either source

const PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
const HEADLESS: &str = "service.kubernetes.io/headless";

const S27_S28_APPS: &[(&str, usize)] = &[
    ("pn-disabled", 2),
    ("pn-toggled", 2),
    ("hl-disabled", 2),
    ("hl-toggled", 2),
];

fn s27_s28_services() -> Vec<Svc> {
    vec![
        Svc::new("pn-disabled", "ClusterIP", "pn-disabled").label(PROXY_NAME, "foo-bar"),
        Svc::new("pn-toggled", "ClusterIP", "pn-toggled"),
        Svc::new("hl-disabled", "ClusterIP", "hl-disabled").label(HEADLESS, ""),
        Svc::new("hl-toggled", "ClusterIP", "hl-toggled"),
    ]
}

/// S27 and S28: a Service labelled for another proxy, or headless, is
/// ignored although it has a ClusterIP; labelling and unlabelling a served
/// Service removes and restores it live.
fn s27_s28(d: &mut dyn Driver, addrs: &[Addrs]) {
    let src = d.source();
    println!("S27/S28 through the {src} source");
    let svcs = s27_s28_services();
    let vip = |i: usize| addrs[i].vip.expect("ClusterIP");
    for (i, s) in svcs.iter().enumerate() {
        println!("  {} at {} labels {:?}", s.name, vip(i), s.labels);
    }
    wait_up(d.lab(), vip(1), "pn-toggled", "S27 unlabelled service");
    wait_up(d.lab(), vip(3), "hl-toggled", "S28 unlabelled service");
    // Both served ones are up, so the agent has synced everything it sees.
    assert_down(d.lab(), vip(0), 3, "S27 proxy-name foo-bar never served");
    assert_down(d.lab(), vip(2), 3, "S28 headless never served");
    println!(
        "  down S27 pn-disabled {} and S28 hl-disabled {}: refused/unreachable",
        vip(0),
        vip(2)
    );

    for round in 1..=2 {
        d.put(&svcs[1].clone().label(PROXY_NAME, "foo-bar"));
        wait_down(
            d.lab(),
            vip(1),
            &format!("S27 round {round}: labelled foo-bar"),
        );
        d.put(&svcs[3].clone().label(HEADLESS, ""));
        wait_down(
            d.lab(),
            vip(3),
            &format!("S28 round {round}: labelled headless"),
        );
        d.put(&svcs[1]);
        wait_up(
            d.lab(),
            vip(1),
            "pn-toggled",
            &format!("S27 round {round}: unlabelled"),
        );
        d.put(&svcs[3]);
        wait_up(
            d.lab(),
            vip(3),
            "hl-toggled",
            &format!("S28 round {round}: unlabelled"),
        );
    }
    assert_down(
        d.lab(),
        vip(0),
        3,
        "S27 proxy-name foo-bar still not served",
    );
    assert_down(d.lab(), vip(2), 3, "S28 headless still not served");
    println!("S27/S28 through the {src} source: ok");
}

const TYPES_APPS: &[(&str, usize)] = &[("flip", 2)];

/// S13–S16, the proxy side, on one Service walked through every type
/// change: ExternalName → ClusterIP (S13) → NodePort → ExternalName (S16)
/// → NodePort (S14) → ClusterIP → ExternalName (S15).
fn s13_s16(d: &mut dyn Driver) {
    let src = d.source();
    println!("S13-S16 through the {src} source");
    let ext = Svc::new("flip", "ExternalName", "flip");
    let cip = Svc::new("flip", "ClusterIP", "flip");
    let np = Svc::new("flip", "NodePort", "flip");

    let a = d.put(&ext);
    assert_eq!(
        a,
        Addrs::default(),
        "an ExternalName service has no frontend"
    );
    println!("  ExternalName: no ClusterIP, no NodePort");

    let a = d.put(&cip);
    let vip1 = a.vip.expect("ClusterIP");
    wait_up(d.lab(), vip1, "flip", "S13 ExternalName -> ClusterIP: VIP");

    let a = d.put(&np);
    assert_eq!(a.vip, Some(vip1), "the ClusterIP is kept");
    let np1 = a.node_port.expect("NodePort");
    wait_up(d.lab(), np1, "flip", "ClusterIP -> NodePort: nodePort");
    wait_up(d.lab(), vip1, "flip", "ClusterIP -> NodePort: VIP still");

    let a = d.put(&ext);
    assert_eq!(a, Addrs::default());
    wait_down(d.lab(), vip1, "S16 NodePort -> ExternalName: old VIP");
    wait_down(d.lab(), np1, "S16 NodePort -> ExternalName: nodePort");

    let a = d.put(&np);
    let vip2 = a.vip.expect("ClusterIP");
    let np2 = a.node_port.expect("NodePort");
    wait_up(d.lab(), vip2, "flip", "S14 ExternalName -> NodePort: VIP");
    wait_up(
        d.lab(),
        np2,
        "flip",
        "S14 ExternalName -> NodePort: nodePort",
    );

    let a = d.put(&cip);
    assert_eq!(a.vip, Some(vip2));
    assert_eq!(a.node_port, None);
    wait_down(d.lab(), np2, "NodePort -> ClusterIP: nodePort");
    wait_up(d.lab(), vip2, "flip", "NodePort -> ClusterIP: VIP still");

    d.put(&ext);
    wait_down(d.lab(), vip2, "S15 ClusterIP -> ExternalName: old VIP");
    println!("S13-S16 through the {src} source: ok");
}

const S7_APPS: &[(&str, usize)] = &[("again", 2)];

/// S7: delete a Service, wait for it to go, recreate it with a new
/// ClusterIP: it works there, and the old VIP stays dead.
fn s7(d: &mut dyn Driver) {
    let src = d.source();
    println!("S7 through the {src} source");
    let svc = Svc::new("again", "ClusterIP", "again");
    let old = d.put(&svc).vip.expect("ClusterIP");
    wait_up(d.lab(), old, "again", "S7 before: VIP");
    d.delete("again");
    wait_down(d.lab(), old, "S7 deleted: old VIP");
    let new_ip = Ipv4Addr::new(198, 19, 222, 7);
    let new = d.put(&svc.clone().ip(new_ip)).vip.expect("ClusterIP");
    assert_ne!(new.ip(), old.ip(), "recreated with a new ClusterIP");
    wait_up(d.lab(), new, "again", "S7 recreated: new VIP");
    assert_down(d.lab(), old, 3, "S7 recreated: old VIP");
    println!("  down S7 recreated: old VIP {old} still refused");
    println!("S7 through the {src} source: ok");
}

// ---------------------------------------------------------------------------
// Tests

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s27_s28_label_toggles_kubernetes_source() {
    let (mut d, addrs) = kube_lab(S27_S28_APPS, &s27_s28_services());
    s27_s28(&mut d, &addrs);
    // The labelled services never reached the agent: the watch filtered them.
    let reqs = d.api.api().requests();
    let sel = reqs
        .iter()
        .find(|r| r.kind == Some(Kind::Services))
        .and_then(|r| r.query.get("labelSelector").cloned());
    println!("  services watched with labelSelector {sel:?}");
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s27_s28_label_toggles_manifests_source() {
    let mut d = manifests_lab(S27_S28_APPS);
    let addrs: Vec<Addrs> = s27_s28_services().iter().map(|s| d.put(s)).collect();
    s27_s28(&mut d, &addrs);
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s13_s14_s15_s16_type_changes_kubernetes_source() {
    let (mut d, _) = kube_lab(TYPES_APPS, &[]);
    s13_s16(&mut d);
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s13_s14_s15_s16_type_changes_manifests_source() {
    let mut d = manifests_lab(TYPES_APPS);
    s13_s16(&mut d);
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s7_recreated_service_new_cluster_ip_kubernetes_source() {
    let (mut d, _) = kube_lab(S7_APPS, &[]);
    s7(&mut d);
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s7_recreated_service_new_cluster_ip_manifests_source() {
    let mut d = manifests_lab(S7_APPS);
    s7(&mut d);
}

/// Connections that succeeded, and the failures with their time.
type ProbeLog = (usize, Vec<(Duration, String)>);

/// New connections, one after another, from the client to `addr` until
/// stopped: (ok, failures with their time since `origin`).
struct Prober {
    stop: Arc<AtomicBool>,
    results: Arc<Mutex<ProbeLog>>,
    handle: std::thread::JoinHandle<()>,
}

impl Prober {
    fn start(ns: &str, addr: SocketAddrV4, pods: Vec<String>, origin: Instant) -> Prober {
        let stop = Arc::new(AtomicBool::new(false));
        let results = Arc::new(Mutex::new((0usize, Vec::new())));
        let (s, r, ns) = (stop.clone(), results.clone(), ns.to_string());
        let handle = std::thread::spawn(move || {
            in_netns(&ns, move || {
                // Bounded: a minute at most.
                let end = Instant::now() + Duration::from_secs(60);
                while !s.load(Ordering::Relaxed) && Instant::now() < end {
                    let res = tcp_request_here(addr, b"hostname\n", Duration::from_secs(1))
                        .map(|b| reply_text(&b));
                    let mut g = r.lock().unwrap();
                    match res {
                        Ok(name) if pods.contains(&name) => g.0 += 1,
                        Ok(other) => g.1.push((origin.elapsed(), format!("answered by {other}"))),
                        Err(e) => g.1.push((origin.elapsed(), e.to_string())),
                    }
                    drop(g);
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
            .expect("prober netns");
        });
        Prober {
            stop,
            results,
            handle,
        }
    }

    fn snapshot(&self) -> (usize, usize) {
        let g = self.results.lock().unwrap();
        (g.0, g.1.len())
    }

    fn finish(self) -> ProbeLog {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().expect("prober");
        let g = self.results.lock().unwrap();
        (g.0, g.1.clone())
    }
}

/// S9: the API server goes away (listener closed, every connection
/// dropped) for a few seconds while new connections keep going to an
/// unchanged service; meanwhile a Service is added and another deleted.
/// No connection fails; during the outage the agent keeps what it
/// programmed; after the restart both changes are applied within the
/// agent's backoff.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s9_apiserver_outage_keeps_traffic_and_catches_up_kubernetes_source() {
    let apps = &[("stable", 2), ("doomed", 1), ("added", 1)];
    let stable = Svc::new("stable", "ClusterIP", "stable");
    let doomed = Svc::new("doomed", "ClusterIP", "doomed");
    let (mut d, addrs) = kube_lab(apps, &[stable.clone(), doomed.clone()]);
    let (stable_vip, doomed_vip) = (addrs[0].vip.unwrap(), addrs[1].vip.unwrap());
    wait_up(&d.lab, stable_vip, "stable", "S9 before: stable");
    wait_up(&d.lab, doomed_vip, "doomed", "S9 before: doomed");

    let origin = Instant::now();
    let prober = Prober::start(
        &client_ns(&d.lab),
        stable_vip,
        pod_names(&d.lab, "stable"),
        origin,
    );
    std::thread::sleep(Duration::from_secs(1));
    let log_before = d.lab.agent_log().lines().count();
    let syncs_before = d.lab.sync_count();

    // Outage.
    let t_stop = origin.elapsed();
    d.api.stop();
    let added_addrs = d.put(&Svc::new("added", "ClusterIP", "added"));
    let added_vip = added_addrs.vip.unwrap();
    d.delete("doomed");
    let outage = Duration::from_secs(5);
    std::thread::sleep(outage / 2);
    // The agent cannot know: what it programmed stays, nothing new appears.
    let mid = probe(&client_ns(&d.lab), doomed_vip);
    assert!(
        mid.is_ok(),
        "S9 during the outage the deleted-but-unseen service keeps working: {mid:?}"
    );
    assert_down(
        &d.lab,
        added_vip,
        2,
        "S9 during the outage: added not yet seen",
    );
    std::thread::sleep(outage / 2);
    let (ok_out, fail_out) = prober.snapshot();
    let log_mid: Vec<String> = d
        .lab
        .agent_log()
        .lines()
        .skip(log_before)
        .map(str::to_string)
        .collect();
    let watch_errors = log_mid.iter().filter(|l| l.contains("watch error")).count();

    // Back.
    let t_restart = origin.elapsed();
    d.api.restart();
    let restarted = Instant::now();
    let up = wait_up(
        &d.lab,
        added_vip,
        "added",
        "S9 after restart: added service",
    );
    let down_extra = wait_down(&d.lab, doomed_vip, "S9 after restart: deleted service");
    let caught_up = restarted.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    let (ok, failures) = prober.finish();
    let t_end = origin.elapsed();

    let (lists, watches) = d.api.api().counts(Kind::Services);
    println!(
        "S9 figures: outage {:.1}s..{:.1}s ({outage:?}); stable {stable_vip}: {ok} connections ok, {} failed over {:.1}s \
         ({ok_out} ok / {fail_out} failed by the end of the outage)",
        t_stop.as_secs_f64(),
        t_restart.as_secs_f64(),
        failures.len(),
        t_end.as_secs_f64()
    );
    println!(
        "S9 figures: {watch_errors} 'watch error' log lines during the outage; after the restart the added service \
         answered in {} ms and the deleted one was gone {} ms later (caught up in {} ms); \
         syncs {} -> {}; Services requests in all: {lists} lists, {watches} watches",
        up.as_millis(),
        down_extra.as_millis(),
        caught_up.as_millis(),
        syncs_before,
        d.lab.sync_count()
    );
    assert!(
        watch_errors > 0,
        "the agent saw the outage:\n{}",
        log_mid.join("\n")
    );
    assert!(
        failures.is_empty(),
        "S9 connections to the unchanged service failed: {failures:?}"
    );
    assert!(ok > 100, "enough connections were made ({ok})");
    assert!(caught_up <= CHANGE, "caught up within {CHANGE:?}");
}

// ---------------------------------------------------------------------------
// First start on a node without kube-proxy (issue: the agent's own access)

/// The in-cluster service account a pod gets, in a private mount namespace of
/// the agent's (a tmpfs over /run, so nothing of the machine changes):
/// `/run/secrets/kubernetes.io/serviceaccount/{token,ca.crt,namespace}`.
fn in_cluster_files_on_spawn(cmd: &mut std::process::Command) {
    use std::ffi::CString;
    use std::os::unix::process::CommandExt;
    let ca = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/fake-serviceaccount-ca.crt"
    ))
    .expect("test CA");
    let dirs: Vec<CString> = [
        "/run/secrets",
        "/run/secrets/kubernetes.io",
        "/run/secrets/kubernetes.io/serviceaccount",
    ]
    .iter()
    .map(|d| CString::new(*d).unwrap())
    .collect();
    let files: Vec<(CString, Vec<u8>)> = [
        ("token", b"fake-token".to_vec()),
        ("ca.crt", ca),
        ("namespace", b"kube-system".to_vec()),
    ]
    .into_iter()
    .map(|(n, c)| {
        (
            CString::new(format!("/run/secrets/kubernetes.io/serviceaccount/{n}")).unwrap(),
            c,
        )
    })
    .collect();
    let run = CString::new("/run").unwrap();
    let root = CString::new("/").unwrap();
    let tmpfs = CString::new("tmpfs").unwrap();
    // SAFETY: only async-signal-safe calls after fork (unshare, mount, mkdir,
    // open, write, close) on memory prepared before it.
    unsafe {
        cmd.pre_exec(move || {
            let check = |rc: libc::c_int| {
                if rc < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(())
                }
            };
            check(libc::unshare(libc::CLONE_NEWNS))?;
            check(libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                tmpfs.as_ptr(),
                run.as_ptr(),
                tmpfs.as_ptr(),
                0,
                std::ptr::null(),
            ))?;
            for d in &dirs {
                check(libc::mkdir(d.as_ptr(), 0o755))?;
            }
            for (path, content) in &files {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CREAT, 0o600);
                check(fd)?;
                let n = libc::write(fd, content.as_ptr().cast(), content.len());
                libc::close(fd);
                check(n as libc::c_int)?;
            }
            Ok(())
        });
    }
}

/// An agent started by hand in the lab's node namespace and cgroup, as the
/// DaemonSet runs it: `--source kubernetes`, in-cluster config whose
/// KUBERNETES_SERVICE_HOST is a ClusterIP, and `extra` flags.
fn spawn_in_cluster_agent(
    lab: &Lab,
    log: &std::path::Path,
    extra: &[String],
) -> std::process::Child {
    let node = lab.node();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_proxy-agent"));
    cmd.args([
        "run",
        "--source",
        "kubernetes",
        "--node-name",
        &node.name,
        "--bpffs",
    ])
    .arg(&node.bpffs)
    .args(["--pod-interfaces", "lxc*", "--min-sync-period", "100ms"])
    .args([
        "--healthz-bind-address",
        "127.0.0.1:10256",
        "--metrics-bind-address",
        "",
    ])
    .args(extra)
    .env("KUBERNETES_SERVICE_HOST", IN_CLUSTER_VIP.to_string())
    .env("KUBERNETES_SERVICE_PORT", "443")
    .env("RUST_LOG", "info")
    .stdin(std::process::Stdio::null())
    .stdout(std::fs::File::create(log).expect("log"))
    .stderr(
        std::fs::OpenOptions::new()
            .append(true)
            .open(log)
            .expect("log"),
    );
    match &node.cgroup {
        Some(cg) => cmd.arg("--cgroup-root").arg(cg),
        None => cmd.args(["--host-socket-lb", "false"]),
    };
    xtask::netns::enter_netns_on_spawn(&mut cmd, &node.netns).expect("netns");
    in_cluster_files_on_spawn(&mut cmd);
    cmd.spawn().expect("spawn agent")
}

/// The ClusterIP of the `kubernetes` Service in this test (nothing serves it).
const IN_CLUSTER_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 255, 1);

/// `/readyz` of the hand-started agent: its HTTP status, if it answers.
fn readyz(lab: &Lab) -> Option<u16> {
    use std::io::{Read, Write};
    // Not tcp_request_here: hyper answers nothing to a half-closed request.
    let r = in_netns(&lab.node().netns, || -> std::io::Result<Vec<u8>> {
        let addr = std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, 10256));
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
        s.set_read_timeout(Some(Duration::from_secs(1)))?;
        s.write_all(b"GET /readyz HTTP/1.0\r\n\r\n")?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf)?;
        Ok(buf)
    })
    .ok()?
    .ok()?;
    String::from_utf8_lossy(&r)
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    t.elapsed()
}

/// First start on a node with no maps yet: with only in-cluster config
/// pointing at a ClusterIP, the agent says within seconds which address it
/// tried and which setting fixes it, and its readiness stays false; with
/// the API server's own address (`--master`) it syncs, becomes ready, and
/// Services work.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn first_start_without_kube_proxy_names_the_api_server_setting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut d, addrs) = kube_lab(&[("web", 1)], &[Svc::new("web", "ClusterIP", "web")]);
    d.lab.stop_agent().expect("stop the lab's agent");
    let _ = proxy_agent::bpf::cleanup(&d.lab.node().bpffs);
    let vip = addrs[0].vip.expect("ClusterIP");

    let log = dir.path().join("agent-in-cluster.log");
    let mut agent = spawn_in_cluster_agent(&d.lab, &log, &[]);
    let took = wait_for("the API-server hint", Duration::from_secs(15), || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines().any(|l| {
            l.contains("ERROR")
                && l.contains(&format!("{IN_CLUSTER_VIP}"))
                && l.contains("KUBERNETES_SERVICE_HOST")
                && l.contains("--master")
        })
    });
    println!("in-cluster at a ClusterIP: the hint came after {took:?}");
    assert_eq!(
        readyz(&d.lab),
        Some(503),
        "not ready before a complete sync"
    );
    assert!(
        probe(&d.lab.info().client.netns, vip).is_err(),
        "nothing programmed yet"
    );
    let _ = agent.kill();
    let _ = agent.wait();

    let log = dir.path().join("agent-master.log");
    let master = format!("http://127.0.0.1:{}", d.api.port);
    let mut agent = spawn_in_cluster_agent(&d.lab, &log, &["--master".into(), master]);
    wait_for("sync with --master", Duration::from_secs(15), || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("sync complete: initial state programmed")
    });
    wait_for("readiness", Duration::from_secs(5), || {
        readyz(&d.lab) == Some(200)
    });
    let answer = probe(&d.lab.info().client.netns, vip);
    let _ = agent.kill();
    let _ = agent.wait();
    assert_eq!(
        answer.as_deref(),
        Ok("web-1"),
        "a Service through the synced agent"
    );
}

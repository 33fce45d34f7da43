//! Lab tests (root) of the `kubernetes` source with real traffic against a
//! real control plane: etcd, kube-apiserver and kube-controller-manager
//! v1.37.2 built by setup, run by the lab in a namespace of its own
//! (`xtask::Lab` with `control_plane(true)`). The agent runs `--source
//! kubernetes` as deploy/'s ServiceAccount; ClusterIPs and NodePorts come
//! from the API server's allocators, EndpointSlices from the real
//! controller; the lab plays the kubelet.
//!
//! The same scenario table runs through the `manifests` source (the same
//! `lab.apply`/`lab.delete` calls, written to the agent's manifests
//! instead), so each row is shown through both sources:
//! - S27/S28: toggling `service.kubernetes.io/service-proxy-name` /
//!   `service.kubernetes.io/headless` adds and removes the service live;
//! - S13–S16 (proxy side): ExternalName ↔ ClusterIP ↔ NodePort, the VIP and
//!   the NodePort start and stop working;
//! - S7: a service recreated with a new ClusterIP works there;
//! - S9 (kubernetes only): kube-apiserver, and etcd, restarted under
//!   traffic: no connection fails, and what changed after is applied;
//! - the first start on a node without kube-proxy: in-cluster config at the
//!   `kubernetes` ClusterIP names the setting to fix and stays unready, and
//!   deploy/api-server.yaml's override bootstraps the agent against the
//!   real server.
//!
//! Run with `cargo xtask test` (they are `#[ignore]`d under a plain `cargo test`).
//!
//! Why one file (about 1,300 lines): every scenario of the table runs
//! through both sources with the same driver and traffic probes, so the
//! table and its fixtures belong together. The file is in sections: the
//! Services and the driver, traffic, the scenario table, the tests.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use xtask::{
    client::{reply_text, tcp_request_here},
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
// ---------------------------------------------------------------------------
// Services and the driver

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

/// Changes through the lab: written to the agent's manifests (`--source
/// manifests`), or to the real API server (`--source kubernetes`), whose
/// allocators fill in ClusterIP and NodePort and whose EndpointSlice
/// controller publishes the pods. Either way `put` and `delete` return
/// once the change is made (the lab waits for the controller); the tests
/// then wait for traffic.
struct Driver {
    lab: Lab,
    source: &'static str,
}

impl Driver {
    fn lab(&mut self) -> &mut Lab {
        &mut self.lab
    }

    /// Creates or replaces the Service; returns its addresses.
    fn put(&mut self, svc: &Svc) -> Addrs {
        // JSON is YAML.
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

fn manifests_lab(apps: &[(&str, usize)]) -> Driver {
    let mut lab = Lab::builder()
        .manifests_yaml(&pods_yaml(apps))
        .agent_bin(env!("CARGO_BIN_EXE_proxy-agent"))
        .control_plane(false)
        .start()
        .expect("lab");
    agent_ready(&mut lab);
    println!("lab {} (manifests source)", lab.id());
    Driver {
        lab,
        source: "manifests",
    }
}

/// A lab with a real control plane, whose agent watches it as deploy/'s
/// ServiceAccount. `initial` Services exist (and their slices are
/// published) before the agent starts.
fn kube_lab(apps: &[(&str, usize)], initial: &[Svc]) -> (Driver, Vec<Addrs>) {
    let lab = Lab::builder()
        .manifests_yaml(&pods_yaml(apps))
        .agent_bin(env!("CARGO_BIN_EXE_proxy-agent"))
        .control_plane(true)
        .agent(false)
        .start()
        .expect("lab");
    let mut d = Driver {
        lab,
        source: "kubernetes",
    };
    let addrs = initial.iter().map(|s| d.put(s)).collect();
    d.lab.start_agent().expect("start agent");
    agent_ready(&mut d.lab);
    println!(
        "lab {} (kubernetes source, API server {})",
        d.lab.id(),
        d.lab.control_plane().expect("control plane").server()
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
    wait_up_within(lab, addr, app, what, CHANGE)
}

/// [`wait_up`] with a bound of its own.
fn wait_up_within(
    lab: &Lab,
    addr: SocketAddrV4,
    app: &str,
    what: &str,
    bound: Duration,
) -> Duration {
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
            start.elapsed() < bound,
            "{what}: {addr} not up after {tries} tries in {bound:?}: {last}\nagent log tail:\n{}",
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

/// The agent's log lines after the first `skip`.
fn log_since(lab: &Lab, skip: usize) -> Vec<String> {
    lab.agent_log()
        .lines()
        .skip(skip)
        .map(str::to_string)
        .collect()
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
fn s27_s28(d: &mut Driver, addrs: &[Addrs]) {
    let src = d.source;
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
fn s13_s16(d: &mut Driver) {
    let src = d.source;
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
fn s7(d: &mut Driver) {
    let src = d.source;
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

/// A lab with a real control plane and two Services answering, `stable`
/// (two pods) and `doomed` (one), and a pod for an `added` Service to come:
/// the outage tests' fixture. Returns the two ClusterIPs.
fn stable_and_doomed(test: &str) -> (Driver, SocketAddrV4, SocketAddrV4) {
    let apps = &[("stable", 2), ("doomed", 1), ("added", 1)];
    let stable = Svc::new("stable", "ClusterIP", "stable");
    let doomed = Svc::new("doomed", "ClusterIP", "doomed");
    let (d, addrs) = kube_lab(apps, &[stable, doomed]);
    let (stable_vip, doomed_vip) = (addrs[0].vip.unwrap(), addrs[1].vip.unwrap());
    wait_up(
        &d.lab,
        stable_vip,
        "stable",
        &format!("{test} before: stable"),
    );
    wait_up(
        &d.lab,
        doomed_vip,
        "doomed",
        &format!("{test} before: doomed"),
    );
    (d, stable_vip, doomed_vip)
}

/// What S9 restarts.
#[derive(Clone, Copy, Debug)]
enum Restarted {
    ApiServer,
    Etcd,
}

/// S9: kube-apiserver (or etcd) stopped for a few seconds and started
/// again while new connections keep going to an unchanged service. No
/// connection fails: while the API is gone the agent keeps what it
/// programmed. Once it is back, a Service added and another deleted are
/// applied within the watcher's backoff (at most 30 s between retries).
fn s9_restart_under_traffic(what: Restarted) {
    let (mut d, stable_vip, doomed_vip) = stable_and_doomed("S9");

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
    match what {
        Restarted::ApiServer => d.lab.stop_apiserver(),
        Restarted::Etcd => d.lab.stop_etcd(),
    }
    .expect("stop");
    let outage = Duration::from_secs(5);
    std::thread::sleep(outage);
    let mid = probe(&client_ns(&d.lab), doomed_vip);
    assert!(
        mid.is_ok(),
        "S9 during the outage what was programmed keeps working: {mid:?}"
    );
    let (ok_out, fail_out) = prober.snapshot();
    let log_mid = log_since(&d.lab, log_before);
    let watch_errors = log_mid.iter().filter(|l| l.contains("watch error")).count();

    // Back.
    let t_restart = origin.elapsed();
    match what {
        Restarted::ApiServer => d.lab.start_apiserver(),
        Restarted::Etcd => d.lab.start_etcd(),
    }
    .expect("start");
    d.lab
        .wait_apiserver_ready(Duration::from_secs(120))
        .expect("API server ready again");
    let restarted = Instant::now();
    let added_vip = d.put(&Svc::new("added", "ClusterIP", "added")).vip.unwrap();
    d.delete("doomed");
    let up = wait_up_within(
        &d.lab,
        added_vip,
        "added",
        "S9 after restart: added service",
        CATCH_UP,
    );
    let down_extra = wait_down(&d.lab, doomed_vip, "S9 after restart: deleted service");
    let caught_up = restarted.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    let (ok, failures) = prober.finish();
    let t_end = origin.elapsed();

    println!(
        "S9 figures ({what:?}): outage {:.1}s..{:.1}s; stable {stable_vip}: {ok} connections ok, {} failed \
         over {:.1}s ({ok_out} ok / {fail_out} failed by the end of the outage)",
        t_stop.as_secs_f64(),
        t_restart.as_secs_f64(),
        failures.len(),
        t_end.as_secs_f64()
    );
    println!(
        "S9 figures ({what:?}): {watch_errors} 'watch error' log lines during the outage; after the \
         restart the added service answered in {} ms and the deleted one was gone {} ms later \
         (caught up in {} ms); syncs {} -> {}",
        up.as_millis(),
        down_extra.as_millis(),
        caught_up.as_millis(),
        syncs_before,
        d.lab.sync_count()
    );
    if let Restarted::ApiServer = what {
        // With etcd gone the API server keeps the watches open from its
        // cache; with the API server gone they break.
        assert!(
            watch_errors > 0,
            "the agent saw the outage:\n{}",
            log_mid.join("\n")
        );
    }
    assert!(
        failures.is_empty(),
        "S9 connections to the unchanged service failed: {failures:?}"
    );
    assert!(ok > 100, "enough connections were made ({ok})");
}

/// Bound of the catch-up after a restart: kube's watcher backs off up to
/// 30 s between retries while the API server is away.
const CATCH_UP: Duration = Duration::from_secs(45);

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s9_apiserver_restart_keeps_traffic_and_catches_up_kubernetes_source() {
    s9_restart_under_traffic(Restarted::ApiServer);
}

#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s9_etcd_restart_keeps_traffic_and_catches_up_kubernetes_source() {
    s9_restart_under_traffic(Restarted::Etcd);
}

// ---------------------------------------------------------------------------
// First start on a node without kube-proxy (issue: the agent's own access)

/// The in-cluster service account a pod gets, in a private mount namespace of
/// the agent's (a tmpfs over /run, so nothing of the machine changes):
/// `/run/secrets/kubernetes.io/serviceaccount/{token,ca.crt,namespace}`,
/// with the lab's real token (deploy/'s ServiceAccount) and CA.
fn in_cluster_files_on_spawn(cmd: &mut std::process::Command, token: Vec<u8>, ca: Vec<u8>) {
    use std::ffi::CString;
    use std::os::unix::process::CommandExt;
    let dirs: Vec<CString> = [
        "/run/secrets",
        "/run/secrets/kubernetes.io",
        "/run/secrets/kubernetes.io/serviceaccount",
    ]
    .iter()
    .map(|d| CString::new(*d).unwrap())
    .collect();
    let files: Vec<(CString, Vec<u8>)> = [
        ("token", token),
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

/// An agent started by hand in the lab's node namespace, as the DaemonSet
/// runs it: `--source kubernetes`, in-cluster config (deploy/'s
/// ServiceAccount token and the cluster's CA) with `env`
/// (`KUBERNETES_SERVICE_HOST`/`_PORT`).
fn spawn_in_cluster_agent(lab: &Lab, log: &Path, env: &[(String, String)]) -> std::process::Child {
    let node = lab.node();
    let cp = lab.control_plane().expect("control plane");
    let token = std::fs::read(cp.agent_token()).expect("the agent's token");
    let ca = std::fs::read(cp.ca()).expect("the cluster's CA");
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
    .env_remove("KUBECONFIG")
    .env("RUST_LOG", "info")
    .stdin(std::process::Stdio::null())
    .stdout(std::fs::File::create(log).expect("log"))
    .stderr(
        std::fs::OpenOptions::new()
            .append(true)
            .open(log)
            .expect("log"),
    );
    for (k, v) in env {
        cmd.env(k, v);
    }
    match &node.cgroup {
        Some(cg) => cmd.arg("--cgroup-root").arg(cg),
        None => cmd.args(["--host-socket-lb", "false"]),
    };
    xtask::netns::enter_netns_on_spawn(&mut cmd, &node.netns).expect("netns");
    in_cluster_files_on_spawn(&mut cmd, token, ca);
    cmd.spawn().expect("spawn agent")
}

/// The `kubernetes` Service's ClusterIP: what in-cluster config dials by
/// default, and what nothing translates before the agent's first sync.
const KUBERNETES_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 1);

/// The environment deploy/api-server.yaml's ConfigMap gives the agent.
fn api_server_override() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/api-server.yaml"
    ))
    .expect("deploy/api-server.yaml");
    let cm: Value = yaml_serde::from_str(&text).expect("a ConfigMap");
    let data = cm["data"].as_object().expect("data");
    data.iter()
        .map(|(k, v)| (k.clone(), v.as_str().expect("a string").to_string()))
        .collect()
}

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

/// First start on a node with no maps yet, against the real API server:
/// with in-cluster config at the `kubernetes` ClusterIP (nothing
/// translates it yet), the agent says within seconds which address it
/// tried and which setting fixes it, and `/readyz` answers 503; with
/// deploy/api-server.yaml's override (the API server's own address) it
/// bootstraps in-cluster, syncs, becomes ready, and Services work.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn first_start_without_kube_proxy_names_the_api_server_setting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut d, addrs) = kube_lab(&[("web", 1)], &[Svc::new("web", "ClusterIP", "web")]);
    d.lab.stop_agent().expect("stop the lab's agent");
    let _ = proxy_agent::bpf::cleanup(&d.lab.node().bpffs);
    let vip = addrs[0].vip.expect("ClusterIP");

    let log = dir.path().join("agent-in-cluster.log");
    let default_env = vec![
        (
            "KUBERNETES_SERVICE_HOST".to_string(),
            KUBERNETES_VIP.to_string(),
        ),
        ("KUBERNETES_SERVICE_PORT".to_string(), "443".to_string()),
    ];
    let mut agent = spawn_in_cluster_agent(&d.lab, &log, &default_env);
    let took = wait_for("the API-server hint", Duration::from_secs(15), || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines().any(|l| {
            l.contains("ERROR")
                && l.contains(&format!("{KUBERNETES_VIP}"))
                && l.contains("KUBERNETES_SERVICE_HOST")
                && l.contains("--master")
        })
    });
    println!("in-cluster at the kubernetes ClusterIP: the hint came after {took:?}");
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

    let env = api_server_override();
    println!("deploy/api-server.yaml's override: {env:?}");
    let cp_ip = d.lab.control_plane().expect("control plane").ip.to_string();
    assert!(
        env.iter()
            .any(|(k, v)| k == "KUBERNETES_SERVICE_HOST" && *v == cp_ip),
        "deploy/api-server.yaml names the lab's API server {cp_ip} (the example address)"
    );
    let log = dir.path().join("agent-override.log");
    let mut agent = spawn_in_cluster_agent(&d.lab, &log, &env);
    let synced = wait_for(
        "sync with deploy/api-server.yaml's override",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("sync complete: initial state programmed")
        },
    );
    wait_for("readiness", Duration::from_secs(5), || {
        readyz(&d.lab) == Some(200)
    });
    let answer = probe(&d.lab.info().client.netns, vip);
    let kubernetes = probe_tls_version(&d.lab);
    let _ = agent.kill();
    let _ = agent.wait();
    println!("in-cluster through the override: synced after {synced:?}");
    assert_eq!(
        answer.as_deref(),
        Ok("web-1"),
        "a Service through the synced agent"
    );
    assert!(
        kubernetes.contains("\"gitVersion\": \"v1.37.2\""),
        "a pod reaches the real API server through the kubernetes Service: {kubernetes}"
    );
}

/// `GET /version` of the API server through the `kubernetes` Service's
/// ClusterIP, from the lab's client pod (curl, checking the certificate
/// for `kubernetes.default` against the cluster's CA).
fn probe_tls_version(lab: &Lab) -> String {
    let cp = lab.control_plane().expect("control plane");
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.info().client.netns,
            "curl",
            "-sS",
            "-m",
            "5",
        ])
        .arg("--cacert")
        .arg(cp.ca())
        .args([
            "--resolve",
            &format!("kubernetes.default:443:{KUBERNETES_VIP}"),
            "https://kubernetes.default/version",
        ])
        .output()
        .expect("curl");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

// ---------------------------------------------------------------------------
// Behaviours of the real API server

/// The agent's requests in the API server's audit log: `(verb, resource,
/// requestURI)` of each.
fn audited(lab: &Lab) -> Vec<(String, String, String)> {
    let path = lab.control_plane().expect("control plane").audit_log();
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|e| {
            (
                e["verb"].as_str().unwrap_or("").to_string(),
                e["objectRef"]["resource"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                e["requestURI"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// The initial list of a large cluster comes in chunks (`limit` and
/// `continue`, as kube-proxy's informers list), every Service is
/// programmed, and the watches that follow ask for bookmarks.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn initial_list_of_a_large_cluster_is_chunked_and_watches_ask_for_bookmarks() {
    const N: usize = 1_200;
    let mut lab = Lab::builder()
        .agent_bin(env!("CARGO_BIN_EXE_proxy-agent"))
        .control_plane(true)
        .agent(false)
        .start()
        .expect("lab");
    let items: Vec<Value> = (0..N)
        .map(|i| {
            json!({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": format!("bulk-{i}"), "namespace": NAMESPACE},
                   "spec": {"ports": [{"port": SVC_PORT, "protocol": "TCP"}]}})
        })
        .collect();
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string();
    let t = Instant::now();
    lab.kubectl(&["create", "-f", "-", "-o", "name"], Some(&list))
        .expect("create the Services");
    println!("{N} Services created through the API in {:?}", t.elapsed());
    lab.start_agent().expect("agent");
    lab.wait_ready(Duration::from_secs(120))
        .expect("the agent's first sync");
    let log = lab.agent_log();
    let initial = log
        .lines()
        .find(|l| l.contains("initial sync"))
        .expect("the initial sync line");
    // Every Service, and the `kubernetes` one.
    assert!(
        initial.contains(&format!("frontends={}", N + 1)),
        "every Service programmed at the first sync: {initial}"
    );
    let audit = audited(&lab);
    let lists: Vec<&String> = audit
        .iter()
        .filter(|(verb, res, _)| verb == "list" && res == "services")
        .map(|(_, _, uri)| uri)
        .collect();
    println!("the agent's lists of Services: {lists:#?}");
    assert!(
        lists.iter().any(|u| u.contains("limit=")) && lists.iter().any(|u| u.contains("continue=")),
        "the initial list is chunked: {lists:?}"
    );
    assert!(
        lists.len() >= N.div_ceil(500),
        "{N} Services in pages of at most 500: {lists:?}"
    );
    let watches: Vec<&String> = audit
        .iter()
        .filter(|(verb, res, _)| verb == "watch" && res == "services")
        .map(|(_, _, uri)| uri)
        .collect();
    assert!(
        !watches.is_empty()
            && watches
                .iter()
                .all(|u| u.contains("allowWatchBookmarks=true")),
        "the watches ask for bookmarks: {watches:?}"
    );
}

fn signal_agent(lab: &Lab, sig: nix::sys::signal::Signal) {
    let pid = lab.node().agent.as_ref().expect("agent running").pid;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).expect("signal");
}

/// A watch expired by etcd's compaction: while the agent is frozen
/// (SIGSTOP), a Service is added and another deleted, etcd's history is
/// compacted and the API server restarted (its watch cache with it). The
/// agent's watch, resumed from its old resourceVersion, gets 410 Gone and
/// relists. Meanwhile nothing programmed is removed (an unchanged Service
/// serves every connection), and both changes are applied, whether first
/// from the events the old connection still held or from the relist, and
/// hold after it.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn a_watch_expired_by_compaction_relists_and_removes_nothing_meanwhile() {
    let (mut d, stable_vip, doomed_vip) = stable_and_doomed("expired watch");
    let origin = Instant::now();
    let prober = Prober::start(
        &client_ns(&d.lab),
        stable_vip,
        pod_names(&d.lab, "stable"),
        origin,
    );
    let log_before = d.lab.agent_log().lines().count();

    signal_agent(&d.lab, nix::sys::signal::Signal::SIGSTOP);
    let added_vip = d.put(&Svc::new("added", "ClusterIP", "added")).vip.unwrap();
    d.delete("doomed");
    let compacted = d.lab.compact_etcd().expect("compact etcd");
    d.lab.stop_apiserver().expect("stop the API server");
    d.lab.start_apiserver().expect("start the API server");
    d.lab
        .wait_apiserver_ready(Duration::from_secs(120))
        .expect("API server ready");
    signal_agent(&d.lab, nix::sys::signal::Signal::SIGCONT);
    let resumed = Instant::now();
    let up = wait_up_within(
        &d.lab,
        added_vip,
        "added",
        "after resuming: added",
        CATCH_UP,
    );
    wait_down(&d.lab, doomed_vip, "after resuming: deleted");
    let caught_up = resumed.elapsed();
    // The changes may come first from the events buffered in the old watch
    // connection before the API server went down; the relist follows the
    // expired resume after the watch's backoff. Wait for it, then check it
    // removed nothing and undid neither change.
    let relisted = |log: &[String]| {
        log.iter()
            .filter(|l| l.contains("listed") && l.contains("first=false"))
            .count()
    };
    let mut log_after = log_since(&d.lab, log_before);
    while relisted(&log_after) == 0 && resumed.elapsed() < CATCH_UP {
        std::thread::sleep(Duration::from_millis(100));
        log_after = log_since(&d.lab, log_before);
    }
    let relists = relisted(&log_after);
    std::thread::sleep(Duration::from_secs(1));
    wait_up_within(
        &d.lab,
        added_vip,
        "added",
        "after the relist: still added",
        CHANGE,
    );
    assert_down(&d.lab, doomed_vip, 3, "after the relist: still deleted");
    let (ok, failures) = prober.finish();
    let expired: Vec<&String> = log_after
        .iter()
        .filter(|l| l.contains("410") || l.contains("too old") || l.contains("Expired"))
        .collect();
    println!(
        "compacted at revision {compacted}; the added Service answered {} ms after the agent \
         resumed, both changes applied in {} ms; {relists} relists; stable {stable_vip}: {ok} \
         connections ok, {} failed",
        up.as_millis(),
        caught_up.as_millis(),
        failures.len()
    );
    assert!(
        !expired.is_empty(),
        "the resumed watch was told its resourceVersion expired:\n{}",
        log_after.join("\n")
    );
    assert!(relists > 0, "the agent relisted:\n{}", log_after.join("\n"));
    assert!(
        failures.is_empty(),
        "connections to the unchanged service failed: {failures:?}"
    );
}

/// deploy/'s ClusterRole without the EndpointSlice rule: the agent says
/// which permission its ServiceAccount lacks and stays unready; with the
/// rule back it syncs and serves, without a restart.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn rbac_denial_names_the_missing_permission_and_recovers_when_granted() {
    let (mut d, _) = kube_lab(&[], &[]);
    d.lab.stop_agent().expect("stop the agent");
    let syncs = d.lab.sync_count();
    let role = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/clusterrole.yaml"
    ))
    .expect("deploy/clusterrole.yaml");
    let mut cr: Value = yaml_serde::from_str(&role).expect("a ClusterRole");
    let rules = cr["rules"].as_array_mut().expect("rules");
    let before = rules.len();
    rules.retain(|r| !r["resources"].to_string().contains("endpointslices"));
    assert_eq!(rules.len(), before - 1, "deploy/'s EndpointSlice rule");
    d.lab
        .kubectl(&["apply", "-f", "-"], Some(&cr.to_string()))
        .expect("the ClusterRole without EndpointSlices");
    d.lab.start_agent().expect("agent");
    let log_path = d.lab.agent_log_path();
    let took = wait_for("the permission error", Duration::from_secs(30), || {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        log.lines().any(|l| {
            l.contains("ERROR")
                && l.contains("endpointslices")
                && l.contains("list")
                && l.contains("system:serviceaccount:kube-system:proxy-agent")
                && l.contains("deploy/clusterrole.yaml")
        })
    });
    println!("the permission error came after {took:?}");
    assert_eq!(
        d.lab.sync_count(),
        syncs,
        "nothing programmed without EndpointSlices"
    );
    d.lab
        .kubectl(&["apply", "-f", "-"], Some(&role))
        .expect("deploy/'s ClusterRole again");
    d.lab
        .wait_ready(CATCH_UP)
        .expect("ready once the permission is granted");
    let vip = d.put(&Svc::new("late", "ClusterIP", "late")).vip.unwrap();
    d.lab.apply(&pods_yaml(&[("late", 1)])).expect("pod");
    d.lab.wait_synced(CHANGE).expect("synced");
    wait_up(&d.lab, vip, "late", "after the permission is granted");
}

/// A host client on a node (the node's own namespace and cgroup, as a
/// hostNetwork pod) reaches `https://kubernetes.default` at the
/// `kubernetes` Service's ClusterIP and gets the real API server: its
/// certificate verifies for that name, and deploy/'s ServiceAccount may read
/// the Service through it.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn a_host_client_reaches_the_real_api_server_through_kubernetes_default() {
    let (d, _) = kube_lab(&[], &[]);
    let cp = d.lab.control_plane().expect("control plane");
    let token = std::fs::read_to_string(cp.agent_token()).expect("token");
    let node = d.lab.node().name.clone();
    let mut cmd = d.lab.node_command(&node, "curl").expect("curl on the node");
    let out = cmd
        .args(["-sS", "-m", "5", "-w", "\n%{http_code}"])
        .arg("--cacert")
        .arg(cp.ca())
        .args([
            "--resolve",
            &format!("kubernetes.default:443:{KUBERNETES_VIP}"),
            "-H",
            &format!("Authorization: Bearer {}", token.trim()),
            "https://kubernetes.default/api/v1/namespaces/default/services/kubernetes",
        ])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{text}");
    assert!(
        text.ends_with("\n200"),
        "200 from the API server through the ClusterIP: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("\"clusterIP\": \"198.19.0.1\""),
        "the kubernetes Service itself: {text}"
    );
}

//! The image (`cargo xtask image`) as an operator gets it: read by skopeo
//! and umoci, rebuilt with the same digest, started under runc exactly as
//! `deploy/` runs it (lab runc mode), each capability of the DaemonSet
//! removed in turn, the DaemonSet's probes, ports and args served, and a
//! rolling update to a newer image that loses no established connection.
//!
//! The image is built once per run of this binary (or taken from
//! `KPR_LAB_IMAGE`, which `cargo xtask test` sets) and shared by the tests.
//! Run as root: `cargo xtask test`, or
//! `cargo test -p xtask --test image -- --include-ignored --test-threads=2`.

use std::net::SocketAddrV4;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use xtask::image::{self, ImageOptions};
use xtask::lab::AgentImage;
use xtask::netns::in_netns;
use xtask::{setup, Lab};

mod support;
use support::fixtures::{manifests, Pod, Port, Svc};
use support::{tcp_hostname, LabTest, Stream, T};

/// Image builds run one at a time (they share the build directory).
static BUILDS: Mutex<()> = Mutex::new(());

fn build(opts: &ImageOptions) -> image::Image {
    let _guard = BUILDS.lock().unwrap_or_else(|e| e.into_inner());
    image::build(opts).unwrap_or_else(|e| panic!("cargo xtask image: {e:#}"))
}

/// The image the tests share: `KPR_LAB_IMAGE` (a layout), else built here.
fn shared() -> &'static AgentImage {
    static IMAGE: OnceLock<AgentImage> = OnceLock::new();
    IMAGE.get_or_init(|| match std::env::var_os("KPR_LAB_IMAGE") {
        Some(p) => AgentImage {
            layout: PathBuf::from(p),
            tag: "latest".into(),
        },
        None => {
            let img = build(&ImageOptions::default());
            AgentImage {
                layout: img.layout,
                tag: img.tag,
            }
        }
    })
}

/// The manifest digest the layout's index names for `tag`.
fn layout_digest(img: &AgentImage) -> String {
    let index: Value =
        serde_json::from_slice(&std::fs::read(img.layout.join("index.json")).unwrap()).unwrap();
    index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == img.tag.as_str())
        .and_then(|m| m["digest"].as_str())
        .expect("the index names the tag")
        .to_string()
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn web() -> String {
    manifests(&[
        &Svc::new("web").selector("web").port(Port::tcp("http", 80)),
        &Pod::new("web-1", "web").port(80, "TCP"),
        &Pod::new("web-2", "web").port(80, "TCP"),
    ])
}

/// A one-node lab with [`web`] whose agent runs from `image` under runc.
fn image_lab(name: &str, image: AgentImage) -> LabTest {
    LabTest::new(name)
        .yaml(&web())
        .with(|b| b.agent_image(image))
        .sync_timeout(Duration::from_secs(20))
        .banner(" (runc)")
}

/// `kubectl kustomize deploy/`, as JSON documents.
fn rendered() -> Vec<Value> {
    let text = run(Command::new("kubectl")
        .arg("kustomize")
        .arg(setup::workspace_root().join("deploy")));
    text.split("\n---\n")
        .filter(|d| !d.trim().is_empty())
        .map(|d| yaml_serde::from_str(d).expect("rendered YAML"))
        .collect()
}

fn kind<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind}/{name} not rendered"))
}

/// `GET <path>` on `addr` from namespace `ns`: (status line, body).
fn http_get(ns: &str, addr: SocketAddrV4, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let p = path.to_string();
    let text = in_netns(ns, move || -> std::io::Result<String> {
        let mut s = std::net::TcpStream::connect_timeout(&addr.into(), T)?;
        s.set_read_timeout(Some(T))?;
        write!(s, "GET {p} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    })
    .and_then(|r| r)
    .unwrap_or_else(|e| panic!("GET {path} from {addr} in {ns}: {e}"));
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (
        head.lines().next().unwrap_or_default().to_string(),
        body.to_string(),
    )
}

/// The bundle config.json of the container node-1's agent runs in.
fn container_config(lab: &Lab) -> Value {
    let id = lab
        .info()
        .agent
        .as_ref()
        .and_then(|a| a.container.clone())
        .expect("the agent runs in a container");
    let state: Value =
        serde_json::from_str(&run(Command::new("runc").args(["state", &id]))).unwrap();
    let bundle = PathBuf::from(state["bundle"].as_str().unwrap());
    serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap()
}

/// Bytes charged to the memory cgroup of process `pid`, and its limit:
/// cgroup v2 (`memory.current`) or a v1 memory controller
/// (`memory.usage_in_bytes`).
fn memory_of(pid: u32) -> (u64, u64) {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let read = |p: PathBuf| -> u64 {
        let t = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        t.trim().parse().unwrap_or(u64::MAX)
    };
    for l in cgroups.lines() {
        let mut f = l.splitn(3, ':');
        let (_, ctrl, path) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
        if ctrl.split(',').any(|c| c == "memory") {
            let dir = PathBuf::from("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
            return (
                read(dir.join("memory.usage_in_bytes")),
                read(dir.join("memory.limit_in_bytes")),
            );
        }
    }
    let mount = xtask::lab::cgroup2_mount().expect("a cgroup2 mount");
    let path = cgroups.lines().find_map(|l| l.strip_prefix("0::")).unwrap();
    let dir = mount.join(path.trim_start_matches('/'));
    (
        read(dir.join("memory.current")),
        read(dir.join("memory.max")),
    )
}

// ================================================================ tests

/// The image is an OCI layout skopeo and umoci read, a tarball skopeo reads
/// both as an OCI archive and as a Docker archive (what `ctr images import`
/// and `docker load` take), and a rebuild of the same commit has the same
/// digest.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn image_is_read_by_skopeo_and_umoci_and_rebuilds_identically() {
    let img = shared();
    let digest = layout_digest(img);
    let builds: Vec<image::Image> = ["a", "b"]
        .iter()
        .map(|n| {
            build(&ImageOptions {
                out_dir: setup::target_dir().join(format!("image-rebuild-{n}")),
                ..Default::default()
            })
        })
        .collect();
    let again = &builds[1];
    println!(
        "image of {}: {} and {} (layer {} bytes gzipped, {} bytes uncompressed)",
        again.commit,
        builds[0].digest,
        again.digest,
        again.compressed_size,
        again.uncompressed_size
    );
    assert_eq!(builds[0].digest, again.digest, "same commit, same digest");
    let shared_commit = run(Command::new("skopeo").args([
        "inspect",
        "--format",
        "{{index .Labels \"org.opencontainers.image.revision\"}}",
        &format!("oci:{}:{}", img.layout.display(), img.tag),
    ]));
    if shared_commit.trim() == again.commit {
        assert_eq!(digest, again.digest, "the shared image is this commit's");
    }
    let oci = format!("oci:{}:{}", img.layout.display(), img.tag);
    let inspect: Value =
        serde_json::from_str(&run(Command::new("skopeo").args(["inspect", &oci]))).unwrap();
    assert_eq!(inspect["Digest"], digest.as_str(), "{inspect}");
    assert_eq!(inspect["Architecture"], "amd64");
    let config: Value = serde_json::from_str(&run(
        Command::new("skopeo").args(["inspect", "--config", &oci])
    ))
    .unwrap();
    assert_eq!(
        config["config"]["Entrypoint"][0],
        "/usr/local/bin/proxy-agent"
    );
    for archive in ["oci-archive", "docker-archive"] {
        let r = format!("{archive}:{}", again.tarball.display());
        let v: Value =
            serde_json::from_str(&run(Command::new("skopeo").args(["inspect", &r]))).unwrap();
        assert_eq!(v["Architecture"], "amd64", "{archive}: {v}");
    }
    let tags = run(Command::new("umoci")
        .args(["ls", "--layout"])
        .arg(&img.layout));
    assert!(
        tags.lines().any(|t| t.trim() == img.tag),
        "umoci ls: {tags}"
    );
    let stat = run(Command::new("umoci").args(["stat", "--image"]).arg(format!(
        "{}:{}",
        img.layout.display(),
        img.tag
    )));
    assert!(stat.contains("cargo xtask image"), "umoci stat: {stat}");
}

/// The DaemonSet's probes, ports and args (read from the rendered
/// manifests) are what the image's agent serves under runc: liveness and
/// readiness on the probes' host and port (the agent's own port, not the
/// healthz port kube-proxy holds during a migration), the health check on
/// the container port, metrics on the ConfigMap's metricsBindAddress; the container runs the DaemonSet's args
/// with RLIMIT_MEMLOCK at 64 KiB (left alone: BPF memory goes to the
/// memory cgroup), its maps within the DaemonSet's memory limit.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn daemonset_probes_ports_and_args_are_served_by_the_image() {
    let docs = rendered();
    let ds = kind(&docs, "DaemonSet", "proxy-agent");
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    let port = c["ports"][0]["containerPort"].as_u64().unwrap() as u16;
    let mut probes = Vec::new();
    for p in ["livenessProbe", "readinessProbe"] {
        let get = &c[p]["httpGet"];
        let host: std::net::Ipv4Addr = get["host"]
            .as_str()
            .expect("the probe's host (the probe server's address)")
            .parse()
            .unwrap();
        probes.push((
            p,
            get["path"].as_str().unwrap().to_string(),
            SocketAddrV4::new(host, get["port"].as_u64().unwrap() as u16),
        ));
    }
    let cm = kind(&docs, "ConfigMap", "proxy-agent");
    let config = cm["data"]["config.yaml"].as_str().unwrap();
    let metrics: SocketAddrV4 = config
        .lines()
        .find_map(|l| l.trim().strip_prefix("metricsBindAddress:"))
        .expect("metricsBindAddress")
        .trim()
        .parse()
        .unwrap();
    let args: Vec<String> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();

    image_lab("probes", shared().clone())
        .inspect_lines(20)
        .run(|lab| {
            let node = lab.node().clone();
            for (what, path, at) in &probes {
                assert_ne!(
                    at.port(),
                    port,
                    "{what} asks a port kube-proxy does not hold"
                );
                let (status, body) = http_get(&node.netns, *at, path);
                println!("{what} GET {path} on {at}: {status} {body}");
                assert!(status.contains(" 200"), "{what} {path}: {status} {body}");
            }
            let (status, body) =
                http_get(&node.netns, SocketAddrV4::new(node.ip, port), "/healthz");
            assert!(
                status.contains(" 200") && body.contains("lastUpdated"),
                "{status} {body}"
            );
            let (status, body) = http_get(&node.netns, metrics, "/metrics");
            assert!(status.contains(" 200"), "{status}");
            assert!(body.contains("proxy_agent_"), "metrics: {body}");

            let cfg = container_config(lab);
            let argv: Vec<String> = cfg["process"]["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap().to_string())
                .collect();
            let pid = lab.info().agent.as_ref().unwrap().pid;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
            let running: Vec<String> = cmdline
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            assert_eq!(running, argv, "the container runs its config's args");
            // The DaemonSet's args, in order, except the source the lab replaces.
            let mut ds_args = args.iter().peekable();
            let mut kept = Vec::new();
            while let Some(a) = ds_args.next() {
                if a == "--source" {
                    ds_args.next();
                } else {
                    kept.push(a.clone());
                }
            }
            assert_eq!(&running[1..=kept.len()], &kept[..], "{running:?}");
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
            assert!(status.contains("NoNewPrivs:\t1"), "no_new_privs");
            // seccompProfile: RuntimeDefault: the runtime's default profile
            // filters the agent (mode 2), which serves everything above.
            assert_eq!(
                c["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
                "the DaemonSet asks for the runtime's default profile"
            );
            assert!(
                status.contains("Seccomp:\t2"),
                "seccomp filter mode: {status}"
            );
            let seccomp = &cfg["linux"]["seccomp"];
            assert!(
                xtask::lab::seccomp::allows(seccomp, "bpf")
                    && !xtask::lab::seccomp::allows(seccomp, "mount"),
                "{seccomp}"
            );
            let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
            let memlock = limits
                .lines()
                .find(|l| l.starts_with("Max locked memory"))
                .unwrap()
                .to_string();
            assert!(memlock.contains("65536"), "{memlock}");
            let log = lab.agent_log();
            assert!(
                log.contains("RLIMIT_MEMLOCK left alone"),
                "the agent did not raise RLIMIT_MEMLOCK"
            );
            // What the pod's memory cgroup holds: the agent and its maps.
            let (current, max) = memory_of(pid);
            println!(
                "container memory: {} MiB (limit {} MiB)",
                current >> 20,
                max >> 20
            );
            let limit = c["resources"]["limits"]["memory"].as_str().unwrap();
            let request = c["resources"]["requests"]["memory"].as_str().unwrap();
            println!("DaemonSet: request {request}, limit {limit}");
            assert!(current > 0);
            assert!(current < max, "the agent fits its limit");
            assert!(current > 0);
        });
}

/// Each capability of the DaemonSet removed in turn: the agent says what
/// fails, with the capability named, and never panics. Prints the table.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn each_capability_removed_shows_what_fails() {
    let dep = xtask::lab::container::Deployment::from_repo().unwrap();
    let caps: Vec<String> = dep
        .container()
        .unwrap()
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.as_ref())
        .and_then(|c| c.add.clone())
        .unwrap();
    let mut table = Vec::new();
    for cap in &caps {
        let mut row = String::new();
        image_lab(&format!("without {cap}"), shared().clone())
            .with(|b| b.without_caps(&[cap.as_str()]))
            .ready(|_| {})
            .inspect_lines(10)
            .run(|lab| {
                // Up to 5 s for it to fail or to come up.
                let deadline = Instant::now() + Duration::from_secs(5);
                let mut ready = false;
                while Instant::now() < deadline && lab.agent_running() {
                    if lab.wait_ready(Duration::from_millis(200)).is_ok() {
                        ready = true;
                        std::thread::sleep(Duration::from_millis(500));
                        break;
                    }
                }
                let running = lab.agent_running();
                let mut log = lab.agent_log();
                if !running {
                    // An agent that exited has said why by now; one seen as
                    // gone while it is still being torn down may not have
                    // (a CI run read only its first two lines): up to 3 s
                    // for its error line.
                    let settle = Instant::now() + Duration::from_secs(3);
                    while !log.lines().any(|l| l.starts_with("Error:")) && Instant::now() < settle {
                        std::thread::sleep(Duration::from_millis(100));
                        log = lab.agent_log();
                    }
                }
                assert!(!log.contains("panicked"), "without {cap}: a panic:\n{log}");
                let problems: Vec<&str> = log
                    .lines()
                    .filter(|l| l.contains("ERROR") || l.contains("WARN") || l.starts_with("Error"))
                    .collect();
                let vip = lab.cluster_frontend("web", 80, "TCP").unwrap();
                let served = tcp_hostname(&lab.client().netns.clone(), vip).is_ok();
                let named = log.contains(&format!("CAP_{cap}"));
                // The agent's own words: its error (the hint and the failed
                // step), else its first complaint.
                let error: Vec<&str> = log
                    .lines()
                    .skip_while(|l| !l.starts_with("Error:"))
                    .filter(|l| !l.trim().is_empty() && !l.starts_with("Caused by"))
                    .take(3)
                    .collect();
                println!(
                    "without {cap}:\n{}",
                    log.lines()
                        .filter(|l| !l.contains(" INFO "))
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                let first = if error.is_empty() {
                    problems.first().copied().unwrap_or("").to_string()
                } else {
                    error
                        .iter()
                        .map(|l| l.trim())
                        .collect::<Vec<_>>()
                        .join(" ← ")
                };
                row = format!(
                    "| {cap} | {} | {} | {} |",
                    if running { "keeps running" } else { "exits" },
                    if served { "served" } else { "not served" },
                    first.replace('|', "/")
                );
                assert!(
                    !ready || !problems.is_empty(),
                    "without {cap} the agent came up without a complaint: is {cap} needed?\n{log}"
                );
                assert!(
                    running || named,
                    "without {cap} the agent exited without naming CAP_{cap}:\n{log}"
                );
            });
        table.push(row);
    }
    println!("| capability removed | agent | ClusterIP | what it says |");
    println!("|---|---|---|---|");
    for r in &table {
        println!("{r}");
    }
}

/// S8 under runc, as a rolling update does it: the agent (with `--on-exit
/// keep`) stopped, the image replaced by a newer build (another digest),
/// the new container started; established connections keep working the
/// whole time and new ones work after.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn s8_rolling_update_to_a_newer_image_keeps_connections() {
    let first = shared().clone();
    let first_digest = layout_digest(&first);
    // A newer build: a later date, so another config and digest. Built
    // before the connections open (the pods' servers close idle streams).
    let epoch = Command::new("git")
        .args(["log", "-1", "--format=%ct"])
        .current_dir(setup::workspace_root())
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse::<u64>()
                .unwrap()
        })
        .unwrap();
    let newer = build(&ImageOptions {
        out_dir: setup::target_dir().join("image-newer"),
        source_date_epoch: Some(epoch + 3600),
        ..Default::default()
    });
    assert_ne!(
        newer.digest, first_digest,
        "the newer build has its own digest"
    );
    image_lab("s8_image", first.clone())
        .args(&["--on-exit", "keep"])
        .inspect_lines(20)
        .run(|lab| {
            let ns = lab.client().netns.clone();
            let vip = lab.cluster_frontend("web", 80, "TCP").unwrap();
            let mut streams: Vec<Stream> = (0..6).map(|_| Stream::open(&ns, vip)).collect();
            for s in &mut streams {
                s.pings(3, "before");
            }
            lab.set_agent_image(AgentImage {
                layout: newer.layout.clone(),
                tag: newer.tag.clone(),
            });
            let old_root = container_config(lab)["root"]["path"].clone();
            lab.stop_agent().expect("stop the agent");
            std::thread::sleep(Duration::from_millis(500));
            for s in &mut streams {
                s.pings(3, "no-agent");
            }
            let t = Instant::now();
            lab.start_agent().expect("start the newer image");
            lab.wait_ready(lab.sync_timeout())
                .expect("newer agent ready");
            println!(
                "S8 image {first_digest} -> {}: agent back in {} ms",
                newer.digest,
                t.elapsed().as_millis()
            );
            let new_root = container_config(lab)["root"]["path"].clone();
            assert_ne!(old_root, new_root, "the new container runs the newer image");
            for s in &mut streams {
                s.pings(3, "after");
            }
            for i in 0..20 {
                tcp_hostname(&ns, vip).unwrap_or_else(|e| panic!("new connection {i}: {e}"));
            }
        });
}

/// Issue 38: the DaemonSet as a kubelet would run it against a real
/// control plane: the image under runc with deploy/'s args, env and mounts,
/// `--source kubernetes` in-cluster from the ServiceAccount's files (token,
/// ca.crt, namespace where a kubelet mounts them) and deploy/api-server.yaml's
/// KUBERNETES_SERVICE_HOST/PORT, which name the lab's API server. It syncs
/// as deploy/'s ServiceAccount (the API server's audit log says so) and
/// serves a Service whose ClusterIP and EndpointSlices the real allocator
/// and controller made.
#[test]
#[ignore = "needs root: run with cargo xtask test"]
fn daemonset_under_runc_syncs_in_cluster_from_the_real_api_server() {
    image_lab("in-cluster", shared().clone())
        .with(|b| b.control_plane(true))
        .banner(" (runc, real control plane)")
        .inspect_lines(20)
        .run(|lab| {
            let cfg = container_config(lab);
            let mounts = cfg["mounts"].as_array().unwrap();
            assert!(
                mounts
                    .iter()
                    .any(|m| m["destination"] == "/var/run/secrets/kubernetes.io/serviceaccount"),
                "the ServiceAccount's files are mounted: {mounts:?}"
            );
            let args = cfg["process"]["args"].to_string();
            assert!(
                args.contains("\"--source\",\"kubernetes\"")
                    && !args.contains("--kubeconfig")
                    && !args.contains("--manifests"),
                "in-cluster, no kubeconfig: {args}"
            );
            let vip = support::frontend(lab, "web", 80, "TCP");
            let (answers, errors) = support::tcp_hostnames(&lab.client().netns, vip, 20);
            println!("in-cluster: {vip}: {answers:?} {errors:?}");
            assert!(errors.is_empty(), "{errors:?}");
            assert_eq!(
                answers.keys().map(String::as_str).collect::<Vec<_>>(),
                ["web-1", "web-2"],
                "both pods answer through the real ClusterIP"
            );
            let audit = std::fs::read_to_string(lab.control_plane().unwrap().audit_log())
                .expect("the API server's audit log");
            assert!(
                audit.lines().any(
                    |l| l.contains("system:serviceaccount:kube-system:proxy-agent")
                        && l.contains("endpointslices")
                        && l.contains("\"verb\":\"watch\"")
                ),
                "the agent watches EndpointSlices as deploy/'s ServiceAccount"
            );
        });
}

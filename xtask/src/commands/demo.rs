//! `cargo xtask demo`: a lab from deploy/examples, how requests spread over
//! the pods of each Service, before and after a pod per Service is deleted.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use xtask::client::{self, Request};
use xtask::lab::{Frontend, Lab};
use xtask::manifests::Object;
use xtask::setup;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn catch_interrupts() -> Result<()> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { sigaction(sig, &action)? };
    }
    Ok(())
}

fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

fn ensure_examples() -> Result<PathBuf> {
    let dir = setup::workspace_root().join("deploy/examples");
    std::fs::create_dir_all(&dir)?;
    let files = [
        ("my-service.yaml", EXAMPLE_MY_SERVICE),
        ("my-service-3.yaml", EXAMPLE_WEB),
    ];
    for (name, text) in files {
        let p = dir.join(name);
        if !p.exists() {
            println!("writing {}", p.display());
            std::fs::write(&p, text)?;
        }
    }
    Ok(dir)
}

const EXAMPLE_MY_SERVICE: &str = r#"apiVersion: v1
kind: Pod
metadata:
  name: pod-1
  labels:
    app: my-app
spec:
  containers:
    - name: my-container
      image: nginx
      ports:
        - containerPort: 80
---
apiVersion: v1
kind: Pod
metadata:
  name: pod-2
  labels:
    app: my-app
spec:
  containers:
    - name: my-container
      image: nginx
      ports:
        - containerPort: 80
---
apiVersion: v1
kind: Service
metadata:
  name: my-service
spec:
  ipFamilyPolicy: PreferDualStack
  selector:
    app: my-app
  ports:
    - protocol: TCP
      port: 80
      targetPort: 80
"#;

const EXAMPLE_WEB: &str = r#"apiVersion: v1
kind: Pod
metadata:
  name: web-1
  labels:
    app: web
spec:
  containers:
    - name: web
      image: nginx
      ports:
        - containerPort: 80
---
apiVersion: v1
kind: Pod
metadata:
  name: web-2
  labels:
    app: web
spec:
  containers:
    - name: web
      image: nginx
      ports:
        - containerPort: 80
---
apiVersion: v1
kind: Pod
metadata:
  name: web-3
  labels:
    app: web
spec:
  containers:
    - name: web
      image: nginx
      ports:
        - containerPort: 80
---
apiVersion: v1
kind: Service
metadata:
  name: web
spec:
  ipFamilyPolicy: PreferDualStack
  selector:
    app: web
  ports:
    - name: http
      protocol: TCP
      port: 80
      targetPort: 80
    - name: udp
      protocol: UDP
      port: 80
      targetPort: 80
"#;

/// How requests to one frontend spread over pods.
struct Spread {
    counts: BTreeMap<String, usize>,
    failed: usize,
    first_error: Option<String>,
}

fn spread(ns: &str, f: &Frontend, n: usize) -> Result<Spread> {
    let tcp = f.protocol.eq_ignore_ascii_case("TCP");
    let mut s = Spread {
        counts: BTreeMap::new(),
        failed: 0,
        first_error: None,
    };
    // Bounded even when nothing answers: 30 s per frontend, and the rest is
    // skipped (counted as failed) after 20 failures in a row.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut in_a_row = 0;
    let mut left = n;
    while left > 0 {
        check_interrupted()?;
        if in_a_row >= 20 {
            s.failed += left;
            break;
        }
        let chunk = left.min(20);
        left -= chunk;
        let reqs = (0..chunk)
            .map(|_| {
                if tcp {
                    Request::tcp(f.socket_addr(), b"hostname\n", Duration::from_secs(1))
                } else {
                    Request::udp(f.socket_addr(), b"hostname", Duration::from_secs(1))
                }
            })
            .collect();
        for r in client::batch(ns, reqs, Some(deadline))? {
            match r {
                Ok(reply) => {
                    in_a_row = 0;
                    *s.counts.entry(client::reply_text(&reply)).or_default() += 1
                }
                Err(e) => {
                    in_a_row += 1;
                    s.failed += 1;
                    s.first_error.get_or_insert_with(|| e.to_string());
                }
            }
        }
    }
    let what = if tcp { "connections" } else { "datagrams" };
    let mut line = format!(
        "{:<12} {:<20} {n} {what}:",
        f.service.trim_start_matches("default/"),
        format!("{}/{}", f.socket_addr(), f.protocol)
    );
    for (pod, c) in &s.counts {
        line.push_str(&format!(
            "  {pod} {c} ({:.1}%)",
            *c as f64 * 100.0 / n as f64
        ));
    }
    line.push_str(&format!("  failed {}", s.failed));
    if let Some(e) = &s.first_error {
        line.push_str(&format!(" (first error: {e})"));
    }
    println!("{line}");
    Ok(s)
}

/// Pods a Service selects, in name order.
fn selected_pods(objects: &[Object], service: &str) -> Vec<String> {
    let (ns, name) = service.split_once('/').unwrap_or(("default", service));
    let Some(selector) = objects.iter().find_map(|o| match o {
        Object::Service(s)
            if s.metadata.name.as_deref() == Some(name)
                && s.metadata.namespace.as_deref() == Some(ns) =>
        {
            s.spec.as_ref().and_then(|sp| sp.selector.clone())
        }
        _ => None,
    }) else {
        return Vec::new();
    };
    let mut pods: Vec<String> = objects
        .iter()
        .filter_map(|o| match o {
            Object::Pod(p) if p.metadata.namespace.as_deref() == Some(ns) => {
                let labels = p.metadata.labels.clone().unwrap_or_default();
                selector
                    .iter()
                    .all(|(k, v)| labels.get(k) == Some(v))
                    .then(|| p.metadata.name.clone().unwrap_or_default())
            }
            _ => None,
        })
        .collect();
    pods.sort();
    pods
}

pub fn demo(requests: usize) -> Result<()> {
    if !setup::is_root() {
        bail!("the demo needs root: it creates network namespaces and loads eBPF programs");
    }
    // KPR_AGENT_BIN names a prebuilt (or stand-in) agent; else build it.
    let agent = match std::env::var_os("KPR_AGENT_BIN") {
        Some(p) => PathBuf::from(p),
        None => setup::build_agent()?,
    };
    let server = setup::build_lab_server()?;
    let examples = ensure_examples()?;
    catch_interrupts()?;
    // Dual-stack: the examples' Services get a ClusterIP of each family,
    // and the spread is shown over both.
    let mut lab = Lab::builder()
        .dual_stack()
        .manifests_path(&examples)
        .agent_bin(agent)
        .server_bin(server)
        .start()?;
    println!("lab {} up: {}", lab.id(), lab.json_path().display());
    lab.wait_ready(Duration::from_secs(30))?;
    let ns = lab.client().netns.clone();
    let frontends: Vec<Frontend> = lab
        .frontends()
        .iter()
        .filter(|f| f.kind == "ClusterIP")
        .cloned()
        .collect();
    let mut failed = 0;

    println!("\n== all pods ==");
    for f in &frontends {
        failed += spread(&ns, f, requests)?.failed;
    }

    let mut services: Vec<String> = frontends.iter().map(|f| f.service.clone()).collect();
    services.dedup();
    let mut deleted = Vec::new();
    for svc in &services {
        if let Some(pod) = selected_pods(lab.objects(), svc).pop() {
            println!("\ndeleting pod {pod} (of {svc}) from the manifests");
            lab.delete_pod(&pod)?;
            deleted.push(pod);
        }
    }
    check_interrupted()?;

    println!("\n== after deleting {} ==", deleted.join(", "));
    let mut leaked = Vec::new();
    for f in &frontends {
        let s = spread(&ns, f, requests)?;
        failed += s.failed;
        leaked.extend(
            deleted
                .iter()
                .filter(|p| s.counts.contains_key(*p))
                .cloned(),
        );
    }
    lab.down()?;
    println!("\nlab torn down");
    if failed > 0 || !leaked.is_empty() {
        bail!("{failed} requests failed; deleted pods still answering: {leaked:?}");
    }
    Ok(())
}

//! Attach modes (root), in a network namespace of the test's own: legacy tc
//! filters (clsact + direct-action `cls_bpf` at a fixed priority and
//! handle) found and replaced in place by a restarted agent, and a move
//! between legacy tc and tcx leaving exactly one attachment. Run with
//! `cargo xtask test` (they are `#[ignore]`d under a plain `cargo test`)
//! or inside the kernel matrix's VMs (`cargo xtask test --kernel 5.10`).

use std::process::Command;

use aya::programs::{SchedClassifier, TcAttachType};
use proxy_agent::bpf::{self, Attacher, IfaceKind, MapSizes, TcMode};
use proxy_testkit::kit::harness::{NetNs, PinDir};

/// `tc -n <ns> filter show dev <dev> <side>`, the lines naming a program.
fn filters(ns: &NetNs, dev: &str, side: &str) -> Vec<String> {
    let out = Command::new("tc")
        .args(["-n", ns.name(), "filter", "show", "dev", dev, side])
        .output()
        .expect("run tc");
    assert!(out.status.success(), "tc filter show failed: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        // One header line per priority, then one line per filter.
        .filter(|l| l.contains(" bpf ") && l.contains(" handle "))
        .map(str::to_owned)
        .collect()
}

/// The program id in a `tc filter show` line (`... id 42 tag ...`).
fn prog_id(line: &str) -> String {
    let mut words = line.split_whitespace();
    while let Some(w) = words.next() {
        if w == "id" {
            return words.next().unwrap_or_default().to_owned();
        }
    }
    panic!("no program id in {line:?}");
}

fn setup(prefix: &str) -> (NetNs, PinDir, u32) {
    let ns = NetNs::new(prefix).expect("netns");
    ns.ip(&[
        "link", "add", "kprv0", "type", "veth", "peer", "name", "kprv1",
    ])
    .expect("veth");
    ns.ip(&["link", "set", "kprv0", "up"]).expect("up");
    let pins = PinDir::new(&format!("{}-pins", ns.name()));
    let idx = ns.enter(|| nix::net::if_::if_nametoindex("kprv0").expect("ifindex"));
    (ns, pins, idx)
}

/// One agent's run: loads the object (maps adopted from `pins`), attaches
/// the pod programs in `mode`, then exits as with `--on-exit keep`.
fn agent_keep(ns: &NetNs, pins: &PinDir, idx: u32, mode: TcMode) {
    ns.enter(|| {
        let loaded = bpf::load(pins.path(), MapSizes::default()).expect("load");
        let mut a =
            Attacher::new(loaded.ebpf, pins.path(), mode, loaded.port_search).expect("attacher");
        a.attach(idx, "kprv0", IfaceKind::Pod)
            .expect("attach pod_ingress");
        a.attach(idx, "kprv0", IfaceKind::PodEgress)
            .expect("attach pod_egress");
        a.prune_pins();
        a.release_all();
    });
}

fn tcx_count(ns: &NetNs, side: TcAttachType) -> usize {
    ns.enter(|| {
        SchedClassifier::query_tcx("kprv0", side)
            .map(|(_, p)| p.len())
            .unwrap_or(0)
    })
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn legacy_filters_are_found_and_replaced_in_place_on_restart() {
    let (ns, pins, idx) = setup("kpr-attach-legacy");
    agent_keep(&ns, &pins, idx, TcMode::Legacy);
    let first = filters(&ns, "kprv0", "ingress");
    assert_eq!(first.len(), 1, "{first:?}");
    for want in ["pref 1 ", "handle 0x4b50", "pod_ingress", "direct-action"] {
        assert!(first[0].contains(want), "{want} missing: {first:?}");
    }
    let egress = filters(&ns, "kprv0", "egress");
    assert_eq!(egress.len(), 1, "{egress:?}");
    assert!(egress[0].contains("handle 0x4b51") && egress[0].contains("pod_egress"));

    // A restarted agent: the same filter, with the new agent's program.
    agent_keep(&ns, &pins, idx, TcMode::Legacy);
    let second = filters(&ns, "kprv0", "ingress");
    assert_eq!(second.len(), 1, "a duplicate filter: {second:?}");
    assert!(second[0].contains("handle 0x4b50"), "{second:?}");
    assert_ne!(
        prog_id(&first[0]),
        prog_id(&second[0]),
        "program not replaced"
    );
    assert_eq!(filters(&ns, "kprv0", "egress").len(), 1);

    // `--on-exit detach`: the filters go.
    ns.enter(|| {
        let loaded = bpf::load(pins.path(), MapSizes::default()).expect("load");
        let mut a = Attacher::new(loaded.ebpf, pins.path(), TcMode::Legacy, loaded.port_search)
            .expect("attacher");
        a.attach(idx, "kprv0", IfaceKind::Pod).expect("attach");
        a.detach_all();
    });
    assert!(filters(&ns, "kprv0", "ingress").is_empty());
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn moving_between_legacy_tc_and_tcx_leaves_one_attachment() {
    if !bpf::kernel_has_tcx() {
        eprintln!("no tcx on this kernel: only the legacy mode applies");
        return;
    }
    let (ns, pins, idx) = setup("kpr-attach-move");
    agent_keep(&ns, &pins, idx, TcMode::Legacy);
    assert_eq!(filters(&ns, "kprv0", "ingress").len(), 1);
    assert_eq!(tcx_count(&ns, TcAttachType::Ingress), 0);

    // Upgrade to a kernel with tcx: the tcx link goes in, the filter goes.
    agent_keep(&ns, &pins, idx, TcMode::Tcx);
    assert!(filters(&ns, "kprv0", "ingress").is_empty());
    assert!(filters(&ns, "kprv0", "egress").is_empty());
    assert_eq!(tcx_count(&ns, TcAttachType::Ingress), 1);
    assert_eq!(tcx_count(&ns, TcAttachType::Egress), 1);

    // And back (a forced `--tc-attach-mode legacy`): the pinned tcx link goes.
    // The kernel frees an unpinned link after an RCU grace period: wait a
    // little for it.
    agent_keep(&ns, &pins, idx, TcMode::Legacy);
    assert_eq!(filters(&ns, "kprv0", "ingress").len(), 1);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while tcx_count(&ns, TcAttachType::Ingress) + tcx_count(&ns, TcAttachType::Egress) > 0
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(tcx_count(&ns, TcAttachType::Ingress), 0);
    assert_eq!(tcx_count(&ns, TcAttachType::Egress), 0);
    // `proxy-agent cleanup` removes the unpinned filters too.
    assert_eq!(ns.enter(bpf::cleanup_legacy_filters), 1);
    assert!(filters(&ns, "kprv0", "ingress").is_empty());
    assert!(filters(&ns, "kprv0", "egress").is_empty());
}

//! Per-packet cost of the tc programs, measured with `BPF_PROG_TEST_RUN` (root).
//!
//! For each number of services N, the maps are filled by the agent's own
//! writer (N ClusterIP frontends with 2 backends each), then three packets are
//! run through `pod_ingress` many times: a new flow (a fresh source port each
//! run), a packet of an established flow, and a packet for no service. Each run
//! is a single execution (`repeat = 1`: with a repeat count the kernel would run
//! the already translated packet again); the kernel reports its duration in ns,
//! and the median over the runs is printed. Timing overhead of the test-run
//! command itself is included; the `baseline` column is an empty-verdict packet
//! (not IPv4), the floor of that overhead.
//!
//! Everything happens in a network namespace of its own; nothing is sent.
//! `cargo run --release -p proxy-agent --example prog_cost -- [N...] [--runs R] [--json]`
use std::{net::Ipv4Addr, os::fd::AsFd, path::PathBuf, process::Command};

use aya::programs::{SchedClassifier, TestRun, TestRunOptions};
use proxy_agent::{
    bpf::{self, BpfDataplane, MapSizes, POD_INGRESS_PROGRAM},
    dataplane::Writer,
    model::{BackendAddr, DesiredState, Frontend, FrontendKey},
};
use proxy_common::{capacity, Config, IPPROTO_TCP, SCOPE_INTERNAL};

fn sum16(d: &[u8]) -> u32 {
    d.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}
fn fold(mut s: u32) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

fn tcp_packet(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Vec<u8> {
    let mut seg = vec![0u8; 20];
    seg[0..2].copy_from_slice(&sport.to_be_bytes());
    seg[2..4].copy_from_slice(&dport.to_be_bytes());
    seg[12] = 5 << 4;
    seg[13] = flags;
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&[0, IPPROTO_TCP, 0, 20]);
    let c = fold(sum16(&pseudo) + sum16(&seg));
    seg[16..18].copy_from_slice(&c.to_be_bytes());
    let mut p = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 8, 0];
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&40u16.to_be_bytes());
    ip[8] = 64;
    ip[9] = IPPROTO_TCP;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let c = fold(sum16(&ip));
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    p.extend_from_slice(&ip);
    p.extend_from_slice(&seg);
    p
}

/// Service i: ClusterIP 198.19.x.y (i-th address), port 80, backends in 198.18.
fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 0)) + i)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let runs_at = args.iter().position(|a| a == "--runs");
    let runs: usize = runs_at
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let mut ns_list: Vec<u32> = args
        .iter()
        .enumerate()
        .filter(|(i, _)| runs_at.is_none_or(|r| *i != r + 1))
        .filter_map(|(_, a)| a.parse().ok())
        .collect();
    if ns_list.is_empty() {
        ns_list = vec![1, 100, 1_000, 10_000, 100_000];
    }
    let netns = format!("kpr-cost-{}", std::process::id());
    anyhow::ensure!(
        Command::new("ip")
            .args(["netns", "add", &netns])
            .status()?
            .success(),
        "ip netns add (root needed)"
    );
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/kpr-cost-{}", std::process::id()));
    let mut result = measure(&netns, &pin_dir, &ns_list, runs);
    if result.is_ok() && args.iter().any(|a| a == "--external") {
        let ext_pins = PathBuf::from(format!("{}-ext", pin_dir.display()));
        let ext = measure_external(&netns, &ext_pins, runs);
        let _ = std::fs::remove_dir_all(&ext_pins);
        result = ext.and_then(|e| {
            result.map(|mut r| {
                r.extend(e);
                r
            })
        });
    }
    let _ = Command::new("ip").args(["netns", "del", &netns]).status();
    let _ = std::fs::remove_dir_all(&pin_dir);
    let rows = result?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("| services | new flow ns | established ns | no service ns | baseline ns |");
        println!("|---:|---:|---:|---:|---:|");
        for r in rows.iter().filter(|r| r.get("program").is_none()) {
            println!(
                "| {} | {} | {} | {} | {} |",
                r["services"],
                r["new_flow_ns"],
                r["established_ns"],
                r["no_service_ns"],
                r["baseline_ns"]
            );
        }
        let ext: Vec<_> = rows.iter().filter(|r| r.get("program").is_some()).collect();
        if !ext.is_empty() {
            println!();
            println!(
                "| external device, NodePort to a remote backend | new flow ns | established ns |"
            );
            println!("|---|---:|---:|");
            for r in ext {
                println!(
                    "| {} | {} | {} |",
                    r["program"], r["new_flow_ns"], r["established_ns"]
                );
            }
        }
    }
    Ok(())
}

/// External traffic (a NodePort whose backend is on another node: DNAT, SNAT
/// to the node, FIB lookup, redirect) through `ext_ingress` (tc) and `ext_xdp`
/// (XDP), new flows and established ones. The netns gets a route and
/// neighbour entries so that the FIB answers, as on a node.
fn measure_external(
    netns: &str,
    pin_dir: &std::path::Path,
    runs: usize,
) -> anyhow::Result<Vec<serde_json::Value>> {
    use aya::programs::Xdp;
    use proxy_agent::bpf::{EXT_INGRESS_PROGRAM, EXT_XDP_PROGRAM};
    use proxy_common::SCOPE_EXTERNAL;
    let node = Ipv4Addr::new(198, 18, 0, 10);
    let remote = Ipv4Addr::new(198, 18, 2, 10);
    let mut loaded = bpf::load(pin_dir, MapSizes::default())?;
    let mut dp = BpfDataplane::new(&mut loaded.ebpf, MapSizes::default())?;
    dp.set_config(Config::default().with_node_addr(node))?;
    let mut writer = Writer::adopt(dp)?;
    let mut d = DesiredState::default();
    d.frontends.insert(
        FrontendKey {
            addr: node,
            port: 30080,
            proto: IPPROTO_TCP,
            scope: SCOPE_EXTERNAL,
        },
        Frontend {
            service: "default/np".into(),
            backends: vec![BackendAddr {
                addr: remote,
                port: 8080,
                proto: IPPROTO_TCP,
            }],
            ..Default::default()
        },
    );
    anyhow::ensure!(
        writer.sync(&d).errors.is_empty(),
        "programming the NodePort"
    );
    for args in [
        vec!["link", "set", "lo", "up"],
        vec![
            "link", "add", "kprv0", "type", "veth", "peer", "name", "kprv1",
        ],
        vec!["link", "set", "kprv0", "up"],
        vec!["link", "set", "kprv1", "up"],
        vec!["route", "add", "198.18.0.0/16", "dev", "kprv0"],
        vec![
            "neigh",
            "add",
            "198.18.2.10",
            "lladdr",
            "02:00:00:00:00:bb",
            "dev",
            "kprv0",
            "nud",
            "permanent",
        ],
    ] {
        anyhow::ensure!(
            Command::new("ip")
                .arg("-n")
                .arg(netns)
                .args(&args)
                .status()?
                .success(),
            "ip {args:?}"
        );
    }
    anyhow::ensure!(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                netns,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
                "net.ipv4.conf.lo.forwarding=1"
            ])
            .status()?
            .success(),
        "sysctl"
    );
    let tc: &SchedClassifier = loaded
        .ebpf
        .program(EXT_INGRESS_PROGRAM)
        .unwrap()
        .try_into()?;
    let xdp: &Xdp = loaded.ebpf.program(EXT_XDP_PROGRAM).unwrap().try_into()?;
    let ns_file = std::fs::File::open(format!("/run/netns/{netns}"))?;
    let median = |mut v: Vec<u64>| {
        v.sort_unstable();
        v[v.len() / 2]
    };
    let rows = std::thread::scope(|s| {
        s.spawn(|| -> anyhow::Result<Vec<serde_json::Value>> {
            nix::sched::setns(ns_file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)?;
            let mut rows = Vec::new();
            for (name, client_base) in [("tc (ext_ingress)", 0u32), ("xdp (ext_xdp)", 1u32)] {
                let run1 = |p: &[u8]| -> anyhow::Result<u64> {
                    let mut out = vec![0u8; p.len() + 128];
                    let opts = TestRunOptions { data_in: Some(p), data_out: Some(&mut out), ..Default::default() };
                    let r = if client_base == 0 { tc.test_run(opts)? } else { xdp.test_run(opts)? };
                    Ok(r.duration.as_nanos() as u64)
                };
                // Distinct clients per program, so that each creates its own flows.
                let client = Ipv4Addr::new(198, 18, 5 + client_base as u8, 1);
                let mut new_flow = Vec::with_capacity(runs);
                for k in 0..runs {
                    let sport = 1024 + (k as u32 % 60_000) as u16;
                    new_flow.push(run1(&tcp_packet(client, sport, node, 30080, 0x02))?);
                }
                let est = tcp_packet(client, 1024, node, 30080, 0x10);
                let established = (0..runs).map(|_| run1(&est)).collect::<anyhow::Result<Vec<_>>>()?;
                let (n, e) = (median(new_flow), median(established));
                eprintln!("external {name}: new {n} ns, established {e} ns");
                rows.push(serde_json::json!({"program": name, "new_flow_ns": n, "established_ns": e, "runs": runs}));
            }
            Ok(rows)
        })
        .join()
        .expect("measuring thread")
    })?;
    Ok(rows)
}

fn measure(
    netns: &str,
    pin_dir: &std::path::Path,
    ns_list: &[u32],
    runs: usize,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let max = *ns_list.iter().max().unwrap_or(&1);
    let sizes = MapSizes {
        services: (max * 3 + 16).max(capacity::SERVICES),
        backends: capacity::BACKENDS,
        ..MapSizes::default()
    };
    let mut loaded = bpf::load(pin_dir, sizes)?;
    let mut dp = BpfDataplane::new(&mut loaded.ebpf, sizes)?;
    dp.set_config(Config::default().with_hairpin_addr(Ipv4Addr::new(198, 18, 0, 254)))?;
    let mut writer = Writer::adopt(dp)?;
    let prog: &SchedClassifier = loaded
        .ebpf
        .program(POD_INGRESS_PROGRAM)
        .unwrap()
        .try_into()?;
    let ns_file = std::fs::File::open(format!("/run/netns/{netns}"))?;
    let client = Ipv4Addr::new(198, 18, 1, 2);
    let mut rows = Vec::new();
    for &n in ns_list {
        let mut d = DesiredState::default();
        for i in 0..n {
            let b = |k: u32| BackendAddr {
                addr: Ipv4Addr::from(
                    u32::from(Ipv4Addr::new(198, 18, 2, 0)) + (i * 2 + k) % 60_000,
                ),
                port: 8080,
                proto: IPPROTO_TCP,
            };
            d.frontends.insert(
                FrontendKey {
                    addr: vip(i),
                    port: 80,
                    proto: IPPROTO_TCP,
                    scope: SCOPE_INTERNAL,
                },
                Frontend {
                    service: format!("default/s{i}"),
                    backends: vec![b(0), b(1)],
                    ..Default::default()
                },
            );
        }
        let report = writer.sync(&d);
        anyhow::ensure!(
            report.errors.is_empty(),
            "programming {n} services: {:?}",
            report.errors.first()
        );
        let target = vip(n / 2);
        let median = |mut v: Vec<u64>| {
            v.sort_unstable();
            v[v.len() / 2]
        };
        let (new_flow, established, none, baseline) = std::thread::scope(|s| {
            s.spawn(|| -> anyhow::Result<(u64, u64, u64, u64)> {
                nix::sched::setns(ns_file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)?;
                let run1 = |p: &[u8]| -> anyhow::Result<u64> {
                    let mut out = vec![0u8; p.len() + 128];
                    let r = prog.test_run(TestRunOptions {
                        data_in: Some(p),
                        data_out: Some(&mut out),
                        ..Default::default()
                    })?;
                    Ok(r.duration.as_nanos() as u64)
                };
                let mut new_flow = Vec::with_capacity(runs);
                for k in 0..runs {
                    let sport = 1024 + (k as u32 % 60_000) as u16;
                    let src = Ipv4Addr::from(u32::from(client) + (k as u32 / 60_000));
                    new_flow.push(run1(&tcp_packet(src, sport, target, 80, 0x02))?);
                }
                let est = tcp_packet(client, 1024, target, 80, 0x10);
                let established = (0..runs)
                    .map(|_| run1(&est))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let other = tcp_packet(client, 1024, Ipv4Addr::new(198, 18, 3, 3), 80, 0x10);
                let none = (0..runs)
                    .map(|_| run1(&other))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let mut arp = other.clone();
                arp[12..14].copy_from_slice(&[0x08, 0x06]);
                let baseline = (0..runs)
                    .map(|_| run1(&arp))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                Ok((
                    median(new_flow),
                    median(established),
                    median(none),
                    median(baseline),
                ))
            })
            .join()
            .expect("measuring thread")
        })?;
        eprintln!("N={n}: new {new_flow} ns, established {established} ns, no service {none} ns, baseline {baseline} ns");
        rows.push(serde_json::json!({
            "services": n, "new_flow_ns": new_flow, "established_ns": established,
            "no_service_ns": none, "baseline_ns": baseline, "runs": runs,
        }));
    }
    Ok(rows)
}

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
//! Everything happens in network namespaces of its own (the packet-test kit's
//! harness, `proxy_testkit::kit`); nothing is sent.
//!
//! `--algorithms` measures instead each load-balancing algorithm (a ClusterIP
//! with 10 backends: new flow and established packet through `pod_ingress`),
//! and Maglev's programming: 1,000 Maglev Services × 10 backends from empty,
//! then a rebuild of every table (one backend replaced in each), and the
//! tables' memory.
//!
//! `--affinity` fills the session-affinity map to capacity (65,536 clients)
//! and times the writer's read of it when it prunes: in batches
//! (`BPF_MAP_LOOKUP_BATCH`) and with aya's iterator (two syscalls an entry).
//! `cargo run --release -p proxy-agent --example prog_cost -- [N...] [--runs R] [--json] [--external] [--algorithms] [--affinity]`
use std::net::Ipv4Addr;

use proxy_agent::{
    bpf::MapSizes,
    model::{BackendAddr, DesiredState, Frontend, FrontendKey, LbAlgorithm},
};
use proxy_common::{capacity, Config, RevNatId, IPPROTO_TCP, SCOPE_EXTERNAL, SCOPE_INTERNAL};

use proxy_testkit::kit::{
    frame::{tcp4, with_ethertype, ACK, ETH_P_ARP, SYN},
    harness::{Harness, Prog, HAIRPIN},
};

/// Service i: ClusterIP 198.19.x.y (i-th address), port 80, backends in 198.18.
fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 0)) + i % 65_536)
}

/// The port of frontend `i`: beyond 65,536 frontends the VIPs of
/// 198.19.0.0/16 are used again with another port.
fn port(i: u32) -> u16 {
    80 + (i / 65_536) as u16
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

/// The kernel's duration of one run of `frame` through `prog`, in ns (on a
/// thread inside the harness's namespace).
fn cost(h: &Harness, prog: Prog, frame: &[u8]) -> anyhow::Result<u64> {
    Ok(h.test_run(prog, frame)?.duration.as_nanos() as u64)
}

/// `runs` costs of the same frame.
fn costs(h: &Harness, prog: Prog, frame: &[u8], runs: usize) -> anyhow::Result<Vec<u64>> {
    (0..runs).map(|_| cost(h, prog, frame)).collect()
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
    if args.iter().any(|a| a == "--algorithms") {
        return measure_algorithms(runs);
    }
    if args.iter().any(|a| a == "--affinity") {
        return measure_affinity_read();
    }
    let mut rows = measure(&ns_list, runs)?;
    if args.iter().any(|a| a == "--external") {
        rows.extend(measure_external(runs)?);
    }
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
fn measure_external(runs: usize) -> anyhow::Result<Vec<serde_json::Value>> {
    let node = Ipv4Addr::new(198, 18, 0, 10);
    let remote = Ipv4Addr::new(198, 18, 2, 10);
    let mut h = Harness::try_new(
        "kpr-cost",
        MapSizes::default(),
        Config::default().with_node_addr(node),
    )?;
    let mut d = DesiredState::default();
    d.frontends.insert(
        FrontendKey {
            addr: node.into(),
            port: 30080,
            proto: IPPROTO_TCP,
            scope: SCOPE_EXTERNAL,
        },
        Frontend {
            service: "default/np".into(),
            backends: vec![BackendAddr {
                addr: remote.into(),
                port: 8080,
                proto: IPPROTO_TCP,
            }],
            ..Default::default()
        },
    );
    anyhow::ensure!(
        h.writer.sync(&d).errors.is_empty(),
        "programming the NodePort"
    );
    h.netns
        .wire("198.18.0.0/16", &[("198.18.2.10", "02:00:00:00:00:bb")])?;
    let h = &h;
    h.enter(|| -> anyhow::Result<Vec<serde_json::Value>> {
        let mut rows = Vec::new();
        for (name, prog, client_base) in [
            ("tc (ext_ingress)", Prog::ExtIngress, 0u8),
            ("xdp (ext_xdp)", Prog::ExtXdp, 1u8),
        ] {
            // Distinct clients per program, so that each creates its own flows.
            let client = Ipv4Addr::new(198, 18, 5 + client_base, 1);
            let mut new_flow = Vec::with_capacity(runs);
            for k in 0..runs {
                let sport = 1024 + (k as u32 % 60_000) as u16;
                new_flow.push(cost(h, prog, &tcp4(client, sport, node, 30080, SYN, b""))?);
            }
            let est = tcp4(client, 1024, node, 30080, ACK, b"");
            let established = costs(h, prog, &est, runs)?;
            let (n, e) = (median(new_flow), median(established));
            eprintln!("external {name}: new {n} ns, established {e} ns");
            rows.push(serde_json::json!({"program": name, "new_flow_ns": n, "established_ns": e, "runs": runs}));
        }
        Ok(rows)
    })
}

fn measure(ns_list: &[u32], runs: usize) -> anyhow::Result<Vec<serde_json::Value>> {
    let max = *ns_list.iter().max().unwrap_or(&1);
    let sizes = MapSizes {
        services: (max * 3 + 16).max(capacity::SERVICES),
        backends: capacity::BACKENDS,
        rev_nat: (max + 16).max(capacity::REV_NAT),
        ..MapSizes::default()
    };
    let mut h = Harness::try_new(
        "kpr-cost",
        sizes,
        Config::default().with_hairpin_addr(HAIRPIN),
    )?;
    // Reverse-NAT ids up to N: beyond what a pooled object's reset zeroes.
    h.unpooled();
    let client = Ipv4Addr::new(198, 18, 1, 2);
    let mut rows = Vec::new();
    for &n in ns_list {
        let mut d = DesiredState::default();
        for i in 0..n {
            let b = |k: u32| BackendAddr {
                addr: Ipv4Addr::from(
                    u32::from(Ipv4Addr::new(198, 18, 2, 0)) + (i * 2 + k) % 60_000,
                )
                .into(),
                port: 8080,
                proto: IPPROTO_TCP,
            };
            d.frontends.insert(
                FrontendKey {
                    addr: vip(i).into(),
                    port: port(i),
                    proto: IPPROTO_TCP,
                    scope: SCOPE_INTERNAL,
                },
                Frontend {
                    service: format!("default/s{i}").into(),
                    backends: vec![b(0), b(1)],
                    ..Default::default()
                },
            );
        }
        let t_sync = std::time::Instant::now();
        let report = h.writer.sync(&d);
        eprintln!(
            "N={n}: the writer programmed the maps in {:.1} ms ({} map writes)",
            t_sync.elapsed().as_secs_f64() * 1e3,
            report.writes
        );
        anyhow::ensure!(
            report.errors.is_empty(),
            "programming {n} services: {:?}",
            report.errors.first()
        );
        let (target, tport) = (vip(n / 2), port(n / 2));
        let hr = &h;
        let (new_flow, established, none, baseline) =
            hr.enter(|| -> anyhow::Result<(u64, u64, u64, u64)> {
                let prog = Prog::PodIngress;
                let mut new_flow = Vec::with_capacity(runs);
                for k in 0..runs {
                    let sport = 1024 + (k as u32 % 60_000) as u16;
                    let src = Ipv4Addr::from(u32::from(client) + (k as u32 / 60_000));
                    new_flow.push(cost(hr, prog, &tcp4(src, sport, target, tport, SYN, b""))?);
                }
                let est = tcp4(client, 1024, target, tport, ACK, b"");
                let established = costs(hr, prog, &est, runs)?;
                let other = tcp4(client, 1024, Ipv4Addr::new(198, 18, 3, 3), 80, ACK, b"");
                let none = costs(hr, prog, &other, runs)?;
                let baseline = costs(hr, prog, &with_ethertype(&other, ETH_P_ARP), runs)?;
                Ok((
                    median(new_flow),
                    median(established),
                    median(none),
                    median(baseline),
                ))
            })?;
        eprintln!("N={n}: new {new_flow} ns, established {established} ns, no service {none} ns, baseline {baseline} ns");
        rows.push(serde_json::json!({
            "services": n, "new_flow_ns": new_flow, "established_ns": established,
            "no_service_ns": none, "baseline_ns": baseline, "runs": runs,
        }));
    }
    // Every Service deleted at once (a namespace of them, or a stale
    // agent's leftovers): the prune phases' deletes.
    let t_remove = std::time::Instant::now();
    let report = h.writer.sync(&DesiredState::default());
    eprintln!(
        "N={max}: the writer removed them all in {:.1} ms ({} map deletes)",
        t_remove.elapsed().as_secs_f64() * 1e3,
        report.writes
    );
    anyhow::ensure!(
        report.errors.is_empty(),
        "removing {max} services: {:?}",
        report.errors.first()
    );
    Ok(rows)
}

/// A ClusterIP frontend `vip(i)`:80 with `n` backends and algorithm `alg`.
fn lb_frontend(d: &mut DesiredState, i: u32, n: u32, alg: LbAlgorithm, first_backend: u32) {
    let backends = (0..n)
        .map(|k| BackendAddr {
            addr: Ipv4Addr::from(
                u32::from(Ipv4Addr::new(198, 18, 2, 0)) + (first_backend + k) % 60_000,
            )
            .into(),
            port: 8080,
            proto: IPPROTO_TCP,
        })
        .collect();
    d.frontends.insert(
        FrontendKey {
            addr: vip(i).into(),
            port: 80,
            proto: IPPROTO_TCP,
            scope: SCOPE_INTERNAL,
        },
        Frontend {
            service: format!("default/s{i}").into(),
            backends,
            flags: alg.flags(),
            ..Default::default()
        },
    );
}

fn measure_algorithms(runs: usize) -> anyhow::Result<()> {
    println!("| algorithm | new flow ns | established ns |");
    println!("|---|---:|---:|");
    for alg in LbAlgorithm::ALL {
        let mut h = Harness::try_new("kpr-cost", MapSizes::default(), Config::default())?;
        let mut d = DesiredState::default();
        lb_frontend(&mut d, 0, 10, alg, 0);
        anyhow::ensure!(h.writer.sync(&d).errors.is_empty(), "programming {alg}");
        let hr = &h;
        let (new_flow, established) = hr.enter(|| -> anyhow::Result<(u64, u64)> {
            let client = Ipv4Addr::new(198, 18, 1, 2);
            let mut new_flow = Vec::with_capacity(runs);
            for k in 0..runs {
                let sport = 1024 + (k as u32 % 60_000) as u16;
                new_flow.push(cost(
                    hr,
                    Prog::PodIngress,
                    &tcp4(client, sport, vip(0), 80, SYN, b""),
                )?);
            }
            let est = tcp4(client, 1024, vip(0), 80, ACK, b"");
            Ok((
                median(new_flow),
                median(costs(hr, Prog::PodIngress, &est, runs)?),
            ))
        })?;
        println!("| {alg} | {new_flow} | {established} |");
    }
    // Maglev programming at 1,000 Services x 10 backends.
    let mut h = Harness::try_new("kpr-cost", MapSizes::default(), Config::default())?;
    let mut d = DesiredState::default();
    for i in 0..1000 {
        lb_frontend(&mut d, i, 10, LbAlgorithm::Maglev, i * 10);
    }
    let t = std::time::Instant::now();
    let r = h.writer.sync(&d);
    let first = t.elapsed();
    anyhow::ensure!(
        r.errors.is_empty(),
        "programming 1000 Maglev services: {:?}",
        r.errors.first()
    );
    let mut d2 = DesiredState::default();
    for i in 0..1000 {
        // The first backend of each replaced by a new one.
        lb_frontend(&mut d2, i, 10, LbAlgorithm::Maglev, i * 10 + 1);
    }
    let t = std::time::Instant::now();
    let r = h.writer.sync(&d2);
    let rebuild = t.elapsed();
    anyhow::ensure!(r.errors.is_empty(), "rebuilding: {:?}", r.errors.first());
    let t = std::time::Instant::now();
    for fe in d2.frontends.values() {
        std::hint::black_box(proxy_agent::model::maglev_table(
            &fe.backends,
            proxy_common::lb::MAGLEV_DEFAULT_SIZE,
        ));
    }
    let population = t.elapsed();
    let (tables, bytes) = h.writer.maglev_usage();
    println!();
    println!(
        "| Maglev, 1,000 Services x 10 backends (table size {}) | |",
        proxy_common::lb::MAGLEV_DEFAULT_SIZE
    );
    println!("|---|---:|");
    println!(
        "| first sync (tables and everything else) | {:.0} ms |",
        first.as_secs_f64() * 1e3
    );
    println!(
        "| rebuild of every table (one backend replaced in each) | {:.0} ms |",
        rebuild.as_secs_f64() * 1e3
    );
    println!(
        "| of which table population (the algorithm alone) | {:.0} ms |",
        population.as_secs_f64() * 1e3
    );
    println!(
        "| tables / entry bytes | {tables} / {:.1} MiB |",
        bytes as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}

/// The session-affinity map at capacity, read whole: in batches, as the
/// writer now does, and with aya's iterator, as it did (median of 5 each).
fn measure_affinity_read() -> anyhow::Result<()> {
    use aya::maps::{HashMap as AyaHashMap, IterableMap, MapData};
    use proxy_agent::bpf::batch;
    use proxy_common::{map_names, Affinity4Key, AffinityValue};
    use std::os::fd::AsFd;
    use std::time::Instant;

    let h = Harness::new();
    let mut map: AyaHashMap<MapData, Affinity4Key, AffinityValue> = h.lru_map(map_names::AFFINITY);
    for i in 0..capacity::AFFINITY {
        let key = Affinity4Key {
            client_be: (0xc612_0000 + i).to_be(),
            rev_nat_id: 1 + (i % 1000) as RevNatId,
        };
        let value = AffinityValue {
            backend_id: 1 + i % 7,
            _pad: 0,
            last_used_ns: 1,
        };
        map.insert(key, value, 0)?;
    }
    let time = |f: &dyn Fn() -> usize| {
        let mut ms = Vec::new();
        let mut n = 0;
        for _ in 0..5 {
            let t = Instant::now();
            n = f();
            ms.push(t.elapsed().as_micros() as u64);
        }
        (median(ms) as f64 / 1e3, n)
    };
    let (batched, n_b) = time(&|| {
        batch::lookup_all::<Affinity4Key, AffinityValue>(map.map().fd().as_fd())
            .ok()
            .flatten()
            .map_or(0, |v| v.len())
    });
    let (iterated, n_i) = time(&|| map.iter().filter_map(Result::ok).count());
    println!("| affinity map read whole | entries | ms |");
    println!("|---|---:|---:|");
    println!("| in batches (BPF_MAP_LOOKUP_BATCH) | {n_b} | {batched:.1} |");
    println!("| aya's iterator | {n_i} | {iterated:.1} |");
    Ok(())
}

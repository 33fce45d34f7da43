//! Where the control plane's time goes, stage by stage, without a kernel:
//! N Services (2 endpoints each, the bench's manifests) read by the manifests
//! source, turned into the desired state by the incremental model and written
//! by the writer to a dataplane that only counts operations (the map writes'
//! own cost is the bench's to measure), as the agent takes them in the bench:
//! after a first sync that found nothing, as changes; then one change (a new Service in a
//! file of its own) through the same stages, as the agent runs them: the
//! source reads only the new file, the model computes that Service, the
//! writer writes its frontend. The last column is the periodic full sync
//! (`syncPeriod`) with nothing changed.
//!
//! The counting dataplane ([`proxy_agent::dataplane::Discard`]) has room for
//! 2^24 frontends and backends (as a node configured with `mapSizes` for
//! them).
//!
//! `cargo run --release -p proxy-agent --example control_plane_cost -- [N...]`
use std::fmt::Write as _;
use std::time::Instant;

use proxy_agent::{
    dataplane::{Changes, Discard, Writer},
    model::{Incremental, ModelOptions},
    sources::{ManifestsSource, Source, SourceChanges},
};

fn service_yaml(i: usize) -> String {
    // ClusterIPs from 198.19.0.0 on (room for 65,536), then 198.18.0.0 on;
    // endpoints in 198.18.0.0/16 (data only: nothing is sent).
    let i32 = u32::try_from(i).expect("fewer than 2^32 Services");
    let vip = std::net::Ipv4Addr::from(if i32 < 65_536 {
        0xc613_0000 + i32
    } else {
        0xc612_0000 + (i32 - 65_536)
    });
    let (a, b) = ((i >> 8) & 0xff, i & 0xff);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"---
{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"svc-{i}","namespace":"bench","creationTimestamp":"2026-01-01T00:00:00Z"}},"spec":{{"type":"ClusterIP","clusterIP":"{vip}","clusterIPs":["{vip}"],"ports":[{{"name":"http","port":80,"protocol":"TCP","targetPort":8080}}]}}}}
---
{{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{{"name":"svc-{i}-bench","namespace":"bench","labels":{{"kubernetes.io/service-name":"svc-{i}"}}}},"addressType":"IPv4","endpoints":[{{"addresses":["198.18.{a}.{b}"],"conditions":{{"ready":true}}}},{{"addresses":["198.18.{a}.{c}"],"conditions":{{"ready":true}}}}],"ports":[{{"name":"http","port":8080,"protocol":"TCP"}}]}}"#,
        c = (b + 1) & 0xff
    );
    out
}

/// This process's resident memory, MiB.
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// What the agent does after its first sync and after a full one
/// ([`proxy_agent::alloc::release_freed_memory`]).
fn give_back() {
    proxy_agent::alloc::release_freed_memory();
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// The agent's allocator, as its binary sets it.
#[global_allocator]
static ALLOCATOR: proxy_agent::alloc::Allocator = proxy_agent::alloc::Allocator;

fn main() {
    proxy_agent::alloc::configure();
    let ns: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let ns = if ns.is_empty() {
        vec![1_000, 10_000, 50_000, 100_000]
    } else {
        ns
    };
    println!("| N | read | model | writer | from empty | one change: read | model | writer | total | map ops | full sync, nothing changed | RSS MiB |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for n in ns {
        let dir = tempfile::tempdir().expect("tempdir");
        let text: String = (0..n).map(service_yaml).collect();
        std::fs::write(dir.path().join("a.yaml"), text).expect("write");
        let mut source = ManifestsSource::new(vec![dir.path().to_path_buf()]);
        let mut model = Incremental::new("node-a", ModelOptions::default());
        let mut writer = Writer::adopt(Discard::default()).expect("adopt");

        let changes = |source: &mut ManifestsSource| match source.changes() {
            (SourceChanges::Changes(c), 0) => c,
            other => panic!("{other:?}"),
        };
        let t = Instant::now();
        let c = changes(&mut source);
        let read = ms(t);
        let rss_read = rss_mib();
        // As the agent: its first sync (nothing yet), then the objects as
        // changes.
        writer.sync(model.desired());
        let t = Instant::now();
        let update = model.apply(c);
        let model_ms = ms(t);
        let rss_model = rss_mib();
        let t = Instant::now();
        let report = writer.sync_changed(
            model.desired(),
            Changes {
                frontends: &update.frontends,
                local_endpoints: &update.local_endpoints,
            },
        );
        // Beyond 65,535 frontends the reverse-NAT ids (16 bits) run out:
        // the youngest Services are reported, not programmed.
        let refused = report.errors.len();
        let write = ms(t);
        assert_eq!(model.desired().frontends.len(), n);
        // Where the memory is: what the source read, the model's
        // additions, the writer's mirror.
        let rss_writer = rss_mib();
        let t_trim = Instant::now();
        give_back();
        eprintln!(
            "N = {n}: RSS {rss_read:.0} MiB after reading, {rss_model:.0} after the model, {rss_writer:.0} after the writer, {:.0} once freed pages are given back ({:.1} ms)",
            rss_mib(),
            ms(t_trim)
        );

        // The big file settles (a file read within a second of its
        // modification has its content compared at the next read).
        std::thread::sleep(std::time::Duration::from_millis(1100));
        assert!(changes(&mut source).is_empty());
        std::fs::write(dir.path().join("b.yaml"), service_yaml(n)).expect("write");
        let t0 = Instant::now();
        let t = Instant::now();
        let c = changes(&mut source);
        let read1 = ms(t);
        let t = Instant::now();
        let update = model.apply(c);
        let model1 = ms(t);
        let ops = writer.dataplane().ops;
        let t = Instant::now();
        let report = writer.sync_changed(
            model.desired(),
            Changes {
                frontends: &update.frontends,
                local_endpoints: &update.local_endpoints,
            },
        );
        let write1 = ms(t);
        let total = ms(t0);
        assert!(report.frontends_added == 1 || refused > 0, "{report:?}");
        let ops = writer.dataplane().ops - ops;
        // The periodic resync: every file's content compared, the model
        // fed what changed (nothing), the writer's full sync.
        let t = Instant::now();
        let c = match source.resync() {
            (SourceChanges::Changes(c), 0) => c,
            other => panic!("{other:?}"),
        };
        assert!(model.apply(c).is_empty());
        let report = writer.sync(model.desired());
        assert!(report.writes == 0 || refused > 0, "{report:?}");
        let idle = ms(t);
        let rss_idle = rss_mib();
        give_back();
        eprintln!(
            "N = {n}: RSS {rss_idle:.0} MiB after a full sync that changed nothing, {:.0} once freed pages are given back",
            rss_mib()
        );
        if refused > 0 {
            eprintln!("N = {n}: {refused} frontends not programmed (reverse-NAT ids exhausted)");
        }
        println!(
            "| {n} | {read:.1} | {model_ms:.1} | {write:.1} | {:.1} | {read1:.2} | {model1:.2} | {write1:.2} | {total:.2} | {ops} | {idle:.1} | {:.0} |",
            read + model_ms + write,
            rss_mib(),
        );
    }
}

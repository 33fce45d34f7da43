//! Prometheus metrics, with kube-proxy's names where the meaning is the same:
//!
//! - `kubeproxy_sync_proxy_rules_duration_seconds` (histogram): how long a sync
//!   took, from reading the source to the last map write;
//! - `kubeproxy_sync_proxy_rules_last_timestamp_seconds`: when the last sync
//!   completed (Unix seconds);
//! - `kubeproxy_network_programming_duration_seconds` (histogram): from an
//!   EndpointSlice's `endpoints.kubernetes.io/last-change-trigger-time` to the
//!   end of the sync that programmed it;
//! - `proxy_agent_programmed_frontends`, `proxy_agent_programmed_backends`:
//!   what the maps hold after the last sync;
//! - `proxy_agent_sync_program_errors`: what the last sync could not program;
//! - `proxy_agent_source_ready`: 1 once the source holds a complete view
//!   (the API server's lists done, the manifests read), 0 while it does not;
//! - `proxy_agent_map_capacity_entries{map}`: the entries each BPF map was
//!   created with (`mapSizes`, `conntrack`), beside which the programmed
//!   counts are the maps' fill;
//! - `proxy_agent_datapath_packets_total{reason}`: the datapath's verdict
//!   counters, read from the pinned stats map at scrape time.
use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    sync::atomic::AtomicU64,
    time::{Duration, SystemTime},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{
        counter::ConstCounter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, linear_buckets, Histogram},
    },
    registry::Registry,
};
use tracing::debug;

use crate::bpf::PinnedMaps;
use crate::objects::{Snapshot, ANNOTATION_LAST_CHANGE_TRIGGER_TIME};

/// kube-proxy's buckets for the sync duration: 1 ms × 2^i, 15 buckets.
fn sync_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 15)
}

/// kube-proxy's buckets for the network programming latency.
fn programming_buckets() -> impl Iterator<Item = f64> {
    linear_buckets(0.25, 0.25, 2)
        .chain(linear_buckets(1.0, 1.0, 59))
        .chain(linear_buckets(60.0, 5.0, 12))
        .chain(linear_buckets(120.0, 30.0, 7))
}

/// The datapath's counters, read when scraped.
#[derive(Debug)]
struct DatapathStats {
    pin_dir: PathBuf,
}

impl Collector for DatapathStats {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = match PinnedMaps::new(&self.pin_dir).stats() {
            Ok(s) => s,
            Err(e) => {
                // No datapath (yet): no series, rather than a failed scrape.
                debug!(error = %e, "datapath stats not readable");
                return Ok(());
            }
        };
        let mut family = encoder.encode_descriptor(
            "proxy_agent_datapath_packets",
            "Packets seen by the datapath, by verdict (summed over CPUs)",
            None,
            ConstCounter::<u64>::new(0).metric_type(),
        )?;
        for (code, value) in stats {
            let reason = proxy_common::stat::NAMES
                .get(code as usize)
                .copied()
                .filter(|n| !n.is_empty())
                .map_or_else(|| format!("code_{code}"), str::to_string);
            let labels = [("reason".to_string(), reason)];
            ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
        }
        let Ok(traffic) = PinnedMaps::new(&self.pin_dir).traffic() else {
            return Ok(());
        };
        let proto = crate::model::proto_name;
        let fe: Vec<(String, proxy_common::Traffic)> = traffic
            .frontends
            .values()
            .map(|(a, p, pr, t)| {
                let at = std::net::SocketAddr::new(*a, *p);
                (format!("{at}/{}", proto(*pr)), *t)
            })
            .collect();
        let be: Vec<(String, proxy_common::Traffic)> = traffic
            .backends
            .values()
            .map(|(a, p, pr, t)| {
                let at = std::net::SocketAddr::new(*a, *p);
                (format!("{at}/{}", proto(*pr)), *t)
            })
            .collect();
        for (what, label, rows) in [("frontend", "frontend", &fe), ("backend", "backend", &be)] {
            for (unit, help, get) in [
                (
                    "packets",
                    "Packets",
                    (|t: &proxy_common::Traffic| t.packets) as fn(&proxy_common::Traffic) -> u64,
                ),
                (
                    "bytes",
                    "Bytes (whole frames)",
                    |t: &proxy_common::Traffic| t.bytes,
                ),
            ] {
                let name = format!("proxy_agent_{what}_{unit}");
                let help =
                    format!("{help} of translated flows through each {what}, both directions");
                let mut family = encoder.encode_descriptor(
                    &name,
                    &help,
                    None,
                    ConstCounter::<u64>::new(0).metric_type(),
                )?;
                for (name, t) in rows.iter() {
                    let labels = [(label.to_string(), name.clone())];
                    ConstCounter::new(get(t)).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
}

/// The agent's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    sync_duration: Histogram,
    last_sync: Gauge<f64, AtomicU64>,
    programming: Histogram,
    frontends: Gauge,
    backends: Gauge,
    program_errors: Gauge,
    maglev_tables: Gauge,
    maglev_table_bytes: Gauge,
    maglev_refused: Gauge,
    source_ready: Gauge,
    map_capacity: Family<[(&'static str, &'static str); 1], Gauge>,
}

impl Metrics {
    /// `pin_dir`: where the datapath's maps are pinned (its stats are read
    /// from there at scrape time); `None` leaves the datapath counters out.
    pub fn new(pin_dir: Option<PathBuf>) -> Self {
        let mut registry = Registry::default();
        let sync_duration = Histogram::new(sync_buckets());
        let last_sync = Gauge::<f64, AtomicU64>::default();
        let programming = Histogram::new(programming_buckets());
        let frontends = Gauge::default();
        let backends = Gauge::default();
        let program_errors = Gauge::default();
        let maglev_tables = Gauge::default();
        let maglev_table_bytes = Gauge::default();
        let maglev_refused = Gauge::default();
        let source_ready = Gauge::default();
        let map_capacity = Family::<[(&'static str, &'static str); 1], Gauge>::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            last_sync.clone(),
        );
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            programming.clone(),
        );
        registry.register(
            "proxy_agent_programmed_frontends",
            "Frontends (service address, port, protocol) programmed by the last sync",
            frontends.clone(),
        );
        registry.register(
            "proxy_agent_programmed_backends",
            "Distinct backends programmed by the last sync (terminating ones kept for their flows included)",
            backends.clone(),
        );
        registry.register(
            "proxy_agent_sync_program_errors",
            "Frontends or backends the last sync could not program",
            program_errors.clone(),
        );
        registry.register(
            "proxy_agent_maglev_tables",
            "Maglev lookup tables programmed (one per Maglev frontend with backends)",
            maglev_tables.clone(),
        );
        registry.register(
            "proxy_agent_maglev_table_bytes",
            "Bytes of Maglev table entries programmed (table size x 4 per table)",
            maglev_table_bytes.clone(),
        );
        registry.register(
            "proxy_agent_maglev_tables_refused",
            "Frontends the last sync refused a Maglev table (loadBalancing.maglev.maxTables reached)",
            maglev_refused.clone(),
        );
        registry.register(
            "proxy_agent_source_ready",
            "1 once the source holds a complete view of the cluster (lists done), 0 while it does not",
            source_ready.clone(),
        );
        registry.register(
            "proxy_agent_map_capacity_entries",
            "Entries each BPF map was created with (mapSizes, conntrack): programmed_frontends over reverse_nat and programmed_backends over backends are the maps' fill",
            map_capacity.clone(),
        );
        if let Some(pin_dir) = pin_dir {
            registry.register_collector(Box::new(DatapathStats { pin_dir }));
        }
        Self {
            registry,
            sync_duration,
            last_sync,
            programming,
            frontends,
            backends,
            program_errors,
            maglev_tables,
            maglev_table_bytes,
            maglev_refused,
            source_ready,
            map_capacity,
        }
    }

    /// Whether the source holds a complete view (its lists done).
    pub fn set_source_ready(&self, ready: bool) {
        self.source_ready.set(i64::from(ready));
    }

    /// The entries the BPF maps were created with.
    pub fn set_map_capacity(&self, sizes: &crate::bpf::MapSizes) {
        for (map, n) in [
            ("services", sizes.services),
            ("backends", sizes.backends),
            ("reverse_nat", sizes.rev_nat),
            ("conntrack", sizes.conntrack),
        ] {
            self.map_capacity
                .get_or_create(&[("map", map)])
                .set(i64::from(n));
        }
    }

    /// Records the Maglev tables programmed (count, bytes) and how many
    /// frontends the last sync refused one.
    pub fn observe_maglev(&self, (tables, bytes): (usize, u64), refused: usize) {
        self.maglev_tables.set(tables as i64);
        self.maglev_table_bytes.set(bytes as i64);
        self.maglev_refused.set(refused as i64);
    }

    /// Records a completed sync of `desired`, `errors` of which could not be
    /// programmed.
    /// One sync: how long it took, the desired frontends, the backends
    /// programmed and what could not be programmed.
    pub fn observe_sync(
        &self,
        elapsed: Duration,
        frontends: usize,
        backends: usize,
        errors: usize,
    ) {
        self.sync_duration.observe(elapsed.as_secs_f64());
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        self.last_sync.set(now.as_secs_f64());
        self.frontends.set(frontends as i64);
        self.backends.set(backends as i64);
        self.program_errors.set(errors as i64);
    }

    /// Records one network programming latency.
    pub fn observe_programming(&self, latency: Duration) {
        self.programming.observe(latency.as_secs_f64());
    }

    /// The metrics in Prometheus text format (0.0.4).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String does not fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

/// Tracks EndpointSlice trigger times between syncs, as kube-proxy's endpoint
/// change tracker does: each new trigger time is observed once, at the end of
/// the sync that programmed it; times from before the agent started are
/// ignored (they would measure the agent's downtime).
#[derive(Debug)]
pub struct ProgrammingLatency {
    started: SystemTime,
    seen: HashMap<(String, String), String>,
}

impl Default for ProgrammingLatency {
    fn default() -> Self {
        Self::new(SystemTime::now())
    }
}

impl ProgrammingLatency {
    pub fn new(started: SystemTime) -> Self {
        Self {
            started,
            seen: HashMap::new(),
        }
    }

    /// The trigger times of the slices in `snapshot` that changed since the
    /// last call; forgets deleted slices.
    pub fn pending(&mut self, snapshot: &Snapshot) -> Vec<SystemTime> {
        self.pending_slices(snapshot.endpoint_slices.iter().filter_map(|s| {
            let m = &s.metadata;
            let t = m
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_LAST_CHANGE_TRIGGER_TIME))?;
            let ns = m.namespace.as_deref().filter(|n| !n.is_empty());
            let key = (
                ns.unwrap_or("default").to_string(),
                m.name.clone().unwrap_or_default(),
            );
            Some((key, t.as_str()))
        }))
    }

    /// [`ProgrammingLatency::pending`] of every slice a source holds, as
    /// its key and trigger time.
    fn pending_slices<'a>(
        &mut self,
        slices: impl Iterator<Item = ((String, String), &'a str)>,
    ) -> Vec<SystemTime> {
        let current: BTreeMap<(String, String), String> =
            slices.map(|(k, t)| (k, t.to_string())).collect();
        let mut out = Vec::new();
        for (key, t) in &current {
            if self.seen.get(key) == Some(t) {
                continue;
            }
            if let Ok(ts) = t.parse::<jiff::Timestamp>() {
                let when = SystemTime::from(ts);
                if when >= self.started {
                    out.push(when);
                }
            }
        }
        self.seen = current.into_iter().collect();
        out
    }

    /// [`ProgrammingLatency::pending`] of every object a source holds.
    pub fn pending_objects(&mut self, objects: &[crate::model::Object]) -> Vec<SystemTime> {
        self.pending_slices(objects.iter().filter_map(|o| match o {
            crate::model::Object::EndpointSlice(s) => Some((
                (s.namespace.to_string(), s.name.to_string()),
                s.trigger_time.as_deref()?,
            )),
            _ => None,
        }))
    }

    /// The trigger times of the slices `changes` name that changed since
    /// they were last seen; forgets deleted slices.
    pub fn pending_changes(&mut self, changes: &[crate::model::Change]) -> Vec<SystemTime> {
        use crate::model::{Change, Kind, Object};
        let mut out = Vec::new();
        for c in changes {
            match c {
                Change::Applied(Object::EndpointSlice(s)) => {
                    let key = (s.namespace.to_string(), s.name.to_string());
                    let Some(t) = s.trigger_time.as_deref() else {
                        self.seen.remove(&key);
                        continue;
                    };
                    if self.seen.get(&key).map(String::as_str) == Some(t) {
                        continue;
                    }
                    if let Ok(ts) = t.parse::<jiff::Timestamp>() {
                        let when = SystemTime::from(ts);
                        if when >= self.started {
                            out.push(when);
                        }
                    }
                    self.seen.insert(key, t.to_string());
                }
                Change::Deleted(Kind::EndpointSlice, key) => {
                    self.seen.remove(&(key.0.to_string(), key.1.to_string()));
                }
                _ => {}
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn slice(name: &str, trigger: &str) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                annotations: Some(
                    [(
                        ANNOTATION_LAST_CHANGE_TRIGGER_TIME.to_string(),
                        trigger.to_string(),
                    )]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            address_type: "IPv4".into(),
            endpoints: vec![],
            ports: None,
        }
    }

    #[test]
    fn each_trigger_time_is_observed_once_and_old_ones_never() {
        let started: SystemTime = "2030-01-01T00:00:00Z"
            .parse::<jiff::Timestamp>()
            .unwrap()
            .into();
        let mut p = ProgrammingLatency::new(started);
        let mut snap = Snapshot {
            endpoint_slices: vec![
                slice("a", "2029-12-31T23:00:00Z"),
                slice("b", "2030-01-01T00:00:05Z"),
            ],
            ..Snapshot::default()
        };
        assert_eq!(p.pending(&snap).len(), 1, "a predates the start");
        assert!(p.pending(&snap).is_empty(), "nothing new");
        snap.endpoint_slices[0] = slice("a", "2030-01-01T00:01:00Z");
        assert_eq!(
            p.pending(&snap),
            vec![SystemTime::from(
                "2030-01-01T00:01:00Z".parse::<jiff::Timestamp>().unwrap()
            )]
        );
    }

    #[test]
    fn encodes_kube_proxy_names_in_prometheus_text() {
        let m = Metrics::new(None);
        m.observe_sync(Duration::from_millis(3), 0, 0, 0);
        m.observe_programming(Duration::from_millis(700));
        let text = m.encode();
        for name in [
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
            "kubeproxy_sync_proxy_rules_duration_seconds_count 1",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"1\"} 1",
            "proxy_agent_programmed_frontends 0",
            "proxy_agent_programmed_backends 0",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
    }

    /// The source's state and the maps' capacities, which the alerts
    /// (deploy/monitoring) divide the programmed counts by.
    #[test]
    fn source_state_and_map_capacity_are_exported() {
        let m = Metrics::new(None);
        assert!(m.encode().contains("proxy_agent_source_ready 0"));
        m.set_source_ready(true);
        let sizes = crate::bpf::MapSizes {
            backends: 4096,
            ..crate::bpf::MapSizes::default()
        };
        m.set_map_capacity(&sizes);
        let text = m.encode();
        assert!(text.contains("proxy_agent_source_ready 1"), "{text}");
        assert!(
            text.contains("proxy_agent_map_capacity_entries{map=\"backends\"} 4096"),
            "{text}"
        );
        for map in ["services", "reverse_nat", "conntrack"] {
            assert!(
                text.contains(&format!(
                    "proxy_agent_map_capacity_entries{{map=\"{map}\"}}"
                )),
                "{map}: {text}"
            );
        }
    }
}

//! One sync: what the source saw, through the model, written to the maps,
//! and reported (health, metrics, the `healthCheckNodePort` listeners, the
//! UDP flows a change ended).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    sync::Arc,
    time::Instant,
};

use proxy_common::Config;
use tracing::{error, info, warn};

use crate::{
    bpf::BpfDataplane,
    config::Settings,
    dataplane::Writer,
    metrics::{Metrics, ProgrammingLatency},
    model,
    serve::health::Health,
    sources::{Source, SourceChanges},
};

use super::start::delivery_via_stack;
use super::udp_flows::{forget_stale_udp_flows, SockRevNatMaps};
use super::SYNC_COMPLETE;

/// What a sync reports to, besides the log.
pub(super) struct Observers {
    pub(super) health: Arc<Health>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) latency: ProgrammingLatency,
    /// The datapath configuration as written, and the node address in it.
    pub(super) datapath: Config,
    /// When `deliveryMode: auto` last looked for a policy engine.
    pub(super) delivery_checked: Instant,
    /// The `healthCheckNodePort` listeners, reconciled after every sync.
    pub(super) health_checks: crate::serve::health_check_node_ports::HealthCheckServers,
    /// The backends of each UDP frontend address as last programmed (every
    /// scope's, retained ones included): when a backend leaves one, the
    /// flows it carried for that frontend are forgotten (conntrack entries
    /// deleted, host clients' connected sockets destroyed).
    pub(super) udp_backends: BTreeMap<SocketAddr, BTreeSet<SocketAddr>>,
    /// The socket-level reverse-NAT maps (which sockets the hooks aimed
    /// where), IPv4's and IPv6's; `None` while host socket LB is off.
    pub(super) sock_revnat: Option<SockRevNatMaps>,
    /// The host-client device, when host clients' UDP to ClusterIPs is
    /// translated per packet.
    pub(super) host_device: Option<crate::host::svc_device::HostDevice>,
    /// The ClusterIP routes to that device, kept in step with the frontends.
    pub(super) service_routes: Option<crate::host::svc_device::ServiceRoutes>,
}

/// Whether a desired frontend is a ClusterIP (routed to the host-client
/// device).
fn is_cluster_ip((k, f): (&model::FrontendKey, &model::Frontend)) -> bool {
    k.scope == proxy_common::SCOPE_INTERNAL && f.flags & proxy_common::svc_flags::CLUSTER_IP != 0
}

/// Whether a frontend of `desired` at `addr` is a ClusterIP.
fn cluster_ip_at(desired: &model::DesiredState, addr: std::net::IpAddr) -> bool {
    let at = |port, proto, scope| model::FrontendKey {
        addr,
        port,
        proto,
        scope,
    };
    desired
        .frontends
        .range(at(0, 0, 0)..=at(u16::MAX, u8::MAX, u8::MAX))
        .any(is_cluster_ip)
}

/// The ClusterIP routes to the host-client device: every one compared at an
/// initial or full sync (and all of them again when the node's address, their
/// source, changed), the changed frontends' addresses otherwise. Also the
/// IPv4 hairpin address: while the node's address is unknown to the
/// datapath, a host client's flow to a backend at that address is given it
/// as its source (otherwise the frontend's), and its answers must come back
/// through the device too.
fn sync_routes(
    cfg: &Settings,
    routes: &mut crate::host::svc_device::ServiceRoutes,
    desired: &model::DesiredState,
    changed: &BTreeSet<model::FrontendKey>,
    scope: SyncScope,
) {
    let src = (desired.node_addr, desired.node_addr6);
    let hairpin = std::net::IpAddr::V4(cfg.hairpin_snat_ip);
    let hairpin_routed =
        !cfg.hairpin_snat_ip.is_unspecified() && desired.node_addr != Some(cfg.hairpin_snat_ip);
    let report = if scope == SyncScope::Changes && routes.source() == src {
        routes.sync_changed(changed.iter().map(|k| k.addr), |a| {
            cluster_ip_at(desired, a)
        })
    } else {
        let mut want: BTreeSet<std::net::IpAddr> = desired
            .frontends
            .iter()
            .filter(|&e| is_cluster_ip(e))
            .map(|(k, _)| k.addr)
            .collect();
        if hairpin_routed {
            want.insert(hairpin);
        }
        routes.sync_all(&want, src)
    };
    for (addr, e) in report.failed.iter().take(10) {
        error!(address = %addr, error = %e, "cannot route a ClusterIP to the host-client device");
    }
    if report.added + report.removed > 0 {
        info!(
            added = report.added,
            removed = report.removed,
            routed = routes.len(),
            "ClusterIP routes to the host-client device updated"
        );
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// What one sync writes.
pub(super) enum SyncScope {
    /// The first: everything, before the programs are attached (leftovers
    /// of a previous agent are deleted); readiness is not announced yet.
    Initial,
    /// Only what the source's changes changed in the desired state.
    Changes,
    /// Everything compared with what is programmed: the periodic safety
    /// net (`syncPeriod`), cheap when nothing changed.
    Full,
}

/// A sync that computed at least this many Services, or a full sync of at
/// least this many frontends, gives the heap's free pages back
/// ([`crate::alloc::release_freed_memory`]).
pub(super) const RELEASE_AFTER: usize = 1_024;

/// One sync: read what changed in the source, compute the desired state of
/// the Services it concerns, write the difference.
pub(super) fn sync_once(
    cfg: &Settings,
    source: &mut dyn Source,
    model: &mut model::Incremental,
    writer: &mut Writer<BpfDataplane>,
    obs: &mut Observers,
    scope: SyncScope,
) {
    let started = Instant::now();
    let (changes, source_errors) = match scope {
        SyncScope::Changes => source.changes(),
        SyncScope::Initial | SyncScope::Full => source.resync(),
    };
    let source_revision = source.revision();
    let (update, triggers) = match changes {
        SourceChanges::Full(snapshot) => {
            let triggers = obs.latency.pending(&snapshot);
            (model.replace(snapshot), triggers)
        }
        SourceChanges::All(objects) => {
            let triggers = obs.latency.pending_objects(&objects);
            (model.replace_objects(objects), triggers)
        }
        SourceChanges::Changes(changes) => {
            let triggers = obs.latency.pending_changes(&changes);
            (model.apply(changes), triggers)
        }
    };
    // Warnings of what was computed again: a Service's problems are said
    // when it (or what it depends on) changes, not at every sync.
    for w in &update.warnings {
        warn!("{w}");
    }
    let desired = model.desired();
    // The node's address is the SNAT source of external traffic to other nodes.
    // IPv6 hairpin flows are SNATed to the configured address, else to the
    // node's IPv6 address.
    let hairpin6 = cfg.hairpin_snat_ip6.or(desired.node_addr6);
    // A sync never drains (only the attach on a node kube-proxy serves, and
    // `--on-exit drain`): a draining flag left by a failed write is cleared.
    let mut node_cfg = obs
        .datapath
        .with_draining(false)
        .with_node_addr(desired.node_addr.unwrap_or(std::net::Ipv4Addr::UNSPECIFIED))
        .with_hairpin6_addr(hairpin6.unwrap_or(std::net::Ipv6Addr::UNSPECIFIED))
        .with_node6_addr(
            desired
                .node_addr6
                .unwrap_or(std::net::Ipv6Addr::UNSPECIFIED),
        );
    if cfg.delivery_mode == crate::config::DeliveryMode::Auto
        && obs.delivery_checked.elapsed() >= cfg.sync_period
    {
        // A policy engine may install its chains after this agent started.
        node_cfg = node_cfg.with_delivery_via_stack(delivery_via_stack(cfg.delivery_mode));
        obs.delivery_checked = Instant::now();
    }
    if node_cfg != obs.datapath {
        match writer.dataplane_mut().set_config(node_cfg) {
            Ok(()) => {
                info!(
                    node_addr = ?desired.node_addr,
                    delivery = if node_cfg.flags & proxy_common::config_flags::DELIVER_VIA_STACK != 0 { "stack" } else { "redirect" },
                    "datapath configuration updated"
                );
                obs.datapath = node_cfg;
            }
            Err(e) => error!(error = %e, "cannot update the datapath configuration"),
        }
    }
    let report = match scope {
        SyncScope::Full | SyncScope::Initial => writer.sync(desired),
        SyncScope::Changes => writer.sync_changed(
            desired,
            crate::dataplane::Changes {
                frontends: &update.frontends,
                local_endpoints: &update.local_endpoints,
            },
        ),
    };
    // A full sync of a large cluster builds and drops sets of every
    // frontend (9 MiB at 50,000 that glibc's malloc kept): given back too,
    // 0.2 ms at 50,000 with mimalloc, against the 130 ms the sync takes.
    if scope == SyncScope::Initial
        || update.services >= RELEASE_AFTER
        || (scope == SyncScope::Full && desired.frontends.len() >= RELEASE_AFTER)
    {
        crate::alloc::release_freed_memory();
    }
    // Over capacity, thousands of frontends fail the same way at every sync:
    // the first few are named, the rest counted.
    const NAMED: usize = 10;
    for (what, e) in report.errors.iter().take(NAMED) {
        error!(frontend = %what, error = %e, "cannot program");
    }
    if report.errors.len() > NAMED {
        error!(
            more = report.errors.len() - NAMED,
            "cannot program more frontends (same causes; see the map sizes)"
        );
    }
    if let Some(routes) = obs.service_routes.as_mut() {
        sync_routes(cfg, routes, desired, &update.frontends, scope);
    }
    // Only a change of a UDP frontend can take a backend from a UDP socket.
    if scope != SyncScope::Changes
        || update
            .frontends
            .iter()
            .any(|k| k.proto == proxy_common::IPPROTO_UDP)
    {
        forget_stale_udp_flows(cfg, obs, writer, desired);
    }
    // Ports that cannot be bound are logged inside and retried next sync.
    obs.health_checks.sync(&desired.health_checks);
    // A sync that ran is an update for the health check even when single
    // frontends failed: those are retried, counted and logged, and a crash
    // loop (liveness) would not make them fit.
    obs.health.updated();
    obs.health.sync_node(model.node(&cfg.node_name));
    obs.metrics.observe_sync(
        started.elapsed(),
        desired.frontends.len(),
        writer.backend_ids().len(),
        report.errors.len(),
    );
    obs.metrics
        .observe_maglev(writer.maglev_usage(), report.maglev_refused);
    let now = std::time::SystemTime::now();
    for t in triggers {
        obs.metrics
            .observe_programming(now.duration_since(t).unwrap_or_default());
    }
    // The first sync runs before the programs are attached: it is not yet the
    // moment to announce readiness (the lab and tests wait for the marker).
    let what = if scope == SyncScope::Initial {
        "initial sync"
    } else {
        SYNC_COMPLETE
    };
    info!(
        frontends = desired.frontends.len(),
        source_errors,
        services_computed = update.services,
        frontends_changed = update.frontends.len(),
        model_warnings = update.warnings.len(),
        program_errors = report.errors.len(),
        elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
        source_revision = source_revision.unwrap_or(0),
        "{what}: {report:?}"
    );
}

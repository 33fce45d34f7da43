//! The agent's run loop: load and pin the datapath, attach it to pod
//! interfaces as they appear, and keep the maps equal to the desired state of
//! the source, with kube-proxy's minimum sync period.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::StreamExt;
use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::{
    address::AddressMessage,
    link::{LinkAttribute, LinkMessage},
    RouteNetlinkMessage,
};
use proxy_common::{Config, SockRevNat4Key, SockRevNat4Value, SockRevNat6Key, SockRevNat6Value};
use rtnetlink::{new_multicast_connection, MulticastGroup};
use tokio::sync::{mpsc, watch};
use tracing::{debug, error, info, warn};

use crate::{
    bpf::{self, Attacher, BpfDataplane, BpfError, IfaceKind},
    config::Settings,
    dataplane::Writer,
    host::ifaddrs::InterfaceAddresses,
    metrics::{Metrics, ProgrammingLatency},
    model::{self, ModelOptions},
    serve::endpoints,
    serve::health::Health,
    sources::{Source, SourceChanges, SourceError},
};

/// How often expired conntrack entries are deleted.
const CT_GC_INTERVAL: Duration = Duration::from_secs(10);

/// Log line printed after every sync; the lab and tests wait for it.
pub const SYNC_COMPLETE: &str = "sync complete";

/// What a sync reports to, besides the log.
struct Observers {
    health: Arc<Health>,
    metrics: Arc<Metrics>,
    latency: ProgrammingLatency,
    /// The datapath configuration as written, and the node address in it.
    datapath: Config,
    /// When `deliveryMode: auto` last looked for a policy engine.
    delivery_checked: Instant,
    /// The `healthCheckNodePort` listeners, reconciled after every sync.
    health_checks: crate::serve::health_check_node_ports::HealthCheckServers,
    /// The backends of each UDP frontend address as last programmed (every
    /// scope's, retained ones included): when a backend leaves one, the
    /// flows it carried for that frontend are forgotten (conntrack entries
    /// deleted, host clients' connected sockets destroyed).
    udp_backends: BTreeMap<SocketAddr, BTreeSet<SocketAddr>>,
    /// The socket-level reverse-NAT maps (which sockets the hooks aimed
    /// where), IPv4's and IPv6's; `None` while host socket LB is off.
    sock_revnat: Option<SockRevNatMaps>,
}

/// The socket-level reverse-NAT maps of both families.
struct SockRevNatMaps {
    v4: aya::maps::HashMap<aya::maps::MapData, SockRevNat4Key, SockRevNat4Value>,
    v6: aya::maps::HashMap<aya::maps::MapData, SockRevNat6Key, SockRevNat6Value>,
}

impl SockRevNatMaps {
    fn open(pin_dir: &std::path::Path) -> Result<Self, String> {
        Ok(Self {
            v4: crate::bpf::open_lru_hash(pin_dir, proxy_common::map_names::SOCK_REVNAT)?,
            v6: crate::bpf::open_lru_hash(pin_dir, proxy_common::map_names::SOCK_REVNAT6)?,
        })
    }

    /// The frontend the hooks aimed socket `cookie` from when they sent it
    /// to `peer` (as the socket has it: an IPv4-mapped peer of an IPv6
    /// socket is in the IPv4 map); `None` if they did not.
    fn aimed_from(&self, cookie: u64, peer: SocketAddr) -> Option<SocketAddr> {
        match crate::host::sockdiag::backend_of(peer) {
            SocketAddr::V4(p) => {
                let key = SockRevNat4Key {
                    cookie,
                    addr_be: u32::from_ne_bytes(p.ip().octets()),
                    port_be: p.port().to_be(),
                    _pad: 0,
                };
                let v = self.v4.get(&key, 0).ok()?;
                Some(SocketAddr::new(
                    Ipv4Addr::from(v.addr_be.to_ne_bytes()).into(),
                    u16::from_be(v.port_be),
                ))
            }
            SocketAddr::V6(p) => {
                let key = SockRevNat6Key {
                    cookie,
                    addr_be: proxy_common::ipv6::addr6(*p.ip()),
                    port_be: p.port().to_be(),
                    _pad: [0; 6],
                };
                let v = self.v6.get(&key, 0).ok()?;
                Some(SocketAddr::new(
                    proxy_common::ipv6::ipv6(&v.addr_be).into(),
                    u16::from_be(v.port_be),
                ))
            }
        }
    }
}

/// The backends of each UDP frontend address of `desired` (the frontends
/// of every scope at that address and port), retained ones included.
fn udp_backends(desired: &model::DesiredState) -> BTreeMap<SocketAddr, BTreeSet<SocketAddr>> {
    let mut out: BTreeMap<SocketAddr, BTreeSet<SocketAddr>> = BTreeMap::new();
    for (k, f) in &desired.frontends {
        if k.proto != proxy_common::IPPROTO_UDP {
            continue;
        }
        out.entry(SocketAddr::new(k.addr, k.port))
            .or_default()
            .extend(
                f.backends
                    .iter()
                    .chain(f.retained.iter())
                    .map(|b| SocketAddr::new(b.addr, b.port)),
            );
    }
    out
}

/// The (frontend, backend) pairs of `before` that `now` no longer has: a
/// backend that left a UDP frontend, or a frontend that went.
fn gone_udp_pairs(
    before: &BTreeMap<SocketAddr, BTreeSet<SocketAddr>>,
    now: &BTreeMap<SocketAddr, BTreeSet<SocketAddr>>,
) -> BTreeSet<(SocketAddr, SocketAddr)> {
    let empty = BTreeSet::new();
    before
        .iter()
        .flat_map(|(fe, backends)| {
            let still = now.get(fe).unwrap_or(&empty);
            backends
                .difference(still)
                .map(move |be| (*fe, *be))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Forgets the UDP flows of every backend that left a UDP frontend, as
/// kube-proxy's conntrack cleanup does: the datapath's conntrack entries of
/// those pairs are deleted, so the next datagram picks one of the
/// frontend's backends again, and host clients' connected UDP sockets the
/// socket hooks aimed at such a pair are destroyed (see
/// [`crate::host::sockdiag`]). The backend may still back other Services: only
/// its flows of this frontend go.
fn forget_stale_udp_flows(
    cfg: &Settings,
    obs: &mut Observers,
    writer: &Writer<BpfDataplane>,
    desired: &model::DesiredState,
) {
    let now = udp_backends(desired);
    let gone = gone_udp_pairs(&obs.udp_backends, &now);
    obs.udp_backends = now;
    if gone.is_empty() {
        return;
    }
    // The datapath's flows: by the frontends' reverse-NAT ids (each scope
    // at the address) and the backend's id, both as programmed now. A
    // frontend that went has no id left, nor a backend no longer
    // programmed anywhere: the datapath finds neither and forgets those
    // flows itself.
    // One pass over the frontends: the ids of each scope at the addresses
    // that lost a backend.
    let gone_frontends: BTreeSet<SocketAddr> = gone.iter().map(|(fe, _)| *fe).collect();
    let mut ids_of: BTreeMap<SocketAddr, Vec<proxy_common::RevNatId>> = BTreeMap::new();
    for (k, &id) in writer.rev_nat_ids() {
        let fe = SocketAddr::new(k.addr, k.port);
        if k.proto == proxy_common::IPPROTO_UDP && gone_frontends.contains(&fe) {
            ids_of.entry(fe).or_default().push(id);
        }
    }
    let backend_ids = writer.backend_ids();
    let mut pairs = BTreeSet::new();
    for (fe, be) in &gone {
        let backend = model::BackendAddr {
            addr: be.ip(),
            port: be.port(),
            proto: proxy_common::IPPROTO_UDP,
        };
        let (Some(&backend_id), Some(ids)) = (backend_ids.get(&backend), ids_of.get(fe)) else {
            continue;
        };
        pairs.extend(ids.iter().map(|&id| (id, backend_id)));
    }
    match crate::bpf::delete_udp_flows(&cfg.bpffs, &pairs) {
        Ok(0) => {}
        Ok(n) => info!(
            flows = n,
            "UDP flows of backends that left their Service forgotten"
        ),
        Err(e) => {
            warn!(error = %e, "cannot delete the UDP flows of backends that left their Service; they keep their backend until idle")
        }
    }
    let Some(revnat) = &obs.sock_revnat else {
        return;
    };
    let backends: BTreeSet<SocketAddr> = gone.iter().map(|(_, be)| *be).collect();
    let ours = |cookie: u64, peer: SocketAddr| {
        revnat
            .aimed_from(cookie, peer)
            .is_some_and(|fe| gone.contains(&(fe, crate::host::sockdiag::backend_of(peer))))
    };
    match crate::host::sockdiag::destroy_aimed_at(&backends, ours) {
        Ok(d) if d.destroyed > 0 || d.failed > 0 => info!(
            destroyed = d.destroyed,
            failed = d.failed,
            "host clients' connected UDP sockets aimed at removed backends destroyed"
        ),
        Ok(_) => {}
        Err(e) => {
            warn!(error = %e, "cannot list UDP sockets (socket diag); connected UDP sockets of host clients may keep a removed backend")
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Bpf(#[from] BpfError),
    #[error("dataplane: {0}")]
    Dataplane(#[from] crate::dataplane::DataplaneError),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("netlink: {0}")]
    Netlink(std::io::Error),
    #[error("signal handler: {0}")]
    Signal(std::io::Error),
    #[error(
        "the interface watcher stopped; new pod interfaces and address changes would be missed"
    )]
    LinkWatcherStopped,
    #[error("{0}")]
    Setting(String),
}

fn matches(patterns: &[glob::Pattern], name: &str) -> bool {
    patterns.iter().any(|p| p.matches(name))
}

fn link_name(msg: &LinkMessage) -> Option<&str> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.as_str()),
        _ => None,
    })
}

/// Which programs an interface gets, by name: pod interfaces first.
#[derive(Clone)]
struct Patterns {
    pod: Vec<glob::Pattern>,
    external: Vec<glob::Pattern>,
    xdp: bool,
    /// The reply program at tc egress of external devices too, where flows
    /// delivered through the stack get their reverse NAT (`deliveryMode`
    /// auto or stack).
    ext_egress: bool,
}

impl Patterns {
    /// Whether `name` is an external device (a pod interface is not, even
    /// if the external patterns match it too).
    fn is_external(&self, name: &str) -> bool {
        !matches(&self.pod, name) && matches(&self.external, name)
    }

    fn kinds(&self, name: &str) -> &'static [IfaceKind] {
        if matches(&self.pod, name) {
            // Egress first: the ingress line is what waiters look for.
            &[IfaceKind::PodEgress, IfaceKind::Pod]
        } else if matches(&self.external, name) {
            // tc first: what XDP passes on must find its program there.
            match (self.xdp, self.ext_egress) {
                (true, true) => &[
                    IfaceKind::ExternalEgress,
                    IfaceKind::External,
                    IfaceKind::ExternalXdp,
                ],
                (true, false) => &[IfaceKind::External, IfaceKind::ExternalXdp],
                (false, true) => &[IfaceKind::ExternalEgress, IfaceKind::External],
                (false, false) => &[IfaceKind::External],
            }
        } else {
            &[]
        }
    }
}

fn on_new_link(attacher: &Mutex<Attacher>, patterns: &Patterns, msg: &LinkMessage) {
    let index = msg.header.index;
    let Some(name) = link_name(msg) else { return };
    let mut a = attacher.lock().expect("attacher lock");
    for &kind in patterns.kinds(name) {
        if a.is_attached(index, kind) {
            continue;
        }
        match a.attach(index, name, kind) {
            Ok(()) => match kind {
                IfaceKind::Pod => info!(interface = name, ifindex = index, "attached pod program"),
                IfaceKind::PodEgress | IfaceKind::ExternalEgress => {
                    debug!(interface = name, ifindex = index, "attached egress program")
                }
                IfaceKind::External => {
                    info!(
                        interface = name,
                        ifindex = index,
                        "attached external program"
                    )
                }
                IfaceKind::ExternalXdp => {
                    info!(
                        interface = name,
                        ifindex = index,
                        "attached external XDP program"
                    )
                }
            },
            // The interface may be gone already (a pod deleted right after creation).
            Err(e) => warn!(interface = name, ifindex = index, error = %e, "cannot attach"),
        }
    }
}

type LinkEvents = futures::channel::mpsc::UnboundedReceiver<(
    netlink_packet_core::NetlinkMessage<RouteNetlinkMessage>,
    netlink_sys::SocketAddr,
)>;

/// A netlink connection subscribed to link and address changes: its
/// handle lists what exists, its events (subscribed before listing, so that
/// nothing falls between the two) feed [`follow_links`].
fn subscribe() -> Result<(rtnetlink::Handle, LinkEvents), AgentError> {
    let (conn, handle, events) = new_multicast_connection(&[
        MulticastGroup::Link,
        MulticastGroup::Ipv4Ifaddr,
        MulticastGroup::Ipv6Ifaddr,
    ])
    .map_err(AgentError::Netlink)?;
    tokio::spawn(conn);
    Ok((handle, events))
}

/// Every interface now.
async fn list_links(handle: &rtnetlink::Handle) -> Vec<LinkMessage> {
    let mut out = Vec::new();
    let mut links = handle.link().get().execute();
    while let Some(msg) = links.next().await {
        match msg {
            Ok(msg) => out.push(msg),
            Err(e) => warn!(error = %e, "listing links"),
        }
    }
    out
}

/// Every address of every interface now.
async fn list_addresses(
    handle: &rtnetlink::Handle,
) -> Result<Vec<AddressMessage>, rtnetlink::Error> {
    let mut out = Vec::new();
    let mut addrs = handle.address().get().execute();
    while let Some(msg) = addrs.next().await {
        out.push(msg?);
    }
    Ok(out)
}

/// The interfaces' addresses now, external interfaces told by `links`'
/// names. A listing that fails leaves the InternalIPs alone as NodePort
/// addresses until the next one ([`follow_links`] lists again every
/// `syncPeriod`).
async fn interface_addresses(
    handle: &rtnetlink::Handle,
    patterns: &Patterns,
    links: &[LinkMessage],
) -> InterfaceAddresses {
    let mut table = InterfaceAddresses::default();
    for l in links {
        let external = link_name(l).is_some_and(|n| patterns.is_external(n));
        table.link(l.header.index, external);
    }
    match list_addresses(handle).await {
        Ok(msgs) => table.replace_addresses(&msgs),
        Err(e) => {
            warn!(error = %e, "cannot list the interfaces' addresses: NodePorts on the Node's InternalIPs only until the next listing")
        }
    }
    table
}

/// Publishes the external interfaces' addresses of `table` when they
/// changed, and says so.
fn publish_addresses(tx: &watch::Sender<BTreeSet<IpAddr>>, table: &InterfaceAddresses) {
    let now = table.external();
    tx.send_if_modified(|held| {
        if *held == now {
            return false;
        }
        info!(
            "node addresses changed: {}",
            crate::host::ifaddrs::describe_change(held, &now)
        );
        *held = now;
        true
    });
}

/// Attaches to interfaces as they appear; forgets them as they disappear.
/// Keeps `table`, the interfaces' addresses, from the same events, and
/// publishes the external interfaces' addresses on `addrs` when they
/// change; lists every address again each `relist` (messages a full socket
/// buffer lost are found then; a listing that fails waits for the next).
async fn follow_links(
    attacher: Arc<Mutex<Attacher>>,
    patterns: Patterns,
    mut events: LinkEvents,
    handle: rtnetlink::Handle,
    mut table: InterfaceAddresses,
    addrs: watch::Sender<BTreeSet<IpAddr>>,
    relist: Duration,
) {
    let mut relist = tokio::time::interval_at((Instant::now() + relist).into(), relist);
    relist.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            event = events.next() => {
                let Some((msg, _)) = event else { return };
                match msg.payload {
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(m)) => {
                        on_new_link(&attacher, &patterns, &m);
                        if let Some(name) = link_name(&m) {
                            table.link(m.header.index, patterns.is_external(name));
                        }
                    }
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(m)) => {
                        table.link_gone(m.header.index);
                        let mut a = attacher.lock().expect("attacher lock");
                        if a.has_links(m.header.index) {
                            a.detach(m.header.index);
                            info!(ifindex = m.header.index, "interface gone, link released");
                        }
                    }
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewAddress(m)) => {
                        table.address(&m, true)
                    }
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelAddress(m)) => {
                        table.address(&m, false)
                    }
                    _ => continue,
                }
            }
            _ = relist.tick() => match list_addresses(&handle).await {
                Ok(msgs) => table.replace_addresses(&msgs),
                Err(e) => warn!(error = %e, "cannot list the interfaces' addresses; tried again in a syncPeriod"),
            },
        }
        publish_addresses(&addrs, &table);
    }
}

/// What one sync writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SyncScope {
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
const RELEASE_AFTER: usize = 1_024;

/// One sync: read what changed in the source, compute the desired state of
/// the Services it concerns, write the difference.
fn sync_once(
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
    let mut node_cfg = obs
        .datapath
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

/// When the agent starts saying why its source is not ready, and how often.
const NOT_READY_HINT_AFTER: Duration = Duration::from_secs(5);
const NOT_READY_HINT_EVERY: Duration = Duration::from_secs(15);

/// Attaches the socket hooks for host clients to the configured cgroup, or
/// says in one line why host socket LB is off.
fn attach_socket_hooks(cfg: &Settings, sock_lb: &bpf::SockLbSupport, attacher: &Mutex<Attacher>) {
    let Some(cgroup) = &cfg.host_socket_lb else {
        info!("host socket load balancing off (hostSocketLB.enabled: false): the node's own clients do not reach Services through this agent");
        return;
    };
    if let Err(why) = &sock_lb.loaded {
        warn!(
            "host socket load balancing off: {why} (cgroup sock_addr hooks with getpeername need Linux 5.8)"
        );
        return;
    }
    match attacher
        .lock()
        .expect("attacher lock")
        .attach_cgroup(cgroup)
    {
        Ok(()) => {
            if sock_lb.netns_cookie == 0 {
                warn!("this kernel has no SO_NETNS_COOKIE (Linux 5.14): the socket hooks serve every network namespace, pods' sockets included");
            }
            if !sock_lb.set_retval {
                info!("this kernel has no bpf_set_retval (Linux 5.18): connect() to a Service without endpoints fails with EPERM instead of ECONNREFUSED");
            }
            info!(cgroup = %cgroup.display(), netns_cookie = sock_lb.netns_cookie, "attached the socket hooks for host clients");
        }
        Err(e) => {
            error!(error = %e, "cannot attach the socket hooks: the node's own clients do not reach Services")
        }
    }
}

/// The datapath's configuration: hairpin address, conntrack timeouts, the
/// SNAT port range `snat` and the delivery.
fn datapath_config(cfg: &Settings, snat: (u16, u16), via_stack: bool) -> Config {
    let mut c = Config::default()
        .with_hairpin_addr(cfg.hairpin_snat_ip)
        .with_delivery_via_stack(via_stack);
    let t = cfg.conntrack_timeouts;
    if let Some(s) = t.tcp_established_s {
        c.ct_tcp_established_s = s;
    }
    if let Some(s) = t.tcp_close_wait_s {
        c.ct_tcp_close_wait_s = s;
    }
    if let Some(s) = t.udp_s {
        c.ct_udp_s = s;
    }
    if let Some(s) = t.udp_stream_s {
        c.ct_udp_stream_s = s;
    }
    (c.snat_port_min, c.snat_port_max) = snat;
    c
}

/// Whether translated packets go through the host's stack: `stack`, or
/// `auto` with a NetworkPolicy engine's chains in the host's netfilter. When
/// the chains cannot be listed, `auto` chooses the stack: never bypass a
/// policy that may be there.
fn delivery_via_stack(mode: crate::config::DeliveryMode) -> bool {
    use crate::config::DeliveryMode;
    match mode {
        DeliveryMode::Redirect => false,
        DeliveryMode::Stack => true,
        DeliveryMode::Auto => match crate::host::netfilter::chains() {
            Ok(chains) => match crate::host::netfilter::policy_engine(&chains) {
                Some(engine) => {
                    debug!(engine, "a NetworkPolicy engine filters forwarded traffic: delivering through the stack");
                    true
                }
                None => false,
            },
            Err(e) => {
                warn!(error = %e, "cannot list the host's iptables/nftables chains: delivering through the stack, so that no NetworkPolicy there is bypassed (deliveryMode: redirect skips this)");
                true
            }
        },
    }
}

/// Lists the kernel's destination-NATed flows in the handover maps
/// ([`crate::host::handover`]); a failure costs those flows their backend, so it
/// is logged, and the agent goes on.
fn hand_over(pin_dir: &std::path::Path, when: &str) {
    match crate::host::handover::hand_over(pin_dir) {
        Ok((0, 0)) => debug!(when, "no flow of the kernel's conntrack to hand over"),
        Ok((v4, v6)) => info!(
            when,
            ipv4 = v4,
            ipv6 = v6,
            "flows the kernel's conntrack translated (kube-proxy's) left to it"
        ),
        Err(e) => {
            warn!(when, error = %e, "cannot hand over the kernel's translated flows: a connection kube-proxy translated may be reset")
        }
    }
}

/// Runs until SIGTERM or SIGINT; then detaches from every interface. The pinned
/// maps stay, so a restarted agent adopts conntrack and ids.
pub async fn run(cfg: Settings, mut source: Box<dyn Source>) -> Result<(), AgentError> {
    match crate::host::privileges::ensure_memlock() {
        Ok(what) => info!("{what}"),
        Err(what) => warn!("{what}"),
    }
    let mut loaded = bpf::load(&cfg.bpffs, cfg.map_sizes)?;
    info!(pin_dir = %loaded.pin_dir.display(), "datapath loaded");
    let mut dp = BpfDataplane::new(&mut loaded.ebpf, cfg.map_sizes)?;
    let local_ports = crate::host::local_port_range().map_err(|e| {
        AgentError::Setting(format!("cannot read the host's ip_local_port_range: {e}"))
    })?;
    let snat =
        crate::config::snat_ports(cfg.snat_port_range, local_ports).map_err(AgentError::Setting)?;
    let via_stack = delivery_via_stack(cfg.delivery_mode);
    info!(
        snat_ports = %format!("{}-{}", snat.0, snat.1),
        ip_local_port_range = %format!("{}-{}", local_ports.0, local_ports.1),
        delivery = if via_stack { "stack" } else { "redirect" },
        mode = ?cfg.delivery_mode,
        "datapath settings"
    );
    let datapath = datapath_config(&cfg, snat, via_stack);
    dp.set_config(datapath)?;
    let mut writer = Writer::adopt(dp)?.with_maglev(cfg.maglev);

    let health = Arc::new(Health::new(Health::timeout_for(cfg.sync_period)));
    let proxy_health = health.clone();
    let mut obs = Observers {
        health,
        metrics: Arc::new(Metrics::new(Some(loaded.pin_dir.clone()))),
        latency: ProgrammingLatency::default(),
        datapath,
        delivery_checked: Instant::now(),
        health_checks: crate::serve::health_check_node_ports::HealthCheckServers::default()
            .with_proxy_health(move || proxy_health.status().healthy),
        udp_backends: BTreeMap::new(),
        sock_revnat: None,
    };
    let sock_lb = loaded.sock_lb.clone();
    if cfg.host_socket_lb.is_some() && sock_lb.loaded.is_ok() {
        match SockRevNatMaps::open(&loaded.pin_dir) {
            Ok(m) => obs.sock_revnat = Some(m),
            Err(e) => warn!(error = %e, "cannot open the socket-level reverse-NAT map"),
        }
    }
    obs.metrics.set_map_capacity(&cfg.map_sizes);
    let mut servers = Vec::new();
    if let Some(addr) = cfg.healthz_bind_address {
        let router = endpoints::health_router(obs.health.clone());
        servers.extend(endpoints::spawn("healthz", addr, router).await);
    }
    if let Some(addr) = cfg.metrics_bind_address {
        let router = endpoints::metrics_router(obs.metrics.clone());
        servers.extend(endpoints::spawn("metrics", addr, router).await);
    }

    let (tx, mut changes) = mpsc::unbounded_channel();
    source.start(tx)?;
    // Never act on a half-filled cache. Say why, within seconds, while the
    // source is not ready (an unreachable API server names its address and
    // the setting that fixes it).
    let waiting = Instant::now();
    let mut hint = tokio::time::interval_at(
        (waiting + NOT_READY_HINT_AFTER).into(),
        NOT_READY_HINT_EVERY,
    );
    while !source.ready() {
        tokio::select! {
            c = changes.recv() => if c.is_none() {
                return Err(SourceError::Other("the source stopped before it was ready".into()).into());
            },
            _ = hint.tick() => {
                if let Some(h) = source.not_ready_hint(waiting.elapsed()) {
                    error!("{h}");
                }
            }
        }
    }
    let xdp_loaded = match &loaded.xdp {
        Ok(()) => true,
        Err(why) => {
            if cfg.acceleration == crate::config::Acceleration::Xdp {
                warn!(
                    "--acceleration xdp: XDP acceleration off: {why}; external traffic stays on tc"
                );
            }
            false
        }
    };
    let patterns = Patterns {
        pod: cfg.pod_interfaces.clone(),
        external: cfg.external_interfaces.clone(),
        xdp: cfg.acceleration == crate::config::Acceleration::Xdp && xdp_loaded,
        ext_egress: cfg.delivery_mode != crate::config::DeliveryMode::Redirect,
    };
    // The interfaces, and the external ones' addresses (NodePort
    // candidates), subscribed to before they are listed.
    let (netlink, events) = subscribe()?;
    let links_now = list_links(&netlink).await;
    let ifaces = interface_addresses(&netlink, &patterns, &links_now).await;
    let (addrs_tx, mut addrs) = watch::channel(ifaces.external());
    info!(
        "node addresses on the external interfaces: {}",
        addrs
            .borrow()
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    );
    obs.metrics.set_source_ready(true);
    // Program the maps before attaching, so the first packets find them.
    let mut model = model::Incremental::new(
        &cfg.node_name,
        ModelOptions {
            service_proxy_name: cfg.service_proxy_name.clone(),
            node_port_addresses: cfg.node_port_addresses.clone(),
            localhost_node_ports: cfg.localhost_node_ports,
            lb_algorithm: cfg.lb_algorithm,
            frontend_policy: cfg.frontend_policy.clone(),
            ..ModelOptions::default()
        },
    );
    model.set_interface_addresses(addrs.borrow_and_update().iter().copied());
    sync_once(
        &cfg,
        source.as_mut(),
        &mut model,
        &mut writer,
        &mut obs,
        SyncScope::Initial,
    );
    let mut last_sync = Instant::now();

    let tc_mode = crate::bpf::resolve_tc_mode(cfg.tc_attach_mode, crate::bpf::kernel_has_tcx())
        .map_err(|reason| crate::bpf::BpfError::Link {
            name: "tc programs",
            reason,
        })?;
    // Maps of an older layout: what its programs wrote since the load is
    // copied again now that ours take over.
    loaded.finish_migrations();
    // Flows the kernel translated (kube-proxy's) stay the kernel's: listed
    // before the programs see their packets, and again once attached (flows
    // kube-proxy opened meanwhile).
    hand_over(&loaded.pin_dir, "before attaching");
    info!(mode = %tc_mode, "attaching tc programs");
    let attacher = Arc::new(Mutex::new(Attacher::new(
        loaded.ebpf,
        &loaded.pin_dir,
        tc_mode,
        loaded.port_search,
    )?));
    for l in &links_now {
        on_new_link(&attacher, &patterns, l);
    }
    attach_socket_hooks(&cfg, &sock_lb, &attacher);
    attacher.lock().expect("attacher lock").prune_pins();
    hand_over(&loaded.pin_dir, "after attaching");
    let links = tokio::spawn(follow_links(
        attacher.clone(),
        patterns,
        events,
        netlink,
        ifaces,
        addrs_tx,
        cfg.sync_period,
    ));
    // Ready: maps programmed and every existing interface attached.
    info!("{SYNC_COMPLETE}: initial state programmed, programs attached");
    obs.health.set_ready();

    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(AgentError::Signal)?;
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(AgentError::Signal)?;
    let mut pending = false;
    let mut result = Ok(());
    // Conntrack GC off this loop: bounded rounds on a thread of its own.
    let ct_gc = match bpf::ConntrackGc::open(&cfg.bpffs) {
        Ok(gc) => Some(gc.spawn(CT_GC_INTERVAL)),
        Err(e) => {
            error!(error = %e, "conntrack garbage collection off: cannot open the pinned maps");
            None
        }
    };
    loop {
        // kube-proxy's minSyncPeriod: a change right after a sync waits for the
        // rest of the period; one after a quiet period is applied at once.
        let wake = if pending {
            last_sync + cfg.min_sync_period
        } else {
            last_sync + cfg.sync_period
        };
        tokio::select! {
            _ = tokio::time::sleep_until(wake.into()) => {
                obs.metrics.set_source_ready(source.ready());
                if source.ready() {
                    // Signals already queued are for changes this sync
                    // reads (a source updates what it holds, then
                    // signals): left queued, they would make a second,
                    // empty sync that moves the minSyncPeriod window, so
                    // that a change a moment later waits for it.
                    while changes.try_recv().is_ok() {}
                    model.set_interface_addresses(addrs.borrow_and_update().iter().copied());
                    // A change is written alone; a period without one
                    // compares everything (kube-proxy's syncPeriod).
                    let scope = if pending { SyncScope::Changes } else { SyncScope::Full };
                    sync_once(&cfg, source.as_mut(), &mut model, &mut writer, &mut obs, scope);
                }
                last_sync = Instant::now();
                pending = false;
            }
            Some(()) = changes.recv() => {
                debug!("source changed");
                obs.health.queued_update();
                pending = true;
            }
            // The external interfaces' addresses changed (logged where
            // seen): the next sync computes the NodePorts again.
            Ok(()) = addrs.changed() => {
                obs.health.queued_update();
                pending = true;
            }
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
        if links.is_finished() {
            result = Err(AgentError::LinkWatcherStopped);
            break;
        }
    }
    links.abort();
    if let Some((stop, gc)) = ct_gc {
        drop(stop);
        let _ = gc.join();
    }
    for s in servers {
        s.abort();
    }
    obs.health_checks.shutdown();
    match cfg.on_exit {
        crate::config::OnExit::Detach => {
            attacher.lock().expect("attacher lock").detach_all();
            info!("detached; maps stay pinned under {}", cfg.bpffs.display());
        }
        crate::config::OnExit::Keep => {
            attacher.lock().expect("attacher lock").release_all();
            info!(
                "exiting with the datapath attached (--on-exit keep); pins under {}",
                cfg.bpffs.display()
            );
        }
        crate::config::OnExit::Drain => {
            match crate::host::handover::set_draining(&loaded.pin_dir) {
                Ok(()) => {
                    attacher.lock().expect("attacher lock").release_all();
                    info!(
                    "exiting with the datapath draining (--on-exit drain): tracked flows stay translated, new ones go to the host's stack; run `proxy-agent cleanup --bpffs {}` once they have ended",
                    cfg.bpffs.display()
                );
                }
                Err(e) => {
                    attacher.lock().expect("attacher lock").detach_all();
                    error!(error = %e, "cannot set the datapath draining: detached instead");
                }
            }
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn table(rows: &[(&str, &[&str])]) -> BTreeMap<SocketAddr, BTreeSet<SocketAddr>> {
        rows.iter()
            .map(|(fe, bes)| (sa(fe), bes.iter().map(|b| sa(b)).collect()))
            .collect()
    }

    /// A backend that leaves one UDP frontend is a gone pair of that
    /// frontend even while it still backs another (the oracle's C2/K1:
    /// web-1 leaves `k1` and stays in `web`); a frontend that goes takes
    /// all its pairs; an unchanged frontend and a backend that arrives give
    /// none.
    #[test]
    fn gone_udp_pairs_are_per_frontend() {
        let before = table(&[
            ("198.19.0.10:80", &["198.18.1.1:80", "198.18.1.2:80"]),
            ("198.19.0.11:80", &["198.18.1.1:80"]),
            ("198.19.0.12:53", &["198.18.1.3:53"]),
            ("[2001:2:0:ff::10]:80", &["[2001:2:0:1::1]:80"]),
        ]);
        let now = table(&[
            ("198.19.0.10:80", &["198.18.1.1:80", "198.18.1.2:80"]),
            ("198.19.0.11:80", &["198.18.1.2:80"]),
            (
                "[2001:2:0:ff::10]:80",
                &["[2001:2:0:1::1]:80", "[2001:2:0:1::2]:80"],
            ),
        ]);
        let gone = gone_udp_pairs(&before, &now);
        assert_eq!(
            gone,
            [
                (sa("198.19.0.11:80"), sa("198.18.1.1:80")),
                (sa("198.19.0.12:53"), sa("198.18.1.3:53")),
            ]
            .into_iter()
            .collect()
        );
        assert!(gone_udp_pairs(&now, &now).is_empty());
    }
}

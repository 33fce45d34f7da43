//! Starting: the datapath loaded and configured, the socket hooks
//! attached, the kube-proxy handover.
use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Instant,
};

use proxy_common::Config;
use tokio::{sync::watch, task::JoinHandle};
use tracing::{debug, error, info, warn};

use crate::{
    bpf::{self, Attacher, BpfDataplane},
    config::Settings,
    dataplane::Writer,
    metrics::Metrics,
    model::{self, ModelOptions},
    serve::{endpoints, health::Health},
    sources::Source,
};

use super::{
    links::{self, Patterns},
    sync::{sync_once, Observers, SyncScope},
    udp_flows::SockRevNatMaps,
    AgentError, CT_GC_INTERVAL, SYNC_COMPLETE,
};

/// The datapath loaded and configured, before anything is attached.
pub(super) struct Started {
    pub(super) writer: Writer<BpfDataplane>,
    pub(super) obs: Observers,
    /// Where the maps and links are pinned.
    pub(super) pin_dir: PathBuf,
}

/// What runs once the programs are attached.
pub(super) struct Running {
    pub(super) attacher: Arc<Mutex<Attacher>>,
    /// The interface watcher ([`links::follow_links`]).
    pub(super) links: JoinHandle<()>,
    pub(super) model: model::Incremental,
    /// The external interfaces' addresses, as the watcher sees them.
    pub(super) addrs: watch::Receiver<std::collections::BTreeSet<std::net::IpAddr>>,
    pub(super) last_sync: Instant,
    /// The conntrack garbage collector's stop signal and thread.
    pub(super) ct_gc: Option<(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>)>,
}

/// Loads (or adopts) the pinned datapath, writes its configuration (the
/// SNAT ports beside the host's, the delivery mode), and makes the writer
/// and what a sync reports to. Returns them with what [`attach`] attaches.
pub(super) fn load(cfg: &Settings) -> Result<(Started, bpf::Loaded), AgentError> {
    match crate::host::privileges::ensure_memlock() {
        Ok(what) => info!("{what}"),
        Err(what) => warn!("{what}"),
    }
    let (host_dev, service_routes) = host_device(cfg).unzip();
    let mut loaded = bpf::load_with_host_device(&cfg.bpffs, cfg.map_sizes, host_dev)?;
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
    let datapath = datapath_config(cfg, snat, via_stack);
    dp.set_config(datapath)?;
    let writer = Writer::adopt(dp)?.with_maglev(cfg.maglev);

    let health = Arc::new(Health::new(Health::timeout_for(cfg.sync_period)));
    let proxy_health = health.clone();
    let mut obs = Observers {
        health,
        metrics: Arc::new(Metrics::new(Some(loaded.pin_dir.clone()))),
        latency: Default::default(),
        datapath,
        delivery_checked: Instant::now(),
        health_checks: crate::serve::health_check_node_ports::HealthCheckServers::default()
            .with_proxy_health(move || proxy_health.status().healthy),
        udp_backends: BTreeMap::new(),
        sock_revnat: None,
        service_routes,
        host_device: host_dev,
    };
    if cfg.host_socket_lb.is_some() && loaded.sock_lb.loaded.is_ok() {
        match SockRevNatMaps::open(&loaded.pin_dir) {
            Ok(m) => obs.sock_revnat = Some(m),
            Err(e) => warn!(error = %e, "cannot open the socket-level reverse-NAT map"),
        }
    }
    obs.metrics.set_map_capacity(&cfg.map_sizes);
    let started = Started {
        writer,
        obs,
        pin_dir: loaded.pin_dir.clone(),
    };
    Ok((started, loaded))
}

/// The host-client device, made ready, and its routes as found, when host
/// clients' UDP to ClusterIPs is to be translated per packet (socket LB on,
/// `udpPerPacket`); `None` otherwise, or when either cannot be had (UDP is
/// then aimed at `connect()`, as before, and the log says why).
fn host_device(
    cfg: &Settings,
) -> Option<(
    crate::host::svc_device::HostDevice,
    crate::host::svc_device::ServiceRoutes,
)> {
    use crate::host::svc_device::{ensure, ServiceRoutes};
    if cfg.host_socket_lb.is_none() || !cfg.host_udp_per_packet {
        return None;
    }
    // The routes are read before the programs learn of the device: without
    // them the hooks must keep aiming UDP at connect().
    match ensure().and_then(|d| Ok((d, ServiceRoutes::open(d)?))) {
        Ok((d, routes)) => {
            info!(
                device = proxy_common::HOST_DEV_NAME,
                ifindex = d.ifindex,
                peer = proxy_common::HOST_PEER_NAME,
                peer_ifindex = d.peer_ifindex,
                routed = routes.len(),
                "host clients' UDP to ClusterIPs is translated per packet"
            );
            Some((d, routes))
        }
        Err(e) => {
            error!(
                error = %e,
                "cannot make the host-client device or read its routes: host clients' UDP to ClusterIPs is aimed at connect() instead"
            );
            None
        }
    }
}

/// The `/healthz`, `/metrics` and probe servers (each unless disabled).
pub(super) fn serve_endpoints(cfg: &Settings, obs: &Observers) -> Vec<JoinHandle<()>> {
    let mut servers = Vec::new();
    if let Some(addr) = cfg.healthz_bind_address {
        let router = endpoints::health_router(obs.health.clone());
        servers.push(endpoints::spawn("healthz", addr, router));
    }
    if let Some(addr) = cfg.metrics_bind_address {
        let router = endpoints::metrics_router(obs.metrics.clone());
        servers.push(endpoints::spawn("metrics", addr, router));
    }
    if let Some(addr) = cfg.probe_bind_address {
        let router = endpoints::health_router(obs.health.clone());
        servers.push(endpoints::spawn("probes", addr, router));
    }
    servers
}

/// Once the source is ready: the first sync (the maps programmed before the
/// programs are attached, so the first packets find them), then every
/// interface and the socket hooks attached, the interface watcher started,
/// the conntrack collector started; the agent is ready.
pub(super) async fn attach(
    cfg: &Settings,
    source: &mut dyn Source,
    started: &mut Started,
    mut loaded: bpf::Loaded,
) -> Result<Running, AgentError> {
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
        host_peer: started.obs.host_device.is_some(),
    };
    // The interfaces, and the external ones' addresses (NodePort
    // candidates), subscribed to before they are listed.
    let (netlink, events) = links::subscribe()?;
    let links_now = links::list_links(&netlink).await;
    let ifaces = links::interface_addresses(&netlink, &patterns, &links_now).await;
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
    started.obs.metrics.set_source_ready(true);
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
        cfg,
        source,
        &mut model,
        &mut started.writer,
        &mut started.obs,
        SyncScope::Initial,
    );
    let last_sync = Instant::now();

    let tc_mode = crate::bpf::resolve_tc_mode(cfg.tc_attach_mode, crate::bpf::kernel_has_tcx())
        .map_err(|reason| crate::bpf::BpfError::Link {
            name: "tc programs",
            reason,
        })?;
    // Maps of an older layout: what its programs wrote since the load is
    // copied again now that ours take over.
    loaded.finish_migrations();
    // Flows the kernel translated (kube-proxy's) stay the kernel's: listed
    // before the programs see their packets, and again once attached. On a
    // node kube-proxy serves, the datapath drains until then: a flow
    // kube-proxy opens meanwhile (its SYN before the programs attach, its
    // ACK after) is passed to the stack and listed by the datapath itself,
    // instead of being given a backend of ours midway (and reset).
    let kube_proxy = kube_proxy_present();
    if kube_proxy.is_some() {
        set_draining(started, true);
    }
    let handed_before = hand_over(&loaded.pin_dir, "before attaching");
    info!(mode = %tc_mode, "attaching tc programs");
    let attacher = Arc::new(Mutex::new(Attacher::new(
        loaded.ebpf,
        &loaded.pin_dir,
        tc_mode,
        loaded.port_search,
    )?));
    for l in &links_now {
        links::on_new_link(&attacher, &patterns, l);
    }
    attach_socket_hooks(cfg, &loaded.sock_lb, &attacher);
    attacher.lock().expect("attacher lock").prune_pins();
    let handed_after = hand_over(&loaded.pin_dir, "after attaching");
    hold_conntrack(&loaded.pin_dir, handed_before.max(handed_after));
    if let Some(mode) = kube_proxy {
        set_draining(started, false);
        info!(
            kube_proxy = mode,
            "taking the node over from kube-proxy: its flows stay its, new flows are ours"
        );
    }
    let links = tokio::spawn(links::follow_links(
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
    started.obs.health.set_ready();
    // Conntrack GC off the sync loop: bounded rounds on a thread of its own.
    let ct_gc = match bpf::ConntrackGc::open(&cfg.bpffs) {
        Ok(gc) => Some(gc.spawn(CT_GC_INTERVAL)),
        Err(e) => {
            error!(error = %e, "conntrack garbage collection off: cannot open the pinned maps");
            None
        }
    };
    Ok(Running {
        attacher,
        links,
        model,
        addrs,
        last_sync,
        ct_gc,
    })
}

/// Attaches the socket hooks for host clients to the configured cgroup, or
/// says in one line why host socket LB is off.
pub(super) fn attach_socket_hooks(
    cfg: &Settings,
    sock_lb: &bpf::SockLbSupport,
    attacher: &Mutex<Attacher>,
) {
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
pub(super) fn datapath_config(cfg: &Settings, snat: (u16, u16), via_stack: bool) -> Config {
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
pub(super) fn delivery_via_stack(mode: crate::config::DeliveryMode) -> bool {
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

/// kube-proxy's mode, when its chains are in the host's netfilter.
fn kube_proxy_present() -> Option<&'static str> {
    match crate::host::netfilter::chains() {
        Ok(chains) => crate::host::netfilter::kube_proxy(&chains),
        Err(e) => {
            warn!(error = %e, "cannot list the host's iptables/nftables chains: if kube-proxy serves this node, a connection it opens while the programs attach may be reset");
            None
        }
    }
}

/// Sets or clears `DRAINING` in the datapath's configuration (while the
/// programs attach on a node kube-proxy serves).
fn set_draining(started: &mut Started, on: bool) {
    let c = started.obs.datapath.with_draining(on);
    match started.writer.dataplane_mut().set_config(c) {
        Ok(()) => started.obs.datapath = c,
        Err(e) => error!(error = %e, draining = on, "cannot update the datapath configuration"),
    }
}

/// Lists the kernel's destination-NATed flows in the handover maps
/// ([`crate::host::handover`]); a failure costs those flows their backend, so it
/// is logged, and the agent goes on. Returns how many flows were listed.
pub(super) fn hand_over(pin_dir: &std::path::Path, when: &str) -> usize {
    match crate::host::handover::hand_over(pin_dir) {
        Ok(n) if n.ipv4 + n.ipv6 == 0 => {
            debug!(when, "no flow of the kernel's conntrack to hand over");
            0
        }
        Ok(n) => {
            info!(
                when,
                ipv4 = n.ipv4,
                ipv6 = n.ipv6,
                masqueraded = n.masqueraded,
                "flows the kernel's conntrack translated (kube-proxy's) left to it, \
                 their node ports kept from SNAT"
            );
            n.ipv4 + n.ipv6
        }
        Err(e) => {
            warn!(when, error = %e, "cannot hand over the kernel's translated flows: a connection kube-proxy translated may be reset");
            0
        }
    }
}

/// How often the agent asks whether flows handed over to the kernel are
/// left, while it keeps the kernel's conntrack running for them.
const CONNTRACK_HOLD_CHECK: std::time::Duration = std::time::Duration::from_secs(60);

/// Keeps the kernel's conntrack running while flows are handed over to it
/// ([`crate::host::conntrack_hold`]), and lets it go once none is left
/// ([`crate::host::handover::live_flows`], every [`CONNTRACK_HOLD_CHECK`]).
/// With none handed over now, a hold an earlier agent left goes at once.
fn hold_conntrack(pin_dir: &std::path::Path, handed_over: usize) {
    use crate::host::conntrack_hold::{self, TABLE};
    let release = |why: &str| match conntrack_hold::release() {
        Ok(true) => info!(
            table = TABLE,
            "{why}: the kernel's conntrack is no longer held on"
        ),
        Ok(false) => {}
        Err(e) => {
            warn!(table = TABLE, error = %e, "cannot remove the nftables table that holds the kernel's conntrack on")
        }
    };
    if handed_over == 0 {
        release("no flow handed over to the kernel");
        return;
    }
    if let Err(e) = conntrack_hold::hold() {
        warn!(error = %e, "cannot keep the kernel's conntrack running for the flows handed over: where nothing else uses it, they are lost once kube-proxy's rules are removed");
        return;
    }
    info!(
        table = TABLE,
        flows = handed_over,
        "the kernel's conntrack and NAT are kept running for the flows handed over, until they end (an nftables table of the agent's: a conntrack rule no hook calls, and empty nat chains only a new kernel entry's first packet walks)"
    );
    let pin_dir = pin_dir.to_path_buf();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(CONNTRACK_HOLD_CHECK);
        tick.tick().await;
        loop {
            tick.tick().await;
            let dir = pin_dir.clone();
            match tokio::task::spawn_blocking(move || crate::host::handover::live_flows(&dir)).await
            {
                Ok(Ok(0)) => {
                    release("every flow handed over to the kernel has ended");
                    return;
                }
                Ok(Ok(n)) => debug!(flows = n, "flows handed over to the kernel still live"),
                Ok(Err(e)) => {
                    warn!(error = %e, "cannot tell whether flows handed over to the kernel are left: its conntrack stays held on")
                }
                Err(_) => return,
            }
        }
    });
}

//! The node's interfaces as they come and go (rtnetlink): which programs
//! each gets, and the external interfaces' addresses, the NodePort
//! candidates.
use std::{
    collections::BTreeSet,
    net::IpAddr,
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
use rtnetlink::{new_multicast_connection, MulticastGroup};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::{
    bpf::{Attacher, IfaceKind},
    host::ifaddrs::InterfaceAddresses,
};

use super::AgentError;

pub(super) fn matches(patterns: &[glob::Pattern], name: &str) -> bool {
    patterns.iter().any(|p| p.matches(name))
}

pub(super) fn link_name(msg: &LinkMessage) -> Option<&str> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.as_str()),
        _ => None,
    })
}

/// Which programs an interface gets, by name: pod interfaces first.
#[derive(Clone)]
pub(super) struct Patterns {
    pub(super) pod: Vec<glob::Pattern>,
    pub(super) external: Vec<glob::Pattern>,
    pub(super) xdp: bool,
    /// The reply program at tc egress of external devices too, where flows
    /// delivered through the stack get their reverse NAT (`deliveryMode`
    /// auto or stack).
    pub(super) ext_egress: bool,
    /// The pod program at tc ingress of the host-client device's peer
    /// ([`crate::host::svc_device`]).
    pub(super) host_peer: bool,
}

impl Patterns {
    /// Whether `name` is an external device (a pod interface is not, even
    /// if the external patterns match it too).
    fn is_external(&self, name: &str) -> bool {
        !matches(&self.pod, name) && matches(&self.external, name)
    }

    fn kinds(&self, name: &str) -> &'static [IfaceKind] {
        if self.host_peer && crate::host::svc_device::is_peer(name) {
            // The node's own UDP to ClusterIPs, translated as a pod's.
            &[IfaceKind::Pod]
        } else if matches(&self.pod, name) {
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

pub(super) fn on_new_link(attacher: &Mutex<Attacher>, patterns: &Patterns, msg: &LinkMessage) {
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

pub(super) type LinkEvents = futures::channel::mpsc::UnboundedReceiver<(
    netlink_packet_core::NetlinkMessage<RouteNetlinkMessage>,
    netlink_sys::SocketAddr,
)>;

/// A netlink connection subscribed to link and address changes: its
/// handle lists what exists, its events (subscribed before listing, so that
/// nothing falls between the two) feed [`follow_links`].
pub(super) fn subscribe() -> Result<(rtnetlink::Handle, LinkEvents), AgentError> {
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
pub(super) async fn list_links(handle: &rtnetlink::Handle) -> Vec<LinkMessage> {
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
pub(super) async fn list_addresses(
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
pub(super) async fn interface_addresses(
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
pub(super) fn publish_addresses(tx: &watch::Sender<BTreeSet<IpAddr>>, table: &InterfaceAddresses) {
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
pub(super) async fn follow_links(
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

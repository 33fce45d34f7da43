//! The host-client device: how the node's own UDP to a ClusterIP is
//! translated per packet, as kube-proxy's OUTPUT chain does, instead of at
//! `connect()` by the socket hooks.
//!
//! The agent owns a veth pair in the node's network namespace,
//! [`HOST_DEV_NAME`] and its peer [`HOST_PEER_NAME`], and routes every
//! ClusterIP (a /32 or /128 in the main table, protocol
//! [`ROUTE_PROTOCOL`]) to the first. A host client's datagram to a
//! ClusterIP leaves through it, and the pod program at tc ingress of the
//! peer translates it as it translates a pod's (conntrack, DNAT, delivery
//! by redirect). A reply, its source back to the ClusterIP, is injected at
//! the device's ingress, where the route to the ClusterIP points, so that a
//! strict reverse-path filter takes it (`fib::to_host` in the datapath).
//! The device has ARP off and a fixed MAC ([`HOST_DEV_MAC`]): what the peer
//! receives untranslated is not addressed to it and goes no further.
//!
//! The pair and its routes outlive the agent across restarts (the flows
//! through it are pinned conntrack entries, as pod flows are); `--on-exit
//! detach` and `proxy-agent cleanup` delete the pair, and its routes with
//! it.
use std::{
    collections::BTreeSet,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use netlink_packet_core::{
    ErrorMessage, NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE,
    NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST,
};
use netlink_packet_route::{
    link::LinkMessage,
    route::{RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope},
    AddressFamily, RouteNetlinkMessage,
};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use proxy_common::{HOST_DEV_MAC, HOST_DEV_NAME, HOST_PEER_NAME};
use rtnetlink::{LinkUnspec, LinkVeth, RouteMessageBuilder};

/// The routing protocol the agent's ClusterIP routes carry (`ip route show
/// proto 222`): how it tells its routes from anyone else's.
pub const ROUTE_PROTOCOL: u8 = 222;

/// Requests sent before their acknowledgements are read.
const BATCH: usize = 256;

/// The pair, by ifindex.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostDevice {
    /// [`HOST_DEV_NAME`]: where the ClusterIPs are routed, and replies
    /// injected.
    pub ifindex: u32,
    /// [`HOST_PEER_NAME`]: where the pod program translates.
    pub peer_ifindex: u32,
}

/// A blocking rtnetlink socket: requests acknowledged one batch at a time.
struct Rtnl {
    socket: Socket,
    seq: u32,
}

impl Rtnl {
    fn open() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self { socket, seq: 0 })
    }

    fn encode(&mut self, msg: RouteNetlinkMessage, flags: u16, out: &mut Vec<u8>) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.seq;
        let mut m = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        m.finalize();
        let at = out.len();
        out.resize(at + m.buffer_len(), 0);
        m.serialize(&mut out[at..]);
        self.seq
    }

    /// Sends `msgs` (each with `flags` and an ACK asked for) and returns
    /// each one's outcome, in order.
    fn requests(
        &mut self,
        msgs: Vec<RouteNetlinkMessage>,
        flags: u16,
    ) -> io::Result<Vec<io::Result<()>>> {
        let mut outcomes = Vec::with_capacity(msgs.len());
        let mut it = msgs.into_iter().peekable();
        while it.peek().is_some() {
            let mut buf = Vec::new();
            let mut first = None;
            let mut n = 0;
            for msg in it.by_ref().take(BATCH) {
                let seq = self.encode(msg, flags | NLM_F_REQUEST | NLM_F_ACK, &mut buf);
                first.get_or_insert(seq);
                n += 1;
            }
            self.socket.send(&buf, 0)?;
            let first = first.unwrap_or(0);
            let mut got: Vec<Option<io::Result<()>>> = (0..n).map(|_| None).collect();
            let mut left = n;
            let mut rx = vec![0u8; 1 << 16];
            while left > 0 {
                let len = self.socket.recv(&mut &mut rx[..], 0)?;
                if len == 0 {
                    return Err(io::Error::other("rtnetlink closed"));
                }
                each_message(&rx[..len], |m| {
                    if let NetlinkPayload::Error(e) = m.payload {
                        let i = m.header.sequence_number.wrapping_sub(first) as usize;
                        if let Some(slot @ None) = got.get_mut(i) {
                            *slot = Some(nack(&e).map_or(Ok(()), Err));
                            left -= 1;
                        }
                    }
                })?;
            }
            outcomes.extend(got.into_iter().map(|o| o.unwrap_or(Ok(()))));
        }
        Ok(outcomes)
    }

    fn request(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<()> {
        self.requests(vec![msg], flags)?
            .pop()
            .unwrap_or_else(|| Err(io::Error::other("no answer")))
    }

    /// Every message a dump request `msg` answers with.
    fn dump(&mut self, msg: RouteNetlinkMessage) -> io::Result<Vec<RouteNetlinkMessage>> {
        let mut buf = Vec::new();
        self.encode(msg, NLM_F_REQUEST | NLM_F_DUMP, &mut buf);
        self.socket.send(&buf, 0)?;
        let mut out = Vec::new();
        let mut rx = vec![0u8; 1 << 16];
        loop {
            let len = self.socket.recv(&mut &mut rx[..], 0)?;
            if len == 0 {
                return Ok(out);
            }
            let mut done = false;
            let mut err = None;
            each_message(&rx[..len], |m| match m.payload {
                NetlinkPayload::Done(_) => done = true,
                NetlinkPayload::Error(e) => err = nack(&e),
                NetlinkPayload::InnerMessage(inner) => out.push(inner),
                _ => {}
            })?;
            if let Some(e) = err {
                return Err(e);
            }
            if done {
                return Ok(out);
            }
        }
    }

    fn link_index(&mut self, name: &str) -> io::Result<Option<u32>> {
        let get = LinkUnspec::new_with_name(name).build();
        match self.request_link(get) {
            Ok(index) => Ok(Some(index)),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// RTM_GETLINK of one link: its ifindex.
    fn request_link(&mut self, msg: LinkMessage) -> io::Result<u32> {
        let mut buf = Vec::new();
        self.encode(RouteNetlinkMessage::GetLink(msg), NLM_F_REQUEST, &mut buf);
        self.socket.send(&buf, 0)?;
        let mut rx = vec![0u8; 1 << 16];
        let len = self.socket.recv(&mut &mut rx[..], 0)?;
        let mut found = Err(io::Error::other("no answer to RTM_GETLINK"));
        each_message(&rx[..len], |m| match m.payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => {
                found = Ok(l.header.index)
            }
            NetlinkPayload::Error(e) => {
                found =
                    Err(nack(&e).unwrap_or_else(|| io::Error::other("empty answer to RTM_GETLINK")))
            }
            _ => {}
        })?;
        found
    }
}

/// The error an answer reports; `None` for an acknowledgement.
fn nack(e: &ErrorMessage) -> Option<io::Error> {
    e.code.map(|c| io::Error::from_raw_os_error(-c.get()))
}

/// Calls `f` on each netlink message in `buf`.
fn each_message(
    buf: &[u8],
    mut f: impl FnMut(NetlinkMessage<RouteNetlinkMessage>),
) -> io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        let m = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[off..])
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        let len = m.header.length as usize;
        f(m);
        if len == 0 {
            break;
        }
        off += (len + 3) & !3;
    }
    Ok(())
}

/// Writes `value` to `/proc/sys/net/<path>` if it exists (IPv6 may be off).
fn sysctl(path: &str, value: &str) {
    let p = format!("/proc/sys/net/{path}");
    if std::path::Path::new(&p).exists() {
        if let Err(e) = std::fs::write(&p, value) {
            tracing::debug!(path = %p, error = %e, "cannot set");
        }
    }
}

/// The pair, created if missing (a half left by an interrupted start is
/// replaced), configured and up.
pub fn ensure() -> io::Result<HostDevice> {
    let mut nl = Rtnl::open()?;
    let (dev, peer) = (
        nl.link_index(HOST_DEV_NAME)?,
        nl.link_index(HOST_PEER_NAME)?,
    );
    let (dev, peer) = match (dev, peer) {
        (Some(d), Some(p)) => (d, p),
        (d, p) => {
            for index in [d, p].into_iter().flatten() {
                let del = LinkUnspec::new_with_index(index).build();
                nl.request(RouteNetlinkMessage::DelLink(del), 0)?;
            }
            let veth = LinkVeth::new(HOST_DEV_NAME, HOST_PEER_NAME).build();
            nl.request(
                RouteNetlinkMessage::NewLink(veth),
                NLM_F_CREATE | NLM_F_EXCL,
            )?;
            let dev = nl.link_index(HOST_DEV_NAME)?;
            let peer = nl.link_index(HOST_PEER_NAME)?;
            match (dev, peer) {
                (Some(d), Some(p)) => (d, p),
                _ => return Err(io::Error::other("the veth pair vanished once created")),
            }
        }
    };
    // No router advertisements, DAD or addresses of its own on either end:
    // the pair carries only translated traffic.
    for name in [HOST_DEV_NAME, HOST_PEER_NAME] {
        sysctl(&format!("ipv6/conf/{name}/accept_ra"), "0");
        sysctl(&format!("ipv6/conf/{name}/accept_dad"), "0");
    }
    let set = LinkUnspec::new_with_index(dev)
        .address(HOST_DEV_MAC.to_vec())
        .arp(false)
        .up()
        .build();
    nl.request(RouteNetlinkMessage::SetLink(set), 0)?;
    let set = LinkUnspec::new_with_index(peer).up().build();
    nl.request(RouteNetlinkMessage::SetLink(set), 0)?;
    Ok(HostDevice {
        ifindex: dev,
        peer_ifindex: peer,
    })
}

/// Deletes the pair (its routes go with it); whether it was there.
pub fn remove() -> io::Result<bool> {
    let mut nl = Rtnl::open()?;
    let Some(index) = nl.link_index(HOST_DEV_NAME)? else {
        return Ok(false);
    };
    let del = LinkUnspec::new_with_index(index).build();
    nl.request(RouteNetlinkMessage::DelLink(del), 0)?;
    Ok(true)
}

/// Whether `name` is the link the link watcher attaches the pod program to
/// for host clients.
pub fn is_peer(name: &str) -> bool {
    name == HOST_PEER_NAME
}

/// The ClusterIP routes to the device, as programmed: kept in step with
/// the frontends a sync programs.
pub struct ServiceRoutes {
    nl: Rtnl,
    dev: u32,
    routed: BTreeSet<IpAddr>,
    /// The source the routes give host clients, per family (the node's
    /// address); `None` leaves the choice to the kernel.
    src: (Option<Ipv4Addr>, Option<Ipv6Addr>),
}

/// What a route change did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RouteReport {
    pub added: usize,
    pub removed: usize,
    /// Routes the kernel refused, with why (the first few).
    pub failed: Vec<(IpAddr, String)>,
}

impl ServiceRoutes {
    /// The routes to `dev` of [`ROUTE_PROTOCOL`] already there (a previous
    /// agent's), read.
    pub fn open(device: HostDevice) -> io::Result<Self> {
        let mut nl = Rtnl::open()?;
        let mut routed = BTreeSet::new();
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut q = RouteMessage::default();
            q.header.address_family = family;
            for m in nl.dump(RouteNetlinkMessage::GetRoute(q))? {
                let RouteNetlinkMessage::NewRoute(r) = m else {
                    continue;
                };
                if r.header.protocol != RouteProtocol::Other(ROUTE_PROTOCOL) {
                    continue;
                }
                let oif = r.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Oif(i) => Some(*i),
                    _ => None,
                });
                let dst = r.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Destination(RouteAddress::Inet(a)) => Some(IpAddr::V4(*a)),
                    RouteAttribute::Destination(RouteAddress::Inet6(a)) => Some(IpAddr::V6(*a)),
                    _ => None,
                });
                if let (Some(i), Some(d)) = (oif, dst) {
                    if i == device.ifindex {
                        routed.insert(d);
                    }
                }
            }
        }
        Ok(Self {
            nl,
            dev: device.ifindex,
            routed,
            src: (None, None),
        })
    }

    /// The source the routes were last given.
    pub fn source(&self) -> (Option<Ipv4Addr>, Option<Ipv6Addr>) {
        self.src
    }

    /// How many addresses are routed to the device.
    pub fn len(&self) -> usize {
        self.routed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.routed.is_empty()
    }

    fn message(&self, addr: IpAddr, with_src: bool) -> RouteMessage {
        let (len, src) = match addr {
            IpAddr::V4(_) => (32, self.src.0.map(IpAddr::V4)),
            IpAddr::V6(_) => (128, self.src.1.map(IpAddr::V6)),
        };
        // Both addresses are of `addr`'s family: the builder cannot refuse.
        let b = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(addr, len)
            .expect("a host prefix");
        let b = match src {
            Some(s) if with_src => b.pref_source(s).expect("a source of the family"),
            _ => b,
        };
        let mut m = b.output_interface(self.dev).build();
        m.header.protocol = RouteProtocol::Other(ROUTE_PROTOCOL);
        m.header.scope = RouteScope::Link;
        m
    }

    /// Routes `addrs` (replacing a route there), with the routes' source
    /// when `with_src`; returns those the kernel refused that source for
    /// (EINVAL: the node's address is not on an interface here).
    fn add(&mut self, addrs: &[IpAddr], with_src: bool, report: &mut RouteReport) -> Vec<IpAddr> {
        let msgs = addrs
            .iter()
            .map(|a| RouteNetlinkMessage::NewRoute(self.message(*a, with_src)))
            .collect();
        let outcomes = match self.nl.requests(msgs, NLM_F_CREATE | NLM_F_REPLACE) {
            Ok(outcomes) => outcomes,
            Err(e) => {
                report
                    .failed
                    .extend(addrs.iter().map(|a| (*a, e.to_string())));
                return Vec::new();
            }
        };
        let mut refused_src = Vec::new();
        for (a, o) in addrs.iter().zip(outcomes) {
            match o {
                Ok(()) => {
                    self.routed.insert(*a);
                    report.added += 1;
                }
                Err(e) if with_src && e.raw_os_error() == Some(libc::EINVAL) => {
                    refused_src.push(*a)
                }
                Err(e) => report.failed.push((*a, e.to_string())),
            }
        }
        refused_src
    }

    /// Routes `add` (replacing a route there) and unroutes `del`.
    fn apply(&mut self, add: Vec<IpAddr>, del: Vec<IpAddr>, report: &mut RouteReport) {
        // Where the node's address is not (yet) on an interface, the kernel
        // picks the source.
        let retry = self.add(&add, true, report);
        self.add(&retry, false, report);
        let dels: Vec<_> = del
            .iter()
            .map(|a| RouteNetlinkMessage::DelRoute(self.message(*a, false)))
            .collect();
        match self.nl.requests(dels, 0) {
            Ok(outcomes) => {
                for (a, o) in del.iter().zip(outcomes) {
                    match o {
                        Ok(()) => {
                            self.routed.remove(a);
                            report.removed += 1;
                        }
                        // Gone already (the device was recreated, say).
                        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                            self.routed.remove(a);
                        }
                        Err(e) => report.failed.push((*a, e.to_string())),
                    }
                }
            }
            Err(e) => report
                .failed
                .extend(del.iter().map(|a| (*a, e.to_string()))),
        }
    }

    /// Makes the routed set `want`, with `src` as the routes' source: what
    /// is missing is added, what is extra removed; every route again when
    /// the source changed.
    pub fn sync_all(
        &mut self,
        want: &BTreeSet<IpAddr>,
        src: (Option<Ipv4Addr>, Option<Ipv6Addr>),
    ) -> RouteReport {
        let mut report = RouteReport::default();
        let resync = src != self.src;
        self.src = src;
        let add: Vec<IpAddr> = want
            .iter()
            .filter(|a| resync || !self.routed.contains(a))
            .copied()
            .collect();
        let del: Vec<IpAddr> = self.routed.difference(want).copied().collect();
        self.apply(add, del, &mut report);
        report
    }

    /// Brings the addresses in `changed` to what `wanted` says of each.
    pub fn sync_changed(
        &mut self,
        changed: impl IntoIterator<Item = IpAddr>,
        wanted: impl Fn(IpAddr) -> bool,
    ) -> RouteReport {
        let mut report = RouteReport::default();
        let (mut add, mut del) = (Vec::new(), Vec::new());
        for a in changed.into_iter().collect::<BTreeSet<_>>() {
            match (wanted(a), self.routed.contains(&a)) {
                (true, false) => add.push(a),
                (false, true) => del.push(a),
                _ => {}
            }
        }
        self.apply(add, del, &mut report);
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes(src: (Option<Ipv4Addr>, Option<Ipv6Addr>)) -> ServiceRoutes {
        ServiceRoutes {
            nl: Rtnl::open().expect("a netlink socket"),
            dev: 7,
            routed: BTreeSet::new(),
            src,
        }
    }

    #[test]
    fn a_cluster_ip_route_is_a_host_route_to_the_device_with_the_node_as_source() {
        let node4 = Ipv4Addr::new(198, 18, 0, 10);
        let node6: Ipv6Addr = "2001:2::a".parse().expect("address");
        let r = routes((Some(node4), Some(node6)));
        for (addr, src, len) in [
            (IpAddr::from([198, 19, 0, 10]), IpAddr::V4(node4), 32),
            (
                "2001:2:0:ff::a".parse().expect("address"),
                IpAddr::V6(node6),
                128,
            ),
        ] {
            let m = r.message(addr, true);
            assert_eq!(m.header.destination_prefix_length, len, "{addr}");
            assert_eq!(m.header.protocol, RouteProtocol::Other(ROUTE_PROTOCOL));
            assert_eq!(m.header.scope, RouteScope::Link);
            let has = |want: &RouteAttribute| m.attributes.contains(want);
            assert!(has(&RouteAttribute::Oif(7)), "{addr}: {m:?}");
            let (dst, pref) = match (addr, src) {
                (IpAddr::V4(a), IpAddr::V4(s)) => (RouteAddress::Inet(a), RouteAddress::Inet(s)),
                (IpAddr::V6(a), IpAddr::V6(s)) => (RouteAddress::Inet6(a), RouteAddress::Inet6(s)),
                _ => unreachable!("one family per row"),
            };
            assert!(has(&RouteAttribute::Destination(dst)), "{addr}: {m:?}");
            assert!(
                has(&RouteAttribute::PrefSource(pref.clone())),
                "{addr}: {m:?}"
            );
            // Without the source (the node's address not on an interface).
            let bare = r.message(addr, false);
            assert!(!bare.attributes.contains(&RouteAttribute::PrefSource(pref)));
        }
    }
}

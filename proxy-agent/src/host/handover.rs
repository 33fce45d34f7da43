//! Taking a node over from kube-proxy without breaking its connections.
//!
//! kube-proxy translates with the kernel's NAT: the first packet of a flow
//! meets its DNAT rule, and the kernel's conntrack entry translates every
//! later packet of that flow, rules or no rules. When this datapath is
//! attached on a node kube-proxy served, the flows it had translated are
//! unknown to the datapath's own conntrack: translated again, to a backend
//! chosen afresh, most TCP connections would be reset.
//!
//! So the agent reads the kernel's conntrack table ([`translated_flows`],
//! over ctnetlink) before it attaches its programs and again right after,
//! and lists every destination-NATed flow in the handover maps
//! ([`proxy_common::map_names::HANDOVER`], `HANDOVER6`). The datapath
//! passes the packets of a listed flow to the stack untouched, where the
//! kernel's entry keeps translating them to their backend after
//! kube-proxy's rules are removed (`kube-proxy --cleanup` leaves conntrack
//! alone). A TCP SYN or SCTP INIT is never handed over: a new connection
//! (a client reusing its port) is the datapath's. Entries end with the
//! kernel entry's timeout (TCP, SCTP) or two minutes after a UDP flow's
//! last packet, and the map is an LRU.
//!
//! A flow that kube-proxy opens between the first read and the programs'
//! attach, and whose later packets arrive before the second read, would
//! still be taken midway. So on a node whose netfilter holds kube-proxy's
//! chains the agent attaches with the datapath draining
//! ([`proxy_common::config_flags::DRAINING`]): a new flow is passed to the
//! stack and listed in the handover map by the datapath itself. Draining
//! ends after the second read.
//!
//! Replies need nothing: a reply the datapath does not know passes to the
//! stack, whose entry reverse-translates it.
//!
//! A flow kube-proxy also masqueraded (`externalTrafficPolicy: Cluster` to
//! a remote backend) holds a port of the node's address toward its
//! backend: `MASQUERADE --random-fully` picks it anywhere in 1024–65535,
//! over the datapath's own SNAT range. Its backend-side tuple (the
//! kernel's reply tuple) is listed too, under `dir` REPLY: the datapath
//! does not give that port to a new flow to the same backend while the
//! entry lasts. Given it, the backend would take the new connection's SYN
//! for the old one's, and the old one's replies would be reverse-translated
//! to the new client.

use std::io;
use std::net::IpAddr;
use std::path::Path;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Status, Tuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};
use proxy_common::{ct_dir, map_names, Ct4Key, Ct6Key, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use crate::bpf::open_lru_hash;

/// Most entries read from one dump (the kernel's table is bounded by
/// `nf_conntrack_max`; this bounds the loop whatever it says).
const MAX_ENTRIES: usize = 4 * 1024 * 1024;

/// A flow the kernel's conntrack destination-NATed: its original
/// direction (the client's packets) and the seconds its entry has left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelFlow {
    pub proto: u8,
    pub src: std::net::SocketAddr,
    pub dst: std::net::SocketAddr,
    pub timeout_s: u32,
    /// The reply direction as (source, destination) when the kernel also
    /// source-NATed the flow: the backend and the node's port it was given.
    pub masqueraded: Option<(std::net::SocketAddr, std::net::SocketAddr)>,
}

/// The destination-NATed TCP, UDP and SCTP flows of the kernel's conntrack
/// table in this network namespace, both families. A kernel without
/// conntrack has none.
pub fn translated_flows() -> io::Result<Vec<KernelFlow>> {
    let mut out = Vec::new();
    for family in [NetfilterProtoFamily::IPv4, NetfilterProtoFamily::IPv6] {
        match dump(family, &mut out) {
            Ok(()) => {}
            // No conntrack in this kernel (or namespace): nothing to hand over.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOENT | libc::EPROTONOSUPPORT | libc::EOPNOTSUPP)
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

fn dump(family: NetfilterProtoFamily, out: &mut Vec<KernelFlow>) -> io::Result<()> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let mut request = NetlinkMessage::new(
        header,
        NetlinkPayload::from(NetfilterMessage::new(
            NetfilterHeader::new(family, 0, 0),
            ConntrackMessage::Get(vec![]),
        )),
    );
    request.finalize();
    let mut buf = vec![0; request.buffer_len()];
    request.serialize(&mut buf);
    socket.send(&buf, 0)?;
    let mut rx = vec![0u8; 1 << 16];
    let mut seen = 0usize;
    loop {
        let n = socket.recv(&mut &mut rx[..], 0)?;
        if n == 0 {
            return Ok(());
        }
        let mut off = 0;
        while off < n {
            let msg = NetlinkMessage::<NetfilterMessage>::deserialize(&rx[off..n])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
            let len = msg.header.length as usize;
            match msg.payload {
                NetlinkPayload::Done(_) => return Ok(()),
                NetlinkPayload::Error(e) => {
                    return Err(e
                        .code
                        .map(|c| io::Error::from_raw_os_error(-c.get()))
                        .unwrap_or_else(|| io::Error::other("ctnetlink error")))
                }
                NetlinkPayload::InnerMessage(NetfilterMessage {
                    inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)),
                    ..
                }) => {
                    if let Some(f) = translated(&attrs) {
                        out.push(f);
                    }
                }
                _ => {}
            }
            seen += 1;
            if seen > MAX_ENTRIES {
                return Err(io::Error::other(format!(
                    "more than {MAX_ENTRIES} conntrack entries: stopped reading"
                )));
            }
            if len == 0 {
                break;
            }
            off += len;
        }
    }
}

/// The flow of one conntrack entry, if the kernel destination-NATed it.
fn translated(attrs: &[ConntrackAttribute]) -> Option<KernelFlow> {
    let mut orig = None;
    let mut reply = None;
    let mut status = Status::empty();
    let mut timeout_s = 0;
    for a in attrs {
        match a {
            ConntrackAttribute::CtaTupleOrig(t) => orig = tuple(t),
            ConntrackAttribute::CtaTupleReply(t) => reply = tuple(t),
            ConntrackAttribute::CtaStatus(s) => status = *s,
            ConntrackAttribute::CtaTimeout(t) => timeout_s = *t,
            _ => {}
        }
    }
    let (proto, src, dst) = orig?;
    if !status.contains(Status::DstNat)
        || ![IPPROTO_TCP, IPPROTO_UDP, IPPROTO_SCTP].contains(&proto)
    {
        return None;
    }
    let masqueraded = if status.contains(Status::SrcNat) {
        reply.and_then(|(p, s, d)| (p == proto).then_some((s, d)))
    } else {
        None
    };
    Some(KernelFlow {
        proto,
        src,
        dst,
        timeout_s,
        masqueraded,
    })
}

fn tuple(t: &[Tuple]) -> Option<(u8, std::net::SocketAddr, std::net::SocketAddr)> {
    let (mut sa, mut da, mut proto, mut sp, mut dp) = (None, None, None, None, None);
    for part in t {
        match part {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => sa = Some(*a),
                        IPTuple::DestinationAddress(a) => da = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(ps) => {
                for p in ps {
                    match p {
                        ProtoTuple::Protocol(n) => proto = Some(u8::from(*n)),
                        ProtoTuple::SourcePort(n) => sp = Some(*n),
                        ProtoTuple::DestinationPort(n) => dp = Some(*n),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some((
        proto?,
        std::net::SocketAddr::new(sa?, sp?),
        std::net::SocketAddr::new(da?, dp?),
    ))
}

/// `CLOCK_MONOTONIC` in ns: the clock of `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Until when the datapath leaves `f` to the kernel, `now` being
/// `CLOCK_MONOTONIC` ns: the entry's own timeout for TCP and SCTP (the
/// kernel's established timeout, days, unless kube-proxy lowered it);
/// [`proxy_common::HANDOVER_REFRESH_NS`] for UDP, which each packet renews.
pub fn deadline(f: &KernelFlow, now: u64) -> u64 {
    if f.proto == IPPROTO_UDP {
        now + proxy_common::HANDOVER_REFRESH_NS
    } else {
        now + u64::from(f.timeout_s.max(1)) * 1_000_000_000
    }
}

/// The handover map key of `f`: the client's direction, as the datapath
/// looks it up (`dir` SERVICE).
pub fn key4(f: &KernelFlow) -> Option<Ct4Key> {
    ct4(f.proto, f.src, f.dst, ct_dir::SERVICE)
}

/// The handover map key of the node's port a masqueraded flow `f` holds:
/// its backend-side tuple, as the datapath's SNAT port choice looks it up
/// (`dir` REPLY). `None` when the kernel did not source-NAT it.
pub fn reply_key4(f: &KernelFlow) -> Option<Ct4Key> {
    let (src, dst) = f.masqueraded?;
    ct4(f.proto, src, dst, ct_dir::REPLY)
}

/// [`key4`] for IPv6.
pub fn key6(f: &KernelFlow) -> Option<Ct6Key> {
    ct6(f.proto, f.src, f.dst, ct_dir::SERVICE)
}

/// [`reply_key4`] for IPv6.
pub fn reply_key6(f: &KernelFlow) -> Option<Ct6Key> {
    let (src, dst) = f.masqueraded?;
    ct6(f.proto, src, dst, ct_dir::REPLY)
}

/// The conntrack key of the packets from `src` to `dst` (`dir` as the
/// datapath files them); `None` unless both are IPv4.
fn ct4(proto: u8, src: std::net::SocketAddr, dst: std::net::SocketAddr, dir: u8) -> Option<Ct4Key> {
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => Some(Ct4Key {
            saddr_be: u32::from_ne_bytes(s.octets()),
            daddr_be: u32::from_ne_bytes(d.octets()),
            sport_be: src.port().to_be(),
            dport_be: dst.port().to_be(),
            proto,
            dir,
            _pad: [0; 2],
        }),
        _ => None,
    }
}

/// [`ct4`] for IPv6.
fn ct6(proto: u8, src: std::net::SocketAddr, dst: std::net::SocketAddr, dir: u8) -> Option<Ct6Key> {
    match (src.ip(), dst.ip()) {
        (IpAddr::V6(s), IpAddr::V6(d)) => Some(Ct6Key {
            saddr_be: proxy_common::ipv6::addr6(s),
            daddr_be: proxy_common::ipv6::addr6(d),
            sport_be: src.port().to_be(),
            dport_be: dst.port().to_be(),
            proto,
            dir,
            _pad: [0; 2],
        }),
        _ => None,
    }
}

/// Until when the datapath keeps the node's port of a masqueraded flow `f`
/// away from its own flows: as [`deadline`] for TCP and SCTP; for UDP,
/// whose handover entry only its own packets renew, as long as a
/// connection's (a port toward one backend is one of tens of thousands).
pub fn port_deadline(f: &KernelFlow, now: u64) -> u64 {
    if f.proto == IPPROTO_UDP {
        now + proxy_common::HANDOVER_DRAINED_NS
    } else {
        deadline(f, now)
    }
}

/// What [`hand_over`] listed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HandedOver {
    /// Flows left to the kernel, of each family.
    pub ipv4: usize,
    pub ipv6: usize,
    /// Of those, the ones the kernel also masqueraded: a port of the node
    /// each, kept from the datapath's own SNAT.
    pub masqueraded: usize,
}

/// Reads the kernel's destination-NATed flows and lists them in the
/// handover maps under `pin_dir`.
pub fn hand_over(pin_dir: &Path) -> Result<HandedOver, String> {
    let flows = translated_flows().map_err(|e| format!("read the kernel's conntrack: {e}"))?;
    let mut v4 = open_lru_hash::<Ct4Key, u64>(pin_dir, map_names::HANDOVER)?;
    let mut v6 = open_lru_hash::<Ct6Key, u64>(pin_dir, map_names::HANDOVER6)?;
    let now = monotonic_ns();
    let mut n = HandedOver::default();
    for f in &flows {
        let until = deadline(f, now);
        if let Some(k) = key4(f) {
            v4.insert(k, until, 0)
                .map_err(|e| format!("{}: {e}", map_names::HANDOVER))?;
            if let Some(r) = reply_key4(f) {
                v4.insert(r, port_deadline(f, now), 0)
                    .map_err(|e| format!("{}: {e}", map_names::HANDOVER))?;
                n.masqueraded += 1;
            }
            n.ipv4 += 1;
        } else if let Some(k) = key6(f) {
            v6.insert(k, until, 0)
                .map_err(|e| format!("{}: {e}", map_names::HANDOVER6))?;
            if let Some(r) = reply_key6(f) {
                v6.insert(r, port_deadline(f, now), 0)
                    .map_err(|e| format!("{}: {e}", map_names::HANDOVER6))?;
                n.masqueraded += 1;
            }
            n.ipv6 += 1;
        }
    }
    Ok(n)
}

/// How many of the kernel's destination-NATed flows are still handed over:
/// listed in the handover maps under `pin_dir`, their deadline not passed.
/// While any is, the kernel's conntrack must keep seeing packets
/// ([`super::conntrack_hold`]); a flow that ended has no kernel entry left
/// (TCP's closes, UDP's times out), whatever its map entry says.
pub fn live_flows(pin_dir: &Path) -> Result<usize, String> {
    let flows = translated_flows().map_err(|e| format!("read the kernel's conntrack: {e}"))?;
    if flows.is_empty() {
        return Ok(0);
    }
    let v4 = open_lru_hash::<Ct4Key, u64>(pin_dir, map_names::HANDOVER)?;
    let v6 = open_lru_hash::<Ct6Key, u64>(pin_dir, map_names::HANDOVER6)?;
    let now = monotonic_ns();
    let live = |until: Result<u64, aya::maps::MapError>| until.is_ok_and(|t| t >= now);
    Ok(flows
        .iter()
        .filter(|f| {
            key4(f).is_some_and(|k| live(v4.get(&k, 0)))
                || key6(f).is_some_and(|k| live(v6.get(&k, 0)))
        })
        .count())
}

/// Hands the node back (`--on-exit drain`): sets `DRAINING` in the
/// pinned configuration, so that the programs, left attached, keep
/// translating the flows they track while every new flow passes to the
/// host's stack, to the proxy taking over (kube-proxy's rules). Run
/// `proxy-agent cleanup` once those flows have ended.
pub fn set_draining(pin_dir: &Path) -> Result<(), String> {
    let name = map_names::CONFIG;
    let map = aya::maps::MapData::from_pin(pin_dir.join(name))
        .map(aya::maps::Map::Array)
        .map_err(|e| format!("open {name}: {e}"))?;
    let mut config: aya::maps::Array<_, proxy_common::Config> =
        aya::maps::Array::try_from(map).map_err(|e| format!("{name}: {e}"))?;
    let mut c = config.get(&0, 0).map_err(|e| format!("{name}: {e}"))?;
    c.flags |= proxy_common::config_flags::DRAINING;
    config.set(0, c, 0).map_err(|e| format!("{name}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(proto: u8, src: &str, dst: &str, timeout_s: u32) -> KernelFlow {
        KernelFlow {
            proto,
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            timeout_s,
            masqueraded: None,
        }
    }

    #[test]
    fn keys_are_the_client_direction_in_network_order() {
        let k = key4(&flow(
            IPPROTO_TCP,
            "198.18.1.10:40000",
            "198.19.0.7:80",
            100,
        ))
        .unwrap();
        assert_eq!(
            k.saddr(),
            "198.18.1.10".parse::<std::net::Ipv4Addr>().unwrap()
        );
        assert_eq!(
            k.daddr(),
            "198.19.0.7".parse::<std::net::Ipv4Addr>().unwrap()
        );
        assert_eq!(u16::from_be(k.sport_be), 40000);
        assert_eq!(u16::from_be(k.dport_be), 80);
        assert_eq!((k.proto, k.dir), (IPPROTO_TCP, ct_dir::SERVICE));
        assert!(key6(&flow(IPPROTO_TCP, "198.18.1.10:1", "198.19.0.7:80", 1)).is_none());
        let k6 = key6(&flow(
            IPPROTO_UDP,
            "[2001:2::5]:5353",
            "[2001:2:0:ff::a]:53",
            1,
        ))
        .unwrap();
        assert_eq!(
            k6.daddr_be,
            proxy_common::ipv6::addr6("2001:2:0:ff::a".parse().unwrap())
        );
        assert_eq!(u16::from_be(k6.dport_be), 53);
    }

    #[test]
    fn tcp_keeps_the_kernel_timeout_udp_is_renewed_by_traffic() {
        let now = 1_000;
        assert_eq!(
            deadline(
                &flow(IPPROTO_TCP, "198.18.1.10:1", "198.19.0.7:80", 86_400),
                now
            ),
            now + 86_400 * 1_000_000_000
        );
        assert_eq!(
            deadline(&flow(IPPROTO_UDP, "198.18.1.10:1", "198.19.0.7:53", 5), now),
            now + proxy_common::HANDOVER_REFRESH_NS
        );
    }

    #[test]
    fn only_destination_nat_of_tcp_udp_sctp_is_handed_over() {
        let orig = |proto: u8| {
            ConntrackAttribute::CtaTupleOrig(vec![
                Tuple::Ip(vec![
                    IPTuple::SourceAddress("198.18.1.10".parse().unwrap()),
                    IPTuple::DestinationAddress("198.19.0.7".parse().unwrap()),
                ]),
                Tuple::Proto(vec![
                    ProtoTuple::Protocol(proto.into()),
                    ProtoTuple::SourcePort(40000),
                    ProtoTuple::DestinationPort(80),
                ]),
            ])
        };
        let dnat = ConntrackAttribute::CtaStatus(Status::DstNat | Status::Confirmed);
        let snat = ConntrackAttribute::CtaStatus(Status::SrcNat | Status::Confirmed);
        let t = ConntrackAttribute::CtaTimeout(300);
        assert_eq!(
            translated(&[orig(IPPROTO_TCP), dnat.clone(), t.clone()]),
            Some(flow(IPPROTO_TCP, "198.18.1.10:40000", "198.19.0.7:80", 300))
        );
        assert!(translated(&[orig(IPPROTO_TCP), snat, t.clone()]).is_none());
        // Masqueraded too (a NodePort to a remote backend): the reply tuple
        // says which port of the node it holds toward its backend.
        let reply = ConntrackAttribute::CtaTupleReply(vec![
            Tuple::Ip(vec![
                IPTuple::SourceAddress("198.18.2.10".parse().unwrap()),
                IPTuple::DestinationAddress("198.18.0.10".parse().unwrap()),
            ]),
            Tuple::Proto(vec![
                ProtoTuple::Protocol(IPPROTO_TCP.into()),
                ProtoTuple::SourcePort(8080),
                ProtoTuple::DestinationPort(61234),
            ]),
        ]);
        let both = ConntrackAttribute::CtaStatus(Status::DstNat | Status::SrcNat);
        let f = translated(&[orig(IPPROTO_TCP), reply.clone(), both, t.clone()]).unwrap();
        assert_eq!(
            f.masqueraded,
            Some((
                "198.18.2.10:8080".parse().unwrap(),
                "198.18.0.10:61234".parse().unwrap()
            ))
        );
        let k = reply_key4(&f).unwrap();
        assert_eq!((k.dir, k.proto), (ct_dir::REPLY, IPPROTO_TCP));
        assert_eq!(
            (k.saddr(), u16::from_be(k.sport_be)),
            ("198.18.2.10".parse::<std::net::Ipv4Addr>().unwrap(), 8080)
        );
        assert_eq!(
            (k.daddr(), u16::from_be(k.dport_be)),
            ("198.18.0.10".parse::<std::net::Ipv4Addr>().unwrap(), 61234)
        );
        // Destination NAT alone: no port of the node is held.
        let f = translated(&[orig(IPPROTO_TCP), reply, dnat.clone(), t.clone()]).unwrap();
        assert_eq!((f.masqueraded, reply_key4(&f)), (None, None));
        assert!(translated(&[orig(1), dnat.clone(), t.clone()]).is_none());
        assert!(translated(&[dnat, t]).is_none());
    }
}

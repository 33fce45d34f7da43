//! Parsing: Ethernet, IPv4 and the TCP/UDP/SCTP ports, into a [`Packet`].
//!
//! Both programs read headers in place, bounds-checked: XDP always
//! ([`parse_xdp`]); tc where they lie in the skb's linear part, which is
//! nearly always ([`tc_load`], [`parse`]). Both give the same [`Packet`], so
//! the steps after parsing are shared.

use core::mem::size_of;

use aya_ebpf::{
    bindings::BPF_ANY,
    cty::c_long,
    programs::{TcContext, XdpContext},
};
use proxy_common::{
    conntrack::sctp_flags, stat, Ct4Key, Frag4Key, FragPorts, IPPROTO_SCTP, IPPROTO_TCP,
    IPPROTO_UDP,
};

use crate::{
    maps::{count, FRAG4_V1},
    verdict::Verdict,
};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const IP_CSUM_OFF: usize = ETH_HLEN + 10;
pub const IP_TTL_OFF: usize = ETH_HLEN + 8;
pub const IP_FRAG_OFF: usize = ETH_HLEN + 6;
pub const IP_MF: u16 = 0x2000;
const IP_OFFSET: u16 = 0x1fff;
/// Byte of the TCP header holding the flags.
const TCP_FLAGS_OFF: usize = 13;
/// Byte of an SCTP packet holding its first chunk's type.
const SCTP_CHUNK_OFF: usize = 12;

/// The fixed 20 bytes of an IPv4 header, as in the packet.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv4Hdr {
    pub ver_ihl: u8,
    pub tos: u8,
    pub tot_len_be: u16,
    pub id_be: u16,
    pub frag_off_be: u16,
    pub ttl: u8,
    pub proto: u8,
    pub check: u16,
    pub saddr_be: u32,
    pub daddr_be: u32,
}
const _: () = assert!(size_of::<Ipv4Hdr>() == 20);

/// What the parser found: offsets and the 5-tuple, as in the packet.
pub struct Packet {
    pub l4_off: usize,
    pub csum_off: usize,
    pub proto: u8,
    pub saddr_be: u32,
    pub daddr_be: u32,
    pub sport_be: u16,
    pub dport_be: u16,
    pub tot_len: u16,
    /// TCP: the header's flags; SCTP: those its first chunk stands for
    /// ([`proxy_common::conntrack::sctp_flags`]).
    pub tcp_flags: u8,
    /// False for a non-first IPv4 fragment: it carries no L4 header; its ports
    /// come from the fragment map, and only addresses are rewritten.
    pub l4_present: bool,
}

impl Packet {
    /// The packet of IPv4 header `ip` whose L4 header (or, for a later
    /// fragment, payload) starts at `l4_off`, with L4 checksum at `csum_off`.
    #[inline(always)]
    fn new(
        ip: &Ipv4Hdr,
        l4_off: usize,
        csum_off: usize,
        ports: [u16; 2],
        l4_present: bool,
    ) -> Self {
        Packet {
            l4_off,
            csum_off,
            proto: ip.proto,
            saddr_be: ip.saddr_be,
            daddr_be: ip.daddr_be,
            sport_be: ports[0],
            dport_be: ports[1],
            tot_len: u16::from_be(ip.tot_len_be),
            tcp_flags: 0,
            l4_present,
        }
    }

    /// The conntrack key of this packet's tuple, as it is in the packet.
    #[inline(always)]
    pub fn ct_key(&self, dir: u8) -> Ct4Key {
        Ct4Key {
            saddr_be: self.saddr_be,
            daddr_be: self.daddr_be,
            sport_be: self.sport_be,
            dport_be: self.dport_be,
            proto: self.proto,
            dir,
            _pad: [0; 2],
        }
    }
}

/// Reads a `T` at `off` of a tc packet: in place when those bytes are in
/// the skb's linear part (a bounds check against `data_end`, nearly always),
/// else through `bpf_skb_load_bytes`, which also reads paged data. The same
/// result either way; the first branch spares a helper call per read.
///
/// Reads only: a program that writes packet data in place gets the
/// verifier's unclone prologue, a copy of the header of every cloned skb
/// (most TCP segments a pod sends) whether or not the program touches it,
/// so tc writes stay with `bpf_skb_store_bytes` and the checksum helpers.
/// And not on every path: each use splits the verifier's states in two
/// until they meet again (used in [`crate::nat`]'s SCTP CRC update, it took
/// `pod_ingress` past a million instructions).
#[inline(always)]
pub fn tc_load<T: Copy>(ctx: &TcContext, off: usize) -> Result<T, c_long> {
    let start = ctx.data();
    if start + off + size_of::<T>() <= ctx.data_end() {
        // SAFETY: bounds-checked against the linear data's end; the packet
        // has no alignment guarantee, hence the unaligned read.
        return Ok(unsafe { ((start + off) as *const T).read_unaligned() });
    }
    ctx.load::<T>(off)
}

/// Parses Ethernet / IPv4 / TCP-UDP ports of a tc packet; returns the packet,
/// its IPv4 header and the offset its L4 header must reach to be complete.
/// `Err` for packets passed untouched before any lookup.
pub fn parse(ctx: &TcContext) -> Result<(Packet, Ipv4Hdr, usize), Verdict> {
    let Ok(h_proto) = tc_load::<u16>(ctx, 12) else {
        return Err(Verdict::Pass(stat::PASS_NOT_IPV4));
    };
    if u16::from_be(h_proto) != ETH_P_IP {
        return Err(Verdict::Pass(stat::PASS_NOT_IPV4));
    }
    let Ok(ip) = tc_load::<Ipv4Hdr>(ctx, ETH_HLEN) else {
        return Err(Verdict::Pass(stat::PASS_MALFORMED));
    };
    let ihl = (ip.ver_ihl & 0x0f) as usize * 4;
    if ip.ver_ihl >> 4 != 4 || ihl < 20 {
        return Err(Verdict::Pass(stat::PASS_MALFORMED));
    }
    if ip.proto != IPPROTO_TCP && ip.proto != IPPROTO_UDP && ip.proto != IPPROTO_SCTP {
        return Err(Verdict::Pass(stat::PASS_OTHER_PROTO));
    }
    let l4_off = ETH_HLEN + ihl;
    let frag = u16::from_be(ip.frag_off_be);
    let fkey = Frag4Key {
        saddr_be: ip.saddr_be,
        daddr_be: ip.daddr_be,
        id_be: ip.id_be,
        proto: ip.proto,
        _pad: 0,
    };
    let mut l4_present = true;
    let ports = if frag & IP_OFFSET != 0 {
        // A later fragment: its ports are those its first fragment carried.
        let Some(p) = FRAG4_V1.get_ptr(fkey) else {
            return Err(Verdict::Pass(stat::PASS_FRAGMENT));
        };
        l4_present = false;
        // SAFETY: map value pointer, copied.
        let p = unsafe { *p };
        [p.sport_be, p.dport_be]
    } else {
        let Ok(ports) = tc_load::<[u16; 2]>(ctx, l4_off) else {
            return Err(Verdict::Pass(stat::PASS_MALFORMED));
        };
        if frag & IP_MF != 0 {
            // A first fragment: remember its ports for the ones that follow.
            let v = FragPorts {
                sport_be: ports[0],
                dport_be: ports[1],
            };
            let _ = FRAG4_V1.insert(fkey, v, BPF_ANY as u64);
            count(stat::FRAGMENT_TRACKED);
        }
        ports
    };
    let (csum_off, l4_min) = l4_layout(ip.proto);
    let pkt = Packet::new(&ip, l4_off, l4_off + csum_off, ports, l4_present);
    Ok((pkt, ip, if l4_present { l4_off + l4_min } else { l4_off }))
}

/// Offset of the L4 checksum in its header, and the header's minimum length
/// (SCTP: the common header and one chunk's header).
#[inline(always)]
fn l4_layout(proto: u8) -> (usize, usize) {
    if proto == IPPROTO_TCP {
        (16, 20)
    } else if proto == IPPROTO_SCTP {
        (8, 16)
    } else {
        (6, 8)
    }
}

/// Reads the TCP flags of a tc packet into `pkt`, or for SCTP those its
/// first chunk stands for (a later fragment has none).
#[inline(always)]
pub fn load_tcp_flags(ctx: &TcContext, pkt: &mut Packet) -> Result<(), Verdict> {
    if !pkt.l4_present {
        return Ok(());
    }
    let malformed = |_| Verdict::Drop(stat::DROP_MALFORMED);
    if pkt.proto == IPPROTO_TCP {
        pkt.tcp_flags = tc_load::<u8>(ctx, pkt.l4_off + TCP_FLAGS_OFF).map_err(malformed)?;
    } else if pkt.proto == IPPROTO_SCTP {
        let chunk = tc_load::<u8>(ctx, pkt.l4_off + SCTP_CHUNK_OFF).map_err(malformed)?;
        pkt.tcp_flags = sctp_flags(chunk);
    }
    Ok(())
}

/// A pointer to a `T` at `off` in the XDP frame, bounds-checked.
#[inline(always)]
pub fn xdp_ptr<T>(ctx: &XdpContext, off: usize) -> Option<*mut T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + size_of::<T>() > end {
        return None;
    }
    Some((start + off) as *mut T)
}

/// Parses an XDP frame in place: IPv4 without options, not a fragment, TCP or
/// UDP with a complete header. Anything else (SCTP included: its checksum
/// update is tc's) is deferred to tc
/// (`Pass(XDP_DEFERRED)`), which handles every case.
#[inline(always)]
pub fn parse_xdp(ctx: &XdpContext) -> Result<Packet, Verdict> {
    let defer = Verdict::Pass(stat::XDP_DEFERRED);
    let eth_proto = xdp_ptr::<u16>(ctx, 12).ok_or(defer)?;
    // SAFETY: bounds-checked frame pointer.
    if u16::from_be(unsafe { *eth_proto }) != ETH_P_IP {
        return Err(defer);
    }
    let ip = xdp_ptr::<Ipv4Hdr>(ctx, ETH_HLEN).ok_or(defer)?;
    // SAFETY: bounds-checked frame pointer, copied.
    let ip = unsafe { *ip };
    let frag = u16::from_be(ip.frag_off_be) & 0x3fff != 0;
    if ip.ver_ihl != 0x45 || frag || (ip.proto != IPPROTO_TCP && ip.proto != IPPROTO_UDP) {
        return Err(defer);
    }
    let l4 = ETH_HLEN + 20;
    let (_, l4_len) = l4_layout(ip.proto);
    if ctx.data() + l4 + l4_len > ctx.data_end() {
        return Err(defer);
    }
    let malformed = Verdict::Drop(stat::DROP_MALFORMED);
    let ports = xdp_ptr::<[u16; 2]>(ctx, l4).ok_or(malformed)?;
    // SAFETY: bounds-checked frame pointer, copied.
    let ports = unsafe { *ports };
    // XDP rewrites checksums in place (`nat::xdp_rewrite`): no offset kept.
    let mut pkt = Packet::new(&ip, l4, 0, ports, true);
    if pkt.proto == IPPROTO_TCP {
        let f = xdp_ptr::<u8>(ctx, l4 + TCP_FLAGS_OFF).ok_or(malformed)?;
        // SAFETY: bounds-checked frame pointer.
        pkt.tcp_flags = unsafe { *f };
    }
    Ok(pkt)
}

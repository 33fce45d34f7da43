//! IPv6 parsing for the tc path ([`crate::ipv6`]), the twin of
//! [`crate::parse`]: the fixed header, the extension headers walked
//! (hop-by-hop, destination options, a fragment header; up to
//! [`MAX_EXT_HEADERS`]), fragments (a first one's ports recorded in
//! `FRAG6_V1` for the later ones), and the L4 ports and flags.

// Map keys and values are passed by reference, as in `ipv6.rs`: by value,
// each call's copy of an IPv6 key takes stack the verifier counts.
#![allow(clippy::needless_borrows_for_generic_args)]

use core::mem::size_of;

use aya_ebpf::{
    bindings::BPF_ANY,
    programs::{TcContext, XdpContext},
};
use proxy_common::{
    conntrack::sctp_flags, stat, Addr6, Ct6Key, Frag6Key, FragPorts, IPPROTO_SCTP, IPPROTO_TCP,
    IPPROTO_UDP,
};

use crate::{
    ipv6::ETH_P_IPV6,
    maps::{count, FRAG6_V1},
    parse::{tc_load, xdp_ptr, ETH_HLEN},
    verdict::Verdict,
};

pub(crate) const IP6_HLEN: usize = 40;
pub(crate) const IP6_HOP_OFF: usize = ETH_HLEN + 7;
pub(crate) const IP6_SRC_OFF: usize = ETH_HLEN + 8;
pub(crate) const IP6_DST_OFF: usize = ETH_HLEN + 24;
pub(crate) const NEXTHDR_HOP: u8 = 0;
pub(crate) const NEXTHDR_FRAGMENT: u8 = 44;
pub(crate) const NEXTHDR_DEST: u8 = 60;
/// Hop-by-hop and destination-options headers walked before the L4 header.
pub const MAX_EXT_HEADERS: usize = 4;
pub(crate) const TCP_FLAGS_OFF: usize = 13;
pub(crate) const SCTP_CHUNK_OFF: usize = 12;
/// `AF_INET6`: [`crate::family::V6`]'s `AF`.
pub(crate) const AF_INET6: u8 = 10;
pub(crate) const IPPROTO_ICMPV6: u8 = 58;

/// The fixed IPv6 header, as in the packet.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv6Hdr {
    pub vtc_flow_be: u32,
    pub payload_len_be: u16,
    pub nexthdr: u8,
    pub hop_limit: u8,
    pub saddr_be: Addr6,
    pub daddr_be: Addr6,
}
const _: () = assert!(size_of::<Ipv6Hdr>() == IP6_HLEN);

/// What the parser found, as in the packet.
#[derive(Clone, Copy, Default)]
pub struct Packet6 {
    pub(crate) l4_off: usize,
    pub(crate) csum_off: usize,
    pub(crate) proto: u8,
    pub(crate) tcp_flags: u8,
    pub(crate) saddr_be: Addr6,
    pub(crate) daddr_be: Addr6,
    pub(crate) sport_be: u16,
    pub(crate) dport_be: u16,
    /// The L4 length (payload after the extension headers).
    pub(crate) l4_len: u16,
    /// [`FRAGMENT_NONE`], [`FRAGMENT_FIRST`] (the L4 header is there) or
    /// [`FRAGMENT_LATER`] (no L4 header: ports from the fragment map, only
    /// addresses are rewritten).
    pub(crate) fragment: u8,
}

pub const FRAGMENT_NONE: u8 = 0;
pub(crate) const FRAGMENT_FIRST: u8 = 1;
pub(crate) const FRAGMENT_LATER: u8 = 2;
/// The fragment header's offset (13 bits, then 2 reserved, then M).
pub(crate) const IP6_FRAG_OFFSET: u16 = 0xfff8;
pub(crate) const IP6_FRAG_MORE: u16 = 0x0001;

impl Packet6 {
    /// What delivery reads of a translated ICMPv6 error: its outer
    /// addresses.
    #[inline(always)]
    pub fn set_error_addrs(&mut self, saddr_be: &Addr6, daddr_be: &Addr6) {
        self.proto = IPPROTO_ICMPV6;
        self.saddr_be = *saddr_be;
        self.daddr_be = *daddr_be;
    }

    #[inline(always)]
    pub(crate) fn ct_key(&self, dir: u8) -> Ct6Key {
        Ct6Key {
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

/// A translated IPv6 4-tuple.
pub type Tuple6 = crate::nat::Tuple<Addr6>;

/// Parses an IPv6 tc frame into `pkt`, up to its L4 ports (and TCP flags,
/// or the SCTP flags its first chunk stands for); 0, else the counter of a
/// frame passed untouched. A BPF call of its own: the IPv6 header it reads
/// is not kept in the entry's frame, under those of the calls after it
/// (the verifier's 512 bytes are for the whole chain).
#[inline(never)]
pub(crate) fn parse(ctx: &TcContext, pkt: &mut Packet6) -> u32 {
    match parse_inner(ctx) {
        Ok(p) => {
            *pkt = p;
            0
        }
        Err(Verdict::Pass(c) | Verdict::Drop(c) | Verdict::Deliver(c) | Verdict::Reject(c)) => c,
    }
}

#[inline(always)]
fn parse_inner(ctx: &TcContext) -> Result<Packet6, Verdict> {
    let malformed = Verdict::Pass(stat::PASS_MALFORMED);
    let ip = tc_load::<Ipv6Hdr>(ctx, ETH_HLEN).map_err(|_| malformed)?;
    if u32::from_be(ip.vtc_flow_be) >> 28 != 6 {
        return Err(malformed);
    }
    let mut nh = ip.nexthdr;
    let mut off = ETH_HLEN + IP6_HLEN;
    // The fragment header's identification and offset field, once seen.
    let mut frag: Option<(u32, u16)> = None;
    for _ in 0..MAX_EXT_HEADERS {
        if nh == NEXTHDR_FRAGMENT && frag.is_none() {
            let h = ctx.load::<[u8; 8]>(off).map_err(|_| malformed)?;
            nh = h[0];
            frag = Some((
                u32::from_ne_bytes([h[4], h[5], h[6], h[7]]),
                u16::from_be_bytes([h[2], h[3]]),
            ));
            off += 8;
            continue;
        }
        if nh != NEXTHDR_HOP && nh != NEXTHDR_DEST {
            break;
        }
        let h = ctx.load::<[u8; 2]>(off).map_err(|_| malformed)?;
        nh = h[0];
        off += (h[1] as usize + 1) * 8;
    }
    if nh != IPPROTO_TCP && nh != IPPROTO_UDP && nh != IPPROTO_SCTP {
        return Err(Verdict::Pass(
            if nh == NEXTHDR_HOP
                || nh == NEXTHDR_DEST
                || nh == NEXTHDR_FRAGMENT
                || nh == 43
                || nh == 51
                || nh == 50
            {
                stat::PASS_IPV6_EXT_HEADER
            } else {
                stat::PASS_OTHER_PROTO
            },
        ));
    }
    let ext_len = off - ETH_HLEN - IP6_HLEN;
    let l4_len = (u16::from_be(ip.payload_len_be) as usize).saturating_sub(ext_len) as u16;
    let (csum, l4_min) = if nh == IPPROTO_TCP {
        (16, 20)
    } else if nh == IPPROTO_SCTP {
        (8, 16)
    } else {
        (6, 8)
    };
    let mut fragment = FRAGMENT_NONE;
    if let Some((id_be, offset_field)) = frag {
        let key = frag_key(&ip, id_be, nh);
        if offset_field & IP6_FRAG_OFFSET != 0 {
            // A later fragment: its ports are those its first one carried,
            // and it has no L4 header.
            let Some(p) = FRAG6_V1.get_ptr(&key) else {
                return Err(Verdict::Pass(stat::PASS_FRAGMENT));
            };
            // SAFETY: map value pointer, copied.
            let p = unsafe { *p };
            return Ok(Packet6 {
                l4_off: off,
                csum_off: off + csum,
                proto: nh,
                tcp_flags: 0,
                saddr_be: ip.saddr_be,
                daddr_be: ip.daddr_be,
                sport_be: p.sport_be,
                dport_be: p.dport_be,
                l4_len,
                fragment: FRAGMENT_LATER,
            });
        }
        if offset_field & IP6_FRAG_MORE != 0 {
            fragment = FRAGMENT_FIRST;
        }
    }
    // The whole L4 header must be there (the verdict of a packet that is
    // neither a frontend's nor a reply's is the stack's).
    if (ctx.len() as usize) < off + l4_min {
        return Err(malformed);
    }
    let ports = tc_load::<[u16; 2]>(ctx, off).map_err(|_| malformed)?;
    if fragment == FRAGMENT_FIRST {
        if let Some((id_be, _)) = frag {
            // A first fragment: its ports, for the fragments that follow.
            let key = frag_key(&ip, id_be, nh);
            let v = FragPorts {
                sport_be: ports[0],
                dport_be: ports[1],
            };
            let _ = FRAG6_V1.insert(&key, &v, BPF_ANY as u64);
            count(stat::FRAGMENT_TRACKED);
        }
    }
    let mut tcp_flags = 0;
    if nh == IPPROTO_TCP {
        tcp_flags = tc_load::<u8>(ctx, off + TCP_FLAGS_OFF).map_err(|_| malformed)?;
    } else if nh == IPPROTO_SCTP {
        tcp_flags = sctp_flags(tc_load::<u8>(ctx, off + SCTP_CHUNK_OFF).map_err(|_| malformed)?);
    }
    Ok(Packet6 {
        l4_off: off,
        csum_off: off + csum,
        proto: nh,
        tcp_flags,
        saddr_be: ip.saddr_be,
        daddr_be: ip.daddr_be,
        sport_be: ports[0],
        dport_be: ports[1],
        l4_len,
        fragment,
    })
}

/// The fragment-map key of the datagram `id_be` of protocol `nh` with
/// header `ip` (`FRAG6_V1`).
#[inline(always)]
fn frag_key(ip: &Ipv6Hdr, id_be: u32, nh: u8) -> Frag6Key {
    Frag6Key {
        saddr_be: ip.saddr_be,
        daddr_be: ip.daddr_be,
        id_be,
        proto: nh,
        _pad: [0; 3],
    }
}

/// Where the XDP path reads the L4 header: right after the IPv6 header
/// (frames with extension headers are left to tc).
pub(crate) const XDP_L4_OFF: usize = ETH_HLEN + IP6_HLEN;

/// The XDP path's parse ([`crate::xdp6`]): an IPv6 frame without extension headers, TCP or UDP with a complete
/// header, read in place into `pkt` (field by field: `pkt` is in the
/// scratch entry, and a whole `Packet6` built first would be on the stack).
/// False when XDP leaves the frame to tc.
#[inline(always)]
pub fn parse_xdp(ctx: &XdpContext, pkt: &mut Packet6) -> bool {
    let Some(eth_proto) = xdp_ptr::<u16>(ctx, 12) else {
        return false;
    };
    // SAFETY: bounds-checked frame pointer.
    if u16::from_be(unsafe { *eth_proto }) != ETH_P_IPV6 {
        return false;
    }
    let Some(ip) = xdp_ptr::<Ipv6Hdr>(ctx, ETH_HLEN) else {
        return false;
    };
    // SAFETY: bounds-checked frame pointer.
    let (vtc, nh) = unsafe { ((*ip).vtc_flow_be, (*ip).nexthdr) };
    if u32::from_be(vtc) >> 28 != 6 || (nh != IPPROTO_TCP && nh != IPPROTO_UDP) {
        return false;
    }
    let l4_len = if nh == IPPROTO_TCP { 20 } else { 8 };
    if ctx.data() + XDP_L4_OFF + l4_len > ctx.data_end() {
        return false;
    }
    let Some(ports) = xdp_ptr::<[u16; 2]>(ctx, XDP_L4_OFF) else {
        return false;
    };
    let mut tcp_flags = 0;
    if nh == IPPROTO_TCP {
        let Some(f) = xdp_ptr::<u8>(ctx, XDP_L4_OFF + TCP_FLAGS_OFF) else {
            return false;
        };
        // SAFETY: bounds-checked frame pointer.
        tcp_flags = unsafe { *f };
    }
    // SAFETY: bounds-checked frame pointers, copied.
    unsafe {
        pkt.saddr_be = (*ip).saddr_be;
        pkt.daddr_be = (*ip).daddr_be;
        pkt.l4_len = u16::from_be((*ip).payload_len_be);
        pkt.sport_be = (*ports)[0];
        pkt.dport_be = (*ports)[1];
    }
    pkt.l4_off = XDP_L4_OFF;
    pkt.csum_off = XDP_L4_OFF + if nh == IPPROTO_TCP { 16 } else { 6 };
    pkt.proto = nh;
    pkt.tcp_flags = tcp_flags;
    pkt.fragment = FRAGMENT_NONE;
    true
}

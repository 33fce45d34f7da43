//! The IPv6 packet rewrite, the twin of [`crate::nat`]'s: addresses and
//! ports, the L4 checksum kept valid through its pseudo-header (IPv6 has no
//! header checksum). tc ([`crate::ipv6`]): 128-bit addresses through
//! `bpf_csum_diff`, SCTP's CRC32c for its ports; XDP ([`crate::xdp6`]): in
//! place, with RFC 1624 incremental checksum updates.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::bpf_csum_diff,
    programs::{TcContext, XdpContext},
};
use proxy_common::{
    crc32c,
    csum::{apply, diff128, diff16},
    stat, Addr6, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP,
};

use crate::{
    parse::{xdp_ptr, ETH_HLEN},
    parse6::{
        Ipv6Hdr, Packet6, Tuple6, FRAGMENT_FIRST, FRAGMENT_LATER, IP6_DST_OFF, IP6_SRC_OFF,
        XDP_L4_OFF,
    },
    verdict::Verdict,
};

const REWRITE_FAILED: Verdict = Verdict::Drop(stat::DROP_REWRITE_FAILED);

#[inline(always)]
fn l4_flags(pkt: &Packet6) -> u64 {
    if pkt.proto == IPPROTO_UDP {
        BPF_F_MARK_MANGLED_0 as u64
    } else {
        0
    }
}

/// Rewrites the address at `off` from `old` to `new`, the L4 checksum (its
/// pseudo-header) following; IPv6 has no header checksum.
#[inline(always)]
fn rewrite_addr(
    ctx: &TcContext,
    pkt: &Packet6,
    off: usize,
    old: &Addr6,
    new: &Addr6,
) -> Result<(), Verdict> {
    if old == new {
        return Ok(());
    }
    // SCTP's checksum covers no address; a later fragment has no L4 header.
    if pkt.proto != IPPROTO_SCTP && pkt.fragment != FRAGMENT_LATER {
        // SAFETY: two 16-byte buffers on the stack, sizes given; the helper
        // only reads them.
        let diff = unsafe {
            bpf_csum_diff(
                old.as_ptr() as *mut u32,
                16,
                new.as_ptr() as *mut u32,
                16,
                0,
            )
        };
        if diff < 0 {
            return Err(REWRITE_FAILED);
        }
        ctx.l4_csum_replace(
            pkt.csum_off,
            0,
            diff as u64,
            BPF_F_PSEUDO_HDR as u64 | l4_flags(pkt),
        )
        .map_err(|_| REWRITE_FAILED)?;
    }
    ctx.store(off, new, 0).map_err(|_| REWRITE_FAILED)
}

#[inline(always)]
fn rewrite_port(
    ctx: &TcContext,
    pkt: &Packet6,
    off: usize,
    old: u16,
    new: u16,
) -> Result<(), Verdict> {
    if old == new || pkt.fragment == FRAGMENT_LATER {
        return Ok(());
    }
    if pkt.proto != IPPROTO_SCTP {
        ctx.l4_csum_replace(pkt.csum_off, old as u64, new as u64, 2 | l4_flags(pkt))
            .map_err(|_| REWRITE_FAILED)?;
    }
    ctx.store(off, &new, 0).map_err(|_| REWRITE_FAILED)
}

#[inline(always)]
fn ports_word(sport_be: u16, dport_be: u16) -> u32 {
    let (s, d) = (sport_be.to_ne_bytes(), dport_be.to_ne_bytes());
    u32::from_ne_bytes([s[0], s[1], d[0], d[1]])
}

/// Rewrites a frame to tuple `to`, checksums kept valid (SCTP: its CRC32c
/// for the ports; its checksum covers no address).
#[inline(always)]
pub(crate) fn rewrite(ctx: &TcContext, pkt: &mut Packet6, to: &Tuple6) -> Result<(), Verdict> {
    if pkt.proto == IPPROTO_SCTP && pkt.fragment != FRAGMENT_LATER {
        let old = ports_word(pkt.sport_be, pkt.dport_be);
        let new = ports_word(to.sport_be, to.dport_be);
        if old != new && pkt.fragment == FRAGMENT_FIRST {
            // The CRC covers the whole packet, whose length this fragment
            // does not give (as IPv4's `drop_sctp_fragment`).
            return Err(Verdict::Drop(stat::DROP_SCTP_FRAGMENT));
        }
        if old != new {
            let stored = ctx.load::<u32>(pkt.csum_off).map_err(|_| REWRITE_FAILED)?;
            let crc = crc32c::update_ports(stored, pkt.l4_len, old, new);
            ctx.store(pkt.csum_off, &crc, 0)
                .map_err(|_| REWRITE_FAILED)?;
        }
    }
    rewrite_addr(ctx, pkt, IP6_DST_OFF, &pkt.daddr_be, &to.daddr_be)?;
    pkt.daddr_be = to.daddr_be;
    rewrite_port(ctx, pkt, pkt.l4_off + 2, pkt.dport_be, to.dport_be)?;
    pkt.dport_be = to.dport_be;
    rewrite_addr(ctx, pkt, IP6_SRC_OFF, &pkt.saddr_be, &to.saddr_be)?;
    pkt.saddr_be = to.saddr_be;
    rewrite_port(ctx, pkt, pkt.l4_off, pkt.sport_be, to.sport_be)?;
    pkt.sport_be = to.sport_be;
    Ok(())
}

/// The XDP path's rewrite ([`crate::xdp6`]), the twin of
/// [`crate::nat::xdp_rewrite`]: the frame's addresses and ports in place to `to`, the L4
/// checksum updated incrementally over the pseudo-header.
#[inline(always)]
pub fn xdp_rewrite(ctx: &XdpContext, pkt: &mut Packet6, to: &Tuple6) -> Result<(), Verdict> {
    let diff = diff128(&pkt.saddr_be, &to.saddr_be)
        + diff128(&pkt.daddr_be, &to.daddr_be)
        + diff16(pkt.sport_be, to.sport_be)
        + diff16(pkt.dport_be, to.dport_be);
    // A constant offset per protocol: one read back from the scratch entry
    // is a number the verifier knows no bound of.
    let c = if pkt.proto == IPPROTO_TCP {
        xdp_ptr::<u16>(ctx, XDP_L4_OFF + 16)
    } else {
        xdp_ptr::<u16>(ctx, XDP_L4_OFF + 6)
    }
    .ok_or(REWRITE_FAILED)?;
    let ip = xdp_ptr::<Ipv6Hdr>(ctx, ETH_HLEN).ok_or(REWRITE_FAILED)?;
    let ports = xdp_ptr::<[u16; 2]>(ctx, XDP_L4_OFF).ok_or(REWRITE_FAILED)?;
    // SAFETY: bounds-checked frame pointers.
    unsafe {
        let old = *c;
        // A UDP checksum of 0 (not allowed over IPv6, but sent) stays; a
        // computed 0 is sent as 0xffff.
        if !(pkt.proto == IPPROTO_UDP && old == 0) {
            let v = apply(old, diff);
            *c = if v == 0 && pkt.proto == IPPROTO_UDP {
                0xffff
            } else {
                v
            };
        }
        (*ip).saddr_be = to.saddr_be;
        (*ip).daddr_be = to.daddr_be;
        *ports = [to.sport_be, to.dport_be];
    }
    pkt.saddr_be = to.saddr_be;
    pkt.daddr_be = to.daddr_be;
    pkt.sport_be = to.sport_be;
    pkt.dport_be = to.dport_be;
    Ok(())
}

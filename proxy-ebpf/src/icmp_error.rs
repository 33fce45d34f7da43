//! ICMP errors about translated flows (netfilter's `RELATED`): a router's
//! "fragmentation needed" or "time exceeded", a backend's "port
//! unreachable", carry the head of the packet they are about, as it was on
//! the wire — with the translated tuple, which no socket knows. Like the
//! kernel's `nf_nat_icmp_reply_translation`, the error is translated with
//! the flow it is about, inner header and outer alike, so path-MTU discovery
//! and `ECONNREFUSED` work through frontends:
//!
//! - about a packet the client sent (inner: the client as the backend sees
//!   it → the backend; the inner turned around is the flow's REPLY key): on
//!   its way to the client, inner back to client → frontend, outer from the
//!   frontend to the client's own address;
//! - about a reply (inner: frontend → client, as it left this node; turned
//!   around, the flow's SERVICE key): on its way to the backend, inner
//!   backend → the client as the backend sees it, outer to the backend (from
//!   the node's address when the flow is SNATed).
//!
//! The inner IPv4 checksum, the inner L4 checksum when the error carries it
//! (UDP's always, TCP's when 20 bytes of the header came along), the ICMP
//! checksum and the outer IPv4 checksum are updated incrementally. Errors of
//! flows delivered through the host's stack are translated where their
//! replies are: at the last hook towards the client.

use aya_ebpf::{
    bindings::{BPF_F_RECOMPUTE_CSUM, TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use proxy_common::{
    csum::{apply, diff16, diff32},
    ct_dir, ct_flags, stat, Ct4Key, Ct4Value, IPPROTO_ICMP, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP,
};

use crate::{
    family::{Family, V4},
    fib,
    lb::rev_nat,
    maps::CT4_V2,
    parse::{Ipv4Hdr, Packet, ETH_HLEN},
    verdict::Verdict,
};

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;
/// IPv4 `frag_off`: the fragment offset and the more-fragments flag.
const IP_FRAG_MASK: u16 = 0x3fff;
/// IPv4 `frag_off`: the fragment offset alone.
const IP_OFFSET_MASK: u16 = 0x1fff;

/// What an ICMP error about a TCP or UDP packet holds at least (RFC 792:
/// the inner IPv4 header and 8 bytes of its payload), as in the packet after
/// the Ethernet header. Only IPv4 headers without options, outer and inner.
#[repr(C)]
#[derive(Clone, Copy)]
struct IcmpError4 {
    outer: Ipv4Hdr,
    icmp_type: u8,
    icmp_code: u8,
    icmp_check: u16,
    icmp_rest: u32,
    inner: Ipv4Hdr,
    sport_be: u16,
    dport_be: u16,
    /// UDP: length, checksum. TCP: the sequence number.
    l4_rest: [u16; 2],
}
const _: () = assert!(core::mem::size_of::<IcmpError4>() == 56);

/// Offset of the inner TCP checksum in the packet (outside [`IcmpError4`]).
const INNER_TCP_CSUM_OFF: usize = ETH_HLEN + 48 + 16;

/// The translated addresses and ports of an error: outer, then inner.
struct Rewrite {
    outer_saddr_be: u32,
    outer_daddr_be: u32,
    inner_saddr_be: u32,
    inner_daddr_be: u32,
    sport_be: u16,
    dport_be: u16,
}

/// An ICMP error about a TCP or UDP packet of a translated flow, seen at tc
/// (`last_hook`: at egress towards the client): translated and delivered as
/// the flow's own packets are; anything else passes untouched as
/// `PASS_OTHER_PROTO`. Returns the tc action and its counter.
///
/// A function of its own (a BPF subprogram): its locals stay out of the
/// program's top frame, which the TCP/UDP path fills (the verifier limits
/// the combined stack of nested calls to 512 bytes).
#[inline(never)]
pub fn translate(ctx: &TcContext, last_hook: bool) -> (i32, u32) {
    let mut pkt = Packet {
        l4_off: ETH_HLEN + 20,
        csum_off: ETH_HLEN + 22,
        proto: IPPROTO_ICMP,
        saddr_be: 0,
        daddr_be: 0,
        sport_be: 0,
        dport_be: 0,
        tot_len: 0,
        tcp_flags: 0,
        l4_present: true,
    };
    match rewritten(ctx, last_hook, &mut pkt) {
        Verdict::Deliver(code) => fib::deliver(ctx, &pkt, code),
        Verdict::Drop(code) => (TC_ACT_SHOT, code),
        Verdict::Pass(code) | Verdict::Reject(code) => (TC_ACT_OK, code),
    }
}

/// The error translated in the packet, and `Deliver` with the outer
/// addresses and length in `pkt`; `Pass(PASS_OTHER_PROTO)` when it is no
/// error of a translated flow. A subprogram of its own too, so that its
/// locals and the delivery's are never on the stack at once.
#[inline(never)]
fn rewritten(ctx: &TcContext, last_hook: bool, pkt: &mut Packet) -> Verdict {
    let pass = Verdict::Pass(stat::PASS_OTHER_PROTO);
    let Ok(mut m) = ctx.load::<IcmpError4>(ETH_HLEN) else {
        return pass;
    };
    if !about_tcp_or_udp(&m) {
        return pass;
    }
    // The inner packet turned around: the key its flow's entries have.
    let mut key = Ct4Key {
        saddr_be: m.inner.daddr_be,
        daddr_be: m.inner.saddr_be,
        sport_be: m.dport_be,
        dport_be: m.sport_be,
        proto: m.inner.proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    };
    let (to, code, via_stack) = if let Some(r) = CT4_V2.get_ptr(key) {
        // SAFETY: map value pointer, its fields read where used.
        let r = unsafe { &*r };
        let via_stack = r.flags & ct_flags::VIA_STACK != 0;
        if via_stack && !last_hook {
            return Verdict::Pass(stat::PASS_REPLY_VIA_STACK);
        }
        let Some(rev) = rev_nat(r.rev_nat_id) else {
            return pass;
        };
        let (client_be, client_port_be) = client_of(&m, r);
        let to = Rewrite {
            outer_saddr_be: rev.addr_be,
            outer_daddr_be: if r.flags & ct_flags::SNAT_ADDR != 0 {
                r.nat_addr_be
            } else {
                m.outer.daddr_be
            },
            inner_saddr_be: client_be,
            inner_daddr_be: rev.addr_be,
            sport_be: client_port_be,
            dport_be: rev.port_be,
        };
        (to, stat::ICMP_ERROR_TO_CLIENT, via_stack)
    } else {
        if last_hook {
            return pass;
        }
        key.dir = ct_dir::SERVICE;
        let Some(s) = CT4_V2.get_ptr(key) else {
            return pass;
        };
        // SAFETY: map value pointer, its fields read where used.
        let s = unsafe { &*s };
        let Some(b) = V4::backend(s.backend_id) else {
            return pass;
        };
        let snat_addr = s.flags & ct_flags::SNAT_ADDR != 0;
        let to = Rewrite {
            outer_saddr_be: if snat_addr {
                s.nat_addr_be
            } else {
                m.outer.saddr_be
            },
            outer_daddr_be: b.addr_be,
            inner_saddr_be: b.addr_be,
            inner_daddr_be: if snat_addr {
                s.nat_addr_be
            } else {
                m.inner.daddr_be
            },
            sport_be: b.port_be,
            dport_be: if s.flags & ct_flags::SNAT_PORT != 0 {
                s.nat_port_be
            } else {
                m.dport_be
            },
        };
        (
            to,
            stat::ICMP_ERROR_TO_BACKEND,
            s.flags & ct_flags::VIA_STACK != 0,
        )
    };
    if rewrite(ctx, &mut m, &to).is_err() {
        return Verdict::Drop(stat::DROP_REWRITE_FAILED);
    }
    if last_hook || via_stack {
        // The stack forwards it (through its filters), or it is leaving.
        return Verdict::Pass(code);
    }
    pkt.saddr_be = to.outer_saddr_be;
    pkt.daddr_be = to.outer_daddr_be;
    pkt.tot_len = u16::from_be(m.outer.tot_len_be);
    Verdict::Deliver(code)
}

/// An ICMP error (destination unreachable, time exceeded, parameter
/// problem), not fragmented, about the first fragment of a TCP or UDP
/// packet; both IPv4 headers without options.
#[inline(always)]
fn about_tcp_or_udp(m: &IcmpError4) -> bool {
    m.outer.ver_ihl == 0x45
        && m.outer.proto == IPPROTO_ICMP
        && u16::from_be(m.outer.frag_off_be) & IP_FRAG_MASK == 0
        && matches!(
            m.icmp_type,
            ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETERPROB
        )
        && m.inner.ver_ihl == 0x45
        && (m.inner.proto == IPPROTO_TCP
            || m.inner.proto == IPPROTO_UDP
            || m.inner.proto == IPPROTO_SCTP)
        && u16::from_be(m.inner.frag_off_be) & IP_OFFSET_MASK == 0
}

/// The client's own address and port, from REPLY entry `r` of the flow the
/// error's inner packet (sent by the client, as the backend sees it)
/// belongs to.
#[inline(always)]
fn client_of(m: &IcmpError4, r: &Ct4Value) -> (u32, u16) {
    (
        if r.flags & ct_flags::SNAT_ADDR != 0 {
            r.nat_addr_be
        } else {
            m.inner.saddr_be
        },
        if r.flags & ct_flags::SNAT_PORT != 0 {
            r.nat_port_be
        } else {
            m.sport_be
        },
    )
}

/// The inner L4 checksum of an ICMP(v6) error about a packet of `proto`,
/// before and after its tuple changes by the sum of differences
/// `inner_tuple`: TCP's, at `tcp_csum_off`, when 20 bytes of its header
/// came along (`Some`: it is to be written there); UDP's, the error's copy
/// `udp_check`, unless it is 0 ("no checksum"; a computed 0 is sent as
/// 0xffff); otherwise none, left as it is. (TCP's, old, new.)
#[inline(always)]
pub fn inner_l4_check(
    ctx: &TcContext,
    proto: u8,
    tcp_csum_off: usize,
    udp_check: u16,
    inner_tuple: u32,
) -> (Option<u16>, u16, u16) {
    let tcp_check = if proto == IPPROTO_TCP && ctx.len() as usize >= tcp_csum_off + 2 {
        ctx.load::<u16>(tcp_csum_off).ok()
    } else {
        None
    };
    let old = match tcp_check {
        Some(c) => c,
        None if proto == IPPROTO_UDP => udp_check,
        None => 0,
    };
    let new = match tcp_check {
        Some(c) => apply(c, inner_tuple),
        None if proto == IPPROTO_UDP && old != 0 => match apply(old, inner_tuple) {
            0 => 0xffff,
            c => c,
        },
        None => old,
    };
    (tcp_check, old, new)
}

/// Writes `to` into the error, every checksum kept valid.
#[inline(always)]
fn rewrite(ctx: &TcContext, m: &mut IcmpError4, to: &Rewrite) -> Result<(), ()> {
    let outer =
        diff32(m.outer.saddr_be, to.outer_saddr_be) + diff32(m.outer.daddr_be, to.outer_daddr_be);
    let inner_addrs =
        diff32(m.inner.saddr_be, to.inner_saddr_be) + diff32(m.inner.daddr_be, to.inner_daddr_be);
    // The inner L4 checksum covers the pseudo-header and the ports.
    let inner_tuple =
        inner_addrs + diff16(m.sport_be, to.sport_be) + diff16(m.dport_be, to.dport_be);
    let ip_check_old = m.inner.check;
    let ip_check_new = apply(ip_check_old, inner_addrs);
    let (tcp_check, l4_check_old, l4_check_new) = inner_l4_check(
        ctx,
        m.inner.proto,
        INNER_TCP_CSUM_OFF,
        m.l4_rest[1],
        inner_tuple,
    );
    // The ICMP checksum covers the inner header and the part of its payload
    // the error carries, with no pseudo-header.
    m.icmp_check = apply(
        m.icmp_check,
        inner_tuple + diff16(ip_check_old, ip_check_new) + diff16(l4_check_old, l4_check_new),
    );
    m.outer.check = apply(m.outer.check, outer);
    m.outer.saddr_be = to.outer_saddr_be;
    m.outer.daddr_be = to.outer_daddr_be;
    m.inner.saddr_be = to.inner_saddr_be;
    m.inner.daddr_be = to.inner_daddr_be;
    m.inner.check = ip_check_new;
    m.sport_be = to.sport_be;
    m.dport_be = to.dport_be;
    if m.inner.proto == IPPROTO_UDP {
        m.l4_rest[1] = l4_check_new;
    }
    let flags = BPF_F_RECOMPUTE_CSUM as u64;
    ctx.store(ETH_HLEN, m, flags).map_err(|_| ())?;
    if tcp_check.is_some() {
        ctx.store(INNER_TCP_CSUM_OFF, &l4_check_new, flags)
            .map_err(|_| ())?;
    }
    Ok(())
}

//! ICMPv6 errors about translated IPv6 flows, as [`crate::icmp_error`] does
//! for IPv4 (the kernel's `nf_nat_icmpv6_reply_translation`): a router's
//! "packet too big" (IPv6 routers never fragment: path-MTU discovery is the
//! only way a flow learns a smaller MTU), "time exceeded", a backend's "port
//! unreachable" carry the head of the packet they are about with the
//! translated tuple, which no socket knows. The error is translated with the
//! flow it is about:
//!
//! - about a packet the client sent (inner: the client as the backend sees
//!   it → the backend; turned around, the flow's REPLY key): to the client,
//!   inner back to client → frontend, outer from the frontend to the
//!   client's own address;
//! - about a reply (inner: frontend → client; turned around, the flow's
//!   SERVICE key): to the backend, inner backend → the client as the backend
//!   sees it, outer to the backend (from the node's address when the flow is
//!   SNATed).
//!
//! IPv6 has no header checksum: the ICMPv6 checksum (over the outer
//! pseudo-header and the message) and the inner L4 checksum when the error
//! carries it (UDP's always, TCP's when 20 bytes of the header came along)
//! are updated incrementally. Only errors whose outer and inner headers have
//! no extension header are translated; others pass untouched.

// Map keys and values are passed by reference (`get_ptr(&key)`): by value,
// each call's copy of a 40-byte IPv6 key takes stack the verifier counts
// against its 512 bytes for the whole chain of calls.
#![allow(clippy::needless_borrows_for_generic_args)]

use core::mem::size_of;

use aya_ebpf::{
    bindings::{BPF_F_RECOMPUTE_CSUM, TC_ACT_OK, TC_ACT_SHOT},
    btf_maps::PerCpuArray,
    helpers::bpf_skb_load_bytes,
    macros::btf_map,
    programs::TcContext,
};
use proxy_common::{
    csum::{apply, diff128, diff16},
    ct_dir, ct_flags, stat, Addr6, Ct6Key, Ct6Value, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP,
};

use crate::{
    icmp_error::inner_l4_check,
    maps::{BACKEND6_V1, CT6_V2, REVNAT6_V2},
    parse::ETH_HLEN,
    parse6::{Ipv6Hdr, Packet6},
    verdict::Verdict,
};

const IPPROTO_ICMPV6: u8 = 58;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PACKET_TOO_BIG: u8 = 2;
const ICMPV6_TIME_EXCEED: u8 = 3;
const ICMPV6_PARAMPROB: u8 = 4;

/// What an ICMPv6 error about a TCP, UDP or SCTP packet holds at least (the
/// inner IPv6 header and 8 bytes of its payload), after the Ethernet header.
#[repr(C)]
#[derive(Clone, Copy)]
struct IcmpError6 {
    outer: Ipv6Hdr,
    icmp_type: u8,
    icmp_code: u8,
    icmp_check: u16,
    icmp_rest: u32,
    inner: Ipv6Hdr,
    sport_be: u16,
    dport_be: u16,
    /// UDP: length, checksum. TCP: the sequence number.
    l4_rest: [u16; 2],
}
const _: () = assert!(size_of::<IcmpError6>() == 96);

/// Offset of the inner TCP checksum in the packet (outside [`IcmpError6`]).
const INNER_TCP_CSUM_OFF: usize = ETH_HLEN + 40 + 8 + 40 + 16;

/// Per-CPU room for an error and its translation (the verifier allows 512
/// bytes of stack for the whole chain of calls; an error alone is 96).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Scratch {
    m: IcmpError6,
    to: Rewrite6,
    key: Ct6Key,
}

#[btf_map]
static ICMP6_SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

/// The translated addresses and ports of an error: outer, then inner.
#[repr(C)]
#[derive(Clone, Copy)]
struct Rewrite6 {
    outer_saddr_be: Addr6,
    outer_daddr_be: Addr6,
    inner_saddr_be: Addr6,
    inner_daddr_be: Addr6,
    sport_be: u16,
    dport_be: u16,
}

/// An ICMPv6 error about a packet of a translated flow, seen at tc
/// (`last_hook`: at egress towards the client): translated and delivered
/// as the flow's packets are; anything else passes untouched as
/// `PASS_OTHER_PROTO`. A BPF call of its own.
#[inline(never)]
pub fn translate(ctx: &TcContext, last_hook: bool) -> (i32, u32) {
    let mut pkt = Packet6::default();
    // Planned, then written, then delivered: three sibling calls, so that
    // their frames never stack on one another.
    let verdict = match planned(ctx, last_hook) {
        Verdict::Deliver(code) => {
            if written(ctx, &mut pkt) {
                Verdict::Deliver(code)
            } else {
                Verdict::Drop(stat::DROP_REWRITE_FAILED)
            }
        }
        // Translated, but the stack forwards it (through its filters), or
        // it is leaving: written, not delivered here.
        Verdict::Reject(code) => {
            if written(ctx, &mut pkt) {
                Verdict::Pass(code)
            } else {
                Verdict::Drop(stat::DROP_REWRITE_FAILED)
            }
        }
        v => v,
    };
    match verdict {
        Verdict::Deliver(code) => crate::fib::deliver6(ctx, &pkt, code),
        Verdict::Drop(code) => (TC_ACT_SHOT, code),
        Verdict::Pass(code) | Verdict::Reject(code) => (TC_ACT_OK, code),
    }
}

/// Writes the translation [`planned`] left in the scratch entry into the
/// packet; the outer addresses into `pkt`. False when the write failed.
#[inline(never)]
fn written(ctx: &TcContext, pkt: &mut Packet6) -> bool {
    let Some(sc) = ICMP6_SCRATCH.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's scratch entry, as `planned` left it.
    let (m, to) = unsafe { (&mut (*sc).m, &(*sc).to) };
    if rewrite(ctx, m, to).is_err() {
        return false;
    }
    pkt.set_error_addrs(&to.outer_saddr_be, &to.outer_daddr_be);
    true
}

/// The error and its translation, read and planned into the scratch entry:
/// `Deliver` when it is to be written and delivered, `Reject` when it is to
/// be written and passed (the flow is delivered through the stack, or this
/// is the last hook); `Pass(PASS_OTHER_PROTO)` when it is no error of a
/// translated flow.
#[inline(never)]
fn planned(ctx: &TcContext, last_hook: bool) -> Verdict {
    let pass = Verdict::Pass(stat::PASS_OTHER_PROTO);
    let Some(sc) = ICMP6_SCRATCH.get_ptr_mut(0) else {
        return pass;
    };
    // SAFETY: this CPU's scratch entry, ours until this run returns.
    let (m, to, key) = unsafe { (&mut (*sc).m, &mut (*sc).to, &mut (*sc).key) };
    // SAFETY: the error's head read into the scratch entry, whole or not at
    // all (a shorter packet fails the helper).
    let rc = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb as *const _,
            ETH_HLEN as u32,
            (m as *mut IcmpError6).cast(),
            size_of::<IcmpError6>() as u32,
        )
    };
    if rc != 0 || !about_a_flow(m) {
        return pass;
    }
    key.saddr_be = m.inner.daddr_be;
    key.daddr_be = m.inner.saddr_be;
    key.sport_be = m.dport_be;
    key.dport_be = m.sport_be;
    key.proto = m.inner.nexthdr;
    key.dir = ct_dir::REPLY;
    key._pad = [0; 2];
    let (code, via_stack) = if let Some(r) = CT6_V2.get_ptr(&*key) {
        // SAFETY: map value pointer, its fields read where used.
        let r: &Ct6Value = unsafe { &*r };
        let via_stack = r.flags & ct_flags::VIA_STACK != 0;
        if via_stack && !last_hook {
            return Verdict::Pass(stat::PASS_REPLY_VIA_STACK);
        }
        let Some(rev) = REVNAT6_V2.get_ptr(r.rev_nat_id) else {
            return pass;
        };
        // SAFETY: map value pointer, read in place.
        let rev = unsafe { &*rev };
        // To the client: from the frontend, its own address restored.
        let snat_addr = r.flags & ct_flags::SNAT_ADDR != 0;
        to.outer_saddr_be = rev.addr_be;
        to.outer_daddr_be = if snat_addr {
            r.nat_addr_be
        } else {
            m.outer.daddr_be
        };
        to.inner_saddr_be = if snat_addr {
            r.nat_addr_be
        } else {
            m.inner.saddr_be
        };
        to.inner_daddr_be = rev.addr_be;
        to.sport_be = if r.flags & ct_flags::SNAT_PORT != 0 {
            r.nat_port_be
        } else {
            m.sport_be
        };
        to.dport_be = rev.port_be;
        (stat::ICMP_ERROR_TO_CLIENT, via_stack)
    } else {
        if last_hook {
            return pass;
        }
        key.dir = ct_dir::SERVICE;
        let Some(s) = CT6_V2.get_ptr(&*key) else {
            return pass;
        };
        // SAFETY: map value pointer, its fields read where used.
        let s: &Ct6Value = unsafe { &*s };
        let Some(b) = BACKEND6_V1.get_ptr(s.backend_id) else {
            return pass;
        };
        // SAFETY: map value pointer, read in place.
        let b = unsafe { &*b };
        // To the backend: about the reply it sent, as it sent it.
        let snat_addr = s.flags & ct_flags::SNAT_ADDR != 0;
        to.outer_saddr_be = if snat_addr {
            s.nat_addr_be
        } else {
            m.outer.saddr_be
        };
        to.outer_daddr_be = b.addr_be;
        to.inner_saddr_be = b.addr_be;
        to.inner_daddr_be = if snat_addr {
            s.nat_addr_be
        } else {
            m.inner.daddr_be
        };
        to.sport_be = b.port_be;
        to.dport_be = if s.flags & ct_flags::SNAT_PORT != 0 {
            s.nat_port_be
        } else {
            m.dport_be
        };
        (
            stat::ICMP_ERROR_TO_BACKEND,
            s.flags & ct_flags::VIA_STACK != 0,
        )
    };
    if last_hook || via_stack {
        return Verdict::Reject(code);
    }
    Verdict::Deliver(code)
}

/// An ICMPv6 error (destination unreachable, packet too big, time exceeded,
/// parameter problem) right after the outer header, about a TCP, UDP or
/// SCTP packet whose L4 header follows its IPv6 header.
#[inline(always)]
fn about_a_flow(m: &IcmpError6) -> bool {
    m.outer.nexthdr == IPPROTO_ICMPV6
        && matches!(
            m.icmp_type,
            ICMPV6_DEST_UNREACH | ICMPV6_PACKET_TOO_BIG | ICMPV6_TIME_EXCEED | ICMPV6_PARAMPROB
        )
        && u32::from_be(m.inner.vtc_flow_be) >> 28 == 6
        && (m.inner.nexthdr == IPPROTO_TCP
            || m.inner.nexthdr == IPPROTO_UDP
            || m.inner.nexthdr == IPPROTO_SCTP)
}

/// Writes `to` into the error, its checksums kept valid.
#[inline(always)]
fn rewrite(ctx: &TcContext, m: &mut IcmpError6, to: &Rewrite6) -> Result<(), ()> {
    // The ICMPv6 checksum covers the outer pseudo-header.
    let outer = diff128(&m.outer.saddr_be, &to.outer_saddr_be)
        + diff128(&m.outer.daddr_be, &to.outer_daddr_be);
    let inner_addrs = diff128(&m.inner.saddr_be, &to.inner_saddr_be)
        + diff128(&m.inner.daddr_be, &to.inner_daddr_be);
    let inner_tuple =
        inner_addrs + diff16(m.sport_be, to.sport_be) + diff16(m.dport_be, to.dport_be);
    let (tcp_check, l4_check_old, l4_check_new) = inner_l4_check(
        ctx,
        m.inner.nexthdr,
        INNER_TCP_CSUM_OFF,
        m.l4_rest[1],
        inner_tuple,
    );
    m.icmp_check = apply(
        m.icmp_check,
        outer + inner_tuple + diff16(l4_check_old, l4_check_new),
    );
    m.outer.saddr_be = to.outer_saddr_be;
    m.outer.daddr_be = to.outer_daddr_be;
    m.inner.saddr_be = to.inner_saddr_be;
    m.inner.daddr_be = to.inner_daddr_be;
    m.sport_be = to.sport_be;
    m.dport_be = to.dport_be;
    if m.inner.nexthdr == IPPROTO_UDP {
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

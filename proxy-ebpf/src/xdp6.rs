//! The XDP path for IPv6 (`ext_xdp6`, tail-called by `ext_xdp` for IPv6
//! frames): as IPv4's [`crate::xdp`], external traffic to backends on other
//! nodes (DNAT, SNAT to the node's IPv6 address) and their replies are
//! translated at the driver and sent back out (XDP_TX) or to another device
//! (XDP_REDIRECT) after a FIB lookup ([`crate::fib::xdp_fib`],
//! [`crate::fib::xdp_out`], IPv4's too), with the flow decisions of the tc
//! path ([`crate::ipv6`]); its parse and in-place rewrite are beside their
//! IPv4 twins ([`crate::parse6::parse_xdp`],
//! [`crate::rewrite6::xdp_rewrite`]). Everything else — flows to local
//! backends (their conntrack entries written first, so tc keeps the backend
//! chosen here), extension headers, fragments, SCTP, no backend (tc
//! rejects), a new flow none of whose source ports was free, packets without
//! a usable FIB answer — is passed on to tc untouched.

// Map keys and values are passed by reference (`get_ptr(&key)`): by value,
// each call's copy of a 40-byte IPv6 key takes stack the verifier counts
// against its 512 bytes for the whole chain of calls.
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::{
    bindings::xdp_action, btf_maps::ProgramArray, helpers::bpf_ktime_get_ns, macros::btf_map,
    programs::XdpContext,
};
use proxy_common::{backend_state, stat, Svc6Key, SCOPE_EXTERNAL};

use crate::{
    family::{Family, V6},
    ipv6::{self, ESTABLISHED, ETH_P_IPV6, NOT_ESTABLISHED},
    maps::{account, count, SVC6_V2},
    parse::{xdp_ptr, ETH_HLEN},
    parse6::{parse_xdp, Ipv6Hdr, Packet6, Tuple6},
    rewrite6::xdp_rewrite,
    verdict::Verdict,
};

/// The XDP program for IPv6 that `ext_xdp` tail-calls; filled by the agent
/// when it loads XDP acceleration ([`proxy_common::map_names::TAIL6_XDP`]).
#[btf_map]
pub static TAIL6_XDP_V1: ProgramArray<1> = ProgramArray::new();

/// Whether an XDP frame is IPv6 (its EtherType).
#[inline(always)]
pub fn is_ipv6(ctx: &XdpContext) -> bool {
    match xdp_ptr::<u16>(ctx, 12) {
        // SAFETY: bounds-checked frame pointer.
        Some(p) => u16::from_be(unsafe { *p }) == ETH_P_IPV6,
        None => false,
    }
}

/// Handed to tc untouched (not counted here: tc counts the packet).
const DEFER: Verdict = Verdict::Pass(stat::XDP_DEFERRED);
const REWRITE_FAILED: Verdict = Verdict::Drop(stat::DROP_REWRITE_FAILED);

/// Runs the IPv6 XDP path; returns the XDP action and its counter
/// (`XDP_DEFERRED` is not counted: tc counts the packet).
#[inline(always)]
pub fn run(ctx: &XdpContext) -> (u32, u32) {
    let r = path(ctx);
    ((r >> 32) as u32, r as u32)
}

/// [`try_run`] as one word (action in the high half, counter in the low):
/// a BPF call of its own, so the entry's frame holds nothing and the
/// deepest chain of frames is this path's.
#[inline(never)]
fn path(ctx: &XdpContext) -> u64 {
    let (action, code) = match try_run(ctx) {
        Ok(v) => v,
        Err(Verdict::Drop(code)) => (xdp_action::XDP_DROP, code),
        Err(Verdict::Pass(_) | Verdict::Deliver(_) | Verdict::Reject(_)) => {
            (xdp_action::XDP_PASS, stat::XDP_DEFERRED)
        }
    };
    (u64::from(action) << 32) | u64::from(code)
}

#[inline(always)]
fn try_run(ctx: &XdpContext) -> Result<(u32, u32), Verdict> {
    let sc = ipv6::scratch()?;
    // SAFETY: this CPU's scratch entry: `pkt` and `to` are this
    // packet's (the flow's fields are the flow functions').
    let (pkt, to) = unsafe { (&mut (*sc).pkt, &mut (*sc).to) };
    if !parse_xdp(ctx, pkt) {
        return Err(DEFER);
    }
    let len = (ctx.data_end() - ctx.data()) as u64;
    let key = V6::frontend_key(pkt, SCOPE_EXTERNAL);
    let (code, rev_nat_id, backend_id) = match SVC6_V2.get_ptr(&key) {
        Some(fe) => {
            // SAFETY: map value pointer, copied.
            let fe = unsafe { *fe };
            forward(pkt, &key, &fe, to)?
        }
        None => {
            let ids = reply(pkt, to);
            if ids == 0 {
                return Err(DEFER);
            }
            (
                stat::FWD_REPLY,
                (ids >> 32) as proxy_common::RevNatId,
                ids as u32,
            )
        }
    };
    let sent = transmit(ctx, pkt, to, code)?;
    // Accounted only once sent: a packet handed on to tc is accounted there.
    account(len, rev_nat_id, backend_id);
    Ok(sent)
}

/// A reply of a tracked flow ([`ipv6::reply_plan`], `to` set): its
/// reverse-NAT id in the high half, its backend id in the low; 0 when it is
/// none (or left to tc). A BPF call of its own (a sibling of
/// [`ipv6::new_flow`]'s: their frames never stack).
#[inline(never)]
fn reply(pkt: &Packet6, to: &mut Tuple6) -> u64 {
    match ipv6::reply_plan(pkt, false, to) {
        Ok((rev_nat_id, backend_id)) => (u64::from(rev_nat_id) << 32) | u64::from(backend_id),
        Err(_) => 0,
    }
}

/// A packet to frontend `fe` (at `key`): conntrack first, else a new flow,
/// as tc decides; `to`, where it goes. (counter, reverse-NAT id, backend id).
#[inline(always)]
fn forward(
    pkt: &Packet6,
    key: &Svc6Key,
    fe: &proxy_common::SvcValue,
    to: &mut Tuple6,
) -> Result<(u32, proxy_common::RevNatId, u32), Verdict> {
    let est = ipv6::established(pkt);
    if est > ESTABLISHED {
        return Err(DEFER);
    }
    let sc = ipv6::scratch()?;
    // SAFETY: this CPU's scratch entry; `flow` is this flow's.
    let flow = unsafe { &mut (*sc).flow };
    if est == NOT_ESTABLISHED {
        match ipv6::new_flow(pkt, key, fe, flow) {
            Ok(()) => {}
            Err(Verdict::Deliver(stat::FWD_HANDOFF)) => {
                // Untranslated, routed towards the backend (so to its node).
                to.saddr_be = pkt.saddr_be;
                to.daddr_be = flow.backend.addr_be;
                to.sport_be = pkt.sport_be;
                to.dport_be = pkt.dport_be;
                return Ok((stat::FWD_HANDOFF, fe.rev_nat_id, flow.backend_id));
            }
            // Reject, pass, a flow without a free source port: tc does the
            // rest.
            Err(Verdict::Pass(_) | Verdict::Reject(_) | Verdict::Drop(stat::DROP_NO_FREE_PORT)) => {
                return Err(DEFER)
            }
            Err(v) => return Err(v),
        }
    }
    let code = chosen(pkt, fe.rev_nat_id, est == ESTABLISHED, to);
    if code == 0 {
        return Err(DEFER);
    }
    Ok((code, fe.rev_nat_id, flow.backend_id))
}

/// The flow in the scratch entry, chosen: its REPLY entry, and `to` set;
/// the counter, or 0 when tc is to deliver it (a backend on this node: tc
/// delivers with `bpf_redirect_peer`, following the flow written down
/// here). A BPF call of its own (a sibling of [`ipv6::new_flow`]'s).
#[inline(never)]
fn chosen(
    pkt: &Packet6,
    rev_nat_id: proxy_common::RevNatId,
    established: bool,
    to: &mut Tuple6,
) -> u32 {
    let Ok(sc) = ipv6::scratch() else {
        return 0;
    };
    // SAFETY: this CPU's scratch entry; `flow` is this flow's.
    let flow = unsafe { &(*sc).flow };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    crate::conntrack::ensure_reply(pkt, flow, rev_nat_id, established, now);
    if flow.backend.state & backend_state::LOCAL != 0 {
        return 0;
    }
    crate::nat::forward_into(to, pkt, flow);
    if established {
        stat::FWD_ESTABLISHED
    } else {
        stat::FWD_NEW
    }
}

/// The FIB's answer for `to` first (what XDP cannot send itself goes to tc
/// untouched, which finds the conntrack entries just written), then the
/// rewrite (none for a handoff), hop limit and MACs, and the send. A BPF
/// call of its own: the FIB parameters live in its frame.
#[inline(never)]
fn transmit(
    ctx: &XdpContext,
    pkt: &mut Packet6,
    to: &Tuple6,
    code: u32,
) -> Result<(u32, u32), Verdict> {
    let mut slot = core::mem::MaybeUninit::uninit();
    let p = crate::fib::xdp_fib::<V6>(ctx, pkt.proto, to, pkt.l4_len.saturating_add(40), &mut slot)
        .ok_or(DEFER)?;
    if code != stat::FWD_HANDOFF {
        xdp_rewrite(ctx, pkt, to)?;
    }
    let ip = xdp_ptr::<Ipv6Hdr>(ctx, ETH_HLEN).ok_or(REWRITE_FAILED)?;
    count(code);
    // SAFETY: bounds-checked frame pointer.
    unsafe {
        if (*ip).hop_limit <= 1 {
            // Translated already; the stack answers with time exceeded.
            return Ok((xdp_action::XDP_PASS, stat::PASS_TTL));
        }
        (*ip).hop_limit -= 1;
    }
    Ok(crate::fib::xdp_out(ctx, p))
}

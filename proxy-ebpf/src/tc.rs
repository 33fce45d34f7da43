//! The tc path, shared by `pod_ingress` (internal frontends) and
//! `ext_ingress` (external ones): parse; a packet to a frontend is translated
//! ([`forward::decide`], then the rewrite); otherwise a reply of a tracked
//! flow is reverse-translated; anything else passes untouched. A translated
//! packet is delivered by [`fib::deliver`]; a frontend without endpoints is
//! answered by [`icmp::reject`]; an ICMP error about a translated flow is
//! translated with it ([`icmp_error`]).

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::bpf_ktime_get_ns,
    programs::TcContext,
};
use proxy_common::{ct_flags, stat, SvcValue, SCOPE_EXTERNAL};

use crate::{
    conntrack::{self, Flow},
    family::{Family, V4},
    fib, forward, icmp, icmp_error,
    lb::rev_nat,
    maps::{account, count, SVC4_V2},
    nat,
    parse::{self, Ipv4Hdr, Packet},
    verdict::Verdict,
};

/// Runs the tc path for frontends of `scope`; returns the tc action and the
/// counter it is recorded under. `SEARCH`: a new flow whose random source-port
/// tries fail searches the whole SNAT range ([`nat::search_nat_port`],
/// `bpf_loop`); the programs built without it are for kernels that lack the
/// helper (a program that so much as references a loop callback is refused
/// there), and drop such a flow.
#[inline(always)]
pub fn run<const SEARCH: bool>(ctx: &TcContext, scope: u8) -> (i32, u32) {
    let (mut pkt, ip, l4_end) = match parse::parse(ctx) {
        Ok(p) => p,
        // Perhaps an ICMP error about a translated flow.
        Err(Verdict::Pass(stat::PASS_OTHER_PROTO)) => return icmp_error::translate(ctx, false),
        Err(Verdict::Drop(code)) => return (TC_ACT_SHOT, code),
        Err(Verdict::Pass(code) | Verdict::Deliver(code) | Verdict::Reject(code)) => {
            return (TC_ACT_OK, code)
        }
    };
    let verdict = steps::<SEARCH>(ctx, &mut pkt, l4_end, scope);
    act(ctx, &pkt, &ip, verdict)
}

/// tc egress of pod interfaces: replies the node's own stack sends to a pod
/// (from a hostNetwork backend on this node, which the pod reached through a
/// frontend) get their reverse NAT here, the last hook before the pod; the
/// packet then goes on as the stack routed it. Everything else passes.
#[inline(always)]
pub fn run_egress(ctx: &TcContext) -> (i32, u32) {
    let (mut pkt, _ip, l4_end) = match parse::parse(ctx) {
        Ok(p) => p,
        // At the last hook an error is never delivered here: it goes on.
        Err(Verdict::Pass(stat::PASS_OTHER_PROTO)) => return icmp_error::translate(ctx, true),
        Err(
            Verdict::Drop(code)
            | Verdict::Pass(code)
            | Verdict::Deliver(code)
            | Verdict::Reject(code),
        ) => return (TC_ACT_OK, code),
    };
    let l4_complete = ctx.len() as usize >= l4_end;
    match reply(ctx, &mut pkt, l4_complete, true) {
        Verdict::Drop(code) => (TC_ACT_SHOT, code),
        Verdict::Pass(code) | Verdict::Deliver(code) | Verdict::Reject(code) => (TC_ACT_OK, code),
    }
}

/// The verdict as a tc action: delivery and the reject run here, in the
/// program's top frame.
#[inline(always)]
fn act(ctx: &TcContext, pkt: &Packet, ip: &Ipv4Hdr, verdict: Verdict) -> (i32, u32) {
    match verdict {
        Verdict::Pass(code) => (TC_ACT_OK, code),
        Verdict::Drop(code) => (TC_ACT_SHOT, code),
        Verdict::Deliver(code) => fib::deliver(ctx, pkt, code),
        Verdict::Reject(_) => icmp::reject(ctx, ip),
    }
}

#[inline(always)]
fn steps<const SEARCH: bool>(
    ctx: &TcContext,
    pkt: &mut Packet,
    l4_end: usize,
    scope: u8,
) -> Verdict {
    let frontend = SVC4_V2.get_ptr(V4::frontend_key(pkt, scope));
    let l4_complete = ctx.len() as usize >= l4_end;
    let Some(frontend) = frontend else {
        // Not for a frontend: perhaps a reply of a tracked flow.
        return reply(ctx, pkt, l4_complete, false);
    };
    if !l4_complete {
        return Verdict::Drop(stat::DROP_MALFORMED);
    }
    if let Err(v) = parse::load_tcp_flags(ctx, pkt) {
        return v;
    }
    // SAFETY: a map value pointer, read once into a copy.
    let fe = unsafe { *frontend };
    translate::<SEARCH>(ctx, pkt, &fe, scope)
}

/// A packet to frontend `fe`: the forward decision, then DNAT (and SNAT for
/// hairpin, another node, or a port collision).
#[inline(always)]
fn translate<const SEARCH: bool>(
    ctx: &TcContext,
    pkt: &mut Packet,
    fe: &SvcValue,
    scope: u8,
) -> Verdict {
    let mut slot = core::mem::MaybeUninit::uninit();
    let flow: &mut Flow<V4> = crate::zeroed::zeroed(&mut slot);
    let mut verdict = forward::decide(pkt, fe, scope, flow);
    if SEARCH && matches!(verdict, Verdict::Drop(stat::DROP_NO_FREE_PORT)) {
        // Random tries failed: the whole range, from this frame.
        if let Some(port_be) = nat::search_nat_port(pkt, flow) {
            verdict = forward::commit_searched(pkt, fe, flow, port_be);
        }
    }
    if !matches!(verdict, Verdict::Deliver(_)) {
        return verdict;
    }
    account(ctx.len() as u64, fe.rev_nat_id, flow.backend_id);
    if matches!(verdict, Verdict::Deliver(stat::FWD_HANDOFF)) {
        // Untranslated, routed towards the backend (so to its node).
        pkt.daddr_be = flow.backend.addr_be;
        return verdict;
    }
    let to = nat::forward_tuple(pkt, flow);
    if let Err(v) = nat::rewrite(ctx, pkt, &to) {
        return v;
    }
    if flow.flags & ct_flags::SNAT_ADDR != 0 && scope != SCOPE_EXTERNAL {
        count(stat::HAIRPIN);
    }
    if flow.flags & ct_flags::VIA_STACK != 0 {
        // `deliveryMode: stack`: the host's stack forwards it, through its
        // filters, which see the backend.
        if let Verdict::Deliver(code) = verdict {
            count(code);
        }
        return Verdict::Pass(stat::DELIVER_STACK);
    }
    verdict
}

/// The reply direction of a tracked flow: reverse NAT (source back to the
/// frontend; for SNATed flows the destination back to the client), and the
/// flow's state and age follow the reply ([`conntrack::reply_seen`]).
/// `Pass(PASS_NO_SERVICE)` when the packet is no such reply.
///
/// `last_hook`: called at tc egress towards the client. A flow delivered
/// through the stack is reverse-translated only there, so the host's filters
/// see its replies as they see its forward packets (from the backend); the
/// first hook a reply meets passes it untouched.
fn reply(ctx: &TcContext, pkt: &mut Packet, l4_complete: bool, last_hook: bool) -> Verdict {
    let Some((rptr, ct)) = conntrack::lookup_reply::<V4>(pkt) else {
        return Verdict::Pass(stat::PASS_NO_SERVICE);
    };
    if !l4_complete {
        return Verdict::Pass(stat::PASS_MALFORMED);
    }
    if ct.flags & ct_flags::VIA_STACK != 0 && !last_hook {
        return Verdict::Pass(stat::PASS_REPLY_VIA_STACK);
    }
    // The frontend is gone: nothing to translate back to.
    let Some(rev) = rev_nat(ct.rev_nat_id) else {
        return Verdict::Pass(stat::PASS_NO_SERVICE);
    };
    // Complete L4 header (checked above): the flags can be read.
    let _ = parse::load_tcp_flags(ctx, pkt);
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    conntrack::reply_seen::<V4>(pkt, rptr, &ct, &rev, now);
    account(ctx.len() as u64, ct.rev_nat_id, ct.backend_id);
    let to = nat::reverse_tuple::<V4>(pkt, &ct, &rev);
    match nat::rewrite(ctx, pkt, &to) {
        Ok(()) => Verdict::Deliver(stat::FWD_REPLY),
        Err(v) => v,
    }
}

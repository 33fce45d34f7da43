//! The IPv6 tc path: `pod_ingress6`, `ext_ingress6` and `pod_egress6`,
//! reached by tail call from the IPv4 programs when a frame is IPv6
//! ([`TAIL6_V1`]), so each family's program has the verifier's whole budget and
//! its own 512-byte stack.
//!
//! What it does is the IPv4 tc path's, with the IPv6 maps
//! ([`proxy_common::ipv6`]): frontend lookup (`SVC6_V2`), conntrack first
//! (`CT6_V2`), else a new flow — `loadBalancerSourceRanges`
//! (`SRCRANGE6_V2`), a backend chosen as IPv4 chooses (session affinity,
//! then the frontend's algorithm: random, round robin, source hash, Maglev
//! with its handoff — tables and cursors are IPv4's, by reverse-NAT id),
//! the SNAT it needs (the hairpin address for a pod reaching itself; the
//! node's IPv6 address and a port of its own for external traffic to
//! another node's backend under `externalTrafficPolicy: Cluster`), another
//! source port where the backend-side tuple is taken (field bug C6) — DNAT
//! with the L4 checksum kept valid ([`crate::rewrite6`]), delivery by FIB
//! lookup and redirect, reverse NAT of replies. A frontend without
//! endpoints is answered with an ICMPv6 port unreachable. Every step is the
//! IPv4 path's own code, generic over the family ([`crate::family`]):
//! backend selection, conntrack, a new flow's choice and its SNAT
//! ([`crate::forward::new_flow`]), the SNAT port choice, the translated
//! tuples, the FIB lookup and send; what differs between the families
//! stays beside its IPv4 twin: parsing ([`crate::parse6`]), the rewrite
//! ([`crate::rewrite6`]), the hop limit ([`crate::fib::deliver6`]), the
//! ICMPv6 reject ([`crate::icmp::reject6`]). What is this file's own is the
//! order of the steps: IPv6 keys and entries are 40 bytes, so the packet,
//! the flow and its keys live in this CPU's scratch entry ([`Scratch6`]),
//! and each step is a BPF call of its own, made from the entry's frame,
//! where IPv4's path ([`crate::tc`]) keeps them on the stack of one call.
//!
//! Extension headers: hop-by-hop, destination options and a fragment header
//! are walked (up to [`crate::parse6::MAX_EXT_HEADERS`] in all); a routing
//! header or any other passes untouched (`pass_ipv6_ext_header`). Fragments are followed
//! as IPv4's: a first fragment's ports are recorded (`FRAG6_V1`) for the
//! later ones, which carry no L4 header and get only their addresses
//! rewritten; a later fragment whose first was not seen passes untouched
//! (`pass_fragment`). ICMPv6 other than errors about translated flows
//! (neighbour discovery among it) passes untouched.
//!
//! ICMPv6 errors about translated flows are translated with them
//! ([`crate::icmp6_error`]). A new flow whose random source-port tries all
//! fail searches the whole SNAT range, as IPv4's ([`search_nat_port`]; the
//! `_rnd` builds, for kernels without `bpf_loop`, drop it). XDP:
//! [`crate::xdp6`].

// Map keys and values are passed by reference (`get_ptr(&key)`): by value,
// each call's copy of a 40-byte IPv6 key takes stack the verifier counts
// against its 512 bytes for the whole chain of calls.
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    btf_maps::{PerCpuArray, ProgramArray},
    helpers::bpf_ktime_get_ns,
    macros::btf_map,
    programs::TcContext,
};
use proxy_common::{ct_dir, ct_flags, stat, Ct6Key, RevNat6, Svc6Key, SvcValue, SCOPE_EXTERNAL};

use crate::{
    family::{Family, V6},
    forward::config,
    maps::{account, count, REVNAT6_V2, SVC6_V2},
    parse::{tc_load, ETH_HLEN},
    parse6::{parse, Packet6, Tuple6, FRAGMENT_LATER, IPPROTO_ICMPV6},
    rewrite6::rewrite,
    verdict::Verdict,
};

pub const ETH_P_IPV6: u16 = 0x86dd;

/// The IPv6 programs the IPv4 ones tail-call, by index; filled by the agent
/// at load ([`proxy_common::map_names::TAIL6`]).
#[btf_map]
pub static TAIL6_V1: ProgramArray<4> = ProgramArray::new();
/// [`TAIL6_V1`] index of `pod_ingress6`.
pub const TAIL_POD_INGRESS6: u32 = 0;
/// [`TAIL6_V1`] index of `ext_ingress6`.
pub const TAIL_EXT_INGRESS6: u32 = 1;
/// [`TAIL6_V1`] index of `pod_egress6`.
pub const TAIL_POD_EGRESS6: u32 = 2;

/// The IPv6 tc ingress path for frontends of `scope`: a packet to a
/// frontend is translated and delivered; a reply of a tracked flow gets its
/// reverse NAT; an ICMPv6 error about a translated flow is translated with
/// it; anything else passes. Returns the action and its counter.
///
/// The entry's frame holds nothing: an ICMPv6 error and a flow's packet
/// each go on in a BPF call of their own, so the deepest chain of frames
/// (the verifier's 512 bytes) is one of theirs alone.
///
/// `SEARCH`: as IPv4's `tc::run` (the build with the exhaustive SNAT port
/// search, for kernels with `bpf_loop`).
#[inline(always)]
pub fn run<const SEARCH: bool>(ctx: &TcContext, scope: u8) -> (i32, u32) {
    if next_header(ctx) == IPPROTO_ICMPV6 {
        return crate::icmp6_error::translate(ctx, false);
    }
    run_flow::<SEARCH>(ctx, scope)
}

/// The IPv6 header's next header (0xff when unreadable).
#[inline(always)]
fn next_header(ctx: &TcContext) -> u8 {
    tc_load::<u8>(ctx, ETH_HLEN + 6).unwrap_or(0xff)
}

/// The frame, parsed into this CPU's scratch entry; else the action to
/// pass it untouched with.
#[inline(always)]
fn parsed(ctx: &TcContext) -> Result<&'static mut Packet6, (i32, u32)> {
    let sc = scratch().map_err(|_| (TC_ACT_OK, stat::PASS_MALFORMED))?;
    // SAFETY: this CPU's scratch entry; `pkt` is this packet's.
    let pkt = unsafe { &mut (*sc).pkt };
    match parse(ctx, pkt) {
        0 => Ok(pkt),
        code => Err((TC_ACT_OK, code)),
    }
}

#[inline(never)]
fn run_flow<const SEARCH: bool>(ctx: &TcContext, scope: u8) -> (i32, u32) {
    let pkt = match parsed(ctx) {
        Ok(pkt) => pkt,
        Err(pass) => return pass,
    };
    let key = V6::frontend_key(pkt, scope);
    let verdict = match SVC6_V2.get_ptr(&key) {
        // SAFETY: a map value pointer, read once into a copy.
        Some(fe) => translate::<SEARCH>(ctx, pkt, &key, &unsafe { *fe }),
        None => reply(ctx, pkt, false),
    };
    match verdict {
        Verdict::Deliver(code) => crate::fib::deliver6(ctx, pkt, code),
        v => act(ctx, v),
    }
}

/// tc egress of pod interfaces (and external devices): reverse NAT of
/// replies at the last hook, as IPv4's `pod_egress`.
#[inline(always)]
pub fn run_egress(ctx: &TcContext) -> (i32, u32) {
    if next_header(ctx) == IPPROTO_ICMPV6 {
        return crate::icmp6_error::translate(ctx, true);
    }
    run_egress_flow(ctx)
}

#[inline(never)]
fn run_egress_flow(ctx: &TcContext) -> (i32, u32) {
    let pkt = match parsed(ctx) {
        Ok(pkt) => pkt,
        Err(pass) => return pass,
    };
    match reply(ctx, pkt, true) {
        Verdict::Drop(code) => (TC_ACT_SHOT, code),
        Verdict::Pass(c) | Verdict::Deliver(c) | Verdict::Reject(c) => (TC_ACT_OK, c),
    }
}

#[inline(always)]
fn act(ctx: &TcContext, v: Verdict) -> (i32, u32) {
    match v {
        Verdict::Pass(c) | Verdict::Deliver(c) => (TC_ACT_OK, c),
        Verdict::Drop(c) => (TC_ACT_SHOT, c),
        Verdict::Reject(_) => crate::icmp::reject6(ctx),
    }
}

/// Per-CPU room for the packet and the forward path's larger values: the
/// verifier allows 512 bytes of stack for a program's whole call chain, and
/// IPv6 keys and entries are 40 bytes each. Each field has one user at a time (a program
/// run owns its CPU's entry until it returns).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Scratch6 {
    pub(crate) flow: Flow6,
    pub(crate) skey: Ct6Key,
    pub(crate) rkey: Ct6Key,
    pub(crate) to: Tuple6,
    /// The packet, as parsed. In the map, not on the stack: what the
    /// verifier knows of a value read back from a map is its type, not the
    /// constant one path of the parser gave it, so the paths of the parser
    /// (protocols, extension headers, fragments) do not stay apart through
    /// the rest of the program (5.10's verifier went past its million with
    /// the packet on the stack).
    pub(crate) pkt: Packet6,
}

#[btf_map]
static SCRATCH6: PerCpuArray<Scratch6, 1> = PerCpuArray::new();

/// This CPU's [`Scratch6`].
#[inline(always)]
pub fn scratch() -> Result<*mut Scratch6, Verdict> {
    SCRATCH6
        .get_ptr_mut(0)
        .ok_or(Verdict::Drop(stat::DROP_REWRITE_FAILED))
}

/// One IPv6 flow as the forward path needs it.
pub type Flow6 = crate::conntrack::Flow<V6>;

/// The IPv6 frontend that replies of reverse-NAT id `id` come from.
#[inline(always)]
pub fn rev_nat(id: proxy_common::RevNatId) -> Option<RevNat6> {
    // SAFETY: map value pointer, copied.
    REVNAT6_V2.get_ptr(id).map(|r| unsafe { *r })
}

/// A packet to frontend `fe` (at `key`): conntrack first ([`established`]),
/// else a new flow ([`new_flow`]), then the REPLY entry and the rewrite
/// ([`finish`]). Each is a BPF call of its own, made from the entry's
/// frame: siblings, so that their frames never stack on one another (the
/// verifier's 512 bytes are for the deepest chain of calls).
///
/// `SEARCH`: a new flow whose random source-port tries all failed searches
/// the whole SNAT range ([`search_nat_port`]), from `run_flow`'s frame.
#[inline(always)]
fn translate<const SEARCH: bool>(
    ctx: &TcContext,
    pkt: &mut Packet6,
    key: &Svc6Key,
    fe: &SvcValue,
) -> Verdict {
    let est = established(pkt);
    if est > ESTABLISHED {
        // Not configured, or no scratch entry.
        return Verdict::Pass(est);
    }
    if est == NOT_ESTABLISHED {
        if pkt.fragment == FRAGMENT_LATER {
            // A later fragment of a flow that is not tracked.
            return Verdict::Pass(stat::PASS_FRAGMENT);
        }
        let Ok(sc) = scratch() else {
            return Verdict::Drop(stat::DROP_REWRITE_FAILED);
        };
        // SAFETY: this CPU's scratch entry; `flow` is the flow's.
        let flow = unsafe { &mut (*sc).flow };
        match new_flow(pkt, key, fe, flow) {
            Ok(()) => {}
            Err(Verdict::Deliver(stat::FWD_HANDOFF)) => {
                // Maglev handoff: sent unchanged towards the backend's node,
                // routed by the backend's address.
                account(ctx.len() as u64, fe.rev_nat_id, flow.backend_id);
                pkt.daddr_be = flow.backend.addr_be;
                return Verdict::Deliver(stat::FWD_HANDOFF);
            }
            Err(Verdict::Drop(stat::DROP_NO_FREE_PORT)) if SEARCH => {
                let Some(port_be) = search_nat_port() else {
                    return Verdict::Drop(stat::DROP_NO_FREE_PORT);
                };
                if let Err(v) = commit_searched(pkt, fe, port_be) {
                    return v;
                }
            }
            Err(v) => return v,
        }
    }
    let mut meta = fe.rev_nat_id & META_ID_MASK;
    if est == ESTABLISHED {
        meta |= META_ESTABLISHED;
    }
    if key.scope == SCOPE_EXTERNAL {
        meta |= META_EXTERNAL;
    }
    finish(ctx, pkt, meta)
}

/// [`established`]: no tracked flow; a tracked flow (in the scratch
/// entry's `flow`). Anything above is the counter to pass under.
pub const NOT_ESTABLISHED: u32 = 0;
pub const ESTABLISHED: u32 = 1;
/// [`finish`]'s `meta`: the reverse-NAT id in the low 24 bits
/// ([`proxy_common::REV_NAT_ID_MAX`]), and these.
const META_ID_MASK: u32 = proxy_common::REV_NAT_ID_MAX;
const META_ESTABLISHED: u32 = 1 << 24;
const META_EXTERNAL: u32 = 1 << 25;

/// The tracked flow of the packet's SERVICE key, in the scratch entry's
/// `flow` ([`lookup`]).
#[inline(never)]
pub fn established(pkt: &Packet6) -> u32 {
    let cfg = match config() {
        Ok(c) => c,
        Err(_) => return stat::PASS_UNCONFIGURED,
    };
    let Ok(sc) = scratch() else {
        return stat::DROP_REWRITE_FAILED;
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: this CPU's scratch entry; `skey` (kept for `new_flow`) and
    // `flow` are the flow's.
    let (skey, flow) = unsafe { (&mut (*sc).skey, &mut (*sc).flow) };
    *skey = pkt.ct_key(ct_dir::SERVICE);
    if crate::conntrack::lookup::<V6>(cfg, pkt, skey, now, flow) {
        ESTABLISHED
    } else {
        crate::forward::left_to_stack::<V6>(cfg, pkt, skey, now).unwrap_or(NOT_ESTABLISHED)
    }
}

/// The flow in the scratch entry's `flow`: its REPLY entry, the packet's
/// accounting and rewrite. `meta`: see [`META_ESTABLISHED`].
#[inline(never)]
fn finish(ctx: &TcContext, pkt: &mut Packet6, meta: u32) -> Verdict {
    let Ok(sc) = scratch() else {
        return Verdict::Drop(stat::DROP_REWRITE_FAILED);
    };
    // SAFETY: this CPU's scratch entry; `flow` and `to` are the flow's.
    let (flow, to) = unsafe { (&(*sc).flow, &mut (*sc).to) };
    let rev_nat_id = meta & META_ID_MASK;
    let established = meta & META_ESTABLISHED != 0;
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    crate::conntrack::ensure_reply(pkt, flow, rev_nat_id, established, now);
    account(ctx.len() as u64, rev_nat_id, flow.backend_id);
    crate::nat::forward_into(to, pkt, flow);
    if let Err(v) = rewrite(ctx, pkt, to) {
        return v;
    }
    if flow.flags & ct_flags::SNAT_ADDR != 0 && meta & META_EXTERNAL == 0 {
        count(stat::HAIRPIN);
    }
    let code = if established {
        stat::FWD_ESTABLISHED
    } else {
        stat::FWD_NEW
    };
    if flow.flags & ct_flags::VIA_STACK != 0 {
        count(code);
        return Verdict::Pass(stat::DELIVER_STACK);
    }
    Verdict::Deliver(code)
}

/// A new flow to frontend `fe` (at `key`): [`crate::forward::new_flow`],
/// with the flow's SERVICE key and backend-side tuple in the scratch entry.
/// A BPF call of its own (the verifier's stack is per frame).
#[inline(never)]
pub fn new_flow(
    pkt: &Packet6,
    key: &Svc6Key,
    fe: &SvcValue,
    flow: &mut Flow6,
) -> Result<(), Verdict> {
    let cfg = config()?;
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let sc = scratch()?;
    // SAFETY: this CPU's scratch entry: `skey` (written by `established`,
    // the caller's first step); `rkey` is the flow's backend-side tuple,
    // kept for the search.
    let (skey, rkey) = unsafe { (&(*sc).skey, &mut (*sc).rkey) };
    let external = key.scope == SCOPE_EXTERNAL;
    crate::forward::new_flow::<V6>(cfg, pkt, skey, key, fe, external, now, rkey, flow)
}

/// The new flow in the scratch entry's `flow`, for which
/// [`search_nat_port`] found source port `port_be` after [`new_flow`]'s
/// random tries failed: its SERVICE entry, as `new_flow` ends.
#[inline(never)]
fn commit_searched(pkt: &Packet6, fe: &SvcValue, port_be: u16) -> Result<(), Verdict> {
    let cfg = config()?;
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let sc = scratch()?;
    // SAFETY: this CPU's scratch entry: the new flow's `skey` and `flow`.
    let (skey, flow) = unsafe { (&(*sc).skey, &mut (*sc).flow) };
    flow.ported(port_be);
    crate::forward::commit(cfg, pkt, skey, fe.rev_nat_id, now, flow);
    Ok(())
}

/// A free source port for the new flow in the scratch entry (its
/// backend-side tuple in `rkey`) after the random tries of
/// [`crate::nat::free_nat_port`] all failed: [`crate::nat::search_port`].
/// A BPF call of its own, from `run_flow`'s frame.
#[inline(never)]
fn search_nat_port() -> Option<u16> {
    let sc = scratch().ok()?;
    // SAFETY: this CPU's scratch entry: the new flow's backend-side tuple.
    crate::nat::search_port::<V6>(unsafe { &(*sc).rkey })
}

/// The reply direction of a tracked flow: the source back to the frontend,
/// the destination back to the client where it was SNATed. `last_hook`: tc
/// egress towards the client (where flows delivered through the stack get
/// their reverse NAT).
#[inline(never)]
fn reply(ctx: &TcContext, pkt: &mut Packet6, last_hook: bool) -> Verdict {
    let Ok(sc) = scratch() else {
        return Verdict::Drop(stat::DROP_REWRITE_FAILED);
    };
    // SAFETY: this CPU's scratch entry; a reply has no forward flow.
    let to = unsafe { &mut (*sc).to };
    let (rev_nat_id, backend_id) = match reply_plan(pkt, last_hook, to) {
        Ok(ids) => ids,
        Err(v) => return v,
    };
    account(ctx.len() as u64, rev_nat_id, backend_id);
    match rewrite(ctx, pkt, to) {
        Ok(()) => Verdict::Deliver(stat::FWD_REPLY),
        Err(v) => v,
    }
}

/// A reply of a tracked flow: its state and age follow it, and `to` is the
/// tuple it is sent on (from the frontend, to the client's own address);
/// the flow's (reverse-NAT id, backend id). `Err(Pass(..))` when the packet
/// is no such reply, or is to be reverse-translated later (at the last
/// hook, for flows delivered through the stack). Shared by tc and XDP.
#[inline(always)]
pub fn reply_plan(
    pkt: &Packet6,
    last_hook: bool,
    to: &mut Tuple6,
) -> Result<(proxy_common::RevNatId, u32), Verdict> {
    let Some((rptr, ct)) = crate::conntrack::lookup_reply::<V6>(pkt) else {
        return Err(Verdict::Pass(stat::PASS_NO_SERVICE));
    };
    if ct.flags & ct_flags::VIA_STACK != 0 && !last_hook {
        return Err(Verdict::Pass(stat::PASS_REPLY_VIA_STACK));
    }
    let Some(rev) = rev_nat(ct.rev_nat_id) else {
        return Err(Verdict::Pass(stat::PASS_NO_SERVICE));
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    crate::conntrack::reply_seen::<V6>(pkt, rptr, &ct, &rev, now);
    crate::nat::reverse_into::<V6>(to, pkt, &ct, &rev);
    Ok((ct.rev_nat_id, ct.backend_id))
}

//! The forward decision for a packet sent to a frontend, shared by tc and
//! XDP: conntrack first (a tracked flow keeps its backend while that backend
//! exists); else a new flow — source ranges, [`lb::select`], the SNAT it needs
//! and its source port, [`conntrack::create`]; then the REPLY entry. Only the
//! rewrite and the delivery differ between the programs.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use proxy_common::{
    backend_state, config_flags, conntrack::connection_oriented, conntrack::tcp,
    conntrack::tcp_state, ct_dir, ct_flags, stat, svc_flags, Config, Ct4Key, SvcValue,
    MAP_LAYOUT_VERSION, SCOPE_EXTERNAL,
};

use crate::{
    conntrack::{self, Flow},
    family::{five_tuple, Family, FlowPacket, V4},
    lb,
    maps::{count, CONFIG_V3},
    nat,
    parse::Packet,
    verdict::Verdict,
};

/// [`decide`] mode bit: called from XDP.
pub const FROM_XDP: u8 = 0x80;

/// The forward direction's decision for a packet to frontend `fe`: fills
/// `flow` and returns `Deliver(FWD_NEW | FWD_ESTABLISHED)` when the packet is
/// to be translated, `Deliver(FWD_HANDOFF)` when it is to be sent unchanged
/// to the node of `flow.backend` (Maglev handoff); otherwise what to do
/// instead. From XDP, flows to a
/// backend on this node are deferred to tc (which delivers to pods with
/// `bpf_redirect_peer`), a new one once its conntrack entries are written.
///
/// `mode`: the frontend scope, or-ed with [`FROM_XDP`]. A BPF function call of
/// its own (the verifier limits the stack of one frame); a BPF call takes at
/// most five arguments.
pub fn decide(pkt: &Packet, fe: &SvcValue, mode: u8, flow: &mut Flow<V4>) -> Verdict {
    match decide_inner(pkt, fe, mode, flow) {
        Ok(code) => Verdict::Deliver(code),
        Err(v) => v,
    }
}

/// The datapath's configuration, once an agent of this layout wrote it.
#[inline(always)]
pub fn config() -> Result<&'static Config, Verdict> {
    match CONFIG_V3.get(0) {
        Some(cfg) if cfg.layout_version == MAP_LAYOUT_VERSION => Ok(cfg),
        _ => Err(Verdict::Pass(stat::PASS_UNCONFIGURED)),
    }
}

#[inline(always)]
fn decide_inner(
    pkt: &Packet,
    fe: &SvcValue,
    mode: u8,
    flow: &mut Flow<V4>,
) -> Result<u32, Verdict> {
    let xdp = mode & FROM_XDP != 0;
    let cfg = config()?;
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let skey = pkt.ct_key(ct_dir::SERVICE);

    let established = conntrack::lookup(cfg, pkt, &skey, now, flow);
    if established {
        // Checked again below for new flows; here it spares the reply-entry
        // work for a tracked flow tc handles anyway (measured: merging the
        // two checks costs ~120 bytes of program and ~1,400 verified
        // instructions in every program, `decide` being shared).
        if xdp && flow.backend.state & backend_state::LOCAL != 0 {
            return Err(Verdict::Pass(stat::XDP_DEFERRED));
        }
    } else {
        if !pkt.l4_present {
            // A later fragment of a flow that is not tracked: nothing to follow.
            return Err(Verdict::Pass(stat::PASS_FRAGMENT));
        }
        if let Some(code) = left_to_stack::<V4>(cfg, pkt, &skey, now) {
            return Err(Verdict::Pass(code));
        }
        let scope = mode & !FROM_XDP;
        let mut rkey = Ct4Key::default();
        new_flow::<V4>(
            cfg,
            pkt,
            &skey,
            &V4::frontend_key(pkt, scope),
            fe,
            scope == SCOPE_EXTERNAL,
            now,
            &mut rkey,
            flow,
        )?;
    }
    conntrack::ensure_reply(pkt, flow, fe.rev_nat_id, established, now);
    if xdp && flow.backend.state & backend_state::LOCAL != 0 {
        // A backend on this node: tc delivers it (`bpf_redirect_peer`). The
        // flow is written down first, so tc keeps the backend chosen here
        // instead of choosing again (which would give local backends 1/N²
        // of the new flows).
        return Err(Verdict::Pass(stat::XDP_DEFERRED));
    }
    Ok(if established {
        stat::FWD_ESTABLISHED
    } else {
        stat::FWD_NEW
    })
}

/// An untracked packet that this datapath leaves to the stack, either
/// family: its counter (`PASS_HANDOVER`, `PASS_DRAINING`), or `None` when
/// it is a new flow of ours. A flow the kernel's conntrack translated
/// before the takeover ([`handed_over`]); while draining, every new flow,
/// recorded so that its later packets follow it.
#[inline(always)]
pub fn left_to_stack<F: Family>(
    cfg: &Config,
    pkt: &F::Packet,
    skey: &F::CtKey,
    now: u64,
) -> Option<u32> {
    if handed_over(F::handover(skey), pkt.proto(), pkt.tcp_flags(), now) {
        return Some(stat::PASS_HANDOVER);
    }
    if cfg.flags & config_flags::DRAINING != 0 {
        // Handing the node back, or not taken over yet: new flows are
        // the other proxy's, for as long as they last.
        F::set_handover(skey, drained_until(pkt.proto(), now));
        return Some(stat::PASS_DRAINING);
    }
    None
}

/// Whether an untracked packet belongs to a flow the kernel's conntrack
/// translated before this datapath took over (`entry`: its handover entry,
/// written by the agent from the kernel's table at start): it is passed to
/// the stack untouched, whose conntrack entry keeps translating it to the
/// backend it had, even once kube-proxy's rules are gone. A TCP SYN is a
/// new connection (the client reused the port), as an SCTP INIT: the
/// datapath's. A UDP flow's deadline moves on with each packet, as the
/// kernel's entry.
#[inline(always)]
pub fn handed_over(entry: Option<*mut u64>, proto: u8, tcp_flags: u8, now: u64) -> bool {
    let Some(until) = entry else {
        return false;
    };
    if connection_oriented(proto) && tcp_flags & tcp::SYN != 0 {
        // (An SCTP INIT parses as SYN.)
        return false;
    }
    // SAFETY: a value of the handover map; a racing writer writes a u64 too.
    unsafe {
        if *until < now {
            return false;
        }
        if !connection_oriented(proto) {
            *until = now + proxy_common::HANDOVER_REFRESH_NS;
        }
    }
    true
}

/// The handover deadline of a flow the draining datapath passes to the
/// stack: as the kernel's entry would keep it (TCP and SCTP; UDP renewed by
/// its packets, as [`handed_over`] does).
#[inline(always)]
pub fn drained_until(proto: u8, now: u64) -> u64 {
    if connection_oriented(proto) {
        now + proxy_common::HANDOVER_DRAINED_NS
    } else {
        now + proxy_common::HANDOVER_REFRESH_NS
    }
}

/// A new flow to frontend `fe` (at `fkey`), either family: source ranges
/// checked, a backend selected, its SNAT ([`nat::snat_for`]) and source
/// port chosen, its SERVICE entry created ([`commit`]); `flow` is the flow
/// as it stands (ours, or a racing packet's). The Maglev handoff is
/// `Err(Deliver(FWD_HANDOFF))`, `flow` naming the backend. Where no random
/// source port was free (`Err(Drop(DROP_NO_FREE_PORT))`), `flow` and `rkey`
/// (its backend-side tuple) are left as chosen, for tc's search of the
/// whole range ([`nat::search_port`]).
///
/// `rkey` is the caller's room for the backend-side tuple: IPv6 keeps it in
/// its per-CPU scratch entry, out of the verifier's 512 bytes of stack.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn new_flow<F: Family>(
    cfg: &Config,
    pkt: &F::Packet,
    skey: &F::CtKey,
    fkey: &F::SvcKey,
    fe: &SvcValue,
    external: bool,
    now: u64,
    rkey: &mut F::CtKey,
    flow: &mut Flow<F>,
) -> Result<(), Verdict> {
    // Every source, as kube-proxy's firewall chain: external clients, pods.
    if fe.flags & svc_flags::SOURCE_RANGES != 0 && !F::source_allowed(fe.rev_nat_id, pkt.saddr()) {
        return Err(Verdict::Drop(stat::DROP_SOURCE_RANGE));
    }
    let (backend_id, b) = lb::select(&five_tuple::<F>(pkt), fkey, fe, now)?;
    if external
        && fe.flags & svc_flags::HANDOFF != 0
        && F::backend_state(&b) & backend_state::LOCAL == 0
    {
        // Maglev handoff: the backend's node picks the same backend and
        // translates; this node only forwards, keeping no state, so any node
        // the router sends the flow to forwards it alike.
        flow.backend_id = backend_id;
        flow.backend = b;
        return Err(Verdict::Deliver(stat::FWD_HANDOFF));
    }
    let (mut flags, nat_addr_be) =
        nat::snat_for::<F>(cfg, fe, &b, pkt.saddr(), pkt.daddr(), external);
    // Short-lived until the backend answers (a first packet that is not a
    // SYN included).
    flags |= ct_flags::UNREPLIED;
    if cfg.flags & config_flags::DELIVER_VIA_STACK != 0 && flags & ct_flags::SNAT_ADDR == 0 {
        // The stack can take it: its source is the client's own (a source
        // address of this node, or the hairpin one, it would drop).
        flags |= ct_flags::VIA_STACK;
    }
    if connection_oriented(pkt.proto()) {
        flags |= tcp_state(0, pkt.tcp_flags());
        if pkt.tcp_flags() & tcp::SYN == 0 {
            count(stat::CT_NEW_MIDSTREAM);
        }
    }
    *flow = Flow {
        backend_id,
        backend: b,
        flags,
        nat_addr_be,
        nat_port_be: 0,
    };
    // The backend-side tuple must not belong to another live flow. One call
    // site of the port choice (its loop is verified once per site).
    *rkey = flow.reply_key(pkt);
    if flags & ct_flags::SNAT_PORT != 0
        || conntrack::reply_tuple_taken::<F>(cfg, rkey, fe.rev_nat_id, now)
    {
        let port_be = nat::free_nat_port::<F>(cfg, rkey, now)
            .ok_or(Verdict::Drop(stat::DROP_NO_FREE_PORT))?;
        flow.ported(port_be);
    }
    commit(cfg, pkt, skey, fe.rev_nat_id, now, flow);
    Ok(())
}

/// The SERVICE entry of new flow `flow` (to the frontend `rev_nat_id`) at
/// `skey` ([`conntrack::create`]): `flow` is then the flow as it stands.
#[inline(always)]
pub fn commit<F: Family>(
    cfg: &Config,
    pkt: &F::Packet,
    skey: &F::CtKey,
    rev_nat_id: proxy_common::RevNatId,
    now: u64,
    flow: &mut Flow<F>,
) {
    let sval = F::service_entry(flow, rev_nat_id, now);
    conntrack::create(cfg, pkt, skey, &sval, now, flow);
}

/// A new flow whose random port tries all failed ([`decide`] returned
/// `Drop(DROP_NO_FREE_PORT)` and left the flow it chose in `flow`), once
/// [`nat::search_nat_port`] found it port `port_be`: the flow is created as
/// [`decide`] would have, and the packet is to be translated
/// (`Deliver(FWD_NEW)`).
///
/// tc only, called from the program's top frame, as the search is: a BPF
/// call of its own, whose frame stacks on the program's and not on
/// [`decide`]'s (the verifier limits the combined stack of nested calls to
/// 512 bytes).
#[inline(never)]
pub fn commit_searched(pkt: &Packet, fe: &SvcValue, flow: &mut Flow<V4>, port_be: u16) -> Verdict {
    let Ok(cfg) = config() else {
        return Verdict::Pass(stat::PASS_UNCONFIGURED);
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    flow.ported(port_be);
    commit(
        cfg,
        pkt,
        &pkt.ct_key(ct_dir::SERVICE),
        fe.rev_nat_id,
        now,
        flow,
    );
    conntrack::ensure_reply(pkt, flow, fe.rev_nat_id, false, now);
    Verdict::Deliver(stat::FWD_NEW)
}

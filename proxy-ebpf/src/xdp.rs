//! The XDP path of the external devices (`--acceleration xdp`): translates,
//! at the driver, external traffic to backends on other nodes (DNAT + SNAT to
//! the node) and their replies, and sends them back out (XDP_TX) or to
//! another device (XDP_REDIRECT) after a FIB lookup. Everything else — flows
//! to local backends, packets without a usable FIB answer, no backend
//! (reject), a new flow none of whose random source ports was free (tc
//! searches the whole range), IP options, fragments, other protocols — is
//! passed on to `ext_ingress` (tc) untouched.

use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns, programs::XdpContext};
use proxy_common::{ct_flags, stat, SCOPE_EXTERNAL};

use crate::{
    conntrack::{self, Flow},
    family::{Family, V4},
    fib,
    forward::{self, FROM_XDP},
    lb::rev_nat,
    maps::{account, count, SVC4_V2},
    nat::{self, Tuple},
    parse::{self, Packet},
    verdict::Verdict,
};

/// Handed to tc untouched (not counted here: tc counts the packet).
const DEFER: Verdict = Verdict::Pass(stat::XDP_DEFERRED);

/// Runs the XDP path; returns the XDP action and the counter it is recorded
/// under (`XDP_DEFERRED` is not counted: tc counts the packet).
#[inline(always)]
pub fn run(ctx: &XdpContext) -> (u32, u32) {
    match try_run(ctx) {
        Ok(v) => v,
        Err(Verdict::Pass(code)) => (xdp_action::XDP_PASS, code),
        Err(Verdict::Drop(code)) => (xdp_action::XDP_DROP, code),
        // Not produced here; tc would do the rest.
        Err(Verdict::Deliver(_) | Verdict::Reject(_)) => (xdp_action::XDP_PASS, stat::XDP_DEFERRED),
    }
}

fn try_run(ctx: &XdpContext) -> Result<(u32, u32), Verdict> {
    let mut pkt = parse::parse_xdp(ctx)?;
    let len = (ctx.data_end() - ctx.data()) as u64;
    let (to, code, rev_nat_id, backend_id): (Tuple, u32, proxy_common::RevNatId, u32) =
        if let Some(fe) = SVC4_V2.get_ptr(V4::frontend_key(&pkt, SCOPE_EXTERNAL)) {
            // SAFETY: map value pointer, copied.
            let fe = unsafe { *fe };
            let mut flow = Flow::default();
            let code = match forward::decide(&pkt, &fe, SCOPE_EXTERNAL | FROM_XDP, &mut flow) {
                Verdict::Deliver(code) => code,
                // Reject, pass, defer: tc does the rest; so does a flow
                // whose random source-port tries failed (tc searches the
                // whole range where the kernel lets it).
                Verdict::Pass(_) | Verdict::Reject(_) | Verdict::Drop(stat::DROP_NO_FREE_PORT) => {
                    return Err(DEFER)
                }
                v => return Err(v),
            };
            let to = if code == stat::FWD_HANDOFF {
                // Untranslated, routed towards the backend (so to its node).
                Tuple {
                    saddr_be: pkt.saddr_be,
                    daddr_be: flow.backend.addr_be,
                    sport_be: pkt.sport_be,
                    dport_be: pkt.dport_be,
                }
            } else {
                nat::forward_tuple(&pkt, &flow)
            };
            (to, code, fe.rev_nat_id, flow.backend_id)
        } else {
            let (rptr, ct) = conntrack::lookup_reply::<V4>(&pkt).ok_or(DEFER)?;
            if ct.flags & ct_flags::VIA_STACK != 0 {
                // Reverse-translated at tc egress towards the client.
                return Err(DEFER);
            }
            let rev = rev_nat(ct.rev_nat_id).ok_or(DEFER)?;
            // SAFETY: helper without arguments.
            conntrack::reply_seen::<V4>(&pkt, rptr, &ct, &rev, unsafe { bpf_ktime_get_ns() });
            let to = nat::reverse_tuple::<V4>(&pkt, &ct, &rev);
            (to, stat::FWD_REPLY, ct.rev_nat_id, ct.backend_id)
        };
    let sent = transmit(ctx, &mut pkt, &to, code)?;
    // Accounted only once sent: a packet handed on to tc is accounted there.
    account(len, rev_nat_id, backend_id);
    Ok(sent)
}

/// Where the translated packet goes (for a Maglev handoff, `to` is only
/// where it is routed: nothing is rewritten), asked before translating: what XDP
/// cannot send itself (no neighbour entry yet, a pod, no route) goes to tc
/// untouched, which finds the conntrack entries just written and finishes the
/// job (a translated packet handed to the stack could carry this node's own
/// address as its source: a martian). Then the rewrite to `to`, counted under
/// `code`, and the send.
///
/// A BPF call of its own: the FIB parameters live in its frame, not in the
/// program's, whose stack adds up with [`forward::decide`]'s.
#[inline(never)]
fn transmit(
    ctx: &XdpContext,
    pkt: &mut Packet,
    to: &Tuple,
    code: u32,
) -> Result<(u32, u32), Verdict> {
    let mut slot = core::mem::MaybeUninit::uninit();
    let fib = fib::xdp_fib::<V4>(ctx, pkt.proto, to, pkt.tot_len, &mut slot).ok_or(DEFER)?;
    if code != stat::FWD_HANDOFF {
        nat::xdp_rewrite(ctx, pkt, to)?;
    }
    count(code);
    Ok(fib::xdp_send(ctx, fib))
}

//! Delivery of translated packets: a FIB lookup, the TTL decremented as
//! forwarding would, the MACs written, then a redirect — `bpf_redirect_peer`
//! into a local pod, `bpf_redirect` / `bpf_redirect_neigh` otherwise (tc), or
//! XDP_TX / XDP_REDIRECT (XDP) — so neither direction walks netfilter.

use core::mem::{size_of, MaybeUninit};

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams, bpf_redir_neigh, xdp_action, BPF_FIB_LKUP_RET_NOT_FWDED,
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_OK, TC_ACT_SHOT,
    },
    helpers::{
        bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh, bpf_redirect_peer, bpf_skb_change_type,
    },
    programs::{TcContext, XdpContext},
};
use proxy_common::{csum, iface_flags, stat, HOST_DEV_MAC, IPPROTO_TCP};

use crate::{
    family::{Family, V4, V6},
    maps::{count, IFACE_V1},
    nat::Tuple,
    parse::{tc_load, xdp_ptr, Ipv4Hdr, Packet, ETH_HLEN, IP_TTL_OFF},
    parse6::{Packet6, Tuple6, IP6_HOP_OFF},
    zeroed::zeroed,
};

/// `skb->pkt_type` of a frame addressed to this host.
const PACKET_HOST: u32 = 0;
/// `bpf_redirect`'s flag for the device's ingress.
const BPF_F_INGRESS: u64 = 1;

/// The FIB lookup of a translated tc frame (counted under `code`), either
/// family, on the parameters `p` holds (answered in `p`): the lookup's
/// answer when the frame is to be sent on (success, or no neighbour entry
/// yet); else the caller returns: a frame to this node is injected at the
/// host-client device ([`to_host`]), anything else goes to the stack
/// (`pass`). A macro, not a function: written as a function returning the
/// outcome, `ext_ingress_rnd` took 2.5 times the verifier's instructions on
/// 6.1.
macro_rules! tc_fib_lookup {
    ($ctx:expr, $p:expr, $code:expr, $pass:expr) => {{
        // SAFETY: params points to a stack struct of the size given.
        let rc = unsafe {
            bpf_fib_lookup(
                $ctx.skb.skb as *mut _,
                $p as *mut _,
                size_of::<FibParams>() as i32,
                0,
            )
        } as u32;
        if rc == BPF_FIB_LKUP_RET_NOT_FWDED {
            return to_host($ctx, $code).unwrap_or($pass);
        }
        if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
            return $pass;
        }
        rc
    }};
}

/// The ifindex of the host-client device ([`proxy_common::HOST_DEV_NAME`])
/// and of its peer, where the pod program translates the node's own UDP to
/// ClusterIPs; 0: no such device. Set by the agent at load time; read-only
/// to the verifier.
#[unsafe(no_mangle)]
static HOST_DEV_IFINDEX: u32 = 0;
#[unsafe(no_mangle)]
static HOST_PEER_IFINDEX: u32 = 0;

/// A translated tc frame (counted under `code`) whose destination the FIB
/// found to be this node: a host client's reply, or a host client's packet
/// to a backend at one of the node's own addresses (it arrived on the
/// host-client device's peer). It is injected at ingress of the host-client
/// device, its destination MAC that device's: the route to its source (a
/// ClusterIP, or the hairpin address) points there, so a strict
/// reverse-path filter takes it, where at the interface it came in on it
/// would be dropped. `None`: not such a frame, or no device.
#[inline(always)]
pub fn to_host(ctx: &TcContext, code: u32) -> Option<(i32, u32)> {
    // SAFETY: read-only globals of this object.
    let (dev, peer) = unsafe {
        (
            core::ptr::read_volatile(&HOST_DEV_IFINDEX),
            core::ptr::read_volatile(&HOST_PEER_IFINDEX),
        )
    };
    // SAFETY: the context pointer is valid for this program run.
    let arrived = unsafe { (*ctx.skb.skb).ifindex };
    if dev == 0 || (code != stat::FWD_REPLY && arrived != peer) {
        return None;
    }
    if ctx.store(0, &HOST_DEV_MAC, 0).is_err() {
        return Some((TC_ACT_SHOT, stat::DROP_REWRITE_FAILED));
    }
    // SAFETY: plain helper taking an ifindex.
    let r = unsafe { bpf_redirect(dev, BPF_F_INGRESS) };
    Some((r as i32, stat::REDIRECT_HOST))
}
/// Byte of the TCP header holding the data offset (header length / 4, high
/// nibble).
const TCP_DOFF_OFF: usize = 12;

/// Fills `slot` with the FIB lookup parameters for a packet of either
/// family and protocol `proto`, on tuple `to`, arriving on `ifindex`, whose
/// MTU check is on length `tot_len` (0: no length; see [`tc_tot_len`]). In
/// place: see [`zeroed`].
#[inline(always)]
fn fib_params<'a, F: Family>(
    slot: &'a mut MaybeUninit<FibParams>,
    proto: u8,
    to: &Tuple<F::Addr>,
    ifindex: u32,
    tot_len: u16,
) -> &'a mut FibParams {
    let p = zeroed(slot);
    p.family = F::AF;
    p.l4_protocol = proto;
    p.sport = to.sport_be;
    p.dport = to.dport_be;
    p.__bindgen_anon_1.tot_len = tot_len;
    p.ifindex = ifindex;
    F::fib_addrs(p, &to.saddr_be, &to.daddr_be);
    p
}

/// The length `bpf_fib_lookup` is to check against the route's MTU for a tc
/// packet. With a length (kernels from 5.12; 5.10 ignores it for an skb) the
/// kernel compares it with the route's MTU (`bpf_ipv4_fib_lookup`,
/// net/core/filter.c) and knows nothing of GSO: a packet merged by GRO or sent
/// by a pod's TSO (up to 64 KiB) would be refused as FRAG_NEEDED and go to the
/// stack already translated, where a source that is now the node's own
/// address is dropped as a martian. So, as the stack's forwarding does
/// (`skb_gso_validate_network_len`): the packet's own length, or for a TCP
/// GSO packet the length of each segment it will be cut into. Other GSO
/// packets get 0, and the kernel checks the skb against the output device
/// (`is_skb_forwardable`, which lets GSO packets through), as 5.10 always does.
#[inline(always)]
fn tc_tot_len(ctx: &TcContext, pkt: &Packet) -> u16 {
    // SAFETY: the context pointer is valid for this program run.
    let gso_size = unsafe { (*ctx.skb.skb).gso_size };
    if gso_size == 0 {
        return pkt.tot_len;
    }
    if pkt.proto != IPPROTO_TCP || !pkt.l4_present {
        return 0;
    }
    let Ok(doff) = tc_load::<u8>(ctx, pkt.l4_off + TCP_DOFF_OFF) else {
        return 0;
    };
    let seg = (pkt.l4_off - ETH_HLEN) as u32 + (doff >> 4) as u32 * 4 + gso_size;
    if seg > u16::MAX as u32 {
        return 0;
    }
    seg as u16
}

/// Delivers a translated tc packet (counted under `code`) by redirect after
/// a FIB lookup; falls back to the stack when the FIB has no answer.
pub fn deliver(ctx: &TcContext, pkt: &Packet, code: u32) -> (i32, u32) {
    count(code);
    let pass = (TC_ACT_OK, stat::PASS_FIB_MISS);
    let to = Tuple {
        saddr_be: pkt.saddr_be,
        daddr_be: pkt.daddr_be,
        sport_be: pkt.sport_be,
        dport_be: pkt.dport_be,
    };
    let mut slot = MaybeUninit::uninit();
    // SAFETY: the context pointer is valid for this program run.
    let p = fib_params::<V4>(
        &mut slot,
        pkt.proto,
        &to,
        unsafe { (*ctx.skb.skb).ifindex },
        tc_tot_len(ctx, pkt),
    );
    let rc = tc_fib_lookup!(ctx, p, code, pass);
    // Forwarding decrements the TTL, as the stack would have. The frame's
    // first 26 bytes (MACs, EtherType, the IPv4 header up to its checksum)
    // are read and, TTL and checksum updated and the FIB's MACs in, written
    // back in one store: two helper calls were one each.
    let Ok(mut head) = tc_load::<[u8; HEAD_LEN]>(ctx, 0) else {
        return pass;
    };
    let (ttl, proto) = (head[IP_TTL_OFF], head[IP_TTL_OFF + 1]);
    if ttl <= 1 {
        return (TC_ACT_OK, stat::PASS_TTL);
    }
    let old = u16::from_ne_bytes([ttl, proto]);
    let new = u16::from_ne_bytes([ttl - 1, proto]);
    let check = csum::update(
        u16::from_ne_bytes([head[IP_TTL_OFF + 2], head[IP_TTL_OFF + 3]]),
        &[old, 0, 0, 0, 0, 0],
        &[new, 0, 0, 0, 0, 0],
    );
    if rc == BPF_FIB_LKUP_RET_NO_NEIGH {
        // `bpf_redirect_neigh` writes the MACs: TTL, protocol, checksum.
        if ctx.store(IP_TTL_OFF, &[new, check], 0).is_err() {
            return (TC_ACT_SHOT, stat::DROP_REWRITE_FAILED);
        }
        return redirect(ctx, p, rc);
    }
    head[..6].copy_from_slice(&p.dmac);
    head[6..12].copy_from_slice(&p.smac);
    head[IP_TTL_OFF] = ttl - 1;
    head[IP_TTL_OFF + 2..].copy_from_slice(&check.to_ne_bytes());
    if ctx.store(0, &head, 0).is_err() {
        return (TC_ACT_SHOT, stat::DROP_REWRITE_FAILED);
    }
    send(ctx, p)
}

/// Delivers a translated IPv6 tc frame (counted under `code`) as
/// [`deliver`] does IPv4's: FIB lookup, hop limit decremented, then
/// [`redirect`]. A BPF call of its own: its FIB parameters are not in the
/// frame of the IPv6 path's entry.
#[inline(never)]
pub fn deliver6(ctx: &TcContext, pkt: &Packet6, code: u32) -> (i32, u32) {
    count(code);
    let pass = (TC_ACT_OK, stat::PASS_FIB_MISS);
    let to = Tuple6 {
        saddr_be: pkt.saddr_be,
        daddr_be: pkt.daddr_be,
        sport_be: pkt.sport_be,
        dport_be: pkt.dport_be,
    };
    let mut slot = MaybeUninit::uninit();
    // No length: the kernel checks the frame against the output device
    // (GSO frames included), see [`tc_tot_len`].
    // SAFETY: the context pointer is valid for this program run.
    let p = fib_params::<V6>(
        &mut slot,
        pkt.proto,
        &to,
        unsafe { (*ctx.skb.skb).ifindex },
        0,
    );
    let rc = tc_fib_lookup!(ctx, p, code, pass);
    let Ok(hop) = tc_load::<u8>(ctx, IP6_HOP_OFF) else {
        return pass;
    };
    if hop <= 1 {
        return (TC_ACT_OK, stat::PASS_TTL);
    }
    if ctx.store(IP6_HOP_OFF, &(hop - 1), 0).is_err() {
        return (TC_ACT_SHOT, stat::DROP_REWRITE_FAILED);
    }
    redirect(ctx, p, rc)
}

/// The bytes of a frame [`deliver`] writes back: up to the end of the IPv4
/// header checksum.
const HEAD_LEN: usize = IP_TTL_OFF + 4;

/// The send of a tc frame the FIB answered for with `p` (`rc`: success, or
/// no neighbour entry yet), either family, its TTL or hop limit already
/// decremented: `bpf_redirect_neigh` to the next hop the FIB wrote when the
/// neighbour is unresolved; else the FIB's MACs and `bpf_redirect_peer`
/// into a pod or `bpf_redirect`.
#[inline(always)]
pub fn redirect(ctx: &TcContext, p: &FibParams, rc: u32) -> (i32, u32) {
    if rc == BPF_FIB_LKUP_RET_NO_NEIGH {
        let mut nh = bpf_redir_neigh {
            nh_family: p.family as u32,
            // SAFETY: a union of plain integers; all zeroes is valid.
            __bindgen_anon_1: unsafe { core::mem::zeroed() },
        };
        // SAFETY: plain fields of stack unions. Both unions lay an IPv4
        // address over the first word of an IPv6 one: copying the IPv6
        // words copies the next hop of either family.
        unsafe { nh.__bindgen_anon_1.ipv6_nh = p.__bindgen_anon_4.ipv6_dst };
        // SAFETY: nh is a stack struct of the size given.
        let r = unsafe {
            bpf_redirect_neigh(p.ifindex, &mut nh, size_of::<bpf_redir_neigh>() as i32, 0)
        };
        return (r as i32, stat::REDIRECT_NEIGH);
    }
    let mut macs = [0u8; 12];
    macs[..6].copy_from_slice(&p.dmac);
    macs[6..].copy_from_slice(&p.smac);
    if ctx.store(0, &macs, 0).is_err() {
        return (TC_ACT_SHOT, stat::DROP_REWRITE_FAILED);
    }
    send(ctx, p)
}

/// The redirect of a tc frame whose MACs are the FIB's (`p`):
/// `bpf_redirect_peer` into a pod, `bpf_redirect` otherwise.
#[inline(always)]
fn send(ctx: &TcContext, p: &FibParams) -> (i32, u32) {
    let pod = match IFACE_V1.get_ptr(p.ifindex) {
        // SAFETY: map value pointer, read once.
        Some(i) => (unsafe { (*i).flags } & iface_flags::POD) != 0,
        None => false,
    };
    // SAFETY: the context pointer is valid for this program run.
    if pod && unsafe { (*ctx.skb.skb).pkt_type } != PACKET_HOST {
        // A frame the host-client device sent is not addressed to its
        // peer (the stack took it for another host's); kernels before
        // 5.16 keep that type through `bpf_redirect_peer`, and the pod's
        // stack would drop it.
        // SAFETY: helper on this program's context.
        unsafe { bpf_skb_change_type(ctx.skb.skb as *mut _, PACKET_HOST) };
    }
    // SAFETY: plain helpers taking an ifindex.
    let r = unsafe {
        if pod {
            bpf_redirect_peer(p.ifindex, 0)
        } else {
            bpf_redirect(p.ifindex, 0)
        }
    };
    (r as i32, stat::REDIRECT)
}

/// The FIB's answer for the translated tuple `to` of an XDP frame of
/// either family (protocol `proto`, length `tot_len`), written in `slot`
/// (the caller's frame: no copy of it is returned): the output device and
/// MACs, when XDP can send there itself (a complete answer, not a pod).
#[inline(always)]
pub fn xdp_fib<'a, F: Family>(
    ctx: &XdpContext,
    proto: u8,
    to: &Tuple<F::Addr>,
    tot_len: u16,
    slot: &'a mut MaybeUninit<FibParams>,
) -> Option<&'a FibParams> {
    // An XDP frame is one wire frame: its own length is the one to check.
    let p = fib_params::<F>(slot, proto, to, ctx.ingress_ifindex() as u32, tot_len);
    xdp_lookup(ctx, p).then_some(&*p)
}

/// The FIB lookup of an XDP frame of either family, on the parameters `p`
/// holds (answered in `p`): whether XDP can send the frame there itself (a
/// complete answer, not a pod, which tc delivers to).
#[inline(always)]
fn xdp_lookup(ctx: &XdpContext, p: &mut FibParams) -> bool {
    // SAFETY: params points to a stack struct of the size given.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.ctx as *mut _,
            p as *mut _,
            size_of::<FibParams>() as i32,
            0,
        )
    } as u32;
    rc == BPF_FIB_LKUP_RET_SUCCESS && IFACE_V1.get_ptr(p.ifindex).is_none()
}

/// TTL, MACs, then XDP_TX (same device) or XDP_REDIRECT ([`xdp_out`]).
pub fn xdp_send(ctx: &XdpContext, p: &FibParams) -> (u32, u32) {
    let Some(ip) = xdp_ptr::<Ipv4Hdr>(ctx, ETH_HLEN) else {
        return (xdp_action::XDP_DROP, stat::DROP_REWRITE_FAILED);
    };
    // SAFETY: bounds-checked frame pointer.
    unsafe {
        if (*ip).ttl <= 1 {
            // Translated already; the stack answers with time exceeded.
            return (xdp_action::XDP_PASS, stat::PASS_TTL);
        }
        let old = [u16::from_ne_bytes([(*ip).ttl, (*ip).proto]), 0, 0, 0, 0, 0];
        (*ip).ttl -= 1;
        let new = [u16::from_ne_bytes([(*ip).ttl, (*ip).proto]), 0, 0, 0, 0, 0];
        (*ip).check = csum::update((*ip).check, &old, &new);
    }
    xdp_out(ctx, p)
}

/// The send of an XDP frame of either family, its TTL or hop limit already
/// decremented: the FIB's MACs (`p`), then XDP_TX (same device) or
/// XDP_REDIRECT.
#[inline(always)]
pub fn xdp_out(ctx: &XdpContext, p: &FibParams) -> (u32, u32) {
    let Some(eth) = xdp_ptr::<[u8; 12]>(ctx, 0) else {
        return (xdp_action::XDP_DROP, stat::DROP_REWRITE_FAILED);
    };
    let mut macs = [0u8; 12];
    macs[..6].copy_from_slice(&p.dmac);
    macs[6..].copy_from_slice(&p.smac);
    // SAFETY: bounds-checked frame pointer.
    unsafe { *eth = macs };
    if p.ifindex == ctx.ingress_ifindex() as u32 {
        return (xdp_action::XDP_TX, stat::XDP_TX);
    }
    // SAFETY: plain helper taking an ifindex.
    let r = unsafe { bpf_redirect(p.ifindex, 0) } as u32;
    (r, stat::XDP_REDIRECT)
}

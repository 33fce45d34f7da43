//! Kernel side of the kube-proxy replacement: the program entry points. Each
//! concern lives in its own module; these functions only compose them.
//!
//! - `pod_ingress` (tc ingress, host side of every pod interface) and
//!   `ext_ingress` (tc ingress, the node's external devices) run [`tc::run`]:
//!   frontend lookup ([`lb`]); for a frontend, conntrack first, else a backend
//!   selected, the SNAT it needs, conntrack entries for both directions
//!   ([`forward`], [`conntrack`], [`nat`]); DNAT; delivery by redirect
//!   ([`fib`]); no backend: an ICMP port unreachable ([`icmp`]) or a drop;
//!   otherwise a reply of a tracked flow gets its reverse NAT; anything else
//!   passes untouched.
//! - `ext_xdp` (XDP, external devices, `--acceleration xdp`) runs [`xdp::run`]:
//!   the same decision for external flows to remote backends and their
//!   replies, sent at the driver; everything else is deferred to tc.
//!
//! - `sock_connect4`, `sock_sendmsg4`, `sock_recvmsg4`, `sock_getpeername4`
//!   (cgroup v2 socket hooks, `--host-socket-lb`): the node's own clients
//!   reach frontends by socket-level load balancing, see [`sock`].
//!
//! Every step returns a [`verdict::Verdict`]; every packet is counted once
//! under its verdict in the stats map ([`proxy_common::stat`]).
//!
//! `pod_ingress_rnd` and `ext_ingress_rnd` (and IPv6's `pod_ingress6_rnd`,
//! `ext_ingress6_rnd`) are the same programs for kernels without `bpf_loop`
//! (before 5.17), where a new flow needing a SNAT source port gets random
//! tries only; the agent loads one of each pair.
//!
//! ICMP errors about translated flows (fragmentation needed, port
//! unreachable, time exceeded) are translated with their flow at tc
//! ([`icmp_error`]); XDP passes them on to tc.
//!
//! - `pod_ingress6`, `ext_ingress6`, `pod_egress6`: the tc path for IPv6,
//!   tail-called by the programs above for IPv6 frames ([`ipv6`]);
//!   `ext_xdp6`, the XDP path for IPv6, tail-called by `ext_xdp` ([`xdp6`]).
//!
//! Limits (each counted when it happens): a later fragment whose first was
//! not seen passes untouched, in both families (`pass_fragment`); see
//! [`ipv6`] for what the IPv6 path does not do yet.
#![no_std]
#![no_main]

mod conntrack;
mod family;
mod fib;
mod forward;
mod icmp;
mod icmp6_error;
mod icmp_error;
mod ipv6;
mod lb;
mod maps;
mod nat;
mod parse;
mod parse6;
mod rewrite6;
mod sock;
mod tc;
mod verdict;
mod xdp;
mod xdp6;
mod zeroed;

use aya_ebpf::bindings::TC_ACT_OK;
use aya_ebpf::{
    bindings::xdp_action,
    macros::{cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, TcContext, XdpContext},
};
use proxy_common::{stat, SCOPE_EXTERNAL, SCOPE_INTERNAL};

use ipv6::{TAIL6_V1, TAIL_EXT_INGRESS6, TAIL_POD_EGRESS6, TAIL_POD_INGRESS6};
use maps::count;

/// An IPv6 frame goes on in the IPv6 program at `index` of [`TAIL6_V1`];
/// where there is none (not loaded), it passes untouched. Returns the
/// action when the frame was IPv6. In the entry's own frame: a tail call
/// from a BPF function whose callers' frames exceed 256 bytes is refused.
#[inline(always)]
fn ipv6_tail(ctx: &TcContext, index: u32) -> Option<i32> {
    // SAFETY: the context pointer is valid for this program run.
    let proto = unsafe { (*ctx.skb.skb).protocol } as u16;
    if u16::from_be(proto) != ipv6::ETH_P_IPV6 {
        return None;
    }
    // SAFETY: a tail call into a program of this type; returns only when
    // the slot is empty.
    unsafe { TAIL6_V1.tail_call(ctx, index) };
    count(stat::PASS_NOT_IPV4);
    Some(TC_ACT_OK)
}

/// tc ingress of pod interfaces: internal frontends (ClusterIP), and replies
/// of flows to pods on this node.
#[classifier]
pub fn pod_ingress(ctx: TcContext) -> i32 {
    if let Some(action) = ipv6_tail(&ctx, TAIL_POD_INGRESS6) {
        return action;
    }
    let (action, code) = tc::run::<true>(&ctx, SCOPE_INTERNAL);
    count(code);
    action
}

/// `pod_ingress` for kernels without `bpf_loop` (before 5.17): a new flow
/// needing a source port gets random tries only, see [`tc::run`].
#[classifier]
pub fn pod_ingress_rnd(ctx: TcContext) -> i32 {
    if let Some(action) = ipv6_tail(&ctx, TAIL_POD_INGRESS6) {
        return action;
    }
    let (action, code) = tc::run::<false>(&ctx, SCOPE_INTERNAL);
    count(code);
    action
}

/// tc egress of pod interfaces: reverse NAT of replies the node's own stack
/// sends to pods (hostNetwork backends on this node).
#[classifier]
pub fn pod_egress(ctx: TcContext) -> i32 {
    if let Some(action) = ipv6_tail(&ctx, TAIL_POD_EGRESS6) {
        return action;
    }
    let (action, code) = tc::run_egress(&ctx);
    // Only translations are counted: every packet to a pod passes here.
    if code == stat::FWD_REPLY || code == stat::ICMP_ERROR_TO_CLIENT {
        count(code);
    }
    action
}

/// tc ingress of the node's external devices: external frontends (NodePort,
/// externalIPs, load-balancer IPs), and replies from backends on other nodes,
/// the first hook they meet on this node.
#[classifier]
pub fn ext_ingress(ctx: TcContext) -> i32 {
    if let Some(action) = ipv6_tail(&ctx, TAIL_EXT_INGRESS6) {
        return action;
    }
    let (action, code) = tc::run::<true>(&ctx, SCOPE_EXTERNAL);
    count(code);
    action
}

/// `ext_ingress` for kernels without `bpf_loop`, as `pod_ingress_rnd`.
#[classifier]
pub fn ext_ingress_rnd(ctx: TcContext) -> i32 {
    if let Some(action) = ipv6_tail(&ctx, TAIL_EXT_INGRESS6) {
        return action;
    }
    let (action, code) = tc::run::<false>(&ctx, SCOPE_EXTERNAL);
    count(code);
    action
}

/// `pod_ingress` for IPv6 (tail-called by the IPv4 programs): see [`ipv6`].
#[classifier]
pub fn pod_ingress6(ctx: TcContext) -> i32 {
    let (action, code) = ipv6::run::<true>(&ctx, SCOPE_INTERNAL);
    count(code);
    action
}

/// `pod_ingress6` for kernels without `bpf_loop`, as `pod_ingress_rnd`.
#[classifier]
pub fn pod_ingress6_rnd(ctx: TcContext) -> i32 {
    let (action, code) = ipv6::run::<false>(&ctx, SCOPE_INTERNAL);
    count(code);
    action
}

/// `ext_ingress` for IPv6: see [`ipv6`].
#[classifier]
pub fn ext_ingress6(ctx: TcContext) -> i32 {
    let (action, code) = ipv6::run::<true>(&ctx, SCOPE_EXTERNAL);
    count(code);
    action
}

/// `ext_ingress6` for kernels without `bpf_loop`, as `pod_ingress_rnd`.
#[classifier]
pub fn ext_ingress6_rnd(ctx: TcContext) -> i32 {
    let (action, code) = ipv6::run::<false>(&ctx, SCOPE_EXTERNAL);
    count(code);
    action
}

/// `pod_egress` for IPv6: see [`ipv6`].
#[classifier]
pub fn pod_egress6(ctx: TcContext) -> i32 {
    let (action, code) = ipv6::run_egress(&ctx);
    if code == stat::FWD_REPLY {
        count(code);
    }
    action
}

/// XDP on the node's external devices: see [`xdp`].
#[xdp]
pub fn ext_xdp(ctx: XdpContext) -> u32 {
    if xdp6::is_ipv6(&ctx) {
        // SAFETY: a tail call into a program of this type; returns only
        // when the slot is empty (XDP acceleration of IPv6 not loaded).
        unsafe { xdp6::TAIL6_XDP_V1.tail_call(&ctx, 0) };
        return xdp_action::XDP_PASS;
    }
    let (action, code) = xdp::run(&ctx);
    if action != xdp_action::XDP_PASS || code != stat::XDP_DEFERRED {
        count(code);
    }
    action
}

/// XDP for IPv6 (tail-called by `ext_xdp`): see [`xdp6`].
#[xdp]
pub fn ext_xdp6(ctx: XdpContext) -> u32 {
    let (action, code) = xdp6::run(&ctx);
    if action != xdp_action::XDP_PASS || code != stat::XDP_DEFERRED {
        count(code);
    }
    action
}

/// Host clients' `connect()`: see [`sock`].
#[cgroup_sock_addr(connect4)]
pub fn sock_connect4(ctx: SockAddrContext) -> i32 {
    sock::forward(&ctx, stat::SOCK_CONNECT)
}

/// Host clients' unconnected UDP `sendmsg()`: see [`sock`].
#[cgroup_sock_addr(sendmsg4)]
pub fn sock_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::forward(&ctx, stat::SOCK_SENDMSG)
}

/// Host clients' UDP `recvmsg()` source address: see [`sock`].
#[cgroup_sock_addr(recvmsg4)]
pub fn sock_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

/// Host clients' `getpeername()`: see [`sock`].
#[cgroup_sock_addr(getpeername4)]
pub fn sock_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

/// Host clients' `connect()` on IPv6 sockets: see [`sock`].
#[cgroup_sock_addr(connect6)]
pub fn sock_connect6(ctx: SockAddrContext) -> i32 {
    sock::forward6(&ctx, stat::SOCK_CONNECT)
}

/// Host clients' unconnected UDP `sendmsg()` on IPv6 sockets: see [`sock`].
#[cgroup_sock_addr(sendmsg6)]
pub fn sock_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock::forward6(&ctx, stat::SOCK_SENDMSG)
}

/// Host clients' UDP `recvmsg()` source address on IPv6 sockets.
#[cgroup_sock_addr(recvmsg6)]
pub fn sock_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock::reverse6(&ctx)
}

/// Host clients' `getpeername()` on IPv6 sockets.
#[cgroup_sock_addr(getpeername6)]
pub fn sock_getpeername6(ctx: SockAddrContext) -> i32 {
    sock::reverse6(&ctx)
}

// Only for the BPF target: on the host (`cargo clippy --workspace`), feature
// unification brings std, which has its own.
#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

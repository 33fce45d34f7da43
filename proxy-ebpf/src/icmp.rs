//! The reject of a frontend without endpoints: an ICMP (ICMPv6) port
//! unreachable from the frontend back to the client, as kube-proxy's REJECT
//! rule answers, so `connect()` fails with ECONNREFUSED at once. Each family
//! writes its own format ([`reject`], [`reject6`]); the rate limit and the
//! send back are one. Rate-limited per CPU ([`proxy_common::ratelimit`],
//! both families from one bucket); over the limit the packet is dropped.

use aya_ebpf::{
    bindings::TC_ACT_SHOT,
    helpers::{bpf_ktime_get_ns, bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use proxy_common::{csum, ratelimit, stat, IPPROTO_ICMP};

use crate::{
    ipv6::ETH_P_IPV6,
    maps::REJECT_RL_V1,
    parse::{Ipv4Hdr, ETH_HLEN},
    parse6::{IP6_HLEN, IPPROTO_ICMPV6},
};

const ETH_P_IP: u16 = 0x0800;

const REJECT_LEN: usize = ETH_HLEN + 20 + 8 + 28;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;

/// Turns the packet into an ICMP port unreachable from the frontend back to
/// the client and sends it back out of the interface it came from; returns
/// the tc action and its counter.
pub fn reject(ctx: &TcContext, ip: &Ipv4Hdr) -> (i32, u32) {
    if !allowed() {
        return (TC_ACT_SHOT, stat::DROP_REJECT_RATE_LIMITED);
    }
    match try_reject(ctx, ip) {
        Ok(v) => v,
        Err(()) => (TC_ACT_SHOT, stat::DROP_REJECT_FAILED),
    }
}

/// Takes one reject from this CPU's bucket, if it has one.
#[inline(always)]
pub fn allowed() -> bool {
    let Some(tat) = REJECT_RL_V1.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: this CPU's slot; no other writer while we run.
    unsafe {
        match ratelimit::allow(*tat, now) {
            Some(next) => {
                *tat = next;
                true
            }
            None => false,
        }
    }
}

#[inline(always)]
fn try_reject(ctx: &TcContext, ip: &Ipv4Hdr) -> Result<(i32, u32), ()> {
    if ip.ver_ihl != 0x45 {
        // With IP options the quoted header would be longer; not generated.
        return Err(());
    }
    let mut buf = [0u8; REJECT_LEN];
    // Original IP header and the first 8 bytes of its payload, quoted.
    let quoted = ctx.load::<[u8; 28]>(ETH_HLEN).map_err(|_| ())?;
    buf[ETH_HLEN + 28..].copy_from_slice(&quoted);
    reply_eth(ctx, &mut buf, ETH_P_IP)?;
    let total = (20 + 8 + 28) as u16;
    let iph = ETH_HLEN;
    buf[iph] = 0x45;
    buf[iph + 2..iph + 4].copy_from_slice(&total.to_be_bytes());
    buf[iph + 8] = 64;
    buf[iph + 9] = IPPROTO_ICMP;
    buf[iph + 12..iph + 16].copy_from_slice(&ip.daddr_be.to_ne_bytes());
    buf[iph + 16..iph + 20].copy_from_slice(&ip.saddr_be.to_ne_bytes());
    let ipc = csum::checksum(&buf[iph..iph + 20], 20);
    buf[iph + 10..iph + 12].copy_from_slice(&ipc.to_ne_bytes());
    let icmp = iph + 20;
    buf[icmp] = ICMP_DEST_UNREACH;
    buf[icmp + 1] = ICMP_PORT_UNREACH;
    let icc = csum::checksum(&buf[icmp..], 36);
    buf[icmp + 2..icmp + 4].copy_from_slice(&icc.to_ne_bytes());
    send_back(ctx, &buf)
}

const REJECT6_LEN: usize = ETH_HLEN + IP6_HLEN + 8 + IP6_HLEN + 8;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;

/// The reject of an IPv6 frontend without endpoints: an ICMPv6 destination
/// unreachable (port unreachable) from the frontend back to the client,
/// quoting the client's IPv6 header and the first 8 bytes after it, as
/// kube-proxy's REJECT answers (`icmp6-port-unreachable`); rate-limited with
/// IPv4's rejects, dropped over the limit. A BPF call of its own (its
/// buffer is not in the frame of the IPv6 path's entry).
#[inline(never)]
pub fn reject6(ctx: &TcContext) -> (i32, u32) {
    if !allowed() {
        return (TC_ACT_SHOT, stat::DROP_REJECT_RATE_LIMITED);
    }
    match try_reject6(ctx) {
        Ok(v) => v,
        Err(()) => (TC_ACT_SHOT, stat::DROP_REJECT_FAILED),
    }
}

#[inline(always)]
fn try_reject6(ctx: &TcContext) -> Result<(i32, u32), ()> {
    let mut buf = [0u8; REJECT6_LEN];
    let quoted = ctx.load::<[u8; IP6_HLEN + 8]>(ETH_HLEN).map_err(|_| ())?;
    reply_eth(ctx, &mut buf, ETH_P_IPV6)?;
    let ip = ETH_HLEN;
    let msg_len = (8 + IP6_HLEN + 8) as u16;
    buf[ip] = 0x60;
    buf[ip + 4..ip + 6].copy_from_slice(&msg_len.to_be_bytes());
    buf[ip + 6] = IPPROTO_ICMPV6;
    buf[ip + 7] = 64;
    // From the frontend (the quoted destination) to the client (its source).
    buf[ip + 8..ip + 24].copy_from_slice(&quoted[24..40]);
    buf[ip + 24..ip + 40].copy_from_slice(&quoted[8..24]);
    let icmp = ip + IP6_HLEN;
    buf[icmp] = ICMPV6_DEST_UNREACH;
    buf[icmp + 1] = ICMPV6_PORT_UNREACH;
    buf[icmp + 8..].copy_from_slice(&quoted);
    // The checksum covers the pseudo-header (addresses, length, next
    // header) and the message.
    let mut sum: u32 = u16::from_ne_bytes([0, msg_len as u8]) as u32
        + u16::from_ne_bytes([0, IPPROTO_ICMPV6]) as u32;
    let mut i = ip + 8;
    while i + 1 < REJECT6_LEN {
        sum += u16::from_ne_bytes([buf[i], buf[i + 1]]) as u32;
        i += 2;
    }
    let c = !csum::fold(sum);
    buf[icmp + 2..icmp + 4].copy_from_slice(&c.to_ne_bytes());
    send_back(ctx, &buf)
}

/// The Ethernet header of a reply to the frame: its MACs swapped, EtherType
/// `ethertype`, written at the start of `buf`.
#[inline(always)]
fn reply_eth(ctx: &TcContext, buf: &mut [u8], ethertype: u16) -> Result<(), ()> {
    let eth = ctx.load::<[u8; 12]>(0).map_err(|_| ())?;
    buf[..6].copy_from_slice(&eth[6..12]);
    buf[6..12].copy_from_slice(&eth[..6]);
    buf[12..14].copy_from_slice(&ethertype.to_be_bytes());
    Ok(())
}

/// Replaces the frame with `buf`, a reply, and sends it back out of the
/// interface it came in on.
#[inline(always)]
fn send_back<const N: usize>(ctx: &TcContext, buf: &[u8; N]) -> Result<(i32, u32), ()> {
    // SAFETY: the context pointer is valid for this program run.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, N as u32, 0) } != 0 {
        return Err(());
    }
    ctx.store(0, buf, 0).map_err(|_| ())?;
    // SAFETY: the context pointer is valid for this program run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper taking an ifindex.
    let r = unsafe { bpf_redirect(ifindex, 0) };
    Ok((r as i32, stat::REJECT_NO_BACKEND))
}

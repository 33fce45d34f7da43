//! The reject of a frontend without endpoints: an ICMP port unreachable from
//! the frontend back to the client, as kube-proxy's REJECT rule answers, so
//! `connect()` fails with ECONNREFUSED at once. Rate-limited per CPU
//! ([`proxy_common::ratelimit`]); over the limit the packet is dropped.

use aya_ebpf::{
    bindings::TC_ACT_SHOT,
    helpers::{bpf_ktime_get_ns, bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use proxy_common::{csum, ratelimit, stat, IPPROTO_ICMP};

use crate::{
    maps::REJECT_RL_V1,
    parse::{Ipv4Hdr, ETH_HLEN},
};

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
    let eth = ctx.load::<[u8; 12]>(0).map_err(|_| ())?;
    buf[..6].copy_from_slice(&eth[6..12]);
    buf[6..12].copy_from_slice(&eth[..6]);
    buf[12] = 0x08;
    buf[13] = 0x00;
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

    // SAFETY: the context pointer is valid for this program run.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, REJECT_LEN as u32, 0) } != 0 {
        return Err(());
    }
    ctx.store(0, &buf, 0).map_err(|_| ())?;
    // SAFETY: the context pointer is valid for this program run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper taking an ifindex.
    let r = unsafe { bpf_redirect(ifindex, 0) };
    Ok((r as i32, stat::REJECT_NO_BACKEND))
}

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
//! with the L4 checksum kept valid (the pseudo-header's 128-bit addresses
//! through `bpf_csum_diff`; SCTP's CRC32c for its ports), delivery by FIB
//! lookup and redirect, reverse NAT of replies. A frontend without
//! endpoints is answered with an ICMPv6 port unreachable.
//!
//! Extension headers: hop-by-hop, destination options and a fragment header
//! are walked (up to [`MAX_EXT_HEADERS`] in all); a routing header or any
//! other passes untouched (`pass_ipv6_ext_header`). Fragments are followed
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

use core::mem::size_of;

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams, BPF_ANY, BPF_FIB_LKUP_RET_NOT_FWDED,
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_F_MARK_MANGLED_0,
        BPF_F_PSEUDO_HDR, TC_ACT_OK, TC_ACT_SHOT,
    },
    btf_maps::{PerCpuArray, ProgramArray},
    helpers::{bpf_csum_diff, bpf_fib_lookup, bpf_ktime_get_ns, bpf_redirect, bpf_skb_change_tail},
    macros::btf_map,
    programs::TcContext,
};
use proxy_common::{
    backend_state, config_flags,
    conntrack::{connection_oriented, sctp_flags, tcp, tcp_state},
    crc32c, csum, ct_dir, ct_flags, stat, svc_flags, Addr6, Ct6Key, Frag6Key, FragPorts, RevNat6,
    Svc6Key, SvcValue, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP, SCOPE_EXTERNAL,
};

use crate::{
    family::{Family, V6},
    forward::config,
    maps::{account, count, FRAG6_V1, HANDOVER6_V1, REVNAT6_V2, SVC6_V2},
    parse::{tc_load, ETH_HLEN},
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

const IP6_HLEN: usize = 40;
const IP6_HOP_OFF: usize = ETH_HLEN + 7;
const IP6_SRC_OFF: usize = ETH_HLEN + 8;
const IP6_DST_OFF: usize = ETH_HLEN + 24;
const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_FRAGMENT: u8 = 44;
const NEXTHDR_DEST: u8 = 60;
/// Hop-by-hop and destination-options headers walked before the L4 header.
pub const MAX_EXT_HEADERS: usize = 4;
const TCP_FLAGS_OFF: usize = 13;
const SCTP_CHUNK_OFF: usize = 12;
const AF_INET6: u8 = 10;
const IPPROTO_ICMPV6: u8 = 58;
/// Random source ports tried when a new flow's backend-side tuple is taken.
const REWRITE_FAILED: Verdict = Verdict::Drop(stat::DROP_REWRITE_FAILED);

/// The fixed IPv6 header, as in the packet.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv6Hdr {
    pub vtc_flow_be: u32,
    pub payload_len_be: u16,
    pub nexthdr: u8,
    pub hop_limit: u8,
    pub saddr_be: Addr6,
    pub daddr_be: Addr6,
}
const _: () = assert!(size_of::<Ipv6Hdr>() == IP6_HLEN);

/// What the parser found, as in the packet.
#[derive(Clone, Copy, Default)]
pub struct Packet6 {
    pub(crate) l4_off: usize,
    pub(crate) csum_off: usize,
    pub(crate) proto: u8,
    pub(crate) tcp_flags: u8,
    pub(crate) saddr_be: Addr6,
    pub(crate) daddr_be: Addr6,
    pub(crate) sport_be: u16,
    pub(crate) dport_be: u16,
    /// The L4 length (payload after the extension headers).
    pub(crate) l4_len: u16,
    /// [`FRAGMENT_NONE`], [`FRAGMENT_FIRST`] (the L4 header is there) or
    /// [`FRAGMENT_LATER`] (no L4 header: ports from the fragment map, only
    /// addresses are rewritten).
    pub(crate) fragment: u8,
}

pub const FRAGMENT_NONE: u8 = 0;
const FRAGMENT_FIRST: u8 = 1;
pub(crate) const FRAGMENT_LATER: u8 = 2;
/// The fragment header's offset (13 bits, then 2 reserved, then M).
const IP6_FRAG_OFFSET: u16 = 0xfff8;
const IP6_FRAG_MORE: u16 = 0x0001;

impl Packet6 {
    /// What backend selection reads of the packet ([`crate::lb::select`]).
    #[inline(always)]
    pub fn five_tuple(&self) -> crate::family::FiveTuple<'_, crate::family::V6> {
        crate::family::FiveTuple {
            saddr: &self.saddr_be,
            daddr: &self.daddr_be,
            sport_be: self.sport_be,
            dport_be: self.dport_be,
            proto: self.proto,
        }
    }

    /// What delivery reads of a translated ICMPv6 error: its outer
    /// addresses.
    #[inline(always)]
    pub fn set_error_addrs(&mut self, saddr_be: &Addr6, daddr_be: &Addr6) {
        self.proto = IPPROTO_ICMPV6;
        self.saddr_be = *saddr_be;
        self.daddr_be = *daddr_be;
    }

    #[inline(always)]
    pub(crate) fn ct_key(&self, dir: u8) -> Ct6Key {
        Ct6Key {
            saddr_be: self.saddr_be,
            daddr_be: self.daddr_be,
            sport_be: self.sport_be,
            dport_be: self.dport_be,
            proto: self.proto,
            dir,
            _pad: [0; 2],
        }
    }
}

/// A translated 4-tuple.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Tuple6 {
    pub saddr_be: Addr6,
    pub daddr_be: Addr6,
    pub sport_be: u16,
    pub dport_be: u16,
}

/// Parses an IPv6 tc frame into `pkt`, up to its L4 ports (and TCP flags,
/// or the SCTP flags its first chunk stands for); 0, else the counter of a
/// frame passed untouched. A BPF call of its own: the IPv6 header it reads
/// is not kept in the entry's frame, under those of the calls after it
/// (the verifier's 512 bytes are for the whole chain).
#[inline(never)]
fn parse(ctx: &TcContext, pkt: &mut Packet6) -> u32 {
    match parse_inner(ctx) {
        Ok(p) => {
            *pkt = p;
            0
        }
        Err(Verdict::Pass(c) | Verdict::Drop(c) | Verdict::Deliver(c) | Verdict::Reject(c)) => c,
    }
}

#[inline(always)]
fn parse_inner(ctx: &TcContext) -> Result<Packet6, Verdict> {
    let malformed = Verdict::Pass(stat::PASS_MALFORMED);
    let ip = tc_load::<Ipv6Hdr>(ctx, ETH_HLEN).map_err(|_| malformed)?;
    if u32::from_be(ip.vtc_flow_be) >> 28 != 6 {
        return Err(malformed);
    }
    let mut nh = ip.nexthdr;
    let mut off = ETH_HLEN + IP6_HLEN;
    // The fragment header's identification and offset field, once seen.
    let mut frag: Option<(u32, u16)> = None;
    for _ in 0..MAX_EXT_HEADERS {
        if nh == NEXTHDR_FRAGMENT && frag.is_none() {
            let h = ctx.load::<[u8; 8]>(off).map_err(|_| malformed)?;
            nh = h[0];
            frag = Some((
                u32::from_ne_bytes([h[4], h[5], h[6], h[7]]),
                u16::from_be_bytes([h[2], h[3]]),
            ));
            off += 8;
            continue;
        }
        if nh != NEXTHDR_HOP && nh != NEXTHDR_DEST {
            break;
        }
        let h = ctx.load::<[u8; 2]>(off).map_err(|_| malformed)?;
        nh = h[0];
        off += (h[1] as usize + 1) * 8;
    }
    if nh != IPPROTO_TCP && nh != IPPROTO_UDP && nh != IPPROTO_SCTP {
        return Err(Verdict::Pass(
            if nh == NEXTHDR_HOP
                || nh == NEXTHDR_DEST
                || nh == NEXTHDR_FRAGMENT
                || nh == 43
                || nh == 51
                || nh == 50
            {
                stat::PASS_IPV6_EXT_HEADER
            } else {
                stat::PASS_OTHER_PROTO
            },
        ));
    }
    let ext_len = off - ETH_HLEN - IP6_HLEN;
    let l4_len = (u16::from_be(ip.payload_len_be) as usize).saturating_sub(ext_len) as u16;
    let (csum, l4_min) = if nh == IPPROTO_TCP {
        (16, 20)
    } else if nh == IPPROTO_SCTP {
        (8, 16)
    } else {
        (6, 8)
    };
    let mut fragment = FRAGMENT_NONE;
    if let Some((id_be, offset_field)) = frag {
        let key = Frag6Key {
            saddr_be: ip.saddr_be,
            daddr_be: ip.daddr_be,
            id_be,
            proto: nh,
            _pad: [0; 3],
        };
        if offset_field & IP6_FRAG_OFFSET != 0 {
            // A later fragment: its ports are those its first one carried,
            // and it has no L4 header.
            let Some(p) = FRAG6_V1.get_ptr(&key) else {
                return Err(Verdict::Pass(stat::PASS_FRAGMENT));
            };
            // SAFETY: map value pointer, copied.
            let p = unsafe { *p };
            return Ok(Packet6 {
                l4_off: off,
                csum_off: off + csum,
                proto: nh,
                tcp_flags: 0,
                saddr_be: ip.saddr_be,
                daddr_be: ip.daddr_be,
                sport_be: p.sport_be,
                dport_be: p.dport_be,
                l4_len,
                fragment: FRAGMENT_LATER,
            });
        }
        if offset_field & IP6_FRAG_MORE != 0 {
            fragment = FRAGMENT_FIRST;
        }
    }
    // The whole L4 header must be there (the verdict of a packet that is
    // neither a frontend's nor a reply's is the stack's).
    if (ctx.len() as usize) < off + l4_min {
        return Err(malformed);
    }
    let ports = tc_load::<[u16; 2]>(ctx, off).map_err(|_| malformed)?;
    if fragment == FRAGMENT_FIRST {
        if let Some((id_be, _)) = frag {
            // A first fragment: its ports, for the fragments that follow.
            let key = Frag6Key {
                saddr_be: ip.saddr_be,
                daddr_be: ip.daddr_be,
                id_be,
                proto: nh,
                _pad: [0; 3],
            };
            let v = FragPorts {
                sport_be: ports[0],
                dport_be: ports[1],
            };
            let _ = FRAG6_V1.insert(&key, &v, BPF_ANY as u64);
            count(stat::FRAGMENT_TRACKED);
        }
    }
    let mut tcp_flags = 0;
    if nh == IPPROTO_TCP {
        tcp_flags = tc_load::<u8>(ctx, off + TCP_FLAGS_OFF).map_err(|_| malformed)?;
    } else if nh == IPPROTO_SCTP {
        tcp_flags = sctp_flags(tc_load::<u8>(ctx, off + SCTP_CHUNK_OFF).map_err(|_| malformed)?);
    }
    Ok(Packet6 {
        l4_off: off,
        csum_off: off + csum,
        proto: nh,
        tcp_flags,
        saddr_be: ip.saddr_be,
        daddr_be: ip.daddr_be,
        sport_be: ports[0],
        dport_be: ports[1],
        l4_len,
        fragment,
    })
}

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

#[inline(never)]
fn run_flow<const SEARCH: bool>(ctx: &TcContext, scope: u8) -> (i32, u32) {
    let Ok(sc) = scratch() else {
        return (TC_ACT_OK, stat::PASS_MALFORMED);
    };
    // SAFETY: this CPU's scratch entry; `pkt` is this packet's.
    let pkt = unsafe { &mut (*sc).pkt };
    let code = parse(ctx, pkt);
    if code != 0 {
        return (TC_ACT_OK, code);
    }
    let key = Svc6Key {
        addr_be: pkt.daddr_be,
        port_be: pkt.dport_be,
        slot: 0,
        proto: pkt.proto,
        scope,
        _pad: [0; 2],
    };
    let verdict = match SVC6_V2.get_ptr(&key) {
        // SAFETY: a map value pointer, read once into a copy.
        Some(fe) => translate::<SEARCH>(ctx, pkt, &key, &unsafe { *fe }),
        None => reply(ctx, pkt, false),
    };
    match verdict {
        Verdict::Deliver(code) => deliver(ctx, pkt, code),
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
    let Ok(sc) = scratch() else {
        return (TC_ACT_OK, stat::PASS_MALFORMED);
    };
    // SAFETY: this CPU's scratch entry; `pkt` is this packet's.
    let pkt = unsafe { &mut (*sc).pkt };
    let code = parse(ctx, pkt);
    if code != 0 {
        return (TC_ACT_OK, code);
    }
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
        Verdict::Reject(_) => reject(ctx),
    }
}

const REJECT6_LEN: usize = ETH_HLEN + IP6_HLEN + 8 + IP6_HLEN + 8;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;

/// The reject of an IPv6 frontend without endpoints: an ICMPv6 destination
/// unreachable (port unreachable) from the frontend back to the client,
/// quoting the client's IPv6 header and the first 8 bytes after it, as
/// kube-proxy's REJECT answers (`icmp6-port-unreachable`); rate-limited with
/// IPv4's rejects, dropped over the limit. A BPF call of its own (its
/// buffer is not in the entry's frame).
#[inline(never)]
fn reject(ctx: &TcContext) -> (i32, u32) {
    if !crate::icmp::allowed() {
        return (TC_ACT_SHOT, stat::DROP_REJECT_RATE_LIMITED);
    }
    let failed = (TC_ACT_SHOT, stat::DROP_REJECT_FAILED);
    let mut buf = [0u8; REJECT6_LEN];
    let Ok(quoted) = ctx.load::<[u8; IP6_HLEN + 8]>(ETH_HLEN) else {
        return failed;
    };
    let Ok(eth) = ctx.load::<[u8; 12]>(0) else {
        return failed;
    };
    buf[..6].copy_from_slice(&eth[6..12]);
    buf[6..12].copy_from_slice(&eth[..6]);
    buf[12..14].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
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
    // SAFETY: the context pointer is valid for this program run.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, REJECT6_LEN as u32, 0) } != 0 {
        return failed;
    }
    if ctx.store(0, &buf, 0).is_err() {
        return failed;
    }
    // SAFETY: the context pointer is valid for this program run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper taking an ifindex.
    let r = unsafe { bpf_redirect(ifindex, 0) };
    (r as i32, stat::REJECT_NO_BACKEND)
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
    } else if crate::forward::handed_over(
        HANDOVER6_V1.get_ptr_mut(&*skey),
        pkt.proto,
        pkt.tcp_flags,
        now,
    ) {
        stat::PASS_HANDOVER
    } else if cfg.flags & config_flags::DRAINING != 0 {
        let until = crate::forward::drained_until(pkt.proto, now);
        let _ = HANDOVER6_V1.insert(&*skey, &until, 0);
        stat::PASS_DRAINING
    } else {
        NOT_ESTABLISHED
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
    let (saddr_be, sport_be) = flow.client_seen(pkt);
    *to = Tuple6 {
        saddr_be,
        sport_be,
        daddr_be: flow.backend.addr_be,
        dport_be: flow.backend.port_be,
    };
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

/// A new flow to frontend `fe` (as IPv4's `forward::new_flow`): source
/// ranges, a backend selected (or the Maglev handoff, `Err(Deliver
/// (FWD_HANDOFF))` with `flow` set), the SNAT it needs — the hairpin
/// address for a pod reaching itself, the node's address and a port of its
/// own for external traffic to a backend on another node
/// (`externalTrafficPolicy: Cluster`) — and a source port of its own where
/// the backend-side tuple is another live flow's; its SERVICE entry. A BPF
/// call of its own (the verifier's stack is per frame).
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
    // SAFETY: this CPU's scratch entry: `skey` (written by `decide`, the
    // caller); `rkey` is used here only while this runs.
    let (skey, rkey) = unsafe { (&(*sc).skey, &mut (*sc).rkey) };
    let external = key.scope == SCOPE_EXTERNAL;
    if fe.flags & svc_flags::SOURCE_RANGES != 0 && !V6::source_allowed(fe.rev_nat_id, &pkt.saddr_be)
    {
        return Err(Verdict::Drop(stat::DROP_SOURCE_RANGE));
    }
    let (backend_id, b) = crate::lb::select(&pkt.five_tuple(), key, fe, now)?;
    if external && fe.flags & svc_flags::HANDOFF != 0 && b.state & backend_state::LOCAL == 0 {
        flow.backend_id = backend_id;
        flow.backend = b;
        return Err(Verdict::Deliver(stat::FWD_HANDOFF));
    }
    let mut flags = ct_flags::UNREPLIED;
    let mut nat_addr_be = [0u32; 4];
    if !external && pkt.saddr_be == cfg.node6_be && cfg.node6_be != [0; 4] {
        // The node itself (a host client): a port of the SNAT range, or to
        // a backend at its own address the frontend's address, as IPv4's
        // `nat::snat_for` says.
        if b.addr_be == pkt.saddr_be {
            flags |= ct_flags::SNAT_ADDR;
            nat_addr_be = pkt.daddr_be;
        } else {
            flags |= ct_flags::SNAT_ADDR | ct_flags::SNAT_PORT;
            nat_addr_be = cfg.node6_be;
        }
    } else if !external && b.addr_be == pkt.saddr_be && cfg.hairpin6_be != [0; 4] {
        // A pod reaching itself: its own address as the source would be
        // dropped by its stack as a martian.
        flags |= ct_flags::SNAT_ADDR;
        nat_addr_be = cfg.hairpin6_be;
    } else if external
        && b.state & backend_state::LOCAL == 0
        && fe.flags & svc_flags::EXTERNAL_LOCAL == 0
        && cfg.node6_be != [0; 4]
    {
        flags |= ct_flags::SNAT_ADDR | ct_flags::SNAT_PORT;
        nat_addr_be = cfg.node6_be;
    }
    if cfg.flags & config_flags::DELIVER_VIA_STACK != 0 && flags & ct_flags::SNAT_ADDR == 0 {
        flags |= ct_flags::VIA_STACK;
    }
    if connection_oriented(pkt.proto) {
        flags |= tcp_state(0, pkt.tcp_flags);
        if pkt.tcp_flags & tcp::SYN == 0 {
            count(stat::CT_NEW_MIDSTREAM);
        }
    }
    // The flow as chosen, in `flow` (replaced below by a racing packet's).
    *flow = crate::conntrack::Flow {
        backend_id,
        backend: b,
        flags,
        nat_port_be: 0,
        nat_addr_be,
    };
    *rkey = flow.reply_key(pkt);
    if flags & ct_flags::SNAT_PORT != 0
        || crate::conntrack::reply_tuple_taken::<V6>(cfg, rkey, fe.rev_nat_id, now)
    {
        // On failure `flow` and `rkey` stay as chosen, for the search.
        let port_be = crate::nat::free_nat_port::<V6>(cfg, rkey, now)
            .ok_or(Verdict::Drop(stat::DROP_NO_FREE_PORT))?;
        flow.ported(port_be);
    }
    let sval = V6::service_entry(flow, fe.rev_nat_id, now);
    crate::conntrack::create(cfg, pkt, skey, &sval, now, flow);
    Ok(())
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
    let sval = V6::service_entry(flow, fe.rev_nat_id, now);
    crate::conntrack::create(cfg, pkt, skey, &sval, now, flow);
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
    to.saddr_be = rev.addr_be;
    to.sport_be = rev.port_be;
    to.daddr_be = if ct.flags & ct_flags::SNAT_ADDR != 0 {
        ct.nat_addr_be
    } else {
        pkt.daddr_be
    };
    to.dport_be = if ct.flags & ct_flags::SNAT_PORT != 0 {
        ct.nat_port_be
    } else {
        pkt.dport_be
    };
    Ok((ct.rev_nat_id, ct.backend_id))
}

// --- rewrite -----------------------------------------------------------------

#[inline(always)]
fn l4_flags(pkt: &Packet6) -> u64 {
    if pkt.proto == IPPROTO_UDP {
        BPF_F_MARK_MANGLED_0 as u64
    } else {
        0
    }
}

/// Rewrites the address at `off` from `old` to `new`, the L4 checksum (its
/// pseudo-header) following; IPv6 has no header checksum.
#[inline(always)]
fn rewrite_addr(
    ctx: &TcContext,
    pkt: &Packet6,
    off: usize,
    old: &Addr6,
    new: &Addr6,
) -> Result<(), Verdict> {
    if old == new {
        return Ok(());
    }
    // SCTP's checksum covers no address; a later fragment has no L4 header.
    if pkt.proto != IPPROTO_SCTP && pkt.fragment != FRAGMENT_LATER {
        // SAFETY: two 16-byte buffers on the stack, sizes given; the helper
        // only reads them.
        let diff = unsafe {
            bpf_csum_diff(
                old.as_ptr() as *mut u32,
                16,
                new.as_ptr() as *mut u32,
                16,
                0,
            )
        };
        if diff < 0 {
            return Err(REWRITE_FAILED);
        }
        ctx.l4_csum_replace(
            pkt.csum_off,
            0,
            diff as u64,
            BPF_F_PSEUDO_HDR as u64 | l4_flags(pkt),
        )
        .map_err(|_| REWRITE_FAILED)?;
    }
    ctx.store(off, new, 0).map_err(|_| REWRITE_FAILED)
}

#[inline(always)]
fn rewrite_port(
    ctx: &TcContext,
    pkt: &Packet6,
    off: usize,
    old: u16,
    new: u16,
) -> Result<(), Verdict> {
    if old == new || pkt.fragment == FRAGMENT_LATER {
        return Ok(());
    }
    if pkt.proto != IPPROTO_SCTP {
        ctx.l4_csum_replace(pkt.csum_off, old as u64, new as u64, 2 | l4_flags(pkt))
            .map_err(|_| REWRITE_FAILED)?;
    }
    ctx.store(off, &new, 0).map_err(|_| REWRITE_FAILED)
}

#[inline(always)]
fn ports_word(sport_be: u16, dport_be: u16) -> u32 {
    let (s, d) = (sport_be.to_ne_bytes(), dport_be.to_ne_bytes());
    u32::from_ne_bytes([s[0], s[1], d[0], d[1]])
}

/// Rewrites a frame to tuple `to`, checksums kept valid (SCTP: its CRC32c
/// for the ports; its checksum covers no address).
#[inline(always)]
fn rewrite(ctx: &TcContext, pkt: &mut Packet6, to: &Tuple6) -> Result<(), Verdict> {
    if pkt.proto == IPPROTO_SCTP && pkt.fragment != FRAGMENT_LATER {
        let old = ports_word(pkt.sport_be, pkt.dport_be);
        let new = ports_word(to.sport_be, to.dport_be);
        if old != new && pkt.fragment == FRAGMENT_FIRST {
            // The CRC covers the whole packet, whose length this fragment
            // does not give (as IPv4's `drop_sctp_fragment`).
            return Err(Verdict::Drop(stat::DROP_SCTP_FRAGMENT));
        }
        if old != new {
            let stored = ctx.load::<u32>(pkt.csum_off).map_err(|_| REWRITE_FAILED)?;
            let crc = crc32c::update_ports(stored, pkt.l4_len, old, new);
            ctx.store(pkt.csum_off, &crc, 0)
                .map_err(|_| REWRITE_FAILED)?;
        }
    }
    rewrite_addr(ctx, pkt, IP6_DST_OFF, &pkt.daddr_be, &to.daddr_be)?;
    pkt.daddr_be = to.daddr_be;
    rewrite_port(ctx, pkt, pkt.l4_off + 2, pkt.dport_be, to.dport_be)?;
    pkt.dport_be = to.dport_be;
    rewrite_addr(ctx, pkt, IP6_SRC_OFF, &pkt.saddr_be, &to.saddr_be)?;
    pkt.saddr_be = to.saddr_be;
    rewrite_port(ctx, pkt, pkt.l4_off, pkt.sport_be, to.sport_be)?;
    pkt.sport_be = to.sport_be;
    Ok(())
}

// --- delivery ----------------------------------------------------------------

/// Delivers a translated frame (counted under `code`): FIB lookup, hop limit
/// decremented, MACs, then `bpf_redirect_peer` into a pod or
/// `bpf_redirect(_neigh)`; to the stack when the FIB has no answer. A BPF
/// call of its own: its FIB parameters are not in the entry's frame.
#[inline(never)]
pub fn deliver(ctx: &TcContext, pkt: &Packet6, code: u32) -> (i32, u32) {
    count(code);
    let pass = (TC_ACT_OK, stat::PASS_FIB_MISS);
    let mut slot = core::mem::MaybeUninit::uninit();
    let p: &mut FibParams = crate::zeroed::zeroed(&mut slot);
    p.family = AF_INET6;
    p.l4_protocol = pkt.proto;
    p.sport = pkt.sport_be;
    p.dport = pkt.dport_be;
    // SAFETY: the context pointer is valid for this program run.
    p.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // No length: the kernel checks the frame against the output device
    // (GSO frames included), see IPv4's `fib::tc_tot_len`.
    p.__bindgen_anon_3.ipv6_src = pkt.saddr_be;
    p.__bindgen_anon_4.ipv6_dst = pkt.daddr_be;
    // SAFETY: params points to a stack struct of the size given.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb as *mut _,
            p as *mut _,
            size_of::<FibParams>() as i32,
            0,
        )
    } as u32;
    if rc == BPF_FIB_LKUP_RET_NOT_FWDED {
        return crate::fib::to_host(ctx, code).unwrap_or(pass);
    }
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        return pass;
    }
    let Ok(hop) = tc_load::<u8>(ctx, IP6_HOP_OFF) else {
        return pass;
    };
    if hop <= 1 {
        return (TC_ACT_OK, stat::PASS_TTL);
    }
    if ctx.store(IP6_HOP_OFF, &(hop - 1), 0).is_err() {
        return (TC_ACT_SHOT, stat::DROP_REWRITE_FAILED);
    }
    crate::fib::redirect(ctx, p, rc)
}

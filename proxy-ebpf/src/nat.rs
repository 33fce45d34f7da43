//! Address and port translation: which SNAT a new flow needs, the source port
//! it gets, the translated tuples of both directions, and their rewrite into
//! the packet (tc: stores through skb helpers, the L4 checksum kept by the
//! kernel's, the IPv4 header's computed here, SCTP's CRC32c updated by
//! [`proxy_common::crc32c`]; XDP: in place, with RFC 1624 incremental
//! checksum updates).

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    cty::c_void,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_loop},
    programs::{TcContext, XdpContext},
};
use proxy_common::{
    backend_state,
    conntrack::{CtEntry, NSEC_PER_SEC},
    crc32c, csum, ct_flags, stat, svc_flags, Config, SvcValue, IPPROTO_SCTP, IPPROTO_TCP,
    IPPROTO_UDP, SNAT_SEARCH_BACKOFF_NS,
};

use crate::{
    conntrack::{self, Flow},
    family::{Family, FlowPacket, V4},
    maps::{count, CONFIG_V3},
    parse::{tc_load, xdp_ptr, Ipv4Hdr, Packet, ETH_HLEN, IP_CSUM_OFF, IP_FRAG_OFF, IP_MF},
    verdict::Verdict,
};

/// Random source ports tried for a flow before the whole range is searched
/// ([`search_nat_port`], tc on kernels with `bpf_loop`) or, where it is not,
/// the flow is dropped as `drop_no_free_port`. Bounded work per packet:
/// each try costs the verifier the whole liveness check below, on every
/// kernel of the matrix.
const NAT_PORT_ATTEMPTS: u32 = 8;

/// A translated 4-tuple (network byte order), either family (IPv4's by
/// default; [`crate::parse6::Tuple6`] is IPv6's).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Tuple<A = u32> {
    pub saddr_be: A,
    pub daddr_be: A,
    pub sport_be: u16,
    pub dport_be: u16,
}

/// The tuple a packet of `flow` is sent on with: to its backend, from the
/// client as the backend sees it.
#[inline(always)]
pub fn forward_tuple<F: Family>(pkt: &F::Packet, flow: &Flow<F>) -> Tuple<F::Addr> {
    let mut to = Tuple::default();
    forward_into(&mut to, pkt, flow);
    to
}

/// [`forward_tuple`] written into `to` field by field (see
/// [`reverse_into`]).
#[inline(always)]
pub fn forward_into<F: Family>(to: &mut Tuple<F::Addr>, pkt: &F::Packet, flow: &Flow<F>) {
    let (saddr_be, sport_be) = flow.client_seen(pkt);
    to.saddr_be = saddr_be;
    to.sport_be = sport_be;
    to.daddr_be = F::backend_addr(&flow.backend);
    to.dport_be = F::backend_port(&flow.backend);
}

/// The tuple a reply of the flow of REPLY entry `ct` (to frontend `rev`)
/// is sent on: from the frontend, to the client's own address and port
/// where the flow was SNATed.
#[inline(always)]
pub fn reverse_tuple<F: Family>(
    pkt: &F::Packet,
    ct: &F::CtValue,
    rev: &F::RevNat,
) -> Tuple<F::Addr> {
    let mut to = Tuple::default();
    reverse_into::<F>(&mut to, pkt, ct, rev);
    to
}

/// [`reverse_tuple`] written into `to` field by field (IPv6's is in its
/// per-CPU scratch entry: a whole tuple built first would be on the stack).
#[inline(always)]
pub fn reverse_into<F: Family>(
    to: &mut Tuple<F::Addr>,
    pkt: &F::Packet,
    ct: &F::CtValue,
    rev: &F::RevNat,
) {
    to.saddr_be = F::rev_addr(rev);
    to.sport_be = F::rev_port(rev);
    to.daddr_be = if ct.flags() & ct_flags::SNAT_ADDR != 0 {
        F::ct_nat_addr(ct)
    } else {
        *pkt.daddr()
    };
    to.dport_be = if ct.flags() & ct_flags::SNAT_PORT != 0 {
        F::ct_nat_port(ct)
    } else {
        pkt.dport_be()
    };
}

/// The SNAT a new flow from `client_be` to backend `b` through the
/// frontend at `frontend_be` needs, as ([`ct_flags`], new source address):
/// - the node itself (a host client, translated on the host-client device):
///   a port of the SNAT range, which the host's own sockets never use, so
///   that the flow's backend-side tuple cannot be one of a host socket the
///   socket hooks aimed at the same backend (its answers would be taken
///   for this flow's); to a backend at the node's own address, the
///   frontend's address instead, routed to that device, so that the
///   backend's answers come back through it to be reverse-translated (to
///   the node's own address they would stay on the loopback), and the stack
///   takes the packet injected there (a local source would be a martian);
/// - hairpin: a pod reaching itself would drop its own address as a martian
///   source, so it gets the hairpin address;
/// - `externalTrafficPolicy: Cluster` to a backend on another node: the
///   node's address and a port of its own, so replies come back through
///   this node.
#[inline(always)]
pub fn snat_for<F: Family>(
    cfg: &Config,
    fe: &SvcValue,
    b: &F::Backend,
    client: &F::Addr,
    frontend: &F::Addr,
    external: bool,
) -> (u16, F::Addr) {
    let unset = F::Addr::default();
    let node = F::node_addr(cfg);
    let hairpin = F::hairpin_addr(cfg);
    let backend = F::backend_addr(b);
    if !external && *client == node && node != unset {
        if backend == *client {
            (ct_flags::SNAT_ADDR, *frontend)
        } else {
            (ct_flags::SNAT_ADDR | ct_flags::SNAT_PORT, node)
        }
    } else if !external && backend == *client && hairpin != unset {
        (ct_flags::SNAT_ADDR, hairpin)
    } else if external
        && F::backend_state(b) & backend_state::LOCAL == 0
        && fe.flags & svc_flags::EXTERNAL_LOCAL == 0
        && node != unset
    {
        (ct_flags::SNAT_ADDR | ct_flags::SNAT_PORT, node)
    } else {
        (0, unset)
    }
}

/// A free source port for a flow whose backend-side tuple is `rkey`, from
/// the configured SNAT range (`snat_port_min..=snat_port_max`, kept out of
/// the host's `ip_local_port_range` by the agent): see
/// [`NAT_PORT_ATTEMPTS`]. A port whose flow has expired is free again,
/// whether or not the garbage collector has deleted its entries yet. `None`
/// when every port tried is in use.
#[inline(always)]
pub fn free_nat_port<F: Family>(cfg: &Config, rkey: &mut F::CtKey, now: u64) -> Option<u16> {
    let (min, size) = snat_range(cfg)?;
    // Never 0 (checked apart so that the compiler sees it: a remainder by
    // zero would be a panic path, which BPF has no way to take).
    let size = core::num::NonZeroU32::new(size)?;
    for _ in 0..NAT_PORT_ATTEMPTS {
        // SAFETY: helper without arguments.
        let r = unsafe { bpf_get_prandom_u32() };
        let port_be = ((min + r % size) as u16).to_be();
        F::set_dport(rkey, port_be);
        if !port_in_use::<F>(cfg, rkey, now) {
            return Some(port_be);
        }
    }
    None
}

/// The SNAT range of `cfg` as (first port, number of ports); `None` when
/// unset.
#[inline(always)]
pub fn snat_range(cfg: &Config) -> Option<(u32, u32)> {
    let min = cfg.snat_port_min as u32;
    let max = cfg.snat_port_max as u32;
    if min == 0 || max < min {
        return None;
    }
    Some((min, max - min + 1))
}

/// Where one search of the whole SNAT range stands, in the searching
/// frame ([`search_port`]): every port of the range once, from a random one
/// on.
#[repr(C)]
pub struct PortWalk {
    pub now: u64,
    /// First port of the range, its size, and where this search starts in
    /// it (`< size`).
    min: u32,
    size: u32,
    start: u32,
    /// The free port found (network byte order); 0 while none is.
    pub found_be: u16,
    _pad: u16,
}

impl PortWalk {
    /// A walk of the range of `size` ports from `min` (see [`snat_range`])
    /// from a random port on.
    #[inline(always)]
    pub fn new(now: u64, min: u32, size: core::num::NonZeroU32) -> Self {
        Self {
            now,
            min,
            size: size.get(),
            // SAFETY: helper without arguments.
            start: unsafe { bpf_get_prandom_u32() } % size,
            found_be: 0,
            _pad: 0,
        }
    }

    /// The port (network byte order) at step `index` (`< size`) of the
    /// walk, wrapping in the range.
    #[inline(always)]
    pub fn port_be(&self, index: u32) -> u16 {
        // `start < size` and `index < size`: one subtraction wraps it.
        let mut off = self.start.wrapping_add(index);
        if off >= self.size {
            off = off.wrapping_sub(self.size);
        }
        (self.min.wrapping_add(off) as u16).to_be()
    }
}

/// One search of the whole SNAT range: `bpf_loop` hands [`search_step`] a
/// pointer to it.
#[repr(C)]
struct Search<K> {
    /// The backend-side tuple; its port is the one being tried.
    rkey: K,
    walk: PortWalk,
}

/// A free source port for an IPv4 flow, after [`free_nat_port`]'s random
/// tries all failed: [`search_port`] for the flow's backend-side tuple.
///
/// `flow`: the new flow as [`crate::forward::decide`] chose it.
///
/// tc only, from the program's top frame: a BPF call of its own, so that it
/// and the callback's frame stack on the program's frame, not on `decide`'s.
#[inline(never)]
pub fn search_nat_port(pkt: &Packet, flow: &Flow<V4>) -> Option<u16> {
    search_port::<V4>(&flow.reply_key(pkt))
}

/// A free source port for a flow whose backend-side tuple is `rkey`, after
/// [`free_nat_port`]'s random tries all failed: every port of the SNAT range,
/// from a random one on, until one is free (expiry honoured as there), with
/// `bpf_loop` (Linux 5.17; only the tc programs built with `SEARCH` call it,
/// and the agent loads those only where the kernel has the helper). A port
/// space found full is not searched again for
/// [`SNAT_SEARCH_BACKOFF_NS`] (`SNAT_FULL4_V1`, `SNAT_FULL6_V1`): each
/// search costs up to two lookups per port of the range (tens of
/// thousands), and a flood of first packets to a saturated backend must not
/// cost that per packet. `None` when no port is free, or within the
/// back-off.
///
/// Inlined into each family's BPF call of its own ([`search_nat_port`],
/// `ipv6::search_nat_port`).
#[inline(always)]
pub fn search_port<F: Family>(rkey: &F::CtKey) -> Option<u16> {
    let cfg = CONFIG_V3.get(0)?;
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let (min, size) = snat_range(cfg)?;
    let size_nz = core::num::NonZeroU32::new(size)?;
    let mut space = *rkey;
    F::set_dport(&mut space, 0);
    if let Some(full) = F::snat_full(&space) {
        // SAFETY: LRU value pointer, read once.
        if now.saturating_sub(unsafe { *full }) < SNAT_SEARCH_BACKOFF_NS {
            return None;
        }
    }
    count(stat::SNAT_PORT_SEARCH);
    // The tuple as the flow has it (the port is the callback's to set);
    // `space` stays apart for the record below.
    let mut s = Search {
        rkey: *rkey,
        walk: PortWalk::new(now, min, size_nz),
    };
    // SAFETY: `search_step` is a BPF subprogram of the callback's signature;
    // `s` outlives the call.
    unsafe {
        bpf_loop(
            size,
            search_step::<F> as *const () as *mut c_void,
            (&mut s as *mut Search<F::CtKey>).cast(),
            0,
        )
    };
    if s.walk.found_be == 0 {
        F::set_snat_full(&space, now);
        return None;
    }
    Some(s.walk.found_be)
}

/// One port of a [`search_port`]: 1 (stop) when port `start + index`
/// (wrapping in the range) is free, 0 (go on) otherwise.
#[inline(never)]
extern "C" fn search_step<F: Family>(index: u32, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `Search` in `search_port`'s frame, which waits
    // for `bpf_loop` to return.
    let s = unsafe { &mut *ctx.cast::<Search<F::CtKey>>() };
    let Some(cfg) = CONFIG_V3.get(0) else {
        return 1;
    };
    let port_be = s.walk.port_be(index);
    F::set_dport(&mut s.rkey, port_be);
    if port_be == 0 || port_in_use::<F>(cfg, &s.rkey, s.walk.now) {
        return 0;
    }
    s.walk.found_be = port_be;
    1
}

/// Whether the backend-side tuple `rkey` belongs to a flow still alive (or
/// being created: a REPLY entry younger than a second), ours or one the
/// kernel masqueraded before the takeover ([`masqueraded_by_kernel`]).
#[inline(always)]
pub fn port_in_use<F: Family>(cfg: &Config, rkey: &F::CtKey, now: u64) -> bool {
    match F::ct(rkey) {
        Some(e) => {
            // SAFETY: map value pointer, copied.
            let e = unsafe { *e };
            now.saturating_sub(e.last_seen_ns()) < NSEC_PER_SEC
                || conntrack::live_backend_of::<F>(cfg, rkey, &e, now).is_some()
        }
        None => masqueraded_by_kernel(F::handover(rkey), now),
    }
}

/// Whether the handover entry of a backend-side tuple (`entry`, `dir`
/// REPLY) says a flow the kernel masqueraded before the takeover still
/// holds that port of the node toward that backend: the agent lists them
/// from the kernel's conntrack (`host::handover`).
#[inline(always)]
pub fn masqueraded_by_kernel(entry: Option<*mut u64>, now: u64) -> bool {
    // SAFETY: a value of the handover map, read once.
    entry.is_some_and(|until| unsafe { *until } >= now)
}

// --- tc: rewrites through skb helpers --------------------------------------

const REWRITE_FAILED: Verdict = Verdict::Drop(stat::DROP_REWRITE_FAILED);

fn l4_flags(pkt: &Packet) -> u64 {
    if pkt.proto == IPPROTO_UDP {
        BPF_F_MARK_MANGLED_0 as u64
    } else {
        0
    }
}

/// The L4 checksum updated for an address of the pseudo-header changing
/// from `old` to `new` (SCTP's checksum has none; a later fragment carries
/// no L4 header).
fn l4_csum_addr(ctx: &TcContext, pkt: &Packet, old: u32, new: u32) -> Result<(), Verdict> {
    if old == new || !pkt.l4_present || pkt.proto == IPPROTO_SCTP {
        return Ok(());
    }
    ctx.l4_csum_replace(
        pkt.csum_off,
        old as u64,
        new as u64,
        BPF_F_PSEUDO_HDR as u64 | 4 | l4_flags(pkt),
    )
    .map_err(|_| REWRITE_FAILED)
}

/// The L4 checksum updated for a port changing from `old` to `new` (SCTP:
/// see [`sctp_ports`]).
fn l4_csum_port(ctx: &TcContext, pkt: &Packet, old: u16, new: u16) -> Result<(), Verdict> {
    if old == new || !pkt.l4_present || pkt.proto == IPPROTO_SCTP {
        return Ok(());
    }
    ctx.l4_csum_replace(pkt.csum_off, old as u64, new as u64, 2 | l4_flags(pkt))
        .map_err(|_| REWRITE_FAILED)
}

/// The 4 port bytes at the start of an L4 header, as stored, read as one
/// native integer.
#[inline(always)]
fn ports_word(sport_be: u16, dport_be: u16) -> u32 {
    let (s, d) = (sport_be.to_ne_bytes(), dport_be.to_ne_bytes());
    u32::from_ne_bytes([s[0], s[1], d[0], d[1]])
}

/// SCTP's CRC32c updated for the ports of `to` ([`crc32c::update_ports`]),
/// before they are written. The CRC covers the whole SCTP packet: the first
/// fragment of a fragmented one does not tell its length, and is dropped
/// (`drop_sctp_fragment`). A packet whose CRC is yet to be computed (a
/// local sender's, `CHECKSUM_PARTIAL` with the CRC offloaded, as over veth)
/// has a field of 0, left so ([`crc32c::update_ports`]): the kernel
/// computes the CRC later over the field as it is.
#[inline(always)]
fn sctp_ports(ctx: &TcContext, pkt: &Packet, to: &Tuple) -> Result<(), Verdict> {
    let old = ports_word(pkt.sport_be, pkt.dport_be);
    let new = ports_word(to.sport_be, to.dport_be);
    if old == new || !pkt.l4_present {
        return Ok(());
    }
    // Read here, not kept in `pkt` by the parser: a fragment flag the
    // verifier knows on each of the parser's paths would keep those paths
    // apart through the whole program (measured: past its million).
    let frag = ctx.load::<u16>(IP_FRAG_OFF).map_err(|_| REWRITE_FAILED)?;
    if u16::from_be(frag) & IP_MF != 0 {
        return Err(Verdict::Drop(stat::DROP_SCTP_FRAGMENT));
    }
    let ihl = pkt.l4_off - ETH_HLEN;
    let len = (pkt.tot_len as usize).saturating_sub(ihl) as u16;
    let stored = ctx.load::<u32>(pkt.csum_off).map_err(|_| REWRITE_FAILED)?;
    let crc = crc32c::update_ports(stored, len, old, new);
    ctx.store(pkt.csum_off, &crc, 0).map_err(|_| REWRITE_FAILED)
}

/// Rewrites a tc packet to tuple `to`, with the IPv4 and L4 checksums kept
/// valid; a later fragment only gets its addresses rewritten (an SCTP one
/// whatever its ports: its CRC is the first fragment's, see
/// [`sctp_ports`]).
///
/// The L4 checksum goes through `bpf_l4_csum_replace`, one call per changed
/// field: only the kernel knows how the skb keeps it (`CHECKSUM_PARTIAL`
/// leaves the field to the device, and a port does not change it then;
/// `CHECKSUM_COMPLETE` wants `skb->csum` updated with a pseudo-header
/// address). The IPv4 header checksum is plain data: it is computed here and
/// written with both addresses and, without IP options, both ports in one
/// store (a field left as it was is written again: a branch per field here
/// multiplies the paths the verifier walks, measured past its million
/// instructions in `pod_ingress`).
pub fn rewrite(ctx: &TcContext, pkt: &mut Packet, to: &Tuple) -> Result<(), Verdict> {
    if pkt.proto == IPPROTO_SCTP {
        sctp_ports(ctx, pkt, to)?;
    }
    let (os, od) = (csum::words(pkt.saddr_be), csum::words(pkt.daddr_be));
    l4_csum_addr(ctx, pkt, pkt.daddr_be, to.daddr_be)?;
    pkt.daddr_be = to.daddr_be;
    l4_csum_port(ctx, pkt, pkt.dport_be, to.dport_be)?;
    pkt.dport_be = to.dport_be;
    l4_csum_addr(ctx, pkt, pkt.saddr_be, to.saddr_be)?;
    pkt.saddr_be = to.saddr_be;
    l4_csum_port(ctx, pkt, pkt.sport_be, to.sport_be)?;
    pkt.sport_be = to.sport_be;
    let check = tc_load::<u16>(ctx, IP_CSUM_OFF).map_err(|_| REWRITE_FAILED)?;
    let (ns, nd) = (csum::words(to.saddr_be), csum::words(to.daddr_be));
    let check = csum::update(
        check,
        &[os[0], os[1], od[0], od[1], 0, 0],
        &[ns[0], ns[1], nd[0], nd[1], 0, 0],
    );
    if pkt.l4_present && pkt.l4_off == IP_CSUM_OFF + 10 {
        // No IP options: checksum, addresses and ports are 14 contiguous
        // bytes, one store.
        let tail = [check, ns[0], ns[1], nd[0], nd[1], to.sport_be, to.dport_be];
        return ctx.store(IP_CSUM_OFF, &tail, 0).map_err(|_| REWRITE_FAILED);
    }
    // Checksum, source, destination: bytes 10..20 of the IPv4 header.
    let tail = [check, ns[0], ns[1], nd[0], nd[1]];
    ctx.store(IP_CSUM_OFF, &tail, 0)
        .map_err(|_| REWRITE_FAILED)?;
    if pkt.l4_present {
        ctx.store(pkt.l4_off, &[to.sport_be, to.dport_be], 0)
            .map_err(|_| REWRITE_FAILED)?;
    }
    Ok(())
}

// --- XDP: rewrites in place -------------------------------------------------

/// Rewrites the 4-tuple of an IPv4 TCP/UDP frame in place (no IP options),
/// updating the IPv4 and L4 checksums incrementally.
pub fn xdp_rewrite(ctx: &XdpContext, pkt: &mut Packet, to: &Tuple) -> Result<(), Verdict> {
    let (saddr, sport, daddr, dport) = (to.saddr_be, to.sport_be, to.daddr_be, to.dport_be);
    let ip = xdp_ptr::<Ipv4Hdr>(ctx, ETH_HLEN).ok_or(REWRITE_FAILED)?;
    let (os, od) = (csum::words(pkt.saddr_be), csum::words(pkt.daddr_be));
    let (ns, nd) = (csum::words(saddr), csum::words(daddr));
    let old = [os[0], os[1], od[0], od[1], pkt.sport_be, pkt.dport_be];
    let new = [ns[0], ns[1], nd[0], nd[1], sport, dport];
    let old_ip = [os[0], os[1], od[0], od[1], 0, 0];
    let new_ip = [ns[0], ns[1], nd[0], nd[1], 0, 0];
    let l4 = ETH_HLEN + 20;
    if pkt.proto == IPPROTO_TCP {
        let c = xdp_ptr::<u16>(ctx, l4 + 16).ok_or(REWRITE_FAILED)?;
        // SAFETY: bounds-checked frame pointers.
        unsafe { *c = csum::update(*c, &old, &new) };
    } else {
        let c = xdp_ptr::<u16>(ctx, l4 + 6).ok_or(REWRITE_FAILED)?;
        // SAFETY: bounds-checked frame pointers.
        unsafe {
            // A UDP checksum of 0 means "none"; a computed 0 is sent as 0xffff.
            if *c != 0 {
                let v = csum::update(*c, &old, &new);
                *c = if v == 0 { 0xffff } else { v };
            }
        }
    }
    let ports = xdp_ptr::<[u16; 2]>(ctx, l4).ok_or(REWRITE_FAILED)?;
    // SAFETY: bounds-checked frame pointers.
    unsafe {
        (*ip).check = csum::update((*ip).check, &old_ip, &new_ip);
        (*ip).saddr_be = saddr;
        (*ip).daddr_be = daddr;
        *ports = [sport, dport];
    }
    pkt.saddr_be = saddr;
    pkt.daddr_be = daddr;
    pkt.sport_be = sport;
    pkt.dport_be = dport;
    Ok(())
}

//! Kernel side of the kube-proxy replacement.
//!
//! `pod_ingress` runs at tc ingress on the host side of every pod interface. It
//! does, for each IPv4 TCP/UDP packet, with hash lookups only:
//!
//! 1. frontend lookup (destination address, port, protocol, internal scope);
//! 2. for a frontend: conntrack FIRST (a tracked flow keeps its backend while that
//!    backend exists), else a random backend among the frontend's slots; DNAT,
//!    plus SNAT to the hairpin address when a pod reaches itself; conntrack
//!    entries for both directions; delivery by redirect;
//! 3. a frontend without backends: an ICMP port unreachable back to the client
//!    (or a drop when the agent marked it "endpoints only elsewhere");
//! 4. otherwise a reply of a tracked flow: reverse NAT, so the client sees the
//!    frontend as the source; delivery by redirect;
//! 5. anything else is passed untouched.
//!
//! Limits (each counted in the stats map when it happens): IPv4 only; fragments
//! are passed untouched; ICMP errors about translated flows are not translated.
#![no_std]
#![no_main]

use core::mem::size_of;

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams, bpf_redir_neigh, xdp_action, BPF_ANY,
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_F_MARK_MANGLED_0,
        BPF_F_PSEUDO_HDR, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT,
    },
    btf_maps::{lpm_trie::Key as LpmKey, Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
    helpers::{
        bpf_fib_lookup, bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_redirect, bpf_redirect_neigh,
        bpf_redirect_peer, bpf_skb_change_tail,
    },
    macros::{btf_map, classifier, xdp},
    programs::{TcContext, XdpContext},
};
use proxy_common::{
    backend_state, capacity, ct_dir, ct_flags, iface_flags, stat, svc_flags, Affinity4Key,
    Affinity4Value, Backend4, Config, Ct4Key, Ct4Value, Frag4Key, Frag4Ports, Iface, RevNat4,
    SourceRange4, Svc4Key, Svc4Value, Traffic, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP,
    MAP_LAYOUT_VERSION, SCOPE_EXTERNAL, SCOPE_INTERNAL, SOURCE_RANGE_ID_BITS,
};

#[btf_map]
static SVC4_V1: HashMap<Svc4Key, Svc4Value, { capacity::SERVICES as usize }> = HashMap::new();
#[btf_map]
static BACKEND4_V1: HashMap<u32, Backend4, { capacity::BACKENDS as usize }> = HashMap::new();
#[btf_map]
static REVNAT4_V1: HashMap<u16, RevNat4, { capacity::REV_NAT as usize }> = HashMap::new();
#[btf_map]
static CT4_V1: LruHashMap<Ct4Key, Ct4Value, { capacity::CONNTRACK as usize }> = LruHashMap::new();
#[btf_map]
static STATS_V1: PerCpuArray<u64, { capacity::STATS as usize }> = PerCpuArray::new();
#[btf_map]
static CONFIG_V1: Array<Config, 1> = Array::new();
#[btf_map]
static IFACE_V1: HashMap<u32, Iface, { capacity::IFACES as usize }> = HashMap::new();
#[btf_map]
static FRAG4_V1: LruHashMap<Frag4Key, Frag4Ports, { capacity::FRAGMENTS as usize }> =
    LruHashMap::new();
#[btf_map]
static SRCRANGE4_V1: LpmTrie<SourceRange4, u8, { capacity::SOURCE_RANGES as usize }> =
    LpmTrie::new();
#[btf_map]
static FE_TRAFFIC_V1: PerCpuArray<Traffic, { capacity::FRONTEND_TRAFFIC as usize }> =
    PerCpuArray::new();
#[btf_map]
static BE_TRAFFIC_V1: PerCpuArray<Traffic, { capacity::BACKENDS as usize }> = PerCpuArray::new();
#[btf_map]
static AFFINITY4_V1: LruHashMap<Affinity4Key, Affinity4Value, { capacity::AFFINITY as usize }> =
    LruHashMap::new();

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const AF_INET: u8 = 2;
const IP_CSUM_OFF: usize = ETH_HLEN + 10;
const IP_TTL_OFF: usize = ETH_HLEN + 8;
const IP_SRC_OFF: usize = ETH_HLEN + 12;
const IP_DST_OFF: usize = ETH_HLEN + 16;
const NSEC_PER_SEC: u64 = 1_000_000_000;
const IP_MF: u16 = 0x2000;
const IP_OFFSET: u16 = 0x1fff;

/// The fixed 20 bytes of an IPv4 header, as in the packet.
#[repr(C)]
#[derive(Clone, Copy)]
struct Ipv4Hdr {
    ver_ihl: u8,
    tos: u8,
    tot_len_be: u16,
    id_be: u16,
    frag_off_be: u16,
    ttl: u8,
    proto: u8,
    check: u16,
    saddr_be: u32,
    daddr_be: u32,
}
const _: () = assert!(size_of::<Ipv4Hdr>() == 20);

/// What the parser found: offsets and the 5-tuple, as in the packet.
struct Packet {
    l4_off: usize,
    csum_off: usize,
    proto: u8,
    saddr_be: u32,
    daddr_be: u32,
    sport_be: u16,
    dport_be: u16,
    tot_len: u16,
    tcp_flags: u8,
    /// False for a non-first IPv4 fragment: it carries no L4 header; its ports
    /// come from the fragment map, and only addresses are rewritten.
    l4_present: bool,
}

impl Packet {
    /// The conntrack key of this packet's tuple, as it is in the packet.
    #[inline(always)]
    fn ct_key(&self, dir: u8) -> Ct4Key {
        Ct4Key {
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

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// Accounts a translated packet to its frontend and backend.
#[inline(always)]
fn account(len: u64, rev_nat_id: u16, backend_id: u32) {
    for p in [
        FE_TRAFFIC_V1.get_ptr_mut(rev_nat_id as u32),
        BE_TRAFFIC_V1.get_ptr_mut(backend_id),
    ]
    .into_iter()
    .flatten()
    {
        // SAFETY: per-CPU slot of this CPU; no other writer while we run.
        unsafe {
            (*p).packets += 1;
            (*p).bytes += len;
        }
    }
}

#[inline(always)]
fn count(code: u32) {
    if let Some(p) = STATS_V1.get_ptr_mut(code) {
        // SAFETY: per-CPU slot of this CPU; no other writer while we run.
        unsafe { *p += 1 };
    }
}

/// A verdict and the counter it is recorded under.
type Verdict = (i32, u32);

/// Not a tc action: "translated, now deliver it", returned by the translation
/// paths so that `deliver` runs from the program's top frame (the verifier
/// limits the combined stack of nested calls).
const DELIVER: i32 = -1;

#[inline(always)]
fn then_deliver(ctx: &TcContext, pkt: &Packet, r: Result<Verdict, u32>) -> Result<Verdict, u32> {
    match r {
        Ok((DELIVER, code)) => Ok(deliver(ctx, pkt, code)),
        other => other,
    }
}

#[classifier]
pub fn pod_ingress(ctx: TcContext) -> i32 {
    finish(try_pod_ingress(&ctx))
}

/// tc ingress of the node's external devices: replies from backends on other
/// nodes get their reverse NAT here, the first hook they meet on this node.
#[classifier]
pub fn ext_ingress(ctx: TcContext) -> i32 {
    finish(try_ext_ingress(&ctx))
}

#[inline(always)]
fn finish(r: Result<Verdict, u32>) -> i32 {
    let (action, code) = match r {
        Ok(v) => v,
        Err(code) => (TC_ACT_SHOT as i32, code),
    };
    count(code);
    action
}

/// Parses Ethernet / IPv4 / TCP-UDP ports. `Err(verdict)` for packets that are
/// passed untouched before any lookup.
fn parse(ctx: &TcContext) -> Result<(Packet, Ipv4Hdr, usize), Verdict> {
    let pass = TC_ACT_OK as i32;
    let Ok(h_proto) = ctx.load::<u16>(12) else {
        return Err((pass, stat::PASS_NOT_IPV4));
    };
    if u16::from_be(h_proto) != ETH_P_IP {
        return Err((pass, stat::PASS_NOT_IPV4));
    }
    let Ok(ip) = ctx.load::<Ipv4Hdr>(ETH_HLEN) else {
        return Err((pass, stat::PASS_MALFORMED));
    };
    let ihl = (ip.ver_ihl & 0x0f) as usize * 4;
    if ip.ver_ihl >> 4 != 4 || ihl < 20 {
        return Err((pass, stat::PASS_MALFORMED));
    }
    if ip.proto != IPPROTO_TCP && ip.proto != IPPROTO_UDP {
        return Err((pass, stat::PASS_OTHER_PROTO));
    }
    let l4_off = ETH_HLEN + ihl;
    let frag = u16::from_be(ip.frag_off_be);
    let fkey = Frag4Key {
        saddr_be: ip.saddr_be,
        daddr_be: ip.daddr_be,
        id_be: ip.id_be,
        proto: ip.proto,
        _pad: 0,
    };
    let mut l4_present = true;
    let ports = if frag & IP_OFFSET != 0 {
        // A later fragment: its ports are those its first fragment carried.
        let Some(p) = FRAG4_V1.get_ptr(fkey) else {
            return Err((pass, stat::PASS_FRAGMENT));
        };
        l4_present = false;
        // SAFETY: map value pointer, copied.
        let p = unsafe { *p };
        [p.sport_be, p.dport_be]
    } else {
        let Ok(ports) = ctx.load::<[u16; 2]>(l4_off) else {
            return Err((pass, stat::PASS_MALFORMED));
        };
        if frag & IP_MF != 0 {
            // A first fragment: remember its ports for the ones that follow.
            let v = Frag4Ports {
                sport_be: ports[0],
                dport_be: ports[1],
            };
            let _ = FRAG4_V1.insert(fkey, v, BPF_ANY as u64);
            count(stat::FRAGMENT_TRACKED);
        }
        ports
    };
    let (csum_off, l4_min) = if ip.proto == IPPROTO_TCP {
        (16, 20)
    } else {
        (6, 8)
    };
    let pkt = Packet {
        l4_off,
        csum_off: l4_off + csum_off,
        proto: ip.proto,
        saddr_be: ip.saddr_be,
        daddr_be: ip.daddr_be,
        sport_be: ports[0],
        dport_be: ports[1],
        tot_len: u16::from_be(ip.tot_len_be),
        tcp_flags: 0,
        l4_present,
    };
    Ok((pkt, ip, if l4_present { l4_off + l4_min } else { l4_off }))
}

fn try_ext_ingress(ctx: &TcContext) -> Result<Verdict, u32> {
    service_entry(ctx, SCOPE_EXTERNAL)
}

/// The reply direction of a tracked flow: reverse NAT (source back to the
/// frontend; for hairpin and port-SNAT flows the destination back to the
/// client), then delivery. `None` when the packet is no such reply.
fn reply(ctx: &TcContext, pkt: &mut Packet, l4_complete: bool) -> Option<Result<Verdict, u32>> {
    let rkey = pkt.ct_key(ct_dir::REPLY);
    let ct = CT4_V1.get_ptr(rkey)?;
    if !l4_complete {
        return Some(Ok((TC_ACT_OK as i32, stat::PASS_MALFORMED)));
    }
    // SAFETY: a map value pointer, read once into a copy.
    let ct = unsafe { *ct };
    // The frontend is gone: nothing to translate back to.
    let rev = REVNAT4_V1.get_ptr(ct.rev_nat_id)?;
    // SAFETY: as above.
    let rev = unsafe { *rev };
    account(ctx.len() as u64, ct.rev_nat_id, ct.backend_id);
    Some(reverse_nat(ctx, pkt, &ct, &rev))
}

fn reverse_nat(
    ctx: &TcContext,
    pkt: &mut Packet,
    ct: &Ct4Value,
    rev: &RevNat4,
) -> Result<Verdict, u32> {
    rewrite_src(ctx, pkt, rev.addr_be, rev.port_be)?;
    if ct.flags & ct_flags::SNAT_ADDR != 0 {
        rewrite_daddr(ctx, pkt, ct.nat_addr_be)?;
    }
    if ct.flags & ct_flags::SNAT_PORT != 0 {
        rewrite_dport(ctx, pkt, ct.nat_port_be)?;
    }
    Ok((DELIVER, stat::FWD_REPLY))
}

fn try_pod_ingress(ctx: &TcContext) -> Result<Verdict, u32> {
    service_entry(ctx, SCOPE_INTERNAL)
}

/// Both programs: a frontend of `scope` (internal from pods, external from the
/// node's devices) is translated; otherwise a reply of a tracked flow is
/// reverse-translated; anything else passes untouched.
#[inline(always)]
fn service_entry(ctx: &TcContext, scope: u8) -> Result<Verdict, u32> {
    let pass = TC_ACT_OK as i32;
    let (mut pkt, ip, l4_end) = match parse(ctx) {
        Ok(p) => p,
        Err(v) => return Ok(v),
    };
    let fe_key = Svc4Key {
        addr_be: pkt.daddr_be,
        port_be: pkt.dport_be,
        slot: 0,
        proto: pkt.proto,
        scope,
        _pad: [0; 2],
    };
    let frontend = SVC4_V1.get_ptr(fe_key);
    let l4_complete = ctx.len() as usize >= l4_end;
    let Some(frontend) = frontend else {
        // Not for a frontend: perhaps a reply of a tracked flow.
        let r = match reply(ctx, &mut pkt, l4_complete) {
            Some(r) => r,
            None => Ok((pass, stat::PASS_NO_SERVICE)),
        };
        return then_deliver(ctx, &pkt, r);
    };
    if !l4_complete {
        return Err(stat::DROP_MALFORMED);
    }
    if pkt.proto == IPPROTO_TCP && pkt.l4_present {
        // Byte 13 of the TCP header holds the flags.
        pkt.tcp_flags = ctx
            .load::<u8>(pkt.l4_off + 13)
            .map_err(|_| stat::DROP_MALFORMED)?;
    }
    // SAFETY: a map value pointer, read once into a copy.
    let fe = unsafe { *frontend };
    match service(ctx, &mut pkt, &fe, scope) {
        Err(stat::REJECT_NO_BACKEND) => reject(ctx, &ip),
        other => then_deliver(ctx, &pkt, other),
    }
}

fn ct_timeout_ns(cfg: &Config, proto: u8, flags: u16) -> u64 {
    let s = if proto != IPPROTO_TCP {
        cfg.ct_udp_s
    } else if flags & ct_flags::TCP_CLOSING != 0 {
        cfg.ct_tcp_closing_s
    } else if flags & ct_flags::TCP_SYN != 0 {
        cfg.ct_tcp_syn_s
    } else {
        cfg.ct_tcp_established_s
    };
    s as u64 * NSEC_PER_SEC
}

/// TCP state bits after a packet with `tcp_flags`, given the previous bits.
fn tcp_state(prev: u16, tcp_flags: u8) -> u16 {
    let mut f = prev & !(ct_flags::TCP_SYN);
    if tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        f |= ct_flags::TCP_CLOSING;
    } else if tcp_flags & TCP_SYN != 0 && tcp_flags & TCP_ACK == 0 {
        // A new SYN reopens a closing tuple (port reuse).
        f = (f & !ct_flags::TCP_CLOSING) | ct_flags::TCP_SYN;
    }
    f
}

/// The state of one flow as the forward path needs it.
#[derive(Clone, Copy, Default)]
struct Flow {
    backend_id: u32,
    backend: Backend4,
    /// [`ct_flags`] of the SERVICE entry.
    flags: u16,
    /// With [`ct_flags::SNAT_ADDR`]: the source address the backend sees.
    nat_addr_be: u32,
    /// With [`ct_flags::SNAT_PORT`]: the source port the backend sees.
    nat_port_be: u16,
}

#[inline(always)]
fn ct_alive(cfg: &Config, proto: u8, v: &Ct4Value, now: u64) -> bool {
    now.saturating_sub(v.last_seen_ns) <= ct_timeout_ns(cfg, proto, v.flags)
}

fn backend(id: u32) -> Option<Backend4> {
    // SAFETY: map value pointer, copied.
    BACKEND4_V1.get_ptr(id).map(|b| unsafe { *b })
}

/// Whether the backend-side tuple `rkey` belongs to another live flow: one of
/// another frontend (two frontends sharing a backend, hit from the same client
/// address and port — field bug C6) whose SERVICE entry is still alive.
fn reply_tuple_taken(cfg: &Config, rkey: &Ct4Key, rev_nat_id: u16, now: u64) -> bool {
    let Some(e) = CT4_V1.get_ptr(*rkey) else {
        return false;
    };
    // SAFETY: map value pointer, copied.
    let e = unsafe { *e };
    if e.rev_nat_id == rev_nat_id {
        // An earlier flow of the same frontend on the same tuple: reused.
        return false;
    }
    let Some(rev) = REVNAT4_V1.get_ptr(e.rev_nat_id) else {
        return false;
    };
    // SAFETY: map value pointer, copied.
    let rev = unsafe { *rev };
    let client = if e.flags & ct_flags::HAIRPIN != 0 {
        e.nat_addr_be
    } else {
        rkey.daddr_be
    };
    let cport = if e.flags & ct_flags::SNAT_PORT != 0 {
        e.nat_port_be
    } else {
        rkey.dport_be
    };
    let okey = Ct4Key {
        saddr_be: client,
        daddr_be: rev.addr_be,
        sport_be: cport,
        dport_be: rev.port_be,
        proto: rkey.proto,
        dir: ct_dir::SERVICE,
        _pad: [0; 2],
    };
    match CT4_V1.get_ptr(okey) {
        // SAFETY: map value pointer, copied.
        Some(o) => {
            let o = unsafe { *o };
            o.backend_id == e.backend_id && ct_alive(cfg, rkey.proto, &o, now)
        }
        None => false,
    }
}

/// Picks a backend for a new flow: the client's session affinity when it is
/// still valid, else a random slot. `Err` when there is none to pick.
/// `Err(Err(REJECT_NO_BACKEND))` asks the caller to reject.
fn select(
    pkt: &Packet,
    fe_key: &Svc4Key,
    fe: &Svc4Value,
    now: u64,
) -> Result<(u32, Backend4), Result<Verdict, u32>> {
    if fe.count == 0 {
        if fe.flags & svc_flags::DROP_NO_BACKEND != 0 {
            return Err(Err(stat::DROP_NO_LOCAL_BACKEND));
        }
        // Answered by the caller, outside this call chain (stack depth).
        return Err(Err(stat::REJECT_NO_BACKEND));
    }
    let akey = Affinity4Key {
        client_be: pkt.saddr_be,
        rev_nat_id: fe.rev_nat_id,
        _pad: 0,
    };
    let timeout_ns = fe.affinity_timeout_s as u64 * NSEC_PER_SEC;
    if timeout_ns != 0 {
        if let Some(a) = AFFINITY4_V1.get_ptr_mut(akey) {
            // SAFETY: LRU value pointer; fields read and written individually.
            let a = unsafe { &mut *a };
            if now.saturating_sub(a.last_used_ns) <= timeout_ns {
                if let Some(b) = backend(a.backend_id) {
                    // Refreshed by each new connection, as kube-proxy's
                    // `recent --set` does; conntrack never extends it.
                    a.last_used_ns = now;
                    count(stat::AFFINITY_HIT);
                    return Ok((a.backend_id, b));
                }
            }
        }
    }
    // SAFETY: helper without arguments.
    let r = unsafe { bpf_get_prandom_u32() };
    let slot = (r % fe.count as u32) as u16 + 1;
    let Some(sv) = SVC4_V1.get_ptr(fe_key.with_slot(slot)) else {
        return Err(Err(stat::DROP_NO_BACKEND_ENTRY));
    };
    // SAFETY: map value pointer, copied.
    let id = unsafe { (*sv).backend_id };
    let Some(b) = backend(id) else {
        return Err(Err(stat::DROP_NO_BACKEND_ENTRY));
    };
    if timeout_ns != 0 {
        let av = Affinity4Value {
            backend_id: id,
            _pad: 0,
            last_used_ns: now,
        };
        let _ = AFFINITY4_V1.insert(akey, av, BPF_ANY as u64);
    }
    Ok((id, b))
}

const NAT_PORT_MIN: u32 = 32768;
const NAT_PORT_RANGE: u32 = 65536 - NAT_PORT_MIN;
const NAT_PORT_TRIES: u32 = 4;

/// A free source port for a flow whose backend-side tuple is `rkey`: a few
/// random tries in [`NAT_PORT_MIN`, 65535]; `None` when all were taken.
fn free_nat_port(rkey: &mut Ct4Key) -> Option<u16> {
    for _ in 0..NAT_PORT_TRIES {
        // SAFETY: helper without arguments.
        let r = unsafe { bpf_get_prandom_u32() };
        let port_be = ((NAT_PORT_MIN + r % NAT_PORT_RANGE) as u16).to_be();
        rkey.dport_be = port_be;
        if CT4_V1.get_ptr(*rkey).is_none() {
            return Some(port_be);
        }
    }
    None
}

/// Whether a client in `addr_be` may open flows to the frontend with
/// `rev_nat_id` (its `loadBalancerSourceRanges`).
fn source_allowed(rev_nat_id: u16, addr_be: u32) -> bool {
    let key = LpmKey {
        prefix_len: SOURCE_RANGE_ID_BITS + 32,
        data: SourceRange4 {
            rev_nat_id_be: rev_nat_id.to_be(),
            _pad: 0,
            addr_be,
        },
    };
    SRCRANGE4_V1.get(&key).is_some()
}

/// Translates a packet for frontend `fe`. `external`: it arrived on an
/// external device (NodePort, load-balancer IP, externalIP from outside).
/// (At most five arguments, the sret pointer included: a BPF call limit.)
#[inline(always)]
fn service(ctx: &TcContext, pkt: &mut Packet, fe: &Svc4Value, scope: u8) -> Result<Verdict, u32> {
    let mut flow = Flow::default();
    let out = decide(pkt, fe, scope, &mut flow);
    match out.kind {
        OUT_TRANSLATE => {}
        OUT_VERDICT if out.action == DEFER => return Ok((TC_ACT_OK as i32, out.code)),
        OUT_VERDICT => return Ok((out.action, out.code)),
        _ => return Err(out.code),
    }
    let established = out.established != 0;
    account(ctx.len() as u64, fe.rev_nat_id, flow.backend_id);
    // 6. DNAT (and SNAT for hairpin, another node, or a port collision).
    rewrite_daddr(ctx, pkt, flow.backend.addr_be)?;
    rewrite_dport(ctx, pkt, flow.backend.port_be)?;
    if flow.flags & ct_flags::SNAT_ADDR != 0 {
        rewrite_saddr(ctx, pkt, flow.nat_addr_be)?;
        if scope != SCOPE_EXTERNAL {
            count(stat::HAIRPIN);
        }
    }
    if flow.flags & ct_flags::SNAT_PORT != 0 {
        rewrite_sport(ctx, pkt, flow.nat_port_be)?;
    }
    let code = if established {
        stat::FWD_ESTABLISHED
    } else {
        stat::FWD_NEW
    };
    Ok((DELIVER, code))
}

/// Not a verdict: "pass it on" — to the stack from tc, to tc from XDP.
const DEFER: i32 = -2;
/// [`decide`] mode bit: called from XDP.
const FROM_XDP: u8 = 0x80;

/// The forward direction's decision for a packet to frontend `fe`: conntrack
/// first, else affinity or a random backend (with the SNATs it needs), and the
/// conntrack entries written. `Err` carries what to do instead: a verdict, a
/// drop code, or `REJECT_NO_BACKEND`. With `xdp`, flows to a backend on this
/// node are deferred to tc (which delivers to pods with `bpf_redirect_peer`)
/// before anything is written.
///
/// `mode`: the frontend scope, or-ed with [`FROM_XDP`]. (A BPF call takes at
/// most five arguments, the sret pointer included.)
fn decide(pkt: &Packet, fe: &Svc4Value, mode: u8, flow: &mut Flow) -> Outcome {
    match decide_inner(pkt, fe, mode) {
        Ok((f, established)) => {
            *flow = f;
            Outcome {
                kind: OUT_TRANSLATE,
                action: 0,
                code: 0,
                established: established as u32,
            }
        }
        Err(Ok((action, code))) => Outcome {
            kind: OUT_VERDICT,
            action,
            code,
            established: 0,
        },
        Err(Err(code)) => Outcome {
            kind: OUT_ERR,
            action: 0,
            code,
            established: 0,
        },
    }
}

/// What [`decide`] concluded, every byte initialized (an enum with undefined
/// bytes must not cross a BPF call: the verifier refuses reading them).
#[repr(C)]
#[derive(Clone, Copy)]
struct Outcome {
    kind: u32,
    action: i32,
    code: u32,
    established: u32,
}
const OUT_TRANSLATE: u32 = 0;
const OUT_VERDICT: u32 = 1;
const OUT_ERR: u32 = 2;

#[inline(always)]
fn decide_inner(
    pkt: &Packet,
    fe: &Svc4Value,
    mode: u8,
) -> Result<(Flow, bool), Result<Verdict, u32>> {
    let xdp = mode & FROM_XDP != 0;
    let scope = mode & !FROM_XDP;
    let Some(cfg) = CONFIG_V1.get(0) else {
        return Err(Ok((DEFER, stat::PASS_UNCONFIGURED)));
    };
    if cfg.layout_version != MAP_LAYOUT_VERSION {
        return Err(Ok((DEFER, stat::PASS_UNCONFIGURED)));
    }
    let external = scope == SCOPE_EXTERNAL;
    let fe_key = &Svc4Key {
        addr_be: pkt.daddr_be,
        port_be: pkt.dport_be,
        slot: 0,
        proto: pkt.proto,
        scope,
        _pad: [0; 2],
    };
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let skey = pkt.ct_key(ct_dir::SERVICE);
    let client_be = pkt.saddr_be;
    let client_port_be = pkt.sport_be;

    // 1. Conntrack first: a tracked flow keeps its backend while it exists.
    // (No Option<Flow>: LLVM may read the undefined payload of a None
    // speculatively, which the verifier refuses.)
    let mut tracked = Flow::default();
    let mut established = false;
    if let Some(ct) = CT4_V1.get_ptr_mut(skey) {
        // SAFETY: LRU value pointer; fields are read and written individually.
        let c = unsafe { &mut *ct };
        if ct_alive(cfg, pkt.proto, c, now) {
            if let Some(b) = backend(c.backend_id) {
                let flags = if pkt.proto == IPPROTO_TCP && pkt.l4_present {
                    tcp_state(c.flags, pkt.tcp_flags)
                } else {
                    c.flags
                };
                if flags != c.flags || now.saturating_sub(c.last_seen_ns) > NSEC_PER_SEC {
                    c.flags = flags;
                    c.last_seen_ns = now;
                }
                tracked = Flow {
                    backend_id: c.backend_id,
                    backend: b,
                    flags: c.flags,
                    nat_addr_be: c.nat_addr_be,
                    nat_port_be: c.nat_port_be,
                };
                established = true;
            }
        }
    }
    if xdp && established && tracked.backend.state & backend_state::LOCAL != 0 {
        return Err(Ok((DEFER, stat::XDP_DEFERRED)));
    }
    let flow = match established {
        true => tracked,
        false if !pkt.l4_present => {
            // A later fragment of a flow that is not tracked: nothing to follow.
            return Err(Ok((DEFER, stat::PASS_FRAGMENT)));
        }
        false => {
            if external
                && fe.flags & svc_flags::SOURCE_RANGES != 0
                && !source_allowed(fe.rev_nat_id, client_be)
            {
                return Err(Err(stat::DROP_SOURCE_RANGE));
            }
            // 2. A new flow: affinity or a random backend (or reject / drop).
            let (backend_id, b) = select(pkt, fe_key, fe, now)?;
            if xdp && b.state & backend_state::LOCAL != 0 {
                return Err(Ok((DEFER, stat::XDP_DEFERRED)));
            }
            let mut flags = 0;
            let mut nat_addr_be = 0;
            if !external && b.addr_be == client_be && cfg.hairpin_addr_be != 0 {
                // Hairpin: the pod would drop its own address as a martian source.
                flags |= ct_flags::SNAT_ADDR;
                nat_addr_be = cfg.hairpin_addr_be;
            } else if external
                && b.state & backend_state::LOCAL == 0
                && fe.flags & svc_flags::EXTERNAL_LOCAL == 0
                && cfg.node_addr_be != 0
            {
                // externalTrafficPolicy: Cluster to another node: SNAT to this
                // node so that the replies come back through it.
                flags |= ct_flags::SNAT_ADDR | ct_flags::SNAT_PORT;
                nat_addr_be = cfg.node_addr_be;
            }
            if pkt.proto == IPPROTO_TCP {
                flags |= tcp_state(0, pkt.tcp_flags);
                if pkt.tcp_flags & TCP_SYN == 0 {
                    count(stat::CT_NEW_MIDSTREAM);
                }
            }
            // 3. The backend-side tuple must not belong to another live flow.
            let mut rkey = Ct4Key {
                saddr_be: b.addr_be,
                daddr_be: if flags & ct_flags::SNAT_ADDR != 0 {
                    nat_addr_be
                } else {
                    client_be
                },
                sport_be: b.port_be,
                dport_be: client_port_be,
                proto: pkt.proto,
                dir: ct_dir::REPLY,
                _pad: [0; 2],
            };
            let mut nat_port_be = 0;
            if flags & ct_flags::SNAT_PORT != 0 {
                let Some(p) = free_nat_port(&mut rkey) else {
                    return Err(Err(stat::DROP_NO_FREE_PORT));
                };
                nat_port_be = p;
                count(stat::SNAT_NODE);
            } else if reply_tuple_taken(cfg, &rkey, fe.rev_nat_id, now) {
                let Some(p) = free_nat_port(&mut rkey) else {
                    return Err(Err(stat::DROP_NO_FREE_PORT));
                };
                nat_port_be = p;
                flags |= ct_flags::SNAT_PORT;
                count(stat::SNAT_PORT_COLLISION);
            }
            let sval = Ct4Value {
                backend_id,
                nat_addr_be,
                rev_nat_id: fe.rev_nat_id,
                flags,
                nat_port_be,
                _pad: 0,
                last_seen_ns: now,
            };
            let mine = Flow {
                backend_id,
                backend: b,
                flags,
                nat_addr_be,
                nat_port_be,
            };
            // 4. A racing first packet of the same flow on another CPU may have
            // won: follow its choice rather than split the flow (field bug K8).
            let mut flow = mine;
            if CT4_V1.insert(skey, sval, BPF_NOEXIST as u64).is_err() {
                let mut follow = false;
                if let Some(w) = CT4_V1.get_ptr(skey) {
                    // SAFETY: map value pointer, copied.
                    let w = unsafe { *w };
                    if ct_alive(cfg, pkt.proto, &w, now) {
                        if let Some(wb) = backend(w.backend_id) {
                            flow = Flow {
                                backend_id: w.backend_id,
                                backend: wb,
                                flags: w.flags,
                                nat_addr_be: w.nat_addr_be,
                                nat_port_be: w.nat_port_be,
                            };
                            follow = true;
                        }
                    }
                }
                if !follow && CT4_V1.insert(skey, sval, BPF_ANY as u64).is_err() {
                    count(stat::CT_INSERT_FAILED);
                }
            }
            flow
        }
    };

    // 5. The reply entry: written for a new flow; written again for a tracked
    // flow whose reply entry the LRU evicted, so replies are always translated.
    let snat_addr = flow.flags & ct_flags::SNAT_ADDR != 0;
    let snat_port = flow.flags & ct_flags::SNAT_PORT != 0;
    let rkey = Ct4Key {
        saddr_be: flow.backend.addr_be,
        daddr_be: if snat_addr {
            flow.nat_addr_be
        } else {
            client_be
        },
        sport_be: flow.backend.port_be,
        dport_be: if snat_port {
            flow.nat_port_be
        } else {
            client_port_be
        },
        proto: pkt.proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    };
    let restore = established && CT4_V1.get_ptr(rkey).is_none();
    if restore {
        count(stat::CT_REPLY_RESTORED);
    }
    if !established || restore {
        let rval = Ct4Value {
            backend_id: flow.backend_id,
            nat_addr_be: if snat_addr { client_be } else { 0 },
            rev_nat_id: fe.rev_nat_id,
            flags: flow.flags & (ct_flags::SNAT_ADDR | ct_flags::SNAT_PORT),
            nat_port_be: if snat_port { client_port_be } else { 0 },
            _pad: 0,
            last_seen_ns: now,
        };
        if CT4_V1.insert(rkey, rval, BPF_ANY as u64).is_err() {
            count(stat::CT_INSERT_FAILED);
        }
    }

    Ok((flow, established))
}

fn l4_flags(pkt: &Packet) -> u64 {
    if pkt.proto == IPPROTO_UDP {
        BPF_F_MARK_MANGLED_0 as u64
    } else {
        0
    }
}

fn rewrite_addr(ctx: &TcContext, pkt: &Packet, off: usize, old: u32, new: u32) -> Result<(), u32> {
    if old == new {
        return Ok(());
    }
    let e = stat::DROP_REWRITE_FAILED;
    if pkt.l4_present {
        ctx.l4_csum_replace(
            pkt.csum_off,
            old as u64,
            new as u64,
            BPF_F_PSEUDO_HDR as u64 | 4 | l4_flags(pkt),
        )
        .map_err(|_| e)?;
    }
    ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4)
        .map_err(|_| e)?;
    ctx.store(off, &new, 0).map_err(|_| e)
}

fn rewrite_port(ctx: &TcContext, pkt: &Packet, off: usize, old: u16, new: u16) -> Result<(), u32> {
    if old == new || !pkt.l4_present {
        return Ok(());
    }
    let e = stat::DROP_REWRITE_FAILED;
    ctx.l4_csum_replace(pkt.csum_off, old as u64, new as u64, 2 | l4_flags(pkt))
        .map_err(|_| e)?;
    ctx.store(off, &new, 0).map_err(|_| e)
}

fn rewrite_daddr(ctx: &TcContext, pkt: &mut Packet, addr_be: u32) -> Result<(), u32> {
    rewrite_addr(ctx, pkt, IP_DST_OFF, pkt.daddr_be, addr_be)?;
    pkt.daddr_be = addr_be;
    Ok(())
}

fn rewrite_saddr(ctx: &TcContext, pkt: &mut Packet, addr_be: u32) -> Result<(), u32> {
    rewrite_addr(ctx, pkt, IP_SRC_OFF, pkt.saddr_be, addr_be)?;
    pkt.saddr_be = addr_be;
    Ok(())
}

fn rewrite_dport(ctx: &TcContext, pkt: &mut Packet, port_be: u16) -> Result<(), u32> {
    rewrite_port(ctx, pkt, pkt.l4_off + 2, pkt.dport_be, port_be)?;
    pkt.dport_be = port_be;
    Ok(())
}

fn rewrite_sport(ctx: &TcContext, pkt: &mut Packet, port_be: u16) -> Result<(), u32> {
    rewrite_port(ctx, pkt, pkt.l4_off, pkt.sport_be, port_be)?;
    pkt.sport_be = port_be;
    Ok(())
}

fn rewrite_src(ctx: &TcContext, pkt: &mut Packet, addr_be: u32, port_be: u16) -> Result<(), u32> {
    rewrite_saddr(ctx, pkt, addr_be)?;
    rewrite_sport(ctx, pkt, port_be)
}

/// Delivers a translated packet by redirect after a FIB lookup, so that it does
/// not walk netfilter; falls back to the stack when the FIB has no answer.
fn deliver(ctx: &TcContext, pkt: &Packet, code: u32) -> Verdict {
    count(code);
    let pass = (TC_ACT_OK as i32, stat::PASS_FIB_MISS);
    // SAFETY: zeroed plain-old-data struct.
    let mut p: FibParams = unsafe { core::mem::zeroed() };
    p.family = AF_INET;
    p.l4_protocol = pkt.proto;
    p.sport = pkt.sport_be;
    p.dport = pkt.dport_be;
    p.__bindgen_anon_1.tot_len = pkt.tot_len;
    // SAFETY: the context pointer is valid for this program run.
    p.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    p.__bindgen_anon_3.ipv4_src = pkt.saddr_be;
    p.__bindgen_anon_4.ipv4_dst = pkt.daddr_be;
    // SAFETY: params points to a stack struct of the size given.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb as *mut _,
            &mut p,
            size_of::<FibParams>() as i32,
            0,
        )
    } as u32;
    if rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        return pass;
    }
    // Forwarding decrements the TTL, as the stack would have.
    let Ok(ttl_proto) = ctx.load::<[u8; 2]>(IP_TTL_OFF) else {
        return pass;
    };
    if ttl_proto[0] <= 1 {
        return (TC_ACT_OK as i32, stat::PASS_TTL);
    }
    let new = [ttl_proto[0] - 1, ttl_proto[1]];
    let old_w = u16::from_ne_bytes(ttl_proto) as u64;
    let new_w = u16::from_ne_bytes(new) as u64;
    if ctx.l3_csum_replace(IP_CSUM_OFF, old_w, new_w, 2).is_err()
        || ctx.store(IP_TTL_OFF, &new, 0).is_err()
    {
        return (TC_ACT_SHOT as i32, stat::DROP_REWRITE_FAILED);
    }
    if rc == BPF_FIB_LKUP_RET_NO_NEIGH {
        let mut nh = bpf_redir_neigh {
            nh_family: AF_INET as u32,
            __bindgen_anon_1: unsafe { core::mem::zeroed() },
        };
        // SAFETY: writing a plain field of a stack union.
        unsafe { nh.__bindgen_anon_1.ipv4_nh = p.__bindgen_anon_4.ipv4_dst };
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
        return (TC_ACT_SHOT as i32, stat::DROP_REWRITE_FAILED);
    }
    let pod = match IFACE_V1.get_ptr(p.ifindex) {
        // SAFETY: map value pointer, read once.
        Some(i) => (unsafe { (*i).flags } & iface_flags::POD) != 0,
        None => false,
    };
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

/// Sum of 16-bit words in memory order, folded and inverted (RFC 1071).
#[inline(always)]
fn csum_fold(buf: &[u8], len: usize) -> u16 {
    let mut sum: u32 = 0;
    let mut i = 0;
    while i + 1 < len && i + 1 < buf.len() {
        sum += u16::from_ne_bytes([buf[i], buf[i + 1]]) as u32;
        i += 2;
    }
    // At most 36 words: two folds bring any such sum below 2^16.
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

const REJECT_LEN: usize = ETH_HLEN + 20 + 8 + 28;

/// Turns the packet into an ICMP port unreachable from the frontend back to
/// the client, as kube-proxy's REJECT rule does, and sends it back out of the
/// interface it came from.
fn reject(ctx: &TcContext, ip: &Ipv4Hdr) -> Result<Verdict, u32> {
    let e = stat::DROP_REJECT_FAILED;
    if ip.ver_ihl != 0x45 {
        // With IP options the quoted header would be longer; not generated.
        return Err(e);
    }
    let mut buf = [0u8; REJECT_LEN];
    // Original IP header and the first 8 bytes of its payload, quoted.
    let quoted = ctx.load::<[u8; 28]>(ETH_HLEN).map_err(|_| e)?;
    buf[ETH_HLEN + 28..].copy_from_slice(&quoted);
    let eth = ctx.load::<[u8; 12]>(0).map_err(|_| e)?;
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
    let ipc = csum_fold(&buf[iph..iph + 20], 20);
    buf[iph + 10..iph + 12].copy_from_slice(&ipc.to_ne_bytes());
    let icmp = iph + 20;
    buf[icmp] = 3; // destination unreachable
    buf[icmp + 1] = 3; // port unreachable
    let icc = csum_fold(&buf[icmp..], 36);
    buf[icmp + 2..icmp + 4].copy_from_slice(&icc.to_ne_bytes());

    // SAFETY: the context pointer is valid for this program run.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, REJECT_LEN as u32, 0) } != 0 {
        return Err(e);
    }
    ctx.store(0, &buf, 0).map_err(|_| e)?;
    // SAFETY: the context pointer is valid for this program run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper taking an ifindex.
    let r = unsafe { bpf_redirect(ifindex, 0) };
    Ok((r as i32, stat::REJECT_NO_BACKEND))
}

// ---------------------------------------------------------------------------
// XDP acceleration of the external devices
// ---------------------------------------------------------------------------

/// XDP on the node's external devices (`--acceleration xdp`): translates, at
/// the driver, external traffic to backends on other nodes (DNAT + SNAT to the
/// node) and their replies, and sends them back out (XDP_TX) or to another
/// device (XDP_REDIRECT) after a FIB lookup. Everything else — flows to local
/// backends, packets without a usable FIB answer, no backend (reject), IP
/// options, fragments, other protocols — is passed on to `ext_ingress` (tc)
/// untouched or, once translated, to the stack.
#[xdp]
pub fn ext_xdp(ctx: XdpContext) -> u32 {
    match try_ext_xdp(&ctx) {
        Ok((action, code)) => {
            if action != xdp_action::XDP_PASS || code != stat::XDP_DEFERRED {
                count(code);
            }
            action
        }
        Err(code) => {
            count(code);
            xdp_action::XDP_DROP
        }
    }
}

/// A translated 4-tuple (network byte order).
struct Tuple {
    saddr_be: u32,
    daddr_be: u32,
    sport_be: u16,
    dport_be: u16,
}

/// A pointer to a `T` at `off` in the XDP frame, bounds-checked.
#[inline(always)]
fn xdp_ptr<T>(ctx: &XdpContext, off: usize) -> Option<*mut T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + size_of::<T>() > end {
        return None;
    }
    Some((start + off) as *mut T)
}

/// RFC 1624 incremental update of a checksum for 16-bit words `old` → `new`
/// (words as they are in memory).
#[inline(always)]
fn csum_update(check: u16, old: &[u16; 6], new: &[u16; 6]) -> u16 {
    let mut sum: u32 = (!check) as u32;
    let mut i = 0;
    while i < 6 {
        sum += (!old[i]) as u32;
        sum += new[i] as u32;
        i += 1;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

#[inline(always)]
fn words(addr_be: u32) -> [u16; 2] {
    let b = addr_be.to_ne_bytes();
    [
        u16::from_ne_bytes([b[0], b[1]]),
        u16::from_ne_bytes([b[2], b[3]]),
    ]
}

/// Rewrites the 4-tuple of an IPv4 TCP/UDP frame in place (no IP options),
/// updating the IPv4 and L4 checksums incrementally.
fn xdp_rewrite(ctx: &XdpContext, pkt: &mut Packet, to: &Tuple) -> Result<(), u32> {
    let (saddr, sport, daddr, dport) = (to.saddr_be, to.sport_be, to.daddr_be, to.dport_be);
    let e = stat::DROP_REWRITE_FAILED;
    let ip = xdp_ptr::<Ipv4Hdr>(ctx, ETH_HLEN).ok_or(e)?;
    let (os, od) = (words(pkt.saddr_be), words(pkt.daddr_be));
    let (ns, nd) = (words(saddr), words(daddr));
    let old = [os[0], os[1], od[0], od[1], pkt.sport_be, pkt.dport_be];
    let new = [ns[0], ns[1], nd[0], nd[1], sport, dport];
    let old_ip = [os[0], os[1], od[0], od[1], 0, 0];
    let new_ip = [ns[0], ns[1], nd[0], nd[1], 0, 0];
    let l4 = ETH_HLEN + 20;
    if pkt.proto == IPPROTO_TCP {
        let c = xdp_ptr::<u16>(ctx, l4 + 16).ok_or(e)?;
        // SAFETY: bounds-checked frame pointers.
        unsafe { *c = csum_update(*c, &old, &new) };
    } else {
        let c = xdp_ptr::<u16>(ctx, l4 + 6).ok_or(e)?;
        // SAFETY: bounds-checked frame pointers.
        unsafe {
            if *c != 0 {
                let v = csum_update(*c, &old, &new);
                *c = if v == 0 { 0xffff } else { v };
            }
        }
    }
    let ports = xdp_ptr::<[u16; 2]>(ctx, l4).ok_or(e)?;
    // SAFETY: bounds-checked frame pointers.
    unsafe {
        (*ip).check = csum_update((*ip).check, &old_ip, &new_ip);
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

fn try_ext_xdp(ctx: &XdpContext) -> Result<(u32, u32), u32> {
    let defer = Ok((xdp_action::XDP_PASS, stat::XDP_DEFERRED));
    let Some(eth_proto) = xdp_ptr::<u16>(ctx, 12) else {
        return defer;
    };
    // SAFETY: bounds-checked frame pointer.
    if u16::from_be(unsafe { *eth_proto }) != ETH_P_IP {
        return defer;
    }
    let Some(ip) = xdp_ptr::<Ipv4Hdr>(ctx, ETH_HLEN) else {
        return defer;
    };
    // SAFETY: bounds-checked frame pointer, copied.
    let ip = unsafe { *ip };
    let frag = u16::from_be(ip.frag_off_be) & 0x3fff != 0;
    if ip.ver_ihl != 0x45 || frag || (ip.proto != IPPROTO_TCP && ip.proto != IPPROTO_UDP) {
        return defer;
    }
    let l4 = ETH_HLEN + 20;
    let l4_len = if ip.proto == IPPROTO_TCP { 20 } else { 8 };
    if ctx.data() + l4 + l4_len > ctx.data_end() {
        return defer;
    }
    let ports = xdp_ptr::<[u16; 2]>(ctx, l4).ok_or(stat::DROP_MALFORMED)?;
    // SAFETY: bounds-checked frame pointer, copied.
    let ports = unsafe { *ports };
    let mut pkt = Packet {
        l4_off: l4,
        csum_off: 0,
        proto: ip.proto,
        saddr_be: ip.saddr_be,
        daddr_be: ip.daddr_be,
        sport_be: ports[0],
        dport_be: ports[1],
        tot_len: u16::from_be(ip.tot_len_be),
        tcp_flags: 0,
        l4_present: true,
    };
    if pkt.proto == IPPROTO_TCP {
        let f = xdp_ptr::<u8>(ctx, l4 + 13).ok_or(stat::DROP_MALFORMED)?;
        // SAFETY: bounds-checked frame pointer.
        pkt.tcp_flags = unsafe { *f };
    }
    let len = (ctx.data_end() - ctx.data()) as u64;
    let fe_key = Svc4Key {
        addr_be: pkt.daddr_be,
        port_be: pkt.dport_be,
        slot: 0,
        proto: pkt.proto,
        scope: SCOPE_EXTERNAL,
        _pad: [0; 2],
    };
    let code: (Tuple, u32) = if let Some(fe) = SVC4_V1.get_ptr(fe_key) {
        // SAFETY: map value pointer, copied.
        let fe = unsafe { *fe };
        let mut flow = Flow::default();
        let out = decide(&pkt, &fe, SCOPE_EXTERNAL | FROM_XDP, &mut flow);
        match out.kind {
            OUT_TRANSLATE => {}
            // Reject, pass, defer: tc does the rest.
            OUT_VERDICT => return defer,
            _ if out.code == stat::REJECT_NO_BACKEND => return defer,
            _ => return Err(out.code),
        }
        let established = out.established != 0;
        account(len, fe.rev_nat_id, flow.backend_id);
        let (saddr, sport) = (
            if flow.flags & ct_flags::SNAT_ADDR != 0 {
                flow.nat_addr_be
            } else {
                pkt.saddr_be
            },
            if flow.flags & ct_flags::SNAT_PORT != 0 {
                flow.nat_port_be
            } else {
                pkt.sport_be
            },
        );
        let to = Tuple {
            saddr_be: saddr,
            sport_be: sport,
            daddr_be: flow.backend.addr_be,
            dport_be: flow.backend.port_be,
        };
        let code = if established {
            stat::FWD_ESTABLISHED
        } else {
            stat::FWD_NEW
        };
        (to, code)
    } else {
        let rkey = pkt.ct_key(ct_dir::REPLY);
        let Some(ct) = CT4_V1.get_ptr(rkey) else {
            return defer;
        };
        // SAFETY: map value pointer, copied.
        let ct = unsafe { *ct };
        let Some(rev) = REVNAT4_V1.get_ptr(ct.rev_nat_id) else {
            return defer;
        };
        // SAFETY: map value pointer, copied.
        let rev = unsafe { *rev };
        account(len, ct.rev_nat_id, ct.backend_id);
        let daddr = if ct.flags & ct_flags::SNAT_ADDR != 0 {
            ct.nat_addr_be
        } else {
            pkt.daddr_be
        };
        let dport = if ct.flags & ct_flags::SNAT_PORT != 0 {
            ct.nat_port_be
        } else {
            pkt.dport_be
        };
        let to = Tuple {
            saddr_be: rev.addr_be,
            sport_be: rev.port_be,
            daddr_be: daddr,
            dport_be: dport,
        };
        (to, stat::FWD_REPLY)
    };
    let (to, code) = code;
    // Where the translated packet goes, asked before translating: what XDP
    // cannot send itself (no neighbour entry yet, a pod, no route) goes to tc
    // untouched, which finds the conntrack entries just written and finishes
    // the job (a translated packet handed to the stack could carry this
    // node's own address as its source: a martian).
    let Some(fib) = xdp_fib(ctx, &pkt, &to) else {
        return defer;
    };
    xdp_rewrite(ctx, &mut pkt, &to)?;
    count(code);
    Ok(xdp_send(ctx, &fib))
}

/// The FIB's answer for the translated tuple `to`: the output device and
/// MACs, when XDP can send there itself (a complete answer, not a pod).
fn xdp_fib(ctx: &XdpContext, pkt: &Packet, to: &Tuple) -> Option<FibParams> {
    // SAFETY: zeroed plain-old-data struct.
    let mut p: FibParams = unsafe { core::mem::zeroed() };
    p.family = AF_INET;
    p.l4_protocol = pkt.proto;
    p.sport = to.sport_be;
    p.dport = to.dport_be;
    p.__bindgen_anon_1.tot_len = pkt.tot_len;
    p.ifindex = ctx.ingress_ifindex() as u32;
    p.__bindgen_anon_3.ipv4_src = to.saddr_be;
    p.__bindgen_anon_4.ipv4_dst = to.daddr_be;
    // SAFETY: params points to a stack struct of the size given.
    let rc = unsafe { bpf_fib_lookup(ctx.ctx as *mut _, &mut p, size_of::<FibParams>() as i32, 0) }
        as u32;
    if rc != BPF_FIB_LKUP_RET_SUCCESS || IFACE_V1.get_ptr(p.ifindex).is_some() {
        return None;
    }
    Some(p)
}

/// TTL, MACs, then XDP_TX (same device) or XDP_REDIRECT.
fn xdp_send(ctx: &XdpContext, p: &FibParams) -> (u32, u32) {
    let (Some(ip), Some(eth)) = (
        xdp_ptr::<Ipv4Hdr>(ctx, ETH_HLEN),
        xdp_ptr::<[u8; 12]>(ctx, 0),
    ) else {
        return (xdp_action::XDP_DROP, stat::DROP_REWRITE_FAILED);
    };
    // SAFETY: bounds-checked frame pointers.
    unsafe {
        if (*ip).ttl <= 1 {
            // Translated already; the stack answers with time exceeded.
            return (xdp_action::XDP_PASS, stat::PASS_TTL);
        }
        let old = [u16::from_ne_bytes([(*ip).ttl, (*ip).proto]), 0, 0, 0, 0, 0];
        (*ip).ttl -= 1;
        let new = [u16::from_ne_bytes([(*ip).ttl, (*ip).proto]), 0, 0, 0, 0, 0];
        (*ip).check = csum_update((*ip).check, &old, &new);
        let mut macs = [0u8; 12];
        macs[..6].copy_from_slice(&p.dmac);
        macs[6..].copy_from_slice(&p.smac);
        *eth = macs;
    }
    if p.ifindex == ctx.ingress_ifindex() as u32 {
        return (xdp_action::XDP_TX, stat::XDP_TX);
    }
    // SAFETY: plain helper taking an ifindex.
    let r = unsafe { bpf_redirect(p.ifindex, 0) } as u32;
    (r, stat::XDP_REDIRECT)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

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
        bpf_fib_lookup as FibParams, bpf_redir_neigh, BPF_ANY, BPF_FIB_LKUP_RET_NO_NEIGH,
        BPF_FIB_LKUP_RET_SUCCESS, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST, TC_ACT_OK,
        TC_ACT_SHOT,
    },
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray},
    helpers::{
        bpf_fib_lookup, bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_redirect, bpf_redirect_neigh,
        bpf_redirect_peer, bpf_skb_change_tail,
    },
    macros::{btf_map, classifier},
    programs::TcContext,
};
use proxy_common::{
    capacity, ct_dir, ct_flags, iface_flags, stat, svc_flags, Backend4, Config, Ct4Key, Ct4Value,
    Iface, RevNat4, Svc4Key, Svc4Value, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP,
    MAP_LAYOUT_VERSION, SCOPE_INTERNAL,
};

#[btf_map]
static SVC4_V1: HashMap<Svc4Key, Svc4Value, { capacity::SERVICES as usize }> = HashMap::new();
#[btf_map]
static BACKEND4_V1: HashMap<u32, Backend4, { capacity::BACKENDS as usize }> = HashMap::new();
#[btf_map]
static REVNAT4_V1: HashMap<u16, RevNat4, { capacity::REV_NAT as usize }> = HashMap::new();
#[btf_map]
static CT4_V1: LruHashMap<Ct4Key, Ct4Value, { capacity::CONNTRACK as usize }> =
    LruHashMap::new();
#[btf_map]
static STATS_V1: PerCpuArray<u64, { capacity::STATS as usize }> = PerCpuArray::new();
#[btf_map]
static CONFIG_V1: Array<Config, 1> = Array::new();
#[btf_map]
static IFACE_V1: HashMap<u32, Iface, { capacity::IFACES as usize }> = HashMap::new();

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const AF_INET: u8 = 2;
const IP_CSUM_OFF: usize = ETH_HLEN + 10;
const IP_TTL_OFF: usize = ETH_HLEN + 8;
const IP_SRC_OFF: usize = ETH_HLEN + 12;
const IP_DST_OFF: usize = ETH_HLEN + 16;
const NSEC_PER_SEC: u64 = 1_000_000_000;

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
}

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

#[inline(always)]
fn count(code: u32) {
    if let Some(p) = STATS_V1.get_ptr_mut(code) {
        // SAFETY: per-CPU slot of this CPU; no other writer while we run.
        unsafe { *p += 1 };
    }
}

/// A verdict and the counter it is recorded under.
type Verdict = (i32, u32);

#[classifier]
pub fn pod_ingress(ctx: TcContext) -> i32 {
    let (action, code) = match try_pod_ingress(&ctx) {
        Ok(v) => v,
        Err(code) => (TC_ACT_SHOT as i32, code),
    };
    count(code);
    action
}

fn try_pod_ingress(ctx: &TcContext) -> Result<Verdict, u32> {
    let pass = TC_ACT_OK as i32;
    let Ok(h_proto) = ctx.load::<u16>(12) else {
        return Ok((pass, stat::PASS_NOT_IPV4));
    };
    if u16::from_be(h_proto) != ETH_P_IP {
        return Ok((pass, stat::PASS_NOT_IPV4));
    }
    let Ok(ip) = ctx.load::<Ipv4Hdr>(ETH_HLEN) else {
        return Ok((pass, stat::PASS_MALFORMED));
    };
    let ihl = (ip.ver_ihl & 0x0f) as usize * 4;
    if ip.ver_ihl >> 4 != 4 || ihl < 20 {
        return Ok((pass, stat::PASS_MALFORMED));
    }
    if ip.proto != IPPROTO_TCP && ip.proto != IPPROTO_UDP {
        return Ok((pass, stat::PASS_OTHER_PROTO));
    }
    if u16::from_be(ip.frag_off_be) & 0x3fff != 0 {
        return Ok((pass, stat::PASS_FRAGMENT));
    }
    let l4_off = ETH_HLEN + ihl;
    let Ok(ports) = ctx.load::<[u16; 2]>(l4_off) else {
        return Ok((pass, stat::PASS_MALFORMED));
    };
    let (csum_off, l4_min) = if ip.proto == IPPROTO_TCP { (16, 20) } else { (6, 8) };
    let mut pkt = Packet {
        l4_off,
        csum_off: l4_off + csum_off,
        proto: ip.proto,
        saddr_be: ip.saddr_be,
        daddr_be: ip.daddr_be,
        sport_be: ports[0],
        dport_be: ports[1],
        tot_len: u16::from_be(ip.tot_len_be),
        tcp_flags: 0,
    };

    let fe_key = Svc4Key {
        addr_be: pkt.daddr_be,
        port_be: pkt.dport_be,
        slot: 0,
        proto: pkt.proto,
        scope: SCOPE_INTERNAL,
        _pad: [0; 2],
    };
    let frontend = SVC4_V1.get_ptr(fe_key);
    let l4_complete = (ctx.len() as usize) >= l4_off + l4_min;
    if frontend.is_none() {
        // Not for a frontend: perhaps a reply of a tracked flow.
        let rkey = Ct4Key {
            saddr_be: pkt.saddr_be,
            daddr_be: pkt.daddr_be,
            sport_be: pkt.sport_be,
            dport_be: pkt.dport_be,
            proto: pkt.proto,
            dir: ct_dir::REPLY,
            _pad: [0; 2],
        };
        let Some(ct) = CT4_V1.get_ptr(rkey) else {
            return Ok((pass, stat::PASS_NO_SERVICE));
        };
        if !l4_complete {
            return Ok((pass, stat::PASS_MALFORMED));
        }
        // SAFETY: a map value pointer, read once into a copy.
        let ct = unsafe { *ct };
        let Some(rev) = REVNAT4_V1.get_ptr(ct.rev_nat_id) else {
            // The frontend is gone: nothing to translate back to.
            return Ok((pass, stat::PASS_NO_SERVICE));
        };
        // SAFETY: as above.
        let rev = unsafe { *rev };
        rewrite_src(ctx, &mut pkt, rev.addr_be, rev.port_be)?;
        if ct.flags & ct_flags::HAIRPIN != 0 {
            rewrite_daddr(ctx, &mut pkt, ct.nat_addr_be)?;
        }
        return Ok(deliver(ctx, &pkt, stat::FWD_REPLY));
    }
    if !l4_complete {
        return Err(stat::DROP_MALFORMED);
    }
    let Some(cfg) = CONFIG_V1.get(0) else {
        return Ok((pass, stat::PASS_UNCONFIGURED));
    };
    if cfg.layout_version != MAP_LAYOUT_VERSION {
        return Ok((pass, stat::PASS_UNCONFIGURED));
    }
    if pkt.proto == IPPROTO_TCP {
        // Byte 13 of the TCP header holds the flags.
        pkt.tcp_flags = ctx.load::<u8>(l4_off + 13).map_err(|_| stat::DROP_MALFORMED)?;
    }
    // SAFETY: a map value pointer, read once into a copy.
    let fe = unsafe { *frontend.unwrap_unchecked() };
    service(ctx, &mut pkt, &fe_key, &fe, cfg, &ip)
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

fn service(
    ctx: &TcContext,
    pkt: &mut Packet,
    fe_key: &Svc4Key,
    fe: &Svc4Value,
    cfg: &Config,
    ip: &Ipv4Hdr,
) -> Result<Verdict, u32> {
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let skey = Ct4Key {
        saddr_be: pkt.saddr_be,
        daddr_be: pkt.daddr_be,
        sport_be: pkt.sport_be,
        dport_be: pkt.dport_be,
        proto: pkt.proto,
        dir: ct_dir::SERVICE,
        _pad: [0; 2],
    };

    // 1. Conntrack first: a tracked flow keeps its backend while it exists.
    let mut chosen: Option<(u32, Backend4, u16)> = None;
    if let Some(ct) = CT4_V1.get_ptr_mut(skey) {
        // SAFETY: LRU value pointer; fields are read and written individually.
        let c = unsafe { &mut *ct };
        let alive = now.saturating_sub(c.last_seen_ns) <= ct_timeout_ns(cfg, pkt.proto, c.flags);
        if alive {
            if let Some(b) = BACKEND4_V1.get_ptr(c.backend_id) {
                let flags = if pkt.proto == IPPROTO_TCP { tcp_state(c.flags, pkt.tcp_flags) } else { c.flags };
                if flags != c.flags || now.saturating_sub(c.last_seen_ns) > NSEC_PER_SEC {
                    c.flags = flags;
                    c.last_seen_ns = now;
                }
                // SAFETY: map value pointer, copied.
                chosen = Some((c.backend_id, unsafe { *b }, c.flags));
            }
        }
    }
    let established = chosen.is_some();

    // 2. No tracked flow: pick a backend (or reject / drop when there is none).
    let (backend_id, backend, state) = match chosen {
        Some(c) => c,
        None => {
            if fe.count == 0 {
                if fe.flags & svc_flags::DROP_NO_BACKEND != 0 {
                    return Err(stat::DROP_NO_LOCAL_BACKEND);
                }
                return reject(ctx, ip);
            }
            // SAFETY: helper without arguments.
            let r = unsafe { bpf_get_prandom_u32() };
            let slot = (r % fe.count as u32) as u16 + 1;
            let Some(s) = SVC4_V1.get_ptr(fe_key.with_slot(slot)) else {
                return Err(stat::DROP_NO_BACKEND_ENTRY);
            };
            // SAFETY: map value pointer, copied.
            let id = unsafe { (*s).backend_id };
            let Some(b) = BACKEND4_V1.get_ptr(id) else {
                return Err(stat::DROP_NO_BACKEND_ENTRY);
            };
            let state = if pkt.proto == IPPROTO_TCP { tcp_state(0, pkt.tcp_flags) } else { 0 };
            // SAFETY: map value pointer, copied.
            (id, unsafe { *b }, state)
        }
    };

    let (backend_id, backend) = if established {
        (backend_id, backend)
    } else {
        let hairpin = backend.addr_be == pkt.saddr_be && cfg.hairpin_addr_be != 0;
        let sval = Ct4Value {
            backend_id,
            nat_addr_be: if hairpin { cfg.hairpin_addr_be } else { 0 },
            rev_nat_id: fe.rev_nat_id,
            flags: if hairpin { ct_flags::HAIRPIN } else { 0 } | state,
            _pad: 0,
            last_seen_ns: now,
        };
        // A racing first packet of the same flow on another CPU may have won:
        // follow its choice rather than split the flow (field bug K8).
        let mut winner = (backend_id, backend);
        if CT4_V1.insert(skey, sval, BPF_NOEXIST as u64).is_err() {
            let mut follow = false;
            if let Some(w) = CT4_V1.get_ptr(skey) {
                // SAFETY: map value pointer, copied.
                let w = unsafe { *w };
                let alive =
                    now.saturating_sub(w.last_seen_ns) <= ct_timeout_ns(cfg, pkt.proto, w.flags);
                if alive {
                    if let Some(b) = BACKEND4_V1.get_ptr(w.backend_id) {
                        // SAFETY: map value pointer, copied.
                        winner = (w.backend_id, unsafe { *b });
                        follow = true;
                    }
                }
            }
            if !follow && CT4_V1.insert(skey, sval, BPF_ANY as u64).is_err() {
                count(stat::CT_INSERT_FAILED);
            }
        }
        winner
    };

    let hairpin = backend.addr_be == pkt.saddr_be && cfg.hairpin_addr_be != 0;
    let client_be = pkt.saddr_be;
    let rkey = Ct4Key {
        saddr_be: backend.addr_be,
        daddr_be: if hairpin { cfg.hairpin_addr_be } else { client_be },
        sport_be: backend.port_be,
        dport_be: pkt.sport_be,
        proto: pkt.proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    };
    // New flows get their reply entry; tracked flows get it back if the LRU
    // evicted it, so replies of a live flow are always translated.
    if !established || CT4_V1.get_ptr(rkey).is_none() {
        let rval = Ct4Value {
            backend_id,
            nat_addr_be: if hairpin { client_be } else { 0 },
            rev_nat_id: fe.rev_nat_id,
            flags: if hairpin { ct_flags::HAIRPIN } else { 0 },
            _pad: 0,
            last_seen_ns: now,
        };
        if CT4_V1.insert(rkey, rval, BPF_ANY as u64).is_err() {
            count(stat::CT_INSERT_FAILED);
        }
    }

    rewrite_daddr(ctx, pkt, backend.addr_be)?;
    rewrite_dport(ctx, pkt, backend.port_be)?;
    if hairpin {
        rewrite_saddr(ctx, pkt, cfg.hairpin_addr_be)?;
        count(stat::HAIRPIN);
    }
    let code = if established { stat::FWD_ESTABLISHED } else { stat::FWD_NEW };
    Ok(deliver(ctx, pkt, code))
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
    ctx.l4_csum_replace(pkt.csum_off, old as u64, new as u64, BPF_F_PSEUDO_HDR as u64 | 4 | l4_flags(pkt))
        .map_err(|_| e)?;
    ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4).map_err(|_| e)?;
    ctx.store(off, &new, 0).map_err(|_| e)
}

fn rewrite_port(ctx: &TcContext, pkt: &Packet, off: usize, old: u16, new: u16) -> Result<(), u32> {
    if old == new {
        return Ok(());
    }
    let e = stat::DROP_REWRITE_FAILED;
    ctx.l4_csum_replace(pkt.csum_off, old as u64, new as u64, 2 | l4_flags(pkt)).map_err(|_| e)?;
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

fn rewrite_src(ctx: &TcContext, pkt: &mut Packet, addr_be: u32, port_be: u16) -> Result<(), u32> {
    rewrite_saddr(ctx, pkt, addr_be)?;
    rewrite_port(ctx, pkt, pkt.l4_off, pkt.sport_be, port_be)?;
    pkt.sport_be = port_be;
    Ok(())
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
        bpf_fib_lookup(ctx.skb.skb as *mut _, &mut p, size_of::<FibParams>() as i32, 0)
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
    if ctx.l3_csum_replace(IP_CSUM_OFF, old_w, new_w, 2).is_err() || ctx.store(IP_TTL_OFF, &new, 0).is_err() {
        return (TC_ACT_SHOT as i32, stat::DROP_REWRITE_FAILED);
    }
    if rc == BPF_FIB_LKUP_RET_NO_NEIGH {
        let mut nh = bpf_redir_neigh { nh_family: AF_INET as u32, __bindgen_anon_1: unsafe { core::mem::zeroed() } };
        // SAFETY: writing a plain field of a stack union.
        unsafe { nh.__bindgen_anon_1.ipv4_nh = p.__bindgen_anon_4.ipv4_dst };
        // SAFETY: nh is a stack struct of the size given.
        let r = unsafe { bpf_redirect_neigh(p.ifindex, &mut nh, size_of::<bpf_redir_neigh>() as i32, 0) };
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

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

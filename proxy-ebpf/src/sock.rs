//! Socket-level load balancing for the node's own clients (host processes,
//! hostNetwork pods): cgroup v2 hooks that aim a socket at a backend when it
//! is connected or sent from, instead of translating its packets.
//!
//! - `connect4` (TCP and UDP `connect()`) and `sendmsg4` (unconnected UDP
//!   `sendmsg()`): a destination that is an internal-scope frontend
//!   (ClusterIP; externalIPs, load-balancer IPs and this node's
//!   `nodeIP:nodePort`, short-circuited to the cluster list as kube-proxy
//!   does for traffic that starts on the node) is replaced by a backend
//!   chosen as on the pod path ([`lb::select`]: session affinity, else a
//!   random slot). The socket and the backend are written to the
//!   socket-level reverse-NAT map.
//! - `recvmsg4` (UDP `recvmsg()` source) and `getpeername4`: a backend
//!   address recorded for this socket is shown as its frontend, so the
//!   application sees the address it asked for, as with kube-proxy's NAT.
//!
//! No endpoint at all: the call fails with ECONNREFUSED at once (kube-proxy's
//! reject); endpoints only elsewhere under a `Local` policy: EHOSTUNREACH at
//! once (kube-proxy drops, so its clients wait for a timeout). Kernels
//! without `bpf_set_retval` (before 5.18) fail such calls with EPERM.
//!
//! Only sockets of the agent's own network namespace are touched (its netns
//! cookie, set at load): pods keep the tc path, which sees every packet.
//! Host clients have no client address at `connect()` (the kernel picks it
//! when routing); they share one affinity identity per node, address 0.
//!
//! UDP to a ClusterIP is not aimed here when the agent has its host-client
//! device (`HOST_UDP_PER_PACKET`): the socket keeps the ClusterIP, and its
//! datagrams are translated one by one by the pod program on that device,
//! so a backend change moves the next datagram of a connected socket, as
//! with kube-proxy. UDP to a NodePort (localhost's included), externalIP
//! or load-balancer IP is aimed at its Service's ClusterIP, when the agent
//! named it as the frontend's host alias (the ClusterIP chooses among the
//! same backends), and so translated per packet too; the reverse hooks
//! show the frontend the socket asked for. Other connected UDP sockets
//! (`deliveryMode: stack`, no device, no alias) keep the backend they were
//! aimed at; the agent destroys those whose backend is removed (socket
//! diag `SOCK_DESTROY`), so the application sees an error and reconnects
//! instead of sending into a void.

// Map keys and values are passed by reference (`get_ptr(&key)`): by value,
// each call's copy of a 40-byte IPv6 key takes stack the verifier counts
// against its 512 bytes for the whole chain of calls.
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::{
    bindings::{bpf_sock_addr, BPF_ANY},
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns, bpf_set_retval},
    programs::SockAddrContext,
    EbpfContext,
};
use proxy_common::{
    stat, svc_flags, Addr6, RevNatId, SockRevNat4Key, SockRevNat4Value, SockRevNat6Key,
    SockRevNat6Value, Svc4Key, Svc6Key, SvcValue, IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL,
};

use crate::{
    family::{Family, FiveTuple, V4, V6},
    lb,
    maps::{account, count, CONFIG_V3, SOCK_REVNAT4_V2, SOCK_REVNAT6_V2, SVC4_V2, SVC6_V2},
    verdict::Verdict,
};

/// The network namespace whose sockets are load-balanced (its cookie); 0:
/// every namespace (kernels without `SO_NETNS_COOKIE`). Set by the agent at
/// load time; read-only to the verifier.
#[unsafe(no_mangle)]
static HOST_NETNS_COOKIE: u64 = 0;

/// 1 when host clients' UDP to a ClusterIP is translated per packet on the
/// host-client device ([`proxy_common::HOST_DEV_NAME`], routed there by the
/// agent) rather than aimed here: set by the agent at load time once the
/// device is in place; read-only to the verifier.
#[unsafe(no_mangle)]
static HOST_UDP_PER_PACKET: u32 = 0;

/// 1 when the kernel has `bpf_set_retval` for cgroup hooks (5.18). A
/// constant to the verifier, which then never sees the helper call on
/// kernels without it.
#[unsafe(no_mangle)]
static HAS_SET_RETVAL: u32 = 0;

const SOCK_STREAM: u32 = 1;
const SOCK_DGRAM: u32 = 2;
const ECONNREFUSED: i32 = 111;
const EHOSTUNREACH: i32 = 113;
const EPERM: i32 = 1;

/// Return value of a cgroup hook: let the call proceed / fail it.
const PROCEED: i32 = 1;
const REJECT: i32 = 0;

#[inline(always)]
fn sock_addr(ctx: &SockAddrContext) -> *mut bpf_sock_addr {
    ctx.sock_addr
}

/// Whether this socket belongs to the namespace the agent serves.
#[inline(always)]
fn served(ctx: &SockAddrContext) -> bool {
    // SAFETY: a read-only global of this object.
    let want = unsafe { core::ptr::read_volatile(&HOST_NETNS_COOKIE) };
    // SAFETY: helper on this program's context.
    want == 0 || unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } == want
}

/// Whether host UDP to ClusterIPs is left to the per-packet path
/// ([`HOST_UDP_PER_PACKET`]), and the datapath delivers by redirect. Under
/// `deliveryMode: stack` (a NetworkPolicy engine in the host's netfilter)
/// a socket is aimed at its backend here instead, so that its packets leave
/// through the host's OUTPUT path towards the backend, where the engine's
/// rules see them: the per-packet path would hand them to a pod by
/// redirect, past those rules.
#[inline(always)]
fn per_packet_udp() -> bool {
    // SAFETY: a read-only global of this object.
    let on = unsafe { core::ptr::read_volatile(&HOST_UDP_PER_PACKET) } != 0;
    on && CONFIG_V3
        .get(0)
        .is_some_and(|c| c.flags & proxy_common::config_flags::DELIVER_VIA_STACK == 0)
}

/// Whether the datapath is draining (`config_flags::DRAINING`): new
/// connections are left to the proxy taking the node back.
#[inline(always)]
fn draining() -> bool {
    CONFIG_V3
        .get(0)
        .is_some_and(|c| c.flags & proxy_common::config_flags::DRAINING != 0)
}

/// The protocol of a stream or datagram socket we translate, if it is one.
#[inline(always)]
fn protocol(sa: *mut bpf_sock_addr) -> Option<u8> {
    // SAFETY: context fields readable by every sock_addr hook.
    let (ty, proto) = unsafe { ((*sa).type_, (*sa).protocol) };
    match (ty, proto as u8) {
        (SOCK_STREAM, IPPROTO_TCP) => Some(IPPROTO_TCP),
        (SOCK_DGRAM, IPPROTO_UDP) => Some(IPPROTO_UDP),
        _ => None,
    }
}

/// Fails the call with `errno` where the kernel lets us choose it.
#[inline(always)]
fn fail(errno: i32) -> i32 {
    // SAFETY: a read-only global of this object.
    if unsafe { core::ptr::read_volatile(&HAS_SET_RETVAL) } != 0 {
        // SAFETY: helper of cgroup hooks; the verifier never sees it on
        // kernels without it (constant above).
        unsafe { bpf_set_retval(-errno) };
    }
    REJECT
}

/// What the socket hooks need of an address family: the frontend lookup,
/// the source-range check by the node's address, the backend choice, and
/// the socket-level reverse-NAT map. The hooks below are written once over
/// it; [`V4`] serves IPv4 sockets and the IPv4-mapped destinations of IPv6
/// ones, [`V6`] IPv6 frontends.
trait SockFamily: Family {
    /// The frontend at `addr`:`port_be` for a host client (internal scope,
    /// slot 0), if there is one.
    fn frontend(proto: u8, addr: &Self::Addr, port_be: u16) -> Option<SvcValue>;
    /// Whether the node's address of this family may open flows to the
    /// frontend `rev_nat_id` (its `loadBalancerSourceRanges`): a host
    /// client's packets leave from it (its own address is not bound yet
    /// at `connect()`), failing closed while it is unknown.
    fn node_allowed(rev_nat_id: RevNatId) -> bool;
    /// A backend for a new socket to the frontend `fe` at `addr`:`port_be`
    /// (as on the pod path: session affinity, else the frontend's
    /// algorithm), with `sport_be` standing in for the client's port:
    /// (backend id, its address, its port).
    fn select(
        proto: u8,
        addr: &Self::Addr,
        port_be: u16,
        fe: &SvcValue,
        sport_be: u16,
        now: u64,
    ) -> Result<(u32, Self::Addr, u16), Verdict>;
    /// Records that socket `cookie` was aimed at `backend`:`bport_be` from
    /// the frontend `addr`:`port_be`; false when the map refused it.
    fn remember(
        cookie: u64,
        backend: &Self::Addr,
        bport_be: u16,
        addr: &Self::Addr,
        port_be: u16,
        rev_nat_id: RevNatId,
    ) -> bool;
    /// The frontend socket `cookie` was aimed at `addr`:`port_be` from.
    fn recall(cookie: u64, addr: &Self::Addr, port_be: u16) -> Option<(Self::Addr, u16)>;
    /// The ClusterIP frontend (address, port) that a frontend with host
    /// alias `id` ([`SvcValue::host_alias`]) names: its reverse-NAT entry,
    /// if a ClusterIP frontend with backends is programmed there under
    /// that id (an alias left from a change the agent is still writing
    /// names nothing, and the socket is aimed at a backend).
    fn alias(proto: u8, id: RevNatId) -> Option<(Self::Addr, u16)>;
}

/// Whether `fe` is a ClusterIP frontend with backends, under reverse-NAT id
/// `id`: what a host alias may name.
#[inline(always)]
fn alias_target(fe: &SvcValue, id: RevNatId) -> bool {
    fe.flags & svc_flags::CLUSTER_IP != 0 && fe.rev_nat_id == id && fe.count != 0
}

/// The services-map key of a host client's frontend: internal scope, slot 0.
#[inline(always)]
fn frontend_key4(proto: u8, addr_be: u32, port_be: u16) -> Svc4Key {
    Svc4Key {
        addr_be,
        port_be,
        slot: 0,
        proto,
        scope: SCOPE_INTERNAL,
        _pad: [0; 2],
    }
}

/// [`frontend_key4`] for IPv6 frontends.
#[inline(always)]
fn frontend_key6(proto: u8, addr_be: &Addr6, port_be: u16) -> Svc6Key {
    Svc6Key {
        addr_be: *addr_be,
        port_be,
        slot: 0,
        proto,
        scope: SCOPE_INTERNAL,
        _pad: [0; 2],
    }
}

impl SockFamily for V4 {
    #[inline(always)]
    fn frontend(proto: u8, addr: &u32, port_be: u16) -> Option<SvcValue> {
        let key = frontend_key4(proto, *addr, port_be);
        // SAFETY: map value pointer, copied.
        SVC4_V2.get_ptr(key).map(|fe| unsafe { *fe })
    }

    #[inline(always)]
    fn node_allowed(rev_nat_id: RevNatId) -> bool {
        let node_be = CONFIG_V3.get(0).map_or(0, |c| c.node_addr_be);
        node_be != 0 && V4::source_allowed(rev_nat_id, &node_be)
    }

    #[inline(always)]
    fn select(
        proto: u8,
        addr: &u32,
        port_be: u16,
        fe: &SvcValue,
        sport_be: u16,
        now: u64,
    ) -> Result<(u32, u32, u16), Verdict> {
        let key = frontend_key4(proto, *addr, port_be);
        // The client: every host client shares one identity, address 0.
        let t = FiveTuple::<V4> {
            saddr: &0,
            daddr: addr,
            sport_be,
            dport_be: port_be,
            proto,
        };
        lb::select(&t, &key, fe, now).map(|(id, b)| (id, b.addr_be, b.port_be))
    }

    #[inline(always)]
    fn remember(
        cookie: u64,
        backend: &u32,
        bport_be: u16,
        addr: &u32,
        port_be: u16,
        rev_nat_id: RevNatId,
    ) -> bool {
        let rkey = SockRevNat4Key {
            cookie,
            addr_be: *backend,
            port_be: bport_be,
            _pad: 0,
        };
        let rval = SockRevNat4Value {
            addr_be: *addr,
            port_be,
            _pad: 0,
            rev_nat_id,
        };
        SOCK_REVNAT4_V2.insert(rkey, rval, BPF_ANY as u64).is_ok()
    }

    #[inline(always)]
    fn recall(cookie: u64, addr: &u32, port_be: u16) -> Option<(u32, u16)> {
        let key = SockRevNat4Key {
            cookie,
            addr_be: *addr,
            port_be,
            _pad: 0,
        };
        // SAFETY: LRU value pointer, copied.
        SOCK_REVNAT4_V2
            .get_ptr(&key)
            .map(|v| unsafe { ((*v).addr_be, (*v).port_be) })
    }

    #[inline(always)]
    fn alias(proto: u8, id: RevNatId) -> Option<(u32, u16)> {
        let r = lb::rev_nat(id)?;
        Self::frontend(proto, &r.addr_be, r.port_be)
            .is_some_and(|fe| alias_target(&fe, id))
            .then_some((r.addr_be, r.port_be))
    }
}

impl SockFamily for V6 {
    #[inline(always)]
    fn frontend(proto: u8, addr: &Addr6, port_be: u16) -> Option<SvcValue> {
        let key = frontend_key6(proto, addr, port_be);
        // SAFETY: map value pointer, copied.
        SVC6_V2.get_ptr(&key).map(|fe| unsafe { *fe })
    }

    #[inline(always)]
    fn node_allowed(rev_nat_id: RevNatId) -> bool {
        let node = CONFIG_V3.get(0).map_or([0; 4], |c| c.node6_be);
        node != [0; 4] && V6::source_allowed(rev_nat_id, &node)
    }

    #[inline(always)]
    fn select(
        proto: u8,
        addr: &Addr6,
        port_be: u16,
        fe: &SvcValue,
        sport_be: u16,
        now: u64,
    ) -> Result<(u32, Addr6, u16), Verdict> {
        let key = frontend_key6(proto, addr, port_be);
        let t = FiveTuple::<V6> {
            saddr: &[0; 4],
            daddr: addr,
            sport_be,
            dport_be: port_be,
            proto,
        };
        lb::select(&t, &key, fe, now).map(|(id, b)| (id, b.addr_be, b.port_be))
    }

    #[inline(always)]
    fn remember(
        cookie: u64,
        backend: &Addr6,
        bport_be: u16,
        addr: &Addr6,
        port_be: u16,
        rev_nat_id: RevNatId,
    ) -> bool {
        let rkey = SockRevNat6Key {
            cookie,
            addr_be: *backend,
            port_be: bport_be,
            _pad: [0; 6],
        };
        let rval = SockRevNat6Value {
            addr_be: *addr,
            port_be,
            _pad: 0,
            rev_nat_id,
        };
        SOCK_REVNAT6_V2.insert(&rkey, &rval, BPF_ANY as u64).is_ok()
    }

    #[inline(always)]
    fn recall(cookie: u64, addr: &Addr6, port_be: u16) -> Option<(Addr6, u16)> {
        let key = SockRevNat6Key {
            cookie,
            addr_be: *addr,
            port_be,
            _pad: [0; 6],
        };
        // SAFETY: LRU value pointer, copied.
        SOCK_REVNAT6_V2
            .get_ptr(&key)
            .map(|v| unsafe { ((*v).addr_be, (*v).port_be) })
    }

    #[inline(always)]
    fn alias(proto: u8, id: RevNatId) -> Option<(Addr6, u16)> {
        let r = crate::ipv6::rev_nat(id)?;
        Self::frontend(proto, &r.addr_be, r.port_be)
            .is_some_and(|fe| alias_target(&fe, id))
            .then_some((r.addr_be, r.port_be))
    }
}

/// What a socket hook does with a destination.
enum Forward<A> {
    /// Leaves it (not a frontend).
    Proceed,
    /// Fails the call with this errno.
    Fail(i32),
    /// Aims the socket at this backend (address and port, network order).
    To(A, u16),
}

/// The first three words of an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`).
const V4_MAPPED: [u32; 3] = [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff])];

/// The socket cookie folded into 16 bits: the stand-in for a host client's
/// source port when a backend is chosen (see [`aim`]).
#[inline(always)]
fn cookie_port(cookie: u64) -> u16 {
    (cookie ^ (cookie >> 16) ^ (cookie >> 32) ^ (cookie >> 48)) as u16
}

/// A host client's socket of `F`'s family sent to `daddr`:`dport_be`: the
/// backend to aim it at, recorded for the reverse hooks, or the errno to
/// fail the call with. The host client's own address and port are not
/// known yet: the socket cookie stands in for the port, so Maglev spreads
/// sockets, while every host client shares one client identity (affinity,
/// source hash).
#[inline(always)]
fn aim<F: SockFamily>(
    ctx: &SockAddrContext,
    proto: u8,
    daddr: &F::Addr,
    dport_be: u16,
    translated: u32,
) -> Forward<F::Addr> {
    let Some(fe) = F::frontend(proto, daddr, dport_be) else {
        return Forward::Proceed;
    };
    // Without a backend the call is refused below, at once: an unconnected
    // socket never hears of the datapath's ICMP reject.
    let per_packet = proto == IPPROTO_UDP && fe.count != 0 && per_packet_udp();
    if per_packet && fe.flags & svc_flags::CLUSTER_IP != 0 {
        // Its packets meet the pod program on the host-client device: a
        // connected socket stays connected to the ClusterIP, and a
        // backend change moves its next datagram, as with kube-proxy.
        count(stat::SOCK_PER_PACKET);
        return Forward::Proceed;
    }
    if fe.flags & svc_flags::SOURCE_RANGES != 0 && !F::node_allowed(fe.rev_nat_id) {
        count(stat::SOCK_SOURCE_RANGE);
        return Forward::Fail(EPERM);
    }
    // SAFETY: helper on this program's context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if per_packet && fe.host_alias() != 0 {
        // A NodePort, externalIP or load-balancer IP whose Service's
        // ClusterIP chooses among the same backends: the socket is aimed
        // at that ClusterIP, whose datagrams are translated one by one, and
        // sees the frontend it asked for (the reverse hooks).
        if let Some((cip, cport_be)) = F::alias(proto, fe.host_alias()) {
            if !F::remember(cookie, &cip, cport_be, daddr, dport_be, fe.rev_nat_id) {
                count(stat::SOCK_REVNAT_INSERT_FAILED);
            }
            count(stat::SOCK_PER_PACKET);
            return Forward::To(cip, cport_be);
        }
    }
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let (backend_id, b, bport_be) =
        match F::select(proto, daddr, dport_be, &fe, cookie_port(cookie), now) {
            Ok(chosen) => chosen,
            Err(Verdict::Reject(_)) => {
                count(stat::SOCK_REJECT_NO_BACKEND);
                return Forward::Fail(ECONNREFUSED);
            }
            Err(Verdict::Drop(stat::DROP_NO_LOCAL_BACKEND)) => {
                count(stat::SOCK_NO_LOCAL_BACKEND);
                return Forward::Fail(EHOSTUNREACH);
            }
            Err(_) => {
                count(stat::SOCK_NO_BACKEND_ENTRY);
                return Forward::Fail(EHOSTUNREACH);
            }
        };
    if !F::remember(cookie, &b, bport_be, daddr, dport_be, fe.rev_nat_id) {
        count(stat::SOCK_REVNAT_INSERT_FAILED);
    }
    count(translated);
    // One flow opened: its packets never meet a program (bytes unknown).
    account(0, fe.rev_nat_id, backend_id);
    Forward::To(b, bport_be)
}

/// Where a hook's address (the destination of `connect`/`sendmsg`, the
/// source or peer of `recvmsg`/`getpeername`) is in its context, and the
/// family it is looked up in: the hooks below are written once over it.
trait UserAddr {
    type F: SockFamily;
    fn get(sa: *mut bpf_sock_addr) -> (<Self::F as Family>::Addr, u16);
    fn set(sa: *mut bpf_sock_addr, addr: &<Self::F as Family>::Addr, port_be: u16);
}

/// An IPv4 socket's `user_ip4`.
struct Ip4;
/// The IPv4 address in an IPv6 socket's IPv4-mapped `user_ip6` (a
/// dual-stack socket reaching an IPv4 frontend): its last word.
struct Mapped;
/// An IPv6 socket's `user_ip6`.
struct Ip6;

impl UserAddr for Ip4 {
    type F = V4;
    #[inline(always)]
    fn get(sa: *mut bpf_sock_addr) -> (u32, u16) {
        // SAFETY: context fields readable by every IPv4 sock_addr hook.
        unsafe { ((*sa).user_ip4, (*sa).user_port as u16) }
    }
    #[inline(always)]
    fn set(sa: *mut bpf_sock_addr, addr: &u32, port_be: u16) {
        // SAFETY: context fields writable by the IPv4 hooks.
        unsafe {
            (*sa).user_ip4 = *addr;
            (*sa).user_port = port_be as u32;
        }
    }
}

impl UserAddr for Mapped {
    type F = V4;
    #[inline(always)]
    fn get(sa: *mut bpf_sock_addr) -> (u32, u16) {
        // SAFETY: context fields readable by every IPv6 sock_addr hook.
        unsafe { ((*sa).user_ip6[3], (*sa).user_port as u16) }
    }
    #[inline(always)]
    fn set(sa: *mut bpf_sock_addr, addr: &u32, port_be: u16) {
        // SAFETY: context fields writable by the IPv6 hooks.
        unsafe {
            (*sa).user_ip6[3] = *addr;
            (*sa).user_port = port_be as u32;
        }
    }
}

impl UserAddr for Ip6 {
    type F = V6;
    #[inline(always)]
    fn get(sa: *mut bpf_sock_addr) -> (Addr6, u16) {
        user_addr6(sa)
    }
    #[inline(always)]
    fn set(sa: *mut bpf_sock_addr, addr: &Addr6, port_be: u16) {
        // SAFETY: context fields writable by the IPv6 hooks.
        unsafe {
            (*sa).user_ip6[0] = addr[0];
            (*sa).user_ip6[1] = addr[1];
            (*sa).user_ip6[2] = addr[2];
            (*sa).user_ip6[3] = addr[3];
            (*sa).user_port = port_be as u32;
        }
    }
}

/// The destination of an IPv6 socket's call (`user_ip6`, `user_port`).
#[inline(always)]
fn user_addr6(sa: *mut bpf_sock_addr) -> (Addr6, u16) {
    // SAFETY: context fields readable by every IPv6 sock_addr hook.
    unsafe {
        (
            [
                (*sa).user_ip6[0],
                (*sa).user_ip6[1],
                (*sa).user_ip6[2],
                (*sa).user_ip6[3],
            ],
            (*sa).user_port as u16,
        )
    }
}

/// Whether an IPv6 socket's address is IPv4-mapped (`::ffff:a.b.c.d`).
#[inline(always)]
fn mapped(sa: *mut bpf_sock_addr) -> bool {
    // SAFETY: context fields readable by every IPv6 sock_addr hook.
    unsafe { [(*sa).user_ip6[0], (*sa).user_ip6[1], (*sa).user_ip6[2]] == V4_MAPPED }
}

/// Aims the socket whose destination is at `U` ([`aim`]), if it is sent to
/// a frontend.
#[inline(always)]
fn forward_at<U: UserAddr>(ctx: &SockAddrContext, proto: u8, translated: u32) -> i32 {
    let sa = sock_addr(ctx);
    let (daddr, dport_be) = U::get(sa);
    match aim::<U::F>(ctx, proto, &daddr, dport_be, translated) {
        Forward::Proceed => PROCEED,
        Forward::Fail(errno) => fail(errno),
        Forward::To(addr, port_be) => {
            U::set(sa, &addr, port_be);
            PROCEED
        }
    }
}

/// Shows the address at `U` as the frontend the socket was aimed from, if
/// the hooks aimed it there.
#[inline(always)]
fn reverse_at<U: UserAddr>(ctx: &SockAddrContext) -> i32 {
    let sa = sock_addr(ctx);
    // SAFETY: helper on this program's context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let (addr, port_be) = U::get(sa);
    if let Some((fe, fport_be)) = U::F::recall(cookie, &addr, port_be) {
        U::set(sa, &fe, fport_be);
        count(stat::SOCK_REVNAT);
    }
    PROCEED
}

/// The protocol of a call the forward hooks serve: a stream or datagram
/// socket of the agent's namespace, while the datapath is not draining.
#[inline(always)]
fn forwarded(ctx: &SockAddrContext) -> Option<u8> {
    let proto = protocol(sock_addr(ctx))?;
    (served(ctx) && !draining()).then_some(proto)
}

/// `connect4` and `sendmsg4`: aims a socket sent to a frontend at a backend.
#[inline(always)]
pub fn forward(ctx: &SockAddrContext, translated: u32) -> i32 {
    match forwarded(ctx) {
        Some(proto) => forward_at::<Ip4>(ctx, proto, translated),
        None => PROCEED,
    }
}

/// `connect6` and `sendmsg6`: as `connect4` and `sendmsg4`, for IPv6
/// sockets: an IPv6 frontend is looked up in the IPv6 maps; an IPv4-mapped
/// destination (a dual-stack socket reaching an IPv4 frontend) in the IPv4
/// ones, and the socket is aimed at the backend's IPv4-mapped address.
#[inline(always)]
pub fn forward6(ctx: &SockAddrContext, translated: u32) -> i32 {
    match forwarded(ctx) {
        Some(proto) if mapped(sock_addr(ctx)) => forward_at::<Mapped>(ctx, proto, translated),
        Some(proto) => forward_at::<Ip6>(ctx, proto, translated),
        None => PROCEED,
    }
}

/// `recvmsg4` and `getpeername4`: shows a backend this socket was aimed at
/// as its frontend.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext) -> i32 {
    if protocol(sock_addr(ctx)).is_none() || !served(ctx) {
        return PROCEED;
    }
    reverse_at::<Ip4>(ctx)
}

/// `recvmsg6` and `getpeername6`: as `recvmsg4` and `getpeername4`, for
/// IPv6 sockets (an IPv4-mapped backend through the IPv4 map).
#[inline(always)]
pub fn reverse6(ctx: &SockAddrContext) -> i32 {
    let sa = sock_addr(ctx);
    if protocol(sa).is_none() || !served(ctx) {
        return PROCEED;
    }
    if mapped(sa) {
        reverse_at::<Mapped>(ctx)
    } else {
        reverse_at::<Ip6>(ctx)
    }
}

//! Types shared by the kernel programs (`proxy-ebpf`) and the agent (`proxy-agent`).
//!
//! Every map key and value is `#[repr(C)]`, made only of fixed-width integers and
//! byte arrays, padded by hand, and checked by compile-time size and offset
//! asserts. Addresses and ports are kept in network byte order; the field names
//! say so (`addr_be`, `port_be`). Conversion happens in one place: the
//! constructors and accessors below, which take `Ipv4Addr` and host-order ports.
//!
//! Id 0 means "unset" in every map (backend ids, reverse-NAT ids). Map names carry
//! a layout version (`_V1`) so that an upgrade can tell an old pinned map from a
//! new one; aya truncates names past 15 bytes, so they stay short.
#![no_std]

use core::mem::{offset_of, size_of};
use core::net::Ipv4Addr;

/// Layout version of every map below. Bump it when any key or value changes.
pub const MAP_LAYOUT_VERSION: u32 = 1;

/// Map names as they appear in the object file and under the pin directory.
pub mod map_names {
    /// Frontends and their backend slots: [`super::Svc4Key`] → [`super::Svc4Value`].
    pub const SERVICES: &str = "SVC4_V1";
    /// Backends: backend id (`u32`, host order) → [`super::Backend4`].
    pub const BACKENDS: &str = "BACKEND4_V1";
    /// Reverse NAT: reverse-NAT id (`u16`, host order) → [`super::RevNat4`].
    pub const REV_NAT: &str = "REVNAT4_V1";
    /// Connection tracking (LRU): [`super::Ct4Key`] → [`super::Ct4Value`].
    pub const CONNTRACK: &str = "CT4_V1";
    /// Per-CPU packet counters indexed by [`super::stat`] codes (`u64` each).
    pub const STATS: &str = "STATS_V1";
    /// One [`super::Config`] at index 0.
    pub const CONFIG: &str = "CONFIG_V1";
    /// Pod-facing interfaces: ifindex (`u32`) → [`super::Iface`]. The datapath
    /// delivers to these with `bpf_redirect_peer`.
    pub const IFACES: &str = "IFACE_V1";

    /// Every map, in the order the agent pins and reports them.
    pub const ALL: [&str; 7] = [SERVICES, BACKENDS, REV_NAT, CONNTRACK, STATS, CONFIG, IFACES];
}

/// Default capacities. The agent may override them at load time.
pub mod capacity {
    pub const SERVICES: u32 = 65_536 * 4;
    pub const BACKENDS: u32 = 65_536 * 2;
    pub const REV_NAT: u32 = 65_536;
    pub const CONNTRACK: u32 = 262_144;
    pub const IFACES: u32 = 4_096;
    /// Number of counters in the stats array; every [`super::stat`] code is below it.
    pub const STATS: u32 = 64;
}

/// IP protocol numbers used in keys.
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// Frontend scope, part of [`Svc4Key`]: a service's internal frontends
/// (ClusterIP, `internalTrafficPolicy`) and external ones (NodePort, externalIP,
/// load-balancer IP, `externalTrafficPolicy`) may carry different backend sets.
pub const SCOPE_EXTERNAL: u8 = 0;
pub const SCOPE_INTERNAL: u8 = 1;

/// Key of the services map. Slot 0 is the frontend itself; slots `1..=count`
/// hold the ids of its backends.
///
/// | offset | field | meaning |
/// |---|---|---|
/// | 0 | `addr_be` | frontend IPv4 address, network byte order |
/// | 4 | `port_be` | frontend port, network byte order |
/// | 6 | `slot` | 0 = frontend, 1..=count = backend slot (host order) |
/// | 8 | `proto` | IP protocol number |
/// | 9 | `scope` | [`SCOPE_EXTERNAL`] or [`SCOPE_INTERNAL`] |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Svc4Key {
    pub addr_be: u32,
    pub port_be: u16,
    pub slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<Svc4Key>() == 12);
const _: () = assert!(offset_of!(Svc4Key, port_be) == 4);
const _: () = assert!(offset_of!(Svc4Key, slot) == 6);
const _: () = assert!(offset_of!(Svc4Key, proto) == 8);
const _: () = assert!(offset_of!(Svc4Key, scope) == 9);

impl Svc4Key {
    pub const fn new(addr: Ipv4Addr, port: u16, proto: u8, scope: u8, slot: u16) -> Self {
        Self {
            addr_be: u32::from_ne_bytes(addr.octets()),
            port_be: port.to_be(),
            slot,
            proto,
            scope,
            _pad: [0; 2],
        }
    }
    pub const fn addr(&self) -> Ipv4Addr {
        let o = self.addr_be.to_ne_bytes();
        Ipv4Addr::new(o[0], o[1], o[2], o[3])
    }
    pub const fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
    /// The same frontend at another slot.
    pub const fn with_slot(mut self, slot: u16) -> Self {
        self.slot = slot;
        self
    }
}

/// Frontend flags ([`Svc4Value::flags`], slot 0 only).
pub mod svc_flags {
    /// Endpoints exist in the cluster but none may be used from this node (a
    /// `Local` traffic policy): drop instead of reject when `count` is 0.
    pub const DROP_NO_BACKEND: u16 = 1 << 0;
}

/// Value of the services map.
///
/// Slot 0 (the frontend): `count` backends, `rev_nat_id`, `flags`,
/// `affinity_timeout_s`; `backend_id` is 0. Slot n ≥ 1: `backend_id` only.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Svc4Value {
    pub backend_id: u32,
    pub count: u16,
    pub rev_nat_id: u16,
    pub flags: u16,
    pub _pad: u16,
    /// Session-affinity timeout in seconds; 0 = no affinity.
    pub affinity_timeout_s: u32,
}
const _: () = assert!(size_of::<Svc4Value>() == 16);
const _: () = assert!(offset_of!(Svc4Value, count) == 4);
const _: () = assert!(offset_of!(Svc4Value, rev_nat_id) == 6);
const _: () = assert!(offset_of!(Svc4Value, flags) == 8);
const _: () = assert!(offset_of!(Svc4Value, affinity_timeout_s) == 12);

impl Svc4Value {
    pub const fn frontend(count: u16, rev_nat_id: u16, flags: u16, affinity_timeout_s: u32) -> Self {
        Self { backend_id: 0, count, rev_nat_id, flags, _pad: 0, affinity_timeout_s }
    }
    pub const fn slot(backend_id: u32) -> Self {
        Self { backend_id, count: 0, rev_nat_id: 0, flags: 0, _pad: 0, affinity_timeout_s: 0 }
    }
}

/// Backend states ([`Backend4::state`]).
pub mod backend_state {
    /// Selectable for new flows.
    pub const ACTIVE: u8 = 0;
    /// Serving and terminating: only for flows that already use it, or as a
    /// fallback chosen by the agent.
    pub const TERMINATING: u8 = 1;
}

/// Value of the backends map (key: backend id, `u32`, host order, never 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Backend4 {
    pub addr_be: u32,
    pub port_be: u16,
    pub proto: u8,
    pub state: u8,
}
const _: () = assert!(size_of::<Backend4>() == 8);
const _: () = assert!(offset_of!(Backend4, port_be) == 4);
const _: () = assert!(offset_of!(Backend4, proto) == 6);
const _: () = assert!(offset_of!(Backend4, state) == 7);

impl Backend4 {
    pub const fn new(addr: Ipv4Addr, port: u16, proto: u8, state: u8) -> Self {
        Self { addr_be: u32::from_ne_bytes(addr.octets()), port_be: port.to_be(), proto, state }
    }
    pub const fn addr(&self) -> Ipv4Addr {
        let o = self.addr_be.to_ne_bytes();
        Ipv4Addr::new(o[0], o[1], o[2], o[3])
    }
    pub const fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
}

/// Value of the reverse-NAT map (key: reverse-NAT id, `u16`, host order, never 0):
/// the frontend that replies must appear to come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RevNat4 {
    pub addr_be: u32,
    pub port_be: u16,
    pub _pad: u16,
}
const _: () = assert!(size_of::<RevNat4>() == 8);
const _: () = assert!(offset_of!(RevNat4, port_be) == 4);

impl RevNat4 {
    pub const fn new(addr: Ipv4Addr, port: u16) -> Self {
        Self { addr_be: u32::from_ne_bytes(addr.octets()), port_be: port.to_be(), _pad: 0 }
    }
    pub const fn addr(&self) -> Ipv4Addr {
        let o = self.addr_be.to_ne_bytes();
        Ipv4Addr::new(o[0], o[1], o[2], o[3])
    }
    pub const fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
}

/// Conntrack directions ([`Ct4Key::dir`]).
pub mod ct_dir {
    /// Client → frontend, as the client sent it (before DNAT).
    pub const SERVICE: u8 = 1;
    /// Backend → client, as the backend sends it (before reverse NAT).
    pub const REPLY: u8 = 2;
}

/// Conntrack key: one direction of one flow. Addresses and ports in network byte
/// order, as they appear in the packet that is looked up.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Ct4Key {
    pub saddr_be: u32,
    pub daddr_be: u32,
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    pub dir: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<Ct4Key>() == 16);
const _: () = assert!(offset_of!(Ct4Key, daddr_be) == 4);
const _: () = assert!(offset_of!(Ct4Key, sport_be) == 8);
const _: () = assert!(offset_of!(Ct4Key, dport_be) == 10);
const _: () = assert!(offset_of!(Ct4Key, proto) == 12);
const _: () = assert!(offset_of!(Ct4Key, dir) == 13);

impl Ct4Key {
    pub const fn saddr(&self) -> Ipv4Addr {
        let o = self.saddr_be.to_ne_bytes();
        Ipv4Addr::new(o[0], o[1], o[2], o[3])
    }
    pub const fn daddr(&self) -> Ipv4Addr {
        let o = self.daddr_be.to_ne_bytes();
        Ipv4Addr::new(o[0], o[1], o[2], o[3])
    }
}

/// Conntrack entry flags ([`Ct4Value::flags`]).
pub mod ct_flags {
    /// Hairpin: the client is its own backend; the source was SNATed to the
    /// hairpin address. In a SERVICE entry `nat_addr_be` is that address; in a
    /// REPLY entry it is the client's own address, restored on replies.
    pub const HAIRPIN: u16 = 1 << 0;
    /// A TCP SYN without ACK was the last packet seen (connection opening).
    pub const TCP_SYN: u16 = 1 << 1;
    /// A TCP FIN or RST was seen: the connection is closing.
    pub const TCP_CLOSING: u16 = 1 << 2;
}

/// Conntrack value.
///
/// SERVICE entries: `backend_id` chosen for the flow, `rev_nat_id` of the
/// frontend, and for hairpin flows the SNAT address in `nat_addr_be`.
/// REPLY entries: `rev_nat_id` (source to restore) and, for hairpin flows, the
/// original client address in `nat_addr_be` (destination to restore).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Ct4Value {
    pub backend_id: u32,
    pub nat_addr_be: u32,
    pub rev_nat_id: u16,
    pub flags: u16,
    pub _pad: u32,
    /// `bpf_ktime_get_ns()` of the last packet seen (refreshed at most once a second).
    pub last_seen_ns: u64,
}
const _: () = assert!(size_of::<Ct4Value>() == 24);
const _: () = assert!(offset_of!(Ct4Value, nat_addr_be) == 4);
const _: () = assert!(offset_of!(Ct4Value, rev_nat_id) == 8);
const _: () = assert!(offset_of!(Ct4Value, flags) == 10);
const _: () = assert!(offset_of!(Ct4Value, last_seen_ns) == 16);

/// Datapath configuration, one entry at index 0 of the config map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Source address given to hairpin flows (a pod reaching itself through a
    /// frontend), network byte order. 0 disables hairpin SNAT.
    pub hairpin_addr_be: u32,
    /// Conntrack timeouts, seconds: TCP while only a SYN was seen.
    pub ct_tcp_syn_s: u32,
    /// TCP established.
    pub ct_tcp_established_s: u32,
    /// TCP after a FIN or RST.
    pub ct_tcp_closing_s: u32,
    /// UDP.
    pub ct_udp_s: u32,
    /// Must equal [`MAP_LAYOUT_VERSION`]; the datapath passes everything while it
    /// does not (an agent has not configured it yet).
    pub layout_version: u32,
}
const _: () = assert!(size_of::<Config>() == 24);
const _: () = assert!(offset_of!(Config, layout_version) == 20);

impl Default for Config {
    /// Conntrack timeouts follow Cilium's defaults (SYN 60 s, established 6 h,
    /// closing 10 s, UDP 60 s).
    fn default() -> Self {
        Self {
            hairpin_addr_be: 0,
            ct_tcp_syn_s: 60,
            ct_tcp_established_s: 21_600,
            ct_tcp_closing_s: 10,
            ct_udp_s: 60,
            layout_version: MAP_LAYOUT_VERSION,
        }
    }
}

impl Config {
    pub const fn with_hairpin_addr(mut self, addr: Ipv4Addr) -> Self {
        self.hairpin_addr_be = u32::from_ne_bytes(addr.octets());
        self
    }
}

/// Value of the interfaces map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Iface {
    /// [`iface_flags`] bits.
    pub flags: u32,
}
const _: () = assert!(size_of::<Iface>() == 4);

pub mod iface_flags {
    /// A veth whose peer is a pod: deliver with `bpf_redirect_peer`.
    pub const POD: u32 = 1 << 0;
}

/// Per-CPU packet counters, indexed by these codes. Every packet the programs
/// see is counted once under its verdict (`PASS_*`, `FWD_*`, `REJECT_*`,
/// `DROP_*`); a translated packet is counted once more under how it was
/// delivered (`REDIRECT*`, `PASS_FIB_MISS`, `PASS_TTL`); `HAIRPIN` and
/// `CT_INSERT_FAILED` are extra marks on packets already counted.
pub mod stat {
    /// Not IPv4 (ARP, IPv6, ...): passed untouched.
    pub const PASS_NOT_IPV4: u32 = 1;
    /// IPv4 but neither for a frontend nor a reply of a tracked flow: passed untouched.
    pub const PASS_NO_SERVICE: u32 = 2;
    /// A new flow to a frontend: backend chosen, DNAT done.
    pub const FWD_NEW: u32 = 3;
    /// A packet of a tracked flow to a frontend: DNAT to its backend.
    pub const FWD_ESTABLISHED: u32 = 4;
    /// A reply of a tracked flow: reverse NAT done.
    pub const FWD_REPLY: u32 = 5;
    /// A frontend without a usable backend: rejected with ICMP port unreachable.
    pub const REJECT_NO_BACKEND: u32 = 6;
    /// A frontend whose endpoints may not be used from this node: dropped.
    pub const DROP_NO_LOCAL_BACKEND: u32 = 7;
    /// A packet for a frontend too short for its headers: dropped.
    pub const DROP_MALFORMED: u32 = 8;
    /// A fragment (IPv4 MF set or offset ≠ 0): passed untouched; the datapath
    /// does not reassemble.
    pub const PASS_FRAGMENT: u32 = 9;
    /// A slot points to a backend id missing from the backends map: dropped.
    pub const DROP_NO_BACKEND_ENTRY: u32 = 10;
    /// A packet rewrite (store or checksum helper) failed: dropped.
    pub const DROP_REWRITE_FAILED: u32 = 11;
    /// Building the ICMP reject failed: dropped instead.
    pub const DROP_REJECT_FAILED: u32 = 12;
    /// Translated, but the FIB had no route or forwarding is off: handed to the
    /// stack.
    pub const PASS_FIB_MISS: u32 = 13;
    /// Translated and delivered with `bpf_redirect_peer` / `bpf_redirect`.
    pub const REDIRECT: u32 = 14;
    /// Translated and delivered with `bpf_redirect_neigh` (neighbour unresolved).
    pub const REDIRECT_NEIGH: u32 = 15;
    /// A conntrack insert failed (map full and not evictable): forwarded anyway,
    /// the flow may change backend.
    pub const CT_INSERT_FAILED: u32 = 16;
    /// Hairpin: a pod reached itself through a frontend; source SNATed.
    pub const HAIRPIN: u32 = 17;
    /// TTL expired on a translated packet: handed to the stack (ICMP time exceeded).
    pub const PASS_TTL: u32 = 18;
    /// The datapath is not configured yet (no agent has written the config map).
    pub const PASS_UNCONFIGURED: u32 = 19;
    /// Neither TCP nor UDP: passed untouched.
    pub const PASS_OTHER_PROTO: u32 = 20;
    /// An IPv4 header or L4 ports that cannot be read (truncated, bad version
    /// or header length), not for a frontend: passed untouched; the stack drops it.
    pub const PASS_MALFORMED: u32 = 21;

    /// Human names, indexed by code; `""` for unused codes.
    pub const NAMES: [&str; 22] = [
        "",
        "pass_not_ipv4",
        "pass_no_service",
        "fwd_new",
        "fwd_established",
        "fwd_reply",
        "reject_no_backend",
        "drop_no_local_backend",
        "drop_malformed",
        "pass_fragment",
        "drop_no_backend_entry",
        "drop_rewrite_failed",
        "drop_reject_failed",
        "pass_fib_miss",
        "redirect",
        "redirect_neigh",
        "ct_insert_failed",
        "hairpin",
        "pass_ttl",
        "pass_unconfigured",
        "pass_other_proto",
        "pass_malformed",
    ];
    const _: () = assert!((NAMES.len() as u32) <= super::capacity::STATS);
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: plain `#[repr(C)]` structs of integers, padded by hand, no
    // implicit padding (checked by the size asserts above).
    unsafe impl aya::Pod for Svc4Key {}
    unsafe impl aya::Pod for Svc4Value {}
    unsafe impl aya::Pod for Backend4 {}
    unsafe impl aya::Pod for RevNat4 {}
    unsafe impl aya::Pod for Ct4Key {}
    unsafe impl aya::Pod for Ct4Value {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for Iface {}
}

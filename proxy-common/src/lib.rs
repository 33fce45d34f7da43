//! Types shared by the kernel programs (`proxy-ebpf`) and the agent (`proxy-agent`).
//! Every map key and value is `#[repr(C)]`, made only of fixed-width integers and
//! byte arrays, padded by hand, and checked by compile-time size and offset
//! asserts. Addresses and ports are kept in network byte order; the field names
//! say so (`addr_be`, `port_be`). Conversion happens in one place: the
//! constructors and accessors below, which take `Ipv4Addr` and host-order ports.
//! Id 0 means "unset" in every map (backend ids, reverse-NAT ids). Map names carry
//! a layout version (`_V1`) so that an upgrade can tell an old pinned map from a
//! new one; aya truncates names past 15 bytes, so they stay short. Why one file
//! (about 850 lines): it is the IPv4 maps' contract with the programs, each map's
//! name, capacity, key and value beside its layout asserts; IPv6's is `ipv6.rs`.
#![no_std]

pub mod conntrack;
pub mod crc32c;
pub mod csum;
pub mod ipv6;
pub mod lb;
pub mod ratelimit;

use core::mem::{offset_of, size_of};
use core::net::{Ipv4Addr, Ipv6Addr};

pub use ipv6::{
    Addr6, Affinity6Key, Backend6, Ct6Key, Ct6Value, Frag6Key, RevNat6, SockRevNat6Key,
    SockRevNat6Value, SourceRange6, Svc6Key,
};

/// Layout version of [`Config`]: the datapath passes everything until an
/// agent wrote a config of this version. Each map's own layout is versioned in
/// its name (`SVC4_V2`): a map whose key or value changes gets a new name
/// and the agent a migration from the old one.
pub const MAP_LAYOUT_VERSION: u32 = 1;

/// A frontend's reverse-NAT id (host order, never 0). It indexes the
/// per-frontend arrays (traffic, round-robin cursors), so ids stay below the
/// reverse-NAT map's configured size. 32 bits (layout `_V2`; `u16` in `_V1`):
/// a node may have more than 65,535 frontends.
pub type RevNatId = u32;

/// The highest reverse-NAT id (2^24 - 1): the reverse-NAT map holds at most
/// 2^24 entries (the datapath carries an id with flag bits in one `u32`).
pub const REV_NAT_ID_MAX: RevNatId = (1 << 24) - 1;

/// Map names as they appear in the object file and under the pin directory.
pub mod map_names {
    /// Frontends and their backend slots: [`super::Svc4Key`] → [`super::SvcValue`].
    pub const SERVICES: &str = "SVC4_V2";
    /// Backends: backend id (`u32`, host order) → [`super::Backend4`].
    pub const BACKENDS: &str = "BACKEND4_V1";
    /// Reverse NAT: [`super::RevNatId`] → [`super::RevNat4`].
    pub const REV_NAT: &str = "REVNAT4_V2";
    /// Connection tracking (LRU): [`super::Ct4Key`] → [`super::Ct4Value`].
    pub const CONNTRACK: &str = "CT4_V2";
    /// Per-CPU packet counters indexed by [`super::stat`] codes (`u64` each).
    pub const STATS: &str = "STATS_V1";
    /// One [`super::Config`] at index 0.
    pub const CONFIG: &str = "CONFIG_V3";
    /// Pod-facing interfaces: ifindex (`u32`) → [`super::Iface`]. The datapath
    /// delivers to these with `bpf_redirect_peer`.
    pub const IFACES: &str = "IFACE_V1";
    /// Session affinity (LRU): [`super::Affinity4Key`] → [`super::AffinityValue`].
    pub const AFFINITY: &str = "AFFINITY4_V2";
    /// IPv4 fragments (LRU): [`super::Frag4Key`] → [`super::FragPorts`].
    pub const FRAGMENTS: &str = "FRAG4_V1";
    /// `loadBalancerSourceRanges` (LPM trie): `{prefix_len, SourceRange4}` → `u8` (1).
    pub const SOURCE_RANGES: &str = "SRCRANGE4_V2";
    /// Per-CPU traffic of each frontend, indexed by reverse-NAT id → [`super::Traffic`].
    pub const FRONTEND_TRAFFIC: &str = "FE_TRAFFIC_V1";
    /// Per-CPU traffic of each backend, indexed by backend id → [`super::Traffic`].
    pub const BACKEND_TRAFFIC: &str = "BE_TRAFFIC_V1";
    /// Socket-level reverse NAT (LRU): [`super::SockRevNat4Key`] →
    /// [`super::SockRevNat4Value`], written by the cgroup hooks for host
    /// clients' sockets.
    pub const SOCK_REVNAT: &str = "SOCK_REVNAT4_V2";
    /// Maglev lookup tables: [`super::lb::MaglevKey`] →
    /// [`super::lb::MaglevChunk`] (not preallocated: memory follows use).
    pub const MAGLEV: &str = "MAGLEV4_V2";
    /// Round-robin cursors, per CPU, indexed by reverse-NAT id (`u32`).
    pub const ROUND_ROBIN: &str = "RR4_V1";
    /// The ICMP reject's rate limit, per CPU: index 0 → the bucket's
    /// theoretical arrival time (`u64`, ns; see [`super::ratelimit`]).
    pub const REJECT_LIMIT: &str = "REJECT_RL_V1";
    /// SNAT port spaces a search found full (LRU): a [`super::Ct4Key`] of
    /// the backend-side tuple with port 0 → when (`u64`, ns). See
    /// [`super::SNAT_SEARCH_BACKOFF_NS`].
    pub const SNAT_FULL: &str = "SNAT_FULL4_V1";
    /// IPv6 [`SNAT_FULL`]: a [`super::Ct6Key`] with port 0 → when (`u64`,
    /// ns).
    pub const SNAT_FULL6: &str = "SNAT_FULL6_V1";
    /// IPv6 frontends and their backend slots: [`super::Svc6Key`] →
    /// [`super::SvcValue`].
    pub const SERVICES6: &str = "SVC6_V2";
    /// IPv6 backends: backend id (`u32`, the IPv4 map's id space) →
    /// [`super::Backend6`].
    pub const BACKENDS6: &str = "BACKEND6_V1";
    /// IPv6 reverse NAT: [`super::RevNatId`] (the IPv4 map's id space) →
    /// [`super::RevNat6`].
    pub const REV_NAT6: &str = "REVNAT6_V2";
    /// IPv6 connection tracking (LRU): [`super::Ct6Key`] → [`super::Ct6Value`].
    pub const CONNTRACK6: &str = "CT6_V2";
    /// IPv6 session affinity (LRU): [`super::Affinity6Key`] →
    /// [`super::AffinityValue`].
    pub const AFFINITY6: &str = "AFFINITY6_V2";
    /// The IPv6 tc programs the IPv4 ones tail-call (a program array, index
    /// → program). Pinned so that it outlives the agent (the kernel empties
    /// a program array whose last user-space reference goes): a restarted
    /// agent fills it with its own programs.
    pub const TAIL6: &str = "TAIL6_V1";
    /// IPv6 `loadBalancerSourceRanges` (LPM trie): `{prefix_len,
    /// SourceRange6}` → `u8` (1).
    pub const SOURCE_RANGES6: &str = "SRCRANGE6_V2";
    /// Socket-level reverse NAT of IPv6 sockets (LRU):
    /// [`super::SockRevNat6Key`] → [`super::SockRevNat6Value`].
    pub const SOCK_REVNAT6: &str = "SOCK_REVNAT6_V2";
    /// IPv6 fragments (LRU): [`super::Frag6Key`] → [`super::FragPorts`].
    pub const FRAGMENTS6: &str = "FRAG6_V1";
    /// The XDP program for IPv6 that `ext_xdp` tail-calls (a program array
    /// of one; pinned as [`TAIL6`]).
    pub const TAIL6_XDP: &str = "TAIL6_XDP_V1";
    /// Flows the kernel's conntrack translated before the agent took over
    /// (LRU): a [`super::Ct4Key`] (the client's direction, `dir` SERVICE)
    /// → until when it is left to the kernel (`u64`, ns of
    /// `bpf_ktime_get_ns`). See [`super::stat::PASS_HANDOVER`]. Under
    /// `dir` REPLY, the backend-side tuple of such a flow the kernel also
    /// masqueraded: its port of the node's address is not given to a new
    /// flow to the same backend until then.
    pub const HANDOVER: &str = "HANDOVER4_V1";
    /// IPv6 [`HANDOVER`]: a [`super::Ct6Key`] → until when (`u64`, ns).
    pub const HANDOVER6: &str = "HANDOVER6_V1";

    /// Every map, in the order the agent pins and reports them.
    pub const ALL: [&str; 30] = [
        SERVICES,
        BACKENDS,
        REV_NAT,
        CONNTRACK,
        STATS,
        CONFIG,
        IFACES,
        AFFINITY,
        FRAGMENTS,
        SOURCE_RANGES,
        FRONTEND_TRAFFIC,
        BACKEND_TRAFFIC,
        SOCK_REVNAT,
        MAGLEV,
        ROUND_ROBIN,
        REJECT_LIMIT,
        SNAT_FULL,
        SERVICES6,
        BACKENDS6,
        REV_NAT6,
        CONNTRACK6,
        AFFINITY6,
        TAIL6,
        SOURCE_RANGES6,
        SOCK_REVNAT6,
        FRAGMENTS6,
        TAIL6_XDP,
        HANDOVER,
        HANDOVER6,
        SNAT_FULL6,
    ];
}

/// Default capacities. The agent may override them at load time.
pub mod capacity {
    pub const SERVICES: u32 = 65_536 * 4;
    pub const BACKENDS: u32 = 65_536 * 2;
    pub const REV_NAT: u32 = 65_536;
    pub const CONNTRACK: u32 = 262_144;
    pub const IFACES: u32 = 4_096;
    pub const AFFINITY: u32 = 65_536;
    pub const FRAGMENTS: u32 = 8_192;
    pub const SOURCE_RANGES: u32 = 16_384;
    /// One traffic slot per reverse-NAT id (the agent sizes it as the
    /// reverse-NAT map).
    pub const FRONTEND_TRAFFIC: u32 = REV_NAT;
    /// Number of counters in the stats array; every [`super::stat`] code is below it.
    pub const STATS: u32 = 64;
    /// Host clients' translated sockets (one entry per socket and backend).
    pub const SOCK_REVNAT: u32 = 131_072;
    /// Maglev tables the agent programs at most (`loadBalancing.maglev.maxTables`).
    pub const MAGLEV_TABLES: u32 = 1_024;
    /// Maglev chunks: two generations of every table at the default size.
    pub const MAGLEV_CHUNKS: u32 =
        2 * MAGLEV_TABLES * super::lb::maglev_chunks(super::lb::MAGLEV_DEFAULT_SIZE);
    /// SNAT port spaces remembered as full (one per backend and source
    /// address whose whole range a search found taken).
    pub const SNAT_FULL: u32 = 1_024;
    /// Flows handed over from the kernel's conntrack, per family.
    pub const HANDOVER: u32 = 65_536;
    /// IPv6 frontend slots (not preallocated: memory follows use).
    pub const SERVICES6: u32 = SERVICES;
    /// IPv6 conntrack (preallocated, as every LRU map): half of IPv4's
    /// default, as an IPv6 entry is twice the size.
    pub const CONNTRACK6: u32 = 131_072;
    /// IPv6 session-affinity clients.
    pub const AFFINITY6: u32 = 16_384;
}

/// How long a SNAT port space a search found full is not searched again:
/// new flows to it get only the random tries (and are dropped when those
/// fail), so a flood of first packets to a saturated backend costs each
/// packet a few lookups, not one per port of the range.
pub const SNAT_SEARCH_BACKOFF_NS: u64 = 100_000_000;

/// How long a handed-over UDP or SCTP flow stays the kernel's after its
/// last packet ([`map_names::HANDOVER`]): each packet the datapath passes
/// moves its deadline this far ahead, as the kernel's conntrack refreshes
/// its own entry (`nf_conntrack_udp_timeout_stream`, 120 s). TCP entries
/// keep the deadline the agent wrote (the kernel entry's own timeout).
pub const HANDOVER_REFRESH_NS: u64 = 120_000_000_000;

/// How long a TCP or SCTP flow the draining datapath passed to the stack
/// stays listed in the handover map: the kernel's default established
/// timeout (`nf_conntrack_tcp_timeout_established`, 5 days), as its entry
/// there. (A UDP flow gets [`HANDOVER_REFRESH_NS`], renewed per packet.)
pub const HANDOVER_DRAINED_NS: u64 = 5 * 24 * 3600 * 1_000_000_000;

/// IP protocol numbers used in keys.
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;

/// Frontend scope, part of [`Svc4Key`]: a service's internal frontends
/// (ClusterIP, `internalTrafficPolicy`) and external ones (NodePort, externalIP,
/// load-balancer IP, `externalTrafficPolicy`) may carry different backend sets.
pub const SCOPE_EXTERNAL: u8 = 0;
pub const SCOPE_INTERNAL: u8 = 1;

/// The host-client device: one end of a veth pair the agent owns in the
/// node's network namespace, where it routes every ClusterIP. The node's own
/// UDP to a ClusterIP leaves through it and arrives at its peer
/// ([`HOST_PEER_NAME`]), whose tc ingress translates it per packet as a
/// pod's; translated packets whose destination is this node (the replies)
/// are injected at this device's ingress, where the route to their source
/// points.
pub const HOST_DEV_NAME: &str = "proxy-svc";
/// The peer of [`HOST_DEV_NAME`], where the pod program translates.
pub const HOST_PEER_NAME: &str = "proxy-svc-lb";
/// The MAC address of [`HOST_DEV_NAME`] (locally administered, never on a
/// wire): the destination the datapath writes into a frame it injects
/// there, so that the stack takes it as the host's.
pub const HOST_DEV_MAC: [u8; 6] = [0x02, 0x6b, 0x70, 0x72, 0x00, 0x01];

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

/// Frontend flags ([`SvcValue::flags`], slot 0 only).
pub mod svc_flags {
    /// Endpoints exist in the cluster but none may be used from this node (a
    /// `Local` traffic policy): drop instead of reject when `count` is 0.
    pub const DROP_NO_BACKEND: u16 = 1 << 0;
    /// `loadBalancerSourceRanges` apply: new flows from clients outside the
    /// source-range map's prefixes for this frontend are dropped.
    pub const SOURCE_RANGES: u16 = 1 << 1;
    /// `externalTrafficPolicy: Local` (external frontends): the client's
    /// address is kept, never SNATed, even towards a remote backend.
    pub const EXTERNAL_LOCAL: u16 = 1 << 2;
    /// The load-balancing algorithm ([`crate::lb::alg`]) in these two bits:
    /// `(flags & ALG_MASK) >> ALG_SHIFT`.
    pub const ALG_SHIFT: u16 = 3;
    pub const ALG_MASK: u16 = 0b11 << ALG_SHIFT;
    /// Maglev: which generation of the frontend's table packets read.
    pub const MAGLEV_GEN: u16 = 1 << 5;
    /// Maglev on a load-balancer IP or externalIP (`externalTrafficPolicy:
    /// Cluster`): a new flow to a backend on another node is sent there
    /// unchanged (its node picks the same backend and translates, keeping the
    /// client's address), so the flow survives when the router moves it to
    /// another node.
    pub const HANDOFF: u16 = 1 << 6;
    /// A Service's ClusterIP (internal scope). Host clients' UDP to it is
    /// translated per packet (the agent routes ClusterIPs to its host-client
    /// device, [`crate::HOST_DEV_NAME`]) instead of aimed at a backend by
    /// the socket hooks, when the agent loaded them so.
    pub const CLUSTER_IP: u16 = 1 << 7;

    /// The algorithm bits of `flags`.
    pub const fn algorithm(flags: u16) -> u16 {
        (flags & ALG_MASK) >> ALG_SHIFT
    }
}

/// Value of the services map.
///
/// Slot 0 (the frontend): `count` backends, `rev_nat_id`, `flags`,
/// `affinity_timeout_s`, and in `backend_id` its host alias
/// ([`SvcValue::host_alias`]). Slot n ≥ 1: `backend_id` only.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SvcValue {
    pub backend_id: u32,
    pub rev_nat_id: RevNatId,
    pub count: u16,
    pub flags: u16,
    /// Slot 0 of a Maglev frontend: the size of its table (a prime); else 0.
    pub maglev_size: u16,
    pub _pad: u16,
    /// Session-affinity timeout in seconds; 0 = no affinity.
    pub affinity_timeout_s: u32,
}
const _: () = assert!(size_of::<SvcValue>() == 20);
const _: () = assert!(offset_of!(SvcValue, rev_nat_id) == 4);
const _: () = assert!(offset_of!(SvcValue, count) == 8);
const _: () = assert!(offset_of!(SvcValue, flags) == 10);
const _: () = assert!(offset_of!(SvcValue, maglev_size) == 12);
const _: () = assert!(offset_of!(SvcValue, affinity_timeout_s) == 16);

impl SvcValue {
    pub const fn frontend(
        count: u16,
        rev_nat_id: RevNatId,
        flags: u16,
        affinity_timeout_s: u32,
    ) -> Self {
        Self {
            backend_id: 0,
            count,
            rev_nat_id,
            flags,
            maglev_size: 0,
            _pad: 0,
            affinity_timeout_s,
        }
    }
    /// This slot 0 with a Maglev table of `size` entries.
    pub const fn with_maglev_size(mut self, size: u16) -> Self {
        self.maglev_size = size;
        self
    }
    /// This slot 0 with the host alias `rev_nat_id` (see
    /// [`SvcValue::host_alias`]).
    pub const fn with_host_alias(mut self, rev_nat_id: RevNatId) -> Self {
        self.backend_id = rev_nat_id;
        self
    }
    /// Slot 0 of an internal-scope NodePort, externalIP or load-balancer IP
    /// frontend: the reverse-NAT id of its Service's ClusterIP frontend
    /// (same family, port and protocol, same backends), to which the socket
    /// hooks aim a host client's UDP so that its datagrams are translated
    /// one by one like any to the ClusterIP; 0: none (the socket is aimed
    /// at a backend). Slot 0 has no backend of its own, so its
    /// `backend_id` carries it.
    pub const fn host_alias(&self) -> RevNatId {
        self.backend_id
    }
    pub const fn slot(backend_id: u32) -> Self {
        Self {
            backend_id,
            count: 0,
            rev_nat_id: 0,
            flags: 0,
            maglev_size: 0,
            _pad: 0,
            affinity_timeout_s: 0,
        }
    }
}

/// Backend states ([`Backend4::state`]).
pub mod backend_state {
    /// Selectable for new flows.
    pub const ACTIVE: u8 = 0;
    /// Bit: terminating; kept for flows that already use it (and selectable
    /// only when the agent put it in a slot as a fallback).
    pub const TERMINATING: u8 = 1 << 0;
    /// Bit: the endpoint runs on this node. External traffic to a remote
    /// backend under `externalTrafficPolicy: Cluster` is SNATed to the node's
    /// address so that replies come back through this node.
    pub const LOCAL: u8 = 1 << 1;
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
        Self {
            addr_be: u32::from_ne_bytes(addr.octets()),
            port_be: port.to_be(),
            proto,
            state,
        }
    }
    pub const fn addr(&self) -> Ipv4Addr {
        let o = self.addr_be.to_ne_bytes();
        Ipv4Addr::new(o[0], o[1], o[2], o[3])
    }
    pub const fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
}

/// Value of the reverse-NAT map (key: [`RevNatId`], host order, never 0):
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
        Self {
            addr_be: u32::from_ne_bytes(addr.octets()),
            port_be: port.to_be(),
            _pad: 0,
        }
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
    /// The source address was rewritten (SNAT): to the hairpin address when a
    /// pod reaches itself, or to the node's address for external traffic sent
    /// to a backend on another node (`externalTrafficPolicy: Cluster`). In a
    /// SERVICE entry `nat_addr_be` is the new source; in a REPLY entry it is
    /// the client's own address, restored on replies.
    pub const SNAT_ADDR: u16 = 1 << 0;
    /// Alias kept for readability where the SNAT is the hairpin one.
    pub const HAIRPIN: u16 = SNAT_ADDR;
    /// A TCP SYN without ACK was the last packet seen (connection opening).
    pub const TCP_SYN: u16 = 1 << 1;
    /// A TCP RST was seen: the connection is closed (agents before the
    /// state machine below also set it on a FIN).
    pub const TCP_CLOSING: u16 = 1 << 2;
    /// The client's source port was rewritten to `nat_port_be`: another live
    /// flow already used the backend-side tuple (field bug C6), or the source
    /// address was SNATed to the node's. In a SERVICE entry `nat_port_be` is
    /// the new port; in a REPLY entry it is the client's own port, restored on
    /// replies.
    pub const SNAT_PORT: u16 = 1 << 3;
    /// The flow is delivered through the host's stack (`deliveryMode:
    /// stack`): its forward packets, translated, are handed to the stack so
    /// the host's filters (a NetworkPolicy engine's FORWARD rules) see the
    /// backend; its replies pass the first hook untranslated and get their
    /// reverse NAT at the last one (tc egress towards the client). Set in
    /// both entries.
    pub const VIA_STACK: u16 = 1 << 4;
    /// TCP: the client sent a FIN.
    pub const TCP_FIN_FWD: u16 = 1 << 5;
    /// TCP: the backend sent a FIN.
    pub const TCP_FIN_REV: u16 = 1 << 6;
    /// The backend has not answered yet (the kernel's conntrack without
    /// `IPS_SEEN_REPLY`): a flow whose SYN is unanswered, or first seen
    /// mid-stream, lives only the short timeout.
    pub const UNREPLIED: u16 = 1 << 7;
    /// UDP: traffic went both ways and went on (the kernel's UDP stream).
    pub const UDP_STREAM: u16 = 1 << 8;
    /// The bits that describe the flow's state (the others its translation).
    pub const STATE: u16 =
        TCP_SYN | TCP_CLOSING | TCP_FIN_FWD | TCP_FIN_REV | UNREPLIED | UDP_STREAM;
}

/// [`Config::flags`] bits.
pub mod config_flags {
    /// `deliveryMode: stack`: translated flows that need no source address
    /// rewrite are handed to the host's stack instead of redirected, so
    /// netfilter's forward filtering sees the backend tuple.
    pub const DELIVER_VIA_STACK: u32 = 1 << 0;
    /// Draining (`--on-exit drain`, the agent handing the node back to
    /// kube-proxy; and while an agent taking a node over from kube-proxy
    /// attaches and lists the kernel's flows): flows already tracked are
    /// still translated, new ones pass untouched to the host's stack
    /// (kube-proxy's rules) and are listed in the handover map, so that
    /// they stay the stack's once draining ends; the socket hooks leave new
    /// connections to it too.
    pub const DRAINING: u32 = 1 << 1;
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
    pub rev_nat_id: RevNatId,
    pub flags: u16,
    pub nat_port_be: u16,
    /// `bpf_ktime_get_ns()` of the last packet seen (refreshed at most once a second).
    pub last_seen_ns: u64,
}
const _: () = assert!(size_of::<Ct4Value>() == 24);
const _: () = assert!(offset_of!(Ct4Value, nat_addr_be) == 4);
const _: () = assert!(offset_of!(Ct4Value, rev_nat_id) == 8);
const _: () = assert!(offset_of!(Ct4Value, flags) == 12);
const _: () = assert!(offset_of!(Ct4Value, nat_port_be) == 14);
const _: () = assert!(offset_of!(Ct4Value, last_seen_ns) == 16);

/// Session-affinity key: one client of one frontend (kube-proxy's
/// `sessionAffinity: ClientIP` is per client address and service port).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Affinity4Key {
    /// Client address, network byte order.
    pub client_be: u32,
    /// The frontend's reverse-NAT id (host order).
    pub rev_nat_id: RevNatId,
}
const _: () = assert!(size_of::<Affinity4Key>() == 8);
const _: () = assert!(offset_of!(Affinity4Key, rev_nat_id) == 4);

/// Session-affinity value: the backend chosen, and when it was last chosen for
/// a new connection. The entry is valid while `now - last_used_ns` is within
/// the frontend's `affinity_timeout_s`; conntrack lifetimes never extend it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AffinityValue {
    pub backend_id: u32,
    pub _pad: u32,
    pub last_used_ns: u64,
}
const _: () = assert!(size_of::<AffinityValue>() == 16);
const _: () = assert!(offset_of!(AffinityValue, last_used_ns) == 8);

/// Socket-level reverse-NAT key: one host client's socket (its cookie) and
/// the backend the cgroup hooks aimed it at. `recvmsg()` and `getpeername()`
/// on that socket see the frontend instead of this backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNat4Key {
    /// `bpf_get_socket_cookie()` of the socket.
    pub cookie: u64,
    /// Backend address, network byte order.
    pub addr_be: u32,
    /// Backend port, network byte order.
    pub port_be: u16,
    pub _pad: u16,
}
const _: () = assert!(size_of::<SockRevNat4Key>() == 16);
const _: () = assert!(offset_of!(SockRevNat4Key, addr_be) == 8);

/// Socket-level reverse-NAT value: the frontend the socket asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SockRevNat4Value {
    /// Frontend address, network byte order.
    pub addr_be: u32,
    /// Frontend port, network byte order.
    pub port_be: u16,
    pub _pad: u16,
    /// The frontend's reverse-NAT id (host order).
    pub rev_nat_id: RevNatId,
}
const _: () = assert!(size_of::<SockRevNat4Value>() == 12);
const _: () = assert!(offset_of!(SockRevNat4Value, rev_nat_id) == 8);

/// Fragment key: one IPv4 datagram being fragmented, as its fragments carry it
/// (before any translation). Addresses and id in network byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Frag4Key {
    pub saddr_be: u32,
    pub daddr_be: u32,
    pub id_be: u16,
    pub proto: u8,
    pub _pad: u8,
}
const _: () = assert!(size_of::<Frag4Key>() == 12);
const _: () = assert!(offset_of!(Frag4Key, id_be) == 8);
const _: () = assert!(offset_of!(Frag4Key, proto) == 10);

/// The L4 ports of a fragmented datagram, from its first fragment (network
/// byte order), so that later fragments follow the same flow.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FragPorts {
    pub sport_be: u16,
    pub dport_be: u16,
}
const _: () = assert!(size_of::<FragPorts>() == 4);

/// Data of a source-range LPM key: the frontend's reverse-NAT id, then the
/// client prefix. The LPM prefix length counts the 32 bits of `rev_nat_id_be`,
/// plus the CIDR's length.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SourceRange4 {
    /// Big-endian, so that the LPM trie compares it bytewise like an address.
    pub rev_nat_id_be: u32,
    pub addr_be: u32,
}
const _: () = assert!(size_of::<SourceRange4>() == 8);
const _: () = assert!(offset_of!(SourceRange4, addr_be) == 4);

/// Bits of a [`SourceRange4`] key before the address.
pub const SOURCE_RANGE_ID_BITS: u32 = 32;

/// Packets and bytes (whole frames) of a frontend or a backend, both
/// directions of its translated flows, per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Traffic {
    pub packets: u64,
    pub bytes: u64,
}
const _: () = assert!(size_of::<Traffic>() == 16);

/// Datapath configuration, one entry at index 0 of the config map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Source address given to hairpin flows (a pod reaching itself through a
    /// frontend), network byte order. 0 disables hairpin SNAT.
    pub hairpin_addr_be: u32,
    /// Conntrack timeouts, seconds: TCP until the backend answered (SYN
    /// sent, or a flow first seen mid-stream), and while the handshake is
    /// unfinished.
    pub ct_tcp_syn_s: u32,
    /// TCP established.
    pub ct_tcp_established_s: u32,
    /// TCP after a RST.
    pub ct_tcp_closing_s: u32,
    /// UDP until traffic went both ways for more than a moment.
    pub ct_udp_s: u32,
    /// Must equal [`MAP_LAYOUT_VERSION`]; the datapath passes everything while it
    /// does not (an agent has not configured it yet).
    pub layout_version: u32,
    /// The node's address, network byte order: the source given to external
    /// traffic sent to a backend on another node. 0 disables that SNAT.
    pub node_addr_be: u32,
    /// [`config_flags`] bits.
    pub flags: u32,
    /// TCP after a FIN in one direction (half-closed: kernel's CLOSE_WAIT).
    pub ct_tcp_close_wait_s: u32,
    /// TCP after FINs in both directions (kernel's TIME_WAIT).
    pub ct_tcp_time_wait_s: u32,
    /// UDP once replied to and still active (kernel's UDP stream).
    pub ct_udp_stream_s: u32,
    /// Source ports given to SNATed flows, host byte order, inclusive; kept
    /// out of the host's `ip_local_port_range` by the agent.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// Source address given to IPv6 hairpin flows ([`Config::hairpin_addr_be`]
    /// for IPv6), [`Addr6`] words. All zeroes disables IPv6 hairpin SNAT.
    pub hairpin6_be: Addr6,
    /// The node's IPv6 address ([`Config::node_addr_be`] for IPv6): the
    /// source given to external IPv6 traffic sent to a backend on another
    /// node. All zeroes disables that SNAT.
    pub node6_be: Addr6,
}
const _: () = assert!(size_of::<Config>() == 80);
const _: () = assert!(offset_of!(Config, layout_version) == 20);
const _: () = assert!(offset_of!(Config, node_addr_be) == 24);
const _: () = assert!(offset_of!(Config, flags) == 28);
const _: () = assert!(offset_of!(Config, ct_udp_stream_s) == 40);
const _: () = assert!(offset_of!(Config, snat_port_min) == 44);
const _: () = assert!(offset_of!(Config, hairpin6_be) == 48);
const _: () = assert!(offset_of!(Config, node6_be) == 64);

impl Default for Config {
    /// Conntrack timeouts follow the kernel's conntrack and kube-proxy's
    /// settings of it: TCP unanswered 60 s (Cilium's; the kernel's SYN_SENT
    /// is 120 s), established 24 h and close-wait 1 h (kube-proxy's
    /// `tcpEstablishedTimeout`, `tcpCloseWaitTimeout`), time-wait 120 s and
    /// close 10 s, UDP 30 s and a UDP stream 120 s (the kernel's).
    /// SNAT ports 1024–32767: below the kernel's default
    /// `ip_local_port_range` (32768–60999).
    fn default() -> Self {
        Self {
            hairpin_addr_be: 0,
            ct_tcp_syn_s: 60,
            ct_tcp_established_s: 86_400,
            ct_tcp_closing_s: 10,
            ct_udp_s: 30,
            layout_version: MAP_LAYOUT_VERSION,
            node_addr_be: 0,
            flags: 0,
            ct_tcp_close_wait_s: 3_600,
            ct_tcp_time_wait_s: 120,
            ct_udp_stream_s: 120,
            snat_port_min: 1024,
            snat_port_max: 32767,
            hairpin6_be: [0; 4],
            node6_be: [0; 4],
        }
    }
}

impl Config {
    pub const fn with_hairpin_addr(mut self, addr: Ipv4Addr) -> Self {
        self.hairpin_addr_be = u32::from_ne_bytes(addr.octets());
        self
    }
    pub const fn with_hairpin6_addr(mut self, addr: Ipv6Addr) -> Self {
        self.hairpin6_be = ipv6::addr6(addr);
        self
    }
    pub const fn with_node6_addr(mut self, addr: Ipv6Addr) -> Self {
        self.node6_be = ipv6::addr6(addr);
        self
    }
    pub const fn with_node_addr(mut self, addr: Ipv4Addr) -> Self {
        self.node_addr_be = u32::from_ne_bytes(addr.octets());
        self
    }
    /// [`config_flags::DRAINING`] set or cleared.
    pub const fn with_draining(self, on: bool) -> Self {
        self.with_flag(config_flags::DRAINING, on)
    }
    /// [`config_flags::DELIVER_VIA_STACK`] set or cleared.
    pub const fn with_delivery_via_stack(self, on: bool) -> Self {
        self.with_flag(config_flags::DELIVER_VIA_STACK, on)
    }
    const fn with_flag(mut self, flag: u32, on: bool) -> Self {
        if on {
            self.flags |= flag;
        } else {
            self.flags &= !flag;
        }
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

// Declared here, below the types, rather than with the modules above: the
// programs' debug info records the line numbers of the code above.
pub mod stat;

#[cfg(feature = "user")]
mod user;

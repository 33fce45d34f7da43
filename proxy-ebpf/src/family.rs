//! The address family as a type: what differs between IPv4 and IPv6 for the
//! code written once over both (backend selection, the conntrack liveness
//! checks and the SNAT port choice: the keys, maps and hash inputs of each
//! family). [`V4`] and [`V6`] are used as type parameters
//! only; every accessor is `#[inline(always)]`, so a generic function
//! compiles to the same code as its former per-family twin.

use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibParams, BPF_ANY},
    btf_maps::lpm_trie::Key as LpmKey,
};
use proxy_common::{
    conntrack::CtEntry,
    ipv6::{fold6, Addr6},
    Affinity4Key, Affinity6Key, AffinityValue, Backend4, Backend6, Config, Ct4Key, Ct4Value,
    Ct6Key, Ct6Value, RevNat4, RevNat6, RevNatId, SourceRange4, SourceRange6, Svc4Key, Svc6Key,
    SOURCE_RANGE_ID_BITS,
};

use crate::maps::{
    AFFINITY4_V2, AFFINITY6_V2, BACKEND4_V1, BACKEND6_V1, CT4_V2, CT6_V2, HANDOVER4_V1,
    HANDOVER6_V1, SNAT_FULL4_V1, SNAT_FULL6_V1, SRCRANGE4_V2, SRCRANGE6_V2, SVC4_V2, SVC6_V2,
};
use crate::{conntrack::Flow, parse::Packet, parse6::Packet6};

/// IPv4 (and IPv6 sockets to IPv4-mapped addresses, in the socket hooks).
#[derive(Clone, Copy, Default)]
pub struct V4;
/// IPv6.
#[derive(Clone, Copy, Default)]
pub struct V6;

/// An address family's keys and maps.
pub trait Family {
    /// An address, network order.
    type Addr: Copy + Default + PartialEq;
    /// The services-map key (a frontend at slot 0, its backends at
    /// 1..=count).
    type SvcKey;
    /// A backend's address and port.
    type Backend: Copy + Default;
    /// A parsed packet.
    type Packet: FlowPacket<Self::Addr>;

    /// `addr` as the 32 bits the flow and source hashes take (IPv6: its
    /// four words folded).
    fn fold(addr: &Self::Addr) -> u32;
    /// The services-map key of the frontend `pkt` is sent to, in `scope`
    /// (slot 0).
    fn frontend_key(pkt: &Self::Packet, scope: u8) -> Self::SvcKey;
    /// The backend id in `slot` of the frontend at `key`.
    fn slot_backend(key: &Self::SvcKey, slot: u16) -> Option<u32>;
    /// The backend with id `id`.
    fn backend(id: u32) -> Option<Self::Backend>;
    /// `client`'s session affinity entry for the frontend `rev_nat_id`.
    fn affinity(client: &Self::Addr, rev_nat_id: RevNatId) -> Option<*mut AffinityValue>;
    /// Writes `client`'s session affinity entry for the frontend `rev_nat_id`.
    fn set_affinity(client: &Self::Addr, rev_nat_id: RevNatId, v: &AffinityValue);
    /// Whether `client` may open flows to the frontend `rev_nat_id` (its
    /// `loadBalancerSourceRanges`).
    fn source_allowed(rev_nat_id: RevNatId, client: &Self::Addr) -> bool;
    /// A backend's address.
    fn backend_addr(b: &Self::Backend) -> Self::Addr;
    /// A backend's port.
    fn backend_port(b: &Self::Backend) -> u16;
    /// A backend's [`proxy_common::backend_state`].
    fn backend_state(b: &Self::Backend) -> u8;
    /// The family's `AF_*` number (`bpf_fib_lookup`'s `family`).
    const AF: u8;
    /// Writes `saddr` and `daddr` into FIB lookup parameters `p`.
    fn fib_addrs(p: &mut FibParams, saddr: &Self::Addr, daddr: &Self::Addr);
    /// The node's own address in this family (unset: the default, zero).
    fn node_addr(cfg: &Config) -> Self::Addr;
    /// The source address of hairpin flows in this family (unset: zero).
    fn hairpin_addr(cfg: &Config) -> Self::Addr;

    /// A conntrack key (either direction).
    type CtKey: Copy;
    /// A conntrack entry.
    type CtValue: CtEntry + Copy;
    /// The frontend replies of a reverse-NAT id come from.
    type RevNat;

    /// The source address a SNATed flow's entry `v` gives it (meaningful
    /// under [`proxy_common::ct_flags::SNAT_ADDR`]).
    fn ct_nat_addr(v: &Self::CtValue) -> Self::Addr;
    /// The source port a SNATed flow's entry `v` gives it (meaningful under
    /// [`proxy_common::ct_flags::SNAT_PORT`]).
    fn ct_nat_port(v: &Self::CtValue) -> u16;
    /// Writes the state `flags` and the last-seen time `now` of entry `c`.
    fn ct_refresh(c: &mut Self::CtValue, flags: u16, now: u64);
    /// The REPLY key of a flow of `proto`: `backend` answering the client
    /// as the backend sees it.
    fn reply_key(
        proto: u8,
        backend: &Self::Backend,
        client_addr: Self::Addr,
        client_port_be: u16,
    ) -> Self::CtKey;
    /// The packet's conntrack key in direction `dir` (its tuple as sent).
    fn pkt_ct_key(pkt: &Self::Packet, dir: u8) -> Self::CtKey;
    /// The SERVICE entry of new flow `flow` to frontend `rev_nat_id`.
    fn service_entry(flow: &Flow<Self>, rev_nat_id: RevNatId, now: u64) -> Self::CtValue
    where
        Self: Sized;
    /// The REPLY entry of a flow (`Ct4Value::reply_of`).
    fn reply_entry(
        backend_id: u32,
        rev_nat_id: RevNatId,
        flags: u16,
        client_addr: Self::Addr,
        client_port_be: u16,
        now: u64,
    ) -> Self::CtValue;
    /// Writes the conntrack entry `v` at `key` (`flags`: `BPF_ANY`,
    /// `BPF_NOEXIST`).
    fn ct_insert(key: &Self::CtKey, v: &Self::CtValue, flags: u64) -> Result<(), i32>;
    /// The conntrack entry of the packet's tuple in direction `dir`.
    fn ct_of_packet(pkt: &Self::Packet, dir: u8) -> Option<*mut Self::CtValue>;
    /// The conntrack entry at `key`.
    fn ct(key: &Self::CtKey) -> Option<*mut Self::CtValue>;
    /// The frontend replies of reverse-NAT id `id` come from
    /// ([`crate::lb::rev_nat`], [`crate::ipv6::rev_nat`]).
    fn rev_nat(id: RevNatId) -> Option<Self::RevNat>;
    /// The SERVICE key of the flow whose REPLY entry `e` is at `rkey`, to
    /// the frontend `rev`.
    fn service_of_reply(rkey: &Self::CtKey, e: &Self::CtValue, rev: &Self::RevNat) -> Self::CtKey;
    /// The address replies from the frontend `rev` come from.
    fn rev_addr(rev: &Self::RevNat) -> Self::Addr;
    /// The port replies from the frontend `rev` come from.
    fn rev_port(rev: &Self::RevNat) -> u16;
    /// The protocol of the flow at `key`.
    fn ct_proto(key: &Self::CtKey) -> u8;
    /// Sets the destination port of `key` (a REPLY key's: the node's
    /// source port the backend sees).
    fn set_dport(key: &mut Self::CtKey, port_be: u16);
    /// The handover entry at `key` ([`crate::maps::HANDOVER4_V1`]).
    fn handover(key: &Self::CtKey) -> Option<*mut u64>;
    /// Writes the handover entry at `key`: passed to the stack until `until`.
    fn set_handover(key: &Self::CtKey, until: u64);
    /// When a search found the SNAT port space of `space` (a REPLY key with
    /// port 0) full ([`crate::maps::SNAT_FULL4_V1`]).
    fn snat_full(space: &Self::CtKey) -> Option<*const u64>;
    /// Records that a search found the SNAT port space of `space` full at
    /// `now`.
    fn set_snat_full(space: &Self::CtKey, now: u64);
}

/// What the conntrack code reads of a parsed packet of either family.
pub trait FlowPacket<A> {
    fn proto(&self) -> u8;
    /// TCP's header flags (SCTP's first chunk as TCP flags).
    fn tcp_flags(&self) -> u8;
    /// Whether the packet carries its L4 header (not a later fragment):
    /// only those move a flow's state.
    fn l4_present(&self) -> bool;
    fn saddr(&self) -> &A;
    fn daddr(&self) -> &A;
    fn sport_be(&self) -> u16;
    fn dport_be(&self) -> u16;
}

/// What backend selection reads of a flow: its 5-tuple, the addresses by
/// reference (an IPv6 address is 16 bytes of the caller's).
pub struct FiveTuple<'a, F: Family> {
    pub saddr: &'a F::Addr,
    pub daddr: &'a F::Addr,
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
}

/// The 5-tuple of `pkt` ([`FiveTuple`]).
#[inline(always)]
pub fn five_tuple<F: Family>(pkt: &F::Packet) -> FiveTuple<'_, F> {
    FiveTuple {
        saddr: pkt.saddr(),
        daddr: pkt.daddr(),
        sport_be: pkt.sport_be(),
        dport_be: pkt.dport_be(),
        proto: pkt.proto(),
    }
}

/// The [`Family`] accessors whose bodies are the same for both families'
/// types (conntrack key, entry, reverse NAT, address, backend, packet,
/// services-map key).
macro_rules! conntrack_accessors {
    ($key:ty, $value:ty, $rev:ty, $addr:ty, $backend:ty, $packet:ty, $svc:ident) => {
        #[inline(always)]
        fn frontend_key(pkt: &$packet, scope: u8) -> $svc {
            $svc {
                addr_be: pkt.daddr_be,
                port_be: pkt.dport_be,
                slot: 0,
                proto: pkt.proto,
                scope,
                _pad: [0; 2],
            }
        }

        #[inline(always)]
        fn ct_nat_addr(v: &$value) -> $addr {
            v.nat_addr_be
        }

        #[inline(always)]
        fn ct_nat_port(v: &$value) -> u16 {
            v.nat_port_be
        }

        #[inline(always)]
        fn ct_refresh(c: &mut $value, flags: u16, now: u64) {
            c.flags = flags;
            c.last_seen_ns = now;
        }

        #[inline(always)]
        fn reply_key(proto: u8, b: &$backend, client_addr: $addr, client_port_be: u16) -> $key {
            <$key>::reply(proto, b.addr_be, b.port_be, client_addr, client_port_be)
        }

        #[inline(always)]
        fn pkt_ct_key(pkt: &$packet, dir: u8) -> $key {
            pkt.ct_key(dir)
        }

        #[inline(always)]
        fn service_of_reply(rkey: &$key, e: &$value, rev: &$rev) -> $key {
            rkey.service_of_reply(e, rev)
        }

        #[inline(always)]
        fn ct_proto(key: &$key) -> u8 {
            key.proto
        }

        #[inline(always)]
        fn rev_addr(rev: &$rev) -> $addr {
            rev.addr_be
        }

        #[inline(always)]
        fn rev_port(rev: &$rev) -> u16 {
            rev.port_be
        }

        #[inline(always)]
        fn backend_addr(b: &$backend) -> $addr {
            b.addr_be
        }

        #[inline(always)]
        fn backend_port(b: &$backend) -> u16 {
            b.port_be
        }

        #[inline(always)]
        fn backend_state(b: &$backend) -> u8 {
            b.state
        }

        #[inline(always)]
        fn set_dport(key: &mut $key, port_be: u16) {
            key.dport_be = port_be;
        }
    };
}

/// The [`Family`] accessors of the maps whose bodies are the same for both
/// families but for the map and type names.
macro_rules! map_accessors {
    (
        $svc_map:ident, $svc:ty, $backend_map:ident, $backend:ty,
        $affinity_map:ident, $affinity_key:ident, $addr:ty,
        $ct_map:ident, $value:ty, $packet:ty
    ) => {
        #[inline(always)]
        fn slot_backend(key: &$svc, slot: u16) -> Option<u32> {
            $svc_map
                .get_ptr(key.with_slot(slot))
                // SAFETY: map value pointer, read once.
                .map(|sv| unsafe { (*sv).backend_id })
        }

        #[inline(always)]
        fn backend(id: u32) -> Option<$backend> {
            // SAFETY: map value pointer, copied.
            $backend_map.get_ptr(id).map(|b| unsafe { *b })
        }

        #[inline(always)]
        fn affinity(client: &$addr, rev_nat_id: RevNatId) -> Option<*mut AffinityValue> {
            $affinity_map.get_ptr_mut($affinity_key {
                client_be: *client,
                rev_nat_id,
            })
        }

        #[inline(always)]
        fn set_affinity(client: &$addr, rev_nat_id: RevNatId, v: &AffinityValue) {
            let key = $affinity_key {
                client_be: *client,
                rev_nat_id,
            };
            let _ = $affinity_map.insert(key, *v, BPF_ANY as u64);
        }

        #[inline(always)]
        fn reply_entry(
            backend_id: u32,
            rev_nat_id: RevNatId,
            flags: u16,
            client_addr: $addr,
            client_port_be: u16,
            now: u64,
        ) -> $value {
            <$value>::reply_of(
                backend_id,
                rev_nat_id,
                flags,
                client_addr,
                client_port_be,
                now,
            )
        }

        #[inline(always)]
        fn ct_of_packet(pkt: &$packet, dir: u8) -> Option<*mut $value> {
            $ct_map.get_ptr_mut(pkt.ct_key(dir))
        }
    };
}

impl Family for V4 {
    /// `AF_INET`.
    const AF: u8 = 2;
    type Addr = u32;
    type SvcKey = Svc4Key;
    type Backend = Backend4;
    type Packet = Packet;

    #[inline(always)]
    fn fold(addr: &u32) -> u32 {
        *addr
    }

    #[inline(always)]
    fn source_allowed(rev_nat_id: RevNatId, client: &u32) -> bool {
        let key = LpmKey {
            prefix_len: SOURCE_RANGE_ID_BITS + 32,
            data: SourceRange4 {
                rev_nat_id_be: rev_nat_id.to_be(),
                addr_be: *client,
            },
        };
        SRCRANGE4_V2.get(&key).is_some()
    }

    type CtKey = Ct4Key;
    type CtValue = Ct4Value;
    type RevNat = RevNat4;

    conntrack_accessors!(Ct4Key, Ct4Value, RevNat4, u32, Backend4, Packet, Svc4Key);
    map_accessors!(
        SVC4_V2,
        Svc4Key,
        BACKEND4_V1,
        Backend4,
        AFFINITY4_V2,
        Affinity4Key,
        u32,
        CT4_V2,
        Ct4Value,
        Packet
    );

    #[inline(always)]
    fn service_entry(flow: &Flow<V4>, rev_nat_id: RevNatId, now: u64) -> Ct4Value {
        Ct4Value {
            backend_id: flow.backend_id,
            nat_addr_be: flow.nat_addr_be,
            rev_nat_id,
            flags: flow.flags,
            nat_port_be: flow.nat_port_be,
            last_seen_ns: now,
        }
    }

    #[inline(always)]
    fn ct_insert(key: &Ct4Key, v: &Ct4Value, flags: u64) -> Result<(), i32> {
        CT4_V2.insert(*key, *v, flags)
    }

    #[inline(always)]
    fn ct(key: &Ct4Key) -> Option<*mut Ct4Value> {
        CT4_V2.get_ptr_mut(*key)
    }

    #[inline(always)]
    fn rev_nat(id: RevNatId) -> Option<RevNat4> {
        crate::lb::rev_nat(id)
    }

    #[inline(always)]
    fn handover(key: &Ct4Key) -> Option<*mut u64> {
        HANDOVER4_V1.get_ptr_mut(key)
    }

    #[inline(always)]
    fn set_handover(key: &Ct4Key, until: u64) {
        let _ = HANDOVER4_V1.insert(key, until, 0);
    }

    #[inline(always)]
    fn fib_addrs(p: &mut FibParams, saddr: &u32, daddr: &u32) {
        p.__bindgen_anon_3.ipv4_src = *saddr;
        p.__bindgen_anon_4.ipv4_dst = *daddr;
    }

    #[inline(always)]
    fn node_addr(cfg: &Config) -> u32 {
        cfg.node_addr_be
    }

    #[inline(always)]
    fn hairpin_addr(cfg: &Config) -> u32 {
        cfg.hairpin_addr_be
    }

    #[inline(always)]
    fn snat_full(space: &Ct4Key) -> Option<*const u64> {
        SNAT_FULL4_V1.get_ptr(*space)
    }

    #[inline(always)]
    fn set_snat_full(space: &Ct4Key, now: u64) {
        let _ = SNAT_FULL4_V1.insert(*space, now, BPF_ANY as u64);
    }
}

impl Family for V6 {
    const AF: u8 = crate::parse6::AF_INET6;
    type Addr = Addr6;
    type SvcKey = Svc6Key;
    type Backend = Backend6;
    type Packet = Packet6;

    #[inline(always)]
    fn fold(addr: &Addr6) -> u32 {
        fold6(addr)
    }

    #[inline(always)]
    fn source_allowed(rev_nat_id: RevNatId, client: &Addr6) -> bool {
        let key = LpmKey {
            prefix_len: SOURCE_RANGE_ID_BITS + 128,
            data: SourceRange6 {
                rev_nat_id_be: rev_nat_id.to_be(),
                addr_be: *client,
            },
        };
        SRCRANGE6_V2.get(&key).is_some()
    }

    type CtKey = Ct6Key;
    type CtValue = Ct6Value;
    type RevNat = RevNat6;

    conntrack_accessors!(Ct6Key, Ct6Value, RevNat6, Addr6, Backend6, Packet6, Svc6Key);
    map_accessors!(
        SVC6_V2,
        Svc6Key,
        BACKEND6_V1,
        Backend6,
        AFFINITY6_V2,
        Affinity6Key,
        Addr6,
        CT6_V2,
        Ct6Value,
        Packet6
    );

    #[inline(always)]
    fn service_entry(flow: &Flow<V6>, rev_nat_id: RevNatId, now: u64) -> Ct6Value {
        Ct6Value {
            backend_id: flow.backend_id,
            rev_nat_id,
            flags: flow.flags,
            nat_port_be: flow.nat_port_be,
            nat_addr_be: flow.nat_addr_be,
            _pad2: 0,
            last_seen_ns: now,
        }
    }

    #[inline(always)]
    fn ct_insert(key: &Ct6Key, v: &Ct6Value, flags: u64) -> Result<(), i32> {
        CT6_V2.insert(key, v, flags)
    }

    #[inline(always)]
    fn ct(key: &Ct6Key) -> Option<*mut Ct6Value> {
        CT6_V2.get_ptr_mut(key)
    }

    #[inline(always)]
    fn rev_nat(id: RevNatId) -> Option<RevNat6> {
        crate::ipv6::rev_nat(id)
    }

    #[inline(always)]
    fn handover(key: &Ct6Key) -> Option<*mut u64> {
        HANDOVER6_V1.get_ptr_mut(key)
    }

    // By reference, as the IPv6 path passed it (see `ipv6.rs`).
    #[allow(clippy::needless_borrows_for_generic_args)]
    #[inline(always)]
    fn set_handover(key: &Ct6Key, until: u64) {
        let _ = HANDOVER6_V1.insert(key, &until, 0);
    }

    #[inline(always)]
    fn fib_addrs(p: &mut FibParams, saddr: &Addr6, daddr: &Addr6) {
        p.__bindgen_anon_3.ipv6_src = *saddr;
        p.__bindgen_anon_4.ipv6_dst = *daddr;
    }

    #[inline(always)]
    fn node_addr(cfg: &Config) -> Addr6 {
        cfg.node6_be
    }

    #[inline(always)]
    fn hairpin_addr(cfg: &Config) -> Addr6 {
        cfg.hairpin6_be
    }

    #[inline(always)]
    fn snat_full(space: &Ct6Key) -> Option<*const u64> {
        SNAT_FULL6_V1.get_ptr(space)
    }

    #[inline(always)]
    fn set_snat_full(space: &Ct6Key, now: u64) {
        let _ = SNAT_FULL6_V1.insert(space, now, BPF_ANY as u64);
    }
}

impl FlowPacket<u32> for Packet {
    #[inline(always)]
    fn proto(&self) -> u8 {
        self.proto
    }
    #[inline(always)]
    fn tcp_flags(&self) -> u8 {
        self.tcp_flags
    }
    #[inline(always)]
    fn l4_present(&self) -> bool {
        self.l4_present
    }
    #[inline(always)]
    fn saddr(&self) -> &u32 {
        &self.saddr_be
    }
    #[inline(always)]
    fn daddr(&self) -> &u32 {
        &self.daddr_be
    }
    #[inline(always)]
    fn sport_be(&self) -> u16 {
        self.sport_be
    }
    #[inline(always)]
    fn dport_be(&self) -> u16 {
        self.dport_be
    }
}

impl FlowPacket<Addr6> for Packet6 {
    #[inline(always)]
    fn proto(&self) -> u8 {
        self.proto
    }
    #[inline(always)]
    fn tcp_flags(&self) -> u8 {
        self.tcp_flags
    }
    #[inline(always)]
    fn l4_present(&self) -> bool {
        self.fragment != crate::parse6::FRAGMENT_LATER
    }
    #[inline(always)]
    fn saddr(&self) -> &Addr6 {
        &self.saddr_be
    }
    #[inline(always)]
    fn daddr(&self) -> &Addr6 {
        &self.daddr_be
    }
    #[inline(always)]
    fn sport_be(&self) -> u16 {
        self.sport_be
    }
    #[inline(always)]
    fn dport_be(&self) -> u16 {
        self.dport_be
    }
}

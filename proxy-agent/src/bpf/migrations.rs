//! Migrations of pinned maps from older layouts ([`super::Migration`]).
//!
//! Layout `_V2` widened the reverse-NAT id from 16 to 32 bits (a node may
//! have more than 65,535 frontends). Every map whose key or value holds one
//! got a new name; an agent that finds the `_V1` pins of an older agent
//! copies their entries, converted, into the `_V2` maps when it loads, and
//! copies the flow state (conntrack, socket reverse NAT) again just before
//! it attaches its programs, as the older programs keep writing it until
//! then. So established flows, session affinity, Maglev tables and the
//! programmed Services carry over an upgrade as they do over a restart;
//! affinity a client gained in between is not copied again (the writer may
//! have pruned the old entries of a backend that left), so it starts anew.
//!
//! The `_V1` types below are the old layouts, frozen: they must never change.
//! Reverse-NAT ids of `_V1` maps are all below 65,536, so every entry converts.

use aya::maps::{lpm_trie::Key as LpmKey, HashMap, LpmTrie, Map, MapData, MapError};
use proxy_common::{
    lb::{MaglevChunk, MaglevKey},
    map_names, Addr6, Affinity4Key, Affinity6Key, AffinityValue, Ct4Key, Ct4Value, Ct6Key,
    Ct6Value, RevNat4, RevNat6, RevNatId, SockRevNat4Key, SockRevNat4Value, SockRevNat6Key,
    SockRevNat6Value, SourceRange4, SourceRange6, Svc4Key, Svc6Key, SvcValue,
};

use super::Migration;

/// Every migration this agent knows: the `_V1` maps into the `_V2` ones.
pub const ALL: &[Migration] = &[
    Migration {
        from: "SVC4_V1",
        to: map_names::SERVICES,
        run: svc4,
        again_before_attach: false,
    },
    Migration {
        from: "SVC6_V1",
        to: map_names::SERVICES6,
        run: svc6,
        again_before_attach: false,
    },
    Migration {
        from: "REVNAT4_V1",
        to: map_names::REV_NAT,
        run: rev_nat4,
        again_before_attach: false,
    },
    Migration {
        from: "REVNAT6_V1",
        to: map_names::REV_NAT6,
        run: rev_nat6,
        again_before_attach: false,
    },
    Migration {
        from: "CT4_V1",
        to: map_names::CONNTRACK,
        run: ct4,
        again_before_attach: true,
    },
    Migration {
        from: "CT6_V1",
        to: map_names::CONNTRACK6,
        run: ct6,
        again_before_attach: true,
    },
    Migration {
        from: "AFFINITY4_V1",
        to: map_names::AFFINITY,
        run: affinity4,
        again_before_attach: false,
    },
    Migration {
        from: "AFFINITY6_V1",
        to: map_names::AFFINITY6,
        run: affinity6,
        again_before_attach: false,
    },
    Migration {
        from: "SOCK_REVNAT4_V1",
        to: map_names::SOCK_REVNAT,
        run: sock_rev_nat4,
        again_before_attach: true,
    },
    Migration {
        from: "SOCK_REVNAT6_V1",
        to: map_names::SOCK_REVNAT6,
        run: sock_rev_nat6,
        again_before_attach: true,
    },
    Migration {
        from: "SRCRANGE4_V1",
        to: map_names::SOURCE_RANGES,
        run: source_ranges4,
        again_before_attach: false,
    },
    Migration {
        from: "SRCRANGE6_V1",
        to: map_names::SOURCE_RANGES6,
        run: source_ranges6,
        again_before_attach: false,
    },
    Migration {
        from: "MAGLEV4_V1",
        to: map_names::MAGLEV,
        run: maglev,
        again_before_attach: false,
    },
];

/// `_V1` layouts (16-bit reverse-NAT ids), as the programs of an older agent
/// wrote them.
pub mod v1 {
    use super::Addr6;

    /// `SVC4_V1` / `SVC6_V1` value.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct SvcValue {
        pub backend_id: u32,
        pub count: u16,
        pub rev_nat_id: u16,
        pub flags: u16,
        pub maglev_size: u16,
        pub affinity_timeout_s: u32,
    }

    /// `CT4_V1` value.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Ct4Value {
        pub backend_id: u32,
        pub nat_addr_be: u32,
        pub rev_nat_id: u16,
        pub flags: u16,
        pub nat_port_be: u16,
        pub _pad: u16,
        pub last_seen_ns: u64,
    }

    /// `CT6_V1` value.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Ct6Value {
        pub backend_id: u32,
        pub rev_nat_id: u16,
        pub flags: u16,
        pub nat_port_be: u16,
        pub _pad: u16,
        pub nat_addr_be: Addr6,
        pub _pad2: u32,
        pub last_seen_ns: u64,
    }

    /// `AFFINITY4_V1` key.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Affinity4Key {
        pub client_be: u32,
        pub rev_nat_id: u16,
        pub _pad: u16,
    }

    /// `AFFINITY6_V1` key.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Affinity6Key {
        pub client_be: Addr6,
        pub rev_nat_id: u16,
        pub _pad: u16,
    }

    /// `SOCK_REVNAT4_V1` value.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct SockRevNat4Value {
        pub addr_be: u32,
        pub port_be: u16,
        pub rev_nat_id: u16,
    }

    /// `SOCK_REVNAT6_V1` value.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct SockRevNat6Value {
        pub addr_be: Addr6,
        pub port_be: u16,
        pub rev_nat_id: u16,
    }

    /// `SRCRANGE4_V1` key data.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct SourceRange4 {
        pub rev_nat_id_be: u16,
        pub _pad: u16,
        pub addr_be: u32,
    }

    /// `SRCRANGE6_V1` key data.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct SourceRange6 {
        pub rev_nat_id_be: u16,
        pub _pad: u16,
        pub addr_be: Addr6,
    }

    /// `MAGLEV4_V1` key.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct MaglevKey {
        pub rev_nat_id: u16,
        pub generation: u8,
        pub _pad: u8,
        pub chunk: u16,
        pub _pad2: u16,
    }

    const _: () = {
        use core::mem::size_of;
        assert!(size_of::<SvcValue>() == 16);
        assert!(size_of::<Ct4Value>() == 24);
        assert!(size_of::<Ct6Value>() == 40);
        assert!(size_of::<Affinity4Key>() == 8);
        assert!(size_of::<Affinity6Key>() == 20);
        assert!(size_of::<SockRevNat4Value>() == 8);
        assert!(size_of::<SockRevNat6Value>() == 20);
        assert!(size_of::<SourceRange4>() == 8);
        assert!(size_of::<SourceRange6>() == 20);
        assert!(size_of::<MaglevKey>() == 8);
    };

    // SAFETY: #[repr(C)], integers only, padded by hand (the `_V1` layout).
    unsafe impl aya::Pod for SvcValue {}
    // SAFETY: #[repr(C)], integers only, padded by hand (the `_V1` layout).
    unsafe impl aya::Pod for Ct4Value {}
    // SAFETY: #[repr(C)], integers only, padded by hand (the `_V1` layout).
    unsafe impl aya::Pod for Ct6Value {}
    // SAFETY: #[repr(C)], integers only, padded by hand (the `_V1` layout).
    unsafe impl aya::Pod for Affinity4Key {}
    // SAFETY: #[repr(C)], integers only, padded by hand (the `_V1` layout).
    unsafe impl aya::Pod for Affinity6Key {}
    // SAFETY: #[repr(C)], integers only, padded by hand (the `_V1` layout).
    unsafe impl aya::Pod for SockRevNat4Value {}
    // SAFETY: #[repr(C)], integers only, padded by hand (the `_V1` layout).
    unsafe impl aya::Pod for SockRevNat6Value {}
    // SAFETY: #[repr(C)], integers only, padded by hand (the `_V1` layout).
    unsafe impl aya::Pod for SourceRange4 {}
    // SAFETY: #[repr(C)], integers only, padded by hand (the `_V1` layout).
    unsafe impl aya::Pod for SourceRange6 {}
    // SAFETY: #[repr(C)], integers only, padded by hand (the `_V1` layout).
    unsafe impl aya::Pod for MaglevKey {}
}

fn svc_value(v: v1::SvcValue) -> SvcValue {
    SvcValue {
        backend_id: v.backend_id,
        rev_nat_id: RevNatId::from(v.rev_nat_id),
        count: v.count,
        flags: v.flags,
        maglev_size: v.maglev_size,
        _pad: 0,
        affinity_timeout_s: v.affinity_timeout_s,
    }
}

/// Copies every entry of the hash (or LRU hash) map `old` into `new`,
/// converted by `f`; returns how many were copied and how many the new map
/// refused (a smaller map: they are dropped, as a resize drops them; the
/// writer programs what the Services need at its first sync).
fn hash<K1: aya::Pod, V1: aya::Pod, K2: aya::Pod, V2: aya::Pod>(
    old: MapData,
    new: &mut Map,
    f: fn(K1, V1) -> (K2, V2),
) -> Result<(usize, usize), MapError> {
    let old: HashMap<MapData, K1, V1> = HashMap::try_from(Map::HashMap(old))?;
    let mut new: HashMap<&mut MapData, K2, V2> = HashMap::try_from(new)?;
    let (mut copied, mut dropped) = (0, 0);
    for kv in old.iter() {
        let (k, v) = kv?;
        let (k, v) = f(k, v);
        match new.insert(k, v, 0) {
            Ok(()) => copied += 1,
            Err(_) => dropped += 1,
        }
    }
    Ok((copied, dropped))
}

/// [`hash`] for LPM tries (`loadBalancerSourceRanges`): the prefix length
/// stays (it counts 32 bits before the address in both layouts).
fn lpm<K1: aya::Pod, K2: aya::Pod>(
    old: MapData,
    new: &mut Map,
    f: fn(K1) -> K2,
) -> Result<(usize, usize), MapError> {
    let old: LpmTrie<MapData, K1, u8> = LpmTrie::try_from(Map::LpmTrie(old))?;
    let mut new: LpmTrie<&mut MapData, K2, u8> = LpmTrie::try_from(new)?;
    let (mut copied, mut dropped) = (0, 0);
    for kv in old.iter() {
        let (k, v) = kv?;
        match new.insert(&LpmKey::new(k.prefix_len(), f(k.data())), v, 0) {
            Ok(()) => copied += 1,
            Err(_) => dropped += 1,
        }
    }
    Ok((copied, dropped))
}

fn svc4(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    hash(old, new, |k: Svc4Key, v: v1::SvcValue| (k, svc_value(v)))
}

fn svc6(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    hash(old, new, |k: Svc6Key, v: v1::SvcValue| (k, svc_value(v)))
}

fn rev_nat4(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    hash(old, new, |id: u16, v: RevNat4| (RevNatId::from(id), v))
}

fn rev_nat6(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    hash(old, new, |id: u16, v: RevNat6| (RevNatId::from(id), v))
}

fn ct4(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    hash(old, new, |k: Ct4Key, v: v1::Ct4Value| {
        let v = Ct4Value {
            backend_id: v.backend_id,
            nat_addr_be: v.nat_addr_be,
            rev_nat_id: RevNatId::from(v.rev_nat_id),
            flags: v.flags,
            nat_port_be: v.nat_port_be,
            last_seen_ns: v.last_seen_ns,
        };
        (k, v)
    })
}

fn ct6(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    hash(old, new, |k: Ct6Key, v: v1::Ct6Value| {
        let v = Ct6Value {
            backend_id: v.backend_id,
            rev_nat_id: RevNatId::from(v.rev_nat_id),
            flags: v.flags,
            nat_port_be: v.nat_port_be,
            nat_addr_be: v.nat_addr_be,
            _pad2: 0,
            last_seen_ns: v.last_seen_ns,
        };
        (k, v)
    })
}

fn affinity4(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    hash(old, new, |k: v1::Affinity4Key, v: AffinityValue| {
        let k = Affinity4Key {
            client_be: k.client_be,
            rev_nat_id: RevNatId::from(k.rev_nat_id),
        };
        (k, v)
    })
}

fn affinity6(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    hash(old, new, |k: v1::Affinity6Key, v: AffinityValue| {
        let k = Affinity6Key {
            client_be: k.client_be,
            rev_nat_id: RevNatId::from(k.rev_nat_id),
        };
        (k, v)
    })
}

fn sock_rev_nat4(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    hash(old, new, |k: SockRevNat4Key, v: v1::SockRevNat4Value| {
        let v = SockRevNat4Value {
            addr_be: v.addr_be,
            port_be: v.port_be,
            _pad: 0,
            rev_nat_id: RevNatId::from(v.rev_nat_id),
        };
        (k, v)
    })
}

fn sock_rev_nat6(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    hash(old, new, |k: SockRevNat6Key, v: v1::SockRevNat6Value| {
        let v = SockRevNat6Value {
            addr_be: v.addr_be,
            port_be: v.port_be,
            _pad: 0,
            rev_nat_id: RevNatId::from(v.rev_nat_id),
        };
        (k, v)
    })
}

fn source_ranges4(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    lpm(old, new, |k: v1::SourceRange4| SourceRange4 {
        rev_nat_id_be: RevNatId::from(u16::from_be(k.rev_nat_id_be)).to_be(),
        addr_be: k.addr_be,
    })
}

fn source_ranges6(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    lpm(old, new, |k: v1::SourceRange6| SourceRange6 {
        rev_nat_id_be: RevNatId::from(u16::from_be(k.rev_nat_id_be)).to_be(),
        addr_be: k.addr_be,
    })
}

fn maglev(old: MapData, new: &mut Map) -> Result<(usize, usize), MapError> {
    hash(old, new, |k: v1::MaglevKey, v: MaglevChunk| {
        (
            MaglevKey::new(RevNatId::from(k.rev_nat_id), k.generation, k.chunk),
            v,
        )
    })
}

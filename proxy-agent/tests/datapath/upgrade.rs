//! Upgrades across map layouts: an agent of layout `_V2` (32-bit reverse-NAT
//! ids) started over the pins of a `_V1` agent (16-bit ids) migrates their
//! entries before its programs run, and the flow state again just before it
//! attaches them, so established flows, session affinity, source ranges and
//! the programmed Services carry over.
//!
//! The pinned maps of an earlier run in general, too: a map of an older
//! layout migrated (one with no migration dropped), and pinned maps checked
//! on adoption, a changed size taking effect.
//!
//! Why one file (about 850 lines): every test here pins maps as another
//! agent or another configuration left them and loads this build over
//! them; they make such maps one way (`create_map`, under `pin_map` and
//! `create_hash_map`), and the `_V1` upgrade is the main use of the
//! migrations the older-layout test checks on its own.

use std::{mem::size_of, net::Ipv4Addr, path::Path};

use aya::maps::{lpm_trie::Key as LpmKey, HashMap, LpmTrie, Map, MapData};
use proxy_agent::{
    bpf::{migrations::v1, MapSizes},
    model::{DesiredState, Frontend},
};
use proxy_common::{
    lb::{MaglevChunk, MaglevKey},
    map_names, stat, svc_flags, Affinity4Key, Affinity6Key, AffinityValue, Backend4, Ct4Key,
    Ct4Value, Ct6Key, Ct6Value, RevNat4, RevNat6, SockRevNat4Key, SockRevNat4Value, SockRevNat6Key,
    SockRevNat6Value, SourceRange4, SourceRange6, Svc4Key, Svc6Key, SvcValue, IPPROTO_TCP,
};

use super::{B1, B2, CLIENT, VIP};
use proxy_testkit::kit::frame::tcp;
use proxy_testkit::kit::{
    check::parse_checked,
    frame::{tcp4, ACK, PSH, SYN},
    harness::{be, fe, Harness, PinDir, TC_ACT_SHOT},
};

const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_MAP_TYPE_LRU_HASH: u32 = 9;
const BPF_MAP_TYPE_LPM_TRIE: u32 = 11;
const BPF_F_NO_PREALLOC: u32 = 1;

/// Creates a map as an older agent's object would have and pins it at `path`.
fn pin_map(path: &Path, map_type: u32, key_size: u32, value_size: u32, flags: u32) -> MapData {
    let fd = create_map(map_type, key_size, value_size, 4096, flags);
    let data = MapData::from_fd(fd).expect("map data");
    data.pin(path).expect("pin");
    data
}

/// Pins a `_V1` hash (or LRU hash) map `name` in `dir` holding `entries`.
fn pin_v1<K: aya::Pod, V: aya::Pod>(dir: &Path, name: &str, lru: bool, entries: &[(K, V)]) {
    let map_type = if lru {
        BPF_MAP_TYPE_LRU_HASH
    } else {
        BPF_MAP_TYPE_HASH
    };
    let data = pin_map(
        &dir.join(name),
        map_type,
        size_of::<K>() as u32,
        size_of::<V>() as u32,
        0,
    );
    let mut m: HashMap<MapData, K, V> = HashMap::try_from(Map::HashMap(data)).unwrap();
    for (k, v) in entries {
        m.insert(k, v, 0).expect("insert into the old map");
    }
}

/// The entries of the pinned hash map `name` of `dir`; the pin is removed
/// (the map of the current layout goes, as it would not exist yet).
fn take_v2<K: aya::Pod, V: aya::Pod>(dir: &Path, name: &str) -> Vec<(K, V)> {
    let data = MapData::from_pin(dir.join(name)).expect("current map pinned");
    let m: HashMap<MapData, K, V> = HashMap::try_from(Map::HashMap(data)).unwrap();
    let out = m.iter().map(|kv| kv.expect("entry")).collect();
    std::fs::remove_file(dir.join(name)).unwrap();
    out
}

/// The entries of the pinned hash map `name` of `dir`.
fn entries<K: aya::Pod, V: aya::Pod>(dir: &Path, name: &str) -> Vec<(K, V)> {
    let data = MapData::from_pin(dir.join(name)).expect("current map pinned");
    let m: HashMap<MapData, K, V> = HashMap::try_from(Map::HashMap(data)).unwrap();
    m.iter().map(|kv| kv.expect("entry")).collect()
}

fn rev16(id: u32) -> u16 {
    u16::try_from(id).expect("a _V1 agent's ids are below 65,536")
}

/// Turns the `_V2` maps of `dir` that hold reverse-NAT ids (IPv4) into the
/// `_V1` pins an agent of the old layout would have left with the same
/// entries.
fn downgrade_ipv4(dir: &Path) {
    let services = take_v2::<Svc4Key, SvcValue>(dir, map_names::SERVICES);
    let services: Vec<_> = services
        .into_iter()
        .map(|(k, v)| {
            let old = v1::SvcValue {
                backend_id: v.backend_id,
                count: v.count,
                rev_nat_id: rev16(v.rev_nat_id),
                flags: v.flags,
                maglev_size: v.maglev_size,
                affinity_timeout_s: v.affinity_timeout_s,
            };
            (k, old)
        })
        .collect();
    pin_v1(dir, "SVC4_V1", false, &services);

    let rev_nat = take_v2::<u32, RevNat4>(dir, map_names::REV_NAT);
    let rev_nat: Vec<_> = rev_nat.into_iter().map(|(id, r)| (rev16(id), r)).collect();
    pin_v1(dir, "REVNAT4_V1", false, &rev_nat);

    let ct = take_v2::<Ct4Key, Ct4Value>(dir, map_names::CONNTRACK);
    let ct: Vec<_> = ct
        .into_iter()
        .map(|(k, v)| {
            let old = v1::Ct4Value {
                backend_id: v.backend_id,
                nat_addr_be: v.nat_addr_be,
                rev_nat_id: rev16(v.rev_nat_id),
                flags: v.flags,
                nat_port_be: v.nat_port_be,
                _pad: 0,
                last_seen_ns: v.last_seen_ns,
            };
            (k, old)
        })
        .collect();
    pin_v1(dir, "CT4_V1", true, &ct);

    let affinity = take_v2::<Affinity4Key, AffinityValue>(dir, map_names::AFFINITY);
    let affinity: Vec<_> = affinity
        .into_iter()
        .map(|(k, v)| {
            let old = v1::Affinity4Key {
                client_be: k.client_be,
                rev_nat_id: rev16(k.rev_nat_id),
                _pad: 0,
            };
            (old, v)
        })
        .collect();
    pin_v1(dir, "AFFINITY4_V1", true, &affinity);

    let path = dir.join(map_names::SOURCE_RANGES);
    let ranges: Vec<(LpmKey<SourceRange4>, u8)> = {
        let data = MapData::from_pin(&path).unwrap();
        let m: LpmTrie<MapData, SourceRange4, u8> = LpmTrie::try_from(Map::LpmTrie(data)).unwrap();
        m.iter().map(|kv| kv.expect("entry")).collect()
    };
    std::fs::remove_file(&path).unwrap();
    let data = pin_map(
        &dir.join("SRCRANGE4_V1"),
        BPF_MAP_TYPE_LPM_TRIE,
        4 + 8,
        1,
        BPF_F_NO_PREALLOC,
    );
    let mut old: LpmTrie<MapData, v1::SourceRange4, u8> =
        LpmTrie::try_from(Map::LpmTrie(data)).unwrap();
    for (k, v) in ranges {
        let d = k.data();
        let data = v1::SourceRange4 {
            rev_nat_id_be: rev16(u32::from_be(d.rev_nat_id_be)).to_be(),
            _pad: 0,
            addr_be: d.addr_be,
        };
        old.insert(&LpmKey::new(k.prefix_len(), data), v, 0)
            .unwrap();
    }
}

/// The pins of `dir` whose names end in `_V1` and hold reverse-NAT ids.
fn v1_pins(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            n.ends_with("_V1")
                && [
                    "SVC",
                    "REVNAT",
                    "CT",
                    "AFFINITY",
                    "SRCRANGE",
                    "SOCK_REVNAT",
                    "MAGLEV",
                ]
                .iter()
                .any(|p| n.starts_with(p))
        })
        .collect()
}

/// An agent of the `_V2` layout started over the pins of a `_V1` agent
/// (16-bit reverse-NAT ids): before any sync, established flows' next
/// segments and replies are translated as before (none is tracked anew),
/// also a flow the older programs opened between the load and the attach
/// (copied again then), a client's session affinity holds, source ranges
/// still filter, and the writer adopts every frontend with its reverse-NAT
/// id (its first sync adds nothing). The old pins stay until the attach.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn an_upgrade_from_16_bit_reverse_nat_ids_keeps_flows_affinity_and_source_ranges() {
    const LB: Ipv4Addr = Ipv4Addr::new(198, 18, 9, 1);
    let allowed = Ipv4Addr::new(198, 18, 4, 7);
    let mut d = DesiredState::default();
    d.frontends.insert(
        fe(VIP, 80, IPPROTO_TCP),
        Frontend {
            service: "default/sticky".into(),
            backends: vec![be(B1, 8080, IPPROTO_TCP), be(B2, 8080, IPPROTO_TCP)],
            affinity_timeout_s: 600,
            ..Default::default()
        },
    );
    d.frontends.insert(
        fe(LB, 80, IPPROTO_TCP),
        Frontend {
            service: "default/lb".into(),
            backends: vec![be(B1, 8080, IPPROTO_TCP)],
            flags: svc_flags::SOURCE_RANGES,
            source_ranges: vec![(Ipv4Addr::new(198, 18, 4, 0).into(), 24)],
            ..Default::default()
        },
    );
    let mut h = Harness::new();
    h.sync_desired(&d);
    let (_, out) = h.run(&tcp4(CLIENT, 40000, VIP, 80, SYN, b""));
    let chosen = parse_checked(&out).dst;
    assert!(chosen == B1 || chosen == B2, "translated to a backend");
    // A second flow of the client (to the same backend: affinity).
    let (_, out) = h.run(&tcp4(CLIENT, 40001, VIP, 80, SYN, b""));
    assert_eq!(parse_checked(&out).dst, chosen);
    let ids = h.writer.rev_nat_ids().clone();
    assert_eq!(ids.len(), 2);
    let chosen_id = entries::<u32, Backend4>(h.pin_dir(), map_names::BACKENDS)
        .into_iter()
        .find(|(_, b)| b.addr() == chosen)
        .map(|(id, _)| id)
        .expect("the chosen backend's entry");

    downgrade_ipv4(h.pin_dir());
    assert_eq!(v1_pins(h.pin_dir()).len(), 5, "the old agent's pins");
    h.reload().expect("the new agent loads over the old pins");
    assert_eq!(
        v1_pins(h.pin_dir()).len(),
        5,
        "the old pins stay until the programs are attached"
    );
    // The second flow as if the older programs had opened it after the
    // load: in the old conntrack map only.
    let ct_path = h.pin_dir().join(map_names::CONNTRACK);
    let mut ct: HashMap<MapData, Ct4Key, Ct4Value> =
        HashMap::try_from(Map::HashMap(MapData::from_pin(&ct_path).unwrap())).unwrap();
    let second: Vec<Ct4Key> = ct
        .keys()
        .map(|k| k.unwrap())
        .filter(|k| k.sport_be == 40001u16.to_be() || k.dport_be == 40001u16.to_be())
        .collect();
    assert_eq!(second.len(), 2, "its SERVICE and REPLY entries");
    for k in &second {
        ct.remove(k).unwrap();
    }
    h.finish_migrations();
    assert_eq!(
        v1_pins(h.pin_dir()),
        Vec::<String>::new(),
        "old pins removed once the programs would be attached"
    );
    assert_eq!(
        h.writer.rev_nat_ids(),
        &ids,
        "every frontend adopted with its id"
    );
    // The flows go on: their next segments to the same backend, their
    // replies from the frontend, none tracked anew.
    let midstream = |h: &Harness| h.stats().get(&stat::CT_NEW_MIDSTREAM).copied().unwrap_or(0);
    let midstream_before = midstream(&h);
    for sport in [40000, 40001] {
        let (_, out) = h.run(&tcp4(CLIENT, sport, VIP, 80, ACK | PSH, b"more"));
        assert_eq!(
            parse_checked(&out).dst,
            chosen,
            "flow {sport} kept its backend"
        );
        let (_, out) = h.run(&tcp(chosen, 8080, CLIENT, sport, ACK, b"answer"));
        let reply = parse_checked(&out);
        assert_eq!(
            (reply.src, reply.sport),
            (VIP.into(), 80),
            "reverse NAT of flow {sport}'s reply"
        );
    }
    assert_eq!(midstream(&h), midstream_before, "no flow tracked anew");
    // Session affinity: the client's entry carried over, naming its
    // backend, and its new connections go there.
    let affinity = entries::<Affinity4Key, AffinityValue>(h.pin_dir(), map_names::AFFINITY);
    let vip_id = ids[&fe(VIP, 80, IPPROTO_TCP)];
    assert_eq!(
        affinity
            .iter()
            .filter(|(k, _)| k.rev_nat_id == vip_id)
            .map(|(k, v)| (k.client_be, v.backend_id))
            .collect::<Vec<_>>(),
        [(u32::from_ne_bytes(CLIENT.octets()), chosen_id)],
        "the client's affinity, migrated"
    );
    for sport in 41000..41016 {
        let (_, out) = h.run(&tcp4(CLIENT, sport, VIP, 80, SYN, b""));
        assert_eq!(
            parse_checked(&out).dst,
            chosen,
            "affinity kept (port {sport})"
        );
    }
    // Source ranges still filter.
    let (rc, _) = h.run(&tcp4(CLIENT, 40005, LB, 80, SYN, b""));
    assert_eq!(rc, TC_ACT_SHOT, "a client outside the ranges");
    let (_, out) = h.run(&tcp4(allowed, 40006, LB, 80, SYN, b""));
    assert_eq!(parse_checked(&out).dst, B1, "a client inside the ranges");
    assert!(
        h.stats()
            .get(&stat::DROP_SOURCE_RANGE)
            .copied()
            .unwrap_or(0)
            >= 1
    );

    // The first sync finds everything in place.
    let r = h.writer.sync(&d);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.frontends_added, 0, "no frontend written anew");
    assert_eq!(h.writer.rev_nat_ids(), &ids);
}

/// Every `_V1` map holding a reverse-NAT id is migrated, each field in its
/// place: the IPv6 twins (source ranges too), socket reverse NAT and
/// Maglev tables (the IPv4 maps are checked through packets above).
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn every_map_of_16_bit_reverse_nat_ids_is_migrated_field_by_field() {
    let mut h = Harness::new();
    let dir = h.pin_dir().to_path_buf();
    let id: u16 = 0xfe01;
    let addr6 = [0x2001_0002u32.to_be(), 0, 0xff, 10u32.to_be()];
    let svc6 = Svc6Key {
        addr_be: addr6,
        port_be: 80u16.to_be(),
        slot: 0,
        proto: IPPROTO_TCP,
        ..Default::default()
    };
    pin_v1(
        &dir,
        "SVC6_V1",
        false,
        &[(
            svc6,
            v1::SvcValue {
                backend_id: 0,
                count: 2,
                rev_nat_id: id,
                flags: svc_flags::DROP_NO_BACKEND,
                maglev_size: 251,
                affinity_timeout_s: 86_400,
            },
        )],
    );
    pin_v1(&dir, "REVNAT6_V1", false, &[(id, RevNat6::default())]);
    let ct6 = Ct6Key::default();
    pin_v1(
        &dir,
        "CT6_V1",
        true,
        &[(
            ct6,
            v1::Ct6Value {
                backend_id: 9,
                rev_nat_id: id,
                flags: 0x0123,
                nat_port_be: 0x4567,
                _pad: 0,
                nat_addr_be: addr6,
                _pad2: 0,
                last_seen_ns: 0x0102_0304_0506,
            },
        )],
    );
    let aff6 = v1::Affinity6Key {
        client_be: addr6,
        rev_nat_id: id,
        _pad: 0,
    };
    let aff_value = AffinityValue {
        backend_id: 9,
        _pad: 0,
        last_used_ns: 77,
    };
    pin_v1(&dir, "AFFINITY6_V1", true, &[(aff6, aff_value)]);
    let sock4 = SockRevNat4Key {
        cookie: 5,
        addr_be: 1,
        port_be: 2,
        _pad: 0,
    };
    pin_v1(
        &dir,
        "SOCK_REVNAT4_V1",
        true,
        &[(
            sock4,
            v1::SockRevNat4Value {
                addr_be: 0x0a0b_0c0d,
                port_be: 0x5000,
                rev_nat_id: id,
            },
        )],
    );
    let sock6 = SockRevNat6Key {
        cookie: 6,
        addr_be: addr6,
        port_be: 3,
        _pad: [0; 6],
    };
    pin_v1(
        &dir,
        "SOCK_REVNAT6_V1",
        true,
        &[(
            sock6,
            v1::SockRevNat6Value {
                addr_be: addr6,
                port_be: 0x5000,
                rev_nat_id: id,
            },
        )],
    );
    let mut chunk = MaglevChunk::default();
    chunk.backend_ids[0] = 9;
    chunk.backend_ids[255] = 10;
    pin_v1(
        &dir,
        "MAGLEV4_V1",
        false,
        &[(
            v1::MaglevKey {
                rev_nat_id: id,
                generation: 1,
                _pad: 0,
                chunk: 3,
                _pad2: 0,
            },
            chunk,
        )],
    );
    let range6 = v1::SourceRange6 {
        rev_nat_id_be: id.to_be(),
        _pad: 0,
        addr_be: addr6,
    };
    let data = pin_map(
        &dir.join("SRCRANGE6_V1"),
        BPF_MAP_TYPE_LPM_TRIE,
        4 + 20,
        1,
        BPF_F_NO_PREALLOC,
    );
    let mut old: LpmTrie<MapData, v1::SourceRange6, u8> =
        LpmTrie::try_from(Map::LpmTrie(data)).unwrap();
    old.insert(&LpmKey::new(32 + 64, range6), 1, 0).unwrap();
    drop(old);
    h.reload().expect("load over the old pins");
    h.finish_migrations();
    assert_eq!(v1_pins(&dir), Vec::<String>::new(), "old pins removed");

    let wide = u32::from(id);
    let svc = entries::<Svc6Key, SvcValue>(&dir, map_names::SERVICES6);
    assert_eq!(
        svc,
        [(svc6, {
            let mut v = SvcValue::frontend(2, wide, svc_flags::DROP_NO_BACKEND, 86_400);
            v.maglev_size = 251;
            v
        })]
    );
    assert_eq!(
        entries::<u32, RevNat6>(&dir, map_names::REV_NAT6),
        [(wide, RevNat6::default())]
    );
    assert_eq!(
        entries::<Ct6Key, Ct6Value>(&dir, map_names::CONNTRACK6),
        [(
            ct6,
            Ct6Value {
                backend_id: 9,
                rev_nat_id: wide,
                flags: 0x0123,
                nat_port_be: 0x4567,
                nat_addr_be: addr6,
                _pad2: 0,
                last_seen_ns: 0x0102_0304_0506,
            }
        )]
    );
    assert_eq!(
        entries::<Affinity6Key, AffinityValue>(&dir, map_names::AFFINITY6),
        [(
            Affinity6Key {
                client_be: addr6,
                rev_nat_id: wide,
            },
            aff_value
        )]
    );
    assert_eq!(
        entries::<SockRevNat4Key, SockRevNat4Value>(&dir, map_names::SOCK_REVNAT),
        [(
            sock4,
            SockRevNat4Value {
                addr_be: 0x0a0b_0c0d,
                port_be: 0x5000,
                _pad: 0,
                rev_nat_id: wide,
            }
        )]
    );
    assert_eq!(
        entries::<SockRevNat6Key, SockRevNat6Value>(&dir, map_names::SOCK_REVNAT6),
        [(
            sock6,
            SockRevNat6Value {
                addr_be: addr6,
                port_be: 0x5000,
                _pad: 0,
                rev_nat_id: wide,
            }
        )]
    );
    let ranges: Vec<(LpmKey<SourceRange6>, u8)> = {
        let data = MapData::from_pin(dir.join(map_names::SOURCE_RANGES6)).unwrap();
        let m: LpmTrie<MapData, SourceRange6, u8> = LpmTrie::try_from(Map::LpmTrie(data)).unwrap();
        m.iter().map(|kv| kv.expect("entry")).collect()
    };
    assert_eq!(ranges.len(), 1);
    assert_eq!(ranges[0].0.prefix_len(), 32 + 64, "the prefix length kept");
    assert_eq!(
        ranges[0].0.data(),
        SourceRange6 {
            rev_nat_id_be: wide.to_be(),
            addr_be: addr6,
        }
    );
    let maglev = entries::<MaglevKey, MaglevChunk>(&dir, map_names::MAGLEV);
    assert_eq!(maglev.len(), 1);
    assert_eq!(maglev[0].0, MaglevKey::new(wide, 1, 3));
    assert_eq!(maglev[0].1, chunk);
}

/// Map layouts carry a version in their names. A pinned map of an older
/// layout (here an affinity map `AFFINITY4_V0` whose value kept the last use
/// in seconds, made on purpose) is migrated into the current map when the
/// agent loads, and its pin removed; an old map with no migration is dropped.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn pinned_maps_of_an_older_layout_are_migrated() {
    use aya::maps::{HashMap as AyaHashMap, Map, MapData};
    use proxy_agent::bpf::{load_with_migrations, Migration};
    use proxy_common::{Affinity4Key, AffinityValue};

    /// The "old" value layout: 8 bytes, last use in whole seconds.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct AffinityV0 {
        backend_id: u32,
        last_used_s: u32,
    }
    // SAFETY: a #[repr(C)] struct of integers without implicit padding.
    unsafe impl aya::Pod for AffinityV0 {}

    fn run(old: MapData, new: &mut Map) -> Result<(usize, usize), aya::maps::MapError> {
        let old: AyaHashMap<MapData, Affinity4Key, AffinityV0> =
            AyaHashMap::try_from(Map::HashMap(old))?;
        let mut new: AyaHashMap<&mut MapData, Affinity4Key, AffinityValue> =
            AyaHashMap::try_from(new)?;
        let mut n = 0;
        for kv in old.iter() {
            let (k, v) = kv?;
            let value = AffinityValue {
                backend_id: v.backend_id,
                _pad: 0,
                last_used_ns: u64::from(v.last_used_s) * 1_000_000_000,
            };
            new.insert(k, value, 0)?;
            n += 1;
        }
        Ok((n, 0))
    }
    const MIGRATIONS: &[Migration] = &[Migration {
        from: "AFFINITY4_V0",
        to: map_names::AFFINITY,
        run,
        again_before_attach: false,
    }];

    let pins = PinDir::new(&format!("kpr-pkt-{}-mig", std::process::id()));
    let pin_dir = pins.path();
    std::fs::create_dir_all(pin_dir).unwrap();
    // Pin old-layout maps, as an older agent would have left them.
    let pin_old = |name: &str, value_size: u32, entries: &[(Affinity4Key, AffinityV0)]| {
        let fd = create_hash_map(8, value_size, 1024);
        let data = MapData::from_fd(fd).unwrap();
        data.pin(pin_dir.join(name)).unwrap();
        let mut m: AyaHashMap<MapData, Affinity4Key, AffinityV0> =
            AyaHashMap::try_from(Map::HashMap(data)).unwrap();
        for (k, v) in entries {
            m.insert(k, v, 0).unwrap();
        }
    };
    let key = Affinity4Key {
        client_be: u32::from_ne_bytes(CLIENT.octets()),
        rev_nat_id: 7,
    };
    pin_old(
        "AFFINITY4_V0",
        8,
        &[(
            key,
            AffinityV0 {
                backend_id: 42,
                last_used_s: 1234,
            },
        )],
    );
    pin_old("FOO4_V0", 8, &[]);

    let mut loaded = load_with_migrations(pin_dir, MapSizes::default(), MIGRATIONS).expect("load");
    assert!(
        pin_dir.join("AFFINITY4_V0").exists(),
        "the old pin stays until the programs are attached"
    );
    loaded.finish_migrations();
    assert!(
        !pin_dir.join("AFFINITY4_V0").exists(),
        "old pin removed after migration"
    );
    assert!(
        !pin_dir.join("FOO4_V0").exists(),
        "an old map with no migration is dropped"
    );
    let m: AyaHashMap<MapData, Affinity4Key, AffinityValue> =
        AyaHashMap::try_from(loaded.ebpf.take_map(map_names::AFFINITY).unwrap()).unwrap();
    let v = m.get(&key, 0).expect("migrated entry");
    assert_eq!((v.backend_id, v.last_used_ns), (42, 1_234_000_000_000));
}

/// Pinned maps are checked on adoption (issue 15). A changed size setting
/// takes effect: the conntrack and backends maps of an earlier run are made
/// anew at the configured size, their entries copied (those that fit; the
/// rest counted); a state map of another layout under the same name is
/// refused, naming the map, the field, the expected and the found value, and
/// left untouched; a cache of another layout starts empty.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn pinned_maps_are_checked_on_adoption_and_a_changed_size_takes_effect() {
    use aya::maps::{HashMap as AyaHashMap, MapData};
    use proxy_agent::bpf::{expected_maps, load, pinned_def};
    use proxy_common::{Backend4, Ct4Key, Ct4Value};

    let pins = PinDir::new(&format!("kpr-pkt-{}-pinsize", std::process::id()));
    let pin_dir = pins.path();
    let small = MapSizes {
        conntrack: 1024,
        backends: 512,
        ..MapSizes::default()
    };
    {
        let mut loaded = load(pin_dir, small).expect("first load");
        let mut be: AyaHashMap<&mut MapData, u32, Backend4> =
            AyaHashMap::try_from(loaded.ebpf.map_mut(map_names::BACKENDS).unwrap()).unwrap();
        for id in 1..=3u32 {
            let b = Backend4::new(Ipv4Addr::new(198, 18, 1, id as u8), 8080, IPPROTO_TCP, 1);
            be.insert(id, b, 0).unwrap();
        }
        let mut ct: AyaHashMap<&mut MapData, Ct4Key, Ct4Value> =
            AyaHashMap::try_from(loaded.ebpf.map_mut(map_names::CONNTRACK).unwrap()).unwrap();
        for port in [40001u16, 40002] {
            let k = Ct4Key {
                sport_be: port.to_be(),
                proto: IPPROTO_TCP,
                ..Ct4Key::default()
            };
            let v = Ct4Value {
                backend_id: 2,
                ..Ct4Value::default()
            };
            ct.insert(k, v, 0).unwrap();
        }
    }
    let max = |name: &str| pinned_def(&pin_dir.join(name)).unwrap().max_entries;
    assert_eq!(
        (max(map_names::CONNTRACK), max(map_names::BACKENDS)),
        (1024, 512)
    );

    // A bigger conntrack and a backends map too small for the 3 entries.
    let changed = MapSizes {
        conntrack: 2048,
        backends: 2,
        ..MapSizes::default()
    };
    let loaded = load(pin_dir, changed).expect("load with the new sizes");
    assert_eq!(
        (max(map_names::CONNTRACK), max(map_names::BACKENDS)),
        (2048, 2)
    );
    drop(loaded);
    let ct: AyaHashMap<MapData, Ct4Key, Ct4Value> = AyaHashMap::try_from(
        aya::maps::Map::LruHashMap(MapData::from_pin(pin_dir.join(map_names::CONNTRACK)).unwrap()),
    )
    .unwrap();
    assert_eq!(ct.keys().count(), 2, "conntrack entries carried over");
    let be: AyaHashMap<MapData, u32, Backend4> = AyaHashMap::try_from(aya::maps::Map::HashMap(
        MapData::from_pin(pin_dir.join(map_names::BACKENDS)).unwrap(),
    ))
    .unwrap();
    assert_eq!(be.keys().count(), 2, "as many backends as fit");
    let leftovers: Vec<_> = std::fs::read_dir(pin_dir)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .ends_with(proxy_agent::bpf::OLD_SUFFIX)
        })
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // An agent stopped while a map was set aside (pinned only as
    // `CT4_V1_OLD`): the next start puts it back and adopts its entries.
    let ct_pin = pin_dir.join(map_names::CONNTRACK);
    let aside = pin_dir.join(format!(
        "{}{}",
        map_names::CONNTRACK,
        proxy_agent::bpf::OLD_SUFFIX
    ));
    MapData::from_pin(&ct_pin).unwrap().pin(&aside).unwrap();
    std::fs::remove_file(&ct_pin).unwrap();
    drop(load(pin_dir, changed).expect("load after an interrupted replacement"));
    assert!(!aside.exists(), "the set-aside pin is gone");
    let ct: AyaHashMap<MapData, Ct4Key, Ct4Value> = AyaHashMap::try_from(
        aya::maps::Map::LruHashMap(MapData::from_pin(&ct_pin).unwrap()),
    )
    .unwrap();
    assert_eq!(ct.keys().count(), 2, "its entries kept");

    // Another layout under a state map's name: refused, nothing changed.
    let bad = PinDir::new(&format!("kpr-pkt-{}-pinbad", std::process::id()));
    std::fs::create_dir_all(bad.path()).unwrap();
    let expected = expected_maps(MapSizes::default()).unwrap();
    let svc = &expected[map_names::SERVICES];
    let pin = bad.path().join(map_names::SERVICES);
    MapData::from_fd(create_hash_map(4, svc.value_size, 64))
        .unwrap()
        .pin(&pin)
        .unwrap();
    // And one under a cache's name: it starts empty, as this build makes it.
    let frag = bad.path().join(map_names::FRAGMENTS);
    MapData::from_fd(create_hash_map(4, 4, 16))
        .unwrap()
        .pin(&frag)
        .unwrap();
    let err = load(bad.path(), MapSizes::default())
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains(map_names::SERVICES)
            && err.contains(&format!(
                "key size is 4, this build expects {}",
                svc.key_size
            )),
        "{err}"
    );
    assert_eq!(pinned_def(&pin).unwrap().key_size, 4, "left as it was");
    std::fs::remove_file(&pin).unwrap();
    load(bad.path(), MapSizes::default()).expect("load with the cache reset");
    assert_eq!(
        pinned_def(&frag).unwrap(),
        expected[map_names::FRAGMENTS],
        "the cache was made anew"
    );
}

/// A plain BPF hash map (for the migration tests' "old" maps).
fn create_hash_map(key_size: u32, value_size: u32, max_entries: u32) -> std::os::fd::OwnedFd {
    create_map(1, key_size, value_size, max_entries, 0)
}

/// A BPF map of `map_type` (`BPF_MAP_TYPE_*`) with `flags`, as an older
/// agent's object would have made it.
fn create_map(
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    flags: u32,
) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    #[repr(C)]
    struct Attr {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
        _rest: [u8; 108],
    }
    let attr = Attr {
        map_type,
        key_size,
        value_size,
        max_entries,
        map_flags: flags,
        _rest: [0; 108],
    };
    // SAFETY: BPF_MAP_CREATE (0) with a zero-padded attribute of the size given.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            0,
            &attr as *const Attr,
            std::mem::size_of::<Attr>() as u32,
        )
    };
    assert!(
        fd >= 0,
        "BPF_MAP_CREATE: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a new fd we own.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) }
}

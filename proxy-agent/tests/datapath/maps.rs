//! The agent's map operations against the kernel's maps: a used harness's
//! maps reset for reuse, and the batched reads, writes and deletes
//! (`BPF_MAP_*_BATCH`) with the outcomes single operations give.
use super::*;

/// What lets packet tests share one loaded object (the verifier's minute
/// under emulation): a used harness's maps are emptied, on every kernel of
/// the matrix (5.10 refused the batch update of its per-CPU statistics, so
/// every harness there loaded the object again and its packet pass took
/// past 900 s).
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn harness_maps_reset_for_reuse() {
    let mut h = Harness::new();
    h.sync(&[(fe(VIP, 80, IPPROTO_TCP), vec![be(B1, 8080, IPPROTO_TCP)], 0)]);
    h.run(&tcp4(CLIENT, 40000, VIP, 80, SYN, b""));
    assert!(!h.maps().programmed().unwrap().services.is_empty());
    assert!(h.stats().values().any(|n| *n > 0), "the packet was counted");
    kit::harness::reset_maps(h.pin_dir()).expect("reset the harness's maps");
    assert!(h.maps().conntrack().unwrap().is_empty(), "conntrack left");
    assert!(h.stats().values().all(|n| *n == 0), "counters left");
    let left = h.maps().programmed().unwrap();
    assert!(
        left.services.is_empty() && left.backends.is_empty(),
        "frontends left"
    );

    // A per-CPU array set at or above the bound a 5.10 reset zeroes up to
    // fails the reset where the kernel can read the array in a batch (the
    // host's), rather than leaking into a later test on 5.10.
    if !kit::harness::per_cpu_bound_checked(h.pin_dir()).unwrap() {
        eprintln!("no batch read of per-CPU arrays on this kernel: the bound is not checked");
        return;
    }
    let rr = |value: u32| {
        use aya::maps::{Map, MapData, PerCpuArray, PerCpuValues};
        let data = MapData::from_pin(h.pin_dir().join(map_names::ROUND_ROBIN)).unwrap();
        let mut m: PerCpuArray<_, u32> = PerCpuArray::try_from(Map::PerCpuArray(data)).unwrap();
        let cpus = aya::util::nr_cpus().unwrap();
        let at = kit::harness::PER_CPU_RESET_BOUND + 7;
        m.set(at, PerCpuValues::try_from(vec![value; cpus]).unwrap(), 0)
            .unwrap();
    };
    rr(1);
    match kit::harness::reset_maps(h.pin_dir()) {
        Err(kit::harness::ResetError::BeyondBound { map, index }) => {
            assert_eq!(
                (map, index),
                (
                    map_names::ROUND_ROBIN,
                    kit::harness::PER_CPU_RESET_BOUND + 7
                )
            )
        }
        other => panic!("a set element beyond the bound: {other:?}"),
    }
    rr(0);
    kit::harness::reset_maps(h.pin_dir()).expect("zero again: the reset passes");
}

/// Pruning the session-affinity map reads it in batches
/// (`BPF_MAP_LOOKUP_BATCH`, several calls at this size): the batches hold
/// every entry the iterator sees, and a prune removes exactly the entries of
/// a pruned frontend that name a backend it no longer has, whatever batch
/// they came in.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn affinity_prune_reads_the_map_in_batches_and_removes_exactly_the_stale() {
    use aya::maps::{HashMap as AyaHashMap, IterableMap, MapData};
    use proxy_agent::{bpf::batch, dataplane::Dataplane};
    use proxy_common::{Affinity4Key, AffinityValue};
    use std::collections::{BTreeMap, BTreeSet};
    use std::os::fd::AsFd;

    let mut h = Harness::new();
    let mut map: AyaHashMap<MapData, Affinity4Key, AffinityValue> = h.lru_map(map_names::AFFINITY);
    // 12,000 clients over two frontends (reverse-NAT ids 7 and 8), each
    // pinned to backend 1, 2 or 3.
    let mut expected_left = BTreeSet::new();
    for i in 0..12_000u32 {
        let rev_nat_id = 7 + i % 2;
        let backend_id = 1 + i % 3;
        let key = Affinity4Key {
            client_be: (0xc612_0000 + i).to_be(),
            rev_nat_id,
        };
        let value = AffinityValue {
            backend_id,
            _pad: 0,
            last_used_ns: 1,
        };
        map.insert(key, value, 0).expect("insert");
        // Frontend 7 keeps backends 1 and 3; frontend 8 is not pruned.
        if rev_nat_id == 8 || backend_id != 2 {
            expected_left.insert((key.client_be, rev_nat_id, backend_id));
        }
    }
    let as_set = |entries: Vec<(Affinity4Key, AffinityValue)>| -> BTreeSet<(u32, u32, u32)> {
        entries
            .into_iter()
            .map(|(k, v)| (k.client_be, k.rev_nat_id, v.backend_id))
            .collect()
    };
    let batched = batch::lookup_all::<Affinity4Key, AffinityValue>(map.map().fd().as_fd())
        .expect("batch lookup")
        .expect("this kernel has batch lookups (5.6)");
    assert_eq!(batched.len(), 12_000);
    let iterated: Vec<_> = map.iter().map(|r| r.expect("entry")).collect();
    assert_eq!(as_set(batched), as_set(iterated));

    let keep = BTreeMap::from([(7u32, BTreeSet::from([1u32, 3]))]);
    let removed = h
        .writer
        .dataplane_mut()
        .prune_affinity(&keep)
        .expect("prune");
    assert_eq!(removed, 2_000);
    let left = batch::entries(&map).expect("entries");
    assert_eq!(as_set(left), expected_left);
    assert_eq!(
        h.writer.dataplane().affinity_ids().expect("ids"),
        BTreeSet::from([7, 8])
    );
}

/// Writes go to the kernel in batches (`BPF_MAP_UPDATE_BATCH`) with the
/// outcome single writes give: handed 6,000 backends at once, a map with room
/// for 5,000 takes the first 5,000 and stops at the next as `Full`; the map
/// holds exactly those. Once it is full, updates of entries it holds still
/// go through in a batch (they need no room), up to the first new entry.
/// The IPv6 maps take batches alike.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn batched_writes_stop_where_single_writes_would() {
    use proxy_agent::dataplane::{BackendEntry, Dataplane, DataplaneError};
    use proxy_common::{Backend4, Backend6};

    let sizes = MapSizes {
        backends: 5_000,
        ..MapSizes::default()
    };
    let mut h = Harness::try_new("kpr-batch", sizes, Config::default()).expect("harness");
    let backend = |id: u32, port: u16| {
        let addr = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + id);
        (
            id,
            BackendEntry::V4(Backend4::new(addr, port, IPPROTO_TCP, 0)),
        )
    };
    let full = |e: Option<DataplaneError>| matches!(e, Some(DataplaneError::Full { map, capacity: 5_000 }) if map == map_names::BACKENDS);
    let first: Vec<(u32, BackendEntry)> = (1..=6_000).map(|id| backend(id, 8080)).collect();
    let (written, err) = h.writer.dataplane_mut().put_backends(&first);
    assert_eq!(written, 5_000);
    assert!(full(err), "the 5,001st backend is refused as Full");
    let held = h.writer.dataplane().dump().expect("dump").backends;
    assert_eq!(
        held.keys().copied().collect::<Vec<u32>>(),
        (1..=5_000).collect::<Vec<u32>>()
    );

    let mixed: Vec<(u32, BackendEntry)> = (4_990..=5_010).map(|id| backend(id, 9090)).collect();
    let (written, err) = h.writer.dataplane_mut().put_backends(&mixed);
    assert_eq!(written, 11, "4,990 to 5,000 updated");
    assert!(full(err), "5,001 refused");
    let held = h.writer.dataplane().dump().expect("dump").backends;
    assert_eq!(held.len(), 5_000);
    for id in 4_990..=5_000 {
        assert_eq!(held[&id].port(), 9090, "backend {id} not updated");
    }
    assert_eq!(held[&4_989].port(), 8080);

    // The IPv6 maps take batches alike, in the same call as IPv4 entries:
    // each run of one family's goes to its map, in order, and the call
    // stops where single writes would (the IPv4 map is full).
    let v6 = |i: u16| {
        let addr = std::net::Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, i);
        (
            u32::from(i),
            BackendEntry::V6(Backend6::new(addr, 8080, IPPROTO_TCP, 0)),
        )
    };
    let mut calls: Vec<(u32, BackendEntry)> = (1..=200u16).map(v6).collect();
    calls.push(backend(4_000, 7070));
    calls.extend((201..=300u16).map(v6));
    calls.push(backend(6_001, 7070));
    calls.push(v6(301));
    let (written, err) = h.writer.dataplane_mut().put_backends(&calls);
    assert_eq!(written, 301, "every entry before the new IPv4 backend");
    assert!(full(err), "the new IPv4 backend is refused as Full");
    let held = h.writer.dataplane().dump().expect("dump");
    assert_eq!(held.backends6.len(), 300, "IPv6 backend 301 not written");
    assert_eq!(
        held.backends6[&300].addr(),
        std::net::Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 300)
    );
    assert_eq!(held.backends[&4_000].port(), 7070);
}

/// Deletes go to the kernel's maps in batches (`BPF_MAP_DELETE_BATCH`),
/// which stop at a key that is not there; such a key is deleted already, as
/// a single delete says, so the deletes go on past it: every present key
/// given goes, every other entry stays, across several batches of 4,096
/// and in both families' maps.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn batched_deletes_go_past_absent_keys() {
    use proxy_agent::dataplane::{BackendEntry, Dataplane, Family};
    use proxy_common::{Backend4, Backend6};

    let mut h =
        Harness::try_new("kpr-bdel", MapSizes::default(), Config::default()).expect("harness");
    let backend = |id: u32| {
        let addr = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + id);
        (
            id,
            BackendEntry::V4(Backend4::new(addr, 8080, IPPROTO_TCP, 0)),
        )
    };
    let all: Vec<(u32, BackendEntry)> = (1..=10_000).map(backend).collect();
    let (written, err) = h.writer.dataplane_mut().put_backends(&all);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(written, 10_000);
    // Absent keys at the start, in the middle of a batch and at its end.
    let dp = h.writer.dataplane_mut();
    for id in [1, 5_000, 9_000] {
        let (n, err) = dp.delete_backends(&[(Family::V4, id)]);
        assert!(n == 1 && err.is_none(), "single delete: {err:?}");
    }
    let doomed: Vec<(Family, u32)> = (1..=9_000)
        .chain(20_000..=20_010)
        .map(|id| (Family::V4, id))
        .collect();
    let (deleted, err) = dp.delete_backends(&doomed);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(deleted, doomed.len(), "every key taken, absent ones too");
    let held = h.writer.dataplane().dump().expect("dump").backends;
    assert_eq!(
        held.keys().copied().collect::<Vec<u32>>(),
        (9_001..=10_000).collect::<Vec<u32>>()
    );
    assert!(held.values().all(|b| b.port() == 8080));

    let v6: Vec<(u32, BackendEntry)> = (1..=300u16)
        .map(|i| {
            let addr = std::net::Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, i);
            (
                u32::from(i),
                BackendEntry::V6(Backend6::new(addr, 8080, IPPROTO_TCP, 0)),
            )
        })
        .collect();
    let dp = h.writer.dataplane_mut();
    let (written, err) = dp.put_backends(&v6);
    assert!(err.is_none() && written == 300, "{err:?}");
    let doomed6: Vec<(Family, u32)> = (100..=400).map(|id| (Family::V6, id)).collect();
    let (deleted, err) = dp.delete_backends(&doomed6);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(deleted, 301);
    let held6 = h.writer.dataplane().dump().expect("dump").backends6;
    assert_eq!(
        held6.keys().copied().collect::<Vec<u32>>(),
        (1..100).collect::<Vec<u32>>()
    );
}

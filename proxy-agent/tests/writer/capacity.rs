//! What a sync does when the maps are full or a write fails: full maps,
//! exhaustion served by Service age, failed writes retried, bounded batches
//! after a failure, more than 65,535 reverse-NAT ids.
use proxy_agent::dataplane::Dataplane;
use proxy_agent::model::ServiceAge;

use super::*;

#[test]
fn full_map_fails_only_that_frontend_and_a_later_sync_retries_it() {
    let (a, b, c) = (
        key(1, 80, IPPROTO_TCP),
        key(2, 80, IPPROTO_TCP),
        key(3, 80, IPPROTO_TCP),
    );
    // Room for 6 service entries: A and B take 2 each.
    let mut w = Writer::adopt(InMemory::with_capacity(6, 100, 100)).unwrap();
    let before = desired(&[(a, &[1]), (b, &[2])]);
    w.sync(&before);
    let programmed_before = w.dataplane().programmed().services.clone();
    w.dataplane_mut().take_ops();

    // C needs 4 entries: it fails; A and B are not touched.
    let with_c = desired(&[(a, &[1]), (b, &[2]), (c, &[3, 4, 5])]);
    let report = w.sync(&with_c);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert!(
        report.errors[0].0.contains("default/svc-3"),
        "{:?}",
        report.errors
    );
    assert!(report.errors[0].1.to_string().contains("full"));
    assert_eq!(
        w.dataplane().programmed().services,
        programmed_before,
        "A and B as they were, no C leftovers"
    );
    assert!(w
        .dataplane()
        .ops()
        .iter()
        .all(|o| !matches!(o, Op::PutService(ServiceKey::V4(k), _) if k.addr() != c.addr)));
    assert!(w.dataplane().violations().is_empty());

    // B goes away; C still does not fit before B's entries are deleted...
    let without_b = desired(&[(a, &[1]), (c, &[3, 4, 5])]);
    let report = w.sync(&without_b);
    assert_eq!(report.errors.len(), 1);
    assert_eq!(report.frontends_removed, 1);
    // ...but the next sync programs it.
    let report = w.sync(&without_b);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.frontends_added, 1);
    assert!(w.dataplane().violations().is_empty());
    assert_programmed(&w, &without_b);
}

/// A frontend that does not fit is cleaned before the frontends after it are
/// written, so a smaller, newer one still gets the room it leaves, as with
/// one write at a time (a phase's writes now go in batches, which stop at
/// the first failure for this).
#[test]
fn a_failed_frontend_frees_its_room_before_the_next_is_written() {
    let (big, small) = (key(1, 80, IPPROTO_TCP), key(2, 80, IPPROTO_TCP));
    let mut d = DesiredState::default();
    let mut fe = frontend(&big, &[1, 2, 3, 4, 5, 6, 7]);
    fe.service = "default/big".into();
    d.frontends.insert(big, fe);
    let mut fe = frontend(&small, &[8]);
    fe.service = "default/small".into();
    d.frontends.insert(small, fe);
    d.service_order
        .insert("default/big".into(), ServiceAge::at_second(0));
    d.service_order
        .insert("default/small".into(), ServiceAge::at_second(1));
    // Room for 6 service entries: the older frontend needs 8 (7 slots and
    // slot 0) and fails at its 7th slot; the newer one needs 2.
    let mut w = Writer::adopt(InMemory::with_capacity(6, 100, 100)).unwrap();
    let report = w.sync(&d);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert!(
        report.errors[0].0.contains("default/big"),
        "{:?}",
        report.errors
    );
    assert_eq!(report.frontends_added, 1);
    let services = &w.dataplane().programmed().services;
    assert_eq!(
        services.len(),
        2,
        "the small frontend's slot 0 and slot 1 only"
    );
    assert!(services.keys().all(|k| k.addr() == small.addr));
    assert!(w.dataplane().violations().is_empty());
}

/// Capacity is served by Service age, not by address: a Service created
/// now with many frontends at low addresses (externalIPs are chosen by
/// whoever creates the Service) cannot take the last reverse-NAT ids, map
/// entries or backend ids from an older Service's new port or its growing
/// backend list; the older Service's ids do not change; the newcomer gets
/// what is left, in its own key order.
#[test]
fn exhaustion_serves_the_older_service_first_whatever_the_addresses() {
    let old_port = key(200, 80, IPPROTO_TCP);
    let old_new_port = key(200, 443, IPPROTO_TCP);
    let hostile: Vec<FrontendKey> = (1..=6).map(|i| key(i, 80, IPPROTO_TCP)).collect();
    let state = |old_backends: &[u8], with_hostile: bool| {
        let mut d = DesiredState::default();
        let mut old = frontend(&old_port, old_backends);
        old.service = "default/old".into();
        d.frontends.insert(old_port, old.clone());
        d.service_order
            .insert("default/old".into(), ServiceAge::at_second(0));
        if with_hostile {
            let mut new_port = frontend(&old_new_port, old_backends);
            new_port.service = "default/old".into();
            d.frontends.insert(old_new_port, new_port);
            for (i, k) in hostile.iter().enumerate() {
                let mut fe = frontend(k, &[100 + i as u8]);
                fe.service = "default/hostile".into();
                d.frontends.insert(*k, fe);
            }
            d.service_order
                .insert("default/hostile".into(), ServiceAge::at_second(1));
        }
        d
    };
    // 4 reverse-NAT entries, 12 service entries, 6 backends (ids 1..=5:
    // the space stops below the capacity of the traffic counters, which the
    // in-memory dataplane does not model; its map holds 6).
    let mut w = Writer::adopt(InMemory::with_capacity(12, 6, 4)).unwrap();
    let report = w.sync(&state(&[1], false));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let old_rev = w.rev_nat_ids()[&old_port];

    // The old Service grows to 3 backends and gains a port, in the same sync
    // as the hostile one appears with 6 frontends that sort first.
    let desired = state(&[1, 2, 3], true);
    let report = w.sync(&desired);
    assert!(w.dataplane().violations().is_empty());
    assert_eq!(
        w.rev_nat_ids()[&old_port],
        old_rev,
        "an existing id never changes"
    );
    let p = w.dataplane().programmed();
    for k in [old_port, old_new_port] {
        let slot0 = p.services.get(&svc(&k, 0)).unwrap_or_else(|| panic!("{k}"));
        assert_eq!(slot0.count, 3, "{k}: the older Service is served whole");
    }
    // What is left goes to the newcomer, lowest key first: 2 of the 4
    // reverse-NAT ids; every other hostile frontend failed, and says so.
    let served: Vec<&FrontendKey> = hostile
        .iter()
        .filter(|k| p.services.contains_key(&svc(k, 0)))
        .collect();
    assert!(served.len() < hostile.len(), "{served:?}");
    assert_eq!(served.first().copied(), hostile.first());
    assert!(!report.errors.is_empty());
    // Every error is the newcomer's: its frontends, or its own backends
    // (198.18.1.100 and up) that found the backends map full.
    assert!(
        report
            .errors
            .iter()
            .all(|(what, _)| what.contains("default/hostile")
                || what.starts_with("backend 198.18.1.10")),
        "{:?}",
        report.errors
    );
}

#[test]
fn failed_operation_leaves_the_frontend_as_it_was_and_the_next_sync_retries() {
    let (a, b) = (key(1, 80, IPPROTO_TCP), key(2, 80, IPPROTO_TCP));
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    w.sync(&desired(&[(a, &[1, 2])]));
    let before = w.dataplane().programmed().clone();

    // Growing A writes backend 3, B's backend 4, B's reverse NAT, A's slot 3,
    // B's slot 1, A's slot 0, B's slot 0: make A's slot 3 (op 3) fail.
    let d = desired(&[(a, &[1, 2, 3]), (b, &[4])]);
    w.dataplane_mut().fail_after(3, 1);
    let report = w.sync(&d);
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert!(report.errors[0].0.contains("default/svc-1"));
    let after = w.dataplane().programmed();
    for slot in 0..=2 {
        assert_eq!(
            after.services.get(&svc(&a, slot)),
            before.services.get(&svc(&a, slot)),
            "A as it was"
        );
    }
    assert!(!after.services.contains_key(&svc(&a, 3)));
    assert_eq!(
        after.services[&svc(&b, 0)].count,
        1,
        "B programmed regardless"
    );
    assert!(w.dataplane().violations().is_empty());

    let report = w.sync(&d);
    assert!(report.errors.is_empty());
    assert_eq!(report.frontends_updated, 1);
    assert_programmed(&w, &d);
}

/// A full map does not make a sync's work grow with the square of the
/// entries: every write after the room is gone fails, and each failure used
/// to cost the preparation of every write left (the next batch call was
/// handed all of them), 9.5 s for 50,000 Services into a full backend map.
/// Counted here as the entries handed to batch calls, against what writing
/// them one at a time would hand.
#[test]
fn a_full_map_costs_each_failed_write_a_bounded_batch() {
    use proxy_agent::dataplane::{
        BackendEntry, BatchOutcome, DataplaneError, Family, Programmed, RevNatEntry, ServiceKey,
        SourceRange,
    };
    use proxy_common::lb::{MaglevChunk, MaglevKey};

    /// InMemory, counting the entries offered to batch writes of backends.
    struct Offered(InMemory, usize);
    impl Dataplane for Offered {
        fn put_services(&mut self, e: &[(ServiceKey, SvcValue)]) -> BatchOutcome {
            self.0.put_services(e)
        }
        fn delete_services(&mut self, k: &[ServiceKey]) -> BatchOutcome {
            self.0.delete_services(k)
        }
        fn put_backends(&mut self, entries: &[(u32, BackendEntry)]) -> BatchOutcome {
            self.1 += entries.len();
            self.0.put_backends(entries)
        }
        fn delete_backends(&mut self, ids: &[(Family, u32)]) -> BatchOutcome {
            self.0.delete_backends(ids)
        }
        fn put_rev_nats(&mut self, e: &[(u32, RevNatEntry)]) -> BatchOutcome {
            self.0.put_rev_nats(e)
        }
        fn delete_rev_nats(&mut self, ids: &[(Family, u32)]) -> BatchOutcome {
            self.0.delete_rev_nats(ids)
        }
        fn put_source_range(&mut self, id: u32, r: SourceRange) -> Result<(), DataplaneError> {
            self.0.put_source_range(id, r)
        }
        fn delete_source_range(&mut self, id: u32, r: SourceRange) -> Result<(), DataplaneError> {
            self.0.delete_source_range(id, r)
        }
        fn put_maglev_chunk(
            &mut self,
            k: MaglevKey,
            c: &MaglevChunk,
        ) -> Result<(), DataplaneError> {
            self.0.put_maglev_chunk(k, c)
        }
        fn delete_maglev_chunk(&mut self, k: MaglevKey) -> Result<(), DataplaneError> {
            self.0.delete_maglev_chunk(k)
        }
        fn dump(&self) -> Result<Programmed, DataplaneError> {
            self.0.dump()
        }
    }

    // 2,000 backends into room for 100: 1,900 writes fail.
    let mut d = DesiredState::default();
    for i in 0..1_000u32 {
        let b = |k: u32| BackendAddr {
            addr: Ipv4Addr::from(0xc612_0000 + i * 2 + k).into(),
            port: 8080,
            proto: IPPROTO_TCP,
        };
        let key = FrontendKey {
            addr: Ipv4Addr::from(0xc613_0000 + i).into(),
            port: 80,
            proto: IPPROTO_TCP,
            scope: SCOPE_INTERNAL,
        };
        let mut fe = frontend(&key, &[]);
        fe.backends = vec![b(0), b(1)];
        d.frontends.insert(key, fe);
    }
    let mut w = Writer::adopt(Offered(InMemory::with_capacity(100_000, 100, 100_000), 0)).unwrap();
    let report = w.sync(&d);
    assert_eq!(w.dataplane().0.programmed().backends.len(), 100);
    assert!(!report.errors.is_empty());
    // All of them at once, then at most 64 after each failure: 2,000 +
    // 1,900 × 64 = 123,600. Handing every call all the writes left would
    // be 1,900 × 950 on average, about 1.8 million.
    let offered = w.dataplane().1;
    assert!(offered <= 2_000 + 1_900 * 64, "{offered} entries offered");
}

/// More than 65,535 frontends (a node of 70,000 ClusterIP Services): each
/// gets a reverse-NAT id of its own, past 65,535 and below the reverse-NAT
/// map's size (the per-frontend arrays are indexed by it); with a map of
/// 65,536 entries, the frontends beyond its 65,535 ids are refused, each
/// with an error naming the map and its capacity, and the others served.
#[test]
fn more_than_65535_frontends_get_ids_of_their_own_below_the_map_size() {
    const N: u32 = 70_000;
    let base = u32::from(Ipv4Addr::new(198, 18, 0, 0));
    let mut d = DesiredState::default();
    for i in 0..N {
        let k = FrontendKey {
            addr: Ipv4Addr::from(base + i).into(),
            port: 80,
            proto: IPPROTO_TCP,
            scope: SCOPE_INTERNAL,
        };
        let mut fe = frontend(&key(1, 80, IPPROTO_TCP), &[1]);
        fe.service = format!("default/svc-{i}").into();
        d.frontends.insert(k, fe);
    }

    let dp = InMemory::with_capacity(4 * N, 16, 80_000).without_checks();
    let mut w = Writer::adopt(dp).unwrap();
    let r = w.sync(&d);
    assert!(r.errors.is_empty(), "{:?}", r.errors.first());
    assert_eq!(r.frontends_added, N as usize);
    let ids: std::collections::BTreeSet<u32> = w.rev_nat_ids().values().copied().collect();
    assert_eq!(ids.len(), N as usize, "one id per frontend");
    assert_eq!(*ids.first().unwrap(), 1);
    assert_eq!(*ids.last().unwrap(), N, "ids past 65,535");
    let rev_nat = &w.dataplane().programmed().rev_nat;
    assert_eq!(rev_nat.len(), N as usize);
    assert!(w
        .dataplane()
        .programmed()
        .services
        .iter()
        .filter(|(k, _)| k.slot == 0)
        .all(|(_, v)| rev_nat.contains_key(&v.rev_nat_id)));

    let dp = InMemory::with_capacity(4 * N, 16, 65_536).without_checks();
    let mut w = Writer::adopt(dp).unwrap();
    let r = w.sync(&d);
    assert_eq!(r.frontends_added, 65_535);
    assert_eq!(r.errors.len(), (N - 65_535) as usize);
    let e = r.errors[0].1.to_string();
    assert!(e.contains("REVNAT4") && e.contains("65535"), "{e}");
    assert!(w.rev_nat_ids().values().all(|id| (1..=65_535).contains(id)));
}

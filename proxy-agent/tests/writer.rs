//! The writer against the in-memory dataplane: make-before-break order, the
//! packet invariant after every single operation, failures, adoption.
use std::net::{IpAddr, Ipv4Addr};

use proxy_agent::dataplane::{BackendEntry, Dataplane, InMemory, Op, ServiceKey, Writer};
use proxy_agent::model::{BackendAddr, DesiredState, Frontend, FrontendKey, ServiceAge};
use proxy_common::{
    backend_state, Backend4, Svc4Key, Svc6Key, SvcValue, IPPROTO_TCP, IPPROTO_UDP, SCOPE_EXTERNAL,
    SCOPE_INTERNAL,
};

/// The IPv4 address of a test frontend or backend (all of them are).
fn v4(addr: IpAddr) -> Ipv4Addr {
    match addr {
        IpAddr::V4(a) => a,
        IpAddr::V6(a) => panic!("IPv6 address {a} in an IPv4 test"),
    }
}

fn key(last: u8, port: u16, proto: u8) -> FrontendKey {
    FrontendKey {
        addr: Ipv4Addr::new(198, 19, 0, last).into(),
        port,
        proto,
        scope: SCOPE_INTERNAL,
    }
}

fn backend(last: u8, proto: u8) -> BackendAddr {
    BackendAddr {
        addr: Ipv4Addr::new(198, 18, 1, last).into(),
        port: 8080,
        proto,
    }
}

fn frontend(k: &FrontendKey, backends: &[u8]) -> Frontend {
    let mut backends: Vec<BackendAddr> = backends.iter().map(|b| backend(*b, k.proto)).collect();
    backends.sort();
    backends.dedup();
    Frontend {
        service: format!("default/svc-{}", v4(k.addr).octets()[3]).into(),
        port_name: "".into(),
        backends,
        flags: 0,
        affinity_timeout_s: 0,
        source_ranges: Vec::new(),
        retained: Vec::new(),
        host_alias: None,
    }
}

fn desired(entries: &[(FrontendKey, &[u8])]) -> DesiredState {
    let mut d = DesiredState::default();
    for (k, b) in entries {
        d.frontends.insert(*k, frontend(k, b));
    }
    d
}

fn svc(k: &FrontendKey, slot: u16) -> Svc4Key {
    Svc4Key::new(v4(k.addr), k.port, k.proto, k.scope, slot)
}

fn position(ops: &[Op], pred: impl Fn(&Op) -> bool) -> usize {
    ops.iter().position(pred).expect("operation not found")
}

fn is_put(ops: &Op, key: Svc4Key) -> bool {
    matches!(ops, Op::PutService(ServiceKey::V4(k), _) if *k == key)
}

fn is_delete(ops: &Op, key: Svc4Key) -> bool {
    matches!(ops, Op::DeleteService(ServiceKey::V4(k)) if *k == key)
}

/// The dataplane holds exactly `desired`: every frontend's count and slots,
/// no extra entries, backends and reverse-NAT entries only for what is used.
fn assert_programmed(writer: &Writer<InMemory>, desired: &DesiredState) {
    let p = writer.dataplane().programmed();
    let mut entries = 0;
    let mut used = std::collections::BTreeSet::new();
    for (k, fe) in &desired.frontends {
        let slot0 = p
            .services
            .get(&svc(k, 0))
            .unwrap_or_else(|| panic!("{k} missing"));
        assert_eq!(slot0.count as usize, fe.backends.len(), "{k}");
        assert_eq!(
            (slot0.flags, slot0.affinity_timeout_s),
            (fe.flags, fe.affinity_timeout_s)
        );
        for (i, b) in fe.backends.iter().enumerate() {
            let slot = p.services[&svc(k, i as u16 + 1)];
            let be = p.backends[&slot.backend_id];
            assert_eq!(
                (IpAddr::V4(be.addr()), be.port(), be.proto),
                (b.addr, b.port, b.proto),
                "{k} slot {}",
                i + 1
            );
            assert_eq!(be.state, backend_state::ACTIVE);
            used.insert(*b);
        }
        let rev = p.rev_nat[&slot0.rev_nat_id];
        assert_eq!((IpAddr::V4(rev.addr()), rev.port()), (k.addr, k.port));
        entries += 1 + fe.backends.len();
    }
    assert_eq!(p.services.len(), entries, "extra service entries");
    assert_eq!(p.backends.len(), used.len(), "extra backends");
    assert_eq!(
        p.rev_nat.len(),
        desired.frontends.len(),
        "extra reverse-NAT entries"
    );
    let ids4 = writer
        .backend_ids()
        .keys()
        .filter(|b| b.addr.is_ipv4())
        .count();
    assert_eq!(ids4, used.len());
}

#[test]
fn add_writes_backends_then_rev_nat_then_slots_then_slot0() {
    let a = key(1, 80, IPPROTO_TCP);
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    let d = desired(&[(a, &[1, 2])]);
    let report = w.sync(&d);
    assert!(report.errors.is_empty());
    assert_eq!(
        (report.frontends_added, report.backends_added, report.writes),
        (1, 2, 6)
    );
    let ops = w.dataplane().ops();
    let last_backend = ops
        .iter()
        .rposition(|o| matches!(o, Op::PutBackend(..)))
        .unwrap();
    let rev = position(ops, |o| matches!(o, Op::PutRevNat(..)));
    let slot1 = position(ops, |o| is_put(o, svc(&a, 1)));
    let slot2 = position(ops, |o| is_put(o, svc(&a, 2)));
    let slot0 = position(ops, |o| is_put(o, svc(&a, 0)));
    assert!(
        last_backend < rev && rev < slot1 && slot1 < slot0 && slot2 < slot0,
        "{ops:#?}"
    );
    assert!(w.dataplane().violations().is_empty());
    assert_programmed(&w, &d);
}

#[test]
fn grow_writes_new_slots_before_slot0() {
    let a = key(1, 80, IPPROTO_TCP);
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    w.sync(&desired(&[(a, &[1, 2])]));
    w.dataplane_mut().take_ops();
    let d = desired(&[(a, &[1, 2, 3])]);
    let report = w.sync(&d);
    assert_eq!((report.frontends_updated, report.backends_added), (1, 1));
    let ops = w.dataplane().ops();
    let backend = position(ops, |o| matches!(o, Op::PutBackend(..)));
    let slot3 = position(ops, |o| is_put(o, svc(&a, 3)));
    let slot0 = position(
        ops,
        |o| matches!(o, Op::PutService(ServiceKey::V4(k), v) if *k == svc(&a, 0) && v.count == 3),
    );
    assert!(backend < slot3 && slot3 < slot0, "{ops:#?}");
    assert_eq!(ops.len(), 3, "unchanged slots are not rewritten: {ops:#?}");
    assert!(w.dataplane().violations().is_empty());
    assert_programmed(&w, &d);
}

#[test]
fn shrink_writes_slot0_before_deleting_obsolete_slots_and_backends() {
    let a = key(1, 80, IPPROTO_TCP);
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    w.sync(&desired(&[(a, &[1, 2, 3])]));
    w.dataplane_mut().take_ops();
    let d = desired(&[(a, &[2])]);
    let report = w.sync(&d);
    assert_eq!(report.backends_removed, 2);
    let ops = w.dataplane().ops();
    let slot1 = position(ops, |o| is_put(o, svc(&a, 1)));
    let slot0 = position(
        ops,
        |o| matches!(o, Op::PutService(ServiceKey::V4(k), v) if *k == svc(&a, 0) && v.count == 1),
    );
    let del2 = position(ops, |o| is_delete(o, svc(&a, 2)));
    let del3 = position(ops, |o| is_delete(o, svc(&a, 3)));
    let first_backend_delete = position(ops, |o| matches!(o, Op::DeleteBackend(..)));
    assert!(slot1 < slot0 && slot0 < del2 && slot0 < del3, "{ops:#?}");
    assert!(
        del2 < first_backend_delete && del3 < first_backend_delete,
        "{ops:#?}"
    );
    assert!(w.dataplane().violations().is_empty());
    assert_programmed(&w, &d);
}

#[test]
fn remove_deletes_slot0_first_then_slots_then_rev_nat_then_backends() {
    let (a, b) = (key(1, 80, IPPROTO_TCP), key(2, 80, IPPROTO_TCP));
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    w.sync(&desired(&[(a, &[1, 2]), (b, &[2])]));
    w.dataplane_mut().take_ops();
    let d = desired(&[(b, &[2])]);
    let report = w.sync(&d);
    assert_eq!((report.frontends_removed, report.backends_removed), (1, 1));
    let ops = w.dataplane().ops();
    assert!(is_delete(&ops[0], svc(&a, 0)), "{ops:#?}");
    assert!(
        is_delete(&ops[1], svc(&a, 1)) && is_delete(&ops[2], svc(&a, 2)),
        "{ops:#?}"
    );
    assert!(matches!(ops[3], Op::DeleteRevNat(..)), "{ops:#?}");
    assert!(
        matches!(ops[4], Op::DeleteBackend(..)) && ops.len() == 5,
        "backend 2 is still used: {ops:#?}"
    );
    assert!(w.dataplane().violations().is_empty());
    assert_programmed(&w, &d);
}

/// Removed frontends' deletes go in batch calls, one step for all of them
/// at a time (every slot 0, then the slots, then the reverse NAT). A slot 0
/// that cannot be deleted keeps its frontend whole and answering (its
/// slots, reverse NAT and backends with it) while the frontends after it
/// in the same call are removed; the next sync removes it.
#[test]
fn a_removed_frontend_whose_slot0_stays_is_kept_whole_and_the_others_go() {
    let (a, b, c) = (
        key(1, 80, IPPROTO_TCP),
        key(2, 80, IPPROTO_TCP),
        key(3, 80, IPPROTO_TCP),
    );
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    let all = desired(&[(a, &[1, 2]), (b, &[3, 4]), (c, &[5])]);
    assert!(w.sync(&all).errors.is_empty());
    let before = w.dataplane().programmed().clone();
    let b_rev = before.services[&svc(&b, 0)].rev_nat_id;

    // A's slot 0 goes, B's (the second delete) fails, C's goes.
    w.dataplane_mut().fail_after(1, 1);
    let report = w.sync(&DesiredState::default());
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    assert!(
        report.errors[0]
            .0
            .starts_with(&format!("{}:80/TCP", b.addr)),
        "{:?}",
        report.errors
    );
    assert_eq!(report.frontends_removed, 2);
    let after = w.dataplane().programmed();
    for slot in 0..=2 {
        assert_eq!(
            after.services.get(&svc(&b, slot)),
            before.services.get(&svc(&b, slot)),
            "B whole, slot {slot}"
        );
    }
    assert!(after.rev_nat.contains_key(&b_rev), "B's reverse NAT kept");
    assert_eq!(
        after.services.len(),
        3,
        "A's and C's entries gone: {:?}",
        after.services
    );
    assert_eq!(after.rev_nat.len(), 1, "only B's reverse NAT is left");
    assert_eq!(after.backends.len(), 2, "B's two backends are left");
    assert!(w.dataplane().violations().is_empty());

    let report = w.sync(&DesiredState::default());
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.frontends_removed, 1);
    let after = w.dataplane().programmed();
    assert!(after.services.is_empty() && after.rev_nat.is_empty() && after.backends.is_empty());
    assert!(w.dataplane().violations().is_empty());
}

/// A removed frontend whose reverse-NAT entry cannot be deleted (its slots
/// are gone) leaves that entry to the next sync, full or incremental, which
/// deletes it: nothing is left in the maps for the agent's lifetime.
#[test]
fn a_reverse_nat_entry_that_fails_to_delete_is_deleted_by_the_next_sync() {
    let a = key(1, 80, IPPROTO_TCP);
    for incremental in [false, true] {
        let mut w = Writer::adopt(InMemory::default()).unwrap();
        assert!(w.sync(&desired(&[(a, &[1, 2])])).errors.is_empty());
        // Slot 0, slot 1, slot 2 go; the reverse-NAT delete (op 3) fails,
        // and so does the same sync's second try (an unowned entry's).
        w.dataplane_mut().fail_after(3, 2);
        let empty = DesiredState::default();
        let report = w.sync(&empty);
        assert_eq!(report.errors.len(), 2, "{:?}", report.errors);
        assert_eq!(w.dataplane().programmed().rev_nat.len(), 1);
        assert!(w.dataplane().programmed().services.is_empty());

        let report = if incremental {
            let none = std::collections::BTreeSet::new();
            w.sync_changed(
                &empty,
                proxy_agent::dataplane::Changes {
                    frontends: &none,
                    local_endpoints: &std::collections::BTreeSet::new(),
                },
            )
        } else {
            w.sync(&empty)
        };
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        let left = w.dataplane().programmed();
        assert!(
            left.rev_nat.is_empty() && left.backends.is_empty(),
            "incremental {incremental}: {:?} {:?}",
            left.rev_nat,
            left.backends
        );
        assert!(w.dataplane().violations().is_empty());
    }
}

#[test]
fn unchanged_state_writes_nothing_and_backends_are_shared() {
    let (a, b) = (key(1, 80, IPPROTO_TCP), key(1, 81, IPPROTO_TCP));
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    let d = desired(&[(a, &[1, 2]), (b, &[2, 3])]);
    w.sync(&d);
    assert_eq!(
        w.backend_ids().len(),
        3,
        "backend 2 shared by both frontends"
    );
    assert!(w.sync(&d).is_noop());
    let empty = desired(&[(a, &[])]);
    w.sync(&empty);
    let slot0 = w.dataplane().programmed().services[&svc(&a, 0)];
    assert_eq!(
        slot0.count, 0,
        "a frontend without backends keeps slot 0 with count 0"
    );
    assert_programmed(&w, &empty);
}

/// A tiny deterministic PRNG (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn randomized_sequence_of_200_states_never_breaks_the_invariant() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let keys: Vec<FrontendKey> = (1..=4)
        .flat_map(|ip| {
            [
                key(ip, 80, IPPROTO_TCP),
                key(ip, 80, IPPROTO_UDP),
                key(ip, 443, IPPROTO_TCP),
            ]
        })
        .collect();
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    let mut ids_seen = std::collections::BTreeMap::new();
    for round in 0..200 {
        let mut d = DesiredState::default();
        for k in &keys {
            if rng.below(3) == 0 {
                continue;
            }
            let backends: Vec<u8> = (1..=10).filter(|_| rng.below(2) == 0).collect();
            let mut fe = frontend(k, &backends);
            fe.flags = rng.below(2) as u16;
            d.frontends.insert(*k, fe);
        }
        // Now and then an operation fails in the middle of a sync.
        let failing = rng.below(4) == 0;
        if failing {
            let n = rng.below(3) as usize + 1;
            w.dataplane_mut().fail_next(n);
        }
        w.sync(&d);
        w.dataplane_mut().fail_next(0);
        assert!(
            w.dataplane().violations().is_empty(),
            "round {round}: {:#?}",
            w.dataplane().violations()
        );
        if failing {
            // The next sync converges.
            w.sync(&d);
        }
        assert_programmed(&w, &d);
        assert!(
            w.sync(&d).is_noop(),
            "round {round}: a second sync writes nothing"
        );
        // A backend keeps its id while it stays in use (a failed sync may drop
        // backends that only a failed frontend wanted; they come back with new ids).
        for (b, id) in w.backend_ids() {
            if let Some(old) = ids_seen.get(b).filter(|_| !failing) {
                assert_eq!(old, id, "round {round}: backend {b} changed id");
            }
        }
        ids_seen = w.backend_ids().clone();
        assert!(w.backend_ids().values().all(|id| *id != 0));
        assert!(w.rev_nat_ids().values().all(|id| *id != 0));
        w.dataplane_mut().take_ops();
    }
    assert!(w.dataplane().violations().is_empty());
}

#[test]
fn backend_ids_are_stable_while_in_use_and_never_zero() {
    let (a, b) = (key(1, 80, IPPROTO_TCP), key(2, 80, IPPROTO_TCP));
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    w.sync(&desired(&[(a, &[1, 2])]));
    let id2 = w.backend_ids()[&backend(2, IPPROTO_TCP)];
    w.sync(&desired(&[(b, &[2, 3])]));
    assert_eq!(w.backend_ids()[&backend(2, IPPROTO_TCP)], id2);
    let id1_old = 1;
    assert!(
        !w.backend_ids().contains_key(&backend(1, IPPROTO_TCP)),
        "backend 1 no longer used"
    );
    w.sync(&desired(&[(b, &[1, 2, 3])]));
    let id1 = w.backend_ids()[&backend(1, IPPROTO_TCP)];
    assert!(
        id1 != 0 && id1 > id1_old,
        "ids are allocated monotonically, not reused at once"
    );
    assert_eq!(w.backend_ids()[&backend(2, IPPROTO_TCP)], id2);
}

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

#[test]
fn adopt_after_sync_keeps_ids_and_writes_nothing() {
    let keys = [
        key(1, 80, IPPROTO_TCP),
        key(1, 53, IPPROTO_UDP),
        key(2, 80, IPPROTO_TCP),
    ];
    let d = desired(&[(keys[0], &[1, 2, 3]), (keys[1], &[4]), (keys[2], &[])]);
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    w.sync(&d);
    let (backend_ids, rev_nat_ids) = (w.backend_ids().clone(), w.rev_nat_ids().clone());

    let mut restarted = Writer::adopt(w.into_dataplane()).unwrap();
    assert_eq!(restarted.backend_ids(), &backend_ids);
    assert_eq!(restarted.rev_nat_ids(), &rev_nat_ids);
    restarted.dataplane_mut().take_ops();
    let report = restarted.sync(&d);
    assert!(
        report.is_noop(),
        "{report:?}: {:#?}",
        restarted.dataplane().ops()
    );
    assert_eq!(restarted.backend_ids(), &backend_ids);

    // New ids after a restart do not collide with adopted ones.
    let more = desired(&[
        (keys[0], &[1, 2, 3, 5]),
        (keys[1], &[4]),
        (keys[2], &[]),
        (key(3, 80, IPPROTO_TCP), &[6]),
    ]);
    restarted.sync(&more);
    let new_id = restarted.backend_ids()[&backend(5, IPPROTO_TCP)];
    assert!(backend_ids.values().all(|id| *id != new_id));
    let new_rev = restarted.rev_nat_ids()[&key(3, 80, IPPROTO_TCP)];
    assert!(rev_nat_ids.values().all(|id| *id != new_rev));
    assert!(restarted.dataplane().violations().is_empty());
    assert_programmed(&restarted, &more);
}

#[test]
fn adopt_cleans_up_inconsistent_leftovers_at_first_sync() {
    let a = key(1, 80, IPPROTO_TCP);
    let gone = key(9, 80, IPPROTO_TCP);
    let mut dp = InMemory::default();
    let b1 = Backend4::new(
        Ipv4Addr::new(198, 18, 1, 1),
        8080,
        IPPROTO_TCP,
        backend_state::ACTIVE,
    );
    dp.put_backend(7, b1).unwrap();
    dp.put_backend(
        8,
        Backend4::new(Ipv4Addr::new(198, 18, 1, 99), 8080, IPPROTO_TCP, 0),
    )
    .unwrap();
    dp.put_rev_nat(3, proxy_common::RevNat4::new(v4(a.addr), a.port))
        .unwrap();
    dp.put_rev_nat(
        4,
        proxy_common::RevNat4::new(Ipv4Addr::new(198, 19, 0, 200), 1),
    )
    .unwrap();
    dp.put_service(svc(&a, 1), SvcValue::slot(7)).unwrap();
    dp.put_service(svc(&a, 0), SvcValue::frontend(1, 3, 0, 0))
        .unwrap();
    dp.put_service(svc(&a, 2), SvcValue::slot(8)).unwrap(); // beyond count
    dp.put_service(svc(&gone, 1), SvcValue::slot(7)).unwrap(); // slots without a frontend
    let mut w = Writer::adopt(dp).unwrap();
    assert_eq!(w.backend_ids()[&backend(1, IPPROTO_TCP)], 7);
    w.dataplane_mut().take_ops();

    let d = desired(&[(a, &[1])]);
    let report = w.sync(&d);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(w.rev_nat_ids()[&a], 3, "reverse-NAT id kept");
    assert_eq!(
        w.backend_ids()[&backend(1, IPPROTO_TCP)],
        7,
        "backend id kept"
    );
    assert!(w.dataplane().violations().is_empty());
    assert_programmed(&w, &d);
    assert!(w.sync(&d).is_noop());
}

/// C5: a terminating endpoint leaves the slots (no new flows) but stays in the
/// backends map while it is listed, so flows that use it keep working; it is
/// deleted only once it is gone from the endpoints.
#[test]
fn terminating_backends_stay_in_the_map_without_slots_c5() {
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    let k = key(10, 80, IPPROTO_TCP);
    let mut desired = DesiredState::default();
    desired.frontends.insert(k, frontend(&k, &[1, 2]));
    assert!(w.sync(&desired).errors.is_empty());
    let b2 = backend(2, IPPROTO_TCP);
    let id2 = w.backend_ids()[&b2];

    // Endpoint 2 starts terminating: out of the slots, kept in the map.
    let mut fe = frontend(&k, &[1]);
    fe.retained = vec![b2];
    desired.frontends.insert(k, fe);
    assert!(w.sync(&desired).errors.is_empty());
    assert_eq!(w.programmed_slots(&k).unwrap().len(), 1);
    let p = w.dataplane().programmed().clone();
    assert!(
        p.backends.contains_key(&id2),
        "terminating backend deleted while listed"
    );
    assert_eq!(
        p.backends[&id2].state,
        proxy_common::backend_state::TERMINATING
    );
    assert_eq!(w.backend_ids()[&b2], id2, "its id must not change");

    // Gone from the endpoints: deleted.
    desired.frontends.insert(k, frontend(&k, &[1]));
    assert!(w.sync(&desired).errors.is_empty());
    assert!(!w.dataplane().programmed().backends.contains_key(&id2));
    assert!(w.dataplane().violations().is_empty());
}

mod maglev {
    //! Maglev tables: written whole before slot 0 reads them, rebuilt into
    //! the other generation, old ones deleted after the switch, capped.
    use super::*;
    use proxy_agent::dataplane::MaglevSettings;
    use proxy_agent::model::{maglev_table, LbAlgorithm};
    use proxy_common::{lb::MaglevKey, svc_flags};

    const SIZE: u16 = 251;

    fn maglev_desired(entries: &[(FrontendKey, &[u8])]) -> DesiredState {
        let mut d = desired(entries);
        for fe in d.frontends.values_mut() {
            fe.flags |= LbAlgorithm::Maglev.flags();
        }
        d
    }

    fn writer(max_tables: usize) -> Writer<InMemory> {
        Writer::adopt(InMemory::default())
            .unwrap()
            .with_maglev(MaglevSettings {
                table_size: SIZE,
                max_tables,
            })
    }

    /// The backend addresses slot 0 of `k` reads, entry by entry.
    fn table_of(w: &Writer<InMemory>, k: &FrontendKey) -> Vec<BackendAddr> {
        let p = w.dataplane().programmed();
        let s0 = p.services[&svc(k, 0)];
        assert_eq!(s0.maglev_size, SIZE);
        let generation = u8::from(s0.flags & svc_flags::MAGLEV_GEN != 0);
        let mut out = Vec::new();
        for c in 0..proxy_common::lb::maglev_chunks(SIZE) {
            let chunk = p.maglev[&MaglevKey::new(s0.rev_nat_id, generation, c as u16)];
            for id in chunk.backend_ids.iter().take(SIZE as usize - out.len()) {
                let b = p.backends[id];
                out.push(BackendAddr {
                    addr: b.addr().into(),
                    port: b.port(),
                    proto: b.proto,
                });
            }
        }
        out
    }

    fn expected(d: &DesiredState, k: &FrontendKey) -> Vec<BackendAddr> {
        let fe = &d.frontends[k];
        maglev_table(&fe.backends, SIZE)
            .iter()
            .map(|i| fe.backends[*i as usize])
            .collect()
    }

    #[test]
    fn tables_are_written_before_slot0_and_rebuilt_into_the_other_generation() {
        let a = key(1, 80, IPPROTO_TCP);
        let mut w = writer(16);
        let d1 = maglev_desired(&[(a, &[1, 2, 3])]);
        let r = w.sync(&d1);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert_eq!(table_of(&w, &a), expected(&d1, &a));
        let ops = w.dataplane().ops();
        let last_chunk = ops
            .iter()
            .rposition(|o| matches!(o, Op::PutMaglevChunk(_)))
            .unwrap();
        assert!(last_chunk < position(ops, |o| is_put(o, svc(&a, 0))));
        let gen1 = w.dataplane().programmed().services[&svc(&a, 0)].flags & svc_flags::MAGLEV_GEN;

        // One backend replaced: the other generation is written, slot 0
        // switches, the old generation is deleted after.
        w.dataplane_mut().take_ops();
        let d2 = maglev_desired(&[(a, &[1, 2, 4])]);
        assert!(w.sync(&d2).errors.is_empty());
        assert_eq!(table_of(&w, &a), expected(&d2, &a));
        let s0 = w.dataplane().programmed().services[&svc(&a, 0)];
        assert_ne!(s0.flags & svc_flags::MAGLEV_GEN, gen1);
        let ops = w.dataplane().ops();
        let switch = position(ops, |o| is_put(o, svc(&a, 0)));
        assert!(
            ops[..switch]
                .iter()
                .filter(|o| matches!(o, Op::PutMaglevChunk(_)))
                .count()
                == proxy_common::lb::maglev_chunks(SIZE) as usize
        );
        assert!(ops[..switch]
            .iter()
            .all(|o| !matches!(o, Op::DeleteMaglevChunk(_))));
        let chunks = proxy_common::lb::maglev_chunks(SIZE) as usize;
        assert_eq!(
            w.dataplane().programmed().maglev.len(),
            chunks,
            "old generation left"
        );
        assert_eq!(w.maglev_usage(), (1, u64::from(SIZE) * 4));

        // Unchanged: nothing written.
        assert!(w.sync(&d2).is_noop());
        // Back to random: slot 0 first, then the table is deleted.
        w.dataplane_mut().take_ops();
        let d3 = desired(&[(a, &[1, 2, 4])]);
        assert!(w.sync(&d3).errors.is_empty());
        let ops = w.dataplane().ops();
        let switch = position(ops, |o| is_put(o, svc(&a, 0)));
        let first_delete = position(ops, |o| matches!(o, Op::DeleteMaglevChunk(_)));
        assert!(switch < first_delete);
        assert!(w.dataplane().programmed().maglev.is_empty());
        assert_programmed(&w, &d3);
        assert!(
            w.dataplane().violations().is_empty(),
            "{:?}",
            w.dataplane().violations()
        );
    }

    /// A chunk that fails leaves the frontend reading its old table; the
    /// next sync completes the rebuild. The invariant holds after every op.
    #[test]
    fn a_failed_chunk_keeps_the_old_table_and_the_next_sync_completes() {
        let a = key(1, 80, IPPROTO_TCP);
        let mut w = writer(16);
        let d1 = maglev_desired(&[(a, &[1, 2])]);
        assert!(w.sync(&d1).errors.is_empty());
        let d2 = maglev_desired(&[(a, &[1, 2, 3])]);
        // Backend 3 and its slot go through; the table's (only) chunk fails.
        w.dataplane_mut().fail_after(2, 1);
        let r = w.sync(&d2);
        assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
        assert!(
            r.errors[0]
                .1
                .to_string()
                .contains(proxy_common::map_names::MAGLEV),
            "{:?}",
            r.errors
        );
        assert_eq!(table_of(&w, &a), expected(&d1, &a));
        let r = w.sync(&d2);
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        assert_eq!(table_of(&w, &a), expected(&d2, &a));
        assert_eq!(
            w.dataplane().programmed().maglev.len(),
            proxy_common::lb::maglev_chunks(SIZE) as usize
        );
        assert!(
            w.dataplane().violations().is_empty(),
            "{:?}",
            w.dataplane().violations()
        );
    }

    /// Over `maxTables`, a frontend is refused with a clear error and keeps
    /// its previous state; nothing else is disturbed.
    #[test]
    fn the_table_cap_refuses_the_frontend_with_an_error() {
        let (a, b) = (key(1, 80, IPPROTO_TCP), key(2, 80, IPPROTO_TCP));
        let mut w = writer(1);
        let d = maglev_desired(&[(a, &[1, 2]), (b, &[3, 4])]);
        let r = w.sync(&d);
        assert_eq!(r.maglev_refused, 1);
        assert_eq!(r.errors.len(), 1);
        let (what, e) = &r.errors[0];
        assert!(what.contains("svc-2"), "{what}");
        assert!(e.to_string().contains("maxTables"), "{e}");
        assert_eq!(table_of(&w, &a), expected(&d, &a));
        assert!(!w
            .dataplane()
            .programmed()
            .services
            .contains_key(&svc(&b, 0)));
        assert_eq!(w.maglev_usage().0, 1);
    }

    /// A restarted agent adopts the tables: nothing is rewritten.
    #[test]
    fn adopted_tables_are_not_rewritten() {
        let a = key(1, 80, IPPROTO_TCP);
        let mut w = writer(16);
        let d = maglev_desired(&[(a, &[1, 2, 3])]);
        assert!(w.sync(&d).errors.is_empty());
        let mut dp = w.into_dataplane();
        dp.take_ops();
        let mut w = Writer::adopt(dp).unwrap().with_maglev(MaglevSettings {
            table_size: SIZE,
            max_tables: 16,
        });
        let r = w.sync(&d);
        assert!(r.is_noop(), "{r:?}");
        assert_eq!(table_of(&w, &a), expected(&d, &a));
    }
}

/// Adding `loadBalancerSourceRanges` fails closed: a range that cannot be
/// written is reported and retried, but slot 0 takes the restriction anyway,
/// so the frontend is never left open to every client.
#[test]
fn source_ranges_that_fail_to_write_leave_the_frontend_closed() {
    use proxy_common::svc_flags;
    let a = key(1, 80, IPPROTO_TCP);
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    let open = desired(&[(a, &[1, 2])]);
    assert!(w.sync(&open).errors.is_empty());
    let mut closed = open.clone();
    let fe = closed.frontends.get_mut(&a).unwrap();
    fe.flags |= svc_flags::SOURCE_RANGES;
    fe.source_ranges = vec![(Ipv4Addr::new(198, 18, 4, 0).into(), 24)];
    // The range's write fails.
    w.dataplane_mut().fail_next(1);
    let r = w.sync(&closed);
    assert_eq!(r.errors.len(), 1, "{:?}", r.errors);
    let p = w.dataplane().programmed();
    let slot0 = p.services[&svc(&a, 0)];
    assert_ne!(
        slot0.flags & svc_flags::SOURCE_RANGES,
        0,
        "the frontend was left open"
    );
    assert!(p.source_ranges.is_empty());
    // The next sync writes the range.
    let r = w.sync(&closed);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(w.dataplane().programmed().source_ranges.len(), 1);
    assert!(w.dataplane().violations().is_empty());
}

/// Issue 15: an affinity prune that failed is retried at the next sync,
/// even when nothing else about the frontend changes.
#[test]
fn failed_affinity_prune_is_retried_next_sync() {
    let k = key(40, 80, IPPROTO_TCP);
    let with_affinity = |backends: &[u8]| {
        let mut d = desired(&[(k, backends)]);
        d.frontends.get_mut(&k).unwrap().affinity_timeout_s = 300;
        d
    };
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    assert!(w.sync(&with_affinity(&[1, 2])).errors.is_empty());
    let id = w.rev_nat_ids()[&k];
    let b1 = w.backend_ids()[&backend(1, IPPROTO_TCP)];
    let before = w.dataplane().prunes().len();

    // Backend 2 leaves; pruning its clients' affinity fails.
    w.dataplane_mut().fail_next_prunes(1);
    let report = w.sync(&with_affinity(&[1]));
    assert_eq!(report.errors.len(), 1, "{report:?}");
    assert_eq!(w.dataplane().prunes().len(), before);
    assert!(w.affinity_pending().contains(&k));

    // Nothing changes, yet the next sync retries the prune.
    let report = w.sync(&with_affinity(&[1]));
    assert!(report.errors.is_empty(), "{report:?}");
    let prunes = w.dataplane().prunes();
    assert_eq!(prunes.len(), before + 1, "prune not retried");
    assert_eq!(prunes[before], (id, [b1].into_iter().collect()));
    assert!(w.affinity_pending().is_empty());

    // Done: a further sync prunes nothing.
    w.sync(&with_affinity(&[1]));
    assert_eq!(w.dataplane().prunes().len(), before + 1);
}

/// Issue 13: the affinity maps are walked once per sync for all the
/// frontends it prunes, and not at all for frontends whose reverse-NAT id
/// can have no entry: programming thousands of frontends without affinity
/// used to walk both maps once per frontend (3 of the 3.6 s of writing
/// 50,000 Services into the kernel's maps).
#[test]
fn affinity_maps_are_walked_at_most_once_per_sync() {
    let keys: Vec<FrontendKey> = (1..=200u8).map(|i| key(i, 80, IPPROTO_TCP)).collect();
    let state = |backends: &[u8], affinity: u32| {
        let entries: Vec<(FrontendKey, &[u8])> = keys.iter().map(|k| (*k, backends)).collect();
        let mut d = desired(&entries);
        for fe in d.frontends.values_mut() {
            fe.affinity_timeout_s = affinity;
        }
        d
    };
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    assert!(w.sync(&state(&[1, 2], 0)).errors.is_empty());
    w.sync(&state(&[1, 3], 0));
    assert_eq!(
        w.dataplane().prune_walks(),
        &[] as &[usize],
        "no affinity: no walk"
    );

    // Affinity on: one walk per sync, whatever the number of frontends.
    let walks = |w: &Writer<InMemory>| w.dataplane().prune_walks().len();
    assert!(w.sync(&state(&[1, 3], 300)).errors.is_empty());
    assert_eq!(walks(&w), 1);
    w.sync(&state(&[1, 4], 300));
    assert_eq!(walks(&w), 2);
    let b1 = w.backend_ids()[&backend(1, IPPROTO_TCP)];
    let b4 = w.backend_ids()[&backend(4, IPPROTO_TCP)];
    let last = &w.dataplane().prunes()[w.dataplane().prunes().len() - 200..];
    assert!(last
        .iter()
        .all(|(_, keep)| *keep == [b1, b4].into_iter().collect()));
    // Off: every entry goes, in one walk; after that no id can have any.
    w.sync(&state(&[1, 4], 0));
    assert_eq!(walks(&w), 3);
    assert!(w.dataplane().prunes()[w.dataplane().prunes().len() - 200..]
        .iter()
        .all(|(_, keep)| keep.is_empty()));
    w.sync(&state(&[1, 5], 0));
    assert_eq!(walks(&w), 3, "affinity is off everywhere: nothing to prune");
}

/// Affinity entries a previous agent left under a reverse-NAT id no slot 0
/// names any more (its Service was deleted while the agent was down) are
/// deleted before a new frontend's slot 0 names that id: otherwise the new
/// Service's clients would be pinned to the old Service's backends.
#[test]
fn affinity_left_under_a_reused_id_is_pruned_before_slot0_names_it() {
    let k = key(41, 80, IPPROTO_TCP);
    let mut dp = InMemory::default();
    dp.set_affinity_ids([1, 2, 3]);
    let mut w = Writer::adopt(dp).unwrap();
    assert!(w.sync(&desired(&[(k, &[1, 2])])).errors.is_empty());
    let id = w.rev_nat_ids()[&k];
    assert!(
        (1..=3).contains(&id),
        "the test expects a reused id, got {id}"
    );
    let dp = w.dataplane();
    let slot0 = position(dp.ops(), |op| is_put(op, svc(&k, 0)));
    assert_eq!(dp.prunes().first(), Some(&(id, Default::default())));
    let walk = dp.prune_walks()[0];
    assert!(
        walk <= slot0,
        "prune of id {id} after {walk} ops, slot 0 written at op {slot0}"
    );

    // A prune that fails fails the frontend: its slot 0 is not written.
    let k2 = key(42, 80, IPPROTO_TCP);
    w.dataplane_mut().fail_next_prunes(1);
    let report = w.sync(&desired(&[(k, &[1, 2]), (k2, &[3])]));
    assert_eq!(report.errors.len(), 1, "{report:?}");
    assert!(!w
        .dataplane()
        .programmed()
        .services
        .contains_key(&svc(&k2, 0)));
    assert!(w
        .sync(&desired(&[(k, &[1, 2]), (k2, &[3])]))
        .errors
        .is_empty());
    assert!(w
        .dataplane()
        .programmed()
        .services
        .contains_key(&svc(&k2, 0)));
    assert!(w.dataplane().violations().is_empty());
}

mod incremental {
    //! `Writer::sync_changed`: told what changed, it leaves the dataplane as
    //! a full sync would, in the same order, writing only for what changed.
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;
    use proxy_agent::dataplane::{Changes, MaglevSettings};
    use proxy_agent::model::LbAlgorithm;
    use proxy_common::{lb::MaglevKey, svc_flags};

    const SIZE: u16 = 251;

    /// What packets see of one frontend: its slot 0 (count, flags without
    /// the Maglev generation, affinity, table size), the backends its slots
    /// resolve to, the address its reverse-NAT entry restores, its source
    /// ranges and the backends its Maglev table resolves to.
    #[derive(Debug, PartialEq, Eq)]
    struct Seen {
        count: u16,
        flags: u16,
        affinity: u32,
        maglev_size: u16,
        slots: Vec<Backend4>,
        rev_nat: Option<(Ipv4Addr, u16)>,
        source_ranges: BTreeSet<(IpAddr, u8)>,
        maglev: Vec<Backend4>,
    }

    /// Everything the maps hold, by content rather than by id: every
    /// frontend as packets see it, the slots left beyond a count, every
    /// backend entry, the counts of the other maps.
    #[derive(Debug, PartialEq, Eq)]
    struct Behaviour {
        frontends: BTreeMap<Svc4Key, Seen>,
        slots_beyond: BTreeMap<Svc4Key, Option<Backend4>>,
        backends: Vec<Backend4>,
        rev_nat: Vec<(Ipv4Addr, u16)>,
        source_range_ids: usize,
        maglev_chunks: usize,
    }

    fn behaviour(w: &Writer<InMemory>) -> Behaviour {
        let p = w.dataplane().programmed();
        let backend = |id: &u32| p.backends.get(id).copied();
        let mut frontends = BTreeMap::new();
        let mut slots_beyond = BTreeMap::new();
        for (k, v) in &p.services {
            if k.slot != 0 {
                let count = p.services.get(&k.with_slot(0)).map_or(0, |s0| s0.count);
                if k.slot > count {
                    slots_beyond.insert(*k, backend(&v.backend_id));
                }
                continue;
            }
            let slots = (1..=v.count)
                .map(|s| backend(&p.services[&k.with_slot(s)].backend_id).unwrap())
                .collect();
            let mut maglev = Vec::new();
            if svc_flags::algorithm(v.flags) == proxy_common::lb::alg::MAGLEV && v.count > 0 {
                let generation = u8::from(v.flags & svc_flags::MAGLEV_GEN != 0);
                for c in 0..proxy_common::lb::maglev_chunks(v.maglev_size) {
                    let chunk = p.maglev[&MaglevKey::new(v.rev_nat_id, generation, c as u16)];
                    let n = (v.maglev_size as usize - maglev.len()).min(chunk.backend_ids.len());
                    maglev.extend(chunk.backend_ids[..n].iter().map(|id| backend(id).unwrap()));
                }
            }
            frontends.insert(
                *k,
                Seen {
                    count: v.count,
                    flags: v.flags & !svc_flags::MAGLEV_GEN,
                    affinity: v.affinity_timeout_s,
                    maglev_size: v.maglev_size,
                    slots,
                    rev_nat: p.rev_nat.get(&v.rev_nat_id).map(|r| (r.addr(), r.port())),
                    source_ranges: p
                        .source_ranges
                        .get(&v.rev_nat_id)
                        .cloned()
                        .unwrap_or_default(),
                    maglev,
                },
            );
        }
        let mut backends: Vec<Backend4> = p.backends.values().copied().collect();
        backends.sort_by_key(|b| (b.addr(), b.port(), b.proto, b.state));
        let mut rev_nat: Vec<(Ipv4Addr, u16)> =
            p.rev_nat.values().map(|r| (r.addr(), r.port())).collect();
        rev_nat.sort();
        Behaviour {
            frontends,
            slots_beyond,
            backends,
            rev_nat,
            source_range_ids: p.source_ranges.len(),
            maglev_chunks: p.maglev.len(),
        }
    }

    fn pool(i: u64, proto: u8) -> BackendAddr {
        BackendAddr {
            addr: Ipv4Addr::new(198, 18, 1, 1 + (i % 12) as u8).into(),
            port: if i >= 12 { 9090 } else { 8080 },
            proto,
        }
    }

    /// A random frontend for `k`: backends and retained ones (disjoint)
    /// from a small shared pool; Maglev, affinity and source ranges now and
    /// then.
    fn random_frontend(rng: &mut Rng, k: &FrontendKey) -> Frontend {
        let mut fe = frontend(k, &[]);
        for i in 0..16 {
            match rng.below(8) {
                0 | 1 => fe.backends.push(pool(i, k.proto)),
                2 => fe.retained.push(pool(i, k.proto)),
                _ => {}
            }
        }
        fe.backends.sort();
        fe.retained.sort();
        if rng.below(3) == 0 {
            fe.flags |= LbAlgorithm::Maglev.flags();
        }
        if rng.below(4) == 0 {
            fe.affinity_timeout_s = 300;
        }
        if rng.below(4) == 0 {
            fe.flags |= svc_flags::SOURCE_RANGES;
            fe.source_ranges = (0..=rng.below(2))
                .map(|i| (Ipv4Addr::new(203, 0, 113, 64 * i as u8).into(), 26))
                .collect();
        }
        fe
    }

    fn writer(dp: InMemory) -> Writer<InMemory> {
        Writer::adopt(dp).unwrap().with_maglev(MaglevSettings {
            table_size: SIZE,
            max_tables: 4,
        })
    }

    /// One writer driven by `sync_changed` with exactly what changed, one by
    /// full syncs of the same states, with the same injected failures: after
    /// every step both dataplanes hold the same thing, reached by the same
    /// operations, and the make-before-break invariant held after each.
    fn run(seed: u64, capacity: Option<(u32, u32, u32)>) {
        let mut rng = Rng(seed);
        let keys: Vec<FrontendKey> = (1..=10)
            .flat_map(|ip| {
                [
                    key(ip, 80, IPPROTO_TCP),
                    key(ip, 443, IPPROTO_TCP),
                    key(ip, 53, IPPROTO_UDP),
                ]
            })
            .collect();
        let dp = || match capacity {
            Some((s, b, r)) => InMemory::with_capacity(s, b, r),
            None => InMemory::default(),
        };
        let (mut inc, mut full) = (writer(dp()), writer(dp()));
        let mut d = DesiredState::default();
        // Services in a random age order, unrelated to their addresses.
        for ip in 1..=10u64 {
            d.service_order.insert(
                format!("default/svc-{ip}"),
                ServiceAge::at_second(rng.below(1000) as i64),
            );
        }
        let mut errors = 0;
        for step in 0..300 {
            let mut changed = BTreeSet::new();
            let n = if step == 0 { 20 } else { rng.below(4) };
            for _ in 0..n {
                let k = keys[rng.below(keys.len() as u64) as usize];
                let new = (rng.below(5) != 0).then(|| random_frontend(&mut rng, &k));
                if d.frontends.get(&k) != new.as_ref() {
                    changed.insert(k);
                }
                match new {
                    Some(fe) => d.frontends.insert(k, fe),
                    None => d.frontends.remove(&k),
                };
            }
            // Listing an unchanged frontend is harmless.
            if rng.below(10) == 0 {
                changed.insert(keys[rng.below(keys.len() as u64) as usize]);
            }
            let mut local = BTreeSet::new();
            for _ in 0..rng.below(3) {
                let addr = pool(rng.below(12), IPPROTO_TCP).addr;
                if !d.local_endpoints.remove(&addr) {
                    d.local_endpoints.insert(addr);
                }
                local.insert(addr);
            }
            if rng.below(6) == 0 {
                let (skip, count) = (rng.below(12) as usize, rng.below(3) as usize + 1);
                inc.dataplane_mut().fail_after(skip, count);
                full.dataplane_mut().fail_after(skip, count);
            }
            if rng.below(10) == 0 {
                inc.dataplane_mut().fail_next_prunes(1);
                full.dataplane_mut().fail_next_prunes(1);
            }
            let changes = Changes {
                frontends: &changed,
                local_endpoints: &local,
            };
            let r_inc = inc.sync_changed(&d, changes);
            let r_full = full.sync(&d);
            errors += r_full.errors.len();
            for w in [&mut inc, &mut full] {
                w.dataplane_mut().fail_next(0);
                w.dataplane_mut().fail_next_prunes(0);
            }
            assert!(
                inc.dataplane().violations().is_empty(),
                "seed {seed:#x} step {step}: {:#?}",
                inc.dataplane().violations()
            );
            assert_eq!(
                behaviour(&inc),
                behaviour(&full),
                "seed {seed:#x} step {step}: changed {changed:?} local {local:?}\n\
                 incremental {r_inc:?}: {:#?}\nfull {r_full:?}: {:#?}",
                inc.dataplane().ops(),
                full.dataplane().ops()
            );
            assert_eq!(
                inc.dataplane().ops(),
                full.dataplane().ops(),
                "seed {seed:#x} step {step}: not the operations of a full sync"
            );
            assert_eq!(inc.dataplane().prunes(), full.dataplane().prunes());
            assert_eq!(
                (r_inc.errors.len(), r_inc.writes),
                (r_full.errors.len(), r_full.writes),
                "seed {seed:#x} step {step}"
            );
            assert_eq!(inc.affinity_pending(), full.affinity_pending());
            inc.dataplane_mut().take_ops();
            full.dataplane_mut().take_ops();
        }
        assert!(
            capacity.is_none() || errors > 0,
            "seed {seed:#x}: a small capacity should make some frontends fail"
        );
    }

    #[test]
    fn sync_changed_leaves_what_a_full_sync_leaves() {
        for seed in [
            0x9e37_79b9_7f4a_7c15,
            0x2545_f491_4f6c_dd1d,
            0xdead_beef_1234_5678,
        ] {
            run(seed, None);
        }
    }

    #[test]
    fn sync_changed_retries_what_a_small_capacity_failed() {
        for seed in [0x0123_4567_89ab_cdef, 0x5555_aaaa_1234_4321] {
            run(seed, Some((40, 12, 14)));
        }
    }
}

mod scale {
    //! `sync_changed` among 20,000 frontends writes for the change only.
    use std::collections::BTreeSet;
    use std::time::Instant;

    use super::*;
    use proxy_agent::dataplane::Changes;

    fn big_key(i: u32) -> FrontendKey {
        FrontendKey {
            addr: Ipv4Addr::from(0x0a60_0000 + i).into(),
            port: 80,
            proto: IPPROTO_TCP,
            scope: SCOPE_INTERNAL,
        }
    }

    fn big_backend(i: u32) -> BackendAddr {
        BackendAddr {
            addr: Ipv4Addr::from(0x0a80_0000 + i % 5_000).into(),
            port: 8080,
            proto: IPPROTO_TCP,
        }
    }

    /// `n` frontends of one Service each, two backends each out of 5,000
    /// (each backend shared by about 8 frontends).
    fn big(n: u32) -> DesiredState {
        let mut d = DesiredState::default();
        for i in 0..n {
            let mut backends = vec![big_backend(i), big_backend(i + 1)];
            backends.sort();
            d.frontends.insert(
                big_key(i),
                Frontend {
                    service: format!("default/svc-{i}").into(),
                    port_name: "".into(),
                    backends,
                    retained: Vec::new(),
                    flags: 0,
                    affinity_timeout_s: 0,
                    source_ranges: Vec::new(),
                    host_alias: None,
                },
            );
            d.service_order
                .insert(format!("default/svc-{i}"), ServiceAge::at_second(i as i64));
        }
        d
    }

    fn changed(
        w: &mut Writer<InMemory>,
        d: &DesiredState,
        keys: &[FrontendKey],
        local: &[IpAddr],
    ) -> Vec<Op> {
        let frontends: BTreeSet<FrontendKey> = keys.iter().copied().collect();
        let local_endpoints: BTreeSet<IpAddr> = local.iter().copied().collect();
        w.dataplane_mut().take_ops();
        let r = w.sync_changed(
            d,
            Changes {
                frontends: &frontends,
                local_endpoints: &local_endpoints,
            },
        );
        assert!(r.errors.is_empty(), "{r:?}");
        assert!(
            w.dataplane().violations().is_empty(),
            "{:?}",
            w.dataplane().violations()
        );
        w.dataplane_mut().take_ops()
    }

    #[test]
    fn one_change_among_20000_frontends_takes_a_constant_number_of_operations() {
        let mut d = big(20_000);
        let mut w = Writer::adopt(InMemory::default()).unwrap();
        assert!(w.sync(&d).errors.is_empty());

        // Nothing changed: nothing written.
        assert_eq!(changed(&mut w, &d, &[], &[]), []);

        // One frontend gains a backend (sorting last): the backend, its
        // slot, slot 0.
        let k = big_key(7_777);
        let fe = d.frontends.get_mut(&k).unwrap();
        fe.backends.push(BackendAddr {
            addr: Ipv4Addr::new(10, 200, 0, 1).into(),
            ..fe.backends[0]
        });
        let ops = changed(&mut w, &d, &[k], &[]);
        assert_eq!(ops.len(), 3, "{ops:#?}");

        // One frontend goes: slot 0, its 3 slots, its reverse NAT, the
        // backend only it used.
        d.frontends.remove(&k);
        let ops = changed(&mut w, &d, &[k], &[]);
        assert_eq!(ops.len(), 6, "{ops:#?}");
        assert!(matches!(ops[5], Op::DeleteBackend(..)), "{ops:#?}");

        // An endpoint becomes local: its backend entry (shared by several
        // frontends, none of which is rewritten).
        let ip = big_backend(1_234).addr;
        d.local_endpoints.insert(ip);
        let ops = changed(&mut w, &d, &[], &[ip]);
        assert!(
            matches!(ops[..], [Op::PutBackend(_, BackendEntry::V4(b))] if b.state & backend_state::LOCAL != 0),
            "{ops:#?}"
        );

        // And the result is what a full sync leaves: it writes nothing.
        w.dataplane_mut().take_ops();
        assert!(w.sync(&d).is_noop(), "{:#?}", w.dataplane().ops());
    }

    /// The time of a full sync and of `sync_changed` for one change, among
    /// 50,000 frontends (run with `--ignored --nocapture`, best in release);
    /// no time is asserted.
    #[test]
    #[ignore]
    fn measure_sync_changed_against_full_sync() {
        let mut d = big(50_000);
        let mut w = Writer::adopt(InMemory::default().without_checks()).unwrap();
        w.sync(&d);
        let k = big_key(123);
        for round in 0..3 {
            let fe = d.frontends.get_mut(&k).unwrap();
            fe.backends.push(BackendAddr {
                port: 9000 + round,
                ..fe.backends[0]
            });
            fe.backends.sort();
            let t = Instant::now();
            w.sync(&d);
            let full = t.elapsed();
            let fe = d.frontends.get_mut(&k).unwrap();
            fe.backends.pop();
            let keys = BTreeSet::from([k]);
            let none = BTreeSet::new();
            let t = Instant::now();
            w.sync_changed(
                &d,
                Changes {
                    frontends: &keys,
                    local_endpoints: &none,
                },
            );
            let inc = t.elapsed();
            println!("50,000 frontends, one change: full sync {full:?}, sync_changed {inc:?}");
        }
    }
}

/// Dual-stack: IPv6 frontends are programmed into the IPv6 maps, with
/// backend and reverse-NAT ids from the same spaces as IPv4's (never one id
/// in both families' maps), source ranges into the IPv6 trie, in the same
/// make-before-break order (the in-memory invariant is checked for them
/// too), in full and changed syncs; a writer adopting the maps keeps every
/// id; IPv4 frontends are programmed as they are without them.
#[test]
fn ipv6_frontends_are_programmed_into_the_ipv6_maps() {
    use proxy_agent::dataplane::Changes;
    use std::collections::BTreeSet;
    use std::net::Ipv6Addr;

    let key6 = |last: u16, scope: u8| FrontendKey {
        addr: IpAddr::V6(Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0x19, last)),
        port: 80,
        proto: IPPROTO_TCP,
        scope,
    };
    let b6 = |b: u16| BackendAddr {
        addr: IpAddr::V6(Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0x18, b)),
        port: 8080,
        proto: IPPROTO_TCP,
    };
    let frontend6 = |backends: &[u16]| Frontend {
        service: "default/dual".into(),
        backends: backends.iter().map(|b| b6(*b)).collect(),
        ..Frontend::default()
    };
    let v4_only = desired(&[
        (key(1, 80, IPPROTO_TCP), &[1, 2]),
        (key(2, 80, IPPROTO_TCP), &[2]),
    ]);
    let mut dual = v4_only.clone();
    dual.frontends
        .insert(key6(1, SCOPE_INTERNAL), frontend6(&[1, 2]));
    dual.frontends
        .insert(key6(2, SCOPE_INTERNAL), frontend6(&[3]));
    let mut lb6 = frontend6(&[1, 2]);
    lb6.source_ranges = vec![("2001:2:0:4::".parse().unwrap(), 64)];
    dual.frontends.insert(key6(1, SCOPE_EXTERNAL), lb6);
    dual.local_endpoints.insert("2001:2::18:1".parse().unwrap());

    // What the IPv6 maps must hold for `d`'s IPv6 frontends.
    let check6 = |w: &Writer<InMemory>, d: &DesiredState| {
        let p = w.dataplane().programmed();
        let mut entries = 0;
        let mut used = BTreeSet::new();
        for (k, fe) in d.frontends.iter().filter(|(k, _)| k.addr.is_ipv6()) {
            let IpAddr::V6(a) = k.addr else {
                unreachable!()
            };
            let slot0 = p
                .services6
                .get(&Svc6Key::new(a, k.port, k.proto, k.scope, 0))
                .unwrap_or_else(|| panic!("{k} missing"));
            let ranges: BTreeSet<_> = fe.source_ranges.iter().copied().collect();
            assert_eq!(
                p.source_ranges
                    .get(&slot0.rev_nat_id)
                    .cloned()
                    .unwrap_or_default(),
                ranges,
                "{k} source ranges"
            );
            assert_eq!(slot0.count as usize, fe.backends.len(), "{k}");
            for (i, b) in fe.backends.iter().enumerate() {
                let slot = p.services6[&Svc6Key::new(a, k.port, k.proto, k.scope, i as u16 + 1)];
                let be = p.backends6[&slot.backend_id];
                assert_eq!((IpAddr::V6(be.addr()), be.port()), (b.addr, b.port));
                assert!(
                    !p.backends.contains_key(&slot.backend_id),
                    "id in both families"
                );
                used.insert(*b);
            }
            let rev = p.rev_nat6[&slot0.rev_nat_id];
            assert_eq!((IpAddr::V6(rev.addr()), rev.port()), (k.addr, k.port));
            assert!(
                !p.rev_nat.contains_key(&slot0.rev_nat_id),
                "id in both families"
            );
            entries += 1 + fe.backends.len();
        }
        assert_eq!(p.services6.len(), entries, "extra IPv6 service entries");
        assert_eq!(p.backends6.len(), used.len(), "extra IPv6 backends");
        assert!(
            w.dataplane().violations().is_empty(),
            "{:?}",
            w.dataplane().violations()
        );
    };

    let mut w = Writer::adopt(InMemory::default()).unwrap();
    let r = w.sync(&dual);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let mut v4 = dual.clone();
    v4.frontends.retain(|k, _| k.addr.is_ipv4());
    assert_programmed(&w, &v4);
    check6(&w, &dual);
    // The local endpoint's entry is marked local.
    let p = w.dataplane().programmed();
    let local = w.backend_ids()[&b6(1)];
    assert_ne!(p.backends6[&local].state & backend_state::LOCAL, 0);

    // Changed syncs: an IPv6 frontend added, one removed, one changed with
    // an IPv4 one, the load-balancer one removed; the maps follow.
    let changed = |w: &mut Writer<InMemory>, d: &DesiredState, keys: &[FrontendKey]| {
        let frontends: BTreeSet<FrontendKey> = keys.iter().copied().collect();
        let local_endpoints = BTreeSet::new();
        let r = w.sync_changed(
            d,
            Changes {
                frontends: &frontends,
                local_endpoints: &local_endpoints,
            },
        );
        assert!(r.errors.is_empty(), "{:?}", r.errors);
    };
    dual.frontends
        .insert(key6(3, SCOPE_INTERNAL), frontend6(&[4]));
    changed(&mut w, &dual, &[key6(3, SCOPE_INTERNAL)]);
    check6(&w, &dual);
    dual.frontends.remove(&key6(1, SCOPE_INTERNAL));
    changed(&mut w, &dual, &[key6(1, SCOPE_INTERNAL)]);
    check6(&w, &dual);
    let k = key(1, 80, IPPROTO_TCP);
    dual.frontends.insert(k, frontend(&k, &[1, 2, 3]));
    dual.frontends
        .insert(key6(2, SCOPE_INTERNAL), frontend6(&[3, 5]));
    changed(&mut w, &dual, &[k, key6(2, SCOPE_INTERNAL)]);
    check6(&w, &dual);
    let ids_before = (w.backend_ids().clone(), w.rev_nat_ids().clone());

    // A full sync agrees; a writer adopting these maps keeps every id.
    let r = w.sync(&dual);
    assert_eq!(r.writes, 0);
    assert_eq!(
        (w.backend_ids().clone(), w.rev_nat_ids().clone()),
        ids_before
    );
    let ids = (w.backend_ids().clone(), w.rev_nat_ids().clone());
    let mut adopted = Writer::adopt(w.into_dataplane()).unwrap();
    let r = adopted.sync(&dual);
    assert_eq!(r.writes, 0, "{r:?}");
    assert_eq!(
        (adopted.backend_ids().clone(), adopted.rev_nat_ids().clone()),
        ids
    );
    check6(&adopted, &dual);
    dual.frontends.remove(&key6(1, SCOPE_EXTERNAL));
    changed(&mut adopted, &dual, &[key6(1, SCOPE_EXTERNAL)]);
    check6(&adopted, &dual);
    assert!(adopted.dataplane().programmed().source_ranges.is_empty());

    // Every IPv6 frontend gone: the IPv6 maps are emptied.
    let r = adopted.sync(&v4_only);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let p = adopted.dataplane().programmed();
    assert!(p.services6.is_empty() && p.backends6.is_empty() && p.rev_nat6.is_empty());
    assert!(adopted.dataplane().violations().is_empty());
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

/// Issue 42: slot 0 of a frontend with a host alias names the reverse-NAT
/// id of that ClusterIP frontend, only while the ClusterIP is its own
/// Service's: another Service owning the address gets 0 (one Service's host
/// UDP is never aimed at another's ClusterIP), as does a ClusterIP that is
/// gone. The entry an alias names is never deleted while it names it (the
/// in-memory dataplane checks this after every operation), so its id is
/// never another frontend's meanwhile.
#[test]
fn host_alias_names_its_own_services_cluster_ip_only() {
    let cluster_ip = key(1, 53, IPPROTO_UDP);
    let node_port = key(2, 30053, IPPROTO_UDP);
    let mut d = desired(&[(cluster_ip, &[1, 2]), (node_port, &[1, 2])]);
    let service = d.frontends[&cluster_ip].service.clone();
    {
        let np = d.frontends.get_mut(&node_port).unwrap();
        np.service = service.clone();
        np.host_alias = Some(cluster_ip);
    }
    let mut w = Writer::adopt(InMemory::default()).unwrap();
    let alias = |w: &Writer<InMemory>| {
        w.dataplane().programmed().services[&svc(&node_port, 0)].host_alias()
    };
    let rev_of = |w: &Writer<InMemory>, k: &FrontendKey| {
        w.dataplane().programmed().services[&svc(k, 0)].rev_nat_id
    };
    assert!(w.sync(&d).errors.is_empty());
    assert_ne!(alias(&w), 0);
    assert_eq!(alias(&w), rev_of(&w, &cluster_ip));
    assert_eq!(
        w.dataplane().programmed().services[&svc(&cluster_ip, 0)].host_alias(),
        0,
        "the ClusterIP names none"
    );

    // Another Service owns the ClusterIP's address: the alias goes, when
    // the frontends naming it are synced again (the model names them).
    d.frontends.get_mut(&cluster_ip).unwrap().service = "default/other".into();
    let changed = [cluster_ip, node_port].into_iter().collect();
    let none = Default::default();
    let changes = proxy_agent::dataplane::Changes {
        frontends: &changed,
        local_endpoints: &none,
    };
    assert!(w.sync_changed(&d, changes).errors.is_empty());
    assert_eq!(alias(&w), 0, "aimed at another Service's ClusterIP");
    d.frontends.get_mut(&cluster_ip).unwrap().service = service;
    assert!(w.sync_changed(&d, changes).errors.is_empty());
    assert_eq!(alias(&w), rev_of(&w, &cluster_ip));

    // The ClusterIP gone (the NodePort still naming it): no alias, and its
    // reverse-NAT entry goes once nothing names it.
    let gone = rev_of(&w, &cluster_ip);
    d.frontends.remove(&cluster_ip);
    assert!(w.sync_changed(&d, changes).errors.is_empty());
    assert_eq!(alias(&w), 0);
    assert!(!w.dataplane().programmed().rev_nat.contains_key(&gone));
    assert!(
        w.dataplane().violations().is_empty(),
        "{:?}",
        w.dataplane().violations()
    );
}

//! The writer against the in-memory dataplane: make-before-break order, the
//! packet invariant after every single operation, failures, adoption.
//!
//! One test binary (`cargo test --test writer`), split by concern into the
//! modules below: `maglev` (Maglev tables), `affinity` (source ranges and
//! session affinity), `incremental` (`sync_changed` against full syncs),
//! `scale` (one change among 20,000 frontends), `capacity` (full maps,
//! exhaustion, failed writes, bounded batches, more than 65,535 ids) and
//! `ipv6` (dual-stack). This file holds the fixtures they share, the
//! make-before-break order tests and adoption.
use std::net::{IpAddr, Ipv4Addr};

use proxy_agent::dataplane::{InMemory, Op, ServiceKey, Writer};
use proxy_agent::model::{BackendAddr, DesiredState, Frontend, FrontendKey};
use proxy_common::{
    backend_state, Backend4, Svc4Key, SvcValue, IPPROTO_TCP, IPPROTO_UDP, SCOPE_INTERNAL,
};

mod affinity;
mod capacity;
mod incremental;
mod ipv6;
mod maglev;
mod scale;

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

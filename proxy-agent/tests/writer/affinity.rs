//! Source ranges that fail closed, and session affinity: failed prunes
//! retried, the affinity maps walked once per sync, entries left under a
//! reused reverse-NAT id pruned before slot 0 names it.
use super::*;

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

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

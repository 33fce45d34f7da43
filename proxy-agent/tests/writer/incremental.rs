//! `Writer::sync_changed`: told what changed, it leaves the dataplane as
//! a full sync would, in the same order, writing only for what changed.
use std::collections::{BTreeMap, BTreeSet};

use super::*;
use proxy_agent::dataplane::{Changes, MaglevSettings};
use proxy_agent::model::{LbAlgorithm, ServiceAge};
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

//! Dual-stack: IPv6 frontends in the IPv6 maps, beside IPv4's.
use proxy_common::{Svc6Key, SCOPE_EXTERNAL};

use super::*;

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

//! `sync_changed` among 20,000 frontends writes for the change only.
use std::collections::BTreeSet;
use std::time::Instant;

use super::*;
use proxy_agent::dataplane::{BackendEntry, Changes};
use proxy_agent::model::ServiceAge;

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

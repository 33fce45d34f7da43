//! The map of each entry's family. The writer works on frontends and
//! backends by `IpAddr` ([`FrontendKey`], [`BackendAddr`]); these pick the
//! IPv4 or IPv6 map for each operation. Backend ids and reverse-NAT ids are
//! one space for both families.

use std::net::IpAddr;

use proxy_common::{Backend4, Backend6, RevNat4, RevNat6, Svc4Key, Svc4Value, Svc6Key};

use super::super::{BackendEntry, BatchOutcome, Dataplane, DataplaneError, RevNatEntry};
use crate::model::FrontendKey;

pub(super) fn delete_service<D: Dataplane>(
    dp: &mut D,
    key: &FrontendKey,
    slot: u16,
) -> Result<(), DataplaneError> {
    match key.addr {
        IpAddr::V4(a) => dp.delete_service(Svc4Key::new(a, key.port, key.proto, key.scope, slot)),
        IpAddr::V6(a) => dp.delete_service6(Svc6Key::new(a, key.port, key.proto, key.scope, slot)),
    }
}

/// Deletes backend `id` from the map of `b`'s family (IPv4's when unknown).
pub(super) fn delete_backend<D: Dataplane>(
    dp: &mut D,
    id: u32,
    b: Option<&BackendEntry>,
) -> Result<(), DataplaneError> {
    match b {
        Some(BackendEntry::V6(_)) => dp.delete_backend6(id),
        _ => dp.delete_backend(id),
    }
}

/// Deletes reverse-NAT `id` from the map of `r`'s family (IPv4's when
/// unknown).
pub(super) fn delete_rev_nat<D: Dataplane>(
    dp: &mut D,
    id: u16,
    r: Option<&RevNatEntry>,
) -> Result<(), DataplaneError> {
    match r {
        Some(RevNatEntry::V6(_)) => dp.delete_rev_nat6(id),
        _ => dp.delete_rev_nat(id),
    }
}

/// Writes slots `(frontend, slot, value)` in order, as single writes one
/// after the other would, stopping at the first that fails
/// ([`Dataplane::put_services`]): each run of one family's slots in one
/// batch call to that family's map. For entries no other of them depends
/// on.
pub(super) fn put_services<D: Dataplane>(
    dp: &mut D,
    writes: &[(FrontendKey, u16, Svc4Value)],
) -> BatchOutcome {
    put_runs(
        dp,
        writes,
        |(k, ..)| k.addr.is_ipv4(),
        |dp, run| {
            let v4: Vec<(Svc4Key, Svc4Value)> = run
                .iter()
                .filter_map(|(k, slot, v)| match k.addr {
                    IpAddr::V4(a) => Some((Svc4Key::new(a, k.port, k.proto, k.scope, *slot), *v)),
                    IpAddr::V6(_) => None,
                })
                .collect();
            dp.put_services(&v4)
        },
        |dp, run| {
            let v6: Vec<(Svc6Key, Svc4Value)> = run
                .iter()
                .filter_map(|(k, slot, v)| match k.addr {
                    IpAddr::V6(a) => Some((Svc6Key::new(a, k.port, k.proto, k.scope, *slot), *v)),
                    IpAddr::V4(_) => None,
                })
                .collect();
            dp.put_services6(&v6)
        },
    )
}

/// As [`put_services`], for backends `(id, entry)`.
pub(super) fn put_backends<D: Dataplane>(
    dp: &mut D,
    writes: &[(u32, BackendEntry)],
) -> BatchOutcome {
    put_runs(
        dp,
        writes,
        |(_, b)| matches!(b, BackendEntry::V4(_)),
        |dp, run| {
            let v4: Vec<(u32, Backend4)> = run
                .iter()
                .filter_map(|(id, b)| match b {
                    BackendEntry::V4(b) => Some((*id, *b)),
                    BackendEntry::V6(_) => None,
                })
                .collect();
            dp.put_backends(&v4)
        },
        |dp, run| {
            let v6: Vec<(u32, Backend6)> = run
                .iter()
                .filter_map(|(id, b)| match b {
                    BackendEntry::V6(b) => Some((*id, *b)),
                    BackendEntry::V4(_) => None,
                })
                .collect();
            dp.put_backends6(&v6)
        },
    )
}

/// As [`put_services`], for reverse-NAT entries `(id, entry)`.
pub(super) fn put_rev_nats<D: Dataplane>(
    dp: &mut D,
    writes: &[(u16, RevNatEntry)],
) -> BatchOutcome {
    put_runs(
        dp,
        writes,
        |(_, r)| matches!(r, RevNatEntry::V4(_)),
        |dp, run| {
            let v4: Vec<(u16, RevNat4)> = run
                .iter()
                .filter_map(|(id, r)| match r {
                    RevNatEntry::V4(r) => Some((*id, *r)),
                    RevNatEntry::V6(_) => None,
                })
                .collect();
            dp.put_rev_nats(&v4)
        },
        |dp, run| {
            let v6: Vec<(u16, RevNat6)> = run
                .iter()
                .filter_map(|(id, r)| match r {
                    RevNatEntry::V6(r) => Some((*id, *r)),
                    RevNatEntry::V4(_) => None,
                })
                .collect();
            dp.put_rev_nats6(&v6)
        },
    )
}

/// `writes` in order, stopping at the first that fails: each run of IPv4
/// ones (`is_v4`) through `batch4`, each run of IPv6 ones through `batch6`.
fn put_runs<D: Dataplane, T>(
    dp: &mut D,
    writes: &[T],
    is_v4: impl Fn(&T) -> bool,
    batch4: impl Fn(&mut D, &[T]) -> BatchOutcome,
    batch6: impl Fn(&mut D, &[T]) -> BatchOutcome,
) -> BatchOutcome {
    let mut done = 0;
    while let Some(first) = writes.get(done) {
        let v4 = is_v4(first);
        let len = writes[done..].iter().take_while(|w| is_v4(w) == v4).count();
        let run = &writes[done..done + len];
        let (n, err) = if v4 { batch4(dp, run) } else { batch6(dp, run) };
        done += n.min(len);
        if err.is_some() {
            return (done, err);
        }
    }
    (done, None)
}

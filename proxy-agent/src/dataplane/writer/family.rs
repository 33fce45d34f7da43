//! The map of each entry's family. The writer works on frontends and
//! backends by `IpAddr` ([`FrontendKey`], [`BackendAddr`]); these pick the
//! IPv4 or IPv6 map for each operation. Backend ids and reverse-NAT ids are
//! one space for both families.

use std::net::IpAddr;

use proxy_common::{RevNatId, Svc4Key, Svc4Value, Svc6Key};

use super::super::{
    BackendEntry, BatchOutcome, BatchSizes, Dataplane, DataplaneError, RevNatEntry,
};
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

/// Deletes reverse-NAT `id` from the map of `r`'s family (IPv4's when
/// unknown).
pub(super) fn delete_rev_nat<D: Dataplane>(
    dp: &mut D,
    id: RevNatId,
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
    runs(
        dp,
        writes,
        |(k, slot, v)| match k.addr {
            IpAddr::V4(a) => V4((Svc4Key::new(a, k.port, k.proto, k.scope, *slot), *v)),
            IpAddr::V6(a) => V6((Svc6Key::new(a, k.port, k.proto, k.scope, *slot), *v)),
        },
        D::put_services,
        D::put_services6,
    )
}

/// As [`put_services`], for backends `(id, entry)`.
pub(super) fn put_backends<D: Dataplane>(
    dp: &mut D,
    writes: &[(u32, BackendEntry)],
) -> BatchOutcome {
    runs(
        dp,
        writes,
        |(id, b)| match b {
            BackendEntry::V4(b) => V4((*id, *b)),
            BackendEntry::V6(b) => V6((*id, *b)),
        },
        D::put_backends,
        D::put_backends6,
    )
}

/// As [`put_services`], for reverse-NAT entries `(id, entry)`.
pub(super) fn put_rev_nats<D: Dataplane>(
    dp: &mut D,
    writes: &[(RevNatId, RevNatEntry)],
) -> BatchOutcome {
    runs(
        dp,
        writes,
        |(id, r)| match r {
            RevNatEntry::V4(r) => V4((*id, *r)),
            RevNatEntry::V6(r) => V6((*id, *r)),
        },
        D::put_rev_nats,
        D::put_rev_nats6,
    )
}

/// Deletes slots `(frontend, slot)` in order, as single deletes one after
/// the other would, stopping at the first that fails
/// ([`Dataplane::delete_services`]): each run of one family's slots in one
/// batch call, as [`put_services`] writes.
pub(super) fn delete_services<D: Dataplane>(
    dp: &mut D,
    slots: &[(FrontendKey, u16)],
) -> BatchOutcome {
    runs(
        dp,
        slots,
        |(k, slot)| match k.addr {
            IpAddr::V4(a) => V4(Svc4Key::new(a, k.port, k.proto, k.scope, *slot)),
            IpAddr::V6(a) => V6(Svc6Key::new(a, k.port, k.proto, k.scope, *slot)),
        },
        D::delete_services,
        D::delete_services6,
    )
}

/// As [`delete_services`], for backends `(id, entry)`: each from the map of
/// its entry's family (IPv4's when unknown).
pub(super) fn delete_backends<D: Dataplane>(
    dp: &mut D,
    ids: &[(u32, Option<BackendEntry>)],
) -> BatchOutcome {
    runs(
        dp,
        ids,
        |(id, b)| match b {
            Some(BackendEntry::V6(_)) => V6(*id),
            _ => V4(*id),
        },
        D::delete_backends,
        D::delete_backends6,
    )
}

/// As [`delete_backends`], for reverse-NAT entries `(id, entry)`.
pub(super) fn delete_rev_nats<D: Dataplane>(
    dp: &mut D,
    ids: &[(RevNatId, Option<RevNatEntry>)],
) -> BatchOutcome {
    runs(
        dp,
        ids,
        |(id, r)| match r {
            Some(RevNatEntry::V6(_)) => V6(*id),
            _ => V4(*id),
        },
        D::delete_rev_nats,
        D::delete_rev_nats6,
    )
}

/// An operation's entry or key in the map of its family.
enum ByFamily<A, B> {
    V4(A),
    V6(B),
}
use ByFamily::{V4, V6};

impl<A, B> ByFamily<A, B> {
    fn is_v4(&self) -> bool {
        matches!(self, V4(_))
    }
    fn v4(self) -> Option<A> {
        match self {
            V4(a) => Some(a),
            V6(_) => None,
        }
    }
    fn v6(self) -> Option<B> {
        match self {
            V6(b) => Some(b),
            V4(_) => None,
        }
    }
}

/// `ops` (writes or deletes) in order, stopping at the first that fails:
/// `entry` gives each one's map entry or key in its family's map; each run
/// of one family's goes to `batch4` or `batch6` in calls of [`BatchSizes`].
fn runs<D: Dataplane, T, A, B>(
    dp: &mut D,
    ops: &[T],
    entry: impl Fn(&T) -> ByFamily<A, B>,
    batch4: impl Fn(&mut D, &[A]) -> BatchOutcome,
    batch6: impl Fn(&mut D, &[B]) -> BatchOutcome,
) -> BatchOutcome {
    let mut done = 0;
    let mut sizes = BatchSizes::default();
    while let Some(first) = ops.get(done) {
        let v4 = entry(first).is_v4();
        let run: Vec<ByFamily<A, B>> = ops[done..]
            .iter()
            .take(sizes.take())
            .map(&entry)
            .take_while(|e| e.is_v4() == v4)
            .collect();
        let len = run.len();
        let (n, err) = if v4 {
            let run: Vec<A> = run.into_iter().filter_map(ByFamily::v4).collect();
            batch4(dp, &run)
        } else {
            let run: Vec<B> = run.into_iter().filter_map(ByFamily::v6).collect();
            batch6(dp, &run)
        };
        done += n.min(len);
        if err.is_some() {
            return (done, err);
        }
    }
    (done, None)
}

//! The writer's operations in map entries. The writer works on frontends
//! and backends by `IpAddr` ([`FrontendKey`], [`BackendAddr`]); these make
//! each operation's key or entry, its family in it ([`ServiceKey`],
//! [`BackendEntry`], [`RevNatEntry`]), and hand them to the dataplane in
//! calls of [`BatchSizes`]. Backend ids and reverse-NAT ids are one space
//! for both families.
//!
//! [`BackendAddr`]: crate::model::BackendAddr

use proxy_common::{RevNatId, SvcValue};

use super::super::{
    one, BackendEntry, BatchOutcome, BatchSizes, Dataplane, DataplaneError, Family, RevNatEntry,
    ServiceKey,
};
use crate::model::FrontendKey;

pub(super) fn delete_service<D: Dataplane>(
    dp: &mut D,
    key: &FrontendKey,
    slot: u16,
) -> Result<(), DataplaneError> {
    one(dp.delete_services(&[ServiceKey::new(key, slot)]))
}

/// The family of the map a backend or reverse-NAT entry is in (IPv4's when
/// unknown).
fn family_of<T>(entry: Option<&T>, family: impl Fn(&T) -> Family) -> Family {
    entry.map_or(Family::V4, family)
}

/// Deletes reverse-NAT `id` from the map of `r`'s family (IPv4's when
/// unknown).
pub(super) fn delete_rev_nat<D: Dataplane>(
    dp: &mut D,
    id: RevNatId,
    r: Option<&RevNatEntry>,
) -> Result<(), DataplaneError> {
    one(dp.delete_rev_nats(&[(family_of(r, RevNatEntry::family), id)]))
}

/// Writes slots `(frontend, slot, value)` in order, as single writes one
/// after the other would, stopping at the first that fails
/// ([`Dataplane::put_services`]). For entries no other of them depends on.
pub(super) fn put_services<D: Dataplane>(
    dp: &mut D,
    writes: &[(FrontendKey, u16, SvcValue)],
) -> BatchOutcome {
    chunked(
        dp,
        writes,
        |(k, slot, v)| (ServiceKey::new(k, *slot), *v),
        D::put_services,
    )
}

/// As [`put_services`], for backends `(id, entry)`.
pub(super) fn put_backends<D: Dataplane>(
    dp: &mut D,
    writes: &[(u32, BackendEntry)],
) -> BatchOutcome {
    chunked(dp, writes, |e| *e, D::put_backends)
}

/// As [`put_services`], for reverse-NAT entries `(id, entry)`.
pub(super) fn put_rev_nats<D: Dataplane>(
    dp: &mut D,
    writes: &[(RevNatId, RevNatEntry)],
) -> BatchOutcome {
    chunked(dp, writes, |e| *e, D::put_rev_nats)
}

/// Deletes slots `(frontend, slot)` in order, as single deletes one after
/// the other would, stopping at the first that fails
/// ([`Dataplane::delete_services`]).
pub(super) fn delete_services<D: Dataplane>(
    dp: &mut D,
    slots: &[(FrontendKey, u16)],
) -> BatchOutcome {
    chunked(
        dp,
        slots,
        |(k, slot)| ServiceKey::new(k, *slot),
        D::delete_services,
    )
}

/// As [`delete_services`], for backends `(id, entry)`: each from the map of
/// its entry's family (IPv4's when unknown).
pub(super) fn delete_backends<D: Dataplane>(
    dp: &mut D,
    ids: &[(u32, Option<BackendEntry>)],
) -> BatchOutcome {
    chunked(
        dp,
        ids,
        |(id, b)| (family_of(b.as_ref(), BackendEntry::family), *id),
        D::delete_backends,
    )
}

/// As [`delete_backends`], for reverse-NAT entries `(id, entry)`.
pub(super) fn delete_rev_nats<D: Dataplane>(
    dp: &mut D,
    ids: &[(RevNatId, Option<RevNatEntry>)],
) -> BatchOutcome {
    chunked(
        dp,
        ids,
        |(id, r)| (family_of(r.as_ref(), RevNatEntry::family), *id),
        D::delete_rev_nats,
    )
}

/// `ops` (writes or deletes) in order, stopping at the first that fails:
/// `entry` makes each one's map entry or key, prepared a call at a time in
/// calls of [`BatchSizes`] (so that where every entry fails, a full map,
/// each failure costs one call's preparation, not that of all the entries
/// left), each call to `call`.
fn chunked<D: Dataplane, T, E>(
    dp: &mut D,
    ops: &[T],
    entry: impl Fn(&T) -> E,
    call: impl Fn(&mut D, &[E]) -> BatchOutcome,
) -> BatchOutcome {
    let mut done = 0;
    let mut sizes = BatchSizes::default();
    while done < ops.len() {
        let run: Vec<E> = ops[done..].iter().take(sizes.take()).map(&entry).collect();
        let len = run.len();
        let (n, err) = call(dp, &run);
        done += n.min(len);
        if err.is_some() {
            return (done, err);
        }
    }
    (done, None)
}

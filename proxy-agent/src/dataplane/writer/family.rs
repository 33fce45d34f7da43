//! The map of each entry's family. The writer works on frontends and
//! backends by `IpAddr` ([`FrontendKey`], [`BackendAddr`]); these pick the
//! IPv4 or IPv6 map for each operation. Backend ids and reverse-NAT ids are
//! one space for both families.

use std::net::IpAddr;

use proxy_common::{map_names, Backend4, RevNat4, Svc4Key, Svc4Value, Svc6Key};

use super::super::{BackendEntry, Dataplane, DataplaneError, RevNatEntry};
use crate::model::FrontendKey;

pub(super) fn put_service<D: Dataplane>(
    dp: &mut D,
    key: &FrontendKey,
    slot: u16,
    value: Svc4Value,
) -> Result<(), DataplaneError> {
    match key.addr {
        IpAddr::V4(a) => {
            dp.put_service(Svc4Key::new(a, key.port, key.proto, key.scope, slot), value)
        }
        IpAddr::V6(a) => {
            dp.put_service6(Svc6Key::new(a, key.port, key.proto, key.scope, slot), value)
        }
    }
}

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

pub(super) fn put_backend<D: Dataplane>(
    dp: &mut D,
    id: u32,
    b: &BackendEntry,
) -> Result<(), DataplaneError> {
    match b {
        BackendEntry::V4(b) => dp.put_backend(id, *b),
        BackendEntry::V6(b) => dp.put_backend6(id, *b),
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

pub(super) fn put_rev_nat<D: Dataplane>(
    dp: &mut D,
    id: u16,
    r: &RevNatEntry,
) -> Result<(), DataplaneError> {
    match r {
        RevNatEntry::V4(r) => dp.put_rev_nat(id, *r),
        RevNatEntry::V6(r) => dp.put_rev_nat6(id, *r),
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

/// The result for an entry a batch call gave none for (a [`Dataplane`]
/// whose batch returned fewer results than entries).
fn no_result(map: &'static str) -> Result<(), DataplaneError> {
    Err(DataplaneError::Op {
        map,
        op: "put",
        reason: "the batch returned no result for this entry".into(),
    })
}

/// Writes slots `(frontend, slot, value)`, as that many [`put_service`]s:
/// the IPv4 ones in one [`Dataplane::put_services`] (in batches), the IPv6
/// ones after them, one at a time. Each one's result, in the order given.
/// For entries no other of them depends on.
pub(super) fn put_services<D: Dataplane>(
    dp: &mut D,
    writes: &[(FrontendKey, u16, Svc4Value)],
) -> Vec<Result<(), DataplaneError>> {
    let v4: Vec<(Svc4Key, Svc4Value)> = writes
        .iter()
        .filter_map(|(k, slot, v)| match k.addr {
            IpAddr::V4(a) => Some((Svc4Key::new(a, k.port, k.proto, k.scope, *slot), *v)),
            IpAddr::V6(_) => None,
        })
        .collect();
    let mut r4 = dp.put_services(&v4).into_iter();
    writes
        .iter()
        .map(|(k, slot, v)| match k.addr {
            IpAddr::V4(_) => r4.next().unwrap_or_else(|| no_result(map_names::SERVICES)),
            IpAddr::V6(_) => put_service(dp, k, *slot, *v),
        })
        .collect()
}

/// As [`put_services`], for backends `(id, entry)`.
pub(super) fn put_backends<D: Dataplane>(
    dp: &mut D,
    writes: &[(u32, BackendEntry)],
) -> Vec<Result<(), DataplaneError>> {
    let v4: Vec<(u32, Backend4)> = writes
        .iter()
        .filter_map(|(id, b)| match b {
            BackendEntry::V4(b) => Some((*id, *b)),
            BackendEntry::V6(_) => None,
        })
        .collect();
    let mut r4 = dp.put_backends(&v4).into_iter();
    writes
        .iter()
        .map(|(id, b)| match b {
            BackendEntry::V4(_) => r4.next().unwrap_or_else(|| no_result(map_names::BACKENDS)),
            BackendEntry::V6(_) => put_backend(dp, *id, b),
        })
        .collect()
}

/// As [`put_services`], for reverse-NAT entries `(id, entry)`.
pub(super) fn put_rev_nats<D: Dataplane>(
    dp: &mut D,
    writes: &[(u16, RevNatEntry)],
) -> Vec<Result<(), DataplaneError>> {
    let v4: Vec<(u16, RevNat4)> = writes
        .iter()
        .filter_map(|(id, r)| match r {
            RevNatEntry::V4(r) => Some((*id, *r)),
            RevNatEntry::V6(_) => None,
        })
        .collect();
    let mut r4 = dp.put_rev_nats(&v4).into_iter();
    writes
        .iter()
        .map(|(id, r)| match r {
            RevNatEntry::V4(_) => r4.next().unwrap_or_else(|| no_result(map_names::REV_NAT)),
            RevNatEntry::V6(_) => put_rev_nat(dp, *id, r),
        })
        .collect()
}

//! The map of each entry's family. The writer works on frontends and
//! backends by `IpAddr` ([`FrontendKey`], [`BackendAddr`]); these pick the
//! IPv4 or IPv6 map for each operation. Backend ids and reverse-NAT ids are
//! one space for both families.

use std::net::IpAddr;

use proxy_common::{Svc4Key, Svc4Value, Svc6Key};

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

//! One frontend's value from the categorized endpoints, and the claim of a
//! frontend key: which Service keeps a frontend two Services want.
use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use proxy_common::svc_flags;

use super::topology::select;
use super::{BackendAddr, Categorized, EndpointInfo, Frontend, FrontendKey, ModelWarning};

pub(super) fn frontend_key(addr: Ipv4Addr, port: u16, proto: u8, scope: u8) -> FrontendKey {
    FrontendKey {
        addr,
        port,
        proto,
        scope,
    }
}

/// Claims `key` for `fe`, unless already claimed: silently when by the same
/// Service (its first claim wins), with a warning when by another. Between two
/// Services, the one that owns the frontend now (`current_owners`) keeps it —
/// an API server would have refused the newcomer's address — else the first
/// by namespace/name.
pub(super) fn insert_frontend(
    frontends: &mut BTreeMap<FrontendKey, Frontend>,
    warnings: &mut Vec<ModelWarning>,
    object: &str,
    key: FrontendKey,
    fe: Frontend,
    current_owners: &BTreeMap<FrontendKey, String>,
) {
    match frontends.get(&key) {
        None => {
            frontends.insert(key, fe);
        }
        Some(existing) if existing.service == fe.service => {}
        Some(existing) if current_owners.get(&key) == Some(&fe.service) => {
            warnings.push(ModelWarning {
                object: format!("Service {}", existing.service),
                message: format!(
                    "frontend {key} already belongs to service {}; skipped",
                    fe.service
                ),
            });
            frontends.insert(key, fe);
        }
        Some(existing) => warnings.push(ModelWarning {
            object: object.to_string(),
            message: format!(
                "frontend {key} already belongs to service {}; skipped",
                existing.service
            ),
        }),
    }
}

/// `base` with the backends of `list` (a [`Categorized`] list; `None`, not
/// used, is empty) and their retained terminating endpoints. An empty list
/// while usable endpoints exist elsewhere sets [`svc_flags::DROP_NO_BACKEND`]
/// (kube-proxy drops: "has no local endpoints"); with no usable endpoint
/// anywhere the flags stay 0 and the datapath rejects.
pub(super) fn with_backends(
    base: &Frontend,
    list: &Option<Vec<BackendAddr>>,
    categorized: &Categorized,
    endpoints: &[EndpointInfo],
) -> Frontend {
    let backends = list.clone().unwrap_or_default();
    let flags = if backends.is_empty() && categorized.has_any_endpoints {
        svc_flags::DROP_NO_BACKEND
    } else {
        0
    };
    Frontend {
        retained: retained_backends(endpoints, &backends),
        backends,
        flags: base.flags | flags,
        ..base.clone()
    }
}

/// The listed endpoints not in `backends` (field bug C5: "Keep terminating
/// backends in the backend map with a flag (excluded from selection, valid
/// for existing flows)"; the same holds for endpoints that turned unready, as
/// kube-proxy's conntrack keeps their established connections). Sorted,
/// deduplicated.
fn retained_backends(endpoints: &[EndpointInfo], backends: &[BackendAddr]) -> Vec<BackendAddr> {
    select(endpoints, |e| !backends.contains(&e.addr))
}

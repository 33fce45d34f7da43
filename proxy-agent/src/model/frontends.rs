//! One frontend's value from the categorized endpoints, and the claim of a
//! frontend key: which Service keeps a frontend two Services want.
use std::net::IpAddr;

use proxy_common::svc_flags;

use super::topology::select;
use super::{BackendAddr, Categorized, EndpointInfo, Frontend, FrontendKey};

pub(super) fn frontend_key(addr: IpAddr, port: u16, proto: u8, scope: u8) -> FrontendKey {
    FrontendKey {
        addr,
        port,
        proto,
        scope,
    }
}

/// What is owned: an address, port and protocol, in every scope at once. A
/// Service owning it has all of its frontends there (from outside and from
/// inside the node); no other Service has any. Ownership is per address,
/// port and protocol, whatever the scope: a ClusterIP owner keeps traffic
/// from outside the node too, never just from its pods (see
/// [`super::incremental`]).
pub(super) type Owned = (IpAddr, u16, u8);

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
/// deduplicated. A set, not `backends.contains` per endpoint: that was
/// quadratic in a Service's endpoints, three times per port.
fn retained_backends(endpoints: &[EndpointInfo], backends: &[BackendAddr]) -> Vec<BackendAddr> {
    let used: std::collections::HashSet<&BackendAddr> = backends.iter().collect();
    select(endpoints, |e| !used.contains(&e.addr))
}

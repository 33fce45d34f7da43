//! One frontend's value from the categorized endpoints, and the claim of a
//! frontend key: which Service keeps a frontend two Services want.
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use proxy_common::svc_flags;

use super::policy::ClaimRank;
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

/// Claims `key` for `fe`, whose claim ranks `rank` (see [`ClaimRank`]),
/// unless already claimed: silently when by the same Service (its first
/// claim wins: clusterIP, externalIPs, then load-balancer IPs), else the
/// better ranked claim keeps the frontend — a ClusterIP over anything else,
/// then the older Service — and a warning names the Service that lost it.
pub(super) fn insert_frontend(
    frontends: &mut BTreeMap<FrontendKey, Frontend>,
    ranks: &mut BTreeMap<FrontendKey, ClaimRank>,
    warnings: &mut Vec<ModelWarning>,
    key: FrontendKey,
    fe: Frontend,
    rank: ClaimRank,
) {
    match (frontends.get(&key), ranks.get(&key)) {
        (Some(existing), Some(held)) if existing.service != fe.service => {
            let (winner, loser) = if rank.cmp_claim(held) == Ordering::Less {
                (&rank, held)
            } else {
                (held, &rank)
            };
            warnings.push(ModelWarning {
                object: format!("Service {}", loser.service),
                message: format!(
                    "frontend {key} also claimed by service {} ({}); skipped",
                    winner.service,
                    winner.why_wins(loser)
                ),
            });
            if winner == &rank {
                frontends.insert(key, fe);
                ranks.insert(key, rank);
            }
        }
        (Some(_), _) => {}
        (None, _) => {
            frontends.insert(key, fe);
            ranks.insert(key, rank);
        }
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

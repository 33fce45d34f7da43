//! The `healthCheckNodePort`s this node serves (kube-proxy
//! `pkg/proxy/healthcheck`'s service health servers).
use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use k8s_openapi::api::core::v1::ServiceSpec;

use super::{HealthCheck, ModelWarning, TrafficPolicy};

/// Claims the `healthCheckNodePort` of Service `id` (`spec`, reported as
/// `object`) when it needs one, reporting `local_ready` (the distinct
/// addresses of its local ready endpoints); a port another Service already
/// has is skipped with a warning.
pub(super) fn claim_health_check(
    health_checks: &mut BTreeMap<u16, HealthCheck>,
    warnings: &mut Vec<ModelWarning>,
    object: &str,
    id: &str,
    spec: &ServiceSpec,
    external_policy: TrafficPolicy,
    local_ready: &BTreeSet<Ipv4Addr>,
) {
    // kube-proxy `apiservice.NeedsHealthCheck`: type LoadBalancer with
    // externalTrafficPolicy Local (the API server allocates the port).
    let health_check_port = spec
        .health_check_node_port
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0);
    if let (Some(hc_port), Some("LoadBalancer"), TrafficPolicy::Local) =
        (health_check_port, spec.type_.as_deref(), external_policy)
    {
        match health_checks.get(&hc_port) {
            Some(existing) => warnings.push(ModelWarning {
                object: object.to_string(),
                message: format!(
                    "healthCheckNodePort {hc_port} already belongs to service {}; skipped",
                    existing.service
                ),
            }),
            None => {
                health_checks.insert(
                    hc_port,
                    HealthCheck {
                        service: id.to_string(),
                        local_endpoints: local_ready.len(),
                    },
                );
            }
        }
    }
}

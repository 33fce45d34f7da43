//! The `healthCheckNodePort`s this node serves (kube-proxy
//! `pkg/proxy/healthcheck`'s service health servers).
use crate::objects::compact::CompactServiceSpec;

use super::TrafficPolicy;

/// The `healthCheckNodePort` a Service needs served, if any: kube-proxy
/// `apiservice.NeedsHealthCheck`, type LoadBalancer with
/// `externalTrafficPolicy: Local` (the API server allocates the port). When
/// two Services name one port, the first by namespace/name has it (see
/// [`super::incremental`]).
pub(super) fn needs_health_check(
    spec: &CompactServiceSpec,
    external_policy: TrafficPolicy,
) -> Option<u16> {
    let port = spec
        .health_check_node_port
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)?;
    (spec.type_.as_deref() == Some("LoadBalancer") && external_policy == TrafficPolicy::Local)
        .then_some(port)
}

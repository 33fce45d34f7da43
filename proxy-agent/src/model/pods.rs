//! EndpointSlices synthesized from Pods, standing in for the EndpointSlice
//! controller when the source (a manifests directory) has Pods but no slices.
use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::endpoints::parse_endpoint_address;
use super::services::{name, namespace};
use super::{IpFamily, LABEL_SERVICE_NAME};
use crate::objects::compact::{CompactService, CompactServicePort};
use crate::objects::Snapshot;

/// Whether the pod may back a Service: a pod IP, not finished (`Succeeded`
/// or `Failed`). Terminating pods may (the EndpointSlice controller's
/// `ShouldPodBeInEndpoints` with `includeTerminating`). Returns its first
/// address of each family (`podIP`, then `podIPs`), IPv4 first.
fn pod_addresses(pod: &Pod) -> Vec<IpAddr> {
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return Vec::new();
    }
    let primary = status.pod_ip.as_deref().into_iter();
    let all = status.pod_ips.iter().flatten().map(|p| p.ip.as_str());
    let ips: Vec<&str> = primary.chain(all).collect();
    IpFamily::ALL
        .into_iter()
        .filter_map(|f| ips.iter().find_map(|ip| parse_endpoint_address(f, ip)))
        .collect()
}

/// The pod's Ready condition; a pod without one counts as ready.
fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_none_or(|c| c.status == "True")
}

/// The port a service port's `targetPort` resolves to on `pod`, if any.
fn resolve_target_port(port: &CompactServicePort, proto_name: &str, pod: &Pod) -> Option<i32> {
    match &port.target_port {
        None => Some(port.port),
        Some(IntOrString::Int(n)) => Some(*n),
        Some(IntOrString::String(s)) => {
            // A numeric string is a number (the API server normalizes these).
            if let Ok(n) = s.parse::<i32>() {
                return Some(n);
            }
            let spec = pod.spec.as_ref()?;
            spec.containers
                .iter()
                .flat_map(|c| c.ports.iter().flatten())
                .find_map(|cp| {
                    (cp.name.as_deref() == Some(s.as_str())
                        && cp.protocol.as_deref().unwrap_or("TCP") == proto_name)
                        .then_some(cp.container_port)
                })
        }
    }
}

/// EndpointSlices standing in for the EndpointSlice controller: for every
/// Service with a selector, one slice per matching Pod in its namespace that
/// has not finished and per family of its pod IPs (`addressType`, as the
/// controller writes a slice per family). The slice, named `<svc>-pod-<pod>`
/// (IPv4) or `<svc>-pod-<pod>-ipv6`, holds one endpoint and one port per
/// service port whose `targetPort` resolves on that Pod.
///
/// The endpoint's conditions follow the controller's `podToEndpoint`
/// (pkg/controller/endpointslice, `endpointslice/util`): serving = the Pod's
/// Ready condition (true when absent, unlike the controller, as manifests
/// often carry no status conditions); terminating = the Pod has a
/// `deletionTimestamp`; ready = `publishNotReadyAddresses || (serving &&
/// !terminating)`.
pub fn endpoint_slices_from_pods(snapshot: &Snapshot) -> Vec<EndpointSlice> {
    let mut out = Vec::new();
    for svc in &snapshot.services {
        let svc = CompactService::from(svc);
        service_slices_from_pods(&svc, snapshot.pods.iter(), &mut out);
    }
    out
}

/// The slices [`endpoint_slices_from_pods`] synthesizes for `svc` alone from
/// `pods` (any namespace: those of another are skipped), appended to `out`.
pub(super) fn service_slices_from_pods<'a>(
    svc: &CompactService,
    pods: impl Iterator<Item = &'a Pod>,
    out: &mut Vec<EndpointSlice>,
) {
    {
        let Some(spec) = &svc.spec else { return };
        let selector = &spec.selector;
        if selector.is_empty() {
            return;
        }
        let ns = &*svc.namespace;
        let svc_name = &*svc.name;
        let publish_not_ready = spec.publish_not_ready_addresses == Some(true);
        for pod in pods {
            if namespace(&pod.metadata) != ns {
                continue;
            }
            let labels = pod.metadata.labels.as_ref();
            if !selector
                .iter()
                .all(|(k, v)| labels.and_then(|l| l.get(&**k)).map(String::as_str) == Some(&**v))
            {
                continue;
            }
            let addresses = pod_addresses(pod);
            if addresses.is_empty() {
                continue;
            }
            let ports: Vec<EndpointPort> = spec
                .ports
                .iter()
                .filter_map(|port| {
                    let protocol = port.protocol.as_deref().unwrap_or("TCP").to_string();
                    let target = resolve_target_port(port, &protocol, pod)?;
                    Some(EndpointPort {
                        name: port.name.as_deref().map(String::from),
                        port: Some(target),
                        protocol: Some(protocol),
                        app_protocol: port.app_protocol.as_deref().map(String::from),
                    })
                })
                .collect();
            let serving = pod_ready(pod);
            let terminating = pod.metadata.deletion_timestamp.is_some();
            let ready = publish_not_ready || (serving && !terminating);
            for ip in addresses {
                let suffix = match IpFamily::of(ip) {
                    IpFamily::V4 => "",
                    IpFamily::V6 => "-ipv6",
                };
                out.push(EndpointSlice {
                    address_type: IpFamily::of(ip).name().to_string(),
                    metadata: ObjectMeta {
                        name: Some(format!("{svc_name}-pod-{}{suffix}", name(&pod.metadata))),
                        namespace: Some(ns.to_string()),
                        labels: Some(BTreeMap::from([(
                            LABEL_SERVICE_NAME.to_string(),
                            svc_name.to_string(),
                        )])),
                        ..ObjectMeta::default()
                    },
                    endpoints: vec![Endpoint {
                        addresses: vec![ip.to_string()],
                        conditions: Some(EndpointConditions {
                            ready: Some(ready),
                            serving: Some(serving),
                            terminating: Some(terminating),
                        }),
                        node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                        ..Endpoint::default()
                    }],
                    ports: Some(ports.clone()),
                });
            }
        }
    }
}

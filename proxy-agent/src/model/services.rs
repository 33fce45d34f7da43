//! Which Services the model ignores (ExternalName, headless, another
//! proxy's), and the object naming and protocol parsing every step shares.
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use proxy_common::{IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use super::{ModelOptions, LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME};

pub(super) fn namespace(meta: &ObjectMeta) -> &str {
    meta.namespace
        .as_deref()
        .filter(|ns| !ns.is_empty())
        .unwrap_or("default")
}

pub(super) fn name(meta: &ObjectMeta) -> &str {
    meta.name.as_deref().unwrap_or("")
}

pub(super) fn service_id(svc: &Service) -> String {
    format!("{}/{}", namespace(&svc.metadata), name(&svc.metadata))
}

/// Parses a Kubernetes protocol name; `None` protocol is TCP.
pub(super) fn parse_proto(protocol: Option<&str>) -> Result<u8, String> {
    match protocol.unwrap_or("TCP") {
        "TCP" => Ok(IPPROTO_TCP),
        "UDP" => Ok(IPPROTO_UDP),
        "SCTP" => Ok(IPPROTO_SCTP),
        other => Err(format!("protocol {other} is not supported")),
    }
}

/// Why a Service is ignored, if it is.
pub(super) fn ignored(svc: &Service, opts: &ModelOptions) -> Option<&'static str> {
    let labels = svc.metadata.labels.as_ref();
    if labels.is_some_and(|l| l.contains_key(LABEL_HEADLESS)) {
        return Some("headless label");
    }
    if let Some(proxy) = labels.and_then(|l| l.get(LABEL_SERVICE_PROXY_NAME)) {
        if opts.service_proxy_name.as_deref() != Some(proxy.as_str()) {
            return Some("service-proxy-name names another proxy");
        }
    }
    let Some(spec) = &svc.spec else {
        return Some("no spec");
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Some("ExternalName");
    }
    match spec.cluster_ip.as_deref() {
        Some("None") => return Some("headless"),
        None | Some("") if spec.cluster_ips.as_ref().is_none_or(|ips| ips.is_empty()) => {
            return Some("no clusterIP");
        }
        _ => {}
    }
    None
}

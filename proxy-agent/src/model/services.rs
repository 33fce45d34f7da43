//! Which Services the model ignores (ExternalName, headless, another
//! proxy's), and the object naming and protocol parsing every step shares.
use proxy_common::{IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use super::ModelOptions;
use crate::objects::compact::CompactService;
pub(super) use crate::objects::{name, namespace};

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
pub(super) fn ignored(svc: &CompactService, opts: &ModelOptions) -> Option<&'static str> {
    if svc.headless_label {
        return Some("headless label");
    }
    if let Some(proxy) = &svc.service_proxy_name {
        if opts.service_proxy_name.as_deref() != Some(&**proxy) {
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
        None | Some("") if spec.cluster_ips.is_empty() => {
            return Some("no clusterIP");
        }
        _ => {}
    }
    None
}

//! EndpointSlices to the endpoints of one service port (kube-proxy
//! `EndpointSliceCache`: port matching, deduplication, conditions and hints),
//! and this node's endpoint addresses.
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::services::parse_proto;
use super::{BackendAddr, EndpointInfo, IpFamily, ModelWarning};
use crate::objects::compact::{
    CompactEndpoint, CompactEndpointPort, CompactServicePort, CompactSlice,
};

/// Whether an EndpointSlice port serves this service port: same name (empty
/// and missing are equal) and same protocol.
fn port_matches(slice_port: &CompactEndpointPort, port: &CompactServicePort, proto: u8) -> bool {
    let slice_name = slice_port.name.as_deref().unwrap_or("");
    let svc_name = port.name.as_deref().unwrap_or("");
    slice_name == svc_name && parse_proto(slice_port.protocol.as_deref()).ok() == Some(proto)
}

/// The endpoints of one service port across the `slices` of `family`
/// (`addressType`; kube-proxy's proxier of a family reads only its slices,
/// so a frontend never gets an endpoint of the other family), deduplicated by
/// `ip:port` (the first slice by name wins, unless a later copy is local, as in
/// kube-proxy `EndpointSliceCache.addEndpoints`), sorted. As kube-proxy: a
/// slice port with no port number or port 0 is skipped; an endpoint's first
/// address is its address; an endpoint without `nodeName` is never local.
pub(super) fn port_endpoints(
    family: IpFamily,
    port: &CompactServicePort,
    proto: u8,
    slices: &[&CompactSlice],
    node_name: &str,
    warnings: &mut Vec<ModelWarning>,
    reported: &mut BTreeSet<(String, String)>,
) -> Vec<EndpointInfo> {
    let mut found: BTreeMap<BackendAddr, EndpointInfo> = BTreeMap::new();
    for slice in slices {
        let slice_family = IpFamily::from_name(&slice.address_type);
        if slice_family.is_none() && &*slice.address_type != "FQDN" {
            // Not a type the API has (FQDN slices are ignored, as
            // kube-proxy ignores them); say so, once per slice.
            let slice_id = format!("{}/{}", slice.namespace, slice.name);
            if reported.insert((slice_id.clone(), "addressType".to_string())) {
                warnings.push(ModelWarning {
                    object: format!("EndpointSlice {slice_id}"),
                    message: format!(
                        "addressType {:?} is none of IPv4, IPv6, FQDN; its endpoints are not used",
                        slice.address_type
                    ),
                });
            }
        }
        if slice_family != Some(family) {
            continue;
        }
        let Some(slice_port) = slice.ports.iter().find(|p| port_matches(p, port, proto)) else {
            continue;
        };
        let slice_id = format!("{}/{}", slice.namespace, slice.name);
        let Some(backend_port) = slice_port
            .port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
        else {
            // kube-proxy skips such a port too; say so, once per slice.
            if reported.insert((slice_id.clone(), "port".to_string())) {
                warnings.push(ModelWarning {
                    object: format!("EndpointSlice {slice_id}"),
                    message: format!(
                        "port {:?} has no usable port number ({:?}); its endpoints are not used",
                        slice_port.name.as_deref().unwrap_or(""),
                        slice_port.port
                    ),
                });
            }
            continue;
        };
        for endpoint in slice.endpoints.iter() {
            let Some(address) = endpoint.address.as_deref() else {
                continue;
            };
            let Some(addr) = parse_endpoint_address(family, address) else {
                if reported.insert((slice_id.clone(), address.to_string())) {
                    warnings.push(ModelWarning {
                        object: format!("EndpointSlice {slice_id}"),
                        message: format!("invalid {family} address {address:?}; endpoint skipped"),
                    });
                }
                continue;
            };
            let info = endpoint_info(
                endpoint,
                BackendAddr {
                    addr,
                    port: backend_port,
                    proto,
                },
            );
            if !found.contains_key(&info.addr) || info.is_local(node_name) {
                found.insert(info.addr, info);
            }
        }
    }
    found.into_values().collect()
}

/// An endpoint address of a slice of `family` (an address of the other
/// family is invalid there, as the API server's validation says).
pub(super) fn parse_endpoint_address(family: IpFamily, address: &str) -> Option<IpAddr> {
    match family {
        IpFamily::V4 => address.parse::<Ipv4Addr>().ok().map(IpAddr::V4),
        IpFamily::V6 => address.parse::<Ipv6Addr>().ok().map(IpAddr::V6),
    }
}

fn endpoint_info(endpoint: &CompactEndpoint, addr: BackendAddr) -> EndpointInfo {
    let hints = endpoint.hints.as_deref();
    EndpointInfo {
        addr,
        ready: endpoint.ready.unwrap_or(true),
        serving: endpoint.serving.unwrap_or(true),
        terminating: endpoint.terminating.unwrap_or(false),
        node_name: endpoint.node_name.as_deref().map(String::from),
        zone: endpoint.zone.as_deref().map(String::from),
        zone_hints: hints
            .iter()
            .flat_map(|h| h.zones.iter())
            .map(|z| z.to_string())
            .collect(),
        node_hints: hints
            .iter()
            .flat_map(|h| h.nodes.iter())
            .map(|n| n.to_string())
            .collect(),
    }
}

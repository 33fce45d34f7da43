//! UDP flows a backend no longer carries: when a backend leaves a UDP
//! frontend, the conntrack entries of that pair are deleted and the host's
//! connected sockets aimed at it from that frontend destroyed, as kube-proxy
//! deletes the UDP conntrack entries of each service port an endpoint leaves.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr},
};

use proxy_common::{SockRevNat4Key, SockRevNat4Value, SockRevNat6Key, SockRevNat6Value};
use tracing::{info, warn};

use crate::{bpf::BpfDataplane, config::Settings, dataplane::Writer, model};

use super::sync::Observers;

/// The socket-level reverse-NAT maps of both families.
pub(super) struct SockRevNatMaps {
    v4: aya::maps::HashMap<aya::maps::MapData, SockRevNat4Key, SockRevNat4Value>,
    v6: aya::maps::HashMap<aya::maps::MapData, SockRevNat6Key, SockRevNat6Value>,
}

impl SockRevNatMaps {
    pub(super) fn open(pin_dir: &std::path::Path) -> Result<Self, String> {
        Ok(Self {
            v4: crate::bpf::open_lru_hash(pin_dir, proxy_common::map_names::SOCK_REVNAT)?,
            v6: crate::bpf::open_lru_hash(pin_dir, proxy_common::map_names::SOCK_REVNAT6)?,
        })
    }

    /// The frontend the hooks aimed socket `cookie` from when they sent it
    /// to `peer` (as the socket has it: an IPv4-mapped peer of an IPv6
    /// socket is in the IPv4 map); `None` if they did not.
    fn aimed_from(&self, cookie: u64, peer: SocketAddr) -> Option<SocketAddr> {
        match crate::host::sockdiag::backend_of(peer) {
            SocketAddr::V4(p) => {
                let key = SockRevNat4Key {
                    cookie,
                    addr_be: u32::from_ne_bytes(p.ip().octets()),
                    port_be: p.port().to_be(),
                    _pad: 0,
                };
                let v = self.v4.get(&key, 0).ok()?;
                Some(SocketAddr::new(
                    Ipv4Addr::from(v.addr_be.to_ne_bytes()).into(),
                    u16::from_be(v.port_be),
                ))
            }
            SocketAddr::V6(p) => {
                let key = SockRevNat6Key {
                    cookie,
                    addr_be: proxy_common::ipv6::addr6(*p.ip()),
                    port_be: p.port().to_be(),
                    _pad: [0; 6],
                };
                let v = self.v6.get(&key, 0).ok()?;
                Some(SocketAddr::new(
                    proxy_common::ipv6::ipv6(&v.addr_be).into(),
                    u16::from_be(v.port_be),
                ))
            }
        }
    }
}

/// The backends of each UDP frontend address of `desired` (the frontends
/// of every scope at that address and port), retained ones included.
pub(super) fn udp_backends(
    desired: &model::DesiredState,
) -> BTreeMap<SocketAddr, BTreeSet<SocketAddr>> {
    let mut out: BTreeMap<SocketAddr, BTreeSet<SocketAddr>> = BTreeMap::new();
    for (k, f) in &desired.frontends {
        if k.proto != proxy_common::IPPROTO_UDP {
            continue;
        }
        out.entry(SocketAddr::new(k.addr, k.port))
            .or_default()
            .extend(
                f.backends
                    .iter()
                    .chain(f.retained.iter())
                    .map(|b| SocketAddr::new(b.addr, b.port)),
            );
    }
    out
}

/// The (frontend, backend) pairs of `before` that `now` no longer has: a
/// backend that left a UDP frontend, or a frontend that went.
pub(super) fn gone_udp_pairs(
    before: &BTreeMap<SocketAddr, BTreeSet<SocketAddr>>,
    now: &BTreeMap<SocketAddr, BTreeSet<SocketAddr>>,
) -> BTreeSet<(SocketAddr, SocketAddr)> {
    let empty = BTreeSet::new();
    before
        .iter()
        .flat_map(|(fe, backends)| {
            let still = now.get(fe).unwrap_or(&empty);
            backends
                .difference(still)
                .map(move |be| (*fe, *be))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Forgets the UDP flows of every backend that left a UDP frontend, as
/// kube-proxy's conntrack cleanup does: the datapath's conntrack entries of
/// those pairs are deleted, so the next datagram picks one of the
/// frontend's backends again, and host clients' connected UDP sockets the
/// socket hooks aimed at such a pair are destroyed (see
/// [`crate::host::sockdiag`]). The backend may still back other Services: only
/// its flows of this frontend go.
pub(super) fn forget_stale_udp_flows(
    cfg: &Settings,
    obs: &mut Observers,
    writer: &Writer<BpfDataplane>,
    desired: &model::DesiredState,
) {
    let now = udp_backends(desired);
    let gone = gone_udp_pairs(&obs.udp_backends, &now);
    obs.udp_backends = now;
    if gone.is_empty() {
        return;
    }
    // The datapath's flows: by the frontends' reverse-NAT ids (each scope
    // at the address) and the backend's id, both as programmed now. A
    // frontend that went has no id left, nor a backend no longer
    // programmed anywhere: the datapath finds neither and forgets those
    // flows itself.
    // One pass over the frontends: the ids of each scope at the addresses
    // that lost a backend.
    let gone_frontends: BTreeSet<SocketAddr> = gone.iter().map(|(fe, _)| *fe).collect();
    let mut ids_of: BTreeMap<SocketAddr, Vec<proxy_common::RevNatId>> = BTreeMap::new();
    for (k, &id) in writer.rev_nat_ids() {
        let fe = SocketAddr::new(k.addr, k.port);
        if k.proto == proxy_common::IPPROTO_UDP && gone_frontends.contains(&fe) {
            ids_of.entry(fe).or_default().push(id);
        }
    }
    let backend_ids = writer.backend_ids();
    let mut pairs = BTreeSet::new();
    for (fe, be) in &gone {
        let backend = model::BackendAddr {
            addr: be.ip(),
            port: be.port(),
            proto: proxy_common::IPPROTO_UDP,
        };
        let (Some(&backend_id), Some(ids)) = (backend_ids.get(&backend), ids_of.get(fe)) else {
            continue;
        };
        pairs.extend(ids.iter().map(|&id| (id, backend_id)));
    }
    match crate::bpf::delete_udp_flows(&cfg.bpffs, &pairs) {
        Ok(0) => {}
        Ok(n) => info!(
            flows = n,
            "UDP flows of backends that left their Service forgotten"
        ),
        Err(e) => {
            warn!(error = %e, "cannot delete the UDP flows of backends that left their Service; they keep their backend until idle")
        }
    }
    let Some(revnat) = &obs.sock_revnat else {
        return;
    };
    let backends: BTreeSet<SocketAddr> = gone.iter().map(|(_, be)| *be).collect();
    let ours = |cookie: u64, peer: SocketAddr| {
        revnat
            .aimed_from(cookie, peer)
            .is_some_and(|fe| gone.contains(&(fe, crate::host::sockdiag::backend_of(peer))))
    };
    match crate::host::sockdiag::destroy_aimed_at(&backends, ours) {
        Ok(d) if d.destroyed > 0 || d.failed > 0 => info!(
            destroyed = d.destroyed,
            failed = d.failed,
            "host clients' connected UDP sockets aimed at removed backends destroyed"
        ),
        Ok(_) => {}
        Err(e) => {
            warn!(error = %e, "cannot list UDP sockets (socket diag); connected UDP sockets of host clients may keep a removed backend")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn table(rows: &[(&str, &[&str])]) -> BTreeMap<SocketAddr, BTreeSet<SocketAddr>> {
        rows.iter()
            .map(|(fe, bes)| (sa(fe), bes.iter().map(|b| sa(b)).collect()))
            .collect()
    }

    /// A backend that leaves one UDP frontend is a gone pair of that
    /// frontend even while it still backs another (the oracle's C2/K1:
    /// web-1 leaves `k1` and stays in `web`); a frontend that goes takes
    /// all its pairs; an unchanged frontend and a backend that arrives give
    /// none.
    #[test]
    fn gone_udp_pairs_are_per_frontend() {
        let before = table(&[
            ("198.19.0.10:80", &["198.18.1.1:80", "198.18.1.2:80"]),
            ("198.19.0.11:80", &["198.18.1.1:80"]),
            ("198.19.0.12:53", &["198.18.1.3:53"]),
            ("[2001:2:0:ff::10]:80", &["[2001:2:0:1::1]:80"]),
        ]);
        let now = table(&[
            ("198.19.0.10:80", &["198.18.1.1:80", "198.18.1.2:80"]),
            ("198.19.0.11:80", &["198.18.1.2:80"]),
            (
                "[2001:2:0:ff::10]:80",
                &["[2001:2:0:1::1]:80", "[2001:2:0:1::2]:80"],
            ),
        ]);
        let gone = gone_udp_pairs(&before, &now);
        assert_eq!(
            gone,
            [
                (sa("198.19.0.11:80"), sa("198.18.1.1:80")),
                (sa("198.19.0.12:53"), sa("198.18.1.3:53")),
            ]
            .into_iter()
            .collect()
        );
        assert!(gone_udp_pairs(&now, &now).is_empty());
    }
}

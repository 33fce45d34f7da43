//! Both families' conntrack maps through one view, so that a packet test
//! written over the address families reads and ages entries the same way:
//! each entry as a [`CtEntry`] (addresses as `IpAddr`, ports in host order),
//! which writes itself back to the map it came from.
use std::net::{IpAddr, Ipv4Addr};

use aya::maps::{HashMap, MapData};
use proxy_common::{ipv6::ipv6, map_names, Ct4Key, Ct4Value, Ct6Key, Ct6Value};

use super::harness::Harness;

/// One conntrack entry of either family.
#[derive(Clone, Debug)]
pub struct CtEntry {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// [`proxy_common::ct_dir`].
    pub dir: u8,
    pub nat_addr: IpAddr,
    pub nat_port: u16,
    pub backend_id: u32,
    pub last_seen_ns: u64,
    raw: Raw,
}

#[derive(Clone, Debug)]
enum Raw {
    V4(Ct4Key, Ct4Value),
    V6(Ct6Key, Ct6Value),
}

/// Every entry of both conntrack maps, IPv4's first.
pub fn entries(h: &Harness) -> Vec<CtEntry> {
    let v4: HashMap<MapData, Ct4Key, Ct4Value> = h.lru_map(map_names::CONNTRACK);
    let v6: HashMap<MapData, Ct6Key, Ct6Value> = h.lru_map(map_names::CONNTRACK6);
    let ip4 = |be: u32| IpAddr::V4(Ipv4Addr::from(u32::from_be(be)));
    let ip6 = |w: &proxy_common::Addr6| IpAddr::V6(ipv6(w));
    let mut out: Vec<CtEntry> = v4
        .iter()
        .map(|e| e.expect("read the IPv4 conntrack map"))
        .map(|(k, v)| CtEntry {
            src: ip4(k.saddr_be),
            dst: ip4(k.daddr_be),
            sport: u16::from_be(k.sport_be),
            dport: u16::from_be(k.dport_be),
            proto: k.proto,
            dir: k.dir,
            nat_addr: ip4(v.nat_addr_be),
            nat_port: u16::from_be(v.nat_port_be),
            backend_id: v.backend_id,
            last_seen_ns: v.last_seen_ns,
            raw: Raw::V4(k, v),
        })
        .collect();
    out.extend(
        v6.iter()
            .map(|e| e.expect("read the IPv6 conntrack map"))
            .map(|(k, v)| CtEntry {
                src: ip6(&k.saddr_be),
                dst: ip6(&k.daddr_be),
                sport: u16::from_be(k.sport_be),
                dport: u16::from_be(k.dport_be),
                proto: k.proto,
                dir: k.dir,
                nat_addr: ip6(&v.nat_addr_be),
                nat_port: u16::from_be(v.nat_port_be),
                backend_id: v.backend_id,
                last_seen_ns: v.last_seen_ns,
                raw: Raw::V6(k, v),
            }),
    );
    out
}

impl CtEntry {
    /// Writes the entry back with its last packet seen `secs` earlier, as
    /// if that long had passed without traffic.
    pub fn age(&self, h: &Harness, secs: u64) {
        let by = secs * 1_000_000_000;
        match self.raw {
            Raw::V4(k, mut v) => {
                v.last_seen_ns = v.last_seen_ns.saturating_sub(by);
                let mut m: HashMap<MapData, Ct4Key, Ct4Value> = h.lru_map(map_names::CONNTRACK);
                m.insert(k, v, 0).expect("write the IPv4 entry");
            }
            Raw::V6(k, mut v) => {
                v.last_seen_ns = v.last_seen_ns.saturating_sub(by);
                let mut m: HashMap<MapData, Ct6Key, Ct6Value> = h.lru_map(map_names::CONNTRACK6);
                m.insert(k, v, 0).expect("write the IPv6 entry");
            }
        }
    }
}

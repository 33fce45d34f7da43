//! [`PinnedMaps`]: a running agent's pinned maps, read without loading the
//! object (inspect, metrics).

use std::net::IpAddr;

use super::*;

/// Traffic per frontend (reverse-NAT id → address, port, protocol, counters)
/// and per backend (id → address, port, protocol, counters).
#[derive(Clone, Debug, Default)]
pub struct ProgrammedTraffic {
    pub frontends: BTreeMap<RevNatId, (IpAddr, u16, u8, Traffic)>,
    pub backends: BTreeMap<u32, (IpAddr, u16, u8, Traffic)>,
}

/// The pinned LRU hash map `name` under `pin_dir`, opened for reading and
/// writing by a process that did not load the object (the handover of the
/// kernel's flows, the socket reverse-NAT lookups); an error names the map.
pub fn open_lru_hash<K: aya::Pod, V: aya::Pod>(
    pin_dir: &Path,
    name: &str,
) -> Result<HashMap<MapData, K, V>, String> {
    let data = MapData::from_pin(pin_dir.join(name)).map_err(|e| format!("open {name}: {e}"))?;
    HashMap::try_from(aya::maps::Map::LruHashMap(data)).map_err(|e| format!("{name}: {e}"))
}

/// Read-only views of pinned maps, for `inspect` and tests.
pub struct PinnedMaps {
    pub dir: PathBuf,
}

impl PinnedMaps {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The pinned maps under `dir`, which must exist: an error naming it
    /// otherwise.
    pub fn existing(dir: impl Into<PathBuf>) -> Result<Self, BpfError> {
        let dir = dir.into();
        if !dir.is_dir() {
            return Err(BpfError::NoPinDir { path: dir });
        }
        Ok(Self { dir })
    }

    /// The pin of map `name`; an error names the full path.
    fn pin(&self, name: &'static str) -> Result<MapData, BpfError> {
        let path = self.dir.join(name);
        MapData::from_pin(&path).map_err(|source| BpfError::Pinned { name, path, source })
    }

    fn open(&self, name: &'static str) -> Result<aya::maps::Map, BpfError> {
        let data = self.pin(name)?;
        Ok(match name {
            n if n == map_names::STATS => aya::maps::Map::PerCpuArray(data),
            n if n == map_names::CONNTRACK || n == map_names::CONNTRACK6 => {
                aya::maps::Map::LruHashMap(data)
            }
            n if n == map_names::CONFIG => aya::maps::Map::Array(data),
            _ => aya::maps::Map::HashMap(data),
        })
    }

    /// Counters summed over CPUs, by code.
    pub fn stats(&self) -> Result<BTreeMap<u32, u64>, BpfError> {
        let m: PerCpuArray<MapData, u64> = PerCpuArray::try_from(self.open(map_names::STATS)?)
            .map_err(map_err(map_names::STATS))?;
        let mut out = BTreeMap::new();
        for code in 1..stat::NAMES.len() as u32 {
            let v = m.get(&code, 0).map_err(map_err(map_names::STATS))?;
            out.insert(code, v.iter().sum());
        }
        Ok(out)
    }

    /// Traffic of every programmed frontend (`addr:port/proto` by reverse-NAT
    /// id) and backend (by id), summed over CPUs. Reads only the programmed ids.
    pub fn traffic(&self) -> Result<ProgrammedTraffic, BpfError> {
        let p = self.programmed()?;
        let open = |name: &'static str| -> Result<PerCpuArray<MapData, Traffic>, BpfError> {
            let data = self.pin(name)?;
            PerCpuArray::try_from(aya::maps::Map::PerCpuArray(data)).map_err(map_err(name))
        };
        let fe = open(map_names::FRONTEND_TRAFFIC)?;
        let be = open(map_names::BACKEND_TRAFFIC)?;
        let sum = |m: &PerCpuArray<MapData, Traffic>, i: u32| -> Traffic {
            m.get(&i, 0).map_or_else(
                |_| Traffic::default(),
                |v| {
                    v.iter().fold(Traffic::default(), |a, t| Traffic {
                        packets: a.packets + t.packets,
                        bytes: a.bytes + t.bytes,
                    })
                },
            )
        };
        let mut out = ProgrammedTraffic::default();
        let protos: BTreeMap<RevNatId, u8> = p
            .services
            .iter()
            .filter(|(k, _)| k.slot == 0)
            .map(|(k, v)| (v.rev_nat_id, k.proto))
            .chain(
                p.services6
                    .iter()
                    .filter(|(k, _)| k.slot == 0)
                    .map(|(k, v)| (v.rev_nat_id, k.proto)),
            )
            .collect();
        let revs = p
            .rev_nat
            .iter()
            .map(|(id, r)| (*id, IpAddr::V4(r.addr()), r.port()))
            .chain(
                p.rev_nat6
                    .iter()
                    .map(|(id, r)| (*id, IpAddr::V6(r.addr()), r.port())),
            );
        for (id, addr, port) in revs {
            let proto = protos.get(&id).copied().unwrap_or(0);
            out.frontends.insert(id, (addr, port, proto, sum(&fe, id)));
        }
        for (id, b) in &p.backends {
            out.backends
                .insert(*id, (b.addr().into(), b.port(), b.proto, sum(&be, *id)));
        }
        for (id, b) in &p.backends6 {
            out.backends
                .insert(*id, (b.addr().into(), b.port(), b.proto, sum(&be, *id)));
        }
        Ok(out)
    }

    pub fn conntrack(&self) -> Result<Vec<(Ct4Key, Ct4Value)>, BpfError> {
        let m: HashMap<MapData, Ct4Key, Ct4Value> =
            HashMap::try_from(self.open(map_names::CONNTRACK)?)
                .map_err(map_err(map_names::CONNTRACK))?;
        m.iter()
            .collect::<Result<_, _>>()
            .map_err(map_err(map_names::CONNTRACK))
    }

    /// The IPv6 conntrack entries (none where the agent has no IPv6 maps).
    pub fn conntrack6(&self) -> Result<Vec<(Ct6Key, Ct6Value)>, BpfError> {
        let Ok(m) = self.open(map_names::CONNTRACK6) else {
            return Ok(Vec::new());
        };
        let m: HashMap<MapData, Ct6Key, Ct6Value> =
            HashMap::try_from(m).map_err(map_err(map_names::CONNTRACK6))?;
        m.iter()
            .collect::<Result<_, _>>()
            .map_err(map_err(map_names::CONNTRACK6))
    }

    pub fn programmed(&self) -> Result<Programmed, BpfError> {
        let services: HashMap<MapData, Svc4Key, SvcValue> =
            HashMap::try_from(self.open(map_names::SERVICES)?)
                .map_err(map_err(map_names::SERVICES))?;
        let backends: HashMap<MapData, u32, Backend4> =
            HashMap::try_from(self.open(map_names::BACKENDS)?)
                .map_err(map_err(map_names::BACKENDS))?;
        let rev_nat: HashMap<MapData, RevNatId, RevNat4> =
            HashMap::try_from(self.open(map_names::REV_NAT)?)
                .map_err(map_err(map_names::REV_NAT))?;
        let mut p = Programmed::default();
        for kv in services.iter() {
            let (k, v) = kv.map_err(map_err(map_names::SERVICES))?;
            p.services.insert(k, v);
        }
        for kv in backends.iter() {
            let (k, v) = kv.map_err(map_err(map_names::BACKENDS))?;
            p.backends.insert(k, v);
        }
        for kv in rev_nat.iter() {
            let (k, v) = kv.map_err(map_err(map_names::REV_NAT))?;
            p.rev_nat.insert(k, v);
        }
        // An agent older than Maglev has no such map: no tables.
        if let Ok(m) = self.open(map_names::MAGLEV) {
            let maglev: HashMap<MapData, MaglevKey, MaglevChunk> =
                HashMap::try_from(m).map_err(map_err(map_names::MAGLEV))?;
            for kv in maglev.iter() {
                let (k, v) = kv.map_err(map_err(map_names::MAGLEV))?;
                p.maglev.insert(k, v);
            }
        }
        // An agent older than IPv6 has no such maps.
        if let (Ok(s), Ok(b), Ok(r)) = (
            self.open(map_names::SERVICES6),
            self.open(map_names::BACKENDS6),
            self.open(map_names::REV_NAT6),
        ) {
            let s: HashMap<MapData, Svc6Key, SvcValue> =
                HashMap::try_from(s).map_err(map_err(map_names::SERVICES6))?;
            for kv in s.iter() {
                let (k, v) = kv.map_err(map_err(map_names::SERVICES6))?;
                p.services6.insert(k, v);
            }
            let b: HashMap<MapData, u32, Backend6> =
                HashMap::try_from(b).map_err(map_err(map_names::BACKENDS6))?;
            for kv in b.iter() {
                let (k, v) = kv.map_err(map_err(map_names::BACKENDS6))?;
                p.backends6.insert(k, v);
            }
            let r: HashMap<MapData, RevNatId, RevNat6> =
                HashMap::try_from(r).map_err(map_err(map_names::REV_NAT6))?;
            for kv in r.iter() {
                let (k, v) = kv.map_err(map_err(map_names::REV_NAT6))?;
                p.rev_nat6.insert(k, v);
            }
        }
        Ok(p)
    }
}

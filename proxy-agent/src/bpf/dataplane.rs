//! [`BpfDataplane`]: the maps the writer programs (conntrack garbage
//! collection is `gc.rs`'s, over the pinned maps).

use std::net::IpAddr;

use super::*;

/// The maps the agent writes, taken out of the loaded object.
pub struct BpfDataplane {
    services: HashMap<MapData, Svc4Key, SvcValue>,
    backends: HashMap<MapData, u32, Backend4>,
    rev_nat: HashMap<MapData, RevNatId, RevNat4>,
    config: Array<MapData, Config>,
    affinity: HashMap<MapData, Affinity4Key, AffinityValue>,
    source_ranges: LpmTrie<MapData, SourceRange4, u8>,
    maglev: HashMap<MapData, MaglevKey, MaglevChunk>,
    services6: HashMap<MapData, Svc6Key, SvcValue>,
    backends6: HashMap<MapData, u32, Backend6>,
    rev_nat6: HashMap<MapData, RevNatId, RevNat6>,
    affinity6: HashMap<MapData, Affinity6Key, AffinityValue>,
    source_ranges6: LpmTrie<MapData, SourceRange6, u8>,
    sizes: MapSizes,
    /// Writes and deletes go in batches (`batch::update_prefix`,
    /// `batch::delete_prefix`) until the kernel says it has none (it has
    /// both or neither: Linux 5.6 brought them together to hash maps).
    batch_writes: bool,
}

/// `bpf_ktime_get_ns()` as user space sees it: CLOCK_MONOTONIC.
pub fn ktime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn source_range_key(
    rev_nat_id: RevNatId,
    addr: std::net::Ipv4Addr,
    len: u8,
) -> LpmKey<SourceRange4> {
    LpmKey::new(
        SOURCE_RANGE_ID_BITS + u32::from(len.min(32)),
        SourceRange4 {
            rev_nat_id_be: rev_nat_id.to_be(),
            addr_be: u32::from_ne_bytes(addr.octets()),
        },
    )
}

fn source_range_key6(
    rev_nat_id: RevNatId,
    addr: std::net::Ipv6Addr,
    len: u8,
) -> LpmKey<SourceRange6> {
    LpmKey::new(
        SOURCE_RANGE_ID_BITS + u32::from(len.min(128)),
        SourceRange6 {
            rev_nat_id_be: rev_nat_id.to_be(),
            addr_be: proxy_common::ipv6::addr6(addr),
        },
    )
}

impl BpfDataplane {
    pub fn new(ebpf: &mut Ebpf, sizes: MapSizes) -> Result<Self, BpfError> {
        Ok(Self {
            services: HashMap::try_from(take_map(ebpf, map_names::SERVICES)?)
                .map_err(map_err(map_names::SERVICES))?,
            backends: HashMap::try_from(take_map(ebpf, map_names::BACKENDS)?)
                .map_err(map_err(map_names::BACKENDS))?,
            rev_nat: HashMap::try_from(take_map(ebpf, map_names::REV_NAT)?)
                .map_err(map_err(map_names::REV_NAT))?,
            config: Array::try_from(take_map(ebpf, map_names::CONFIG)?)
                .map_err(map_err(map_names::CONFIG))?,
            affinity: HashMap::try_from(take_map(ebpf, map_names::AFFINITY)?)
                .map_err(map_err(map_names::AFFINITY))?,
            source_ranges: LpmTrie::try_from(take_map(ebpf, map_names::SOURCE_RANGES)?)
                .map_err(map_err(map_names::SOURCE_RANGES))?,
            maglev: HashMap::try_from(take_map(ebpf, map_names::MAGLEV)?)
                .map_err(map_err(map_names::MAGLEV))?,
            services6: HashMap::try_from(take_map(ebpf, map_names::SERVICES6)?)
                .map_err(map_err(map_names::SERVICES6))?,
            backends6: HashMap::try_from(take_map(ebpf, map_names::BACKENDS6)?)
                .map_err(map_err(map_names::BACKENDS6))?,
            rev_nat6: HashMap::try_from(take_map(ebpf, map_names::REV_NAT6)?)
                .map_err(map_err(map_names::REV_NAT6))?,
            affinity6: HashMap::try_from(take_map(ebpf, map_names::AFFINITY6)?)
                .map_err(map_err(map_names::AFFINITY6))?,
            source_ranges6: LpmTrie::try_from(take_map(ebpf, map_names::SOURCE_RANGES6)?)
                .map_err(map_err(map_names::SOURCE_RANGES6))?,
            sizes,
            batch_writes: true,
        })
    }

    /// The maps a loaded object pinned under `pin_dir`, opened again from
    /// their pins: a writer over the maps of an object loaded earlier
    /// (whose programs still use them).
    pub fn from_pins(pin_dir: &Path, sizes: MapSizes) -> Result<Self, BpfError> {
        use aya::maps::Map;
        let open =
            |name: &'static str| MapData::from_pin(pin_dir.join(name)).map_err(map_err(name));
        Ok(Self {
            services: HashMap::try_from(Map::HashMap(open(map_names::SERVICES)?))
                .map_err(map_err(map_names::SERVICES))?,
            backends: HashMap::try_from(Map::HashMap(open(map_names::BACKENDS)?))
                .map_err(map_err(map_names::BACKENDS))?,
            rev_nat: HashMap::try_from(Map::HashMap(open(map_names::REV_NAT)?))
                .map_err(map_err(map_names::REV_NAT))?,
            config: Array::try_from(Map::Array(open(map_names::CONFIG)?))
                .map_err(map_err(map_names::CONFIG))?,
            affinity: HashMap::try_from(Map::LruHashMap(open(map_names::AFFINITY)?))
                .map_err(map_err(map_names::AFFINITY))?,
            source_ranges: LpmTrie::try_from(Map::LpmTrie(open(map_names::SOURCE_RANGES)?))
                .map_err(map_err(map_names::SOURCE_RANGES))?,
            maglev: HashMap::try_from(Map::HashMap(open(map_names::MAGLEV)?))
                .map_err(map_err(map_names::MAGLEV))?,
            services6: HashMap::try_from(Map::HashMap(open(map_names::SERVICES6)?))
                .map_err(map_err(map_names::SERVICES6))?,
            backends6: HashMap::try_from(Map::HashMap(open(map_names::BACKENDS6)?))
                .map_err(map_err(map_names::BACKENDS6))?,
            rev_nat6: HashMap::try_from(Map::HashMap(open(map_names::REV_NAT6)?))
                .map_err(map_err(map_names::REV_NAT6))?,
            affinity6: HashMap::try_from(Map::LruHashMap(open(map_names::AFFINITY6)?))
                .map_err(map_err(map_names::AFFINITY6))?,
            source_ranges6: LpmTrie::try_from(Map::LpmTrie(open(map_names::SOURCE_RANGES6)?))
                .map_err(map_err(map_names::SOURCE_RANGES6))?,
            sizes,
            batch_writes: true,
        })
    }

    /// Writes the datapath configuration (index 0 of the config map).
    pub fn set_config(&mut self, cfg: Config) -> Result<(), BpfError> {
        self.config
            .set(0, cfg, 0)
            .map_err(map_err(map_names::CONFIG))
    }
}

fn op_err(map: &'static str, op: &'static str, capacity: u32, e: MapError) -> DataplaneError {
    // A write that finds no room; a delete never does.
    if let (MapError::SyscallError(s), false) = (&e, op == "delete") {
        if s.io_error.raw_os_error() == Some(libc::E2BIG)
            || s.io_error.raw_os_error() == Some(libc::ENOMEM)
        {
            return DataplaneError::Full { map, capacity };
        }
    }
    DataplaneError::Op {
        map,
        op,
        reason: e.to_string(),
    }
}

/// Writes `entries` to `map` (`name`, `capacity` entries) in order, in
/// batches while `batches` holds (cleared when the kernel has none), else one
/// at a time, stopping at the first that fails ([`Dataplane::put_services`]).
/// The entry a batch stops at is written again alone, for its own error (or,
/// the cause gone, written, and the batches go on after it): the outcome is
/// the one single writes give.
fn put_all<K: aya::Pod, V: aya::Pod>(
    batches: &mut bool,
    map: &mut HashMap<MapData, K, V>,
    name: &'static str,
    capacity: u32,
    entries: &[(K, V)],
) -> BatchOutcome {
    use aya::maps::IterableMap;
    use std::os::fd::AsFd;
    let mut done = 0;
    while done < entries.len() {
        if !*batches {
            let (n, err) = each(&entries[done..], |(k, v)| {
                map.insert(k, v, 0)
                    .map_err(|e| op_err(name, "insert", capacity, e))
            });
            return (done + n, err);
        }
        let (n, err) = batch::update_prefix(map.map().fd().as_fd(), &entries[done..]);
        done += n;
        let Some(err) = err else {
            break;
        };
        if n == 0 && batch::unsupported(&err) {
            *batches = false;
            continue;
        }
        let Some((k, v)) = entries.get(done) else {
            break;
        };
        if let Err(e) = map.insert(k, v, 0) {
            return (done, Some(op_err(name, "insert", capacity, e)));
        }
        done += 1;
    }
    (done, None)
}

/// Deletes `keys` from `map` as [`put_all`] writes (the batches'
/// `batch::delete_prefix`), as single deletes would: an absent key, at which
/// a batch stops too, is deleted already, and the batches go on after it.
fn delete_all<K: aya::Pod, V: aya::Pod>(
    batches: &mut bool,
    map: &mut HashMap<MapData, K, V>,
    name: &'static str,
    capacity: u32,
    keys: &[K],
) -> BatchOutcome {
    use aya::maps::IterableMap;
    use std::os::fd::AsFd;
    let delete = |map: &mut HashMap<MapData, K, V>, k: &K| {
        ignore_missing(map.remove(k)).map_err(|e| op_err(name, "delete", capacity, e))
    };
    let mut done = 0;
    while done < keys.len() {
        if !*batches {
            let (n, err) = each(&keys[done..], |k| delete(map, k));
            return (done + n, err);
        }
        let (n, err) = batch::delete_prefix(map.map().fd().as_fd(), &keys[done..]);
        done += n;
        let Some(err) = err else {
            break;
        };
        if n == 0 && batch::unsupported(&err) {
            *batches = false;
            continue;
        }
        let Some(k) = keys.get(done) else {
            break;
        };
        if let Err(e) = delete(map, k) {
            return (done, Some(e));
        }
        done += 1;
    }
    (done, None)
}

/// Deleting an absent key is not an error: the state wanted is reached.
fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

/// An id to delete, in its family's map.
fn by_family(&(family, id): &(Family, u32)) -> ByFamily<u32, u32> {
    match family {
        Family::V4 => ByFamily::V4(id),
        Family::V6 => ByFamily::V6(id),
    }
}

impl Dataplane for BpfDataplane {
    fn put_services(&mut self, entries: &[(ServiceKey, SvcValue)]) -> BatchOutcome {
        let (cap, batches) = (self.sizes.services, &mut self.batch_writes);
        let (v4, v6) = (&mut self.services, &mut self.services6);
        family_runs(
            entries,
            |(k, v)| match k {
                ServiceKey::V4(k) => ByFamily::V4((*k, *v)),
                ServiceKey::V6(k) => ByFamily::V6((*k, *v)),
            },
            |run| match run {
                ByFamily::V4(r) => put_all(batches, v4, map_names::SERVICES, cap, r),
                ByFamily::V6(r) => put_all(batches, v6, map_names::SERVICES6, cap, r),
            },
        )
    }
    fn delete_services(&mut self, keys: &[ServiceKey]) -> BatchOutcome {
        let (cap, batches) = (self.sizes.services, &mut self.batch_writes);
        let (v4, v6) = (&mut self.services, &mut self.services6);
        family_runs(
            keys,
            |k| match k {
                ServiceKey::V4(k) => ByFamily::V4(*k),
                ServiceKey::V6(k) => ByFamily::V6(*k),
            },
            |run| match run {
                ByFamily::V4(r) => delete_all(batches, v4, map_names::SERVICES, cap, r),
                ByFamily::V6(r) => delete_all(batches, v6, map_names::SERVICES6, cap, r),
            },
        )
    }
    fn put_backends(&mut self, entries: &[(u32, BackendEntry)]) -> BatchOutcome {
        let (cap, batches) = (self.sizes.backends, &mut self.batch_writes);
        let (v4, v6) = (&mut self.backends, &mut self.backends6);
        family_runs(
            entries,
            |(id, b)| match b {
                BackendEntry::V4(b) => ByFamily::V4((*id, *b)),
                BackendEntry::V6(b) => ByFamily::V6((*id, *b)),
            },
            |run| match run {
                ByFamily::V4(r) => put_all(batches, v4, map_names::BACKENDS, cap, r),
                ByFamily::V6(r) => put_all(batches, v6, map_names::BACKENDS6, cap, r),
            },
        )
    }
    fn delete_backends(&mut self, ids: &[(Family, u32)]) -> BatchOutcome {
        let (cap, batches) = (self.sizes.backends, &mut self.batch_writes);
        let (v4, v6) = (&mut self.backends, &mut self.backends6);
        family_runs(ids, by_family, |run| match run {
            ByFamily::V4(r) => delete_all(batches, v4, map_names::BACKENDS, cap, r),
            ByFamily::V6(r) => delete_all(batches, v6, map_names::BACKENDS6, cap, r),
        })
    }
    fn put_rev_nats(&mut self, entries: &[(RevNatId, RevNatEntry)]) -> BatchOutcome {
        let (cap, batches) = (self.sizes.rev_nat, &mut self.batch_writes);
        let (v4, v6) = (&mut self.rev_nat, &mut self.rev_nat6);
        family_runs(
            entries,
            |(id, r)| match r {
                RevNatEntry::V4(r) => ByFamily::V4((*id, *r)),
                RevNatEntry::V6(r) => ByFamily::V6((*id, *r)),
            },
            |run| match run {
                ByFamily::V4(r) => put_all(batches, v4, map_names::REV_NAT, cap, r),
                ByFamily::V6(r) => put_all(batches, v6, map_names::REV_NAT6, cap, r),
            },
        )
    }
    fn delete_rev_nats(&mut self, ids: &[(Family, RevNatId)]) -> BatchOutcome {
        let (cap, batches) = (self.sizes.rev_nat, &mut self.batch_writes);
        let (v4, v6) = (&mut self.rev_nat, &mut self.rev_nat6);
        family_runs(ids, by_family, |run| match run {
            ByFamily::V4(r) => delete_all(batches, v4, map_names::REV_NAT, cap, r),
            ByFamily::V6(r) => delete_all(batches, v6, map_names::REV_NAT6, cap, r),
        })
    }
    fn put_maglev_chunk(
        &mut self,
        key: MaglevKey,
        chunk: &MaglevChunk,
    ) -> Result<(), DataplaneError> {
        let cap = self.sizes.maglev_chunks;
        self.maglev
            .insert(key, chunk, 0)
            .map_err(|e| op_err(map_names::MAGLEV, "insert", cap, e))
    }
    fn delete_maglev_chunk(&mut self, key: MaglevKey) -> Result<(), DataplaneError> {
        let cap = self.sizes.maglev_chunks;
        ignore_missing(self.maglev.remove(&key))
            .map_err(|e| op_err(map_names::MAGLEV, "delete", cap, e))
    }
    fn prune_affinity(
        &mut self,
        keep: &BTreeMap<RevNatId, BTreeSet<u32>>,
    ) -> Result<usize, DataplaneError> {
        let stale = |rev_nat_id: RevNatId, backend_id: u32| {
            keep.get(&rev_nat_id)
                .is_some_and(|set| !set.contains(&backend_id))
        };
        // One read of each map, in batches (`batch::entries`).
        let stale4: Vec<Affinity4Key> = batch::entries(&self.affinity)
            .map_err(|e| op_err(map_names::AFFINITY, "dump", 0, e))?
            .into_iter()
            .filter(|(k, v)| stale(k.rev_nat_id, v.backend_id))
            .map(|(k, _)| k)
            .collect();
        for k in &stale4 {
            let cap = capacity::AFFINITY;
            ignore_missing(self.affinity.remove(k))
                .map_err(|e| op_err(map_names::AFFINITY, "delete", cap, e))?;
        }
        let stale6: Vec<Affinity6Key> = batch::entries(&self.affinity6)
            .map_err(|e| op_err(map_names::AFFINITY6, "dump", 0, e))?
            .into_iter()
            .filter(|(k, v)| stale(k.rev_nat_id, v.backend_id))
            .map(|(k, _)| k)
            .collect();
        for k in &stale6 {
            let cap = capacity::AFFINITY6;
            ignore_missing(self.affinity6.remove(k))
                .map_err(|e| op_err(map_names::AFFINITY6, "delete", cap, e))?;
        }
        Ok(stale4.len() + stale6.len())
    }
    fn id_spaces(&self) -> (u32, u32) {
        (self.sizes.backends, self.sizes.rev_nat)
    }
    fn affinity_ids(&self) -> Result<BTreeSet<RevNatId>, DataplaneError> {
        let mut ids = BTreeSet::new();
        let all4 = batch::entries(&self.affinity)
            .map_err(|e| op_err(map_names::AFFINITY, "dump", 0, e))?;
        ids.extend(all4.iter().map(|(k, _)| k.rev_nat_id));
        let all6 = batch::entries(&self.affinity6)
            .map_err(|e| op_err(map_names::AFFINITY6, "dump", 0, e))?;
        ids.extend(all6.iter().map(|(k, _)| k.rev_nat_id));
        Ok(ids)
    }
    fn put_source_range(
        &mut self,
        rev_nat_id: RevNatId,
        (addr, len): SourceRange,
    ) -> Result<(), DataplaneError> {
        let cap = capacity::SOURCE_RANGES;
        match addr {
            IpAddr::V4(a) => self
                .source_ranges
                .insert(&source_range_key(rev_nat_id, a, len), 1, 0)
                .map_err(|e| op_err(map_names::SOURCE_RANGES, "insert", cap, e)),
            IpAddr::V6(a) => self
                .source_ranges6
                .insert(&source_range_key6(rev_nat_id, a, len), 1, 0)
                .map_err(|e| op_err(map_names::SOURCE_RANGES6, "insert", cap, e)),
        }
    }
    fn delete_source_range(
        &mut self,
        rev_nat_id: RevNatId,
        (addr, len): SourceRange,
    ) -> Result<(), DataplaneError> {
        let cap = capacity::SOURCE_RANGES;
        match addr {
            IpAddr::V4(a) => ignore_missing(
                self.source_ranges
                    .remove(&source_range_key(rev_nat_id, a, len)),
            )
            .map_err(|e| op_err(map_names::SOURCE_RANGES, "delete", cap, e)),
            IpAddr::V6(a) => ignore_missing(
                self.source_ranges6
                    .remove(&source_range_key6(rev_nat_id, a, len)),
            )
            .map_err(|e| op_err(map_names::SOURCE_RANGES6, "delete", cap, e)),
        }
    }
    fn dump(&self) -> Result<Programmed, DataplaneError> {
        let d = |map: &'static str| {
            move |e: MapError| DataplaneError::Op {
                map,
                op: "dump",
                reason: e.to_string(),
            }
        };
        let mut p = Programmed::default();
        for kv in self.services.iter() {
            let (k, v) = kv.map_err(d(map_names::SERVICES))?;
            p.services.insert(k, v);
        }
        for kv in self.backends.iter() {
            let (k, v) = kv.map_err(d(map_names::BACKENDS))?;
            p.backends.insert(k, v);
        }
        for kv in self.rev_nat.iter() {
            let (k, v) = kv.map_err(d(map_names::REV_NAT))?;
            p.rev_nat.insert(k, v);
        }
        for kv in self.maglev.iter() {
            let (k, v) = kv.map_err(d(map_names::MAGLEV))?;
            p.maglev.insert(k, v);
        }
        for kv in self.services6.iter() {
            let (k, v) = kv.map_err(d(map_names::SERVICES6))?;
            p.services6.insert(k, v);
        }
        for kv in self.backends6.iter() {
            let (k, v) = kv.map_err(d(map_names::BACKENDS6))?;
            p.backends6.insert(k, v);
        }
        for kv in self.rev_nat6.iter() {
            let (k, v) = kv.map_err(d(map_names::REV_NAT6))?;
            p.rev_nat6.insert(k, v);
        }
        for k in self.source_ranges.keys() {
            let k = k.map_err(d(map_names::SOURCE_RANGES))?;
            let data = k.data();
            let len = k.prefix_len().saturating_sub(SOURCE_RANGE_ID_BITS) as u8;
            let o = data.addr_be.to_ne_bytes();
            p.source_ranges
                .entry(RevNatId::from_be(data.rev_nat_id_be))
                .or_default()
                .insert((
                    IpAddr::V4(std::net::Ipv4Addr::new(o[0], o[1], o[2], o[3])),
                    len,
                ));
        }
        for k in self.source_ranges6.keys() {
            let k = k.map_err(d(map_names::SOURCE_RANGES6))?;
            let data = k.data();
            let len = k.prefix_len().saturating_sub(SOURCE_RANGE_ID_BITS) as u8;
            p.source_ranges
                .entry(RevNatId::from_be(data.rev_nat_id_be))
                .or_default()
                .insert((IpAddr::V6(proxy_common::ipv6::ipv6(&data.addr_be)), len));
        }
        Ok(p)
    }
}

//! The BPF side of the agent: loading the embedded object with its maps pinned
//! under a bpffs directory (a restarted agent adopts them), the [`Dataplane`]
//! implementation over those maps, and attaching the tc program to pod
//! interfaces.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use aya::{
    maps::{
        lpm_trie::{Key as LpmKey, LpmTrie},
        Array, HashMap, MapData, MapError, PerCpuArray,
    },
    programs::{
        links::{FdLink, PinnedLink},
        tc::SchedClassifierLink,
        xdp::XdpLink,
        SchedClassifier, TcAttachType, Xdp, XdpMode,
    },
    Ebpf, EbpfLoader,
};
use proxy_common::{
    capacity, conntrack, iface_flags, map_names, stat, Affinity4Key, Affinity4Value, Backend4,
    Config, Ct4Key, Ct4Value, Iface, RevNat4, SourceRange4, Svc4Key, Svc4Value, Traffic,
    SOURCE_RANGE_ID_BITS,
};

use crate::dataplane::{Dataplane, DataplaneError, Programmed, SourceRange};

/// The kernel object built from `proxy-ebpf` by `build.rs`.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy"));

/// Name of the tc program for pod interfaces (the function name in `proxy-ebpf`).
pub const POD_INGRESS_PROGRAM: &str = "pod_ingress";
/// Name of the tc program for the node's external devices.
pub const EXT_INGRESS_PROGRAM: &str = "ext_ingress";

/// Name of the XDP program for the node's external devices (`--acceleration xdp`).
pub const EXT_XDP_PROGRAM: &str = "ext_xdp";

/// Which program a link attaches, and so to which side of the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum IfaceKind {
    /// The host side of a pod's veth: `pod_ingress` at tc ingress, delivered
    /// to with `bpf_redirect_peer`.
    Pod,
    /// A device towards other nodes and external clients: `ext_ingress` at tc
    /// ingress.
    External,
    /// The same device's XDP hook: `ext_xdp` (XDP acceleration).
    ExternalXdp,
}

impl IfaceKind {
    pub fn program(self) -> &'static str {
        match self {
            IfaceKind::Pod => POD_INGRESS_PROGRAM,
            IfaceKind::External => EXT_INGRESS_PROGRAM,
            IfaceKind::ExternalXdp => EXT_XDP_PROGRAM,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error("cannot prepare the pin directory {path}: {source}")]
    PinDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not on a bpffs mount (mount one with `mount -t bpf bpf {path}` or pass --bpffs under /sys/fs/bpf)")]
    NotBpffs { path: PathBuf },
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: MapError,
    },
    #[error("map {0} missing from the object")]
    MissingMap(&'static str),
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("program {name}: link: {reason}")]
    Link { name: &'static str, reason: String },
}

/// Map sizes, from the agent's configuration.
#[derive(Clone, Copy, Debug)]
pub struct MapSizes {
    pub services: u32,
    pub backends: u32,
    pub rev_nat: u32,
    pub conntrack: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: capacity::SERVICES,
            backends: capacity::BACKENDS,
            rev_nat: capacity::REV_NAT,
            conntrack: capacity::CONNTRACK,
        }
    }
}

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

fn ensure_bpffs_dir(dir: &Path) -> Result<(), BpfError> {
    std::fs::create_dir_all(dir).map_err(|source| BpfError::PinDir {
        path: dir.into(),
        source,
    })?;
    let st = nix::sys::statfs::statfs(dir).map_err(|e| BpfError::PinDir {
        path: dir.into(),
        source: std::io::Error::from_raw_os_error(e as i32),
    })?;
    if st.filesystem_type().0 as i64 != BPF_FS_MAGIC {
        return Err(BpfError::NotBpffs { path: dir.into() });
    }
    Ok(())
}

/// The loaded object: programs (for attaching) and the maps, pinned.
pub struct Loaded {
    pub ebpf: Ebpf,
    pub pin_dir: PathBuf,
}

/// Loads the embedded object. Every map is pinned as `<pin_dir>/<MAP_NAME>`; a
/// map already pinned there (by an earlier agent) is reused, with its entries,
/// so established flows keep their conntrack state across restarts.
pub fn load(pin_dir: &Path, sizes: MapSizes) -> Result<Loaded, BpfError> {
    load_with_migrations(pin_dir, sizes, MIGRATIONS)
}

/// A change of a map's layout, from the pinned map of an older agent to the
/// current one. Map names carry their layout version (`CT4_V1`); an agent
/// that finds a pinned map of an older version copies its entries, converted,
/// into the current map, then removes the old pin. Entries of an old map with
/// no migration are dropped (with a warning).
pub struct Migration {
    /// Pinned name of the old layout, e.g. `CT4_V0`.
    pub from: &'static str,
    /// The current map it migrates into (one of `map_names::ALL`).
    pub to: &'static str,
    /// Copies the old map's entries, converted, into the new one; returns how
    /// many were copied.
    pub run: fn(old: MapData, new: &mut aya::maps::Map) -> Result<usize, MapError>,
}

/// Migrations this agent knows. Every map is at its first layout (`_V1`), so
/// there is none yet; the mechanism is tested with a layout changed on purpose.
pub const MIGRATIONS: &[Migration] = &[];

/// Whether `name` looks like a versioned map pin (`SOMETHING_V<digits>`).
fn is_versioned_map_pin(name: &str) -> bool {
    name.rsplit_once("_V").is_some_and(|(base, v)| {
        !base.is_empty() && !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit())
    })
}

/// [`load`] with the given migrations.
pub fn load_with_migrations(
    pin_dir: &Path,
    sizes: MapSizes,
    migrations: &[Migration],
) -> Result<Loaded, BpfError> {
    ensure_bpffs_dir(pin_dir)?;
    let paths: Vec<(&'static str, PathBuf)> = map_names::ALL
        .iter()
        .map(|n| (*n, pin_dir.join(n)))
        .collect();
    let mut loader = EbpfLoader::new();
    for (name, path) in &paths {
        loader.map_pin_path(name, path.as_path());
    }
    loader
        .map_max_entries(map_names::SERVICES, sizes.services)
        .map_max_entries(map_names::BACKENDS, sizes.backends)
        .map_max_entries(map_names::REV_NAT, sizes.rev_nat)
        .map_max_entries(map_names::CONNTRACK, sizes.conntrack);
    let mut ebpf = loader.load(EBPF_OBJECT)?;
    for name in [POD_INGRESS_PROGRAM, EXT_INGRESS_PROGRAM] {
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or(BpfError::Program {
                name,
                source: aya::programs::ProgramError::UnexpectedProgramType,
            })?
            .try_into()
            .map_err(|source| BpfError::Program { name, source })?;
        prog.load()
            .map_err(|source| BpfError::Program { name, source })?;
    }
    let xdp: &mut Xdp = ebpf
        .program_mut(EXT_XDP_PROGRAM)
        .ok_or(BpfError::Program {
            name: EXT_XDP_PROGRAM,
            source: aya::programs::ProgramError::UnexpectedProgramType,
        })?
        .try_into()
        .map_err(|source| BpfError::Program {
            name: EXT_XDP_PROGRAM,
            source,
        })?;
    xdp.load().map_err(|source| BpfError::Program {
        name: EXT_XDP_PROGRAM,
        source,
    })?;
    migrate(pin_dir, &mut ebpf, migrations)?;
    Ok(Loaded {
        ebpf,
        pin_dir: pin_dir.to_owned(),
    })
}

/// Runs the migrations whose old map is pinned in `pin_dir`, then removes
/// pins of older layouts nothing migrates.
fn migrate(pin_dir: &Path, ebpf: &mut Ebpf, migrations: &[Migration]) -> Result<(), BpfError> {
    for m in migrations {
        let old_path = pin_dir.join(m.from);
        if !old_path.exists() {
            continue;
        }
        let old = MapData::from_pin(&old_path).map_err(map_err(m.to))?;
        let new = ebpf.map_mut(m.to).ok_or(BpfError::MissingMap(m.to))?;
        let n = (m.run)(old, new).map_err(map_err(m.to))?;
        std::fs::remove_file(&old_path).map_err(|source| BpfError::PinDir {
            path: old_path.clone(),
            source,
        })?;
        tracing::info!(
            from = m.from,
            to = m.to,
            entries = n,
            "migrated a pinned map to its new layout"
        );
    }
    let Ok(dir) = std::fs::read_dir(pin_dir) else {
        return Ok(());
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if is_versioned_map_pin(&name) && !map_names::ALL.contains(&name.as_str()) {
            tracing::warn!(pin = %e.path().display(), "a map of an older layout with no migration: its entries are dropped");
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(())
}

fn take_map(ebpf: &mut Ebpf, name: &'static str) -> Result<aya::maps::Map, BpfError> {
    ebpf.take_map(name).ok_or(BpfError::MissingMap(name))
}

fn map_err(name: &'static str) -> impl Fn(MapError) -> BpfError {
    move |source| BpfError::Map { name, source }
}

/// The maps the agent writes, taken out of the loaded object.
pub struct BpfDataplane {
    services: HashMap<MapData, Svc4Key, Svc4Value>,
    backends: HashMap<MapData, u32, Backend4>,
    rev_nat: HashMap<MapData, u16, RevNat4>,
    config: Array<MapData, Config>,
    affinity: HashMap<MapData, Affinity4Key, Affinity4Value>,
    source_ranges: LpmTrie<MapData, SourceRange4, u8>,
    conntrack: HashMap<MapData, Ct4Key, Ct4Value>,
    sizes: MapSizes,
}

/// What one conntrack garbage collection did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtGcReport {
    pub scanned: usize,
    pub expired: usize,
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

fn source_range_key(rev_nat_id: u16, (addr, len): SourceRange) -> LpmKey<SourceRange4> {
    LpmKey::new(
        SOURCE_RANGE_ID_BITS + u32::from(len.min(32)),
        SourceRange4 {
            rev_nat_id_be: rev_nat_id.to_be(),
            _pad: 0,
            addr_be: u32::from_ne_bytes(addr.octets()),
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
            conntrack: HashMap::try_from(take_map(ebpf, map_names::CONNTRACK)?)
                .map_err(map_err(map_names::CONNTRACK))?,
            sizes,
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
    if let MapError::SyscallError(s) = &e {
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

/// Deleting an absent key is not an error: the state wanted is reached.
fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

impl BpfDataplane {
    /// Garbage-collects conntrack at time `now_ns` ([`ktime_ns`]): a SERVICE
    /// entry idle for longer than its timeout (per protocol and TCP state, as
    /// the datapath judges it) is deleted with its REPLY entry; a REPLY entry
    /// whose SERVICE entry is gone is deleted. The LRU bounds the map anyway;
    /// this frees entries of finished flows before it has to.
    pub fn gc_conntrack(&mut self, cfg: &Config, now_ns: u64) -> CtGcReport {
        let entries: Vec<(Ct4Key, Ct4Value)> =
            self.conntrack.iter().filter_map(Result::ok).collect();
        let mut report = CtGcReport {
            scanned: entries.len(),
            expired: 0,
        };
        let live: std::collections::HashSet<Ct4Key> = entries
            .iter()
            .filter(|(k, v)| {
                k.dir == proxy_common::ct_dir::SERVICE && conntrack::alive(cfg, k.proto, v, now_ns)
            })
            .map(|(k, _)| *k)
            .collect();
        let rev: BTreeMap<u16, RevNat4> = self.rev_nat.iter().filter_map(Result::ok).collect();
        for (k, v) in &entries {
            let keep = match k.dir {
                proxy_common::ct_dir::SERVICE => live.contains(k),
                _ => {
                    // The SERVICE entry of this reply's flow.
                    let Some(r) = rev.get(&v.rev_nat_id) else {
                        report.expired += usize::from(self.conntrack.remove(k).is_ok());
                        continue;
                    };
                    let skey = k.service_of_reply(v, r);
                    // A reply entry younger than a second may belong to a
                    // flow being created right now.
                    live.contains(&skey)
                        || now_ns.saturating_sub(v.last_seen_ns) < conntrack::NSEC_PER_SEC
                }
            };
            if !keep && self.conntrack.remove(k).is_ok() {
                report.expired += 1;
            }
        }
        report
    }
}

impl Dataplane for BpfDataplane {
    fn put_backend(&mut self, id: u32, backend: Backend4) -> Result<(), DataplaneError> {
        let cap = self.sizes.backends;
        self.backends
            .insert(id, backend, 0)
            .map_err(|e| op_err(map_names::BACKENDS, "insert", cap, e))
    }
    fn delete_backend(&mut self, id: u32) -> Result<(), DataplaneError> {
        let cap = self.sizes.backends;
        ignore_missing(self.backends.remove(&id))
            .map_err(|e| op_err(map_names::BACKENDS, "delete", cap, e))
    }
    fn put_service(&mut self, key: Svc4Key, value: Svc4Value) -> Result<(), DataplaneError> {
        let cap = self.sizes.services;
        self.services
            .insert(key, value, 0)
            .map_err(|e| op_err(map_names::SERVICES, "insert", cap, e))
    }
    fn delete_service(&mut self, key: Svc4Key) -> Result<(), DataplaneError> {
        let cap = self.sizes.services;
        ignore_missing(self.services.remove(&key))
            .map_err(|e| op_err(map_names::SERVICES, "delete", cap, e))
    }
    fn put_rev_nat(&mut self, id: u16, value: RevNat4) -> Result<(), DataplaneError> {
        let cap = self.sizes.rev_nat;
        self.rev_nat
            .insert(id, value, 0)
            .map_err(|e| op_err(map_names::REV_NAT, "insert", cap, e))
    }
    fn delete_rev_nat(&mut self, id: u16) -> Result<(), DataplaneError> {
        let cap = self.sizes.rev_nat;
        ignore_missing(self.rev_nat.remove(&id))
            .map_err(|e| op_err(map_names::REV_NAT, "delete", cap, e))
    }
    fn prune_affinity(
        &mut self,
        rev_nat_id: u16,
        keep: &BTreeSet<u32>,
    ) -> Result<usize, DataplaneError> {
        let stale: Vec<Affinity4Key> = self
            .affinity
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, v)| k.rev_nat_id == rev_nat_id && !keep.contains(&v.backend_id))
            .map(|(k, _)| k)
            .collect();
        for k in &stale {
            let cap = capacity::AFFINITY;
            ignore_missing(self.affinity.remove(k))
                .map_err(|e| op_err(map_names::AFFINITY, "delete", cap, e))?;
        }
        Ok(stale.len())
    }
    fn put_source_range(
        &mut self,
        rev_nat_id: u16,
        range: SourceRange,
    ) -> Result<(), DataplaneError> {
        let cap = capacity::SOURCE_RANGES;
        self.source_ranges
            .insert(&source_range_key(rev_nat_id, range), 1, 0)
            .map_err(|e| op_err(map_names::SOURCE_RANGES, "insert", cap, e))
    }
    fn delete_source_range(
        &mut self,
        rev_nat_id: u16,
        range: SourceRange,
    ) -> Result<(), DataplaneError> {
        let cap = capacity::SOURCE_RANGES;
        ignore_missing(
            self.source_ranges
                .remove(&source_range_key(rev_nat_id, range)),
        )
        .map_err(|e| op_err(map_names::SOURCE_RANGES, "delete", cap, e))
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
        for k in self.source_ranges.keys() {
            let k = k.map_err(d(map_names::SOURCE_RANGES))?;
            let data = k.data();
            let len = k.prefix_len().saturating_sub(SOURCE_RANGE_ID_BITS) as u8;
            let o = data.addr_be.to_ne_bytes();
            p.source_ranges
                .entry(u16::from_be(data.rev_nat_id_be))
                .or_default()
                .insert((std::net::Ipv4Addr::new(o[0], o[1], o[2], o[3]), len));
        }
        Ok(p)
    }
}

/// Traffic per frontend (reverse-NAT id → address, port, protocol, counters)
/// and per backend (id → address, port, protocol, counters).
#[derive(Clone, Debug, Default)]
pub struct ProgrammedTraffic {
    pub frontends: BTreeMap<u16, (std::net::Ipv4Addr, u16, u8, Traffic)>,
    pub backends: BTreeMap<u32, (std::net::Ipv4Addr, u16, u8, Traffic)>,
}

/// Read-only views of pinned maps, for `inspect` and tests.
pub struct PinnedMaps {
    pub dir: PathBuf,
}

impl PinnedMaps {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    fn open(&self, name: &'static str) -> Result<aya::maps::Map, BpfError> {
        let data = MapData::from_pin(self.dir.join(name)).map_err(map_err(name))?;
        Ok(match name {
            n if n == map_names::STATS => aya::maps::Map::PerCpuArray(data),
            n if n == map_names::CONNTRACK => aya::maps::Map::LruHashMap(data),
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
            let data = MapData::from_pin(self.dir.join(name)).map_err(map_err(name))?;
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
        let protos: BTreeMap<u16, u8> = p
            .services
            .iter()
            .filter(|(k, _)| k.slot == 0)
            .map(|(k, v)| (v.rev_nat_id, k.proto))
            .collect();
        for (id, rev) in &p.rev_nat {
            let proto = protos.get(id).copied().unwrap_or(0);
            out.frontends.insert(
                *id,
                (rev.addr(), rev.port(), proto, sum(&fe, u32::from(*id))),
            );
        }
        for (id, b) in &p.backends {
            out.backends
                .insert(*id, (b.addr(), b.port(), b.proto, sum(&be, *id)));
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

    pub fn programmed(&self) -> Result<Programmed, BpfError> {
        let services: HashMap<MapData, Svc4Key, Svc4Value> =
            HashMap::try_from(self.open(map_names::SERVICES)?)
                .map_err(map_err(map_names::SERVICES))?;
        let backends: HashMap<MapData, u32, Backend4> =
            HashMap::try_from(self.open(map_names::BACKENDS)?)
                .map_err(map_err(map_names::BACKENDS))?;
        let rev_nat: HashMap<MapData, u16, RevNat4> =
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
        Ok(p)
    }
}

/// A tcx link held by the agent: its fd and where it is pinned.
struct Held {
    name: String,
    kind: IfaceKind,
    fd: FdLink,
    pin: PathBuf,
}

/// Attaches the programs to interfaces, one tcx link per interface, pinned
/// under `<pin dir>/links/` so that the datapath keeps running while the agent
/// restarts: a restarted agent finds the pinned link of an interface and
/// atomically replaces its program (`bpf_link_update`); packets never see an
/// interface without a program. Also keeps the interfaces map (pod interfaces,
/// delivered to with `bpf_redirect_peer`) equal to the attached pod interfaces.
pub struct Attacher {
    ebpf: Ebpf,
    ifaces: HashMap<MapData, u32, Iface>,
    links: BTreeMap<(u32, IfaceKind), Held>,
    link_dir: PathBuf,
}

fn link_err(name: &'static str, e: impl std::fmt::Display) -> BpfError {
    BpfError::Link {
        name,
        reason: e.to_string(),
    }
}

impl Attacher {
    /// Takes the interfaces map out of `ebpf` and forgets its old entries
    /// (interfaces are learned again from netlink).
    pub fn new(mut ebpf: Ebpf, pin_dir: &Path) -> Result<Self, BpfError> {
        let mut ifaces: HashMap<MapData, u32, Iface> =
            HashMap::try_from(take_map(&mut ebpf, map_names::IFACES)?)
                .map_err(map_err(map_names::IFACES))?;
        let stale: Vec<u32> = ifaces.keys().filter_map(Result::ok).collect();
        for k in stale {
            let _ = ifaces.remove(&k);
        }
        let link_dir = pin_dir.join("links");
        std::fs::create_dir_all(&link_dir).map_err(|source| BpfError::PinDir {
            path: link_dir.clone(),
            source,
        })?;
        Ok(Self {
            ebpf,
            ifaces,
            links: BTreeMap::new(),
            link_dir,
        })
    }

    fn program(&mut self, kind: IfaceKind) -> &mut SchedClassifier {
        self.ebpf
            .program_mut(kind.program())
            .expect("program checked at load")
            .try_into()
            .expect("program type checked at load")
    }

    fn xdp(&mut self) -> &mut Xdp {
        self.ebpf
            .program_mut(EXT_XDP_PROGRAM)
            .expect("program checked at load")
            .try_into()
            .expect("program type checked at load")
    }

    pub fn is_attached(&self, ifindex: u32, kind: IfaceKind) -> bool {
        self.links.contains_key(&(ifindex, kind))
    }

    /// Takes over a pinned link with the current program (`bpf_link_update`).
    fn take_over(&mut self, fd: FdLink, kind: IfaceKind) -> Result<FdLink, BpfError> {
        let name = kind.program();
        let perr = |source| BpfError::Program { name, source };
        if kind == IfaceKind::ExternalXdp {
            let link = XdpLink::try_from(fd).map_err(|e| link_err(name, e))?;
            let xdp = self.xdp();
            let id = xdp.attach_to_link(link).map_err(perr)?;
            let link = xdp.take_link(id).map_err(perr)?;
            return FdLink::try_from(link).map_err(|e| link_err(name, e));
        }
        let link = SchedClassifierLink::try_from(fd).map_err(|e| link_err(name, e))?;
        let prog = self.program(kind);
        let id = prog.attach_to_link(link).map_err(perr)?;
        let link = prog.take_link(id).map_err(perr)?;
        FdLink::try_from(link).map_err(|e| link_err(name, e))
    }

    /// A new link of `kind` on interface `name`.
    fn attach_new(&mut self, name: &str, kind: IfaceKind) -> Result<FdLink, BpfError> {
        let prog_name = kind.program();
        let perr = |source| BpfError::Program {
            name: prog_name,
            source,
        };
        if kind == IfaceKind::ExternalXdp {
            let xdp = self.xdp();
            let id = xdp.attach(name, XdpMode::Default).map_err(perr)?;
            let link = xdp.take_link(id).map_err(perr)?;
            return FdLink::try_from(link).map_err(|e| link_err(prog_name, e));
        }
        let prog = self.program(kind);
        let id = prog.attach(name, TcAttachType::Ingress).map_err(perr)?;
        let link = prog.take_link(id).map_err(perr)?;
        FdLink::try_from(link).map_err(|e| link_err(prog_name, e))
    }

    fn pin_path(&self, ifindex: u32, name: &str, kind: IfaceKind) -> PathBuf {
        let k = match kind {
            IfaceKind::Pod => "pod",
            IfaceKind::External => "ext",
            IfaceKind::ExternalXdp => "xdp",
        };
        self.link_dir.join(format!("{ifindex}-{name}-{k}"))
    }

    /// Attaches the program of `kind` at tc ingress (tcx) of `name`, or takes
    /// over the link a previous agent pinned for it.
    pub fn attach(&mut self, ifindex: u32, name: &str, kind: IfaceKind) -> Result<(), BpfError> {
        let prog_name = kind.program();
        let pin = self.pin_path(ifindex, name, kind);
        let adopted = match PinnedLink::from_pin(&pin) {
            Ok(pinned) => match self.take_over(FdLink::from(pinned), kind) {
                Ok(fd) => Some(fd),
                Err(e) => {
                    // A defunct link (its interface was recreated): start afresh.
                    tracing::debug!(pin = %pin.display(), error = %e, "pinned link not reusable");
                    let _ = std::fs::remove_file(&pin);
                    None
                }
            },
            Err(_) => None,
        };
        let fd = match adopted {
            Some(fd) => fd,
            None => {
                let fd = self.attach_new(name, kind)?;
                FdLink::from(fd.pin(&pin).map_err(|e| link_err(prog_name, e))?)
            }
        };
        self.links.insert(
            (ifindex, kind),
            Held {
                name: name.to_owned(),
                kind,
                fd,
                pin,
            },
        );
        if kind == IfaceKind::Pod {
            self.ifaces
                .insert(
                    ifindex,
                    Iface {
                        flags: iface_flags::POD,
                    },
                    0,
                )
                .map_err(map_err(map_names::IFACES))?;
        }
        Ok(())
    }

    /// Detaches every link on `ifindex` (removing their pins) and forgets them.
    pub fn detach(&mut self, ifindex: u32) {
        let keys: Vec<(u32, IfaceKind)> = self
            .links
            .keys()
            .filter(|(i, _)| *i == ifindex)
            .copied()
            .collect();
        for k in keys {
            if let Some(held) = self.links.remove(&k) {
                let _ = std::fs::remove_file(&held.pin);
                drop(held.fd);
            }
        }
        let _ = self.ifaces.remove(&ifindex);
    }

    /// Whether any link is held on `ifindex`.
    pub fn has_links(&self, ifindex: u32) -> bool {
        self.links.keys().any(|(i, _)| *i == ifindex)
    }

    pub fn detach_all(&mut self) {
        let all: std::collections::BTreeSet<u32> = self.links.keys().map(|(i, _)| *i).collect();
        for i in all {
            self.detach(i);
        }
    }

    /// Lets go of every link but leaves it pinned: the programs stay attached
    /// after the agent exits, until a new agent takes them over.
    pub fn release_all(&mut self) {
        self.links.clear();
    }

    /// Removes pins of links this agent does not hold (interfaces that are
    /// gone, or no longer match the patterns).
    pub fn prune_pins(&mut self) {
        let held: std::collections::BTreeSet<PathBuf> =
            self.links.values().map(|h| h.pin.clone()).collect();
        if let Ok(dir) = std::fs::read_dir(&self.link_dir) {
            for e in dir.flatten() {
                if !held.contains(&e.path()) {
                    tracing::info!(pin = %e.path().display(), "removing a stale link pin");
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    pub fn attached(&self) -> impl Iterator<Item = (u32, &str, IfaceKind)> {
        self.links
            .iter()
            .map(|((i, _), h)| (*i, h.name.as_str(), h.kind))
    }
}

/// Removes a datapath left attached by an agent that exited with
/// `--on-exit keep`: every pinned link (detaching the programs) and every
/// pinned map under `pin_dir`. Returns how many pins were removed.
pub fn cleanup(pin_dir: &Path) -> Result<usize, BpfError> {
    if !pin_dir.exists() {
        return Ok(0);
    }
    let mut n = 0;
    let links = pin_dir.join("links");
    if let Ok(dir) = std::fs::read_dir(&links) {
        n += dir.flatten().count();
    }
    if let Ok(dir) = std::fs::read_dir(pin_dir) {
        n += dir.flatten().filter(|e| e.path() != links).count();
    }
    std::fs::remove_dir_all(pin_dir).map_err(|source| BpfError::PinDir {
        path: pin_dir.into(),
        source,
    })?;
    Ok(n)
}

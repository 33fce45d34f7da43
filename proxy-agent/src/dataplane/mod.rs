//! The dataplane seen from the agent: a small set of map operations
//! ([`Dataplane`]), implemented over the BPF maps (`crate::bpf::BpfDataplane`)
//! and in memory ([`InMemory`], for tests), and the [`Writer`] that diffs the
//! desired state against what is programmed and writes in make-before-break
//! order.
//!
//! | file | what |
//! | --- | --- |
//! | `mod.rs` | the [`Dataplane`] operations, [`Programmed`], [`DataplaneError`] |
//! | `writer.rs` | the [`Writer`]: its mirror of the maps and reference counts, adoption, [`Writer::sync`] as a list of phases, [`Writer::sync_changed`] over [`Changes`] |
//! | `writer/update.rs` | the phases that make desired frontends (backends, reverse NAT, slots, slot 0, ...) |
//! | `writer/prune.rs` | the phases that break what nothing wants any more |
//! | `writer/users.rs` | the desired frontends by backend address, for [`Writer::sync_changed`] |
//! | `ids.rs` | backend and reverse-NAT id allocation |
//! | `in_memory.rs` | [`InMemory`], the dataplane of the tests, with its invariant check |
use std::collections::{BTreeMap, BTreeSet};

use std::net::IpAddr;

use proxy_common::{
    lb::{MaglevChunk, MaglevKey},
    Backend4, Backend6, RevNat4, RevNat6, RevNatId, Svc4Key, Svc6Key, SvcValue,
};

use crate::model::{BackendAddr, FrontendKey};

mod ids;
mod in_memory;
mod writer;

pub use in_memory::{InMemory, Op};

pub use writer::{Changes, MaglevSettings, SyncReport, Writer};

/// A failed map operation.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// The map has no room for a new entry.
    #[error("map {map} is full ({capacity} entries)")]
    Full { map: &'static str, capacity: u32 },
    /// A frontend asked for a Maglev table beyond the configured cap.
    #[error("no Maglev table for this frontend: {cap} tables programmed, the most loadBalancing.maglev.maxTables allows; the frontend keeps its previous state")]
    MaglevCap { cap: usize },
    /// Any other failure of the map operation.
    #[error("map {map}: {op} failed: {reason}")]
    Op {
        map: &'static str,
        op: &'static str,
        reason: String,
    },
}

/// Everything the maps hold that the writer manages (conntrack excluded).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Programmed {
    pub services: BTreeMap<Svc4Key, SvcValue>,
    pub backends: BTreeMap<u32, Backend4>,
    pub rev_nat: BTreeMap<RevNatId, RevNat4>,
    /// `loadBalancerSourceRanges`: reverse-NAT id → allowed client prefixes.
    pub source_ranges: BTreeMap<RevNatId, BTreeSet<SourceRange>>,
    /// Maglev tables, chunk by chunk.
    pub maglev: BTreeMap<MaglevKey, MaglevChunk>,
    /// IPv6 frontends and their slots (`SVC6_V2`).
    pub services6: BTreeMap<Svc6Key, SvcValue>,
    /// IPv6 backends (`BACKEND6_V1`; ids shared with `backends`).
    pub backends6: BTreeMap<u32, Backend6>,
    /// IPv6 reverse NAT (`REVNAT6_V2`; ids shared with `rev_nat`).
    pub rev_nat6: BTreeMap<RevNatId, RevNat6>,
}

/// A backend entry, in the map of its address's family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendEntry {
    V4(Backend4),
    V6(Backend6),
}

impl BackendEntry {
    /// The entry of backend `addr` in state `state` ([`proxy_common::backend_state`]).
    pub fn new(addr: &BackendAddr, state: u8) -> Self {
        match addr.addr {
            IpAddr::V4(a) => Self::V4(Backend4::new(a, addr.port, addr.proto, state)),
            IpAddr::V6(a) => Self::V6(Backend6::new(a, addr.port, addr.proto, state)),
        }
    }
    pub fn family(&self) -> Family {
        match self {
            Self::V4(_) => Family::V4,
            Self::V6(_) => Family::V6,
        }
    }
    /// The backend this entry is.
    pub fn addr(&self) -> BackendAddr {
        match self {
            Self::V4(b) => BackendAddr {
                addr: IpAddr::V4(b.addr()),
                port: b.port(),
                proto: b.proto,
            },
            Self::V6(b) => BackendAddr {
                addr: IpAddr::V6(b.addr()),
                port: b.port(),
                proto: b.proto,
            },
        }
    }
}

/// A reverse-NAT entry, in the map of its frontend's family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RevNatEntry {
    V4(RevNat4),
    V6(RevNat6),
}

impl RevNatEntry {
    /// The entry of frontend `key`: its address and port.
    pub fn of(key: &FrontendKey) -> Self {
        match key.addr {
            IpAddr::V4(a) => Self::V4(RevNat4::new(a, key.port)),
            IpAddr::V6(a) => Self::V6(RevNat6::new(a, key.port)),
        }
    }
    pub fn family(&self) -> Family {
        match self {
            Self::V4(_) => Family::V4,
            Self::V6(_) => Family::V6,
        }
    }
}

/// What a batch write or delete did: how many entries it took (the first
/// ones), and the error of the entry it stopped at, if it stopped.
pub type BatchOutcome = (usize, Option<DataplaneError>);

/// The most entries the writer hands one batch call (the BPF dataplane's
/// batch: one syscall).
pub const BATCH_MAX: usize = 4_096;

/// The sizes of the batch calls the writer makes for a phase's entries:
/// from 64 doubling to [`BATCH_MAX`], back to 64 after a call that stops
/// at a failure. A call costs the writer its entries' preparation, whether
/// the dataplane takes them or stops at the first; where every entry fails
/// (a full map), each failure costs 64 entries' preparation, not that of
/// all the entries left.
#[derive(Clone, Copy)]
pub struct BatchSizes(usize);

impl Default for BatchSizes {
    fn default() -> Self {
        Self(64)
    }
}

impl BatchSizes {
    /// The size of the next call (and the one after it doubles).
    pub fn take(&mut self) -> usize {
        let n = self.0;
        self.0 = (n * 2).min(BATCH_MAX);
        n
    }
    /// After a call that stopped at a failure.
    pub fn failed(&mut self) {
        *self = Self::default();
    }
}

/// `entries` taken one at a time with `op` (a put or a delete), stopping at
/// the first error.
pub fn each<T>(
    entries: &[T],
    mut op: impl FnMut(&T) -> Result<(), DataplaneError>,
) -> BatchOutcome {
    for (i, e) in entries.iter().enumerate() {
        if let Err(err) = op(e) {
            return (i, Some(err));
        }
    }
    (entries.len(), None)
}

/// An allowed client prefix (network address, prefix length).
pub type SourceRange = (IpAddr, u8);

/// The address family of a map entry: each kind of entry has one map per
/// family (`SVC4_V2`/`SVC6_V2`, ...); backend and reverse-NAT ids are one
/// space for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(addr: &IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }
}

/// A frontend slot's key with its family, as Cilium's `ServiceKey`: the
/// services map of that family holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceKey {
    V4(Svc4Key),
    V6(Svc6Key),
}

/// Each family's entries into the family-keyed ones.
macro_rules! from_family {
    ($($t:ty => $e:ident :: $v:ident),* $(,)?) => {
        $(impl From<$t> for $e {
            fn from(x: $t) -> Self {
                $e::$v(x)
            }
        })*
    };
}
from_family!(
    Svc4Key => ServiceKey::V4,
    Svc6Key => ServiceKey::V6,
    Backend4 => BackendEntry::V4,
    Backend6 => BackendEntry::V6,
    RevNat4 => RevNatEntry::V4,
    RevNat6 => RevNatEntry::V6,
);

impl ServiceKey {
    /// Slot `slot` of frontend `key`.
    pub fn new(key: &FrontendKey, slot: u16) -> Self {
        match key.addr {
            IpAddr::V4(a) => Self::V4(Svc4Key::new(a, key.port, key.proto, key.scope, slot)),
            IpAddr::V6(a) => Self::V6(Svc6Key::new(a, key.port, key.proto, key.scope, slot)),
        }
    }
    pub fn family(&self) -> Family {
        match self {
            Self::V4(_) => Family::V4,
            Self::V6(_) => Family::V6,
        }
    }
}

/// Map operations, one per kind of entry, the family in the key or the
/// entry. Keys and values are the shared kernel types; ids are host order.
///
/// The writes and deletes of services, backends and reverse NAT take many
/// entries: in order, as single operations one after the other would,
/// stopping at the first that fails. They return how many were done (the
/// first ones) and that one's error; it and those after it are not done.
/// The BPF dataplane writes each run of one family's entries in batches
/// where the kernel can (`BPF_MAP_UPDATE_BATCH`, `BPF_MAP_DELETE_BATCH`):
/// one syscall for thousands of entries, each landing after the one before
/// it. For entries no earlier one depends on: a writer phase's. Deleting an
/// absent key succeeds (it is deleted already).
pub trait Dataplane {
    fn put_services(&mut self, entries: &[(ServiceKey, SvcValue)]) -> BatchOutcome;
    fn delete_services(&mut self, keys: &[ServiceKey]) -> BatchOutcome;
    fn put_backends(&mut self, entries: &[(u32, BackendEntry)]) -> BatchOutcome;
    /// Backend ids, each deleted from its family's map.
    fn delete_backends(&mut self, ids: &[(Family, u32)]) -> BatchOutcome;
    fn put_rev_nats(&mut self, entries: &[(RevNatId, RevNatEntry)]) -> BatchOutcome;
    /// Reverse-NAT ids, each deleted from its family's map.
    fn delete_rev_nats(&mut self, ids: &[(Family, RevNatId)]) -> BatchOutcome;
    /// Allows clients in `range` to open flows to the frontend `rev_nat_id`
    /// (meaningful when its slot 0 has `svc_flags::SOURCE_RANGES`); the
    /// family is the range's.
    fn put_source_range(
        &mut self,
        rev_nat_id: RevNatId,
        range: SourceRange,
    ) -> Result<(), DataplaneError>;
    fn delete_source_range(
        &mut self,
        rev_nat_id: RevNatId,
        range: SourceRange,
    ) -> Result<(), DataplaneError>;
    /// Writes one chunk of a Maglev table generation (both families').
    fn put_maglev_chunk(
        &mut self,
        key: MaglevKey,
        chunk: &MaglevChunk,
    ) -> Result<(), DataplaneError>;
    fn delete_maglev_chunk(&mut self, key: MaglevKey) -> Result<(), DataplaneError>;
    /// Deletes, in one walk of the affinity maps, the session-affinity
    /// entries of every frontend `keep` names (by reverse-NAT id) whose
    /// backend is not in its set (all of them when the set is empty): a
    /// client's affinity ends when its backend leaves the frontend or
    /// affinity is switched off. Returns how many were deleted.
    fn prune_affinity(
        &mut self,
        keep: &BTreeMap<RevNatId, BTreeSet<u32>>,
    ) -> Result<usize, DataplaneError> {
        let _ = keep;
        Ok(0)
    }
    /// The sizes of the maps the datapath indexes by id (the per-backend and
    /// per-frontend arrays have as many entries): backend ids stay below
    /// `.0` (the backends map's size), reverse-NAT ids below `.1` (the
    /// reverse-NAT map's).
    fn id_spaces(&self) -> (u32, u32) {
        (
            proxy_common::capacity::BACKENDS,
            proxy_common::capacity::REV_NAT,
        )
    }
    /// The reverse-NAT ids the affinity maps hold entries of (read once, on
    /// adoption: a frontend whose id has none needs no prune).
    fn affinity_ids(&self) -> Result<BTreeSet<RevNatId>, DataplaneError> {
        Ok(BTreeSet::new())
    }
    /// Reads back everything programmed (used to adopt pinned maps on start).
    fn dump(&self) -> Result<Programmed, DataplaneError>;
}

/// The outcome of one operation as a `Result`.
pub fn one(outcome: BatchOutcome) -> Result<(), DataplaneError> {
    match outcome {
        (_, Some(e)) => Err(e),
        (_, None) => Ok(()),
    }
}

/// One family's entry (or run of entries) of an operation.
pub enum ByFamily<A, B> {
    V4(A),
    V6(B),
}

/// `entries` in runs of one family, in order: `entry` gives each one's key
/// or entry in its family's map; `run` takes each run and returns what it
/// did; stops at the first run that stops.
pub fn family_runs<T, A, B>(
    entries: &[T],
    entry: impl Fn(&T) -> ByFamily<A, B>,
    mut run: impl FnMut(ByFamily<&[A], &[B]>) -> BatchOutcome,
) -> BatchOutcome {
    let mut done = 0;
    while done < entries.len() {
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        for e in &entries[done..] {
            match entry(e) {
                ByFamily::V4(a) if v6.is_empty() => v4.push(a),
                ByFamily::V6(b) if v4.is_empty() => v6.push(b),
                _ => break,
            }
        }
        let len = v4.len() + v6.len();
        let (n, err) = if v4.is_empty() {
            run(ByFamily::V6(&v6))
        } else {
            run(ByFamily::V4(&v4))
        };
        done += n.min(len);
        if err.is_some() {
            return (done, err);
        }
    }
    (done, None)
}

/// A dataplane that takes every operation and keeps nothing, only their
/// count: the control plane's own cost, measured without the maps' (the
/// `control_plane_cost` example, the memory test). Room for 2^24 frontends
/// and backends, as a node configured with `mapSizes` for them.
#[derive(Debug, Default)]
pub struct Discard {
    /// Operations taken.
    pub ops: usize,
}

impl Dataplane for Discard {
    fn id_spaces(&self) -> (u32, u32) {
        (1 << 24, 1 << 24)
    }
    fn put_services(&mut self, entries: &[(ServiceKey, SvcValue)]) -> BatchOutcome {
        self.ops += entries.len();
        (entries.len(), None)
    }
    fn delete_services(&mut self, keys: &[ServiceKey]) -> BatchOutcome {
        self.ops += keys.len();
        (keys.len(), None)
    }
    fn put_backends(&mut self, entries: &[(u32, BackendEntry)]) -> BatchOutcome {
        self.ops += entries.len();
        (entries.len(), None)
    }
    fn delete_backends(&mut self, ids: &[(Family, u32)]) -> BatchOutcome {
        self.ops += ids.len();
        (ids.len(), None)
    }
    fn put_rev_nats(&mut self, entries: &[(RevNatId, RevNatEntry)]) -> BatchOutcome {
        self.ops += entries.len();
        (entries.len(), None)
    }
    fn delete_rev_nats(&mut self, ids: &[(Family, RevNatId)]) -> BatchOutcome {
        self.ops += ids.len();
        (ids.len(), None)
    }
    fn put_source_range(&mut self, _: RevNatId, _: SourceRange) -> Result<(), DataplaneError> {
        self.ops += 1;
        Ok(())
    }
    fn delete_source_range(&mut self, _: RevNatId, _: SourceRange) -> Result<(), DataplaneError> {
        self.ops += 1;
        Ok(())
    }
    fn put_maglev_chunk(&mut self, _: MaglevKey, _: &MaglevChunk) -> Result<(), DataplaneError> {
        self.ops += 1;
        Ok(())
    }
    fn delete_maglev_chunk(&mut self, _: MaglevKey) -> Result<(), DataplaneError> {
        self.ops += 1;
        Ok(())
    }
    fn dump(&self) -> Result<Programmed, DataplaneError> {
        Ok(Programmed::default())
    }
}

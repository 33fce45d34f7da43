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

use proxy_common::{
    lb::{MaglevChunk, MaglevKey},
    Backend4, RevNat4, Svc4Key, Svc4Value,
};

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
    pub services: BTreeMap<Svc4Key, Svc4Value>,
    pub backends: BTreeMap<u32, Backend4>,
    pub rev_nat: BTreeMap<u16, RevNat4>,
    /// `loadBalancerSourceRanges`: reverse-NAT id → allowed client prefixes.
    pub source_ranges: BTreeMap<u16, BTreeSet<SourceRange>>,
    /// Maglev tables, chunk by chunk.
    pub maglev: BTreeMap<MaglevKey, MaglevChunk>,
}

/// An allowed client prefix (network address, prefix length).
pub type SourceRange = (std::net::Ipv4Addr, u8);

/// Map operations. Keys and values are the shared kernel types; ids are host
/// order. Each operation either takes effect whole or fails.
pub trait Dataplane {
    fn put_backend(&mut self, id: u32, backend: Backend4) -> Result<(), DataplaneError>;
    fn delete_backend(&mut self, id: u32) -> Result<(), DataplaneError>;
    fn put_service(&mut self, key: Svc4Key, value: Svc4Value) -> Result<(), DataplaneError>;
    fn delete_service(&mut self, key: Svc4Key) -> Result<(), DataplaneError>;
    fn put_rev_nat(&mut self, id: u16, value: RevNat4) -> Result<(), DataplaneError>;
    fn delete_rev_nat(&mut self, id: u16) -> Result<(), DataplaneError>;
    /// Deletes the session-affinity entries of frontend `rev_nat_id` whose
    /// backend is not in `keep` (all of them when `keep` is empty): a client's
    /// affinity ends when its backend leaves the frontend or affinity is
    /// switched off. Returns how many were deleted.
    fn prune_affinity(
        &mut self,
        rev_nat_id: u16,
        keep: &BTreeSet<u32>,
    ) -> Result<usize, DataplaneError> {
        let _ = (rev_nat_id, keep);
        Ok(0)
    }
    /// Allows clients in `range` to open flows to the frontend `rev_nat_id`
    /// (meaningful when its slot 0 has `svc_flags::SOURCE_RANGES`).
    fn put_source_range(
        &mut self,
        rev_nat_id: u16,
        range: SourceRange,
    ) -> Result<(), DataplaneError>;
    fn delete_source_range(
        &mut self,
        rev_nat_id: u16,
        range: SourceRange,
    ) -> Result<(), DataplaneError>;
    /// Writes one chunk of a Maglev table generation.
    fn put_maglev_chunk(
        &mut self,
        key: MaglevKey,
        chunk: &MaglevChunk,
    ) -> Result<(), DataplaneError>;
    fn delete_maglev_chunk(&mut self, key: MaglevKey) -> Result<(), DataplaneError>;
    /// Reads back everything programmed (used to adopt pinned maps on start).
    fn dump(&self) -> Result<Programmed, DataplaneError>;
}

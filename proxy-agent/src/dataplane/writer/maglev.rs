//! The Maglev phases of [`Writer::sync`]: a frontend's table is written whole
//! into the generation its slot 0 does not read, then slot 0 switches to it
//! (`update_slot0`), then the old generation is deleted. A packet reads
//! either the old table or the new one, never a half-written one.
use std::collections::{BTreeMap, BTreeSet};

use proxy_common::{
    capacity,
    lb::{alg, maglev_chunks, MaglevChunk, MaglevKey, MAGLEV_CHUNK, MAGLEV_DEFAULT_SIZE},
    svc_flags, RevNatId, SvcValue,
};

use super::{Dataplane, DataplaneError, FrontendEntries, FrontendKey, SyncState, Writer};
use crate::model::{maglev_table, BackendAddr, DesiredState, LbAlgorithm};

/// `loadBalancing.maglev`: the size of every table (a prime) and how many
/// tables may be programmed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevSettings {
    pub table_size: u16,
    pub max_tables: usize,
}

impl Default for MaglevSettings {
    fn default() -> Self {
        Self {
            table_size: MAGLEV_DEFAULT_SIZE,
            max_tables: capacity::MAGLEV_TABLES as usize,
        }
    }
}

/// One frontend's table as programmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct MaglevTable {
    pub(super) generation: u8,
    pub(super) size: u16,
    /// The backends it was built from (`None` when adopted from pinned maps:
    /// compared by content then).
    pub(super) backends: Option<Vec<BackendAddr>>,
    /// Backend id of every entry.
    pub(super) table: Vec<u32>,
}

/// The tables adopted from pinned maps: for every Maglev slot 0, the
/// generation it reads, if whole.
pub(super) fn adopt_tables(
    frontends: &BTreeMap<FrontendKey, FrontendEntries>,
    chunks: &BTreeMap<MaglevKey, MaglevChunk>,
) -> BTreeMap<RevNatId, MaglevTable> {
    let mut tables = BTreeMap::new();
    for v in frontends.values().filter_map(|e| e.slot0) {
        if !reads_maglev(&v) {
            continue;
        }
        let generation = generation_of(&v);
        let mut table = Vec::with_capacity(v.maglev_size as usize);
        for chunk in 0..maglev_chunks(v.maglev_size) {
            match chunks.get(&MaglevKey::new(v.rev_nat_id, generation, chunk as u16)) {
                Some(c) => table.extend_from_slice(&c.backend_ids),
                None => break,
            }
        }
        if table.len() < v.maglev_size as usize {
            continue;
        }
        table.truncate(v.maglev_size as usize);
        tables.insert(
            v.rev_nat_id,
            MaglevTable {
                generation,
                size: v.maglev_size,
                backends: None,
                table,
            },
        );
    }
    tables
}

/// Whether packets to slot 0 `v` read a Maglev table.
fn reads_maglev(v: &SvcValue) -> bool {
    svc_flags::algorithm(v.flags) == alg::MAGLEV && v.count > 0 && v.maglev_size > 0
}

fn generation_of(v: &SvcValue) -> u8 {
    u8::from(v.flags & svc_flags::MAGLEV_GEN != 0)
}

impl<D: Dataplane> Writer<D> {
    /// Writes a new table for every Maglev target whose backends changed (or
    /// that has none yet), whole, into the generation its slot 0 does not
    /// read. Invariant: slot 0 switches to a generation only once all of its
    /// chunks are written (a frontend whose chunk fails is failed, so its
    /// slot 0 stays as it was); each entry names a backend already written. A
    /// frontend that would exceed `maxTables` is refused (failed), never
    /// silently given another algorithm.
    pub(super) fn update_maglev(&mut self, desired: &DesiredState, s: &mut SyncState) {
        let size = self.maglev.table_size;
        for key in &s.order {
            let Some(target) = s.targets.get(key) else {
                continue;
            };
            let fe = &desired.frontends[key];
            if s.out.is_failed(key)
                || LbAlgorithm::of_flags(fe.flags) != LbAlgorithm::Maglev
                || target.count == 0
            {
                continue;
            }
            let rev = self.rev_nat_ids.as_map()[key];
            let current = self.maglev_tables.get(&rev);
            if current.is_some_and(|c| c.size == size && c.backends.as_ref() == Some(&fe.backends))
            {
                continue;
            }
            let table: Vec<u32> = maglev_table(&fe.backends, size)
                .into_iter()
                .map(|i| target.ids[i as usize])
                .collect();
            if let Some(c) = self.maglev_tables.get_mut(&rev) {
                if c.size == size && c.table == table {
                    // Adopted and still right.
                    c.backends = Some(fe.backends.clone());
                    continue;
                }
            }
            let current = self.maglev_tables.get(&rev);
            if current.is_none()
                && self.maglev_tables.len() + s.maglev_pending.len() >= self.maglev.max_tables
            {
                let e = DataplaneError::MaglevCap {
                    cap: self.maglev.max_tables,
                };
                s.out.report.maglev_refused += 1;
                s.out.fail(*key, Some(fe), e);
                continue;
            }
            let generation = current.map_or(0, |c| 1 - c.generation);
            let mut ok = true;
            for (i, entries) in table.chunks(MAGLEV_CHUNK).enumerate() {
                let mkey = MaglevKey::new(rev, generation, i as u16);
                let mut chunk = MaglevChunk::default();
                chunk.backend_ids[..entries.len()].copy_from_slice(entries);
                match self.dp.put_maglev_chunk(mkey, &chunk) {
                    Ok(()) => {
                        s.out.wrote();
                        self.maglev_keys.insert(mkey);
                        self.loose.rev_nat.insert(rev);
                    }
                    Err(e) => {
                        // The half-written generation is deleted by
                        // `delete_unused_maglev`: no slot 0 reads it.
                        s.out.fail(*key, Some(fe), e);
                        ok = false;
                        break;
                    }
                }
            }
            if ok {
                s.maglev_pending.insert(
                    *key,
                    MaglevTable {
                        generation,
                        size,
                        backends: Some(fe.backends.clone()),
                        table,
                    },
                );
            }
        }
    }

    /// What slot 0 `value` of Maglev frontend `key` becomes: the generation
    /// and size of its pending table, else of its programmed one. `None`
    /// when neither exists (the frontend has failed).
    pub(super) fn with_maglev_table(
        &self,
        key: &FrontendKey,
        value: SvcValue,
        s: &SyncState,
    ) -> Option<SvcValue> {
        if svc_flags::algorithm(value.flags) != alg::MAGLEV || value.count == 0 {
            return Some(value);
        }
        let t = s
            .maglev_pending
            .get(key)
            .or_else(|| self.maglev_tables.get(&value.rev_nat_id))?;
        let mut v = value.with_maglev_size(t.size);
        if t.generation == 1 {
            v.flags |= svc_flags::MAGLEV_GEN;
        }
        Some(v)
    }

    /// Slot 0 of `key` now reads its pending table, if it has one.
    pub(super) fn commit_maglev(
        &mut self,
        key: &FrontendKey,
        rev: RevNatId,
        pending: &mut BTreeMap<FrontendKey, MaglevTable>,
    ) {
        if let Some(t) = pending.remove(key) {
            self.maglev_tables.insert(rev, t);
        }
    }

    /// Deletes every Maglev chunk no slot 0 reads: old generations of
    /// rebuilt tables, tables of removed frontends or of frontends that left
    /// Maglev, chunks of failed rebuilds and leftovers of an earlier agent
    /// (in a full sync: every chunk is looked at; else those of loose
    /// reverse-NAT ids, which every slot 0 written or deleted, and every
    /// chunk written, makes loose).
    /// Invariant: runs after every slot 0 is written or deleted, so a chunk is
    /// deleted only once no slot 0 names its generation.
    pub(super) fn delete_unused_maglev(&mut self, s: &mut SyncState) {
        let revs: BTreeSet<RevNatId> = if s.full {
            self.maglev_keys
                .iter()
                .map(|k| k.rev_nat_id)
                .chain(self.maglev_tables.keys().copied())
                .collect()
        } else {
            self.loose.rev_nat.clone()
        };
        // (reverse-NAT id, generation) → chunks, of every slot 0 reading a
        // table of `revs`.
        let live: BTreeMap<(RevNatId, u8), u32> = revs
            .iter()
            .filter_map(|rev| self.slot0_by_rev.get(rev))
            .flatten()
            .filter_map(|k| self.frontends.get(k).and_then(|e| e.slot0))
            .filter(reads_maglev)
            .map(|v| {
                (
                    (v.rev_nat_id, generation_of(&v)),
                    maglev_chunks(v.maglev_size),
                )
            })
            .collect();
        let unused: Vec<MaglevKey> = revs
            .iter()
            .flat_map(|rev| {
                self.maglev_keys
                    .range(MaglevKey::new(*rev, 0, 0)..=MaglevKey::new(*rev, u8::MAX, u16::MAX))
            })
            .filter(|k| {
                live.get(&(k.rev_nat_id, k.generation))
                    .is_none_or(|chunks| u32::from(k.chunk) >= *chunks)
            })
            .copied()
            .collect();
        for key in unused {
            match self.dp.delete_maglev_chunk(key) {
                Ok(()) => {
                    s.out.wrote();
                    self.maglev_keys.remove(&key);
                }
                Err(e) => {
                    s.out.retry.rev_nat.insert(key.rev_nat_id);
                    s.out.error(format!("Maglev chunk {key:?}"), e);
                }
            }
        }
        let live_revs: BTreeSet<RevNatId> = live.keys().map(|(rev, _)| *rev).collect();
        for rev in &revs {
            if !live_revs.contains(rev) {
                self.maglev_tables.remove(rev);
            }
        }
        s.maglev_pending.clear();
    }

    /// Maglev tables programmed and the bytes their entries take (size × 4
    /// each; chunks round up to 256 entries).
    pub fn maglev_usage(&self) -> (usize, u64) {
        let bytes = self
            .maglev_tables
            .values()
            .map(|t| u64::from(t.size) * 4)
            .sum();
        (self.maglev_tables.len(), bytes)
    }
}

//! The phases of [`Writer::sync`] that break what no desired frontend wants
//! any more, in the order `sync` runs them, after every desired frontend is
//! made: removed frontends, then the reverse-NAT entries, source ranges and
//! backends that nothing names.
use std::collections::{BTreeMap, BTreeSet};

use super::{frontend_label, svc_key, Dataplane, FrontendKey, SourceRange, SyncState, Writer};
use crate::model::DesiredState;

impl<D: Dataplane> Writer<D> {
    /// Deletes every programmed frontend that is not desired: its slot 0,
    /// then its slots, then its reverse-NAT entry. Invariant: a frontend
    /// disappears whole before its parts do (no packet reads a slot once slot
    /// 0 is gone), and a reverse-NAT entry is deleted only once no slot 0
    /// names it and all the frontend's slots are gone. A frontend whose slot
    /// 0 cannot be deleted is kept whole.
    pub(super) fn remove_frontends(&mut self, desired: &DesiredState, s: &mut SyncState) {
        let removed: Vec<FrontendKey> = self
            .frontends
            .keys()
            .filter(|k| !desired.frontends.contains_key(k))
            .copied()
            .collect();
        s.slot0_refs = self.slot0_refs();
        for key in removed {
            let entries = self.frontends[&key].clone();
            if let Some(v) = entries.slot0 {
                if let Err(e) = self.dp.delete_service(svc_key(&key, 0)) {
                    s.out.error(frontend_label(&key, None), e);
                    continue;
                }
                s.out.wrote();
                s.out.report.frontends_removed += 1;
                if let Some(e) = self.frontends.get_mut(&key) {
                    e.slot0 = None;
                }
                s.slot0_refs.entry(v.rev_nat_id).and_modify(|n| *n -= 1);
            }
            let mut clean = true;
            for slot in entries.slots.keys() {
                match self.dp.delete_service(svc_key(&key, *slot)) {
                    Ok(()) => {
                        s.out.wrote();
                        if let Some(e) = self.frontends.get_mut(&key) {
                            e.slots.remove(slot);
                        }
                    }
                    Err(e) => {
                        s.out.error(frontend_label(&key, None), e);
                        clean = false;
                    }
                }
            }
            if let Some(id) = self.rev_nat_ids.get(&key) {
                if clean && s.slot0_refs.get(&id).copied().unwrap_or(0) == 0 {
                    match self.dp.delete_rev_nat(id) {
                        Ok(()) => {
                            s.out.wrote();
                            self.rev_nat.remove(&id);
                            self.rev_nat_ids.release(&key);
                        }
                        Err(e) => s.out.error(frontend_label(&key, None), e),
                    }
                }
            }
            self.forget_if_empty(&key);
        }
    }

    /// Reverse-NAT id → how many programmed slot 0 entries name it.
    fn slot0_refs(&self) -> BTreeMap<u16, usize> {
        let mut refs: BTreeMap<u16, usize> = BTreeMap::new();
        for e in self.frontends.values() {
            if let Some(v) = e.slot0 {
                *refs.entry(v.rev_nat_id).or_default() += 1;
            }
        }
        refs
    }

    /// Deletes reverse-NAT entries nobody owns or uses (leftovers of a
    /// previous agent). Invariant: an entry a slot 0 still names is kept,
    /// owned or not (replies of its flows are translated back with it).
    pub(super) fn delete_stale_rev_nat(&mut self, s: &mut SyncState) {
        let stale: Vec<u16> = self
            .rev_nat
            .keys()
            .copied()
            .filter(|id| {
                self.rev_nat_ids.owner(*id).is_none()
                    && s.slot0_refs.get(id).copied().unwrap_or(0) == 0
            })
            .collect();
        for id in stale {
            match self.dp.delete_rev_nat(id) {
                Ok(()) => {
                    s.out.wrote();
                    self.rev_nat.remove(&id);
                }
                Err(e) => s.out.error(format!("reverse NAT {id}"), e),
            }
        }
    }

    /// Deletes the source ranges of reverse-NAT ids no desired frontend owns.
    /// Invariant: the ranges of a desired frontend are left to the make
    /// phases (a range it gains is written before its slot 0, one it loses is
    /// deleted after); only those of frontends already removed, or of ids
    /// nobody owns, go here.
    pub(super) fn delete_stale_source_ranges(&mut self, desired: &DesiredState, s: &mut SyncState) {
        let stale: Vec<(u16, SourceRange)> = self
            .source_ranges
            .iter()
            .filter(|(id, _)| {
                self.rev_nat_ids
                    .owner(**id)
                    .is_none_or(|k| !desired.frontends.contains_key(k))
            })
            .flat_map(|(id, set)| set.iter().map(move |r| (*id, *r)))
            .collect();
        for (id, range) in stale {
            match self.dp.delete_source_range(id, range) {
                Ok(()) => {
                    s.out.wrote();
                    if let Some(set) = self.source_ranges.get_mut(&id) {
                        set.remove(&range);
                    }
                }
                Err(e) => s.out.error(format!("source range of reverse NAT {id}"), e),
            }
        }
        self.source_ranges.retain(|_, set| !set.is_empty());
    }

    /// Deletes the backends no slot names and no desired frontend retains,
    /// and forgets their ids. Invariant: a backend is deleted only once no
    /// programmed slot names it, live or not (the slots that named it were
    /// deleted by the phases before), and a retained (terminating) backend
    /// stays while flows may use it.
    pub(super) fn delete_unused_backends(&mut self, desired: &DesiredState, s: &mut SyncState) {
        let mut referenced: BTreeSet<u32> = self.slot_backend_ids();
        referenced.extend(
            desired
                .frontends
                .values()
                .flat_map(|fe| fe.retained.iter())
                .filter_map(|b| self.backend_ids.get(b)),
        );
        let unused: Vec<u32> = self
            .backends
            .keys()
            .copied()
            .filter(|id| !referenced.contains(id))
            .collect();
        for id in unused {
            match self.dp.delete_backend(id) {
                Ok(()) => {
                    s.out.wrote();
                    s.out.report.backends_removed += 1;
                    if let Some(b) = self.backends.remove(&id) {
                        self.backend_ids.release(&b, id);
                    }
                }
                Err(e) => s.out.error(format!("backend id {id}"), e),
            }
        }
    }
}

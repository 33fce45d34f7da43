//! The phases of [`Writer::sync`] that break what no desired frontend wants
//! any more, in the order `sync` runs them, after every desired frontend is
//! made: removed frontends, then the reverse-NAT entries, source ranges and
//! backends that nothing names. In a full sync they look at every entry; in
//! [`Writer::sync_changed`] at the frontends in scope and the ids that may
//! have lost their last reference ([`super::Loose`]) only: an entry is
//! deleted in both cases exactly when nothing names it any more.
use super::{family, Dataplane, FrontendKey, SourceRange, SyncState, Writer};
use crate::dataplane::ids::backend_addr;
use crate::model::DesiredState;

impl<D: Dataplane> Writer<D> {
    /// Deletes every programmed frontend in scope that is not desired: its
    /// slot 0, then its slots, then its reverse-NAT entry. Invariant: a
    /// frontend disappears whole before its parts do (no packet reads a slot
    /// once slot 0 is gone), and a reverse-NAT entry is deleted only once no
    /// slot 0 names it and all the frontend's slots are gone. A frontend
    /// whose slot 0 cannot be deleted is kept whole, and looked at again by
    /// the next sync.
    pub(super) fn remove_frontends(&mut self, desired: &DesiredState, s: &mut SyncState) {
        let removed: Vec<FrontendKey> = s
            .scope
            .iter()
            .filter(|k| self.frontends.contains_key(k) && !desired.frontends.contains_key(k))
            .copied()
            .collect();
        for key in removed {
            let entries = self.frontends[&key].clone();
            if entries.slot0.is_some() {
                if let Err(e) = family::delete_service(&mut self.dp, &key, 0) {
                    s.out.unfinished(&key, None, e);
                    continue;
                }
                s.out.wrote();
                s.out.report.frontends_removed += 1;
                self.mirror_slot0(&key, None);
            }
            let mut clean = true;
            for slot in entries.slots.keys() {
                match family::delete_service(&mut self.dp, &key, *slot) {
                    Ok(()) => {
                        s.out.wrote();
                        self.mirror_slot(&key, *slot, None);
                    }
                    Err(e) => {
                        s.out.unfinished(&key, None, e);
                        clean = false;
                    }
                }
            }
            if let Some(id) = self.rev_nat_ids.get(&key) {
                if clean && self.slot0_refs(id) == 0 {
                    match family::delete_rev_nat(&mut self.dp, id, self.rev_nat.get(&id)) {
                        Ok(()) => {
                            s.out.wrote();
                            self.rev_nat.remove(&id);
                            self.release_rev_nat(&key);
                        }
                        Err(e) => s.out.unfinished(&key, None, e),
                    }
                }
            }
            self.forget_if_empty(&key);
        }
    }

    /// The reverse-NAT ids the prune phases look at: every one with an
    /// entry in `present` in a full sync, else the loose ones.
    fn rev_nat_candidates<V>(
        &self,
        s: &SyncState,
        present: &std::collections::BTreeMap<u16, V>,
    ) -> Vec<u16> {
        if s.full {
            present.keys().copied().collect()
        } else {
            self.loose
                .rev_nat
                .iter()
                .copied()
                .filter(|id| present.contains_key(id))
                .collect()
        }
    }

    /// Deletes reverse-NAT entries nobody owns or uses (leftovers of a
    /// previous agent). Invariant: an entry a slot 0 still names is kept,
    /// owned or not (replies of its flows are translated back with it).
    pub(super) fn delete_stale_rev_nat(&mut self, s: &mut SyncState) {
        let stale: Vec<u16> = self
            .rev_nat_candidates(s, &self.rev_nat)
            .into_iter()
            .filter(|id| self.rev_nat_ids.owner(*id).is_none() && self.slot0_refs(*id) == 0)
            .collect();
        for id in stale {
            match family::delete_rev_nat(&mut self.dp, id, self.rev_nat.get(&id)) {
                Ok(()) => {
                    s.out.wrote();
                    self.rev_nat.remove(&id);
                }
                Err(e) => {
                    s.out.retry.rev_nat.insert(id);
                    s.out.error(format!("reverse NAT {id}"), e);
                }
            }
        }
    }

    /// Deletes the source ranges of reverse-NAT ids no desired frontend owns.
    /// Invariant: the ranges of a desired frontend are left to the make
    /// phases (a range it gains is written before its slot 0, one it loses is
    /// deleted after); only those of frontends already removed, or of ids
    /// nobody owns, go here.
    pub(super) fn delete_stale_source_ranges(&mut self, desired: &DesiredState, s: &mut SyncState) {
        let ids: Vec<u16> = self
            .rev_nat_candidates(s, &self.source_ranges)
            .into_iter()
            .filter(|id| {
                self.rev_nat_ids
                    .owner(*id)
                    .is_none_or(|k| !desired.frontends.contains_key(k))
            })
            .collect();
        for id in ids {
            let ranges: Vec<SourceRange> = self.source_ranges[&id].iter().copied().collect();
            for range in ranges {
                match self.dp.delete_source_range(id, range) {
                    Ok(()) => {
                        s.out.wrote();
                        if let Some(set) = self.source_ranges.get_mut(&id) {
                            set.remove(&range);
                        }
                    }
                    Err(e) => {
                        s.out.retry.rev_nat.insert(id);
                        s.out.error(format!("source range of reverse NAT {id}"), e);
                    }
                }
            }
            if self
                .source_ranges
                .get(&id)
                .is_some_and(|set| set.is_empty())
            {
                self.source_ranges.remove(&id);
            }
        }
    }

    /// Deletes the backends no slot names and no desired frontend retains,
    /// and forgets their ids. Invariant: a backend is deleted only once no
    /// programmed slot names it, live or not (the slots that named it were
    /// deleted by the phases before), and a retained (terminating) backend
    /// stays while flows may use it.
    pub(super) fn delete_unused_backends(&mut self, s: &mut SyncState) {
        let candidates: Vec<u32> = if s.full {
            self.backends.keys().copied().collect()
        } else {
            self.loose
                .backends
                .iter()
                .copied()
                .filter(|id| self.backends.contains_key(id))
                .collect()
        };
        let unused: Vec<u32> = candidates
            .into_iter()
            .filter(|id| {
                let addr = backend_addr(&self.backends[id]);
                let retained =
                    self.backend_ids.get(&addr) == Some(*id) && self.users.is_retained(&addr);
                !self.slot_refs.contains_key(id) && !retained
            })
            .collect();
        for id in unused {
            match family::delete_backend(&mut self.dp, id, self.backends.get(&id)) {
                Ok(()) => {
                    s.out.wrote();
                    s.out.report.backends_removed += 1;
                    if let Some(b) = self.backends.remove(&id) {
                        self.backend_ids.release(&b, id);
                    }
                }
                Err(e) => {
                    s.out.retry.backends.insert(id);
                    s.out.error(format!("backend id {id}"), e);
                }
            }
        }
    }
}

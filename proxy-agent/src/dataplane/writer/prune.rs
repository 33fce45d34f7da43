//! The phases of [`Writer::sync`] that break what no desired frontend wants
//! any more, in the order `sync` runs them, after every desired frontend is
//! made: removed frontends, then the reverse-NAT entries, source ranges and
//! backends that nothing names. In a full sync they look at every entry; in
//! [`Writer::sync_changed`] at the frontends in scope and the ids that may
//! have lost their last reference ([`super::Loose`]) only: an entry is
//! deleted in both cases exactly when nothing names it any more.
use std::collections::BTreeSet;

use proxy_common::RevNatId;

use super::{
    family, BackendEntry, Dataplane, DataplaneError, FrontendKey, RevNatEntry, SourceRange,
    SyncState, Writer,
};
use crate::dataplane::ids::backend_addr;
use crate::dataplane::{BatchOutcome, BatchSizes};
use crate::model::DesiredState;

impl<D: Dataplane> Writer<D> {
    /// Takes `ops` (deletes) in order in batch calls `batch` (of
    /// [`BatchSizes`]): `took` accounts each one the dataplane took, `failed`
    /// the one a call stopped at, and a new call goes on after it, so every
    /// op is tried once, as single deletes one after the other would be.
    pub(super) fn in_batches<T>(
        &mut self,
        s: &mut SyncState,
        ops: &[T],
        batch: impl Fn(&mut D, &[T]) -> BatchOutcome,
        mut took: impl FnMut(&mut Self, &mut SyncState, &T),
        mut failed: impl FnMut(&mut Self, &mut SyncState, &T, DataplaneError),
    ) {
        let mut i = 0;
        let mut sizes = BatchSizes::default();
        while i < ops.len() {
            let call = &ops[i..ops.len().min(i + sizes.take())];
            let (n, err) = batch(&mut self.dp, call);
            // A dataplane takes them all, or stops at one it did not take.
            debug_assert!(
                if err.is_some() {
                    n < call.len()
                } else {
                    n == call.len()
                },
                "a batch outcome that names no op: {n} of {}",
                call.len()
            );
            if n == 0 && err.is_none() {
                break;
            }
            let n = n.min(call.len());
            for op in &ops[i..i + n] {
                s.out.wrote();
                took(self, s, op);
            }
            i += n;
            let Some(e) = err else {
                continue;
            };
            let Some(op) = ops.get(i) else {
                break;
            };
            failed(self, s, op, e);
            sizes.failed();
            i += 1;
        }
    }

    /// Deletes every programmed frontend in scope that is not desired: its
    /// slot 0, then its slots, then its reverse-NAT entry, each step in batch
    /// calls for all of them. Invariant: a frontend disappears whole before
    /// its parts do (no packet reads a slot once slot 0 is gone), and a
    /// reverse-NAT entry is deleted only once no slot 0 names it and all the
    /// frontend's slots are gone. A frontend whose slot 0 cannot be deleted
    /// is kept whole, and looked at again by the next sync.
    pub(super) fn remove_frontends(&mut self, desired: &DesiredState, s: &mut SyncState) {
        let removed: Vec<FrontendKey> = s
            .scope
            .iter()
            .filter(|k| self.frontends.contains_key(k) && !desired.frontends.contains_key(k))
            .copied()
            .collect();
        // Frontends whose slot 0 could not be deleted: kept whole.
        let mut kept: BTreeSet<FrontendKey> = BTreeSet::new();
        let slot0s: Vec<(FrontendKey, u16)> = removed
            .iter()
            .filter(|k| self.frontends[k].slot0.is_some())
            .map(|k| (*k, 0))
            .collect();
        self.in_batches(
            s,
            &slot0s,
            family::delete_services,
            |w, s, (key, _)| {
                s.out.report.frontends_removed += 1;
                w.mirror_slot0(key, None);
            },
            |_, s, (key, _), e| {
                s.out.unfinished(key, None, e);
                kept.insert(*key);
            },
        );
        let slots: Vec<(FrontendKey, u16)> = removed
            .iter()
            .filter(|k| !kept.contains(k))
            .flat_map(|k| self.frontends[k].slots.keys().map(|slot| (*k, *slot)))
            .collect();
        // Frontends a slot of which could not be deleted: their reverse-NAT
        // entry stays for the next sync.
        let mut unclean: BTreeSet<FrontendKey> = BTreeSet::new();
        self.in_batches(
            s,
            &slots,
            family::delete_services,
            |w, _, (key, slot)| w.mirror_slot(key, *slot, None),
            |_, s, (key, _), e| {
                s.out.unfinished(key, None, e);
                unclean.insert(*key);
            },
        );
        // The frontends gone whole: their reverse-NAT ids are released
        // whether or not the entry can go now. One a slot 0 still names
        // (an adopted leftover's) or whose delete fails is then an unowned
        // entry, which `delete_stale_rev_nat` deletes once nothing names it.
        let mut rev_nats: Vec<(FrontendKey, RevNatId, Option<RevNatEntry>)> = Vec::new();
        for key in removed
            .iter()
            .filter(|k| !kept.contains(k) && !unclean.contains(k))
        {
            let Some(id) = self.rev_nat_ids.get(key) else {
                continue;
            };
            if self.slot0_refs(id) == 0 {
                rev_nats.push((*key, id, self.rev_nat.get(&id).copied()));
            }
            self.release_rev_nat(key);
        }
        self.in_batches(
            s,
            &rev_nats,
            |dp, ops| {
                let ids: Vec<(RevNatId, Option<RevNatEntry>)> =
                    ops.iter().map(|(_, id, r)| (*id, *r)).collect();
                family::delete_rev_nats(dp, &ids)
            },
            |w, _, (_, id, _)| {
                w.rev_nat.remove(id);
            },
            |_, s, (key, id, _), e| {
                s.out.retry.rev_nat.insert(*id);
                s.out.unfinished(key, None, e);
            },
        );
        for key in &removed {
            self.forget_if_empty(key);
        }
    }

    /// The reverse-NAT ids the prune phases look at: every one with an
    /// entry in `present` in a full sync, else the loose ones.
    fn rev_nat_candidates<V>(
        &self,
        s: &SyncState,
        present: &std::collections::BTreeMap<RevNatId, V>,
    ) -> Vec<RevNatId> {
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
        let ops: Vec<(RevNatId, Option<RevNatEntry>)> = self
            .rev_nat_candidates(s, &self.rev_nat)
            .into_iter()
            .filter(|id| self.rev_nat_ids.owner(*id).is_none() && self.slot0_refs(*id) == 0)
            .map(|id| (id, self.rev_nat.get(&id).copied()))
            .collect();
        self.in_batches(
            s,
            &ops,
            family::delete_rev_nats,
            |w, _, (id, _)| {
                w.rev_nat.remove(id);
            },
            |_, s, (id, _), e| {
                s.out.retry.rev_nat.insert(*id);
                s.out.error(format!("reverse NAT {id}"), e);
            },
        );
    }

    /// Deletes the source ranges of reverse-NAT ids no desired frontend owns.
    /// Invariant: the ranges of a desired frontend are left to the make
    /// phases (a range it gains is written before its slot 0, one it loses is
    /// deleted after); only those of frontends already removed, or of ids
    /// nobody owns, go here.
    pub(super) fn delete_stale_source_ranges(&mut self, desired: &DesiredState, s: &mut SyncState) {
        let ids: Vec<RevNatId> = self
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
        let ops: Vec<(u32, Option<BackendEntry>)> = candidates
            .into_iter()
            .filter(|id| {
                let addr = backend_addr(&self.backends[id]);
                let retained =
                    self.backend_ids.get(&addr) == Some(*id) && self.users.is_retained(&addr);
                !self.slot_refs.contains_key(id) && !retained
            })
            .map(|id| (id, self.backends.get(&id).copied()))
            .collect();
        self.in_batches(
            s,
            &ops,
            family::delete_backends,
            |w, s, (id, _)| {
                s.out.report.backends_removed += 1;
                if let Some(b) = w.backends.remove(id) {
                    w.backend_ids.release(&b, *id);
                }
            },
            |_, s, (id, _), e| {
                s.out.retry.backends.insert(*id);
                s.out.error(format!("backend id {id}"), e);
            },
        );
    }
}

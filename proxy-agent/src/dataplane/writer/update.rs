//! The phases of [`Writer::sync`] that make desired frontends as they should
//! be, in the order `sync` runs them. Each writes an entry only before
//! anything names it, or after nothing does any more.
//!
//! No write of a phase depends on another of the same phase, so the four
//! phases that write the most (backends, reverse NAT, slots, slot 0) plan
//! their writes and hand them to the dataplane in batch calls (thousands
//! per syscall on the BPF maps). A batch call stops at the first write that
//! fails; the phase handles that failure as it would a single write's
//! (a failed frontend is cleaned before the frontends after it are
//! written) and goes on with a batch from the next write.
use std::collections::{BTreeMap, BTreeSet};

use proxy_common::{map_names, RevNatId, SvcValue};

use super::{
    family, source_ranges_of, BackendEntry, Dataplane, DataplaneError, RevNatEntry, SourceRange,
    SyncState, Target, Writer,
};
use crate::model::{BackendAddr, DesiredState, FrontendKey};

impl<D: Dataplane> Writer<D> {
    /// The host alias of frontend `key` for its slot 0
    /// ([`SvcValue::host_alias`]): the reverse-NAT id of the ClusterIP
    /// frontend it names, while that frontend is its own Service's (the
    /// desired state's owner: another Service claiming the address never
    /// receives this one's host UDP) and has its reverse-NAT entry (an id
    /// is kept only once it is written); 0 otherwise, and the socket hooks
    /// aim the host's UDP at a backend.
    fn host_alias(&self, key: &FrontendKey, desired: &DesiredState) -> RevNatId {
        let fe = &desired.frontends[key];
        fe.host_alias
            .filter(|a| {
                a.family() == key.family()
                    && a.proto == key.proto
                    && desired
                        .frontends
                        .get(a)
                        .is_some_and(|c| c.service == fe.service)
            })
            .and_then(|a| self.rev_nat_ids.get(&a))
            .unwrap_or(0)
    }

    /// Every backend the frontends of `s.order` need, with its entry (see
    /// [`Writer::wanted_backend`]: those in slots are active; terminating
    /// ones that flows may still use (`retained`) stay in the map without a
    /// slot; endpoints on this node are marked local: external traffic to the
    /// others is SNATed), in the order of the first frontend (in `order`)
    /// that needs each.
    fn wanted_backends(
        &self,
        desired: &DesiredState,
        s: &SyncState,
    ) -> Vec<(BackendAddr, BackendEntry)> {
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for fe in s.order.iter().filter_map(|k| desired.frontends.get(k)) {
            for b in fe.backends.iter().chain(&fe.retained) {
                if seen.insert(*b) {
                    if let Some(value) = self.wanted_backend(b, desired) {
                        out.push((*b, value));
                    }
                }
            }
        }
        out
    }
}

impl<D: Dataplane> Writer<D> {
    /// Writes every wanted backend that is new or changed, allocating ids for
    /// new ones. Invariant: a backend is written before any slot names it (a
    /// frontend with a backend that could not be written gets no target, so
    /// no slot); a new id is one no slot names, even a slot packets do not
    /// read. A backend that could not be written makes every frontend using
    /// it unfinished, so [`Writer::sync_changed`] retries it.
    pub(super) fn update_backends(&mut self, desired: &DesiredState, s: &mut SyncState) {
        // (address, id, new id, entry): planned first, then written in
        // batch calls (`family::put_backends`) and accounted in order.
        let mut writes: Vec<(BackendAddr, u32, bool, BackendEntry)> = Vec::new();
        // Ids handed out in this phase, not yet written: not to be handed
        // out twice should the allocator wrap around.
        let mut fresh: BTreeSet<u32> = BTreeSet::new();
        for (addr, value) in &self.wanted_backends(desired, s) {
            let (id, new) = match self.backend_ids.get(addr) {
                Some(id) => (id, false),
                None => match self.backend_ids.allocate(|id| {
                    self.backends.contains_key(&id)
                        || self.slot_refs.contains_key(&id)
                        || fresh.contains(&id)
                }) {
                    Some(id) => {
                        fresh.insert(id);
                        (id, true)
                    }
                    None => {
                        let e = DataplaneError::Full {
                            map: map_names::BACKENDS,
                            capacity: self.backend_ids.capacity(),
                        };
                        s.out.unwritten(addr, e);
                        continue;
                    }
                },
            };
            if self.backends.get(&id) == Some(value) {
                continue;
            }
            writes.push((*addr, id, new, *value));
        }
        let entries: Vec<(u32, BackendEntry)> = writes.iter().map(|w| (w.1, w.3)).collect();
        let mut i = 0;
        while i < writes.len() {
            let (n, err) = family::put_backends(&mut self.dp, &entries[i..]);
            for (addr, id, new, value) in &writes[i..i + n] {
                s.out.wrote();
                self.backends.insert(*id, *value);
                // Unused if every frontend needing it fails.
                self.loose.backends.insert(*id);
                if *new {
                    s.out.report.backends_added += 1;
                    self.backend_ids.assign(*addr, *id);
                }
            }
            i += n;
            let (Some(e), Some((addr, ..))) = (err, writes.get(i)) else {
                break;
            };
            s.out.unwritten(addr, e);
            i += 1;
        }
    }

    /// Plans the target of every desired frontend in scope: the ids of its
    /// slots and its count. Writes nothing. Invariant: a frontend gets a
    /// target only if every one of its backends is written, and a count a
    /// slot 0 can hold; the others fail and stay as they were.
    pub(super) fn plan_targets(&mut self, desired: &DesiredState, s: &mut SyncState) {
        for (key, fe) in s
            .scope
            .iter()
            .filter_map(|k| desired.frontends.get_key_value(k))
        {
            let missing = fe
                .backends
                .iter()
                .find(|b| self.backend_ids.get(b).is_none());
            if let Some(b) = missing {
                let e = DataplaneError::Op {
                    map: map_names::BACKENDS,
                    op: "put",
                    reason: format!("backend {b} could not be written"),
                };
                s.out.fail(*key, Some(fe), e);
                continue;
            }
            let Ok(count) = u16::try_from(fe.backends.len()) else {
                let e = DataplaneError::Op {
                    map: map_names::SERVICES,
                    op: "put",
                    reason: format!(
                        "{} backends, at most {} per frontend",
                        fe.backends.len(),
                        u16::MAX
                    ),
                };
                s.out.fail(*key, Some(fe), e);
                continue;
            };
            let ids = fe
                .backends
                .iter()
                .map(|b| self.backend_ids.as_map()[b])
                .collect();
            s.targets.insert(*key, Target { ids, count });
        }
    }

    /// Writes the reverse-NAT entry of every desired frontend that is new or
    /// changed, allocating ids for new frontends. Invariant: a frontend's
    /// reverse-NAT entry is written before its slot 0 names it (slot 0 is
    /// written only for frontends that have an id, and an id is kept only
    /// once its entry is written).
    pub(super) fn update_rev_nat(&mut self, desired: &DesiredState, s: &mut SyncState) {
        // (frontend, id, new id, entry), as in `update_backends`.
        let mut writes: Vec<(FrontendKey, RevNatId, bool, RevNatEntry)> = Vec::new();
        let mut fresh: BTreeSet<RevNatId> = BTreeSet::new();
        for key in &s.order {
            let fe = &desired.frontends[key];
            if s.out.is_failed(key) {
                continue;
            }
            let (id, new) = match self.rev_nat_ids.get(key) {
                Some(id) => (id, false),
                None => match self
                    .rev_nat_ids
                    .allocate(|id| self.rev_nat.contains_key(&id) || fresh.contains(&id))
                {
                    Some(id) => {
                        fresh.insert(id);
                        (id, true)
                    }
                    None => {
                        let e = DataplaneError::Full {
                            map: map_names::REV_NAT,
                            capacity: self.rev_nat_ids.capacity(),
                        };
                        s.out.fail(*key, Some(fe), e);
                        continue;
                    }
                },
            };
            let value = RevNatEntry::of(key);
            if self.rev_nat.get(&id) == Some(&value) {
                continue;
            }
            writes.push((*key, id, new, value));
        }
        let entries: Vec<(RevNatId, RevNatEntry)> = writes.iter().map(|w| (w.1, w.3)).collect();
        let mut i = 0;
        while i < writes.len() {
            let (n, err) = family::put_rev_nats(&mut self.dp, &entries[i..]);
            for (key, id, new, value) in &writes[i..i + n] {
                s.out.wrote();
                self.rev_nat.insert(*id, *value);
                if *new {
                    self.rev_nat_ids.assign(*key, *id);
                }
            }
            i += n;
            let (Some(e), Some((key, ..))) = (err, writes.get(i)) else {
                break;
            };
            s.out.fail(*key, desired.frontends.get(key), e);
            i += 1;
        }
    }

    /// Writes the source ranges a frontend gains. Invariant: a range is
    /// written before a slot 0 that restricts clients to its ranges takes
    /// effect, so no allowed client is refused in between. A range that
    /// cannot be written is reported and retried next sync, but the frontend
    /// is not failed: its slot 0 still gets the restriction, so a failure
    /// refuses clients the missing range would allow (fails closed) and
    /// never leaves the frontend open to everyone.
    pub(super) fn add_source_ranges(&mut self, desired: &DesiredState, s: &mut SyncState) {
        for key in &s.order {
            let fe = &desired.frontends[key];
            if s.out.is_failed(key) {
                continue;
            }
            let Some(id) = self.rev_nat_ids.get(key) else {
                continue;
            };
            for range in &source_ranges_of(key, fe) {
                if self
                    .source_ranges
                    .get(&id)
                    .is_some_and(|set| set.contains(range))
                {
                    continue;
                }
                match self.dp.put_source_range(id, *range) {
                    Ok(()) => {
                        s.out.wrote();
                        self.source_ranges.entry(id).or_default().insert(*range);
                    }
                    Err(e) => {
                        s.out.unfinished(key, Some(fe), e);
                        break;
                    }
                }
            }
        }
    }

    /// Writes slots `1..=count` of every target that differ from what is
    /// programmed. Invariant: a slot 0 never counts a slot that is not yet
    /// written: slots are written before the slot 0 with the new count, and a
    /// frontend whose slot fails is failed (its slot 0 is not written) and
    /// cleaned of the slots beyond its current count.
    pub(super) fn update_slots(&mut self, desired: &DesiredState, s: &mut SyncState) {
        // (frontend, slot, backend id), every frontend's, in batch calls.
        let mut writes: Vec<(FrontendKey, u16, u32)> = Vec::new();
        for key in &s.order {
            let Some(target) = s.targets.get(key) else {
                continue;
            };
            if s.out.is_failed(key) {
                continue;
            }
            for (i, id) in target.ids.iter().enumerate() {
                let slot = i as u16 + 1;
                if self.frontends.get(key).and_then(|e| e.slots.get(&slot)) == Some(id) {
                    continue;
                }
                writes.push((*key, slot, *id));
            }
        }
        let entries: Vec<(FrontendKey, u16, SvcValue)> = writes
            .iter()
            .map(|(key, slot, id)| (*key, *slot, SvcValue::slot(*id)))
            .collect();
        let mut i = 0;
        while i < writes.len() {
            let (n, err) = family::put_services(&mut self.dp, &entries[i..]);
            for (key, slot, id) in &writes[i..i + n] {
                s.out.wrote();
                s.touched.insert(*key);
                self.mirror_slot(key, *slot, Some(*id));
            }
            i += n;
            let (Some(e), Some(&(key, ..))) = (err, writes.get(i)) else {
                break;
            };
            // As single writes would: the frontend is failed and cleaned at
            // its first error (the room its slots took is free again for
            // the frontends after it), and its other slots are not written.
            s.out.fail(key, desired.frontends.get(&key), e);
            self.clean_failed(&key, &mut s.out);
            while writes.get(i).is_some_and(|w| w.0 == key) {
                i += 1;
            }
        }
    }

    /// Writes slot 0 of every target whose count, reverse-NAT id, flags,
    /// affinity or Maglev table differ. Invariant: slot 0 is written last,
    /// once every slot it counts, its reverse-NAT entry, its source ranges and
    /// its Maglev table are; a frontend
    /// whose slot 0 fails keeps its previous slot 0, and the slots beyond it
    /// are cleaned.
    pub(super) fn update_slot0(&mut self, desired: &DesiredState, s: &mut SyncState) {
        let order = std::mem::take(&mut s.order);
        // (frontend, reverse-NAT id, value, previous value): planned (each
        // Maglev table written as it is), then one batch call.
        let mut writes: Vec<(FrontendKey, RevNatId, SvcValue, Option<SvcValue>)> = Vec::new();
        for key in &order {
            let Some(target) = s.targets.get(key) else {
                continue;
            };
            if s.out.is_failed(key) {
                continue;
            }
            let fe = &desired.frontends[key];
            // A target that did not fail has a reverse-NAT id.
            let rev = self.rev_nat_ids.as_map()[key];
            let value = SvcValue::frontend(target.count, rev, fe.flags, fe.affinity_timeout_s)
                .with_host_alias(self.host_alias(key, desired));
            // A Maglev frontend reads its new table once this is written.
            let Some(value) = self.with_maglev_table(key, value, s) else {
                continue;
            };
            let previous = self.frontends.get(key).and_then(|e| e.slot0);
            if previous == Some(value) {
                continue;
            }
            writes.push((*key, rev, value, previous));
        }
        let entries: Vec<(FrontendKey, u16, SvcValue)> =
            writes.iter().map(|w| (w.0, 0, w.2)).collect();
        let mut i = 0;
        while i < writes.len() {
            let (n, err) = family::put_services(&mut self.dp, &entries[i..]);
            for (key, rev, value, previous) in &writes[i..i + n] {
                s.out.wrote();
                s.touched.insert(*key);
                self.commit_maglev(key, *rev, &mut s.maglev_pending);
                self.mirror_slot0(key, Some(*value));
                if previous.is_none() {
                    s.out.report.frontends_added += 1;
                }
            }
            i += n;
            let (Some(e), Some(&(key, ..))) = (err, writes.get(i)) else {
                break;
            };
            // Cleaned before the frontends after it are written, as single
            // writes would: the room its slots took is theirs.
            s.out.fail(key, desired.frontends.get(&key), e);
            self.clean_failed(&key, &mut s.out);
            i += 1;
        }
        s.order = order;
    }

    /// Deletes the slots beyond each target's count. Invariant: a slot is
    /// deleted only once slot 0 no longer counts it (its slot 0 with the new
    /// count is written: failed frontends are skipped).
    pub(super) fn delete_obsolete_slots(&mut self, desired: &DesiredState, s: &mut SyncState) {
        let mut obsolete: Vec<(FrontendKey, u16)> = Vec::new();
        for (key, target) in &s.targets {
            if s.out.is_failed(key) {
                continue;
            }
            let Some(entries) = self.frontends.get(key) else {
                continue;
            };
            let beyond = entries.slots.keys().filter(|slot| **slot > target.count);
            obsolete.extend(beyond.map(|slot| (*key, *slot)));
        }
        self.in_batches(
            s,
            &obsolete,
            family::delete_services,
            |w, s, (key, slot)| {
                s.touched.insert(*key);
                w.mirror_slot(key, *slot, None);
            },
            |_, s, (key, _), e| s.out.unfinished(key, desired.frontends.get(key), e),
        );
    }

    /// Deletes the source ranges a desired frontend no longer has.
    /// Invariant: a range is deleted only once slot 0 is as desired (failed
    /// frontends are skipped), so a client is refused only by the new state.
    pub(super) fn remove_source_ranges(&mut self, desired: &DesiredState, s: &mut SyncState) {
        for (key, fe) in s
            .scope
            .iter()
            .filter_map(|k| desired.frontends.get_key_value(k))
        {
            if s.out.is_failed(key) {
                continue;
            }
            let Some(id) = self.rev_nat_ids.get(key) else {
                continue;
            };
            let wanted: BTreeSet<SourceRange> = source_ranges_of(key, fe).into_iter().collect();
            let extra: Vec<SourceRange> = self
                .source_ranges
                .get(&id)
                .map(|set| set.difference(&wanted).copied().collect())
                .unwrap_or_default();
            for range in extra {
                match self.dp.delete_source_range(id, range) {
                    Ok(()) => {
                        s.out.wrote();
                        if let Some(set) = self.source_ranges.get_mut(&id) {
                            set.remove(&range);
                            if set.is_empty() {
                                self.source_ranges.remove(&id);
                            }
                        }
                    }
                    Err(e) => s.out.unfinished(key, Some(fe), e),
                }
            }
        }
    }

    /// Deletes the session-affinity entries left under the reverse-NAT id a
    /// frontend's slot 0 is about to name for the first time: an id freed by
    /// a removed frontend with affinity may still have entries pinning
    /// clients to that frontend's backends, which would hand this
    /// frontend's traffic to another Service's. Invariant: a slot 0 names an
    /// id only once no entry of an earlier frontend is left under it (a
    /// frontend whose prune fails is failed, so its slot 0 is not written).
    /// One walk of the affinity maps for all of them; none when no such id
    /// can have entries ([`Writer::affinity_ids`]).
    pub(super) fn prune_reused_affinity(&mut self, desired: &DesiredState, s: &mut SyncState) {
        let mut keys: BTreeMap<RevNatId, FrontendKey> = BTreeMap::new();
        for key in &s.order {
            if s.out.is_failed(key) {
                continue;
            }
            let Some(id) = self.rev_nat_ids.get(key) else {
                continue;
            };
            let named = self
                .frontends
                .get(key)
                .and_then(|e| e.slot0)
                .is_some_and(|v| v.rev_nat_id == id);
            if !named && self.slot0_refs(id) == 0 && self.affinity_ids.contains(&id) {
                keys.insert(id, *key);
            }
        }
        if keys.is_empty() {
            return;
        }
        let keep = keys.keys().map(|id| (*id, BTreeSet::new())).collect();
        match self.dp.prune_affinity(&keep) {
            Ok(_) => {
                for id in keys.keys() {
                    self.affinity_ids.remove(id);
                }
            }
            Err(e) => {
                let reason = e.to_string();
                for key in keys.values() {
                    let e = prune_error(&reason);
                    s.out.fail(*key, desired.frontends.get(key), e);
                    self.clean_failed(key, &mut s.out);
                }
            }
        }
    }

    /// Ends the session affinity of changed frontends: a client's entry ends
    /// when its backend left the frontend, every entry when affinity is off.
    /// A prune that failed is retried at every later sync until it succeeds
    /// (or the frontend is no longer desired: removing it ends its affinity).
    /// Invariant: affinity is pruned only once slot 0 no longer balances over
    /// the backends it drops (failed frontends are skipped), so a client is
    /// not pinned again to a backend that is leaving. All the frontends of a
    /// sync are pruned in one walk of the affinity maps, and only those whose
    /// id may have entries ([`Writer::affinity_ids`]): a sync of 50,000 new
    /// frontends without affinity walks nothing.
    pub(super) fn prune_changed_affinity(&mut self, desired: &DesiredState, s: &mut SyncState) {
        self.affinity_pending
            .retain(|key| desired.frontends.contains_key(key));
        let keys: BTreeSet<FrontendKey> = s
            .touched
            .iter()
            .chain(self.affinity_pending.iter())
            .copied()
            .collect();
        let mut keep: BTreeMap<RevNatId, BTreeSet<u32>> = BTreeMap::new();
        let mut pruned: Vec<FrontendKey> = Vec::new();
        for key in &keys {
            let (Some(fe), Some(target), Some(id)) = (
                desired.frontends.get(key),
                s.targets.get(key),
                self.rev_nat_ids.get(key),
            ) else {
                continue;
            };
            if s.out.is_failed(key) {
                continue;
            }
            if !self.affinity_ids.contains(&id) {
                self.affinity_pending.remove(key);
                continue;
            }
            let set = keep.entry(id).or_default();
            if fe.affinity_timeout_s > 0 {
                set.extend(target.ids.iter().copied());
            }
            pruned.push(*key);
        }
        if keep.is_empty() {
            return;
        }
        match self.dp.prune_affinity(&keep) {
            Ok(_) => {
                for key in &pruned {
                    self.affinity_pending.remove(key);
                }
                // An id whose frontends all have affinity off now has no
                // entry, and none can be made.
                for (id, set) in &keep {
                    if set.is_empty() && !self.names_affinity(*id) {
                        self.affinity_ids.remove(id);
                    }
                }
            }
            Err(e) => {
                let reason = e.to_string();
                for key in &pruned {
                    self.affinity_pending.insert(*key);
                    let e = prune_error(&reason);
                    s.out.unfinished(key, desired.frontends.get(key), e);
                }
            }
        }
    }

    /// Whether a programmed slot 0 naming reverse-NAT id `id` has session
    /// affinity.
    fn names_affinity(&self, id: RevNatId) -> bool {
        self.slot0_by_rev.get(&id).is_some_and(|keys| {
            keys.iter().any(|k| {
                self.frontends
                    .get(k)
                    .and_then(|e| e.slot0)
                    .is_some_and(|v| v.affinity_timeout_s > 0)
            })
        })
    }
}

/// The error of each frontend a failed walk of the affinity maps was for
/// (one walk serves them all; `reason` is its error).
fn prune_error(reason: &str) -> DataplaneError {
    DataplaneError::Op {
        map: map_names::AFFINITY,
        op: "prune",
        reason: reason.into(),
    }
}

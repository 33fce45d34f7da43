//! The [`Writer`]: keeps a [`Dataplane`] equal to a [`DesiredState`], writing
//! only differences, in make-before-break order.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use proxy_common::{backend_state, map_names, Backend4, RevNat4, Svc4Key, Svc4Value};

use super::ids::{BackendIds, RevNatIds};
use super::{Dataplane, DataplaneError, SourceRange};
use crate::model::{BackendAddr, DesiredState, Frontend, FrontendKey};

/// What one [`Writer::sync`] did.
#[derive(Default)]
pub struct SyncReport {
    pub frontends_added: usize,
    pub frontends_updated: usize,
    pub frontends_removed: usize,
    pub backends_added: usize,
    pub backends_removed: usize,
    /// Map operations that took effect (puts and deletes).
    pub writes: usize,
    /// What could not be programmed (a frontend, `service frontend`, or a
    /// backend) and why. Everything else was; a later sync retries these.
    pub errors: Vec<(String, DataplaneError)>,
}

impl SyncReport {
    /// Whether the sync wrote nothing and failed nowhere.
    pub fn is_noop(&self) -> bool {
        self.writes == 0 && self.errors.is_empty()
    }
}

impl fmt::Debug for SyncReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "frontends +{} ~{} -{}, backends +{} -{}, {} writes, {} errors",
            self.frontends_added,
            self.frontends_updated,
            self.frontends_removed,
            self.backends_added,
            self.backends_removed,
            self.writes,
            self.errors.len()
        )
    }
}

/// One frontend's entries in the services map, as programmed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct FrontendEntries {
    /// Slot 0.
    slot0: Option<Svc4Value>,
    /// Slots ≥ 1 → backend id.
    slots: BTreeMap<u16, u32>,
}

impl FrontendEntries {
    /// The number of slots packets may read.
    fn live_count(&self) -> u16 {
        self.slot0.map_or(0, |v| v.count)
    }
}

fn svc_key(key: &FrontendKey, slot: u16) -> Svc4Key {
    Svc4Key::new(key.addr, key.port, key.proto, key.scope, slot)
}

fn frontend_key(key: &Svc4Key) -> FrontendKey {
    FrontendKey {
        addr: key.addr(),
        port: key.port(),
        proto: key.proto,
        scope: key.scope,
    }
}

fn frontend_label(key: &FrontendKey, fe: Option<&Frontend>) -> String {
    match fe {
        Some(fe) => format!("{} {key}", fe.service),
        None => key.to_string(),
    }
}

/// Keeps a [`Dataplane`] equal to a [`DesiredState`]: owns the dataplane, the
/// backend ids (one per [`BackendAddr`], shared by every frontend using it,
/// never 0, allocated monotonically and never reused while in use), the
/// reverse-NAT ids (one per [`FrontendKey`], never 0) and a mirror of what is
/// programmed, and writes only differences, in make-before-break order.
pub struct Writer<D: Dataplane> {
    dp: D,
    frontends: BTreeMap<FrontendKey, FrontendEntries>,
    backends: BTreeMap<u32, Backend4>,
    rev_nat: BTreeMap<u16, RevNat4>,
    backend_ids: BackendIds,
    rev_nat_ids: RevNatIds,
    /// Programmed `loadBalancerSourceRanges`, by reverse-NAT id.
    source_ranges: BTreeMap<u16, BTreeSet<SourceRange>>,
}

impl<D: Dataplane> Writer<D> {
    /// Takes over `dp`, adopting what it already holds (pinned maps of a
    /// previous agent): backend ids and reverse-NAT ids stay as they are, so
    /// established flows keep working. Leftovers (slots beyond a frontend's
    /// count, unreferenced backends or reverse-NAT entries, frontends no longer
    /// desired) are deleted by the first [`Writer::sync`].
    pub fn adopt(dp: D) -> Result<Self, DataplaneError> {
        let programmed = dp.dump()?;
        let mut frontends: BTreeMap<FrontendKey, FrontendEntries> = BTreeMap::new();
        for (key, value) in &programmed.services {
            let entries = frontends.entry(frontend_key(key)).or_default();
            if key.slot == 0 {
                entries.slot0 = Some(*value);
            } else {
                entries.slots.insert(key.slot, value.backend_id);
            }
        }
        // Backend ids packets may use now win over duplicates.
        let live: BTreeSet<u32> = frontends
            .values()
            .flat_map(|e| {
                e.slots
                    .iter()
                    .filter(|(s, _)| **s <= e.live_count())
                    .map(|(_, id)| *id)
            })
            .collect();
        let max_backend = programmed
            .backends
            .keys()
            .copied()
            .chain(frontends.values().flat_map(|e| e.slots.values().copied()))
            .max();
        let max_rev_nat = programmed
            .rev_nat
            .keys()
            .copied()
            .chain(
                frontends
                    .values()
                    .filter_map(|e| e.slot0.map(|v| v.rev_nat_id)),
            )
            .max();
        let backend_ids = BackendIds::adopt(&programmed.backends, &live, max_backend);
        let rev_nat_ids = RevNatIds::adopt(
            frontends
                .iter()
                .filter_map(|(key, e)| e.slot0.map(|v| (*key, v.rev_nat_id))),
            max_rev_nat,
        );
        tracing::debug!(
            frontends = frontends.len(),
            backends = programmed.backends.len(),
            rev_nat = programmed.rev_nat.len(),
            "writer: adopted programmed state"
        );
        Ok(Self {
            dp,
            frontends,
            backends: programmed.backends,
            rev_nat: programmed.rev_nat,
            backend_ids,
            rev_nat_ids,
            source_ranges: programmed.source_ranges,
        })
    }

    pub fn dataplane(&self) -> &D {
        &self.dp
    }

    pub fn dataplane_mut(&mut self) -> &mut D {
        &mut self.dp
    }

    pub fn into_dataplane(self) -> D {
        self.dp
    }

    /// The backend id of every programmed backend.
    pub fn backend_ids(&self) -> &BTreeMap<BackendAddr, u32> {
        self.backend_ids.as_map()
    }

    /// The reverse-NAT id of every frontend that has one.
    pub fn rev_nat_ids(&self) -> &BTreeMap<FrontendKey, u16> {
        self.rev_nat_ids.as_map()
    }

    /// The backend ids in a frontend's slots `1..=count`, as programmed.
    pub fn programmed_slots(&self, key: &FrontendKey) -> Option<Vec<u32>> {
        let e = self.frontends.get(key)?;
        e.slot0?;
        Some(
            (1..=e.live_count())
                .filter_map(|s| e.slots.get(&s).copied())
                .collect(),
        )
    }

    /// Deletes slots of a frontend that failed to program, beyond what packets
    /// may read, and its reverse-NAT entry if no slot 0 uses it, so that a
    /// failure leaves nothing behind but the previous working state.
    fn clean_failed(&mut self, key: &FrontendKey, report: &mut SyncReport) {
        let Some(entries) = self.frontends.get(key) else {
            return;
        };
        let live = entries.live_count();
        let extra: Vec<u16> = entries
            .slots
            .keys()
            .copied()
            .filter(|s| *s > live)
            .collect();
        let has_slot0 = entries.slot0.is_some();
        for slot in extra {
            if self.dp.delete_service(svc_key(key, slot)).is_ok() {
                report.writes += 1;
                if let Some(e) = self.frontends.get_mut(key) {
                    e.slots.remove(&slot);
                }
            }
        }
        if !has_slot0 {
            if let Some(id) = self.rev_nat_ids.get(key) {
                if self.dp.delete_rev_nat(id).is_ok() {
                    report.writes += 1;
                    self.rev_nat.remove(&id);
                    self.rev_nat_ids.release(key);
                }
            }
        }
        self.forget_if_empty(key);
    }

    fn forget_if_empty(&mut self, key: &FrontendKey) {
        if self
            .frontends
            .get(key)
            .is_some_and(|e| e.slot0.is_none() && e.slots.is_empty())
        {
            self.frontends.remove(key);
        }
    }

    /// Makes the dataplane equal to `desired`, writing only what differs, in
    /// make-before-break order: (1) new backends, (2) reverse-NAT entries of new
    /// frontends, (3) slots `1..=n` of changed frontends, (4) their slot 0 with
    /// the new count, (5) their obsolete slots, (6) removed frontends (slot 0,
    /// then slots, then reverse NAT), (7) backends no frontend uses any more.
    /// A frontend that cannot be programmed is reported and left as it was;
    /// every other frontend is still synced.
    pub fn sync(&mut self, desired: &DesiredState) -> SyncReport {
        let mut report = SyncReport::default();
        self.backend_ids.begin_sync();
        self.rev_nat_ids.begin_sync();
        let mut failed: BTreeSet<FrontendKey> = BTreeSet::new();
        let fail = |failed: &mut BTreeSet<FrontendKey>, report: &mut SyncReport, key, fe, e| {
            failed.insert(key);
            report.errors.push((frontend_label(&key, fe), e));
        };

        // Endpoints on this node: external traffic to the others is SNATed.
        let local = |b: &BackendAddr| {
            if desired.local_endpoints.contains(&b.addr) {
                backend_state::LOCAL
            } else {
                0
            }
        };
        // (1) Backends: those in slots are active; terminating ones that flows
        // may still use (`retained`) stay in the map without a slot.
        let mut wanted: BTreeMap<BackendAddr, Backend4> = BTreeMap::new();
        for fe in desired.frontends.values() {
            for b in &fe.retained {
                wanted.insert(
                    *b,
                    Backend4::new(
                        b.addr,
                        b.port,
                        b.proto,
                        backend_state::TERMINATING | local(b),
                    ),
                );
            }
        }
        for fe in desired.frontends.values() {
            for b in &fe.backends {
                wanted.insert(
                    *b,
                    Backend4::new(b.addr, b.port, b.proto, backend_state::ACTIVE | local(b)),
                );
            }
        }
        let referenced: BTreeSet<u32> = self
            .frontends
            .values()
            .flat_map(|e| e.slots.values().copied())
            .collect();
        for (addr, value) in &wanted {
            let (id, new) = match self.backend_ids.get(addr) {
                Some(id) => (id, false),
                None => match self
                    .backend_ids
                    .allocate(|id| self.backends.contains_key(&id) || referenced.contains(&id))
                {
                    Some(id) => (id, true),
                    None => {
                        let e = DataplaneError::Full {
                            map: map_names::BACKENDS,
                            capacity: u32::MAX,
                        };
                        report.errors.push((format!("backend {addr}"), e));
                        continue;
                    }
                },
            };
            if self.backends.get(&id) == Some(value) {
                continue;
            }
            match self.dp.put_backend(id, *value) {
                Ok(()) => {
                    report.writes += 1;
                    self.backends.insert(id, *value);
                    if new {
                        report.backends_added += 1;
                        self.backend_ids.assign(*addr, id);
                    }
                }
                Err(e) => report.errors.push((format!("backend {addr}"), e)),
            }
        }

        // The target of every desired frontend: slot 0's fields and the slots.
        let mut targets: BTreeMap<FrontendKey, (Vec<u32>, u16)> = BTreeMap::new();
        for (key, fe) in &desired.frontends {
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
                fail(&mut failed, &mut report, *key, Some(fe), e);
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
                fail(&mut failed, &mut report, *key, Some(fe), e);
                continue;
            };
            let ids = fe
                .backends
                .iter()
                .map(|b| self.backend_ids.as_map()[b])
                .collect();
            targets.insert(*key, (ids, count));
        }

        // (2) Reverse-NAT entries.
        for (key, fe) in &desired.frontends {
            if failed.contains(key) {
                continue;
            }
            let (id, new) = match self.rev_nat_ids.get(key) {
                Some(id) => (id, false),
                None => match self
                    .rev_nat_ids
                    .allocate(|id| self.rev_nat.contains_key(&id))
                {
                    Some(id) => (id, true),
                    None => {
                        let e = DataplaneError::Full {
                            map: map_names::REV_NAT,
                            capacity: u16::MAX as u32,
                        };
                        fail(&mut failed, &mut report, *key, Some(fe), e);
                        continue;
                    }
                },
            };
            let value = RevNat4::new(key.addr, key.port);
            if self.rev_nat.get(&id) == Some(&value) {
                continue;
            }
            match self.dp.put_rev_nat(id, value) {
                Ok(()) => {
                    report.writes += 1;
                    self.rev_nat.insert(id, value);
                    if new {
                        self.rev_nat_ids.assign(*key, id);
                    }
                }
                Err(e) => fail(&mut failed, &mut report, *key, Some(fe), e),
            }
        }

        // (2b) Source ranges a frontend gains, before its slot 0 may use them.
        for (key, fe) in &desired.frontends {
            if failed.contains(key) {
                continue;
            }
            let Some(id) = self.rev_nat_ids.get(key) else {
                continue;
            };
            for range in &fe.source_ranges {
                if self
                    .source_ranges
                    .get(&id)
                    .is_some_and(|s| s.contains(range))
                {
                    continue;
                }
                match self.dp.put_source_range(id, *range) {
                    Ok(()) => {
                        report.writes += 1;
                        self.source_ranges.entry(id).or_default().insert(*range);
                    }
                    Err(e) => {
                        fail(&mut failed, &mut report, *key, Some(fe), e);
                        break;
                    }
                }
            }
        }

        // (3) Slots 1..=n of changed frontends.
        let mut touched: BTreeSet<FrontendKey> = BTreeSet::new();
        for (key, (ids, _)) in &targets {
            if failed.contains(key) {
                continue;
            }
            for (i, id) in ids.iter().enumerate() {
                let slot = i as u16 + 1;
                if self.frontends.get(key).and_then(|e| e.slots.get(&slot)) == Some(id) {
                    continue;
                }
                match self
                    .dp
                    .put_service(svc_key(key, slot), Svc4Value::slot(*id))
                {
                    Ok(()) => {
                        report.writes += 1;
                        touched.insert(*key);
                        self.frontends
                            .entry(*key)
                            .or_default()
                            .slots
                            .insert(slot, *id);
                    }
                    Err(e) => {
                        fail(
                            &mut failed,
                            &mut report,
                            *key,
                            desired.frontends.get(key),
                            e,
                        );
                        self.clean_failed(key, &mut report);
                        break;
                    }
                }
            }
        }

        // (4) Slot 0 with the new count.
        for (key, (_, count)) in &targets {
            if failed.contains(key) {
                continue;
            }
            let fe = &desired.frontends[key];
            let value = Svc4Value::frontend(
                *count,
                self.rev_nat_ids.as_map()[key],
                fe.flags,
                fe.affinity_timeout_s,
            );
            let previous = self.frontends.get(key).and_then(|e| e.slot0);
            if previous == Some(value) {
                continue;
            }
            match self.dp.put_service(svc_key(key, 0), value) {
                Ok(()) => {
                    report.writes += 1;
                    touched.insert(*key);
                    self.frontends.entry(*key).or_default().slot0 = Some(value);
                    if previous.is_none() {
                        report.frontends_added += 1;
                    }
                }
                Err(e) => {
                    fail(&mut failed, &mut report, *key, Some(fe), e);
                    self.clean_failed(key, &mut report);
                }
            }
        }

        // (5) Obsolete slots of changed frontends.
        for (key, (_, count)) in &targets {
            if failed.contains(key) {
                continue;
            }
            let Some(entries) = self.frontends.get(key) else {
                continue;
            };
            let obsolete: Vec<u16> = entries
                .slots
                .keys()
                .copied()
                .filter(|s| s > count)
                .collect();
            for slot in obsolete {
                match self.dp.delete_service(svc_key(key, slot)) {
                    Ok(()) => {
                        report.writes += 1;
                        touched.insert(*key);
                        if let Some(e) = self.frontends.get_mut(key) {
                            e.slots.remove(&slot);
                        }
                    }
                    Err(e) => report
                        .errors
                        .push((frontend_label(key, desired.frontends.get(key)), e)),
                }
            }
        }
        // (5b) Source ranges a frontend no longer has (its slot 0 is written).
        for (key, fe) in &desired.frontends {
            if failed.contains(key) {
                continue;
            }
            let Some(id) = self.rev_nat_ids.get(key) else {
                continue;
            };
            let wanted: BTreeSet<SourceRange> = fe.source_ranges.iter().copied().collect();
            let extra: Vec<SourceRange> = self
                .source_ranges
                .get(&id)
                .map(|s| s.difference(&wanted).copied().collect())
                .unwrap_or_default();
            for range in extra {
                match self.dp.delete_source_range(id, range) {
                    Ok(()) => {
                        report.writes += 1;
                        if let Some(s) = self.source_ranges.get_mut(&id) {
                            s.remove(&range);
                        }
                    }
                    Err(e) => report.errors.push((frontend_label(key, Some(fe)), e)),
                }
            }
        }

        // Session affinity of changed frontends: a client's entry ends when its
        // backend left the frontend, every entry when affinity is off.
        for key in &touched {
            let (Some(fe), Some((ids, _)), Some(id)) = (
                desired.frontends.get(key),
                targets.get(key),
                self.rev_nat_ids.get(key),
            ) else {
                continue;
            };
            if failed.contains(key) {
                continue;
            }
            let keep: BTreeSet<u32> = if fe.affinity_timeout_s > 0 {
                ids.iter().copied().collect()
            } else {
                BTreeSet::new()
            };
            if let Err(e) = self.dp.prune_affinity(id, &keep) {
                report.errors.push((frontend_label(key, Some(fe)), e));
            }
        }
        report.frontends_updated = touched
            .iter()
            .filter(|k| !failed.contains(k))
            .count()
            .saturating_sub(report.frontends_added);

        // (6) Removed frontends: slot 0, then the slots, then reverse NAT.
        let removed: Vec<FrontendKey> = self
            .frontends
            .keys()
            .filter(|k| !desired.frontends.contains_key(k))
            .copied()
            .collect();
        let mut slot0_refs: BTreeMap<u16, usize> = BTreeMap::new();
        for e in self.frontends.values() {
            if let Some(v) = e.slot0 {
                *slot0_refs.entry(v.rev_nat_id).or_default() += 1;
            }
        }
        for key in removed {
            let entries = self.frontends[&key].clone();
            if let Some(v) = entries.slot0 {
                if let Err(e) = self.dp.delete_service(svc_key(&key, 0)) {
                    report.errors.push((frontend_label(&key, None), e));
                    continue;
                }
                report.writes += 1;
                report.frontends_removed += 1;
                if let Some(e) = self.frontends.get_mut(&key) {
                    e.slot0 = None;
                }
                slot0_refs.entry(v.rev_nat_id).and_modify(|n| *n -= 1);
            }
            let mut clean = true;
            for slot in entries.slots.keys() {
                match self.dp.delete_service(svc_key(&key, *slot)) {
                    Ok(()) => {
                        report.writes += 1;
                        if let Some(e) = self.frontends.get_mut(&key) {
                            e.slots.remove(slot);
                        }
                    }
                    Err(e) => {
                        report.errors.push((frontend_label(&key, None), e));
                        clean = false;
                    }
                }
            }
            if let Some(id) = self.rev_nat_ids.get(&key) {
                if clean && slot0_refs.get(&id).copied().unwrap_or(0) == 0 {
                    match self.dp.delete_rev_nat(id) {
                        Ok(()) => {
                            report.writes += 1;
                            self.rev_nat.remove(&id);
                            self.rev_nat_ids.release(&key);
                        }
                        Err(e) => report.errors.push((frontend_label(&key, None), e)),
                    }
                }
            }
            self.forget_if_empty(&key);
        }

        // Reverse-NAT entries nobody owns or uses (leftovers of a previous agent).
        let stale_rev_nat: Vec<u16> = self
            .rev_nat
            .keys()
            .copied()
            .filter(|id| {
                self.rev_nat_ids.owner(*id).is_none()
                    && slot0_refs.get(id).copied().unwrap_or(0) == 0
            })
            .collect();
        for id in stale_rev_nat {
            match self.dp.delete_rev_nat(id) {
                Ok(()) => {
                    report.writes += 1;
                    self.rev_nat.remove(&id);
                }
                Err(e) => report.errors.push((format!("reverse NAT {id}"), e)),
            }
        }

        // Source ranges of reverse-NAT ids no desired frontend owns.
        let stale_ranges: Vec<(u16, SourceRange)> = self
            .source_ranges
            .iter()
            .filter(|(id, _)| {
                self.rev_nat_ids
                    .owner(**id)
                    .is_none_or(|k| !desired.frontends.contains_key(k))
            })
            .flat_map(|(id, set)| set.iter().map(move |r| (*id, *r)))
            .collect();
        for (id, range) in stale_ranges {
            match self.dp.delete_source_range(id, range) {
                Ok(()) => {
                    report.writes += 1;
                    if let Some(s) = self.source_ranges.get_mut(&id) {
                        s.remove(&range);
                    }
                }
                Err(e) => report
                    .errors
                    .push((format!("source range of reverse NAT {id}"), e)),
            }
        }
        self.source_ranges.retain(|_, s| !s.is_empty());

        // (7) Backends no slot refers to and no frontend retains.
        let mut referenced: BTreeSet<u32> = self
            .frontends
            .values()
            .flat_map(|e| e.slots.values().copied())
            .collect();
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
                    report.writes += 1;
                    report.backends_removed += 1;
                    if let Some(b) = self.backends.remove(&id) {
                        self.backend_ids.release(&b, id);
                    }
                }
                Err(e) => report.errors.push((format!("backend id {id}"), e)),
            }
        }

        if !report.errors.is_empty() {
            tracing::warn!(
                errors = report.errors.len(),
                "writer: sync incomplete; failed frontends retried next sync"
            );
        }
        tracing::debug!(report = ?report, "writer: sync done");
        report
    }
}

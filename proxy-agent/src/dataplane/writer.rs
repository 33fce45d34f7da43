//! The [`Writer`]: keeps a [`Dataplane`] equal to a [`DesiredState`], writing
//! only differences, in make-before-break order. [`Writer::sync`] is a list of
//! phases, as Cilium's `pkg/loadbalancer/reconciler/bpf_reconciler.go`: those
//! that make what desired frontends need are in `update.rs`, those that break
//! what nothing wants any more in `prune.rs`. Each phase says the invariant it
//! keeps; what the phases of one sync hand each other is a [`SyncState`].
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use proxy_common::{lb::MaglevKey, Backend4, RevNat4, Svc4Key, Svc4Value};

use super::ids::{BackendIds, RevNatIds};
use super::{Dataplane, DataplaneError, SourceRange};
use crate::model::{BackendAddr, DesiredState, Frontend, FrontendKey};

mod maglev;
mod prune;
mod update;

pub use maglev::MaglevSettings;
use maglev::MaglevTable;

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
    /// Frontends refused a Maglev table by `loadBalancing.maglev.maxTables`.
    pub maglev_refused: usize,
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

/// What a desired frontend's entries become: the backend id of each slot
/// `1..=count`, in order, and the count its slot 0 gets.
struct Target {
    ids: Vec<u32>,
    count: u16,
}

/// What the phases of one [`Writer::sync`] hand each other.
#[derive(Default)]
struct SyncState {
    out: Outcome,
    /// Every desired frontend that can be programmed (see
    /// [`Writer::plan_targets`]).
    targets: BTreeMap<FrontendKey, Target>,
    /// Frontends whose slots or slot 0 were written in this sync.
    touched: BTreeSet<FrontendKey>,
    /// Reverse-NAT id → how many programmed slot 0 entries name it (counted
    /// when removed frontends start to be deleted, kept up to date after).
    slot0_refs: BTreeMap<u16, usize>,
    /// Maglev tables written whole in the generation slot 0 does not read
    /// yet, by frontend: slot 0 switches to them.
    maglev_pending: BTreeMap<FrontendKey, MaglevTable>,
}

/// The report of one sync, and the frontends that failed in it: those are
/// left as they were, and later phases skip them.
#[derive(Default)]
struct Outcome {
    report: SyncReport,
    failed: BTreeSet<FrontendKey>,
}

impl Outcome {
    /// A map operation took effect.
    fn wrote(&mut self) {
        self.report.writes += 1;
    }

    /// Something other than a desired frontend could not be written.
    fn error(&mut self, what: String, e: DataplaneError) {
        self.report.errors.push((what, e));
    }

    /// The desired frontend `key` cannot be programmed in this sync.
    fn fail(&mut self, key: FrontendKey, fe: Option<&Frontend>, e: DataplaneError) {
        self.failed.insert(key);
        self.error(frontend_label(&key, fe), e);
    }

    fn is_failed(&self, key: &FrontendKey) -> bool {
        self.failed.contains(key)
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
    maglev: MaglevSettings,
    /// Every chunk in the Maglev map.
    maglev_keys: BTreeSet<MaglevKey>,
    /// The table each Maglev frontend's slot 0 reads, by reverse-NAT id.
    maglev_tables: BTreeMap<u16, MaglevTable>,
    /// Frontends whose last affinity prune failed: retried at the next sync.
    affinity_pending: BTreeSet<FrontendKey>,
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
        let maglev_tables = maglev::adopt_tables(&frontends, &programmed.maglev);
        Ok(Self {
            dp,
            frontends,
            backends: programmed.backends,
            rev_nat: programmed.rev_nat,
            backend_ids,
            rev_nat_ids,
            source_ranges: programmed.source_ranges,
            maglev: MaglevSettings::default(),
            maglev_keys: programmed.maglev.keys().copied().collect(),
            maglev_tables,
            affinity_pending: BTreeSet::new(),
        })
    }

    /// The Maglev table size and cap (`loadBalancing.maglev`).
    pub fn with_maglev(mut self, settings: MaglevSettings) -> Self {
        self.maglev = settings;
        self
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

    /// Frontends whose session-affinity prune failed and is retried at the
    /// next sync.
    pub fn affinity_pending(&self) -> &BTreeSet<FrontendKey> {
        &self.affinity_pending
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

    /// Makes the dataplane equal to `desired`, writing only what differs, in
    /// make-before-break order: first what desired frontends need, each piece
    /// before anything names it (backends, reverse NAT, source ranges, slots
    /// `1..=n`, then slot 0 with the new count), then what slot 0 no longer
    /// names (obsolete slots, source ranges, affinity), then removed frontends
    /// (slot 0, then slots, then reverse NAT) and whatever nothing names any
    /// more (reverse-NAT entries, source ranges, backends). A frontend that
    /// cannot be programmed is reported and left as it was; every other
    /// frontend is still synced.
    pub fn sync(&mut self, desired: &DesiredState) -> SyncReport {
        self.backend_ids.begin_sync();
        self.rev_nat_ids.begin_sync();
        let mut s = SyncState::default();

        // Make (update.rs).
        self.update_backends(desired, &mut s);
        self.plan_targets(desired, &mut s);
        self.update_rev_nat(desired, &mut s);
        self.add_source_ranges(desired, &mut s);
        self.update_slots(desired, &mut s);
        self.update_maglev(desired, &mut s);
        self.update_slot0(desired, &mut s);
        self.delete_obsolete_slots(desired, &mut s);
        self.remove_source_ranges(desired, &mut s);
        self.prune_changed_affinity(desired, &mut s);
        s.count_updated();

        // Break (prune.rs).
        self.remove_frontends(desired, &mut s);
        self.delete_stale_rev_nat(&mut s);
        self.delete_stale_source_ranges(desired, &mut s);
        self.delete_unused_maglev(&mut s);
        self.delete_unused_backends(desired, &mut s);

        let report = s.out.report;
        if !report.errors.is_empty() {
            tracing::warn!(
                errors = report.errors.len(),
                "writer: sync incomplete; failed frontends retried next sync"
            );
        }
        tracing::debug!(report = ?report, "writer: sync done");
        report
    }

    /// The backend ids named by programmed slots (live or not).
    fn slot_backend_ids(&self) -> BTreeSet<u32> {
        self.frontends
            .values()
            .flat_map(|e| e.slots.values().copied())
            .collect()
    }

    /// Deletes slots of a frontend that failed to program, beyond what packets
    /// may read, and its reverse-NAT entry if no slot 0 uses it, so that a
    /// failure leaves nothing behind but the previous working state.
    fn clean_failed(&mut self, key: &FrontendKey, out: &mut Outcome) {
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
                out.wrote();
                if let Some(e) = self.frontends.get_mut(key) {
                    e.slots.remove(&slot);
                }
            }
        }
        if !has_slot0 {
            if let Some(id) = self.rev_nat_ids.get(key) {
                if self.dp.delete_rev_nat(id).is_ok() {
                    out.wrote();
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
}

impl SyncState {
    /// `frontends_updated`: touched frontends that did not fail, other than
    /// the added ones.
    fn count_updated(&mut self) {
        let report = &mut self.out.report;
        report.frontends_updated = self
            .touched
            .iter()
            .filter(|k| !self.out.failed.contains(k))
            .count()
            .saturating_sub(report.frontends_added);
    }
}

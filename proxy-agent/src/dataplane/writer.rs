//! The [`Writer`]: keeps a [`Dataplane`] equal to a [`DesiredState`], writing
//! only differences, in make-before-break order. [`Writer::sync`] is a list of
//! phases, as Cilium's `pkg/loadbalancer/reconciler/bpf_reconciler.go`: those
//! that make what desired frontends need are in `update.rs`, those that break
//! what nothing wants any more in `prune.rs`. Each phase says the invariant it
//! keeps; what the phases of one sync hand each other is a [`SyncState`].
//!
//! [`Writer::sync_changed`] runs the same phases over the frontends a
//! [`Changes`] lists (and those an earlier sync left unfinished), and the
//! prune phases over the ids that may have lost their last reference: the
//! writer keeps reference counts (slots per backend id, slot 0 entries per
//! reverse-NAT id) and an index of the desired frontends by backend address
//! (`users.rs`) so that neither needs a walk over the whole state.
//!
//! Why one file (about 1,000 lines): the phases are in `writer/`, but the
//! [`Writer`]'s mirror of what is programmed and the indexes kept with it
//! (`slot_refs`, `slot0_by_rev`, `alias_by_rev`, `loose`, `unfinished`) are
//! built in one place, [`Writer::adopt`], and kept in a few others
//! (`mirror_slot`, `mirror_slot0`, `run`); they stay beside the struct that
//! declares them, so that the invariants between them are read together.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use proxy_common::{lb::MaglevKey, RevNatId, Svc4Key, Svc6Key, SvcValue};

use super::ids::{BackendIds, RevNatIds};
use super::{BackendEntry, Dataplane, DataplaneError, RevNatEntry, SourceRange};
use crate::model::{BackendAddr, DesiredState, Frontend, FrontendKey, ServiceAge};
use crate::vec_set::{VecMap, VecSet};

mod family;
mod maglev;
mod prune;
mod update;
mod users;

pub use maglev::MaglevSettings;
use maglev::MaglevTable;
use users::Users;

/// What changed in the desired state since the last sync (full or changed):
/// what [`Writer::sync_changed`] is told.
#[derive(Clone, Copy, Debug)]
pub struct Changes<'a> {
    /// Frontends whose [`Frontend`] was added, changed or removed.
    pub frontends: &'a BTreeSet<FrontendKey>,
    /// Addresses that entered or left [`DesiredState::local_endpoints`].
    pub local_endpoints: &'a BTreeSet<IpAddr>,
}

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

/// The first full sync with at least this many frontends, or one that
/// adds this many and at least a quarter of those held, repacks the
/// writer's maps.
const REPACK_AT: usize = 1_024;

/// One frontend's entries in the services map, as programmed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct FrontendEntries {
    /// Slot 0.
    slot0: Option<SvcValue>,
    /// Slots ≥ 1 → backend id (a sorted vector: most frontends have a few,
    /// where a `BTreeMap` would allocate a node of eleven).
    slots: VecMap<u16, u32>,
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
    /// The frontends this sync looks at, desired or not: every one in a full
    /// sync; in [`Writer::sync_changed`] the changed ones, those an earlier
    /// sync left unfinished and those using a backend whose entry changes.
    scope: BTreeSet<FrontendKey>,
    /// Whether `scope` is everything: the prune phases then look at every
    /// entry, not only at the ids in [`Writer::loose`].
    full: bool,
    /// Every desired frontend in `scope`, in the order phases that take
    /// capacity (ids, map entries, Maglev tables) serve them: see
    /// [`capacity_order`].
    order: Vec<FrontendKey>,
    /// Every desired frontend in `scope` that can be programmed (see
    /// [`Writer::plan_targets`]).
    targets: BTreeMap<FrontendKey, Target>,
    /// Frontends whose slots or slot 0 were written in this sync.
    touched: BTreeSet<FrontendKey>,
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
    /// Frontends that did not fail but are not all done (an error in a
    /// phase that does not fail the frontend): a full sync would write for
    /// them again, so the next [`Writer::sync_changed`] looks at them.
    unfinished: BTreeSet<FrontendKey>,
    /// Backends that could not be written: the frontends using them are
    /// looked at again by the next [`Writer::sync_changed`].
    unwritten: BTreeSet<BackendAddr>,
    /// Ids a prune phase could not delete: looked at again next sync.
    retry: Loose,
}

impl Outcome {
    /// A map operation took effect.
    fn wrote(&mut self) {
        self.report.writes += 1;
    }

    /// Something not tied to one frontend could not be written or deleted.
    fn error(&mut self, what: String, e: DataplaneError) {
        self.report.errors.push((what, e));
    }

    /// A phase could not finish frontend `key` (desired or not), without
    /// failing it.
    fn unfinished(&mut self, key: &FrontendKey, fe: Option<&Frontend>, e: DataplaneError) {
        self.unfinished.insert(*key);
        self.error(frontend_label(key, fe), e);
    }

    /// The backend entry of `addr` could not be written.
    fn unwritten(&mut self, addr: &BackendAddr, e: DataplaneError) {
        self.unwritten.insert(*addr);
        self.error(format!("backend {addr}"), e);
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

/// A frontend's source ranges of its own family (the model gives it no
/// others; one of the other family could not be keyed in its family's map).
fn source_ranges_of(key: &FrontendKey, fe: &Frontend) -> Vec<SourceRange> {
    fe.source_ranges
        .iter()
        .filter(|(a, _)| a.is_ipv4() == key.addr.is_ipv4())
        .copied()
        .collect()
}

fn frontend_key(key: &Svc4Key) -> FrontendKey {
    FrontendKey {
        addr: IpAddr::V4(key.addr()),
        port: key.port(),
        proto: key.proto,
        scope: key.scope,
    }
}

fn frontend_key6(key: &Svc6Key) -> FrontendKey {
    FrontendKey {
        addr: IpAddr::V6(key.addr()),
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

/// The desired frontends in the order they are served when an id space or a
/// map runs out: by their Service's place in
/// [`DesiredState::service_order`] (the oldest Service first), then by key.
/// Not by address alone: a new Service whose addresses sort low (an
/// externalIP list of thousands, chosen by whoever creates it) would
/// otherwise take the last ids and entries before an older Service's new
/// frontend or growing backend list. What a frontend holds already (its ids,
/// its entries) is never taken from it: only what is still to be allocated
/// follows this order.
///
/// Only the frontends of `scope` are ordered: among them, the order is the
/// one all desired frontends have.
fn capacity_order(desired: &DesiredState, scope: &BTreeSet<FrontendKey>) -> Vec<FrontendKey> {
    let all = desired.frontends.len();
    // A scope of a sixteenth of the frontends or more (a start, a full
    // sync) is found by one walk of both sorted sets, not a search each.
    let wide = scope.len().saturating_mul(16) >= all;
    let in_scope: Vec<(&FrontendKey, &Frontend)> = if wide {
        let mut wanted = scope.iter().peekable();
        desired
            .frontends
            .iter()
            .filter(|(key, _)| {
                while wanted.next_if(|w| *w < *key).is_some() {}
                wanted.next_if_eq(key).is_some()
            })
            .collect()
    } else {
        scope
            .iter()
            .filter_map(|key| desired.frontends.get_key_value(key))
            .collect()
    };
    // The same for the ages: with many frontends to place, the Services'
    // ages are read once into a hash map.
    let ages: Option<foldhash::HashMap<&str, ServiceAge>> = wide.then(|| {
        desired
            .service_order
            .iter()
            .map(|(service, age)| (service.as_str(), *age))
            .collect()
    });
    let age_of = |service: &str| match &ages {
        Some(ages) => ages.get(service).copied(),
        None => desired.service_order.get(service).copied(),
    };
    // (missing from the order, age, Service, key): keys are unique, so an
    // unstable sort gives the one order.
    let mut order: Vec<(bool, ServiceAge, &str, FrontendKey)> = in_scope
        .into_iter()
        .map(|(key, fe)| {
            let age = age_of(&fe.service);
            (age.is_none(), age.unwrap_or_default(), &*fe.service, *key)
        })
        .collect();
    order.sort_unstable();
    order.into_iter().map(|(_, _, _, key)| key).collect()
}

/// Ids that may have lost their last reference since the prune phases last
/// ran: what [`Writer::sync_changed`]'s prune phases look at.
#[derive(Debug, Default)]
struct Loose {
    /// Backend ids a slot stopped naming, or whose address changed users.
    backends: BTreeSet<u32>,
    /// Reverse-NAT ids a slot 0 stopped (or started) naming, ids released,
    /// ids of frontends looked at: their entry, source ranges and Maglev
    /// chunks may be stale.
    rev_nat: BTreeSet<RevNatId>,
}

/// Keeps a [`Dataplane`] equal to a [`DesiredState`]: owns the dataplane, the
/// backend ids (one per [`BackendAddr`], shared by every frontend using it,
/// never 0, allocated monotonically and never reused while in use), the
/// reverse-NAT ids (one per [`FrontendKey`], never 0) and a mirror of what is
/// programmed, and writes only differences, in make-before-break order.
pub struct Writer<D: Dataplane> {
    dp: D,
    frontends: BTreeMap<FrontendKey, FrontendEntries>,
    backends: BTreeMap<u32, BackendEntry>,
    rev_nat: BTreeMap<RevNatId, RevNatEntry>,
    backend_ids: BackendIds,
    rev_nat_ids: RevNatIds,
    /// Programmed `loadBalancerSourceRanges`, by reverse-NAT id.
    source_ranges: BTreeMap<RevNatId, BTreeSet<SourceRange>>,
    maglev: MaglevSettings,
    /// Every chunk in the Maglev map.
    maglev_keys: BTreeSet<MaglevKey>,
    /// The table each Maglev frontend's slot 0 reads, by reverse-NAT id.
    maglev_tables: BTreeMap<RevNatId, MaglevTable>,
    /// Frontends whose last affinity prune failed: retried at the next sync.
    affinity_pending: BTreeSet<FrontendKey>,
    /// Reverse-NAT ids the affinity maps may hold entries of: those a slot 0
    /// with session affinity named since their entries were last pruned
    /// away, and those found in the maps on adoption. A frontend whose id is
    /// not here has no entry to prune, so a sync skips its walk of the maps.
    affinity_ids: BTreeSet<RevNatId>,
    /// Backend id → how many programmed slots (live or not) name it; kept
    /// with `frontends` by [`Writer::mirror_slot`].
    slot_refs: BTreeMap<u32, usize>,
    /// Reverse-NAT id → the frontends whose programmed slot 0 names it; kept
    /// with `frontends` by [`Writer::mirror_slot0`].
    slot0_by_rev: BTreeMap<RevNatId, VecSet<FrontendKey>>,
    /// Reverse-NAT id → the frontends whose programmed slot 0 names it as
    /// their host alias ([`SvcValue::host_alias`]); kept by
    /// [`Writer::mirror_slot0`]. An entry so named is not deleted, so its
    /// id is not given to another frontend while an alias names it.
    alias_by_rev: BTreeMap<RevNatId, VecSet<FrontendKey>>,
    /// The desired frontends by backend address, as of the last sync.
    users: Users,
    /// Frontends the last sync failed or did not finish (and those using a
    /// backend it could not write): [`Writer::sync_changed`] takes them as
    /// changed, so they are retried as a full sync would retry them.
    unfinished: BTreeSet<FrontendKey>,
    /// See [`Loose`]; emptied by the prune phases of every sync.
    loose: Loose,
    /// Whether a full [`Writer::sync`] ran: until then `sync_changed` is one
    /// (adopted leftovers are deleted, the indexes built).
    synced: bool,
}

impl<D: Dataplane> Writer<D> {
    /// Takes over `dp`, adopting what it already holds (pinned maps of a
    /// previous agent): backend ids and reverse-NAT ids stay as they are, so
    /// established flows keep working. Leftovers (slots beyond a frontend's
    /// count, unreferenced backends or reverse-NAT entries, frontends no longer
    /// desired) are deleted by the first [`Writer::sync`].
    pub fn adopt(dp: D) -> Result<Self, DataplaneError> {
        let programmed = dp.dump()?;
        let mut affinity_ids = dp.affinity_ids()?;
        let mut frontends: BTreeMap<FrontendKey, FrontendEntries> = BTreeMap::new();
        let services = programmed
            .services
            .iter()
            .map(|(k, v)| (frontend_key(k), k.slot, v))
            .chain(
                programmed
                    .services6
                    .iter()
                    .map(|(k, v)| (frontend_key6(k), k.slot, v)),
            );
        for (key, slot, value) in services {
            let entries = frontends.entry(key).or_default();
            if slot == 0 {
                if value.affinity_timeout_s > 0 {
                    affinity_ids.insert(value.rev_nat_id);
                }
                entries.slot0 = Some(*value);
            } else {
                entries.slots.insert(slot, value.backend_id);
            }
        }
        let backends: BTreeMap<u32, BackendEntry> = programmed
            .backends
            .iter()
            .map(|(id, b)| (*id, BackendEntry::V4(*b)))
            .chain(
                programmed
                    .backends6
                    .iter()
                    .map(|(id, b)| (*id, BackendEntry::V6(*b))),
            )
            .collect();
        let rev_nat: BTreeMap<RevNatId, RevNatEntry> = programmed
            .rev_nat
            .iter()
            .map(|(id, r)| (*id, RevNatEntry::V4(*r)))
            .chain(
                programmed
                    .rev_nat6
                    .iter()
                    .map(|(id, r)| (*id, RevNatEntry::V6(*r))),
            )
            .collect();
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
        let max_backend = backends
            .keys()
            .copied()
            .chain(frontends.values().flat_map(|e| e.slots.values().copied()))
            .max();
        let max_rev_nat = rev_nat
            .keys()
            .copied()
            .chain(
                frontends
                    .values()
                    .filter_map(|e| e.slot0.map(|v| v.rev_nat_id)),
            )
            .max();
        let (backend_space, rev_nat_space) = dp.id_spaces();
        let backend_ids = BackendIds::adopt(&backends, &live, max_backend, backend_space);
        let rev_nat_ids = RevNatIds::adopt(
            frontends
                .iter()
                .filter_map(|(key, e)| e.slot0.map(|v| (*key, v.rev_nat_id))),
            max_rev_nat,
            rev_nat_space,
        );
        // A map made smaller than the ids in use (`mapSizes`): the frontends
        // keep their ids (their flows name them), but the per-frontend
        // arrays the datapath indexes by id end below them.
        let beyond = rev_nat_ids
            .as_map()
            .values()
            .filter(|id| **id > rev_nat_ids.capacity())
            .count();
        if beyond > 0 {
            tracing::warn!(
                frontends = beyond,
                ids = rev_nat_ids.capacity(),
                "frontends keep reverse-NAT ids beyond mapSizes.reverseNat (made smaller): they have no traffic counters, and round robin picks at random for them, until their Services are made again"
            );
        }
        let beyond = backend_ids
            .as_map()
            .values()
            .filter(|id| **id > backend_ids.capacity())
            .count();
        if beyond > 0 {
            tracing::warn!(
                backends = beyond,
                ids = backend_ids.capacity(),
                "backends keep ids beyond mapSizes.backends (made smaller): they have no traffic counters while they are in use"
            );
        }
        tracing::debug!(
            frontends = frontends.len(),
            backends = backends.len(),
            rev_nat = rev_nat.len(),
            "writer: adopted programmed state"
        );
        let maglev_tables = maglev::adopt_tables(&frontends, &programmed.maglev);
        let mut slot_refs: BTreeMap<u32, usize> = BTreeMap::new();
        let mut slot0_by_rev: BTreeMap<RevNatId, VecSet<FrontendKey>> = BTreeMap::new();
        let mut alias_by_rev: BTreeMap<RevNatId, VecSet<FrontendKey>> = BTreeMap::new();
        for (key, e) in &frontends {
            for id in e.slots.values() {
                *slot_refs.entry(*id).or_default() += 1;
            }
            if let Some(v) = e.slot0 {
                slot0_by_rev.entry(v.rev_nat_id).or_default().insert(*key);
                if v.host_alias() != 0 {
                    alias_by_rev.entry(v.host_alias()).or_default().insert(*key);
                }
            }
        }
        Ok(Self {
            dp,
            frontends,
            backends,
            rev_nat,
            backend_ids,
            rev_nat_ids,
            source_ranges: programmed.source_ranges,
            maglev: MaglevSettings::default(),
            maglev_keys: programmed.maglev.keys().copied().collect(),
            maglev_tables,
            affinity_pending: BTreeSet::new(),
            affinity_ids,
            slot_refs,
            slot0_by_rev,
            alias_by_rev,
            users: Users::default(),
            unfinished: BTreeSet::new(),
            loose: Loose::default(),
            synced: false,
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
    pub fn rev_nat_ids(&self) -> &BTreeMap<FrontendKey, RevNatId> {
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
        let scope: BTreeSet<FrontendKey> = desired
            .frontends
            .keys()
            .chain(self.frontends.keys())
            .chain(self.users.keys())
            .copied()
            .collect();
        let first = !self.synced;
        self.users.update(&scope, desired);
        let report = self.run(desired, scope, true);
        self.repack_after(first, &report);
        report
    }

    /// Repacks ([`Writer::repack`]) after the first full sync or a sync
    /// that added many frontends, full or changed: a start whose objects
    /// arrive as changes (the agent's first sync finds the manifests
    /// directory empty, or the API's list comes after it) fills the maps
    /// as much as a full sync does, and left them half full: 18 MiB more at
    /// 50,000 Services (`control_plane_cost`, as the agent syncs).
    fn repack_after(&mut self, first: bool, report: &SyncReport) {
        let added = report.frontends_added;
        if (first || added.saturating_mul(4) >= self.frontends.len())
            && self.frontends.len().max(added) >= REPACK_AT
        {
            self.repack();
        }
    }

    /// Rebuilds the mirror's maps with full nodes, after the first sync (a
    /// start, or maps adopted from a previous agent) or one that added many
    /// frontends: filled in key order, a `BTreeMap` keeps its nodes about
    /// half full ([`crate::vec_set::repack`]).
    /// The maps are independent: two CPUs rebuild them in two groups.
    fn repack(&mut self) {
        use crate::vec_set::repack;
        let (frontends, users) = (&mut self.frontends, &mut self.users);
        crate::parallel::join(
            || {
                repack(frontends);
                users.repack();
            },
            || {
                repack(&mut self.backends);
                repack(&mut self.rev_nat);
                repack(&mut self.slot_refs);
                self.backend_ids.repack();
                self.rev_nat_ids.repack();
            },
        );
    }

    /// Makes the dataplane equal to `desired` as [`Writer::sync`] would, when
    /// `desired` differs from the state of the previous sync only as
    /// `changes` says (and in the `service_order` of the changed frontends'
    /// Services): the same phases, in the same order, with the same
    /// make-before-break invariants, but over the changed frontends only,
    /// plus those the previous sync failed or did not finish, plus those
    /// using a backend whose entry changes (a local endpoint, a backend
    /// turning active or terminating), so that each backend is written at
    /// the place a full sync would write it. The prune phases look only at
    /// the ids that may have lost their last reference. The cost is that of
    /// those frontends (their backends, slots, Maglev tables) times log N.
    /// The first sync after [`Writer::adopt`] is a full one.
    pub fn sync_changed(&mut self, desired: &DesiredState, changes: Changes<'_>) -> SyncReport {
        if !self.synced {
            return self.sync(desired);
        }
        let mut scope: BTreeSet<FrontendKey> = changes
            .frontends
            .iter()
            .chain(&self.unfinished)
            .chain(&self.affinity_pending)
            .copied()
            .collect();
        let changed = self.users.update(&scope, desired);
        // A backend whose users changed may be unused now.
        for addr in &changed {
            if let Some(id) = self.backend_ids.get(addr) {
                self.loose.backends.insert(id);
            }
        }
        // Every backend whose entry this sync writes brings every frontend
        // using it into scope: a full sync writes it at the first of them.
        let mut addrs = changed;
        for fe in scope.iter().filter_map(|k| desired.frontends.get(k)) {
            addrs.extend(fe.backends.iter().chain(&fe.retained));
        }
        for ip in changes.local_endpoints {
            addrs.extend(self.users.at(*ip));
        }
        for addr in &addrs {
            let Some(wanted) = self.wanted_backend(addr, desired) else {
                continue;
            };
            let written = self
                .backend_ids
                .get(addr)
                .is_some_and(|id| self.backends.get(&id) == Some(&wanted));
            if !written {
                scope.extend(self.users.of(addr));
            }
        }
        for key in &scope {
            if let Some(id) = self.rev_nat_ids.get(key) {
                self.loose.rev_nat.insert(id);
            }
        }
        let report = self.run(desired, scope, false);
        self.repack_after(false, &report);
        report
    }

    /// The phases of one sync over `scope` (see [`SyncState::scope`]).
    fn run(
        &mut self,
        desired: &DesiredState,
        scope: BTreeSet<FrontendKey>,
        full: bool,
    ) -> SyncReport {
        self.backend_ids.begin_sync();
        self.rev_nat_ids.begin_sync();
        let mut s = SyncState {
            order: capacity_order(desired, &scope),
            scope,
            full,
            ..SyncState::default()
        };

        // Make (update.rs).
        self.update_backends(desired, &mut s);
        self.plan_targets(desired, &mut s);
        self.update_rev_nat(desired, &mut s);
        self.prune_reused_affinity(desired, &mut s);
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
        self.delete_unused_backends(&mut s);

        let out = s.out;
        self.loose = out.retry;
        self.unfinished = out.failed;
        self.unfinished.extend(out.unfinished);
        for addr in &out.unwritten {
            self.unfinished.extend(self.users.of(addr));
        }
        self.synced = true;
        let report = out.report;
        if !report.errors.is_empty() {
            tracing::warn!(
                errors = report.errors.len(),
                "writer: sync incomplete; failed frontends retried next sync"
            );
        }
        tracing::debug!(report = ?report, "writer: sync done");
        report
    }

    /// The entry backend `addr` should have: its state from the frontends
    /// using it, local if its address is a local endpoint. `None` when no
    /// desired frontend uses it.
    fn wanted_backend(&self, addr: &BackendAddr, desired: &DesiredState) -> Option<BackendEntry> {
        let mut state = self.users.state(addr)?;
        if desired.local_endpoints.contains(&addr.addr) {
            state |= proxy_common::backend_state::LOCAL;
        }
        Some(BackendEntry::new(addr, state))
    }

    /// Records slot `slot` (≥ 1) of `key` as programmed naming backend `id`,
    /// or deleted (`None`), keeping `slot_refs`: a backend id no slot names
    /// any more becomes loose.
    fn mirror_slot(&mut self, key: &FrontendKey, slot: u16, id: Option<u32>) {
        let old = match id {
            Some(id) => {
                *self.slot_refs.entry(id).or_default() += 1;
                self.frontends
                    .entry(*key)
                    .or_default()
                    .slots
                    .insert(slot, id)
            }
            None => self
                .frontends
                .get_mut(key)
                .and_then(|e| e.slots.remove(&slot)),
        };
        if let Some(old) = old {
            if let Some(n) = self.slot_refs.get_mut(&old) {
                *n -= 1;
                if *n == 0 {
                    self.slot_refs.remove(&old);
                    self.loose.backends.insert(old);
                }
            }
        }
    }

    /// Records slot 0 of `key` as programmed with `value`, or deleted
    /// (`None`), keeping `slot0_by_rev`: the reverse-NAT ids it named and
    /// names become loose.
    fn mirror_slot0(&mut self, key: &FrontendKey, value: Option<SvcValue>) {
        let old = match value {
            Some(v) => {
                if v.affinity_timeout_s > 0 {
                    self.affinity_ids.insert(v.rev_nat_id);
                }
                self.slot0_by_rev
                    .entry(v.rev_nat_id)
                    .or_default()
                    .insert(*key);
                if v.host_alias() != 0 {
                    self.alias_by_rev
                        .entry(v.host_alias())
                        .or_default()
                        .insert(*key);
                }
                self.loose.rev_nat.insert(v.rev_nat_id);
                self.frontends.entry(*key).or_default().slot0.replace(v)
            }
            None => self.frontends.get_mut(key).and_then(|e| e.slot0.take()),
        };
        if let Some(old) = old {
            self.loose.rev_nat.insert(old.rev_nat_id);
            let alias = old.host_alias();
            if alias != 0 && value.map(|v| v.host_alias()) != Some(alias) {
                self.loose.rev_nat.insert(alias);
                if let Some(keys) = self.alias_by_rev.get_mut(&alias) {
                    keys.remove(key);
                    if keys.is_empty() {
                        self.alias_by_rev.remove(&alias);
                    }
                }
            }
            if value.map(|v| v.rev_nat_id) != Some(old.rev_nat_id) {
                if let Some(keys) = self.slot0_by_rev.get_mut(&old.rev_nat_id) {
                    keys.remove(key);
                    if keys.is_empty() {
                        self.slot0_by_rev.remove(&old.rev_nat_id);
                    }
                }
            }
        }
    }

    /// How many programmed slot 0 entries name reverse-NAT id `id`, as
    /// their own or as their host alias.
    fn slot0_refs(&self, id: RevNatId) -> usize {
        self.slot0_by_rev.get(&id).map_or(0, VecSet::len)
            + self.alias_by_rev.get(&id).map_or(0, VecSet::len)
    }

    /// Forgets `key`'s reverse-NAT id (its entry was deleted); the id is
    /// loose (its source ranges, Maglev chunks may be stale).
    fn release_rev_nat(&mut self, key: &FrontendKey) {
        if let Some(id) = self.rev_nat_ids.get(key) {
            self.loose.rev_nat.insert(id);
        }
        self.rev_nat_ids.release(key);
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
            if family::delete_service(&mut self.dp, key, slot).is_ok() {
                out.wrote();
                self.mirror_slot(key, slot, None);
            }
        }
        if !has_slot0 {
            if let Some(id) = self.rev_nat_ids.get(key) {
                if family::delete_rev_nat(&mut self.dp, id, self.rev_nat.get(&id)).is_ok() {
                    out.wrote();
                    self.rev_nat.remove(&id);
                    self.release_rev_nat(key);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ways of finding the scope's frontends and their Services' ages
    /// (a walk for a wide scope, a search each for a narrow one) give the
    /// order every desired frontend has, restricted to the scope.
    #[test]
    fn capacity_order_is_the_whole_order_restricted_to_the_scope() {
        let mut desired = DesiredState::default();
        let keys: Vec<FrontendKey> = (0..200u32)
            .map(|i| FrontendKey {
                addr: IpAddr::from([198, 18, (i / 7) as u8, (i * 37 % 251) as u8]),
                port: 80 + (i % 3) as u16,
                proto: 6,
                scope: (i % 2) as u8,
            })
            .collect();
        for (i, key) in keys.iter().enumerate() {
            // 40 Services of several frontends each; every seventh Service
            // is missing from the order; ages repeat.
            let service = format!("ns/svc-{}", (i * 13) % 40);
            let fe = Frontend {
                service: service.as_str().into(),
                ..Frontend::default()
            };
            desired.frontends.insert(*key, fe);
            if (i * 13) % 40 % 7 != 0 {
                let age = ServiceAge::at_second(((i * 13) % 40 % 5) as i64);
                desired.service_order.insert(service, age);
            }
        }
        let whole = {
            let mut all: Vec<(bool, ServiceAge, &str, FrontendKey)> = desired
                .frontends
                .iter()
                .map(|(k, fe)| {
                    let age = desired.service_order.get(&*fe.service);
                    (
                        age.is_none(),
                        age.copied().unwrap_or_default(),
                        &*fe.service,
                        *k,
                    )
                })
                .collect();
            all.sort();
            all.into_iter().map(|(_, _, _, k)| k).collect::<Vec<_>>()
        };
        let absent = FrontendKey {
            addr: IpAddr::from([198, 19, 0, 1]),
            port: 1,
            proto: 6,
            scope: 0,
        };
        for step in [1, 2, 5, 60, 199] {
            // Every step-th key, and one not desired (a removed frontend).
            let mut scope: BTreeSet<FrontendKey> = keys.iter().step_by(step).copied().collect();
            scope.insert(absent);
            let expected: Vec<FrontendKey> = whole
                .iter()
                .filter(|k| scope.contains(k))
                .copied()
                .collect();
            assert_eq!(capacity_order(&desired, &scope), expected, "every {step}th");
        }
    }
}

//! The in-memory dataplane of the tests: the maps as BTreeMaps with their
//! capacities, a log of the operations, injectable failures, and a check after
//! every operation of the invariant a packet relies on.
use std::collections::{BTreeMap, BTreeSet};

use proxy_common::{
    lb::{alg, maglev_chunks, MaglevChunk, MaglevKey, MAGLEV_CHUNK},
    map_names, svc_flags, Backend4, RevNatId, Svc4Key, Svc6Key, SvcValue,
};

use super::{
    each, BackendEntry, BatchOutcome, Dataplane, DataplaneError, Family, Programmed, RevNatEntry,
    ServiceKey, SourceRange,
};

/// One applied map operation, as recorded by [`InMemory`]: the entry's
/// family is in its key or value, as the [`Dataplane`] takes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    PutBackend(u32, BackendEntry),
    DeleteBackend(Family, u32),
    PutService(ServiceKey, SvcValue),
    DeleteService(ServiceKey),
    PutRevNat(RevNatId, RevNatEntry),
    DeleteRevNat(Family, RevNatId),
    PutSourceRange(RevNatId, SourceRange),
    DeleteSourceRange(RevNatId, SourceRange),
    PutMaglevChunk(MaglevKey),
    DeleteMaglevChunk(MaglevKey),
}

/// A [`Dataplane`] in BTreeMaps, for tests: capacities per map, an op log, an
/// injectable failure, and a check after every operation of the invariant a
/// packet relies on (see [`InMemory::violations`]).
#[derive(Clone, Debug)]
pub struct InMemory {
    state: Programmed,
    cap_services: u32,
    cap_backends: u32,
    cap_rev_nat: u32,
    ops: Vec<Op>,
    violations: Vec<String>,
    /// Operations to let through before failing `fail_count` of them.
    fail_skip: usize,
    fail_count: usize,
    /// Affinity prunes to fail before they succeed again.
    fail_prunes: usize,
    /// Every affinity prune that took effect: (reverse-NAT id, kept backends).
    prunes: Vec<(RevNatId, BTreeSet<u32>)>,
    /// Every walk of the affinity maps that took effect: how many map
    /// operations came before it.
    prune_walks: Vec<usize>,
    /// Reverse-NAT ids the affinity maps hold entries of, as
    /// [`Dataplane::affinity_ids`] reports them (set by tests).
    affinity_ids: BTreeSet<RevNatId>,
    /// Whether the invariant is checked after every operation.
    checking: bool,
}

impl Default for InMemory {
    fn default() -> Self {
        use proxy_common::capacity;
        Self::with_capacity(capacity::SERVICES, capacity::BACKENDS, capacity::REV_NAT)
    }
}

impl InMemory {
    pub fn with_capacity(services: u32, backends: u32, rev_nat: u32) -> Self {
        Self {
            state: Programmed::default(),
            cap_services: services,
            cap_backends: backends,
            cap_rev_nat: rev_nat,
            ops: Vec::new(),
            violations: Vec::new(),
            fail_skip: 0,
            fail_count: 0,
            fail_prunes: 0,
            prunes: Vec::new(),
            prune_walks: Vec::new(),
            affinity_ids: BTreeSet::new(),
            checking: true,
        }
    }

    /// Does not check the invariant after operations (for cost
    /// measurements: a delete may otherwise check every frontend).
    pub fn without_checks(mut self) -> Self {
        self.checking = false;
        self
    }

    /// The maps' contents.
    pub fn programmed(&self) -> &Programmed {
        &self.state
    }

    /// Every applied operation, in order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// Returns and clears the op log.
    pub fn take_ops(&mut self) -> Vec<Op> {
        std::mem::take(&mut self.ops)
    }

    /// Invariant violations seen after any operation: a frontend whose count
    /// covers a missing slot, a slot naming a missing backend, a frontend
    /// whose reverse-NAT entry is missing or names another address, or a
    /// Maglev frontend whose table (the generation its slot 0 names) has a
    /// missing chunk or an entry naming a missing backend.
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// Makes the next `n` affinity prunes fail (without effect); 0 cancels.
    pub fn fail_next_prunes(&mut self, n: usize) {
        self.fail_prunes = n;
    }

    /// Every affinity prune that took effect, in order: the frontend's
    /// reverse-NAT id and the backend ids whose entries were kept.
    pub fn prunes(&self) -> &[(RevNatId, BTreeSet<u32>)] {
        &self.prunes
    }

    /// Every walk of the affinity maps ([`Dataplane::prune_affinity`]) that
    /// took effect, as the number of map operations ([`InMemory::ops`])
    /// before it: a sync walks the maps at most twice, whatever its size.
    pub fn prune_walks(&self) -> &[usize] {
        &self.prune_walks
    }

    /// Has the affinity maps hold entries under reverse-NAT ids `ids` (left
    /// by a previous agent), as [`Dataplane::affinity_ids`] reports them.
    pub fn set_affinity_ids(&mut self, ids: impl IntoIterator<Item = RevNatId>) {
        self.affinity_ids = ids.into_iter().collect();
    }

    /// Makes the next `n` operations fail (without effect); 0 cancels.
    pub fn fail_next(&mut self, n: usize) {
        self.fail_after(0, n);
    }

    /// Lets `skip` operations through, then makes the `n` following fail.
    pub fn fail_after(&mut self, skip: usize, n: usize) {
        self.fail_skip = skip;
        self.fail_count = n;
    }

    fn injected(&mut self, map: &'static str, op: &'static str) -> Result<(), DataplaneError> {
        if self.fail_count == 0 {
            return Ok(());
        }
        if self.fail_skip > 0 {
            self.fail_skip -= 1;
            return Ok(());
        }
        self.fail_count -= 1;
        Err(DataplaneError::Op {
            map,
            op,
            reason: "injected failure".into(),
        })
    }

    /// Logs `op` and checks the make-before-break invariant for every slot
    /// 0 `op` may have broken (see [`Check`]): each slot it counts exists and
    /// names a backend that exists, and its reverse-NAT entry exists with
    /// its own address.
    fn record(&mut self, op: Op, check: Check) {
        self.ops.push(op);
        if !self.checking {
            return;
        }
        let slot0s: Vec<(Svc4Key, SvcValue)> = match check {
            Check::Nothing | Check::Frontend(ServiceKey::V6(_)) => Vec::new(),
            Check::Frontend(ServiceKey::V4(key)) => {
                let key = key.with_slot(0);
                self.state
                    .services
                    .get(&key)
                    .map(|v| (key, *v))
                    .into_iter()
                    .collect()
            }
            Check::All => self
                .state
                .services
                .iter()
                .filter(|(k, _)| k.slot == 0)
                .map(|(k, v)| (*k, *v))
                .collect(),
        };
        for (key, value) in &slot0s {
            let (key, value) = (*key, *value);
            for slot in 1..=value.count {
                match self.state.services.get(&key.with_slot(slot)) {
                    None => self.violations.push(format!(
                        "after {op:?}: {key:?} count {} but slot {slot} missing",
                        value.count
                    )),
                    Some(s) if !self.state.backends.contains_key(&s.backend_id) => {
                        self.violations.push(format!(
                            "after {op:?}: {key:?} slot {slot} names missing backend {}",
                            s.backend_id
                        ))
                    }
                    Some(_) => {}
                }
            }
            if let Some(v) = maglev_violation(&self.state, &value) {
                self.violations.push(format!("after {op:?}: {key:?} {v}"));
            }
            match self.state.rev_nat.get(&value.rev_nat_id) {
                Some(r) if r.addr() == key.addr() && r.port() == key.port() => {}
                other => self.violations.push(format!(
                    "after {op:?}: {key:?} rev_nat_id {} has entry {other:?}",
                    value.rev_nat_id
                )),
            }
            let alias = value.host_alias();
            if alias != 0 && !self.state.rev_nat.contains_key(&alias) {
                self.violations.push(format!(
                    "after {op:?}: {key:?} host alias {alias} names no reverse-NAT entry"
                ));
            }
        }
        self.check6(op, check);
    }

    /// [`InMemory::record`]'s check for the IPv6 frontends `check` names.
    fn check6(&mut self, op: Op, check: Check) {
        let slot0s: Vec<(Svc6Key, SvcValue)> = match check {
            Check::Nothing | Check::Frontend(ServiceKey::V4(_)) => Vec::new(),
            Check::Frontend(ServiceKey::V6(key)) => {
                let key = key.with_slot(0);
                self.state
                    .services6
                    .get(&key)
                    .map(|v| (key, *v))
                    .into_iter()
                    .collect()
            }
            Check::All => self
                .state
                .services6
                .iter()
                .filter(|(k, _)| k.slot == 0)
                .map(|(k, v)| (*k, *v))
                .collect(),
        };
        for (key, value) in &slot0s {
            for slot in 1..=value.count {
                match self.state.services6.get(&key.with_slot(slot)) {
                    None => self.violations.push(format!(
                        "after {op:?}: {key:?} count {} but slot {slot} missing",
                        value.count
                    )),
                    Some(s) if !self.state.backends6.contains_key(&s.backend_id) => {
                        self.violations.push(format!(
                            "after {op:?}: {key:?} slot {slot} names missing IPv6 backend {}",
                            s.backend_id
                        ))
                    }
                    Some(_) => {}
                }
            }
            if let Some(v) = maglev_violation6(&self.state, value) {
                self.violations.push(format!("after {op:?}: {key:?} {v}"));
            }
            match self.state.rev_nat6.get(&value.rev_nat_id) {
                Some(r) if r.addr() == key.addr() && r.port() == key.port() => {}
                other => self.violations.push(format!(
                    "after {op:?}: {key:?} rev_nat_id {} has IPv6 entry {other:?}",
                    value.rev_nat_id
                )),
            }
            let alias = value.host_alias();
            if alias != 0 && !self.state.rev_nat6.contains_key(&alias) {
                self.violations.push(format!(
                    "after {op:?}: {key:?} host alias {alias} names no IPv6 reverse-NAT entry"
                ));
            }
        }
    }

    /// A put into one of the capacity-bound maps (`entries` picks it):
    /// the injected failure first, then a full map, then the write.
    fn put_entry<K: Ord, V>(
        &mut self,
        map: &'static str,
        entries: fn(&mut Programmed) -> &mut BTreeMap<K, V>,
        capacity: u32,
        (key, value): (K, V),
        op: Op,
    ) -> Result<(), DataplaneError> {
        self.injected(map, "put")?;
        let entries = entries(&mut self.state);
        if !entries.contains_key(&key) && entries.len() >= capacity as usize {
            return Err(DataplaneError::Full { map, capacity });
        }
        let check = match entries.insert(key, value) {
            None => Check::Nothing,
            Some(_) => Check::All,
        };
        self.record(op, check.or_frontend(&op));
        Ok(())
    }

    /// A delete from one of the capacity-bound maps (`entries` picks it).
    fn delete_entry<K: Ord, V>(
        &mut self,
        map: &'static str,
        entries: fn(&mut Programmed) -> &mut BTreeMap<K, V>,
        key: K,
        op: Op,
    ) -> Result<(), DataplaneError> {
        self.injected(map, "delete")?;
        let check = match entries(&mut self.state).remove(&key) {
            None => Check::Nothing,
            Some(_) => Check::All,
        };
        self.record(op, check.or_frontend(&op));
        Ok(())
    }
}

/// Which slot 0 entries an operation may have broken, so [`InMemory`] checks
/// only those (a full check after every operation would make a test with
/// tens of thousands of frontends quadratic). Adding an entry that was not
/// there breaks nothing; a service entry concerns only its frontend; any
/// other overwrite or delete may concern any frontend.
#[derive(Clone, Copy)]
enum Check {
    Nothing,
    Frontend(ServiceKey),
    All,
}

impl Check {
    /// A service operation checks its own frontend, whatever it replaced.
    fn or_frontend(self, op: &Op) -> Self {
        match op {
            Op::PutService(key, _) | Op::DeleteService(key) => Check::Frontend(*key),
            _ => self,
        }
    }
}

/// What is wrong with the Maglev table slot 0 `value` names, if anything: a
/// Maglev frontend with backends must have every chunk of that generation,
/// each entry a backend that exists.
fn maglev_violation(state: &Programmed, value: &SvcValue) -> Option<String> {
    if svc_flags::algorithm(value.flags) != alg::MAGLEV || value.count == 0 {
        return None;
    }
    if value.maglev_size == 0 {
        return Some("Maglev without a table size".into());
    }
    let generation = u8::from(value.flags & svc_flags::MAGLEV_GEN != 0);
    for chunk in 0..maglev_chunks(value.maglev_size) {
        let key = MaglevKey::new(value.rev_nat_id, generation, chunk as u16);
        let Some(c) = state.maglev.get(&key) else {
            return Some(format!("Maglev chunk {key:?} missing"));
        };
        let entries =
            (value.maglev_size as usize - chunk as usize * MAGLEV_CHUNK).min(MAGLEV_CHUNK);
        if let Some(id) = c.backend_ids[..entries]
            .iter()
            .find(|id| !state.backends.contains_key(id))
        {
            return Some(format!("Maglev chunk {key:?} names missing backend {id}"));
        }
    }
    None
}

/// [`maglev_violation`] for an IPv6 frontend: its table names IPv6 backends.
fn maglev_violation6(state: &Programmed, value: &SvcValue) -> Option<String> {
    let mut as_v4 = Programmed {
        maglev: state.maglev.clone(),
        ..Programmed::default()
    };
    as_v4.backends = state
        .backends6
        .keys()
        .map(|id| (*id, Backend4::default()))
        .collect();
    maglev_violation(&as_v4, value)
}

/// Single operations, each recorded as one [`Op`], in the map of the
/// family its key or value names.
impl InMemory {
    pub fn put_backend(
        &mut self,
        id: u32,
        entry: impl Into<BackendEntry>,
    ) -> Result<(), DataplaneError> {
        let entry = entry.into();
        let (cap, op) = (self.cap_backends, Op::PutBackend(id, entry));
        match entry {
            BackendEntry::V4(b) => {
                self.put_entry(map_names::BACKENDS, |s| &mut s.backends, cap, (id, b), op)
            }
            BackendEntry::V6(b) => {
                self.put_entry(map_names::BACKENDS6, |s| &mut s.backends6, cap, (id, b), op)
            }
        }
    }
    pub fn delete_backend(&mut self, family: Family, id: u32) -> Result<(), DataplaneError> {
        let op = Op::DeleteBackend(family, id);
        match family {
            Family::V4 => self.delete_entry(map_names::BACKENDS, |s| &mut s.backends, id, op),
            Family::V6 => self.delete_entry(map_names::BACKENDS6, |s| &mut s.backends6, id, op),
        }
    }
    pub fn put_service(
        &mut self,
        key: impl Into<ServiceKey>,
        value: SvcValue,
    ) -> Result<(), DataplaneError> {
        let key = key.into();
        let (cap, op) = (self.cap_services, Op::PutService(key, value));
        match key {
            ServiceKey::V4(k) => self.put_entry(
                map_names::SERVICES,
                |s| &mut s.services,
                cap,
                (k, value),
                op,
            ),
            ServiceKey::V6(k) => self.put_entry(
                map_names::SERVICES6,
                |s| &mut s.services6,
                cap,
                (k, value),
                op,
            ),
        }
    }
    pub fn delete_service(&mut self, key: impl Into<ServiceKey>) -> Result<(), DataplaneError> {
        let key = key.into();
        let op = Op::DeleteService(key);
        match key {
            ServiceKey::V4(k) => self.delete_entry(map_names::SERVICES, |s| &mut s.services, k, op),
            ServiceKey::V6(k) => {
                self.delete_entry(map_names::SERVICES6, |s| &mut s.services6, k, op)
            }
        }
    }
    pub fn put_rev_nat(
        &mut self,
        id: RevNatId,
        entry: impl Into<RevNatEntry>,
    ) -> Result<(), DataplaneError> {
        let entry = entry.into();
        let (cap, op) = (self.cap_rev_nat, Op::PutRevNat(id, entry));
        match entry {
            RevNatEntry::V4(r) => {
                self.put_entry(map_names::REV_NAT, |s| &mut s.rev_nat, cap, (id, r), op)
            }
            RevNatEntry::V6(r) => {
                self.put_entry(map_names::REV_NAT6, |s| &mut s.rev_nat6, cap, (id, r), op)
            }
        }
    }
    pub fn delete_rev_nat(&mut self, family: Family, id: RevNatId) -> Result<(), DataplaneError> {
        let op = Op::DeleteRevNat(family, id);
        match family {
            Family::V4 => self.delete_entry(map_names::REV_NAT, |s| &mut s.rev_nat, id, op),
            Family::V6 => self.delete_entry(map_names::REV_NAT6, |s| &mut s.rev_nat6, id, op),
        }
    }
}

impl Dataplane for InMemory {
    fn put_services(&mut self, entries: &[(ServiceKey, SvcValue)]) -> BatchOutcome {
        each(entries, |(k, v)| self.put_service(*k, *v))
    }
    fn delete_services(&mut self, keys: &[ServiceKey]) -> BatchOutcome {
        each(keys, |k| self.delete_service(*k))
    }
    fn put_backends(&mut self, entries: &[(u32, BackendEntry)]) -> BatchOutcome {
        each(entries, |(id, b)| self.put_backend(*id, *b))
    }
    fn delete_backends(&mut self, ids: &[(Family, u32)]) -> BatchOutcome {
        each(ids, |(f, id)| self.delete_backend(*f, *id))
    }
    fn put_rev_nats(&mut self, entries: &[(RevNatId, RevNatEntry)]) -> BatchOutcome {
        each(entries, |(id, r)| self.put_rev_nat(*id, *r))
    }
    fn delete_rev_nats(&mut self, ids: &[(Family, RevNatId)]) -> BatchOutcome {
        each(ids, |(f, id)| self.delete_rev_nat(*f, *id))
    }
    fn prune_affinity(
        &mut self,
        keep: &BTreeMap<RevNatId, BTreeSet<u32>>,
    ) -> Result<usize, DataplaneError> {
        if self.fail_prunes > 0 {
            self.fail_prunes -= 1;
            return Err(DataplaneError::Op {
                map: map_names::AFFINITY,
                op: "prune",
                reason: "injected failure".into(),
            });
        }
        self.prune_walks.push(self.ops.len());
        self.prunes
            .extend(keep.iter().map(|(id, set)| (*id, set.clone())));
        self.affinity_ids
            .retain(|id| !keep.get(id).is_some_and(BTreeSet::is_empty));
        Ok(0)
    }
    fn id_spaces(&self) -> (u32, u32) {
        (self.cap_backends, self.cap_rev_nat)
    }
    fn affinity_ids(&self) -> Result<BTreeSet<RevNatId>, DataplaneError> {
        Ok(self.affinity_ids.clone())
    }
    fn put_maglev_chunk(
        &mut self,
        key: MaglevKey,
        chunk: &MaglevChunk,
    ) -> Result<(), DataplaneError> {
        self.injected(map_names::MAGLEV, "put")?;
        let check = match self.state.maglev.insert(key, *chunk) {
            None => Check::Nothing,
            Some(_) => Check::All,
        };
        self.record(Op::PutMaglevChunk(key), check);
        Ok(())
    }
    fn delete_maglev_chunk(&mut self, key: MaglevKey) -> Result<(), DataplaneError> {
        self.injected(map_names::MAGLEV, "delete")?;
        self.state.maglev.remove(&key);
        self.record(Op::DeleteMaglevChunk(key), Check::All);
        Ok(())
    }
    fn put_source_range(
        &mut self,
        rev_nat_id: RevNatId,
        range: SourceRange,
    ) -> Result<(), DataplaneError> {
        self.injected(map_names::SOURCE_RANGES, "put")?;
        self.state
            .source_ranges
            .entry(rev_nat_id)
            .or_default()
            .insert(range);
        self.record(Op::PutSourceRange(rev_nat_id, range), Check::Nothing);
        Ok(())
    }
    fn delete_source_range(
        &mut self,
        rev_nat_id: RevNatId,
        range: SourceRange,
    ) -> Result<(), DataplaneError> {
        self.injected(map_names::SOURCE_RANGES, "delete")?;
        if let Some(set) = self.state.source_ranges.get_mut(&rev_nat_id) {
            set.remove(&range);
            if set.is_empty() {
                self.state.source_ranges.remove(&rev_nat_id);
            }
        }
        self.record(Op::DeleteSourceRange(rev_nat_id, range), Check::Nothing);
        Ok(())
    }
    fn dump(&self) -> Result<Programmed, DataplaneError> {
        Ok(self.state.clone())
    }
}

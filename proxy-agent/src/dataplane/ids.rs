//! Backend ids and reverse-NAT ids: which id each backend address and each
//! frontend has, and how a free one is found.
//!
//! Both kinds are allocated the same way: round the id space, starting just
//! after the last id handed out, skipping 0 ("unset" in every map) and every
//! id still taken. So an id freed now is reused only after every other one
//! was, and an id that an entry still names is never handed out again (a flow
//! or a slot naming it would reach the wrong backend or frontend). Once a sync
//! found a space full, it stays full for the rest of that sync: the next
//! frontend or backend that needs an id does not scan the space again.
use std::collections::{BTreeMap, BTreeSet};

use proxy_common::RevNatId;

use super::BackendEntry;

use crate::model::{BackendAddr, FrontendKey};

/// Ids `1..=max`, handed out round the space.
#[derive(Debug)]
struct IdSpace {
    max: u32,
    /// Where the next search starts (clamped into `1..=max`).
    next: u32,
    /// Set when the space was found full during this sync.
    exhausted: bool,
}

impl IdSpace {
    fn new(max: u32, next: u32) -> Self {
        Self {
            max,
            next,
            exhausted: false,
        }
    }

    fn step(&self, id: u32) -> u32 {
        if id >= self.max {
            1
        } else {
            id + 1
        }
    }

    /// The first id from `next` on, round the space, that is not `taken`.
    fn allocate(&mut self, taken: impl Fn(u32) -> bool) -> Option<u32> {
        if self.exhausted {
            return None;
        }
        let start = self.next.clamp(1, self.max);
        let mut id = start;
        loop {
            if !taken(id) {
                self.next = self.step(id);
                return Some(id);
            }
            id = self.step(id);
            if id == start {
                self.exhausted = true;
                return None;
            }
        }
    }
}

/// The id after `highest` (the highest id found in adopted maps), or 1.
fn after_u32(highest: Option<u32>) -> u32 {
    highest.map_or(1, |m| m.wrapping_add(1).max(1))
}

/// One backend id per [`BackendAddr`], shared by every frontend using it,
/// never 0, below the backends map's size: ids index the per-backend
/// traffic counters, an array of that size.
#[derive(Debug)]
pub(super) struct BackendIds {
    by_addr: BTreeMap<BackendAddr, u32>,
    space: IdSpace,
}

impl BackendIds {
    /// Rebuilds its map with full nodes ([`crate::vec_set::repack`]).
    pub(super) fn repack(&mut self) {
        crate::vec_set::repack(&mut self.by_addr);
    }

    /// Takes over the ids of programmed `backends`. Two ids for one address
    /// (leftovers): one in `live` (a slot packets may read names it) wins, then
    /// the lowest. `highest`: the highest backend id any entry names; new ids
    /// start after it, so they do not collide with adopted ones. `size`: the
    /// backends map's size (ids are below it).
    pub(super) fn adopt(
        backends: &BTreeMap<u32, BackendEntry>,
        live: &BTreeSet<u32>,
        highest: Option<u32>,
        size: u32,
    ) -> Self {
        let mut by_addr = BTreeMap::new();
        let (used, unused): (Vec<_>, Vec<_>) =
            backends.iter().partition(|(id, _)| live.contains(id));
        for (id, b) in used.into_iter().chain(unused) {
            by_addr.entry(backend_addr(b)).or_insert(*id);
        }
        Self {
            by_addr,
            space: IdSpace::new(size.saturating_sub(1).max(1), after_u32(highest)),
        }
    }

    /// Starts a sync: the space is searched again.
    pub(super) fn begin_sync(&mut self) {
        self.space.exhausted = false;
    }

    pub(super) fn get(&self, addr: &BackendAddr) -> Option<u32> {
        self.by_addr.get(addr).copied()
    }

    pub(super) fn as_map(&self) -> &BTreeMap<BackendAddr, u32> {
        &self.by_addr
    }

    /// How many ids there are.
    pub(super) fn capacity(&self) -> u32 {
        self.space.max
    }

    /// A free backend id: none that is `taken` (in the backends map or named
    /// by a slot). `None` when every id is taken.
    pub(super) fn allocate(&mut self, taken: impl Fn(u32) -> bool) -> Option<u32> {
        self.space.allocate(taken)
    }

    /// Records `id` as the id of `addr` (once its backend entry is written).
    pub(super) fn assign(&mut self, addr: BackendAddr, id: u32) {
        self.by_addr.insert(addr, id);
    }

    /// Forgets the id of `backend`'s address, if it is still `id` (its entry
    /// was deleted).
    pub(super) fn release(&mut self, backend: &BackendEntry, id: u32) {
        let addr = backend_addr(backend);
        if self.by_addr.get(&addr) == Some(&id) {
            self.by_addr.remove(&addr);
        }
    }
}

/// The address of backend entry `b`.
pub(super) fn backend_addr(b: &BackendEntry) -> BackendAddr {
    b.addr()
}

/// One reverse-NAT id per [`FrontendKey`] (its owner), never 0, below the
/// reverse-NAT map's size (ids index the per-frontend arrays of that size)
/// and at most [`proxy_common::REV_NAT_ID_MAX`].
#[derive(Debug)]
pub(super) struct RevNatIds {
    by_key: BTreeMap<FrontendKey, RevNatId>,
    owner: BTreeMap<RevNatId, FrontendKey>,
    space: IdSpace,
}

impl RevNatIds {
    /// Rebuilds its maps with full nodes ([`crate::vec_set::repack`]).
    pub(super) fn repack(&mut self) {
        crate::vec_set::repack(&mut self.by_key);
        crate::vec_set::repack(&mut self.owner);
    }

    /// Takes over the reverse-NAT ids that programmed slot 0 entries name, in
    /// the order given: the first frontend naming an id owns it; 0 is no id.
    /// `highest`: the highest reverse-NAT id any entry names. `size`: the
    /// reverse-NAT map's size.
    pub(super) fn adopt(
        slot0s: impl IntoIterator<Item = (FrontendKey, RevNatId)>,
        highest: Option<RevNatId>,
        size: u32,
    ) -> Self {
        let mut by_key = BTreeMap::new();
        let mut owner = BTreeMap::new();
        for (key, id) in slot0s {
            if id != 0 && !owner.contains_key(&id) {
                by_key.insert(key, id);
                owner.insert(id, key);
            }
        }
        let max = size
            .saturating_sub(1)
            .clamp(1, proxy_common::REV_NAT_ID_MAX);
        Self {
            by_key,
            owner,
            space: IdSpace::new(max, after_u32(highest)),
        }
    }

    /// Starts a sync: the space is searched again.
    pub(super) fn begin_sync(&mut self) {
        self.space.exhausted = false;
    }

    pub(super) fn get(&self, key: &FrontendKey) -> Option<RevNatId> {
        self.by_key.get(key).copied()
    }

    /// How many ids there are.
    pub(super) fn capacity(&self) -> u32 {
        self.space.max
    }

    /// The frontend that owns `id`.
    pub(super) fn owner(&self, id: RevNatId) -> Option<&FrontendKey> {
        self.owner.get(&id)
    }

    pub(super) fn as_map(&self) -> &BTreeMap<FrontendKey, RevNatId> {
        &self.by_key
    }

    /// A free reverse-NAT id: owned by no frontend and not `taken` (in the
    /// reverse-NAT map). `None` when every id is.
    pub(super) fn allocate(&mut self, taken: impl Fn(RevNatId) -> bool) -> Option<RevNatId> {
        let owner = &self.owner;
        self.space
            .allocate(|id| taken(id) || owner.contains_key(&id))
    }

    /// Records `id` as owned by `key` (once its reverse-NAT entry is written).
    pub(super) fn assign(&mut self, key: FrontendKey, id: RevNatId) {
        self.by_key.insert(key, id);
        self.owner.insert(id, key);
    }

    /// Forgets `key`'s id (its reverse-NAT entry was deleted).
    pub(super) fn release(&mut self, key: &FrontendKey) {
        if let Some(id) = self.by_key.remove(key) {
            self.owner.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::net::Ipv4Addr;

    use proxy_common::{backend_state, capacity, IPPROTO_TCP, SCOPE_INTERNAL};

    use super::*;

    fn addr(last: u8) -> BackendAddr {
        BackendAddr {
            addr: Ipv4Addr::new(198, 18, 1, last).into(),
            port: 8080,
            proto: IPPROTO_TCP,
        }
    }

    fn backend(last: u8) -> BackendEntry {
        BackendEntry::new(&addr(last), backend_state::ACTIVE)
    }

    fn key(last: u8) -> FrontendKey {
        FrontendKey {
            addr: Ipv4Addr::new(198, 19, 0, last).into(),
            port: 80,
            proto: IPPROTO_TCP,
            scope: SCOPE_INTERNAL,
        }
    }

    fn fresh_backend_ids() -> BackendIds {
        BackendIds::adopt(&BTreeMap::new(), &BTreeSet::new(), None, capacity::BACKENDS)
    }

    #[test]
    fn ids_are_allocated_in_order_from_1_skipping_taken_ones() {
        let mut ids = fresh_backend_ids();
        let taken = BTreeSet::from([2, 3]);
        let got: Vec<u32> = (0..3)
            .map(|_| ids.allocate(|id| taken.contains(&id)).unwrap())
            .collect();
        assert_eq!(got, [1, 4, 5]);

        let mut rev = RevNatIds::adopt([], None, capacity::REV_NAT);
        assert_eq!(rev.allocate(|_| false), Some(1));
        assert_eq!(rev.allocate(|_| false), Some(2));
    }

    #[test]
    fn a_released_id_is_reused_only_after_going_round_the_space() {
        let mut space = IdSpace::new(4, 1);
        let mut in_use = BTreeSet::new();
        for _ in 0..3 {
            in_use.insert(space.allocate(|id| in_use.contains(&id)).unwrap());
        }
        assert_eq!(in_use, BTreeSet::from([1, 2, 3]));
        in_use.remove(&2);
        assert_eq!(space.allocate(|id| in_use.contains(&id)), Some(4));
        in_use.insert(4);
        assert_eq!(
            space.allocate(|id| in_use.contains(&id)),
            Some(2),
            "after the top of the space, the search goes round to the freed id"
        );
    }

    #[test]
    fn released_backend_and_reverse_nat_ids_are_not_reused_at_once() {
        let mut ids = fresh_backend_ids();
        let b = backend(1);
        let first = ids.allocate(|_| false).unwrap();
        ids.assign(addr(1), first);
        ids.release(&b, first);
        assert_eq!(ids.get(&addr(1)), None);
        assert_eq!(ids.allocate(|_| false), Some(first + 1));

        let mut rev = RevNatIds::adopt([], None, capacity::REV_NAT);
        let id = rev.allocate(|_| false).unwrap();
        rev.assign(key(1), id);
        assert_eq!(rev.owner(id), Some(&key(1)));
        rev.release(&key(1));
        assert_eq!((rev.get(&key(1)), rev.owner(id)), (None, None));
        assert_eq!(rev.allocate(|_| false), Some(id + 1));
    }

    #[test]
    fn release_forgets_an_address_only_if_it_still_has_that_id() {
        let mut ids = fresh_backend_ids();
        ids.assign(addr(1), 5);
        ids.release(&backend(1), 4);
        assert_eq!(ids.get(&addr(1)), Some(5));
        ids.release(&backend(1), 5);
        assert_eq!(ids.get(&addr(1)), None);
    }

    #[test]
    fn owned_reverse_nat_ids_are_never_handed_out() {
        let mut rev = RevNatIds::adopt([(key(1), 1), (key(2), 3)], Some(3), capacity::REV_NAT);
        // The search starts after the highest adopted id and goes round.
        let map = BTreeSet::from([4, 5]);
        assert_eq!(rev.allocate(|id| map.contains(&id) || id > 6), Some(6));
        assert_eq!(rev.allocate(|id| map.contains(&id) || id > 6), Some(2));
    }

    #[test]
    fn reverse_nat_ids_go_past_65535_and_wrap_below_the_map_size_never_0() {
        // More than 65,535 frontends: ids are 32 bits (layout `_V2`).
        let size = 200_000;
        let mut rev = RevNatIds::adopt([(key(1), 65_535)], Some(65_535), size);
        assert_eq!(rev.allocate(|_| false), Some(65_536));
        let mut rev = RevNatIds::adopt([(key(1), size - 2)], Some(size - 2), size);
        assert_eq!(
            rev.allocate(|_| false),
            Some(size - 1),
            "the last index of the per-frontend arrays"
        );
        assert_eq!(rev.allocate(|_| false), Some(1));
        let mut huge = RevNatIds::adopt([], Some(u32::MAX - 1), u32::MAX);
        assert_eq!(
            huge.allocate(|_| false),
            Some(proxy_common::REV_NAT_ID_MAX),
            "never past the ids the datapath can carry"
        );
    }

    #[test]
    fn backend_ids_stay_below_the_size_of_the_traffic_counters() {
        for size in [capacity::BACKENDS, 400_000] {
            let mut ids =
                BackendIds::adopt(&BTreeMap::new(), &BTreeSet::new(), Some(u32::MAX - 1), size);
            assert_eq!(
                ids.allocate(|_| false),
                Some(size - 1),
                "an adopted id beyond the space starts the search at its top"
            );
            assert_eq!(ids.allocate(|_| false), Some(1));
        }
    }

    #[test]
    fn a_full_space_is_not_searched_again_until_the_next_sync() {
        let mut ids = fresh_backend_ids();
        let probes = Cell::new(0u32);
        let all_taken = |_| {
            probes.set(probes.get() + 1);
            true
        };
        assert_eq!(ids.allocate(all_taken), None);
        assert_eq!(
            probes.get(),
            capacity::BACKENDS - 1,
            "every id looked at once"
        );
        assert_eq!(ids.allocate(all_taken), None);
        assert_eq!(probes.get(), capacity::BACKENDS - 1, "not searched again");
        ids.begin_sync();
        assert_eq!(ids.allocate(|id| id != 7), Some(7));

        let mut rev = RevNatIds::adopt([], None, capacity::REV_NAT);
        assert_eq!(rev.allocate(|_| true), None);
        assert_eq!(rev.allocate(|_| false), None, "exhausted for this sync");
        rev.begin_sync();
        assert_eq!(rev.allocate(|_| false), Some(1));
    }

    #[test]
    fn adopt_prefers_the_live_id_of_an_address_and_starts_after_the_highest() {
        let backends = BTreeMap::from([(3, backend(1)), (9, backend(1)), (4, backend(2))]);
        let mut ids = BackendIds::adopt(
            &backends,
            &BTreeSet::from([9]),
            Some(12),
            capacity::BACKENDS,
        );
        assert_eq!(ids.get(&addr(1)), Some(9), "the id a slot uses wins");
        assert_eq!(ids.get(&addr(2)), Some(4));
        assert_eq!(ids.allocate(|_| false), Some(13));

        let dead = BackendIds::adopt(&backends, &BTreeSet::new(), Some(9), capacity::BACKENDS);
        assert_eq!(dead.get(&addr(1)), Some(3), "else the lowest");

        let rev = RevNatIds::adopt(
            [(key(1), 0), (key(2), 5), (key(3), 5)],
            Some(5),
            capacity::REV_NAT,
        );
        assert_eq!(rev.get(&key(1)), None, "0 is no id");
        assert_eq!(
            rev.get(&key(2)),
            Some(5),
            "the first frontend naming an id owns it"
        );
        assert_eq!(rev.get(&key(3)), None);
        assert_eq!(rev.as_map().len(), 1);
    }
}

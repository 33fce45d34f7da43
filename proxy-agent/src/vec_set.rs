//! [`VecSet`] and [`VecMap`]: ordered sets and maps in one sorted vector,
//! for the many small collections the model and the writer keep per object
//! (the Services claiming a frontend, a Service's slices, the frontends
//! naming a backend, a Service's claims). Most hold one to three entries;
//! a `BTreeSet` or `BTreeMap` allocates a whole node of eleven for the first
//! (over 500 bytes for a `(namespace, name)` key), which at 50,000 Services
//! was tens of MiB of empty slots. Lookups are a binary search, insertions
//! and removals shift the tail: linear in the entries, which suits the small
//! sizes these hold. A large one (a thousand Services claiming one address)
//! pays a shift of its entries per insertion, a copy of a few kB.
//!
//! [`repack`] is for the large maps: it rebuilds a `BTreeMap` with full
//! nodes after a start has filled it in key order.
use std::borrow::Borrow;

use smallvec::SmallVec;

/// An ordered set in a sorted vector (see the module docs). One entry is
/// held in place, without an allocation: most of these sets have one (the
/// Service claiming an address, a Service's slice, the frontend using a
/// backend).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct VecSet<T>(SmallVec<[T; 1]>);

impl<T> Default for VecSet<T> {
    fn default() -> Self {
        Self(SmallVec::new())
    }
}

impl<T: Ord> VecSet<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `value`; false if it was there.
    pub fn insert(&mut self, value: T) -> bool {
        match self.0.binary_search(&value) {
            Ok(_) => false,
            Err(i) => {
                grow_exact_small(&mut self.0);
                self.0.insert(i, value);
                true
            }
        }
    }

    /// Removes `value`; false if it was not there.
    pub fn remove<Q: Ord + ?Sized>(&mut self, value: &Q) -> bool
    where
        T: Borrow<Q>,
    {
        match self.0.binary_search_by(|e| e.borrow().cmp(value)) {
            Ok(i) => {
                self.0.remove(i);
                true
            }
            Err(_) => false,
        }
    }

    pub fn contains<Q: Ord + ?Sized>(&self, value: &Q) -> bool
    where
        T: Borrow<Q>,
    {
        self.0.binary_search_by(|e| e.borrow().cmp(value)).is_ok()
    }
}

impl<T> VecSet<T> {
    /// In order.
    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The least.
    pub fn first(&self) -> Option<&T> {
        self.0.first()
    }
}

impl<'a, T> IntoIterator for &'a VecSet<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl<T: Ord> FromIterator<T> for VecSet<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut v: Vec<T> = iter.into_iter().collect();
        v.sort();
        v.dedup();
        v.shrink_to_fit();
        Self(SmallVec::from_vec(v))
    }
}

/// An ordered map in a sorted vector of pairs (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VecMap<K, V>(Vec<(K, V)>);

impl<K, V> Default for VecMap<K, V> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<K: Ord, V> VecMap<K, V> {
    pub fn new() -> Self {
        Self::default()
    }

    fn find(&self, key: &K) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.cmp(key))
    }

    pub fn get(&self, key: &K) -> Option<&V> {
        self.find(key).ok().map(|i| &self.0[i].1)
    }

    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.find(key).ok().map(|i| &mut self.0[i].1)
    }

    /// The value of `key`, made with `make` if it has none.
    pub fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        let i = match self.find(&key) {
            Ok(i) => i,
            Err(i) => {
                grow_exact(&mut self.0);
                self.0.insert(i, (key, make()));
                i
            }
        };
        &mut self.0[i].1
    }

    /// Sets `key` to `value`; returns its previous value.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        match self.find(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                grow_exact(&mut self.0);
                self.0.insert(i, (key, value));
                None
            }
        }
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        self.find(key).ok().map(|i| self.0.remove(i).1)
    }

    /// The values, in key order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.0.iter().map(|(_, v)| v)
    }

    /// The keys, in order.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.0.iter().map(|(k, _)| k)
    }

    /// The entries, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// The values, in key order, to change.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.0.iter_mut().map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: Ord, V> std::ops::Index<&K> for VecMap<K, V> {
    type Output = V;
    fn index(&self, key: &K) -> &V {
        self.get(key).expect("key in VecMap")
    }
}

/// `map`, rebuilt from its entries in order, with full nodes. A `BTreeMap`
/// filled in key order (every object at once, at a start) keeps its nodes
/// about half full; built from a sorted list, it fills them.
pub fn repack<K: Ord, V>(map: &mut std::collections::BTreeMap<K, V>) {
    *map = std::mem::take(map).into_iter().collect();
}

/// Room for one more entry, exactly, while a vector is small: `Vec`'s
/// first push reserves four, which for most of these collections is three
/// empty slots kept for good.
fn grow_exact<T>(v: &mut Vec<T>) {
    if v.len() == v.capacity() && v.len() < 4 {
        v.reserve_exact(1);
    }
}

/// [`grow_exact`] for a set's vector: past its one entry in place, room for
/// one more at a time while it is small.
fn grow_exact_small<T>(v: &mut SmallVec<[T; 1]>) {
    if v.len() == v.capacity() && v.len() < 4 {
        v.reserve_exact(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    /// A seeded sequence of inserts and removals leaves a `VecSet` and a
    /// `BTreeSet` equal after every step, and a `VecMap` equal to a
    /// `BTreeMap`.
    #[test]
    fn behaves_as_the_btree_collections_it_replaces() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut set = VecSet::new();
        let mut reference = BTreeSet::new();
        let mut map = VecMap::new();
        let mut reference_map = BTreeMap::new();
        for _ in 0..5_000 {
            let value = (next() % 40) as u32;
            if next() % 3 == 0 {
                assert_eq!(set.remove(&value), reference.remove(&value));
                assert_eq!(map.remove(&value), reference_map.remove(&value));
            } else if next() % 4 == 0 {
                let v = (next() % 7) as u32;
                assert_eq!(map.insert(value, v), reference_map.insert(value, v));
            } else {
                assert_eq!(set.insert(value), reference.insert(value));
                let n = map.get_or_insert_with(value, || 0u32);
                *n += 1;
                *reference_map.entry(value).or_insert(0u32) += 1;
            }
            assert!(set.iter().eq(reference.iter()));
            assert_eq!(set.len(), reference.len());
            assert_eq!(set.first(), reference.first());
            assert_eq!(set.contains(&value), reference.contains(&value));
            assert!(map.iter().eq(reference_map.iter()));
            assert!(map.values().eq(reference_map.values()));
            assert_eq!(map.get(&value), reference_map.get(&value));
        }
        let collected: VecSet<u32> = [5, 1, 5, 3].into_iter().collect();
        assert!(collected.iter().eq([1, 3, 5].iter()));
    }

    #[test]
    fn a_single_entry_allocates_one_slot() {
        let mut set = VecSet::new();
        set.insert((String::from("default"), String::from("web")));
        assert!(!set.0.spilled(), "one entry in place");
        set.insert((String::from("default"), String::from("x")));
        assert_eq!(set.0.capacity(), 2);
        let mut map = VecMap::new();
        map.get_or_insert_with(1u8, || 2u8);
        assert_eq!(map.0.capacity(), 1);
    }
}

//! Which desired frontends use each backend address: the index that lets a
//! sync decide a backend's state, whether it may be deleted, and which
//! frontends a changed backend concerns, without a walk over every frontend.
//! Both [`Writer::sync`](super::Writer::sync) and
//! [`Writer::sync_changed`](super::Writer::sync_changed) keep it equal to the
//! desired state they were given.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use proxy_common::backend_state;

use crate::model::{BackendAddr, DesiredState, Frontend, FrontendKey};
use crate::vec_set::VecSet;

/// The desired frontends naming one backend address, each with whether it
/// balances new flows over it (`Frontend::backends`, true) or keeps it for
/// flows already using it (`Frontend::retained`, false). A frontend has an
/// address in one list or the other, never both.
type AddrUsers = VecSet<(FrontendKey, bool)>;

/// One desired frontend's `backends` then `retained`, in one allocation,
/// and where `retained` starts.
#[derive(Debug, PartialEq, Eq)]
struct Lists {
    addrs: Box<[BackendAddr]>,
    retained_from: usize,
}

impl Lists {
    fn of(fe: &Frontend) -> Self {
        Self {
            addrs: fe.backends.iter().chain(&fe.retained).copied().collect(),
            retained_from: fe.backends.len(),
        }
    }

    /// Each address, with whether it is active (not retained).
    fn each(&self) -> impl Iterator<Item = (BackendAddr, bool)> + '_ {
        self.addrs
            .iter()
            .enumerate()
            .map(|(i, a)| (*a, i < self.retained_from))
    }

    fn is(&self, fe: &Frontend) -> bool {
        self.addrs[..self.retained_from] == fe.backends[..]
            && self.addrs[self.retained_from..] == fe.retained[..]
    }
}

/// The backend lists of every desired frontend, indexed by backend address.
#[derive(Debug, Default)]
pub(super) struct Users {
    by_addr: BTreeMap<BackendAddr, AddrUsers>,
    /// Every desired frontend's `backends` and `retained`, as indexed.
    lists: BTreeMap<FrontendKey, Lists>,
}

impl Users {
    /// Rebuilds its maps with full nodes ([`crate::vec_set::repack`]).
    pub(super) fn repack(&mut self) {
        crate::vec_set::repack(&mut self.by_addr);
        crate::vec_set::repack(&mut self.lists);
    }

    /// Every frontend indexed (desired at the last sync).
    pub(super) fn keys(&self) -> impl Iterator<Item = &FrontendKey> {
        self.lists.keys()
    }

    /// [`Users::set`] for every frontend of `scope`, as `desired` has it;
    /// returns the addresses whose users changed.
    pub(super) fn update(
        &mut self,
        scope: &BTreeSet<FrontendKey>,
        desired: &DesiredState,
    ) -> BTreeSet<BackendAddr> {
        let mut changed = BTreeSet::new();
        for key in scope {
            self.set(key, desired.frontends.get(key), &mut changed);
        }
        changed
    }

    /// Indexes `fe` as the desired frontend `key` (`None`: not desired), and
    /// adds to `changed` every address whose users this changes.
    pub(super) fn set(
        &mut self,
        key: &FrontendKey,
        fe: Option<&Frontend>,
        changed: &mut BTreeSet<BackendAddr>,
    ) {
        match (self.lists.get(key), fe) {
            (None, None) => return,
            (Some(old), Some(fe)) if old.is(fe) => return,
            _ => {}
        }
        if let Some(old) = self.lists.remove(key) {
            for (addr, active) in old.each() {
                changed.insert(addr);
                let Some(u) = self.by_addr.get_mut(&addr) else {
                    continue;
                };
                u.remove(&(*key, active));
                if u.is_empty() {
                    self.by_addr.remove(&addr);
                }
            }
        }
        let Some(fe) = fe else {
            return;
        };
        let lists = Lists::of(fe);
        for (addr, active) in lists.each() {
            changed.insert(addr);
            self.by_addr.entry(addr).or_default().insert((*key, active));
        }
        self.lists.insert(*key, lists);
    }

    /// The state bits a backend entry for `addr` gets from the frontends
    /// using it (before [`backend_state::LOCAL`]): active if any balances
    /// over it, else terminating if any retains it; `None` if none uses it.
    pub(super) fn state(&self, addr: &BackendAddr) -> Option<u8> {
        let u = self.by_addr.get(addr)?;
        Some(if u.iter().any(|(_, active)| *active) {
            backend_state::ACTIVE
        } else {
            backend_state::TERMINATING
        })
    }

    /// Whether a desired frontend retains `addr`.
    pub(super) fn is_retained(&self, addr: &BackendAddr) -> bool {
        self.by_addr
            .get(addr)
            .is_some_and(|u| u.iter().any(|(_, active)| !*active))
    }

    /// Every desired frontend naming `addr`.
    pub(super) fn of(&self, addr: &BackendAddr) -> impl Iterator<Item = &FrontendKey> {
        self.by_addr
            .get(addr)
            .into_iter()
            .flat_map(|u| u.iter().map(|(k, _)| k))
    }

    /// Every address in use with IP `ip` (any port and protocol).
    pub(super) fn at(&self, ip: IpAddr) -> impl Iterator<Item = &BackendAddr> {
        let lo = BackendAddr {
            addr: ip,
            port: 0,
            proto: 0,
        };
        let hi = BackendAddr {
            addr: ip,
            port: u16::MAX,
            proto: u8::MAX,
        };
        self.by_addr.range(lo..=hi).map(|(a, _)| a)
    }
}

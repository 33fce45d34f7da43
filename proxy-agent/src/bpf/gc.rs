//! Conntrack garbage collection: the judgement of one entry
//! ([`entry_expired`], point lookups only), and [`ConntrackGc`], which
//! walks the pinned map in bounded rounds on a thread of its own, so that a
//! large or churning conntrack map never stalls syncs, health or shutdown.

use std::os::fd::{AsFd, AsRawFd};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use super::*;
use proxy_common::{conntrack::CtEntry, Ct6Key, Ct6Value, RevNatId};

/// A conntrack key of either family: what the collector needs of it.
trait CtKey: aya::Pod + Default {
    /// The conntrack value and reverse-NAT entry of its family.
    type Value: aya::Pod + CtEntry;
    type Rev: aya::Pod;
    fn dir(&self) -> u8;
    fn proto(&self) -> u8;
    fn service_of_reply(&self, v: &Self::Value, rev: &Self::Rev) -> Self;
}

impl CtKey for Ct4Key {
    type Value = Ct4Value;
    type Rev = RevNat4;
    fn dir(&self) -> u8 {
        self.dir
    }
    fn proto(&self) -> u8 {
        self.proto
    }
    fn service_of_reply(&self, v: &Ct4Value, rev: &RevNat4) -> Self {
        Ct4Key::service_of_reply(self, v, rev)
    }
}

impl CtKey for Ct6Key {
    type Value = Ct6Value;
    type Rev = RevNat6;
    fn dir(&self) -> u8 {
        self.dir
    }
    fn proto(&self) -> u8 {
        self.proto
    }
    fn service_of_reply(&self, v: &Ct6Value, rev: &RevNat6) -> Self {
        Ct6Key::service_of_reply(self, v, rev)
    }
}

/// Whether entry `k` (`v`) has expired at `now_ns`: a SERVICE entry idle
/// for longer than its timeout (per protocol and TCP state, as the
/// datapath judges it); a REPLY entry whose SERVICE entry is gone or
/// expired, or whose frontend is gone — unless it is younger than a second
/// (its flow may be being created right now).
fn entry_expired<K: CtKey>(
    conntrack: &HashMap<MapData, K, K::Value>,
    rev_nat: &HashMap<MapData, RevNatId, K::Rev>,
    cfg: &Config,
    k: &K,
    v: &K::Value,
    now_ns: u64,
) -> bool {
    if k.dir() == proxy_common::ct_dir::SERVICE {
        return !conntrack::alive(cfg, k.proto(), v, now_ns);
    }
    let Ok(r) = rev_nat.get(&v.rev_nat_id(), 0) else {
        return true;
    };
    if now_ns.saturating_sub(v.last_seen_ns()) < conntrack::NSEC_PER_SEC {
        return false;
    }
    match conntrack.get(&k.service_of_reply(v, &r), 0) {
        Ok(s) => !conntrack::alive(cfg, k.proto(), &s, now_ns),
        Err(_) => true,
    }
}

/// What one pass of conntrack garbage collection did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtGcReport {
    pub scanned: usize,
    pub expired: usize,
}

/// What one [`ConntrackGc::round`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GcRound {
    /// Entries looked at (at most the round's budget).
    pub scanned: usize,
    /// Entries deleted.
    pub expired: usize,
    /// The walk reached the end of the map: the next round starts a pass.
    pub pass_done: bool,
}

/// Conntrack garbage collection over the pinned maps, in rounds of a
/// bounded number of entries: each round goes on where the last one
/// stopped (the next key, fetched before the current entry may be
/// deleted), so one round's cost does not grow with the map; a pass whose
/// next key the LRU evicted between rounds ends there. A pass walks the
/// IPv4 map, then the IPv6 one. The datapath's configuration (its
/// timeouts) is read from the pinned config map at each pass's start, as
/// the programs read it; without one (none written, or of another layout)
/// nothing is deleted.
pub struct ConntrackGc {
    v4: FamilyGc<Ct4Key>,
    v6: FamilyGc<Ct6Key>,
    /// The IPv4 map's walk of this pass is done; the IPv6 one's goes on.
    v4_done: bool,
}

/// The collector of one family's conntrack map.
struct FamilyGc<K: CtKey> {
    conntrack: HashMap<MapData, K, K::Value>,
    /// The conntrack map's descriptor (owned by `conntrack`), for
    /// `BPF_MAP_GET_NEXT_KEY` from a key of ours.
    conntrack_fd: i32,
    rev_nat: HashMap<MapData, RevNatId, K::Rev>,
    config: Array<MapData, Config>,
    cfg: Option<Config>,
    /// The next key to look at; `None`: the next round starts a pass.
    next: Option<K>,
}

impl ConntrackGc {
    /// Opens the maps an agent pinned under `pin_dir`.
    pub fn open(pin_dir: &Path) -> Result<Self, BpfError> {
        Ok(Self {
            v4: FamilyGc::open(pin_dir, map_names::CONNTRACK, map_names::REV_NAT)?,
            v6: FamilyGc::open(pin_dir, map_names::CONNTRACK6, map_names::REV_NAT6)?,
            v4_done: false,
        })
    }

    /// Looks at up to `budget` entries from where the last round stopped
    /// (the IPv4 map, then the IPv6 one), deleting the expired ones at time
    /// `now_ns`.
    pub fn round(&mut self, now_ns: u64, budget: usize) -> GcRound {
        let mut out = GcRound::default();
        if !self.v4_done {
            out = self.v4.round(now_ns, budget);
            if !out.pass_done {
                return out;
            }
            self.v4_done = true;
        }
        let r = self.v6.round(now_ns, budget.saturating_sub(out.scanned));
        out.scanned += r.scanned;
        out.expired += r.expired;
        out.pass_done = r.pass_done;
        if r.pass_done {
            self.v4_done = false;
        }
        out
    }
}

impl<K: CtKey> FamilyGc<K> {
    fn open(pin_dir: &Path, ct: &'static str, rev: &'static str) -> Result<Self, BpfError> {
        use aya::maps::Map;
        let open =
            |name: &'static str| MapData::from_pin(pin_dir.join(name)).map_err(map_err(name));
        let ct_map = open(ct)?;
        let conntrack_fd = ct_map.fd().as_fd().as_raw_fd();
        Ok(Self {
            conntrack: HashMap::try_from(Map::LruHashMap(ct_map)).map_err(map_err(ct))?,
            conntrack_fd,
            rev_nat: HashMap::try_from(Map::HashMap(open(rev)?)).map_err(map_err(rev))?,
            config: Array::try_from(Map::Array(open(map_names::CONFIG)?))
                .map_err(map_err(map_names::CONFIG))?,
            cfg: None,
            next: None,
        })
    }

    /// See [`ConntrackGc::round`], over this family's map.
    fn round(&mut self, now_ns: u64, budget: usize) -> GcRound {
        let mut out = GcRound::default();
        let fd = self.conntrack_fd;
        let mut key = match self.next.take() {
            // Where the last round stopped, if that entry is still there.
            Some(k) if self.conntrack.get(&k, 0).is_ok() => Some(k),
            // The datapath's LRU removed it meanwhile: the walk cannot go
            // on from there (a missing key's next is the map's first), and
            // starting over could go on for ever under steady eviction. The
            // pass ends; the next one starts after the interval.
            Some(_) => {
                out.pass_done = true;
                return out;
            }
            None => {
                // A pass starts: the datapath's timeouts as they are now.
                self.cfg = self
                    .config
                    .get(&0, 0)
                    .ok()
                    .filter(|c| c.layout_version == proxy_common::MAP_LAYOUT_VERSION);
                next_key(fd, None)
            }
        };
        let Some(cfg) = self.cfg else {
            // No configuration of this layout written yet (an unwritten
            // array slot reads as zeros: every timeout 0, so every entry
            // would look expired): nothing is judged.
            out.pass_done = true;
            return out;
        };
        while out.scanned < budget {
            let Some(k) = key else {
                out.pass_done = true;
                return out;
            };
            // Fetched first: the next key of a deleted one is the map's first.
            key = next_key(fd, Some(&k));
            out.scanned += 1;
            let Ok(v) = self.conntrack.get(&k, 0) else {
                continue;
            };
            if entry_expired(&self.conntrack, &self.rev_nat, &cfg, &k, &v, now_ns)
                && self.conntrack.remove(&k).is_ok()
            {
                out.expired += 1;
            }
        }
        self.next = key;
        out.pass_done = key.is_none();
        out
    }
}

impl ConntrackGc {
    /// Runs passes every `interval` on a thread of its own, in rounds of
    /// [`GC_ROUND`] entries with a pause between them, until `stop` is
    /// dropped or sent to. Logs each pass that deleted entries.
    pub fn spawn(mut self, interval: Duration) -> (Sender<()>, std::thread::JoinHandle<()>) {
        let (stop, rx) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::Builder::new()
            .name("conntrack-gc".into())
            .spawn(move || self.run(interval, &rx))
            .expect("spawn the conntrack GC thread");
        (stop, handle)
    }

    fn run(&mut self, interval: Duration, stop: &Receiver<()>) {
        let stopped =
            |wait: Duration| !matches!(stop.recv_timeout(wait), Err(RecvTimeoutError::Timeout));
        loop {
            if stopped(interval) {
                return;
            }
            let mut pass = CtGcReport::default();
            loop {
                let r = self.round(ktime_ns(), GC_ROUND);
                pass.scanned += r.scanned;
                pass.expired += r.expired;
                if r.pass_done {
                    break;
                }
                if stopped(GC_PAUSE) {
                    return;
                }
            }
            if pass.expired > 0 {
                tracing::info!(
                    scanned = pass.scanned,
                    expired = pass.expired,
                    "conntrack garbage-collected"
                );
            }
        }
    }
}

/// Deletes the UDP flows whose frontend and backend are one of `pairs`
/// (reverse-NAT id, backend id), in both families' pinned conntrack maps
/// under `pin_dir`; returns how many. kube-proxy's conntrack cleanup: when
/// an endpoint leaves a Service's UDP port, the flows it carried for that
/// port are forgotten, so their next datagram picks one of the port's
/// backends again. The datapath cannot see that by itself when the
/// endpoint still backs another Service (backends are shared by address).
/// Only SERVICE entries go; each one's REPLY entry is then collected by
/// [`ConntrackGc`] (its SERVICE entry gone).
pub fn delete_udp_flows(
    pin_dir: &Path,
    pairs: &std::collections::BTreeSet<(RevNatId, u32)>,
) -> Result<usize, BpfError> {
    if pairs.is_empty() {
        return Ok(0);
    }
    let v4 = delete_family::<Ct4Key>(pin_dir, map_names::CONNTRACK, pairs)?;
    let v6 = delete_family::<Ct6Key>(pin_dir, map_names::CONNTRACK6, pairs)?;
    Ok(v4 + v6)
}

fn delete_family<K: CtKey>(
    pin_dir: &Path,
    name: &'static str,
    pairs: &std::collections::BTreeSet<(RevNatId, u32)>,
) -> Result<usize, BpfError> {
    use proxy_common::conntrack::CtEntry as _;
    let data = MapData::from_pin(pin_dir.join(name)).map_err(map_err(name))?;
    let fd = data.fd().as_fd().as_raw_fd();
    // Bounded: a key evicted under the walk sends it back to the map's
    // first key, so it stops after twice the map's capacity in steps.
    let max_steps = data
        .info()
        .map_or(usize::MAX, |i| (i.max_entries() as usize).saturating_mul(2));
    let mut map: HashMap<MapData, K, K::Value> =
        HashMap::try_from(aya::maps::Map::LruHashMap(data)).map_err(map_err(name))?;
    let mut deleted = 0;
    let mut key = next_key::<K>(fd, None);
    let mut steps = 0;
    while let Some(k) = key {
        steps += 1;
        if steps > max_steps {
            break;
        }
        // Fetched first: the next key of a deleted one is the map's first.
        key = next_key(fd, Some(&k));
        if k.dir() != proxy_common::ct_dir::SERVICE || k.proto() != proxy_common::IPPROTO_UDP {
            continue;
        }
        let Ok(v) = map.get(&k, 0) else {
            continue;
        };
        if pairs.contains(&(v.rev_nat_id(), v.backend_id())) && map.remove(&k).is_ok() {
            deleted += 1;
        }
    }
    Ok(deleted)
}

/// Entries one round of the agent's collector looks at.
pub const GC_ROUND: usize = 4_096;
/// The pause between two rounds of a pass.
pub const GC_PAUSE: Duration = Duration::from_millis(5);

/// `BPF_MAP_GET_NEXT_KEY`: the key after `key` in the map of `fd` (the
/// first key when `key` is `None` or no longer in the map); `None` at the
/// end or on an error.
fn next_key<K: CtKey>(fd: i32, key: Option<&K>) -> Option<K> {
    const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
    let mut next = K::default();
    // union bpf_attr for map element commands: map_fd, (pad), key, next_key.
    let mut attr = [0u64; 4];
    attr[0] = fd as u32 as u64;
    attr[1] = key.map_or(0, |k| k as *const K as u64);
    attr[2] = &mut next as *mut K as u64;
    // SAFETY: the bpf syscall reads a key of the map's key size (a `K`: the
    // map's key type) from `attr[1]` (a live key, or none) and writes one
    // to `attr[2]` (ours).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_GET_NEXT_KEY,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr) as u32,
        )
    };
    (rc == 0).then_some(next)
}

//! Pinned maps checked on adoption: before the object is loaded, every map
//! an earlier agent pinned is compared with what this build expects (the
//! object's definition, with the configured sizes). aya reuses a pin by name
//! without looking at it, so without this a changed size setting would never
//! take effect and a map of another layout under the same name would be
//! handed to the programs.
//!
//! | mismatch | map | what happens |
//! |---|---|---|
//! | `max_entries` only | state: services, backends, reverse NAT, conntrack, Maglev, interfaces, affinity, socket reverse NAT | a new map of the new size; the entries copied (those that fit); a log line with the figures |
//! | anything | caches and counters: stats, config, fragments, source ranges, traffic, round-robin, reject limit | a new empty map; a log line (the agent writes config and source ranges again at its first sync) |
//! | type, key or value size | state | an error naming the map, the field, what this build expects and what is pinned |
//!
//! The old map is pinned as `<name>_OLD` while the object loads (bpffs has no
//! rename to names with a dot: pinned there, then unpinned under its name), so a failed load puts
//! it back (and a crash in between is repaired at the next start);
//! its entries are copied once the new map exists, then its pin is removed.

use aya::maps::{MapInfo, MapType};

use super::*;

/// What a map is: the fields the kernel reports for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapDef {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
}

impl MapDef {
    /// The first field that differs from `found`: (name, expected, found).
    fn first_difference(&self, found: &MapDef) -> Option<(&'static str, u32, u32)> {
        [
            ("type", self.map_type, found.map_type),
            ("key size", self.key_size, found.key_size),
            ("value size", self.value_size, found.value_size),
            ("max entries", self.max_entries, found.max_entries),
        ]
        .into_iter()
        .find(|(_, e, f)| e != f)
    }
}

/// Suffix of an old map's pin while it is being replaced.
pub const OLD_SUFFIX: &str = "_OLD";

/// Every map of the object as this build creates it: the object's
/// definitions, with the sizes of `sizes` (the agent's configuration).
pub fn expected_maps(sizes: MapSizes) -> Result<BTreeMap<&'static str, MapDef>, BpfError> {
    let obj = aya_obj::Object::parse(EBPF_OBJECT)
        .map_err(|e| BpfError::Load(aya::EbpfError::ParseError(e)))?;
    let configured = sizes.configured();
    let mut out = BTreeMap::new();
    for name in map_names::ALL {
        let m = obj.maps.get(name).ok_or(BpfError::MissingMap(name))?;
        let max_entries = configured
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(m.max_entries(), |(_, size)| *size);
        out.insert(
            name,
            MapDef {
                map_type: m.map_type(),
                key_size: m.key_size(),
                value_size: m.value_size(),
                max_entries,
            },
        );
    }
    Ok(out)
}

/// What a pinned map is.
pub fn pinned_def(path: &Path) -> Result<MapDef, MapError> {
    let info = MapInfo::from_pin(path)?;
    let map_type = info.map_type().map_or(u32::MAX, |t: MapType| t as u32);
    Ok(MapDef {
        map_type,
        key_size: info.key_size(),
        value_size: info.value_size(),
        max_entries: info.max_entries(),
    })
}

/// Whether the entries of `name` are state worth carrying over to a map of
/// another size (flows, ids, tables), rather than a cache or counters.
fn is_state(name: &str) -> bool {
    [
        map_names::SERVICES,
        map_names::BACKENDS,
        map_names::REV_NAT,
        map_names::CONNTRACK,
        map_names::MAGLEV,
        map_names::IFACES,
        map_names::AFFINITY,
        map_names::SOCK_REVNAT,
        map_names::SERVICES6,
        map_names::BACKENDS6,
        map_names::REV_NAT6,
        map_names::CONNTRACK6,
        map_names::AFFINITY6,
        map_names::SOCK_REVNAT6,
    ]
    .contains(&name)
}

/// A pinned map set aside to be replaced by one of the expected size.
pub(super) struct Replaced {
    name: &'static str,
    old_pin: PathBuf,
    found: MapDef,
    /// Copy the entries into the new map (state), or start empty (a cache).
    copy: bool,
}

/// Checks every pinned map under `pin_dir` against `expected`: a map that
/// fits is left to be adopted; one to replace is renamed aside
/// (pinned as `<name>`[`OLD_SUFFIX`]); one that can be neither is an error, and nothing is
/// changed. A `<name>_OLD` left by an agent that stopped half-way is put back
/// first (or dropped if the new map was already pinned).
pub(super) fn check(
    pin_dir: &Path,
    expected: &BTreeMap<&'static str, MapDef>,
) -> Result<Vec<Replaced>, BpfError> {
    let mut plan = Vec::new();
    for (name, want) in expected {
        let pin = pin_dir.join(name);
        let old_pin = pin_dir.join(format!("{name}{OLD_SUFFIX}"));
        if old_pin.exists() {
            if pin.exists() {
                let _ = std::fs::remove_file(&old_pin);
            } else {
                move_pin(name, &old_pin, &pin)?;
            }
        }
        if !pin.exists() {
            continue;
        }
        let found = pinned_def(&pin).map_err(|source| BpfError::Pinned {
            name,
            path: pin.clone(),
            source,
        })?;
        let Some((field, e, f)) = want.first_difference(&found) else {
            continue;
        };
        let copy = is_state(name);
        if copy && field != "max entries" {
            return Err(BpfError::PinMismatch {
                name,
                path: pin,
                field,
                expected: e,
                found: f,
            });
        }
        plan.push(Replaced {
            name,
            old_pin,
            found,
            copy,
        });
    }
    for r in &plan {
        move_pin(r.name, &pin_dir.join(r.name), &r.old_pin)?;
    }
    Ok(plan)
}

/// Moves a map's pin from `from` to `to`. bpffs has no rename: the map is
/// pinned at `to` as well, then unpinned at `from`, so it is never unpinned.
fn move_pin(name: &'static str, from: &Path, to: &Path) -> Result<(), BpfError> {
    let data = MapData::from_pin(from).map_err(|source| BpfError::Pinned {
        name,
        path: from.to_path_buf(),
        source,
    })?;
    data.pin(to).map_err(|e| BpfError::PinDir {
        path: to.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })?;
    std::fs::remove_file(from).map_err(|source| BpfError::PinDir {
        path: from.to_path_buf(),
        source,
    })
}

/// Puts the maps `check` set aside back (the object did not load).
pub(super) fn restore(pin_dir: &Path, plan: &[Replaced]) {
    for r in plan {
        let pin = pin_dir.join(r.name);
        let _ = std::fs::remove_file(&pin);
        if let Err(e) = move_pin(r.name, &r.old_pin, &pin) {
            tracing::error!(map = r.name, error = %e, "cannot put a pinned map back");
        }
    }
}

/// Copies (or drops) the entries of each replaced map into the new one the
/// object created, then removes the old pin. Returns, per map, (copied,
/// dropped) entries.
pub(super) fn finish(
    ebpf: &mut Ebpf,
    plan: Vec<Replaced>,
    expected: &BTreeMap<&'static str, MapDef>,
) -> Result<Vec<(&'static str, usize, usize)>, BpfError> {
    let mut out = Vec::new();
    for r in plan {
        let want = expected[r.name];
        let (copied, dropped) = if r.copy {
            let old = MapData::from_pin(&r.old_pin).map_err(|source| BpfError::Pinned {
                name: r.name,
                path: r.old_pin.clone(),
                source,
            })?;
            let new = ebpf.map_mut(r.name).ok_or(BpfError::MissingMap(r.name))?;
            copy_entries(r.name, old, new).map_err(map_err(r.name))?
        } else {
            (0, 0)
        };
        std::fs::remove_file(&r.old_pin).map_err(|source| BpfError::PinDir {
            path: r.old_pin.clone(),
            source,
        })?;
        if r.copy {
            tracing::info!(
                map = r.name,
                from = r.found.max_entries,
                to = want.max_entries,
                copied,
                dropped,
                "pinned map resized to the configured size; its entries copied"
            );
        } else {
            tracing::warn!(
                map = r.name,
                pinned = ?r.found,
                expected = ?want,
                "pinned map differs from this build's; a cache or counters, so it starts empty"
            );
        }
        out.push((r.name, copied, dropped));
    }
    Ok(out)
}

/// Copies every entry of `old` into `new` (same key and value types): as
/// many as fit. Returns (copied, dropped).
fn copy_entries(
    name: &'static str,
    old: MapData,
    new: &mut aya::maps::Map,
) -> Result<(usize, usize), MapError> {
    use aya::maps::Map;
    fn copy<K: aya::Pod, V: aya::Pod>(old: Map, new: &mut Map) -> Result<(usize, usize), MapError> {
        let old: HashMap<MapData, K, V> = HashMap::try_from(old)?;
        let mut new: HashMap<&mut MapData, K, V> = HashMap::try_from(new)?;
        let (mut copied, mut dropped) = (0, 0);
        for kv in old.iter() {
            let (k, v) = kv?;
            match new.insert(k, v, 0) {
                Ok(()) => copied += 1,
                // A smaller map: what does not fit is dropped (E2BIG).
                Err(_) => dropped += 1,
            }
        }
        Ok((copied, dropped))
    }
    let lru = |d| Map::LruHashMap(d);
    let hash = |d| Map::HashMap(d);
    match name {
        n if n == map_names::SERVICES => copy::<Svc4Key, SvcValue>(hash(old), new),
        n if n == map_names::BACKENDS => copy::<u32, Backend4>(hash(old), new),
        n if n == map_names::REV_NAT => copy::<RevNatId, RevNat4>(hash(old), new),
        n if n == map_names::CONNTRACK => copy::<Ct4Key, Ct4Value>(lru(old), new),
        n if n == map_names::MAGLEV => copy::<MaglevKey, MaglevChunk>(hash(old), new),
        n if n == map_names::IFACES => copy::<u32, Iface>(hash(old), new),
        n if n == map_names::AFFINITY => copy::<Affinity4Key, AffinityValue>(lru(old), new),
        n if n == map_names::SOCK_REVNAT => {
            copy::<proxy_common::SockRevNat4Key, proxy_common::SockRevNat4Value>(lru(old), new)
        }
        n if n == map_names::SERVICES6 => copy::<Svc6Key, SvcValue>(hash(old), new),
        n if n == map_names::BACKENDS6 => copy::<u32, Backend6>(hash(old), new),
        n if n == map_names::REV_NAT6 => copy::<RevNatId, RevNat6>(hash(old), new),
        n if n == map_names::CONNTRACK6 => copy::<Ct6Key, Ct6Value>(lru(old), new),
        n if n == map_names::AFFINITY6 => copy::<Affinity6Key, AffinityValue>(lru(old), new),
        n if n == map_names::SOCK_REVNAT6 => {
            copy::<proxy_common::SockRevNat6Key, proxy_common::SockRevNat6Value>(lru(old), new)
        }
        _ => Ok((0, 0)),
    }
}

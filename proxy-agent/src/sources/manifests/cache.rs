//! What was read before and is still valid: each file's objects, kept while
//! its stamp and content hash say it has not changed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::duplicates::{duplicate_error, read_twice};
use super::{file_error, list_files, load_str, ManifestError};

/// What identifies a file's content without reading it: modification time,
/// size, inode (a file replaced by a rename is another inode) and change
/// time (a content change that restores the modification time, as `cp -p`
/// or `rsync -t --inplace` do, still moves it; so does a `chmod`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    modified: Option<std::time::SystemTime>,
    len: u64,
    ino: u64,
    changed: (i64, i64),
}

impl Stamp {
    fn of(path: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(Self {
            modified: m.modified().ok(),
            len: m.len(),
            ino: m.ino(),
            changed: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// Kind (as in [`Kind`]) and key of an object a file holds.
pub(super) type FileKey = (crate::objects::Kind, crate::objects::ObjectKey);

/// One file as last read.
struct CachedFile {
    stamp: Option<Stamp>,
    /// A hash of its content, and when it was read: a file modified within
    /// a second of its read may have changed again without its time
    /// moving (file times are coarse), so its content is compared (git's
    /// "racy clean" rule).
    hash: u64,
    read_at: std::time::SystemTime,
    /// Its objects, the first of each key (later ones are duplicates).
    objects: std::collections::BTreeMap<FileKey, crate::objects::Object>,
    /// Objects its errors name: kept as they were while the error lasts.
    named_in_errors: BTreeSet<FileKey>,
}

/// The manifests, read again only where a file changed, as object changes:
/// a file whose modification time, size and inode are those of its last
/// read is not read again. An object two files hold is the first file's (in
/// reading order), as [`load_paths`] has it; an object whose document turned
/// bad keeps its last good version (no change is reported for it) until
/// the error is gone, as [`keep_last_good`] does.
#[derive(Default)]
pub struct FileCache {
    files: Vec<(PathBuf, CachedFile)>,
    /// The next refresh compares every file's content, whatever its stamp.
    compare_all: bool,
}

impl FileCache {
    /// Makes the next [`FileCache::refresh`] compare every file's content
    /// with what was read, whatever the file's times say: the periodic
    /// safety net against a change no stamp showed.
    pub fn compare_all_next(&mut self) {
        self.compare_all = true;
    }

    /// Reads what changed under `paths` since the last call (everything the
    /// first time). Returns the changes and the errors of the files read
    /// again (and of objects two files hold, where that concerns a changed
    /// file).
    pub fn refresh(
        &mut self,
        paths: &[PathBuf],
    ) -> (Vec<crate::objects::Change>, Vec<ManifestError>) {
        use crate::objects::{Change, Kind, Object};
        let (list, mut errors) = list_files(paths);
        let mut old: std::collections::BTreeMap<PathBuf, CachedFile> =
            std::mem::take(&mut self.files).into_iter().collect();
        let mut affected: BTreeSet<FileKey> = BTreeSet::new();
        let mut read_again: BTreeSet<PathBuf> = BTreeSet::new();
        for path in list {
            let stamp = Stamp::of(&path);
            if self.compare_all {
                // The periodic safety net: every file's content compared.
                if let Some(c) = old.get_mut(&path) {
                    c.read_at = std::time::SystemTime::UNIX_EPOCH;
                }
            }
            let cached = old.remove(&path);
            if let Some(c) = &cached {
                let settled = c
                    .stamp
                    .and_then(|s| s.modified)
                    .is_some_and(|m| m + std::time::Duration::from_secs(1) < c.read_at);
                if stamp.is_some() && c.stamp == stamp && settled {
                    self.files.extend(cached.map(|c| (path, c)));
                    continue;
                }
            }
            let read_at = std::time::SystemTime::now();
            // A file read before has its content compared first, through a
            // small buffer: one that did not change (a large file read again
            // because it was read within a second of being written, or by
            // the periodic resync, which compares every file) costs no copy
            // of itself, 35 MB for 50,000 Services.
            let cached = match cached {
                Some(mut c) if file_hash(&path).is_ok_and(|h| h == c.hash) => {
                    c.stamp = stamp;
                    c.read_at = read_at;
                    self.files.push((path, c));
                    continue;
                }
                other => other,
            };
            let mut one: Vec<Object> = Vec::new();
            let mut file_errors = Vec::new();
            let text = std::fs::read_to_string(&path);
            // A file that could not be read is read again at every refresh
            // (a chmod may fix it without its content changing).
            let stamp = if text.is_ok() { stamp } else { None };
            let hash = text.as_ref().map_or(0, |t| content_hash(t.as_bytes()));
            if let Some(mut c) = cached {
                // Unchanged after all: changed back between the two reads,
                // or the first could not hash it.
                if text.is_ok() && c.hash == hash {
                    c.stamp = stamp;
                    c.read_at = read_at;
                    self.files.push((path, c));
                    continue;
                }
                affected.extend(c.objects.into_keys());
                affected.extend(c.named_in_errors);
            }
            match text {
                Ok(text) => load_str(&path, &text, &mut one, &mut file_errors),
                Err(e) => file_errors.push(file_error(&path, format!("cannot read file: {e}"))),
            }
            // As `load_paths` dedupes: of the objects of one key, the first
            // read is kept, each later one reported. Sorted by key, stably
            // (one sort, keys compared once, no set of names to build).
            let mut keyed: Vec<(FileKey, Object)> =
                one.into_iter().map(|o| ((o.kind(), o.key()), o)).collect();
            keyed.sort_by(|a, b| a.0.cmp(&b.0));
            let mut unique: Vec<(FileKey, Object)> = Vec::with_capacity(keyed.len());
            for (key, o) in keyed {
                match unique.last() {
                    Some((last, _)) if *last == key => {
                        let (kind, (namespace, name)) = &key;
                        file_errors.push(read_twice(kind.name(), namespace, name, &path));
                    }
                    _ => unique.push((key, o)),
                }
            }
            // Already sorted: built without sorting again.
            let objects: std::collections::BTreeMap<FileKey, Object> = unique.into_iter().collect();
            let named_in_errors: BTreeSet<FileKey> = file_errors
                .iter()
                .filter(|e| !e.duplicate)
                .filter_map(|e| {
                    let o = e.object.as_ref()?;
                    let kind = Kind::from_name(o.kind.as_deref()?)?;
                    let ns = match kind {
                        Kind::Node => String::new(),
                        _ => o.namespace.clone().unwrap_or_else(|| "default".into()),
                    };
                    Some((kind, (ns.into(), o.name.as_deref()?.into())))
                })
                .collect();
            affected.extend(objects.keys().cloned());
            errors.extend(file_errors);
            read_again.insert(path.clone());
            self.files.push((
                path,
                CachedFile {
                    stamp,
                    hash,
                    read_at,
                    objects,
                    named_in_errors,
                },
            ));
        }
        self.compare_all = false;
        // Files gone, with the objects their bad documents kept.
        for (_, cached) in old {
            affected.extend(cached.objects.into_keys());
            affected.extend(cached.named_in_errors);
        }
        let mut changes = Vec::new();
        for key in affected {
            let mut holders = self
                .files
                .iter()
                .filter(|(_, f)| f.objects.contains_key(&key));
            match holders.next() {
                Some((first, f)) => {
                    for (other, _) in holders.filter(|(p, _)| read_again.contains(p)) {
                        errors.push(duplicate_error(&key, first, other));
                    }
                    changes.push(Change::Applied(f.objects[&key].clone()));
                }
                None if self
                    .files
                    .iter()
                    .any(|(_, f)| f.named_in_errors.contains(&key)) => {}
                None => changes.push(Change::Deleted(key.0, key.1)),
            }
        }
        (changes, errors)
    }
}

/// The pieces a file's content is hashed in: the same whether it is hashed
/// from its text or read piece by piece ([`file_hash`]).
const HASH_PIECE: usize = 64 * 1024;

/// A hasher for file contents: foldhash, fixed seed. With std's SipHash the
/// first change after 50,000 Services were written (their 35 MB file
/// compared again) took 8.9 ms, with foldhash 4.6 ms (bench, N = 50,000).
fn content_hasher() -> impl std::hash::Hasher {
    use std::hash::BuildHasher;
    foldhash::quality::FixedState::default().build_hasher()
}

/// A hash of a file's content, `bytes`.
fn content_hash(bytes: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = content_hasher();
    for piece in bytes.chunks(HASH_PIECE) {
        h.write(piece);
    }
    h.finish()
}

/// [`content_hash`] of the file at `path`, read through one buffer of
/// [`HASH_PIECE`] bytes.
fn file_hash(path: &Path) -> std::io::Result<u64> {
    use std::hash::Hasher;
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut h = content_hasher();
    let mut buf = vec![0u8; HASH_PIECE];
    loop {
        // Filled whole (a read may return less), as `chunks` cuts the text.
        let mut len = 0;
        while len < buf.len() {
            match file.read(&mut buf[len..]) {
                Ok(0) => break,
                Ok(n) => len += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if len == 0 {
            return Ok(h.finish());
        }
        h.write(&buf[..len]);
        if len < buf.len() {
            return Ok(h.finish());
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    /// A file's content hashes the same read piece by piece as from its
    /// text, at sizes around the piece's, and differently once one byte
    /// differs: the cache compares the two.
    #[test]
    fn a_file_hashes_as_its_text() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.yaml");
        for len in [
            0,
            1,
            HASH_PIECE - 1,
            HASH_PIECE,
            HASH_PIECE + 1,
            3 * HASH_PIECE + 5,
        ] {
            let text: Vec<u8> = (0..len).map(|i| b"apiVersion: v1\n"[i % 15]).collect();
            std::fs::write(&path, &text).unwrap();
            assert_eq!(
                file_hash(&path).unwrap(),
                content_hash(&text),
                "{len} bytes"
            );
            if len > 0 {
                let mut other = text.clone();
                other[len - 1] ^= 1;
                assert_ne!(content_hash(&other), content_hash(&text), "{len} bytes");
            }
        }
        assert!(file_hash(&dir.path().join("gone.yaml")).is_err());
    }
}

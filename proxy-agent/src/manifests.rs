//! The `manifests` source of desired state: standard Kubernetes YAML (or JSON)
//! files holding Services, EndpointSlices, Pods and Nodes, read into a
//! [`Snapshot`] and watched for changes.
//!
//! Loading is forgiving: a bad document yields a [`ManifestError`] naming the
//! file, the document and the object, and is skipped; every other document and
//! file still loads. Pods with a pod IP stand in for the EndpointSlice
//! controller (see [`crate::model::endpoint_slices_from_pods`]).
use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use notify::{EventKind, RecursiveMode, Watcher};
use serde::de::DeserializeOwned;
use yaml_serde::Value;

use crate::objects::{Object, Snapshot};

/// Where loading puts each object it read.
pub trait Sink: Default + Send {
    fn service(&mut self, svc: Service);
    fn endpoint_slice(&mut self, slice: EndpointSlice);
    fn pod(&mut self, pod: Pod);
    fn node(&mut self, node: Node);
    /// Adds what `other` holds, after what this one holds.
    fn append(&mut self, other: Self);
}

impl Sink for Snapshot {
    fn service(&mut self, svc: Service) {
        self.services.push(svc);
    }
    fn endpoint_slice(&mut self, slice: EndpointSlice) {
        self.endpoint_slices.push(slice);
    }
    fn pod(&mut self, pod: Pod) {
        self.pods.push(pod);
    }
    fn node(&mut self, node: Node) {
        self.nodes.push(node);
    }
    fn append(&mut self, other: Self) {
        self.services.extend(other.services);
        self.endpoint_slices.extend(other.endpoint_slices);
        self.pods.extend(other.pods);
        self.nodes.extend(other.nodes);
    }
}

/// Objects as the model takes them: a Service or an EndpointSlice is made
/// compact as soon as it is read, so a file of many holds one full object
/// at a time, not all of them.
impl Sink for Vec<Object> {
    fn service(&mut self, svc: Service) {
        self.push(Object::from(&svc));
    }
    fn endpoint_slice(&mut self, slice: EndpointSlice) {
        self.push(Object::from(&slice));
    }
    fn pod(&mut self, pod: Pod) {
        self.push(Object::from(pod));
    }
    fn node(&mut self, node: Node) {
        self.push(Object::from(node));
    }
    fn append(&mut self, mut other: Self) {
        Vec::append(self, &mut other);
    }
}

/// The object a bad document describes, as far as it could be read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObjectRef {
    pub kind: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.as_deref().unwrap_or("object"))?;
        match (&self.namespace, &self.name) {
            (Some(ns), Some(name)) => write!(f, " {ns}/{name}"),
            (None, Some(name)) => write!(f, " {name}"),
            _ => Ok(()),
        }
    }
}

/// A file, a document or an object that could not be used. Display:
/// `deploy/examples/x.yaml: document 2 (Service default/web): spec.ports[0].port: invalid type: ...`.
#[derive(Debug, thiserror::Error)]
#[error("{}: {}{}", .file.display(), place(*.document, .object.as_ref()), .message)]
pub struct ManifestError {
    /// The file (or directory) concerned.
    pub file: PathBuf,
    /// 1-based index of the YAML document in the file, when the error is about one.
    pub document: Option<usize>,
    /// The object, when its kind or name could be read.
    pub object: Option<ObjectRef>,
    pub message: String,
    /// A warning rather than an error: the object is a second copy of one
    /// already read (same kind, namespace and name), which stays in use.
    pub duplicate: bool,
}

fn place(document: Option<usize>, object: Option<&ObjectRef>) -> String {
    match (document, object) {
        (Some(d), Some(o)) => format!("document {d} ({o}): "),
        (Some(d), None) => format!("document {d}: "),
        (None, Some(o)) => format!("{o}: "),
        (None, None) => String::new(),
    }
}

/// File extensions read from a directory.
const EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

fn has_manifest_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x)))
}

/// Loads every path: a file, or a directory whose `*.yaml`, `*.yml` and `*.json`
/// files are read (non-recursively, sorted by name). Returns what loaded and an
/// error per file, document or object that did not.
///
/// An object whose kind, namespace and name were already read (in another file
/// or earlier in the same one) is a duplicate: the first one read, in the order
/// of `paths`, the sorted file names and the documents, is kept, the later one
/// is dropped with a warning naming both files (`duplicate` set), and nothing
/// else is disturbed. An API server would hold only one of them; which one a
/// `kubectl apply` of the files would leave depends on the order it is run in,
/// so the agent picks the one order it can repeat.
pub fn load_paths(paths: &[PathBuf]) -> (Snapshot, Vec<ManifestError>) {
    let mut snapshot = Snapshot::default();
    let mut seen = Seen::default();
    let (files, mut errors) = list_files(paths);
    for file in files {
        let mut one = Snapshot::default();
        load_file(&file, &mut one, &mut errors);
        seen.merge(&file, one, &mut snapshot, &mut errors);
    }
    (snapshot, errors)
}

/// The files `paths` name, in reading order: a file, or a directory's
/// manifest files sorted by name; and an error per directory that cannot be
/// read.
fn list_files(paths: &[PathBuf]) -> (Vec<PathBuf>, Vec<ManifestError>) {
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for path in paths {
        if path.is_dir() {
            let entries = match std::fs::read_dir(path) {
                Ok(entries) => entries,
                Err(e) => {
                    errors.push(file_error(path, format!("cannot read directory: {e}")));
                    continue;
                }
            };
            let mut files: Vec<PathBuf> = entries
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.is_file() && has_manifest_extension(p))
                .collect();
            files.sort();
            out.extend(files);
        } else {
            out.push(path.clone());
        }
    }
    (out, errors)
}

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
type FileKey = (crate::objects::Kind, crate::objects::ObjectKey);

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

/// The warning for an object `other` holds too, `first` having it already.
fn duplicate_error(key: &FileKey, first: &Path, other: &Path) -> ManifestError {
    let (namespace, name) = &key.1;
    duplicate_of(key.0.name(), namespace, name, other, first)
}

fn file_error(path: &Path, message: String) -> ManifestError {
    ManifestError {
        file: path.to_path_buf(),
        document: None,
        object: None,
        message,
        duplicate: false,
    }
}

/// The file each (kind, namespace, name) read so far came from.
#[derive(Default)]
struct Seen(std::collections::BTreeMap<(&'static str, String, String), PathBuf>);

impl Seen {
    /// Appends `one` (every object of `file`) to `snapshot`, minus the
    /// objects already read, each reported as a duplicate.
    fn merge(
        &mut self,
        file: &Path,
        one: Snapshot,
        snapshot: &mut Snapshot,
        errors: &mut Vec<ManifestError>,
    ) {
        self.merge_kind(
            "Service",
            file,
            one.services,
            &mut snapshot.services,
            errors,
        );
        self.merge_kind(
            "EndpointSlice",
            file,
            one.endpoint_slices,
            &mut snapshot.endpoint_slices,
            errors,
        );
        self.merge_kind("Pod", file, one.pods, &mut snapshot.pods, errors);
        self.merge_kind("Node", file, one.nodes, &mut snapshot.nodes, errors);
    }

    fn merge_kind<T>(
        &mut self,
        kind: &'static str,
        file: &Path,
        objects: Vec<T>,
        into: &mut Vec<T>,
        errors: &mut Vec<ManifestError>,
    ) where
        T: k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
    {
        for object in objects {
            let meta = object.metadata();
            // Nodes have no namespace; the others were defaulted on load.
            let namespace = meta.namespace.as_deref().unwrap_or_default();
            let name = meta.name.as_deref().unwrap_or_default();
            if self.first(kind, namespace, name, file, errors) {
                into.push(object);
            }
        }
    }

    /// Whether (`kind`, `namespace`, `name`) is read for the first time
    /// (from `file`); if not, the duplicate is reported.
    fn first(
        &mut self,
        kind: &'static str,
        namespace: &str,
        name: &str,
        file: &Path,
        errors: &mut Vec<ManifestError>,
    ) -> bool {
        let key = (kind, namespace.to_string(), name.to_string());
        match self.0.get(&key) {
            Some(first) => {
                errors.push(duplicate_of(kind, namespace, name, file, first));
                false
            }
            None => {
                self.0.insert(key, file.to_path_buf());
                true
            }
        }
    }
}

/// The warning for a duplicate (`kind`, `namespace`, `name`) read from
/// `file`, the one used having been read from `first`.
fn duplicate_of(
    kind: &str,
    namespace: &str,
    name: &str,
    file: &Path,
    first: &Path,
) -> ManifestError {
    let message = if first == file {
        format!(
            "duplicate {kind}: read twice from {}; the first one is used, this one is ignored",
            file.display()
        )
    } else {
        format!(
            "duplicate {kind}: already read from {}; that one is used, this one (in {}) is ignored",
            first.display(),
            file.display()
        )
    };
    ManifestError {
        file: file.to_path_buf(),
        document: None,
        object: Some(ObjectRef {
            kind: Some(kind.to_string()),
            namespace: (!namespace.is_empty()).then(|| namespace.to_string()),
            name: Some(name.to_string()),
        }),
        message,
        duplicate: true,
    }
}

/// The warning for an object `file` holds twice (or more).
fn read_twice(kind: &str, namespace: &str, name: &str, file: &Path) -> ManifestError {
    duplicate_of(kind, namespace, name, file, file)
}

/// Loads one file into `snapshot`.
pub fn load_file(path: &Path, snapshot: &mut Snapshot, errors: &mut Vec<ManifestError>) {
    match std::fs::read_to_string(path) {
        Ok(text) => load_str(path, &text, snapshot, errors),
        Err(e) => errors.push(file_error(path, format!("cannot read file: {e}"))),
    }
}

/// Loads the documents of `text` (read from `path`, used in errors) into `snapshot`.
pub fn load_str<S: Sink>(
    path: &Path,
    text: &str,
    snapshot: &mut S,
    errors: &mut Vec<ManifestError>,
) {
    // A byte-order mark may start the file, or a line of it where files
    // were joined (`cat a.yaml b.yaml`); the YAML parser takes neither.
    let unmarked: String;
    let text = if text.contains('\u{feff}') {
        unmarked = text
            .split_inclusive('\n')
            .map(|l| l.strip_prefix('\u{feff}').unwrap_or(l))
            .collect();
        &unmarked
    } else {
        text
    };
    let docs = split_documents(text);
    // Many documents (a generated file of thousands of Services) are read
    // on every CPU, in chunks whose objects and errors are then put in
    // document order: each document is read alone.
    let threads = crate::parallel::threads();
    if threads < 2 || docs.len() < PARALLEL_DOCUMENTS {
        for (index, (first_line, doc)) in docs.into_iter().enumerate() {
            load_document(path, index + 1, first_line, doc, snapshot, errors);
        }
        return;
    }
    let chunk = docs.len().div_ceil(threads);
    let parts: Vec<_> = docs
        .chunks(chunk)
        .enumerate()
        .map(|(c, part)| {
            move || {
                let mut sink = S::default();
                let mut errors = Vec::new();
                for (i, (first_line, doc)) in part.iter().enumerate() {
                    let index = c * chunk + i + 1;
                    load_document(path, index, *first_line, doc, &mut sink, &mut errors);
                }
                (sink, errors)
            }
        })
        .collect();
    let parts = crate::parallel::map_parts(parts);
    for (sink, errs) in parts {
        snapshot.append(sink);
        errors.extend(errs);
    }
}

/// Files with at least this many documents are read on several threads.
const PARALLEL_DOCUMENTS: usize = 2_048;

/// Loads one document of `path` (1-based `index`, starting at line
/// `first_line` of the file) into `snapshot`.
fn load_document<S: Sink>(
    path: &Path,
    index: usize,
    first_line: usize,
    doc: &str,
    snapshot: &mut S,
    errors: &mut Vec<ManifestError>,
) {
    let err = |object: Option<ObjectRef>, message: String| ManifestError {
        file: path.to_path_buf(),
        document: Some(index),
        object,
        message,
        duplicate: false,
    };
    // A JSON document (what generators write) is parsed as JSON, several
    // times faster; anything it cannot take goes the YAML way, whose
    // errors name the field.
    if load_json(doc, snapshot) {
        return;
    }
    if let Some(line) = too_deep(doc) {
        errors.push(err(
            None,
            format!(
                "line {}: brackets nested more than {MAX_FLOW_DEPTH} levels deep",
                line + first_line
            ),
        ));
        return;
    }
    let value: Value = match yaml_serde::from_str(doc) {
        Ok(v) => v,
        Err(e) => {
            errors.push(err(None, yaml_message(&e, first_line)));
            return;
        }
    };
    if value.is_null() {
        return;
    }
    let object = object_ref(&value);
    if !value.is_mapping() {
        errors.push(err(
            None,
            "not a mapping (an object needs apiVersion and kind)".into(),
        ));
        return;
    }
    let (Some(api_version), Some(kind)) =
        (str_field(&value, "apiVersion"), str_field(&value, "kind"))
    else {
        errors.push(err(Some(object), "missing apiVersion or kind".into()));
        return;
    };
    if (api_version, kind) == ("v1", "List") {
        let items = match value.get("items") {
            None | Some(Value::Null) => return,
            Some(Value::Sequence(items)) => items,
            Some(_) => {
                errors.push(err(Some(object), "items: expected a sequence".into()));
                return;
            }
        };
        for (i, item) in items.iter().enumerate() {
            let result = yaml_serde::to_string(item)
                .map_err(|e| e.to_string())
                .and_then(|text| dispatch(item, &text, snapshot));
            if let Err(message) = result {
                errors.push(err(
                    Some(object_ref(item)),
                    format!("items[{i}]: {message}"),
                ));
            }
        }
        return;
    }
    if let Err(message) = dispatch(&value, doc, snapshot) {
        errors.push(err(Some(object), message));
    }
}

/// Flow collections (`[...]`, `{...}`) nested deeper than this refuse the
/// document before the YAML parser sees it. The parser refuses anything past
/// 128 levels anyway, but its scanner reads all of a flow collection's
/// nesting first, in time that grows with the square of the depth: a
/// 200 kB document of brackets took it 12 s.
const MAX_FLOW_DEPTH: usize = 1_000;

/// The 1-based line (within `doc`) where its brackets open a level past
/// [`MAX_FLOW_DEPTH`], if they do. The count is rough, never a parse: it
/// takes the deeper of two counts, one that skips brackets in quoted strings
/// and comments (a quote counts as opening a string only where a quoted
/// value can begin: at the start of a line or after whitespace, `[`, `{`,
/// `,`, or a `:` closing a quoted key), and one that skips nothing, so that
/// an odd quote in a plain value (`o'brien`) or a bracket in a quoted string
/// hides no nesting from both. A bracket in a plain or block scalar counts
/// too, so the limit is far above any real object's nesting.
fn too_deep(doc: &str) -> Option<usize> {
    let (mut depth, mut raw, mut line) = (0usize, 0usize, 1usize);
    let mut quote: Option<u8> = None;
    let (mut comment, mut escaped) = (false, false);
    // The byte before this one, and the one before that.
    let (mut previous, mut before) = (b'\n', b'\n');
    for &b in doc.as_bytes() {
        match b {
            b'[' | b'{' => raw += 1,
            b']' | b'}' => raw = raw.saturating_sub(1),
            _ => {}
        }
        if b == b'\n' {
            line += 1;
            comment = false;
        } else if comment {
        } else if let Some(q) = quote {
            match b {
                _ if escaped => escaped = false,
                b'\\' if q == b'"' => escaped = true,
                _ if b == q => quote = None,
                _ => {}
            }
        } else {
            match b {
                b'"' | b'\'' if opens_quoted(previous, before) => quote = Some(b),
                b'#' if previous.is_ascii_whitespace() => comment = true,
                b'[' | b'{' => depth += 1,
                b']' | b'}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        if depth.max(raw) > MAX_FLOW_DEPTH {
            return Some(line);
        }
        (before, previous) = (previous, b);
    }
    None
}

/// Whether a quote after `previous` (after `before`) can open a quoted
/// value: at the start of a line or after whitespace, a flow collection's
/// `[`, `{` or `,`, or the `:` of a quoted key (`{"a":"b"}`).
fn opens_quoted(previous: u8, before: u8) -> bool {
    match previous {
        b'[' | b'{' | b',' => true,
        b':' => matches!(before, b'"' | b'\''),
        _ => previous.is_ascii_whitespace(),
    }
}

/// A syntax error's message with its line numbers (relative to the
/// document) made relative to the file.
fn yaml_message(e: &yaml_serde::Error, first_line: usize) -> String {
    let text = e.to_string();
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(at) = rest.find("line ") {
        let (before, after) = rest.split_at(at + "line ".len());
        out.push_str(before);
        let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        match after[..digits].parse::<usize>() {
            Ok(n) => out.push_str(&(n + first_line).to_string()),
            Err(_) => out.push_str(&after[..digits]),
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

/// The error's message without its `at line L column C` suffix.
fn strip_location(e: &yaml_serde::Error) -> String {
    let text = e.to_string();
    if let Some(loc) = e.location() {
        let suffix = format!(" at line {} column {}", loc.line(), loc.column());
        if let Some(stripped) = text.strip_suffix(&suffix) {
            return stripped.to_string();
        }
    }
    text
}

/// Routes one object to its list in `snapshot` by apiVersion/kind, after
/// validation. Unknown kinds are skipped.
fn dispatch(value: &Value, text: &str, snapshot: &mut impl Sink) -> Result<(), String> {
    let api_version = str_field(value, "apiVersion").unwrap_or_default();
    let kind = str_field(value, "kind").ok_or_else(|| "missing kind".to_string())?;
    if !matches!(
        (api_version, kind),
        ("v1", "Service")
            | ("v1", "Pod")
            | ("v1", "Node")
            | ("discovery.k8s.io/v1", "EndpointSlice")
    ) {
        tracing::debug!(
            api_version,
            kind,
            "manifests: skipping a kind the proxy does not use"
        );
        return Ok(());
    }
    push_typed(parse_typed(text, kind)?, snapshot)
}

/// Adds `typed` to its list in `snapshot`, in the namespace `default` when
/// it names none, trimmed as the Kubernetes source trims ([`crate::k8s::trim`]:
/// `managedFields` and annotations the agent does not read, often most of an
/// object dumped with `kubectl get -o yaml`). A Service is validated first.
fn push_typed(typed: Typed, snapshot: &mut impl Sink) -> Result<(), String> {
    match typed {
        Typed::Service(mut svc) => {
            default_namespace(&mut svc.metadata);
            validate_service(&svc)?;
            crate::k8s::trim(&mut *svc);
            snapshot.service(*svc);
        }
        Typed::Pod(mut pod) => {
            default_namespace(&mut pod.metadata);
            crate::k8s::trim(&mut *pod);
            snapshot.pod(*pod);
        }
        Typed::Node(mut node) => {
            crate::k8s::trim(&mut *node);
            snapshot.node(*node);
        }
        Typed::EndpointSlice(mut slice) => {
            default_namespace(&mut slice.metadata);
            crate::k8s::trim(&mut *slice);
            snapshot.endpoint_slice(*slice);
        }
    }
    Ok(())
}

/// Loads `doc` if it is one JSON object of a kind the proxy uses (or skips
/// it if its kind is another) and valid; false leaves it to the YAML path.
fn load_json(doc: &str, snapshot: &mut impl Sink) -> bool {
    if !doc.trim_start().starts_with('{') {
        return false;
    }
    // Two passes over the text, neither building a tree: the first checks
    // that every object has each key once (a JSON object with a key twice
    // is the YAML path's to refuse: serde_json would keep the last one
    // silently) and reads `apiVersion` and `kind`; the second deserializes
    // the object of that kind straight from the text. Through a
    // `serde_json::Value` (built and then converted) the parse of 50,000
    // Services and their EndpointSlices took a third longer.
    let Ok(header) = serde_json::from_str::<JsonHeader>(doc) else {
        return false;
    };
    let (Some(api_version), Some(kind)) = (header.api_version, header.kind) else {
        return false;
    };
    let typed = match (&*api_version, &*kind) {
        ("v1", "Service") => serde_json::from_str(doc).map(|o| Typed::Service(Box::new(o))),
        ("v1", "Pod") => serde_json::from_str(doc).map(|o| Typed::Pod(Box::new(o))),
        ("v1", "Node") => serde_json::from_str(doc).map(|o| Typed::Node(Box::new(o))),
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            serde_json::from_str(doc).map(|o| Typed::EndpointSlice(Box::new(o)))
        }
        // Lists and errors are the YAML path's; other kinds are skipped there.
        _ => return false,
    };
    // An invalid Service is the YAML path's to report.
    typed.is_ok_and(|t| push_typed(t, snapshot).is_ok())
}

/// A JSON string, borrowed from the text when it has no escapes.
struct JsonStr<'de>(std::borrow::Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for JsonStr<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = JsonStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<JsonStr<'de>, E> {
                Ok(JsonStr(std::borrow::Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<JsonStr<'de>, E> {
                Ok(JsonStr(std::borrow::Cow::Owned(s.to_owned())))
            }
            fn visit_string<E>(self, s: String) -> Result<JsonStr<'de>, E> {
                Ok(JsonStr(std::borrow::Cow::Owned(s)))
            }
        }
        d.deserialize_str(Visitor)
    }
}

/// Refuses `keys` (one object's) if one is there twice.
fn check_unique_keys<E: serde::de::Error>(mut keys: Vec<JsonStr<'_>>) -> Result<(), E> {
    keys.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    if keys.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(E::custom("duplicate key"));
    }
    Ok(())
}

/// Any JSON value, walked and dropped: refused at an object, at any depth,
/// with a key twice.
struct UniqueKeys;

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UniqueKeys;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_i64<E>(self, _: i64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_u64<E>(self, _: u64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_f64<E>(self, _: f64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_str<E>(self, _: &str) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_unit<E>(self) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_none<E>(self) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys)
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<UniqueKeys, D::Error> {
                serde::Deserialize::deserialize(d)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<UniqueKeys, A::Error> {
                while seq.next_element::<UniqueKeys>()?.is_some() {}
                Ok(UniqueKeys)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<UniqueKeys, A::Error> {
                let mut keys = Vec::new();
                while let Some(k) = map.next_key::<JsonStr>()? {
                    map.next_value::<UniqueKeys>()?;
                    keys.push(k);
                }
                check_unique_keys(keys)?;
                Ok(UniqueKeys)
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// A JSON object walked as [`UniqueKeys`] walks it, keeping its
/// `apiVersion` and `kind`; anything but an object, or either of them not
/// a string, is refused.
struct JsonHeader<'de> {
    api_version: Option<std::borrow::Cow<'de, str>>,
    kind: Option<std::borrow::Cow<'de, str>>,
}

impl<'de> serde::Deserialize<'de> for JsonHeader<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = JsonHeader<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<JsonHeader<'de>, A::Error> {
                let mut out = JsonHeader {
                    api_version: None,
                    kind: None,
                };
                let mut keys = Vec::new();
                while let Some(k) = map.next_key::<JsonStr>()? {
                    match &*k.0 {
                        "apiVersion" => out.api_version = Some(map.next_value::<JsonStr>()?.0),
                        "kind" => out.kind = Some(map.next_value::<JsonStr>()?.0),
                        _ => {
                            map.next_value::<UniqueKeys>()?;
                        }
                    }
                    keys.push(k);
                }
                check_unique_keys(keys)?;
                Ok(out)
            }
        }
        d.deserialize_map(Visitor)
    }
}

/// One object of a kind the proxy uses.
enum Typed {
    Service(Box<Service>),
    Pod(Box<Pod>),
    Node(Box<Node>),
    EndpointSlice(Box<EndpointSlice>),
}

/// Deserializes `text` as the type of `kind`; errors carry the field path
/// (`spec.ports[0].port: invalid type: ...`).
fn parse_typed(text: &str, kind: &str) -> Result<Typed, String> {
    fn parse<T: DeserializeOwned>(text: &str) -> Result<Box<T>, String> {
        yaml_serde::from_str(text)
            .map(Box::new)
            .map_err(|e| strip_location(&e))
    }
    Ok(match kind {
        "Service" => Typed::Service(parse(text)?),
        "Pod" => Typed::Pod(parse(text)?),
        "Node" => Typed::Node(parse(text)?),
        _ => Typed::EndpointSlice(parse(text)?),
    })
}

fn default_namespace(meta: &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) {
    if meta.namespace.as_deref().is_none_or(str::is_empty) {
        meta.namespace = Some("default".to_string());
    }
}

/// Checks the manifests source can use this Service as written.
fn validate_service(svc: &Service) -> Result<(), String> {
    let Some(spec) = &svc.spec else { return Ok(()) };
    let type_ = spec.type_.as_deref().unwrap_or("ClusterIP");
    if !matches!(type_, "ClusterIP" | "NodePort" | "LoadBalancer") {
        return Ok(());
    }
    let has_selector = spec.selector.as_ref().is_some_and(|s| !s.is_empty());
    let has_ports = spec.ports.as_ref().is_some_and(|p| !p.is_empty());
    let has_cluster_ip = spec.cluster_ip.as_deref().is_some_and(|ip| !ip.is_empty())
        || spec
            .cluster_ips
            .as_ref()
            .is_some_and(|ips| ips.iter().any(|ip| !ip.is_empty()));
    if (has_selector || has_ports) && !has_cluster_ip {
        return Err(
            "has no spec.clusterIP (the manifests source does not allocate ClusterIPs)".into(),
        );
    }
    Ok(())
}

fn str_field<'a>(value: &'a Value, key: &str) -> Option<&'a str> {
    value.get(key).and_then(Value::as_str)
}

fn object_ref(value: &Value) -> ObjectRef {
    let meta = value.get("metadata");
    let kind = str_field(value, "kind").map(str::to_string);
    let name = meta.and_then(|m| str_field(m, "name")).map(str::to_string);
    let namespace = meta
        .and_then(|m| str_field(m, "namespace"))
        .map(str::to_string);
    let namespaced = !matches!(kind.as_deref(), Some("Node" | "List"));
    let namespace = match namespace {
        Some(ns) => Some(ns),
        None if namespaced && name.is_some() => Some("default".to_string()),
        None => None,
    };
    ObjectRef {
        kind,
        namespace,
        name,
    }
}

/// Splits a YAML stream into documents at `---` and `...` markers (which YAML
/// allows only at the start of a line, never inside content), so that one bad
/// document does not hide the others. Returns each document with the 0-based
/// line it starts at.
fn split_documents(text: &str) -> Vec<(usize, &str)> {
    fn is_marker(line: &str, marker: &str) -> bool {
        line.strip_prefix(marker)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r']))
    }
    let mut docs = Vec::new();
    let (mut start, mut start_line, mut offset) = (0usize, 0usize, 0usize);
    // A segment not opened by `---` (the file's start, or after `...`) is a
    // document only when it has content other than blanks and comments.
    let mut explicit = false;
    let mut seen_content = false;
    for (line_no, line) in text.split_inclusive('\n').enumerate() {
        let bare = line.trim_end_matches('\n');
        if is_marker(bare, "---") {
            if explicit || seen_content {
                docs.push((start_line, &text[start..offset]));
            }
            // The rest of the marker line may hold content (`--- {a: 1}`).
            (start, start_line, explicit, seen_content) = (offset + 3, line_no, true, false);
        } else if is_marker(bare, "...") {
            if explicit || seen_content {
                docs.push((start_line, &text[start..offset]));
            }
            (start, start_line, explicit, seen_content) =
                (offset + line.len(), line_no + 1, false, false);
        } else if !bare.trim().is_empty() && !bare.trim_start().starts_with('#') {
            seen_content = true;
        }
        offset += line.len();
    }
    if explicit || seen_content {
        docs.push((start_line, &text[start..]));
    }
    docs
}

/// The symlink the kubelet's atomic writer swaps to update a ConfigMap,
/// Secret or projected volume: the volume's files are symlinks through it.
const ATOMIC_DATA: &str = "..data";

/// Watches `paths` (directories non-recursively; for a file, its parent
/// directory filtered by the file's name, because editors replace files) and
/// sends `()` on every change that may alter what [`load_paths`] returns.
pub fn watch(
    paths: Vec<PathBuf>,
    tx: tokio::sync::mpsc::UnboundedSender<()>,
) -> notify::Result<notify::RecommendedWatcher> {
    watch_replaced(paths, tx, Default::default())
}

/// [`watch`], and `replaced` set when an event names a watched directory
/// itself (created, or renamed into place): an inotify watch follows its
/// inode, so a directory swapped in by a rename, or deleted and made again,
/// must be watched again ([`crate::source::ManifestsSource`] does, before
/// its next read).
pub fn watch_replaced(
    paths: Vec<PathBuf>,
    tx: tokio::sync::mpsc::UnboundedSender<()>,
    replaced: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> notify::Result<notify::RecommendedWatcher> {
    // (directory, file name or None for every manifest file in it)
    let mut rules: Vec<(PathBuf, Option<OsString>)> = Vec::new();
    for path in &paths {
        let abs = std::path::absolute(path)?;
        if abs.is_dir() {
            let dir = abs.canonicalize().unwrap_or(abs);
            rules.push((dir, None));
        } else {
            let name = abs.file_name().map(|n| n.to_os_string());
            let parent = abs
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("/"));
            let dir = parent.canonicalize().unwrap_or(parent);
            rules.push((dir, name));
        }
    }
    let mut dirs: BTreeSet<PathBuf> = rules.iter().map(|(d, _)| d.clone()).collect();
    // A watched directory's parent too, so that the directory being deleted
    // and created again is noticed (its own watch dies with it).
    for (dir, name) in &rules {
        if name.is_none() {
            if let Some(parent) = dir.parent() {
                dirs.insert(parent.to_path_buf());
            }
        }
    }
    let matcher = rules.clone();
    let mut watcher =
        notify::recommended_watcher(move |res: notify::Result<notify::Event>| match res {
            Ok(event) => {
                // A rename arrives as its names (`From`, `To`) and again as
                // the pair (`Both`): the pair is no change of its own, and a
                // second signal would make a second sync.
                if matches!(
                    event.kind,
                    EventKind::Access(_)
                        | EventKind::Modify(notify::event::ModifyKind::Name(
                            notify::event::RenameMode::Both
                        ))
                ) {
                    return;
                }
                let relevant = event.need_rescan()
                    || event.paths.iter().any(|p| {
                        matcher.iter().any(|(dir, name)| {
                            let in_dir = p.parent() == Some(dir.as_path());
                            // A ConfigMap (or Secret, projected) volume
                            // is updated by renaming a symlink over
                            // `..data`, which its files point through.
                            let swap = in_dir && p.file_name() == Some(OsStr::new(ATOMIC_DATA));
                            swap || match name {
                                Some(name) => in_dir && p.file_name() == Some(name.as_os_str()),
                                None => (in_dir && has_manifest_extension(p)) || p == dir,
                            }
                        })
                    });
                let dir_itself = event
                    .paths
                    .iter()
                    .any(|p| matcher.iter().any(|(dir, name)| name.is_none() && p == dir));
                if dir_itself {
                    replaced.store(true, std::sync::atomic::Ordering::Release);
                }
                if relevant {
                    let _ = tx.send(());
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "manifests: watch error; reloading");
                let _ = tx.send(());
            }
        })?;
    for dir in &dirs {
        if dir.exists() {
            watcher.watch(dir, RecursiveMode::NonRecursive)?;
        }
    }
    Ok(watcher)
}

/// Keeps the last good version of objects whose document turned bad, as an
/// API server keeps an object when an update of it is rejected: an error
/// naming a kind, namespace and name brings that object back from `previous`
/// if it is absent from `snapshot`. Returns how many objects were kept.
pub fn keep_last_good(
    previous: &Snapshot,
    errors: &[ManifestError],
    snapshot: &mut Snapshot,
) -> usize {
    use k8s_openapi::Metadata;
    fn same<T: Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>>(
        o: &T,
        ns: &str,
        name: &str,
    ) -> bool {
        let m = o.metadata();
        m.name.as_deref() == Some(name) && m.namespace.as_deref().unwrap_or("default") == ns
    }
    fn carry<
        T: Clone + Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
    >(
        prev: &[T],
        now: &mut Vec<T>,
        ns: &str,
        name: &str,
    ) -> usize {
        if now.iter().any(|o| same(o, ns, name)) {
            return 0;
        }
        match prev.iter().find(|o| same(*o, ns, name)) {
            Some(o) => {
                now.push(o.clone());
                1
            }
            None => 0,
        }
    }
    let mut kept = 0;
    for e in errors {
        let Some(ObjectRef {
            kind: Some(kind),
            namespace,
            name: Some(name),
        }) = &e.object
        else {
            continue;
        };
        let ns = namespace.as_deref().unwrap_or("default");
        kept += match kind.as_str() {
            "Service" => carry(&previous.services, &mut snapshot.services, ns, name),
            "EndpointSlice" => carry(
                &previous.endpoint_slices,
                &mut snapshot.endpoint_slices,
                ns,
                name,
            ),
            "Pod" => carry(&previous.pods, &mut snapshot.pods, ns, name),
            "Node" => carry(&previous.nodes, &mut snapshot.nodes, ns, name),
            _ => 0,
        };
    }
    kept
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

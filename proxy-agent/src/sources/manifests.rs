//! The `manifests` source of desired state: standard Kubernetes YAML (or JSON)
//! files holding Services, EndpointSlices, Pods and Nodes, read into a
//! [`Snapshot`] and watched for changes.
//!
//! Loading is forgiving: a bad document yields a [`ManifestError`] naming the
//! file, the document and the object, and is skipped; every other document and
//! file still loads. Pods with a pod IP stand in for the EndpointSlice
//! controller (see [`crate::model::endpoint_slices_from_pods`]).
//!
//! One module per concern: which files are read ([`files`]), what was read
//! before and is still valid ([`cache`]), objects read twice
//! ([`duplicates`]), YAML and JSON documents into typed objects ([`parse`]),
//! watching the files ([`watch`]), and the [`ManifestsSource`] built on them
//! ([`source`]).
mod cache;
mod duplicates;
mod files;
mod parse;
mod source;
mod watch;

use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::objects::{Object, Snapshot};

pub use cache::FileCache;
pub use parse::load_str;
pub use source::ManifestsSource;
pub use watch::{keep_last_good, watch, watch_replaced};

use duplicates::Seen;
use files::list_files;

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

/// Loads one file into `snapshot`.
pub fn load_file(path: &Path, snapshot: &mut Snapshot, errors: &mut Vec<ManifestError>) {
    match std::fs::read_to_string(path) {
        Ok(text) => load_str(path, &text, snapshot, errors),
        Err(e) => errors.push(file_error(path, format!("cannot read file: {e}"))),
    }
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

//! Objects read twice (the same kind, namespace and name in two files, or
//! twice in one): the first one read is kept, the later one dropped with a
//! warning naming both files.

use std::path::{Path, PathBuf};

use crate::objects::Snapshot;

use super::cache::FileKey;
use super::{ManifestError, ObjectRef};

/// The warning for an object `other` holds too, `first` having it already.
pub(super) fn duplicate_error(key: &FileKey, first: &Path, other: &Path) -> ManifestError {
    let (namespace, name) = &key.1;
    duplicate_of(key.0.name(), namespace, name, other, first)
}

/// The file each (kind, namespace, name) read so far came from.
#[derive(Default)]
pub(super) struct Seen(std::collections::BTreeMap<(&'static str, String, String), PathBuf>);

impl Seen {
    /// Appends `one` (every object of `file`) to `snapshot`, minus the
    /// objects already read, each reported as a duplicate.
    pub(super) fn merge(
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
pub(super) fn read_twice(kind: &str, namespace: &str, name: &str, file: &Path) -> ManifestError {
    duplicate_of(kind, namespace, name, file, file)
}

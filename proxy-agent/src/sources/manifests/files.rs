//! Which files the manifests source reads: the paths given, a directory's
//! manifest files (by extension), in one repeatable order.

use std::path::{Path, PathBuf};

use super::{file_error, ManifestError};

/// File extensions read from a directory.
const EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

pub(super) fn has_manifest_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x)))
}

/// The files `paths` name, in reading order: a file, or a directory's
/// manifest files sorted by name; and an error per directory that cannot be
/// read.
pub(super) fn list_files(paths: &[PathBuf]) -> (Vec<PathBuf>, Vec<ManifestError>) {
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

//! The manifests source: files, directories, multi-document YAML, bad documents.
//!
//! One test binary (`cargo test --test manifests`), split by concern into
//! the modules below: `parse` (multi-document YAML and JSON, bad documents,
//! fuzzing, trimming, deep nesting, byte-order marks, thousands of
//! documents, duplicates), `watch` (the watches: a changed or renamed file,
//! a deleted or swapped directory, a ConfigMap volume, the last good
//! object) and `cache` (the file cache). This file holds their helpers
//! (`data`, `names`, `service_manifest`).
use std::path::{Path, PathBuf};

mod cache;
mod parse;
mod watch;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn names<
    T: k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
>(
    objs: &[T],
) -> Vec<String> {
    objs.iter()
        .map(|o| {
            let m = o.metadata();
            format!(
                "{}/{}",
                m.namespace.as_deref().unwrap_or("-"),
                m.name.as_deref().unwrap_or("-")
            )
        })
        .collect()
}

/// A Service manifest named `name` with ClusterIP `ip`.
fn service_manifest(name: &str, ip: &str) -> String {
    format!("apiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n")
}

//! deploy/ validated as a cluster would take it: `kubectl kustomize deploy/`
//! renders, and every manifest (each file and the rendered whole) passes
//! PyPI's kubernetes-validate, strict, against the OpenAPI schemas of every
//! Kubernetes version supported (docs/testing.md); a misspelt field fails
//! for every version. (The ConfigMap's embedded config is parsed by the agent's own
//! parser in `proxy-agent/tests/deploy.rs`.)
//!
//! Needs `cargo xtask setup` (kubectl, the venv with kubernetes-validate);
//! run by `cargo xtask test`.

use std::path::{Path, PathBuf};
use std::process::Command;

use xtask::setup;

/// The Kubernetes minor versions supported (docs/testing.md).
const VERSIONS: &[&str] = &[
    "1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0",
];

fn deploy_dir() -> PathBuf {
    setup::workspace_root().join("deploy")
}

fn rendered() -> String {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(deploy_dir())
        .output()
        .expect("kubectl (cargo xtask setup installs it)");
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// kubernetes-validate --strict on `files` for `version`: (passed, output).
fn validate(version: &str, files: &[PathBuf]) -> (bool, String) {
    let out = Command::new(setup::kubernetes_validate_bin())
        .args(["--strict", "--quiet", "-k", version])
        .args(files)
        .output()
        .expect("kubernetes-validate (cargo xtask setup installs it into <target>/venv)");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = setup::target_dir().join(format!("deploy-validate-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every manifest file of deploy/ (not the kustomization, not examples/).
fn manifest_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.is_file()
                && p.extension().is_some_and(|e| e == "yaml")
                && p.file_name().is_some_and(|n| n != "kustomization.yaml")
        })
        .collect();
    v.sort();
    v
}

#[test]
fn kustomize_renders_every_resource() {
    let text = rendered();
    let kinds: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("kind: "))
        .collect();
    for kind in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
    ] {
        assert!(kinds.contains(&kind), "{kind} not rendered: {kinds:?}");
    }
    assert!(
        text.contains("image: proxy-agent:latest"),
        "the image the kustomization sets"
    );
}

#[test]
fn every_manifest_validates_for_every_supported_version() {
    let dir = tmp_dir("ok");
    let all = dir.join("rendered.yaml");
    std::fs::write(&all, rendered()).unwrap();
    let mut files = manifest_files(&deploy_dir());
    files.push(all);
    for v in VERSIONS {
        let (ok, out) = validate(v, &files);
        assert!(ok, "Kubernetes {v}: {out}");
    }
}

#[test]
fn a_misspelt_field_fails_for_every_version() {
    let dir = tmp_dir("bad");
    let text = std::fs::read_to_string(deploy_dir().join("daemonset.yaml")).unwrap();
    for (field, typo) in [
        ("readOnlyRootFilesystem:", "readOnlyRootFileSystem:"),
        ("mountPropagation:", "mountPropogation:"),
    ] {
        assert!(text.contains(field), "daemonset.yaml sets {field}");
        let bad = dir.join("daemonset.yaml");
        std::fs::write(&bad, text.replacen(field, typo, 1)).unwrap();
        for v in VERSIONS {
            let (ok, out) = validate(v, std::slice::from_ref(&bad));
            assert!(!ok, "Kubernetes {v} accepted {typo}");
            assert!(
                out.contains(typo.trim_end_matches(':')),
                "Kubernetes {v}: the error names {typo}: {out}"
            );
        }
    }
}

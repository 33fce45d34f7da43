//! `cargo xtask lint`: formatting and clippy, warnings as errors, over every
//! crate — the user-space ones on the host, the eBPF crate for its own target
//! (it only builds there: `no_std`, its own panic handler). `cargo xtask test`
//! runs it first, so CI fails on a lint as on a test. It also checks that
//! the agent's dependencies point one way ([`LAYERS`]).

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::setup::{cargo, run_visible, target_dir, workspace_root};

/// Whether `rustup`'s nightly toolchain has clippy.
fn nightly_has_clippy() -> bool {
    Command::new("cargo")
        .args(["+nightly", "clippy", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The agent's layers, bottom up: each folder (with its `.rs` file) and the
/// crate modules it must not name. Objects are the vocabulary every part
/// shares; the model computes from objects only, never from a source or
/// what runs it; the sources read objects and know nothing of the model.
pub const LAYERS: &[(&str, &[&str])] = &[
    (
        "proxy-agent/src/objects",
        &[
            "model",
            "sources",
            "agent",
            "dataplane",
            "bpf",
            "config",
            "cli",
        ],
    ),
    (
        "proxy-agent/src/model",
        &["sources", "agent", "config", "cli"],
    ),
    // The configuration resolves flags, file and defaults from facts the
    // caller found on the host; the commands and what they run come after it.
    (
        "proxy-agent/src/config",
        &["cli", "agent", "sources", "host"],
    ),
    // The sources (manifests, the Kubernetes API) hand objects up; what the
    // model makes of them is not theirs to know.
    (
        "proxy-agent/src/sources",
        &["model", "agent", "dataplane", "bpf", "config", "cli"],
    ),
];

/// The crate modules a Rust source names (`crate::x`, and each item of a
/// `crate::{x, y::z}` group), comments left out.
pub fn crate_modules_named(src: &str) -> Vec<String> {
    let code: String = src
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The group's top-level items: what follows `{` or a `,` at depth 1.
            let (mut depth, mut expect) = (1, true);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 1 => break,
                    '}' => depth -= 1,
                    ',' if depth == 1 => expect = true,
                    c if c.is_whitespace() => {}
                    _ if expect && depth == 1 => {
                        out.push(ident(&group[j..]));
                        expect = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(ident(rest));
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

/// Where the agent's sources break [`LAYERS`], one line each.
pub fn layering_violations(root: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for (layer, forbidden) in LAYERS {
        let dir = root.join(layer);
        let mut files = vec![dir.with_extension("rs")];
        if dir.is_dir() {
            for e in walk(&dir)? {
                files.push(e);
            }
        }
        for f in files.iter().filter(|f| f.is_file()) {
            let src = std::fs::read_to_string(f).with_context(|| format!("{}", f.display()))?;
            for m in crate_modules_named(&src) {
                if forbidden.contains(&m.as_str()) {
                    out.push(format!(
                        "{}: names crate::{m}, which {layer} must not depend on",
                        f.strip_prefix(root).unwrap_or(f).display()
                    ));
                }
            }
        }
    }
    Ok(out)
}

fn walk(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))? {
        let p = e?.path();
        if p.is_dir() {
            out.extend(walk(&p)?);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

/// Runs the layering check, rustfmt's check, clippy on the host crates and
/// clippy on the eBPF crate.
pub fn lint() -> Result<()> {
    println!("lint: the agent's layers");
    let broken = layering_violations(&workspace_root())?;
    if !broken.is_empty() {
        bail!(
            "the agent's dependencies must point one way (xtask/src/lint.rs LAYERS):\n{}",
            broken.join("\n")
        );
    }
    println!("lint: rustfmt");
    run_visible(cargo().args(["fmt", "--all", "--check"]))?;
    println!("lint: clippy (every crate on the host, the eBPF one checked only)");
    run_visible(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    println!("lint: clippy (eBPF crate, bpfel-unknown-none)");
    // Like aya-build: nightly where it is installed, else the stable
    // toolchain with RUSTC_BOOTSTRAP=1 for `-Z build-std`.
    let mut c = Command::new("cargo");
    if nightly_has_clippy() {
        c.arg("+nightly");
    } else {
        c.env("RUSTC_BOOTSTRAP", "1");
    }
    c.current_dir(workspace_root().join("proxy-ebpf"))
        .args([
            "clippy",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
            "--",
            "-D",
            "warnings",
        ])
        .env("CARGO_TARGET_DIR", target_dir().join("ebpf-clippy"))
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER");
    run_visible(&mut c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crate_paths_and_groups_are_read_comments_are_not() {
        let src = "use crate::model::Object;\n\
                   use crate::{\n    bpf::PinnedMaps,\n    objects::{Change, Kind},\n    sources,\n};\n\
                   // crate::agent in a comment\n\
                   let x = crate::host::hostname();\n";
        assert_eq!(
            crate_modules_named(src),
            ["model", "bpf", "objects", "sources", "host"]
        );
    }

    /// The tree as it is keeps its layers; a model file that named a
    /// source would be caught.
    #[test]
    fn the_agent_keeps_its_layers() {
        let root = workspace_root();
        assert_eq!(layering_violations(&root).unwrap(), Vec::<String>::new());
        let (layer, forbidden) = LAYERS[1];
        assert!(layer.ends_with("model") && forbidden.contains(&"sources"));
        assert!(
            crate_modules_named("use crate::{sources::manifests::Sink};")
                .iter()
                .any(|m| forbidden.contains(&m.as_str()))
        );
    }
}

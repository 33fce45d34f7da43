//! What a user of the command line reads: `cargo xtask test --help` names
//! `--kernel` and every environment variable the docs tell a user to set,
//! and `cargo xtask lab up` names its own flag (not a library method) when a
//! manifest needs a dual-stack lab. No root: nothing here creates a lab.

use std::path::{Path, PathBuf};
use std::process::Command;

fn xtask() -> Command {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// README.md and every page of docs/.
fn docs() -> Vec<(PathBuf, String)> {
    let root = repo_root();
    let mut files = vec![root.join("README.md")];
    if let Ok(rd) = std::fs::read_dir(root.join("docs")) {
        files.extend(
            rd.map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "md")),
        );
    }
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p, text)
        })
        .collect()
}

/// Variables the docs name that a user does not set for `cargo xtask test`:
/// the xtask sets them for the tests itself, or they belong to another
/// command.
const NOT_FOR_USERS: &[&str] = &[
    "KPR_AGENT_BIN",           // built and passed by `cargo xtask test`
    "KPR_LAB_SERVER_BIN",      // ditto
    "KPR_LAB_HOST_CLIENT_BIN", // ditto
    "KPR_REQUIRE_ROOT_TESTS",  // set by `cargo xtask test` (it runs as root)
    "KPR_BENCH_AGENT_BIN",     // `cargo xtask bench`
];

fn kpr_variables(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("KPR_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].trim_end_matches('_').to_string());
        rest = &tail[end..];
    }
    out
}

#[test]
fn test_help_names_kernel_and_documented_environment() {
    let out = xtask().args(["test", "--help"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(help.contains("--kernel"), "no --kernel in:\n{help}");
    let mut missing = Vec::new();
    for (path, text) in docs() {
        for var in kpr_variables(&text) {
            if !NOT_FOR_USERS.contains(&var.as_str())
                && !help.contains(&var)
                && !missing.iter().any(|(v, _)| v == &var)
            {
                missing.push((var, path.display().to_string()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "documented but not in `cargo xtask test --help` (TEST_HELP in xtask/src/main.rs): {missing:?}"
    );
    // The short form shows the same list.
    let out = xtask().args(["test", "-h"]).output().unwrap();
    let short = String::from_utf8(out.stdout).unwrap();
    assert!(
        short.contains("--kernel") && short.contains("KPR_SKIP_VMS"),
        "{short}"
    );
}

#[test]
fn lab_up_dual_stack_manifest_names_the_flag() {
    let dir = std::env::temp_dir().join(format!("kpr-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let manifest = dir.join("svc.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: v1\nkind: Service\nmetadata: {name: both}\nspec:\n  \
         ipFamilyPolicy: RequireDualStack\n  ipFamilies: [IPv4, IPv6]\n  ports: [{port: 80}]\n",
    )
    .unwrap();
    let out = xtask()
        .args(["lab", "up", "--no-agent"])
        .arg(&manifest)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "lab up succeeded: {stderr}");
    assert!(stderr.contains("--dual-stack"), "{stderr}");
    assert!(stderr.contains("service both"), "{stderr}");
    assert!(!stderr.contains("LabBuilder"), "{stderr}");
}

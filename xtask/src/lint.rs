//! `cargo xtask lint`: formatting and clippy, warnings as errors, over every
//! crate — the user-space ones on the host, the eBPF crate for its own target
//! (it only builds there: `no_std`, its own panic handler). `cargo xtask test`
//! runs it first, so CI fails on a lint as on a test.

use std::process::Command;

use anyhow::Result;

use crate::setup::{cargo, run_visible, target_dir, workspace_root};

/// Whether `rustup`'s nightly toolchain has clippy.
fn nightly_has_clippy() -> bool {
    Command::new("cargo")
        .args(["+nightly", "clippy", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Runs rustfmt's check, clippy on the host crates and clippy on the eBPF crate.
pub fn lint() -> Result<()> {
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

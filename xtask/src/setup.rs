//! `cargo xtask setup` and the build helpers shared by the other tasks.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::SystemTime;

use anyhow::{bail, Context, Result};

/// The bpf-linker release that loads the LLVM shipped with the Rust toolchain.
pub const BPF_LINKER_VERSION: &str = "0.10.0";
/// Debian packages the lab and the benchmarks use.
pub const DEBIAN_PACKAGES: &[&str] = &[
    "iproute2",
    "bpftool",
    "iptables",
    "nftables",
    "socat",
    "netcat-openbsd",
    "ethtool",
    "procps",
    // The bench's HTTP cell: wrk with short connections (issue 13).
    "wrk",
    // The kernel matrix's VMs (`cargo xtask test --kernel`): qemu, the
    // guests' busybox, and the tools that unpack Debian's kernel modules.
    "qemu-system-x86",
    "busybox-static",
    "xz-utils",
    "zstd",
    // The image (`cargo xtask image`: ring's C code for the musl agent) and
    // the lab's runc mode: run it, read it, unpack it.
    "musl-tools",
    "runc",
    "skopeo",
    "umoci",
    // deploy/'s validation: a venv for PyPI's kubernetes-validate.
    "python3-venv",
    // The lab's control plane: its certificates and keys, etcd's gateway.
    "openssl",
    "curl",
    // Host clients' UDP (issue 42): a DNS resolver from Debian (dig) asking
    // DNS servers (dnsmasq) in pods through a ClusterIP.
    "bind9-dnsutils",
    "dnsmasq-base",
];
/// The Rust target of the image's static agent.
pub const MUSL_TARGET: &str = "x86_64-unknown-linux-musl";
/// Where bpffs must be mounted.
pub const BPFFS: &str = "/sys/fs/bpf";
const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// The workspace root (the parent of the xtask crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives inside the workspace")
        .to_path_buf()
}

/// The cargo target directory (`CARGO_TARGET_DIR` or `<workspace>/target`).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => PathBuf::from(d),
        None => workspace_root().join("target"),
    }
}

/// True if the effective user is root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// `cargo` (the one running xtask, else from PATH) in the workspace root.
pub fn cargo() -> Command {
    let mut c = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.current_dir(workspace_root());
    c
}

/// Runs a command with inherited output, failing if it exits non-zero.
pub fn run_visible(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

/// `cargo build -p <package> [args]` in the workspace.
pub fn cargo_build(package: &str, extra: &[&str]) -> Result<()> {
    run_visible(cargo().args(["build", "-p", package]).args(extra))
}

static SETUP_DONE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
static DATAPATH_SETUP_DONE: std::sync::OnceLock<()> = std::sync::OnceLock::new();

/// Runs [`setup`] once per process: the tests, the bench and `lint` need all
/// of it (the Kubernetes components and Go tools included).
pub fn ensure_setup() -> Result<()> {
    if SETUP_DONE.get().is_some() {
        return Ok(());
    }
    setup()?;
    let _ = SETUP_DONE.set(());
    let _ = DATAPATH_SETUP_DONE.set(());
    Ok(())
}

/// Runs [`setup_datapath`] once per process before anything is built: every
/// command that builds the agent or its eBPF object (demo, lab, build-ebpf)
/// needs the `rust-src` component and bpf-linker, and a fresh machine has
/// neither. Not the Kubernetes components: they take minutes to build on a
/// fresh machine and only a lab with a control plane needs them (it builds
/// them when it starts one).
pub fn ensure_datapath_setup() -> Result<()> {
    if DATAPATH_SETUP_DONE.get().is_some() {
        return Ok(());
    }
    setup_datapath()?;
    let _ = DATAPATH_SETUP_DONE.set(());
    Ok(())
}

/// Builds proxy-agent in release (whose build.rs builds the eBPF object) and
/// returns the agent binary.
pub fn build_agent() -> Result<PathBuf> {
    ensure_datapath_setup()?;
    cargo_build("proxy-agent", &["--release", "--bins"])?;
    Ok(target_dir().join("release/proxy-agent"))
}

/// Builds the lab's pod server and returns its path.
pub fn build_lab_server() -> Result<PathBuf> {
    ensure_datapath_setup()?;
    cargo_build(
        "xtask",
        &["--bin", "lab-server", "--bin", "lab-host-client"],
    )?;
    Ok(target_dir().join("debug/lab-server"))
}

/// The newest eBPF object built by proxy-agent's build script
/// (`target/debug/build/proxy-agent-*/out/proxy`).
pub fn find_ebpf_object() -> Result<PathBuf> {
    let build = target_dir().join("debug/build");
    let mut best: Option<(SystemTime, PathBuf)> = None;
    let mut seen = Vec::new();
    for e in std::fs::read_dir(&build).with_context(|| format!("read {}", build.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("proxy-agent-") {
            continue;
        }
        let out = e.path().join("out");
        if !out.is_dir() {
            continue;
        }
        seen.push(out.clone());
        let candidate = out.join("proxy");
        if let Ok(meta) = candidate.metadata() {
            if meta.is_file() {
                let m = meta.modified()?;
                if best.as_ref().is_none_or(|(t, _)| m > *t) {
                    best = Some((m, candidate));
                }
            }
        }
    }
    match best {
        Some((_, p)) => Ok(p),
        None => bail!(
            "no eBPF object `proxy` found under {}/proxy-agent-*/out (looked in {:?})",
            build.display(),
            seen
        ),
    }
}

/// `cargo xtask build-ebpf`: builds proxy-agent and returns the object path.
pub fn build_ebpf() -> Result<PathBuf> {
    ensure_datapath_setup()?;
    cargo_build("proxy-agent", &[])?;
    find_ebpf_object()
}

fn rustup_has_toolchain(name: &str) -> Result<bool> {
    let out = crate::netns::run(Command::new("rustup").args(["toolchain", "list"]))?;
    Ok(out.lines().any(|l| l.starts_with(name)))
}

fn ensure_rust_src(toolchain: &str) -> Result<()> {
    let out = crate::netns::run(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        toolchain,
    ]))?;
    if out.lines().any(|l| l.starts_with("rust-src")) {
        println!("ok: rust-src already installed for {toolchain}");
        return Ok(());
    }
    println!("installing rust-src for {toolchain}");
    run_visible(Command::new("rustup").args([
        "component",
        "add",
        "rust-src",
        "--toolchain",
        toolchain,
    ]))
    .with_context(|| format!("cannot install rust-src for toolchain {toolchain}"))
}

fn ensure_musl_target() -> Result<()> {
    let out = crate::netns::run(Command::new("rustup").args(["target", "list", "--installed"]))?;
    if out.lines().any(|l| l.trim() == MUSL_TARGET) {
        println!("ok: rust target {MUSL_TARGET} already installed");
        return Ok(());
    }
    println!("installing rust target {MUSL_TARGET}");
    run_visible(Command::new("rustup").args(["target", "add", MUSL_TARGET]))
        .with_context(|| format!("cannot install the rust target {MUSL_TARGET}"))
}

/// `kubectl` (for `kubectl kustomize deploy/`): the one on PATH, else
/// Debian's `kubernetes-client`.
fn ensure_kubectl() -> Result<()> {
    let found = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if found {
        println!("ok: kubectl already installed");
        return Ok(());
    }
    if !is_root() {
        bail!("kubectl missing and not root: install Debian's kubernetes-client");
    }
    println!("installing kubernetes-client (kubectl)");
    run_visible(
        Command::new("apt-get")
            .args([
                "install",
                "-y",
                "--no-install-recommends",
                "kubernetes-client",
            ])
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .context("cannot install kubernetes-client")
}

/// The kubernetes-validate release (PyPI) deploy/ is validated with: it
/// carries the OpenAPI schemas up to Kubernetes 1.37.
pub const KUBERNETES_VALIDATE_VERSION: &str = "1.37.0";

/// `<target>/venv/bin/kubernetes-validate`.
pub fn kubernetes_validate_bin() -> PathBuf {
    target_dir().join("venv/bin/kubernetes-validate")
}

/// PyPI's kubernetes-validate in a venv under the target directory.
fn ensure_kubernetes_validate() -> Result<()> {
    let bin = kubernetes_validate_bin();
    let current = Command::new(&bin)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if current
        .as_deref()
        .is_some_and(|v| v.contains(KUBERNETES_VALIDATE_VERSION))
    {
        println!("ok: kubernetes-validate {KUBERNETES_VALIDATE_VERSION} already installed");
        return Ok(());
    }
    let venv = target_dir().join("venv");
    println!(
        "installing kubernetes-validate {KUBERNETES_VALIDATE_VERSION} into {}",
        venv.display()
    );
    run_visible(Command::new("python3").args(["-m", "venv"]).arg(&venv))
        .context("cannot create the venv")?;
    run_visible(
        Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet"])
            .arg(format!(
                "kubernetes-validate=={KUBERNETES_VALIDATE_VERSION}"
            )),
    )
    .context("cannot install kubernetes-validate from PyPI")
}

fn ensure_bpf_linker() -> Result<()> {
    let current = Command::new("bpf-linker")
        .arg("--version")
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if let Some(v) = &current {
        if v.split_whitespace().any(|w| w == BPF_LINKER_VERSION) {
            println!("ok: {v} already installed");
            return Ok(());
        }
    }
    println!(
        "installing bpf-linker {BPF_LINKER_VERSION} (found: {})",
        current.as_deref().unwrap_or("none")
    );
    run_visible(cargo().args([
        "install",
        "bpf-linker",
        "--version",
        BPF_LINKER_VERSION,
        "--locked",
    ]))
    .context("cannot install bpf-linker")
}

fn dpkg_installed(pkg: &str) -> bool {
    Command::new("dpkg")
        .args(["-s", pkg])
        .output()
        .map(|o| {
            o.status.success()
                && String::from_utf8_lossy(&o.stdout).contains("Status: install ok installed")
        })
        .unwrap_or(false)
}

fn ensure_debian_packages() -> Result<()> {
    if Command::new("dpkg").arg("--version").output().is_err() {
        bail!(
            "dpkg not found: install these packages by hand: {}",
            DEBIAN_PACKAGES.join(" ")
        );
    }
    let missing: Vec<&str> = DEBIAN_PACKAGES
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    for p in DEBIAN_PACKAGES.iter().filter(|p| !missing.contains(p)) {
        println!("ok: package {p} already installed");
    }
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!(
            "packages missing ({}) and not root: cannot apt-get install",
            missing.join(" ")
        );
    }
    println!("installing packages: {}", missing.join(" "));
    run_visible(
        Command::new("apt-get")
            .arg("update")
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .context("apt-get update failed")?;
    run_visible(
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .with_context(|| format!("cannot install {}", missing.join(" ")))
}

fn is_bpffs(path: &str) -> Result<bool> {
    let c = std::ffi::CString::new(path)?;
    // SAFETY: statfs writes into the zeroed struct we pass; the path is a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("statfs {path}"));
    }
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_type as i64 == BPF_FS_MAGIC)
}

/// Makes sure bpffs is mounted at /sys/fs/bpf (mounts it if not).
pub fn ensure_bpffs(verbose: bool) -> Result<()> {
    if is_bpffs(BPFFS)? {
        if verbose {
            println!("ok: bpffs mounted at {BPFFS}");
        }
        return Ok(());
    }
    if !is_root() {
        bail!(
            "bpffs is not mounted at {BPFFS} and not root: run `mount -t bpf bpf {BPFFS}` as root"
        );
    }
    println!("mounting bpffs at {BPFFS}");
    crate::netns::run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))?;
    if !is_bpffs(BPFFS)? {
        bail!("mounted bpffs at {BPFFS} but it still is not bpffs");
    }
    Ok(())
}

/// The toolchain `proxy-agent/build.rs` builds the eBPF crate with:
/// `aya_build::Toolchain::default()`, i.e. `rustup run nightly cargo build
/// -Z build-std=core --target bpfel-unknown-none`. Stable cannot stand in: aya-build
/// asks rustup for this toolchain by name, so without it the build fails.
pub const EBPF_TOOLCHAIN: &str = "nightly";

/// What setup says when the eBPF toolchain is missing (it then installs it).
pub fn missing_ebpf_toolchain_message() -> String {
    format!(
        "installing the {EBPF_TOOLCHAIN} toolchain with rust-src: aya-build builds the eBPF crate with \
         `rustup run {EBPF_TOOLCHAIN} cargo build -Z build-std=core`, which fails without it"
    )
}

/// The eBPF toolchain, installed if missing, with rust-src (for build-std).
fn ensure_ebpf_toolchain() -> Result<()> {
    if rustup_has_toolchain(EBPF_TOOLCHAIN)? {
        println!(
            "ok: {EBPF_TOOLCHAIN} toolchain installed (aya-build builds the eBPF crate with it)"
        );
    } else {
        println!("{}", missing_ebpf_toolchain_message());
        run_visible(Command::new("rustup").args([
            "toolchain",
            "install",
            EBPF_TOOLCHAIN,
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]))
        .with_context(|| format!("cannot install the {EBPF_TOOLCHAIN} toolchain"))?;
    }
    ensure_rust_src(EBPF_TOOLCHAIN)
}

/// `cargo xtask setup`: installs what building and testing need; idempotent.
pub fn setup() -> Result<()> {
    setup_datapath()?;
    crate::kube::ensure_built()?;
    crate::kube::ensure_tools_built()?;
    println!("setup complete");
    Ok(())
}

/// What building the agent and running a lab without a control plane need
/// (the demo): the eBPF toolchain, Debian's packages, bpffs.
pub fn setup_datapath() -> Result<()> {
    ensure_rust_src("stable")?;
    ensure_ebpf_toolchain()?;
    ensure_bpf_linker()?;
    ensure_musl_target()?;
    ensure_debian_packages()?;
    ensure_kubectl()?;
    ensure_kubernetes_validate()?;
    ensure_bpffs(true)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The toolchain setup installs is the one aya-build runs: build.rs takes
    /// aya-build's default, which is nightly (not stable with RUSTC_BOOTSTRAP,
    /// as setup used to say).
    #[test]
    fn the_ebpf_toolchain_is_the_one_aya_build_runs() {
        let build_rs = include_str!("../../proxy-agent/build.rs");
        assert!(
            build_rs.contains("aya_build::Toolchain::default()"),
            "{build_rs}"
        );
        assert!(matches!(
            aya_build::Toolchain::default(),
            aya_build::Toolchain::Nightly
        ));
        assert_eq!(EBPF_TOOLCHAIN, "nightly");
        let message = missing_ebpf_toolchain_message();
        assert!(message.contains("rustup run nightly"), "{message}");
        assert!(!message.contains("RUSTC_BOOTSTRAP") && !message.contains("stable"));
    }
}

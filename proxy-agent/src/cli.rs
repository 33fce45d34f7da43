//! The command line. Flags of `run` are all optional here: what is not given
//! comes from the config file (`--config`), then from the defaults (see
//! [`crate::config::Settings::resolve`]).
use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser, Subcommand};

/// The flags of `run`, which the configuration resolves with its file.
pub use crate::config::flags::RunArgs;

/// eBPF replacement for kube-proxy: Service load-balancing in tc programs,
/// kept in sync with the cluster's Services and EndpointSlices.
#[derive(Parser)]
#[command(name = "proxy-agent", version)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Load the datapath, attach it to pod interfaces and keep it in sync.
    Run(Box<RunArgs>),
    /// Read the pinned maps of a running agent.
    Inspect(crate::inspect::InspectArgs),
    /// Remove a datapath an agent left attached (`--on-exit keep`): detach
    /// every program and remove every pin under the directory. A directory
    /// that does not exist is nothing to do: it says so and exits 0.
    Cleanup {
        /// The agent's pin directory.
        #[arg(long, default_value = crate::config::DEFAULT_BPFFS)]
        bpffs: PathBuf,
    },
}

/// The clap command of the binary, for tests and tooling (e.g. checking that
/// a DaemonSet passes only flags that exist).
pub fn cli() -> clap::Command {
    Cli::command()
}

/// Whether `path` is on a bpffs mount.
fn on_bpffs(path: &Path) -> bool {
    use nix::sys::statfs::{statfs, BPF_FS_MAGIC};
    statfs(path).is_ok_and(|st| st.filesystem_type() == BPF_FS_MAGIC)
}

/// What `cleanup --bpffs <path>` may remove: a missing path (nothing to do),
/// or a directory on a bpffs mount below its root. Anything else (a path on
/// another filesystem, e.g. a mistyped `--bpffs /var/lib/x`, or the bpffs
/// mount itself, which holds other programs' pins) is refused with an error
/// naming the path, before anything is removed.
pub fn check_cleanup_path(path: &Path) -> Result<(), String> {
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(());
    }
    if !on_bpffs(path) {
        return Err(format!(
            "--bpffs {}: not on a bpffs mount (statfs type is not BPF_FS_MAGIC); refusing to remove anything",
            path.display()
        ));
    }
    let parent = path
        .canonicalize()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf));
    if !parent.is_some_and(|p| on_bpffs(&p)) {
        return Err(format!(
            "--bpffs {}: the root of a bpffs mount, which holds other programs' pins too; \
             give the agent's own directory (e.g. {})",
            path.display(),
            crate::config::DEFAULT_BPFFS
        ));
    }
    Ok(())
}

/// What `proxy-agent cleanup` did; its `Display` is the line it prints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CleanupOutcome {
    /// The path does not exist: nothing was attached or pinned there.
    NothingThere(PathBuf),
    /// The directory and this many pins under it were removed.
    Removed(PathBuf, usize),
}

impl std::fmt::Display for CleanupOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NothingThere(p) => write!(
                f,
                "nothing to clean up: {} does not exist (no pins, no links removed; check --bpffs if the agent used another directory)",
                p.display()
            ),
            Self::Removed(p, n) => write!(f, "removed {n} pins under {}", p.display()),
        }
    }
}

/// `proxy-agent cleanup --bpffs <path>`: [`check_cleanup_path`], then
/// [`crate::bpf::cleanup`].
///
/// A missing path succeeds (exit 0), saying that nothing was there: cleanup
/// is idempotent, so an uninstall script or a second run after the first
/// has removed everything is not a failure, and the line names the path so
/// a mistyped `--bpffs` is visible. A path that exists but is not a
/// directory on bpffs is refused (an error, exit 1).
pub fn cleanup(path: &Path) -> anyhow::Result<CleanupOutcome> {
    check_cleanup_path(path).map_err(anyhow::Error::msg)?;
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(CleanupOutcome::NothingThere(path.to_path_buf()));
    }
    let n = crate::bpf::cleanup(path)?;
    Ok(CleanupOutcome::Removed(path.to_path_buf(), n))
}

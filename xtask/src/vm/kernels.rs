//! The kernels of the matrix: which Debian package carries each, fetched and
//! unpacked with an apt configuration of the runner's own under
//! `target/kernels/apt` (its own `sources.list`, lists and archive
//! directories): the machine's apt sources are never changed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::setup::{run_visible, target_dir};

/// A kernel of the matrix: a name on the command line and where Debian has it.
#[derive(Clone, Copy, Debug)]
pub struct KernelSpec {
    /// The name `--kernel` takes (`5.10`, `6.1`, `6.12`).
    pub name: &'static str,
    /// Package name prefix; the newest `linux-image-<prefix>*-amd64` is used.
    pub prefix: &'static str,
}

/// Debian's kernels the CI boots: bullseye's 5.10, bookworm's 6.1, trixie's 6.12.
pub const MATRIX: &[KernelSpec] = &[
    KernelSpec {
        name: "5.10",
        prefix: "linux-image-5.10.",
    },
    KernelSpec {
        name: "6.1",
        prefix: "linux-image-6.1.",
    },
    KernelSpec {
        name: "6.12",
        prefix: "linux-image-6.12.",
    },
];

/// The kernel named `name` (one of [`MATRIX`]), or an error listing them.
pub fn spec(name: &str) -> Result<KernelSpec> {
    MATRIX
        .iter()
        .find(|k| k.name == name)
        .copied()
        .with_context(|| {
            let names: Vec<&str> = MATRIX.iter().map(|k| k.name).collect();
            format!(
                "unknown kernel {name:?}: known are {}, host and matrix",
                names.join(", ")
            )
        })
}

/// The Debian suites the runner's apt configuration reads.
const SOURCES: &str = "\
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bullseye main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bullseye-security main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bookworm-security main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main
";

pub(super) fn kernels_dir() -> PathBuf {
    target_dir().join("kernels")
}

/// The runner's own apt: `apt-get`/`apt-cache` with directories under
/// `target/kernels/apt`, never the machine's sources or lists.
fn apt(tool: &str) -> Result<Command> {
    let dir = kernels_dir().join("apt");
    for sub in ["lists/partial", "archives/partial", "cache", "etc/parts"] {
        std::fs::create_dir_all(dir.join(sub))
            .with_context(|| format!("create {}", dir.join(sub).display()))?;
    }
    let list = dir.join("etc/sources.list");
    if std::fs::read_to_string(&list).ok().as_deref() != Some(SOURCES) {
        std::fs::write(&list, SOURCES).with_context(|| format!("write {}", list.display()))?;
    }
    let mut c = Command::new(tool);
    let d = |s: &str| dir.join(s).display().to_string();
    for (k, v) in [
        ("Dir::Etc::SourceList", d("etc/sources.list")),
        ("Dir::Etc::SourceParts", d("etc/parts")),
        ("Dir::State::Lists", d("lists")),
        ("Dir::Cache", d("cache")),
        ("Dir::Cache::Archives", d("archives")),
        ("APT::Architecture", "amd64".into()),
        ("APT::Sandbox::User", "root".into()),
        ("Debug::NoLocking", "1".into()),
    ] {
        c.arg("-o").arg(format!("{k}={v}"));
    }
    c.current_dir(dir.join("archives"));
    Ok(c)
}

/// Updates the runner's apt lists (at most once a day).
fn apt_update() -> Result<()> {
    let stamp = kernels_dir().join("apt/updated");
    let fresh = std::fs::metadata(&stamp)
        .and_then(|m| m.modified())
        .is_ok_and(|t| t.elapsed().unwrap_or_default() < Duration::from_secs(86_400));
    if fresh {
        return Ok(());
    }
    println!("vm: apt-get update (the runner's own sources under target/kernels/apt)");
    run_visible(apt("apt-get")?.args(["-q", "update"]))?;
    std::fs::write(&stamp, b"")?;
    Ok(())
}

/// The newest `linux-image-<prefix>N...-amd64` package (signed, generic).
fn newest_package(spec: &KernelSpec) -> Result<String> {
    let out = apt("apt-cache")?
        .args(["search", "--names-only"])
        .arg(format!("^{}", spec.prefix.replace('.', "\\.")))
        .output()
        .context("cannot run apt-cache")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| is_generic_image(n, spec.prefix))
        .collect();
    names.sort_by_key(|n| version_key(n));
    names.last().map(|s| s.to_string()).with_context(|| {
        format!(
            "no {}*-amd64 package in the runner's apt lists",
            spec.prefix
        )
    })
}

/// `linux-image-6.1.0-57-amd64`, `linux-image-6.12.117+deb13-amd64`: the
/// generic amd64 flavour, not `-cloud-`, `-rt-`, `-dbg` or `-unsigned`.
fn is_generic_image(name: &str, prefix: &str) -> bool {
    let Some(rest) = name.strip_prefix(prefix) else {
        return false;
    };
    let Some(ver) = rest.strip_suffix("-amd64") else {
        return false;
    };
    !ver.contains("cloud") && !ver.contains("rt")
}

/// The numbers of a package name, for ordering `-46` after `-9`.
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect()
}

/// A fetched kernel: its image and its modules directory.
#[derive(Debug)]
pub struct Fetched {
    pub vmlinuz: PathBuf,
    pub modules: PathBuf,
    pub release: String,
}

/// Fetches and extracts the kernel of `spec` under `target/kernels/<name>`
/// (kept: a second call reuses it).
pub fn fetch(spec: &KernelSpec) -> Result<Fetched> {
    let root = kernels_dir().join(spec.name);
    if let Ok(f) = find_extracted(&root) {
        println!("vm: kernel {} cached ({})", spec.name, f.release);
        return Ok(f);
    }
    apt_update()?;
    let pkg = newest_package(spec)?;
    println!("vm: fetching {pkg}");
    run_visible(apt("apt-get")?.args(["-q", "download", &pkg]))?;
    let archives = kernels_dir().join("apt/archives");
    let deb = std::fs::read_dir(&archives)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{pkg}_")) && n.ends_with(".deb"))
        })
        .with_context(|| {
            format!(
                "apt-get download left no {pkg}_*.deb in {}",
                archives.display()
            )
        })?;
    let tmp = root.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    run_visible(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tmp))?;
    let _ = std::fs::remove_dir_all(&root);
    std::fs::rename(&tmp, &root)?;
    find_extracted(&root)
}

fn find_extracted(root: &Path) -> Result<Fetched> {
    let boot = root.join("boot");
    let vmlinuz = std::fs::read_dir(&boot)
        .with_context(|| format!("read {}", boot.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-"))
        })
        .with_context(|| format!("no vmlinuz in {}", boot.display()))?;
    let release = vmlinuz
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("vmlinuz-"))
        .unwrap_or_default()
        .to_owned();
    let modules = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|d| root.join(d).join(&release))
        .find(|d| d.join("modules.order").is_file())
        .with_context(|| format!("no modules.order for {release} under {}", root.display()))?;
    Ok(Fetched {
        vmlinuz,
        modules,
        release,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_generic_images_newest_first() {
        assert!(is_generic_image(
            "linux-image-6.12.117+deb13-amd64",
            "linux-image-6.12."
        ));
        assert!(!is_generic_image(
            "linux-image-6.12.117+deb13-cloud-amd64",
            "linux-image-6.12."
        ));
        assert!(!is_generic_image(
            "linux-image-6.12.117+deb13-rt-amd64",
            "linux-image-6.12."
        ));
        assert!(!is_generic_image(
            "linux-image-5.10.0-46-amd64-dbg",
            "linux-image-5.10."
        ));
        assert!(
            version_key("linux-image-5.10.0-46-amd64") > version_key("linux-image-5.10.0-9-amd64")
        );
    }
}

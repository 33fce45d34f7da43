//! The real Kubernetes components the lab runs (etcd, kube-apiserver,
//! kube-controller-manager, kubectl, kube-proxy), built by `cargo xtask
//! setup` from their published Go modules, pinned by the project's own
//! go.mod/go.sum files under `xtask/go/`:
//!
//! | module | builds |
//! | --- | --- |
//! | `xtask/go/kubernetes` | `k8s.io/kubernetes` [`KUBERNETES_VERSION`]'s commands, its staging modules replaced by their published v0.x twins |
//! | `xtask/go/etcd` | a few-line main around `etcdmain.Main` of `go.etcd.io/etcd/server/v3` [`ETCD_VERSION`] |
//! | `xtask/go/helm` | `helm` of `helm.sh/helm/v4` [`HELM_VERSION`] (deploy/helm's checks) |
//! | `xtask/go/prometheus` | `promtool` of `github.com/prometheus/prometheus` [`PROMETHEUS_VERSION`] (deploy/monitoring's checks) |
//!
//! The binaries go to `<target>/kube/bin`. A stamp there holds a hash of
//! everything the build depends on (the module files, the flags, the Go
//! version): setup rebuilds only when it changed. helm and promtool have a
//! stamp each ([`GO_TOOLS`]), so a change to one module rebuilds only its
//! tool. The Go build cache and module cache are the machine's (`go env
//! GOCACHE GOMODCACHE`), so a fresh clone on a machine that built them once
//! only links.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::progress::Heartbeat;
use crate::setup::{target_dir, workspace_root};

/// The Kubernetes release of every component built here.
pub const KUBERNETES_VERSION: &str = "v1.37.2";
/// The etcd server release.
pub const ETCD_VERSION: &str = "v3.6.16";

/// The commands of `k8s.io/kubernetes` that setup builds (the `tool`
/// directives of `xtask/go/kubernetes/go.mod`).
pub const KUBERNETES_COMMANDS: &[&str] = &[
    "kube-apiserver",
    "kube-controller-manager",
    "kubectl",
    "kube-proxy",
];

/// A tool built from a Go module of its own under `xtask/go/<module>`,
/// with a stamp of its own (`.stamp-<bin>`).
#[derive(Clone, Copy, Debug)]
pub struct GoTool {
    /// The directory under `xtask/go/`.
    pub module: &'static str,
    /// The pinned module, as its go.mod requires it.
    pub requires: &'static str,
    /// The version its go.mod pins.
    pub version: &'static str,
    /// The command's package (a `tool` directive of the go.mod).
    pub package: &'static str,
    /// The binary's name in [`bin_dir`].
    pub bin: &'static str,
    /// `-X` flags that stamp the version the binary reports.
    pub version_ldflags: &'static str,
}

/// The Helm release deploy/helm is checked with.
pub const HELM_VERSION: &str = "v4.3.2";
/// The Prometheus module (release 3.16.0) whose promtool checks
/// deploy/monitoring's rules.
pub const PROMETHEUS_VERSION: &str = "v0.316.0";

/// helm and promtool.
pub const GO_TOOLS: &[GoTool] = &[
    GoTool {
        module: "helm",
        requires: "helm.sh/helm/v4",
        version: HELM_VERSION,
        package: "helm.sh/helm/v4/cmd/helm",
        bin: "helm",
        // Else `helm version` says only "v4.3".
        version_ldflags: "-X helm.sh/helm/v4/internal/version.version=v4.3.2",
    },
    GoTool {
        module: "prometheus",
        requires: "github.com/prometheus/prometheus",
        version: PROMETHEUS_VERSION,
        package: "github.com/prometheus/prometheus/cmd/promtool",
        bin: "promtool",
        version_ldflags: "",
    },
];

/// Where the built binaries live.
pub fn bin_dir() -> PathBuf {
    target_dir().join("kube/bin")
}

/// The path of one built binary (`etcd`, `kube-apiserver`, ...).
pub fn bin(name: &str) -> PathBuf {
    bin_dir().join(name)
}

fn go_dir(module: &str) -> PathBuf {
    workspace_root().join("xtask/go").join(module)
}

/// The `-ldflags` that stamp the version, as Kubernetes' own build does
/// (`hack/lib/version.sh`); without them the binaries say v0.0.0.
fn kubernetes_ldflags() -> String {
    let v = KUBERNETES_VERSION.trim_start_matches('v');
    let mut parts = v.split('.');
    let major = parts.next().unwrap_or("1");
    let minor = parts.next().unwrap_or("0");
    let mut flags = String::from("-s -w");
    for pkg in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        flags.push_str(&format!(
            " -X {pkg}.gitVersion={KUBERNETES_VERSION} -X {pkg}.gitMajor={major} \
             -X {pkg}.gitMinor={minor} -X {pkg}.gitTreeState=clean"
        ));
    }
    flags
}

/// The `go` command: from PATH, else Go's default install location.
fn go_command() -> Result<PathBuf> {
    let on_path = Command::new("go")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success());
    if on_path {
        return Ok(PathBuf::from("go"));
    }
    let default = PathBuf::from("/usr/local/go/bin/go");
    if default.is_file() {
        return Ok(default);
    }
    bail!(
        "no Go toolchain found (neither `go` on PATH nor /usr/local/go/bin/go): the lab's \
         Kubernetes components (etcd, kube-apiserver, kube-controller-manager, kubectl, \
         kube-proxy) are built from their Go modules; install Go 1.26 or newer"
    )
}

fn go_in(go: &Path, dir: &Path) -> Command {
    let mut c = Command::new(go);
    c.current_dir(dir)
        // The version go.mod names is the one to build with; never fetch another.
        .env("GOTOOLCHAIN", "local")
        .env("CGO_ENABLED", "0")
        .env("GOFLAGS", "-mod=readonly -buildvcs=false");
    c
}

/// The hash of everything the build depends on.
fn stamp(go: &Path) -> Result<String> {
    let mut h = Sha256::new();
    for module in ["kubernetes", "etcd"] {
        let dir = go_dir(module);
        for file in ["go.mod", "go.sum", "main.go"] {
            let p = dir.join(file);
            if p.is_file() {
                h.update(file.as_bytes());
                h.update(std::fs::read(&p).with_context(|| format!("read {}", p.display()))?);
            }
        }
    }
    h.update(kubernetes_ldflags().as_bytes());
    h.update(KUBERNETES_COMMANDS.join(",").as_bytes());
    let version = Command::new(go)
        .arg("version")
        .env("GOTOOLCHAIN", "local")
        .output()
        .context("go version")?;
    h.update(&version.stdout);
    Ok(format!("{:x}", h.finalize()))
}

/// How often a long `go build` says it is still going.
const BEAT: std::time::Duration = std::time::Duration::from_secs(30);

fn all_built() -> bool {
    KUBERNETES_COMMANDS
        .iter()
        .chain(std::iter::once(&"etcd"))
        .all(|b| bin(b).is_file())
}

/// Builds the components unless the stamp says they are current.
pub fn ensure_built() -> Result<()> {
    let go = go_command()?;
    let want = stamp(&go)?;
    let stamp_file = bin_dir().join(".stamp");
    let have = std::fs::read_to_string(&stamp_file).unwrap_or_default();
    if have.trim() == want && all_built() {
        println!(
            "ok: Kubernetes {KUBERNETES_VERSION} ({}) and etcd {ETCD_VERSION} already built in {}",
            KUBERNETES_COMMANDS.join(", "),
            bin_dir().display()
        );
        return Ok(());
    }
    std::fs::create_dir_all(bin_dir())?;
    let _ = std::fs::remove_file(&stamp_file);
    let started = Instant::now();
    // `go build` says nothing for minutes: a line every 30 s says it goes on.
    let total = KUBERNETES_COMMANDS.len() + 1;
    println!(
        "building etcd {ETCD_VERSION} (1 of {total}) from go.etcd.io/etcd/server/v3 into {} \
         (the first build on a machine downloads its modules and takes minutes)",
        bin_dir().display()
    );
    let t = Instant::now();
    let beat = Heartbeat::start(format!("building etcd (1 of {total})"), BEAT);
    crate::setup::run_visible(
        go_in(&go, &go_dir("etcd"))
            .args(["build", "-trimpath", "-ldflags", "-s -w", "-o"])
            .arg(bin("etcd"))
            .arg("."),
    )
    .context("cannot build etcd")?;
    drop(beat);
    println!("built etcd in {:.0} s", t.elapsed().as_secs_f64());
    for (i, cmd) in KUBERNETES_COMMANDS.iter().enumerate() {
        let t = Instant::now();
        let step = format!("{} of {total}", i + 2);
        println!("building {cmd} {KUBERNETES_VERSION} ({step}) from k8s.io/kubernetes/cmd/{cmd}");
        let beat = Heartbeat::start(format!("building {cmd} ({step})"), BEAT);
        crate::setup::run_visible(
            go_in(&go, &go_dir("kubernetes"))
                .args(["build", "-trimpath", "-ldflags"])
                .arg(kubernetes_ldflags())
                .arg("-o")
                .arg(bin(cmd))
                .arg(format!("k8s.io/kubernetes/cmd/{cmd}")),
        )
        .with_context(|| format!("cannot build {cmd}"))?;
        drop(beat);
        println!(
            "built {cmd} in {:.0} s ({} so far)",
            t.elapsed().as_secs_f64(),
            crate::progress::elapsed(started.elapsed())
        );
    }
    std::fs::write(&stamp_file, format!("{want}\n"))?;
    println!(
        "built the Kubernetes components in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn tool_ldflags(tool: &GoTool) -> String {
    format!("-s -w {}", tool.version_ldflags).trim().to_string()
}

/// The hash of everything one tool's build depends on.
fn tool_stamp(go: &Path, tool: &GoTool) -> Result<String> {
    let mut h = Sha256::new();
    let dir = go_dir(tool.module);
    for file in ["go.mod", "go.sum"] {
        let p = dir.join(file);
        h.update(file.as_bytes());
        h.update(std::fs::read(&p).with_context(|| format!("read {}", p.display()))?);
    }
    h.update(tool.package.as_bytes());
    h.update(tool_ldflags(tool).as_bytes());
    let version = Command::new(go)
        .arg("version")
        .env("GOTOOLCHAIN", "local")
        .output()
        .context("go version")?;
    h.update(&version.stdout);
    Ok(format!("{:x}", h.finalize()))
}

/// Builds helm and promtool ([`GO_TOOLS`]), each unless its own stamp says
/// it is current.
pub fn ensure_tools_built() -> Result<()> {
    let go = go_command()?;
    std::fs::create_dir_all(bin_dir())?;
    for tool in GO_TOOLS {
        let want = tool_stamp(&go, tool)?;
        let stamp_file = bin_dir().join(format!(".stamp-{}", tool.bin));
        let have = std::fs::read_to_string(&stamp_file).unwrap_or_default();
        if have.trim() == want && bin(tool.bin).is_file() {
            println!(
                "ok: {} ({} {}) already built in {}",
                tool.bin,
                tool.requires,
                tool.version,
                bin_dir().display()
            );
            continue;
        }
        let _ = std::fs::remove_file(&stamp_file);
        println!(
            "building {} from {} {} into {} (the first build on a machine downloads its \
             modules and takes minutes)",
            tool.bin,
            tool.package,
            tool.version,
            bin_dir().display()
        );
        let t = Instant::now();
        crate::setup::run_visible(
            go_in(&go, &go_dir(tool.module))
                .args(["build", "-trimpath", "-ldflags"])
                .arg(tool_ldflags(tool))
                .arg("-o")
                .arg(bin(tool.bin))
                .arg(tool.package),
        )
        .with_context(|| format!("cannot build {}", tool.bin))?;
        std::fs::write(&stamp_file, format!("{want}\n"))?;
        println!("built {} in {:.0} s", tool.bin, t.elapsed().as_secs_f64());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The versions this module reports are the ones its go.mod files pin,
    /// and every command built is a tool of the Kubernetes module (else
    /// `go build -mod=readonly` would refuse it on a fresh machine).
    #[test]
    fn the_pinned_versions_are_the_go_mod_files_own() {
        let kube = std::fs::read_to_string(go_dir("kubernetes").join("go.mod")).unwrap();
        assert!(
            kube.contains(&format!("k8s.io/kubernetes {KUBERNETES_VERSION}")),
            "{kube}"
        );
        let staging = format!("v0.{}", KUBERNETES_VERSION.trim_start_matches("v1."));
        for m in ["k8s.io/api", "k8s.io/apiserver", "k8s.io/client-go"] {
            assert!(
                kube.contains(&format!("{m} => {m} {staging}")),
                "{m} not replaced by {staging}"
            );
        }
        for cmd in KUBERNETES_COMMANDS {
            assert!(
                kube.contains(&format!("k8s.io/kubernetes/cmd/{cmd}\n")),
                "{cmd} is not a tool of xtask/go/kubernetes/go.mod"
            );
        }
        let etcd = std::fs::read_to_string(go_dir("etcd").join("go.mod")).unwrap();
        assert!(
            etcd.contains(&format!("go.etcd.io/etcd/server/v3 {ETCD_VERSION}")),
            "{etcd}"
        );
    }

    /// helm and promtool: the versions named here are their go.mod files'
    /// own, and each command is a tool of its module.
    #[test]
    fn the_tools_are_their_go_mod_files_own() {
        for tool in GO_TOOLS {
            let m = std::fs::read_to_string(go_dir(tool.module).join("go.mod")).unwrap();
            assert!(
                m.contains(&format!("{} {}", tool.requires, tool.version)),
                "{}: {m}",
                tool.module
            );
            assert!(
                m.contains(&format!("tool {}\n", tool.package)),
                "{} is not a tool of xtask/go/{}/go.mod",
                tool.package,
                tool.module
            );
            let v = tool.version.trim_start_matches('v');
            assert!(
                tool.version_ldflags.is_empty() || tool.version_ldflags.ends_with(v),
                "{}",
                tool.version_ldflags
            );
        }
    }

    #[test]
    fn ldflags_stamp_the_version_kubernetes_reports() {
        let f = kubernetes_ldflags();
        assert!(f.contains("k8s.io/component-base/version.gitVersion=v1.37.2"));
        assert!(f.contains("gitMajor=1") && f.contains("gitMinor=37"), "{f}");
    }
}

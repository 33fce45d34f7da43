//! `cargo xtask test --kernel <name>`: the packet tests (and a one-node lab
//! smoke, and the SCTP lab tests) inside a qemu virtual machine booting one
//! of Debian's kernels, since verifiers and attach points differ between
//! kernels (and this machine's kernel has no SCTP).
//!
//! Kernels come from Debian's own packages, fetched with an apt configuration
//! of this runner's own under `target/kernels/apt` (its own `sources.list`,
//! lists and archive directories): the machine's apt sources are never
//! changed. The guest boots a busybox initramfs holding the modules it needs
//! (virtio, 9p, overlay, veth, sch_ingress, cls_bpf), mounts the host's root
//! filesystem read-only over 9p with a tmpfs overlay on top, chroots into it
//! and runs a script the host wrote; the script prints one result line per
//! step on the serial console, which the runner parses. qemu runs under TCG
//! (software emulation) unless `KPR_VM_ACCEL=kvm`; every wait is bounded and
//! the VM is killed when the runner stops.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

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

/// Modules the guest loads, in this order after their dependencies (those
/// built into a kernel are skipped).
const GUEST_MODULES: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "overlay",
    "veth",
    "sch_ingress",
    "cls_bpf",
];

/// Modules the `lab-sctp` step loads in the guest, after S41 (which must see
/// the proxy not load sctp) and before N4, N10 and D3 (which need it), in this
/// order after their dependencies. `crc32c_generic` first: libcrc32c's only
/// tie to it is `softdep=pre: crc32c`, an algorithm alias no `depends=`
/// names, and libcrc32c's init fails without a crc32c provider (the guest's
/// `request_module` finds no modprobe to load one).
const SCTP_MODULES: &[&str] = &["crc32c_generic", "sctp"];

fn kernels_dir() -> PathBuf {
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

/// Modules to load for `wanted`, dependencies first, as paths relative to
/// the modules directory. `order` is the package's `modules.order` (every
/// module it ships, one path a line); `deps_of` gives a module's `depends=`
/// (from its `.modinfo`; the package has no `modules.dep`, depmod makes it
/// on installation). Modules the kernel has built in are not in
/// `modules.order` and are skipped.
pub fn module_order(
    order: &str,
    wanted: &[&str],
    deps_of: &mut dyn FnMut(&str) -> Vec<String>,
) -> Vec<String> {
    use std::collections::HashMap;
    let norm = |s: &str| s.replace('-', "_");
    let paths: HashMap<String, String> = order
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|p| (norm(module_name(p)), p.to_owned()))
        .collect();
    fn visit(
        name: &str,
        paths: &HashMap<String, String>,
        deps_of: &mut dyn FnMut(&str) -> Vec<String>,
        out: &mut Vec<String>,
        depth: usize,
    ) {
        let Some(path) = paths.get(name) else {
            return;
        };
        if out.contains(path) || depth > 32 {
            return;
        }
        for d in deps_of(path) {
            visit(&d.replace('-', "_"), paths, deps_of, out, depth + 1);
        }
        if !out.contains(path) {
            out.push(path.clone());
        }
    }
    let mut out = Vec::new();
    for w in wanted {
        visit(&norm(w), &paths, deps_of, &mut out, 0);
    }
    out
}

/// The `depends=` of a module's `.modinfo` (NUL-separated `key=value`
/// strings in the object).
pub fn modinfo_depends(ko: &[u8]) -> Vec<String> {
    const KEY: &[u8] = b"\0depends=";
    let Some(i) = ko.windows(KEY.len()).position(|w| w == KEY) else {
        return Vec::new();
    };
    let rest = &ko[i + KEY.len()..];
    let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end])
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `kernel/fs/9p/9p.ko.xz` → `9p`.
fn module_name(path: &str) -> &str {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split(".ko").next().unwrap_or(file)
}

/// A `newc` cpio archive written in memory (what the kernel unpacks as an
/// initramfs).
#[derive(Default)]
struct Cpio {
    buf: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.ino += 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        self.buf.extend_from_slice(header.as_bytes());
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }
    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }
    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040755, &[]);
    }
    fn file(&mut self, name: &str, exec: bool, data: &[u8]) {
        self.entry(name, if exec { 0o100755 } else { 0o100644 }, data);
    }
    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.buf
    }
}

/// The guest's `/init`: modules, the host's root read-only over 9p under a
/// tmpfs overlay, the kernel filesystems, then the script named by
/// `kpr.script=` on the command line, chrooted; its exit status is printed
/// as `KPR-VM-DONE rc=<n>` before the VM powers off.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod "/mods/$m" || echo "KPR-VM insmod $m failed"; done
script=$(tr ' ' '\n' < /proc/cmdline | sed -n 's/^kpr.script=//p')
mkdir -p /host /rw /root
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144,cache=loose host /host || echo "KPR-VM mount 9p failed"
mount -t tmpfs -o size=1500m tmpfs /rw
mkdir -p /rw/upper /rw/work
if ! mount -t overlay overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work /root; then
  echo "KPR-VM overlay failed: read-only root with tmpfs on /tmp and /run"
  mount --bind /host /root
fi
mount -t proc proc /root/proc
mount -t sysfs sys /root/sys
mount -t devtmpfs dev /root/dev
# A checkout (or target directory) under /tmp or /run stays visible through
# the fresh tmpfs mounted there: kpr.keep= names it, moved aside and back.
keep=$(tr ' ' '\n' < /proc/cmdline | sed -n 's/^kpr.keep=//p' | tr ',' ' ')
i=0
for k in $keep; do mkdir -p /keep$i; mount --bind "/root$k" /keep$i || echo "KPR-VM keep $k failed"; i=$((i+1)); done
mount -t tmpfs tmpfs /root/tmp
mount -t tmpfs tmpfs /root/run
i=0
for k in $keep; do mkdir -p "/root$k"; mount --move /keep$i "/root$k" || echo "KPR-VM keep $k failed"; i=$((i+1)); done
mount -t bpf bpf /root/sys/fs/bpf
mount -t cgroup2 cgroup2 /root/sys/fs/cgroup
mount -t debugfs debugfs /root/sys/kernel/debug 2>/dev/null
ip link set lo up
echo "KPR-VM-BOOTED $(uname -r)"
chroot /root /bin/sh "$script"
echo "KPR-VM-DONE rc=$?"
poweroff -f
"#;

/// The guest mounts fresh tmpfs on `/tmp` and `/run`: the checkout and the
/// target directory, when they live there, are kept visible (`kpr.keep=`).
fn kept_paths(paths: &[PathBuf]) -> Result<Vec<String>> {
    let mut kept: Vec<String> = Vec::new();
    for p in paths {
        let p = p.canonicalize().unwrap_or_else(|_| p.clone());
        if !(p.starts_with("/tmp") || p.starts_with("/run")) {
            continue;
        }
        let text = p.to_string_lossy().into_owned();
        if text.contains(|c: char| c.is_whitespace() || c == ',') {
            bail!(
                "the kernel matrix cannot keep {text} visible in its VMs (a space or comma \
                 in the path of a checkout under /tmp or /run): clone elsewhere"
            );
        }
        if !kept.iter().any(|k| p.starts_with(k)) {
            kept.retain(|k| !Path::new(k).starts_with(&p));
            kept.push(text);
        }
    }
    Ok(kept)
}

fn kept_paths_arg() -> Result<String> {
    let kept = kept_paths(&[crate::setup::workspace_root(), crate::setup::target_dir()])?;
    Ok(if kept.is_empty() {
        String::new()
    } else {
        format!(" kpr.keep={}", kept.join(","))
    })
}

/// The machine's busybox: the guest's initramfs gets a copy, and the
/// guest's scripts (chrooted into this machine's root) run it for `insmod`.
fn busybox() -> Result<&'static Path> {
    ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.is_file())
        .context("busybox not found (cargo xtask setup installs busybox-static)")
}

/// [`module_order`] of `wanted` in `kernel`'s package.
fn kernel_module_order(kernel: &Fetched, wanted: &[&str]) -> Result<Vec<String>> {
    let list = std::fs::read_to_string(kernel.modules.join("modules.order"))?;
    let mut deps_of = |path: &str| {
        decompress(&kernel.modules.join(path))
            .map(|ko| modinfo_depends(&ko))
            .unwrap_or_default()
    };
    Ok(module_order(&list, wanted, &mut deps_of))
}

/// A module the guest loads with `insmod`: its name as `/proc/modules`
/// lists it, and the decompressed object on this machine's filesystem
/// (which the guest sees at the same path).
#[derive(Debug, Clone, PartialEq)]
pub struct GuestModule {
    pub name: String,
    pub path: PathBuf,
}

/// [`SCTP_MODULES`] of `kernel`, dependencies first, decompressed (the
/// guest's busybox `insmod` takes plain objects) into
/// `target/kernels/<name>.sctp/` (remade on every run).
fn sctp_modules(name: &str, kernel: &Fetched) -> Result<Vec<GuestModule>> {
    let order = kernel_module_order(kernel, SCTP_MODULES)?;
    if !order.iter().any(|m| module_name(m) == "sctp") {
        bail!(
            "kernel {name}: no sctp module in {} (built in, or not shipped)",
            kernel.modules.join("modules.order").display()
        );
    }
    let dir = kernels_dir().join(format!("{name}.sctp"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    order
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let module = module_name(m).replace('-', "_");
            let path = dir.join(format!("{i:02}-{module}.ko"));
            std::fs::write(&path, decompress(&kernel.modules.join(m))?)
                .with_context(|| format!("write {}", path.display()))?;
            Ok(GuestModule { name: module, path })
        })
        .collect()
}

/// Shell lines loading `modules` in order with `busybox insmod`, skipping
/// those `/proc/modules` lists already; the first failure exits the
/// (sub)shell with status 1 after a `KPR-SCTP insmod <name> failed` line.
pub fn insmod_lines(modules: &[GuestModule], busybox: &Path) -> String {
    modules
        .iter()
        .map(|m| {
            format!(
                "grep -q '^{name} ' /proc/modules || {bb} insmod {path} || {{ echo \"KPR-SCTP insmod {name} failed\"; exit 1; }}\n",
                name = m.name,
                bb = busybox.display(),
                path = m.path.display()
            )
        })
        .collect()
}

/// Builds the initramfs for `kernel` (busybox, `/init`, the modules
/// decompressed) at `target/kernels/<name>.initrd`.
fn initramfs(name: &str, kernel: &Fetched) -> Result<PathBuf> {
    let busybox = busybox()?;
    let order = kernel_module_order(kernel, GUEST_MODULES)?;
    let mut cpio = Cpio::default();
    for d in [
        "bin", "proc", "sys", "dev", "mods", "host", "rw", "root", "tmp",
    ] {
        cpio.dir(d);
    }
    cpio.file("bin/busybox", true, &std::fs::read(busybox)?);
    cpio.file("init", true, INIT.as_bytes());
    let mut names = String::new();
    for (i, m) in order.iter().enumerate() {
        let path = kernel.modules.join(m);
        let data = decompress(&path)?;
        let file = format!("{i:02}-{}.ko", module_name(m));
        cpio.file(&format!("mods/{file}"), false, &data);
        names.push_str(&file);
        names.push('\n');
    }
    cpio.file("modules.order", false, names.as_bytes());
    let out = kernels_dir().join(format!("{name}.initrd"));
    std::fs::write(&out, cpio.finish())?;
    Ok(out)
}

/// A module's bytes, decompressed; `modules.order` says `x.ko` where the
/// package ships `x.ko.xz` (or `.zst`, `.gz`).
fn decompress(path: &Path) -> Result<Vec<u8>> {
    let path = &["", ".xz", ".zst", ".gz"]
        .iter()
        .map(|ext| PathBuf::from(format!("{}{ext}", path.display())))
        .find(|p| p.is_file())
        .unwrap_or_else(|| path.to_owned());
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let tool = match ext {
        "xz" => "xz",
        "zst" => "zstd",
        "gz" => "gzip",
        _ => return std::fs::read(path).with_context(|| format!("read {}", path.display())),
    };
    let out = Command::new(tool)
        .arg("-dc")
        .arg(path)
        .output()
        .with_context(|| format!("cannot run {tool}"))?;
    if !out.status.success() {
        bail!("{tool} -dc {} failed", path.display());
    }
    Ok(out.stdout)
}

/// What one VM run printed: the result lines of the script's steps.
#[derive(Debug, Default)]
pub struct VmOutput {
    /// Every console line.
    pub lines: Vec<String>,
    /// The script's exit status (`KPR-VM-DONE rc=<n>`), if it got there.
    pub rc: Option<i32>,
}

/// Parses `KPR-VM-DONE rc=<n>`.
pub fn parse_done(line: &str) -> Option<i32> {
    line.trim()
        .strip_prefix("KPR-VM-DONE rc=")
        .and_then(|s| s.trim().parse().ok())
}

/// Boots `spec`'s kernel and runs `script` (a shell script, on the host's
/// filesystem, run as root in the guest) within `timeout`; the VM is killed
/// at the deadline or when this returns.
pub fn run_script(spec: &KernelSpec, script: &Path, timeout: Duration) -> Result<VmOutput> {
    let kernel = fetch(spec)?;
    let initrd = initramfs(spec.name, &kernel)?;
    let (accel, cpu) = match std::env::var("KPR_VM_ACCEL").as_deref() {
        Ok("kvm") => ("kvm", "host"),
        _ => ("tcg,thread=multi", "max"),
    };
    let mut qemu = Command::new("qemu-system-x86_64");
    // SAFETY: prctl is async-signal-safe; the VM dies with the runner, even
    // when the runner is killed.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut qemu, || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = qemu
        .args(["-machine", "q35", "-accel", accel, "-cpu", cpu])
        .args(["-smp", "2", "-m", "3072", "-nographic", "-no-reboot"])
        .args(["-nic", "none", "-serial", "stdio", "-monitor", "none"])
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .arg("-append")
        .arg(format!(
            "console=ttyS0 panic=-1 loglevel=4 mitigations=off kpr.script={}{}",
            script.display(),
            kept_paths_arg()?
        ))
        .args([
            "-virtfs",
            "local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("cannot start qemu-system-x86_64 (cargo xtask setup installs qemu-system-x86)")?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + timeout;
    let mut out = VmOutput::default();
    let result = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break Err(anyhow::anyhow!(
                "kernel {}: no result within {timeout:?}",
                spec.name
            ));
        }
        match rx.recv_timeout(left.min(Duration::from_secs(1))) {
            Ok(line) => {
                let line = line.trim_end_matches('\r').to_owned();
                println!("[{}] {line}", spec.name);
                let _ = std::io::stdout().flush();
                if let Some(rc) = parse_done(&line) {
                    out.rc = Some(rc);
                }
                out.lines.push(line);
                if out.rc.is_some() {
                    break Ok(());
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Ok(Some(st)) = child.try_wait() {
                    break Err(anyhow::anyhow!(
                        "kernel {}: qemu exited ({st}) before the script finished",
                        spec.name
                    ));
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                break Err(anyhow::anyhow!(
                    "kernel {}: the VM's console closed before the script finished",
                    spec.name
                ));
            }
        }
    };
    // Powered off or not: never leave a VM behind.
    let stop = Instant::now() + Duration::from_secs(10);
    while Instant::now() < stop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    result.map(|()| out)
}

/// The test binary `<name>` of `package`, built with the package selection
/// of `cargo xtask test`'s own pass (`--workspace --exclude proxy-ebpf`):
/// another selection unifies the dependencies' features differently and
/// rebuilds them (about 2 minutes here) instead of reusing that pass's build.
fn test_binary(package: &str, test: &str) -> Result<PathBuf> {
    let out = crate::setup::cargo()
        .args(["test", "--workspace", "--exclude", "proxy-ebpf"])
        .args(["--test", test, "--no-run", "--message-format", "json"])
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo test --no-run")?;
    if !out.status.success() {
        bail!("cargo test --test {test} --no-run failed");
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"]["name"] == test)
        .filter(|v| {
            v["package_id"].as_str().is_some_and(|id| {
                // `path+file:///…/proxy-agent#0.1.0` (cargo ≥ 1.77) or
                // `proxy-agent 0.1.0 (path+file:///…)`.
                id.contains(&format!("/{package}#"))
                    || id.contains(&format!("#{package}@"))
                    || id.starts_with(&format!("{package} "))
            })
        })
        .find_map(|v| v["executable"].as_str().map(PathBuf::from))
        .with_context(|| format!("cargo built no test binary {test} of {package}"))
}

/// What a kernel run executes: the verifier's statistics, the packet tests,
/// the attach-mode tests and, with `lab`, the one-node lab smoke (S1) and
/// with `sctp` the SCTP lab tests.
struct Binaries {
    datapath: PathBuf,
    attach: PathBuf,
    verifier_stats: PathBuf,
    lab: Option<LabBinaries>,
}

struct LabBinaries {
    agent: PathBuf,
    server: PathBuf,
    /// `tests/lab.rs`, for the smoke.
    smoke: Option<PathBuf>,
    /// `tests/lab_ipv6.rs`, for the IPv6 smoke (with the smoke).
    ipv6: Option<PathBuf>,
    /// `tests/lab_sctp.rs`.
    sctp: Option<PathBuf>,
}

/// The lab test the kernel matrix runs (one node, a ClusterIP, pods added
/// and removed, ECONNREFUSED with none).
const LAB_SMOKE: &str = "s1_basic_endpoint_added_and_removed";

/// The IPv6 lab test the kernel matrix runs beside the smoke (a dual-stack
/// lab; both ClusterIPs of two dual-stack Services answered by every pod):
/// the IPv6 programs, tail-called from the IPv4 ones, on every kernel.
const LAB_IPV6_SMOKE: &str = "d_lab_3_dual_stack_service_answers_on_both_cluster_ips";

/// The SCTP lab test run before the guest loads sctp: the proxy must not
/// load it (S41).
const SCTP_UNLOADED_TEST: &str = "s41_sctp_service_does_not_load_the_sctp_module";
/// The SCTP lab tests run once the guest loaded sctp, with SCTP required.
const SCTP_TESTS: &[&str] = &[
    "n4_pod_to_service_sctp",
    "n10_endpoint_to_service_sctp",
    "d3_pod_to_secondary_cluster_ip_and_node_port_sctp",
];

fn build(lab: bool, sctp: bool) -> Result<Binaries> {
    // The package selection of `cargo xtask test`'s own pass (see
    // [`test_binary`]): a `-p proxy-agent --release` build of the example
    // rebuilt the agent's dependencies with other features (2.5 minutes
    // here). The eBPF object is the same in either profile.
    run_visible(crate::setup::cargo().args([
        "build",
        "--workspace",
        "--exclude",
        "proxy-ebpf",
        "--example",
        "verifier_stats",
    ]))?;
    let lab = if lab || sctp {
        let agent = crate::setup::build_agent()?;
        let server = crate::setup::build_lab_server()?;
        Some(LabBinaries {
            agent,
            server,
            smoke: lab.then(|| test_binary("xtask", "lab")).transpose()?,
            ipv6: lab.then(|| test_binary("xtask", "lab_ipv6")).transpose()?,
            sctp: sctp.then(|| test_binary("xtask", "lab_sctp")).transpose()?,
        })
    } else {
        None
    };
    Ok(Binaries {
        datapath: test_binary("proxy-agent", "datapath")?,
        attach: test_binary("proxy-agent", "attach")?,
        verifier_stats: target_dir().join("debug/examples/verifier_stats"),
        lab,
    })
}

/// The guest's script: each step prints `KPR-STEP <name> rc=<n>`; the script
/// exits non-zero if any step failed. `sctp_modules`: what the `lab-sctp`
/// step loads between S41 and the tests that need SCTP.
fn script(b: &Binaries, packet_tests: bool, sctp_modules: &[GuestModule]) -> String {
    let root = crate::setup::workspace_root();
    let mut s = format!(
        "set -u\nexport KPR_REQUIRE_ROOT_TESTS=1 HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin\ncd {}\nfail=0\n",
        root.display()
    );
    let mut step = |name: &str, cmd: String| {
        s.push_str(&format!(
            "echo \"KPR-STEP-START {name}\"\n{cmd}\nrc=$?\necho \"KPR-STEP {name} rc=$rc\"\n[ $rc -eq 0 ] || fail=1\n"
        ));
    };
    step("verifier", b.verifier_stats.display().to_string());
    if packet_tests {
        step(
            "packet-tests",
            format!(
                "{} --include-ignored --test-threads=2 {}",
                b.datapath.display(),
                // A test-name filter, to debug one test in a VM.
                std::env::var("KPR_VM_PACKET_FILTER").unwrap_or_default()
            ),
        );
    }
    step(
        "attach-tests",
        format!("{} --include-ignored --test-threads=1", b.attach.display()),
    );
    if let Some(l) = &b.lab {
        let env = format!(
            "KPR_LAB_START_TIMEOUT=180 KPR_AGENT_BIN={} KPR_LAB_SERVER_BIN={}",
            l.agent.display(),
            l.server.display()
        );
        if let Some(smoke) = &l.smoke {
            step(
                "lab-smoke",
                format!(
                    "{env} {} --include-ignored --exact {LAB_SMOKE}",
                    smoke.display()
                ),
            );
        }
        if let Some(ipv6) = &l.ipv6 {
            step(
                "lab-ipv6",
                format!(
                    "{env} {} --include-ignored --exact {LAB_IPV6_SMOKE}",
                    ipv6.display()
                ),
            );
        }
        if let Some(tests) = &l.sctp {
            // No busybox fails the initramfs first.
            let bb = busybox().unwrap_or(Path::new("busybox"));
            step("lab-sctp", sctp_step(&env, tests, sctp_modules, bb));
        }
    }
    s.push_str("exit $fail\n");
    s
}

/// The `lab-sctp` step, in a subshell: S41 while sctp is not loaded (it must
/// not be, or S41 proves nothing), then `sctp_modules` loaded, then the
/// tests that need SCTP with `KPR_REQUIRE_SCTP=1` (a skip is a failure).
/// Fails if any part did; a failed `insmod` skips the tests after it.
fn sctp_step(env: &str, tests: &Path, modules: &[GuestModule], busybox: &Path) -> String {
    format!(
        "(
rc=0
t0=$(date +%s)
if grep -q '^sctp ' /proc/modules; then echo \"KPR-SCTP sctp loaded before S41\"; exit 1; fi
{env} {tests} --include-ignored --nocapture --exact {SCTP_UNLOADED_TEST} || rc=1
echo \"KPR-SCTP s41 rc=$rc after $(( $(date +%s) - t0 )) s; loading sctp\"
{insmod}grep -q '^sctp ' /proc/modules || {{ echo \"KPR-SCTP sctp not loaded after insmod\"; exit 1; }}
KPR_REQUIRE_SCTP=1 {env} {tests} --include-ignored --nocapture --test-threads=2 --exact {names} || rc=1
echo \"KPR-SCTP lab-sctp rc=$rc after $(( $(date +%s) - t0 )) s\"
exit $rc
)",
        tests = tests.display(),
        insmod = insmod_lines(modules, busybox),
        names = SCTP_TESTS.join(" "),
    )
}

/// A step's result line: `KPR-STEP <name> rc=<n>`.
pub fn parse_step(line: &str) -> Option<(&str, i32)> {
    let rest = line.trim().strip_prefix("KPR-STEP ")?;
    let (name, rc) = rest.split_once(" rc=")?;
    Some((name, rc.trim().parse().ok()?))
}

/// Whether a kernel list `value` (`6.1,5.10`, `all`, or `none`; unset:
/// `default`) names kernel `name`.
fn selects(value: Option<&str>, name: &str, default: &[&str]) -> bool {
    match value.map(str::trim) {
        Some("all") => true,
        Some(v) => v.split(',').map(str::trim).any(|k| k == name),
        None => default.contains(&name),
    }
}

/// Kernels whose run includes the `lab-sctp` step unless
/// `KPR_VM_SCTP_KERNELS` names others: the newest and the oldest. On 6.12
/// under TCG the step took about 20 s (S41 6 s, then N4 and N10 side by
/// side 10 s); the whole 6.12 pass 150 s.
const SCTP_KERNELS: &[&str] = &["6.12", "5.10"];

/// Whether kernel `name`'s run includes the `lab-sctp` step (S41 before
/// sctp is loaded, N4, N10 and D3 after): `KPR_VM_SCTP_KERNELS` (a list, `all`,
/// or `none`), by default [`SCTP_KERNELS`].
fn with_sctp(name: &str) -> bool {
    selects(
        std::env::var("KPR_VM_SCTP_KERNELS").ok().as_deref(),
        name,
        SCTP_KERNELS,
    )
}

/// Whether kernel `name`'s run includes the lab smoke.
fn with_lab(name: &str) -> bool {
    selects(
        std::env::var("KPR_VM_LAB_KERNELS").ok().as_deref(),
        name,
        LAB_KERNELS,
    )
}

/// How long one kernel's run may take under TCG (boot, verifier, packet
/// tests, lab smoke) before the VM is killed.
const VM_TIMEOUT: Duration = Duration::from_secs(900);

/// `cargo xtask test --kernel <name>`: the verifier's statistics, the packet
/// tests, the attach tests and the lab smoke on that kernel;
/// `host` runs them on this machine's kernel; `matrix` runs the kernel tier
/// of a full `cargo xtask test` alone ([`test_matrix`]).
pub fn test_kernel(name: &str) -> Result<()> {
    if name == "matrix" {
        return test_matrix();
    }
    // One kernel asked for by name: everything on it, unless the lab
    // smoke's kernels are named.
    let lab = std::env::var_os("KPR_VM_LAB_KERNELS").is_none() || with_lab(name);
    run_kernel(name, true, lab)
}

/// One kernel's run; without `packet_tests`, the verifier's statistics (every
/// program must load) and the attach tests only; with `lab`, the lab smoke.
fn run_kernel(name: &str, packet_tests: bool, lab: bool) -> Result<()> {
    let lab = lab || name == "host";
    // Never on this machine: the step loads the sctp module.
    let sctp = with_sctp(name) && name != "host";
    let b = build(lab, sctp)?;
    if name == "host" {
        let path = kernels_dir().join("run-host.sh");
        std::fs::create_dir_all(kernels_dir())?;
        std::fs::write(&path, script(&b, packet_tests, &[]))?;
        return run_visible(Command::new("sh").arg(&path));
    }
    let spec = spec(name)?;
    let started = Instant::now();
    let modules = if sctp {
        sctp_modules(name, &fetch(&spec)?)?
    } else {
        Vec::new()
    };
    let path = kernels_dir().join(format!("run-{name}.sh"));
    std::fs::create_dir_all(kernels_dir())?;
    std::fs::write(&path, script(&b, packet_tests, &modules))?;
    let out = run_script(&spec, &path, VM_TIMEOUT)?;
    let steps: Vec<(String, i32)> = out
        .lines
        .iter()
        .filter_map(|l| parse_step(l).map(|(n, rc)| (n.to_owned(), rc)))
        .collect();
    println!("\nkernel {name}: {:.0?}", started.elapsed());
    for (n, rc) in &steps {
        println!("  {n:<14} {}", if *rc == 0 { "ok" } else { "FAILED" });
    }
    let failed: Vec<&str> = steps
        .iter()
        .filter(|(_, rc)| *rc != 0)
        .map(|(n, _)| n.as_str())
        .collect();
    if !failed.is_empty() || out.rc != Some(0) {
        bail!(
            "kernel {name}: failed: {failed:?} (script exit {:?})",
            out.rc
        );
    }
    Ok(())
}

/// Whether the matrix's pass of kernel `name` includes the packet tests:
/// by default on [`PACKET_KERNELS`], the oldest kernel (legacy tc, no
/// `bpf_loop`, the most fallbacks); the host's kernel runs them natively in
/// the main pass, and every kernel's pass loads every program (the
/// verifier step). `KPR_VM_PACKET_KERNELS=all` runs them everywhere (the
/// full run). Under TCG a harness's load (the verifier checking every
/// program) takes about a minute, so harnesses reuse a loaded object (maps
/// emptied): the 39 packet tests took 233 s on 6.1 and 253 s on 5.10; the
/// 79 of stop 38 took 418 s on 5.10 and about 6 minutes on 6.1, which kept
/// CI past its 60 minutes.
fn with_packets(name: &str) -> bool {
    selects(
        std::env::var("KPR_VM_PACKET_KERNELS").ok().as_deref(),
        name,
        PACKET_KERNELS,
    )
}

/// Kernels whose pass includes the packet tests unless
/// `KPR_VM_PACKET_KERNELS` names others.
const PACKET_KERNELS: &[&str] = &["5.10"];

/// Kernels whose pass includes the one-node lab smoke (and its IPv6 twin)
/// unless `KPR_VM_LAB_KERNELS` names others: the oldest and the newest
/// (legacy tc and tcx links); 6.1 attaches as 5.10 does.
const LAB_KERNELS: &[&str] = &["6.12", "5.10"];

/// Every kernel of [`MATRIX`], one after the other (the CI's kernel tier),
/// with each pass's wall time at the end.
pub fn test_matrix() -> Result<()> {
    let mut failed = Vec::new();
    let mut times = Vec::new();
    for k in MATRIX {
        let started = Instant::now();
        let with_packets = with_packets(k.name);
        if let Err(e) = run_kernel(k.name, with_packets, with_lab(k.name)) {
            eprintln!("{e:#}");
            failed.push(k.name);
        }
        times.push((k.name, with_packets, started.elapsed()));
    }
    println!("\nkernel matrix (wall time of each pass, builds included):");
    for (name, with_packets, t) in &times {
        let what = if *with_packets {
            "verifier, packet tests, attach tests"
        } else {
            "verifier, attach tests"
        };
        let lab = if with_lab(name) { ", lab smoke" } else { "" };
        let sctp = if with_sctp(name) { ", lab SCTP" } else { "" };
        println!("  {name:<5} {:>5} s  {what}{lab}{sctp}", t.as_secs());
    }
    if !failed.is_empty() {
        bail!("kernel matrix: failed on {failed:?}");
    }
    Ok(())
}

/// Fetches every kernel of [`MATRIX`] (cached: a second call only checks).
pub fn fetch_matrix() -> Result<()> {
    for k in MATRIX {
        fetch(k)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_checkout_under_tmp_is_kept_visible_in_the_guest() {
        let kept = kept_paths(&[
            PathBuf::from("/tmp/kpr-clone"),
            PathBuf::from("/tmp/kpr-clone/target"),
            PathBuf::from("/work/elsewhere"),
        ])
        .unwrap();
        assert_eq!(kept, vec!["/tmp/kpr-clone".to_string()]);
        assert!(kept_paths(&[PathBuf::from("/work/main")])
            .unwrap()
            .is_empty());
        assert!(kept_paths(&[PathBuf::from("/tmp/a b")]).is_err());
    }

    use super::*;

    #[test]
    fn modules_come_after_their_dependencies() {
        let order = "\
kernel/net/9p/9pnet.ko.xz
kernel/net/9p/9pnet_virtio.ko.xz
kernel/fs/netfs/netfs.ko.xz
kernel/fs/9p/9p.ko.xz
kernel/drivers/net/veth.ko
";
        let mut deps = |p: &str| -> Vec<String> {
            match p {
                "kernel/fs/9p/9p.ko.xz" => vec!["9pnet".into(), "netfs".into()],
                "kernel/net/9p/9pnet_virtio.ko.xz" => vec!["9pnet".into()],
                _ => vec![],
            }
        };
        let got = module_order(
            order,
            &["9pnet_virtio", "9p", "veth", "virtio_pci"],
            &mut deps,
        );
        assert_eq!(
            got,
            [
                "kernel/net/9p/9pnet.ko.xz",
                "kernel/net/9p/9pnet_virtio.ko.xz",
                "kernel/fs/netfs/netfs.ko.xz",
                "kernel/fs/9p/9p.ko.xz",
                "kernel/drivers/net/veth.ko",
            ]
        );
    }

    /// The 6.12 package's sctp chain: sctp needs udp_tunnel, ip6_udp_tunnel
    /// and libcrc32c; crc32c_generic comes first by [`SCTP_MODULES`]'s
    /// order; a module the kernel has built in (absent from modules.order)
    /// is skipped.
    #[test]
    fn sctp_modules_come_after_their_dependencies() {
        let order = "\
kernel/arch/x86/crypto/crc32c-intel.ko
kernel/crypto/crc32c_generic.ko
kernel/lib/libcrc32c.ko
kernel/net/ipv4/udp_tunnel.ko
kernel/net/ipv6/ip6_udp_tunnel.ko
kernel/net/sctp/sctp.ko
kernel/net/sctp/sctp_diag.ko
";
        let mut deps = |p: &str| -> Vec<String> {
            match p {
                "kernel/net/sctp/sctp.ko" => vec![
                    "udp_tunnel".into(),
                    "ip6_udp_tunnel".into(),
                    "libcrc32c".into(),
                ],
                "kernel/net/sctp/sctp_diag.ko" => vec!["sctp".into()],
                _ => vec![],
            }
        };
        assert_eq!(
            module_order(order, SCTP_MODULES, &mut deps),
            [
                "kernel/crypto/crc32c_generic.ko",
                "kernel/net/ipv4/udp_tunnel.ko",
                "kernel/net/ipv6/ip6_udp_tunnel.ko",
                "kernel/lib/libcrc32c.ko",
                "kernel/net/sctp/sctp.ko",
            ]
        );
        // A dependency the kernel has built in is not in modules.order:
        // skipped.
        let order = "\
kernel/crypto/crc32c_generic.ko
kernel/lib/libcrc32c.ko
kernel/net/sctp/sctp.ko
";
        let mut deps = |p: &str| -> Vec<String> {
            match p {
                "kernel/net/sctp/sctp.ko" => vec!["udp_tunnel".into(), "libcrc32c".into()],
                _ => vec![],
            }
        };
        assert_eq!(
            module_order(order, SCTP_MODULES, &mut deps),
            [
                "kernel/crypto/crc32c_generic.ko",
                "kernel/lib/libcrc32c.ko",
                "kernel/net/sctp/sctp.ko",
            ]
        );
    }

    #[test]
    fn insmod_lines_skip_loaded_modules_and_stop_at_a_failure() {
        let mods = [
            GuestModule {
                name: "libcrc32c".into(),
                path: "/t/k/6.12.sctp/00-libcrc32c.ko".into(),
            },
            GuestModule {
                name: "sctp".into(),
                path: "/t/k/6.12.sctp/01-sctp.ko".into(),
            },
        ];
        assert_eq!(
            insmod_lines(&mods, Path::new("/bin/busybox")),
            "grep -q '^libcrc32c ' /proc/modules || /bin/busybox insmod /t/k/6.12.sctp/00-libcrc32c.ko || { echo \"KPR-SCTP insmod libcrc32c failed\"; exit 1; }\n\
             grep -q '^sctp ' /proc/modules || /bin/busybox insmod /t/k/6.12.sctp/01-sctp.ko || { echo \"KPR-SCTP insmod sctp failed\"; exit 1; }\n"
        );
    }

    /// S41 runs before the modules load, the tests needing SCTP after, with
    /// SCTP required.
    #[test]
    fn sctp_step_checks_s41_before_loading_sctp() {
        let mods = [GuestModule {
            name: "sctp".into(),
            path: "/m/sctp.ko".into(),
        }];
        let s = sctp_step("E=1", Path::new("/t/lab_sctp"), &mods, Path::new("bb"));
        let at = |needle: &str| {
            s.find(needle)
                .unwrap_or_else(|| panic!("{needle:?} not in {s}"))
        };
        assert!(at("grep -q '^sctp ' /proc/modules; then") < at(SCTP_UNLOADED_TEST));
        assert!(at(SCTP_UNLOADED_TEST) < at("bb insmod /m/sctp.ko"));
        assert!(at("bb insmod /m/sctp.ko") < at("KPR_REQUIRE_SCTP=1 E=1 /t/lab_sctp"));
        for t in SCTP_TESTS {
            assert!(at("KPR_REQUIRE_SCTP=1") < at(t));
        }
        assert!(!s[..at("KPR_REQUIRE_SCTP=1")].contains("n4_"));
    }

    #[test]
    fn kernel_lists_select() {
        let def = ["6.12", "5.10"];
        assert!(selects(None, "6.12", &def));
        assert!(!selects(None, "6.1", &def));
        assert!(selects(Some("all"), "6.1", &def));
        assert!(selects(Some("6.1, 5.10"), "5.10", &def));
        assert!(!selects(Some("6.1"), "6.12", &def));
        assert!(!selects(Some("none"), "6.12", &def));
        assert!(!selects(Some(""), "6.12", &def));
    }

    #[test]
    fn reads_depends_from_modinfo() {
        let ko = b"\x7fELF junk\0license=GPL\0depends=9pnet,netfs\0intree=Y\0";
        assert_eq!(modinfo_depends(ko), ["9pnet", "netfs"]);
        assert!(modinfo_depends(b"\0depends=\0name=veth\0").is_empty());
        assert!(modinfo_depends(b"nothing").is_empty());
    }

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

    #[test]
    fn parses_the_result_line() {
        assert_eq!(parse_done("KPR-VM-DONE rc=0\r"), Some(0));
        assert_eq!(parse_done("KPR-VM-DONE rc=101"), Some(101));
        assert_eq!(parse_done("KPR-VM-DONE rc="), None);
        assert_eq!(parse_done("something else"), None);
    }
}

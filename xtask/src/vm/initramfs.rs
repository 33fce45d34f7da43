//! The guest's initramfs: busybox, the modules the guest loads (virtio, 9p,
//! overlay, veth, bridge, sch_ingress, cls_bpf; sctp for its step) in dependency
//! order, and an init that mounts the host's root filesystem read-only over
//! 9p with a tmpfs overlay, keeps a checkout under `/tmp` visible, chroots
//! and runs the host's script.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::kernels::*;

/// Modules the guest loads, in this order after their dependencies (those
/// built into a kernel are skipped).
const GUEST_MODULES: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "overlay",
    "veth",
    // The switch of a lab of two nodes (the host-client step's).
    "bridge",
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

pub(super) fn kept_paths_arg() -> Result<String> {
    let kept = kept_paths(&[crate::setup::workspace_root(), crate::setup::target_dir()])?;
    Ok(if kept.is_empty() {
        String::new()
    } else {
        format!(" kpr.keep={}", kept.join(","))
    })
}

/// The machine's busybox: the guest's initramfs gets a copy, and the
/// guest's scripts (chrooted into this machine's root) run it for `insmod`.
pub(super) fn busybox() -> Result<&'static Path> {
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
pub(super) fn sctp_modules(name: &str, kernel: &Fetched) -> Result<Vec<GuestModule>> {
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
pub(super) fn initramfs(name: &str, kernel: &Fetched) -> Result<PathBuf> {
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn reads_depends_from_modinfo() {
        let ko = b"\x7fELF junk\0license=GPL\0depends=9pnet,netfs\0intree=Y\0";
        assert_eq!(modinfo_depends(ko), ["9pnet", "netfs"]);
        assert!(modinfo_depends(b"\0depends=\0name=veth\0").is_empty());
        assert!(modinfo_depends(b"nothing").is_empty());
    }
}

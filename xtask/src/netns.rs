//! Network namespace plumbing: `ip` commands, threads and child processes that
//! run inside a named namespace (`/run/netns/<name>`).
//!
//! Nothing here ever touches the machine's root namespace: every `ip` command
//! is either `ip netns add/del` or carries `-n <ns>`, and every address passed
//! in is checked against the lab range 198.18.0.0/15.

use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The only addresses the lab may use (RFC 2544 benchmarking range).
pub const LAB_NET: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 0);
/// Prefix length of [`LAB_NET`].
pub const LAB_NET_PREFIX: u8 = 15;

/// True if `ip` is inside 198.18.0.0/15.
pub fn in_lab_range(ip: Ipv4Addr) -> bool {
    let mask = u32::MAX << (32 - LAB_NET_PREFIX);
    u32::from(ip) & mask == u32::from(LAB_NET) & mask
}

/// Fails unless `ip` is inside 198.18.0.0/15.
pub fn check_lab_addr(ip: Ipv4Addr) -> Result<()> {
    if !in_lab_range(ip) {
        bail!(
            "address {ip} is outside the lab range {LAB_NET}/{LAB_NET_PREFIX}; refusing to use it"
        );
    }
    Ok(())
}

/// Path of a named namespace's handle.
pub fn netns_path(ns: &str) -> PathBuf {
    Path::new("/run/netns").join(ns)
}

/// True if the named namespace exists.
pub fn netns_exists(ns: &str) -> bool {
    netns_path(ns).exists()
}

/// Runs a command, failing with its stderr if it exits non-zero.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ip -n <ns> <args...>`.
pub fn ip_in(ns: &str, args: &[&str]) -> Result<String> {
    if ns.is_empty() {
        bail!("refusing to run `ip` without a namespace");
    }
    run(Command::new("ip").arg("-n").arg(ns).args(args))
}

/// `ip netns exec <ns> sysctl -qw <key>=<value>`.
pub fn sysctl_in(ns: &str, key: &str, value: &str) -> Result<()> {
    run(Command::new("ip")
        .args(["netns", "exec", ns, "sysctl", "-qw"])
        .arg(format!("{key}={value}")))?;
    Ok(())
}

/// Creates a named namespace with `lo` up.
pub fn create_netns(ns: &str) -> Result<()> {
    if netns_exists(ns) {
        bail!("network namespace {ns} already exists");
    }
    run(Command::new("ip").args(["netns", "add", ns]))?;
    ip_in(ns, &["link", "set", "lo", "up"])?;
    Ok(())
}

/// Deletes a named namespace (its veths go with it). Missing is not an error.
pub fn delete_netns(ns: &str) -> Result<()> {
    if !netns_exists(ns) {
        return Ok(());
    }
    run(Command::new("ip").args(["netns", "del", ns]))?;
    Ok(())
}

/// Runs `f` on a fresh thread that first joins the network namespace `ns`, so
/// sockets created in `f` live in that namespace. The calling thread is not
/// affected.
pub fn in_netns<T, F>(ns: &str, f: F) -> io::Result<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let file = File::open(netns_path(ns))?;
    let handle = std::thread::Builder::new()
        .name(format!("netns-{ns}"))
        .spawn(move || -> io::Result<T> {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(io::Error::from)?;
            drop(file);
            Ok(f())
        })?;
    handle
        .join()
        .map_err(|_| io::Error::other("thread inside the namespace panicked"))?
}

/// Makes `cmd` enter the network namespace `ns` (setns in the child, before
/// exec) and start a new session (so a terminal's Ctrl-C or hang-up does not
/// reach it). Unlike `ip netns exec`, /sys is not remounted, so /sys/fs/bpf
/// stays visible.
pub fn enter_netns_on_spawn(cmd: &mut Command, ns: &str) -> Result<()> {
    let file = File::open(netns_path(ns)).with_context(|| format!("open namespace {ns}"))?;
    let fd = file.as_raw_fd();
    // SAFETY: only async-signal-safe libc calls between fork and exec; `file`
    // is moved into the closure, so the fd stays open until the Command drops.
    unsafe {
        cmd.pre_exec(move || {
            let _keep = &file;
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

/// Random bytes from the kernel.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut buf = [0u8; N];
    let mut f = File::open("/dev/urandom").expect("open /dev/urandom");
    io::Read::read_exact(&mut f, &mut buf).expect("read /dev/urandom");
    buf
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lab_range() {
        assert!(in_lab_range(Ipv4Addr::new(198, 18, 0, 1)));
        assert!(in_lab_range(Ipv4Addr::new(198, 19, 255, 255)));
        assert!(!in_lab_range(Ipv4Addr::new(198, 20, 0, 1)));
        assert!(!in_lab_range(Ipv4Addr::new(10, 0, 0, 1)));
    }
}

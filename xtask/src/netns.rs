//! Network namespace plumbing: `ip` commands, threads and child processes that
//! run inside a named namespace (`/run/netns/<name>`).
//!
//! Nothing here ever touches the machine's root namespace: every `ip` command
//! is either `ip netns add/del` or carries `-n <ns>`, and every address passed
//! in is checked against the lab ranges 198.18.0.0/15 and 2001:2::/48.

use std::fs::File;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The only addresses the lab may use (RFC 2544 benchmarking range).
pub const LAB_NET: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 0);
/// Prefix length of [`LAB_NET`].
pub const LAB_NET_PREFIX: u8 = 15;

/// The only IPv6 addresses the lab may use (RFC 5180 benchmarking range).
pub const LAB_NET6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0);
/// Prefix length of [`LAB_NET6`].
pub const LAB_NET6_PREFIX: u8 = 48;

/// True if `ip` is inside 198.18.0.0/15.
pub fn in_lab_range(ip: Ipv4Addr) -> bool {
    let mask = u32::MAX << (32 - LAB_NET_PREFIX);
    u32::from(ip) & mask == u32::from(LAB_NET) & mask
}

/// True if `ip` is inside 2001:2::/48.
pub fn in_lab_range6(ip: Ipv6Addr) -> bool {
    let mask = u128::MAX << (128 - LAB_NET6_PREFIX);
    u128::from(ip) & mask == u128::from(LAB_NET6) & mask
}

/// The IPv6 twin of a lab IPv4 address in 198.18.0.0/16: 198.18.`x`.`y` is
/// 2001:2:0:`x`::`y` (`x` and `y` as numbers: 198.18.1.10 is 2001:2:0:1::a).
/// The dual-stack lab gives every node, pod and client the twin of its IPv4
/// address, so node i's pod CIDR 198.18.i.0/24 lies in 2001:2:0:i::/64.
/// `None` outside 198.18.0.0/16.
pub fn ipv6_twin(ip: Ipv4Addr) -> Option<Ipv6Addr> {
    match ip.octets() {
        [198, 18, x, y] => Some(Ipv6Addr::new(0x2001, 2, 0, x.into(), 0, 0, 0, y.into())),
        _ => None,
    }
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

/// Fails unless `ip` is inside 2001:2::/48.
pub fn check_lab_addr6(ip: Ipv6Addr) -> Result<()> {
    if !in_lab_range6(ip) {
        bail!(
            "address {ip} is outside the lab range {LAB_NET6}/{LAB_NET6_PREFIX}; refusing to use it"
        );
    }
    Ok(())
}

/// Fails unless `ip` is inside the lab range of its family.
pub fn check_lab_ip(ip: IpAddr) -> Result<()> {
    match ip {
        IpAddr::V4(a) => check_lab_addr(a),
        IpAddr::V6(a) => check_lab_addr6(a),
    }
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

/// `ip netns exec <ns> sysctl -qw <key>=<value> ...`: several keys, one
/// process.
pub fn sysctls_in(ns: &str, settings: &[(&str, &str)]) -> Result<()> {
    if settings.is_empty() {
        return Ok(());
    }
    run(Command::new("ip")
        .args(["netns", "exec", ns, "sysctl", "-qw"])
        .args(settings.iter().map(|(k, v)| format!("{k}={v}"))))?;
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

    #[test]
    fn lab_range6() {
        let ok = |s: &str| in_lab_range6(s.parse().unwrap());
        assert!(ok("2001:2::1"));
        assert!(ok("2001:2:0:ffff:ffff:ffff:ffff:ffff"));
        assert!(!ok("2001:2:1::1"));
        assert!(!ok("2001:db8::1"));
        assert!(!ok("fd00::1"));
        assert!(!ok("fe80::1"));
        assert!(check_lab_ip("2001:2:0:ff::a".parse().unwrap()).is_ok());
        assert!(check_lab_ip("fd00::1".parse().unwrap()).is_err());
        assert!(check_lab_ip("10.0.0.1".parse().unwrap()).is_err());
    }

    #[test]
    fn ipv6_twins() {
        let twin = |s: &str| ipv6_twin(s.parse().unwrap()).map(|a| a.to_string());
        assert_eq!(twin("198.18.1.10").as_deref(), Some("2001:2:0:1::a"));
        assert_eq!(twin("198.18.0.1").as_deref(), Some("2001:2::1"));
        assert_eq!(twin("198.18.0.10").as_deref(), Some("2001:2::a"));
        assert_eq!(twin("198.18.50.254").as_deref(), Some("2001:2:0:32::fe"));
        assert_eq!(twin("198.19.0.10"), None);
        for h in [0u8, 1, 255] {
            let a = ipv6_twin(Ipv4Addr::new(198, 18, h, h)).unwrap();
            assert!(in_lab_range6(a), "{a}");
        }
    }
}

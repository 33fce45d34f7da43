//! The lab's own cgroups: one cgroup v2 directory per node under
//! `<cgroup2>/kpr-lab-<id>/`, where the node's agent attaches its socket
//! hooks and the node's host clients run. Nothing is ever attached to the
//! machine's own root cgroup.
use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

/// Where this machine mounts the cgroup v2 hierarchy (`/sys/fs/cgroup`, or
/// `/sys/fs/cgroup/unified` on a hybrid host), from `/proc/mounts`.
pub fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (_dev, dir, fstype) = (f.next()?, f.next()?, f.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(dir))
    })
}

/// Every cgroup hierarchy's mount point (v1 controllers and v2), from
/// `/proc/mounts`: runc in runc mode creates the container's cgroup in each.
pub fn all_mounts() -> Vec<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_dev, dir, fstype) = (f.next()?, f.next()?, f.next()?);
            matches!(fstype, "cgroup" | "cgroup2").then(|| PathBuf::from(dir))
        })
        .collect()
}

/// The lab's cgroup directory, `<cgroup2>/kpr-lab-<id>`.
pub fn lab_root(id: &str) -> Option<PathBuf> {
    cgroup2_mount().map(|m| m.join(format!("kpr-lab-{id}")))
}

/// Creates `dir` (and its lab parent).
pub fn create(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create cgroup {}", dir.display()))
}

/// Kills what still runs in `dir` and removes it (bounded: 3 s).
pub fn remove(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    let ours = name.is_some_and(|n| n.starts_with("kpr-lab-") || n.starts_with("node-"));
    if !ours {
        bail!("refusing to remove {}: not a lab cgroup", dir.display());
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() > deadline => {
                return Err(e).with_context(|| format!("remove cgroup {}", dir.display()))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Makes the child of `cmd` join cgroup `dir` before it runs.
pub fn join_on_spawn(cmd: &mut std::process::Command, dir: &Path) -> Result<()> {
    use std::os::unix::{ffi::OsStrExt, process::CommandExt};
    let procs = std::ffi::CString::new(dir.join("cgroup.procs").as_os_str().as_bytes())?;
    // SAFETY: only async-signal-safe calls (open, write, close) after fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let rc = libc::write(fd, b"0\n".as_ptr().cast(), 2);
            libc::close(fd);
            if rc < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

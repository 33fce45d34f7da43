//! System helpers of the benchmark: commands inside lab namespaces, CPU
//! pinning, steal time, kernel memory, conntrack flush (ctnetlink) and
//! clearing a pinned BPF map (bpf syscalls), all without extra tools.

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::netns::netns_path;

/// Refuses any namespace that is not a lab's (`kpr-<id>-...`).
pub fn check_lab_ns(ns: &str) -> Result<()> {
    if !ns.starts_with("kpr-") || ns.contains('/') || !netns_path(ns).exists() {
        bail!("refusing to act on namespace {ns:?}: not an existing lab namespace");
    }
    Ok(())
}

/// Outcome of a command run with a cap.
pub enum Timed {
    Done(Duration),
    Capped(Duration),
}

/// `ip netns exec <ns> <prog> <args>` with `input` on stdin; the wall time.
/// With `cap`, the command is killed (by its pid) once it runs longer.
pub fn exec_in(
    ns: &str,
    prog: &str,
    args: &[&str],
    input: &str,
    cap: Option<Duration>,
) -> Result<Timed> {
    check_lab_ns(ns)?;
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, prog])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn {prog} in {ns}"))?;
    let t0 = Instant::now();
    let mut stdin = child.stdin.take().expect("piped");
    let input = input.to_string();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(input.as_bytes());
    });
    let mut stderr = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    loop {
        if let Some(status) = child.try_wait()? {
            let dt = t0.elapsed();
            let _ = writer.join();
            let err = reader.join().unwrap_or_default();
            if !status.success() {
                bail!("{prog} {args:?} in {ns} failed ({status}): {}", err.trim());
            }
            return Ok(Timed::Done(dt));
        }
        if let Some(c) = cap {
            if t0.elapsed() > c {
                let _ = child.kill();
                let _ = child.wait();
                let _ = writer.join();
                let _ = reader.join();
                return Ok(Timed::Capped(t0.elapsed()));
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// [`exec_in`] without a cap; the wall time.
pub fn exec_in_timed(ns: &str, prog: &str, args: &[&str], input: &str) -> Result<Duration> {
    match exec_in(ns, prog, args, input, None)? {
        Timed::Done(d) | Timed::Capped(d) => Ok(d),
    }
}

/// Spawns a thread that first joins namespace `ns` (a long-lived
/// counterpart of [`crate::netns::in_netns`]).
pub fn spawn_in<T, F>(ns: &str, name: &str, f: F) -> io::Result<JoinHandle<io::Result<T>>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let file = File::open(netns_path(ns))?;
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || -> io::Result<T> {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(io::Error::from)?;
            drop(file);
            Ok(f())
        })
}

/// Number of online CPUs.
pub fn ncpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Pins the calling thread to `cpu` (modulo the CPU count); no-op on one CPU.
pub fn pin_to(cpu: usize) {
    let n = ncpus();
    if n < 2 {
        return;
    }
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu % n).is_ok() {
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    }
}

/// CPU used by clients.
pub const CLIENT_CPU: usize = 0;
/// CPU used by servers.
pub const SERVER_CPU: usize = 1;

/// (steal, total) jiffies of all CPUs from /proc/stat.
pub fn cpu_jiffies() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0);
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    (v.get(7).copied().unwrap_or(0), total)
}

/// (user+nice+system, steal, total) jiffies of all CPUs, and the jiffies
/// (utime+stime) of this process and of `others` (e.g. the agent).
#[derive(Debug, Clone, Copy)]
pub struct Jiffies {
    busy: u64,
    steal: u64,
    total: u64,
    ours: u64,
}

fn proc_jiffies(pid: &str) -> u64 {
    let Ok(t) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    let Some((_, rest)) = t.rsplit_once(')') else {
        return 0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the command: state is field 3, utime 14, stime 15.
    let get = |i: usize| {
        f.get(i - 3)
            .and_then(|x| x.parse::<u64>().ok())
            .unwrap_or(0)
    };
    get(14) + get(15)
}

/// Reads [`Jiffies`] now; `ours` counts this process and `pids`.
pub fn jiffies(pids: &[u32]) -> Jiffies {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = text
        .lines()
        .find(|l| l.starts_with("cpu "))
        .map(|l| {
            l.split_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let g = |i: usize| v.get(i).copied().unwrap_or(0);
    let mut ours = proc_jiffies("self");
    for p in pids {
        ours += proc_jiffies(&p.to_string());
    }
    Jiffies {
        busy: g(0) + g(1) + g(2),
        steal: g(7),
        total: v.iter().take(8).sum(),
        ours,
    }
}

/// (steal %, other processes' CPU %) between two readings: the share of
/// all CPUs' time that went to the hypervisor or to processes other than
/// ours (user and system time; interrupts and softirqs not counted).
pub fn noise(a: Jiffies, b: Jiffies) -> (f64, f64) {
    let dt = b.total.saturating_sub(a.total);
    if dt == 0 {
        return (0.0, 0.0);
    }
    let steal = b.steal.saturating_sub(a.steal) as f64 * 100.0 / dt as f64;
    let other = b
        .busy
        .saturating_sub(a.busy)
        .saturating_sub(b.ours.saturating_sub(a.ours)) as f64
        * 100.0
        / dt as f64;
    (steal, other)
}

/// Steal time between two [`cpu_jiffies`] readings, in percent.
pub fn steal_pct(a: (u64, u64), b: (u64, u64)) -> f64 {
    let dt = b.1.saturating_sub(a.1);
    if dt == 0 {
        return 0.0;
    }
    b.0.saturating_sub(a.0) as f64 * 100.0 / dt as f64
}

/// Unreclaimable kernel memory in bytes: SUnreclaim + VmallocUsed + Percpu
/// from /proc/meminfo (where kmalloc'ed nftables objects, vmalloc'ed
/// x_tables blobs and per-CPU counters live).
pub fn kernel_mem_bytes() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mut sum = 0;
    for l in text.lines() {
        let mut it = l.split_whitespace();
        let (Some(k), Some(v)) = (it.next(), it.next()) else {
            continue;
        };
        if matches!(k, "SUnreclaim:" | "VmallocUsed:" | "Percpu:") {
            sum += v.parse::<u64>().unwrap_or(0) * 1024;
        }
    }
    sum
}

/// VmRSS of a process in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let l = text.lines().find(|l| l.starts_with("VmRSS:"))?;
    l.split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()
        .map(|k| k * 1024)
}

/// Sum of `bytes_memlock` of the maps pinned directly under `dir` (bpftool).
pub fn pinned_maps_memlock(dir: &Path) -> Result<u64> {
    let mut sum = 0;
    for e in std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let p = e?.path();
        if !p.is_file() {
            continue;
        }
        let out = Command::new("bpftool")
            .args(["-j", "map", "show", "pinned"])
            .arg(&p)
            .stderr(Stdio::null())
            .output();
        let Ok(out) = out else { continue };
        if !out.status.success() {
            continue;
        }
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
            sum += v.get("bytes_memlock").and_then(|b| b.as_u64()).unwrap_or(0);
        }
    }
    Ok(sum)
}

// ---------------------------------------------------------------- conntrack

/// Flushes the kernel conntrack entries of `family` in the current
/// thread's namespace (ctnetlink IPCTNL_MSG_CT_DELETE without attributes,
/// what `conntrack -F` sends; the kernel flushes only the message's
/// family: `conntrack -F -f ipv6` for IPv6).
pub fn flush_conntrack_here(family: super::Family) -> io::Result<()> {
    const NETLINK_NETFILTER: i32 = 12;
    const NFNL_SUBSYS_CTNETLINK: u16 = 1;
    const IPCTNL_MSG_CT_DELETE: u16 = 2;
    // SAFETY: plain socket syscalls on a buffer we own.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            NETLINK_NETFILTER,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let tv = libc::timeval {
            tv_sec: 2,
            tv_usec: 0,
        };
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        );
        let mut msg = [0u8; 20];
        msg[0..4].copy_from_slice(&20u32.to_ne_bytes());
        msg[4..6]
            .copy_from_slice(&((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE).to_ne_bytes());
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
        msg[6..8].copy_from_slice(&flags.to_ne_bytes());
        msg[8..12].copy_from_slice(&1u32.to_ne_bytes());
        msg[16] = match family {
            super::Family::Ipv4 => libc::AF_INET as u8,
            super::Family::Ipv6 => libc::AF_INET6 as u8,
        }; // nfgen_family
        msg[17] = 0; // NFNETLINK_V0
        let mut sa: libc::sockaddr_nl = std::mem::zeroed();
        sa.nl_family = libc::AF_NETLINK as u16;
        let r = libc::sendto(
            fd,
            msg.as_ptr() as *const libc::c_void,
            msg.len(),
            0,
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        );
        if r < 0 {
            let e = io::Error::last_os_error();
            libc::close(fd);
            return Err(e);
        }
        let mut buf = [0u8; 256];
        let n = libc::recv(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0);
        libc::close(fd);
        if n < 20 {
            return Err(io::Error::other("no ack from ctnetlink"));
        }
        let ty = u16::from_ne_bytes([buf[4], buf[5]]);
        if ty == libc::NLMSG_ERROR as u16 {
            let err = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
            if err != 0 && err != -libc::ENOENT {
                return Err(io::Error::from_raw_os_error(-err));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- BPF maps

fn bpf(cmd: u32, attr: &mut [u64; 16]) -> io::Result<i64> {
    // SAFETY: the attr buffer is 128 zero-initialised bytes, larger than
    // every command's attribute struct used here.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr.as_mut_ptr() as *mut libc::c_void,
            std::mem::size_of::<[u64; 16]>() as libc::c_long,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Deletes every entry of the (hash or LRU hash) map pinned at `path`;
/// returns how many were deleted.
pub fn clear_pinned_map(path: &Path) -> io::Result<usize> {
    use std::os::unix::ffi::OsStrExt;
    const BPF_MAP_DELETE_ELEM: u32 = 3;
    const BPF_MAP_GET_NEXT_KEY: u32 = 4;
    const BPF_OBJ_GET: u32 = 7;
    const BPF_OBJ_GET_INFO_BY_FD: u32 = 15;
    let cpath = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::other("path with NUL"))?;
    let mut attr = [0u64; 16];
    attr[0] = cpath.as_ptr() as u64;
    let fd = bpf(BPF_OBJ_GET, &mut attr)? as u32;
    let result = (|| {
        let mut info = [0u32; 32];
        let mut attr = [0u64; 16];
        attr[0] = fd as u64 | ((std::mem::size_of_val(&info) as u64) << 32);
        attr[1] = info.as_mut_ptr() as u64;
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
        let key_size = info[2] as usize;
        let max_entries = info[4] as usize;
        if key_size == 0 || key_size > 256 {
            return Err(io::Error::other("unexpected key size"));
        }
        let mut keys: Vec<Vec<u8>> = Vec::new();
        let mut cur: Option<Vec<u8>> = None;
        for _ in 0..=max_entries {
            let mut next = vec![0u8; key_size];
            let mut attr = [0u64; 16];
            attr[0] = fd as u64;
            attr[1] = cur.as_ref().map_or(0, |k| k.as_ptr() as u64);
            attr[2] = next.as_mut_ptr() as u64;
            match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
                Ok(_) => {
                    keys.push(next.clone());
                    cur = Some(next);
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
                Err(e) => return Err(e),
            }
        }
        let mut deleted = 0;
        for k in &keys {
            let mut attr = [0u64; 16];
            attr[0] = fd as u64;
            attr[1] = k.as_ptr() as u64;
            if bpf(BPF_MAP_DELETE_ELEM, &mut attr).is_ok() {
                deleted += 1;
            }
        }
        Ok(deleted)
    })();
    // SAFETY: closing the fd we got from BPF_OBJ_GET.
    unsafe { libc::close(fd as i32) };
    result
}

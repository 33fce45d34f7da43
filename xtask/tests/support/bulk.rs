//! Bulk TCP transfers against the lab server's `sink` and `source <n>`
//! (see `src/bin/lab-server.rs`), bounded by a deadline so a stalled
//! transfer fails the test instead of hanging it; the kernel counters
//! (`/proc/net/snmp`, `ethtool -k`) the tests read around them.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddrV4, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use xtask::netns::in_netns;

/// What one transfer moved, and how long it took.
#[derive(Debug, Clone, Copy)]
pub struct Transfer {
    pub bytes: u64,
    pub elapsed: Duration,
}

impl Transfer {
    pub fn mbit_per_s(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.elapsed.as_secs_f64().max(1e-9) / 1e6
    }
}

impl std::fmt::Display for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes in {} ms ({:.0} Mbit/s)",
            self.bytes,
            self.elapsed.as_millis(),
            self.mbit_per_s()
        )
    }
}

/// The time left until `deadline`, as a socket timeout (never zero, which
/// would mean "no timeout").
fn left(deadline: Instant) -> io::Result<Duration> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
    }
    Ok(d)
}

/// Bytes moved so far when `e` happened, in its message; a socket timeout
/// (EAGAIN) is reported as `TimedOut`.
fn at(e: io::Error, what: &str, done: u64, bytes: u64) -> io::Error {
    let kind = match e.kind() {
        io::ErrorKind::WouldBlock => io::ErrorKind::TimedOut,
        k => k,
    };
    io::Error::new(kind, format!("{what} after {done} of {bytes} bytes: {e}"))
}

/// Uploads `bytes` from `ns` to the lab server's `sink` at `addr`, within
/// `limit`; the server's count must equal `bytes`.
pub fn upload(ns: &str, addr: SocketAddrV4, bytes: u64, limit: Duration) -> io::Result<Transfer> {
    in_netns(ns, move || -> io::Result<Transfer> {
        let t = Instant::now();
        let deadline = t + limit;
        let mut s = TcpStream::connect_timeout(&addr.into(), left(deadline)?)?;
        let chunk = vec![b'u'; 256 * 1024];
        s.write_all(b"sink\n")?;
        let mut done = 0u64;
        // One write() per timeout: write_all would restart the timeout after
        // every partial write.
        while done < bytes {
            s.set_write_timeout(Some(
                left(deadline).map_err(|e| at(e, "write", done, bytes))?,
            ))?;
            let k = (bytes - done).min(chunk.len() as u64) as usize;
            let n = s
                .write(&chunk[..k])
                .map_err(|e| at(e, "write", done, bytes))?;
            done += n as u64;
        }
        s.shutdown(Shutdown::Write)?;
        let mut reply = String::new();
        s.set_read_timeout(Some(
            left(deadline).map_err(|e| at(e, "reply", done, bytes))?,
        ))?;
        s.read_to_string(&mut reply)
            .map_err(|e| at(e, "waiting for the sink's count", done, bytes))?;
        let got: u64 = reply
            .trim()
            .parse()
            .map_err(|_| io::Error::other(format!("sink replied {reply:?}")))?;
        if got != bytes {
            return Err(io::Error::other(format!(
                "the sink counted {got} of {bytes} bytes"
            )));
        }
        Ok(Transfer {
            bytes,
            elapsed: t.elapsed(),
        })
    })?
}

/// Downloads `bytes` into `ns` from the lab server's `source` at `addr`,
/// within `limit`; exactly `bytes` must arrive before EOF.
pub fn download(ns: &str, addr: SocketAddrV4, bytes: u64, limit: Duration) -> io::Result<Transfer> {
    in_netns(ns, move || -> io::Result<Transfer> {
        let t = Instant::now();
        let deadline = t + limit;
        let mut s = TcpStream::connect_timeout(&addr.into(), left(deadline)?)?;
        s.write_all(format!("source {bytes}\n").as_bytes())?;
        let mut buf = vec![0u8; 256 * 1024];
        let mut done = 0u64;
        loop {
            s.set_read_timeout(Some(
                left(deadline).map_err(|e| at(e, "read", done, bytes))?,
            ))?;
            let n = s.read(&mut buf).map_err(|e| at(e, "read", done, bytes))?;
            if n == 0 {
                break;
            }
            done += n as u64;
        }
        if done != bytes {
            return Err(io::Error::other(format!(
                "EOF after {done} of {bytes} bytes"
            )));
        }
        Ok(Transfer {
            bytes,
            elapsed: t.elapsed(),
        })
    })?
}

/// Runs `cmd` (a program and its arguments) inside `ns` with `ip netns exec`;
/// its stdout, or panics with its stderr.
pub fn exec_in(ns: &str, cmd: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns])
        .args(cmd)
        .output()
        .unwrap_or_else(|e| panic!("ip netns exec {ns} {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "ip netns exec {ns} {cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `ethtool -K <dev> <features...>` inside `ns`. ethtool exits non-zero when
/// the kernel leaves a feature off (`[requested on]`); that is reported, not
/// fatal: [`offloads`] shows what is on.
pub fn ethtool_set(ns: &str, dev: &str, features: &[&str]) {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "ethtool", "-K", dev])
        .args(features)
        .output()
        .unwrap_or_else(|e| panic!("ethtool -K {dev} in {ns}: {e}"));
    if !out.status.success() {
        println!(
            "ethtool -K {dev} {features:?} in {ns}: {}{}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
}

/// The offloads of `dev` in `ns` that decide whether packets are merged:
/// `tx-checksumming`, TSO, GSO, GRO (`ethtool -k`), as `name=on|off` words.
pub fn offloads(ns: &str, dev: &str) -> String {
    let k = exec_in(ns, &["ethtool", "-k", dev]);
    [
        ("tx-checksumming", "tx"),
        ("tcp-segmentation-offload", "tso"),
        ("generic-segmentation-offload", "gso"),
        ("generic-receive-offload", "gro"),
    ]
    .iter()
    .map(|(long, short)| {
        let v = k
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{long}: ")))
            .and_then(|v| v.split_whitespace().next())
            .unwrap_or("?");
        format!("{short}={v}")
    })
    .collect::<Vec<_>>()
    .join(" ")
}

/// One counter of `/proc/net/snmp` in `ns`, named `<Group><Field>` as nstat
/// names them (`IcmpOutDestUnreachs`, `IcmpMsgOutType3`, `TcpRetransSegs`);
/// 0 if absent (IcmpMsg fields appear once counted).
pub fn snmp(ns: &str, name: &str) -> u64 {
    let text = exec_in(ns, &["cat", "/proc/net/snmp"]);
    let lines: Vec<&str> = text.lines().collect();
    for pair in lines.chunks(2) {
        let [head, vals] = pair else { continue };
        let (Some((group, fields)), Some((_, values))) =
            (head.split_once(": "), vals.split_once(": "))
        else {
            continue;
        };
        for (f, v) in fields.split_whitespace().zip(values.split_whitespace()) {
            if format!("{group}{f}") == name {
                return v.parse().unwrap_or(0);
            }
        }
    }
    0
}

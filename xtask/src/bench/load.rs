//! The load generator and the pods' bench servers.
//!
//! Servers (one TCP and one UDP thread per pod, pinned to [`SERVER_CPU`],
//! listening on [`TPORT`] inside the pod's namespace: on every IPv4
//! address, or on the pod's IPv6 address in an IPv6 lab). TCP: the first byte
//! chooses the exchange:
//! - `C`: reply `<pod index> <client ip>\n`, close (one connection, one
//!   request, one response);
//! - `K`: ack with `k`, then echo every byte until EOF (request/response on
//!   a kept connection);
//! - `B`: count bytes until EOF, reply the count as a little-endian u64;
//! - `G`: an HTTP/1.1 `GET` (wrk's): read the request head, answer `200`
//!   with a 2-byte body and `Connection: close`, close.
//!
//! UDP: every datagram is answered with one byte, the pod index.
//!
//! Clients are threads that join the client namespace, pinned to
//! [`CLIENT_CPU`], recording into hdrhistograms (nanoseconds); they dial
//! addresses of either family.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket,
};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use hdrhistogram::Histogram;

use super::layouts::TPORT;
use super::sys::{pin_to, spawn_in, CLIENT_CPU, SERVER_CPU};
use crate::netns::in_netns;

/// Timeout of one exchange: long enough for one SYN retransmission (1 s),
/// so a lost SYN shows as a slow connection, not a failed one.
pub const IO_TIMEOUT: Duration = Duration::from_secs(3);

/// The bench servers of a lab's pods.
pub struct Servers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<io::Result<()>>>,
}

fn set_accept_timeout(l: &TcpListener, d: Duration) {
    let tv = libc::timeval {
        tv_sec: d.as_secs() as libc::time_t,
        tv_usec: d.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: setsockopt on a socket we own with a properly sized timeval.
    unsafe {
        libc::setsockopt(
            l.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        );
    }
}

fn serve_conn(mut s: TcpStream, peer: SocketAddr, idx: usize) -> io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    s.set_write_timeout(Some(Duration::from_secs(3)))?;
    s.set_nodelay(true)?;
    let mut buf = vec![0u8; 64 * 1024];
    let n = s.read(&mut buf)?;
    if n == 0 {
        return Ok(());
    }
    match buf[0] {
        b'C' => {
            let reply = format!("{idx} {}\n", peer.ip());
            s.write_all(reply.as_bytes())?;
        }
        b'K' => {
            s.write_all(b"k")?;
            let mut pending = n - 1;
            loop {
                if pending > 0 {
                    let out = vec![b'r'; pending];
                    s.write_all(&out)?;
                }
                let m = s.read(&mut buf)?;
                if m == 0 {
                    break;
                }
                pending = m;
            }
        }
        b'G' => {
            // The request head ends with an empty line; 8 kB at most.
            let mut head = n;
            while !buf[..head].windows(4).any(|w| w == b"\r\n\r\n") && head < 8192 {
                let m = s.read(&mut buf[head..8192])?;
                if m == 0 {
                    return Ok(());
                }
                head += m;
            }
            s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")?;
        }
        b'B' => {
            let mut total = (n - 1) as u64;
            loop {
                let m = s.read(&mut buf)?;
                if m == 0 {
                    break;
                }
                total += m as u64;
            }
            s.write_all(&total.to_le_bytes())?;
        }
        _ => {}
    }
    Ok(())
}

impl Servers {
    /// Starts the servers in each `(namespace, pod index, address)`: the
    /// address they listen on (IPv4's unspecified address, or the pod's
    /// IPv6 address: `[::]` would take IPv4 as well, mapped).
    pub fn start(pods: &[(String, usize, IpAddr)]) -> Result<Servers> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let mut ready = Vec::new();
        for (ns, idx, bind) in pods {
            let (idx, bind) = (*idx, *bind);
            let (tx, rx) = std::sync::mpsc::channel::<io::Result<()>>();
            let st = stop.clone();
            threads.push(spawn_in(ns, &format!("bench-tcp-{idx}"), move || {
                pin_to(SERVER_CPU);
                let l = match TcpListener::bind((bind, TPORT)) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                set_accept_timeout(&l, Duration::from_millis(100));
                let _ = tx.send(Ok(()));
                while !st.load(Ordering::Relaxed) {
                    if let Ok((s, peer)) = l.accept() {
                        let _ = serve_conn(s, peer, idx);
                    }
                }
            })?);
            ready.push(rx);
            let (tx, rx) = std::sync::mpsc::channel::<io::Result<()>>();
            let st = stop.clone();
            threads.push(spawn_in(ns, &format!("bench-udp-{idx}"), move || {
                pin_to(SERVER_CPU);
                let s = match UdpSocket::bind((bind, TPORT)) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
                let _ = tx.send(Ok(()));
                let mut buf = [0u8; 2048];
                while !st.load(Ordering::Relaxed) {
                    if let Ok((_, peer)) = s.recv_from(&mut buf) {
                        let _ = s.send_to(&[idx as u8], peer);
                    }
                }
            })?);
            ready.push(rx);
        }
        let servers = Servers { stop, threads };
        for rx in ready {
            rx.recv_timeout(Duration::from_secs(5))
                .map_err(|_| anyhow!("bench server did not start"))?
                .map_err(|e| anyhow!("bench server: {e}"))?;
        }
        Ok(servers)
    }

    /// Stops and joins every server thread.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1_000, 60_000_000_000, 3).expect("histogram bounds")
}

/// Result of a connection-latency cell.
#[derive(Debug, Clone)]
pub struct ConnCell {
    pub hist: Histogram<u64>,
    pub ok: usize,
    pub failed: usize,
    /// Replies per backend (pod index).
    pub backends: BTreeMap<usize, usize>,
    /// Replies whose server saw another client address than ours (NAT).
    pub wrong_client_ip: usize,
    /// Connections whose peer was not the address we dialled.
    pub wrong_peer: usize,
    pub first_error: Option<String>,
}

fn one_conn(addr: SocketAddr) -> io::Result<(usize, IpAddr, SocketAddr)> {
    let mut s = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
    let peer = s.peer_addr()?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_nodelay(true)?;
    s.write_all(b"C")?;
    let mut buf = [0u8; 64];
    let mut n = 0;
    loop {
        let m = s.read(&mut buf[n..])?;
        if m == 0 {
            break;
        }
        n += m;
        if n == buf.len() {
            break;
        }
    }
    let text = std::str::from_utf8(&buf[..n]).map_err(|_| io::Error::other("bad reply"))?;
    let mut it = text.trim().split(' ');
    let idx = it
        .next()
        .and_then(|x| x.parse().ok())
        .ok_or_else(|| io::Error::other(format!("bad reply {text:?}")))?;
    let ip = it
        .next()
        .and_then(|x| x.parse().ok())
        .ok_or_else(|| io::Error::other(format!("bad reply {text:?}")))?;
    Ok((idx, ip, peer))
}

/// `samples` sequential connections (connect, one request, one response,
/// close) from `ns`, round robin over `targets`. Stops early after 50
/// failures in a row.
pub fn conn_latency(
    ns: &str,
    targets: Vec<SocketAddr>,
    samples: usize,
    client_ip: Option<IpAddr>,
) -> Result<ConnCell> {
    Ok(in_netns(ns, move || {
        pin_to(CLIENT_CPU);
        let mut c = ConnCell {
            hist: hist(),
            ok: 0,
            failed: 0,
            backends: BTreeMap::new(),
            wrong_client_ip: 0,
            wrong_peer: 0,
            first_error: None,
        };
        let mut in_a_row = 0;
        for i in 0..samples {
            let addr = targets[i % targets.len()];
            let t = Instant::now();
            match one_conn(addr) {
                Ok((idx, ip, peer)) => {
                    let dt = t.elapsed().as_nanos() as u64;
                    let _ = c.hist.record(dt.max(1_000));
                    c.ok += 1;
                    in_a_row = 0;
                    *c.backends.entry(idx).or_default() += 1;
                    if client_ip.is_some_and(|want| ip != want) {
                        c.wrong_client_ip += 1;
                    }
                    if peer != addr {
                        c.wrong_peer += 1;
                    }
                }
                Err(e) => {
                    c.failed += 1;
                    in_a_row += 1;
                    c.first_error.get_or_insert_with(|| format!("{addr}: {e}"));
                    if in_a_row >= 50 {
                        c.failed += samples - i - 1;
                        break;
                    }
                }
            }
        }
        c
    })?)
}

/// New connections per second: `threads` closed-loop clients (all pinned
/// to the client CPU) for `duration`. Returns (rate, failures).
pub fn conn_rate(
    ns: &str,
    targets: Vec<SocketAddr>,
    threads: usize,
    duration: Duration,
) -> Result<(f64, usize)> {
    let start = Instant::now();
    let deadline = start + duration;
    let mut handles = Vec::new();
    for t in 0..threads {
        let ns = ns.to_string();
        let targets = targets.clone();
        handles.push(std::thread::spawn(move || {
            in_netns(&ns, move || {
                pin_to(CLIENT_CPU);
                let (mut ok, mut failed, mut in_a_row) = (0usize, 0usize, 0);
                let mut i = t;
                while Instant::now() < deadline && in_a_row < 50 {
                    match one_conn(targets[i % targets.len()]) {
                        Ok(_) => {
                            ok += 1;
                            in_a_row = 0;
                        }
                        Err(e) => {
                            if failed == 0 {
                                eprintln!("[bench] conn/s cell: first failure: {e}");
                            }
                            failed += 1;
                            in_a_row += 1;
                        }
                    }
                    i += 1;
                }
                (ok, failed)
            })
        }));
    }
    let (mut ok, mut failed) = (0, 0);
    for h in handles {
        let (o, f) = h.join().map_err(|_| anyhow!("client thread panicked"))??;
        ok += o;
        failed += f;
    }
    Ok((ok as f64 / start.elapsed().as_secs_f64(), failed))
}

/// HTTP requests per second that `wrk` (one thread, 8 connections, each
/// request on a connection of its own: `Connection: close`) gets from
/// `target` in `duration`, from namespace `ns`, pinned to [`CLIENT_CPU`];
/// and the requests that failed (socket errors, timeouts, non-2xx). `None`
/// without `wrk` (installed by `cargo xtask setup`).
pub fn http_rps(ns: &str, target: SocketAddr, duration: Duration) -> Result<Option<(f64, u64)>> {
    let out = match std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "taskset",
            "-c",
            &CLIENT_CPU.to_string(),
            "wrk",
        ])
        .args(["-t1", "-c8", "--timeout", "3s"])
        .arg(format!("-d{}s", duration.as_secs().max(1)))
        .args(["-H", "Connection: close"])
        .arg(format!("http://{target}/"))
        .output()
    {
        Ok(o) => o,
        Err(e) => return Err(anyhow!("running wrk: {e}")),
    };
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("wrk") && err.contains("No such file") {
            return Ok(None);
        }
        return Err(anyhow!("wrk failed: {err}{text}"));
    }
    Ok(Some(parse_wrk(&text)?))
}

/// wrk's `Requests/sec` and its failed requests (the `Socket errors` line's
/// counts and `Non-2xx or 3xx responses`).
fn parse_wrk(text: &str) -> Result<(f64, u64)> {
    let rps = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .ok_or_else(|| anyhow!("no Requests/sec in wrk's output: {text}"))?;
    let mut failed = 0;
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("Socket errors:") {
            failed += rest
                .split(',')
                .filter_map(|kv| kv.split_whitespace().last()?.parse::<u64>().ok())
                .sum::<u64>();
        } else if let Some(rest) = line.strip_prefix("Non-2xx or 3xx responses:") {
            failed += rest.trim().parse::<u64>().unwrap_or(0);
        }
    }
    Ok((rps, failed))
}

/// Result of a request/response cell.
#[derive(Debug, Clone)]
pub struct RrCell {
    pub hist: Histogram<u64>,
    pub ok: usize,
    pub failed: usize,
    pub first_error: Option<String>,
}

/// Request/response of one byte on one kept TCP connection.
pub fn tcp_rr(ns: &str, target: SocketAddr, samples: usize) -> Result<RrCell> {
    Ok(in_netns(ns, move || {
        pin_to(CLIENT_CPU);
        let mut c = RrCell {
            hist: hist(),
            ok: 0,
            failed: 0,
            first_error: None,
        };
        let r = (|| -> io::Result<()> {
            let mut s = TcpStream::connect_timeout(&target, IO_TIMEOUT)?;
            s.set_read_timeout(Some(IO_TIMEOUT))?;
            s.set_nodelay(true)?;
            s.write_all(b"K")?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b)?;
            for _ in 0..samples {
                let t = Instant::now();
                s.write_all(b"x")?;
                s.read_exact(&mut b)?;
                let _ = c.hist.record((t.elapsed().as_nanos() as u64).max(1_000));
                c.ok += 1;
            }
            s.shutdown(Shutdown::Write)?;
            Ok(())
        })();
        if let Err(e) = r {
            c.failed = samples - c.ok;
            c.first_error = Some(e.to_string());
        }
        c
    })?)
}

/// Request/response of one datagram on one connected UDP socket (a reply
/// from any other address than `target` is not received). Timeouts count
/// as drops; stops after 50 in a row.
pub fn udp_rr(ns: &str, target: SocketAddr, samples: usize) -> Result<RrCell> {
    Ok(in_netns(ns, move || {
        pin_to(CLIENT_CPU);
        let mut c = RrCell {
            hist: hist(),
            ok: 0,
            failed: 0,
            first_error: None,
        };
        let r = (|| -> io::Result<()> {
            let any: IpAddr = if target.is_ipv6() {
                Ipv6Addr::UNSPECIFIED.into()
            } else {
                Ipv4Addr::UNSPECIFIED.into()
            };
            let s = UdpSocket::bind((any, 0))?;
            s.connect(target)?;
            s.set_read_timeout(Some(Duration::from_millis(200)))?;
            let mut b = [0u8; 16];
            let mut in_a_row = 0;
            for _ in 0..samples {
                let t = Instant::now();
                s.send(b"u")?;
                match s.recv(&mut b) {
                    Ok(_) => {
                        let _ = c.hist.record((t.elapsed().as_nanos() as u64).max(1_000));
                        c.ok += 1;
                        in_a_row = 0;
                    }
                    Err(e) => {
                        c.failed += 1;
                        in_a_row += 1;
                        c.first_error.get_or_insert_with(|| e.to_string());
                        if in_a_row >= 50 {
                            break;
                        }
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = r {
            c.failed = samples - c.ok;
            c.first_error = Some(e.to_string());
        }
        c
    })?)
}

/// Bulk TCP stream for `duration`; bits per second counted by the server.
pub fn bulk(ns: &str, target: SocketAddr, duration: Duration) -> Result<f64> {
    in_netns(ns, move || -> Result<f64> {
        pin_to(CLIENT_CPU);
        let t = Instant::now();
        let mut s = TcpStream::connect_timeout(&target, IO_TIMEOUT)?;
        s.set_write_timeout(Some(Duration::from_secs(5)))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"B")?;
        let buf = vec![0x5au8; 128 * 1024];
        while t.elapsed() < duration {
            s.write_all(&buf)?;
        }
        s.shutdown(Shutdown::Write)?;
        let mut b = [0u8; 8];
        s.read_exact(&mut b)?;
        let secs = t.elapsed().as_secs_f64();
        Ok(u64::from_le_bytes(b) as f64 * 8.0 / secs)
    })?
}

/// Polls `target` with fresh connections, one started every millisecond,
/// until one succeeds; returns when, relative to `t0`.
///
/// The attempts overlap: [`POLLERS`] threads take turns, each attempt with
/// a connect timeout of that many milliseconds. A SYN the kernel answers
/// with nothing (no frontend yet, and the ICMP errors of the lab's node
/// rate-limited after the first few) costs its thread the whole timeout,
/// but the next attempt starts a millisecond later all the same: the
/// resolution is 1 ms, not the timeout.
pub fn first_success(
    ns: &str,
    target: SocketAddr,
    t0: Instant,
    limit: Duration,
) -> Result<Option<Duration>> {
    const POLLERS: u32 = 5;
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for j in 0..POLLERS {
        let stop = Arc::clone(&stop);
        threads.push(spawn_in(ns, "npl-poller", move || {
            pin_to(CLIENT_CPU);
            let slot = Duration::from_millis(1);
            let mut m = 0u32;
            while !stop.load(Ordering::Relaxed) && t0.elapsed() < limit {
                // Attempt m of thread j starts at j + POLLERS·m ms.
                let at = start + slot * (j + POLLERS * m);
                m += 1;
                if let Some(wait) = at.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let ok = answers(target, slot * POLLERS);
                if ok {
                    let d = t0.elapsed();
                    stop.store(true, Ordering::Relaxed);
                    return Some(d);
                }
            }
            None
        })?);
    }
    let mut first: Option<Duration> = None;
    for t in threads {
        let d = t.join().map_err(|_| anyhow!("a poller panicked"))??;
        first = match (first, d) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    Ok(first)
}

/// One `C` exchange with `target` (connect within `connect_timeout`, the
/// reply's first byte within 200 ms): whether a pod answered.
fn answers(target: SocketAddr, connect_timeout: Duration) -> bool {
    TcpStream::connect_timeout(&target, connect_timeout)
        .and_then(|mut s| {
            s.set_read_timeout(Some(Duration::from_millis(200)))?;
            s.write_all(b"C")?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b)
        })
        .is_ok()
}

/// Polls `target` from namespace `ns` every 5 ms until a connection to it
/// fails (no endpoint left: refused, or no answer in 200 ms); whether
/// that happened within `limit`.
pub fn first_failure(ns: &str, target: SocketAddr, limit: Duration) -> Result<bool> {
    let t = spawn_in(ns, "refusal-poller", move || {
        let start = Instant::now();
        while start.elapsed() < limit {
            if !answers(target, Duration::from_millis(200)) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    })?;
    t.join()
        .map_err(|_| anyhow!("the poller panicked"))?
        .map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_output_gives_its_rate_and_failures() {
        let out = "Running 3s test @ http://198.19.0.1:8080/
  1 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   402.10us  101.23us   3.01ms   80.12%
    Req/Sec    19.51k     1.02k   21.03k    70.00%
  58303 requests in 3.00s, 5.56MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:  19434.45
Transfer/sec:      1.85MB
";
        assert_eq!(parse_wrk(out).unwrap(), (19434.45, 7));
        assert!(parse_wrk("Running 3s test").is_err());
    }
}

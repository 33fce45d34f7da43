//! A client process of a lab node's own namespace and cgroup (a host
//! process or hostNetwork pod, as the socket hooks see it), driven over
//! stdin/stdout by the lab ([`xtask::lab::HostClient`]) so that one process
//! makes many requests.
//!
//! Addresses (`<ip:port>`) are IPv4 (`198.19.0.5:80`, an AF_INET socket) or
//! IPv6 (`[2001:2:0:ff::5]:80`, an AF_INET6 socket), IPv4-mapped included
//! (`[::ffff:198.19.0.5]:80`: an AF_INET6 socket sending IPv4, a dual-stack
//! socket; `net.ipv6.bindv6only` is 0 in every new namespace). Peers are
//! printed as the socket reports them (`getpeername()`, `recvfrom()`), in
//! the socket's family.
//!
//! One command per line, one answer line each:
//! - `tcp <ip:port> <request>`: connect, send the request line, read one
//!   reply line. `ok <peer> <reply>`; `peer` is what `getpeername()` says.
//! - `udp <ip:port> <request>`: an unconnected socket's `sendto` and
//!   `recvfrom`. `ok <from> <reply>`.
//! - `udpc-open <name> <ip:port>`: a connected UDP socket kept as `name`.
//!   `ok <peer>`.
//! - `udpc <name> <request>`: send and receive on it. `ok - <reply>`.
//! - `udpc-peer <name>`: its `getpeername()`. `ok <peer>`.
//! - `udpu-open <name> <ip:port>`: an unconnected UDP socket of that
//!   address's family, bound now to an ephemeral port, kept as `name`.
//!   `ok <local address>`.
//! - `udpu <name> <ip:port> <request>`: `sendto` on it and `recvfrom`.
//!   `ok <from> <reply>`.
//! - `tcps-open <name> <ip:port>`: a TCP connection kept as `name` (the lab
//!   server's `stream` mode). `ok <peer>`.
//! - `tcps <name> <line>`: one line on it, one reply line. `ok - <reply>`.
//!
//! Errors: `err <kind> <errno> <message>`, `kind` being `refused`,
//! `timeout`, `aborted`, `disconnected`, `unreachable`, `denied` or `other`.
use std::{
    collections::HashMap,
    io::{BufRead, BufReader, Read, Write},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

const TIMEOUT: Duration = Duration::from_millis(1500);

fn kind(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::ECONNREFUSED) => "refused",
        Some(libc::ECONNABORTED) => "aborted",
        // A connected socket that was destroyed is disconnected: send() wants
        // an address again.
        Some(libc::EDESTADDRREQ) => "disconnected",
        Some(libc::EHOSTUNREACH) | Some(libc::ENETUNREACH) => "unreachable",
        Some(libc::EPERM) | Some(libc::EACCES) => "denied",
        Some(libc::EAGAIN) | Some(libc::ETIMEDOUT) => "timeout",
        _ if e.kind() == std::io::ErrorKind::TimedOut => "timeout",
        _ if e.kind() == std::io::ErrorKind::WouldBlock => "timeout",
        _ => "other",
    }
}

fn err(e: std::io::Error) -> String {
    format!("err {} {} {e}", kind(&e), e.raw_os_error().unwrap_or(0))
}

fn line_of(buf: &[u8]) -> String {
    String::from_utf8_lossy(buf)
        .trim_end_matches(['\n', '\r'])
        .replace('\n', " ")
}

fn tcp(addr: SocketAddr, req: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT)?;
    s.set_read_timeout(Some(TIMEOUT))?;
    let peer = s.peer_addr()?;
    s.write_all(format!("{req}\n").as_bytes())?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.contains(&b'\n') {
            break;
        }
    }
    Ok(format!("ok {peer} {}", line_of(&buf)))
}

/// A UDP socket of `addr`'s family, bound to the wildcard address and an
/// ephemeral port (IPv6's `[::]` takes IPv4-mapped destinations too).
fn udp_socket(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    let any: SocketAddr = match addr {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    UdpSocket::bind(any)
}

fn udp(addr: SocketAddr, req: &str) -> std::io::Result<String> {
    let s = udp_socket(addr)?;
    s.set_read_timeout(Some(TIMEOUT))?;
    s.send_to(req.as_bytes(), addr)?;
    let mut buf = [0u8; 65536];
    let (n, from) = s.recv_from(&mut buf)?;
    Ok(format!("ok {from} {}", line_of(&buf[..n])))
}

fn main() {
    let mut sockets: HashMap<String, UdpSocket> = HashMap::new();
    let mut unconnected: HashMap<String, UdpSocket> = HashMap::new();
    let mut streams: HashMap<String, BufReader<TcpStream>> = HashMap::new();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in BufReader::new(stdin.lock()).lines() {
        let Ok(line) = line else { break };
        let mut parts = line.splitn(3, ' ');
        let cmd = parts.next().unwrap_or("");
        let a = parts.next().unwrap_or("");
        let b = parts.next().unwrap_or("");
        let answer = match cmd {
            "tcp" | "udp" | "udpc-open" => {
                let target = if cmd == "udpc-open" { b } else { a };
                match target.parse::<SocketAddr>() {
                    Err(e) => format!("err other 0 bad address {target:?}: {e}"),
                    Ok(addr) => match cmd {
                        "tcp" => tcp(addr, b).unwrap_or_else(err),
                        "udp" => udp(addr, b).unwrap_or_else(err),
                        _ => {
                            let mut open = || -> std::io::Result<String> {
                                let s = udp_socket(addr)?;
                                s.set_read_timeout(Some(TIMEOUT))?;
                                s.connect(addr)?;
                                let peer = s.peer_addr()?;
                                sockets.insert(a.to_string(), s);
                                Ok(format!("ok {peer}"))
                            };
                            open().unwrap_or_else(err)
                        }
                    },
                }
            }
            "tcps-open" => match b.parse::<SocketAddr>() {
                Err(e) => format!("err other 0 bad address {b:?}: {e}"),
                Ok(addr) => {
                    let mut open = || -> std::io::Result<String> {
                        let mut s = TcpStream::connect_timeout(&addr, TIMEOUT)?;
                        s.set_read_timeout(Some(TIMEOUT))?;
                        let peer = s.peer_addr()?;
                        s.write_all(b"stream\n")?;
                        let mut r = BufReader::new(s);
                        let mut first = String::new();
                        r.read_line(&mut first)?;
                        streams.insert(a.to_string(), r);
                        Ok(format!("ok {peer} {}", first.trim_end()))
                    };
                    open().unwrap_or_else(err)
                }
            },
            "tcps" => match streams.get_mut(a) {
                None => format!("err other 0 no stream {a:?}"),
                Some(r) => {
                    let mut go = || -> std::io::Result<String> {
                        r.get_mut().write_all(format!("{b}\n").as_bytes())?;
                        let mut reply = String::new();
                        if r.read_line(&mut reply)? == 0 {
                            return Err(std::io::Error::from_raw_os_error(libc::ECONNRESET));
                        }
                        Ok(format!("ok - {}", reply.trim_end()))
                    };
                    go().unwrap_or_else(err)
                }
            },
            "udpu-open" => match b.parse::<SocketAddr>() {
                Err(e) => format!("err other 0 bad address {b:?}: {e}"),
                Ok(addr) => {
                    let mut open = || -> std::io::Result<String> {
                        let s = udp_socket(addr)?;
                        s.set_read_timeout(Some(TIMEOUT))?;
                        let local = s.local_addr()?;
                        unconnected.insert(a.to_string(), s);
                        Ok(format!("ok {local}"))
                    };
                    open().unwrap_or_else(err)
                }
            },
            "udpu" => {
                let (target, request) = b.split_once(' ').unwrap_or((b, ""));
                match (unconnected.get(a), target.parse::<SocketAddr>()) {
                    (None, _) => format!("err other 0 no socket {a:?}"),
                    (_, Err(e)) => format!("err other 0 bad address {target:?}: {e}"),
                    (Some(s), Ok(addr)) => {
                        let go = || -> std::io::Result<String> {
                            s.send_to(request.as_bytes(), addr)?;
                            let mut buf = [0u8; 65536];
                            let (n, from) = s.recv_from(&mut buf)?;
                            Ok(format!("ok {from} {}", line_of(&buf[..n])))
                        };
                        go().unwrap_or_else(err)
                    }
                }
            }
            "udpc" => match sockets.get(a) {
                None => format!("err other 0 no socket {a:?}"),
                Some(s) => {
                    let go = || -> std::io::Result<String> {
                        s.send(b.as_bytes())?;
                        let mut buf = [0u8; 65536];
                        let n = s.recv(&mut buf)?;
                        Ok(format!("ok - {}", line_of(&buf[..n])))
                    };
                    go().unwrap_or_else(err)
                }
            },
            "udpc-peer" => match sockets.get(a) {
                None => format!("err other 0 no socket {a:?}"),
                Some(s) => s
                    .peer_addr()
                    .map(|peer| format!("ok {peer}"))
                    .unwrap_or_else(err),
            },
            _ => format!("err other 0 unknown command {cmd:?}"),
        };
        if writeln!(out, "{answer}")
            .and_then(|()| out.flush())
            .is_err()
        {
            break;
        }
    }
}

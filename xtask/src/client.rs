//! Clients that talk from inside a lab namespace without spawning processes:
//! each call runs on a fresh thread that joins the namespace first.
//!
//! Addresses are taken as `impl Into<SocketAddr>`: a `SocketAddrV4` as
//! before, or a `SocketAddr` of either family (TCP and UDP; the SCTP client
//! is IPv4 only).

use std::io::{self, Read, Write};
use std::net::{
    Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, SocketAddrV4, SocketAddrV6, TcpStream, UdpSocket,
};
use std::time::{Duration, Instant};

use crate::netns::in_netns;

/// One request of a batch.
#[derive(Debug, Clone)]
pub enum Request {
    /// New TCP connection: connect, write `payload`, shut down writing, read to end.
    Tcp {
        addr: SocketAddr,
        payload: Vec<u8>,
        timeout: Duration,
    },
    /// New UDP socket (bound to `bind_port`, or an ephemeral port): send one
    /// datagram, wait for one reply from `addr`.
    Udp {
        addr: SocketAddr,
        payload: Vec<u8>,
        timeout: Duration,
        bind_port: Option<u16>,
    },
    /// New SCTP association (one-to-one socket): connect, write `payload`
    /// (a line ended by `\n`: an SCTP shutdown is no half-close, so the end
    /// of the request is not marked by one), read to end; either family.
    Sctp {
        addr: SocketAddr,
        payload: Vec<u8>,
        timeout: Duration,
    },
}

impl Request {
    /// A TCP request.
    pub fn tcp(addr: impl Into<SocketAddr>, payload: &[u8], timeout: Duration) -> Self {
        Request::Tcp {
            addr: addr.into(),
            payload: payload.to_vec(),
            timeout,
        }
    }

    /// A UDP request from an ephemeral port.
    pub fn udp(addr: impl Into<SocketAddr>, payload: &[u8], timeout: Duration) -> Self {
        Request::Udp {
            addr: addr.into(),
            payload: payload.to_vec(),
            timeout,
            bind_port: None,
        }
    }

    /// An SCTP request.
    pub fn sctp(addr: impl Into<SocketAddr>, payload: &[u8], timeout: Duration) -> Self {
        Request::Sctp {
            addr: addr.into(),
            payload: payload.to_vec(),
            timeout,
        }
    }

    fn run(&self) -> io::Result<Vec<u8>> {
        match self {
            Request::Tcp {
                addr,
                payload,
                timeout,
            } => tcp_request_here(*addr, payload, *timeout),
            Request::Udp {
                addr,
                payload,
                timeout,
                bind_port,
            } => udp_request_here(*addr, payload, *timeout, *bind_port),
            Request::Sctp {
                addr,
                payload,
                timeout,
            } => sctp_request_here(*addr, payload, *timeout),
        }
    }
}

/// A read timeout shows as `WouldBlock` on Linux; call it what it is.
fn timed_out(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(io::ErrorKind::TimedOut, "no reply before the timeout")
    } else {
        e
    }
}

/// TCP request from the current thread's namespace. The timeout bounds the
/// connect and each read/write.
pub fn tcp_request_here(
    addr: impl Into<SocketAddr>,
    request: &[u8],
    timeout: Duration,
) -> io::Result<Vec<u8>> {
    tcp_exchange_here(addr, request, timeout).map_err(|f| f.error)
}

/// A TCP request that failed, and the connection's local address when the
/// connect had succeeded (the error came later: a reset, a timeout).
#[derive(Debug)]
pub struct TcpFailure {
    pub error: io::Error,
    pub local: Option<SocketAddr>,
}

/// [`tcp_request_here`] that also tells, on an error after the connect,
/// which local address the connection had: the key to find what the
/// datapath did with it (its conntrack entries).
pub fn tcp_exchange_here(
    addr: impl Into<SocketAddr>,
    request: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, TcpFailure> {
    let mut stream = TcpStream::connect_timeout(&addr.into(), timeout)
        .map_err(|error| TcpFailure { error, local: None })?;
    let local = stream.local_addr().ok();
    let exchange = |stream: &mut TcpStream| -> io::Result<Vec<u8>> {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.write_all(request)?;
        stream.shutdown(Shutdown::Write)?;
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).map_err(timed_out)?;
        Ok(reply)
    };
    exchange(&mut stream).map_err(|error| TcpFailure { error, local })
}

/// UDP request from the current thread's namespace. The socket (bound to
/// the unspecified address of `addr`'s family) is connected to `addr`, so a
/// reply from any other source is not accepted (it times out) and an ICMP
/// port unreachable surfaces as `ConnectionRefused`.
pub fn udp_request_here(
    addr: impl Into<SocketAddr>,
    payload: &[u8],
    timeout: Duration,
    bind_port: Option<u16>,
) -> io::Result<Vec<u8>> {
    let addr = addr.into();
    let port = bind_port.unwrap_or(0);
    let local = match addr {
        SocketAddr::V4(_) => SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port)),
        SocketAddr::V6(_) => SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, port, 0, 0)),
    };
    let sock = if bind_port.is_some() {
        bind_fixed_port(local)?
    } else {
        UdpSocket::bind(local)?
    };
    sock.connect(addr)?;
    sock.set_read_timeout(Some(timeout))?;
    sock.send(payload)?;
    let mut buf = vec![0u8; 65536];
    let n = sock.recv(&mut buf).map_err(timed_out)?;
    buf.truncate(n);
    Ok(buf)
}

/// Binds `local`, a fixed port a socket of the previous request had. That
/// socket is closed, but a child another thread of this process was
/// spawning at that moment may still hold a copy of it until its `exec`
/// closes it (fork copies the descriptor table): `EADDRINUSE` for a few
/// milliseconds. Tries again for up to a second.
fn bind_fixed_port(local: SocketAddr) -> io::Result<UdpSocket> {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match UdpSocket::bind(local) {
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            r => return r,
        }
    }
}

/// SCTP request from the current thread's namespace: a new association
/// (set up within the timeout; `ConnectionRefused` when the peer answers
/// the INIT with an ABORT, `TimedOut` when nothing answers), `request`
/// written, the reply read until the server ends the association. The
/// timeout also bounds each read and write. Needs SCTP in the kernel (see
/// [`crate::sctp::available`]): on a kernel where it is a module not yet
/// loaded, the socket loads it.
pub fn sctp_request_here(
    addr: impl Into<SocketAddr>,
    request: &[u8],
    timeout: Duration,
) -> io::Result<Vec<u8>> {
    let mut stream = crate::sctp::connect_timeout(addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(request)?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).map_err(timed_out)?;
    Ok(reply)
}

/// New SCTP association from namespace `ns` to `addr` (see
/// [`sctp_request_here`]).
pub fn sctp_request(
    ns: &str,
    addr: impl Into<SocketAddr>,
    request: &[u8],
    timeout: Duration,
) -> io::Result<Vec<u8>> {
    let addr = addr.into();
    let request = request.to_vec();
    in_netns(ns, move || sctp_request_here(addr, &request, timeout))?
}

/// New TCP connection from namespace `ns` to `addr` (either family):
/// connect (with timeout), write `request`, shut down writing, read the
/// reply to EOF.
pub fn tcp_request(
    ns: &str,
    addr: impl Into<SocketAddr>,
    request: &[u8],
    timeout: Duration,
) -> io::Result<Vec<u8>> {
    let addr = addr.into();
    let request = request.to_vec();
    in_netns(ns, move || tcp_request_here(addr, &request, timeout))?
}

/// One UDP datagram from a new socket in namespace `ns` (bound to `bind_port`
/// if given) to `addr` (either family), and the one reply.
pub fn udp_request(
    ns: &str,
    addr: impl Into<SocketAddr>,
    payload: &[u8],
    timeout: Duration,
    bind_port: Option<u16>,
) -> io::Result<Vec<u8>> {
    let addr = addr.into();
    let payload = payload.to_vec();
    in_netns(ns, move || {
        udp_request_here(addr, &payload, timeout, bind_port)
    })?
}

/// Runs `requests` one after another on one thread inside `ns`. Returns one
/// result per request, in order. Requests not started before `deadline` fail
/// with `TimedOut` without being sent. The outer error is for failing to
/// enter the namespace.
pub fn batch(
    ns: &str,
    requests: Vec<Request>,
    deadline: Option<Instant>,
) -> io::Result<Vec<io::Result<Vec<u8>>>> {
    in_netns(ns, move || {
        requests
            .iter()
            .map(|r| {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "batch deadline passed",
                    ));
                }
                r.run()
            })
            .collect()
    })
}

/// The reply as a trimmed string (pod name for a `hostname` request).
pub fn reply_text(reply: &[u8]) -> String {
    String::from_utf8_lossy(reply).trim().to_string()
}

/// `GET path` over HTTP/1.0 to `addr` from inside namespace `ns`, connect
/// and read each bounded by `t`: the status code and the body. For the
/// agent's and kube-proxy's /metrics and /healthz in the lab.
pub fn http_get_in(
    ns: &str,
    addr: SocketAddrV4,
    path: &str,
    t: Duration,
) -> anyhow::Result<(u16, String)> {
    use anyhow::Context as _;
    let p = path.to_string();
    let text = in_netns(ns, move || -> io::Result<String> {
        let mut s = TcpStream::connect_timeout(&addr.into(), t)?;
        s.set_read_timeout(Some(t))?;
        write!(s, "GET {p} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body)
    })
    .and_then(|r| r)
    .with_context(|| format!("GET {path} from {addr} in {ns}"))?;
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("GET {path} from {addr}: not HTTP: {text:.80}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixed source port still held for a moment (by a copy of the
    /// previous socket in a child being spawned) is bound once it is free,
    /// not refused; one held for good is still refused once the tries end.
    /// In a namespace of its own.
    #[test]
    #[ignore = "needs root: run with cargo xtask test"]
    fn a_fixed_port_held_for_a_moment_is_bound_once_free() {
        struct Ns(String);
        impl Drop for Ns {
            fn drop(&mut self) {
                let _ = crate::netns::delete_netns(&self.0);
            }
        }
        let ns = Ns(format!("kpr-{}-bindport", std::process::id()));
        crate::netns::create_netns(&ns.0).expect("netns");
        in_netns(&ns.0, || {
            let held = UdpSocket::bind("0.0.0.0:0").unwrap();
            let local = held.local_addr().unwrap();
            let release = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                drop(held);
            });
            let sock = bind_fixed_port(local).expect("bound once the other socket is closed");
            assert_eq!(sock.local_addr().unwrap(), local);
            release.join().unwrap();
            let e = bind_fixed_port(local).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        })
        .expect("in the namespace");
    }
}

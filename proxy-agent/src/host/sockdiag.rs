//! Connected UDP sockets of the node's own clients that the socket hooks
//! aimed at a backend which is now gone: found with a socket-diag dump and
//! destroyed (`SOCK_DESTROY`, `CONFIG_INET_DIAG_DESTROY`), as Cilium does.
//!
//! A connected UDP socket keeps the destination `connect()` gave it; sends
//! never meet a hook again. Left alone, a DNS resolver's socket would send
//! into the void for as long as it lives. Destroyed, the socket reports an
//! error (ECONNABORTED) on its next call, and the application reconnects
//! through the hooks, to a live backend. Only sockets the hooks translated
//! (their cookie and backend are in the socket-level reverse-NAT map) are
//! touched: an application that dialled a pod IP itself is left alone.
//! TCP is never destroyed (kube-proxy keeps established TCP too). Both
//! families: IPv6 sockets (a dual-stack one aimed at an IPv4-mapped backend
//! included) are dumped and destroyed as IPv4 ones.
use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

const NETLINK_SOCK_DIAG: i32 = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// `TCP_ESTABLISHED`: the state of a connected UDP socket.
const UDP_CONNECTED_STATES: u32 = 1 << 1;
const NLMSG_HDRLEN: usize = 16;
const SOCKID_LEN: usize = 48;
const REQ_LEN: usize = 8 + SOCKID_LEN;
const MSG_LEN: usize = 4 + SOCKID_LEN + 20;

/// A connected UDP socket, as socket diag reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdpSock {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub ifindex: u32,
    pub cookie: u64,
    /// The raw `inet_diag_sockid`, echoed back to destroy this socket.
    id: [u8; SOCKID_LEN],
}

fn netlink() -> io::Result<OwnedFd> {
    netlink_socket(NETLINK_SOCK_DIAG)
}

/// A netlink socket of `protocol` whose receives time out after 2 s (a dump
/// that never ends fails instead of hanging the agent).
pub(crate) fn netlink_socket(protocol: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2).
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            protocol,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval {
        tv_sec: 2,
        tv_usec: 0,
    };
    // SAFETY: setsockopt with a timeval of its size.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    Ok(fd)
}

/// An `inet_diag_req_v2` for UDP over `family` in a netlink message.
fn request(
    kind: u16,
    flags: u16,
    seq: u32,
    family: u8,
    states: u32,
    id: &[u8; SOCKID_LEN],
) -> Vec<u8> {
    let len = NLMSG_HDRLEN + REQ_LEN;
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.push(family);
    m.push(libc::IPPROTO_UDP as u8);
    m.push(0); // idiag_ext
    m.push(0); // pad
    m.extend_from_slice(&states.to_ne_bytes());
    m.extend_from_slice(id);
    m
}

fn send(fd: &OwnedFd, msg: &[u8]) -> io::Result<()> {
    // SAFETY: sending our buffer to the kernel (nl_pid 0).
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as u16;
    // SAFETY: as above, with valid pointers and lengths.
    let rc = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            msg.as_ptr().cast(),
            msg.len(),
            0,
            (&addr as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn recv(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: receiving into our buffer.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Parses one `inet_diag_msg` (of an IPv4 or IPv6 socket).
fn parse_msg(p: &[u8]) -> Option<UdpSock> {
    if p.len() < MSG_LEN {
        return None;
    }
    let family = p[0];
    let id: [u8; SOCKID_LEN] = p[4..4 + SOCKID_LEN].try_into().ok()?;
    let sport = u16::from_be_bytes([id[0], id[1]]);
    let dport = u16::from_be_bytes([id[2], id[3]]);
    let (src, dst): (IpAddr, IpAddr) = if family == libc::AF_INET as u8 {
        (
            Ipv4Addr::new(id[4], id[5], id[6], id[7]).into(),
            Ipv4Addr::new(id[20], id[21], id[22], id[23]).into(),
        )
    } else if family == libc::AF_INET6 as u8 {
        let a: [u8; 16] = id[4..20].try_into().ok()?;
        let b: [u8; 16] = id[20..36].try_into().ok()?;
        (Ipv6Addr::from(a).into(), Ipv6Addr::from(b).into())
    } else {
        return None;
    };
    let ifindex = u32_at(&id, 36);
    let cookie = u64::from(u32_at(&id, 40)) | (u64::from(u32_at(&id, 44)) << 32);
    Some(UdpSock {
        local: SocketAddr::new(src, sport),
        remote: SocketAddr::new(dst, dport),
        ifindex,
        cookie,
        id,
    })
}

/// Every connected UDP socket of this network namespace, of both families.
pub fn connected_udp() -> io::Result<Vec<UdpSock>> {
    let mut out = connected_udp_of(libc::AF_INET as u8)?;
    out.extend(connected_udp_of(libc::AF_INET6 as u8)?);
    Ok(out)
}

/// Every connected UDP socket of `family` of this network namespace.
fn connected_udp_of(family: u8) -> io::Result<Vec<UdpSock>> {
    let fd = netlink()?;
    send(
        &fd,
        &request(
            SOCK_DIAG_BY_FAMILY,
            NLM_F_REQUEST | NLM_F_DUMP,
            1,
            family,
            UDP_CONNECTED_STATES,
            &[0; SOCKID_LEN],
        ),
    )?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    // Bounded: a dump ends with NLMSG_DONE; a stuck one times out (2 s).
    for _ in 0..100_000 {
        let n = recv(&fd, &mut buf)?;
        let mut off = 0;
        while off + NLMSG_HDRLEN <= n {
            let len = u32_at(&buf, off) as usize;
            let kind = u16_at(&buf, off + 4);
            if len < NLMSG_HDRLEN || off + len > n {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "truncated sock_diag message",
                ));
            }
            match kind {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let errno = -(u32_at(&buf, off + NLMSG_HDRLEN) as i32);
                    return Err(io::Error::from_raw_os_error(errno));
                }
                SOCK_DIAG_BY_FAMILY => {
                    out.extend(parse_msg(&buf[off + NLMSG_HDRLEN..off + len]));
                }
                _ => {}
            }
            off += (len + 3) & !3;
        }
    }
    Err(io::Error::new(
        io::ErrorKind::TimedOut,
        "sock_diag dump did not end",
    ))
}

/// Destroys `sock` (the kernel checks its cookie): its owner's next call
/// fails with ECONNABORTED.
pub fn destroy(sock: &UdpSock) -> io::Result<()> {
    let fd = netlink()?;
    send(
        &fd,
        &request(
            SOCK_DESTROY,
            NLM_F_REQUEST | NLM_F_ACK,
            2,
            if sock.remote.is_ipv4() {
                libc::AF_INET as u8
            } else {
                libc::AF_INET6 as u8
            },
            u32::MAX,
            &sock.id,
        ),
    )?;
    let mut buf = [0u8; 512];
    let n = recv(&fd, &mut buf)?;
    if n >= NLMSG_HDRLEN + 4 && u16_at(&buf, 4) == NLMSG_ERROR {
        let errno = -(u32_at(&buf, NLMSG_HDRLEN) as i32);
        if errno != 0 {
            return Err(io::Error::from_raw_os_error(errno));
        }
    }
    Ok(())
}

/// What [`destroy_aimed_at`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Destroyed {
    pub destroyed: usize,
    pub failed: usize,
}

/// The peer of a socket as a backend address: an IPv4-mapped IPv6 peer (a
/// dual-stack socket's) is the IPv4 backend it reaches.
pub fn backend_of(peer: SocketAddr) -> SocketAddr {
    match peer {
        SocketAddr::V6(p) => match p.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(v4.into(), p.port()),
            None => peer,
        },
        v4 => v4,
    }
}

/// Destroys the connected UDP sockets whose peer (as a backend,
/// [`backend_of`]) is one of `gone` and that `ours` says the socket hooks
/// aimed there (by cookie and the peer as the socket has it).
pub fn destroy_aimed_at(
    gone: &std::collections::BTreeSet<SocketAddr>,
    ours: impl Fn(u64, SocketAddr) -> bool,
) -> io::Result<Destroyed> {
    let mut d = Destroyed::default();
    if gone.is_empty() {
        return Ok(d);
    }
    for s in connected_udp()? {
        if gone.contains(&backend_of(s.remote)) && ours(s.cookie, s.remote) {
            match destroy(&s) {
                Ok(()) => d.destroyed += 1,
                Err(e) => {
                    tracing::warn!(socket = ?s.local, peer = %s.remote, error = %e, "cannot destroy a UDP socket aimed at a removed backend");
                    d.failed += 1;
                }
            }
        }
    }
    Ok(d)
}

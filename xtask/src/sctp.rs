//! SCTP for the lab: one-to-one style sockets (`SOCK_STREAM`,
//! `IPPROTO_SCTP`: one association per socket, read and written like a TCP
//! stream, so std's `TcpListener`/`TcpStream` carry them once made), and
//! whether the kernel has SCTP, asked without loading it.
//!
//! Creating an SCTP socket on a kernel where `sctp` is a module not yet
//! loaded loads it (`request_module("net-pf-2-proto-132")`): the module is
//! global to the machine and S41 checks that the proxy never loads it. So
//! [`available`] looks at what is there (`/proc/net/sctp`, made by the loaded
//! module or a built-in SCTP) and never opens a socket; the lab opens SCTP
//! sockets only once that answered yes. The VM runner loads the module in its
//! guest before the SCTP lab tests; nothing here loads it.

use std::io;
use std::net::{
    Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream,
};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

/// The name of the kernel's SCTP module, as `/proc/modules` lists it.
pub const MODULE: &str = "sctp";

/// Whether the kernel has SCTP right now (the module loaded, or built in),
/// without loading anything: `/proc/net/sctp` (or `/sys/module/sctp`).
pub fn available() -> bool {
    Path::new("/proc/net/sctp").is_dir() || Path::new("/sys/module/sctp").is_dir()
}

/// Why the SCTP lab tests cannot run here, or `None` when they can.
pub fn unavailable_reason() -> Option<String> {
    if available() {
        return None;
    }
    Some(
        "this kernel has no SCTP loaded (no /proc/net/sctp; the lab never loads the \
         sctp module itself: `modprobe sctp` first, or run the VM runner's lab-sctp step, \
         `cargo xtask test --kernel 6.12`)"
            .to_string(),
    )
}

/// Whether `/proc/modules` text lists `module` (a loaded module, not a
/// built-in one).
pub fn module_listed(proc_modules: &str, module: &str) -> bool {
    proc_modules
        .lines()
        .any(|l| l.split_whitespace().next() == Some(module))
}

/// Whether the sctp module is loaded now (`/proc/modules`; a kernel built
/// without loadable modules has none, and no module can be loaded there).
pub fn module_loaded() -> io::Result<bool> {
    match std::fs::read_to_string("/proc/modules") {
        Ok(text) => Ok(module_listed(&text, MODULE)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A new one-to-one SCTP socket of `domain` (`AF_INET`, `AF_INET6`;
/// `flags`: `SOCK_NONBLOCK` or 0).
fn socket(domain: libc::c_int, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned from here on.
    let fd = cvt(unsafe {
        libc::socket(
            domain,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | flags,
            libc::IPPROTO_SCTP,
        )
    })?;
    // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn sockaddr(addr: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*addr.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

fn sockaddr6(addr: SocketAddrV6) -> libc::sockaddr_in6 {
    libc::sockaddr_in6 {
        sin6_family: libc::AF_INET6 as libc::sa_family_t,
        sin6_port: addr.port().to_be(),
        sin6_flowinfo: 0,
        sin6_addr: libc::in6_addr {
            s6_addr: addr.ip().octets(),
        },
        sin6_scope_id: addr.scope_id(),
    }
}

/// A socket address of either family as `sockaddr_storage` and its length.
fn sockaddr_any(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero bytes are a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sa = sockaddr(a);
            // SAFETY: sockaddr_storage is larger than, and aligned for, sockaddr_in.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sa) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sa = sockaddr6(a);
            // SAFETY: sockaddr_storage is larger than, and aligned for, sockaddr_in6.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sa) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

fn domain(addr: SocketAddr) -> libc::c_int {
    match addr {
        SocketAddr::V4(_) => libc::AF_INET,
        SocketAddr::V6(_) => libc::AF_INET6,
    }
}

/// A listening one-to-one SCTP socket on 0.0.0.0:`port` (in the calling
/// thread's namespace), as a `TcpListener`: its `accept` gives one
/// association per `TcpStream`.
pub fn listen(port: u16) -> io::Result<TcpListener> {
    listen_on(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
}

/// [`listen`] on [::]:`port`, IPv6 only (`IPV6_V6ONLY`: IPv4 associations
/// stay with [`listen`]'s socket, whose peers keep their IPv4 form).
pub fn listen6(port: u16) -> io::Result<TcpListener> {
    listen_on(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)))
}

fn set_int(
    fd: &OwnedFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: a valid descriptor and an int option of the right size.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

fn listen_on(addr: SocketAddr) -> io::Result<TcpListener> {
    let fd = socket(domain(addr), 0)?;
    set_int(&fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    if addr.is_ipv6() {
        set_int(&fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)?;
    }
    let (sa, len) = sockaddr_any(addr);
    // SAFETY: `sa` holds a sockaddr of `len` bytes.
    cvt(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_storage).cast(),
            len,
        )
    })?;
    // SAFETY: a bound socket.
    cvt(unsafe { libc::listen(fd.as_raw_fd(), 128) })?;
    Ok(TcpListener::from(fd))
}

/// An SCTP association to `addr` from the calling thread's namespace, set
/// up within `timeout` (`TimedOut` when the INIT is not answered in time,
/// `ConnectionRefused` when answered with an ABORT: nothing listens). The
/// returned stream blocks; reads and writes have no timeout until set.
///
/// Do not `shutdown(Write)` it to mark the request's end as with TCP: an
/// SCTP SHUTDOWN is no half-close, the peer may no longer send; the lab
/// server answers a request line ended by `\n`.
pub fn connect_timeout(addr: impl Into<SocketAddr>, timeout: Duration) -> io::Result<TcpStream> {
    let addr = addr.into();
    let fd = socket(domain(addr), libc::SOCK_NONBLOCK)?;
    let (sa, len) = sockaddr_any(addr);
    // SAFETY: `sa` holds a sockaddr of `len` bytes.
    let r = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_storage).cast(),
            len,
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
        wait_connected(&fd, timeout)?;
    }
    // Back to blocking.
    // SAFETY: fcntl on a valid descriptor.
    let fl = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK) })?;
    Ok(TcpStream::from(fd))
}

/// Waits (up to `timeout`) for a non-blocking connect to finish; its error,
/// if it failed.
fn wait_connected(fd: &OwnedFd, timeout: Duration) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "SCTP association not set up before the timeout",
            ));
        }
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            continue;
        }
        let mut err: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: an int option of the right size.
        cvt(unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&mut err as *mut libc::c_int).cast(),
                &mut len,
            )
        })?;
        return match err {
            0 => Ok(()),
            e => Err(io::Error::from_raw_os_error(e)),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_module_in_proc_modules() {
        let text = "\
sctp 471040 2 - Live 0x0000000000000000
libcrc32c 12288 1 sctp, Live 0x0000000000000000
sctp_diag 12288 0 - Live 0x0000000000000000
";
        assert!(module_listed(text, "sctp"));
        assert!(module_listed(text, "libcrc32c"));
        assert!(!module_listed(text, "crc32c"));
        let without = "sctp_diag 12288 0 - Live 0x0\nveth 45056 0 - Live 0x0\n";
        assert!(!module_listed(without, "sctp"));
        assert!(!module_listed("", "sctp"));
    }

    #[test]
    fn sockaddr_is_in_network_order() {
        let sa = sockaddr("198.18.0.10:5060".parse().unwrap());
        assert_eq!(sa.sin_family, libc::AF_INET as libc::sa_family_t);
        assert_eq!(u16::from_be(sa.sin_port), 5060);
        assert_eq!(
            Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
            Ipv4Addr::new(198, 18, 0, 10)
        );
    }

    #[test]
    fn sockaddr_any_holds_either_family() {
        let (ss, len) = sockaddr_any("[2001:2::a]:5060".parse().unwrap());
        assert_eq!(len as usize, std::mem::size_of::<libc::sockaddr_in6>());
        // SAFETY: sockaddr_any wrote a sockaddr_in6 there.
        let sa: libc::sockaddr_in6 =
            unsafe { std::ptr::read((&ss as *const libc::sockaddr_storage).cast()) };
        assert_eq!(sa.sin6_family, libc::AF_INET6 as libc::sa_family_t);
        assert_eq!(u16::from_be(sa.sin6_port), 5060);
        assert_eq!(
            Ipv6Addr::from(sa.sin6_addr.s6_addr),
            "2001:2::a".parse::<Ipv6Addr>().unwrap()
        );
        let (ss, len) = sockaddr_any("198.18.0.10:5060".parse().unwrap());
        assert_eq!(len as usize, std::mem::size_of::<libc::sockaddr_in>());
        assert_eq!(ss.ss_family, libc::AF_INET as libc::sa_family_t);
    }
}

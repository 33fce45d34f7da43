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
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
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

/// A new one-to-one SCTP socket (`flags`: `SOCK_NONBLOCK` or 0).
fn socket(flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned from here on.
    let fd = cvt(unsafe {
        libc::socket(
            libc::AF_INET,
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

const SOCKADDR_LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;

/// A listening one-to-one SCTP socket on 0.0.0.0:`port` (in the calling
/// thread's namespace), as a `TcpListener`: its `accept` gives one
/// association per `TcpStream`.
pub fn listen(port: u16) -> io::Result<TcpListener> {
    let fd = socket(0)?;
    let one: libc::c_int = 1;
    // SAFETY: a valid descriptor and an int option of the right size.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })?;
    let sa = sockaddr(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port));
    // SAFETY: `sa` is a sockaddr_in of SOCKADDR_LEN bytes.
    cvt(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_in).cast(),
            SOCKADDR_LEN,
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
pub fn connect_timeout(addr: SocketAddrV4, timeout: Duration) -> io::Result<TcpStream> {
    let fd = socket(libc::SOCK_NONBLOCK)?;
    let sa = sockaddr(addr);
    // SAFETY: `sa` is a sockaddr_in of SOCKADDR_LEN bytes.
    let r = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_in).cast(),
            SOCKADDR_LEN,
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
}

//! The agent's socket diag (`proxy_agent::host::sockdiag`), which destroys host
//! clients' connected UDP sockets aimed at a removed backend: it finds and
//! destroys them in both families — IPv4 sockets, IPv6 sockets, and
//! dual-stack IPv6 sockets connected to an IPv4-mapped address (whose peer
//! is the IPv4 backend). In a namespace of its own, on its loopback device.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;

use proxy_agent::host::sockdiag;

use proxy_testkit::kit::harness::NetNs;

/// `SO_COOKIE` of a socket: what socket diag reports it under.
fn cookie(s: &UdpSocket) -> u64 {
    let mut c: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt into a u64 of the given length, on our socket.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&mut c as *mut u64).cast(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "SO_COOKIE: {}", std::io::Error::last_os_error());
    c
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn connected_udp_sockets_of_both_families_are_found_and_destroyed() {
    let ns = NetNs::new("kpr-diag").expect("netns");
    ns.ip(&["link", "set", "lo", "up"]).unwrap();
    ns.ip(&["addr", "add", "198.18.0.1/32", "dev", "lo"])
        .unwrap();
    ns.ip(&["addr", "add", "2001:2::1/128", "dev", "lo", "nodad"])
        .unwrap();
    ns.enter(|| {
        let v4_peer: SocketAddr = (Ipv4Addr::new(198, 18, 0, 1), 5353).into();
        let v6_peer: SocketAddr = ("2001:2::1".parse::<Ipv6Addr>().unwrap(), 5353).into();
        let mapped_peer: SocketAddr = (Ipv4Addr::new(198, 18, 0, 1).to_ipv6_mapped(), 5354).into();
        let v4 = UdpSocket::bind("198.18.0.1:0").unwrap();
        v4.connect(v4_peer).unwrap();
        let v6 = UdpSocket::bind("[2001:2::1]:0").unwrap();
        v6.connect(v6_peer).unwrap();
        // A dual-stack socket: IPv6, sending to an IPv4 peer.
        let mapped = UdpSocket::bind("[::]:0").unwrap();
        mapped.connect(mapped_peer).unwrap();

        let found = match sockdiag::connected_udp() {
            Ok(found) => found,
            // No UDP socket diag in this kernel (`udp_diag` not built in,
            // and the VM runner's guests load no module): nothing to test.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                eprintln!("SKIPPED: this kernel has no UDP socket diag (udp_diag): {e}");
                return;
            }
            Err(e) => panic!("socket diag dump: {e}"),
        };
        for (s, peer) in [(&v4, v4_peer), (&v6, v6_peer), (&mapped, mapped_peer)] {
            let c = cookie(s);
            let d = found
                .iter()
                .find(|d| d.cookie == c)
                .unwrap_or_else(|| panic!("socket to {peer} not in the dump: {found:?}"));
            assert_eq!(d.remote, peer);
        }
        assert_eq!(
            sockdiag::backend_of(mapped_peer),
            SocketAddr::from((Ipv4Addr::new(198, 18, 0, 1), 5354))
        );

        // Gone: the IPv6 backend and the IPv4 one the mapped socket reaches;
        // `ours` says the hooks aimed every socket.
        let gone = [v6_peer, sockdiag::backend_of(mapped_peer)]
            .into_iter()
            .collect();
        let d = sockdiag::destroy_aimed_at(&gone, |_, _| true).expect("destroy");
        assert_eq!((d.destroyed, d.failed), (2, 0));
        // A destroyed socket's next call fails: ECONNABORTED once, and it
        // is no longer connected (a send has no destination).
        let aborted = |s: &UdpSocket| {
            s.send(b"x")
                .err()
                .and_then(|e| e.raw_os_error())
                .is_some_and(|e| e == libc::ECONNABORTED || e == libc::EDESTADDRREQ)
        };
        assert!(aborted(&v6), "the IPv6 socket was destroyed");
        assert!(aborted(&mapped), "the dual-stack socket was destroyed");
        assert!(v4.send(b"x").is_ok(), "the IPv4 socket, not gone, lives on");
    });
}

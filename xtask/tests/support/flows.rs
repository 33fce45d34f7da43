//! The UDP flow scenarios field-bugs K1 and K2, run by `tests/lab.rs` on one
//! node and by `tests/lab_multinode.rs` across nodes: one client socket with
//! a fixed source port sends a datagram every 100 ms ([`UdpProbe`]) while
//! the endpoints change under it; and [`connect_from`], a TCP connection
//! from a fixed source port (field bug C6).

use std::io;
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::time::{Duration, Instant};

use xtask::Lab;

use super::fixtures::Pod;
use super::{delete_pod, describe, frontend, Shot, UdpProbe};

/// Where a scenario runs.
pub struct Placement<'a> {
    /// Prefix of every message (`K1`, `K1 across nodes`).
    pub what: &'a str,
    /// The probe's source port.
    pub bind_port: u16,
    /// Node of the pod the scenario adds (None: the lab places it).
    pub new_pod_node: Option<&'a str>,
}

impl Placement<'_> {
    fn pod(&self, name: &str, app: &str, port: u16) -> String {
        let pod = Pod::new(name, app);
        match self.new_pod_node {
            Some(node) => pod.node(node),
            None => pod,
        }
        .port(port, "UDP")
        .yaml()
    }
}

/// K1 — a UDP flow keeps using a deleted endpoint. Service `statsd` (UDP
/// 8125) with the pods `pod-a` and `pod-b` (the lab's manifests). "Step 1: new
/// datagrams reach B within about 1 s. Step 2: no datagram is forwarded
/// towards any old backend IP. The client gets ICMP port-unreachable, i.e.
/// reject semantics. Step 3: datagrams reach D within about 1 s" (D: `pod-d`,
/// added).
pub fn k1_udp_flow_leaves_deleted_endpoint(lab: &mut Lab, at: &Placement) {
    let vip = frontend(lab, "statsd", 8125, "UDP");
    k1_udp_flow_leaves_deleted_endpoint_via(lab, at, vip.into())
}

/// [`k1_udp_flow_leaves_deleted_endpoint`] through the frontend `vip` of
/// `statsd` (its IPv6 ClusterIP in a dual-stack lab).
pub fn k1_udp_flow_leaves_deleted_endpoint_via(lab: &mut Lab, at: &Placement, vip: SocketAddr) {
    let what = at.what;
    let ns = lab.client().netns.clone();
    let probe = UdpProbe::start(
        &ns,
        vip,
        at.bind_port,
        Duration::from_millis(100),
        Duration::from_secs(30),
    );
    let origin = Instant::now();
    std::thread::sleep(Duration::from_millis(600));

    // Which pod does the flow use?
    let first = probe.snapshot();
    let answered: Vec<&str> = first
        .iter()
        .filter_map(|s| s.result.as_deref().ok())
        .collect();
    println!("{what} before any change: {}", describe(&first, origin));
    if answered.len() < 3 {
        let shots = probe.finish();
        panic!(
            "{what}: the flow was not answered before any change: {}",
            describe(&shots, origin)
        );
    }
    let x = answered[0].to_string();
    assert!(
        answered.iter().all(|a| *a == x),
        "{what}: one UDP flow (same 5-tuple) was answered by different pods: {answered:?}"
    );
    let y = if x == "pod-a" { "pod-b" } else { "pod-a" }.to_string();

    // Step 1: delete the pod the flow uses.
    let t1 = Instant::now();
    let sync1 = delete_pod(lab, &x);
    std::thread::sleep(Duration::from_millis(1200).saturating_sub(t1.elapsed()));

    // Step 2: delete the last pod.
    let t2 = Instant::now();
    let sync2 = delete_pod(lab, &y);
    std::thread::sleep(Duration::from_millis(1500).saturating_sub(t2.elapsed()));

    // Step 3: a new pod. The manifest is written inside `apply`, so step 2
    // ends when `apply` starts (`t3_start`); step 3 is timed from its return.
    let t3_start = Instant::now();
    lab.apply(&at.pod("pod-d", "statsd", 8125)).unwrap();
    let t3 = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    let shots = probe.finish();
    println!(
        "{what} flow (ms from first manifest change): {}",
        describe(&shots, t1)
    );
    println!(
        "{what}: delete_pod({x}) returned after {} ms, delete_pod({y}) after {} ms",
        sync1.as_millis(),
        sync2.as_millis()
    );

    // Step 1.
    let step1: Vec<&Shot> = shots
        .iter()
        .filter(|s| s.sent >= t1 && s.sent < t2)
        .collect();
    let Some(reach_y) = step1.iter().find(|s| s.result.as_deref() == Ok(y.as_str())) else {
        panic!("{what} step 1: the flow never reached {y} after {x} was deleted")
    };
    let el1 = reach_y.sent - t1;
    println!(
        "{what} step 1: flow reached {y} {} ms after {x} was removed from the manifests",
        el1.as_millis()
    );
    assert!(
        el1 < Duration::from_secs(1),
        "{what} step 1: flow reached {y} only after {el1:?}"
    );
    assert!(
        step1
            .iter()
            .filter(|s| s.sent >= reach_y.sent)
            .all(|s| s.result.as_deref() == Ok(y.as_str())),
        "{what} step 1: after reaching {y}, the flow did not stay there"
    );

    // Step 2.
    let step2: Vec<&Shot> = shots
        .iter()
        .filter(|s| s.sent >= t2 && s.sent < t3_start)
        .collect();
    let Some(refused) = step2
        .iter()
        .position(|s| s.result == Err(io::ErrorKind::ConnectionRefused))
    else {
        panic!("{what} step 2: with 0 endpoints the flow was never refused (ICMP)")
    };
    let el2 = step2[refused].sent - t2;
    println!(
        "{what} step 2: flow refused {} ms after the last pod was removed",
        el2.as_millis()
    );
    assert!(
        el2 < Duration::from_secs(1),
        "{what} step 2: refused only after {el2:?}"
    );
    let bad: Vec<&&Shot> = step2[refused..]
        .iter()
        .filter(|s| s.result != Err(io::ErrorKind::ConnectionRefused))
        .collect();
    assert!(
        bad.is_empty(),
        "{what} step 2: with 0 endpoints some datagrams were not refused: {bad:?}"
    );

    // Step 3.
    let Some(reach_d) = shots
        .iter()
        .filter(|s| s.sent >= t3)
        .find(|s| s.result.as_deref() == Ok("pod-d"))
    else {
        panic!("{what} step 3: the flow never reached the new pod-d")
    };
    let el3 = reach_d.sent - t3;
    println!(
        "{what} step 3: flow reached pod-d {} ms after it was added to the manifests",
        el3.as_millis()
    );
    assert!(
        el3 < Duration::from_secs(1),
        "{what} step 3: reached pod-d only after {el3:?}"
    );
}

/// K2 — a UDP blackhole survives endpoints going 0→N: Service `dns` (UDP 53)
/// with no endpoint (the lab's manifests), a client sending from a fixed
/// source port; a ready pod `dns-1` is added: "the first datagram after the
/// change is forwarded to A, within about 1 s". Also: "the no-backend path
/// must not create a CT entry or any negative-cache state" (before the
/// change, datagrams are refused).
pub fn k2_udp_zero_to_one_endpoint(lab: &mut Lab, at: &Placement) {
    let what = at.what;
    let ns = lab.client().netns.clone();
    let vip = frontend(lab, "dns", 53, "UDP");
    let probe = UdpProbe::start(
        &ns,
        vip,
        at.bind_port,
        Duration::from_millis(100),
        Duration::from_secs(20),
    );
    std::thread::sleep(Duration::from_millis(500));
    // The manifest is written inside `apply` (after the pod's namespace is
    // made), so the agent may program the endpoint before `apply` returns:
    // "before the change" ends when `apply` starts, "after" starts when it
    // returns.
    let t0 = Instant::now();
    lab.apply(&at.pod("dns-1", "dns", 53)).unwrap();
    let t = Instant::now();
    // About 20 more datagrams after the change.
    std::thread::sleep(Duration::from_millis(2000));
    let shots = probe.finish();
    println!(
        "{what} flow (ms from the pod's addition): {}",
        describe(&shots, t)
    );

    let before: Vec<&Shot> = shots.iter().filter(|s| s.sent < t0).collect();
    assert!(
        before.len() >= 3,
        "{what}: too few datagrams before the change"
    );
    assert!(
        before
            .iter()
            .all(|s| s.result == Err(io::ErrorKind::ConnectionRefused)),
        "{what}: with 0 endpoints the datagrams were not all refused: {}",
        describe(&shots, t)
    );
    let after: Vec<&Shot> = shots.iter().filter(|s| s.sent >= t).collect();
    let Some(first) = after
        .iter()
        .position(|s| s.result.as_deref() == Ok("dns-1"))
    else {
        panic!("{what}: the same source port never reached dns-1 after it was added")
    };
    let el = after[first].sent - t;
    println!(
        "{what}: first answer from dns-1 {} ms after the change (datagram #{} after it)",
        el.as_millis(),
        first + 1
    );
    assert!(
        el < Duration::from_secs(1),
        "{what}: reached dns-1 only after {el:?}"
    );
    assert!(
        after[first..]
            .iter()
            .all(|s| s.result.as_deref() == Ok("dns-1")),
        "{what}: after reaching dns-1 the flow did not stay there"
    );
}

/// A `sockaddr_in` for `a`.
pub fn sockaddr_in(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// A TCP socket with SO_REUSEADDR and SO_REUSEPORT bound to `src`, connected
/// to `dst` (connect bounded by SO_SNDTIMEO = `timeout`), in the current thread's
/// namespace.
pub fn connect_from(
    src: SocketAddrV4,
    dst: SocketAddrV4,
    timeout: Duration,
) -> io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let check = |r: libc::c_int| {
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    };
    // SAFETY: plain socket syscalls on a descriptor owned by `stream` from
    // its creation on (closed on every error path by its drop).
    unsafe {
        let fd = check(libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
        ))?;
        let stream = TcpStream::from_raw_fd(fd);
        let one: libc::c_int = 1;
        for opt in [libc::SO_REUSEADDR, libc::SO_REUSEPORT] {
            check(libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                &one as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            ))?;
        }
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        check(libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            &tv as *const libc::timeval as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        ))?;
        let s = sockaddr_in(src);
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        check(libc::bind(
            fd,
            &s as *const libc::sockaddr_in as *const libc::sockaddr,
            len,
        ))?;
        let d = sockaddr_in(dst);
        check(libc::connect(
            fd,
            &d as *const libc::sockaddr_in as *const libc::sockaddr,
            len,
        ))?;
        Ok(stream)
    }
}

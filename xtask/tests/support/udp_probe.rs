//! [`UdpProbe`]: one UDP client on a fixed source port, sending on an
//! interval in the background, and what each of its datagrams got.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xtask::client::reply_text;
use xtask::netns::in_netns;

/// What one datagram of a [`UdpProbe`] got.
#[derive(Debug, Clone)]
pub struct Shot {
    pub sent: Instant,
    pub result: Result<String, io::ErrorKind>,
}

/// One UDP socket bound to a fixed source port, connected to a VIP, sending
/// `hostname` every `interval` (like a statsd or DNS client) until stopped
/// or `max` has passed.
pub struct UdpProbe {
    stop: Arc<AtomicBool>,
    shots: Arc<Mutex<Vec<Shot>>>,
    handle: JoinHandle<io::Result<io::Result<()>>>,
}

impl UdpProbe {
    /// Waits up to `interval` for each answer; at most 1000 datagrams.
    pub fn start(
        ns: &str,
        addr: impl Into<SocketAddr>,
        bind_port: u16,
        interval: Duration,
        max: Duration,
    ) -> Self {
        Self::spawn(ns, addr.into(), bind_port, interval, interval, max, 1000)
    }

    /// Waits up to `read_timeout` for each answer; no cap on the number of
    /// datagrams (until stopped or `max` has passed).
    pub fn start_waiting(
        ns: &str,
        addr: impl Into<SocketAddr>,
        bind_port: u16,
        interval: Duration,
        read_timeout: Duration,
        max: Duration,
    ) -> Self {
        Self::spawn(
            ns,
            addr.into(),
            bind_port,
            interval,
            read_timeout,
            max,
            usize::MAX,
        )
    }

    fn spawn(
        ns: &str,
        addr: SocketAddr,
        bind_port: u16,
        interval: Duration,
        read_timeout: Duration,
        max: Duration,
        max_shots: usize,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let shots = Arc::new(Mutex::new(Vec::new()));
        let (flag, out) = (stop.clone(), shots.clone());
        let ns = ns.to_string();
        let handle = std::thread::spawn(move || {
            in_netns(&ns, move || -> io::Result<()> {
                let local = match addr {
                    SocketAddr::V4(_) => {
                        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, bind_port))
                    }
                    SocketAddr::V6(_) => {
                        SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, bind_port, 0, 0))
                    }
                };
                let sock = UdpSocket::bind(local)?;
                sock.connect(addr)?;
                sock.set_read_timeout(Some(read_timeout))?;
                let begin = Instant::now();
                let mut buf = vec![0u8; 65536];
                for _ in 0..max_shots {
                    if flag.load(Ordering::SeqCst) || begin.elapsed() >= max {
                        break;
                    }
                    let sent = Instant::now();
                    let result = match sock.send(b"hostname") {
                        Err(e) => Err(e.kind()),
                        Ok(_) => match sock.recv(&mut buf) {
                            Ok(n) => Ok(reply_text(&buf[..n])),
                            Err(e) => Err(match e.kind() {
                                io::ErrorKind::WouldBlock => io::ErrorKind::TimedOut,
                                k => k,
                            }),
                        },
                    };
                    out.lock().unwrap().push(Shot { sent, result });
                    let spent = sent.elapsed();
                    if spent < interval {
                        std::thread::sleep(interval - spent);
                    }
                }
                Ok(())
            })
        });
        UdpProbe {
            stop,
            shots,
            handle,
        }
    }

    /// What the probe got so far.
    pub fn snapshot(&self) -> Vec<Shot> {
        self.shots.lock().unwrap().clone()
    }

    pub fn finish(self) -> Vec<Shot> {
        self.stop.store(true, Ordering::SeqCst);
        let shots = self.shots.clone();
        self.handle
            .join()
            .expect("probe thread panicked")
            .expect("enter client namespace")
            .expect("probe socket");
        let v = shots.lock().unwrap().clone();
        v
    }
}

/// Signed milliseconds from `origin` to `t`.
pub fn ms_since(origin: Instant, t: Instant) -> i64 {
    if t >= origin {
        (t - origin).as_millis() as i64
    } else {
        -((origin - t).as_millis() as i64)
    }
}

/// The shots as `+<ms>:<answer or error>`, from `origin`.
pub fn describe(shots: &[Shot], origin: Instant) -> String {
    shots
        .iter()
        .map(|s| {
            format!(
                "{:+}ms:{}",
                ms_since(origin, s.sent),
                match &s.result {
                    Ok(n) => n.clone(),
                    Err(k) => format!("{k:?}"),
                }
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

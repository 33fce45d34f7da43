//! Packet fuzzing (issue 15): seeded, bounded runs of random and mutated
//! frames — valid headers with random fields, truncations, IPv4 header edits
//! (options, lengths, fragments), stray bytes, other EtherTypes — through
//! every program with real maps. Whatever the frame, the program returns; and
//! for every frame the invariants a user relies on hold:
//!
//! - a well-formed frame to a frontend never leaves tc untranslated (XDP may
//!   pass it on to tc untouched: that is its deferral);
//! - a well-formed reply of a tracked flow never leaves with the backend as
//!   its source;
//! - every frame a program rewrote from a well-formed one is well-formed:
//!   IPv4 header and L4 checksums valid, lengths consistent.
//!
//! The seed is printed; `KPR_FUZZ_SEED` replays one, `KPR_FUZZ_FRAMES` sets
//! how many frames each program gets (default 1500: a few seconds).
use super::*;
use proxy_common::IPPROTO_SCTP;

/// xorshift64*: small, seedable, good enough to pick mutations.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub(super) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    pub(super) fn byte(&mut self) -> u8 {
        self.next() as u8
    }
    pub(super) fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.byte()).collect()
    }
    /// Up to `max - 1` random bytes.
    pub(super) fn some_bytes(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max) as usize;
        self.bytes(n)
    }
}

/// A frame is well-formed when it is Ethernet + IPv4 whose lengths agree,
/// not a fragment, with a complete TCP/UDP/ICMP header (SCTP: common header
/// and a chunk's) and valid checksums (SCTP: its CRC32c).
/// Returns (source, sport, destination, dport, proto) then.
fn well_formed(f: &[u8]) -> Option<(Ipv4Addr, u16, Ipv4Addr, u16, u8)> {
    if f.len() < 34 || f[12..14] != [0x08, 0x00] || f[14] >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(f[14] & 0x0f) * 4;
    if ihl < 20 || f.len() < 14 + ihl {
        return None;
    }
    let ip = &f[14..14 + ihl];
    if kit::check::ip_csum(ip) != 0 {
        return None;
    }
    let tot = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let frag = u16::from_be_bytes([ip[6], ip[7]]);
    if f.len() != 14 + tot || frag & 0x3fff != 0 {
        return None;
    }
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let l4 = &f[14 + ihl..];
    let proto = ip[9];
    let ok = match proto {
        IPPROTO_TCP => l4.len() >= 20 && l4_csum4(src, dst, proto, l4) == 0,
        IPPROTO_UDP => {
            l4.len() >= 8
                && usize::from(u16::from_be_bytes([l4[4], l4[5]])) == l4.len()
                && (l4[6..8] == [0, 0] || l4_csum4(src, dst, proto, l4) == 0)
        }
        IPPROTO_ICMP => l4.len() >= 8 && kit::check::ip_csum(l4) == 0,
        IPPROTO_SCTP => l4.len() >= 16 && l4[8..12] == kit::check::sctp_checksum(l4),
        _ => false,
    };
    if !ok {
        return None;
    }
    let (sport, dport) = if proto == IPPROTO_ICMP {
        (0, 0)
    } else {
        (
            u16::from_be_bytes([l4[0], l4[1]]),
            u16::from_be_bytes([l4[2], l4[3]]),
        )
    };
    Some((src, sport, dst, dport, proto))
}

const LB: Ipv4Addr = Ipv4Addr::new(198, 18, 9, 1);

/// The frontends of the fuzzed maps: (address, port, protocol, scope).
fn fuzz_frontends() -> Vec<(Ipv4Addr, u16, u8, u8)> {
    use proxy_common::{SCOPE_EXTERNAL as E, SCOPE_INTERNAL as I};
    vec![
        (VIP, 80, IPPROTO_TCP, I),
        (VIP, 53, IPPROTO_UDP, I),
        (NODE, 30080, IPPROTO_TCP, E),
        (NODE, 30080, IPPROTO_TCP, I),
        (LB, 80, IPPROTO_TCP, E),
        (VIP, 5060, IPPROTO_SCTP, I),
        (NODE, 30060, IPPROTO_SCTP, E),
    ]
}

fn fuzz_setup() -> Setup {
    let tcp2 = vec![be(B1, 8080, IPPROTO_TCP), be(B2, 8080, IPPROTO_TCP)];
    let mut s = Setup::new(vec![
        (fe(VIP, 80, IPPROTO_TCP), tcp2.clone(), 0),
        (fe(VIP, 53, IPPROTO_UDP), vec![be(B1, 5353, IPPROTO_UDP)], 0),
        (
            fe_ext(NODE, 30080, IPPROTO_TCP),
            vec![be(REMOTE, 8080, IPPROTO_TCP)],
            0,
        ),
        (fe(NODE, 30080, IPPROTO_TCP), tcp2, 0),
        (
            fe_ext(LB, 80, IPPROTO_TCP),
            vec![be(B1, 8080, IPPROTO_TCP)],
            0,
        ),
        // SCTP with port translation: the CRC32c must hold after any rewrite.
        (
            fe(VIP, 5060, IPPROTO_SCTP),
            vec![be(B1, 5061, IPPROTO_SCTP), be(B2, 5061, IPPROTO_SCTP)],
            0,
        ),
        (
            fe_ext(NODE, 30060, IPPROTO_SCTP),
            vec![be(REMOTE, 5061, IPPROTO_SCTP)],
            0,
        ),
    ]);
    s.node = Some(NODE.into());
    s.local = vec![B1.into(), B2.into()];
    s.wire = Some((
        "198.18.0.0/16",
        vec![
            ("198.18.1.10", "02:00:00:00:00:bb"),
            ("198.18.1.11", "02:00:00:00:00:bb"),
            ("198.18.2.10", "02:00:00:00:00:bb"),
            ("198.18.1.2", "02:00:00:00:00:cc"),
            ("198.18.0.100", "02:00:00:00:00:cc"),
        ],
    ));
    s
}

/// A well-formed frame: to a frontend, or to something else.
fn random_valid(rng: &mut Rng) -> Vec<u8> {
    let fes = fuzz_frontends();
    let (dst, dport, proto, _) = if rng.chance(80) {
        fes[rng.below(fes.len() as u64) as usize]
    } else {
        (
            Ipv4Addr::new(198, 18, 3, rng.byte()),
            rng.below(65535) as u16 + 1,
            IPPROTO_TCP,
            0,
        )
    };
    let src = if rng.chance(50) { CLIENT } else { EXT_CLIENT };
    let sport = 1024 + rng.below(60000) as u16;
    let payload = rng.some_bytes(48);
    if proto == IPPROTO_UDP {
        udp4(src, sport, dst, dport, &payload)
    } else if proto == IPPROTO_SCTP {
        // INIT, INIT ACK, ABORT, SHUTDOWN, DATA or any chunk type.
        let chunk = [1u8, 2, 6, 7, 0, rng.byte()][rng.below(6) as usize];
        kit::frame::sctp4(src, sport, dst, dport, chunk, &payload)
    } else {
        let flags = match rng.below(6) {
            0 => SYN,
            1 => ACK,
            2 => ACK | PSH,
            3 => FIN | ACK,
            4 => 0x04, // RST
            _ => rng.byte(),
        };
        tcp4(src, sport, dst, dport, flags, &payload)
    }
}

/// `frame` mutated one way (or not at all).
fn mutate(rng: &mut Rng, frame: &mut Vec<u8>) {
    match rng.below(8) {
        0 => {} // as it is
        1 => {
            let n = rng.below(frame.len() as u64) as usize;
            frame.truncate(n.max(14));
        }
        2 => {
            // An IPv4 header field: version/IHL, TOS, length, id, flags and
            // fragment offset, TTL, protocol; the header checksum resealed.
            let at = 14 + [0usize, 1, 2, 3, 6, 7, 8, 9][rng.below(8) as usize];
            frame[at] = rng.byte();
            if frame[14] & 0x0f >= 5 && frame.len() >= 14 + usize::from(frame[14] & 0x0f) * 4 {
                kit::frame::reseal_ipv4_header(frame);
            }
        }
        3 => {
            let at = rng.below(frame.len() as u64) as usize;
            frame[at] = rng.byte();
        }
        4 => {
            let extra = rng.some_bytes(32);
            frame.extend(extra);
            frame.push(0);
        }
        5 => {
            // A first fragment or a later one.
            let more = if rng.chance(50) { 0x2000 } else { 0 };
            let v: u16 = if rng.chance(50) {
                0x2000
            } else {
                rng.below(64) as u16 | more
            };
            frame[20..22].copy_from_slice(&v.to_be_bytes());
            kit::frame::reseal_ipv4_header(frame);
        }
        6 => {
            let et = [0x86ddu16, 0x0806, 0x8100, rng.next() as u16][rng.below(4) as usize];
            frame[12..14].copy_from_slice(&et.to_be_bytes());
        }
        _ => {
            let n = 14 + rng.below(80) as usize;
            *frame = rng.bytes(n);
        }
    }
}

/// The run's seed (`KPR_FUZZ_SEED`, else the clock) and frames per program
/// (`KPR_FUZZ_FRAMES`, else 1500), printed.
pub(super) fn seed_and_frames() -> (u64, usize) {
    let seed = std::env::var("KPR_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64 | 1)
        });
    let frames: usize = std::env::var("KPR_FUZZ_FRAMES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1500);
    println!("fuzz seed {seed} (KPR_FUZZ_SEED={seed} replays it), {frames} frames per program");
    (seed, frames)
}

/// Frames `BPF_PROG_TEST_RUN` refuses before any program runs: shorter than
/// the network header their EtherType announces.
pub(super) fn runner_refuses(f: &[u8]) -> bool {
    match f.get(12..14) {
        Some([0x08, 0x00]) => f.len() < 14 + 20,
        Some([0x86, 0xdd]) => f.len() < 14 + 40,
        _ => f.len() < 14,
    }
}

/// Whether `(dst, dport, proto)` is a frontend `prog` translates.
fn frontend_of(prog: Prog, dst: Ipv4Addr, dport: u16, proto: u8) -> bool {
    let scope = if prog == PodIngress {
        proxy_common::SCOPE_INTERNAL
    } else {
        proxy_common::SCOPE_EXTERNAL
    };
    fuzz_frontends().contains(&(dst, dport, proto, scope))
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn fuzzed_frames_are_translated_or_left_alone_never_broken() {
    let (seed, frames) = seed_and_frames();
    let s = fuzz_setup();
    let backends = [B1, B2, REMOTE];
    for prog in Prog::ALL {
        let h = s.harness();
        let mut rng = Rng(seed ^ prog as u64);
        let mut violations = Vec::new();
        let mut translated = 0;
        let mut refused = 0;
        h.enter(|| {
            for i in 0..frames {
                // A reply of a tracked flow now and then: open one first.
                let (mut frame, reply_of) = if rng.chance(20) {
                    let sport = 1024 + rng.below(60000) as u16;
                    let syn = tcp4(CLIENT, sport, VIP, 80, SYN, b"");
                    let b = match h.test_run(PodIngress, &syn) {
                        Ok(r) => well_formed(&r.frame).map(|t| t.2),
                        Err(_) => None,
                    };
                    let Some(b) = b.filter(|b| backends.contains(b)) else {
                        continue;
                    };
                    let flags = [SYN | ACK, ACK, ACK | PSH, FIN | ACK][rng.below(4) as usize];
                    (tcp4(b, 8080, CLIENT, sport, flags, &rng.some_bytes(32)), Some(b))
                } else {
                    (random_valid(&mut rng), None)
                };
                mutate(&mut rng, &mut frame);
                let input_ok = well_formed(&frame);
                let run = match h.test_run(prog, &frame) {
                    Ok(r) => r,
                    // The kernel's test runner itself refuses frames it
                    // cannot build an skb of (no complete network header
                    // after an IPv4 or IPv6 EtherType); the program never
                    // sees those.
                    Err(_) if runner_refuses(&frame) => {
                        refused += 1;
                        continue;
                    }
                    Err(e) => {
                        violations.push(format!("#{i}: test run failed: {e} on {frame:02x?}"));
                        continue;
                    }
                };
                let dropped = run.retval == Drop.code(prog);
                if dropped || run.frame == frame {
                    // Left alone: a well-formed frame to a frontend must not be.
                    if let (false, Some((_, _, dst, dport, proto))) = (dropped, input_ok) {
                        if !prog.is_xdp() && reply_of.is_none() && frontend_of(prog, dst, dport, proto) {
                            violations.push(format!("#{i}: {}: to frontend {dst}:{dport}/{proto} left untranslated", prog.name()));
                        }
                        if let Some(b) = reply_of.filter(|_| !prog.is_xdp()) {
                            violations.push(format!("#{i}: reply from backend {b} left untranslated"));
                        }
                    }
                    continue;
                }
                if input_ok.is_none() {
                    continue;
                }
                translated += 1;
                match well_formed(&run.frame) {
                    None => violations.push(format!(
                        "#{i}: {} rewrote a well-formed frame into a broken one: {:02x?} -> {:02x?}",
                        prog.name(),
                        frame,
                        run.frame
                    )),
                    Some((src, sport, ..)) => {
                        if reply_of.is_some_and(|b| src == b && sport == 8080) {
                            violations.push(format!("#{i}: reply left with the backend's source {src}"));
                        }
                    }
                }
            }
        });
        println!(
            "{}: {frames} frames, {translated} rewritten, {} violations",
            prog.name(),
            violations.len()
        );
        assert!(
            violations.is_empty(),
            "seed {seed}, {}: {} violations, first: {:#?}",
            prog.name(),
            violations.len(),
            &violations[..violations.len().min(5)]
        );
    }
}

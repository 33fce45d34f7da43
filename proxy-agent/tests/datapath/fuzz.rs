//! Packet fuzzing (issue 15), both families: seeded, bounded runs of random
//! and mutated frames through the programs with real maps. Each family
//! makes its own frames and checks them (the formats really differ): over
//! IPv4, valid headers with random fields, truncations, header edits
//! (options, lengths, fragments), stray bytes, other EtherTypes; over IPv6,
//! the same with options headers, and fragment, routing and overlong
//! options headers inserted. One loop ([`fuzz`]) runs them. Whatever the
//! frame, the program returns; and for every frame the invariants a user
//! relies on hold:
//!
//! - a well-formed frame to a frontend never leaves tc untranslated (XDP may
//!   pass it on to tc untouched: that is its deferral);
//! - a well-formed reply of a tracked flow never leaves tc with the backend
//!   as its source;
//! - every frame a program rewrote from a well-formed one is well-formed:
//!   header and L4 checksums valid (over the new pseudo-header; SCTP's
//!   CRC32c), lengths consistent.
//!
//! The seed is printed; `KPR_FUZZ_SEED` replays one, `KPR_FUZZ_FRAMES` sets
//! how many frames each program gets (default 1500: a few seconds).
use std::net::Ipv6Addr;

use super::*;
use proxy_common::{IPPROTO_SCTP, SCOPE_EXTERNAL, SCOPE_INTERNAL};
use proxy_testkit::kit::check::{l4_csum6, sctp_checksum, NEXTHDR_FRAGMENT};
use proxy_testkit::kit::frame::{
    frame6, ipv6_fragment_header, ipv6_options_header, ipv6_routing_header, sctp_packet,
    udp_segment, ETH_P_IPV6, L4_OFF6,
};

/// A well-formed frame's (source, sport, destination, dport, protocol).
type Tuple = (IpAddr, u16, IpAddr, u16, u8);
/// A fuzzed frontend: (address, port, protocol, scope).
type Frontend = (IpAddr, u16, u8, u8);

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
fn well_formed(f: &[u8]) -> Option<Tuple> {
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
        IPPROTO_SCTP => l4.len() >= 16 && l4[8..12] == sctp_checksum(l4),
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
    Some((src.into(), sport, dst.into(), dport, proto))
}

/// The addresses of one family's fuzzed maps: the frontends (a ClusterIP,
/// NodePorts, a load-balancer IP) and their backends (two on this node,
/// `local` or not, and one on another), and the namespace's route and
/// neighbours (so that XDP can deliver to a remote backend and back to a
/// client: `b1`, `b2`, `remote`, then the two clients).
struct FuzzAddrs {
    vip: IpAddr,
    node: IpAddr,
    lb: IpAddr,
    b1: IpAddr,
    b2: IpAddr,
    remote: IpAddr,
    local: bool,
    wire: (&'static str, [&'static str; 5]),
}

/// The fuzzed frontends: (address, port, protocol, scope).
fn frontends(a: &FuzzAddrs) -> Vec<Frontend> {
    use proxy_common::{SCOPE_EXTERNAL as E, SCOPE_INTERNAL as I};
    vec![
        (a.vip, 80, IPPROTO_TCP, I),
        (a.vip, 53, IPPROTO_UDP, I),
        (a.node, 30080, IPPROTO_TCP, E),
        (a.node, 30080, IPPROTO_TCP, I),
        (a.lb, 80, IPPROTO_TCP, E),
        (a.vip, 5060, IPPROTO_SCTP, I),
        (a.node, 30060, IPPROTO_SCTP, E),
    ]
}

/// The maps of [`frontends`].
fn setup(a: &FuzzAddrs) -> Setup {
    let tcp2 = vec![be(a.b1, 8080, IPPROTO_TCP), be(a.b2, 8080, IPPROTO_TCP)];
    let mut s = Setup::new(vec![
        (fe(a.vip, 80, IPPROTO_TCP), tcp2.clone(), 0),
        (
            fe(a.vip, 53, IPPROTO_UDP),
            vec![be(a.b1, 5353, IPPROTO_UDP)],
            0,
        ),
        (
            fe_ext(a.node, 30080, IPPROTO_TCP),
            vec![be(a.remote, 8080, IPPROTO_TCP)],
            0,
        ),
        (fe(a.node, 30080, IPPROTO_TCP), tcp2, 0),
        (
            fe_ext(a.lb, 80, IPPROTO_TCP),
            vec![be(a.b1, 8080, IPPROTO_TCP)],
            0,
        ),
        // SCTP with port translation: the CRC32c must hold after any rewrite.
        (
            fe(a.vip, 5060, IPPROTO_SCTP),
            vec![be(a.b1, 5061, IPPROTO_SCTP), be(a.b2, 5061, IPPROTO_SCTP)],
            0,
        ),
        (
            fe_ext(a.node, 30060, IPPROTO_SCTP),
            vec![be(a.remote, 5061, IPPROTO_SCTP)],
            0,
        ),
    ]);
    s.node = Some(a.node);
    if a.local {
        s.local = vec![a.b1, a.b2];
    }
    let (route, n) = a.wire;
    let (bb, cc) = ("02:00:00:00:00:bb", "02:00:00:00:00:cc");
    s.wire = Some((
        route,
        vec![(n[0], bb), (n[1], bb), (n[2], bb), (n[3], cc), (n[4], cc)],
    ));
    s
}

/// A well-formed frame: to a frontend, or to something else.
fn random_valid(rng: &mut Rng, fes: &[Frontend]) -> Vec<u8> {
    let (dst, dport, proto, _) = if rng.chance(80) {
        fes[rng.below(fes.len() as u64) as usize]
    } else {
        (
            Ipv4Addr::new(198, 18, 3, rng.byte()).into(),
            rng.below(65535) as u16 + 1,
            IPPROTO_TCP,
            0,
        )
    };
    let IpAddr::V4(dst) = dst else {
        unreachable!("an IPv4 frontend")
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

/// A well-formed IPv6 frame: Ethernet + IPv6 whose payload length agrees
/// with the frame, extension headers only hop-by-hop (first) and
/// destination options, at most [`MAX_EXT_FUZZ`] of them, each complete; no
/// fragment header; a complete TCP/UDP/SCTP header (SCTP: common header and
/// a chunk's) with a valid checksum over the pseudo-header (UDP's may not be
/// 0 over IPv6; SCTP: its CRC32c). Returns (source, sport, destination,
/// dport, proto) then.
fn well_formed6(f: &[u8]) -> Option<Tuple> {
    if f.len() < L4_OFF6 || f[12..14] != [0x86, 0xdd] || f[14] >> 4 != 6 {
        return None;
    }
    if 14 + 40 + usize::from(u16::from_be_bytes([f[18], f[19]])) != f.len() {
        return None;
    }
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&f[22..38]).ok()?);
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&f[38..54]).ok()?);
    let mut nh = f[20];
    let mut off = L4_OFF6;
    let mut walked = 0;
    while nh == 0 || nh == 60 {
        if (nh == 0 && walked > 0) || walked == MAX_EXT_FUZZ || off + 8 > f.len() {
            return None;
        }
        let len = (usize::from(f[off + 1]) + 1) * 8;
        if off + len > f.len() {
            return None;
        }
        nh = f[off];
        off += len;
        walked += 1;
    }
    let l4 = &f[off..];
    let csum_ok = |proto: u8| l4_csum6(src, dst, proto, l4) == 0;
    let ok = match nh {
        IPPROTO_TCP => l4.len() >= 20 && csum_ok(nh),
        IPPROTO_UDP => {
            l4.len() >= 8
                && usize::from(u16::from_be_bytes([l4[4], l4[5]])) == l4.len()
                && l4[6..8] != [0, 0]
                && csum_ok(nh)
        }
        IPPROTO_SCTP => l4.len() >= 16 && l4[8..12] == sctp_checksum(l4),
        _ => false,
    };
    ok.then(|| {
        let port = |at: usize| u16::from_be_bytes([l4[at], l4[at + 1]]);
        (src.into(), port(0), dst.into(), port(2), nh)
    })
}

/// The extension headers a fuzzed frame may carry and still be well-formed
/// (see [`well_formed6`]); the datapath walks up to 4.
const MAX_EXT_FUZZ: usize = 3;

/// A well-formed IPv6 frame, to a frontend (80 %) or to something else,
/// with up to [`MAX_EXT_FUZZ`] options headers of random lengths.
fn random_valid6(rng: &mut Rng, fes: &[Frontend]) -> Vec<u8> {
    let (dst, dport, proto, _) = if rng.chance(80) {
        fes[rng.below(fes.len() as u64) as usize]
    } else {
        (
            Ipv6Addr::new(0x2001, 2, 0, 3, 0, 0, 0, u16::from(rng.byte())).into(),
            rng.below(65535) as u16 + 1,
            IPPROTO_TCP,
            0,
        )
    };
    let src = if rng.chance(50) { CLIENT6 } else { EXT_CLIENT6 };
    let sport = 1024 + rng.below(60000) as u16;
    let payload = rng.some_bytes(48);
    let mut ext = Vec::new();
    for k in 0..rng.below(MAX_EXT_FUZZ as u64 + 1) {
        // Hop-by-hop only first; options of 8 to 24 bytes (PadN).
        let t = if k == 0 && rng.chance(50) { 0 } else { 60 };
        ext.push((t, ipv6_options_header(rng.below(3) as u8)));
    }
    let seg = if proto == IPPROTO_UDP {
        udp_segment(sport, dport, &payload)
    } else if proto == IPPROTO_SCTP {
        let chunk = [1u8, 2, 6, 7, 0, rng.byte()][rng.below(6) as usize];
        sctp_packet(sport, dport, chunk, &payload)
    } else {
        let flags = [SYN, ACK, ACK | 0x08, 0x11, 0x04, rng.byte()][rng.below(6) as usize];
        tcp_segment(sport, dport, flags, &payload)
    };
    let IpAddr::V6(dst) = dst else {
        unreachable!("an IPv6 frontend")
    };
    frame6(src, dst, proto, &ext, seg)
}

/// `frame` mutated one way (or not at all).
fn mutate6(rng: &mut Rng, frame: &mut Vec<u8>) {
    match rng.below(8) {
        0 => {}
        1 => {
            let n = rng.below(frame.len() as u64) as usize;
            frame.truncate(n.max(14));
        }
        2 => {
            // An IPv6 header field: version/traffic class/flow label,
            // payload length, next header, hop limit.
            let at = 14 + [0usize, 1, 3, 4, 5, 6, 7][rng.below(7) as usize];
            frame[at] = rng.byte();
        }
        3 => {
            let at = rng.below(frame.len() as u64) as usize;
            frame[at] = rng.byte();
        }
        4 => {
            // A header inserted first: a fragment header (first or later
            // fragment), a routing header, or an options header whose
            // length runs past the frame; payload length kept consistent.
            let nh = frame[20];
            let (t, mut h) = match rng.below(4) {
                0 => (NEXTHDR_FRAGMENT, ipv6_fragment_header(0, true, 7)),
                1 => (NEXTHDR_FRAGMENT, ipv6_fragment_header(4, false, 7)),
                2 => (43, ipv6_routing_header()),
                _ => (60, vec![0, 200, 1, 4, 0, 0, 0, 0]),
            };
            h[0] = nh;
            frame[20] = t;
            frame.splice(L4_OFF6..L4_OFF6, h);
            let len = (frame.len() - L4_OFF6) as u16;
            frame[18..20].copy_from_slice(&len.to_be_bytes());
        }
        5 => {
            let extra = rng.some_bytes(32);
            frame.extend(extra);
            frame.push(0);
        }
        6 => {
            let et = [0x0800u16, 0x0806, 0x8100, rng.next() as u16][rng.below(4) as usize];
            frame[12..14].copy_from_slice(&et.to_be_bytes());
        }
        _ => {
            let n = 14 + rng.below(100) as usize;
            let mut f = rng.bytes(n);
            f[12..14].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
            *frame = f;
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

/// What the fuzz loop needs of a family: its programs, its maps, its
/// frames and their check.
struct Fuzzed {
    name: &'static str,
    progs: &'static [Prog],
    /// The generator of `prog`'s frames, from the run's seed.
    rng: fn(u64, Prog) -> Rng,
    addrs: FuzzAddrs,
    /// The frontends' scope whose frames `prog` must translate, if any.
    translates: fn(Prog) -> Option<u8>,
    well_formed: fn(&[u8]) -> Option<Tuple>,
    random_valid: fn(&mut Rng, &[Frontend]) -> Vec<u8>,
    mutate: fn(&mut Rng, &mut Vec<u8>),
    /// The pod client and ClusterIP of the tracked flows whose replies are
    /// fuzzed, and the backends `vip:80` has.
    client: IpAddr,
    vip: IpAddr,
    backends: &'static [IpAddr],
}

const FUZZED: [Fuzzed; 2] = [
    Fuzzed {
        name: "IPv4",
        progs: &Prog::ALL,
        rng: |seed, prog| Rng(seed ^ prog as u64),
        addrs: FuzzAddrs {
            vip: IpAddr::V4(VIP),
            node: IpAddr::V4(NODE),
            lb: IpAddr::V4(Ipv4Addr::new(198, 18, 9, 1)),
            b1: IpAddr::V4(B1),
            b2: IpAddr::V4(B2),
            remote: IpAddr::V4(REMOTE),
            local: true,
            wire: (
                "198.18.0.0/16",
                [
                    "198.18.1.10",
                    "198.18.1.11",
                    "198.18.2.10",
                    "198.18.1.2",
                    "198.18.0.100",
                ],
            ),
        },
        translates: |prog| match prog {
            _ if prog.is_xdp() => None,
            PodIngress => Some(SCOPE_INTERNAL),
            _ => Some(SCOPE_EXTERNAL),
        },
        well_formed,
        random_valid,
        mutate,
        client: IpAddr::V4(CLIENT),
        vip: IpAddr::V4(VIP),
        backends: &[IpAddr::V4(B1), IpAddr::V4(B2), IpAddr::V4(REMOTE)],
    },
    Fuzzed {
        name: "IPv6",
        // Each tail-calls its IPv6 program.
        progs: &[PodIngress, ExtIngress, ExtXdp, Egress],
        rng: |seed, prog| Rng(seed ^ (prog as u64) << 8 ^ 6),
        addrs: FuzzAddrs {
            vip: IpAddr::V6(VIP6),
            node: IpAddr::V6(NODE6),
            lb: IpAddr::V6(Ipv6Addr::new(0x2001, 2, 0, 0x64, 0, 0, 0, 0x50)),
            b1: IpAddr::V6(B6),
            b2: IpAddr::V6(B6_2),
            remote: IpAddr::V6(REMOTE6),
            local: false,
            wire: (
                "2001:2::/48",
                [
                    "2001:2:0:1::10",
                    "2001:2:0:1::11",
                    "2001:2:0:2::10",
                    "2001:2:0:1::2",
                    "2001:2::64",
                ],
            ),
        },
        translates: |prog| match prog {
            PodIngress => Some(SCOPE_INTERNAL),
            ExtIngress => Some(SCOPE_EXTERNAL),
            _ => None,
        },
        well_formed: well_formed6,
        random_valid: random_valid6,
        mutate: mutate6,
        client: IpAddr::V6(CLIENT6),
        vip: IpAddr::V6(VIP6),
        backends: &[IpAddr::V6(B6), IpAddr::V6(B6_2)],
    },
];

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn fuzzed_frames_are_translated_or_left_alone_never_broken() {
    let (seed, frames) = seed_and_frames();
    for fam in &FUZZED {
        for &prog in fam.progs {
            fuzz(fam, prog, seed, frames);
        }
    }
}

/// `frames` fuzzed frames of family `fam` through `prog`, on a harness of
/// its own; fails on the first program with violations.
fn fuzz(fam: &Fuzzed, prog: Prog, seed: u64, frames: usize) {
    let h = setup(&fam.addrs).harness();
    let fes = frontends(&fam.addrs);
    let mut rng = (fam.rng)(seed, prog);
    let mut violations = Vec::new();
    let (mut translated, mut refused) = (0, 0);
    let to_frontend = |dst: IpAddr, dport: u16, proto: u8| {
        (fam.translates)(prog).is_some_and(|scope| fes.contains(&(dst, dport, proto, scope)))
    };
    h.enter(|| {
        for i in 0..frames {
            // A reply of a tracked flow now and then: open one first.
            let (mut frame, reply_of) = if rng.chance(20) {
                let sport = 1024 + rng.below(60000) as u16;
                let syn = tcp(fam.client, sport, fam.vip, 80, SYN, b"");
                let b = h
                    .test_run(PodIngress, &syn)
                    .ok()
                    .and_then(|r| (fam.well_formed)(&r.frame))
                    .map(|t| t.2)
                    .filter(|b| fam.backends.contains(b));
                let Some(b) = b else { continue };
                let flags = [SYN | ACK, ACK, ACK | PSH, FIN | ACK][rng.below(4) as usize];
                (
                    tcp(b, 8080, fam.client, sport, flags, &rng.some_bytes(32)),
                    Some(b),
                )
            } else {
                ((fam.random_valid)(&mut rng, &fes), None)
            };
            (fam.mutate)(&mut rng, &mut frame);
            let input_ok = (fam.well_formed)(&frame);
            let run = match h.test_run(prog, &frame) {
                Ok(r) => r,
                // The kernel's test runner itself refuses frames it cannot
                // build an skb of (no complete network header after an IPv4
                // or IPv6 EtherType); the program never sees those.
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
                    if reply_of.is_none() && to_frontend(dst, dport, proto) {
                        violations.push(format!(
                            "#{i}: {}: to frontend {}/{proto} left untranslated: {frame:02x?}",
                            prog.name(),
                            std::net::SocketAddr::new(dst, dport)
                        ));
                    }
                    if let Some(b) = reply_of.filter(|_| !prog.is_xdp()) {
                        violations.push(format!(
                            "#{i}: {}: reply from backend {b} left untranslated",
                            prog.name()
                        ));
                    }
                }
                continue;
            }
            if input_ok.is_none() {
                continue;
            }
            translated += 1;
            match (fam.well_formed)(&run.frame) {
                None => violations.push(format!(
                    "#{i}: {} rewrote a well-formed frame into a broken one: {frame:02x?} -> {:02x?}",
                    prog.name(),
                    run.frame
                )),
                Some((src, sport, ..)) => {
                    if reply_of.is_some_and(|b| src == b && sport == 8080) {
                        violations.push(format!(
                            "#{i}: {}: reply left with the backend's source {src}",
                            prog.name()
                        ));
                    }
                }
            }
        }
    });
    println!(
        "{} ({}): {frames} frames, {translated} rewritten, {refused} refused by the runner, {} violations",
        prog.name(),
        fam.name,
        violations.len()
    );
    assert!(
        violations.is_empty(),
        "seed {seed}, {} ({}): {} violations, first: {:#?}",
        prog.name(),
        fam.name,
        violations.len(),
        &violations[..violations.len().min(5)]
    );
}

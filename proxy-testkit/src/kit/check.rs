//! The independent checker: RFC 1071 checksums computed here, from the bytes,
//! without any code of the datapath, and a parser that verifies every checksum
//! of an output frame of either family (IPv4 header, TCP/UDP over either
//! pseudo-header, ICMP, ICMPv6, SCTP's CRC32c) — and of the packet an ICMP or
//! ICMPv6 error quotes.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proxy_common::{IPPROTO_ICMP, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

/// ICMPv6's next-header value.
pub const IPPROTO_ICMPV6: u8 = 58;
/// IPv6's fragment header.
pub const NEXTHDR_FRAGMENT: u8 = 44;

/// Sum of the 16-bit big-endian words of `data` (an odd last byte padded).
pub fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

/// Folds a 32-bit sum into 16 bits and inverts it.
pub fn fold(mut s: u32) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// The Internet checksum of `data` (0 over data that carries a valid one):
/// IPv4 headers, ICMP messages.
pub fn ip_csum(data: &[u8]) -> u16 {
    fold(sum16(data))
}

/// The TCP/UDP checksum of `seg` over the IPv4 pseudo-header (0 over a
/// segment that carries a valid one).
pub fn l4_csum4(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, seg: &[u8]) -> u16 {
    let mut pseudo = Vec::with_capacity(12);
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&[0, proto]);
    pseudo.extend_from_slice(&(seg.len() as u16).to_be_bytes());
    fold(sum16(&pseudo) + sum16(seg))
}

/// The TCP/UDP/ICMPv6 checksum of `seg` over IPv6's pseudo-header (RFC
/// 8200 8.1; 0 over a segment that carries a valid one). A sender puts a
/// UDP checksum computed as 0 on the wire as 0xffff ([`super::frame::frame6`]
/// does).
pub fn l4_csum6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, seg: &[u8]) -> u16 {
    let mut pseudo = Vec::with_capacity(40);
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&(seg.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, proto]);
    fold(sum16(&pseudo) + sum16(seg))
}

/// The L4 checksum of `seg` over the pseudo-header of the addresses'
/// family (both of one family).
pub fn l4_csum(src: IpAddr, dst: IpAddr, proto: u8, seg: &[u8]) -> u16 {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => l4_csum4(s, d, proto, seg),
        (IpAddr::V6(s), IpAddr::V6(d)) => l4_csum6(s, d, proto, seg),
        _ => panic!("{src} and {dst} are of two families"),
    }
}

/// CRC32c (RFC 9260 appendix A) bit by bit from the polynomial: nothing
/// shared with the datapath's table-driven update.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for b in data {
        c ^= u32::from(*b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82f6_3b78
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// The CRC32c an SCTP packet must carry: over the packet with its checksum
/// field zeroed, stored least significant byte first.
pub fn sctp_checksum(packet: &[u8]) -> [u8; 4] {
    let mut p = packet.to_vec();
    p[8..12].fill(0);
    crc32c(&p).to_le_bytes()
}

/// A parsed view of an output frame, with every checksum verified.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    /// IPv4's TTL, IPv6's hop limit.
    pub ttl: u8,
    /// The L4 protocol (IPv6: the last next-header value).
    pub proto: u8,
    /// Where the L4 header starts in the frame.
    pub l4_off: usize,
    /// The IP payload after the headers (L4 header and data).
    pub l4: Vec<u8>,
}

impl Parsed {
    /// (source, source port, destination, destination port).
    pub fn tuple(&self) -> (IpAddr, u16, IpAddr, u16) {
        (self.src, self.sport, self.dst, self.dport)
    }

    /// The packet an ICMP or ICMPv6 error quotes (what follows its 8-byte
    /// header) as a frame of its own behind the error's Ethernet header,
    /// for [`parse_checked`].
    pub fn quoted_frame(&self) -> Vec<u8> {
        let ethertype: u16 = if self.src.is_ipv4() { 0x0800 } else { 0x86dd };
        let mut f = Vec::with_capacity(14 + self.l4.len());
        f.extend_from_slice(&self.dmac);
        f.extend_from_slice(&self.smac);
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(&self.l4[8..]);
        f
    }
}

/// (source, source port, destination, destination port) of a frame of
/// either family whose L4 header starts at `l4_off` (after IPv4 options or
/// IPv6 extension headers), every checksum verified ([`parse_checked`]).
pub fn tuple_checked(frame: &[u8], l4_off: usize) -> (IpAddr, u16, IpAddr, u16) {
    let p = parse_checked(frame);
    assert_eq!(p.l4_off, l4_off, "where the L4 header starts");
    p.tuple()
}

/// The tuple of the packet an ICMP or ICMPv6 error (`err`, of its family's
/// ICMP) quotes, the quote checked as a frame of its own by
/// [`parse_checked`]: its IPv4 header checksum, its length, and its L4
/// checksum — so the quote must hold the whole packet.
pub fn quoted_tuple(err: &Parsed) -> (IpAddr, u16, IpAddr, u16) {
    let icmp = if err.src.is_ipv4() {
        IPPROTO_ICMP
    } else {
        IPPROTO_ICMPV6
    };
    assert_eq!(err.proto, icmp, "an ICMP error of the frame's family");
    parse_checked(&err.quoted_frame()).tuple()
}

/// (source, source port, destination, destination port) of either family,
/// to compare with [`Parsed::tuple`].
pub fn tuple(
    src: impl Into<IpAddr>,
    sport: u16,
    dst: impl Into<IpAddr>,
    dport: u16,
) -> (IpAddr, u16, IpAddr, u16) {
    (src.into(), sport, dst.into(), dport)
}

/// Parses an Ethernet + IPv4 or IPv6 frame (by its EtherType), asserting
/// that its length matches the IP header's and that every checksum is
/// valid: see [`parse_checked4`] and [`parse_checked6`].
pub fn parse_checked(frame: &[u8]) -> Parsed {
    assert!(frame.len() >= 14, "frame too short: {} bytes", frame.len());
    match u16::from_be_bytes([frame[12], frame[13]]) {
        0x86dd => parse_checked6(frame),
        _ => parse_checked4(frame),
    }
}

/// Parses an Ethernet + IPv4 frame, asserting that its length matches the IPv4
/// total length and that the IPv4 header checksum and the TCP, UDP (unless 0,
/// "none") or ICMP checksum are valid.
pub fn parse_checked4(frame: &[u8]) -> Parsed {
    assert!(
        frame.len() >= 14 + 20,
        "frame too short for IPv4: {} bytes",
        frame.len()
    );
    assert_eq!(&frame[12..14], &[0x08, 0x00], "ethertype");
    let ihl = usize::from(frame[14] & 0x0f) * 4;
    assert!(
        ihl >= 20 && frame.len() >= 14 + ihl,
        "IPv4 header length {ihl}"
    );
    let ip = &frame[14..14 + ihl];
    assert_eq!(ip_csum(ip), 0, "IPv4 header checksum invalid: {ip:02x?}");
    let tot = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    assert_eq!(frame.len(), 14 + tot, "frame length vs IPv4 total length");
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let l4 = frame[14 + ihl..].to_vec();
    let proto = ip[9];
    match proto {
        IPPROTO_TCP => assert_eq!(l4_csum4(src, dst, proto, &l4), 0, "TCP checksum invalid"),
        IPPROTO_UDP if l4[6..8] != [0, 0] => {
            assert_eq!(l4_csum4(src, dst, proto, &l4), 0, "UDP checksum invalid")
        }
        IPPROTO_ICMP => assert_eq!(ip_csum(&l4), 0, "ICMP checksum invalid"),
        IPPROTO_SCTP => assert_eq!(l4[8..12], sctp_checksum(&l4), "SCTP CRC32c invalid"),
        _ => {}
    }
    Parsed {
        dmac: mac(frame, 0),
        smac: mac(frame, 6),
        src: src.into(),
        dst: dst.into(),
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dport: u16::from_be_bytes([l4[2], l4[3]]),
        ttl: ip[8],
        proto,
        l4_off: 14 + ihl,
        l4,
    }
}

fn mac(frame: &[u8], at: usize) -> [u8; 6] {
    frame[at..at + 6].try_into().unwrap()
}

/// Parses an Ethernet + IPv6 frame: its payload length matches the frame,
/// extension headers (hop-by-hop, routing, destination options, fragment)
/// are walked to the L4 header, and the TCP, UDP (unless 0), ICMPv6 or
/// SCTP checksum is valid — except in a fragment, whose L4 checksum is the
/// whole datagram's (and a later fragment has no L4 header: ports 0).
pub fn parse_checked6(frame: &[u8]) -> Parsed {
    assert!(
        frame.len() >= 14 + 40,
        "frame too short for IPv6: {} bytes",
        frame.len()
    );
    assert_eq!(&frame[12..14], &[0x86, 0xdd], "ethertype");
    assert_eq!(frame[14] >> 4, 6, "IP version");
    let payload = u16::from_be_bytes([frame[18], frame[19]]) as usize;
    assert_eq!(
        14 + 40 + payload,
        frame.len(),
        "frame length vs payload length"
    );
    let addr = |at: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&frame[at..at + 16]).unwrap());
    let (src, dst) = (addr(22), addr(38));
    let (mut nh, mut off, mut fragment, mut later) = (frame[20], 14 + 40, false, false);
    while matches!(nh, 0 | 43 | 60 | NEXTHDR_FRAGMENT) {
        assert!(off + 8 <= frame.len(), "extension header {nh} truncated");
        let len = if nh == NEXTHDR_FRAGMENT {
            fragment = true;
            later = u16::from_be_bytes([frame[off + 2], frame[off + 3]]) >> 3 != 0;
            8
        } else {
            (usize::from(frame[off + 1]) + 1) * 8
        };
        nh = frame[off];
        off += len;
    }
    let l4 = frame[off..].to_vec();
    if !fragment {
        match nh {
            IPPROTO_TCP | IPPROTO_ICMPV6 => {
                assert_eq!(l4_csum6(src, dst, nh, &l4), 0, "L4 checksum invalid")
            }
            IPPROTO_UDP if l4[6..8] != [0, 0] => {
                assert_eq!(l4_csum6(src, dst, nh, &l4), 0, "UDP checksum invalid")
            }
            IPPROTO_SCTP => assert_eq!(l4[8..12], sctp_checksum(&l4), "SCTP CRC32c invalid"),
            _ => {}
        }
    }
    let (sport, dport) = if later || l4.len() < 4 {
        (0, 0)
    } else {
        (
            u16::from_be_bytes([l4[0], l4[1]]),
            u16::from_be_bytes([l4[2], l4[3]]),
        )
    };
    Parsed {
        dmac: mac(frame, 0),
        smac: mac(frame, 6),
        src: src.into(),
        dst: dst.into(),
        sport,
        dport,
        ttl: frame[21],
        proto: nh,
        l4_off: off,
        l4,
    }
}

/// Source and destination of an IPv4 frame, header checksum verified; for
/// fragments, whose L4 checksum only holds over the reassembled datagram.
pub fn ipv4_addrs_checked(frame: &[u8]) -> (Ipv4Addr, Ipv4Addr) {
    assert_eq!(ip_csum(&frame[14..34]), 0, "IPv4 header checksum invalid");
    (
        Ipv4Addr::new(frame[26], frame[27], frame[28], frame[29]),
        Ipv4Addr::new(frame[30], frame[31], frame[32], frame[33]),
    )
}

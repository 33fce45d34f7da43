//! Frame builders: Ethernet + IPv4 or IPv6 + TCP/UDP/SCTP with valid
//! checksums, ICMP and ICMPv6 errors quoting a packet, IPv4 fragments and
//! options, IPv6 extension headers. The family-neutral builders (`tcp`,
//! `udp`, `sctp`, `icmp_error`) take either family's addresses, so one
//! table of cases serves both; names that carry a family (`tcp4`, `ipv4_*`,
//! `frame6`, `ipv6_*`) build what only that family has. The L4 segment
//! builders (`tcp_segment`, `udp_segment`, `sctp_packet`) are
//! family-neutral.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proxy_common::{IPPROTO_ICMP, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use super::check::{crc32c, ip_csum, l4_csum4, l4_csum6, IPPROTO_ICMPV6, NEXTHDR_FRAGMENT};

/// MACs of every built frame: from the "client" (`SRC_MAC`) to the "node".
pub const SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_IPV6: u16 = 0x86dd;
/// Ethernet + IPv4 header without options.
pub const L4_OFF4: usize = 14 + 20;
/// Ethernet + IPv6 header without extension headers.
pub const L4_OFF6: usize = 14 + 40;

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const PSH: u8 = 0x08;
pub const ACK: u8 = 0x10;

/// A TCP header (20 bytes: sequence 1000, window 64240, given flags) and
/// payload, checksum left 0.
pub fn tcp_segment(sport: u16, dport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut seg = vec![0u8; 20];
    seg[0..2].copy_from_slice(&sport.to_be_bytes());
    seg[2..4].copy_from_slice(&dport.to_be_bytes());
    seg[4..8].copy_from_slice(&1000u32.to_be_bytes());
    seg[12] = 5 << 4;
    seg[13] = flags;
    seg[14..16].copy_from_slice(&64240u16.to_be_bytes());
    seg.extend_from_slice(payload);
    seg
}

/// A UDP header and payload, checksum left 0 ("none").
pub fn udp_segment(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let mut seg = vec![0u8; 8];
    seg[0..2].copy_from_slice(&sport.to_be_bytes());
    seg[2..4].copy_from_slice(&dport.to_be_bytes());
    seg[4..6].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    seg.extend_from_slice(payload);
    seg
}

/// An SCTP packet: common header (verification tag 0x01020304) and one
/// chunk of type `chunk` (flags 0) whose value is `value` (padded to 4
/// bytes), with its CRC32c (no pseudo-header: the addresses do not matter).
pub fn sctp_packet(sport: u16, dport: u16, chunk: u8, value: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 12];
    p[0..2].copy_from_slice(&sport.to_be_bytes());
    p[2..4].copy_from_slice(&dport.to_be_bytes());
    p[4..8].copy_from_slice(&0x0102_0304u32.to_be_bytes());
    p.extend_from_slice(&[chunk, 0]);
    p.extend_from_slice(&((4 + value.len()) as u16).to_be_bytes());
    p.extend_from_slice(value);
    while !p.len().is_multiple_of(4) {
        p.push(0);
    }
    let c = super::check::sctp_checksum(&p);
    p[8..12].copy_from_slice(&c);
    p
}

/// Ethernet + IPv4 + an SCTP packet of one chunk ([`sctp_packet`]).
pub fn sctp4(
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    chunk: u8,
    value: &[u8],
) -> Vec<u8> {
    ipv4(
        src,
        dst,
        IPPROTO_SCTP,
        &sctp_packet(sport, dport, chunk, value),
    )
}

/// Fills in the L4 checksum of `seg` (TCP or UDP) over the IPv4 pseudo-header.
pub fn seal4(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, mut seg: Vec<u8>) -> Vec<u8> {
    let at = if proto == IPPROTO_TCP { 16 } else { 6 };
    seg[at..at + 2].copy_from_slice(&[0, 0]);
    let c = l4_csum4(src, dst, proto, &seg);
    seg[at..at + 2].copy_from_slice(&c.to_be_bytes());
    seg
}

/// Ethernet + IPv4 (20 bytes, TTL 64, DF) + TCP (20 bytes, given flags) +
/// payload, with valid checksums.
pub fn tcp4(
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let seg = seal4(
        src,
        dst,
        IPPROTO_TCP,
        tcp_segment(sport, dport, flags, payload),
    );
    ipv4(src, dst, IPPROTO_TCP, &seg)
}

/// Ethernet + IPv4 + UDP + payload, with valid checksums.
pub fn udp4(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, payload: &[u8]) -> Vec<u8> {
    let seg = seal4(src, dst, IPPROTO_UDP, udp_segment(sport, dport, payload));
    ipv4(src, dst, IPPROTO_UDP, &seg)
}

/// As [`udp4`], with UDP checksum 0 ("no checksum").
pub fn udp4_no_csum(
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    payload: &[u8],
) -> Vec<u8> {
    ipv4(src, dst, IPPROTO_UDP, &udp_segment(sport, dport, payload))
}

/// Ethernet + a 20-byte IPv4 header (identification 0x1234, DF, TTL 64, valid
/// checksum) + `payload` as it is.
pub fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, payload: &[u8]) -> Vec<u8> {
    ipv4_with_options(src, dst, proto, &[], payload)
}

/// As [`ipv4`], with IP `options` (padded with zeros, end of options, to a
/// multiple of 4 bytes) after the fixed header.
pub fn ipv4_with_options(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    options: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    let mut opts = options.to_vec();
    opts.resize(options.len().div_ceil(4) * 4, 0);
    let hlen = 20 + opts.len();
    let mut ip = vec![0u8; 20];
    ip[0] = 0x40 | (hlen / 4) as u8;
    ip[2..4].copy_from_slice(&((hlen + payload.len()) as u16).to_be_bytes());
    ip[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
    ip[6] = 0x40; // DF
    ip[8] = 64;
    ip[9] = proto;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    ip.extend_from_slice(&opts);
    let c = ip_csum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let mut p = ethernet(ETH_P_IP);
    p.extend_from_slice(&ip);
    p.extend_from_slice(payload);
    p
}

/// An IPv4 fragment (no options) carrying `data`, the bytes at `offset` (a
/// multiple of 8) of the original datagram's IP payload; `more`: more
/// fragments follow. DF is clear, identification as [`ipv4`].
pub fn ipv4_fragment(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    offset: usize,
    more: bool,
    data: &[u8],
) -> Vec<u8> {
    assert_eq!(offset % 8, 0, "fragment offsets are in units of 8 bytes");
    let mut p = ipv4(src, dst, proto, data);
    let fo = ((offset / 8) as u16) | if more { 0x2000 } else { 0 };
    p[20..22].copy_from_slice(&fo.to_be_bytes());
    reseal_ipv4_header(&mut p);
    p
}

/// Cuts a built IPv4 frame (no options) into two fragments, the first carrying
/// `at` bytes (a multiple of 8) of its IP payload.
pub fn ipv4_split(frame: &[u8], at: usize) -> (Vec<u8>, Vec<u8>) {
    let src = Ipv4Addr::new(frame[26], frame[27], frame[28], frame[29]);
    let dst = Ipv4Addr::new(frame[30], frame[31], frame[32], frame[33]);
    let proto = frame[23];
    let payload = &frame[L4_OFF4..];
    (
        ipv4_fragment(src, dst, proto, 0, true, &payload[..at]),
        ipv4_fragment(src, dst, proto, at, false, &payload[at..]),
    )
}

/// Recomputes the IPv4 header checksum of a frame after an edit of its header.
pub fn reseal_ipv4_header(frame: &mut [u8]) {
    let ihl = usize::from(frame[14] & 0x0f) * 4;
    frame[24..26].copy_from_slice(&[0, 0]);
    let c = ip_csum(&frame[14..14 + ihl]);
    frame[24..26].copy_from_slice(&c.to_be_bytes());
}

/// `frame` with another EtherType (e.g. [`ETH_P_ARP`]), bytes otherwise kept.
pub fn with_ethertype(frame: &[u8], ethertype: u16) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[12..14].copy_from_slice(&ethertype.to_be_bytes());
    f
}

/// `frame` with one byte replaced (a malformed header), checksums kept as they were.
pub fn with_byte(frame: &[u8], at: usize, value: u8) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[at] = value;
    f
}

/// Ethernet + IPv6 (`ext`: extension headers as (type, bytes), their chain
/// ending in `proto`; hop limit 64) + `seg`, with its L4 checksum (SCTP:
/// CRC32c) computed — unless it is a fragment (a fragment header in
/// `ext`): its checksum is the whole datagram's, left as `seg` has it.
pub fn frame6(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    proto: u8,
    ext: &[(u8, Vec<u8>)],
    mut seg: Vec<u8>,
) -> Vec<u8> {
    let fragment = ext.iter().any(|(t, _)| *t == NEXTHDR_FRAGMENT);
    match if fragment { 0 } else { proto } {
        IPPROTO_TCP => {
            let c = l4_csum6(src, dst, proto, &seg);
            seg[16..18].copy_from_slice(&c.to_be_bytes());
        }
        IPPROTO_UDP => {
            let c = match l4_csum6(src, dst, proto, &seg) {
                0 => 0xffff,
                c => c,
            };
            seg[6..8].copy_from_slice(&c.to_be_bytes());
        }
        IPPROTO_SCTP => {
            seg[8..12].fill(0);
            let c = crc32c(&seg);
            seg[8..12].copy_from_slice(&c.to_le_bytes());
        }
        _ => {}
    }
    let mut f = ethernet(ETH_P_IPV6);
    let ext_len: usize = ext.iter().map(|(_, h)| h.len()).sum();
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&((ext_len + seg.len()) as u16).to_be_bytes());
    f.push(ext.first().map_or(proto, |(t, _)| *t));
    f.push(64);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    for (i, (_, h)) in ext.iter().enumerate() {
        let mut h = h.clone();
        h[0] = ext.get(i + 1).map_or(proto, |(t, _)| *t);
        f.extend_from_slice(&h);
    }
    f.extend_from_slice(&seg);
    f
}

/// An IPv6 options header (hop-by-hop, next header 0, or destination
/// options, 60) of `(len8 + 1) * 8` bytes, its options one PadN filling it;
/// the next-header byte is left for [`frame6`] to chain.
pub fn ipv6_options_header(len8: u8) -> Vec<u8> {
    let mut h = vec![0u8; (usize::from(len8) + 1) * 8];
    h[1] = len8;
    h[2] = 1; // PadN
    h[3] = (h.len() - 4) as u8;
    h
}

/// An 8-byte IPv6 routing header (next header 43): type 0, no segments
/// left; the next-header byte is left for [`frame6`] to chain.
pub fn ipv6_routing_header() -> Vec<u8> {
    vec![0; 8]
}

/// An IPv6 fragment header ([`NEXTHDR_FRAGMENT`]): the fragment's offset in
/// 8-byte units (13 bits, then the more-fragments bit) and identification
/// `id`; the next-header byte is left for [`frame6`] to chain.
pub fn ipv6_fragment_header(offset8: u16, more: bool, id: u32) -> Vec<u8> {
    let field = (offset8 << 3) | u16::from(more);
    let mut h = vec![0, 0];
    h.extend_from_slice(&field.to_be_bytes());
    h.extend_from_slice(&id.to_be_bytes());
    h
}

/// An ICMP error (ICMPv6 for IPv6 addresses) from `src` to `dst` of
/// `(type, code)`, about `about`: an Ethernet frame of the same family,
/// whose IP packet, at most `keep` bytes of it, is quoted. `mtu` fills the
/// low half of the 4 bytes after the checksum (the next-hop MTU of
/// IPv4's fragmentation needed, the MTU of ICMPv6's packet too big; unused
/// by the other errors). The checksum is valid: ICMP's over the message,
/// ICMPv6's over the IPv6 pseudo-header too.
pub fn icmp_error(
    src: impl Into<IpAddr>,
    dst: impl Into<IpAddr>,
    (ty, code): (u8, u8),
    mtu: u16,
    about: &[u8],
    keep: usize,
) -> Vec<u8> {
    let packet = &about[14..];
    let mut msg = vec![ty, code, 0, 0, 0, 0];
    msg.extend_from_slice(&mtu.to_be_bytes());
    msg.extend_from_slice(&packet[..packet.len().min(keep)]);
    match (src.into(), dst.into()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let c = ip_csum(&msg);
            msg[2..4].copy_from_slice(&c.to_be_bytes());
            ipv4(s, d, IPPROTO_ICMP, &msg)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let c = l4_csum6(s, d, IPPROTO_ICMPV6, &msg);
            msg[2..4].copy_from_slice(&c.to_be_bytes());
            frame6(s, d, IPPROTO_ICMPV6, &[], msg)
        }
        (s, d) => panic!("{s} and {d} are of two families"),
    }
}

/// Ethernet + IP of `src`'s family (IPv4: as [`ipv4`]; IPv6: as
/// [`frame6`] without extension headers) + `seg`, its TCP/UDP checksum
/// filled in (SCTP's CRC32c as `seg` has it; IPv6 recomputes it).
fn ip(src: IpAddr, dst: IpAddr, proto: u8, seg: Vec<u8>) -> Vec<u8> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) if proto == IPPROTO_SCTP => ipv4(s, d, proto, &seg),
        (IpAddr::V4(s), IpAddr::V4(d)) => ipv4(s, d, proto, &seal4(s, d, proto, seg)),
        (IpAddr::V6(s), IpAddr::V6(d)) => frame6(s, d, proto, &[], seg),
        _ => panic!("{src} and {dst} are of two families"),
    }
}

/// As [`tcp4`], in the family of the addresses given.
pub fn tcp(
    src: impl Into<IpAddr>,
    sport: u16,
    dst: impl Into<IpAddr>,
    dport: u16,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let seg = tcp_segment(sport, dport, flags, payload);
    ip(src.into(), dst.into(), IPPROTO_TCP, seg)
}

/// As [`udp4`], in the family of the addresses given.
pub fn udp(
    src: impl Into<IpAddr>,
    sport: u16,
    dst: impl Into<IpAddr>,
    dport: u16,
    payload: &[u8],
) -> Vec<u8> {
    let seg = udp_segment(sport, dport, payload);
    ip(src.into(), dst.into(), IPPROTO_UDP, seg)
}

/// As [`sctp4`], in the family of the addresses given.
pub fn sctp(
    src: impl Into<IpAddr>,
    sport: u16,
    dst: impl Into<IpAddr>,
    dport: u16,
    chunk: u8,
    value: &[u8],
) -> Vec<u8> {
    let seg = sctp_packet(sport, dport, chunk, value);
    ip(src.into(), dst.into(), IPPROTO_SCTP, seg)
}

/// Where the L4 header of a frame built without IP options or extension
/// headers starts, by its EtherType.
pub fn l4_off(frame: &[u8]) -> usize {
    if frame[12..14] == ETH_P_IPV6.to_be_bytes() {
        L4_OFF6
    } else {
        L4_OFF4
    }
}

fn ethernet(ethertype: u16) -> Vec<u8> {
    let mut p = Vec::with_capacity(1514);
    p.extend_from_slice(&DST_MAC);
    p.extend_from_slice(&SRC_MAC);
    p.extend_from_slice(&ethertype.to_be_bytes());
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kit::check::{parse_checked, quoted_tuple, tuple, tuple_checked};

    /// An error of either family parses with every checksum valid, and its
    /// quote is the packet it is about.
    #[test]
    fn icmp_errors_of_both_families_quote_their_packet() {
        let v4 = (Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(192, 0, 2, 2));
        let v6 = (
            Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1),
            Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2),
        );
        for (a, b, ty) in [
            (v4.0.into(), v4.1.into(), (3, 4)),
            (IpAddr::V6(v6.0), IpAddr::V6(v6.1), (2, 0)),
        ] {
            let about = tcp(a, 40000, b, 80, SYN, b"hello");
            let err = parse_checked(&icmp_error(b, a, ty, 1280, &about, 1500));
            assert_eq!((err.src, err.dst), (b, a));
            assert_eq!(&err.l4[..2], &[ty.0, ty.1]);
            assert_eq!(&err.l4[6..8], &1280u16.to_be_bytes());
            assert_eq!(err.quoted_frame()[14..], about[14..]);
            assert_eq!(quoted_tuple(&err), tuple(a, 40000, b, 80));
        }
    }

    /// Extension headers chain in the order given and are walked by the
    /// checker; a fragment header's fields sit where RFC 8200 puts them.
    #[test]
    fn ipv6_extension_headers_are_chained() {
        let (a, b) = (
            Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1),
            Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2),
        );
        let ext = [(0, ipv6_options_header(0)), (60, ipv6_options_header(1))];
        let f = frame6(a, b, IPPROTO_TCP, &ext, tcp_segment(1, 2, SYN, b""));
        assert_eq!(tuple_checked(&f, L4_OFF6 + 24), tuple(a, 1, b, 2));
        assert_eq!(
            ipv6_fragment_header(4, false, 7),
            [0, 0, 0, 0x20, 0, 0, 0, 7]
        );
        assert_eq!(ipv6_fragment_header(0, true, 7), [0, 0, 0, 1, 0, 0, 0, 7]);
    }
}

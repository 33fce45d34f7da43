//! Internet checksum arithmetic (RFC 1071, RFC 1624) on 16-bit words as they
//! are in memory, so that the datapath can use it on packet bytes without
//! byte swapping. The agent's tests and the datapath share it; the packet
//! tests check its results with an independent implementation.

/// One's-complement sum of `sum`'s carries folded into 16 bits.
#[inline(always)]
pub const fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// The checksum of the first `len` bytes of `buf` (an even count; at most 36
/// words, for which two folds bring any sum below 2^16), as stored in a header.
#[inline(always)]
pub fn checksum(buf: &[u8], len: usize) -> u16 {
    let mut sum: u32 = 0;
    let mut i = 0;
    while i + 1 < len && i + 1 < buf.len() {
        sum += u16::from_ne_bytes([buf[i], buf[i + 1]]) as u32;
        i += 2;
    }
    !fold(sum)
}

/// RFC 1624 incremental update of checksum `check` when 16-bit words `old`
/// become `new` (unused words equal in both).
#[inline(always)]
pub fn update(check: u16, old: &[u16; 6], new: &[u16; 6]) -> u16 {
    let mut sum: u32 = (!check) as u32;
    let mut i = 0;
    while i < 6 {
        sum += (!old[i]) as u32;
        sum += new[i] as u32;
        i += 1;
    }
    !fold(sum)
}

/// The two 16-bit words of an IPv4 address in network byte order, as they are
/// in memory.
#[inline(always)]
pub const fn words(addr_be: u32) -> [u16; 2] {
    let b = addr_be.to_ne_bytes();
    [
        u16::from_ne_bytes([b[0], b[1]]),
        u16::from_ne_bytes([b[2], b[3]]),
    ]
}

/// What a checksum's one's-complement sum gains when 16-bit field `old`
/// becomes `new` (RFC 1624), in memory order.
#[inline(always)]
pub const fn diff16(old: u16, new: u16) -> u32 {
    (!old) as u32 + new as u32
}

/// As [`diff16`] for a 32-bit field (an IPv4 address), as two words.
#[inline(always)]
pub const fn diff32(old: u32, new: u32) -> u32 {
    let (o, n) = (words(old), words(new));
    (!o[0]) as u32 + (!o[1]) as u32 + n[0] as u32 + n[1] as u32
}

/// As [`diff16`] for an IPv6 address (four words of its bytes).
#[inline(always)]
pub const fn diff128(old: &[u32; 4], new: &[u32; 4]) -> u32 {
    diff32(old[0], new[0])
        + diff32(old[1], new[1])
        + diff32(old[2], new[2])
        + diff32(old[3], new[3])
}

/// Checksum `check` updated by the sum of field differences `diff`.
#[inline(always)]
pub const fn apply(check: u16, diff: u32) -> u16 {
    !fold((!check) as u32 + fold(diff) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 1071 the slow way: big-endian words, wide sum, folded at the end.
    fn reference(bytes: &[u8]) -> u16 {
        let mut s: u64 = 0;
        for c in bytes.chunks(2) {
            s += u64::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
        while s > 0xffff {
            s = (s & 0xffff) + (s >> 16);
        }
        !(s as u16)
    }

    /// An IPv4 header (RFC 1071's example values aside, a real one).
    const IP: [u8; 20] = [
        0x45, 0x00, 0x00, 0x3c, 0x1c, 0x46, 0x40, 0x00, 0x40, 0x06, 0x00, 0x00, 0xc6, 0x12, 0x01,
        0x02, 0xc6, 0x13, 0x00, 0x0a,
    ];

    #[test]
    fn checksum_matches_the_reference_and_verifies() {
        let c = checksum(&IP, 20);
        assert_eq!(u16::from_be(c), reference(&IP));
        let mut h = IP;
        h[10..12].copy_from_slice(&c.to_ne_bytes());
        // A header with its checksum in place sums to zero.
        assert_eq!(checksum(&h, 20), 0);
        assert_eq!(reference(&h), 0);
    }

    #[test]
    fn checksum_of_a_maximal_buffer_does_not_overflow() {
        let buf = [0xffu8; 72];
        assert_eq!(u16::from_be(checksum(&buf, 72)), reference(&buf));
    }

    #[test]
    fn incremental_update_equals_a_full_recompute() {
        let mut h = IP;
        let c = checksum(&h, 20);
        h[10..12].copy_from_slice(&c.to_ne_bytes());
        // Rewrite both addresses (DNAT and SNAT at once).
        let (os, od) = (
            words(u32::from_ne_bytes([h[12], h[13], h[14], h[15]])),
            words(u32::from_ne_bytes([h[16], h[17], h[18], h[19]])),
        );
        let (ns, nd) = (
            words(u32::from_ne_bytes([198, 18, 0, 254])),
            words(u32::from_ne_bytes([198, 18, 7, 99])),
        );
        let updated = update(
            c,
            &[os[0], os[1], od[0], od[1], 0, 0],
            &[ns[0], ns[1], nd[0], nd[1], 0, 0],
        );
        h[12..16].copy_from_slice(&[198, 18, 0, 254]);
        h[16..20].copy_from_slice(&[198, 18, 7, 99]);
        h[10..12].copy_from_slice(&[0, 0]);
        assert_eq!(u16::from_be(updated), reference(&h));
    }

    #[test]
    fn words_keep_memory_order() {
        let w = words(u32::from_ne_bytes([0x12, 0x34, 0x56, 0x78]));
        assert_eq!(w[0].to_ne_bytes(), [0x12, 0x34]);
        assert_eq!(w[1].to_ne_bytes(), [0x56, 0x78]);
    }
}

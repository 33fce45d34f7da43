//! SCTP's checksum, CRC32c (Castagnoli, RFC 9260 appendix A), and its
//! update when a port is rewritten, without reading the packet's payload.
//!
//! SCTP's checksum covers the whole SCTP packet (common header with the
//! checksum field taken as zero, then every chunk) and no IP pseudo-header:
//! an address-only rewrite leaves it valid; a port rewrite changes it. A CRC
//! is linear over GF(2): for messages of one length,
//! `crc(M ^ D) = crc(M) ^ raw(D)`, where `raw` is the CRC register run from 0
//! with no final inversion. With `D` non-zero only in the 4 port bytes at the
//! start of the packet, `raw(D)` is the register after those 4 bytes, then
//! carried through the `len - 4` zero bytes that follow: a multiplication by
//! `x^(8·(len - 4))` modulo the polynomial, taken from a table of powers
//! (`len < 65,536`). One multiplication of 32 steps: bounded work per packet
//! whatever its length.
//!
//! Polynomial arithmetic follows zlib's `crc32_combine` (reflected: bit 31
//! is the coefficient of `x^0`). The packet stores the checksum as the
//! little-endian bytes of the CRC (Linux: `cpu_to_le32(~crc32c(...))`).

/// CRC32c's polynomial, reflected.
const POLY: u32 = 0x82f6_3b78;

/// `x^0` in the reflected representation.
const ONE: u32 = 1 << 31;

const fn byte_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

/// The byte-at-a-time table of CRC32c.
static TABLE: [u32; 256] = byte_table();

/// `a · b` modulo the polynomial (zlib's `multmodp`), in 32 branch-free
/// steps.
#[inline(always)]
pub const fn mul(a: u32, mut b: u32) -> u32 {
    let mut p = 0u32;
    let mut i = 0;
    while i < 32 {
        // Bit 31 - i of `a` is the coefficient of x^i.
        p ^= b & 0u32.wrapping_sub((a >> (31 - i)) & 1);
        b = (b >> 1) ^ (POLY & 0u32.wrapping_sub(b & 1));
        i += 1;
    }
    p
}

/// `x^(8·n)` for every `n < 65,536`: the register 1 (`x^0`) carried through
/// `n` zero bytes, one CRC step per byte. 256 KiB, so that a shift costs one
/// multiplication: the verifier walks that straight-line code once per
/// state reaching a rewrite (two multiplications, from two 256-entry
/// tables, cost `pod_ingress` 160k more instructions verified on 6.18: 479k
/// against 320k).
static ZEROS: [u32; 65_536] = {
    let table = byte_table();
    let mut t = [0u32; 65_536];
    let mut p = ONE;
    let mut i = 0;
    while i < 65_536 {
        t[i] = p;
        p = table[(p & 0xff) as usize] ^ (p >> 8);
        i += 1;
    }
    t
};

/// The CRC register `reg` carried through `n` zero bytes.
#[inline(always)]
pub fn shift(reg: u32, n: u16) -> u32 {
    mul(ZEROS[n as usize], reg)
}

/// The register run from 0 over `bytes` (no initial or final inversion):
/// from 0, feeding 4 bytes is the same as starting from those bytes (little
/// endian, as the reflected register takes them) and feeding 4 zero bytes.
/// Written so, each table index is a mask of the register, the last
/// operation before the lookup: 5.10's verifier refuses an index it cannot
/// bound, as it could not the XOR LLVM made of `(reg ^ byte) & 0xff`.
#[inline(always)]
fn raw(bytes: [u8; 4]) -> u32 {
    let mut reg = u32::from_le_bytes(bytes);
    let mut i = 0;
    while i < 4 {
        reg = TABLE[(reg & 0xff) as usize] ^ (reg >> 8);
        i += 1;
    }
    reg
}

/// The checksum field (its 4 bytes as stored, read as a native integer) of an
/// SCTP packet of `len` bytes (common header and chunks) after its ports —
/// its first 4 bytes, as stored, read as a native integer — change from
/// `old_ports` to `new_ports`. `len` shorter than the common header (12
/// bytes) leaves it as it is.
///
/// A field of 0 is left as it is too: it is a CRC yet to be computed. A
/// Linux sender whose route's device offloads the CRC (veth does) hands the
/// packet on with the field zeroed (`CHECKSUM_PARTIAL`); a device that
/// cannot compute it further on (most NICs, a tunnel) has the kernel do it
/// in software (`skb_crc32c_csum_help`), over the bytes as they are, field
/// included: a delta written into it would be summed into a wrong CRC. The
/// price: a packet whose real CRC is 0 (one in 2^32) keeps its old one.
#[inline(always)]
pub fn update_ports(stored: u32, len: u16, old_ports: u32, new_ports: u32) -> u32 {
    if len < 12 || old_ports == new_ports || stored == 0 {
        return stored;
    }
    let delta = (old_ports ^ new_ports).to_ne_bytes();
    let d = shift(raw(delta), len - 4);
    // Stored little-endian: the CRC's byte order, whatever the CPU's.
    let crc = u32::from_le_bytes(stored.to_ne_bytes()) ^ d;
    u32::from_ne_bytes(crc.to_le_bytes())
}

/// CRC32c of `bytes` (initial and final inversion), byte at a time: for the
/// agent's tests and tools, never the datapath (its loop follows the
/// packet's length).
pub fn checksum(bytes: &[u8]) -> u32 {
    let mut reg = !0u32;
    for b in bytes {
        reg = TABLE[((reg ^ *b as u32) & 0xff) as usize] ^ (reg >> 8);
    }
    !reg
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::{vec, vec::Vec};

    /// CRC32c bit by bit, from the polynomial alone (no table, no shortcut).
    fn reference(bytes: &[u8]) -> u32 {
        let mut c = !0u32;
        for b in bytes {
            c ^= *b as u32;
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

    /// The packet with its checksum field zeroed, then filled as SCTP does.
    fn seal(pkt: &mut [u8]) {
        pkt[8..12].fill(0);
        let c = reference(pkt);
        pkt[8..12].copy_from_slice(&c.to_le_bytes());
    }

    fn field(pkt: &[u8], off: usize) -> u32 {
        u32::from_ne_bytes(pkt[off..off + 4].try_into().unwrap())
    }

    #[test]
    fn known_answers() {
        // RFC 3720 B.4 / the usual check value of CRC-32C.
        assert_eq!(checksum(b"123456789"), 0xe306_9283);
        assert_eq!(reference(b"123456789"), 0xe306_9283);
        assert_eq!(checksum(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(checksum(&[0xffu8; 32]), 0x62a8_ab43);
    }

    #[test]
    fn shift_is_appending_zero_bytes() {
        let mut x = 0x1234_5678u32;
        for n in [0u16, 1, 7, 255, 256, 257, 1500, 9000, 65_535] {
            let mut reg = x;
            for _ in 0..n {
                reg = TABLE[(reg & 0xff) as usize] ^ (reg >> 8);
            }
            assert_eq!(shift(x, n), reg, "n = {n}");
            x = x.rotate_left(7) ^ 0x9e37_79b9;
        }
    }

    #[test]
    fn a_port_rewrite_keeps_the_checksum_valid() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for len in [12usize, 13, 16, 28, 100, 1452, 1500, 9000, 65_000] {
            let mut pkt: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            seal(&mut pkt);
            let old = field(&pkt, 0);
            let new = next() as u32;
            let updated = update_ports(field(&pkt, 8), len as u16, old, new);
            pkt[0..4].copy_from_slice(&new.to_ne_bytes());
            let stored = field(&pkt, 8);
            seal(&mut pkt);
            assert_eq!(updated, field(&pkt, 8), "len {len}");
            assert_ne!(stored, updated, "len {len}: the rewrite changed nothing");
        }
    }

    #[test]
    fn one_port_at_a_time_composes() {
        let mut pkt = vec![0xabu8; 64];
        seal(&mut pkt);
        let ports = field(&pkt, 0);
        let mut dport_changed = pkt.clone();
        dport_changed[2..4].copy_from_slice(&5061u16.to_be_bytes());
        let mid = field(&dport_changed, 0);
        let c1 = update_ports(field(&pkt, 8), 64, ports, mid);
        let mut both = dport_changed.clone();
        both[0..2].copy_from_slice(&40_000u16.to_be_bytes());
        let c2 = update_ports(c1, 64, mid, field(&both, 0));
        seal(&mut both);
        assert_eq!(c2, field(&both, 8));
    }

    #[test]
    fn unchanged_ports_a_runt_or_a_crc_yet_to_be_computed_leave_the_field() {
        assert_eq!(update_ports(0xdead_beef, 100, 7, 7), 0xdead_beef);
        assert_eq!(update_ports(0xdead_beef, 11, 7, 8), 0xdead_beef);
        assert_eq!(update_ports(0, 100, 7, 8), 0);
    }

    /// Every length from the common header's to 300 bytes, and the longest.
    #[test]
    fn every_short_length_and_the_longest() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for len in (12usize..=300).chain([65_535]) {
            let mut pkt: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            seal(&mut pkt);
            let new = next() as u32;
            let updated = update_ports(field(&pkt, 8), len as u16, field(&pkt, 0), new);
            pkt[0..4].copy_from_slice(&new.to_ne_bytes());
            seal(&mut pkt);
            assert_eq!(updated, field(&pkt, 8), "len {len}");
        }
    }
}

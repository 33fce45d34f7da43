//! Load-balancing algorithms: how a new flow's backend is chosen, written once
//! for the kernel programs and the agent.
//!
//! A frontend's algorithm is two bits of its slot 0 flags
//! ([`crate::svc_flags::ALG_MASK`]); entries written before algorithms existed
//! read as [`alg::RANDOM`]. The hashes here are fixed: two agents of any
//! version compute the same values, so every node picks the same backend for
//! the same flow (Maglev) or client (source hash). They are pinned by tests.

use core::mem::{offset_of, size_of};

/// The algorithms ([`crate::svc_flags::ALG_MASK`] values, shifted down).
pub mod alg {
    /// A random slot per new flow (kube-proxy's iptables mode).
    pub const RANDOM: u16 = 0;
    /// The next slot, per CPU (IPVS `rr`; no cursor shared between CPUs).
    pub const ROUND_ROBIN: u16 = 1;
    /// A slot chosen by a hash of the client address (IPVS `sh`).
    pub const SOURCE_HASH: u16 = 2;
    /// Maglev consistent hashing of the 5-tuple over a lookup table.
    pub const MAGLEV: u16 = 3;
}

/// Entries of one Maglev table chunk ([`MaglevChunk`]).
pub const MAGLEV_CHUNK: usize = 256;
/// Default Maglev table size (a prime; Cilium's default too).
pub const MAGLEV_DEFAULT_SIZE: u16 = 16_381;
/// Largest Maglev table size (the largest prime below 2^16: the size is kept
/// in slot 0's `u16`).
pub const MAGLEV_MAX_SIZE: u16 = 65_521;

/// Chunks of a table of `size` entries.
pub const fn maglev_chunks(size: u16) -> u32 {
    (size as u32).div_ceil(MAGLEV_CHUNK as u32)
}

/// Key of the Maglev map: a chunk of one generation of a frontend's table.
/// The frontend's slot 0 says which generation packets read
/// ([`crate::svc_flags::MAGLEV_GEN`]); the other one is where the agent writes
/// a rebuilt table before switching to it.
///
/// | offset | field | meaning |
/// |---|---|---|
/// | 0 | `rev_nat_id` | the frontend (host order) |
/// | 4 | `generation` | 0 or 1 |
/// | 6 | `chunk` | entries `chunk * 256 ..` (host order) |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct MaglevKey {
    pub rev_nat_id: crate::RevNatId,
    pub generation: u8,
    pub _pad: u8,
    pub chunk: u16,
}
const _: () = assert!(size_of::<MaglevKey>() == 8);
const _: () = assert!(offset_of!(MaglevKey, generation) == 4);
const _: () = assert!(offset_of!(MaglevKey, chunk) == 6);

impl MaglevKey {
    pub const fn new(rev_nat_id: crate::RevNatId, generation: u8, chunk: u16) -> Self {
        Self {
            rev_nat_id,
            generation,
            _pad: 0,
            chunk,
        }
    }
}

/// 256 entries of a Maglev table: backend ids (host order). Entries past the
/// table's size in its last chunk are 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevChunk {
    pub backend_ids: [u32; MAGLEV_CHUNK],
}
const _: () = assert!(size_of::<MaglevChunk>() == 1024);

impl Default for MaglevChunk {
    fn default() -> Self {
        Self {
            backend_ids: [0; MAGLEV_CHUNK],
        }
    }
}

/// murmur3's 32-bit finalizer: every input bit affects every output bit.
#[inline(always)]
pub const fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

const SEED: u32 = 0x6b70_7231; // "kpr1"

/// The hash of a flow's 5-tuple (addresses and ports as in the packet, in
/// network byte order), for Maglev. Symmetric in nothing: the client side
/// comes first.
#[inline(always)]
pub const fn flow_hash(
    saddr_be: u32,
    daddr_be: u32,
    sport_be: u16,
    dport_be: u16,
    proto: u8,
) -> u32 {
    let mut h = fmix32(SEED ^ saddr_be);
    h = fmix32(h ^ daddr_be);
    h = fmix32(h ^ (((sport_be as u32) << 16) | dport_be as u32));
    fmix32(h ^ proto as u32)
}

/// The hash of a client address (network byte order), for source hashing.
#[inline(always)]
pub const fn source_hash(saddr_be: u32) -> u32 {
    fmix32(fmix32(SEED ^ saddr_be))
}

/// FNV-1a, 64 bits, with a chosen offset basis: Maglev's two hashes of a
/// backend's name.
const fn fnv1a64(basis: u64, bytes: &[u8]) -> u64 {
    let mut h = basis;
    let mut i = 0;
    while i < bytes.len() {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    // FNV mixes its high bits poorly into the low ones a modulo reads.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h
}

/// Maglev's `(offset, skip)` of a backend named `name` (its address and port
/// as bytes) in a table of prime size `size`: the backend's preference list is
/// `offset, offset + skip, offset + 2 skip, ...` modulo `size`.
pub const fn maglev_offset_skip(name: &[u8], size: u16) -> (u32, u32) {
    let m = size as u64;
    let offset = fnv1a64(0xcbf2_9ce4_8422_2325, name) % m;
    let skip = fnv1a64(0x8422_2325_cbf2_9ce4, name) % (m - 1) + 1;
    (offset as u32, skip as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The hashes are part of the cluster's behaviour: nodes running different
    // versions must agree. These values must never change.
    #[test]
    fn hashes_are_pinned() {
        assert_eq!(fmix32(0), 0);
        assert_eq!(fmix32(1), 0x514e_28b7);
        // Values computed independently (a Python transcription of the
        // definitions above).
        assert_eq!(
            flow_hash(0x0a00_12c6, 0x0b00_13c6, 0x3412, 0x5000, 6),
            0x1de3_8dcc
        );
        assert_ne!(
            flow_hash(0x0a00_12c6, 0x0b00_13c6, 0x3413, 0x5000, 6),
            0x1de3_8dcc
        );
        assert_eq!(source_hash(0x0a00_12c6), 0x57fd_06e7);
        assert_eq!(maglev_offset_skip(b"198.18.1.10:80", 16_381), (9967, 7562));
    }

    #[test]
    fn chunks_cover_the_table() {
        assert_eq!(maglev_chunks(MAGLEV_DEFAULT_SIZE), 64);
        assert_eq!(maglev_chunks(MAGLEV_MAX_SIZE), 256);
        assert_eq!(maglev_chunks(256), 1);
        assert_eq!(maglev_chunks(257), 2);
    }
}

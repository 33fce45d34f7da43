//! IPv6 map types: the IPv4 ones (in the crate root) with 128-bit addresses.
//! The values that hold no address are shared with IPv4: a frontend's slots
//! are [`crate::SvcValue`]; a conntrack entry is a [`Ct6Value`] (the IPv4
//! one with an IPv6 `nat_addr_be`); and backend ids, reverse-NAT ids, Maglev
//! tables, round-robin cursors and traffic counters share the IPv4 maps' id
//! spaces and maps.
//!
//! Addresses are four `u32` words in network byte order (the packet's 16
//! bytes, read as native words): compared and copied a word at a time by the
//! datapath.

use core::mem::{offset_of, size_of};
use core::net::Ipv6Addr;

use crate::{conntrack::CtEntry, ct_dir, ct_flags};

/// An IPv6 address as four words of its bytes in network order.
pub type Addr6 = [u32; 4];

/// `addr` as [`Addr6`] words.
pub const fn addr6(addr: Ipv6Addr) -> Addr6 {
    let o = addr.octets();
    [
        u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
        u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
        u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
        u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
    ]
}

/// The address of [`Addr6`] words.
pub const fn ipv6(w: &Addr6) -> Ipv6Addr {
    let mut seg = [0u16; 8];
    let mut i = 0;
    while i < 4 {
        let b = w[i].to_ne_bytes();
        seg[2 * i] = u16::from_be_bytes([b[0], b[1]]);
        seg[2 * i + 1] = u16::from_be_bytes([b[2], b[3]]);
        i += 1;
    }
    Ipv6Addr::new(
        seg[0], seg[1], seg[2], seg[3], seg[4], seg[5], seg[6], seg[7],
    )
}

/// One 32-bit word folding an IPv6 address, for the load-balancing hashes
/// ([`crate::lb::source_hash`], [`crate::lb::flow_hash`]).
#[inline(always)]
pub const fn fold6(w: &Addr6) -> u32 {
    w[0] ^ w[1] ^ w[2] ^ w[3]
}

/// Key of the IPv6 services map: [`crate::Svc4Key`] with an IPv6 address.
///
/// | offset | field | meaning |
/// |---|---|---|
/// | 0 | `addr_be` | frontend address |
/// | 16 | `port_be` | frontend port, network byte order |
/// | 18 | `slot` | 0 = frontend, 1..=count = backend slot (host order) |
/// | 20 | `proto` | IP protocol number |
/// | 21 | `scope` | [`crate::SCOPE_EXTERNAL`] or [`crate::SCOPE_INTERNAL`] |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Svc6Key {
    pub addr_be: Addr6,
    pub port_be: u16,
    pub slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<Svc6Key>() == 24);
const _: () = assert!(offset_of!(Svc6Key, port_be) == 16);
const _: () = assert!(offset_of!(Svc6Key, slot) == 18);
const _: () = assert!(offset_of!(Svc6Key, proto) == 20);
const _: () = assert!(offset_of!(Svc6Key, scope) == 21);

impl Svc6Key {
    pub const fn new(addr: Ipv6Addr, port: u16, proto: u8, scope: u8, slot: u16) -> Self {
        Self {
            addr_be: addr6(addr),
            port_be: port.to_be(),
            slot,
            proto,
            scope,
            _pad: [0; 2],
        }
    }
    pub const fn addr(&self) -> Ipv6Addr {
        ipv6(&self.addr_be)
    }
    pub const fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
    /// The same frontend at another slot.
    pub const fn with_slot(mut self, slot: u16) -> Self {
        self.slot = slot;
        self
    }
}

/// Value of the IPv6 backends map (key: backend id, shared with IPv4's).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Backend6 {
    pub addr_be: Addr6,
    pub port_be: u16,
    pub proto: u8,
    /// [`crate::backend_state`] bits.
    pub state: u8,
}
const _: () = assert!(size_of::<Backend6>() == 20);
const _: () = assert!(offset_of!(Backend6, port_be) == 16);
const _: () = assert!(offset_of!(Backend6, state) == 19);

impl Backend6 {
    pub const fn new(addr: Ipv6Addr, port: u16, proto: u8, state: u8) -> Self {
        Self {
            addr_be: addr6(addr),
            port_be: port.to_be(),
            proto,
            state,
        }
    }
    pub const fn addr(&self) -> Ipv6Addr {
        ipv6(&self.addr_be)
    }
    pub const fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
}

/// Value of the IPv6 reverse-NAT map (key: reverse-NAT id, shared with
/// IPv4's): the frontend replies must appear to come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RevNat6 {
    pub addr_be: Addr6,
    pub port_be: u16,
    pub _pad: u16,
}
const _: () = assert!(size_of::<RevNat6>() == 20);

impl RevNat6 {
    pub const fn new(addr: Ipv6Addr, port: u16) -> Self {
        Self {
            addr_be: addr6(addr),
            port_be: port.to_be(),
            _pad: 0,
        }
    }
    pub const fn addr(&self) -> Ipv6Addr {
        ipv6(&self.addr_be)
    }
    pub const fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
}

/// IPv6 conntrack key: [`crate::Ct4Key`] with IPv6 addresses; its value is
/// a [`Ct6Value`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Ct6Key {
    pub saddr_be: Addr6,
    pub daddr_be: Addr6,
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    /// [`crate::ct_dir`].
    pub dir: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<Ct6Key>() == 40);
const _: () = assert!(offset_of!(Ct6Key, daddr_be) == 16);
const _: () = assert!(offset_of!(Ct6Key, sport_be) == 32);
const _: () = assert!(offset_of!(Ct6Key, proto) == 36);
const _: () = assert!(offset_of!(Ct6Key, dir) == 37);

impl Ct6Key {
    /// The REPLY key of a flow: the backend answering the client as the
    /// backend sees it (after any SNAT), as [`crate::Ct4Key::reply`].
    #[inline(always)]
    pub const fn reply(
        proto: u8,
        backend_addr_be: Addr6,
        backend_port_be: u16,
        client_addr_be: Addr6,
        client_port_be: u16,
    ) -> Self {
        Self {
            saddr_be: backend_addr_be,
            daddr_be: client_addr_be,
            sport_be: backend_port_be,
            dport_be: client_port_be,
            proto,
            dir: ct_dir::REPLY,
            _pad: [0; 2],
        }
    }

    /// The SERVICE key of the flow this REPLY key and entry `v` belong to,
    /// to the frontend `rev`, as [`crate::Ct4Key::service_of_reply`].
    #[inline(always)]
    pub const fn service_of_reply(&self, v: &Ct6Value, rev: &RevNat6) -> Self {
        Self {
            saddr_be: if v.flags & ct_flags::SNAT_ADDR != 0 {
                v.nat_addr_be
            } else {
                self.daddr_be
            },
            daddr_be: rev.addr_be,
            sport_be: if v.flags & ct_flags::SNAT_PORT != 0 {
                v.nat_port_be
            } else {
                self.dport_be
            },
            dport_be: rev.port_be,
            proto: self.proto,
            dir: ct_dir::SERVICE,
            _pad: [0; 2],
        }
    }

    pub const fn saddr(&self) -> Ipv6Addr {
        ipv6(&self.saddr_be)
    }
    pub const fn daddr(&self) -> Ipv6Addr {
        ipv6(&self.daddr_be)
    }
}

/// IPv6 conntrack value: [`crate::Ct4Value`] with an IPv6 `nat_addr_be`
/// (SERVICE entries: the source a SNATed flow gets; REPLY entries: the
/// client's own address, restored on replies).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Ct6Value {
    pub backend_id: u32,
    pub rev_nat_id: crate::RevNatId,
    /// [`crate::ct_flags`].
    pub flags: u16,
    pub nat_port_be: u16,
    pub nat_addr_be: Addr6,
    pub _pad2: u32,
    /// `bpf_ktime_get_ns()` of the last packet seen (refreshed at most once
    /// a second).
    pub last_seen_ns: u64,
}
const _: () = assert!(size_of::<Ct6Value>() == 40);
const _: () = assert!(offset_of!(Ct6Value, rev_nat_id) == 4);
const _: () = assert!(offset_of!(Ct6Value, flags) == 8);
const _: () = assert!(offset_of!(Ct6Value, nat_port_be) == 10);
const _: () = assert!(offset_of!(Ct6Value, nat_addr_be) == 12);
const _: () = assert!(offset_of!(Ct6Value, last_seen_ns) == 32);

impl Ct6Value {
    /// The REPLY entry of a flow, as [`crate::Ct4Value::reply_of`].
    #[inline(always)]
    pub const fn reply_of(
        backend_id: u32,
        rev_nat_id: crate::RevNatId,
        flags: u16,
        client_addr_be: Addr6,
        client_port_be: u16,
        now_ns: u64,
    ) -> Self {
        let snat_addr = flags & ct_flags::SNAT_ADDR != 0;
        let snat_port = flags & ct_flags::SNAT_PORT != 0;
        Self {
            backend_id,
            rev_nat_id,
            flags: flags
                & (ct_flags::SNAT_ADDR
                    | ct_flags::SNAT_PORT
                    | ct_flags::VIA_STACK
                    | ct_flags::UNREPLIED),
            nat_port_be: if snat_port { client_port_be } else { 0 },
            nat_addr_be: if snat_addr { client_addr_be } else { [0; 4] },
            _pad2: 0,
            last_seen_ns: now_ns,
        }
    }
}

impl CtEntry for Ct6Value {
    #[inline(always)]
    fn flags(&self) -> u16 {
        self.flags
    }
    #[inline(always)]
    fn last_seen_ns(&self) -> u64 {
        self.last_seen_ns
    }
    #[inline(always)]
    fn rev_nat_id(&self) -> crate::RevNatId {
        self.rev_nat_id
    }
    #[inline(always)]
    fn backend_id(&self) -> u32 {
        self.backend_id
    }
}

/// Data of an IPv6 source-range LPM key: [`crate::SourceRange4`] with an
/// IPv6 client prefix (the prefix length counts
/// [`crate::SOURCE_RANGE_ID_BITS`] plus the CIDR's).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SourceRange6 {
    /// Big-endian, so that the LPM trie compares it bytewise.
    pub rev_nat_id_be: u32,
    pub addr_be: Addr6,
}
const _: () = assert!(size_of::<SourceRange6>() == 20);
const _: () = assert!(offset_of!(SourceRange6, addr_be) == 4);

/// Socket-level reverse-NAT key for IPv6 sockets: [`crate::SockRevNat4Key`]
/// with an IPv6 backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockRevNat6Key {
    pub cookie: u64,
    pub addr_be: Addr6,
    pub port_be: u16,
    pub _pad: [u8; 6],
}
const _: () = assert!(size_of::<SockRevNat6Key>() == 32);
const _: () = assert!(offset_of!(SockRevNat6Key, addr_be) == 8);

/// Socket-level reverse-NAT value for IPv6 sockets: the frontend asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SockRevNat6Value {
    pub addr_be: Addr6,
    pub port_be: u16,
    pub _pad: u16,
    pub rev_nat_id: crate::RevNatId,
}
const _: () = assert!(size_of::<SockRevNat6Value>() == 24);
const _: () = assert!(offset_of!(SockRevNat6Value, rev_nat_id) == 20);

/// IPv6 fragment key: one datagram being fragmented, as its fragments carry
/// it (before translation); its value is a [`crate::FragPorts`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Frag6Key {
    pub saddr_be: Addr6,
    pub daddr_be: Addr6,
    /// The fragment header's identification, as in the packet.
    pub id_be: u32,
    pub proto: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<Frag6Key>() == 40);
const _: () = assert!(offset_of!(Frag6Key, id_be) == 32);

/// IPv6 session-affinity key: [`crate::Affinity4Key`] with an IPv6 client.
/// Its value is a [`crate::AffinityValue`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Affinity6Key {
    pub client_be: Addr6,
    pub rev_nat_id: crate::RevNatId,
}
const _: () = assert!(size_of::<Affinity6Key>() == 20);
const _: () = assert!(offset_of!(Affinity6Key, rev_nat_id) == 16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        let a: Ipv6Addr = "2001:2:0:ff::a".parse().unwrap();
        assert_eq!(ipv6(&addr6(a)), a);
        let k = Svc6Key::new(a, 53, crate::IPPROTO_UDP, crate::SCOPE_INTERNAL, 0);
        assert_eq!(k.addr(), a);
        assert_eq!(k.port(), 53);
        // The first word holds the packet's first four bytes.
        assert_eq!(addr6(a)[0].to_ne_bytes(), [0x20, 0x01, 0x00, 0x02]);
    }

    #[test]
    fn service_key_of_reply_key() {
        let client = addr6("2001:2:0:1::10".parse().unwrap());
        let backend = addr6("2001:2:0:1::11".parse().unwrap());
        let hairpin = addr6("2001:2::fe".parse().unwrap());
        let rev = RevNat6::new("2001:2:0:ff::1".parse().unwrap(), 80);
        let p = crate::IPPROTO_TCP;
        let plain = Ct6Value::reply_of(7, 3, 0, client, 40000u16.to_be(), 1);
        let r = Ct6Key::reply(p, backend, 8080u16.to_be(), client, 40000u16.to_be());
        let s = r.service_of_reply(&plain, &rev);
        assert_eq!((s.saddr_be, s.daddr_be), (client, rev.addr_be));
        assert_eq!((s.sport_be, s.dport_be), (40000u16.to_be(), 80u16.to_be()));
        assert_eq!(s.dir, ct_dir::SERVICE);
        // Hairpin: the backend is the client, seen from the hairpin address;
        // its address and moved port are restored from the entry.
        let f = ct_flags::SNAT_ADDR | ct_flags::SNAT_PORT;
        let hp = Ct6Value::reply_of(7, 3, f, backend, 40000u16.to_be(), 1);
        let r = Ct6Key::reply(p, backend, 8080u16.to_be(), hairpin, 2000u16.to_be());
        let s = r.service_of_reply(&hp, &rev);
        assert_eq!((s.saddr_be, s.sport_be), (backend, 40000u16.to_be()));
    }
}

//! Conntrack rules both sides apply: the datapath when it judges a flow, the
//! agent when it garbage-collects the map. Written once, here, so that the two
//! can never disagree about when an entry expires or which entries belong to
//! one flow.
//!
//! A flow has two entries: the SERVICE entry, keyed by the tuple the client
//! sends (before DNAT), and the REPLY entry, keyed by the tuple the backend
//! sends back (before reverse NAT). The derivations below turn one into the
//! other.

use crate::{ct_dir, ct_flags, Config, Ct4Key, Ct4Value, RevNat4, IPPROTO_UDP};

/// Nanoseconds in a second (`bpf_ktime_get_ns()` counts nanoseconds).
pub const NSEC_PER_SEC: u64 = 1_000_000_000;

/// TCP header flag bits (byte 13 of the TCP header).
pub mod tcp {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const ACK: u8 = 0x10;
}

/// SCTP chunk types ([`sctp_flags`]).
pub mod sctp {
    pub const INIT: u8 = 1;
    pub const INIT_ACK: u8 = 2;
    pub const ABORT: u8 = 6;
    pub const SHUTDOWN: u8 = 7;
    pub const SHUTDOWN_ACK: u8 = 8;
    pub const SHUTDOWN_COMPLETE: u8 = 14;
}

/// Whether a flow of `proto` (TCP, UDP or SCTP: the only protocols the
/// datapath tracks) has a connection whose state conntrack follows (TCP and
/// SCTP); UDP's are datagrams, unreplied or a stream.
///
/// One comparison, with UDP: the verifier splits its paths at each test of
/// a protocol it does not know, and two comparisons split them three ways
/// (measured on 6.18: `ext_xdp` 332k instructions verified against 195k).
#[inline(always)]
pub const fn connection_oriented(proto: u8) -> bool {
    proto != IPPROTO_UDP
}

/// The TCP flags an SCTP packet whose first chunk is of type `chunk` stands
/// for, so that one state machine ([`tcp_state`], [`reply_state`], the
/// datapath's reopening of a closed tuple) follows both protocols, as the
/// kernel's SCTP conntrack does in its own states: INIT opens (a SYN;
/// COOKIE_WAIT), INIT_ACK answers (SYN-ACK), ABORT and SHUTDOWN_COMPLETE
/// close (a RST: the short closing timeout), SHUTDOWN and SHUTDOWN_ACK close
/// one side each (a FIN), anything else (DATA, COOKIE_ECHO, SACK,
/// HEARTBEAT, ...) carries the association on (an ACK).
#[inline(always)]
pub const fn sctp_flags(chunk: u8) -> u8 {
    match chunk {
        sctp::INIT => tcp::SYN,
        sctp::INIT_ACK => tcp::SYN | tcp::ACK,
        sctp::ABORT | sctp::SHUTDOWN_COMPLETE => tcp::RST,
        sctp::SHUTDOWN | sctp::SHUTDOWN_ACK => tcp::FIN | tcp::ACK,
        _ => tcp::ACK,
    }
}

/// How long an entry of protocol `proto` with [`ct_flags`] `flags` lives
/// without traffic, in nanoseconds, following the kernel's conntrack states:
/// for TCP and SCTP ([`sctp_flags`]) closed (RST), time-wait (FINs both
/// ways), close-wait (a FIN one way: the other side may send for long),
/// unanswered or handshaking, and established; for UDP unreplied or a
/// stream.
#[inline(always)]
pub fn timeout_ns(cfg: &Config, proto: u8, flags: u16) -> u64 {
    let fins = ct_flags::TCP_FIN_FWD | ct_flags::TCP_FIN_REV;
    let s = if !connection_oriented(proto) {
        if flags & ct_flags::UDP_STREAM != 0 {
            cfg.ct_udp_stream_s
        } else {
            cfg.ct_udp_s
        }
    } else if flags & ct_flags::TCP_CLOSING != 0 {
        cfg.ct_tcp_closing_s
    } else if flags & fins == fins {
        cfg.ct_tcp_time_wait_s
    } else if flags & fins != 0 {
        cfg.ct_tcp_close_wait_s
    } else if flags & (ct_flags::TCP_SYN | ct_flags::UNREPLIED) != 0 {
        cfg.ct_tcp_syn_s
    } else {
        cfg.ct_tcp_established_s
    };
    s as u64 * NSEC_PER_SEC
}

/// What the rules read of a conntrack entry of either family
/// ([`Ct4Value`], [`crate::ipv6::Ct6Value`]).
pub trait CtEntry {
    fn flags(&self) -> u16;
    fn last_seen_ns(&self) -> u64;
    fn rev_nat_id(&self) -> crate::RevNatId;
    fn backend_id(&self) -> u32;
}

impl CtEntry for Ct4Value {
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

/// Whether entry `v` of protocol `proto` is still alive at `now_ns`.
#[inline(always)]
pub fn alive<E: CtEntry>(cfg: &Config, proto: u8, v: &E, now_ns: u64) -> bool {
    now_ns.saturating_sub(v.last_seen_ns()) <= timeout_ns(cfg, proto, v.flags())
}

/// The TCP state bits of an entry after a segment from the client with header
/// flags `tcp_flags`, given its previous [`ct_flags`] `prev` (non-state bits
/// kept).
///
/// RST: closed. A SYN without ACK opens the flow anew (also a closing
/// tuple the client reused): unanswered until the backend replies. A SYN
/// reusing a closed tuple (time-wait or reset) does not get here: the
/// datapath's conntrack lookup makes it a new flow, balanced anew.
/// A FIN: the client's half is closed. An ACK once the backend answered ends
/// the handshake.
#[inline(always)]
pub fn tcp_state(prev: u16, tcp_flags: u8) -> u16 {
    if tcp_flags & tcp::RST != 0 {
        return prev | ct_flags::TCP_CLOSING;
    }
    if tcp_flags & tcp::SYN != 0 && tcp_flags & tcp::ACK == 0 {
        return (prev & !ct_flags::STATE) | ct_flags::TCP_SYN | ct_flags::UNREPLIED;
    }
    let mut f = prev;
    if tcp_flags & tcp::FIN != 0 {
        f |= ct_flags::TCP_FIN_FWD;
    }
    if tcp_flags & tcp::ACK != 0 && f & ct_flags::UNREPLIED == 0 {
        f &= !ct_flags::TCP_SYN;
    }
    f
}

/// Whether TCP header flags `tcp_flags` (SCTP's from [`sctp_flags`]) are a
/// bare SYN (no ACK): a connection opening.
///
/// A bare SYN on a [`closed`] entry reopens its tuple (the datapath's
/// conntrack lookup): a new connection, balanced anew, as the kernel's
/// conntrack kills such an entry and lets the SYN through NAT again. Kept,
/// the entry would pin the client's next connection on that tuple to the
/// old backend, even one no longer among the endpoints (no longer ready)
/// while it is still in the backend map.
#[inline(always)]
pub const fn bare_syn(tcp_flags: u8) -> bool {
    tcp_flags & (tcp::SYN | tcp::ACK) == tcp::SYN
}

/// Whether connection entry `e` is closed: reset, or FINs both ways
/// (time-wait). See [`bare_syn`].
#[inline(always)]
pub fn closed<E: CtEntry>(e: &E) -> bool {
    let fins = ct_flags::TCP_FIN_FWD | ct_flags::TCP_FIN_REV;
    e.flags() & ct_flags::TCP_CLOSING != 0 || e.flags() & fins == fins
}

/// The state bits of an entry after a packet from the client: TCP and SCTP
/// (`tcp_flags` from [`sctp_flags`]) as [`tcp_state`]; UDP becomes a stream
/// once it goes on after a reply.
#[inline(always)]
pub fn forward_state(prev: u16, proto: u8, tcp_flags: u8) -> u16 {
    if connection_oriented(proto) {
        tcp_state(prev, tcp_flags)
    } else if prev & ct_flags::UNREPLIED == 0 {
        prev | ct_flags::UDP_STREAM
    } else {
        prev
    }
}

/// The state bits of an entry after a packet from the backend: answered; for
/// TCP and SCTP a RST closes, a FIN closes the backend's half; UDP answered
/// a second time is a stream.
#[inline(always)]
pub fn reply_state(prev: u16, proto: u8, tcp_flags: u8) -> u16 {
    let mut f = prev & !ct_flags::UNREPLIED;
    if connection_oriented(proto) {
        if tcp_flags & tcp::RST != 0 {
            f |= ct_flags::TCP_CLOSING;
        } else if tcp_flags & tcp::FIN != 0 {
            f |= ct_flags::TCP_FIN_REV;
        }
    } else if prev & ct_flags::UNREPLIED == 0 {
        f |= ct_flags::UDP_STREAM;
    }
    f
}

/// Whether an entry should be refreshed: its state changed, or its timestamp
/// is more than a second old (refreshing on every packet would make every
/// packet write the entry).
#[inline(always)]
pub fn needs_refresh<E: CtEntry>(v: &E, flags: u16, now_ns: u64) -> bool {
    flags != v.flags() || now_ns.saturating_sub(v.last_seen_ns()) > NSEC_PER_SEC
}

impl Ct4Key {
    /// The REPLY key of a flow: the backend (`backend_addr_be`,
    /// `backend_port_be`) answering the client as the backend sees it
    /// (`client_addr_be`, `client_port_be`: after any SNAT).
    #[inline(always)]
    pub const fn reply(
        proto: u8,
        backend_addr_be: u32,
        backend_port_be: u16,
        client_addr_be: u32,
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

    /// The SERVICE key of the flow this REPLY key and entry `v` belong to:
    /// the client as it sent the packet (the REPLY entry keeps its original
    /// address and port when they were SNATed) to the frontend `rev`.
    #[inline(always)]
    pub const fn service_of_reply(&self, v: &Ct4Value, rev: &RevNat4) -> Self {
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
}

impl Ct4Value {
    /// The REPLY entry of a flow of frontend `rev_nat_id` to backend
    /// `backend_id` whose SERVICE entry has [`ct_flags`] `flags`, for the
    /// client `client_addr_be`:`client_port_be` as it sent the packet: it
    /// names the frontend to restore as the source and, where the client was
    /// SNATed, the client's own address and port to restore as destination.
    #[inline(always)]
    pub const fn reply_of(
        backend_id: u32,
        rev_nat_id: crate::RevNatId,
        flags: u16,
        client_addr_be: u32,
        client_port_be: u16,
        now_ns: u64,
    ) -> Self {
        let snat_addr = flags & ct_flags::SNAT_ADDR != 0;
        let snat_port = flags & ct_flags::SNAT_PORT != 0;
        Self {
            backend_id,
            nat_addr_be: if snat_addr { client_addr_be } else { 0 },
            rev_nat_id,
            flags: flags
                & (ct_flags::SNAT_ADDR
                    | ct_flags::SNAT_PORT
                    | ct_flags::VIA_STACK
                    | ct_flags::UNREPLIED),
            nat_port_be: if snat_port { client_port_be } else { 0 },
            last_seen_ns: now_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IPPROTO_SCTP, IPPROTO_TCP};

    fn entry(flags: u16, last_seen_ns: u64) -> Ct4Value {
        Ct4Value {
            flags,
            last_seen_ns,
            ..Ct4Value::default()
        }
    }

    #[test]
    fn only_a_bare_syn_on_a_closed_connection_opens_it_anew() {
        use ct_flags::*;
        let e = |flags: u16| entry(flags, 0);
        // Closed: reset, or FINs both ways.
        assert!(closed(&e(TCP_CLOSING)));
        assert!(closed(&e(TCP_FIN_FWD | TCP_FIN_REV)));
        assert!(!closed(&e(TCP_FIN_FWD)));
        assert!(!closed(&e(TCP_FIN_REV)));
        assert!(!closed(&e(0)));
        // A bare SYN opens; a SYN-ACK, an ACK or a FIN does not.
        assert!(bare_syn(tcp::SYN));
        assert!(!bare_syn(tcp::SYN | tcp::ACK));
        assert!(!bare_syn(tcp::ACK));
        assert!(!bare_syn(tcp::FIN | tcp::ACK));
        // SCTP's INIT is a bare SYN.
        assert!(bare_syn(sctp_flags(sctp::INIT)));
        assert!(!bare_syn(sctp_flags(sctp::INIT_ACK)));
    }

    #[test]
    fn timeouts_follow_protocol_and_tcp_state() {
        use ct_flags::*;
        let cfg = Config::default();
        let s = |n: u32| n as u64 * NSEC_PER_SEC;
        let tcp = |f: u16| timeout_ns(&cfg, IPPROTO_TCP, f);
        // kube-proxy's settings of the kernel's conntrack.
        assert_eq!(cfg.ct_tcp_established_s, 86_400);
        assert_eq!(cfg.ct_tcp_close_wait_s, 3_600);
        assert_eq!(timeout_ns(&cfg, IPPROTO_UDP, 0), s(cfg.ct_udp_s));
        assert_eq!(timeout_ns(&cfg, IPPROTO_UDP, UNREPLIED), s(cfg.ct_udp_s));
        assert_eq!(
            timeout_ns(&cfg, IPPROTO_UDP, UDP_STREAM),
            s(cfg.ct_udp_stream_s)
        );
        // UDP ignores TCP state bits.
        assert_eq!(timeout_ns(&cfg, IPPROTO_UDP, TCP_CLOSING), s(cfg.ct_udp_s));
        assert_eq!(tcp(0), s(cfg.ct_tcp_established_s));
        assert_eq!(tcp(TCP_SYN | UNREPLIED), s(cfg.ct_tcp_syn_s));
        assert_eq!(tcp(TCP_SYN), s(cfg.ct_tcp_syn_s));
        // A flow first seen mid-stream and never answered is short-lived.
        assert_eq!(tcp(UNREPLIED), s(cfg.ct_tcp_syn_s));
        // Half-closed: the other side may go on sending.
        assert_eq!(tcp(TCP_FIN_FWD), s(cfg.ct_tcp_close_wait_s));
        assert_eq!(tcp(TCP_FIN_REV), s(cfg.ct_tcp_close_wait_s));
        assert_eq!(tcp(TCP_FIN_FWD | TCP_FIN_REV), s(cfg.ct_tcp_time_wait_s));
        // A RST wins over everything.
        assert_eq!(
            tcp(TCP_SYN | TCP_FIN_FWD | TCP_CLOSING),
            s(cfg.ct_tcp_closing_s)
        );
        // NAT bits do not change the timeout.
        assert_eq!(
            tcp(SNAT_ADDR | SNAT_PORT | VIA_STACK),
            s(cfg.ct_tcp_established_s)
        );
    }

    /// An SCTP association's life, chunk by chunk, through the states TCP's
    /// flags stand for: INIT is short-lived until answered, the handshake
    /// and DATA make it established, SHUTDOWN closes one side, ABORT or
    /// SHUTDOWN_COMPLETE close it.
    #[test]
    fn sctp_associations_follow_the_tcp_states() {
        use ct_flags::*;
        use sctp::*;
        let cfg = Config::default();
        let s = |n: u32| n as u64 * NSEC_PER_SEC;
        let t = |f: u16| timeout_ns(&cfg, IPPROTO_SCTP, f);
        let fwd = |prev: u16, chunk: u8| forward_state(prev, IPPROTO_SCTP, sctp_flags(chunk));
        let rev = |prev: u16, chunk: u8| reply_state(prev, IPPROTO_SCTP, sctp_flags(chunk));
        const DATA: u8 = 0;
        const COOKIE_ECHO: u8 = 10;
        let init = fwd(0, INIT);
        assert_eq!(init, TCP_SYN | UNREPLIED);
        assert_eq!(t(init), s(cfg.ct_tcp_syn_s));
        let answered = rev(init, INIT_ACK);
        assert_eq!(answered, TCP_SYN);
        let up = fwd(answered, COOKIE_ECHO);
        assert_eq!(up, 0);
        assert_eq!(t(fwd(up, DATA)), s(cfg.ct_tcp_established_s));
        let shutting = fwd(up, SHUTDOWN);
        assert_eq!(shutting, TCP_FIN_FWD);
        let both = rev(shutting, SHUTDOWN_ACK);
        assert_eq!(t(both), s(cfg.ct_tcp_time_wait_s));
        assert_eq!(t(fwd(both, SHUTDOWN_COMPLETE)), s(cfg.ct_tcp_closing_s));
        assert_eq!(t(rev(up, ABORT)), s(cfg.ct_tcp_closing_s));
        assert_eq!(t(fwd(up, ABORT)), s(cfg.ct_tcp_closing_s));
        // A new INIT on the tuple opens it anew.
        assert_eq!(fwd(TCP_CLOSING, INIT), TCP_SYN | UNREPLIED);
    }

    #[test]
    fn alive_until_the_timeout_inclusive() {
        let cfg = Config::default();
        let t = timeout_ns(&cfg, IPPROTO_UDP, 0);
        let v = entry(0, 1_000);
        assert!(alive(&cfg, IPPROTO_UDP, &v, 1_000 + t));
        assert!(!alive(&cfg, IPPROTO_UDP, &v, 1_000 + t + 1));
        // A clock before the entry (another CPU wrote it a moment later) is alive.
        assert!(alive(&cfg, IPPROTO_UDP, &v, 0));
    }

    /// A whole connection, packet by packet, through both directions, with
    /// the state each step leaves.
    #[test]
    fn tcp_state_transitions() {
        use ct_flags::*;
        use tcp::*;
        let opening = TCP_SYN | UNREPLIED;
        // Handshake: SYN, SYN+ACK (answered), ACK (established).
        assert_eq!(tcp_state(0, SYN), opening);
        assert_eq!(reply_state(opening, IPPROTO_TCP, SYN | ACK), TCP_SYN);
        assert_eq!(tcp_state(TCP_SYN, ACK), 0);
        // An ACK before any answer does not establish.
        assert_eq!(tcp_state(opening, ACK), opening);
        // Half close by the client; the backend goes on; then its FIN.
        assert_eq!(tcp_state(0, FIN | ACK), TCP_FIN_FWD);
        assert_eq!(reply_state(TCP_FIN_FWD, IPPROTO_TCP, ACK), TCP_FIN_FWD);
        assert_eq!(
            reply_state(TCP_FIN_FWD, IPPROTO_TCP, FIN | ACK),
            TCP_FIN_FWD | TCP_FIN_REV
        );
        // Or the backend first.
        assert_eq!(reply_state(0, IPPROTO_TCP, FIN | ACK), TCP_FIN_REV);
        // RST from either side closes, and stays closed until a new SYN.
        assert_eq!(tcp_state(0, RST), TCP_CLOSING);
        assert_eq!(reply_state(0, IPPROTO_TCP, RST | ACK), TCP_CLOSING);
        assert_eq!(tcp_state(TCP_CLOSING, ACK), TCP_CLOSING);
        // A new SYN reopens a closed or closing tuple the client reused.
        assert_eq!(tcp_state(TCP_CLOSING, SYN), opening);
        assert_eq!(tcp_state(TCP_FIN_FWD | TCP_FIN_REV, SYN), opening);
        // A SYN+ACK from the client does not reopen.
        assert_eq!(tcp_state(TCP_CLOSING, SYN | ACK), TCP_CLOSING);
        // A first packet that is not a SYN: unanswered until the backend
        // replies, then established.
        assert_eq!(tcp_state(UNREPLIED, ACK), UNREPLIED);
        assert_eq!(reply_state(UNREPLIED, IPPROTO_TCP, ACK), 0);
        // NAT bits survive every transition.
        let nat = SNAT_ADDR | SNAT_PORT | VIA_STACK;
        assert_eq!(tcp_state(nat | TCP_SYN, ACK), nat);
        assert_eq!(tcp_state(nat, FIN), nat | TCP_FIN_FWD);
        assert_eq!(tcp_state(nat | TCP_CLOSING, SYN), nat | opening);
        assert_eq!(
            reply_state(nat | opening, IPPROTO_TCP, SYN | ACK),
            nat | TCP_SYN
        );
    }

    #[test]
    fn udp_becomes_a_stream_once_it_goes_on_after_a_reply() {
        use ct_flags::*;
        // A query and its answer: answered, not a stream (30 s).
        assert_eq!(reply_state(UNREPLIED, IPPROTO_UDP, 0), 0);
        assert_eq!(forward_state(UNREPLIED, IPPROTO_UDP, 0), UNREPLIED);
        // Then more traffic, either way: a stream (120 s).
        assert_eq!(forward_state(0, IPPROTO_UDP, 0), UDP_STREAM);
        assert_eq!(reply_state(0, IPPROTO_UDP, 0), UDP_STREAM);
        // TCP flags mean nothing to UDP.
        assert_eq!(reply_state(UNREPLIED, IPPROTO_UDP, tcp::RST), 0);
    }

    #[test]
    fn refresh_on_state_change_or_after_a_second() {
        let v = entry(0, 10 * NSEC_PER_SEC);
        assert!(!needs_refresh(&v, 0, 10 * NSEC_PER_SEC + NSEC_PER_SEC));
        assert!(needs_refresh(&v, 0, 11 * NSEC_PER_SEC + 1));
        assert!(needs_refresh(&v, ct_flags::TCP_CLOSING, 10 * NSEC_PER_SEC));
    }

    const CLIENT: u32 = u32::from_ne_bytes([198, 18, 1, 2]);
    const NODE: u32 = u32::from_ne_bytes([198, 18, 0, 1]);
    const BACKEND: u32 = u32::from_ne_bytes([198, 18, 2, 10]);
    const VIP: u32 = u32::from_ne_bytes([198, 19, 0, 10]);

    /// A flow's SERVICE key → its REPLY key and entry → back to the SERVICE
    /// key, with and without SNAT of the address and the port.
    #[test]
    fn reply_and_service_keys_are_inverse() {
        let rev = RevNat4 {
            addr_be: VIP,
            port_be: 80u16.to_be(),
            _pad: 0,
        };
        let (cport, bport, nport) = (40000u16.to_be(), 8080u16.to_be(), 50000u16.to_be());
        let skey = Ct4Key {
            saddr_be: CLIENT,
            daddr_be: VIP,
            sport_be: cport,
            dport_be: rev.port_be,
            proto: IPPROTO_TCP,
            dir: ct_dir::SERVICE,
            _pad: [0; 2],
        };
        let cases = [
            (0, CLIENT, cport),
            (ct_flags::SNAT_ADDR, NODE, cport),
            (ct_flags::SNAT_PORT, CLIENT, nport),
            (ct_flags::SNAT_ADDR | ct_flags::SNAT_PORT, NODE, nport),
        ];
        for (flags, seen_addr, seen_port) in cases {
            let service = Ct4Value {
                backend_id: 7,
                nat_addr_be: if flags & ct_flags::SNAT_ADDR != 0 {
                    NODE
                } else {
                    0
                },
                rev_nat_id: 3,
                flags: flags | ct_flags::TCP_SYN,
                nat_port_be: if flags & ct_flags::SNAT_PORT != 0 {
                    nport
                } else {
                    0
                },
                last_seen_ns: 5,
            };
            let rkey = Ct4Key::reply(IPPROTO_TCP, BACKEND, bport, seen_addr, seen_port);
            assert_eq!(rkey.dir, ct_dir::REPLY);
            assert_eq!((rkey.saddr_be, rkey.sport_be), (BACKEND, bport));
            let rval = Ct4Value::reply_of(
                service.backend_id,
                service.rev_nat_id,
                service.flags,
                CLIENT,
                cport,
                9,
            );
            assert_eq!(rval.backend_id, 7);
            assert_eq!(rval.rev_nat_id, 3);
            assert_eq!(rval.last_seen_ns, 9);
            // Only the NAT bits, never the TCP state, go to the reply entry.
            assert_eq!(rval.flags, flags);
            let stack = Ct4Value::reply_of(
                7,
                3,
                flags | ct_flags::VIA_STACK | ct_flags::UNREPLIED,
                CLIENT,
                cport,
                9,
            );
            assert_eq!(
                stack.flags,
                flags | ct_flags::VIA_STACK | ct_flags::UNREPLIED
            );
            assert_eq!(rkey.service_of_reply(&rval, &rev), skey, "flags {flags:#x}");
        }
    }
}

//! Connection tracking: the two entries of every translated flow (SERVICE,
//! keyed by what the client sends; REPLY, keyed by what the backend sends
//! back), their lookup, creation and restoration. The rules for timeouts, TCP
//! state and key derivations are `proxy_common::conntrack`'s, shared with the
//! agent's garbage collector.

use aya_ebpf::bindings::{BPF_ANY, BPF_NOEXIST};
use proxy_common::{
    conntrack::{
        alive, bare_syn, closed, connection_oriented, forward_state, needs_refresh, reply_state,
        CtEntry,
    },
    ct_dir, ct_flags, stat, Config,
};

use crate::{
    family::{Family, FlowPacket},
    maps::count,
};

/// The state of one flow as the forward path needs it, either family.
pub struct Flow<F: Family> {
    pub backend_id: u32,
    pub backend: F::Backend,
    /// [`ct_flags`] of the SERVICE entry.
    pub flags: u16,
    /// With [`ct_flags::SNAT_ADDR`]: the source address the backend sees.
    pub nat_addr_be: F::Addr,
    /// With [`ct_flags::SNAT_PORT`]: the source port the backend sees.
    pub nat_port_be: u16,
}

impl<F: Family> Clone for Flow<F> {
    #[inline(always)]
    fn clone(&self) -> Self {
        *self
    }
}

impl<F: Family> Copy for Flow<F> {}

impl<F: Family> Default for Flow<F> {
    #[inline(always)]
    fn default() -> Self {
        Flow {
            backend_id: 0,
            backend: F::Backend::default(),
            flags: 0,
            nat_port_be: 0,
            nat_addr_be: F::Addr::default(),
        }
    }
}

impl<F: Family> Flow<F> {
    /// The flow of entry `v`, to `backend`.
    #[inline(always)]
    pub fn of(v: &F::CtValue, backend: F::Backend) -> Self {
        Flow {
            backend_id: v.backend_id(),
            backend,
            flags: v.flags(),
            nat_addr_be: F::ct_nat_addr(v),
            nat_port_be: F::ct_nat_port(v),
        }
    }

    /// The client's address and port as the backend sees them (after SNAT).
    #[inline(always)]
    pub fn client_seen(&self, pkt: &F::Packet) -> (F::Addr, u16) {
        (
            if self.flags & ct_flags::SNAT_ADDR != 0 {
                self.nat_addr_be
            } else {
                *pkt.saddr()
            },
            if self.flags & ct_flags::SNAT_PORT != 0 {
                self.nat_port_be
            } else {
                pkt.sport_be()
            },
        )
    }

    /// This new flow gets source port `port_be`: SNATed to the node
    /// (`SNAT_PORT` already set), or moved off a tuple another flow holds.
    #[inline(always)]
    pub fn ported(&mut self, port_be: u16) {
        count(if self.flags & ct_flags::SNAT_PORT != 0 {
            stat::SNAT_NODE
        } else {
            stat::SNAT_PORT_COLLISION
        });
        self.nat_port_be = port_be;
        self.flags |= ct_flags::SNAT_PORT;
    }

    /// The REPLY key of this flow.
    #[inline(always)]
    pub fn reply_key(&self, pkt: &F::Packet) -> F::CtKey {
        let (addr, port) = self.client_seen(pkt);
        F::reply_key(pkt.proto(), &self.backend, addr, port)
    }
}

/// Conntrack first: the tracked flow of `skey` (the packet's SERVICE key)
/// while its entry is alive and its backend exists; its TCP state follows the
/// packet. Fills `flow` and returns true when there is one.
///
/// (An out-parameter, not `Option<Flow>`: LLVM may read the undefined payload
/// of a `None` speculatively, which the verifier refuses.)
#[inline(always)]
pub fn lookup<F: Family>(
    cfg: &Config,
    pkt: &F::Packet,
    skey: &F::CtKey,
    now: u64,
    flow: &mut Flow<F>,
) -> bool {
    let Some(ct) = F::ct(skey) else {
        return false;
    };
    // SAFETY: LRU value pointer; fields are read and written individually.
    let c = unsafe { &mut *ct };
    if !alive(cfg, pkt.proto(), c, now) || reopens::<F>(pkt, c) {
        return false;
    }
    let Some(b) = F::backend(c.backend_id()) else {
        return false;
    };
    let flags = if pkt.l4_present() {
        forward_state(c.flags(), pkt.proto(), pkt.tcp_flags())
    } else {
        c.flags()
    };
    if needs_refresh(c, flags, now) {
        F::ct_refresh(c, flags, now);
    }
    *flow = Flow::of(c, b);
    true
}

/// Whether `pkt` reopens the tuple of flow `c`: a bare SYN on a closed
/// connection ([`bare_syn`], [`closed`]): a new flow.
///
/// Each part is read only once the one before holds (the verifier walks up
/// to 40 % more states of the IPv4 programs when the packet's flags are
/// read up front).
#[inline(always)]
pub fn reopens<F: Family>(pkt: &F::Packet, c: &F::CtValue) -> bool {
    connection_oriented(pkt.proto()) && bare_syn(pkt.tcp_flags()) && closed(c)
}

/// The REPLY entry of the packet's tuple, if it is a reply of a tracked flow.
#[inline(always)]
pub fn lookup_reply<F: Family>(pkt: &F::Packet) -> Option<(*mut F::CtValue, F::CtValue)> {
    let ct = F::ct_of_packet(pkt, ct_dir::REPLY)?;
    // SAFETY: a map value pointer, read once into a copy.
    Some((ct, unsafe { *ct }))
}

/// A reply of the flow of REPLY entry `r` (at `rptr`, to frontend `rev`) was
/// seen at `now`: the flow's state follows it (answered, the backend's FIN
/// or RST) and the flow lives on, as the kernel's conntrack refreshes on
/// traffic in either direction — a flow whose traffic runs only from the
/// backend (half-closed TCP, UDP server push) keeps its translation. Written
/// at most once a second, or at once when the state changes: the REPLY entry,
/// then the SERVICE entry, whose state and age the datapath and the garbage
/// collector judge the flow by.
#[inline(always)]
pub fn reply_seen<F: Family>(
    pkt: &F::Packet,
    rptr: *mut F::CtValue,
    r: &F::CtValue,
    rev: &F::RevNat,
    now: u64,
) {
    let rflags = reply_state(r.flags(), pkt.proto(), pkt.tcp_flags());
    if !needs_refresh(r, rflags, now) {
        return;
    }
    // SAFETY: LRU value pointer; fields written individually.
    F::ct_refresh(unsafe { &mut *rptr }, rflags, now);
    let skey = F::service_of_reply(&F::pkt_ct_key(pkt, ct_dir::REPLY), r, rev);
    let Some(s) = F::ct(&skey) else {
        return;
    };
    // SAFETY: LRU value pointer; fields read and written individually.
    let s = unsafe { &mut *s };
    if s.backend_id() == r.backend_id() {
        let flags = reply_state(s.flags(), pkt.proto(), pkt.tcp_flags());
        F::ct_refresh(s, flags, now);
    }
}

/// Whether the backend-side tuple `rkey` belongs to another live flow: one of
/// another frontend (two frontends sharing a backend, hit from the same client
/// address and port — field bug C6) whose SERVICE entry is still alive.
#[inline(always)]
pub fn reply_tuple_taken<F: Family>(
    cfg: &Config,
    rkey: &F::CtKey,
    rev_nat_id: proxy_common::RevNatId,
    now: u64,
) -> bool {
    let Some(e) = F::ct(rkey) else {
        return false;
    };
    // SAFETY: map value pointer, copied.
    let e = unsafe { *e };
    if e.rev_nat_id() == rev_nat_id {
        // An earlier flow of the same frontend on the same tuple: reused.
        return false;
    }
    live_backend_of::<F>(cfg, rkey, &e, now) == Some(e.backend_id())
}

/// The backend of the flow whose REPLY entry `e` is at `rkey`, while that
/// flow's SERVICE entry is alive.
#[inline(always)]
pub fn live_backend_of<F: Family>(
    cfg: &Config,
    rkey: &F::CtKey,
    e: &F::CtValue,
    now: u64,
) -> Option<u32> {
    let rev = F::rev_nat(e.rev_nat_id())?;
    let o = F::ct(&F::service_of_reply(rkey, e, &rev))?;
    // SAFETY: map value pointer, copied.
    let o = unsafe { *o };
    alive(cfg, F::ct_proto(rkey), &o, now).then_some(o.backend_id())
}

/// Creates the SERVICE entry `sval` ([`Family::service_entry`]) of the new
/// flow in `flow` at `skey`, and leaves in `flow` the flow as it stands. A
/// racing first packet of the same flow on another CPU may have won: its
/// choice is followed rather than the flow split (field bug K8).
#[inline(always)]
pub fn create<F: Family>(
    cfg: &Config,
    pkt: &F::Packet,
    skey: &F::CtKey,
    sval: &F::CtValue,
    now: u64,
    flow: &mut Flow<F>,
) {
    if F::ct_insert(skey, sval, BPF_NOEXIST as u64).is_ok() {
        return;
    }
    if let Some(w) = F::ct(skey) {
        // SAFETY: map value pointer, copied.
        let w = unsafe { *w };
        // A racing first packet's entry is followed; a closed flow's, whose
        // tuple this SYN reuses, is replaced.
        if alive(cfg, pkt.proto(), &w, now) && !reopens::<F>(pkt, &w) {
            if let Some(wb) = F::backend(w.backend_id()) {
                *flow = Flow::of(&w, wb);
                return;
            }
        }
    }
    if F::ct_insert(skey, sval, BPF_ANY as u64).is_err() {
        count(stat::CT_INSERT_FAILED);
    }
}

/// The REPLY entry of `flow`: written for a new flow; written again for a
/// tracked flow whose reply entry the LRU evicted, so replies are always
/// translated.
#[inline(always)]
pub fn ensure_reply<F: Family>(
    pkt: &F::Packet,
    flow: &Flow<F>,
    rev_nat_id: proxy_common::RevNatId,
    established: bool,
    now: u64,
) {
    let rkey = flow.reply_key(pkt);
    let restore = established && F::ct(&rkey).is_none();
    if restore {
        count(stat::CT_REPLY_RESTORED);
    }
    if !established || restore {
        let rval = F::reply_entry(
            flow.backend_id,
            rev_nat_id,
            flow.flags,
            *pkt.saddr(),
            pkt.sport_be(),
            now,
        );
        if F::ct_insert(&rkey, &rval, BPF_ANY as u64).is_err() {
            count(stat::CT_INSERT_FAILED);
        }
    }
}

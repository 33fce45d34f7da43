//! Every map of the datapath, and the per-CPU counters written on the way.
//!
//! Names carry the map's layout version (`_V1`, `_V2`) and match
//! [`proxy_common::map_names`]; keys and values are the `#[repr(C)]` types of
//! `proxy-common`, so `bpftool map dump` prints their fields by name.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
    macros::btf_map,
};
use proxy_common::{
    capacity,
    lb::{MaglevChunk, MaglevKey},
    Affinity4Key, Affinity6Key, AffinityValue, Backend4, Backend6, Config, Ct4Key, Ct4Value,
    Ct6Key, Ct6Value, Frag4Key, Frag6Key, FragPorts, Iface, RevNat4, RevNat6, RevNatId,
    SockRevNat4Key, SockRevNat4Value, SockRevNat6Key, SockRevNat6Value, SourceRange4, SourceRange6,
    Svc4Key, Svc6Key, SvcValue, Traffic,
};

/// Frontends (slot 0) and their backend slots (1..=count).
#[btf_map]
pub static SVC4_V2: HashMap<Svc4Key, SvcValue, { capacity::SERVICES as usize }> = HashMap::new();
/// Backend id → backend.
#[btf_map]
pub static BACKEND4_V1: HashMap<u32, Backend4, { capacity::BACKENDS as usize }> = HashMap::new();
/// Reverse-NAT id → the frontend replies come from.
#[btf_map]
pub static REVNAT4_V2: HashMap<RevNatId, RevNat4, { capacity::REV_NAT as usize }> = HashMap::new();
/// Both directions of every translated flow.
#[btf_map]
pub static CT4_V2: LruHashMap<Ct4Key, Ct4Value, { capacity::CONNTRACK as usize }> =
    LruHashMap::new();
/// Verdict and event counters, indexed by [`proxy_common::stat`] codes.
#[btf_map]
pub static STATS_V1: PerCpuArray<u64, { capacity::STATS as usize }> = PerCpuArray::new();
/// The agent's configuration, at index 0.
#[btf_map]
pub static CONFIG_V3: Array<Config, 1> = Array::new();
/// Pod-facing interfaces (delivered to with `bpf_redirect_peer`).
#[btf_map]
pub static IFACE_V1: HashMap<u32, Iface, { capacity::IFACES as usize }> = HashMap::new();
/// Ports of IPv4 datagrams being fragmented, from their first fragment.
#[btf_map]
pub static FRAG4_V1: LruHashMap<Frag4Key, FragPorts, { capacity::FRAGMENTS as usize }> =
    LruHashMap::new();
/// `loadBalancerSourceRanges`: (reverse-NAT id, client prefix) → allowed.
#[btf_map]
pub static SRCRANGE4_V2: LpmTrie<SourceRange4, u8, { capacity::SOURCE_RANGES as usize }> =
    LpmTrie::new();
/// Traffic of each frontend, by reverse-NAT id.
#[btf_map]
pub static FE_TRAFFIC_V1: PerCpuArray<Traffic, { capacity::FRONTEND_TRAFFIC as usize }> =
    PerCpuArray::new();
/// Traffic of each backend, by backend id.
#[btf_map]
pub static BE_TRAFFIC_V1: PerCpuArray<Traffic, { capacity::BACKENDS as usize }> =
    PerCpuArray::new();
/// Session affinity: (client, reverse-NAT id) → backend, last use.
#[btf_map]
pub static AFFINITY4_V2: LruHashMap<Affinity4Key, AffinityValue, { capacity::AFFINITY as usize }> =
    LruHashMap::new();
/// Socket-level reverse NAT: (host client's socket, backend) → frontend.
#[btf_map]
pub static SOCK_REVNAT4_V2: LruHashMap<
    SockRevNat4Key,
    SockRevNat4Value,
    { capacity::SOCK_REVNAT as usize },
> = LruHashMap::new();

/// Maglev lookup tables, in chunks; not preallocated, so memory follows the
/// tables programmed (the agent caps them).
#[btf_map]
pub static MAGLEV4_V2: HashMap<
    MaglevKey,
    MaglevChunk,
    { capacity::MAGLEV_CHUNKS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();
/// Round-robin cursors: reverse-NAT id → the next pick, per CPU (no cursor
/// is shared between CPUs, so none is written concurrently).
#[btf_map]
pub static RR4_V1: PerCpuArray<u32, { capacity::REV_NAT as usize }> = PerCpuArray::new();

/// The ICMP reject's rate limit: the bucket's theoretical arrival time, per
/// CPU ([`proxy_common::ratelimit`]).
#[btf_map]
pub static REJECT_RL_V1: PerCpuArray<u64, 1> = PerCpuArray::new();

/// SNAT port spaces a search found full: the backend-side tuple with port 0
/// → when ([`proxy_common::SNAT_SEARCH_BACKOFF_NS`]).
#[btf_map]
pub static SNAT_FULL4_V1: LruHashMap<Ct4Key, u64, { capacity::SNAT_FULL as usize }> =
    LruHashMap::new();

/// IPv6 `SNAT_FULL4_V1`.
#[btf_map]
pub static SNAT_FULL6_V1: LruHashMap<Ct6Key, u64, { capacity::SNAT_FULL as usize }> =
    LruHashMap::new();

/// Flows the kernel's conntrack translated before this datapath took over
/// (kube-proxy's DNAT): the client's tuple → until when they stay the
/// kernel's ([`crate::forward::handed_over`]); and, `dir` REPLY, the
/// backend-side tuples of those the kernel also masqueraded → until when
/// their node port is not given to a new flow ([`crate::nat`]).
#[btf_map]
pub static HANDOVER4_V1: LruHashMap<Ct4Key, u64, { capacity::HANDOVER as usize }> =
    LruHashMap::new();
/// IPv6 `HANDOVER4_V1`.
#[btf_map]
pub static HANDOVER6_V1: LruHashMap<Ct6Key, u64, { capacity::HANDOVER as usize }> =
    LruHashMap::new();

/// IPv6 frontends and their backend slots (as `SVC4_V2`); not preallocated:
/// memory follows the IPv6 Services a cluster has.
#[btf_map]
pub static SVC6_V2: HashMap<
    Svc6Key,
    SvcValue,
    { capacity::SERVICES6 as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();
/// Backend id → IPv6 backend (ids shared with `BACKEND4_V1`).
#[btf_map]
pub static BACKEND6_V1: HashMap<
    u32,
    Backend6,
    { capacity::BACKENDS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();
/// Reverse-NAT id → the IPv6 frontend replies come from.
#[btf_map]
pub static REVNAT6_V2: HashMap<
    RevNatId,
    RevNat6,
    { capacity::REV_NAT as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();
/// Both directions of every translated IPv6 flow.
#[btf_map]
pub static CT6_V2: LruHashMap<Ct6Key, Ct6Value, { capacity::CONNTRACK6 as usize }> =
    LruHashMap::new();
/// IPv6 `loadBalancerSourceRanges`: (reverse-NAT id, client prefix) → allowed.
#[btf_map]
pub static SRCRANGE6_V2: LpmTrie<SourceRange6, u8, { capacity::SOURCE_RANGES as usize }> =
    LpmTrie::new();
/// Ports of IPv6 datagrams being fragmented, from their first fragment.
#[btf_map]
pub static FRAG6_V1: LruHashMap<Frag6Key, FragPorts, { capacity::FRAGMENTS as usize }> =
    LruHashMap::new();
/// Socket-level reverse NAT of IPv6 sockets: (host client's socket,
/// backend) → frontend.
#[btf_map]
pub static SOCK_REVNAT6_V2: LruHashMap<
    SockRevNat6Key,
    SockRevNat6Value,
    { capacity::SOCK_REVNAT as usize },
> = LruHashMap::new();
/// IPv6 session affinity: (client, reverse-NAT id) → backend, last use.
#[btf_map]
pub static AFFINITY6_V2: LruHashMap<Affinity6Key, AffinityValue, { capacity::AFFINITY6 as usize }> =
    LruHashMap::new();

/// Counts one event under `code` ([`proxy_common::stat`]).
#[inline(always)]
pub fn count(code: u32) {
    if let Some(p) = STATS_V1.get_ptr_mut(code) {
        // SAFETY: per-CPU slot of this CPU; no other writer while we run.
        unsafe { *p += 1 };
    }
}

/// Accounts a translated packet of `len` bytes to its frontend and backend.
///
/// Each slot is checked and written on its own: LLVM merges the null checks
/// of a loop over both lookups into one `or` of the two pointers, which the
/// verifier refuses ("pointer |= pointer prohibited").
#[inline(always)]
pub fn account(len: u64, rev_nat_id: RevNatId, backend_id: u32) {
    if let Some(p) = FE_TRAFFIC_V1.get_ptr_mut(rev_nat_id) {
        add_traffic(p, len);
    }
    if let Some(p) = BE_TRAFFIC_V1.get_ptr_mut(backend_id) {
        add_traffic(p, len);
    }
}

#[inline(always)]
fn add_traffic(p: *mut Traffic, len: u64) {
    // SAFETY: per-CPU slot of this CPU; no other writer while we run.
    unsafe {
        (*p).packets += 1;
        (*p).bytes += len;
    }
}

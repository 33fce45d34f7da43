//! Load balancing: the frontend lookup and the choice of a backend for a new
//! flow (session affinity, else the frontend's algorithm: a random slot, the
//! next slot per CPU, a slot by the client's hash, or the Maglev table's
//! entry for the 5-tuple), from the services, backends, affinity, Maglev and
//! source-range maps. Hash lookups only; nothing here loops over backends.
//! Written once for both families ([`crate::family`]).

use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{
    conntrack::NSEC_PER_SEC,
    lb::{alg, flow_hash, source_hash, MaglevKey, MAGLEV_CHUNK},
    stat, svc_flags, AffinityValue, RevNat4, SvcValue,
};

use crate::{
    family::{Family, FiveTuple},
    maps::{count, MAGLEV4_V2, REVNAT4_V2, RR4_V1},
    verdict::Verdict,
};

/// The frontend that replies of reverse-NAT id `id` come from.
#[inline(always)]
pub fn rev_nat(id: proxy_common::RevNatId) -> Option<RevNat4> {
    // SAFETY: map value pointer, copied.
    REVNAT4_V2.get_ptr(id).map(|r| unsafe { *r })
}

/// Picks a backend for a new flow `t` to frontend `fe` (at `key`), either
/// family: the client's session affinity while it is valid, else the one
/// the frontend's algorithm names ([`choose`]). `Err` when there is none to
/// pick: drop when the endpoints may not be used from this node, else
/// reject.
///
/// Inlined into its callers: as a BPF call of its own its frame (72 bytes,
/// 96 once the verifier rounds it up) on top of `forward::decide`'s and the
/// entry point's made 544 bytes, which kernels before 6.x's newer stack
/// accounting refuse ("combined stack size of 3 calls", 5.10 and 6.1).
#[inline(always)]
pub fn select<F: Family>(
    t: &FiveTuple<F>,
    key: &F::SvcKey,
    fe: &SvcValue,
    now: u64,
) -> Result<(u32, F::Backend), Verdict> {
    if fe.count == 0 {
        if fe.flags & svc_flags::DROP_NO_BACKEND != 0 {
            return Err(Verdict::Drop(stat::DROP_NO_LOCAL_BACKEND));
        }
        // Answered by the caller, outside this call chain (stack depth).
        return Err(Verdict::Reject(stat::REJECT_NO_BACKEND));
    }
    let timeout_ns = fe.affinity_timeout_s as u64 * NSEC_PER_SEC;
    if timeout_ns != 0 {
        if let Some(a) = F::affinity(t.saddr, fe.rev_nat_id) {
            // SAFETY: LRU value pointer; fields read and written individually.
            let a = unsafe { &mut *a };
            if now.saturating_sub(a.last_used_ns) <= timeout_ns {
                if let Some(b) = F::backend(a.backend_id) {
                    // Refreshed by each new connection, as kube-proxy's
                    // `recent --set` does; conntrack never extends it.
                    a.last_used_ns = now;
                    count(stat::AFFINITY_HIT);
                    return Ok((a.backend_id, b));
                }
            }
        }
    }
    let id = choose(t, key, fe)?;
    let Some(b) = F::backend(id) else {
        return Err(Verdict::Drop(stat::DROP_NO_BACKEND_ENTRY));
    };
    if timeout_ns != 0 {
        let av = AffinityValue {
            backend_id: id,
            _pad: 0,
            last_used_ns: now,
        };
        F::set_affinity(t.saddr, fe.rev_nat_id, &av);
    }
    Ok((id, b))
}

/// The backend id the frontend's algorithm picks for a new flow (`fe.count`
/// is not 0): Maglev reads its table; the others pick a slot.
#[inline(always)]
fn choose<F: Family>(t: &FiveTuple<F>, key: &F::SvcKey, fe: &SvcValue) -> Result<u32, Verdict> {
    let algorithm = svc_flags::algorithm(fe.flags);
    if algorithm == alg::MAGLEV {
        return maglev(t, fe);
    }
    let r = if algorithm == alg::ROUND_ROBIN {
        match RR4_V1.get_ptr_mut(fe.rev_nat_id) {
            // SAFETY: this CPU's cursor; no other writer while we run.
            Some(c) => unsafe {
                let r = *c;
                *c = r.wrapping_add(1);
                r
            },
            // An id beyond the cursors (the reverse-NAT map made smaller
            // than the ids in use): a random pick, not always slot 1.
            // SAFETY: helper without arguments.
            None => unsafe { bpf_get_prandom_u32() },
        }
    } else if algorithm == alg::SOURCE_HASH {
        source_hash(F::fold(t.saddr))
    } else {
        // SAFETY: helper without arguments.
        unsafe { bpf_get_prandom_u32() }
    };
    let slot = (r % fe.count as u32) as u16 + 1;
    F::slot_backend(key, slot).ok_or(Verdict::Drop(stat::DROP_NO_BACKEND_ENTRY))
}

/// Maglev: the entry of the frontend's table (the generation slot 0 names)
/// for the flow's 5-tuple. One hash and one map lookup; both families'
/// tables are in one map, by reverse-NAT id.
#[inline(always)]
fn maglev<F: Family>(t: &FiveTuple<F>, fe: &SvcValue) -> Result<u32, Verdict> {
    let miss = Verdict::Drop(stat::DROP_NO_BACKEND_ENTRY);
    if fe.maglev_size == 0 {
        return Err(miss);
    }
    let h = flow_hash(
        F::fold(t.saddr),
        F::fold(t.daddr),
        t.sport_be,
        t.dport_be,
        t.proto,
    );
    let index = h % fe.maglev_size as u32;
    let generation = u8::from(fe.flags & svc_flags::MAGLEV_GEN != 0);
    let key = MaglevKey::new(
        fe.rev_nat_id,
        generation,
        (index / MAGLEV_CHUNK as u32) as u16,
    );
    let chunk = MAGLEV4_V2.get_ptr(key).ok_or(miss)?;
    let entry = (index as usize) & (MAGLEV_CHUNK - 1);
    // SAFETY: map value pointer; `entry` is below the chunk's length.
    let id = unsafe { (*chunk).backend_ids[entry] };
    if id == 0 {
        return Err(miss);
    }
    Ok(id)
}

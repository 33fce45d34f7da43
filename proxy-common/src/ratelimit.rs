//! The ICMP reject's rate limit: a GCRA token bucket (one `u64` per CPU, the
//! bucket's theoretical arrival time), as the kernel limits the ICMP errors
//! it sends itself (`net.ipv4.icmp_msgs_per_sec` 1000, burst 50). Without
//! one, spoofed SYNs to a frontend without endpoints would make every node an
//! unlimited ICMP reflector. Written once, for the datapath, tested here.

/// Rejects allowed per second and CPU, sustained.
pub const REJECTS_PER_SEC: u64 = 1_000;
/// Rejects allowed at once, per CPU, after a quiet period.
pub const REJECT_BURST: u64 = 50;

const INTERVAL_NS: u64 = 1_000_000_000 / REJECTS_PER_SEC;

/// Whether one more reject may go at `now_ns`, given the bucket's theoretical
/// arrival time `tat_ns`: `Some(new tat)` if it may, `None` if over the limit.
#[inline(always)]
pub const fn allow(tat_ns: u64, now_ns: u64) -> Option<u64> {
    let tat = if tat_ns > now_ns { tat_ns } else { now_ns };
    if tat - now_ns >= REJECT_BURST * INTERVAL_NS {
        return None;
    }
    Some(tat + INTERVAL_NS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_the_sustained_rate() {
        let t0 = 5_000_000_000;
        let mut tat = 0;
        let mut allowed = 0;
        for _ in 0..1000 {
            if let Some(t) = allow(tat, t0) {
                tat = t;
                allowed += 1;
            }
        }
        assert_eq!(allowed, REJECT_BURST);
        // One more per interval after that.
        assert!(allow(tat, t0).is_none());
        let t = allow(tat, t0 + INTERVAL_NS).expect("one interval later");
        assert!(allow(t, t0 + INTERVAL_NS).is_none());
        // After a quiet second, the whole burst again.
        let mut n = 0;
        let mut tat = t;
        while let Some(t) = allow(tat, t0 + 2_000_000_000) {
            tat = t;
            n += 1;
        }
        assert_eq!(n, REJECT_BURST);
    }
}

//! The one outcome type of the datapath's steps.
//!
//! Every step returns `Result<T, Verdict>`: `Ok` to go on with the next step,
//! `Err(verdict)` when the packet's fate is settled. Each program maps a
//! verdict to its own action in one place (`tc::act`, `xdp::act`), so the
//! steps never name a tc or XDP action themselves.

/// What to do with a packet, and the [`proxy_common::stat`] counter it is
/// recorded under.
///
/// Every variant carries exactly one `u32`, so a `Verdict` has no
/// uninitialised bytes and may cross a BPF function call (the verifier
/// refuses reading undefined stack bytes).
#[repr(C, u32)]
#[derive(Clone, Copy)]
pub enum Verdict {
    /// Leave the packet as it is: to the stack from tc; to tc from XDP.
    Pass(u32),
    /// Drop it.
    Drop(u32),
    /// Translated: deliver it (FIB lookup, redirect) from the program's top
    /// frame (the verifier limits the combined stack of nested calls).
    Deliver(u32),
    /// No usable backend: answer with an ICMP port unreachable (tc), or leave
    /// that to tc (XDP).
    Reject(u32),
}

//! What the agent needs from the kernel, and saying so when it is missing:
//! RLIMIT_MEMLOCK raised only where the kernel charges BPF memory to it, and
//! the capabilities named when the kernel answers EPERM or EACCES.
//!
//! | capability | what needs it |
//! |---|---|
//! | `CAP_BPF` | creating maps, loading programs, pinning and opening pins |
//! | `CAP_PERFMON` | loading the tc/XDP programs (pointer arithmetic on packets) |
//! | `CAP_NET_ADMIN` | loading networking program types (tc, XDP, cgroup socket hooks; the kernel asks for it beside CAP_BPF), attaching them, `sock_diag` destroy |
//! | `CAP_SYS_RESOURCE` | only on kernels that charge BPF memory to RLIMIT_MEMLOCK (before 5.11) |

use std::io;

/// Capabilities the agent uses, with what breaks without each.
pub const NEEDED: &[(&str, u32, &str)] = &[
    (
        "CAP_BPF",
        39,
        "creating maps and loading programs (bpf() is refused)",
    ),
    (
        "CAP_PERFMON",
        38,
        "loading the tc and XDP programs (the verifier refuses pointer arithmetic on packets)",
    ),
    (
        "CAP_NET_ADMIN",
        12,
        "loading networking programs (tc, XDP, cgroup socket hooks) and attaching them, netlink changes",
    ),
];

/// Whether the kernel charges BPF memory to RLIMIT_MEMLOCK, as libbpf's
/// `probe_memcg_account` tells: `bpf_ktime_get_coarse_ns` arrived together
/// with memcg accounting of BPF memory (Linux 5.11), so a kernel that has
/// the helper accounts to the cgroup, not to the limit. Never a version
/// comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemlockProbe {
    /// The helper exists: BPF memory is charged to the memory cgroup.
    Memcg,
    /// The helper is missing: BPF memory is charged to RLIMIT_MEMLOCK.
    Rlimit,
    /// The probe could not run (for example: no CAP_BPF yet).
    Unknown,
}

/// What to do about RLIMIT_MEMLOCK.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemlockAction {
    /// Leave the limit alone.
    Keep,
    /// Raise the limit to infinity.
    Raise,
}

/// The decision: raise only where the kernel charges the limit (or cannot
/// tell), and the limit is not already unlimited.
pub fn memlock_action(probe: MemlockProbe, current_soft_limit: u64) -> MemlockAction {
    match probe {
        MemlockProbe::Memcg => MemlockAction::Keep,
        _ if current_soft_limit == libc::RLIM_INFINITY => MemlockAction::Keep,
        MemlockProbe::Rlimit | MemlockProbe::Unknown => MemlockAction::Raise,
    }
}

/// Runs the probe on this kernel.
pub fn probe_memlock() -> MemlockProbe {
    use aya::{programs::ProgramType, sys::BpfHelper};
    match aya::sys::is_helper_supported(
        ProgramType::SocketFilter,
        BpfHelper::BPF_FUNC_ktime_get_coarse_ns,
    ) {
        Ok(true) => MemlockProbe::Memcg,
        Ok(false) => MemlockProbe::Rlimit,
        Err(_) => MemlockProbe::Unknown,
    }
}

/// Probes, then raises RLIMIT_MEMLOCK where the kernel needs it. Failing to
/// raise it is not fatal here (the map creation that fails later says why);
/// the returned text says what happened, for the log.
pub fn ensure_memlock() -> Result<&'static str, String> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return Err(format!(
            "getrlimit(RLIMIT_MEMLOCK): {}",
            io::Error::last_os_error()
        ));
    }
    let probe = probe_memlock();
    match memlock_action(probe, lim.rlim_cur) {
        MemlockAction::Keep if probe == MemlockProbe::Memcg => {
            Ok("BPF memory is charged to the memory cgroup: RLIMIT_MEMLOCK left alone")
        }
        MemlockAction::Keep => Ok("RLIMIT_MEMLOCK is already unlimited"),
        MemlockAction::Raise => {
            let inf = libc::rlimit {
                rlim_cur: libc::RLIM_INFINITY,
                rlim_max: libc::RLIM_INFINITY,
            };
            // SAFETY: setrlimit reads the struct we pass.
            if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &inf) } == 0 {
                Ok("this kernel charges BPF memory to RLIMIT_MEMLOCK: raised it to unlimited")
            } else {
                Err(format!(
                    "this kernel charges BPF memory to RLIMIT_MEMLOCK ({} bytes) and raising it failed ({}): it needs CAP_SYS_RESOURCE, or a higher limit from the container runtime",
                    lim.rlim_cur,
                    io::Error::last_os_error()
                ))
            }
        }
    }
}

/// The effective capability set of this process (`CapEff` of
/// /proc/self/status), `None` if it cannot be read.
pub fn effective_capabilities() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_cap_eff(&status)
}

fn parse_cap_eff(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
}

/// The needed capabilities missing from `eff`.
pub fn missing(eff: u64) -> Vec<&'static str> {
    NEEDED
        .iter()
        .filter(|(_, bit, _)| eff & (1u64 << bit) == 0)
        .map(|(name, _, _)| *name)
        .collect()
}

/// True if some error in the chain is EPERM or EACCES.
pub fn is_permission_error(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut e: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(cur) = e {
        if let Some(io) = cur.downcast_ref::<io::Error>() {
            if matches!(io.raw_os_error(), Some(libc::EPERM | libc::EACCES))
                || io.kind() == io::ErrorKind::PermissionDenied
            {
                return true;
            }
        }
        e = cur.source();
    }
    false
}

/// A hint for an error the kernel refused: which capabilities this process
/// lacks and what each is for. `None` if the error is not EPERM/EACCES.
pub fn hint(err: &(dyn std::error::Error + 'static)) -> Option<String> {
    if !is_permission_error(err) {
        return None;
    }
    Some(hint_for(effective_capabilities()))
}

fn hint_for(eff: Option<u64>) -> String {
    let all = NEEDED
        .iter()
        .map(|(n, _, _)| *n)
        .collect::<Vec<_>>()
        .join(", ");
    let lacking: Vec<String> = eff
        .map(missing)
        .unwrap_or_default()
        .iter()
        .filter_map(|m| NEEDED.iter().find(|(n, _, _)| n == m))
        .map(|(n, _, what)| format!("{n}, needed for {what}"))
        .collect();
    if lacking.is_empty() {
        format!("the kernel refused (permission denied) although this process has {all}: check the seccomp profile, the LSM (AppArmor, SELinux) and, on kernels before 5.11, RLIMIT_MEMLOCK")
    } else {
        format!(
            "the kernel refused (permission denied): this process lacks {} (the agent needs {all}; deploy/daemonset.yaml adds them)",
            lacking.join("; ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_is_raised_only_where_the_kernel_charges_it() {
        let small = 8 << 20;
        assert_eq!(
            memlock_action(MemlockProbe::Memcg, small),
            MemlockAction::Keep
        );
        assert_eq!(
            memlock_action(MemlockProbe::Rlimit, small),
            MemlockAction::Raise
        );
        assert_eq!(
            memlock_action(MemlockProbe::Unknown, small),
            MemlockAction::Raise
        );
        assert_eq!(
            memlock_action(MemlockProbe::Rlimit, libc::RLIM_INFINITY),
            MemlockAction::Keep
        );
    }

    #[test]
    fn cap_eff_parsed_and_missing_named() {
        let status = "Name:\tproxy-agent\nCapEff:\t000000c000001000\n";
        let eff = parse_cap_eff(status).unwrap();
        assert!(missing(eff).is_empty());
        let no_perfmon = eff & !(1 << 38);
        assert_eq!(missing(no_perfmon), vec!["CAP_PERFMON"]);
        assert!(hint_for(Some(no_perfmon)).contains("lacks CAP_PERFMON"));
    }

    #[test]
    fn permission_errors_found_in_the_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] io::Error);
        let e = Outer(io::Error::from_raw_os_error(libc::EPERM));
        assert!(is_permission_error(&e));
        let e = Outer(io::Error::from_raw_os_error(libc::ENOENT));
        assert!(!is_permission_error(&e));
    }
}

//! `seccompProfile: RuntimeDefault` for the lab's runc mode: the default
//! profile of moby (`profiles/seccomp/default.json`, the one whose rules
//! containerd's `contrib/seccomp/seccomp_default.go` generates too), resolved
//! for one container as those runtimes resolve it, into OCI `linux.seccomp`.
//!
//! The rules below are that profile's, as data, in its order: the syscalls
//! every container may make, those allowed only with an argument check, and
//! those allowed only when the container holds a capability (`includes.caps`)
//! or only when it does not (`excludes.caps`). Resolving keeps the rules whose
//! conditions hold for the container's bounding set and architecture, as
//! moby's `setupSeccomp` does, so a container with CAP_BPF and CAP_PERFMON
//! gets `bpf` and `perf_event_open`, one without them does not. Taken from
//! moby/moby at commit 00f3d189e420d485e42d15fe494f96d272284e0e (Apache-2.0).
//!
//! What the agent needs of it: `bpf` (CAP_BPF rule) and `perf_event_open`
//! (CAP_PERFMON rule), both in the profile since moby and containerd added the
//! CAP_BPF/CAP_PERFMON rules; older runtimes allow them only with CAP_SYS_ADMIN
//! (docs/security.md: "The DaemonSet's seccomp profile").

use serde_json::{json, Value};

/// When a rule applies.
enum When {
    Always,
    /// The container holds this capability (`includes.caps`).
    Cap(&'static str),
    /// The container does not hold it (`excludes.caps`).
    NotCap(&'static str),
    /// One of these architectures (moby's names, `includes.arches`).
    Arch(&'static [&'static str]),
    /// Not one of these architectures, and not the capability.
    NotCapNotArch(&'static str, &'static [&'static str]),
    /// These architectures, without the capability.
    ArchNotCap(&'static [&'static str], &'static str),
}

/// One argument comparison (`args`): index, value, op.
type Arg = (u32, u64, &'static str);

struct Rule {
    names: &'static [&'static str],
    /// `None`: allow; `Some(errno)`: fail with it.
    errno: Option<u32>,
    args: &'static [Arg],
    when: When,
}

/// CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
/// | CLONE_NEWNET | CLONE_NEWCGROUP: `clone` without CAP_SYS_ADMIN may not
/// make namespaces.
const CLONE_NS_FLAGS: u64 = 2_114_060_288;

/// The syscalls allowed to every container.
const ALLOWED: &[&str] = &[
    "accept",
    "accept4",
    "access",
    "adjtimex",
    "alarm",
    "bind",
    "brk",
    "capget",
    "capset",
    "chdir",
    "chmod",
    "chown",
    "chown32",
    "clock_adjtime",
    "clock_adjtime64",
    "clock_getres",
    "clock_getres_time64",
    "clock_gettime",
    "clock_gettime64",
    "clock_nanosleep",
    "clock_nanosleep_time64",
    "close",
    "close_range",
    "connect",
    "copy_file_range",
    "creat",
    "dup",
    "dup2",
    "dup3",
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_ctl_old",
    "epoll_pwait",
    "epoll_pwait2",
    "epoll_wait",
    "epoll_wait_old",
    "eventfd",
    "eventfd2",
    "execve",
    "execveat",
    "exit",
    "exit_group",
    "faccessat",
    "faccessat2",
    "fadvise64",
    "fadvise64_64",
    "fallocate",
    "fanotify_mark",
    "fchdir",
    "fchmod",
    "fchmodat",
    "fchown",
    "fchown32",
    "fchownat",
    "fcntl",
    "fcntl64",
    "fdatasync",
    "fgetxattr",
    "flistxattr",
    "flock",
    "fork",
    "fremovexattr",
    "fsetxattr",
    "fstat",
    "fstat64",
    "fstatat64",
    "fstatfs",
    "fstatfs64",
    "fsync",
    "ftruncate",
    "ftruncate64",
    "futex",
    "futex_time64",
    "futex_waitv",
    "futimesat",
    "getcpu",
    "getcwd",
    "getdents",
    "getdents64",
    "getegid",
    "getegid32",
    "geteuid",
    "geteuid32",
    "getgid",
    "getgid32",
    "getgroups",
    "getgroups32",
    "getitimer",
    "getpeername",
    "getpgid",
    "getpgrp",
    "getpid",
    "getppid",
    "getpriority",
    "getrandom",
    "getresgid",
    "getresgid32",
    "getresuid",
    "getresuid32",
    "getrlimit",
    "get_robust_list",
    "getrusage",
    "getsid",
    "getsockname",
    "getsockopt",
    "get_thread_area",
    "gettid",
    "gettimeofday",
    "getuid",
    "getuid32",
    "getxattr",
    "inotify_add_watch",
    "inotify_init",
    "inotify_init1",
    "inotify_rm_watch",
    "io_cancel",
    "ioctl",
    "io_destroy",
    "io_getevents",
    "io_pgetevents",
    "io_pgetevents_time64",
    "ioprio_get",
    "ioprio_set",
    "io_setup",
    "io_submit",
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "ipc",
    "kill",
    "landlock_add_rule",
    "landlock_create_ruleset",
    "landlock_restrict_self",
    "lchown",
    "lchown32",
    "lgetxattr",
    "link",
    "linkat",
    "listen",
    "listxattr",
    "llistxattr",
    "_llseek",
    "lremovexattr",
    "lseek",
    "lsetxattr",
    "lstat",
    "lstat64",
    "madvise",
    "membarrier",
    "memfd_create",
    "memfd_secret",
    "mincore",
    "mkdir",
    "mkdirat",
    "mknod",
    "mknodat",
    "mlock",
    "mlock2",
    "mlockall",
    "mmap",
    "mmap2",
    "mprotect",
    "mq_getsetattr",
    "mq_notify",
    "mq_open",
    "mq_timedreceive",
    "mq_timedreceive_time64",
    "mq_timedsend",
    "mq_timedsend_time64",
    "mq_unlink",
    "mremap",
    "msgctl",
    "msgget",
    "msgrcv",
    "msgsnd",
    "msync",
    "munlock",
    "munlockall",
    "munmap",
    "name_to_handle_at",
    "nanosleep",
    "newfstatat",
    "_newselect",
    "open",
    "openat",
    "openat2",
    "pause",
    "pidfd_open",
    "pidfd_send_signal",
    "pipe",
    "pipe2",
    "pkey_alloc",
    "pkey_free",
    "pkey_mprotect",
    "poll",
    "ppoll",
    "ppoll_time64",
    "prctl",
    "pread64",
    "preadv",
    "preadv2",
    "prlimit64",
    "process_mrelease",
    "pselect6",
    "pselect6_time64",
    "pwrite64",
    "pwritev",
    "pwritev2",
    "read",
    "readahead",
    "readlink",
    "readlinkat",
    "readv",
    "recv",
    "recvfrom",
    "recvmmsg",
    "recvmmsg_time64",
    "recvmsg",
    "remap_file_pages",
    "removexattr",
    "rename",
    "renameat",
    "renameat2",
    "restart_syscall",
    "rmdir",
    "rseq",
    "rt_sigaction",
    "rt_sigpending",
    "rt_sigprocmask",
    "rt_sigqueueinfo",
    "rt_sigreturn",
    "rt_sigsuspend",
    "rt_sigtimedwait",
    "rt_sigtimedwait_time64",
    "rt_tgsigqueueinfo",
    "sched_getaffinity",
    "sched_getattr",
    "sched_getparam",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_getscheduler",
    "sched_rr_get_interval",
    "sched_rr_get_interval_time64",
    "sched_setaffinity",
    "sched_setattr",
    "sched_setparam",
    "sched_setscheduler",
    "sched_yield",
    "seccomp",
    "select",
    "semctl",
    "semget",
    "semop",
    "semtimedop",
    "semtimedop_time64",
    "send",
    "sendfile",
    "sendfile64",
    "sendmmsg",
    "sendmsg",
    "sendto",
    "setfsgid",
    "setfsgid32",
    "setfsuid",
    "setfsuid32",
    "setgid",
    "setgid32",
    "setgroups",
    "setgroups32",
    "setitimer",
    "setpgid",
    "setpriority",
    "setregid",
    "setregid32",
    "setresgid",
    "setresgid32",
    "setresuid",
    "setresuid32",
    "setreuid",
    "setreuid32",
    "setrlimit",
    "set_robust_list",
    "setsid",
    "setsockopt",
    "set_thread_area",
    "set_tid_address",
    "setuid",
    "setuid32",
    "setxattr",
    "shmat",
    "shmctl",
    "shmdt",
    "shmget",
    "shutdown",
    "sigaltstack",
    "signalfd",
    "signalfd4",
    "sigprocmask",
    "sigreturn",
    "socketcall",
    "socketpair",
    "splice",
    "stat",
    "stat64",
    "statfs",
    "statfs64",
    "statx",
    "symlink",
    "symlinkat",
    "sync",
    "sync_file_range",
    "syncfs",
    "sysinfo",
    "tee",
    "tgkill",
    "time",
    "timer_create",
    "timer_delete",
    "timer_getoverrun",
    "timer_gettime",
    "timer_gettime64",
    "timer_settime",
    "timer_settime64",
    "timerfd_create",
    "timerfd_gettime",
    "timerfd_gettime64",
    "timerfd_settime",
    "timerfd_settime64",
    "times",
    "tkill",
    "truncate",
    "truncate64",
    "ugetrlimit",
    "umask",
    "uname",
    "unlink",
    "unlinkat",
    "utime",
    "utimensat",
    "utimensat_time64",
    "utimes",
    "vfork",
    "vmsplice",
    "wait4",
    "waitid",
    "waitpid",
    "write",
    "writev",
];

const fn allow(names: &'static [&'static str], when: When) -> Rule {
    Rule {
        names,
        errno: None,
        args: &[],
        when,
    }
}

const fn allow_args(names: &'static [&'static str], args: &'static [Arg]) -> Rule {
    Rule {
        names,
        errno: None,
        args,
        when: When::Always,
    }
}

/// The profile's rules, in its order.
const RULES: &[Rule] = &[
    allow(ALLOWED, When::Always),
    // minKernel 4.8: every kernel this agent runs on.
    allow(
        &["process_vm_readv", "process_vm_writev", "ptrace"],
        When::Always,
    ),
    // Every socket family but AF_VSOCK.
    allow_args(&["socket"], &[(0, 40, "SCMP_CMP_NE")]),
    allow_args(&["personality"], &[(0, 0, "SCMP_CMP_EQ")]),
    allow_args(&["personality"], &[(0, 8, "SCMP_CMP_EQ")]),
    allow_args(&["personality"], &[(0, 131_072, "SCMP_CMP_EQ")]),
    allow_args(&["personality"], &[(0, 131_080, "SCMP_CMP_EQ")]),
    allow_args(&["personality"], &[(0, 4_294_967_295, "SCMP_CMP_EQ")]),
    allow(
        &["sync_file_range2", "swapcontext"],
        When::Arch(&["ppc64le"]),
    ),
    allow(
        &[
            "arm_fadvise64_64",
            "arm_sync_file_range",
            "sync_file_range2",
            "breakpoint",
            "cacheflush",
            "set_tls",
        ],
        When::Arch(&["arm", "arm64"]),
    ),
    allow(&["arch_prctl"], When::Arch(&["amd64", "x32"])),
    allow(&["modify_ldt"], When::Arch(&["amd64", "x32", "x86"])),
    allow(
        &[
            "s390_pci_mmio_read",
            "s390_pci_mmio_write",
            "s390_runtime_instr",
        ],
        When::Arch(&["s390", "s390x"]),
    ),
    allow(&["riscv_flush_icache"], When::Arch(&["riscv64"])),
    allow(&["open_by_handle_at"], When::Cap("CAP_DAC_READ_SEARCH")),
    allow(
        &[
            "bpf",
            "clone",
            "clone3",
            "fanotify_init",
            "fsconfig",
            "fsmount",
            "fsopen",
            "fspick",
            "lookup_dcookie",
            "mount",
            "mount_setattr",
            "move_mount",
            "open_tree",
            "perf_event_open",
            "quotactl",
            "quotactl_fd",
            "setdomainname",
            "sethostname",
            "setns",
            "syslog",
            "umount",
            "umount2",
            "unshare",
        ],
        When::Cap("CAP_SYS_ADMIN"),
    ),
    Rule {
        names: &["clone"],
        errno: None,
        args: &[(0, CLONE_NS_FLAGS, "SCMP_CMP_MASKED_EQ")],
        when: When::NotCapNotArch("CAP_SYS_ADMIN", &["s390", "s390x"]),
    },
    Rule {
        names: &["clone"],
        errno: None,
        args: &[(1, CLONE_NS_FLAGS, "SCMP_CMP_MASKED_EQ")],
        when: When::ArchNotCap(&["s390", "s390x"], "CAP_SYS_ADMIN"),
    },
    // ENOSYS, so that libcs fall back to clone.
    Rule {
        names: &["clone3"],
        errno: Some(38),
        args: &[],
        when: When::NotCap("CAP_SYS_ADMIN"),
    },
    allow(&["reboot"], When::Cap("CAP_SYS_BOOT")),
    allow(&["chroot"], When::Cap("CAP_SYS_CHROOT")),
    allow(
        &["delete_module", "init_module", "finit_module"],
        When::Cap("CAP_SYS_MODULE"),
    ),
    allow(&["acct"], When::Cap("CAP_SYS_PACCT")),
    allow(
        &[
            "kcmp",
            "pidfd_getfd",
            "process_madvise",
            "process_vm_readv",
            "process_vm_writev",
            "ptrace",
        ],
        When::Cap("CAP_SYS_PTRACE"),
    ),
    allow(&["iopl", "ioperm"], When::Cap("CAP_SYS_RAWIO")),
    allow(
        &["settimeofday", "stime", "clock_settime", "clock_settime64"],
        When::Cap("CAP_SYS_TIME"),
    ),
    allow(&["vhangup"], When::Cap("CAP_SYS_TTY_CONFIG")),
    allow(
        &[
            "get_mempolicy",
            "mbind",
            "set_mempolicy",
            "set_mempolicy_home_node",
        ],
        When::Cap("CAP_SYS_NICE"),
    ),
    allow(&["syslog"], When::Cap("CAP_SYSLOG")),
    allow(&["bpf"], When::Cap("CAP_BPF")),
    allow(&["perf_event_open"], When::Cap("CAP_PERFMON")),
];

/// This machine's architecture as moby names it, and the seccomp
/// architectures a filter covers for it (the profile's `archMap`).
fn arch() -> (&'static str, &'static [&'static str]) {
    match std::env::consts::ARCH {
        "x86_64" => (
            "amd64",
            &["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        ),
        "aarch64" => ("arm64", &["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"]),
        "riscv64" => ("riscv64", &["SCMP_ARCH_RISCV64"]),
        "s390x" => ("s390x", &["SCMP_ARCH_S390X", "SCMP_ARCH_S390"]),
        other => (other, &[]),
    }
}

/// The runtime default profile for a container with bounding set `caps`
/// (`CAP_…` names), as OCI `linux.seccomp`.
pub fn runtime_default(caps: &[String]) -> Value {
    let (arch, architectures) = arch();
    let has = |c: &str| caps.iter().any(|x| x == c);
    let on = |arches: &[&str]| arches.contains(&arch);
    let mut syscalls = Vec::new();
    for r in RULES {
        let applies = match r.when {
            When::Always => true,
            When::Cap(c) => has(c),
            When::NotCap(c) => !has(c),
            When::Arch(a) => on(a),
            When::NotCapNotArch(c, a) => !has(c) && !on(a),
            When::ArchNotCap(a, c) => on(a) && !has(c),
        };
        if !applies {
            continue;
        }
        let mut rule = json!({"names": r.names});
        match r.errno {
            None => rule["action"] = json!("SCMP_ACT_ALLOW"),
            Some(errno) => {
                rule["action"] = json!("SCMP_ACT_ERRNO");
                rule["errnoRet"] = json!(errno);
            }
        }
        if !r.args.is_empty() {
            rule["args"] = r
                .args
                .iter()
                .map(|(index, value, op)| json!({"index": index, "value": value, "op": op}))
                .collect();
        }
        syscalls.push(rule);
    }
    json!({
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "architectures": architectures,
        "syscalls": syscalls,
    })
}

/// Whether the resolved profile allows `name` unconditionally (no argument
/// check): for tests.
pub fn allows(profile: &Value, name: &str) -> bool {
    profile["syscalls"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|r| {
            r["action"] == "SCMP_ACT_ALLOW"
                && r.get("args").is_none()
                && r["names"]
                    .as_array()
                    .is_some_and(|n| n.iter().any(|x| x == name))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(list: &[&str]) -> Vec<String> {
        list.iter().map(|c| c.to_string()).collect()
    }

    /// The agent's capabilities get bpf() and perf_event_open() from their
    /// own rules, and nothing CAP_SYS_ADMIN would add; without CAP_BPF,
    /// bpf() is denied (the default action).
    #[test]
    fn the_agents_capabilities_resolve_to_bpf_and_perf_but_no_admin_calls() {
        let agent = runtime_default(&caps(&["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"]));
        assert_eq!(agent["defaultAction"], "SCMP_ACT_ERRNO");
        for call in ["bpf", "perf_event_open", "read", "socket", "clone"] {
            assert!(agent.to_string().contains(&format!("\"{call}\"")), "{call}");
        }
        assert!(allows(&agent, "bpf") && allows(&agent, "perf_event_open"));
        for call in ["mount", "setns", "unshare", "init_module", "reboot"] {
            assert!(!allows(&agent, call), "{call} allowed");
        }
        // clone only without namespace flags; clone3 fails with ENOSYS.
        let rules = agent["syscalls"].as_array().unwrap();
        assert!(rules
            .iter()
            .any(|r| r["names"][0] == "clone3" && r["errnoRet"] == 38));
        assert!(rules
            .iter()
            .any(|r| r["names"][0] == "clone" && r["args"][0]["op"] == "SCMP_CMP_MASKED_EQ"));

        let without_bpf = runtime_default(&caps(&["CAP_NET_ADMIN", "CAP_PERFMON"]));
        assert!(!allows(&without_bpf, "bpf"));
        let admin = runtime_default(&caps(&["CAP_SYS_ADMIN"]));
        assert!(allows(&admin, "bpf") && allows(&admin, "mount"));
    }
}

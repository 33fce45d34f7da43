//! What the kernel's verifier says of each program (root): instructions it
//! processed, the stack depth of each of its functions (the program's own
//! frame first, then each BPF call's, from the same statistics line), and
//! the program's size after translation and JIT. The split of
//! the datapath into modules, a new kernel or a new toolchain must not make
//! these grow unnoticed.
//!
//! `cargo run --release -p proxy-agent --example verifier_stats -- [OBJECT]`
//! loads the embedded object (or the eBPF object file given) with maps of
//! their default sizes, unpinned, and prints one line per program: the tc
//! and XDP programs and the cgroup socket hooks, with the socket hooks'
//! `HAS_SET_RETVAL` probed as the agent probes it (so the verifier sees the
//! program the agent would load on this kernel). Both builds of the tc
//! ingress programs are loaded where the kernel has `bpf_loop`; where it has
//! not, only the random-tries build (`*_rnd`) the agent loads there.
//!
//! Kernels before 5.16 keep no `verified_insns` in a program's info; there
//! the count comes from the verifier's own statistics line ("processed N
//! insns"), asked for at `BPF_LOG_STATS` level: aya loads with no log when
//! nothing fails and keeps no log of a load that succeeds, so this example
//! interposes libc's `syscall()` (which aya calls) and gives each
//! `BPF_PROG_LOAD` that carries no log a statistics-only log of its own. The
//! program loaded is unchanged: only the log attributes differ.
use aya::{
    programs::{Program, ProgramInfo, ProgramType},
    sys::{is_helper_supported, BpfHelper},
    EbpfLoader,
};
use proxy_agent::bpf::load_retrying;

fn main() -> anyhow::Result<()> {
    let file;
    let bytes: &[u8] = match std::env::args().nth(1) {
        Some(path) => {
            file = std::fs::read(&path)?;
            &file
        }
        None => proxy_agent::bpf::EBPF_OBJECT,
    };
    let set_retval = u32::from(
        is_helper_supported(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_set_retval)
            .unwrap_or(false),
    );
    let mut ebpf = EbpfLoader::new()
        .override_global("HAS_SET_RETVAL", &set_retval, true)
        .load(bytes)?;
    let mut names: Vec<String> = ebpf.programs().map(|(n, _)| n.to_owned()).collect();
    names.sort();
    println!(
        "kernel {} (bpf_set_retval in sock_addr programs: {})",
        kernel_release(),
        if set_retval == 1 { "yes" } else { "no" }
    );
    let search = proxy_agent::bpf::PortSearch::probe();
    let mut failed = 0;
    for name in names {
        if search.program(&name) != name {
            println!(
                "{name:<18} not loaded: needs bpf_loop (this kernel runs {})",
                search.program(&name)
            );
            continue;
        }
        let prog = ebpf.program_mut(&name).expect("listed");
        let loaded = match prog {
            Program::SchedClassifier(p) => {
                load_retrying(&name, || p.load()).and_then(|()| p.info())
            }
            Program::Xdp(p) => load_retrying(&name, || p.load()).and_then(|()| p.info()),
            Program::CgroupSockAddr(p) => load_retrying(&name, || p.load()).and_then(|()| p.info()),
            _ => {
                failed += 1;
                println!("{name:<18} not a program type this example loads");
                continue;
            }
        };
        match loaded {
            Ok(info) => print_info(&name, &info),
            Err(e) => {
                failed += 1;
                println!("{name:<18} REFUSED: {e:#}");
            }
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} program(s) refused by the verifier");
    }
    Ok(())
}

fn print_info(name: &str, info: &ProgramInfo) {
    let show = |v: Option<u32>| v.map_or_else(|| "?".to_owned(), |v| v.to_string());
    let logged = stats_log::take_processed();
    let stack = stats_log::take_stack_depth().unwrap_or_else(|| "?".to_owned());
    println!(
        "{name:<18} verified_insns {:>6}  (log: processed {:>6})  xlated {:>6} B  jited {:>6} B  stack {stack}",
        show(info.verified_instruction_count()),
        show(logged),
        show(info.size_translated()),
        info.size_jitted(),
    );
}

/// The verifier's "processed N insns" of the last successful
/// `BPF_PROG_LOAD` made without a log of its own (see the module comment).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod stats_log {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    const SYS_BPF: i64 = 321;
    const BPF_PROG_LOAD: i64 = 5;
    const BPF_LOG_STATS: u32 = 4;
    const LOG_LEN: usize = 64 * 1024;
    /// `union bpf_attr` for BPF_PROG_LOAD: `log_level` at 24, `log_size`
    /// at 28, `log_buf` at 32; aya passes 160 bytes or fewer.
    const ATTR_MAX: usize = 256;
    const NONE: u32 = u32::MAX;

    static BUSY: AtomicBool = AtomicBool::new(false);
    static PROCESSED: AtomicU32 = AtomicU32::new(NONE);
    /// The log's "stack depth 96+0+48" (its part after the key), and its
    /// length (0: none); written under BUSY, read once the load returned.
    const STACK_MAX: usize = 256;
    static STACK_LEN: AtomicU32 = AtomicU32::new(0);
    static mut STACK: [u8; STACK_MAX] = [0; STACK_MAX];
    static mut LOG: [u8; LOG_LEN] = [0; LOG_LEN];
    static mut ATTR: [u8; ATTR_MAX] = [0; ATTR_MAX];

    pub fn take_processed() -> Option<u32> {
        match PROCESSED.swap(NONE, Ordering::SeqCst) {
            NONE => None,
            n => Some(n),
        }
    }

    /// The stack depth of each function of the last program loaded, as the
    /// verifier logged it ("96+0+48": the program's frame, then each BPF
    /// call's).
    pub fn take_stack_depth() -> Option<String> {
        let len = STACK_LEN.swap(0, Ordering::SeqCst) as usize;
        if len == 0 {
            return None;
        }
        // SAFETY: written before the load returned; no load is running.
        let stack = unsafe { &*core::ptr::addr_of!(STACK) };
        Some(String::from_utf8_lossy(&stack[..len]).into_owned())
    }

    unsafe fn raw(n: i64, a: [i64; 6]) -> i64 {
        let ret: i64;
        // SAFETY: the x86_64 Linux syscall convention; the caller's
        // arguments, passed through unchanged.
        unsafe {
            core::arch::asm!(
                "syscall",
                inlateout("rax") n => ret,
                in("rdi") a[0], in("rsi") a[1], in("rdx") a[2],
                in("r10") a[3], in("r8") a[4], in("r9") a[5],
                lateout("rcx") _, lateout("r11") _,
                options(nostack)
            );
        }
        ret
    }

    /// libc's `syscall(long n, ...)`: on x86_64 its integer arguments sit
    /// where a fixed seven-argument function reads them (a seventh slot the
    /// caller did not fill is read but unused by the kernel).
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn syscall(
        n: i64,
        a0: i64,
        a1: i64,
        a2: i64,
        a3: i64,
        a4: i64,
        a5: i64,
    ) -> i64 {
        let mut args = [a0, a1, a2, a3, a4, a5];
        let mut ours = false;
        if n == SYS_BPF
            && a0 == BPF_PROG_LOAD
            && (a2 as usize) <= ATTR_MAX
            && a2 >= 40
            && !BUSY.swap(true, Ordering::SeqCst)
        {
            // SAFETY: the caller's attribute of `a2` bytes, copied into our
            // buffer (BUSY: one user at a time).
            unsafe {
                let attr = &mut *core::ptr::addr_of_mut!(ATTR);
                core::ptr::copy_nonoverlapping(a1 as *const u8, attr.as_mut_ptr(), a2 as usize);
                let level = u32::from_ne_bytes(attr[24..28].try_into().unwrap());
                if level == 0 {
                    let log = &mut *core::ptr::addr_of_mut!(LOG);
                    log[0] = 0;
                    attr[24..28].copy_from_slice(&BPF_LOG_STATS.to_ne_bytes());
                    attr[28..32].copy_from_slice(&(LOG_LEN as u32).to_ne_bytes());
                    attr[32..40].copy_from_slice(&(log.as_mut_ptr() as u64).to_ne_bytes());
                    args[1] = attr.as_ptr() as i64;
                    ours = true;
                } else {
                    BUSY.store(false, Ordering::SeqCst);
                }
            }
        }
        // SAFETY: the caller's system call, with our attribute copy if ours.
        let ret = unsafe { raw(n, args) };
        if ours {
            if ret >= 0 {
                // SAFETY: the kernel wrote a NUL-terminated log into LOG.
                let log = unsafe { &*core::ptr::addr_of!(LOG) };
                PROCESSED.store(parse(log).unwrap_or(NONE), Ordering::SeqCst);
                // SAFETY: our buffer (BUSY: one user at a time).
                let stack = unsafe { &mut *core::ptr::addr_of_mut!(STACK) };
                STACK_LEN.store(stack_depth(log, stack) as u32, Ordering::SeqCst);
            }
            BUSY.store(false, Ordering::SeqCst);
        }
        if ret < 0 && ret > -4096 {
            // SAFETY: this thread's errno.
            unsafe { *libc::__errno_location() = -ret as i32 };
            return -1;
        }
        ret
    }

    /// "stack depth 96+0+48" in a NUL-terminated log: its depths copied into
    /// `out`; their length (0 when there is none).
    fn stack_depth(log: &[u8], out: &mut [u8]) -> usize {
        const KEY: &[u8] = b"stack depth ";
        let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
        let log = &log[..end];
        let Some(i) = log.windows(KEY.len()).position(|w| w == KEY) else {
            return 0;
        };
        let depths = log[i + KEY.len()..]
            .iter()
            .take_while(|b| b.is_ascii_digit() || **b == b'+')
            .take(out.len());
        let mut n = 0;
        for (o, b) in out.iter_mut().zip(depths) {
            *o = *b;
            n += 1;
        }
        n
    }

    /// "processed 1234 insns" in a NUL-terminated log.
    fn parse(log: &[u8]) -> Option<u32> {
        const KEY: &[u8] = b"processed ";
        let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
        let log = &log[..end];
        let i = log.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
        let mut digits = log[i..].iter().take_while(|b| b.is_ascii_digit());
        // No allocation here: this runs inside the interposed syscall().
        digits
            .try_fold(0u32, |n, d| {
                n.checked_mul(10)?.checked_add(u32::from(d - b'0'))
            })
            .filter(|_| log.get(i).is_some_and(u8::is_ascii_digit))
    }
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
mod stats_log {
    pub fn take_processed() -> Option<u32> {
        None
    }

    pub fn take_stack_depth() -> Option<String> {
        None
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".to_owned())
}

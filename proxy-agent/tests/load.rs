//! Loading the object (root) in a process that receives signals. The
//! verifier returns `EAGAIN` when a signal is pending while it works (it
//! checks between instructions), so a load that does not retry fails with
//! nothing wrong with the program: CI saw `pod_ingress` refused that way.
//! Run with `cargo xtask test` (`#[ignore]`d under a plain `cargo test`).

use std::{
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

use aya::{programs::SchedClassifier, EbpfLoader};
use proxy_agent::bpf::{self, LOAD_ATTEMPTS};

static HANDLED: AtomicUsize = AtomicUsize::new(0);

extern "C" fn count_signal(_: libc::c_int) {
    HANDLED.fetch_add(1, Ordering::Relaxed);
}

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn program_load_survives_signals_during_verification() {
    // A handled SIGUSR1 (its default action would end the process), sent
    // to the loading thread only.
    // SAFETY: a zeroed sigaction with a handler that only bumps an atomic
    // is a valid argument; the old action is not asked for.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = count_signal as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
    }
    // The object with its maps unpinned, as `examples/verifier_stats.rs`
    // loads it; pod_ingress is the largest program.
    let mut ebpf = EbpfLoader::new()
        .override_global("HOST_NETNS_COOKIE", &0u64, true)
        .override_global("HAS_SET_RETVAL", &0u32, true)
        .load(bpf::EBPF_OBJECT)
        .expect("object");
    // The build of pod_ingress this kernel runs (the agent's choice).
    let name = bpf::PortSearch::probe().program(bpf::POD_INGRESS_PROGRAM);
    let prog: &mut SchedClassifier = ebpf
        .program_mut(name)
        .expect("pod_ingress")
        .try_into()
        .expect("a tc program");
    // SAFETY: pthread_self has no preconditions.
    let me = unsafe { libc::pthread_self() } as usize;
    // One signal every 5 ms from 2 ms on: verifying pod_ingress takes tens
    // of milliseconds on any kernel (seconds under emulation), so each signal
    // ends one BPF_PROG_LOAD. aya makes two per attempt (the second asking
    // for a log), so these signals use up all attempts but the last; without
    // retries the second signal already ends the load.
    let signals = 2 * (LOAD_ATTEMPTS - 1);
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(2));
        for _ in 0..signals {
            // SAFETY: the loading thread outlives the sender (joined below).
            unsafe { libc::pthread_kill(me as libc::pthread_t, libc::SIGUSR1) };
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let loaded = bpf::load_retrying(name, || prog.load());
    sender.join().expect("signal sender");
    assert!(
        HANDLED.load(Ordering::Relaxed) > 0,
        "no signal reached the loading thread"
    );
    if let Err(e) = loaded {
        panic!("pod_ingress refused under signals: {e}");
    }
}

//! The agent's allocator: mimalloc, set to give freed pages back at once.
//!
//! Measured at 50,000 Services with two endpoints each (`cargo xtask bench
//! --n 50000 --modes proxy-tc --family ipv4 --rounds 1`, issue 13), program
//! from empty and agent RSS:
//!
//! - glibc's malloc (the bench's build): 1.09 s, 178 MiB even after
//!   `malloc_trim`, the objects kept being spread over pages the parse's
//!   garbage shared;
//! - musl's (the image's static build): 2.65 s, 146 MiB. One lock serves
//!   every thread, and the manifests are parsed on up to four;
//! - mimalloc, purging freed pages at once: 1.02–1.22 s and 146–148 MiB
//!   (glibc build), 1.18–1.23 s and 145 MiB (musl build). With its default
//!   10 ms purge delay it kept 183–222 MiB: a thread that goes idle never
//!   purges, and the syncs run on whichever tokio worker is free, so
//!   [`release_freed_memory`] (this thread's heap) cannot reach it. A
//!   longer delay programs faster (`control_plane_cost 50000`, 1 s delay:
//!   793–801 ms against 832–1,090) but peaks higher (194 MiB against 128
//!   before the pages are given back), and a memory limit sees the peak.
//!
//! The binary sets it as the global allocator and calls [`configure`] first
//! thing; the library's tests keep the system allocator (the memory test
//! counts through it), where [`release_freed_memory`] does nothing.

pub use mimalloc::MiMalloc as Allocator;

/// mimalloc's `mi_option_purge_delay` (`mimalloc.h`, v2 and v3): the
/// milliseconds a freed page waits before it is given back.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Makes the allocator give freed pages back as soon as they are free.
/// Called before the agent starts its threads.
pub fn configure() {
    // SAFETY: sets one of the allocator's options; mimalloc reads them
    // atomically, from any thread.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
}

/// Gives the free pages this thread's heap still holds back to the system:
/// after a sync that built and dropped much (the first: every object read,
/// the maps repacked), so that the agent's RSS is what it keeps.
pub fn release_freed_memory() {
    // SAFETY: a plain call into the allocator, which collects its own free
    // lists under its own locks; any thread may call it at any time.
    unsafe { libmimalloc_sys::mi_collect(true) };
}

//! Map operations in batches (Linux 5.6, hash and LRU hash maps): a few
//! thousand entries per syscall.
//!
//! - Whole-map reads (`BPF_MAP_LOOKUP_BATCH`), where aya's iterator takes
//!   two syscalls per entry (next key, then lookup). The writer reads the
//!   session-affinity maps so when a sync prunes them: 65,536 entries at
//!   most, 131,072 syscalls the other way.
//! - Writes (`BPF_MAP_UPDATE_BATCH`, [`update_prefix`]) and deletes
//!   (`BPF_MAP_DELETE_BATCH`, [`delete_prefix`]): the kernel takes the
//!   entries one after the other, in order, as that many single updates or
//!   deletes would, and stops at the first that fails (for a delete, also
//!   at a key that is not there: `ENOENT`).
//!
//! A kernel or map type without batch operations answers `EINVAL` or
//! `ENOTSUPP`; the caller then goes one entry at a time ([`entries`] does
//! both for reads).
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use aya::maps::{HashMap, IterableMap, MapData, MapError};
use aya::Pod;

/// `BPF_MAP_LOOKUP_BATCH` (uapi `enum bpf_cmd`).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// `BPF_MAP_UPDATE_BATCH` (uapi `enum bpf_cmd`).
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
/// `BPF_MAP_DELETE_BATCH` (uapi `enum bpf_cmd`).
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;
/// The kernel's `ENOTSUPP` (not in libc: it never reaches user space
/// through the C library's names, but `bpf()` returns it).
const ENOTSUPP: i32 = 524;
/// Entries asked for per call.
const BATCH: u32 = 4_096;

/// `union bpf_attr`'s `batch` member.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// One `bpf()` batch command `cmd` on `attr`.
///
/// # Safety
/// The pointers in `attr` must be valid for what `cmd` reads and writes
/// through them, for the call.
unsafe fn bpf_batch(cmd: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a live `bpf_attr` batch member of the size given;
    // the caller vouches for the pointers in it.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            std::mem::size_of::<BatchAttr>(),
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Every entry of hash map `fd` in batches, or `None` where the kernel has
/// no batch operations for it.
pub fn lookup_all<K: Pod, V: Pod>(fd: BorrowedFd<'_>) -> io::Result<Option<Vec<(K, V)>>> {
    let mut out = Vec::new();
    // A hash map's batch token is a bucket index (u32).
    let mut token: u32 = 0;
    let mut first = true;
    let mut room = BATCH;
    let mut keys: Vec<K> = zeroed(room);
    let mut values: Vec<V> = zeroed(room);
    loop {
        let mut next: u32 = 0;
        let mut attr = BatchAttr {
            in_batch: if first {
                0
            } else {
                std::ptr::from_ref(&token) as u64
            },
            out_batch: std::ptr::from_mut(&mut next) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: room,
            map_fd: fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        // SAFETY: the attribute points at buffers of `room` keys and values
        // and at two u32 tokens, all alive for the call; the kernel writes
        // at most `count` entries.
        let err = unsafe { bpf_batch(BPF_MAP_LOOKUP_BATCH, &mut attr) }.err();
        match err.as_ref().and_then(io::Error::raw_os_error) {
            None | Some(libc::ENOENT) => {}
            // A bucket holds more entries than there was room for.
            Some(libc::ENOSPC) if room < 1 << 20 => {
                room *= 2;
                keys = zeroed(room);
                values = zeroed(room);
                continue;
            }
            Some(libc::EINVAL | ENOTSUPP | libc::ENOSYS) if first => return Ok(None),
            Some(_) => return Err(err.expect("an error")),
        }
        let n = (attr.count as usize).min(room as usize);
        out.extend(keys.iter().copied().zip(values.iter().copied()).take(n));
        if err.is_some() {
            // ENOENT: the last buckets were read.
            return Ok(Some(out));
        }
        token = next;
        first = false;
    }
}

/// Writes `entries` (flags `BPF_ANY`) to hash map `fd`, in order, in batches
/// of [`BATCH`]. Returns how many were written, all of them unless the
/// kernel stopped, and then its error: the entries before the count are
/// written, the one at it and those after it are not. (An error the kernel
/// met before writing anything counts none, even if its batch had started
/// further on: rewriting an entry is harmless.)
pub fn update_prefix<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    entries: &[(K, V)],
) -> (usize, Option<io::Error>) {
    in_chunks(entries, |chunk| {
        let keys: Vec<K> = chunk.iter().map(|(k, _)| *k).collect();
        let values: Vec<V> = chunk.iter().map(|(_, v)| *v).collect();
        // SAFETY: `count` keys and values, alive for the call.
        unsafe {
            prefix(
                BPF_MAP_UPDATE_BATCH,
                fd,
                keys.as_ptr() as u64,
                values.as_ptr() as u64,
                chunk.len(),
            )
        }
    })
}

/// Deletes `keys` from hash map `fd`, in order, in batches of [`BATCH`], as
/// [`update_prefix`] writes: returns how many were deleted (the first ones)
/// and the error of the one the kernel stopped at. A key that is not there
/// stops the kernel too (`ENOENT`), though deleting it was a no-op: the
/// caller tells that apart and goes on after it.
pub fn delete_prefix<K: Pod>(fd: BorrowedFd<'_>, keys: &[K]) -> (usize, Option<io::Error>) {
    in_chunks(keys, |chunk| {
        // SAFETY: `count` keys, alive for the call (a delete reads no
        // values).
        unsafe {
            prefix(
                BPF_MAP_DELETE_BATCH,
                fd,
                chunk.as_ptr() as u64,
                0,
                chunk.len(),
            )
        }
    })
}

/// `batch` over `items` in chunks of [`BATCH`], in order, stopping at the
/// first chunk the kernel stopped in: how many were taken, and its error.
fn in_chunks<T>(
    items: &[T],
    mut batch: impl FnMut(&[T]) -> (usize, Option<io::Error>),
) -> (usize, Option<io::Error>) {
    let mut done = 0;
    for chunk in items.chunks(BATCH as usize) {
        let (n, err) = batch(chunk);
        done += n;
        if err.is_some() {
            return (done, err);
        }
    }
    (done, None)
}

/// One update or delete batch `cmd` of `count` entries (`keys`, `values`:
/// user pointers to them); returns how many the kernel took and its error.
///
/// # Safety
/// `keys` (and `values`, for an update) must point at `count` keys (values)
/// of the map's sizes, alive for the call; the kernel only reads them.
unsafe fn prefix(
    cmd: libc::c_long,
    fd: BorrowedFd<'_>,
    keys: u64,
    values: u64,
    count: usize,
) -> (usize, Option<io::Error>) {
    let mut attr = BatchAttr {
        keys,
        values,
        count: count as u32,
        map_fd: fd.as_raw_fd() as u32,
        ..BatchAttr::default()
    };
    // SAFETY: the caller vouches for the keys and values; the kernel writes
    // only `count`.
    match unsafe { bpf_batch(cmd, &mut attr) } {
        Ok(()) => (count, None),
        Err(err) => {
            // Failing at an entry, the kernel sets `count` to the entries
            // it took before it; failing before the first (no batch
            // operation, a bad fd, no memory for the copies), it leaves
            // `count` as it was: nothing taken.
            let taken = attr.count as usize;
            (if taken < count { taken } else { 0 }, Some(err))
        }
    }
}

/// Whether `e`, from a batch operation that did nothing, says the kernel or
/// the map has no batch operations.
pub fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL | ENOTSUPP | libc::ENOSYS)
    )
}

/// `n` values of plain data, zeroed: buffers the kernel writes into.
fn zeroed<T: Pod>(n: u32) -> Vec<T> {
    // SAFETY: `T` is plain data (`aya::Pod`), for which zero bytes are a value.
    (0..n).map(|_| unsafe { std::mem::zeroed() }).collect()
}

/// Every entry of `map`: in batches where the kernel can, else with aya's
/// iterator (which skips an entry that vanishes mid-walk, an LRU eviction;
/// any other error fails the read rather than shorten it).
pub fn entries<K: Pod, V: Pod>(map: &HashMap<MapData, K, V>) -> Result<Vec<(K, V)>, MapError> {
    let fd = map.map().fd().as_fd();
    match lookup_all::<K, V>(fd) {
        Ok(Some(all)) => Ok(all),
        Ok(None) => map.iter().collect(),
        Err(io_error) => Err(MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_lookup_batch",
            io_error,
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error met before the kernel writes anything (here: the fd is no
    /// map; unprivileged, no permission) leaves the attribute's count as it
    /// was: nothing is reported written, whatever the batch's size.
    #[test]
    fn an_error_before_the_first_entry_reports_none_written() {
        let not_a_map = std::fs::File::open("/dev/null").expect("/dev/null");
        let entries: Vec<(u32, u64)> = (0..3).map(|i| (i, u64::from(i))).collect();
        let (written, err) = update_prefix(not_a_map.as_fd(), &entries);
        assert_eq!(written, 0);
        assert!(err.is_some());
        let keys: Vec<u32> = (0..3).collect();
        let (deleted, err) = delete_prefix(not_a_map.as_fd(), &keys);
        assert_eq!(deleted, 0);
        assert!(err.is_some());
    }
}

//! Zeroed stack values without `memset`.
//!
//! LLVM compiles the zeroing of a struct (`core::mem::zeroed`, a derived
//! `Default`) of more than a few bytes to a call of `memset`, and in BPF
//! `memset` is a function of its own that stores one byte at a time: the
//! 52 bytes of FIB parameters cost a call and about 260 instructions on
//! every translated packet. Here the zeroes are 4-byte stores, unrolled.

use core::mem::{align_of, size_of, MaybeUninit};

/// Zeroes `slot` with 4-byte stores and returns it initialised. `T` must be
/// plain integers (all-zero valid), 4-byte aligned, its size a multiple of
/// 4 (checked at compile time).
///
/// Used in place (`let mut s = MaybeUninit::uninit(); let v = zeroed(&mut s);`):
/// returned by value, the zeroed copy would be zeroed again with `memset`.
#[inline(always)]
pub fn zeroed<T: Copy>(slot: &mut MaybeUninit<T>) -> &mut T {
    const {
        assert!(size_of::<T>().is_multiple_of(4) && align_of::<T>() >= 4);
    }
    let words = slot.as_mut_ptr() as *mut u32;
    let mut i = 0;
    while i < size_of::<T>() / 4 {
        // SAFETY: `i` words lie within `slot` (size a multiple of 4, aligned
        // to 4). Volatile: LLVM would merge plain stores back into `memset`.
        unsafe { core::ptr::write_volatile(words.add(i), 0) };
        i += 1;
    }
    // SAFETY: every byte was written; `T` is plain integers, all-zero valid.
    unsafe { slot.assume_init_mut() }
}

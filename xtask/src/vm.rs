//! `cargo xtask test --kernel <name>`: the packet tests (and a one-node lab
//! smoke, and the SCTP lab tests) inside a qemu virtual machine booting one
//! of Debian's kernels, since verifiers and attach points differ between
//! kernels (and this machine's kernel has no SCTP).
//!
//! Kernels come from Debian's own packages, fetched with an apt configuration
//! of this runner's own under `target/kernels/apt` (its own `sources.list`,
//! lists and archive directories): the machine's apt sources are never
//! changed. The guest boots a busybox initramfs holding the modules it needs
//! (virtio, 9p, overlay, veth, sch_ingress, cls_bpf), mounts the host's root
//! filesystem read-only over 9p with a tmpfs overlay on top, chroots into it
//! and runs a script the host wrote; the script prints one result line per
//! step on the serial console, which the runner parses. qemu runs under TCG
//! (software emulation) unless `KPR_VM_ACCEL=kvm`; every wait is bounded and
//! the VM is killed when the runner stops.
//!
//! | module | job |
//! |---|---|
//! | `kernels` | the matrix's kernels, fetched from Debian's packages |
//! | `initramfs` | the guest's busybox initramfs and its modules |
//! | `qemu` | booting a kernel and running one script |
//! | `plan` | the test plan per kernel, its script and its results |

mod initramfs;
mod kernels;
mod plan;
mod qemu;

pub use initramfs::{insmod_lines, modinfo_depends, module_order, GuestModule};
pub use kernels::{fetch, spec, Fetched, KernelSpec, MATRIX};
pub use plan::{fetch_matrix, parse_step, test_binary, test_kernel, test_matrix};
pub use qemu::{parse_done, run_script, VmOutput};

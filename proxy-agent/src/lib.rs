//! The agent of the eBPF kube-proxy replacement.
//!
//! Sources of desired state (`manifests`) feed a pure model ([`model`]) whose
//! output the [`dataplane::Writer`] diffs against what is already programmed and
//! writes, in make-before-break order, through a [`dataplane::Dataplane`]: the
//! BPF maps ([`bpf`]) or an in-memory one for tests.
pub mod agent;
pub mod bpf;
pub mod dataplane;
pub mod inspect;
pub mod manifests;
pub mod model;
pub mod source;

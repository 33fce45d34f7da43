//! The agent of the eBPF kube-proxy replacement.
//!
//! Sources of desired state ([`sources`]: manifests, the Kubernetes API) read the
//! [`objects`] that feed a pure model ([`model`]), whose
//! output the [`dataplane::Writer`] diffs against what is already programmed and
//! writes, in make-before-break order, through a [`dataplane::Dataplane`]: the
//! BPF maps ([`bpf`]) or an in-memory one for tests.
pub mod agent;
pub mod alloc;
pub mod bpf;
pub mod cli;
pub mod config;
pub mod config_reference;
pub mod dataplane;
pub mod host;
pub mod inspect;
pub mod metrics;
pub mod model;
pub mod objects;
pub mod parallel;
pub mod serve;
pub mod sources;
pub mod vec_set;

//! Test support shared by `proxy-agent`'s integration tests and examples, a
//! crate of its own (a dev-dependency of `proxy-agent`) so that each helper
//! is compiled, linted and documented once instead of being included into
//! every test binary that needs it.
//!
//! - [`kit`]: the packet-test kit (root, a kernel with BPF): frame builders,
//!   a checksum checker independent of the datapath, the harness that loads
//!   the real eBPF object, fills its maps with the agent's writer and runs
//!   its programs with `BPF_PROG_TEST_RUN` in a network namespace of its
//!   own, and packet cases as tables run through every program. The packet
//!   tests, the attach tests and the `prog_cost` example use it.
//! - [`fuzz`]: a seeded, bounded input fuzzer (a reproducible generator,
//!   tokens that break parsers, mutations of text and of JSON values) for
//!   the property tests of the configuration, the manifests and the model.
//! - [`fake_apiserver`]: a scripted Kubernetes API server (list and watch
//!   of Services, EndpointSlices and Nodes on 127.0.0.1) for the cases of
//!   the Kubernetes source a real API server cannot produce on demand.
pub mod fake_apiserver;
pub mod fuzz;
pub mod kit;

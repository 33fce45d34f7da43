//! The packet-test kit of `proxy-agent`'s `tests/datapath/`, `tests/attach.rs`
//! and `examples/prog_cost.rs`: frame builders, the independent checksum
//! checker, the harness (a namespace and pin dir of its own, the real object,
//! the agent's writer, `BPF_PROG_TEST_RUN` of tc and XDP programs) and packet
//! cases as a table.

pub mod case;
pub mod check;
pub mod ct;
pub mod frame;
pub mod harness;

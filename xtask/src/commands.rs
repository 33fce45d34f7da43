//! The subcommands of `cargo xtask` that are more than a call into the
//! library, one file each; `main.rs` parses the command line and
//! dispatches.

pub mod demo;
pub mod lab;
pub mod test;

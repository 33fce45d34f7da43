//! `cargo xtask`: setup, build-ebpf, lab, demo, test. This file parses the
//! command line and dispatches; `lab`, `demo` and `test` are in
//! `commands/`, one file each.

mod commands;

use anyhow::Result;
use clap::{Parser, Subcommand};
use commands::demo::demo;
use commands::lab::{lab_cmd, LabCmd};
use commands::test::test;
use xtask::setup;

#[derive(Parser)]
#[command(about = "Developer and CI tasks of the eBPF kube-proxy replacement")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what building and testing need, and fetch the kernel
    /// matrix's Debian kernels into target/kernels (idempotent).
    Setup,
    /// Build proxy-agent (and with it the eBPF object); print the object's path.
    BuildEbpf,
    /// Start, inspect or stop labs (network namespaces under /run/kpr-lab).
    Lab {
        #[command(subcommand)]
        cmd: LabCmd,
    },
    /// Start a lab from deploy/examples, show how traffic spreads, delete a
    /// pod per service, show it again, tear down.
    Demo {
        /// Requests per frontend and round.
        #[arg(long, default_value_t = 1000)]
        requests: usize,
    },
    /// rustfmt's check and clippy (warnings as errors) on every crate, the
    /// eBPF one for its own target.
    Lint,
    /// Setup, lint, build (the agent and its image), then `cargo test
    /// --workspace --exclude proxy-ebpf -- --include-ignored --test-threads=2`
    /// as root (the eBPF crate only builds for the bpf target); without
    /// arguments, then the lab tests of RUNC_TESTS again with the agent inside
    /// the image under runc. Arguments go to `cargo test`; those after a
    /// second `--` go to the test binaries.
    #[command(after_help = TEST_HELP)]
    Test {
        /// Only the kernel tier, in a VM: 5.10, 6.1, 6.12 (Debian's), host
        /// (the machine's), or matrix (every kernel, as a full run ends).
        #[arg(long, value_name = "KERNEL")]
        kernel: Option<String>,
        /// Arguments of `cargo test` (a test binary, a filter); those after a
        /// second `--` go to the test binaries.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The agent's OCI image (a static agent with the eBPF object embedded)
    /// as a layout under target/image/proxy-agent and a tarball
    /// target/image/proxy-agent.tar; reproducible (same commit, same digest).
    Image {
        /// The tag the layout's index and the tarball name.
        #[arg(long, default_value = "latest")]
        tag: String,
    },
    /// Benchmarks side by side with kube-proxy's iptables and nftables layouts.
    Bench(xtask::bench::BenchArgs),
    /// Regenerate the pages generated from the code: docs/configuration.md
    /// from the agent's config types (a test fails when it is stale).
    Docs,
}

/// What `cargo xtask test --help` adds below the options: the environment
/// variables of docs/testing.md and docs/kernels.md a user sets
/// (`xtask/tests/cli.rs` checks that every documented one is here).
const TEST_HELP: &str = "\
Environment:
  KPR_SKIP_VMS=1             A full run leaves out the kernel matrix (VMs).
  KPR_LAB_CONTROL_PLANE=1    Lab tests against a real control plane (etcd,
                             kube-apiserver, kube-controller-manager) instead
                             of the lab playing the API server.
  KPR_CONTROL_PLANE_ALL=1    The full run's control-plane pass runs every lab
                             test binary, not one row per conformance family.
  KPR_API_SCALE_SERVICES=N   Services of lab_scale's real-API-server test
                             (default 10,000).
  KPR_LAB_AGENT=runc         Lab agents from the image under runc
  KPR_LAB_IMAGE=<dir>        (the image: default target/image/proxy-agent).
  KPR_LAB_START_TIMEOUT=<s>  Seconds a lab waits for its agents' first sync.
  KPR_LAB_DIAG=1             lab_load prints the agent's log and maps after
                             every test, not only on failure.
  KPR_REQUIRE_SCTP=1         SCTP tests fail, not skip, without the sctp module.
  KPR_FUZZ_FRAMES=N          Frames per program of the datapath fuzz test
  KPR_FUZZ_SEED=<seed>       (default 1,500), and the seed to replay.
  KPR_VM_ACCEL=kvm           VMs with KVM (default: TCG software emulation).
  KPR_VM_PACKET_KERNELS=l    Kernels (a list: 6.1,5.10) of the VMs' packet tests,
  KPR_VM_LAB_KERNELS=l       of their lab smoke,
  KPR_VM_SCTP_KERNELS=l      and of their SCTP tests (also `all` or `none`).
  KPR_VM_PACKET_FILTER=f     Packet tests of the VMs by name.

Examples:
  cargo xtask test                              everything (as CI)
  cargo xtask test --test lab                   one test binary
  cargo xtask test --test lab -- s1_            and a filter of its tests
  cargo xtask test --kernel 6.1                 one kernel in a VM

See docs/testing.md.";

fn main() -> Result<()> {
    // `test` forwards its arguments verbatim (clap would swallow a leading `--`).
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("test")
        && !matches!(argv.get(2).map(String::as_str), Some("-h" | "--help"))
    {
        return test(argv[2..].to_vec());
    }
    match Cli::parse().cmd {
        Cmd::Setup => {
            setup::setup()?;
            xtask::vm::fetch_matrix()
        }
        Cmd::BuildEbpf => {
            let obj = setup::build_ebpf()?;
            println!("{}", obj.display());
            Ok(())
        }
        Cmd::Lab { cmd } => lab_cmd(cmd),
        Cmd::Demo { requests } => demo(requests),
        Cmd::Lint => {
            setup::ensure_setup()?;
            xtask::lint::lint()
        }
        Cmd::Test { kernel, mut args } => {
            if let Some(k) = kernel {
                args.splice(0..0, ["--kernel".to_string(), k]);
            }
            test(args)
        }
        Cmd::Image { tag } => image(tag),
        Cmd::Docs => {
            let page = setup::workspace_root().join("docs/configuration.md");
            setup::run_visible(
                setup::cargo()
                    .args([
                        "run",
                        "-q",
                        "-p",
                        "proxy-agent",
                        "--example",
                        "config_reference",
                        "--",
                    ])
                    .arg(&page),
            )?;
            println!("wrote {}", page.display());
            Ok(())
        }
        Cmd::Bench(args) => {
            // The iptables/nftables layouts and the lab need setup's packages;
            // redrawing an earlier run's report needs nothing.
            if args.replot.is_none() {
                setup::ensure_setup()?;
            }
            xtask::bench::run(args)
        }
    }
}

fn image(tag: String) -> Result<()> {
    let img = xtask::image::build(&xtask::image::ImageOptions {
        tag,
        ..Default::default()
    })?;
    println!("image {} (commit {})", img.digest, img.commit);
    println!(
        "layer: {} bytes gzipped, {} bytes uncompressed",
        img.compressed_size, img.uncompressed_size
    );
    println!("OCI layout: {}", img.layout.display());
    println!(
        "tarball (docker load, ctr images import): {}",
        img.tarball.display()
    );
    println!(
        "push: skopeo copy oci:{} docker://REGISTRY/proxy-agent:{}",
        img.oci_ref(),
        img.tag
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::commands::test::BESIDE_THE_MATRIX;

    /// The tests a full run moves beside the kernel matrix exist under
    /// those names (a renamed one would run in the main pass instead), and
    /// they are all of their binary's.
    #[test]
    fn the_tests_beside_the_matrix_exist() {
        let (binary, tests) = BESIDE_THE_MATRIX;
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests")
            .join(format!("{binary}.rs"));
        let source = std::fs::read_to_string(&path).unwrap();
        for t in tests {
            assert!(
                source.contains(&format!("fn {t}()")),
                "{} has no test {t}",
                path.display()
            );
        }
        let all = source.matches("#[test]").count();
        assert_eq!(
            all,
            tests.len(),
            "every test of {binary} runs beside the matrix"
        );
    }
}

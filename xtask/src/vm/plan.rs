//! The test plan: which test binaries run on which kernel (packet tests,
//! the lab smoke, the SCTP lab tests), the script each VM runs, and its
//! result lines read back into a pass or a failure per step.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::initramfs::*;
use super::kernels::*;
use super::qemu::*;
use crate::setup::{run_visible, target_dir};

/// The test binary `<name>` of `package`, built with the package selection
/// of `cargo xtask test`'s own pass (`--workspace --exclude proxy-ebpf`):
/// another selection unifies the dependencies' features differently and
/// rebuilds them (about 2 minutes here) instead of reusing that pass's build.
pub fn test_binary(package: &str, test: &str) -> Result<PathBuf> {
    let out = crate::setup::cargo()
        .args(["test", "--workspace", "--exclude", "proxy-ebpf"])
        .args(["--test", test, "--no-run", "--message-format", "json"])
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo test --no-run")?;
    if !out.status.success() {
        bail!("cargo test --test {test} --no-run failed");
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"]["name"] == test)
        .filter(|v| {
            v["package_id"].as_str().is_some_and(|id| {
                // `path+file:///…/proxy-agent#0.1.0` (cargo ≥ 1.77) or
                // `proxy-agent 0.1.0 (path+file:///…)`.
                id.contains(&format!("/{package}#"))
                    || id.contains(&format!("#{package}@"))
                    || id.starts_with(&format!("{package} "))
            })
        })
        .find_map(|v| v["executable"].as_str().map(PathBuf::from))
        .with_context(|| format!("cargo built no test binary {test} of {package}"))
}

/// What a kernel run executes: the verifier's statistics, the packet tests,
/// the attach-mode tests and, with `lab`, the one-node lab smoke (S1) and
/// with `sctp` the SCTP lab tests.
struct Binaries {
    datapath: PathBuf,
    attach: PathBuf,
    verifier_stats: PathBuf,
    lab: Option<LabBinaries>,
}

struct LabBinaries {
    agent: PathBuf,
    server: PathBuf,
    /// `tests/lab.rs`, for the smoke.
    smoke: Option<PathBuf>,
    /// `tests/lab_ipv6.rs`, for the IPv6 smoke (with the smoke).
    ipv6: Option<PathBuf>,
    /// `tests/lab_host.rs`, for host clients' per-packet UDP (with the smoke).
    host: Option<PathBuf>,
    /// `tests/lab_sctp.rs`.
    sctp: Option<PathBuf>,
}

/// The lab test the kernel matrix runs (one node, a ClusterIP, pods added
/// and removed, ECONNREFUSED with none).
const LAB_SMOKE: &str = "s1_basic_endpoint_added_and_removed";

/// The IPv6 lab test the kernel matrix runs beside the smoke (a dual-stack
/// lab; both ClusterIPs of two dual-stack Services answered by every pod):
/// the IPv6 programs, tail-called from the IPv4 ones, on every kernel.
const LAB_IPV6_SMOKE: &str = "d_lab_3_dual_stack_service_answers_on_both_cluster_ips";

/// The host-client lab tests the kernel matrix runs beside the smoke: a
/// host's connected UDP sockets to an IPv4 and an IPv6 ClusterIP, and to a
/// localhost NodePort (aimed at its ClusterIP by the socket hooks), across
/// backend changes, through the host-client device (issue 42), whose
/// per-packet path the verifier step's load (no device) leaves out.
const LAB_HOST_TESTS: &[&str] = &[
    "connected_udp_keeps_its_socket_across_backend_changes",
    "connected_udp6_keeps_its_socket_across_backend_changes",
    "connected_udp_to_localhost_node_port_keeps_its_socket_across_backend_changes",
];

/// The SCTP lab test run before the guest loads sctp: the proxy must not
/// load it (S41).
const SCTP_UNLOADED_TEST: &str = "s41_sctp_service_does_not_load_the_sctp_module";
/// The SCTP lab tests run once the guest loaded sctp, with SCTP required.
const SCTP_TESTS: &[&str] = &[
    "n4_pod_to_service_sctp",
    "n10_endpoint_to_service_sctp",
    "d3_pod_to_secondary_cluster_ip_and_node_port_sctp",
];

fn build(lab: bool, sctp: bool) -> Result<Binaries> {
    // The package selection of `cargo xtask test`'s own pass (see
    // [`test_binary`]): a `-p proxy-agent --release` build of the example
    // rebuilt the agent's dependencies with other features (2.5 minutes
    // here). The eBPF object is the same in either profile.
    run_visible(crate::setup::cargo().args([
        "build",
        "--workspace",
        "--exclude",
        "proxy-ebpf",
        "--example",
        "verifier_stats",
    ]))?;
    let lab = if lab || sctp {
        let agent = crate::setup::build_agent()?;
        let server = crate::setup::build_lab_server()?;
        Some(LabBinaries {
            agent,
            server,
            smoke: lab.then(|| test_binary("xtask", "lab")).transpose()?,
            ipv6: lab.then(|| test_binary("xtask", "lab_ipv6")).transpose()?,
            host: lab.then(|| test_binary("xtask", "lab_host")).transpose()?,
            sctp: sctp.then(|| test_binary("xtask", "lab_sctp")).transpose()?,
        })
    } else {
        None
    };
    Ok(Binaries {
        datapath: test_binary("proxy-agent", "datapath")?,
        attach: test_binary("proxy-agent", "attach")?,
        verifier_stats: target_dir().join("debug/examples/verifier_stats"),
        lab,
    })
}

/// The guest's script: each step prints `KPR-STEP <name> rc=<n>`; the script
/// exits non-zero if any step failed. `sctp_modules`: what the `lab-sctp`
/// step loads between S41 and the tests that need SCTP.
fn script(b: &Binaries, packet_tests: bool, sctp_modules: &[GuestModule]) -> String {
    let root = crate::setup::workspace_root();
    let mut s = format!(
        "set -u\nexport KPR_REQUIRE_ROOT_TESTS=1 HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin\ncd {}\nfail=0\n",
        root.display()
    );
    let mut step = |name: &str, cmd: String| {
        s.push_str(&format!(
            "echo \"KPR-STEP-START {name}\"\n{cmd}\nrc=$?\necho \"KPR-STEP {name} rc=$rc\"\n[ $rc -eq 0 ] || fail=1\n"
        ));
    };
    step("verifier", b.verifier_stats.display().to_string());
    if packet_tests {
        step(
            "packet-tests",
            format!(
                "{} --include-ignored --test-threads=2 {}",
                b.datapath.display(),
                // A test-name filter, to debug one test in a VM.
                std::env::var("KPR_VM_PACKET_FILTER").unwrap_or_default()
            ),
        );
    }
    step(
        "attach-tests",
        format!("{} --include-ignored --test-threads=1", b.attach.display()),
    );
    if let Some(l) = &b.lab {
        let env = format!(
            "KPR_LAB_START_TIMEOUT=180 KPR_AGENT_BIN={} KPR_LAB_SERVER_BIN={}",
            l.agent.display(),
            l.server.display()
        );
        if let Some(smoke) = &l.smoke {
            step(
                "lab-smoke",
                format!(
                    "{env} {} --include-ignored --exact {LAB_SMOKE}",
                    smoke.display()
                ),
            );
        }
        if let Some(ipv6) = &l.ipv6 {
            step(
                "lab-ipv6",
                format!(
                    "{env} {} --include-ignored --exact {LAB_IPV6_SMOKE}",
                    ipv6.display()
                ),
            );
        }
        if let Some(host) = &l.host {
            step(
                "lab-host-udp",
                format!(
                    "{env} {} --include-ignored --test-threads=1 --exact {}",
                    host.display(),
                    LAB_HOST_TESTS.join(" ")
                ),
            );
        }
        if let Some(tests) = &l.sctp {
            // No busybox fails the initramfs first.
            let bb = busybox().unwrap_or(Path::new("busybox"));
            step("lab-sctp", sctp_step(&env, tests, sctp_modules, bb));
        }
    }
    s.push_str("exit $fail\n");
    s
}

/// The `lab-sctp` step, in a subshell: S41 while sctp is not loaded (it must
/// not be, or S41 proves nothing), then `sctp_modules` loaded, then the
/// tests that need SCTP with `KPR_REQUIRE_SCTP=1` (a skip is a failure).
/// Fails if any part did; a failed `insmod` skips the tests after it.
fn sctp_step(env: &str, tests: &Path, modules: &[GuestModule], busybox: &Path) -> String {
    format!(
        "(
rc=0
t0=$(date +%s)
if grep -q '^sctp ' /proc/modules; then echo \"KPR-SCTP sctp loaded before S41\"; exit 1; fi
{env} {tests} --include-ignored --nocapture --exact {SCTP_UNLOADED_TEST} || rc=1
echo \"KPR-SCTP s41 rc=$rc after $(( $(date +%s) - t0 )) s; loading sctp\"
{insmod}grep -q '^sctp ' /proc/modules || {{ echo \"KPR-SCTP sctp not loaded after insmod\"; exit 1; }}
KPR_REQUIRE_SCTP=1 {env} {tests} --include-ignored --nocapture --test-threads=2 --exact {names} || rc=1
echo \"KPR-SCTP lab-sctp rc=$rc after $(( $(date +%s) - t0 )) s\"
exit $rc
)",
        tests = tests.display(),
        insmod = insmod_lines(modules, busybox),
        names = SCTP_TESTS.join(" "),
    )
}

/// A step's result line: `KPR-STEP <name> rc=<n>`.
pub fn parse_step(line: &str) -> Option<(&str, i32)> {
    let rest = line.trim().strip_prefix("KPR-STEP ")?;
    let (name, rc) = rest.split_once(" rc=")?;
    Some((name, rc.trim().parse().ok()?))
}

/// Whether a kernel list `value` (`6.1,5.10`, `all`, or `none`; unset:
/// `default`) names kernel `name`.
fn selects(value: Option<&str>, name: &str, default: &[&str]) -> bool {
    match value.map(str::trim) {
        Some("all") => true,
        Some(v) => v.split(',').map(str::trim).any(|k| k == name),
        None => default.contains(&name),
    }
}

/// Kernels whose run includes the `lab-sctp` step unless
/// `KPR_VM_SCTP_KERNELS` names others: the newest and the oldest. On 6.12
/// under TCG the step took about 20 s (S41 6 s, then N4 and N10 side by
/// side 10 s); the whole 6.12 pass 150 s.
const SCTP_KERNELS: &[&str] = &["6.12", "5.10"];

/// Whether kernel `name`'s run includes the `lab-sctp` step (S41 before
/// sctp is loaded, N4, N10 and D3 after): `KPR_VM_SCTP_KERNELS` (a list, `all`,
/// or `none`), by default [`SCTP_KERNELS`].
fn with_sctp(name: &str) -> bool {
    selects(
        std::env::var("KPR_VM_SCTP_KERNELS").ok().as_deref(),
        name,
        SCTP_KERNELS,
    )
}

/// Whether kernel `name`'s run includes the lab smoke.
fn with_lab(name: &str) -> bool {
    selects(
        std::env::var("KPR_VM_LAB_KERNELS").ok().as_deref(),
        name,
        LAB_KERNELS,
    )
}

/// How long one kernel's run may take under TCG (boot, verifier, packet
/// tests, lab smoke) before the VM is killed: a guard against a hung VM,
/// not a performance bound. 5.10's run took 843 s in CI (it has the most
/// to do: the legacy fallbacks, the IPv4 and IPv6 `_rnd` builds), went
/// past 900 s on a loaded machine, and took 1,207 s on a slower 2-core one;
/// a full run now shares the machine with lab_scale's tests meanwhile.
const VM_TIMEOUT: Duration = Duration::from_secs(2_400);

/// `cargo xtask test --kernel <name>`: the verifier's statistics, the packet
/// tests, the attach tests and the lab smoke on that kernel;
/// `host` runs them on this machine's kernel; `matrix` runs the kernel tier
/// of a full `cargo xtask test` alone ([`test_matrix`]).
pub fn test_kernel(name: &str) -> Result<()> {
    if name == "matrix" {
        return test_matrix();
    }
    // One kernel asked for by name: everything on it, unless the lab
    // smoke's kernels are named.
    let lab = std::env::var_os("KPR_VM_LAB_KERNELS").is_none() || with_lab(name);
    run_kernel(name, true, lab)
}

/// One kernel's run; without `packet_tests`, the verifier's statistics (every
/// program must load) and the attach tests only; with `lab`, the lab smoke.
fn run_kernel(name: &str, packet_tests: bool, lab: bool) -> Result<()> {
    let lab = lab || name == "host";
    // Never on this machine: the step loads the sctp module.
    let sctp = with_sctp(name) && name != "host";
    let b = build(lab, sctp)?;
    if name == "host" {
        let path = kernels_dir().join("run-host.sh");
        std::fs::create_dir_all(kernels_dir())?;
        std::fs::write(&path, script(&b, packet_tests, &[]))?;
        return run_visible(Command::new("sh").arg(&path));
    }
    let spec = spec(name)?;
    let started = Instant::now();
    let modules = if sctp {
        sctp_modules(name, &fetch(&spec)?)?
    } else {
        Vec::new()
    };
    let path = kernels_dir().join(format!("run-{name}.sh"));
    std::fs::create_dir_all(kernels_dir())?;
    std::fs::write(&path, script(&b, packet_tests, &modules))?;
    let out = run_script(&spec, &path, VM_TIMEOUT)?;
    let steps: Vec<(String, i32)> = out
        .lines
        .iter()
        .filter_map(|l| parse_step(l).map(|(n, rc)| (n.to_owned(), rc)))
        .collect();
    println!("\nkernel {name}: {:.0?}", started.elapsed());
    for (n, rc) in &steps {
        println!("  {n:<14} {}", if *rc == 0 { "ok" } else { "FAILED" });
    }
    let failed: Vec<&str> = steps
        .iter()
        .filter(|(_, rc)| *rc != 0)
        .map(|(n, _)| n.as_str())
        .collect();
    if !failed.is_empty() || out.rc != Some(0) {
        bail!(
            "kernel {name}: failed: {failed:?} (script exit {:?})",
            out.rc
        );
    }
    Ok(())
}

/// Whether the matrix's pass of kernel `name` includes the packet tests:
/// by default on [`PACKET_KERNELS`], the oldest kernel (legacy tc, no
/// `bpf_loop`, the most fallbacks); the host's kernel runs them natively in
/// the main pass, and every kernel's pass loads every program (the
/// verifier step). `KPR_VM_PACKET_KERNELS=all` runs them everywhere (the
/// full run). Under TCG a harness's load (the verifier checking every
/// program) takes about a minute, so harnesses reuse a loaded object (maps
/// emptied): the 39 packet tests took 233 s on 6.1 and 253 s on 5.10; the
/// 79 of stop 38 took 418 s on 5.10 and about 6 minutes on 6.1, which kept
/// CI past its 60 minutes.
fn with_packets(name: &str) -> bool {
    selects(
        std::env::var("KPR_VM_PACKET_KERNELS").ok().as_deref(),
        name,
        PACKET_KERNELS,
    )
}

/// Kernels whose pass includes the packet tests unless
/// `KPR_VM_PACKET_KERNELS` names others.
const PACKET_KERNELS: &[&str] = &["5.10"];

/// Kernels whose pass includes the one-node lab smoke (and its IPv6 twin)
/// unless `KPR_VM_LAB_KERNELS` names others: the oldest and the newest
/// (legacy tc and tcx links); 6.1 attaches as 5.10 does.
const LAB_KERNELS: &[&str] = &["6.12", "5.10"];

/// Every kernel of [`MATRIX`], one after the other (the CI's kernel tier),
/// with each pass's wall time at the end.
pub fn test_matrix() -> Result<()> {
    let mut failed = Vec::new();
    let mut times = Vec::new();
    for k in MATRIX {
        let started = Instant::now();
        let with_packets = with_packets(k.name);
        if let Err(e) = run_kernel(k.name, with_packets, with_lab(k.name)) {
            eprintln!("{e:#}");
            failed.push(k.name);
        }
        times.push((k.name, with_packets, started.elapsed()));
    }
    println!("\nkernel matrix (wall time of each pass, builds included):");
    for (name, with_packets, t) in &times {
        let what = if *with_packets {
            "verifier, packet tests, attach tests"
        } else {
            "verifier, attach tests"
        };
        let lab = if with_lab(name) { ", lab smoke" } else { "" };
        let sctp = if with_sctp(name) { ", lab SCTP" } else { "" };
        println!("  {name:<5} {:>5} s  {what}{lab}{sctp}", t.as_secs());
    }
    if !failed.is_empty() {
        bail!("kernel matrix: failed on {failed:?}");
    }
    Ok(())
}

/// Fetches every kernel of [`MATRIX`] (cached: a second call only checks).
pub fn fetch_matrix() -> Result<()> {
    for k in MATRIX {
        fetch(k)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// S41 runs before the modules load, the tests needing SCTP after, with
    /// SCTP required.
    #[test]
    fn sctp_step_checks_s41_before_loading_sctp() {
        let mods = [GuestModule {
            name: "sctp".into(),
            path: "/m/sctp.ko".into(),
        }];
        let s = sctp_step("E=1", Path::new("/t/lab_sctp"), &mods, Path::new("bb"));
        let at = |needle: &str| {
            s.find(needle)
                .unwrap_or_else(|| panic!("{needle:?} not in {s}"))
        };
        assert!(at("grep -q '^sctp ' /proc/modules; then") < at(SCTP_UNLOADED_TEST));
        assert!(at(SCTP_UNLOADED_TEST) < at("bb insmod /m/sctp.ko"));
        assert!(at("bb insmod /m/sctp.ko") < at("KPR_REQUIRE_SCTP=1 E=1 /t/lab_sctp"));
        for t in SCTP_TESTS {
            assert!(at("KPR_REQUIRE_SCTP=1") < at(t));
        }
        assert!(!s[..at("KPR_REQUIRE_SCTP=1")].contains("n4_"));
    }

    #[test]
    fn kernel_lists_select() {
        let def = ["6.12", "5.10"];
        assert!(selects(None, "6.12", &def));
        assert!(!selects(None, "6.1", &def));
        assert!(selects(Some("all"), "6.1", &def));
        assert!(selects(Some("6.1, 5.10"), "5.10", &def));
        assert!(!selects(Some("6.1"), "6.12", &def));
        assert!(!selects(Some("none"), "6.12", &def));
        assert!(!selects(Some(""), "6.12", &def));
    }
}

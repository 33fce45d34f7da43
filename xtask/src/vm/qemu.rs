//! One VM run: qemu boots a kernel with the initramfs and runs a script;
//! its console lines and the script's exit status come back. TCG unless
//! `KPR_VM_ACCEL=kvm`; bounded by a timeout, the VM killed when the run
//! ends.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::initramfs::*;
use super::kernels::*;

/// What one VM run printed: the result lines of the script's steps.
#[derive(Debug, Default)]
pub struct VmOutput {
    /// Every console line.
    pub lines: Vec<String>,
    /// The script's exit status (`KPR-VM-DONE rc=<n>`), if it got there.
    pub rc: Option<i32>,
}

/// Parses `KPR-VM-DONE rc=<n>`.
pub fn parse_done(line: &str) -> Option<i32> {
    line.trim()
        .strip_prefix("KPR-VM-DONE rc=")
        .and_then(|s| s.trim().parse().ok())
}

/// Boots `spec`'s kernel and runs `script` (a shell script, on the host's
/// filesystem, run as root in the guest) within `timeout`; the VM is killed
/// at the deadline or when this returns.
pub fn run_script(spec: &KernelSpec, script: &Path, timeout: Duration) -> Result<VmOutput> {
    let kernel = fetch(spec)?;
    let initrd = initramfs(spec.name, &kernel)?;
    let (accel, cpu) = match std::env::var("KPR_VM_ACCEL").as_deref() {
        Ok("kvm") => ("kvm", "host"),
        _ => ("tcg,thread=multi", "max"),
    };
    let mut qemu = Command::new("qemu-system-x86_64");
    // SAFETY: prctl is async-signal-safe; the VM dies with the runner, even
    // when the runner is killed.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut qemu, || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = qemu
        .args(["-machine", "q35", "-accel", accel, "-cpu", cpu])
        .args(["-smp", "2", "-m", "3072", "-nographic", "-no-reboot"])
        .args(["-nic", "none", "-serial", "stdio", "-monitor", "none"])
        .arg("-kernel")
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .arg("-append")
        .arg(format!(
            "console=ttyS0 panic=-1 loglevel=4 mitigations=off kpr.script={}{}",
            script.display(),
            kept_paths_arg()?
        ))
        .args([
            "-virtfs",
            "local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("cannot start qemu-system-x86_64 (cargo xtask setup installs qemu-system-x86)")?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + timeout;
    let mut out = VmOutput::default();
    let result = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break Err(anyhow::anyhow!(
                "kernel {}: no result within {timeout:?}",
                spec.name
            ));
        }
        match rx.recv_timeout(left.min(Duration::from_secs(1))) {
            Ok(line) => {
                let line = line.trim_end_matches('\r').to_owned();
                println!("[{}] {line}", spec.name);
                let _ = std::io::stdout().flush();
                if let Some(rc) = parse_done(&line) {
                    out.rc = Some(rc);
                }
                out.lines.push(line);
                if out.rc.is_some() {
                    break Ok(());
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Ok(Some(st)) = child.try_wait() {
                    break Err(anyhow::anyhow!(
                        "kernel {}: qemu exited ({st}) before the script finished",
                        spec.name
                    ));
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                break Err(anyhow::anyhow!(
                    "kernel {}: the VM's console closed before the script finished",
                    spec.name
                ));
            }
        }
    };
    // Powered off or not: never leave a VM behind.
    let stop = Instant::now() + Duration::from_secs(10);
    while Instant::now() < stop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    result.map(|()| out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_result_line() {
        assert_eq!(parse_done("KPR-VM-DONE rc=0\r"), Some(0));
        assert_eq!(parse_done("KPR-VM-DONE rc=101"), Some(101));
        assert_eq!(parse_done("KPR-VM-DONE rc="), None);
        assert_eq!(parse_done("something else"), None);
    }
}

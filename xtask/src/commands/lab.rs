//! `cargo xtask lab`: start, list, check and tear down labs from the
//! command line.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Subcommand;
use xtask::lab::Lab;
use xtask::setup;

#[derive(Subcommand)]
pub enum LabCmd {
    /// Start a lab from a manifest file or directory; print its lab.json path.
    Up {
        manifests: PathBuf,
        /// Do not start the agents.
        #[arg(long)]
        no_agent: bool,
        /// Number of nodes (more than one adds a switch and an external client).
        #[arg(long, default_value_t = 1)]
        nodes: usize,
        /// Zones of the nodes, in node order, comma separated (zone-a,zone-b).
        #[arg(long, value_delimiter = ',')]
        zones: Vec<String>,
        /// IPv6 beside IPv4 (2001:2::/48): every node, pod and client gets
        /// both, Services the families they ask for.
        #[arg(long)]
        dual_stack: bool,
        /// Run a real control plane (etcd, kube-apiserver,
        /// kube-controller-manager, built by setup) and the agents with
        /// `--source kubernetes` against it; the lab plays the kubelet.
        /// Prints how to run kubectl against it.
        #[arg(long, env = "KPR_LAB_CONTROL_PLANE")]
        control_plane: bool,
        /// Do not wait for the agent's first sync.
        #[arg(long)]
        no_wait: bool,
        /// Seconds to wait for the agent's first sync.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        #[arg(long, env = "KPR_AGENT_BIN")]
        agent_bin: Option<PathBuf>,
        #[arg(long, env = "KPR_LAB_SERVER_BIN")]
        server_bin: Option<PathBuf>,
    },
    /// Tear a lab down (lab.json path or id); all labs if none given.
    Down { target: Option<String> },
    /// List running labs.
    List,
    /// Check that every pod answers directly from the client (no proxy involved).
    Check { target: Option<String> },
}

pub fn lab_cmd(cmd: LabCmd) -> Result<()> {
    match cmd {
        LabCmd::Up {
            manifests,
            no_agent,
            nodes,
            zones,
            dual_stack,
            control_plane,
            no_wait,
            timeout,
            agent_bin,
            server_bin,
        } => {
            // A Service asking for IPv6 fails an IPv4-only lab: say so before
            // anything is installed or created, naming the flag.
            if !dual_stack {
                let objects = xtask::manifests::load_path(&manifests)?;
                if let Some(what) = xtask::manifests::first_ipv6_request(&objects) {
                    bail!("{what}, but the lab is IPv4 only (start it with `cargo xtask lab up --dual-stack`)");
                }
            }
            // With --agent-bin and --server-bin nothing is built, but the lab
            // still needs setup's packages (iproute2, bpffs mounted); with
            // --control-plane it builds the Kubernetes components itself.
            setup::ensure_datapath_setup()?;
            let zones: Vec<&str> = zones.iter().map(String::as_str).collect();
            let mut b = Lab::builder()
                .manifests_path(manifests)
                .agent(!no_agent)
                .nodes(nodes)
                .zones(&zones)
                .ipv6(dual_stack)
                .control_plane(control_plane);
            if let Some(p) = agent_bin {
                b = b.agent_bin(p);
            }
            if let Some(p) = server_bin {
                b = b.server_bin(p);
            }
            let mut lab = b.start()?;
            if !no_agent && !no_wait {
                lab.wait_ready(Duration::from_secs(timeout))?;
            }
            if let Some(cp) = lab.control_plane() {
                eprintln!(
                    "kubectl against the lab's API server ({}): ip netns exec {} {} --kubeconfig {}",
                    cp.server(),
                    cp.netns,
                    xtask::kube::bin("kubectl").display(),
                    cp.admin_kubeconfig.display()
                );
            }
            println!("{}", lab.detach()?.display());
            Ok(())
        }
        LabCmd::Down { target } => {
            let targets: Vec<String> = match target {
                Some(t) => vec![t],
                None => Lab::list()
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect(),
            };
            let mut failed = false;
            for t in targets {
                match Lab::attach(&t).and_then(|lab| {
                    let id = lab.id().to_string();
                    lab.down().map(|()| id)
                }) {
                    Ok(id) => println!("lab {id} down"),
                    Err(e) => {
                        eprintln!("{t}: {e:#}");
                        failed = true;
                    }
                }
            }
            if failed {
                bail!("some labs could not be torn down");
            }
            Ok(())
        }
        LabCmd::List => {
            for p in Lab::list() {
                println!("{}", p.display());
            }
            Ok(())
        }
        LabCmd::Check { target } => {
            let target = match target {
                Some(t) => t,
                None => match Lab::list().as_slice() {
                    [one] => one.display().to_string(),
                    [] => bail!("no lab running"),
                    _ => bail!("several labs running: name one"),
                },
            };
            let lab = Lab::attach(&target)?;
            xtask::self_check(&lab)
        }
    }
}

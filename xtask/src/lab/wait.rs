//! Waiting for the agents: their `sync complete` markers and their
//! attachments.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::{Lab, NODE_NAME, SYNC_MARKER};

pub(super) fn count_markers(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .map(|t| t.lines().filter(|l| l.contains(SYNC_MARKER)).count())
        .unwrap_or(0)
}

/// The highest `source_revision` of a `sync complete` line of an agent's log.
pub(super) fn synced_revision(log: &Path) -> u64 {
    std::fs::read_to_string(log)
        .map(|t| {
            t.lines()
                .filter(|l| l.contains(SYNC_MARKER))
                .filter_map(|l| {
                    l.split_whitespace()
                        .find_map(|w| w.strip_prefix("source_revision="))
                        .and_then(|v| v.parse::<u64>().ok())
                })
                .max()
                .unwrap_or(0)
        })
        .unwrap_or(0)
}

pub(super) fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// What an agent logs once a pod or client veth has its ingress program
/// (`agent/links.rs`); the egress program's line comes before it.
const POD_ATTACHED: &str = "attached pod program";

/// What each agent of a lab adds to [`Lab::wait_ready`]'s bound: a start
/// has the kernel verify every program, about 2.7 s of CPU on the 2-core
/// machines CI runs on, and a lab's agents start together (two 6-node labs
/// side by side took 16.5 s to their first syncs, past a flat 15 s).
pub const START_PER_AGENT: Duration = Duration::from_secs(3);

impl Lab {
    /// How many times node-1's agent has logged [`SYNC_MARKER`] (over all runs).
    pub fn sync_count(&self) -> usize {
        count_markers(&self.info.nodes[0].agent_log)
    }

    /// How many times the agent of node `node` has logged [`SYNC_MARKER`].
    pub fn sync_count_on(&self, node: &str) -> Result<usize> {
        Ok(count_markers(&self.node_info(node)?.agent_log))
    }

    /// Waits until, for every node index in `which`, the agent's marker
    /// count exceeds `above[i]`.
    fn wait_markers(
        &mut self,
        which: &[usize],
        above: &[usize],
        timeout: Duration,
        what: &str,
    ) -> Result<()> {
        self.wait_logs(which, |i, log| count_markers(log) > above[i], timeout, what)
    }

    /// Waits until `done(i, log)` holds for the agent log of every node
    /// index in `which`; fails at once if one of those agents stops.
    fn wait_logs(
        &mut self,
        which: &[usize],
        done: impl Fn(usize, &Path) -> bool,
        timeout: Duration,
        what: &str,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut pending: Vec<usize> = which.to_vec();
        loop {
            pending.retain(|&i| !done(i, &self.info.nodes[i].agent_log));
            if pending.is_empty() {
                return Ok(());
            }
            for &i in &pending {
                if !self.agent_running_idx(i) {
                    let n = &self.info.nodes[i];
                    bail!(
                        "agent of {} is not running while waiting for {what}; log tail:\n{}",
                        n.name,
                        tail(&n.agent_log, 30)
                    );
                }
            }
            if Instant::now() >= deadline {
                let n = &self.info.nodes[pending[0]];
                bail!(
                    "timed out after {timeout:?} waiting for {what} of {}; log tail of {}:\n{}",
                    pending
                        .iter()
                        .map(|&i| self.info.nodes[i].name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    n.name,
                    tail(&n.agent_log, 30)
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn nodes_with_agent(&self) -> Vec<usize> {
        (0..self.info.nodes.len())
            .filter(|&i| self.info.nodes[i].agent.is_some())
            .collect()
    }

    /// Waits until every agent (since it was last started) logged its first
    /// `sync complete`, within `timeout` plus [`START_PER_AGENT`] for each
    /// agent. Fails if no agent was started.
    ///
    /// `KPR_LAB_START_TIMEOUT` (seconds) raises the bound: the kernel
    /// runner sets it, since under a VM's software emulation the agent's
    /// start (the verifier checking every program) takes many times longer.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let which = self.nodes_with_agent();
        if which.is_empty() {
            bail!("no agent was started");
        }
        let timeout = timeout + START_PER_AGENT * u32::try_from(which.len()).unwrap_or(u32::MAX);
        let timeout = std::env::var("KPR_LAB_START_TIMEOUT")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .map_or(timeout, |s| timeout.max(Duration::from_secs(s)));
        let marks = self.agent_start_marks.clone();
        self.wait_markers(&which, &marks, timeout, "the agent's first sync")
    }

    /// Waits for every running agent's next `sync complete` after the last
    /// manifest write (`apply`, `delete_*`, `replace_manifests`). Returns at
    /// once without an agent. With a real control plane: until every
    /// running agent logged a sync whose `source_revision` reached the
    /// lab's last barrier (everything the lab wrote before it).
    pub fn wait_synced(&mut self, timeout: Duration) -> Result<()> {
        if let Some(target) = self.api.as_ref().map(|a| a.target) {
            let t = Instant::now();
            self.wait_revision(target, timeout)?;
            return self.wait_kube_proxy_synced(timeout.saturating_sub(t.elapsed()));
        }
        let which = self.nodes_with_agent();
        let marks = self.write_marks.clone();
        self.wait_markers(&which, &marks, timeout, "a sync after the manifest change")
    }

    /// Waits until every node running kube-proxy has the lab's last
    /// kube-proxy barrier in its rules (see `write_kube_proxy_barrier`):
    /// its Service's port with its ClusterIP, and its endpoint.
    pub fn wait_kube_proxy_synced(&mut self, timeout: Duration) -> Result<()> {
        let Some((ip, port)) = self.kube_proxy_target() else {
            return Ok(());
        };
        let nodes = self.nodes_with_kube_proxy();
        let deadline = Instant::now() + timeout;
        let service = ip.to_string();
        let backend = format!("{}:{port}", super::api::KUBE_PROXY_BARRIER_BACKEND);
        let port = port.to_string();
        for node in nodes {
            loop {
                let rules = self.kube_proxy_rules(&node)?;
                let has_service = rules.lines().any(|l| {
                    l.contains(&service)
                        && l.split(|c: char| !c.is_ascii_digit()).any(|w| w == port)
                });
                let has_backend = rules.lines().any(|l| l.contains(&backend));
                if has_service && has_backend {
                    break;
                }
                if Instant::now() > deadline {
                    bail!(
                        "kube-proxy on {node} did not program the lab's barrier ({service}:{port} → {backend}) within {timeout:?}"
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// Waits until every running agent logged a sync with a
    /// `source_revision` of at least `target`.
    pub fn wait_revision(&mut self, target: u64, timeout: Duration) -> Result<()> {
        let which = self.nodes_with_agent();
        self.wait_logs(
            &which,
            |_, log| synced_revision(log) >= target,
            timeout,
            &format!("a sync at source_revision {target}"),
        )
    }

    /// Waits for a sync of node-1's agent after marker count `mark` (see
    /// [`sync_count`](Lab::sync_count)).
    pub fn wait_synced_since(&mut self, mark: usize, timeout: Duration) -> Result<()> {
        let mut marks = vec![0; self.info.nodes.len()];
        marks[0] = mark;
        self.wait_markers(&[0], &marks, timeout, "a sync")
    }

    /// Waits until every running agent logged an attachment naming each
    /// host-side veth of its node's pods and clients (`attached pod
    /// program`: the ingress program, logged after the egress one) and, with
    /// a switch and an agent that takes `--external-interfaces`, its `eth0`
    /// (a line containing `attached`). The agents attach from a netlink
    /// watch, independently of their syncs: `sync complete` can come before
    /// the attachments, and traffic in between bypasses the datapath.
    pub fn wait_attached(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let ext = self.agent_has_ext_flag == Some(true);
        loop {
            let mut missing = Vec::new();
            for n in &self.info.nodes {
                if n.agent.is_none() {
                    continue;
                }
                // (interface, what its attachment line says)
                let mut ifs: Vec<(&str, &str)> = Vec::new();
                if self.info.client.node == n.name
                    || (n.name == NODE_NAME && self.info.client.node.is_empty())
                {
                    ifs.push((&self.info.client.host_if, POD_ATTACHED));
                }
                ifs.extend(
                    self.info
                        .clients
                        .iter()
                        .filter(|c| c.node == n.name || (c.node.is_empty() && n.name == NODE_NAME))
                        .map(|c| (c.host_if.as_str(), POD_ATTACHED)),
                );
                ifs.extend(
                    self.info
                        .pods
                        .iter()
                        .filter(|p| p.node == n.name)
                        .map(|p| (p.host_if.as_str(), POD_ATTACHED)),
                );
                if ext && !n.eth.is_empty() {
                    ifs.push((&n.eth, "attached"));
                }
                ifs.retain(|(i, _)| !i.is_empty());
                let log = std::fs::read_to_string(&n.agent_log).unwrap_or_default();
                for (i, attached) in ifs {
                    let quoted = format!("\"{i}\"");
                    let bare = format!("={i}");
                    let found = log.lines().any(|l| {
                        l.contains(attached)
                            && !l.contains("detached")
                            && (l.contains(&quoted)
                                || l.split_whitespace().any(|w| w.ends_with(&bare)))
                    });
                    if !found {
                        missing.push(format!("{}:{i}", n.name));
                    }
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("agents did not attach to {missing:?} within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

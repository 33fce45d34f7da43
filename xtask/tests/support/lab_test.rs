//! [`LabTest`]: how a lab test describes its lab, starts it and waits for
//! the agents, with the diagnostics of [`run_lab`](super::run_lab) on
//! failure.

use std::time::Duration;

use xtask::lab::{LabBuilder, DEFAULT_SYNC_TIMEOUT};
use xtask::Lab;

use super::{attached, diagnostics, diagnostics_nodes, run_lab};

/// A lab test: the lab to start and how long to wait for its agents.
///
/// ```ignore
/// LabTest::new("s1").yaml(&yaml).run(|lab| { /* ... */ });
/// LabTest::new("s31").nodes(3).zones(&["a", "b"]).yaml(&yaml).run(|lab| { /* ... */ });
/// ```
///
/// Two kinds of lab, by whether [`nodes`](LabTest::nodes) was called:
/// - without it, a one-node lab: `run` waits for the agent's first sync and
///   attachments ("agent not ready" / "agent not attached"), and on failure
///   prints the agent's log tail and maps ([`diagnostics`], at most
///   [`inspect_lines`](LabTest::inspect_lines) lines of each map); its
///   banner says " (dual-stack)" when the lab is;
/// - with it (even `nodes(1)`), a lab of that many nodes: `run` waits for
///   every agent ("agents not ready", then [`attached`]), and on failure
///   prints every node's diagnostics ([`diagnostics_nodes`]); its banner
///   says " with <n> nodes".
///
/// The sync timeout (default [`DEFAULT_SYNC_TIMEOUT`], 15 s) is recorded
/// on the lab ([`Lab::sync_timeout`]), where [`super::synced`],
/// [`super::apply`], [`super::attached`] and [`super::client_on`] read it.
#[derive(Clone)]
pub struct LabTest {
    name: String,
    builder: LabBuilder,
    nodes: Option<usize>,
    dual_stack: bool,
    sync_timeout: Duration,
    inspect_lines: Option<usize>,
    ready: Option<fn(&mut Lab)>,
    banner: Option<String>,
}

impl LabTest {
    /// A one-node lab without manifests, named `name` in the test's output.
    pub fn new(name: &str) -> Self {
        LabTest {
            name: name.to_string(),
            builder: Lab::builder(),
            nodes: None,
            dual_stack: false,
            sync_timeout: DEFAULT_SYNC_TIMEOUT,
            inspect_lines: None,
            ready: None,
            banner: None,
        }
    }

    /// Manifests as YAML text ([`LabBuilder::manifests_yaml`]).
    pub fn yaml(mut self, yaml: &str) -> Self {
        self.builder = self.builder.manifests_yaml(yaml);
        self
    }

    /// A lab of `n` nodes, with the multi-node waits and diagnostics (see
    /// [`LabTest`]).
    pub fn nodes(mut self, n: usize) -> Self {
        self.nodes = Some(n);
        self
    }

    /// The nodes' zones ([`LabBuilder::zones`]).
    pub fn zones(mut self, zones: &[&str]) -> Self {
        self.builder = self.builder.zones(zones);
        self
    }

    /// The switch, the nodes' `eth0` and the external client
    /// ([`LabBuilder::external`]).
    pub fn external(mut self, on: bool) -> Self {
        self.builder = self.builder.external(on);
        self
    }

    /// A dual-stack lab ([`LabBuilder::dual_stack`]).
    pub fn dual_stack(mut self) -> Self {
        self.builder = self.builder.dual_stack();
        self.dual_stack = true;
        self
    }

    /// `args` appended to every agent's command line.
    pub fn args(mut self, args: &[&str]) -> Self {
        for a in args {
            self.builder = self.builder.agent_arg(*a);
        }
        self
    }

    /// How long to wait for the agents to come up or to sync a change
    /// (default [`DEFAULT_SYNC_TIMEOUT`]).
    pub fn sync_timeout(mut self, timeout: Duration) -> Self {
        self.sync_timeout = timeout;
        self
    }

    /// On failure of a one-node lab, print at most the first `n` lines of
    /// each `proxy-agent inspect` (default: all of them).
    pub fn inspect_lines(mut self, n: usize) -> Self {
        self.inspect_lines = Some(n);
        self
    }

    /// Waits for the agents with `ready` instead of the default waits (see
    /// [`LabTest`]); `ready` reads the timeout from [`Lab::sync_timeout`].
    pub fn ready(mut self, ready: fn(&mut Lab)) -> Self {
        self.ready = Some(ready);
        self
    }

    /// Any other option of the lab ([`LabBuilder`]: a real control plane,
    /// the agent's image, no agent yet, ...).
    pub fn with(mut self, f: impl FnOnce(LabBuilder) -> LabBuilder) -> Self {
        self.builder = f(self.builder);
        self
    }

    /// A real control plane and no proxy yet: the test starts the agent
    /// ([`super::agent_bin`]) or kube-proxy on the nodes itself, so `run`
    /// waits for no agent.
    pub fn proxies_started_by_the_test(self) -> Self {
        self.with(|b| {
            b.agent_bin(super::agent_bin())
                .control_plane(true)
                .agent(false)
        })
        .ready(|_| {})
    }

    /// What the "lab ... ready" line says of the lab, instead of its node
    /// count or " (dual-stack)".
    pub fn banner(mut self, banner: &str) -> Self {
        self.banner = Some(banner.to_string());
        self
    }

    /// Starts the lab, waits for its agents, runs `f` (see [`run_lab`]).
    pub fn run(self, f: impl FnOnce(&mut Lab)) {
        let builder = self.builder.sync_timeout(self.sync_timeout);
        let banner = |default: &str| self.banner.clone().unwrap_or_else(|| default.to_string());
        match self.nodes {
            Some(nodes) => run_lab(
                &self.name,
                builder.nodes(nodes),
                &banner(&format!(" with {nodes} nodes")),
                |lab| match self.ready {
                    Some(ready) => ready(lab),
                    None => {
                        lab.wait_ready(lab.sync_timeout())
                            .unwrap_or_else(|e| panic!("agents not ready: {e:#}"));
                        attached(lab);
                    }
                },
                diagnostics_nodes,
                f,
            ),
            None => run_lab(
                &self.name,
                builder,
                &banner(if self.dual_stack { " (dual-stack)" } else { "" }),
                |lab| match self.ready {
                    Some(ready) => ready(lab),
                    None => {
                        lab.wait_ready(lab.sync_timeout())
                            .unwrap_or_else(|e| panic!("agent not ready: {e:#}"));
                        attached(lab);
                    }
                },
                |lab| diagnostics(lab, self.inspect_lines),
                f,
            ),
        }
    }
}

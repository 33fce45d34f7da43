//! What the kernel offers, probed at start (never by version number: RHEL
//! backports features to older version numbers). A feature the kernel lacks
//! turns off the capability that needs it, with one log line naming the
//! kernel that brings it, or, for the tc datapath itself, stops the agent
//! with that line instead of a verifier dump.

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{is_helper_supported, is_map_supported, is_program_supported, BpfHelper},
};

/// Something the kernel may or may not have, and what needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Feature {
    /// What is probed, as the kernel calls it (`bpf_redirect_peer`).
    pub name: &'static str,
    /// The upstream Linux version that brought it.
    pub since: &'static str,
    /// The capability it belongs to.
    pub capability: Capability,
}

/// A part of the datapath that can be on or off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Capability {
    /// The tc programs on pod and external interfaces: without them there is
    /// no datapath, so a missing feature here stops the agent.
    TcDatapath,
    /// XDP acceleration of external traffic (`--acceleration xdp`).
    XdpAcceleration,
    /// The cgroup socket hooks for the node's own clients.
    HostSocketLb,
    /// The search of the whole SNAT port range once random tries fail
    /// (otherwise such a flow is dropped), see [`super::PortSearch`].
    SnatPortSearch,
}

impl std::fmt::Display for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Capability::TcDatapath => "the tc datapath",
            Capability::XdpAcceleration => "XDP acceleration",
            Capability::HostSocketLb => "host socket load balancing",
            Capability::SnatPortSearch => "the exhaustive SNAT port search",
        })
    }
}

enum Probe {
    Program(ProgramType),
    Map(MapType),
    Helper(ProgramType, BpfHelper),
}

/// Every feature the programs use (helpers as `proxy-ebpf/src` calls them),
/// with its probe.
fn features() -> Vec<(Feature, Probe)> {
    use Capability::*;
    let f = |name, since, capability| Feature {
        name,
        since,
        capability,
    };
    let tc = ProgramType::SchedClassifier;
    let xdp = ProgramType::Xdp;
    let sock = ProgramType::CgroupSockAddr;
    vec![
        (
            f("sched_cls programs", "4.1", TcDatapath),
            Probe::Program(tc),
        ),
        (
            f("LRU hash maps", "4.10", TcDatapath),
            Probe::Map(MapType::LruHash),
        ),
        (
            f("LPM trie maps", "4.11", TcDatapath),
            Probe::Map(MapType::LpmTrie),
        ),
        (
            f("per-CPU array maps", "4.6", TcDatapath),
            Probe::Map(MapType::PerCpuArray),
        ),
        (
            f("bpf_fib_lookup", "4.18", TcDatapath),
            Probe::Helper(tc, BpfHelper::BPF_FUNC_fib_lookup),
        ),
        (
            f("bpf_redirect_peer", "5.10", TcDatapath),
            Probe::Helper(tc, BpfHelper::BPF_FUNC_redirect_peer),
        ),
        (
            f("bpf_redirect_neigh", "5.10", TcDatapath),
            Probe::Helper(tc, BpfHelper::BPF_FUNC_redirect_neigh),
        ),
        (
            f("XDP programs", "4.8", XdpAcceleration),
            Probe::Program(xdp),
        ),
        (
            f("bpf_fib_lookup in XDP", "4.18", XdpAcceleration),
            Probe::Helper(xdp, BpfHelper::BPF_FUNC_fib_lookup),
        ),
        (
            f("cgroup sock_addr programs", "4.17", HostSocketLb),
            Probe::Program(sock),
        ),
        (
            f(
                "bpf_get_socket_cookie in sock_addr programs",
                "5.7",
                HostSocketLb,
            ),
            Probe::Helper(sock, BpfHelper::BPF_FUNC_get_socket_cookie),
        ),
        (
            f(
                "bpf_get_netns_cookie in sock_addr programs",
                "5.7",
                HostSocketLb,
            ),
            Probe::Helper(sock, BpfHelper::BPF_FUNC_get_netns_cookie),
        ),
        (
            f("bpf_loop", "5.17", SnatPortSearch),
            Probe::Helper(tc, BpfHelper::BPF_FUNC_loop),
        ),
    ]
}

/// Probes every feature; `Err` from a probe counts as missing.
pub fn probe() -> Vec<(Feature, bool)> {
    features()
        .into_iter()
        .map(|(f, p)| {
            // A probe that fails outright (EPERM without CAP_BPF, say) says
            // nothing about the kernel: the feature counts as present, and
            // the load that follows names what is really missing (a
            // capability) instead of blaming the kernel.
            let ok = match p {
                Probe::Program(t) => is_program_supported(t).unwrap_or(true),
                Probe::Map(t) => is_map_supported(t).unwrap_or(true),
                Probe::Helper(t, h) => is_helper_supported(t, h).unwrap_or(true),
            };
            (f, ok)
        })
        .collect()
}

/// What the probes decide: the capabilities turned off, each with the one
/// line that says why.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// `(capability, reason)` for every capability turned off, in order;
    /// the reason reads "this kernel lacks X (Linux N brings it)".
    pub off: Vec<(Capability, String)>,
}

impl Decision {
    /// Whether `c` stays on.
    pub fn has(&self, c: Capability) -> bool {
        !self.off.iter().any(|(o, _)| *o == c)
    }

    /// The line that says why the tc datapath cannot run, if it cannot.
    pub fn fatal(&self) -> Option<String> {
        self.off
            .iter()
            .find(|(c, _)| *c == Capability::TcDatapath)
            .map(|(c, r)| format!("{c} cannot run: {r}"))
    }
}

/// Turns probe results into capabilities: the first missing feature of a
/// capability turns it off, named with the kernel that brings it.
pub fn decide(results: &[(Feature, bool)]) -> Decision {
    let mut d = Decision::default();
    for (f, ok) in results {
        if *ok || !d.has(f.capability) {
            continue;
        }
        d.off.push((
            f.capability,
            format!("this kernel lacks {} (Linux {} brings it)", f.name, f.since),
        ));
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(ok: bool) -> Vec<(Feature, bool)> {
        features().into_iter().map(|(f, _)| (f, ok)).collect()
    }

    #[test]
    fn everything_present_turns_nothing_off() {
        let d = decide(&all(true));
        assert_eq!(d, Decision::default());
        assert!(d.fatal().is_none());
    }

    #[test]
    fn a_missing_helper_turns_off_its_capability_once_and_names_the_kernel() {
        let mut r = all(true);
        for (f, ok) in &mut r {
            if f.capability == Capability::HostSocketLb && f.name.contains("cookie") {
                *ok = false;
            }
        }
        let d = decide(&r);
        assert_eq!(d.off.len(), 1, "{d:?}");
        assert!(!d.has(Capability::HostSocketLb));
        assert!(d.has(Capability::TcDatapath) && d.has(Capability::XdpAcceleration));
        assert_eq!(
            d.off[0].1,
            "this kernel lacks bpf_get_socket_cookie in sock_addr programs (Linux 5.7 brings it)"
        );
        assert!(d.fatal().is_none());
    }

    #[test]
    fn without_bpf_loop_the_random_tries_build_is_loaded() {
        use crate::bpf::{IfaceKind, PortSearch};
        let d = decide(&all(true));
        assert_eq!(PortSearch::of(&d), PortSearch::Exhaustive);
        assert_eq!(IfaceKind::Pod.program(PortSearch::of(&d)), "pod_ingress");
        let mut r = all(true);
        for (f, ok) in &mut r {
            if f.name == "bpf_loop" {
                *ok = false;
            }
        }
        let d = decide(&r);
        assert!(d.fatal().is_none(), "the datapath runs without it");
        assert_eq!(
            d.off,
            vec![(
                Capability::SnatPortSearch,
                "this kernel lacks bpf_loop (Linux 5.17 brings it)".to_owned()
            )]
        );
        let search = PortSearch::of(&d);
        assert_eq!(search, PortSearch::RandomTries);
        assert_eq!(IfaceKind::Pod.program(search), "pod_ingress_rnd");
        assert_eq!(IfaceKind::External.program(search), "ext_ingress_rnd");
        assert_eq!(IfaceKind::PodEgress.program(search), "pod_egress");
        assert_eq!(IfaceKind::ExternalXdp.program(search), "ext_xdp");
        // The IPv6 programs the ingress ones tail-call, in the same build.
        let ipv6: Vec<&str> = crate::bpf::IPV6_PROGRAMS
            .iter()
            .map(|(name, _)| search.program(name))
            .collect();
        assert_eq!(
            ipv6,
            ["pod_ingress6_rnd", "ext_ingress6_rnd", "pod_egress6"]
        );
        let ipv6: Vec<&str> = crate::bpf::IPV6_PROGRAMS
            .iter()
            .map(|(name, _)| PortSearch::Exhaustive.program(name))
            .collect();
        assert_eq!(ipv6, ["pod_ingress6", "ext_ingress6", "pod_egress6"]);
    }

    #[test]
    fn a_missing_tc_helper_is_fatal_with_one_line() {
        let mut r = all(true);
        for (f, ok) in &mut r {
            if f.name == "bpf_redirect_peer" {
                *ok = false;
            }
        }
        let d = decide(&r);
        assert_eq!(
            d.fatal().as_deref(),
            Some("the tc datapath cannot run: this kernel lacks bpf_redirect_peer (Linux 5.10 brings it)")
        );
    }
}

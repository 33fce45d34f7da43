//! What the agent reads from, and does to, the host beyond its BPF
//! programs and maps: the external interfaces' addresses ([`ifaddrs`]), the
//! kernel's limits and the capabilities it lacks ([`privileges`]), a
//! NetworkPolicy engine in netfilter ([`netfilter`]), the kernel's own
//! conntrack when taking over from kube-proxy ([`handover`]) and kept running
//! for the flows handed over ([`conntrack_hold`]), host
//! clients' sockets ([`sockdiag`]), the host-client device and its ClusterIP
//! routes ([`svc_device`]), and the host's port range and name.
pub mod conntrack_hold;
pub mod handover;
pub mod ifaddrs;
pub mod netfilter;
pub mod privileges;
pub mod sockdiag;
pub mod svc_device;

/// The host's `net.ipv4.ip_local_port_range` (this network namespace's).
pub fn local_port_range() -> std::io::Result<(u16, u16)> {
    let s = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")?;
    let mut it = s.split_whitespace().map(str::parse::<u16>);
    match (it.next(), it.next()) {
        (Some(Ok(a)), Some(Ok(b))) => Ok((a, b)),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("ip_local_port_range: {s:?}"),
        )),
    }
}

/// The host's name, lower-cased, as kube-proxy's default node name.
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_lowercase())
        .filter(|h| !h.is_empty())
}

/// What the configuration needs to know of this host
/// ([`crate::config::HostFacts`]): its name and its cgroup v2 root.
pub fn facts() -> crate::config::HostFacts {
    crate::config::HostFacts {
        hostname: hostname(),
        cgroup2_root: crate::bpf::cgroup2_root(),
    }
}

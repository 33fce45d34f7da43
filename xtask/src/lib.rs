//! Developer and CI tasks of the eBPF kube-proxy replacement, and the lab
//! library the integration tests drive.

pub mod bench;
pub mod client;
pub mod image;
pub mod kube;
pub mod lab;
pub mod lint;
pub mod manifests;
pub mod netns;
pub mod progress;
pub mod sctp;
pub mod setup;
pub mod vm;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{bail, Result};

pub use lab::{
    Endpoint, Frontend, HostClient, HostReply, Lab, LabBuilder, LabInfo, NodeInfo, PodInfo,
};

/// Checks the lab's plumbing without any proxy: from the client namespace
/// on node-1, every pod's server on every node answers on its pod IP over
/// TCP and UDP with its name, and sees the client's own address (no NAT on
/// the direct path; pods on other nodes are reached through the switch).
/// With an external client, the same from it. In a dual-stack lab, over
/// IPv6 too.
pub fn self_check(lab: &Lab) -> Result<()> {
    let mut failures = check_from(lab, lab.client());
    if let Some(ext) = lab.external() {
        failures.extend(check_from(lab, ext));
    }
    if !failures.is_empty() {
        bail!("pods not reachable directly: {}", failures.join(", "));
    }
    Ok(())
}

/// Every pod (with its own namespace) from `from`; returns the failures.
fn check_from(lab: &Lab, from: &Endpoint) -> Vec<String> {
    let timeout = Duration::from_secs(2);
    let mut failures = Vec::new();
    for pod in lab.pods() {
        if pod.host_if.is_empty() {
            continue;
        }
        let port = pod
            .ports
            .first()
            .map(|p| p.port)
            .unwrap_or(lab::DEFAULT_POD_PORT);
        let mut pairs = vec![(IpAddr::V4(pod.ip), IpAddr::V4(from.ip))];
        if let (Some(to), Some(me)) = (pod.ip6, from.ip6) {
            pairs.push((to.into(), me.into()));
        }
        for (to, me) in pairs {
            let addr = SocketAddr::new(to, port);
            let tcp = client::tcp_request(&from.netns, addr, b"hostname\n", timeout)
                .map(|r| client::reply_text(&r));
            let udp = client::udp_request(&from.netns, addr, b"hostname", timeout, None)
                .map(|r| client::reply_text(&r));
            let peer = client::tcp_request(&from.netns, addr, b"clientip\n", timeout)
                .map(|r| client::reply_text(&r));
            // The server prints its peer as a socket address: `[ip]:port`
            // for IPv6.
            let me = SocketAddr::new(me, 0).to_string();
            let me = me.strip_suffix(":0").unwrap_or(&me);
            let ok = matches!(&tcp, Ok(n) if *n == pod.name)
                && matches!(&udp, Ok(n) if *n == pod.name)
                && matches!(&peer, Ok(p) if p.starts_with(&format!("{me}:")));
            println!(
                "{} {} -> {addr} ({} on {}): tcp {:?} udp {:?} clientip {:?}",
                if ok { "ok  " } else { "FAIL" },
                from.name,
                pod.name,
                pod.node,
                tcp,
                udp,
                peer
            );
            if !ok {
                failures.push(format!("{} at {to} from {}", pod.name, from.name));
            }
        }
    }
    failures
}

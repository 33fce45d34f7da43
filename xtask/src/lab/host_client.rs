//! [`HostClient`]: requests from a lab node's own namespace and cgroup, as
//! a host process or hostNetwork pod makes them (through the socket hooks).
//!
//! Addresses are any [`SocketAddr`]: an IPv4 one opens an AF_INET socket, an
//! IPv6 one an AF_INET6 socket, also when it is IPv4-mapped
//! (`[::ffff:a.b.c.d]:port`: a dual-stack socket, as a Java or Go program
//! makes one, whose packets are IPv4). Peers are reported as the socket
//! sees them: an AF_INET6 socket's in IPv6 form (`[::ffff:a.b.c.d]:port`
//! for a mapped one).
use std::{
    io::{BufRead, BufReader, Write},
    net::SocketAddr,
    path::PathBuf,
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
};

use anyhow::{bail, Context, Result};

use super::{process::find_server_bin, Lab};
use crate::netns;

/// The answer to one request: the reply, and the address the client saw
/// (`getpeername()` for TCP, the datagram's source for UDP), or the error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostReply {
    Ok {
        peer: String,
        text: String,
    },
    /// `kind`: `refused`, `timeout`, `aborted`, `unreachable`, `denied`, `other`.
    Err {
        kind: String,
        message: String,
    },
}

impl HostReply {
    pub fn text(&self) -> Option<&str> {
        match self {
            HostReply::Ok { text, .. } => Some(text),
            HostReply::Err { .. } => None,
        }
    }
    pub fn error_kind(&self) -> Option<&str> {
        match self {
            HostReply::Ok { .. } => None,
            HostReply::Err { kind, .. } => Some(kind),
        }
    }
}

/// One `lab-host-client` process in a node's namespace and cgroup. Killed
/// on drop (and, being in the node's cgroup, at the lab's teardown).
pub struct HostClient {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

fn bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KPR_LAB_HOST_CLIENT_BIN") {
        return Ok(PathBuf::from(p));
    }
    let server = find_server_bin()?;
    let p = server.with_file_name("lab-host-client");
    if p.is_file() {
        return Ok(p);
    }
    crate::setup::build_lab_server()?;
    Ok(crate::setup::target_dir().join("debug/lab-host-client"))
}

impl Lab {
    /// Makes `cmd` start as a host process of node `node` (a program from
    /// the machine, `dig` say): in the node's network namespace and its
    /// cgroup, where its socket hooks serve it, as [`Lab::host_client`].
    pub fn as_host_process(&self, node: &str, cmd: &mut Command) -> Result<()> {
        let n = self
            .info
            .nodes
            .iter()
            .find(|n| n.name == node)
            .with_context(|| format!("no node {node}"))?;
        let Some(cg) = &n.cgroup else {
            bail!("this machine has no cgroup v2 hierarchy: no host clients");
        };
        netns::enter_netns_on_spawn(cmd, &n.netns)?;
        super::cgroup::join_on_spawn(cmd, cg)
    }

    /// A host client of node `node` (`node-1`): in its network namespace and
    /// its cgroup, so that the node's socket hooks serve it.
    pub fn host_client(&self, node: &str) -> Result<HostClient> {
        let mut cmd = Command::new(bin()?);
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        self.as_host_process(node, &mut cmd)?;
        let mut child = cmd.spawn().context("spawn lab-host-client")?;
        let stdin = child.stdin.take().context("stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("stdout")?);
        Ok(HostClient {
            child,
            stdin,
            stdout,
        })
    }
}

impl HostClient {
    fn ask(&mut self, line: &str) -> Result<HostReply> {
        writeln!(self.stdin, "{line}")?;
        self.stdin.flush()?;
        let mut answer = String::new();
        if self.stdout.read_line(&mut answer)? == 0 {
            bail!("lab-host-client exited");
        }
        let answer = answer.trim_end();
        if let Some(rest) = answer.strip_prefix("ok ") {
            let (peer, text) = rest.split_once(' ').unwrap_or((rest, ""));
            return Ok(HostReply::Ok {
                peer: peer.to_string(),
                text: text.to_string(),
            });
        }
        if answer == "ok" {
            return Ok(HostReply::Ok {
                peer: String::new(),
                text: String::new(),
            });
        }
        let rest = answer.strip_prefix("err ").unwrap_or(answer);
        let (kind, message) = rest.split_once(' ').unwrap_or((rest, ""));
        Ok(HostReply::Err {
            kind: kind.to_string(),
            message: message.to_string(),
        })
    }

    /// A TCP request (one line) to `addr`; `peer` is what `getpeername()`
    /// of the connected socket says.
    pub fn tcp(&mut self, addr: impl Into<SocketAddr>, request: &str) -> Result<HostReply> {
        self.ask(&format!("tcp {} {request}", addr.into()))
    }

    /// A UDP request from a fresh unconnected socket (of `addr`'s family,
    /// bound to the wildcard address); `peer` is the reply's source.
    pub fn udp(&mut self, addr: impl Into<SocketAddr>, request: &str) -> Result<HostReply> {
        self.ask(&format!("udp {} {request}", addr.into()))
    }

    /// Opens (or reopens) the connected UDP socket `name` to `addr`; the
    /// reply's `peer` is what `getpeername()` says.
    pub fn udp_connect(&mut self, name: &str, addr: impl Into<SocketAddr>) -> Result<HostReply> {
        self.ask(&format!("udpc-open {name} {}", addr.into()))
    }

    /// Opens the long-lived TCP connection `name` to `addr` (the lab
    /// server's `stream` mode); `peer` is what `getpeername()` says.
    pub fn tcp_stream_open(
        &mut self,
        name: &str,
        addr: impl Into<SocketAddr>,
    ) -> Result<HostReply> {
        self.ask(&format!("tcps-open {name} {}", addr.into()))
    }

    /// One line on the TCP connection `name`; the reply is `<pod> <line>`
    /// (`peer` is `-`).
    pub fn tcp_stream_send(&mut self, name: &str, line: &str) -> Result<HostReply> {
        self.ask(&format!("tcps {name} {line}"))
    }

    /// `getpeername()` of the connected UDP socket `name`, as the reply's
    /// `peer`.
    pub fn udp_peer(&mut self, name: &str) -> Result<HostReply> {
        self.ask(&format!("udpc-peer {name}"))
    }

    /// A request on the connected UDP socket `name` (`peer` is `-`).
    pub fn udp_send(&mut self, name: &str, request: &str) -> Result<HostReply> {
        self.ask(&format!("udpc {name} {request}"))
    }

    /// An unconnected UDP socket of `family_of`'s family, bound to an
    /// ephemeral port, kept as `name`: the reply's `peer` is its local
    /// address.
    pub fn udp_unconnected_open(
        &mut self,
        name: &str,
        family_of: impl Into<SocketAddr>,
    ) -> Result<HostReply> {
        self.ask(&format!("udpu-open {name} {}", family_of.into()))
    }

    /// `sendto(addr)` and `recvfrom` on the unconnected socket `name`: the
    /// reply's `peer` is where the answer came from.
    pub fn udp_sendto(
        &mut self,
        name: &str,
        addr: impl Into<SocketAddr>,
        request: &str,
    ) -> Result<HostReply> {
        self.ask(&format!("udpu {name} {} {request}", addr.into()))
    }
}

impl Drop for HostClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

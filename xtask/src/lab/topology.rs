//! The lab's network: the switch, node namespaces and their links, the
//! external client, and pod-like namespaces (clients and pods) on a node;
//! in a dual-stack lab, their IPv6 addresses and routes too.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};

use super::{
    node_pod_addr, Endpoint, Lab, BPFFS_PREFIX, BRIDGE, EXTERNAL_IP, EXTERNAL_IP6,
    EXTRA_CLIENT_FIRST, EXTRA_CLIENT_LAST, GATEWAY_IP, GATEWAY_IP6, GATEWAY_LINK_LOCAL6, LAB_ROUTE,
    LAB_ROUTE6, NODE_LINK_PREFIX, NODE_LINK_PREFIX6,
};
use crate::netns::{
    self, check_lab_addr, check_lab_addr6, create_netns, delete_netns, ip_in, ipv6_twin, sysctl_in,
    sysctls_in,
};

/// Dual-stack: IPv6 on in a lab namespace, without duplicate address
/// detection (for its interfaces to come: set before they are created), so
/// an address is usable as soon as it is added.
pub(super) const IPV6_SYSCTLS: [(&str, &str); 6] = [
    ("net.ipv6.conf.all.disable_ipv6", "0"),
    ("net.ipv6.conf.default.disable_ipv6", "0"),
    ("net.ipv6.conf.all.accept_dad", "0"),
    ("net.ipv6.conf.default.accept_dad", "0"),
    ("net.ipv6.conf.all.dad_transmits", "0"),
    ("net.ipv6.conf.default.dad_transmits", "0"),
];

impl Lab {
    /// A route in the external client's namespace: `ip`/32 via `node`'s
    /// address (`ip route replace`). LB IPs and externalIPs are owned by no
    /// interface; something must send them to a node, as a cloud load
    /// balancer or a router would, and moving the route moves the flow.
    pub fn route_from_external(&self, ip: Ipv4Addr, node: &str) -> Result<()> {
        let via = self.node_info(node)?.ip.to_string();
        let ext = self
            .external()
            .context("the lab has no external client (LabBuilder::external)")?;
        ip_in(
            &ext.netns,
            &[
                "route",
                "replace",
                &format!("{ip}/32"),
                "via",
                &via,
                "dev",
                "eth0",
            ],
        )?;
        Ok(())
    }

    pub(super) fn create_switch(&mut self) -> Result<()> {
        let Some(sw) = self.info.switch_netns.clone() else {
            return Ok(());
        };
        self.info.namespaces.push(sw.clone());
        self.save()?;
        create_netns(&sw)?;
        ip_in(&sw, &["link", "add", BRIDGE, "type", "bridge"])?;
        if self.info.dual_stack {
            sysctls_in(&sw, &IPV6_SYSCTLS)?;
            // Neighbour solicitations are multicast: flooded, not filtered
            // by what MLD snooping learnt (or forgot) of the ports.
            ip_in(
                &sw,
                &[
                    "link",
                    "set",
                    BRIDGE,
                    "type",
                    "bridge",
                    "mcast_snooping",
                    "0",
                ],
            )?;
        }
        ip_in(&sw, &["link", "set", BRIDGE, "up"])?;
        Ok(())
    }

    /// A pinned XDP program that passes every frame (`r0 = XDP_PASS; exit`),
    /// loaded once per lab under its own bpffs directory.
    pub(super) fn xdp_pass_program(&self) -> Result<PathBuf> {
        let dir = PathBuf::from(format!("{BPFFS_PREFIX}{}", self.info.id));
        let pin = dir.join("xdp_pass");
        if pin.exists() {
            return Ok(pin);
        }
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        // mov r0, 2 (XDP_PASS); exit
        let insns: [u64; 2] = [0x0000_0002_0000_00b7, 0x0000_0000_0000_0095];
        let license = b"GPL\0";
        let mut attr = [0u8; 128];
        attr[0..4].copy_from_slice(&6u32.to_ne_bytes()); // BPF_PROG_TYPE_XDP
        attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
        attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
        attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
        // SAFETY: BPF_PROG_LOAD (5) with a zero-padded attribute pointing at
        // live buffers.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, 5, attr.as_ptr(), attr.len() as u32) };
        if fd < 0 {
            bail!(
                "BPF_PROG_LOAD (XDP pass): {}",
                std::io::Error::last_os_error()
            );
        }
        let path = std::ffi::CString::new(pin.to_string_lossy().as_bytes())?;
        let mut pin_attr = [0u8; 16];
        pin_attr[0..8].copy_from_slice(&(path.as_ptr() as u64).to_ne_bytes());
        pin_attr[8..12].copy_from_slice(&(fd as u32).to_ne_bytes());
        // SAFETY: BPF_OBJ_PIN (6) with the fd just loaded and a C string path.
        let r =
            unsafe { libc::syscall(libc::SYS_bpf, 6, pin_attr.as_ptr(), pin_attr.len() as u32) };
        // SAFETY: our own fd; the pin keeps the program.
        unsafe { libc::close(fd as i32) };
        if r < 0 {
            bail!(
                "pin the XDP pass program at {}: {}",
                pin.display(),
                std::io::Error::last_os_error()
            );
        }
        Ok(pin)
    }

    /// A veth from the switch's bridge (port `port`) to `eth0` in `ns`, with
    /// `ip`/24 (and `ip6`/64) on it, up.
    pub(super) fn plug_into_switch(
        &mut self,
        ns: &str,
        port: &str,
        ip: Ipv4Addr,
        ip6: Option<Ipv6Addr>,
    ) -> Result<()> {
        let sw = self
            .info
            .switch_netns
            .clone()
            .ok_or_else(|| anyhow!("the lab has no switch"))?;
        check_lab_addr(ip)?;
        if let Some(ip6) = ip6 {
            check_lab_addr6(ip6)?;
        }
        ip_in(
            &sw,
            &[
                "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns,
            ],
        )?;
        ip_in(&sw, &["link", "set", port, "master", BRIDGE])?;
        ip_in(&sw, &["link", "set", port, "up"])?;
        // Frames a node sends with XDP_TX (XDP acceleration) reach the other
        // end of a veth only when that end runs an XDP program too (a real
        // NIC has no such need): the switch side gets one that passes
        // everything. And with TX checksum offload off on `eth0`, frames on
        // this "wire" carry complete checksums, as on a real one (a veth
        // otherwise passes partial checksums, which XDP cannot update).
        let pass = self.xdp_pass_program()?;
        let attach = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{sw}"))
            .args(["ip", "link", "set", "dev", port, "xdpdrv", "pinned"])
            .arg(&pass)
            .output();
        if !attach.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!("lab: could not attach the XDP pass program to {port}: {attach:?}");
        }
        let tx = Command::new("ip")
            .args(["netns", "exec", ns, "ethtool", "-K", "eth0", "tx", "off"])
            .output();
        if !tx.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!("lab: could not turn TX checksum offload off on eth0 in {ns} (is ethtool installed?)");
        }
        ip_in(
            ns,
            &[
                "addr",
                "add",
                &format!("{ip}/{NODE_LINK_PREFIX}"),
                "dev",
                "eth0",
            ],
        )?;
        if let Some(ip6) = ip6 {
            ip_in(
                ns,
                &[
                    "-6",
                    "addr",
                    "add",
                    &format!("{ip6}/{NODE_LINK_PREFIX6}"),
                    "dev",
                    "eth0",
                    "nodad",
                ],
            )?;
        }
        ip_in(ns, &["link", "set", "eth0", "up"])?;
        Ok(())
    }

    pub(super) fn create_node(&mut self, i: usize) -> Result<()> {
        let node = self.info.nodes[i].clone();
        let ns = node.netns.clone();
        self.info.namespaces.push(ns.clone());
        self.save()?;
        create_netns(&ns)?;
        if let Some(cg) = &node.cgroup {
            super::cgroup::create(cg)?;
        }
        for (k, v) in [
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ] {
            sysctl_in(&ns, k, v)?;
        }
        if self.info.dual_stack {
            let mut settings = IPV6_SYSCTLS.to_vec();
            settings.push(("net.ipv6.conf.all.forwarding", "1"));
            sysctls_in(&ns, &settings)?;
        }
        check_lab_addr(GATEWAY_IP)?;
        ip_in(
            &ns,
            &["addr", "add", &format!("{GATEWAY_IP}/32"), "dev", "lo"],
        )?;
        if self.info.dual_stack {
            check_lab_addr6(GATEWAY_IP6)?;
            ip_in(
                &ns,
                &[
                    "-6",
                    "addr",
                    "add",
                    &format!("{GATEWAY_IP6}/128"),
                    "dev",
                    "lo",
                ],
            )?;
        }
        if node.eth.is_empty() {
            check_lab_addr(node.ip)?;
            ip_in(
                &ns,
                &["addr", "add", &format!("{}/32", node.ip), "dev", "lo"],
            )?;
            if let Some(ip6) = node.ip6 {
                check_lab_addr6(ip6)?;
                ip_in(
                    &ns,
                    &["-6", "addr", "add", &format!("{ip6}/128"), "dev", "lo"],
                )?;
            }
            return Ok(());
        }
        self.plug_into_switch(&ns, &format!("n{}", i + 1), node.ip, node.ip6)?;
        sysctl_in(&ns, "net.ipv4.conf.eth0.rp_filter", "0")?;
        sysctl_in(&ns, "net.ipv4.conf.eth0.forwarding", "1")?;
        for (j, other) in self.info.nodes.clone().iter().enumerate() {
            if j == i {
                continue;
            }
            let via = other.ip.to_string();
            ip_in(
                &ns,
                &["route", "add", &other.pod_cidr, "via", &via, "dev", "eth0"],
            )?;
            if let (Some(cidr6), Some(via6)) = (&other.pod_cidr6, other.ip6) {
                let via6 = via6.to_string();
                ip_in(
                    &ns,
                    &["-6", "route", "add", cidr6, "via", &via6, "dev", "eth0"],
                )?;
            }
        }
        Ok(())
    }

    pub(super) fn create_external(&mut self) -> Result<()> {
        if self.info.switch_netns.is_none() {
            return Ok(());
        }
        let ns = format!("kpr-{}-ext", self.info.id);
        self.info.namespaces.push(ns.clone());
        self.save()?;
        create_netns(&ns)?;
        let ip6 = self.info.dual_stack.then_some(EXTERNAL_IP6);
        if ip6.is_some() {
            sysctls_in(&ns, &IPV6_SYSCTLS)?;
        }
        self.plug_into_switch(&ns, "ext", EXTERNAL_IP, ip6)?;
        self.route_pod_cidrs_via_nodes(&ns, ip6.is_some())?;
        self.info.external = Some(Endpoint {
            name: "external".to_string(),
            netns: ns,
            ip: EXTERNAL_IP,
            ip6,
            host_if: "ext".to_string(),
            node: String::new(),
        });
        self.save()
    }

    /// Routes, in `ns` (a machine on the switch), to every node's pod CIDR
    /// via that node's address (and the IPv6 ones with `ipv6`).
    pub(super) fn route_pod_cidrs_via_nodes(&self, ns: &str, ipv6: bool) -> Result<()> {
        for n in &self.info.nodes {
            let via = n.ip.to_string();
            ip_in(
                ns,
                &["route", "add", &n.pod_cidr, "via", &via, "dev", "eth0"],
            )?;
            if let (Some(cidr6), Some(via6), true) = (&n.pod_cidr6, n.ip6, ipv6) {
                let via6 = via6.to_string();
                ip_in(
                    ns,
                    &["-6", "route", "add", cidr6, "via", &via6, "dev", "eth0"],
                )?;
            }
        }
        Ok(())
    }

    pub(super) fn unique_netns(&self, name: &str) -> String {
        let clean: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        let base = format!("kpr-{}-{clean}", self.info.id);
        let mut candidate = base.clone();
        let mut n = 2;
        while self.info.namespaces.contains(&candidate) || netns::netns_exists(&candidate) {
            candidate = format!("{base}-{n}");
            n += 1;
        }
        candidate
    }

    pub(super) fn unique_host_if(&self) -> String {
        loop {
            let name = format!("lxc{}", netns::hex(&netns::random_bytes::<4>()));
            // Unique across nodes too (simpler to read in logs).
            let used = self.info.pods.iter().any(|p| p.host_if == name)
                || self.info.clients.iter().any(|c| c.host_if == name)
                || self.info.client.host_if == name;
            if !used {
                return name;
            }
        }
    }

    /// Creates namespace `ns` with `eth0` holding `ip` (and `ip6`), wired
    /// to node `node_idx` (0-based) by a veth pair; returns the host-side
    /// interface.
    pub(super) fn create_endpoint(
        &mut self,
        node_idx: usize,
        ns: &str,
        ip: Ipv4Addr,
        ip6: Option<Ipv6Addr>,
    ) -> Result<String> {
        check_lab_addr(ip)?;
        if let Some(ip6) = ip6 {
            check_lab_addr6(ip6)?;
        }
        let node = self.info.nodes[node_idx].netns.clone();
        let host_if = self.unique_host_if();
        self.info.namespaces.push(ns.to_string());
        self.save()?;
        create_netns(ns)?;
        if ip6.is_some() {
            sysctls_in(ns, &IPV6_SYSCTLS)?;
        }
        ip_in(
            &node,
            &[
                "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", ns,
            ],
        )?;
        let cidr = format!("{ip}/32");
        let gw = GATEWAY_IP.to_string();
        ip_in(ns, &["addr", "add", &cidr, "dev", "eth0"])?;
        ip_in(ns, &["link", "set", "eth0", "up"])?;
        ip_in(ns, &["route", "add", &gw, "dev", "eth0", "scope", "link"])?;
        ip_in(ns, &["route", "add", LAB_ROUTE, "via", &gw, "dev", "eth0"])?;
        ip_in(&node, &["link", "set", &host_if, "up"])?;
        ip_in(&node, &["route", "add", &cidr, "dev", &host_if])?;
        sysctl_in(&node, &format!("net.ipv4.conf.{host_if}.rp_filter"), "0")?;
        if let Some(ip6) = ip6 {
            self.wire_endpoint6(&node, &host_if, ns, ip6)?;
        }
        Ok(host_if)
    }

    /// Dual-stack half of [`create_endpoint`](Lab::create_endpoint), both
    /// ends up: `ip6`/128 on `eth0` in `ns`, [`GATEWAY_LINK_LOCAL6`] on the
    /// host side `host_if` in `node`, the pod's route to 2001:2::/48 via it
    /// and the node's to `ip6`/128 over `host_if`.
    fn wire_endpoint6(&self, node: &str, host_if: &str, ns: &str, ip6: Ipv6Addr) -> Result<()> {
        let cidr6 = format!("{ip6}/128");
        let gw6 = GATEWAY_LINK_LOCAL6.to_string();
        ip_in(
            node,
            &[
                "-6",
                "addr",
                "add",
                &format!("{gw6}/64"),
                "dev",
                host_if,
                "nodad",
            ],
        )?;
        ip_in(ns, &["-6", "addr", "add", &cidr6, "dev", "eth0", "nodad"])?;
        ip_in(
            ns,
            &["-6", "route", "add", LAB_ROUTE6, "via", &gw6, "dev", "eth0"],
        )?;
        ip_in(node, &["-6", "route", "add", &cidr6, "dev", host_if])?;
        Ok(())
    }

    pub(super) fn remove_namespace(&mut self, ns: &str) -> Result<()> {
        delete_netns(ns)?;
        self.info.namespaces.retain(|n| n != ns);
        Ok(())
    }

    /// Adds a client namespace on node-1 (an address from 198.18.1.3-9, not
    /// a backend).
    pub fn add_client(&mut self, name: &str) -> Result<Endpoint> {
        let node = self.info.nodes[0].name.clone();
        self.add_client_on(name, &node)
    }

    /// Adds a client namespace on node `node` (an address from
    /// 198.18.i.3-9 of node i's pod CIDR, not a backend; dual-stack: and its
    /// IPv6 twin).
    pub fn add_client_on(&mut self, name: &str, node: &str) -> Result<Endpoint> {
        if name == "client" || self.info.clients.iter().any(|c| c.name == name) {
            bail!("client {name} already exists");
        }
        let idx = self.node_index(node)?;
        let ip = self.alloc.allocate_in(
            node_pod_addr(idx + 1, EXTRA_CLIENT_FIRST.octets()[3]),
            node_pod_addr(idx + 1, EXTRA_CLIENT_LAST.octets()[3]),
            "client",
        )?;
        let ip6 = if self.info.dual_stack {
            let ip6 =
                ipv6_twin(ip).ok_or_else(|| anyhow!("client address {ip} has no IPv6 twin"))?;
            self.alloc.reserve_ip(ip6);
            Some(ip6)
        } else {
            None
        };
        let ns = self.unique_netns(name);
        let host_if = self.create_endpoint(idx, &ns, ip, ip6)?;
        let ep = Endpoint {
            name: name.to_string(),
            netns: ns,
            ip,
            ip6,
            host_if,
            node: node.to_string(),
        };
        self.info.clients.push(ep.clone());
        self.save()?;
        Ok(ep)
    }

    /// A client added with [`add_client`](Lab::add_client), or the default one.
    pub fn client_named(&self, name: &str) -> Option<&Endpoint> {
        if name == "client" {
            return Some(&self.info.client);
        }
        self.info.clients.iter().find(|c| c.name == name)
    }
}

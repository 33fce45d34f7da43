//! kube-proxy's iptables and nftables rule layouts for N ClusterIP services,
//! ported from `shared/reference/kube-proxy-layouts.py` (same chain names,
//! same hashes, same rule order), parameterised by the endpoints of each
//! service so the benchmark's target services point at the lab's pods and
//! every other service at dummy endpoints that are never contacted.
//!
//! Also renders the same services as manifests (Services and
//! EndpointSlices) for the agent.
//!
//! Both families: an [`Entry`]'s addresses say which. IPv6 entries render
//! what kube-proxy's IPv6 proxiers write: for iptables the same chains
//! (for `ip6tables-restore`), with the endpoint written `[addr]:port` in
//! the KUBE-SEP hash, its comment and the DNAT target, and `! -d ::1/128`
//! on the NodePorts jump; for nftables the `ip6 kube-proxy` table
//! (`ipv6_addr` sets and maps, `ip6 daddr`/`ip6 saddr`, `dnat to
//! [addr]:port`, the endpoint chain's address with `.` for `:`). IPv6
//! Services are single-stack IPv6 (`ipFamilies: [IPv6]`) with IPv6
//! EndpointSlices. Addresses: IPv4 from 198.18.0.0/15, IPv6 from
//! 2001:2::/48 (VIPs in the lab's 2001:2:0:ff::/112, dummy endpoints
//! 2001:2:0:c8::x, the twins of 198.18.200.x).
//!
//! Service `i` has its own (VIP, port): the Service CIDR holds
//! [`VIPS`] VIPs, so Service `i` has VIP `i % VIPS` and port
//! `PORT + i / VIPS` ([`vip_in`], [`svc_port`], [`svc_addr`]). Services
//! 0..65,533 keep their VIP (host part `i + 1`) on port 80; beyond them
//! the VIPs are reused on ports 81, 82, ... (a ClusterIP shared by
//! Services of different ports, as kube-proxy and the agent allow: both
//! key a frontend on address, port and protocol). Up to [`MAX_SERVICES`]
//! Services.
//!
//! Why one file (about 1,000 lines): the iptables, nftables and manifests
//! renderings are three views of one list of [`Entry`]s and must agree on
//! every Service's (VIP, port), chain names and hashes; the tests (about 300
//! lines) check them against each other and against the reference script,
//! so the address plan, the three renderers and their tests stay together.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use sha2::{Digest, Sha256};

use super::Family;

/// kube-proxy's "cluster CIDR" in the layouts (the lab's pods and clients are in it).
pub const CLUSTER_CIDR: &str = "198.18.0.0/16";
/// The Service CIDR the VIPs come from.
pub const SVC_CIDR: &str = "198.19.0.0/16";
/// IPv6: the cluster CIDR (the twins of 198.18.0.0/16: 198.18.x.y is
/// 2001:2:0:x::y; the lab's IPv6 pods and clients are in it).
pub const CLUSTER_CIDR6: &str = "2001:2::/56";
/// IPv6: the Service CIDR the VIPs come from (the lab's).
pub const SVC_CIDR6: &str = crate::manifests::SERVICE_CIDR6;
/// The port of the first [`VIPS`] Services (Service `i`'s is [`svc_port`]).
pub const PORT: u16 = 80;
/// Target (container) port: the bench servers listen on it in the pods.
pub const TPORT: u16 = 8080;
/// VIPs of a family's Service CIDR the layout uses: host parts 1..=65,534
/// of 198.19.0.0/16 (of 2001:2:0:ff::/112 in IPv6; the reference's `i + 1`
/// avoids .0.0, and .255.255 is left out as well).
pub const VIPS: usize = 65_534;
/// Services the layout can name: one (VIP, port) each, ports
/// [`PORT`]..=65,535.
pub const MAX_SERVICES: usize = VIPS * (u16::MAX as usize - PORT as usize + 1);

/// `i`, checked to name a Service of the layout.
fn service_index(i: usize) -> usize {
    assert!(
        i < MAX_SERVICES,
        "service index {i} beyond the layout's {MAX_SERVICES} Services"
    );
    i
}

/// The host part (1..=[`VIPS`]) of Service `i`'s VIP.
fn vip_host(i: usize) -> usize {
    service_index(i) % VIPS + 1
}

/// The VIP of service `i`: 198.19.x.y, host part `i % VIPS + 1` (as the
/// reference for `i` < [`VIPS`]: `i + 1` avoids .0.0). Shared with the
/// Services `i ± VIPS`, which have other ports ([`svc_port`]).
pub fn vip(i: usize) -> Ipv4Addr {
    let h = vip_host(i);
    Ipv4Addr::new(198, 19, ((h >> 8) & 0xff) as u8, (h & 0xff) as u8)
}

/// The IPv6 VIP of service `i`: 2001:2:0:ff::(i % VIPS + 1), in the lab's
/// IPv6 Service CIDR (shared as [`vip`]'s).
pub fn vip6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 2, 0, 0xff, 0, 0, 0, vip_host(i) as u16)
}

/// The VIP of service `i` in `family`.
pub fn vip_in(family: Family, i: usize) -> IpAddr {
    match family {
        Family::Ipv4 => vip(i).into(),
        Family::Ipv6 => vip6(i).into(),
    }
}

/// The port of service `i`: [`PORT`] for the first [`VIPS`] Services,
/// one more for each further round of the VIPs.
pub fn svc_port(i: usize) -> u16 {
    PORT + (service_index(i) / VIPS) as u16
}

/// Service `i`'s (VIP, port) in `family`: what a client dials. Unique per
/// Service for `i` < [`MAX_SERVICES`].
pub fn svc_addr(family: Family, i: usize) -> SocketAddr {
    SocketAddr::new(vip_in(family, i), svc_port(i))
}

/// Dummy endpoint `e` (198.18.200.x: routed nowhere, never contacted).
pub fn dummy_ep(e: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 200, 2 + (e % 250) as u8)
}

/// Dummy endpoint `e` in `family` (IPv6: 2001:2:0:c8::x, the twin of
/// [`dummy_ep`]; routed nowhere, never contacted).
pub fn dummy_ep_in(family: Family, e: usize) -> IpAddr {
    match family {
        Family::Ipv4 => dummy_ep(e).into(),
        Family::Ipv6 => crate::netns::ipv6_twin(dummy_ep(e))
            .expect("198.18.200.x has a twin")
            .into(),
    }
}

/// kube-proxy's cluster CIDR in `family`.
pub fn cluster_cidr(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => CLUSTER_CIDR,
        Family::Ipv6 => CLUSTER_CIDR6,
    }
}

/// The Service CIDR in `family`.
pub fn svc_cidr(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => SVC_CIDR,
        Family::Ipv6 => SVC_CIDR6,
    }
}

/// An endpoint as kube-proxy writes it (Go's `net.JoinHostPort`):
/// `198.18.1.2:8080`, `[2001:2:0:1::2]:8080`.
fn ep_port(ep: IpAddr) -> String {
    SocketAddr::new(ep, TPORT).to_string()
}

fn base32(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(bytes.len() * 8 / 5 + 8);
    let mut acc: u64 = 0;
    let mut bits = 0;
    for &b in bytes {
        acc = (acc << 8) | b as u64;
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((acc >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((acc << (5 - bits)) & 31) as usize] as char);
    }
    out
}

/// kube-proxy's 16-character chain-name hash.
pub fn h16(s: &str) -> String {
    let digest = Sha256::digest(s.as_bytes());
    base32(&digest)[..16].to_string()
}

/// kube-proxy's 8-character hash (nftables mode).
pub fn h8(s: &str) -> String {
    h16(s)[..8].to_string()
}

/// One service port (a frontend) of the layout.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Service index.
    pub index: usize,
    /// `ns<i>/svc<i>`.
    pub name: String,
    /// Port name (`p<port>` for TCP, `u<port>` for UDP: `p80`, `u80`).
    pub port_name: String,
    /// `tcp` or `udp`.
    pub proto: &'static str,
    pub vip: IpAddr,
    /// The Service port ([`svc_port`]).
    pub port: u16,
    /// Of the VIP's family.
    pub eps: Vec<IpAddr>,
}

impl Entry {
    /// The family of its addresses.
    pub fn family(&self) -> Family {
        if self.vip.is_ipv6() {
            Family::Ipv6
        } else {
            Family::Ipv4
        }
    }

    /// `ns<i>/svc<i>:<port name>` (kube-proxy's ServicePortName).
    pub fn spn(&self) -> String {
        format!("{}:{}", self.name, self.port_name)
    }
}

/// The entries of service `i` in `family`: TCP always; UDP too when
/// `udp`. `eps` are of `family`.
pub fn service_entries(i: usize, family: Family, eps: &[IpAddr], udp: bool) -> Vec<Entry> {
    assert!(
        eps.iter().all(|e| e.is_ipv6() == (family == Family::Ipv6)),
        "endpoints {eps:?} are not all {}",
        family.label()
    );
    let vip = vip_in(family, i);
    let port = svc_port(i);
    let name = format!("ns{i}/svc{i}");
    let mut v = vec![Entry {
        index: i,
        name: name.clone(),
        port_name: format!("p{port}"),
        proto: "tcp",
        vip,
        port,
        eps: eps.to_vec(),
    }];
    if udp {
        v.push(Entry {
            index: i,
            name,
            port_name: format!("u{port}"),
            proto: "udp",
            vip,
            port,
            eps: eps.to_vec(),
        });
    }
    v
}

// ------------------------------------------------------------------ iptables

fn ipt_kube_services_rule(e: &Entry) -> String {
    let spn = e.spn();
    let svc_chain = format!("KUBE-SVC-{}", h16(&format!("{spn}{}", e.proto)));
    format!(
        "-A KUBE-SERVICES -m comment --comment \"{spn} cluster IP\" -m {p} -p {p} -d {v} --dport {port} -j {svc_chain}",
        p = e.proto,
        v = e.vip,
        port = e.port
    )
}

/// (KUBE-SERVICES rule, chain declarations, chain rules) of one entry.
fn ipt_entry(e: &Entry) -> (String, Vec<String>, Vec<String>) {
    let spn = e.spn();
    let p = e.proto;
    let v = e.vip;
    let port = e.port;
    let svc_chain = format!("KUBE-SVC-{}", h16(&format!("{spn}{p}")));
    let ks = ipt_kube_services_rule(e);
    let mut decls = vec![format!(":{svc_chain} - [0:0]")];
    let cidr = cluster_cidr(e.family());
    let mut rules = vec![format!(
        "-A {svc_chain} -m comment --comment \"{spn} cluster IP\" -m {p} -p {p} -d {v} --dport {port} ! -s {cidr} -j KUBE-MARK-MASQ"
    )];
    let n = e.eps.len();
    for (k, ep) in e.eps.iter().enumerate() {
        let dest = ep_port(*ep);
        let sep = format!("KUBE-SEP-{}", h16(&format!("{spn}{p}{dest}")));
        decls.push(format!(":{sep} - [0:0]"));
        let left = n - k;
        if left > 1 {
            rules.push(format!(
                "-A {svc_chain} -m comment --comment \"{spn} -> {dest}\" -m statistic --mode random --probability {:.10} -j {sep}",
                1.0 / left as f64
            ));
        } else {
            rules.push(format!(
                "-A {svc_chain} -m comment --comment \"{spn} -> {dest}\" -j {sep}"
            ));
        }
        rules.push(format!(
            "-A {sep} -m comment --comment {spn} -s {ep} -j KUBE-MARK-MASQ"
        ));
        rules.push(format!(
            "-A {sep} -m comment --comment {spn} -m {p} -p {p} -j DNAT --to-destination {dest}"
        ));
    }
    (ks, decls, rules)
}

const NODEPORTS_RULE: &str = "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS";
/// IPv6: kube-proxy blocks localhost NodePorts (they never work in IPv6).
const NODEPORTS_RULE6: &str = "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS";

/// The family of `entries` (IPv4 when there are none).
fn family_of(entries: &[Entry]) -> Family {
    entries.first().map_or(Family::Ipv4, Entry::family)
}

fn nodeports_rule(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => NODEPORTS_RULE,
        Family::Ipv6 => NODEPORTS_RULE6,
    }
}

/// A full iptables-restore file (filter and nat), as kube-proxy's full
/// sync; for `ip6tables-restore` when the entries are IPv6.
pub fn ipt_full(entries: &[Entry]) -> String {
    let mut out = String::with_capacity(entries.len() * 1200 + 4096);
    out.push_str(
        r#"*filter
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
*nat
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SERVICES - [0:0]
"#,
    );
    let mut ks_rules = Vec::with_capacity(entries.len());
    let mut rules = Vec::with_capacity(entries.len() * 6);
    for e in entries {
        let (k, d, r) = ipt_entry(e);
        ks_rules.push(k);
        for l in d {
            out.push_str(&l);
            out.push('\n');
        }
        rules.extend(r);
    }
    out.push_str(
        r#"-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
"#,
    );
    for l in ks_rules {
        out.push_str(&l);
        out.push('\n');
    }
    out.push_str(nodeports_rule(family_of(entries)));
    out.push('\n');
    for l in rules {
        out.push_str(&l);
        out.push('\n');
    }
    out.push_str("COMMIT\n");
    out
}

/// kube-proxy's partial sync after adding `new` to `existing` (for
/// `iptables-restore --noflush`): KUBE-SERVICES rewritten in full, only the
/// new service's chains written.
pub fn ipt_partial_add(existing: &[Entry], new: &[Entry]) -> String {
    let mut out = String::with_capacity(existing.len() * 200 + 4096);
    out.push_str("*nat\n:KUBE-SERVICES - [0:0]\n");
    let mut new_rules = Vec::new();
    let mut new_ks = Vec::new();
    for e in new {
        let (k, d, r) = ipt_entry(e);
        for l in d {
            out.push_str(&l);
            out.push('\n');
        }
        new_ks.push(k);
        new_rules.extend(r);
    }
    for e in existing {
        out.push_str(&ipt_kube_services_rule(e));
        out.push('\n');
    }
    for l in new_ks {
        out.push_str(&l);
        out.push('\n');
    }
    out.push_str(nodeports_rule(family_of(new)));
    out.push('\n');
    for l in new_rules {
        out.push_str(&l);
        out.push('\n');
    }
    out.push_str("COMMIT\n");
    out
}

/// Restores the filter and nat tables to empty (deletes every user chain).
pub const IPT_EMPTY: &str = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n";

// ------------------------------------------------------------------ nftables

const NFT_BASE: &str = r#"add table FAM kube-proxy { comment "rules for kube-proxy" ; }
add set FAM kube-proxy cluster-ips { type ADDR_T ; comment "Active ClusterIPs" ; }
add set FAM kube-proxy nodeport-ips { type ADDR_T ; comment "IPs that accept NodePort traffic" ; }
add map FAM kube-proxy firewall-ips { type ADDR_T . inet_proto . inet_service : verdict ; comment "destinations that are subject to LoadBalancerSourceRanges" ; }
add map FAM kube-proxy no-endpoint-nodeports { type inet_proto . inet_service : verdict ; comment "vmap to drop or reject packets to service nodeports with no endpoints" ; }
add map FAM kube-proxy no-endpoint-services { type ADDR_T . inet_proto . inet_service : verdict ; comment "vmap to drop or reject packets to services with no endpoints" ; }
add map FAM kube-proxy service-ips { type ADDR_T . inet_proto . inet_service : verdict ; comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }
add map FAM kube-proxy service-nodeports { type inet_proto . inet_service : verdict ; comment "NodePort traffic" ; }
add chain FAM kube-proxy cluster-ips-check
add chain FAM kube-proxy filter-prerouting-pre-dnat { type filter hook prerouting priority -110 ; }
add chain FAM kube-proxy filter-output-pre-dnat { type filter hook output priority -110 ; }
add chain FAM kube-proxy filter-forward { type filter hook forward priority 0 ; }
add chain FAM kube-proxy filter-input { type filter hook input priority 0 ; }
add chain FAM kube-proxy filter-output { type filter hook output priority 0 ; }
add chain FAM kube-proxy firewall-check
add chain FAM kube-proxy mark-for-masquerade
add chain FAM kube-proxy masquerading
add chain FAM kube-proxy nat-output { type nat hook output priority -100 ; }
add chain FAM kube-proxy nat-postrouting { type nat hook postrouting priority 100 ; }
add chain FAM kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }
add chain FAM kube-proxy nodeport-endpoints-check
add chain FAM kube-proxy reject-chain { comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }
add chain FAM kube-proxy services
add chain FAM kube-proxy service-endpoints-check
add rule FAM kube-proxy cluster-ips-check IPX daddr @cluster-ips reject comment "Reject traffic to invalid ports of ClusterIPs"
add rule FAM kube-proxy cluster-ips-check IPX daddr { SVC_CIDR } drop comment "Drop traffic to unallocated ClusterIPs"
add rule FAM kube-proxy filter-prerouting-pre-dnat ct state new jump firewall-check
add rule FAM kube-proxy filter-forward ct state new jump service-endpoints-check
add rule FAM kube-proxy filter-forward ct state new jump cluster-ips-check
add rule FAM kube-proxy filter-input ct state new jump nodeport-endpoints-check
add rule FAM kube-proxy filter-input ct state new jump service-endpoints-check
add rule FAM kube-proxy filter-output ct state new jump service-endpoints-check
add rule FAM kube-proxy filter-output-pre-dnat ct state new jump firewall-check
add rule FAM kube-proxy filter-output ct state new jump cluster-ips-check
add rule FAM kube-proxy firewall-check IPX daddr . meta l4proto . th dport vmap @firewall-ips
add rule FAM kube-proxy mark-for-masquerade mark set mark or 0x4000
add rule FAM kube-proxy masquerading mark and 0x4000 == 0 return
add rule FAM kube-proxy masquerading mark set mark xor 0x4000
add rule FAM kube-proxy masquerading masquerade fully-random
add rule FAM kube-proxy nat-output jump services
add rule FAM kube-proxy nat-postrouting jump masquerading
add rule FAM kube-proxy nat-prerouting jump services
add rule FAM kube-proxy nodeport-endpoints-check IPX daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports
add rule FAM kube-proxy reject-chain reject
add rule FAM kube-proxy services IPX daddr . meta l4proto . th dport vmap @service-ips
add rule FAM kube-proxy services IPX daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports
add rule FAM kube-proxy service-endpoints-check IPX daddr . meta l4proto . th dport vmap @no-endpoint-services
"#;

/// The nftables table family (`ip`, `ip6`) and address match (`ip`,
/// `ip6`, as in `ip6 daddr`) of `family`: the same words.
fn nft_fam(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => "ip",
        Family::Ipv6 => "ip6",
    }
}

/// The base of kube-proxy's nftables table (no services) in `family`.
pub fn nft_base(family: Family) -> String {
    let addr_t = match family {
        Family::Ipv4 => "ipv4_addr",
        Family::Ipv6 => "ipv6_addr",
    };
    NFT_BASE
        .replace("SVC_CIDR", svc_cidr(family))
        .replace("FAM", nft_fam(family))
        .replace("ADDR_T", addr_t)
        .replace("IPX", nft_fam(family))
}

/// The `nft -f` lines of one entry.
pub fn nft_entry(e: &Entry, out: &mut String) {
    let spn = e.spn();
    let p = e.proto;
    let v = e.vip;
    let port = e.port;
    let f = nft_fam(e.family());
    let cidr = cluster_cidr(e.family());
    let suffix = format!("{}/{p}/{}", e.name, e.port_name);
    let sc = format!("service-{}-{suffix}", h8(&format!("{spn}{p}")));
    let _ = writeln!(out, "add chain {f} kube-proxy {sc}");
    let mut eps = Vec::new();
    for ep in &e.eps {
        // A chain name has no `:`: kube-proxy writes an IPv6 endpoint's with `.`.
        let ec = format!(
            "endpoint-{}-{suffix}__{}/{TPORT}",
            h8(&format!("{spn}{p}{ep}")),
            ep.to_string().replace(':', ".")
        );
        let _ = writeln!(out, "add chain {f} kube-proxy {ec}");
        eps.push((ec, *ep));
    }
    let _ = writeln!(
        out,
        "add rule {f} kube-proxy {sc} {f} daddr {v} {p} dport {port} {f} saddr != {cidr} jump mark-for-masquerade"
    );
    let vm: Vec<String> = eps
        .iter()
        .enumerate()
        .map(|(k, (c, _))| format!("{k} : goto {c}"))
        .collect();
    let _ = writeln!(
        out,
        "add rule {f} kube-proxy {sc} numgen random mod {} vmap {{ {} }}",
        eps.len(),
        vm.join(" , ")
    );
    for (ec, ep) in &eps {
        let _ = writeln!(
            out,
            "add rule {f} kube-proxy {ec} {f} saddr {ep} jump mark-for-masquerade"
        );
        let _ = writeln!(
            out,
            "add rule {f} kube-proxy {ec} meta l4proto {p} dnat to {}",
            ep_port(*ep)
        );
    }
    let _ = writeln!(out, "add element {f} kube-proxy cluster-ips {{ {v} }}");
    let _ = writeln!(
        out,
        "add element {f} kube-proxy service-ips {{ {v} . {p} . {port} : goto {sc} }}"
    );
}

/// `nft -f` texts loading `entries`: the base plus entries of up to
/// `chunk` services per transaction (kube-proxy's cold start), or one
/// transaction when `chunk` is 0; the table of the entries' family.
pub fn nft_chunks(entries: &[Entry], chunk: usize) -> Vec<String> {
    let mut out = vec![nft_base(family_of(entries))];
    let mut services_in_chunk = 0;
    let mut last_index = None;
    for e in entries {
        if last_index != Some(e.index) {
            last_index = Some(e.index);
            if chunk > 0 && services_in_chunk == chunk {
                out.push(String::new());
                services_in_chunk = 0;
            }
            services_in_chunk += 1;
        }
        nft_entry(e, out.last_mut().expect("one chunk"));
    }
    out
}

/// One `nft -f` transaction adding `new`.
pub fn nft_add(new: &[Entry]) -> String {
    let mut s = String::new();
    for e in new {
        nft_entry(e, &mut s);
    }
    s
}

// ----------------------------------------------------------------- manifests

/// The entries as manifests for the agent: one Service (ClusterIP given)
/// and one EndpointSlice per service, as JSON documents of one YAML stream.
/// IPv6 entries make single-stack IPv6 Services (`ipFamilies: [IPv6]`,
/// `ipFamilyPolicy: SingleStack`) and `addressType: IPv6` slices.
pub fn manifests(entries: &[Entry], lb_algorithm: Option<&str>) -> String {
    let annotations = lb_algorithm.map_or(String::new(), |a| {
        format!(r#","annotations":{{"proxy-agent.io/lb-algorithm":"{a}"}}"#)
    });
    let mut out = String::with_capacity(entries.len() * 700);
    let mut i = 0;
    while i < entries.len() {
        let idx = entries[i].index;
        let mut j = i;
        while j < entries.len() && entries[j].index == idx {
            j += 1;
        }
        let group = &entries[i..j];
        let first = &group[0];
        let (ns, name) = first.name.split_once('/').expect("ns/name");
        let proto = |p: &str| if p == "udp" { "UDP" } else { "TCP" };
        let (families, address_type) = match first.family() {
            Family::Ipv4 => ("", "IPv4"),
            Family::Ipv6 => (
                r#","ipFamilies":["IPv6"],"ipFamilyPolicy":"SingleStack""#,
                "IPv6",
            ),
        };
        let svc_ports: Vec<String> = group
            .iter()
            .map(|e| {
                format!(
                    r#"{{"name":"{}","port":{},"protocol":"{}","targetPort":{TPORT}}}"#,
                    e.port_name,
                    e.port,
                    proto(e.proto)
                )
            })
            .collect();
        let _ = writeln!(
            out,
            r#"---
{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}","namespace":"{ns}"{annotations}}},"spec":{{"type":"ClusterIP","clusterIP":"{v}","clusterIPs":["{v}"]{families},"ports":[{ports}]}}}}"#,
            v = first.vip,
            ports = svc_ports.join(",")
        );
        let eps: Vec<String> = first
            .eps
            .iter()
            .map(|ep| format!(r#"{{"addresses":["{ep}"],"conditions":{{"ready":true}}}}"#))
            .collect();
        let slice_ports: Vec<String> = group
            .iter()
            .map(|e| {
                format!(
                    r#"{{"name":"{}","port":{TPORT},"protocol":"{}"}}"#,
                    e.port_name,
                    proto(e.proto)
                )
            })
            .collect();
        let _ = writeln!(
            out,
            r#"---
{{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{{"name":"{name}-bench","namespace":"{ns}","labels":{{"kubernetes.io/service-name":"{name}"}}}},"addressType":"{address_type}","endpoints":[{eps}],"ports":[{ports}]}}"#,
            eps = eps.join(","),
            ports = slice_ports.join(",")
        );
        i = j;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_match_kube_proxy() {
        // kube-proxy's own unit test: ns1/svc1:p80 tcp -> KUBE-SVC-XPGD46QRK7WJZT7O.
        assert_eq!(h16("ns1/svc1:p80tcp"), "XPGD46QRK7WJZT7O");
    }

    fn eps4() -> [IpAddr; 2] {
        [
            Ipv4Addr::new(198, 18, 1, 2).into(),
            Ipv4Addr::new(198, 18, 1, 3).into(),
        ]
    }

    fn eps6() -> [IpAddr; 2] {
        [
            "2001:2:0:1::2".parse().unwrap(),
            "2001:2:0:1::3".parse().unwrap(),
        ]
    }

    #[test]
    fn vips_and_layout() {
        assert_eq!(vip(0), Ipv4Addr::new(198, 19, 0, 1));
        assert_eq!(vip(255), Ipv4Addr::new(198, 19, 1, 0));
        let eps = eps4();
        let entries: Vec<Entry> = (0..3)
            .flat_map(|i| service_entries(i, Family::Ipv4, &eps, false))
            .collect();
        let t = ipt_full(&entries);
        assert!(t.contains("--probability 0.5000000000"));
        assert!(t.contains("-j DNAT --to-destination 198.18.1.3:8080"));
        let chunks = nft_chunks(&entries, 2);
        assert_eq!(chunks.len(), 2);
        assert!(chunks[0].contains("numgen random mod 2 vmap"));
    }

    /// Service i's (VIP, port) is unique over 200,000 Services in both
    /// families, stays in the Service CIDRs, and the first 65,534 keep
    /// the one-VIP-per-Service layout on port 80.
    #[test]
    fn service_addresses_are_unique_beyond_one_vip_each() {
        const N: usize = 200_000;
        for family in Family::ALL {
            let mut seen = std::collections::HashSet::with_capacity(N);
            for i in 0..N {
                let a = svc_addr(family, i);
                assert!(seen.insert(a), "{a} twice (service {i})");
                assert_eq!(a.ip(), vip_in(family, i));
                assert_eq!(a.port(), svc_port(i));
                match a.ip() {
                    IpAddr::V4(v) => {
                        let o = v.octets();
                        assert_eq!(&o[..2], &[198, 19], "{v} outside 198.19.0.0/16");
                        assert!(v != Ipv4Addr::new(198, 19, 0, 0));
                        assert!(v != Ipv4Addr::new(198, 19, 255, 255));
                    }
                    IpAddr::V6(v) => {
                        let s = v.segments();
                        assert_eq!(&s[..7], &[0x2001, 2, 0, 0xff, 0, 0, 0], "{v}");
                        assert!(s[7] != 0 && s[7] != 0xffff, "{v}");
                    }
                }
            }
        }
        // Unchanged below 65,534: VIP i + 1, port 80 (today's figures).
        for i in (0..VIPS).step_by(97).chain([VIPS - 1]) {
            let h = i + 1;
            assert_eq!(
                vip(i),
                Ipv4Addr::new(198, 19, (h >> 8) as u8, (h & 0xff) as u8)
            );
            assert_eq!(
                vip6(i),
                Ipv6Addr::new(0x2001, 2, 0, 0xff, 0, 0, 0, h as u16)
            );
            assert_eq!(svc_port(i), PORT);
            let e = &service_entries(i, Family::Ipv4, &eps4(), true);
            assert_eq!((e[0].port_name.as_str(), e[0].port), ("p80", 80));
            assert_eq!((e[1].port_name.as_str(), e[1].port), ("u80", 80));
        }
        assert_eq!(vip(VIPS - 1), Ipv4Addr::new(198, 19, 255, 254));
        // Then the VIPs again, one port up.
        assert_eq!(
            svc_addr(Family::Ipv4, VIPS),
            "198.19.0.1:81".parse().unwrap()
        );
        assert_eq!(
            svc_addr(Family::Ipv6, 2 * VIPS + 4),
            "[2001:2:0:ff::5]:82".parse().unwrap()
        );
        assert_eq!(svc_port(N - 1), 83);
        assert_eq!(
            svc_addr(Family::Ipv4, MAX_SERVICES - 1),
            "198.19.255.254:65535".parse().unwrap()
        );
    }

    #[test]
    #[should_panic(expected = "beyond the layout")]
    fn no_service_beyond_the_ports() {
        vip(MAX_SERVICES);
    }

    /// Services sharing a VIP: every layout matches each on its own port.
    #[test]
    fn shared_vips_have_their_own_ports_in_every_layout() {
        let eps = eps4();
        let entries: Vec<Entry> = [0, VIPS, 2 * VIPS]
            .into_iter()
            .flat_map(|i| service_entries(i, Family::Ipv4, &eps, i == VIPS))
            .collect();
        assert!(entries.iter().all(|e| e.vip == vip_in(Family::Ipv4, 0)));
        let ipt = ipt_full(&entries);
        for (svc, pn, proto, port) in [
            ("ns0/svc0", "p80", "tcp", 80),
            ("ns65534/svc65534", "p81", "tcp", 81),
            ("ns65534/svc65534", "u81", "udp", 81),
            ("ns131068/svc131068", "p82", "tcp", 82),
        ] {
            let chain = h16(&format!("{svc}:{pn}{proto}"));
            let want = format!(
                "-A KUBE-SERVICES -m comment --comment \"{svc}:{pn} cluster IP\" -m {proto} -p {proto} -d 198.19.0.1 --dport {port} -j KUBE-SVC-{chain}"
            );
            assert!(ipt.contains(&want), "missing {want:?}");
            assert!(ipt.contains(&format!(
                "-A KUBE-SVC-{chain} -m comment --comment \"{svc}:{pn} cluster IP\" -m {proto} -p {proto} -d 198.19.0.1 --dport {port} ! -s"
            )));
        }
        let part = ipt_partial_add(
            &entries,
            &service_entries(3 * VIPS, Family::Ipv4, &eps, false),
        );
        assert!(part.contains("-d 198.19.0.1 --dport 83 -j KUBE-SVC-"));
        assert_eq!(
            part.matches("-A KUBE-SERVICES -m comment --comment \"ns")
                .count(),
            5
        );

        let nft = nft_chunks(&entries, 0).remove(0);
        for want in [
            "ip daddr 198.19.0.1 tcp dport 80 ip saddr",
            "ip daddr 198.19.0.1 tcp dport 81 ip saddr",
            "ip daddr 198.19.0.1 udp dport 81 ip saddr",
            "ip daddr 198.19.0.1 tcp dport 82 ip saddr",
            "service-ips { 198.19.0.1 . tcp . 80 : goto service-",
            "service-ips { 198.19.0.1 . tcp . 81 : goto service-",
            "service-ips { 198.19.0.1 . udp . 81 : goto service-",
            "service-ips { 198.19.0.1 . tcp . 82 : goto service-",
            "-ns65534/svc65534/udp/u81",
        ] {
            assert!(nft.contains(want), "missing {want:?}");
        }
        assert!(
            nft_add(&service_entries(VIPS + 7, Family::Ipv6, &eps6(), false))
                .contains("ip6 kube-proxy service-ips { 2001:2:0:ff::8 . tcp . 81 : goto")
        );

        let m = manifests(&entries, None);
        assert!(m.contains(r#""name":"svc65534","namespace":"ns65534"},"spec":{"type":"ClusterIP","clusterIP":"198.19.0.1","clusterIPs":["198.19.0.1"],"ports":[{"name":"p81","port":81,"protocol":"TCP","targetPort":8080},{"name":"u81","port":81,"protocol":"UDP","targetPort":8080}]"#));
        assert!(
            m.contains(r#""ports":[{"name":"p82","port":82,"protocol":"TCP","targetPort":8080}]"#)
        );
        assert!(
            m.contains(r#""ports":[{"name":"p80","port":80,"protocol":"TCP","targetPort":8080}]"#)
        );
        // The slices' ports are the target port, named as the Service's.
        assert!(m.contains(r#""ports":[{"name":"p81","port":8080,"protocol":"TCP"},{"name":"u81","port":8080,"protocol":"UDP"}]"#));
    }

    /// The port prints what the reference script prints (when the script
    /// and python3 are there: `../shared/reference/kube-proxy-layouts.py`).
    #[test]
    fn matches_the_reference_script() {
        let script =
            crate::setup::workspace_root().join("../shared/reference/kube-proxy-layouts.py");
        if !script.exists() {
            eprintln!("skipped: {} missing", script.display());
            return;
        }
        let eps = eps4();
        let entries: Vec<Entry> = (0..3)
            .flat_map(|i| service_entries(i, Family::Ipv4, &eps, false))
            .collect();
        let py = |kind: &str, n: &str| -> Option<String> {
            let o = std::process::Command::new("python3")
                .arg(&script)
                .args([kind, n, "2"])
                .output()
                .ok()?;
            o.status
                .success()
                .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
        };
        let Some(ipt) = py("ipt_full", "3") else {
            eprintln!("skipped: python3 not available");
            return;
        };
        assert_eq!(ipt_full(&entries), ipt);
        assert_eq!(
            ipt_partial_add(&entries, &service_entries(3, Family::Ipv4, &eps, false)),
            py("ipt_partial_add", "3").unwrap()
        );
        let nft_mine = nft_chunks(&entries, 0).remove(0);
        let nft_ref = py("nft_full", "3").unwrap();
        let norm = |t: &str| {
            t.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        assert_eq!(norm(&nft_mine), norm(&nft_ref));
        assert_eq!(
            nft_add(&service_entries(3, Family::Ipv4, &eps, false)),
            py("nft_add_one", "3").unwrap()
        );
    }

    /// IPv6 is IPv4's layout with IPv6 addresses: line for line the same
    /// rules once the addresses (and the endpoint's written form) are
    /// mapped, kube-proxy's IPv6 details where it has them, and every
    /// address from 2001:2::/48.
    #[test]
    fn ipv6_layouts_mirror_ipv4() {
        assert_eq!(vip6(0), "2001:2:0:ff::1".parse::<Ipv6Addr>().unwrap());
        assert_eq!(
            vip6(65_533),
            "2001:2:0:ff::fffe".parse::<Ipv6Addr>().unwrap()
        );
        assert_eq!(
            dummy_ep_in(Family::Ipv6, 0),
            "2001:2:0:c8::2".parse::<IpAddr>().unwrap()
        );
        let four: Vec<Entry> = (0..3)
            .flat_map(|i| service_entries(i, Family::Ipv4, &eps4(), i == 1))
            .collect();
        let six: Vec<Entry> = (0..3)
            .flat_map(|i| service_entries(i, Family::Ipv6, &eps6(), i == 1))
            .collect();
        assert!(six.iter().all(|e| e.family() == Family::Ipv6));

        let ipt6 = ipt_full(&six);
        assert!(ipt6.contains(
            "-m tcp -p tcp -d 2001:2:0:ff::2 --dport 80 ! -s 2001:2::/56 -j KUBE-MARK-MASQ"
        ));
        assert!(ipt6.contains("-j DNAT --to-destination [2001:2:0:1::3]:8080"));
        assert!(ipt6.contains("\"ns1/svc1:u80 -> [2001:2:0:1::2]:8080\""));
        assert!(ipt6.contains("--dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS"));
        // The KUBE-SEP hash is of the endpoint as kube-proxy writes it.
        let sep = h16("ns0/svc0:p80tcp[2001:2:0:1::2]:8080");
        assert!(ipt6.contains(&format!(":KUBE-SEP-{sep} - [0:0]")));
        // The same rules, line for line, as IPv4's (chain names aside:
        // their hashes cover the addresses).
        let shape = |t: &str| -> Vec<String> {
            t.lines()
                .map(|l| {
                    l.split_whitespace()
                        .filter(|w| !w.starts_with("KUBE-SEP-") && !w.starts_with(":KUBE-SEP-"))
                        .filter(|w| !w.contains("198.") && !w.contains("2001:") && *w != "::1/128")
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect()
        };
        let (s4, s6) = (shape(&ipt_full(&four)), shape(&ipt6));
        assert_eq!(s4.len(), s6.len());
        for (a, b) in s4.iter().zip(&s6) {
            // The NodePorts jump's `! -d ::1/128` leaves `! -d`.
            assert_eq!(a, &b.replace("LOCAL ! -d -j", "LOCAL -j"));
        }
        let part6 = ipt_partial_add(&six, &service_entries(3, Family::Ipv6, &eps6(), false));
        assert!(part6.contains("-d 2001:2:0:ff::4 --dport 80"));
        assert!(part6.contains("! -d ::1/128 -j KUBE-NODEPORTS"));

        let nft6 = nft_chunks(&six, 0).remove(0);
        for want in [
            "add table ip6 kube-proxy",
            "type ipv6_addr . inet_proto . inet_service : verdict",
            "ip6 daddr . meta l4proto . th dport vmap @service-ips",
            "ip6 daddr { 2001:2:0:ff::/112 } drop",
            "ip6 daddr 2001:2:0:ff::1 tcp dport 80 ip6 saddr != 2001:2::/56 jump mark-for-masquerade",
            "__2001.2.0.1..3/8080 meta l4proto tcp dnat to [2001:2:0:1::3]:8080",
            "add element ip6 kube-proxy service-ips { 2001:2:0:ff::2 . udp . 80 : goto service-",
        ] {
            assert!(nft6.contains(want), "missing {want:?}");
        }
        for l in nft6.lines().filter(|l| !l.trim().is_empty()) {
            assert!(
                !l.contains(" ip kube-proxy")
                    && !l.contains("ipv4_addr")
                    && !l.contains("ip daddr")
                    && !l.contains("ip saddr"),
                "{l}"
            );
        }
        assert_eq!(
            nft_chunks(&four, 0).remove(0).lines().count(),
            nft6.lines().count()
        );

        let m = manifests(&six, None);
        assert!(m.contains(r#""clusterIP":"2001:2:0:ff::2","clusterIPs":["2001:2:0:ff::2"],"ipFamilies":["IPv6"],"ipFamilyPolicy":"SingleStack""#));
        assert!(m.contains(r#""addressType":"IPv6","endpoints":[{"addresses":["2001:2:0:1::2"]"#));
        assert!(!manifests(&four, None).contains("ipFamilies"));

        // Every IPv6 address written is in 2001:2::/48.
        for t in [ipt6, nft6, m] {
            for w in t.split(|c: char| !(c.is_ascii_hexdigit() || c == ':')) {
                if let Ok(a) = w.parse::<Ipv6Addr>() {
                    assert!(
                        a.is_loopback() || crate::netns::in_lab_range6(a),
                        "{a} outside 2001:2::/48"
                    );
                }
            }
        }
    }
}

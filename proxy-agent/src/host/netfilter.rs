//! Whether a NetworkPolicy engine filters forwarded traffic in the host's
//! netfilter (iptables or nftables): the question `deliveryMode: auto` asks.
//!
//! A translated packet that is redirected (`bpf_redirect_peer`,
//! `bpf_redirect_neigh`) never reaches netfilter's FORWARD hook, so an
//! engine that enforces NetworkPolicy there (Calico's iptables and nftables
//! dataplanes, Canal, kube-router, Weave Net, kube-network-policies) never
//! sees it: a pod denied B would reach B through B's ClusterIP. With such an
//! engine present the datapath hands translated packets to the stack
//! instead (`ct_flags::VIA_STACK`).
//!
//! The chains are listed read-only: nftables over nfnetlink (which also
//! holds the rules of `iptables-nft`), legacy iptables' `filter` table with
//! `IPT_SO_GET_ENTRIES` only when that table exists already (asking would
//! load `iptable_filter`, which hooks FORWARD).

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

/// A chain of the host's netfilter: its table and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub table: String,
    pub name: String,
}

/// The policy engine whose chains are in `chains`, by the names the engines
/// give them; `None` when none is recognised.
pub fn policy_engine(chains: &[Chain]) -> Option<&'static str> {
    for c in chains {
        let n = c.name.as_str();
        let engine = if n.starts_with("cali-") || c.table == "calico" {
            "Calico"
        } else if n.starts_with("KUBE-ROUTER-") || n.starts_with("KUBE-NWPLCY-") {
            "kube-router"
        } else if n.starts_with("WEAVE-NPC") {
            "Weave Net"
        } else if c.table == "kube-network-policies" {
            "kube-network-policies"
        } else if n.starts_with("ANTREA-") && n.contains("POL") {
            "Antrea"
        } else {
            continue;
        };
        return Some(engine);
    }
    None
}

/// kube-proxy's chains in `chains`: its mode, when its rules (a proxy that
/// translates with the kernel's NAT) are in the host's netfilter. The
/// iptables and ipvs modes' filter chains are in legacy iptables' `filter`
/// table or, with `iptables-nft`, in nftables; the nftables mode has a
/// table of its own.
pub fn kube_proxy(chains: &[Chain]) -> Option<&'static str> {
    const IPTABLES: [&str; 5] = [
        "KUBE-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-PROXY-FIREWALL",
    ];
    chains.iter().find_map(|c| {
        if c.table == "kube-proxy" {
            Some("nftables")
        } else if IPTABLES.contains(&c.name.as_str()) {
            Some("iptables or ipvs")
        } else {
            None
        }
    })
}

/// Every chain of the host's nftables (`iptables-nft` included) and legacy
/// iptables `filter` table, in this network namespace.
pub fn chains() -> io::Result<Vec<Chain>> {
    let mut out = Vec::new();
    // nftables is asked always: where it is a module not loaded yet, the
    // dump loads it (a module without tables or hooks changes nothing).
    match nft_chains() {
        Ok(c) => out.extend(c),
        // No nfnetlink or nftables in this kernel: no nftables rules.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EPROTONOSUPPORT | libc::EOPNOTSUPP)
            ) => {}
        Err(e) => return Err(e),
    }
    let legacy = std::fs::read_to_string("/proc/net/ip_tables_names").unwrap_or_default();
    if legacy.lines().any(|t| t.trim() == "filter") {
        out.extend(legacy_chains("filter")?);
    }
    Ok(out)
}

fn socket(domain: i32, ty: i32, proto: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, proto) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

// ---------------------------------------------------------------- nftables

pub(super) const NETLINK_NETFILTER: i32 = 12;
pub(super) const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETCHAIN: u16 = 4;
pub(super) const NFT_MSG_NEWCHAIN: u16 = 3;
pub(super) const NFTA_CHAIN_TABLE: u16 = 1;
pub(super) const NFTA_CHAIN_NAME: u16 = 3;
pub(super) const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
pub(super) const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_HDRLEN: usize = 16;
const NFGENMSG_LEN: usize = 4;

/// An `NFT_MSG_GETCHAIN` dump request of every family.
fn getchain_request(seq: u32) -> Vec<u8> {
    // nfgenmsg: family NFPROTO_UNSPEC (all), resource id 0.
    message(
        (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETCHAIN,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        0,
        0,
        &[],
    )
}

/// A netfilter netlink message: its header, an `nfgenmsg` (family, version
/// 0, resource id, network order), then `attrs`.
pub(super) fn message(
    ty: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
    attrs: &[u8],
) -> Vec<u8> {
    let len = NLMSG_HDRLEN + NFGENMSG_LEN + attrs.len();
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&ty.to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.push(family);
    m.push(0);
    m.extend_from_slice(&res_id.to_ne_bytes());
    m.extend_from_slice(attrs);
    m
}

/// The netlink messages in one buffer: each one's type and body (what
/// follows its header).
pub(super) fn messages(buf: &[u8]) -> io::Result<Vec<(u16, &[u8])>> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + NLMSG_HDRLEN <= buf.len() {
        let len = u32::from_ne_bytes(buf[off..off + 4].try_into().unwrap()) as usize;
        let ty = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().unwrap());
        if len < NLMSG_HDRLEN || off + len > buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "truncated netlink message",
            ));
        }
        out.push((ty, &buf[off + NLMSG_HDRLEN..off + len]));
        off += (len + 3) & !3;
    }
    Ok(out)
}

/// The errno of an `NLMSG_ERROR` body (0: an acknowledgement).
pub(super) fn errno(body: &[u8]) -> i32 {
    body.get(..4)
        .map_or(0, |b| i32::from_ne_bytes(b.try_into().unwrap()))
}

/// The chains in one buffer of netlink messages; `Ok(true)` once the dump
/// is done.
fn parse_chains(buf: &[u8], out: &mut Vec<Chain>) -> io::Result<bool> {
    for (ty, body) in messages(buf)? {
        match ty {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let errno = errno(body);
                if errno != 0 {
                    return Err(io::Error::from_raw_os_error(-errno));
                }
                return Ok(true);
            }
            t if t == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWCHAIN => {
                let (mut table, mut name) = (None, None);
                let mut a = NFGENMSG_LEN;
                while a + 4 <= body.len() {
                    let alen = u16::from_ne_bytes(body[a..a + 2].try_into().unwrap()) as usize;
                    let aty = u16::from_ne_bytes(body[a + 2..a + 4].try_into().unwrap()) & 0x3fff;
                    if alen < 4 || a + alen > body.len() {
                        break;
                    }
                    let v = &body[a + 4..a + alen];
                    let s = || {
                        String::from_utf8_lossy(v.split(|b| *b == 0).next().unwrap_or(&[]))
                            .into_owned()
                    };
                    match aty {
                        NFTA_CHAIN_TABLE => table = Some(s()),
                        NFTA_CHAIN_NAME => name = Some(s()),
                        _ => {}
                    }
                    a += (alen + 3) & !3;
                }
                if let (Some(table), Some(name)) = (table, name) {
                    out.push(Chain { table, name });
                }
            }
            _ => {}
        }
    }
    Ok(false)
}

fn nft_chains() -> io::Result<Vec<Chain>> {
    let fd = crate::host::sockdiag::netlink_socket(NETLINK_NETFILTER)?;
    let req = getchain_request(1);
    // SAFETY: sending a buffer of its length.
    if unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    // Bounded: a dump of even thousands of chains is a few buffers.
    for _ in 0..10_000 {
        // SAFETY: receiving into a buffer of its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if parse_chains(&buf[..n as usize], &mut out)? {
            return Ok(out);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        "nftables chain dump did not end",
    ))
}

// ---------------------------------------------------------------- legacy iptables

const IPT_SO_GET_INFO: i32 = 64;
const IPT_SO_GET_ENTRIES: i32 = 65;
const XT_TABLE_MAXNAMELEN: usize = 32;
/// `struct ipt_getinfo`: name, valid_hooks, hook_entry[5], underflow[5],
/// num_entries, size.
const GETINFO_LEN: usize = XT_TABLE_MAXNAMELEN + 4 + 20 + 20 + 4 + 4;
/// `struct ipt_entry` up to its matches: `ipt_ip` (84), nfcache, target and
/// next offsets, comefrom, counters.
const ENTRY_TARGET_OFFSET_AT: usize = 84 + 4;
const ENTRY_NEXT_OFFSET_AT: usize = ENTRY_TARGET_OFFSET_AT + 2;
/// `struct xt_entry_target`: target_size (2), name (29), revision (1).
const TARGET_NAME_AT: usize = 2;
const TARGET_DATA_AT: usize = 32;

/// User-defined chains of a legacy iptables table: in the blob of entries,
/// each starts with an `ERROR` target whose data is the chain's name (the
/// last `ERROR` entry, named `ERROR`, ends the table).
fn parse_legacy_entries(table: &str, blob: &[u8], out: &mut Vec<Chain>) {
    let cstr =
        |b: &[u8]| String::from_utf8_lossy(b.split(|c| *c == 0).next().unwrap_or(&[])).into_owned();
    let mut off = 0;
    while off + ENTRY_NEXT_OFFSET_AT + 2 <= blob.len() {
        let at = |i: usize| u16::from_ne_bytes([blob[off + i], blob[off + i + 1]]) as usize;
        let (target, next) = (at(ENTRY_TARGET_OFFSET_AT), at(ENTRY_NEXT_OFFSET_AT));
        if next == 0 || off + next > blob.len() {
            return;
        }
        let t = off + target;
        if t + TARGET_DATA_AT + XT_TABLE_MAXNAMELEN <= off + next
            && cstr(&blob[t + TARGET_NAME_AT..t + TARGET_NAME_AT + 29]) == "ERROR"
        {
            let name = cstr(&blob[t + TARGET_DATA_AT..t + TARGET_DATA_AT + XT_TABLE_MAXNAMELEN]);
            if name != "ERROR" {
                out.push(Chain {
                    table: table.to_owned(),
                    name,
                });
            }
        }
        off += next;
    }
}

/// `getsockopt(IPPROTO_IP, opt)` into `buf` (which carries the request in).
fn getsockopt_ip(fd: &OwnedFd, opt: i32, buf: &mut [u8]) -> io::Result<()> {
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: getsockopt into a buffer of the length given.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_IP,
            opt,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn legacy_chains(table: &str) -> io::Result<Vec<Chain>> {
    let fd = socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW)?;
    let mut info = [0u8; GETINFO_LEN];
    info[..table.len().min(XT_TABLE_MAXNAMELEN - 1)]
        .copy_from_slice(&table.as_bytes()[..table.len().min(XT_TABLE_MAXNAMELEN - 1)]);
    getsockopt_ip(&fd, IPT_SO_GET_INFO, &mut info)?;
    let size = u32::from_ne_bytes(info[GETINFO_LEN - 4..].try_into().unwrap()) as usize;
    // `struct ipt_get_entries`: name, size, then the entries.
    let head = XT_TABLE_MAXNAMELEN + 4;
    let mut buf = vec![0u8; head + size];
    buf[..XT_TABLE_MAXNAMELEN].copy_from_slice(&info[..XT_TABLE_MAXNAMELEN]);
    buf[XT_TABLE_MAXNAMELEN..head].copy_from_slice(&(size as u32).to_ne_bytes());
    getsockopt_ip(&fd, IPT_SO_GET_ENTRIES, &mut buf)?;
    let mut out = Vec::new();
    parse_legacy_entries(table, &buf[head..], &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(table: &str, name: &str) -> Chain {
        Chain {
            table: table.into(),
            name: name.into(),
        }
    }

    #[test]
    fn engines_are_known_by_their_chains() {
        let plain = [chain("filter", "FORWARD"), chain("filter", "DOCKER-USER")];
        assert_eq!(policy_engine(&plain), None);
        for (c, engine) in [
            (chain("filter", "cali-FORWARD"), "Calico"),
            (chain("calico", "filter-FORWARD"), "Calico"),
            (chain("filter", "KUBE-ROUTER-FORWARD"), "kube-router"),
            (chain("filter", "KUBE-NWPLCY-ABCDEF"), "kube-router"),
            (chain("filter", "WEAVE-NPC-INGRESS"), "Weave Net"),
            (
                chain("kube-network-policies", "forward"),
                "kube-network-policies",
            ),
        ] {
            let mut all = plain.to_vec();
            all.push(c.clone());
            assert_eq!(policy_engine(&all), Some(engine), "{c:?}");
        }
        // kube-proxy's own chains are not a policy engine.
        assert_eq!(policy_engine(&[chain("filter", "KUBE-FORWARD")]), None);
    }

    #[test]
    fn kube_proxy_is_known_by_its_chains() {
        let plain = [chain("filter", "FORWARD"), chain("nat", "DOCKER")];
        assert_eq!(kube_proxy(&plain), None);
        // Another project's chains with a KUBE- prefix are not kube-proxy's.
        assert_eq!(kube_proxy(&[chain("filter", "KUBE-ROUTER-FORWARD")]), None);
        assert_eq!(
            kube_proxy(&[chain("kube-proxy", "services")]),
            Some("nftables")
        );
        for name in ["KUBE-FORWARD", "KUBE-SERVICES", "KUBE-PROXY-FIREWALL"] {
            assert_eq!(
                kube_proxy(&[plain[0].clone(), chain("filter", name)]),
                Some("iptables or ipvs"),
                "{name}"
            );
        }
    }

    /// A netlink buffer as the kernel writes it: two chains, then DONE.
    #[test]
    fn nft_chain_dump_is_parsed() {
        fn attr(ty: u16, s: &str) -> Vec<u8> {
            let mut v = Vec::new();
            let len = 4 + s.len() + 1;
            v.extend_from_slice(&(len as u16).to_ne_bytes());
            v.extend_from_slice(&ty.to_ne_bytes());
            v.extend_from_slice(s.as_bytes());
            v.push(0);
            while v.len() % 4 != 0 {
                v.push(0);
            }
            v
        }
        fn msg(ty: u16, body: &[u8]) -> Vec<u8> {
            let mut m = Vec::new();
            m.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
            m.extend_from_slice(&ty.to_ne_bytes());
            m.extend_from_slice(&[0; 10]);
            m.extend_from_slice(body);
            while m.len() % 4 != 0 {
                m.push(0);
            }
            m
        }
        let newchain = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWCHAIN;
        let mut buf = Vec::new();
        for (t, n) in [("filter", "cali-FORWARD"), ("kprtest", "fwd")] {
            let mut body = vec![2, 0, 0, 0];
            body.extend(attr(NFTA_CHAIN_TABLE, t));
            body.extend(attr(2, "handle")); // another attribute, skipped
            body.extend(attr(NFTA_CHAIN_NAME, n));
            buf.extend(msg(newchain, &body));
        }
        let mut out = Vec::new();
        assert!(!parse_chains(&buf, &mut out).unwrap());
        buf = msg(NLMSG_DONE, &[0; 4]);
        assert!(parse_chains(&buf, &mut out).unwrap());
        assert_eq!(
            out,
            vec![chain("filter", "cali-FORWARD"), chain("kprtest", "fwd")]
        );
        // A truncated message is an error, not a panic.
        let mut bad = msg(newchain, &[0; 8]);
        bad[0] = 200;
        assert!(parse_chains(&bad, &mut out).is_err());
    }
}

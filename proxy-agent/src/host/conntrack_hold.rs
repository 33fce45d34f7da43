//! Keeps the kernel's conntrack running in this network namespace while
//! flows handed over from kube-proxy ([`super::handover`]) still need it.
//!
//! The kernel runs conntrack in a namespace only while something there
//! asks for it (`nf_ct_netns_get`): a NAT rule, a `ct` match. kube-proxy's
//! rules ask for it; once they are removed (`kube-proxy --cleanup`, or its
//! nftables table deleted) and nothing else asks, conntrack stops seeing
//! packets. The entries of the flows kube-proxy translated stay in the
//! table, but no packet meets them any more: a handed-over flow, passed to
//! the stack untranslated, goes to the Service's address itself and is
//! lost. On a node where nothing else uses conntrack (an IPv6 node without
//! other rules, most often) every UDP flow and TCP connection kube-proxy
//! translated was broken by the takeover.
//!
//! The same holds for NAT: the kernel applies an entry's translation only
//! while a `nat` chain of that family is registered. kube-proxy's nftables
//! mode deletes its whole table on cleanup, its `nat` chains with it; the
//! iptables mode leaves the empty built-in chains behind.
//!
//! So while the handover maps hold live entries, the agent keeps one
//! nftables table of its own (family `inet`: both families), [`TABLE`]:
//! - a regular chain, [`CHAIN`], that no hook calls (no packet walks it),
//!   with one rule that loads `ct state`: the rule is what asks the kernel
//!   for conntrack;
//! - an empty `nat` chain on each NAT hook (prerouting, input, output,
//!   postrouting), policy accept: they keep the kernel's NAT applying the
//!   entries' translations. A `nat` chain is walked only by the first
//!   packet of a new kernel conntrack entry, and an empty one changes
//!   nothing.
//!
//! The table is removed once no handed-over flow is left, and by
//! `proxy-agent cleanup`. Where conntrack and NAT run anyway (kube-proxy's
//! rules still there, a CNI's masquerading) it changes nothing.

use std::io;
use std::os::fd::AsRawFd;

use super::netfilter::{
    errno, message, messages, NETLINK_NETFILTER, NFNL_SUBSYS_NFTABLES, NFTA_CHAIN_NAME,
    NFTA_CHAIN_TABLE, NFT_MSG_NEWCHAIN, NLMSG_ERROR, NLM_F_REQUEST,
};

/// The nftables table (family `inet`) that holds conntrack on.
pub const TABLE: &str = "proxy-agent-handover";
/// Its chain that holds conntrack: a regular chain, attached to no hook.
pub const CHAIN: &str = "conntrack";
/// Its empty `nat` chains: (name, hook, priority).
const NAT_CHAINS: [(&str, u32, i32); 4] = [
    ("nat-prerouting", NF_INET_PRE_ROUTING, -100),
    ("nat-input", NF_INET_LOCAL_IN, 100),
    ("nat-output", NF_INET_LOCAL_OUT, -100),
    ("nat-postrouting", NF_INET_POST_ROUTING, 100),
];

const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWRULE: u16 = 6;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NF_INET_PRE_ROUTING: u32 = 0;
const NF_INET_LOCAL_IN: u32 = 1;
const NF_INET_LOCAL_OUT: u32 = 3;
const NF_INET_POST_ROUTING: u32 = 4;
const NF_ACCEPT: u32 = 1;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
/// nft's rule comment, in the rule's user data (`NFTNL_UDATA_RULE_COMMENT`).
const UDATA_RULE_COMMENT: u8 = 0;
/// The rule's comment: `nft list ruleset` shows it (and nothing else: a
/// lone load has no nft syntax).
pub const COMMENT: &str =
    "proxy-agent: keeps conntrack running for flows handed over from kube-proxy";
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_CT_DREG: u16 = 1;
const NFTA_CT_KEY: u16 = 2;
const NFT_CT_STATE: u32 = 0;
const NFT_REG_1: u32 = 1;
const NFPROTO_UNSPEC: u8 = 0;
const NFPROTO_INET: u8 = 1;
const NLA_F_NESTED: u16 = 0x8000;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;

/// Creates [`TABLE`] with its one rule, replacing one left by an earlier
/// agent (one transaction: the table is never seen half made).
pub fn hold() -> io::Result<()> {
    let table = table_attrs();
    let chain = [
        attr_str(NFTA_CHAIN_TABLE, TABLE),
        attr_str(NFTA_CHAIN_NAME, CHAIN),
    ]
    .concat();
    let ct = [
        attr_u32(NFTA_CT_DREG, NFT_REG_1),
        attr_u32(NFTA_CT_KEY, NFT_CT_STATE),
    ]
    .concat();
    let expr = [attr_str(NFTA_EXPR_NAME, "ct"), nested(NFTA_EXPR_DATA, &ct)].concat();
    let rule = [
        attr_str(NFTA_RULE_TABLE, TABLE),
        attr_str(NFTA_RULE_CHAIN, CHAIN),
        nested(NFTA_RULE_EXPRESSIONS, &nested(NFTA_LIST_ELEM, &expr)),
        attr(NFTA_RULE_USERDATA, &comment(COMMENT)),
    ]
    .concat();
    // Create (a no-op when it exists), delete, create: whatever an earlier
    // agent left, the table ends with exactly these chains and rule.
    let mut msgs = vec![
        (NFT_MSG_NEWTABLE, NLM_F_CREATE, table.clone()),
        (NFT_MSG_DELTABLE, 0, table.clone()),
        (NFT_MSG_NEWTABLE, NLM_F_CREATE, table),
        (NFT_MSG_NEWCHAIN, NLM_F_CREATE, chain),
        (NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, rule),
    ];
    for (name, hook, priority) in NAT_CHAINS {
        let hook = [
            attr_u32(NFTA_HOOK_HOOKNUM, hook),
            attr_u32(NFTA_HOOK_PRIORITY, priority as u32),
        ]
        .concat();
        let chain = [
            attr_str(NFTA_CHAIN_TABLE, TABLE),
            attr_str(NFTA_CHAIN_NAME, name),
            nested(NFTA_CHAIN_HOOK, &hook),
            attr_u32(NFTA_CHAIN_POLICY, NF_ACCEPT),
            attr_str(NFTA_CHAIN_TYPE, "nat"),
        ]
        .concat();
        msgs.push((NFT_MSG_NEWCHAIN, NLM_F_CREATE, chain));
    }
    transaction(&msgs)
}

/// Removes [`TABLE`]; `Ok(false)` when there was none.
pub fn release() -> io::Result<bool> {
    match transaction(&[(NFT_MSG_DELTABLE, 0, table_attrs())]) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether [`TABLE`] is in this namespace's nftables.
pub fn held() -> io::Result<bool> {
    Ok(super::netfilter::chains()?
        .iter()
        .any(|c| c.table == TABLE && c.name == CHAIN))
}

fn table_attrs() -> Vec<u8> {
    attr_str(NFTA_TABLE_NAME, TABLE)
}

/// Sends `msgs` (type, extra flags, attributes) as one nftables batch,
/// each acknowledged; the first error the kernel reports.
fn transaction(msgs: &[(u16, u16, Vec<u8>)]) -> io::Result<()> {
    let fd = super::sockdiag::netlink_socket(NETLINK_NETFILTER)?;
    let res_id = NFNL_SUBSYS_NFTABLES.to_be();
    let mut buf = message(
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        1,
        NFPROTO_UNSPEC,
        res_id,
        &[],
    );
    for (i, (cmd, flags, attrs)) in msgs.iter().enumerate() {
        buf.extend(message(
            (NFNL_SUBSYS_NFTABLES << 8) | cmd,
            NLM_F_REQUEST | NLM_F_ACK | flags,
            2 + i as u32,
            NFPROTO_INET,
            0,
            attrs,
        ));
    }
    buf.extend(message(
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST,
        2 + msgs.len() as u32,
        NFPROTO_UNSPEC,
        res_id,
        &[],
    ));
    // SAFETY: sending a buffer of its length.
    if unsafe { libc::send(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // One acknowledgement per message, or an error that ends the batch.
    let mut acked = 0;
    let mut rx = vec![0u8; 64 * 1024];
    while acked < msgs.len() {
        // SAFETY: receiving into a buffer of its length; the socket's
        // receives time out (`netlink_socket`), so this cannot hang.
        let n = unsafe { libc::recv(fd.as_raw_fd(), rx.as_mut_ptr().cast(), rx.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        if n == 0 {
            return Err(io::Error::other("nfnetlink closed before acknowledging"));
        }
        for errno in errors(&rx[..n])? {
            if errno != 0 {
                return Err(io::Error::from_raw_os_error(-errno));
            }
            acked += 1;
        }
    }
    Ok(())
}

/// The errno of every `NLMSG_ERROR` in a buffer of netlink messages (0: an
/// acknowledgement).
fn errors(buf: &[u8]) -> io::Result<Vec<i32>> {
    Ok(messages(buf)?
        .into_iter()
        .filter(|(ty, _)| *ty == NLMSG_ERROR)
        .map(|(_, body)| errno(body))
        .collect())
}

fn attr(ty: u16, payload: &[u8]) -> Vec<u8> {
    let len = 4 + payload.len();
    let mut a = Vec::with_capacity((len + 3) & !3);
    a.extend_from_slice(&(len as u16).to_ne_bytes());
    a.extend_from_slice(&ty.to_ne_bytes());
    a.extend_from_slice(payload);
    a.resize((len + 3) & !3, 0);
    a
}

fn attr_str(ty: u16, s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    attr(ty, &v)
}

/// nftables' integers are in network byte order.
fn attr_u32(ty: u16, v: u32) -> Vec<u8> {
    attr(ty, &v.to_be_bytes())
}

/// A rule comment as nft writes it in the user data: type, length, the
/// NUL-terminated text (nft allows 128 bytes).
fn comment(text: &str) -> Vec<u8> {
    let mut v = vec![UDATA_RULE_COMMENT, text.len() as u8 + 1];
    v.extend_from_slice(text.as_bytes());
    v.push(0);
    v
}

fn nested(ty: u16, inner: &[u8]) -> Vec<u8> {
    attr(ty | NLA_F_NESTED, inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_strings_terminated() {
        let a = attr_str(NFTA_TABLE_NAME, "abc");
        assert_eq!(a, [8, 0, 1, 0, b'a', b'b', b'c', 0]);
        let a = attr_str(NFTA_TABLE_NAME, "abcd");
        assert_eq!(a.len(), 12, "4 + 5 bytes, padded to 12");
        assert_eq!(u16::from_ne_bytes([a[0], a[1]]), 9);
        let n = nested(NFTA_EXPR_DATA, &attr_u32(NFTA_CT_KEY, NFT_CT_STATE));
        assert_eq!(
            u16::from_ne_bytes([n[2], n[3]]),
            NFTA_EXPR_DATA | NLA_F_NESTED
        );
        assert_eq!(&n[8..12], &0u32.to_be_bytes());
    }

    #[test]
    fn the_comment_fits_nft_limit() {
        assert!(COMMENT.len() < 128);
        let c = comment("ab");
        assert_eq!(c, [UDATA_RULE_COMMENT, 3, b'a', b'b', 0]);
    }

    #[test]
    fn errors_are_read_from_acknowledgements() {
        let mut buf = Vec::new();
        for errno in [0i32, -libc::ENOENT] {
            let mut m = Vec::new();
            m.extend_from_slice(&36u32.to_ne_bytes());
            m.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
            m.extend_from_slice(&[0; 10]);
            m.extend_from_slice(&errno.to_ne_bytes());
            m.extend_from_slice(&[0; 16]);
            buf.extend(m);
        }
        assert_eq!(errors(&buf).unwrap(), vec![0, -libc::ENOENT]);
        assert!(
            errors(&buf[..20]).is_err(),
            "a message cut short is an error"
        );
    }
}

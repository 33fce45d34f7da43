//! The addresses configured on this node's external interfaces, kept from
//! rtnetlink's address and link messages: with the Node's InternalIPs, the
//! candidates of its NodePort addresses ([`crate::model::NodePortAddresses`]).
//! An address added after the agent started (a keepalived or kube-vip VIP)
//! serves NodePorts from the next sync on, as under kube-proxy's iptables
//! mode (`--dst-type LOCAL`) and Cilium (the addresses of its devices).
//!
//! Only usable addresses count: global scope (not host, link or site),
//! neither loopback nor link-local, not tentative nor failed duplicate
//! address detection (an IPv6 address serves once DAD is done: the kernel
//! says so with a new message). Interfaces are told apart by index; which
//! are external is decided by name where they are listed or renamed.
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use netlink_packet_route::address::{
    AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage, AddressScope,
};

/// The usable addresses of every interface, and which interfaces are
/// external.
#[derive(Clone, Debug, Default)]
pub struct InterfaceAddresses {
    /// Indexes of the external interfaces.
    external: BTreeSet<u32>,
    /// Usable addresses by interface index, of every interface (an address
    /// may be reported before its interface is named external).
    addrs: BTreeMap<u32, BTreeSet<IpAddr>>,
}

impl InterfaceAddresses {
    /// Interface `index` exists, external or not (a new or renamed link).
    pub fn link(&mut self, index: u32, external: bool) {
        if external {
            self.external.insert(index);
        } else {
            self.external.remove(&index);
        }
    }

    /// Interface `index` is gone, with its addresses.
    pub fn link_gone(&mut self, index: u32) {
        self.external.remove(&index);
        self.addrs.remove(&index);
    }

    /// An address message: `present` for `RTM_NEWADDR` (added, or its flags
    /// changed), not for `RTM_DELADDR`.
    pub fn address(&mut self, msg: &AddressMessage, present: bool) {
        let Some(ip) = address_of(msg) else { return };
        let index = msg.header.index;
        if present && usable(msg, ip) {
            self.addrs.entry(index).or_default().insert(ip);
        } else if let Some(set) = self.addrs.get_mut(&index) {
            set.remove(&ip);
            if set.is_empty() {
                self.addrs.remove(&index);
            }
        }
    }

    /// Every address as a full listing (`RTM_GETADDR` dump) has them: what
    /// it does not name is gone.
    pub fn replace_addresses<'a>(&mut self, msgs: impl IntoIterator<Item = &'a AddressMessage>) {
        self.addrs.clear();
        for m in msgs {
            self.address(m, true);
        }
    }

    /// The usable addresses of the external interfaces, sorted.
    pub fn external(&self) -> BTreeSet<IpAddr> {
        self.external
            .iter()
            .filter_map(|i| self.addrs.get(i))
            .flatten()
            .copied()
            .collect()
    }
}

/// The interface's own address of `msg`: `IFA_LOCAL`, else `IFA_ADDRESS`
/// (they differ only on point-to-point links, where `IFA_ADDRESS` is the
/// peer's).
fn address_of(msg: &AddressMessage) -> Option<IpAddr> {
    let find = |local: bool| {
        msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Local(ip) if local => Some(*ip),
            AddressAttribute::Address(ip) if !local => Some(*ip),
            _ => None,
        })
    };
    find(true).or_else(|| find(false))
}

/// Whether `ip` of `msg` may serve NodePorts: global scope, not tentative
/// or failed DAD, and an address the model takes as a frontend at all.
fn usable(msg: &AddressMessage, ip: IpAddr) -> bool {
    let flags = msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Flags(f) => Some(*f),
        _ => None,
    });
    let unready = match flags {
        Some(f) => f.intersects(AddressFlags::Tentative | AddressFlags::Dadfailed),
        None => msg
            .header
            .flags
            .intersects(AddressHeaderFlags::Tentative | AddressHeaderFlags::Dadfailed),
    };
    msg.header.scope == AddressScope::Universe
        && !unready
        && crate::model::forbidden_address(ip).is_none()
}

/// `+added -removed` between two sets, for the log: `+198.18.0.61`.
pub fn describe_change(before: &BTreeSet<IpAddr>, after: &BTreeSet<IpAddr>) -> String {
    let added = after.difference(before).map(|a| format!("+{a}"));
    let removed = before.difference(after).map(|a| format!("-{a}"));
    added.chain(removed).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_route::AddressFamily;

    fn msg(index: u32, ip: &str, scope: AddressScope, flags: AddressFlags) -> AddressMessage {
        let ip: IpAddr = ip.parse().unwrap();
        let mut m = AddressMessage::default();
        m.header.index = index;
        m.header.scope = scope;
        m.header.family = match ip {
            IpAddr::V4(_) => AddressFamily::Inet,
            IpAddr::V6(_) => AddressFamily::Inet6,
        };
        m.attributes.push(AddressAttribute::Address(ip));
        if ip.is_ipv4() {
            m.attributes.push(AddressAttribute::Local(ip));
        }
        m.attributes.push(AddressAttribute::Flags(flags));
        m
    }

    fn global(index: u32, ip: &str) -> AddressMessage {
        msg(index, ip, AddressScope::Universe, AddressFlags::Permanent)
    }

    fn set(addrs: &[&str]) -> BTreeSet<IpAddr> {
        addrs.iter().map(|a| a.parse().unwrap()).collect()
    }

    /// Only the external interfaces' global, ready addresses: not a pod
    /// interface's, not loopback, link-local, host-scope, tentative or
    /// failed-DAD ones.
    #[test]
    fn only_usable_addresses_of_external_interfaces() {
        let mut t = InterfaceAddresses::default();
        t.link(1, false); // lo
        t.link(2, true); // eth0
        t.link(3, false); // lxc…
        t.address(
            &msg(1, "127.0.0.1", AddressScope::Host, AddressFlags::Permanent),
            true,
        );
        t.address(&global(1, "198.18.0.200"), true);
        t.address(&global(2, "198.18.0.10"), true);
        t.address(&global(2, "2001:2::10"), true);
        t.address(
            &msg(2, "fe80::1", AddressScope::Link, AddressFlags::Permanent),
            true,
        );
        t.address(&global(2, "169.254.7.7"), true);
        t.address(
            &msg(
                2,
                "2001:2::99",
                AddressScope::Universe,
                AddressFlags::Tentative,
            ),
            true,
        );
        t.address(
            &msg(
                2,
                "2001:2::98",
                AddressScope::Universe,
                AddressFlags::Dadfailed,
            ),
            true,
        );
        t.address(
            &msg(
                2,
                "198.18.0.99",
                AddressScope::Site,
                AddressFlags::Permanent,
            ),
            true,
        );
        t.address(&global(3, "198.18.1.1"), true);
        assert_eq!(t.external(), set(&["198.18.0.10", "2001:2::10"]));
        // DAD done: the same address again, ready.
        t.address(&global(2, "2001:2::99"), true);
        assert_eq!(
            t.external(),
            set(&["198.18.0.10", "2001:2::10", "2001:2::99"])
        );
    }

    /// A VIP added, then removed; an interface renamed out of the external
    /// patterns, renamed back, then gone; a full listing replaces what was
    /// known.
    #[test]
    fn addresses_and_interfaces_come_and_go() {
        let mut t = InterfaceAddresses::default();
        t.link(2, true);
        t.address(&global(2, "198.18.0.10"), true);
        let before = t.external();
        t.address(&global(2, "198.18.0.61"), true);
        let after = t.external();
        assert_eq!(after, set(&["198.18.0.10", "198.18.0.61"]));
        assert_eq!(describe_change(&before, &after), "+198.18.0.61");
        t.address(&global(2, "198.18.0.61"), false);
        assert_eq!(t.external(), before);
        assert_eq!(describe_change(&after, &before), "-198.18.0.61");
        // Tentative again (flags changed): not usable any more.
        t.address(
            &msg(
                2,
                "198.18.0.10",
                AddressScope::Universe,
                AddressFlags::Tentative,
            ),
            true,
        );
        assert!(t.external().is_empty());
        t.address(&global(2, "198.18.0.10"), true);
        t.link(2, false);
        assert!(t.external().is_empty());
        t.link(2, true);
        assert_eq!(t.external(), set(&["198.18.0.10"]));
        t.replace_addresses([&global(2, "198.18.0.11"), &global(4, "198.18.0.12")]);
        assert_eq!(t.external(), set(&["198.18.0.11"]));
        t.link(4, true);
        assert_eq!(
            describe_change(&set(&["198.18.0.11"]), &t.external()),
            "+198.18.0.12"
        );
        t.link_gone(2);
        assert_eq!(t.external(), set(&["198.18.0.12"]));
        // An address removed that was never known: nothing happens.
        t.address(&global(9, "198.18.0.13"), false);
        assert_eq!(t.external(), set(&["198.18.0.12"]));
    }
}

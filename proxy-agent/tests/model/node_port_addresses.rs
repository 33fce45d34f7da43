//! `nodePortAddresses` and the addresses NodePorts are served on: its
//! parsing, the CIDR and `primary` filters, a Node without an InternalIP,
//! and the addresses of the node's external interfaces.
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use proxy_agent::model::{
    desired_state, desired_state_with, FrontendKey, Incremental, ModelOptions, NodePortAddresses,
};
use proxy_common::{IPPROTO_TCP, SCOPE_EXTERNAL, SCOPE_INTERNAL};

use super::*;

#[test]
fn node_port_addresses_parse() {
    assert_eq!(
        NodePortAddresses::parse("primary"),
        Ok(NodePortAddresses::Primary)
    );
    assert_eq!(
        NodePortAddresses::parse("198.18.2.7/24"),
        Ok(NodePortAddresses::Cidr(Ipv4Addr::new(198, 18, 2, 0), 24))
    );
    assert_eq!(
        NodePortAddresses::parse(" 198.18.2.7/32 "),
        Ok(NodePortAddresses::Cidr(Ipv4Addr::new(198, 18, 2, 7), 32))
    );
    assert_eq!(
        NodePortAddresses::parse("0.0.0.0/0"),
        Ok(NodePortAddresses::Cidr(Ipv4Addr::UNSPECIFIED, 0))
    );
    // Leading zeros are decimal, as in Go's ParseCIDRSloppy.
    assert_eq!(
        "198.018.002.0/24".parse::<NodePortAddresses>(),
        Ok(NodePortAddresses::Cidr(Ipv4Addr::new(198, 18, 2, 0), 24))
    );
    // IPv6 CIDRs select the node's IPv6 addresses, host bits cleared.
    assert_eq!(
        NodePortAddresses::parse("2001:2::7/64"),
        Ok(NodePortAddresses::Cidr6("2001:2::".parse().unwrap(), 64))
    );
    assert_eq!(
        NodePortAddresses::parse("2001:2::5:7/112").map(|n| n.to_string()),
        Ok("2001:2::5:0/112".to_string())
    );
    for bad in [
        "",
        "Primary",
        "198.18.0.0",
        "198.18.0.0/33",
        "198.18.0.0/",
        "198.18.0/16",
        "198.18.0.256/24",
        "2001:2::/129",
        "2001:2::/",
        "2001:2:::/64",
        "x/8",
    ] {
        assert!(NodePortAddresses::parse(bad).is_err(), "{bad:?} accepted");
    }
    assert_eq!(
        NodePortAddresses::Cidr(Ipv4Addr::new(198, 18, 2, 0), 24).to_string(),
        "198.18.2.0/24"
    );
}

/// `nodePortAddresses`: a CIDR selects the node's InternalIPs inside it,
/// `primary` the first InternalIP; a list of only IPv6 CIDRs falls back to
/// every InternalIP (kube-proxy's IPv4 proxier uses 0.0.0.0/0 then).
#[test]
fn node_port_addresses_cidr_filter_and_primary() {
    let yaml = web_svc("  type: NodePort\n", ", nodePort: 30080", "")
        + &node_addrs(
            "node-a",
            &[
                ("InternalIP", "198.18.0.11"),
                ("InternalIP", "198.18.2.5"),
                ("InternalIP", "198.18.3.5"),
            ],
        );
    let snapshot = snap(&yaml);
    let node_ports = |entries: &[&str]| {
        let opts = ModelOptions {
            node_port_addresses: entries
                .iter()
                .map(|e| NodePortAddresses::parse(e).unwrap())
                .collect(),
            ..ModelOptions::default()
        };
        let (state, warnings) = desired_state_with(&snapshot, "node-a", &opts);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(state.node_addr, Some(Ipv4Addr::new(198, 18, 0, 11)));
        let ext: Vec<String> = state
            .frontends
            .keys()
            .filter(|k| k.scope == SCOPE_EXTERNAL)
            .map(|k| format!("{}:{}", k.addr, k.port))
            .collect();
        let int: Vec<String> = state
            .frontends
            .keys()
            .filter(|k| k.scope == SCOPE_INTERNAL && k.port == 30080)
            .map(|k| format!("{}:{}", k.addr, k.port))
            .collect();
        assert_eq!(ext, int, "{entries:?}: internal entries differ");
        ext
    };
    let all = ["198.18.0.11:30080", "198.18.2.5:30080", "198.18.3.5:30080"];
    assert_eq!(node_ports(&[]), all);
    assert_eq!(node_ports(&["198.18.2.0/24"]), ["198.18.2.5:30080"]);
    assert_eq!(
        node_ports(&["198.18.2.0/24", "198.18.3.5/32", "198.18.0.0/16"]),
        all
    );
    assert_eq!(node_ports(&["primary"]), ["198.18.0.11:30080"]);
    assert_eq!(
        node_ports(&["primary", "198.18.3.0/24", "2001:2::/64"]),
        ["198.18.0.11:30080", "198.18.3.5:30080"]
    );
    assert!(node_ports(&["198.18.200.0/24"]).is_empty());
    assert_eq!(node_ports(&["2001:2::/64"]), all);
}

/// Without a Node object, or one without an IPv4 InternalIP, there is no
/// NodePort address: no NodePort frontends, one warning however many ports
/// have a nodePort, and no SNAT address; everything else is built.
#[test]
fn node_without_node_object_or_address_has_no_node_ports_and_warns_once() {
    let services = web_svc(
        "  type: NodePort\n  externalIPs: [198.18.9.250]\n",
        ", nodePort: 30080",
        "",
    ) + &web_svc("  type: NodePort\n", ", nodePort: 30081", "")
        .replace("name: web", "name: web2")
        .replace("198.19.0.1", "198.19.0.2");
    for (yaml, why) in [
        (services.clone(), "no Node object"),
        (
            services.clone()
                + &node_addrs(
                    "node-a",
                    &[("ExternalIP", "198.18.0.99"), ("InternalIP", "2001:2::11")],
                ),
            "no IPv4 InternalIP",
        ),
        (
            services.clone() + &node_addrs("node-b", &[("InternalIP", "198.18.0.12")]),
            "no Node object",
        ),
    ] {
        let (state, warnings) = desired_state(&snap(&yaml), "node-a");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert_eq!(warnings[0].object, "Node node-a");
        assert!(warnings[0].message.contains(why), "{warnings:?}");
        assert_eq!(state.node_addr, None);
        assert!(state
            .frontends
            .keys()
            .all(|k| k.port != 30080 && k.port != 30081));
        assert!(has_fe(
            &state,
            "198.18.9.250",
            80,
            IPPROTO_TCP,
            SCOPE_EXTERNAL
        ));
        assert!(has_fe(
            &state,
            "198.19.0.2",
            80,
            IPPROTO_TCP,
            SCOPE_INTERNAL
        ));
    }
    // No nodePort anywhere: nothing to warn about.
    let (_, warnings) = desired_state(&snap(WEB), "node-a");
    assert!(warnings.is_empty(), "{warnings:?}");
}

/// The NodePort addresses of `node-a` for `yaml`, `nodePortAddresses`
/// `entries` and `iface` on its external interfaces, through the
/// incremental model (the agent's path: addresses set, then a sync), as
/// `ip:port` of the external-scope frontends at `port`; also checks the
/// internal-scope entries are the same addresses. Returns them with the
/// warnings.
fn node_ports_with_interfaces(
    yaml: &str,
    entries: &[&str],
    iface: &[&str],
    port: u16,
) -> (Vec<String>, Vec<String>) {
    let opts = ModelOptions {
        node_port_addresses: entries
            .iter()
            .map(|e| NodePortAddresses::parse(e).unwrap())
            .collect(),
        ..ModelOptions::default()
    };
    let mut model = Incremental::new("node-a", opts);
    model.set_interface_addresses(iface.iter().map(|a| a.parse::<IpAddr>().unwrap()));
    model.replace(snap(yaml));
    let state = model.desired();
    let at = |scope: u8| -> Vec<String> {
        state
            .frontends
            .keys()
            .filter(|k| k.scope == scope && k.port == port)
            .map(|k| SocketAddr::new(k.addr, k.port).to_string())
            .collect()
    };
    let ext = at(SCOPE_EXTERNAL);
    assert_eq!(ext, at(SCOPE_INTERNAL), "{entries:?} {iface:?}");
    let warnings = model.warnings().iter().map(|w| w.to_string()).collect();
    (ext, warnings)
}

/// NodePort candidates are the Node's InternalIPs and the addresses on its
/// external interfaces (a keepalived or kube-vip VIP added to `eth0`), as
/// kube-proxy's iptables mode serves every local address: by default all of
/// them, per family (an IPv6 interface address only for a Service with an
/// IPv6 ClusterIP); never loopback or link-local ones. A `nodePortAddresses`
/// CIDR selects the candidates inside it, InternalIPs and interface
/// addresses alike; `primary` stays the first InternalIP.
#[test]
fn node_port_addresses_include_the_external_interfaces_addresses() {
    let yaml = web_svc("  type: NodePort\n", ", nodePort: 30080", "")
        + &node_addrs(
            "node-a",
            &[("InternalIP", "198.18.0.11"), ("InternalIP", "198.18.2.5")],
        );
    let iface = [
        "198.18.0.11",
        "198.18.0.61",
        "198.18.5.7",
        "2001:2::61",
        "169.254.3.3",
        "127.0.0.2",
        "fe80::1",
    ];
    let np = |entries: &[&str]| {
        let (np, warnings) = node_ports_with_interfaces(&yaml, entries, &iface, 30080);
        assert!(warnings.is_empty(), "{warnings:?}");
        np
    };
    let all = [
        "198.18.0.11:30080",
        "198.18.0.61:30080",
        "198.18.2.5:30080",
        "198.18.5.7:30080",
    ];
    assert_eq!(np(&[]), all);
    assert_eq!(np(&["0.0.0.0/0"]), all);
    assert_eq!(np(&["2001:2::/48"]), all);
    assert_eq!(
        np(&["198.18.0.0/24"]),
        ["198.18.0.11:30080", "198.18.0.61:30080"]
    );
    // A CIDR that holds only an interface address.
    assert_eq!(np(&["198.18.5.0/24"]), ["198.18.5.7:30080"]);
    assert_eq!(np(&["primary"]), ["198.18.0.11:30080"]);
    assert_eq!(
        np(&["primary", "198.18.5.7/32"]),
        ["198.18.0.11:30080", "198.18.5.7:30080"]
    );
    assert!(np(&["198.18.200.0/24"]).is_empty());
    // Without interface addresses, the InternalIPs alone, as before.
    let (np, _) = node_ports_with_interfaces(&yaml, &[], &[], 30080);
    assert_eq!(np, ["198.18.0.11:30080", "198.18.2.5:30080"]);
    // A dual-stack Service on a dual-stack node: the IPv6 interface address
    // too, in the IPv6 family only; `primary` keeps the IPv6 InternalIP.
    let dual = "---
apiVersion: v1
kind: Service
metadata: {name: web6}
spec:
  type: NodePort
  clusterIP: 198.19.0.6
  clusterIPs: [198.19.0.6, \"2001:2::19:6\"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: RequireDualStack
  ports: [{name: http, port: 80, nodePort: 30086}]
"
    .to_string()
        + &node_addrs(
            "node-a",
            &[("InternalIP", "198.18.0.11"), ("InternalIP", "2001:2::11")],
        );
    let (np, warnings) = node_ports_with_interfaces(&dual, &[], &iface, 30086);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        np,
        [
            "198.18.0.11:30086",
            "198.18.0.61:30086",
            "198.18.5.7:30086",
            "[2001:2::11]:30086",
            "[2001:2::61]:30086"
        ]
    );
    let (np, _) = node_ports_with_interfaces(&dual, &["primary"], &iface, 30086);
    assert_eq!(np, ["198.18.0.11:30086", "[2001:2::11]:30086"]);
    let (np, _) = node_ports_with_interfaces(&dual, &["2001:2::60/124"], &iface, 30086);
    assert_eq!(
        np,
        [
            "198.18.0.11:30086",
            "198.18.0.61:30086",
            "198.18.5.7:30086",
            "[2001:2::61]:30086"
        ]
    );
}

/// A family without an InternalIP serves no NodePort, whatever its
/// interfaces hold (its SNAT address would be missing): the warning says
/// so, as without interface addresses.
#[test]
fn interface_addresses_do_not_serve_node_ports_without_an_internal_ip() {
    let yaml = web_svc("  type: NodePort\n", ", nodePort: 30080", "")
        + &node_addrs("node-a", &[("InternalIP", "2001:2::11")]);
    let (np, warnings) =
        node_ports_with_interfaces(&yaml, &[], &["198.18.0.61", "2001:2::61"], 30080);
    assert!(np.is_empty(), "{np:?}");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("no IPv4 InternalIP"), "{warnings:?}");
}

/// An address on an external interface is this node's own: refused as an
/// externalIP (frontendPolicy.allowNodeAddresses: false, the default), as
/// an InternalIP is. A load-balancer IP there is served: a controller that
/// announces its IPs from the node (kube-vip) puts them on the interface.
#[test]
fn interface_addresses_are_own_addresses_for_external_ips_not_for_lb_ips() {
    let status = "status:
  loadBalancer:
    ingress: [{ip: 198.18.0.62}]
";
    let yaml = web_svc(
        "  type: LoadBalancer\n  externalIPs: [198.18.0.61]\n",
        ", nodePort: 30080",
        status,
    ) + &node_addrs("node-a", &[("InternalIP", "198.18.0.11")])
        + &web_endpoints(&[("198.18.1.1", "node-b", "")]);
    let snapshot = snap(&yaml);
    let mut model = Incremental::new("node-a", ModelOptions::default());
    model.replace(snapshot.clone());
    assert!(model.warnings().is_empty(), "{:?}", model.warnings());
    assert!(has_fe(
        model.desired(),
        "198.18.0.61",
        80,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
    let vips = ["198.18.0.61", "198.18.0.62"].map(|a| a.parse::<IpAddr>().unwrap());
    assert!(model.set_interface_addresses(vips));
    model.apply([]);
    let state = model.desired();
    let warnings = model.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0]
            .message
            .contains("externalIP 198.18.0.61 is this node's own address"),
        "{warnings:?}"
    );
    assert!(!has_fe(
        state,
        "198.18.0.61",
        80,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
    // The VIPs serve the NodePort; the load-balancer IP its port too.
    for ip in ["198.18.0.11", "198.18.0.61", "198.18.0.62"] {
        assert!(
            has_fe(state, ip, 30080, IPPROTO_TCP, SCOPE_EXTERNAL),
            "{ip}"
        );
    }
    let lb = fe_at(state, "198.18.0.62", 80, IPPROTO_TCP, SCOPE_EXTERNAL);
    assert_eq!(addrs(lb), ["198.18.1.1:8080"]);
    // allowNodeAddresses: the externalIP is served again.
    let mut opts = ModelOptions::default();
    opts.frontend_policy.allow_node_addresses = true;
    let mut model = Incremental::new("node-a", opts);
    model.set_interface_addresses(vips);
    model.replace(snapshot);
    assert!(model.warnings().is_empty(), "{:?}", model.warnings());
    assert!(has_fe(
        model.desired(),
        "198.18.0.61",
        80,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
}

/// The agent's path when a VIP comes and goes: the next sync (any `apply`,
/// even of no object) computes the Services again, and its update names
/// the VIP's NodePort frontends, added then removed, so a change-only write
/// programs them; setting the same addresses again changes nothing.
#[test]
fn an_interface_address_added_later_serves_node_ports_and_stops_when_removed() {
    let yaml = web_svc("  type: NodePort\n", ", nodePort: 30080", "")
        + &node_addrs("node-a", &[("InternalIP", "198.18.0.11")])
        + &web_endpoints(&[("198.18.1.1", "node-b", "")]);
    let mut model = Incremental::new("node-a", ModelOptions::default());
    let node_ip: IpAddr = "198.18.0.11".parse().unwrap();
    let vip: IpAddr = "198.18.0.61".parse().unwrap();
    model.set_interface_addresses([node_ip]);
    model.replace(snap(&yaml));
    assert!(!has_fe(
        model.desired(),
        "198.18.0.61",
        30080,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
    let vip_keys: BTreeSet<FrontendKey> = [SCOPE_EXTERNAL, SCOPE_INTERNAL]
        .map(|scope| FrontendKey {
            scope,
            ..key("198.18.0.61", 30080, IPPROTO_TCP)
        })
        .into();

    assert!(model.set_interface_addresses([node_ip, vip]));
    let up = model.apply([]);
    assert_eq!(up.frontends, vip_keys);
    let fe = fe_at(
        model.desired(),
        "198.18.0.61",
        30080,
        IPPROTO_TCP,
        SCOPE_EXTERNAL,
    );
    assert_eq!(addrs(fe), ["198.18.1.1:8080"]);
    // The same set again: nothing to compute.
    assert!(!model.set_interface_addresses([vip, node_ip]));
    assert!(model.apply([]).is_empty());

    assert!(model.set_interface_addresses([node_ip]));
    let up = model.apply([]);
    assert_eq!(up.frontends, vip_keys);
    assert!(!has_fe(
        model.desired(),
        "198.18.0.61",
        30080,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
    assert!(has_fe(
        model.desired(),
        "198.18.0.11",
        30080,
        IPPROTO_TCP,
        SCOPE_EXTERNAL
    ));
}

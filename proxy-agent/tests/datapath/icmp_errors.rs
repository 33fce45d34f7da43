//! ICMP errors about translated flows (issue 15): a router's fragmentation
//! needed, a backend's port unreachable, a time exceeded carry the head of
//! the packet they are about with the translated tuple; the datapath
//! translates them with their flow, inner and outer headers, as netfilter's
//! NAT does for `RELATED` packets, so path-MTU discovery and ECONNREFUSED
//! work through frontends. Every output is checked independently by the
//! kit's checker: the outer IPv4 and ICMP checksums (`parse_checked`), the
//! inner IPv4 checksum, and the inner TCP/UDP checksum over the inner
//! segment, which these errors carry whole (`quoted_tuple`).
use super::*;
use proxy_testkit::kit::{
    check::{quoted_tuple, Parsed},
    frame::{icmp_error, ipv4},
};

/// A router between the nodes (or between a node and an external client).
const ROUTER: Ipv4Addr = Ipv4Addr::new(198, 18, 3, 1);
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;
const ICMP_TIME_EXCEEDED: u8 = 11;

/// A router's fragmentation needed (next-hop MTU `mtu`) to `dst` about
/// `about`, quoting it whole.
fn frag_needed(dst: Ipv4Addr, mtu: u16, about: &[u8]) -> Vec<u8> {
    icmp_error(
        ROUTER,
        dst,
        (ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED),
        mtu,
        about,
        1500,
    )
}

/// `err` through `prog`: redirected (to its client or backend), every
/// checksum valid; the output parsed.
fn delivered(h: &Harness, prog: Prog, err: &[u8]) -> Parsed {
    let (rc, out) = h.run_prog(prog, err);
    assert_eq!(rc, Redirect.code(prog), "{prog:?}: delivered");
    parse_checked(&out)
}

fn wired(h: &Harness) {
    h.wire(
        "198.18.0.0/15",
        &[
            ("198.18.1.2", "02:00:00:00:00:cc"),
            ("198.18.1.10", "02:00:00:00:00:bb"),
            ("198.18.2.10", "02:00:00:00:00:bb"),
            ("198.18.0.100", "02:00:00:00:00:cc"),
        ],
    );
}

fn cluster_ip(h: &mut Harness, backend: Ipv4Addr) {
    h.sync(&[
        (
            fe(VIP, 80, IPPROTO_TCP),
            vec![be(backend, 8080, IPPROTO_TCP)],
            0,
        ),
        (
            fe(VIP, 53, IPPROTO_UDP),
            vec![be(backend, 5353, IPPROTO_UDP)],
            0,
        ),
    ]);
    wired(h);
}

/// A router's fragmentation needed about a client's segment to a ClusterIP
/// (backend on another node: the error comes in at the external device; on
/// this node: from the backend's interface) reaches the client from the
/// frontend, quoting the segment as the client sent it (client → VIP:80),
/// so its socket learns the path MTU. Before: passed untouched, quoting
/// client → backend, which no socket of the client has.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn frag_needed_about_a_clients_segment_reaches_it_from_the_frontend() {
    for (backend, prog) in [(REMOTE, ExtIngress), (B1, PodIngress)] {
        let mut h = Harness::new();
        cluster_ip(&mut h, backend);
        let data = vec![0x5a; 1200];
        h.run(&tcp4(CLIENT, 40000, VIP, 80, SYN, b""));
        let (_, seg) = h.run(&tcp4(CLIENT, 40000, VIP, 80, ACK | PSH, &data));
        assert_eq!(
            parse_checked(&seg).tuple(),
            tuple(CLIENT, 40000, backend, 8080)
        );
        let err = frag_needed(CLIENT, 1000, &seg);
        let o = delivered(&h, prog, &err);
        assert_eq!(
            (o.src, o.dst),
            (VIP.into(), CLIENT.into()),
            "{prog:?}: outer header"
        );
        assert_eq!(&o.l4[..2], &[ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED]);
        assert_eq!(&o.l4[6..8], &1000u16.to_be_bytes(), "the MTU is kept");
        assert_eq!(
            quoted_tuple(&o),
            tuple(CLIENT, 40000, VIP, 80),
            "{prog:?}: the quote is the client's own segment"
        );
        assert_eq!(o.ttl, 63, "forwarded: TTL decremented");
        assert_eq!(h.stats()[&stat::ICMP_ERROR_TO_CLIENT], 1);
        // The same error about a segment of no tracked flow: untouched.
        let stray = frag_needed(
            CLIENT,
            1000,
            &tcp4(CLIENT, 40999, backend, 8080, ACK, &data),
        );
        assert_eq!(h.run_prog(prog, &stray), (Pass.code(prog), stray));
    }
}

/// A backend without a listener answers a UDP datagram to a ClusterIP with
/// port unreachable: the client gets it from the frontend, quoting its own
/// datagram (client → VIP:53, UDP checksum valid), so a connected UDP
/// socket sees ECONNREFUSED as through kube-proxy.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn a_backends_port_unreachable_reaches_the_udp_client_from_the_frontend() {
    let mut h = Harness::new();
    cluster_ip(&mut h, B1);
    let (_, dgram) = h.run(&udp4(CLIENT, 41000, VIP, 53, b"query"));
    assert_eq!(
        parse_checked(&dgram).tuple(),
        tuple(CLIENT, 41000, B1, 5353)
    );
    let err = icmp_error(
        B1,
        CLIENT,
        (ICMP_DEST_UNREACH, ICMP_PORT_UNREACH),
        0,
        &dgram,
        548,
    );
    let o = delivered(&h, PodIngress, &err);
    assert_eq!((o.src, o.dst), (VIP.into(), CLIENT.into()));
    assert_eq!(quoted_tuple(&o), tuple(CLIENT, 41000, VIP, 53));
    // A UDP checksum of 0 ("none") stays 0.
    let (_, bare) = h.run(&udp4_no_csum(CLIENT, 41001, VIP, 53, b"query"));
    let err = icmp_error(
        B1,
        CLIENT,
        (ICMP_DEST_UNREACH, ICMP_PORT_UNREACH),
        0,
        &bare,
        548,
    );
    let o = parse_checked(&h.run(&err).1);
    assert_eq!(
        &o.l4[8 + 20 + 6..8 + 20 + 8],
        &[0, 0],
        "no checksum stays none"
    );
}

/// External traffic SNATed to the node (eTP Cluster, backend on another
/// node): a router's fragmentation needed about the node's segment to the
/// backend (node:port → backend) reaches the external client, from the
/// NodePort's address, quoting client → node:nodePort.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn frag_needed_about_a_snated_segment_reaches_the_external_client() {
    let mut h = Harness::new();
    h.set_config(
        Config::default()
            .with_hairpin_addr(HAIRPIN)
            .with_node_addr(NODE),
    );
    h.sync(&[(
        fe_ext(NODE, 30080, IPPROTO_TCP),
        vec![be(REMOTE, 8080, IPPROTO_TCP)],
        0,
    )]);
    wired(&h);
    h.run_prog(ExtIngress, &tcp4(EXT_CLIENT, 42000, NODE, 30080, SYN, b""));
    let (_, seg) = h.run_prog(
        ExtIngress,
        &tcp4(EXT_CLIENT, 42000, NODE, 30080, ACK, &[7; 900]),
    );
    let s = parse_checked(&seg);
    assert_eq!(
        (s.src, s.dst, s.dport),
        (NODE.into(), REMOTE.into(), 8080),
        "SNATed"
    );
    let err = frag_needed(NODE, 800, &seg);
    assert_eq!(
        h.run_prog(ExtXdp, &err),
        (Pass.code(ExtXdp), err.clone()),
        "XDP defers it to tc"
    );
    let o = delivered(&h, ExtIngress, &err);
    assert_eq!(
        (o.src, o.dst),
        (NODE.into(), EXT_CLIENT.into()),
        "to the client's own address"
    );
    assert_eq!(quoted_tuple(&o), tuple(EXT_CLIENT, 42000, NODE, 30080));
}

/// A router between the node and an external client sends fragmentation
/// needed about a reply that left through a NodePort (node:nodePort →
/// client): it goes on to the backend, quoting backend → client as the
/// backend sent it, so the backend's socket lowers its MSS — for a local
/// backend (no SNAT) and a remote one (SNATed: quoting backend → node:port,
/// from the node's address).
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn frag_needed_about_a_reply_reaches_the_backend() {
    let mut h = Harness::new();
    h.set_config(
        Config::default()
            .with_hairpin_addr(HAIRPIN)
            .with_node_addr(NODE),
    );
    let mut d = kit::harness::desired(
        &[
            (
                fe_ext(NODE, 30080, IPPROTO_TCP),
                vec![be(REMOTE, 8080, IPPROTO_TCP)],
                0,
            ),
            (
                fe_ext(NODE, 30081, IPPROTO_TCP),
                vec![be(B1, 8080, IPPROTO_TCP)],
                0,
            ),
        ],
        0,
    );
    d.local_endpoints.extend([std::net::IpAddr::V4(B1)]);
    h.sync_desired(&d);
    wired(&h);
    // Local backend, no SNAT.
    h.run_prog(ExtIngress, &tcp4(EXT_CLIENT, 43000, NODE, 30081, SYN, b""));
    let (_, reply) = h.run(&tcp4(B1, 8080, EXT_CLIENT, 43000, ACK, &[1; 1400]));
    assert_eq!(
        parse_checked(&reply).tuple(),
        tuple(NODE, 30081, EXT_CLIENT, 43000)
    );
    let err = frag_needed(NODE, 1280, &reply);
    let o = delivered(&h, ExtIngress, &err);
    assert_eq!(
        (o.src, o.dst),
        (ROUTER.into(), B1.into()),
        "the router's error, to the backend"
    );
    assert_eq!(quoted_tuple(&o), tuple(B1, 8080, EXT_CLIENT, 43000));
    assert_eq!(h.stats()[&stat::ICMP_ERROR_TO_BACKEND], 1);
    // Remote backend, SNATed: a time exceeded this time.
    let (_, seg) = h.run_prog(ExtIngress, &tcp4(EXT_CLIENT, 43001, NODE, 30080, SYN, b""));
    let port = parse_checked(&seg).sport;
    let (_, reply) = h.run_prog(ExtIngress, &tcp4(REMOTE, 8080, NODE, port, SYN | ACK, b""));
    assert_eq!(
        parse_checked(&reply).tuple(),
        tuple(NODE, 30080, EXT_CLIENT, 43001)
    );
    let err = icmp_error(ROUTER, NODE, (ICMP_TIME_EXCEEDED, 0), 0, &reply, 1500);
    let o = delivered(&h, ExtIngress, &err);
    assert_eq!(
        (o.src, o.dst),
        (NODE.into(), REMOTE.into()),
        "from the node, as SNAT has it"
    );
    assert_eq!(quoted_tuple(&o), tuple(REMOTE, 8080, NODE, port));
}

/// What is not an error about a translated flow's first fragment passes
/// untouched: an echo request to a frontend, an error quoting too little
/// (no ports), an error quoting a later fragment, an error with IP options.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn other_icmp_passes_untouched() {
    let mut h = Harness::new();
    cluster_ip(&mut h, B1);
    let (_, seg) = h.run(&tcp4(CLIENT, 40000, VIP, 80, SYN, b""));
    let echo = ipv4(CLIENT, VIP, IPPROTO_ICMP, &[8, 0, 0xf7, 0xff, 0, 0, 0, 0]);
    let short = icmp_error(
        B1,
        CLIENT,
        (ICMP_DEST_UNREACH, ICMP_PORT_UNREACH),
        0,
        &seg,
        22,
    );
    let (_, later) = ipv4_split(&tcp4(CLIENT, 40000, B1, 8080, ACK, &[0; 64]), 16);
    let about_later = icmp_error(ROUTER, CLIENT, (ICMP_TIME_EXCEEDED, 0), 0, &later, 100);
    let err = icmp_error(ROUTER, CLIENT, (ICMP_TIME_EXCEEDED, 0), 0, &seg, 100);
    let with_options = ipv4_with_options(ROUTER, CLIENT, IPPROTO_ICMP, &[1, 1, 1, 0], &err[34..]);
    for frame in [echo, short, about_later, with_options] {
        for prog in Prog::ALL {
            assert_eq!(
                h.run_prog(prog, &frame),
                (Pass.code(prog), frame.clone()),
                "{prog:?}"
            );
        }
    }
    assert_eq!(
        h.stats()
            .get(&stat::ICMP_ERROR_TO_CLIENT)
            .copied()
            .unwrap_or(0),
        0
    );
}

/// `deliveryMode: stack`: an error about a client's segment passes the
/// first hook untouched (the host's filters see it as their conntrack
/// tracked the flow) and is translated at tc egress towards the client,
/// where the flow's replies are.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn with_stack_delivery_errors_are_translated_at_the_last_hook() {
    let mut h = Harness::new();
    h.set_config(
        Config::default()
            .with_hairpin_addr(HAIRPIN)
            .with_delivery_via_stack(true),
    );
    cluster_ip(&mut h, B1);
    let (_, seg) = h.run(&tcp4(CLIENT, 40000, VIP, 80, SYN, b""));
    let err = frag_needed(CLIENT, 1000, &seg);
    for prog in [PodIngress, ExtIngress] {
        assert_eq!(h.run_prog(prog, &err), (Pass.code(prog), err.clone()));
    }
    let (rc, out) = h.run_prog(Prog::Egress, &err);
    assert_eq!(rc, Pass.code(PodIngress), "egress: on towards the client");
    let o = parse_checked(&out);
    assert_eq!((o.src, o.dst), (VIP.into(), CLIENT.into()));
    assert_eq!(quoted_tuple(&o), tuple(CLIENT, 40000, VIP, 80));
}

/// SCTP (issue 12): a router's fragmentation needed about a client's SCTP
/// packet to a ClusterIP with port translation (5060 → 5061) reaches the
/// client from the frontend, quoting the packet as the client sent it
/// (client → VIP:5060), so its association learns the path MTU. The
/// quoted packet's CRC32c is left as the backend-side one: the client's
/// stack finds the association by addresses, ports and verification tag
/// (`sctp_v4_err`), never by the quoted CRC.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn frag_needed_about_an_sctp_packet_reaches_the_client_from_the_frontend() {
    let mut h = Harness::new();
    h.sync(&[(
        fe(VIP, 5060, proxy_common::IPPROTO_SCTP),
        vec![be(REMOTE, 5061, proxy_common::IPPROTO_SCTP)],
        0,
    )]);
    wired(&h);
    let data = vec![0x5a; 1200];
    let (_, pkt) = h.run(&kit::frame::sctp4(CLIENT, 40000, VIP, 5060, 0, &data));
    assert_eq!(
        parse_checked(&pkt).tuple(),
        tuple(CLIENT, 40000, REMOTE, 5061)
    );
    let err = frag_needed(CLIENT, 1000, &pkt);
    let o = delivered(&h, ExtIngress, &err);
    assert_eq!((o.src, o.dst), (VIP.into(), CLIENT.into()), "outer header");
    assert_eq!(&o.l4[..2], &[ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED]);
    let inner = &o.l4[8..];
    assert_eq!(kit::check::ip_csum(&inner[..20]), 0, "inner IPv4 checksum");
    assert_eq!(&inner[12..16], &CLIENT.octets());
    assert_eq!(&inner[16..20], &VIP.octets());
    assert_eq!(&inner[20..22], &40000u16.to_be_bytes());
    assert_eq!(
        &inner[22..24],
        &5060u16.to_be_bytes(),
        "the frontend's port"
    );
    assert_eq!(h.stats()[&stat::ICMP_ERROR_TO_CLIENT], 1);
}

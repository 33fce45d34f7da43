//! SCTP (conformance S41, N4, N10 at the packet level): frontends of
//! protocol SCTP are translated like TCP's, with port translation (service
//! port ≠ targetPort, which Cilium does not do) keeping the CRC32c valid —
//! checked here bit by bit from the polynomial (`kit::check::crc32c`), never
//! with the datapath's table-driven update — and conntrack following the
//! association through the chunk types (INIT, ABORT, SHUTDOWN).
//!
//! XDP defers SCTP to tc (its in-place rewrite is TCP/UDP only).

use std::net::Ipv4Addr;

use proxy_common::{
    conntrack::sctp as chunk, ct_dir, ct_flags, stat, IPPROTO_ICMP, IPPROTO_SCTP, IPPROTO_TCP,
};

use super::{not_for_the_external_device, CLIENT, EXT_CLIENT, MAC_BB, MAC_CC, NODE, REMOTE, VIP};
use proxy_testkit::kit::check::tuple;
use proxy_testkit::kit::{
    case::{run_cases, run_stateless_cases, Case, Expect, Field, Setup},
    check::{ipv4_addrs_checked, parse_checked, sctp_checksum},
    frame::{ipv4_split, sctp4},
    harness::{be, fe, fe_ext, Harness, Prog, Verdict, TC_ACT_OK, TC_ACT_SHOT},
};
use Prog::{ExtIngress, ExtXdp, PodIngress};
use Verdict::{Drop, Pass, Redirect};

const B1: Ipv4Addr = super::B1;

/// SIP over SCTP: service port 5060, pods listening on 5061.
fn sctp_setup() -> Setup {
    Setup::new(vec![(
        fe(VIP, 5060, IPPROTO_SCTP),
        vec![be(B1, 5061, IPPROTO_SCTP)],
        0,
    )])
}

/// An INIT chunk's value: initiate tag, a_rwnd, streams, initial TSN.
const INIT: &[u8] = &[0, 0, 0, 1, 0, 1, 0, 0, 0, 10, 0, 10, 0, 0, 0, 1];

#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn sctp_dnat_with_port_translation_and_reverse_nat_keep_the_crc32c() {
    let s = sctp_setup();
    let init = sctp4(CLIENT, 40000, VIP, 5060, chunk::INIT, INIT);
    // DATA of 1,400 bytes: the update must hold over a long packet too.
    let data: Vec<u8> = (0..1400u32).map(|i| (i * 7) as u8).collect();
    let data_pkt = sctp4(CLIENT, 40000, VIP, 5060, 0, &data);
    let init_ack = sctp4(B1, 5061, CLIENT, 40000, chunk::INIT_ACK, INIT);
    run_cases(&[
        not_for_the_external_device(
            Case::new(
                "SCTP INIT to a ClusterIP: DNAT to port 5061",
                &s,
                init.clone(),
            )
            .expect(
                PodIngress,
                Expect::fields(
                    Pass,
                    vec![
                        Field::tuple(CLIENT, 40000, B1, 5061),
                        Field::Proto(IPPROTO_SCTP),
                    ],
                )
                .stats(&[(stat::FWD_NEW, 1)]),
            ),
        ),
        not_for_the_external_device(
            Case::new(
                "1,400 bytes of SCTP DATA of the association: same DNAT, payload intact",
                &s,
                data_pkt,
            )
            .after(Some(PodIngress), init.clone())
            .expect(
                PodIngress,
                Expect::fields(Pass, vec![Field::dst(B1, 5061), Field::L4From(16, data)])
                    .stats(&[(stat::FWD_NEW, 1), (stat::FWD_ESTABLISHED, 1)]),
            ),
        ),
        Case::new(
            "the backend's INIT ACK: reverse NAT to the frontend's port",
            &s,
            init_ack,
        )
        .after(Some(PodIngress), init)
        .expect_all(
            &[PodIngress, ExtIngress],
            Expect::fields(Pass, vec![Field::tuple(VIP, 5060, CLIENT, 40000)])
                .stats(&[(stat::FWD_REPLY, 1)]),
        )
        .expect(ExtXdp, Expect::unchanged(Pass)),
    ]);
}

/// Service port = targetPort: only addresses change, which SCTP's checksum
/// does not cover: the CRC bytes are left exactly as they were.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn sctp_address_only_dnat_leaves_the_crc32c_as_it_was() {
    let s = Setup::new(vec![(
        fe(VIP, 5060, IPPROTO_SCTP),
        vec![be(B1, 5060, IPPROTO_SCTP)],
        0,
    )]);
    let init = sctp4(CLIENT, 40000, VIP, 5060, chunk::INIT, INIT);
    let crc = init[34 + 8..34 + 12].to_vec();
    run_cases(&[not_for_the_external_device(
        Case::new("SCTP INIT, same port: DNAT of the address only", &s, init).expect(
            PodIngress,
            Expect::fields(
                Pass,
                vec![Field::tuple(CLIENT, 40000, B1, 5060), Field::L4At(8, crc)],
            ),
        ),
    )]);
}

/// A NodePort with a backend on another node: DNAT and SNAT to the node with
/// a source port of its own — both ports change, and the CRC still holds;
/// the reply gets both back. XDP passes SCTP on to tc.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn sctp_nodeport_snat_to_a_remote_backend_keeps_the_crc32c() {
    let mut s = Setup::new(vec![(
        fe_ext(NODE, 30060, IPPROTO_SCTP),
        vec![be(REMOTE, 5061, IPPROTO_SCTP)],
        0,
    )]);
    s.node = Some(NODE.into());
    s.wire = Some((
        "198.18.0.0/16",
        vec![
            ("198.18.2.10", "02:00:00:00:00:bb"),
            ("198.18.0.100", "02:00:00:00:00:cc"),
        ],
    ));
    let init = sctp4(EXT_CLIENT, 40000, NODE, 30060, chunk::INIT, INIT);
    run_cases(&[
        Case::new(
            "SCTP INIT to a NodePort with a remote backend: DNAT + SNAT, redirected",
            &s,
            init.clone(),
        )
        .expect(
            ExtIngress,
            Expect::fields(
                Redirect,
                vec![
                    Field::DstMac(MAC_BB),
                    Field::src_addr(NODE),
                    Field::dst(REMOTE, 5061),
                    Field::SportIn(1024, 32767),
                ],
            )
            .stats(&[(stat::SNAT_NODE, 1), (stat::REDIRECT, 1)]),
        )
        .expect(ExtXdp, Expect::unchanged(Pass).stats(&[(stat::FWD_NEW, 0)]))
        .expect(PodIngress, Expect::unchanged(Pass)),
        Case::new(
            "its INIT ACK: back to the client from the NodePort",
            &s,
            Vec::new(),
        )
        .after(Some(ExtIngress), init)
        .input_from_last(|o| sctp4(REMOTE, 5061, NODE, o.sport, chunk::INIT_ACK, INIT))
        .expect(
            ExtIngress,
            Expect::fields(
                Redirect,
                vec![
                    Field::tuple(NODE, 30060, EXT_CLIENT, 40000),
                    Field::DstMac(MAC_CC),
                ],
            ),
        ),
    ]);
}

/// Truncated SCTP to a frontend: dropped, never forwarded untranslated; a
/// packet the parser cannot read passes untouched.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn truncated_sctp_packets_are_dropped_not_forwarded() {
    let s = sctp_setup();
    let full = sctp4(CLIENT, 40000, VIP, 5060, chunk::INIT, INIT);
    let mut cases = Vec::new();
    // Whole IPv4 header and ports, but not the common header and a chunk's.
    for l4 in [4usize, 11, 12, 15] {
        let len = 34 + l4;
        let mut frame = full[..len].to_vec();
        // The IPv4 total length says what is there: a short packet, not a
        // cut frame.
        frame[16..18].copy_from_slice(&((20 + l4) as u16).to_be_bytes());
        proxy_testkit::kit::frame::reseal_ipv4_header(&mut frame);
        cases.push(
            Case::new(
                format!("an SCTP packet of {l4} bytes to a ClusterIP"),
                &s,
                frame,
            )
            .expect(
                PodIngress,
                Expect::verdict(Drop).stats(&[(stat::DROP_MALFORMED, 1), (stat::FWD_NEW, 0)]),
            )
            .expect_all(
                &Prog::EXT,
                Expect::verdict(Pass).stats(&[(stat::FWD_NEW, 0)]),
            ),
        );
    }
    run_stateless_cases(&cases);
}

/// The first fragment of a fragmented SCTP packet whose port is translated
/// cannot have its CRC updated (the CRC covers the whole packet, whose
/// length it does not give): dropped and counted, never sent on with a CRC
/// the receiver would discard silently. Without port translation the
/// fragments go through, addresses rewritten.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn fragmented_sctp_with_port_translation_is_dropped_and_counted() {
    let mut h = Harness::new();
    h.sync(&[
        (
            fe(VIP, 5060, IPPROTO_SCTP),
            vec![be(B1, 5061, IPPROTO_SCTP)],
            0,
        ),
        (
            fe(VIP, 5070, IPPROTO_SCTP),
            vec![be(B1, 5070, IPPROTO_SCTP)],
            0,
        ),
    ]);
    let big = vec![0x5au8; 1900];
    let (f1, _) = ipv4_split(&sctp4(CLIENT, 40000, VIP, 5060, 0, &big), 1480);
    let (verdict, _) = h.run(&f1);
    assert_eq!(verdict, TC_ACT_SHOT);
    assert_eq!(h.stats().get(&stat::DROP_SCTP_FRAGMENT), Some(&1));

    let whole = sctp4(CLIENT, 40001, VIP, 5070, 0, &big);
    let (g1, g2) = ipv4_split(&whole, 1480);
    let (v1, o1) = h.run(&g1);
    let (v2, o2) = h.run(&g2);
    assert_eq!((v1, v2), (TC_ACT_OK, TC_ACT_OK));
    assert_eq!(ipv4_addrs_checked(&o1), (CLIENT, B1));
    assert_eq!(ipv4_addrs_checked(&o2), (CLIENT, B1));
    let mut packet = o1[34..].to_vec();
    packet.extend_from_slice(&o2[34..]);
    assert_eq!(packet, whole[34..], "the SCTP packet itself is untouched");
    assert_eq!(packet[8..12], sctp_checksum(&packet));
}

/// The association's conntrack entry follows its chunks: INIT is
/// short-lived until answered; ABORT closes it; a new INIT on the closed
/// tuple is a new association, balanced anew.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn sctp_conntrack_follows_init_abort_and_a_new_init() {
    let h = sctp_setup().harness();
    let service_flags = |h: &Harness| {
        h.maps()
            .conntrack()
            .unwrap()
            .into_iter()
            .find(|(k, _)| k.dir == ct_dir::SERVICE && k.proto == IPPROTO_SCTP)
            .map(|(_, v)| v.flags & ct_flags::STATE)
            .expect("the association's SERVICE entry")
    };
    let (v, o) = h.run(&sctp4(CLIENT, 40000, VIP, 5060, chunk::INIT, INIT));
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(parse_checked(&o).tuple(), tuple(CLIENT, 40000, B1, 5061));
    assert_eq!(
        service_flags(&h),
        ct_flags::TCP_SYN | ct_flags::UNREPLIED,
        "INIT: opening, unanswered"
    );
    h.run(&sctp4(B1, 5061, CLIENT, 40000, chunk::INIT_ACK, INIT));
    h.run(&sctp4(CLIENT, 40000, VIP, 5060, 10, b"cookie!!")); // COOKIE ECHO
    assert_eq!(
        service_flags(&h),
        0,
        "answered and acknowledged: established"
    );
    h.run(&sctp4(CLIENT, 40000, VIP, 5060, chunk::ABORT, b""));
    assert_ne!(
        service_flags(&h) & ct_flags::TCP_CLOSING,
        0,
        "ABORT: closing"
    );
    let (v, o) = h.run(&sctp4(CLIENT, 40000, VIP, 5060, chunk::INIT, INIT));
    assert_eq!(v, TC_ACT_OK);
    assert_eq!(parse_checked(&o).tuple(), tuple(CLIENT, 40000, B1, 5061));
    assert_eq!(
        service_flags(&h),
        ct_flags::TCP_SYN | ct_flags::UNREPLIED,
        "a new INIT on the closed tuple opens a new association"
    );
    assert_eq!(h.stats().get(&stat::FWD_NEW), Some(&2));
    // TCP on the same ports is another flow altogether.
    assert!(h
        .maps()
        .conntrack()
        .unwrap()
        .iter()
        .all(|(k, _)| k.proto != IPPROTO_TCP));
}

/// S29 for SCTP: a frontend without endpoints rejects an INIT with ICMP
/// port unreachable (kube-proxy's REJECT), so the client's association
/// fails at once instead of retransmitting its INIT; no conntrack state.
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn sctp_to_a_frontend_without_endpoints_is_rejected() {
    let s = Setup::new(vec![(fe(VIP, 5060, IPPROTO_SCTP), vec![], 0)]);
    run_cases(&[not_for_the_external_device(
        Case::new(
            "SCTP INIT to a ClusterIP without endpoints: ICMP port unreachable",
            &s,
            sctp4(CLIENT, 40000, VIP, 5060, chunk::INIT, INIT),
        )
        .expect(
            PodIngress,
            Expect::fields(
                Redirect,
                vec![
                    Field::MacsSwapped,
                    Field::Proto(IPPROTO_ICMP),
                    Field::addrs(VIP, CLIENT),
                    Field::Icmp(3, 3),
                    Field::QuotesInput,
                ],
            )
            .stats(&[(stat::REJECT_NO_BACKEND, 1)])
            .then(|h, _| assert!(h.maps().conntrack().unwrap().is_empty())),
        ),
    )]);
}

/// A pod's SCTP whose CRC is left to the device (a Linux sender over veth
/// hands it on with the field zeroed, `CHECKSUM_PARTIAL`): the port is
/// translated and the field stays 0, for the kernel to compute the CRC
/// over the packet as it leaves (`skb_crc32c_csum_help` sums the field as
/// it is: a delta written into it would give a wrong CRC, and a backend on
/// another node would drop every packet of the association).
#[test]
#[ignore = "needs root: run with `cargo xtask test`"]
fn an_sctp_crc_yet_to_be_computed_stays_zero_through_port_translation() {
    let h = sctp_setup().harness();
    let mut init = sctp4(CLIENT, 40000, VIP, 5060, chunk::INIT, INIT);
    init[34 + 8..34 + 12].fill(0);
    let (rc, out) = h.run(&init);
    assert_eq!(rc, TC_ACT_OK);
    assert_eq!(ipv4_addrs_checked(&out), (CLIENT, B1));
    assert_eq!(
        &out[34 + 2..34 + 4],
        &5061u16.to_be_bytes(),
        "port translated"
    );
    assert_eq!(&out[34 + 8..34 + 12], &[0, 0, 0, 0], "CRC left to compute");
}

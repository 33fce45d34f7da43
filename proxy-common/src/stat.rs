//! Per-CPU packet counters, indexed by these codes. Every packet the programs
//! see is counted once under its verdict (`PASS_*`, `FWD_*`, `REJECT_*`,
//! `DROP_*`); a translated packet is counted once more under how it was
//! delivered (`REDIRECT*`, `PASS_FIB_MISS`, `PASS_TTL`); `HAIRPIN` and
//! `CT_INSERT_FAILED` are extra marks on packets already counted.

/// Neither IPv4 nor IPv6 (ARP, ...), or IPv6 where the IPv6 programs
/// are not loaded: passed untouched.
pub const PASS_NOT_IPV4: u32 = 1;
/// IPv4 but neither for a frontend nor a reply of a tracked flow: passed untouched.
pub const PASS_NO_SERVICE: u32 = 2;
/// A new flow to a frontend: backend chosen, DNAT done.
pub const FWD_NEW: u32 = 3;
/// A packet of a tracked flow to a frontend: DNAT to its backend.
pub const FWD_ESTABLISHED: u32 = 4;
/// A reply of a tracked flow: reverse NAT done.
pub const FWD_REPLY: u32 = 5;
/// A frontend without a usable backend: rejected with ICMP (ICMPv6) port
/// unreachable.
pub const REJECT_NO_BACKEND: u32 = 6;
/// A frontend whose endpoints may not be used from this node: dropped.
pub const DROP_NO_LOCAL_BACKEND: u32 = 7;
/// A packet for a frontend too short for its headers: dropped.
pub const DROP_MALFORMED: u32 = 8;
/// A later IPv4 or IPv6 fragment whose first fragment was not seen (or
/// whose flow is not tracked): passed untouched; the datapath does not
/// reassemble.
pub const PASS_FRAGMENT: u32 = 9;
/// A slot points to a backend id missing from the backends map: dropped.
pub const DROP_NO_BACKEND_ENTRY: u32 = 10;
/// A packet rewrite (store or checksum helper) failed: dropped.
pub const DROP_REWRITE_FAILED: u32 = 11;
/// Building the ICMP reject failed: dropped instead.
pub const DROP_REJECT_FAILED: u32 = 12;
/// Translated, but the FIB had no route or forwarding is off: handed to the
/// stack.
pub const PASS_FIB_MISS: u32 = 13;
/// Translated and delivered with `bpf_redirect_peer` / `bpf_redirect`.
pub const REDIRECT: u32 = 14;
/// Translated and delivered with `bpf_redirect_neigh` (neighbour unresolved).
pub const REDIRECT_NEIGH: u32 = 15;
/// A conntrack insert failed (map full and not evictable): forwarded anyway,
/// the flow may change backend.
pub const CT_INSERT_FAILED: u32 = 16;
/// Hairpin: a pod reached itself through a frontend; source SNATed.
pub const HAIRPIN: u32 = 17;
/// TTL expired on a translated packet: handed to the stack (ICMP time exceeded).
pub const PASS_TTL: u32 = 18;
/// The datapath is not configured yet (no agent has written the config map).
pub const PASS_UNCONFIGURED: u32 = 19;
/// Neither TCP, UDP nor SCTP: passed untouched.
pub const PASS_OTHER_PROTO: u32 = 20;
/// An IPv4 header or L4 ports that cannot be read (truncated, bad version
/// or header length), not for a frontend: passed untouched; the stack drops it.
pub const PASS_MALFORMED: u32 = 21;
/// A new flow went to the backend its client's session affinity names.
pub const AFFINITY_HIT: u32 = 22;
/// A new flow's backend-side tuple was taken by another live flow (two
/// frontends sharing a backend, same client address and port): the source
/// port was rewritten (field bug C6).
pub const SNAT_PORT_COLLISION: u32 = 23;
/// A new flow needed a source port (SNAT to the node, or a collision)
/// and none of the range was free: dropped. Random ports are tried
/// first; where the kernel has `bpf_loop`, tc then searches the whole
/// range before dropping.
pub const DROP_NO_FREE_PORT: u32 = 24;
/// A first IPv4 or IPv6 fragment: its ports were recorded for the
/// fragments that follow.
pub const FRAGMENT_TRACKED: u32 = 25;
/// A new flow to a load-balancer frontend from outside its
/// `loadBalancerSourceRanges`: dropped.
pub const DROP_SOURCE_RANGE: u32 = 26;
/// External traffic to a backend on another node: source SNATed to the
/// node's address (`externalTrafficPolicy: Cluster`).
pub const SNAT_NODE: u32 = 27;
/// A TCP segment without SYN started a new flow: its conntrack entry was
/// evicted by the LRU (conntrack full), expired, or lost across a restart
/// without pins. The flow may move to another backend (which resets it).
pub const CT_NEW_MIDSTREAM: u32 = 28;
/// A tracked flow's reply entry was missing (evicted by the LRU) and was
/// written again, so its replies keep being translated.
pub const CT_REPLY_RESTORED: u32 = 29;
/// XDP: a flow to a backend on this node (or something XDP does not
/// handle) passed on to tc untouched.
pub const XDP_DEFERRED: u32 = 30;
/// XDP: translated and sent back out of the device it came in on (XDP_TX).
pub const XDP_TX: u32 = 31;
/// XDP: translated and redirected to another device (XDP_REDIRECT).
pub const XDP_REDIRECT: u32 = 32;
/// Maglev handoff: a new flow to a load-balancer IP or externalIP whose
/// backend is on another node, sent there unchanged (no translation, no
/// conntrack here); that node translates it.
pub const FWD_HANDOFF: u32 = 33;
/// A frontend without a usable backend, over the reject rate limit
/// ([`super::ratelimit`]): dropped instead of answered, so spoofed
/// packets cannot turn the node into an ICMP reflector.
pub const DROP_REJECT_RATE_LIMITED: u32 = 34;
/// `deliveryMode: stack`: a translated packet handed to the host's stack
/// (its filters see the backend) instead of redirected.
pub const DELIVER_STACK: u32 = 35;
/// `deliveryMode: stack`: a reply passed untranslated to the stack; tc
/// egress towards the client reverse-translates it.
pub const PASS_REPLY_VIA_STACK: u32 = 36;
/// An ICMP error about a packet a client sent to a frontend (a router's
/// fragmentation needed, the backend's port unreachable): translated back
/// to the client, from the frontend, its inner header the client's own.
pub const ICMP_ERROR_TO_CLIENT: u32 = 37;
/// An ICMP error about a reply that left through a frontend (a router
/// between this node and an external client): translated on to the
/// backend, its inner header the backend's own.
pub const ICMP_ERROR_TO_BACKEND: u32 = 38;
/// A new flow's random source-port tries all hit ports in use: tc
/// searched the whole SNAT range (`bpf_loop`), port by port, for a free
/// one. Counted per search, found or not.
pub const SNAT_PORT_SEARCH: u32 = 39;
/// Socket LB (host clients): a `connect()` to a frontend was aimed at a
/// backend.
pub const SOCK_CONNECT: u32 = 40;
/// Socket LB: an unconnected UDP `sendmsg()` to a frontend was aimed at a
/// backend.
pub const SOCK_SENDMSG: u32 = 41;
/// Socket LB: a `recvmsg()` source or `getpeername()` answer was turned
/// back from the backend into the frontend.
pub const SOCK_REVNAT: u32 = 42;
/// Socket LB: a frontend without a usable endpoint; the call failed with
/// ECONNREFUSED (EPERM where the kernel lacks `bpf_set_retval`).
pub const SOCK_REJECT_NO_BACKEND: u32 = 43;
/// Socket LB: a frontend whose endpoints may not be used from this node
/// (a `Local` policy); the call failed with EHOSTUNREACH at once.
pub const SOCK_NO_LOCAL_BACKEND: u32 = 44;
/// Socket LB: a slot or backend entry was missing; the call failed.
pub const SOCK_NO_BACKEND_ENTRY: u32 = 45;
/// Socket LB: the reverse-NAT entry could not be written (map full and
/// not evictable); the socket was translated anyway.
pub const SOCK_REVNAT_INSERT_FAILED: u32 = 46;
/// Socket LB: a host client outside a load-balancer IP's
/// `loadBalancerSourceRanges` (judged by the node's address); the call
/// failed with EPERM.
pub const SOCK_SOURCE_RANGE: u32 = 47;
/// The first fragment of an SCTP packet whose port is translated: its
/// CRC32c covers the whole packet, whose length this fragment does not
/// give, so it cannot be kept valid; dropped (SCTP fragments its own
/// chunks to the path MTU and sends with DF set, so IP fragments of it
/// are rare; without port translation fragments pass translated).
pub const DROP_SCTP_FRAGMENT: u32 = 48;
/// An IPv6 packet with a routing header, a header this datapath does
/// not walk past (AH, ESP, ...), or more extension headers than it
/// walks: passed untouched.
pub const PASS_IPV6_EXT_HEADER: u32 = 49;
/// A packet of a flow the kernel's conntrack had translated before this
/// datapath took over (kube-proxy's DNAT, listed in the handover maps
/// by the agent at start): passed untouched, so the kernel's NAT entry
/// keeps it on its backend. Never a TCP SYN: a new connection is the
/// datapath's.
pub const PASS_HANDOVER: u32 = 50;
/// Draining (`config_flags::DRAINING`): a new flow passed untouched to
/// the host's stack, for the proxy taking the node back.
pub const PASS_DRAINING: u32 = 51;
/// A translated packet of a host client's flow (a reply, or a packet to a
/// backend at one of the node's own addresses) whose destination is this
/// node: injected at ingress of the host-client device, where the route
/// to its source points, so that strict reverse-path filters accept it.
pub const REDIRECT_HOST: u32 = 52;
/// A host client's UDP `connect()` or send to a ClusterIP, left
/// untranslated by the socket hooks, or to a frontend with a host alias,
/// aimed at that ClusterIP: its packets are translated one by one on
/// the host-client device.
pub const SOCK_PER_PACKET: u32 = 53;

/// Human names, indexed by code; `""` for unused codes.
pub const NAMES: [&str; 54] = [
    "",
    "pass_not_ipv4",
    "pass_no_service",
    "fwd_new",
    "fwd_established",
    "fwd_reply",
    "reject_no_backend",
    "drop_no_local_backend",
    "drop_malformed",
    "pass_fragment",
    "drop_no_backend_entry",
    "drop_rewrite_failed",
    "drop_reject_failed",
    "pass_fib_miss",
    "redirect",
    "redirect_neigh",
    "ct_insert_failed",
    "hairpin",
    "pass_ttl",
    "pass_unconfigured",
    "pass_other_proto",
    "pass_malformed",
    "affinity_hit",
    "snat_port_collision",
    "drop_no_free_port",
    "fragment_tracked",
    "drop_source_range",
    "snat_node",
    "ct_new_midstream",
    "ct_reply_restored",
    "xdp_deferred",
    "xdp_tx",
    "xdp_redirect",
    "fwd_handoff",
    "drop_reject_rate_limited",
    "deliver_stack",
    "pass_reply_via_stack",
    "icmp_error_to_client",
    "icmp_error_to_backend",
    "snat_port_search",
    "sock_connect",
    "sock_sendmsg",
    "sock_revnat",
    "sock_reject_no_backend",
    "sock_no_local_backend",
    "sock_no_backend_entry",
    "sock_revnat_insert_failed",
    "sock_source_range",
    "drop_sctp_fragment",
    "pass_ipv6_ext_header",
    "pass_handover",
    "pass_draining",
    "redirect_host",
    "sock_per_packet",
];
const _: () = assert!((NAMES.len() as u32) <= super::capacity::STATS);

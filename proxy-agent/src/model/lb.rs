//! Load-balancing algorithms: which one each frontend uses (the Service's
//! annotation, else the node's default), and Maglev's lookup table.
use std::fmt;
use std::str::FromStr;

use proxy_common::{
    lb::{alg, maglev_offset_skip},
    svc_flags,
};

use super::{BackendAddr, ModelWarning};
use crate::objects::compact::CompactService;
use crate::objects::ANNOTATION_LB_ALGORITHM;

/// How new flows to a frontend pick their backend. Conntrack comes first
/// (a tracked flow keeps its backend), then session affinity; the algorithm
/// picks among the endpoints the traffic policies and topology leave.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum LbAlgorithm {
    /// A random backend per new flow (kube-proxy's iptables and nftables modes).
    #[default]
    Random,
    /// Each backend in turn, per CPU (IPVS `rr`).
    RoundRobin,
    /// By the client's address: every flow of one client to one backend while
    /// the backends stay the same, without affinity state (IPVS `sh`).
    SourceHash,
    /// Maglev consistent hashing of the 5-tuple: every node picks the same
    /// backend for a flow; a backend's removal moves only its own flows.
    Maglev,
}

impl LbAlgorithm {
    pub const ALL: [LbAlgorithm; 4] = [
        LbAlgorithm::Random,
        LbAlgorithm::RoundRobin,
        LbAlgorithm::SourceHash,
        LbAlgorithm::Maglev,
    ];

    /// The algorithm's bits of a slot 0's flags.
    pub const fn flags(self) -> u16 {
        let a = match self {
            LbAlgorithm::Random => alg::RANDOM,
            LbAlgorithm::RoundRobin => alg::ROUND_ROBIN,
            LbAlgorithm::SourceHash => alg::SOURCE_HASH,
            LbAlgorithm::Maglev => alg::MAGLEV,
        };
        a << svc_flags::ALG_SHIFT
    }

    /// The algorithm of a slot 0's flags.
    pub const fn of_flags(flags: u16) -> Self {
        match svc_flags::algorithm(flags) {
            alg::ROUND_ROBIN => LbAlgorithm::RoundRobin,
            alg::SOURCE_HASH => LbAlgorithm::SourceHash,
            alg::MAGLEV => LbAlgorithm::Maglev,
            _ => LbAlgorithm::Random,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            LbAlgorithm::Random => "random",
            LbAlgorithm::RoundRobin => "round-robin",
            LbAlgorithm::SourceHash => "source-hash",
            LbAlgorithm::Maglev => "maglev",
        }
    }
}

impl fmt::Display for LbAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for LbAlgorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == s.trim())
            .ok_or_else(|| {
                format!("unknown load-balancing algorithm {s:?} (random, round-robin, source-hash or maglev)")
            })
    }
}

/// The algorithms of a Service's (internal, external) frontends: its
/// annotation for both; else the node default, except that a `maglev` node
/// default applies to external frontends only (Maglev's point is that every
/// node an external router may send a flow to picks the same backend;
/// ClusterIP traffic starts on the client's own node). An annotation naming
/// no algorithm is reported and the default applies.
pub(super) fn service_algorithms(
    svc: &CompactService,
    object: &str,
    default: LbAlgorithm,
    warnings: &mut Vec<ModelWarning>,
) -> (LbAlgorithm, LbAlgorithm) {
    let internal_default = match default {
        LbAlgorithm::Maglev => LbAlgorithm::Random,
        other => other,
    };
    let Some(value) = svc.lb_algorithm.as_deref() else {
        return (internal_default, default);
    };
    match value.parse::<LbAlgorithm>() {
        Ok(a) => (a, a),
        Err(e) => {
            warnings.push(ModelWarning {
                object: object.to_string(),
                message: format!(
                    "annotation {ANNOTATION_LB_ALGORITHM}: {e}; the node default ({default}) applies"
                ),
            });
            (internal_default, default)
        }
    }
}

/// Whether `n` is prime (table sizes are checked once, at start).
pub fn is_prime(n: u32) -> bool {
    n >= 2
        && (2..)
            .take_while(|d| d * d <= n)
            .all(|d| !n.is_multiple_of(d))
}

/// Maglev's lookup table (Eisenbud et al., NSDI 2016, §3.4) of prime `size`
/// entries over `backends`: entry `j` is the index into `backends` of the
/// backend flows hashing to `j` go to. Each backend fills the table from its
/// own preference list (offset and skip from hashes of its address, so two
/// agents with the same backends build the same table whatever order they
/// got them in), one entry per turn, until the table is full: every backend
/// gets `size / n` entries or one more, and removing one backend moves
/// little more than its own entries. Empty for no backends.
pub fn maglev_table(backends: &[BackendAddr], size: u16) -> Vec<u16> {
    let n = backends.len();
    let m = size as usize;
    if n == 0 || m == 0 {
        return Vec::new();
    }
    // Preference lists follow the backends' addresses, not their order here.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|i| backends[*i]);
    let prefs: Vec<(usize, usize)> = order
        .iter()
        .map(|i| {
            let (offset, skip) = maglev_offset_skip(&backend_name(&backends[*i]), size);
            (offset as usize, skip as usize)
        })
        .collect();
    let mut next = vec![0usize; n];
    let mut table = vec![u16::MAX; m];
    let mut filled = 0;
    'fill: loop {
        for (turn, (offset, skip)) in prefs.iter().enumerate() {
            let mut c = (offset + next[turn] * skip) % m;
            while table[c] != u16::MAX {
                next[turn] += 1;
                c = (offset + next[turn] * skip) % m;
            }
            table[c] = order[turn] as u16;
            next[turn] += 1;
            filled += 1;
            if filled == m {
                break 'fill;
            }
        }
    }
    table
}

/// A backend's name for Maglev's hashes: its address, port and protocol.
fn backend_name(b: &BackendAddr) -> Vec<u8> {
    let mut name = match b.addr {
        std::net::IpAddr::V4(a) => a.octets().to_vec(),
        std::net::IpAddr::V6(a) => a.octets().to_vec(),
    };
    name.extend_from_slice(&b.port.to_be_bytes());
    name.push(b.proto);
    name
}

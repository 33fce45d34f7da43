//! Packet cases as a table: a description, the desired state (maps) and
//! namespace set-up, earlier packets, one input frame, and for every program
//! the case applies to the verdict, output-frame fields and counters it must
//! give. Each case runs through each of its programs in a harness of its own,
//! so that a tc/XDP divergence shows as the program that fails.
use std::{
    fmt::Write as _,
    net::IpAddr,
    panic::{catch_unwind, AssertUnwindSafe},
};

use proxy_agent::model::{BackendAddr, FrontendKey};
use proxy_common::Config;

use super::check::{parse_checked, Parsed};
use super::harness::{desired, Harness, Prog, Verdict, HAIRPIN, HAIRPIN6};

/// The maps and the namespace a case starts from.
#[derive(Clone, Default, PartialEq)]
pub struct Setup {
    /// Frontends as `(key, backends, service flags)`.
    pub frontends: Vec<(FrontendKey, Vec<BackendAddr>, u16)>,
    /// Backend addresses that are endpoints on this node.
    pub local: Vec<IpAddr>,
    /// The node's address in the config map (SNAT of external traffic).
    pub node: Option<IpAddr>,
    /// A route and permanent neighbours `(address, MAC)` in the namespace
    /// (see [`Harness::wire`]); without, the FIB has no answer.
    pub wire: Option<(&'static str, Vec<(&'static str, &'static str)>)>,
    /// `loadBalancerSourceRanges` (prefix, length) of every frontend (those
    /// whose flags have `SOURCE_RANGES`).
    pub source_ranges: Vec<(IpAddr, u8)>,
}

impl Setup {
    pub fn new(frontends: Vec<(FrontendKey, Vec<BackendAddr>, u16)>) -> Self {
        Self {
            frontends,
            ..Default::default()
        }
    }

    pub fn harness(&self) -> Harness {
        let mut h = Harness::new();
        let hairpins = Config::default()
            .with_hairpin_addr(HAIRPIN)
            .with_hairpin6_addr(HAIRPIN6);
        match self.node {
            Some(IpAddr::V4(node)) => h.set_config(hairpins.with_node_addr(node)),
            Some(IpAddr::V6(node)) => h.set_config(hairpins.with_node6_addr(node)),
            None => {}
        }
        let mut d = desired(&self.frontends, 0);
        d.local_endpoints.extend(self.local.iter().copied());
        for fe in d.frontends.values_mut() {
            fe.source_ranges.clone_from(&self.source_ranges);
        }
        h.sync_desired(&d);
        if let Some((route, neighbours)) = &self.wire {
            h.wire(route, neighbours);
        }
        h
    }
}

/// One property of an output frame (parsed with every checksum verified),
/// of either family.
#[derive(Clone, Debug)]
pub enum Field {
    /// (source, source port, destination, destination port).
    Tuple(IpAddr, u16, IpAddr, u16),
    /// Destination address and port.
    Dst(IpAddr, u16),
    /// Source address, any source port.
    SrcAddr(IpAddr),
    /// Source and destination addresses.
    Addrs(IpAddr, IpAddr),
    /// A source port allocated by SNAT: in this range (inclusive).
    SportIn(u16, u16),
    /// IPv4's TTL, IPv6's hop limit.
    Ttl(u8),
    Proto(u8),
    DstMac([u8; 6]),
    SrcMac([u8; 6]),
    /// Bytes of the IP payload (after the headers) from this offset to the
    /// end.
    L4From(usize, Vec<u8>),
    /// Bytes of the IP payload at this offset (as many as given).
    L4At(usize, Vec<u8>),
    /// Ethernet addresses of the input, swapped (sent back where it came from).
    MacsSwapped,
    /// ICMP (or ICMPv6) type and code.
    Icmp(u8, u8),
    /// An ICMP error quoting the input's IP header and its first 8 L4 bytes.
    QuotesInput,
}

impl Field {
    /// [`Field::Tuple`] of either family's addresses.
    pub fn tuple(src: impl Into<IpAddr>, sport: u16, dst: impl Into<IpAddr>, dport: u16) -> Self {
        Self::Tuple(src.into(), sport, dst.into(), dport)
    }
    /// [`Field::Dst`].
    pub fn dst(dst: impl Into<IpAddr>, dport: u16) -> Self {
        Self::Dst(dst.into(), dport)
    }
    /// [`Field::SrcAddr`].
    pub fn src_addr(src: impl Into<IpAddr>) -> Self {
        Self::SrcAddr(src.into())
    }
    /// [`Field::Addrs`].
    pub fn addrs(src: impl Into<IpAddr>, dst: impl Into<IpAddr>) -> Self {
        Self::Addrs(src.into(), dst.into())
    }
}

/// What the output frame must be.
#[derive(Clone, Debug)]
pub enum Want {
    /// Byte for byte the input.
    Unchanged,
    /// Any frame (only the verdict and counters are checked).
    Any,
    /// A valid IPv4 frame with these properties.
    Fields(Vec<Field>),
}

/// What one program must do with a case's input.
#[derive(Clone, Debug)]
pub struct Expect {
    pub verdict: Verdict,
    pub frame: Want,
    /// How much counters (stat codes) grew over the case, earlier packets
    /// included: exact.
    pub stats: Vec<(u32, u64)>,
    /// The kernel may refuse the frame (EINVAL) before the program runs.
    pub may_refuse: bool,
    /// A further check after the input ran (maps, counters).
    pub then: Option<fn(&Harness, &Ran)>,
}

impl Expect {
    pub fn unchanged(verdict: Verdict) -> Self {
        Self::with(verdict, Want::Unchanged)
    }
    pub fn fields(verdict: Verdict, fields: Vec<Field>) -> Self {
        Self::with(verdict, Want::Fields(fields))
    }
    pub fn verdict(verdict: Verdict) -> Self {
        Self::with(verdict, Want::Any)
    }
    fn with(verdict: Verdict, frame: Want) -> Self {
        Self {
            verdict,
            frame,
            stats: Vec::new(),
            may_refuse: false,
            then: None,
        }
    }
    pub fn stats(mut self, stats: &[(u32, u64)]) -> Self {
        self.stats.extend_from_slice(stats);
        self
    }
    pub fn may_refuse(mut self) -> Self {
        self.may_refuse = true;
        self
    }
    pub fn then(mut self, f: fn(&Harness, &Ran)) -> Self {
        self.then = Some(f);
        self
    }
}

/// The input frame of a case.
#[derive(Clone)]
pub enum Input {
    Frame(Vec<u8>),
    /// Built from the output of the last earlier packet (e.g. a reply to a
    /// source port the datapath allocated).
    FromLast(fn(&Parsed) -> Vec<u8>),
}

/// What a case's extra check sees.
pub struct Ran<'a> {
    pub prog: Prog,
    /// Every frame run, the earlier packets first, the input last.
    pub inputs: &'a [Vec<u8>],
    pub output: &'a [u8],
}

/// One row of a packet table.
#[derive(Clone)]
pub struct Case {
    pub what: String,
    pub setup: Setup,
    /// Packets run first, each through the given program or (None) through
    /// the program under test; their verdicts are not checked here.
    pub before: Vec<(Option<Prog>, Vec<u8>)>,
    pub input: Input,
    /// The programs the case applies to, each with what it must do.
    pub expect: Vec<(Prog, Expect)>,
}

impl Case {
    pub fn new(what: impl Into<String>, setup: &Setup, input: Vec<u8>) -> Self {
        Self {
            what: what.into(),
            setup: setup.clone(),
            before: Vec::new(),
            input: Input::Frame(input),
            expect: Vec::new(),
        }
    }
    /// A packet run first, through `prog` (None: the program under test).
    pub fn after(mut self, prog: Option<Prog>, frame: Vec<u8>) -> Self {
        self.before.push((prog, frame));
        self
    }
    pub fn input_from_last(mut self, f: fn(&Parsed) -> Vec<u8>) -> Self {
        self.input = Input::FromLast(f);
        self
    }
    pub fn expect(mut self, prog: Prog, e: Expect) -> Self {
        self.expect.push((prog, e));
        self
    }
    /// The same expectation for several programs.
    pub fn expect_all(mut self, progs: &[Prog], e: Expect) -> Self {
        for p in progs {
            self.expect.push((*p, e.clone()));
        }
        self
    }
    /// Runs the case through one of its programs, in a fresh harness; panics
    /// on any difference.
    pub fn run_through(&self, prog: Prog, e: &Expect) {
        self.run_in(&self.setup.harness(), prog, e)
    }

    /// Runs the case through one of its programs in `h` (set up as the
    /// case's `setup`); panics on any difference.
    fn run_in(&self, h: &Harness, prog: Prog, e: &Expect) {
        let stats_before = h.stats();
        let mut inputs = Vec::new();
        let mut last = None;
        for (p, frame) in &self.before {
            let (_, out) = h.run_prog(p.unwrap_or(prog), frame);
            last = Some(out);
            inputs.push(frame.clone());
        }
        let input = match &self.input {
            Input::Frame(f) => f.clone(),
            Input::FromLast(f) => f(&parse_checked(last.as_ref().expect("an earlier packet"))),
        };
        inputs.push(input.clone());
        let (rc, out) = match h.try_run_prog(prog, &input) {
            Ok(r) => r,
            Err(_) if e.may_refuse => return,
            Err(err) => panic!("BPF_PROG_TEST_RUN: {err}"),
        };
        assert_eq!(rc, e.verdict.code(prog), "verdict: want {:?}", e.verdict);
        match &e.frame {
            Want::Unchanged => assert_eq!(out, input, "packet changed"),
            Want::Any => {}
            Want::Fields(fields) => {
                let o = parse_checked(&out);
                for f in fields {
                    check_field(f, &o, &input);
                }
            }
        }
        if !e.stats.is_empty() {
            let s = h.stats();
            for (code, n) in &e.stats {
                let grew = s.get(code).copied().unwrap_or(0)
                    - stats_before.get(code).copied().unwrap_or(0);
                assert_eq!(grew, *n, "counter {code}");
            }
        }
        if let Some(then) = e.then {
            then(
                h,
                &Ran {
                    prog,
                    inputs: &inputs,
                    output: &out,
                },
            );
        }
    }
}

fn check_field(f: &Field, o: &Parsed, input: &[u8]) {
    match f {
        Field::Tuple(s, sp, d, dp) => {
            assert_eq!(o.tuple(), (*s, *sp, *d, *dp), "(src, sport, dst, dport)")
        }
        Field::Dst(d, dp) => assert_eq!((o.dst, o.dport), (*d, *dp), "(dst, dport)"),
        Field::SrcAddr(s) => assert_eq!(o.src, *s, "src"),
        Field::Addrs(s, d) => assert_eq!((o.src, o.dst), (*s, *d), "(src, dst)"),
        Field::SportIn(a, b) => assert!(
            (*a..=*b).contains(&o.sport),
            "a source port allocated for the SNAT, {a}-{b}: {}",
            o.sport
        ),
        Field::Ttl(t) => assert_eq!(o.ttl, *t, "TTL"),
        Field::Proto(p) => assert_eq!(o.proto, *p, "IP protocol"),
        Field::DstMac(m) => assert_eq!(o.dmac, *m, "destination MAC"),
        Field::SrcMac(m) => assert_eq!(o.smac, *m, "source MAC"),
        Field::L4From(at, bytes) => assert_eq!(&o.l4[*at..], &bytes[..], "L4 bytes from {at}"),
        Field::L4At(at, bytes) => assert_eq!(
            &o.l4[*at..*at + bytes.len()],
            &bytes[..],
            "L4 bytes at {at}"
        ),
        Field::MacsSwapped => {
            assert_eq!(&o.dmac[..], &input[6..12], "to the sender's MAC");
            assert_eq!(&o.smac[..], &input[0..6], "from the MAC it was sent to");
        }
        Field::Icmp(t, c) => assert_eq!((o.l4[0], o.l4[1]), (*t, *c), "ICMP type, code"),
        Field::QuotesInput => {
            // The input's IP header (IPv4 without options: 20 bytes; IPv6:
            // 40) and the first 8 bytes of its L4 header.
            let quoted = &input[14..super::frame::l4_off(input) + 8];
            assert_eq!(
                &o.l4[8..],
                quoted,
                "quotes the original IP header and 8 bytes, no more"
            )
        }
    }
}

/// Runs every case through every program it applies to, each in a harness
/// of its own, and fails listing each (case, program) that did not do what
/// the table says.
pub fn run_cases(cases: &[Case]) {
    each_applies(cases);
    report(cases.iter().flat_map(|c| {
        c.expect
            .iter()
            .map(move |(prog, e)| (c, *prog, catch(|| c.run_through(*prog, e))))
    }));
}

/// As [`run_cases`], with one harness per program for the whole table: for
/// tables of cases that leave no state behind (nothing translated, nothing
/// tracked, no earlier packets), all of the same setup, where a harness per
/// case would only cost time.
pub fn run_stateless_cases(cases: &[Case]) {
    each_applies(cases);
    let Some(first) = cases.first() else { return };
    for c in cases {
        assert!(
            c.before.is_empty() && c.setup == first.setup,
            "case `{}`: not stateless, or another setup",
            c.what
        );
    }
    let mut results = Vec::new();
    for prog in Prog::ALL {
        let mut h = None;
        for c in cases {
            for (_, e) in c.expect.iter().filter(|(p, _)| *p == prog) {
                let h = h.get_or_insert_with(|| first.setup.harness());
                results.push((c, prog, catch(|| c.run_in(h, prog, e))));
            }
        }
    }
    report(results);
}

fn each_applies(cases: &[Case]) {
    for c in cases {
        assert!(
            !c.expect.is_empty(),
            "case `{}` applies to no program",
            c.what
        );
    }
}

/// The panic message of `f`, if it panicked.
fn catch(f: impl FnOnce()) -> Option<String> {
    let p = catch_unwind(AssertUnwindSafe(f)).err()?;
    Some(
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default(),
    )
}

/// Fails listing each (case, program) whose run panicked.
fn report<'a>(results: impl IntoIterator<Item = (&'a Case, Prog, Option<String>)>) {
    let mut failures = String::new();
    let mut n = 0;
    for (c, prog, failed) in results {
        n += 1;
        if let Some(msg) = failed {
            let _ = writeln!(failures, "- `{}` through {}: {msg}", c.what, prog.name());
        }
    }
    assert!(n > 0, "a table of no (case, program) runs");
    assert!(failures.is_empty(), "packet cases failed:\n{failures}");
    eprintln!("{n} (case, program) runs passed");
}

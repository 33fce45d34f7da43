//! The harness: a network namespace and a bpffs pin directory of their own
//! (both removed on drop, also when a test panics), the real object loaded
//! with the agent's `bpf::load`, its maps filled by the agent's own `Writer`,
//! and `BPF_PROG_TEST_RUN` of any of its programs inside that namespace.
//!
//! Why one file (about 700 lines): the pool of loaded objects and the map
//! reset are one mechanism. A harness's object goes back to `POOL` on drop
//! only once `reset_maps` has emptied its maps as a new load has them, and a
//! reset that finds a per-CPU entry at or above `PER_CPU_RESET_BOUND` fails
//! the test right there; the pool, the reset and that bound are read together.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsFd,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU32, Ordering},
        Mutex, Once,
    },
    time::Duration,
};

use anyhow::Context;
use aya::programs::{ProgramError, SchedClassifier, TestRun, TestRunOptions, Xdp};
use proxy_agent::{
    bpf::{
        self, BpfDataplane, MapSizes, PinnedMaps, EXT_INGRESS_PROGRAM, EXT_XDP_PROGRAM,
        POD_EGRESS_PROGRAM, POD_INGRESS_PROGRAM,
    },
    dataplane::Writer,
    model::{BackendAddr, DesiredState, Frontend, FrontendKey},
};
use proxy_common::{map_names, Config, SCOPE_EXTERNAL, SCOPE_INTERNAL};
use xtask::netns;

/// The datapath's programs that take packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Prog {
    /// tc ingress of the pods' host-side interfaces (internal frontends).
    PodIngress,
    /// tc ingress of the node's external devices (external frontends, replies).
    ExtIngress,
    /// XDP of the node's external devices (acceleration of `ext_ingress`).
    ExtXdp,
    /// tc egress towards a client (`pod_egress`: pod interfaces, and external
    /// devices when delivering through the stack): replies only.
    Egress,
}

impl Prog {
    pub const ALL: [Prog; 3] = [Prog::PodIngress, Prog::ExtIngress, Prog::ExtXdp];
    /// Both external-device programs: tc and XDP.
    pub const EXT: [Prog; 2] = [Prog::ExtIngress, Prog::ExtXdp];

    pub fn name(self) -> &'static str {
        match self {
            Prog::PodIngress => POD_INGRESS_PROGRAM,
            Prog::ExtIngress => EXT_INGRESS_PROGRAM,
            Prog::ExtXdp => EXT_XDP_PROGRAM,
            Prog::Egress => POD_EGRESS_PROGRAM,
        }
    }

    pub fn is_xdp(self) -> bool {
        self == Prog::ExtXdp
    }
}

/// A program's verdict, named once for tc and XDP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// tc: `TC_ACT_OK`; XDP: `XDP_PASS` (on to tc / the stack).
    Pass,
    /// tc: `TC_ACT_SHOT`; XDP: `XDP_DROP`.
    Drop,
    /// tc: `TC_ACT_REDIRECT`; XDP: `XDP_REDIRECT`.
    Redirect,
    /// XDP only: `XDP_TX`.
    Tx,
}

pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;

impl Verdict {
    /// The return value of `prog` that means this verdict.
    pub fn code(self, prog: Prog) -> u32 {
        match (self, prog.is_xdp()) {
            (Verdict::Pass, false) => TC_ACT_OK,
            (Verdict::Drop, false) => TC_ACT_SHOT,
            (Verdict::Redirect, false) => TC_ACT_REDIRECT,
            (Verdict::Tx, false) => panic!("XDP_TX is no tc verdict"),
            (Verdict::Pass, true) => XDP_PASS,
            (Verdict::Drop, true) => XDP_DROP,
            (Verdict::Redirect, true) => XDP_REDIRECT,
            (Verdict::Tx, true) => XDP_TX,
        }
    }
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A network namespace of its own, named `<prefix>-<pid>-<n>`, deleted on drop.
pub struct NetNs {
    name: String,
}

impl NetNs {
    pub fn new(prefix: &str) -> anyhow::Result<Self> {
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        );
        netns::create_netns(&name).with_context(|| format!("ip netns add {name} (root needed)"))?;
        Ok(Self { name })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip -n <ns> <args>`.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<()> {
        netns::ip_in(&self.name, args).map(drop)
    }

    /// Gives the namespace a "wire": a veth `kprv0` (MAC 02:..:aa) with a
    /// route to `route` and permanent neighbours `(address, MAC)`, and turns
    /// forwarding on, so that the FIB answers as on a node.
    pub fn wire(&self, route: &str, neighbours: &[(&str, &str)]) -> anyhow::Result<()> {
        self.ip(&["link", "set", "lo", "up"])?;
        self.ip(&[
            "link",
            "add",
            "kprv0",
            "address",
            "02:00:00:00:00:aa",
            "type",
            "veth",
            "peer",
            "name",
            "kprv1",
        ])?;
        self.ip(&["link", "set", "kprv0", "up"])?;
        self.ip(&["link", "set", "kprv1", "up"])?;
        self.ip(&["route", "add", route, "dev", "kprv0"])?;
        for (addr, mac) in neighbours {
            self.ip(&[
                "neigh",
                "add",
                addr,
                "lladdr",
                mac,
                "dev",
                "kprv0",
                "nud",
                "permanent",
            ])?;
        }
        netns::sysctl_in(&self.name, "net.ipv4.ip_forward", "1")?;
        netns::sysctl_in(&self.name, "net.ipv4.conf.lo.forwarding", "1")?;
        netns::sysctl_in(&self.name, "net.ipv6.conf.all.forwarding", "1")?;
        netns::sysctl_in(&self.name, "net.ipv6.conf.lo.forwarding", "1")?;
        Ok(())
    }

    /// Runs `f` on a scoped thread that first joins the namespace (the calling
    /// thread stays where it is). `f` may borrow.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let file = std::fs::File::open(netns::netns_path(&self.name)).expect("open netns");
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("setns");
                f()
            })
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
        })
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = netns::delete_netns(&self.name);
    }
}

/// A bpffs pin directory, removed (with every pin in it) on drop.
pub struct PinDir(PathBuf);

impl PinDir {
    pub fn new(name: &str) -> Self {
        Self(PathBuf::from("/sys/fs/bpf").join(name))
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The hairpin address every harness configures (as a node would), and
/// IPv6's, [`HAIRPIN6`].
pub const HAIRPIN: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 254);
/// IPv6's hairpin address.
pub const HAIRPIN6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0xfe);

/// One program run: return value, output frame, the kernel's duration.
pub struct Run {
    pub retval: u32,
    pub frame: Vec<u8>,
    pub duration: Duration,
}

/// A fresh netns, a pin dir, the object loaded, and a writer over its maps.
/// Fields drop in order: the object's fds, then the pins, then the namespace.
///
/// Loading the object is what a harness costs (the verifier checks every
/// program: about a second here, a minute under a VM's software emulation),
/// so harnesses of the default map sizes reuse the object of a finished one
/// from `POOL`, its maps emptied first: a test sees maps as fresh as a new
/// load's, in a namespace of its own.
pub struct Harness {
    pub writer: Writer<BpfDataplane>,
    loaded: Option<Loaded>,
    /// Of the default sizes: its object goes back to the pool on drop.
    reusable: bool,
    sizes: MapSizes,
    config: Config,
    /// Migrations [`Harness::reload`] began ([`Harness::finish_migrations`]).
    pending: Vec<bpf::PendingMigration>,
    pub netns: NetNs,
}

/// A loaded object and the pin directory of its maps.
struct Loaded {
    ebpf: aya::Ebpf,
    pins: PinDir,
    /// The build of the tc ingress programs loaded (the agent's choice for
    /// this kernel).
    port_search: bpf::PortSearch,
}

impl Loaded {
    /// The object loaded over `pins`, as an agent starting on the node
    /// loads it: the object, the writer's maps, and the migrations from
    /// older layouts it began.
    fn load(
        pins: PinDir,
        sizes: MapSizes,
    ) -> anyhow::Result<(Self, BpfDataplane, Vec<bpf::PendingMigration>)> {
        let mut b = bpf::load(pins.path(), sizes).context("load datapath")?;
        let dp = BpfDataplane::new(&mut b.ebpf, sizes).context("maps")?;
        let pending = std::mem::take(&mut b.pending_migrations);
        let loaded = Self {
            ebpf: b.ebpf,
            pins,
            port_search: b.port_search,
        };
        Ok((loaded, dp, pending))
    }
}

/// A writer adopting `dp`, configured with `config`.
fn writer_over(mut dp: BpfDataplane, config: Config) -> anyhow::Result<Writer<BpfDataplane>> {
    dp.set_config(config).context("config")?;
    Writer::adopt(dp).context("adopt")
}

/// Objects of finished harnesses (default map sizes), maps emptied, with
/// their pin directories; removed when the test process exits.
static POOL: Mutex<Vec<Loaded>> = Mutex::new(Vec::new());
static POOL_CLEANUP: Once = Once::new();

extern "C" fn drain_pool() {
    if let Ok(mut pool) = POOL.lock() {
        pool.clear();
    }
}

impl Harness {
    /// Default map sizes, config with the hairpin addresses [`HAIRPIN`] and
    /// [`HAIRPIN6`] (a dual-stack node's).
    // No `Default`: a harness is no default value but a namespace and a
    // loaded object (root needed), so it is made by name only.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        Self::with_sizes(MapSizes::default())
    }

    pub fn with_sizes(sizes: MapSizes) -> Self {
        Self::try_new(
            "kpr-pkt",
            sizes,
            Config::default()
                .with_hairpin_addr(HAIRPIN)
                .with_hairpin6_addr(HAIRPIN6),
        )
        .expect("packet-test harness")
    }

    /// A harness whose namespace (and, for a new object, pin dir) is named
    /// `<prefix>-<pid>-<n>`.
    pub fn try_new(prefix: &str, sizes: MapSizes, config: Config) -> anyhow::Result<Self> {
        let netns = NetNs::new(prefix)?;
        let reusable = sizes == MapSizes::default();
        let pooled = if reusable {
            POOL.lock().unwrap_or_else(|e| e.into_inner()).pop()
        } else {
            None
        };
        let (loaded, dp) = match pooled {
            Some(l) => {
                let dp = BpfDataplane::from_pins(l.pins.path(), sizes).context("maps")?;
                (l, dp)
            }
            None => {
                let (mut l, dp, pending) = Loaded::load(PinDir::new(netns.name()), sizes)?;
                bpf::finish_migrations(&mut l.ebpf, pending);
                (l, dp)
            }
        };
        let writer = writer_over(dp, config)?;
        Ok(Self {
            writer,
            loaded: Some(loaded),
            reusable,
            sizes,
            config,
            pending: Vec::new(),
            netns,
        })
    }

    /// Leaves this harness's object out of the pool when it is dropped (it
    /// is unloaded instead): for a user whose ids go beyond what a reset
    /// zeroes on 5.10 (the per-CPU arrays' first 4,096 entries), such as
    /// `prog_cost` at N = 10,000, where a pooled harness would fail its
    /// drop.
    pub fn unpooled(&mut self) {
        self.reusable = false;
    }

    /// As an agent restarted (or upgraded) on the node: the object is loaded
    /// again over the pins the previous one left (adopted, or migrated from
    /// older layouts), and a new writer adopts what they hold. Nothing is
    /// synced. Migrations from older layouts are left to finish as the
    /// agent finishes them before attaching ([`Harness::finish_migrations`]).
    /// The object is not pooled afterwards.
    pub fn reload(&mut self) -> anyhow::Result<()> {
        let Loaded { ebpf, pins, .. } = self.loaded.take().expect("a live harness");
        // The previous agent's descriptors go; its pins stay.
        drop(ebpf);
        self.reusable = false;
        let (loaded, dp, pending) = Loaded::load(pins, self.sizes)?;
        self.writer = writer_over(dp, self.config)?;
        self.pending = pending;
        self.loaded = Some(loaded);
        Ok(())
    }

    /// What the agent does just before it attaches its programs: the
    /// migrations [`Harness::reload`] began are finished (flow state copied
    /// again, old pins removed).
    pub fn finish_migrations(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        let loaded = self.loaded.as_mut().expect("a live harness");
        bpf::finish_migrations(&mut loaded.ebpf, pending);
    }

    fn loaded(&self) -> &Loaded {
        self.loaded.as_ref().expect("a live harness has its object")
    }

    /// How the loaded tc programs find a source port once random tries fail.
    pub fn port_search(&self) -> bpf::PortSearch {
        self.loaded().port_search
    }

    pub fn pin_dir(&self) -> &Path {
        self.loaded().pins.path()
    }

    pub fn maps(&self) -> PinnedMaps {
        PinnedMaps::new(self.pin_dir())
    }

    /// The pinned LRU hash map `name` (conntrack, affinity), writable.
    pub fn lru_map<K: aya::Pod, V: aya::Pod>(
        &self,
        name: &str,
    ) -> aya::maps::HashMap<aya::maps::MapData, K, V> {
        let pinned = aya::maps::MapData::from_pin(self.pin_dir().join(name))
            .unwrap_or_else(|e| panic!("open the pin of {name}: {e}"));
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(pinned))
            .unwrap_or_else(|e| panic!("{name} as an LRU hash map: {e}"))
    }

    pub fn stats(&self) -> BTreeMap<u32, u64> {
        self.maps().stats().expect("stats")
    }

    pub fn set_config(&mut self, config: Config) {
        self.writer
            .dataplane_mut()
            .set_config(config)
            .expect("config");
    }

    /// Programs `desired`; panics on any error of the writer.
    pub fn sync_desired(&mut self, desired: &DesiredState) {
        let r = self.writer.sync(desired);
        assert!(r.errors.is_empty(), "sync errors: {:?}", r.errors);
    }

    /// Frontends as `(key, backends, flags)`, all of service `default/test`.
    pub fn sync(&mut self, frontends: &[(FrontendKey, Vec<BackendAddr>, u16)]) {
        self.sync_with_affinity(frontends, 0)
    }

    pub fn sync_with_affinity(
        &mut self,
        frontends: &[(FrontendKey, Vec<BackendAddr>, u16)],
        affinity_timeout_s: u32,
    ) {
        self.sync_desired(&desired(frontends, affinity_timeout_s))
    }

    pub fn wire(&self, route: &str, neighbours: &[(&str, &str)]) {
        self.netns.wire(route, neighbours).expect("wire the netns");
    }

    /// One `BPF_PROG_TEST_RUN` of `prog` on the calling thread, which must be
    /// inside the namespace already (see [`Harness::enter`]).
    pub fn test_run(&self, prog: Prog, input: &[u8]) -> Result<Run, ProgramError> {
        let mut out = vec![0u8; input.len() + 256];
        let opts = TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            ..Default::default()
        };
        let loaded = self.loaded();
        let p = loaded
            .ebpf
            .program(loaded.port_search.program(prog.name()))
            .expect("program in the object");
        let r = if prog.is_xdp() {
            let x: &Xdp = p.try_into()?;
            x.test_run(opts)?
        } else {
            let c: &SchedClassifier = p.try_into()?;
            c.test_run(opts)?
        };
        out.truncate(r.data_size_out as usize);
        Ok(Run {
            retval: r.return_value,
            frame: out,
            duration: r.duration,
        })
    }

    /// Runs `f` on a thread inside the harness's namespace.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        self.netns.enter(f)
    }

    /// Runs one frame through `prog` inside the namespace: (verdict, output).
    pub fn try_run_prog(&self, prog: Prog, input: &[u8]) -> Result<(u32, Vec<u8>), ProgramError> {
        self.enter(|| self.test_run(prog, input))
            .map(|r| (r.retval, r.frame))
    }

    pub fn run_prog(&self, prog: Prog, input: &[u8]) -> (u32, Vec<u8>) {
        self.try_run_prog(prog, input).expect("BPF_PROG_TEST_RUN")
    }

    /// Through `pod_ingress`.
    pub fn run(&self, input: &[u8]) -> (u32, Vec<u8>) {
        self.run_prog(Prog::PodIngress, input)
    }

    pub fn try_run(&self, input: &[u8]) -> Result<(u32, Vec<u8>), ProgramError> {
        self.try_run_prog(Prog::PodIngress, input)
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        let Some(loaded) = self.loaded.take() else {
            return;
        };
        // A failed test's object is dropped (its pins removed), not reused.
        if !self.reusable || std::thread::panicking() {
            return;
        }
        match reset_maps(loaded.pins.path()) {
            Ok(()) => {
                POOL_CLEANUP.call_once(|| {
                    // SAFETY: registers a plain function run at exit.
                    unsafe { libc::atexit(drain_pool) };
                });
                POOL.lock().unwrap_or_else(|e| e.into_inner()).push(loaded);
            }
            // The test broke what lets 5.10 reuse objects: it fails here.
            Err(e @ ResetError::BeyondBound { .. }) => panic!("harness: {e}"),
            // Dropped: the next harness loads the object again (slower,
            // never wrong).
            Err(e) => eprintln!("harness: maps not reset, object not reused: {e:#}"),
        }
    }
}

const BPF_MAP_UPDATE_ELEM: i64 = 2;
const BPF_MAP_GET_NEXT_KEY: i64 = 4;
const BPF_MAP_LOOKUP_BATCH: i64 = 24;
const BPF_MAP_UPDATE_BATCH: i64 = 26;

/// The per-CPU arrays a pooled harness's traffic writes (statistics, the
/// traffic counters and the round-robin cursors, indexed by reverse-NAT and
/// backend ids) hold nothing at or above this index. A fresh writer hands
/// out ids from 1 on, and no test of the default sizes makes thousands.
/// Where the kernel has no batch update of per-CPU arrays (5.10), the
/// reset zeroes only the indexes below it, one at a time: all 262,144
/// elements took about 6 s per harness under the VM's emulation. Where the
/// kernel can read them in a batch (the host), the reset first checks that
/// nothing at or above the bound is set, so a test that breaks the bound
/// fails there.
pub const PER_CPU_RESET_BOUND: u32 = 4096;

fn sys_bpf(cmd: i64, attr: &mut [u64; 8]) -> std::io::Result<()> {
    // SAFETY: the bpf(2) system call with a zero-padded attribute of the
    // size given, pointing at live buffers.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), 64u32) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Why [`reset_maps`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ResetError {
    /// A per-CPU array holds a value at or above [`PER_CPU_RESET_BOUND`]:
    /// a kernel without batch updates would have left it to the next test.
    #[error(
        "{map}[{index}] is not zero: a pooled harness's per-CPU arrays must stay below \
         index {PER_CPU_RESET_BOUND}, which is all a reset zeroes on 5.10 (use ids below it, \
         or a harness of other sizes, which is not pooled)"
    )]
    BeyondBound { map: &'static str, index: u32 },
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// Bytes of one element of a per-CPU array of `value_size`-byte values,
/// all CPUs' copies (each padded to 8 bytes), as the bpf(2) calls pass it.
fn per_cpu_element(value_size: usize) -> anyhow::Result<usize> {
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| anyhow::Error::from(e))?;
    Ok(value_size.div_ceil(8) * 8 * cpus)
}

/// Whether this kernel reads per-CPU arrays in a batch (5.13 and later),
/// so that [`reset_maps`] checks [`PER_CPU_RESET_BOUND`]: probed on the
/// round-robin cursors pinned under `pin_dir`.
pub fn per_cpu_bound_checked(pin_dir: &Path) -> anyhow::Result<bool> {
    use std::os::fd::AsRawFd;
    let m = aya::maps::MapData::from_pin(pin_dir.join(map_names::ROUND_ROBIN))
        .context("open the round-robin cursors")?;
    let info = m.info()?;
    let per = per_cpu_element(info.value_size() as usize)?;
    let fd = m.fd().as_fd().as_raw_fd() as u64;
    Ok(read_beyond_bound(fd, info.max_entries(), per).is_some())
}

/// The first index at or above [`PER_CPU_RESET_BOUND`] whose value in the
/// per-CPU array `fd` (`n` elements of `per` bytes for all CPUs) is not
/// zero, or `None` where the kernel cannot read the array in a batch
/// ([`per_cpu_bound_checked`]).
fn read_beyond_bound(fd: u64, n: u32, per: usize) -> Option<Option<u32>> {
    if n <= PER_CPU_RESET_BOUND {
        return Some(None);
    }
    // From the bound on: the batch starts after `in_batch`.
    let count = n - PER_CPU_RESET_BOUND;
    let in_batch = PER_CPU_RESET_BOUND - 1;
    let mut keys = vec![0u32; count as usize];
    let mut values = vec![0u8; per * count as usize];
    let mut out_batch = 0u32;
    let mut attr = [0u64; 8];
    attr[0] = &in_batch as *const u32 as u64;
    attr[1] = &mut out_batch as *mut u32 as u64;
    attr[2] = keys.as_mut_ptr() as u64;
    attr[3] = values.as_mut_ptr() as u64;
    attr[4] = u64::from(count) | (fd << 32);
    match sys_bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) {
        Ok(()) => {}
        // The whole array read: the kernel says so with ENOENT.
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        Err(_) => return None,
    }
    let got = (attr[4] & 0xffff_ffff) as usize;
    Some(
        keys.iter()
            .zip(values.chunks(per))
            .take(got)
            .find(|(k, v)| **k >= PER_CPU_RESET_BOUND && v.iter().any(|b| *b != 0))
            .map(|(k, _)| *k),
    )
}

/// Empties every map pinned under `pin_dir` as a new load would have it:
/// hash, LRU and LPM maps lose every entry, arrays are zeroed (per-CPU
/// arrays below [`PER_CPU_RESET_BOUND`] only, on a kernel without their
/// batch update). The program arrays keep the object's IPv6 programs, as a
/// new load fills them.
pub fn reset_maps(pin_dir: &Path) -> Result<(), ResetError> {
    use aya::maps::{MapData, MapType};
    use std::os::fd::AsRawFd;
    let programs = [map_names::TAIL6, map_names::TAIL6_XDP];
    for name in map_names::ALL.into_iter().filter(|n| !programs.contains(n)) {
        let m = MapData::from_pin(pin_dir.join(name)).with_context(|| format!("open {name}"))?;
        let info = m.info().context("map info")?;
        let fd = m.fd().as_fd().as_raw_fd() as u64;
        let (ks, vs, n) = (
            info.key_size() as usize,
            info.value_size() as usize,
            info.max_entries(),
        );
        let ty = info.map_type().context("map type")?;
        if matches!(ty, MapType::Array | MapType::PerCpuArray) {
            let per_cpu = ty == MapType::PerCpuArray;
            let per = if per_cpu { per_cpu_element(vs)? } else { vs };
            if per_cpu {
                if let Some(index) = read_beyond_bound(fd, n, per).flatten() {
                    return Err(ResetError::BeyondBound { map: name, index });
                }
            }
            // A per-CPU array holds nothing from the bound on (checked just
            // now where the kernel can read it in a batch).
            let upto = if per_cpu {
                n.min(PER_CPU_RESET_BOUND)
            } else {
                n
            };
            let keys: Vec<u32> = (0..upto).collect();
            let zeros = vec![0u8; per * upto as usize];
            let mut attr = [0u64; 8];
            attr[2] = keys.as_ptr() as u64;
            attr[3] = zeros.as_ptr() as u64;
            attr[4] = u64::from(upto) | (fd << 32);
            if sys_bpf(BPF_MAP_UPDATE_BATCH, &mut attr).is_err() {
                // A kernel without batch updates of per-CPU arrays (5.10
                // answers ENOTSUPP): one element at a time.
                for (key, value) in keys.iter().zip(zeros.chunks(per)) {
                    let mut attr = [0u64; 8];
                    attr[0] = fd;
                    attr[1] = key as *const u32 as u64;
                    attr[2] = value.as_ptr() as u64;
                    sys_bpf(BPF_MAP_UPDATE_ELEM, &mut attr)
                        .with_context(|| format!("zero {name}[{key}]"))?;
                }
            }
        } else {
            xtask::bench::sys::clear_pinned_map(&pin_dir.join(name))
                .with_context(|| format!("empty {name}"))?;
            // Nothing left (an entry clear_pinned_map missed would leak into the
            // next test).
            let probe = vec![0u8; ks];
            let mut attr = [0u64; 8];
            attr[0] = fd;
            attr[2] = probe.as_ptr() as u64;
            if sys_bpf(BPF_MAP_GET_NEXT_KEY, &mut attr).is_ok() {
                return Err(anyhow::anyhow!("{name} not empty after reset").into());
            }
        }
    }
    Ok(())
}

/// The desired state of `frontends` (all of service `default/test`).
pub fn desired(
    frontends: &[(FrontendKey, Vec<BackendAddr>, u16)],
    affinity_timeout_s: u32,
) -> DesiredState {
    let mut d = DesiredState::default();
    for (k, b, flags) in frontends {
        d.frontends.insert(
            *k,
            Frontend {
                service: "default/test".into(),
                port_name: "".into(),
                backends: b.clone(),
                flags: *flags,
                affinity_timeout_s,
                ..Default::default()
            },
        );
    }
    d
}

/// An internal (ClusterIP) frontend key, of either family.
pub fn fe(addr: impl Into<IpAddr>, port: u16, proto: u8) -> FrontendKey {
    FrontendKey {
        addr: addr.into(),
        port,
        proto,
        scope: SCOPE_INTERNAL,
    }
}

/// An external (NodePort, LB IP, externalIP) frontend key, of either
/// family.
pub fn fe_ext(addr: impl Into<IpAddr>, port: u16, proto: u8) -> FrontendKey {
    FrontendKey {
        addr: addr.into(),
        port,
        proto,
        scope: SCOPE_EXTERNAL,
    }
}

/// A backend's address, of either family.
pub fn be(addr: impl Into<IpAddr>, port: u16, proto: u8) -> BackendAddr {
    BackendAddr {
        addr: addr.into(),
        port,
        proto,
    }
}

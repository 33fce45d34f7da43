//! The BPF side of the agent: loading the embedded object with its maps pinned
//! under a bpffs directory (a restarted agent adopts them), the [`Dataplane`]
//! implementation over those maps, and attaching the tc program to pod
//! interfaces.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the object, program names, map sizes, loading with pinned maps, layout migrations |
//! | `dataplane.rs` | [`BpfDataplane`]: the writer's maps |
//! | `batch.rs` | whole-map reads in batches (`BPF_MAP_LOOKUP_BATCH`), aya's iterator where the kernel has none |
//! | `gc.rs` | conntrack garbage collection: [`ConntrackGc`], bounded rounds on a thread of its own |
//! | `pinned.rs` | [`PinnedMaps`]: read-only access to a running agent's maps (inspect, metrics) |
//! | `pins.rs` | pinned maps checked against this build on adoption: resized, reset or refused |
//! | `migrations.rs` | the `_V1` layouts (16-bit reverse-NAT ids) and their migration to `_V2` |
//! | `links.rs` | [`Attacher`]: tc and XDP links, pinned and taken over on restart; `cleanup` |
//!
//! Why one file (about 800 lines): loading is one ordered sequence
//! (`load_inner`, `load_checked`): pins checked against this build, maps of
//! older layouts migrated before any program of the new object can be
//! tail-called, the tc programs with their fallback build, then the IPv6
//! programs, XDP and the socket hooks as far as the kernel takes them; the
//! migrations finish only just before attach (`finish_migrations`). The types
//! that sequence fills (`Loaded`, `PortSearch`, `Migration`,
//! `PendingMigration`) stay beside it, and the submodules take their imports
//! from here (`use super::*`).
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use aya::{
    maps::{
        lpm_trie::{Key as LpmKey, LpmTrie},
        Array, HashMap, MapData, MapError, PerCpuArray,
    },
    programs::{
        links::{FdLink, PinnedLink},
        tc::SchedClassifierLink,
        xdp::XdpLink,
        CgroupSockAddr, ProgramError, SchedClassifier, TcAttachType, Xdp, XdpMode,
    },
    Ebpf, EbpfLoader,
};
use proxy_common::{
    capacity, conntrack, iface_flags,
    lb::{MaglevChunk, MaglevKey},
    map_names, stat, Affinity4Key, Affinity6Key, AffinityValue, Backend4, Backend6, Config, Ct4Key,
    Ct4Value, Ct6Key, Ct6Value, Iface, RevNat4, RevNat6, RevNatId, SourceRange4, SourceRange6,
    Svc4Key, Svc6Key, SvcValue, Traffic, SOURCE_RANGE_ID_BITS,
};

use crate::dataplane::{
    each, family_runs, BackendEntry, BatchOutcome, ByFamily, Dataplane, DataplaneError, Family,
    Programmed, RevNatEntry, ServiceKey, SourceRange,
};

/// The kernel object built from `proxy-ebpf` by `build.rs`.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy"));

/// Name of the tc program for pod interfaces (the function name in `proxy-ebpf`).
pub const POD_INGRESS_PROGRAM: &str = "pod_ingress";
/// Name of the tc egress program for pod interfaces (reverse NAT of replies
/// from hostNetwork backends on this node).
pub const POD_EGRESS_PROGRAM: &str = "pod_egress";
/// Name of the tc program for the node's external devices.
pub const EXT_INGRESS_PROGRAM: &str = "ext_ingress";

/// `pod_ingress` and `ext_ingress` built for kernels without `bpf_loop`
/// (see [`PortSearch`]).
pub const POD_INGRESS_RND_PROGRAM: &str = "pod_ingress_rnd";
pub const EXT_INGRESS_RND_PROGRAM: &str = "ext_ingress_rnd";

/// The IPv6 tc programs, at their index of the `TAIL6_V1` program array
/// (the IPv4 programs tail-call them for IPv6 frames); the ingress ones in
/// the build of the IPv4 programs ([`PortSearch::program`]).
pub const IPV6_PROGRAMS: [(&str, u32); 3] =
    [("pod_ingress6", 0), ("ext_ingress6", 1), ("pod_egress6", 2)];

/// The XDP program for IPv6, tail-called by `ext_xdp` (`TAIL6_XDP_V1`).
pub const EXT_XDP6_PROGRAM: &str = "ext_xdp6";

/// Name of the XDP program for the node's external devices (`--acceleration xdp`).
pub const EXT_XDP_PROGRAM: &str = "ext_xdp";

/// How the tc ingress programs find a source port for a new flow that needs
/// one (SNAT to the node for external traffic to another node's backend, or
/// a tuple another flow holds) once a few random ports of the SNAT range
/// were all in use. The object holds both builds of `pod_ingress` and
/// `ext_ingress`; the agent loads the one the kernel can run (a program
/// that so much as references a loop callback is refused by a kernel
/// without `bpf_loop`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortSearch {
    /// The whole range is searched, port by port (`bpf_loop`, Linux 5.17):
    /// a flow is dropped only when no port is free.
    Exhaustive,
    /// Random tries only: a flow may be dropped while a few ports are free.
    RandomTries,
}

impl PortSearch {
    /// The build this kernel runs, from the probes' decision.
    pub fn of(kernel: &probe::Decision) -> Self {
        if kernel.has(Capability::SnatPortSearch) {
            PortSearch::Exhaustive
        } else {
            PortSearch::RandomTries
        }
    }

    /// The build this kernel runs, probed now.
    pub fn probe() -> Self {
        Self::of(&probe::decide(&probe::probe()))
    }

    /// The program of `name` (`pod_ingress`, `ext_ingress` or their IPv6
    /// twins) in this build; any other name is returned as it is.
    pub fn program(self, name: &str) -> &str {
        match (self, name) {
            (PortSearch::RandomTries, POD_INGRESS_PROGRAM) => POD_INGRESS_RND_PROGRAM,
            (PortSearch::RandomTries, EXT_INGRESS_PROGRAM) => EXT_INGRESS_RND_PROGRAM,
            (PortSearch::RandomTries, "pod_ingress6") => "pod_ingress6_rnd",
            (PortSearch::RandomTries, "ext_ingress6") => "ext_ingress6_rnd",
            _ => name,
        }
    }
}

/// The cgroup socket hooks serving the node's own clients (host
/// processes, hostNetwork pods), see `proxy-ebpf/src/sock.rs`.
pub const SOCK_PROGRAMS: [&str; 8] = [
    "sock_connect4",
    "sock_sendmsg4",
    "sock_recvmsg4",
    "sock_getpeername4",
    "sock_connect6",
    "sock_sendmsg6",
    "sock_recvmsg6",
    "sock_getpeername6",
];

/// What the kernel offers the socket hooks, found at load time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SockLbSupport {
    /// The hooks loaded; `Err` says why not (the capability is then off).
    pub loaded: Result<(), String>,
    /// The netns cookie the hooks serve (0: every namespace, where the kernel
    /// lacks `SO_NETNS_COOKIE`).
    pub netns_cookie: u64,
    /// Whether failed calls get their own errno (`bpf_set_retval`).
    pub set_retval: bool,
}

/// Which program a link attaches, and so to which side of the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum IfaceKind {
    /// The host side of a pod's veth: `pod_ingress` at tc ingress, delivered
    /// to with `bpf_redirect_peer`.
    Pod,
    /// The same veth's tc egress: `pod_egress`, reverse NAT of replies the
    /// node's own stack sends to the pod.
    PodEgress,
    /// A device towards other nodes and external clients: `ext_ingress` at tc
    /// ingress.
    External,
    /// The same device's XDP hook: `ext_xdp` (XDP acceleration).
    ExternalXdp,
    /// The same device's tc egress: `pod_egress`, the reply program, which
    /// reverse-translates replies of flows delivered through the stack on
    /// their way to an external client (`deliveryMode` auto or stack).
    ExternalEgress,
}

impl IfaceKind {
    /// The program attached for this kind, in the build `search` names.
    pub fn program(self, search: PortSearch) -> &'static str {
        search.program(match self {
            IfaceKind::Pod => POD_INGRESS_PROGRAM,
            IfaceKind::PodEgress => POD_EGRESS_PROGRAM,
            IfaceKind::External => EXT_INGRESS_PROGRAM,
            IfaceKind::ExternalXdp => EXT_XDP_PROGRAM,
            IfaceKind::ExternalEgress => POD_EGRESS_PROGRAM,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error("cannot prepare the pin directory {path}: {source}")]
    PinDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not on a bpffs mount (mount one with `mount -t bpf bpf {path}` or pass --bpffs under /sys/fs/bpf)")]
    NotBpffs { path: PathBuf },
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: MapError,
    },
    #[error("map {name} pinned at {}: {source}", .path.display())]
    Pinned {
        name: &'static str,
        path: PathBuf,
        source: MapError,
    },
    #[error("{}: no such directory, so no pinned maps to read (is an agent running with this --bpffs?)", .path.display())]
    NoPinDir { path: PathBuf },
    #[error("map {name} pinned at {}: its {field} is {found}, this build expects {expected}; \
             a map of another layout under this name cannot be adopted (remove it with \
             `proxy-agent cleanup`, which ends the flows it tracks)", .path.display())]
    PinMismatch {
        name: &'static str,
        path: PathBuf,
        field: &'static str,
        expected: u32,
        found: u32,
    },
    #[error("map {0} missing from the object")]
    MissingMap(&'static str),
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("program {name}: link: {reason}")]
    Link { name: &'static str, reason: String },
    #[error("cgroup {path}: {reason}")]
    Cgroup { path: PathBuf, reason: String },
    #[error("{0}")]
    Kernel(String),
}

/// Map sizes, from the agent's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    pub services: u32,
    pub backends: u32,
    pub rev_nat: u32,
    pub conntrack: u32,
    /// Maglev chunks: two generations of `loadBalancing.maglev.maxTables`
    /// tables of `tableSize` entries.
    pub maglev_chunks: u32,
}

impl MapSizes {
    /// Every map whose size follows the configuration, with that size: the
    /// maps of frontends and backends, and the arrays their ids index.
    pub fn configured(&self) -> [(&'static str, u32); 11] {
        [
            (map_names::SERVICES, self.services),
            (map_names::SERVICES6, self.services),
            (map_names::BACKENDS, self.backends),
            (map_names::BACKENDS6, self.backends),
            (map_names::BACKEND_TRAFFIC, self.backends),
            (map_names::REV_NAT, self.rev_nat),
            (map_names::REV_NAT6, self.rev_nat),
            (map_names::FRONTEND_TRAFFIC, self.rev_nat),
            (map_names::ROUND_ROBIN, self.rev_nat),
            (map_names::CONNTRACK, self.conntrack),
            (map_names::MAGLEV, self.maglev_chunks),
        ]
    }
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: capacity::SERVICES,
            backends: capacity::BACKENDS,
            rev_nat: capacity::REV_NAT,
            conntrack: capacity::CONNTRACK,
            maglev_chunks: capacity::MAGLEV_CHUNKS,
        }
    }
}

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

fn ensure_bpffs_dir(dir: &Path) -> Result<(), BpfError> {
    std::fs::create_dir_all(dir).map_err(|source| BpfError::PinDir {
        path: dir.into(),
        source,
    })?;
    let st = nix::sys::statfs::statfs(dir).map_err(|e| BpfError::PinDir {
        path: dir.into(),
        source: std::io::Error::from_raw_os_error(e as i32),
    })?;
    if st.filesystem_type().0 as i64 != BPF_FS_MAGIC {
        return Err(BpfError::NotBpffs { path: dir.into() });
    }
    Ok(())
}

/// The loaded object: programs (for attaching) and the maps, pinned.
pub struct Loaded {
    pub ebpf: Ebpf,
    pub pin_dir: PathBuf,
    /// Whether the socket hooks for host clients could be loaded.
    pub sock_lb: SockLbSupport,
    /// Whether `ext_xdp` loaded (XDP acceleration); `Err` says why not.
    pub xdp: Result<(), String>,
    /// Which build of the tc ingress programs was loaded.
    pub port_search: PortSearch,
    /// Whether the IPv6 tc programs loaded (and are tail-called); `Err`
    /// says why not: IPv6 then passes untouched.
    pub ipv6: Result<(), String>,
    /// Migrations begun at load, for [`Loaded::finish_migrations`].
    pub pending_migrations: Vec<PendingMigration>,
}

impl Loaded {
    /// Finishes the migrations [`load`] began; to be called just before the
    /// programs are attached (see [`finish_migrations`]).
    pub fn finish_migrations(&mut self) {
        finish_migrations(&mut self.ebpf, std::mem::take(&mut self.pending_migrations));
    }
}

/// This process's network namespace cookie (`SO_NETNS_COOKIE`, Linux 5.14),
/// the one the socket hooks compare with; `None` where the kernel lacks it.
pub fn own_netns_cookie() -> Option<u64> {
    use std::os::fd::AsRawFd;
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").ok()?;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt into a u64 of the given length, on a socket we own.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    (rc == 0 && cookie != 0).then_some(cookie)
}

/// Probes what the socket hooks may use on this kernel (never by version).
fn probe_sock_lb() -> SockLbSupport {
    use aya::{programs::ProgramType, sys::BpfHelper};
    let set_retval =
        aya::sys::is_helper_supported(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_set_retval)
            .unwrap_or(false);
    let netns_cookie = own_netns_cookie().unwrap_or(0);
    SockLbSupport {
        loaded: Ok(()),
        netns_cookie,
        set_retval,
    }
}

/// How many times one program's load is tried when the kernel gave up
/// verifying it because a signal was pending. libbpf's `PROG_LOAD_ATTEMPTS`
/// is 5; a fresh-clone CI run's host packet pass lost `ext_xdp` after 5
/// `EAGAIN`s in a row (its verification doubled with SCTP, 97k to 195k
/// instructions on 6.18, and so did its window for a signal), so 10.
pub const LOAD_ATTEMPTS: usize = 10;

/// Runs `load` (one program's `BPF_PROG_LOAD`) again, up to [`LOAD_ATTEMPTS`]
/// times in all, while it fails with `EAGAIN`. The verifier checks for a
/// pending signal between instructions and returns `-EAGAIN` when it finds
/// one, so verifying a large program (tens of milliseconds, seconds under
/// emulation) in a process that receives signals fails with nothing wrong
/// with the program; libbpf retries the same way. Any other error, or the
/// last attempt's, is returned as it is.
pub fn load_retrying(
    name: &str,
    mut load: impl FnMut() -> Result<(), ProgramError>,
) -> Result<(), ProgramError> {
    let mut attempt = 1;
    loop {
        match load() {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && attempt < LOAD_ATTEMPTS =>
            {
                tracing::debug!(
                    program = name,
                    attempt,
                    "verification interrupted by a signal (EAGAIN); loading again"
                );
                attempt += 1;
            }
            other => return other,
        }
    }
}

/// Loads the socket hooks; an error turns host socket load balancing off.
fn load_sock_programs(ebpf: &mut Ebpf) -> Result<(), String> {
    for name in SOCK_PROGRAMS {
        let prog: &mut CgroupSockAddr = ebpf
            .program_mut(name)
            .ok_or_else(|| format!("program {name} missing from the object"))?
            .try_into()
            .map_err(|e| format!("program {name}: {e}"))?;
        load_retrying(name, || prog.load()).map_err(|e| {
            // The verifier's log is for developers: debug level.
            tracing::debug!(program = name, error = ?e, "socket hook not loaded");
            format!("program {name} not accepted by this kernel: {e}")
        })?;
    }
    Ok(())
}

/// Loads the embedded object. Every map is pinned as `<pin_dir>/<MAP_NAME>`; a
/// map already pinned there (by an earlier agent) is reused, with its entries,
/// so established flows keep their conntrack state across restarts.
pub fn load(pin_dir: &Path, sizes: MapSizes) -> Result<Loaded, BpfError> {
    load_with_migrations(pin_dir, sizes, MIGRATIONS)
}

/// [`load`] for a node whose host clients' UDP to ClusterIPs goes through
/// the host-client device `host_dev` ([`crate::host::svc_device`]): the
/// programs learn its ifindexes (replies injected there), and the socket
/// hooks leave such UDP untranslated.
pub fn load_with_host_device(
    pin_dir: &Path,
    sizes: MapSizes,
    host_dev: Option<crate::host::svc_device::HostDevice>,
) -> Result<Loaded, BpfError> {
    load_inner(pin_dir, sizes, MIGRATIONS, host_dev)
}

/// A change of a map's layout, from the pinned map of an older agent to the
/// current one. Map names carry their layout version (`CT4_V1`); an agent
/// that finds a pinned map of an older version copies its entries, converted,
/// into the current map when it loads, then (see [`finish_migrations`])
/// removes the old pin just before it attaches its programs. Entries of an
/// old map with no migration are dropped (with a warning).
#[derive(Clone, Copy)]
pub struct Migration {
    /// Pinned name of the old layout, e.g. `CT4_V0`.
    pub from: &'static str,
    /// The current map it migrates into (one of `map_names::ALL`).
    pub to: &'static str,
    /// Copies the old map's entries, converted, into the new one; returns how
    /// many were copied and how many did not fit (a smaller map: dropped).
    pub run: MigrationFn,
    /// Flow state the programs of the older agent keep writing until the
    /// new ones are attached (conntrack, socket reverse NAT): copied again
    /// then, so the flows they opened meanwhile carry over too.
    pub again_before_attach: bool,
}

/// [`Migration::run`]: (old map, new map) → (entries copied, entries dropped).
pub type MigrationFn =
    fn(old: MapData, new: &mut aya::maps::Map) -> Result<(usize, usize), MapError>;

/// A migration whose old map was copied at load; its pin stays until
/// [`finish_migrations`] (an agent that stops before it attaches, or a
/// rollback to the older agent, still finds it).
pub struct PendingMigration {
    migration: Migration,
    old: std::os::fd::OwnedFd,
    pin: PathBuf,
}

/// Migrations this agent knows: the `_V1` maps of 16-bit reverse-NAT ids
/// into the `_V2` ones ([`migrations`]).
pub const MIGRATIONS: &[Migration] = migrations::ALL;

/// Whether `name` looks like a versioned map pin (`SOMETHING_V<digits>`).
fn is_versioned_map_pin(name: &str) -> bool {
    name.rsplit_once("_V").is_some_and(|(base, v)| {
        !base.is_empty() && !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit())
    })
}

/// [`load`] with the given migrations.
pub fn load_with_migrations(
    pin_dir: &Path,
    sizes: MapSizes,
    migrations: &[Migration],
) -> Result<Loaded, BpfError> {
    load_inner(pin_dir, sizes, migrations, None)
}

fn load_inner(
    pin_dir: &Path,
    sizes: MapSizes,
    migrations: &[Migration],
    host_dev: Option<crate::host::svc_device::HostDevice>,
) -> Result<Loaded, BpfError> {
    ensure_bpffs_dir(pin_dir)?;
    // Pins that do not match this build are set aside (or refused) first:
    // aya would adopt them by name as they are.
    let expected = pins::expected_maps(sizes)?;
    let plan = pins::check(pin_dir, &expected)?;
    match load_checked(pin_dir, sizes, migrations, host_dev) {
        Ok(mut loaded) => {
            pins::finish(&mut loaded.ebpf, plan, &expected)?;
            Ok(loaded)
        }
        Err(e) => {
            pins::restore(pin_dir, &plan);
            Err(e)
        }
    }
}

/// [`load_with_migrations`] once the pins are checked.
fn load_checked(
    pin_dir: &Path,
    sizes: MapSizes,
    migrations: &[Migration],
    host_dev: Option<crate::host::svc_device::HostDevice>,
) -> Result<Loaded, BpfError> {
    let kernel = probe::decide(&probe::probe());
    if let Some(why) = kernel.fatal() {
        return Err(BpfError::Kernel(why));
    }
    // The socket hooks' line is the agent's (it knows whether they are wanted).
    for (c, why) in kernel
        .off
        .iter()
        .filter(|(c, _)| *c != Capability::HostSocketLb)
    {
        tracing::warn!("{c} off: {why}");
    }
    let paths: Vec<(&'static str, PathBuf)> = map_names::ALL
        .iter()
        .map(|n| (*n, pin_dir.join(n)))
        .collect();
    let mut sock_lb = probe_sock_lb();
    let set_retval = u32::from(sock_lb.set_retval);
    let (host_dev_ifindex, host_peer_ifindex) =
        host_dev.map_or((0u32, 0u32), |d| (d.ifindex, d.peer_ifindex));
    let per_packet = u32::from(host_dev.is_some());
    let mut loader = EbpfLoader::new();
    loader
        .override_global("HOST_NETNS_COOKIE", &sock_lb.netns_cookie, true)
        .override_global("HAS_SET_RETVAL", &set_retval, true)
        .override_global("HOST_DEV_IFINDEX", &host_dev_ifindex, true)
        .override_global("HOST_PEER_IFINDEX", &host_peer_ifindex, true)
        .override_global("HOST_UDP_PER_PACKET", &per_packet, true);
    for (name, path) in &paths {
        loader.map_pin_path(name, path.as_path());
    }
    for (name, size) in sizes.configured() {
        loader.map_max_entries(name, size);
    }
    let mut ebpf = loader.load(EBPF_OBJECT)?;
    // Before any program of this object can run (the IPv6 ones are
    // tail-called by the older agent's programs as soon as they are in the
    // pinned program array): maps of an older layout copied into this
    // object's.
    let pending_migrations = migrate(pin_dir, &mut ebpf, migrations)?;
    let mut port_search = PortSearch::of(&kernel);
    if let Err(e) = load_tc_programs(&mut ebpf, port_search) {
        // A kernel with `bpf_loop` whose verifier refuses the search build
        // (one outside the matrix the build is checked on): the datapath
        // runs with the random-tries build rather than not at all.
        let refused = matches!(&e, BpfError::Program {
            source: ProgramError::LoadError { io_error, .. }, ..
        } if io_error.raw_os_error() != Some(libc::EPERM));
        if port_search != PortSearch::Exhaustive || !refused {
            return Err(e);
        }
        tracing::warn!(error = %e, "the exhaustive SNAT port search off: the verifier refused its build; loading the random-tries build");
        port_search = PortSearch::RandomTries;
        load_tc_programs(&mut ebpf, port_search).map_err(|_| e)?;
    }
    let ipv6 = load_ipv6_programs(&mut ebpf, port_search);
    if let Err(why) = &ipv6 {
        tracing::warn!("the IPv6 datapath off (IPv6 passes untouched): {why}");
        clear_tail(
            &mut ebpf,
            map_names::TAIL6,
            IPV6_PROGRAMS.iter().map(|(_, i)| *i),
        );
    }
    let xdp: &mut Xdp = ebpf
        .program_mut(EXT_XDP_PROGRAM)
        .ok_or(BpfError::Program {
            name: EXT_XDP_PROGRAM,
            source: aya::programs::ProgramError::UnexpectedProgramType,
        })?
        .try_into()
        .map_err(|source| BpfError::Program {
            name: EXT_XDP_PROGRAM,
            source,
        })?;
    let xdp_loaded = match kernel
        .off
        .iter()
        .find(|(c, _)| *c == Capability::XdpAcceleration)
    {
        Some((_, why)) => Err(why.clone()),
        None => {
            load_retrying(EXT_XDP_PROGRAM, || xdp.load()).map_err(|source| BpfError::Program {
                name: EXT_XDP_PROGRAM,
                source,
            })?;
            let xdp6 = match &ipv6 {
                Ok(()) => load_xdp6(&mut ebpf),
                Err(_) => Err("the IPv6 tc programs are off".to_string()),
            };
            if let Err(why) = xdp6 {
                tracing::warn!("XDP acceleration of IPv6 off (tc handles it): {why}");
                clear_tail(&mut ebpf, map_names::TAIL6_XDP, [0]);
            }
            Ok(())
        }
    };
    sock_lb.loaded = match kernel
        .off
        .iter()
        .find(|(c, _)| *c == Capability::HostSocketLb)
    {
        Some((_, why)) => Err(why.clone()),
        None => load_sock_programs(&mut ebpf),
    };
    Ok(Loaded {
        ebpf,
        pin_dir: pin_dir.to_owned(),
        sock_lb,
        xdp: xdp_loaded,
        port_search,
        ipv6,
        pending_migrations,
    })
}

/// Loads `ext_xdp6` and puts it in the program array `ext_xdp` tail-calls
/// for IPv6 frames.
fn load_xdp6(ebpf: &mut Ebpf) -> Result<(), String> {
    let prog: &mut Xdp = ebpf
        .program_mut(EXT_XDP6_PROGRAM)
        .ok_or_else(|| format!("program {EXT_XDP6_PROGRAM} missing from the object"))?
        .try_into()
        .map_err(|e| format!("program {EXT_XDP6_PROGRAM}: {e}"))?;
    load_retrying(EXT_XDP6_PROGRAM, || prog.load()).map_err(|e| {
        tracing::debug!(program = EXT_XDP6_PROGRAM, error = ?e, "IPv6 XDP program not loaded");
        format!("program {EXT_XDP6_PROGRAM} not accepted by this kernel: {e}")
    })?;
    let fd = prog
        .fd()
        .and_then(|fd| fd.try_clone().map_err(ProgramError::from))
        .map_err(|e| format!("program {EXT_XDP6_PROGRAM}: {e}"))?;
    let map = ebpf
        .map_mut(map_names::TAIL6_XDP)
        .ok_or_else(|| format!("map {} missing from the object", map_names::TAIL6_XDP))?;
    let mut tail: aya::maps::ProgramArray<&mut MapData> = aya::maps::ProgramArray::try_from(map)
        .map_err(|e| format!("{}: {e}", map_names::TAIL6_XDP))?;
    tail.set(0, &fd, 0)
        .map_err(|e| format!("{}[0]: {e}", map_names::TAIL6_XDP))
}

/// Loads the IPv6 tc programs of build `search` and puts them in the
/// program array the IPv4 programs tail-call. A kernel refusing them loses
/// IPv6 only.
fn load_ipv6_programs(ebpf: &mut Ebpf, search: PortSearch) -> Result<(), String> {
    let mut fds = Vec::new();
    for (name, index) in IPV6_PROGRAMS {
        let name = search.program(name);
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or_else(|| format!("program {name} missing from the object"))?
            .try_into()
            .map_err(|e| format!("program {name}: {e}"))?;
        load_retrying(name, || prog.load()).map_err(|e| {
            tracing::debug!(program = name, error = ?e, "IPv6 program not loaded");
            format!("program {name} not accepted by this kernel: {e}")
        })?;
        let fd = prog
            .fd()
            .and_then(|fd| fd.try_clone().map_err(ProgramError::from))
            .map_err(|e| format!("program {name}: {e}"))?;
        fds.push((index, fd));
    }
    let map = ebpf
        .map_mut(map_names::TAIL6)
        .ok_or_else(|| format!("map {} missing from the object", map_names::TAIL6))?;
    let mut tail: aya::maps::ProgramArray<&mut MapData> =
        aya::maps::ProgramArray::try_from(map).map_err(|e| format!("{}: {e}", map_names::TAIL6))?;
    for (index, fd) in &fds {
        tail.set(*index, fd, 0)
            .map_err(|e| format!("{}[{index}]: {e}", map_names::TAIL6))?;
    }
    Ok(())
}

/// Loads the tc programs of build `search`.
fn load_tc_programs(ebpf: &mut Ebpf, search: PortSearch) -> Result<(), BpfError> {
    for name in [POD_INGRESS_PROGRAM, POD_EGRESS_PROGRAM, EXT_INGRESS_PROGRAM] {
        let name = search.program(name);
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or(BpfError::Program {
                name,
                source: ProgramError::UnexpectedProgramType,
            })?
            .try_into()
            .map_err(|source| BpfError::Program { name, source })?;
        load_retrying(name, || prog.load()).map_err(|source| BpfError::Program { name, source })?;
    }
    Ok(())
}

/// Runs the migrations whose old map is pinned in `pin_dir` (their pins
/// stay, for [`finish_migrations`]), then removes pins of older layouts
/// nothing migrates.
fn migrate(
    pin_dir: &Path,
    ebpf: &mut Ebpf,
    migrations: &[Migration],
) -> Result<Vec<PendingMigration>, BpfError> {
    use std::os::fd::AsFd;
    let mut pending = Vec::new();
    for m in migrations {
        let old_path = pin_dir.join(m.from);
        if !old_path.exists() {
            continue;
        }
        let old = MapData::from_pin(&old_path).map_err(map_err(m.to))?;
        let fd = old
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| BpfError::PinDir {
                path: old_path.clone(),
                source,
            })?;
        let new = ebpf.map_mut(m.to).ok_or(BpfError::MissingMap(m.to))?;
        let (copied, dropped) = (m.run)(old, new).map_err(map_err(m.to))?;
        if dropped > 0 {
            tracing::warn!(
                from = m.from,
                to = m.to,
                copied,
                dropped,
                "migrated a pinned map to its new layout: entries that did not fit were dropped"
            );
        } else {
            tracing::info!(
                from = m.from,
                to = m.to,
                entries = copied,
                "migrated a pinned map to its new layout"
            );
        }
        pending.push(PendingMigration {
            migration: *m,
            old: fd,
            pin: old_path,
        });
    }
    let Ok(dir) = std::fs::read_dir(pin_dir) else {
        return Ok(pending);
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if is_versioned_map_pin(&name)
            && !map_names::ALL.contains(&name.as_str())
            && !migrations.iter().any(|m| m.from == name)
        {
            tracing::warn!(pin = %e.path().display(), "a map of an older layout with no migration: its entries are dropped");
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(pending)
}

/// Finishes migrations begun at load, just before the programs are
/// attached: the older agent's programs, attached until then, kept writing
/// flow state into the old maps, so those are copied again
/// ([`Migration::again_before_attach`]; what the first copy took is
/// overwritten with the same or newer entries), and every old pin is
/// removed. Failures are logged: the programs are attached all the same.
pub fn finish_migrations(ebpf: &mut Ebpf, pending: Vec<PendingMigration>) {
    for p in pending {
        let m = p.migration;
        if m.again_before_attach {
            let copied = MapData::from_fd(p.old).and_then(|old| match ebpf.map_mut(m.to) {
                Some(new) => (m.run)(old, new),
                None => Err(MapError::InvalidName {
                    name: m.to.to_string(),
                }),
            });
            match copied {
                Ok((copied, dropped)) => tracing::info!(
                    from = m.from,
                    to = m.to,
                    copied,
                    dropped,
                    "copied again the entries the older programs wrote since the load"
                ),
                Err(e) => tracing::warn!(
                    from = m.from,
                    to = m.to,
                    error = %e,
                    "cannot copy again what the older programs wrote since the load: flows they opened meanwhile are tracked anew"
                ),
            }
        }
        if let Err(e) = std::fs::remove_file(&p.pin) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(pin = %p.pin.display(), error = %e, "cannot remove the pin of a migrated map");
            }
        }
    }
}

/// Empties the program array `name` at `indices`: a program of the older
/// agent left there would be tail-called with maps of an older layout.
fn clear_tail(ebpf: &mut Ebpf, name: &'static str, indices: impl IntoIterator<Item = u32>) {
    let Some(map) = ebpf.map_mut(name) else {
        return;
    };
    let Ok(mut tail) = aya::maps::ProgramArray::<&mut MapData>::try_from(map) else {
        return;
    };
    for i in indices {
        if let Err(e) = tail.clear_index(&i) {
            if !matches!(&e, MapError::KeyNotFound) {
                tracing::warn!(map = name, index = i, error = %e, "cannot clear a tail-call slot");
            }
        }
    }
}

fn take_map(ebpf: &mut Ebpf, name: &'static str) -> Result<aya::maps::Map, BpfError> {
    ebpf.take_map(name).ok_or(BpfError::MissingMap(name))
}

fn map_err(name: &'static str) -> impl Fn(MapError) -> BpfError {
    move |source| BpfError::Map { name, source }
}

pub mod batch;
mod dataplane;
mod gc;
mod links;
pub mod migrations;
mod pinned;
mod pins;
pub mod probe;

use probe::Capability;

pub use dataplane::{ktime_ns, BpfDataplane};
pub use gc::{delete_udp_flows, ConntrackGc, CtGcReport, GcRound, GC_PAUSE, GC_ROUND};
pub use links::{
    cgroup2_root, cleanup, cleanup_legacy_filters, kernel_has_tcx, resolve_tc_mode, Attacher,
    TcAttachMode, TcMode, LEGACY_HANDLE_EGRESS, LEGACY_HANDLE_INGRESS, LEGACY_PRIORITY,
};
pub use pinned::{open_lru_hash, PinnedMaps, ProgrammedTraffic};
pub use pins::{expected_maps, pinned_def, MapDef, OLD_SUFFIX};

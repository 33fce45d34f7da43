//! [`Attacher`]: the programs' tc and XDP links, pinned under the pin
//! directory and taken over by the next agent; `cleanup` of a datapath left
//! attached.

use super::*;

/// A link held by the agent: its attachment and, for a bpf link, where it
/// is pinned.
struct Held {
    name: String,
    kind: IfaceKind,
    link: HeldLink,
    pin: PathBuf,
}

/// One attachment: a bpf link (tcx or XDP, pinned), or a legacy tc filter
/// (clsact, direct-action `cls_bpf` at [`LEGACY_PRIORITY`] and a fixed
/// handle), which cannot be pinned: a restarted agent finds it by priority
/// and handle. Dropping a `Filter` removes it.
enum HeldLink {
    /// Held for its fd: the link lives while it is open or pinned.
    Fd(#[allow(dead_code)] FdLink),
    Filter(SchedClassifierLink),
}

/// How tc programs are attached (`--tc-attach-mode`, `tcAttachMode`).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Deserialize,
    schemars::JsonSchema,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum TcAttachMode {
    /// tcx links where the kernel has them (probed, never by version), else legacy.
    #[default]
    Auto,
    /// tcx links only (Linux 6.6, or a kernel with tcx backported).
    Tcx,
    /// A clsact qdisc and direct-action `cls_bpf` filters over netlink.
    Legacy,
}

/// The attach mode in use, once the kernel has been asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcMode {
    /// tcx bpf links, pinned, taken over with `bpf_link_update`.
    Tcx,
    /// clsact + `cls_bpf` filters at a fixed priority and handle, replaced
    /// in place (a netlink `RTM_NEWTFILTER` on the same priority and handle
    /// swaps the program atomically).
    Legacy,
}

impl std::fmt::Display for TcMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TcMode::Tcx => "tcx",
            TcMode::Legacy => "legacy tc (clsact + cls_bpf)",
        })
    }
}

/// The tc priority of the agent's legacy filters.
pub const LEGACY_PRIORITY: u16 = 1;
/// The handle of the agent's legacy filter at tc ingress.
pub const LEGACY_HANDLE_INGRESS: u32 = 0x4b50;
/// The handle of the agent's legacy filter at tc egress (`pod_egress`).
pub const LEGACY_HANDLE_EGRESS: u32 = 0x4b51;

/// Whether the kernel has tcx: a read-only `BPF_PROG_QUERY` of
/// `BPF_TCX_INGRESS` on `lo` (a kernel without tcx refuses the attach type
/// with EINVAL).
pub fn kernel_has_tcx() -> bool {
    match SchedClassifier::query_tcx("lo", TcAttachType::Ingress) {
        Ok(_) => true,
        Err(e) => {
            tracing::debug!(error = %e, "tcx query on lo refused: no tcx");
            false
        }
    }
}

/// The mode to use for `requested` on a kernel with or without tcx; an
/// error when tcx is asked for and the kernel lacks it.
pub fn resolve_tc_mode(requested: TcAttachMode, has_tcx: bool) -> Result<TcMode, String> {
    match (requested, has_tcx) {
        (TcAttachMode::Auto | TcAttachMode::Tcx, true) => Ok(TcMode::Tcx),
        (TcAttachMode::Auto, false) | (TcAttachMode::Legacy, _) => Ok(TcMode::Legacy),
        (TcAttachMode::Tcx, false) => Err(
            "--tc-attach-mode tcx: this kernel has no tcx links (Linux 6.6 brings them); use auto or legacy".into(),
        ),
    }
}

/// The tc side and legacy filter handle of a tc program's attachment.
fn tc_side(kind: IfaceKind) -> (TcAttachType, u32) {
    if matches!(kind, IfaceKind::PodEgress | IfaceKind::ExternalEgress) {
        (TcAttachType::Egress, LEGACY_HANDLE_EGRESS)
    } else {
        (TcAttachType::Ingress, LEGACY_HANDLE_INGRESS)
    }
}

/// Removes the agent's legacy filter of `kind` on `iface`, if there is one.
fn remove_legacy_filter(iface: &str, kind: IfaceKind) -> bool {
    let (side, handle) = tc_side(kind);
    match SchedClassifierLink::attached(iface, side, LEGACY_PRIORITY, handle.into(), None) {
        Ok(link) => aya::programs::Link::detach(link).is_ok(),
        Err(_) => false,
    }
}

/// Attaches the programs to interfaces, one tcx link per interface, pinned
/// under `<pin dir>/links/` so that the datapath keeps running while the agent
/// restarts: a restarted agent finds the pinned link of an interface and
/// atomically replaces its program (`bpf_link_update`); packets never see an
/// interface without a program. Also keeps the interfaces map (pod interfaces,
/// delivered to with `bpf_redirect_peer`) equal to the attached pod interfaces.
pub struct Attacher {
    ebpf: Ebpf,
    ifaces: HashMap<MapData, u32, Iface>,
    links: BTreeMap<(u32, IfaceKind), Held>,
    /// The socket hooks' links on the cgroup served, with their pins.
    cgroup_links: Vec<(FdLink, PathBuf)>,
    link_dir: PathBuf,
    tc_mode: TcMode,
    /// Which build of the tc ingress programs was loaded.
    port_search: PortSearch,
}

const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// The cgroup v2 hierarchy's root on this machine: `/sys/fs/cgroup` on a
/// unified host, `/sys/fs/cgroup/unified` on a hybrid one.
pub fn cgroup2_root() -> Option<PathBuf> {
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| is_cgroup2(p))
}

fn is_cgroup2(path: &Path) -> bool {
    // `f_type` is an i64 with glibc and a u64 with musl (the image's agent).
    #[allow(clippy::unnecessary_cast)]
    nix::sys::statfs::statfs(path)
        .is_ok_and(|st| st.filesystem_type().0 as i64 == CGROUP2_SUPER_MAGIC)
}

/// The bpf(2) syscall `cmd` with `attr` (a `#[repr(C)]` prefix of the
/// kernel's `union bpf_attr` for that command); its non-negative result.
fn bpf<T>(cmd: libc::c_long, attr: &T) -> std::io::Result<i64> {
    // SAFETY: `attr` is a valid, initialised value of the size given.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *const T,
            std::mem::size_of::<T>() as u32,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rc)
}

/// `BPF_LINK_UPDATE` on the link pinned at `pin`: points it at program
/// `prog`, atomically (aya has it for tc and XDP links only).
fn link_update(pin: &Path, prog: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
    use std::os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    };
    #[repr(C)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    #[repr(C)]
    struct LinkUpdateAttr {
        link_fd: u32,
        new_prog_fd: u32,
        flags: u32,
        old_prog_fd: u32,
    }
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_LINK_UPDATE: libc::c_long = 29;
    let path = std::ffi::CString::new(pin.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let get = ObjGetAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    let fd = bpf(BPF_OBJ_GET, &get)?;
    // SAFETY: a new fd the kernel just returned to us.
    let link = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let attr = LinkUpdateAttr {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: prog.as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    bpf(BPF_LINK_UPDATE, &attr)?;
    Ok(())
}

fn link_err(name: &'static str, e: impl std::fmt::Display) -> BpfError {
    BpfError::Link {
        name,
        reason: e.to_string(),
    }
}

impl Attacher {
    /// Takes the interfaces map out of `ebpf` and forgets its old entries
    /// (interfaces are learned again from netlink). `port_search`: the build
    /// of the tc ingress programs [`super::load`] loaded.
    pub fn new(
        mut ebpf: Ebpf,
        pin_dir: &Path,
        tc_mode: TcMode,
        port_search: PortSearch,
    ) -> Result<Self, BpfError> {
        let mut ifaces: HashMap<MapData, u32, Iface> =
            HashMap::try_from(take_map(&mut ebpf, map_names::IFACES)?)
                .map_err(map_err(map_names::IFACES))?;
        let stale: Vec<u32> = ifaces.keys().filter_map(Result::ok).collect();
        for k in stale {
            let _ = ifaces.remove(&k);
        }
        let link_dir = pin_dir.join("links");
        std::fs::create_dir_all(&link_dir).map_err(|source| BpfError::PinDir {
            path: link_dir.clone(),
            source,
        })?;
        Ok(Self {
            ebpf,
            ifaces,
            links: BTreeMap::new(),
            cgroup_links: Vec::new(),
            link_dir,
            tc_mode,
            port_search,
        })
    }

    /// Attaches the socket hooks to the cgroup v2 directory `cgroup` (every
    /// process in it and below: the root cgroup on a node), one link per
    /// hook pinned as `<pin dir>/links/cgroup-<cgroup id>-<program>`; a
    /// restarted agent takes each pinned link over (`bpf_link_update`), so
    /// host clients never see a moment without the hooks.
    pub fn attach_cgroup(&mut self, cgroup: &Path) -> Result<(), BpfError> {
        use std::os::unix::fs::MetadataExt;
        let cerr = |reason: String| BpfError::Cgroup {
            path: cgroup.to_owned(),
            reason,
        };
        if !is_cgroup2(cgroup) {
            return Err(cerr(
                "not a cgroup v2 directory (give the cgroup2 mount, e.g. /sys/fs/cgroup)".into(),
            ));
        }
        let dir = std::fs::File::open(cgroup).map_err(|e| cerr(e.to_string()))?;
        let id = dir.metadata().map_err(|e| cerr(e.to_string()))?.ino();
        for name in SOCK_PROGRAMS {
            let pin = self.link_dir.join(format!("cgroup-{id}-{name}"));
            let prog: &mut CgroupSockAddr = self
                .ebpf
                .program_mut(name)
                .expect("program checked at load")
                .try_into()
                .expect("program type checked at load");
            let perr = |source| BpfError::Program { name, source };
            let adopted = match PinnedLink::from_pin(&pin) {
                Ok(pinned) => {
                    let fd = FdLink::from(pinned);
                    let prog_fd = prog.fd().map_err(perr)?;
                    match link_update(&pin, std::os::fd::AsFd::as_fd(prog_fd)) {
                        Ok(()) => Some(fd),
                        Err(e) => {
                            tracing::debug!(pin = %pin.display(), error = %e, "pinned cgroup link not reusable");
                            let _ = std::fs::remove_file(&pin);
                            None
                        }
                    }
                }
                Err(_) => None,
            };
            let fd = match adopted {
                Some(fd) => fd,
                None => {
                    // A cgroup link is always one of many (the kernel refuses
                    // flags on link creation): `Single` passes none.
                    let id = prog
                        .attach(&dir, aya::programs::CgroupAttachMode::Single)
                        .map_err(perr)?;
                    let link = prog.take_link(id).map_err(perr)?;
                    let fd = FdLink::try_from(link).map_err(|e| link_err(name, e))?;
                    FdLink::from(fd.pin(&pin).map_err(|e| link_err(name, e))?)
                }
            };
            self.cgroup_links.push((fd, pin));
        }
        Ok(())
    }

    /// Whether the socket hooks are attached.
    pub fn cgroup_attached(&self) -> bool {
        !self.cgroup_links.is_empty()
    }

    fn program(&mut self, kind: IfaceKind) -> &mut SchedClassifier {
        self.ebpf
            .program_mut(kind.program(self.port_search))
            .expect("program checked at load")
            .try_into()
            .expect("program type checked at load")
    }

    fn xdp(&mut self) -> &mut Xdp {
        self.ebpf
            .program_mut(EXT_XDP_PROGRAM)
            .expect("program checked at load")
            .try_into()
            .expect("program type checked at load")
    }

    pub fn is_attached(&self, ifindex: u32, kind: IfaceKind) -> bool {
        self.links.contains_key(&(ifindex, kind))
    }

    /// Takes over a pinned link with the current program (`bpf_link_update`).
    fn take_over(&mut self, fd: FdLink, kind: IfaceKind) -> Result<FdLink, BpfError> {
        let name = kind.program(self.port_search);
        let perr = |source| BpfError::Program { name, source };
        if kind == IfaceKind::ExternalXdp {
            let link = XdpLink::try_from(fd).map_err(|e| link_err(name, e))?;
            let xdp = self.xdp();
            let id = xdp.attach_to_link(link).map_err(perr)?;
            let link = xdp.take_link(id).map_err(perr)?;
            return FdLink::try_from(link).map_err(|e| link_err(name, e));
        }
        let link = SchedClassifierLink::try_from(fd).map_err(|e| link_err(name, e))?;
        let prog = self.program(kind);
        let id = prog.attach_to_link(link).map_err(perr)?;
        let link = prog.take_link(id).map_err(perr)?;
        FdLink::try_from(link).map_err(|e| link_err(name, e))
    }

    /// The tc attach mode in use.
    pub fn tc_mode(&self) -> TcMode {
        self.tc_mode
    }

    /// Attaches the tc program of `kind` to `iface` as a legacy filter: the
    /// clsact qdisc (added if missing), then the filter at
    /// [`LEGACY_PRIORITY`] and the kind's fixed handle. A filter already
    /// there (a previous agent's) is replaced in place, atomically: no
    /// packet sees the interface without a program.
    fn attach_legacy(&mut self, iface: &str, kind: IfaceKind) -> Result<HeldLink, BpfError> {
        use aya::programs::tc::{NlOptions, TcAttachOptions};
        let name = kind.program(self.port_search);
        let perr = |source| BpfError::Program { name, source };
        let (side, handle) = tc_side(kind);
        // EEXIST when the qdisc is there already; any other failure shows
        // in the attach below.
        let _ = aya::programs::tc::qdisc_add_clsact(iface);
        let prog = self.program(kind);
        let replaced =
            SchedClassifierLink::attached(iface, side, LEGACY_PRIORITY, handle.into(), None)
                .map_err(|e| link_err(name, e))
                .and_then(|old| prog.attach_to_link(old).map_err(perr));
        let id = match replaced {
            Ok(id) => {
                tracing::debug!(iface, program = name, "legacy tc filter replaced in place");
                id
            }
            Err(_) => prog
                .attach_with_options(
                    iface,
                    side,
                    TcAttachOptions::Netlink(NlOptions {
                        priority: LEGACY_PRIORITY,
                        handle: handle.into(),
                        ..Default::default()
                    }),
                )
                .map_err(perr)?,
        };
        Ok(HeldLink::Filter(prog.take_link(id).map_err(perr)?))
    }

    /// A new link of `kind` on interface `name`.
    fn attach_new(&mut self, name: &str, kind: IfaceKind) -> Result<FdLink, BpfError> {
        let prog_name = kind.program(self.port_search);
        let perr = |source| BpfError::Program {
            name: prog_name,
            source,
        };
        if kind == IfaceKind::ExternalXdp {
            let xdp = self.xdp();
            let id = xdp.attach(name, XdpMode::Default).map_err(perr)?;
            let link = xdp.take_link(id).map_err(perr)?;
            return FdLink::try_from(link).map_err(|e| link_err(prog_name, e));
        }
        let side = if matches!(kind, IfaceKind::PodEgress | IfaceKind::ExternalEgress) {
            TcAttachType::Egress
        } else {
            TcAttachType::Ingress
        };
        let prog = self.program(kind);
        let id = prog.attach(name, side).map_err(perr)?;
        let link = prog.take_link(id).map_err(perr)?;
        FdLink::try_from(link).map_err(|e| link_err(prog_name, e))
    }

    fn pin_path(&self, ifindex: u32, name: &str, kind: IfaceKind) -> PathBuf {
        let k = match kind {
            IfaceKind::Pod => "pod",
            IfaceKind::PodEgress => "pod-egress",
            IfaceKind::External => "ext",
            IfaceKind::ExternalXdp => "xdp",
            IfaceKind::ExternalEgress => "ext-egress",
        };
        self.link_dir.join(format!("{ifindex}-{name}-{k}"))
    }

    /// Attaches the program of `kind` to `name` (tcx, or a legacy tc filter
    /// in [`TcMode::Legacy`]; XDP always as an XDP link), or takes over the
    /// attachment a previous agent left. Moving between the modes (a kernel
    /// upgrade, a forced mode) attaches the new way first, then removes the
    /// old attachment: never a moment without a program, never two.
    pub fn attach(&mut self, ifindex: u32, name: &str, kind: IfaceKind) -> Result<(), BpfError> {
        let prog_name = kind.program(self.port_search);
        let pin = self.pin_path(ifindex, name, kind);
        if kind != IfaceKind::ExternalXdp && self.tc_mode == TcMode::Legacy {
            let link = self.attach_legacy(name, kind)?;
            // A tcx link an earlier agent pinned here goes once the filter is in.
            if std::fs::remove_file(&pin).is_ok() {
                tracing::info!(
                    iface = name,
                    program = prog_name,
                    "tcx link replaced by a legacy tc filter"
                );
            }
            self.hold(ifindex, name, kind, link, pin)?;
            return Ok(());
        }
        let adopted = match PinnedLink::from_pin(&pin) {
            Ok(pinned) => match self.take_over(FdLink::from(pinned), kind) {
                Ok(fd) => Some(fd),
                Err(e) => {
                    // A defunct link (its interface was recreated): start afresh.
                    tracing::debug!(pin = %pin.display(), error = %e, "pinned link not reusable");
                    let _ = std::fs::remove_file(&pin);
                    None
                }
            },
            Err(_) => None,
        };
        let fd = match adopted {
            Some(fd) => fd,
            None => {
                let fd = self.attach_new(name, kind)?;
                FdLink::from(fd.pin(&pin).map_err(|e| link_err(prog_name, e))?)
            }
        };
        // A legacy filter an earlier agent left goes once the tcx link is in.
        if kind != IfaceKind::ExternalXdp && remove_legacy_filter(name, kind) {
            tracing::info!(
                iface = name,
                program = prog_name,
                "legacy tc filter replaced by a tcx link"
            );
        }
        self.hold(ifindex, name, kind, HeldLink::Fd(fd), pin)
    }

    fn hold(
        &mut self,
        ifindex: u32,
        name: &str,
        kind: IfaceKind,
        link: HeldLink,
        pin: PathBuf,
    ) -> Result<(), BpfError> {
        self.links.insert(
            (ifindex, kind),
            Held {
                name: name.to_owned(),
                kind,
                link,
                pin,
            },
        );
        if kind == IfaceKind::Pod {
            self.ifaces
                .insert(
                    ifindex,
                    Iface {
                        flags: iface_flags::POD,
                    },
                    0,
                )
                .map_err(map_err(map_names::IFACES))?;
        }
        Ok(())
    }

    /// Detaches every link on `ifindex` (removing their pins) and forgets them.
    pub fn detach(&mut self, ifindex: u32) {
        let keys: Vec<(u32, IfaceKind)> = self
            .links
            .keys()
            .filter(|(i, _)| *i == ifindex)
            .copied()
            .collect();
        for k in keys {
            if let Some(held) = self.links.remove(&k) {
                let _ = std::fs::remove_file(&held.pin);
                // Closing the last fd of an unpinned link detaches it;
                // dropping a legacy filter's link removes the filter.
                drop(held.link);
            }
        }
        let _ = self.ifaces.remove(&ifindex);
    }

    /// Whether any link is held on `ifindex`.
    pub fn has_links(&self, ifindex: u32) -> bool {
        self.links.keys().any(|(i, _)| *i == ifindex)
    }

    pub fn detach_all(&mut self) {
        let all: std::collections::BTreeSet<u32> = self.links.keys().map(|(i, _)| *i).collect();
        for i in all {
            self.detach(i);
        }
        for (fd, pin) in self.cgroup_links.drain(..) {
            let _ = std::fs::remove_file(&pin);
            drop(fd);
        }
    }

    /// Lets go of every link but leaves it pinned: the programs stay attached
    /// after the agent exits, until a new agent takes them over.
    pub fn release_all(&mut self) {
        for (_, held) in std::mem::take(&mut self.links) {
            if let HeldLink::Filter(f) = held.link {
                // Dropping would remove the filter: leave it for the next agent.
                std::mem::forget(f);
            }
        }
        self.cgroup_links.clear();
    }

    /// Removes pins of links this agent does not hold (interfaces that are
    /// gone, or no longer match the patterns).
    pub fn prune_pins(&mut self) {
        let held: std::collections::BTreeSet<PathBuf> = self
            .links
            .values()
            .filter(|h| matches!(h.link, HeldLink::Fd(_)))
            .map(|h| h.pin.clone())
            .chain(self.cgroup_links.iter().map(|(_, p)| p.clone()))
            .collect();
        if let Ok(dir) = std::fs::read_dir(&self.link_dir) {
            for e in dir.flatten() {
                if !held.contains(&e.path()) {
                    tracing::info!(pin = %e.path().display(), "removing a stale link pin");
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    pub fn attached(&self) -> impl Iterator<Item = (u32, &str, IfaceKind)> {
        self.links
            .iter()
            .map(|((i, _), h)| (*i, h.name.as_str(), h.kind))
    }
}

/// Removes the agent's legacy tc filters (by program name, at any
/// priority) from every interface of this network namespace; returns how
/// many interfaces had one.
pub fn cleanup_legacy_filters() -> usize {
    let Ok(ifaces) = nix::net::if_::if_nameindex() else {
        return 0;
    };
    let mut n = 0;
    for iface in ifaces.iter() {
        let Ok(name) = iface.name().to_str() else {
            continue;
        };
        let mut removed = false;
        for (side, prog) in [
            (TcAttachType::Ingress, POD_INGRESS_PROGRAM),
            (TcAttachType::Ingress, EXT_INGRESS_PROGRAM),
            (TcAttachType::Ingress, POD_INGRESS_RND_PROGRAM),
            (TcAttachType::Ingress, EXT_INGRESS_RND_PROGRAM),
            (TcAttachType::Egress, POD_EGRESS_PROGRAM),
        ] {
            removed |= aya::programs::tc::qdisc_detach_program(name, side, prog).is_ok();
        }
        n += usize::from(removed);
    }
    n
}

/// Removes a datapath left attached by an agent that exited with
/// `--on-exit keep`: every pinned link (detaching the programs) and every
/// pinned map under `pin_dir`. Returns how many pins were removed. Legacy
/// tc filters are not pinned: [`cleanup_legacy_filters`] removes them.
pub fn cleanup(pin_dir: &Path) -> Result<usize, BpfError> {
    if !pin_dir.exists() {
        return Ok(0);
    }
    let mut n = 0;
    let links = pin_dir.join("links");
    if let Ok(dir) = std::fs::read_dir(&links) {
        n += dir.flatten().count();
    }
    if let Ok(dir) = std::fs::read_dir(pin_dir) {
        n += dir.flatten().filter(|e| e.path() != links).count();
    }
    std::fs::remove_dir_all(pin_dir).map_err(|source| BpfError::PinDir {
        path: pin_dir.into(),
        source,
    })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tc_attach_mode_follows_the_kernel_not_its_version() {
        assert_eq!(resolve_tc_mode(TcAttachMode::Auto, true), Ok(TcMode::Tcx));
        assert_eq!(
            resolve_tc_mode(TcAttachMode::Auto, false),
            Ok(TcMode::Legacy)
        );
        assert_eq!(
            resolve_tc_mode(TcAttachMode::Legacy, true),
            Ok(TcMode::Legacy)
        );
        assert_eq!(
            resolve_tc_mode(TcAttachMode::Legacy, false),
            Ok(TcMode::Legacy)
        );
        assert_eq!(resolve_tc_mode(TcAttachMode::Tcx, true), Ok(TcMode::Tcx));
        let e = resolve_tc_mode(TcAttachMode::Tcx, false).unwrap_err();
        assert!(e.contains("6.6"), "{e}");
    }

    #[test]
    fn legacy_filters_have_one_fixed_handle_per_side() {
        assert_eq!(
            tc_side(IfaceKind::Pod),
            (TcAttachType::Ingress, LEGACY_HANDLE_INGRESS)
        );
        assert_eq!(
            tc_side(IfaceKind::External),
            (TcAttachType::Ingress, LEGACY_HANDLE_INGRESS)
        );
        assert_eq!(
            tc_side(IfaceKind::PodEgress),
            (TcAttachType::Egress, LEGACY_HANDLE_EGRESS)
        );
    }
}

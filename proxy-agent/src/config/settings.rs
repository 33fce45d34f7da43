//! The settings the agent runs with: the flags over the file over the
//! defaults, resolved and checked one section at a time.
use std::{
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use crate::bpf::MapSizes;

use super::flags::RunArgs;
use super::{
    invalid, parse_bind_address, parse_port_range, Acceleration, Cidr, ConfigError, ConfigFile,
    DeliveryMode, FrontendPolicyFile, GoDuration, MaglevFile, MapSizesFile, OnExit, SourceKind,
    DEFAULT_BPFFS, DEFAULT_EXTERNAL_INTERFACES, DEFAULT_HAIRPIN_SNAT_IP,
    DEFAULT_HEALTHZ_BIND_ADDRESS, DEFAULT_METRICS_BIND_ADDRESS, DEFAULT_MIN_SYNC_PERIOD,
    DEFAULT_POD_INTERFACES, DEFAULT_PROBE_BIND_ADDRESS, DEFAULT_SYNC_PERIOD, MAP_SIZE_MAX,
};

/// `mapSizes` checked onto `sizes`.
fn checked_map_sizes(file: Option<&MapSizesFile>, sizes: &mut MapSizes) -> Result<(), ConfigError> {
    let Some(file) = file else {
        return Ok(());
    };
    for (field, value, size) in [
        ("mapSizes.services", file.services, &mut sizes.services),
        ("mapSizes.backends", file.backends, &mut sizes.backends),
        ("mapSizes.reverseNat", file.reverse_nat, &mut sizes.rev_nat),
    ] {
        let Some(n) = value else { continue };
        if !(16..=MAP_SIZE_MAX).contains(&n) {
            return Err(invalid(
                field,
                format!("{n} must be between 16 and {MAP_SIZE_MAX}"),
            ));
        }
        *size = n;
    }
    Ok(())
}

/// `frontendPolicy` checked: CIDRs parse, the limit is at least 1.
fn frontend_policy(
    file: Option<&FrontendPolicyFile>,
) -> Result<crate::model::FrontendPolicy, ConfigError> {
    let mut p = crate::model::FrontendPolicy::default();
    let Some(file) = file else {
        return Ok(p);
    };
    let cidrs = |field: &str, list: &Option<Vec<String>>| {
        list.iter()
            .flatten()
            .map(|s| {
                s.trim()
                    .parse::<Cidr>()
                    .and_then(Cidr::exact)
                    .map(|c| (c.addr, c.prefix))
                    .map_err(|e| invalid(field, e))
            })
            .collect::<Result<Vec<_>, _>>()
    };
    p.external_ip_allow = cidrs(
        "frontendPolicy.externalIPAllowCIDRs",
        &file.external_ip_allow_cidrs,
    )?;
    p.external_ip_deny = cidrs(
        "frontendPolicy.externalIPDenyCIDRs",
        &file.external_ip_deny_cidrs,
    )?;
    if let Some(b) = file.honour_external_ips {
        p.honour_external_ips = b;
    }
    if let Some(b) = file.allow_node_addresses {
        p.allow_node_addresses = b;
    }
    if let Some(n) = file.max_frontends_per_service {
        if n == 0 {
            return Err(invalid(
                "frontendPolicy.maxFrontendsPerService",
                "must be at least 1",
            ));
        }
        p.max_frontends_per_service = n as usize;
    }
    Ok(p)
}

/// Conntrack timeouts, seconds; `None` keeps the datapath's default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConntrackTimeouts {
    pub tcp_established_s: Option<u32>,
    pub tcp_close_wait_s: Option<u32>,
    pub udp_s: Option<u32>,
    pub udp_stream_s: Option<u32>,
}

/// Everything `run` needs, merged from the defaults, the file and the flags.
#[derive(Clone, Debug)]
pub struct Settings {
    pub source: SourceKind,
    pub manifests: Vec<PathBuf>,
    pub node_name: String,
    pub kubeconfig: Option<PathBuf>,
    pub service_proxy_name: Option<String>,
    pub bpffs: PathBuf,
    pub pod_interfaces: Vec<glob::Pattern>,
    pub external_interfaces: Vec<glob::Pattern>,
    pub on_exit: OnExit,
    pub acceleration: Acceleration,
    pub delivery_mode: DeliveryMode,
    /// `None`: chosen at start from the host's `ip_local_port_range`.
    pub snat_port_range: Option<(u16, u16)>,
    pub tc_attach_mode: crate::bpf::TcAttachMode,
    pub hairpin_snat_ip: Ipv4Addr,
    /// `None`: the node's IPv6 address.
    pub hairpin_snat_ip6: Option<std::net::Ipv6Addr>,
    pub min_sync_period: Duration,
    pub sync_period: Duration,
    /// `None`: disabled (an empty address).
    pub healthz_bind_address: Option<SocketAddr>,
    pub metrics_bind_address: Option<SocketAddr>,
    /// `/readyz` and `/livez` for the pod's probes; `None`: disabled.
    pub probe_bind_address: Option<SocketAddr>,
    pub map_sizes: MapSizes,
    pub conntrack_timeouts: ConntrackTimeouts,
    /// `nodePortAddresses`: CIDRs or `primary` (kube-proxy's values),
    /// selecting among the InternalIPs and the external interfaces'
    /// addresses ([`crate::model::NodePortAddresses`]).
    pub node_port_addresses: Vec<crate::model::NodePortAddresses>,
    /// Accepted and checked; not used by the datapath yet.
    pub cluster_cidr: Option<Cidr>,
    /// The API server URL given (`--master` / `master`), over the
    /// kubeconfig's or the in-cluster one.
    pub master: Option<String>,
    /// The cgroup the socket hooks attach to; `None`: host socket LB off.
    pub host_socket_lb: Option<PathBuf>,
    /// Host clients' UDP to ClusterIPs translated per packet
    /// (`hostSocketLB.udpPerPacket`; only with host socket LB on).
    pub host_udp_per_packet: bool,
    pub localhost_node_ports: bool,
    /// The node's default load-balancing algorithm.
    pub lb_algorithm: crate::model::LbAlgorithm,
    pub maglev: crate::dataplane::MaglevSettings,
    /// `frontendPolicy`.
    pub frontend_policy: crate::model::FrontendPolicy,
}

/// `loadBalancing.maglev` checked: a prime size the slot 0 field holds, at
/// least one table.
fn maglev_settings(
    file: Option<&MaglevFile>,
) -> Result<crate::dataplane::MaglevSettings, ConfigError> {
    let mut m = crate::dataplane::MaglevSettings::default();
    let Some(file) = file else {
        return Ok(m);
    };
    if let Some(size) = file.table_size {
        if size > u32::from(proxy_common::lb::MAGLEV_MAX_SIZE) || !crate::model::is_prime(size) {
            return Err(invalid(
                "loadBalancing.maglev.tableSize",
                format!(
                    "{size} is not a prime of at most {} (e.g. 251, 1021, 4093, 16381, 65521)",
                    proxy_common::lb::MAGLEV_MAX_SIZE
                ),
            ));
        }
        m.table_size = size as u16;
    }
    if let Some(n) = file.max_tables {
        if n == 0 || n > u32::from(u16::MAX) {
            return Err(invalid(
                "loadBalancing.maglev.maxTables",
                format!("{n} must be between 1 and 65535"),
            ));
        }
        m.max_tables = n as usize;
    }
    Ok(m)
}

fn secs(field: &str, d: Option<GoDuration>) -> Result<Option<u32>, ConfigError> {
    d.map(|GoDuration(d)| {
        u32::try_from(d.as_secs())
            .ok()
            .filter(|s| *s > 0)
            .ok_or_else(|| invalid(field, "must be between 1s and 136 years"))
    })
    .transpose()
}

/// What the configuration needs from the host it runs on, found by the
/// caller ([`crate::host::facts`]): the configuration itself reads nothing
/// of the host, so that it resolves the same anywhere (tests, `helm
/// template` checks) from the same facts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// The host's name, lowercased: the node name when none is given.
    pub hostname: Option<String>,
    /// The cgroup v2 hierarchy's mount point, if there is one: where the
    /// socket hooks attach when `hostSocketLB.cgroupRoot` is not given.
    pub cgroup2_root: Option<PathBuf>,
}

/// A setting that is a flag, else a file field, else a default.
fn pick<T: Clone>(flag: &Option<T>, file: &Option<T>) -> Option<T> {
    flag.clone().or_else(|| file.clone())
}

impl Settings {
    /// Merges: flags over the file over the defaults; then checks the
    /// result. One function per section of the file, each checking its own
    /// fields.
    pub fn resolve(
        file: &ConfigFile,
        flags: &RunArgs,
        host: &HostFacts,
    ) -> Result<Self, ConfigError> {
        let (source, manifests) = source(file, flags)?;
        let (pod_interfaces, external_interfaces) = interfaces(file, flags)?;
        let (min_sync_period, sync_period) = sync_periods(file, flags)?;
        let (healthz_bind_address, metrics_bind_address, probe_bind_address) =
            bind_addresses(file, flags)?;
        let (map_sizes, conntrack_timeouts, maglev) = maps_and_conntrack(file, flags)?;
        Ok(Settings {
            source,
            manifests,
            node_name: node_name(file, flags, host)?,
            kubeconfig: flags.kubeconfig.clone().or_else(|| {
                file.client_connection
                    .as_ref()
                    .and_then(|c| c.kubeconfig.clone())
                    .filter(|p| !p.as_os_str().is_empty())
            }),
            service_proxy_name: pick(&flags.service_proxy_name, &file.service_proxy_name)
                .filter(|n| !n.is_empty()),
            bpffs: pick(&flags.bpffs, &file.bpffs).unwrap_or_else(|| DEFAULT_BPFFS.into()),
            pod_interfaces,
            external_interfaces,
            on_exit: flags.on_exit.or(file.on_exit).unwrap_or_default(),
            acceleration: flags.acceleration.or(file.acceleration).unwrap_or_default(),
            delivery_mode: flags
                .delivery_mode
                .or(file.delivery_mode)
                .unwrap_or_default(),
            snat_port_range: snat_port_range(file, flags)?,
            tc_attach_mode: flags
                .tc_attach_mode
                .or(file.tc_attach_mode)
                .unwrap_or_default(),
            hairpin_snat_ip: flags
                .hairpin_snat_ip
                .or(file.hairpin_snat_ip)
                .unwrap_or(DEFAULT_HAIRPIN_SNAT_IP),
            hairpin_snat_ip6: flags.hairpin_snat_ip6.or(file.hairpin_snat_ip6),
            min_sync_period,
            sync_period,
            healthz_bind_address,
            metrics_bind_address,
            probe_bind_address,
            map_sizes,
            conntrack_timeouts,
            node_port_addresses: node_port_addresses(file)?,
            cluster_cidr: cluster_cidr(file)?,
            master: master(file, flags)?,
            host_socket_lb: host_socket_lb(file, flags, host)?,
            host_udp_per_packet: flags
                .host_udp_per_packet
                .or(file.host_socket_lb.as_ref().and_then(|s| s.udp_per_packet))
                .unwrap_or(true),
            localhost_node_ports: file.localhost_node_ports.unwrap_or(true),
            lb_algorithm: file
                .load_balancing
                .as_ref()
                .and_then(|lb| lb.algorithm)
                .unwrap_or_default(),
            maglev,
            frontend_policy: frontend_policy(file.frontend_policy.as_ref())?,
        })
    }

    /// Reads `flags.config` when given, then merges.
    pub fn from_flags(flags: &RunArgs, host: &HostFacts) -> Result<Self, ConfigError> {
        let file = match &flags.config {
            Some(path) => ConfigFile::load(path)?,
            None => ConfigFile::default(),
        };
        Self::resolve(&file, flags, host)
    }
}

/// `source` and `manifests`: the manifests source needs paths.
fn source(file: &ConfigFile, flags: &RunArgs) -> Result<(SourceKind, Vec<PathBuf>), ConfigError> {
    let source = flags
        .source
        .or(file.source)
        .unwrap_or(SourceKind::Manifests);
    let manifests = if flags.manifests.is_empty() {
        file.manifests.clone().unwrap_or_default()
    } else {
        flags.manifests.clone()
    };
    if source == SourceKind::Manifests && manifests.is_empty() {
        return Err(invalid(
            "manifests",
            "the manifests source needs files or directories (--manifests or `manifests:`)",
        ));
    }
    Ok((source, manifests))
}

/// `hostnameOverride`: the flag, else the file, else the host's name.
fn node_name(file: &ConfigFile, flags: &RunArgs, host: &HostFacts) -> Result<String, ConfigError> {
    flags
        .node_name
        .clone()
        .filter(|n| !n.is_empty())
        .or_else(|| file.hostname_override.clone().filter(|n| !n.is_empty()))
        .or_else(|| host.hostname.clone())
        .ok_or_else(|| {
            invalid(
                "hostnameOverride",
                "no node name: pass --node-name, set NODE_NAME or hostnameOverride",
            )
        })
}

/// `podInterfaces` and `externalInterfaces`: glob patterns.
fn interfaces(
    file: &ConfigFile,
    flags: &RunArgs,
) -> Result<(Vec<glob::Pattern>, Vec<glob::Pattern>), ConfigError> {
    // An empty external pattern is no device (`externalInterfaces: [""]`).
    let patterns = |field: &str, list: Vec<String>, skip_empty: bool| {
        list.iter()
            .filter(|p| !(skip_empty && p.is_empty()))
            .map(|p| {
                glob::Pattern::new(p).map_err(|e| invalid(field, format!("bad pattern {p:?}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let pod = patterns(
        "podInterfaces",
        pick(&flags.pod_interfaces, &file.pod_interfaces)
            .unwrap_or_else(|| vec![DEFAULT_POD_INTERFACES.to_string()]),
        false,
    )?;
    let external = patterns(
        "externalInterfaces",
        pick(&flags.external_interfaces, &file.external_interfaces)
            .unwrap_or_else(|| vec![DEFAULT_EXTERNAL_INTERFACES.to_string()]),
        true,
    )?;
    Ok((pod, external))
}

/// `minSyncPeriod` and `syncPeriod`: the minimum no longer than the period.
fn sync_periods(file: &ConfigFile, flags: &RunArgs) -> Result<(Duration, Duration), ConfigError> {
    let min_sync_period = flags
        .min_sync_period
        .or(file.min_sync_period.map(|d| d.0))
        .unwrap_or(DEFAULT_MIN_SYNC_PERIOD);
    let sync_period = flags
        .sync_period
        .or(file.sync_period.map(|d| d.0))
        .unwrap_or(DEFAULT_SYNC_PERIOD);
    if sync_period.is_zero() {
        return Err(invalid("syncPeriod", "must be greater than 0"));
    }
    if min_sync_period > sync_period {
        return Err(invalid(
            "minSyncPeriod",
            format!("{min_sync_period:?} is longer than syncPeriod {sync_period:?}"),
        ));
    }
    Ok((min_sync_period, sync_period))
}

/// `healthzBindAddress`, `metricsBindAddress` and `probeBindAddress`;
/// empty: disabled.
type BindAddresses = (Option<SocketAddr>, Option<SocketAddr>, Option<SocketAddr>);

fn bind_addresses(file: &ConfigFile, flags: &RunArgs) -> Result<BindAddresses, ConfigError> {
    let healthz = pick(&flags.healthz_bind_address, &file.healthz_bind_address)
        .unwrap_or_else(|| DEFAULT_HEALTHZ_BIND_ADDRESS.to_string());
    let metrics = pick(&flags.metrics_bind_address, &file.metrics_bind_address)
        .unwrap_or_else(|| DEFAULT_METRICS_BIND_ADDRESS.to_string());
    let probe = pick(&flags.probe_bind_address, &file.probe_bind_address)
        .unwrap_or_else(|| DEFAULT_PROBE_BIND_ADDRESS.to_string());
    let healthz = parse_bind_address("healthzBindAddress", &healthz, 10256)?;
    let mut probe = parse_bind_address("probeBindAddress", &probe, 10266)?;
    // The healthz server answers the probes' paths too: on an address it
    // holds, the probe server would only fail to bind.
    if let (Some(h), Some(p)) = (healthz, probe) {
        if h.port() == p.port()
            && (h.ip() == p.ip() || h.ip().is_unspecified() || p.ip().is_unspecified())
        {
            probe = None;
        }
    }
    Ok((
        healthz,
        parse_bind_address("metricsBindAddress", &metrics, 10249)?,
        probe,
    ))
}

/// `conntrack`, `mapSizes` and `loadBalancing.maglev`: the map sizes they
/// make (Maglev's chunks among them) and the conntrack timeouts.
fn maps_and_conntrack(
    file: &ConfigFile,
    flags: &RunArgs,
) -> Result<
    (
        MapSizes,
        ConntrackTimeouts,
        crate::dataplane::MaglevSettings,
    ),
    ConfigError,
> {
    let ct = file.conntrack.clone().unwrap_or_default();
    let mut map_sizes = MapSizes::default();
    if let Some(per_core) = ct.max_per_core.filter(|n| *n > 0) {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        let total = (u64::from(per_core) * cpus).max(u64::from(ct.min.unwrap_or(0)));
        map_sizes.conntrack = u32::try_from(total)
            .map_err(|_| invalid("conntrack.maxPerCore", "the map would be too large"))?;
    }
    if let Some(n) = flags.conntrack_max {
        map_sizes.conntrack = n;
    }
    checked_map_sizes(file.map_sizes.as_ref(), &mut map_sizes)?;
    if map_sizes.conntrack == 0 {
        return Err(invalid("conntrack", "the conntrack map cannot be empty"));
    }
    let maglev = maglev_settings(
        file.load_balancing
            .as_ref()
            .and_then(|lb| lb.maglev.as_ref()),
    )?;
    // Two generations of every table (one being rebuilt).
    map_sizes.maglev_chunks =
        2 * maglev.max_tables as u32 * proxy_common::lb::maglev_chunks(maglev.table_size);
    let timeouts = ConntrackTimeouts {
        tcp_established_s: secs(
            "conntrack.tcpEstablishedTimeout",
            ct.tcp_established_timeout,
        )?,
        tcp_close_wait_s: secs("conntrack.tcpCloseWaitTimeout", ct.tcp_close_wait_timeout)?,
        udp_s: secs("conntrack.udpTimeout", ct.udp_timeout)?,
        udp_stream_s: secs("conntrack.udpStreamTimeout", ct.udp_stream_timeout)?,
    };
    Ok((map_sizes, timeouts, maglev))
}

/// `snatPortRange`; `None`: chosen at start beside the host's ephemeral
/// ports ([`super::snat_ports`]).
fn snat_port_range(file: &ConfigFile, flags: &RunArgs) -> Result<Option<(u16, u16)>, ConfigError> {
    flags
        .snat_port_range
        .as_deref()
        .or(file.snat_port_range.as_deref())
        .map(|r| parse_port_range(r).map_err(|e| invalid("snatPortRange", e)))
        .transpose()
}

/// `nodePortAddresses`: CIDRs or `primary`.
fn node_port_addresses(
    file: &ConfigFile,
) -> Result<Vec<crate::model::NodePortAddresses>, ConfigError> {
    file.node_port_addresses
        .iter()
        .flatten()
        .map(|s| {
            crate::model::NodePortAddresses::parse(s).map_err(|e| invalid("nodePortAddresses", e))
        })
        .collect()
}

/// `clusterCIDR`, checked.
fn cluster_cidr(file: &ConfigFile) -> Result<Option<Cidr>, ConfigError> {
    file.cluster_cidr
        .as_deref()
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|e| invalid("clusterCIDR", e)))
        .transpose()
}

/// `master`: a URL with a scheme and an authority.
fn master(file: &ConfigFile, flags: &RunArgs) -> Result<Option<String>, ConfigError> {
    let master = pick(&flags.master, &file.master).filter(|m| !m.trim().is_empty());
    if let Some(m) = &master {
        let ok = m
            .parse::<axum::http::Uri>()
            .ok()
            .is_some_and(|u| u.scheme().is_some() && u.authority().is_some());
        if !ok {
            return Err(invalid(
                "master",
                format!("{m:?} is not a URL (expected e.g. https://198.18.0.1:6443)"),
            ));
        }
    }
    Ok(master)
}

/// `hostSocketLB`: the cgroup the socket hooks attach to (the one given,
/// else the host's cgroup v2 root); `None` when turned off.
fn host_socket_lb(
    file: &ConfigFile,
    flags: &RunArgs,
    host: &HostFacts,
) -> Result<Option<PathBuf>, ConfigError> {
    let sock = file.host_socket_lb.clone().unwrap_or_default();
    if !flags.host_socket_lb.or(sock.enabled).unwrap_or(true) {
        return Ok(None);
    }
    match flags.cgroup_root.clone().or(sock.cgroup_root) {
        Some(p) => Ok(Some(p)),
        None => host.cgroup2_root.clone().map(Some).ok_or_else(|| {
            invalid(
                "hostSocketLB.cgroupRoot",
                "no cgroup v2 hierarchy found at /sys/fs/cgroup or /sys/fs/cgroup/unified: \
                 give its path, or set hostSocketLB.enabled: false",
            )
        }),
    }
}

//! The configuration file (`--config`) and how it merges with the flags.
//!
//! Field names follow kube-proxy's `KubeProxyConfiguration` where the meaning
//! is the same (`healthzBindAddress`, `metricsBindAddress`, `minSyncPeriod`,
//! `syncPeriod`, `hostnameOverride`, `clientConnection.kubeconfig`,
//! `conntrack`, ...); the agent's own fields are camelCase too (`bpffs`,
//! `podInterfaces`, `externalInterfaces`, `hairpinSnatIP`, `source`, `manifests`,
//! `serviceProxyName`). Durations are Go durations (`1s`, `250ms`, `1m30s`).
//! Unknown fields are errors. Flags override the file; the file overrides the
//! defaults.
//!
//! One module per concern: the values of single fields ([`values`]), the
//! file ([`file`]), the flags ([`flags`]), and the settings they resolve to
//! ([`settings`], one function per section).
use std::{fmt, net::Ipv4Addr, path::PathBuf, time::Duration};

mod file;
pub mod flags;
mod settings;
mod values;

pub use file::*;
pub use settings::*;
pub use values::*;

/// kube-proxy's default `healthzBindAddress`.
pub const DEFAULT_HEALTHZ_BIND_ADDRESS: &str = "0.0.0.0:10256";
/// kube-proxy's default `metricsBindAddress`.
pub const DEFAULT_METRICS_BIND_ADDRESS: &str = "127.0.0.1:10249";
/// The default `probeBindAddress`: loopback, for the kubelet's probes
/// (`host: 127.0.0.1`) of a hostNetwork pod.
pub const DEFAULT_PROBE_BIND_ADDRESS: &str = "127.0.0.1:10266";
pub const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/proxy-agent";
pub const DEFAULT_POD_INTERFACES: &str = "lxc*";
/// The node's external devices, by default.
pub const DEFAULT_EXTERNAL_INTERFACES: &str = "eth0";
/// Cilium's default service loopback address.
pub const DEFAULT_HAIRPIN_SNAT_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 42, 1);
/// The `kind` a configuration file may declare.
pub const KIND: &str = "ProxyAgentConfiguration";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading the config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A syntax error, an unknown field or a bad value in the file; the
    /// message names the field and where it is.
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid(field: &str, message: impl fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        message: message.to_string(),
    }
}

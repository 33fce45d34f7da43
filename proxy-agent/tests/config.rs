//! The config file and the flags: field names, Go durations, errors that name
//! the field, flags over file over defaults, and the lab's command line.
use std::{net::SocketAddr, path::Path, time::Duration};

use clap::Parser;
use proxy_agent::{
    cli::{Cli, Cmd, RunArgs},
    config::{parse_duration, ConfigError, ConfigFile, Settings, SourceKind},
};

/// `Settings::resolve` with this host's facts (hostname, cgroup root).
fn resolve(file: &ConfigFile, flags: &RunArgs) -> Result<Settings, ConfigError> {
    Settings::resolve(file, flags, &proxy_agent::host::facts())
}

fn run_args(args: &[&str]) -> RunArgs {
    let mut argv = vec!["proxy-agent", "run"];
    argv.extend_from_slice(args);
    match Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{args:?}: {e}")) {
        Cli { cmd: Cmd::Run(a) } => *a,
        _ => unreachable!(),
    }
}

fn parse(text: &str) -> Result<ConfigFile, String> {
    ConfigFile::parse(Path::new("config.yaml"), text).map_err(|e| e.to_string())
}

const FULL: &str = r#"
apiVersion: proxy-agent.io/v1alpha1
kind: ProxyAgentConfiguration
healthzBindAddress: 0.0.0.0:10266
metricsBindAddress: 127.0.0.1:10259
nodePortAddresses: [198.18.0.0/15]
clusterCIDR: 198.19.0.0/16
minSyncPeriod: 250ms
syncPeriod: 1m30s
hostnameOverride: node-7
clientConnection:
  kubeconfig: /etc/kubeconfig
conntrack:
  maxPerCore: 1000
  min: 5000000
  tcpEstablishedTimeout: 24h
  tcpCloseWaitTimeout: 1h
  udpTimeout: 30s
source: kubernetes
manifests: [/srv/a, /srv/b]
bpffs: /sys/fs/bpf/x
podInterfaces: ["lxc*", "veth*"]
hairpinSnatIP: 198.18.255.1
serviceProxyName: ebpf
"#;

#[test]
fn go_durations() {
    let ok = [
        ("0", Duration::ZERO),
        ("1s", Duration::from_secs(1)),
        ("250ms", Duration::from_millis(250)),
        ("1m30s", Duration::from_secs(90)),
        ("1.5h", Duration::from_secs(5400)),
        ("2h45m", Duration::from_secs(9900)),
        ("100us", Duration::from_micros(100)),
        ("10ns", Duration::from_nanos(10)),
    ];
    for (s, d) in ok {
        assert_eq!(parse_duration(s), Ok(d), "{s}");
    }
    for bad in ["", "1", "-1s", "1x", "s", "1s2"] {
        assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
    }
}

#[test]
fn every_field_of_the_file_is_used() {
    let file = parse(FULL).unwrap();
    let s = resolve(&file, &RunArgs::default()).unwrap();
    assert_eq!(
        s.healthz_bind_address,
        Some("0.0.0.0:10266".parse().unwrap())
    );
    assert_eq!(
        s.metrics_bind_address,
        Some("127.0.0.1:10259".parse().unwrap())
    );
    assert_eq!(s.node_port_addresses.len(), 1);
    assert_eq!(s.cluster_cidr.unwrap().to_string(), "198.19.0.0/16");
    assert_eq!(s.min_sync_period, Duration::from_millis(250));
    assert_eq!(s.sync_period, Duration::from_secs(90));
    assert_eq!(s.node_name, "node-7");
    assert_eq!(s.kubeconfig.as_deref(), Some(Path::new("/etc/kubeconfig")));
    assert!(s.map_sizes.conntrack >= 5_000_000);
    assert_eq!(s.conntrack_timeouts.tcp_established_s, Some(86_400));
    assert_eq!(s.conntrack_timeouts.tcp_close_wait_s, Some(3_600));
    assert_eq!(s.conntrack_timeouts.udp_s, Some(30));
    assert_eq!(s.source, SourceKind::Kubernetes);
    assert_eq!(s.manifests.len(), 2);
    assert_eq!(s.bpffs, Path::new("/sys/fs/bpf/x"));
    assert_eq!(s.pod_interfaces.len(), 2);
    assert_eq!(s.hairpin_snat_ip.to_string(), "198.18.255.1");
    assert_eq!(s.service_proxy_name.as_deref(), Some("ebpf"));
}

#[test]
fn defaults_are_kube_proxys() {
    let s = resolve(
        &ConfigFile::default(),
        &run_args(&["--manifests", "/m", "--node-name", "n"]),
    )
    .unwrap();
    assert_eq!(
        s.healthz_bind_address,
        Some("0.0.0.0:10256".parse().unwrap())
    );
    assert_eq!(
        s.metrics_bind_address,
        Some("127.0.0.1:10249".parse().unwrap())
    );
    assert_eq!(s.min_sync_period, Duration::from_secs(1));
    assert_eq!(s.sync_period, Duration::from_secs(30));
    assert_eq!(s.source, SourceKind::Manifests);
}

#[test]
fn unknown_and_invalid_fields_are_errors_that_name_them() {
    let e = parse("minSyncPeriod: 1s\nbindAddres: 0.0.0.0\n").unwrap_err();
    assert!(e.contains("bindAddres"), "{e}");
    assert!(e.contains("config.yaml"), "{e}");
    let e = parse("conntrack:\n  maxPerCores: 1\n").unwrap_err();
    assert!(e.contains("conntrack") && e.contains("maxPerCores"), "{e}");
    let e = parse("syncPeriod: 30\n").unwrap_err();
    assert!(
        e.contains("syncPeriod") && e.contains("invalid duration"),
        "{e}"
    );
    let e = parse("hairpinSnatIP: 198.18.0.300\n").unwrap_err();
    assert!(e.contains("hairpinSnatIP"), "{e}");
    let e = parse("source: ipvs\n").unwrap_err();
    assert!(e.contains("source"), "{e}");
    let e = parse("kind: KubeProxyConfiguration\n").unwrap_err();
    assert!(e.contains("kind"), "{e}");
    let file = parse("clusterCIDR: 198.18.0.0/33\nsource: kubernetes\n").unwrap();
    let e = resolve(&file, &run_args(&["--node-name", "n"]))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("clusterCIDR"), "{e}");
    let file = parse("healthzBindAddress: nowhere\nsource: kubernetes\n").unwrap();
    let e = resolve(&file, &run_args(&["--node-name", "n"]))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("healthzBindAddress"), "{e}");
}

#[test]
fn flags_override_the_file() {
    let file = parse(FULL).unwrap();
    let flags = run_args(&[
        "--source",
        "manifests",
        "--manifests",
        "/m",
        "--node-name",
        "node-1",
        "--min-sync-period",
        "100ms",
        "--healthz-bind-address",
        "127.0.0.1:1",
        "--metrics-bind-address",
        "",
        "--kubeconfig",
        "/k",
        "--conntrack-max",
        "1000",
    ]);
    let s = resolve(&file, &flags).unwrap();
    assert_eq!(s.source, SourceKind::Manifests);
    assert_eq!(s.manifests, [Path::new("/m")]);
    assert_eq!(s.node_name, "node-1");
    assert_eq!(s.min_sync_period, Duration::from_millis(100));
    assert_eq!(s.sync_period, Duration::from_secs(90), "from the file");
    assert_eq!(
        s.healthz_bind_address,
        Some("127.0.0.1:1".parse::<SocketAddr>().unwrap())
    );
    assert_eq!(s.metrics_bind_address, None, "empty disables");
    assert_eq!(s.kubeconfig.as_deref(), Some(Path::new("/k")));
    assert_eq!(s.map_sizes.conntrack, 1000);
}

#[test]
fn the_labs_command_line_still_works() {
    let flags = run_args(&[
        "--source",
        "manifests",
        "--manifests",
        "/tmp/lab/manifests",
        "--node-name",
        "node-1",
        "--bpffs",
        "/sys/fs/bpf/lab-node-1",
        "--pod-interfaces",
        "lxc*",
        "--hairpin-snat-ip",
        "198.18.255.254",
        "--min-sync-period",
        "100ms",
    ]);
    let s = Settings::from_flags(&flags, &proxy_agent::host::facts()).unwrap();
    assert_eq!(s.node_name, "node-1");
    assert_eq!(s.bpffs, Path::new("/sys/fs/bpf/lab-node-1"));
    assert_eq!(s.pod_interfaces[0].as_str(), "lxc*");
    assert_eq!(s.min_sync_period, Duration::from_millis(100));
    assert_eq!(s.hairpin_snat_ip.to_string(), "198.18.255.254");
}

#[test]
fn the_manifests_source_needs_manifests() {
    let e = resolve(&ConfigFile::default(), &run_args(&["--node-name", "n"])).unwrap_err();
    assert!(e.to_string().starts_with("manifests"), "{e}");
}

/// Issue 15: `cleanup --bpffs` refuses a path that is not on bpffs, and
/// removes nothing there.
#[test]
fn cleanup_refuses_a_path_not_on_bpffs() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("proxy-agent");
    std::fs::create_dir_all(victim.join("links")).unwrap();
    std::fs::write(victim.join("precious"), b"data").unwrap();
    let err = proxy_agent::cli::cleanup(&victim).unwrap_err().to_string();
    assert!(err.contains("not on a bpffs mount"), "{err}");
    assert!(err.contains(&victim.display().to_string()), "{err}");
    assert!(victim.join("precious").exists(), "cleanup removed a file");
    assert!(victim.join("links").exists());
    // A missing path is nothing to clean up, not an error, and it says so,
    // naming the path.
    let absent = dir.path().join("absent");
    let outcome = proxy_agent::cli::cleanup(&absent).unwrap();
    assert_eq!(
        outcome,
        proxy_agent::cli::CleanupOutcome::NothingThere(absent.clone())
    );
    let line = outcome.to_string();
    assert!(
        line.starts_with("nothing to clean up: ") && line.contains(&absent.display().to_string()),
        "{line}"
    );
}

/// `inspect` names the directory it looked in: a missing one, and the pin
/// path of a map that is not there.
#[test]
fn inspect_errors_name_the_pin_directory() {
    use clap::Parser;
    let dir = tempfile::tempdir().unwrap();
    let inspect = |what: &str, path: &std::path::Path| {
        let args = proxy_agent::inspect::InspectArgs::try_parse_from([
            "inspect",
            what,
            "--bpffs",
            path.to_str().unwrap(),
        ])
        .unwrap();
        proxy_agent::inspect::run(args).unwrap_err().to_string()
    };
    let absent = dir.path().join("absent");
    let err = inspect("services", &absent);
    assert!(
        err.contains(&absent.display().to_string()) && err.contains("no such directory"),
        "{err}"
    );
    use proxy_common::map_names;
    for (what, map) in [
        ("services", map_names::SERVICES),
        ("stats", map_names::STATS),
        ("conntrack", map_names::CONNTRACK),
    ] {
        let err = inspect(what, dir.path());
        let pin = dir.path().join(map).display().to_string();
        assert!(err.contains(&format!("pinned at {pin}")), "{what}: {err}");
    }
}

/// Issue 15: `frontendPolicy` reaches the settings; its defaults are
/// kube-proxy's (externalIPs honoured) plus the refusals; bad values are
/// errors naming the field.
#[test]
fn frontend_policy_fields_defaults_and_errors() {
    let resolve = |text: &str| {
        let file = parse(&format!("source: kubernetes\n{text}"))?;
        resolve(&file, &run_args(&["--node-name", "n"])).map_err(|e| e.to_string())
    };
    let d = resolve("").unwrap().frontend_policy;
    assert!(d.honour_external_ips);
    assert!(!d.allow_node_addresses);
    assert_eq!(d.max_frontends_per_service, 1024);
    assert!(d.external_ip_allow.is_empty() && d.external_ip_deny.is_empty());

    let p = resolve(
        "frontendPolicy:
  honourExternalIPs: false
  externalIPAllowCIDRs: [198.18.0.0/15]
  externalIPDenyCIDRs: [198.18.5.0/24, 198.18.6.1/32]
  allowNodeAddresses: true
  maxFrontendsPerService: 64
",
    )
    .unwrap()
    .frontend_policy;
    assert!(!p.honour_external_ips);
    assert!(p.allow_node_addresses);
    assert_eq!(p.max_frontends_per_service, 64);
    assert_eq!(p.external_ip_allow, [("198.18.0.0".parse().unwrap(), 15)]);
    assert_eq!(p.external_ip_deny.len(), 2);

    let e = resolve("frontendPolicy:\n  externalIPDenyCIDRs: [198.18.0.0/40]\n").unwrap_err();
    assert!(e.starts_with("frontendPolicy.externalIPDenyCIDRs"), "{e}");
    let e = resolve("frontendPolicy:\n  externalIPAllowCIDRs: [nowhere]\n").unwrap_err();
    assert!(e.starts_with("frontendPolicy.externalIPAllowCIDRs"), "{e}");
    // Host bits set: an error naming the field and the network meant, in
    // both lists (a deny entry 198.18.7.1/24 is a typo, not a network).
    for field in ["externalIPDenyCIDRs", "externalIPAllowCIDRs"] {
        let e = resolve(&format!(
            "frontendPolicy:\n  {field}: [198.18.5.0/24, 198.18.7.1/24]\n"
        ))
        .unwrap_err();
        assert!(
            e.starts_with(&format!("frontendPolicy.{field}"))
                && e.contains("198.18.7.1/24 has host bits set")
                && e.contains("198.18.7.0/24"),
            "{e}"
        );
    }
    // A /0 and a /32 have none to set wrongly.
    resolve("frontendPolicy:\n  externalIPDenyCIDRs: [0.0.0.0/0, 198.18.7.1/32]\n").unwrap();
    let e = resolve("frontendPolicy:\n  externalIPDenyCIDRs: [198.18.7.1/0]\n").unwrap_err();
    assert!(e.contains("the network is 0.0.0.0/0"), "{e}");
    // IPv6 CIDRs, beside IPv4 ones, with the same checks.
    let p = resolve("frontendPolicy:\n  externalIPAllowCIDRs: [198.18.0.0/15, \"2001:2::/48\"]\n")
        .unwrap()
        .frontend_policy;
    assert_eq!(
        p.external_ip_allow,
        [
            ("198.18.0.0".parse().unwrap(), 15),
            ("2001:2::".parse().unwrap(), 48)
        ]
    );
    let e = resolve("frontendPolicy:\n  externalIPDenyCIDRs: [\"2001:2::7:1/112\"]\n").unwrap_err();
    assert!(
        e.starts_with("frontendPolicy.externalIPDenyCIDRs") && e.contains("2001:2::7:0/112"),
        "{e}"
    );
    let e = resolve("frontendPolicy:\n  externalIPDenyCIDRs: [\"2001:2::/129\"]\n").unwrap_err();
    assert!(e.contains("0..=128"), "{e}");
    let e = resolve("frontendPolicy:\n  maxFrontendsPerService: 0\n").unwrap_err();
    assert!(
        e.starts_with("frontendPolicy.maxFrontendsPerService"),
        "{e}"
    );
    let e = resolve("frontendPolicy:\n  honorExternalIPs: true\n").unwrap_err();
    assert!(
        e.contains("frontendPolicy") && e.contains("honorExternalIPs"),
        "{e}"
    );
}

use proxy_testkit::fuzz;

/// Issue 15, input fuzzing: random and mutated config files never panic the
/// parser nor the merge; every error is one line of text that names the file
/// or the field.
#[test]
fn fuzzed_config_files_never_panic_and_errors_are_clear() {
    let full_policy = format!(
        "{FULL}loadBalancing: {{algorithm: maglev, maglev: {{tableSize: 251, maxTables: 4}}}}\nfrontendPolicy: {{honourExternalIPs: true, externalIPAllowCIDRs: [198.18.0.0/15], maxFrontendsPerService: 8}}\nhostSocketLB: {{enabled: false}}\nlocalhostNodePorts: true\n"
    );
    assert!(parse(&full_policy).is_ok());
    for seed in 0..3000u64 {
        let mut rng = fuzz::Rng::new(seed);
        let text = match rng.below(3) {
            0 => fuzz::random_string(&mut rng),
            1 => {
                let mut v: serde_json::Value = yaml_serde::from_str(&full_policy).unwrap();
                fuzz::mutate_value(&mut rng, &mut v);
                serde_json::to_string(&v).unwrap()
            }
            _ => fuzz::mutate_text(&mut rng, &full_policy),
        };
        let outcome = std::panic::catch_unwind(|| {
            ConfigFile::parse(Path::new("fuzz.yaml"), &text)
                .map_err(|e| e.to_string())
                .and_then(|file| {
                    resolve(&file, &run_args(&["--node-name", "n"]))
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                })
        });
        let Ok(result) = outcome else {
            panic!("seed {seed}: panicked on {text:?}");
        };
        if let Err(e) = result {
            assert!(!e.trim().is_empty(), "seed {seed}: empty error");
            let first = e.split([':', ' ']).next().unwrap_or_default();
            assert!(
                e.starts_with("config file fuzz.yaml")
                    || (!first.is_empty() && first.chars().next().unwrap().is_ascii_lowercase()),
                "seed {seed}: error names neither the file nor a field: {e:?}"
            );
        }
    }
}

/// `deliveryMode`, `snatPortRange` and the UDP stream timeout: parsed, flags
/// over the file, bad values name the field.
#[test]
fn delivery_mode_and_snat_port_range() {
    use proxy_agent::config::DeliveryMode;
    let base = "source: kubernetes\n";
    let file = parse(base).unwrap();
    let s = resolve(&file, &run_args(&["--node-name", "n"])).unwrap();
    assert_eq!(
        s.delivery_mode,
        DeliveryMode::Auto,
        "never bypass a policy engine by default"
    );
    assert_eq!(s.snat_port_range, None);
    let file = parse(&format!(
        "{base}deliveryMode: stack\nsnatPortRange: 20000-29999\nconntrack:\n  udpStreamTimeout: 3m\n"
    ))
    .unwrap();
    let s = resolve(&file, &run_args(&["--node-name", "n"])).unwrap();
    assert_eq!(s.delivery_mode, DeliveryMode::Stack);
    assert_eq!(s.snat_port_range, Some((20000, 29999)));
    assert_eq!(s.conntrack_timeouts.udp_stream_s, Some(180));
    let s = resolve(
        &file,
        &run_args(&[
            "--node-name",
            "n",
            "--delivery-mode",
            "redirect",
            "--snat-port-range",
            "1024-2047",
        ]),
    )
    .unwrap();
    assert_eq!(s.delivery_mode, DeliveryMode::Redirect);
    assert_eq!(s.snat_port_range, Some((1024, 2047)));
    for bad in ["30000", "0-10", "20-10", "1-70000", "a-b"] {
        let file = parse(&format!("{base}snatPortRange: \"{bad}\"\n")).unwrap();
        let e = resolve(&file, &run_args(&["--node-name", "n"]))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("snatPortRange"), "{bad}: {e}");
    }
    assert!(parse(&format!("{base}deliveryMode: fast\n"))
        .unwrap_err()
        .contains("deliveryMode"));
}

/// The SNAT range never overlaps the host's ephemeral ports: a configured
/// overlap is refused naming both ranges; unconfigured, the larger span of
/// 1024-65535 outside `ip_local_port_range` is taken.
#[test]
fn snat_ports_stay_out_of_the_hosts_ephemeral_ports() {
    use proxy_agent::config::snat_ports;
    // The kernel's default range: the ports below it are the larger span.
    assert_eq!(snat_ports(None, (32768, 60999)), Ok((1024, 32767)));
    assert_eq!(snat_ports(None, (1024, 40000)), Ok((40001, 65535)));
    assert_eq!(snat_ports(None, (10000, 65535)), Ok((1024, 9999)));
    assert!(snat_ports(None, (1024, 65535))
        .unwrap_err()
        .contains("ip_local_port_range"));
    assert_eq!(
        snat_ports(Some((61000, 65535)), (32768, 60999)),
        Ok((61000, 65535))
    );
    let e = snat_ports(Some((30000, 40000)), (32768, 60999)).unwrap_err();
    assert!(
        e.contains("30000-40000") && e.contains("32768-60999"),
        "{e}"
    );
    assert!(
        snat_ports(Some((60999, 61000)), (32768, 60999)).is_err(),
        "touching is overlapping"
    );
}

/// `mapSizes` sizes the maps of frontends and backends (a node with more
/// than 65,535 frontends raises them); out-of-range values are errors that
/// name the field, and what is not given keeps its default.
#[test]
fn map_sizes_raise_the_frontend_and_backend_maps() {
    use proxy_agent::bpf::MapSizes;
    let resolve = |text: &str| {
        let file = parse(&format!("source: kubernetes\n{text}"))?;
        resolve(&file, &run_args(&["--node-name", "n"]))
            .map(|s| s.map_sizes)
            .map_err(|e| e.to_string())
    };
    let s =
        resolve("mapSizes: {services: 524288, backends: 262144, reverseNat: 131072}\n").unwrap();
    assert_eq!(
        (s.services, s.backends, s.rev_nat),
        (524_288, 262_144, 131_072)
    );
    assert_eq!(s.conntrack, MapSizes::default().conntrack);
    let s = resolve("mapSizes: {reverseNat: 200000}\n").unwrap();
    assert_eq!(
        s,
        MapSizes {
            rev_nat: 200_000,
            ..MapSizes::default()
        }
    );
    for (text, field) in [
        ("mapSizes: {reverseNat: 16777217}\n", "mapSizes.reverseNat"),
        ("mapSizes: {services: 0}\n", "mapSizes.services"),
        ("mapSizes: {backends: 15}\n", "mapSizes.backends"),
    ] {
        let e = resolve(text).unwrap_err();
        assert!(
            e.contains(field) && e.contains("between 16 and 16777216"),
            "{text}: {e}"
        );
    }
    let e = resolve("mapSizes: {revNat: 1000}\n").unwrap_err();
    assert!(e.contains("revNat"), "{e}");
}

/// The configuration reads nothing of the host: the node name and the
/// socket hooks' cgroup come from the facts the caller found, and without
/// a cgroup v2 root the error names the field to set.
#[test]
fn the_node_name_and_the_cgroup_root_come_from_the_host_facts_given() {
    use proxy_agent::config::HostFacts;
    let file = ConfigFile::default();
    let flags = run_args(&["--manifests", "m.yaml"]);
    let facts = HostFacts {
        hostname: Some("from-facts".into()),
        cgroup2_root: Some("/facts/cgroup".into()),
    };
    let s = Settings::resolve(&file, &flags, &facts).unwrap();
    assert_eq!(s.node_name, "from-facts");
    assert_eq!(
        s.host_socket_lb.as_deref(),
        Some(Path::new("/facts/cgroup"))
    );

    let bare = HostFacts::default();
    let e = Settings::resolve(&file, &flags, &bare)
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("hostnameOverride:"), "{e}");
    let named = run_args(&["--manifests", "m.yaml", "--node-name", "n"]);
    let e = Settings::resolve(&file, &named, &bare)
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("hostSocketLB.cgroupRoot:"), "{e}");
    let off = run_args(&[
        "--manifests",
        "m.yaml",
        "--node-name",
        "n",
        "--host-socket-lb",
        "false",
    ]);
    assert_eq!(
        Settings::resolve(&file, &off, &bare)
            .unwrap()
            .host_socket_lb,
        None
    );
}

/// The probes' server: its own port by default (kube-proxy holds 10256
/// while a node is migrated), a flag over the file, empty disables it, and
/// an address the healthz server already holds is left to that server.
#[test]
fn the_probe_server_has_its_own_port_unless_healthz_holds_it() {
    const BASE: [&str; 6] = [
        "--source",
        "manifests",
        "--manifests",
        "/m",
        "--node-name",
        "n",
    ];
    let probe = |file: &str, flags: &[&str]| {
        let mut args = BASE.to_vec();
        args.extend_from_slice(flags);
        resolve(&parse(file).unwrap(), &run_args(&args))
            .unwrap()
            .probe_bind_address
    };
    let addr = |s: &str| Some(s.parse::<SocketAddr>().unwrap());
    assert_eq!(probe("", &[]), addr("127.0.0.1:10266"));
    assert_eq!(
        probe("probeBindAddress: 0.0.0.0:9000\n", &[]),
        addr("0.0.0.0:9000")
    );
    assert_eq!(
        probe(
            "probeBindAddress: 0.0.0.0:9000\n",
            &["--probe-bind-address", "127.0.0.1:9001"]
        ),
        addr("127.0.0.1:9001")
    );
    assert_eq!(
        probe("probeBindAddress: \"\"\n", &[]),
        None,
        "empty disables"
    );
    assert_eq!(
        probe("healthzBindAddress: 0.0.0.0:10266\n", &[]),
        None,
        "0.0.0.0:10266 serves the probes' paths on loopback already"
    );
    assert_eq!(
        probe("healthzBindAddress: 198.18.0.10:10266\n", &[]),
        addr("127.0.0.1:10266"),
        "another address of the same port does not overlap"
    );
    let e = resolve(
        &parse("probeBindAddress: nowhere\n").unwrap(),
        &run_args(&BASE),
    )
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("probeBindAddress"), "{e}");
}

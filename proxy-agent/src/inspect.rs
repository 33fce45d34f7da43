//! `proxy-agent inspect`: reads the pinned maps of a running agent and prints
//! them as a table or as JSON.
use crate::model::proto_name;
use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf};

use clap::{Parser, ValueEnum};
use proxy_common::{ct_dir, stat};
use serde_json::json;

use crate::bpf::{BpfError, PinnedMaps};
use crate::model::LbAlgorithm;
use proxy_common::{lb::MaglevKey, SvcValue};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum What {
    /// Frontends with their backends.
    Services,
    /// Backends by id.
    Backends,
    /// Conntrack entries.
    Conntrack,
    /// Datapath counters (summed over CPUs).
    Stats,
    /// Maglev tables: size, generation, memory and each backend's share.
    Maglev,
}

#[derive(Clone, Copy, Debug, Default, ValueEnum)]
pub enum Output {
    #[default]
    Table,
    Json,
}

#[derive(Parser)]
pub struct InspectArgs {
    what: What,
    /// The agent's pin directory.
    #[arg(long, default_value = "/sys/fs/bpf/proxy-agent")]
    bpffs: PathBuf,
    #[arg(long, short, value_enum, default_value = "table")]
    output: Output,
}

pub fn run(a: InspectArgs) -> Result<(), BpfError> {
    let maps = PinnedMaps::existing(a.bpffs)?;
    let value = match a.what {
        What::Services => {
            let p = maps.programmed()?;
            let mut out = Vec::new();
            // `host_alias`, where there is one: the ClusterIP a host
            // client's UDP to this frontend is aimed at
            // (`SvcValue::host_alias`).
            let row = |addr: SocketAddr,
                       proto: u8,
                       scope: u8,
                       v: &SvcValue,
                       backends,
                       alias: Option<SocketAddr>| {
                let mut row = json!({
                    "frontend": format!("{addr}/{}", proto_name(proto)),
                    "scope": if scope == proxy_common::SCOPE_INTERNAL { "internal" } else { "external" },
                    "rev_nat_id": v.rev_nat_id, "flags": v.flags, "backends": backends,
                    "algorithm": LbAlgorithm::of_flags(v.flags).name(),
                });
                if let Some(a) = alias {
                    row["host_alias"] = json!(a.to_string());
                }
                row
            };
            for (k, v) in p.services.iter().filter(|(k, _)| k.slot == 0) {
                let backends: Vec<String> = (1..=v.count)
                    .filter_map(|s| p.services.get(&k.with_slot(s)))
                    .map(|sv| match p.backends.get(&sv.backend_id) {
                        Some(b) => format!("{}:{}", b.addr(), b.port()),
                        None => format!("missing#{}", sv.backend_id),
                    })
                    .collect();
                let at = SocketAddr::new(k.addr().into(), k.port());
                let alias = (v.host_alias() != 0)
                    .then(|| p.rev_nat.get(&v.host_alias()))
                    .flatten()
                    .map(|r| SocketAddr::new(r.addr().into(), r.port()));
                out.push(row(at, k.proto, k.scope, v, backends, alias));
            }
            for (k, v) in p.services6.iter().filter(|(k, _)| k.slot == 0) {
                let backends: Vec<String> = (1..=v.count)
                    .filter_map(|s| p.services6.get(&k.with_slot(s)))
                    .map(|sv| match p.backends6.get(&sv.backend_id) {
                        Some(b) => SocketAddr::new(b.addr().into(), b.port()).to_string(),
                        None => format!("missing#{}", sv.backend_id),
                    })
                    .collect();
                let at = SocketAddr::new(k.addr().into(), k.port());
                let alias = (v.host_alias() != 0)
                    .then(|| p.rev_nat6.get(&v.host_alias()))
                    .flatten()
                    .map(|r| SocketAddr::new(r.addr().into(), r.port()));
                out.push(row(at, k.proto, k.scope, v, backends, alias));
            }
            json!(out)
        }
        What::Maglev => {
            let p = maps.programmed()?;
            // One row per Maglev frontend of either family: its table's size,
            // generation, chunks present and each backend's share of slots.
            let table = |at: SocketAddr,
                         proto: u8,
                         scope: u8,
                         v: &SvcValue,
                         name: &dyn Fn(u32) -> Option<String>| {
                let generation = u8::from(v.flags & proxy_common::svc_flags::MAGLEV_GEN != 0);
                let mut share: BTreeMap<String, usize> = BTreeMap::new();
                let mut chunks = 0;
                for c in 0..proxy_common::lb::maglev_chunks(v.maglev_size) {
                    let key = MaglevKey::new(v.rev_nat_id, generation, c as u16);
                    let Some(chunk) = p.maglev.get(&key) else {
                        continue;
                    };
                    chunks += 1;
                    let start = c as usize * proxy_common::lb::MAGLEV_CHUNK;
                    let n = (v.maglev_size as usize)
                        .saturating_sub(start)
                        .min(chunk.backend_ids.len());
                    for id in &chunk.backend_ids[..n] {
                        let backend = name(*id).unwrap_or_else(|| format!("missing#{id}"));
                        *share.entry(backend).or_default() += 1;
                    }
                }
                json!({
                    "frontend": format!("{at}/{}", proto_name(proto)),
                    "scope": if scope == proxy_common::SCOPE_INTERNAL { "internal" } else { "external" },
                    "table_size": v.maglev_size, "generation": generation,
                    "bytes": v.maglev_size as u64 * 4,
                    "chunks": format!("{chunks}/{}", proxy_common::lb::maglev_chunks(v.maglev_size)),
                    "entries": share,
                })
            };
            let is_maglev = |slot: u16, v: &SvcValue| {
                slot == 0 && LbAlgorithm::of_flags(v.flags) == LbAlgorithm::Maglev
            };
            let name4 = |id: u32| {
                p.backends
                    .get(&id)
                    .map(|b| format!("{}:{}", b.addr(), b.port()))
            };
            let name6 = |id: u32| {
                p.backends6
                    .get(&id)
                    .map(|b| SocketAddr::new(b.addr().into(), b.port()).to_string())
            };
            let mut out = Vec::new();
            for (k, v) in p.services.iter().filter(|(k, v)| is_maglev(k.slot, v)) {
                let at = SocketAddr::new(k.addr().into(), k.port());
                out.push(table(at, k.proto, k.scope, v, &name4));
            }
            for (k, v) in p.services6.iter().filter(|(k, v)| is_maglev(k.slot, v)) {
                let at = SocketAddr::new(k.addr().into(), k.port());
                out.push(table(at, k.proto, k.scope, v, &name6));
            }
            json!(out)
        }
        What::Backends => {
            let p = maps.programmed()?;
            let backends = p
                .backends
                .iter()
                .map(|(id, b)| {
                    (
                        *id,
                        SocketAddr::new(b.addr().into(), b.port()),
                        b.proto,
                        b.state,
                    )
                })
                .chain(p.backends6.iter().map(|(id, b)| {
                    (
                        *id,
                        SocketAddr::new(b.addr().into(), b.port()),
                        b.proto,
                        b.state,
                    )
                }));
            json!(backends
                .map(
                    |(id, at, proto, state)| json!({"id": id, "address": at.to_string(),
                                       "protocol": proto_name(proto), "state": state})
                )
                .collect::<Vec<_>>())
        }
        What::Conntrack => {
            let dir = |d: u8| {
                if d == ct_dir::SERVICE {
                    "service"
                } else {
                    "reply"
                }
            };
            let tuple = |s: SocketAddr, d: SocketAddr, proto: u8| {
                format!("{s} -> {d}/{}", proto_name(proto))
            };
            let v4 = maps.conntrack()?.into_iter().map(|(k, v)| {
                json!({
                    "dir": dir(k.dir),
                    "tuple": tuple(
                        SocketAddr::new(k.saddr().into(), u16::from_be(k.sport_be)),
                        SocketAddr::new(k.daddr().into(), u16::from_be(k.dport_be)),
                        k.proto,
                    ),
                    "backend_id": v.backend_id, "rev_nat_id": v.rev_nat_id, "flags": v.flags,
                })
            });
            let v6 = maps.conntrack6()?.into_iter().map(|(k, v)| {
                json!({
                    "dir": dir(k.dir),
                    "tuple": tuple(
                        SocketAddr::new(k.saddr().into(), u16::from_be(k.sport_be)),
                        SocketAddr::new(k.daddr().into(), u16::from_be(k.dport_be)),
                        k.proto,
                    ),
                    "backend_id": v.backend_id, "rev_nat_id": v.rev_nat_id, "flags": v.flags,
                })
            });
            json!(v4.chain(v6).collect::<Vec<_>>())
        }
        What::Stats => {
            let s = maps.stats()?;
            let named: BTreeMap<&str, u64> = s
                .iter()
                .map(|(c, n)| (stat::NAMES[*c as usize], *n))
                .filter(|(name, _)| !name.is_empty())
                .collect();
            json!(named)
        }
    };
    match a.output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        ),
        Output::Table => print_table(&value),
    }
    Ok(())
}

fn print_table(v: &serde_json::Value) {
    match v {
        serde_json::Value::Array(rows) => {
            for r in rows {
                if let serde_json::Value::Object(m) = r {
                    let cells: Vec<String> = m
                        .iter()
                        .map(|(k, v)| match v {
                            serde_json::Value::String(s) => format!("{k}={s}"),
                            other => format!("{k}={other}"),
                        })
                        .collect();
                    println!("{}", cells.join("  "));
                }
            }
        }
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                println!("{k:<24} {v}");
            }
        }
        other => println!("{other}"),
    }
}

//! `proxy-agent inspect`: reads the pinned maps of a running agent and prints
//! them as a table or as JSON.
use crate::model::proto_name;
use std::{collections::BTreeMap, path::PathBuf};

use clap::{Parser, ValueEnum};
use proxy_common::{ct_dir, stat};
use serde_json::json;

use crate::bpf::{BpfError, PinnedMaps};
use crate::model::LbAlgorithm;
use proxy_common::lb::MaglevKey;

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
            for (k, v) in p.services.iter().filter(|(k, _)| k.slot == 0) {
                let backends: Vec<String> = (1..=v.count)
                    .filter_map(|s| p.services.get(&k.with_slot(s)))
                    .map(|sv| match p.backends.get(&sv.backend_id) {
                        Some(b) => format!("{}:{}", b.addr(), b.port()),
                        None => format!("missing#{}", sv.backend_id),
                    })
                    .collect();
                out.push(json!({
                    "frontend": format!("{}:{}/{}", k.addr(), k.port(), proto_name(k.proto)),
                    "scope": if k.scope == proxy_common::SCOPE_INTERNAL { "internal" } else { "external" },
                    "rev_nat_id": v.rev_nat_id, "flags": v.flags, "backends": backends,
                    "algorithm": LbAlgorithm::of_flags(v.flags).name(),
                }));
            }
            json!(out)
        }
        What::Maglev => {
            let p = maps.programmed()?;
            let mut out = Vec::new();
            for (k, v) in p.services.iter().filter(|(k, v)| {
                k.slot == 0 && LbAlgorithm::of_flags(v.flags) == LbAlgorithm::Maglev
            }) {
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
                        let name = match p.backends.get(id) {
                            Some(b) => format!("{}:{}", b.addr(), b.port()),
                            None => format!("missing#{id}"),
                        };
                        *share.entry(name).or_default() += 1;
                    }
                }
                out.push(json!({
                    "frontend": format!("{}:{}/{}", k.addr(), k.port(), proto_name(k.proto)),
                    "scope": if k.scope == proxy_common::SCOPE_INTERNAL { "internal" } else { "external" },
                    "table_size": v.maglev_size, "generation": generation,
                    "bytes": v.maglev_size as u64 * 4,
                    "chunks": format!("{chunks}/{}", proxy_common::lb::maglev_chunks(v.maglev_size)),
                    "entries": share,
                }));
            }
            json!(out)
        }
        What::Backends => {
            let p = maps.programmed()?;
            json!(p
                .backends
                .iter()
                .map(
                    |(id, b)| json!({"id": id, "address": format!("{}:{}", b.addr(), b.port()),
                                       "protocol": proto_name(b.proto), "state": b.state})
                )
                .collect::<Vec<_>>())
        }
        What::Conntrack => {
            let ct = maps.conntrack()?;
            json!(ct
                .iter()
                .map(|(k, v)| json!({
                    "dir": if k.dir == ct_dir::SERVICE { "service" } else { "reply" },
                    "tuple": format!("{}:{} -> {}:{}/{}", k.saddr(), u16::from_be(k.sport_be),
                                     k.daddr(), u16::from_be(k.dport_be), proto_name(k.proto)),
                    "backend_id": v.backend_id, "rev_nat_id": v.rev_nat_id, "flags": v.flags,
                }))
                .collect::<Vec<_>>())
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

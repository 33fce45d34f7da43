//! The charts BENCHMARKS.md opens with are the bench's output: redrawn from
//! the `results.json` checked in beside them (`docs/bench/`), they come out
//! byte for byte as committed, and BENCHMARKS.md shows every one of them.
//! A change to the charts' code, or a hand edit of an SVG, fails here until
//! `cargo xtask bench --replot docs/bench` draws them again. No root.

use std::path::{Path, PathBuf};

use xtask::bench::{charts, Results};

fn bench_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("docs/bench")
}

fn results() -> Results {
    let path = bench_dir().join("results.json");
    let text = std::fs::read_to_string(&path).expect("docs/bench/results.json");
    serde_json::from_str(&text).expect("docs/bench/results.json is a bench run's results")
}

#[test]
fn committed_charts_are_what_the_bench_draws_from_the_committed_results() {
    let drawn = charts::render(&results()).unwrap();
    assert!(
        drawn.len() >= 3,
        "latency, programming and memory at least: {drawn:?}"
    );
    let mut stale = Vec::new();
    for (file, svg) in &drawn {
        let committed = std::fs::read_to_string(bench_dir().join(file)).unwrap_or_default();
        if committed != *svg {
            stale.push(file.clone());
        }
    }
    assert!(
        stale.is_empty(),
        "docs/bench/{stale:?} differ from what the bench draws from docs/bench/results.json: \
         run `cargo xtask bench --replot docs/bench` and commit the charts"
    );
}

#[test]
fn benchmarks_md_opens_with_every_chart() {
    let root = bench_dir()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let text = std::fs::read_to_string(root.join("BENCHMARKS.md")).unwrap();
    let first_table = text.find("\n|").expect("BENCHMARKS.md has tables");
    for (file, _) in charts::render(&results()).unwrap() {
        let image = format!("](docs/bench/{file})");
        let at = text
            .find(&image)
            .unwrap_or_else(|| panic!("BENCHMARKS.md does not show docs/bench/{file}"));
        assert!(
            at < first_table,
            "docs/bench/{file} comes after the first table: the charts open the page"
        );
    }
}

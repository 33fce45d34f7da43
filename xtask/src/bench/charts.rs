//! The benchmark's charts: SVG files beside `results.md`, drawn from the
//! same [`Results`], in the manner of KEP-3866's (a line per mode against
//! N, log scales where the values span decades).
//!
//! | File | Panels |
//! |---|---|
//! | `latency.svg` | connection latency p50, p99 at the main target |
//! | `programming.svg` | programming N Services from empty; one change, issued → first successful connection |
//! | `memory.svg` | the proxy process's RSS |
//!
//! An IPv6 run adds the same files with `-ipv6` before `.svg`. A mode not
//! measured at some N has no point there; a mode measured nowhere has no
//! line and no legend entry. The output is a pure function of the results,
//! so the charts checked in under `docs/bench/` can be redrawn from the
//! `results.json` beside them and compared.
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::results::FLOOR;
use super::{Family, ModeResult, NResult, Results};

/// Width and height of one chart file, pixels.
const SIZE: (u32, u32) = (1100, 470);
/// Height of the legend strip under the panels, per row of entries.
const LEGEND_ROW: u32 = 22;
/// Legend entries per row.
const LEGEND_COLUMNS: usize = 4;

/// One line: a mode's label and its (N, value) points, N ascending.
#[derive(Debug, Clone, PartialEq)]
struct Series {
    mode: String,
    label: String,
    points: Vec<(f64, f64)>,
}

/// One panel: a title, the unit's axis label, how a value is printed, and
/// its lines.
struct Panel {
    title: &'static str,
    y_desc: &'static str,
    y_fmt: fn(&f64) -> String,
    series: Vec<Series>,
}

/// One file.
struct Chart {
    name: &'static str,
    caption: String,
    panels: Vec<Panel>,
}

/// Writes the charts of `r` into `dir` and returns the files written (none
/// for a run without a proxy mode measured at any N).
pub fn write(dir: &Path, r: &Results) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for (file, svg) in render(r)? {
        let path = dir.join(file);
        std::fs::write(&path, svg)?;
        written.push(path);
    }
    Ok(written)
}

/// Each chart's file name and SVG text.
pub fn render(r: &Results) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for family in Family::ALL {
        if !r.results.iter().any(|n| !n.modes_of(family).is_empty()) {
            continue;
        }
        let suffix = match family {
            Family::Ipv4 => "",
            Family::Ipv6 => "-ipv6",
        };
        for mut chart in charts(r, family) {
            // A value no mode measured (the one-change time of a run
            // without changes) gets no empty panel.
            chart.panels.retain(|p| !p.series.is_empty());
            if chart.panels.is_empty() {
                continue;
            }
            out.push((format!("{}{suffix}.svg", chart.name), draw(&chart)?));
        }
    }
    Ok(out)
}

/// The markdown lines that show the charts of `r` (relative paths).
pub fn markdown_images(r: &Results) -> Result<String> {
    let mut s = String::new();
    for (file, _) in render(r)? {
        s.push_str(&format!("![{}]({file})\n\n", file.trim_end_matches(".svg")));
    }
    Ok(s)
}

fn family_label(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => "IPv4",
        Family::Ipv6 => "IPv6",
    }
}

fn charts(r: &Results, family: Family) -> Vec<Chart> {
    let endpoints = r
        .config
        .get("endpoints")
        .map(|e| format!(", {e} endpoints each"))
        .unwrap_or_default();
    let fam = family_label(family);
    vec![
        Chart {
            name: "latency",
            caption: format!(
                "Connection latency against the number of Services N ({fam}{endpoints})"
            ),
            panels: vec![
                Panel {
                    title: "p50",
                    y_desc: "connect + first reply",
                    y_fmt: fmt_us,
                    series: series(r, family, |n, m, mr| n.conn_main(m, mr).map(|c| c.p50_us)),
                },
                Panel {
                    title: "p99",
                    y_desc: "connect + first reply",
                    y_fmt: fmt_us,
                    series: series(r, family, |n, m, mr| n.conn_main(m, mr).map(|c| c.p99_us)),
                },
            ],
        },
        Chart {
            name: "programming",
            caption: format!("Programming time against N ({fam})"),
            panels: vec![
                Panel {
                    title: "N Services from empty",
                    y_desc: "time",
                    y_fmt: fmt_s,
                    series: series(r, family, |_, _, mr| mr.prog.from_empty_s),
                },
                Panel {
                    title: "One change: issued → first successful connection",
                    y_desc: "time",
                    y_fmt: fmt_s,
                    series: series(r, family, |_, _, mr| mr.prog.npl_ms.map(|ms| ms / 1e3)),
                },
            ],
        },
        Chart {
            name: "memory",
            caption: format!("Proxy memory against N ({fam})"),
            panels: vec![Panel {
                title: "RSS of the proxy process (API modes: peak over the N; proxy-tc: after the load)",
                y_desc: "RSS",
                y_fmt: fmt_mib,
                series: series(r, family, |_, _, mr| rss(mr)),
            }],
        },
    ]
}

/// The proxy's RSS in `mr`, MiB (so the ticks fall on round MiB): the peak
/// the API modes record (kube-proxy and the agent alike), else the agent's
/// after the load.
fn rss(mr: &ModeResult) -> Option<f64> {
    mr.api
        .as_ref()
        .and_then(|a| a.peak_rss)
        .or(mr.prog.agent_rss)
        .map(|b| b as f64 / (1024.0 * 1024.0))
}

/// One line per mode of `family` with at least one positive value.
fn series(
    r: &Results,
    family: Family,
    value: impl Fn(&NResult, &str, &ModeResult) -> Option<f64>,
) -> Vec<Series> {
    let mut modes: Vec<&str> = r
        .results
        .iter()
        .flat_map(|n| n.modes_of(family).keys().map(String::as_str))
        .collect();
    modes.sort_by_key(|m| (mode_rank(m), *m));
    modes.dedup();
    let mut out = Vec::new();
    for mode in modes {
        let mut points: Vec<(f64, f64)> = r
            .results
            .iter()
            .filter_map(|n| {
                let mr = n.modes_of(family).get(mode)?;
                let v = value(n, mode, mr)?;
                (v.is_finite() && v > 0.0).then_some((n.n as f64, v))
            })
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        if !points.is_empty() {
            out.push(Series {
                mode: mode.to_string(),
                label: if mode == FLOOR {
                    "none (the floor: no proxy)".to_string()
                } else {
                    mode.to_string()
                },
                points,
            });
        }
    }
    out
}

/// The order modes are listed in: the floor, the agent, the real
/// kube-proxy, then the rule layouts.
fn mode_rank(mode: &str) -> u8 {
    match mode {
        FLOOR => 0,
        m if m.starts_with("proxy-tc") => 1,
        m if m.starts_with("kube-proxy") => 2,
        _ => 3,
    }
}

/// A mode's colour and whether its line is dashed, fixed per mode so a
/// mode looks the same in every chart.
fn style(mode: &str) -> (RGBColor, bool) {
    match mode {
        FLOOR => (RGBColor(0, 0, 0), true),
        "proxy-tc" => (RGBColor(31, 119, 180), false),
        "proxy-tc-k8s" => (RGBColor(23, 190, 207), false),
        "proxy-tc-maglev" => (RGBColor(44, 160, 44), false),
        "proxy-tc-stack" => (RGBColor(148, 103, 189), false),
        "kube-proxy-iptables" => (RGBColor(214, 39, 40), false),
        "kube-proxy-nftables" => (RGBColor(255, 127, 14), false),
        "iptables-legacy" | "ip6tables-legacy" => (RGBColor(214, 39, 40), true),
        "iptables-nft" | "ip6tables-nft" => (RGBColor(140, 86, 75), true),
        "nftables" => (RGBColor(255, 127, 14), true),
        _ => (RGBColor(127, 127, 127), true),
    }
}

fn draw(chart: &Chart) -> Result<String> {
    let modes = legend_modes(chart);
    let rows = modes.len().div_ceil(LEGEND_COLUMNS) as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let root = root
            .titled(&chart.caption, ("sans-serif", 20))
            .map_err(plot_err)?;
        let (plots, legend) = root.split_vertically(SIZE.1 - 30 - rows * LEGEND_ROW - 10);
        let areas = plots.split_evenly((1, chart.panels.len()));
        for (panel, area) in chart.panels.iter().zip(&areas) {
            draw_panel(panel, area)?;
        }
        draw_legend(&legend, &modes)?;
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

/// Every mode with a line in some panel, with its label, in panel order.
fn legend_modes(chart: &Chart) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = Vec::new();
    for s in chart.panels.iter().flat_map(|p| &p.series) {
        if !v.iter().any(|(m, _)| *m == s.mode) {
            v.push((s.mode.clone(), s.label.clone()));
        }
    }
    v
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing a chart: {e:?}")
}

/// A log axis range around `values`, a little wider than they are (and a
/// decade wide at least, so one point still gets labels).
fn log_range(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = values.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        return 1.0..10.0;
    }
    let (mut lo, mut hi) = (lo / 1.5, hi * 1.5);
    if hi / lo < 10.0 {
        let mid = (lo * hi).sqrt();
        lo = mid / 10f64.sqrt();
        hi = mid * 10f64.sqrt();
    }
    lo..hi
}

fn draw_panel(panel: &Panel, area: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<()> {
    let xs = log_range(
        panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0)),
    );
    let ys = log_range(
        panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1)),
    );
    // Ticks at the N the run measured, and at 1-2-5 steps of the value.
    let mut ns: Vec<f64> = panel
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    ns.sort_by(f64::total_cmp);
    ns.dedup();
    let y_ticks = ticks_125(&ys);
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, ("sans-serif", 15))
        .margin(8)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(
            xs.log_scale().with_key_points(ns),
            ys.log_scale().with_key_points(y_ticks),
        )
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("N (Services), log scale")
        .y_desc(format!("{}, log scale", panel.y_desc))
        .x_label_formatter(&fmt_n)
        .y_label_formatter(&panel.y_fmt)
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(plot_err)?;
    for s in &panel.series {
        let (color, dashed) = style(&s.mode);
        let line = color.stroke_width(2);
        if dashed {
            chart
                .draw_series(DashedLineSeries::new(s.points.iter().copied(), 6, 4, line))
                .map_err(plot_err)?;
        } else {
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), line))
                .map_err(plot_err)?;
        }
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(plot_err)?;
    }
    Ok(())
}

fn draw_legend(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    modes: &[(String, String)],
) -> Result<()> {
    let (w, _) = area.dim_in_pixel();
    let col = (w as i32 - 40) / LEGEND_COLUMNS as i32;
    for (i, (mode, label)) in modes.iter().enumerate() {
        let (color, dashed) = style(mode);
        let x = 40 + (i % LEGEND_COLUMNS) as i32 * col;
        let y = 8 + (i / LEGEND_COLUMNS) as i32 * LEGEND_ROW as i32;
        let line = color.stroke_width(2);
        if dashed {
            for k in 0..3 {
                area.draw(&PathElement::new(
                    vec![(x + k * 10, y), (x + k * 10 + 6, y)],
                    line,
                ))
                .map_err(plot_err)?;
            }
        } else {
            area.draw(&PathElement::new(vec![(x, y), (x + 26, y)], line))
                .map_err(plot_err)?;
        }
        area.draw(&Circle::new((x + 13, y), 3, color.filled()))
            .map_err(plot_err)?;
        area.draw(&Text::new(
            label.clone(),
            (x + 34, y - 7),
            ("sans-serif", 14).into_font(),
        ))
        .map_err(plot_err)?;
    }
    Ok(())
}

/// 1, 2 and 5 times the powers of ten within `r` (only the powers when
/// that gives more than eight).
fn ticks_125(r: &std::ops::Range<f64>) -> Vec<f64> {
    let mut v = Vec::new();
    let mut decade = 10f64.powi(r.start.log10().floor() as i32);
    while decade <= r.end {
        for m in [1.0, 2.0, 5.0] {
            let t = decade * m;
            if t >= r.start && t <= r.end {
                v.push(t);
            }
        }
        decade *= 10.0;
    }
    if v.len() > 8 {
        v.retain(|t| (t.log10() - t.log10().round()).abs() < 1e-9);
    }
    v
}

/// N on the axis: 100, 1k, 10k, 100k.
fn fmt_n(n: &f64) -> String {
    let n = n.round();
    if n >= 1000.0 {
        format!("{}k", n / 1000.0)
    } else {
        format!("{n}")
    }
}

fn fmt_us(us: &f64) -> String {
    fmt_s(&(us / 1e6))
}

fn fmt_s(s: &f64) -> String {
    let s = *s;
    let (v, unit) = if s >= 1.0 {
        (s, "s")
    } else if s >= 1e-3 {
        (s * 1e3, "ms")
    } else {
        (s * 1e6, "µs")
    };
    format!("{} {unit}", trim(v))
}

fn fmt_mib(mib: &f64) -> String {
    if *mib >= 1024.0 {
        format!("{} GiB", trim(mib / 1024.0))
    } else {
        format!("{} MiB", trim(*mib))
    }
}

/// Two significant digits at most, no trailing zeros.
fn trim(v: f64) -> String {
    let s = if v >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    };
    s.trim_end_matches(".0").to_string()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::{ApiStats, ConnStats, ProgStats};
    use super::*;

    fn mode(p50_us: f64, from_empty_s: Option<f64>, rss: Option<u64>) -> ModeResult {
        let mut conn = BTreeMap::new();
        conn.insert(
            "middle".to_string(),
            ConnStats {
                p50_us,
                p99_us: p50_us * 3.0,
                ..Default::default()
            },
        );
        ModeResult {
            conn,
            prog: ProgStats {
                from_empty_s,
                ..Default::default()
            },
            api: rss.map(|r| ApiStats {
                peak_rss: Some(r),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn results() -> Results {
        let mut results = Vec::new();
        for (n, scale) in [(100usize, 1.0), (1000, 2.0), (10_000, 8.0)] {
            let mut modes = BTreeMap::new();
            modes.insert(
                "proxy-tc-k8s".to_string(),
                mode(60.0, Some(0.1 * scale), Some(50 << 20)),
            );
            // kube-proxy measured at the first two N only: its line stops.
            if n < 10_000 {
                modes.insert(
                    "kube-proxy-iptables".to_string(),
                    mode(70.0 * scale, Some(scale), Some((80 << 20) * n as u64 / 100)),
                );
            }
            results.push(NResult {
                n,
                positions: BTreeMap::new(),
                modes,
                modes_ipv6: BTreeMap::new(),
                family_target: None,
                not_run: BTreeMap::new(),
            });
        }
        Results {
            machine: BTreeMap::new(),
            config: BTreeMap::new(),
            results,
        }
    }

    #[test]
    fn a_line_per_mode_with_a_point_per_n_it_was_measured_at() {
        let r = results();
        let p50 = series(&r, Family::Ipv4, |n, m, mr| {
            n.conn_main(m, mr).map(|c| c.p50_us)
        });
        let by_mode: BTreeMap<&str, &Vec<(f64, f64)>> =
            p50.iter().map(|s| (s.mode.as_str(), &s.points)).collect();
        assert_eq!(
            by_mode["kube-proxy-iptables"],
            &vec![(100.0, 70.0), (1000.0, 140.0)]
        );
        assert_eq!(by_mode["proxy-tc-k8s"].len(), 3);
        // The agent listed before kube-proxy, whatever the names' order.
        assert_eq!(p50[0].mode, "proxy-tc-k8s");
        // A value never measured gives no line at all.
        assert!(series(&r, Family::Ipv4, |_, _, mr| mr.prog.npl_ms).is_empty());
    }

    #[test]
    fn every_chart_draws_every_measured_mode_with_its_legend() {
        let charts = render(&results()).unwrap();
        let names: Vec<&str> = charts.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(names, ["latency.svg", "programming.svg", "memory.svg"]);
        for (file, svg) in &charts {
            assert!(svg.starts_with("<svg"), "{file}");
            for label in ["proxy-tc-k8s", "kube-proxy-iptables"] {
                assert!(
                    svg.contains(label),
                    "{file} has no legend entry for {label}"
                );
            }
            // The agent's line (its colour) once per panel and once in the
            // legend: latency has p50 and p99; programming only from-empty,
            // as no one-change time was measured; memory one panel.
            let agent_lines = svg.matches(r##"stroke="#17BECF""##).count();
            let panels = if file == "latency.svg" { 2 } else { 1 };
            assert_eq!(agent_lines, panels + 1, "{file}");
        }
        // The axes are labelled in the unit's terms.
        let latency = &charts[0].1;
        assert!(latency.contains("µs"), "latency axis in µs");
        assert!(charts[2].1.contains("MiB"), "memory axis in MiB");
    }

    #[test]
    fn output_is_a_function_of_the_results() {
        assert_eq!(render(&results()).unwrap(), render(&results()).unwrap());
    }

    #[test]
    fn a_run_without_measurements_draws_nothing() {
        let mut r = results();
        for n in &mut r.results {
            n.modes.clear();
        }
        assert!(render(&r).unwrap().is_empty());
    }

    #[test]
    fn axis_labels() {
        assert_eq!(fmt_n(&100.0), "100");
        assert_eq!(fmt_n(&10_000.0), "10k");
        assert_eq!(fmt_us(&250.0), "250 µs");
        assert_eq!(fmt_s(&1.5), "1.5 s");
        assert_eq!(fmt_s(&0.02), "20 ms");
        assert_eq!(fmt_mib(&50.0), "50 MiB");
        assert_eq!(fmt_mib(&2048.0), "2 GiB");
        let r = log_range([50.0, 60.0].into_iter());
        assert!(r.end / r.start >= 10.0 - 1e-9, "{r:?}");
        assert_eq!(ticks_125(&(15.0..600.0)), [20.0, 50.0, 100.0, 200.0, 500.0]);
        assert_eq!(
            ticks_125(&(0.5..2e5)),
            [1.0, 10.0, 100.0, 1000.0, 10_000.0, 100_000.0]
        );
    }
}

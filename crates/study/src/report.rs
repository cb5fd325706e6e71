//! `vqblk report`: figures of merit from a results file, as Markdown (laid out like
//! the seeds' tables: rows size x op, columns jobs x iodepth), CSV, JSON and a
//! self-contained HTML page with one chart per cell.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use serde_json::json;

use crate::matrix::{size_label, Cell, Op, Setup};
use crate::merit::{all_merits, total, CellMerit, Options, TotalMerit};
use crate::results::Results;

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// GitHub-flavoured Markdown tables.
    Markdown,
    /// One row per cell and per Total.
    Csv,
    /// Everything, structured.
    Json,
    /// A self-contained page: tables and inline SVG charts, no external resources.
    Html,
}

impl Format {
    /// File name under `--out`.
    pub fn file_name(self) -> &'static str {
        match self {
            Format::Markdown => "report.md",
            Format::Csv => "report.csv",
            Format::Json => "report.json",
            Format::Html => "report.html",
        }
    }
}

/// What `vqblk report` and `vqblk recommend` both read: the results and how
/// to judge them.
#[derive(Debug, Clone, Args)]
pub struct StudyArgs {
    /// Results file written by `vqblk sweep`.
    #[arg(value_name = "RESULTS")]
    pub results: PathBuf,
    /// Fraction of each cell's best throughput that counts as reaching it.
    #[arg(long, default_value_t = 0.9)]
    pub threshold: f64,
    /// Repeats whose relative range exceeds this are flagged noisy.
    #[arg(long, default_value_t = 0.10)]
    pub noise: f64,
}

impl StudyArgs {
    /// Reads and judges the results file.
    pub fn load(&self) -> anyhow::Result<Study> {
        load(
            &self.results,
            Options {
                threshold: self.threshold,
                noise: self.noise,
            },
        )
    }
}

/// Options of `vqblk report`.
#[derive(Debug, Clone, Args)]
pub struct ReportArgs {
    #[command(flatten)]
    pub study: StudyArgs,
    /// Output format (default: markdown on stdout; with --out, every format).
    #[arg(long, value_enum)]
    pub format: Option<Format>,
    /// Directory to write report.{md,csv,json,html} into.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// Per-setup extras of one cell, averaged over the repeats.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Extras {
    /// IOPS.
    pub iops: Option<f64>,
    /// p50 latency, us.
    pub p50_us: Option<f64>,
    /// p99 latency, us.
    pub p99_us: Option<f64>,
    /// Server CPU, percent of one CPU.
    pub server_cpu_pct: Option<f64>,
}

/// A results file with its figures of merit computed.
#[derive(Debug, Clone)]
pub struct Study {
    /// The raw results.
    pub results: Results,
    /// Knobs used.
    pub opts: Options,
    /// Per cell.
    pub merits: BTreeMap<Cell, CellMerit>,
    /// IOThread counts that appear (without the baseline).
    pub counts: Vec<u32>,
    /// Whether any native / baseline run exists.
    pub has_native: bool,
    /// See `has_native`.
    pub has_baseline: bool,
}

fn mean_opt(xs: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let v: Vec<f64> = xs.flatten().collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

impl Study {
    /// Computes every figure.
    pub fn new(results: Results, opts: Options) -> Study {
        let merits = all_merits(&results.throughput(), opts);
        let setups = results.setups();
        let counts = setups.iter().filter_map(|s| match s {
            Setup::IoThreads(k) => Some(*k),
            _ => None,
        });
        Study {
            counts: counts.collect(),
            has_native: setups.contains(&Setup::Native),
            has_baseline: setups.contains(&Setup::Baseline),
            merits,
            results,
            opts,
        }
    }

    /// Columns in display order: native, baseline, counts.
    pub fn setups(&self) -> Vec<Setup> {
        let mut v = Vec::new();
        if self.has_native {
            v.push(Setup::Native);
        }
        if self.has_baseline {
            v.push(Setup::Baseline);
        }
        v.extend(self.counts.iter().map(|&k| Setup::IoThreads(k)));
        v
    }

    /// (jobs, iodepth) columns present, sorted.
    pub fn job_columns(&self) -> Vec<(u32, u32)> {
        let s: BTreeSet<(u32, u32)> = self.merits.keys().map(|c| (c.jobs, c.iodepth)).collect();
        s.into_iter().collect()
    }

    /// Block sizes present.
    pub fn sizes(&self) -> Vec<u64> {
        let s: BTreeSet<u64> = self.merits.keys().map(|c| c.bs).collect();
        s.into_iter().collect()
    }

    /// Operations present.
    pub fn ops(&self) -> Vec<Op> {
        let s: BTreeSet<Op> = self.merits.keys().map(|c| c.op).collect();
        s.into_iter().collect()
    }

    /// Per-size Total (mean over the operations) for each (jobs, iodepth).
    pub fn total(&self, bs: u64, jobs: u32, iodepth: u32) -> TotalMerit {
        let cells: Vec<&CellMerit> = self
            .merits
            .iter()
            .filter(|(c, _)| c.bs == bs && c.jobs == jobs && c.iodepth == iodepth)
            .map(|(_, m)| m)
            .collect();
        total(&cells)
    }

    /// Averages of the other figures of one cell and setup.
    pub fn extras(&self, cell: &Cell, setup: Setup) -> Extras {
        let runs = self.results.runs_of(cell, setup);
        Extras {
            iops: mean_opt(runs.iter().map(|r| Some(r.iops))),
            p50_us: mean_opt(runs.iter().map(|r| r.p50_us)),
            p99_us: mean_opt(runs.iter().map(|r| r.p99_us)),
            server_cpu_pct: mean_opt(runs.iter().map(|r| r.server_cpu_pct)),
        }
    }

    /// Cells flagged noisy.
    pub fn noisy_cells(&self) -> Vec<(&Cell, &CellMerit)> {
        self.merits.iter().filter(|(_, m)| m.is_noisy()).collect()
    }
}

/// One figure of merit, laid out like the seeds' tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Figure {
    /// Improvement of best over baseline, percent.
    Improvement,
    /// Fewest IOThreads reaching the threshold.
    MinIoThreads,
    /// Best / native.
    RatioToNative,
}

/// A table ready for any renderer: header, rows, and which rows are totals.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// Caption.
    pub title: String,
    /// Explanation under the caption.
    pub note: String,
    /// Column names.
    pub header: Vec<String>,
    /// Whether each column is numeric (right-aligned).
    pub numeric: Vec<bool>,
    /// Rows of cells, with a flag for Total rows.
    pub rows: Vec<(Vec<String>, bool)>,
}

/// `1234`, `123`, `12.3`, `1.23`.
pub fn fmt_mb(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// Noisy values carry a `~`.
const NOISY: &str = "~";
/// Missing values.
const NA: &str = "n/a";

fn figure_of(f: Figure, m: &CellMerit) -> Option<String> {
    match f {
        Figure::Improvement => m.improvement_pct.map(|p| format!("{p:.0}%")),
        Figure::MinIoThreads => m.min_iothreads.map(|k| k.to_string()),
        Figure::RatioToNative => m.ratio_to_native.map(|r| format!("{r:.2}")),
    }
}

fn figure_of_total(f: Figure, t: &TotalMerit) -> Option<String> {
    match f {
        Figure::Improvement => t.improvement_pct.map(|p| format!("{p:.0}%")),
        Figure::MinIoThreads => t.min_iothreads.map(|k| format!("{}", k.round())),
        Figure::RatioToNative => t.ratio_to_native.map(|r| format!("{r:.2}")),
    }
}

fn mark(v: Option<String>, noisy: bool) -> String {
    match v {
        Some(s) if noisy => format!("{s}{NOISY}"),
        Some(s) => s,
        None => NA.into(),
    }
}

/// The seeds' layout for one figure: rows size x op plus a Total per size, columns
/// jobs x iodepth.
pub fn figure_table(study: &Study, f: Figure) -> Table {
    let th = (study.opts.threshold * 100.0).round();
    let (title, note) = match f {
        Figure::Improvement => (
            "Best improvement over baseline with additional IOThreads".to_string(),
            "Best throughput over every IOThread count (baseline included) relative to the baseline. 0% = the baseline is best.".to_string(),
        ),
        Figure::MinIoThreads => (
            format!("Minimum IOThread count to achieve {th}% of best performance"),
            format!("Fewest IOThreads reaching {th}% of the best throughput of the cell; 0 = the baseline already does."),
        ),
        Figure::RatioToNative => (
            "Ratio of best performance to native".to_string(),
            "Best virtualized throughput / the same workload run directly on the storage (the seeds' \"pod\").".to_string(),
        ),
    };
    let cols = study.job_columns();
    let mut header = vec!["size".to_string(), "op".to_string()];
    header.extend(cols.iter().map(|(j, d)| format!("{j}/{d}")));
    let mut numeric = vec![false, false];
    numeric.extend(cols.iter().map(|_| true));
    let mut rows = Vec::new();
    for bs in study.sizes() {
        let mut first = true;
        for op in study.ops() {
            let mut row = vec![
                if first { size_label(bs) } else { String::new() },
                op.to_string(),
            ];
            first = false;
            for &(jobs, iodepth) in &cols {
                let cell = Cell {
                    bs,
                    op,
                    jobs,
                    iodepth,
                };
                row.push(match study.merits.get(&cell) {
                    Some(m) => mark(figure_of(f, m), m.is_noisy()),
                    None => NA.into(),
                });
            }
            rows.push((row, false));
        }
        let mut row = vec![format!("{} Total", size_label(bs)), String::new()];
        for &(jobs, iodepth) in &cols {
            let t = study.total(bs, jobs, iodepth);
            row.push(if t.cells == 0 {
                NA.into()
            } else {
                mark(figure_of_total(f, &t), t.noisy)
            });
        }
        rows.push((row, true));
    }
    Table {
        title,
        note: format!("{note} Columns: jobs/iodepth."),
        header,
        numeric,
        rows,
    }
}

/// Throughput of every cell at every column, with best.
pub fn throughput_table(study: &Study) -> Table {
    let setups = study.setups();
    let mut header: Vec<String> = ["size", "op", "jobs", "iodepth"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    header.extend(setups.iter().map(|s| match s {
        Setup::Native => "native".to_string(),
        Setup::Baseline => "0 (baseline)".to_string(),
        Setup::IoThreads(k) => k.to_string(),
    }));
    header.push("best".into());
    let mut numeric = vec![false, false, true, true];
    numeric.extend(setups.iter().map(|_| true));
    numeric.push(true);
    let mut rows = Vec::new();
    for (cell, m) in &study.merits {
        let mut row = vec![
            size_label(cell.bs),
            cell.op.to_string(),
            cell.jobs.to_string(),
            cell.iodepth.to_string(),
        ];
        for &s in &setups {
            row.push(match m.measure(s) {
                Some(x) => mark(Some(fmt_mb(x.mean)), m.noisy.contains(&s)),
                None => NA.into(),
            });
        }
        row.push(m.best.map(fmt_mb).unwrap_or_else(|| NA.into()));
        rows.push((row, false));
    }
    Table {
        title: "Throughput (MB/s)".into(),
        note: format!(
            "Mean of the measured repeats, in MB/s (10^6 bytes/s); {NOISY} = repeats differ by more than {:.0}%. \
             Columns: native, baseline (0), IOThread counts.",
            study.opts.noise * 100.0
        ),
        header,
        numeric,
        rows,
    }
}

/// Every table of the report, in order.
pub fn tables(study: &Study) -> Vec<Table> {
    let mut v = vec![
        figure_table(study, Figure::Improvement),
        figure_table(study, Figure::MinIoThreads),
    ];
    if study.has_native {
        v.push(figure_table(study, Figure::RatioToNative));
    }
    v.push(throughput_table(study));
    v
}

/// Facts about the study, as (label, value) lines.
pub fn facts(study: &Study) -> Vec<(String, String)> {
    let mut v = Vec::new();
    let r = &study.results;
    if let Some(h) = r.header() {
        v.push(("storage".into(), h.storage.describe()));
        v.push((
            "host".into(),
            format!(
                "{} CPUs, {}, kernel {} ({})",
                h.host.nproc, h.host.cpu_model, h.host.kernel, h.host.hostname
            ),
        ));
        v.push(("vqblk".into(), h.vqblk_version.clone()));
        v.push(("started".into(), h.started.clone()));
        v.push(("baseline".into(), h.baseline.clone()));
        v.push((
            "method".into(),
            format!(
                "{} warm-up run(s) discarded, {} measured run(s) averaged per cell and column; {} s per run after {} s ramp; {} virtqueues",
                h.warmups, h.repeats, h.runtime_s, h.ramp_s, h.queues
            ),
        ));
        v.push(("IOThread rule".into(), h.skip_rule.clone()));
        for (k, c) in &h.commands {
            v.push((format!("command ({k})"), c.clone()));
        }
        if r.headers.len() > 1 {
            v.push((
                "resumed".into(),
                format!("{} more time(s)", r.headers.len() - 1),
            ));
        }
    }
    v.push(("measured runs".into(), r.runs.len().to_string()));
    if !study.has_native {
        let why = r
            .skips
            .iter()
            .find(|s| s.setup == "native")
            .map(|s| s.reason.clone())
            .unwrap_or_else(|| "not measured".into());
        v.push(("native".into(), why));
    }
    for s in r.skips.iter().filter(|s| s.setup != "native") {
        v.push((s.setup.clone(), s.reason.clone()));
    }
    if !r.errors.is_empty() {
        v.push((
            "failed run attempts".into(),
            format!(
                "{} (a failed run is retried once; see the list at the end)",
                r.errors.len()
            ),
        ));
    }
    v
}

/// The noisy cells, as lines.
pub fn noisy_lines(study: &Study) -> Vec<String> {
    study
        .noisy_cells()
        .into_iter()
        .map(|(c, m)| {
            let parts: Vec<String> = m
                .noisy
                .iter()
                .filter_map(|s| {
                    m.measure(*s)
                        .map(|x| format!("{s} {:.0}%", x.spread() * 100.0))
                })
                .collect();
            format!("{c}: {}", parts.join(", "))
        })
        .collect()
}

fn md_escape(s: &str) -> String {
    s.replace('|', "\\|")
}

/// Markdown rendering.
pub fn markdown(study: &Study) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# vqblk IOThread study\n");
    for (k, v) in facts(study) {
        if k.starts_with("command") {
            let _ = writeln!(o, "- {k}: `{}`", v);
        } else {
            let _ = writeln!(o, "- {k}: {}", md_escape(&v));
        }
    }
    let _ = writeln!(
        o,
        "\n{NOISY} marks a cell where some column's repeats differ by more than {:.0}% (noisy); n/a = not measured.\n",
        study.opts.noise * 100.0
    );
    for t in tables(study) {
        let _ = writeln!(o, "## {}\n\n{}\n", t.title, t.note);
        let _ = writeln!(o, "| {} |", t.header.join(" | "));
        let align: Vec<&str> = t
            .numeric
            .iter()
            .map(|&n| if n { "--:" } else { "---" })
            .collect();
        let _ = writeln!(o, "|{}|", align.join("|"));
        for (row, is_total) in &t.rows {
            let cells: Vec<String> = row
                .iter()
                .map(|c| {
                    if *is_total && !c.is_empty() {
                        format!("**{c}**")
                    } else {
                        md_escape(c)
                    }
                })
                .collect();
            let _ = writeln!(o, "| {} |", cells.join(" | "));
        }
        let _ = writeln!(o);
    }
    let noisy = noisy_lines(study);
    if !noisy.is_empty() {
        let _ = writeln!(o, "## Noisy cells (relative range of the repeats)\n");
        for l in noisy {
            let _ = writeln!(o, "- {l}");
        }
        let _ = writeln!(o);
    }
    if !study.results.errors.is_empty() {
        let _ = writeln!(o, "## Failed run attempts\n");
        for e in &study.results.errors {
            let _ = writeln!(o, "- {} {}: {}", e.setup, e.cell, md_escape(&e.message));
        }
    }
    o
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn num(x: Option<f64>) -> String {
    x.map(|v| {
        format!("{v:.4}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    })
    .unwrap_or_default()
}

/// CSV: one row per cell, then one per Total; throughput columns per setup in MB/s.
pub fn csv(study: &Study) -> String {
    let setups = study.setups();
    let mut header: Vec<String> = ["kind", "size", "bs", "op", "jobs", "iodepth"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    header.extend(
        setups
            .iter()
            .map(|s| format!("{}_mb_s", s.label().replace('=', "_"))),
    );
    header.extend(
        [
            "best_mb_s",
            "improvement_pct",
            "min_iothreads",
            "ratio_to_native",
            "noisy",
            "max_spread_pct",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    let mut o = header.join(",") + "\n";
    for (c, m) in &study.merits {
        let mut row = vec![
            "cell".to_string(),
            size_label(c.bs),
            c.bs.to_string(),
            c.op.to_string(),
            c.jobs.to_string(),
            c.iodepth.to_string(),
        ];
        row.extend(setups.iter().map(|&s| num(m.mean(s))));
        let spread = setups
            .iter()
            .filter_map(|&s| m.measure(s).map(|x| x.spread()))
            .fold(0.0, f64::max);
        row.extend([
            num(m.best),
            num(m.improvement_pct),
            m.min_iothreads.map(|k| k.to_string()).unwrap_or_default(),
            num(m.ratio_to_native),
            m.is_noisy().to_string(),
            num(Some(spread * 100.0)),
        ]);
        o += &(row
            .iter()
            .map(|s| csv_field(s))
            .collect::<Vec<_>>()
            .join(",")
            + "\n");
    }
    for bs in study.sizes() {
        for (jobs, iodepth) in study.job_columns() {
            let t = study.total(bs, jobs, iodepth);
            if t.cells == 0 {
                continue;
            }
            let mut row = vec![
                "total".to_string(),
                size_label(bs),
                bs.to_string(),
                String::new(),
                jobs.to_string(),
                iodepth.to_string(),
            ];
            row.extend(
                setups
                    .iter()
                    .map(|s| num(t.throughput.get(&s.label()).copied())),
            );
            row.extend([
                num(t.best),
                num(t.improvement_pct),
                num(t.min_iothreads),
                num(t.ratio_to_native),
                t.noisy.to_string(),
                String::new(),
            ]);
            o += &(row.join(",") + "\n");
        }
    }
    o
}

/// JSON: the header, every cell with its figures and per-setup extras, the totals.
pub fn json(study: &Study) -> anyhow::Result<String> {
    let cells: Vec<serde_json::Value> = study
        .merits
        .iter()
        .map(|(c, m)| {
            let setups: serde_json::Map<String, serde_json::Value> = study
                .setups()
                .into_iter()
                .filter_map(|s| {
                    let x = m.measure(s)?;
                    let e = study.extras(c, s);
                    Some((
                        s.label(),
                        json!({"mb_s": x.mean, "min_mb_s": x.min, "max_mb_s": x.max, "repeats": x.n,
                               "spread": x.spread(), "iops": e.iops, "p50_us": e.p50_us, "p99_us": e.p99_us,
                               "server_cpu_pct": e.server_cpu_pct}),
                    ))
                })
                .collect();
            json!({
                "cell": c, "label": c.to_string(), "setups": setups, "best_mb_s": m.best,
                "improvement_pct": m.improvement_pct, "min_iothreads": m.min_iothreads,
                "ratio_to_native": m.ratio_to_native, "noisy": m.noisy,
            })
        })
        .collect();
    let mut totals = Vec::new();
    for bs in study.sizes() {
        for (jobs, iodepth) in study.job_columns() {
            let t = study.total(bs, jobs, iodepth);
            if t.cells > 0 {
                totals.push(json!({"bs": bs, "jobs": jobs, "iodepth": iodepth, "total": t}));
            }
        }
    }
    let v = json!({
        "header": study.results.header(),
        "options": {"threshold": study.opts.threshold, "noise": study.opts.noise},
        "columns": study.setups(),
        "skipped": study.results.skips,
        "errors": study.results.errors,
        "cells": cells,
        "totals": totals,
    });
    Ok(serde_json::to_string_pretty(&v)? + "\n")
}

/// Renders one format.
pub fn render(study: &Study, f: Format) -> anyhow::Result<String> {
    Ok(match f {
        Format::Markdown => markdown(study),
        Format::Csv => csv(study),
        Format::Json => json(study)?,
        Format::Html => crate::html::html(study),
    })
}

/// Reads a results file and computes the figures.
pub fn load(path: &std::path::Path, opts: Options) -> anyhow::Result<Study> {
    if opts.threshold.is_nan() || opts.threshold <= 0.0 || opts.threshold > 1.0 {
        bail!("--threshold: {} is not in (0, 1]", opts.threshold);
    }
    if opts.noise.is_nan() || opts.noise < 0.0 {
        bail!("--noise: {} is not >= 0", opts.noise);
    }
    let results = Results::read(path)?;
    if results.runs.is_empty() {
        bail!("{}: no measured runs", path.display());
    }
    Ok(Study::new(results, opts))
}

/// `vqblk report`.
pub fn run(args: ReportArgs) -> anyhow::Result<i32> {
    let study = args.study.load()?;
    match &args.out {
        None => print!(
            "{}",
            render(&study, args.format.unwrap_or(Format::Markdown))?
        ),
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("--out {}", dir.display()))?;
            let formats = match args.format {
                Some(f) => vec![f],
                None => vec![Format::Markdown, Format::Csv, Format::Json, Format::Html],
            };
            for f in formats {
                let path = dir.join(f.file_name());
                std::fs::write(&path, render(&study, f)?)
                    .with_context(|| format!("{}", path.display()))?;
                eprintln!("vqblk report: wrote {}", path.display());
            }
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::{Record, Run};

    fn study(rows: &[(Op, u32, Setup, &[f64])]) -> Study {
        let mut r = Results::default();
        for &(op, jobs, setup, xs) in rows {
            for (i, &mb) in xs.iter().enumerate() {
                r.push(Record::Run(Box::new(Run {
                    cell: Cell {
                        bs: 2048,
                        op,
                        jobs,
                        iodepth: 1,
                    },
                    setup: setup.label(),
                    iothreads: setup.count(),
                    run: i as u32 + 1,
                    iops: 1.0,
                    bw_bytes: mb * 1e6,
                    mb_s: mb,
                    p50_us: None,
                    p99_us: None,
                    server_cpu_s: None,
                    server_cpu_pct: None,
                    elapsed_s: 1.0,
                    time: String::new(),
                    argv: vec![],
                })));
            }
        }
        Study::new(r, Options::default())
    }

    #[test]
    fn seeds_layout_with_a_missing_cell_and_totals() {
        let s = study(&[
            (Op::Randread, 1, Setup::Baseline, &[100.0, 100.0]),
            (Op::Randread, 1, Setup::IoThreads(2), &[150.0, 150.0]),
            (Op::Randread, 4, Setup::Baseline, &[100.0, 100.0]),
            (Op::Randread, 4, Setup::IoThreads(2), &[300.0, 360.0]),
            (Op::Write, 1, Setup::Baseline, &[100.0, 100.0]),
            (Op::Write, 1, Setup::IoThreads(2), &[50.0, 50.0]),
        ]);
        let t = figure_table(&s, Figure::Improvement);
        assert_eq!(t.header, vec!["size", "op", "1/1", "4/1"]);
        assert_eq!(t.rows[0].0, vec!["2k", "randread", "50%", "230%~"]);
        assert_eq!(
            t.rows[1].0,
            vec!["", "write", "0%", "n/a"],
            "write 4/1 was not measured"
        );
        assert_eq!(
            t.rows[2],
            (
                vec![
                    "2k Total".to_string(),
                    String::new(),
                    "25%".into(),
                    "230%~".into()
                ],
                true
            )
        );
        let k = figure_table(&s, Figure::MinIoThreads);
        assert_eq!(k.rows[0].0[2..], ["2", "2~"]);
        assert_eq!(k.rows[1].0[2..], ["0", "n/a"]);
        assert_eq!(k.rows[2].0[2..], ["1", "2~"], "mean of 2 and 0");
        assert!(!s.has_native);
        assert_eq!(tables(&s).len(), 3, "no ratio table without native");
        let md = markdown(&s);
        assert!(
            md.contains("| **2k Total** |  | **25%** | **230%~** |"),
            "{md}"
        );
        assert!(
            md.contains("- randread 2k jobs=4 iodepth=1: iothreads=2 18%"),
            "{md}"
        );
        let csv = csv(&s);
        assert!(
            csv.lines()
                .any(|l| l == "cell,2k,2048,write,1,1,100,50,100,0,0,,false,0"),
            "{csv}"
        );
    }
}

//! `vqblk report`: figures of merit from a results file, as Markdown (laid out like
//! the seeds' tables: rows size x op, columns jobs x iodepth), CSV, JSON and a
//! self-contained HTML page with one chart per cell.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use serde_json::json;

use vqblk_daemon::size::size_label;

use crate::matrix::{Cell, Setup};
use crate::merit::{CellMerit, TotalMerit};
use crate::study::{Study, StudyArgs};
use crate::tables::{facts, noisy_lines, tables, NOISY};

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

/// Options of `vqblk report`.
#[derive(Debug, Clone, Args)]
pub struct ReportArgs {
    /// The results file and how to judge it.
    #[command(flatten)]
    pub study: StudyArgs,
    /// Output format (default: markdown on stdout; with --out, every format).
    #[arg(long, value_enum)]
    pub format: Option<Format>,
    /// Directory to write report.{md,csv,json,html} into.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
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
    let mut o = csv_header(&setups);
    for (c, m) in &study.merits {
        o += &csv_cell_row(&setups, c, m);
    }
    for bs in study.sizes() {
        for (jobs, iodepth) in study.job_columns() {
            let t = study.total(bs, jobs, iodepth);
            if t.cells == 0 {
                continue;
            }
            o += &csv_total_row(&setups, &t, bs, jobs, iodepth);
        }
    }
    o
}

/// The header line: the cell's coordinates, one throughput column per setup, the
/// figures of merit.
fn csv_header(setups: &[Setup]) -> String {
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
    header.join(",") + "\n"
}

/// The line of one cell, its fields quoted where needed.
fn csv_cell_row(setups: &[Setup], c: &Cell, m: &CellMerit) -> String {
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
    row.iter()
        .map(|s| csv_field(s))
        .collect::<Vec<_>>()
        .join(",")
        + "\n"
}

/// The line of the Total of one size and jobs x iodepth column (no op, no spread).
fn csv_total_row(setups: &[Setup], t: &TotalMerit, bs: u64, jobs: u32, iodepth: u32) -> String {
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
    row.join(",") + "\n"
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
    use crate::matrix::{Cell, Op, Setup};
    use crate::merit::Options;
    use crate::results::{Record, Results, Run};
    use crate::tables::{figure_table, Figure};

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
                    server_threads: Default::default(),
                    server_threads_wait: Default::default(),
                    server_threads_cpu: Default::default(),
                    tune: None,
                    iothread_counters: None,
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

    #[test]
    fn auto_is_a_column_compared_with_the_best_fixed_count() {
        let s = study(&[
            (Op::Randread, 1, Setup::Baseline, &[100.0, 100.0]),
            (Op::Randread, 1, Setup::IoThreads(2), &[200.0, 200.0]),
            (Op::Randread, 1, Setup::Auto, &[190.0, 190.0]),
            (Op::Write, 1, Setup::Baseline, &[100.0, 100.0]),
            (Op::Write, 1, Setup::IoThreads(2), &[50.0, 50.0]),
        ]);
        let m = &s.merits[&Cell {
            bs: 2048,
            op: Op::Randread,
            jobs: 1,
            iodepth: 1,
        }];
        assert_eq!(m.best, Some(200.0), "auto is not one of the fixed counts");
        assert_eq!(m.best_count(), Some(2));
        assert_eq!(m.auto_vs_best(), Some(0.95));
        let all = tables(&s);
        let auto = all.last().unwrap();
        assert_eq!(auto.title, "auto against the best fixed IOThread count");
        assert_eq!(auto.rows.len(), 1, "only the cell auto was measured in");
        assert_eq!(auto.rows[0].0[4..8], ["190", "2", "200", "0.95"]);
        // Runs recorded without the controller's figures.
        assert_eq!(auto.rows[0].0[11..], ["n/a", "n/a", "no"]);
        // With them: the IOThreads active at the end of the runs, and the
        // moves made during them.
        let mut s = s;
        let tunes = [(1, 2), (2, 1)];
        let runs = s
            .results
            .runs
            .iter_mut()
            .filter(|r| r.setup() == Setup::Auto);
        for (r, (active, moves)) in runs.zip(tunes) {
            r.tune = Some(crate::results::TuneDuring {
                moves: [("balance".to_string(), moves)].into(),
                failed_moves: 0,
                active_iothreads: active,
            });
        }
        let all = tables(&s);
        assert_eq!(all.last().unwrap().rows[0].0[11..], ["1-2", "3", "no"]);
        let md = markdown(&s);
        assert!(
            md.contains("| 2k | randread | 1 | 1 | 100 | 200 | 190 | 200 |"),
            "{md}"
        );
        assert!(csv(&s).lines().next().unwrap().contains("auto_mb_s"));
    }

    /// A cell where `auto` falls short of the threshold but its repeats
    /// overlap the best count's is said to be within the noise, in the
    /// table and in `recommend`'s reasoning.
    #[test]
    fn a_shortfall_within_the_repeats_noise_is_told_apart() {
        let s = study(&[
            (Op::Randread, 1, Setup::Baseline, &[100.0, 100.0]),
            (Op::Randread, 1, Setup::IoThreads(2), &[180.0, 220.0]),
            (Op::Randread, 1, Setup::Auto, &[150.0, 185.0]),
            (Op::Write, 1, Setup::Baseline, &[100.0, 100.0]),
            (Op::Write, 1, Setup::IoThreads(2), &[200.0, 200.0]),
            (Op::Write, 1, Setup::Auto, &[150.0, 150.0]),
        ]);
        let all = tables(&s);
        let auto = all.last().unwrap();
        let noise: Vec<&str> = auto.rows.iter().map(|r| r.0[13].as_str()).collect();
        assert_eq!(noise, ["yes", "no"]);
        let cells: Vec<_> = s.merits.iter().map(|(c, m)| (*c, m)).collect();
        let d = crate::merit::decide(&cells, 0.9);
        let text = crate::recommend::reasoning(&s, &cells, &d, 0.9);
        assert!(
            text.contains("in 0 of 2 cells, and in 1 more its repeats overlap the best count's"),
            "{text}"
        );
    }
}

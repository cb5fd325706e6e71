//! The report's tables and facts, laid out once for every renderer (Markdown, CSV,
//! HTML): rows size x op with a Total per size, columns jobs x iodepth, like the
//! seeds' tables.

use vqblk_daemon::size::size_label;

use crate::matrix::{Cell, Setup};
use crate::merit::{CellMerit, TotalMerit};
use crate::study::{fmt_mb, Study};

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

/// Noisy values carry a `~`.
pub const NOISY: &str = "~";
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
        Setup::Auto => "auto".to_string(),
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
             Columns: native, baseline (0), IOThread counts, auto (`--iothreads auto`). \
             Best is over the baseline and the counts.",
            study.opts.noise * 100.0
        ),
        header,
        numeric,
        rows,
    }
}

/// Server CPU time per request of one cell in one column, microseconds.
fn cpu_us_per_io(study: &Study, cell: &Cell, s: Setup) -> Option<f64> {
    let e = study.extras(cell, s);
    let (cpu, iops) = (e.server_cpu_pct?, e.iops?);
    (iops > 0.0).then(|| cpu / 100.0 / iops * 1e6)
}

/// `--iothreads auto` against the best fixed count of each cell: throughput
/// and the server's CPU per request, as ratios (the autotune targets: at
/// least 0.9x the throughput at no more than 1.1x the CPU per request).
pub fn auto_table(study: &Study) -> Table {
    let header: Vec<String> = [
        "size",
        "op",
        "jobs",
        "iodepth",
        "auto",
        "best fixed",
        "best",
        "auto/best",
        "CPU/request auto (us)",
        "CPU/request best (us)",
        "CPU ratio",
        "IOThreads active (auto)",
        "moves (auto)",
        "within noise",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut numeric = vec![false, false];
    numeric.extend([true; 11]);
    numeric.push(false);
    let mut rows = Vec::new();
    for (cell, m) in &study.merits {
        let Some(auto) = &m.auto else { continue };
        let best_count = m.best_count();
        let cpu_auto = cpu_us_per_io(study, cell, Setup::Auto);
        let cpu_best = m.best_setup().and_then(|s| cpu_us_per_io(study, cell, s));
        let us = |v: Option<f64>| v.map(|v| format!("{v:.1}")).unwrap_or_else(|| NA.into());
        rows.push((
            vec![
                size_label(cell.bs),
                cell.op.to_string(),
                cell.jobs.to_string(),
                cell.iodepth.to_string(),
                mark(Some(fmt_mb(auto.mean)), m.noisy.contains(&Setup::Auto)),
                best_count.map_or_else(|| NA.into(), |k| k.to_string()),
                m.best.map(fmt_mb).unwrap_or_else(|| NA.into()),
                m.auto_vs_best()
                    .map(|r| format!("{r:.2}"))
                    .unwrap_or_else(|| NA.into()),
                us(cpu_auto),
                us(cpu_best),
                match (cpu_auto, cpu_best) {
                    (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
                    _ => NA.into(),
                },
            ],
            false,
        ));
        let (active, moves) = tune_summary(study, cell);
        rows.last_mut().expect("just pushed").0.extend([
            active,
            moves,
            match m.auto_within_noise() {
                Some(true) => "yes".into(),
                Some(false) => "no".into(),
                None => NA.into(),
            },
        ]);
    }
    Table {
        title: "auto against the best fixed IOThread count".into(),
        note: "Throughput (MB/s) of `--iothreads auto` and of the cell's best fixed count \
               (0 = baseline), their ratio, and the server's CPU time per request of each; \
               the IOThreads `auto` had active at the end of its runs (lowest-highest), \
               the queue moves it made during them, and whether its repeats overlap the \
               best count's (yes: the gap is within the noise of this host)."
            .into(),
        header,
        numeric,
        rows,
    }
}

/// The `auto` runs of `cell`: the IOThreads active at their ends ("1", or
/// "1-2" when the runs differ) and the moves made during them, n/a for runs
/// recorded without them.
fn tune_summary(study: &Study, cell: &Cell) -> (String, String) {
    let tunes: Vec<_> = study
        .results
        .runs_of(cell, Setup::Auto)
        .into_iter()
        .filter_map(|r| r.tune.as_ref())
        .collect();
    let (Some(lo), Some(hi)) = (
        tunes.iter().map(|t| t.active_iothreads).min(),
        tunes.iter().map(|t| t.active_iothreads).max(),
    ) else {
        return (NA.into(), NA.into());
    };
    let active = if lo == hi {
        lo.to_string()
    } else {
        format!("{lo}-{hi}")
    };
    let moves: u64 = tunes.iter().flat_map(|t| t.moves.values()).sum();
    (active, moves.to_string())
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
    if study.setups().contains(&Setup::Auto) {
        v.push(auto_table(study));
    }
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

//! The study: a results file with its figures of merit computed, the shape every
//! renderer (report tables, HTML page, recommendation) reads.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use anyhow::bail;
use clap::Args;

use crate::matrix::{Cell, Op, Setup};
use crate::merit::{all_merits, total, CellMerit, Options, TotalMerit};
use crate::results::Results;

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
        if self.merits.values().any(|m| m.auto.is_some()) {
            v.push(Setup::Auto);
        }
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

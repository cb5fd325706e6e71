//! The workload matrix of a sweep: operations x block sizes x jobs x iodepths, run
//! at each IOThread count. `seeds` is the seeds' full matrix, `quick` a subset that
//! finishes in minutes on a 2-core machine, and a TOML file can give any other.

use std::fmt;
use std::str::FromStr;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use vqblk_daemon::size::{parse_size, size_label};

/// An fio `rw` mode the study measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Random reads (the seeds sort their rows alphabetically: randread first).
    Randread,
    /// Random writes.
    Randwrite,
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
}

impl Op {
    /// All four, in the seeds' row order.
    pub const ALL: [Op; 4] = [Op::Randread, Op::Randwrite, Op::Read, Op::Write];

    /// fio's name.
    pub fn name(self) -> &'static str {
        match self {
            Op::Randread => "randread",
            Op::Randwrite => "randwrite",
            Op::Read => "read",
            Op::Write => "write",
        }
    }

    /// Whether the operation modifies the storage.
    pub fn writes(self) -> bool {
        matches!(self, Op::Randwrite | Op::Write)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Op {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Op> {
        Op::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .with_context(|| format!("unknown operation {s:?} (read, write, randread, randwrite)"))
    }
}

/// One workload: what fio runs against the disk (independent of the IOThread count).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Cell {
    /// Block size in bytes.
    pub bs: u64,
    /// Operation.
    pub op: Op,
    /// fio `numjobs` (one virtqueue each).
    pub jobs: u32,
    /// fio `iodepth` per job.
    pub iodepth: u32,
}

impl fmt::Display for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} jobs={} iodepth={}",
            self.op,
            size_label(self.bs),
            self.jobs,
            self.iodepth
        )
    }
}

/// The least warm-up of an `auto` run, seconds: the tuner samples about once a
/// second and moves a queue after a few samples agree (docs/autotune.md), so
/// a shorter ramp would measure it before it has seen the cell's load.
pub const AUTO_RAMP_S: f64 = 4.0;

/// The least warm-up of the discarded run of `auto` that opens each cell,
/// seconds: long enough for a probe (docs/autotune.md) to be confirmed (2
/// ticks), made, settled (2 s), judged (1-2 ticks) and, when it does not pay,
/// undone and settled again, so that a cell's measured runs see the placement
/// the tuner settles on, not its try (a probe that fell into a 1 s measured
/// run cost it up to 1.9x the CPU per request). The tuner keeps its verdict
/// for the measured runs that follow (the server and its controller live
/// through the sweep).
pub const AUTO_WARMUP_RAMP_S: f64 = 8.0;

/// What serves the disk in one column of the study.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Setup {
    /// The workload run directly on the storage, no virtualization (the seeds' "pod").
    Native,
    /// The classic single-threaded model (the seeds' "0 IOThreads").
    Baseline,
    /// vqblk with this many IOThreads.
    IoThreads(u32),
    /// vqblk with `--iothreads auto`: the pool and the queue placement tuned
    /// online (docs/autotune.md).
    Auto,
}

impl Setup {
    /// The IOThread count as the seeds' tables write it (baseline = 0; native has none).
    pub fn count(self) -> Option<u32> {
        match self {
            Setup::Native => None,
            Setup::Baseline => Some(0),
            Setup::IoThreads(k) => Some(k),
            Setup::Auto => None,
        }
    }

    /// Short label: `native`, `baseline`, `iothreads=K`, `auto`.
    pub fn label(self) -> String {
        match self {
            Setup::Native => "native".into(),
            Setup::Baseline => "baseline".into(),
            Setup::IoThreads(k) => format!("iothreads={k}"),
            Setup::Auto => "auto".into(),
        }
    }
}

impl Serialize for Setup {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.label())
    }
}

impl fmt::Display for Setup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// The matrix: every combination of these values is one [`Cell`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Matrix {
    /// Operations.
    pub ops: Vec<Op>,
    /// Block sizes in bytes.
    pub sizes: Vec<u64>,
    /// Job counts.
    pub jobs: Vec<u32>,
    /// I/O depths.
    pub iodepth: Vec<u32>,
    /// IOThread counts measured (besides the baseline).
    pub iothreads: Vec<u32>,
    /// Whether the baseline is measured.
    pub baseline: bool,
    /// Whether `--iothreads auto` is measured beside the fixed counts.
    pub auto: bool,
    /// Default measured time per run, seconds.
    pub runtime_s: f64,
    /// Default warm-up time per run (fio ramp_time), seconds.
    pub ramp_s: f64,
}

/// The matrix TOML file (`--matrix FILE.toml`): the same keys as the presets.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct MatrixFile {
    ops: Option<Vec<String>>,
    sizes: Option<Vec<toml::Value>>,
    jobs: Option<Vec<u32>>,
    iodepth: Option<Vec<u32>>,
    iothreads: Option<Vec<toml::Value>>,
    runtime: Option<toml::Value>,
    ramp_time: Option<toml::Value>,
}

impl Matrix {
    /// The seeds' matrix: 4 ops x 2k/4k/32k/1m x jobs 1/4/16 x iodepth 1/4/16 x
    /// IOThreads baseline, 1, 2, 3, 4, 6, 8, 12, 16, auto. 30 s runs, 5 s warm-up.
    pub fn seeds() -> Matrix {
        Matrix {
            ops: Op::ALL.to_vec(),
            sizes: vec![2048, 4096, 32768, 1 << 20],
            jobs: vec![1, 4, 16],
            iodepth: vec![1, 4, 16],
            iothreads: vec![1, 2, 3, 4, 6, 8, 12, 16],
            baseline: true,
            auto: true,
            runtime_s: 30.0,
            ramp_s: 5.0,
        }
    }

    /// A subset for a 2-core machine: randread, randwrite x 4k, 1m x jobs 1, 4 x
    /// iodepth 1, 16 x IOThreads baseline, 1, 2, 4, auto; 1 s runs after 0.25 s
    /// ramp (auto's ramp is longer: [`AUTO_RAMP_S`]).
    pub fn quick() -> Matrix {
        Matrix {
            ops: vec![Op::Randread, Op::Randwrite],
            sizes: vec![4096, 1 << 20],
            jobs: vec![1, 4],
            iodepth: vec![1, 16],
            iothreads: vec![1, 2, 4],
            baseline: true,
            auto: true,
            runtime_s: 1.0,
            ramp_s: 0.25,
        }
    }

    /// `seeds`, `quick`, or a TOML file path.
    pub fn load(spec: &str) -> anyhow::Result<Matrix> {
        match spec {
            "seeds" => Ok(Matrix::seeds()),
            "quick" => Ok(Matrix::quick()),
            path => {
                let text = std::fs::read_to_string(path).with_context(|| {
                    format!("--matrix {path}: not `seeds`, `quick` or a readable TOML file")
                })?;
                Matrix::from_toml(&text).with_context(|| format!("--matrix {path}"))
            }
        }
    }

    /// Parses a matrix file. Missing keys take the `seeds` values. `iothreads` lists
    /// counts and optionally `"baseline"` and `"auto"`:
    /// `iothreads = ["baseline", 1, 2, 4, "auto"]`.
    pub fn from_toml(text: &str) -> anyhow::Result<Matrix> {
        let f: MatrixFile = toml::from_str(text)?;
        let mut m = Matrix::seeds();
        if let Some(ops) = f.ops {
            m.ops = ops
                .iter()
                .map(|s| s.parse())
                .collect::<anyhow::Result<_>>()?;
        }
        if let Some(sizes) = f.sizes {
            m.sizes = sizes
                .iter()
                .map(|v| match v {
                    toml::Value::Integer(n) if *n > 0 => Ok(*n as u64),
                    toml::Value::String(s) => Ok(parse_size(s)?),
                    other => bail!("sizes: {other} is not a size (4096 or \"4k\")"),
                })
                .collect::<anyhow::Result<_>>()?;
        }
        if let Some(j) = f.jobs {
            m.jobs = j;
        }
        if let Some(d) = f.iodepth {
            m.iodepth = d;
        }
        if let Some(list) = f.iothreads {
            m.baseline = false;
            m.auto = false;
            m.iothreads.clear();
            for v in list {
                match v {
                    toml::Value::String(s) if s == "baseline" => m.baseline = true,
                    toml::Value::String(s) if s == "auto" => m.auto = true,
                    toml::Value::Integer(n) if n > 0 => m.iothreads.push(n as u32),
                    other => bail!(
                        "iothreads: {other} is neither \"baseline\", \"auto\" nor a count > 0"
                    ),
                }
            }
        }
        if let Some(v) = f.runtime {
            m.runtime_s = toml_duration(&v).context("runtime")?;
        }
        if let Some(v) = f.ramp_time {
            m.ramp_s = toml_duration(&v).context("ramp-time")?;
        }
        m.normalize()?;
        Ok(m)
    }

    /// Sorts and deduplicates every axis; rejects empty axes and zero values.
    pub fn normalize(&mut self) -> anyhow::Result<()> {
        fn tidy<T: Ord>(v: &mut Vec<T>) {
            v.sort();
            v.dedup();
        }
        tidy(&mut self.ops);
        tidy(&mut self.sizes);
        tidy(&mut self.jobs);
        tidy(&mut self.iodepth);
        tidy(&mut self.iothreads);
        if self.ops.is_empty()
            || self.sizes.is_empty()
            || self.jobs.is_empty()
            || self.iodepth.is_empty()
        {
            bail!("ops, sizes, jobs and iodepth must each list at least one value");
        }
        if self.iothreads.is_empty() && !self.baseline && !self.auto {
            bail!("iothreads: lists nothing to measure");
        }
        if self.sizes.iter().any(|&s| s == 0 || s % 512 != 0) {
            bail!("sizes: every block size must be a non-zero multiple of 512");
        }
        if self.jobs.contains(&0) || self.iodepth.contains(&0) {
            bail!("jobs and iodepth must be > 0");
        }
        Ok(())
    }

    /// Every cell, sorted (size, op, jobs, iodepth): the seeds' table order.
    pub fn cells(&self) -> Vec<Cell> {
        let mut v = Vec::new();
        for &bs in &self.sizes {
            for &op in &self.ops {
                for &jobs in &self.jobs {
                    for &iodepth in &self.iodepth {
                        v.push(Cell {
                            bs,
                            op,
                            jobs,
                            iodepth,
                        });
                    }
                }
            }
        }
        v
    }

    /// Virtqueues per disk: the largest job count (each job thread drives one queue).
    pub fn queues(&self) -> u32 {
        self.jobs.iter().copied().max().unwrap_or(1)
    }
}

/// `10`, `10s`, `500ms`, `2m` -> seconds.
pub fn parse_duration(s: &str) -> anyhow::Result<f64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let n: f64 = t[..split]
        .parse()
        .with_context(|| format!("{s:?} is not a duration (10, 10s, 500ms, 2m)"))?;
    let mult = match &t[split..] {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "us" => 1e-6,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => bail!("{s:?} is not a duration (10, 10s, 500ms, 2m)"),
    };
    if !(n * mult).is_finite() || n < 0.0 {
        bail!("{s:?} is not a duration (10, 10s, 500ms, 2m)");
    }
    Ok(n * mult)
}

fn toml_duration(v: &toml::Value) -> anyhow::Result<f64> {
    match v {
        toml::Value::Integer(n) if *n >= 0 => Ok(*n as f64),
        toml::Value::Float(x) if *x >= 0.0 => Ok(*x),
        toml::Value::String(s) => parse_duration(s),
        other => bail!("{other} is not a duration"),
    }
}

/// Seconds -> fio's spelling in milliseconds (`1250ms`).
pub fn fio_duration(secs: f64) -> String {
    format!("{}ms", (secs * 1000.0).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_seeds_shape() {
        let s = Matrix::seeds();
        assert_eq!(s.cells().len(), 4 * 4 * 3 * 3);
        assert_eq!(s.iothreads, vec![1, 2, 3, 4, 6, 8, 12, 16]);
        assert_eq!(s.queues(), 16);
        let q = Matrix::quick();
        assert_eq!(q.cells().len(), 16);
        assert_eq!(q.queues(), 4);
        assert!(
            q.cells().windows(2).all(|w| w[0] < w[1]),
            "cells come sorted"
        );
    }

    #[test]
    fn toml_overrides_and_defaults() {
        let m = Matrix::from_toml(
            "ops = [\"write\", \"randread\"]\nsizes = [\"4k\", 1048576, \"4k\"]\njobs = [1]\n\
             iodepth = [16, 1]\niothreads = [\"baseline\", 2, 1]\nruntime = \"500ms\"\nramp-time = 0\n",
        )
        .unwrap();
        assert_eq!(m.ops, vec![Op::Randread, Op::Write]);
        assert_eq!(m.sizes, vec![4096, 1 << 20]);
        assert_eq!(m.iodepth, vec![1, 16]);
        assert_eq!(m.iothreads, vec![1, 2]);
        assert!(m.baseline);
        assert_eq!(m.runtime_s, 0.5);
        assert_eq!(m.ramp_s, 0.0);
        assert!(!m.auto, "a list without \"auto\" does not measure it");
        let d = Matrix::from_toml("iothreads = [4]").unwrap();
        assert!(!d.baseline);
        assert_eq!(d.sizes, Matrix::seeds().sizes);
        let a = Matrix::from_toml("iothreads = [\"auto\"]").unwrap();
        assert!(a.auto && a.iothreads.is_empty() && !a.baseline);
        assert_eq!(a.cells().len(), Matrix::seeds().cells().len());
        assert_eq!(Setup::Auto.label(), "auto");
        assert_eq!(Setup::Auto.count(), None);
    }

    #[test]
    fn toml_errors_name_the_key() {
        let e = |t: &str| format!("{:#}", Matrix::from_toml(t).unwrap_err());
        assert!(e("ops = [\"trim\"]").contains("trim"));
        assert!(e("sizes = [\"3x\"]").contains("3x"));
        assert!(e("sizes = [1000]").contains("512"));
        assert!(e("iothreads = [0]").contains("iothreads"));
        assert!(e("iothreads = [\"autom\"]").contains("\"auto\""));
        assert!(e("iothreads = []").contains("nothing"));
        assert!(e("colour = 1").contains("colour"));
    }

    #[test]
    fn sizes_use_the_daemons_fio_grammar_and_durations() {
        // The one size grammar of vqblk (vqblk_daemon::size): fio's suffixes.
        let m = Matrix::from_toml("sizes = [\"4KiB\", \"1m\", \"512b\", \"2kb\"]").unwrap();
        assert_eq!(m.sizes, vec![512, 2048, 4096, 1 << 20]);
        let labels: Vec<String> = m.sizes.iter().map(|&b| size_label(b)).collect();
        assert_eq!(labels, ["512", "2k", "4k", "1m"]);
        assert_eq!(parse_duration("2m").unwrap(), 120.0);
        assert_eq!(parse_duration("250ms").unwrap(), 0.25);
        assert_eq!(parse_duration("1.5").unwrap(), 1.5);
        assert!(parse_duration("x").is_err());
        assert_eq!(fio_duration(1.25), "1250ms");
    }
}

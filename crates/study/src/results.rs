//! The results file: JSON Lines, one record per line, appended as the sweep goes
//! (so an interrupted sweep keeps what it measured and can resume).
//!
//! Records (`"type"`): `header` (once per sweep invocation: commands, host, storage,
//! matrix), `server` (a server started: its exact argv), `run` (one measured run),
//! `skip` (a column or cell not measured, with the reason), `error` (a run failed).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::matrix::{Cell, Matrix, Setup};

/// Version of the record layout.
pub const FORMAT: u32 = 1;

/// The machine the sweep ran on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Host {
    /// CPUs the process may use.
    pub nproc: u32,
    /// `/proc/cpuinfo` model name.
    pub cpu_model: String,
    /// Kernel release.
    pub kernel: String,
    /// Host name.
    pub hostname: String,
}

/// What was measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Storage {
    /// `null`, `image`, `device` or `rbd`.
    pub kind: String,
    /// Image or device path, `rbd:POOL/IMAGE` for rbd (none for null).
    pub path: Option<PathBuf>,
    /// Capacity in bytes.
    pub bytes: u64,
    /// The null backend's completion delay (`--latency-ns`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ns: Option<u64>,
}

impl Storage {
    /// One line for a report.
    pub fn describe(&self) -> String {
        match (&self.path, self.latency_ns) {
            (Some(p), _) => format!(
                "{} {} ({} bytes, O_DIRECT)",
                self.kind,
                p.display(),
                self.bytes
            ),
            (None, Some(ns)) => format!(
                "{} backend, {} bytes, every request completed after {ns} ns (a device's latency, no device's limits)",
                self.kind, self.bytes
            ),
            (None, None) => format!(
                "{} backend, {} bytes (no device: measures the software path only)",
                self.kind, self.bytes
            ),
        }
    }
}

/// First record of every sweep invocation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// [`FORMAT`].
    pub format: u32,
    /// `vqblk --version` of the binary that ran.
    pub vqblk_version: String,
    /// UTC start time (RFC 3339).
    pub started: String,
    /// The `vqblk sweep` command line.
    pub argv: Vec<String>,
    /// Host facts.
    pub host: Host,
    /// Storage measured.
    pub storage: Storage,
    /// `vqblk` (serve --iothreads 1 --poll off) or `qemu-storage-daemon`.
    pub baseline: String,
    /// The matrix.
    pub matrix: Matrix,
    /// Virtqueues per disk.
    pub queues: u32,
    /// Measured time per run, seconds.
    pub runtime_s: f64,
    /// fio ramp_time per run, seconds.
    pub ramp_s: f64,
    /// Discarded warm-up runs per cell and setup.
    pub warmups: u32,
    /// Measured runs per cell and setup (averaged).
    pub repeats: u32,
    /// The rule deciding which IOThread counts are skipped.
    pub skip_rule: String,
    /// Command templates: `serve`, `baseline`, `bench`, `native`.
    pub commands: BTreeMap<String, String>,
}

/// A server process started for one column.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Server {
    /// `baseline` or `iothreads=K`.
    pub setup: String,
    /// IOThread count (0 = baseline).
    pub iothreads: u32,
    /// Exact command line.
    pub argv: Vec<String>,
    /// Process id.
    pub pid: u32,
}

/// One measured run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Run {
    /// The workload.
    pub cell: Cell,
    /// `native`, `baseline` or `iothreads=K`.
    pub setup: String,
    /// IOThread count: 0 = baseline, none = native.
    pub iothreads: Option<u32>,
    /// 1-based index among the measured runs of this cell and setup.
    pub run: u32,
    /// I/O operations per second.
    pub iops: f64,
    /// Bytes per second.
    pub bw_bytes: f64,
    /// Throughput in MB/s (10^6 bytes), the seeds' unit.
    pub mb_s: f64,
    /// Median completion latency, microseconds.
    pub p50_us: Option<f64>,
    /// 99th percentile completion latency, microseconds.
    pub p99_us: Option<f64>,
    /// Server CPU time over the run, seconds (none for native).
    pub server_cpu_s: Option<f64>,
    /// Server CPU as a percentage of one CPU over the run.
    pub server_cpu_pct: Option<f64>,
    /// Measured seconds.
    pub elapsed_s: f64,
    /// UTC time the run ended.
    pub time: String,
    /// Exact `vqblk bench` command line.
    pub argv: Vec<String>,
    /// CPU seconds of each server thread over the run, by thread name (threads
    /// of one name summed; those that used no CPU left out): which of vqblk's
    /// IOThreads (`vqblk-iotN`) served it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub server_threads: BTreeMap<String, f64>,
    /// Seconds each server thread was runnable but waited for a CPU over the
    /// run, by thread name (those that waited at all): a thread that served
    /// slowly on little CPU slept if this is small, was crowded out if not.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub server_threads_wait: BTreeMap<String, f64>,
    /// The CPU each server thread last ran on when the run ended, by thread
    /// name: where the scheduler put an unpinned IOThread (on this VM, CPU 1
    /// takes the disk's interrupts).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub server_threads_cpu: BTreeMap<String, u32>,
    /// The `auto` column: what its controller did during the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tune: Option<TuneDuring>,
    /// vqblk's columns: what its IOThreads counted during the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iothread_counters: Option<IoThreadCounters>,
}

/// The counters of a vqblk server's IOThreads over one run, summed over its
/// IOThreads (the bench's `vqblk.server_iothreads`: the server's stats file
/// before and after the run, `--server-stats`): how its threads waited for
/// work.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IoThreadCounters {
    /// Event-loop passes.
    pub passes: u64,
    /// Sleeps ended by a backend's completion.
    pub completion_wakeups: u64,
    /// Sleeps ended by a guest's kick.
    pub kick_wakeups: u64,
    /// Adaptive polling's timed naps.
    pub naps: u64,
    /// Polling windows that caught their event.
    pub poll_hits: u64,
    /// Adaptive polling's trials of sleeping until each event that gave a
    /// verdict.
    #[serde(default)]
    pub poll_trials: u64,
    /// Of those, the ones sleeping won.
    #[serde(default)]
    pub poll_trials_slept: u64,
    /// The largest nap lateness measured by an IOThread that served requests
    /// during the run (the price of a sleep its policy weighs), at its end.
    pub nap_late_ns: u64,
}

/// What `--iothreads auto`'s controller did during one run, from the
/// daemon's `query-tune` and `query-iothreads` before and after it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TuneDuring {
    /// Queue moves made during the run, by reason.
    pub moves: BTreeMap<String, u64>,
    /// Moves that failed during the run.
    pub failed_moves: u64,
    /// IOThreads active at the end of the run.
    pub active_iothreads: u32,
}

impl Run {
    /// The column this run belongs to.
    pub fn setup(&self) -> Setup {
        setup_of(&self.setup, self.iothreads)
    }
}

/// A column or cell that was not measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Skip {
    /// `native`, `baseline` or `iothreads=K`.
    pub setup: String,
    /// IOThread count, if any.
    pub iothreads: Option<u32>,
    /// Why.
    pub reason: String,
}

/// A run that failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunError {
    /// The workload.
    pub cell: Cell,
    /// The column.
    pub setup: String,
    /// IOThread count, if any.
    pub iothreads: Option<u32>,
    /// What happened.
    pub message: String,
}

/// One line of the results file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Record {
    /// See [`Header`].
    Header(Box<Header>),
    /// See [`Server`].
    Server(Server),
    /// See [`Run`].
    Run(Box<Run>),
    /// See [`Skip`].
    Skip(Skip),
    /// See [`RunError`].
    Error(RunError),
}

/// The setup named by a record's `setup` label and `iothreads` field.
pub fn setup_of(label: &str, iothreads: Option<u32>) -> Setup {
    match (label, iothreads) {
        ("auto", _) => Setup::Auto,
        ("native", _) | (_, None) => Setup::Native,
        ("baseline", _) | (_, Some(0)) => Setup::Baseline,
        (_, Some(k)) => Setup::IoThreads(k),
    }
}

/// Everything in a results file.
#[derive(Debug, Clone, Default)]
pub struct Results {
    /// Headers, in file order (one per sweep invocation; the first describes the study).
    pub headers: Vec<Header>,
    /// Servers started.
    pub servers: Vec<Server>,
    /// Measured runs.
    pub runs: Vec<Run>,
    /// Skipped columns, deduplicated by (setup, reason).
    pub skips: Vec<Skip>,
    /// Failed runs.
    pub errors: Vec<RunError>,
}

impl Results {
    /// Reads a results file. A torn last line (a sweep killed mid-write) is ignored;
    /// any other bad line is an error naming its line number.
    pub fn read(path: &Path) -> anyhow::Result<Results> {
        let f = File::open(path).with_context(|| format!("{}", path.display()))?;
        let lines: Vec<String> = BufReader::new(f)
            .lines()
            .collect::<Result<_, _>>()
            .with_context(|| format!("{}", path.display()))?;
        Results::parse_lines(&lines).with_context(|| format!("{}", path.display()))
    }

    /// Parses JSON Lines text.
    pub fn parse(text: &str) -> anyhow::Result<Results> {
        let lines: Vec<String> = text.lines().map(str::to_string).collect();
        Results::parse_lines(&lines)
    }

    fn parse_lines(lines: &[String]) -> anyhow::Result<Results> {
        let mut r = Results::default();
        let last = lines.iter().rposition(|l| !l.trim().is_empty());
        for (i, line) in lines.iter().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let rec: Record = match serde_json::from_str(line) {
                Ok(rec) => rec,
                Err(_) if Some(i) == last && !line.trim_end().ends_with('}') => continue,
                Err(e) => return Err(e).with_context(|| format!("line {}", i + 1)),
            };
            r.push(rec);
        }
        Ok(r)
    }

    /// Adds one record.
    pub fn push(&mut self, rec: Record) {
        match rec {
            Record::Header(h) => self.headers.push(*h),
            Record::Server(s) => self.servers.push(s),
            Record::Run(run) => self.runs.push(*run),
            Record::Skip(s) => {
                if !self
                    .skips
                    .iter()
                    .any(|o| o.setup == s.setup && o.reason == s.reason)
                {
                    self.skips.push(s)
                }
            }
            Record::Error(e) => self.errors.push(e),
        }
    }

    /// The header describing the study (the first one).
    pub fn header(&self) -> Option<&Header> {
        self.headers.first()
    }

    /// Measured MB/s per cell and setup, one value per run index (a run measured
    /// twice, e.g. by a resumed sweep, keeps its latest value).
    pub fn throughput(&self) -> BTreeMap<Cell, BTreeMap<Setup, Vec<f64>>> {
        let mut by: BTreeMap<Cell, BTreeMap<Setup, BTreeMap<u32, f64>>> = BTreeMap::new();
        for r in &self.runs {
            by.entry(r.cell)
                .or_default()
                .entry(r.setup())
                .or_default()
                .insert(r.run, r.mb_s);
        }
        by.into_iter()
            .map(|(c, m)| {
                (
                    c,
                    m.into_iter()
                        .map(|(s, runs)| (s, runs.into_values().collect()))
                        .collect(),
                )
            })
            .collect()
    }

    /// Runs of one cell and setup.
    pub fn runs_of(&self, cell: &Cell, setup: Setup) -> Vec<&Run> {
        self.runs
            .iter()
            .filter(|r| &r.cell == cell && r.setup() == setup)
            .collect()
    }

    /// Measured run indexes of (cell, setup): what a resumed sweep skips.
    pub fn done(&self) -> BTreeMap<(Cell, Setup), BTreeSet<u32>> {
        let mut m: BTreeMap<(Cell, Setup), BTreeSet<u32>> = BTreeMap::new();
        for r in &self.runs {
            m.entry((r.cell, r.setup())).or_default().insert(r.run);
        }
        m
    }

    /// Every setup that appears in the runs, sorted (native, baseline, 1, 2, ...).
    pub fn setups(&self) -> Vec<Setup> {
        let s: BTreeSet<Setup> = self.runs.iter().map(Run::setup).collect();
        s.into_iter().collect()
    }
}

/// Appends records to the results file, one line each, flushed at once.
pub struct Writer {
    file: File,
}

impl Writer {
    /// Opens (creating) the file for appending.
    pub fn open(path: &Path) -> anyhow::Result<Writer> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("--results {}", path.display()))?;
        Ok(Writer { file })
    }

    /// Writes one record as one line (a single write, so a kill leaves at most a torn
    /// last line).
    pub fn write(&mut self, rec: &Record) -> anyhow::Result<()> {
        let mut line = serde_json::to_string(rec)?;
        line.push('\n');
        self.file.write_all(line.as_bytes())?;
        self.file.sync_data().ok();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matrix::Op;

    fn run(setup: &str, k: Option<u32>, idx: u32, mb: f64) -> Record {
        Record::Run(Box::new(Run {
            cell: Cell {
                bs: 4096,
                op: Op::Randread,
                jobs: 1,
                iodepth: 1,
            },
            setup: setup.into(),
            iothreads: k,
            run: idx,
            iops: mb * 1e6 / 4096.0,
            bw_bytes: mb * 1e6,
            mb_s: mb,
            p50_us: Some(10.0),
            p99_us: None,
            server_cpu_s: None,
            server_cpu_pct: None,
            elapsed_s: 1.0,
            time: "2026-01-01T00:00:00Z".into(),
            server_threads: Default::default(),
            server_threads_wait: Default::default(),
            server_threads_cpu: Default::default(),
            tune: None,
            iothread_counters: None,
            argv: vec![],
        }))
    }

    #[test]
    fn round_trip_and_grouping() {
        let recs = [
            run("baseline", Some(0), 1, 10.0),
            run("iothreads=2", Some(2), 1, 20.0),
            run("iothreads=2", Some(2), 2, 22.0),
            run("native", None, 1, 30.0),
            run("iothreads=2", Some(2), 2, 24.0),
        ];
        let text: String = recs
            .iter()
            .map(|r| serde_json::to_string(r).unwrap() + "\n")
            .collect();
        assert!(text.contains("\"type\":\"run\""));
        let r = Results::parse(&text).unwrap();
        assert_eq!(r.runs.len(), 5);
        let t = r.throughput();
        let c = t.values().next().unwrap();
        assert_eq!(c[&Setup::Baseline], vec![10.0]);
        assert_eq!(
            c[&Setup::IoThreads(2)],
            vec![20.0, 24.0],
            "a re-measured run keeps its latest value"
        );
        assert_eq!(c[&Setup::Native], vec![30.0]);
        assert_eq!(
            r.setups(),
            vec![Setup::Native, Setup::Baseline, Setup::IoThreads(2)]
        );
    }

    #[test]
    fn torn_last_line_is_ignored_but_not_a_bad_middle_line() {
        let good = serde_json::to_string(&run("baseline", Some(0), 1, 10.0)).unwrap();
        let torn = format!("{good}\n{}", &good[..20]);
        assert_eq!(Results::parse(&torn).unwrap().runs.len(), 1);
        let bad = format!("{}\n{good}\n", &good[..20]);
        assert!(format!("{:#}", Results::parse(&bad).unwrap_err()).contains("line 1"));
    }
}

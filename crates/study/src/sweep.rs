//! `vqblk sweep`: runs the matrix at every IOThread count and appends each measured
//! run to a JSON Lines file.
//!
//! For each column (native, baseline, each IOThread count, auto) one server is
//! started (`vqblk serve`, or qemu-storage-daemon for `--baseline
//! qemu-storage-daemon`) with as many virtqueues as the largest job count, on its own
//! socket, and all of them run for the whole sweep. Every cell runs against each with
//! `vqblk bench`: `warmups` discarded runs, then `repeats` measured ones, the columns
//! interleaved within the cell (repeat by repeat, in a rotating order) so that a
//! host that drifts over the sweep weighs on every column alike. Both processes are
//! the running executable itself, so the sweep measures exactly what users run
//! (`--vqblk PATH` names another one). Native runs `vqblk bench` on the image or
//! device directly.
//!
//! - [`plan`] decides everything before anything runs: storage, columns, command lines;
//! - `runner` measures the plan, resumable, and appends every run to the results;
//! - [`measure`] reads what one bench run measured; [`host`] holds the machine's facts.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use vqblk_daemon::poll::PollMode;

pub mod host;
pub mod measure;
pub mod plan;
mod process;
mod progress;
mod runner;

pub use host::{hms, host_info, rfc3339, utc_now};
pub use measure::{parse_bench_json, Measured};
pub use plan::{iothread_columns, shell_join, Plan, Target};

/// What serves the baseline column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BaselineKind {
    /// `vqblk serve --iothreads 1 --poll off`: the classic single-threaded model.
    Vqblk,
    /// The real qemu-storage-daemon: one export, one IOThread, io_uring.
    QemuStorageDaemon,
}

/// Options of `vqblk sweep`.
#[derive(Debug, Clone, Args)]
pub struct SweepArgs {
    /// Raw image file to measure, opened with O_DIRECT (cache none), or an RBD
    /// image `rbd:POOL/IMAGE` on the cluster `$CEPH_CONF` names (served by the
    /// rbd backend, qsd's rbd driver; native is librbd). Write cells overwrite
    /// data inside the image (never beyond its size).
    #[arg(long, value_name = "PATH", conflicts_with_all = ["device", "backend"])]
    pub image: Option<PathBuf>,
    /// With --image: create the image with this size if it does not exist, filled with
    /// data (not sparse: reading holes would never reach the device).
    #[arg(long, value_name = "SIZE", requires = "image")]
    pub create: Option<String>,
    /// Block device to measure (O_DIRECT). Write cells destroy its data: --force required.
    #[arg(long, value_name = "PATH", conflicts_with = "backend")]
    pub device: Option<PathBuf>,
    /// `null`: no storage at all, measures the software path only (no native column).
    #[arg(long, value_parser = ["null"])]
    pub backend: Option<String>,
    /// Size of the null device.
    #[arg(long, default_value = "1G")]
    pub size: String,
    /// With `--backend null`: complete every request this many nanoseconds
    /// after it arrives (a device's latency without a device's limits; qsd's
    /// null-co `latency-ns`).
    #[arg(long, value_name = "NS", requires = "backend")]
    pub latency_ns: Option<u64>,
    /// `seeds` (the seeds' full matrix), `quick` (minutes on 2 cores) or a TOML file
    /// with keys ops, sizes, jobs, iodepth, iothreads, runtime, ramp-time.
    #[arg(long, default_value = "quick")]
    pub matrix: String,
    /// Measured time per run (default: the matrix's; seeds 30s, quick 1s).
    #[arg(long)]
    pub runtime: Option<String>,
    /// fio ramp_time of every run: I/O not counted (default: the matrix's).
    #[arg(long = "ramp-time")]
    pub ramp_time: Option<String>,
    /// Measured runs per cell and column, averaged.
    #[arg(long, default_value_t = 2)]
    pub repeats: u32,
    /// Discarded warm-up runs per cell and column before the measured ones.
    #[arg(long, default_value_t = 1)]
    pub warmups: u32,
    /// JSON Lines results file, appended to after every measured run. An existing
    /// file resumes the sweep: runs already in it are not measured again.
    #[arg(long, value_name = "FILE")]
    pub results: PathBuf,
    /// What the baseline column runs.
    #[arg(long, value_enum, default_value = "vqblk")]
    pub baseline: BaselineKind,
    /// `--poll` of the IOThread columns (default: the daemon's default).
    #[arg(long, value_enum)]
    pub poll: Option<PollMode>,
    /// Largest IOThread count measured; larger ones are skipped with a note.
    /// Default: twice the CPUs available.
    #[arg(long)]
    pub max_iothreads: Option<u32>,
    /// Do not measure the native column.
    #[arg(long)]
    pub no_native: bool,
    /// Allow write cells on a block device.
    #[arg(long)]
    pub force: bool,
    /// Print the plan (columns, skips, commands, run count) and exit.
    #[arg(long)]
    pub dry_run: bool,
    /// The `vqblk` executable that serves and benches (default: the running one,
    /// so the sweep measures exactly what users run).
    #[arg(long = "vqblk", value_name = "PATH")]
    pub vqblk: Option<PathBuf>,
}

impl SweepArgs {
    /// The `vqblk` executable: `--vqblk`, else the running executable.
    pub fn vqblk_exe(&self) -> anyhow::Result<PathBuf> {
        match &self.vqblk {
            Some(p) => Ok(p.clone()),
            None => std::env::current_exe().context("cannot locate the vqblk executable"),
        }
    }
}

/// `vqblk sweep`: returns the exit code (0 done, 1 some runs failed for good).
pub fn run(args: SweepArgs) -> anyhow::Result<i32> {
    runner::run(&args)
}

#[cfg(test)]
mod tests;

//! `vqblk sweep`, `vqblk report`, `vqblk recommend`: the IOThread study of the seeds
//! (REFERENCE.md section 5), run against vqblk itself.
//!
//! - [`sweep`] runs the matrix (operation x block size x jobs x iodepth) at every
//!   IOThread count, plus the baseline and native columns, and appends every measured
//!   run to a JSON Lines [`results`] file (resumable);
//! - [`merit`] computes the figures of merit: pure functions, unit-tested;
//! - [`study`] holds a results file with its figures computed; [`tables`] lays them
//!   out like the seeds' tables, which [`report`] renders as Markdown, CSV and JSON
//!   and [`html`] as a page with graphs;
//! - [`recommend`] picks one IOThread count and prints configuration snippets.
//!
//! The workload [`matrix`] is either a preset (`seeds`, `quick`) or a TOML file.

pub mod html;
pub mod matrix;
pub mod merit;
pub mod recommend;
pub mod report;
pub mod results;
pub mod study;
pub mod sweep;
pub mod tables;

pub use recommend::RecommendArgs;
pub use report::ReportArgs;
pub use sweep::SweepArgs;

/// `vqblk sweep`: returns the process exit code (0 done, 1 some runs failed).
pub fn run_sweep(args: SweepArgs) -> anyhow::Result<i32> {
    sweep::run(args)
}

/// `vqblk report`: returns the process exit code.
pub fn run_report(args: ReportArgs) -> anyhow::Result<i32> {
    report::run(args)
}

/// `vqblk recommend`: returns the process exit code.
pub fn run_recommend(args: RecommendArgs) -> anyhow::Result<i32> {
    recommend::run(args)
}

//! What a run measured ([`Report`]): the runner fills it in, [`crate::output`] prints it.
//! Plain data, so the two depend on this module and not on each other.

use std::time::Duration;

use crate::cpu::{CpuTimes, ThreadCpu};
use crate::options::{JobSpec, WaitMode};
use crate::server_stats::IoThreadDelta;
use crate::stats::DirStats;
use crate::verify::Mismatch;

/// Description of one opened target, for the report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TargetInfo {
    /// As given (`unix:/x.sock`).
    pub target: String,
    /// `libblkio virtio-blk-vhost-user` or `io_uring`.
    pub engine: String,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Offsets and lengths must be multiples of this.
    pub request_alignment: u64,
    /// Virtqueue size (vhost-user only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_size: Option<u32>,
    /// Queues used (vhost-user only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_queues: Option<u32>,
    /// Queues the device offers (vhost-user only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_queues: Option<u32>,
    /// Completion wait mode (vhost-user only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait_mode: Option<WaitMode>,
    /// O_DIRECT (native only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub direct: Option<bool>,
}

/// Results of one job clone or one reporting group.
#[derive(Debug, Clone)]
pub struct JobReport {
    /// Job name.
    pub name: String,
    /// fio's group id (always 0: jobs run concurrently).
    pub groupid: u32,
    /// Threads folded into this report.
    pub threads: u32,
    /// The job description (of the first job in a group).
    pub spec: JobSpec,
    /// Read counters.
    pub read: DirStats,
    /// Write counters.
    pub write: DirStats,
    /// Measured time with reads in flight.
    pub read_runtime: Duration,
    /// Measured time with writes in flight.
    pub write_runtime: Duration,
    /// Measured time of the job.
    pub runtime: Duration,
    /// CPU time of the job threads while measured.
    pub cpu: CpuTimes,
    /// First I/O error, if any.
    pub error: Option<String>,
    /// Number of failed requests.
    pub io_errors: u64,
}

impl JobReport {
    /// Folds another thread's report into this group report (fio's
    /// `group_reporting`): counters add up, run times are the longest, the first
    /// error stays.
    pub fn fold(&mut self, other: JobReport) {
        self.threads += other.threads;
        self.read.merge(&other.read);
        self.write.merge(&other.write);
        self.read_runtime = self.read_runtime.max(other.read_runtime);
        self.write_runtime = self.write_runtime.max(other.write_runtime);
        self.runtime = self.runtime.max(other.runtime);
        self.cpu = self.cpu + other.cpu;
        self.io_errors += other.io_errors;
        if self.error.is_none() {
            self.error = other.error;
        }
    }
}

/// Verification results over all jobs.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct VerifySummary {
    /// Blocks read back and checked.
    pub blocks_checked: u64,
    /// Blocks that did not match.
    pub errors: u64,
    /// The first mismatches, by job thread.
    pub mismatches: Vec<Mismatch>,
    /// Seed written into every header of this run.
    pub seed: u64,
}

/// Everything a run measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// Start of the run, seconds since the epoch.
    pub timestamp: u64,
    /// Start of the run, milliseconds since the epoch.
    pub timestamp_ms: u64,
    /// Per clone, or one per group with group reporting.
    pub jobs: Vec<JobReport>,
    /// Wall time of the passes.
    pub elapsed: Duration,
    /// Whole-process CPU time over the passes.
    pub client_cpu: CpuTimes,
    /// The server's CPU time over the passes, or why it could not be read.
    pub server_cpu: Option<Result<CpuTimes, String>>,
    /// `--server-pid`.
    pub server_pid: Option<u32>,
    /// The server's CPU time per thread over the passes (with `--server-pid`).
    pub server_threads: Vec<ThreadCpu>,
    /// A vqblk server's counters per IOThread over the passes (with
    /// `--server-stats`; None if a snapshot could not be taken).
    pub server_iothreads: Option<Vec<IoThreadDelta>>,
    /// Verification results, when verify was asked for.
    pub verify: Option<VerifySummary>,
    /// Targets used.
    pub targets: Vec<TargetInfo>,
    /// Whether jobs were folded into one group.
    pub group_reporting: bool,
}

impl Report {
    /// Measured requests over all jobs.
    pub fn total_ios(&self) -> u64 {
        self.jobs
            .iter()
            .map(|j| j.read.total_ios + j.write.total_ios)
            .sum()
    }

    /// 0 when clean, 1 on verify mismatches or I/O errors (fio returns 1 for both).
    pub fn exit_code(&self) -> i32 {
        let verify_bad = self.verify.as_ref().is_some_and(|v| v.errors > 0);
        let io_bad = self.jobs.iter().any(|j| j.io_errors > 0);
        i32::from(verify_bad || io_bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(ms: u64, error: Option<&str>) -> JobReport {
        let spec =
            JobSpec::from_options("j", &[("target".into(), Some("file:/x".into()))]).unwrap();
        let mut read = DirStats::new();
        read.record(4096, 1, 2);
        JobReport {
            name: "j".into(),
            groupid: 0,
            threads: 1,
            spec,
            read,
            write: DirStats::new(),
            read_runtime: Duration::from_millis(ms),
            write_runtime: Duration::ZERO,
            runtime: Duration::from_millis(ms),
            cpu: CpuTimes {
                user: Duration::from_millis(ms),
                sys: Duration::ZERO,
                ctx: 1,
                sleeps: 1,
            },
            error: error.map(String::from),
            io_errors: u64::from(error.is_some()),
        }
    }

    #[test]
    fn a_group_adds_counters_and_keeps_the_longest_time() {
        let mut g = job(10, None);
        g.fold(job(30, Some("a")));
        g.fold(job(20, Some("b")));
        assert_eq!(g.threads, 3);
        assert_eq!(g.read.total_ios, 3);
        assert_eq!(g.runtime, Duration::from_millis(30));
        assert_eq!(g.cpu.user, Duration::from_millis(60));
        assert_eq!((g.io_errors, g.error.as_deref()), (2, Some("a")));
        assert_eq!(g.cpu.sleeps, 3);
    }

    /// A report of `jobs` with every run-wide field empty.
    fn report(jobs: Vec<JobReport>) -> Report {
        Report {
            timestamp: 0,
            timestamp_ms: 0,
            jobs,
            elapsed: Duration::ZERO,
            client_cpu: CpuTimes::default(),
            server_cpu: None,
            server_pid: None,
            server_threads: Vec::new(),
            server_iothreads: None,
            verify: None,
            targets: Vec::new(),
            group_reporting: false,
        }
    }

    #[test]
    fn the_json_reports_client_sleeps_per_request() {
        let mut b = job(1, None);
        b.name = "k".into();
        b.cpu.sleeps = 4;
        b.read.record(4096, 1, 2);
        let r = report(vec![job(1, None), b]);
        let v = serde_json::to_value(crate::output::to_json(&r)).unwrap();
        let vq = &v["vqblk"];
        // 1 + 4 sleeps over 1 + 2 requests.
        assert_eq!(vq["client_sleeps_per_io"].as_f64(), Some(5.0 / 3.0));
        assert_eq!(vq["jobs"][1]["jobname"], "k");
        assert_eq!(vq["jobs"][1]["client_sleeps"], 4);
        assert_eq!(vq["jobs"][1]["client_sleeps_per_io"].as_f64(), Some(2.0));
    }

    #[test]
    fn exit_code_is_one_on_io_errors() {
        let mut r = report(vec![job(1, None)]);
        assert_eq!((r.exit_code(), r.total_ios()), (0, 1));
        r.jobs.push(job(1, Some("eio")));
        assert_eq!(r.exit_code(), 1);
    }
}

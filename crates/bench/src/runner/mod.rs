//! Runs a [`Plan`]: opens the targets, checks the jobs against them, runs one thread per
//! job clone (each with its own engine) and collects a [`Report`].
//!
//! [`setup`](self) opens devices and starts engines; each pass runs a thread per clone
//! (`pass`), each thread running the request loop of `worker`; `progress` draws
//! fio's status line meanwhile.

mod pass;
mod progress;
mod setup;
mod worker;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::engine::blkio::DESCRIPTORS_PER_REQUEST;
use crate::engine::EngineError;
use crate::job::Prng;
use crate::options::{JobSpec, OutputFormat, VerifyMode};
use crate::report::{JobReport, Report, VerifySummary};

use pass::Totals;
use setup::JobClone;
use worker::{CloneOutcome, Pass};

/// Everything a run needs: the jobs plus run-wide settings.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Job descriptions (each cloned `numjobs` times).
    pub jobs: Vec<JobSpec>,
    /// Output format.
    pub output_format: OutputFormat,
    /// Process whose CPU time is reported as the server's.
    pub server_pid: Option<u32>,
    /// The stats file of that process, a `vqblk serve` (`--server-stats`):
    /// its IOThreads' counters over the measured part of the run.
    pub server_stats: Option<PathBuf>,
    /// With verify: created after the write pass; the read pass starts once it is removed.
    pub verify_pause_file: Option<PathBuf>,
    /// How long to wait for the vhost-user handshake.
    pub connect_timeout: Duration,
    /// Print a progress line on stdout once a second (only when stdout is a terminal).
    pub progress: bool,
}

/// Errors of a run that are the user's to fix (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The engine layer failed to set up.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A job does not fit the device it targets.
    #[error("{0}")]
    Config(String),
    /// The hook between the verify passes failed.
    #[error("between verify passes: {0}")]
    Hook(String),
}

/// Queue size used for vhost-user when the job gives none: libblkio's default (256),
/// raised so that `iodepth` requests fit (three descriptors each).
pub fn auto_queue_size(max_iodepth: u32) -> u32 {
    max_iodepth
        .saturating_mul(DESCRIPTORS_PER_REQUEST)
        .min(32768)
        .next_power_of_two()
        .max(256)
}

/// Runs `plan`. `between_verify_passes` is called after the verify write pass and before
/// the read pass (after the pause file, if any, is removed); tests corrupt data there.
pub fn execute(
    plan: &Plan,
    between_verify_passes: &mut dyn FnMut() -> anyhow::Result<()>,
) -> Result<Report, RunError> {
    let verify = check_jobs(&plan.jobs)?;
    let devices = setup::open_devices(plan)?;
    let clones = setup::plan_clones(plan, &devices)?;
    let (mut engines, targets) = setup::start_engines(plan, &clones, devices)?;

    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let verify_seed = Prng::new(now.as_nanos() as u64 ^ u64::from(std::process::id())).next_u64();
    let passes: &[Pass] = if verify {
        &[Pass::VerifyWrite, Pass::VerifyRead]
    } else {
        &[Pass::Workload]
    };
    let mut outcomes: Vec<CloneOutcome> =
        (0..clones.len()).map(|_| CloneOutcome::default()).collect();
    let mut totals = Totals::new(plan.server_pid, plan.server_stats.is_some());
    for (pi, &pass) in passes.iter().enumerate() {
        if pi > 0 {
            pause_between_passes(plan)?;
            between_verify_passes().map_err(|e| RunError::Hook(format!("{e:#}")))?;
        }
        let pass_out = pass::run_pass(
            plan,
            &clones,
            &mut engines,
            (pass, verify_seed),
            &mut totals,
        )?;
        for (acc, o) in outcomes.iter_mut().zip(pass_out) {
            acc.absorb(o);
        }
    }

    let group = plan.jobs.iter().any(|j| j.group_reporting);
    let (jobs, vsum) = collect(plan, &clones, outcomes, group);
    Ok(Report {
        timestamp: now.as_secs(),
        timestamp_ms: now.as_millis() as u64,
        jobs,
        elapsed: totals.elapsed,
        client_cpu: totals.client_cpu,
        server_cpu: totals.server_cpu,
        server_pid: plan.server_pid,
        server_threads: totals.server_threads,
        server_iothreads: totals.server_iothreads,
        verify: verify.then_some(VerifySummary {
            seed: verify_seed,
            ..vsum
        }),
        targets,
        group_reporting: group,
    })
}

/// Checks the jobs can run together; returns whether the run verifies data.
fn check_jobs(jobs: &[JobSpec]) -> Result<bool, RunError> {
    if jobs.is_empty() {
        return Err(RunError::Config("no job to run".into()));
    }
    let verify = jobs.iter().any(|j| j.verify == VerifyMode::Crc32c);
    if verify && jobs.iter().any(|j| j.verify == VerifyMode::None) {
        return Err(RunError::Config(
            "verify=crc32c jobs cannot run together with jobs without verify".into(),
        ));
    }
    Ok(verify)
}

/// Turns the clones' outcomes into job reports (one per clone, or one for all with
/// `group`) and the verify summary (without its seed).
fn collect(
    plan: &Plan,
    clones: &[JobClone],
    outcomes: Vec<CloneOutcome>,
    group: bool,
) -> (Vec<JobReport>, VerifySummary) {
    let mut jobs: Vec<JobReport> = Vec::new();
    let mut vsum = VerifySummary::default();
    for (cl, o) in clones.iter().zip(outcomes) {
        vsum.blocks_checked += o.checked;
        vsum.errors += o.mismatch_count;
        vsum.mismatches.extend(o.mismatches.iter().cloned());
        let spec = &plan.jobs[cl.job];
        let jr = JobReport {
            name: spec.name.clone(),
            groupid: 0,
            threads: 1,
            spec: spec.clone(),
            read: o.read,
            write: o.write,
            read_runtime: o.read_runtime,
            write_runtime: o.write_runtime,
            runtime: o.runtime,
            cpu: o.cpu,
            error: o.error,
            io_errors: o.io_errors,
        };
        match jobs.first_mut() {
            Some(g) if group => g.fold(jr),
            _ => jobs.push(jr),
        }
    }
    vsum.mismatches.sort_by_key(|m| m.offset);
    (jobs, vsum)
}

/// With `verify_pause_file`: create it, then wait until someone removes it.
fn pause_between_passes(plan: &Plan) -> Result<(), RunError> {
    let Some(p) = &plan.verify_pause_file else {
        return Ok(());
    };
    std::fs::write(
        p,
        b"write pass done; remove this file to start the verify pass\n",
    )
    .map_err(|e| RunError::Hook(format!("create {}: {e}", p.display())))?;
    eprintln!(
        "vqblk bench: write pass done; waiting for {} to be removed",
        p.display()
    );
    let limit = Instant::now() + Duration::from_secs(3600);
    while p.exists() {
        if Instant::now() > limit {
            return Err(RunError::Hook(format!(
                "{} still there after an hour",
                p.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_size_fits_depth() {
        assert_eq!(auto_queue_size(1), 256);
        assert_eq!(auto_queue_size(85), 256);
        assert_eq!(auto_queue_size(86), 512);
        assert_eq!(auto_queue_size(1024), 4096);
        assert_eq!(auto_queue_size(u32::MAX), 32768);
    }

    #[test]
    fn verify_jobs_do_not_mix_with_others() {
        let job = |verify: &str| {
            JobSpec::from_options(
                "j",
                &[
                    ("target".into(), Some("file:/x".into())),
                    ("rw".into(), Some("write".into())),
                    ("verify".into(), Some(verify.into())),
                ],
            )
            .unwrap()
        };
        assert!(check_jobs(&[]).is_err());
        assert!(!check_jobs(&[job("0")]).unwrap());
        assert!(check_jobs(&[job("crc32c"), job("crc32c")]).unwrap());
        assert!(check_jobs(&[job("crc32c"), job("0")]).is_err());
    }
}

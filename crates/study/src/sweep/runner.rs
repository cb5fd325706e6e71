//! Measures a [`Plan`]: resumes from the results file, starts the server of every
//! column at once, and goes through the cells in matrix order; within a cell, every
//! column's warm-ups, then each measured repeat of every column in turn (see
//! [`order`]). A failed run is retried once, and every record is appended as it
//! happens.

use std::collections::{BTreeMap, BTreeSet};
use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::Value;
use vqblk_daemon::control::client::ControlClient;

use super::host::{hms, host_info, utc_now};
use super::measure::{parse_bench_json, Measured, TuneState};
use super::plan::Plan;
use super::process::{run_with_timeout, ServerProc};
use super::progress::Progress;
use super::{BaselineKind, SweepArgs};
use crate::matrix::{Cell, Setup};
use crate::results::{Header, Host, Record, Results, Run, RunError, Server, Skip, Writer, FORMAT};

/// One bench run of the sweep: a cell in a column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Step {
    pub(super) cell: Cell,
    pub(super) setup: Setup,
    /// The measured run's index (1-based); None for a warm-up, which is discarded.
    pub(super) run: Option<u32>,
}

/// The runs still to do, in the order they are done. Cells in matrix order; within
/// a cell, the warm-ups of every column that still misses a run of it, then for
/// each repeat `i` the columns that miss run `i`, starting at the `i`-th column of
/// `setups` and wrapping round. So the columns of a cell are measured side by side
/// and none is always first or last: a host that drifts during the sweep (a disk
/// slowing down, a neighbour's load) weighs on every column alike instead of on
/// those measured after the drift. `done`: the runs already in the results file.
pub(super) fn order(
    cells: &[Cell],
    setups: &[Setup],
    done: &BTreeMap<(Cell, Setup), BTreeSet<u32>>,
    repeats: u32,
    warmups: u32,
) -> Vec<Step> {
    let mut steps = Vec::new();
    for &cell in cells {
        let missing =
            |setup: Setup, run: u32| !done.get(&(cell, setup)).is_some_and(|d| d.contains(&run));
        for &setup in setups {
            if (1..=repeats).any(|i| missing(setup, i)) {
                steps.extend((0..warmups).map(|_| Step {
                    cell,
                    setup,
                    run: None,
                }));
            }
        }
        for i in 1..=repeats {
            let rotated = setups
                .iter()
                .cycle()
                .skip(i as usize - 1)
                .take(setups.len());
            for &setup in rotated {
                if missing(setup, i) {
                    steps.push(Step {
                        cell,
                        setup,
                        run: Some(i),
                    });
                }
            }
        }
    }
    steps
}

/// `vqblk sweep`: see [`super::run`].
pub(super) fn run(args: &SweepArgs) -> anyhow::Result<i32> {
    let host = host_info();
    let plan = Plan::new(args, args.vqblk_exe()?, host.nproc)?;
    let existing = if args.results.exists() {
        Results::read(&args.results)?
    } else {
        Results::default()
    };
    check_resumable(&existing, &plan, &args.results)?;
    let steps = order(
        &plan.matrix.cells(),
        &plan.setups,
        &existing.done(),
        plan.repeats,
        plan.warmups,
    );
    let estimate_s = estimate_s(&plan, &steps);
    announce(&plan, steps.len(), estimate_s, existing.runs.len());
    if args.dry_run {
        for (k, v) in plan.command_templates() {
            println!("{k}: {v}");
        }
        return Ok(0);
    }
    std::fs::create_dir_all(&plan.work_dir)?;
    let mut w = Writer::open(&args.results)?;
    write_header(&mut w, &plan, host, &existing)?;
    let tty = std::io::stderr().is_terminal();
    let per_run_s = estimate_s / steps.len().max(1) as f64;
    let progress = Progress::new(steps.len(), per_run_s, tty);
    let mut sweep = Sweep::new(&plan, w, progress);
    sweep.start_servers(&steps)?;
    for cell in steps.chunk_by(|a, b| a.cell == b.cell) {
        sweep.cell(cell)?;
    }
    Ok(sweep.finish(&args.results))
}

/// A results file can be resumed only with the same storage and run length.
fn check_resumable(existing: &Results, plan: &Plan, path: &Path) -> anyhow::Result<()> {
    let Some(h) = existing.header() else {
        return Ok(());
    };
    let storage = plan.target.storage();
    if h.storage != storage {
        bail!(
            "--results {}: holds a sweep of {}, not {}; use another results file",
            path.display(),
            h.storage.describe(),
            storage.describe()
        );
    }
    let m = &plan.matrix;
    if (h.runtime_s - m.runtime_s).abs() > 1e-9 || (h.ramp_s - m.ramp_s).abs() > 1e-9 {
        bail!(
            "--results {}: its runs lasted {} s (ramp {} s), not {} s (ramp {} s); use another results file",
            path.display(),
            h.runtime_s,
            h.ramp_s,
            m.runtime_s,
            m.ramp_s
        );
    }
    Ok(())
}

/// Seconds the runs of `steps` are expected to take, each with its column's
/// ramp.
pub(super) fn estimate_s(plan: &Plan, steps: &[Step]) -> f64 {
    steps
        .iter()
        .map(|s| plan.run_estimate_s(s.setup, s.run.is_none()))
        .sum()
}

/// Says what the sweep will do and how long it should take (`estimate_s`).
fn announce(plan: &Plan, total_runs: usize, estimate_s: f64, already: usize) {
    let est = Duration::from_secs_f64(estimate_s);
    let columns: Vec<String> = plan.setups.iter().map(|s| s.label()).collect();
    let resumed = if already > 0 {
        format!(", {already} runs already in the results file")
    } else {
        String::new()
    };
    eprintln!(
        "vqblk sweep: {} cells x columns [{}]; {} runs to do ({} warm-up per cell, {} measured){}; about {}",
        plan.matrix.cells().len(),
        columns.join(", "),
        total_runs,
        plan.warmups,
        plan.repeats,
        resumed,
        hms(est)
    );
    for (s, why) in &plan.skipped {
        eprintln!("vqblk sweep: {s}: {why}");
    }
}

/// Appends the header of this (possibly resumed) sweep and the skips not yet recorded.
fn write_header(w: &mut Writer, plan: &Plan, host: Host, existing: &Results) -> anyhow::Result<()> {
    let version = std::process::Command::new(&plan.exe)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    w.write(&Record::Header(Box::new(Header {
        format: FORMAT,
        vqblk_version: version,
        started: utc_now(),
        argv: std::env::args().collect(),
        host,
        storage: plan.target.storage(),
        baseline: match plan.baseline {
            BaselineKind::Vqblk => "vqblk serve --iothreads 1 --poll off".into(),
            BaselineKind::QemuStorageDaemon => "qemu-storage-daemon".into(),
        },
        matrix: plan.matrix.clone(),
        queues: plan.matrix.queues(),
        runtime_s: plan.matrix.runtime_s,
        ramp_s: plan.matrix.ramp_s,
        warmups: plan.warmups,
        repeats: plan.repeats,
        skip_rule: plan.skip_rule.clone(),
        commands: plan.command_templates(),
    })))?;
    for (s, why) in &plan.skipped {
        let recorded = existing
            .skips
            .iter()
            .any(|o| o.setup == s.label() && &o.reason == why);
        if !recorded {
            w.write(&Record::Skip(Skip {
                setup: s.label(),
                iothreads: s.count(),
                reason: why.clone(),
            }))?;
        }
    }
    Ok(())
}

/// The sweep in progress: the servers, the results being written and the tallies.
struct Sweep<'a> {
    plan: &'a Plan,
    w: Writer,
    progress: Progress,
    /// The columns being measured and their servers (None for native); a column
    /// whose server did not start is not here.
    servers: BTreeMap<Setup, Option<ServerProc>>,
    /// Time limit of one bench run.
    limit: Duration,
    started: Instant,
    /// Runs given up after their retry.
    failures: usize,
    /// Runs that failed once and were retried.
    retried: usize,
}

impl<'a> Sweep<'a> {
    fn new(plan: &'a Plan, w: Writer, progress: Progress) -> Self {
        // A run that takes 90 s more than it should is stuck.
        let limit = Duration::from_secs_f64(plan.matrix.runtime_s + plan.matrix.ramp_s + 90.0);
        Sweep {
            plan,
            w,
            progress,
            servers: BTreeMap::new(),
            limit,
            started: Instant::now(),
            failures: 0,
            retried: 0,
        }
    }

    /// Starts the server of a column (None for native) and records it.
    fn start_server(&mut self, setup: Setup) -> anyhow::Result<Option<ServerProc>> {
        let Some(argv) = self.plan.server_argv(setup) else {
            return Ok(None);
        };
        let log = self
            .plan
            .work_dir
            .join(format!("{}.log", Plan::file_stem(setup)));
        let s = ServerProc::start(&argv, &self.plan.socket(setup), &log)?;
        self.w.write(&Record::Server(Server {
            setup: setup.label(),
            iothreads: setup.count().unwrap_or(0),
            argv: argv.iter().map(|a| a.to_string_lossy().into()).collect(),
            pid: s.pid(),
        }))?;
        Ok(Some(s))
    }

    /// Starts the server of every column with runs to do, each on its own socket:
    /// the runs of the columns interleave, and an idle server costs nothing (no
    /// queue is attached between runs). A column whose server does not start is
    /// skipped; the others go on.
    fn start_servers(&mut self, steps: &[Step]) -> anyhow::Result<()> {
        let plan = self.plan;
        for &setup in &plan.setups {
            let runs = steps.iter().filter(|s| s.setup == setup).count();
            if runs == 0 {
                continue;
            }
            match self.start_server(setup) {
                Ok(s) => {
                    self.servers.insert(setup, s);
                }
                Err(e) => self.skip_column(setup, runs, &e)?,
            }
        }
        Ok(())
    }

    /// A column whose server does not start is recorded as skipped, its `runs`
    /// counted as done.
    fn skip_column(&mut self, setup: Setup, runs: usize, e: &anyhow::Error) -> anyhow::Result<()> {
        self.progress
            .line(&format!("vqblk sweep: {setup}: {e:#}; column skipped"));
        self.w.write(&Record::Skip(Skip {
            setup: setup.label(),
            iothreads: setup.count(),
            reason: format!("server failed to start: {e:#}"),
        }))?;
        self.failures += 1;
        for _ in 0..runs {
            self.progress.tick("");
        }
        Ok(())
    }

    /// The runs of one cell, in [`order`], then one line per column with its mean.
    fn cell(&mut self, steps: &[Step]) -> anyhow::Result<()> {
        let Some(cell) = steps.first().map(|s| s.cell) else {
            return Ok(());
        };
        let mut measured: BTreeMap<Setup, (f64, usize)> = BTreeMap::new();
        for step in steps {
            if !self.servers.contains_key(&step.setup) {
                continue;
            }
            let outcome = self.attempt(step)?;
            self.progress.tick(&format!("{} {}", step.setup, step.cell));
            match (outcome, step.run) {
                (Some(_), None) => {}
                (Some((m, argv)), Some(i)) => {
                    let (sum, n) = measured.entry(step.setup).or_default();
                    *sum += m.bw_bytes / 1e6;
                    *n += 1;
                    self.record_run(step.setup, &step.cell, i, &m, argv)?;
                }
                (None, _) => self.failures += 1,
            }
        }
        for (setup, (sum, n)) in measured {
            self.progress
                .cell_done(&format!("{setup} {cell}"), sum / n as f64, n);
        }
        Ok(())
    }

    /// The server of a column, if it has one.
    fn server(&self, setup: Setup) -> Option<&ServerProc> {
        self.servers.get(&setup).and_then(Option::as_ref)
    }

    /// One run, retried once: a transient failure (the host is shared) costs a
    /// retry, a persistent one a missing value. Every failed attempt is recorded.
    fn attempt(&mut self, step: &Step) -> anyhow::Result<Option<(Measured, Vec<String>)>> {
        let (setup, cell) = (step.setup, &step.cell);
        for attempt in 1..=2 {
            self.restart_if_dead(setup)?;
            let pid = self.server(setup).map(ServerProc::pid);
            let argv = match step.run {
                Some(_) => self.plan.bench_argv(cell, setup, pid),
                None => self.plan.warmup_argv(cell, setup, pid),
            };
            let before = self.tune_state(setup);
            let result =
                run_with_timeout(&argv, self.limit).and_then(|out| parse_bench_json(&out, cell.op));
            match result {
                Ok(mut m) => {
                    if let (Some(b), Some(a)) = (before, self.tune_state(setup)) {
                        m.tune = Some(b.until(&a));
                    }
                    return Ok(Some((m, argv)));
                }
                Err(e) => {
                    let msg = with_server_log(format!("{e:#}"), self.server(setup));
                    self.record_failure(setup, cell, attempt, &msg)?;
                }
            }
        }
        Ok(None)
    }

    /// The `auto` column's controller now (None for other columns, or if its
    /// control socket does not answer: the run is recorded without it).
    fn tune_state(&self, setup: Setup) -> Option<TuneState> {
        if setup != Setup::Auto {
            return None;
        }
        let mut c = ControlClient::connect(&self.plan.control_socket()).ok()?;
        let tune = c.call("query-tune", Value::Null).ok()?;
        let threads = c.call("query-iothreads", Value::Null).ok()?;
        TuneState::parse(&tune, &threads)
    }

    /// A server that died is restarted.
    fn restart_if_dead(&mut self, setup: Setup) -> anyhow::Result<()> {
        let Some(Some(s)) = self.servers.get_mut(&setup) else {
            return Ok(());
        };
        if s.alive() {
            return Ok(());
        }
        self.progress.line(&format!(
            "vqblk sweep: {setup}: server died:\n{}\nrestarting",
            s.log_tail()
        ));
        self.servers.insert(setup, None);
        let s = self.start_server(setup)?;
        self.servers.insert(setup, s);
        Ok(())
    }

    /// Stops every server (SIGTERM: a clean exit), saying which did not exit cleanly.
    fn stop_servers(&mut self) {
        for (setup, server) in std::mem::take(&mut self.servers) {
            let Some(mut s) = server else { continue };
            match s.stop() {
                Some(st) if st.success() => {}
                st => self.progress.line(&format!(
                    "vqblk sweep: {setup}: server exit {st:?}:\n{}",
                    s.log_tail()
                )),
            }
        }
    }

    fn record_failure(
        &mut self,
        setup: Setup,
        cell: &Cell,
        attempt: u32,
        msg: &str,
    ) -> anyhow::Result<()> {
        let retry = attempt < 2;
        if retry {
            self.retried += 1;
        }
        self.progress.line(&format!(
            "vqblk sweep: {setup} {cell}: run failed (attempt {attempt}{}): {msg}",
            if retry { ", retrying" } else { ", giving up" }
        ));
        self.w.write(&Record::Error(RunError {
            cell: *cell,
            setup: setup.label(),
            iothreads: setup.count(),
            message: format!("attempt {attempt}: {msg}"),
        }))
    }

    fn record_run(
        &mut self,
        setup: Setup,
        cell: &Cell,
        run: u32,
        m: &Measured,
        argv: Vec<String>,
    ) -> anyhow::Result<()> {
        self.w.write(&Record::Run(Box::new(Run {
            cell: *cell,
            setup: setup.label(),
            iothreads: setup.count(),
            run,
            iops: m.iops,
            bw_bytes: m.bw_bytes,
            mb_s: m.bw_bytes / 1e6,
            p50_us: m.p50_us,
            p99_us: m.p99_us,
            server_cpu_s: m.server_cpu_s,
            server_cpu_pct: m.server_cpu_pct(),
            elapsed_s: m.elapsed_s,
            time: utc_now(),
            argv,
            server_threads: m.server_threads.clone(),
            server_threads_wait: m.server_threads_wait.clone(),
            server_threads_cpu: m.server_threads_cpu.clone(),
            tune: m.tune.clone(),
            iothread_counters: m.iothread_counters.clone(),
        })))
    }

    /// Stops the servers, cleans up, sums up, and returns the exit code.
    fn finish(mut self, results: &Path) -> i32 {
        self.stop_servers();
        self.progress.finish();
        let logs = results.with_extension("logs");
        if let Err(e) = keep_logs(&self.plan.work_dir, &logs) {
            eprintln!(
                "vqblk sweep: cannot keep the server logs in {}: {e}",
                logs.display()
            );
        }
        let (failures, retried) = (self.failures, self.retried);
        if failures + retried == 0 {
            let _ = std::fs::remove_dir_all(&self.plan.work_dir);
        } else {
            eprintln!(
                "vqblk sweep: server logs kept in {}",
                self.plan.work_dir.display()
            );
        }
        eprintln!(
            "vqblk sweep: done in {}: {} runs, {retried} retried, {failures} failed for good; results in {}",
            hms(self.started.elapsed()),
            self.progress.done(),
            results.display()
        );
        i32::from(failures > 0)
    }
}

/// Appends each server's log in `work` to the file of the same name in
/// `logs` (created; a resumed sweep's servers add to the logs of the
/// first).
fn keep_logs(work: &Path, logs: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(logs)?;
    for entry in std::fs::read_dir(work)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "log") {
            let mut from = std::fs::File::open(&path)?;
            let mut to = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(logs.join(path.file_name().unwrap_or_default()))?;
            std::io::copy(&mut from, &mut to)?;
        }
    }
    Ok(())
}

/// Appends the last lines of the server's log to a failure message.
fn with_server_log(msg: String, server: Option<&ServerProc>) -> String {
    let Some(s) = server else {
        return msg;
    };
    let tail = s.log_tail();
    let last: Vec<&str> = tail.lines().rev().take(5).collect();
    if last.is_empty() {
        return msg;
    }
    let last: Vec<&str> = last.into_iter().rev().collect();
    format!("{msg} [server log: {}]", last.join(" | "))
}

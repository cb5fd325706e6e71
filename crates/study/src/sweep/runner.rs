//! Measures a [`Plan`]: resumes from the results file, starts one server per
//! column, runs every cell's warm-ups and repeats, retries a failed run once, and
//! appends every record as it happens.

use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;

use super::host::{hms, host_info, utc_now};
use super::measure::{parse_bench_json, Measured};
use super::plan::Plan;
use super::process::{run_with_timeout, ServerProc};
use super::progress::Progress;
use super::{BaselineKind, SweepArgs};
use crate::matrix::{Cell, Setup};
use crate::results::{Header, Host, Record, Results, Run, RunError, Server, Skip, Writer, FORMAT};

/// A cell still to measure in one column, with the run indexes missing.
type Pending = (Cell, Vec<u32>);

/// Per column: the cells still to measure.
type Todo = Vec<(Setup, Vec<Pending>)>;

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
    let todo = pending(&plan, &existing);
    let total_runs = run_count(&plan, &todo);
    announce(&plan, total_runs, existing.runs.len());
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
    let progress = Progress::new(total_runs, plan.run_estimate_s(), tty);
    let mut sweep = Sweep::new(&plan, w, progress);
    for (setup, cells) in &todo {
        sweep.column(*setup, cells)?;
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

/// Per column, the cells with measured runs missing from `existing`.
fn pending(plan: &Plan, existing: &Results) -> Todo {
    let done = existing.done();
    let cells = plan.matrix.cells();
    let mut todo = Vec::new();
    for &s in &plan.setups {
        let mut v = Vec::new();
        for c in &cells {
            let have = done.get(&(*c, s));
            let missing: Vec<u32> = (1..=plan.repeats)
                .filter(|i| !have.is_some_and(|h| h.contains(i)))
                .collect();
            if !missing.is_empty() {
                v.push((*c, missing));
            }
        }
        if !v.is_empty() {
            todo.push((s, v));
        }
    }
    todo
}

/// Runs to do, warm-ups included.
fn run_count(plan: &Plan, todo: &Todo) -> usize {
    todo.iter()
        .flat_map(|(_, v)| v.iter().map(|(_, m)| m.len() + plan.warmups as usize))
        .sum()
}

/// Says what the sweep will do and how long it should take.
fn announce(plan: &Plan, total_runs: usize, already: usize) {
    let est = Duration::from_secs_f64(total_runs as f64 * plan.run_estimate_s());
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

/// The sweep in progress: the results being written and the tallies.
struct Sweep<'a> {
    plan: &'a Plan,
    w: Writer,
    progress: Progress,
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

    /// Measures every pending cell of one column against one server.
    fn column(&mut self, setup: Setup, cells: &[Pending]) -> anyhow::Result<()> {
        let mut server = match self.start_server(setup) {
            Ok(s) => s,
            Err(e) => return self.skip_column(setup, cells, &e),
        };
        for (cell, missing) in cells {
            self.cell(setup, cell, missing, &mut server)?;
        }
        if let Some(mut s) = server.take() {
            match s.stop() {
                Some(st) if st.success() => {}
                st => self.progress.line(&format!(
                    "vqblk sweep: {setup}: server exit {st:?}:\n{}",
                    s.log_tail()
                )),
            }
        }
        Ok(())
    }

    /// A column whose server does not start is recorded as skipped.
    fn skip_column(
        &mut self,
        setup: Setup,
        cells: &[Pending],
        e: &anyhow::Error,
    ) -> anyhow::Result<()> {
        self.progress
            .line(&format!("vqblk sweep: {setup}: {e:#}; column skipped"));
        self.w.write(&Record::Skip(Skip {
            setup: setup.label(),
            iothreads: setup.count(),
            reason: format!("server failed to start: {e:#}"),
        }))?;
        self.failures += 1;
        for (_, missing) in cells {
            for _ in 0..(missing.len() + self.plan.warmups as usize) {
                self.progress.tick("");
            }
        }
        Ok(())
    }

    /// The warm-ups and the missing measured runs of one cell.
    fn cell(
        &mut self,
        setup: Setup,
        cell: &Cell,
        missing: &[u32],
        server: &mut Option<ServerProc>,
    ) -> anyhow::Result<()> {
        let what = format!("{setup} {cell}");
        let mut sum = 0.0;
        let mut n = 0;
        let warmups = (0..self.plan.warmups).map(|_| None);
        for idx in warmups.chain(missing.iter().map(|&i| Some(i))) {
            let outcome = self.attempt(setup, cell, server)?;
            self.progress.tick(&what);
            match (outcome, idx) {
                (Some(_), None) => {}
                (Some((m, argv)), Some(i)) => {
                    sum += m.bw_bytes / 1e6;
                    n += 1;
                    self.record_run(setup, cell, i, &m, argv)?;
                }
                (None, _) => self.failures += 1,
            }
        }
        if n > 0 {
            self.progress.cell_done(&what, sum / n as f64, n);
        }
        Ok(())
    }

    /// One run, retried once: a transient failure (the host is shared) costs a
    /// retry, a persistent one a missing value. Every failed attempt is recorded.
    fn attempt(
        &mut self,
        setup: Setup,
        cell: &Cell,
        server: &mut Option<ServerProc>,
    ) -> anyhow::Result<Option<(Measured, Vec<String>)>> {
        for attempt in 1..=2 {
            self.restart_if_dead(setup, server)?;
            let pid = server.as_ref().map(ServerProc::pid);
            let argv = self.plan.bench_argv(cell, setup, pid);
            let result =
                run_with_timeout(&argv, self.limit).and_then(|out| parse_bench_json(&out, cell.op));
            match result {
                Ok(m) => return Ok(Some((m, argv))),
                Err(e) => {
                    let msg = with_server_log(format!("{e:#}"), server.as_ref());
                    self.record_failure(setup, cell, attempt, &msg)?;
                }
            }
        }
        Ok(None)
    }

    /// A server that died is restarted.
    fn restart_if_dead(
        &mut self,
        setup: Setup,
        server: &mut Option<ServerProc>,
    ) -> anyhow::Result<()> {
        if let Some(s) = server.as_mut() {
            if !s.alive() {
                self.progress.line(&format!(
                    "vqblk sweep: {setup}: server died:\n{}\nrestarting",
                    s.log_tail()
                ));
                drop(server.take());
                *server = self.start_server(setup)?;
            }
        }
        Ok(())
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
        })))
    }

    /// Cleans up, sums up, and returns the exit code.
    fn finish(self, results: &Path) -> i32 {
        self.progress.finish();
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

//! One pass of a run: a thread per job clone behind a common start [`Gate`], while the
//! main thread samples client and server CPU time around the measured part and draws
//! the progress line.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::{Scope, ScopedJoinHandle, Thread};
use std::time::{Duration, Instant};

use vqblk_daemon::stats::DaemonSnapshot;

use crate::cpu::{self, CpuTimes, ThreadCpu};
use crate::engine::Engine;
use crate::server_stats::{self, IoThreadDelta};

use super::progress::Progress;
use super::setup::JobClone;
use super::worker::{run_clone, CloneOutcome, Counter, Gate, Pass, Work};
use super::{Plan, RunError};

/// What the passes of a run measured together, outside the job threads.
#[derive(Debug, Default)]
pub(super) struct Totals {
    /// Wall time of the measured parts.
    pub(super) elapsed: Duration,
    /// CPU time of this whole process.
    pub(super) client_cpu: CpuTimes,
    /// CPU time of the server process, or why it could not be read.
    pub(super) server_cpu: Option<Result<CpuTimes, String>>,
    /// CPU time of each server thread.
    pub(super) server_threads: Vec<ThreadCpu>,
    /// A vqblk server's counters per IOThread (with `--server-stats`; None
    /// once a snapshot could not be taken).
    pub(super) server_iothreads: Option<Vec<IoThreadDelta>>,
}

/// CPU time readings at one moment.
#[derive(Debug, Clone, Default)]
struct Sample {
    client: CpuTimes,
    server: Option<Result<CpuTimes, String>>,
    threads: Vec<ThreadCpu>,
    /// A vqblk server's own counters, where the plan names its stats file.
    stats: Option<DaemonSnapshot>,
}

impl Sample {
    /// The CPU times of `plan`'s client and server, then, if `counters`
    /// (the sample starts or ends the measured part), the server's counters
    /// (a signal and a file rewrite later: milliseconds).
    fn take(plan: &Plan, counters: bool) -> Self {
        let server_pid = plan.server_pid;
        Self {
            client: cpu::process_times(),
            server: server_pid.map(cpu::server_times),
            threads: server_pid.map(cpu::server_thread_times).unwrap_or_default(),
            stats: counters.then(|| server_counters(plan)).flatten(),
        }
    }
}

/// A snapshot of the counters of `plan`'s server, if it names its stats file.
fn server_counters(plan: &Plan) -> Option<DaemonSnapshot> {
    server_stats::snapshot(plan.server_stats.as_ref()?, plan.server_pid?)
}

impl Totals {
    /// Nothing measured yet; server figures only with a server pid, its
    /// IOThreads' counters only with `counters` (a stats file to read).
    pub(super) fn new(server_pid: Option<u32>, counters: bool) -> Self {
        Self {
            server_cpu: server_pid.map(|_| Ok(CpuTimes::default())),
            server_iothreads: (server_pid.is_some() && counters).then(Vec::new),
            ..Default::default()
        }
    }

    /// Adds what happened between two samples `wall` apart. A server reading that
    /// failed once makes the server's total that error.
    fn add(&mut self, a: Sample, b: Sample, wall: Duration) {
        for d in cpu::thread_delta(&a.threads, &b.threads) {
            match self.server_threads.iter_mut().find(|t| t.tid == d.tid) {
                Some(t) => {
                    t.cpu += d.cpu;
                    t.wait += d.wait;
                }
                None => self.server_threads.push(d),
            }
        }
        self.elapsed += wall;
        self.client_cpu = self.client_cpu + b.client.since(&a.client);
        self.server_iothreads = match (self.server_iothreads.take(), &a.stats, &b.stats) {
            (Some(mut acc), Some(a), Some(b)) => {
                for d in server_stats::iothread_delta(a, b) {
                    match acc.iter_mut().find(|t| t.name == d.name) {
                        Some(t) => t.absorb(&d),
                        None => acc.push(d),
                    }
                }
                Some(acc)
            }
            _ => None,
        };
        if let (Some(acc), Some(a), Some(b)) = (self.server_cpu.as_mut(), a.server, b.server) {
            match (a, b) {
                (Ok(a), Ok(b)) => {
                    if let Ok(acc) = acc {
                        *acc = *acc + b.since(&a);
                    }
                }
                (Err(e), _) | (_, Err(e)) => *acc = Err(e),
            }
        }
    }
}

/// Runs one pass of every clone, each on its engine, and returns their outcomes in
/// clone order; the measured time and CPU go into `totals`.
pub(super) fn run_pass(
    plan: &Plan,
    clones: &[JobClone],
    engines: &mut [Box<dyn Engine>],
    (pass, verify_seed): (Pass, u64),
    totals: &mut Totals,
) -> Result<Vec<CloneOutcome>, RunError> {
    let counters: Vec<Counter> = (0..clones.len()).map(|_| Counter::default()).collect();
    let gate = Gate::default();
    let finished = AtomicUsize::new(0);
    let ramp = match pass {
        Pass::Workload => plan.jobs.iter().map(|j| j.ramp_time).max(),
        _ => None,
    }
    .unwrap_or_default();
    let mut progress = (plan.progress && std::io::stdout().is_terminal())
        .then(|| Progress::new(plan, clones, pass));
    let shared = Shared {
        plan,
        clones,
        counters: &counters,
        gate: &gate,
        finished: &finished,
        main: std::thread::current(),
    };
    let out = std::thread::scope(|s| {
        let handles = spawn_clones(s, &shared, engines, (pass, verify_seed))?;
        let (a, b, wall) = watch(&shared, ramp, progress.as_mut());
        totals.add(a, b, wall);
        Ok(handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| CloneOutcome::panicked()))
            .collect())
    });
    if let Some(p) = progress {
        p.finish();
    }
    out
}

/// What the job threads and the main thread share during a pass.
struct Shared<'a> {
    plan: &'a Plan,
    clones: &'a [JobClone],
    counters: &'a [Counter],
    gate: &'a Gate,
    /// Job threads done with the pass.
    finished: &'a AtomicUsize,
    /// Unparked by each job thread that finishes.
    main: Thread,
}

/// Spawns a thread per clone, waiting at the gate. If one cannot be spawned, the others
/// are called off and joined.
fn spawn_clones<'s, 'a: 's>(
    s: &'s Scope<'s, '_>,
    shared: &'s Shared<'a>,
    engines: &'s mut [Box<dyn Engine>],
    (pass, verify_seed): (Pass, u64),
) -> Result<Vec<ScopedJoinHandle<'s, CloneOutcome>>, RunError> {
    let mut handles = Vec::new();
    for (ci, (engine, cl)) in engines.iter_mut().zip(shared.clones).enumerate() {
        let spec = &shared.plan.jobs[cl.job];
        let work = Work {
            spec,
            region: cl.region,
            pass,
            seed: spec.randseed ^ (ci as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            verify_seed,
            counter: &shared.counters[ci],
            gate: shared.gate,
        };
        let name = format!("{}.{}", spec.name, cl.index);
        let h = std::thread::Builder::new()
            .name(name.chars().take(15).collect())
            .spawn_scoped(s, move || {
                let o = run_clone(engine.as_mut(), &work);
                shared.finished.fetch_add(1, Ordering::Release);
                shared.main.unpark();
                o
            });
        match h {
            Ok(h) => handles.push(h),
            Err(e) => {
                shared.gate.open(false);
                for h in handles {
                    let _ = h.join();
                }
                return Err(RunError::Config(format!("cannot spawn a job thread: {e}")));
            }
        }
    }
    Ok(handles)
}

/// The main thread while the job threads run: opens their gate, samples CPU time once
/// the ramp is over and again when every thread is done, and updates the progress
/// line. Returns both samples and the measured wall time.
fn watch(
    shared: &Shared,
    ramp: Duration,
    mut progress: Option<&mut Progress>,
) -> (Sample, Sample, Duration) {
    let plan = shared.plan;
    let mut sampled = ramp.is_zero();
    // Without a ramp the measured part starts with the I/O: its sample is
    // taken before the gate opens (the counters' snapshot takes
    // milliseconds, a signal and a file rewrite).
    let mut before = Sample::take(plan, sampled);
    shared.gate.open(true);
    let t0 = Instant::now();
    while shared.finished.load(Ordering::Acquire) < shared.clones.len() {
        let wake = if sampled {
            Duration::from_millis(1000)
        } else {
            ramp.saturating_sub(t0.elapsed())
        };
        std::thread::park_timeout(wake.max(Duration::from_millis(1)));
        if !sampled && t0.elapsed() >= ramp {
            sampled = true;
            before = Sample::take(plan, true);
        }
        if let Some(p) = progress.as_deref_mut() {
            p.update(shared.counters, t0.elapsed());
        }
    }
    let wall = t0.elapsed().saturating_sub(ramp);
    (before, Sample::take(plan, true), wall)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(ms: u64) -> CpuTimes {
        CpuTimes {
            user: Duration::from_millis(ms),
            sys: Duration::from_millis(ms / 2),
            ctx: ms,
            sleeps: ms,
        }
    }

    fn thread(tid: u32, ms: u64) -> ThreadCpu {
        ThreadCpu {
            tid,
            name: format!("t{tid}"),
            cpu: Duration::from_millis(ms),
            wait: Duration::from_micros(ms * 500),
            last_cpu: Some(tid % 2),
        }
    }

    #[test]
    fn totals_add_the_differences_of_each_pass() {
        let mut t = Totals::new(Some(1), false);
        let s = |c, srv, threads| Sample {
            client: cpu(c),
            server: Some(Ok(cpu(srv))),
            threads,
            stats: None,
        };
        t.add(
            s(10, 100, vec![thread(1, 5)]),
            s(30, 140, vec![thread(1, 9)]),
            Duration::from_secs(1),
        );
        t.add(
            s(30, 140, vec![thread(1, 9)]),
            s(40, 150, vec![thread(1, 10), thread(2, 3)]),
            Duration::from_secs(2),
        );
        assert_eq!(t.elapsed, Duration::from_secs(3));
        assert_eq!(t.client_cpu, cpu(30));
        assert_eq!(t.server_cpu, Some(Ok(cpu(50))));
        assert_eq!(t.server_threads, vec![thread(1, 5), thread(2, 3)]);
    }

    #[test]
    fn a_failed_server_reading_is_reported() {
        let mut t = Totals::new(Some(1), false);
        let bad = Sample {
            server: Some(Err("gone".into())),
            ..Default::default()
        };
        let good = Sample {
            server: Some(Ok(cpu(1))),
            ..Default::default()
        };
        t.add(good, bad, Duration::ZERO);
        assert_eq!(t.server_cpu, Some(Err("gone".into())));
        assert_eq!(Totals::new(None, false).server_cpu, None);
    }
}

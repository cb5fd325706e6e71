//! `--iothreads auto`: the `vqblk-tune` thread, a thin controller around the
//! pure policy [`crate::autotune`]. Once a second it reads the IOThreads'
//! counters (CPU and polling time, each queue's completed requests), hands
//! the policy a [`Sample`], and carries out its decisions with the live
//! `queue-move` ([`DaemonState::move_queue`]), logging and counting each
//! with its reason and keeping the last few for the control socket; each
//! tick it publishes the counts and which IOThreads own a queue for the
//! metrics ([`TuneBoard`]). Queues placed by the configuration (`iothreads` or
//! `iothread-vq-mapping` of an export) and the queues of an export whose
//! tuning the `tune` method turned off are shown to the policy as pinned:
//! they load their thread but never move.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{error, info, warn};

use super::DaemonState;
use crate::autotune::{AutoTune, Params, QueueSample, Reason, Sample, ThreadSample};
use crate::config::{BackendKind, ExportPlan};
use crate::control::TunerMove;
use crate::mapping::VirtqueueMap;
use crate::metrics::{TuneBoard, TuneReading};
use crate::seccomp::{SeccompMode, ThreadKind};
use crate::stats::DaemonSnapshot;

/// How often the controller samples and decides.
const TICK: Duration = Duration::from_secs(1);

/// How many of the last moves the control socket shows: enough to see the
/// last convergence (a pegged thread wakes up to three at once).
const RECENT: usize = 8;

/// The tuner's state shared with the control socket and the metrics.
#[derive(Debug)]
pub(crate) struct Tuning {
    /// The policy's knobs (the cpu budget among them).
    pub(crate) params: Params,
    /// Exports whose queues stay where they are (`tune` off).
    off: Mutex<HashSet<String>>,
    /// The IOThread on the CPU that takes the most of an export's disk
    /// interrupts, for the exports whose disk says.
    homes: Mutex<HashMap<String, usize>>,
    /// Moves carried out, by reason, in the order of [`Reason::ALL`].
    moves: [AtomicU64; Reason::ALL.len()],
    /// Moves that failed (the queue stayed, or moves once its drain ends).
    failed: AtomicU64,
    /// The last [`RECENT`] moves carried out, oldest first.
    recent: Mutex<VecDeque<(Instant, TunerMove)>>,
    /// What the metrics show, published every tick.
    pub(crate) board: Arc<TuneBoard>,
}

impl Tuning {
    pub(crate) fn new(params: Params) -> Self {
        Tuning {
            params,
            off: Mutex::new(HashSet::new()),
            homes: Mutex::default(),
            moves: Default::default(),
            failed: AtomicU64::new(0),
            recent: Mutex::new(VecDeque::with_capacity(RECENT)),
            board: Arc::default(),
        }
    }

    /// Turns tuning of `export`'s queues on or off.
    pub(crate) fn set(&self, export: &str, on: bool) {
        let mut off = self.off.lock().unwrap();
        if on {
            off.remove(export);
        } else {
            off.insert(export.to_string());
        }
    }

    /// Is tuning of `export` on?
    pub(crate) fn is_on(&self, export: &str) -> bool {
        !self.off.lock().unwrap().contains(export)
    }

    /// The IOThread `export`'s queues run best on, if its disk says.
    fn home_of(&self, export: &str) -> Option<usize> {
        self.homes.lock().unwrap().get(export).copied()
    }

    /// Moves carried out, by reason label.
    pub(crate) fn moves(&self) -> Vec<(&'static str, u64)> {
        Reason::ALL
            .iter()
            .zip(&self.moves)
            .map(|(r, n)| (r.label(), n.load(Ordering::Relaxed)))
            .collect()
    }

    /// Moves that failed.
    pub(crate) fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    /// Counts move `m`, carried out, and keeps it among the recent ones.
    fn moved(&self, reason: Reason, m: TunerMove) {
        self.moves[reason as usize].fetch_add(1, Ordering::Relaxed);
        let mut recent = self.recent.lock().unwrap();
        if recent.len() == RECENT {
            recent.pop_front();
        }
        recent.push_back((Instant::now(), m));
    }

    /// The last moves carried out, newest first, with their age.
    pub(crate) fn recent(&self) -> Vec<TunerMove> {
        let recent = self.recent.lock().unwrap();
        recent
            .iter()
            .rev()
            .map(|(at, m)| TunerMove {
                age: at.elapsed(),
                ..m.clone()
            })
            .collect()
    }

    /// Publishes the counts and `active`, each IOThread's state, for scrapes.
    fn publish(&self, active: Vec<bool>) {
        self.board.publish(TuneReading {
            moves: self.moves(),
            failed: self.failed(),
            active,
        });
    }
}

/// Per IOThread of the pool: does it own a queue of an export (active), or
/// is it parked?
fn active(state: &DaemonState) -> Vec<bool> {
    let mut active = vec![false; state.iothreads.len()];
    for e in state.exports.lock().unwrap().iter() {
        let map = e.map();
        for q in 0..map.num_queues() {
            if let Some(a) = active.get_mut(map.thread_of(q)) {
                *a = true;
            }
        }
    }
    active
}

/// The initial placement of an export the policy may move: every queue on
/// one IOThread, so that the pool starts with few active threads and the
/// policy wakes more as load comes. With one CPU per IOThread
/// (`thread_cpus[i]` is the CPU IOThread `i` is pinned to), that thread is
/// the one on the CPU taking the most of the disk's completion interrupts
/// (see [`crate::irq`]), kept in `tuning` for parking; else IOThread 0.
pub(crate) fn start_placement(
    plan: &mut ExportPlan,
    pool: usize,
    thread_cpus: Option<&[usize]>,
    tuning: &Tuning,
) {
    if placed_by_config(&plan.config) {
        return;
    }
    let home = thread_cpus.and_then(|cpus| home_thread(plan, cpus));
    let mut homes = tuning.homes.lock().unwrap();
    match home {
        Some(h) => homes.insert(plan.name.clone(), h),
        None => homes.remove(&plan.name),
    };
    plan.map = VirtqueueMap::round_robin(plan.config.queues, &[home.unwrap_or(0)], pool)
        .expect("the home IOThread exists");
}

/// The IOThread pinned to the CPU that takes the most of the export's disk
/// interrupts, if the disk is a local one that says (a null export has no
/// image; an RBD image's name is not a path).
fn home_thread(plan: &ExportPlan, thread_cpus: &[usize]) -> Option<usize> {
    let c = &plan.config;
    if c.backend == BackendKind::Rbd {
        return None;
    }
    let cpu = crate::irq::busiest_cpu_of(c.image.as_deref()?, thread_cpus)?;
    let home = thread_cpus.iter().position(|&t| t == cpu)?;
    info!(
        "export {}: its queues start on IOThread {home}, on CPU {cpu}, which takes most \
         of its disk's interrupts",
        plan.name
    );
    Some(home)
}

fn placed_by_config(c: &crate::config::ExportConfig) -> bool {
    c.iothread_vq_mapping.is_some() || c.iothreads.is_some()
}

/// The running controller.
pub(crate) struct Controller {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

impl Controller {
    /// Starts `vqblk-tune` over `state` (which must carry a [`Tuning`]).
    pub(crate) fn spawn(
        state: Arc<DaemonState>,
        seccomp: SeccompMode,
    ) -> std::io::Result<Controller> {
        let (stop, rx) = channel();
        let thread = std::thread::Builder::new()
            .name("vqblk-tune".into())
            .spawn(move || {
                if let Err(e) = crate::seccomp::apply(ThreadKind::Tune, seccomp) {
                    error!("{e}: the tuning thread runs without a filter");
                }
                let Some(tuning) = state.tuning.clone() else {
                    return;
                };
                let mut policy = AutoTune::new(tuning.params);
                let mut ids = QueueIds::default();
                let t0 = Instant::now();
                let mut prev: Option<(Instant, DaemonSnapshot)> = None;
                tuning.publish(active(&state));
                loop {
                    match rx.recv_timeout(TICK) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    let now = Instant::now();
                    let snap = state.stats();
                    if let Some((then, old)) = &prev {
                        let dt = now.duration_since(*then).as_secs_f64();
                        let now_ms = now.duration_since(t0).as_millis() as u64;
                        let sample = sample(&state, &tuning, &mut ids, old, &snap, dt, now_ms);
                        log::debug!(
                            "autotune: work {:.2?}, poll {:.2?}, {:.0} requests/s",
                            sample.threads.iter().map(|t| t.work).collect::<Vec<_>>(),
                            sample.threads.iter().map(|t| t.poll).collect::<Vec<_>>(),
                            sample.queues.iter().map(|q| q.rate).sum::<f64>()
                        );
                        for d in policy.decide(&sample) {
                            let export = ids.name(d.queue.0).to_string();
                            let q = d.queue.1;
                            match state.move_queue(&export, q, d.to) {
                                Ok(_) => {
                                    tuning.moved(
                                        d.reason,
                                        TunerMove {
                                            export: export.clone(),
                                            queue: q,
                                            from: d.from,
                                            to: d.to,
                                            reason: d.reason.label(),
                                            load: d.load,
                                            age: Duration::ZERO,
                                        },
                                    );
                                    info!(
                                        "autotune: export {export} queue {q}: IOThread {} -> {} \
                                         ({}, {:.2} of a core)",
                                        d.from,
                                        d.to,
                                        d.reason.label(),
                                        d.load
                                    );
                                }
                                Err(e) => {
                                    tuning.failed.fetch_add(1, Ordering::Relaxed);
                                    warn!(
                                        "autotune: export {export} queue {q} to IOThread {} \
                                         ({}): {e}",
                                        d.to,
                                        d.reason.label()
                                    );
                                }
                            }
                        }
                    }
                    // Every tick, not only after a move: a queue-move or
                    // an export added or removed changes the set too.
                    tuning.publish(active(&state));
                    prev = Some((now, snap));
                }
            })?;
        Ok(Controller { stop, thread })
    }

    /// Stops the controller and waits for it (a move in progress finishes).
    pub(crate) fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

/// Stable indexes for export names (the policy keys queues by them).
#[derive(Default)]
struct QueueIds {
    names: Vec<String>,
}

impl QueueIds {
    fn id(&mut self, name: &str) -> usize {
        match self.names.iter().position(|n| n == name) {
            Some(i) => i,
            None => {
                self.names.push(name.to_string());
                self.names.len() - 1
            }
        }
    }
    fn name(&self, id: usize) -> &str {
        &self.names[id]
    }
}

/// What happened between snapshots `old` and `new`, `dt` seconds apart.
fn sample(
    state: &DaemonState,
    tuning: &Tuning,
    ids: &mut QueueIds,
    old: &DaemonSnapshot,
    new: &DaemonSnapshot,
    dt: f64,
    now_ms: u64,
) -> Sample {
    let dt = dt.max(1e-3);
    let threads = new
        .iothreads
        .iter()
        .zip(&old.iothreads)
        .map(|(n, o)| {
            let cpu = (n.cpu_seconds - o.cpu_seconds).max(0.0);
            let poll = (n.poll_seconds - o.poll_seconds).clamp(0.0, cpu);
            let sleep = (n.sleep_seconds - o.sleep_seconds).max(0.0);
            // Time neither asleep nor polling is work, whether the thread
            // ran or waited for a CPU: a thread that never idles is
            // saturated even on a host that gives it less than a core. Naps
            // are idle time the counters do not sum, and a sleep is counted
            // when it ends, so a thread that napped, or did no pass (one
            // long sleep), or completed nothing counts its CPU time only.
            let busy = n.naps == o.naps && n.passes > o.passes && n.requests > o.requests;
            let awake = if busy {
                (dt - sleep - poll).max(0.0)
            } else {
                0.0
            };
            let ready = n.passes_ready.saturating_sub(o.passes_ready);
            let together = n
                .passes_ready_together
                .saturating_sub(o.passes_ready_together);
            ThreadSample {
                work: ((cpu - poll).max(awake) / dt).min(1.0),
                poll: poll / dt,
                together: if ready > 0 {
                    together as f64 / ready as f64
                } else {
                    0.0
                },
            }
        })
        .collect();
    // Completed requests per (export, queue), whichever threads served it.
    let requests = |s: &DaemonSnapshot| {
        let mut m: HashMap<(String, u16), u64> = HashMap::new();
        for t in &s.iothreads {
            for q in &t.queues {
                *m.entry((q.export.clone(), q.queue)).or_default() += q.requests;
            }
        }
        m
    };
    let (before, after) = (requests(old), requests(new));
    let mut queues = Vec::new();
    for e in state.exports.lock().unwrap().iter() {
        let pinned = placed_by_config(&e.config) || !tuning.is_on(&e.name);
        let home = tuning.home_of(&e.name);
        let map = e.map();
        let id = ids.id(&e.name);
        for q in 0..map.num_queues() {
            let key = (e.name.clone(), q);
            let done = after.get(&key).copied().unwrap_or(0);
            let was = before.get(&key).copied().unwrap_or(0);
            queues.push(QueueSample {
                id: (id, q),
                owner: map.thread_of(q),
                rate: done.saturating_sub(was) as f64 / dt,
                pinned,
                home,
            });
        }
    }
    Sample {
        now_ms,
        threads,
        queues,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a_move(queue: u16, from: usize, to: usize) -> TunerMove {
        TunerMove {
            export: "db".into(),
            queue,
            from,
            to,
            reason: Reason::Balance.label(),
            load: 0.3,
            age: Duration::ZERO,
        }
    }

    /// Moves are counted by reason, the last few kept newest first, and a
    /// tick publishes the counts with the active set for the metrics.
    #[test]
    fn moves_are_counted_kept_and_published() {
        let t = Tuning::new(Params::default());
        for q in 0..RECENT as u16 + 2 {
            t.moved(Reason::Balance, a_move(q, 0, 1));
        }
        t.moved(Reason::Park, a_move(99, 1, 0));
        let recent = t.recent();
        assert_eq!(recent.len(), RECENT);
        assert_eq!((recent[0].queue, recent[0].from), (99, 1), "newest first");
        assert_eq!(recent[RECENT - 1].queue, 3, "the oldest were dropped");
        t.failed.fetch_add(1, Ordering::Relaxed);
        t.publish(vec![true, false]);
        let r = t.board.reading();
        assert_eq!(
            r.moves,
            vec![
                ("balance", RECENT as u64 + 2),
                ("activate", 0),
                ("park", 1),
                ("budget", 0),
                ("probe", 0),
                ("revert", 0)
            ]
        );
        assert_eq!((r.failed, r.active), (1, vec![true, false]));
    }
}

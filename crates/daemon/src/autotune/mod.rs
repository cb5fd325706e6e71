//! Online tuning of the IOThread pool: how many IOThreads are active and
//! which one owns each virtqueue, as a pure policy (state in, decisions out).
//!
//! Once a tick (about a second) the controller hands [`AutoTune::decide`] a
//! [`Sample`]: per IOThread the fraction of a core it spent working and
//! busy-polling over the tick, and per virtqueue its owner, its completed
//! requests per second and whether the configuration pinned it
//! (`iothread-vq-mapping`: never moved). The policy answers with
//! [`Decision`]s, each a queue, its new owner and a [`Reason`].
//!
//! **Load.** A thread's load is its *work* fraction: CPU time minus
//! busy-polling time over the tick. Polling is spare time turned into
//! latency; it shrinks by itself as work grows, so it does not count towards
//! saturation. A queue's load is its request rate times its owner's CPU cost
//! per request (the owner's work over the requests it completed).
//!
//! **Rules**, in order, planned on a copy of the tick's view so that each
//! queue gets at most one decision a tick:
//! 1. *Budget*: more active threads (threads owning a queue) than the cpu
//!    budget allows: the coolest are emptied onto the others.
//! 2. *Balance*: a thread above `balance_above` gives the queue that lowers
//!    its load most (by at least `min_gain`) to the coolest active thread.
//! 3. *Activate*: a thread above `activate_above` with several queues that
//!    balancing cannot relieve wakes a parked thread (one without queues)
//!    and hands it about half of its load. A *pegged* thread (above
//!    `pegged`) hides how much more its queues want: it goes to parked
//!    threads first, up to three at once, and when none is parked the
//!    coolest threads are emptied onto the other cool ones to make room.
//!    *Probe*: a thread that is awake all the time (working or polling,
//!    never asleep) with several busy queues is not saturated by its load,
//!    yet its queues may be waiting on each other, and they are when its
//!    passes often find several of them ready at once (`probe_together`:
//!    at least a fifth of its passes with work): once confirmed, a parked
//!    thread takes about half of them, and the move is kept only if their
//!    request rate grows by `probe_gain` (the lowest tick after it settles
//!    over the highest tick that confirmed it);
//!    otherwise it is reverted and not tried again for those queues while
//!    their rate stays within `probe_band` of the rate that confirmed it
//!    (for `probe_retry_ms`): a pause, or a single tick out of the band (a
//!    burst's first or last), is not a new workload, which would probe
//!    again at every burst. The threads of a probe that paid are not
//!    parked while the rate holds.
//! 4. *Park*: a thread whose queues fit on the other threads below
//!    `park_below` (best fit; idle queues fit anywhere) gives them away and
//!    is left parked (no queue, no CPU). The coolest thread goes first,
//!    but a thread that is the *home* of one of its queues (pinned to the
//!    CPU taking the most of its disk's interrupts) goes last.
//!
//! **Hysteresis.** Thresholds apart (activate 0.90, balance 0.80, park
//! 0.75), a rule must hold for `confirm_*` consecutive ticks before it acts
//! (waking quickly, parking slowly), no decision for `settle_ms` after a
//! move (the next sample would mix the old placement with the new), and a
//! queue that moved does not move again for `dwell_ms` (10 s) to balance or
//! to park. Waking threads and making room for them ignore the dwell: they
//! happen only while a thread is pegged, before convergence.
//!
//! **Cost model of a move.** A move drains the queue's ring: the queue stops
//! popping until its in-flight requests complete, then its new owner serves
//! it. Measured here with `cargo test --release --test queue_move --
//! --nocapture stall_of_one_move` (io_uring, O_DIRECT, 4 queues writing and
//! verifying batches of 8 x 4 KiB at QD8, 3 IOThreads, 20 moves):
//! `move_queue`'s own stall (no popping) has a median of 0.54 ms and a max
//! of 1.6 ms (0 to 8 requests drained); the completion gap the moved
//! queue's user sees across a move has a median of 1.7 ms and a max of
//! 13.5 ms, against a median of 0.4 ms, a p99 of 3.7 ms and a max of 10 ms
//! between batches away from moves; other queues do not stop. The policy
//! charges a move [`Params::move_cost_s`] (2 ms, above that median gap) of
//! the queue's requests and makes it only when the capacity it frees over
//! one dwell period pays that
//! back [`Params::payback`] times over.

pub mod sim;

use std::collections::HashMap;

/// A queue's load below which it counts as idle (a fraction of a core).
const IDLE_LOAD: f64 = 0.005;

/// A virtqueue, as the controller names it: export index and queue index.
pub type QueueId = (usize, u16);

/// One IOThread over the last tick.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ThreadSample {
    /// Fraction of one core spent working (CPU time minus busy-polling).
    pub work: f64,
    /// Fraction of one core spent busy-polling.
    pub poll: f64,
    /// Of the passes that found a queue with work, the fraction that found
    /// two or more at once: how often its queues wait on each other.
    pub together: f64,
}

/// One virtqueue over the last tick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueSample {
    /// Which queue.
    pub id: QueueId,
    /// The IOThread that owns it now.
    pub owner: usize,
    /// Requests completed per second.
    pub rate: f64,
    /// Placed by the configuration (`iothread-vq-mapping`): never moved.
    pub pinned: bool,
    /// The IOThread on the CPU that takes the most of its disk's interrupts,
    /// if the disk says: parking empties the other threads first.
    pub home: Option<usize>,
}

/// What the controller measured over one tick.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    /// Time of the sample, ms on any monotonic clock.
    pub now_ms: u64,
    /// Every IOThread of the pool, by index.
    pub threads: Vec<ThreadSample>,
    /// Every queue the policy may see (pinned ones included: they load their
    /// thread).
    pub queues: Vec<QueueSample>,
}

/// Why a queue moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// Load spread over the active threads.
    Balance,
    /// A parked thread woken because the active ones saturate.
    Activate,
    /// A thread emptied because the others can carry its load.
    Park,
    /// A thread emptied because the active threads exceed the cpu budget.
    Budget,
    /// A parked thread woken to try: the thread it relieves never sleeps.
    Probe,
    /// A probe undone: the queues' request rate did not grow.
    Revert,
}

impl Reason {
    /// Every reason, for counters.
    pub const ALL: [Reason; 6] = [
        Reason::Balance,
        Reason::Activate,
        Reason::Park,
        Reason::Budget,
        Reason::Probe,
        Reason::Revert,
    ];

    /// The label value (`reason="..."`) and the word in logs.
    pub fn label(self) -> &'static str {
        match self {
            Reason::Balance => "balance",
            Reason::Activate => "activate",
            Reason::Park => "park",
            Reason::Budget => "budget",
            Reason::Probe => "probe",
            Reason::Revert => "revert",
        }
    }
}

/// Move queue `queue` to IOThread `to`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// The queue.
    pub queue: QueueId,
    /// Its owner now.
    pub from: usize,
    /// Its new owner.
    pub to: usize,
    /// Why.
    pub reason: Reason,
    /// The load (fraction of a core) the policy expects the queue to carry.
    pub load: f64,
}

/// The policy's knobs. [`Params::default`] holds the values the simulation
/// and the unit tests were tuned with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    /// Most threads that may be active (own a queue): the cpu budget in
    /// whole cores, at least 1.
    pub max_active: usize,
    /// Work fraction above which a thread is saturated.
    pub activate_above: f64,
    /// Work fraction every remaining thread must stay under for a thread to
    /// be parked.
    pub park_below: f64,
    /// The hottest thread's work fraction above which queues are balanced.
    pub balance_above: f64,
    /// Least reduction of the hottest thread's work fraction a balance move
    /// must bring.
    pub min_gain: f64,
    /// Work fraction above which a saturated thread is pegged: how much more
    /// its queues want is unknown, so it wakes several threads at once.
    pub pegged: f64,
    /// Ticks a thread must stay hot before a queue leaves it (to balance
    /// or to a woken thread).
    pub confirm_hot: u32,
    /// Ticks an idle surplus must last before a thread is parked.
    pub confirm_park: u32,
    /// No decision this long after a move, ms.
    pub settle_ms: u64,
    /// A queue that moved stays this long, ms (the budget rule excepted).
    pub dwell_ms: u64,
    /// What a move costs its queue: this long without completions, s.
    pub move_cost_s: f64,
    /// A move must free this many times the requests it costs, over one
    /// dwell period.
    pub payback: f64,
    /// CPU seconds per request assumed for a thread with no completions.
    pub default_cost_s: f64,
    /// Awake fraction (work plus polling) above which a thread that is not
    /// saturated is probed: it never sleeps, so its queues may be waiting on
    /// each other rather than on the guest or the disk.
    pub probe_awake: f64,
    /// ... if its queues do wait on each other: at least this fraction of
    /// its passes with work found two or more queues ready at once
    /// ([`ThreadSample::together`]).
    pub probe_together: f64,
    /// Least growth of the queues' request rate that keeps a probe: the
    /// lowest tick after it over the highest tick that confirmed it, so
    /// that the gain shows above the ticks' own noise.
    pub probe_gain: f64,
    /// Ticks after the settle time over which a probe's rate is measured
    /// (a tick below the gain undoes it at once: the lowest only falls).
    pub probe_ticks: u32,
    /// A probe's verdict holds while its queues' rate stays within this
    /// fraction of the rate it was measured at (a refusal: while they are
    /// busy; idle ticks do not end it).
    pub probe_band: f64,
    /// A probe that did not pay is not tried again for this long, ms.
    pub probe_retry_ms: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            max_active: usize::MAX,
            activate_above: 0.90,
            park_below: 0.75,
            balance_above: 0.80,
            pegged: 0.97,
            min_gain: 0.10,
            confirm_hot: 2,
            confirm_park: 5,
            settle_ms: 2_000,
            dwell_ms: 10_000,
            move_cost_s: 0.002,
            payback: 10.0,
            default_cost_s: 5e-6,
            probe_awake: 0.95,
            probe_together: 0.20,
            probe_gain: 0.05,
            probe_ticks: 2,
            probe_band: 0.25,
            probe_retry_ms: 300_000,
        }
    }
}

impl Params {
    /// The most active threads a budget of `cores` allows (at least one).
    pub fn max_active_for_budget(cores: f64) -> usize {
        (cores.floor() as usize).max(1)
    }
}

/// Which rule was pending, and for how many ticks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Streaks {
    hot: u32,
    park: u32,
    probe: u32,
    /// The highest rate of the busy queues over the ticks of the probe
    /// streak.
    probe_high: f64,
}

/// A probe ([`Reason::Probe`]): its queues (the busy ones of the thread it
/// relieved, sorted) and where it stands.
#[derive(Debug, Clone, PartialEq)]
struct Probe {
    queues: Vec<QueueId>,
    stage: Stage,
}

#[derive(Debug, Clone, PartialEq)]
enum Stage {
    /// Woken: the queues' rate is being measured after the move.
    Running {
        /// The thread relieved and the one woken.
        from: usize,
        to: usize,
        /// The queues moved.
        moved: Vec<QueueId>,
        /// Their highest rate over the ticks that confirmed the probe.
        before: f64,
        /// Their lowest rate over `ticks` ticks since the settle time.
        low: f64,
        ticks: u32,
    },
    /// It paid: neither thread is parked while the queues keep this rate.
    Kept { threads: [usize; 2], rate: f64 },
    /// It did not pay: not tried again before `until_ms` while the queues
    /// keep the rate they had on one thread (the highest of the ticks that
    /// confirmed the probe: a tick measured after the revert may be a
    /// partial one, at the start or the end of a burst). A pause is not a
    /// new workload: only `confirm_hot` busy ticks in a row out of the band
    /// forget it (`away` counts them); an idle tick, or one back in the
    /// band, starts the count again.
    Refused { rate: f64, until_ms: u64, away: u32 },
}

/// The policy's state between ticks.
#[derive(Debug, Clone)]
pub struct AutoTune {
    params: Params,
    /// When each queue last moved, ms.
    last_move: HashMap<QueueId, u64>,
    /// No decision before this time, ms.
    settle_until: u64,
    streaks: Streaks,
    /// The last probe, while its verdict holds.
    probe: Option<Probe>,
}

/// The per-tick view the rules work on.
#[derive(Clone)]
struct View<'a> {
    sample: &'a Sample,
    /// Work fraction per thread, updated as decisions are planned.
    load: Vec<f64>,
    /// Queue index (in the sample) -> owner, updated as decisions are planned.
    owner: Vec<usize>,
    /// Load of each queue.
    qload: Vec<f64>,
    /// CPU seconds per request on each thread.
    cost: Vec<f64>,
    /// Queues already given a decision this tick (one each).
    planned: Vec<bool>,
}

impl View<'_> {
    fn active(&self, t: usize) -> bool {
        self.owner.contains(&t)
    }
    fn actives(&self) -> Vec<usize> {
        (0..self.load.len()).filter(|&t| self.active(t)).collect()
    }
    fn queues_on(&self, t: usize) -> Vec<usize> {
        (0..self.owner.len())
            .filter(|&i| self.owner[i] == t)
            .collect()
    }
    /// Whether `t` is the home of one of its queues (no list built: the
    /// sort of park candidates asks this for every comparison).
    fn is_home(&self, t: usize) -> bool {
        self.owner
            .iter()
            .zip(&self.sample.queues)
            .any(|(&o, q)| o == t && q.home == Some(t))
    }
    fn has_pinned(&self, t: usize) -> bool {
        self.queues_on(t)
            .iter()
            .any(|&i| self.sample.queues[i].pinned)
    }
}

impl AutoTune {
    /// A policy with `params` and no history.
    pub fn new(params: Params) -> Self {
        AutoTune {
            params,
            last_move: HashMap::new(),
            settle_until: 0,
            streaks: Streaks::default(),
            probe: None,
        }
    }

    /// The knobs.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The decisions for this tick (empty: leave everything where it is).
    /// The caller carries them out and reports the new owners in the next
    /// sample; a move that failed shows as the old owner there.
    pub fn decide(&mut self, s: &Sample) -> Vec<Decision> {
        let p = self.params;
        let mut v = self.view(s);
        if s.now_ms < self.settle_until {
            self.streaks = Streaks::default();
            return Vec::new();
        }
        let out = match self.probe_verdict(&mut v) {
            // A probe being measured, or undone, takes the tick: nothing
            // else moves, so that the rate it sees is its own doing.
            Some(d) => d,
            None => {
                let mut out = self.budget(&mut v);
                if out.is_empty() {
                    out = self.balance_or_activate(&mut v);
                }
                if out.is_empty() {
                    out = self.start_probe(&mut v);
                }
                if out.is_empty() {
                    out = self.park(&mut v);
                }
                out
            }
        };
        if !out.is_empty() {
            self.streaks = Streaks::default();
            self.settle_until = s.now_ms + p.settle_ms;
            for d in &out {
                self.last_move.insert(d.queue, s.now_ms);
            }
        }
        // Forget queues that are gone (an export removed).
        self.last_move
            .retain(|q, _| s.queues.iter().any(|x| x.id == *q));
        out
    }

    fn view<'a>(&self, s: &'a Sample) -> View<'a> {
        let n = s.threads.len();
        let load: Vec<f64> = s.threads.iter().map(|t| t.work.clamp(0.0, 1.0)).collect();
        let mut rate_on = vec![0.0; n];
        for q in &s.queues {
            if q.owner < n {
                rate_on[q.owner] += q.rate.max(0.0);
            }
        }
        let cost: Vec<f64> = (0..n)
            .map(|t| {
                if rate_on[t] > 1.0 && load[t] > 0.0 {
                    load[t] / rate_on[t]
                } else {
                    self.params.default_cost_s
                }
            })
            .collect();
        let qload = s
            .queues
            .iter()
            .map(|q| q.rate.max(0.0) * cost.get(q.owner).copied().unwrap_or(0.0))
            .collect();
        View {
            sample: s,
            load,
            owner: s.queues.iter().map(|q| q.owner).collect(),
            qload,
            cost,
            planned: vec![false; s.queues.len()],
        }
    }

    /// May queue `i` of the sample move now (not pinned, dwell over)?
    fn movable(&self, v: &View, i: usize, honour_dwell: bool) -> bool {
        let q = &v.sample.queues[i];
        if q.pinned || v.planned[i] {
            return false;
        }
        !honour_dwell
            || self
                .last_move
                .get(&q.id)
                .is_none_or(|&t| v.sample.now_ms >= t + self.params.dwell_ms)
    }

    /// Does a move of queue `i` that lowers its thread's load by `freed`
    /// pay for the requests its drain costs?
    fn pays(&self, v: &View, i: usize, freed: f64) -> bool {
        let p = &self.params;
        let q = &v.sample.queues[i];
        let from = v.owner[i];
        let lost = q.rate * p.move_cost_s;
        let gained = freed / v.cost[from] * p.dwell_ms as f64 / 1000.0;
        gained >= p.payback * lost
    }

    fn plan(&self, v: &mut View, i: usize, to: usize, reason: Reason) -> Decision {
        let from = v.owner[i];
        let l = v.qload[i];
        // A queue's cost per request is its workload's (request sizes,
        // backend): it carries the same load to its new thread.
        v.load[from] = (v.load[from] - l).max(0.0);
        v.load[to] += l;
        v.owner[i] = to;
        v.planned[i] = true;
        Decision {
            queue: v.sample.queues[i].id,
            from,
            to,
            reason,
            load: l,
        }
    }

    /// Empties `t` onto the other active threads, coolest first, heaviest
    /// queue first. None if a queue of `t` may not move.
    fn empty_thread(
        &self,
        v: &mut View,
        t: usize,
        reason: Reason,
        honour_dwell: bool,
    ) -> Option<Vec<Decision>> {
        let mut qs = v.queues_on(t);
        if qs.iter().any(|&i| !self.movable(v, i, honour_dwell)) {
            return None;
        }
        let targets: Vec<usize> = v.actives().into_iter().filter(|&o| o != t).collect();
        if targets.is_empty() {
            return None;
        }
        qs.sort_by(|&a, &b| v.qload[b].total_cmp(&v.qload[a]));
        let mut out = Vec::new();
        for i in qs {
            let to = *targets
                .iter()
                .min_by(|&&a, &&b| v.load[a].total_cmp(&v.load[b]))
                .expect("not empty");
            out.push(self.plan(v, i, to, reason));
        }
        Some(out)
    }

    fn budget(&mut self, v: &mut View) -> Vec<Decision> {
        let mut out = Vec::new();
        loop {
            let actives = v.actives();
            if actives.len() <= self.params.max_active {
                return out;
            }
            // The coolest thread whose queues may all move.
            let mut candidates: Vec<usize> =
                actives.into_iter().filter(|&t| !v.has_pinned(t)).collect();
            candidates.sort_by(|&a, &b| v.load[a].total_cmp(&v.load[b]));
            let Some(&t) = candidates.first() else {
                return out;
            };
            match self.empty_thread(v, t, Reason::Budget, false) {
                Some(d) => out.extend(d),
                None => return out,
            }
        }
    }

    fn balance_or_activate(&mut self, v: &mut View) -> Vec<Decision> {
        let p = self.params;
        let actives = v.actives();
        let mut hot: Vec<usize> = actives
            .iter()
            .copied()
            .filter(|&t| v.load[t] > p.balance_above)
            .collect();
        hot.sort_by(|&a, &b| v.load[b].total_cmp(&v.load[a]));
        // Planned on a copy: nothing changes until the rule is confirmed.
        let mut w = v.clone();
        let mut out = Vec::new();
        let mut saturated = Vec::new();
        let mut parked = (0..v.load.len())
            .filter(|&t| !v.active(t))
            .collect::<Vec<_>>();
        let mut room = p.max_active.saturating_sub(actives.len()).min(parked.len());
        let mut starved = Vec::new();
        for h in hot.iter().copied() {
            let splittable = w.load[h] > p.activate_above && w.queues_on(h).len() > 1;
            // A pegged thread's queues want more than they show: moving one
            // to a busy thread would peg that one too; a parked thread is
            // the place for it while there is room.
            if splittable && w.load[h] >= p.pegged {
                if room > 0 {
                    saturated.push(h);
                    room -= 1;
                } else {
                    starved.push(h);
                }
                continue;
            }
            let c = *actives
                .iter()
                .min_by(|&&a, &&b| w.load[a].total_cmp(&w.load[b]))
                .expect("a hot thread is active");
            let best = (c != h)
                .then(|| {
                    w.queues_on(h)
                        .into_iter()
                        .filter(|&i| self.movable(&w, i, true))
                        .map(|i| {
                            let l = w.qload[i];
                            let after = (w.load[h] - l).max(w.load[c] + l);
                            (i, w.load[h] - after)
                        })
                        .filter(|&(i, gain)| gain >= p.min_gain && self.pays(&w, i, gain))
                        .max_by(|a, b| a.1.total_cmp(&b.1))
                })
                .flatten();
            match best {
                Some((i, _)) => out.push(self.plan(&mut w, i, c, Reason::Balance)),
                None if splittable && room > 0 => {
                    saturated.push(h);
                    room -= 1;
                }
                None => {}
            }
        }
        // Pegged threads and no parked one to wake: empty the coolest
        // threads onto the other cool ones, and wake them for the pegged
        // ones in the same round.
        'starved: for h in starved {
            let want = (w.queues_on(h).len() - 1).min(3);
            for n in 0..want {
                let Some((t, d)) = self.free_a_thread(&mut w, &hot, false) else {
                    if n > 0 {
                        saturated.push(h);
                    }
                    break 'starved;
                };
                out.extend(d);
                parked.push(t);
            }
            saturated.push(h);
        }
        if out.is_empty() && saturated.is_empty() {
            self.streaks.hot = 0;
            return Vec::new();
        }
        self.streaks.hot += 1;
        if self.streaks.hot < p.confirm_hot {
            return Vec::new();
        }
        let mut active = w.actives().len();
        parked.sort_unstable_by(|a, b| b.cmp(a));
        for h in saturated {
            // A pegged thread hides how much more its queues want: it wakes
            // up to three threads at once, so that a large host reaches its
            // active set in a few rounds (the active set can quadruple per
            // round); parking gathers the cool ones again later.
            let want = if w.load[h] >= p.pegged { 3 } else { 1 };
            let room = p.max_active.saturating_sub(active).min(parked.len());
            let groups = self.split(&w, h, want.min(room));
            for group in groups {
                let t = parked.pop().expect("no more groups than parked threads");
                for i in group {
                    out.push(self.plan(&mut w, i, t, Reason::Activate));
                }
                active += 1;
            }
        }
        *v = w;
        out
    }

    /// Empties the coolest active thread that is not `hot` onto the other
    /// active threads that are not, each staying below `park_below`, and
    /// returns it with the moves. Its queues may not be pinned; to make
    /// room for a pegged thread their dwell time is not honoured: that
    /// happens only before convergence, and moves only cool queues.
    fn free_a_thread(
        &self,
        v: &mut View,
        hot: &[usize],
        honour_dwell: bool,
    ) -> Option<(usize, Vec<Decision>)> {
        let p = self.params;
        let cool: Vec<usize> = v
            .actives()
            .into_iter()
            .filter(|t| !hot.contains(t))
            .collect();
        let mut candidates: Vec<usize> = cool
            .iter()
            .copied()
            .filter(|&t| {
                !v.has_pinned(t)
                    && v.queues_on(t)
                        .iter()
                        .all(|&i| self.movable(v, i, honour_dwell))
            })
            .collect();
        // The coolest first; a thread that is home to one of its queues
        // last (it runs where their completions arrive).
        candidates.sort_by(|&a, &b| {
            (v.is_home(a).cmp(&v.is_home(b))).then(v.load[a].total_cmp(&v.load[b]))
        });
        for t in candidates {
            let mut w = v.clone();
            let mut qs = w.queues_on(t);
            qs.sort_by(|&a, &b| w.qload[b].total_cmp(&w.qload[a]));
            let mut out = Vec::new();
            for i in qs {
                // Best fit: the fullest cool thread that stays below
                // `park_below`, so that the next thread can go too.
                // A queue without requests adds nothing: any active thread
                // takes it, the one with the fewest queues first.
                let l = w.qload[i];
                let fit = cool
                    .iter()
                    .copied()
                    .filter(|&o| o != t && w.active(o) && w.load[o] + l < p.park_below)
                    .max_by(|&a, &b| w.load[a].total_cmp(&w.load[b]));
                let idle = || {
                    (l < IDLE_LOAD)
                        .then(|| {
                            w.actives()
                                .into_iter()
                                .filter(|&o| o != t)
                                .min_by_key(|&o| w.queues_on(o).len())
                        })
                        .flatten()
                };
                let Some(to) = fit.or_else(idle) else {
                    break;
                };
                out.push(self.plan(&mut w, i, to, Reason::Park));
            }
            if !w.active(t) && cool.iter().all(|&o| w.load[o] < p.park_below) {
                *v = w;
                return Some((t, out));
            }
        }
        None
    }

    /// Splits the queues of saturated thread `h` into itself and up to
    /// `ways` woken threads, longest processing time first (the queues that
    /// may not move stay on `h`). Returns the groups to move, none empty.
    /// Activation is the one rule that ignores the dwell time: it only ever
    /// adds threads, so it cannot oscillate by itself, and a large host
    /// would otherwise wait a dwell period per doubling.
    fn split(&self, v: &View, h: usize, ways: usize) -> Vec<Vec<usize>> {
        if ways == 0 {
            return Vec::new();
        }
        let (mut qs, stay): (Vec<usize>, Vec<usize>) = v
            .queues_on(h)
            .into_iter()
            .partition(|&i| self.movable(v, i, false));
        qs.sort_by(|&a, &b| v.qload[b].total_cmp(&v.qload[a]));
        let mut load = vec![0.0f64; ways + 1];
        load[0] = stay.iter().map(|&i| v.qload[i]).sum();
        let mut groups = vec![Vec::new(); ways + 1];
        for i in qs {
            let g = (0..=ways)
                .min_by(|&a, &b| load[a].total_cmp(&load[b]))
                .expect("not empty");
            load[g] += v.qload[i];
            groups[g].push(i);
        }
        groups
            .into_iter()
            .skip(1)
            .map(|g| {
                g.into_iter()
                    .filter(|&i| self.pays(v, i, v.qload[i]))
                    .collect::<Vec<_>>()
            })
            .filter(|g| !g.is_empty())
            .collect()
    }

    /// Carries a probe on: measures a running one and gives its verdict
    /// (Some while it runs: none, or the moves that undo it; None: the other
    /// rules decide), and forgets a verdict whose queues' rate left the band
    /// it was measured at (the workload changed).
    fn probe_verdict(&mut self, v: &mut View) -> Option<Vec<Decision>> {
        let p = self.params;
        let now = v.sample.now_ms;
        let mut probe = self.probe.take()?;
        let rate = rate_of(v.sample, &probe.queues);
        let keep = |r: f64| (rate - r).abs() <= r * p.probe_band;
        let mut out = None;
        match &mut probe.stage {
            Stage::Running {
                from,
                to,
                moved,
                before,
                low,
                ticks,
            } => {
                *low = low.min(rate);
                *ticks += 1;
                // The lowest tick only falls: one below the gain already
                // decides, a tick before the last.
                let pays = *low >= *before * (1.0 + p.probe_gain);
                if pays && *ticks < p.probe_ticks {
                    out = Some(Vec::new());
                } else if pays {
                    probe.stage = Stage::Kept {
                        threads: [*from, *to],
                        rate: *low,
                    };
                } else {
                    let (from, to, before) = (*from, *to, *before);
                    let back: Vec<usize> = indexes_of(v.sample, moved)
                        .filter(|&i| v.owner[i] == to)
                        .collect();
                    out = Some(
                        back.into_iter()
                            .map(|i| self.plan(v, i, from, Reason::Revert))
                            .collect(),
                    );
                    probe.stage = Stage::Refused {
                        rate: before,
                        until_ms: now + p.probe_retry_ms,
                        away: 0,
                    };
                }
            }
            Stage::Kept { threads, rate: r } => {
                // A load that grew keeps it too: it wants the threads more.
                if !threads.iter().all(|&t| v.active(t)) || rate < *r * (1.0 - p.probe_band) {
                    return None;
                }
            }
            Stage::Refused {
                rate: r,
                until_ms,
                away,
            } => {
                if now >= *until_ms {
                    return None;
                }
                // Idle queues (a pause) say nothing of the workload, nor
                // does one tick (the partial one a burst starts or ends in).
                if load_of(v, &probe.queues) >= IDLE_LOAD && !keep(*r) {
                    *away += 1;
                } else {
                    *away = 0;
                }
                if *away >= p.confirm_hot {
                    return None;
                }
            }
        }
        self.probe = Some(probe);
        out
    }

    /// Rule 3b, *probe*: an active thread that is awake all the time
    /// (`probe_awake`) but not saturated, with several busy queues, hands
    /// about half of them to a parked thread once confirmed, and
    /// [`Self::probe_verdict`] keeps the move only if the queues' rate grows
    /// by `probe_gain`. Its load cannot say whether a second thread pays:
    /// the time it spends polling may be its queues waiting on each other.
    /// One probe at a time; one that did not pay is not tried again for
    /// the same queues at the same rate, pauses between (`Stage::Refused`).
    fn start_probe(&mut self, v: &mut View) -> Vec<Decision> {
        let p = self.params;
        let s = v.sample;
        let parked = (0..v.load.len()).find(|&t| !v.active(t));
        let actives = v.actives();
        let candidate = parked
            .filter(|_| actives.len() < p.max_active)
            .and_then(|_| {
                actives
                    .iter()
                    .copied()
                    .filter(|&t| {
                        let th = &s.threads[t];
                        th.work + th.poll >= p.probe_awake && th.together >= p.probe_together
                    })
                    .map(|t| {
                        let busy: Vec<usize> = v
                            .queues_on(t)
                            .into_iter()
                            .filter(|&i| v.qload[i] >= IDLE_LOAD && !s.queues[i].pinned)
                            .collect();
                        (t, busy)
                    })
                    .filter(|(_, busy)| {
                        busy.len() >= 2 && busy.iter().all(|&i| self.movable(v, i, true))
                    })
                    .max_by_key(|(_, busy)| busy.len())
            });
        let blocked = |ids: &[QueueId]| match &self.probe {
            None => false,
            Some(Probe {
                queues,
                stage: Stage::Refused { .. },
            }) => queues == ids,
            Some(_) => true,
        };
        let Some((h, ids)) = candidate
            .map(|(h, busy)| {
                let mut ids: Vec<QueueId> = busy.iter().map(|&i| s.queues[i].id).collect();
                ids.sort_unstable();
                (h, ids)
            })
            .filter(|(_, ids)| !blocked(ids))
        else {
            self.streaks.probe = 0;
            self.streaks.probe_high = 0.0;
            return Vec::new();
        };
        // Measured as the verdict measures it.
        let rate = rate_of(s, &ids);
        self.streaks.probe_high = self.streaks.probe_high.max(rate);
        self.streaks.probe += 1;
        if self.streaks.probe < p.confirm_hot {
            return Vec::new();
        }
        let before = self.streaks.probe_high;
        let to = parked.expect("a candidate needs a parked thread");
        let Some(group) = self.split(v, h, 1).into_iter().next() else {
            return Vec::new();
        };
        let out: Vec<Decision> = group
            .into_iter()
            .map(|i| self.plan(v, i, to, Reason::Probe))
            .collect();
        self.probe = Some(Probe {
            queues: ids,
            stage: Stage::Running {
                from: h,
                to,
                moved: out.iter().map(|d| d.queue).collect(),
                before,
                low: f64::INFINITY,
                ticks: 0,
            },
        });
        out
    }

    fn park(&mut self, v: &mut View) -> Vec<Decision> {
        let p = self.params;
        // Threads at `park_below` or above neither give nor take queues, nor
        // do the threads of a probe that paid.
        let kept = match &self.probe {
            Some(Probe {
                stage: Stage::Kept { threads, .. },
                ..
            }) => &threads[..],
            _ => &[],
        };
        let busy: Vec<usize> = (0..v.load.len())
            .filter(|&t| v.load[t] >= p.park_below || kept.contains(&t))
            .collect();
        let mut w = v.clone();
        let mut out = Vec::new();
        while let Some((_, d)) = self.free_a_thread(&mut w, &busy, true) {
            out.extend(d);
        }
        if out.is_empty() {
            self.streaks.park = 0;
            return Vec::new();
        }
        self.streaks.park += 1;
        if self.streaks.park < p.confirm_park {
            return Vec::new();
        }
        *v = w;
        out
    }
}

/// The indexes in `s` of `queues`.
fn indexes_of<'a>(s: &'a Sample, queues: &'a [QueueId]) -> impl Iterator<Item = usize> + 'a {
    (0..s.queues.len()).filter(move |&i| queues.contains(&s.queues[i].id))
}

/// The summed load of `queues` (a fraction of a core) in `v`.
fn load_of(v: &View, queues: &[QueueId]) -> f64 {
    indexes_of(v.sample, queues).map(|i| v.qload[i]).sum()
}

/// The summed request rate of `queues` in `s`.
fn rate_of(s: &Sample, queues: &[QueueId]) -> f64 {
    indexes_of(s, queues)
        .map(|i| s.queues[i].rate.max(0.0))
        .sum()
}

#[cfg(test)]
mod tests;

//! The adaptive algorithm (ours): poll only for intervals polling can catch, and
//! only when it pays.
//!
//! The goal: keep IOPS within 5% of busy polling (the maintainer's bar for a new
//! default) while burning much less CPU than the weighted algorithm. The reasoning
//! starts from what polling buys. With a window `W`, an event `t` ns after the wait
//! starts is a *hit* if `t <= W`: it costs `t` of CPU and no wake-up. Otherwise
//! polling wasted `W` of CPU *and* the request still pays the wake-up (epoll sleep,
//! interrupt, context switch: [`PollPolicy::wakeup_ns`](super::PollPolicy::wakeup_ns),
//! measured on this host as the lateness of a timed nap: 8-16 us on this project's
//! VM when its host is quiet, 30-65 us when it is loaded). The CPU
//! spent on hits is the same for every scheme that catches the event, busy polling
//! included; what a policy controls is (a) how many wake-ups it lets through, which
//! costs latency and so IOPS, and (b) how much CPU it burns on misses, `W` each.
//! The QEMU algorithms get both wrong on mixed workloads: the classic window
//! collapses to 0 at every wait longer than `poll-max-ns`, and the weighted window
//! follows an average of *all* waits, too short for the tail of the short intervals
//! (misses that cost IOPS) and inflated by the long ones (CPU wasted).
//!
//! 1. **Learn the pollable intervals only.** Each source estimates its interval from
//!    the samples `x <= poll-max-ns` (longer ones can never be caught by polling,
//!    and would only inflate the window when polling is least useful): a mean (gain
//!    1/8) and a mean deviation (gain 1/4), as TCP's RTT estimator (Jacobson/Karels,
//!    RFC 6298), plus a decaying peak, `peak = max(x, peak - peak/256)`. A wait that
//!    ended after a sleep includes the wake-up, so `wakeup_ns` is removed from it
//!    (at most 3/4 of the wait, so that an overstated wake-up cannot shrink it to
//!    nothing; and the interval was at least the window polled in vain). A
//!    source whose last 32 events all came after more than `poll-max-ns` forgets
//!    its estimate: its short intervals belonged to an earlier phase.
//! 2. **Cover them, with a margin.** A source's cover is
//!    `max(mean + max(mean * margin_pct / 100, 4 * dev), peak + peak / 8)`, capped by
//!    `poll-max-ns`: 1.5x the mean when intervals are steady, the TCP-RTO-like
//!    `mean + 4 dev` under symmetric jitter, and just above the recent peak (which
//!    decays with a half-life of about 177 samples, so it follows a high percentile
//!    rather than the all-time maximum) for skewed tails. The target `T` is the
//!    largest cover among the sources that had an event within the last
//!    `poll-max-ns` of waiting, or whose guest the last pass answered
//!    ([`Adaptive::observe_answered`]): a queue that went quiet stops holding the
//!    window up, as in the weighted ageing, but keeps its statistics for when it
//!    comes back; and a queue handed completions is due to send its next
//!    requests, however long it waited for the device (a virtual disk at
//!    iodepth 16: ~175 us between batches, the driver's next requests a few
//!    microseconds after each). As in QEMU, the maximum over sources.
//! 3. **Poll only if it pays, in CPU or in IOPS.** The IOThread tracks its hit rate
//!    `p` (EWMA, gain 1/8) of "the event came within `T`": measured when it polled
//!    the full window, counterfactual (from the corrected sample) when it polled
//!    less or not at all, so it keeps learning while polling is off. Polling with
//!    window `T` saves `p * wakeup_ns` of wake-up latency per iteration and wastes
//!    `(1 - p) * T` of CPU. It polls if
//!    (a) `p * wakeup_ns >= (1 - p) * T * max(1, depth)`: polling pays for
//!    itself (the ski-rental break-even: at depth 1, with `T = 12 us` it needs
//!    `p >= 0.44`, with `T = 32 us` `p >= 0.68`). `depth` is defined under (b):
//!    as shares, the wake-up saved is `wakeup / (depth * cycle)` of a request's
//!    round trip and the CPU wasted `(1 - p) * T / cycle` of an event's, so
//!    with 16 requests in flight a miss must be 16 times rarer to pay; or
//!    (b) `p * wakeup_ns > latency_budget_pct * cycle * max(1, depth)`: the
//!    wake-ups would cost more than the IOPS budget (2% by default) of a
//!    request's round trip. `cycle` is the mean interval between events (EWMA,
//!    samples capped at 1 ms) and `depth` a request's round trip in cycles: the
//!    mean number of requests the backend held while the thread waited (EWMA,
//!    fed by [`Adaptive::observe_in_flight`]) over the mean number each pass
//!    finished ([`Adaptive::observe_finished`]), at least 1. By Little's law a
//!    request's round trip is that many cycles, and a wake-up added to each
//!    completion of a pipeline `depth` deep costs `wakeup / (depth * cycle)` of
//!    its IOPS, not `wakeup / cycle`; where completions come in batches (a
//!    VM's virtual disk at iodepth 16: about 7 per pass), counting every
//!    request held as a cycle made a wake-up look 7 times cheaper. At queue depth
//!    1, or with a backend that completes inline (null), this is the event
//!    cycle; an RBD image at iodepth 16 (16 requests in flight, one completion
//!    every 50-100 us) does not pay 15-25% more CPU per I/O for polling that buys
//!    less than 1% of IOPS; or
//!    (c) the last iterations were hits, at least two and a run less likely than
//!    1/64 under the hit rate (as rule 4 judges a run of misses): re-arm at
//!    once, without waiting for the average to climb back. After a change to
//!    short intervals (`p` near 0) two hits do it, as before; where hits are
//!    common but do not pay (an RBD image at iodepth 16, `p` about 0.6) a pair
//!    of them is no news, and re-arming on every pair kept the gate open a
//!    third of the time.
//!    Waits after a pass that answered a guest and the other waits (after a
//!    submission to the backend) each have their own hit rate and runs: at
//!    iodepth 16 on a virtual disk the first end with the driver's requests
//!    within microseconds, the second with the device's next batch hundreds
//!    of microseconds later. One hit rate for both hovered near 1/2 and
//!    opened the gate before the device's batch as often as before the
//!    driver's answer.
//!    Rule (b) is what holds IOPS: when intervals straddle `poll-max-ns` it keeps
//!    polling, and pays CPU for it, where both QEMU algorithms give up (the `mid`
//!    trace of the simulation). `latency_budget_pct = 100` disables it and leaves a
//!    CPU-first policy.
//! 4. **Back off on a surprising run of misses, re-arm on a hit.** A run of misses
//!    is a surprise once it is at least `miss_limit` long and its probability under
//!    the current hit rate has fallen below 1/64 (3 misses when `p` was about 1, a
//!    dozen at `p = 0.3`, where runs of misses are normal): the workload changed or
//!    the device went idle, and the averages lag. The window then halves with every
//!    further miss, down to 0 (windows halved below [`ADAPTIVE_MIN_POLL_NS`] are not worth
//!    a polling pass). The first hit, or an event that the full window would have
//!    caught, restores the full window.
//! 5. **Nap through the predictable part of the wait** (hybrid polling, as the
//!    kernel's blk-mq): see the `nap` module. Each source's [`Rhythm`] lives here,
//!    beside its interval estimate.
//! 6. **Try the other way now and then**: a thread that serves requests
//!    compares, in short alternating windows, the requests it finishes a
//!    second waiting as rules 1-5 say and sleeping (after a spin no longer
//!    than a sleep costs the thread, no nap); where
//!    sleeping is as fast (within the IOPS budget), it sleeps until the next
//!    trial. See the `trial` module; [`PollPolicy`](super::PollPolicy)
//!    holds the trials beside this state and overrides its window.

use super::nap::Rhythm;
use super::{ewma, jacobson, AdaptiveParams, PollParams, ADAPTIVE_MIN_POLL_NS, MEAN_SHIFT};

/// Hit-rate fixed point: 1.0 == `RATE_ONE`.
const RATE_ONE: u32 = 1024;
/// Gain of the hit-rate EWMA (1/8).
const RATE_SHIFT: u32 = 3;
/// Deviations added to the mean interval for the cover (as TCP's RTO = SRTT + 4 RTTVAR).
const DEV_MULT: u64 = 4;
/// Interval samples are capped at 1 ms for the mean cycle: beyond that a wake-up
/// costs less than 1.5% anyway, and an idle period must not close the gate for long.
const CYCLE_SAMPLE_CAP_NS: u64 = 1_000_000;
/// Decay of the adaptive peak per short sample (1/256: half-life about 177 samples).
const PEAK_SHIFT: u32 = 8;
/// Headroom of the cover over the peak (1/8).
const PEAK_HEADROOM_SHIFT: u32 = 3;
/// Run-of-misses probability fixed point: 1.0 == `ODDS_ONE`.
const ODDS_ONE: u64 = 1 << 16;
/// A run of misses less likely than 1/64 under the hit rate means the workload
/// changed: back off.
const ODDS_SURPRISE: u64 = ODDS_ONE / 64;
/// Consecutive events of a source, each after more than `poll-max-ns`, after
/// which its short-interval estimate is forgotten.
const FORGET_AFTER_LONG: u32 = 32;
/// Consecutive hits that re-open a closed adaptive gate.
const REARM_HITS: u32 = 2;
/// In-flight depth fixed point: 1 request == `DEPTH_ONE`.
const DEPTH_ONE: u64 = 256;
/// In-flight samples are capped (a queue is at most 32768 entries deep; the
/// budget is already far above any wake-up at a few hundred).
const DEPTH_SAMPLE_CAP: u64 = 1024;

/// One source of the adaptive algorithm.
#[derive(Debug, Clone, Copy, Default)]
struct AdaptiveSource {
    /// Mean of its short intervals (0: no sample yet).
    mean: u64,
    /// Mean deviation of its short intervals.
    dev: u64,
    /// Decaying peak of its short intervals.
    peak: u64,
    /// Sum of the `block_ns` reported since the source's last event.
    idle_ns: u64,
    /// The timing of its events, for naps.
    rhythm: Rhythm,
    /// Consecutive events of this source that came after more than
    /// `poll-max-ns` of waiting.
    long_run: u32,
}

impl AdaptiveSource {
    /// Jacobson/Karels update of the mean and mean deviation, and the peak.
    fn estimate_interval(&mut self, x: u64) {
        self.peak = if self.mean == 0 {
            x
        } else {
            x.max(self.peak - (self.peak >> PEAK_SHIFT))
        };
        jacobson(&mut self.mean, &mut self.dev, x);
    }

    /// The window this source asks for (0 without a sample).
    fn cover(&self, knobs: &AdaptiveParams, max: u64) -> u64 {
        if self.mean == 0 {
            return 0;
        }
        let margin = (self.mean.saturating_mul(knobs.margin_pct) / 100)
            .max(self.dev.saturating_mul(DEV_MULT));
        let tail = self.peak.saturating_add(self.peak >> PEAK_HEADROOM_SHIFT);
        self.mean.saturating_add(margin).max(tail).min(max)
    }
}

/// The hit rate and the runs of hits and misses of one kind of wait (rules 3
/// and 4).
#[derive(Debug, Clone, Copy)]
struct Gate {
    /// Hit-rate EWMA, `RATE_ONE` == 1.0.
    hit_rate: u32,
    /// Consecutive hits.
    hit_streak: u32,
    /// Probability of the current run of hits under the hit rate (`ODDS_ONE` == 1.0).
    streak_odds: u64,
    /// Consecutive misses.
    miss_streak: u32,
    /// Probability of the current run of misses under the hit rate (`ODDS_ONE` == 1.0).
    run_odds: u64,
    /// Halvings of the window (misses since the run became surprising).
    backoff: u32,
}

impl Default for Gate {
    /// No history: a hit rate of 1/2.
    fn default() -> Self {
        Gate {
            hit_rate: RATE_ONE / 2,
            hit_streak: 0,
            streak_odds: ODDS_ONE,
            miss_streak: 0,
            run_odds: ODDS_ONE,
            backoff: 0,
        }
    }
}

impl Gate {
    /// Counts one wait: whether the full target window caught (or would have
    /// caught) its event.
    fn record(&mut self, hit: bool, miss_limit: u32) {
        self.hit_rate = self.hit_rate - (self.hit_rate >> RATE_SHIFT)
            + if hit { RATE_ONE >> RATE_SHIFT } else { 0 };
        if hit {
            self.hit_streak = self.hit_streak.saturating_add(1);
            self.streak_odds = self.streak_odds * u64::from(self.hit_rate) / u64::from(RATE_ONE);
            self.miss_streak = 0;
            self.run_odds = ODDS_ONE;
            self.backoff = 0;
        } else {
            self.miss_streak = self.miss_streak.saturating_add(1);
            self.hit_streak = 0;
            self.streak_odds = ODDS_ONE;
            // Odds of this run of misses if the hit rate were right.
            let miss_rate = u64::from(RATE_ONE - self.hit_rate);
            self.run_odds = self.run_odds * miss_rate / u64::from(RATE_ONE);
            if self.miss_streak >= miss_limit && self.run_odds < ODDS_SURPRISE {
                self.backoff = self.backoff.saturating_add(1);
            }
        }
    }
}

/// What the thread did just before a wait: the gates of the two kinds learn
/// apart (rule 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    /// Anything but an answer: it submitted to the backend, or the wait
    /// ended empty.
    Other = 0,
    /// It handed completions back to a guest: that guest's next requests are
    /// due, a turnaround away.
    Answer = 1,
}

/// State of [`super::PollMode::Adaptive`].
#[derive(Debug, Clone)]
pub(super) struct Adaptive {
    /// Per-source estimates.
    sources: Vec<AdaptiveSource>,
    /// The full target window (before gate and back-off).
    target_ns: u64,
    /// The gate of waits after anything else, and after an answer.
    gates: [Gate; 2],
    /// What the coming wait follows.
    after: After,
    /// EWMA of the interval between events of any source (capped samples).
    cycle_ns: u64,
    /// EWMA of the requests the backend held at the start of each wait, fixed
    /// point (`DEPTH_ONE` == 1 request).
    depth: u64,
    /// EWMA of the requests each pass finished, fixed point (`DEPTH_ONE` == 1
    /// request; 0: not observed, taken as 1).
    batch: u64,
}

impl Adaptive {
    /// A fresh state for `n` sources: no samples, a hit rate of 1/2.
    pub(super) fn new(n: usize) -> Self {
        Adaptive {
            sources: vec![AdaptiveSource::default(); n],
            target_ns: 0,
            gates: [Gate::default(); 2],
            after: After::Other,
            cycle_ns: 0,
            depth: 0,
            batch: 0,
        }
    }

    /// Sets the number of sources; removed ones are forgotten, added ones are fresh.
    pub(super) fn resize(&mut self, n: usize) {
        self.sources.resize(n, AdaptiveSource::default());
    }

    /// The cover of source `i`, ignoring gate and back-off (`None` if there is no
    /// such source).
    pub(super) fn source_ns(&self, i: usize, knobs: &AdaptiveParams, max: u64) -> Option<u64> {
        self.sources.get(i).map(|s| s.cover(knobs, max))
    }

    /// The full target window computed by the last [`Self::refresh`].
    #[cfg(test)]
    pub(super) fn target_ns(&self) -> u64 {
        self.target_ns
    }

    /// The sources' rhythms, for naps.
    pub(super) fn rhythms(&self) -> impl Iterator<Item = &Rhythm> {
        self.sources.iter().map(|s| &s.rhythm)
    }

    /// The sources in `events` had an event at `now_ns`: feeds their rhythms.
    /// Duplicates and unknown indexes are ignored.
    pub(super) fn observe_events_at(&mut self, now_ns: u64, events: &[usize]) {
        for &i in events {
            if let Some(s) = self.sources.get_mut(i) {
                s.rhythm.observe(now_ns);
            }
        }
    }

    /// The pass before the coming wait handed completions to the guests
    /// behind `sources` (none: it answered no one). Each counts as active
    /// again (rule 2), and the wait is judged by the gate of its kind (rule
    /// 3). Returns whether the window must be recomputed.
    pub(super) fn observe_answered(
        &mut self,
        sources: impl IntoIterator<Item = usize>,
        max: u64,
    ) -> bool {
        let mut changed = false;
        let mut after = After::Other;
        for i in sources {
            after = After::Answer;
            if let Some(s) = self.sources.get_mut(i) {
                changed |= s.idle_ns >= max;
                s.idle_ns = 0;
            }
        }
        changed |= after != self.after;
        self.after = after;
        changed
    }

    /// Whether the coming wait follows a pass that answered a guest.
    pub(super) fn after_answer(&self) -> bool {
        self.after == After::Answer
    }

    /// The gate of the coming wait.
    fn gate(&self) -> &Gate {
        &self.gates[self.after as usize]
    }

    /// The backend holds `n` requests at the start of this wait: feeds the depth
    /// that scales the break-even and the IOPS budget (rules 3a and 3b).
    pub(super) fn observe_in_flight(&mut self, n: u64) {
        let x = n.min(DEPTH_SAMPLE_CAP) * DEPTH_ONE;
        self.depth = ewma(self.depth, x, MEAN_SHIFT);
    }

    /// The last pass finished `n` requests: feeds the batch that turns the
    /// depth into a round trip in event intervals (rules 3a and 3b).
    pub(super) fn observe_finished(&mut self, n: u64) {
        let x = n.min(DEPTH_SAMPLE_CAP) * DEPTH_ONE;
        self.batch = ewma(self.batch, x, MEAN_SHIFT);
    }

    /// A request's round trip in event intervals, fixed point (`DEPTH_ONE` ==
    /// one interval), at least one: by Little's law the requests held divided
    /// by the requests each event finishes. A disk's completions come in
    /// batches (a VM's virtual disk: about 7 per wake-up at queue depth 16), and
    /// counting each request held as one interval made the round trip 7 times
    /// too long and a wake-up look 7 times too cheap.
    fn round_trip(&self) -> u64 {
        let rt = self.depth * DEPTH_ONE / self.batch.max(DEPTH_ONE);
        rt.max(DEPTH_ONE)
    }

    /// One iteration: `had_event[i]` says whether source `i` had work; `polled_ns`
    /// is the window that was polled (the one before this update).
    pub(super) fn update(
        &mut self,
        block_ns: u64,
        had_event: &[bool],
        polled_hit: bool,
        polled_ns: u64,
        params: &PollParams,
        knobs: &AdaptiveParams,
    ) {
        let max = params.poll_max_ns;
        let any_event = had_event.iter().any(|&e| e);
        let target = self.target_ns;
        // The interval of this iteration: exact if the event was caught polling;
        // otherwise it includes the wake-up (removed, but at most 3/4 of the wait,
        // so that an overstated wake-up cannot shrink it to nothing), and it was
        // longer than what we polled.
        let sample = if polled_hit {
            block_ns
        } else {
            let wakeup = knobs.wakeup_ns.min(block_ns - block_ns / 4);
            (block_ns - wakeup).max(polled_ns)
        };
        // Would the full target window have caught it? Measured if we polled the
        // full window, counterfactual if we polled less (gate closed, backed off).
        let hit = any_event && (polled_hit || (polled_ns < target && sample <= target));

        for (s, &event) in self.sources.iter_mut().zip(had_event) {
            if event {
                s.idle_ns = 0;
                if sample <= max {
                    s.long_run = 0;
                    s.estimate_interval(sample);
                } else {
                    // Only short intervals are learnt, so a source whose events
                    // all come late would keep the cover of an earlier phase
                    // for ever (an RBD image's completions: every 30-60 us at
                    // iodepth 16, every 300 us at iodepth 1, where the stale
                    // cover had the thread poll 32 us in vain before each).
                    s.long_run = s.long_run.saturating_add(1);
                    if s.long_run >= FORGET_AFTER_LONG {
                        (s.mean, s.dev, s.peak) = (0, 0, 0);
                    }
                }
            } else {
                s.idle_ns = s.idle_ns.saturating_add(block_ns);
            }
        }

        let capped = sample.min(CYCLE_SAMPLE_CAP_NS);
        self.cycle_ns = if self.cycle_ns == 0 {
            capped
        } else {
            ewma(self.cycle_ns, capped, MEAN_SHIFT)
        };
        self.gates[self.after as usize].record(hit, knobs.miss_limit);
    }

    /// Recomputes the target (the largest cover among the sources active within
    /// `poll-max-ns` of waiting) and returns the window: the target after gate and
    /// back-off.
    pub(super) fn refresh(&mut self, params: &PollParams, knobs: &AdaptiveParams) -> u64 {
        let max = params.poll_max_ns;
        self.target_ns = self
            .sources
            .iter()
            .filter(|s| s.idle_ns < max)
            .map(|s| s.cover(knobs, max))
            .max()
            .unwrap_or(0);
        self.window(knobs)
    }

    /// Gate and back-off applied to the target.
    fn window(&self, knobs: &AdaptiveParams) -> u64 {
        let t = self.target_ns;
        let gate = self.gate();
        let one = u128::from(RATE_ONE);
        let p = u128::from(gate.hit_rate);
        // Per iteration, scaled by RATE_ONE: wake-up latency that polling avoids,
        // CPU it burns on misses, and the latency the IOPS budget tolerates.
        // A request's round trip in cycles (Little's law), at least one.
        let depth = u128::from(self.round_trip());
        let saved = p * u128::from(knobs.wakeup_ns);
        // Rule (a) in shares: the wake-up saved is `wakeup / (depth * cycle)` of
        // a request's round trip, the CPU wasted `(1 - p) * T / cycle` of an
        // event's; so the waste is weighed `depth` times.
        let wasted = (one - p) * u128::from(t) * depth / u128::from(DEPTH_ONE);
        let budget = one * u128::from(self.cycle_ns) * depth * u128::from(knobs.latency_budget_pct)
            / (100 * u128::from(DEPTH_ONE));
        let rearm = gate.hit_streak >= REARM_HITS && gate.streak_odds < ODDS_SURPRISE;
        let open = saved >= wasted || saved > budget || rearm;
        if !open {
            return 0;
        }
        let w = t.checked_shr(gate.backoff).unwrap_or(0);
        if w >= ADAPTIVE_MIN_POLL_NS {
            w
        } else if gate.backoff == 0 && t > 0 {
            // Intervals shorter than the shortest window (a polling driver
            // at QD1: a few hundred nanoseconds) are the ones polling
            // catches best: the spin ends at the event, long before the
            // window does.
            ADAPTIVE_MIN_POLL_NS
        } else {
            0
        }
    }
}

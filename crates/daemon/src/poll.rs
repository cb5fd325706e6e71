//! The adaptive polling policy of an IOThread: how long to busy-poll before blocking.
//!
//! This is a pure policy module (no threads, no clocks, no I/O). The event loop of an
//! IOThread asks [`PollPolicy::poll_ns`] for the current *polling window*, busy-polls
//! its pollable sources (each virtqueue's avail ring and the io_uring completion
//! queue) for at most that long, blocks if nothing turned up, and then reports what
//! happened with [`PollPolicy::update`]: the time it waited (`block_ns`, polling plus
//! blocking, as QEMU measures it), which sources had work, and whether the work was
//! found while polling. Every mode is a deterministic function of those reports, so
//! the tests below pin the behaviour iteration by iteration, and [`simulate`] replays
//! a trace of event intervals through any policy.
//!
//! # Modes
//!
//! - [`PollMode::Off`]: never poll (always block in the kernel).
//! - [`PollMode::Busy`]: never block (the SPDK model; the window is `u64::MAX`).
//! - [`PollMode::Classic`]: QEMU's `adjust_polling_time` (util/aio-posix.c).
//! - [`PollMode::Weighted`]: QEMU's `poll-weight` algorithm (QEMU 11.1).
//! - [`PollMode::Adaptive`]: our design, described below.
//!
//! The knobs are QEMU's ([`PollParams`]: `poll-max-ns`, `poll-grow`, `poll-shrink`,
//! `poll-weight`, with QEMU's defaults and meanings). `poll-max-ns = 0` disables
//! polling in every mode except `busy`.
//!
//! # Classic (QEMU `adjust_polling_time`)
//!
//! Every source that had an event in an iteration adjusts its own window with the
//! iteration's `block_ns`: no change if `block_ns` fitted in the window; if
//! `block_ns > poll-max-ns` the window shrinks (`poll-shrink = 0`: reset to 0, else
//! divided by `poll-shrink`); otherwise, if there is room to grow, the window grows
//! (from 0 to [`POLL_NS_INITIAL`] = 4 us, then multiplied by `poll-grow`, 0 meaning
//! 2), clamped to `poll-max-ns`. As in QEMU, a `block_ns` exactly equal to
//! `poll-max-ns` neither grows nor shrinks the window.
//!
//! *Per-source windows.* Old QEMU (2.9 to 5.x) kept one window per AioContext; current
//! QEMU keeps one per AioHandler (`AioPolledEvent` in each node) and polls for the
//! largest window among the handlers on its poll list. We follow current QEMU: the
//! window is the maximum over the sources. QEMU also drops a handler from the poll
//! list after [`POLL_IDLE_INTERVAL_NS`] (7 s) without activity until its next event;
//! we approximate wall time by the sum of the `block_ns` reported since the source's
//! last event, and a source idle for that long stops counting towards the maximum
//! (its window is kept and counts again at its next event).
//!
//! # Weighted (QEMU `poll-weight`, QEMU 11.1)
//!
//! From the poll-weight series (Jaehoon Kim, qemu-devel, January 2026) and
//! REFERENCE.md section 2. Each source keeps an exponentially weighted moving average
//! of the `block_ns` of the iterations in which it had an event (the newest sample
//! weighs `1 / 2^w`, `w = poll-weight`; 0 selects the default, 3 in QEMU 11.1, 2 in
//! the first version of the series; the first sample is taken as is). An average that reaches `poll-max-ns` is reset to
//! 0. A source without an event but with a non-zero average *ages*: the iteration's
//! `block_ns` is added to it, and it drops to 0 once it reaches `poll-max-ns`, so a
//! source that went quiet stops holding the window up. If any source had an event,
//! let `adj` be the largest average among them; the single window of the IOThread
//! (per context again, as in the patch) then grows to
//! `min(max, max(adj, window * grow))` when `adj` exceeds it, and otherwise is
//! divided by `shrink` when `adj < window / shrink`. In this algorithm both
//! `poll-grow = 0` and `poll-shrink = 0` mean 2: the shrink is always gradual, never
//! a reset to 0 (the patch's `shrink_polling_time` uses 2 for 0, "matching the grow
//! rate, to reduce frequent poll_ns resets for slow devices"). Growth from 0 jumps
//! straight to `adj`; the 4 us first step is a classic-only rule.
//!
//! # Adaptive (ours)
//!
//! The goal: keep IOPS within 5% of busy polling (the maintainer's bar for a new
//! default) while burning much less CPU than the weighted algorithm. The reasoning
//! starts from what polling buys. With a window `W`, an event `t` ns after the wait
//! starts is a *hit* if `t <= W`: it costs `t` of CPU and no wake-up. Otherwise
//! polling wasted `W` of CPU *and* the request still pays the wake-up (epoll sleep,
//! interrupt, context switch: [`AdaptiveParams::wakeup_ns`], about 15 us). The CPU
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
//!    nothing; and the interval was at least the window polled in vain).
//! 2. **Cover them, with a margin.** A source's cover is
//!    `max(mean + max(mean * margin_pct / 100, 4 * dev), peak + peak / 8)`, capped by
//!    `poll-max-ns`: 1.5x the mean when intervals are steady, the TCP-RTO-like
//!    `mean + 4 dev` under symmetric jitter, and just above the recent peak (which
//!    decays with a half-life of about 177 samples, so it follows a high percentile
//!    rather than the all-time maximum) for skewed tails. The target `T` is the largest cover among the sources that had
//!    an event within the last `poll-max-ns` of waiting: a queue that went quiet
//!    stops holding the window up, as in the weighted ageing, but keeps its
//!    statistics for when it comes back. As in QEMU, the maximum over sources.
//! 3. **Poll only if it pays, in CPU or in IOPS.** The IOThread tracks its hit rate
//!    `p` (EWMA, gain 1/8) of "the event came within `T`": measured when it polled
//!    the full window, counterfactual (from the corrected sample) when it polled
//!    less or not at all, so it keeps learning while polling is off. Polling with
//!    window `T` saves `p * wakeup_ns` of wake-up latency per iteration and wastes
//!    `(1 - p) * T` of CPU. It polls if
//!    (a) `p * wakeup_ns >= (1 - p) * T`: polling pays for itself (the ski-rental
//!    break-even: with `T = 12 us` it needs `p >= 0.44`, with `T = 32 us`
//!    `p >= 0.68`); or
//!    (b) `p * wakeup_ns > latency_budget_pct * cycle`: the wake-ups would cost more
//!    than the IOPS budget (2% by default), `cycle` being the mean interval between
//!    events (EWMA, samples capped at 1 ms); or
//!    (c) the last two iterations were hits: re-arm at once, without waiting for
//!    the average to climb back.
//!    Rule (b) is what holds IOPS: when intervals straddle `poll-max-ns` it keeps
//!    polling, and pays CPU for it, where both QEMU algorithms give up (the `mid`
//!    trace of the simulation). `latency_budget_pct = 100` disables it and leaves a
//!    CPU-first policy.
//! 4. **Back off on a surprising run of misses, re-arm on a hit.** A run of misses
//!    is a surprise once it is at least `miss_limit` long and its probability under
//!    the current hit rate has fallen below 1/64 (3 misses when `p` was about 1, a
//!    dozen at `p = 0.3`, where runs of misses are normal): the workload changed or
//!    the device went idle, and the averages lag. The window then halves with every
//!    further miss, down to 0 (windows below [`ADAPTIVE_MIN_POLL_NS`] are not worth
//!    a polling pass). The first hit, or an event that the full window would have
//!    caught, restores the full window.
//! 5. **Nap through the predictable part of the wait** (hybrid polling, as the
//!    kernel's blk-mq): each source also learns its own rhythm, the mean and
//!    deviation of the gap between its events (a queue's kicks, the completions'
//!    device latency; gaps up to [`NAP_HORIZON_NS`]), fed with timestamps by
//!    [`PollPolicy::observe_events_at`]. [`PollPolicy::nap_at`] sleeps until one
//!    timer overshoot before the earliest `last + gap - 2 dev` among the active
//!    sources, then the loop spins for [`PollPolicy::nap_spin_ns`]. The overshoot
//!    and the CPU a nap costs are measured by the IOThread, not assumed; a nap must
//!    save 2 us and a quarter of its length over spinning. Naps may reach past
//!    `poll-max-ns`, which bounds only spinning: an 80 us device is caught at the
//!    end of a 70 us nap instead of by a wake-up.
//!
//! The test `simulation_comparison` (run it with `--nocapture`) prints the modes side
//! by side on steady, jittery, heavy-tailed, bimodal, mid-range, slow and phased
//! traces, with the best any window capped at `poll-max-ns` could do.
//!
//! # Simulation model
//!
//! [`simulate`] feeds a policy one event per iteration on source 0. With window `W`
//! and the event arriving `t` ns after the wait starts: if `t <= W` it is a polling
//! hit (`t` of polling CPU, `block_ns = t`); otherwise the loop polls `W` in vain,
//! sleeps, and finds the event [`WAKEUP_LATENCY_NS`] late (`block_ns = t + 15 us`).

use serde::Deserialize;

/// First step of a classic window that grows from 0 (QEMU: "start polling at 4
/// microseconds").
pub const POLL_NS_INITIAL: u64 = 4_000;

/// Default `poll-max-ns` (QEMU's iothread default).
pub const DEFAULT_POLL_MAX_NS: u64 = 32_768;

/// The `poll-weight` used by the weighted algorithm when `poll-weight` is 0 (QEMU 11.1
/// default: the newest interval counts 1/8).
pub const DEFAULT_POLL_WEIGHT: u32 = 3;

/// Largest meaningful `poll-weight` (it is a shift count on 64-bit nanoseconds).
pub const MAX_POLL_WEIGHT: u32 = 63;

/// A source without activity for this long stops counting towards the classic window
/// (QEMU's `POLL_IDLE_INTERVAL_NS`, 7 s).
pub const POLL_IDLE_INTERVAL_NS: u64 = 7_000_000_000;

/// Adaptive windows shorter than this are rounded down to 0: one pass over the
/// sources plus the notification toggling costs about as much.
pub const ADAPTIVE_MIN_POLL_NS: u64 = 1_000;

/// Shortest hybrid-polling nap ([`PollPolicy::nap_at`]).
pub const MIN_NAP_NS: u64 = 1_000;

/// CPU a nap must save over spinning through the same time, in ns, at least
/// ([`PollPolicy::nap_at`] also asks for a quarter of the nap's length): below
/// this the risk of a late timer is not worth it.
pub const MIN_NAP_SAVING_NS: u64 = 2_000;

/// Until measured ([`PollPolicy::set_nap_cpu_ns`]): thread CPU time of one timed
/// nap (arming the timer, the context switches, the interrupt).
pub const DEFAULT_NAP_CPU_NS: u64 = 5_000;

/// Inter-arrival times longer than this are idle periods, not a rhythm to nap
/// through; a source silent for longer is not expected soon.
pub const NAP_HORIZON_NS: u64 = 1_000_000;

/// Overshoot samples of a nap are capped at 1 ms (a preempted thread is not a
/// property of the timer).
const NAP_SAMPLE_CAP_NS: u64 = 1_000_000;

/// Wake-up latency charged by [`simulate`] to an event found after sleeping.
pub const WAKEUP_LATENCY_NS: u64 = 15_000;

/// Hit-rate fixed point: 1.0 == `RATE_ONE`.
const RATE_ONE: u32 = 1024;
/// Gain of the hit-rate EWMA (1/8).
const RATE_SHIFT: u32 = 3;
/// Gain of the adaptive mean (1/8), as TCP's SRTT.
const MEAN_SHIFT: u32 = 3;
/// Gain of the adaptive mean deviation (1/4), as TCP's RTTVAR.
const DEV_SHIFT: u32 = 2;
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
/// Consecutive hits that re-open a closed adaptive gate.
const REARM_HITS: u32 = 2;

/// QEMU-compatible knobs (names and defaults as QEMU's iothread object and libvirt
/// `<iothread><poll max= grow= shrink= weight=/></iothread>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct PollParams {
    /// Longest window in nanoseconds (default 32768); 0 means never poll.
    pub poll_max_ns: u64,
    /// Growth factor of the window; 0 means 2.
    pub poll_grow: u64,
    /// Shrink divisor of the window; 0 means reset to 0 (classic) or 2 (weighted).
    pub poll_shrink: u64,
    /// EWMA weight shift of the weighted algorithm: 0 selects the classic algorithm
    /// when the mode is derived from the parameters ([`PollParams::qemu_mode`]), and
    /// [`DEFAULT_POLL_WEIGHT`] when the mode is explicitly `weighted`. QEMU 11.1
    /// defaults to 3, and so do we.
    pub poll_weight: u32,
}

impl Default for PollParams {
    fn default() -> Self {
        PollParams {
            poll_max_ns: DEFAULT_POLL_MAX_NS,
            poll_grow: 0,
            poll_shrink: 0,
            poll_weight: DEFAULT_POLL_WEIGHT,
        }
    }
}

/// Why a set of [`PollParams`] was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PollParamsError {
    /// `poll-weight` is a shift count and cannot exceed 63.
    #[error("poll-weight = {0} is out of range (valid: 0 to {MAX_POLL_WEIGHT}; 0 = classic, QEMU default 3)")]
    Weight(u32),
}

impl PollParams {
    /// Checks the parameters; each error names the field and the valid range.
    pub fn validate(&self) -> Result<(), PollParamsError> {
        if self.poll_weight > MAX_POLL_WEIGHT {
            return Err(PollParamsError::Weight(self.poll_weight));
        }
        Ok(())
    }

    /// The QEMU algorithm these parameters select: `poll-weight = 0` is the classic
    /// algorithm, anything else the weighted one (QEMU 11.1 semantics).
    pub fn qemu_mode(&self) -> PollMode {
        if self.poll_weight == 0 {
            PollMode::Classic
        } else {
            PollMode::Weighted
        }
    }

    /// Growth factor with QEMU's default applied (0 means 2).
    fn grow(&self) -> u64 {
        if self.poll_grow == 0 {
            2
        } else {
            self.poll_grow
        }
    }

    /// Weight shift of the weighted algorithm (0 means the default; clamped to 63).
    fn weight_shift(&self) -> u32 {
        match self.poll_weight {
            0 => DEFAULT_POLL_WEIGHT,
            w => w.min(MAX_POLL_WEIGHT),
        }
    }
}

/// Knobs of the [`PollMode::Adaptive`] algorithm (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct AdaptiveParams {
    /// Price of going to sleep instead of catching the event by polling, in ns: the
    /// latency of an epoll sleep, wake-up and context switch on this host (default
    /// 15000). It is both the benefit side of the poll/sleep break-even and the
    /// latency removed from intervals measured across a sleep.
    pub wakeup_ns: u64,
    /// Margin of the window over the predicted interval, in percent (default 50:
    /// poll for 1.5x the mean interval when it is steady).
    pub margin_pct: u64,
    /// Consecutive misses always tolerated before the window may halve (default 3);
    /// it halves only once the run is also unlikely (below 1/64) given the hit rate.
    pub miss_limit: u32,
    /// IOPS budget, in percent of the mean event interval: when the wake-ups that
    /// polling would avoid add more latency than this, poll even if the CPU it
    /// wastes exceeds the latency it saves (default 2).
    pub latency_budget_pct: u64,
}

impl Default for AdaptiveParams {
    fn default() -> Self {
        AdaptiveParams {
            wakeup_ns: WAKEUP_LATENCY_NS,
            margin_pct: 50,
            miss_limit: 3,
            latency_budget_pct: 2,
        }
    }
}

/// Which polling algorithm an IOThread runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PollMode {
    /// Never poll: always block in the kernel.
    Off,
    /// QEMU's classic grow/shrink algorithm (`adjust_polling_time`).
    Classic,
    /// QEMU 11.1's weighted algorithm (`poll-weight`).
    Weighted,
    /// Never block: spin forever (the SPDK model).
    Busy,
    /// Our cost-based algorithm (see the module documentation).
    Adaptive,
}

/// Per-source state. The meaning of `ns` depends on the mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct SourceState {
    /// Classic: the source's window. Weighted: EWMA of its `block_ns`. Adaptive: mean
    /// of its short intervals (0: no sample yet).
    ns: u64,
    /// Adaptive: mean deviation of its short intervals.
    dev: u64,
    /// Adaptive: decaying peak of its short intervals.
    peak: u64,
    /// Sum of the `block_ns` reported since the source's last event.
    idle_ns: u64,
    /// Adaptive naps: time of the source's last event ([`PollPolicy::observe_events_at`];
    /// 0: none yet).
    last_at: u64,
    /// Adaptive naps: mean and mean deviation of the time between its events
    /// (inter-arrivals up to [`NAP_HORIZON_NS`]; 0: no sample yet).
    gap_ns: u64,
    gap_dev: u64,
    /// Scratch flag: the source is in the current `update`'s event list.
    had_event: bool,
}

/// The polling state of one IOThread.
#[derive(Debug, Clone)]
pub struct PollPolicy {
    mode: PollMode,
    params: PollParams,
    adaptive: AdaptiveParams,
    sources: Vec<SourceState>,
    /// Current window, as returned by [`PollPolicy::poll_ns`].
    window_ns: u64,
    /// Weighted: the IOThread's window (one per context, as in the patch).
    ctx_ns: u64,
    /// Adaptive: the full target window (before gate and back-off).
    target_ns: u64,
    /// Adaptive: hit-rate EWMA, `RATE_ONE` == 1.0.
    hit_rate: u32,
    /// Adaptive: consecutive hits.
    hit_streak: u32,
    /// Adaptive: consecutive misses.
    miss_streak: u32,
    /// Adaptive: probability of the current run of misses under the hit rate
    /// (`ODDS_ONE` == 1.0).
    run_odds: u64,
    /// Adaptive: halvings of the window (misses since the run became surprising).
    backoff: u32,
    /// Adaptive: EWMA of the interval between events of any source (capped samples).
    cycle_ns: u64,
    /// Adaptive naps: mean and mean deviation of how late a timed nap ends (0 =
    /// not measured yet: `wakeup_ns` stands in).
    nap_late_ns: u64,
    nap_late_dev: u64,
    /// Adaptive naps: thread CPU time one nap costs.
    nap_cpu_ns: u64,
}

impl PollPolicy {
    /// A policy for an IOThread with `num_sources` pollable sources, with the default
    /// [`AdaptiveParams`].
    pub fn new(mode: PollMode, params: PollParams, num_sources: usize) -> Self {
        let mut policy = PollPolicy {
            mode,
            params,
            adaptive: AdaptiveParams::default(),
            sources: vec![SourceState::default(); num_sources],
            window_ns: 0,
            ctx_ns: 0,
            target_ns: 0,
            hit_rate: RATE_ONE / 2,
            hit_streak: 0,
            miss_streak: 0,
            run_odds: ODDS_ONE,
            backoff: 0,
            cycle_ns: 0,
            nap_late_ns: 0,
            nap_late_dev: 0,
            nap_cpu_ns: DEFAULT_NAP_CPU_NS,
        };
        policy.refresh_window();
        policy
    }

    /// Replaces the knobs of the adaptive algorithm (builder style).
    pub fn with_adaptive_params(mut self, adaptive: AdaptiveParams) -> Self {
        self.adaptive = adaptive;
        self.refresh_window();
        self
    }

    /// The mode this policy runs.
    pub fn mode(&self) -> PollMode {
        self.mode
    }

    /// The QEMU knobs this policy runs with.
    pub fn params(&self) -> PollParams {
        self.params
    }

    /// The knobs of the adaptive algorithm.
    pub fn adaptive_params(&self) -> AdaptiveParams {
        self.adaptive
    }

    /// Number of pollable sources.
    pub fn num_sources(&self) -> usize {
        self.sources.len()
    }

    /// Changes the knobs at run time and forgets all learnt state, as QEMU's
    /// `aio_context_set_poll_params` does (every window back to 0).
    pub fn set_params(&mut self, params: PollParams) {
        let n = self.sources.len();
        *self = PollPolicy::new(self.mode, params, n).with_adaptive_params(self.adaptive);
    }

    /// Sets the number of pollable sources (queues attached or detached; the sources
    /// are each virtqueue plus the io_uring CQ). Removed sources lose their state;
    /// sources added later start fresh. The window is recomputed (a removed source may
    /// have held the maximum).
    pub fn set_num_sources(&mut self, n: usize) {
        self.sources.resize(n, SourceState::default());
        self.refresh_window();
    }

    /// The current window: how long to busy-poll before blocking, in ns (0: do not
    /// poll; `u64::MAX` for [`PollMode::Busy`]).
    pub fn poll_ns(&self) -> u64 {
        self.window_ns
    }

    /// Adaptive hybrid polling: how long to *sleep* from `now_ns` (notifications
    /// armed, with a precise timer) before spinning, in ns; 0 = do not nap. Each
    /// source that had an event within [`NAP_HORIZON_NS`] is expected again at
    /// `last event + mean gap - 2 dev` (its own rhythm: a queue's kicks, the
    /// completions' device latency); the nap ends a timer overshoot
    /// ([`PollPolicy::nap_late_ns`]) before the earliest of these, as the kernel's
    /// blk-mq hybrid polling sleeps through the first part of a request's expected
    /// latency. Any recently active source without an estimate yet, or one already
    /// due, means no nap. A nap of `n` ns lasts about `n + late` and costs the
    /// thread [`Self::nap_cpu_ns`] of CPU, where spinning would cost `n + late`: it
    /// is taken only if that saves at least [`MIN_NAP_SAVING_NS`] and a quarter of
    /// its length. Unlike the window, a nap may reach past `poll-max-ns` (it burns
    /// no CPU); the spin after it is bounded by [`Self::nap_spin_ns`]. Every other
    /// mode never naps, nor does `poll-max-ns=0`.
    pub fn nap_at(&self, now_ns: u64) -> u64 {
        if self.mode != PollMode::Adaptive || self.params.poll_max_ns == 0 {
            return 0;
        }
        let mut earliest = u64::MAX;
        for s in &self.sources {
            if s.last_at == 0 || now_ns.saturating_sub(s.last_at) >= NAP_HORIZON_NS {
                continue;
            }
            if s.gap_ns == 0 {
                return 0;
            }
            let due = (s.last_at + s.gap_ns).saturating_sub(2 * s.gap_dev);
            earliest = earliest.min(due);
        }
        if earliest == u64::MAX {
            return 0;
        }
        let late = self.nap_late_ns();
        let nap = earliest.saturating_sub(late).saturating_sub(now_ns);
        let mean_late = if self.nap_late_ns == 0 {
            late
        } else {
            self.nap_late_ns
        };
        // CPU saved against spinning through the nap's whole length; it must be
        // worth the risk of a late timer: 2 us, and a quarter of the length.
        let length = nap + mean_late;
        let saving = length.saturating_sub(self.nap_cpu_ns);
        if nap < MIN_NAP_NS || saving < MIN_NAP_SAVING_NS.max(length / 4) {
            0
        } else {
            nap.min(NAP_HORIZON_NS)
        }
    }

    /// After a nap, how long to spin for the event that the nap expected, in ns:
    /// the timer's lateness and the gaps' spread are already spent, so what is
    /// left is the slack of the prediction, bounded by `poll-max-ns`.
    pub fn nap_spin_ns(&self) -> u64 {
        let spread = self
            .sources
            .iter()
            .filter(|s| s.last_at != 0 && s.gap_ns != 0)
            .map(|s| s.gap_dev)
            .max()
            .unwrap_or(0);
        (self.nap_late_ns() + 4 * spread + MIN_NAP_SAVING_NS).min(self.params.poll_max_ns)
    }

    /// Adaptive naps: the sources in `events` had an event at `now_ns` (any
    /// monotonic clock, > 0): their gap since the previous one feeds a
    /// mean/deviation estimator (gains 1/8 and 1/4, as TCP's RTT), unless it is
    /// longer than [`NAP_HORIZON_NS`] (an idle period). Duplicates and unknown
    /// indexes are ignored; other modes ignore the call.
    pub fn observe_events_at(&mut self, now_ns: u64, events: &[usize]) {
        // Only adaptive naps use the rhythm: no work on other modes' passes.
        if self.mode != PollMode::Adaptive {
            return;
        }
        for &i in events {
            let Some(s) = self.sources.get_mut(i) else {
                continue;
            };
            if s.last_at == now_ns {
                continue;
            }
            let gap = now_ns.saturating_sub(s.last_at);
            if s.last_at != 0 && gap <= NAP_HORIZON_NS {
                jacobson(&mut s.gap_ns, &mut s.gap_dev, gap.max(1));
            }
            s.last_at = now_ns;
        }
    }

    /// How late a timed nap may end, in ns: the measured mean + 2 deviations of
    /// [`Self::observe_nap`] samples, or `wakeup_ns` until one was measured.
    pub fn nap_late_ns(&self) -> u64 {
        if self.nap_late_ns == 0 {
            self.adaptive.wakeup_ns
        } else {
            self.nap_late_ns + 2 * self.nap_late_dev
        }
    }

    /// Thread CPU time that one nap costs, in ns (measured or [`DEFAULT_NAP_CPU_NS`]).
    pub fn nap_cpu_ns(&self) -> u64 {
        self.nap_cpu_ns
    }

    /// A timed nap of `requested_ns` that ended by its timer after `elapsed_ns`: the
    /// overshoot feeds the mean/deviation estimator (gains 1/8 and 1/4, samples
    /// capped at 1 ms and at 4x the current mean; the first sample sets the mean,
    /// with half of it as deviation).
    pub fn observe_nap(&mut self, requested_ns: u64, elapsed_ns: u64) {
        let mut x = elapsed_ns
            .saturating_sub(requested_ns)
            .clamp(1, NAP_SAMPLE_CAP_NS);
        if self.nap_late_ns > 0 {
            // A nap that was preempted says little about the timer: one sample
            // moves the estimate by at most 3/8 of itself.
            x = x.min(4 * self.nap_late_ns.max(1_000));
        }
        if self.nap_late_ns == 0 {
            self.nap_late_ns = x;
            self.nap_late_dev = x / 2;
            return;
        }
        let err = x.abs_diff(self.nap_late_ns);
        self.nap_late_dev = ewma(self.nap_late_dev, err, DEV_SHIFT);
        self.nap_late_ns = ewma(self.nap_late_ns, x, MEAN_SHIFT).max(1);
    }

    /// Sets the nap lateness from a calibration: its typical value and spread
    /// (e.g. the median, and the 90th percentile minus the median), as the
    /// estimator's mean and deviation; later [`Self::observe_nap`] samples refine it.
    pub fn set_nap_late(&mut self, typical_ns: u64, spread_ns: u64) {
        self.nap_late_ns = typical_ns.clamp(1, NAP_SAMPLE_CAP_NS);
        self.nap_late_dev = spread_ns.min(NAP_SAMPLE_CAP_NS);
    }

    /// Sets the measured thread CPU time of one nap.
    pub fn set_nap_cpu_ns(&mut self, cpu_ns: u64) {
        self.nap_cpu_ns = cpu_ns;
    }

    /// The window that `source` alone asks for (classic: its own window; weighted:
    /// its interval average; adaptive: its cover, ignoring gate and back-off), or
    /// `None` if there is no such source.
    pub fn source_poll_ns(&self, source: usize) -> Option<u64> {
        let s = self.sources.get(source)?;
        Some(match self.mode {
            PollMode::Off => 0,
            PollMode::Busy => u64::MAX,
            PollMode::Classic | PollMode::Weighted => s.ns,
            PollMode::Adaptive => self.cover(s),
        })
    }

    /// Called once per event-loop iteration after it ran: `block_ns` = time from
    /// start of the iteration's wait (polling + blocking) until an event was found;
    /// `events` = indexes of the sources that had work this iteration (may be empty
    /// on a timeout/spurious wake); `polled_hit` = whether the event was found while
    /// busy-polling (vs after sleeping).
    ///
    /// Duplicate indexes count once and out-of-range indexes are ignored. The
    /// iteration is assumed to have polled for (at most) the window that
    /// [`PollPolicy::poll_ns`] returned before the call; only the adaptive mode uses
    /// `polled_hit`.
    pub fn update(&mut self, block_ns: u64, events: &[usize], polled_hit: bool) {
        for &i in events {
            if let Some(s) = self.sources.get_mut(i) {
                s.had_event = true;
            }
        }
        let any_event = self.sources.iter().any(|s| s.had_event);
        if self.params.poll_max_ns == 0 {
            // QEMU does not even measure block_ns when polling is disabled.
            for s in &mut self.sources {
                s.had_event = false;
            }
            self.refresh_window();
            return;
        }
        match self.mode {
            PollMode::Off | PollMode::Busy => {
                for s in &mut self.sources {
                    s.had_event = false;
                    s.idle_ns = s.idle_ns.saturating_add(block_ns);
                }
            }
            PollMode::Classic => self.update_classic(block_ns),
            PollMode::Weighted => self.update_weighted(block_ns),
            PollMode::Adaptive => self.update_adaptive(block_ns, any_event, polled_hit),
        }
        self.refresh_window();
    }

    fn update_classic(&mut self, block_ns: u64) {
        let params = self.params;
        for s in &mut self.sources {
            if std::mem::take(&mut s.had_event) {
                s.idle_ns = 0;
                s.ns = classic_adjust(s.ns, block_ns, &params);
            } else {
                s.idle_ns = s.idle_ns.saturating_add(block_ns);
            }
        }
    }

    fn update_weighted(&mut self, block_ns: u64) {
        let max = self.params.poll_max_ns;
        let w = self.params.weight_shift();
        let mut adj: Option<u64> = None;
        for s in &mut self.sources {
            if std::mem::take(&mut s.had_event) {
                s.idle_ns = 0;
                s.ns = if s.ns == 0 {
                    block_ns
                } else {
                    (s.ns - (s.ns >> w)).saturating_add(block_ns >> w)
                };
                if s.ns >= max {
                    s.ns = 0;
                }
                adj = Some(adj.map_or(s.ns, |a| a.max(s.ns)));
            } else {
                s.idle_ns = s.idle_ns.saturating_add(block_ns);
                if s.ns > 0 {
                    s.ns = s.ns.saturating_add(block_ns);
                    if s.ns >= max {
                        s.ns = 0;
                    }
                }
            }
        }
        if let Some(adj) = adj {
            let grow = self.params.grow();
            let shrink = if self.params.poll_shrink == 0 {
                2
            } else {
                self.params.poll_shrink
            };
            if adj > self.ctx_ns {
                self.ctx_ns = adj.max(self.ctx_ns.saturating_mul(grow)).min(max);
            } else if adj < self.ctx_ns / shrink {
                self.ctx_ns /= shrink;
            }
        }
    }

    fn update_adaptive(&mut self, block_ns: u64, any_event: bool, polled_hit: bool) {
        let max = self.params.poll_max_ns;
        let polled = self.window_ns;
        let target = self.target_ns;
        // The interval of this iteration: exact if the event was caught polling;
        // otherwise it includes the wake-up (removed, but at most 3/4 of the wait,
        // so that an overstated wake-up cannot shrink it to nothing), and it was
        // longer than what we polled.
        let sample = if polled_hit {
            block_ns
        } else {
            let wakeup = self.adaptive.wakeup_ns.min(block_ns - block_ns / 4);
            (block_ns - wakeup).max(polled)
        };
        // Would the full target window have caught it? Measured if we polled the
        // full window, counterfactual if we polled less (gate closed, backed off).
        let hit = any_event && (polled_hit || (polled < target && sample <= target));

        for s in &mut self.sources {
            if std::mem::take(&mut s.had_event) {
                s.idle_ns = 0;
                if sample <= max {
                    estimate_interval(s, sample);
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
        self.hit_rate = self.hit_rate - (self.hit_rate >> RATE_SHIFT)
            + if hit { RATE_ONE >> RATE_SHIFT } else { 0 };
        if hit {
            self.hit_streak = self.hit_streak.saturating_add(1);
            self.miss_streak = 0;
            self.run_odds = ODDS_ONE;
            self.backoff = 0;
        } else {
            self.miss_streak = self.miss_streak.saturating_add(1);
            self.hit_streak = 0;
            // Odds of this run of misses if the hit rate were right.
            let miss_rate = u64::from(RATE_ONE - self.hit_rate);
            self.run_odds = self.run_odds * miss_rate / u64::from(RATE_ONE);
            if self.miss_streak >= self.adaptive.miss_limit && self.run_odds < ODDS_SURPRISE {
                self.backoff = self.backoff.saturating_add(1);
            }
        }
    }

    /// Adaptive: the window one source asks for (0 without a sample).
    fn cover(&self, s: &SourceState) -> u64 {
        if s.ns == 0 {
            return 0;
        }
        let margin = (s.ns.saturating_mul(self.adaptive.margin_pct) / 100)
            .max(s.dev.saturating_mul(DEV_MULT));
        let tail = s.peak.saturating_add(s.peak >> PEAK_HEADROOM_SHIFT);
        s.ns.saturating_add(margin)
            .max(tail)
            .min(self.params.poll_max_ns)
    }

    /// Recomputes `window_ns` (and the adaptive target) from the current state.
    fn refresh_window(&mut self) {
        let max = self.params.poll_max_ns;
        self.window_ns = match self.mode {
            PollMode::Off => 0,
            PollMode::Busy => u64::MAX,
            _ if max == 0 => 0,
            PollMode::Classic => self
                .sources
                .iter()
                .filter(|s| s.idle_ns < POLL_IDLE_INTERVAL_NS)
                .map(|s| s.ns)
                .max()
                .unwrap_or(0),
            PollMode::Weighted => self.ctx_ns,
            PollMode::Adaptive => {
                self.target_ns = self
                    .sources
                    .iter()
                    .filter(|s| s.idle_ns < max)
                    .map(|s| self.cover(s))
                    .max()
                    .unwrap_or(0);
                self.adaptive_window()
            }
        };
    }

    /// Adaptive: gate and back-off applied to the target.
    fn adaptive_window(&self) -> u64 {
        let t = self.target_ns;
        let one = u128::from(RATE_ONE);
        let p = u128::from(self.hit_rate);
        // Per iteration, scaled by RATE_ONE: wake-up latency that polling avoids,
        // CPU it burns on misses, and the latency the IOPS budget tolerates.
        let saved = p * u128::from(self.adaptive.wakeup_ns);
        let wasted = (one - p) * u128::from(t);
        let budget =
            one * u128::from(self.cycle_ns) * u128::from(self.adaptive.latency_budget_pct) / 100;
        let open = saved >= wasted || saved > budget || self.hit_streak >= REARM_HITS;
        if !open {
            return 0;
        }
        let w = t.checked_shr(self.backoff).unwrap_or(0);
        if w < ADAPTIVE_MIN_POLL_NS {
            0
        } else {
            w
        }
    }
}

/// Classic per-source step (QEMU `adjust_polling_time`).
fn classic_adjust(ns: u64, block_ns: u64, params: &PollParams) -> u64 {
    let max = params.poll_max_ns;
    if block_ns <= ns {
        // The event came within the window: the sweet spot.
        ns
    } else if block_ns > max {
        // Polling could not have caught it: poll less.
        match params.poll_shrink {
            0 => 0,
            shrink => ns / shrink,
        }
    } else if ns < max && block_ns < max {
        // A longer window would have caught it: poll longer.
        let grown = if ns == 0 {
            POLL_NS_INITIAL
        } else {
            ns.saturating_mul(params.grow())
        };
        grown.min(max)
    } else {
        ns
    }
}

/// Adaptive: Jacobson/Karels update of a source's mean and mean deviation.
fn estimate_interval(s: &mut SourceState, x: u64) {
    s.peak = if s.ns == 0 {
        x
    } else {
        x.max(s.peak - (s.peak >> PEAK_SHIFT))
    };
    jacobson(&mut s.ns, &mut s.dev, x);
}

/// Jacobson/Karels mean and mean deviation (gains 1/8 and 1/4); a mean of 0 is
/// "no sample yet": the first sets the mean, with half of it as deviation.
fn jacobson(mean: &mut u64, dev: &mut u64, x: u64) {
    if *mean == 0 {
        *mean = x.max(1);
        *dev = x / 2;
        return;
    }
    let err = x.abs_diff(*mean);
    *mean = if x >= *mean {
        *mean + (err >> MEAN_SHIFT)
    } else {
        (*mean - (err >> MEAN_SHIFT)).max(1)
    };
    *dev = if err >= *dev {
        *dev + ((err - *dev) >> DEV_SHIFT)
    } else {
        *dev - ((*dev - err) >> DEV_SHIFT)
    };
}

/// Exponentially weighted moving average with gain `1 / 2^shift`.
fn ewma(old: u64, x: u64, shift: u32) -> u64 {
    old - (old >> shift) + (x >> shift)
}

/// Outcome of [`simulate`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimResult {
    /// CPU spent busy-polling: the interval on a hit, the whole window on a miss.
    pub poll_cpu_ns: u64,
    /// The part of `poll_cpu_ns` spent on misses (windows that expired in vain).
    pub wasted_cpu_ns: u64,
    /// Events found after sleeping.
    pub sleeps: u64,
    /// Events caught while polling.
    pub hits: u64,
    /// Latency added to events by wake-ups ([`WAKEUP_LATENCY_NS`] per sleep).
    pub added_latency_ns: u64,
}

/// Replays a trace through `policy`: each entry is the time from the start of a wait
/// until the next event (on source 0). If it fits in the current window it is a
/// polling hit costing that much CPU; otherwise the whole window is polled in vain and
/// the event is found [`WAKEUP_LATENCY_NS`] late, after a sleep. A policy without
/// sources is given one.
pub fn simulate(policy: &mut PollPolicy, intervals_ns: &[u64]) -> SimResult {
    if policy.num_sources() == 0 {
        policy.set_num_sources(1);
    }
    let mut r = SimResult::default();
    for &t in intervals_ns {
        let w = policy.poll_ns();
        if t <= w {
            r.hits += 1;
            r.poll_cpu_ns = r.poll_cpu_ns.saturating_add(t);
            policy.update(t, &[0], true);
        } else {
            r.sleeps += 1;
            r.poll_cpu_ns = r.poll_cpu_ns.saturating_add(w);
            r.wasted_cpu_ns = r.wasted_cpu_ns.saturating_add(w);
            r.added_latency_ns = r.added_latency_ns.saturating_add(WAKEUP_LATENCY_NS);
            policy.update(t.saturating_add(WAKEUP_LATENCY_NS), &[0], false);
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(max: u64, grow: u64, shrink: u64, weight: u32) -> PollParams {
        PollParams {
            poll_max_ns: max,
            poll_grow: grow,
            poll_shrink: shrink,
            poll_weight: weight,
        }
    }

    fn classic(max: u64, grow: u64, shrink: u64) -> PollPolicy {
        PollPolicy::new(PollMode::Classic, params(max, grow, shrink, 0), 1)
    }

    fn weighted(weight: u32, shrink: u64) -> PollPolicy {
        PollPolicy::new(PollMode::Weighted, params(32_768, 0, shrink, weight), 1)
    }

    fn adaptive() -> PollPolicy {
        PollPolicy::new(PollMode::Adaptive, PollParams::default(), 1)
    }

    /// Deterministic xorshift64* generator for traces.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn range(&mut self, lo: u64, hi: u64) -> u64 {
            lo + self.next() % (hi - lo + 1)
        }
        fn chance(&mut self, pct: u64) -> bool {
            self.next() % 100 < pct
        }
    }

    // ---- parameters ---------------------------------------------------------

    #[test]
    fn defaults_match_qemu() {
        let p = PollParams::default();
        assert_eq!(p.poll_max_ns, 32_768);
        assert_eq!(p.poll_grow, 0);
        assert_eq!(p.poll_shrink, 0);
        assert_eq!(p.poll_weight, 3);
        assert_eq!(p.qemu_mode(), PollMode::Weighted);
        assert_eq!(params(32_768, 0, 0, 0).qemu_mode(), PollMode::Classic);
        assert_eq!(p.validate(), Ok(()));
        let a = AdaptiveParams::default();
        assert_eq!(
            (
                a.wakeup_ns,
                a.margin_pct,
                a.miss_limit,
                a.latency_budget_pct
            ),
            (15_000, 50, 3, 2)
        );
    }

    #[test]
    fn params_deserialize_kebab_case_with_defaults() {
        let p: PollParams = toml::from_str("poll-max-ns = 50000\npoll-weight = 2").unwrap();
        assert_eq!(p, params(50_000, 0, 0, 2));
        let p: PollParams = serde_json::from_str(r#"{"poll-grow": 4, "poll-shrink": 8}"#).unwrap();
        assert_eq!(p, params(32_768, 4, 8, 3));
        assert!(toml::from_str::<PollParams>("poll-max = 1").is_err());
        let a: AdaptiveParams = toml::from_str("wakeup-ns = 20000").unwrap();
        assert_eq!(a.wakeup_ns, 20_000);
        assert_eq!(a.margin_pct, 50);
        let m: PollMode = serde_json::from_str(r#""adaptive""#).unwrap();
        assert_eq!(m, PollMode::Adaptive);
        use clap::ValueEnum;
        assert_eq!(
            PollMode::from_str("weighted", false),
            Ok(PollMode::Weighted)
        );
        assert_eq!(PollMode::value_variants().len(), 5);
    }

    #[test]
    fn weight_out_of_range_is_rejected_and_clamped() {
        let err = params(32_768, 0, 0, 64).validate().unwrap_err();
        assert_eq!(err, PollParamsError::Weight(64));
        assert!(err.to_string().contains("poll-weight = 64"));
        assert!(err.to_string().contains("0 to 63"));
        // Never panics on the shift even if not validated.
        let mut p = PollPolicy::new(PollMode::Weighted, params(32_768, 0, 0, 200), 1);
        p.update(5_000, &[0], false);
        p.update(5_000, &[0], false);
        assert_eq!(p.poll_ns(), 5_000);
    }

    // ---- off / busy ---------------------------------------------------------

    #[test]
    fn off_and_busy_are_constant() {
        for max in [0, 32_768] {
            let mut off = PollPolicy::new(PollMode::Off, params(max, 0, 0, 0), 2);
            let mut busy = PollPolicy::new(PollMode::Busy, params(max, 0, 0, 0), 2);
            for (b, ev, hit) in [
                (1_000, &[0][..], true),
                (1_000_000, &[][..], false),
                (7, &[1][..], false),
            ] {
                off.update(b, ev, hit);
                busy.update(b, ev, hit);
                assert_eq!(off.poll_ns(), 0);
                assert_eq!(busy.poll_ns(), u64::MAX);
            }
        }
        let mut busy = PollPolicy::new(PollMode::Busy, PollParams::default(), 1);
        let r = simulate(&mut busy, &[1_000, 500_000, 8_000]);
        assert_eq!(
            r,
            SimResult {
                poll_cpu_ns: 509_000,
                wasted_cpu_ns: 0,
                sleeps: 0,
                hits: 3,
                added_latency_ns: 0
            }
        );
        let mut off = PollPolicy::new(PollMode::Off, PollParams::default(), 1);
        let r = simulate(&mut off, &[1_000, 500_000, 8_000]);
        assert_eq!(
            r,
            SimResult {
                poll_cpu_ns: 0,
                wasted_cpu_ns: 0,
                sleeps: 3,
                hits: 0,
                added_latency_ns: 45_000
            }
        );
    }

    #[test]
    fn poll_max_zero_never_polls() {
        for mode in [PollMode::Classic, PollMode::Weighted, PollMode::Adaptive] {
            let mut p = PollPolicy::new(mode, params(0, 0, 0, 3), 2);
            for _ in 0..50 {
                p.update(2_000, &[0, 1], true);
                assert_eq!(p.poll_ns(), 0, "{mode:?}");
            }
            let r = simulate(&mut p, &[100; 100]);
            assert_eq!(r.hits, 0, "{mode:?}");
            assert_eq!(r.poll_cpu_ns, 0, "{mode:?}");
        }
    }

    // ---- classic ------------------------------------------------------------

    #[test]
    fn classic_first_step_is_4000() {
        let mut p = classic(32_768, 0, 0);
        assert_eq!(p.poll_ns(), 0);
        p.update(20_000, &[0], false);
        assert_eq!(p.poll_ns(), POLL_NS_INITIAL);
        // Even with a custom grow factor.
        let mut p = classic(32_768, 10, 0);
        p.update(1, &[0], false);
        assert_eq!(p.poll_ns(), 4_000);
        // And clamped if max is below it.
        let mut p = classic(3_000, 0, 0);
        p.update(2_000, &[0], false);
        assert_eq!(p.poll_ns(), 3_000);
    }

    #[test]
    fn classic_grows_by_two_then_clamps() {
        let mut p = classic(32_768, 0, 0);
        let mut seen = vec![];
        for _ in 0..7 {
            p.update(30_000, &[0], false);
            seen.push(p.poll_ns());
        }
        assert_eq!(seen, [4_000, 8_000, 16_000, 32_000, 32_000, 32_000, 32_000]);
        // 32000 >= 30000: the sweet spot, no change.
        let mut p = classic(32_768, 0, 0);
        for _ in 0..4 {
            p.update(32_700, &[0], false);
        }
        assert_eq!(p.poll_ns(), 32_000);
        p.update(32_700, &[0], false);
        assert_eq!(p.poll_ns(), 32_768, "clamped at max");
        p.update(32_700, &[0], false);
        assert_eq!(p.poll_ns(), 32_768);
    }

    #[test]
    fn classic_custom_grow() {
        let mut p = classic(1_000_000, 3, 0);
        let mut seen = vec![];
        for _ in 0..6 {
            p.update(900_000, &[0], false);
            seen.push(p.poll_ns());
        }
        assert_eq!(seen, [4_000, 12_000, 36_000, 108_000, 324_000, 972_000]);
        p.update(900_000, &[0], false);
        assert_eq!(p.poll_ns(), 972_000, "sweet spot");
    }

    #[test]
    fn classic_sweet_spot_keeps_window() {
        let mut p = classic(32_768, 0, 0);
        p.update(10_000, &[0], false); // 4000
        p.update(10_000, &[0], false); // 8000
        p.update(10_000, &[0], false); // 16000
        assert_eq!(p.poll_ns(), 16_000);
        for b in [0, 1, 15_999, 16_000] {
            p.update(b, &[0], true);
            assert_eq!(p.poll_ns(), 16_000);
        }
    }

    #[test]
    fn classic_block_equal_to_max_neither_grows_nor_shrinks() {
        let mut p = classic(32_768, 0, 0);
        p.update(100, &[0], false);
        p.update(32_768, &[0], false);
        assert_eq!(p.poll_ns(), 4_000);
    }

    #[test]
    fn classic_shrink_resets_to_zero_by_default() {
        let mut p = classic(32_768, 0, 0);
        for _ in 0..4 {
            p.update(30_000, &[0], false);
        }
        assert_eq!(p.poll_ns(), 32_000);
        p.update(32_769, &[0], false);
        assert_eq!(p.poll_ns(), 0);
        p.update(20_000, &[0], false);
        assert_eq!(p.poll_ns(), 4_000, "restarts at the first step");
    }

    #[test]
    fn classic_custom_shrink_is_gradual() {
        let mut p = classic(32_768, 0, 4);
        for _ in 0..4 {
            p.update(30_000, &[0], false);
        }
        let mut seen = vec![];
        for _ in 0..4 {
            p.update(1_000_000, &[0], false);
            seen.push(p.poll_ns());
        }
        assert_eq!(seen, [8_000, 2_000, 500, 125]);
        // From a small window, growth doubles it again (no reset to 4000).
        p.update(10_000, &[0], false);
        assert_eq!(p.poll_ns(), 250);
    }

    #[test]
    fn classic_no_event_no_change() {
        let mut p = classic(32_768, 0, 0);
        p.update(20_000, &[0], false);
        p.update(1_000_000, &[], false);
        assert_eq!(p.poll_ns(), 4_000);
    }

    #[test]
    fn classic_multi_source_window_is_max() {
        let mut p = PollPolicy::new(PollMode::Classic, params(32_768, 0, 0, 0), 3);
        // Source 0 grows three times, source 1 once, source 2 never.
        p.update(20_000, &[0, 1], false);
        p.update(20_000, &[0], false);
        p.update(20_000, &[0], false);
        assert_eq!(p.source_poll_ns(0), Some(16_000));
        assert_eq!(p.source_poll_ns(1), Some(4_000));
        assert_eq!(p.source_poll_ns(2), Some(0));
        assert_eq!(p.source_poll_ns(3), None);
        assert_eq!(p.poll_ns(), 16_000);
        // A long wait seen by source 0 resets it; the window falls to source 1's.
        p.update(100_000, &[0], false);
        assert_eq!(p.poll_ns(), 4_000);
        // Events only adjust the sources that had them.
        p.update(10_000, &[2, 2, 9], false); // duplicate and out-of-range ignored
        assert_eq!(p.source_poll_ns(2), Some(4_000));
        assert_eq!(p.source_poll_ns(1), Some(4_000));
        assert_eq!(p.source_poll_ns(0), Some(0));
    }

    #[test]
    fn classic_idle_source_stops_counting_after_7s() {
        let mut p = PollPolicy::new(PollMode::Classic, params(32_768, 0, 0, 0), 2);
        for _ in 0..4 {
            p.update(30_000, &[0], false);
        }
        p.update(2_000, &[1], true);
        assert_eq!(p.source_poll_ns(1), Some(4_000));
        assert_eq!(p.poll_ns(), 32_000);
        // A long timeout (no event: no window changes), then source 1 fires again
        // while source 0 stays idle; 7 s of waiting without an event drop it.
        p.update(POLL_IDLE_INTERVAL_NS - 4_000, &[], false);
        assert_eq!(p.poll_ns(), 32_000);
        p.update(1_000, &[1], true);
        assert_eq!(p.poll_ns(), 32_000, "idle for 7 s - 1 us");
        p.update(1_000, &[1], true);
        assert_eq!(p.source_poll_ns(0), Some(32_000), "window kept");
        assert_eq!(p.poll_ns(), 4_000, "but no longer polled for");
        // Its next event brings it back.
        p.update(1_000, &[0], true);
        assert_eq!(p.poll_ns(), 32_000);
    }

    // ---- weighted -----------------------------------------------------------

    #[test]
    fn weighted_first_sample_taken_as_is_then_ewma() {
        let mut p = weighted(3, 0);
        p.update(10_000, &[0], false);
        assert_eq!(p.source_poll_ns(0), Some(10_000));
        assert_eq!(p.poll_ns(), 10_000, "grows straight to adj, no 4000 step");
        p.update(2_000, &[0], true);
        // 10000 - 10000/8 + 2000/8 = 10000 - 1250 + 250
        assert_eq!(p.source_poll_ns(0), Some(9_000));
        assert_eq!(p.poll_ns(), 10_000, "9000 is not below 10000/2: keep");
    }

    #[test]
    fn weighted_grows_to_max_of_adj_and_double() {
        let mut p = weighted(1, 0);
        p.update(1_000, &[0], false);
        assert_eq!(p.poll_ns(), 1_000);
        p.update(1_400, &[0], false); // ns = 1000 - 500 + 700 = 1200 > 1000: max(1200, 2000)
        assert_eq!(p.source_poll_ns(0), Some(1_200));
        assert_eq!(p.poll_ns(), 2_000);
        p.update(12_000, &[0], false); // ns = 600 + 6000 = 6600: max(6600, 4000)
        assert_eq!(p.poll_ns(), 6_600);
        p.update(30_000, &[0], false); // ns = 3300 + 15000 = 18300: max(18300, 13200)
        assert_eq!(p.poll_ns(), 18_300);
        p.update(32_000, &[0], false); // ns = 9150 + 16000 = 25150: min(max, 36600)
        assert_eq!(p.poll_ns(), 32_768);
    }

    #[test]
    fn weighted_custom_grow() {
        let mut p = PollPolicy::new(PollMode::Weighted, params(1_000_000, 4, 0, 1), 1);
        p.update(1_000, &[0], false);
        p.update(1_200, &[0], false); // ns 1100 > 1000 -> max(1100, 4000)
        assert_eq!(p.poll_ns(), 4_000);
    }

    #[test]
    fn weighted_shrink_is_gradual_by_default() {
        let mut p = weighted(3, 0);
        p.update(20_000, &[0], false);
        assert_eq!(p.poll_ns(), 20_000);
        // An interval above max resets the source's average to 0: adj = 0 < 20000/2,
        // so the window halves (no reset to 0 as in classic).
        p.update(1_000_000, &[0], false);
        assert_eq!(p.source_poll_ns(0), Some(0));
        assert_eq!(p.poll_ns(), 10_000);
        p.update(1_000_000, &[0], false);
        // ns was 0, so the sample is taken as is, >= max, back to 0.
        assert_eq!(p.poll_ns(), 5_000);
        p.update(1_000_000, &[0], false);
        assert_eq!(p.poll_ns(), 2_500);
        // Custom shrink divisor.
        let mut p = weighted(3, 4);
        p.update(20_000, &[0], false);
        p.update(1_000_000, &[0], false);
        assert_eq!(p.poll_ns(), 5_000);
        // Shrink only when adj < window / shrink.
        let mut p = weighted(3, 0);
        p.update(20_000, &[0], false);
        p.update(1_000_000, &[0], false); // window 10000, ns 0
        p.update(6_000, &[0], false); // ns 6000 > 5000: not below window/2; not above window
        assert_eq!(p.poll_ns(), 10_000);
    }

    #[test]
    fn weighted_idle_sources_age_out() {
        let mut p = PollPolicy::new(PollMode::Weighted, params(32_768, 0, 0, 3), 2);
        p.update(20_000, &[0], false);
        p.update(2_000, &[1], true);
        assert_eq!(
            p.source_poll_ns(0),
            Some(22_000),
            "idle source ages by block_ns"
        );
        assert_eq!(p.source_poll_ns(1), Some(2_000));
        assert_eq!(p.poll_ns(), 10_000, "adj = 2000 < 20000 / 2: halved");
        p.update(2_000, &[1], true);
        p.update(2_000, &[1], true);
        p.update(2_000, &[1], true);
        p.update(2_000, &[1], true);
        assert_eq!(p.source_poll_ns(0), Some(30_000));
        p.update(2_000, &[1], true);
        assert_eq!(p.source_poll_ns(0), Some(32_000));
        p.update(2_000, &[1], true);
        assert_eq!(p.source_poll_ns(0), Some(0), "reached max: aged out");
        // The window shrinks gradually to the busy source's average.
        for _ in 0..10 {
            p.update(2_000, &[1], true);
        }
        assert_eq!(p.poll_ns(), 2_500);
        // A source that never had an event does not age.
        let mut p = PollPolicy::new(PollMode::Weighted, params(32_768, 0, 0, 3), 2);
        p.update(5_000, &[0], false);
        assert_eq!(p.source_poll_ns(1), Some(0));
    }

    #[test]
    fn weighted_no_event_ages_but_keeps_window() {
        let mut p = weighted(3, 0);
        p.update(10_000, &[0], false);
        p.update(10_000, &[], false);
        assert_eq!(p.source_poll_ns(0), Some(20_000));
        assert_eq!(p.poll_ns(), 10_000, "no event, no window adjustment");
    }

    #[test]
    fn weighted_multi_source_adj_is_max_of_those_with_events() {
        let mut p = PollPolicy::new(PollMode::Weighted, params(32_768, 0, 0, 3), 3);
        p.update(4_000, &[0, 2], false);
        assert_eq!(p.poll_ns(), 4_000);
        p.update(24_000, &[1], false); // source 1: 24000; sources 0, 2 age to 28000
        assert_eq!(p.poll_ns(), 24_000);
        p.update(1_000, &[0], true); // source 0: 28000 - 3500 + 125 = 24625 > 24000
        assert_eq!(p.source_poll_ns(0), Some(24_625));
        assert_eq!(p.poll_ns(), 32_768);
    }

    /// Iterations until the window settles after the intervals drop from 30 us to
    /// 4 us. It halves whenever the average falls below half of it (30000, 15000,
    /// 7500) and stays at 7500: 4000 is not below 7500 / 2. The average falls at a
    /// rate set by the weight.
    fn weighted_settle(weight: u32) -> usize {
        let mut p = weighted(weight, 0);
        for _ in 0..50 {
            p.update(30_000, &[0], false);
        }
        assert_eq!(p.poll_ns(), 30_000);
        for i in 1..=1000 {
            p.update(4_000, &[0], true);
            if p.poll_ns() == 7_500 {
                for _ in 0..1000 {
                    p.update(4_000, &[0], true);
                }
                assert_eq!(p.poll_ns(), 7_500, "steady");
                return i;
            }
        }
        panic!("weight {weight} never settled");
    }

    #[test]
    fn weighted_weights_converge_at_different_speeds() {
        let n: Vec<usize> = (1..=4).map(weighted_settle).collect();
        // Average below 7500 after k steps: 4000 + 26000 (1 - 2^-w)^k < 7500.
        assert_eq!(n, [3, 7, 16, 32]);
        // Weight 0 means the default, 3.
        let mut a = weighted(0, 0);
        let mut b = weighted(3, 0);
        for x in [10_000, 3_000, 17_000, 40_000, 2_000, 9_000] {
            a.update(x, &[0], false);
            b.update(x, &[0], false);
            assert_eq!(a.poll_ns(), b.poll_ns());
        }
        eprintln!("weighted: iterations to settle from 30 us to 4 us, weights 1..4: {n:?}");
    }

    #[test]
    fn weighted_ewma_step_by_weight() {
        for (w, expect) in [(1, 6_000), (2, 7_000), (3, 7_500), (4, 7_750)] {
            let mut p = weighted(w, 0);
            p.update(8_000, &[0], false);
            p.update(4_000, &[0], true);
            assert_eq!(p.source_poll_ns(0), Some(expect), "weight {w}");
        }
    }

    // ---- adaptive -----------------------------------------------------------

    /// Feeds `n` events of interval `t` through the simulation model.
    fn feed(p: &mut PollPolicy, t: u64, n: usize) -> SimResult {
        simulate(p, &vec![t; n])
    }

    #[test]
    fn adaptive_starts_closed_and_opens_on_short_intervals() {
        let mut p = adaptive();
        assert_eq!(p.poll_ns(), 0);
        // Only the first event, before any sample, is slept on: a wake-up would add
        // 190% to an 8 us cycle, far above the IOPS budget.
        let r = feed(&mut p, 8_000, 2);
        assert_eq!((r.sleeps, r.hits), (1, 1));
        assert!(p.poll_ns() >= 8_000, "{}", p.poll_ns());
        // The first sample alone (after a sleep: 35 us measured, 20 us corrected)
        // yields a cover of 3x the interval (mean + 4 x an initial deviation of half
        // the mean).
        let mut p = PollPolicy::new(PollMode::Adaptive, params(100_000, 0, 0, 0), 1);
        p.update(20_000 + WAKEUP_LATENCY_NS, &[0], false);
        assert_eq!(p.source_poll_ns(0), Some(60_000));
        // A wait shorter than 4/3 of the wake-up loses only 3/4 of it.
        let mut p = PollPolicy::new(PollMode::Adaptive, params(100_000, 0, 0, 0), 1);
        p.update(4_000 + WAKEUP_LATENCY_NS, &[0], false);
        assert_eq!(p.source_poll_ns(0), Some(3 * 4_750));
        let mut p = adaptive();
        let r = feed(&mut p, 8_000, 100);
        assert_eq!(r.sleeps, 1);
    }

    #[test]
    fn adaptive_steady_short_intervals_are_covered_with_margin() {
        let mut p = adaptive();
        feed(&mut p, 8_000, 200);
        let w = p.poll_ns();
        assert!((8_000..=12_500).contains(&w), "window {w}");
        assert_eq!(w, p.source_poll_ns(0).unwrap());
        let r = feed(&mut p, 8_000, 1000);
        assert_eq!(r.hits, 1000);
        assert_eq!(r.poll_cpu_ns, 8_000_000);
    }

    #[test]
    fn adaptive_long_intervals_give_zero_window() {
        let mut p = adaptive();
        let r = feed(&mut p, 500_000, 100);
        assert_eq!(p.poll_ns(), 0);
        assert_eq!(r.poll_cpu_ns, 0, "never polled for intervals above max");
        // After a short phase, a long phase closes the window again.
        feed(&mut p, 8_000, 100);
        assert!(p.poll_ns() > 0);
        let r = feed(&mut p, 500_000, 100);
        assert_eq!(p.poll_ns(), 0);
        assert!(r.poll_cpu_ns <= 5 * 12_000, "wasted {}", r.poll_cpu_ns);
    }

    #[test]
    fn adaptive_jittery_and_bimodal_windows_are_bounded() {
        let mut rng = Rng(7);
        let mut p = adaptive();
        for _ in 0..2000 {
            let t = rng.range(4_000, 20_000);
            simulate(&mut p, &[t]);
            assert!(p.poll_ns() <= 32_768);
        }
        let w = p.poll_ns();
        assert!((16_000..=32_768).contains(&w), "jitter 4-20 us: window {w}");

        // Bimodal within range: covers the upper mode, capped by max.
        let mut p = adaptive();
        for i in 0..2000 {
            simulate(&mut p, &[if i % 2 == 0 { 4_000 } else { 24_000 }]);
            assert!(p.poll_ns() <= 32_768);
        }
        assert!(p.poll_ns() >= 24_000, "{}", p.poll_ns());

        // Bimodal across max: the window covers the short mode only.
        let mut p = adaptive();
        for i in 0..2000 {
            let t = if rng.chance(70) {
                rng.range(6_000, 10_000)
            } else {
                300_000
            };
            simulate(&mut p, &[t]);
            if i > 50 {
                assert!(p.poll_ns() <= 20_000, "{}", p.poll_ns());
            }
        }
    }

    #[test]
    fn adaptive_backs_off_after_consecutive_misses_and_rearms() {
        let mut p = adaptive();
        feed(&mut p, 8_000, 200);
        let full = p.poll_ns();
        assert!(full >= 8_000);
        // Polling misses: the window expired, the event came after a sleep.
        let mut windows = vec![];
        for _ in 0..6 {
            let w = p.poll_ns();
            p.update(200_000 + w, &[0], false);
            windows.push(p.poll_ns());
        }
        // At a hit rate of ~1, three misses in a row are a surprise (odds < 1/64):
        // the third halves the window, and each further miss halves it again.
        assert_eq!(&windows[..2], &[full, full], "{windows:?}");
        assert_eq!(windows[2], full / 2, "{windows:?}");
        assert_eq!(windows[3], full / 4, "{windows:?}");
        assert_eq!(windows[4], full / 8, "{windows:?}");
        assert_eq!(
            windows[5], 0,
            "below {ADAPTIVE_MIN_POLL_NS} ns: not worth polling"
        );
        // Timeouts with no event count as misses too.
        p.update(1_000_000, &[], false);
        assert_eq!(p.poll_ns(), 0);
        // A short interval (caught after a sleep) re-arms at once; two open the gate.
        p.update(8_000 + WAKEUP_LATENCY_NS, &[0], false);
        p.update(8_000 + WAKEUP_LATENCY_NS, &[0], false);
        assert_eq!(p.poll_ns(), full);
    }

    #[test]
    fn adaptive_gate_closes_when_hits_are_rare() {
        // 10% short intervals: polling would waste its window 9 times in 10.
        let mut rng = Rng(3);
        let trace: Vec<u64> = (0..5000)
            .map(|_| if rng.chance(10) { 8_000 } else { 400_000 })
            .collect();
        let mut p = adaptive();
        let r = simulate(&mut p, &trace);
        let mut w = weighted(3, 0);
        let rw = simulate(&mut w, &trace);
        assert!(
            r.poll_cpu_ns * 3 < rw.poll_cpu_ns,
            "adaptive {r:?} weighted {rw:?}"
        );
    }

    #[test]
    fn adaptive_idle_source_does_not_hold_the_window() {
        let mut p = PollPolicy::new(PollMode::Adaptive, PollParams::default(), 2);
        for _ in 0..100 {
            p.update(25_000, &[0], true);
        }
        for _ in 0..100 {
            p.update(3_000, &[1], true);
        }
        // Source 0 has been quiet for 300 us of waiting: only source 1 counts.
        assert!(p.source_poll_ns(0).unwrap() >= 25_000);
        let w = p.poll_ns();
        assert!((3_000..=5_000).contains(&w), "{w}");
        // Both active: the window is the larger cover.
        p.update(3_000, &[0, 1], true);
        assert_eq!(p.poll_ns(), 32_768);
    }

    #[test]
    fn adaptive_wakeup_correction_recovers_intervals_near_max() {
        // 25 us intervals look like 40 us (> max) after a sleep; the correction
        // recognizes them as pollable and the policy ends up catching them.
        let mut p = adaptive();
        feed(&mut p, 25_000, 50);
        let r = feed(&mut p, 25_000, 100);
        assert_eq!(r.hits, 100);
    }

    #[test]
    fn adaptive_params_are_used() {
        let a = AdaptiveParams {
            margin_pct: 100,
            miss_limit: 5,
            ..AdaptiveParams::default()
        };
        let mut p = adaptive().with_adaptive_params(a);
        assert_eq!(p.adaptive_params(), a);
        feed(&mut p, 8_000, 200);
        let full = p.poll_ns();
        assert!((15_000..=16_500).contains(&full), "margin 100%: {full}");
        for _ in 0..4 {
            p.update(full + 200_000, &[0], false);
            assert_eq!(
                p.poll_ns(),
                full,
                "miss_limit 5: no back-off before the fifth miss"
            );
        }
        p.update(full + 200_000, &[0], false);
        assert_eq!(p.poll_ns(), full / 2);
        // A larger wake-up price makes polling pay at lower hit rates.
        let cheap = AdaptiveParams {
            wakeup_ns: 1_000,
            latency_budget_pct: 100,
            ..AdaptiveParams::default()
        };
        let dear = AdaptiveParams {
            wakeup_ns: 50_000,
            latency_budget_pct: 100,
            ..AdaptiveParams::default()
        };
        let trace: Vec<u64> = (0..400)
            .map(|i| if i % 2 == 0 { 8_000 } else { 300_000 })
            .collect();
        let mut p = adaptive().with_adaptive_params(cheap);
        let r_cheap = simulate(&mut p, &trace);
        let mut p = adaptive().with_adaptive_params(dear);
        let r_dear = simulate(&mut p, &trace);
        assert!(
            r_dear.hits > 150 && r_cheap.hits < 20,
            "{r_cheap:?} {r_dear:?}"
        );
    }

    #[test]
    fn adaptive_run_of_misses_is_judged_against_the_hit_rate() {
        // Intervals 20-60 us: about 30% are pollable. Runs of 3-5 misses are normal
        // there and must not shrink the window below the pollable ones.
        let mut rng = Rng(11);
        let mut p = adaptive();
        for _ in 0..2000 {
            let t = rng.range(20_000, 60_000);
            simulate(&mut p, &[t]);
        }
        let full = p.target_ns;
        assert_eq!(full, 32_768);
        for _ in 0..5 {
            p.update(60_000 + WAKEUP_LATENCY_NS, &[0], false);
        }
        assert_eq!(
            p.poll_ns(),
            full,
            "5 misses at a ~30% hit rate: not a surprise"
        );
    }

    #[test]
    fn adaptive_latency_budget_keeps_polling_when_sleeping_costs_iops() {
        // 30% of intervals pollable: polling wastes more CPU than the latency it
        // saves (ski rental says sleep), but sleeping would cost ~11% IOPS.
        let mut rng = Rng(5);
        let trace: Vec<u64> = (0..5000).map(|_| rng.range(20_000, 60_000)).collect();
        let mut p = adaptive();
        let with_budget = simulate(&mut p, &trace);
        let no_budget = AdaptiveParams {
            latency_budget_pct: 100,
            ..AdaptiveParams::default()
        };
        let mut p = adaptive().with_adaptive_params(no_budget);
        let without = simulate(&mut p, &trace);
        let pollable = trace.iter().filter(|&&t| t <= 32_768).count() as u64;
        assert!(
            with_budget.hits * 100 >= pollable * 95,
            "{with_budget:?} of {pollable}"
        );
        assert!(
            without.hits * 100 <= pollable * 20,
            "{without:?} of {pollable}"
        );
        assert!(without.wasted_cpu_ns * 5 < with_budget.wasted_cpu_ns);
    }

    // ---- sources and parameters at run time ---------------------------------

    #[test]
    fn set_num_sources_shrinking_and_growing() {
        for mode in [PollMode::Classic, PollMode::Adaptive] {
            let mut p = PollPolicy::new(mode, PollParams::default(), 2);
            for _ in 0..50 {
                p.update(3_000, &[0], true);
                p.update(25_000, &[1], true);
            }
            let both = p.poll_ns();
            assert!(both >= 25_000, "{mode:?} {both}");
            p.set_num_sources(1);
            assert_eq!(p.num_sources(), 1);
            assert!(
                p.poll_ns() < both,
                "{mode:?}: removed source no longer counts"
            );
            assert_eq!(p.source_poll_ns(1), None);
            p.set_num_sources(3);
            assert_eq!(
                p.source_poll_ns(1),
                Some(0),
                "{mode:?}: re-added source is fresh"
            );
            assert_eq!(p.source_poll_ns(2), Some(0));
            p.update(3_000, &[2], true);
            assert!(p.source_poll_ns(2).unwrap() > 0);
        }
        // Weighted keeps its IOThread window; the removed source's average is gone.
        let mut p = PollPolicy::new(PollMode::Weighted, PollParams::default(), 2);
        p.update(20_000, &[1], false);
        p.set_num_sources(1);
        assert_eq!(p.poll_ns(), 20_000);
        p.set_num_sources(2);
        assert_eq!(p.source_poll_ns(1), Some(0));
        // Zero sources: nothing to poll for.
        let mut p = PollPolicy::new(PollMode::Classic, PollParams::default(), 1);
        p.update(10_000, &[0], false);
        p.set_num_sources(0);
        assert_eq!(p.poll_ns(), 0);
        p.update(10_000, &[0], false);
        assert_eq!(p.poll_ns(), 0);
    }

    #[test]
    fn set_params_resets_state() {
        let mut p = classic(32_768, 0, 0);
        p.update(10_000, &[0], false);
        p.update(10_000, &[0], false);
        assert_eq!(p.poll_ns(), 8_000);
        p.set_params(params(100_000, 4, 0, 0));
        assert_eq!(p.poll_ns(), 0);
        assert_eq!(p.params().poll_max_ns, 100_000);
        p.update(50_000, &[0], false);
        p.update(50_000, &[0], false);
        assert_eq!(p.poll_ns(), 16_000);
    }

    // ---- simulation -----------------------------------------------------------

    #[test]
    fn simulate_model() {
        // Classic: 0 -> sleep; 4000 -> 8 us misses; 8000 -> hit.
        let mut p = classic(32_768, 0, 0);
        let r = simulate(&mut p, &[8_000, 8_000, 8_000]);
        assert_eq!(r.sleeps, 2);
        assert_eq!(r.hits, 1);
        assert_eq!(r.poll_cpu_ns, 4_000 + 8_000);
        assert_eq!(r.wasted_cpu_ns, 4_000);
        assert_eq!(r.added_latency_ns, 2 * WAKEUP_LATENCY_NS);
        // A policy without sources gets one.
        let mut p = PollPolicy::new(PollMode::Classic, PollParams::default(), 0);
        let r = simulate(&mut p, &[1_000, 1_000]);
        assert_eq!(p.num_sources(), 1);
        assert_eq!((r.sleeps, r.hits), (1, 1));
        assert_eq!(p.poll_ns(), 4_000);
    }

    /// What the adaptive policy must achieve on a trace, besides staying within 1
    /// point of the IOPS that any window capped at `poll-max-ns` can reach.
    #[derive(Clone, Copy, PartialEq)]
    enum Expect {
        /// Every interval is pollable: at least 99% of busy polling's hits.
        BusyHits,
        /// Some intervals are not pollable: no more CPU wasted than weighted.
        LessWaste,
        /// Sleeping costs more than the IOPS budget: more IOPS than weighted.
        MoreIops,
    }

    struct Trace {
        name: &'static str,
        intervals: Vec<u64>,
        expect: Expect,
    }

    fn traces() -> Vec<Trace> {
        let mut rng = Rng(0x5eed);
        let n = 20_000;
        let mut mix = |short_pct: u64, short: (u64, u64), long: (u64, u64)| -> Vec<u64> {
            (0..n)
                .map(|_| {
                    if rng.chance(short_pct) {
                        rng.range(short.0, short.1)
                    } else {
                        rng.range(long.0, long.1)
                    }
                })
                .collect()
        };
        use Expect::*;
        let mut t = vec![
            Trace {
                name: "steady 8us",
                intervals: vec![8_000; n],
                expect: BusyHits,
            },
            Trace {
                name: "jitter 4-20us",
                intervals: mix(100, (4_000, 20_000), (0, 0)),
                expect: BusyHits,
            },
            Trace {
                name: "tail 70% 5-15/30% 15-32us",
                intervals: mix(70, (5_000, 15_000), (15_000, 32_000)),
                expect: BusyHits,
            },
            Trace {
                name: "nvme 90% 6-14/10% 40-200us",
                intervals: mix(90, (6_000, 14_000), (40_000, 200_000)),
                expect: LessWaste,
            },
            Trace {
                name: "bimodal 50% 8/300us",
                intervals: mix(50, (8_000, 8_000), (300_000, 300_000)),
                expect: LessWaste,
            },
            Trace {
                name: "sparse 20% 8/300us",
                intervals: mix(20, (8_000, 8_000), (300_000, 300_000)),
                expect: LessWaste,
            },
            Trace {
                name: "mid 20-60us",
                intervals: mix(100, (20_000, 60_000), (0, 0)),
                expect: MoreIops,
            },
            Trace {
                name: "slow 500us",
                intervals: vec![500_000; n / 4],
                expect: LessWaste,
            },
        ];
        let mut rng = Rng(0xfeed);
        t.push(Trace {
            name: "phases 1000x 8us/40-80us",
            intervals: (0..n)
                .map(|i| {
                    if (i / 1000) % 2 == 0 {
                        rng.range(6_000, 10_000)
                    } else {
                        rng.range(40_000, 80_000)
                    }
                })
                .collect(),
            expect: LessWaste,
        });
        t
    }

    /// The best any window capped at `max` can do: poll exactly until the event if
    /// it is pollable, sleep at once otherwise.
    fn oracle(trace: &[u64], max: u64) -> SimResult {
        let mut r = SimResult::default();
        for &t in trace {
            if t <= max {
                r.hits += 1;
                r.poll_cpu_ns += t;
            } else {
                r.sleeps += 1;
                r.added_latency_ns += WAKEUP_LATENCY_NS;
            }
        }
        r
    }

    /// Estimated IOPS loss against busy polling for a closed loop (queue depth 1):
    /// the added latency over the total time.
    fn iops_loss_pct(r: &SimResult, trace: &[u64]) -> f64 {
        let total: u64 = trace.iter().sum();
        100.0 * r.added_latency_ns as f64 / (total + r.added_latency_ns) as f64
    }

    #[test]
    fn simulation_comparison() {
        eprintln!(
            "{:<27} {:<9} {:>6} {:>6} {:>8} {:>9} {:>8}",
            "trace (events)", "mode", "hits%", "sleeps", "CPU ms", "waste ms", "IOPS -%"
        );
        let row = |name: &str, mode: &str, r: &SimResult, trace: &[u64]| {
            eprintln!(
                "{:<27} {:<9} {:>6.1} {:>6} {:>8.1} {:>9.1} {:>8.2}",
                name,
                mode,
                100.0 * r.hits as f64 / trace.len() as f64,
                r.sleeps,
                r.poll_cpu_ns as f64 / 1e6,
                r.wasted_cpu_ns as f64 / 1e6,
                iops_loss_pct(r, trace)
            );
        };
        for tr in traces() {
            let mut results = vec![];
            for mode in [
                PollMode::Busy,
                PollMode::Classic,
                PollMode::Weighted,
                PollMode::Adaptive,
            ] {
                let mut p = PollPolicy::new(mode, PollParams::default(), 1);
                let r = simulate(&mut p, &tr.intervals);
                row(
                    tr.name,
                    &format!("{mode:?}").to_lowercase(),
                    &r,
                    &tr.intervals,
                );
                results.push(r);
            }
            // The adaptive policy without its IOPS budget (pure ski-rental gate).
            let cpu_first = AdaptiveParams {
                latency_budget_pct: 100,
                ..AdaptiveParams::default()
            };
            let mut p = adaptive().with_adaptive_params(cpu_first);
            row(
                tr.name,
                "adapt-b∞",
                &simulate(&mut p, &tr.intervals),
                &tr.intervals,
            );
            let best = oracle(&tr.intervals, DEFAULT_POLL_MAX_NS);
            row(tr.name, "(oracle)", &best, &tr.intervals);
            let (busy, weighted, adaptive) = (results[0], results[2], results[3]);
            let loss = |r: &SimResult| iops_loss_pct(r, &tr.intervals);
            match tr.expect {
                Expect::BusyHits => {
                    assert!(
                        adaptive.hits * 100 >= busy.hits * 99,
                        "{}: {adaptive:?}",
                        tr.name
                    );
                    assert!(
                        adaptive.hits >= weighted.hits,
                        "{}: {adaptive:?} {weighted:?}",
                        tr.name
                    );
                }
                Expect::LessWaste => assert!(
                    adaptive.wasted_cpu_ns <= weighted.wasted_cpu_ns,
                    "{}: adaptive {adaptive:?} weighted {weighted:?}",
                    tr.name
                ),
                Expect::MoreIops => assert!(
                    loss(&adaptive) + 1.0 < loss(&weighted),
                    "{}: adaptive {adaptive:?} weighted {weighted:?}",
                    tr.name
                ),
            }
            assert!(
                loss(&adaptive) - loss(&best) < 1.0,
                "{}: {adaptive:?} {best:?}",
                tr.name
            );
        }
    }

    #[test]
    fn adaptive_naps_only_when_events_are_predictably_late() {
        // Measured on the host: naps end 6 us late, +- 0.5, and cost 7 us of CPU.
        let calibrated = |sources| {
            let mut p = PollPolicy::new(PollMode::Adaptive, PollParams::default(), sources);
            p.set_nap_late(6_000, 500);
            p.set_nap_cpu_ns(7_000);
            p
        };
        // A source with an event every `gap` ns, the last one at `t`.
        let rhythm = |p: &mut PollPolicy, source: usize, start: u64, gap: u64, n: u64| {
            for k in 0..n {
                p.observe_events_at(start + k * gap, &[source]);
            }
            start + (n - 1) * gap
        };
        // Steady 30 us gaps (a device's latency), 2 us after the last event: nap
        // until one overshoot (7 us) before the next: 30 - 2 - 7 = 21 us.
        let mut p = calibrated(1);
        let t = rhythm(&mut p, 0, 1_000, 30_000, 200);
        let nap = p.nap_at(t + 2_000);
        assert!((20_000..=21_500).contains(&nap), "nap {nap}");
        // Past the predicted time: no nap.
        assert_eq!(p.nap_at(t + 25_000), 0);
        // The spin after a nap covers the timer's lateness and the spread.
        assert!(
            (7_000..=12_000).contains(&p.nap_spin_ns()),
            "{}",
            p.nap_spin_ns()
        );
        // Gaps beyond poll-max-ns (an 80 us device): the nap reaches past it,
        // which the window never does.
        let mut p = calibrated(1);
        let t = rhythm(&mut p, 0, 1_000, 80_000, 200);
        let nap = p.nap_at(t);
        assert!((72_000..=73_500).contains(&nap), "nap {nap}");
        assert!(p.nap_spin_ns() <= PollParams::default().poll_max_ns);
        // Steady 10 us gaps: a 2-3 us nap would save too little for the risk.
        let mut p = calibrated(1);
        let t = rhythm(&mut p, 0, 1_000, 10_000, 200);
        assert_eq!(p.nap_at(t), 0);
        // Two sources: the earliest expected event bounds the nap. Completions
        // every 60 us; kicks every 60 us, 10 us after each completion.
        let mut p = calibrated(2);
        for k in 0..99u64 {
            p.observe_events_at(1_000 + k * 60_000, &[0]);
            p.observe_events_at(11_000 + k * 60_000, &[1]);
        }
        let last_completion = 1_000 + 99 * 60_000;
        p.observe_events_at(last_completion, &[0]);
        // Right after a completion the kick is 10 us away: no nap.
        assert_eq!(p.nap_at(last_completion + 1_000), 0);
        // Right after the kick, the next completion is ~50 us away.
        p.observe_events_at(last_completion + 10_000, &[1]);
        let nap = p.nap_at(last_completion + 11_000);
        assert!((41_000..=43_000).contains(&nap), "nap {nap}");
        // A source active but without an estimate yet: no nap.
        let mut p = calibrated(2);
        let t = rhythm(&mut p, 0, 1_000, 30_000, 50);
        p.observe_events_at(t + 1_000, &[1]);
        assert_eq!(p.nap_at(t + 2_000), 0);
        // A source silent for longer than the horizon no longer counts, and a
        // gap that long is not learnt.
        let mut p = calibrated(2);
        let t = rhythm(&mut p, 0, 1_000, 30_000, 50);
        let t2 = rhythm(&mut p, 1, t + 10 * NAP_HORIZON_NS, 40_000, 50);
        assert!(p.nap_at(t2 + 1_000) > 20_000);
        // ...but a nap costing as much CPU as spinning through it is not taken.
        p.set_nap_cpu_ns(60_000);
        assert_eq!(p.nap_at(t2 + 1_000), 0);
        // Other modes, and poll-max-ns=0, never nap.
        for mode in [
            PollMode::Classic,
            PollMode::Weighted,
            PollMode::Busy,
            PollMode::Off,
        ] {
            let mut p = PollPolicy::new(mode, PollParams::default(), 1);
            let t = rhythm(&mut p, 0, 1_000, 30_000, 50);
            assert_eq!(p.nap_at(t), 0, "{mode:?}");
        }
        let mut p = PollPolicy::new(
            PollMode::Adaptive,
            PollParams {
                poll_max_ns: 0,
                ..Default::default()
            },
            1,
        );
        let t = rhythm(&mut p, 0, 1_000, 30_000, 50);
        assert_eq!(p.nap_at(t), 0);
    }

    #[test]
    fn nap_lateness_is_learnt_from_measured_naps() {
        let mut p = PollPolicy::new(PollMode::Adaptive, PollParams::default(), 1);
        // Unmeasured: the configured wake-up latency stands in.
        assert_eq!(p.nap_late_ns(), AdaptiveParams::default().wakeup_ns);
        assert_eq!(p.nap_cpu_ns(), DEFAULT_NAP_CPU_NS);
        // The first sample sets the mean, with half of it as deviation.
        p.observe_nap(10_000, 16_000);
        assert_eq!(p.nap_late_ns(), 6_000 + 2 * 3_000);
        // Steady samples: the deviation decays, the mean stays.
        for _ in 0..100 {
            p.observe_nap(10_000, 16_000);
        }
        assert!(
            (6_000..=6_100).contains(&p.nap_late_ns()),
            "{}",
            p.nap_late_ns()
        );
        // The host gets slower: the estimate follows.
        for _ in 0..100 {
            p.observe_nap(10_000, 30_000);
        }
        assert!(
            (20_000..=20_500).contains(&p.nap_late_ns()),
            "{}",
            p.nap_late_ns()
        );
        // A calibration sets both; samples then refine them.
        p.set_nap_late(7_000, 1_000);
        assert_eq!(p.nap_late_ns(), 9_000);
        p.observe_nap(10_000, 17_000);
        assert!(p.nap_late_ns() < 9_000);
        // One preempted nap moves the estimate by a fraction of itself.
        let before = p.nap_late_ns();
        p.observe_nap(10_000, 900_000);
        assert!(
            p.nap_late_ns() < 3 * before,
            "{} -> {}",
            before,
            p.nap_late_ns()
        );
        // A preempted first nap counts as at most 1 ms late; an early one as 1 ns.
        let mut q = PollPolicy::new(PollMode::Adaptive, PollParams::default(), 1);
        q.observe_nap(10_000, 5_000_000_000);
        assert_eq!(q.nap_late_ns(), 2 * NAP_SAMPLE_CAP_NS);
        let mut q = PollPolicy::new(PollMode::Adaptive, PollParams::default(), 1);
        q.observe_nap(10_000, 9_000);
        assert_eq!(q.nap_late_ns(), 1);
    }
}

//! The polling policy of an IOThread: how long to busy-poll before blocking, and
//! (adaptive mode) how long to nap first.
//!
//! This is a pure policy module (no threads, no clocks, no I/O). The event loop of an
//! IOThread asks [`PollPolicy::poll_ns`] for the current *polling window*, busy-polls
//! its pollable sources (each virtqueue's avail ring and the io_uring completion
//! queue) for at most that long, blocks if nothing turned up, and then reports what
//! happened with [`PollPolicy::update`]: the time it waited (`block_ns`, polling plus
//! blocking, as QEMU measures it), which sources had work, and whether the work was
//! found while polling. Every mode is a deterministic function of those reports, so
//! the unit tests pin the behaviour iteration by iteration, and [`simulate`] replays
//! a trace of event intervals through any policy.
//!
//! # Modes, and where each lives
//!
//! - [`PollMode::Off`]: never poll (always block in the kernel).
//! - [`PollMode::Busy`]: never block (the SPDK model; the window is `u64::MAX`).
//! - [`PollMode::Classic`]: QEMU's `adjust_polling_time` (util/aio-posix.c), in
//!   `classic.rs`.
//! - [`PollMode::Weighted`]: QEMU's `poll-weight` algorithm (QEMU 11.1), also in
//!   `classic.rs`.
//! - [`PollMode::Adaptive`]: our design, in `adaptive.rs` (when and how long to poll)
//!   and `nap.rs` (hybrid polling: sleep through the predictable part of a wait).
//!
//! [`PollPolicy`] is the facade the IOThread holds. It keeps the knobs, the nap
//! timing measured on this host and one algorithm's state: an enum with one variant
//! per mode, each holding only what its algorithm uses. The [`sim`] module replays
//! traces through a policy; `cargo run --release -p vqblk-daemon --example poll_sim`
//! prints the modes side by side on its reference traces, with the best any window
//! capped at `poll-max-ns` could do. docs/polling.md explains the design and the
//! measurements.
//!
//! The knobs are QEMU's ([`PollParams`]: `poll-max-ns`, `poll-grow`, `poll-shrink`,
//! `poll-weight`, with QEMU's defaults and meanings). `poll-max-ns = 0` disables
//! polling in every mode except `busy`.

mod adaptive;
mod classic;
mod nap;
pub mod sim;
mod trial;

#[cfg(test)]
mod tests;

use serde::Deserialize;

use adaptive::Adaptive;
use classic::{Classic, Weighted};
use nap::NapTiming;
pub use sim::{simulate, simulate_events, SimEvent, SimResult};
use trial::Trials;

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

/// Adaptive windows that a run of misses halved below this are rounded down
/// to 0: one pass over the sources plus the notification toggling costs
/// about as much. A target below it (intervals of a few hundred
/// nanoseconds) is raised to it: its events end the spin long before.
pub const ADAPTIVE_MIN_POLL_NS: u64 = 1_000;

/// Shortest hybrid-polling nap ([`PollPolicy::nap_at`]).
pub const MIN_NAP_NS: u64 = 1_000;

/// Sleeps without a timer after which an adaptive thread whose naps have not
/// told it their lateness since takes a timed nap first
/// ([`PollPolicy::sample_nap`]).
pub const NAP_SAMPLE_EVERY: u32 = 64;

/// Length of a nap taken to measure the timer's lateness, in ns: the
/// calibration's when a thread starts, and the sampled ones
/// ([`PollPolicy::sample_nap`]).
pub const NAP_SAMPLE_NS: u64 = 20_000;

/// Spinning without a nap ended by its timer after which an adaptive thread
/// takes a timed nap before its next spin, in ns
/// ([`PollPolicy::sample_nap_in_spin`]).
pub const NAP_SAMPLE_SPIN_NS: u64 = 100_000_000;

/// CPU a nap must save over spinning through the same time, in ns, at least
/// ([`PollPolicy::nap_at`] also asks for a quarter of the nap's length): below
/// this the risk of a late timer is not worth it.
pub const MIN_NAP_SAVING_NS: u64 = 2_000;

/// Until measured ([`PollPolicy::set_nap_cpu_ns`]): thread CPU time of one timed
/// nap (arming the timer, the context switches, the interrupt).
pub const DEFAULT_NAP_CPU_NS: u64 = 5_000;

/// The policy's source of the backend's completions (the io_uring ring, RBD,
/// the null backend's latency timer); sources 1.. are the virtqueues. Its
/// rhythm is the device's latency, the one that follows the thread's own
/// submissions: a nap may plan for it where its gaps scatter beyond a
/// bounded spin ([`PollPolicy::nap_at`]).
pub const DEVICE_SOURCE: usize = 0;

/// Inter-arrival times longer than this are idle periods, not a rhythm to nap
/// through; a source silent for longer is not expected soon.
pub const NAP_HORIZON_NS: u64 = 1_000_000;

/// Wake-up latency charged by [`simulate`] to an event found after sleeping, and
/// the adaptive policy's price of a sleep until its IOThread has measured the
/// host's own ([`PollPolicy::wakeup_ns`]).
pub const WAKEUP_LATENCY_NS: u64 = 15_000;

/// Gain of the Jacobson/Karels means (1/8), as TCP's SRTT.
const MEAN_SHIFT: u32 = 3;
/// Gain of the Jacobson/Karels mean deviations (1/4), as TCP's RTTVAR.
const DEV_SHIFT: u32 = 2;

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

/// Knobs of the [`PollMode::Adaptive`] algorithm (see `adaptive.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct AdaptiveParams {
    /// Price of going to sleep instead of catching the event by polling, in ns: the
    /// latency of an epoll sleep, wake-up and context switch (default 15000), used
    /// until the host's own is measured ([`PollPolicy::wakeup_ns`]). It is both
    /// the benefit side of the poll/sleep break-even and the latency removed from
    /// intervals measured across a sleep.
    pub wakeup_ns: u64,
    /// Margin of the window over the predicted interval, in percent (default 50:
    /// poll for 1.5x the mean interval when it is steady).
    pub margin_pct: u64,
    /// Consecutive misses always tolerated before the window may halve (default 3);
    /// it halves only once the run is also unlikely (below 1/64) given the hit rate.
    pub miss_limit: u32,
    /// IOPS budget, in percent of a request's round trip (the mean event interval
    /// times the mean number of requests the backend holds, at least one): when
    /// the wake-ups that polling would avoid add more latency than this, poll even
    /// if the CPU it wastes exceeds the latency it saves (default 2).
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

/// The learnt state of the algorithm a policy runs: each variant holds only what
/// its algorithm uses.
#[derive(Debug, Clone)]
enum Algorithm {
    /// [`PollMode::Off`]: nothing to learn, the window is 0.
    Off,
    /// [`PollMode::Busy`]: nothing to learn, the window is `u64::MAX`.
    Busy,
    /// [`PollMode::Classic`]: a window per source.
    Classic(Classic),
    /// [`PollMode::Weighted`]: an interval average per source, one window.
    Weighted(Weighted),
    /// [`PollMode::Adaptive`]: interval and rhythm estimates per source, hit rate,
    /// gate and back-off.
    Adaptive(Adaptive),
}

impl Algorithm {
    /// A fresh state of `mode`'s algorithm for `n` sources.
    fn new(mode: PollMode, n: usize) -> Self {
        match mode {
            PollMode::Off => Algorithm::Off,
            PollMode::Busy => Algorithm::Busy,
            PollMode::Classic => Algorithm::Classic(Classic::new(n)),
            PollMode::Weighted => Algorithm::Weighted(Weighted::new(n)),
            PollMode::Adaptive => Algorithm::Adaptive(Adaptive::new(n)),
        }
    }

    /// The mode this state belongs to.
    fn mode(&self) -> PollMode {
        match self {
            Algorithm::Off => PollMode::Off,
            Algorithm::Busy => PollMode::Busy,
            Algorithm::Classic(_) => PollMode::Classic,
            Algorithm::Weighted(_) => PollMode::Weighted,
            Algorithm::Adaptive(_) => PollMode::Adaptive,
        }
    }
}

/// The polling state of one IOThread.
#[derive(Debug, Clone)]
pub struct PollPolicy {
    /// The QEMU knobs.
    params: PollParams,
    /// The knobs of the adaptive algorithm (kept in every mode, as configured).
    adaptive: AdaptiveParams,
    /// The running algorithm and what it learnt.
    algo: Algorithm,
    /// Number of pollable sources.
    num_sources: usize,
    /// Scratch, one flag per source: the source is in the current `update`'s event
    /// list (cleared before `update` returns).
    had_event: Vec<bool>,
    /// Current window, as returned by [`PollPolicy::poll_ns`].
    window_ns: u64,
    /// How late a timed nap ends on this host and what it costs (measured by the
    /// IOThread; used by adaptive naps).
    nap: NapTiming,
    /// Adaptive, rule 6: trials of sleeping until each event, and their
    /// verdict (kept here, not in the algorithm's state: they override its
    /// window).
    trials: Trials,
}

impl PollPolicy {
    /// A policy for an IOThread with `num_sources` pollable sources, with the default
    /// [`AdaptiveParams`].
    pub fn new(mode: PollMode, params: PollParams, num_sources: usize) -> Self {
        let mut policy = PollPolicy {
            params,
            adaptive: AdaptiveParams::default(),
            algo: Algorithm::new(mode, num_sources),
            num_sources,
            had_event: vec![false; num_sources],
            window_ns: 0,
            nap: NapTiming::default(),
            trials: Trials::default(),
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
        self.algo.mode()
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
        self.num_sources
    }

    /// Changes the knobs at run time and forgets all learnt state, as QEMU's
    /// `aio_context_set_poll_params` does (every window back to 0).
    pub fn set_params(&mut self, params: PollParams) {
        *self = PollPolicy::new(self.mode(), params, self.num_sources)
            .with_adaptive_params(self.adaptive);
    }

    /// Sets the number of pollable sources (queues attached or detached; the sources
    /// are each virtqueue plus the io_uring CQ). Removed sources lose their state;
    /// sources added later start fresh. The window is recomputed (a removed source may
    /// have held the maximum).
    pub fn set_num_sources(&mut self, n: usize) {
        self.num_sources = n;
        self.had_event.resize(n, false);
        match &mut self.algo {
            Algorithm::Off | Algorithm::Busy => {}
            Algorithm::Classic(c) => c.resize(n),
            Algorithm::Weighted(w) => w.resize(n),
            Algorithm::Adaptive(a) => a.resize(n),
        }
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
    /// due, means no nap. A source whose gaps scatter too widely for the spin
    /// after the nap is not planned for, except the device's completions
    /// ([`DEVICE_SOURCE`]) where a longer spin costs at most three quarters of
    /// their gap (`nap.rs`); and after a pass that answered a guest, such a
    /// queue means no nap (its driver's next requests may come within
    /// microseconds, rule 3). A nap of `n` ns lasts about `n + late` and costs
    /// the thread [`Self::nap_cpu_ns`] of CPU, where spinning would cost
    /// `n + late`: it is taken only if that saves at least
    /// [`MIN_NAP_SAVING_NS`] and a quarter of its length. Unlike the window,
    /// a nap may reach past `poll-max-ns` (it burns no CPU); the spin after
    /// it is bounded by [`Self::nap_spin_ns`]. Every other mode never naps,
    /// nor does `poll-max-ns=0`.
    pub fn nap_at(&self, now_ns: u64) -> u64 {
        let Some(a) = self.napping() else {
            return 0;
        };
        let (wakeup, max) = (self.wakeup_ns(), self.spin_max_ns());
        nap::nap_at(
            a.rhythms(),
            &self.nap,
            wakeup,
            max,
            now_ns,
            a.after_answer(),
        )
    }

    /// The adaptive algorithm's state, if this policy naps: adaptive, with
    /// `poll-max-ns` not 0, and not sleeping until each event (rule 6).
    fn napping(&self) -> Option<&Adaptive> {
        match &self.algo {
            Algorithm::Adaptive(a) if self.params.poll_max_ns != 0 && !self.trials.sleeping() => {
                Some(a)
            }
            _ => None,
        }
    }

    /// After a nap, how long to spin for the event that the nap expected, in ns:
    /// the timer's lateness and the gaps' spread are already spent, so what is
    /// left is the slack of the prediction, bounded by `poll-max-ns` except for
    /// the device's completions (see [`Self::nap_at`]).
    pub fn nap_spin_ns(&self) -> u64 {
        let (wakeup, max) = (self.wakeup_ns(), self.spin_max_ns());
        match &self.algo {
            Algorithm::Adaptive(a) => nap::spin_ns(a.rhythms(), &self.nap, wakeup, max),
            // No rhythm is learnt: no spread.
            _ => nap::spin_ns([], &self.nap, wakeup, max),
        }
    }

    /// Adaptive naps: the sources in `events` had an event at `now_ns` (any
    /// monotonic clock, > 0): their gap since the previous one feeds a
    /// mean/deviation estimator (gains 1/8 and 1/4, as TCP's RTT), unless it is
    /// longer than [`NAP_HORIZON_NS`] (an idle period). Duplicates and unknown
    /// indexes are ignored; other modes ignore the call.
    pub fn observe_events_at(&mut self, now_ns: u64, events: &[usize]) {
        // Only adaptive naps use the rhythm: no work on other modes' passes.
        if let Algorithm::Adaptive(a) = &mut self.algo {
            a.observe_events_at(now_ns, events);
        }
    }

    /// Adaptive, rule 6: called once per pass with the pass's clock (any
    /// monotonic clock, > 0) and the requests the pass before finished (as
    /// handed to [`Self::observe_finished`]). Now and then
    /// a trial compares the requests finished a second while waiting as the
    /// algorithm says and while sleeping until each event (as `--poll off`),
    /// in alternating windows; where sleeping is as fast, within
    /// `latency_budget_pct` and the trial's noise, the thread sleeps so until
    /// the next trial (see `trial.rs`). `limited`: a queue of the thread is
    /// held back by its I/O limits (no trial then, and no verdict to sleep).
    /// Returns the verdict of a trial that ended with this
    /// pass (true: sleep), if it saw enough requests to give one. Other
    /// modes ignore the call, as does `poll-max-ns=0`.
    pub fn observe_pass(&mut self, now_ns: u64, finished: usize, limited: bool) -> Option<bool> {
        if self.params.poll_max_ns == 0 || !matches!(self.algo, Algorithm::Adaptive(_)) {
            return None;
        }
        let (changed, verdict) = self.trials.observe(
            now_ns,
            finished as u64,
            self.adaptive.latency_budget_pct,
            limited,
        );
        if changed {
            self.refresh_window();
        }
        verdict
    }

    /// Adaptive, rule 6: whether the thread sleeps until each event now (a
    /// trial's sleeping window, or its verdict); false in other modes. The
    /// thread reads it as a window of 0 and no nap.
    #[cfg(test)]
    fn sleeping(&self) -> bool {
        matches!(self.algo, Algorithm::Adaptive(_)) && self.trials.sleeping()
    }

    /// Called at the end of each pass with the sources (indexes) whose guests
    /// it handed completions to, none if it answered no one. Adaptive: each
    /// is expected to answer with its next requests, so it counts as active
    /// however long it was quiet (rule 2), and a wait after an answer learns
    /// its hit rate apart from other waits (rule 3; see `adaptive.rs`).
    /// Unknown indexes are ignored; other modes ignore the call.
    pub fn observe_answered(&mut self, sources: impl IntoIterator<Item = usize>) {
        if let Algorithm::Adaptive(a) = &mut self.algo {
            if a.observe_answered(sources, self.params.poll_max_ns) {
                self.refresh_window();
            }
        }
    }

    /// How late a timed nap may end, in ns: the measured mean + 2 deviations of
    /// [`Self::observe_nap`] samples, or `wakeup_ns` until one was measured.
    pub fn nap_late_ns(&self) -> u64 {
        self.nap.late_ns(self.adaptive.wakeup_ns)
    }

    /// The price of a sleep that the adaptive algorithm weighs, in ns: how late a
    /// timed nap ends on this host once measured ([`Self::set_nap_late`],
    /// [`Self::observe_nap`]), else the configured `wakeup_ns`. Coming out of a
    /// sleep costs what it costs on this host: a few microseconds on bare metal,
    /// 8-16 us on a VM whose idle vCPU exits to the hypervisor, over 60 us when
    /// that hypervisor is loaded. A fixed figure had the policy sleep through
    /// intervals that a sleep made four times longer.
    pub fn wakeup_ns(&self) -> u64 {
        self.adaptive_knobs().1.wakeup_ns
    }

    /// The longest the adaptive algorithm spins, in ns: `poll-max-ns`, or, at its
    /// default ([`DEFAULT_POLL_MAX_NS`]), two wake-ups ([`Self::wakeup_ns`]) if
    /// that is longer. QEMU's default bound suits a host where a wake-up costs
    /// less than it; where one costs more, a spin bounded below a wake-up can
    /// neither follow a nap (whose timer ends that late) nor wait for an event
    /// that a sleep would deliver no sooner. An operator's own `poll-max-ns` is
    /// kept as given.
    pub fn spin_max_ns(&self) -> u64 {
        self.adaptive_knobs().0.poll_max_ns
    }

    /// The knobs the adaptive algorithm runs with ([`adaptive_knobs`]).
    fn adaptive_knobs(&self) -> (PollParams, AdaptiveParams) {
        adaptive_knobs(&self.params, &self.adaptive, &self.nap)
    }

    /// Thread CPU time that one nap costs, in ns (measured or [`DEFAULT_NAP_CPU_NS`]).
    pub fn nap_cpu_ns(&self) -> u64 {
        self.nap.cpu_ns()
    }

    /// A timed nap of `requested_ns` that ended by its timer after `elapsed_ns`: the
    /// overshoot feeds the mean/deviation estimator (gains 1/8 and 1/4, samples
    /// capped at 1 ms and at 4x the current mean; the first sample sets the mean,
    /// with half of it as deviation).
    pub fn observe_nap(&mut self, requested_ns: u64, elapsed_ns: u64) {
        self.nap.observe(requested_ns, elapsed_ns);
    }

    /// Called before a sleep without a timer (until an event): the length of a
    /// timed nap to take first, or 0. The lateness of naps is learnt from the
    /// naps that end by their timer, and a thread whose calibration came out
    /// high (measured while the host was busy: a daemon started beside
    /// others) does not nap at all, so nothing would ever correct it: it
    /// would keep sleeping through gaps that a nap and a spin would serve.
    /// So, adaptive only, once [`NAP_SAMPLE_EVERY`] such sleeps passed
    /// without a nap ended by its timer ([`Self::observe_nap`]), each one
    /// starts with a nap of [`NAP_SAMPLE_NS`] until one ends by its timer.
    /// An event that ends it first is served as the sleep would have served
    /// it; one that ends by its timer costs a wake-up, at most once in
    /// [`NAP_SAMPLE_EVERY`] sleeps.
    pub fn sample_nap(&mut self) -> u64 {
        if self.napping().is_none() {
            return 0;
        }
        if self.nap.sleep_unsampled() >= NAP_SAMPLE_EVERY {
            NAP_SAMPLE_NS
        } else {
            0
        }
    }

    /// Called at `now_ns` before a spin that no nap precedes: the length of
    /// a timed nap to take first, or 0. [`Self::sample_nap`] serves a thread
    /// that sleeps; a thread whose calibration came out high may never
    /// sleep either: its spin, two of those wake-ups long at the default
    /// `poll-max-ns`, outlasts every gap of its queues, and it spins a whole
    /// core for requests that a nap would wait for as well. So, adaptive
    /// only, once it has spun [`NAP_SAMPLE_SPIN_NS`] without a nap ended by
    /// its timer, its next spin starts with a nap of [`NAP_SAMPLE_NS`], and
    /// so does the spin after a measured nap that came out below half the
    /// estimate (the estimate is falling: one nap moves it by an eighth).
    /// Not after a pass that answered a guest: its next requests may come
    /// within microseconds and end the nap before its timer (measured: at
    /// QD1 on a 50 us device, 45 such samples in 4 s, none ended by its
    /// timer); the wait after a pass that submitted them is the device's.
    /// An event that ends the nap first is served as the spin would have
    /// served it (a little later). Where the estimate is right, one such
    /// nap in each [`NAP_SAMPLE_SPIN_NS`].
    pub fn sample_nap_in_spin(&mut self, now_ns: u64) -> u64 {
        if self.napping().is_none_or(Adaptive::after_answer) {
            return 0;
        }
        if self.nap.spin_unsampled(now_ns) {
            NAP_SAMPLE_NS
        } else {
            0
        }
    }

    /// Sets the nap lateness from a calibration: its typical value and spread
    /// (e.g. the median, and the 90th percentile minus the median), as the
    /// estimator's mean and deviation; later [`Self::observe_nap`] samples refine it.
    pub fn set_nap_late(&mut self, typical_ns: u64, spread_ns: u64) {
        self.nap.set_late(typical_ns, spread_ns);
    }

    /// Sets the measured thread CPU time of one nap.
    pub fn set_nap_cpu_ns(&mut self, cpu_ns: u64) {
        self.nap.set_cpu_ns(cpu_ns);
    }

    /// The window that `source` alone asks for (classic: its own window; weighted:
    /// its interval average; adaptive: its cover, ignoring gate and back-off), or
    /// `None` if there is no such source.
    pub fn source_poll_ns(&self, source: usize) -> Option<u64> {
        if source >= self.num_sources {
            return None;
        }
        match &self.algo {
            Algorithm::Off => Some(0),
            Algorithm::Busy => Some(u64::MAX),
            Algorithm::Classic(c) => c.source_ns(source),
            Algorithm::Weighted(w) => w.source_ns(source),
            Algorithm::Adaptive(a) => {
                let (params, knobs) = self.adaptive_knobs();
                a.source_ns(source, &knobs, params.poll_max_ns)
            }
        }
    }

    /// Called once per event-loop iteration before it waits: the backend holds
    /// `n` requests (submitted, not yet completed). The adaptive algorithm weighs
    /// a wake-up against a request's round trip, `n` event intervals deep (see
    /// `adaptive.rs`, rules 3a and 3b); other modes ignore it.
    pub fn observe_in_flight(&mut self, n: usize) {
        if let Algorithm::Adaptive(a) = &mut self.algo {
            a.observe_in_flight(n as u64);
        }
    }

    /// Called once per event-loop iteration before it waits: the last pass
    /// finished `n` requests. With [`Self::observe_in_flight`] it gives a
    /// request's round trip in event intervals (adaptive; other modes ignore it).
    pub fn observe_finished(&mut self, n: usize) {
        if let Algorithm::Adaptive(a) = &mut self.algo {
            a.observe_finished(n as u64);
        }
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
        // QEMU does not even measure block_ns when polling is disabled.
        if self.params.poll_max_ns != 0 {
            for &i in events {
                if let Some(e) = self.had_event.get_mut(i) {
                    *e = true;
                }
            }
            let params = &self.params;
            match &mut self.algo {
                Algorithm::Off | Algorithm::Busy => {}
                Algorithm::Classic(c) => c.update(block_ns, &self.had_event, params),
                Algorithm::Weighted(w) => w.update(block_ns, &self.had_event, params),
                Algorithm::Adaptive(a) => {
                    let (params, knobs) = adaptive_knobs(params, &self.adaptive, &self.nap);
                    a.update(
                        block_ns,
                        &self.had_event,
                        polled_hit,
                        self.window_ns,
                        &params,
                        &knobs,
                    )
                }
            }
            self.had_event.fill(false);
        }
        self.refresh_window();
    }

    /// Recomputes `window_ns` (and the adaptive target) from the current state.
    fn refresh_window(&mut self) {
        self.window_ns = match &mut self.algo {
            Algorithm::Off => 0,
            Algorithm::Busy => u64::MAX,
            _ if self.params.poll_max_ns == 0 => 0,
            Algorithm::Classic(c) => c.window(),
            Algorithm::Weighted(w) => w.window(),
            Algorithm::Adaptive(a) => {
                let (params, knobs) = adaptive_knobs(&self.params, &self.adaptive, &self.nap);
                let window = a.refresh(&params, &knobs);
                // Rule 6: a trial's sleeping window, or its verdict, does
                // not spin.
                if self.trials.sleeping() {
                    0
                } else {
                    window
                }
            }
        };
    }

    /// Adaptive: the full target window (before gate and back-off); 0 in other modes.
    #[cfg(test)]
    fn target_ns(&self) -> u64 {
        match &self.algo {
            Algorithm::Adaptive(a) => a.target_ns(),
            _ => 0,
        }
    }
}

/// The knobs the adaptive algorithm runs with: the configured ones, with the
/// wake-up as measured ([`PollPolicy::wakeup_ns`]) and the window bounded by
/// [`PollPolicy::spin_max_ns`]. A function of the fields it reads, so that the
/// algorithm's state can be borrowed beside them.
fn adaptive_knobs(
    params: &PollParams,
    adaptive: &AdaptiveParams,
    nap: &NapTiming,
) -> (PollParams, AdaptiveParams) {
    let wakeup_ns = nap.measured_late_ns().unwrap_or(adaptive.wakeup_ns);
    let max = params.poll_max_ns;
    let poll_max_ns = if max == DEFAULT_POLL_MAX_NS {
        max.max(wakeup_ns.saturating_mul(2))
    } else {
        max
    };
    (
        PollParams {
            poll_max_ns,
            ..*params
        },
        AdaptiveParams {
            wakeup_ns,
            ..*adaptive
        },
    )
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

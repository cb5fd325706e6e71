//! QEMU's two window algorithms: classic grow/shrink and the weighted average.
//!
//! # Classic (QEMU `adjust_polling_time`, util/aio-posix.c)
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
//! the first version of the series; the first sample is taken as is). An average
//! that reaches `poll-max-ns` is reset to 0. A source without an event but with a
//! non-zero average *ages*: the iteration's `block_ns` is added to it, and it drops
//! to 0 once it reaches `poll-max-ns`, so a source that went quiet stops holding the
//! window up. If any source had an event, let `adj` be the largest average among
//! them; the single window of the IOThread (per context again, as in the patch) then
//! grows to `min(max, max(adj, window * grow))` when `adj` exceeds it, and otherwise
//! is divided by `shrink` when `adj < window / shrink`. In this algorithm both
//! `poll-grow = 0` and `poll-shrink = 0` mean 2: the shrink is always gradual, never
//! a reset to 0 (the patch's `shrink_polling_time` uses 2 for 0, "matching the grow
//! rate, to reduce frequent poll_ns resets for slow devices"). Growth from 0 jumps
//! straight to `adj`; the 4 us first step is a classic-only rule.

use super::{PollParams, POLL_IDLE_INTERVAL_NS, POLL_NS_INITIAL};

/// One source of the classic algorithm.
#[derive(Debug, Clone, Copy, Default)]
struct ClassicSource {
    /// The source's own window.
    window_ns: u64,
    /// Sum of the `block_ns` reported since the source's last event.
    idle_ns: u64,
}

/// State of [`super::PollMode::Classic`]: one window per source.
#[derive(Debug, Clone, Default)]
pub(super) struct Classic {
    /// Per-source windows.
    sources: Vec<ClassicSource>,
}

impl Classic {
    /// A fresh state for `n` sources (every window 0).
    pub(super) fn new(n: usize) -> Self {
        Classic {
            sources: vec![ClassicSource::default(); n],
        }
    }

    /// Sets the number of sources; removed ones are forgotten, added ones are fresh.
    pub(super) fn resize(&mut self, n: usize) {
        self.sources.resize(n, ClassicSource::default());
    }

    /// The window of source `i` (`None` if there is no such source).
    pub(super) fn source_ns(&self, i: usize) -> Option<u64> {
        self.sources.get(i).map(|s| s.window_ns)
    }

    /// One iteration: `had_event[i]` says whether source `i` had work.
    pub(super) fn update(&mut self, block_ns: u64, had_event: &[bool], params: &PollParams) {
        for (s, &event) in self.sources.iter_mut().zip(had_event) {
            if event {
                s.idle_ns = 0;
                s.window_ns = classic_adjust(s.window_ns, block_ns, params);
            } else {
                s.idle_ns = s.idle_ns.saturating_add(block_ns);
            }
        }
    }

    /// The IOThread's window: the largest among the sources active in the last 7 s.
    pub(super) fn window(&self) -> u64 {
        self.sources
            .iter()
            .filter(|s| s.idle_ns < POLL_IDLE_INTERVAL_NS)
            .map(|s| s.window_ns)
            .max()
            .unwrap_or(0)
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

/// State of [`super::PollMode::Weighted`]: an interval average per source and one
/// window for the IOThread.
#[derive(Debug, Clone, Default)]
pub(super) struct Weighted {
    /// Per source: EWMA of the `block_ns` of its iterations with an event (0: none,
    /// or reset).
    averages: Vec<u64>,
    /// The IOThread's window (one per context, as in the patch).
    window_ns: u64,
}

impl Weighted {
    /// A fresh state for `n` sources (window 0).
    pub(super) fn new(n: usize) -> Self {
        Weighted {
            averages: vec![0; n],
            window_ns: 0,
        }
    }

    /// Sets the number of sources; removed ones are forgotten, added ones are fresh.
    /// The IOThread's window is kept.
    pub(super) fn resize(&mut self, n: usize) {
        self.averages.resize(n, 0);
    }

    /// The interval average of source `i` (`None` if there is no such source).
    pub(super) fn source_ns(&self, i: usize) -> Option<u64> {
        self.averages.get(i).copied()
    }

    /// One iteration: `had_event[i]` says whether source `i` had work.
    pub(super) fn update(&mut self, block_ns: u64, had_event: &[bool], params: &PollParams) {
        let max = params.poll_max_ns;
        let w = params.weight_shift();
        let mut adj: Option<u64> = None;
        for (avg, &event) in self.averages.iter_mut().zip(had_event) {
            if event {
                *avg = if *avg == 0 {
                    block_ns
                } else {
                    (*avg - (*avg >> w)).saturating_add(block_ns >> w)
                };
                if *avg >= max {
                    *avg = 0;
                }
                adj = Some(adj.map_or(*avg, |a| a.max(*avg)));
            } else if *avg > 0 {
                // Ageing: a quiet source stops holding the window up.
                *avg = avg.saturating_add(block_ns);
                if *avg >= max {
                    *avg = 0;
                }
            }
        }
        if let Some(adj) = adj {
            let grow = params.grow();
            let shrink = if params.poll_shrink == 0 {
                2
            } else {
                params.poll_shrink
            };
            if adj > self.window_ns {
                self.window_ns = adj.max(self.window_ns.saturating_mul(grow)).min(max);
            } else if adj < self.window_ns / shrink {
                self.window_ns /= shrink;
            }
        }
    }

    /// The IOThread's window.
    pub(super) fn window(&self) -> u64 {
        self.window_ns
    }
}

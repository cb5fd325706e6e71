//! Trace-driven simulation of the polling policies, and the reference traces they
//! are compared on.
//!
//! [`simulate`] feeds a policy one event per iteration on source 0 ([`simulate_events`]:
//! on any source, with the requests in flight at each wait). With window `W`
//! and the event arriving `t` ns after the wait starts: if `t <= W` it is a polling
//! hit (`t` of polling CPU, `block_ns = t`); otherwise the loop polls `W` in vain,
//! sleeps, and finds the event [`WAKEUP_LATENCY_NS`] late (`block_ns = t + 15 us`).
//!
//! [`traces`] are the steady, jittery, heavy-tailed, bimodal, mid-range, slow and
//! phased traces on which the unit tests hold the adaptive mode to its goals
//! ([`Expect`]); [`compare`] runs every mode on one of them next to the [`oracle`].
//! `cargo run --release -p vqblk-daemon --example poll_sim` prints the table.

use super::{
    AdaptiveParams, PollMode, PollParams, PollPolicy, DEFAULT_POLL_MAX_NS, WAKEUP_LATENCY_NS,
};

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

impl SimResult {
    /// Estimated IOPS loss against busy polling for a closed loop (queue depth 1),
    /// in percent: the added latency over the total time of `trace`.
    pub fn iops_loss_pct(&self, trace: &[u64]) -> f64 {
        let total: u64 = trace.iter().sum();
        100.0 * self.added_latency_ns as f64 / (total + self.added_latency_ns) as f64
    }

    /// Percentage of the `events` caught while polling.
    pub fn hit_pct(&self, events: usize) -> f64 {
        100.0 * self.hits as f64 / events as f64
    }
}

/// One event of a simulated trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimEvent {
    /// Time from the start of the wait until the event.
    pub interval_ns: u64,
    /// The source that has it.
    pub source: usize,
    /// Requests the backend holds while the thread waits for it
    /// ([`PollPolicy::observe_in_flight`]).
    pub in_flight: usize,
    /// Requests the pass handling the event finishes
    /// ([`PollPolicy::observe_finished`]).
    pub finished: usize,
    /// The source whose guest that pass hands completions to
    /// ([`PollPolicy::observe_answered`]), if any.
    pub answered: Option<usize>,
}

/// Replays a trace through `policy`: each entry is the time from the start of a wait
/// until the next event (on source 0, nothing in flight). If it fits in the current
/// window it is a polling hit costing that much CPU; otherwise the whole window is
/// polled in vain and the event is found [`WAKEUP_LATENCY_NS`] late, after a sleep.
/// A policy without sources is given one.
pub fn simulate(policy: &mut PollPolicy, intervals_ns: &[u64]) -> SimResult {
    if policy.num_sources() == 0 {
        policy.set_num_sources(1);
    }
    simulate_events(
        policy,
        intervals_ns.iter().map(|&t| SimEvent {
            interval_ns: t,
            source: 0,
            in_flight: 0,
            finished: 0,
            answered: None,
        }),
    )
}

/// [`simulate`] for events on any of the policy's sources, each wait started
/// with the event's `in_flight` handed to the policy, as the event loop does.
pub fn simulate_events(
    policy: &mut PollPolicy,
    events: impl IntoIterator<Item = SimEvent>,
) -> SimResult {
    let mut r = SimResult::default();
    for e in events {
        policy.observe_in_flight(e.in_flight);
        let (t, w) = (e.interval_ns, policy.poll_ns());
        if t <= w {
            r.hits += 1;
            r.poll_cpu_ns = r.poll_cpu_ns.saturating_add(t);
            policy.update(t, &[e.source], true);
        } else {
            r.sleeps += 1;
            r.poll_cpu_ns = r.poll_cpu_ns.saturating_add(w);
            r.wasted_cpu_ns = r.wasted_cpu_ns.saturating_add(w);
            r.added_latency_ns = r.added_latency_ns.saturating_add(WAKEUP_LATENCY_NS);
            policy.update(t.saturating_add(WAKEUP_LATENCY_NS), &[e.source], false);
        }
        policy.observe_answered(e.answered);
        policy.observe_finished(e.finished);
    }
    r
}

/// The best any window capped at `max` can do: poll exactly until the event if it
/// is pollable, sleep at once otherwise.
pub fn oracle(trace: &[u64], max: u64) -> SimResult {
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

/// What the adaptive policy must achieve on a trace, besides staying within 1
/// point of the IOPS that any window capped at `poll-max-ns` can reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Every interval is pollable: at least 99% of busy polling's hits.
    BusyHits,
    /// Some intervals are not pollable: no more CPU wasted than weighted.
    LessWaste,
    /// Sleeping costs more than the IOPS budget: more IOPS than weighted.
    MoreIops,
}

/// A reference trace of event intervals.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Short description of the intervals.
    pub name: &'static str,
    /// Time from the start of each wait until its event, in ns.
    pub intervals: Vec<u64>,
    /// The adaptive policy's goal on this trace.
    pub expect: Expect,
}

/// The reference traces (20 000 events each, but 5 000 for the slow one), from a
/// fixed seed: the same on every run.
pub fn traces() -> Vec<Trace> {
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

/// Every mode simulated on one trace with the default knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Comparison {
    /// [`PollMode::Busy`].
    pub busy: SimResult,
    /// [`PollMode::Classic`].
    pub classic: SimResult,
    /// [`PollMode::Weighted`].
    pub weighted: SimResult,
    /// [`PollMode::Adaptive`].
    pub adaptive: SimResult,
    /// [`PollMode::Adaptive`] without its IOPS budget (`latency_budget_pct = 100`:
    /// the pure ski-rental gate).
    pub cpu_first: SimResult,
    /// The best any window capped at [`DEFAULT_POLL_MAX_NS`] can do ([`oracle`]).
    pub oracle: SimResult,
}

impl Comparison {
    /// The results with their row labels, in table order.
    pub fn rows(&self) -> [(&'static str, SimResult); 6] {
        [
            ("busy", self.busy),
            ("classic", self.classic),
            ("weighted", self.weighted),
            ("adaptive", self.adaptive),
            ("adapt-b∞", self.cpu_first),
            ("(oracle)", self.oracle),
        ]
    }
}

/// Simulates every mode (default [`PollParams`], one source) on `intervals`.
pub fn compare(intervals: &[u64]) -> Comparison {
    let run = |mode: PollMode, adaptive: AdaptiveParams| {
        let mut p = PollPolicy::new(mode, PollParams::default(), 1).with_adaptive_params(adaptive);
        simulate(&mut p, intervals)
    };
    let cpu_first = AdaptiveParams {
        latency_budget_pct: 100,
        ..AdaptiveParams::default()
    };
    Comparison {
        busy: run(PollMode::Busy, AdaptiveParams::default()),
        classic: run(PollMode::Classic, AdaptiveParams::default()),
        weighted: run(PollMode::Weighted, AdaptiveParams::default()),
        adaptive: run(PollMode::Adaptive, AdaptiveParams::default()),
        cpu_first: run(PollMode::Adaptive, cpu_first),
        oracle: oracle(intervals, DEFAULT_POLL_MAX_NS),
    }
}

/// Deterministic xorshift64* generator for traces.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// The next pseudo-random number.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// True with a probability of `pct` percent.
    pub(crate) fn chance(&mut self, pct: u64) -> bool {
        self.next() % 100 < pct
    }
}

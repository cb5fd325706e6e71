//! Reservations and weights between the exports of one backing device,
//! enforced without a lock on the data path: a pure **share allocator** turns
//! what each export did in the last interval into an IOPS cap per export, and
//! each cap is one more lock-free bucket ([`ShareCap`]) that a queue asks
//! together with the export's limits ([`Gate`]).
//!
//! # Why caps, not a central mClock queue
//!
//! An export's queues live on several IOThreads, and the exports of one
//! device too. [`super::mclock`] decides which request goes next, so it
//! needs every request of the device in one place: a queue all IOThreads
//! push to and one dispatcher pops from, a lock (or a hand-off between
//! threads) per request. dmClock's distributed form avoids the central queue
//! but still needs a device-wide view of who was served, per request.
//!
//! The floors and the split only matter while the device is saturated, and
//! then what matters is the rate each export gets, not the order of two
//! requests. So the allocator works on rates, every [`TICK_NS`] (PARDA, FAST
//! 2009, controls hosts sharing an array the same way: from outside the
//! request path, by their rates): it estimates the device's capacity `C`,
//! gives each export its reservation, splits `C` minus the reservations by
//! weight, and writes each export's share as a cap. The data path only meets
//! a rate limit, the same kind of atomic "next free time" cell as a throttle
//! group's ([`super::group`]): no lock, no cross-thread hand-off, and a queue
//! held back by its cap sleeps on its IOThread's timer like a throttled one.
//! A cap restrains; it never gives a request priority. The device serves what
//! the caps let through, so keeping a floor means capping the neighbours
//! enough that the reserved export's requests find the device free.
//!
//! # The allocator ([`ShareAllocator::tick`])
//!
//! Input per export and interval: reservation, weight, static IOPS limit,
//! operations completed (a rate), whether it was **busy** (at least half a
//! request in flight on average, or held back) and whether its cap **held**
//! it back.
//!
//! 1. **Demand.** A busy export wants more than it got (unbounded, up to its
//!    static limit). An export that was not busy, or that is known to want
//!    no more (step 3), wants what it did plus [`HEADROOM`]: it gives the
//!    rest of its share back.
//! 2. **Capacity.** The first interval in which the device completes
//!    anything gives the first estimate of `C`: what it completed. Then,
//!    additive increase and cut (AIMD): when caps bind (some export held by
//!    its cap) and the device keeps up (it completed at least 90% of `C`),
//!    `C` grows by [`GROWTH`] (one step more each tick in a row, up to
//!    [`MAX_STREAK`] steps); when an export that its cap did not hold gets
//!    less than 90% of its cap, or a reserved one less than 98% of its
//!    reservation, the device may be the bottleneck, and `C` is cut to what
//!    the device completed. With every other export at most at its cap, an
//!    export short of its cap by `s` means the device did at least `s` less
//!    than `C`, so caps computed from what it did give the short export its
//!    share and a reserved one its reservation (its neighbours pay). For
//!    [`PROBE_TICKS`] after a cut, `C` does not grow past what the device did
//!    then; after that it probes again.
//! 3. **Exports that want no more.** An export can get less than its cap
//!    because it asks for less (a light guest) or because of itself (a guest
//!    at queue depth 1 behind the device's latency). Cutting `C` then only
//!    takes from its neighbours. So a cut is a probe: if an export that was
//!    short, and that its new cap did not hold, kept its pace (within 5%
//!    either way) in the next interval, it is marked self-limited (its
//!    demand becomes what it does plus headroom) and the cut is undone. One
//!    that slowed down slowed with the device (a host's speed changes from
//!    one tick to the next) or to a new cap below what it did: no mark. The
//!    mark is dropped when its cap holds it back or a later cut speeds it up
//!    (it wants more than it was given). Whether the device keeps up (step
//!    2) is judged against the estimate less the headroom the self-limited
//!    exports leave unused, so that headroom goes to the others: the split
//!    stays work-conserving.
//! 4. **Split** (water-filling): each export gets its reservation (its
//!    demand, if less); what `C` leaves is split by weight among the exports
//!    that want more, and the share an export does not want goes to the
//!    others. Its cap is its allocation, never below its reservation or
//!    [`MIN_CAP_IOPS`]. Until `C` is known, nothing is capped.
//!
//! When the reservations do not fit `C`, the reserved exports are capped at
//! their reservations and the others at [`MIN_CAP_IOPS`]: the device decides
//! between the reserved exports (a floor is promised only while the floors
//! fit).
//!
//! # Reaction time and limits
//!
//! A change of load is seen at the next tick and acted on at once (an idle
//! export that starts to flood is held by a cap near what it did, becomes
//! busy, and gets its full share one tick later); a change of the device's
//! capacity takes a cut (one tick) downwards and, upwards, the probe delay
//! after the last cut ([`PROBE_TICKS`]) and then about `sqrt(100 ln(x))`
//! ticks to grow by a factor `x` (a factor 2.5 in about a second). Between ticks the caps are fixed:
//! a floor holds on average over a few ticks, not per request. Counts are
//! operations, whatever their size (`iops-size` is not applied).
//!
//! Everything here is pure (no clock, no thread); the process layer
//! (`daemon/shares.rs`) samples the counters, calls [`ShareAllocator::tick`]
//! and writes the caps.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::throttle::{
    batch_over, batch_until, wait_until, Admission, CreditCell, Direction, BATCH_REQUESTS,
    TICKS_PER_NS,
};
use super::SharedThrottle;

/// The allocator's interval.
pub const TICK_NS: u64 = 100_000_000;
/// The smallest cap written: an export is never stopped outright.
pub const MIN_CAP_IOPS: f64 = 10.0;
/// Growth of the capacity estimate per tick while the caps bind (the first
/// tick; it grows by one more step each tick in a row, up to [`MAX_STREAK`]
/// steps).
pub const GROWTH: f64 = 1.02;
/// Most steps of [`GROWTH`] in one tick.
pub const MAX_STREAK: u32 = 5;
/// Ticks after a cut during which the estimate stays at most at what the
/// device did when it failed (then it probes again).
pub const PROBE_TICKS: u32 = 10;
/// An export that did not use its whole share is allowed this much more than
/// it did before it counts as wanting more.
pub const HEADROOM: f64 = 1.2;
/// An export below this fraction of its cap, not held by it, may wait on
/// the device.
const SHORT: f64 = 0.9;
/// A reserved export below this fraction of its reservation, not held, may
/// wait on the device.
const FLOOR: f64 = 0.98;
/// A short export whose pace changed by less than this factor either way
/// after a cut is self-limited.
const SPED_UP: f64 = 1.05;
/// How far ahead of now a cap's cell may be and still admit: bursts of a few
/// milliseconds pass, which a device absorbs.
const CAP_BURST_NS: u64 = 5_000_000;

/// An export's share settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share {
    /// Operations per second it gets while it asks for them (0: none).
    pub reservation: f64,
    /// Its share of what the reservations leave (at least 1).
    pub weight: u32,
    /// Its static IOPS limit (0: none): it never wants more.
    pub limit: f64,
}

impl Default for Share {
    fn default() -> Self {
        Share {
            reservation: 0.0,
            weight: 1,
            limit: 0.0,
        }
    }
}

/// What an export did in the last interval.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Interval {
    /// Operations completed, per second.
    pub done: f64,
    /// Requests in flight most of the interval, or held back: it asked for more.
    pub busy: bool,
    /// Its share cap held a request back.
    pub held: bool,
}

/// One export's input to a tick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShareInput {
    /// Identifies the export across ticks (exports join and leave).
    pub id: u64,
    /// Its settings.
    pub share: Share,
    /// What it did.
    pub seen: Interval,
}

/// What the allocator remembers of an export.
#[derive(Debug, Clone, Copy)]
struct ExportState {
    id: u64,
    /// The cap written last tick.
    cap: Option<f64>,
    /// Marked self-limited at this rate.
    limited_at: Option<f64>,
    /// Its rate when the last cut was made for it.
    done_at_cut: Option<f64>,
}

/// The share allocator of one backing device: state in, caps out.
#[derive(Debug, Default)]
pub struct ShareAllocator {
    capacity: Option<f64>,
    /// The estimate before the last tick's cut (None: that tick cut nothing).
    cut_from: Option<f64>,
    /// The estimate at the last cut: the device could not do it.
    ceiling: Option<f64>,
    /// Ticks since the last cut.
    since_cut: u32,
    /// Ticks the estimate has grown in a row.
    streak: u32,
    exports: Vec<ExportState>,
}

impl ShareAllocator {
    /// No estimate, no caps.
    pub fn new() -> Self {
        Self::default()
    }

    /// The device's capacity estimate, operations per second (None: the
    /// device has not done anything yet).
    pub fn capacity(&self) -> Option<f64> {
        self.capacity
    }

    /// One interval: what the exports on the device did (in any order, the
    /// same `id` for the same export across ticks) in, each one's cap (None:
    /// uncapped) out, in the order of `inputs`.
    pub fn tick(&mut self, inputs: &[ShareInput]) -> Vec<Option<f64>> {
        // Exports join and leave: keep the state of those still here.
        let mut states: Vec<ExportState> = inputs
            .iter()
            .map(|i| {
                self.exports
                    .iter()
                    .find(|s| s.id == i.id)
                    .copied()
                    .unwrap_or(ExportState {
                        id: i.id,
                        cap: None,
                        limited_at: None,
                        done_at_cut: None,
                    })
            })
            .collect();
        for (s, i) in states.iter_mut().zip(inputs) {
            let seen = i.seen;
            if s.limited_at.is_some() && seen.held {
                s.limited_at = None;
            }
        }
        let total: f64 = inputs.iter().map(|i| i.seen.done).sum();
        let cut_from = self.cut_from.take();
        self.capacity = match self.capacity {
            None => (total > 0.0).then_some(total),
            Some(c) => Some(self.adjust(c, total, cut_from, &mut states, inputs)),
        };
        let floor = MIN_CAP_IOPS * inputs.len() as f64;
        self.capacity = self.capacity.map(|c| c.max(floor));
        let caps = match self.capacity {
            None => vec![None; inputs.len()],
            Some(c) => split(c, inputs, &states)
                .into_iter()
                .zip(inputs)
                .map(|(a, i)| Some(a.max(i.share.reservation).max(MIN_CAP_IOPS)))
                .collect(),
        };
        for (s, cap) in states.iter_mut().zip(&caps) {
            s.cap = *cap;
        }
        self.exports = states;
        caps
    }

    /// The capacity estimate after an interval in which the device did
    /// `total` against the estimate `c` (steps 2 and 3 of the module's doc).
    fn adjust(
        &mut self,
        c: f64,
        total: f64,
        cut_from: Option<f64>,
        states: &mut [ExportState],
        inputs: &[ShareInput],
    ) -> f64 {
        self.since_cut = self.since_cut.saturating_add(1);
        if let Some(before) = cut_from {
            // The last tick cut for the exports that were short: one that
            // its new cap did not hold and that kept its pace waits on
            // itself, not on the device, and the cut is undone. One that
            // sped up wants more than it was marked at; one that slowed
            // down slowed with the device (a host's speed changes from one
            // tick to the next) or to a new cap below what it did. Neither
            // is marked.
            let mut stuck = false;
            for (s, i) in states.iter_mut().zip(inputs) {
                let Some(at) = s.done_at_cut.take() else {
                    continue;
                };
                let done = i.seen.done;
                let kept_pace = done <= SPED_UP * at && done * SPED_UP >= at;
                if !i.seen.held && kept_pace {
                    s.limited_at = Some(done);
                    stuck = true;
                } else {
                    s.limited_at = None;
                }
            }
            if stuck {
                for s in states.iter_mut() {
                    s.done_at_cut = None;
                }
                self.streak = 0;
                return before;
            }
        }
        let short: Vec<usize> = (0..inputs.len())
            .filter(|&k| {
                let (s, seen) = (&states[k], inputs[k].seen);
                let expected = s.limited_at.or(s.cap);
                let below_floor = seen.done < FLOOR * inputs[k].share.reservation;
                !seen.held && (below_floor || expected.is_some_and(|e| seen.done < SHORT * e))
            })
            .collect();
        if short.is_empty() {
            for s in states.iter_mut() {
                s.done_at_cut = None;
            }
            // What the device was offered: the estimate less the headroom
            // of the exports that wait on themselves.
            let offered = c - states
                .iter()
                .filter_map(|s| Some((s.cap? - s.limited_at?).max(0.0)))
                .sum::<f64>();
            if !inputs.iter().any(|i| i.seen.held) || total < SHORT * offered {
                self.streak = 0;
                return c;
            }
            // The caps bind and the device keeps up: probe upwards, faster
            // while it keeps up, but not back into the estimate the device
            // last failed at before PROBE_TICKS have passed.
            self.streak = (self.streak + 1).min(MAX_STREAK);
            let grown = c * (1.0 + (GROWTH - 1.0) * f64::from(self.streak));
            return match self.ceiling {
                Some(top) if self.since_cut < PROBE_TICKS && grown > top => {
                    self.streak = 0;
                    top.max(c)
                }
                _ => grown,
            };
        }
        self.streak = 0;
        for &k in &short {
            states[k].done_at_cut = Some(inputs[k].seen.done);
        }
        self.cut_from = Some(c);
        self.ceiling = Some(c.min(total));
        self.since_cut = 0;
        // With every other export at most at its cap, an export short of its
        // cap by `s` means the device did at least `s` less than `c`: caps
        // computed from what it did give the short export at least its
        // reservation (the neighbours pay for it).
        c.min(total)
    }
}

/// Water-filling of capacity `c` (step 4 of the module's doc): each export's
/// allocation, in the order of `inputs`.
fn split(c: f64, inputs: &[ShareInput], states: &[ExportState]) -> Vec<f64> {
    let demand: Vec<f64> = inputs
        .iter()
        .zip(states)
        .map(|(i, s)| {
            let d = if i.seen.busy && s.limited_at.is_none() {
                f64::INFINITY
            } else {
                (i.seen.done * HEADROOM).max(MIN_CAP_IOPS)
            };
            if i.share.limit > 0.0 {
                d.min(i.share.limit)
            } else {
                d
            }
        })
        .collect();
    let mut got: Vec<f64> = inputs
        .iter()
        .zip(&demand)
        .map(|(i, &d)| i.share.reservation.min(d))
        .collect();
    let rest = c - got.iter().sum::<f64>();
    let weights: Vec<f64> = inputs.iter().map(|i| i.share.weight as f64).collect();
    water_fill(rest, &weights, &demand, &mut got);
    got
}

/// Pours `rest` over the entries of `got` still below their `bound`, in
/// proportion to `weight`; an entry that reaches its bound gives what it
/// does not need back to the others (max-min fairness by weight). Also the
/// simulated device's split among its clients (`sim.rs`).
pub(crate) fn water_fill(mut rest: f64, weight: &[f64], bound: &[f64], got: &mut [f64]) {
    let mut open: Vec<usize> = (0..got.len()).filter(|&k| got[k] < bound[k]).collect();
    while rest > 1e-9 && !open.is_empty() {
        let total: f64 = open.iter().map(|&k| weight[k]).sum();
        let share = |k: usize| rest * weight[k] / total;
        let full: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&k| got[k] + share(k) >= bound[k])
            .collect();
        if full.is_empty() {
            for &k in &open {
                got[k] += share(k);
            }
            break;
        }
        for &k in &full {
            rest -= bound[k] - got[k];
            got[k] = bound[k];
        }
        open.retain(|k| !full.contains(k));
    }
}

/// One export's share cap on the data path: a rate the allocator writes and
/// a "next free time" cell its queues charge, on any IOThread, without a
/// lock (the cell works as a throttle group's bucket: [`super::group`]).
#[derive(Debug, Default)]
pub struct ShareCap {
    /// Ticks of the cell one operation costs at the cap (0: no cap).
    interval: AtomicU64,
    /// When the cell is empty (ticks, CLOCK_MONOTONIC).
    empty_at: AtomicU64,
    /// Requests the cap held back (for the allocator: it wanted more).
    held: AtomicU64,
    /// The queues that draw on it ([`Gate`]s).
    queues: AtomicUsize,
}

impl ShareCap {
    /// Uncapped.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the cap (None: uncapped) at `now_ns`. Credit banked at a lower
    /// cap is not carried over: the cell is pulled back to at most a burst
    /// ahead, so that a queue told to wait under the old cap is not kept
    /// long under a higher one.
    pub fn set(&self, iops: Option<f64>, now_ns: u64) {
        let interval = match iops {
            Some(r) if r > 0.0 => ((1e9 * TICKS_PER_NS as f64 / r) as u64).max(1),
            _ => 0,
        };
        self.interval.store(interval, Ordering::Relaxed);
        let limit = now_ns
            .saturating_mul(TICKS_PER_NS)
            .saturating_add(TOLERANCE);
        let _ = self
            .empty_at
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |at| {
                (at > limit).then_some(limit)
            });
    }

    /// The cap, operations per second (None: uncapped).
    pub fn iops(&self) -> Option<f64> {
        match self.interval.load(Ordering::Relaxed) {
            0 => None,
            i => Some(1e9 * TICKS_PER_NS as f64 / i as f64),
        }
    }

    /// Requests held back by the cap so far.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// None if the cap admits a request at `now_ns`, otherwise when to ask
    /// again (ns). Reads only.
    #[inline]
    pub fn check(&self, now_ns: u64) -> Option<u64> {
        let interval = self.interval.load(Ordering::Relaxed);
        if interval == 0 {
            return None;
        }
        let now = now_ns.saturating_mul(TICKS_PER_NS);
        let over = self
            .empty_at
            .empty_at()
            .saturating_sub(now)
            .saturating_sub(TOLERANCE);
        wait_until(now, over)
    }

    /// When the cap admits `n` operations in a row at `now_ns`, or, if its
    /// burst is smaller, as many as it ever admits at once (None: now).
    /// Reads only.
    pub fn check_batch(&self, n: usize, now_ns: u64) -> Option<u64> {
        let interval = self.interval.load(Ordering::Relaxed);
        if interval == 0 {
            return None;
        }
        let now = now_ns.saturating_mul(TICKS_PER_NS);
        let over = batch_over(self.empty_at.empty_at(), now, interval, TOLERANCE, n);
        wait_until(now, over)
    }

    /// Accounts one operation admitted at `now_ns`.
    #[inline]
    pub fn charge(&self, now_ns: u64) {
        let interval = self.interval.load(Ordering::Relaxed);
        if interval == 0 {
            return;
        }
        // The cell of the limits' buckets (`CreditCell`), one interval a request.
        self.empty_at
            .charge(now_ns.saturating_mul(TICKS_PER_NS), interval);
    }
}

/// How far ahead of now a cap's cell may be and still admit, ticks.
const TOLERANCE: u64 = CAP_BURST_NS * TICKS_PER_NS;

/// What a queue's reads and writes must pass: its export's limits (its own
/// or its throttle group's) and its share cap. A request is charged only when
/// both admit it, so a request one of them holds back costs the other
/// nothing. Each gate counts as one queue drawing on both.
#[derive(Debug)]
pub struct Gate {
    /// The limits (None: none).
    pub throttle: Option<Arc<SharedThrottle>>,
    /// The share cap (None: the export's device has no shares).
    pub share: Option<Arc<ShareCap>>,
}

impl Gate {
    /// The gate of `throttle` and `share`; None when there is neither, so
    /// that an unlimited queue pays one branch.
    pub fn new(
        throttle: Option<Arc<SharedThrottle>>,
        share: Option<Arc<ShareCap>>,
    ) -> Option<Gate> {
        (throttle.is_some() || share.is_some()).then(|| {
            let gate = Gate { throttle, share };
            gate.count(true);
            gate
        })
    }

    /// Counts this gate's queue in (`joins`) or out of the queues drawing on
    /// its buckets.
    fn count(&self, joins: bool) {
        let step = |n: &AtomicUsize| {
            if joins {
                n.fetch_add(1, Ordering::Relaxed);
            } else {
                n.fetch_sub(1, Ordering::Relaxed);
            }
        };
        if let Some(t) = &self.throttle {
            step(&t.queues);
        }
        if let Some(s) = &self.share {
            step(&s.queues);
        }
    }

    /// Whether this gate's queue is the only one drawing on its buckets.
    fn alone(&self) -> bool {
        let one = |n: &AtomicUsize| n.load(Ordering::Relaxed) == 1;
        self.throttle.as_ref().is_none_or(|t| one(&t.queues))
            && self.share.as_ref().is_none_or(|s| one(&s.queues))
    }

    /// Admits (and accounts in both) a request of `bytes` in direction `dir`
    /// at `now_ns`, or says when to ask again; callable from any thread. Ask
    /// for the head of a queue only.
    pub fn admit(&self, dir: Direction, bytes: u64, now_ns: u64) -> Admission {
        let (throttle, share) = (self.throttle.as_deref(), self.share.as_deref());
        let by_share = share.and_then(|s| {
            let wait = s.check(now_ns);
            if wait.is_some() {
                s.held.fetch_add(1, Ordering::Relaxed);
            }
            wait
        });
        let by_limits = throttle.and_then(|t| t.check(dir, now_ns));
        match (by_share, by_limits) {
            (None, None) => {
                if let Some(t) = throttle {
                    t.charge(dir, bytes, now_ns);
                }
                if let Some(s) = share {
                    s.charge(now_ns);
                }
                Admission::Go
            }
            (a, b) => Admission::WaitUntil(a.unwrap_or(0).max(b.unwrap_or(0))),
        }
    }

    /// [`Gate::admit`] for the head of a queue with `waiting` requests
    /// (the head among them): held back, it is told to ask again when the
    /// limits and the cap admit `min(waiting, BATCH_REQUESTS)` requests like
    /// it, within [`BATCH_DELAY_NS`](super::throttle::BATCH_DELAY_NS) of
    /// when it could go alone ([`batch_until`]), so that its IOThread wakes
    /// once for several requests rather than once for each.
    ///
    /// Only while its queue is the only one drawing on the buckets: a batch
    /// then delays that queue's own requests only. Queues that share them
    /// (a throttle group, an export's queues) each waiting for a batch are
    /// due at the same time, and the one that asks first (on the IOThread
    /// with less to do, every time) takes the whole batch, round after
    /// round, where one request at a time shares the limit evenly.
    pub fn admit_head(&self, dir: Direction, bytes: u64, waiting: usize, now_ns: u64) -> Admission {
        let alone = match self.admit(dir, bytes, now_ns) {
            Admission::WaitUntil(alone) if waiting > 1 && self.alone() => alone,
            a => return a,
        };
        let n = waiting.min(BATCH_REQUESTS);
        let by_limits = self
            .throttle
            .as_deref()
            .and_then(|t| t.check_batch(dir, bytes, n, now_ns));
        let by_share = self.share.as_deref().and_then(|s| s.check_batch(n, now_ns));
        Admission::WaitUntil(batch_until(alone, by_limits.max(by_share)))
    }
}

impl Clone for Gate {
    fn clone(&self) -> Self {
        let gate = Gate {
            throttle: self.throttle.clone(),
            share: self.share.clone(),
        };
        gate.count(true);
        gate
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.count(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qos::sim::{share_scenario, simulate_shares, Capacity, Load, ShareClient};

    fn input(id: u64, share: Share, done: f64, busy: bool, held: bool) -> ShareInput {
        ShareInput {
            id,
            share,
            seen: Interval { done, busy, held },
        }
    }

    fn reserved(r: f64) -> Share {
        Share {
            reservation: r,
            ..Share::default()
        }
    }

    /// One tick of a heavy export (weight 3) and a light one (weight 1),
    /// each seen as (done, held); an export that did something was busy.
    fn heavy_and_light(
        a: &mut ShareAllocator,
        heavy: (f64, bool),
        light: (f64, bool),
    ) -> Vec<Option<f64>> {
        a.tick(&[
            input(1, weight(3), heavy.0, heavy.0 > 0.0, heavy.1),
            input(2, weight(1), light.0, light.0 > 0.0, light.1),
        ])
    }

    /// The caps split 3:1.
    fn assert_three_to_one(caps: &[Option<f64>]) {
        let ratio = caps[0].unwrap() / caps[1].unwrap();
        assert!((ratio - 3.0).abs() < 0.01, "caps {caps:?}: {ratio:.2}:1");
    }

    fn weight(w: u32) -> Share {
        Share {
            weight: w,
            ..Share::default()
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6 * b.abs().max(1.0)
    }

    /// Nothing is capped before the device did anything; the first interval
    /// with I/O gives the first estimate, and the reservation comes first,
    /// the rest by weight.
    #[test]
    fn reservations_fit() {
        let mut a = ShareAllocator::new();
        let idle = [
            input(1, reserved(3000.0), 0.0, false, false),
            input(2, weight(3), 0.0, false, false),
        ];
        assert_eq!(a.tick(&idle), vec![None, None]);
        assert_eq!(a.capacity(), None);
        let caps = a.tick(&[
            input(1, reserved(3000.0), 2000.0, true, false),
            input(2, weight(3), 8000.0, true, false),
        ]);
        assert_eq!(a.capacity(), Some(10_000.0));
        // 3000 + 7000 / 4, and 7000 * 3 / 4.
        assert!(close(caps[0].unwrap(), 4750.0), "{caps:?}");
        assert!(close(caps[1].unwrap(), 5250.0), "{caps:?}");
    }

    /// Reservations above the device's capacity: the reserved exports keep
    /// their reservations as caps (never below), the others get the least cap.
    #[test]
    fn reservations_do_not_fit() {
        let mut a = ShareAllocator::new();
        let caps = a.tick(&[
            input(1, reserved(3000.0), 1000.0, true, false),
            input(2, reserved(1000.0), 500.0, true, false),
            input(3, weight(5), 500.0, true, false),
        ]);
        assert_eq!(a.capacity(), Some(2000.0));
        assert_eq!(caps, vec![Some(3000.0), Some(1000.0), Some(MIN_CAP_IOPS)]);
    }

    /// Weights 3:1, both flooding: caps 3:1 of the capacity, and the fluid
    /// device model serves them within 10% of 3:1 however it splits the
    /// device by itself (here 1:1, equal queue depths).
    #[test]
    fn weights_three_to_one() {
        let mut a = ShareAllocator::new();
        let caps = a.tick(&[
            input(1, weight(3), 5000.0, true, false),
            input(2, weight(1), 5000.0, true, false),
        ]);
        assert!(close(caps[0].unwrap(), 7500.0) && close(caps[1].unwrap(), 2500.0));
        let clients = [3, 1].map(|w| ShareClient {
            name: "flood",
            share: weight(w),
            load: vec![Load::Flood { qd: 64 }],
        });
        let phases = [Capacity {
            secs: 10,
            iops: 10_000,
        }];
        let r = &simulate_shares(&clients, &phases, 10)[0];
        let ratio = r.served[0].done / r.served[1].done;
        assert!((ratio - 3.0).abs() <= 0.3, "{ratio} {r:?}");
        let total = r.served[0].done + r.served[1].done;
        assert!(total >= 0.95 * 10_000.0, "the device is kept busy: {r:?}");
    }

    /// An export that used less than its share leaves the rest to the
    /// others; its cap is what it did plus headroom, and once that cap holds
    /// it back it counts as busy and gets its full share at the next tick.
    #[test]
    fn idle_export_gives_its_share_back() {
        let mut a = ShareAllocator::new();
        a.tick(&[
            input(1, weight(1), 100.0, false, false),
            input(2, weight(1), 9900.0, true, false),
        ]);
        assert_eq!(a.capacity(), Some(10_000.0));
        let caps = a.tick(&[
            input(1, weight(1), 100.0, false, false),
            input(2, weight(1), 9900.0, true, true),
        ]);
        assert!(close(caps[0].unwrap(), 100.0 * HEADROOM), "{caps:?}");
        // The flood gets the rest (the estimate grew: its cap held it).
        let c = a.capacity().unwrap();
        assert!(close(caps[1].unwrap(), c - 100.0 * HEADROOM), "{caps:?}");
        let caps = a.tick(&[
            input(1, weight(1), 120.0, true, true),
            input(2, weight(1), 9880.0, true, true),
        ]);
        let c = a.capacity().unwrap();
        assert!(close(caps[0].unwrap(), c / 2.0), "{caps:?}");
        // A static limit is all an export ever wants.
        let capped = Share {
            limit: 1000.0,
            ..weight(1)
        };
        let caps = a.tick(&[
            input(1, capped, 1000.0, true, true),
            input(2, weight(1), 9000.0, true, true),
        ]);
        let c = a.capacity().unwrap();
        assert!(close(caps[0].unwrap(), 1000.0), "{caps:?}");
        assert!(close(caps[1].unwrap(), c - 1000.0), "{caps:?}");
    }

    /// The scenario of the example: the device's capacity drops to 4000 and
    /// comes back, clients come and go. The reserved client keeps its
    /// floor, the weights split the rest, the device is not left idle, and
    /// a queue depth 1 client that cannot use its share does not cost the
    /// flood the device (it would, if every short export cut the estimate).
    #[test]
    fn share_scenario_meets_its_goals() {
        let (clients, phases) = share_scenario();
        let results = simulate_shares(&clients, &phases, 10);
        let done = |p: usize, k: usize| results[p].served[k].done;
        for p in 0..4 {
            assert!(done(p, 0) >= 0.97 * 3000.0, "floor, phase {p}: {results:?}");
        }
        // 10K: 3000 + 7000 / 4 and 7000 * 3 / 4 (within 10%).
        assert!((done(0, 0) / 4750.0 - 1.0).abs() <= 0.1, "{:?}", results[0]);
        assert!((done(0, 1) / 5250.0 - 1.0).abs() <= 0.1, "{:?}", results[0]);
        // Three clients: 4400, 4200, 1400.
        for (k, want) in [4400.0, 4200.0, 1400.0].into_iter().enumerate() {
            assert!((done(1, k) / want - 1.0).abs() <= 0.1, "{:?}", results[1]);
        }
        // 4K: 3200, 600, 200; the estimate follows the device down.
        for (k, want) in [3200.0, 600.0, 200.0].into_iter().enumerate() {
            assert!((done(2, k) / want - 1.0).abs() <= 0.15, "{:?}", results[2]);
        }
        let estimate = results[2].estimate.unwrap();
        assert!((3800.0..4400.0).contains(&estimate), "{:?}", results[2]);
        // Back to 10K: the estimate recovers; the open loop gets what it asks.
        let estimate = results[3].estimate.unwrap();
        assert!((9500.0..11000.0).contains(&estimate), "{:?}", results[3]);
        assert!(done(3, 2) >= 0.9 * 500.0, "{:?}", results[3]);
        // The queue depth 1 client gets what it can do, the flood the rest.
        assert!(done(4, 2) >= 0.85 * 800.0, "{:?}", results[4]);
        assert!(done(4, 1) >= 0.85 * 9200.0, "{:?}", results[4]);
        for r in &results {
            let total: f64 = r.served.iter().map(|s| s.done).sum();
            assert!(total >= 0.8 * r.capacity.iops as f64, "idle device {r:?}");
        }
    }

    /// A heavy export whose own queues cannot take its weighted share (its
    /// client, not the device, bounds it) gets all it can do, and the light
    /// one the rest of the device: the split is work-conserving. With the
    /// heavy one able to use its share, the split is by weight.
    #[test]
    fn a_self_bound_export_leaves_the_rest_to_the_others() {
        let run = |bound: f64| {
            let clients = vec![
                ShareClient {
                    name: "heavy",
                    share: weight(3),
                    load: vec![Load::Bound {
                        qd: 16,
                        iops: bound,
                    }],
                },
                ShareClient {
                    name: "light",
                    share: Share::default(),
                    load: vec![Load::Flood { qd: 16 }],
                },
            ];
            let phases = [Capacity {
                secs: 10,
                iops: 100_000,
            }];
            let r = simulate_shares(&clients, &phases, 15).remove(0);
            (r.served[0].done, r.served[1].done, r)
        };
        // Bound below its share of 75K: all it can do, the light one most
        // of the rest.
        for bound in [40_000.0, 58_000.0, 65_000.0] {
            let (heavy, light, r) = run(bound);
            assert!(heavy >= 0.95 * bound, "{bound}: {r:?}");
            assert!(light >= 0.75 * (100_000.0 - bound), "{bound}: {r:?}");
        }
        let (heavy, light, r) = run(f64::INFINITY);
        assert!((heavy / light - 3.0).abs() <= 0.3, "{r:?}");
    }

    /// Weights 3:1, both flooding a device that is the CPU they share (this
    /// project's VM, whose speed changes from one tick to the next): the
    /// heavy export falls short of its cap, and during the cut's probe it
    /// slows down further, with the device. That is no export wanting no
    /// more: marked self-limited, it would be capped at what it did plus
    /// headroom and the light one given the rest of an estimate the device
    /// no longer reaches (in the run of `tests/qos.rs` whose allocator log
    /// this replays, caps of 1.35:1 and a split near 1.4:1 to the end).
    #[test]
    fn a_flood_that_slows_down_with_the_device_is_not_self_limited() {
        let mut a = ShareAllocator::new();
        for _ in 0..5 {
            heavy_and_light(&mut a, (428_349.0, true), (142_746.0, true));
        }
        heavy_and_light(&mut a, (305_795.0, true), (142_915.0, true));
        heavy_and_light(&mut a, (342_497.0, false), (142_761.0, true));
        let caps = heavy_and_light(&mut a, (273_763.0, false), (121_300.0, true));
        assert_three_to_one(&caps);
    }

    /// A short export that the cut capped below what it did slows down to
    /// its new cap: it used what the cut left it, and is not self-limited
    /// (the start of a flood beside one that ran alone, from the log of a
    /// `tests/qos.rs` run: the heavy export, marked at 291K, was held to
    /// 349K while the light one was given 299K).
    #[test]
    fn a_flood_at_its_lowered_cap_is_not_self_limited() {
        let mut a = ShareAllocator::new();
        for _ in 0..5 {
            heavy_and_light(&mut a, (620_616.0, false), (0.0, false));
        }
        heavy_and_light(&mut a, (620_616.0, false), (9.0, true));
        let cut = heavy_and_light(&mut a, (381_130.0, false), (17_525.0, true));
        assert!(cut[0].unwrap() < 381_130.0 * SPED_UP, "{cut:?}");
        let caps = heavy_and_light(&mut a, (291_328.0, false), (99_756.0, true));
        assert_three_to_one(&caps);
    }

    /// A cap is a rate: over a second of requests asked as soon as allowed,
    /// it admits the rate plus the burst tolerance; a new cap takes effect
    /// at once, credit banked under the old one is not kept.
    #[test]
    fn cap_admits_its_rate() {
        let cap = ShareCap::new();
        assert_eq!(cap.check(0), None, "uncapped");
        cap.set(Some(1000.0), 0);
        assert_eq!(cap.iops().map(f64::round), Some(1000.0));
        let mut now = 1_000_000_000u64;
        let end = now + 1_000_000_000;
        let mut admitted = 0u64;
        while now < end {
            match cap.check(now) {
                None => {
                    cap.charge(now);
                    admitted += 1;
                }
                Some(t) => {
                    assert!(t > now);
                    now = t;
                }
            }
        }
        // 1000 in the second, plus the 5 ms burst (5 requests), plus one.
        assert!((1000..=1006).contains(&admitted), "{admitted}");
        cap.set(Some(10.0), now);
        let wait = cap.check(now).map(|t| t - now).unwrap_or(0);
        assert!(wait <= 100_000_000, "{wait}");
        cap.set(None, now);
        assert_eq!(cap.check(now), None);
        assert_eq!(cap.iops(), None);
    }

    /// A held head of a queue with others waiting is told when the limits
    /// and the cap admit up to a batch of them, within the batch delay of
    /// when it could go alone; a lone one when it could go alone.
    #[test]
    fn a_held_head_waits_for_a_batch() {
        use crate::qos::throttle::{BATCH_DELAY_NS, BATCH_REQUESTS};
        use crate::qos::ThrottleConfig;
        let ms = 1_000_000;
        let now = 1_000_000_000;
        let gate_of = |iops: u64, cap: Option<f64>| {
            let limits = ThrottleConfig {
                iops_total: Some(iops),
                ..Default::default()
            }
            .validate()
            .unwrap();
            let share = Arc::new(ShareCap::new());
            share.set(cap, 0);
            let gate = Gate::new(Some(Arc::new(SharedThrottle::new(limits))), Some(share)).unwrap();
            // Ask until the limits or the cap hold one back.
            while gate.admit(Direction::Read, 4096, now) == Admission::Go {}
            gate
        };
        let wait = |gate: &Gate, waiting| match gate.admit_head(Direction::Read, 4096, waiting, now)
        {
            Admission::WaitUntil(t) => t - now,
            Admission::Go => panic!("held back"),
        };
        // 1000 IOPS: a millisecond a request.
        let gate = gate_of(1000, None);
        let alone = wait(&gate, 1);
        assert!((ms..=ms + 1).contains(&alone), "{alone}");
        assert_eq!(wait(&gate, 4), alone + 3 * ms);
        assert_eq!(wait(&gate, BATCH_REQUESTS), alone + 15 * ms);
        assert_eq!(
            wait(&gate, 100),
            wait(&gate, BATCH_REQUESTS),
            "a batch at most"
        );
        // 100 IOPS: 16 would take 150 ms; the head waits the bound at most.
        let gate = gate_of(100, None);
        let alone = wait(&gate, 1);
        assert_eq!(wait(&gate, 2), alone + 10 * ms);
        assert_eq!(wait(&gate, 16), alone + BATCH_DELAY_NS);
        // A cap of 100 IOPS with a 5 ms burst admits one at a time: a batch
        // waits for nothing more.
        let gate = gate_of(1000, Some(100.0));
        let alone = wait(&gate, 1);
        assert!(alone >= 5 * ms, "the cap holds the head: {alone}");
        assert_eq!(wait(&gate, 16), alone);
        // One of 1000 IOPS admits six at once (5 ms of burst): a batch of
        // 16 waits for those.
        let gate = gate_of(1000, Some(1000.0));
        let alone = wait(&gate, 1);
        assert_eq!(wait(&gate, 16), alone + 5 * ms);
        // A second queue on the same buckets: one request at a time again.
        let other = gate.clone();
        assert_eq!(wait(&gate, 16), alone);
        drop(other);
        assert_eq!(wait(&gate, 16), alone + 5 * ms);
        let limits = gate.throttle.clone();
        let member = Gate::new(limits, None).unwrap();
        assert_eq!(wait(&gate, 16), alone, "a group's other member");
        drop(member);
        // Asking charges nothing: the head alone still goes at its time.
        assert_eq!(
            gate.admit_head(Direction::Read, 4096, 16, now + alone),
            Admission::Go
        );
    }

    /// The gate charges a request only when both the limits and the cap
    /// admit it: a request the cap holds back costs the limits nothing.
    #[test]
    fn gate_charges_only_what_both_admit() {
        use crate::qos::{Direction, ThrottleConfig};
        let limits = ThrottleConfig {
            iops_total: Some(100),
            ..Default::default()
        }
        .validate()
        .unwrap();
        let throttle = Arc::new(SharedThrottle::new(limits));
        let cap = Arc::new(ShareCap::new());
        let gate = Gate::new(Some(throttle.clone()), Some(cap.clone())).unwrap();
        assert!(Gate::new(None, None).is_none());
        cap.set(Some(1.0), 0);
        let now = 1_000_000_000;
        assert_eq!(gate.admit(Direction::Read, 4096, now), Admission::Go);
        // The cap (1 IOPS) holds the second; the limits are not charged.
        assert!(matches!(
            gate.admit(Direction::Read, 4096, now),
            Admission::WaitUntil(_)
        ));
        assert_eq!(cap.held(), 1);
        // 100 IOPS with a tenth of a second of burst: 10 more go at once.
        for _ in 0..10 {
            assert_eq!(throttle.admit(Direction::Read, 4096, now), Admission::Go);
        }
        assert!(matches!(
            throttle.admit(Direction::Read, 4096, now),
            Admission::WaitUntil(_)
        ));
        // Uncapped: the limits alone decide.
        cap.set(None, now);
        assert!(matches!(
            gate.admit(Direction::Read, 4096, now),
            Admission::WaitUntil(_)
        ));
        assert_eq!(cap.held(), 1, "held by the limits, not the cap");
    }
}

//! Limits shared by queues on several IOThreads, without a lock: an export's
//! own limits (its queues are spread over the pool) and a throttle group (one
//! set of limits for several exports, QEMU's `throttle-group` object and
//! libvirt's `group_name`).
//!
//! # Design
//!
//! Each bucket is one `AtomicU64` holding the time at which it would be empty,
//! in ticks ([`super::throttle`]: QEMU's level as credit time). A request of an
//! IOThread is admitted in two steps on the buckets of its direction:
//!
//! 1. **check**: one relaxed load per bucket; if some bucket is more than its
//!    tolerance ahead of `now`, answer "wait until" without writing anything
//!    (a queue held back costs no write to the shared line);
//! 2. **charge**: one compare-exchange loop per bucket setting
//!    `empty_at = max(empty_at, now) + cost`.
//!
//! No lock, no per-request allocation, and the threads never wait for each
//! other: a failed compare-exchange only means another IOThread charged in
//! between, and the loop retries with the value it saw. Relaxed ordering is
//! enough: the cells publish no other memory, and read-modify-writes of one
//! atomic are totally ordered whatever the ordering argument, so no charge is
//! lost.
//!
//! # Error bound
//!
//! Every admitted request adds its full cost to `empty_at` (nothing is lost),
//! and a request is admitted only if, when it was checked, `empty_at` was at
//! most `now + tolerance`. Take the last check that passed before some
//! charge: after it, only requests already checked can be charged, and each
//! IOThread has at most one of those (it admits one request at a time). So
//! `empty_at` never passes `now + tolerance + N * c_max`, where `now` is the
//! latest time any IOThread passed in, `N` the number of IOThreads that share
//! the throttle and `c_max` the largest request's cost. Over any interval of
//! `t` seconds a bucket therefore admits at most
//!
//! ```text
//! avg * t + size + N * c_max        (QEMU, one thread: avg * t + size + c_max)
//! ```
//!
//! units: the shared form passes QEMU's own overshoot by at most `N - 1`
//! requests, whatever the interleaving (a stale `now` only makes a thread more
//! conservative). With several buckets on one direction, each bucket obeys
//! its bound. The long-run rate is exact: the bound does not grow with `t`.
//! `tests::shared_group_never_exceeds_the_bound` hammers one group from
//! threads and checks this.
//!
//! # Cost per request
//!
//! With no limit the data path holds no throttle at all (`Option` is `None`: a
//! branch). Otherwise an admitted request costs, per bucket of its direction,
//! one load, a multiplication and a rounding (its cost in ticks) and one
//! compare-exchange, on top of a call and a walk over the direction's active
//! buckets; a held-back request costs the loads only. `examples/qos_cost.rs`
//! counts the instructions under callgrind (docs/qos.md has the figures). The
//! compare-exchange is the only expensive part when IOThreads of one group
//! admit at once (the cache line moves between cores, on the order of 100 ns).
//! Only admitted requests write, so the line moves at most as often as the
//! limit lets requests through: a throttle shared by IOThreads costs in
//! proportion to the I/O it admits, not to the pressure it holds back.
//!
//! Per-IOThread leases (take `k` units from the group at once) would move the
//! line `k` times less often but add `N * k` units of error and credit that
//! idles in a lease; at the rates throttles are set to (far below what the
//! daemon can do unthrottled) the single shared word is the simpler bound.
//!
//! Fairness between the queues of a group: a held-back queue retries at the
//! time it was told; queues told the same time race for the credit, so none is
//! favoured systematically. Shares between exports, with floors, are the
//! business of [`super::mclock`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::throttle::{Admission, CreditCell, Direction, Plan, ThrottleLimits, CELLS};

impl CreditCell for AtomicU64 {
    fn empty_at(&self) -> u64 {
        self.load(Ordering::Relaxed)
    }
    fn charge(&self, now: u64, cost: u64) {
        // fetch_update retries on contention; the closure never refuses.
        let _ = self.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |at| {
            Some(at.max(now).saturating_add(cost))
        });
    }
}

/// Leaky buckets that IOThreads share by reference (`Arc`): `&self` admits.
#[derive(Debug)]
pub struct SharedThrottle {
    limits: ThrottleLimits,
    plan: Plan,
    cells: [AtomicU64; CELLS],
    /// The queues that draw on it ([`super::Gate`]s).
    pub(super) queues: AtomicUsize,
}

impl SharedThrottle {
    /// Empty buckets for `limits`.
    pub fn new(limits: ThrottleLimits) -> Self {
        SharedThrottle {
            plan: Plan::new(&limits),
            limits,
            cells: Default::default(),
            queues: AtomicUsize::new(0),
        }
    }

    /// The limits enforced.
    pub fn limits(&self) -> &ThrottleLimits {
        &self.limits
    }

    /// Admits (and accounts) a request of `bytes` in direction `dir` at
    /// `now_ns`, or says when to ask again; callable from any thread. Ask for
    /// the head of a queue only, so that a queue's requests keep their order.
    pub fn admit(&self, dir: Direction, bytes: u64, now_ns: u64) -> Admission {
        self.plan.admit(&self.cells, dir, bytes, now_ns)
    }

    /// The first half of [`SharedThrottle::admit`], for a request that other
    /// buckets must admit too ([`super::shares::Gate`]): None if the limits
    /// admit a request of `dir` at `now_ns`, otherwise when to ask again.
    /// Writes nothing.
    pub fn check(&self, dir: Direction, now_ns: u64) -> Option<u64> {
        self.plan.check(&self.cells, dir, now_ns)
    }

    /// When the limits admit `n` requests of `bytes` in direction `dir` in
    /// a row (`Plan::check_batch`); None: now. Writes nothing.
    pub fn check_batch(&self, dir: Direction, bytes: u64, n: usize, now_ns: u64) -> Option<u64> {
        self.plan.check_batch(&self.cells, dir, bytes, n, now_ns)
    }

    /// The second half of [`SharedThrottle::admit`]: accounts a request that
    /// [`SharedThrottle::check`] admitted.
    pub fn charge(&self, dir: Direction, bytes: u64, now_ns: u64) {
        self.plan.charge(&self.cells, dir, bytes, now_ns)
    }
}

/// A named set of limits that several exports join (`[[throttle-group]]`).
/// Like a QEMU throttle node, an export belongs to at most one group; its own
/// `[export.throttle]` is a group of one.
#[derive(Debug)]
pub struct ThrottleGroup {
    /// The group's name (`throttle-group = "NAME"` in an export).
    pub name: String,
    /// Its buckets, shared by the queues of every member.
    pub throttle: SharedThrottle,
}

impl ThrottleGroup {
    /// A group with empty buckets.
    pub fn new(name: impl Into<String>, limits: ThrottleLimits) -> Self {
        ThrottleGroup {
            name: name.into(),
            throttle: SharedThrottle::new(limits),
        }
    }
}

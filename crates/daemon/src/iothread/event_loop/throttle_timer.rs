//! The IOThread's throttle timer: one timerfd in its epoll set, pointed at the
//! earliest queue held back by its I/O limits, so that a thread whose queues
//! all wait sleeps until one is due instead of polling for tokens.

use std::os::fd::AsFd;

use super::*;
use crate::clock::{arm_timer_at, monotonic_ns};

impl IoThread {
    /// Queues held back whose time has come go to `ready`.
    pub(super) fn collect_due(&mut self, ready: &mut Vec<SlotId>) {
        let now = monotonic_ns();
        for (slot, q) in self.queues.iter() {
            if q.held_until().is_some_and(|t| t <= now) {
                ready.push(slot);
                self.timer_dirty = true;
                self.due = true;
            }
        }
    }

    /// Points the throttle timer at the earliest held-back queue, or disarms
    /// it.
    pub(super) fn rearm_timer(&mut self) {
        self.timer_dirty = false;
        let next = self
            .queues
            .iter()
            .filter_map(|(_, q)| q.held_until())
            .min()
            // 0 would disarm: a queue due at once is due at 1 ns, in the past.
            .map_or(0, |t| t.max(1));
        if next == self.timer_at {
            return;
        }
        match arm_timer_at(self.throttle_timer.as_fd(), next) {
            Ok(()) => self.timer_at = next,
            Err(e) => error!("{}: cannot arm the throttle timer: {e}", self.name),
        }
    }
}

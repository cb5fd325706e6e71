//! The IOThread's throttle timer: one timerfd in its epoll set, pointed at the
//! earliest queue held back by its I/O limits, so that a thread whose queues
//! all wait sleeps until one is due instead of polling for tokens.

use super::*;

impl IoThread {
    /// Queues held back whose time has come go to `ready`.
    pub(super) fn collect_due(&mut self, ready: &mut Vec<SlotId>) {
        let now = throttle_clock();
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
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            // An all-zero it_value disarms the timer.
            it_value: libc::timespec {
                tv_sec: (next / 1_000_000_000) as libc::time_t,
                tv_nsec: (next % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: `throttle_timer` is a live timerfd and `spec` a valid
        // itimerspec; the old value is not asked for.
        let r = unsafe {
            libc::timerfd_settime(
                self.throttle_timer.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
        if r == 0 {
            self.timer_at = next;
        } else {
            error!(
                "{}: cannot arm the throttle timer: {}",
                self.name,
                io::Error::last_os_error()
            );
        }
    }
}

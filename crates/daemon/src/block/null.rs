//! The null engine: reads return zeroes, writes are dropped. Every operation
//! completes at once, or `latency_ns` after its submission (as QEMU's null-co
//! `latency-ns`), delivered like a device's: a timerfd raises the engine's
//! notify fd when the earliest one is due, and a polling IOThread sees it due
//! from the clock.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::{clock_ns, Completion, Engine, IoKind, IoOp};

/// Completes operations in the submitting IOThread, at once or when due.
#[derive(Default)]
pub struct NullEngine {
    done: Vec<Completion>,
    /// Delayed completions by due time (CLOCK_MONOTONIC ns), earliest first.
    delayed: BinaryHeap<Reverse<(u64, u64, i32)>>,
    /// Armed for the earliest delayed completion; created on first use.
    timer: Option<OwnedFd>,
    /// Due time the timer is armed for (0: disarmed).
    armed_for: u64,
}

impl NullEngine {
    /// A null engine whose timer exists from the start (it is otherwise made
    /// by the first delayed operation).
    pub fn with_timer() -> io::Result<Self> {
        // SAFETY: timerfd_create takes no pointers; the result is checked.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(NullEngine {
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            timer: Some(unsafe { OwnedFd::from_raw_fd(fd) }),
            ..Default::default()
        })
    }

    /// Points the timer at the earliest delayed completion (or disarms it).
    fn rearm(&mut self) {
        let next = self.delayed.peek().map_or(0, |Reverse((due, _, _))| *due);
        if next == self.armed_for {
            return;
        }
        let Some(timer) = &self.timer else { return };
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
        // SAFETY: `timer` is a live timerfd and `spec` a valid itimerspec; the
        // old value is not asked for.
        let r = unsafe {
            libc::timerfd_settime(
                timer.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
        if r == 0 {
            self.armed_for = next;
        }
    }
}

impl Engine for NullEngine {
    unsafe fn submit(&mut self, _fd: RawFd, op: &IoOp, token: u64) -> io::Result<()> {
        if op.kind == IoKind::Read {
            for i in 0..op.iovcnt as usize {
                // SAFETY: the caller guarantees `op.iov` holds `iovcnt` valid
                // iovecs describing writable buffers.
                unsafe {
                    let v = &*op.iov.add(i);
                    std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len);
                }
            }
        }
        let result = match op.kind {
            IoKind::Read | IoKind::Write => op.len.min(i32::MAX as u64) as i32,
            _ => 0,
        };
        if op.latency_ns == 0 {
            self.done.push(Completion { token, result });
        } else {
            if self.timer.is_none() {
                self.timer = NullEngine::with_timer()?.timer;
            }
            let due = clock_ns(libc::CLOCK_MONOTONIC) + op.latency_ns;
            self.delayed.push(Reverse((due, token, result)));
        }
        Ok(())
    }

    fn commit(&mut self) -> io::Result<()> {
        self.rearm();
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.done);
        if !self.delayed.is_empty() {
            let now = clock_ns(libc::CLOCK_MONOTONIC);
            while let Some(Reverse((due, token, result))) = self.delayed.peek().copied() {
                if due > now {
                    break;
                }
                self.delayed.pop();
                out.push(Completion { token, result });
            }
            self.rearm();
        }
    }

    fn has_completions(&mut self) -> bool {
        !self.done.is_empty()
            || self
                .delayed
                .peek()
                .is_some_and(|Reverse((due, _, _))| *due <= clock_ns(libc::CLOCK_MONOTONIC))
    }

    fn notify_fd(&self) -> Option<RawFd> {
        self.timer.as_ref().map(AsRawFd::as_raw_fd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn op(latency_ns: u64) -> IoOp {
        IoOp {
            kind: IoKind::Flush,
            offset: 0,
            len: 0,
            iov: std::ptr::null(),
            iovcnt: 0,
            dsync: false,
            punch: false,
            latency_ns,
        }
    }

    #[test]
    fn immediate_without_latency() {
        let mut e = NullEngine::default();
        // SAFETY: a flush has no buffers.
        unsafe { e.submit(-1, &op(0), 7).unwrap() };
        assert!(e.has_completions());
        let mut out = Vec::new();
        e.reap(&mut out);
        assert_eq!(
            out,
            vec![Completion {
                token: 7,
                result: 0
            }]
        );
        assert!(!e.has_completions());
    }

    #[test]
    fn delayed_completions_come_due_in_order_and_raise_the_timer() {
        let mut e = NullEngine::with_timer().unwrap();
        let fd = e.notify_fd().unwrap();
        let t = Instant::now();
        // SAFETY: flushes have no buffers.
        unsafe {
            e.submit(-1, &op(40_000_000), 2).unwrap();
            e.submit(-1, &op(20_000_000), 1).unwrap();
        }
        e.commit().unwrap();
        assert!(!e.has_completions());
        let mut out = Vec::new();
        e.reap(&mut out);
        assert!(out.is_empty());
        // The timer fd becomes readable when the first one is due.
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 1000) }, 1);
        assert!(t.elapsed() >= Duration::from_millis(20));
        assert!(e.has_completions());
        e.reap(&mut out);
        assert_eq!(
            out,
            vec![Completion {
                token: 1,
                result: 0
            }]
        );
        std::thread::sleep(Duration::from_millis(25));
        e.reap(&mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(out[1].token, 2);
        assert!(t.elapsed() >= Duration::from_millis(40));
        assert!(!e.has_completions());
    }
}

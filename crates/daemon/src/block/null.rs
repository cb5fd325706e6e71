//! The null engine: reads return zeroes (or, for a disk without QEMU's
//! null-co `read-zeroes`, leave their buffers untouched), writes are dropped. Every operation
//! completes when it is submitted ([`Handed::Done`]), or `latency_ns` after
//! its submission (as QEMU's null-co `latency-ns`; the latency is the
//! engine's, given at construction), delivered like a device's: a timerfd
//! raises the engine's notify fd when the earliest one is due, and a polling
//! IOThread sees it due from the clock. A flush has nothing to make durable
//! and completes when it is submitted.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use super::{Completion, Engine, Handed, IoKind, IoOp};
use crate::clock::{arm_timer_at, monotonic_ns, monotonic_timer};

/// Completes operations in the submitting IOThread, at once or when due.
#[derive(Default)]
pub struct NullEngine {
    /// Completion latency, ns (0: at once).
    latency_ns: u64,
    /// Delayed completions by due time (CLOCK_MONOTONIC ns), earliest first.
    delayed: BinaryHeap<Reverse<(u64, u64, i32)>>,
    /// Armed for the earliest delayed completion; created on first use.
    timer: Option<OwnedFd>,
    /// Due time the timer is armed for (0: disarmed).
    armed_for: u64,
}

impl NullEngine {
    /// A null engine whose operations complete `latency_ns` after submission
    /// (with a latency, its timer and notify fd exist from the start).
    pub fn new(latency_ns: u64) -> io::Result<Self> {
        if latency_ns == 0 {
            return Ok(NullEngine::default());
        }
        Ok(NullEngine {
            latency_ns,
            timer: Some(monotonic_timer()?),
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
        if arm_timer_at(timer.as_fd(), next).is_ok() {
            self.armed_for = next;
        }
    }
}

impl NullEngine {
    /// Runs `op`: done at once without a latency (and for a flush), else
    /// queued until it is due, its completion carrying `token`. A read
    /// writes zeroes into its buffers if `read_zeroes`, else leaves them as
    /// they are.
    ///
    /// # Safety
    /// As [`Engines::submit`](super::Engines::submit).
    pub unsafe fn submit(
        &mut self,
        op: &IoOp,
        token: u64,
        read_zeroes: bool,
    ) -> io::Result<Handed> {
        if op.kind == IoKind::Read && read_zeroes {
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
        match &self.timer {
            Some(_) if op.kind != IoKind::Flush => {
                let due = monotonic_ns() + self.latency_ns;
                self.delayed.push(Reverse((due, token, result)));
                Ok(Handed::Queued)
            }
            _ => Ok(Handed::Done(result)),
        }
    }
}

impl Engine for NullEngine {
    fn commit(&mut self) -> io::Result<()> {
        self.rearm();
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        if !self.delayed.is_empty() {
            let now = monotonic_ns();
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
        self.delayed
            .peek()
            .is_some_and(|Reverse((due, _, _))| *due <= monotonic_ns())
    }

    fn notify_fd(&self) -> Option<RawFd> {
        self.timer.as_ref().map(AsRawFd::as_raw_fd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn op() -> IoOp {
        IoOp {
            kind: IoKind::Discard,
            offset: 0,
            len: 4096,
            iov: std::ptr::null(),
            iovcnt: 0,
            dsync: false,
            punch: false,
        }
    }

    /// What one reap hands out.
    fn reaped(e: &mut NullEngine) -> Vec<Completion> {
        let mut out = Vec::new();
        e.reap(&mut out);
        out
    }

    #[test]
    fn immediate_without_latency() {
        let mut e = NullEngine::new(0).unwrap();
        assert_eq!(e.notify_fd(), None);
        // SAFETY: a discard has no buffers.
        let handed = unsafe { e.submit(&op(), 7, true).unwrap() };
        assert_eq!(handed, Handed::Done(0));
        assert!(!e.has_completions());
        assert_eq!(reaped(&mut e), []);
    }

    #[test]
    fn delayed_completions_come_due_in_order_and_raise_the_timer() {
        let mut e = NullEngine::new(40_000_000).unwrap();
        let fd = e.notify_fd().unwrap();
        let t = Instant::now();
        // SAFETY: discards have no buffers.
        assert_eq!(unsafe { e.submit(&op(), 1, true).unwrap() }, Handed::Queued);
        std::thread::sleep(Duration::from_millis(20));
        // SAFETY: as above.
        assert_eq!(unsafe { e.submit(&op(), 2, true).unwrap() }, Handed::Queued);
        e.commit().unwrap();
        let mut out = Vec::new();
        if t.elapsed() < Duration::from_millis(35) {
            assert!(!e.has_completions());
            e.reap(&mut out);
            assert!(out.is_empty());
        }
        // The timer fd becomes readable when the first one is due.
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 1000) }, 1);
        assert!(t.elapsed() >= Duration::from_millis(40));
        assert!(e.has_completions());
        e.reap(&mut out);
        assert_eq!(out[0].token, 1);
        std::thread::sleep(Duration::from_millis(25));
        e.reap(&mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(out[1].token, 2);
        assert!(t.elapsed() >= Duration::from_millis(60));
        assert!(!e.has_completions());
    }

    #[test]
    fn flush_completes_at_once_even_with_a_latency() {
        let mut e = NullEngine::new(1_000_000_000).unwrap();
        // SAFETY: a flush has no buffers.
        let handed = unsafe { e.submit(&IoOp::flush(), 3, true).unwrap() };
        assert_eq!(handed, Handed::Done(0));
        assert!(!e.has_completions());
        assert_eq!(reaped(&mut e), []);
    }

    /// A read fills its buffers with zeroes, or with `read_zeroes` off
    /// leaves them as the guest had them; both complete with the full length.
    #[test]
    fn reads_zero_their_buffers_unless_read_zeroes_is_off() {
        for (zeroes, expect) in [(true, 0u8), (false, 0xa5)] {
            let mut e = NullEngine::new(0).unwrap();
            let mut buf = vec![0xa5u8; 8192];
            let iov = [
                libc::iovec {
                    iov_base: buf.as_mut_ptr().cast(),
                    iov_len: 4096,
                },
                libc::iovec {
                    // SAFETY: 4096 is inside the 8192-byte buffer.
                    iov_base: unsafe { buf.as_mut_ptr().add(4096) }.cast(),
                    iov_len: 4096,
                },
            ];
            let read = IoOp {
                kind: IoKind::Read,
                len: 8192,
                iov: iov.as_ptr(),
                iovcnt: 2,
                ..op()
            };
            // SAFETY: the iovecs describe `buf`, live until the reap below.
            let handed = unsafe { e.submit(&read, 9, zeroes).unwrap() };
            assert_eq!(handed, Handed::Done(8192));
            assert!(buf.iter().all(|&b| b == expect), "read_zeroes {zeroes}");
        }
    }
}

//! The kernel's clocks in nanoseconds: what the event loop reads for its
//! CPU accounting (CLOCK_THREAD_CPUTIME_ID) and the null backend for the due
//! time of a delayed completion (CLOCK_MONOTONIC); and the CLOCK_MONOTONIC
//! timerfds that the null backend's delayed completions and an IOThread's
//! queues held back by their I/O limits sleep on, armed at an absolute time.
//! A leaf module: it knows no other part of the daemon, so any layer may use
//! it.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// The time of `clock` (CLOCK_MONOTONIC, CLOCK_THREAD_CPUTIME_ID...) in ns.
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a live, writable timespec; an invalid clock id only
    // makes the call fail (leaving 0).
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC in ns (the clock of `Instant`), as a `u64`: the
/// IOThreads' clock for passes, polling, request latency and the I/O
/// limits, the same in every thread (a queue's pop times stay on it when the
/// queue moves to another IOThread) and never 0 once the system is up (0 is
/// "never" for the polling policy). A `u64` where `Instant` arithmetic cost
/// about 50 instructions per request, and `Instant`'s reads and conversions
/// showed in profiles of a polling IOThread at QD1.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// A non-blocking CLOCK_MONOTONIC timerfd, disarmed.
pub fn monotonic_timer() -> io::Result<OwnedFd> {
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
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Arms `timer` (from [`monotonic_timer`]) to fire once at `at_ns` on
/// CLOCK_MONOTONIC (a time in the past fires at once); 0 disarms it.
pub fn arm_timer_at(timer: BorrowedFd<'_>, at_ns: u64) -> io::Result<()> {
    let spec = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        // An all-zero it_value disarms the timer.
        it_value: libc::timespec {
            tv_sec: (at_ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (at_ns % 1_000_000_000) as libc::c_long,
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
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_monotonic_clock_does_not_go_back() {
        let a = clock_ns(libc::CLOCK_MONOTONIC);
        let b = clock_ns(libc::CLOCK_MONOTONIC);
        assert!(a > 0 && b >= a, "{a} then {b}");
    }

    #[test]
    fn an_armed_timer_fires_and_a_disarmed_one_does_not() {
        use std::os::fd::AsFd;
        let t = monotonic_timer().unwrap();
        let expirations = |t: &OwnedFd| {
            let mut n = 0u64;
            // SAFETY: reads 8 bytes into `n` from a live non-blocking timerfd.
            let r = unsafe { libc::read(t.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
            if r == 8 {
                n
            } else {
                0
            }
        };
        arm_timer_at(t.as_fd(), 1).unwrap(); // long past: fires at once
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(expirations(&t), 1);
        let later = clock_ns(libc::CLOCK_MONOTONIC) + 1_000_000;
        arm_timer_at(t.as_fd(), later).unwrap();
        arm_timer_at(t.as_fd(), 0).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(expirations(&t), 0, "a disarmed timer fired");
    }
}

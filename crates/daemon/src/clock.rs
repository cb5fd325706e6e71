//! The kernel's clocks in nanoseconds: what the event loop reads for its
//! CPU accounting (CLOCK_THREAD_CPUTIME_ID) and the null backend for the due
//! time of a delayed completion (CLOCK_MONOTONIC). A leaf module: it knows
//! no other part of the daemon, so any layer may use it.

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

#[cfg(test)]
mod tests {
    use super::clock_ns;

    #[test]
    fn the_monotonic_clock_does_not_go_back() {
        let a = clock_ns(libc::CLOCK_MONOTONIC);
        let b = clock_ns(libc::CLOCK_MONOTONIC);
        assert!(a > 0 && b >= a, "{a} then {b}");
    }
}

//! Instructions per request of a throttle on the request path, for callgrind:
//! `admit` on a [`SharedThrottle`] (the form IOThreads share) with one bucket
//! (`iops-total`), with three buckets of a write (`iops-total`, `bps-total`
//! with a burst bucket), and a held-back request (a check, no write).
//!
//!     cargo build --release -p vqblk-daemon --example qos_cost
//!     for n in 1000000 2000000; do
//!       valgrind --tool=callgrind --callgrind-out-file=/tmp/qos.$n \
//!         target/release/examples/qos_cost $n
//!     done
//!
//! The difference of the two totals over 1M is the cost of 3 requests (one of
//! each kind): it does not depend on the machine's load.

use std::hint::black_box;

use vqblk_daemon::qos::{Admission, Direction, SharedThrottle, ThrottleConfig};

fn throttle(c: ThrottleConfig) -> SharedThrottle {
    SharedThrottle::new(c.validate().expect("valid limits"))
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    // Limits far above the request rate (one request per simulated µs), so
    // every request goes: check and charge.
    let one = throttle(ThrottleConfig {
        iops_total: Some(10_000_000),
        ..Default::default()
    });
    let three = throttle(ThrottleConfig {
        iops_total: Some(10_000_000),
        bps_total: Some(100_000_000_000),
        bps_total_max: Some(200_000_000_000),
        bps_total_max_length: Some(2),
        ..Default::default()
    });
    // A bucket already far ahead: every request is told to wait.
    let held = throttle(ThrottleConfig {
        iops_total: Some(1),
        ..Default::default()
    });
    for _ in 0..100 {
        held.admit(Direction::Read, 4096, 0);
    }
    let mut went = 0u64;
    for k in 0..n {
        let now = black_box(1_000 * k);
        went += u64::from(one.admit(Direction::Read, black_box(4096), now) == Admission::Go);
        went += u64::from(three.admit(Direction::Write, black_box(4096), now) == Admission::Go);
        went += u64::from(held.admit(Direction::Read, black_box(4096), now) == Admission::Go);
    }
    println!("{went} of {} admitted", 3 * n);
}

//! The simulation model, and the modes compared on the reference traces.

use super::*;
use crate::poll::sim::{compare, traces, Expect};

#[test]
fn simulate_model() {
    // Classic: 0 -> sleep; 4000 -> 8 us misses; 8000 -> hit.
    let mut p = classic(32_768, 0, 0);
    let r = simulate(&mut p, &[8_000, 8_000, 8_000]);
    assert_eq!(r.sleeps, 2);
    assert_eq!(r.hits, 1);
    assert_eq!(r.poll_cpu_ns, 4_000 + 8_000);
    assert_eq!(r.wasted_cpu_ns, 4_000);
    assert_eq!(r.added_latency_ns, 2 * WAKEUP_LATENCY_NS);
    // A policy without sources gets one.
    let mut p = PollPolicy::new(PollMode::Classic, PollParams::default(), 0);
    let r = simulate(&mut p, &[1_000, 1_000]);
    assert_eq!(p.num_sources(), 1);
    assert_eq!((r.sleeps, r.hits), (1, 1));
    assert_eq!(p.poll_ns(), 4_000);
}

#[test]
fn simulation_comparison() {
    // The table itself: `cargo run --release -p vqblk-daemon --example poll_sim`.
    for tr in traces() {
        let c = compare(&tr.intervals);
        let best = c.oracle;
        let (busy, weighted, adaptive) = (c.busy, c.weighted, c.adaptive);
        let loss = |r: &SimResult| r.iops_loss_pct(&tr.intervals);
        match tr.expect {
            Expect::BusyHits => {
                assert!(
                    adaptive.hits * 100 >= busy.hits * 99,
                    "{}: {adaptive:?}",
                    tr.name
                );
                assert!(
                    adaptive.hits >= weighted.hits,
                    "{}: {adaptive:?} {weighted:?}",
                    tr.name
                );
            }
            Expect::LessWaste => assert!(
                adaptive.wasted_cpu_ns <= weighted.wasted_cpu_ns,
                "{}: adaptive {adaptive:?} weighted {weighted:?}",
                tr.name
            ),
            Expect::MoreIops => assert!(
                loss(&adaptive) + 1.0 < loss(&weighted),
                "{}: adaptive {adaptive:?} weighted {weighted:?}",
                tr.name
            ),
        }
        assert!(
            loss(&adaptive) - loss(&best) < 1.0,
            "{}: {adaptive:?} {best:?}",
            tr.name
        );
    }
}

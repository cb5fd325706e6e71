//! QEMU classic and weighted.

use super::*;

#[test]
fn classic_first_step_is_4000() {
    let mut p = classic(32_768, 0, 0);
    assert_eq!(p.poll_ns(), 0);
    p.update(20_000, &[0], false);
    assert_eq!(p.poll_ns(), POLL_NS_INITIAL);
    // Even with a custom grow factor.
    let mut p = classic(32_768, 10, 0);
    p.update(1, &[0], false);
    assert_eq!(p.poll_ns(), 4_000);
    // And clamped if max is below it.
    let mut p = classic(3_000, 0, 0);
    p.update(2_000, &[0], false);
    assert_eq!(p.poll_ns(), 3_000);
}

#[test]
fn classic_grows_by_two_then_clamps() {
    let mut p = classic(32_768, 0, 0);
    let mut seen = vec![];
    for _ in 0..7 {
        p.update(30_000, &[0], false);
        seen.push(p.poll_ns());
    }
    assert_eq!(seen, [4_000, 8_000, 16_000, 32_000, 32_000, 32_000, 32_000]);
    // 32000 >= 30000: the sweet spot, no change.
    let mut p = classic(32_768, 0, 0);
    for _ in 0..4 {
        p.update(32_700, &[0], false);
    }
    assert_eq!(p.poll_ns(), 32_000);
    p.update(32_700, &[0], false);
    assert_eq!(p.poll_ns(), 32_768, "clamped at max");
    p.update(32_700, &[0], false);
    assert_eq!(p.poll_ns(), 32_768);
}

#[test]
fn classic_custom_grow() {
    let mut p = classic(1_000_000, 3, 0);
    let mut seen = vec![];
    for _ in 0..6 {
        p.update(900_000, &[0], false);
        seen.push(p.poll_ns());
    }
    assert_eq!(seen, [4_000, 12_000, 36_000, 108_000, 324_000, 972_000]);
    p.update(900_000, &[0], false);
    assert_eq!(p.poll_ns(), 972_000, "sweet spot");
}

#[test]
fn classic_sweet_spot_keeps_window() {
    let mut p = classic(32_768, 0, 0);
    p.update(10_000, &[0], false); // 4000
    p.update(10_000, &[0], false); // 8000
    p.update(10_000, &[0], false); // 16000
    assert_eq!(p.poll_ns(), 16_000);
    for b in [0, 1, 15_999, 16_000] {
        p.update(b, &[0], true);
        assert_eq!(p.poll_ns(), 16_000);
    }
}

#[test]
fn classic_block_equal_to_max_neither_grows_nor_shrinks() {
    let mut p = classic(32_768, 0, 0);
    p.update(100, &[0], false);
    p.update(32_768, &[0], false);
    assert_eq!(p.poll_ns(), 4_000);
}

#[test]
fn classic_shrink_resets_to_zero_by_default() {
    let mut p = classic(32_768, 0, 0);
    for _ in 0..4 {
        p.update(30_000, &[0], false);
    }
    assert_eq!(p.poll_ns(), 32_000);
    p.update(32_769, &[0], false);
    assert_eq!(p.poll_ns(), 0);
    p.update(20_000, &[0], false);
    assert_eq!(p.poll_ns(), 4_000, "restarts at the first step");
}

#[test]
fn classic_custom_shrink_is_gradual() {
    let mut p = classic(32_768, 0, 4);
    for _ in 0..4 {
        p.update(30_000, &[0], false);
    }
    let mut seen = vec![];
    for _ in 0..4 {
        p.update(1_000_000, &[0], false);
        seen.push(p.poll_ns());
    }
    assert_eq!(seen, [8_000, 2_000, 500, 125]);
    // From a small window, growth doubles it again (no reset to 4000).
    p.update(10_000, &[0], false);
    assert_eq!(p.poll_ns(), 250);
}

#[test]
fn classic_no_event_no_change() {
    let mut p = classic(32_768, 0, 0);
    p.update(20_000, &[0], false);
    p.update(1_000_000, &[], false);
    assert_eq!(p.poll_ns(), 4_000);
}

#[test]
fn classic_multi_source_window_is_max() {
    let mut p = PollPolicy::new(PollMode::Classic, params(32_768, 0, 0, 0), 3);
    // Source 0 grows three times, source 1 once, source 2 never.
    p.update(20_000, &[0, 1], false);
    p.update(20_000, &[0], false);
    p.update(20_000, &[0], false);
    assert_eq!(p.source_poll_ns(0), Some(16_000));
    assert_eq!(p.source_poll_ns(1), Some(4_000));
    assert_eq!(p.source_poll_ns(2), Some(0));
    assert_eq!(p.source_poll_ns(3), None);
    assert_eq!(p.poll_ns(), 16_000);
    // A long wait seen by source 0 resets it; the window falls to source 1's.
    p.update(100_000, &[0], false);
    assert_eq!(p.poll_ns(), 4_000);
    // Events only adjust the sources that had them.
    p.update(10_000, &[2, 2, 9], false); // duplicate and out-of-range ignored
    assert_eq!(p.source_poll_ns(2), Some(4_000));
    assert_eq!(p.source_poll_ns(1), Some(4_000));
    assert_eq!(p.source_poll_ns(0), Some(0));
}

#[test]
fn classic_idle_source_stops_counting_after_7s() {
    let mut p = PollPolicy::new(PollMode::Classic, params(32_768, 0, 0, 0), 2);
    for _ in 0..4 {
        p.update(30_000, &[0], false);
    }
    p.update(2_000, &[1], true);
    assert_eq!(p.source_poll_ns(1), Some(4_000));
    assert_eq!(p.poll_ns(), 32_000);
    // A long timeout (no event: no window changes), then source 1 fires again
    // while source 0 stays idle; 7 s of waiting without an event drop it.
    p.update(POLL_IDLE_INTERVAL_NS - 4_000, &[], false);
    assert_eq!(p.poll_ns(), 32_000);
    p.update(1_000, &[1], true);
    assert_eq!(p.poll_ns(), 32_000, "idle for 7 s - 1 us");
    p.update(1_000, &[1], true);
    assert_eq!(p.source_poll_ns(0), Some(32_000), "window kept");
    assert_eq!(p.poll_ns(), 4_000, "but no longer polled for");
    // Its next event brings it back.
    p.update(1_000, &[0], true);
    assert_eq!(p.poll_ns(), 32_000);
}

#[test]
fn weighted_first_sample_taken_as_is_then_ewma() {
    let mut p = weighted(3, 0);
    p.update(10_000, &[0], false);
    assert_eq!(p.source_poll_ns(0), Some(10_000));
    assert_eq!(p.poll_ns(), 10_000, "grows straight to adj, no 4000 step");
    p.update(2_000, &[0], true);
    // 10000 - 10000/8 + 2000/8 = 10000 - 1250 + 250
    assert_eq!(p.source_poll_ns(0), Some(9_000));
    assert_eq!(p.poll_ns(), 10_000, "9000 is not below 10000/2: keep");
}

#[test]
fn weighted_grows_to_max_of_adj_and_double() {
    let mut p = weighted(1, 0);
    p.update(1_000, &[0], false);
    assert_eq!(p.poll_ns(), 1_000);
    p.update(1_400, &[0], false); // ns = 1000 - 500 + 700 = 1200 > 1000: max(1200, 2000)
    assert_eq!(p.source_poll_ns(0), Some(1_200));
    assert_eq!(p.poll_ns(), 2_000);
    p.update(12_000, &[0], false); // ns = 600 + 6000 = 6600: max(6600, 4000)
    assert_eq!(p.poll_ns(), 6_600);
    p.update(30_000, &[0], false); // ns = 3300 + 15000 = 18300: max(18300, 13200)
    assert_eq!(p.poll_ns(), 18_300);
    p.update(32_000, &[0], false); // ns = 9150 + 16000 = 25150: min(max, 36600)
    assert_eq!(p.poll_ns(), 32_768);
}

#[test]
fn weighted_custom_grow() {
    let mut p = PollPolicy::new(PollMode::Weighted, params(1_000_000, 4, 0, 1), 1);
    p.update(1_000, &[0], false);
    p.update(1_200, &[0], false); // ns 1100 > 1000 -> max(1100, 4000)
    assert_eq!(p.poll_ns(), 4_000);
}

#[test]
fn weighted_shrink_is_gradual_by_default() {
    let mut p = weighted(3, 0);
    p.update(20_000, &[0], false);
    assert_eq!(p.poll_ns(), 20_000);
    // An interval above max resets the source's average to 0: adj = 0 < 20000/2,
    // so the window halves (no reset to 0 as in classic).
    p.update(1_000_000, &[0], false);
    assert_eq!(p.source_poll_ns(0), Some(0));
    assert_eq!(p.poll_ns(), 10_000);
    p.update(1_000_000, &[0], false);
    // ns was 0, so the sample is taken as is, >= max, back to 0.
    assert_eq!(p.poll_ns(), 5_000);
    p.update(1_000_000, &[0], false);
    assert_eq!(p.poll_ns(), 2_500);
    // Custom shrink divisor.
    let mut p = weighted(3, 4);
    p.update(20_000, &[0], false);
    p.update(1_000_000, &[0], false);
    assert_eq!(p.poll_ns(), 5_000);
    // Shrink only when adj < window / shrink.
    let mut p = weighted(3, 0);
    p.update(20_000, &[0], false);
    p.update(1_000_000, &[0], false); // window 10000, ns 0
    p.update(6_000, &[0], false); // ns 6000 > 5000: not below window/2; not above window
    assert_eq!(p.poll_ns(), 10_000);
}

#[test]
fn weighted_idle_sources_age_out() {
    let mut p = PollPolicy::new(PollMode::Weighted, params(32_768, 0, 0, 3), 2);
    p.update(20_000, &[0], false);
    p.update(2_000, &[1], true);
    assert_eq!(
        p.source_poll_ns(0),
        Some(22_000),
        "idle source ages by block_ns"
    );
    assert_eq!(p.source_poll_ns(1), Some(2_000));
    assert_eq!(p.poll_ns(), 10_000, "adj = 2000 < 20000 / 2: halved");
    p.update(2_000, &[1], true);
    p.update(2_000, &[1], true);
    p.update(2_000, &[1], true);
    p.update(2_000, &[1], true);
    assert_eq!(p.source_poll_ns(0), Some(30_000));
    p.update(2_000, &[1], true);
    assert_eq!(p.source_poll_ns(0), Some(32_000));
    p.update(2_000, &[1], true);
    assert_eq!(p.source_poll_ns(0), Some(0), "reached max: aged out");
    // The window shrinks gradually to the busy source's average.
    for _ in 0..10 {
        p.update(2_000, &[1], true);
    }
    assert_eq!(p.poll_ns(), 2_500);
    // A source that never had an event does not age.
    let mut p = PollPolicy::new(PollMode::Weighted, params(32_768, 0, 0, 3), 2);
    p.update(5_000, &[0], false);
    assert_eq!(p.source_poll_ns(1), Some(0));
}

#[test]
fn weighted_no_event_ages_but_keeps_window() {
    let mut p = weighted(3, 0);
    p.update(10_000, &[0], false);
    p.update(10_000, &[], false);
    assert_eq!(p.source_poll_ns(0), Some(20_000));
    assert_eq!(p.poll_ns(), 10_000, "no event, no window adjustment");
}

#[test]
fn weighted_multi_source_adj_is_max_of_those_with_events() {
    let mut p = PollPolicy::new(PollMode::Weighted, params(32_768, 0, 0, 3), 3);
    p.update(4_000, &[0, 2], false);
    assert_eq!(p.poll_ns(), 4_000);
    p.update(24_000, &[1], false); // source 1: 24000; sources 0, 2 age to 28000
    assert_eq!(p.poll_ns(), 24_000);
    p.update(1_000, &[0], true); // source 0: 28000 - 3500 + 125 = 24625 > 24000
    assert_eq!(p.source_poll_ns(0), Some(24_625));
    assert_eq!(p.poll_ns(), 32_768);
}

/// Iterations until the window settles after the intervals drop from 30 us to
/// 4 us. It halves whenever the average falls below half of it (30000, 15000,
/// 7500) and stays at 7500: 4000 is not below 7500 / 2. The average falls at a
/// rate set by the weight.
fn weighted_settle(weight: u32) -> usize {
    let mut p = weighted(weight, 0);
    for _ in 0..50 {
        p.update(30_000, &[0], false);
    }
    assert_eq!(p.poll_ns(), 30_000);
    for i in 1..=1000 {
        p.update(4_000, &[0], true);
        if p.poll_ns() == 7_500 {
            for _ in 0..1000 {
                p.update(4_000, &[0], true);
            }
            assert_eq!(p.poll_ns(), 7_500, "steady");
            return i;
        }
    }
    panic!("weight {weight} never settled");
}

#[test]
fn weighted_weights_converge_at_different_speeds() {
    let n: Vec<usize> = (1..=4).map(weighted_settle).collect();
    // Average below 7500 after k steps: 4000 + 26000 (1 - 2^-w)^k < 7500.
    assert_eq!(n, [3, 7, 16, 32]);
    // Weight 0 means the default, 3.
    let mut a = weighted(0, 0);
    let mut b = weighted(3, 0);
    for x in [10_000, 3_000, 17_000, 40_000, 2_000, 9_000] {
        a.update(x, &[0], false);
        b.update(x, &[0], false);
        assert_eq!(a.poll_ns(), b.poll_ns());
    }
    eprintln!("weighted: iterations to settle from 30 us to 4 us, weights 1..4: {n:?}");
}

#[test]
fn weighted_ewma_step_by_weight() {
    for (w, expect) in [(1, 6_000), (2, 7_000), (3, 7_500), (4, 7_750)] {
        let mut p = weighted(w, 0);
        p.update(8_000, &[0], false);
        p.update(4_000, &[0], true);
        assert_eq!(p.source_poll_ns(0), Some(expect), "weight {w}");
    }
}

//! The adaptive window: learning, cover, gate and back-off.

use super::*;

/// Feeds `n` events of interval `t` through the simulation model.
fn feed(p: &mut PollPolicy, t: u64, n: usize) -> SimResult {
    simulate(p, &vec![t; n])
}

#[test]
fn adaptive_starts_closed_and_opens_on_short_intervals() {
    let mut p = adaptive();
    assert_eq!(p.poll_ns(), 0);
    // Only the first event, before any sample, is slept on: a wake-up would add
    // 190% to an 8 us cycle, far above the IOPS budget.
    let r = feed(&mut p, 8_000, 2);
    assert_eq!((r.sleeps, r.hits), (1, 1));
    assert!(p.poll_ns() >= 8_000, "{}", p.poll_ns());
    // The first sample alone (after a sleep: 35 us measured, 20 us corrected)
    // yields a cover of 3x the interval (mean + 4 x an initial deviation of half
    // the mean).
    let mut p = PollPolicy::new(PollMode::Adaptive, params(100_000, 0, 0, 0), 1);
    p.update(20_000 + WAKEUP_LATENCY_NS, &[0], false);
    assert_eq!(p.source_poll_ns(0), Some(60_000));
    // A wait shorter than 4/3 of the wake-up loses only 3/4 of it.
    let mut p = PollPolicy::new(PollMode::Adaptive, params(100_000, 0, 0, 0), 1);
    p.update(4_000 + WAKEUP_LATENCY_NS, &[0], false);
    assert_eq!(p.source_poll_ns(0), Some(3 * 4_750));
    let mut p = adaptive();
    let r = feed(&mut p, 8_000, 100);
    assert_eq!(r.sleeps, 1);
}

#[test]
fn adaptive_steady_short_intervals_are_covered_with_margin() {
    let mut p = adaptive();
    feed(&mut p, 8_000, 200);
    let w = p.poll_ns();
    assert!((8_000..=12_500).contains(&w), "window {w}");
    assert_eq!(w, p.source_poll_ns(0).unwrap());
    let r = feed(&mut p, 8_000, 1000);
    assert_eq!(r.hits, 1000);
    assert_eq!(r.poll_cpu_ns, 8_000_000);
}

#[test]
fn adaptive_long_intervals_give_zero_window() {
    let mut p = adaptive();
    let r = feed(&mut p, 500_000, 100);
    assert_eq!(p.poll_ns(), 0);
    assert_eq!(r.poll_cpu_ns, 0, "never polled for intervals above max");
    // After a short phase, a long phase closes the window again.
    feed(&mut p, 8_000, 100);
    assert!(p.poll_ns() > 0);
    let r = feed(&mut p, 500_000, 100);
    assert_eq!(p.poll_ns(), 0);
    assert!(r.poll_cpu_ns <= 5 * 12_000, "wasted {}", r.poll_cpu_ns);
}

#[test]
fn adaptive_jittery_and_bimodal_windows_are_bounded() {
    let mut rng = Rng(7);
    let mut p = adaptive();
    for _ in 0..2000 {
        let t = rng.range(4_000, 20_000);
        simulate(&mut p, &[t]);
        assert!(p.poll_ns() <= 32_768);
    }
    let w = p.poll_ns();
    assert!((16_000..=32_768).contains(&w), "jitter 4-20 us: window {w}");

    // Bimodal within range: covers the upper mode, capped by max.
    let mut p = adaptive();
    for i in 0..2000 {
        simulate(&mut p, &[if i % 2 == 0 { 4_000 } else { 24_000 }]);
        assert!(p.poll_ns() <= 32_768);
    }
    assert!(p.poll_ns() >= 24_000, "{}", p.poll_ns());

    // Bimodal across max: the window covers the short mode only.
    let mut p = adaptive();
    for i in 0..2000 {
        let t = if rng.chance(70) {
            rng.range(6_000, 10_000)
        } else {
            300_000
        };
        simulate(&mut p, &[t]);
        if i > 50 {
            assert!(p.poll_ns() <= 20_000, "{}", p.poll_ns());
        }
    }
}

#[test]
fn intervals_shorter_than_the_shortest_window_are_polled_for() {
    // A polling driver at QD1 on a fast host: its next request a few
    // hundred nanoseconds after each answer. The cover of such intervals is
    // below ADAPTIVE_MIN_POLL_NS; the window is that minimum, not 0 (which
    // slept before every request: a kick and a wake-up each, half of busy
    // polling's IOPS).
    let mut p = adaptive();
    let r = feed(&mut p, 400, 2_000);
    assert_eq!(p.poll_ns(), ADAPTIVE_MIN_POLL_NS);
    assert!(r.hits >= 1_990, "{r:?}");
}

#[test]
fn adaptive_backs_off_after_consecutive_misses_and_rearms() {
    let mut p = adaptive();
    feed(&mut p, 8_000, 200);
    let full = p.poll_ns();
    assert!(full >= 8_000);
    // Polling misses: the window expired, the event came after a sleep.
    let mut windows = vec![];
    for _ in 0..6 {
        let w = p.poll_ns();
        p.update(200_000 + w, &[0], false);
        windows.push(p.poll_ns());
    }
    // At a hit rate of ~1, three misses in a row are a surprise (odds < 1/64):
    // the third halves the window, and each further miss halves it again.
    assert_eq!(&windows[..2], &[full, full], "{windows:?}");
    assert_eq!(windows[2], full / 2, "{windows:?}");
    assert_eq!(windows[3], full / 4, "{windows:?}");
    assert_eq!(windows[4], full / 8, "{windows:?}");
    assert_eq!(
        windows[5], 0,
        "below {ADAPTIVE_MIN_POLL_NS} ns: not worth polling"
    );
    // Timeouts with no event count as misses too.
    p.update(1_000_000, &[], false);
    assert_eq!(p.poll_ns(), 0);
    // A short interval (caught after a sleep) re-arms at once; two open the gate.
    p.update(8_000 + WAKEUP_LATENCY_NS, &[0], false);
    p.update(8_000 + WAKEUP_LATENCY_NS, &[0], false);
    assert_eq!(p.poll_ns(), full);
}

#[test]
fn adaptive_gate_closes_when_hits_are_rare() {
    // 10% short intervals: polling would waste its window 9 times in 10.
    let mut rng = Rng(3);
    let trace: Vec<u64> = (0..5000)
        .map(|_| if rng.chance(10) { 8_000 } else { 400_000 })
        .collect();
    let mut p = adaptive();
    let r = simulate(&mut p, &trace);
    let mut w = weighted(3, 0);
    let rw = simulate(&mut w, &trace);
    assert!(
        r.poll_cpu_ns * 3 < rw.poll_cpu_ns,
        "adaptive {r:?} weighted {rw:?}"
    );
}

#[test]
fn adaptive_idle_source_does_not_hold_the_window() {
    let mut p = PollPolicy::new(PollMode::Adaptive, PollParams::default(), 2);
    for _ in 0..100 {
        p.update(25_000, &[0], true);
    }
    for _ in 0..100 {
        p.update(3_000, &[1], true);
    }
    // Source 0 has been quiet for 300 us of waiting: only source 1 counts.
    assert!(p.source_poll_ns(0).unwrap() >= 25_000);
    let w = p.poll_ns();
    assert!((3_000..=5_000).contains(&w), "{w}");
    // Both active: the window is the larger cover.
    p.update(3_000, &[0, 1], true);
    assert_eq!(p.poll_ns(), 32_768);
}

#[test]
fn adaptive_wakeup_correction_recovers_intervals_near_max() {
    // 25 us intervals look like 40 us (> max) after a sleep; the correction
    // recognizes them as pollable and the policy ends up catching them.
    let mut p = adaptive();
    feed(&mut p, 25_000, 50);
    let r = feed(&mut p, 25_000, 100);
    assert_eq!(r.hits, 100);
}

#[test]
fn adaptive_params_are_used() {
    let a = AdaptiveParams {
        margin_pct: 100,
        miss_limit: 5,
        ..AdaptiveParams::default()
    };
    let mut p = adaptive().with_adaptive_params(a);
    assert_eq!(p.adaptive_params(), a);
    feed(&mut p, 8_000, 200);
    let full = p.poll_ns();
    assert!((15_000..=16_500).contains(&full), "margin 100%: {full}");
    for _ in 0..4 {
        p.update(full + 200_000, &[0], false);
        assert_eq!(
            p.poll_ns(),
            full,
            "miss_limit 5: no back-off before the fifth miss"
        );
    }
    p.update(full + 200_000, &[0], false);
    assert_eq!(p.poll_ns(), full / 2);
    // A larger wake-up price makes polling pay at lower hit rates.
    let cheap = AdaptiveParams {
        wakeup_ns: 1_000,
        latency_budget_pct: 100,
        ..AdaptiveParams::default()
    };
    let dear = AdaptiveParams {
        wakeup_ns: 50_000,
        latency_budget_pct: 100,
        ..AdaptiveParams::default()
    };
    let trace: Vec<u64> = (0..400)
        .map(|i| if i % 2 == 0 { 8_000 } else { 300_000 })
        .collect();
    let mut p = adaptive().with_adaptive_params(cheap);
    let r_cheap = simulate(&mut p, &trace);
    let mut p = adaptive().with_adaptive_params(dear);
    let r_dear = simulate(&mut p, &trace);
    assert!(
        r_dear.hits > 150 && r_cheap.hits < 20,
        "{r_cheap:?} {r_dear:?}"
    );
}

#[test]
fn adaptive_run_of_misses_is_judged_against_the_hit_rate() {
    // Intervals 20-60 us: about 30% are pollable. Runs of 3-5 misses are normal
    // there and must not shrink the window below the pollable ones.
    let mut rng = Rng(11);
    let mut p = adaptive();
    for _ in 0..2000 {
        let t = rng.range(20_000, 60_000);
        simulate(&mut p, &[t]);
    }
    let full = p.target_ns();
    assert_eq!(full, 32_768);
    for _ in 0..5 {
        p.update(60_000 + WAKEUP_LATENCY_NS, &[0], false);
    }
    assert_eq!(
        p.poll_ns(),
        full,
        "5 misses at a ~30% hit rate: not a surprise"
    );
}

/// 5000 intervals of 20-60 us, straddling `poll-max-ns`, and how many of them
/// a window capped there can catch.
fn straddling_trace() -> (Vec<u64>, u64) {
    let mut rng = Rng(5);
    let trace: Vec<u64> = (0..5000).map(|_| rng.range(20_000, 60_000)).collect();
    let pollable = trace.iter().filter(|&&t| t <= 32_768).count() as u64;
    (trace, pollable)
}

#[test]
fn adaptive_latency_budget_keeps_polling_when_sleeping_costs_iops() {
    // 30% of intervals pollable: polling wastes more CPU than the latency it
    // saves (ski rental says sleep), but sleeping would cost ~11% IOPS.
    let (trace, pollable) = straddling_trace();
    let mut p = adaptive();
    let with_budget = simulate(&mut p, &trace);
    let no_budget = AdaptiveParams {
        latency_budget_pct: 100,
        ..AdaptiveParams::default()
    };
    let mut p = adaptive().with_adaptive_params(no_budget);
    let without = simulate(&mut p, &trace);
    assert!(
        with_budget.hits * 100 >= pollable * 95,
        "{with_budget:?} of {pollable}"
    );
    assert!(
        without.hits * 100 <= pollable * 20,
        "{without:?} of {pollable}"
    );
    assert!(without.wasted_cpu_ns * 5 < with_budget.wasted_cpu_ns);
}

/// Runs `trace` through `p` as [`simulate`] does, the backend holding `depth`
/// requests at each wait.
fn simulate_at_depth(p: &mut PollPolicy, trace: &[u64], depth: usize) -> SimResult {
    simulate_batched(p, trace, depth, 1)
}

/// As [`simulate_at_depth`], each event finishing `batch` requests.
fn simulate_batched(p: &mut PollPolicy, trace: &[u64], depth: usize, batch: usize) -> SimResult {
    simulate_events(
        p,
        trace.iter().map(|&t| SimEvent {
            interval_ns: t,
            source: 0,
            in_flight: depth,
            finished: batch,
            answered: None,
        }),
    )
}

#[test]
fn adaptive_latency_budget_is_a_share_of_the_round_trip_not_of_one_interval() {
    // The straddling trace. At depth 1 the wake-ups polling would avoid (30%
    // of events, 15 us each) add ~11% to the event interval: the IOPS budget
    // keeps polling. With 16 requests in flight (an RBD image at iodepth 16:
    // completions every 20-60 us of a ~640 us round trip) they add ~0.7% to a
    // request's round trip, and the CPU that polling wastes is not paid for.
    let (trace, pollable) = straddling_trace();
    let mut p = adaptive();
    let shallow = simulate_at_depth(&mut p, &trace, 1);
    let mut p = adaptive();
    let inline = simulate_at_depth(&mut p, &trace, 0);
    assert_eq!(
        (inline.hits, inline.wasted_cpu_ns),
        (shallow.hits, shallow.wasted_cpu_ns),
        "a backend completing inline is weighed as depth 1"
    );
    let mut p = adaptive();
    let deep = simulate_at_depth(&mut p, &trace, 16);
    assert!(shallow.hits * 100 >= pollable * 95, "{shallow:?}");
    assert!(deep.hits * 100 <= pollable * 20, "{deep:?} of {pollable}");
    assert!(
        deep.wasted_cpu_ns * 5 < shallow.wasted_cpu_ns,
        "{deep:?} vs {shallow:?}"
    );
}

#[test]
fn adaptive_round_trip_counts_the_requests_each_event_finishes() {
    // The straddling trace, 16 requests in flight, but every event
    // finishes 8 of them (a disk that completes in batches): a round trip is
    // 2 event intervals, not 16, and the wake-ups that polling avoids add
    // ~6% to it, above the IOPS budget. Polling goes on as at depth 1.
    let (trace, pollable) = straddling_trace();
    let mut p = adaptive();
    let batched = simulate_batched(&mut p, &trace, 16, 8);
    assert!(
        batched.hits * 100 >= pollable * 95,
        "{batched:?} of {pollable}"
    );
    // One request per event is the depth as it is.
    let mut p = adaptive();
    let deep = simulate_batched(&mut p, &trace, 16, 1);
    assert!(deep.hits * 100 <= pollable * 20, "{deep:?} of {pollable}");
}

#[test]
fn adaptive_break_even_weighs_a_saved_wake_up_against_the_round_trip() {
    // 60% of events after 6-10 us, 40% after 300 us; the IOPS budget off, so
    // only the ski-rental rule opens the gate. At depth 1 the wake-ups saved
    // (0.6 x 15 us) outweigh the misses' waste (0.4 x ~12 us); with 16
    // requests in flight a saved wake-up is 1/16 as much of a round trip.
    let mut rng = Rng(11);
    let trace: Vec<u64> = (0..5000)
        .map(|_| {
            if rng.range(0, 9) < 6 {
                rng.range(6_000, 10_000)
            } else {
                300_000
            }
        })
        .collect();
    let cpu_first = AdaptiveParams {
        latency_budget_pct: 100,
        ..AdaptiveParams::default()
    };
    let mut p = adaptive().with_adaptive_params(cpu_first);
    let shallow = simulate_at_depth(&mut p, &trace, 1);
    let mut p = adaptive().with_adaptive_params(cpu_first);
    let deep = simulate_at_depth(&mut p, &trace, 16);
    let pollable = trace.iter().filter(|&&t| t <= 32_768).count() as u64;
    assert!(
        shallow.hits * 100 >= pollable * 80,
        "{shallow:?} of {pollable}"
    );
    assert!(
        deep.wasted_cpu_ns * 3 < shallow.wasted_cpu_ns,
        "{deep:?} vs {shallow:?}"
    );
}

#[test]
fn adaptive_forgets_a_source_whose_events_all_come_late_now() {
    // An RBD image at iodepth 16 (completions every ~20 us, source 0), then at
    // iodepth 1: completions every 300 us, each followed by the driver's kick
    // (source 1) 25 us later. The completions' old cover must not keep the
    // thread polling 32 us in vain before every completion.
    let mut p = PollPolicy::new(PollMode::Adaptive, PollParams::default(), 2);
    for _ in 0..500 {
        p.observe_in_flight(16);
        p.update(20_000, &[0], true);
    }
    assert!(p.source_poll_ns(0).unwrap() > 0);
    let alternating = (0..400).map(|i| {
        let completion = i % 2 == 0;
        SimEvent {
            interval_ns: if completion { 300_000 } else { 25_000 },
            source: usize::from(!completion),
            in_flight: usize::from(completion),
            finished: usize::from(completion),
            answered: completion.then_some(1),
        }
    });
    let wasted = simulate_events(&mut p, alternating).wasted_cpu_ns;
    assert_eq!(
        p.source_poll_ns(0),
        Some(0),
        "the completions' cover is forgotten"
    );
    // It polls in vain before the first 32 completions only (~1 ms); without
    // forgetting it did before each of the 200 (~6.4 ms).
    assert!(wasted < 1_500_000, "wasted {wasted} ns polling");
}

#[test]
fn adaptive_expects_the_guest_it_just_answered() {
    // A virtual disk at iodepth 16 with a polling driver: a batch of 7
    // completions (source 0) every ~175 us, each answered at once by the
    // driver's kick (source 1) 3 us after the thread handed them back. The
    // kick's queue was quiet for the whole device wait, so by its own events
    // it looks idle exactly when its next request is due; the thread slept
    // before every kick and paid a wake-up on top of each batch.
    let batches = |answered: bool| {
        (0..400).map(move |i| {
            let completion = i % 2 == 0;
            SimEvent {
                interval_ns: if completion { 175_000 } else { 3_000 },
                source: usize::from(!completion),
                in_flight: if completion { 16 } else { 9 },
                finished: if completion { 7 } else { 0 },
                answered: (completion && answered).then_some(1),
            }
        })
    };
    let mut p = PollPolicy::new(PollMode::Adaptive, PollParams::default(), 2);
    let r = simulate_events(&mut p, batches(true));
    // The 200 completions are slept on; nearly all 200 kicks are caught.
    assert!(r.hits >= 190, "{r:?}");
    // Polled in vain only for a kick's cover before each completion.
    assert!(r.wasted_cpu_ns <= 200 * 10_000, "{r:?}");
    let mut p = PollPolicy::new(PollMode::Adaptive, PollParams::default(), 2);
    let unanswered = simulate_events(&mut p, batches(false));
    assert!(unanswered.hits <= 10, "{unanswered:?}");
}

/// Replays `trace` (source 0, nothing in flight) on a host where coming out of a
/// sleep takes `wakeup_ns`: as [`simulate`], with the host's own wake-up instead
/// of [`WAKEUP_LATENCY_NS`]. Returns the hits and sleeps.
fn replay_on_host(p: &mut PollPolicy, trace: &[u64], wakeup_ns: u64) -> (usize, usize) {
    let (mut hits, mut sleeps) = (0, 0);
    for &t in trace {
        if t <= p.poll_ns() {
            hits += 1;
            p.update(t, &[0], true);
        } else {
            sleeps += 1;
            p.update(t + wakeup_ns, &[0], false);
        }
    }
    (hits, sleeps)
}

#[test]
fn adaptive_weighs_the_wake_up_this_host_measured() {
    // A loaded VM: a timed nap ends 60 us late, and so does every sleep.
    let host = |max: u64| {
        let mut p = PollPolicy::new(PollMode::Adaptive, params(max, 0, 0, 0), 1);
        p.set_nap_late(60_000, 5_000);
        p
    };
    let p = host(DEFAULT_POLL_MAX_NS);
    assert_eq!(p.wakeup_ns(), 60_000);
    assert_eq!(p.spin_max_ns(), 120_000);
    assert_eq!(adaptive().wakeup_ns(), WAKEUP_LATENCY_NS, "until measured");
    assert_eq!(adaptive().spin_max_ns(), DEFAULT_POLL_MAX_NS);

    // A blocking client at queue depth 1: its next request comes 20 us after
    // the completion. Each sleep makes that wait 80 us; taking 15 us off it
    // left 65 us, above poll-max-ns, so the interval was never learnt and the
    // thread slept before every request.
    let mut p = host(DEFAULT_POLL_MAX_NS);
    let (hits, _) = replay_on_host(&mut p, &[20_000; 500], 60_000);
    assert!(hits >= 490, "{hits} of 500 caught by polling");

    // 45 us gaps: longer than QEMU's default bound, shorter than a wake-up
    // here. Spinning through them is what keeps the IOPS.
    let mut p = host(DEFAULT_POLL_MAX_NS);
    let (hits, _) = replay_on_host(&mut p, &[45_000; 500], 60_000);
    assert!(hits >= 490, "{hits} of 500 caught by polling");

    // An operator's own poll-max-ns bounds the spin as given.
    let mut p = host(40_000);
    assert_eq!(p.spin_max_ns(), 40_000);
    let (hits, _) = replay_on_host(&mut p, &[45_000; 500], 60_000);
    assert_eq!(hits, 0);
    assert!(p.poll_ns() <= 40_000);
}

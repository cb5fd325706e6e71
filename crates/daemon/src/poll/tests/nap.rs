//! Adaptive naps: when to nap and how late a nap ends.

use super::*;
use crate::poll::nap::NAP_SAMPLE_CAP_NS;

/// An adaptive policy over `sources` whose naps were measured `late` ns late,
/// +- `dev`, at 7 us of CPU each.
fn calibrated(sources: usize, late: u64, dev: u64) -> PollPolicy {
    let mut p = PollPolicy::new(PollMode::Adaptive, PollParams::default(), sources);
    p.set_nap_late(late, dev);
    p.set_nap_cpu_ns(7_000);
    p
}

/// `n` events of `source`, from 1 us on, their gaps alternately `a` and `b`
/// ns (a mean of `(a + b) / 2`, a deviation of `|b - a| / 2`); the last one's
/// time.
fn alternating(p: &mut PollPolicy, source: usize, a: u64, b: u64, n: u64) -> u64 {
    let mut t = 1_000;
    for k in 0..n {
        t += if k % 2 == 0 { a } else { b };
        p.observe_events_at(t, &[source]);
    }
    t
}

#[test]
fn adaptive_naps_only_when_events_are_predictably_late() {
    // Measured on the host: naps end 6 us late, +- 0.5, and cost 7 us of CPU.
    // A source with an event every `gap` ns, the last one at `t`.
    let rhythm = |p: &mut PollPolicy, source: usize, start: u64, gap: u64, n: u64| {
        for k in 0..n {
            p.observe_events_at(start + k * gap, &[source]);
        }
        start + (n - 1) * gap
    };
    // Steady 30 us gaps (a device's latency), 2 us after the last event: nap
    // until one overshoot (7 us) before the next: 30 - 2 - 7 = 21 us.
    let mut p = calibrated(1, 6_000, 500);
    let t = rhythm(&mut p, 0, 1_000, 30_000, 200);
    let nap = p.nap_at(t + 2_000);
    assert!((20_000..=21_500).contains(&nap), "nap {nap}");
    // Past the predicted time: no nap.
    assert_eq!(p.nap_at(t + 25_000), 0);
    // The spin after a nap covers the timer's lateness and the spread.
    assert!(
        (7_000..=12_000).contains(&p.nap_spin_ns()),
        "{}",
        p.nap_spin_ns()
    );
    // Gaps beyond poll-max-ns (an 80 us device): the nap reaches past it,
    // which the window never does.
    let mut p = calibrated(1, 6_000, 500);
    let t = rhythm(&mut p, 0, 1_000, 80_000, 200);
    let nap = p.nap_at(t);
    assert!((72_000..=73_500).contains(&nap), "nap {nap}");
    assert!(p.nap_spin_ns() <= PollParams::default().poll_max_ns);
    // Steady 10 us gaps: a 2-3 us nap would save too little for the risk.
    let mut p = calibrated(1, 6_000, 500);
    let t = rhythm(&mut p, 0, 1_000, 10_000, 200);
    assert_eq!(p.nap_at(t), 0);
    // Two sources: the earliest expected event bounds the nap. Completions
    // every 60 us; kicks every 60 us, 10 us after each completion.
    let mut p = calibrated(2, 6_000, 500);
    for k in 0..99u64 {
        p.observe_events_at(1_000 + k * 60_000, &[0]);
        p.observe_events_at(11_000 + k * 60_000, &[1]);
    }
    let last_completion = 1_000 + 99 * 60_000;
    p.observe_events_at(last_completion, &[0]);
    // Right after a completion the kick is 10 us away: no nap.
    assert_eq!(p.nap_at(last_completion + 1_000), 0);
    // Right after the kick, the next completion is ~50 us away.
    p.observe_events_at(last_completion + 10_000, &[1]);
    let nap = p.nap_at(last_completion + 11_000);
    assert!((41_000..=43_000).contains(&nap), "nap {nap}");
    // A source active but without an estimate yet: no nap.
    let mut p = calibrated(2, 6_000, 500);
    let t = rhythm(&mut p, 0, 1_000, 30_000, 50);
    p.observe_events_at(t + 1_000, &[1]);
    assert_eq!(p.nap_at(t + 2_000), 0);
    // A source silent for longer than the horizon no longer counts, and a
    // gap that long is not learnt.
    let mut p = calibrated(2, 6_000, 500);
    let t = rhythm(&mut p, 0, 1_000, 30_000, 50);
    let t2 = rhythm(&mut p, 1, t + 10 * NAP_HORIZON_NS, 40_000, 50);
    assert!(p.nap_at(t2 + 1_000) > 20_000);
    // ...but a nap costing as much CPU as spinning through it is not taken.
    p.set_nap_cpu_ns(60_000);
    assert_eq!(p.nap_at(t2 + 1_000), 0);
    // Other modes, and poll-max-ns=0, never nap.
    for mut p in never_napping() {
        let t = rhythm(&mut p, 0, 1_000, 30_000, 50);
        assert_eq!(p.nap_at(t), 0, "{:?}", p.mode());
    }
}

#[test]
fn nap_lateness_is_learnt_from_measured_naps() {
    let mut p = PollPolicy::new(PollMode::Adaptive, PollParams::default(), 1);
    // Unmeasured: the configured wake-up latency stands in.
    assert_eq!(p.nap_late_ns(), AdaptiveParams::default().wakeup_ns);
    assert_eq!(p.nap_cpu_ns(), DEFAULT_NAP_CPU_NS);
    // The first sample sets the mean, with half of it as deviation.
    p.observe_nap(10_000, 16_000);
    assert_eq!(p.nap_late_ns(), 6_000 + 2 * 3_000);
    // Steady samples: the deviation decays, the mean stays.
    for _ in 0..100 {
        p.observe_nap(10_000, 16_000);
    }
    assert!(
        (6_000..=6_100).contains(&p.nap_late_ns()),
        "{}",
        p.nap_late_ns()
    );
    // The host gets slower: the estimate follows.
    for _ in 0..100 {
        p.observe_nap(10_000, 30_000);
    }
    assert!(
        (20_000..=20_500).contains(&p.nap_late_ns()),
        "{}",
        p.nap_late_ns()
    );
    // A calibration sets both; samples then refine them.
    p.set_nap_late(7_000, 1_000);
    assert_eq!(p.nap_late_ns(), 9_000);
    p.observe_nap(10_000, 17_000);
    assert!(p.nap_late_ns() < 9_000);
    // One preempted nap moves the estimate by a fraction of itself.
    let before = p.nap_late_ns();
    p.observe_nap(10_000, 900_000);
    assert!(
        p.nap_late_ns() < 3 * before,
        "{} -> {}",
        before,
        p.nap_late_ns()
    );
    // A preempted first nap counts as at most 1 ms late; an early one as 1 ns.
    let mut q = PollPolicy::new(PollMode::Adaptive, PollParams::default(), 1);
    q.observe_nap(10_000, 5_000_000_000);
    assert_eq!(q.nap_late_ns(), 2 * NAP_SAMPLE_CAP_NS);
    let mut q = PollPolicy::new(PollMode::Adaptive, PollParams::default(), 1);
    q.observe_nap(10_000, 9_000);
    assert_eq!(q.nap_late_ns(), 1);
}

/// A calibration that came out high (the host busy while the thread
/// started) is measured again: a thread that sleeps until its events takes
/// a timed nap first now and then, and the naps that end by their timer
/// bring the estimate down to what the host does now.
#[test]
fn a_high_calibration_is_measured_again_by_sampled_naps() {
    let mut p = calibrated(1, 96_000, 10_000);
    let mut sleeps = 0;
    let mut sampled = 0;
    while p.nap_late_ns() > 20_000 {
        assert!(
            sleeps < 100 * u64::from(NAP_SAMPLE_EVERY),
            "{}",
            p.nap_late_ns()
        );
        sleeps += 1;
        match p.sample_nap() {
            0 => {}
            n => {
                assert_eq!(n, NAP_SAMPLE_NS);
                sampled += 1;
                // Every other sample is ended by an event: tried again at
                // the next sleep.
                if sampled % 2 == 0 {
                    p.observe_nap(n, n + 8_000);
                }
            }
        }
    }
    // One timed nap in NAP_SAMPLE_EVERY sleeps, plus the tries ended early.
    assert!(
        sampled <= 2 * sleeps / u64::from(NAP_SAMPLE_EVERY) + 2,
        "{sampled} in {sleeps}"
    );
    assert!(sleeps < 40 * u64::from(NAP_SAMPLE_EVERY), "{sleeps}");
    // Naps that tell their lateness anyway (the policy's own) leave no need.
    for _ in 0..10 * NAP_SAMPLE_EVERY {
        p.observe_nap(10_000, 18_000);
        assert_eq!(p.sample_nap(), 0);
    }
    // Other modes never nap, nor does poll-max-ns=0.
    for mut q in never_napping() {
        assert!(
            (0..2 * NAP_SAMPLE_EVERY).all(|_| q.sample_nap() == 0),
            "{:?}",
            q.mode()
        );
    }
}

/// A high calibration is measured again in a thread that never sleeps
/// either: with naps priced at 240 us its spin (two wake-ups long) outlasts
/// every gap of a 50 us device, so no sleep ever comes to sample a nap.
/// Once in [`NAP_SAMPLE_SPIN_NS`] of spinning without a measured nap, a
/// timed nap comes before the spin instead.
#[test]
fn a_high_calibration_is_measured_again_in_a_thread_that_spins() {
    let mut p = calibrated(2, 240_000, 20_000);
    // QD1 on a 50 us device: a spin that no nap precedes every 35 us, in
    // turn after a pass that answered the guest (its next request comes
    // within microseconds and would end a nap: no sample there) and after
    // one that submitted that request (the device answers in 50 us).
    let mut now = 1_000_000u64;
    let start = now;
    let mut sampled = 0u64;
    let mut answered = false;
    while p.nap_late_ns() > 20_000 {
        assert!(now - start < 60_000_000_000, "{}", p.nap_late_ns());
        now += 35_000;
        answered = !answered;
        p.observe_answered(answered.then_some(1));
        match p.sample_nap_in_spin(now) {
            0 => {}
            n => {
                assert!(!answered, "a sample after an answer");
                assert_eq!(n, NAP_SAMPLE_NS);
                sampled += 1;
                // Ended by its timer, 8 us late (what the host does now).
                p.observe_nap(n, n + 8_000);
            }
        }
    }
    p.observe_answered([]);
    // A sample far below the estimate is followed by another at the next
    // spin, so the estimate comes down within two stretches of spinning,
    // with a timed nap in about every other pass meanwhile.
    assert!(
        now - start <= 2 * NAP_SAMPLE_SPIN_NS + 70_000,
        "{} ns",
        now - start
    );
    assert!(sampled <= 100, "{sampled}");
    // Where the estimate is right, one timed nap per stretch of spinning.
    let mut confirmed = 0;
    let t = now;
    for k in 1..=1000u64 {
        if p.sample_nap_in_spin(t + k * 1_000_000) > 0 {
            confirmed += 1;
            p.observe_nap(NAP_SAMPLE_NS, NAP_SAMPLE_NS + 10_000);
        }
    }
    assert!(
        confirmed <= 1_000_000_000 / NAP_SAMPLE_SPIN_NS + 1,
        "{confirmed}"
    );
    // A sample ended by an event (not measured) is tried again after the
    // next stretch, not at the next spin: a queue whose requests keep
    // ending the naps does not pay a nap per request.
    let t = t + 2_000_000_000;
    assert_eq!(p.sample_nap_in_spin(t), NAP_SAMPLE_NS);
    assert_eq!(p.sample_nap_in_spin(t + 70_000), 0);
    assert_eq!(p.sample_nap_in_spin(t + NAP_SAMPLE_SPIN_NS - 1), 0);
    let now = t;
    // A nap that tells its lateness (the policy's own) starts the stretch
    // again, half-way through one.
    let half = NAP_SAMPLE_SPIN_NS / 2;
    assert_eq!(p.sample_nap_in_spin(now + half), 0);
    p.observe_nap(10_000, 20_000);
    let restart = now + half + 1_000;
    assert_eq!(p.sample_nap_in_spin(restart), 0);
    assert_eq!(p.sample_nap_in_spin(now + NAP_SAMPLE_SPIN_NS + 1_000), 0);
    assert_eq!(p.sample_nap_in_spin(restart + NAP_SAMPLE_SPIN_NS - 1), 0);
    assert_eq!(
        p.sample_nap_in_spin(restart + NAP_SAMPLE_SPIN_NS),
        NAP_SAMPLE_NS
    );
    // A stretch that ends after an answer waits for the next spin that
    // does not follow one.
    let t = t + 3 * NAP_SAMPLE_SPIN_NS;
    p.observe_answered([1]);
    assert_eq!(p.sample_nap_in_spin(t), 0);
    p.observe_answered([]);
    assert_eq!(p.sample_nap_in_spin(t + 35_000), NAP_SAMPLE_NS);
    // Other modes never nap, nor does poll-max-ns=0.
    for mut q in never_napping() {
        assert!(
            (1..1000u64).all(|k| q.sample_nap_in_spin(k * NAP_SAMPLE_SPIN_NS) == 0),
            "{:?}",
            q.mode()
        );
    }
}

#[test]
fn no_nap_for_events_too_scattered_for_the_spin_after_it() {
    // Naps end 60 us late, +- 5 (this VM's wake-up while loaded).
    // RBD-like completions: 300 us apart, +- 80 us (a deterministic spread).
    let scattered =
        |p: &mut PollPolicy, source: usize, n: u64| alternating(p, source, 220_000, 380_000, n);
    let mut p = calibrated(1, 50_000, 5_000);
    let t = scattered(&mut p, DEVICE_SOURCE, 200);
    // 4 deviations (~320 us) do not fit in poll-max-ns, and the spin of the
    // device's long waits (60 + 3 x 80 us) would take more than three
    // quarters of the gap: no nap.
    assert_eq!(p.nap_at(t + 1_000), 0);
    // The same rhythm on a queue: no nap either, however cheap a wake-up.
    let mut p = calibrated(2, 6_000, 500);
    let t = scattered(&mut p, DEVICE_SOURCE + 1, 200);
    assert_eq!(p.nap_at(t + 1_000), 0);
    // A steady source next to a scattered queue is still napped for, and the
    // spin after that nap is sized by the steady source, not stretched by
    // the other.
    let mut p = calibrated(3, 6_000, 500);
    let t = scattered(&mut p, 2, 200);
    // Source 1: every 60 us, steadily, up to just after source 2's last event.
    let mut last = 0;
    for k in 0..200u64 {
        last = t - 200 * 60_000 + 2_000 + k * 60_000;
        p.observe_events_at(last, &[1]);
    }
    let nap = p.nap_at(last + 1_000);
    assert!((50_000..=53_500).contains(&nap), "nap {nap}");
    assert!(p.nap_spin_ns() < 20_000, "spin {}", p.nap_spin_ns());
}

#[test]
fn the_device_is_napped_for_through_a_long_scattered_wait() {
    // A disk behind a virtual controller at queue depth 16: a batch of
    // completions every 350 us, +- 60 us (a deterministic spread).
    let batches = |p: &mut PollPolicy, source: usize| alternating(p, source, 290_000, 410_000, 200);
    let mut p = calibrated(2, 6_000, 500);
    let t = batches(&mut p, DEVICE_SOURCE);
    // 4 deviations do not fit in poll-max-ns, 2 do in half the gap: nap
    // until one overshoot (7 us) before 350 - 2 x 60 = 230 us.
    let nap = p.nap_at(t + 10_000);
    assert!((205_000..=216_000).contains(&nap), "nap {nap}");
    // Then spin for the overshoot and 3 deviations, past poll-max-ns.
    let spin = p.nap_spin_ns();
    assert!(
        spin > PollParams::default().poll_max_ns && (180_000..=210_000).contains(&spin),
        "spin {spin}"
    );
    // The same rhythm on a queue's kicks is not planned for.
    let mut p = calibrated(2, 6_000, 500);
    let t = batches(&mut p, DEVICE_SOURCE + 1);
    assert_eq!(p.nap_at(t + 10_000), 0);
    assert!(p.nap_spin_ns() <= PollParams::default().poll_max_ns);
}

#[test]
fn no_nap_while_a_guest_answers() {
    let mut p = calibrated(2, 6_000, 500);
    // Completions every 80 us: a nap of ~70 us after each...
    let mut t = 0;
    for k in 1..=200u64 {
        t = k * 80_000;
        p.observe_events_at(t, &[DEVICE_SOURCE]);
    }
    // ...whatever queue 1's kicks do: they scatter too widely to plan for.
    let mut kick = 0;
    for k in 0u64.. {
        kick += if k % 2 == 0 { 20_000 } else { 300_000 };
        if kick + 320_000 > t {
            break;
        }
        p.observe_events_at(kick, &[1]);
    }
    p.observe_answered([]);
    assert!(p.nap_at(t + 1_000) > 60_000);
    // ...but not right after the pass handed them to queue 1's guest: its
    // next requests are due at once.
    p.observe_answered([1]);
    assert_eq!(p.nap_at(t + 1_000), 0);
    // Its answer came: the next wait naps again.
    p.observe_events_at(t + 3_000, &[1]);
    p.observe_answered([]);
    assert!(p.nap_at(t + 4_000) > 50_000, "{}", p.nap_at(t + 4_000));
    // A queue with a steady rhythm of its own (a client that thinks 600 us
    // between requests at queue depth 1) is napped for after an answer too.
    let mut p = calibrated(2, 6_000, 500);
    let mut t = 0;
    for k in 1..=200u64 {
        t = k * 600_000;
        p.observe_events_at(t, &[1]);
    }
    p.observe_answered([1]);
    let nap = p.nap_at(t + 2_000);
    assert!((585_000..=592_000).contains(&nap), "nap {nap}");
}

use super::*;

const COST: f64 = 5e-6;

/// A sample where queue `i` is `(owner, rate, pinned)` and each thread's work
/// is its queues' rate times [`COST`].
fn sample(now_ms: u64, pool: usize, queues: &[(usize, f64, bool)]) -> Sample {
    let mut threads = vec![ThreadSample::default(); pool];
    for &(o, r, _) in queues {
        threads[o].work += r * COST;
    }
    Sample {
        now_ms,
        threads,
        queues: queues
            .iter()
            .enumerate()
            .map(|(i, &(owner, rate, pinned))| QueueSample {
                id: (0, i as u16),
                owner,
                rate,
                pinned,
                home: None,
            })
            .collect(),
    }
}

/// Ticks `policy` once a second over a closed model of the threads: each
/// queue offers `demand` requests per second at [`COST`] CPU seconds each; a
/// thread asked for more than a core serves each of its queues in
/// proportion. Returns every decision with its time, and the final owners.
fn run(
    policy: &mut AutoTune,
    pool: usize,
    demand: &[f64],
    owners: &mut [usize],
    pinned: &[bool],
    seconds: u64,
) -> Vec<(u64, Decision)> {
    let mut log = Vec::new();
    for s in 0..seconds {
        let mut asked = vec![0.0; pool];
        for (q, &d) in demand.iter().enumerate() {
            asked[owners[q]] += d * COST;
        }
        let queues: Vec<(usize, f64, bool)> = demand
            .iter()
            .enumerate()
            .map(|(q, &d)| {
                let scale = (1.0 / asked[owners[q]]).min(1.0);
                (owners[q], d * scale, pinned[q])
            })
            .collect();
        let now = s * 1000;
        for d in policy.decide(&sample(now, pool, &queues)) {
            assert_eq!(owners[d.queue.1 as usize], d.from);
            owners[d.queue.1 as usize] = d.to;
            log.push((now, d));
        }
    }
    log
}

fn decide_n(policy: &mut AutoTune, n: u64, pool: usize, q: &[(usize, f64, bool)]) -> Vec<Decision> {
    let mut last = Vec::new();
    for t in 0..n {
        last = policy.decide(&sample(t * 1000, pool, q));
        if !last.is_empty() {
            break;
        }
    }
    last
}

#[test]
fn a_hot_thread_gives_a_queue_to_a_cool_one_once_confirmed() {
    let mut p = AutoTune::new(Params::default());
    // Thread 0: 0.45 + 0.45; thread 1: 0.10.
    let q = [
        (0, 90_000.0, false),
        (0, 90_000.0, false),
        (1, 20_000.0, false),
    ];
    assert!(p.decide(&sample(0, 2, &q)).is_empty(), "not confirmed yet");
    let d = p.decide(&sample(1000, 2, &q));
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!((d[0].from, d[0].to, d[0].reason), (0, 1, Reason::Balance));
    assert!((d[0].load - 0.45).abs() < 1e-9, "{d:?}");
    // Settling: the same sample asks nothing for 2 s.
    assert!(p.decide(&sample(2000, 2, &q)).is_empty());
}

#[test]
fn balanced_or_cool_threads_stay_as_they_are() {
    let mut p = AutoTune::new(Params::default());
    let even = [(0, 100_000.0, false), (1, 100_000.0, false)];
    assert!(decide_n(&mut p, 20, 2, &even).is_empty());
    // Uneven but nowhere near busy: nothing to gain.
    let cool = [(0, 50_000.0, false), (0, 50_000.0, false), (1, 0.0, false)];
    let mut p = AutoTune::new(Params {
        confirm_park: 1000,
        ..Params::default()
    });
    assert!(decide_n(&mut p, 20, 2, &cool).is_empty());
}

#[test]
fn a_saturated_thread_wakes_a_parked_one_with_half_its_load() {
    let mut p = AutoTune::new(Params::default());
    let q = [
        (0, 48_000.0, false),
        (0, 48_000.0, false),
        (0, 48_000.0, false),
        (0, 48_000.0, false),
    ];
    let d = decide_n(&mut p, 5, 4, &q);
    assert_eq!(d.len(), 2, "{d:?}");
    assert!(d
        .iter()
        .all(|d| d.reason == Reason::Activate && d.from == 0 && d.to == 1));
}

#[test]
fn a_single_saturated_queue_is_left_alone() {
    let mut p = AutoTune::new(Params::default());
    let q = [(0, 200_000.0, false), (1, 1_000.0, false)];
    assert!(decide_n(&mut p, 20, 4, &q).is_empty());
}

#[test]
fn idle_threads_are_consolidated_and_parked_slowly() {
    let params = Params::default();
    let mut p = AutoTune::new(params);
    let q = [
        (0, 10_000.0, false),
        (1, 10_000.0, false),
        (2, 10_000.0, false),
        (3, 10_000.0, false),
    ];
    for t in 0..params.confirm_park as u64 - 1 {
        assert!(p.decide(&sample(t * 1000, 4, &q)).is_empty());
    }
    let d = p.decide(&sample(10_000, 4, &q));
    // 0.2 of a core in all fits on one thread below park_below.
    assert_eq!(d.len(), 3, "{d:?}");
    assert!(d.iter().all(|d| d.reason == Reason::Park));
    let to: Vec<usize> = d.iter().map(|d| d.to).collect();
    assert!(to.iter().all(|&t| t == to[0]), "all onto one: {d:?}");
    assert!(d.iter().all(|d| d.from != to[0]));
}

/// Of two cool threads, the one on the CPU that takes the disk's
/// interrupts keeps the queues, though it is the cooler.
#[test]
fn parking_keeps_the_thread_where_the_disk_interrupts() {
    let params = Params::default();
    let mut p = AutoTune::new(params);
    let q = [(0, 20_000.0, false), (1, 10_000.0, false)];
    let mut s = sample(0, 2, &q);
    for q in &mut s.queues {
        q.home = Some(1);
    }
    let mut d = Vec::new();
    for t in 0..params.confirm_park as u64 {
        s.now_ms = t * 1000;
        d = p.decide(&s);
    }
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!((d[0].from, d[0].to, d[0].reason), (0, 1, Reason::Park));
}

#[test]
fn no_oscillation_under_steady_load() {
    for demand in [
        vec![60_000.0; 8],
        vec![150_000.0, 20_000.0, 20_000.0, 20_000.0, 90_000.0, 5_000.0],
        vec![30_000.0; 16],
        vec![45_000.0, 45_000.0, 45_000.0],
    ] {
        let mut p = AutoTune::new(Params::default());
        let n = demand.len();
        let mut owners = vec![0; n];
        let log = run(&mut p, 8, &demand, &mut owners, &vec![false; n], 300);
        // At most one move per queue per 10 s, all along.
        for q in 0..n as u16 {
            let times: Vec<u64> = log
                .iter()
                .filter(|(_, d)| d.queue.1 == q)
                .map(|&(t, _)| t)
                .collect();
            assert!(
                times.windows(2).all(|w| w[1] - w[0] >= 10_000),
                "{demand:?}: queue {q} moved at {times:?}"
            );
        }
        // Converged within a minute, then still.
        assert!(log.iter().all(|&(t, _)| t < 60_000), "{demand:?}: {log:?}");
        // And the placement serves the whole demand.
        let mut asked = [0.0; 8];
        for (q, &d) in demand.iter().enumerate() {
            asked[owners[q]] += d * COST;
        }
        assert!(
            asked.iter().all(|&a| a <= 1.0),
            "{demand:?}: {owners:?} asks {asked:?}"
        );
    }
}

#[test]
fn pinned_queues_never_move_and_keep_their_thread_active() {
    let mut p = AutoTune::new(Params {
        max_active: 1,
        ..Params::default()
    });
    let demand = [120_000.0, 120_000.0, 10_000.0, 10_000.0];
    let pinned = [true, true, false, true];
    let mut owners = [0, 0, 1, 2];
    let log = run(&mut p, 4, &demand, &mut owners, &pinned, 120);
    assert!(log.iter().all(|(_, d)| d.queue.1 == 2), "{log:?}");
    assert_eq!(owners[..2], [0, 0]);
    assert_eq!(owners[3], 2);
}

#[test]
fn the_cpu_budget_caps_active_threads() {
    assert_eq!(Params::max_active_for_budget(2.5), 2);
    assert_eq!(Params::max_active_for_budget(0.2), 1);
    let mut p = AutoTune::new(Params {
        max_active: 2,
        ..Params::default()
    });
    // Four threads active, more than the budget: emptied at once (no confirm).
    let q = [
        (0, 10_000.0, false),
        (1, 10_000.0, false),
        (2, 90_000.0, false),
        (3, 10_000.0, false),
    ];
    let d = p.decide(&sample(0, 4, &q));
    assert_eq!(d.len(), 2, "{d:?}");
    assert!(d.iter().all(|d| d.reason == Reason::Budget));
    // Then however saturated, a third thread is never woken.
    let demand = [100_000.0; 6];
    let mut owners = [0; 6];
    let log = run(&mut p, 4, &demand, &mut owners, &[false; 6], 120);
    let mut used: Vec<usize> = owners.to_vec();
    used.sort();
    used.dedup();
    assert_eq!(used.len(), 2, "{log:?}");
}

#[test]
fn a_move_that_does_not_pay_for_its_drain_is_not_made() {
    // A drain so expensive that no gain pays it back.
    let mut p = AutoTune::new(Params {
        move_cost_s: 100.0,
        ..Params::default()
    });
    let q = [
        (0, 90_000.0, false),
        (0, 90_000.0, false),
        (1, 20_000.0, false),
    ];
    assert!(decide_n(&mut p, 10, 2, &q).is_empty());
}

#[test]
fn reasons_have_distinct_labels() {
    let mut l: Vec<&str> = Reason::ALL.iter().map(|r| r.label()).collect();
    l.sort_unstable();
    l.dedup();
    assert_eq!(l.len(), Reason::ALL.len());
}

/// A sample where queue `i` belongs to `owners[i]` and completes `rates[i]`
/// requests a second at [`COST`] each, and every thread with work spends the
/// rest of the tick polling: it never sleeps. Its passes find several
/// queues ready at once as often as one IOThread's did with 4 jobs at QD16
/// on the null backend with 50 us of latency (56-63%, where a second
/// thread did 1.35x).
fn awake_sample(now_ms: u64, pool: usize, owners: &[usize], rates: &[f64]) -> Sample {
    let mut threads = vec![ThreadSample::default(); pool];
    for (&o, &r) in owners.iter().zip(rates) {
        threads[o].work += r * COST;
    }
    for t in threads.iter_mut().filter(|t| t.work > 0.0) {
        t.poll = 1.0 - t.work;
        t.together = 0.6;
    }
    Sample {
        now_ms,
        threads,
        queues: owners
            .iter()
            .zip(rates)
            .enumerate()
            .map(|(i, (&owner, &rate))| QueueSample {
                id: (0, i as u16),
                owner,
                rate,
                pinned: false,
                home: None,
            })
            .collect(),
    }
}

/// Ticks `policy` once a second from `from_s` to `to_s` with the rates
/// `rates(owners)` gives, carrying out its decisions; returns them with
/// their time in seconds.
fn tick(
    policy: &mut AutoTune,
    pool: usize,
    owners: &mut [usize],
    (from_s, to_s): (u64, u64),
    rates: impl Fn(&[usize]) -> Vec<f64>,
) -> Vec<(u64, Decision)> {
    let mut log = Vec::new();
    for t in from_s..to_s {
        let r = rates(owners);
        for d in policy.decide(&awake_sample(t * 1000, pool, owners, &r)) {
            assert_eq!(owners[d.queue.1 as usize], d.from, "{d:?}");
            owners[d.queue.1 as usize] = d.to;
            log.push((t, d));
        }
    }
    log
}

/// Two busy queues and two idle ones on a thread that never sleeps; each
/// busy queue does `one` requests a second while they share a thread and
/// `two` when they do not.
fn two_busy(one: f64, two: f64) -> impl Fn(&[usize]) -> Vec<f64> {
    move |owners: &[usize]| {
        let each = if owners[0] == owners[1] { one } else { two };
        vec![each, each, 0.0, 0.0]
    }
}

/// Four busy queues on a thread that never sleeps; each does `together`
/// requests a second while all four share a thread and `apart` when they
/// do not.
fn four_busy(together: f64, apart: f64) -> impl Fn(&[usize]) -> Vec<f64> + Copy {
    move |owners: &[usize]| {
        let each = if owners.iter().all(|&o| o == owners[0]) {
            together
        } else {
            apart
        };
        vec![each; 4]
    }
}

#[test]
fn a_thread_that_never_sleeps_is_probed_and_kept_when_the_rate_grows() {
    let mut p = AutoTune::new(Params::default());
    let mut owners = [0, 0, 0, 0];
    // Half work, half polling: not saturated, but never asleep.
    let log = tick(
        &mut p,
        2,
        &mut owners,
        (0, 120),
        two_busy(50_000.0, 60_000.0),
    );
    assert!(!log.is_empty(), "no probe");
    let (t, first) = log[0];
    assert!(t <= 3, "probed at {t} s");
    assert_eq!((first.from, first.to, first.reason), (0, 1, Reason::Probe));
    assert_ne!(owners[0], owners[1], "{log:?}");
    // Kept: no revert, and the two threads (0.3 of a core each) are not
    // parked together again while the rate holds.
    assert!(
        log.iter().all(|(_, d)| d.reason == Reason::Probe),
        "{log:?}"
    );
    // The load goes away: the threads are gathered again (slowly).
    let log = tick(&mut p, 2, &mut owners, (120, 180), |_| vec![0.0; 4]);
    assert!(log.iter().any(|(_, d)| d.reason == Reason::Park), "{log:?}");
    assert_eq!(owners, [owners[0]; 4]);
}

#[test]
fn a_probe_that_does_not_raise_the_rate_is_reverted_and_not_retried() {
    let mut p = AutoTune::new(Params::default());
    let mut owners = [0, 0, 0, 0];
    // Four busy queues: the ones that did not move are not a new set to try.
    let four = four_busy(30_000.0, 30_500.0);
    let log = tick(&mut p, 2, &mut owners, (0, 200), four);
    let probes: Vec<_> = log
        .iter()
        .filter(|(_, d)| d.reason == Reason::Probe)
        .collect();
    let reverts: Vec<_> = log
        .iter()
        .filter(|(_, d)| d.reason == Reason::Revert)
        .collect();
    assert!(!probes.is_empty() && !reverts.is_empty(), "{log:?}");
    assert_eq!(
        probes.len(),
        reverts.len(),
        "every moved queue comes back {log:?}"
    );
    assert!(
        reverts.iter().all(|(t, _)| *t <= probes[0].0 + 5),
        "reverted within the settle time and the measure: {log:?}"
    );
    assert!(
        log.iter().all(|(t, _)| *t <= probes[0].0 + 5),
        "tried once: {log:?}"
    );
    assert_eq!(owners, [0; 4]);
    // The workload changes (its rate leaves the band): it is tried again.
    let log = tick(&mut p, 2, &mut owners, (200, 210), |_| vec![39_000.0; 4]);
    assert!(
        log.iter().any(|(_, d)| d.reason == Reason::Probe),
        "{log:?}"
    );
}

/// A pause is not a new workload: a probe that did not pay is not tried
/// again when the same queues come back at the same rate after a pause (a
/// guest's idle spell, the gaps of a sweep between its runs), with the
/// partial ticks around it. A rate that stays out of the band is a new
/// workload: it is.
#[test]
fn a_probe_refused_before_a_pause_is_not_tried_again_after_it() {
    let mut p = AutoTune::new(Params::default());
    let mut owners = [0, 0, 0, 0];
    // Two threads do no more than one (the shape of 4 jobs at QD1 with a
    // device's latency).
    let four = four_busy(11_000.0, 10_000.0);
    let log = tick(&mut p, 2, &mut owners, (0, 20), four);
    assert!(
        log.iter().any(|(_, d)| d.reason == Reason::Revert),
        "{log:?}"
    );
    assert_eq!(owners, [0; 4]);
    // Five pauses of 5 s, each with a tick at half the rate on either side.
    let t = pauses(&mut p, &mut owners, 20, four);
    // A rate out of the band, tick after tick: a new workload, tried.
    let log = tick(&mut p, 2, &mut owners, (t, t + 10), |_| vec![20_000.0; 4]);
    assert!(
        log.iter().any(|(_, d)| d.reason == Reason::Probe),
        "{log:?}"
    );

    // A pause while a probe is measured: it is undone, and not tried again
    // when the bursts come back.
    let mut p = AutoTune::new(Params::default());
    let mut owners = [0, 0, 0, 0];
    let mut t = 0;
    while owners == [0; 4] {
        assert!(t < 10, "no probe");
        tick(&mut p, 2, &mut owners, (t, t + 1), four);
        t += 1;
    }
    let log = tick(&mut p, 2, &mut owners, (t, t + 6), |_| vec![0.0; 4]);
    assert!(
        log.iter().any(|(_, d)| d.reason == Reason::Revert),
        "{log:?}"
    );
    assert_eq!(owners, [0; 4]);
    pauses(&mut p, &mut owners, t + 6, four);
}

/// Ticks five bursts of `rates` from `t` s, each 5 s long with a tick at
/// half its rate on either side and a pause of 5 s after it, asserting that
/// nothing moves; returns the time after them.
fn pauses(
    p: &mut AutoTune,
    owners: &mut [usize],
    mut t: u64,
    rates: impl Fn(&[usize]) -> Vec<f64> + Copy,
) -> u64 {
    for _ in 0..5 {
        for s in 0..12 {
            let at = move |owners: &[usize]| match s {
                0 | 6 => rates(owners).iter().map(|r| r / 2.0).collect(),
                1..=5 => rates(owners),
                _ => vec![0.0; 4],
            };
            let log = tick(p, 2, owners, (t, t + 1), at);
            assert!(log.is_empty(), "at {t} s: {log:?}");
            t += 1;
        }
    }
    t
}

#[test]
fn no_probe_without_two_busy_queues_a_sleepless_thread_or_room() {
    // One busy queue: nothing to split.
    let mut p = AutoTune::new(Params::default());
    let one = |_: &[usize]| vec![100_000.0, 0.0, 0.0, 0.0];
    assert!(tick(&mut p, 2, &mut [0; 4], (0, 60), one).is_empty());
    // A thread that sleeps 30% of the time.
    let mut p = AutoTune::new(Params::default());
    let q = [(0, 50_000.0, false), (0, 50_000.0, false)];
    let mut s = sample(0, 2, &q);
    s.threads[0].poll = 0.2;
    for t in 0..60 {
        s.now_ms = t * 1000;
        assert!(p.decide(&s).is_empty());
    }
    // A budget of one thread.
    let mut p = AutoTune::new(Params {
        max_active: 1,
        ..Params::default()
    });
    let busy = two_busy(50_000.0, 60_000.0);
    assert!(tick(&mut p, 2, &mut [0; 4], (0, 60), busy).is_empty());
}

/// A thread that never sleeps, with several busy queues, whose passes seldom
/// find two of them ready at once: its queues do not wait on each other,
/// and a second thread would only take a CPU from the guest. One IOThread
/// with 4 jobs at QD1 on the null backend with 50 us of latency: 4.5-5.2%
/// of its passes with work found two or more queues ready (56-63% at QD16),
/// and a probe there lost 45K -> 37K requests a second.
#[test]
fn no_probe_for_queues_that_seldom_wait_on_each_other() {
    let mut p = AutoTune::new(Params::default());
    for t in 0..60 {
        let mut s = awake_sample(t * 1000, 2, &[0, 0, 0, 0], &[11_000.0; 4]);
        s.threads[0].together = 0.05;
        assert!(p.decide(&s).is_empty(), "moved at {t} s");
    }
    // The same thread once its passes find them ready together: probed.
    let mut p = AutoTune::new(Params::default());
    let probed = (0..10).any(|t| {
        let s = awake_sample(t * 1000, 2, &[0, 0, 0, 0], &[11_000.0; 4]);
        p.decide(&s).iter().any(|d| d.reason == Reason::Probe)
    });
    assert!(probed, "not probed");
}

/// A probe is kept only for a gain above the noise of the ticks before it:
/// its lowest tick after the settle time against the highest tick that
/// confirmed it, not a single tick's rate against another's.
#[test]
fn a_probe_is_judged_against_the_noise_of_the_ticks_before_it() {
    let mut p = AutoTune::new(Params::default());
    let mut owners = [0, 0, 0, 0];
    // Two busy queues; the confirming ticks do 120K and then 100K.
    let per_tick = [60_000.0, 50_000.0, 56_000.0, 56_000.0, 56_000.0];
    let mut log = Vec::new();
    for (t, &each) in per_tick.iter().enumerate() {
        let rates = [each, each, 0.0, 0.0];
        for d in p.decide(&awake_sample(t as u64 * 1000, 2, &owners, &rates)) {
            owners[d.queue.1 as usize] = d.to;
            log.push((t, d.reason));
        }
    }
    // Probed at the second tick; 112K after it is 12% over the last tick
    // before it but under the highest: undone, at the first tick after the
    // settle time (the lowest of the measured ticks can only fall).
    assert_eq!(log.first(), Some(&(1, Reason::Probe)), "{log:?}");
    assert!(log.contains(&(3, Reason::Revert)), "{log:?}");
    assert_eq!(owners, [0; 4]);
}

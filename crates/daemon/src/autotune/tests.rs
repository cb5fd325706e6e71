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
    l.dedup();
    assert_eq!(l.len(), 4);
}

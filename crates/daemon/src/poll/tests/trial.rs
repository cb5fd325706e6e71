//! Rule 6 of the adaptive algorithm: trials of sleeping until each event.

use super::*;
use crate::poll::trial::{
    FIRST_TRIAL_NS, GLANCE_NS, HOLD_MAX_NS, HOLD_MIN_NS, IDLE_NS, MIN_REQUESTS, WINDOWS, WINDOW_NS,
};

const MS: u64 = 1_000_000;

/// A pass at `now` after one that finished `n` requests, as the IOThread
/// reports it.
fn pass(p: &mut PollPolicy, now: u64, n: usize) {
    pass_held(p, now, n, false);
}

/// [`pass`], with a queue held back by its limits or not; the verdict of a
/// trial that ended with it.
fn pass_held(p: &mut PollPolicy, now: u64, n: usize, held: bool) -> Option<bool> {
    p.observe_finished(n);
    p.observe_pass(now, n, held)
}

/// Drives `p` with a pass every millisecond from `from` (exclusive) to
/// `until` (inclusive); each pass finished `awake` requests, or `asleep` if
/// the wait before it slept until its event. Returns the times of the passes
/// after which the thread slept.
fn drive(p: &mut PollPolicy, from: u64, until: u64, awake: u64, asleep: u64) -> Vec<u64> {
    let mut slept = Vec::new();
    let mut now = from;
    while now < until {
        let sleeping = p.sleeping();
        now += MS;
        pass(p, now, if sleeping { asleep } else { awake } as usize);
        if p.sleeping() {
            slept.push(now);
        }
    }
    slept
}

/// A policy whose window is open: a queue with 5 us between requests.
fn polling() -> PollPolicy {
    let mut p = adaptive();
    for _ in 0..64 {
        p.update(5_000, &[0], true);
    }
    assert!(p.poll_ns() > 0);
    p
}

/// The end of the first trial.
const TRIAL_END: u64 = MS + FIRST_TRIAL_NS + WINDOWS as u64 * WINDOW_NS;
/// The end of the second trial, started at the pass after the first ended:
/// where the first found sleeping as fast, this one must confirm it.
const CONFIRMED: u64 = TRIAL_END + MS + WINDOWS as u64 * WINDOW_NS;

#[test]
fn a_trial_alternates_its_windows_and_sleeping_as_fast_wins() {
    let mut p = polling();
    let window = p.poll_ns();
    // Before the first trial the policy's window stands.
    assert!(drive(&mut p, 0, FIRST_TRIAL_NS, 10, 10).is_empty());
    assert_eq!(p.poll_ns(), window);
    // The trial's windows sleep in the order ABBA BAAB: the slept passes,
    // window by window.
    let slept = drive(&mut p, FIRST_TRIAL_NS, TRIAL_END - MS, 10, 10);
    let start = MS + FIRST_TRIAL_NS;
    let by_window: Vec<bool> = (0..WINDOWS as u64)
        .map(|w| slept.contains(&(start + w * WINDOW_NS + WINDOW_NS / 2)))
        .collect();
    assert_eq!(
        by_window,
        [false, true, true, false, true, false, false, true]
    );
    // Sleeping finished as many requests a second; a second trial starts at
    // once to confirm it, with a window that waits as the policy says.
    drive(&mut p, TRIAL_END - MS, TRIAL_END + MS, 10, 10);
    assert!(!p.sleeping());
    assert_eq!(p.poll_ns(), window);
    // Confirmed: the thread sleeps until each event, with no spin and no
    // nap, until the next trial.
    drive(&mut p, TRIAL_END + MS, CONFIRMED, 10, 10);
    assert!(p.sleeping());
    assert_eq!(p.poll_ns(), 0);
    assert_eq!(p.nap_at(CONFIRMED + MS), 0);
    let slept = drive(&mut p, CONFIRMED, CONFIRMED + HOLD_MIN_NS - MS, 10, 10);
    assert_eq!(slept.len() as u64, (HOLD_MIN_NS - MS) / MS);
    // The next trial starts with a window that waits as the policy says.
    drive(
        &mut p,
        CONFIRMED + HOLD_MIN_NS - MS,
        CONFIRMED + HOLD_MIN_NS + MS,
        10,
        10,
    );
    assert!(!p.sleeping());
    assert!(p.poll_ns() > 0);
}

#[test]
fn sleeping_slower_than_the_budget_keeps_the_policy() {
    // 10% fewer requests a second asleep: polling pays.
    let mut p = polling();
    drive(&mut p, 0, CONFIRMED + MS, 100, 90);
    assert!(!p.sleeping());
    assert!(p.poll_ns() > 0);
    // 1% fewer: within the 2% budget, sleeping wins (in two trials).
    let mut p = polling();
    drive(&mut p, 0, CONFIRMED + MS, 100, 99);
    assert!(p.sleeping());
    // 3% fewer: beyond it.
    let mut p = polling();
    drive(&mut p, 0, CONFIRMED + MS, 100, 97);
    assert!(!p.sleeping());
    // A budget of 10% takes the 10% loss.
    let mut p = polling().with_adaptive_params(AdaptiveParams {
        latency_budget_pct: 10,
        ..AdaptiveParams::default()
    });
    drive(&mut p, 0, CONFIRMED + MS, 100, 90);
    assert!(p.sleeping());
}

#[test]
fn a_verdict_to_sleep_needs_a_second_trial_to_agree() {
    // As fast asleep in the first trial, 10% slower in the second: the
    // thread keeps polling, and tries again a hold later.
    let mut p = polling();
    drive(&mut p, 0, TRIAL_END, 100, 100);
    drive(&mut p, TRIAL_END, CONFIRMED + MS, 100, 90);
    assert!(!p.sleeping());
    assert!(p.poll_ns() > 0);
    let slept = drive(
        &mut p,
        CONFIRMED + MS,
        CONFIRMED + HOLD_MIN_NS - MS,
        100,
        100,
    );
    assert!(slept.is_empty());
}

/// Drives `p` through the first trial and the second that confirms it: a
/// pass every millisecond, finishing `awake` requests after an awake wait
/// and, after a sleeping one, `asleep[j]` in the j-th pair of windows of
/// either trial (AB, BA, BA, AB). Returns whether the thread sleeps after.
fn drive_pairs(p: &mut PollPolicy, awake: u64, asleep: [u64; 4]) -> bool {
    let starts = [MS + FIRST_TRIAL_NS, TRIAL_END + MS];
    let mut now = 0;
    while now < CONFIRMED + MS {
        let sleeping = p.sleeping();
        now += MS;
        let start = starts[usize::from(now > TRIAL_END)];
        // The window a pass is counted in: the one its time closes or falls in.
        let pair = (now.saturating_sub(start + 1) / WINDOW_NS / 2).min(3) as usize;
        pass(p, now, if sleeping { asleep[pair] } else { awake } as usize);
    }
    p.sleeping()
}

#[test]
fn a_tie_within_the_trials_noise_goes_to_sleeping() {
    // Asleep as fast in two pairs of windows and 5% slower in the other
    // two (the host's speed changed, or the load's): 2.5% behind in all,
    // beyond the 2% budget but within it plus the pairs' standard error
    // (1.4%). The pairs' order does not matter.
    assert!(drive_pairs(&mut polling(), 100, [100, 95, 100, 95]));
    assert!(drive_pairs(&mut polling(), 100, [95, 95, 100, 100]));
    // The same 2.5% without the noise is a loss.
    assert!(!drive_pairs(&mut polling(), 100, [97; 4]));
}

#[test]
fn a_loss_beyond_twice_the_budget_keeps_polling_however_noisy() {
    // 5% behind in all, with a spread whose standard error (10%) would
    // cover it: the noise counts for one budget at most.
    assert!(!drive_pairs(&mut polling(), 100, [115, 75, 115, 75]));
    // 3.5% behind with the same spread: within twice the budget.
    assert!(drive_pairs(&mut polling(), 100, [116, 77, 116, 77]));
}

#[test]
fn the_sleeping_way_sleeps_as_poll_off_does() {
    // However cheap a sleep is on this host, the sleeping way neither spins
    // nor naps: it is the way `--poll off` waits, the one a trial weighs
    // polling against.
    for nap_cpu in [1_000, 1_000_000] {
        let mut p = polling();
        p.set_nap_cpu_ns(nap_cpu);
        assert!(drive_pairs(&mut p, 10, [10; 4]));
        assert_eq!(p.poll_ns(), 0, "{nap_cpu}");
        assert_eq!(p.nap_at(CONFIRMED + 2 * MS), 0);
    }
}

/// Drives `p` as [`drive`] does, with a host that takes its time to settle
/// after each switch from polling to sleeping: for the first `settle_ms`
/// passes asleep after a switch each finishes `unsettled`, later ones
/// `asleep`. Returns whether the thread sleeps at `until`.
fn drive_settling(
    p: &mut PollPolicy,
    until: u64,
    awake: u64,
    (settle_ms, unsettled, asleep): (u64, u64, u64),
) -> bool {
    let (mut now, mut asleep_for) = (0, 0);
    while now < until {
        let sleeping = p.sleeping();
        asleep_for = if sleeping { asleep_for + 1 } else { 0 };
        now += MS;
        let n = match (sleeping, asleep_for <= settle_ms) {
            (false, _) => awake,
            (true, true) => unsettled,
            (true, false) => asleep,
        };
        pass(p, now, n as usize);
    }
    p.sleeping()
}

#[test]
fn sleeping_is_judged_once_the_host_has_settled() {
    // Measured on this project's VM, threads not pinned: for some tens of
    // milliseconds after the thread stops polling, sleeping serves little
    // more than half of what it serves once the host's scheduler has placed
    // the threads anew, and then more than polling did. Windows as short
    // as the transient judged sleeping by it and never slept there.
    assert!(drive_settling(
        &mut polling(),
        CONFIRMED + MS,
        100,
        (30, 60, 110)
    ));
    // And as fast once settled, after 40 ms at 60%: the first part of each
    // window is not counted, and the tie goes to sleeping. Counted whole,
    // the windows that follow an awake one would read 0.92 (at QD1 on this
    // VM the first sleeping window of a trial read 0.83-0.89, the later ones
    // 1.0 on average).
    assert!(drive_settling(
        &mut polling(),
        CONFIRMED + MS,
        100,
        (40, 60, 100)
    ));
    // A way that stays at 60% once settled loses, at the end of its first
    // sleeping window (more than five budgets behind)...
    let mut p = polling();
    let start = MS + FIRST_TRIAL_NS;
    assert!(!drive_settling(
        &mut p,
        start + 2 * WINDOW_NS,
        100,
        (30, 60, 60)
    ));
    assert!(!drive_settling(&mut p, CONFIRMED + MS, 100, (30, 60, 60)));
}

#[test]
fn a_trial_whose_sleeping_window_falls_far_behind_ends_there() {
    // Asleep, a quarter of the requests (a polling driver at QD1): the
    // first sleeping window is routed a glance into it, and the policy's
    // way is kept.
    let mut p = polling();
    let start = MS + FIRST_TRIAL_NS;
    let slept = drive(&mut p, 0, start + 2 * WINDOW_NS, 100, 25);
    assert_eq!(slept.first(), Some(&(start + WINDOW_NS)));
    assert_eq!(slept.last(), Some(&(start + WINDOW_NS + GLANCE_NS - MS)));
    assert!(!p.sleeping());
    // The next trial comes a hold later.
    let next = start + WINDOW_NS + GLANCE_NS + HOLD_MIN_NS;
    let slept = drive(&mut p, next - MS, next + 2 * WINDOW_NS, 100, 25);
    assert_eq!(slept.first(), Some(&(next + WINDOW_NS)));
    // 60% is no rout: the window runs whole, and being more than five
    // budgets behind, ends the trial.
    let mut p = polling();
    let slept = drive(&mut p, 0, start + 3 * WINDOW_NS, 100, 60);
    assert_eq!(slept.len() as u64, WINDOW_NS / MS);
    assert!(!p.sleeping());
    // 10% behind is no early end: the trial runs its eight windows.
    let mut p = polling();
    let slept = drive(&mut p, 0, start + WINDOWS as u64 * WINDOW_NS, 100, 90);
    assert_eq!(slept.len() as u64, 4 * WINDOW_NS / MS);
}

#[test]
fn a_trial_that_ended_early_is_lost_whatever_its_pairs_left_unfilled() {
    // Asleep 12% behind: the first sleeping window ends the trial. Its one
    // complete pair (0.88) and three empty ones must not average to a tie.
    let mut p = polling();
    let start = MS + FIRST_TRIAL_NS;
    let slept = drive(&mut p, 0, start + HOLD_MIN_NS, 100, 88);
    assert_eq!(slept.first(), Some(&(start + WINDOW_NS)));
    assert_eq!(slept.last(), Some(&(start + 2 * WINDOW_NS - MS)));
    assert!(!p.sleeping());
}

/// The times at which trials start over `until` of a steady load under
/// which sleeping wins: each starts with an awake window after a stretch
/// asleep longer than a trial's sleeping windows in a row (two).
fn trial_starts(until: u64) -> Vec<u64> {
    let mut p = polling();
    let mut starts = Vec::new();
    let mut now = 0;
    let mut asleep_since = None;
    while now < until {
        now += MS;
        pass(&mut p, now, 10);
        match (p.sleeping(), asleep_since) {
            (true, None) => asleep_since = Some(now),
            (false, Some(since)) => {
                if now - since > 3 * WINDOW_NS {
                    starts.push(now);
                }
                asleep_since = None;
            }
            _ => {}
        }
    }
    starts
}

#[test]
fn a_verdict_that_trials_confirm_is_held_longer_each_time() {
    let starts = trial_starts(40_000 * MS);
    let trial = WINDOWS as u64 * WINDOW_NS;
    let holds: Vec<u64> = starts.windows(2).map(|w| w[1] - w[0] - trial).collect();
    // The first two trials' verdict changed the way (held 1 s before the
    // third, the first one seen here); each trial after confirms it.
    assert_eq!(
        holds,
        [2 * HOLD_MIN_NS, 4 * HOLD_MIN_NS, HOLD_MAX_NS, HOLD_MAX_NS],
        "{starts:?}"
    );
    assert_eq!(starts[0], CONFIRMED + HOLD_MIN_NS);
}

#[test]
fn a_trial_with_too_few_requests_keeps_the_verdict() {
    // One request every other window's pass: fewer than MIN_REQUESTS.
    let mut p = polling();
    let per_pass = MIN_REQUESTS / (WINDOWS as u64 * WINDOW_NS / MS) / 2;
    drive(&mut p, 0, TRIAL_END + MS, per_pass, per_pass);
    assert!(!p.sleeping());
    assert!(p.poll_ns() > 0);
}

#[test]
fn an_idle_spell_drops_the_trial() {
    let mut p = polling();
    // Into the trial's second window (asleep).
    let t = MS + FIRST_TRIAL_NS + WINDOW_NS + WINDOW_NS / 2;
    drive(&mut p, 0, t, 10, 10);
    assert!(p.sleeping());
    // No pass for IDLE_NS: the next one drops the trial, without a verdict
    // (the policy's way), and starts another at the pass after.
    let now = t + IDLE_NS;
    pass(&mut p, now, 1);
    assert!(!p.sleeping());
    drive(
        &mut p,
        now,
        now + 2 * WINDOWS as u64 * WINDOW_NS + 3 * MS,
        10,
        10,
    );
    assert!(p.sleeping(), "the next trials' verdict");
}

/// A queue held back by its limits: the rate is the limit's, whichever way
/// the thread waits. A verdict to sleep is dropped at the first pass that
/// sees it, the trial under way with it, and no trial runs while it lasts;
/// once the limits let go, the next trial comes [`HOLD_MIN_NS`] after the
/// last pass that saw a queue held.
#[test]
fn a_limit_that_holds_a_queue_drops_the_trial_and_the_verdict() {
    let mut p = polling();
    let window = p.poll_ns();
    drive(&mut p, 0, CONFIRMED, 10, 10);
    assert!(p.sleeping(), "sleeping as fast, confirmed");
    // Held back: the policy's way at once.
    assert_eq!(pass_held(&mut p, CONFIRMED + MS, 10, true), None);
    assert!(!p.sleeping());
    assert_eq!(p.poll_ns(), window);
    // Still held when the verdict's hold would have ended: no trial, no
    // sleeping window.
    let mut now = CONFIRMED + MS;
    while now < CONFIRMED + 3 * HOLD_MIN_NS {
        now += MS;
        assert_eq!(pass_held(&mut p, now, 10, true), None);
        assert!(!p.sleeping(), "{now}");
    }
    // Let go: a trial starts a hold after the last drop, and sleeps in its
    // second window.
    let until = now + HOLD_MIN_NS + WINDOW_NS + WINDOW_NS / 2;
    let slept = drive(&mut p, now, until, 10, 10);
    assert!(!slept.is_empty(), "a trial after the limits let go");
    assert!(slept[0] > now + HOLD_MIN_NS, "{} {now}", slept[0]);
    // A trial under way ends at the first limited pass.
    assert!(p.sleeping());
    pass_held(&mut p, until + MS, 10, true);
    assert!(!p.sleeping());
}

#[test]
fn other_modes_and_poll_max_ns_0_never_try() {
    for mut p in never_napping() {
        let window = p.poll_ns();
        assert!(drive(&mut p, 0, 3 * HOLD_MIN_NS, 10, 10).is_empty());
        assert_eq!(p.poll_ns(), window, "{:?}", p.mode());
    }
}

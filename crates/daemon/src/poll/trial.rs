//! Rule 6 of the adaptive algorithm: check, now and then, that polling buys
//! what the model says it buys, by trying the other way.
//!
//! Rules 1-5 price a wake-up at what a timed nap costs on this host and poll
//! where the wake-ups saved are worth it. On this project's VM that model
//! was wrong in whole cells: at QD1 on a 50 us null device, and at QD16 on a
//! file, a thread that never polls (`--poll off`) served as many requests a
//! second as the adaptive one, or more, at half its CPU (docs/polling.md,
//! "Try the other way now and then"). What a wake-up costs the guest, and what a
//! spinning thread costs the CPU it shares with the guest's vCPU or the
//! disk's interrupts, the thread cannot measure directly; the requests it
//! finishes per second, it can.
//!
//! So a thread that serves requests runs a trial: [`WINDOWS`] windows of
//! [`WINDOW_NS`], in turn waiting as rules 1-5 say and *sleeping* until
//! each event, as `--poll off` does (no spin, no nap). The windows go in
//! the order ABBA BAAB, so that a steady drift of the load weighs on both
//! sides alike, and each pair of adjacent windows compares the two ways
//! under the same host. A window is long, and its first [`SETTLE_NS`] are
//! not counted, because the host takes its time to settle after a thread
//! changes its way of waiting: where the guest's
//! vCPU and the IOThread share CPUs, the host's scheduler places the two
//! threads anew once one of them stops spinning, and in the meantime the
//! sleeping way serves a half to three quarters of what it serves once
//! settled. Measured on this project's VM (null backend with 50 us of
//! latency, QD16, threads not pinned; `--poll off` 1.15x the adaptive
//! mode's IOPS at half its CPU): the first 20 ms asleep ran at 0.74-0.76x
//! the polling rate, the first 50 ms at 0.54-0.75x, whole windows of
//! 200 ms at 1.03-1.17x. Windows of 20 ms judged sleeping by its
//! transient and never slept there. At QD1 there (`--poll off` 1.04x the
//! adaptive mode's IOPS at 0.57x its CPU) the first sleeping window of a
//! trial, right after a stretch of polling, ran at 0.83-0.89x, the later
//! ones at 0.67-1.19x around a mean of 1.0.
//!
//! If the sleeping windows finished requests at a rate within the IOPS
//! budget (`latency_budget_pct`, 2%) of the others, give or take the
//! trial's noise (`Trial::sleep_won`), and again in a second trial right
//! after where the thread polled until then, sleeping is as fast and
//! cheaper: the thread sleeps until the next trial. Otherwise it waits as
//! rules 1-5 say. A trial whose sleeping windows fall clearly behind ends
//! early: a sleeping window still below half the awake rate
//! [`GLANCE_NS`] into it (`Trial::sleep_routed`; a polling driver at QD1
//! serves a tenth to a fifth of its requests with a thread that sleeps),
//! or one that ends more than five budgets behind (`Trial::sleep_lost`).
//! A verdict is held [`HOLD_MIN_NS`] after it changes, twice as long each
//! time a trial confirms it, up to [`HOLD_MAX_NS`]. A trial that sees too
//! few requests to tell ([`MIN_REQUESTS`]) keeps the verdict; one
//! interrupted by an idle spell ([`IDLE_NS`] without a pass) is dropped.

use std::cmp::Ordering;

/// Length of one window of a trial: long enough for the host to settle
/// after the thread changes its way of waiting (see the module's doc).
pub(super) const WINDOW_NS: u64 = 200_000_000;
/// The first part of each window, not counted: the host settling after the
/// thread changed its way of waiting (see the module's doc).
pub(super) const SETTLE_NS: u64 = 50_000_000;
/// How far into a sleeping window a rout is judged ([`Trial::sleep_routed`]).
pub(super) const GLANCE_NS: u64 = 20_000_000;
/// A sleeping window [`GLANCE_NS`] in and this many percent behind the
/// awake rate is routed: further behind than the host's transient ever
/// put a way that wins once settled (0.54x, see the module's doc).
const ROUT_PCT: u64 = 50;
/// Windows per trial, half of them asleep.
pub(super) const WINDOWS: usize = 8;
/// Which windows of a trial sleep (ABBA BAAB).
const SLEEPS: [bool; WINDOWS] = [false, true, true, false, true, false, false, true];
/// When the first trial starts, after the thread's first pass.
pub(super) const FIRST_TRIAL_NS: u64 = 100_000_000;
/// How long a verdict is held after it changed.
pub(super) const HOLD_MIN_NS: u64 = 1_000_000_000;
/// Longest hold of a verdict that trials keep confirming: a load that
/// changes waits at most this long for the way that suits it.
pub(super) const HOLD_MAX_NS: u64 = 8_000_000_000;
/// Requests a trial must see, in all, to give a verdict.
pub(super) const MIN_REQUESTS: u64 = 256;
/// A pass this long after the previous one ends a trial without a verdict:
/// the thread slept through an idle spell, and its window measured that.
pub(super) const IDLE_NS: u64 = 40_000_000;

/// Pairs of adjacent windows in a trial, one awake and one asleep each.
const PAIRS: usize = WINDOWS / 2;

/// The trial under way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Trial {
    /// Index of the current window.
    window: usize,
    /// When it started.
    window_start: u64,
    /// Requests finished in it so far, its first [`SETTLE_NS`] included.
    window_requests: u64,
    /// Requests finished and time spent in each pair of adjacent windows
    /// (AB, BA, BA, AB), waiting as rules 1-5 say (0) and asleep (1), each
    /// window's first [`SETTLE_NS`] left out.
    requests: [[u64; 2]; PAIRS],
    elapsed: [[u64; 2]; PAIRS],
}

impl Trial {
    /// Whether the sleeping windows so far finished fewer requests a second
    /// than the others by more than five times the budget (10% by default),
    /// over at least [`MIN_REQUESTS`] / 2 requests awake: the trial ends
    /// there, without the windows left: a trial where polling pays 10% or
    /// more costs one sleeping window instead of four.
    fn sleep_lost(&self, budget_pct: u64) -> bool {
        let sum = |v: &[[u64; 2]; PAIRS]| {
            v.iter()
                .fold([0, 0], |acc, p| [acc[0] + p[0], acc[1] + p[1]])
        };
        let (requests, elapsed) = (sum(&self.requests), sum(&self.elapsed));
        requests[0] >= MIN_REQUESTS / 2
            && asleep_vs_awake(requests, elapsed, budget_pct.saturating_mul(5)) == Ordering::Less
    }

    /// Whether the sleeping window under way, `spent` ns and at least
    /// [`GLANCE_NS`] into it, finished fewer than half the requests a second
    /// of the trial's awake windows so far (over at least [`MIN_REQUESTS`] /
    /// 2 of them): the trial ends there. Where polling pays that much, a
    /// trial costs a glance asleep instead of a window. The glance falls
    /// within the window's settling: no transient measured here ran below
    /// half the polling rate (0.54x at the least).
    fn sleep_routed(&self, spent: u64) -> bool {
        let (mut awake, mut awake_ns) = (0, 0);
        for (r, e) in self.requests.iter().zip(&self.elapsed) {
            awake += r[0];
            awake_ns += e[0];
        }
        spent >= GLANCE_NS
            && awake >= MIN_REQUESTS / 2
            && asleep_vs_awake([awake, self.window_requests], [awake_ns, spent], ROUT_PCT)
                == Ordering::Less
    }

    /// Whether sleeping was as fast, within `budget_pct` and the trial's own
    /// noise. Each pair of adjacent windows gives the sleeping window's rate
    /// over the other's: a host whose speed changes (this VM's varies
    /// twofold from one second to the next) moves both windows of a pair
    /// alike. Sleeping wins unless the pairs' mean falls behind by more than
    /// the budget plus the mean's standard error, the latter counted up to
    /// one more budget: a tie within the noise goes to the cheaper way, a
    /// loss beyond twice the budget never does. A trial that ended before
    /// its last window ended on a loss ([`Self::sleep_lost`],
    /// [`Self::sleep_routed`]): the pairs it left unfilled are no tie.
    fn sleep_won(&self, budget_pct: u64) -> bool {
        if self.window < WINDOWS {
            return false;
        }
        let ratios = self.ratios();
        let n = PAIRS as f64;
        let mean = ratios.iter().sum::<f64>() / n;
        let var = ratios.iter().map(|r| (r - mean) * (r - mean)).sum::<f64>() / (n - 1.0);
        let budget = budget_pct.min(100) as f64 / 100.0;
        let noise = (var.sqrt() / n.sqrt()).min(budget);
        mean >= 1.0 - budget - noise
    }

    /// Per pair, the sleeping window's rate over the other's, capped at 2
    /// (a pair with no request awake counts as a tie if none came asleep
    /// either).
    fn ratios(&self) -> [f64; PAIRS] {
        std::array::from_fn(|i| {
            let [t_awake, t_asleep] = self.elapsed[i];
            match self.requests[i] {
                [0, 0] => 1.0,
                [0, _] => 2.0,
                [awake, asleep] => {
                    let rate = |n: u64, t: u64| n as f64 / t as f64;
                    (rate(asleep, t_asleep) / rate(awake, t_awake)).min(2.0)
                }
            }
        })
    }
}

/// The sleeping side's rate against the other's less `margin_pct` percent
/// (requests per ns, compared as cross products; index 0 awake, 1 asleep).
fn asleep_vs_awake(requests: [u64; 2], elapsed: [u64; 2], margin_pct: u64) -> Ordering {
    let awake = u128::from(requests[0]) * u128::from(elapsed[1]);
    let asleep = u128::from(requests[1]) * u128::from(elapsed[0]);
    (asleep * 100).cmp(&(awake * u128::from(100 - margin_pct.min(100))))
}

/// Trials and their verdict: whether the thread sleeps until each event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Trials {
    /// The verdict of the last trial: sleep until each event.
    sleep: bool,
    /// How long the verdict is held (0: no trial yet).
    hold_ns: u64,
    /// When the next trial starts (0: not scheduled yet).
    next_at: u64,
    /// The last pass's time.
    last_at: u64,
    /// A trial found sleeping as fast while the thread polls: the next
    /// trial, at once, must find it too before the thread sleeps.
    confirming: bool,
    trial: Option<Trial>,
}

impl Trials {
    /// Whether the coming wait sleeps until an event (no window, no nap).
    pub(super) fn sleeping(&self) -> bool {
        match &self.trial {
            Some(t) => SLEEPS[t.window],
            None => self.sleep,
        }
    }

    /// A pass at `now_ns` (> 0) found `finished` requests finished by the
    /// pass before; `limited`: a queue of the thread is held back by its I/O
    /// limits. Returns whether [`Self::sleeping`] changed, and the verdict
    /// of a trial that ended with one (true: sleep). The first trial starts
    /// [`FIRST_TRIAL_NS`] after the first call.
    pub(super) fn observe(
        &mut self,
        now_ns: u64,
        finished: u64,
        budget_pct: u64,
        limited: bool,
    ) -> (bool, Option<bool>) {
        let before = self.sleeping();
        let mut verdict = None;
        let idle = self.last_at != 0 && now_ns.saturating_sub(self.last_at) >= IDLE_NS;
        self.last_at = now_ns;
        if self.next_at == 0 {
            self.next_at = now_ns.saturating_add(FIRST_TRIAL_NS);
        }
        if limited {
            self.drop_verdict(now_ns);
            return (self.sleeping() != before, None);
        }
        match &mut self.trial {
            Some(_) if idle => {
                self.trial = None;
                self.next_at = now_ns;
            }
            Some(t) => {
                let side = usize::from(SLEEPS[t.window]);
                let pair = t.window / 2;
                let spent = now_ns.saturating_sub(t.window_start);
                t.window_requests += finished;
                if spent > SETTLE_NS {
                    t.requests[pair][side] += finished;
                }
                let ended = if spent >= WINDOW_NS {
                    t.elapsed[pair][side] += spent - SETTLE_NS;
                    t.window += 1;
                    t.window_start = now_ns;
                    t.window_requests = 0;
                    t.window == WINDOWS || (side == 1 && t.sleep_lost(budget_pct))
                } else {
                    side == 1 && t.sleep_routed(spent)
                };
                if ended {
                    let t = *t;
                    self.trial = None;
                    verdict = self.conclude(&t, now_ns, budget_pct);
                }
            }
            None if now_ns >= self.next_at => {
                self.trial = Some(Trial {
                    window: 0,
                    window_start: now_ns,
                    window_requests: 0,
                    requests: [[0; 2]; PAIRS],
                    elapsed: [[0; 2]; PAIRS],
                });
            }
            None => {}
        }
        (self.sleeping() != before, verdict)
    }

    /// A limit holds a queue back: the requests finished a second are the
    /// limit's, whichever way the thread waits, so a trial cannot tell the
    /// two ways apart (it would find them level, and sleep). Worse, a thread
    /// that sleeps because its rate was capped cannot serve a raised cap:
    /// the share allocator raises caps towards what the device does and
    /// reads a shortfall as the export wanting no more (docs/qos.md). So the
    /// trial under way ends without a verdict, a verdict to sleep is
    /// dropped (the thread waits as rules 1-5 say, which sleep on the
    /// throttle timer while every queue is held), and no trial starts
    /// before [`HOLD_MIN_NS`] after the last pass that saw a queue held (a
    /// cap that lets go moves on for a while: the share allocator's).
    fn drop_verdict(&mut self, now_ns: u64) {
        self.trial = None;
        self.sleep = false;
        self.confirming = false;
        self.hold_ns = 0;
        self.next_at = now_ns.saturating_add(HOLD_MIN_NS);
    }

    /// The verdict of a finished trial, if it saw enough requests to give one.
    fn conclude(&mut self, t: &Trial, now_ns: u64, budget_pct: u64) -> Option<bool> {
        let mut verdict = None;
        if t.requests.iter().flatten().sum::<u64>() >= MIN_REQUESTS {
            let sleep = t.sleep_won(budget_pct);
            if sleep && !self.sleep && !std::mem::take(&mut self.confirming) {
                // Sleeping costs the most where it is wrong: a second trial
                // must agree before the thread stops polling.
                self.confirming = true;
                self.next_at = now_ns;
                return None;
            }
            self.confirming = false;
            self.hold_ns = if sleep == self.sleep && self.hold_ns != 0 {
                (self.hold_ns * 2).min(HOLD_MAX_NS)
            } else {
                HOLD_MIN_NS
            };
            self.sleep = sleep;
            verdict = Some(sleep);
        }
        self.next_at = now_ns.saturating_add(self.hold_ns.max(HOLD_MIN_NS));
        verdict
    }
}

//! The IOThread's event loop: waits for kicks, completions and commands
//! (epoll), busy-polls the rings and backends when its [`PollPolicy`] says so,
//! naps (hybrid polling), ignores stale edges, and runs the control
//! commands. Requests are popped and finished by the [`queue`](super::queue)
//! layer and executed by the [`executor`](super::executor).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use log::{debug, error, info};
use virtio_queue::QueueT;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::executor::{Executor, SlotId};
use super::queue::{Popped, QueueSlot, Release};
use super::queues::Queues;
use super::{Command, GuestMem, IoThreadSetup, QueueAttach, QueueKey};
use crate::clock::{clock_ns, monotonic_ns};
use crate::poll::{PollMode, PollPolicy, DEVICE_SOURCE, NAP_SAMPLE_NS};
use crate::stats::IoThreadStats;

mod commands;
mod throttle_timer;

/// epoll token of the command wake-up eventfd.
pub(super) const TOKEN_WAKE: u64 = 0;
/// epoll token of every backend's completion eventfd.
const TOKEN_COMPLETION: u64 = 1;
/// epoll token of the timer of queues held back by their I/O limits.
pub(super) const TOKEN_THROTTLE: u64 = 2;
/// epoll token of queue slot `i`'s kick fd: `TOKEN_KICK_BASE + i`.
const TOKEN_KICK_BASE: u64 = 16;

/// How the control plane reaches an IOThread.
pub(super) struct Channels {
    /// The thread's epoll set (the wake eventfd already in it).
    pub epoll: Epoll,
    /// Written after a command is sent.
    pub wake: Arc<EventFd>,
    /// Commands.
    pub rx: Receiver<Command>,
    /// Set before `wake` is written, so polling sees commands without a syscall.
    pub pending: Arc<AtomicBool>,
    /// A CLOCK_MONOTONIC timerfd (already in the epoll set, level-triggered,
    /// as [`TOKEN_THROTTLE`]): armed for the earliest time a queue held back
    /// by its I/O limits is due.
    pub throttle_timer: OwnedFd,
}

/// One IOThread's state: its queues, its executor, its polling policy.
pub(super) struct IoThread {
    name: String,
    epoll: Epoll,
    wake: Arc<EventFd>,
    rx: Receiver<Command>,
    pending: Arc<AtomicBool>,
    queues: Queues,
    executor: Executor,
    stats: Arc<IoThreadStats>,
    stopping: bool,
    /// Scratch list of (slot, memory snapshot) for a polling slice.
    poll_mems: Vec<(SlotId, Arc<GuestMem>)>,
    /// Scratch list of new backend completion fds to watch.
    new_fds: Vec<RawFd>,
    /// Queues whose pop budget ran out this pass: processed first next pass.
    carried: Vec<SlotId>,
    /// Scratch list of the queues a pass answered (notified).
    answered: Vec<SlotId>,
    /// Source 0 is the backends' completions, source 1 + i is queue slot i.
    policy: PollPolicy,
    /// A control command was handled during this pass.
    commanded: bool,
    /// The thread's finished requests at the start of the last pass (the
    /// policy weighs a wake-up against a request's round trip: requests held
    /// over requests finished per pass).
    finished_before: u64,
    /// The timer of held-back queues (see [`Channels::throttle_timer`]).
    throttle_timer: OwnedFd,
    /// When the timer fires (CLOCK_MONOTONIC ns; 0: disarmed).
    timer_at: u64,
    /// A queue was held back, became due or changed limits this pass: the
    /// timer is pointed at the earliest held queue at the end of the pass.
    timer_dirty: bool,
    /// Held-back queues became due this pass: they are served longest held
    /// first.
    due: bool,
}

impl IoThread {
    /// A thread named `name` with no queue yet.
    pub fn new(
        name: String,
        channels: Channels,
        stats: Arc<IoThreadStats>,
        setup: &IoThreadSetup,
    ) -> IoThread {
        let Channels {
            epoll,
            wake,
            rx,
            pending,
            throttle_timer,
        } = channels;
        IoThread {
            executor: Executor::new(name.clone(), setup.bounce_max, setup.seccomp),
            name,
            epoll,
            wake,
            rx,
            pending,
            queues: Queues::new(stats.clone()),
            stats,
            stopping: false,
            poll_mems: Vec::new(),
            new_fds: Vec::new(),
            carried: Vec::new(),
            answered: Vec::new(),
            policy: PollPolicy::new(setup.poll_mode, setup.poll_params, 1),
            commanded: false,
            finished_before: 0,
            throttle_timer,
            timer_at: 0,
            timer_dirty: false,
            due: false,
        }
    }

    /// Serves until stopped (and drained).
    pub fn run(&mut self) {
        if self.policy.mode() == PollMode::Adaptive {
            self.calibrate_naps();
        }
        debug!("{} started ({:?} polling)", self.name, self.policy.mode());
        let mut events = vec![EpollEvent::default(); 64];
        let mut ready: Vec<SlotId> = Vec::new();
        let mut sources: Vec<usize> = Vec::new();
        loop {
            if self.stopping && self.queues.inflight() == 0 {
                break;
            }
            self.commanded = false;
            let serving = self.serving();
            // The depth of the backend's pipeline weighs what a wake-up costs
            // (adaptive: a request's round trip, not one event interval). The
            // executor counts it; summing the queues' counts would walk every
            // queue slot on every pass.
            self.policy.observe_in_flight(self.executor.inflight());
            let finished = self.stats.requests.get();
            let finished_last = finished.saturating_sub(self.finished_before) as usize;
            self.policy.observe_finished(finished_last);
            self.finished_before = finished;
            let window = if serving { self.policy.poll_ns() } else { 0 };
            self.stats.poll_window_ns.set(window.min(i64::MAX as u64));
            let t0 = monotonic_ns();
            let mut completed = false;
            let mut polled_hit = false;
            let mut slept = false;
            // When a poll that found work ended, while nothing has happened
            // since.
            let mut polled_at = None;
            // Hybrid polling (adaptive): sleep through the part of the wait in
            // which no event is expected (notifications armed, as in any
            // sleep), then spin for the event the nap expected.
            let mut nap = if serving { self.policy.nap_at(t0) } else { 0 };
            if nap == 0 && window > 0 {
                // Now and then a timed nap before a spin, to measure the
                // timer again (PollPolicy::sample_nap_in_spin).
                nap = self.policy.sample_nap_in_spin(t0);
            }
            if window > 0 || nap > 0 {
                let mut deadline = window;
                if nap > 0 {
                    self.arm_notifications(&mut ready);
                    if ready.is_empty() {
                        self.stats.naps.add(1);
                        slept = true;
                        self.nap(nap, &mut events, &mut ready, &mut completed);
                        let spin = self.policy.nap_spin_ns();
                        deadline = deadline.max(monotonic_ns().saturating_sub(t0) + spin);
                    }
                }
                // A command handled during the nap (a queue to detach, say) is
                // answered at the end of this pass: do not spin or sleep first.
                if self.nothing_yet(&ready, completed) {
                    // Without a nap, t0 was read just before.
                    let t = if slept { monotonic_ns() } else { t0 };
                    slept = false;
                    self.stats.poll_attempts.add(1);
                    polled_hit = self.poll(deadline, t0, &mut ready, &mut completed);
                    let now = monotonic_ns();
                    self.stats.poll_ns.add(now.saturating_sub(t));
                    polled_at = polled_hit.then_some(now);
                }
            }
            if !polled_hit && !slept {
                // About to sleep: re-enable guest notifications, then look at the
                // rings once more, so a request that raced with this is never
                // stranded (vhost-user: the guest kicks only if asked to).
                self.arm_notifications(&mut ready);
            }
            if !polled_hit && !slept && self.nothing_yet(&ready, completed) {
                // Now and then a timed nap first, to measure the timer again
                // (PollPolicy::sample_nap): an event ends it as it would end
                // the sleep.
                let sample = if serving { self.policy.sample_nap() } else { 0 };
                if sample > 0 {
                    self.nap(sample, &mut events, &mut ready, &mut completed);
                }
                let t = monotonic_ns();
                // Until something real happens: a stale edge (see handle_events)
                // is not a reason to run a pass.
                while self.nothing_yet(&ready, completed) && !self.stopping {
                    // An idle thread holds no memory map.
                    self.executor.before_sleep();
                    self.wait_events(-1, &mut events, &mut ready, &mut completed);
                }
                self.stats.sleep_ns.add(monotonic_ns().saturating_sub(t));
            } else if self.pending.load(Ordering::Acquire) {
                self.wait_events(0, &mut events, &mut ready, &mut completed);
                polled_at = None;
            }
            // The pass's clock: the pop and completion time of what it
            // handles. A poll that found work ended just now: its clock read
            // serves (at QD1 with a polling driver, clock reads were 9% of the
            // thread's samples, four of them per pass).
            let t_end = polled_at.unwrap_or_else(monotonic_ns);
            if polled_hit {
                self.stats.poll_hits.add(1);
            }
            self.stats.passes.add(1);
            ready.sort_unstable();
            ready.dedup();
            if !ready.is_empty() {
                self.stats.passes_ready.add(1);
                if ready.len() > 1 {
                    self.stats.passes_ready_together.add(1);
                }
            }
            if std::mem::take(&mut self.due) {
                // Queues of one throttle told the same time compete for the
                // same credit: the one held longest asks first, so a queue
                // that just got through (and popped its next request at
                // once) does not win every round by its slot's place.
                let queues = &self.queues;
                ready.sort_by_key(|s| queues.get(*s).and_then(QueueSlot::held_since));
            }
            sources.clear();
            if completed {
                sources.push(DEVICE_SOURCE);
            }
            sources.extend(ready.iter().map(|s| s.0 + 1));
            // Keep kicks off while we expect to poll next time (the window
            // as the pass before left it: the policy learns this pass's
            // wait once its guests are answered).
            let rearm = self.window() == 0;
            for slot in ready.drain(..) {
                self.process_queue(slot, rearm, t_end);
            }
            ready.append(&mut self.carried);
            self.complete_all(t_end);
            // The guests are answered before the policy's bookkeeping
            // (several hundred instructions a pass): a blocking driver at
            // QD1 sleeps unless the call reaches it within a few hundred
            // nanoseconds of its request.
            self.answer();
            self.policy
                .update(t_end.saturating_sub(t0), &sources, polled_hit);
            self.policy.observe_events_at(t_end, &sources);
            // A queue held back by its limits (the timer is armed, or was
            // moved or fired this pass): its rate is the limit's.
            let limited = self.timer_at != 0 || self.timer_dirty;
            if let Some(slept) = self.policy.observe_pass(t_end, finished_last, limited) {
                self.stats.poll_trials.add(1);
                if slept {
                    self.stats.poll_trials_slept.add(1);
                }
            }
            self.after_answer();
        }
        info!(
            "{} stopped: {} requests served",
            self.name,
            self.stats.requests.get()
        );
    }

    /// Measures what a hybrid-polling nap costs on this host before serving:
    /// how late a short timed sleep ends and how much thread CPU it takes (in a
    /// VM each costs several microseconds: timer programming and the idle exit
    /// trap to the hypervisor). The policy sizes naps from these figures; later
    /// naps that end by their timer keep refining the lateness. About 1 ms.
    fn calibrate_naps(&mut self) {
        const NAPS: u64 = 32;
        let Ok(epoll) = Epoll::new() else {
            return;
        };
        let mut events = [EpollEvent::default(); 1];
        let mut late = Vec::with_capacity(NAPS as usize);
        let cpu0 = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID);
        for _ in 0..NAPS {
            let t = Instant::now();
            if epoll_pwait2(&epoll, &mut events, NAP_SAMPLE_NS).is_err() {
                return;
            }
            late.push((t.elapsed().as_nanos() as u64).saturating_sub(NAP_SAMPLE_NS));
        }
        // Median and 90th percentile: a nap preempted by another thread is not
        // a property of the timer.
        late.sort_unstable();
        let (median, p90) = (late[late.len() / 2], late[late.len() * 9 / 10]);
        self.policy.set_nap_late(median, p90 - median);
        let cpu = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID).saturating_sub(cpu0) / NAPS;
        self.policy.set_nap_cpu_ns(cpu);
        self.stats.nap_late_ns.set(self.policy.nap_late_ns());
        self.stats.nap_cpu_ns.set(cpu);
        debug!(
            "{}: a timed nap ends up to {} ns late and costs {} ns of CPU",
            self.name,
            self.policy.nap_late_ns(),
            cpu
        );
    }

    /// The polling window for this pass: none while stopping or with nothing to serve.
    fn window(&self) -> u64 {
        if self.serving() {
            self.policy.poll_ns()
        } else {
            0
        }
    }

    /// Whether this pass has nothing to act on yet: no ring with work, no
    /// completion, no command answered.
    fn nothing_yet(&self, ready: &[SlotId], completed: bool) -> bool {
        ready.is_empty() && !completed && !self.commanded
    }

    /// Whether any ring is being served (not stopping, some queue active and
    /// not held back by its limits: a thread whose queues all wait for their
    /// limits sleeps until its timer, it does not poll).
    fn serving(&self) -> bool {
        !self.stopping && self.queues.iter().any(|(_, q)| polled(q))
    }

    /// Busy-polls the rings, the backends and the command flag for at most
    /// `window` ns from `t0`. Returns true if anything turned up.
    fn poll(
        &mut self,
        window: u64,
        t0: u64,
        ready: &mut Vec<SlotId>,
        completed: &mut bool,
    ) -> bool {
        // One snapshot of each ring's memory for the whole polling slice: the
        // map is replaced only by the control plane, and an old snapshot
        // still maps the same guest pages.
        let mut mems = std::mem::take(&mut self.poll_mems);
        mems.clear();
        for (slot, q) in self.queues.iter_mut().filter(|(_, q)| polled(q)) {
            let mem = q.memory();
            // Polling: the guest need not kick.
            let _ = q.quiet(&mem);
            mems.push((slot, mem));
        }
        // A held-back queue that becomes due ends the slice too (busy
        // polling may never sleep on the timer): the timer's time (0: not
        // armed) is on the same clock.
        let due_at = self.timer_at;
        let mut spins = 0u32;
        let found = loop {
            for (slot, mem) in &mems {
                if self.queues.get(*slot).is_some_and(|q| q.has_avail(mem)) {
                    ready.push(*slot);
                }
            }
            if self.executor.has_completions() {
                *completed = true;
            }
            if !ready.is_empty() || *completed || self.pending.load(Ordering::Acquire) {
                break true;
            }
            spins = spins.wrapping_add(1);
            // Reading the clock costs more than a spin over the rings; look
            // at it every few spins.
            if spins.is_multiple_of(8) {
                let now = monotonic_ns();
                if due_at != 0 && now >= due_at {
                    self.collect_due(ready);
                    if !ready.is_empty() {
                        break true;
                    }
                }
                if now.saturating_sub(t0) >= window {
                    break false;
                }
            }
            std::hint::spin_loop();
        };
        // The snapshots go now, not at the next slice: a thread that sleeps
        // after this one holds no map (a removed region is unmapped when the
        // last map holding it goes).
        mems.clear();
        self.poll_mems = mems;
        found
    }

    /// Re-enables notifications on every ring that has them off; a ring that
    /// received work meanwhile goes to `ready`.
    fn arm_notifications(&mut self, ready: &mut Vec<SlotId>) {
        // A held-back queue stays quiet: its timer brings it back.
        for (slot, q) in self.queues.iter_mut().filter(|(_, q)| polled(q)) {
            if q.arm_or_break() {
                ready.push(slot);
            }
        }
    }

    /// A hybrid-polling nap: sleeps up to `nap_ns` (notifications armed) or until
    /// something real happens; a stale edge does not end it. A nap ended by its
    /// timer tells the policy how late the timer was.
    fn nap(
        &mut self,
        nap_ns: u64,
        events: &mut [EpollEvent],
        ready: &mut Vec<SlotId>,
        completed: &mut bool,
    ) {
        let start = monotonic_ns();
        // First take the stale edges (kicks and completions that polling already
        // served) without sleeping: each would otherwise cost a wake-up.
        self.wait_events(0, events, ready, completed);
        while self.nothing_yet(ready, *completed) {
            let left = nap_ns.saturating_sub(monotonic_ns().saturating_sub(start));
            if left == 0 {
                break;
            }
            let t = monotonic_ns();
            match self.wait_events_ns(left, events, ready, completed) {
                Some(0) => {
                    self.policy
                        .observe_nap(left, monotonic_ns().saturating_sub(t));
                    self.stats.nap_late_ns.set(self.policy.nap_late_ns());
                    break;
                }
                Some(_) => {}
                None => break,
            }
        }
        self.stats
            .sleep_ns
            .add(monotonic_ns().saturating_sub(start));
    }

    /// Like [`Self::wait_events`] with a timeout in nanoseconds (epoll_pwait2),
    /// for hybrid-polling naps.
    fn wait_events_ns(
        &mut self,
        timeout_ns: u64,
        events: &mut [EpollEvent],
        ready: &mut Vec<SlotId>,
        completed: &mut bool,
    ) -> Option<usize> {
        let n = match epoll_pwait2(&self.epoll, events, timeout_ns) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return None,
            Err(e) => {
                error!("{}: epoll_pwait2 failed: {e}", self.name);
                self.stopping = true;
                return None;
            }
        };
        self.handle_events(n, events, ready, completed);
        Some(n)
    }

    /// One epoll_wait: handles commands, notes completions, collects kicked rings.
    fn wait_events(
        &mut self,
        timeout_ms: i32,
        events: &mut [EpollEvent],
        ready: &mut Vec<SlotId>,
        completed: &mut bool,
    ) {
        let n = match self.epoll.wait(timeout_ms, events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return,
            Err(e) => {
                error!("{}: epoll_wait failed: {e}", self.name);
                self.stopping = true;
                return;
            }
        };
        self.handle_events(n, events, ready, completed);
    }

    /// Acts on the first `n` events epoll returned.
    fn handle_events(
        &mut self,
        n: usize,
        events: &[EpollEvent],
        ready: &mut Vec<SlotId>,
        completed: &mut bool,
    ) {
        let (mut kicked, mut signalled, mut stale) = (false, false, false);
        // A held-back queue came due (not a kick: counted apart from them).
        let mut due = false;
        for ev in &events[..n] {
            match ev.data() {
                TOKEN_WAKE => {
                    let _ = self.wake.read();
                    self.pending.store(false, Ordering::Release);
                    self.handle_commands();
                }
                // Edge-triggered too: nothing to read back. An edge may be
                // stale: raised while the thread was polling, its completion
                // already reaped.
                TOKEN_COMPLETION => {
                    if self.executor.has_completions() {
                        signalled = true;
                    } else {
                        stale = true;
                    }
                }
                // Level-triggered: read back, or it stays ready.
                TOKEN_THROTTLE => {
                    let mut expirations = [0u8; 8];
                    // SAFETY: reads at most 8 bytes into the live local buffer.
                    let _ = unsafe {
                        libc::read(
                            self.throttle_timer.as_raw_fd(),
                            expirations.as_mut_ptr().cast(),
                            expirations.len(),
                        )
                    };
                    self.timer_at = 0;
                    self.timer_dirty = true;
                    let before = ready.len();
                    self.collect_due(ready);
                    if ready.len() > before {
                        due = true;
                    } else {
                        stale = true;
                    }
                }
                t => {
                    let slot = SlotId(t.saturating_sub(TOKEN_KICK_BASE) as usize);
                    self.stats.kicks.add(1);
                    // Edge-triggered: every guest kick (an eventfd write)
                    // raises a new edge, so the counter need not be read
                    // back to zero: one syscall less per kick. The edge is
                    // stale if polling already took the request: with
                    // EVENT_IDX the first request after re-arming always
                    // kicks, even if the thread is polling by then.
                    let Some(q) = self.queues.get_mut(slot) else {
                        continue;
                    };
                    if q.has_work() {
                        ready.push(slot);
                        kicked = true;
                    } else {
                        stale = true;
                    }
                }
            }
        }
        if stale && !kicked && !signalled && !due {
            self.stats.stale_edges.add(1);
        }
        if signalled {
            *completed = true;
            self.stats.completion_wakeups.add(1);
        }
        if kicked {
            self.stats.kick_wakeups.add(1);
        }
    }

    /// Pops every available request of a queue and submits it. With `rearm`,
    /// guest notifications are re-enabled afterwards (the thread will sleep);
    /// without, they stay off (the thread will poll). `now` is the pass's clock.
    fn process_queue(&mut self, id: SlotId, rearm: bool, now: u64) {
        if self.stopping {
            return;
        }
        match self.queues.process(id, &mut self.executor, rearm, now) {
            // Its budget ran out: first in line next pass, which does not
            // wait (a non-empty ready list is work found).
            Popped::More => self.carried.push(id),
            // The timer is pointed at it at the end of the pass.
            Popped::Held(_) => self.timer_dirty = true,
            Popped::Drained | Popped::HandBack => {}
        }
    }

    /// Commits submissions and finishes every request the backends are done
    /// with (completed at `now`, the pass's clock); watches the completion
    /// fds of newly created backends.
    fn complete_all(&mut self, now: u64) {
        self.queues.deliver(&mut self.executor, now);
        self.executor.take_new_notify_fds(&mut self.new_fds);
        for fd in self.new_fds.drain(..) {
            let ev = EpollEvent::new(EventSet::IN | EventSet::EDGE_TRIGGERED, TOKEN_COMPLETION);
            if let Err(e) = self.epoll.ctl(ControlOperation::Add, fd, ev) {
                error!("{}: cannot watch a backend's completions: {e}", self.name);
            }
        }
    }

    /// End of a processing pass: one notification per queue that completed
    /// something, the memory maps no request holds any more let go (but the
    /// one in use), and detach replies for drained queues.
    fn finish_pass(&mut self) {
        self.answer();
        self.after_answer();
    }

    /// The first half of [`Self::finish_pass`]: one notification per queue
    /// that completed something (the guests answered, in `answered`), and
    /// the memory maps no request holds any more let go.
    fn answer(&mut self) {
        self.answered.clear();
        self.queues.notify(&mut self.answered);
        self.executor.end_pass();
    }

    /// The second half of [`Self::finish_pass`]: the policy told whom the
    /// pass answered, the timer re-armed, drained queues let go.
    fn after_answer(&mut self) {
        // A guest just answered is the source to expect next (its next
        // request follows the completions it was handed), however long it
        // was quiet while the backend worked; and a wait for an answer is
        // judged apart from a wait for the backend.
        self.policy
            .observe_answered(self.answered.iter().map(|s| s.0 + 1));
        if self.timer_dirty {
            self.rearm_timer();
        }
        for i in 0..self.queues.len() {
            let id = SlotId(i);
            let drained = self
                .queues
                .get(id)
                .is_some_and(|q| q.inflight == 0 && (q.releasing() || self.stopping));
            let Some(q) = drained.then(|| self.queues.remove(id)).flatten() else {
                continue;
            };
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                q.kick.as_raw_fd(),
                EpollEvent::default(),
            );
            debug!(
                "{}: released {} queue {}",
                self.name, q.device.name, q.key.queue
            );
            q.let_go();
        }
    }
}

/// Whether the thread polls a queue and arms its kicks: served and not held
/// back by its I/O limits.
fn polled(q: &QueueSlot) -> bool {
    q.active() && q.held_until().is_none()
}

/// `epoll_pwait2` with a timeout in nanoseconds (no signal mask).
fn epoll_pwait2(epoll: &Epoll, events: &mut [EpollEvent], timeout_ns: u64) -> io::Result<usize> {
    let ts = libc::timespec {
        tv_sec: (timeout_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (timeout_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: `EpollEvent` is `repr(transparent)` over `libc::epoll_event`, so
    // `events` is a valid buffer of `events.len()` epoll_event structs for the
    // kernel to fill; `ts` is a live timespec; a null sigmask means none.
    let n = unsafe {
        libc::epoll_pwait2(
            epoll.as_raw_fd(),
            events.as_mut_ptr().cast::<libc::epoll_event>(),
            events.len() as i32,
            &ts,
            std::ptr::null(),
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

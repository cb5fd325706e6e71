//! The queue slots of one IOThread ([`Queues`]) and what one pass of the
//! event loop does with a queue: pop within a budget, hand back what is
//! already finished after every pop with another behind it, call the driver
//! at most every [`CALL_EVERY`] pops, and at the end of the pass one
//! notification check per queue that published something. A single queue's ring is the
//! [`queue`](super::queue) layer's.

use std::sync::Arc;
use std::time::Instant;

use log::{error, warn};

use super::executor::{Executor, Finished, SlotId};
use super::queue::{Popped, QueueSlot};
use super::{GuestMem, QueueKey, QueueLog};
use crate::stats::IoThreadStats;

/// Requests one queue may pop in one pass of its IOThread. A guest that keeps
/// its ring full cannot make the thread's other queues (other VMs' disks among
/// them) wait for more than this many of its requests: what is left is popped
/// in the next pass, which comes at once (the thread does not sleep while a
/// queue has work carried over). 32 keeps a QD16-per-queue load within one
/// pass, so the budget costs nothing until a queue floods.
pub const POP_BUDGET: usize = 32;

/// Pops between calls inside a queue's pass. A pass hands back what is
/// already finished after every pop with another request behind it (the null
/// backend, device-model answers, errors; io_uring or RBD completions of
/// earlier requests when they are waiting): it publishes the used entries at
/// once, before it pops the next request. After the last one available the
/// pass ends, and its end publishes and calls. A driver (libblkio's, a
/// guest's) submits a request and looks at its used ring right after;
/// finding it empty, it arms `used_event` and sleeps, and waking a sleeping
/// driver costs far more than a publish (an interrupt, in a VM an exit and a
/// wake-up of the vCPU). Publishing each completion before the next pop
/// keeps an entry in front of it.
///
/// The call (an eventfd write, a system call of the IOThread's) is sent at
/// most every `CALL_EVERY` pops, and at the end of the pass: a driver that
/// writes `used_event` after every round of reaping (libblkio's does) asks
/// for a call even while it is awake, and a call per pop would make the
/// server the slower side. A sleeping driver waits at most `CALL_EVERY` pops
/// longer; a driver that is awake finds the entries without the call.
/// Calls only at the end of the pass would leave a sleeping driver waiting
/// for the whole pass. The pass goes on after each hand-back, within
/// [`POP_BUDGET`]. docs/performance.md has the measurements behind the
/// figure.
pub const CALL_EVERY: usize = 4;

/// The queue slots of one IOThread, indexed by [`SlotId`], with what
/// finishing a request needs (the thread's counters, the warning limiter).
pub(super) struct Queues {
    slots: Vec<Option<QueueSlot>>,
    stats: Arc<IoThreadStats>,
    warn: WarnLimiter,
    /// Scratch list of finished requests.
    finished: Vec<Finished>,
}

impl Queues {
    /// No queue yet.
    pub fn new(stats: Arc<IoThreadStats>) -> Queues {
        Queues {
            slots: Vec::new(),
            stats,
            warn: WarnLimiter::default(),
            finished: Vec::with_capacity(super::executor::SCRATCH_CAPACITY),
        }
    }

    /// The slot `id`, if it serves a queue.
    pub fn get(&self, id: SlotId) -> Option<&QueueSlot> {
        self.slots.get(id.0).and_then(Option::as_ref)
    }

    /// The slot `id`, if it serves a queue.
    pub fn get_mut(&mut self, id: SlotId) -> Option<&mut QueueSlot> {
        self.slots.get_mut(id.0).and_then(Option::as_mut)
    }

    /// Switches dirty logging of every slot serving `key` (a draining one
    /// too: its last requests are logged).
    pub fn set_log(&mut self, key: QueueKey, log: Option<QueueLog>) {
        for q in self.slots.iter_mut().flatten().filter(|q| q.key == key) {
            q.set_log(log.clone());
        }
    }

    /// Number of slots (served or free); slot ids are below it.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// The served queues with their slot ids.
    pub fn iter(&self) -> impl Iterator<Item = (SlotId, &QueueSlot)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, q)| q.as_ref().map(|q| (SlotId(i), q)))
    }

    /// The served queues with their slot ids.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (SlotId, &mut QueueSlot)> {
        self.slots
            .iter_mut()
            .enumerate()
            .filter_map(|(i, q)| q.as_mut().map(|q| (SlotId(i), q)))
    }

    /// The slot serving `key` (not detaching).
    pub fn find(&self, key: QueueKey) -> Option<SlotId> {
        self.iter()
            .find(|(_, q)| q.key == key && !q.releasing())
            .map(|(id, _)| id)
    }

    /// Serves `q` in the first free slot.
    pub fn insert(&mut self, q: QueueSlot) -> SlotId {
        let i = match self.slots.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.slots[i] = Some(q);
        SlotId(i)
    }

    /// The id the next [`Queues::insert`] will use.
    pub fn next_free(&self) -> SlotId {
        SlotId(
            self.slots
                .iter()
                .position(Option::is_none)
                .unwrap_or(self.slots.len()),
        )
    }

    /// Stops serving slot `id`.
    pub fn remove(&mut self, id: SlotId) -> Option<QueueSlot> {
        self.slots.get_mut(id.0).and_then(Option::take)
    }

    /// Requests popped and not yet finished, over all queues.
    pub fn inflight(&self) -> usize {
        self.iter().map(|(_, q)| q.inflight).sum()
    }

    /// Pops and executes the available requests of queue `id`, up to its
    /// budget for the pass, handing back finished requests after every pop
    /// (published; the driver called, if it asked, every [`CALL_EVERY`]
    /// pops); counts a ring found broken and a budget used up. `now` is the
    /// pass's clock (when its wait ended): the pop time of what it pops and
    /// the completion time of what it finishes, so the latency histogram
    /// costs no clock read of its own, until a backend other than null was
    /// handed work ([`Executor::clock`]).
    pub fn process(&mut self, id: SlotId, exec: &mut Executor, rearm: bool, now: u64) -> Popped {
        let Some(mem) = self.get_mut(id).map(QueueSlot::take_pass_memory) else {
            return Popped::Drained;
        };
        let mut budget = POP_BUDGET;
        let mut uncalled = 0;
        let popped = loop {
            let (popped, n) = self.process_some(id, exec, rearm, now, &mem, budget);
            if popped != Popped::HandBack {
                break popped;
            }
            // Early hand-back (see CALL_EVERY): publish what is done, call
            // every CALL_EVERY pops if the driver asked, go on within the
            // pass's budget. The end of the pass calls for the rest.
            self.deliver(exec, now);
            uncalled += n;
            if uncalled >= CALL_EVERY {
                self.notify_one(id, &mem);
                uncalled = 0;
            }
            budget -= n;
            if budget == 0 {
                self.stats.budget_exhausted.add(1);
                break Popped::More;
            }
        };
        // Kept for the pass's call (`notify`), which takes it.
        if let Some(q) = self.get_mut(id) {
            q.pass_mem = Some(mem);
        }
        popped
    }

    /// [`QueueSlot::process`] within `budget`, counted; also how many it popped.
    fn process_some(
        &mut self,
        id: SlotId,
        exec: &mut Executor,
        rearm: bool,
        now: u64,
        mem: &Arc<GuestMem>,
        budget: usize,
    ) -> (Popped, usize) {
        let Some(q) = self.slots.get_mut(id.0).and_then(Option::as_mut) else {
            return (Popped::Drained, 0);
        };
        let was_broken = q.broken();
        let inflight = q.inflight;
        let popped = q.process(id, exec, rearm, now, mem, budget);
        // Nothing finishes during `process`: the growth is what it popped.
        let n = q.inflight.saturating_sub(inflight);
        self.stats.popped.add(n as u64);
        q.counters().popped.add(n as u64);
        if !was_broken && q.broken() {
            self.stats.broken_rings.add(1);
        }
        if popped == Popped::More {
            self.stats.budget_exhausted.add(1);
        }
        (popped, n)
    }

    /// Finishes every request the executor is done with: the one place a
    /// request's status is written and its used entry added. `now` is the
    /// pass's clock: the completion time, unless a backend other than null
    /// was handed work since ([`Executor::clock`]).
    pub fn deliver(&mut self, exec: &mut Executor, now: u64) {
        let mut finished = std::mem::take(&mut self.finished);
        exec.complete(&mut finished);
        let published = self.stats.used_publishes.get();
        if finished.is_empty() {
            self.finished = finished;
            return;
        }
        let now = exec.clock(now);
        // Each is read where it is, in the executor's table, and retired
        // after all are published.
        for f in &finished {
            let Some(done) = exec.done(f) else {
                continue;
            };
            match self
                .slots
                .get_mut(done.ticket.slot.0)
                .and_then(Option::as_mut)
            {
                Some(q) => q.finish(
                    &done,
                    f.result.as_ref().map_err(|e| &**e),
                    &self.stats,
                    &mut self.warn,
                    now,
                ),
                None => error!(
                    "completion for a released queue slot {:?}",
                    done.ticket.slot
                ),
            }
        }
        exec.retire(&mut finished);
        if self.stats.used_publishes.get() != published {
            self.stats.used_batches.add(1);
        }
        self.finished = finished;
    }

    /// The notification of one queue, inside a pass (an early hand-back),
    /// with the pass's memory snapshot.
    fn notify_one(&mut self, id: SlotId, mem: &GuestMem) {
        if let Some(q) = self.slots.get_mut(id.0).and_then(Option::as_mut) {
            q.notify_guest(mem, &self.stats);
        }
    }

    /// One notification per queue that published something since the last
    /// check; the end of a pass. The slots answered are added to `answered`.
    pub fn notify(&mut self, answered: &mut Vec<SlotId>) {
        for (i, q) in self.slots.iter_mut().enumerate() {
            let Some(q) = q.as_mut() else {
                continue;
            };
            // No snapshot outlives its pass.
            if !q.unnotified() {
                q.pass_mem = None;
                continue;
            }
            // The pass's snapshot, taken when a kick was looked at or the
            // queue processed (microseconds old; an older map still maps the
            // ring's pages), else a new one for a queue that published
            // without being processed (a backend's completion).
            let mem = q.take_pass_memory();
            q.notify_guest(&mem, &self.stats);
            answered.push(SlotId(i));
        }
    }
}

/// Rate limit for per-request warnings.
#[derive(Default)]
pub(super) struct WarnLimiter {
    window: Option<Instant>,
    count: u32,
    suppressed: u64,
}

impl WarnLimiter {
    /// At most 10 warnings per second per IOThread.
    pub fn allow(&mut self) -> bool {
        let now = Instant::now();
        match self.window {
            Some(w) if now.duration_since(w).as_secs() < 1 => {}
            _ => {
                if self.suppressed > 0 {
                    warn!("{} similar warnings suppressed", self.suppressed);
                }
                self.window = Some(now);
                self.count = 0;
                self.suppressed = 0;
            }
        }
        self.count += 1;
        if self.count > 10 {
            self.suppressed += 1;
            false
        } else {
            true
        }
    }
}

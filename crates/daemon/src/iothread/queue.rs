//! One virtqueue an IOThread serves ([`QueueSlot`]): popping and parsing
//! requests (through the device model) within the budget a pass gives it,
//! resubmitting what a dead daemon left in flight, stopping a ring found in
//! an impossible state, notification suppression in both directions (kicks
//! the driver need not send, calls it did not ask for), and finishing a
//! request (status byte, used ring entry, counters). How a slot leaves its
//! thread is in [`release`]; the table of slots and the pass over them in
//! [`queues`](super::queues).

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::sync::Arc;

use log::{debug, error, warn};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestAddressSpace};

use super::executor::{Done, Executor, SlotId};
use super::queues::WarnLimiter;
use super::state::{Kicks, SlotState, Unnotified};
use super::{BlockDevice, ExecuteError, GuestMem, GuestMemHandle, QueueAttach, QueueKey, QueueLog};
use crate::clock::monotonic_ns;
use crate::fastpath::{SmallAccess, SplitRing};
use crate::inflight::InflightQueue;
use crate::qos::{Admission, Direction, Gate, SharedThrottle};
use crate::stats::{IoThreadStats, QueueCounters};
use crate::virtio::request::{self, Operation, Rejected, ReqKind, Request};
use crate::virtio::status;

mod release;
pub(super) use release::Release;

/// What [`QueueSlot::process`] left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Popped {
    /// The ring is empty (or stopped).
    Drained,
    /// The pass's budget ran out with requests still available.
    More,
    /// A request was popped and finished work waits to be published: publish
    /// (and call, see [`CALL_EVERY`](super::queues::CALL_EVERY)) now, then process the queue again
    /// (inside [`Queues::process`](super::queues::Queues::process) only).
    HandBack,
    /// The head request waits for the queue's I/O limits until this time
    /// (CLOCK_MONOTONIC ns): nothing more is popped before then.
    Held(u64),
}

/// A request popped and parsed that the queue's throttle has not admitted
/// yet. It stays the queue's head: nothing behind it is popped before it
/// goes, so the queue's requests keep their order.
struct Held {
    /// As parsed (a throttle holds back well-formed reads and writes only).
    parsed: Result<Request, Rejected>,
    /// When to ask the throttle again (CLOCK_MONOTONIC ns).
    until: u64,
    /// When it was first held back (CLOCK_MONOTONIC ns), for `throttled_ns`.
    since: u64,
}

/// What a request costs under the I/O limits: its direction and bytes.
/// Discard and write-zeroes are writes of their range, as QEMU's throttle
/// node counts them; flush and GET_ID are not throttled (None).
fn throttled_as(op: &Operation) -> Option<(Direction, u64)> {
    match op {
        Operation::Read { .. } => Some((Direction::Read, op.data_len())),
        Operation::Write { .. } => Some((Direction::Write, op.data_len())),
        Operation::Discard { num_sectors, .. } | Operation::WriteZeroes { num_sectors, .. } => {
            Some((Direction::Write, u64::from(*num_sectors) * 512))
        }
        Operation::Flush | Operation::GetId { .. } => None,
    }
}

/// Whether `gate` holds back a request popped at `now` (the pass's clock,
/// which is the limits' clock), the head of `waiting` requests: Some(until)
/// if it must wait (counted), None if it may go (admitted and accounted, or
/// not throttled). Off the unthrottled path, which only tests for a gate.
#[inline(never)]
fn must_wait(
    gate: &Gate,
    counters: &QueueCounters,
    parsed: &Result<Request, Rejected>,
    waiting: usize,
    now: u64,
) -> Option<u64> {
    let until = admission(gate, parsed, waiting, now)?;
    counters.throttled.add(1);
    Some(until)
}

/// Asks `gate` for a parsed request at the head of `waiting` requests:
/// None if it may go (accounted; a rejected request is not throttled), or
/// the time to ask again, when several of them may go
/// ([`Gate::admit_head`]).
fn admission(
    gate: &Gate,
    parsed: &Result<Request, Rejected>,
    waiting: usize,
    now_ns: u64,
) -> Option<u64> {
    let (dir, bytes) = throttled_as(&parsed.as_ref().ok()?.op)?;
    match gate.admit_head(dir, bytes, waiting, now_ns) {
        Admission::Go => None,
        Admission::WaitUntil(t) => Some(t),
    }
}

/// A virtqueue served by this thread.
pub(super) struct QueueSlot {
    /// Which queue.
    pub key: QueueKey,
    queue: Queue,
    /// The guest's kick eventfd (in the thread's epoll set while served).
    pub kick: File,
    /// The eventfd to signal the guest with (None: poll mode frontend).
    pub call: Option<File>,
    mem: GuestMemHandle,
    /// The memory snapshot of the current pass: taken when a kick is
    /// looked at or when the pass processes the queue, used by what follows
    /// in the pass, and dropped by its call at the end ([`Queues::notify`]
    /// takes it): one snapshot of the map per pass, not two or three (each
    /// is an `ArcSwap` load, about 75-120 instructions).
    pub(super) pass_mem: Option<Arc<GuestMem>>,
    /// The device the queue belongs to.
    pub device: Arc<BlockDevice>,
    counters: Arc<QueueCounters>,
    /// Requests popped and not yet finished.
    pub inflight: usize,
    /// Used entries the driver has not been considered for a call about.
    unnotified: Unnotified,
    /// The avail index as last read: requests up to it are popped without
    /// reading it again. The driver writes that cache line on every
    /// submission, so each read is a cache-line transfer from its CPU, and a
    /// pass that hands back after every pop re-enters
    /// [`QueueSlot::process`] once per request.
    avail_seen: u16,
    /// Serving, stopped as broken, or being released.
    state: SlotState,
    /// Whether the driver is asked to kick: armed before sleeping, quiet
    /// while the thread polls.
    kicks: Kicks,
    /// The queue's inflight record (INFLIGHT_SHMFD negotiated), None otherwise.
    record: Option<InflightQueue>,
    /// Heads a dead daemon left in flight, executed before anything new.
    resubmit: VecDeque<u16>,
    /// When each head (by index) was popped, on the pass clock
    /// ([`crate::clock::monotonic_ns`]), for the latency histogram.
    popped_at: Box<[u64]>,
    /// The migration dirty log while it is on (vhost-user VHOST_F_LOG_ALL).
    log: Option<QueueLog>,
    /// What the queue's requests draw on: the I/O limits (its export's, or
    /// its throttle group's, shared with their other queues) and the
    /// export's share cap; None: neither, and the request path pays one
    /// branch.
    gate: Option<Gate>,
    /// The head request, popped and held back by the throttle.
    held: Option<Held>,
    /// The requests the queue had outstanding when the limits were last
    /// asked again for its held head (0: never held): its driver's depth
    /// at the limit ([`QueueSlot::outstanding`]).
    depth: usize,
}

impl QueueSlot {
    /// Starts serving an attached queue; its counters come from the thread's
    /// statistics.
    pub fn new(a: QueueAttach, counters: Arc<QueueCounters>) -> QueueSlot {
        let (record, resubmit) = match a.inflight {
            Some(t) => (Some(t.record), t.resubmit),
            None => (None, Vec::new()),
        };
        let size = a.queue.size() as usize;
        let avail_seen = a.queue.next_avail();
        // Read once, when the queue arrives; later changes come as commands.
        let gate = Gate::new(a.device.throttle(), a.device.share());
        QueueSlot {
            key: a.key,
            queue: a.queue,
            kick: a.kick,
            call: a.call,
            mem: a.mem,
            pass_mem: None,
            device: a.device,
            counters,
            inflight: 0,
            unnotified: Unnotified::default(),
            avail_seen,
            state: SlotState::Serving,
            kicks: Kicks::Armed,
            popped_at: vec![monotonic_ns(); size].into(),
            record,
            resubmit: resubmit.into(),
            log: a.log,
            gate,
            held: None,
            depth: 0,
        }
    }

    /// Replaces the queue's I/O limits, and takes the export's share cap if
    /// it got one since. A request held back is due at once: the next pass
    /// asks the new gate (None: it goes).
    pub fn set_throttle(&mut self, throttle: Option<Arc<SharedThrottle>>) {
        self.gate = Gate::new(throttle, self.device.share());
        if let Some(h) = &mut self.held {
            h.until = 0;
        }
    }

    /// Until when the head request is held back by the I/O limits (None:
    /// nothing held). A held queue is not work for polling or kicks until
    /// then: its IOThread's timer brings it back.
    pub fn held_until(&self) -> Option<u64> {
        self.held.as_ref().map(|h| h.until)
    }

    /// Since when the head request has been held back (None: nothing held).
    pub fn held_since(&self) -> Option<u64> {
        self.held.as_ref().map(|h| h.since)
    }

    /// Submits the held-back head at once, unthrottled: the queue is being
    /// released (GET_VRING_BASE, disconnect, `queue-move`, stop), and a drain
    /// never waits for the limits.
    pub fn submit_held(&mut self, id: SlotId, exec: &mut Executor) {
        if let Some(h) = self.held.take() {
            let mem = self.memory();
            self.run_held(id, h, exec, &mem, monotonic_ns());
        }
    }

    /// Executes a held-back request that may go now, counting how long it
    /// waited.
    fn run_held(
        &mut self,
        id: SlotId,
        h: Held,
        exec: &mut Executor,
        mem: &Arc<GuestMem>,
        now: u64,
    ) {
        self.counters.throttled_ns.add(now.saturating_sub(h.since));
        exec.execute(id, h.parsed, mem, &self.device);
    }

    /// Switches dirty logging on (Some) or off (None).
    pub fn set_log(&mut self, log: Option<QueueLog>) {
        self.log = log;
    }

    /// Marks the used ring dirty after the daemon wrote into it, while a
    /// migration logs (one predictable branch otherwise).
    #[inline]
    fn log_used(&self) {
        if let Some(log) = &self.log {
            log.mark_used(self.queue.size());
        }
    }

    /// Whether the thread should look at this ring at all.
    pub fn active(&self) -> bool {
        self.state.active()
    }

    /// A snapshot of the guest memory map.
    pub fn memory(&self) -> Arc<GuestMem> {
        self.mem.memory().into_inner()
    }

    /// The pass's snapshot of the memory map ([`QueueSlot::pass_mem`]),
    /// taken out of the slot: the one the pass already loaded, or a new one.
    pub(super) fn take_pass_memory(&mut self) -> Arc<GuestMem> {
        self.pass_mem.take().unwrap_or_else(|| self.memory())
    }

    /// Drops the pass's snapshot of the memory map, if one was loaded: the
    /// connection replaced the map ([`super::Command::NewMemory`]), and the
    /// pass must pop with the new one.
    pub fn forget_pass_memory(&mut self) {
        self.pass_mem = None;
    }

    /// The next avail index (GET_VRING_BASE).
    pub fn next_avail(&self) -> u16 {
        self.queue.next_avail()
    }

    /// Tells the guest it need not kick (EVENT_IDX: avail_event stays behind;
    /// otherwise VRING_USED_F_NO_NOTIFY), unless that is already so: without
    /// EVENT_IDX every toggle is a write to a guest cache line.
    /// Checked on every entry into [`QueueSlot::process`] (once per request
    /// at QD16): the check is inlined there, the toggle is not.
    #[inline(always)]
    pub fn quiet(&mut self, mem: &GuestMem) -> Result<(), virtio_queue::Error> {
        if self.kicks == Kicks::Armed {
            self.disable_kicks(mem)?;
        }
        Ok(())
    }

    #[inline(never)]
    fn disable_kicks(&mut self, mem: &GuestMem) -> Result<(), virtio_queue::Error> {
        SplitRing::of(&self.queue).disable_notification(mem, &self.queue)?;
        self.kicks = Kicks::Quiet;
        self.log_used();
        Ok(())
    }

    /// Asks the guest to kick again; true if requests arrived while it did
    /// not. Called with kicks off: by `process` after `quiet`, and by
    /// [`QueueSlot::arm_or_break`] for a ring not armed yet.
    fn arm(&mut self, mem: &GuestMem) -> Result<bool, virtio_queue::Error> {
        let more = SplitRing::of(&self.queue).enable_notification(mem, &self.queue)?;
        self.kicks = Kicks::Armed;
        self.log_used();
        Ok(more)
    }

    /// Re-enables guest notifications, unless they are on already; true if
    /// requests arrived meanwhile. A ring that cannot be accessed is marked
    /// broken (false).
    pub fn arm_or_break(&mut self) -> bool {
        // Armed already (the pass re-armed it when it found the ring empty):
        // no memory snapshot to take (an `ArcSwap` load before every sleep).
        if self.kicks == Kicks::Armed {
            return false;
        }
        let mem = self.mem.memory();
        match self.arm(&mem) {
            Ok(more) => more,
            Err(e) => {
                self.break_ring(e);
                false
            }
        }
    }

    /// The requests the queue has outstanding: in flight (a held head among
    /// them) and `behind` its head in the avail ring (at most a ring's
    /// worth: an index the pop loop would find impossible counts for nothing
    /// more, the loop stops the ring when it gets there).
    ///
    /// A held head waits to release as many together ([`Gate::admit_head`]),
    /// or its queue's depth when it was last due, if that is more.
    /// Those in flight count because a driver that keeps its depth at the
    /// limit sends each again as it completes; and the depth is remembered
    /// because that driver's requests come back one at a time after a batch:
    /// the first is held before the others are there. Counting only what
    /// is in the ring when the head is held splits the depth into batches
    /// that alternate, and wakes the thread twice as often or more. A driver
    /// that sends fewer leaves a head waiting at most
    /// [`BATCH_DELAY_NS`](crate::qos::throttle::BATCH_DELAY_NS) longer, once
    /// (the next release measures its depth again), and the limits lose
    /// nothing by it.
    fn outstanding(&self, behind: u16) -> usize {
        self.inflight + usize::from(behind).min(usize::from(self.queue.size()))
    }

    /// The requests available behind the head (the avail index read now).
    fn behind(&self, mem: &GuestMem) -> u16 {
        self.avail_idx(mem)
            .map_or(0, |idx| idx.wrapping_sub(self.queue.next_avail()))
    }

    /// Whether the guest made requests available that we have not popped yet.
    pub fn has_avail(&self, mem: &GuestMem) -> bool {
        // The poll loop reads it on every spin.
        self.avail_idx(mem)
            .is_ok_and(|idx| idx != self.queue.next_avail())
    }

    /// The avail ring's index, read only if every request up to `known` (an
    /// index read before) is popped.
    fn avail_idx_after(&self, mem: &GuestMem, known: u16) -> Result<u16, virtio_queue::Error> {
        if known != self.queue.next_avail() {
            return Ok(known);
        }
        self.avail_idx(mem)
    }

    /// The avail ring's index (Acquire: the entries before it are visible).
    fn avail_idx(&self, mem: &GuestMem) -> Result<u16, virtio_queue::Error> {
        SplitRing::of(&self.queue).avail_idx(mem)
    }

    /// The head the driver put at avail ring position `index`.
    fn avail_head(&self, mem: &GuestMem, index: u16) -> Result<u16, virtio_queue::Error> {
        SplitRing::of(&self.queue).avail_head(mem, index)
    }

    /// Puts `head` with `len` bytes written on the used ring and publishes
    /// it: virtio-queue's `add_used` (see [`SplitRing::add_used`]).
    fn add_used(&mut self, mem: &GuestMem, head: u16, len: u32) -> Result<(), virtio_queue::Error> {
        let ring = SplitRing::of(&self.queue);
        ring.add_used(mem, &mut self.queue, head, len)
    }

    /// [`QueueSlot::has_avail`] on a snapshot of the memory map, or heads to
    /// resubmit: whether a kick brought work. A snapshot that found work is
    /// kept as the pass's ([`QueueSlot::pass_mem`]): the pass that pops what
    /// the kick announced uses it instead of loading the map again. One that
    /// found none is dropped: a stale kick comes while the thread sleeps,
    /// which it goes on doing, and a map kept through the sleep would miss a
    /// region the frontend added meanwhile (ADD_MEM_REG) for the requests
    /// the next kick announces.
    /// A queue whose head is held back has none: a kick is looked at when
    /// the head is due.
    pub fn has_work(&mut self) -> bool {
        if self.held.is_some() {
            return false;
        }
        if self.resubmit_pending() {
            return true;
        }
        let mem = self.take_pass_memory();
        let work = self.has_avail(&mem);
        if work {
            self.pass_mem = Some(mem);
        }
        work
    }

    /// Whether heads left in flight by a dead daemon wait to be executed again.
    fn resubmit_pending(&self) -> bool {
        !self.resubmit.is_empty()
    }

    /// Executes again, in their original pop order, the heads a dead daemon had
    /// popped and not completed (vhost-user "Inflight I/O tracking"), within the
    /// pass's `budget`. Their record stays as it is (flag and counter): they are
    /// completed like any other request. A head outside the ring is an
    /// impossible state (the frontend changed the region or the ring size).
    fn resubmit(
        &mut self,
        id: SlotId,
        exec: &mut Executor,
        mem: &Arc<GuestMem>,
        budget: &mut usize,
        now: u64,
    ) {
        let size = self.queue.size();
        let table = GuestAddress(self.queue.desc_table());
        while *budget > 0 {
            let Some(head) = self.resubmit.pop_front() else {
                break;
            };
            *budget -= 1;
            if head >= size {
                self.stop_ring(format_args!(
                    "inflight region: head {head} to resubmit is outside the {size}-entry ring"
                ));
                return;
            }
            let parsed = request::parse_head(&**mem, table, size, head, &self.device.limits);
            self.popped_at[head as usize] = exec.clock(now);
            self.inflight += 1;
            exec.execute(id, parsed, mem, &self.device);
        }
        if !self.resubmit_pending() {
            // Done with recovery: give the memory back.
            self.resubmit = VecDeque::new();
        }
    }

    fn break_ring(&mut self, e: virtio_queue::Error) {
        self.stop_ring(format_args!("ring not accessible ({e})"));
    }

    /// A ring in an impossible state is a broken ring: it is not touched again
    /// (no busy loop on a state that cannot make progress), counted and logged
    /// once; the frontend's messages are still answered, every other ring
    /// keeps being served, and the next vring setup or reconnection attaches
    /// a fresh slot.
    fn stop_ring(&mut self, why: std::fmt::Arguments) {
        if self.state.break_ring() {
            error!(
                "{} queue {}: {why}; queue stopped until the frontend sets it up again",
                self.device.name, self.key.queue
            );
        }
    }

    /// Whether the ring was stopped as broken.
    pub fn broken(&self) -> bool {
        self.state.broken()
    }

    /// The queue's counters.
    pub fn counters(&self) -> &QueueCounters {
        &self.counters
    }

    /// Whether used entries were published since the driver was last
    /// considered for a call.
    pub fn unnotified(&self) -> bool {
        self.unnotified.pending()
    }

    /// Pops at most [`POP_BUDGET`](super::queues::POP_BUDGET) available requests, parses them and hands
    /// them to `exec`. With `rearm` and the ring drained, guest notifications
    /// are re-enabled afterwards (the thread will sleep; a request that raced
    /// with that is popped too); otherwise they stay off (the thread will
    /// poll, or come back for what the budget left).
    /// `now` is the pass's clock (the pop time of what it pops, re-read
    /// after a backend other than null was handed work: [`Executor::clock`];
    /// and the time the I/O limits admit it at), `mem` its
    /// snapshot of the guest memory (taken once per pass, not per hand-back:
    /// the map only changes between passes).
    pub fn process(
        &mut self,
        id: SlotId,
        exec: &mut Executor,
        rearm: bool,
        now: u64,
        mem: &Arc<GuestMem>,
        mut budget: usize,
    ) -> Popped {
        if !self.active() {
            return Popped::Drained;
        }
        if self.resubmit_pending() {
            self.resubmit(id, exec, mem, &mut budget, now);
            if self.resubmit_pending() || !self.active() {
                return if !self.active() {
                    Popped::Drained
                } else {
                    Popped::More
                };
            }
        }
        // The held-back head goes first, when the limits let it; those
        // behind it follow in the loop below as long as the limits admit
        // them, as one batch: no early hand-back (see CALL_EVERY) while they
        // are popped. Their driver, all of whose requests waited, sleeps
        // until called: a hand-back every few pops would wake it once for
        // each, where the end of the pass calls it once for the batch, tens
        // of microseconds later for requests that waited milliseconds.
        let mut batch = false;
        if let Some(h) = self.held.take() {
            // At its due time the driver has sent again what it got back:
            // what is outstanding now is its depth.
            self.depth = self.outstanding(self.behind(mem));
            let waiting = self.depth;
            match self
                .gate
                .as_ref()
                .and_then(|g| admission(g, &h.parsed, waiting, now))
            {
                Some(until) => {
                    self.held = Some(Held { until, ..h });
                    return Popped::Held(until);
                }
                None => {
                    self.run_held(id, h, exec, mem, now);
                    batch = true;
                }
            }
        }
        loop {
            if let Err(e) = self.quiet(mem) {
                self.break_ring(e);
                return Popped::Drained;
            }
            // The checks of virtio-queue's `iter`, but an impossible avail
            // index (more than the queue size ahead of next_avail), a ring
            // that is not ready or an entry that cannot be read stops the
            // ring: taken as "nothing to pop" while the avail index still
            // says there is work, the thread would spin on it forever.
            let size = self.queue.size();
            let table = GuestAddress(self.queue.desc_table());
            if !self.queue.ready() || self.queue.avail_ring() == 0 {
                self.stop_ring(format_args!("impossible avail ring state (not ready)"));
                return Popped::Drained;
            }
            // The avail index is read again only once every request up to
            // the one last read is popped (`avail_seen`: read here, or by
            // the look at the end of a pass below); a known index is
            // checked below all the same.
            let known = self.avail_seen;
            let last = match self.avail_idx_after(mem, known) {
                Ok(idx) if idx.wrapping_sub(self.queue.next_avail()) <= size => {
                    self.avail_seen = idx;
                    idx
                }
                Ok(idx) => {
                    let next = self.queue.next_avail();
                    self.stop_ring(format_args!(
                        "impossible avail ring state (avail index {idx}, {next} popped, \
                         {size} entries)"
                    ));
                    return Popped::Drained;
                }
                Err(e) => {
                    self.stop_ring(format_args!("impossible avail ring state ({e})"));
                    return Popped::Drained;
                }
            };
            let mut popped_one = false;
            while budget > 0 {
                // Nothing more known to be available: no hand-back (below).
                let next = self.queue.next_avail();
                if next == last {
                    break;
                }
                if popped_one && !batch && exec.has_completions() {
                    // Hand back what is done now; Queues::process pops on
                    // (see CALL_EVERY).
                    return Popped::HandBack;
                }
                let head = match self.avail_head(mem, next) {
                    Ok(head) => head,
                    Err(e) => {
                        self.stop_ring(format_args!("avail ring entry {next}: {e}"));
                        return Popped::Drained;
                    }
                };
                self.queue.set_next_avail(next.wrapping_add(1));
                budget -= 1;
                popped_one = true;
                if head >= size {
                    self.stop_ring(format_args!(
                        "the driver made head {head} available on a {size}-entry ring"
                    ));
                    return Popped::Drained;
                }
                // Recorded before it runs (vhost-user "Inflight I/O tracking").
                if let Some(record) = &mut self.record {
                    if let Err(e) = record.begin(head) {
                        self.stop_ring(format_args!("{e}"));
                        return Popped::Drained;
                    }
                }
                self.popped_at[head as usize] = exec.clock(now);
                // The chain is walked by the fast path's `HeadChain`, not
                // popped through virtio-queue (see `fastpath`).
                let parsed = request::parse_head(&**mem, table, size, head, &self.device.limits);
                // Popped, so in flight (and in the inflight record) from
                // here, whether it runs now or is held back.
                self.inflight += 1;
                if let Some(gate) = &self.gate {
                    // Popped: `next + 1` is the first behind it.
                    let waiting = self
                        .outstanding(last.wrapping_sub(next) - 1)
                        .max(self.depth);
                    if let Some(until) = must_wait(gate, &self.counters, &parsed, waiting, now) {
                        self.held = Some(Held {
                            parsed,
                            until,
                            since: now,
                        });
                        return Popped::Held(until);
                    }
                }
                exec.execute(id, parsed, mem, &self.device);
            }
            if budget == 0 && self.has_avail(mem) {
                return Popped::More;
            }
            if !rearm {
                // One more look at the avail index before the pass ends: a
                // driver with other requests out may have made more
                // available meanwhile, and this pass pops them. One that
                // waits for what was just popped has not, and the end of
                // the pass publishes and calls at once. A hand-back instead
                // would publish, pop again only to find nothing, and the
                // call would wait for that round: at QD1 the answer came
                // that much later, and a blocking driver sleeps whenever
                // the answer is later than its last look before sleeping.
                // What it finds is the loop's next index (checked there,
                // not read again).
                if popped_one {
                    if let Ok(idx) = self.avail_idx(mem) {
                        if idx != self.queue.next_avail() {
                            self.avail_seen = idx;
                            continue;
                        }
                    }
                }
                return Popped::Drained;
            }
            match self.arm(mem) {
                Ok(true) => continue, // more arrived while notifications were off
                Ok(false) => return Popped::Drained,
                Err(e) => {
                    self.break_ring(e);
                    return Popped::Drained;
                }
            }
        }
    }

    /// Writes the status byte, puts the request on the used ring and counts
    /// it. The used length is the data written to guest buffers plus the
    /// status byte (0 if there is no status byte to write).
    pub(super) fn finish(
        &mut self,
        done: &Done<'_>,
        result: Result<&u64, &ExecuteError>,
        stats: &IoThreadStats,
        warn: &mut WarnLimiter,
        now: u64,
    ) {
        let Done {
            ticket,
            mem,
            written,
        } = done;
        let kind = ticket.kind;
        let c = &self.counters;
        let (st, bytes) = match result {
            Ok(n) => (status::OK, *n),
            Err(e) => {
                if warn.allow() {
                    warn!("{} queue {}: {e}", self.device.name, self.key.queue);
                }
                c.error(e.kind());
                (e.status(), 0)
            }
        };
        if let Some(t) = self.popped_at.get(ticket.head as usize) {
            c.latency.observe(now.saturating_sub(*t));
        }
        let data_len = if kind.is_some_and(ReqKind::writes_guest) {
            bytes as u32
        } else {
            0
        };
        let used_len = match ticket.status {
            Some(a) if mem.write_obj_small(st, a).is_ok() => data_len + 1,
            _ => 0,
        };
        // Migration: the pages written are marked before the used index
        // publishes them (vhost-user "Dirty logging").
        if let Some(log) = &self.log {
            log.mark_request(written, ticket.status);
        }
        match kind {
            Some(ReqKind::Read) => {
                c.reads.add(1);
                c.bytes_read.add(bytes);
            }
            Some(ReqKind::Write) => {
                c.writes.add(1);
                c.bytes_written.add(bytes);
            }
            Some(ReqKind::Flush) => c.flushes.add(1),
            Some(_) => c.other.add(1),
            None => {}
        }
        c.requests.add(1);
        if st != status::OK {
            c.errors.add(1);
            stats.errors.add(1);
        }
        stats.requests.add(1);
        self.inflight -= 1;
        // With an inflight record, the used entry is a batch of one head
        // (add_used stores the used idx once per entry): staged, published,
        // then recorded (see the inflight module for why this order is
        // recoverable at every instruction).
        if let Some(record) = &mut self.record {
            if let Err(e) = record.stage_used(ticket.head) {
                error!("{} queue {}: {e}", self.device.name, self.key.queue);
            }
        }
        match self.add_used(mem, ticket.head, used_len) {
            Ok(()) => {
                self.unnotified.add();
                self.log_used();
                stats.used_publishes.add(1);
                if let Some(record) = &mut self.record {
                    record.commit_used(self.queue.next_used());
                }
            }
            Err(e) => {
                if let Some(record) = &mut self.record {
                    record.discard_staged();
                }
                error!(
                    "{} queue {}: add_used failed: {e}",
                    self.device.name, self.key.queue
                );
            }
        }
    }

    /// Whether the driver asked to hear about the used entries added since
    /// the last call (EVENT_IDX's `used_event`, or NO_INTERRUPT: see
    /// [`SplitRing::needs_notification`]).
    fn wants_call(&self, mem: &GuestMem, added: u16) -> Result<bool, virtio_queue::Error> {
        let q = &self.queue;
        SplitRing::of(q).needs_notification(mem, q.event_idx_enabled(), q.next_used(), added)
    }

    /// Signals the guest if used entries were published since the last check
    /// and the guest wants to hear about it (EVENT_IDX / NO_INTERRUPT), and
    /// counts the call or its suppression. `mem` is the current memory map
    /// (the pass's snapshot).
    pub(super) fn notify_guest(&mut self, mem: &GuestMem, stats: &IoThreadStats) {
        let Some(added) = self.unnotified.take() else {
            return;
        };
        match self.wants_call(mem, added.get()) {
            Ok(true) => {
                if let Some(call) = &self.call {
                    let _ = (&*call).write(&1u64.to_ne_bytes());
                    stats.notifications.add(1);
                }
            }
            Ok(false) => stats.notifications_suppressed.add(1),
            Err(e) => debug!(
                "{} queue {}: needs_notification: {e}",
                self.device.name, self.key.queue
            ),
        }
    }
}

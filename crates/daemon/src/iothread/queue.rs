//! The virtqueues an IOThread serves: popping and parsing requests (through
//! the device model), guest notification suppression, and finishing a request
//! (status byte, used ring entry, one notification per queue per pass).

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::Instant;

use log::{debug, error, warn};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestAddressSpace};

use super::executor::{Executor, Finished, SlotId};
use super::{
    BlockDevice, GuestMem, GuestMemHandle, HandedOver, InflightTracking, Mailbox, QueueAttach,
    QueueKey, QueueLog,
};
use crate::fastpath::{SmallAccess, SplitRing};
use crate::inflight::InflightQueue;
use crate::stats::{IoThreadStats, QueueCounters};
use crate::virtio::request::{self, ReqKind};
use crate::virtio::status;

/// Requests one queue may pop in one pass of its IOThread. A guest that keeps
/// its ring full cannot make the thread's other queues (other VMs' disks among
/// them) wait for more than this many of its requests: what is left is popped
/// in the next pass, which comes at once (the thread does not sleep while a
/// queue has work carried over). 32 keeps a QD16-per-queue load within one
/// pass, so the budget costs nothing until a queue floods.
pub const POP_BUDGET: usize = 32;

/// Pops between calls inside a queue's pass (issue 16). A pass hands back
/// what is already finished after every pop (the null backend, device-model
/// answers, errors; io_uring or RBD completions of earlier requests when they
/// are waiting): it publishes the used entries at once, before it pops the
/// next request. The libblkio driver (and a guest's) submits one request at
/// a time and looks at its used ring right after; finding it empty, it arms
/// `used_event` and sleeps, and a sleeping driver must be woken (~10 us in a
/// VM). Publishing each completion keeps an entry in front of it.
///
/// The call (an eventfd write, ~0.5-1 us of the IOThread's time) is sent at
/// most every `CALL_EVERY` pops, and at the end of the pass: libblkio's
/// driver writes `used_event` = its position after every round of reaping,
/// so it asks for a call even while awake, and a call per pop (0.5-0.6 calls
/// per request) made the server the slower side. A sleeping driver waits at
/// most `CALL_EVERY` pops longer. Null QD16, `vqblk bench` blocking client,
/// server on CPU 1, client on CPU 0, 5 interleaved rounds, medians: client
/// sleeps per request 0.0054 -> 0.0006 (one per ~1,700 requests), IOPS
/// 1.37M -> 1.67M in this host's slow mode (2.0-2.3M either way in its fast
/// one); a call per pop: 1.41M, 0.5-0.6 calls per request; calls only at
/// the end of the pass: 0.019 sleeps per request (the calls an awake driver
/// gets leave its eventfd set, and its next wait returns at once). Polling
/// client QD16: 1.57M -> 1.64M in the slow mode, 2.83M -> 2.63M in the fast
/// one (the hand-back's fixed cost is now paid per request: ~400
/// instructions). The previous rule (a hand-back every 4 pops,
/// d4068a7) had taken the client from one sleep per 16 requests to one per
/// ~30-120. The pass goes on after each hand-back, within [`POP_BUDGET`].
pub const CALL_EVERY: usize = 4;

/// What [`QueueSlot::process`] left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Popped {
    /// The ring is empty (or stopped).
    Drained,
    /// The pass's budget ran out with requests still available.
    More,
    /// A request was popped and finished work waits to be published: publish
    /// (and call, see [`CALL_EVERY`]) now, then process the queue again
    /// (inside [`Queues::process`] only).
    HandBack,
}

/// Why a queue stops being served here, once its in-flight requests are done.
pub(super) enum Release {
    /// GET_VRING_BASE, ring disable, disconnect: reply with the next avail index.
    Detach(SyncSender<u16>),
    /// `queue-move`: send the ring to another IOThread, then reply.
    Handover {
        /// The IOThread taking the queue.
        to: Mailbox,
        /// Told once the ring is on its way.
        reply: SyncSender<Option<HandedOver>>,
        /// Requests in flight when the handover began.
        drained: usize,
        /// When the handover began.
        since: Instant,
    },
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
    /// The device the queue belongs to.
    pub device: Arc<BlockDevice>,
    counters: Arc<QueueCounters>,
    /// Requests popped and not yet finished.
    pub inflight: usize,
    /// Used ring entries added since the last notification check.
    dirty: bool,
    /// How many: what EVENT_IDX's rule needs (`SplitRing::needs_notification`).
    num_added: u16,
    /// The avail index as last read: requests up to it are popped without
    /// reading it again. The driver writes that cache line on every
    /// submission, so each read is a transfer from its CPU (55-330 ns on
    /// this project's VM), and a pass that hands back after every pop
    /// re-enters [`QueueSlot::process`] once per request.
    avail_seen: u16,
    /// A Detach or a Handover is waiting for this queue to drain.
    pub detach: Option<Release>,
    /// The ring could not be accessed: stop touching it until detached.
    broken: bool,
    /// Guest notifications (kicks) are enabled: set before sleeping, cleared
    /// while the thread polls.
    notify: bool,
    /// The queue's inflight record (INFLIGHT_SHMFD negotiated), None otherwise.
    record: Option<InflightQueue>,
    /// Heads a dead daemon left in flight, executed before anything new.
    resubmit: VecDeque<u16>,
    /// When each head (by index) was popped, for the latency histogram.
    popped_at: Box<[Instant]>,
    /// The migration dirty log while it is on (vhost-user VHOST_F_LOG_ALL).
    log: Option<QueueLog>,
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
        QueueSlot {
            key: a.key,
            queue: a.queue,
            kick: a.kick,
            call: a.call,
            mem: a.mem,
            device: a.device,
            counters,
            inflight: 0,
            dirty: false,
            num_added: 0,
            avail_seen,
            detach: None,
            broken: false,
            notify: true,
            popped_at: vec![Instant::now(); size].into(),
            record,
            resubmit: resubmit.into(),
            log: a.log,
        }
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

    /// The ring and everything that goes with it, for another IOThread to
    /// serve (`queue-move`); called once the queue has nothing in flight.
    /// Guest notifications are turned back on first, so that the ring agrees
    /// with the new owner's slot, which starts with them on
    /// ([`QueueSlot::new`]): a polling source leaves the ring quiet. (The new
    /// owner's first pass quiets and re-arms it anyway, unless it is
    /// stopping.) Heads a dead daemon left that are not resubmitted yet go
    /// along, in order.
    pub fn into_attach(mut self) -> QueueAttach {
        debug_assert_eq!(self.inflight, 0, "a ring moves only once drained");
        if !self.broken {
            // Requests that arrived meanwhile are found by the new owner,
            // which checks the ring as soon as it attaches it.
            let _ = self.arm_or_break();
        }
        // The driver was told about every used entry (`Queues::notify` runs
        // before a drained queue is released): the EVENT_IDX count, which
        // stays with the slot, has nothing left to move.
        debug_assert!(!self.dirty, "a ring moves only once notified");
        let inflight = self.record.map(|record| InflightTracking {
            record,
            resubmit: self.resubmit.into(),
        });
        QueueAttach {
            key: self.key,
            queue: self.queue,
            kick: self.kick,
            call: self.call,
            mem: self.mem,
            device: self.device,
            inflight,
            // A migration that logs goes on logging on the new owner.
            log: self.log,
        }
    }

    /// Whether the thread should look at this ring at all.
    pub fn active(&self) -> bool {
        self.detach.is_none() && !self.broken
    }

    /// A snapshot of the guest memory map.
    pub fn memory(&self) -> Arc<GuestMem> {
        self.mem.memory().into_inner()
    }

    /// The next avail index (GET_VRING_BASE).
    pub fn next_avail(&self) -> u16 {
        self.queue.next_avail()
    }

    /// Tells the guest it need not kick (EVENT_IDX: avail_event stays behind;
    /// otherwise VRING_USED_F_NO_NOTIFY), unless that is already so: without
    /// EVENT_IDX every toggle is a write to a guest cache line.
    pub fn quiet(&mut self, mem: &GuestMem) -> Result<(), virtio_queue::Error> {
        if self.notify {
            self.queue.disable_notification(mem)?;
            self.notify = false;
            self.log_used();
        }
        Ok(())
    }

    /// Asks the guest to kick again, unless it already does; true if requests
    /// arrived while it did not.
    pub fn arm(&mut self, mem: &GuestMem) -> Result<bool, virtio_queue::Error> {
        if self.notify {
            return Ok(false);
        }
        let more = self.queue.enable_notification(mem)?;
        self.notify = true;
        self.log_used();
        Ok(more)
    }

    /// Re-enables guest notifications; true if requests arrived meanwhile. A
    /// ring that cannot be accessed is marked broken (false).
    pub fn arm_or_break(&mut self) -> bool {
        let mem = self.mem.memory();
        match self.arm(&mem) {
            Ok(more) => more,
            Err(e) => {
                self.break_ring(e);
                false
            }
        }
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
        ring.add_used(mem, &mut self.queue, &mut self.num_added, head, len)
    }

    /// [`QueueSlot::has_avail`] on the current memory map (no reference
    /// count taken).
    pub fn has_work(&self) -> bool {
        self.resubmit_pending() || self.has_avail(&self.mem.memory())
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
        now: Instant,
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
            self.popped_at[head as usize] = now;
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
        if self.broken {
            return;
        }
        error!(
            "{} queue {}: {why}; queue stopped until the frontend sets it up again",
            self.device.name, self.key.queue
        );
        self.broken = true;
    }

    /// Whether the ring was stopped as broken.
    pub fn broken(&self) -> bool {
        self.broken
    }

    /// Pops at most [`POP_BUDGET`] available requests, parses them and hands
    /// them to `exec`. With `rearm` and the ring drained, guest notifications
    /// are re-enabled afterwards (the thread will sleep; a request that raced
    /// with that is popped too); otherwise they stay off (the thread will
    /// poll, or come back for what the budget left).
    /// `now` is the pass's clock (the pop time of what it pops), `mem` its
    /// snapshot of the guest memory (taken once per pass, not per hand-back:
    /// the map only changes between passes).
    pub fn process(
        &mut self,
        id: SlotId,
        exec: &mut Executor,
        rearm: bool,
        now: Instant,
        mem: &Arc<GuestMem>,
        mut budget: usize,
    ) -> Popped {
        if !self.active() {
            return Popped::Drained;
        }
        if self.resubmit_pending() {
            self.resubmit(id, exec, mem, &mut budget, now);
            if self.resubmit_pending() || self.broken {
                return if self.broken {
                    Popped::Drained
                } else {
                    Popped::More
                };
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
            // the one last read is popped (`avail_seen`); a known index
            // passed the check below when it was read, and next_avail has
            // only moved towards it since.
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
                if popped_one && exec.has_completions() {
                    // Hand back what is done now; Queues::process pops on
                    // (see CALL_EVERY).
                    return Popped::HandBack;
                }
                let next = self.queue.next_avail();
                if next == last {
                    break;
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
                self.popped_at[head as usize] = now;
                // The chain is walked by the fast path's `HeadChain`, not
                // popped through virtio-queue (see `fastpath`).
                let parsed = request::parse_head(&**mem, table, size, head, &self.device.limits);
                self.inflight += 1;
                exec.execute(id, parsed, mem, &self.device);
            }
            if budget == 0 && self.has_avail(mem) {
                return Popped::More;
            }
            if !rearm {
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
    fn finish(&mut self, f: Finished, stats: &IoThreadStats, warn: &mut WarnLimiter, now: Instant) {
        let Finished {
            ticket,
            result,
            mem,
            written,
        } = f;
        let kind = ticket.kind;
        let c = &self.counters;
        let (st, bytes) = match &result {
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
            c.latency
                .observe(now.saturating_duration_since(*t).as_nanos() as u64);
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
            log.mark_request(&written, ticket.status);
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
        match self.add_used(&mem, ticket.head, used_len) {
            Ok(()) => {
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
        self.dirty = true;
    }

    /// Whether the driver asked to hear about the used entries added since
    /// the last call (EVENT_IDX's `used_event`, or NO_INTERRUPT: see
    /// [`SplitRing::needs_notification`]).
    fn wants_call(&mut self, mem: &GuestMem) -> Result<bool, virtio_queue::Error> {
        let q = &self.queue;
        let (event_idx, used) = (q.event_idx_enabled(), q.next_used());
        SplitRing::of(q).needs_notification(mem, event_idx, used, &mut self.num_added)
    }

    /// Signals the guest if requests were finished since the last call and
    /// the guest wants to hear about it (EVENT_IDX / NO_INTERRUPT); true if
    /// it did. `mem` is the current memory map (the pass's snapshot).
    fn notify_guest(&mut self, mem: &GuestMem, stats: &IoThreadStats) -> bool {
        if !self.dirty {
            return false;
        }
        self.dirty = false;
        match self.wants_call(mem) {
            Ok(true) => {
                if let Some(call) = &self.call {
                    let _ = (&*call).write(&1u64.to_ne_bytes());
                    stats.notifications.add(1);
                    return true;
                }
            }
            Ok(false) => stats.notifications_suppressed.add(1),
            Err(e) => debug!(
                "{} queue {}: needs_notification: {e}",
                self.device.name, self.key.queue
            ),
        }
        false
    }
}

/// The queue slots of one IOThread, indexed by [`SlotId`], with what
/// finishing a request needs (the thread's counters, the warning limiter).
pub(super) struct Queues {
    slots: Vec<Option<QueueSlot>>,
    stats: Arc<IoThreadStats>,
    warn: WarnLimiter,
    /// Scratch list of finished requests.
    finished: Vec<Finished>,
    /// The current pass's clock (when its wait ended), set by the event
    /// loop and cleared at the end of the pass: the pop and completion time
    /// of the requests the pass handles, so the latency histogram costs no
    /// clock read of its own. Outside a pass (a queue attached while the
    /// thread slept) the clock is read.
    clock: Option<Instant>,
    /// In a sampled pass (issue 16's hand-back timing): when it first
    /// published used entries and first called (an early hand-back, or the
    /// end of the pass).
    sample: Option<HandbackSample>,
}

/// See [`Queues::sample_handback`].
#[derive(Debug, Default, Clone, Copy)]
pub struct HandbackSample {
    /// The first used-index publish.
    pub publish: Option<Instant>,
    /// The first call eventfd write returning.
    pub call: Option<Instant>,
}

impl Queues {
    /// No queue yet.
    pub fn new(stats: Arc<IoThreadStats>) -> Queues {
        Queues {
            slots: Vec::new(),
            stats,
            warn: WarnLimiter::default(),
            finished: Vec::with_capacity(super::executor::SCRATCH_CAPACITY),
            clock: None,
            sample: None,
        }
    }

    /// Starts timing this pass's first publish and first call.
    pub fn sample_handback(&mut self) {
        self.sample = Some(HandbackSample::default());
    }

    /// What the sampled pass timed (None if not sampled); ends the sample.
    pub fn take_handback_sample(&mut self) -> Option<HandbackSample> {
        self.sample.take()
    }

    /// Notes the time of the sampled pass's first call, if one was sent.
    fn note_call(&mut self, called: bool) {
        if let (true, Some(HandbackSample { call: c @ None, .. })) = (called, &mut self.sample) {
            *c = Some(Instant::now());
        }
    }

    /// Sets the pass's clock (see `clock`), until [`Queues::notify`] ends the pass.
    pub fn set_clock(&mut self, now: Instant) {
        self.clock = Some(now);
    }

    fn now(&self) -> Instant {
        self.clock.unwrap_or_else(Instant::now)
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
            .find(|(_, q)| q.key == key && q.detach.is_none())
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
    /// pops); counts a ring found broken and a budget used up.
    pub fn process(&mut self, id: SlotId, exec: &mut Executor, rearm: bool) -> Popped {
        let Some(mem) = self.get(id).map(QueueSlot::memory) else {
            return Popped::Drained;
        };
        let mut budget = POP_BUDGET;
        let mut uncalled = 0;
        loop {
            let (popped, n) = self.process_some(id, exec, rearm, &mem, budget);
            if popped != Popped::HandBack {
                return popped;
            }
            // Early hand-back (see CALL_EVERY): publish what is done, call
            // every CALL_EVERY pops if the driver asked, go on within the
            // pass's budget. The end of the pass calls for the rest.
            self.deliver(exec);
            uncalled += n;
            if uncalled >= CALL_EVERY {
                self.notify_one(id, &mem);
                uncalled = 0;
            }
            budget -= n;
            if budget == 0 {
                self.stats.budget_exhausted.add(1);
                return Popped::More;
            }
        }
    }

    /// [`QueueSlot::process`] within `budget`, counted; also how many it popped.
    fn process_some(
        &mut self,
        id: SlotId,
        exec: &mut Executor,
        rearm: bool,
        mem: &Arc<GuestMem>,
        budget: usize,
    ) -> (Popped, usize) {
        let now = self.now();
        let Some(q) = self.slots.get_mut(id.0).and_then(Option::as_mut) else {
            return (Popped::Drained, 0);
        };
        let was_broken = q.broken();
        let inflight = q.inflight;
        let popped = q.process(id, exec, rearm, now, mem, budget);
        // Nothing finishes during `process`: the growth is what it popped.
        let n = q.inflight.saturating_sub(inflight);
        self.stats.popped.add(n as u64);
        q.counters.popped.add(n as u64);
        if !was_broken && q.broken() {
            self.stats.broken_rings.add(1);
        }
        if popped == Popped::More {
            self.stats.budget_exhausted.add(1);
        }
        (popped, n)
    }

    /// Finishes every request the executor is done with: the one place a
    /// request's status is written and its used entry added.
    pub fn deliver(&mut self, exec: &mut Executor) {
        let mut finished = std::mem::take(&mut self.finished);
        exec.complete(&mut finished);
        let published = self.stats.used_publishes.get();
        if finished.is_empty() {
            self.finished = finished;
            return;
        }
        let now = self.now();
        for f in finished.drain(..) {
            match self.slots.get_mut(f.ticket.slot.0).and_then(Option::as_mut) {
                Some(q) => q.finish(f, &self.stats, &mut self.warn, now),
                None => error!("completion for a released queue slot {:?}", f.ticket.slot),
            }
        }
        if self.stats.used_publishes.get() != published {
            self.stats.used_batches.add(1);
            if let Some(HandbackSample {
                publish: p @ None, ..
            }) = &mut self.sample
            {
                *p = Some(Instant::now());
            }
        }
        self.finished = finished;
    }

    /// The notification of one queue, inside a pass (an early hand-back),
    /// with the pass's memory snapshot.
    fn notify_one(&mut self, id: SlotId, mem: &GuestMem) {
        let called = self
            .slots
            .get_mut(id.0)
            .and_then(Option::as_mut)
            .is_some_and(|q| q.notify_guest(mem, &self.stats));
        self.note_call(called);
    }

    /// One notification per queue that finished something since the last
    /// call; the end of a pass (its clock is dropped).
    pub fn notify(&mut self) {
        self.clock = None;
        let mut called = false;
        // A snapshot only for the queues that published something.
        for q in self.slots.iter_mut().flatten().filter(|q| q.dirty) {
            let mem = q.memory();
            called |= q.notify_guest(&mem, &self.stats);
        }
        self.note_call(called);
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

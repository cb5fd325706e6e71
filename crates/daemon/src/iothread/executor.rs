//! The executor: takes a parsed request and the guest memory it refers to,
//! turns it into a backend operation (through the device model), keeps it in
//! the in-flight table until the backend completes it, and yields
//! [`Finished`] requests back to the queue layer. A finished request stays in
//! the table, where the queue layer reads it ([`Executor::done`]) to publish
//! it, until it is retired ([`Executor::retire`]): it is not copied out on
//! the way. It owns the IOThread's backends and the bounce buffers; it never
//! touches a virtqueue.

use std::alloc::{alloc, dealloc, Layout};
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::Arc;

use log::error;
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

use super::{BlockDevice, ExecuteError, GuestMem};
use crate::block::{Backend, Completion, Engines, Handed, IoKind, Next, Transfer};
use crate::clock::monotonic_ns;
use crate::fastpath::SmallAccess;
use crate::seccomp::SeccompMode;
use crate::virtio::device::{self, Action, BlockIo};
use crate::virtio::request::{Operation, Rejected, ReqKind, Request, Segment, Segments};

mod maps;
use maps::{HeldMaps, MapId};

/// Largest number of host iovecs in one request (Linux IOV_MAX).
const IOV_MAX: usize = 1024;

/// Index of a queue slot in its IOThread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct SlotId(pub usize);

/// Which request a completion is for, and what the queue layer needs to
/// finish it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ticket {
    /// The queue the request came from.
    pub slot: SlotId,
    /// Head descriptor index, for the used ring.
    pub head: u16,
    /// Where the status byte goes (None: the chain has no usable one).
    pub status: Option<GuestAddress>,
    /// The request's kind (None: refused before its kind mattered).
    pub kind: Option<ReqKind>,
}

/// A request the executor is done with: its entry in the in-flight table
/// and its result. The entry is read through [`Executor::done`] and freed by
/// [`Executor::retire`].
#[derive(Debug)]
pub(super) struct Finished {
    /// The request's entry in the table.
    token: usize,
    /// Bytes transferred (data written to the guest for reads and GET_ID),
    /// or why it failed. The error is boxed: a `Finished` is moved through
    /// two lists per request, and at 24 bytes it moves in registers, where
    /// one with the error inline (48) went through the stack, the copy's
    /// 16-byte loads waiting on the 8-byte stores that built it (about a
    /// twentieth of a null request's time at QD16).
    pub result: Result<u64, Box<ExecuteError>>,
}

impl Finished {
    /// Request `token` finished with `result` (its error boxed, see
    /// [`Finished::result`]).
    fn new(token: usize, result: Result<u64, ExecuteError>) -> Finished {
        Finished {
            token,
            result: result.map_err(Box::new),
        }
    }
}

/// What the queue layer needs of a finished request to publish it.
pub(super) struct Done<'a> {
    /// Which request.
    pub ticket: Ticket,
    /// The guest memory the request's buffers and status byte are in.
    pub mem: &'a GuestMem,
    /// The guest buffers the device wrote (reads, GET_ID): what a migration's
    /// dirty log must mark. Empty for other requests.
    pub written: &'a [Segment],
}

/// An aligned buffer for O_DIRECT when guest buffers are not aligned.
struct Bounce {
    ptr: *mut u8,
    layout: Layout,
}

impl Bounce {
    fn new(len: usize) -> Option<Bounce> {
        let layout = Layout::from_size_align(len.max(1), 4096).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc(layout) };
        (!ptr.is_null()).then_some(Bounce { ptr, layout })
    }
    /// Bytes held (what counts against `bounce-buffer-max`).
    fn held(&self) -> u64 {
        self.layout.size() as u64
    }
    fn slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live allocation of `layout.size()` bytes owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout and not freed elsewhere.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// What [`Executor::submit`] did with a request.
enum Submitted {
    /// Handed to the backend.
    InFlight,
    /// Its bounce buffer does not fit under the cap yet: it waits.
    Waits(BlockIo),
}

/// A request in the in-flight table: from its execution until the queue
/// layer has published it.
struct Inflight {
    ticket: Ticket,
    /// The guest memory map its buffers and status byte are in, held for it
    /// in the executor's [`HeldMaps`] while the kernel or a worker may still
    /// access it (the control plane may replace the map meanwhile).
    mem: MapId,
    /// The request's guest segments (for a bounce buffer's copy, and for
    /// the dirty log: the pages a read wrote). Without a backend operation,
    /// the buffers the device model wrote (GET_ID's), or none.
    data: Segments,
    /// Its backend operation (None: finished without one: refused,
    /// answered by the device model, failed before submission).
    io: Option<Submission>,
}

impl Inflight {
    /// The guest buffers the device wrote: a read's (even a failed one may
    /// have written them, partly), the device model's answer.
    fn written(&self) -> &[Segment] {
        match &self.io {
            Some(io) if io.transfer.kind() != IoKind::Read => &[],
            _ => &self.data,
        }
    }
}

/// A request's operation on a backend.
struct Submission {
    backend: Backend,
    /// The operation, its iovecs and its recovery state.
    transfer: Transfer,
    /// An aligned buffer standing in for the guest's segments, until the
    /// backend completes the request.
    bounce: Option<Bounce>,
}

/// The in-flight table and the backends of one IOThread.
pub(super) struct Executor {
    /// Names pool workers and log lines.
    name: String,
    /// Requests from their execution until they are retired, by token.
    inflight: Vec<Option<Inflight>>,
    free: Vec<usize>,
    engines: Engines,
    /// The memory maps of the requests in the table (declared after the
    /// engines: dropped after them).
    maps: HeldMaps,
    /// Operations handed to an engine whose completion is still to be
    /// reaped: none, and [`Executor::complete`] neither commits nor reaps.
    in_engines: usize,
    /// Completions of operations their engine finished when they were
    /// submitted ([`Handed::Done`]), not yet handed out.
    at_once: Vec<Completion>,
    /// Scratch list of backend completions.
    reaped: Vec<Completion>,
    /// Requests finished without a backend (refused, answered by the device
    /// model, failed before submission), not yet handed out.
    ready: Vec<Finished>,
    /// Bytes held in bounce buffers by requests in flight.
    bounce_bytes: u64,
    /// Most bytes the bounce buffers may hold (`bounce-buffer-max`).
    bounce_max: u64,
    /// Requests waiting for bounce-buffer memory, oldest first.
    waiting: VecDeque<Waiting>,
    /// Iovec lists of completed transfers, reused by the next ones: a
    /// request allocates nothing in steady state. At most
    /// [`IOV_POOL_MAX`] are kept.
    iov_pool: Vec<Vec<libc::iovec>>,
    /// Requests handed to a backend so far (wrapping): tells
    /// [`Executor::complete`] whether a round submitted anything.
    submitted: u64,
    /// The clock as [`Executor::clock`] last read it (0: not yet).
    clock_at: u64,
    /// A backend other than null was handed work since then.
    clock_stale: bool,
}

/// Initial capacity of the per-thread scratch lists of completions.
pub(super) const SCRATCH_CAPACITY: usize = 64;

/// Most iovec lists an IOThread keeps for reuse: more than a queue-depth's
/// worth of requests in flight on all its queues is rare.
const IOV_POOL_MAX: usize = 1024;

/// Iovecs of a list made in advance by [`Executor::reserve`]: a 4 KiB
/// request in one guest page or across two.
const RESERVED_IOVECS: usize = 2;

/// A request that needs a bounce buffer while the cap is reached: it runs
/// when requests in flight give theirs back.
struct Waiting {
    ticket: Ticket,
    io: BlockIo,
    mem: Arc<GuestMem>,
    device: Arc<BlockDevice>,
}

impl Executor {
    /// An executor with no backend yet (they are created on first use) whose
    /// bounce buffers hold at most `bounce_max` bytes at a time; pool workers
    /// run under `seccomp`'s worker filter.
    pub fn new(name: String, bounce_max: u64, seccomp: SeccompMode) -> Executor {
        Executor {
            name,
            inflight: Vec::new(),
            free: Vec::new(),
            engines: Engines::new(seccomp),
            maps: HeldMaps::default(),
            in_engines: 0,
            // Sized once for a few passes' worth of completions, so that
            // steady state allocates nothing; a bigger burst grows them once.
            at_once: Vec::with_capacity(SCRATCH_CAPACITY),
            reaped: Vec::with_capacity(SCRATCH_CAPACITY),
            ready: Vec::with_capacity(SCRATCH_CAPACITY),
            bounce_bytes: 0,
            bounce_max,
            waiting: VecDeque::new(),
            iov_pool: Vec::new(),
            submitted: 0,
            clock_at: 0,
            clock_stale: false,
        }
    }

    /// The time to stamp a request with when it is popped or its used entry
    /// published, `now` being the pass's clock: a request's latency runs
    /// from one to the other. The pass's clock serves while requests only
    /// went to the null backend (no clock read per request); once another
    /// backend was handed one (a system call or a library call: microseconds
    /// each, and a pass may make several), the clock is read again. On the
    /// pass's clock alone, a request popped and finished in one pass of an
    /// io_uring queue read 0 (12-28% of 4k reads at QD16 on a disk).
    pub fn clock(&mut self, now: u64) -> u64 {
        if self.clock_stale {
            self.clock_stale = false;
            self.clock_at = monotonic_ns();
        }
        self.clock_at.max(now)
    }

    /// Makes room for `requests` more requests in flight (a queue of that
    /// size is attached): in-flight table slots and iovec lists of
    /// [`RESERVED_IOVECS`] each, so that a request allocates nothing however
    /// many are in flight at once (a request with more segments grows its
    /// list once; the pool keeps it). At most [`IOV_POOL_MAX`] lists are kept.
    pub fn reserve(&mut self, requests: usize) {
        self.inflight.reserve(requests);
        self.free.reserve(requests);
        let lists = requests.min(IOV_POOL_MAX.saturating_sub(self.iov_pool.len()));
        self.iov_pool
            .extend((0..lists).map(|_| Vec::with_capacity(RESERVED_IOVECS)));
    }

    /// Executes a parsed request of `device` (a refused one just finishes with
    /// its error). Its [`Finished`] comes out of [`Executor::complete`].
    pub fn execute(
        &mut self,
        slot: SlotId,
        parsed: Result<Request, Rejected>,
        mem: &Arc<GuestMem>,
        device: &Arc<BlockDevice>,
    ) {
        let req = match parsed {
            Ok(req) => req,
            Err(rej) => {
                let ticket = Ticket {
                    slot,
                    head: rej.head,
                    status: rej.status,
                    kind: None,
                };
                return self.finish_now(ticket, Err(rej.error.into()), mem, Segments::new());
            }
        };
        let ticket = Ticket {
            slot,
            head: req.head,
            status: Some(req.status),
            kind: Some(req.op.kind()),
        };
        // GET_ID writes the serial into the guest: its buffers are kept for the
        // dirty log (GET_ID is rare: this copy costs nothing on the I/O path).
        let id_data = match &req.op {
            Operation::GetId { data } => data.clone(),
            _ => Segments::new(),
        };
        let result = match device::action(req.op, &**mem, &device.serial, device.disk.read_only()) {
            Ok(Action::Answered(written)) => Ok(written as u64),
            Err(e) => Err(ExecuteError::GetId(e)),
            Ok(Action::Io(io)) => match self.submit(ticket, io, mem, device) {
                Ok(Submitted::InFlight) => return,
                Ok(Submitted::Waits(io)) => {
                    self.waiting.push_back(Waiting {
                        ticket,
                        io,
                        mem: mem.clone(),
                        device: device.clone(),
                    });
                    return;
                }
                Err(e) => Err(e),
            },
        };
        self.finish_now(ticket, result, mem, id_data);
    }

    /// Submits waiting requests, oldest first, while their bounce buffers fit.
    fn run_waiting(&mut self) {
        while let Some(w) = self.waiting.pop_front() {
            match self.submit(w.ticket, w.io, &w.mem, &w.device) {
                Ok(Submitted::InFlight) => {}
                Ok(Submitted::Waits(io)) => {
                    self.waiting.push_front(Waiting { io, ..w });
                    return;
                }
                Err(e) => self.finish_now(w.ticket, Err(e), &w.mem, Segments::new()),
            }
        }
    }

    /// Finishes a request without a backend; `written` are the guest
    /// buffers the device model wrote.
    fn finish_now(
        &mut self,
        ticket: Ticket,
        result: Result<u64, ExecuteError>,
        mem: &Arc<GuestMem>,
        written: Segments,
    ) {
        let mem = self.maps.hold(mem);
        let token = self.entry(Inflight {
            ticket,
            mem,
            data: written,
            io: None,
        });
        self.ready.push(Finished::new(token, result));
    }

    /// A free token of the table, holding `inflight`.
    #[inline(always)]
    fn entry(&mut self, inflight: Inflight) -> usize {
        match self.free.pop() {
            Some(token) => {
                self.inflight[token] = Some(inflight);
                token
            }
            None => {
                self.inflight.push(Some(inflight));
                self.inflight.len() - 1
            }
        }
    }

    /// Puts `io` in flight on the device's backend, or hands it back if its
    /// bounce buffer does not fit under the cap yet.
    fn submit(
        &mut self,
        ticket: Ticket,
        io: BlockIo,
        mem: &Arc<GuestMem>,
        device: &BlockDevice,
    ) -> Result<Submitted, ExecuteError> {
        let disk = &device.disk;
        let mut iov = self.iov_pool.pop().unwrap_or_default();
        let mut bounce = None;
        if matches!(io.kind, IoKind::Read | IoKind::Write) {
            if !guest_iovecs(mem, &io.data, &mut iov) {
                return Err(ExecuteError::GuestMemory);
            }
            if iov.len() > IOV_MAX || disk.direct_align().is_some_and(|a| !aligned(&iov, a)) {
                iov.clear();
                // Unaligned for O_DIRECT (or too fragmented): go through an
                // aligned copy, within the thread's cap: a guest's unaligned
                // buffers cannot make the daemon allocate without bound.
                if io.len > self.bounce_max {
                    return Err(ExecuteError::BounceLimit {
                        len: io.len,
                        max: self.bounce_max,
                    });
                }
                if self.bounce_bytes + io.len > self.bounce_max {
                    return Ok(Submitted::Waits(io));
                }
                let mut b =
                    Bounce::new(io.len as usize).ok_or(ExecuteError::BounceAlloc(io.len))?;
                if io.kind == IoKind::Write {
                    copy_from_guest(mem, &io.data, b.slice()).map_err(ExecuteError::BounceCopy)?;
                }
                iov.push(libc::iovec {
                    iov_base: b.ptr.cast(),
                    iov_len: io.len as usize,
                });
                bounce = Some(b);
            }
        }
        // A fault replaced this memory with zeros (the frontend shrank a file
        // behind it, crate::fault): what the request would write is not the
        // guest's data, and its connection is closing. Checked after the
        // bounce copy, which is where such a fault shows.
        if mem.broken() {
            return Err(ExecuteError::GuestMemory);
        }
        let transfer = Transfer::new(io.kind, io.offset, io.len, iov)
            .dsync(io.kind == IoKind::Write && device.writethrough())
            .punch(io.punch);
        let backend = disk.backend();
        let bounced = bounce.as_ref().map_or(0, Bounce::held);
        let map = self.maps.hold(mem);
        let token = self.entry(Inflight {
            ticket,
            mem: map,
            data: io.data,
            io: Some(Submission {
                backend,
                transfer,
                bounce,
            }),
        });
        self.bounce_bytes += bounced;
        match self.submit_token(token) {
            Ok(()) => Ok(Submitted::InFlight),
            Err(source) => {
                self.inflight[token] = None;
                self.free.push(token);
                self.maps.release(map);
                self.bounce_bytes -= bounced;
                Err(ExecuteError::Submit { backend, source })
            }
        }
    }

    /// Bytes held in bounce buffers now.
    #[cfg(test)]
    pub fn bounce_bytes(&self) -> u64 {
        self.bounce_bytes
    }

    /// Requests waiting for bounce-buffer memory.
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Hands in-flight request `token` to its backend.
    #[inline]
    fn submit_token(&mut self, token: usize) -> std::io::Result<()> {
        let Some(io) = submission(&mut self.inflight, token) else {
            return Err(std::io::Error::other("no such in-flight request"));
        };
        self.submitted = self.submitted.wrapping_add(1);
        if !matches!(io.backend, Backend::Null { .. }) {
            self.clock_stale = true;
        }
        // SAFETY: the transfer's iovecs (heap, not moved until the Inflight is
        // retired) and the buffers they point to (guest memory of the map
        // held for the Inflight's `mem` in `maps`, or `io.bounce`, held by
        // it) stay valid until this token's completion is reaped: the bounce
        // buffer is only taken in `on_completion`, the Inflight only leaves
        // the table when it is retired, after that, and its map is held
        // until then (and to the end of that pass).
        let handed = unsafe {
            self.engines
                .submit(io.backend, &self.name, io.transfer.op(), token as u64)
        }?;
        match handed {
            Handed::Queued => self.in_engines += 1,
            Handed::Done(result) => self.at_once.push(Completion {
                token: token as u64,
                result,
            }),
        }
        Ok(())
    }

    /// Requests in flight on a backend (submitted, not yet reaped): O(1),
    /// read by the event loop before every wait for the polling policy.
    pub fn inflight(&self) -> usize {
        self.inflight.len() - self.free.len()
    }

    /// Whether a backend has completions waiting (cheap: called while polling).
    #[inline]
    pub fn has_completions(&mut self) -> bool {
        !self.ready.is_empty()
            || !self.at_once.is_empty()
            || (self.in_engines > 0 && self.engines.has_completions())
    }

    /// Moves the completion eventfds of backends created since the last call
    /// to `out`.
    pub fn take_new_notify_fds(&mut self, out: &mut Vec<RawFd>) {
        self.engines.take_new_notify_fds(out);
    }

    /// Commits submissions and moves every finished request to `out`,
    /// repeating while its completions put work on a backend that finishes
    /// it at once (null). Each stays in the table until
    /// [`Executor::retire`].
    pub fn complete(&mut self, out: &mut Vec<Finished>) {
        out.append(&mut self.ready);
        loop {
            // The scratch list, empty between rounds, trades places with
            // the completions finished at once (each keeps its allocation):
            // no copy of them.
            let mut reaped = std::mem::replace(&mut self.at_once, std::mem::take(&mut self.reaped));
            // Nothing on an engine (a pass that only met the null backend,
            // or a hand-back right after a pop): nothing to commit or reap.
            if self.in_engines > 0 {
                if let Err(e) = self.engines.commit() {
                    error!("{}: backend submit failed: {e}", self.name);
                }
                let before = reaped.len();
                self.engines.reap(&mut reaped);
                self.in_engines = self.in_engines.saturating_sub(reaped.len() - before);
            }
            if reaped.is_empty() {
                self.reaped = reaped;
                return;
            }
            let submitted = self.submitted;
            for c in reaped.drain(..) {
                self.on_completion(c, out);
            }
            self.reaped = reaped;
            if !self.waiting.is_empty() {
                self.run_waiting();
                out.append(&mut self.ready);
            }
            // Another round only if these completions put work on a backend
            // (a retry, a request that waited for bounce memory): a null
            // backend finishes it at once. Otherwise the round would find
            // nothing, which a hand-back per request would pay every time.
            if self.submitted == submitted {
                return;
            }
        }
    }

    /// Applies the backend's recovery policy to a completion: resubmits, or
    /// finishes the request.
    fn on_completion(&mut self, c: Completion, out: &mut Vec<Finished>) {
        let token = c.token as usize;
        let Some(io) = submission(&mut self.inflight, token) else {
            error!("{}: completion for unknown token {token}", self.name);
            return;
        };
        let backend = io.backend;
        let read = io.transfer.kind() == IoKind::Read;
        let mut result = match io.transfer.on_completion(c.result) {
            Next::Resubmit => match self.submit_token(token) {
                Ok(()) => return,
                Err(source) => Err(ExecuteError::Submit { backend, source }),
            },
            Next::Done(r) => r.map_err(ExecuteError::from),
        };
        let Some(inf) = self.inflight[token].as_mut() else {
            return;
        };
        let Some(mem) = self.maps.get(inf.mem) else {
            error!("{}: no memory map for token {token}", self.name);
            return;
        };
        if let Some(mut b) = inf.io.as_mut().and_then(|io| io.bounce.take()) {
            self.bounce_bytes -= b.held();
            if read && result.is_ok() {
                if let Err(e) = copy_to_guest(mem, &inf.data, b.slice()) {
                    result = Err(ExecuteError::BounceCopy(e));
                }
            }
        }
        // The memory broke while the request was in flight: a write may have
        // carried the zeros that replaced it, a read's data went to them.
        if result.is_ok() && mem.broken() {
            result = Err(ExecuteError::GuestMemory);
        }
        out.push(Finished::new(token, result));
    }

    /// What the queue layer needs to publish `f`, from its entry in the
    /// table (not copied out of it).
    pub fn done(&self, f: &Finished) -> Option<Done<'_>> {
        let inf = self.inflight.get(f.token)?.as_ref()?;
        Some(Done {
            ticket: inf.ticket,
            mem: self.maps.get(inf.mem)?,
            written: inf.written(),
        })
    }

    /// Frees the entries of the requests in `finished` (published: nothing
    /// reads their buffers or iovecs any more), which is left empty. Their
    /// iovec lists go back to the pool; a memory map none of the requests
    /// in flight holds any more goes at the end of the pass or before the
    /// thread sleeps ([`Executor::end_pass`], [`Executor::before_sleep`]).
    pub fn retire(&mut self, finished: &mut Vec<Finished>) {
        for f in finished.iter() {
            let Some(entry) = self.inflight.get_mut(f.token) else {
                continue;
            };
            let Some(inf) = entry.as_mut() else {
                continue;
            };
            self.maps.release(inf.mem);
            if let Some(io) = inf.io.as_mut() {
                if self.iov_pool.len() < IOV_POOL_MAX {
                    self.iov_pool.push(io.transfer.take_iov());
                }
            }
            // Dropped in place: not moved out of the table first.
            *entry = None;
            self.free.push(f.token);
        }
        finished.clear();
    }

    /// The end of a pass: lets go of the memory maps no request in flight
    /// holds but the one held last (the last hold on a replaced map, or on
    /// the map of a frontend that went away, may go with them).
    pub fn end_pass(&mut self) {
        self.maps.release_idle(false);
    }

    /// The thread is about to sleep with no timeout: lets go of every
    /// memory map no request in flight holds.
    pub fn before_sleep(&mut self) {
        self.maps.release_idle(true);
    }

    /// Memory maps held for requests now.
    #[cfg(test)]
    pub fn held_maps(&self) -> usize {
        self.maps.len()
    }
}

/// The backend operation of the in-flight request `token` of `table` (a
/// function of the table alone: the executor's other fields stay free to
/// borrow beside it).
fn submission(table: &mut [Option<Inflight>], token: usize) -> Option<&mut Submission> {
    table.get_mut(token)?.as_mut()?.io.as_mut()
}

/// Appends the host iovecs of guest segments to `iov` (empty); false if any
/// byte is outside guest memory.
fn guest_iovecs(mem: &GuestMem, segs: &[Segment], iov: &mut Vec<libc::iovec>) -> bool {
    for s in segs {
        // A buffer in one region (nearly all of them) is one iovec, without
        // vm-memory's region-by-region walk.
        if let Some(slice) = mem.one_region(s.addr, s.len as usize) {
            iov.push(libc::iovec {
                iov_base: slice.ptr_guard_mut().as_ptr().cast(),
                iov_len: slice.len(),
            });
            continue;
        }
        let Ok(slices) = mem.get_slices(s.addr, s.len as usize, Permissions::ReadWrite) else {
            return false;
        };
        for slice in slices {
            let Ok(slice) = slice else { return false };
            iov.push(libc::iovec {
                iov_base: slice.ptr_guard_mut().as_ptr().cast(),
                iov_len: slice.len(),
            });
        }
    }
    true
}

fn aligned(iov: &[libc::iovec], align: usize) -> bool {
    iov.iter()
        .all(|v| (v.iov_base as usize).is_multiple_of(align) && v.iov_len % align == 0)
}

fn copy_from_guest(
    mem: &GuestMem,
    segs: &[Segment],
    buf: &mut [u8],
) -> Result<(), vm_memory::GuestMemoryError> {
    let mut off = 0;
    for s in segs {
        mem.read_slice(&mut buf[off..off + s.len as usize], s.addr)?;
        off += s.len as usize;
    }
    Ok(())
}

fn copy_to_guest(
    mem: &GuestMem,
    segs: &[Segment],
    buf: &[u8],
) -> Result<(), vm_memory::GuestMemoryError> {
    let mut off = 0;
    for s in segs {
        mem.write_slice(&buf[off..off + s.len as usize], s.addr)?;
        off += s.len as usize;
    }
    Ok(())
}

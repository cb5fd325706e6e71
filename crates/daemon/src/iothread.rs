//! IOThreads: the request engine.
//!
//! Each IOThread is one OS thread (`vqblk-iotN`) running one event loop. It owns
//! the virtqueues mapped to it (their `Queue` state, kick and call fds), its own
//! backend engines (one io_uring, one worker pool) and its counters. A request is
//! popped, parsed, submitted, completed and signalled in the thread that owns its
//! queue; nothing on that path is shared with another IOThread.
//!
//! The control plane (the vhost-user connection threads) talks to an IOThread
//! only through [`Command`]s sent over a channel plus a wake-up eventfd.

use std::alloc::{alloc, dealloc, Layout};
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use log::{debug, error, info, warn};
use virtio_queue::{Queue, QueueT};
use vm_memory::{
    Bytes, GuestAddress, GuestAddressSpace, GuestMemory, GuestMemoryAtomic, GuestMemoryMmap,
    Permissions,
};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::block::{clock_ns, Completion, Disk, Engine, Engines, IoKind, IoOp};
use crate::config::BackendKind;
use crate::poll::{PollMode, PollParams, PollPolicy};
use crate::stats::{IoThreadStats, QueueCounters};
use crate::virtio::request::{self, Limits, Operation, Request, Segment};
use crate::virtio::{status, ID_BYTES, SECTOR_SIZE};

/// Guest memory as mapped by the daemon.
pub type GuestMem = GuestMemoryMmap<()>;
/// The guest memory map shared by a connection and the IOThreads serving it;
/// replaced (RCU-style) on SET_MEM_TABLE / ADD_MEM_REG / REM_MEM_REG.
pub type GuestMemHandle = GuestMemoryAtomic<GuestMem>;

/// Resubmissions of a request that failed with EAGAIN or EINTR.
const MAX_RETRIES: u8 = 8;

/// Largest number of host iovecs in one request (Linux IOV_MAX).
const IOV_MAX: usize = 1024;

/// What an IOThread needs to execute one export's requests.
#[derive(Debug)]
pub struct BlockDevice {
    /// Export name, for logs and statistics.
    pub name: String,
    /// The opened disk.
    pub disk: Disk,
    /// Validation limits (capacity, seg_max, ...).
    pub limits: Limits,
    /// GET_ID answer, NUL-padded.
    pub serial: [u8; ID_BYTES],
}

/// Identifies a virtqueue across the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueKey {
    /// Export index.
    pub export: usize,
    /// Virtqueue index within the export.
    pub queue: u16,
}

/// A started virtqueue handed to its owner IOThread.
pub struct QueueAttach {
    /// Which queue.
    pub key: QueueKey,
    /// Ring state, ready and validated against `mem`.
    pub queue: Queue,
    /// The guest's kick eventfd.
    pub kick: File,
    /// The eventfd to signal the guest with (None: poll mode frontend).
    pub call: Option<File>,
    /// Guest memory.
    pub mem: GuestMemHandle,
    /// The device the queue belongs to.
    pub device: Arc<BlockDevice>,
}

/// Control-plane requests to an IOThread.
pub enum Command {
    /// Start serving a queue.
    Attach(Box<QueueAttach>),
    /// Stop serving a queue: stop popping, wait for its in-flight requests,
    /// then reply with the next avail index (GET_VRING_BASE).
    Detach {
        /// Which queue.
        key: QueueKey,
        /// Receives the queue's next avail index once drained.
        reply: SyncSender<u16>,
    },
    /// Replace a running queue's call fd.
    SetCall {
        /// Which queue.
        key: QueueKey,
        /// The new call fd.
        call: Option<File>,
    },
    /// Drain everything and exit the thread.
    Stop,
}

/// The control plane's handle on one IOThread.
pub struct IoThreadHandle {
    /// Index in the pool.
    pub index: usize,
    /// Counters, readable at any time.
    pub stats: Arc<IoThreadStats>,
    tx: Sender<Command>,
    wake: Arc<EventFd>,
    /// Set before `wake` is written: lets a polling IOThread see commands
    /// without a syscall.
    pending: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
}

/// How an IOThread is set up.
#[derive(Debug, Clone)]
pub struct IoThreadSetup {
    /// Host CPUs to pin to.
    pub cpus: Option<Vec<usize>>,
    /// Polling algorithm.
    pub poll_mode: PollMode,
    /// QEMU-compatible polling knobs.
    pub poll_params: PollParams,
}

impl Default for IoThreadSetup {
    fn default() -> Self {
        IoThreadSetup {
            cpus: None,
            poll_mode: PollMode::Off,
            poll_params: PollParams::default(),
        }
    }
}

impl IoThreadHandle {
    /// Starts IOThread `index`.
    pub fn spawn(index: usize, setup: IoThreadSetup) -> io::Result<Self> {
        let name = format!("vqblk-iot{index}");
        let stats = Arc::new(IoThreadStats::new(name.clone()));
        let wake = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let (tx, rx) = channel();
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            wake.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_WAKE),
        )?;
        let pending = Arc::new(AtomicBool::new(false));
        let (thread_wake, thread_stats, thread_pending) =
            (wake.clone(), stats.clone(), pending.clone());
        let IoThreadSetup {
            cpus,
            poll_mode,
            poll_params,
        } = setup;
        let join = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let mut t = IoThread {
                    name: name.clone(),
                    epoll,
                    wake: thread_wake,
                    rx,
                    queues: Vec::new(),
                    inflight: Vec::new(),
                    free: Vec::new(),
                    engines: Engines::default(),
                    registered: [false; 3],
                    stats: thread_stats,
                    warn: WarnLimiter::default(),
                    stopping: false,
                    completions: Vec::new(),
                    pending: thread_pending,
                    poll_mems: Vec::new(),
                    policy: PollPolicy::new(poll_mode, poll_params, 1),
                    commanded: false,
                    epoch: Instant::now(),
                };
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::gettid() } as u64;
                t.stats.tid.store(tid, std::sync::atomic::Ordering::Relaxed);
                if let Some(cpus) = cpus {
                    pin_to(&cpus);
                }
                // Hybrid-polling naps need a precise timer (the default slack
                // of normal threads is 50 us).
                // SAFETY: prctl with integer arguments only.
                unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
                if t.policy.mode() == PollMode::Adaptive {
                    t.calibrate_naps();
                }
                t.run();
            })?;
        Ok(IoThreadHandle {
            index,
            stats,
            tx,
            wake,
            pending,
            join: Some(join),
        })
    }

    /// Sends a command and wakes the thread.
    pub fn send(&self, cmd: Command) {
        if self.tx.send(cmd).is_ok() {
            self.pending.store(true, Ordering::Release);
            let _ = self.wake.write(1);
        }
    }

    /// Stops the thread after draining and waits for it.
    pub fn stop(&mut self) {
        self.send(Command::Stop);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

impl Drop for IoThreadHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

fn pin_to(cpus: &[usize]) {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: CPU_SET writes within `set`; c < 1024 = CPU_SETSIZE (checked by the config).
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: the pointer and size describe the live local `set`.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        warn!(
            "cannot pin IOThread to CPUs {cpus:?}: {}",
            io::Error::last_os_error()
        );
    }
}

const TOKEN_WAKE: u64 = 0;
const TOKEN_URING: u64 = 1;
const TOKEN_POOL: u64 = 2;
const TOKEN_NULL: u64 = 3;
const TOKEN_KICK_BASE: u64 = 16;

/// A virtqueue served by this thread.
struct QueueSlot {
    key: QueueKey,
    queue: Queue,
    kick: File,
    call: Option<File>,
    mem: GuestMemHandle,
    device: Arc<BlockDevice>,
    counters: Arc<QueueCounters>,
    /// Requests popped and not yet completed.
    inflight: usize,
    /// Used ring entries added since the last notification check.
    dirty: bool,
    /// A Detach is waiting for this queue to drain.
    detach: Option<SyncSender<u16>>,
    /// The ring could not be accessed: stop touching it until detached.
    broken: bool,
    /// Guest notifications (kicks) are enabled: set before sleeping, cleared
    /// while the thread polls.
    notify: bool,
}

impl QueueSlot {
    /// Whether the thread should look at this ring at all.
    fn active(&self) -> bool {
        self.detach.is_none() && !self.broken
    }

    /// Tells the guest it need not kick (EVENT_IDX: avail_event stays behind;
    /// otherwise VRING_USED_F_NO_NOTIFY), unless that is already so: without
    /// EVENT_IDX every toggle is a write to a guest cache line.
    fn quiet(&mut self, mem: &GuestMem) -> Result<(), virtio_queue::Error> {
        if self.notify {
            self.queue.disable_notification(mem)?;
            self.notify = false;
        }
        Ok(())
    }

    /// Asks the guest to kick again, unless it already does; true if requests
    /// arrived while it did not.
    fn arm(&mut self, mem: &GuestMem) -> Result<bool, virtio_queue::Error> {
        if self.notify {
            return Ok(false);
        }
        let more = self.queue.enable_notification(mem)?;
        self.notify = true;
        Ok(more)
    }
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

/// A request submitted to a backend and not yet completed.
struct Inflight {
    slot: usize,
    head: u16,
    status: GuestAddress,
    /// Keeps the guest memory mapping alive while the kernel or a worker may
    /// still access it (memory can be replaced by the control plane meanwhile).
    mem: Arc<GuestMem>,
    /// The iovecs the operation points to (heap: stable address).
    iov: Vec<libc::iovec>,
    op: IoOp,
    /// Length of the whole request's data, bytes (`op.len` shrinks when a
    /// short transfer is resubmitted).
    len: u64,
    /// Resubmissions after a transient error (EAGAIN, EINTR).
    retries: u8,
    /// Bytes transferred so far (for short reads/writes).
    done: u64,
    /// Guest segments, when a bounce buffer stands in for them.
    bounce: Option<(Bounce, Vec<Segment>)>,
}

#[derive(Default)]
struct WarnLimiter {
    window: Option<Instant>,
    count: u32,
    suppressed: u64,
}

impl WarnLimiter {
    /// At most 10 warnings per second per IOThread.
    fn allow(&mut self) -> bool {
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

struct IoThread {
    name: String,
    epoll: Epoll,
    wake: Arc<EventFd>,
    rx: Receiver<Command>,
    queues: Vec<Option<QueueSlot>>,
    inflight: Vec<Option<Inflight>>,
    free: Vec<usize>,
    engines: Engines,
    /// Whether the io_uring / pool completion eventfds are in the epoll set.
    registered: [bool; 3],
    stats: Arc<IoThreadStats>,
    warn: WarnLimiter,
    stopping: bool,
    completions: Vec<Completion>,
    pending: Arc<AtomicBool>,
    /// Scratch list of (slot, memory snapshot) for a polling slice.
    poll_mems: Vec<(usize, Arc<GuestMem>)>,
    /// Source 0 is the backends' completions, source 1 + i is queue slot i.
    policy: PollPolicy,
    /// A control command was handled during this pass.
    commanded: bool,
    /// Origin of the policy's clock.
    epoch: Instant,
}

/// Policy source index of the backend completions.
const SOURCE_COMPLETIONS: usize = 0;

impl IoThread {
    fn run(&mut self) {
        debug!("{} started ({:?} polling)", self.name, self.policy.mode());
        let mut events = vec![EpollEvent::default(); 64];
        let mut ready: Vec<usize> = Vec::new();
        let mut sources: Vec<usize> = Vec::new();
        loop {
            if self.stopping && self.inflight_total() == 0 {
                break;
            }
            self.commanded = false;
            let serving = self.serving();
            let window = if serving { self.policy.poll_ns() } else { 0 };
            self.stats.poll_window_ns.set(window.min(i64::MAX as u64));
            let t0 = Instant::now();
            let mut completed = false;
            let mut polled_hit = false;
            let mut slept = false;
            // Hybrid polling (adaptive): sleep through the part of the wait in
            // which no event is expected (notifications armed, as in any
            // sleep), then spin for the event the nap expected.
            let nap = if serving {
                self.policy.nap_at(self.clock_ns(t0))
            } else {
                0
            };
            if window > 0 || nap > 0 {
                let mut deadline = window;
                if nap > 0 {
                    self.arm_notifications(&mut ready);
                    if ready.is_empty() {
                        self.stats.naps.add(1);
                        slept = true;
                        self.nap(nap, &mut events, &mut ready, &mut completed);
                        let spin = self.policy.nap_spin_ns();
                        deadline = deadline.max(t0.elapsed().as_nanos() as u64 + spin);
                    }
                }
                // A command handled during the nap (a queue to detach, say) is
                // answered at the end of this pass: do not spin or sleep first.
                if self.nothing_yet(&ready, completed) {
                    slept = false;
                    self.stats.poll_attempts.add(1);
                    let t = Instant::now();
                    polled_hit = self.poll(deadline, t0, &mut ready, &mut completed);
                    self.stats.poll_ns.add(t.elapsed().as_nanos() as u64);
                }
            }
            if !polled_hit && !slept {
                // About to sleep: re-enable guest notifications, then look at the
                // rings once more, so a request that raced with this is never
                // stranded (vhost-user: the guest kicks only if asked to).
                self.arm_notifications(&mut ready);
            }
            if !polled_hit && !slept && self.nothing_yet(&ready, completed) {
                let t = Instant::now();
                // Until something real happens: a stale edge (see handle_events)
                // is not a reason to run a pass.
                while self.nothing_yet(&ready, completed) && !self.stopping {
                    self.wait_events(-1, &mut events, &mut ready, &mut completed);
                }
                self.stats.sleep_ns.add(t.elapsed().as_nanos() as u64);
            } else if self.pending.load(Ordering::Acquire) {
                self.wait_events(0, &mut events, &mut ready, &mut completed);
            }
            let t_end = Instant::now();
            if polled_hit {
                self.stats.poll_hits.add(1);
            }
            self.stats.passes.add(1);
            ready.sort_unstable();
            ready.dedup();
            sources.clear();
            if completed {
                sources.push(SOURCE_COMPLETIONS);
            }
            sources.extend(ready.iter().map(|s| s + 1));
            self.policy.update(
                t_end.duration_since(t0).as_nanos() as u64,
                &sources,
                polled_hit,
            );
            self.policy
                .observe_events_at(self.clock_ns(t_end), &sources);
            // Keep kicks off while we expect to poll next time.
            let rearm = self.window() == 0;
            for slot in ready.drain(..) {
                self.process_queue(slot, rearm);
            }
            self.complete_all();
            self.finish_pass();
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
        const NAP_NS: u64 = 20_000;
        let Ok(epoll) = Epoll::new() else {
            return;
        };
        let mut events = [EpollEvent::default(); 1];
        let mut late = Vec::with_capacity(NAPS as usize);
        let cpu0 = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID);
        for _ in 0..NAPS {
            let t = Instant::now();
            if epoll_pwait2(&epoll, &mut events, NAP_NS).is_err() {
                return;
            }
            late.push((t.elapsed().as_nanos() as u64).saturating_sub(NAP_NS));
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
    fn nothing_yet(&self, ready: &[usize], completed: bool) -> bool {
        ready.is_empty() && !completed && !self.commanded
    }

    /// Whether any ring is being served (not stopping, some queue active).
    fn serving(&self) -> bool {
        !self.stopping && self.queues.iter().flatten().any(QueueSlot::active)
    }

    /// `t` on the policy's clock: ns since the thread started, plus one (0 is
    /// "never" there).
    fn clock_ns(&self, t: Instant) -> u64 {
        t.duration_since(self.epoch).as_nanos() as u64 + 1
    }

    /// Busy-polls the rings, the backends and the command flag for at most
    /// `window` ns from `t0`. Returns true if anything turned up.
    fn poll(
        &mut self,
        window: u64,
        t0: Instant,
        ready: &mut Vec<usize>,
        completed: &mut bool,
    ) -> bool {
        // One snapshot of each ring's memory for the whole polling slice: the
        // map is replaced only by the control plane, and an old snapshot
        // still maps the same guest pages.
        let mut mems = std::mem::take(&mut self.poll_mems);
        mems.clear();
        for (slot, q) in self.queues.iter_mut().enumerate() {
            let Some(q) = q.as_mut().filter(|q| q.active()) else {
                continue;
            };
            let mem = q.mem.memory().into_inner();
            // Polling: the guest need not kick.
            let _ = q.quiet(&mem);
            mems.push((slot, mem));
        }
        let mut spins = 0u32;
        let found = loop {
            for (slot, mem) in &mems {
                let q = self.queues[*slot].as_ref().unwrap();
                if has_avail(q, mem) {
                    ready.push(*slot);
                }
            }
            if self.engines.has_completions() {
                *completed = true;
            }
            if !ready.is_empty() || *completed || self.pending.load(Ordering::Acquire) {
                break true;
            }
            spins = spins.wrapping_add(1);
            // Reading the clock costs ~20 ns; look at it every few passes.
            if spins.is_multiple_of(8) && t0.elapsed().as_nanos() >= window as u128 {
                break false;
            }
            std::hint::spin_loop();
        };
        self.poll_mems = mems;
        found
    }

    /// Re-enables notifications on every ring that has them off; a ring that
    /// received work meanwhile goes to `ready`.
    fn arm_notifications(&mut self, ready: &mut Vec<usize>) {
        for (slot, q) in self.queues.iter_mut().enumerate() {
            let Some(q) = q.as_mut().filter(|q| q.active()) else {
                continue;
            };
            let mem = q.mem.memory();
            match q.arm(&mem) {
                Ok(more) => {
                    if more {
                        ready.push(slot);
                    }
                }
                Err(e) => {
                    error!(
                        "{} queue {}: ring not accessible ({e})",
                        q.device.name, q.key.queue
                    );
                    q.broken = true;
                }
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
        ready: &mut Vec<usize>,
        completed: &mut bool,
    ) {
        let start = Instant::now();
        // First take the stale edges (kicks and completions that polling already
        // served) without sleeping: each would otherwise cost a wake-up.
        self.wait_events(0, events, ready, completed);
        while self.nothing_yet(ready, *completed) {
            let left = nap_ns.saturating_sub(start.elapsed().as_nanos() as u64);
            if left == 0 {
                break;
            }
            let t = Instant::now();
            match self.wait_events_ns(left, events, ready, completed) {
                Some(0) => {
                    self.policy.observe_nap(left, t.elapsed().as_nanos() as u64);
                    self.stats.nap_late_ns.set(self.policy.nap_late_ns());
                    break;
                }
                Some(_) => {}
                None => break,
            }
        }
        self.stats.sleep_ns.add(start.elapsed().as_nanos() as u64);
    }

    /// Like [`Self::wait_events`] with a timeout in nanoseconds (epoll_pwait2),
    /// for hybrid-polling naps.
    fn wait_events_ns(
        &mut self,
        timeout_ns: u64,
        events: &mut [EpollEvent],
        ready: &mut Vec<usize>,
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
        ready: &mut Vec<usize>,
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
        ready: &mut Vec<usize>,
        completed: &mut bool,
    ) {
        let (mut kicked, mut signalled, mut stale) = (false, false, false);
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
                TOKEN_URING | TOKEN_POOL | TOKEN_NULL => {
                    if self.engines.has_completions() {
                        signalled = true;
                    } else {
                        stale = true;
                    }
                }
                t => {
                    let slot = (t - TOKEN_KICK_BASE) as usize;
                    // Edge-triggered: every guest kick (an eventfd write)
                    // raises a new edge, so the counter need not be read
                    // back to zero: one syscall less per kick. The edge is
                    // stale if polling already took the request: with
                    // EVENT_IDX the first request after re-arming always
                    // kicks, even if the thread is polling by then.
                    let Some(q) = self.queues.get(slot).and_then(Option::as_ref) else {
                        continue;
                    };
                    if has_avail(q, &q.mem.memory()) {
                        ready.push(slot);
                        kicked = true;
                    } else {
                        stale = true;
                    }
                }
            }
        }
        if stale && !kicked && !signalled {
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

    fn inflight_total(&self) -> usize {
        self.queues.iter().flatten().map(|q| q.inflight).sum()
    }

    fn handle_commands(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            self.commanded = true;
            match cmd {
                Command::Attach(a) => self.attach(*a),
                Command::Detach { key, reply } => {
                    match self.slot_of(key) {
                        Some(slot) => {
                            let q = self.queues[slot].as_mut().unwrap();
                            let _ = self.epoll.ctl(
                                ControlOperation::Delete,
                                q.kick.as_raw_fd(),
                                EpollEvent::default(),
                            );
                            q.detach = Some(reply);
                        }
                        // Never attached here: nothing to drain.
                        None => drop(reply),
                    }
                }
                Command::SetCall { key, call } => {
                    if let Some(slot) = self.slot_of(key) {
                        self.queues[slot].as_mut().unwrap().call = call;
                    }
                }
                Command::Stop => {
                    self.stopping = true;
                    // Stop accepting guest work: detach-style drain of every queue.
                    for q in self.queues.iter_mut().flatten() {
                        let _ = self.epoll.ctl(
                            ControlOperation::Delete,
                            q.kick.as_raw_fd(),
                            EpollEvent::default(),
                        );
                    }
                }
            }
        }
    }

    fn slot_of(&self, key: QueueKey) -> Option<usize> {
        self.queues.iter().position(|q| {
            q.as_ref()
                .is_some_and(|q| q.key == key && q.detach.is_none())
        })
    }

    fn attach(&mut self, a: QueueAttach) {
        let slot = self
            .queues
            .iter()
            .position(Option::is_none)
            .unwrap_or_else(|| {
                self.queues.push(None);
                self.queues.len() - 1
            });
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Add,
            a.kick.as_raw_fd(),
            EpollEvent::new(
                EventSet::IN | EventSet::EDGE_TRIGGERED,
                TOKEN_KICK_BASE + slot as u64,
            ),
        ) {
            error!(
                "{}: cannot watch kick fd of {}/q{}: {e}",
                self.name, a.device.name, a.key.queue
            );
            return;
        }
        let counters = self.stats.queue(&a.device.name, a.key.queue);
        debug!(
            "{}: serving {} queue {}",
            self.name, a.device.name, a.key.queue
        );
        self.queues[slot] = Some(QueueSlot {
            key: a.key,
            queue: a.queue,
            kick: a.kick,
            call: a.call,
            mem: a.mem,
            device: a.device,
            counters,
            inflight: 0,
            dirty: false,
            detach: None,
            broken: false,
            notify: true,
        });
        self.policy.set_num_sources(self.queues.len() + 1);
        // Requests may have been queued before the kick fd was handed over.
        self.process_queue(slot, true);
        self.complete_all();
        self.finish_pass();
    }

    /// Pops every available request of a queue and submits it. With `rearm`,
    /// guest notifications are re-enabled afterwards (the thread will sleep);
    /// without, they stay off (the thread will poll).
    fn process_queue(&mut self, slot: usize, rearm: bool) {
        let Some(q) = self.queues[slot].as_mut() else {
            return;
        };
        if q.detach.is_some() || q.broken || self.stopping {
            return;
        }
        let mem = q.mem.memory().into_inner();
        loop {
            let q = self.queues[slot].as_mut().unwrap();
            if let Err(e) = q.quiet(&mem) {
                self.break_queue(slot, e);
                return;
            }
            loop {
                let q = self.queues[slot].as_mut().unwrap();
                let Some(chain) = q.queue.pop_descriptor_chain(&*mem) else {
                    break;
                };
                let limits = q.device.limits;
                let parsed = request::parse(chain, &limits);
                q.inflight += 1;
                match parsed {
                    Ok(req) => self.execute(slot, req, &mem),
                    Err(rej) => {
                        let q = self.queues[slot].as_ref().unwrap();
                        if self.warn.allow() {
                            warn!(
                                "{} queue {}: malformed request: {}",
                                q.device.name, q.key.queue, rej.error
                            );
                        }
                        let st = rej.error.status();
                        self.finish(slot, rej.head, rej.status, st, 0, &mem);
                    }
                }
            }
            if !rearm {
                break;
            }
            match self.queues[slot].as_mut().unwrap().arm(&mem) {
                Ok(true) => continue, // more arrived while notifications were off
                Ok(false) => break,
                Err(e) => {
                    self.break_queue(slot, e);
                    return;
                }
            }
        }
    }

    fn break_queue(&mut self, slot: usize, e: virtio_queue::Error) {
        let q = self.queues[slot].as_mut().unwrap();
        error!(
            "{} queue {}: ring not accessible ({e}); queue stopped until reset",
            q.device.name, q.key.queue
        );
        q.broken = true;
    }

    /// Turns a parsed request into a backend operation, or completes it here.
    fn execute(&mut self, slot: usize, req: Request, mem: &Arc<GuestMem>) {
        let device = self.queues[slot].as_ref().unwrap().device.clone();
        let disk = &device.disk;
        let Request {
            head,
            op,
            status: st,
        } = req;
        let data_len = op.data_len();
        let (kind, offset, len, segs) = match op {
            Operation::GetId { data } => {
                let mut written = 0usize;
                for s in &data {
                    let n = (s.len as usize).min(ID_BYTES - written);
                    if n == 0 {
                        break;
                    }
                    if mem
                        .write_slice(&device.serial[written..written + n], s.addr)
                        .is_err()
                    {
                        return self.finish(slot, head, Some(st), status::IOERR, 0, mem);
                    }
                    written += n;
                }
                return self.finish(slot, head, Some(st), status::OK, written as u32, mem);
            }
            Operation::Flush if disk.read_only || disk.kind == BackendKind::Null => {
                return self.finish(slot, head, Some(st), status::OK, 0, mem);
            }
            Operation::Flush => (IoKind::Flush, 0, 0, Vec::new()),
            Operation::Read { sector, data } => {
                (IoKind::Read, sector * SECTOR_SIZE, data_len, data)
            }
            Operation::Write { sector, data } => {
                (IoKind::Write, sector * SECTOR_SIZE, data_len, data)
            }
            Operation::Discard {
                sector,
                num_sectors,
            } => (
                IoKind::Discard,
                sector * SECTOR_SIZE,
                num_sectors as u64 * SECTOR_SIZE,
                Vec::new(),
            ),
            Operation::WriteZeroes {
                sector,
                num_sectors,
                unmap,
            } => {
                let op = (
                    IoKind::WriteZeroes,
                    sector * SECTOR_SIZE,
                    num_sectors as u64 * SECTOR_SIZE,
                    Vec::new(),
                );
                // Punching a hole is the cheapest way to zero when unmapping is allowed.
                return self.submit(slot, head, st, op, unmap, mem, &device);
            }
        };
        self.submit(
            slot,
            head,
            st,
            (kind, offset, len, segs),
            false,
            mem,
            &device,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        slot: usize,
        head: u16,
        st: GuestAddress,
        (kind, offset, len, segs): (IoKind, u64, u64, Vec<Segment>),
        punch: bool,
        mem: &Arc<GuestMem>,
        device: &Arc<BlockDevice>,
    ) {
        let disk = &device.disk;
        let mut iov = Vec::new();
        let mut bounce = None;
        if matches!(kind, IoKind::Read | IoKind::Write) {
            match guest_iovecs(mem, &segs) {
                Some(v) if v.len() <= IOV_MAX && (!disk.direct || aligned(&v, disk.align)) => {
                    iov = v
                }
                Some(_) => {
                    // Unaligned for O_DIRECT (or too fragmented): go through an aligned copy.
                    let Some(mut b) = Bounce::new(len as usize) else {
                        return self.finish(slot, head, Some(st), status::IOERR, 0, mem);
                    };
                    if kind == IoKind::Write && copy_from_guest(mem, &segs, b.slice()).is_err() {
                        return self.finish(slot, head, Some(st), status::IOERR, 0, mem);
                    }
                    iov.push(libc::iovec {
                        iov_base: b.ptr.cast(),
                        iov_len: len as usize,
                    });
                    bounce = Some((b, segs));
                }
                None => {
                    if self.warn.allow() {
                        warn!("{}: data buffer outside guest memory", device.name);
                    }
                    return self.finish(slot, head, Some(st), status::IOERR, 0, mem);
                }
            }
        }
        let op = IoOp {
            kind,
            offset,
            len,
            iov: iov.as_ptr(),
            iovcnt: iov.len() as u32,
            dsync: kind == IoKind::Write && disk.writethrough(),
            punch,
            latency_ns: disk.latency_ns,
        };
        let token = self.free.pop().unwrap_or_else(|| {
            self.inflight.push(None);
            self.inflight.len() - 1
        });
        self.inflight[token] = Some(Inflight {
            slot,
            head,
            status: st,
            mem: mem.clone(),
            iov,
            op,
            len,
            retries: 0,
            done: 0,
            bounce,
        });
        if let Err(e) = self.submit_token(token) {
            error!(
                "{}: cannot submit to the {:?} backend: {e}",
                device.name, disk.kind
            );
            let inf = self.inflight[token].take().unwrap();
            self.free.push(token);
            self.finish(slot, head, Some(st), status::IOERR, 0, &inf.mem);
        }
    }

    fn submit_token(&mut self, token: usize) -> io::Result<()> {
        let inf = self.inflight[token].as_ref().unwrap();
        let disk = &self.queues[inf.slot].as_ref().unwrap().device.disk;
        let (kind, fd) = (disk.kind, disk.fd());
        let engine = self.engines.get(kind, &self.name)?;
        // SAFETY: `inf.iov` (heap, not moved until the Inflight is dropped) and
        // the guest buffers it points to (mapped by `inf.mem`, which the
        // Inflight holds) stay valid until this token's completion is reaped,
        // because the Inflight is only dropped in `complete`.
        unsafe { engine.submit(fd, &inf.op, token as u64)? };
        self.watch_completions(kind);
        Ok(())
    }

    /// Puts a failed or short request back in flight; hands it back (Some) if
    /// the backend refuses it.
    fn resubmit(&mut self, token: usize, inf: Inflight) -> Option<Inflight> {
        self.inflight[token] = Some(inf);
        match self.submit_token(token) {
            Ok(()) => None,
            Err(_) => self.inflight[token].take(),
        }
    }

    /// Adds the completion eventfd of `kind`'s engine to the epoll set, once
    /// (engines are created on first use).
    fn watch_completions(&mut self, kind: BackendKind) {
        let (i, token) = match kind {
            BackendKind::IoUring => (0, TOKEN_URING),
            BackendKind::Threads => (1, TOKEN_POOL),
            BackendKind::Null => (2, TOKEN_NULL),
        };
        if self.registered[i] {
            return;
        }
        let fd = match kind {
            BackendKind::IoUring => self.engines.uring.as_ref().and_then(Engine::notify_fd),
            BackendKind::Threads => self.engines.pool.as_ref().and_then(Engine::notify_fd),
            // Only once a delayed (latency-ns) operation made its timer.
            BackendKind::Null => self.engines.null.notify_fd(),
        };
        let Some(fd) = fd else { return };
        let ev = EpollEvent::new(EventSet::IN | EventSet::EDGE_TRIGGERED, token);
        if self.epoll.ctl(ControlOperation::Add, fd, ev).is_ok() {
            self.registered[i] = true;
        }
    }

    /// Commits submissions and completes everything that finished, repeating
    /// while synchronous engines (null) produce completions.
    fn complete_all(&mut self) {
        loop {
            if let Err(e) = self.engines.commit() {
                error!("{}: backend submit failed: {e}", self.name);
            }
            let mut done = std::mem::take(&mut self.completions);
            self.engines.reap(&mut done);
            if done.is_empty() {
                self.completions = done;
                return;
            }
            for c in done.drain(..) {
                self.complete(c);
            }
            self.completions = done;
        }
    }

    fn complete(&mut self, c: Completion) {
        let token = c.token as usize;
        let Some(mut inf) = self.inflight.get_mut(token).and_then(Option::take) else {
            error!("{}: completion for unknown token {token}", self.name);
            return;
        };
        let mut st = status::OK;
        if c.result < 0 {
            let errno = -c.result;
            match inf.op.kind {
                // Transient: the kernel may hand these back under memory or
                // queue pressure. Try again a few times before failing the request.
                _ if (errno == libc::EAGAIN || errno == libc::EINTR)
                    && inf.retries < MAX_RETRIES =>
                {
                    inf.retries += 1;
                    match self.resubmit(token, inf) {
                        None => return,
                        Some(back) => (inf, st) = (back, status::IOERR),
                    }
                }
                // Discard is advisory: a file system without hole punching ignores it.
                IoKind::Discard if errno == libc::EOPNOTSUPP => {}
                // No ZERO_RANGE (tmpfs): punch a hole instead, it reads back as zeroes.
                IoKind::WriteZeroes if errno == libc::EOPNOTSUPP && !inf.op.punch => {
                    inf.op.punch = true;
                    match self.resubmit(token, inf) {
                        None => return,
                        Some(back) => (inf, st) = (back, status::IOERR),
                    }
                }
                _ => {
                    if self.warn.allow() {
                        warn!(
                            "{}: {:?} at offset {} failed: {}",
                            self.queues[inf.slot].as_ref().unwrap().device.name,
                            inf.op.kind,
                            inf.op.offset,
                            io::Error::from_raw_os_error(errno)
                        );
                    }
                    st = status::IOERR;
                }
            }
        } else if matches!(inf.op.kind, IoKind::Read | IoKind::Write) {
            inf.done += c.result as u64;
            if inf.done < inf.op.len {
                if c.result == 0 {
                    // End of file: the image shrank under us.
                    if self.warn.allow() {
                        warn!(
                            "{}: {:?} at offset {} ended after {} of {} bytes",
                            self.queues[inf.slot].as_ref().unwrap().device.name,
                            inf.op.kind,
                            inf.op.offset,
                            inf.done,
                            inf.op.len
                        );
                    }
                    st = status::IOERR;
                } else {
                    // Short transfer: resubmit the rest.
                    advance(&mut inf.iov, c.result as usize);
                    inf.op.iov = inf.iov.as_ptr();
                    inf.op.iovcnt = inf.iov.len() as u32;
                    inf.op.offset += c.result as u64;
                    inf.op.len -= inf.done;
                    inf.done = 0;
                    match self.resubmit(token, inf) {
                        None => return,
                        Some(back) => (inf, st) = (back, status::IOERR),
                    }
                }
            }
        }
        self.free.push(token);
        let mut used = 0;
        if inf.op.kind == IoKind::Read && st == status::OK {
            if let Some((b, segs)) = &mut inf.bounce {
                if copy_to_guest(&inf.mem, segs, b.slice()).is_err() {
                    st = status::IOERR;
                }
            }
            // The whole request was transferred (short transfers were resubmitted).
            used = inf.len as u32;
        }
        let q = self.queues[inf.slot].as_ref().unwrap();
        let c = &q.counters;
        match inf.op.kind {
            IoKind::Read => {
                c.reads.add(1);
                c.bytes_read.add(used as u64);
            }
            IoKind::Write => {
                c.writes.add(1);
                if st == status::OK {
                    c.bytes_written.add(inf.len);
                }
            }
            IoKind::Flush => c.flushes.add(1),
            _ => c.other.add(1),
        }
        // `inf` is owned here (taken out of the table): its mapping serves
        // finish() as is, no reference count to bump per request.
        self.finish(inf.slot, inf.head, Some(inf.status), st, used, &inf.mem);
    }

    /// Writes the status byte and puts the request on the used ring.
    /// `data_len` is the number of bytes written into guest buffers before the status.
    fn finish(
        &mut self,
        slot: usize,
        head: u16,
        st_addr: Option<GuestAddress>,
        st: u8,
        data_len: u32,
        mem: &GuestMem,
    ) {
        let q = self.queues[slot].as_mut().unwrap();
        let used_len = match st_addr {
            Some(a) if mem.write_obj(st, a).is_ok() => data_len + 1,
            _ => 0,
        };
        q.counters.requests.add(1);
        if st != status::OK {
            q.counters.errors.add(1);
            self.stats.errors.add(1);
        }
        self.stats.requests.add(1);
        q.inflight -= 1;
        if let Err(e) = q.queue.add_used(mem, head, used_len) {
            error!(
                "{} queue {}: add_used failed: {e}",
                q.device.name, q.key.queue
            );
        }
        q.dirty = true;
    }

    /// End of a processing pass: one notification per queue that completed
    /// something, and detach replies for drained queues.
    fn finish_pass(&mut self) {
        for slot in 0..self.queues.len() {
            let Some(q) = self.queues[slot].as_mut() else {
                continue;
            };
            if q.dirty {
                q.dirty = false;
                let mem = q.mem.memory();
                match q.queue.needs_notification(&*mem) {
                    Ok(true) => {
                        if let Some(call) = &q.call {
                            let _ = (&*call).write(&1u64.to_ne_bytes());
                            self.stats.notifications.add(1);
                        }
                    }
                    Ok(false) => {}
                    Err(e) => debug!(
                        "{} queue {}: needs_notification: {e}",
                        q.device.name, q.key.queue
                    ),
                }
            }
            if q.inflight == 0 && (q.detach.is_some() || self.stopping) {
                let q = self.queues[slot].take().unwrap();
                let _ = self.epoll.ctl(
                    ControlOperation::Delete,
                    q.kick.as_raw_fd(),
                    EpollEvent::default(),
                );
                debug!(
                    "{}: released {} queue {}",
                    self.name, q.device.name, q.key.queue
                );
                if let Some(reply) = q.detach {
                    let _ = reply.send(q.queue.next_avail());
                }
            }
        }
    }
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

/// Host iovecs for guest segments; None if any byte is outside guest memory.
fn guest_iovecs(mem: &GuestMem, segs: &[Segment]) -> Option<Vec<libc::iovec>> {
    let mut iov = Vec::with_capacity(segs.len());
    for s in segs {
        for slice in mem
            .get_slices(s.addr, s.len as usize, Permissions::ReadWrite)
            .ok()?
        {
            let slice = slice.ok()?;
            iov.push(libc::iovec {
                iov_base: slice.ptr_guard_mut().as_ptr().cast(),
                iov_len: slice.len(),
            });
        }
    }
    Some(iov)
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

/// Drops the first `n` bytes from an iovec list.
fn advance(iov: &mut Vec<libc::iovec>, mut n: usize) {
    let mut skip = 0;
    for v in iov.iter_mut() {
        if n >= v.iov_len {
            n -= v.iov_len;
            skip += 1;
        } else {
            // SAFETY: n < iov_len, so the new base stays inside the same buffer.
            v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
            v.iov_len -= n;
            break;
        }
    }
    iov.drain(..skip);
}

/// Whether the guest made requests available that we have not popped yet.
fn has_avail(q: &QueueSlot, mem: &GuestMem) -> bool {
    q.queue
        .avail_idx(mem, Ordering::Acquire)
        .is_ok_and(|idx| idx.0 != q.queue.next_avail())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advance_drops_prefix() {
        let mut a = [0u8; 16];
        let base = a.as_mut_ptr();
        let mut iov = vec![
            libc::iovec {
                iov_base: base.cast(),
                iov_len: 4,
            },
            libc::iovec {
                iov_base: base.wrapping_add(4).cast(),
                iov_len: 12,
            },
        ];
        advance(&mut iov, 6);
        assert_eq!(iov.len(), 1);
        assert_eq!(iov[0].iov_base as usize, base as usize + 6);
        assert_eq!(iov[0].iov_len, 10);
    }
}

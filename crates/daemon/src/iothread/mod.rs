//! IOThreads: the request engine, in layers.
//!
//! Each IOThread is one OS thread (`vqblk-iotN`) running one event loop. It owns
//! the virtqueues mapped to it (their `Queue` state, kick and call fds), its own
//! backend engines (one io_uring, one worker pool) and its counters. A request is
//! popped, parsed, submitted, completed and signalled in the thread that owns its
//! queue; nothing on that path is shared with another IOThread.
//!
//! - `event_loop`: waiting, busy-polling, naps, stale edges, control commands.
//! - `queue`: a served virtqueue: pop, parse (through the device model),
//!   notification suppression, and `finish` (status byte, used ring, notify).
//! - `executor`: the in-flight table, the backends and bounce buffers: a
//!   parsed request plus guest memory in, completions out.
//! - `error`: [`ExecuteError`], the one place a virtio status is chosen.
//!
//! The control plane (the vhost-user connection threads) talks to an IOThread
//! only through [`Command`]s sent over a channel plus a wake-up eventfd.

#[cfg(test)]
mod alloc_count;
mod error;
mod event_loop;
mod executor;
mod queue;
mod queues;
mod state;
#[cfg(test)]
mod tests;

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use log::{error, warn};
use virtio_queue::Queue;
use vm_memory::{GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::block::Disk;
use crate::dirty_log::DirtyLog;
use crate::fastpath;
use crate::inflight::InflightQueue;
use crate::poll::{PollMode, PollParams};
use crate::qos::{ShareCap, SharedThrottle};
use crate::seccomp::{self, SeccompMode, ThreadKind};
use crate::stats::IoThreadStats;
use crate::virtio::device::serial_bytes;
use crate::virtio::request::{Limits, Segment};
use crate::virtio::ID_BYTES;

pub use error::ExecuteError;

pub use crate::fastpath::GuestMem;
/// The guest memory map shared by a connection and the IOThreads serving it;
/// replaced (RCU-style) on SET_MEM_TABLE / ADD_MEM_REG / REM_MEM_REG.
pub type GuestMemHandle = GuestMemoryAtomic<GuestMem>;

/// What an IOThread needs to execute one export's requests: the opened disk,
/// the device model's limits and serial, and the guest's cache mode.
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
    /// The guest switched the cache to writethrough (virtio-blk CONFIG_WCE):
    /// writes are submitted with RWF_DSYNC. Written by the transport.
    writethrough: AtomicBool,
    /// The limits the export's requests draw on (its own, or its throttle
    /// group's; None: unthrottled). Read by an IOThread when it attaches a
    /// queue of the export and replaced by the control plane, which then
    /// sends [`Command::SetThrottle`] to the queues already served: the data
    /// path keeps its own copy in the queue slot and never takes this lock.
    throttle: Mutex<Option<Arc<SharedThrottle>>>,
    /// The export's share cap, once its backing device has reservations or
    /// weights (the process layer's share allocator writes its rate).
    share: std::sync::OnceLock<Arc<ShareCap>>,
}

impl BlockDevice {
    /// The device for export `name` over `disk`; `serial` is truncated to the
    /// 20 bytes of a GET_ID answer. The cache starts in writeback mode.
    pub fn new(name: String, disk: Disk, limits: Limits, serial: &str) -> BlockDevice {
        BlockDevice {
            name,
            disk,
            limits,
            serial: serial_bytes(serial),
            writethrough: AtomicBool::new(false),
            throttle: Mutex::new(None),
            share: std::sync::OnceLock::new(),
        }
    }

    /// The export's share cap (None: its device has no reservations or
    /// weights). Read when a queue attaches and on [`Command::SetThrottle`].
    pub fn share(&self) -> Option<Arc<ShareCap>> {
        self.share.get().cloned()
    }

    /// Gives the export a share cap (once; later calls return the first).
    /// The queues already served learn it from a [`Command::SetThrottle`],
    /// sent after this.
    pub fn share_cap(&self) -> Arc<ShareCap> {
        self.share.get_or_init(Default::default).clone()
    }

    /// The limits a queue of this export attaches with (None: unthrottled).
    pub fn throttle(&self) -> Option<Arc<SharedThrottle>> {
        self.throttle.lock().unwrap().clone()
    }

    /// Replaces the limits queues attach with; the queues already served
    /// learn it from a [`Command::SetThrottle`], sent after this.
    pub fn set_throttle(&self, throttle: Option<Arc<SharedThrottle>>) {
        *self.throttle.lock().unwrap() = throttle;
    }

    /// Whether writes must be durable before completing (the guest chose
    /// writethrough).
    pub fn writethrough(&self) -> bool {
        self.writethrough.load(Ordering::Relaxed)
    }

    /// Sets the cache mode the guest chose (virtio spec 1.2, 5.2.5: the
    /// `writeback` config byte).
    pub fn set_writethrough(&self, on: bool) {
        self.writethrough.store(on, Ordering::Relaxed);
    }
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
    /// The queue's inflight record, when the frontend shares an inflight region
    /// (vhost-user INFLIGHT_SHMFD); None: no tracking.
    pub inflight: Option<InflightTracking>,
    /// The dirty log, when the ring starts while a migration logs (None:
    /// logging off).
    pub log: Option<QueueLog>,
}

/// A queue's view of the migration dirty log (vhost-user "Dirty logging"):
/// while it is set, every guest page the queue writes is marked.
#[derive(Debug, Clone)]
pub struct QueueLog {
    /// The log shared by the export's queues.
    pub log: Arc<DirtyLog>,
    /// Guest-physical address of the used ring to log its writes at
    /// (SET_VRING_ADDR's `log_guest_addr`, given with VHOST_VRING_F_LOG);
    /// None: the frontend did not ask for the used ring to be logged.
    pub used: Option<u64>,
}

/// A queue's view of the inflight region, attached (and recovered) by the
/// transport, and what the daemon that died left to do.
pub struct InflightTracking {
    /// The queue's record, written by the owner IOThread only.
    pub record: InflightQueue,
    /// Heads to execute again before popping anything new, in their original
    /// pop order; they stay recorded in flight until completed.
    pub resubmit: Vec<u16>,
}

impl QueueLog {
    /// Marks what finishing a request wrote: its data buffers and its status
    /// byte.
    pub(crate) fn mark_request(&self, written: &[Segment], status: Option<GuestAddress>) {
        for s in written {
            self.log.mark(s.addr.0, u64::from(s.len));
        }
        if let Some(a) = status {
            self.log.mark(a.0, 1);
        }
    }

    /// Marks the used ring of a `size`-entry queue (flags, index, entries and
    /// avail_event: virtio spec 1.2, 2.7.8), if the frontend asked for it.
    pub(crate) fn mark_used(&self, size: u16) {
        if let Some(used) = self.used {
            self.log.mark(used, fastpath::used_ring_len(size));
        }
    }
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
    /// Move a queue to another IOThread while the guest runs: stop popping
    /// it, wait for its in-flight requests (their used entries published and
    /// the guest notified), then send the ring, as an [`Command::Attach`],
    /// straight to `to`, and only then reply. The ring goes to `to` even if
    /// nobody waits for the reply any more, so it can never be lost.
    Handover {
        /// Which queue.
        key: QueueKey,
        /// The IOThread that takes the queue over.
        to: Mailbox,
        /// Receives what the source did once the ring is on its way to `to`;
        /// None: the queue is not served here (not started), nothing moved.
        reply: SyncSender<Option<HandedOver>>,
    },
    /// Replace the polling algorithm and knobs of a running thread (the
    /// control socket's `iothread-set`, as QEMU's `qom-set` on an iothread's
    /// poll properties). The policy starts afresh: what the old one learnt
    /// about the queues' rhythm does not carry over to new knobs.
    SetPoll {
        /// The new algorithm.
        mode: PollMode,
        /// The new knobs (validated by the sender).
        params: PollParams,
    },
    /// Switch dirty logging of a queue on (Some) or off (None), without
    /// stopping it (a migration starts or ends). Applies to the queue also
    /// while it drains for a Detach: what its last requests write is logged.
    SetLog {
        /// Which queue.
        key: QueueKey,
        /// The log, or None to stop logging.
        log: Option<QueueLog>,
        /// Told once the switch applies: every completion after it marks (the
        /// transport answers the frontend only then).
        applied: SyncSender<()>,
    },
    /// The connection replaced the memory map of queue `key`: the map the
    /// thread loaded for the queue's next pass, if any, is dropped, so that
    /// the pass loads the new one.
    NewMemory {
        /// Which queue.
        key: QueueKey,
        /// Told once done (the transport answers the frontend only then).
        applied: SyncSender<()>,
    },
    /// Replace the I/O limits of every queue of `device` served here (set
    /// with [`BlockDevice::set_throttle`] first, so that a queue attaching
    /// meanwhile takes the same). A request held back is looked at again at
    /// once under the new limits.
    SetThrottle {
        /// The export whose queues change.
        device: Arc<BlockDevice>,
        /// Its new limits (None: unthrottled).
        throttle: Option<Arc<SharedThrottle>>,
    },
    /// Drain everything and exit the thread.
    Stop,
}

/// What the source IOThread of a [`Command::Handover`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandedOver {
    /// Requests in flight when the handover began, completed before the ring
    /// left.
    pub drained: usize,
    /// From the handover command to the ring's departure: how long no
    /// IOThread popped the queue (the target pops at once on arrival).
    pub drain: Duration,
}

/// Where commands to one IOThread go: its channel, its wake-up eventfd and
/// its pending flag. Cloned into a [`Command::Handover`] so that the source
/// IOThread hands a ring straight to the target.
#[derive(Clone)]
pub struct Mailbox {
    tx: Sender<Command>,
    wake: Arc<EventFd>,
    pending: Arc<AtomicBool>,
}

impl Mailbox {
    /// Sends a command and wakes the thread (a command to a thread that has
    /// exited is dropped).
    pub fn send(&self, cmd: Command) {
        if self.tx.send(cmd).is_ok() {
            self.pending.store(true, Ordering::Release);
            let _ = self.wake.write(1);
        }
    }
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
    /// Most bounce-buffer memory the thread may hold (`bounce-buffer-max`).
    pub bounce_max: u64,
    /// seccomp filter mode for the thread (and its workers).
    pub seccomp: SeccompMode,
}

/// Default of `bounce-buffer-max`: 64 MiB per IOThread (256 requests of 256 KiB).
pub const DEFAULT_BOUNCE_BUFFER_MAX: u64 = 64 << 20;

impl Default for IoThreadSetup {
    fn default() -> Self {
        IoThreadSetup {
            cpus: None,
            poll_mode: PollMode::Off,
            poll_params: PollParams::default(),
            bounce_max: DEFAULT_BOUNCE_BUFFER_MAX,
            seccomp: SeccompMode::Off,
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
            EpollEvent::new(EventSet::IN, event_loop::TOKEN_WAKE),
        )?;
        // CLOCK_MONOTONIC is the I/O limits' clock.
        let throttle_timer = crate::clock::monotonic_timer()?;
        epoll.ctl(
            ControlOperation::Add,
            throttle_timer.as_raw_fd(),
            EpollEvent::new(EventSet::IN, event_loop::TOKEN_THROTTLE),
        )?;
        let pending = Arc::new(AtomicBool::new(false));
        let channels = event_loop::Channels {
            epoll,
            wake: wake.clone(),
            rx,
            pending: pending.clone(),
            throttle_timer,
        };
        let thread_stats = stats.clone();
        // The handle is returned once the thread has its id in the counters:
        // query-iothreads right after start names every thread.
        let (started, has_tid) = std::sync::mpsc::sync_channel(1);
        let join = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::gettid() } as u64;
                thread_stats.tid.store(tid, Ordering::Relaxed);
                let _ = started.send(());
                if let Some(cpus) = &setup.cpus {
                    pin_to(cpus);
                }
                // Hybrid-polling naps need a precise timer (the default slack
                // of normal threads is 50 us).
                // SAFETY: prctl with integer arguments only.
                unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
                let mut t = event_loop::IoThread::new(name, channels, thread_stats, &setup);
                // Everything the thread opens from here on (io_uring rings,
                // worker pools, timers) is allowed by its filter.
                if let Err(e) = seccomp::apply(ThreadKind::IoThread, setup.seccomp) {
                    error!("{e}: the IOThread serves without a filter");
                }
                t.run();
            })?;
        // Err only if the thread ended before sending (it cannot panic first).
        let _ = has_tid.recv();
        Ok(IoThreadHandle {
            index,
            stats,
            tx,
            wake,
            pending,
            join: Some(join),
        })
    }

    /// Where to send this thread commands from another thread.
    pub fn mailbox(&self) -> Mailbox {
        Mailbox {
            tx: self.tx.clone(),
            wake: self.wake.clone(),
            pending: self.pending.clone(),
        }
    }

    /// Sends a command and wakes the thread.
    pub fn send(&self, cmd: Command) {
        if self.tx.send(cmd).is_ok() {
            self.pending.store(true, Ordering::Release);
            let _ = self.wake.write(1);
        }
    }

    /// Whether `stop` joined the thread (it has exited).
    #[cfg(test)]
    pub(crate) fn is_joined(&self) -> bool {
        self.join.is_none()
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

/// Pins the calling thread to `cpus` (a warning if the kernel refuses).
pub(crate) fn pin_to(cpus: &[usize]) {
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

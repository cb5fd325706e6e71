//! I/O engines: how requests reach a device. The workload loop (`runner`) knows nothing
//! about virtio or io_uring; an engine knows nothing about offsets or statistics.
//!
//! Each engine owns `iodepth` slot buffers of `bs` bytes. A slot is either idle (its
//! buffer may be read and written through [`Engine::buffer`]) or in flight (the device
//! owns it until [`Engine::reap`] hands it back).

pub mod blkio;
pub mod rbd;
pub mod uring;

use crate::job::Dir;

/// A request handed back by [`Engine::reap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    /// The slot passed to [`Engine::queue`].
    pub slot: usize,
    /// 0 on success, a negative errno on failure.
    pub result: i32,
}

/// Errors of the engine layer.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// An operating-system call failed.
    // The OS error is part of the message (not a `#[source]`), so a one-line report
    // made with `to_string()` keeps it and `{:#}` does not repeat it.
    #[error("{target}: {what}: {err}")]
    Os {
        /// The target as given (`unix:/x.sock`, `file:/x`).
        target: String,
        /// What was being done.
        what: String,
        /// The OS error.
        err: std::io::Error,
    },
    /// libblkio refused a call.
    #[error("{target}: {what}: {msg} (errno {errno})")]
    Blkio {
        /// The target as given.
        target: String,
        /// What was being done.
        what: String,
        /// libblkio's message.
        msg: String,
        /// The errno libblkio reported.
        errno: i32,
    },
    /// The device and the job description do not fit together.
    #[error("{0}")]
    Config(String),
}

impl EngineError {
    pub(crate) fn blkio(target: &str, what: &str, e: ::blkio::Error) -> Self {
        Self::Blkio {
            target: target.to_string(),
            what: what.to_string(),
            msg: e.message().to_string(),
            errno: e.errno().raw_os_error(),
        }
    }

    pub(crate) fn os(target: &str, what: &str, err: std::io::Error) -> Self {
        Self::Os {
            target: target.to_string(),
            what: what.to_string(),
            err,
        }
    }
}

/// A queue of requests against one device, used by one job thread.
pub trait Engine: Send {
    /// The buffer of an idle slot.
    ///
    /// # Panics
    /// If the slot is in flight (a bug in the caller, not an input error).
    fn buffer(&mut self, slot: usize) -> &mut [u8];

    /// Queues a request of `bs` bytes at `offset` using the slot's buffer. The request
    /// reaches the device at the latest on the next [`Engine::commit`].
    fn queue(&mut self, slot: usize, dir: Dir, offset: u64) -> Result<(), EngineError>;

    /// Hands all queued requests to the device.
    fn commit(&mut self) -> Result<(), EngineError>;

    /// Waits for at least `min` completions (using the engine's wait mode) and appends
    /// every completion available to `out`.
    fn reap(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), EngineError>;
}

/// Slot bookkeeping shared by the engines: which slot is in flight, where its buffer is.
pub(crate) struct Slots {
    base: *mut u8,
    bs: usize,
    in_flight: Vec<bool>,
}

// SAFETY: `base` points to memory owned by the engine that owns this `Slots` (an
// aligned allocation, or a libblkio memory region kept alive by the engine's `Blkioq`,
// which holds the region registry). Nothing else aliases it, so moving it to the job
// thread together with the engine is sound.
unsafe impl Send for Slots {}

impl Slots {
    /// # Safety
    /// `base` must be valid for reads and writes of `bs * count` bytes for the lifetime
    /// of the returned value and not be accessed through any other path.
    pub(crate) unsafe fn new(base: *mut u8, bs: usize, count: usize) -> Self {
        Self {
            base,
            bs,
            in_flight: vec![false; count],
        }
    }

    pub(crate) fn buffer(&mut self, slot: usize) -> &mut [u8] {
        assert!(!self.in_flight[slot], "slot {slot} is in flight");
        // SAFETY: `slot < count` (checked by the index above); the slot's range lies
        // inside the allocation promised by `new`, and the device does not own it
        // (not in flight). `&mut self` makes the returned borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(slot * self.bs), self.bs) }
    }

    /// Marks the slot in flight and returns its buffer's address for the device.
    pub(crate) fn lend(&mut self, slot: usize) -> *mut u8 {
        assert!(!self.in_flight[slot], "slot {slot} queued twice");
        self.in_flight[slot] = true;
        // SAFETY: in bounds, as in `buffer`.
        unsafe { self.base.add(slot * self.bs) }
    }

    pub(crate) fn give_back(&mut self, slot: usize) {
        self.in_flight[slot] = false;
    }

    pub(crate) fn bs(&self) -> usize {
        self.bs
    }

    pub(crate) fn in_flight_count(&self) -> usize {
        self.in_flight.iter().filter(|&&f| f).count()
    }

    pub(crate) fn count(&self) -> usize {
        self.in_flight.len()
    }
}

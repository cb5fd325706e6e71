//! Native RBD engine: an image on a Ceph cluster driven through librbd's
//! asynchronous API directly, as fio's `rbd` engine does: the baseline without
//! virtualization for RBD exports. It reuses the daemon's loader and engine
//! (`vqblk_daemon::block::rbd`): one open image per target, one engine (its
//! own completion list and eventfd) per job thread.

use std::alloc::{self, Layout};
use std::os::fd::RawFd;
use std::sync::Arc;

use vqblk_daemon::block::rbd::{ClientConfig, RbdEngine, RbdImage, RbdSpec, DEFAULT_OP_TIMEOUT_S};
use vqblk_daemon::block::{Completion, Engine as _, IoKind, IoOp};

use super::{Done, Engine, EngineError, Slots};
use crate::job::Dir;

/// An opened RBD image.
pub struct RbdDevice {
    image: Arc<RbdImage>,
    target: String,
    /// Size in bytes.
    pub capacity: u64,
}

impl RbdDevice {
    /// Opens `spec` (`POOL/[NAMESPACE/]IMAGE`) as client.admin with the
    /// configuration librados finds (`$CEPH_CONF` first), librbd's cache off.
    pub fn open(spec: &str) -> Result<Self, EngineError> {
        let target = format!("rbd:{spec}");
        let spec = RbdSpec::parse(spec).map_err(EngineError::Config)?;
        let client = ClientConfig {
            conf: None,
            id: None,
            op_timeout_s: DEFAULT_OP_TIMEOUT_S,
            rbd_cache: false,
        };
        let image = RbdImage::open(&spec, &client, false)
            .map_err(|e| EngineError::Config(format!("{target}: {e}")))?;
        Ok(Self {
            capacity: image.size,
            image: Arc::new(image),
            target,
        })
    }

    /// An engine for one job thread.
    pub fn engine(&self, iodepth: u32, bs: u64) -> Result<RbdBenchEngine, EngineError> {
        let engine = RbdEngine::new(self.image.handle())
            .map_err(|e| EngineError::os(&self.target, "eventfd", e))?;
        let len = (iodepth as usize * bs as usize).max(4096);
        let layout = Layout::from_size_align(len, 4096)
            .map_err(|_| EngineError::Config(format!("{}: buffers too large", self.target)))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(EngineError::Config(format!(
                "{}: cannot allocate buffers",
                self.target
            )));
        }
        // SAFETY: `ptr` holds `iodepth * bs` bytes, owned by the engine next to
        // `slots` (freed in its Drop) and only accessed through `slots`.
        let slots = unsafe { Slots::new(ptr, bs as usize, iodepth as usize) };
        let iov = (0..iodepth)
            .map(|_| libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            })
            .collect();
        Ok(RbdBenchEngine {
            engine,
            slots,
            iov,
            reaped: Vec::new(),
            target: self.target.clone(),
            buf: (ptr, layout),
            _image: self.image.clone(),
        })
    }
}

/// librbd aio driven by one job thread.
pub struct RbdBenchEngine {
    engine: RbdEngine,
    slots: Slots,
    /// One iovec per slot (librbd reads it while the request is in flight).
    iov: Vec<libc::iovec>,
    reaped: Vec<Completion>,
    target: String,
    buf: (*mut u8, Layout),
    /// Keeps the image open while requests may be in flight.
    _image: Arc<RbdImage>,
}

// SAFETY: the buffer is plain memory owned by this engine, the iovecs point into
// it, and the image handle may be used from any thread: the engine moves to its
// job thread as a whole.
unsafe impl Send for RbdBenchEngine {}

impl Drop for RbdBenchEngine {
    fn drop(&mut self) {
        // librbd may still write into a buffer of a request in flight.
        let n = self.slots.in_flight_count();
        if n > 0 {
            let mut done = Vec::new();
            let _ = self.reap(n, &mut done);
        }
        // SAFETY: allocated in `RbdDevice::engine` with this layout; nothing in flight.
        unsafe { alloc::dealloc(self.buf.0, self.buf.1) }
    }
}

/// Waits until `fd` is readable, then clears its count.
fn wait_eventfd(fd: RawFd) -> std::io::Result<()> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd; 1 s bounds the wait (the caller loops).
    let r = unsafe { libc::poll(&mut p, 1, 1000) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == std::io::ErrorKind::Interrupted {
            Ok(())
        } else {
            Err(e)
        };
    }
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into `v` from a non-blocking eventfd (EAGAIN if
    // nothing is pending, which is fine).
    unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
    Ok(())
}

impl Engine for RbdBenchEngine {
    fn buffer(&mut self, slot: usize) -> &mut [u8] {
        self.slots.buffer(slot)
    }

    fn queue(&mut self, slot: usize, dir: Dir, offset: u64) -> Result<(), EngineError> {
        let bs = self.slots.bs();
        let buf = self.slots.lend(slot);
        self.iov[slot] = libc::iovec {
            iov_base: buf.cast(),
            iov_len: bs,
        };
        let op = IoOp {
            kind: match dir {
                Dir::Read => IoKind::Read,
                Dir::Write => IoKind::Write,
            },
            offset,
            len: bs as u64,
            iov: &self.iov[slot],
            iovcnt: 1,
            dsync: false,
            punch: false,
        };
        // SAFETY: the iovec (in `self.iov`, not resized) and the slot's buffer
        // stay valid and untouched until this slot's completion is reaped.
        if let Err(e) = unsafe { self.engine.submit(&op, slot as u64) } {
            self.slots.give_back(slot);
            return Err(EngineError::os(&self.target, "rbd_aio submit", e));
        }
        Ok(())
    }

    fn commit(&mut self) -> Result<(), EngineError> {
        Ok(())
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), EngineError> {
        let bs = self.slots.bs() as i32;
        let mut got = 0;
        loop {
            self.engine.reap(&mut self.reaped);
            for c in self.reaped.drain(..) {
                let slot = c.token as usize;
                self.slots.give_back(slot);
                let result = match c.result {
                    r if r < 0 => r,
                    r if r != bs => -libc::EIO,
                    _ => 0,
                };
                out.push(Done { slot, result });
                got += 1;
            }
            if got >= min {
                return Ok(());
            }
            if let Some(fd) = self.engine.notify_fd() {
                wait_eventfd(fd).map_err(|e| EngineError::os(&self.target, "poll", e))?;
            }
        }
    }
}

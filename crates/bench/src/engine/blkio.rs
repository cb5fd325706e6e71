//! vhost-user-blk client through libblkio's `virtio-blk-vhost-user` driver, the way
//! fio's libblkio engine drives it with `thread`: one libblkio instance per socket, one
//! virtqueue per job thread, data buffers inside one mapped memory region.

use std::mem::MaybeUninit;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use ::blkio::{Blkio, Blkioq, Completion, ReqFlags};

use super::{Done, Engine, EngineError, Slots};
use crate::job::Dir;
use crate::options::WaitMode;

/// libblkio's driver name.
pub const DRIVER: &str = "virtio-blk-vhost-user";

/// Descriptors a request takes in the virtqueue: libblkio sends the request header,
/// one data segment and the status byte as three descriptors and does not use
/// VIRTIO_RING_F_INDIRECT_DESC, so a queue of N entries holds N / 3 requests.
pub const DESCRIPTORS_PER_REQUEST: u32 = 3;

/// How long a job thread waits for any completion before it gives up: libblkio does not
/// watch the vhost-user socket while waiting, so a server that died or stalled would
/// otherwise hang the run forever.
pub const COMPLETION_STALL: Duration = Duration::from_secs(60);

/// A connected (not yet started) vhost-user-blk device.
pub struct BlkioDevice {
    blkio: Blkio,
    target: String,
    /// Capacity in bytes (virtio-blk config space `capacity` * 512).
    pub capacity: u64,
    /// Queues the device offers (config space `num_queues`).
    pub max_queues: u32,
    /// Required alignment of offsets and lengths (the device's `blk_size`).
    pub request_alignment: u64,
}

/// Checks that `path` is a Unix socket before handing it to libblkio, whose errors
/// for a missing path or a regular file are less telling.
fn check_socket(target: &str, path: &Path) -> Result<(), EngineError> {
    let meta = std::fs::metadata(path)
        .map_err(|e| EngineError::os(target, "cannot reach the socket", e))?;
    if !meta.file_type().is_socket() {
        let kind = if meta.is_dir() {
            "a directory"
        } else if meta.is_file() {
            "a regular file"
        } else {
            "not a socket"
        };
        return Err(EngineError::Config(format!(
            "{target}: is {kind}, not a Unix socket of a vhost-user-blk server"
        )));
    }
    Ok(())
}

impl BlkioDevice {
    /// Connects to the vhost-user-blk socket at `path`. A peer that accepts the
    /// connection but does not answer the vhost-user handshake within `timeout` (it is
    /// not a vhost-user server) is an error rather than a hang.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, EngineError> {
        let target = format!("unix:{}", path.display());
        check_socket(&target, path)?;
        let path_str = path
            .to_str()
            .ok_or_else(|| EngineError::Config(format!("{target}: path is not UTF-8")))?
            .to_string();

        let (tx, rx) = mpsc::channel();
        let t = target.clone();
        // libblkio blocks in recvmsg() without a timeout; connect on a helper thread so
        // a silent peer cannot hang us. If it times out the thread stays blocked until
        // the process exits, which is what a one-shot benchmark does next.
        std::thread::Builder::new()
            .name("blkio-connect".into())
            .spawn(move || {
                let r = (|| {
                    let mut b = Blkio::new(DRIVER)
                        .map_err(|e| EngineError::blkio(&t, "blkio_create", e))?;
                    b.set_str("path", &path_str)
                        .map_err(|e| EngineError::blkio(&t, "set path", e))?;
                    b.connect()
                        .map_err(|e| EngineError::blkio(&t, "connect (vhost-user handshake)", e))?;
                    Ok(b)
                })();
                let _ = tx.send(r);
            })
            .map_err(|e| EngineError::os(&target, "spawn connect thread", e))?;
        let blkio = match rx.recv_timeout(timeout) {
            Ok(r) => r?,
            Err(_) => {
                return Err(EngineError::Config(format!(
                    "{target}: no vhost-user answer within {}s; is it a vhost-user-blk server?",
                    timeout.as_secs_f64()
                )))
            }
        };

        let get_u64 = |name: &str| {
            blkio
                .get_u64(name)
                .map_err(|e| EngineError::blkio(&target, &format!("get {name}"), e))
        };
        let get_i32 = |name: &str| {
            blkio
                .get_i32(name)
                .map_err(|e| EngineError::blkio(&target, &format!("get {name}"), e))
        };
        let capacity = get_u64("capacity")?;
        let max_queues = get_i32("max-queues")?.max(0) as u32;
        let request_alignment = get_i32("request-alignment")?.max(1) as u64;
        Ok(Self {
            blkio,
            target,
            capacity,
            max_queues,
            request_alignment,
        })
    }

    /// Starts the device with one queue per entry of `queues` (`(iodepth, bs)` of the job
    /// thread that will use it) and `queue_size` entries each, and maps one memory region
    /// holding every thread's buffers.
    pub fn start(
        mut self,
        queues: &[(u32, u64)],
        queue_size: u32,
        wait_mode: WaitMode,
    ) -> Result<Vec<BlkioEngine>, EngineError> {
        let target = self.target.clone();
        let err = |what: &str| {
            let target = target.clone();
            let what = what.to_string();
            move |e| EngineError::blkio(&target, &what, e)
        };
        self.blkio
            .set_i32("num-queues", queues.len() as i32)
            .map_err(err("set num-queues"))?;
        self.blkio
            .set_i32("queue-size", queue_size as i32)
            .map_err(err("set queue-size"))?;
        let outcome = self.blkio.start().map_err(err("start"))?;

        let align = self
            .blkio
            .get_u64("mem-region-alignment")
            .map_err(err("get mem-region-alignment"))?
            .max(4096);
        let per_queue: Vec<u64> = queues
            .iter()
            .map(|&(depth, bs)| (u64::from(depth) * bs).div_ceil(align) * align)
            .collect();
        let total: u64 = per_queue.iter().sum();
        let total = usize::try_from(total)
            .map_err(|_| EngineError::Config(format!("{target}: buffers too large")))?;
        let region = self
            .blkio
            .alloc_mem_region(total)
            .map_err(err("alloc_mem_region"))?;
        self.blkio
            .map_mem_region(&region)
            .map_err(err("map_mem_region"))?;

        let device = Arc::new(self.blkio);
        let mut engines = Vec::with_capacity(queues.len());
        let mut base = region.addr;
        for ((q, &(depth, bs)), len) in outcome.queues.into_iter().zip(queues).zip(per_queue) {
            // SAFETY: `[base, base + depth * bs)` lies inside the region libblkio allocated
            // (`total` is the sum of the rounded-up per-queue lengths) and is given to
            // this engine only. The region stays allocated while any `Blkioq` lives (each
            // holds libblkio's region registry), and the engine owns its `Blkioq`.
            let slots = unsafe { Slots::new(base as *mut u8, bs as usize, depth as usize) };
            engines.push(BlkioEngine::new(
                q,
                slots,
                wait_mode,
                Arc::clone(&device),
                &target,
            ));
            base += len as usize;
        }
        if engines.len() != queues.len() {
            return Err(EngineError::Config(format!(
                "{target}: libblkio started {} queues, {} asked",
                engines.len(),
                queues.len()
            )));
        }
        Ok(engines)
    }
}

/// One virtqueue driven by one job thread.
pub struct BlkioEngine {
    // Field order matters: the queue is dropped before the device it belongs to.
    q: Blkioq,
    slots: Slots,
    completions: Vec<MaybeUninit<Completion>>,
    wait_mode: WaitMode,
    completion_fd: Option<i32>,
    target: String,
    _device: Arc<Blkio>,
}

impl BlkioEngine {
    fn new(
        mut q: Blkioq,
        slots: Slots,
        wait_mode: WaitMode,
        device: Arc<Blkio>,
        target: &str,
    ) -> Self {
        let completion_fd = if wait_mode == WaitMode::Eventfd {
            // Queues start with completion notifications off (libblkio); turn them on
            // so the device signals the eventfd we wait on.
            q.set_completion_fd_enabled(true);
            q.get_completion_fd()
        } else {
            None
        };
        let n = slots.count();
        Self {
            q,
            slots,
            completions: (0..n).map(|_| MaybeUninit::uninit()).collect(),
            wait_mode,
            completion_fd,
            target: target.to_string(),
            _device: device,
        }
    }

    fn stalled(&self) -> EngineError {
        EngineError::Config(format!(
            "{}: no completion for {}s; the server stalled or went away",
            self.target,
            COMPLETION_STALL.as_secs()
        ))
    }

    /// One `blkioq_do_io()`; completions go to `out`.
    fn do_io(&mut self, min: usize, out: &mut Vec<Done>) -> Result<usize, EngineError> {
        let mut timeout = COMPLETION_STALL;
        let t = if min > 0 { Some(&mut timeout) } else { None };
        let n = match self.q.do_io(&mut self.completions, min, t, None) {
            Ok(n) => n,
            // libblkio reports a timed-out wait as ETIME.
            Err(e) if e.errno() == ::blkio::Errno::TIME => return Err(self.stalled()),
            Err(e) => return Err(EngineError::blkio(&self.target, "blkioq_do_io", e)),
        };
        for c in &self.completions[..n] {
            // SAFETY: do_io() initialised the first `n` elements.
            let c = unsafe { c.assume_init_ref() };
            self.slots.give_back(c.user_data);
            out.push(Done {
                slot: c.user_data,
                result: c.ret,
            });
        }
        Ok(n)
    }

    fn wait_completion_fd(&self, fd: i32) -> Result<(), EngineError> {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        loop {
            let ms = COMPLETION_STALL.as_millis() as libc::c_int;
            // SAFETY: `pfd` is a valid pollfd for the duration of the call.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r == 0 {
                return Err(self.stalled());
            }
            if r > 0 {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(EngineError::os(&self.target, "poll completion fd", e));
            }
        }
        let mut counter = 0u64;
        // SAFETY: reads 8 bytes into `counter`; the eventfd is non-blocking (libblkio sets
        // O_NONBLOCK), and EAGAIN only means another wake-up consumed it.
        unsafe { libc::read(fd, (&mut counter as *mut u64).cast(), 8) };
        Ok(())
    }
}

impl Engine for BlkioEngine {
    fn buffer(&mut self, slot: usize) -> &mut [u8] {
        self.slots.buffer(slot)
    }

    fn queue(&mut self, slot: usize, dir: Dir, offset: u64) -> Result<(), EngineError> {
        let bs = self.slots.bs();
        let buf = self.slots.lend(slot);
        match dir {
            Dir::Read => self.q.read(offset, buf, bs, slot, ReqFlags::empty()),
            Dir::Write => self.q.write(offset, buf, bs, slot, ReqFlags::empty()),
        }
        Ok(())
    }

    fn commit(&mut self) -> Result<(), EngineError> {
        // fio's libblkio commit: do_io with no completion space only submits.
        self.q
            .do_io(&mut [], 0, None, None)
            .map_err(|e| EngineError::blkio(&self.target, "blkioq_do_io (submit)", e))?;
        Ok(())
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), EngineError> {
        match self.wait_mode {
            WaitMode::Block => {
                self.do_io(min, out)?;
            }
            WaitMode::Loop => {
                let mut got = self.do_io(0, out)?;
                let mut spins = 0u32;
                let mut since: Option<std::time::Instant> = None;
                while got < min {
                    std::hint::spin_loop();
                    got += self.do_io(0, out)?;
                    spins = spins.wrapping_add(1);
                    // Look at the clock only now and then: this loop is the hot path.
                    if spins.is_multiple_of(65536) {
                        let t0 = *since.get_or_insert_with(std::time::Instant::now);
                        if t0.elapsed() > COMPLETION_STALL {
                            return Err(self.stalled());
                        }
                    }
                }
            }
            WaitMode::Eventfd => {
                let fd = self.completion_fd.ok_or_else(|| {
                    EngineError::Config(format!("{}: queue has no completion fd", self.target))
                })?;
                let mut got = self.do_io(0, out)?;
                while got < min {
                    self.wait_completion_fd(fd)?;
                    got += self.do_io(0, out)?;
                }
            }
        }
        Ok(())
    }
}

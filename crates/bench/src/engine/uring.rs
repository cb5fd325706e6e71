//! Native engine: a plain file or block device through io_uring, one ring per job
//! thread, O_DIRECT with page-aligned buffers by default. This is the baseline without
//! virtualization ("pod" in the seeds' method).

use std::alloc::{self, Layout};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

use io_uring::{opcode, types, IoUring};

use super::{Done, Engine, EngineError, Slots};
use crate::job::Dir;

/// Buffer alignment: a page satisfies O_DIRECT on every device we meet.
const BUF_ALIGN: usize = 4096;

/// An opened native target.
pub struct NativeDevice {
    file: File,
    target: String,
    /// Size in bytes.
    pub capacity: u64,
    /// Required alignment of offsets and lengths (logical block size for devices).
    pub request_alignment: u64,
    /// Whether the file was opened with O_DIRECT.
    pub direct: bool,
}

/// Size in bytes and logical block size of a block device (the daemon's ioctls).
fn block_device_geometry(file: &File, target: &str) -> Result<(u64, u64), EngineError> {
    let size = vqblk_daemon::block::blkdev_size(file)
        .map_err(|e| EngineError::os(target, "BLKGETSIZE64", e))?;
    let ssz = vqblk_daemon::block::blkdev_logical_block_size(file).map_or(512, u64::from);
    Ok((size, ssz))
}

impl NativeDevice {
    /// Opens `path` (`is_dev` for a block device). A regular file that does not exist is
    /// created and laid out with zeroes up to `create_len` bytes, as fio does, when
    /// `create_len` is given.
    pub fn open(
        path: &Path,
        is_dev: bool,
        direct: bool,
        create_len: Option<u64>,
    ) -> Result<Self, EngineError> {
        let target = format!("{}:{}", if is_dev { "dev" } else { "file" }, path.display());
        match std::fs::metadata(path) {
            Ok(m) => {
                let ft = m.file_type();
                if is_dev && !ft.is_block_device() {
                    return Err(EngineError::Config(format!(
                        "{target}: not a block device (use file: for regular files)"
                    )));
                }
                if !is_dev && !ft.is_file() {
                    return Err(EngineError::Config(format!(
                        "{target}: not a regular file (use dev: for block devices, unix: for \
                         vhost-user-blk sockets)"
                    )));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !is_dev => {
                let Some(len) = create_len else {
                    return Err(EngineError::Config(format!(
                        "{target}: does not exist; give size= to have it created"
                    )));
                };
                lay_out(path, len).map_err(|e| EngineError::os(&target, "create", e))?;
            }
            Err(e) => return Err(EngineError::os(&target, "cannot stat", e)),
        }

        let mut oo = OpenOptions::new();
        oo.read(true).write(true);
        if direct {
            oo.custom_flags(libc::O_DIRECT);
        }
        let file = match oo.open(path) {
            Ok(f) => f,
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                return Err(EngineError::Config(format!(
                    "{target}: the filesystem does not support O_DIRECT (tmpfs before \
                     Linux 6.6, some FUSE); pass --direct=0 to use the page cache"
                )))
            }
            Err(e) => return Err(EngineError::os(&target, "open", e)),
        };

        let (capacity, request_alignment) = if is_dev {
            block_device_geometry(&file, &target)?
        } else {
            let len = file
                .metadata()
                .map_err(|e| EngineError::os(&target, "stat", e))?
                .len();
            (len, 512)
        };
        Ok(Self {
            file,
            target,
            capacity,
            request_alignment,
            direct,
        })
    }

    /// An engine for one job thread: its own descriptor and ring.
    pub fn engine(&self, iodepth: u32, bs: u64) -> Result<UringEngine, EngineError> {
        let file = self
            .file
            .try_clone()
            .map_err(|e| EngineError::os(&self.target, "dup", e))?;
        let ring = IoUring::new(iodepth.next_power_of_two())
            .map_err(|e| EngineError::os(&self.target, "io_uring_setup", e))?;
        let buf = AlignedBuf::new(iodepth as usize * bs as usize).ok_or_else(|| {
            EngineError::Config(format!("{}: cannot allocate buffers", self.target))
        })?;
        // SAFETY: `buf` holds `iodepth * bs` bytes, is owned by the engine next to
        // `slots`, and is only accessed through `slots`.
        let slots = unsafe { Slots::new(buf.ptr, bs as usize, iodepth as usize) };
        Ok(UringEngine {
            ring,
            slots,
            file,
            target: self.target.clone(),
            _buf: buf,
        })
    }
}

/// Creates `path` and writes `len` bytes of zeroes (a sparse file would make reads
/// free and the baseline meaningless).
fn lay_out(path: &Path, len: u64) -> std::io::Result<()> {
    eprintln!(
        "vqblk bench: laying out {} ({} MiB)",
        path.display(),
        len >> 20
    );
    let mut f = OpenOptions::new().write(true).create_new(true).open(path)?;
    let chunk = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    f.sync_all()
}

/// A zeroed, page-aligned heap buffer.
struct AlignedBuf {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the buffer is plain memory owned by this value; it moves with its engine.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn new(len: usize) -> Option<Self> {
        let layout = Layout::from_size_align(len.max(BUF_ALIGN), BUF_ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        (!ptr.is_null()).then_some(Self { ptr, layout })
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { alloc::dealloc(self.ptr, self.layout) }
    }
}

/// One io_uring driven by one job thread.
pub struct UringEngine {
    // Field order matters: the ring (and any request still in it) goes before the
    // buffers it points into.
    ring: IoUring,
    slots: Slots,
    file: File,
    target: String,
    _buf: AlignedBuf,
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // The kernel may still write into a buffer of a request in flight: wait for
        // those before the buffers are freed (the runner normally leaves none).
        let n = self.slots.in_flight_count();
        if n > 0 {
            let mut done = Vec::new();
            let _ = self.reap(n, &mut done);
        }
    }
}

impl Engine for UringEngine {
    fn buffer(&mut self, slot: usize) -> &mut [u8] {
        self.slots.buffer(slot)
    }

    fn queue(&mut self, slot: usize, dir: Dir, offset: u64) -> Result<(), EngineError> {
        let bs = self.slots.bs() as u32;
        let fd = types::Fd(self.file.as_raw_fd());
        let buf = self.slots.lend(slot);
        let sqe = match dir {
            Dir::Read => opcode::Read::new(fd, buf, bs).offset(offset).build(),
            Dir::Write => opcode::Write::new(fd, buf, bs).offset(offset).build(),
        }
        .user_data(slot as u64);
        // SAFETY: the buffer stays valid and unused by us until the completion for
        // `slot` is reaped (the slot is marked in flight); the fd outlives the ring.
        let pushed = unsafe { self.ring.submission().push(&sqe) };
        if pushed.is_err() {
            self.slots.give_back(slot);
            return Err(EngineError::Config(format!(
                "{}: submission queue full (more requests than iodepth?)",
                self.target
            )));
        }
        Ok(())
    }

    fn commit(&mut self) -> Result<(), EngineError> {
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(EngineError::os(&self.target, "io_uring_enter", e)),
            }
        }
    }

    fn reap(&mut self, min: usize, out: &mut Vec<Done>) -> Result<(), EngineError> {
        let bs = self.slots.bs() as i32;
        let mut got = 0;
        loop {
            for cqe in self.ring.completion() {
                let slot = cqe.user_data() as usize;
                let res = cqe.result();
                self.slots.give_back(slot);
                let result = if res < 0 {
                    res
                } else if res != bs {
                    // A short transfer: past the end of the file, most likely.
                    -libc::EIO
                } else {
                    0
                };
                out.push(Done { slot, result });
                got += 1;
            }
            if got >= min {
                return Ok(());
            }
            match self.ring.submit_and_wait(min - got) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(EngineError::os(&self.target, "io_uring_enter", e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_of_a_regular_file_is_refused() {
        let f = tempfile::tempfile().unwrap();
        let e = block_device_geometry(&f, "file:/tmp/x").unwrap_err();
        assert!(e.to_string().contains("BLKGETSIZE64"), "{e}");
    }
}

//! Block backends: execute block operations on a disk. A backend never sees a
//! descriptor or a virtqueue; it gets an [`IoOp`] (kind, byte offset, host
//! iovecs) and a token, and later hands back a [`Completion`] with that token.
//!
//! Each IOThread owns one [`Engines`] value: its own io_uring, its own worker
//! pool and its own null-completion list. Nothing here is shared between
//! IOThreads.

mod null;
pub mod rbd;
mod threads;
mod transfer;
mod uring;

use crate::seccomp::SeccompMode;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

pub use crate::blkdev::{blkdev_logical_block_size, blkdev_size};
pub use null::NullEngine;
pub use threads::PoolEngine;
pub use transfer::{IoError, Next, Transfer};
pub use uring::UringEngine;

/// Which engine runs a file disk's operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileEngine {
    /// The IOThread's io_uring.
    IoUring,
    /// A pool of blocking worker threads per IOThread.
    Threads,
}

/// Where a disk's operations go: the engine that runs them, with what that
/// engine needs to reach the disk. Copied into every in-flight operation; it
/// stays valid while the [`Disk`] it came from is open (a queue's requests
/// are drained before its device goes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// No image: reads return zeroes, writes are dropped.
    Null {
        /// Completion latency in ns (0: at once), as QEMU's null-co `latency-ns`.
        latency_ns: u64,
        /// Reads write zeroes into their buffers (QEMU's null-co
        /// `read-zeroes`); false: the buffers are not touched.
        read_zeroes: bool,
    },
    /// The IOThread's io_uring, on the file `fd`.
    IoUring {
        /// The open image of a [`FileDisk`].
        fd: RawFd,
    },
    /// A pool of blocking worker threads per IOThread, on the file `fd`.
    Threads {
        /// The open image of a [`FileDisk`].
        fd: RawFd,
    },
    /// An RBD image on a Ceph cluster, through librbd's asynchronous API.
    Rbd(rbd::ImageRef),
}

/// Errors opening or preparing a disk.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The image does not exist and creating it was not asked for.
    #[error("image {0} does not exist (pass --create SIZE to create a new sparse image)")]
    Missing(PathBuf),
    /// The image could not be opened, or its metadata or (block device)
    /// size could not be read.
    #[error("cannot open image {path}: {source}")]
    Open {
        /// The image path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// O_DIRECT is not supported by the file system.
    #[error(
        "image {0}: the file system does not support O_DIRECT (cache=none); use --cache writeback"
    )]
    NoDirect(PathBuf),
    /// The image is too small to hold one sector.
    #[error("image {0} is smaller than 512 bytes")]
    TooSmall(PathBuf),
    /// An RBD image could not be opened.
    #[error(transparent)]
    Rbd(#[from] rbd::RbdError),
    /// Creating the sparse image failed.
    #[error("cannot create image {path}: {source}")]
    Create {
        /// The image path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// An opened export target: one backend, with what its engine needs.
///
/// An explicit tag (`repr(u8)`): every request asks the disk for its
/// backend, alignment and read-only state, and matching a tag byte is
/// cheaper than decoding a variant from a niche in the fields.
#[derive(Debug)]
#[repr(u8)]
pub enum Disk {
    /// A raw image file or block device.
    File(FileDisk),
    /// No image: reads return zeroes, writes are dropped.
    Null {
        /// Size in bytes (a multiple of 512).
        size: u64,
        /// Completion latency in ns (0: at once), as QEMU's null-co `latency-ns`.
        latency_ns: u64,
        /// Reads write zeroes into their buffers (QEMU's null-co
        /// `read-zeroes`, the default); false: no data is transferred.
        read_zeroes: bool,
        /// Export is read-only.
        read_only: bool,
    },
    /// An open RBD image (its size and read-only state are the image's).
    Rbd(rbd::RbdImage),
}

/// An open raw image file or block device.
#[derive(Debug)]
pub struct FileDisk {
    /// The open image.
    pub file: File,
    /// Which engine runs its operations.
    pub engine: FileEngine,
    /// Size in bytes (a multiple of 512).
    pub size: u64,
    /// Opened with O_DIRECT: the alignment its buffers and lengths need
    /// (None: through the host page cache).
    pub direct_align: Option<usize>,
    /// Logical block size to advertise.
    pub logical_block_size: u32,
    /// Opened read-only.
    pub read_only: bool,
}

impl Disk {
    /// A null disk of `size` bytes whose requests complete `latency_ns` after
    /// submission and whose reads write zeroes into their buffers if
    /// `read_zeroes` (QEMU's null-co `read-zeroes`), else leave them as they
    /// are (SPDK's null bdev).
    pub fn null(size: u64, read_only: bool, latency_ns: u64, read_zeroes: bool) -> Disk {
        Disk::Null {
            size: size / 512 * 512,
            latency_ns,
            read_zeroes,
            read_only,
        }
    }

    /// Opens the RBD image `spec` over the process's connection for `client`
    /// (a snapshot is exported read-only). Its size is the image's.
    pub fn open_rbd(
        spec: &rbd::RbdSpec,
        client: &rbd::ClientConfig,
        read_only: bool,
    ) -> Result<Disk, BlockError> {
        let image = rbd::RbdImage::open(spec, client, read_only)?;
        if image.size < 512 {
            return Err(BlockError::TooSmall(PathBuf::from(spec.to_string())));
        }
        Ok(Disk::Rbd(image))
    }

    /// Opens (or, with `create`, creates) a raw image or block device, with
    /// O_DIRECT if `direct` (the host page cache bypassed: cache=none).
    pub fn open(
        path: &Path,
        engine: FileEngine,
        direct: bool,
        read_only: bool,
        create: Option<u64>,
    ) -> Result<Disk, BlockError> {
        let open_err = |source| BlockError::Open {
            path: path.to_path_buf(),
            source,
        };
        match std::fs::metadata(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let Some(size) = create else {
                    return Err(BlockError::Missing(path.to_path_buf()));
                };
                let create_err = |source| BlockError::Create {
                    path: path.to_path_buf(),
                    source,
                };
                let f = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(path)
                    .map_err(create_err)?;
                f.set_len(size).map_err(create_err)?;
            }
            Err(e) => return Err(open_err(e)),
            Ok(_) => {}
        }
        let mut opts = OpenOptions::new();
        opts.read(true).write(!read_only);
        if direct {
            opts.custom_flags(libc::O_DIRECT);
        }
        let file = match opts.open(path) {
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                return Err(BlockError::NoDirect(path.to_path_buf()))
            }
            r => r.map_err(open_err)?,
        };
        let meta = file.metadata().map_err(open_err)?;
        let (size, lbs) = if meta.file_type().is_block_device() {
            (
                blkdev_size(&file).map_err(open_err)?,
                blkdev_logical_block_size(&file).unwrap_or(512),
            )
        } else {
            (meta.len(), 512)
        };
        if size < 512 {
            return Err(BlockError::TooSmall(path.to_path_buf()));
        }
        Ok(Disk::File(FileDisk {
            file,
            engine,
            size: size / 512 * 512,
            direct_align: direct.then_some(lbs as usize),
            logical_block_size: lbs,
            read_only,
        }))
    }

    /// Size in bytes (a multiple of 512).
    pub fn size(&self) -> u64 {
        match self {
            Disk::File(f) => f.size,
            Disk::Null { size, .. } => *size,
            Disk::Rbd(image) => image.size / 512 * 512,
        }
    }

    /// Whether the export is read-only (asked for, or an RBD snapshot).
    pub fn read_only(&self) -> bool {
        match self {
            Disk::File(f) => f.read_only,
            Disk::Null { read_only, .. } => *read_only,
            Disk::Rbd(image) => image.read_only,
        }
    }

    /// Logical block size to advertise (a block device's own, else 512).
    pub fn logical_block_size(&self) -> u32 {
        match self {
            Disk::File(f) => f.logical_block_size,
            Disk::Null { .. } | Disk::Rbd(_) => 512,
        }
    }

    /// The alignment O_DIRECT needs of buffers and lengths (None: any).
    pub fn direct_align(&self) -> Option<usize> {
        match self {
            Disk::File(f) => f.direct_align,
            Disk::Null { .. } | Disk::Rbd(_) => None,
        }
    }

    /// Where this disk's operations go.
    pub fn backend(&self) -> Backend {
        match self {
            Disk::File(f) => {
                let fd = f.file.as_raw_fd();
                match f.engine {
                    FileEngine::IoUring => Backend::IoUring { fd },
                    FileEngine::Threads => Backend::Threads { fd },
                }
            }
            Disk::Null {
                latency_ns,
                read_zeroes,
                ..
            } => Backend::Null {
                latency_ns: *latency_ns,
                read_zeroes: *read_zeroes,
            },
            Disk::Rbd(image) => Backend::Rbd(image.handle()),
        }
    }

    /// Makes all completed writes durable (used at shutdown).
    pub fn sync(&self) -> io::Result<()> {
        if self.read_only() {
            return Ok(());
        }
        match self {
            Disk::File(f) => f.file.sync_data(),
            Disk::Null { .. } => Ok(()),
            Disk::Rbd(image) => image.flush(),
        }
    }
}

/// The kind of a block operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    /// Read into the iovecs.
    Read,
    /// Write from the iovecs.
    Write,
    /// fdatasync.
    Flush,
    /// Deallocate a range (reads back as zeroes on files).
    Discard,
    /// Zero a range.
    WriteZeroes,
}

/// One block operation. `iov`/`iovcnt` point into memory the caller keeps
/// alive (and does not move) until the operation's completion is reaped.
#[derive(Debug, Clone, Copy)]
pub struct IoOp {
    /// What to do.
    pub kind: IoKind,
    /// Byte offset on the disk.
    pub offset: u64,
    /// Byte length (Read/Write: sum of the iovecs).
    pub len: u64,
    /// Host iovecs (Read/Write only).
    pub iov: *const libc::iovec,
    /// Number of iovecs.
    pub iovcnt: u32,
    /// Submit writes with RWF_DSYNC.
    pub dsync: bool,
    /// Use FALLOC_FL_PUNCH_HOLE for write-zeroes (allowed to unmap, or the
    /// file system lacks ZERO_RANGE).
    pub punch: bool,
}

#[cfg(test)]
impl IoOp {
    /// A flush: no buffers, no range (the engines' tests' operation
    /// without data).
    pub fn flush() -> IoOp {
        IoOp {
            kind: IoKind::Flush,
            offset: 0,
            len: 0,
            iov: std::ptr::null(),
            iovcnt: 0,
            dsync: false,
            punch: false,
        }
    }
}

/// The result of an operation: bytes transferred, or `-errno`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The token given at submission.
    pub token: u64,
    /// Bytes transferred (>= 0) or a negated errno.
    pub result: i32,
}

/// A request engine of one IOThread. Each engine queues operations with its
/// own `submit`, whose arguments say how it reaches a disk (a file engine
/// takes the file's fd, the null and RBD engines none); [`Engines::submit`]
/// picks the engine and those arguments from a [`Backend`].
pub trait Engine {
    /// Hands queued operations to the kernel or the workers.
    fn commit(&mut self) -> io::Result<()>;
    /// Appends finished operations to `out`.
    fn reap(&mut self, out: &mut Vec<Completion>);
    /// An eventfd signalled when completions are ready (None: the engine
    /// finishes every operation when it is submitted, [`Handed::Done`]).
    /// Watch it edge-triggered: it is never read back.
    fn notify_fd(&self) -> Option<RawFd>;
    /// Whether completions are waiting to be reaped (cheap: used while polling).
    fn has_completions(&mut self) -> bool;
}

/// Runs one operation synchronously with plain syscalls: the `threads` backend.
///
/// # Safety
/// Same contract as [`Engines::submit`].
pub unsafe fn execute_sync(fd: RawFd, op: &IoOp) -> i32 {
    let r: libc::ssize_t = match op.kind {
        // SAFETY: the caller guarantees the iovecs and their buffers are valid.
        IoKind::Read => unsafe { libc::preadv(fd, op.iov, op.iovcnt as i32, op.offset as i64) },
        IoKind::Write => {
            let flags = if op.dsync { libc::RWF_DSYNC } else { 0 };
            // SAFETY: as above.
            unsafe { libc::pwritev2(fd, op.iov, op.iovcnt as i32, op.offset as i64, flags) }
        }
        // SAFETY: plain syscalls on an fd, no pointers.
        IoKind::Flush => unsafe { libc::fdatasync(fd) as isize },
        // SAFETY: as above.
        IoKind::Discard | IoKind::WriteZeroes => unsafe {
            libc::fallocate(fd, fallocate_mode(op), op.offset as i64, op.len as i64) as isize
        },
    };
    if r < 0 {
        -io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    } else {
        r.min(i32::MAX as isize) as i32
    }
}

/// The fallocate mode for a discard or write-zeroes operation.
pub fn fallocate_mode(op: &IoOp) -> i32 {
    if op.kind == IoKind::Discard || op.punch {
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
    } else {
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
    }
}

/// What an engine did with a submitted operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handed {
    /// Queued: its completion comes out of [`Engines::reap`].
    Queued,
    /// Finished when it was submitted, with this result (as a
    /// [`Completion`]'s); no completion follows (the null engine without a
    /// latency).
    Done(i32),
}

fn queued(_: ()) -> Handed {
    Handed::Queued
}

/// The engines of one IOThread, created on first use: one io_uring, one
/// worker pool, and one null engine per null latency.
#[derive(Default)]
pub struct Engines {
    /// Null engines, by completion latency.
    nulls: Vec<(u64, NullEngine)>,
    /// The IOThread's io_uring.
    uring: Option<UringEngine>,
    /// The IOThread's blocking worker pool.
    pool: Option<PoolEngine>,
    /// RBD engines, by image.
    rbds: Vec<(rbd::ImageRef, rbd::RbdEngine)>,
    /// Completion eventfds of engines created since the last
    /// [`Engines::take_new_notify_fds`].
    new_fds: Vec<RawFd>,
    /// seccomp mode for the pool's workers.
    seccomp: SeccompMode,
}

impl Engines {
    /// No engine yet; pool workers will run under `seccomp`'s worker filter.
    pub fn new(seccomp: SeccompMode) -> Engines {
        Engines {
            seccomp,
            ..Default::default()
        }
    }

    /// Queues `op` on `backend`'s engine (created on first use; `name` names
    /// pool workers); the completion carries `token`. May submit at once, or
    /// finish the operation then and there ([`Handed::Done`]: no completion
    /// follows).
    ///
    /// # Safety
    /// `op.iov` must point to `op.iovcnt` iovecs that, with the buffers they
    /// describe, stay valid and unmoved until this token's completion is
    /// reaped; `backend`'s disk stays open until then.
    pub unsafe fn submit(
        &mut self,
        backend: Backend,
        name: &str,
        op: &IoOp,
        token: u64,
    ) -> io::Result<Handed> {
        // SAFETY: each engine's `submit` has this function's contract, which
        // the caller upholds.
        unsafe {
            match backend {
                Backend::Null {
                    latency_ns,
                    read_zeroes,
                } => self.null(latency_ns)?.submit(op, token, read_zeroes),
                Backend::IoUring { fd } => self.uring()?.submit(fd, op, token).map(queued),
                Backend::Threads { fd } => self.pool(name)?.submit(fd, op, token).map(queued),
                Backend::Rbd(image) => self.rbd(image)?.submit(op, token).map(queued),
            }
        }
    }

    /// The null engine of `latency_ns`, created if needed.
    fn null(&mut self, latency_ns: u64) -> io::Result<&mut NullEngine> {
        let i = match self.nulls.iter().position(|(l, _)| *l == latency_ns) {
            Some(i) => i,
            None => {
                let e = NullEngine::new(latency_ns)?;
                self.new_fds.extend(e.notify_fd());
                self.nulls.push((latency_ns, e));
                self.nulls.len() - 1
            }
        };
        Ok(&mut self.nulls[i].1)
    }

    /// The io_uring, created if needed.
    fn uring(&mut self) -> io::Result<&mut UringEngine> {
        Ok(match &mut self.uring {
            Some(u) => u,
            u @ None => {
                let e = UringEngine::new(256)?;
                self.new_fds.extend(e.notify_fd());
                u.insert(e)
            }
        })
    }

    /// The worker pool (its threads named after `name`), created if needed.
    fn pool(&mut self, name: &str) -> io::Result<&mut PoolEngine> {
        Ok(match &mut self.pool {
            Some(p) => p,
            p @ None => {
                let e = PoolEngine::new(name, 4, self.seccomp)?;
                self.new_fds.extend(e.notify_fd());
                p.insert(e)
            }
        })
    }

    /// The RBD engine of `image`, created if needed.
    fn rbd(&mut self, image: rbd::ImageRef) -> io::Result<&mut rbd::RbdEngine> {
        let i = match self.rbds.iter().position(|(r, _)| *r == image) {
            Some(i) => i,
            None => {
                let e = rbd::RbdEngine::new(image)?;
                self.new_fds.extend(e.notify_fd());
                self.rbds.push((image, e));
                self.rbds.len() - 1
            }
        };
        Ok(&mut self.rbds[i].1)
    }

    /// Moves the completion eventfds of engines created since the last call
    /// to `out` (the IOThread watches them, edge-triggered).
    pub fn take_new_notify_fds(&mut self, out: &mut Vec<RawFd>) {
        out.append(&mut self.new_fds);
    }

    /// Submits everything queued in every engine.
    pub fn commit(&mut self) -> io::Result<()> {
        for (_, n) in &mut self.nulls {
            n.commit()?;
        }
        if let Some(u) = &mut self.uring {
            u.commit()?;
        }
        if let Some(p) = &mut self.pool {
            p.commit()?;
        }
        for (_, r) in &mut self.rbds {
            r.commit()?;
        }
        Ok(())
    }

    /// Whether any engine has completions waiting.
    pub fn has_completions(&mut self) -> bool {
        self.nulls.iter_mut().any(|(_, n)| n.has_completions())
            || self.uring.as_mut().is_some_and(|u| u.has_completions())
            || self.pool.as_mut().is_some_and(|p| p.has_completions())
            || self.rbds.iter_mut().any(|(_, r)| r.has_completions())
    }

    /// Reaps every engine.
    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        for (_, n) in &mut self.nulls {
            n.reap(out);
        }
        if let Some(u) = &mut self.uring {
            u.reap(out);
        }
        if let Some(p) = &mut self.pool {
            p.reap(out);
        }
        for (_, r) in &mut self.rbds {
            r.reap(out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_image_is_an_error_unless_created() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.raw");
        let e = Disk::open(&p, FileEngine::IoUring, false, false, None).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        assert!(!p.exists());
        let d = Disk::open(&p, FileEngine::IoUring, false, false, Some(1 << 20)).unwrap();
        assert_eq!(d.size(), 1 << 20);
        assert_eq!(d.direct_align(), None);
    }

    /// The same operations through every engine give the same file contents.
    #[test]
    fn engines_read_write_zero() {
        for kind in [FileEngine::IoUring, FileEngine::Threads] {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("d.raw");
            let disk = Disk::open(&p, kind, false, false, Some(1 << 20)).unwrap();
            let mut engines = Engines::default();
            let mut buf = vec![0xabu8; 8192];
            let iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            let run = |engines: &mut Engines, op: IoOp| -> i32 {
                // SAFETY: `iov`, `buf` and `disk` outlive the completion,
                // which is awaited below.
                let handed = unsafe { engines.submit(disk.backend(), "t", &op, 7).unwrap() };
                assert_eq!(handed, Handed::Queued);
                engines.commit().unwrap();
                let mut out = Vec::new();
                for _ in 0..1000 {
                    engines.reap(&mut out);
                    if !out.is_empty() {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                assert_eq!(out.len(), 1);
                assert_eq!(out[0].token, 7);
                out[0].result
            };
            let w = IoOp {
                kind: IoKind::Write,
                offset: 4096,
                len: 8192,
                iov: &iov,
                iovcnt: 1,
                dsync: false,
                punch: false,
            };
            assert_eq!(run(&mut engines, w), 8192, "{kind:?}");
            assert_eq!(run(&mut engines, IoOp::flush()), 0);
            let z = IoOp {
                kind: IoKind::WriteZeroes,
                offset: 4096,
                len: 4096,
                ..IoOp::flush()
            };
            assert_eq!(run(&mut engines, z), 0);
            let data = std::fs::read(&p).unwrap();
            assert!(data[4096..8192].iter().all(|&b| b == 0));
            assert!(data[8192..12288].iter().all(|&b| b == 0xab));
            buf.fill(0);
            let r = IoOp {
                kind: IoKind::Read,
                ..w
            };
            assert_eq!(run(&mut engines, r), 8192);
            assert!(buf[4096..].iter().all(|&b| b == 0xab));
        }
    }
}

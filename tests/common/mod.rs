//! Shared helpers for the integration tests: an in-process daemon and a
//! libblkio (virtio-blk-vhost-user) client, the same driver fio's libblkio
//! engine uses.
#![allow(dead_code)]

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use vqblk_daemon::config::{BackendKind, CacheMode, ExportConfig, ServeConfig};
use vqblk_daemon::daemon::Daemon;

pub mod ceph;
pub mod control_socket;
pub mod serve_process;

/// A scratch directory on a disk file system (O_DIRECT works there, unlike tmpfs).
pub fn scratch(name: &str) -> PathBuf {
    let base =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    base
}

/// One export config with an image (or null) of `size` bytes in `dir`.
pub fn export(dir: &Path, backend: BackendKind, queues: u16, size: u64) -> ExportConfig {
    let mut e = ExportConfig::new(dir.join("disk.sock"));
    e.queues = queues;
    e.backend = backend;
    match backend {
        BackendKind::Null => e.size = Some(size.to_string()),
        _ => {
            e.image = Some(dir.join("disk.raw"));
            e.create = Some(size.to_string());
        }
    }
    e.cache = CacheMode::None;
    e
}

/// Starts a daemon with one export over `iothreads` IOThreads.
pub fn start(e: ExportConfig, iothreads: usize) -> Daemon {
    // The daemon's warnings (a failed request names its errno) go to stderr,
    // so that a rare failure in CI says why.
    let _ = vqblk_daemon::cli::init_logging("warn");
    let mut cfg = ServeConfig {
        exports: vec![e],
        ..Default::default()
    };
    cfg.iothreads.count = iothreads;
    Daemon::start(&cfg).expect("daemon starts")
}

/// A libblkio client connected to a vhost-user-blk socket.
pub struct Client {
    pub blkio: Blkio,
    pub queues: Vec<Blkioq>,
    pub region: MemoryRegion,
    pub capacity: u64,
}

pub const REGION: usize = 4 << 20;

impl Client {
    pub fn connect(sock: &Path, num_queues: usize) -> Result<Client, blkio::Error> {
        Self::connect_with(sock, num_queues, false)
    }

    pub fn connect_with(
        sock: &Path,
        num_queues: usize,
        read_only: bool,
    ) -> Result<Client, blkio::Error> {
        let mut b = Blkio::new("virtio-blk-vhost-user")?;
        b.set_str("path", sock.to_str().unwrap())?;
        b.set_bool("read-only", read_only)?;
        b.connect()?;
        b.set_i32("num-queues", num_queues as i32)?;
        b.start().map(|o| o.queues).and_then(|queues| {
            let capacity = b.get_u64("capacity")?;
            let region = b.alloc_mem_region(REGION)?;
            b.map_mem_region(&region)?;
            Ok(Client {
                blkio: b,
                queues,
                region,
                capacity,
            })
        })
    }

    /// The region as a byte slice.
    pub fn buf(&mut self) -> &mut [u8] {
        // SAFETY: the region is a live mapping of REGION bytes owned by `blkio`.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, self.region.len) }
    }

    /// Waits for `n` completions on queue `q`; returns their `ret` values by user_data order.
    pub fn wait(q: &mut Blkioq, n: usize) -> Vec<(usize, i32)> {
        let mut out = Vec::new();
        let mut c: Vec<MaybeUninit<Completion>> =
            (0..n.max(1)).map(|_| MaybeUninit::uninit()).collect();
        while out.len() < n {
            let mut t = Duration::from_secs(20);
            let got = q.do_io(&mut c, 1, Some(&mut t), None).expect("do_io");
            assert!(got > 0, "timed out waiting for a completion");
            for x in &c[..got] {
                // SAFETY: do_io initialised the first `got` entries.
                let x = unsafe { x.assume_init_ref() };
                out.push((x.user_data, x.ret));
            }
        }
        out.sort();
        out
    }

    /// Reads `len` bytes at `off` into region offset `buf_off`; returns ret.
    pub fn read(&mut self, q: usize, off: u64, buf_off: usize, len: usize) -> i32 {
        let p = (self.region.addr + buf_off) as *mut u8;
        self.queues[q].read(off, p, len, 0, ReqFlags::empty());
        Self::wait(&mut self.queues[q], 1)[0].1
    }

    /// Writes `len` bytes at `off` from region offset `buf_off`; returns ret.
    pub fn write(&mut self, q: usize, off: u64, buf_off: usize, len: usize) -> i32 {
        let p = (self.region.addr + buf_off) as *const u8;
        self.queues[q].write(off, p, len, 0, ReqFlags::empty());
        Self::wait(&mut self.queues[q], 1)[0].1
    }

    pub fn flush(&mut self, q: usize) -> i32 {
        self.queues[q].flush(0, ReqFlags::empty());
        Self::wait(&mut self.queues[q], 1)[0].1
    }

    pub fn discard(&mut self, q: usize, off: u64, len: u64) -> i32 {
        self.queues[q].discard(off, len, 0, ReqFlags::empty());
        Self::wait(&mut self.queues[q], 1)[0].1
    }

    pub fn write_zeroes(&mut self, q: usize, off: u64, len: u64, unmap: bool) -> i32 {
        let flags = if unmap {
            ReqFlags::empty()
        } else {
            ReqFlags::NO_UNMAP
        };
        self.queues[q].write_zeroes(off, len, 0, flags);
        Self::wait(&mut self.queues[q], 1)[0].1
    }
}

/// The byte pattern writer `w` puts in block `b`.
pub fn pattern(w: usize, b: usize, i: usize) -> u8 {
    (w as u8)
        .wrapping_mul(31)
        .wrapping_add((b as u8).wrapping_mul(7))
        .wrapping_add(i as u8)
        | 1
}

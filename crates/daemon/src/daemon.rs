//! The daemon: opens the disks, starts the IOThread pool, listens on every
//! export's socket (one control thread each) and shuts everything down in
//! order: stop accepting, drain, fsync, remove the sockets.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use log::{error, info, warn};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::block::{Backend, BlockError, Disk};
use crate::config::{parse_cpuset, BackendKind, CacheMode, ConfigError, ServeConfig};
use crate::iothread::{BlockDevice, Command, IoThreadHandle, IoThreadSetup};
use crate::seccomp::ThreadKind;
use crate::stats::DaemonSnapshot;
use crate::vhost_user::{serve_frontend, wait_readable, ExportShared, SessionEnd};
use crate::virtio::{BlkGeometry, SECTOR_SIZE};

/// Largest data segment we accept (virtio-blk `size_max`).
pub const SIZE_MAX: u32 = 4 << 20;
/// Largest discard / write-zeroes, in sectors (1 GiB).
pub const MAX_ZERO_SECTORS: u32 = 1 << 21;

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An export's image could not be opened.
    #[error("export {export}: {source}")]
    Block {
        /// Export name.
        export: String,
        /// What went wrong.
        #[source]
        source: BlockError,
    },
    /// A socket could not be created.
    #[error("export {export}: socket {path}: {message}")]
    Socket {
        /// Export name.
        export: String,
        /// Socket path.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A thread could not be started.
    #[error("cannot start a thread: {0}")]
    Thread(#[from] io::Error),
    /// seccomp filters were asked for and cannot be installed here.
    #[error("{0} (run with --seccomp off to serve without filters)")]
    Seccomp(#[from] crate::seccomp::SeccompError),
}

/// Opens an rbd export's image (the spec was checked by validation).
fn open_rbd(c: &crate::config::ExportConfig) -> Result<Disk, crate::block::BlockError> {
    use crate::block::rbd::{ClientConfig, RbdError, RbdSpec, DEFAULT_OP_TIMEOUT_S};
    let image = c.image.as_deref().expect("validated").to_string_lossy();
    let spec = RbdSpec::parse(&image).map_err(RbdError::Setting)?;
    let client = ClientConfig {
        conf: c.ceph_conf.clone(),
        id: c.ceph_id.clone(),
        op_timeout_s: c.ceph_op_timeout.unwrap_or(DEFAULT_OP_TIMEOUT_S),
        rbd_cache: c.cache == CacheMode::Writeback,
    };
    let disk = Disk::open_rbd(&spec, &client, c.read_only)?;
    info!(
        "{spec}: {} bytes{}",
        disk.size,
        if disk.read_only { ", read-only" } else { "" }
    );
    Ok(disk)
}

struct ExportRunner {
    name: String,
    socket: PathBuf,
    /// The disk, for the final fsync.
    device: Arc<BlockDevice>,
    control: Option<JoinHandle<()>>,
}

/// A running daemon.
pub struct Daemon {
    iothreads: Arc<Vec<IoThreadHandle>>,
    exports: Vec<ExportRunner>,
    shutdown: Arc<EventFd>,
    /// `stop` ran (from `shutdown` or from drop): it runs once.
    stopped: bool,
}

impl Daemon {
    /// Validates `config`, opens every export and starts serving.
    pub fn start(config: &ServeConfig) -> Result<Daemon, DaemonError> {
        let plans = config.validate()?;
        let seccomp = config.seccomp;
        crate::seccomp::probe(seccomp)?;
        let bounce_max = config.iothreads.bounce_buffer_max()?;
        // Open every disk before starting anything, so a bad export fails fast.
        let mut disks = Vec::new();
        for p in &plans {
            let c = &p.config;
            let disk = match c.backend {
                BackendKind::Null => {
                    Disk::null(p.size.unwrap_or(0), c.read_only, c.latency_ns.unwrap_or(0))
                }
                BackendKind::Rbd => open_rbd(c).map_err(|source| DaemonError::Block {
                    export: p.name.clone(),
                    source,
                })?,
                kind => Disk::open(
                    c.image.as_deref().unwrap(),
                    if kind == BackendKind::Threads {
                        Backend::Threads
                    } else {
                        Backend::IoUring
                    },
                    c.cache == CacheMode::None,
                    c.read_only,
                    p.create,
                )
                .map_err(|source| DaemonError::Block {
                    export: p.name.clone(),
                    source,
                })?,
            };
            disks.push(disk);
        }
        let mut threads = Vec::new();
        for i in 0..config.iothreads.count {
            let cpus = config
                .iothreads
                .threads
                .iter()
                .find(|t| t.id == i)
                .and_then(|t| t.cpuset.as_deref())
                .map(|c| parse_cpuset(c).expect("validated"));
            let (poll_mode, poll_params) = config.iothreads.poll_for(i);
            info!("IOThread {i}: polling {poll_mode:?} {poll_params:?}");
            threads.push(IoThreadHandle::spawn(
                i,
                IoThreadSetup {
                    cpus,
                    poll_mode,
                    poll_params,
                    bounce_max,
                    seccomp,
                },
            )?);
        }
        let iothreads = Arc::new(threads);
        let shutdown = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let mut daemon = Daemon {
            iothreads: iothreads.clone(),
            exports: Vec::new(),
            shutdown: shutdown.clone(),
            stopped: false,
        };
        for (index, (plan, disk)) in plans.into_iter().zip(disks).enumerate() {
            let c = &plan.config;
            let queue_size = c.queue_size;
            let geometry = BlkGeometry {
                capacity_sectors: disk.size / SECTOR_SIZE,
                blk_size: disk.logical_block_size,
                physical_block_exp: 0,
                size_max: SIZE_MAX,
                seg_max: queue_size.min(1024) as u32 - 2,
                num_queues: c.queues,
                max_discard_sectors: MAX_ZERO_SECTORS,
                max_write_zeroes_sectors: MAX_ZERO_SECTORS,
                write_zeroes_may_unmap: true,
                // The disk's: an RBD snapshot is read-only without --read-only.
                read_only: disk.read_only,
            };
            let limits = geometry.limits();
            let serial = c.serial.as_deref().unwrap_or(&plan.name);
            let (size, read_only) = (disk.size, disk.read_only);
            let device = Arc::new(BlockDevice::new(plan.name.clone(), disk, limits, serial));
            let shared = Arc::new(ExportShared {
                index,
                geometry,
                device,
                map: plan.map.clone(),
                max_queue_size: queue_size,
                iothreads: iothreads.clone(),
            });
            let sock_err = |message: String| DaemonError::Socket {
                export: plan.name.clone(),
                path: c.socket.clone(),
                message,
            };
            let listener = bind_socket(&c.socket, plan.socket_mode).map_err(sock_err)?;
            info!(
                "export {}: {} ({} bytes, backend {:?}, cache {:?}{}) on {} with {} queues, mapping {}",
                plan.name,
                c.image.as_deref().map_or("null".into(), |p| p.display().to_string()),
                size,
                c.backend,
                c.cache,
                if read_only { ", read-only" } else { "" },
                c.socket.display(),
                c.queues,
                plan.map
            );
            let sd = shutdown.clone();
            let device = shared.device.clone();
            // The control thread holds the only export-side clone of the
            // IOThread pool, so that `stop` can join the IOThreads.
            let control = std::thread::Builder::new()
                .name(format!("vqblk-ctl{index}"))
                .spawn(move || {
                    if let Err(e) = crate::seccomp::apply(ThreadKind::Control, seccomp) {
                        error!("{e}: the control thread runs without a filter");
                    }
                    control_loop(listener, shared, sd)
                })?;
            daemon.exports.push(ExportRunner {
                name: plan.name,
                socket: c.socket.clone(),
                device,
                control: Some(control),
            });
        }
        Ok(daemon)
    }

    /// The sockets, in export order.
    pub fn sockets(&self) -> Vec<PathBuf> {
        self.exports.iter().map(|e| e.socket.clone()).collect()
    }

    /// Counters of every IOThread.
    pub fn stats(&self) -> DaemonSnapshot {
        DaemonSnapshot {
            iothreads: self.iothreads.iter().map(|t| t.stats.snapshot()).collect(),
        }
    }

    /// Stops accepting, drains in-flight requests, fsyncs writable images and
    /// removes the sockets.
    pub fn shutdown(mut self) -> DaemonSnapshot {
        self.stop();
        self.stats()
    }

    /// Stops the daemon, once: drain every frontend (the control threads
    /// detach their rings and exit), stop the IOThreads, then fsync the
    /// writable images and remove the sockets.
    fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        let _ = self.shutdown.write(1);
        for e in &mut self.exports {
            if let Some(j) = e.control.take() {
                let _ = j.join();
            }
        }
        // Every connection is closed and drained and every control thread
        // has exited with its clone of the pool: stop the IOThreads, so that
        // no request can reach a disk after its fsync.
        match Arc::get_mut(&mut self.iothreads) {
            Some(threads) => {
                for t in threads.iter_mut() {
                    t.stop();
                }
            }
            None => {
                // Not expected (every other clone lived in a control thread,
                // all joined above); the threads still get the command.
                error!("IOThread pool still shared at shutdown: stopping without joining");
                for t in self.iothreads.iter() {
                    t.send(Command::Stop);
                }
            }
        }
        for e in &self.exports {
            if let Err(err) = e.device.disk.sync() {
                error!("export {}: fsync failed: {err}", e.name);
            }
            let _ = fs::remove_file(&e.socket);
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Binds the listening socket, replacing a stale socket file but never a live
/// one or a file that is not a socket.
fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener, String> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err("another process is listening on it".into());
            }
            fs::remove_file(path).map_err(|e| format!("cannot remove the stale socket: {e}"))?;
        }
        Ok(_) => return Err("exists and is not a socket".into()),
        Err(_) => {}
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create directory {}: {e}", dir.display()))?;
    }
    let l = UnixListener::bind(path).map_err(|e| e.to_string())?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| format!("chmod: {e}"))?;
    Ok(l)
}

/// One export's control thread: accept a frontend, serve its vhost-user
/// messages until it goes away, drain, and accept the next one.
fn control_loop(listener: UnixListener, shared: Arc<ExportShared>, shutdown: Arc<EventFd>) {
    let name = shared.device.name.clone();
    loop {
        if wait_readable(listener.as_raw_fd(), &shutdown, None) {
            break;
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                warn!("export {name}: accept failed: {e}");
                continue;
            }
        };
        info!("export {name}: frontend connected");
        if serve_frontend(stream, &shared, &shutdown) == SessionEnd::Shutdown {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ExportConfig;

    /// `stop` drains, then stops and joins the IOThreads (before the fsync),
    /// and a second `stop` (drop after `shutdown`) does nothing.
    #[test]
    fn stop_joins_the_iothreads_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = ExportConfig::new(dir.path().join("d.sock"));
        e.backend = BackendKind::Null;
        e.size = Some("1M".into());
        let mut cfg = ServeConfig {
            exports: vec![e],
            ..Default::default()
        };
        cfg.iothreads.count = 2;
        let mut daemon = Daemon::start(&cfg).unwrap();
        let tids: Vec<u64> = (0..100)
            .map(|_| {
                std::thread::sleep(std::time::Duration::from_millis(5));
                daemon
                    .iothreads
                    .iter()
                    .map(|t| t.stats.tid.load(std::sync::atomic::Ordering::Relaxed))
                    .collect::<Vec<_>>()
            })
            .find(|t| t.iter().all(|&x| x != 0))
            .expect("IOThreads started");
        for &tid in &tids {
            assert!(Path::new(&format!("/proc/self/task/{tid}")).exists());
        }
        daemon.stop();
        for &tid in &tids {
            assert!(
                !Path::new(&format!("/proc/self/task/{tid}")).exists(),
                "IOThread {tid} still runs after stop()"
            );
        }
        assert!(!dir.path().join("d.sock").exists(), "socket removed");
        daemon.stop();
        drop(daemon);
    }
}

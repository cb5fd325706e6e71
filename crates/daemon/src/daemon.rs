//! The daemon: opens the disks, starts the IOThread pool, listens on every
//! export's socket (one control thread each) and, when configured, on the
//! JSON-RPC control socket (which adds and removes exports at run time), and
//! shuts everything down in order: stop accepting, drain, fsync, remove the
//! sockets.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use log::{error, info, warn};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::block::{BlockError, Disk, FileEngine};
use crate::config::{
    parse_cpuset, BackendKind, CacheMode, ConfigError, ExportConfig, ExportPlan, ServeConfig,
};
use crate::fault::MemorySealing;
use crate::iothread::{BlockDevice, Command, IoThreadHandle, IoThreadSetup};
use crate::mapping::VirtqueueMap;
use crate::poll::{PollMode, PollParams};
use crate::seccomp::SeccompMode;
use crate::seccomp::ThreadKind;
use crate::stats::DaemonSnapshot;
use crate::vhost_user::{wait_frontend, ExportShared, Session, SessionEnd, Successor};
use crate::virtio::{BlkGeometry, SECTOR_SIZE};

mod autotune;
mod control_target;
pub mod handover;
pub mod queue_move;
mod shares;
mod throttle;

pub use throttle::ExportLimits;
use throttle::LiveGroup;

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
    /// The control socket could not be created.
    #[error("control socket {path}: {message}")]
    ControlSocket {
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
    /// The SIGBUS/SIGSEGV handler for faults in frontend memory could not be
    /// installed.
    #[error("cannot install the memory fault handler: {0}")]
    FaultHandler(#[source] io::Error),
}

/// A running export, as the daemon keeps it.
pub(crate) struct ExportRunner {
    /// Export name.
    pub(crate) name: String,
    /// Its vhost-user socket.
    pub(crate) socket: PathBuf,
    /// The export's settings as given (image, backend, cache...).
    pub(crate) config: ExportConfig,
    /// Owner IOThread of each queue when the export started (`queue-move`
    /// changes the live one, in `shared`: see [`ExportRunner::map`]).
    initial_map: VirtqueueMap,
    /// What its connections share: the live queue mapping (`queue-move`).
    /// Weak: the control thread's clone is the one that keeps the IOThread
    /// pool shared, so that `stop` can join the IOThreads once it exits.
    pub(crate) shared: Weak<ExportShared>,
    /// The disk, for the final fsync (and its size).
    pub(crate) device: Arc<BlockDevice>,
    /// The I/O limits its requests draw on (changed live).
    pub(crate) limits: ExportLimits,
    /// A frontend is connected.
    pub(crate) connected: Arc<AtomicBool>,
    /// Ends this export's control thread (its frontend is drained first).
    stop: Arc<EventFd>,
    /// Identity of the socket file this daemon bound: the path is removed
    /// only if it still names that file, and first thing in `stop`, while
    /// this daemon still accepts. During an upgrade the new daemon
    /// (`--takeover`) binds a fresh socket at the same path as soon as this
    /// one stops accepting; removing the path after that (as `stop` did, after
    /// the drain and the fsync) unlinked the new daemon's socket, and no
    /// frontend could reconnect.
    socket_id: Option<SocketId>,
    /// The socket and its connection went to a successor (an upgrade
    /// without reconnect): the socket is its now, never removed here.
    handed_over: Arc<AtomicBool>,
    control: Option<JoinHandle<()>>,
}

impl ExportRunner {
    /// Owner IOThread of each queue now (after any `queue-move`).
    pub(crate) fn map(&self) -> VirtqueueMap {
        match self.shared.upgrade() {
            Some(shared) => shared.map.snapshot(),
            None => self.initial_map.clone(),
        }
    }

    /// Stops the control thread (drains a connected frontend's rings) and waits for it.
    fn stop_and_join(&mut self) {
        let _ = self.stop.write(1);
        if let Some(j) = self.control.take() {
            let _ = j.join();
        }
    }

    /// Removes the socket file if it is still the one this daemon bound.
    fn remove_socket(&self) {
        if self.handed_over.load(Ordering::Acquire) {
            return;
        }
        if self.socket_id.is_some() && socket_id(&self.socket) == self.socket_id {
            let _ = fs::remove_file(&self.socket);
        }
    }

    /// Flushes the image and removes the socket if still ours (after `stop_and_join`).
    fn finish(&self) {
        if let Err(err) = self.device.disk.sync() {
            error!("export {}: fsync failed: {err}", self.name);
        }
        self.remove_socket();
    }
}

/// One IOThread as the control socket describes it: its pinning and how it
/// polls now (changed by `iothread-set`).
pub(crate) struct IoThreadInfo {
    /// Host CPUs the thread is pinned to.
    pub(crate) cpus: Option<Vec<usize>>,
    /// Current polling algorithm and knobs.
    pub(crate) poll: Mutex<(PollMode, PollParams)>,
}

/// What the daemon's threads share: the IOThread pool and the exports, which
/// the control socket adds and removes at run time. The data path never
/// touches the `exports` lock.
pub(crate) struct DaemonState {
    /// The IOThread pool.
    pub(crate) iothreads: Arc<Vec<IoThreadHandle>>,
    /// Per IOThread: pinning and polling settings.
    pub(crate) info: Vec<IoThreadInfo>,
    /// The running exports, in the order they were added.
    pub(crate) exports: Mutex<Vec<ExportRunner>>,
    /// The throttle groups (`[[throttle-group]]`, `throttle-group-set`).
    /// Taken after `exports` when both are.
    pub(crate) groups: Mutex<Vec<LiveGroup>>,
    seccomp: SeccompMode,
    memory_sealing: MemorySealing,
    /// With `--iothreads auto`: the online tuner's state (docs/autotune.md).
    pub(crate) tuning: Option<Arc<autotune::Tuning>>,
    /// Index of the next export (never reused: it keys queues in the IOThreads).
    next_index: AtomicUsize,
    /// The share allocator's thread (reservations and weights) and its board.
    pub(crate) shares: shares::Shares,
    /// This state, for the threads it starts later (the share allocator);
    /// emptied when the daemon stops (a weak reference left would keep
    /// `stop` from taking the IOThreads back to join them).
    me: Mutex<Weak<DaemonState>>,
}

/// Why `export-del` did not remove an export.
#[derive(Debug, thiserror::Error)]
pub enum DelError {
    /// No export has that name.
    #[error("no export named {0:?}")]
    NoSuchExport(String),
    /// A frontend is connected and `force` was not given (qsd's semantics).
    #[error("export {0:?} has a frontend connected (force disconnects it)")]
    InUse(String),
}

impl DaemonState {
    /// Counters of every IOThread.
    pub(crate) fn stats(&self) -> DaemonSnapshot {
        DaemonSnapshot {
            iothreads: self.iothreads.iter().map(|t| t.stats.snapshot()).collect(),
        }
    }

    /// Validates `config` as one more export (same keys as a TOML
    /// `[[export]]`), opens it and starts serving it.
    pub(crate) fn add_export(&self, config: &ExportConfig) -> Result<String, DaemonError> {
        let mut plan = crate::config::validate_export(0, config, self.iothreads.len())
            .map_err(|e| ConfigError::new(e.field.trim_start_matches("export[0]."), e.message))?;
        if let Some(tuning) = &self.tuning {
            let pool = self.iothreads.len();
            let pinned = one_cpu_each(self.info.iter().map(|i| i.cpus.as_deref()));
            autotune::start_placement(&mut plan, pool, pinned.as_deref(), tuning);
        }
        if let Some(g) = config
            .throttle_group
            .as_deref()
            .filter(|g| !self.has_group(g))
        {
            let m = format!("{g:?} is not a throttle group (throttle-group-set creates one)");
            return Err(ConfigError::new("throttle-group", m).into());
        }
        {
            let exports = self.exports.lock().unwrap();
            if exports.iter().any(|e| e.name == plan.name) {
                let m = format!("{:?} is used by another export", plan.name);
                return Err(ConfigError::new("name", m).into());
            }
            if exports.iter().any(|e| e.socket == config.socket) {
                let m = format!("{} is used by another export", config.socket.display());
                return Err(ConfigError::new("socket", m).into());
            }
        }
        let disk = open_disk(&plan)?;
        let index = self.next_index.fetch_add(1, Ordering::Relaxed);
        let name = plan.name.clone();
        // Under the exports lock: a throttle group that changes meanwhile
        // finds the export among its members.
        let mut exports = self.exports.lock().unwrap();
        let runner = self.start_export(index, plan, disk, None)?;
        exports.push(runner);
        drop(exports);
        if config.reservation_iops.is_some() || config.weight.is_some() {
            self.start_shares()?;
        }
        Ok(name)
    }

    /// Starts the share allocator's thread unless it runs (an export was
    /// given a reservation or a weight).
    pub(crate) fn start_shares(&self) -> std::io::Result<()> {
        let me = self.me.lock().unwrap().clone();
        self.shares.start(me, self.seccomp)
    }

    /// Removes export `name`: refused while a frontend is connected unless
    /// `force`; forced, the frontend is disconnected after its rings are
    /// drained. Then the image is flushed and the socket removed.
    pub(crate) fn del_export(&self, name: &str, force: bool) -> Result<(), DelError> {
        let mut runner = {
            let mut exports = self.exports.lock().unwrap();
            let i = exports
                .iter()
                .position(|e| e.name == name)
                .ok_or_else(|| DelError::NoSuchExport(name.into()))?;
            if exports[i].connected.load(Ordering::Acquire) && !force {
                return Err(DelError::InUse(name.into()));
            }
            exports.remove(i)
        };
        runner.stop_and_join();
        runner.finish();
        info!("export {name}: removed");
        Ok(())
    }

    /// Binds the socket of a validated export over its opened disk (or takes
    /// the one a predecessor handed over, with its connection) and starts
    /// its control thread.
    fn start_export(
        &self,
        index: usize,
        plan: ExportPlan,
        disk: Disk,
        arrival: Option<handover::Arrival>,
    ) -> Result<ExportRunner, DaemonError> {
        let c = &plan.config;
        let queue_size = c.queue_size;
        let geometry = BlkGeometry {
            capacity_sectors: disk.size() / SECTOR_SIZE,
            blk_size: disk.logical_block_size(),
            physical_block_exp: 0,
            size_max: SIZE_MAX,
            seg_max: queue_size.min(1024) as u32 - 2,
            num_queues: c.queues,
            max_discard_sectors: MAX_ZERO_SECTORS,
            max_write_zeroes_sectors: MAX_ZERO_SECTORS,
            write_zeroes_may_unmap: true,
            // The disk's, not the setting's: an RBD snapshot is read-only.
            read_only: disk.read_only(),
        };
        let limits = geometry.limits();
        let serial = c.serial.as_deref().unwrap_or(&plan.name);
        let (size, read_only) = (disk.size(), disk.read_only());
        let device = Arc::new(BlockDevice::new(plan.name.clone(), disk, limits, serial));
        // Before the export's socket exists: its first queues attach with it.
        let qos = match (&plan.throttle, &c.throttle_group) {
            (Some(l), _) => ExportLimits::Own(*l),
            (None, Some(g)) => ExportLimits::Group(g.clone()),
            (None, None) => ExportLimits::Unlimited,
        };
        device.set_throttle(self.initial_throttle(&qos));
        let shared = Arc::new(ExportShared {
            index,
            geometry,
            device,
            map: plan.map.clone().into(),
            max_queue_size: queue_size,
            iothreads: self.iothreads.clone(),
            memory_sealing: self.memory_sealing,
        });
        let sock_err = |message: String| DaemonError::Socket {
            export: plan.name.clone(),
            path: c.socket.clone(),
            message,
        };
        let (listener, resumed) = match arrival {
            Some(a) => (a.listener, handover::resume(a.connection, &shared)),
            None => (
                bind_socket(&c.socket, plan.socket_mode).map_err(sock_err)?,
                None,
            ),
        };
        let socket_id = socket_id(&c.socket);
        let port = handover::HandoverPort::bind(&c.socket, &plan.name, c.queues, queue_size)
            .map_err(|e| {
                warn!(
                    "export {}: no handover on upgrades (they will reconnect): {e}",
                    plan.name
                )
            })
            .ok();
        let handed_over = port
            .as_ref()
            .map_or_else(Default::default, |p| p.handed_over());
        info!(
            "export {}: {} ({} bytes, backend {:?}, cache {:?}{}) on {} with {} queues, mapping {}",
            plan.name,
            c.image
                .as_deref()
                .map_or("null".into(), |p| p.display().to_string()),
            size,
            c.backend,
            c.cache,
            if read_only { ", read-only" } else { "" },
            c.socket.display(),
            c.queues,
            plan.map
        );
        let stop = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let connected = Arc::new(AtomicBool::new(false));
        let device = shared.device.clone();
        let weak = Arc::downgrade(&shared);
        let (sd, conn, seccomp) = (stop.clone(), connected.clone(), self.seccomp);
        // The control thread holds the only export-side clone of the
        // IOThread pool, so that `stop` can join the IOThreads.
        let control = std::thread::Builder::new()
            .name(format!("vqblk-ctl{index}"))
            .spawn(move || {
                if let Err(e) = crate::seccomp::apply(ThreadKind::Control, seccomp) {
                    error!("{e}: the control thread runs without a filter");
                }
                control_loop(listener, shared, sd, conn, port, resumed)
            });
        let control = match control {
            Ok(j) => j,
            Err(e) => {
                let _ = fs::remove_file(&c.socket);
                return Err(e.into());
            }
        };
        Ok(ExportRunner {
            name: plan.name,
            socket: c.socket.clone(),
            config: c.clone(),
            initial_map: plan.map,
            socket_id,
            handed_over,
            shared: weak,
            device,
            limits: qos,
            connected,
            stop,
            control: Some(control),
        })
    }
}

/// Opens an rbd export's image (the spec was checked by validation).
fn open_rbd(c: &ExportConfig) -> Result<Disk, BlockError> {
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
        disk.size(),
        if disk.read_only() { ", read-only" } else { "" }
    );
    Ok(disk)
}

/// The CPU each IOThread is pinned to, given each thread's CPUs, if each
/// is pinned to exactly one.
fn one_cpu_each<'a>(threads: impl Iterator<Item = Option<&'a [usize]>>) -> Option<Vec<usize>> {
    threads
        .map(|cpus| match cpus {
            Some(&[cpu]) => Some(cpu),
            _ => None,
        })
        .collect()
}

/// Opens the disk of a validated export (a null disk needs nothing opened).
fn open_disk(p: &ExportPlan) -> Result<Disk, DaemonError> {
    let c = &p.config;
    Ok(match c.backend {
        BackendKind::Null => {
            let latency = c.latency_ns.unwrap_or(0);
            Disk::null(
                p.size.unwrap_or(0),
                c.read_only,
                latency,
                c.read_zeroes.unwrap_or(true),
            )
        }
        BackendKind::Rbd => open_rbd(c).map_err(|source| DaemonError::Block {
            export: p.name.clone(),
            source,
        })?,
        kind => Disk::open(
            c.image.as_deref().unwrap(),
            if kind == BackendKind::Threads {
                FileEngine::Threads
            } else {
                FileEngine::IoUring
            },
            c.cache == CacheMode::None,
            c.read_only,
            p.create,
        )
        .map_err(|source| DaemonError::Block {
            export: p.name.clone(),
            source,
        })?,
    })
}

/// A running daemon.
pub struct Daemon {
    state: Arc<DaemonState>,
    /// The control socket's thread and path, when configured.
    control: Option<(JoinHandle<()>, PathBuf)>,
    /// Ends the control socket's thread.
    shutdown: Arc<EventFd>,
    /// With `--iothreads auto`: the `vqblk-tune` thread.
    tuner: Option<autotune::Controller>,
    /// `stop` ran (from `shutdown` or from drop): it runs once.
    stopped: bool,
}

impl Daemon {
    /// Validates `config`, opens every export and starts serving.
    pub fn start(config: &ServeConfig) -> Result<Daemon, DaemonError> {
        Daemon::start_adopting(config, Vec::new())
    }

    /// [`Daemon::start`], serving export `i` on what a predecessor handed
    /// over in `arrivals[i]` (`vqblk serve --takeover`) when there is one.
    pub fn start_adopting(
        config: &ServeConfig,
        mut arrivals: Vec<Option<handover::Arrival>>,
    ) -> Result<Daemon, DaemonError> {
        let mut plans = config.validate()?;
        let seccomp = config.seccomp;
        crate::seccomp::probe(seccomp)?;
        // Before any thread that touches frontend memory starts (and
        // installs a filter, which allows sigaction for SIGBUS/SIGSEGV only).
        crate::fault::install().map_err(DaemonError::FaultHandler)?;
        let bounce_max = config.iothreads.bounce_buffer_max()?;
        // Open every disk before starting anything, so a bad export fails fast.
        let disks = plans.iter().map(open_disk).collect::<Result<Vec<_>, _>>()?;
        let mut threads = Vec::new();
        let mut info = Vec::new();
        let auto_cpus = config.iothreads.auto_cpus()?;
        let pool = config.iothreads.pool_size()?;
        // A cpuset the operator gives is taken as CPUs for the pool: one
        // IOThread pinned to each, as libvirt's iothreadpin. Without one the
        // pool shares every CPU of the host with everything else, and a
        // thread pinned to a CPU that other work takes (the disk's own
        // interrupts and kernel writeback, a busy vCPU) waits for it while
        // another CPU idles; the scheduler places those threads instead.
        let pin_each = config.iothreads.cpuset.is_some();
        let thread_cpus: Vec<Option<Vec<usize>>> = (0..pool)
            .map(|i| match &auto_cpus {
                Some(c) => pin_each.then(|| vec![c[i]]),
                None => config
                    .iothreads
                    .threads
                    .iter()
                    .find(|t| t.id == i)
                    .and_then(|t| t.cpuset.as_deref())
                    .map(|c| parse_cpuset(c).expect("validated")),
            })
            .collect();
        let tuning = auto_cpus.as_ref().map(|cpus| {
            let budget = config.iothreads.cpu_budget.unwrap_or(cpus.len() as f64);
            let params = crate::autotune::Params {
                max_active: crate::autotune::Params::max_active_for_budget(budget),
                ..Default::default()
            };
            let tuning = autotune::Tuning::new(params);
            let pinned = one_cpu_each(thread_cpus.iter().map(Option::as_deref));
            for plan in &mut plans {
                autotune::start_placement(plan, pool, pinned.as_deref(), &tuning);
            }
            info!(
                "IOThreads: auto, one per CPU of {cpus:?}{}, at most {} active",
                if pinned.is_some() {
                    ", pinned to it"
                } else {
                    ", not pinned"
                },
                tuning.params.max_active
            );
            Arc::new(tuning)
        });
        for (i, cpus) in thread_cpus.into_iter().enumerate() {
            let (poll_mode, poll_params) = config.iothreads.poll_for(i);
            info!("IOThread {i}: polling {poll_mode:?} {poll_params:?}");
            info.push(IoThreadInfo {
                cpus: cpus.clone(),
                poll: Mutex::new((poll_mode, poll_params)),
            });
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
        let groups = config
            .throttle_group_plans()?
            .into_iter()
            .map(|g| LiveGroup::new(g.name, g.limits))
            .collect();
        let state = Arc::new_cyclic(|me| DaemonState {
            iothreads: Arc::new(threads),
            info,
            exports: Mutex::new(Vec::new()),
            groups: Mutex::new(groups),
            seccomp,
            memory_sealing: config.memory_sealing,
            tuning,
            next_index: AtomicUsize::new(plans.len()),
            shares: shares::Shares::default(),
            me: Mutex::new(me.clone()),
        });
        let mut daemon = Daemon {
            state: state.clone(),
            control: None,
            shutdown: Arc::new(EventFd::new(EFD_NONBLOCK)?),
            tuner: None,
            stopped: false,
        };
        for (index, (plan, disk)) in plans.into_iter().zip(disks).enumerate() {
            let arrival = arrivals.get_mut(index).and_then(Option::take);
            let runner = state.start_export(index, plan, disk, arrival)?;
            state.exports.lock().unwrap().push(runner);
        }
        if config
            .exports
            .iter()
            .any(|e| e.reservation_iops.is_some() || e.weight.is_some())
        {
            state.shares.start(Arc::downgrade(&state), seccomp)?;
        }
        if let Some(c) = &config.control {
            let listener = bind_socket(&c.socket, c.mode_bits()?).map_err(|message| {
                DaemonError::ControlSocket {
                    path: c.socket.clone(),
                    message,
                }
            })?;
            info!("control socket on {}", c.socket.display());
            let j =
                crate::control::spawn(listener, state.clone(), daemon.shutdown.clone(), seccomp)?;
            daemon.control = Some((j, c.socket.clone()));
        }
        if state.tuning.is_some() {
            daemon.tuner = Some(autotune::Controller::spawn(state.clone(), seccomp)?);
        }
        Ok(daemon)
    }

    /// The sockets, in export order.
    pub fn sockets(&self) -> Vec<PathBuf> {
        let exports = self.state.exports.lock().unwrap();
        exports.iter().map(|e| e.socket.clone()).collect()
    }

    /// The control socket, when configured.
    pub fn control_socket(&self) -> Option<&Path> {
        self.control.as_ref().map(|(_, p)| p.as_path())
    }

    /// The live counters of every IOThread (the pool is fixed), for readers
    /// that outlive a snapshot: the metrics server.
    pub fn iothread_stats(&self) -> Vec<Arc<crate::stats::IoThreadStats>> {
        self.state
            .iothreads
            .iter()
            .map(|t| t.stats.clone())
            .collect()
    }

    /// Counters of every IOThread.
    pub fn stats(&self) -> DaemonSnapshot {
        self.state.stats()
    }

    /// What the share allocator decided last (reservations and weights),
    /// for the metrics server.
    pub fn share_board(&self) -> Arc<crate::metrics::ShareBoard> {
        self.state.shares.board.clone()
    }

    /// What the online tuner has done and which IOThreads it parked, for
    /// the metrics server (None: the pool is not tuned online).
    pub fn tune_board(&self) -> Option<Arc<crate::metrics::TuneBoard>> {
        self.state.tuning.as_ref().map(|t| t.board.clone())
    }

    /// Stops accepting, drains in-flight requests, fsyncs writable images and
    /// removes the sockets.
    pub fn shutdown(mut self) -> DaemonSnapshot {
        self.stop();
        self.stats()
    }

    /// Stops the daemon, once: stop the control socket, drain every frontend
    /// (the control threads detach their rings and exit), stop the IOThreads,
    /// then fsync the writable images and remove the sockets.
    fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        // The sockets go first, while the listeners still accept: a successor
        // waiting with --takeover binds only once the path is free, and this
        // daemon never touches the path again.
        for e in self.state.exports.lock().unwrap().iter() {
            e.remove_socket();
        }
        let _ = self.shutdown.write(1);
        if let Some((j, path)) = self.control.take() {
            let _ = j.join();
            let _ = fs::remove_file(path);
        }
        // Before the drain: no queue moves once the exports stop.
        if let Some(t) = self.tuner.take() {
            t.stop();
        }
        // Before the IOThreads are joined: it holds the state while it ticks.
        self.state.shares.stop();
        *self.state.me.lock().unwrap() = Weak::new();
        let mut exports = std::mem::take(&mut *self.state.exports.lock().unwrap());
        // One line per step, so that a stop that hangs (or is cut short by
        // shutdown-timeout) says where.
        info!(
            "shutdown: draining the requests in flight of {} exports",
            exports.len()
        );
        for e in &exports {
            let _ = e.stop.write(1);
        }
        for e in &mut exports {
            e.stop_and_join();
        }
        // Every connection is closed and drained and every control thread
        // (and the control socket's) has exited with its clone of the pool:
        // stop the IOThreads, so that no request can reach a disk after its fsync.
        info!("shutdown: stopping the IOThreads");
        match Arc::get_mut(&mut self.state).and_then(|s| Arc::get_mut(&mut s.iothreads)) {
            Some(threads) => {
                for t in threads.iter_mut() {
                    t.stop();
                }
            }
            None => {
                // Not expected (every other clone lived in a joined thread);
                // the threads still get the command.
                error!("IOThread pool still shared at shutdown: stopping without joining");
                for t in self.state.iothreads.iter() {
                    t.send(Command::Stop);
                }
            }
        }
        info!("shutdown: flushing the images");
        for e in &exports {
            e.finish();
        }
        info!("shutdown: closing the images");
        drop(exports);
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Device, inode and change time of a file: a socket bound at the same path
/// after ours was unlinked may reuse the inode number, not the change time.
type SocketId = (u64, u64, i64, i64);

/// The identity of the file at `path`, if there is one.
fn socket_id(path: &Path) -> Option<SocketId> {
    use std::os::unix::fs::MetadataExt;
    fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
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
/// messages until it goes away, drain, and accept the next one; first the
/// connection a predecessor handed over (`resumed`), if any. Ends when the
/// daemon stops, or when a successor took the export over `port`.
fn control_loop(
    listener: UnixListener,
    shared: Arc<ExportShared>,
    shutdown: Arc<EventFd>,
    connected: Arc<AtomicBool>,
    mut port: Option<handover::HandoverPort>,
    mut resumed: Option<Session>,
) {
    let name = shared.device.name.clone();
    loop {
        let session = match resumed.take() {
            Some(s) => s,
            None => {
                let knock = port.as_ref().and_then(|p| p.fd());
                match wait_frontend(listener.as_raw_fd(), knock, &shutdown) {
                    None => break,
                    Some(false) => {
                        // No frontend: the listener alone goes.
                        let channel = port.as_mut().and_then(|p| p.knock());
                        if let Some(channel) = channel {
                            if port.take().unwrap().hand_over(channel, &listener, None) {
                                return;
                            }
                        }
                        continue;
                    }
                    Some(true) => {}
                }
                match listener.accept() {
                    Ok((s, _)) => {
                        info!("export {name}: frontend connected");
                        Session::new(s, &shared)
                    }
                    Err(e) => {
                        warn!("export {name}: accept failed: {e}");
                        continue;
                    }
                }
            }
        };
        connected.store(true, Ordering::Release);
        let end = session.serve(&shutdown, port.as_mut().map(|p| p as &mut dyn Successor));
        connected.store(false, Ordering::Release);
        match end {
            SessionEnd::Shutdown => break,
            SessionEnd::Disconnected => {}
            SessionEnd::HandedOver(d) => {
                let connection = Some((d.state, d.files));
                if port
                    .take()
                    .unwrap()
                    .hand_over(d.channel, &listener, connection)
                {
                    return;
                }
            }
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
                    .state
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
        assert!(
            daemon.state.iothreads.iter().all(|t| t.is_joined()),
            "stop() joined every IOThread"
        );
        // A joined thread's task can outlive the join by a moment (the kernel
        // clears the tid the join waits on before it releases the task).
        for &tid in &tids {
            let task = format!("/proc/self/task/{tid}");
            let gone = (0..200).any(|_| {
                let gone = !Path::new(&task).exists();
                if !gone {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                gone
            });
            assert!(gone, "IOThread {tid} still runs after stop()");
        }
        assert!(!dir.path().join("d.sock").exists(), "socket removed");
        daemon.stop();
        drop(daemon);
    }

    /// During an upgrade the new daemon (`--takeover`) binds a socket at the
    /// path once the old one stops accepting. The old daemon's exit must not
    /// remove it (it did: QEMU then found no socket and never reconnected).
    #[test]
    fn stop_leaves_a_socket_another_daemon_bound_at_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let mut e = ExportConfig::new(path.clone());
        e.backend = BackendKind::Null;
        e.size = Some("1M".into());
        let cfg = ServeConfig {
            exports: vec![e],
            ..Default::default()
        };
        let daemon = Daemon::start(&cfg).unwrap();
        // The successor replaces the path with its own socket.
        fs::remove_file(&path).unwrap();
        let successor = UnixListener::bind(&path).unwrap();
        daemon.shutdown();
        assert!(
            path.exists(),
            "the old daemon removed its successor's socket"
        );
        assert!(UnixStream::connect(&path).is_ok());
        drop(successor);
    }
}

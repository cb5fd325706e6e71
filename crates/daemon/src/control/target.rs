//! What the control socket sees of the daemon and may ask of it.
//!
//! The process layer (`daemon`) owns the IOThread pool and the exports and
//! starts the control socket's thread, handing it a [`ControlTarget`]. The
//! control socket knows the daemon only through this trait, defined on its
//! side, so the dependency runs one way: process -> control socket, the order
//! of ARCHITECTURE.md's layer table (checked by `tests/layers.rs`).

use std::path::PathBuf;
use std::time::Duration;

use super::RpcError;
use crate::config::ExportConfig;
use crate::mapping::VirtqueueMap;
use crate::poll::{PollMode, PollParams};
use crate::qos::ThrottleLimits;
use crate::stats::DaemonSnapshot;

/// The daemon as the control socket drives it. Errors are the control
/// socket's: a refusal naming the parameter at fault
/// ([`RpcError::param`]) or a failure ([`RpcError::failed`]).
pub trait ControlTarget: Send + Sync {
    /// Counters of every IOThread, now.
    fn stats(&self) -> DaemonSnapshot;
    /// The IOThread pool, in id order.
    fn iothreads(&self) -> Vec<IoThreadView>;
    /// The running exports, in the order they were added.
    fn exports(&self) -> Vec<ExportView>;
    /// Gives IOThread `id` (one of the pool's) a new polling algorithm and knobs.
    fn set_poll(&self, id: usize, mode: PollMode, params: PollParams);
    /// Validates `config` as one more export (the keys of a TOML
    /// `[[export]]`), opens it and serves it; returns its name.
    fn add_export(&self, config: &ExportConfig) -> Result<String, RpcError>;
    /// Removes export `name`; one with a frontend connected only if `force`
    /// (its rings are drained first).
    fn del_export(&self, name: &str, force: bool) -> Result<(), RpcError>;
    /// Moves virtqueue `queue` of `export` to IOThread `iothread` while the
    /// guest runs.
    fn move_queue(&self, export: &str, queue: u16, iothread: usize)
        -> Result<QueueMoved, RpcError>;
    /// Gives export `export` its own `limits` (none enabled: unthrottled),
    /// or makes it a member of throttle `group` (`block_set_io_throttle`).
    fn set_io_throttle(
        &self,
        export: &str,
        limits: ThrottleLimits,
        group: Option<&str>,
    ) -> Result<(), RpcError>;
    /// Creates throttle group `name` or changes its limits; its members
    /// follow at once (`throttle-group-set`).
    fn set_throttle_group(&self, name: &str, limits: ThrottleLimits) -> Result<(), RpcError>;
    /// The throttle groups, in the order they were made.
    fn throttle_groups(&self) -> Vec<ThrottleGroupView>;
    /// Gives export `export` a reservation and a weight (`share-set`; None:
    /// none).
    fn set_share(
        &self,
        export: &str,
        reservation_iops: Option<u64>,
        weight: Option<u32>,
    ) -> Result<(), RpcError>;
    /// Turns online tuning of `export`'s queues on or off (`tune`).
    fn set_tune(&self, export: &str, on: bool) -> Result<(), RpcError> {
        let _ = (export, on);
        Err(RpcError::failed(
            "the IOThread pool is not tuned online (start with --iothreads auto)",
        ))
    }
    /// The online tuner, when the pool has one (`--iothreads auto`).
    fn tune(&self) -> Option<TuneView> {
        None
    }
}

/// The online tuner of the IOThread pool (docs/autotune.md).
#[derive(Debug, Clone)]
pub struct TuneView {
    /// Most IOThreads that may be active (the cpu budget).
    pub max_active: usize,
    /// Exports whose tuning is on.
    pub on: Vec<String>,
    /// Queue moves carried out, by reason.
    pub moves: Vec<(&'static str, u64)>,
    /// Queue moves that failed.
    pub failed: u64,
    /// The last queue moves carried out, newest first.
    pub recent: Vec<TunerMove>,
}

/// One queue move the online tuner carried out.
#[derive(Debug, Clone, PartialEq)]
pub struct TunerMove {
    /// The export.
    pub export: String,
    /// Its virtqueue.
    pub queue: u16,
    /// The IOThread that served it.
    pub from: usize,
    /// The IOThread that serves it since.
    pub to: usize,
    /// Why (`balance`, `activate`, `park`, `budget`).
    pub reason: &'static str,
    /// The load it carried, in cores.
    pub load: f64,
    /// How long ago.
    pub age: Duration,
}

/// One throttle group.
#[derive(Debug, Clone)]
pub struct ThrottleGroupView {
    /// Its name.
    pub name: String,
    /// Its limits.
    pub limits: ThrottleLimits,
    /// The exports that draw on it.
    pub members: Vec<String>,
}

/// One IOThread of the pool.
#[derive(Debug, Clone)]
pub struct IoThreadView {
    /// Host CPUs the thread is pinned to.
    pub cpus: Option<Vec<usize>>,
    /// Its polling algorithm and knobs now.
    pub poll: (PollMode, PollParams),
}

/// One running export.
#[derive(Debug, Clone)]
pub struct ExportView {
    /// Export name.
    pub name: String,
    /// Its vhost-user socket.
    pub socket: PathBuf,
    /// Its settings as given (image, backend, cache...).
    pub config: ExportConfig,
    /// The disk's size in bytes.
    pub size_bytes: u64,
    /// Owner IOThread of each queue now (after any `queue-move`).
    pub map: VirtqueueMap,
    /// A frontend is connected.
    pub connected: bool,
    /// Its own I/O limits (None: none of its own).
    pub limits: Option<ThrottleLimits>,
    /// The throttle group it belongs to.
    pub throttle_group: Option<String>,
    /// Its share of its backing device now (None: the device has no
    /// reservations or weights).
    pub share: Option<ShareView>,
}

/// An export's share of its backing device, as the share allocator set it.
#[derive(Debug, Clone, PartialEq)]
pub struct ShareView {
    /// The backing device's label (`fs-MAJOR:MINOR`, `blk-MAJOR:MINOR`,
    /// `export-NAME`).
    pub device: String,
    /// The export's IOPS cap now (None: uncapped).
    pub cap_iops: Option<f64>,
    /// The estimate of what the device completes (None: not measured yet).
    pub device_capacity_iops: Option<f64>,
}

/// What a `queue-move` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueMoved {
    /// The IOThread that owned the queue.
    pub from: usize,
    /// The IOThread that owns it now.
    pub to: usize,
    /// A running ring was handed over (false: the ring was not started, or
    /// `from == to`; only the mapping changed, or nothing).
    pub handed_over: bool,
    /// Requests in flight on the queue when the move began, completed by
    /// `from` before the ring left.
    pub drained: usize,
    /// How long the queue was not popped, at most: from the handover
    /// command to the ring being queued to `to` (which pops it at once).
    pub stall: Duration,
}

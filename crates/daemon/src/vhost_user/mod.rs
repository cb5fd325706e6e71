//! The vhost-user transport: one [`Connection`] per frontend connection,
//! implementing the backend side of the vhost-user protocol on top of the
//! `vhost` crate's message parser, and [`serve_frontend`], the message loop
//! of one connection.
//!
//! The connection owns the control-plane state of every vring (size,
//! addresses, base, kick/call fds) until the ring is started; then the ring's
//! `Queue` moves to its owner IOThread ([`Command::Attach`]) and comes back only
//! as the next avail index at GET_VRING_BASE ([`Command::Detach`]).
//!
//! The frontend is not trusted (docs/security.md): every memory region is
//! checked against its file before it is mapped ([`memory`]), every vring
//! index and size is checked, and a frontend that breaks the protocol is
//! disconnected without disturbing the other exports.
//!
//! We do not use `vhost-user-backend`'s daemon: it starts one set of worker
//! threads per connection and per export, so IOThreads could not be shared by
//! several exports, and its workers own the event loop we need for polling.
//!
//! [`Command::Attach`]: crate::iothread::Command::Attach
//! [`Command::Detach`]: crate::iothread::Command::Detach

mod connection;
pub mod memory;
mod session;

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

pub use connection::Connection;
pub(crate) use session::wait_readable;
pub use session::{serve_frontend, SessionEnd, MESSAGE_TIMEOUT};

use crate::iothread::{BlockDevice, IoThreadHandle};
use crate::mapping::VirtqueueMap;
use crate::virtio::BlkGeometry;

/// Whether INFLIGHT_SHMFD is offered to frontends: always, except in tests
/// that show what inflight tracking prevents. **Test-only:** the environment
/// variable `VQBLK_TEST_NO_INFLIGHT=1` stops offering it (read once, at the
/// first connection; logged). A frontend then restores a ring from its used
/// index after a daemon crash, as before inflight tracking (docs/qemu.md).
pub fn offer_inflight() -> bool {
    static OFFER: OnceLock<bool> = OnceLock::new();
    *OFFER.get_or_init(|| {
        let off = std::env::var_os("VQBLK_TEST_NO_INFLIGHT").is_some_and(|v| v == "1");
        if off {
            log::warn!(
                "VQBLK_TEST_NO_INFLIGHT=1: INFLIGHT_SHMFD is not offered (test only: \
                 requests in flight when the daemon dies are lost or done twice)"
            );
        }
        !off
    })
}

/// What the benchmark switch `VQBLK_BENCH_TRACK` asks every connection to
/// track although its frontend did not negotiate it, so that a client which
/// cannot (libblkio, under `vqblk bench`) measures the data-path cost of the
/// bookkeeping QEMU would ask for. **Benchmark-only**; read once, logged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BenchTrack {
    /// `inflight`: each ring is tracked in a private inflight region, as if
    /// the frontend had sent GET_INFLIGHT_FD (nobody reads it back).
    pub inflight: bool,
    /// `dirty-log`: a private dirty log covering guest memory is marked, as
    /// if the frontend had acked VHOST_F_LOG_ALL and sent SET_LOG_BASE (with
    /// the used ring logged at its own address).
    pub dirty_log: bool,
}

/// Parses `VQBLK_BENCH_TRACK`: a comma-separated list of `inflight` and
/// `dirty-log`; anything else is named in the error.
pub fn parse_bench_track(v: &str) -> Result<BenchTrack, String> {
    let mut t = BenchTrack::default();
    for w in v.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        match w {
            "inflight" => t.inflight = true,
            "dirty-log" => t.dirty_log = true,
            other => {
                return Err(format!(
                    "VQBLK_BENCH_TRACK: unknown item {other:?} (valid: inflight, dirty-log)"
                ))
            }
        }
    }
    Ok(t)
}

/// The [`BenchTrack`] of this process (`VQBLK_BENCH_TRACK`, unset: nothing;
/// an invalid value is logged and ignored).
pub fn bench_track() -> BenchTrack {
    static TRACK: OnceLock<BenchTrack> = OnceLock::new();
    *TRACK.get_or_init(|| {
        let Some(v) = std::env::var_os("VQBLK_BENCH_TRACK") else {
            return BenchTrack::default();
        };
        match parse_bench_track(&v.to_string_lossy()) {
            Ok(t) => {
                if t != BenchTrack::default() {
                    log::warn!(
                        "VQBLK_BENCH_TRACK: tracking {t:?} for every frontend (benchmark only)"
                    );
                }
                t
            }
            Err(e) => {
                log::error!("{e}; ignored");
                BenchTrack::default()
            }
        }
    })
}

/// What a connection needs from its export, shared by all its connections.
pub struct ExportShared {
    /// Export index in the daemon.
    pub index: usize,
    /// Device model (geometry, features, config space).
    pub geometry: BlkGeometry,
    /// The device the IOThreads execute requests for.
    pub device: Arc<BlockDevice>,
    /// Owner IOThread of each queue, changed at run time by `queue-move`.
    pub map: QueueRoutes,
    /// Largest queue size the frontend may set.
    pub max_queue_size: u16,
    /// The IOThread pool.
    pub iothreads: Arc<Vec<IoThreadHandle>>,
}

/// The live queue -> IOThread mapping of one export, and the lock that orders
/// every operation that routes a command to a queue's owner.
///
/// The transport holds the lock from reading a queue's owner until its
/// command is answered (a ring start, GET_VRING_BASE's drain, a new call fd);
/// a `queue-move` holds it from the handover to the new owner being
/// recorded. So a frontend's ring operation never reaches an IOThread that
/// just gave the queue away, and a move never races a ring starting or
/// stopping. IOThreads never take it: the data path does not see it.
pub struct QueueRoutes {
    num_queues: u16,
    map: Mutex<VirtqueueMap>,
}

impl From<VirtqueueMap> for QueueRoutes {
    fn from(map: VirtqueueMap) -> Self {
        QueueRoutes {
            num_queues: map.num_queues(),
            map: Mutex::new(map),
        }
    }
}

impl QueueRoutes {
    /// Number of virtqueues of the export (fixed).
    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// Takes the lock: the mapping stays as it is, and no other ring
    /// operation of this export runs, until the guard is dropped.
    pub fn lock(&self) -> MutexGuard<'_, VirtqueueMap> {
        // A panic while holding it left the mapping whole (changes are one
        // assignment): go on with it.
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A copy of the current mapping, for reports.
    pub fn snapshot(&self) -> VirtqueueMap {
        self.lock().clone()
    }
}

#[cfg(test)]
mod bench_track_tests {
    use super::{parse_bench_track, BenchTrack};

    #[test]
    fn bench_track_parses_its_items_and_names_an_unknown_one() {
        assert_eq!(parse_bench_track(""), Ok(BenchTrack::default()));
        assert_eq!(
            parse_bench_track("inflight"),
            Ok(BenchTrack {
                inflight: true,
                dirty_log: false
            })
        );
        assert_eq!(
            parse_bench_track(" dirty-log , inflight"),
            Ok(BenchTrack {
                inflight: true,
                dirty_log: true
            })
        );
        let e = parse_bench_track("inflight,log").unwrap_err();
        assert!(e.contains("\"log\""), "{e}");
    }
}

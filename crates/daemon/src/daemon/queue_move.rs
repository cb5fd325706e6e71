//! `queue-move`: moves virtqueue Q of an export to IOThread T while the guest
//! runs.
//!
//! Under the export's routing lock (`QueueRoutes`), the queue's owner gets
//! a [`Command::Handover`]: it stops popping the queue, waits for the requests
//! it has in flight (their used entries published and the guest notified),
//! turns guest notifications back on and sends the ring (the `Queue` with its
//! indexes, kick and call fds, memory, device, inflight record) straight to
//! the new owner, which checks the ring at once (a kick that arrived during
//! the move is not lost) and serves it. Then the mapping says T, and the lock
//! is released: the frontend's own ring operations (GET_VRING_BASE,
//! SET_VRING_CALL, a ring starting) wait for the move and then go to T.
//!
//! A queue that is not running (no frontend, ring not started) just changes
//! owner: it starts on T.

use std::sync::mpsc::{sync_channel, RecvTimeoutError};
use std::time::{Duration, Instant};

pub use crate::control::QueueMoved;

use log::{info, warn};

use super::{Daemon, DaemonState};
use crate::iothread::{Command, QueueKey};
use crate::mapping::MapError;

/// How long a move waits for the queue's in-flight requests: as long as
/// GET_VRING_BASE does. Past it the move still completes, when they do.
const MOVE_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a `queue-move` was refused or did not finish. Each message names the
/// parameter at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoveError {
    /// No export has that name.
    #[error("export: no export is named {export:?} (exports: {known})")]
    UnknownExport {
        /// The name given.
        export: String,
        /// The exports there are, comma-separated.
        known: String,
    },
    /// The queue index is not one of the export's.
    #[error("queue: {source}")]
    Queue {
        /// What is wrong with it.
        #[source]
        source: MapError,
    },
    /// The IOThread index is not one of the pool's.
    #[error("iothread: {source}")]
    IoThread {
        /// What is wrong with it.
        #[source]
        source: MapError,
    },
    /// The daemon is shutting down.
    #[error("export {export:?}: the daemon is stopping")]
    Stopping {
        /// The export.
        export: String,
    },
    /// The queue's in-flight requests did not complete in time; the ring
    /// moves when they do (it is never lost).
    #[error(
        "queue: export {export:?} queue {queue} still has requests in flight after \
         {waited:?}; it moves to IOThread {to} once they complete"
    )]
    DrainTimeout {
        /// The export.
        export: String,
        /// The queue.
        queue: u16,
        /// The IOThread it goes to.
        to: usize,
        /// How long the move waited.
        waited: Duration,
    },
}

impl DaemonState {
    /// Moves virtqueue `queue` of export `export` to IOThread `iothread`
    /// while the guest runs (see the module documentation). Moving a queue to
    /// its owner does nothing; a bad export, queue or IOThread is refused
    /// before anything changes.
    pub(crate) fn move_queue(
        &self,
        export: &str,
        queue: u16,
        iothread: usize,
    ) -> Result<QueueMoved, MoveError> {
        let shared = {
            let exports = self.exports.lock().unwrap();
            let runner = exports.iter().find(|e| e.name == export).ok_or_else(|| {
                MoveError::UnknownExport {
                    export: export.to_string(),
                    known: exports
                        .iter()
                        .map(|e| e.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                }
            })?;
            // The exports lock is not held across the move: `export-del`
            // and queries must not wait for a drain.
            runner.shared.clone()
        };
        let stopping = || MoveError::Stopping {
            export: export.to_string(),
        };
        let shared = shared.upgrade().ok_or_else(stopping)?;
        let pool = shared.iothreads.len();
        let num_queues = shared.map.num_queues();
        if queue >= num_queues {
            let source = MapError::QueueOutOfRange { queue, num_queues };
            return Err(MoveError::Queue { source });
        }
        if iothread >= pool {
            let source = MapError::UnknownThread {
                thread: iothread,
                pool,
            };
            return Err(MoveError::IoThread { source });
        }
        // Held to the end: the frontend's ring operations on this export
        // wait for the move.
        let mut routes = shared.map.lock();
        let from = routes.thread_of(queue);
        let mut moved = QueueMoved {
            from,
            to: iothread,
            handed_over: false,
            drained: 0,
            stall: Duration::ZERO,
        };
        if from == iothread {
            return Ok(moved);
        }
        let (tx, rx) = sync_channel(1);
        let t0 = Instant::now();
        shared.iothreads[from].send(Command::Handover {
            key: QueueKey {
                export: shared.index,
                queue,
            },
            to: shared.iothreads[iothread].mailbox(),
            reply: tx,
        });
        let reply = rx.recv_timeout(MOVE_TIMEOUT);
        // Whatever the reply, the ring is on `iothread` now or will be (the
        // source sends it there itself), or it is not running: route there.
        routes
            .set_thread(queue, iothread, pool)
            .expect("queue and IOThread checked above");
        match reply {
            Ok(Some(h)) => {
                moved.handed_over = true;
                moved.drained = h.drained;
                moved.stall = t0.elapsed();
                info!(
                    "export {export}: queue {queue} moved from IOThread {from} to {iothread} \
                     ({} requests drained, {:?} without popping)",
                    moved.drained, moved.stall
                );
                Ok(moved)
            }
            Ok(None) => {
                info!("export {export}: queue {queue} (not running) now on IOThread {iothread}");
                Ok(moved)
            }
            Err(RecvTimeoutError::Timeout) => {
                warn!(
                    "export {export}: queue {queue} did not drain in {MOVE_TIMEOUT:?}; \
                     it moves to IOThread {iothread} when it does"
                );
                Err(MoveError::DrainTimeout {
                    export: export.to_string(),
                    queue,
                    to: iothread,
                    waited: t0.elapsed(),
                })
            }
            // The source IOThread exited: only `stop` does that.
            Err(RecvTimeoutError::Disconnected) => Err(stopping()),
        }
    }
}

impl Daemon {
    /// Moves virtqueue `queue` of export `export` to IOThread `iothread`
    /// while the guest runs (see the module documentation).
    pub fn move_queue(
        &self,
        export: &str,
        queue: u16,
        iothread: usize,
    ) -> Result<QueueMoved, MoveError> {
        self.state.move_queue(export, queue, iothread)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BackendKind, ExportConfig, ServeConfig};

    fn daemon(dir: &std::path::Path) -> Daemon {
        let mut e = ExportConfig::new(dir.join("d.sock"));
        e.name = Some("db".into());
        e.backend = BackendKind::Null;
        e.size = Some("1M".into());
        e.queues = 4;
        let mut cfg = ServeConfig {
            exports: vec![e],
            ..Default::default()
        };
        cfg.iothreads.count = 2;
        Daemon::start(&cfg).unwrap()
    }

    #[test]
    fn bad_parameters_are_named_and_change_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let d = daemon(dir.path());
        let e = d.move_queue("nope", 0, 1).unwrap_err();
        assert!(matches!(e, MoveError::UnknownExport { .. }), "{e}");
        assert!(e.to_string().starts_with("export: "), "{e}");
        assert!(e.to_string().contains("db"), "lists the exports: {e}");
        let e = d.move_queue("db", 4, 1).unwrap_err();
        assert!(e.to_string().starts_with("queue: virtqueue 4"), "{e}");
        let e = d.move_queue("db", 0, 2).unwrap_err();
        assert!(e.to_string().starts_with("iothread: IOThread 2"), "{e}");
        let shared = d.state.exports.lock().unwrap()[0].shared.upgrade().unwrap();
        assert_eq!(shared.map.snapshot().to_string(), "0:0,2;1:1,3");
    }

    #[test]
    fn a_queue_not_running_changes_owner_and_the_same_owner_is_a_no_op() {
        let dir = tempfile::tempdir().unwrap();
        let d = daemon(dir.path());
        let moved = d.move_queue("db", 2, 1).unwrap();
        assert_eq!(
            moved,
            QueueMoved {
                from: 0,
                to: 1,
                handed_over: false,
                drained: 0,
                stall: Duration::ZERO
            }
        );
        let shared = d.state.exports.lock().unwrap()[0].shared.upgrade().unwrap();
        assert_eq!(shared.map.snapshot().to_string(), "0:0;1:1,2,3");
        let same = d.move_queue("db", 2, 1).unwrap();
        assert_eq!((same.from, same.to, same.handed_over), (1, 1, false));
        drop(shared);
        // The runner's handle is weak: stop still joins the IOThreads.
        d.shutdown();
    }
}

//! The vhost-user transport: one [`Connection`] per frontend connection,
//! implementing the backend side of the vhost-user protocol on top of the
//! `vhost` crate's message parser, and [`Session`], the message loop of one
//! connection (new, or resumed from what a predecessor handed over during an
//! upgrade: [`handover`]).
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
pub mod handover;
pub mod memory;
mod session;

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

pub use connection::Connection;
pub(crate) use session::wait_frontend;
pub use session::{Session, SessionEnd, Successor};

use crate::fault::MemorySealing;
use crate::iothread::{BlockDevice, IoThreadHandle};
use crate::mapping::VirtqueueMap;
use crate::virtio::BlkGeometry;

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
    /// Whether memory that cannot be sealed against shrinking is refused.
    pub memory_sealing: MemorySealing,
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

//! Live migration on a connection (vhost-user "Migration", "Dirty logging"):
//! the dirty log of SET_LOG_BASE, which log each running ring marks and
//! where its used ring is logged, switched on the IOThreads without stopping
//! the rings; and the refusal of post-copy migration.

use std::fs::File;
use std::sync::Arc;

use log::{debug, warn};
use vhost::vhost_user::message::VhostUserLog;
use vhost::vhost_user::{Error as VhostError, Result as VhostResult};
use vm_memory::{GuestAddressSpace, GuestMemoryBackend};

use super::{invalid, Connection, LOG_ALL};
use crate::dirty_log::DirtyLog;
use crate::iothread::{Command, QueueLog};
use crate::vhost_user::handover::LogState;
use crate::vhost_user::memory::seal_against_shrinking;

impl Connection {
    /// SET_LOG_BASE: maps the frontend's dirty log, checked against its file
    /// and the guest memory it must cover, and hands it to the running rings.
    pub(super) fn map_log(&mut self, log: &VhostUserLog, file: File) -> VhostResult<()> {
        // As for guest memory: sealed against shrinking where possible, then
        // checked against its size; an unsealable file is refused or left to
        // the fault handler, as the memory-sealing policy says.
        self.sealing_policy(seal_against_shrinking(&file), "the dirty log")?;
        let name = &self.export.device.name;
        // The log must cover every guest address the daemon may write.
        let mem_end = self.mem.memory().last_addr().0.saturating_add(1);
        let mut mapped =
            DirtyLog::map(&file, log.mmap_size, log.mmap_offset, mem_end).map_err(|e| {
                warn!("{name}: SET_LOG_BASE refused: {e}");
                invalid(&e.to_string())
            })?;
        mapped.register_faults(&self.faults).map_err(|e| {
            warn!("{name}: SET_LOG_BASE refused: {e}");
            invalid(&e.to_string())
        })?;
        debug!(
            "{name}: dirty log of {} bytes mapped ({} pages of guest memory)",
            log.mmap_size,
            mapped.pages()
        );
        // A new log (QEMU resizes it when memory changes) replaces the old one
        // on every running ring; the old mapping goes with its last holder.
        self.log = Some(Arc::new(mapped));
        let state = LogState {
            mmap_size: log.mmap_size,
            mmap_offset: log.mmap_offset,
        };
        self.log_file = Some((state, file));
        self.push_log();
        Ok(())
    }

    /// The dirty log queue `index` marks: the mapped log while the frontend
    /// acks VHOST_F_LOG_ALL (vhost-user "Dirty logging"), else None.
    pub(super) fn queue_log(&self, index: u16) -> Option<QueueLog> {
        if self.acked_features & LOG_ALL == 0 {
            return None;
        }
        self.log.as_ref().map(|log| QueueLog {
            log: log.clone(),
            used: self.vrings[index as usize].log_used,
        })
    }

    /// Tells the IOThreads of every running ring whether to log (and where),
    /// without stopping the rings, and waits until they apply it: the frontend
    /// hears back only then, so no completion after its message goes unmarked.
    pub(super) fn push_log(&self) {
        let indexes = self.started_rings();
        self.push_log_to(&indexes);
    }

    pub(super) fn push_log_to(&self, indexes: &[u16]) {
        self.tell_rings(indexes, "switch dirty logging", |key, applied| {
            Command::SetLog {
                key,
                log: self.queue_log(key.queue),
                applied,
            }
        });
    }

    /// Post-copy migration (the frontend wants page faults served) is not
    /// supported: PAGEFAULT is never offered, and a frontend asking anyway is
    /// refused with a clear log line.
    pub(super) fn refuse_postcopy(&self) -> VhostError {
        warn!(
            "{}: post-copy migration is not supported (use pre-copy live migration)",
            self.export.device.name
        );
        VhostError::InvalidOperation("post-copy migration not supported")
    }
}

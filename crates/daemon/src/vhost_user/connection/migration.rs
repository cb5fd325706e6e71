//! Live migration on a connection (vhost-user "Migration", "Dirty logging"):
//! the dirty log of SET_LOG_BASE, which log each running ring marks and
//! where its used ring is logged, switched on the IOThreads without stopping
//! the rings; and the refusal of post-copy migration.

use std::fs::File;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;

use log::{debug, warn};
use vhost::vhost_user::message::VhostUserLog;
use vhost::vhost_user::{Error as VhostError, Result as VhostResult};
use vm_memory::{GuestAddressSpace, GuestMemoryBackend};

use super::{invalid, Connection, DRAIN_TIMEOUT, LOG_ALL};
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
        let indexes: Vec<u16> = (0..self.vrings.len() as u16)
            .filter(|&i| self.vrings[i as usize].started)
            .collect();
        self.push_log_to(&indexes);
    }

    pub(super) fn push_log_to(&self, indexes: &[u16]) {
        let (tx, rx) = sync_channel(indexes.len());
        // Routed under the export's lock, held until every switch applies: a
        // queue-move cannot take a ring away between the send and the switch.
        let routes = self.export.map.lock();
        for &index in indexes {
            self.export.iothreads[routes.thread_of(index)].send(Command::SetLog {
                key: self.key(index),
                log: self.queue_log(index),
                applied: tx.clone(),
            });
        }
        drop(tx);
        for _ in indexes {
            if rx.recv_timeout(DRAIN_TIMEOUT).is_err() {
                warn!(
                    "{}: an IOThread did not switch dirty logging in time",
                    self.export.device.name
                );
                return;
            }
        }
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

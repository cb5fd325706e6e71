//! The inflight region of a connection (vhost-user "Inflight I/O
//! tracking", INFLIGHT_SHMFD): created for GET_INFLIGHT_FD or adopted from
//! SET_INFLIGHT_FD, checked against the export's shape, and attached to each
//! ring as it starts, with the recovery of the requests a crashed daemon left
//! in flight.

use std::fs::File;

use log::{debug, info, warn};
use vhost::vhost_user::message::VhostUserInflight;
use vhost::vhost_user::{Error as VhostError, Result as VhostResult};
use virtio_queue::{Queue, QueueT};

use super::{invalid, Connection};
use crate::inflight::{InflightLayout, InflightRegion};
use crate::iothread::InflightTracking;
use crate::vhost_user::handover::InflightState;
use crate::vhost_user::memory::seal_against_shrinking;

impl Connection {
    /// GET_INFLIGHT_FD: a fresh region of the shape the frontend asks for,
    /// which rings started from now on are tracked in; its description and
    /// file go back to the frontend, which keeps it across a daemon restart.
    pub(super) fn create_inflight(
        &mut self,
        inflight: &VhostUserInflight,
    ) -> VhostResult<(VhostUserInflight, File)> {
        self.check_inflight_shape(inflight.num_queues, inflight.queue_size)?;
        let layout = InflightLayout::new(inflight.num_queues, inflight.queue_size)
            .map_err(|e| invalid(&e.to_string()))?;
        let (region, file) = InflightRegion::create(layout).map_err(|e| {
            warn!("{}: {e}", self.export.device.name);
            invalid(&e.to_string())
        })?;
        self.register_inflight(&region)?;
        debug!(
            "{}: inflight region of {} bytes for {} queues of {}",
            self.export.device.name,
            layout.mmap_size(),
            layout.num_queues(),
            layout.queue_size()
        );
        self.inflight = Some(region);
        self.inflight_file = Some((
            InflightState {
                mmap_size: layout.mmap_size(),
                mmap_offset: 0,
                num_queues: layout.num_queues(),
                queue_size: layout.queue_size(),
            },
            file.try_clone().map_err(VhostError::ReqHandlerError)?,
        ));
        let reply = VhostUserInflight::new(
            layout.mmap_size(),
            0,
            layout.num_queues(),
            layout.queue_size(),
        );
        Ok((reply, file))
    }

    /// SET_INFLIGHT_FD: adopts the region the frontend kept (after a daemon
    /// restart), before any ring starts.
    pub(super) fn adopt_inflight(
        &mut self,
        inflight: &VhostUserInflight,
        file: File,
    ) -> VhostResult<()> {
        if self.vrings.iter().any(|v| v.started) {
            return Err(invalid("SET_INFLIGHT_FD while rings are running"));
        }
        self.check_inflight_shape(inflight.num_queues, inflight.queue_size)?;
        // The frontend's own file: sealed against shrinking where it can be,
        // as guest memory is (a file we created is sealed already).
        self.sealing_policy(seal_against_shrinking(&file), "the inflight region")?;
        // Validated before mapping: a short or oversized file is refused, never
        // mapped (touching past its end would raise SIGBUS).
        let region = InflightRegion::from_file(
            &file,
            inflight.mmap_offset,
            inflight.mmap_size,
            inflight.num_queues,
            inflight.queue_size,
        )
        .map_err(|e| {
            warn!("{}: {e}", self.export.device.name);
            invalid(&e.to_string())
        })?;
        self.register_inflight(&region)?;
        info!(
            "{}: inflight region handed back by the frontend ({} queues of {})",
            self.export.device.name, inflight.num_queues, inflight.queue_size
        );
        self.inflight = Some(region);
        self.inflight_file = Some((
            InflightState {
                mmap_size: inflight.mmap_size,
                mmap_offset: inflight.mmap_offset,
                num_queues: inflight.num_queues,
                queue_size: inflight.queue_size,
            },
            file,
        ));
        Ok(())
    }

    /// Enters the region's mapping in the fault handler's registry.
    fn register_inflight(&self, region: &InflightRegion) -> VhostResult<()> {
        region.register_faults(&self.faults).map_err(|e| {
            warn!("{}: inflight region refused: {e}", self.export.device.name);
            invalid(&e.to_string())
        })
    }

    /// Attaches a starting ring to the inflight region, if there is one, and
    /// runs the recovery (vhost-user "Inflight I/O tracking"): the ring continues
    /// from the avail index the region proves was reached, which overrides
    /// SET_VRING_BASE (after a backend crash the frontend rebuilds that from the
    /// used index, which out-of-order completions make wrong), and the heads
    /// left in flight go to the IOThread to be executed again first.
    pub(super) fn attach_inflight(
        &self,
        index: u16,
        queue: &mut Queue,
        used_idx: u16,
    ) -> VhostResult<Option<InflightTracking>> {
        let Some(region) = &self.inflight else {
            return Ok(None);
        };
        let name = &self.export.device.name;
        let layout = region.layout();
        if index >= layout.num_queues() || queue.size() > layout.queue_size() {
            return Err(invalid(&format!(
                "vring {index} of size {} is not covered by the inflight region \
                 ({} queues of {})",
                queue.size(),
                layout.num_queues(),
                layout.queue_size()
            )));
        }
        let (record, recovery) = region.attach_queue(index, used_idx).map_err(|e| {
            warn!("{name}: vring {index}: {e}");
            invalid(&e.to_string())
        })?;
        if queue.next_avail() != recovery.next_avail_idx || !recovery.resubmit.is_empty() {
            info!(
                "{name}: vring {index}: inflight recovery: {} requests to execute again, \
                 next avail index {} (the frontend said {})",
                recovery.resubmit.len(),
                recovery.next_avail_idx,
                queue.next_avail()
            );
        }
        queue.set_next_avail(recovery.next_avail_idx);
        Ok(Some(InflightTracking {
            record,
            resubmit: recovery.resubmit,
        }))
    }

    /// An inflight region may describe at most the export's queues, of at most
    /// the largest queue size a ring may have.
    pub(super) fn check_inflight_shape(&self, num_queues: u16, queue_size: u16) -> VhostResult<()> {
        let max_queue = self.export.max_queue_size;
        if usize::from(num_queues) > self.vrings.len() || queue_size > max_queue {
            return Err(invalid(&format!(
                "inflight region for {num_queues} queues of {queue_size}: the export has {} \
                 queues of at most {max_queue}",
                self.vrings.len()
            )));
        }
        Ok(())
    }
}

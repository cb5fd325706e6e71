//! How a queue slot leaves its IOThread: a Detach (GET_VRING_BASE, ring
//! disable, disconnect) replies with the next avail index once the slot is
//! gone; a Handover (`queue-move`) sends the ring, with its inflight record
//! and its dirty log, to another IOThread. Either waits until the queue has
//! nothing in flight and its driver was told about every used entry.

use std::sync::mpsc::SyncSender;
use std::time::Instant;

use super::QueueSlot;
use crate::iothread::{Command, HandedOver, InflightTracking, Mailbox, QueueAttach};

/// Why a queue stops being served here, once its in-flight requests are done.
pub(in crate::iothread) enum Release {
    /// GET_VRING_BASE, ring disable, disconnect: reply with the next avail index.
    Detach(SyncSender<u16>),
    /// `queue-move`: send the ring to another IOThread, then reply.
    Handover {
        /// The IOThread taking the queue.
        to: Mailbox,
        /// Told once the ring is on its way.
        reply: SyncSender<Option<HandedOver>>,
        /// Requests in flight when the handover began.
        drained: usize,
        /// When the handover began.
        since: Instant,
    },
}

impl QueueSlot {
    /// Whether a Detach or a Handover waits for this queue to drain.
    pub fn releasing(&self) -> bool {
        self.state.releasing()
    }

    /// Stops popping; once the queue has nothing in flight, the event loop
    /// lets it go as `why` says ([`QueueSlot::let_go`]).
    pub fn release(&mut self, why: Release) {
        self.state.release(why);
    }

    /// The release a drained queue waited for (None: the thread stops).
    fn take_release(&mut self) -> Option<Release> {
        self.state.take_release()
    }

    /// Lets a drained queue go as its release says (no release: the thread
    /// stops, the slot is dropped).
    pub fn let_go(mut self) {
        debug_assert_eq!(self.inflight, 0, "a ring leaves only once drained");
        match self.take_release() {
            // The slot (and its inflight record) is gone before the reply: the
            // transport may attach the queue again as soon as it has it.
            Some(Release::Detach(reply)) => {
                let next_avail = self.next_avail();
                drop(self);
                let _ = reply.send(next_avail);
            }
            // Its used entries are published and the guest notified
            // (`Queues::notify` runs first): the ring goes to its new owner,
            // which checks it at once, then the mover is told.
            Some(Release::Handover {
                to,
                reply,
                drained,
                since,
            }) => {
                to.send(Command::Attach(Box::new(self.into_attach())));
                let drain = since.elapsed();
                let _ = reply.send(Some(HandedOver { drained, drain }));
            }
            None => drop(self),
        }
    }

    /// The ring and everything that goes with it, for another IOThread to
    /// serve (`queue-move`); called once the queue has nothing in flight.
    /// Guest notifications are turned back on first, so that the ring agrees
    /// with the new owner's slot, which starts with them on
    /// ([`QueueSlot::new`]): a polling source leaves the ring quiet. (The new
    /// owner's first pass quiets and re-arms it anyway, unless it is
    /// stopping.) Heads a dead daemon left that are not resubmitted yet go
    /// along, in order.
    pub fn into_attach(mut self) -> QueueAttach {
        debug_assert_eq!(self.inflight, 0, "a ring moves only once drained");
        if !self.state.broken() {
            // Requests that arrived meanwhile are found by the new owner,
            // which checks the ring as soon as it attaches it.
            let _ = self.arm_or_break();
        }
        // The driver was told about every used entry (`Queues::notify` runs
        // before a drained queue is released): the EVENT_IDX count, which
        // stays with the slot, has nothing left to move.
        debug_assert!(
            !self.unnotified.pending(),
            "a ring moves only once notified"
        );
        let inflight = self.record.map(|record| InflightTracking {
            record,
            resubmit: self.resubmit.into(),
        });
        QueueAttach {
            key: self.key,
            queue: self.queue,
            kick: self.kick,
            call: self.call,
            mem: self.mem,
            device: self.device,
            inflight,
            // A migration that logs goes on logging on the new owner.
            log: self.log,
        }
    }
}

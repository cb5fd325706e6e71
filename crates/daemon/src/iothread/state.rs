//! The state of a queue slot, as types that cannot contradict themselves:
//! where the ring is in its life on this IOThread ([`SlotState`]), whether
//! the driver is asked to kick ([`Kicks`]), and which used entries the driver
//! has not yet been considered for a call about ([`Unnotified`]). Pure: no
//! guest memory, no file descriptors; unit-tested below.

use std::num::NonZeroU16;

use super::queue::Release;

/// Where a ring is in its life on this IOThread.
pub(super) enum SlotState {
    /// Popped, executed and notified.
    Serving,
    /// Found in an impossible state (a ring that cannot be accessed, an avail
    /// index or a head out of range): not touched again until the frontend
    /// sets it up again, which detaches this slot and attaches a fresh one.
    Broken,
    /// A Detach or a Handover waits for the ring's in-flight requests; nothing
    /// new is popped.
    Releasing {
        /// Why it leaves, and whom to tell.
        why: Release,
        /// The ring had been stopped as broken before the release began.
        broken: bool,
    },
}

impl SlotState {
    /// Whether the thread pops from and polls this ring.
    pub fn active(&self) -> bool {
        matches!(self, SlotState::Serving)
    }

    /// Whether the ring was stopped as broken (and perhaps released since).
    pub fn broken(&self) -> bool {
        matches!(
            self,
            SlotState::Broken | SlotState::Releasing { broken: true, .. }
        )
    }

    /// Whether a release waits for the ring to drain.
    pub fn releasing(&self) -> bool {
        matches!(self, SlotState::Releasing { .. })
    }

    /// Stops the ring as broken; false if it already was (it is reported once).
    pub fn break_ring(&mut self) -> bool {
        match self {
            SlotState::Serving => *self = SlotState::Broken,
            SlotState::Releasing { broken, .. } if !*broken => *broken = true,
            SlotState::Broken | SlotState::Releasing { .. } => return false,
        }
        true
    }

    /// Begins releasing the ring for `why` (a broken ring stays broken). A
    /// second release replaces the first: the transport waits for one reply
    /// per queue, and a queue being released is not found for another
    /// command (`Queues::find`).
    pub fn release(&mut self, why: Release) {
        let broken = self.broken();
        *self = SlotState::Releasing { why, broken };
    }

    /// The release, taken out once the ring is drained, leaving the ring's
    /// health as it was (None: no release was asked, the thread stops).
    pub fn take_release(&mut self) -> Option<Release> {
        let broken = self.broken();
        let health = if broken {
            SlotState::Broken
        } else {
            SlotState::Serving
        };
        match std::mem::replace(self, health) {
            SlotState::Releasing { why, .. } => Some(why),
            SlotState::Serving | SlotState::Broken => None,
        }
    }
}

/// Whether the driver is asked to kick (virtio "driver notifications").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kicks {
    /// Asked: the thread is about to sleep, or a slot starts (the driver of a
    /// fresh ring kicks).
    Armed,
    /// Not asked (EVENT_IDX: avail_event left behind; otherwise
    /// VRING_USED_F_NO_NOTIFY): the thread polls or pops the ring anyway.
    Quiet,
}

/// The used entries published since the driver was last considered for a
/// call (virtio "device notifications"): a count that is zero exactly when
/// there is nothing to notify, because it is the only record of both.
/// EVENT_IDX's rule needs the count (`ring::event_idx_wants_call`); without
/// EVENT_IDX only whether it is zero matters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Unnotified(Option<NonZeroU16>);

impl Unnotified {
    /// Counts one used entry published. Saturates rather than wrapping: a
    /// count that wrapped to zero would say there is nothing to notify, where
    /// the saturated count only makes EVENT_IDX's rule call (a call too many
    /// is harmless, one too few strands the driver).
    #[inline]
    pub fn add(&mut self) {
        self.0 = Some(self.0.map_or(NonZeroU16::MIN, |n| n.saturating_add(1)));
    }

    /// Whether some used entry has not been considered for a call.
    #[inline]
    pub fn pending(&self) -> bool {
        self.0.is_some()
    }

    /// The entries to consider now, and none pending after.
    #[inline]
    pub fn take(&mut self) -> Option<NonZeroU16> {
        self.0.take()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::sync_channel;

    use super::*;

    fn detach() -> (Release, std::sync::mpsc::Receiver<u16>) {
        let (tx, rx) = sync_channel(1);
        (Release::Detach(tx), rx)
    }

    /// The count is zero exactly when nothing is pending, through any
    /// sequence of adds and takes, and it never wraps to "nothing".
    #[test]
    fn unnotified_is_empty_iff_nothing_to_notify() {
        let mut u = Unnotified::default();
        assert!(!u.pending());
        assert_eq!(u.take(), None);
        for round in 1..=40u16 {
            for _ in 0..round {
                u.add();
                assert!(u.pending());
            }
            assert_eq!(u.take().map(NonZeroU16::get), Some(round));
            assert!(!u.pending());
            assert_eq!(u.take(), None);
        }
        for _ in 0..u32::from(u16::MAX) + 2 {
            u.add();
        }
        assert!(u.pending(), "a full wrap still has something to notify");
        assert_eq!(u.take().map(NonZeroU16::get), Some(u16::MAX));
        assert!(!u.pending());
    }

    /// Serving is the only active state; breaking is reported once, also
    /// while releasing; a release keeps the ring's health and gives it back
    /// when taken.
    #[test]
    fn slot_state_transitions_keep_health_and_release_apart() {
        let mut s = SlotState::Serving;
        assert!(s.active() && !s.broken() && !s.releasing());
        assert!(s.take_release().is_none());
        assert!(s.active(), "taking no release changes nothing");

        assert!(s.break_ring());
        assert!(!s.active() && s.broken() && !s.releasing());
        assert!(!s.break_ring(), "a broken ring is reported once");

        let (why, rx) = detach();
        s.release(why);
        assert!(!s.active() && s.broken() && s.releasing());
        assert!(!s.break_ring());
        match s.take_release() {
            Some(Release::Detach(tx)) => tx.send(7).unwrap(),
            _ => panic!("the detach comes back"),
        }
        assert_eq!(rx.recv().unwrap(), 7);
        assert!(s.broken() && !s.releasing() && !s.active());

        let mut s = SlotState::Serving;
        let (why, _rx) = detach();
        s.release(why);
        assert!(!s.active() && !s.broken() && s.releasing());
        assert!(s.break_ring(), "a releasing ring can still be found broken");
        assert!(!s.break_ring());
        assert!(s.take_release().is_some());
        assert!(s.broken() && !s.releasing());

        let mut s = SlotState::Serving;
        let (why, _rx) = detach();
        s.release(why);
        assert!(s.take_release().is_some());
        assert!(s.active(), "a healthy ring stays healthy");
    }
}

//! A split virtqueue in guest memory (virtio 1.2, 2.7): where its fields
//! are, the loads and stores the request path makes on them, and the
//! EVENT_IDX rule for calls (2.7.10).
//!
//! virtio-queue's `Queue` keeps the ring's configuration (addresses, size,
//! features) and its next avail and next used indexes; the IOThread keeps
//! using it for that and for its checks at ring setup. The accesses of the
//! request path and of the notification toggles (before every sleep of the
//! thread) go through [`SplitRing`]: each is one load or store through
//! [`SmallAccess`], where virtio-queue's `avail_idx`, `iter`, `add_used`,
//! `needs_notification` and `enable_notification` go through vm-memory's
//! generic accessors (an `enable_notification` cost 255 instructions, 165
//! here). The checks and errors are virtio-queue's (its `Error`).

use std::sync::atomic::{fence, Ordering};

use virtio_bindings::virtio_ring::{VRING_AVAIL_F_NO_INTERRUPT, VRING_USED_F_NO_NOTIFY};
use virtio_queue::{Error, Queue, QueueT};
use vm_memory::{Address, GuestAddress};

use super::mem::SmallAccess;

/// Bytes before the avail ring's entries (flags, idx).
const AVAIL_HEADER: u64 = 4;
/// Bytes of an avail ring entry (a head index).
const AVAIL_ENTRY: u64 = 2;
/// Bytes before the used ring's entries (flags, idx).
const USED_HEADER: u64 = 4;
/// Bytes of a used ring entry (id, len).
const USED_ENTRY: u64 = 8;
/// Bytes after the used ring's entries (avail_event).
const USED_FOOTER: u64 = 2;

/// The avail ring's `idx` (le16): where the driver will put its next head.
fn avail_idx(avail: GuestAddress) -> Option<GuestAddress> {
    avail.checked_add(2)
}

/// Entry `index` (modulo the ring's `size`) of the avail ring (le16).
fn avail_entry(avail: GuestAddress, size: u16, index: u16) -> Option<GuestAddress> {
    let slot = u64::from(index.checked_rem(size)?);
    avail.checked_add(AVAIL_HEADER + slot * AVAIL_ENTRY)
}

/// `used_event` (le16, EVENT_IDX): after the avail ring's `size` entries.
fn used_event(avail: GuestAddress, size: u16) -> Option<GuestAddress> {
    avail.checked_add(AVAIL_HEADER + u64::from(size) * AVAIL_ENTRY)
}

/// The used ring's `idx` (le16): how many entries the device has published.
fn used_idx(used: GuestAddress) -> Option<GuestAddress> {
    used.checked_add(2)
}

/// Entry `index` (modulo the ring's `size`) of the used ring (le32 id, le32
/// len).
fn used_entry(used: GuestAddress, size: u16, index: u16) -> Option<GuestAddress> {
    let slot = u64::from(index.checked_rem(size)?);
    used.checked_add(USED_HEADER + slot * USED_ENTRY)
}

/// Bytes of the used ring of a `size`-entry queue: flags, index, entries and
/// avail_event (2.7.8), what a migration's dirty log marks after the device
/// wrote into it.
pub fn used_ring_len(size: u16) -> u64 {
    USED_HEADER + USED_ENTRY * u64::from(size) + USED_FOOTER
}

/// EVENT_IDX: whether the driver asked for a call among the `added` entries
/// just published, the last of which made the used index `used`: its
/// `used_event` names one of them, that is lies in `[used - added, used)`
/// modulo 2^16 (the inequality Linux's `vring_need_event` uses, which also
/// covers entries published in a batch).
pub fn event_idx_wants_call(used: u16, added: u16, used_event: u16) -> bool {
    used.wrapping_sub(used_event).wrapping_sub(1) < added
}

/// A le16 field of a ring at `at` (None: its address overflowed), with
/// virtio-queue's errors.
#[inline(always)]
fn load_le16<M: SmallAccess + ?Sized>(
    mem: &M,
    at: Option<GuestAddress>,
    order: Ordering,
) -> Result<u16, Error> {
    let at = at.ok_or(Error::AddressOverflow)?;
    mem.load_small::<u16>(at, order)
        .map(u16::from_le)
        .map_err(Error::GuestMemory)
}

/// Where a split ring's parts are and how many entries it has: what
/// virtio-queue's `Queue` holds besides its indexes, as a view for the
/// accesses of one step of the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitRing {
    desc_table: GuestAddress,
    avail: GuestAddress,
    used: GuestAddress,
    size: u16,
}

impl SplitRing {
    /// The ring `queue` is configured with.
    #[inline(always)]
    pub fn of(queue: &Queue) -> SplitRing {
        SplitRing {
            desc_table: GuestAddress(queue.desc_table()),
            avail: GuestAddress(queue.avail_ring()),
            used: GuestAddress(queue.used_ring()),
            size: queue.size(),
        }
    }

    /// The descriptor table (where [`HeadChain`](super::HeadChain) walks).
    pub fn desc_table(&self) -> GuestAddress {
        self.desc_table
    }

    /// Entries of the ring.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// The avail ring's index (Acquire: the entries before it are visible).
    #[inline(always)]
    pub fn avail_idx<M: SmallAccess + ?Sized>(&self, mem: &M) -> Result<u16, Error> {
        load_le16(mem, avail_idx(self.avail), Ordering::Acquire)
    }

    /// The head the driver put at avail ring position `index`.
    #[inline(always)]
    pub fn avail_head<M: SmallAccess + ?Sized>(&self, mem: &M, index: u16) -> Result<u16, Error> {
        load_le16(
            mem,
            avail_entry(self.avail, self.size, index),
            Ordering::Acquire,
        )
    }

    /// Puts `head` with `len` bytes written on `queue`'s used ring (this
    /// ring) and publishes it: the entry, then the used index (Release:
    /// after the entry). virtio-queue's `Queue::add_used`, the same steps in
    /// the same order. The EVENT_IDX count (`num_added`, private in
    /// virtio-queue) is the caller's: it knows which publishes a call
    /// covers.
    #[inline(always)]
    pub fn add_used<M: SmallAccess + ?Sized>(
        &self,
        mem: &M,
        queue: &mut Queue,
        head: u16,
        len: u32,
    ) -> Result<(), Error> {
        if head >= self.size {
            return Err(Error::InvalidDescriptorIndex);
        }
        let next = queue.next_used();
        let entry = used_entry(self.used, self.size, next).ok_or(Error::AddressOverflow)?;
        let idx = used_idx(self.used).ok_or(Error::AddressOverflow)?;
        // id (le32), len (le32).
        mem.write_obj_small([u32::from(head).to_le(), len.to_le()], entry)
            .map_err(Error::GuestMemory)?;
        let next = next.wrapping_add(1);
        queue.set_next_used(next);
        mem.store_small(next.to_le(), idx, Ordering::Release)
            .map_err(Error::GuestMemory)
    }

    /// Asks the driver to kick for the heads after `queue`'s next avail
    /// index (EVENT_IDX: `avail_event` set to it; otherwise the used ring's
    /// flags cleared of VRING_USED_F_NO_NOTIFY), then reads the avail index
    /// again: true if heads arrived before the request was visible, which
    /// the driver may not kick for. virtio-queue's `enable_notification`,
    /// the same stores and the same fence, called before every sleep.
    #[inline(always)]
    pub fn enable_notification<M: SmallAccess + ?Sized>(
        &self,
        mem: &M,
        queue: &Queue,
    ) -> Result<bool, Error> {
        let next_avail = queue.next_avail();
        if queue.event_idx_enabled() {
            let at = self.avail_event().ok_or(Error::AddressOverflow)?;
            mem.store_small(next_avail.to_le(), at, Ordering::Relaxed)
        } else {
            mem.store_small(0u16.to_le(), self.used, Ordering::Relaxed)
        }
        .map_err(Error::GuestMemory)?;
        // The store above before the load below: either the driver sees the
        // request to kick, or this load sees its new heads.
        fence(Ordering::SeqCst);
        let idx = load_le16(mem, avail_idx(self.avail), Ordering::Relaxed)?;
        Ok(idx != next_avail)
    }

    /// Tells the driver it need not kick: VRING_USED_F_NO_NOTIFY in the used
    /// ring's flags, or with EVENT_IDX nothing (`avail_event` stays behind,
    /// so the driver kicks at most once more). virtio-queue's
    /// `disable_notification`.
    #[inline(always)]
    pub fn disable_notification<M: SmallAccess + ?Sized>(
        &self,
        mem: &M,
        queue: &Queue,
    ) -> Result<(), Error> {
        if queue.event_idx_enabled() {
            return Ok(());
        }
        let flag = VRING_USED_F_NO_NOTIFY as u16;
        mem.store_small(flag.to_le(), self.used, Ordering::Relaxed)
            .map_err(Error::GuestMemory)
    }

    /// `avail_event` (le16, EVENT_IDX): after the used ring's entries.
    fn avail_event(&self) -> Option<GuestAddress> {
        self.used
            .checked_add(USED_HEADER + u64::from(self.size) * USED_ENTRY)
    }

    /// Whether the driver asked to hear about the `added` used entries
    /// published since the last call,
    /// the last of which made the used index `used`: its `used_event`
    /// (EVENT_IDX, virtio-queue's
    /// `needs_notification`), or else a clear VRING_AVAIL_F_NO_INTERRUPT in
    /// the avail ring's flags, which virtio-queue does not look at (it would
    /// call after every publish). A driver that sets the flag while it reaps
    /// (libblkio, Linux) then gets a call only when it is about to wait.
    #[inline(always)]
    pub fn needs_notification<M: SmallAccess + ?Sized>(
        &self,
        mem: &M,
        event_idx: bool,
        used: u16,
        added: u16,
    ) -> Result<bool, Error> {
        // The used index was stored before this load, in that order: a
        // driver that writes used_event (or clears the flag) and then reads
        // the used index sees our entries, or we see what it wrote; no
        // wake-up is lost.
        fence(Ordering::SeqCst);
        if event_idx {
            let at = used_event(self.avail, self.size);
            let used_event = load_le16(mem, at, Ordering::Relaxed)?;
            return Ok(event_idx_wants_call(used, added, used_event));
        }
        let flags = load_le16(mem, Some(self.avail), Ordering::Acquire)?;
        Ok(flags & VRING_AVAIL_F_NO_INTERRUPT as u16 == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_addresses_follow_the_layout() {
        let a = GuestAddress(0x1000);
        assert_eq!(avail_idx(a), Some(GuestAddress(0x1002)));
        assert_eq!(avail_entry(a, 256, 0), Some(GuestAddress(0x1004)));
        assert_eq!(avail_entry(a, 256, 257), Some(GuestAddress(0x1006)));
        assert_eq!(used_event(a, 256), Some(GuestAddress(0x1204)));
        assert_eq!(used_idx(a), Some(GuestAddress(0x1002)));
        assert_eq!(used_entry(a, 256, 3), Some(GuestAddress(0x101c)));
        assert_eq!(used_entry(a, 256, 259), Some(GuestAddress(0x101c)));
        // Flags, idx, 256 entries, avail_event.
        assert_eq!(used_ring_len(256), 4 + 256 * 8 + 2);
        // A ring of size 0 has no entries; an address at the top of the
        // address space has no fields after it.
        assert_eq!(avail_entry(a, 0, 0), None);
        assert_eq!(used_entry(a, 0, 0), None);
        assert_eq!(avail_idx(GuestAddress(u64::MAX - 1)), None);
        assert_eq!(used_entry(GuestAddress(u64::MAX - 2), 1, 0), None);
    }

    /// The rule against its definition: a call is wanted when the used
    /// index passed `used_event + 1` with one of the `added` entries,
    /// checked by stepping through them, wrapping at 2^16 included.
    #[test]
    fn event_idx_calls_exactly_when_used_event_was_crossed() {
        for used in [0u16, 1, 5, 100, 65535, 65534, 3] {
            for added in [0u16, 1, 2, 4, 16, 300] {
                for back in 0u16..400 {
                    let used_event = used.wrapping_sub(back);
                    let crossed = (0..added).any(|k| {
                        // The entry that made the index `used - k`.
                        used.wrapping_sub(k) == used_event.wrapping_add(1)
                    });
                    assert_eq!(
                        event_idx_wants_call(used, added, used_event),
                        crossed,
                        "used {used}, added {added}, used_event {used_event}"
                    );
                }
            }
        }
    }
}

/// [`SplitRing`] against virtio-queue's own accesses to the same ring.
#[cfg(test)]
mod against_virtio_queue {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_AVAIL_F_NO_INTERRUPT;
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::QueueOwnedT;
    use vm_memory::{Bytes, GuestMemoryMmap};

    const SIZE: u16 = 16;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1_0000)]).unwrap()
    }

    #[test]
    fn avail_reads_match() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, SIZE);
        for i in 0..SIZE {
            let head = (i * 5 + 3) % SIZE;
            vq.avail()
                .ring()
                .ref_at(i.into())
                .unwrap()
                .store(head.to_le());
        }
        let mut q: Queue = vq.create_queue().unwrap();
        let ring = SplitRing::of(&q);
        assert_eq!(ring.desc_table(), vq.desc_table_addr());
        assert_eq!(ring.size(), SIZE);
        // Popping past the ring's size: the entries wrap.
        for i in 0..SIZE + 4 {
            vq.avail().idx().store((i + 1).to_le());
            let idx = ring.avail_idx(&m).unwrap();
            assert_eq!(idx, q.avail_idx(&m, Ordering::Acquire).unwrap().0);
            let popped = q.iter(&m).unwrap().next().unwrap();
            assert_eq!(ring.avail_head(&m, i).unwrap(), popped.head_index(), "{i}");
        }
    }

    #[test]
    fn used_writes_match() {
        let (ours, theirs) = (mem(), mem());
        let (va, vb) = (
            MockSplitQueue::new(&ours, SIZE),
            MockSplitQueue::new(&theirs, SIZE),
        );
        let mut ours_q: Queue = va.create_queue().unwrap();
        let ring = SplitRing::of(&ours_q);
        let mut q: Queue = vb.create_queue().unwrap();
        // Start near the wrap of the 16-bit index.
        let mut next = 65530u16;
        q.set_next_used(next);
        ours_q.set_next_used(next);
        let used = vb.used_addr();
        assert_eq!(used, va.used_addr());
        let bytes = |m: &GuestMemoryMmap| {
            let mut b = vec![0u8; used_ring_len(SIZE) as usize];
            m.read_slice(&mut b, used).unwrap();
            b
        };
        for k in 0..3 * u32::from(SIZE) {
            let (head, len) = ((k * 7 % u32::from(SIZE)) as u16, k * 4097);
            ring.add_used(&ours, &mut ours_q, head, len).unwrap();
            next = next.wrapping_add(1);
            q.add_used(&theirs, head, len).unwrap();
            assert_eq!((ours_q.next_used(), q.next_used()), (next, next));
            assert_eq!(bytes(&ours), bytes(&theirs), "entry {k}");
        }
        // A head outside the ring is refused by both, and writes nothing.
        let before = bytes(&ours);
        assert!(matches!(
            ring.add_used(&ours, &mut ours_q, SIZE, 0),
            Err(Error::InvalidDescriptorIndex)
        ));
        assert!(matches!(
            q.add_used(&theirs, SIZE, 0),
            Err(Error::InvalidDescriptorIndex)
        ));
        assert_eq!(bytes(&ours), before);
        // A used ring outside guest memory: both fail on the entry.
        let far = SplitRing {
            used: GuestAddress(0x10_0000),
            ..ring
        };
        assert!(matches!(
            far.add_used(&ours, &mut ours_q, 0, 0),
            Err(Error::GuestMemory(_))
        ));
        // Neither a refused head nor a failed write moved the ring.
        assert_eq!(ours_q.next_used(), next);
    }

    /// EVENT_IDX: the same answer as virtio-queue's `needs_notification`
    /// for every batch size and every `used_event` around the used index,
    /// across the wrap of the 16-bit index.
    #[test]
    fn event_idx_notification_matches() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, SIZE);
        let mut q: Queue = vq.create_queue().unwrap();
        q.set_event_idx(true);
        q.set_next_used(65500);
        let ring = SplitRing::of(&q);
        let used_event_at = GuestAddress(vq.avail_addr().0 + 4 + 2 * u64::from(SIZE));
        let mut seen = [false; 2];
        for round in 0u16..200 {
            let added = round % 5;
            for _ in 0..added {
                q.add_used(&m, 0, 0).unwrap();
            }
            let used = q.next_used();
            let back = round.wrapping_mul(7) % 9;
            m.write_obj(used.wrapping_sub(back).to_le(), used_event_at)
                .unwrap();
            let ours = ring.needs_notification(&m, true, used, added).unwrap();
            let theirs = q.needs_notification(&m).unwrap();
            assert_eq!(ours, theirs, "used {used}, added {added}, back {back}");
            seen[usize::from(ours)] = true;
        }
        assert_eq!(seen, [true, true], "both answers were exercised");
    }

    /// Turning kicks on and off writes the same bytes as virtio-queue, with
    /// EVENT_IDX and without, and enabling them reports heads that arrived
    /// meanwhile exactly when virtio-queue does, across the wrap of the
    /// 16-bit index.
    #[test]
    fn notification_toggles_match() {
        for event_idx in [false, true] {
            let (ours, theirs) = (mem(), mem());
            let (va, vb) = (
                MockSplitQueue::new(&ours, SIZE),
                MockSplitQueue::new(&theirs, SIZE),
            );
            let mut ours_q: Queue = va.create_queue().unwrap();
            let mut q: Queue = vb.create_queue().unwrap();
            let ring = SplitRing::of(&ours_q);
            let used = vb.used_addr();
            let bytes = |m: &GuestMemoryMmap| {
                let mut b = vec![0u8; used_ring_len(SIZE) as usize];
                m.read_slice(&mut b, used).unwrap();
                b
            };
            let mut seen = [false; 2];
            for round in 0u16..40 {
                for qq in [&mut ours_q, &mut q] {
                    qq.set_event_idx(event_idx);
                    qq.set_next_avail(65530u16.wrapping_add(round));
                }
                // The driver's avail index: caught up, or some heads ahead.
                let ahead = round % 3;
                let idx = 65530u16.wrapping_add(round).wrapping_add(ahead);
                va.avail().idx().store(idx.to_le());
                vb.avail().idx().store(idx.to_le());
                let mine = ring.enable_notification(&ours, &ours_q).unwrap();
                let theirs_more = q.enable_notification(&theirs).unwrap();
                assert_eq!(mine, theirs_more, "event_idx {event_idx}, round {round}");
                assert_eq!(bytes(&ours), bytes(&theirs), "enabled, round {round}");
                seen[usize::from(mine)] = true;
                ring.disable_notification(&ours, &ours_q).unwrap();
                q.disable_notification(&theirs).unwrap();
                assert_eq!(bytes(&ours), bytes(&theirs), "disabled, round {round}");
            }
            assert_eq!(seen, [true, true], "both answers were exercised");
        }
        // A used ring outside guest memory fails as virtio-queue's does.
        let m = mem();
        let vq = MockSplitQueue::new(&m, SIZE);
        let q: Queue = vq.create_queue().unwrap();
        let far = SplitRing {
            used: GuestAddress(0x10_0000),
            ..SplitRing::of(&q)
        };
        assert!(matches!(
            far.enable_notification(&m, &q),
            Err(Error::GuestMemory(_))
        ));
    }

    /// Without EVENT_IDX virtio-queue always calls; the driver's
    /// VRING_AVAIL_F_NO_INTERRUPT is read here instead.
    #[test]
    fn no_interrupt_flag_is_honoured() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, SIZE);
        let ring = SplitRing::of(&vq.create_queue::<Queue>().unwrap());
        m.write_obj(0u16, vq.avail_addr()).unwrap();
        assert!(ring.needs_notification(&m, false, 1, 1).unwrap());
        let flag = VRING_AVAIL_F_NO_INTERRUPT as u16;
        m.write_obj(flag.to_le(), vq.avail_addr()).unwrap();
        assert!(!ring.needs_notification(&m, false, 1, 1).unwrap());
    }
}

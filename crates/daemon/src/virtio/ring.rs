//! Where the fields of a split virtqueue are (virtio 1.2, 2.7), and the
//! EVENT_IDX rule for calls (2.7.10): what the IOThreads need to pop heads
//! and publish used entries through [`SmallAccess`](super::access), one
//! load or store each, rather than through virtio-queue's accessors, which
//! walk vm-memory's generic region iterators for every 2- or 8-byte access
//! (issue 16). virtio-queue's `Queue` keeps the ring's configuration and its
//! next avail and next used indexes; these are only addresses and a rule.

use vm_memory::{Address, GuestAddress};

/// Bytes before the avail ring's entries (flags, idx).
const AVAIL_HEADER: u64 = 4;
/// Bytes of an avail ring entry (a head index).
const AVAIL_ENTRY: u64 = 2;
/// Bytes before the used ring's entries (flags, idx).
const USED_HEADER: u64 = 4;
/// Bytes of a used ring entry (id, len).
const USED_ENTRY: u64 = 8;

/// The avail ring's `idx` (le16): where the driver will put its next head.
pub fn avail_idx(avail: GuestAddress) -> Option<GuestAddress> {
    avail.checked_add(2)
}

/// Entry `index` (modulo the ring's `size`) of the avail ring (le16).
pub fn avail_entry(avail: GuestAddress, size: u16, index: u16) -> Option<GuestAddress> {
    let slot = u64::from(index.checked_rem(size)?);
    avail.checked_add(AVAIL_HEADER + slot * AVAIL_ENTRY)
}

/// `used_event` (le16, EVENT_IDX): after the avail ring's `size` entries.
pub fn used_event(avail: GuestAddress, size: u16) -> Option<GuestAddress> {
    avail.checked_add(AVAIL_HEADER + u64::from(size) * AVAIL_ENTRY)
}

/// The used ring's `idx` (le16): how many entries the device has published.
pub fn used_idx(used: GuestAddress) -> Option<GuestAddress> {
    used.checked_add(2)
}

/// Entry `index` (modulo the ring's `size`) of the used ring (le32 id, le32
/// len).
pub fn used_entry(used: GuestAddress, size: u16, index: u16) -> Option<GuestAddress> {
    let slot = u64::from(index.checked_rem(size)?);
    used.checked_add(USED_HEADER + slot * USED_ENTRY)
}

/// EVENT_IDX: whether the driver asked for a call among the `added` entries
/// just published, the last of which made the used index `used`: its
/// `used_event` names one of them, that is lies in `[used - added, used)`
/// modulo 2^16 (the inequality Linux's `vring_need_event` uses, which also
/// covers entries published in a batch).
pub fn event_idx_wants_call(used: u16, added: u16, used_event: u16) -> bool {
    used.wrapping_sub(used_event).wrapping_sub(1) < added
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

//! One queue's view of the inflight region: the data-path bookkeeping and the
//! recovery algorithm (see the module documentation of [`super`] for the order of
//! the stores and why it is crash-safe).

use std::sync::atomic::{AtomicU16, AtomicU64, AtomicU8, Ordering};

use super::{
    InflightError, InflightRegion, Recovery, DESC_OFF_COUNTER, DESC_OFF_INFLIGHT, DESC_OFF_NEXT,
    DESC_STATE_SIZE, OFF_DESC_NUM, OFF_FEATURES, OFF_LAST_BATCH_HEAD, OFF_USED_IDX, OFF_VERSION,
    QUEUE_HEADER_SIZE, REGION_VERSION,
};

/// The std atomics the region's fields are, with their `Release` store and
/// `Acquire` load inlined: the request path makes three stores on a pop and
/// three on a publish, and vm-memory's `AtomicInteger` methods are calls.
trait Field: Sized {
    /// The integer.
    type V: Copy + Default;
    fn put(&self, v: Self::V);
    fn get(&self) -> Self::V;
}

macro_rules! field {
    ($($a:ty => $v:ty),*) => {$(
        impl Field for $a {
            type V = $v;
            #[inline(always)]
            fn put(&self, v: $v) {
                self.store(v, Ordering::Release)
            }
            #[inline(always)]
            fn get(&self) -> $v {
                self.load(Ordering::Acquire)
            }
        }
    )*};
}
field!(AtomicU8 => u8, AtomicU16 => u16, AtomicU64 => u64);

/// The inflight record of one virtqueue, written by the one thread that serves the
/// queue. No lock and no allocation on [`begin`](Self::begin),
/// [`stage_used`](Self::stage_used) and [`commit_used`](Self::commit_used): a few
/// atomic stores into the shared mapping each.
///
/// Obtained from [`InflightRegion::attach_queue`]; dropping it releases the queue
/// so it can be attached again.
pub struct InflightQueue {
    region: InflightRegion,
    index: u16,
    /// Host address of this queue's block in the mapping (an address, not a
    /// pointer, so the record can move to its IOThread), and the block's
    /// length in bytes, within the mapping (checked in [`Self::new`]).
    block_addr: usize,
    block_len: usize,
    /// Descriptor states in the block (the layout's queue size).
    desc_num: u16,
    /// Counter for the next `begin`. Private: the region holds the record.
    next_counter: u64,
    /// The `used_idx` this queue last wrote (the region's copy is not read back).
    used_idx: u16,
    /// The `last_batch_head` this queue last wrote.
    batch_head: u16,
    /// Heads staged since the last commit.
    batch_len: u16,
    /// Test hook: stores left before the simulated process dies (`None`: no limit).
    #[cfg(test)]
    pub(super) crash: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
}

impl std::fmt::Debug for InflightQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InflightQueue")
            .field("index", &self.index)
            .field("desc_num", &self.desc_num)
            .field("next_counter", &self.next_counter)
            .field("used_idx", &self.used_idx)
            .field("batch_len", &self.batch_len)
            .finish_non_exhaustive()
    }
}

impl Drop for InflightQueue {
    fn drop(&mut self) {
        self.region.release(self.index);
    }
}

impl InflightQueue {
    /// A view of queue `index`, which the caller has marked attached.
    pub(super) fn new(region: InflightRegion, index: u16) -> Self {
        let layout = region.layout();
        // The whole region was mapped, so every queue offset fits a usize.
        let base = usize::try_from(layout.queue_offset(index)).unwrap_or(usize::MAX);
        let desc_num = layout.queue_size();
        let len = QUEUE_HEADER_SIZE as usize + DESC_STATE_SIZE as usize * usize::from(desc_num);
        let map = region.mapping();
        // A block outside the mapping (impossible for a layout the region was
        // created or checked with) gets length 0: every access is refused.
        let block_len = match base.checked_add(len) {
            Some(end) if end <= map.size() => len,
            _ => 0,
        };
        let block_addr = (map.as_ptr() as usize).wrapping_add(base);
        Self {
            desc_num,
            region,
            index,
            block_addr,
            block_len,
            next_counter: 1,
            used_idx: 0,
            batch_head: 0,
            batch_len: 0,
            #[cfg(test)]
            crash: None,
        }
    }

    /// The queue's index in the region.
    pub fn index(&self) -> u16 {
        self.index
    }

    /// Descriptor states of the queue (its size in the layout).
    pub fn queue_size(&self) -> u16 {
        self.desc_num
    }

    /// Heads staged by [`stage_used`](Self::stage_used) and not yet committed.
    pub fn staged(&self) -> u16 {
        self.batch_len
    }

    /// Records that `head` was popped from the available ring: its counter, then
    /// its inflight flag. Call before the request is executed.
    pub fn begin(&mut self, head: u16) -> Result<(), InflightError> {
        self.check_head(head)?;
        let desc = self.desc_offset(head);
        self.store::<AtomicU64>(desc + DESC_OFF_COUNTER, self.next_counter);
        self.store::<AtomicU8>(desc + DESC_OFF_INFLIGHT, 1);
        self.next_counter = self.next_counter.saturating_add(1);
        Ok(())
    }

    /// Adds `head` to the batch about to be published: `desc[head].next =
    /// last_batch_head; last_batch_head = head`. Call for each head of the batch
    /// before its used element is published.
    pub fn stage_used(&mut self, head: u16) -> Result<(), InflightError> {
        self.check_head(head)?;
        debug_assert!(
            self.batch_len < self.desc_num,
            "a batch larger than the queue: heads staged but never committed"
        );
        let desc = self.desc_offset(head);
        self.store::<AtomicU16>(desc + DESC_OFF_NEXT, self.batch_head);
        self.store::<AtomicU16>(OFF_LAST_BATCH_HEAD, head);
        self.batch_head = head;
        self.batch_len = self.batch_len.saturating_add(1);
        Ok(())
    }

    /// Records that the staged batch is published, `ring_used_idx` being the used
    /// ring's `idx` just stored (with one store for the whole batch): clears the
    /// batch's inflight flags, then sets `used_idx`.
    pub fn commit_used(&mut self, ring_used_idx: u16) {
        debug_assert_eq!(
            ring_used_idx.wrapping_sub(self.used_idx),
            self.batch_len,
            "the used idx moved by something else than the staged batch"
        );
        let mut head = self.batch_head;
        for left in (0..self.batch_len).rev() {
            self.store::<AtomicU8>(self.desc_offset(head) + DESC_OFF_INFLIGHT, 0);
            if left == 0 {
                break;
            }
            // The links were written by this queue; the frontend could have
            // changed them, so a link outside the queue ends the walk.
            head = self.load::<AtomicU16>(self.desc_offset(head) + DESC_OFF_NEXT);
            if head >= self.desc_num {
                break;
            }
        }
        self.store::<AtomicU16>(OFF_USED_IDX, ring_used_idx);
        self.used_idx = ring_used_idx;
        self.batch_len = 0;
    }

    /// Forgets the staged heads because their batch was not published (the used
    /// ring write failed, `idx` did not move). They stay recorded in flight; the
    /// links written while staging are ignored by recovery as long as the region's
    /// `used_idx` equals the ring's, which it does since nothing was published.
    pub fn discard_staged(&mut self) {
        self.batch_len = 0;
    }

    /// The specification's reconnection algorithm, plus initialisation of a block
    /// never used. See [`InflightRegion::attach_queue`].
    pub(super) fn recover(&mut self, ring_used_idx: u16) -> Result<Recovery, InflightError> {
        let queue = self.index;
        let version = self.load::<AtomicU16>(OFF_VERSION);
        if version == 0 {
            self.initialise(ring_used_idx);
            return Ok(Recovery {
                resubmit: Vec::new(),
                next_avail_idx: ring_used_idx,
                fresh: true,
            });
        }
        if version != REGION_VERSION {
            return Err(InflightError::Version { queue, version });
        }
        let desc_num = self.load::<AtomicU16>(OFF_DESC_NUM);
        if desc_num != self.desc_num {
            return Err(InflightError::DescNum {
                queue,
                desc_num,
                queue_size: self.desc_num,
            });
        }
        let features = self.load::<AtomicU64>(OFF_FEATURES);
        if features != 0 {
            return Err(InflightError::Features { queue, features });
        }

        let region_used = self.load::<AtomicU16>(OFF_USED_IDX);
        let last_batch_head = self.load::<AtomicU16>(OFF_LAST_BATCH_HEAD);
        if region_used != ring_used_idx {
            // Published but not fully recorded: the first `batch` entries of the
            // last-batch list completed.
            let batch = ring_used_idx.wrapping_sub(region_used);
            if batch > self.desc_num {
                return Err(InflightError::Batch {
                    queue,
                    ring: ring_used_idx,
                    region: region_used,
                    batch,
                    queue_size: self.desc_num,
                });
            }
            let mut head = last_batch_head;
            for _ in 0..batch {
                if head >= self.desc_num {
                    return Err(InflightError::BatchList {
                        queue,
                        head,
                        queue_size: self.desc_num,
                    });
                }
                let desc = self.desc_offset(head);
                self.store::<AtomicU8>(desc + DESC_OFF_INFLIGHT, 0);
                head = self.load::<AtomicU16>(desc + DESC_OFF_NEXT);
            }
            self.store::<AtomicU16>(OFF_USED_IDX, ring_used_idx);
        }

        let mut inflight: Vec<(u64, u16)> = Vec::new();
        for head in 0..self.desc_num {
            let desc = self.desc_offset(head);
            match self.load::<AtomicU8>(desc + DESC_OFF_INFLIGHT) {
                0 => {}
                1 => inflight.push((self.load::<AtomicU64>(desc + DESC_OFF_COUNTER), head)),
                flag => return Err(InflightError::Flag { queue, head, flag }),
            }
        }
        // Pop order; equal counters (only from a tampered region) by head.
        inflight.sort_unstable();
        self.next_counter = inflight
            .last()
            .map_or(1, |&(counter, _)| counter.saturating_add(1));
        self.used_idx = ring_used_idx;
        self.batch_head = last_batch_head;
        self.batch_len = 0;
        // At most `desc_num` <= 32768 heads, so the count fits a u16.
        let count = u16::try_from(inflight.len()).unwrap_or(u16::MAX);
        Ok(Recovery {
            resubmit: inflight.into_iter().map(|(_, head)| head).collect(),
            next_avail_idx: ring_used_idx.wrapping_add(count),
            fresh: false,
        })
    }

    /// Zeroes the descriptor states, writes the header and, last, the version: a
    /// crash before that store leaves version 0, and the next attach starts over.
    fn initialise(&mut self, ring_used_idx: u16) {
        for head in 0..self.desc_num {
            let desc = self.desc_offset(head);
            self.store::<AtomicU8>(desc + DESC_OFF_INFLIGHT, 0);
            self.store::<AtomicU16>(desc + DESC_OFF_NEXT, 0);
            self.store::<AtomicU64>(desc + DESC_OFF_COUNTER, 0);
        }
        self.store::<AtomicU64>(OFF_FEATURES, 0);
        self.store::<AtomicU16>(OFF_DESC_NUM, self.desc_num);
        self.store::<AtomicU16>(OFF_LAST_BATCH_HEAD, 0);
        self.store::<AtomicU16>(OFF_USED_IDX, ring_used_idx);
        self.store::<AtomicU16>(OFF_VERSION, REGION_VERSION);
        self.next_counter = 1;
        self.used_idx = ring_used_idx;
        self.batch_head = 0;
        self.batch_len = 0;
    }

    fn check_head(&self, head: u16) -> Result<(), InflightError> {
        if head < self.desc_num {
            Ok(())
        } else {
            Err(InflightError::Head {
                head,
                queue_size: self.desc_num,
            })
        }
    }

    /// Offset inside the queue block of descriptor state `head` (< `desc_num`).
    fn desc_offset(&self, head: u16) -> usize {
        // Both constants are 16; the casts cannot truncate.
        QUEUE_HEADER_SIZE as usize + DESC_STATE_SIZE as usize * usize::from(head)
    }

    /// The atomic field of type `A` at `offset` in this queue's block, if it
    /// lies within the block and is aligned for `A` (always, for the layout's
    /// offsets: the block starts on a 64-byte boundary of a page-aligned
    /// mapping). Two compares instead of vm-memory's checked accessor, whose
    /// generic bounds and alignment checks the request path would pay on
    /// every store.
    #[inline]
    fn field<A: Field>(&self, offset: usize) -> Option<&A> {
        let end = offset.checked_add(std::mem::size_of::<A>())?;
        let addr = self.block_addr.checked_add(offset)?;
        if end > self.block_len || !addr.is_multiple_of(std::mem::align_of::<A>()) {
            return None;
        }
        // SAFETY: [addr, addr + size_of::<A>()) lies inside this queue's block,
        // which `new` checked to lie inside the mapping; the mapping stays
        // mapped while `self.region` holds it (as long as the returned borrow
        // of self); the address is aligned for A, and A (a std atomic) has the
        // layout of its integer. Every access the daemon makes to the shared
        // region is atomic; the frontend only reads it back after we are gone
        // (or before we start).
        Some(unsafe { &*(addr as *const A) })
    }

    /// A `Release` store at `offset` in the queue block (see [`Self::field`]).
    #[inline]
    fn store<A: Field>(&self, offset: usize, value: A::V) {
        if self.crashed() {
            return;
        }
        match self.field::<A>(offset) {
            Some(field) => field.put(value),
            None => debug_assert!(false, "inflight store outside the queue block"),
        }
    }

    /// An `Acquire` load at `offset` in the queue block (0 if out of bounds, which
    /// the layout rules out).
    #[inline]
    fn load<A: Field>(&self, offset: usize) -> A::V {
        match self.field::<A>(offset) {
            Some(field) => field.get(),
            None => {
                debug_assert!(false, "inflight load outside the queue block");
                A::V::default()
            }
        }
    }

    /// Whether the simulated process has died (tests only; always false otherwise).
    #[inline]
    fn crashed(&self) -> bool {
        #[cfg(test)]
        if let Some(budget) = &self.crash {
            return budget
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_err();
        }
        false
    }
}

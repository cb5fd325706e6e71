//! Walking the descriptor chain of a given head (virtio spec 1.2, 2.7.5 and
//! 2.7.5.3). The IOThreads walk every request's chain with it: a head popped
//! from the available ring, and a head that is not popped (recorded in
//! flight by a daemon that died, resubmitted after a restart: vhost-user
//! "Inflight I/O tracking"). Where one region holds the whole table (as
//! every frontend lays it out), the table is found once and each
//! descriptor is a typed load at its offset in it (-33 instructions per
//! 4k read against a region lookup per descriptor); otherwise each
//! descriptor is read through [`SmallAccess`], as far as memory goes.
//!
//! virtio-queue builds chains only while popping (its `DescriptorChain::new`
//! is crate-private), so [`HeadChain`] walks the table itself with the same
//! checks as that crate's iterator: every index below the table size, at most
//! table-size descriptors per table (a loop ends), one level of indirection
//! whose table length is a multiple of 16 and at most 65535 entries, at most
//! 2^32 bytes in all. A chain that breaks a rule ends where it breaks,
//! exactly as a popped chain does, so the request parser sees the same
//! descriptors either way.

use std::mem::size_of;

use virtio_queue::desc::split::Descriptor;
use vm_memory::volatile_memory::VolatileSlice;
use vm_memory::{Address, GuestAddress, VolatileMemory};

use super::mem::SmallAccess;

/// Size of a split descriptor; an indirect table's length is a multiple of it.
const DESC_SIZE: u32 = size_of::<Descriptor>() as u32;

/// The descriptors of the chain starting at `head` in a split queue's
/// descriptor table.
#[derive(Debug, Clone)]
pub struct HeadChain<'a, M: SmallAccess + ?Sized> {
    mem: &'a M,
    table: GuestAddress,
    /// The whole table, where one region holds it: a descriptor is then a
    /// load at its offset, without a region lookup each (None: each
    /// descriptor is read by [`SmallAccess::read_obj_small`]).
    slice: Option<VolatileSlice<'a, ()>>,
    table_size: u16,
    next: u16,
    /// Descriptors this table may still yield (loop protection).
    ttl: u16,
    yielded: u32,
    indirect: bool,
}

impl<'a, M: SmallAccess + ?Sized> HeadChain<'a, M> {
    /// The chain of `head` in the table at `desc_table` of a queue of
    /// `queue_size` entries. A head outside the queue yields nothing.
    pub fn new(mem: &'a M, desc_table: GuestAddress, queue_size: u16, head: u16) -> Self {
        HeadChain {
            mem,
            table: desc_table,
            slice: table_slice(mem, desc_table, queue_size),
            table_size: queue_size,
            next: head,
            ttl: queue_size,
            yielded: 0,
            indirect: false,
        }
    }

    /// Follows an indirect descriptor: the rest of the chain is its table.
    fn enter_indirect(&mut self, desc: &Descriptor) -> Option<()> {
        // No indirect descriptor inside an indirect table (2.7.5.3.1).
        if self.indirect || !desc.len().is_multiple_of(DESC_SIZE) {
            return None;
        }
        let entries = u16::try_from(desc.len() / DESC_SIZE).ok()?;
        self.table = desc.addr();
        self.slice = table_slice(self.mem, self.table, entries);
        self.table_size = entries;
        self.next = 0;
        self.ttl = entries;
        self.indirect = true;
        Some(())
    }
}

impl<M: SmallAccess + ?Sized> Iterator for HeadChain<'_, M> {
    type Item = Descriptor;

    // Called once per descriptor from `parse_head`'s loop: left to itself,
    // LLVM inlines it in some builds and not in others (a change elsewhere
    // in the IOThread moved 2448 -> 2474 instructions per 4k read, all of it
    // here), so the call is not left to chance.
    #[inline(always)]
    fn next(&mut self) -> Option<Descriptor> {
        loop {
            if self.ttl == 0 || self.next >= self.table_size {
                return None;
            }
            let offset = usize::from(self.next) * DESC_SIZE as usize;
            let desc: Descriptor = match &self.slice {
                Some(table) => table.get_ref(offset).ok()?.load(),
                None => {
                    let addr = self.table.checked_add(offset as u64)?;
                    self.mem.read_obj_small(addr).ok()?
                }
            };
            if desc.refers_to_indirect_table() {
                self.enter_indirect(&desc)?;
                continue;
            }
            // A chain longer than 2^32 bytes is illegal (2.7.5.2): it ends here.
            self.yielded = self.yielded.checked_add(desc.len())?;
            if desc.has_next() {
                self.next = desc.next();
                self.ttl -= 1;
            } else {
                self.ttl = 0;
            }
            return Some(desc);
        }
    }
}

/// The `entries` descriptors of the table at `table`, if one region holds
/// them all.
#[inline(always)]
fn table_slice<M: SmallAccess + ?Sized>(
    mem: &M,
    table: GuestAddress,
    entries: u16,
) -> Option<VolatileSlice<'_, ()>> {
    mem.one_region(table, usize::from(entries) * DESC_SIZE as usize)
}

/// [`HeadChain`] against the chain virtio-queue pops, descriptor by
/// descriptor: well-formed chains and every way a chain can break.
#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{
        VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    };
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::{Queue, QueueT};
    use vm_memory::{Bytes, GuestMemoryMmap};

    use crate::fastpath::mem::GuestMem;

    const SIZE: u16 = 16;
    const TABLE: u64 = 0x8000;
    const NEXT: u32 = VRING_DESC_F_NEXT;
    const WRITE: u32 = VRING_DESC_F_WRITE;
    const INDIRECT: u32 = VRING_DESC_F_INDIRECT;

    fn raw(addr: u64, len: u32, flags: u32, next: u16) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, len, flags as u16, next))
    }

    fn fields(d: Descriptor) -> (u64, u32, u16, u16) {
        (d.addr().0, d.len(), d.flags(), d.next())
    }

    /// The descriptors of head 0 of a table holding `descs` (and an
    /// indirect table at `TABLE` holding `indirect`), walked both ways, and
    /// ours over both maps: vm-memory's (a read per descriptor) and the
    /// daemon's (a table in one region read through one slice).
    fn walk_both(descs: &[RawDescriptor], indirect: &[RawDescriptor]) -> usize {
        let m = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1_0000)]).unwrap();
        walk_in(&m, descs, indirect)
    }

    /// [`walk_both`] in the memory `m`.
    fn walk_in(
        m: &GuestMemoryMmap<()>,
        descs: &[RawDescriptor],
        indirect: &[RawDescriptor],
    ) -> usize {
        let vq = MockSplitQueue::new(m, SIZE);
        for (i, d) in descs.iter().enumerate() {
            vq.desc_table().store(i as u16, *d).unwrap();
        }
        for (i, d) in indirect.iter().enumerate() {
            m.write_obj(*d, GuestAddress(TABLE + 16 * i as u64))
                .unwrap();
        }
        vq.avail().ring().ref_at(0).unwrap().store(0);
        vq.avail().idx().store(u16::to_le(1));
        let mut q: Queue = vq.create_queue().unwrap();
        let popped: Vec<_> = q.pop_descriptor_chain(m).unwrap().map(fields).collect();
        let walked: Vec<_> = HeadChain::new(m, vq.desc_table_addr(), SIZE, 0)
            .map(fields)
            .collect();
        assert_eq!(walked, popped, "{descs:?} / {indirect:?}");
        let ours = GuestMem::from(m.clone());
        let sliced: Vec<_> = HeadChain::new(&ours, vq.desc_table_addr(), SIZE, 0)
            .map(fields)
            .collect();
        assert_eq!(sliced, popped, "daemon's map: {descs:?} / {indirect:?}");
        walked.len()
    }

    #[test]
    fn well_formed_chains_walk_alike() {
        let direct = [
            raw(0x1000, 16, NEXT, 1),
            raw(0x2000, 4096, NEXT | WRITE, 2),
            raw(0x3000, 1, WRITE, 0),
        ];
        assert_eq!(walk_both(&direct, &[]), 3);
        let head = [raw(TABLE, 48, INDIRECT, 0)];
        assert_eq!(walk_both(&head, &direct), 3);
        // A descriptor without NEXT ends the chain whatever its `next`.
        assert_eq!(walk_both(&[raw(0x1000, 16, 0, 5)], &[]), 1);
    }

    #[test]
    fn broken_chains_end_alike() {
        let cases: [(&[RawDescriptor], &[RawDescriptor]); 7] = [
            // A loop: 0 -> 1 -> 0.
            (&[raw(0x1000, 16, NEXT, 1), raw(0x2000, 512, NEXT, 0)], &[]),
            // A next index outside the table.
            (&[raw(0x1000, 16, NEXT, 1), raw(0x2000, 1, NEXT, 40)], &[]),
            // An indirect table whose length is not a multiple of 16.
            (&[raw(TABLE, 40, INDIRECT, 0)], &[]),
            // An indirect descriptor inside an indirect table.
            (
                &[raw(TABLE, 16, INDIRECT, 0)],
                &[raw(TABLE, 16, INDIRECT, 0)],
            ),
            // A loop inside an indirect table.
            (
                &[raw(TABLE, 32, INDIRECT, 0)],
                &[raw(0x1000, 16, NEXT, 1), raw(0x2000, 16, NEXT, 0)],
            ),
            // More than 2^32 bytes in all.
            (&[raw(0x1000, u32::MAX, NEXT, 1), raw(0x2000, 2, 0, 0)], &[]),
            // An indirect table outside guest memory.
            (&[raw(0x10_0000, 32, INDIRECT, 0)], &[]),
        ];
        for (descs, indirect) in cases {
            walk_both(descs, indirect);
        }
    }

    /// An indirect table that two regions hold, or that runs past the end
    /// of guest memory: read descriptor by descriptor, as far as memory
    /// goes.
    #[test]
    fn a_table_across_regions_or_past_memory_walks_alike() {
        let two = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), TABLE as usize + 16),
            (GuestAddress(TABLE + 16), 0x1_0000),
        ])
        .unwrap();
        let direct = [
            raw(0x1000, 16, NEXT, 1),
            raw(0x2000, 4096, NEXT | WRITE, 2),
            raw(0x3000, 1, WRITE, 0),
        ];
        assert_eq!(walk_in(&two, &[raw(TABLE, 48, INDIRECT, 0)], &direct), 3);
        let short =
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), TABLE as usize + 32)]).unwrap();
        assert_eq!(
            walk_in(&short, &[raw(TABLE, 48, INDIRECT, 0)], &direct[..2]),
            2
        );
    }

    #[test]
    fn a_head_outside_the_table_yields_nothing() {
        let m = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1000)]).unwrap();
        assert_eq!(HeadChain::new(&m, GuestAddress(0), SIZE, SIZE).count(), 0);
    }
}

//! Walking the descriptor chain of a given head (virtio spec 1.2, 2.7.5 and
//! 2.7.5.3). The IOThreads walk every request's chain with it: a head popped
//! from the available ring, and a head that is not popped (recorded in
//! flight by a daemon that died, resubmitted after a restart: vhost-user
//! "Inflight I/O tracking"). Its descriptor reads go through
//! [`SmallAccess`], the one-region path of the IOThreads' guest memory.
//!
//! `virtio_queue` builds chains only while popping (its `DescriptorChain::new` is
//! crate-private), so [`HeadChain`] walks the table itself with the same checks
//! as that crate's iterator: every index below the table size, at most table-size
//! descriptors per table (a loop ends), one level of indirection whose table
//! length is a multiple of 16 and at most 65535 entries, at most 2^32 bytes in
//! all. A chain that breaks a rule ends where it breaks, exactly as a popped
//! chain does, so the request parser sees the same descriptors either way.

use std::mem::size_of;

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, GuestAddress};

use super::access::SmallAccess;

/// Size of a split descriptor; an indirect table's length is a multiple of it.
const DESC_SIZE: u32 = size_of::<Descriptor>() as u32;

/// The descriptors of the chain starting at `head` in a split queue's
/// descriptor table.
#[derive(Debug, Clone)]
pub struct HeadChain<'a, M: SmallAccess + ?Sized> {
    mem: &'a M,
    table: GuestAddress,
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
        self.table_size = entries;
        self.next = 0;
        self.ttl = entries;
        self.indirect = true;
        Some(())
    }
}

impl<M: SmallAccess + ?Sized> Iterator for HeadChain<'_, M> {
    type Item = Descriptor;

    fn next(&mut self) -> Option<Descriptor> {
        loop {
            if self.ttl == 0 || self.next >= self.table_size {
                return None;
            }
            let addr = self
                .table
                .checked_add(u64::from(self.next) * u64::from(DESC_SIZE))?;
            let desc: Descriptor = self.mem.read_obj_small(addr).ok()?;
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

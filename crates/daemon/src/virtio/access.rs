//! The small guest memory accesses of the request path: a descriptor (16
//! bytes), a request header (16 bytes), a status byte.
//!
//! vm-memory's `Bytes` accessors work for any range: they walk it region by
//! region through a chain of generic iterators, which costs several hundred
//! instructions per 16-byte read however small the range is. The range of a
//! descriptor or a header nearly always lies in one region, so a memory map
//! can offer a direct path for that case (the IOThread's `GuestMem` does),
//! falling back to vm-memory's for a range across regions, and giving the
//! same result and the same errors either way. The defaults here are
//! vm-memory's own accessors, for any other map (the unit tests' plain
//! `GuestMemoryMmap`).

use std::sync::atomic::Ordering;

use vm_memory::{
    AtomicAccess, ByteValued, Bytes, GuestAddress, GuestMemory, GuestMemoryError, GuestMemoryMmap,
};

/// Small reads and writes of guest memory (see the module's documentation).
pub trait SmallAccess: GuestMemory {
    /// Fills `buf` from `addr` (all of it, or an error).
    fn read_small(&self, buf: &mut [u8], addr: GuestAddress) -> Result<(), GuestMemoryError> {
        self.read_slice(buf, addr)
    }

    /// Reads a `T` at `addr`.
    fn read_obj_small<T: ByteValued>(&self, addr: GuestAddress) -> Result<T, GuestMemoryError> {
        self.read_obj(addr)
    }

    /// Writes `val` at `addr`.
    fn write_obj_small<T: ByteValued>(
        &self,
        val: T,
        addr: GuestAddress,
    ) -> Result<(), GuestMemoryError> {
        self.write_obj(val, addr)
    }

    /// An atomic load of a `T` at `addr` (a ring index), aligned as `T`.
    fn load_small<T: AtomicAccess>(
        &self,
        addr: GuestAddress,
        order: Ordering,
    ) -> Result<T, GuestMemoryError> {
        self.load(addr, order)
    }

    /// An atomic store of `val` at `addr` (a ring index), aligned as `T`.
    fn store_small<T: AtomicAccess>(
        &self,
        val: T,
        addr: GuestAddress,
        order: Ordering,
    ) -> Result<(), GuestMemoryError> {
        self.store(val, addr, order)
    }
}

impl SmallAccess for GuestMemoryMmap<()> {}

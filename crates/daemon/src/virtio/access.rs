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

use std::mem::size_of;
use std::sync::atomic::Ordering;

use vm_memory::volatile_memory::VolatileSlice;
use vm_memory::{
    AtomicAccess, ByteValued, Bytes, GuestAddress, GuestMemory, GuestMemoryError, GuestMemoryMmap,
    VolatileMemory,
};

/// Small reads and writes of guest memory (see the module's documentation).
/// A map offers the direct path by answering [`SmallAccess::one_region`];
/// every access takes it when it can and falls back to vm-memory's
/// accessor otherwise, so the fast path and the fallback are written once.
pub trait SmallAccess: GuestMemory {
    /// The `len` bytes at `addr` as one volatile slice, when one region
    /// holds all of them and the map offers the direct path (None: take
    /// vm-memory's accessor).
    fn one_region(&self, _addr: GuestAddress, _len: usize) -> Option<VolatileSlice<'_, ()>> {
        None
    }

    /// Fills `buf` from `addr` (all of it, or an error).
    fn read_small(&self, buf: &mut [u8], addr: GuestAddress) -> Result<(), GuestMemoryError> {
        match self.one_region(addr, buf.len()) {
            Some(s) => {
                s.copy_to(buf);
                Ok(())
            }
            None => self.read_slice(buf, addr),
        }
    }

    /// Reads a `T` at `addr`. In one region a typed object is one volatile
    /// load of its size (vm-memory's `VolatileRef`, unaligned-safe), where a
    /// byte copy of a run-time length calls libc's memcpy.
    fn read_obj_small<T: ByteValued>(&self, addr: GuestAddress) -> Result<T, GuestMemoryError> {
        match self.one_region(addr, size_of::<T>()) {
            Some(s) => s.get_ref::<T>(0).map(|r| r.load()).map_err(Into::into),
            None => self.read_obj(addr),
        }
    }

    /// Writes `val` at `addr` (one volatile store in one region).
    fn write_obj_small<T: ByteValued>(
        &self,
        val: T,
        addr: GuestAddress,
    ) -> Result<(), GuestMemoryError> {
        match self.one_region(addr, size_of::<T>()) {
            Some(s) => s.get_ref::<T>(0).map(|r| r.store(val)).map_err(Into::into),
            None => self.write_obj(val, addr),
        }
    }

    /// An atomic load of a `T` at `addr` (a ring index), aligned as `T`.
    fn load_small<T: AtomicAccess>(
        &self,
        addr: GuestAddress,
        order: Ordering,
    ) -> Result<T, GuestMemoryError> {
        match self.one_region(addr, size_of::<T>()) {
            Some(s) => s.load(0, order).map_err(Into::into),
            None => self.load(addr, order),
        }
    }

    /// An atomic store of `val` at `addr` (a ring index), aligned as `T`.
    fn store_small<T: AtomicAccess>(
        &self,
        val: T,
        addr: GuestAddress,
        order: Ordering,
    ) -> Result<(), GuestMemoryError> {
        match self.one_region(addr, size_of::<T>()) {
            Some(s) => s.store(val, 0, order).map_err(Into::into),
            None => self.store(val, addr, order),
        }
    }
}

impl SmallAccess for GuestMemoryMmap<()> {}

//! Guest memory as the daemon maps it, and the small accesses of the request
//! path (a descriptor, a request header, a status byte, a ring index).
//!
//! [`GuestMem`] is vm-memory's region collection (the same regions, the same
//! checked accessors) with a cheaper region lookup: vm-memory's collection
//! binary-searches its regions through each region's `Arc`; here a small
//! inline table of each region's bounds and host address is scanned
//! instead. A frontend maps a handful of regions (vhost-user allows 32 at
//! most), and the table is built once per memory map, never per access.
//!
//! [`SmallAccess`] reads and writes a range that lies in one region straight
//! through a slice of that region's mapping: a bounds check against the
//! table, then one volatile load or store of the object's size. The slice
//! is made from the table's host address (the one `unsafe` of this module)
//! rather than by the region's `get_slice`, which reaches the mapping
//! through the region's `Arc` and checks the same bounds again: about 20
//! instructions per access, ten or so accesses per request (208
//! instructions per 4k read at QD16 in all).
//!
//! vm-memory's `Bytes` and `GuestMemory::load`/`store` work for any range,
//! so they walk it region by region through generic iterators, which cost
//! many times the access itself for a 2- or 16-byte one. A range across
//! regions (or outside guest memory) takes vm-memory's accessor, which
//! copies it piecewise or refuses it: the result and the errors are the
//! same either way.

use std::mem::size_of;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vm_memory::volatile_memory::VolatileSlice;
use vm_memory::{
    AtomicAccess, ByteValued, Bytes, GuestAddress, GuestMemory, GuestMemoryBackend,
    GuestMemoryError, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap, GuestUsize,
    VolatileMemory,
};

/// Small reads and writes of guest memory (see the module's documentation).
/// A map offers the direct path by answering [`SmallAccess::one_region`];
/// every access takes it when it can and falls back to vm-memory's
/// accessor otherwise, so the fast path and the fallback are written once.
/// The defaults are vm-memory's own accessors, which is all a plain
/// `GuestMemoryMmap` offers (the parser's tests and its oracle use one).
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
    ///
    /// This and the three accessors below are always inlined: at each call
    /// site they are a region check, a load or store and a branch, but left
    /// to the compiler some stayed calls depending on unrelated code around
    /// them (the count per request moved by 20 from one build to the next).
    /// Inlined everywhere: 2783 -> 2630 server instructions per 4k read,
    /// 2837 -> 2679 per write (`scripts/instructions-per-request.sh`).
    #[inline(always)]
    fn read_obj_small<T: ByteValued>(&self, addr: GuestAddress) -> Result<T, GuestMemoryError> {
        match self.one_region(addr, size_of::<T>()) {
            Some(s) => s.get_ref::<T>(0).map(|r| r.load()).map_err(Into::into),
            None => self.read_obj(addr),
        }
    }

    /// Writes `val` at `addr` (one volatile store in one region).
    #[inline(always)]
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
    #[inline(always)]
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
    #[inline(always)]
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

/// The regions' type.
pub type Region = GuestRegionMmap<()>;
/// vm-memory's error for a memory map it refuses.
pub type MapError = vm_memory::GuestRegionCollectionError;

/// Something that must live exactly as long as a region of a map and be
/// gone before the region is unmapped (the fault handler's registration of
/// the region's mapping).
pub type RegionCompanion = Arc<dyn std::any::Any + Send + Sync>;

/// Guest memory as mapped by the daemon: vm-memory's regions, a lookup
/// table of their bounds (see the module's documentation).
#[derive(Debug, Default, Clone)]
pub struct GuestMem {
    /// (region start, companion) of regions that have one. Declared before
    /// `regions`: fields drop in declaration order, so the map that holds a
    /// region last drops its companion before vm-memory unmaps the region.
    companions: Vec<(u64, RegionCompanion)>,
    regions: GuestMemoryMmap<()>,
    /// Each region's bounds and mapping, in `regions`' order.
    spans: Vec<Span>,
    /// Set when a fault broke the memory of the connection this map belongs
    /// to (the frontend shrank a file behind it): its requests must fail,
    /// whatever they read from it now is not the guest's.
    broken: Option<Arc<AtomicBool>>,
}

/// A region of a [`GuestMem`]: its guest addresses and where they are
/// mapped in the daemon.
#[derive(Debug, Clone, Copy)]
struct Span {
    /// First guest address.
    start: u64,
    /// Length in bytes (never 0: vm-memory refuses an empty region).
    len: u64,
    /// The host address of `start`: the region's mapping, which lives as
    /// long as the map holds the region (kept as an integer so the map stays
    /// `Send` and `Sync`, as vm-memory's regions are).
    host: usize,
}

impl GuestMem {
    fn new(regions: GuestMemoryMmap<()>) -> GuestMem {
        let spans = regions
            .iter()
            .map(|r| Span {
                start: r.start_addr().0,
                len: r.len(),
                host: r.as_ptr() as usize,
            })
            .collect();
        GuestMem {
            companions: Vec::new(),
            regions,
            spans,
            broken: None,
        }
    }

    /// The index of the region that holds `addr`.
    #[inline(always)]
    fn span_of(&self, addr: GuestAddress) -> Option<usize> {
        // `addr - start < len` is "start <= addr < start + len" without an
        // overflow: an address below `start` wraps to a huge offset.
        self.spans
            .iter()
            .position(|s| addr.0.wrapping_sub(s.start) < s.len)
    }

    /// `regions` with this map's companions (but `except`'s) and broken flag.
    fn derived(&self, regions: GuestMemoryMmap<()>, except: Option<u64>) -> GuestMem {
        let mut m = GuestMem::new(regions);
        m.companions = self
            .companions
            .iter()
            .filter(|(start, _)| Some(*start) != except)
            .cloned()
            .collect();
        m.broken = self.broken.clone();
        m
    }

    /// Keeps `companion` with the region starting at `start` in this map and
    /// every map derived from it that keeps the region.
    pub fn add_companion(&mut self, start: GuestAddress, companion: RegionCompanion) {
        self.companions.push((start.0, companion));
    }

    /// The flag that says this map's memory is broken (see [`GuestMem::broken`]),
    /// passed on to maps derived from this one.
    pub fn set_broken_flag(&mut self, flag: Arc<AtomicBool>) {
        self.broken = Some(flag);
    }

    /// Whether a fault broke this memory (its mappings now hold zeros, not
    /// the guest's data): a request that reads or writes it must fail.
    #[inline]
    pub fn broken(&self) -> bool {
        self.broken
            .as_ref()
            .is_some_and(|b| b.load(Ordering::Acquire))
    }

    /// The regions of a SET_MEM_TABLE (sorted, not overlapping: vm-memory
    /// checks).
    pub fn from_regions(regions: Vec<Region>) -> Result<GuestMem, MapError> {
        GuestMemoryMmap::from_regions(regions).map(GuestMem::new)
    }

    /// This map with `region` added (ADD_MEM_REG).
    pub fn insert_region(&self, region: Arc<Region>) -> Result<GuestMem, MapError> {
        self.regions
            .insert_region(region)
            .map(|m| self.derived(m, None))
    }

    /// This map without the region at `base` of `size` bytes (REM_MEM_REG).
    pub fn remove_region(
        &self,
        base: GuestAddress,
        size: GuestUsize,
    ) -> Result<(GuestMem, Arc<Region>), MapError> {
        self.regions
            .remove_region(base, size)
            .map(|(m, r)| (self.derived(m, Some(base.0)), r))
    }
}

/// A descriptor, a header, a status byte, a ring index or a data buffer in
/// one region is accessed straight through that region's slice; a range
/// across regions (or outside guest memory) takes vm-memory's accessor.
impl SmallAccess for GuestMem {
    #[inline(always)]
    fn one_region(&self, addr: GuestAddress, len: usize) -> Option<VolatileSlice<'_, ()>> {
        let span = self.spans[self.span_of(addr)?];
        // `addr` lies in the span, so `offset < span.len`; the range must
        // end in it too (past the end: None, as vm-memory's `get_slice`).
        let offset = addr.0 - span.start;
        if len as u64 > span.len - offset {
            return None;
        }
        // SAFETY: `span.host` is where the region's mapping of `span.len`
        // bytes starts, and `self.regions` holds that region (its `Arc`)
        // for at least the lifetime of `&self`, to which the slice is tied:
        // the mapping outlives the slice. `offset + len <= span.len` was
        // checked above, so the slice lies inside the mapping, and
        // `offset < span.len` fits in a `usize` because the mapping does.
        // Guest memory is only ever accessed through volatile accessors, as
        // vm-memory's own slices of it are (its `get_slice` makes the same
        // slice after the same check).
        Some(unsafe { VolatileSlice::new((span.host as *mut u8).add(offset as usize), len) })
    }
}

impl From<GuestMemoryMmap<()>> for GuestMem {
    /// The same regions (a harness's own layout, say).
    fn from(regions: GuestMemoryMmap<()>) -> GuestMem {
        GuestMem::new(regions)
    }
}

impl GuestMemoryBackend for GuestMem {
    type R = Region;

    fn num_regions(&self) -> usize {
        self.spans.len()
    }

    fn find_region(&self, addr: GuestAddress) -> Option<&Region> {
        self.regions.iter().nth(self.span_of(addr)?)
    }

    fn iter(&self) -> impl Iterator<Item = &Region> {
        self.regions.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three regions with holes between them, as a frontend maps RAM below
    /// and above a PCI hole.
    fn mem() -> GuestMem {
        GuestMem::from(
            GuestMemoryMmap::from_ranges(&[
                (GuestAddress(0x1000), 0x1000),
                (GuestAddress(0x4000), 0x2000),
                (GuestAddress(0x1_0000), 0x1000),
            ])
            .unwrap(),
        )
    }

    #[test]
    fn lookup_finds_the_same_region_as_vm_memory() {
        let m = mem();
        for addr in (0..0x1_2000u64).step_by(0x80).chain([
            0xfff,
            0x1fff,
            0x2000,
            0x5fff,
            0x6000,
            0x1_0fff,
            0x1_1000,
            u64::MAX,
        ]) {
            let ours = m.find_region(GuestAddress(addr)).map(|r| r.start_addr());
            let theirs = m
                .regions
                .find_region(GuestAddress(addr))
                .map(|r| r.start_addr());
            assert_eq!(ours, theirs, "{addr:#x}");
        }
    }

    #[test]
    fn accesses_stay_checked_across_holes_and_ends() {
        let m = mem();
        m.write_obj(0xabcdu16, GuestAddress(0x5ffe)).unwrap();
        assert_eq!(m.read_obj::<u16>(GuestAddress(0x5ffe)).unwrap(), 0xabcd);
        // Straddling the end of a region into a hole, or lying in a hole.
        assert!(m.read_obj::<u32>(GuestAddress(0x5ffe)).is_err());
        assert!(m.read_obj::<u8>(GuestAddress(0x3000)).is_err());
        assert!(m.write_obj(1u8, GuestAddress(u64::MAX)).is_err());
    }

    /// The fast path gives what vm-memory's accessors give, byte for byte
    /// and error for error: inside a region, at its last bytes, across two
    /// adjacent regions (the fallback), into a hole, past the end of the
    /// address space.
    #[test]
    fn small_accesses_match_vm_memory() {
        // Two adjacent regions (0x1000-0x3000 in two pieces), then a hole.
        let plain = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0x1000), 0x1000),
            (GuestAddress(0x2000), 0x1000),
            (GuestAddress(0x8000), 0x1000),
        ])
        .unwrap();
        let ours = GuestMem::from(plain.clone());
        let pattern: Vec<u8> = (0..0x1000u32).map(|i| (i * 7 + 3) as u8).collect();
        for base in [0x1000u64, 0x2000, 0x8000] {
            plain.write_slice(&pattern, GuestAddress(base)).unwrap();
        }
        let addrs = [
            0x0,
            0xff8,
            0x1000,
            0x1001,
            0x1002,
            0x1008,
            0x1ff0,
            0x1ff8,
            0x1ffc,
            0x1fff,
            0x2000,
            0x2ff0,
            0x2ff8,
            0x2ffc,
            0x2fff,
            0x3000,
            0x8ff0,
            0x8ff9,
            0x9000,
            u64::MAX - 7,
            u64::MAX,
        ];
        for &a in &addrs {
            let addr = GuestAddress(a);
            for len in [1usize, 2, 4, 8, 16] {
                let (mut x, mut y) = (vec![0u8; len], vec![0u8; len]);
                let (rx, ry) = (
                    ours.read_small(&mut x, addr),
                    plain.read_slice(&mut y, addr),
                );
                assert_eq!(
                    rx.is_ok(),
                    ry.is_ok(),
                    "read {len} at {a:#x}: {rx:?} / {ry:?}"
                );
                assert_eq!(x, y, "read {len} at {a:#x}");
            }
            let (x, y) = (
                ours.read_obj_small::<u64>(addr),
                plain.read_obj::<u64>(addr),
            );
            assert_eq!(x.ok(), y.ok(), "read_obj at {a:#x}");
            let (x, y) = (
                ours.read_obj_small::<[u64; 2]>(addr),
                plain.read_obj::<[u64; 2]>(addr),
            );
            assert_eq!(x.ok(), y.ok(), "read_obj of 16 at {a:#x}");
            let (x, y) = (
                ours.load_small::<u16>(addr, Ordering::Acquire),
                plain.load::<u16>(addr, Ordering::Acquire),
            );
            assert_eq!(x.ok(), y.ok(), "load u16 at {a:#x}");
            let (x, y) = (
                ours.load_small::<u32>(addr, Ordering::Acquire),
                plain.load::<u32>(addr, Ordering::Acquire),
            );
            assert_eq!(x.ok(), y.ok(), "load u32 at {a:#x}");
            let wx = ours.store_small(0x5566u16, addr, Ordering::Release);
            let rx = plain.read_obj::<u16>(addr);
            let wy = plain.store(0x7788u16, addr, Ordering::Release);
            assert_eq!(wx.is_ok(), wy.is_ok(), "store u16 at {a:#x}");
            if wx.is_ok() {
                assert_eq!(rx.unwrap(), 0x5566, "store u16 at {a:#x}");
            }
            // Writes: the same bytes land (or the same refusal) in both maps
            // (`ours` shares `plain`'s mappings, so each side writes its own
            // value and reads back through the other).
            let wx = ours.write_obj_small(0x1122_3344_5566_7788u64, addr);
            let rx = plain.read_obj::<u64>(addr);
            let wy = plain.write_obj(0x1122_3344_5566_7788u64, addr);
            assert_eq!(wx.is_ok(), wy.is_ok(), "write at {a:#x}");
            if wx.is_ok() {
                assert_eq!(rx.unwrap(), 0x1122_3344_5566_7788, "write at {a:#x}");
            }
        }
    }

    /// The direct path answers exactly the ranges that lie in one region,
    /// up to its last byte, and points where vm-memory's slice points
    /// (the fallback would hide a check that refused too much).
    #[test]
    fn one_region_covers_exactly_one_region() {
        let m = mem();
        // (address, length, whether one region holds the whole range)
        for (addr, len, fits) in [
            (0x1000u64, 1usize, true),
            (0x1000, 0x1000, true),
            (0x1ff0, 16, true),
            (0x1fff, 1, true),
            (0x4000, 0x2000, true),
            (0x5ff8, 8, true),
            (0x1_0ff0, 16, true),
            (0x1ff0, 17, false),
            (0x1fff, 2, false),
            (0x1000, 0x1001, false),
            (0x5ff9, 8, false),
            (0x2000, 1, false),
            (0x1_1000, 1, false),
            (u64::MAX, 1, false),
            (0x1_0fff, usize::MAX, false),
        ] {
            let s = m.one_region(GuestAddress(addr), len);
            if !fits {
                assert!(s.is_none(), "{len} at {addr:#x}");
                continue;
            }
            let region = m.regions.find_region(GuestAddress(addr)).unwrap();
            let theirs = region
                .get_slice(
                    vm_memory::MemoryRegionAddress(addr - region.start_addr().0),
                    len,
                )
                .unwrap();
            let s = s.unwrap_or_else(|| panic!("{len} at {addr:#x}"));
            assert_eq!(
                (s.ptr_guard().as_ptr(), s.len()),
                (theirs.ptr_guard().as_ptr(), len)
            );
        }
    }

    /// A companion lives as long as some map holds its region, and goes
    /// with a removed region once no map holds it; the broken flag is
    /// passed on to derived maps.
    #[test]
    fn companions_and_the_broken_flag_follow_their_regions() {
        let mut m = mem();
        let flag = Arc::new(AtomicBool::new(false));
        m.set_broken_flag(flag.clone());
        let c: RegionCompanion = Arc::new(0x4000u64);
        let weak = Arc::downgrade(&c);
        m.add_companion(GuestAddress(0x4000), c);
        let r = Arc::new(GuestRegionMmap::from_range(GuestAddress(0x8000), 0x1000, None).unwrap());
        let added = m.insert_region(r).unwrap();
        let (removed, _) = added.remove_region(GuestAddress(0x4000), 0x2000).unwrap();
        assert_eq!(added.companions.len(), 1);
        assert!(removed.companions.is_empty());
        assert!(!removed.broken());
        flag.store(true, Ordering::Release);
        assert!(removed.broken() && added.broken() && m.broken());
        drop((m, added));
        assert!(weak.upgrade().is_none(), "no map holds the region any more");
        assert!(!GuestMem::default().broken());
    }

    #[test]
    fn regions_added_and_removed_are_found_or_gone() {
        let r = Arc::new(GuestRegionMmap::from_range(GuestAddress(0x8000), 0x1000, None).unwrap());
        let m = mem().insert_region(r).unwrap();
        assert_eq!(m.num_regions(), 4);
        assert!(m.read_obj::<u64>(GuestAddress(0x8ff8)).is_ok());
        let (m, gone) = m.remove_region(GuestAddress(0x4000), 0x2000).unwrap();
        assert_eq!(gone.start_addr(), GuestAddress(0x4000));
        assert_eq!(m.num_regions(), 3);
        assert!(m.find_region(GuestAddress(0x4000)).is_none());
        assert!(m.read_obj::<u64>(GuestAddress(0x8000)).is_ok());
    }
}

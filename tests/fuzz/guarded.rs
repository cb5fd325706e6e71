//! Guest memory for the harnesses: several regions at fixed guest addresses
//! with unmapped guest-physical holes between them, each region's host
//! mapping fenced by PROT_NONE guard pages, so that a host-side access one
//! byte past a region faults instead of silently touching a neighbour.
//! Snapshots of every region let a harness compare memory before and after.
//!
//! The mappings live as long as the process (a harness builds its layouts
//! once and reuses them for every case, rewriting their contents).

use vm_memory::mmap::MmapRegion;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap, GuestRegionMmap};

const PAGE: usize = 4096;

/// Guest memory with guard gaps around every region.
#[derive(Clone)]
pub struct Guarded {
    /// The guest memory map (cheap to clone: regions are shared).
    pub mem: GuestMemoryMmap<()>,
    /// (guest address, size) of each region, sorted.
    pub regions: Vec<(u64, usize)>,
}

/// The bytes of every region, in [`Guarded::regions`] order.
pub type Snapshot = Vec<Vec<u8>>;

impl Guarded {
    /// Maps `layout` (sorted, disjoint (guest address, size) pairs, sizes a
    /// multiple of the page size).
    pub fn new(layout: &[(u64, usize)]) -> Guarded {
        let mut regions = Vec::new();
        for &(gpa, size) in layout {
            assert!(size.is_multiple_of(PAGE));
            // SAFETY: a fresh anonymous reservation, not aliased by anything.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    size + 2 * PAGE,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            assert_ne!(base, libc::MAP_FAILED, "mmap reservation");
            // SAFETY: the page after the first guard page, within the
            // reservation just made.
            let ptr = unsafe { base.cast::<u8>().add(PAGE) };
            // SAFETY: makes the middle of our own reservation accessible; the
            // guard pages either side stay PROT_NONE.
            let r = unsafe { libc::mprotect(ptr.cast(), size, libc::PROT_READ | libc::PROT_WRITE) };
            assert_eq!(r, 0, "mprotect");
            // SAFETY: `ptr..ptr + size` is a live read-write mapping that is
            // never unmapped (it lives as long as the process) and is only
            // accessed through this region.
            let region = unsafe {
                MmapRegion::<()>::build_raw(
                    ptr,
                    size,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                )
            }
            .expect("raw mmap region");
            regions.push(GuestRegionMmap::new(region, GuestAddress(gpa)).expect("region"));
        }
        Guarded {
            mem: GuestMemoryMmap::from_regions(regions).expect("guest memory"),
            regions: layout.to_vec(),
        }
    }

    /// Whether `[addr, addr + len)` lies inside one region (len 0: `addr` does).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        self.regions.iter().any(|&(gpa, size)| {
            addr >= gpa
                && addr
                    .checked_add(len.max(1))
                    .is_some_and(|end| end <= gpa + size as u64)
        })
    }

    /// Fills every region with bytes from `rng`.
    pub fn fill(&self, rng: &mut fastrand::Rng) {
        let mut buf = Vec::new();
        for &(gpa, size) in &self.regions {
            buf.resize(size, 0);
            rng.fill(&mut buf);
            self.mem.write_slice(&buf, GuestAddress(gpa)).unwrap();
        }
    }

    /// Writes `data` at `addr` if it fits in guest memory (else nothing).
    pub fn put(&self, addr: u64, data: &[u8]) {
        let _ = self.mem.write_slice(data, GuestAddress(addr));
    }

    /// Copies every region.
    pub fn snapshot(&self) -> Snapshot {
        self.regions
            .iter()
            .map(|&(gpa, size)| {
                let mut v = vec![0u8; size];
                self.mem.read_slice(&mut v, GuestAddress(gpa)).unwrap();
                v
            })
            .collect()
    }

    /// `len` bytes at `addr` in snapshot `s`, if they lie in one region.
    pub fn read<'s>(&self, s: &'s Snapshot, addr: u64, len: usize) -> Option<&'s [u8]> {
        let i = self.regions.iter().position(|&(gpa, size)| {
            addr >= gpa
                && addr
                    .checked_add(len as u64)
                    .is_some_and(|e| e <= gpa + size as u64)
        })?;
        let off = (addr - self.regions[i].0) as usize;
        Some(&s[i][off..off + len])
    }

    /// Guest addresses whose byte differs between two snapshots.
    pub fn changed(&self, before: &Snapshot, after: &Snapshot) -> Vec<u64> {
        let mut out = Vec::new();
        for (i, &(gpa, _)) in self.regions.iter().enumerate() {
            let (a, b) = (&before[i], &after[i]);
            for (c, (x, y)) in a.chunks(256).zip(b.chunks(256)).enumerate() {
                if x != y {
                    for (j, (p, q)) in x.iter().zip(y).enumerate() {
                        if p != q {
                            out.push(gpa + (c * 256 + j) as u64);
                        }
                    }
                }
            }
        }
        out
    }
}

/// Helpers to read little-endian values out of a snapshot.
pub fn le_u16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

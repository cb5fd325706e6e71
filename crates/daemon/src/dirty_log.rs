//! The dirty log of a live migration (vhost-user "Migration", "Dirty
//! logging"): a bitmap shared with the frontend, one bit per 4 KiB page of
//! guest *physical* address space, bit `n` of byte `n / 8` for page `n`
//! (little-endian bit order, so the frontend can read it as `u64` words).
//!
//! While the frontend acks `VHOST_F_LOG_ALL`, every byte the daemon writes
//! into guest memory must set its page's bit, atomically (the frontend clears
//! bits concurrently, once per migration round) and before the used index
//! that publishes the write: a page written and not marked reaches the
//! destination stale. The frontend hands the bitmap over with `SET_LOG_BASE`
//! (`VHOST_USER_PROTOCOL_F_LOG_SHMFD`): an fd, a size and an offset.
//!
//! The mapping is checked before it is made (as guest memory regions are,
//! docs/security.md): the window must lie within its file (else touching its
//! end raises SIGBUS) and be long enough to cover the highest guest address
//! (else a mark would fall outside it). A mark beyond the log anyway (memory
//! hot-added without a new log) is dropped and reported once, never written.

use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use log::error;
use vm_memory::mmap::MmapRegion;
use vm_memory::FileOffset;

use crate::fault::{self, FaultOwner, MappingKind, Registration, RegistryFull};

/// Bytes of guest memory one bit of the log stands for (vhost-user spec:
/// `VHOST_LOG_PAGE`).
pub const LOG_PAGE: u64 = 4096;

/// Why a `SET_LOG_BASE` was refused.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A log of zero bytes.
    #[error("dirty log: mmap_size is zero")]
    Empty,
    /// mmap needs a page-aligned offset.
    #[error("dirty log: mmap_offset {0:#x} is not a multiple of the page size")]
    Offset(u64),
    /// `fstat` failed on the log's fd.
    #[error("dirty log: fstat: {0}")]
    Stat(#[source] std::io::Error),
    /// The fd is not a regular file or memfd.
    #[error("dirty log: its fd is not a regular file or memfd")]
    NotRegular,
    /// The window reaches past the end of the file: SIGBUS on first access.
    #[error(
        "dirty log: mmap_offset {offset:#x} + mmap_size {size:#x} is beyond the end of its file ({file_len} bytes)"
    )]
    BeyondEof {
        /// mmap offset.
        offset: u64,
        /// Log size.
        size: u64,
        /// Size of the file.
        file_len: u64,
    },
    /// The log cannot cover the guest memory it must log.
    #[error(
        "dirty log: {size} bytes cover guest addresses below {covered:#x}, \
         but guest memory reaches {mem_end:#x} ({needed} bytes needed)"
    )]
    TooShort {
        /// Log size.
        size: u64,
        /// First guest address the log does not cover.
        covered: u64,
        /// One past the highest guest address.
        mem_end: u64,
        /// Bytes needed.
        needed: u64,
    },
    /// mmap failed.
    #[error("dirty log: mmap: {0}")]
    Map(#[source] vm_memory::mmap::MmapRegionError),
}

/// Bytes of log needed to cover guest addresses below `mem_end`.
pub fn bytes_needed(mem_end: u64) -> u64 {
    mem_end.div_ceil(LOG_PAGE).div_ceil(8)
}

/// Checks a `SET_LOG_BASE` window against its file (`file_len` bytes) and
/// the guest memory it must cover (addresses below `mem_end`), with the
/// host's `page` size. Pure: the rules, without the file.
pub fn check(
    size: u64,
    offset: u64,
    file_len: u64,
    page: u64,
    mem_end: u64,
) -> Result<(), LogError> {
    if size == 0 {
        return Err(LogError::Empty);
    }
    if !offset.is_multiple_of(page.max(1)) {
        return Err(LogError::Offset(offset));
    }
    match offset.checked_add(size) {
        Some(end) if end <= file_len => {}
        _ => {
            return Err(LogError::BeyondEof {
                offset,
                size,
                file_len,
            })
        }
    }
    let needed = bytes_needed(mem_end);
    if size < needed {
        return Err(LogError::TooShort {
            size,
            covered: size.saturating_mul(8 * LOG_PAGE),
            mem_end,
            needed,
        });
    }
    Ok(())
}

/// A mapped dirty log. Shared (`Arc`) by the connection and the IOThreads
/// serving the export; unmapped when the last holder drops it.
pub struct DirtyLog {
    /// The mapping's entry in the fault handler's registry: declared before
    /// `map`, so it is removed before the mapping goes (`crate::fault`).
    fault: Option<Registration>,
    map: MmapRegion<()>,
    /// Pages the log covers (8 per byte).
    pages: u64,
    /// A mark beyond the log was dropped (reported once).
    told_beyond: AtomicBool,
}

impl std::fmt::Debug for DirtyLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirtyLog")
            .field("pages", &self.pages)
            .finish()
    }
}

impl DirtyLog {
    /// Maps the log of a `SET_LOG_BASE`: `size` bytes at `offset` of `file`,
    /// checked first (see [`check`]) so that it covers guest addresses below
    /// `mem_end` and lies within the file. The caller seals the file against
    /// shrinking before (as for guest memory).
    pub fn map(file: &File, size: u64, offset: u64, mem_end: u64) -> Result<DirtyLog, LogError> {
        let meta = file.metadata().map_err(LogError::Stat)?;
        if !meta.file_type().is_file() {
            return Err(LogError::NotRegular);
        }
        // SAFETY: sysconf takes no pointer.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page = u64::try_from(page).unwrap_or(4096).max(1);
        check(size, offset, meta.len(), page, mem_end)?;
        let len = usize::try_from(size).map_err(|_| LogError::BeyondEof {
            offset,
            size,
            file_len: meta.len(),
        })?;
        let dup = file.try_clone().map_err(LogError::Stat)?;
        let map =
            MmapRegion::from_file(FileOffset::new(dup, offset), len).map_err(LogError::Map)?;
        Ok(DirtyLog::over(map))
    }

    fn over(map: MmapRegion<()>) -> DirtyLog {
        DirtyLog {
            fault: None,
            pages: (map.size() as u64).saturating_mul(8),
            map,
            told_beyond: AtomicBool::new(false),
        }
    }

    /// An anonymous log of `bytes` bytes, for tests.
    #[cfg(test)]
    pub(crate) fn anonymous(bytes: usize) -> DirtyLog {
        DirtyLog::over(MmapRegion::new(bytes).unwrap())
    }

    /// Enters the mapping in the fault handler's registry for `owner`: a
    /// frontend that shrinks the log's file under it breaks its own
    /// connection instead of the process (`crate::fault`).
    pub fn register_faults(&mut self, owner: &Arc<FaultOwner>) -> Result<(), RegistryFull> {
        let r = fault::register(
            self.map.as_ptr(),
            self.map.size(),
            MappingKind::DirtyLog,
            owner,
        )?;
        self.fault = Some(r);
        Ok(())
    }

    /// Pages the log covers.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Byte `i` of the bitmap, as an atomic.
    fn byte(&self, i: u64) -> &AtomicU8 {
        debug_assert!(i < self.map.size() as u64);
        // SAFETY: i < map.size() (callers clamp to `pages / 8`), so the byte is
        // inside the live mapping owned by self; AtomicU8 has the layout of u8,
        // and every access to the shared bitmap (ours and the frontend's) is
        // atomic.
        unsafe { &*self.map.as_ptr().add(i as usize).cast::<AtomicU8>() }
    }

    /// Marks the pages of guest addresses `[gpa, gpa + len)` dirty. `len` 0
    /// marks nothing; pages beyond the log are dropped (and reported once).
    pub fn mark(&self, gpa: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = gpa / LOG_PAGE;
        let last = gpa.saturating_add(len - 1) / LOG_PAGE;
        if last >= self.pages {
            if !self.told_beyond.swap(true, Ordering::Relaxed) {
                error!(
                    "dirty log: guest address {gpa:#x}+{len:#x} is beyond the {} pages the \
                     log covers: those pages are not marked",
                    self.pages
                );
            }
            if first >= self.pages {
                return;
            }
        }
        let last = last.min(self.pages - 1);
        let (first_byte, last_byte) = (first / 8, last / 8);
        for b in first_byte..=last_byte {
            let lo = if b == first_byte { first % 8 } else { 0 };
            let hi = if b == last_byte { last % 8 } else { 7 };
            // Bits lo..=hi of this byte.
            let mask = (0xffu8 >> (7 - hi)) & (0xffu8 << lo);
            // Release: the guest-memory writes this mark stands for are
            // ordered before it.
            self.byte(b).fetch_or(mask, Ordering::Release);
        }
    }

    /// Whether page `page` is marked (tests and diagnostics).
    pub fn is_marked(&self, page: u64) -> bool {
        page < self.pages && self.byte(page / 8).load(Ordering::Acquire) & (1 << (page % 8)) != 0
    }

    /// The marked pages, in order (tests and diagnostics).
    pub fn marked(&self) -> Vec<u64> {
        (0..self.pages).filter(|&p| self.is_marked(p)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_mark_inside_one_page_sets_one_bit() {
        let log = DirtyLog::anonymous(16);
        log.mark(0x1000, 1);
        log.mark(0x2fff, 1);
        log.mark(0x5000, 4096);
        assert_eq!(log.marked(), vec![1, 2, 5]);
    }

    #[test]
    fn len_zero_marks_nothing() {
        let log = DirtyLog::anonymous(16);
        log.mark(0x3000, 0);
        assert!(log.marked().is_empty());
    }

    #[test]
    fn a_range_crossing_a_page_boundary_marks_both_pages() {
        let log = DirtyLog::anonymous(16);
        log.mark(0x1fff, 2);
        assert_eq!(log.marked(), vec![1, 2]);
    }

    #[test]
    fn a_range_spanning_bytes_of_the_bitmap_marks_every_page() {
        let log = DirtyLog::anonymous(16);
        // Pages 6..=25: crosses bytes 0, 1, 2, 3 of the bitmap.
        log.mark(6 * LOG_PAGE + 100, 19 * LOG_PAGE + 1);
        assert_eq!(log.marked(), (6..=25).collect::<Vec<_>>());
        // Bit order within a byte: page 6 is bit 6 of byte 0.
        assert_eq!(log.byte(0).load(Ordering::Relaxed), 0b1100_0000);
        assert_eq!(log.byte(1).load(Ordering::Relaxed), 0xff);
        assert_eq!(log.byte(3).load(Ordering::Relaxed), 0b0000_0011);
    }

    #[test]
    fn marks_accumulate_and_never_clear() {
        let log = DirtyLog::anonymous(16);
        log.mark(0, 1);
        log.mark(7 * LOG_PAGE, 1);
        log.mark(0, LOG_PAGE);
        assert_eq!(log.marked(), vec![0, 7]);
    }

    #[test]
    fn the_last_page_of_the_log_is_marked_and_beyond_it_dropped() {
        let log = DirtyLog::anonymous(2); // 16 pages
        assert_eq!(log.pages(), 16);
        log.mark(15 * LOG_PAGE + 4095, 1);
        assert_eq!(log.marked(), vec![15]);
        // Straddles the end: the covered part is marked.
        log.mark(14 * LOG_PAGE, 3 * LOG_PAGE);
        assert_eq!(log.marked(), vec![14, 15]);
        // Entirely beyond, and at the very top of the address space: no write.
        log.mark(16 * LOG_PAGE, 1);
        log.mark(u64::MAX - 10, 100);
        assert_eq!(log.marked(), vec![14, 15]);
    }

    #[test]
    fn bytes_needed_covers_the_highest_address() {
        assert_eq!(bytes_needed(0), 0);
        assert_eq!(bytes_needed(1), 1);
        assert_eq!(bytes_needed(8 * LOG_PAGE), 1);
        assert_eq!(bytes_needed(8 * LOG_PAGE + 1), 2);
        // 256 MiB of guest memory: 65536 pages, 8 KiB of log.
        assert_eq!(bytes_needed(256 << 20), 8192);
    }

    #[test]
    fn check_refuses_short_logs_and_windows_beyond_the_file() {
        let mem_end = 256 << 20;
        assert!(check(8192, 0, 8192, 4096, mem_end).is_ok());
        assert!(matches!(
            check(8191, 0, 8192, 4096, mem_end),
            Err(LogError::TooShort { needed: 8192, .. })
        ));
        assert!(matches!(
            check(8192, 4096, 8192, 4096, mem_end),
            Err(LogError::BeyondEof { .. })
        ));
        assert!(matches!(
            check(8192, u64::MAX - 4095, u64::MAX, 4096, mem_end),
            Err(LogError::BeyondEof { .. })
        ));
        assert!(matches!(
            check(8192, 100, 1 << 20, 4096, mem_end),
            Err(LogError::Offset(100))
        ));
        assert!(matches!(check(0, 0, 8192, 4096, 0), Err(LogError::Empty)));
    }

    #[test]
    fn map_checks_the_file_before_mapping_it() {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&[0u8; 8192]).unwrap();
        // Short file: refused, no mapping (touching it would be SIGBUS).
        assert!(matches!(
            DirtyLog::map(&file, 16384, 0, 4096),
            Err(LogError::BeyondEof { .. })
        ));
        // Too short for guest memory of 512 MiB (16 KiB needed).
        assert!(matches!(
            DirtyLog::map(&file, 8192, 0, 512 << 20),
            Err(LogError::TooShort { .. })
        ));
        let log = DirtyLog::map(&file, 4096, 4096, 128 << 20).unwrap();
        log.mark(0x1000, 1);
        assert!(log.is_marked(1));
        drop(log);
        // The mark landed in the file at the window's offset.
        let mut buf = [0u8; 1];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, 4096).unwrap();
        assert_eq!(buf[0], 0b10);
    }
}

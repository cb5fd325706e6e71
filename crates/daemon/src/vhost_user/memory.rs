//! Guest memory regions handed over by the frontend (SET_MEM_TABLE,
//! ADD_MEM_REG), checked before they are mapped.
//!
//! A region is a window `[mmap_offset, mmap_offset + size)` of a file the
//! frontend passed by fd. If that window reaches past the end of the file,
//! the mapping succeeds but the first access to the missing pages raises
//! SIGBUS, which kills the daemon and every export with it. So each region's
//! file is checked with `fstat` first: a regular file (memfds, tmpfs and
//! hugetlbfs files are regular files) large enough for the window.
//!
//! A frontend could still shrink the file *after* the check. Shared memory
//! files (memfd) can be sealed against that (`F_SEAL_SHRINK`, which QEMU's
//! memfd backend already sets): when the seal is missing and the file allows
//! it, we add it ourselves, before the size check, so the size we check is
//! the size that stays. A well-behaved frontend never shrinks guest memory a
//! backend maps. Files that cannot be sealed (tmpfs or hugetlbfs files opened
//! by path, disk files) are refused under `--memory-sealing required`;
//! otherwise a truncation is caught by the fault handler (`crate::fault`) and
//! ends that frontend's connection (docs/security.md).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use vhost::vhost_user::message::VhostUserMemoryRegion;

/// Why a memory region was refused.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// A region of zero bytes.
    #[error("region {index}: size is zero")]
    Empty {
        /// Region index in the message.
        index: usize,
    },
    /// An address range wraps past 2^64 or does not fit the address space.
    #[error("region {index}: {what} {start:#x} + size {size:#x} overflows")]
    Overflow {
        /// Region index in the message.
        index: usize,
        /// Which range: guest address, frontend address or mmap offset.
        what: &'static str,
        /// Start of the range.
        start: u64,
        /// Size of the range.
        size: u64,
    },
    /// `fstat` failed on the region's fd.
    #[error("region {index}: fstat: {source}")]
    Stat {
        /// Region index in the message.
        index: usize,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The fd is not a regular file (a socket, a pipe, a device...).
    #[error("region {index}: its fd is not a regular file or memfd")]
    NotRegular {
        /// Region index in the message.
        index: usize,
    },
    /// The window reaches past the end of the file: SIGBUS on first access.
    #[error(
        "region {index}: mmap offset {offset:#x} + size {size:#x} is beyond the end of its file ({file_size} bytes)"
    )]
    BeyondEof {
        /// Region index in the message.
        index: usize,
        /// mmap offset.
        offset: u64,
        /// Region size.
        size: u64,
        /// Size of the file.
        file_size: u64,
    },
    /// Two regions claim the same frontend addresses.
    #[error("region {index}: frontend addresses {start:#x}+{size:#x} overlap another region")]
    UserOverlap {
        /// Region index in the message.
        index: usize,
        /// Start of the frontend address range.
        start: u64,
        /// Size of the range.
        size: u64,
    },
}

/// Whether a checked region's file is protected against shrinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sealing {
    /// `F_SEAL_SHRINK` was already set by the frontend.
    Sealed,
    /// We added `F_SEAL_SHRINK`.
    SealedByUs,
    /// The file cannot be sealed (not shmem, or `F_SEAL_SEAL` set without
    /// `F_SEAL_SHRINK`, or the fd is read-only): a truncation by the frontend
    /// after mapping faults the daemon's next access, which the fault handler
    /// turns into the end of that connection (`crate::fault`).
    Unsealed,
}

/// Checks `r` (region `index` of a message) against its file, sealing the
/// file against shrinking first where possible. Call before mapping.
pub fn check_region(
    index: usize,
    r: &VhostUserMemoryRegion,
    file: &File,
) -> Result<Sealing, RegionError> {
    if r.memory_size == 0 {
        return Err(RegionError::Empty { index });
    }
    for (what, start) in [
        ("guest address", r.guest_phys_addr),
        ("frontend address", r.user_addr),
        ("mmap offset", r.mmap_offset),
    ] {
        if start.checked_add(r.memory_size).is_none() || usize::try_from(r.memory_size).is_err() {
            return Err(RegionError::Overflow {
                index,
                what,
                start,
                size: r.memory_size,
            });
        }
    }
    let meta = file
        .metadata()
        .map_err(|source| RegionError::Stat { index, source })?;
    if !meta.file_type().is_file() {
        return Err(RegionError::NotRegular { index });
    }
    // Seal before measuring, so the size checked is the size that stays.
    let sealing = seal_against_shrinking(file);
    let file_size = file
        .metadata()
        .map_err(|source| RegionError::Stat { index, source })?
        .len();
    let end = r.mmap_offset + r.memory_size; // no overflow: checked above
    if end > file_size {
        return Err(RegionError::BeyondEof {
            index,
            offset: r.mmap_offset,
            size: r.memory_size,
            file_size,
        });
    }
    Ok(sealing)
}

/// Makes sure the file cannot shrink: reads its seals and adds
/// `F_SEAL_SHRINK` if it is missing and the file allows it.
pub(crate) fn seal_against_shrinking(file: &File) -> Sealing {
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a valid fd we own, with an integer-only command.
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    if seals < 0 {
        // Not a file type that supports seals (EINVAL).
        return Sealing::Unsealed;
    }
    if seals & libc::F_SEAL_SHRINK != 0 {
        return Sealing::Sealed;
    }
    if seals & libc::F_SEAL_SEAL != 0 {
        return Sealing::Unsealed;
    }
    // SAFETY: as above; F_ADD_SEALS takes an integer argument.
    let r = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
    if r == 0 {
        Sealing::SealedByUs
    } else {
        Sealing::Unsealed
    }
}

/// One region's frontend-address window, to translate vring addresses
/// (SET_VRING_ADDR carries frontend virtual addresses).
#[derive(Debug, Clone, Copy)]
pub struct AddrMapping {
    /// Start in the frontend's address space.
    pub vmm_addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// Guest physical address of `vmm_addr`.
    pub gpa_base: u64,
}

impl AddrMapping {
    /// The mapping of region `r`.
    pub fn of(r: &VhostUserMemoryRegion) -> Self {
        AddrMapping {
            vmm_addr: r.user_addr,
            size: r.memory_size,
            gpa_base: r.guest_phys_addr,
        }
    }

    fn overlaps(&self, other: &AddrMapping) -> bool {
        self.vmm_addr < other.vmm_addr + other.size && other.vmm_addr < self.vmm_addr + self.size
    }
}

/// Refuses a set of mappings in which two frontend address ranges overlap
/// (vring address translation would be ambiguous). `index` numbers the
/// new mapping for the error; `existing` must already be disjoint.
pub fn check_disjoint(
    index: usize,
    new: &AddrMapping,
    existing: &[AddrMapping],
) -> Result<(), RegionError> {
    if existing.iter().any(|m| m.overlaps(new)) {
        return Err(RegionError::UserOverlap {
            index,
            start: new.vmm_addr,
            size: new.size,
        });
    }
    Ok(())
}

/// Translates a frontend virtual address into a guest physical address.
pub fn vmm_va_to_gpa(mappings: &[AddrMapping], va: u64) -> Option<u64> {
    mappings
        .iter()
        .find(|m| va >= m.vmm_addr && va - m.vmm_addr < m.size)
        .map(|m| va - m.vmm_addr + m.gpa_base)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(len: u64, flags: libc::c_uint) -> File {
        // SAFETY: a NUL-terminated name and valid flags.
        let fd = unsafe { libc::memfd_create(c"vqblk-region-test".as_ptr(), flags) };
        assert!(fd >= 0);
        // SAFETY: a fresh fd we own.
        let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.set_len(len).unwrap();
        f
    }

    fn region(size: u64, offset: u64) -> VhostUserMemoryRegion {
        VhostUserMemoryRegion::new(0, size, 0x7000_0000, offset)
    }

    #[test]
    fn window_must_fit_the_file() {
        let f = memfd(0x10000, libc::MFD_ALLOW_SEALING);
        assert!(check_region(0, &region(0x10000, 0), &f).is_ok());
        assert!(check_region(0, &region(0x8000, 0x8000), &f).is_ok());
        assert!(matches!(
            check_region(0, &region(0x10001, 0), &f),
            Err(RegionError::BeyondEof { .. })
        ));
        assert!(matches!(
            check_region(0, &region(0x1000, 0x10000), &f),
            Err(RegionError::BeyondEof { .. })
        ));
        assert!(matches!(
            check_region(0, &region(0x1000, u64::MAX - 10), &f),
            Err(RegionError::Overflow { .. })
        ));
        assert!(matches!(
            check_region(0, &region(0, 0), &f),
            Err(RegionError::Empty { .. })
        ));
    }

    #[test]
    fn memfd_gets_sealed_against_shrinking() {
        let f = memfd(0x10000, libc::MFD_ALLOW_SEALING);
        assert_eq!(
            check_region(0, &region(0x1000, 0), &f).unwrap(),
            Sealing::SealedByUs
        );
        assert!(f.set_len(0x1000).is_err(), "shrinking must now fail");
        assert!(f.set_len(0x20000).is_ok(), "growing stays allowed");
        assert_eq!(
            check_region(0, &region(0x1000, 0), &f).unwrap(),
            Sealing::Sealed
        );
        // A memfd created without MFD_ALLOW_SEALING carries F_SEAL_SEAL.
        let g = memfd(0x10000, 0);
        assert_eq!(
            check_region(0, &region(0x1000, 0), &g).unwrap(),
            Sealing::Unsealed
        );
    }

    #[test]
    fn non_files_are_refused() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let f = File::from(std::os::fd::OwnedFd::from(a));
        assert!(matches!(
            check_region(0, &region(0x1000, 0), &f),
            Err(RegionError::NotRegular { .. })
        ));
    }

    #[test]
    fn frontend_ranges_must_be_disjoint() {
        let a = AddrMapping {
            vmm_addr: 0x1000,
            size: 0x1000,
            gpa_base: 0,
        };
        let b = AddrMapping {
            vmm_addr: 0x1800,
            size: 0x1000,
            gpa_base: 0x10000,
        };
        let c = AddrMapping {
            vmm_addr: 0x2000,
            size: 0x1000,
            gpa_base: 0x10000,
        };
        assert!(check_disjoint(1, &b, &[a]).is_err());
        assert!(check_disjoint(1, &c, &[a]).is_ok());
        assert_eq!(vmm_va_to_gpa(&[a, c], 0x2010), Some(0x10010));
        assert_eq!(vmm_va_to_gpa(&[a, c], 0x3000), None);
    }
}

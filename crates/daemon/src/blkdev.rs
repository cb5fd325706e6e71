//! Queries of a Linux block device: its size and its logical block size,
//! by the ioctls of linux/fs.h. A leaf module: the block layer asks them when
//! it opens a device, and the seccomp filter of the thread that adds exports
//! allows exactly these ioctl numbers.

use std::fs::File;
use std::io;

/// Block device ioctls of linux/fs.h, numbered by vmm-sys-util's macros.
pub(crate) mod ioctl {
    #![allow(missing_docs)] // the macros generate one `pub fn NAME() -> c_ulong` each
    vmm_sys_util::ioctl_ior_nr!(BLKGETSIZE64, 0x12, 114, u64);
    vmm_sys_util::ioctl_io_nr!(BLKSSZGET, 0x12, 104);
}

/// The size in bytes of an open block device (`BLKGETSIZE64`).
pub fn blkdev_size(f: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through its argument, which is a
    // live, exclusively borrowed u64; `f` is an open file (a non-device fails
    // with ENOTTY, reported as an error).
    let r = unsafe { vmm_sys_util::ioctl::ioctl_with_mut_ref(f, ioctl::BLKGETSIZE64(), &mut size) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// The logical block size of an open block device (`BLKSSZGET`), if it says one of at
/// least 512 bytes.
pub fn blkdev_logical_block_size(f: &File) -> Option<u32> {
    let mut lbs: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through its argument, which is a live,
    // exclusively borrowed c_int; `f` is an open file.
    let r = unsafe { vmm_sys_util::ioctl::ioctl_with_mut_ref(f, ioctl::BLKSSZGET(), &mut lbs) };
    (r == 0 && lbs >= 512).then_some(lbs as u32)
}

#[cfg(test)]
mod tests {
    use super::ioctl;

    #[test]
    fn ioctl_numbers_match_linux_fs_h() {
        // The values the kernel headers give on 64-bit Linux.
        assert_eq!(ioctl::BLKGETSIZE64(), 0x8008_1272);
        assert_eq!(ioctl::BLKSSZGET(), 0x1268);
    }
}

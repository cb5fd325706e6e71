//! Where a disk's completion interrupts land: the CPU an IOThread serving
//! that disk should run on.
//!
//! A device completes a request with an interrupt on the CPU its vector is
//! routed to, and the kernel hands the completion to the submitting thread
//! there. A thread on another CPU pays a cross-CPU wake-up, or with io_uring
//! an inter-processor interrupt, for every completion: on a VM each is a VM
//! exit (docs/autotune.md, "Placement on CPUs", has the figures). An
//! unpinned thread is moved there by the scheduler; a pool pinned to a
//! cpuset has to choose.
//!
//! The answer comes from files any thread may read (no directory listing,
//! no `readlink`: the control socket's seccomp filter allows neither): the
//! image's device number, the PCI slot in the `uevent` of the device above
//! it in `/sys/dev/block`, and that slot's MSI lines in `/proc/interrupts`,
//! counted per CPU. Devices without such lines (device-mapper, loop, RBD,
//! the null backend, kernels that do not name the slot in
//! `/proc/interrupts`) have no answer, and the caller keeps its default.

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

/// The CPU of `allowed` that took the most completion interrupts of the
/// device holding `image` (a file or a block device), if any of them took
/// one.
pub fn busiest_cpu_of(image: &Path, allowed: &[usize]) -> Option<usize> {
    let counts = interrupts_of(image)?;
    busiest(&counts, allowed)
}

/// Interrupts of the PCI device holding `image`, per CPU.
fn interrupts_of(image: &Path) -> Option<Vec<u64>> {
    let meta = fs::metadata(image).ok()?;
    let dev = if meta.file_type().is_block_device() {
        meta.rdev()
    } else {
        meta.dev()
    };
    let sys = format!("/sys/dev/block/{}:{}", libc::major(dev), libc::minor(dev));
    // A partition's `device` is its disk's: the kernel resolves `..` after
    // the symlink, so these paths name the device and the one above it (a
    // virtio disk sits on a PCI device; an NVMe namespace on a controller
    // whose `device` is the PCI device).
    let slot = [
        "device",
        "device/..",
        "device/device",
        "../device",
        "../device/..",
    ]
    .iter()
    .find_map(|d| {
        let uevent = fs::read_to_string(format!("{sys}/{d}/uevent")).ok()?;
        pci_slot(&uevent).map(str::to_owned)
    })?;
    let interrupts = fs::read_to_string("/proc/interrupts").ok()?;
    per_cpu(&interrupts, &slot)
}

/// The `PCI_SLOT_NAME` of a sysfs `uevent` file.
fn pci_slot(uevent: &str) -> Option<&str> {
    uevent
        .lines()
        .find_map(|l| l.strip_prefix("PCI_SLOT_NAME="))
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// Sums, per CPU, the counts of the `/proc/interrupts` lines of the PCI
/// device `slot` (chip name `PCI-MSI-<slot>` or `PCI-MSIX-<slot>`); `None`
/// if no line names it.
fn per_cpu(interrupts: &str, slot: &str) -> Option<Vec<u64>> {
    let mut lines = interrupts.lines();
    let cpus = lines.next()?.split_whitespace().count();
    let mut sum = vec![0u64; cpus];
    let mut found = false;
    for line in lines {
        let mut fields = line.split_whitespace();
        // Numbered IRQs only ("NMI:", "LOC:" ... are not a device's).
        let numbered = fields
            .next()
            .and_then(|f| f.strip_suffix(':'))
            .is_some_and(|n| n.parse::<u32>().is_ok());
        if !numbered {
            continue;
        }
        let counts: Vec<u64> = fields
            .by_ref()
            .take(cpus)
            .map_while(|f| f.parse().ok())
            .collect();
        let ours = fields.next().is_some_and(|chip| {
            ["PCI-MSI-", "PCI-MSIX-"]
                .iter()
                .any(|p| chip.strip_prefix(p) == Some(slot))
        });
        if ours && counts.len() == cpus {
            found = true;
            for (s, c) in sum.iter_mut().zip(counts) {
                *s += c;
            }
        }
    }
    found.then_some(sum)
}

/// The CPU of `allowed` with the highest count (the first on a tie), if
/// one has a count above 0.
fn busiest(counts: &[u64], allowed: &[usize]) -> Option<usize> {
    let mut best: Option<(usize, u64)> = None;
    for &cpu in allowed {
        let c = counts.get(cpu).copied().unwrap_or(0);
        if c > 0 && best.is_none_or(|(_, b)| c > b) {
            best = Some((cpu, c));
        }
    }
    best.map(|(cpu, _)| cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 2-CPU VM's `/proc/interrupts` (Linux 6.x names the PCI slot).
    const INTERRUPTS: &str = "           CPU0       CPU1
  1:          9          0  IO-APIC   1-edge      i8042
 28:          0          0  PCI-MSIX-0000:00:01.0   0-edge      virtio0-config
 32:       3905          0  PCI-MSIX-0000:00:01.0   4-edge      virtio0-reporting_vq
 35:          0          1  PCI-MSIX-0000:00:02.0   0-edge      virtio1-config
 36:          0   15880635  PCI-MSIX-0000:00:02.0   1-edge      virtio1-req.0
 41:      24341          0  PCI-MSIX-0000:00:04.0   1-edge      virtio3-rx
NMI:          0          0   Non-maskable interrupts
LOC:   47294051   47802183   Local timer interrupts
";

    #[test]
    fn the_slot_comes_from_the_uevent() {
        let uevent = "DRIVER=virtio-pci\nPCI_CLASS=18000\nPCI_SLOT_NAME=0000:00:02.0\n";
        assert_eq!(pci_slot(uevent), Some("0000:00:02.0"));
        assert_eq!(pci_slot("DRIVER=virtio_blk\n"), None);
    }

    #[test]
    fn the_lines_of_the_slot_are_summed_per_cpu() {
        assert_eq!(per_cpu(INTERRUPTS, "0000:00:02.0"), Some(vec![0, 15880636]));
        assert_eq!(per_cpu(INTERRUPTS, "0000:00:01.0"), Some(vec![3905, 0]));
        // A slot that has no line, and a prefix of one, are not found.
        assert_eq!(per_cpu(INTERRUPTS, "0000:00:09.0"), None);
        assert_eq!(per_cpu(INTERRUPTS, "0000:00:0"), None);
    }

    #[test]
    fn the_busiest_allowed_cpu_wins() {
        let counts = [5, 100, 100, 7];
        assert_eq!(busiest(&counts, &[0, 1, 2, 3]), Some(1), "first on a tie");
        assert_eq!(busiest(&counts, &[3, 0]), Some(3));
        assert_eq!(busiest(&counts, &[2, 1]), Some(2));
        // No interrupt on the allowed CPUs (or beyond the table): no answer.
        assert_eq!(busiest(&[0, 9], &[0, 4]), None);
    }

    /// A missing image has no answer (and the crate's own file system says
    /// what it has, for the log).
    #[test]
    fn a_missing_image_has_no_answer() {
        let all: Vec<usize> = (0..1024).collect();
        let answer = busiest_cpu_of(Path::new(env!("CARGO_MANIFEST_DIR")), &all);
        eprintln!("the disk of this crate interrupts CPU {answer:?} most");
        assert_eq!(busiest_cpu_of(Path::new("/nonexistent"), &all), None);
    }
}

#!/usr/bin/env bash
# qemu-crashed-at-boot.sh - did QEMU crash on its own while the test guest booted?
#
# Usage: qemu-crashed-at-boot.sh QEMU_STDERR_LOG SERIAL_LOG
#
# Exit 0 when QEMU's stderr shows one of the assertions QEMU 10.0's TCG (smp > 1)
# now and then aborts on while the guest kernel boots, and the guest's console
# shows its init never started (so nothing of the test ran): in its MSI-X table
# emulation (msix_table_mmio_write: addr + size <= ...) and in its softmmu TLB
# (iotlb_to_section: section_index < d->map.sections_nb), each seen a few times
# in many suite runs on a loaded machine. That is the emulator crashing, not
# something the backend under test did, and the guest harnesses boot once more
# (scripts/run-guest.sh, tests/guest_migration.rs). Exit 1 otherwise: any other
# abort, or one after the guest's init started, is a failure to report.
set -uo pipefail
[ $# -eq 2 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
grep -Eq '(msix_table_mmio_write|iotlb_to_section): Assertion' "$1" 2>/dev/null || exit 1
! grep -q 'vqblk: init started' "$2" 2>/dev/null

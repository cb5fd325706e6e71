#!/usr/bin/env python3
"""check-image.py IMAGE --writers N - verify the guest's write pattern landed in IMAGE.

Recomputes the pattern scripts/guest-init.sh writes in vqblk.mode=rw and compares it
with a raw disk image (or any file / block device the backend served):

  writer W (0 <= W < N) owns REGION bytes at offset W * 2 * REGION
  (REGION = --region-kib rounded down to 64 KiB, as the guest does), and every
  512-byte sector with absolute LBA L in it holds
      "VQBLK seed=S writer=W lba=L|" + C * (511 - len(header)) + "\\n"
  with C = "abcdefghijklmnopqrstuvwxyz"[(L + 7*W + S) % 26].

Options mirror the guest's kernel parameters: --writers (vqblk.writers, default in
the guest = nproc = run-guest.sh --smp), --region-kib (vqblk.region_kib),
--seed (vqblk.seed).  With --discard, also check that the discard region
(DISCARD_KIB right after the writer regions) is all zeroes.

Exit 0 when everything matches; 1 with the first mismatching byte offset otherwise
(2 for usage errors / unreadable image).  stdlib only.
"""
import argparse
import sys

SECTOR = 512
CHUNK = 65536
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def sector(writer: int, lba: int, seed: int) -> bytes:
    h = f"VQBLK seed={seed} writer={writer} lba={lba}|"
    c = LETTERS[(lba + 7 * writer + seed) % 26]
    return (h + c * (511 - len(h)) + "\n").encode("ascii")


def pattern(writer: int, offset: int, length: int, seed: int) -> bytes:
    lba0 = offset // SECTOR
    return b"".join(sector(writer, lba0 + k, seed) for k in range(length // SECTOR))


def first_diff(a: bytes, b: bytes) -> int:
    """Index of the first differing byte (len of the shorter one if a prefix)."""
    n = min(len(a), len(b))
    for i in range(0, n, SECTOR):  # coarse then fine, to stay fast
        if a[i:i + SECTOR] != b[i:i + SECTOR]:
            for j in range(i, min(i + SECTOR, n)):
                if a[j] != b[j]:
                    return j
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("image")
    ap.add_argument("--writers", type=int, required=True)
    ap.add_argument("--region-kib", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--discard", action="store_true",
                    help="also check the discard region reads as zeroes")
    ap.add_argument("--discard-kib", type=int, default=1024)
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args()

    region = args.region_kib // 64 * CHUNK or CHUNK
    stride = 2 * region
    try:
        f = open(args.image, "rb")
    except OSError as e:
        print(f"check-image: {e}", file=sys.stderr)
        return 2
    with f:
        for w in range(args.writers):
            off = w * stride
            f.seek(off)
            got = f.read(region)
            exp = pattern(w, off, region, args.seed)
            if got != exp:
                at = off + first_diff(got, exp)
                lba = at // SECTOR
                print(f"check-image: MISMATCH writer {w}: first differing byte at offset {at} "
                      f"(lba {lba}); image has {got[(at - off) // SECTOR * SECTOR:][:40]!r}, "
                      f"expected {exp[(at - off) // SECTOR * SECTOR:][:40]!r}", file=sys.stderr)
                print(at)
                return 1
            if not args.quiet:
                print(f"check-image: writer {w}: {region} bytes at {off} OK")
        if args.discard:
            off = args.writers * stride
            length = args.discard_kib // 64 * CHUNK or CHUNK
            f.seek(off)
            got = f.read(length)
            zero = bytes(length)
            if got != zero:
                at = off + first_diff(got, zero)
                print(f"check-image: MISMATCH discard region: non-zero byte at offset {at}",
                      file=sys.stderr)
                print(at)
                return 1
            if not args.quiet:
                print(f"check-image: discard region: {length} bytes at {off} are zero")
    return 0


if __name__ == "__main__":
    sys.exit(main())

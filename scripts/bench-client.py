#!/usr/bin/env python3
"""Is the load generator the bottleneck? How many IOPS one `vqblk bench` job
thread issues, and its CPU per I/O, with libblkio wait mode `loop` against the
null backend (vqblk serve busy-polling, so the server is as fast as it gets, and
qemu-storage-daemon's null-co for comparison), next to the same client in native
io_uring mode on a tmpfs file (no device behind it). Figures, not a test.

Usage: scripts/bench-client.py [--runtime 5] [--repeats 3]
"""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (ROOT, ensure_tools, median_of, run_bench, start_qsd, start_vqblk,  # noqa: E402
                      stop, wait_socket)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    ensure_tools()
    work = tempfile.mkdtemp(prefix="bench-client-", dir=os.path.join(ROOT, "target"))
    shm = tempfile.mkdtemp(prefix="vqblk-bench-client-", dir="/dev/shm")
    tmpfs_file = os.path.join(shm, "f.raw")
    with open(tmpfs_file, "wb") as f:
        f.truncate(256 << 20)
    rows = []
    try:
        for name, start in [("vqblk serve null, --poll busy",
                             lambda s: start_vqblk("null", None, s, extra=["--poll", "busy"])),
                            ("qemu-storage-daemon null-co", lambda s: start_qsd("null", None, s))]:
            sock = os.path.join(work, f"{len(rows)}.sock")
            proc = start(sock)
            try:
                wait_socket(sock, proc)
                for depth in [1, 16]:
                    runs = [run_bench(f"unix:{sock}", depth, a.runtime, proc.pid,
                                      extra=["--libblkio_wait_mode=loop"]) for _ in range(a.repeats)]
                    rows.append((f"{name}, wait loop", depth, median_of(runs)))
            finally:
                stop(proc)
        for depth in [1, 16]:
            runs = [run_bench(f"file:{tmpfs_file}", depth, a.runtime, extra=["--direct=0"])
                    for _ in range(a.repeats)]
            rows.append(("native io_uring, tmpfs file", depth, median_of(runs)))
    finally:
        os.unlink(tmpfs_file)
        os.rmdir(shm)
    print("| client target | iodepth | IOPS (one job thread) | client CPU per I/O (us) | p50 (us) |")
    print("|---|---|---|---|---|")
    for name, depth, m in rows:
        print(f"| {name} | {depth} | {m['iops']:.0f} | {m['client_cpu_us_per_io']:.2f} | {m['p50_us']:.1f} |")


if __name__ == "__main__":
    main()

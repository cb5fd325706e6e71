#!/usr/bin/env python3
"""vqblk serve vs qemu-storage-daemon, same client, same run.

Starts `vqblk serve` and `qemu-storage-daemon` on the same backend (null, and an
O_DIRECT raw file), drives each with the same libblkio client (`vqblk bench`,
one job, 4k randread, iodepth 1 and 16), and the same workload straight on the
file with io_uring + O_DIRECT (no virtualization). Prints IOPS, p50/p99
completion latency and the server's CPU time per I/O (summed over all of its
threads from /proc/PID/task/*/stat), as medians over --repeats runs, plus the
ratios the targets are stated in. Figures, not a pass/fail test.

Usage: scripts/bench-serve.py [--runtime 10] [--repeats 3] [--out results.json]
"""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (ROOT, ensure_tools, make_image, median_of, run_bench, start_qsd,  # noqa: E402
                      start_vqblk, stop, versions, wait_socket)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch dir on a disk file system (default: under target/)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ensure_tools()
    work = a.dir or tempfile.mkdtemp(prefix="bench-serve-", dir=os.path.join(ROOT, "target"))
    image = os.path.join(work, "bench.raw")
    make_image(image)
    results = []
    for backend in ["null", "file"]:
        for server, start in [("vqblk", start_vqblk), ("qemu-storage-daemon", start_qsd)]:
            sock = os.path.join(work, f"{server}-{backend}.sock")
            if os.path.exists(sock):
                os.unlink(sock)
            proc = start(backend, image, sock)
            try:
                wait_socket(sock, proc)
                for depth in [1, 16]:
                    runs = [run_bench(f"unix:{sock}", depth, a.runtime, proc.pid) for _ in range(a.repeats)]
                    m = median_of(runs)
                    results.append({"server": server, "backend": backend, "iodepth": depth, **m, "runs": runs})
                    print(f"{server:20} {backend:5} qd{depth:<3} {m['iops']:10.0f} IOPS  p50 {m['p50_us']:7.1f} us"
                          f"  p99 {m['p99_us']:7.1f} us  server CPU {m['server_cpu_us_per_io']:6.2f} us/IO",
                          flush=True)
            finally:
                stop(proc)
    for depth in [1, 16]:
        runs = [run_bench(f"file:{image}", depth, a.runtime) for _ in range(a.repeats)]
        m = median_of(runs)
        results.append({"server": "native io_uring", "backend": "file", "iodepth": depth, **m, "runs": runs})
        print(f"{'native io_uring':20} file  qd{depth:<3} {m['iops']:10.0f} IOPS  p50 {m['p50_us']:7.1f} us"
              f"  p99 {m['p99_us']:7.1f} us", flush=True)

    def get(server, backend, depth, key):
        for r in results:
            if (r["server"], r["backend"], r["iodepth"]) == (server, backend, depth):
                return r[key]
        return float("nan")

    print("\n| server | backend | iodepth | IOPS | p50 (us) | p99 (us) | server CPU (us/IO) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        cpu = f"{r['server_cpu_us_per_io']:.2f}" if "server_cpu_us_per_io" in r else "-"
        print(f"| {r['server']} | {r['backend']} | {r['iodepth']} | {r['iops']:.0f} | {r['p50_us']:.1f} |"
              f" {r['p99_us']:.1f} | {cpu} |")
    q = "qemu-storage-daemon"
    ratios = {
        "null qd16 IOPS vqblk/qsd (target >= 1.3)": get("vqblk", "null", 16, "iops") / get(q, "null", 16, "iops"),
        "null qd1 server CPU per I/O vqblk/qsd (target <= 0.7)":
            get("vqblk", "null", 1, "server_cpu_us_per_io") / get(q, "null", 1, "server_cpu_us_per_io"),
        "file qd16 IOPS vqblk/native (target >= 0.97)":
            get("vqblk", "file", 16, "iops") / get("native io_uring", "file", 16, "iops"),
        "file qd16 IOPS qsd/native": get(q, "file", 16, "iops") / get("native io_uring", "file", 16, "iops"),
    }
    print()
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"versions": versions(), "runtime": a.runtime, "repeats": a.repeats, "results": results,
                       "ratios": ratios}, f, indent=2)


if __name__ == "__main__":
    main()

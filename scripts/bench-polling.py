#!/usr/bin/env python3
"""Polling modes of vqblk serve, and qemu-storage-daemon, on the same cells.

For each server configuration (vqblk with --poll off / classic (QEMU defaults)
/ weighted (poll-weight 3) / busy / adaptive, and qemu-storage-daemon with its
defaults) on the null backend and an O_DIRECT raw file, runs 4k randread and
randwrite with 1 and 2 jobs at iodepth 1, 4 and 16 through the same libblkio
client (`vqblk bench`), and reports IOPS, p99 completion latency and the
server's CPU seconds per second (all threads, from /proc). Medians over
--repeats runs. The summary compares adaptive against busy and weighted.
Figures, not a pass/fail test.

A backend "null:NS" is the null backend completing each request NS ns after
submission (vqblk --latency-ns, qemu-storage-daemon null-co latency-ns): a
device with a fixed latency, as a fast NVMe drive, where intervals are long
against a wake-up. Such cells are summarised apart from the issue's (null, file).

Usage: scripts/bench-polling.py [--runtime 3] [--repeats 1] [--out results.json]
       [--backends null,file] [--depths 1,4,16] [--jobs 1,2] [--rws randread,randwrite]
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (ROOT, ensure_tools, make_image, median_of, run_bench, start_qsd,  # noqa: E402
                      start_vqblk, stop, versions, wait_socket)

SERVERS = {
    "off": ["--poll", "off"],
    "classic": ["--poll", "classic", "--poll-max-ns", "32768"],
    "weighted": ["--poll", "weighted", "--poll-weight", "3"],
    "busy": ["--poll", "busy"],
    "adaptive": ["--poll", "adaptive"],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--backends", default="null,file")
    ap.add_argument("--rws", default="randread,randwrite")
    ap.add_argument("--jobs", default="1,2")
    ap.add_argument("--depths", default="1,4,16")
    ap.add_argument("--servers", default=",".join([*SERVERS, "qsd"]))
    ap.add_argument("--poll-max-ns", type=int, default=None,
                    help="poll-max-ns of the classic, weighted and adaptive servers (default: QEMU's 32768)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    servers_args = {k: list(v) for k, v in SERVERS.items()}
    if a.poll_max_ns is not None:
        servers_args["classic"] = ["--poll", "classic"]
        for k in ("classic", "weighted", "adaptive"):
            servers_args[k] += ["--poll-max-ns", str(a.poll_max_ns)]
    ensure_tools()
    work = tempfile.mkdtemp(prefix="bench-polling-", dir=os.path.join(ROOT, "target"))
    image = os.path.join(work, "bench.raw")
    make_image(image, 256)
    cells = [(rw, j, d) for rw in a.rws.split(",") for j in map(int, a.jobs.split(","))
             for d in map(int, a.depths.split(","))]
    max_jobs = max(j for _, j, _ in cells)
    results = []
    for backend in a.backends.split(","):
        # Every server of a backend runs at once (idle ones sleep: no queue is
        # attached between runs) and each cell is run on every server in turn,
        # so drifting host or storage speed hits all servers of a cell alike.
        procs = {}
        try:
            for server in a.servers.split(","):
                sock = os.path.join(work, f"{server}-{backend.replace(':', '-')}.sock")
                if os.path.exists(sock):
                    os.unlink(sock)
                if server == "qsd":
                    proc = start_qsd(backend, image, sock, queues=max_jobs, poll_max_ns=a.poll_max_ns)
                else:
                    proc = start_vqblk(backend, image, sock, queues=max_jobs, iothreads=1, extra=servers_args[server])
                procs[server] = (proc, sock)
                wait_socket(sock, proc)
            for rw, jobs, depth in cells:
                runs = {server: [] for server in procs}
                for _ in range(a.repeats):
                    for server, (proc, sock) in procs.items():
                        runs[server].append(run_bench(f"unix:{sock}", depth, a.runtime, proc.pid, rw=rw,
                                                      numjobs=jobs))
                for server, rs in runs.items():
                    m = median_of(rs)
                    results.append({"server": server, "backend": backend, "rw": rw, "jobs": jobs,
                                    "iodepth": depth, **m})
                    print(f"{server:9} {backend:4} {rw:9} j{jobs} qd{depth:<2} {m['iops']:9.0f} IOPS"
                          f"  p99 {m['p99_us']:8.1f} us  CPU {m['server_cpu_per_s']:5.2f} s/s", flush=True)
        finally:
            for proc, _ in procs.values():
                stop(proc)

    def cell(server, backend, rw, jobs, depth):
        for r in results:
            if (r["server"], r["backend"], r["rw"], r["jobs"], r["iodepth"]) == (server, backend, rw, jobs, depth):
                return r
        return None

    servers = a.servers.split(",")
    print("\n| backend | rw | jobs | iodepth | " + " | ".join(f"{s} IOPS / p99 us / CPU" for s in servers) + " |")
    print("|---|---|---|---|" + "---|" * len(servers))
    summary = []
    for backend in a.backends.split(","):
        for rw, jobs, depth in cells:
            row = []
            for s in servers:
                r = cell(s, backend, rw, jobs, depth)
                row.append(f"{r['iops']:.0f} / {r['p99_us']:.0f} / {r['server_cpu_per_s']:.2f}" if r else "-")
            print(f"| {backend} | {rw} | {jobs} | {depth} | " + " | ".join(row) + " |")
            ad, busy, wt = (cell(s, backend, rw, jobs, depth) for s in ("adaptive", "busy", "weighted"))
            if ad and busy and wt:
                summary.append({
                    "cell": f"{backend} {rw} j{jobs} qd{depth}",
                    "backend": backend,
                    "iops_vs_busy": ad["iops"] / busy["iops"],
                    "cpu_vs_busy": ad["server_cpu_per_s"] / busy["server_cpu_per_s"],
                    "cpu_per_io_vs_weighted": (ad["server_cpu_per_s"] / ad["iops"])
                    / (wt["server_cpu_per_s"] / wt["iops"]),
                })
    if summary:
        print("\n| cell | adaptive IOPS / busy | adaptive CPU / busy | adaptive CPU per I/O / weighted |")
        print("|---|---|---|---|")
        for s in summary:
            print(f"| {s['cell']} | {s['iops_vs_busy']:.2f} | {s['cpu_vs_busy']:.2f} | {s['cpu_per_io_vs_weighted']:.2f} |")
        groups = [("the issue's cells (null, file)", [s for s in summary if s["backend"] in ("null", "file")]),
                  ("device-latency cells (null:NS)", [s for s in summary if s["backend"] not in ("null", "file")])]
        for title, rows in groups:
            if not rows:
                continue
            n = len(rows)
            print(f"\n{title}:")
            print(f"min adaptive IOPS / busy: {min(s['iops_vs_busy'] for s in rows):.2f} (goal >= 0.95)")
            print(f"mean adaptive CPU / busy: {sum(s['cpu_vs_busy'] for s in rows) / n:.2f} (goal <= 0.75)")
            print(f"cells where adaptive CPU per I/O > weighted: "
                  f"{sum(1 for s in rows if s['cpu_per_io_vs_weighted'] > 1.0)} of {n}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"versions": versions(), "runtime": a.runtime, "repeats": a.repeats,
                       "poll_max_ns": a.poll_max_ns, "results": results,
                       "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()

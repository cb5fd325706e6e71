#!/usr/bin/env python3
"""Interleaved A/B of two vqblk binaries as servers, same client.

Both servers run at once (an idle one uses no CPU) on the same backend; the
client (`vqblk bench` of --client, default this tree's build) drives them in
turn, A B A B ..., 4k randread, one job. Cells: null QD1, null QD16, file
QD16 (O_DIRECT raw image). Prints per cell the medians of IOPS and server
CPU per I/O and the B/A ratios. Figures, not a pass/fail test.

    scripts/bench-ab.py --a OLD_BINARY --b NEW_BINARY [--runtime 5] [--repeats 5]
                        [--b-extra "--seccomp off"] [--b-env VQBLK_BENCH_TRACK=inflight]
                        [--out results.json]

--a-env/--b-env KEY=VALUE (repeatable) set a server's environment: e.g. the
same binary as A and B with B under VQBLK_BENCH_TRACK=inflight measures what
inflight tracking costs a frontend that negotiates it.
"""
import argparse
import json
import os
import shlex
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="server binary A (the baseline)")
    ap.add_argument("--b", required=True, help="server binary B")
    ap.add_argument("--a-extra", default="", help="extra serve flags for A")
    ap.add_argument("--b-extra", default="", help="extra serve flags for B")
    ap.add_argument("--a-env", action="append", default=[], metavar="KEY=VALUE", help="environment for A")
    ap.add_argument("--b-env", action="append", default=[], metavar="KEY=VALUE", help="environment for B")
    ap.add_argument("--client", default=benchlib.VQBLK, help="the vqblk binary whose bench drives both")
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cells", default="null:1,null:16,file:16", help="BACKEND:DEPTH,... (default: all three)")
    ap.add_argument("--wait-mode", choices=["block", "loop"], default="block",
                    help="the client's libblkio_wait_mode (default block)")
    ap.add_argument("--out")
    a = ap.parse_args()
    benchlib.VQBLK = a.client
    work = tempfile.mkdtemp(prefix="bench-ab-", dir=os.path.join(benchlib.ROOT, "target"))
    image = os.path.join(work, "bench.raw")
    cells = [(c.split(":")[0], int(c.split(":")[1])) for c in a.cells.split(",")]
    runs = {}
    if any(b == "file" for b, _ in cells):
        benchlib.make_image(image)
    for backend in sorted({b for b, _ in cells}, key=["null", "file"].index):
        procs = {}
        try:
            for side, binary, extra, env in [("A", a.a, a.a_extra, a.a_env), ("B", a.b, a.b_extra, a.b_env)]:
                sock = os.path.join(work, f"{side}-{backend}.sock")
                stats = os.path.join(work, f"{side}-{backend}.stats.json")
                extra = shlex.split(extra) + ["--stats-file", stats]
                procs[side] = (benchlib.start_vqblk(backend, image, sock, extra=extra, binary=binary,
                                                     env=dict(kv.split("=", 1) for kv in env)), sock, stats)
                benchlib.wait_socket(sock, procs[side][0])
            for rep in range(a.repeats):
                for be, depth in cells:
                    if be != backend:
                        continue
                    order = ["A", "B"] if rep % 2 == 0 else ["B", "A"]
                    for side in order:
                        p, sock, stats = procs[side]
                        extra = ["--libblkio_wait_mode", a.wait_mode, "--server-pid", str(p.pid),
                                 "--server-stats", stats]
                        r = benchlib.run_bench(f"unix:{sock}", depth, a.runtime, p.pid, extra=extra)
                        runs.setdefault((backend, depth, side), []).append(r)
                        print(f"{backend} qd{depth} {side} run {rep + 1}: {r['iops'] / 1e3:.1f}K IOPS, "
                              f"{r['server_cpu_us_per_io']:.2f} us CPU/IO, calls {r.get('calls_per_io', 0):.3f}/IO, "
                              f"client sleeps {r['client_sleeps_per_io']:.4f}/IO, p50 {r['p50_us']:.1f} us, "
                              f"p99 {r['p99_us']:.1f} us", flush=True)
        finally:
            for p, _, _ in procs.values():
                benchlib.stop(p)
    print(f"\nclient libblkio_wait_mode={a.wait_mode}")
    print("| cell | A IOPS | B IOPS | B/A IOPS | A CPU us/IO | B CPU us/IO | B/A CPU/IO |"
          " A sleeps/IO | B sleeps/IO | A calls/IO | B calls/IO | A p50/p99 us | B p50/p99 us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    table = []
    for backend, depth in cells:
        ma = benchlib.median_of(runs[(backend, depth, "A")])
        mb = benchlib.median_of(runs[(backend, depth, "B")])
        row = (backend, depth, ma["iops"], mb["iops"], mb["iops"] / ma["iops"], ma["server_cpu_us_per_io"],
               mb["server_cpu_us_per_io"], mb["server_cpu_us_per_io"] / ma["server_cpu_us_per_io"])
        table.append(row)
        print(f"| {backend} QD{depth} | {row[2] / 1e3:.1f}K | {row[3] / 1e3:.1f}K | {row[4]:.2f} | "
              f"{row[5]:.2f} | {row[6]:.2f} | {row[7]:.2f} | {ma['client_sleeps_per_io']:.4f} | "
              f"{mb['client_sleeps_per_io']:.4f} | {ma.get('calls_per_io', 0):.3f} | {mb.get('calls_per_io', 0):.3f} | "
              f"{ma['p50_us']:.1f}/{ma['p99_us']:.1f} | {mb['p50_us']:.1f}/{mb['p99_us']:.1f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "runs": {f"{k[0]}-qd{k[1]}-{k[2]}": v for k, v in runs.items()},
                       "versions": benchlib.versions()}, f, indent=1)


if __name__ == "__main__":
    main()

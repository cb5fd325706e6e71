#!/usr/bin/env python3
"""vqblk serve vs qemu-storage-daemon, same client, same run.

Starts `vqblk serve` and `qemu-storage-daemon` on the same backend (null, and an
O_DIRECT raw file), drives each with the same libblkio client (`vqblk bench`,
one job, 4k randread, iodepth 1 and 16), and the same workload straight on the
file with io_uring + O_DIRECT (no virtualization). Prints IOPS, p50/p99
completion latency, the server's CPU time per I/O (summed over all of its
threads from /proc/PID/task/*/stat), the guest notifications (calls) per I/O
(vqblk's own counters, --stats-file; "-" for qsd) and the client's sleeps per
I/O (the job thread's voluntary context switches), as medians over --repeats
runs, plus the ratios the targets are stated in. Figures, not a pass/fail test.
--wait-mode is the client's libblkio_wait_mode: block sleeps on completions
(like a guest waiting for interrupts), loop busy-polls.

--baseline BINARY adds that build of vqblk (e.g. the main branch's) as a
server of its own, "vqblk (baseline)", interleaved with the others, for
before/after tables; --servers picks a subset of the servers by name.

Usage: scripts/bench-serve.py [--runtime 10] [--repeats 3] [--wait-mode block|loop]
                              [--backends null,file] [--depths 1,16] [--out results.json]
                              [--baseline BINARY] [--servers vqblk,qemu-storage-daemon,...]
                              [--server-cpus 1] [--client-cpus 0]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (ROOT, ensure_tools, make_image, median_of, run_bench, start_qsd,  # noqa: E402
                      start_vqblk, stop, versions, wait_socket)


def cacheline_rtt(cpus):
    """The cache-line round trip between two CPUs in ns (scripts/cacheline-rtt.sh), NaN if it failed."""
    out = subprocess.run([os.path.join(ROOT, "scripts", "cacheline-rtt.sh"), *cpus],
                         capture_output=True, text=True).stdout
    try:
        return float(out.split(": ")[1].split()[0])
    except (IndexError, ValueError):
        return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch dir on a disk file system (default: under target/)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--wait-mode", choices=["block", "loop"], default="block",
                    help="the client's libblkio_wait_mode (default block)")
    ap.add_argument("--backends", default="null,file", help="comma-separated subset of null,file")
    ap.add_argument("--depths", default="1,16", help="comma-separated iodepths")
    ap.add_argument("--baseline", default=None, help="another vqblk binary to run as 'vqblk (baseline)'")
    ap.add_argument("--servers", default=None,
                    help="comma-separated server names to run (default: all of them)")
    ap.add_argument("--server-cpus", default=None,
                    help="taskset CPU list for every server (issue 16 pins the server to CPU 1)")
    ap.add_argument("--client-cpus", default=None, help="taskset CPU list for the client")
    a = ap.parse_args()
    sc = a.server_cpus
    # One server CPU and one client CPU: their cache-line round trip is
    # measured around each run.
    rtt_cpus = [a.server_cpus, a.client_cpus] if all(
        c is not None and c.isdigit() for c in (a.server_cpus, a.client_cpus)) else None
    backends = [b for b in a.backends.split(",") if b]
    depths = [int(d) for d in a.depths.split(",") if d]
    ensure_tools()
    work = a.dir or tempfile.mkdtemp(prefix="bench-serve-", dir=os.path.join(ROOT, "target"))
    image = os.path.join(work, "bench.raw")
    make_image(image)
    def stats_file(server, backend):
        return os.path.join(work, f"{server.replace(' ', '_')}-{backend}.stats.json")

    servers = [
        ("vqblk", lambda b, i, s: start_vqblk(b, i, s, extra=["--stats-file", stats_file("vqblk", b)], cpus=sc)),
        ("vqblk --poll off", lambda b, i, s: start_vqblk(
            b, i, s, extra=["--poll", "off", "--stats-file", stats_file("vqblk --poll off", b)], cpus=sc)),
        ("qemu-storage-daemon", lambda b, i, s: start_qsd(b, i, s, cpus=sc)),
    ]
    if a.baseline:
        servers.insert(1, ("vqblk (baseline)", lambda b, i, s: start_vqblk(
            b, i, s, binary=a.baseline, extra=["--stats-file", stats_file("vqblk (baseline)", b)], cpus=sc)))
    if a.servers:
        wanted = a.servers.split(",")
        servers = [s for s in servers if s[0] in wanted]
    runs = {}
    for backend in backends:
        # All servers of a backend run at once (idle ones use no CPU), and the
        # runs are interleaved, so drifting host or storage speed hits every
        # server alike; the native baseline is interleaved too.
        procs = {}
        try:
            for server, start in servers:
                sock = os.path.join(work, f"{server.replace(' ', '_')}-{backend}.sock")
                if os.path.exists(sock):
                    os.unlink(sock)
                procs[server] = (start(backend, image, sock), sock)
                wait_socket(sock, procs[server][0])
            targets = [(name, f"unix:{sock}", p.pid) for name, (p, sock) in procs.items()]
            # vqblk's own counters (calls per I/O) come from its stats file.
            counters = {name: ["--server-pid", str(p.pid), "--server-stats", stats_file(name, backend)]
                        for name, (p, _) in procs.items() if name.startswith("vqblk")}
            if backend == "file":
                targets.append(("native io_uring", f"file:{image}", None))
            for rep in range(a.repeats):
                for depth in depths:
                    for name, target, pid in targets:
                        extra = ["--libblkio_wait_mode", a.wait_mode] + counters.get(name, [])
                        rtt = cacheline_rtt(rtt_cpus) if rtt_cpus else None
                        r = run_bench(target, depth, a.runtime, pid, extra=extra, cpus=a.client_cpus)
                        if rtt_cpus:
                            # The host may place the two CPUs near or far, and
                            # every figure of the run follows: measured before
                            # and after it (docs/performance.md).
                            r["cacheline_rtt_before_ns"] = rtt
                            r["cacheline_rtt_after_ns"] = cacheline_rtt(rtt_cpus)
                        runs.setdefault((name, backend, depth), []).append(r)
                        cpu = f"  server CPU {r['server_cpu_us_per_io']:6.2f} us/IO" if pid else ""
                        if "calls_per_io" in r:
                            cpu += f"  calls {r['calls_per_io']:5.3f}/IO"
                        if target.startswith("unix:"):
                            cpu += f"  client sleeps {r['client_sleeps_per_io']:5.3f}/IO"
                        if rtt_cpus:
                            cpu += (f"  cache-line rtt {r['cacheline_rtt_before_ns']:.0f}"
                                    f"/{r['cacheline_rtt_after_ns']:.0f} ns")
                        print(f"[{rep + 1}/{a.repeats}] {name:20} {backend:5} qd{depth:<3} {r['iops']:10.0f} IOPS"
                              f"  p50 {r['p50_us']:7.1f} us  p99 {r['p99_us']:8.1f} us{cpu}", flush=True)
        finally:
            for p, _ in procs.values():
                stop(p)
    results = []
    for (name, backend, depth), rs in runs.items():
        results.append({"server": name, "backend": backend, "iodepth": depth, **median_of(rs), "runs": rs})

    def get(server, backend, depth, key):
        for r in results:
            if (r["server"], r["backend"], r["iodepth"]) == (server, backend, depth):
                return r[key]
        return float("nan")

    print(f"\nclient libblkio_wait_mode={a.wait_mode}")
    print("| server | backend | iodepth | IOPS | p50 (us) | p99 (us) | server CPU (ns/IO) | calls/IO |"
          " client sleeps/IO | pop->publish (ns) | publish->call (ns) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["backend"], r["iodepth"])):
        cpu = f"{r['server_cpu_us_per_io'] * 1000:.0f}" if "server_cpu_us_per_io" in r else "-"
        calls = f"{r['calls_per_io']:.3f}" if "calls_per_io" in r else "-"
        sleeps = f"{r['client_sleeps_per_io']:.3f}" if r["server"] != "native io_uring" else "-"
        pub = f"{r['pop_to_publish_ns']:.0f}" if "pop_to_publish_ns" in r else "-"
        call = f"{r['publish_to_call_ns']:.0f}" if "publish_to_call_ns" in r else "-"
        print(f"| {r['server']} | {r['backend']} | {r['iodepth']} | {r['iops']:.0f} | {r['p50_us']:.1f} |"
              f" {r['p99_us']:.1f} | {cpu} | {calls} | {sleeps} | {pub} | {call} |")
    q = "qemu-storage-daemon"
    ratios = {
        "null qd16 IOPS vqblk/qsd (target >= 1.3)": get("vqblk", "null", 16, "iops") / get(q, "null", 16, "iops"),
        "null qd1 server CPU per I/O vqblk/qsd (target <= 0.7)":
            get("vqblk", "null", 1, "server_cpu_us_per_io") / get(q, "null", 1, "server_cpu_us_per_io"),
        "null qd1 server CPU per I/O vqblk --poll off/qsd (target <= 0.7)":
            get("vqblk --poll off", "null", 1, "server_cpu_us_per_io") / get(q, "null", 1, "server_cpu_us_per_io"),
        "null qd16 IOPS vqblk --poll off/qsd": get("vqblk --poll off", "null", 16, "iops") / get(q, "null", 16, "iops"),
        "file qd16 IOPS vqblk/native (target >= 0.97)":
            get("vqblk", "file", 16, "iops") / get("native io_uring", "file", 16, "iops"),
        "file qd16 IOPS vqblk --poll off/native":
            get("vqblk --poll off", "file", 16, "iops") / get("native io_uring", "file", 16, "iops"),
        "file qd16 IOPS qsd/native": get(q, "file", 16, "iops") / get("native io_uring", "file", 16, "iops"),
    }
    print()
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"versions": versions(), "runtime": a.runtime, "repeats": a.repeats,
                       "wait_mode": a.wait_mode, "results": results,
                       "ratios": ratios}, f, indent=2)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Fairness between exports that share an IOThread (issue 11, "Fairness").

Two null exports on ONE IOThread: `flood` (several queues, each driven by a job
at a large iodepth) and `victim` (one queue, iodepth 1). The victim's p50/p99
completion latency is measured alone and under the flood, interleaved, medians
of --repeats runs; the verdict is p99 under flood / p99 alone (goal <= 2).

    scripts/bench-fairness.py [--runtime 5] [--repeats 3] [--latency-ns 0]
                              [--flood-jobs 1] [--flood-iodepth 64] [--vqblk PATH]
                              [--server-cpu 1] [--client-cpus 0]

On a 2-core machine every client thread competes for the client CPU: with
more flood jobs than client cores the victim's latency measures the client's
scheduler, not the server. Hence one flood job by default.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402


def config(d, latency_ns, flood_queues, server_cpu):
    extra = f"latency-ns = {latency_ns}\n" if latency_ns else ""
    pin = f'[[iothreads.thread]]\nid = 0\ncpuset = "{server_cpu}"\n' if server_cpu else ""
    return f"""
[iothreads]
count = 1
{pin}
[[export]]
name = "flood"
backend = "null"
size = "1G"
socket = "{d}/flood.sock"
queues = {flood_queues}
{extra}
[[export]]
name = "victim"
backend = "null"
size = "1G"
socket = "{d}/victim.sock"
queues = 1
{extra}"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--latency-ns", type=int, default=0)
    ap.add_argument("--flood-jobs", type=int, default=1)
    ap.add_argument("--flood-iodepth", type=int, default=64)
    ap.add_argument("--server-cpu", default="1", help="pin the IOThread here ('' for no pinning)")
    ap.add_argument("--client-cpus", default="0", help="run the clients on these CPUs ('' for anywhere)")
    ap.add_argument("--vqblk", default=benchlib.VQBLK, help="the vqblk binary (server and client)")
    ap.add_argument("--json", help="write the raw runs here")
    a = ap.parse_args()
    benchlib.VQBLK = a.vqblk
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "vqblk.toml")
        with open(cfg, "w") as f:
            f.write(config(d, a.latency_ns, a.flood_jobs, a.server_cpu))
        if a.client_cpus:
            os.sched_setaffinity(0, {int(c) for c in a.client_cpus.split(",")})
        server = subprocess.Popen(["taskset", "-c", a.server_cpu or "0-1023", a.vqblk, "serve", "--config", cfg, "--log-level", "warn"])
        try:
            benchlib.wait_socket(f"{d}/victim.sock", server)
            benchlib.wait_socket(f"{d}/flood.sock", server)
            alone, flooded = [], []
            for rep in range(a.repeats):
                alone.append(benchlib.run_bench(f"unix:{d}/victim.sock", 1, a.runtime))
                flood_out = {}

                def flood():
                    flood_out["r"] = benchlib.run_bench(f"unix:{d}/flood.sock", a.flood_iodepth,
                                                        a.runtime + 2, numjobs=a.flood_jobs)

                t = threading.Thread(target=flood)
                t.start()
                r = benchlib.run_bench(f"unix:{d}/victim.sock", 1, a.runtime)
                t.join()
                r["flood_iops"] = flood_out["r"]["iops"]
                flooded.append(r)
                print(f"run {rep + 1}: victim alone p99 {alone[-1]['p99_us']:.1f} us, "
                      f"under flood p99 {r['p99_us']:.1f} us (flood {r['flood_iops'] / 1e3:.0f}K IOPS)",
                      flush=True)
        finally:
            benchlib.stop(server)
    ma, mf = benchlib.median_of(alone), benchlib.median_of(flooded)
    print(f"\nvictim (qd1) alone:       {ma['iops'] / 1e3:8.1f}K IOPS  p50 {ma['p50_us']:7.1f} us  p99 {ma['p99_us']:7.1f} us")
    print(f"victim under flood:       {mf['iops'] / 1e3:8.1f}K IOPS  p50 {mf['p50_us']:7.1f} us  p99 {mf['p99_us']:7.1f} us"
          f"  (flood: {a.flood_jobs} jobs x qd{a.flood_iodepth}, {mf['flood_iops'] / 1e3:.0f}K IOPS)")
    print(f"p99 ratio (goal <= 2.0): {mf['p99_us'] / ma['p99_us']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"alone": alone, "flooded": flooded, "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""vqblk's benchmark driver: one client (`vqblk bench`, libblkio's
virtio-blk driver, the same code as fio's libblkio engine) against vqblk and
other servers, runs interleaved so that a drifting host hits every server
alike, medians over --repeats runs. Figures, not pass/fail tests.

Subcommands:
  serve     vqblk against qemu-storage-daemon and native io_uring, null and
            O_DIRECT file, QD1/QD16; --baseline BINARY adds another vqblk
            build for an A/B (medians and ratios per cell)
  polling   the polling modes (off, classic, weighted, busy, adaptive) and
            qemu-storage-daemon on the same cells
  client    is the load generator the bottleneck? one job's IOPS and CPU
  fairness  a victim export's latency next to a flooding export on one IOThread
  rbd       vqblk's rbd backend against qemu-storage-daemon's and native
            librbd, on a throw-away local Ceph cluster
  qos       I/O limits: measured rates against the limits, bursts second by
            second beside qemu-storage-daemon, a throttle group of three, CPU
            per I/O at a limit; reservations and weights on one disk
  phases    --iothreads auto against fixed IOThread counts on a workload that
            switches phase (one queue at QD1, four at QD32)

`scripts/bench.py SUBCOMMAND --help` lists each one's options. Every
subcommand builds `target/release/vqblk` if it is missing.
"""
import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from benchlib import (ROOT, cacheline_rtt, client_series, ensure_tools, make_image, median_of,  # noqa: E402
                      qsd_throttle_args, rotated, run_bench, serving, start_qsd, start_vqblk, stop, versions,
                      wait_socket)

SERVE_HELP = """vqblk serve against qemu-storage-daemon, same client, same run.

Starts `vqblk serve` (adaptive polling, and `--poll off`) and
`qemu-storage-daemon` on the same backend (null, and an O_DIRECT raw file),
drives each with the same libblkio client (one job, 4k randread, iodepth 1 and
16), and the same workload straight on the file with io_uring + O_DIRECT (no
virtualization). Prints IOPS, p50/p99 completion latency, the server's CPU
time per I/O (summed over all of its threads from /proc/PID/task/*/stat), the
guest notifications (calls) per I/O (vqblk's own counters, --stats-file; "-"
for qsd) and the client's sleeps per I/O (the job thread's voluntary context
switches), as medians over --repeats runs, plus the ratios the targets are
stated in. --wait-mode is the client's libblkio_wait_mode: block sleeps on
completions (like a guest waiting for interrupts), loop busy-polls.

Before and after every run the cache-line round trip between the server's
and the client's CPU is measured (scripts/cacheline-rtt.sh; CPUs 0 and 1 when
not pinned): the host may place two vCPUs near or far, every cross-CPU figure
follows, and only runs in the same mode compare (docs/performance.md).

SPDK's vhost target (--servers ...,spdk; built by ../shared/peers/, see its
README) serves a null bdev or an aio bdev on the same file; it is started for
its own runs only, since its reactor spins a whole core (the server CPU), and
the ratios then include vqblk/SPDK IOPS and IOPS per server core per cell.

A/B of two builds: --baseline BINARY adds that vqblk as "vqblk (baseline)",
interleaved with the others (the order of the servers rotates every repeat),
and prints per cell the medians of both and their ratios. For the A/B alone:
--servers vqblk,baseline --cells null:1,null:16,file:16.
"""


SHORT_NAMES = {"baseline": "vqblk (baseline)", "poll-off": "vqblk --poll off", "qsd": "qemu-storage-daemon",
               "native": "native io_uring", "spdk": "SPDK vhost"}


def rtt_cpus_of(a):
    """The two CPUs of the cache-line round trip (--rtt-cpus, --server-cpus and
    --client-cpus), or None when it cannot be taken."""
    if a.rtt_cpus:
        return a.rtt_cpus.split(",")
    if all(c is not None and c.isdigit() for c in (a.server_cpus, a.client_cpus)):
        return [a.server_cpus, a.client_cpus]
    if (os.cpu_count() or 1) >= 2 and not (a.server_cpus or a.client_cpus):
        return ["0", "1"]
    return None


def serve(a):
    wanted = [SHORT_NAMES.get(s, s) for s in a.servers.split(",")] if a.servers else None
    ensure_tools(qsd=not wanted or "qemu-storage-daemon" in wanted)
    benchlib.VQBLK = a.client or benchlib.VQBLK
    binary = a.vqblk
    sc = a.server_cpus
    rtt_cpus = rtt_cpus_of(a)
    if a.cells:
        cells = [(c.split(":")[0], int(c.split(":")[1])) for c in a.cells.split(",") if c]
    else:
        cells = [(b, int(d)) for b in a.backends.split(",") if b for d in a.depths.split(",") if d]
    backends = sorted({b for b, _ in cells}, key=["null", "file"].index)
    work = a.dir or tempfile.mkdtemp(prefix="bench-serve-", dir=os.path.join(ROOT, "target"))
    image = os.path.join(work, "bench.raw")
    if "file" in backends:
        make_image(image)

    def stats_file(server, backend):
        return os.path.join(work, f"{server.replace(' ', '_')}-{backend}.stats.json")

    def vqblk(name, extra, binary):
        return (name, lambda b, i, s: start_vqblk(b, i, s, binary=binary, cpus=sc, read_zeroes=zeroes,
                                                  extra=extra + ["--stats-file", stats_file(name, b)]))

    extra = shlex.split(a.extra)
    zeroes = a.read_zeroes == "on"
    servers = [
        vqblk("vqblk", extra, binary),
        vqblk("vqblk --poll off", extra + ["--poll", "off"], binary),
        ("qemu-storage-daemon", lambda b, i, s: start_qsd(b, i, s, cpus=sc, read_zeroes=zeroes)),
    ]
    if a.baseline:
        servers.insert(1, vqblk("vqblk (baseline)", shlex.split(a.baseline_extra), a.baseline))
    if wanted and "SPDK vhost" in wanted:
        # Opt-in: SPDK's target from ../shared/peers/ (its reactor spins one core).
        servers.append(("SPDK vhost", lambda b, i, s: benchlib.start_spdk(b, i, s, a.spdk_held, a.spdk_script,
                                                                        cpus=sc)))
    if wanted:
        servers = [s for s in servers if s[0] in wanted]
    runs = {}
    for backend in backends:
        # All servers of a backend run at once (idle ones use no CPU).
        procs = {}
        try:
            for server, start in servers:
                if server == "SPDK vhost":
                    continue  # started for its own runs only: it spins a core
                sock = os.path.join(work, f"{server.replace(' ', '_')}-{backend}.sock")
                if os.path.exists(sock):
                    os.unlink(sock)
                procs[server] = (start(backend, image, sock), sock)
                wait_socket(sock, procs[server][0])
            targets = [(name, f"unix:{sock}", p.pid) for name, (p, sock) in procs.items()]
            spdk = next((start for server, start in servers if server == "SPDK vhost"), None)
            if spdk:
                # SPDK runs chrooted: its socket lies inside the chroot.
                spdk_sock = os.path.join(benchlib.spdk_root(a.spdk_held), "tmp", f"bench-{backend}.sock")
                targets.append(("SPDK vhost", f"unix:{spdk_sock}", None))
            # vqblk's own counters (calls per I/O) come from its stats file.
            counters = {name: ["--server-pid", str(p.pid), "--server-stats", stats_file(name, backend)]
                        for name, (p, _) in procs.items() if name.startswith("vqblk")}
            if backend == "file" and (not wanted or "native io_uring" in wanted):
                targets.append(("native io_uring", f"file:{image}", None))
            if not targets:
                continue
            for rep in range(a.repeats):
                k = rep % len(targets)
                for be, depth in cells:
                    if be != backend:
                        continue
                    for name, target, pid in targets[k:] + targets[:k]:
                        extra_args = ["--libblkio_wait_mode", a.wait_mode] + counters.get(name, [])
                        wrapper = None
                        if name == "SPDK vhost":
                            wrapper = spdk(backend, image, target[len("unix:"):])
                            pid = benchlib.spdk_pid(wrapper)
                            wait_socket(target[len("unix:"):], wrapper, timeout=60)
                        rtt = cacheline_rtt(rtt_cpus) if rtt_cpus else None
                        try:
                            r = run_bench(target, depth, a.runtime, pid, extra=extra_args, cpus=a.client_cpus)
                        finally:
                            if wrapper:
                                stop(wrapper)
                        if rtt_cpus:
                            r["cacheline_rtt_before_ns"] = rtt
                            r["cacheline_rtt_after_ns"] = cacheline_rtt(rtt_cpus)
                        runs.setdefault((name, backend, depth), []).append(r)
                        cpu = f"  server CPU {r['server_cpu_us_per_io']:6.2f} us/IO" if pid else ""
                        if "calls_per_io" in r:
                            cpu += f"  calls {r['calls_per_io']:5.3f}/IO"
                        if target.startswith("unix:"):
                            cpu += f"  client sleeps {r['client_sleeps_per_io']:6.4f}/IO"
                        if rtt_cpus:
                            cpu += (f"  cache-line rtt {r['cacheline_rtt_before_ns']:.0f}"
                                    f"/{r['cacheline_rtt_after_ns']:.0f} ns")
                        print(f"[{rep + 1}/{a.repeats}] {name:20} {backend:5} qd{depth:<3} {r['iops']:10.0f} IOPS"
                              f"  p50 {r['p50_us']:7.1f} us  p99 {r['p99_us']:8.1f} us{cpu}", flush=True)
        finally:
            for p, _ in procs.values():
                stop(p)
    results = [{"server": n, "backend": b, "iodepth": d, **median_of(rs), "runs": rs}
               for (n, b, d), rs in runs.items()]

    def get(server, backend, depth, key):
        for r in results:
            if (r["server"], r["backend"], r["iodepth"]) == (server, backend, depth):
                return r.get(key, float("nan"))
        return float("nan")

    def ratio(x, y):
        return x / y if y else float("nan")

    print(f"\nclient libblkio_wait_mode={a.wait_mode}")
    print("| server | backend | iodepth | IOPS | p50 (us) | p99 (us) | server CPU (ns/IO) | calls/IO |"
          " client sleeps/IO | cache-line rtt (ns) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["backend"], r["iodepth"])):
        cpu = f"{r['server_cpu_us_per_io'] * 1000:.0f}" if "server_cpu_us_per_io" in r else "-"
        calls = f"{r['calls_per_io']:.3f}" if "calls_per_io" in r else "-"
        sleeps = f"{r['client_sleeps_per_io']:.4f}" if r["server"] != "native io_uring" else "-"
        rtt = (f"{r['cacheline_rtt_before_ns']:.0f}/{r['cacheline_rtt_after_ns']:.0f}"
               if "cacheline_rtt_before_ns" in r else "-")
        print(f"| {r['server']} | {r['backend']} | {r['iodepth']} | {r['iops']:.0f} | {r['p50_us']:.1f} |"
              f" {r['p99_us']:.1f} | {cpu} | {calls} | {sleeps} | {rtt} |")
    q, n = "qemu-storage-daemon", "native io_uring"
    ratios = {
        "null qd16 IOPS vqblk/qsd": ratio(get("vqblk", "null", 16, "iops"), get(q, "null", 16, "iops")),
        "null qd1 server CPU per I/O vqblk/qsd":
            ratio(get("vqblk", "null", 1, "server_cpu_us_per_io"), get(q, "null", 1, "server_cpu_us_per_io")),
        "null qd1 server CPU per I/O vqblk --poll off/qsd":
            ratio(get("vqblk --poll off", "null", 1, "server_cpu_us_per_io"),
                  get(q, "null", 1, "server_cpu_us_per_io")),
        "null qd16 IOPS vqblk --poll off/qsd":
            ratio(get("vqblk --poll off", "null", 16, "iops"), get(q, "null", 16, "iops")),
        "file qd16 IOPS vqblk/native": ratio(get("vqblk", "file", 16, "iops"), get(n, "file", 16, "iops")),
        "file qd16 IOPS vqblk --poll off/native":
            ratio(get("vqblk --poll off", "file", 16, "iops"), get(n, "file", 16, "iops")),
        "file qd16 IOPS qsd/native": ratio(get(q, "file", 16, "iops"), get(n, "file", 16, "iops")),
    }
    sp = "SPDK vhost"
    for backend, depth in cells:
        # Per server core: SPDK's reactor always spins a whole one.
        ratios[f"{backend} qd{depth} IOPS vqblk/SPDK"] = ratio(get("vqblk", backend, depth, "iops"),
                                                             get(sp, backend, depth, "iops"))
        ratios[f"{backend} qd{depth} IOPS per server core vqblk/SPDK"] = ratio(
            ratio(get("vqblk", backend, depth, "iops"), get("vqblk", backend, depth, "server_cpu_per_s")),
            ratio(get(sp, backend, depth, "iops"), get(sp, backend, depth, "server_cpu_per_s")))
    print()
    for k, v in ratios.items():
        if v == v:  # not NaN: both cells ran
            print(f"{k}: {v:.2f}")
    ab = []
    if a.baseline:
        b = "vqblk (baseline)"
        print("\nA/B: vqblk (B) against vqblk (baseline) (A), medians")
        print("| cell | A IOPS | B IOPS | B/A IOPS | A CPU us/IO | B CPU us/IO | B/A CPU/IO |"
              " A sleeps/IO | B sleeps/IO | A calls/IO | B calls/IO | A p50/p99 us | B p50/p99 us |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for backend, depth in cells:
            g = {s: {k: get(s, backend, depth, k) for k in ("iops", "server_cpu_us_per_io", "client_sleeps_per_io",
                                                           "calls_per_io", "p50_us", "p99_us")}
                 for s in ("vqblk", b)}
            A, B = g[b], g["vqblk"]
            row = {"cell": f"{backend} qd{depth}", "iops_b_over_a": ratio(B["iops"], A["iops"]),
                   "cpu_per_io_b_over_a": ratio(B["server_cpu_us_per_io"], A["server_cpu_us_per_io"])}
            ab.append(row)
            print(f"| {backend} QD{depth} | {A['iops'] / 1e3:.1f}K | {B['iops'] / 1e3:.1f}K | {row['iops_b_over_a']:.2f}"
                  f" | {A['server_cpu_us_per_io']:.2f} | {B['server_cpu_us_per_io']:.2f} |"
                  f" {row['cpu_per_io_b_over_a']:.2f} | {A['client_sleeps_per_io']:.4f} |"
                  f" {B['client_sleeps_per_io']:.4f} | {A['calls_per_io']:.3f} | {B['calls_per_io']:.3f} |"
                  f" {A['p50_us']:.1f}/{A['p99_us']:.1f} | {B['p50_us']:.1f}/{B['p99_us']:.1f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"versions": versions(), "args": vars(a), "results": results, "ratios": ratios,
                       "ab": ab}, f, indent=2, default=str)


POLLING_HELP = """Polling modes of vqblk serve, and qemu-storage-daemon, on the same cells.

For each server configuration (vqblk with --poll off / classic (QEMU defaults)
/ weighted (poll-weight 3) / busy / adaptive, and qemu-storage-daemon with its
defaults) on the null backend and an O_DIRECT raw file, runs 4k randread and
randwrite with 1 and 2 jobs at iodepth 1, 4 and 16 through the same libblkio
client, and reports IOPS, p99 completion latency and the server's CPU seconds
per second (all threads, from /proc). The summary compares adaptive against
busy and weighted, and says in which cells another mode dominates the default
(more than 3% more IOPS at more than 3% less server CPU). --wait-modes adds
the client's polling mode (loop) beside its sleeping one (block); pin the
servers and the client (--server-cpus 1 --client-cpus 0) to compare with
`serve`, and the cache-line round trip is printed per cell.

A backend "null:NS" is the null backend completing each request NS ns after
submission (vqblk --latency-ns, qemu-storage-daemon null-co latency-ns): a
device with a fixed latency, as a fast NVMe drive, where intervals are long
against a wake-up. Such cells are summarised apart from null and file.
"""

POLL_SERVERS = {
    "off": ["--poll", "off"],
    "classic": ["--poll", "classic", "--poll-max-ns", "32768"],
    "weighted": ["--poll", "weighted", "--poll-weight", "3"],
    "busy": ["--poll", "busy"],
    "adaptive": ["--poll", "adaptive"],
}

# How much more IOPS at how much less CPU another polling mode must show to
# dominate the default in a cell: less is within a run's spread here.
DOMINANCE_MARGIN = 0.03


def polling(a):
    ensure_tools()
    servers_args = {k: list(v) for k, v in POLL_SERVERS.items()}
    if a.poll_max_ns is not None:
        servers_args["classic"] = ["--poll", "classic"]
        for k in ("classic", "weighted", "adaptive"):
            servers_args[k] += ["--poll-max-ns", str(a.poll_max_ns)]
    work = tempfile.mkdtemp(prefix="bench-polling-", dir=os.path.join(ROOT, "target"))
    image = os.path.join(work, "bench.raw")
    if "file" in a.backends.split(","):
        make_image(image, 256)
    cells = [(rw, j, d, w) for rw in a.rws.split(",") for j in map(int, a.jobs.split(","))
             for d in map(int, a.depths.split(",")) for w in a.wait_modes.split(",")]
    max_jobs = max(j for _, j, _, _ in cells)
    rtt_cpus = rtt_cpus_of(a)
    results = []
    for backend in a.backends.split(","):
        # Every server of a backend runs at once (idle ones sleep: no queue is
        # attached between runs) and each cell is run on every server in turn.
        procs = {}
        try:
            for server in a.servers.split(","):
                sock = os.path.join(work, f"{server}-{backend.replace(':', '-')}.sock")
                if os.path.exists(sock):
                    os.unlink(sock)
                if server == "qsd":
                    proc = start_qsd(backend, image, sock, queues=max_jobs, poll_max_ns=a.poll_max_ns,
                                     cpus=a.server_cpus)
                elif server == "baseline":
                    proc = start_vqblk(backend, image, sock, queues=max_jobs, iothreads=1,
                                       extra=a.baseline_extra.split(), binary=a.baseline, cpus=a.server_cpus)
                else:
                    proc = start_vqblk(backend, image, sock, queues=max_jobs, iothreads=1,
                                       extra=servers_args[server], binary=a.vqblk, cpus=a.server_cpus)
                procs[server] = (proc, sock)
                wait_socket(sock, proc)
            order = list(procs)
            for rw, jobs, depth, wait in cells:
                runs = {server: [] for server in procs}
                rtts = []
                for rep in range(a.repeats):
                    # The order rotates with the repeat: no server always runs
                    # first, right after another one's load.
                    for server in rotated(order, rep):
                        proc, sock = procs[server]
                        if rtt_cpus:
                            rtts.append(cacheline_rtt(rtt_cpus))
                        runs[server].append(run_bench(f"unix:{sock}", depth, a.runtime, proc.pid, rw=rw,
                                                      numjobs=jobs, cpus=a.client_cpus,
                                                      extra=["--libblkio_wait_mode", wait]))
                if rtt_cpus:
                    rtts.append(cacheline_rtt(rtt_cpus))
                rtt = f"  cache-line rtt {min(rtts):.0f}-{max(rtts):.0f} ns" if rtts else ""
                for server, rs in runs.items():
                    m = median_of(rs)
                    results.append({"server": server, "backend": backend, "rw": rw, "jobs": jobs,
                                    "iodepth": depth, "wait_mode": wait, "cacheline_rtt_ns": rtts, **m})
                    print(f"{server:9} {backend:4} {rw:9} j{jobs} qd{depth:<2} {wait:5} {m['iops']:9.0f} IOPS"
                          f"  p99 {m['p99_us']:8.1f} us  CPU {m['server_cpu_per_s']:5.2f} s/s{rtt}", flush=True)
        finally:
            for proc, _ in procs.values():
                stop(proc)

    def cell(server, backend, rw, jobs, depth, wait):
        for r in results:
            if (r["server"], r["backend"], r["rw"], r["jobs"], r["iodepth"], r["wait_mode"]) == \
                    (server, backend, rw, jobs, depth, wait):
                return r
        return None

    servers = a.servers.split(",")
    print("\n| backend | rw | jobs | iodepth | client | " + " | ".join(f"{s} IOPS / p99 us / CPU" for s in servers)
          + " |")
    print("|---|---|---|---|---|" + "---|" * len(servers))
    summary = []
    dominance = []
    for backend in a.backends.split(","):
        for rw, jobs, depth, wait in cells:
            row = []
            for s in servers:
                r = cell(s, backend, rw, jobs, depth, wait)
                row.append(f"{r['iops']:.0f} / {r['p99_us']:.0f} / {r['server_cpu_per_s']:.2f}" if r else "-")
            print(f"| {backend} | {rw} | {jobs} | {depth} | {wait} | " + " | ".join(row) + " |")
            label = f"{backend} {rw} j{jobs} qd{depth} {wait}"
            ad, busy, wt = (cell(s, backend, rw, jobs, depth, wait) for s in ("adaptive", "busy", "weighted"))
            if ad and busy and wt:
                summary.append({
                    "cell": label,
                    "backend": backend,
                    "iops_vs_busy": ad["iops"] / busy["iops"],
                    "cpu_vs_busy": ad["server_cpu_per_s"] / busy["server_cpu_per_s"],
                    "cpu_per_io_vs_weighted": (ad["server_cpu_per_s"] / ad["iops"])
                    / (wt["server_cpu_per_s"] / wt["iops"]),
                })
            if ad:
                # Another mode dominates the default where it does more than
                # DOMINANCE_MARGIN more IOPS at more than DOMINANCE_MARGIN less
                # server CPU (cores).
                others = {s: cell(s, backend, rw, jobs, depth, wait) for s in POLL_SERVERS if s != "adaptive"}
                ratios = {s: (r["iops"] / ad["iops"], r["server_cpu_per_s"] / ad["server_cpu_per_s"])
                          for s, r in others.items() if r}
                dominance.append({
                    "cell": label, "backend": backend, "adaptive_iops": ad["iops"],
                    "adaptive_cpu": ad["server_cpu_per_s"], "ratios": ratios,
                    "dominated_by": [s for s, (i, c) in ratios.items()
                                     if i > 1 + DOMINANCE_MARGIN and c < 1 - DOMINANCE_MARGIN],
                })
    if summary:
        print("\n| cell | adaptive IOPS / busy | adaptive CPU / busy | adaptive CPU per I/O / weighted |")
        print("|---|---|---|---|")
        for s in summary:
            print(f"| {s['cell']} | {s['iops_vs_busy']:.2f} | {s['cpu_vs_busy']:.2f} | {s['cpu_per_io_vs_weighted']:.2f} |")
        groups = [("null and file cells", [s for s in summary if s["backend"] in ("null", "file")]),
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
    if dominance:
        modes = [s for s in POLL_SERVERS if s != "adaptive" and s in servers]
        print("\nThe default (adaptive) against every other mode: other / adaptive, IOPS and server CPU (cores)")
        print("\n| cell | adaptive IOPS / CPU | " + " | ".join(f"{m} IOPS / CPU" for m in modes) + " | dominated by |")
        print("|---|---|" + "---|" * len(modes) + "---|")
        for d in dominance:
            cols = [f"{d['ratios'][m][0]:.2f} / {d['ratios'][m][1]:.2f}" if m in d["ratios"] else "-" for m in modes]
            print(f"| {d['cell']} | {d['adaptive_iops']:.0f} / {d['adaptive_cpu']:.2f} | " + " | ".join(cols)
                  + f" | {', '.join(d['dominated_by']) or '-'} |")
        print(f"\ncells where another mode beats adaptive on both IOPS and CPU by more than "
              f"{DOMINANCE_MARGIN:.0%}: {sum(1 for d in dominance if d['dominated_by'])} of {len(dominance)}")
        file_busy = [d["ratios"]["busy"][0] for d in dominance if d["backend"] == "file" and "busy" in d["ratios"]]
        if file_busy:
            print(f"file cells: min adaptive IOPS / busy {1 / max(file_busy):.2f} (goal >= 0.95)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"versions": versions(), "runtime": a.runtime, "repeats": a.repeats,
                       "poll_max_ns": a.poll_max_ns, "results": results,
                       "summary": summary, "dominance": dominance}, f, indent=2)


CLIENT_HELP = """Is the load generator the bottleneck? How many IOPS one `vqblk bench` job
thread issues, and its CPU per I/O, with libblkio wait mode `loop` against the
null backend (vqblk serve busy-polling, so the server is as fast as it gets,
and qemu-storage-daemon's null-co for comparison), next to the same client in
native io_uring mode on a tmpfs file (no device behind it).
"""


def client(a):
    ensure_tools()
    work = tempfile.mkdtemp(prefix="bench-client-", dir=os.path.join(ROOT, "target"))
    shm = tempfile.mkdtemp(prefix="vqblk-bench-client-", dir="/dev/shm")
    tmpfs_file = os.path.join(shm, "f.raw")
    with open(tmpfs_file, "wb") as f:
        f.truncate(256 << 20)
    rows = []
    try:
        for name, start in [("vqblk serve null, --poll busy",
                             lambda s: start_vqblk("null", None, s, extra=["--poll", "busy"], binary=a.vqblk)),
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


FAIRNESS_HELP = """Fairness between exports that share an IOThread.

Two null exports on ONE IOThread: `flood` (several queues, each driven by a job
at a large iodepth) and `victim` (one queue, iodepth 1). The victim's p50/p99
completion latency is measured alone and under the flood, interleaved, medians
of --repeats runs; the verdict is p99 under flood / p99 alone (goal <= 2).

On a 2-core machine every client thread competes for the client CPU: with
more flood jobs than client cores the victim's latency measures the client's
scheduler, not the server. Hence one flood job by default.
"""


def fairness_config(d, latency_ns, flood_queues, server_cpu):
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


def fairness(a):
    ensure_tools(qsd=False)
    benchlib.VQBLK = a.vqblk
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "vqblk.toml")
        with open(cfg, "w") as f:
            f.write(fairness_config(d, a.latency_ns, a.flood_jobs, a.server_cpu))
        if a.client_cpus:
            os.sched_setaffinity(0, {int(c) for c in a.client_cpus.split(",")})
        server = subprocess.Popen(["taskset", "-c", a.server_cpu or "0-1023", a.vqblk, "serve", "--config", cfg,
                                   "--log-level", "warn"])
        try:
            wait_socket(f"{d}/victim.sock", server)
            wait_socket(f"{d}/flood.sock", server)
            alone, flooded = [], []
            for rep in range(a.repeats):
                alone.append(run_bench(f"unix:{d}/victim.sock", 1, a.runtime))
                flood_out = {}

                def flood():
                    flood_out["r"] = run_bench(f"unix:{d}/flood.sock", a.flood_iodepth, a.runtime + 2,
                                               numjobs=a.flood_jobs)

                t = threading.Thread(target=flood)
                t.start()
                r = run_bench(f"unix:{d}/victim.sock", 1, a.runtime)
                t.join()
                r["flood_iops"] = flood_out["r"]["iops"]
                flooded.append(r)
                print(f"run {rep + 1}: victim alone p99 {alone[-1]['p99_us']:.1f} us, "
                      f"under flood p99 {r['p99_us']:.1f} us (flood {r['flood_iops'] / 1e3:.0f}K IOPS)",
                      flush=True)
        finally:
            stop(server)
    ma, mf = median_of(alone), median_of(flooded)
    print(f"\nvictim (qd1) alone:       {ma['iops'] / 1e3:8.1f}K IOPS  p50 {ma['p50_us']:7.1f} us  p99 {ma['p99_us']:7.1f} us")
    print(f"victim under flood:       {mf['iops'] / 1e3:8.1f}K IOPS  p50 {mf['p50_us']:7.1f} us  p99 {mf['p99_us']:7.1f} us"
          f"  (flood: {a.flood_jobs} jobs x qd{a.flood_iodepth}, {mf['flood_iops'] / 1e3:.0f}K IOPS)")
    print(f"p99 ratio (goal <= 2.0): {mf['p99_us'] / ma['p99_us']:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"alone": alone, "flooded": flooded, "args": vars(a)}, f, indent=1, default=str)


RBD_HELP = """vqblk's rbd backend vs qemu-storage-daemon's rbd driver vs native librbd.

Starts a throw-away Ceph cluster (scripts/ceph/start.sh: one monitor, one
memstore OSD, its own CEPH_DIR and MON_PORT), then `vqblk serve --backend rbd`
and `qemu-storage-daemon --blockdev driver=rbd` on the same image (librbd's
cache off in both: cache none / cache.direct=on), and drives each with the same
libblkio client (one job, 4k randread and randwrite, iodepth 1 and 16), plus
the same workload straight on the image through librbd (`vqblk bench --target
rbd:POOL/IMAGE`, as fio's rbd engine). Runs are interleaved; prints medians of
IOPS, p99, the server's CPU per I/O (all of its threads, librbd's included,
and split by thread name) and the whole machine's CPU per I/O with how busy
its CPUs were (the OSD runs on the same host: its CPU is only in that column;
when the CPUs are all busy, IOPS follow it). The cluster is stopped at the
end, also on failure.

--client-option KEY=VALUE adds a librados/librbd setting to ceph.conf's
[client] section, which every client reads (vqblk, qsd and the native runs
alike), e.g. --client-option rbd_non_blocking_aio=false. --osd-option
KEY=VALUE does the same for the OSD's [osd] section before it starts, e.g.
the messenger's delay injection to stand for a cluster at a network's
distance: --osd-option ms_inject_delay_type=client
--osd-option ms_inject_delay_max=0.002 --osd-option ms_inject_delay_probability=1
(each client message waits a random 0-2 ms before the OSD handles it).
"""

RBD_MON_PORT = "3480"
RBD_IMAGE = "rbd/bench"


def rbd(a):
    depths = [int(d) for d in a.depths.split(",") if d]
    patterns = [p for p in a.rw.split(",") if p]

    def settings(flag, opts):
        """KEY=VALUE options as ceph.conf lines ("KEY = VALUE")."""
        lines = []
        for o in opts:
            k, eq, v = (p.strip() for p in o.partition("="))
            if not eq or not k:
                sys.exit(f"{flag}: expected KEY=VALUE, got {o!r}")
            lines.append(f"{k} = {v}")
        return lines

    client_conf = settings("--client-option", a.client_option)
    osd_conf = settings("--osd-option", a.osd_option)
    ensure_tools(qsd=False)
    vqblk = a.vqblk
    work = tempfile.mkdtemp(prefix="bench-rbd-", dir=os.path.join(ROOT, "target"))
    env = dict(os.environ, CEPH_DIR=os.path.join(work, "ceph"), MON_PORT=RBD_MON_PORT)
    env["OSD_EXTRA_CONF"] = "\n".join(osd_conf)
    conf = os.path.join(env["CEPH_DIR"], "ceph.conf")
    env["CEPH_CONF"] = conf
    os.environ["CEPH_CONF"] = conf  # for vqblk bench's native librbd runs
    ceph = os.path.join(ROOT, "scripts", "ceph")
    procs = {}
    runs = {}
    try:
        subprocess.run(["timeout", "180", os.path.join(ceph, "start.sh")], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        if client_conf:
            # Read by librados in every client process; the cluster's own
            # daemons read their [mon]/[osd] sections, not this one.
            with open(conf, "a") as f:
                f.write("\n[client]\n" + "".join(line + "\n" for line in client_conf))
        subprocess.run(["timeout", "60", "rbd", "create", "--size", "1G", RBD_IMAGE], env=env, check=True)
        # Write the whole image once, so reads hit data, not holes.
        subprocess.run([benchlib.VQBLK, "bench", "--target", f"rbd:{RBD_IMAGE}", "--rw", "write", "--bs", "4m",
                        "--iodepth", "4", "--size", "1G"], env=env, check=True, stdout=subprocess.DEVNULL)
        pool, name = RBD_IMAGE.split("/")
        servers = {
            "vqblk": [vqblk, "serve", "--image", f"rbd:{RBD_IMAGE}", "--ceph-conf", conf, "--log-level", "warn"],
            "qemu-storage-daemon": [
                "qemu-storage-daemon", "--blockdev",
                f"driver=rbd,node-name=disk,pool={pool},image={name},conf={conf},cache.direct=on",
                "--object", "iothread,id=iot0"],
        }
        for v in a.variant:
            label, _, flags = v.partition(":")
            servers[f"vqblk {label}"] = servers["vqblk"] + flags.split()
        for server, argv in servers.items():
            sock = os.path.join(work, f"{server.replace(' ', '-')}.sock")
            if server.startswith("vqblk"):
                argv = argv + ["--socket", sock]
            else:
                argv = argv + ["--export", "type=vhost-user-blk,id=exp0,node-name=disk,addr.type=unix,"
                               f"addr.path={sock},writable=on,num-queues=1,iothread=iot0"]
            p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env)
            procs[server] = (p, sock)
            wait_socket(sock, p)
        targets = [(n, f"unix:{s}", p.pid) for n, (p, s) in procs.items()]
        targets.append(("native librbd", f"rbd:{RBD_IMAGE}", None))
        for rep in range(a.repeats):
            for rw in patterns:
                for depth in depths:
                    # Each repeat starts the cell with another server: the
                    # first run after a change of cell meets the OSD still
                    # busy with the last one, which a fixed order charges to
                    # the same server every time.
                    k = rep % len(targets)
                    for name, target, pid in targets[k:] + targets[:k]:
                        r = run_bench(target, depth, a.runtime, pid, rw=rw)
                        runs.setdefault((name, rw, depth), []).append(r)
                        cpu = f"  server CPU {r['server_cpu_us_per_io']:6.2f} us/IO" if pid else ""
                        if pid:
                            split = r["server_cpu_us_per_io_by_thread"]
                            cpu += " (" + ", ".join(f"{n} {v:.1f}" for n, v in split.items()) + ")"
                        print(f"[{rep + 1}/{a.repeats}] {name:20} {rw:9} qd{depth:<3} {r['iops']:9.0f} IOPS"
                              f"  p99 {r['p99_us']:8.1f} us  machine {r['machine_cpu_us_per_io']:6.1f} us/IO"
                              f" ({100 * r['machine_busy']:.0f}% busy){cpu}", flush=True)
    finally:
        for p, _ in procs.values():
            stop(p)
        subprocess.run(["timeout", "60", os.path.join(ceph, "stop.sh")], env=env, stdout=subprocess.DEVNULL)
    results = [{"server": n, "rw": rw, "iodepth": d, **median_of(rs), "runs": rs}
               for (n, rw, d), rs in runs.items()]
    print("| server | rw | iodepth | IOPS | p99 (us) | server CPU (us/IO) | machine CPU (us/IO, busy) |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (r["rw"], r["iodepth"], r["server"])):
        cpu = f"{r['server_cpu_us_per_io']:.2f}" if "server_cpu_us_per_io" in r else "-"
        print(f"| {r['server']} | {r['rw']} | {r['iodepth']} | {r['iops']:.0f} | {r['p99_us']:.1f} | {cpu} "
              f"| {r['machine_cpu_us_per_io']:.1f} ({100 * r['machine_busy']:.0f}%) |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"versions": versions(), "runtime": a.runtime, "repeats": a.repeats,
                       "client_options": a.client_option,
                       "osd_options": a.osd_option, "results": results}, f, indent=2)


QOS_HELP = """I/O limits (docs/qos.md): what vqblk lets through against what it was told.

Tables (--tables, comma-separated):
  limits  `vqblk serve --throttle KEY=LIMIT` for each of --limits, on each of
          --backends (null:NS is a null export with that latency, file an
          O_DIRECT raw image): iops-* limits with 4k random I/O, bps-* limits
          with requests of about a hundredth of the limit (4k to 1M), reads
          unless the key is a write limit, at a depth of one request per
          thousand the run completes (1 to 32: see depth_for); the achieved
          IOPS and MB/s over --runtime seconds (after the client's 1 s ramp)
          and the ratio achieved/limit against the --target-pct target; a
          cell that misses is run again up to --rerun-misses times (every
          attempt is printed: noise moves between attempts, a fault of the
          daemon stays), then once without the limit: a limit above what the
          backend does unthrottled cannot be reached, and the table says so
  burst   the requests completed each second under --burst (a burst:
          KEY-max and KEY-max-length) by vqblk and by qemu-storage-daemon with
          the same throttle-group settings (a throttle node over null-co),
          side by side, and their ratio second by second against the
          --burst-target-pct target: one client run of --burst-seconds (4k
          random reads at QD32, one connection), its rate over each second
          read from the status line it draws on a terminal (qsd's exports
          count nothing, so the series is the client's, the same for both)
  group   three null exports in one [[throttle-group]] with --group-limit,
          all flooding at once (QD16 each): each one's rate, their sum and the
          ratio sum/limit
  cpu     the server's CPU per I/O at a limit (null, QD16, iops-total=N for
          each of --cpu-iops) beside unthrottled at the same rate: the same
          client at QD16 against a null export whose latency makes it do N
          IOPS (`vqblk bench` has no rate_iops): 16/N s, then corrected once
          by the client's own time per request measured in the first run;
          and qemu-storage-daemon at the same limit (a throttle node over
          null-co), the same client
  shares  reservations and weights: two O_DIRECT file exports whose images
          share a directory (one backing device). First one export alone at
          QD64 (what the disk does), then one with reservation-iops of 40% of
          that at --shares-depth while the other floods at QD64 (its rate
          against the reservation; target >= 0.95x), then weights 3:1 both
          flooding at QD64 (the split; target within 10% of 3:1)

Every cell is printed with the machine's 1-minute load average and the
cache-line round trip between CPUs 0 and 1 (scripts/cacheline-rtt.sh) taken
just before it: the figures of a loaded or badly placed VM say so.

Figures, not pass/fail: the targets are in docs/qos.md.
"""


def bs_for(limit_bytes):
    """A request size for a bytes-per-second limit: about a hundred requests a
    second, a power of two from 4k to 1M."""
    return max(4096, min(1 << 20, 2 ** int(math.log2(max(1, limit_bytes // 100)))))


def depth_for(requests_per_s, runtime):
    """The client's depth for a limits cell: one request in flight per
    thousand the run completes, 1 to 32. The client counts only requests
    issued after its ramp and measures until its last completion, so the
    requests it has in flight when the ramp ends, which a limited server holds
    back, are missing from its count: a depth of D under a limit of L over T
    seconds reads L * T / (T + D / L), -3.1% for 100 IOPS at QD32 over 10 s.
    At a thousandth that is -0.1%, and the depth still covers the backend's
    latency up to a millisecond at every limit up to 32K requests a second
    (10K at QD1 needs 0.1 ms)."""
    return max(1, min(32, int(requests_per_s * runtime) // 1000))


def machine_state():
    """The 1-minute load average and the cache-line round trip (ns) between
    CPUs 0 and 1 (NaN on a single CPU), noted beside each figure."""
    rtt = cacheline_rtt(["0", "1"]) if (os.cpu_count() or 1) >= 2 else float("nan")
    return {"load1": os.getloadavg()[0], "cacheline_rtt_ns": rtt}


def state_text(s):
    return f"load {s['load1']:.2f}, cache-line rtt {s['cacheline_rtt_ns']:.0f} ns"


def within(ratio, pct):
    return abs(ratio - 1) * 100 <= pct


def qos_limits(a, work):
    image = os.path.join(work, "disk.raw")
    sock = os.path.join(work, "v.sock")
    rows = []
    for backend in a.backends.split(","):
        if backend == "file":
            make_image(image, 256)
        for spec in a.limits.split(","):
            key, _, value = spec.partition("=")
            limit = int(value)
            by_bytes = key.startswith("bps")
            bs = bs_for(limit) if by_bytes else 4096
            depth = depth_for(limit / bs if by_bytes else limit, a.runtime)
            rw = "randwrite" if "write" in key else "randread"
            attempts = []
            for _ in range(1 + a.rerun_misses):
                state = machine_state()
                with serving(start_vqblk(backend, image, sock, extra=["--throttle", spec]), sock) as proc:
                    r = run_bench(f"unix:{sock}", depth, a.runtime, proc.pid, rw=rw, bs=str(bs))
                got = r["iops"] * bs if by_bytes else r["iops"]
                row = {"backend": backend, "limit": spec, "bs": bs, "depth": depth, "iops": r["iops"],
                       "mb_per_s": r["iops"] * bs / 1e6, "measured": got, "ratio": got / limit,
                       "attempt": len(attempts) + 1,
                       "server_cpu_us_per_io": r.get("server_cpu_us_per_io", 0.0), **state}
                attempts.append(row)
                print(f"{backend} {spec} (attempt {row['attempt']}): {r['iops']:.0f} IOPS, "
                      f"{row['mb_per_s']:.2f} MB/s, achieved/limit {row['ratio']:.4f} ({state_text(state)})",
                      flush=True)
                if within(row["ratio"], a.target_pct):
                    break
            if not within(attempts[-1]["ratio"], a.target_pct):
                # What the backend does without the limit, with the same client.
                with serving(start_vqblk(backend, image, sock), sock) as proc:
                    r = run_bench(f"unix:{sock}", depth, a.runtime, proc.pid, rw=rw, bs=str(bs))
                unlimited = r["iops"] * bs if by_bytes else r["iops"]
                for row in attempts:
                    row["unthrottled"] = unlimited
                print(f"{backend} {spec}: unthrottled {unlimited:.0f} ({unlimited / limit:.4f} of the limit)",
                      flush=True)
            rows += attempts
    print(f"\nachieved/limit over {a.runtime} s (target: within {a.target_pct:g}%)")
    print("| backend | limit | request | QD | attempt | IOPS | MB/s | achieved/limit | target | "
          "server CPU per I/O (us) | load | cache-line rtt (ns) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ok = "met" if within(r["ratio"], a.target_pct) else "missed"
        if "unthrottled" in r and r["unthrottled"] < r["measured"] / r["ratio"] * (1 - a.target_pct / 100):
            ok = f"above the backend ({r['unthrottled'] * r['ratio'] / r['measured']:.2f} of it unthrottled)"
        print(f"| {r['backend']} | {r['limit']} | {r['bs']} | {r['depth']} | {r['attempt']} | {r['iops']:.0f} | "
              f"{r['mb_per_s']:.2f} | {r['ratio']:.4f} | {ok} | {r['server_cpu_us_per_io']:.2f} | "
              f"{r['load1']:.2f} | {r['cacheline_rtt_ns']:.0f} |")
    return rows


def start_qsd_throttled(sock, limits):
    """qemu-storage-daemon exporting a null-co disk behind a throttle node of
    one throttle group with `limits` (vqblk's --throttle grammar)."""
    thr, nodes = qsd_throttle_args(limits)
    return subprocess.Popen([
        "qemu-storage-daemon",
        "--blockdev", "driver=null-co,node-name=disk,size=1073741824,read-zeroes=on", *thr,
        "--object", "iothread,id=iot0",
        "--export", f"type=vhost-user-blk,id=exp0,node-name={nodes[0]},addr.type=unix,"
                    f"addr.path={sock},writable=on,num-queues=1,iothread=iot0",
    ], stdout=subprocess.DEVNULL)


def qos_burst(a, work):
    sock = os.path.join(work, "b.sock")
    series = {}
    states = {}
    for server in ["vqblk", "qemu-storage-daemon"]:
        states[server] = machine_state()
        if server == "vqblk":
            proc = start_vqblk("null", None, sock, extra=["--throttle", a.burst])
        else:
            proc = start_qsd_throttled(sock, a.burst)
        with serving(proc, sock):
            series[server] = client_series(f"unix:{sock}", a.burst_seconds)
    v, q = series["vqblk"], series["qemu-storage-daemon"]
    print(f"\nrequests a second under {a.burst} (one client run, 4k randread QD32)")
    for server, s in states.items():
        print(f"{server}: {state_text(s)}")
    print("| second | vqblk | qemu-storage-daemon | vqblk/qsd |")
    print("|---|---|---|---|")
    ratios = []
    for i, (x, y) in enumerate(zip(v, q)):
        ratios.append(x / y if y else float("nan"))
        print(f"| {i + 1} | {x:.0f} | {y:.0f} | {ratios[-1]:.3f} |")
    worst = max((abs(r - 1) for r in ratios if r == r), default=float("nan"))
    met = sum(1 for r in ratios if r == r and within(r, a.burst_target_pct))
    print(f"seconds within {a.burst_target_pct:g}% of qemu-storage-daemon: {met} of {len(ratios)}; "
          f"largest difference {worst * 100:.1f}%")
    return {"series": series, "ratios": ratios, "states": states}


def qos_group(a, work):
    cfg = os.path.join(work, "group.toml")
    names = ["a", "b", "c"]
    with open(cfg, "w") as f:
        f.write(f'[iothreads]\ncount = 2\n\n[[throttle-group]]\nname = "g"\n{a.group_limit.replace(",", chr(10))}\n')
        for n in names:
            f.write(f'\n[[export]]\nname = "{n}"\nbackend = "null"\nsize = "1G"\n'
                    f'socket = "{work}/{n}.sock"\nthrottle-group = "g"\n')
    state = machine_state()
    proc = subprocess.Popen([benchlib.VQBLK, "serve", "--config", cfg, "--log-level", "warn"],
                            stdout=subprocess.DEVNULL)
    res = {}
    try:
        for n in names:
            wait_socket(f"{work}/{n}.sock", proc)

        def one(n):
            res[n] = client_series(f"unix:{work}/{n}.sock", a.runtime + 1, iodepth=16)

        threads = [threading.Thread(target=one, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop(proc)
    limit = float(a.group_limit.split("=")[1].split(",")[0])
    # The first second holds the connections and the buckets' initial
    # allowance (a tenth of a second at the average rate, as in QEMU): left out.
    seconds = min(len(s) for s in res.values())
    sums = [sum(res[n][i] for n in names) for i in range(1, seconds)]
    mean = {n: sum(res[n][1:seconds]) / len(sums) for n in names}
    total = sum(sums) / len(sums)
    print(f"\ngroup {a.group_limit}, three exports flooding at QD16 ({state_text(state)}), "
          f"requests a second after the first")
    print("| second | " + " | ".join(names) + " | sum | sum/limit |")
    print("|---|" + "---|" * (len(names) + 2))
    for i, x in enumerate(sums):
        print(f"| {i + 2} | " + " | ".join(f"{res[n][i + 1]:.0f}" for n in names) + f" | {x:.0f} | {x / limit:.4f} |")
    print("| mean | " + " | ".join(f"{mean[n]:.0f}" for n in names) + f" | {total:.0f} | {total / limit:.4f} |")
    print(f"largest second: {max(sums) / limit:.4f} of the limit (target: at most {1 + a.target_pct / 100:g})")
    return {"series": res, "ratio": total / limit, "max_second_ratio": max(sums) / limit, **state}


def qos_cpu(a, work):
    sock = os.path.join(work, "c.sock")
    depth = 16
    rows = []

    def run(n, label, backend, extra):
        state = machine_state()
        if label.startswith("qemu-storage-daemon"):
            proc = start_qsd_throttled(sock, f"iops-total={n}")
        else:
            proc = start_vqblk(backend, None, sock, extra=extra)
        with serving(proc, sock):
            r = run_bench(f"unix:{sock}", depth, a.runtime, proc.pid)
        rows.append({"limit": n, "server": label, "depth": depth, "iops": r["iops"],
                     "server_cpu_us_per_io": r["server_cpu_us_per_io"], **state})
        print(f"cpu {n} {label}: {r['iops']:.0f} IOPS, {r['server_cpu_us_per_io']:.2f} us/IO", flush=True)
        return r["iops"]

    for n in [int(x) for x in a.cpu_iops.split(",")]:
        run(n, "at the limit", "null", ["--throttle", f"iops-total={n}"])
        if shutil.which("qemu-storage-daemon"):
            run(n, "qemu-storage-daemon at the limit", None, None)
        # QD16 over a latency L does 16 / (L + o) IOPS, o the client's and the
        # transport's own time per request: one run measures o.
        latency = depth * 10 ** 9 // n
        iops = run(n, f"unthrottled, latency {latency / 1000:.0f} us", f"null:{latency}", [])
        if not within(iops / n, a.target_pct) and iops > 0:
            latency = int(depth * 1e9 / n - (depth * 1e9 / iops - latency))
            if latency > 0:
                run(n, f"unthrottled, latency {latency / 1000:.0f} us", f"null:{latency}", [])
    print("\n| limit (IOPS) | server | QD | measured IOPS | server CPU per I/O (us) | load | cache-line rtt (ns) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['limit']} | {r['server']} | {r['depth']} | {r['iops']:.0f} | {r['server_cpu_us_per_io']:.2f} | "
              f"{r['load1']:.2f} | {r['cacheline_rtt_ns']:.0f} |")
    return rows


def qos_shares(a, work):
    for n in ["a", "b"]:
        make_image(os.path.join(work, f"{n}.raw"), 256)

    def serve_two(keys_a, keys_b):
        cfg = os.path.join(work, "shares.toml")
        with open(cfg, "w") as f:
            f.write("[iothreads]\ncount = 2\n")
            for n, keys in [("a", keys_a), ("b", keys_b)]:
                f.write(f'\n[[export]]\nname = "{n}"\nimage = "{work}/{n}.raw"\ncache = "none"\n'
                        f'socket = "{work}/{n}.sock"\n{keys}')
        proc = subprocess.Popen([benchlib.VQBLK, "serve", "--config", cfg, "--log-level", "warn"],
                                stdout=subprocess.DEVNULL)
        for n in ["a", "b"]:
            wait_socket(f"{work}/{n}.sock", proc)
        return proc

    def together(depths):
        res = {}

        def one(n, d):
            res[n] = run_bench(f"unix:{work}/{n}.sock", d, a.runtime)["iops"]

        threads = [threading.Thread(target=one, args=(n, d)) for n, d in depths.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return res

    proc = serve_two("", "")
    try:
        alone = together({"a": 64})["a"]
        unshared = together({"a": a.shares_depth, "b": 64})
    finally:
        stop(proc)
    reservation = int(0.4 * alone)
    proc = serve_two(f"reservation-iops = {reservation}\n", "")
    try:
        reserved = together({"a": a.shares_depth, "b": 64})
    finally:
        stop(proc)
    proc = serve_two("weight = 3\n", "weight = 1\n")
    try:
        weighted = together({"a": 64, "b": 64})
    finally:
        stop(proc)
    print(f"\nthe disk alone (a, QD64): {alone:.0f} IOPS")
    print("| case | a | b | target |")
    print("|---|---|---|---|")
    print(f"| no shares, a QD{a.shares_depth}, b QD64 | {unshared['a']:.0f} | {unshared['b']:.0f} | - |")
    print(f"| a reservation-iops={reservation}, QD{a.shares_depth}; b QD64 | {reserved['a']:.0f} "
          f"({reserved['a'] / reservation:.2f}x the reservation) | {reserved['b']:.0f} | >= 0.95x |")
    print(f"| weights 3:1, both QD64 | {weighted['a']:.0f} | {weighted['b']:.0f} "
          f"(split {weighted['a'] / max(weighted['b'], 1):.2f}:1) | 3:1 within 10% |")
    return {"alone": alone, "unshared": unshared, "reservation": reservation, "reserved": reserved,
            "weighted": weighted}


def qos(a):
    tables = a.tables.split(",")
    ensure_tools(qsd="burst" in tables)
    benchlib.VQBLK = a.vqblk
    work = tempfile.mkdtemp(prefix="bench-qos-", dir=os.path.join(ROOT, "target"))
    out = {"versions": versions(), "args": vars(a), "start": machine_state()}
    print(f"start: {state_text(out['start'])}", flush=True)
    for name, func in [("limits", qos_limits), ("burst", qos_burst), ("group", qos_group), ("cpu", qos_cpu),
                       ("shares", qos_shares)]:
        if name in tables:
            out[name] = func(a, work)
    out["end"] = machine_state()
    print(f"\nend: {state_text(out['end'])}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)


PHASES_HELP = """--iothreads auto against fixed IOThread counts on a workload that changes.

One daemon per server (4 queues; `--iothreads auto`, and each fixed count of
--fixed) serves a workload that switches phase every --phase-seconds: one job
at QD1, then four jobs at QD32 (4k random reads), --cycles times. Each phase
is one client run whose first --settle seconds are its ramp (not counted), so
its IOPS are what the server does from --settle seconds after the switch to
the end of the phase: the autotune target is at least 0.9x the best fixed
count's IOPS in every phase (docs/autotune.md). The servers run one after the
other, in an order that rotates every repeat; medians over --repeats. Each
phase of `auto` also says what its controller did (asked on its control
socket before and after the phase's run): the queue moves by reason, the
switch's included, and the IOThreads active at the end.
"""

PHASES = [("1 queue, QD1", 1, 1), ("4 queues, QD32", 4, 32)]


def tuner_state(control):
    """`--iothreads auto`'s controller now: moves by reason (the phase's and the
    switch's, which fall in its ramp) and the IOThreads that own a queue."""
    def ctl(method):
        return json.loads(subprocess.run([benchlib.VQBLK, "ctl", "--control", control, "--json", method],
                                         check=True, capture_output=True, text=True).stdout)
    threads = ctl("query-iothreads")
    return {"moves": ctl("query-tune")["moves"], "active": sum(1 for t in threads if t.get("active"))}


def phases(a):
    ensure_tools(qsd=False)
    benchlib.VQBLK = a.vqblk
    work = tempfile.mkdtemp(prefix="bench-phases-", dir=os.path.join(ROOT, "target"))
    sock = os.path.join(work, "p.sock")
    image = None
    if a.backend == "file":
        image = os.path.join(work, "p.raw")
        make_image(image, 1024)
    servers = [("auto", "auto")] + [(f"iothreads={k}", k) for k in a.fixed.split(",")]
    control = os.path.join(work, "p.ctl")
    out = {"versions": versions(), "args": vars(a), "start": machine_state(), "runs": []}
    print(f"start: {state_text(out['start'])}", flush=True)
    for rep in range(a.repeats):
        for label, iothreads in rotated(servers, rep):
            extra = ["--control", control] if iothreads == "auto" else []
            with serving(start_vqblk(a.backend, image, sock, queues=4, iothreads=iothreads, extra=extra),
                         sock) as proc:
                for cycle in range(a.cycles):
                    for name, jobs, depth in PHASES:
                        before = tuner_state(control) if extra else None
                        r = run_bench(f"unix:{sock}", depth, a.phase_seconds - a.settle, proc.pid,
                                      numjobs=jobs, ramp=a.settle)
                        row = {"repeat": rep, "server": label, "cycle": cycle, "phase": name, "iops": r["iops"],
                               "server_cpu_us_per_io": r["server_cpu_us_per_io"], **machine_state()}
                        tuned = ""
                        if before is not None:
                            after = tuner_state(control)
                            moves = {k: n - before["moves"].get(k, 0) for k, n in after["moves"].items()}
                            row["tune"] = {"active_iothreads": after["active"],
                                           "moves": {k: n for k, n in moves.items() if n}}
                            tuned = (f", {after['active']} IOThreads active at the end, moves "
                                     f"{row['tune']['moves'] or 'none'}")
                        out["runs"].append(row)
                        print(f"{label} cycle {cycle} {name}: {r['iops']:.0f} IOPS, "
                              f"{r['server_cpu_us_per_io']:.2f} us/IO{tuned} ({state_text(row)})", flush=True)
    print("\n| phase | server | IOPS (median) | server CPU per I/O (us) | IOPS / best fixed |")
    print("|---|---|---|---|---|")
    for name, _, _ in PHASES:
        med = {}
        for label, _ in servers:
            runs = [r for r in out["runs"] if r["server"] == label and r["phase"] == name]
            med[label] = (statistics.median(r["iops"] for r in runs),
                          statistics.median(r["server_cpu_us_per_io"] for r in runs))
        best = max(v[0] for k, v in med.items() if k != "auto")
        for label, (iops, cpu) in med.items():
            print(f"| {name} | {label} | {iops:.0f} | {cpu:.2f} | {iops / best:.2f} |")
    out["end"] = machine_state()
    print(f"\nend: {state_text(out['end'])}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)


def parser():
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    sub = ap.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    def pinning(p):
        """Where the servers and the client run, and the CPUs of the cache-line
        round trip (rtt_cpus_of)."""
        p.add_argument("--server-cpus", default=None, help="taskset CPU list for every server (e.g. 1)")
        p.add_argument("--client-cpus", default=None, help="taskset CPU list for the client (e.g. 0)")
        p.add_argument("--rtt-cpus", default=None, metavar="A,B",
                       help="CPUs of the cache-line round trip (default: the pinned server and client CPUs, "
                            "else 0,1 when nothing is pinned)")

    def command(name, help_text, func, runtime, repeats):
        p = sub.add_parser(name, description=help_text, formatter_class=raw, help=help_text.splitlines()[0])
        p.set_defaults(func=func)
        p.add_argument("--runtime", type=int, default=runtime, help=f"seconds per run (default {runtime})")
        p.add_argument("--repeats", type=int, default=repeats, help=f"runs per cell (default {repeats})")
        p.add_argument("--vqblk", default=benchlib.VQBLK,
                       help="the vqblk binary to serve (default: this tree's release build)")
        p.add_argument("--out", default=None, help="write the results here as JSON")
        return p

    p = command("serve", SERVE_HELP, serve, 10, 3)
    p.add_argument("--dir", default=None, help="scratch dir on a disk file system (default: under target/)")
    p.add_argument("--wait-mode", choices=["block", "loop"], default="block",
                   help="the client's libblkio_wait_mode (default block)")
    p.add_argument("--backends", default="null,file", help="comma-separated subset of null,file")
    p.add_argument("--depths", default="1,16", help="comma-separated iodepths")
    p.add_argument("--cells", default=None,
                   help="BACKEND:DEPTH,... instead of every --backends x --depths (e.g. null:1,null:16,file:16)")
    p.add_argument("--baseline", default=None, metavar="BINARY",
                   help="another vqblk binary to run as 'vqblk (baseline)', for an A/B")
    p.add_argument("--read-zeroes", choices=["on", "off"], default="on",
                   help="null backend: reads write zeroes (on, the default) or transfer no data (off: "
                        "vqblk --read-zeroes off, qsd null-co read-zeroes=off; SPDK's null bdev never writes them)")
    p.add_argument("--extra", default="", help="extra serve flags for vqblk (e.g. \"--seccomp off\")")
    p.add_argument("--baseline-extra", default="", help="extra serve flags for the baseline")
    p.add_argument("--client", default=None, metavar="BINARY",
                   help="the vqblk binary whose bench drives every server (default: this tree's)")
    p.add_argument("--servers", default=None,
                   help="comma-separated servers to run: vqblk, baseline, poll-off, qsd, native, spdk "
                        "(default: all but spdk)")
    p.add_argument("--spdk-held", default="/var/tmp/vqblk-peers", metavar="DIR",
                   help="where ../shared/peers/ built SPDK (HELD; default /var/tmp/vqblk-peers)")
    p.add_argument("--spdk-script", default=os.path.join(os.path.dirname(ROOT), "shared", "peers", "spdk-null.sh"),
                   metavar="PATH", help="SPDK's launcher (default ../shared/peers/spdk-null.sh)")
    pinning(p)

    p = command("polling", POLLING_HELP, polling, 3, 1)
    p.add_argument("--backends", default="null,file", help="comma-separated: null, null:NS, file")
    p.add_argument("--rws", default="randread,randwrite")
    p.add_argument("--jobs", default="1,2")
    p.add_argument("--depths", default="1,4,16")
    p.add_argument("--servers", default=",".join([*POLL_SERVERS, "qsd"]))
    p.add_argument("--poll-max-ns", type=int, default=None,
                   help="poll-max-ns of the classic, weighted and adaptive servers (default: QEMU's 32768)")
    p.add_argument("--baseline", default=None, metavar="BINARY",
                   help="another vqblk binary, served as 'baseline' (add it to --servers) for an A/B")
    p.add_argument("--baseline-extra", default="--poll adaptive", help="serve flags of the baseline")
    p.add_argument("--wait-modes", default="block",
                   help="comma-separated libblkio_wait_mode of the client: block (sleeps, as a guest), loop (polls)")
    pinning(p)

    command("client", CLIENT_HELP, client, 5, 3)

    p = command("fairness", FAIRNESS_HELP, fairness, 5, 3)
    p.add_argument("--latency-ns", type=int, default=0)
    p.add_argument("--flood-jobs", type=int, default=1)
    p.add_argument("--flood-iodepth", type=int, default=64)
    p.add_argument("--server-cpu", default="1", help="pin the IOThread here ('' for no pinning)")
    p.add_argument("--client-cpus", default="0", help="run the clients on these CPUs ('' for anywhere)")
    p.add_argument("--json", dest="out", help="the same as --out")

    p = command("rbd", RBD_HELP, rbd, 10, 3)
    p.add_argument("--depths", default="1,16", help="comma-separated iodepths")
    p.add_argument("--rw", default="randread,randwrite", help="comma-separated patterns")
    p.add_argument("--client-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a [client] setting in ceph.conf for every client; repeatable")
    p.add_argument("--osd-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an [osd] setting in ceph.conf, set before the OSD starts; repeatable")
    p.add_argument("--variant", action="append", default=[],
                   help="another vqblk server with extra flags, as LABEL:FLAGS "
                        "(e.g. 'poll-off:--poll off'); repeatable")

    p = command("qos", QOS_HELP, qos, 10, 1)
    p.add_argument("--tables", default="limits,burst,group,cpu,shares")
    p.add_argument("--backends", default="null:100000,file", help="limits table: null:NS and/or file")
    p.add_argument("--limits", default="iops-total=100,iops-total=1000,iops-total=10000,iops-total=100000,"
                                       "bps-total=1000000,bps-total=10000000,bps-total=100000000,"
                                       "bps-total=1000000000",
                   help="limits table: KEY=VALUE,... one cell each")
    p.add_argument("--burst", default="iops-total=200,iops-total-max=1000,iops-total-max-length=5",
                   help="burst table: the limits of both servers")
    p.add_argument("--burst-seconds", type=int, default=20)
    p.add_argument("--group-limit", default="iops-total=3000", help="group table: the group's limits")
    p.add_argument("--cpu-iops", default="1000,10000", help="cpu table: the limits")
    p.add_argument("--target-pct", type=float, default=3.0,
                   help="limits and group tables: the target, in percent of the limit (default 3)")
    p.add_argument("--rerun-misses", type=int, default=1,
                   help="limits table: runs of a cell that missed the target again, at most (default 1)")
    p.add_argument("--burst-target-pct", type=float, default=5.0,
                   help="burst table: the target, in percent of qemu-storage-daemon's second (default 5)")
    p.add_argument("--shares-depth", type=int, default=16,
                   help="shares table: the reserved export's iodepth")

    p = command("phases", PHASES_HELP, phases, 0, 1)
    p.add_argument("--backend", default="null:20000", help="null:NS or file (default null:20000)")
    p.add_argument("--fixed", default="1,2", help="the fixed IOThread counts (default 1,2)")
    p.add_argument("--cycles", type=int, default=2, help="QD1 / QD32 cycles per server (default 2)")
    p.add_argument("--phase-seconds", type=int, default=20, help="length of a phase (default 20)")
    p.add_argument("--settle", type=int, default=5,
                   help="seconds after a switch not counted (default 5: the target's)")
    return ap


def main():
    a = parser().parse_args()
    a.func(a)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""vqblk's rbd backend vs qemu-storage-daemon's rbd driver vs native librbd.

Starts a throw-away Ceph cluster (scripts/ceph/start.sh: one monitor, one
memstore OSD, its own CEPH_DIR and MON_PORT), then `vqblk serve --backend rbd`
and `qemu-storage-daemon --blockdev driver=rbd` on the same image (librbd's
cache off in both: cache none / cache.direct=on), and drives each with the same
libblkio client (`vqblk bench`, one job, 4k randread and randwrite, iodepth 1
and 16), plus the same workload straight on the image through librbd
(`vqblk bench --target rbd:POOL/IMAGE`, as fio's rbd engine). Runs are
interleaved; prints medians of IOPS, p99, the server's CPU per I/O (all of
its threads, librbd's included) and the whole machine's CPU per I/O with how
busy its CPUs were (the OSD runs on the same host: its CPU is only in that
column; when the CPUs are all busy, IOPS follow it). The cluster is stopped at the end, also on failure.

--client-option KEY=VALUE adds a librados/librbd setting to ceph.conf's
[client] section, which every client reads (vqblk, qsd and the native runs
alike), e.g. --client-option rbd_non_blocking_aio=false. --osd-option
KEY=VALUE does the same for the OSD's [osd] section before it starts, e.g.
the messenger's delay injection to stand for a cluster at a network's
distance: --osd-option ms_inject_delay_type=client
--osd-option ms_inject_delay_max=0.002 --osd-option ms_inject_delay_probability=1
(each client message waits a random 0-2 ms before the OSD handles it).

Usage: scripts/bench-rbd.py [--runtime 10] [--repeats 3] [--depths 1,16] [--rw randread,randwrite]
                            [--client-option KEY=VALUE]... [--osd-option KEY=VALUE]...
                            [--out results.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import ROOT, VQBLK, ensure_tools, median_of, run_bench, stop, versions, wait_socket  # noqa: E402

MON_PORT = "3480"
IMAGE = "rbd/bench"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depths", default="1,16", help="comma-separated iodepths")
    ap.add_argument("--rw", default="randread,randwrite", help="comma-separated patterns")
    ap.add_argument("--client-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a [client] setting in ceph.conf for every client; repeatable")
    ap.add_argument("--osd-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an [osd] setting in ceph.conf, set before the OSD starts; repeatable")
    ap.add_argument("--out", default=None)
    ap.add_argument("--variant", action="append", default=[],
                    help="another vqblk server with extra flags, as LABEL:FLAGS "
                         "(e.g. 'poll-off:--poll off'); repeatable")
    a = ap.parse_args()
    depths = [int(d) for d in a.depths.split(",") if d]
    patterns = [p for p in a.rw.split(",") if p]

    def settings(flag, opts):
        """KEY=VALUE options as ceph.conf lines ("KEY = VALUE")."""
        lines = []
        for o in opts:
            k, eq, v = (p.strip() for p in o.partition("="))
            if not eq or not k:
                ap.error(f"{flag}: expected KEY=VALUE, got {o!r}")
            lines.append(f"{k} = {v}")
        return lines

    client_conf = settings("--client-option", a.client_option)
    osd_conf = settings("--osd-option", a.osd_option)
    ensure_tools()
    work = tempfile.mkdtemp(prefix="bench-rbd-", dir=os.path.join(ROOT, "target"))
    env = dict(os.environ, CEPH_DIR=os.path.join(work, "ceph"), MON_PORT=MON_PORT)
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
        subprocess.run(["timeout", "60", "rbd", "create", "--size", "1G", IMAGE], env=env, check=True)
        # Write the whole image once, so reads hit data, not holes.
        subprocess.run([VQBLK, "bench", "--target", f"rbd:{IMAGE}", "--rw", "write", "--bs", "4m",
                        "--iodepth", "4", "--size", "1G"], env=env, check=True, stdout=subprocess.DEVNULL)
        pool, name = IMAGE.split("/")
        servers = {
            "vqblk": [VQBLK, "serve", "--image", f"rbd:{IMAGE}", "--ceph-conf", conf, "--log-level", "warn"],
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
        targets.append(("native librbd", f"rbd:{IMAGE}", None))
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


if __name__ == "__main__":
    main()

"""Shared pieces of scripts/bench.py: start vqblk serve or
qemu-storage-daemon, run `vqblk bench` against a socket or a file, read a
server's CPU time from /proc (summed over all of its threads), and measure the
cache-line round trip between two CPUs."""
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VQBLK = os.path.join(ROOT, "target", "release", "vqblk")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_thread_cpu_ticks(pid):
    """utime+stime ticks of the live threads of pid, summed per thread name."""
    out = {}
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                st = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if ")" not in st:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        fields = st.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0) + int(fields[11]) + int(fields[12])
    return out


def proc_cpu(pid):
    """utime+stime of pid in seconds (every thread, exited ones included),
    and the live threads' ticks by name (proc_thread_cpu_ticks): one walk
    over /proc/PID/task for both."""
    threads = proc_thread_cpu_ticks(pid)
    # Threads that exited are accounted in the process-wide counters.
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    proc_total = int(fields[11]) + int(fields[12])
    return max(sum(threads.values()), proc_total) / CLK_TCK, threads


def machine_busy_ticks():
    """(busy, total) clock ticks of every CPU since boot, from /proc/stat
    (busy: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    total = sum(fields[:8])  # guest time is already in user
    return total - fields[3] - fields[4], total


def wait_socket(path, proc, timeout=20):
    t = time.time()
    while not os.path.exists(path):
        if proc.poll() is not None:
            sys.exit(f"server exited early: {proc.args}")
        if time.time() - t > timeout:
            sys.exit(f"socket {path} never appeared")
        time.sleep(0.05)
    time.sleep(0.2)


def null_latency(backend):
    """Latency in ns of a null backend spec ("null" or "null:NS"), None if not null."""
    name, _, ns = backend.partition(":")
    return int(ns or 0) if name == "null" else None


def pinned(args, cpus):
    """`args` run under `taskset -c CPUS` (every thread of the process) when
    cpus is given (e.g. "1")."""
    return ["taskset", "-c", cpus, *args] if cpus else list(args)


def start_vqblk(backend, image, sock, queues=1, iothreads=1, extra=(), binary=None, cpus=None,
                read_zeroes=True):
    args = [binary or VQBLK, "serve", "--socket", sock, "--queues", str(queues), "--iothreads", str(iothreads),
            "--log-level", "warn", *extra]
    latency = null_latency(backend)
    if latency is not None:
        args += ["--backend", "null", "--size", "1G"]
        if latency:
            args += ["--latency-ns", str(latency)]
        if not read_zeroes:
            args += ["--read-zeroes", "off"]
    else:
        args += ["--image", image, "--cache", "none"]
    return subprocess.Popen(pinned(args, cpus), stdout=subprocess.DEVNULL)


def start_qsd(backend, image, sock, queues=1, poll_max_ns=None, cpus=None, read_zeroes=True):
    latency = null_latency(backend)
    if latency is not None:
        blockdev = "driver=null-co,node-name=disk,size=1073741824,read-zeroes=" + ("on" if read_zeroes else "off")
        if latency:
            blockdev += f",latency-ns={latency}"
    else:
        blockdev = f"driver=file,node-name=disk,filename={image},cache.direct=on,aio=io_uring"
    args = [
        "qemu-storage-daemon",
        "--blockdev", blockdev,
        "--object", "iothread,id=iot0" + (f",poll-max-ns={poll_max_ns}" if poll_max_ns is not None else ""),
        "--export", f"type=vhost-user-blk,id=exp0,node-name=disk,addr.type=unix,addr.path={sock},"
                    f"writable=on,num-queues={queues},iothread=iot0",
    ]
    return subprocess.Popen(pinned(args, cpus), stdout=subprocess.DEVNULL)


def spdk_root(held):
    """The chroot of SPDK's build (../shared/peers/: trixie.sh, spdk.sh) under HELD."""
    return os.path.join(held, "trixie")


def start_spdk(backend, image, sock, held, script, cpus=None):
    """SPDK's vhost target serving one controller at `sock` (inside the chroot:
    HELD/trixie/tmp/...) from a null bdev, or from an aio bdev on `image`
    (bind-mounted at /mnt in the chroot: SPDK's aio bdev opens it O_DIRECT).
    Its reactor polls the one CPU of `cpus` (default 1). Returns the wrapper's
    Popen; the server's own pid is spdk_pid(wrapper)."""
    env = dict(os.environ, HELD=held)
    if null_latency(backend) is None:
        mnt = os.path.join(spdk_root(held), "mnt")
        os.makedirs(mnt, exist_ok=True)
        if subprocess.run(["mountpoint", "-q", mnt]).returncode != 0:
            subprocess.run(["mount", "--bind", os.path.dirname(image), mnt], check=True)
        env["BDEV_RPC"] = f"bdev_aio_create /mnt/{os.path.basename(image)} null0 512"
    elif null_latency(backend):
        sys.exit("SPDK's null bdev has no latency: use null or file cells with spdk")
    cpu = (cpus or "1").split(",")[0]
    return subprocess.Popen([script, sock, cpu], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def spdk_pid(wrapper, timeout=60):
    """The pid of spdk_tgt started by spdk-null.sh `wrapper` (its child)."""
    t = time.time()
    while time.time() - t < timeout:
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read()
            except OSError:
                continue
            name = st[st.index("(") + 1:st.rindex(")")]
            if int(st.rsplit(")", 1)[1].split()[1]) == wrapper.pid and name.startswith(("spdk_tgt", "reactor")):
                return int(d)
        if wrapper.poll() is not None:
            sys.exit("spdk-null.sh exited early (build SPDK with ../shared/peers/spdk.sh)")
        time.sleep(0.1)
    sys.exit("spdk_tgt did not start")


def run_bench(target, iodepth, runtime, server_pid=None, rw="randread", numjobs=1, bs="4k", extra=(), cpus=None,
              ramp=1):
    args = [VQBLK, "bench", "--name", "bench", "--target", target, "--rw", rw, "--bs", bs,
            "--numjobs", str(numjobs), "--iodepth", str(iodepth), "--runtime", str(runtime), "--ramp_time", str(ramp),
            "--time_based", "--size", "256M", "--group_reporting", "--output-format", "json", *extra]
    cpu0, threads0 = proc_cpu(server_pid) if server_pid else (None, None)
    busy0 = machine_busy_ticks()
    t0 = time.time()
    for attempt in (1, 2):
        proc = subprocess.run(pinned(args, cpus), capture_output=True, text=True)
        if proc.returncode == 0:
            break
        err = f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}"
        if attempt == 2:
            raise RuntimeError(err)
        # One retry: a run is minutes into a sweep; the failure is reported.
        print(f"warning: retrying once: {err}", file=sys.stderr, flush=True)
        cpu0, threads0 = proc_cpu(server_pid) if server_pid else (None, None)
        busy0 = machine_busy_ticks()
        t0 = time.time()
    out = proc.stdout
    elapsed = time.time() - t0
    cpu1, threads1 = proc_cpu(server_pid) if server_pid else (None, None)
    busy1 = machine_busy_ticks()
    j = json.loads(out)
    job = j["jobs"][0]
    r = job["read"] if job["read"]["total_ios"] else job["write"]
    pct = r["clat_ns"]["percentile"]
    res = {
        "iops": r["iops"],
        "p50_us": pct["50.000000"] / 1000,
        "p99_us": pct["99.000000"] / 1000,
        "total_ios": r["total_ios"],
        "client_cpu_us_per_io": j["vqblk"].get("client_cpu_per_io_us") or 0.0,
        # The job threads' voluntary context switches per request (bench's count).
        "client_sleeps_per_io": j["vqblk"].get("client_sleeps_per_io") or 0.0,
    }
    # With --server-stats: the IOThreads' own counters over the run.
    iots = j["vqblk"].get("server_iothreads")
    if iots:
        reqs = sum(t["requests"] for t in iots)
        res["calls_per_io"] = sum(t["notifications"] for t in iots) / reqs if reqs else 0.0
    # Every CPU of the machine (client, server, and whatever else runs: the
    # OSD of a local Ceph cluster) over the run, per I/O, and how busy the
    # CPUs were: when they are all busy, IOPS follow this figure.
    ios_run = r["iops"] * elapsed
    res["machine_cpu_us_per_io"] = (busy1[0] - busy0[0]) / CLK_TCK / ios_run * 1e6 if ios_run else 0.0
    res["machine_busy"] = (busy1[0] - busy0[0]) / (busy1[1] - busy0[1]) if busy1[1] > busy0[1] else 0.0
    if server_pid:
        # CPU over the whole client run (ramp included) divided by the I/Os of
        # the whole run: the ramp's I/Os are estimated at the measured rate.
        ios_all = r["iops"] * elapsed
        res["server_cpu_s"] = cpu1 - cpu0
        res["server_cpu_per_s"] = (cpu1 - cpu0) / elapsed
        res["server_cpu_us_per_io"] = (cpu1 - cpu0) / ios_all * 1e6 if ios_all else 0.0
        # The same split by thread name (live threads only), to tell the
        # server's own loop from its libraries' threads (librbd's messenger...).
        res["server_cpu_us_per_io_by_thread"] = {
            name: (ticks - threads0.get(name, 0)) / CLK_TCK / ios_all * 1e6
            for name, ticks in sorted(threads1.items(), key=lambda kv: -kv[1])
            if ios_all and ticks > threads0.get(name, 0)
        }
    return res


def median_of(runs):
    """Per key, the median over the runs; a dict value (a split by thread)
    gets the median of each of its keys over the runs that have it."""
    out = {}
    for k, v in runs[0].items():
        if isinstance(v, dict):
            names = {n for r in runs for n in r.get(k, {})}
            out[k] = {n: statistics.median(r[k][n] for r in runs if n in r.get(k, {}))
                      for n in sorted(names)}
        else:
            out[k] = statistics.median(r[k] for r in runs)
    return out


def make_image(path, size_mib=512):
    """A raw image full of real data, so O_DIRECT reads hit the disk."""
    if os.path.exists(path) and os.path.getsize(path) == size_mib << 20:
        return
    with open(path, "wb") as f:
        for _ in range(size_mib):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())


def cacheline_rtt(cpus):
    """The cache-line round trip between two CPUs in ns (scripts/cacheline-rtt.sh), NaN if it failed.
    The host may place two vCPUs on cores that share a cache or not, and every
    cross-CPU figure follows: runs compare only in the same mode."""
    out = subprocess.run([os.path.join(ROOT, "scripts", "cacheline-rtt.sh"), *cpus],
                         capture_output=True, text=True).stdout
    try:
        return float(out.split(": ")[1].split()[0])
    except (IndexError, ValueError):
        return float("nan")


def ensure_tools(qsd=True):
    """Builds this tree's vqblk if it is missing; checks qemu-storage-daemon when it is needed."""
    if not os.path.exists(VQBLK):
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    if qsd and not shutil.which("qemu-storage-daemon"):
        sys.exit("qemu-storage-daemon not found (Debian qemu-utils; run scripts/install-deps.sh)")


def versions():
    qsd = shutil.which("qemu-storage-daemon")
    return {
        "vqblk": subprocess.run([VQBLK, "--version"], capture_output=True, text=True).stdout.strip(),
        "qemu-storage-daemon": subprocess.run([qsd, "--version"], capture_output=True,
                                              text=True).stdout.splitlines()[0] if qsd else None,
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                          "?"),
    }


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rotated(items, k):
    """`items` starting at its k-th (modulo its length): run k of a rotating order,
    so that no server always runs first or last."""
    k %= len(items)
    return items[k:] + items[:k]


@contextlib.contextmanager
def serving(proc, sock):
    """A started server, once its socket listens; stopped when the block ends."""
    try:
        wait_socket(sock, proc)
        yield proc
    finally:
        stop(proc)


def qsd_throttle_args(limits, nodes=("disk",)):
    """qemu-storage-daemon arguments putting the nodes `nodes` behind one
    throttle group with `limits` ("iops-total=100,iops-total-max=500"):
    returns (args, exported node names)."""
    opts = ",".join(f"limits.{kv}" for kv in limits.split(",") if kv)
    args = ["--object", f"throttle-group,id=tg0,{opts}"]
    for n in nodes:
        args += ["--blockdev", f"driver=throttle,node-name=thr-{n},throttle-group=tg0,file={n}"]
    return args, [f"thr-{n}" for n in nodes]


# fio's status line as `vqblk bench` draws it on a terminal:
# `Jobs: 1 [16.7%][r=4371KiB/s,w=0B/s][r=1.09k,w=0 IOPS][eta 00m:05s]`.
STATUS_LINE = re.compile(r"Jobs: \d+ \[([\d.]+)%\]\[r=([\d.]+)(B|KiB|MiB|GiB)/s,w=([\d.]+)(B|KiB|MiB|GiB)/s\]")
BINARY = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def status_series(text, bs):
    """Requests a second, one per update of the status lines in `text` (a
    terminal's output, frames separated by carriage returns). Each update
    sets the rates over the last interval (at least 1 s) and then the
    progress, so the first frame with a new progress figure carries that
    update's rates; the frames at 0.0% are drawn before the first update's
    progress. The bytes (four digits) are more precise than the IOPS (three)."""
    series = {}
    for frame in re.split(r"[\r\n]", text):
        m = STATUS_LINE.search(frame)
        if not m or float(m.group(1)) == 0 or m.group(1) in series:
            continue
        nbytes = float(m.group(2)) * BINARY[m.group(3)] + float(m.group(4)) * BINARY[m.group(5)]
        series[m.group(1)] = nbytes / bs
    return list(series.values())


def client_series(target, seconds, iodepth=32, bs=4096):
    """Requests a second completed by one `vqblk bench` run of `seconds`
    (random reads of `bs`, one connection, no ramp), read from the status
    line it draws once a second on a terminal (script(1) gives it one): the
    series of one uninterrupted client, whatever the server, which need not
    count anything itself (qemu-storage-daemon's exports have no counters)."""
    cmd = [VQBLK, "bench", "--name", "s", "--target", target, "--rw", "randread", "--bs", str(bs),
           "--iodepth", str(iodepth), "--runtime", str(seconds), "--time_based", "--size", "256M"]
    out = subprocess.run(["script", "-qefc", shlex.join(cmd), "/dev/null"], capture_output=True, text=True,
                         check=True).stdout
    series = status_series(out, bs)
    if len(series) < seconds - 1:
        raise RuntimeError(f"{len(series)} status updates in a {seconds} s run: {out[-500:]!r}")
    return series

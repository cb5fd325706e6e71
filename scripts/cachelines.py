#!/usr/bin/env python3
"""Cache lines a vqblk server touches per request, from valgrind lackey's
memory trace (`--trace-mem=yes`) read on stdin.

A request is the stretch of the trace from one entry of
`virtio::request::parse_head` to the next (every popped request is parsed
once). In each stretch the distinct 64-byte lines touched are counted by
where they live: the frontend's shared memory (each `rw-s` mapping, by
name: with libblkio `memfd:virtio-ring` holds the rings, descriptors,
request headers and status bytes, `memfd:libblkio-buf` the data), or the
server's own memory (also by mapping, the five largest). The shared lines
are the ones that travel between the frontend's CPU and the IOThread's; of
those, the lines the server writes are the ones it must take ownership of.

usage: cachelines.py BINARY PIDFILE SKIP COUNT < lackey-trace
"""
import os
import subprocess
import sys
import time
from collections import Counter

LINE = 64


def marker_offsets(binary):
    out = subprocess.run(["nm", "--defined-only", binary], capture_output=True,
                         text=True, check=True).stdout
    offs = [int(f.split()[0], 16) for f in out.splitlines()
            if "request10parse_head" in f]
    if not offs:
        sys.exit(f"{binary}: no symbol virtio::request::parse_head (inlined?); "
                 "nothing marks a request")
    return offs


def read_maps(pid):
    maps = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            name = parts[5].strip() if len(parts) > 5 else ""
            maps.append((lo, hi, parts[1], int(parts[2], 16), name))
    return maps


def mapping_label(lo, hi, perms, name):
    """A mapping as the counts name it: the frontend's by its name
    (`memfd:virtio-ring`), the server's own by file and permissions, or by
    size if anonymous (under valgrind a thread's stack and malloc's arenas
    are; a Rust thread's stack is 2 MiB)."""
    if perms.endswith("s"):
        return name.split("/")[-1].replace(" (deleted)", "")
    if name:
        return f"{name.split('/')[-1]} {perms}"
    return f"anonymous {(hi - lo) // 1024} KiB {perms}"


def main():
    binary, pidfile, skip, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    offs = marker_offsets(binary)
    real = os.path.realpath(binary)
    markers = None
    mappings = []  # (lo line, hi line, label, shared with the frontend)
    pid = None
    requests = 0
    seen = {}  # line -> written?
    shared = Counter()  # lines in the frontend's mappings, by mapping
    written = Counter()  # of those, the lines the server wrote
    own = Counter()  # the server's own lines, by mapping
    for raw in sys.stdin:
        c = raw[0]
        if c == "=":
            continue
        if c == "I":
            if markers is None:
                while pid is None:
                    try:
                        pid = int(open(pidfile).read())
                    except (OSError, ValueError):
                        time.sleep(0.05)
                base = [lo - off for lo, _, _, off, name in read_maps(pid)
                        if os.path.realpath(name or "/") == real and off == 0]
                if not base:
                    sys.exit(f"{binary} is not mapped in process {pid}")
                markers = {base[0] + o for o in offs}
            addr = int(raw[3:raw.index(",")], 16)
            if addr in markers:
                if requests == 0:
                    # The frontend's memory is mapped by now.
                    mappings = [(lo // LINE, (hi - 1) // LINE, mapping_label(lo, hi, perms, name),
                                 perms.endswith("s"))
                                for lo, hi, perms, _, name in read_maps(pid)]
                if skip < requests <= skip + count:
                    for line, wrote in seen.items():
                        label, is_shared = next(((label, sh) for lo, hi, label, sh in mappings
                                                 if lo <= line <= hi), ("unmapped", False))
                        if not is_shared:
                            own[label] += 1
                            continue
                        shared[label] += 1
                        if wrote:
                            written[label] += 1
                requests += 1
                seen.clear()
                if requests > skip + count:
                    break
            continue
        if requests <= skip:
            continue
        comma = raw.index(",")
        addr = int(raw[3:comma], 16)
        size = int(raw[comma + 1:])
        write = raw[1] != "L"
        for line in range(addr // LINE, (addr + size - 1) // LINE + 1):
            if write:
                seen[line] = True
            else:
                seen.setdefault(line, False)
    measured = min(max(requests - 1 - skip, 0), count)
    if measured == 0:
        sys.exit(f"no request measured ({requests} seen, {skip} skipped)")
    parts = [f"{n / measured:.1f} in {label} ({written[label] / measured:.1f} written)"
             for label, n in sorted(shared.items())]
    shared_total, own_total = sum(shared.values()), sum(own.values())
    print(f"{(shared_total + own_total) / measured:.1f} cache lines per request "
          f"over {measured} requests: {shared_total / measured:.1f} shared with the frontend "
          f"[{'; '.join(parts) or 'none'}], {own_total / measured:.1f} the server's own")
    print("  the server's own by mapping: " + "; ".join(
        f"{n / measured:.1f} {label}" for label, n in own.most_common(5)))


if __name__ == "__main__":
    main()

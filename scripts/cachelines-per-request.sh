#!/bin/bash
# Cache lines the server touches per request, from valgrind lackey's memory
# trace (scripts/cachelines.py says how requests are told apart and lines
# classified). 4k random I/O at QD16 (or IODEPTH) through the server that
# scripts/valgrind-serve.sh describes, as for
# scripts/instructions-per-request.sh. The first 1024 requests are skipped
# (warm-up), the next 2048 counted. Like instruction counts, line counts do
# not depend on what else the machine is doing.
#
# usage: scripts/cachelines-per-request.sh [VQBLK_BINARY] [randread|randwrite] [IODEPTH]
set -euo pipefail
. "$(dirname "$0")/valgrind-serve.sh"
skip=1024
count=2048
vg=
trap '[ -n "$vg" ] && kill -INT "$vg" 2>/dev/null; rm -rf "$t"' EXIT
mkfifo "$t/trace"
python3 "$root/scripts/cachelines.py" "$bin" "$t/pid" "$skip" "$count" <"$t/trace" >"$t/result" &
py=$!
valgrind --tool=lackey --trace-mem=yes --log-fd=9 "$bin" "${serve_args[@]}" 9>"$t/trace" \
    >"$t/log" 2>&1 &
vg=$!
echo "$vg" >"$t/pid"
wait_for_server
drive $((skip + count + 64))
wait "$py" || { cat "$t/result" >&2; exit 1; }
echo "$bin $rw QD$depth: $(cat "$t/result")"

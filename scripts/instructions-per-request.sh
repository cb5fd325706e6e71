#!/bin/bash
# Server instructions per request, counted by callgrind (valgrind): the same
# count for the same binary and input whatever else the machine is doing,
# unlike timings on a shared 2-vCPU host. Null backend, 4k random I/O at QD16
# (or IODEPTH), 65536 requests from `vqblk bench` (libblkio), `--poll off` (no spinning to
# count) and `--seccomp off` (valgrind's own syscalls). The null backend's
# memset of read data is reported apart: it is the same for every version.
#
# Below QD16, 16384 requests are counted; at QD1 every request is a wake-up
# of the IOThread.
#
# usage: scripts/instructions-per-request.sh [VQBLK_BINARY] [randread|randwrite] [IODEPTH]
set -euo pipefail
. "$(dirname "$0")/valgrind-serve.sh"
requests=65536
[ "$depth" -ge 16 ] || requests=16384
trap 'pkill -INT -f "callgrind-out-file=$t/out" 2>/dev/null || true; rm -rf "$t"' EXIT
timeout 600 valgrind --tool=callgrind --callgrind-out-file="$t/out" "$bin" "${serve_args[@]}" \
    >"$t/log" 2>&1 &
vg=$!
wait_for_server
drive "$requests"
pkill -INT -f "callgrind-out-file=$t/out"
wait "$vg" || true
total=$(callgrind_annotate --auto=no "$t/out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
memset=$(callgrind_annotate --auto=no "$t/out" 2>/dev/null | awk '/__memset/ && !n {gsub(",", "", $1); print $1; n = 1}')
memset=${memset:-0}
echo "$bin $rw QD$depth: $(( (total - memset) / requests )) instructions per request (+ $(( memset / requests )) in the null backend's memset), $total in all"

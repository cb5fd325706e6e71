#!/bin/bash
# Server instructions per request, counted by callgrind (valgrind): the same
# count for the same binary and input whatever else the machine is doing,
# unlike timings on a shared 2-vCPU host. Null backend, 4k random I/O at QD16,
# 65536 requests from `vqblk bench` (libblkio), `--poll off` (no spinning to
# count) and `--seccomp off` (valgrind's own syscalls). The null backend's
# memset of read data is reported apart: it is the same for every version.
#
# usage: scripts/instructions-per-request.sh [VQBLK_BINARY] [randread|randwrite]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$root/target/release/vqblk}
rw=${2:-randread}
command -v valgrind >/dev/null || { echo "valgrind is needed (Debian package valgrind)" >&2; exit 2; }
# Builds from before the seccomp filter have no --seccomp.
seccomp=()
"$bin" serve --help | grep -q -- --seccomp && seccomp=(--seccomp off)
t=$(mktemp -d /tmp/vqblk-cg.XXXXXX)
trap 'pkill -INT -f "callgrind-out-file=$t/out" 2>/dev/null || true; rm -rf "$t"' EXIT
timeout 600 valgrind --tool=callgrind --callgrind-out-file="$t/out" "$bin" serve --backend null \
    --size 1G --socket "$t/s.sock" --queues 1 --iothreads 1 --log-level warn --poll off \
    "${seccomp[@]}" >"$t/log" 2>&1 &
vg=$!
for _ in $(seq 150); do [ -S "$t/s.sock" ] && break; sleep 0.2; done
[ -S "$t/s.sock" ] || { cat "$t/log" >&2; exit 1; }
"$root/target/release/vqblk" bench --name cg --target "unix:$t/s.sock" --rw "$rw" --bs 4k \
    --iodepth 16 --size 256M >"$t/bench" 2>&1
pkill -INT -f "callgrind-out-file=$t/out"
wait "$vg" || true
total=$(callgrind_annotate --auto=no "$t/out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
memset=$(callgrind_annotate --auto=no "$t/out" 2>/dev/null | awk '/__memset/ && !n {gsub(",", "", $1); print $1; n = 1}')
memset=${memset:-0}
echo "$bin $rw: $(( (total - memset) / 65536 )) instructions per request (+ $(( memset / 65536 )) in the null backend's memset), $total in all"

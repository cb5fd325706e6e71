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
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$root/target/release/vqblk}
rw=${2:-randread}
depth=${3:-16}
case $depth in ''|*[!0-9]*|0) echo "IODEPTH must be a positive number: $depth" >&2; exit 2 ;; esac
requests=65536
[ "$depth" -ge 16 ] || requests=16384
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
    --iodepth "$depth" --size $((requests * 4))K >"$t/bench" 2>&1
pkill -INT -f "callgrind-out-file=$t/out"
wait "$vg" || true
total=$(callgrind_annotate --auto=no "$t/out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
memset=$(callgrind_annotate --auto=no "$t/out" 2>/dev/null | awk '/__memset/ && !n {gsub(",", "", $1); print $1; n = 1}')
memset=${memset:-0}
echo "$bin $rw QD$depth: $(( (total - memset) / requests )) instructions per request (+ $(( memset / requests )) in the null backend's memset), $total in all"

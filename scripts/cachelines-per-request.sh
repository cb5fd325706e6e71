#!/bin/bash
# Cache lines the server touches per request, from valgrind lackey's memory
# trace (scripts/cachelines.py says how requests are told apart and lines
# classified). Null backend, 4k random I/O at QD16 (or IODEPTH), `vqblk
# bench` (libblkio) as the frontend, `--poll off` and `--seccomp off` as in
# scripts/instructions-per-request.sh. The first 1024 requests are skipped
# (warm-up), the next 2048 counted. Like instruction counts, line counts do
# not depend on what else the machine is doing.
#
# usage: scripts/cachelines-per-request.sh [VQBLK_BINARY] [randread|randwrite] [IODEPTH]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:-$root/target/release/vqblk}
rw=${2:-randread}
depth=${3:-16}
case $depth in ''|*[!0-9]*|0) echo "IODEPTH must be a positive number: $depth" >&2; exit 2 ;; esac
skip=1024
count=2048
command -v valgrind >/dev/null || { echo "valgrind is needed (Debian package valgrind)" >&2; exit 2; }
seccomp=()
"$bin" serve --help | grep -q -- --seccomp && seccomp=(--seccomp off)
t=$(mktemp -d /tmp/vqblk-cl.XXXXXX)
vg=
trap '[ -n "$vg" ] && kill -INT "$vg" 2>/dev/null; rm -rf "$t"' EXIT
mkfifo "$t/trace"
python3 "$root/scripts/cachelines.py" "$bin" "$t/pid" "$skip" "$count" <"$t/trace" >"$t/result" &
py=$!
valgrind --tool=lackey --trace-mem=yes --log-fd=9 "$bin" serve --backend null \
    --size 1G --socket "$t/s.sock" --queues 1 --iothreads 1 --log-level warn --poll off \
    "${seccomp[@]}" 9>"$t/trace" >"$t/log" 2>&1 &
vg=$!
echo "$vg" >"$t/pid"
for _ in $(seq 300); do [ -S "$t/s.sock" ] && break; sleep 0.2; done
[ -S "$t/s.sock" ] || { cat "$t/log" >&2; exit 1; }
"$root/target/release/vqblk" bench --name cl --target "unix:$t/s.sock" --rw "$rw" --bs 4k \
    --iodepth "$depth" --size $(( (skip + count + 64) * 4 ))K >"$t/bench" 2>&1
wait "$py" || { cat "$t/result" >&2; exit 1; }
echo "$bin $rw QD$depth: $(cat "$t/result")"

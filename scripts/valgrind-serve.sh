# Sourced by scripts/instructions-per-request.sh and
# scripts/cachelines-per-request.sh: their arguments ([VQBLK_BINARY]
# [randread|randwrite] [IODEPTH]), and the server both run under a valgrind
# tool with `vqblk bench` (libblkio) as its frontend: null backend, one queue
# and one IOThread, `--poll off` (no spinning to count) and `--seccomp off`
# (valgrind's own system calls).
#
# Sets root, bin, rw, depth, t (a scratch directory; the caller removes it)
# and serve_args; wait_for_server and drive REQUESTS use them.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${1:-$root/target/release/vqblk}
rw=${2:-randread}
depth=${3:-16}
case $depth in ''|*[!0-9]*|0) echo "IODEPTH must be a positive number: $depth" >&2; exit 2 ;; esac
command -v valgrind >/dev/null || { echo "valgrind is needed (Debian package valgrind)" >&2; exit 2; }
# Builds from before the seccomp filter have no --seccomp.
seccomp=()
"$bin" serve --help | grep -q -- --seccomp && seccomp=(--seccomp off)
t=$(mktemp -d /tmp/vqblk-valgrind.XXXXXX)
serve_args=(serve --backend null --size 1G --socket "$t/s.sock" --queues 1 --iothreads 1
    --log-level warn --poll off "${seccomp[@]}")

# Waits (up to a minute: valgrind starts slowly) for the server's socket; the
# server's output is expected in $t/log.
wait_for_server() {
    for _ in $(seq 300); do [ -S "$t/s.sock" ] && return; sleep 0.2; done
    cat "$t/log" >&2
    exit 1
}

# Sends REQUESTS 4 KiB requests of $rw at QD$depth through the server.
drive() {
    "$root/target/release/vqblk" bench --name valgrind --target "unix:$t/s.sock" --rw "$rw" \
        --bs 4k --iodepth "$depth" --size $(($1 * 4))K >"$t/bench" 2>&1
}

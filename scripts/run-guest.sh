#!/usr/bin/env bash
# run-guest.sh - boot the vqblk test guest under QEMU (TCG) against a vhost-user-blk
# socket, wait for it to power off, and report its VQBLK-RESULT line.
#
# Usage:
#   run-guest.sh --socket PATH [--queues N] [--append 'vqblk.mode=rw ...'] [--log FILE]
#                [--timeout SEC] [--guest-dir DIR] [--smp N] [--mem SIZE]
#                [--queue-size N] [--reconnect-ms MS] [--qmp PATH] [--pidfile PATH]
#                [--allow-reboot] [-- EXTRA QEMU ARGS]
#
#   --socket PATH      vhost-user-blk server socket (required); QEMU is the client
#   --queues N         num-queues of the vhost-user-blk-pci device (default 1)
#   --append STR       extra kernel command line (the guest-init.sh vqblk.* params)
#   --log FILE         serial console log (default: a temp file, removed on success)
#   --timeout SEC      kill QEMU after SEC seconds (default 180)
#   --guest-dir DIR    dir with vmlinuz + initramfs.cpio.gz (default: $VQBLK_GUEST_DIR,
#                      else target/vqblk-guest in the repo; built if missing/stale)
#   --smp N            vCPUs (default 2)
#   --mem SIZE         guest RAM, shared memfd (default 512M)
#   --queue-size N     virtqueue size (default: QEMU's, 128)
#   --reconnect-ms MS  chardev reconnect-ms (QEMU reconnects if the backend goes away)
#   --qmp PATH         also expose a QMP unix socket (for device/backend tests)
#   --pidfile PATH     QEMU writes its pid there (to kill -9 QEMU itself: killing this
#                      script does not reach it, `timeout` runs it in its own group)
#   --allow-reboot     drop -no-reboot, so a guest reboot resets the devices inside the
#                      same QEMU process (guest-init.sh vqblk.reboot=1); a guest panic
#                      then reboots too (the guest is re-run until --timeout)
#
# stdout: the VQBLK-RESULT line (without the prefix: just the JSON), if any.
# Exit status: 0  guest reported ok=true
#              1  guest reported ok=false
#              2  no VQBLK-RESULT line (QEMU failed, guest crashed, ...)
#              124 timeout (QEMU killed)
# Progress/diagnostics go to stderr.  QEMU's own stderr goes to stderr too.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)

SOCKET='' QUEUES=1 APPEND='' LOG='' TIMEOUT=180 SMP=2 MEM=512M QSIZE='' RECONNECT='' QMP=''
PIDFILE='' REBOOT=0
GUEST_DIR=${VQBLK_GUEST_DIR:-$REPO/target/vqblk-guest}
EXTRA=()

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --socket) SOCKET=$2; shift 2 ;;
        --queues) QUEUES=$2; shift 2 ;;
        --append) APPEND=$2; shift 2 ;;
        --log) LOG=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        --guest-dir) GUEST_DIR=$2; shift 2 ;;
        --smp) SMP=$2; shift 2 ;;
        --mem) MEM=$2; shift 2 ;;
        --queue-size) QSIZE=$2; shift 2 ;;
        --reconnect-ms) RECONNECT=$2; shift 2 ;;
        --qmp) QMP=$2; shift 2 ;;
        --pidfile) PIDFILE=$2; shift 2 ;;
        --allow-reboot) REBOOT=1; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) usage ;;
        *) echo "run-guest: unknown argument $1" >&2; usage ;;
    esac
done
[ -n "$SOCKET" ] || { echo "run-guest: --socket is required" >&2; usage; }

# Build (or reuse) kernel + initramfs; build-initramfs.sh is a no-op when up to date.
"$HERE/build-initramfs.sh" "$GUEST_DIR" >&2

KEEP_LOG=1
if [ -z "$LOG" ]; then LOG=$(mktemp /tmp/vqblk-guest.XXXXXX.log); KEEP_LOG=0; fi
: > "$LOG"

chardev="socket,id=vhost0,path=$SOCKET"
[ -n "$RECONNECT" ] && chardev+=",reconnect-ms=$RECONNECT"
device="vhost-user-blk-pci,chardev=vhost0,num-queues=$QUEUES"
[ -n "$QSIZE" ] && device+=",queue-size=$QSIZE"

# shellcheck disable=SC2054  # the commas are QEMU option syntax
args=(
    -M q35,memory-backend=mem
    # vhost-user needs guest RAM in a shareable fd
    -object "memory-backend-memfd,id=mem,size=$MEM,share=on"
    -m "$MEM"
    -smp "$SMP"
    -accel tcg
    # -nodefaults: no VGA, NIC, floppy, CD-ROM, parallel port or default monitor
    -nodefaults -display none -vga none -nic none -monitor none
    -serial "file:$LOG"
    -kernel "$GUEST_DIR/vmlinuz"
    -initrd "$GUEST_DIR/initramfs.cpio.gz"
    # panic=-1: reboot at once on panic, which -no-reboot turns into QEMU exiting
    -append "console=ttyS0 quiet panic=-1 $APPEND"
    -chardev "$chardev"
    -device "$device"
)
[ -n "$QMP" ] && args+=(-qmp "unix:$QMP,server=on,wait=off")
[ -n "$PIDFILE" ] && args+=(-pidfile "$PIDFILE")
# -no-reboot: a guest reboot (or a panic, see panic=-1 above) makes QEMU exit.
[ "$REBOOT" -eq 1 ] || args+=(-no-reboot)

echo "run-guest: qemu-system-x86_64 ${args[*]} ${EXTRA[*]}" >&2
start=$(date +%s.%N)
qemu_err=$(mktemp)
trap 'rm -f "$qemu_err"' EXIT
for attempt in 1 2; do
    rc=0
    # stdin from /dev/null: nothing of QEMU reads it, and CI has none.
    timeout -k 10 "$TIMEOUT" qemu-system-x86_64 "${args[@]}" "${EXTRA[@]}" </dev/null \
        2>"$qemu_err" || rc=$?
    cat "$qemu_err" >&2
    # QEMU's own crash at boot (see qemu-crashed-at-boot.sh): boot once more,
    # and say so (tests that count the backend's connections read this line).
    if [ "$attempt" -eq 1 ] && [ "$rc" -eq 134 ] &&
        "$HERE/qemu-crashed-at-boot.sh" "$qemu_err" "$LOG"; then
        echo "run-guest: QEMU aborted on its own assertion before the guest's init ran (a QEMU TCG crash); booting again" >&2
        continue
    fi
    break
done
end=$(date +%s.%N)
elapsed=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')

result=$(tr -d '\r' < "$LOG" | sed -n 's/^.*VQBLK-RESULT //p' | tail -n 1)
# 124: timeout fired; 137: QEMU got SIGKILL, from `timeout -k` only if the time ran out
# (anything else, e.g. a test doing kill -9 on QEMU, is "no result", not a timeout).
timed_out=$(awk -v e="$elapsed" -v t="$TIMEOUT" 'BEGIN { print (e >= t) ? 1 : 0 }')
if [ "$rc" -eq 124 ] || { [ "$rc" -eq 137 ] && [ "$timed_out" -eq 1 ]; }; then
    echo "run-guest: TIMEOUT after ${TIMEOUT}s; serial log: $LOG" >&2
    tail -n 20 "$LOG" >&2 || true
    [ -n "$result" ] && echo "$result"
    exit 124
fi
if [ -z "$result" ]; then
    echo "run-guest: no VQBLK-RESULT line (qemu exit $rc, ${elapsed}s); serial log: $LOG" >&2
    tail -n 30 "$LOG" >&2 || true
    exit 2
fi
echo "$result"
# guest-init.sh always prints "ok" as the first member (nested objects have "ok" too)
case "$result" in
    '{"ok":true,'*)
        echo "run-guest: guest OK in ${elapsed}s (qemu exit $rc)" >&2
        [ "$KEEP_LOG" -eq 1 ] || rm -f "$LOG"
        exit 0 ;;
    *)
        echo "run-guest: guest reported failure in ${elapsed}s; serial log: $LOG" >&2
        exit 1 ;;
esac

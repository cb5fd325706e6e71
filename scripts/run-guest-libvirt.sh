#!/usr/bin/env bash
# run-guest-libvirt.sh - boot the vqblk test guest through libvirt (a transient
# domain, TCG) with a <disk type='vhostuser'> on a vhost-user-blk socket, wait
# for it to power off, and report its VQBLK-RESULT line: the same guest and the
# same verdict as run-guest.sh, but the QEMU command line is libvirt's, built
# from the domain XML that docs/qemu.md documents.
#
# Usage:
#   run-guest-libvirt.sh --socket PATH [--queues N] [--append 'vqblk.mode=rw ...']
#                        [--log FILE] [--timeout SEC] [--guest-dir DIR] [--smp N]
#                        [--mem-mib N] [--name NAME] [--xml-out FILE]
#
#   --socket PATH   vhost-user-blk server socket (required)
#   --queues N      <driver queues='N'> (default 1)
#   --append STR    extra kernel command line (guest-init.sh's vqblk.* parameters)
#   --log FILE      serial console log (default: a temp file, removed on success)
#   --timeout SEC   destroy the domain after SEC seconds (default 240)
#   --guest-dir DIR vmlinuz + initramfs.cpio.gz (default: $VQBLK_GUEST_DIR, else
#                   target/vqblk-guest in the repo; built if missing or stale)
#   --smp N         vCPUs (default 2)
#   --mem-mib N     guest RAM in MiB, shared memfd (default 512)
#   --name NAME     domain name (default vqblk-guest-PID)
#   --xml-out FILE  also keep the domain XML there
#
# libvirt: the system driver (qemu:///system, or $VQBLK_LIBVIRT_URI); its
# daemons (libvirtd, virtlogd) are started when they are not running. QEMU runs
# as libvirt's qemu user, so the socket must be reachable by it (`vqblk serve
# --socket-mode 0666` in a directory others may search). Needs libvirt-clients,
# libvirt-daemon and libvirt-daemon-driver-qemu (scripts/install-deps.sh).
#
# stdout: the VQBLK-RESULT JSON, if any. Exit status: 0 guest ok, 1 guest
# reported failure, 2 no result (libvirt or QEMU failed, guest crashed), 124 timeout.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SOCKET='' QUEUES=1 APPEND='' LOG='' TIMEOUT=240 SMP=2 MEM_MIB=512 NAME="vqblk-guest-$$" XML_OUT=''
GUEST_DIR=${VQBLK_GUEST_DIR:-$REPO/target/vqblk-guest}
URI=${VQBLK_LIBVIRT_URI:-qemu:///system}
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
        --mem-mib) MEM_MIB=$2; shift 2 ;;
        --name) NAME=$2; shift 2 ;;
        --xml-out) XML_OUT=$2; shift 2 ;;
        -h|--help) usage ;;
        *) echo "run-guest-libvirt: unknown argument $1" >&2; usage ;;
    esac
done
[ -n "$SOCKET" ] || { echo "run-guest-libvirt: --socket is required" >&2; usage; }
command -v virsh >/dev/null || { echo "run-guest-libvirt: virsh not found (scripts/install-deps.sh)" >&2; exit 2; }
# The system driver's daemons, started here when no service manager did it
# (a container, CI): virtlogd collects QEMU's output, libvirtd runs the domain.
if [ "$URI" = qemu:///system ]; then
    # A socket file alone proves nothing: a daemon killed with its container
    # leaves it behind, and libvirtd then fails with "Connection refused".
    if ! pgrep -x virtlogd >/dev/null; then
        rm -f /run/libvirt/virtlogd-sock /run/libvirt/virtlogd-admin-sock
        virtlogd -d
        for _ in $(seq 50); do [ -S /run/libvirt/virtlogd-sock ] && break; sleep 0.1; done
    fi
    if ! virsh -q -c "$URI" version >/dev/null 2>&1; then
        libvirtd -d
        for _ in $(seq 100); do virsh -q -c "$URI" version >/dev/null 2>&1 && break; sleep 0.2; done
    fi
fi
"$HERE/build-initramfs.sh" "$GUEST_DIR" >&2
SOCKET=$(readlink -f "$SOCKET")
GUEST_DIR=$(readlink -f "$GUEST_DIR")
KEEP_LOG=1
if [ -z "$LOG" ]; then LOG=$(mktemp /tmp/vqblk-guest.XXXXXX.log); KEEP_LOG=0; fi
: > "$LOG"
LOG=$(readlink -f "$LOG")
xml=$(mktemp /tmp/vqblk-domain.XXXXXX.xml)
trap 'rm -f "$xml"; virsh -q -c "$URI" destroy "$NAME" >/dev/null 2>&1 || true' EXIT
esc() { sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' -e "s/'/\&apos;/g" <<<"$1"; }
cat >"$xml" <<EOF
<domain type='qemu'>
  <name>$NAME</name>
  <memory unit='MiB'>$MEM_MIB</memory>
  <memoryBacking>
    <source type='memfd'/>
    <access mode='shared'/>
  </memoryBacking>
  <vcpu>$SMP</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>$GUEST_DIR/vmlinuz</kernel>
    <initrd>$GUEST_DIR/initramfs.cpio.gz</initrd>
    <cmdline>$(esc "console=ttyS0 quiet panic=-1 $APPEND")</cmdline>
  </os>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <disk type='vhostuser' device='disk'>
      <driver name='qemu' type='raw' queues='$QUEUES'/>
      <source type='unix' path='$(esc "$SOCKET")'>
        <reconnect enabled='yes' timeout='10'/>
      </source>
      <target dev='vda' bus='virtio'/>
    </disk>
    <serial type='file'>
      <source path='$(esc "$LOG")'/>
      <target port='0'/>
    </serial>
    <memballoon model='none'/>
  </devices>
</domain>
EOF
[ -n "$XML_OUT" ] && cp "$xml" "$XML_OUT"
echo "run-guest-libvirt: virsh -c $URI create $xml (domain $NAME)" >&2
start=$(date +%s)
if ! virsh -q -c "$URI" create "$xml" >&2; then
    echo "run-guest-libvirt: libvirt refused the domain:" >&2
    cat "$xml" >&2
    exit 2
fi
rc=0
# A transient domain disappears when QEMU exits (the guest powers off).
while virsh -q -c "$URI" domstate "$NAME" >/dev/null 2>&1; do
    if [ $(( $(date +%s) - start )) -ge "$TIMEOUT" ]; then rc=124; break; fi
    sleep 1
done
elapsed=$(( $(date +%s) - start ))
result=$(tr -d '\r' < "$LOG" | sed -n 's/^.*VQBLK-RESULT //p' | tail -n 1)
if [ "$rc" -eq 124 ]; then
    echo "run-guest-libvirt: TIMEOUT after ${TIMEOUT}s; serial log: $LOG" >&2
    tail -n 20 "$LOG" >&2 || true
    exit 124
fi
if [ -z "$result" ]; then
    echo "run-guest-libvirt: no VQBLK-RESULT line after ${elapsed}s; serial log: $LOG" >&2
    tail -n 30 "$LOG" >&2 || true
    qlog=${XDG_CONFIG_HOME:-$HOME/.cache}/libvirt/qemu/log/$NAME.log
    [ -f "$qlog" ] && tail -n 20 "$qlog" >&2
    exit 2
fi
echo "$result"
case "$result" in
    '{"ok":true,'*)
        echo "run-guest-libvirt: guest OK in ${elapsed}s" >&2
        [ "$KEEP_LOG" -eq 1 ] || rm -f "$LOG"
        exit 0 ;;
    *)
        echo "run-guest-libvirt: guest reported failure in ${elapsed}s; serial log: $LOG" >&2
        exit 1 ;;
esac

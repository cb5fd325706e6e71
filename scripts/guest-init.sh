#!/bin/sh
# guest-init.sh - /init of vqblk's test guest (runs under busybox sh as PID 1).
#
# Loads the virtio modules, runs block-device checks on /dev/vda (the
# vhost-user-blk disk), prints progress lines "vqblk: ..." and finally ONE line
#
#   VQBLK-RESULT {"ok":true,"failures":[],...}
#
# on the console, then powers the VM off.  Parameters come from the kernel
# command line (all optional):
#
#   vqblk.mode=rw|ro|read-verify   rw (default): parallel pattern writes + read-back
#                                  ro: device must be read-only, writes must fail,
#                                      reads must work
#                                  read-verify: only read back and check the
#                                      patterns a previous rw boot wrote
#   vqblk.writers=N        number of writer regions (default: nproc, one per CPU)
#   vqblk.region_kib=K     bytes per writer region, in KiB (default 4096, rounded
#                          down to a multiple of 64); writer i's region starts at
#                          i * 2 * region
#   vqblk.seed=S           pattern seed (default 0), so boots can write distinct data
#   vqblk.verify=1         in ro mode, also verify the patterns (as read-verify)
#   vqblk.discard=1        rw mode: device must advertise discard; a discarded
#                          region (after the writer regions) must read back as zeroes
#   vqblk.discard_kib=K    size of that region (default 1024)
#   vqblk.queues=N         the device's num-queues: expect min(N, possible CPUs)
#                          dirs in /sys/block/vda/mq
#   vqblk.mq_queues=N      expect exactly N dirs in /sys/block/vda/mq
#   vqblk.capacity_sectors=N       expected /sys/block/vda/size (512-byte units)
#   vqblk.logical_block_size=N     expected logical block size
#   vqblk.serial=XYZ       expected /sys/block/vda/serial
#   vqblk.dev=vda          device name (default vda)
#   vqblk.timeout=SEC      guest watchdog: report failure and power off after SEC
#                          seconds (default 240)
#   vqblk.reboot=1         rw mode only: exercise a device reset inside one QEMU
#                          process.  Boot 1 runs the rw checks; if they pass it
#                          writes a marker into the device's last 64 KiB and does
#                          `reboot -f` (needs QEMU without -no-reboot: run-guest.sh
#                          --allow-reboot).  Boot 2 finds the marker, clears it,
#                          re-reads the writer regions (as read-verify) and reports
#                          {"boot":2,"rebooted":true,...}.  A boot-1 failure is
#                          reported at once with "boot":1.
#   vqblk.mode=migrate     live-migration load (tests/guest_migration.rs): each
#                          writer writes sequence-numbered 4 KiB blocks over its
#                          vqblk.blocks blocks (as seqwrite), reads each back and
#                          compares, with O_DIRECT, until the host writes the stop
#                          marker "VQBLK-STOP" into the device's last 4 KiB or
#                          vqblk.seconds pass; a progress line every 8 writes
#   vqblk.mode=irq         interrupts per request: 16 parallel readers of
#                          vqblk.blocks 4 KiB O_DIRECT blocks each (QD16); reports
#                          irq_requests, irq_interrupts (the device's virtio
#                          request vectors) and irq_centiseconds
#   vqblk.mode=paced       I/O under a daemon's limit (tests/guest_e2e.rs): 4
#                          readers of 4 KiB O_DIRECT blocks for vqblk.seconds;
#                          a failed read (an I/O error, not a slow one) fails
#                          the run; reports paced_reads (the device's completed
#                          reads) and paced_centiseconds
#   vqblk.read_mib=M       migrate mode: also a reader reads the M MiB at
#   vqblk.read_off_mib=O   offset O MiB over and over with O_DIRECT (dd | awk) and
#                          checks that every sector holds "VQBLK-RD k=K s=S|" (the
#                          host wrote them): data the device wrote into dd's buffer
#                          and that reached a migration's destination stale fails
#   vqblk.idloop=1         seqwrite mode: also read $SYS/serial over and over while
#                          the writers run: each read is a GET_ID request, which the
#                          daemon answers at once, so on a null export with
#                          latency-ns it overtakes the writes in flight on the same
#                          queue (completions out of ring order at a daemon kill)
#   vqblk.compare=0        migrate mode: do not compare what is read back (null
#                          backend: reads return zeroes)
#   vqblk.debug=1          set -x
#
# The pattern (scripts/check-image.py recomputes it on the host): every 512-byte
# sector with absolute LBA L in writer W's region holds
#   "VQBLK seed=S writer=W lba=L|" + C * (511 - len(header)) + "\n"
# where C = "abcdefghijklmnopqrstuvwxyz"[(L + 7*W + S) % 26].
#
# shellcheck shell=sh
# shellcheck disable=SC3037  # busybox echo -n is fine

PATH=/bin:/sbin:/usr/bin:/usr/sbin
export PATH

mkdir -p /proc /sys /dev /tmp
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
# The initramfs may lack /dev/console at exec time; make sure our output goes to it.
exec </dev/console >/dev/console 2>&1

# ------------------------------------------------------------------ parameters
P_MODE=rw
P_WRITERS=
P_REGION_KIB=4096
P_SEED=0
P_VERIFY=0
P_DISCARD=0
P_DISCARD_KIB=1024
P_QUEUES=
P_MQ_QUEUES=
P_CAPACITY=
P_LBS=
P_SERIAL=
P_SERIAL_SET=0
P_DEV=vda
P_TIMEOUT=240
P_DEBUG=0
P_REBOOT=0
P_SECONDS=30
P_BLOCKS=64
P_COMPARE=1
P_READ_MIB=0
P_READ_OFF_MIB=16
P_IDLOOP=0

# shellcheck disable=SC2013  # word splitting of the cmdline is what we want
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        vqblk.mode=*)               P_MODE=${arg#*=} ;;
        vqblk.writers=*)            P_WRITERS=${arg#*=} ;;
        vqblk.region_kib=*)         P_REGION_KIB=${arg#*=} ;;
        vqblk.seed=*)               P_SEED=${arg#*=} ;;
        vqblk.verify=*)             P_VERIFY=${arg#*=} ;;
        vqblk.discard=*)            P_DISCARD=${arg#*=} ;;
        vqblk.discard_kib=*)        P_DISCARD_KIB=${arg#*=} ;;
        vqblk.queues=*)             P_QUEUES=${arg#*=} ;;
        vqblk.mq_queues=*)          P_MQ_QUEUES=${arg#*=} ;;
        vqblk.capacity_sectors=*)   P_CAPACITY=${arg#*=} ;;
        vqblk.logical_block_size=*) P_LBS=${arg#*=} ;;
        vqblk.serial=*)             P_SERIAL=${arg#*=}; P_SERIAL_SET=1 ;;
        vqblk.dev=*)                P_DEV=${arg#*=} ;;
        vqblk.timeout=*)            P_TIMEOUT=${arg#*=} ;;
        vqblk.debug=*)              P_DEBUG=${arg#*=} ;;
        vqblk.reboot=*)             P_REBOOT=${arg#*=} ;;
        vqblk.seconds=*)            P_SECONDS=${arg#*=} ;;
        vqblk.blocks=*)             P_BLOCKS=${arg#*=} ;;
        vqblk.compare=*)            P_COMPARE=${arg#*=} ;;
        vqblk.read_mib=*)           P_READ_MIB=${arg#*=} ;;
        vqblk.read_off_mib=*)       P_READ_OFF_MIB=${arg#*=} ;;
        vqblk.idloop=*)             P_IDLOOP=${arg#*=} ;;
    esac
done
[ "$P_DEBUG" = 1 ] && set -x

DEV=/dev/$P_DEV
SYS=/sys/block/$P_DEV
CHUNK=65536                      # dd block size: 64 KiB requests
# round down to whole 64 KiB chunks
# shellcheck disable=SC2017
REGION=$(( P_REGION_KIB / 64 * CHUNK ))
[ "$REGION" -gt 0 ] || REGION=$CHUNK
STRIDE=$(( REGION * 2 ))
# shellcheck disable=SC2017
DISCARD_LEN=$(( P_DISCARD_KIB / 64 * CHUNK ))
[ "$DISCARD_LEN" -gt 0 ] || DISCARD_LEN=$CHUNK

log() { echo "vqblk: $*"; }

# JSON string escaping (quotes, backslashes; control chars dropped).
json_esc() { printf '%s' "$1" | tr -d '\000-\037' | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g'; }

FAILS=
fail() {
    log "FAIL: $*"
    FAILS="$FAILS${FAILS:+,}\"$(json_esc "$*")\""
}

# Extra JSON members, accumulated as ',"key":value' fragments.
FACTS=
fact_num() { FACTS="$FACTS,\"$1\":${2:-null}"; }
fact_str() { FACTS="$FACTS,\"$1\":\"$(json_esc "$2")\""; }
fact_raw() { FACTS="$FACTS,\"$1\":$2"; }

uptime_s() { cut -d' ' -f1 /proc/uptime; }

RESULT_PRINTED=0
finish() {
    [ "$RESULT_PRINTED" = 1 ] && return
    RESULT_PRINTED=1
    [ -n "${WATCHDOG_PID:-}" ] && kill "$WATCHDOG_PID" 2>/dev/null
    if [ -z "$FAILS" ]; then ok=true; else ok=false; fi
    # Keep kernel messages from interleaving with the result line.
    echo 1 > /proc/sys/kernel/printk 2>/dev/null
    echo
    echo "VQBLK-RESULT {\"ok\":$ok,\"mode\":\"$(json_esc "$P_MODE")\",\"failures\":[$FAILS]$FACTS,\"uptime_s\":$(uptime_s)}"
    sync
    poweroff -f
    # poweroff -f should not return; if it does, sysrq, then let init exit (panic=-1
    # reboots and QEMU -no-reboot exits).
    echo o > /proc/sysrq-trigger 2>/dev/null
    sleep 5
    exit 1
}

# Watchdog: if anything below hangs (e.g. I/O that never completes), still print a
# result and power off, so the host sees a clean failure instead of its own timeout.
(
    sleep "$P_TIMEOUT"
    echo 1 > /proc/sys/kernel/printk 2>/dev/null
    echo
    echo "VQBLK-RESULT {\"ok\":false,\"mode\":\"$(json_esc "$P_MODE")\",\"failures\":[\"guest watchdog: checks did not finish within ${P_TIMEOUT}s\"],\"uptime_s\":$(uptime_s)}"
    poweroff -f
) &
WATCHDOG_PID=$!

log "init started at $(uptime_s)s, kernel $(uname -r), cmdline: $(cat /proc/cmdline)"
fact_str kernel "$(uname -r)"

# ------------------------------------------------------------------ modules
# /etc/vqblk-modules lists .ko paths in dependency order (written by build-initramfs.sh).
if [ -f /etc/vqblk-modules ]; then
    while read -r ko; do
        [ -n "$ko" ] || continue
        name=$(basename "$ko" .ko)
        # "File exists" = already loaded; anything else is a real failure.
        if ! out=$(insmod "$ko" 2>&1); then
            case "$out" in *"File exists"*) ;; *) fail "insmod $name: $out" ;; esac
        fi
    done < /etc/vqblk-modules
fi

# ------------------------------------------------------------------ device
i=0
while [ ! -b "$DEV" ] && [ "$i" -lt 200 ]; do sleep 0.1; i=$((i + 1)); done
if [ ! -b "$DEV" ]; then
    fail "$DEV did not appear within 20s"
    finish
fi
log "$DEV present at $(uptime_s)s"

NCPU=$(nproc)
# possible CPUs ("0-1") -> count; virtio-blk caps its queue count at this.
NPOSSIBLE=$(awk -F, '{n=0; for (i=1;i<=NF;i++) { split($i,a,"-"); n += (a[2]=="" ? 1 : a[2]-a[1]+1) } print n}' \
    /sys/devices/system/cpu/possible 2>/dev/null)
[ -n "$NPOSSIBLE" ] || NPOSSIBLE=$NCPU

MQ=$(find "$SYS/mq" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l)
SIZE=$(cat "$SYS/size")
LBS=$(cat "$SYS/queue/logical_block_size")
PBS=$(cat "$SYS/queue/physical_block_size")
RO=$(cat "$SYS/ro")
SERIAL=$(cat "$SYS/serial" 2>/dev/null)
DMAX=$(cat "$SYS/queue/discard_max_bytes" 2>/dev/null)
WC=$(cat "$SYS/queue/write_cache" 2>/dev/null)
if [ "$RO" = 1 ]; then RO_JSON=true; else RO_JSON=false; fi

fact_num nproc "$NCPU"
fact_num mq_queues "$MQ"
fact_num capacity_sectors "$SIZE"
fact_num logical_block_size "$LBS"
fact_num physical_block_size "$PBS"
fact_raw ro "$RO_JSON"
fact_str serial "$SERIAL"
fact_num discard_max_bytes "${DMAX:-0}"
fact_str write_cache "$WC"
log "facts: mq_queues=$MQ size=$SIZE lbs=$LBS pbs=$PBS ro=$RO serial='$SERIAL' discard_max_bytes=$DMAX write_cache='$WC' cpus=$NCPU"

if [ -n "$P_MQ_QUEUES" ] && [ "$MQ" != "$P_MQ_QUEUES" ]; then
    fail "mq_queues: expected $P_MQ_QUEUES, got $MQ"
fi
if [ -n "$P_QUEUES" ]; then
    want=$P_QUEUES
    [ "$want" -gt "$NPOSSIBLE" ] && want=$NPOSSIBLE
    [ "$MQ" = "$want" ] || fail "mq_queues: expected $want (num-queues $P_QUEUES, $NPOSSIBLE CPUs), got $MQ"
fi
if [ -n "$P_CAPACITY" ] && [ "$SIZE" != "$P_CAPACITY" ]; then
    fail "capacity_sectors: expected $P_CAPACITY, got $SIZE"
fi
if [ -n "$P_LBS" ] && [ "$LBS" != "$P_LBS" ]; then
    fail "logical_block_size: expected $P_LBS, got $LBS"
fi
if [ "$P_SERIAL_SET" = 1 ] && [ "$SERIAL" != "$P_SERIAL" ]; then
    fail "serial: expected '$P_SERIAL', got '$SERIAL'"
fi

# ------------------------------------------------------------------ helpers
DIRECT_IN=iflag=direct
DIRECT_OUT=oflag=direct
if ! dd if="$DEV" of=/dev/null bs=$CHUNK count=1 iflag=direct 2>/dev/null; then
    log "dd iflag=direct not usable; falling back to buffered I/O + fsync"
    DIRECT_IN=
    DIRECT_OUT=conv=fsync
fi

# gen_pattern WRITER OFFSET_BYTES LEN_BYTES FILE  - see the header for the format.
gen_pattern() {
    awk -v w="$1" -v lba0=$(( $2 / 512 )) -v n=$(( $3 / 512 )) -v seed="$P_SEED" '
    BEGIN {
        letters = "abcdefghijklmnopqrstuvwxyz"
        for (c = 0; c < 26; c++) {
            ch = substr(letters, c + 1, 1); s = ch
            while (length(s) < 511) s = s s
            fill[c] = substr(s, 1, 511)
        }
        for (k = 0; k < n; k++) {
            lba = lba0 + k
            h = "VQBLK seed=" seed " writer=" w " lba=" lba "|"
            printf "%s%s\n", h, substr(fill[(lba + 7 * w + seed) % 26], 1, 511 - length(h))
        }
    }' > "$4"
}

md5_of() { md5sum "$1" | cut -d' ' -f1; }

# read_md5 OFFSET LEN - md5 of LEN bytes of the device at OFFSET (O_DIRECT when possible)
read_md5() {
    # shellcheck disable=SC2086
    dd if="$DEV" bs=$CHUNK skip=$(( $1 / CHUNK )) count=$(( $2 / CHUNK )) $DIRECT_IN 2>/dev/null | md5sum | cut -d' ' -f1
}

drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches; }

if [ -z "$P_WRITERS" ]; then P_WRITERS=$NCPU; fi
NEED=$(( P_WRITERS * STRIDE ))

# verify_regions - read back every writer region and compare with the pattern.
# Appends the per-writer JSON objects to WJSON.
WJSON=
verify_regions() {
    w=0
    while [ "$w" -lt "$P_WRITERS" ]; do
        off=$(( w * STRIDE ))
        gen_pattern "$w" "$off" "$REGION" /tmp/pat.$w
        exp=$(md5_of /tmp/pat.$w)
        rm -f /tmp/pat.$w
        got=$(read_md5 "$off" "$REGION")
        if [ "$exp" = "$got" ]; then wok=true; else
            wok=false; fail "writer $w: region at $off reads back $got, expected $exp"
        fi
        WJSON="$WJSON${WJSON:+,}{\"writer\":$w,\"offset\":$off,\"bytes\":$REGION,\"expected_md5\":\"$exp\",\"read_md5\":\"$got\",\"ok\":$wok}"
        w=$((w + 1))
    done
}

# ------------------------------------------------------------------ reboot marker
# vqblk.reboot=1: the only state that survives the reboot is the disk, so the boot
# number lives in a marker chunk at the end of the device.
BOOT=1
MARK_LINE="VQBLK-REBOOT-MARKER seed=$P_SEED"
MARK_OFF=$(( (SIZE * 512 / CHUNK - 1) * CHUNK ))
if [ "$P_REBOOT" = 1 ]; then
    [ "$P_MODE" = rw ] || fail "vqblk.reboot=1 needs vqblk.mode=rw (got $P_MODE)"
    # shellcheck disable=SC2086
    mark=$(dd if="$DEV" bs=$CHUNK skip=$(( MARK_OFF / CHUNK )) count=1 $DIRECT_IN 2>/dev/null |
        tr -d '\000' | head -n 1)
    if [ "$mark" = "$MARK_LINE" ]; then
        BOOT=2
        log "reboot: marker found at $MARK_OFF: this is boot 2 (after the device reset)"
        # shellcheck disable=SC2086
        dd if=/dev/zero of="$DEV" bs=$CHUNK seek=$(( MARK_OFF / CHUNK )) count=1 $DIRECT_OUT \
            2>/dev/null || fail "reboot: clearing the marker failed"
    fi
    fact_num boot "$BOOT"
fi

# ------------------------------------------------------------------ modes
if [ "$BOOT" = 2 ]; then
    # Boot 2 of vqblk.reboot=1: only read back what boot 1 wrote.
    drop_caches
    verify_regions
    fact_raw writers "[$WJSON]"
    fact_raw rebooted true
    log "checks finished at $(uptime_s)s (boot 2)"
    finish
fi

# centiseconds since boot
cs() { read -r up _ < /proc/uptime; echo "${up%.*}${up#*.}"; }

# gen_seq_block WRITER SEQ BLOCK FILE - the 4 KiB content of write SEQ of WRITER
# to its block BLOCK: 8 sectors, each "VQBLK-SEQ w=W s=S b=B off=BYTE|" padded with
# a letter chosen by SEQ and the sector, then a newline (tests/guest_e2e.rs
# seq_block computes the same bytes).
gen_seq_block() {
    awk -v w="$1" -v s="$2" -v b="$3" -v base=$(( ($1 * P_BLOCKS + $3) * 4096 )) '
    BEGIN {
        letters = "abcdefghijklmnopqrstuvwxyz"
        for (k = 0; k < 8; k++) {
            h = "VQBLK-SEQ w=" w " s=" s " b=" b " off=" (base + 512 * k) "|"
            ch = substr(letters, (s + k) % 26 + 1, 1)
            line = h
            while (length(line) < 511) line = line ch
            printf "%s\n", substr(line, 1, 511)
        }
    }' > "$4"
}

case "$P_MODE" in
seqwrite)
    # Sequence-numbered 4 KiB writes for P_SECONDS, one writer per CPU, each on its
    # own P_BLOCKS blocks (block = seq mod P_BLOCKS), while the host kills and
    # restarts the daemon; reports per writer how many writes completed and the
    # longest gap between two completions.
    [ "$RO" = 0 ] || fail "mode seqwrite but $SYS/ro is $RO"
    log "seqwrite: $P_WRITERS writers x $P_BLOCKS blocks for ${P_SECONDS}s, $DIRECT_OUT"
    w=0
    while [ "$w" -lt "$P_WRITERS" ]; do
        (
            s=0; maxgap=0; last=$(cs); end=$(( last + P_SECONDS * 100 ))
            rc=0
            while [ "$last" -lt "$end" ]; do
                b=$(( s % P_BLOCKS ))
                gen_seq_block "$w" "$s" "$b" /tmp/blk.$w
                # shellcheck disable=SC2086
                if ! dd if=/tmp/blk.$w of="$DEV" bs=4096 count=1 seek=$(( w * P_BLOCKS + b )) $DIRECT_OUT 2>/tmp/dd.$w; then
                    rc=1; break
                fi
                now=$(cs)
                [ $(( now - last )) -gt "$maxgap" ] && maxgap=$(( now - last ))
                last=$now
                s=$(( s + 1 ))
            done
            echo "$rc $s $maxgap" > /tmp/rc.$w.tmp && mv /tmp/rc.$w.tmp /tmp/rc.$w
        ) &
        w=$((w + 1))
    done
    if [ "$P_IDLOOP" = 1 ]; then
        (
            ids=0; end=$(( $(cs) + P_SECONDS * 100 ))
            while [ "$(cs)" -lt "$end" ]; do
                read -r _ < "$SYS/serial"; ids=$(( ids + 1 ))
            done
            echo "$ids" > /tmp/ids
        ) &
    fi
    # A write that never completes (lost at a daemon restart) hangs its
    # writer: give up on it 60 s after the writing time instead of waiting
    # for the watchdog.
    hung_at=$(( $(cs) + P_SECONDS * 100 + 6000 ))
    w=0
    SJSON=
    while [ "$w" -lt "$P_WRITERS" ]; do
        while [ ! -f /tmp/rc.$w ] && [ "$(cs)" -lt "$hung_at" ]; do sleep 0.2; done
        if [ ! -f /tmp/rc.$w ]; then
            fail "writer $w: a write did not complete within 60s after the writing time (hung)"
            w=$((w + 1))
            continue
        fi
        read -r rc n gap < /tmp/rc.$w
        [ "$rc" = 0 ] || fail "writer $w: write $n failed: $(tr '\n' ' ' < /tmp/dd.$w)"
        SJSON="$SJSON${SJSON:+,}{\"writer\":$w,\"writes\":$n,\"max_gap_cs\":$gap}"
        w=$((w + 1))
    done
    fact_raw seq "[$SJSON]"
    fact_num blocks "$P_BLOCKS"
    [ -f /tmp/ids ] && fact_num get_ids "$(cat /tmp/ids)"
    log "seqwrite: finished at $(uptime_s)s"
    ;;
migrate)
    [ "$RO" = 0 ] || fail "mode migrate but $SYS/ro is $RO"
    STOP_BLK=$(( SIZE / 8 - 1 ))
    log "migrate: $P_WRITERS writers x $P_BLOCKS blocks until the stop marker or ${P_SECONDS}s, $DIRECT_OUT"
    w=0
    while [ "$w" -lt "$P_WRITERS" ]; do
        (
            s=0; rc=0; stopped=0; end=$(( $(cs) + P_SECONDS * 100 ))
            dd if=/dev/zero of=/tmp/exp.$w bs=4096 count="$P_BLOCKS" 2>/dev/null
            while [ "$(cs)" -lt "$end" ]; do
                b=$(( s % P_BLOCKS )); blk=$(( w * P_BLOCKS + b ))
                gen_seq_block "$w" "$s" "$b" /tmp/blk.$w
                # shellcheck disable=SC2086
                dd if=/tmp/blk.$w of="$DEV" bs=4096 count=1 seek=$blk $DIRECT_OUT 2>/tmp/dd.$w || { rc=1; break; }
                # shellcheck disable=SC2086
                dd if="$DEV" of=/tmp/rd.$w bs=4096 count=1 skip=$blk $DIRECT_IN 2>/tmp/dd.$w || { rc=2; break; }
                if [ "$P_COMPARE" = 1 ] && ! cmp -s /tmp/blk.$w /tmp/rd.$w; then
                    head -c 60 /tmp/rd.$w > /tmp/dd.$w; rc=3; break
                fi
                # What all the writer's blocks must hold now; then read them
                # buffered: mostly page-cache hits on pages the device filled
                # earlier (a page the daemon writes and does not log reaches a
                # migration's destination stale, and only such a re-read sees it).
                dd if=/tmp/blk.$w of=/tmp/exp.$w bs=4096 seek=$b conv=notrunc 2>/dev/null
                if [ "$P_COMPARE" = 1 ]; then
                    dd if="$DEV" of=/tmp/all.$w bs=4096 count="$P_BLOCKS" skip=$(( w * P_BLOCKS )) 2>/dev/null
                    if ! cmp /tmp/exp.$w /tmp/all.$w > /tmp/dd.$w 2>&1; then rc=4; break; fi
                fi
                s=$(( s + 1 ))
                [ $(( s % 8 )) = 0 ] && log "migrate: w=$w s=$s at $(uptime_s)s"
                # shellcheck disable=SC2086
                stop=$(dd if="$DEV" bs=4096 count=1 skip=$STOP_BLK $DIRECT_IN 2>/dev/null | head -c 10)
                if [ "$stop" = VQBLK-STOP ]; then stopped=1; : > /tmp/stop; break; fi
            done
            echo "$rc $s $stopped" > /tmp/rc.$w.tmp && mv /tmp/rc.$w.tmp /tmp/rc.$w
        ) &
        w=$((w + 1))
    done
    if [ "$P_READ_MIB" -gt 0 ]; then
        (
            # dd reads with O_DIRECT into its buffer and blocks writing it to the
            # pipe while awk, slower, checks every sector: dd's buffer holds data
            # the device wrote and no CPU touched, for as long as awk lags.
            n=$(( P_READ_MIB * 16 )); passes=0; rc=0
            end=$(( $(cs) + P_SECONDS * 100 ))
            while [ ! -f /tmp/stop ] && [ "$(cs)" -lt "$end" ]; do
                # shellcheck disable=SC2086
                dd if="$DEV" bs=65536 skip=$(( P_READ_OFF_MIB * 16 )) count=$n $DIRECT_IN 2>/dev/null |
                    awk '{
                        k = int((NR - 1) / 128); s = (NR - 1) % 128
                        want = "VQBLK-RD k=" k " s=" s "|"
                        if (substr($0, 1, length(want)) != want) {
                            print "sector " s " of chunk " k " holds: " substr($0, 1, 40) > "/tmp/rbad"
                            exit 1
                        }
                        if (s == 127 && system("test -f /tmp/stop") == 0) exit 0
                    }' || { rc=1; break; }
                passes=$(( passes + 1 ))
            done
            echo "$rc $passes" > /tmp/rrc.tmp && mv /tmp/rrc.tmp /tmp/rrc
        ) &
    fi
    w=0
    SJSON=
    while [ "$w" -lt "$P_WRITERS" ]; do
        while [ ! -f /tmp/rc.$w ]; do sleep 0.2; done
        read -r rc n stopped < /tmp/rc.$w
        case "$rc" in
            0) ;;
            1) fail "writer $w: write $n failed: $(tr '\n' ' ' < /tmp/dd.$w)" ;;
            2) fail "writer $w: read-back of write $n failed: $(tr '\n' ' ' < /tmp/dd.$w)" ;;
            3) fail "writer $w: write $n reads back other data: $(tr -d '\n' < /tmp/dd.$w)" ;;
            *) fail "writer $w: after write $n, a buffered read of its blocks differs: $(tr '\n' ' ' < /tmp/dd.$w)" ;;
        esac
        SJSON="$SJSON${SJSON:+,}{\"writer\":$w,\"writes\":$n,\"stopped\":$stopped}"
        w=$((w + 1))
    done
    fact_raw seq "[$SJSON]"
    fact_num blocks "$P_BLOCKS"
    if [ "$P_READ_MIB" -gt 0 ]; then
        : > /tmp/stop
        while [ ! -f /tmp/rrc ]; do sleep 0.2; done
        read -r rrc passes < /tmp/rrc
        [ "$rrc" = 0 ] || fail "reader: O_DIRECT data differs from the disk (stale guest memory): $(cat /tmp/rbad)"
        fact_raw reader "{\"ok\":$([ "$rrc" = 0 ] && echo true || echo false),\"passes\":$passes}"
    fi
    log "migrate: finished at $(uptime_s)s"
    ;;
rw)
    [ "$RO" = 0 ] || fail "mode rw but $SYS/ro is $RO"
    if [ $(( NEED / 512 )) -gt "$SIZE" ]; then
        fail "device too small: $P_WRITERS writers need $NEED bytes, device has $(( SIZE * 512 ))"
        finish
    fi
    have_taskset=0
    command -v taskset >/dev/null 2>&1 && have_taskset=1
    log "rw: $P_WRITERS writers x $REGION bytes (stride $STRIDE), $DIRECT_OUT, taskset=$have_taskset"
    w=0
    while [ "$w" -lt "$P_WRITERS" ]; do
        (
            cpu=$(( w % NCPU ))
            off=$(( w * STRIDE ))
            gen_pattern "$w" "$off" "$REGION" /tmp/pat.$w
            md5_of /tmp/pat.$w > /tmp/exp.$w
            pin=
            [ "$have_taskset" = 1 ] && pin="taskset -c $cpu"
            # shellcheck disable=SC2086
            $pin dd if=/tmp/pat.$w of="$DEV" bs=$CHUNK seek=$(( off / CHUNK )) $DIRECT_OUT 2>/tmp/dd.$w
            echo $? > /tmp/rc.$w
            rm -f /tmp/pat.$w
        ) &
        w=$((w + 1))
    done
    # `wait` with no args would also wait for the watchdog; poll the writers' rc files.
    w=0
    while [ "$w" -lt "$P_WRITERS" ]; do
        while [ ! -f /tmp/rc.$w ]; do sleep 0.1; done
        w=$((w + 1))
    done
    log "rw: writes finished at $(uptime_s)s"
    w=0
    while [ "$w" -lt "$P_WRITERS" ]; do
        rc=$(cat /tmp/rc.$w)
        [ "$rc" = 0 ] || fail "writer $w: dd exit $rc: $(tr '\n' ' ' < /tmp/dd.$w)"
        w=$((w + 1))
    done
    drop_caches
    verify_regions
    fact_raw writers "[$WJSON]"
    log "rw: verify finished at $(uptime_s)s"

    if [ "$P_DISCARD" = 1 ]; then
        doff=$NEED
        dres=
        if [ "${DMAX:-0}" = 0 ]; then
            fail "discard: device does not advertise discard (discard_max_bytes=0)"
            dres="{\"advertised\":false}"
        elif [ $(( (doff + DISCARD_LEN) / 512 )) -gt "$SIZE" ]; then
            fail "discard: device too small for the discard region at $doff"
        else
            # Fill the region with data first so that "reads as zeroes" means something.
            gen_pattern "$P_WRITERS" "$doff" "$DISCARD_LEN" /tmp/pat.d
            # shellcheck disable=SC2086
            dd if=/tmp/pat.d of="$DEV" bs=$CHUNK seek=$(( doff / CHUNK )) $DIRECT_OUT 2>/dev/null \
                || fail "discard: pre-fill write failed"
            rm -f /tmp/pat.d
            if out=$(blkdiscard -o "$doff" -l "$DISCARD_LEN" "$DEV" 2>&1); then
                drop_caches
                zero=$(dd if=/dev/zero bs=$CHUNK count=$(( DISCARD_LEN / CHUNK )) 2>/dev/null | md5sum | cut -d' ' -f1)
                got=$(read_md5 "$doff" "$DISCARD_LEN")
                if [ "$got" = "$zero" ]; then zok=true; else
                    zok=false; fail "discard: region at $doff does not read back as zeroes after blkdiscard"
                fi
                dres="{\"advertised\":true,\"offset\":$doff,\"bytes\":$DISCARD_LEN,\"reads_zero\":$zok}"
            else
                fail "discard: blkdiscard -o $doff -l $DISCARD_LEN failed: $out"
                dres="{\"advertised\":true,\"offset\":$doff,\"bytes\":$DISCARD_LEN,\"error\":\"$(json_esc "$out")\"}"
            fi
        fi
        [ -n "$dres" ] && fact_raw discard "$dres"
        log "rw: discard check finished at $(uptime_s)s"
    fi
    ;;
ro)
    [ "$RO" = 1 ] || fail "mode ro but $SYS/ro is $RO"
    before=$(read_md5 0 $CHUNK)
    [ -n "$before" ] || fail "ro: read failed"
    # shellcheck disable=SC2086
    if dd if=/dev/zero of="$DEV" bs=$CHUNK count=1 $DIRECT_OUT 2>/tmp/ddro; then
        fail "ro: write to $DEV succeeded"
        wblocked=false
    else
        wblocked=true
        log "ro: write refused as expected: $(tr '\n' ' ' < /tmp/ddro)"
    fi
    drop_caches
    after=$(read_md5 0 $CHUNK)
    [ "$before" = "$after" ] || fail "ro: first $CHUNK bytes changed after a refused write"
    if dd if="$DEV" of=/dev/null bs=$CHUNK count=16 $DIRECT_IN 2>/dev/null; then rok=true; else
        rok=false; fail "ro: reading 1 MiB failed"
    fi
    fact_raw write_blocked "$wblocked"
    fact_raw read_ok "$rok"
    if [ "$P_VERIFY" = 1 ]; then
        verify_regions
        fact_raw writers "[$WJSON]"
    fi
    ;;
irq)
    # Interrupts per request under a QD16 load: 16 readers of
    # 4 KiB O_DIRECT blocks at once, vqblk.blocks blocks each, from all
    # CPUs; the device's interrupts (its virtio request vectors in
    # /proc/interrupts) over the reads it completed (/sys/block/DEV/stat).
    irqs() { awk '/virtio[0-9]+-req/ { for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+$/) n += $i } END { print n + 0 }' /proc/interrupts; }
    reads() { read -r r _ < "$SYS/stat"; echo "$r"; }
    i0=$(irqs); r0=$(reads); t0=$(cs)
    n=0; pids=
    while [ "$n" -lt 16 ]; do
        # shellcheck disable=SC2086
        dd if="$DEV" of=/dev/null bs=4096 count="$P_BLOCKS" skip=$(( n * P_BLOCKS )) $DIRECT_IN 2>/dev/null &
        pids="$pids $!"
        n=$((n + 1))
    done
    # Not a bare `wait`: the watchdog is a child too.
    # shellcheck disable=SC2086
    wait $pids
    i1=$(irqs); r1=$(reads); t1=$(cs)
    req=$(( r1 - r0 )); irq=$(( i1 - i0 ))
    [ "$req" -ge $(( 16 * P_BLOCKS )) ] || fail "irq: $req reads completed, expected $(( 16 * P_BLOCKS ))"
    fact_num irq_requests "$req"
    fact_num irq_interrupts "$irq"
    fact_num irq_centiseconds $(( t1 - t0 ))
    log "irq: $irq interrupts for $req reads in $(( t1 - t0 ))0 ms"
    ;;
paced)
    # As many reads as the daemon lets through: 4 readers at QD1 each, 8
    # blocks per dd, until vqblk.seconds have passed.
    reads() { read -r r _ < "$SYS/stat"; echo "$r"; }
    r0=$(reads); t0=$(cs); end=$(( t0 + P_SECONDS * 100 ))
    blocks=$(( SIZE / 8 ))
    n=0; pids=
    while [ "$n" -lt 4 ]; do
        (
            k=0
            while [ "$(cs)" -lt "$end" ]; do
                # shellcheck disable=SC2086
                dd if="$DEV" of=/dev/null bs=4096 count=8 \
                    skip=$(( (n * blocks / 4 + k * 8) % (blocks - 8) )) $DIRECT_IN 2>/dev/null || exit 1
                k=$((k + 1))
            done
        ) &
        pids="$pids $!"
        n=$((n + 1))
    done
    failed=0
    for p in $pids; do
        wait "$p" || failed=$((failed + 1))
    done
    t1=$(cs); r1=$(reads)
    [ "$failed" = 0 ] || fail "paced: $failed of 4 readers saw a failed read"
    if dmesg 2>/dev/null | grep -q "I/O error"; then
        fail "paced: the kernel logged an I/O error"
    fi
    fact_num paced_reads $(( r1 - r0 ))
    fact_num paced_centiseconds $(( t1 - t0 ))
    log "paced: $(( r1 - r0 )) reads in $(( t1 - t0 ))0 ms"
    ;;
read-verify)
    if [ $(( NEED / 512 )) -gt "$SIZE" ]; then
        fail "device too small for $P_WRITERS writer regions"
        finish
    fi
    verify_regions
    fact_raw writers "[$WJSON]"
    ;;
*)
    fail "unknown vqblk.mode '$P_MODE'"
    ;;
esac

log "checks finished at $(uptime_s)s"
if [ "$P_REBOOT" = 1 ] && [ -z "$FAILS" ]; then
    printf '%s\n' "$MARK_LINE" > /tmp/mark
    # conv=sync pads the one input block with zeroes to a full 64 KiB chunk
    dd if=/tmp/mark of=/tmp/mark.chunk bs=$CHUNK count=1 conv=sync 2>/dev/null
    # shellcheck disable=SC2086
    if dd if=/tmp/mark.chunk of="$DEV" bs=$CHUNK seek=$(( MARK_OFF / CHUNK )) $DIRECT_OUT 2>/dev/null; then
        sync
        [ -n "${WATCHDOG_PID:-}" ] && kill "$WATCHDOG_PID" 2>/dev/null
        log "reboot: boot 1 passed at $(uptime_s)s; marker written; reboot -f (device reset)"
        echo 1 > /proc/sys/kernel/printk 2>/dev/null
        reboot -f
        sleep 5
        fail "reboot: reboot -f returned"
    else
        fail "reboot: writing the marker failed"
    fi
fi
finish

#!/bin/bash
# Throw-away single-node Ceph (Pacific 16.2.x, Debian bookworm) on 127.0.0.1.
# No systemd, no cephx, 1 mon + 1 memstore OSD (+ optional mgr), pool "rbd",
# 1 GiB image rbd/img.  Everything lives under $CEPH_DIR.
# Clients: export CEPH_CONF=$CEPH_DIR/ceph.conf (librados reads it).
# Needs Debian packages ceph-mon ceph-osd ceph-common (rbd) uuid-runtime bc.
# PROOF=1 also runs a few `rbd bench` passes and prints their timings.
set -euo pipefail

CEPH_DIR=${CEPH_DIR:-/tmp/cephtest/cluster}
MON_PORT=${MON_PORT:-3300}          # msgr2 port; msgr1 port = MON_PORT+1
WITH_MGR=${WITH_MGR:-0}             # 1 = also start ceph-mgr (not needed for RBD I/O)
OBJECTSTORE=${OBJECTSTORE:-memstore}  # memstore (RAM) | bluestore (sparse file created as $CEPH_DIR/osd.0/block)
OSD_BYTES=${OSD_BYTES:-4294967296}    # advertised memstore capacity / bluestore file size
OSD_EXTRA_CONF=${OSD_EXTRA_CONF:-}    # more lines for the [osd] section (KEY = VALUE, newline-separated)
CONF=$CEPH_DIR/ceph.conf
export CEPH_CONF=$CONF

T0=$(date +%s.%N); TL=$T0
step() {  # print elapsed time of previous step
  local now; now=$(date +%s.%N)
  printf '[%6.2fs | +%5.2fs] %s\n' "$(echo "$now - $T0" | bc)" "$(echo "$now - $TL" | bc)" "$*"
  TL=$now
}
ceph_() { timeout 60 ceph --connect-timeout 30 "$@"; }
rss() { for p in "$CEPH_DIR"/run/*.pid; do printf '%s=%dMiB ' "$(basename "$p" .pid)" $(( $(ps -o rss= -p "$(cat "$p")") / 1024 )); done; echo; }
trap 'echo "start.sh FAILED at line $LINENO; logs in $CEPH_DIR/log (run stop.sh to clean up)" >&2' ERR

# ---- refuse to clobber a running cluster, else start from nothing ----------
for p in "$CEPH_DIR"/run/*.pid; do
  [ -e "$p" ] || continue
  if kill -0 "$(cat "$p")" 2>/dev/null; then
    echo "cluster already running ($p); run stop.sh first" >&2; exit 1
  fi
done
rm -rf "$CEPH_DIR"
mkdir -p "$CEPH_DIR"/{run,log,mon.a,osd.0,mgr.x}

FSID=$(uuidgen)
cat > "$CONF" <<EOF
[global]
fsid = $FSID
mon initial members = a
mon host = [v2:127.0.0.1:$MON_PORT,v1:127.0.0.1:$((MON_PORT+1))]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
run dir = $CEPH_DIR/run
pid file = $CEPH_DIR/run/\$name.pid
admin socket = $CEPH_DIR/run/\$name.asok
log file = $CEPH_DIR/log/\$name.log
log to stderr = false
err to stderr = true
keyring = /dev/null
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim allowed = false
mon data avail warn = 1
mon data avail crit = 0
paxos propose interval = 0.1
mon mgr mkfs grace = 31536000

[mon]
mon data = $CEPH_DIR/mon.\$id

[mon.a]
# "public addr" above has no port: without this the monitor would bind the
# default ports (3300/6789) whatever MON_PORT says, and two clusters collide.
public addrv = [v2:127.0.0.1:$MON_PORT,v1:127.0.0.1:$((MON_PORT+1))]

[mgr]
mgr data = $CEPH_DIR/mgr.\$id

[osd]
osd data = $CEPH_DIR/osd.\$id
osd objectstore = $OBJECTSTORE
memstore device bytes = $OSD_BYTES
memstore page set = true
memstore page size = ${MEMSTORE_PAGE_SIZE:-4096}
bluestore block create = true
bluestore block size = $OSD_BYTES
bluestore fsck on mkfs = false
osd memory target = 1073741824
osd crush initial weight = 1
osd crush update on start = true
$OSD_EXTRA_CONF
EOF
step "wrote ceph.conf (fsid $FSID)"

# ---- monitor ----------------------------------------------------------------
ceph-mon -c "$CONF" -i a --mkfs
step "ceph-mon --mkfs"
ceph-mon -c "$CONF" -i a                 # daemonizes, writes run/mon.a.pid
ceph_ mon stat >/dev/null
step "mon up and answering"

# ---- optional manager -------------------------------------------------------
if [ "$WITH_MGR" = 1 ]; then
  ceph-mgr -c "$CONF" -i x
  for i in $(seq 120); do
    ceph_ mgr stat -f json 2>/dev/null | grep -q '"available": *true' && break
    sleep 0.5
  done
  step "mgr available"
fi

# ---- one memstore OSD -------------------------------------------------------
OSD_UUID=$(uuidgen)
OSD_ID=$(ceph_ osd new "$OSD_UUID")
[ "$OSD_ID" = 0 ] || { echo "unexpected osd id $OSD_ID" >&2; exit 1; }
ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$OSD_UUID" >"$CEPH_DIR/log/osd.0.mkfs.out" 2>&1 ||
  { cat "$CEPH_DIR/log/osd.0.mkfs.out" >&2; exit 1; }
step "osd.0 created ($OBJECTSTORE)"
ceph-osd -c "$CONF" -i 0
for i in $(seq 120); do
  ceph_ osd dump 2>/dev/null | grep -q '^osd.0 up' && break
  sleep 0.5
done
ceph_ osd dump | grep -q '^osd.0 up' || { echo "osd.0 never came up" >&2; exit 1; }
step "osd.0 up"

# ---- pool + image -----------------------------------------------------------
ceph_ osd pool create rbd 8 8 >/dev/null
timeout 120 rbd pool init rbd
step "pool rbd created + rbd pool init"
timeout 60 rbd create --size 1G rbd/img
step "image rbd/img (1 GiB) created"

echo "  RSS before I/O: $(rss)"
if [ "${PROOF:-0}" = 1 ]; then
# ---- I/O proof --------------------------------------------------------------
timeout 300 rbd bench --io-type write --io-size 4K --io-total 64M rbd/img | tail -1
step "rbd bench write 4K x 64M  <== first I/O done"
timeout 300 rbd bench --rbd-cache=false --io-type write --io-size 4K --io-total 64M rbd/img | tail -1
step "rbd bench write 4K x 64M, rbd cache off"
timeout 300 rbd bench --io-type read --io-size 4K --io-total 64M rbd/img | tail -1
step "rbd bench read 4K x 64M"
timeout 300 rbd bench --rbd-cache=false --io-type read --io-size 4K --io-total 64M rbd/img | tail -1
step "rbd bench read 4K x 64M, rbd cache off"
timeout 300 rbd bench --io-type write --io-size 4K --io-pattern rand --io-total 16M rbd/img | tail -1
step "rbd bench rand write 4K x 16M"

if command -v qemu-img >/dev/null; then
  if qemu-img info "rbd:rbd/img:conf=$CONF" 2>/dev/null | head -3; then
    step "qemu-img info"
  else
    step "qemu-img has no rbd driver here (Debian qemu-block-extra adds it)"
  fi
fi

fi
ceph_ health
echo "  RSS after I/O: $(rss)"
step "done"
echo "export CEPH_CONF=$CONF"

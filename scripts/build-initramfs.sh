#!/usr/bin/env bash
# build-initramfs.sh OUT_DIR - build the test guest's kernel + initramfs.
#
# Produces
#   OUT_DIR/vmlinuz             copy of the Debian kernel
#   OUT_DIR/initramfs.cpio.gz   busybox-static (+ applet symlinks), the virtio_blk /
#                               virtio_pci modules and their dependencies (decompressed,
#                               since busybox insmod cannot load .ko.xz/.ko.zst), and
#                               /init = scripts/guest-init.sh
#   OUT_DIR/kernel-release      the kernel release string (e.g. 6.1.0-56-amd64)
#   OUT_DIR/.stamp              hash of the inputs; when it matches, nothing is rebuilt
#
# Inputs:
#   kernel tree  $VQBLK_KERNEL_ROOT (a dir holding boot/vmlinuz-* and lib/modules/*),
#                default $VQBLK_CACHE_DIR/kernel/current (what install-deps.sh extracts;
#                VQBLK_CACHE_DIR defaults to /var/cache/vqblk).  VQBLK_KERNEL_ROOT=/ uses
#                an installed kernel.  If nothing is found, install-deps.sh is run.
#   busybox      /bin/busybox from busybox-static (install-deps.sh installs it)
#   modules      virtio_blk virtio_pci + $VQBLK_EXTRA_MODULES (space separated)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:?usage: build-initramfs.sh OUT_DIR}
CACHE_DIR=${VQBLK_CACHE_DIR:-/var/cache/vqblk}
KROOT=${VQBLK_KERNEL_ROOT:-$CACHE_DIR/kernel/current}
MODULES="virtio_blk virtio_pci ${VQBLK_EXTRA_MODULES:-}"
GUEST_INIT=$HERE/guest-init.sh

log() { echo "build-initramfs: $*"; }
die() { echo "build-initramfs: $*" >&2; exit 1; }

# Tests may run this concurrently (e.g. via run-guest.sh): one builder at a time.
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9

# find_kernel - sets KVER and VMLINUZ from $KROOT: the newest release that has both a
# vmlinuz and a modules.dep.
find_kernel() {
    KVER='' VMLINUZ=''
    local v kv
    for v in $(find "$KROOT/boot/" -maxdepth 1 -name 'vmlinuz-*' 2>/dev/null | sort -V -r); do
        kv=${v##*/vmlinuz-}
        if [ -f "$KROOT/lib/modules/$kv/modules.dep" ]; then KVER=$kv VMLINUZ=$v; return 0; fi
    done
    return 1
}

find_busybox() {
    BUSYBOX=
    local b
    for b in /bin/busybox /usr/bin/busybox; do
        # must be the static build: the initramfs has no libc
        if [ -x "$b" ] && ! ldd "$b" >/dev/null 2>&1; then BUSYBOX=$b; return 0; fi
    done
    return 1
}

if ! find_kernel || ! find_busybox || ! command -v cpio >/dev/null 2>&1; then
    log "kernel, static busybox or cpio missing; running install-deps.sh"
    "$HERE/install-deps.sh"
    find_kernel || die "no kernel with modules.dep under $KROOT"
    find_busybox || die "no static busybox (install busybox-static)"
fi
MODDIR=$KROOT/lib/modules/$KVER

# ---------------------------------------------------------------- module closure
# modules.dep lines: "kernel/x/a.ko: kernel/y/b.ko kernel/z/c.ko" (paths relative to
# MODDIR, possibly with .xz/.zst/.gz).  Resolve depth-first so that every module comes
# after its dependencies; skip modules that are built into the kernel.
declare -A DEP_OF=() PATH_OF=() SEEN=()
while IFS= read -r line; do
    mod=${line%%:*}
    name=${mod##*/}; name=${name%%.ko*}; name=${name//-/_}
    PATH_OF[$name]=$mod
    DEP_OF[$name]=${line#*:}
done < "$MODDIR/modules.dep"

declare -A BUILTIN=()
if [ -f "$MODDIR/modules.builtin" ]; then
    while IFS= read -r b; do
        b=${b##*/}; b=${b%%.ko*}; BUILTIN[${b//-/_}]=1
    done < "$MODDIR/modules.builtin"
fi

ORDER=()
add_module() {
    local name=${1//-/_} d dn
    [ -n "${SEEN[$name]:-}" ] && return 0
    SEEN[$name]=1
    if [ -n "${BUILTIN[$name]:-}" ]; then return 0; fi
    [ -n "${PATH_OF[$name]:-}" ] || die "module $name not found in $MODDIR/modules.dep"
    for d in ${DEP_OF[$name]}; do
        dn=${d##*/}; dn=${dn%%.ko*}
        add_module "$dn"
    done
    ORDER+=("${PATH_OF[$name]}")
}
for m in $MODULES; do add_module "$m"; done

# ---------------------------------------------------------------- cache check
bb_version=$("$BUSYBOX" 2>/dev/null | head -n1 || true)
stamp=$(
    {
        echo "kernel $KVER $(sha256sum "$VMLINUZ" | cut -d' ' -f1)"
        echo "busybox $bb_version $(sha256sum "$BUSYBOX" | cut -d' ' -f1)"
        echo "init $(sha256sum "$GUEST_INIT" | cut -d' ' -f1)"
        echo "builder $(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"
        for m in "${ORDER[@]}"; do echo "module $m $(sha256sum "$MODDIR/$m" | cut -d' ' -f1)"; done
    } | sha256sum | cut -d' ' -f1
)
up_to_date() {
    [ -f "$OUT/.stamp" ] && [ "$(cat "$OUT/.stamp")" = "$stamp" ] &&
        [ -s "$OUT/vmlinuz" ] && [ -s "$OUT/initramfs.cpio.gz" ]
}
if up_to_date; then
    log "up to date: $OUT (kernel $KVER)"
    exit 0
fi

# ---------------------------------------------------------------- build
# Stage inside OUT and rename, so a QEMU reading the old files never sees a partial one.
STAGE=$(mktemp -d "$OUT/.stage.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
R=$STAGE/root
mkdir -p "$R"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,tmp,root,"lib/modules/$KVER"}

cp "$BUSYBOX" "$R/bin/busybox"
# One symlink per applet, at the path busybox wants it (e.g. /sbin/insmod).
while IFS= read -r applet; do
    applet=${applet#/}
    [ -e "$R/$applet" ] || ln -s /bin/busybox "$R/$applet"
done < <("$BUSYBOX" --list-full)

: > "$R/etc/vqblk-modules"
for m in "${ORDER[@]}"; do
    dst=$R/lib/modules/$KVER/${m%.ko*}.ko
    mkdir -p "$(dirname "$dst")"
    case "$m" in
        *.ko)     cp "$MODDIR/$m" "$dst" ;;
        *.ko.xz)  xz -dc "$MODDIR/$m" > "$dst" ;;
        *.ko.zst) zstd -qdc "$MODDIR/$m" > "$dst" ;;
        *.ko.gz)  gzip -dc "$MODDIR/$m" > "$dst" ;;
        *) die "unknown module format: $m" ;;
    esac
    echo "/lib/modules/$KVER/${m%.ko*}.ko" >> "$R/etc/vqblk-modules"
done

install -m 0755 "$GUEST_INIT" "$R/init"
# /dev/console must exist when the kernel starts /init, or init runs without
# stdin/stdout (guest-init.sh re-opens it after mounting devtmpfs anyway).
if [ "$(id -u)" -eq 0 ]; then
    mknod -m 600 "$R/dev/console" c 5 1
    mknod -m 666 "$R/dev/null" c 1 3
fi

(cd "$R" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) |
    gzip -n -6 > "$STAGE/initramfs.cpio.gz"
cp "$VMLINUZ" "$STAGE/vmlinuz"
mv -f "$STAGE/vmlinuz" "$OUT/vmlinuz"
mv -f "$STAGE/initramfs.cpio.gz" "$OUT/initramfs.cpio.gz"
echo "$KVER" > "$OUT/kernel-release"
echo "$stamp" > "$OUT/.stamp"
log "built $OUT/initramfs.cpio.gz ($(du -k "$OUT/initramfs.cpio.gz" | cut -f1) KiB) for kernel $KVER"
log "modules (load order): ${ORDER[*]}"

#!/usr/bin/env bash
# install-deps.sh - install what vqblk's tests need on a Debian bookworm machine.
#
# Idempotent: every step checks first and is skipped when already satisfied, so a
# second run is fast and touches neither apt nor the network.  `apt-get update`
# runs at most once, and only when something has to be installed or downloaded.
#
# What it provides:
#   * gcc (cc)                    - the only native build dep of the Rust crates
#   * qemu-system-x86 >= 10       - from bookworm-backports (adds the suite if absent)
#   * busybox-static              - the guest's userland (copied into the initramfs)
#   * cpio                        - to pack the initramfs
#   * util-linux                  - host-side blkdiscard
#   * kmod                        - depmod, to generate modules.dep for the extracted kernel
#   * chromium                    - headless, renders `vqblk report`'s HTML in a test
#   * libvirt 11 (bookworm-backports) - tests/libvirt.rs boots a domain with a vhostuser disk
#   * a Debian kernel (linux-image-amd64's current dependency), EXTRACTED into a
#     cache dir, NOT installed: `apt-get download` + `dpkg-deb -x` gives us
#     vmlinuz + modules without touching /boot, running initramfs/bootloader hooks
#     or pulling in linux-base/initramfs-tools.  The tree lands in
#       $VQBLK_CACHE_DIR/kernel/<package>_<version>/{boot,lib/modules}
#     and $VQBLK_CACHE_DIR/kernel/current points at it
#     (VQBLK_CACHE_DIR defaults to /var/cache/vqblk).  build-initramfs.sh reads it.
#
# Environment:
#   VQBLK_CACHE_DIR   where the extracted kernel goes (default /var/cache/vqblk)
#   VQBLK_SKIP_KERNEL=1   do not fetch the kernel
#
# Works non-interactively (CI=true, no stdin).
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
# depmod, dpkg-deb etc. live in sbin; a non-login CI shell may lack it in PATH.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
CACHE_DIR=${VQBLK_CACHE_DIR:-/var/cache/vqblk}
KERNEL_CACHE=$CACHE_DIR/kernel
BACKPORTS_FILE=/etc/apt/sources.list.d/vqblk-backports.sources

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO=(sudo -n); else
        echo "install-deps: must run as root (or with passwordless sudo)" >&2; exit 1
    fi
fi

log() { echo "install-deps: $*"; }

APT_UPDATED=0
apt_update_once() {
    if [ "$APT_UPDATED" -eq 0 ]; then
        log "running apt-get update"
        "${SUDO[@]}" apt-get update -q -o DPkg::Lock::Timeout=300 </dev/null
        APT_UPDATED=1
    fi
}

apt_install() {
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends -o DPkg::Lock::Timeout=300 \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "$@" </dev/null
}

pkg_installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" = "install ok installed" ]
}

# Major version of qemu-system-x86_64, or 0 if absent.
qemu_major() {
    local v
    v=$(qemu-system-x86_64 --version 2>/dev/null | sed -n 's/.*version \([0-9][0-9]*\)\..*/\1/p' | head -n1)
    echo "${v:-0}"
}

# Does any apt source already carry bookworm-backports?
have_backports_source() {
    grep -rqsE '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null
}

# Write a deb822 entry for bookworm-backports that reuses the URIs and keyring of the
# existing Debian entry whose Suites contain `bookworm`.
add_backports_source() {
    local uris="" keyring="" f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -e "$f" ] || continue
        [ "$f" = "$BACKPORTS_FILE" ] && continue
        # deb822 stanzas are separated by blank lines; pick the first stanza whose
        # Suites field holds the bare word `bookworm`.
        read -r uris keyring < <(awk '
            BEGIN { RS = ""; FS = "\n" }
            {
                u = ""; k = ""; s = ""
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^URIs:/)      { u = $i; sub(/^URIs:[ \t]*/, "", u) }
                    if ($i ~ /^Signed-By:/) { k = $i; sub(/^Signed-By:[ \t]*/, "", k) }
                    if ($i ~ /^Suites:/)    { s = " " $i " " }
                }
                if (s ~ /[ \t]bookworm[ \t]/ && u != "") {
                    split(u, a, /[ \t]+/); print a[1], k; exit
                }
            }' "$f") || true
        [ -n "$uris" ] && break
    done
    if [ -z "$uris" ]; then
        uris=http://deb.debian.org/debian
        log "no deb822 bookworm entry found; falling back to $uris"
    fi
    if [ -z "$keyring" ]; then keyring=/usr/share/keyrings/debian-archive-keyring.gpg; fi
    log "adding $BACKPORTS_FILE (URIs: $uris, Signed-By: $keyring)"
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
        "$uris" "$keyring" | "${SUDO[@]}" tee "$BACKPORTS_FILE" >/dev/null
}

did=()

# ---------------------------------------------------------------- what is missing?
need_pkgs=()
command -v cc >/dev/null 2>&1 || need_pkgs+=(gcc libc6-dev)
pkg_installed busybox-static || need_pkgs+=(busybox-static)
command -v cpio >/dev/null 2>&1 || need_pkgs+=(cpio)
command -v blkdiscard >/dev/null 2>&1 || need_pkgs+=(util-linux)
command -v dpkg-deb >/dev/null 2>&1 || need_pkgs+=(dpkg)
# depmod: Debian's kernel .deb does not ship modules.dep (its postinst generates it).
command -v depmod >/dev/null 2>&1 || need_pkgs+=(kmod)
# Headless browser for the HTML report test (crates/study/tests/html_chromium.rs).
[ -x /usr/bin/chromium ] || need_pkgs+=(chromium)
# promtool checks the Prometheus endpoint (tests/metrics.rs).
command -v promtool >/dev/null 2>&1 || need_pkgs+=(prometheus)
# tmux drives `vqblk top` in an 80x24 pane (tests/control_cli.rs).
command -v tmux >/dev/null 2>&1 || need_pkgs+=(tmux)
# The throw-away Ceph cluster of the RBD tests (scripts/ceph/start.sh) and
# librbd, which vqblk loads at run time for `--backend rbd`.
for p in ceph-mon ceph-osd ceph-common librbd1 librados2 uuid-runtime bc; do
    pkg_installed "$p" || need_pkgs+=("$p")
done

need_qemu=0
[ "$(qemu_major)" -ge 10 ] || need_qemu=1

# The backports source must be in place before the (single) apt-get update.
if [ "$need_qemu" -eq 1 ] && ! have_backports_source; then
    add_backports_source
    did+=("added $BACKPORTS_FILE")
fi

# ---------------------------------------------------------------- plain packages
if [ "${#need_pkgs[@]}" -gt 0 ]; then
    apt_update_once
    log "installing ${need_pkgs[*]}"
    apt_install "${need_pkgs[@]}"
    did+=("installed ${need_pkgs[*]}")
else
    log "gcc, busybox-static, cpio, blkdiscard, depmod, chromium: already present"
fi

# ---------------------------------------------------------------- QEMU 10
if [ "$need_qemu" -eq 0 ]; then
    log "qemu-system-x86_64 $(qemu-system-x86_64 --version | head -n1 | sed 's/.*version //'): already present"
else
    apt_update_once
    # (capture first: `apt-cache | grep -q` can SIGPIPE apt-cache and trip pipefail)
    policy=$(apt-cache policy qemu-system-x86)
    if ! grep -q bookworm-backports <<<"$policy"; then
        echo "install-deps: bookworm-backports offers no qemu-system-x86 (apt-cache policy:)" >&2
        echo "$policy" >&2
        exit 1
    fi
    # -t bookworm-backports raises backports' priority for this transaction, so the
    # matching qemu-system-common/-data, seabios and ipxe-qemu come from there too.
    # qemu-utils is named so that it is kept in lock-step with the system emulator.
    log "installing qemu-system-x86 from bookworm-backports"
    apt_install -t bookworm-backports qemu-system-x86 qemu-system-common qemu-system-data qemu-utils
    if [ "$(qemu_major)" -lt 10 ]; then
        echo "install-deps: qemu-system-x86_64 is still not 10.x:" >&2
        qemu-system-x86_64 --version >&2 || true
        exit 1
    fi
    did+=("installed $(qemu-system-x86_64 --version | head -n1)")
fi

# ---------------------------------------------------------------- qemu-storage-daemon's rbd driver
# qemu-block-extra must match qemu-utils (bookworm-backports): the RBD benchmark
# runs qemu-storage-daemon's own rbd driver against vqblk's.
if pkg_installed qemu-block-extra; then
    log "qemu-block-extra: already present"
else
    apt_update_once
    log "installing qemu-block-extra from bookworm-backports"
    apt_install -t bookworm-backports qemu-block-extra
    did+=("installed qemu-block-extra")
fi

# ---------------------------------------------------------------- libvirt
# tests/libvirt.rs runs docs/qemu.md's domain XML (a vhostuser disk) with the
# real libvirt: bookworm-backports' libvirt 11, of QEMU 10's time.
if pkg_installed libvirt-daemon-driver-qemu && pkg_installed libvirt-clients &&
    command -v libvirtd >/dev/null 2>&1 && command -v virtlogd >/dev/null 2>&1; then
    log "libvirt: already present"
else
    apt_update_once
    log "installing libvirt from bookworm-backports"
    apt_install -t bookworm-backports libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients
    did+=("installed libvirt $(virsh --version 2>/dev/null || echo '?')")
fi

# ---------------------------------------------------------------- guest kernel
kernel_ok() {
    local d=$KERNEL_CACHE/current
    [ -f "$d/.complete" ] && compgen -G "$d/boot/vmlinuz-*" >/dev/null &&
        [ -n "$(find "$d/lib/modules" -name 'modules.dep' -print -quit 2>/dev/null)" ]
}

if [ "${VQBLK_SKIP_KERNEL:-0}" = 1 ]; then
    log "kernel: skipped (VQBLK_SKIP_KERNEL=1)"
elif kernel_ok; then
    log "kernel: already extracted in $(readlink -f "$KERNEL_CACHE/current")"
else
    apt_update_once
    # linux-image-amd64 is a metapackage; its first Depends is the real image
    # (e.g. linux-image-6.1.0-41-amd64).
    kpkg=$(apt-cache show --no-all-versions linux-image-amd64 |
        sed -n 's/^Depends: *\([^ ,(|]*\).*/\1/p' | head -n1)
    if [ -z "$kpkg" ]; then
        echo "install-deps: cannot resolve linux-image-amd64's kernel package" >&2; exit 1
    fi
    kver=$(apt-cache show --no-all-versions "$kpkg" | sed -n 's/^Version: *//p' | head -n1)
    dest=$KERNEL_CACHE/${kpkg}_${kver}
    log "kernel: downloading $kpkg $kver and extracting into $dest"
    "${SUDO[@]}" mkdir -p "$KERNEL_CACHE"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    chmod 755 "$tmp"
    # apt-get download drops privileges to _apt; let it write into the temp dir.
    if id _apt >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then chown _apt "$tmp"; fi
    (cd "$tmp" && apt-get download -q "$kpkg=$kver" </dev/null)
    deb=$(find "$tmp" -maxdepth 1 -name '*.deb' -print -quit)
    [ -n "$deb" ] || { echo "install-deps: apt-get download produced no .deb" >&2; exit 1; }
    "${SUDO[@]}" rm -rf "$dest.partial" "$dest"
    "${SUDO[@]}" mkdir -p "$dest.partial"
    "${SUDO[@]}" dpkg-deb -x "$deb" "$dest.partial"
    # Debian ships modules.order/modules.builtin but not modules.dep (depmod runs in
    # postinst).  Generate it if missing, with depmod when available, else with our
    # own scan of the .ko files' "depends=" modinfo field (see build-initramfs.sh).
    for mdir in "$dest.partial"/lib/modules/*/; do
        kv=$(basename "$mdir")
        if [ ! -f "$mdir/modules.dep" ] && command -v depmod >/dev/null 2>&1; then
            "${SUDO[@]}" depmod -b "$dest.partial" "$kv" || true
        fi
    done
    echo "$kpkg $kver" | "${SUDO[@]}" tee "$dest.partial/.complete" >/dev/null
    "${SUDO[@]}" mv "$dest.partial" "$dest"
    "${SUDO[@]}" ln -sfn "$(basename "$dest")" "$KERNEL_CACHE/current"
    rm -rf "$tmp"
    trap - EXIT
    did+=("extracted kernel $kpkg $kver into $dest")
fi

if [ "${#did[@]}" -eq 0 ]; then
    log "nothing to do: everything already in place"
else
    for d in "${did[@]}"; do log "done: $d"; done
fi

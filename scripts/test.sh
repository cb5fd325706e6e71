#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need
# (QEMU 10 from bookworm-backports, a Debian kernel, busybox), then runs the
# format and lint checks, every unit and integration test (libblkio client,
# qemu-storage-daemon peer, QEMU guest end to end) and the doc build.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }

step "install test dependencies"
scripts/install-deps.sh

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test (unit, integration, end to end)"
# --test-threads: the QEMU guests and daemons are heavy on a 2-core machine.
cargo test --workspace --release -- --test-threads=2

step "cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

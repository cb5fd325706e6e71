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

step "python scripts compile"
python3 -m py_compile scripts/*.py

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test (unit, integration, end to end)"
# --test-threads: the QEMU guests and daemons are heavy on a 2-core machine.
mkdir -p target
cargo test --workspace --release -- --test-threads=2 2>&1 | tee target/test-output.log

step "cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

# One closing line over every test binary (cargo prints one result line per
# binary, the last ones being doc-test runners with nothing to run). A
# result line can follow a daemon's log output on the same line (stderr and
# stdout share the pipe): it is found anywhere in a line.
awk '{ if (match($0, /test result: [A-Za-z]+\. [0-9]+ passed; [0-9]+ failed/)) {
         split(substr($0, RSTART, RLENGTH), w, " "); p += w[4]; f += w[6] } }
     END { printf "\ntests: %d passed, %d failed\n", p, f }' target/test-output.log

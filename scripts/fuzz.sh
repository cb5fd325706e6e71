#!/usr/bin/env bash
# Runs the fuzz harnesses (tests/fuzz_*.rs, stable toolchain) for a given time
# each and prints, per target, executions, exec/s and findings.
#
#   scripts/fuzz.sh [-j N] [SECONDS] [TARGET...]
#
# TARGET is parser, queue or vhost (default: all three); SECONDS defaults to
# 60. -j 2 runs two targets at a time. VQBLK_FUZZ_SEED fixes the seed.
# Findings are saved under target/tmp/fuzz-findings/<target>/ with the
# command that replays them; the full output of each target is in
# target/tmp/fuzz-<target>.log.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=1
if [[ "${1:-}" == "-j" ]]; then
    jobs="$2"
    shift 2
fi
seconds="${1:-60}"
shift || true
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
    targets=(parser queue vhost)
fi

args=()
for t in "${targets[@]}"; do
    args+=(--test "fuzz_$t")
done
echo "building ${targets[*]} (release)..."
cargo test --release --no-run "${args[@]}" >/dev/null 2>&1 || cargo test --release --no-run "${args[@]}"

mkdir -p target/tmp
run_one() {
    local t="$1"
    local log="target/tmp/fuzz-$t.log"
    local rc=0
    VQBLK_FUZZ_SECONDS="$seconds" cargo test --release --test "fuzz_$t" -- \
        --nocapture --exact "fuzz_$t" >"$log" 2>&1 || rc=$?
    local line
    line=$(grep -E "^fuzz $t: [0-9]+ executions" "$log" | tail -1 || true)
    if [[ -z "$line" ]]; then
        line="fuzz $t: no summary (see $log)"
    fi
    echo "$line"
    grep -E "^fuzz $t: results" "$log" | tail -1 || true
    if [[ $rc -ne 0 ]]; then
        echo "fuzz $t: FAILED (exit $rc): findings in $log"
        grep -E "^FINDING" "$log" | head -20 || true
    fi
    return $rc
}

status=0
pids=()
for t in "${targets[@]}"; do
    if [[ "$jobs" -gt 1 ]]; then
        run_one "$t" &
        pids+=($!)
        while [[ $(jobs -rp | wc -l) -ge "$jobs" ]]; do
            wait -n || status=1
        done
    else
        run_one "$t" || status=1
    fi
done
for p in "${pids[@]}"; do
    wait "$p" || status=1
done
exit $status

#!/bin/bash
# Round trip of one cache line between two CPUs, in ns: a thread on each
# CPU hands an atomic flag back and forth 2M times. Every ring access that
# crosses from the driver's CPU to the IOThread's pays this, so on a VM whose
# vCPUs the host sometimes places on cores that share no cache, every
# cross-CPU benchmark figure moves with it (docs/performance.md, "The host's
# cache-line round trip"). scripts/bench.py serve runs it before and after
# every run; compare only runs in the same mode.
#
# usage: scripts/cacheline-rtt.sh [CPU_A] [CPU_B] [SAMPLES]   (default 0 1 1)
set -euo pipefail
a=${1:-0}
b=${2:-1}
n=${3:-1}
cc=$(command -v cc || command -v gcc) || { echo "a C compiler is needed (Debian package gcc)" >&2; exit 2; }
t=$(mktemp -d /tmp/vqblk-rtt.XXXXXX)
trap 'rm -rf "$t"' EXIT
cat >"$t/rtt.c" <<'C'
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ROUNDS 2000000L

static _Alignas(64) _Atomic long flag;

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) {
        fprintf(stderr, "cannot run on CPU %d\n", cpu);
        exit(2);
    }
}

static void *answer(void *arg) {
    pin(*(int *)arg);
    for (long i = 0; i < ROUNDS; i++) {
        while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 1) {
        }
        atomic_store_explicit(&flag, 2 * i + 2, memory_order_release);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int a = atoi(argv[1]), b = atoi(argv[2]);
    pthread_t t;
    struct timespec t0, t1;
    pin(a);
    pthread_create(&t, NULL, answer, &b);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < ROUNDS; i++) {
        atomic_store_explicit(&flag, 2 * i + 1, memory_order_release);
        while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 2) {
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    pthread_join(t, NULL);
    double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    printf("CPU %d <-> CPU %d: %.1f ns per cache-line round trip\n", a, b, ns / ROUNDS);
    return 0;
}
C
"$cc" -O2 -pthread -o "$t/rtt" "$t/rtt.c"
for i in $(seq "$n"); do
    [ "$i" -gt 1 ] && sleep 1
    "$t/rtt" "$a" "$b"
done

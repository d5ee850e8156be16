#!/usr/bin/env bash
# Side-by-side builds of the CUDA code with different compile-time settings, benchmarked in
# alternation in one run (ratios from one machine state, not from two calls).
#
#   tools/device/variants.sh LOGDIR MODEL NAME=FLAGS... [-- BENCH_ENGINE_ARGS...]
#
#   NAME=FLAGS  a variant: FLAGS are extra nvcc flags ("" for the default build), e.g.
#               base= down8=-DDOWN_ROWS=8 gu2="-DGU_ROWS=2 -DDOWN_ROWS=8"
#   ROUNDS=N    benchmark rounds, each running every variant once (default 2)
#   TESTS=1     also run each variant's GPU tests (one runner at a time: the VRAM-budget test
#               counts every process on the GPU); TESTS="NAME ..." only those variants' tests
#
# Builds go to /tmp/moed-var-NAME in parallel (tools/device/gpu-check.sh's build step, so the
# .carry/ dependencies apply); each bench prints the table row of build/bench/bench_engine.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ $# -lt 3 ]; then
    sed -n '2,15p' "$0" >&2
    exit 2
fi
LOG=$1 MODEL=$2
shift 2
names=() flags=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case $1 in
    *=*) names+=("${1%%=*}") flags+=("${1#*=}") ;;
    *) echo "variants: '$1' is not NAME=FLAGS" >&2; exit 2 ;;
    esac
    shift
done
[ "${1:-}" = "--" ] && shift
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--prompt 512 --gen 128 --batches 4,16 --long 0)
mkdir -p "$LOG"
export LD_LIBRARY_PATH=$PWD/.carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
TESTS=${TESTS:-0}
tested() { [ "$TESTS" = 1 ] || case " $TESTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

for i in "${!names[@]}"; do
    n=${names[$i]}
    targets="build/bench/bench_engine"
    tested "$n" && targets="$targets build/tests/moe-gpu-tests bin/moed-worker"
    B=/tmp/moed-var-$n NVCCFLAGS="-O3 -lineinfo ${flags[$i]}" BUILD_TARGETS="$targets" \
        tools/device/gpu-check.sh "$LOG/build-$n" build >"$LOG/build-$n.txt" 2>&1 &
done
wait
ok=()
for n in "${names[@]}"; do
    if grep -q "^build ok" "$LOG/build-$n.txt"; then
        ok+=("$n")
    else
        echo "$n: build failed"
        tail -n 15 "$LOG/build-$n/build.log" 2>/dev/null
    fi
done

if [ "$TESTS" != 0 ]; then
    for n in "${ok[@]}"; do
        tested "$n" || continue
        MOE_BIN=/tmp/moed-var-$n/bin timeout 900 /tmp/moed-var-$n/build/tests/moe-gpu-tests -j 1 \
            >"$LOG/tests-$n.log" 2>&1
        echo "$n tests: exit $? ($(grep -E 'passed' "$LOG/tests-$n.log" | tail -n 1))"
        grep "^FAIL" "$LOG/tests-$n.log" | head -n 5
    done
fi

for r in $(seq 1 "${ROUNDS:-2}"); do
    for n in "${ok[@]}"; do
        timeout 300 /tmp/moed-var-$n/build/bench/bench_engine "$MODEL" --device cuda:0 "${ARGS[@]}" \
            >"$LOG/bench-$n-$r.log" 2>&1
        echo "$n #$r: $(grep '^| cuda' "$LOG/bench-$n-$r.log" || tail -n 1 "$LOG/bench-$n-$r.log")"
    done
done

#!/usr/bin/env bash
# Synthetic Qwen3-30B-A3B-shape model on the CPU backend: time to write it with moectl mkmodel,
# then prompt and decode speed of the standalone worker, then the daemon's store load time.
#
#   BIN=bin OUT=/tmp bench/cpu-synthetic-30b.sh [THREADS]
# Results go to docs/benchmarks.md by hand, with the machine and commit.
set -uo pipefail
BIN=${BIN:-bin}
OUT=${OUT:-/tmp}
T=${1:-$(nproc)}
M=$OUT/q30-q4_k_m.gguf
echo "== machine: $(nproc) cores, $(free -g | awk '/Mem/ {print $2}') GiB RAM; threads $T"
echo "== mkmodel qwen3-30b-a3b q4_k_m"
/usr/bin/time -f "mkmodel: %e s wall, %U s user, %S s sys, max RSS %M KiB" \
    "$BIN/moectl" mkmodel --preset qwen3-30b-a3b --quant q4_k_m --threads "$T" -o "$M" || exit 1
ls -l "$M"
"$BIN/moectl" inspect "$M" --vram-budget 12G | tail -n 12
echo "== moed-worker: p1 prompt, 64 tokens greedy (cold page cache is not dropped: the file was just written)"
"$BIN/moed-worker" --model "$M" --prompt-file tests/golden/prompts/p1.txt -n 64 --threads "$T" \
    --routing-stats 2>&1 >/dev/null | grep -v -E '^\s*$|^layer ' | tail -n 12
echo "== moed-worker: a 1062-token prompt (p1..p3 repeated), 32 tokens"
for i in 1 2 3 4 5 6 7; do cat tests/golden/prompts/p1.txt tests/golden/prompts/p2.txt; done > "$OUT/long.txt"
"$BIN/moed-worker" --model "$M" --prompt-file "$OUT/long.txt" -n 32 --threads "$T" 2>&1 >/dev/null | tail -n 3
echo "== moed: store load with 1 CPU worker"
st=$(mktemp -d)
start=$(date +%s.%N)
"$BIN/moed" --model "$M" --socket "$st/s.sock" --state-dir "$st/state" --devices cpu --workers 1 \
    > "$st/log" 2>&1 &
pid=$!
for _ in $(seq 1 1800); do
    grep -q "ready" "$st/log" 2>/dev/null && "$BIN/moectl" --socket "$st/s.sock" status >/dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
done
echo "daemon ready after $(awk "BEGIN {print $(date +%s.%N) - $start}") s"
grep -v '^\s*$' "$st/log" | tail -n 8
kill -TERM $pid; wait $pid
rm -rf "$st" "$M"

#!/usr/bin/env bash
# Tiered store on a synthetic Qwen3-30B-A3B-shape model (Q4_K_M): the disk's sequential read
# speed (dd, O_DIRECT), then for each RAM budget a daemon with one worker (a CPU worker, or the
# GPU DEVICES names): decode tokens/s, disk bytes per token, achieved read rate, hit rate and
# waits.
#
#   BIN=bin OUT=/tmp [DEVICES=0] bench/tier-30b.sh [THREADS] [BUDGETS...]
# BUDGETS default to 100% 50% 25%; MOED_ARGS are added to moed's arguments (a GPU worker's
# --vram-budget, say). Before each run the model file's pages leave the page cache
# (posix_fadvise DONTNEED; the rest of the cache is left alone). MODEL=FILE uses another GGUF.
# Results go to docs/benchmarks.md by hand.
set -uo pipefail
BIN=${BIN:-bin}
OUT=${OUT:-/tmp}
T=${1:-$(nproc)}
shift || true
BUDGETS=${*:-100% 50% 25%}
N=${GEN:-32}
M=${MODEL:-$OUT/q30-q4_k_m.gguf}
DEV=${DEVICES:-cpu}
echo "== machine: $(nproc) cores, $(free -g | awk '/Mem/ {print $2}') GiB RAM; threads $T; worker $DEV; commit $(git rev-parse --short HEAD 2>/dev/null)"
if [ ! -f "$M" ]; then
    "$BIN/moectl" mkmodel --preset qwen3-30b-a3b --quant q4_k_m --threads "$T" -o "$M" >/dev/null || exit 1
fi
ls -l "$M"
drop() { # the model file's pages only (posix_fadvise): other processes keep their cache
    sync "$M"
    python3 -c 'import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)' "$M" \
        && echo "model file dropped from the page cache"
}
drop
echo "== disk: sequential read of 8 GiB, O_DIRECT"
dd if="$M" of=/dev/null bs=16M count=512 iflag=direct 2>&1 | tail -n 1
st=$(mktemp -d)
req() { # prompt max_tokens -> seconds
    local t0 t1
    t0=$(date +%s.%N)
    "$BIN/moectl" --socket "$st/s.sock" --json generate -n "$2" --temp 0 "$1" > "$st/last.json"
    t1=$(date +%s.%N)
    awk "BEGIN {print $t1 - $t0}"
}
pool() { "$BIN/moectl" --socket "$st/s.sock" --json status | python3 -c '
import json, sys
p = json.load(sys.stdin).get("store", {}).get("pool")
print(" ".join(str(p.get(k, 0)) for k in ("read_bytes", "read_seconds", "reads", "waits", "hits", "misses")) if p else "0 0 0 0 0 0")'; }
P="In the beginning God created the heaven and the earth. And the earth was without form, and void"
for B in $BUDGETS; do
    echo "== --ram-budget $B"
    drop
    "$BIN/moed" --model "$M" --socket "$st/s.sock" --state-dir "$st/state" --devices "$DEV" --workers 1 \
        --threads "$T" --ram-budget "$B" ${MOED_ARGS:-} > "$st/log" 2>&1 &
    pid=$!
    for _ in $(seq 1 3000); do
        "$BIN/moectl" --socket "$st/s.sock" status 2>/dev/null | grep -q "^moed *ready" && break
        kill -0 $pid 2>/dev/null || break
        sleep 0.1
    done
    grep -E "ram-budget|tiered store|expert store|ready on" "$st/log"
    w=$(req "$P" 1)
    echo "prompt + 1 token: $w s"
    read -r b0 s0 r0 w0 h0 m0 <<<"$(pool)"
    d=$(req "$P" $((N + 1)))
    read -r b1 s1 r1 w1 h1 m1 <<<"$(pool)"
    gen=$(python3 -c '
import json, sys
t = open(sys.argv[1]).read().strip()
try:
    print(json.loads(t)["usage"]["completion_tokens"])
except Exception:
    print(sys.argv[2])' "$st/last.json" "$N")
    awk -v d="$d" -v n="$gen" -v b="$((b1 - b0))" -v s="$s1 $s0" -v r="$((r1 - r0))" -v w="$((w1 - w0))" 'BEGIN {
        split(s, a, " "); rs = a[1] - a[2];
        printf "decode: %d tokens in %.2f s = %.2f tok/s; disk %.1f MiB/token in %d reads (%.2f GiB/s while reading, reads summed); %d waits\n",
            n, d, n / d, b / n / 1048576, r, (rs > 0 ? b / rs / 1073741824 : 0), w }'
    sleep 1.2
    "$BIN/moectl" --socket "$st/s.sock" status | grep -E "^(pool|store)"
    kill -TERM $pid; wait $pid
done
rm -rf "$st"

#!/usr/bin/env bash
# Complementary hot sets end to end on a GPU machine: a daemon with two GPU workers (by default
# both on GPU 0, a quarter of each layer's experts in VRAM, routing signatures on), three
# workloads of 60 requests each in three rounds (scripture, documentation, C code, each with a
# system prompt of its own), then /admin/placement, the placement metrics and `moectl placement`
# into $OUT. Expect `complementary.active` true, each worker's `hot_experts` and the expected hit
# rates of identical against complementary sets (docs/offload.md, "Several GPU workers").
#
#   OUT=DIR [B=BUILD_PREFIX] [DEVS=0,1] [EXTRA="--vram-budget 20G"] tools/device/workloads-gpu.sh
#
# B: where bin/ is (default /tmp/moed-build, tools/device/gpu-check.sh's); DEVS, EXTRA: the
# daemon's --devices and its options instead of --expert-residency 25%.
B=${B:-/tmp/moed-build}
S=/tmp/wl; rm -rf $S; mkdir -p $S
$B/bin/moed --model models/kjv-demo-F16.gguf --socket $S/s.sock --state-dir $S/st --devices ${DEVS:-0,0} \
    ${EXTRA---expert-residency 25%} --route-signatures on --profile-interval 1 --parallel 4 >$S/log 2>&1 &
pid=$!
for i in $(seq 90); do $B/bin/moectl --socket $S/s.sock status >/dev/null 2>&1 && break; sleep 1; done
sys0="Thou art a reader of the scriptures. Continue the reading of the chapter that is given, verse by verse."
sys1="You are the assistant of an inference server's operators. Read the passage of its documentation below and explain it."
sys2="You review C code for a server that runs language models. Read the lines of the source file below and say what they do."
mapfile -t L0 < <(grep -v '^$' tests/fixtures/demo/heldout.txt | head -400)
mapfile -t L1 < <(grep -v '^$' docs/offload.md docs/store.md | head -400)
mapfile -t L2 < <(grep -v '^$' store/placement.c store/gguf.c | head -400)
send() { $B/bin/moectl --socket $S/s.sock generate -n 8 "$1" >/dev/null 2>&1; }
for round in 0 1 2; do
  for i in $(seq 0 19); do
    k=$(( (round * 20 + i) * 6 ))
    send "$sys0 ${L0[$k]} ${L0[$((k+1))]}" & p0=$!
    send "$sys1 ${L1[$k]} ${L1[$((k+1))]}" & p1=$!
    send "$sys2 ${L2[$k]} ${L2[$((k+1))]}" & p2=$!
    wait $p0 $p1 $p2
  done
  sleep 3
done
curl -s --unix-socket $S/s.sock http://moed/admin/placement > $OUT/placement.json
curl -s --unix-socket $S/s.sock http://moed/metrics | grep -E "hot_experts|workload|placement_|expert_hits_total|expert_misses_total" > $OUT/metrics.txt
$B/bin/moectl --socket $S/s.sock placement > $OUT/placement.txt 2>&1
kill $pid; wait $pid
grep -E "placement|error|warn" $S/log | tail -20
cat $OUT/metrics.txt; tail -12 $OUT/placement.txt

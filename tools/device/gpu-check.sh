#!/usr/bin/env bash
# Build, GPU tests, GPU parity and benchmarks in one go, for a machine with an NVIDIA GPU and
# nvcc but without the Debian -dev packages: their headers and libraries come in .carry/
# (include/, lib/; tools/device/pack-deps.sh makes it) along with the generated protobuf-c files.
#
#   tools/device/gpu-check.sh [LOGDIR] [steps...]
#   steps: build tests parity sanitizer sampler daemon daemon-tests daemon-offload tiny big
#          offload tc tok multi variants envs trace
#   (sampler: the sampler's GPU tests, the engine's sampling tests and compute-sanitizer on the
#   worker with every spread pass on, MOE_SAMPLE_SPREAD=all, then bench_cuda_sample)
#   (tok: the mat-vec walk that converts each code once for 16 tokens, MOE_CUDA_MV_TOK=1: its
#   exactness tests, then bench_engine at 16 and 64 sequences with it off, on and for the dense
#   matrices only, in alternation, then ncu of its kernels and the 4-token ones at a 16-token step)
#   (tc: the products on tensor cores, MOE_CUDA_TC: their GPU tests, the tensor-core mat-vec
#   against the float walk, and bench_engine with the float walk, the default (down on tensor
#   cores), gate/up and down with grouped steps' inputs staged once, and all with the inputs
#   staged once, in alternation; multi: bench/bench_workers.py on the 30B model at 60% expert
#   residency, one GPU worker against one per GPU of the machine, 1/16/64 sequences, the store's
#   Pss and every worker's hit rate; on a one-GPU machine the one-worker row alone)
#
# The backend's switches pass through: `MOE_CUDA_TC=0 gpu-check.sh LOG build tests parity
# sanitizer offload` runs the suites with the float walk everywhere (the tests that compare
# against the float walk or the fused step set MOE_CUDA_TC=0 for their references).
#
# Binaries built here instead (no build step there): tools/device/pack-bins.sh says how; with
# its VARIANTS=, the `variants` step tests and benchmarks the other builds against the first.
#
# The tracked files (about 63 MB) and .carry (about 3.5 MB) are near the 64 MiB a device call can
# send: `git sparse-checkout set --no-cone '/*' '!/tests/golden/refs/'` before the call leaves
# out the golden logits (9.5 MB; the GPU tests and mkmodel do not read them, the parity step
# does), `git sparse-checkout disable` after it. With binaries built here, tools/device/pack-data.sh
# packs the models and fixtures instead, so that every step's tests find them.
#
# Every step logs to LOGDIR/<step>.log and prints a one-line result; the run goes on after a
# failed step so that one call reports everything.
set -uo pipefail
cd "$(dirname "$0")/../.."
LOG=${1:-/tmp/gpu-check}
shift || true
STEPS=${*:-build tests parity sanitizer daemon daemon-offload tiny big offload}
mkdir -p "$LOG"
B=${B:-/tmp/moed-build}
export CPATH=$PWD/.carry/include LIBRARY_PATH=$PWD/.carry/lib
export LD_LIBRARY_PATH=$PWD/.carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# Binaries built elsewhere (tools/device/pack-bins.sh): their libraries, and the vocabulary
# where the tree left the tokenizer out.
if [ -d "$B/lib" ]; then
    export LD_LIBRARY_PATH=$B/lib:$LD_LIBRARY_PATH
fi
if [ -f "$B/vocab.gguf" ] && [ ! -f tests/golden/tokenizer/qwen3-vocab.gguf ]; then
    mkdir -p tests/golden/tokenizer && cp "$B/vocab.gguf" tests/golden/tokenizer/qwen3-vocab.gguf
fi
# The test models and fixtures packed by tools/device/pack-data.sh, where the tree left them out.
if [ -f .carry/data.tar.xz ] && [ ! -f models/kjv-demo-F16.gguf ]; then
    tar -xJf .carry/data.tar.xz
fi
J=$(nproc)

step() { echo "== $1 ($(date +%T))"; }
# The 30B-shape model the benchmark steps share, made once per machine (its time printed).
M=/tmp/q30-q4_k_m.gguf
model30() {
    [ -f $M ] && return 0
    /usr/bin/time -f "mkmodel %e s" "$B/bin/moectl" mkmodel --preset qwen3-30b-a3b --quant q4_k_m \
        --threads "$J" -o $M >"$LOG/mkmodel.log" 2>&1
    tail -n 1 "$LOG/mkmodel.log"
}
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

if has build; then
    step build
    if ! sha256sum --quiet -c .carry/proto/SOURCES.sha256 >/dev/null 2>&1; then
        echo "build: .carry/proto was generated from another proto/*.proto; run tools/device/pack-deps.sh"
        exit 1
    fi
    mkdir -p "$B/build/proto"
    cp .carry/proto/* "$B/build/proto/" && touch "$B/build/proto/"*
    # BUILD_TARGETS: a shorter build (e.g. "bin/moed bin/moed-worker bin/moectl
    # build/tests/moe-gpu-tests", paths under $B) when the benches are not needed.
    targets="all $B/build/tests/moe-tests"
    [ -n "${BUILD_TARGETS:-}" ] && targets=$(for t in $BUILD_TARGETS; do printf '%s ' "$B/$t"; done)
    if make -j"$J" O="$B" $targets >"$LOG/build.log" 2>&1; then
        echo "build ok"
    else
        tail -n 30 "$LOG/build.log"
        exit 1
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
fi
if has tests; then
    step "gpu tests"
    timeout 900 "$B/build/tests/moe-gpu-tests" -v -j 1 ${GPU_TESTS:-} >"$LOG/gpu-tests.log" 2>&1
    grep -E "^(ok|FAIL|SKIP)|passed|worst|rel-L2|batch of" "$LOG/gpu-tests.log" | tail -n 60
fi
if has parity; then
    step "parity on cuda:0"
    MOE_TEST_DEVICE=cuda:0 MOE_BIN="$B/bin" timeout 600 "$B/build/tests/moe-tests" -v -j 4 \
        -f parity -f engine >"$LOG/parity.log" 2>&1
    grep -E "^(ok|FAIL)|passed|parity|greedy|\|" "$LOG/parity.log" | tail -n 70
fi
if has sanitizer; then
    step "compute-sanitizer"
    printf 'In the beginning God created the heaven and the earth.' >"$LOG/prompt.txt"
    for tool in memcheck racecheck; do
        for res in 1 0.3; do
            timeout 300 compute-sanitizer --tool $tool --error-exitcode 3 "$B/bin/moed-worker" \
                --model tests/golden/models/tiny-qwen3moe-Q4_K_M.gguf --prompt-file "$LOG/prompt.txt" \
                -n 6 --temp 0 --device cuda:0 --expert-residency $res \
                >"$LOG/sanitizer-$tool-$res.log" 2>&1
            echo "$tool, expert residency $res: exit $? ($(grep -c "Error\|error" "$LOG/sanitizer-$tool-$res.log") error lines)"
            tail -n 3 "$LOG/sanitizer-$tool-$res.log"
        done
    done
fi
if has sampler; then
    step "the sampler's spread passes, every one on (MOE_SAMPLE_SPREAD=all, the default)"
    timeout 300 "$B/build/tests/moe-gpu-tests" -v -j 2 -f cuda_sample >"$LOG/sampler-tests.log" 2>&1
    grep -E "^(ok|FAIL)|passed" "$LOG/sampler-tests.log" | tail -n 14
    MOE_SAMPLE_SPREAD=all timeout 300 "$B/build/tests/moe-gpu-tests" -v -j 2 -f cuda_engine_sampl \
        -f cuda_engine_samples >"$LOG/sampler-engine.log" 2>&1
    grep -E "^(ok|FAIL)|passed" "$LOG/sampler-engine.log" | tail -n 4
    printf 'In the beginning God created the heaven and the earth.' >"$LOG/prompt.txt"
    for tool in memcheck racecheck; do
        for args in "--temp 1 --top-k 0 --top-p 0.95 --min-p 0" "--temp 0.7 --top-k 0 --top-p 0.9 --min-p 0.05 --repeat-penalty 1.3" \
                    "--temp 0.8 --repeat-penalty 1.2"; do
            MOE_SAMPLE_SPREAD=all timeout 300 compute-sanitizer --tool $tool --error-exitcode 3 \
                "$B/bin/moed-worker" --model tests/golden/models/tiny-qwen3moe-Q4_K_M.gguf \
                --prompt-file "$LOG/prompt.txt" -n 8 $args --seed 3 --device cuda:0 \
                >"$LOG/sampler-$tool.log" 2>&1
            echo "$tool, $args: exit $? ($(tail -n 1 "$LOG/sampler-$tool.log"))"
        done
    done
    timeout 300 "$B/build/bench/bench_cuda_sample" 0.05 2>&1 | tee "$LOG/bench-sample.log" | tail -n 40
fi
if has daemon; then
    step "daemon with a CUDA worker (make demo's script)"
    MOE_BIN="$B/bin" timeout 300 scripts/demo.sh >"$LOG/demo.log" 2>&1
    echo "demo: exit $?"
    tail -n 14 "$LOG/demo.log"
fi
if has daemon-tests; then
    step "the daemon's system tests with CUDA workers (MOE_TEST_DEVICE=cuda:0)"
    MOE_TEST_DEVICE=cuda:0 MOE_BIN="$B/bin" timeout 600 "$B/build/tests/moe-tests" \
        -v -j 4 -f test_daemon >"$LOG/daemon-tests.log" 2>&1
    echo "daemon-tests: exit $?"
    grep -E "^(ok|FAIL|SKIP)|passed" "$LOG/daemon-tests.log" | grep -v "^ok" | tail -n 40
fi
if has daemon-offload; then
    step "daemon with a CUDA worker under an expert residency"
    timeout 300 tools/device/offload-daemon.py "$B/bin" models/kjv-demo-F16.gguf 40% \
        >"$LOG/daemon-offload.log" 2>&1
    echo "daemon-offload: exit $?"
    tail -n 40 "$LOG/daemon-offload.log"
fi
if has tiny; then
    step "bench tiny"
    "$B/build/bench/bench_engine" models/kjv-demo-F16.gguf --device cuda:0 --prompt 256 --gen 64 \
        --batches 4,16,64 --long 1024 2>&1 | tail -n 9
fi
if has big; then
    step "bench qwen3-30b-a3b q4_k_m"
    model30
    timeout 400 "$B/build/bench/bench_engine" $M --device cuda:0 ${BIG_ARGS:---prompt 512 --gen 128 --batches 4,16,64 --long 4096} \
        2>&1 | tee "$LOG/bench-30b.log" | tail -n 12
fi
if has offload; then
    step "offload bench qwen3-30b-a3b q4_k_m"
    model30
    timeout "${OFF_TIMEOUT:-500}" "$B/build/bench/bench_offload" $M --device cuda:0 ${OFF_ARGS:---budgets 12.7G,10G} \
        2>&1 | tee "$LOG/bench-offload.log" | tail -n 40
fi
if has tc; then
    step "expert products on tensor cores (MOE_CUDA_TC)"
    timeout 300 "$B/build/tests/moe-gpu-tests" -v -j 2 -f mv_tc -f cuda_tc_experts >"$LOG/tc-tests.log" 2>&1
    grep -E "^(ok|FAIL)|passed|rel-L2" "$LOG/tc-tests.log" | tail -n 20
    timeout 300 "$B/build/bench/bench_cuda_mv_tc" 0.05 2>&1 | tee "$LOG/bench-mv-tc.log" | tail -n 32
    model30
    for round in 1 2; do
        for v in "MOE_CUDA_TC=0" "MOE_CUDA_TC=down" "MOE_CUDA_TC=1 MOE_CUDA_TC_STAGED=1" \
                 "MOE_CUDA_TC=all MOE_CUDA_TC_STAGED=1"; do
            printf '%s, round %s: ' "$v" $round
            env $v timeout 200 "$B/build/bench/bench_engine" $M --device cuda:0 \
                ${TC_ARGS:---prompt 512 --gen 128 --batches 4,16,64 --long 0} 2>&1 | tail -n 1
        done
    done | tee "$LOG/bench-tc.log"
fi
if has tok; then
    step "the 16-token mat-vec walk (MOE_CUDA_MV_TOK)"
    MOE_CUDA_MV_TOK=1 timeout 300 "$B/build/tests/moe-gpu-tests" -v -j 3 -f cuda_matvec \
        -f cuda_forward_matches -f cuda_backend_ops_match >"$LOG/tok-tests.log" 2>&1
    grep -E "^FAIL|passed|differ" "$LOG/tok-tests.log" | tail -n 8
    model30
    for round in 1 2; do
        for v in "MOE_CUDA_MV_TOK=0" "MOE_CUDA_MV_TOK=1" "MOE_CUDA_MV_TOK=dense"; do
            printf '%s, round %s: ' "$v" $round
            env $v timeout 200 "$B/build/bench/bench_engine" $M --device cuda:0 \
                ${TOK_ARGS:---prompt 512 --gen 64 --batches 16,64 --long 0} 2>&1 | tail -n 1
        done
    done | tee "$LOG/bench-tok.log"
    # The 16-token kernels against the 4-token ones of a 16-token step (ncu, when installed).
    if command -v ncu >/dev/null; then
        for v in 1 0; do
            k='matvec_tok_kernel'
            [ $v = 0 ] && k='matvec_kernel<\(int\)12, \(int\)1[24], \(int\)4'
            MOE_CUDA_MV_TOK=$v timeout 200 ncu --kernel-name-base demangled -k regex:"$k" -c 2 \
                --section SpeedOfLight --section LaunchStats --section Occupancy \
                --section InstructionStats --section WarpStateStats --section MemoryWorkloadAnalysis \
                "$B/build/bench/bench_engine" $M --device cuda:0 --prompt 16 --gen 2 --batches "" \
                --long 0 >"$LOG/ncu-tok-$v.log" 2>&1
            echo "MOE_CUDA_MV_TOK=$v:"
            grep -E "^  [a-z_]+.*matvec|Duration|Registers Per|Achieved Occupancy|Executed Instructions  |L1/TEX Hit|L2 Hit|DRAM Throughput|Warp Cycles Per Issued" \
                "$LOG/ncu-tok-$v.log" | head -n 24
        done
    fi
fi
if has multi; then
    step "GPU workers: one against one per GPU (bench/bench_workers.py)"
    model30
    n=$(nvidia-smi -L | grep -c '^GPU')
    lists="--devices cuda:0"
    [ "$n" -gt 1 ] && lists="$lists --devices $(seq -s, -f 'cuda:%g' 0 $((n - 1)))"
    timeout "${MULTI_TIMEOUT:-580}" python3 bench/bench_workers.py $M $lists \
        --expert-residency "${MULTI_RESIDENCY:-60%}" --concurrency 1,16,64 --bin "$B/bin" \
        --json "$LOG/workers.json" 2>&1 | tee "$LOG/workers.log" | tail -n 40
fi
if has variants; then
    # Other builds packed beside the binaries (pack-bins.sh VARIANTS=name=dir): each one's GPU
    # tests (VARIANT_TESTS, -f filters; default the forward, fused-step, graph and attention
    # tests), then bench_engine of the base build and of every variant in alternation, two
    # rounds (VARIANT_ARGS; default batch 1 and 16 sequences after a 512-token prompt).
    step "variants against the base build"
    model30
    vs=$(cd "$B" && for d in */; do
        d=${d%/}
        case $d in bin | build | lib) ;; *) [ -x "$d/build/bench/bench_engine" ] && echo "$d" ;; esac
    done)
    for v in $vs; do
        timeout 300 "$B/$v/build/tests/moe-gpu-tests" -v -j 4 ${VARIANT_TESTS:--f cuda_forward_matches \
            -f cuda_fused_step -f cuda_graphs_equal -f cuda_attention_rope} >"$LOG/variant-$v-tests.log" 2>&1
        echo "$v tests: $(grep -E "passed" "$LOG/variant-$v-tests.log" | tail -n 1)"
        grep -E "^FAIL" "$LOG/variant-$v-tests.log" | head -n 5
    done
    for round in 1 2; do
        for v in base $vs; do
            bin=$B/build/bench/bench_engine
            [ $v != base ] && bin=$B/$v/build/bench/bench_engine
            printf '%s, round %s: ' $v $round
            timeout 200 "$bin" $M --device cuda:0 \
                ${VARIANT_ARGS:---prompt 512 --gen 128 --batches 16 --long 0} 2>&1 | tail -n 1
        done
    done | tee "$LOG/bench-variants.log"
fi
if has envs; then
    # Runtime switches against each other on one build: ENVS holds the settings, separated by
    # ';', each a list of NAME=VALUE (an empty one is the default), e.g.
    # ENVS=";MOE_CUDA_QKV_BRANCH=0;MOE_CUDA_PDL=0 MOE_CUDA_TC=down". bench_engine for each in
    # alternation, ENVS_ROUNDS rounds (default 3; ENVS_ARGS, default batch 1 in an engine of
    # one sequence after a 512-token prompt), then 64 greedy tokens of each against the first's.
    step "switches against each other"
    model30
    IFS=';' read -r -a envs <<<"${ENVS:-}"
    [ ${#envs[@]} -eq 0 ] && envs=("")
    for round in $(seq 1 "${ENVS_ROUNDS:-3}"); do
        for e in "${envs[@]}"; do
            printf '[%s], round %s: ' "$e" "$round"
            env $e timeout 200 "$B/build/bench/bench_engine" $M --device cuda:0 \
                ${ENVS_ARGS:---prompt 512 --gen 128 --batches "" --long 0} 2>&1 |
                grep -E "^decode batch|aggregate" | tr '\n' ' '
            echo
        done
    done | tee "$LOG/bench-envs.log"
    printf 'The quick brown fox jumps over the lazy dog. %.0s' {1..20} >"$LOG/greedy-prompt.txt"
    i=0
    for e in "${envs[@]}"; do
        env $e timeout 120 "$B/bin/moed-worker" --model $M --prompt-file "$LOG/greedy-prompt.txt" \
            -n 64 --temp 0 --json --device cuda:0 >"$LOG/greedy-$i.json" 2>"$LOG/greedy-$i.err"
        if [ $i -gt 0 ]; then
            cmp -s "$LOG/greedy-0.json" "$LOG/greedy-$i.json" &&
                echo "[$e]: 64 greedy tokens as [${envs[0]}]" ||
                echo "[$e]: greedy tokens DIFFER from [${envs[0]}]"
        fi
        i=$((i + 1))
    done
fi
if has trace; then
    # Every kernel of a one-token step on the GPU's clock (tools/device/kernel-trace.c, packed by
    # pack-bins.sh as kernel-trace.so, or TRACE_LIB) for each setting of ENVS (as above):
    # LOG/trace-N.txt, N the setting's position.
    step "kernel trace"
    model30
    lib=${TRACE_LIB:-$B/kernel-trace.so}
    if [ ! -f "$lib" ]; then
        echo "trace: no $lib (pack-bins.sh builds it where CUPTI's headers are)"
    else
        IFS=';' read -r -a envs <<<"${ENVS:-}"
        [ ${#envs[@]} -eq 0 ] && envs=("")
        i=0
        for e in "${envs[@]}"; do
            env $e CUDA_INJECTION64_PATH="$lib" MOE_TRACE_OUT="$LOG/trace-$i.txt" timeout 200 \
                "$B/build/bench/bench_engine" $M --device cuda:0 --prompt 512 --gen 128 \
                --batches "" --long 0 >"$LOG/trace-$i.log" 2>&1
            echo "[$e]: $(sed -n 2p "$LOG/trace-$i.txt" 2>/dev/null)"
            i=$((i + 1))
        done
    fi
fi

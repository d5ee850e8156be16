#!/bin/sh
# Builds ggml and ggml_check (build.sh), makes the files to check with our own moectl, and runs
# every check. The whole log goes to $WORK/results.txt; the exit status is non-zero when a file
# that should pass fails or a broken file (mutant) is not caught.
#
#   tools/ggml-check/run.sh          (from the repository root; about 2 minutes on 2 cores)
#
# Environment: as build.sh (GGML_SRC, GGML_REV, WORK, JOBS).
set -u

WORK=${WORK:-/tmp/ggml-check}
export WORK
tools/ggml-check/build.sh || exit 2

CHECK="$WORK/ggml_check"
MOECTL="$WORK/moed/bin/moectl"
FILES="$WORK/files"
LOG="$WORK/results.txt"
GOLDEN=tests/golden/models
rm -rf "$FILES"
mkdir -p "$FILES"
status=0

# Files made by our tools: mkmodel at every --quant, quantize from the golden F16 at every type
# the task lists, and the real-shape layouts as metadata-only (sparse) files.
for q in f16 q8_0 q4_k_m; do
    "$MOECTL" mkmodel --preset tiny --quant $q --quiet -o "$FILES/mkmodel-tiny-$q.gguf" || status=1
done
for t in q4_k_m q5_k_m q6_k q5_0 q4_0 q8_0; do
    "$MOECTL" quantize "$GOLDEN/tiny-qwen3moe-F16.gguf" "$FILES/quantize-golden-$t.gguf" $t \
        >/dev/null 2>&1 || status=1
done
for p in qwen3-30b-a3b qwen3-235b-a22b; do
    "$MOECTL" mkmodel --preset $p --quant q4_k_m --no-data --quiet \
        -o "$FILES/mkmodel-$p-q4_k_m-nodata.gguf" || status=1
done

{
    echo "# ggml-check $(date -u +%Y-%m-%dT%H:%MZ), ggml $(git -C "$WORK/ggml" rev-parse --short HEAD), moed $(git rev-parse --short HEAD 2>/dev/null)"
    "$CHECK" --types || status=1
    "$CHECK" --quant || status=1

    # Files that llama.cpp must load (and both readers must read identically).
    "$CHECK" --show-kv $GOLDEN/tiny-qwen3moe-F16.gguf || status=1
    "$CHECK" $GOLDEN/tiny-qwen3moe-Q8_0.gguf $GOLDEN/tiny-qwen3moe-Q4_K_M.gguf \
        models/kjv-demo-F16.gguf tests/golden/tokenizer/qwen3-vocab.gguf || status=1
    "$CHECK" "$FILES/mkmodel-tiny-f16.gguf" "$FILES/mkmodel-tiny-q8_0.gguf" || status=1
    "$CHECK" --mix $GOLDEN/tiny-qwen3moe-Q4_K_M.gguf "$FILES/mkmodel-tiny-q4_k_m.gguf" || status=1
    for t in q4_k_m q5_k_m q6_k q5_0 q4_0 q8_0; do
        mix=""
        [ $t = q4_k_m ] && mix="--mix $GOLDEN/tiny-qwen3moe-Q4_K_M.gguf"
        [ $t = q8_0 ] && mix="--mix $GOLDEN/tiny-qwen3moe-Q8_0.gguf"
        "$CHECK" --ref $GOLDEN/tiny-qwen3moe-F16.gguf $mix "$FILES/quantize-golden-$t.gguf" || status=1
    done
    "$CHECK" --meta-only --show-kv "$FILES/mkmodel-qwen3-30b-a3b-q4_k_m-nodata.gguf" || status=1
    "$CHECK" --meta-only "$FILES/mkmodel-qwen3-235b-a22b-q4_k_m-nodata.gguf" || status=1

    # Block-type mix against llama-quantize's Q4_K_M/Q5_K_M rule (the golden file was made by
    # llama-quantize and must pass too; a Q6_K file checked against the Q4_K_M rule must not).
    echo "# type mix vs llama-quantize's rule"
    for f in $GOLDEN/tiny-qwen3moe-Q4_K_M.gguf "$FILES/mkmodel-tiny-q4_k_m.gguf" \
             "$FILES/quantize-golden-q4_k_m.gguf" "$FILES"/mkmodel-qwen3-*-q4_k_m-nodata.gguf; do
        python3 tools/ggml-check/mix_rule.py "$f" q4_k_m || status=1
    done
    python3 tools/ggml-check/mix_rule.py "$FILES/quantize-golden-q5_k_m.gguf" q5_k_m || status=1
    if python3 tools/ggml-check/mix_rule.py "$FILES/quantize-golden-q6_k.gguf" q4_k_m >/dev/null; then
        echo "MUTANT NOT CAUGHT: mix_rule passed a q6_k file as q4_k_m"
        status=1
    fi

    # Test fixtures: both readers must agree; llama.cpp loadability is reported, not required
    # (they carry no vocabulary by design).
    echo "# tests/fixtures/hf (no tokenizer by design: llama.cpp failures expected)"
    "$CHECK" tests/fixtures/hf/*.gguf

    # Broken copies: each must FAIL, or the checks above prove nothing.
    echo "# mutants of the golden F16 and of the quantize q4_0 output: each must FAIL"
    python3 tools/ggml-check/mutants.py $GOLDEN/tiny-qwen3moe-F16.gguf "$FILES/mutants" >"$FILES/mutants.txt"
    python3 tools/ggml-check/mutants.py "$FILES/quantize-golden-q4_0.gguf" "$FILES/mutants-q4_0" |
        grep '^type-noncompute' >>"$FILES/mutants.txt"
    while IFS="$(printf '\t')" read -r name path what; do
        echo "## mutant $name: $what"
        if "$CHECK" --max-lines 3 "$path"; then
            echo "MUTANT NOT CAUGHT: $name"
            status=1
        fi
    done <"$FILES/mutants.txt"
    echo "# overall: $([ $status = 0 ] && echo PASS || echo FAIL)"
} >"$LOG" 2>&1

grep -E '^(PASS|FAIL|MUTANT|# overall)' "$LOG"
echo "full log: $LOG"
exit $status

#!/usr/bin/env bash
# Packs the files the tests read on a device call (the demo model and its fixtures, the golden
# models, references and prompts, the transformers fixtures, the demo's PyTorch evaluation)
# into .carry/data.tar.xz: about 47 MB for 53 MB, so that a call can send them beside the
# binaries of pack-bins.sh (about 14 MB) within the 64 MiB a call may send, and run every GPU
# test, the demo's tests and the daemon's tests there. Then leave them, and the sources that
# packed binaries do not need, out of the call's tree:
#
#   tools/device/pack-bins.sh /tmp/dev-build && tools/device/pack-data.sh
#   tools/device/pack-data.sh --sparse | git sparse-checkout set --no-cone --stdin
#   (through a pipe: an unquoted $(...) would let the shell expand '/*' into the root's folders)
#   (the call, carry [".carry"]) tar -C /tmp -xJf .carry/bins.tar.xz; tar -xJf .carry/data.tar.xz
#       mkdir -p tests/golden/tokenizer; cp /tmp/moed-bins/vocab.gguf tests/golden/tokenizer/qwen3-vocab.gguf
#       export MOE_BIN=/tmp/moed-bins/bin    # where the tests find moed, moectl, moed-worker
#   (tools/device/gpu-check.sh does the unpacking itself)
#   git sparse-checkout disable
#
# (A sparse checkout rewrites the files it brings back, so the next make rebuilds everything.)
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA="models tests/golden/models tests/golden/refs tests/golden/prompts tests/fixtures/demo
tests/fixtures/hf tools/train-demo/run/eval.json"
if [ "${1:-}" = --sparse ]; then
    # Everything at the top, less the packed data, the tokenizer (in the binaries' pack) and the
    # sources.
    printf "%s\n" '/*' '!/docs/' '!/daemon/' '!/worker/' '!/store/' '!/tools/' '!/bench/' \
        '!/cli/' '!/proto/' '!/systemd/' '!/tests/gpu/' '!/tests/*.c' '!/tests/*.h' \
        '!/tests/fixtures/chat-templates/' '!/tests/golden/' '!/models/' '!/tests/fixtures/demo/' \
        '!/tests/fixtures/hf/'
    exit 0
fi
for p in $DATA; do
    [ -e "$p" ] || { echo "pack-data.sh: $p is missing (a sparse checkout?)" >&2; exit 1; }
done
mkdir -p .carry
# shellcheck disable=SC2086
tar -cf - $DATA | xz -T0 -6 > .carry/data.tar.xz
ls -l .carry/data.tar.xz

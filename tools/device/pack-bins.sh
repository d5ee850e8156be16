#!/usr/bin/env bash
# Packs binaries built here for a device call that runs them instead of building there:
#
#   make O=/tmp/dev-build CUDA_ARCH="-gencode arch=compute_90,code=sm_90" all test-build
#   tools/device/pack-bins.sh /tmp/dev-build            # -> .carry/bins.tar.xz (about 13 MB)
#   (on the device) tar -C /tmp -xJf .carry/bins.tar.xz &&
#       B=/tmp/moed-bins tools/device/gpu-check.sh LOG tests tok ...   # any steps but build
#
# The pack holds, stripped, the programs the steps run (bin/, build/tests/, build/bench/, in
# the build tree's layout), the shared libraries of the Debian packages they link (lib/,
# which gpu-check.sh puts on LD_LIBRARY_PATH), the kernel trace where CUPTI's headers are here
# (kernel-trace.so, gpu-check.sh's trace step) and the tokenizer's vocabulary (vocab.gguf,
# which `moectl mkmodel` reads from tests/golden/tokenizer/), so that a call can leave the
# golden references, the chat templates and the tokenizer out of its tree with `git
# sparse-checkout set --no-cone '/*' '!/tests/golden/refs/' '!/tests/fixtures/chat-templates/'
# '!/tests/golden/tokenizer/'` and stay under the 64 MiB a call may send (`git sparse-checkout
# disable` after it). PROGRAMS="bin/moed-worker build/bench/bench_engine ..." packs others. A
# pack of several variants (each adds about 0.5-2 MB) may also leave out the sources, which
# packed binaries do not need: '!/docs/' '!/daemon/' '!/worker/' '!/tests/*.c' (about 3 MB more),
# and the GPU tests and bench_engine do not read '!/tests/fixtures/demo/' (1.8 MB).
#
# Other builds of the same tree to compare in the same call (A/B on one machine) go in beside:
# VARIANTS="b=/tmp/dev-b c=/tmp/dev-c" packs each build's VARIANT_PROGRAMS (default
# bench_engine and moe-gpu-tests) under moed-bins/b/, moed-bins/c/, ... in the same layout;
# xz finds their bytes shared with the first build's, so each adds a few kilobytes when the
# builds differ in a kernel or two (`B=/tmp/moed-bins gpu-check.sh LOG variants` tests them and
# benchmarks them against the first build, or run /tmp/moed-bins/b/build/bench/bench_engine).
set -euo pipefail
cd "$(dirname "$0")/../.."
O=${1:?usage: pack-bins.sh BUILD_DIR}
PROGRAMS=${PROGRAMS:-bin/moed bin/moed-worker bin/moectl build/tests/moe-gpu-tests \
build/bench/bench_engine build/bench/bench_cuda_sample}
D=$(mktemp -d)/moed-bins
trap 'rm -rf "$(dirname "$D")"' EXIT
mkdir -p "$D/lib"
# put BUILD PROGRAM DEST: the program, stripped, at DEST/PROGRAM.
put() {
    mkdir -p "$3/$(dirname "$2")"
    cp "$1/$2" "$3/$2"
    strip "$3/$2" 2>/dev/null || true
}
for p in $PROGRAMS; do
    put "$O" "$p" "$D"
done
for v in ${VARIANTS:-}; do
    name=${v%%=*} dir=${v#*=}
    case $name in '' | */* | . | .. | bin | build | lib)
        echo "pack-bins.sh: bad variant name '$name' (NAME=BUILD_DIR)" >&2
        exit 1
        ;;
    esac
    for p in ${VARIANT_PROGRAMS:-build/bench/bench_engine build/tests/moe-gpu-tests}; do
        put "$dir" "$p" "$D/$name"
    done
done
. tools/device/libs.sh
device_libs_copy "$D/lib"
# The kernel trace (gpu-check.sh's trace step) where CUPTI's headers are here.
cupti=/usr/local/cuda/extras/CUPTI
if [ -f "$cupti/include/cupti.h" ] || [ -f /usr/local/cuda/include/cupti.h ]; then
    cc -O2 -shared -fPIC -o "$D/kernel-trace.so" tools/device/kernel-trace.c \
        -I/usr/local/cuda/include -I"$cupti/include" -L/usr/local/cuda/lib64 -L"$cupti/lib64" -lcupti
fi
git show HEAD:tests/golden/tokenizer/qwen3-vocab.gguf >"$D/vocab.gguf"
mkdir -p .carry
tar -C "$(dirname "$D")" -cf - moed-bins | xz -T2 --lzma2=preset=6,dict=192MiB >.carry/bins.tar.xz
ls -l .carry/bins.tar.xz

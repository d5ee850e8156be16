#!/bin/sh
# Builds ggml (CPU only, from a git mirror or clone, outside this repository), moed's store
# library, and tools/ggml-check/ggml_check linked against both. Nothing from ggml enters the repo.
#
#   tools/ggml-check/build.sh            (run from the repository root)
#
# Environment:
#   GGML_SRC    ggml git repository to clone   (default /work/.mirror/ggml-org+ggml/repo)
#   GGML_REV    revision to check out          (default HEAD)
#   WORK        scratch directory              (default /tmp/ggml-check)
#   JOBS        parallel build jobs            (default 2)
set -eu

GGML_SRC=${GGML_SRC:-/work/.mirror/ggml-org+ggml/repo}
GGML_REV=${GGML_REV:-HEAD}
WORK=${WORK:-/tmp/ggml-check}
JOBS=${JOBS:-2}
ROOT=$(pwd)

[ -f "$ROOT/tools/ggml-check/ggml_check.c" ] || { echo "run from the repository root" >&2; exit 2; }
mkdir -p "$WORK"

# 1. ggml, CPU only. Only libggml-base is needed: the GGUF loader, the type traits
#    (to_float) and ggml_quantize_chunk all live there.
if [ ! -d "$WORK/ggml/.git" ]; then
    git clone -q "$GGML_SRC" "$WORK/ggml"
fi
git -C "$WORK/ggml" checkout -q "$GGML_REV"
cmake -S "$WORK/ggml" -B "$WORK/ggml/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF \
      -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF \
      >"$WORK/ggml-cmake.log"
cmake --build "$WORK/ggml/build" -j "$JOBS" --target ggml-base >"$WORK/ggml-build.log"
GGML_LIB=$(find "$WORK/ggml/build" -name libggml-base.a | head -n 1)
echo "ggml $(git -C "$WORK/ggml" rev-parse --short HEAD): $GGML_LIB"

# 2. Our store library and programs, in their own output directory.
make -s -j "$JOBS" O="$WORK/moed" all
STORE_LIB="$WORK/moed/build/libmoestore.a"

# 3. Both libraries define gguf_find_tensor(); rename ours in a private copy of the archive
#    (definition and every reference), and compile our side with the same rename.
objcopy --redefine-sym gguf_find_tensor=moe_gguf_find_tensor "$STORE_LIB" "$WORK/libmoestore-renamed.a"

CFLAGS="-std=c11 -O2 -g -Wall -Wextra -Werror -D_GNU_SOURCE"
cc $CFLAGS -I. -Dgguf_find_tensor=moe_gguf_find_tensor -c tools/ggml-check/ggml_check.c \
   -o "$WORK/ggml_check.o"
cc $CFLAGS -I"$WORK/ggml/include" -c tools/ggml-check/ggml_side.c -o "$WORK/ggml_side.o"
cc -o "$WORK/ggml_check" "$WORK/ggml_check.o" "$WORK/ggml_side.o" "$WORK/libmoestore-renamed.a" \
   "$GGML_LIB" -lstdc++ -lgomp -luv -lprotobuf-c -llmdb -ljansson -lpcre2-8 -lxxhash -lsystemd -lm -lpthread
echo "built $WORK/ggml_check"

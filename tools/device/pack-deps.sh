#!/usr/bin/env bash
# Packs what tools/device/gpu-check.sh needs to build on a machine without the Debian -dev
# packages into .carry/ (ignored by git): the headers and shared libraries of the packages the
# Makefile links, and the protobuf-c files generated here (run `make` first).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .carry/include .carry/lib .carry/proto && mkdir -p .carry/include .carry/lib .carry/proto
for p in libuv1-dev libprotobuf-c-dev liblmdb-dev libhttp-parser-dev libjansson-dev \
         libxxhash-dev libpcre2-dev libsystemd-dev libedit-dev; do
    dpkg -L "$p" | grep '^/usr/include/' | while read -r f; do
        [ -f "$f" ] || continue
        d=.carry/include/${f#/usr/include/}
        mkdir -p "$(dirname "$d")" && cp "$f" "$d"
    done
done
. tools/device/libs.sh
device_libs_copy .carry/lib
cp build/proto/*.pb-c.[ch] .carry/proto/
# gpu-check.sh refuses to build with generated files of another proto/moed.proto.
sha256sum proto/*.proto >.carry/proto/SOURCES.sha256
du -sh .carry

# The shared libraries of the Debian packages the programs link (the -dev packages in
# scripts/deps.sh), for a GPU machine that lacks them: sourced by pack-deps.sh and pack-bins.sh.
DEVICE_LIBS="uv protobuf-c lmdb http_parser jansson xxhash pcre2-8 systemd edit bsd md tinfo"

# Copies them (the .so files and their links) into directory $1.
device_libs_copy() {
    for l in $DEVICE_LIBS; do
        cp -P /usr/lib/x86_64-linux-gnu/lib$l.so* "$1/"
    done
}

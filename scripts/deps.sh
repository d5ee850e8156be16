#!/usr/bin/env bash
# Installs the Debian 12 packages that building and testing moed need. Idempotent: does nothing
# when they are all present. As root it runs apt-get; otherwise it prints the exact command.
set -euo pipefail

PKGS=(build-essential pkg-config clang libclang-rt-14-dev
      libuv1-dev libprotobuf-c-dev protobuf-c-compiler liblmdb-dev
      libhttp-parser-dev libjansson-dev libxxhash-dev libpcre2-dev libsystemd-dev
      python3 python3-venv python3-pip)

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
    cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${missing[*]}"
    if [ "$(id -u)" -eq 0 ]; then
        echo "deps: installing ${missing[*]}" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        echo "deps: missing Debian packages; run as root:" >&2
        echo "  sudo sh -c '$cmd'" >&2
        exit 1
    fi
fi

#!/usr/bin/env bash
# Installs the Debian 12 packages that building, testing and demoing moed need (`make deps`; also
# the first step of `make test` and `make demo`). Idempotent: does nothing when they are all
# present. As root it runs apt-get; otherwise it prints the exact command and fails, because the
# build cannot go on without them. docs/install.md says why each package is here.
# Checked on a bare debootstrap --variant=minbase bookworm root by tools/fresh-debian/run.sh.
set -euo pipefail

PKGS=(
    # compiler, make's companions, and the C libraries the Makefile links
    build-essential
    libuv1-dev libprotobuf-c-dev protobuf-c-compiler liblmdb-dev
    libhttp-parser-dev libjansson-dev libxxhash-dev libpcre2-dev libsystemd-dev
    # moectl chat's line editing
    libedit-dev
    # `make fuzz`: libFuzzer and the sanitizer runtimes come with clang's runtime package
    clang libclang-rt-14-dev
    # scripts/demo.sh speaks HTTP to the daemon's Unix socket and reads its JSON with python3;
    # curl is what the README and docs/operations.md use to do the same by hand
    python3 curl
    # tests/run.sh makes a venv (build/venv) and pip-installs tests/py/requirements.txt from PyPI:
    # venv needs python3-venv (ensurepip), HTTPS to PyPI needs the CA bundle
    python3-venv python3-pip ca-certificates
)

if ! command -v dpkg-query >/dev/null 2>&1; then
    # Not Debian: say what is needed and let the build try; it fails clearly if something lacks.
    echo "deps: not a Debian system; make sure the equivalents of these are installed:" >&2
    echo "  ${PKGS[*]}" >&2
    exit 0
fi

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
    echo "deps: missing Debian packages: ${missing[*]}" >&2
    echo "deps: install them as root, then run make again:" >&2
    echo "  sudo sh -c '$cmd'" >&2
    exit 1
fi

# apt's output is long; keep it in a log and show it only when something goes wrong.
log=$(mktemp "${TMPDIR:-/tmp}/moed-deps.XXXXXX")
echo "deps: installing ${missing[*]}" >&2
echo "deps: (first time: about 160 MB to download, 730 MB on disk, 1-2 minutes; apt's log: $log)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get update >"$log" 2>&1 ||
   ! apt-get install -y --no-install-recommends "${missing[@]}" >>"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "deps: apt-get failed; the command was:" >&2
    echo "  $cmd" >&2
    exit 1
fi
rm -f "$log"
echo "deps: done" >&2

#!/usr/bin/env bash
# Proves the README's two commands on a fresh Debian 12 machine: builds a pristine bookworm root
# with debootstrap (once; kept as a tarball), unpacks a copy, puts a clean `git clone` of the repo
# (committed state only) in it, and runs `make demo` then `make test` inside chroot as root, the
# way a new user or CI would. Everything goes to one log; the summary at its end says which
# packages deps.sh had to install, what each step returned and how long it took.
#
#   tools/fresh-debian/run.sh [options]
#     --repo DIR        repository to clone (default: the one this script lives in)
#     --ref REF         commit to test (default HEAD)
#     --overlay PATH    copy PATH (a file or folder) from the working tree over the clone
#                       (repeatable): tests an uncommitted fix. The log lists every overlay.
#     --cuda            bind /usr/local/cuda* into the root read-only, as on the CI machine (which
#                       has the toolkit but no GPU): the Makefile then builds worker/cuda/*.cu
#     --steps LIST      comma-separated, default "demo,test". Also: ci (.ci/run); fuzz (`make
#                       fuzz`, then each target 10 s on its seeds); install (`make install
#                       DESTDIR=/tmp/moed-install`); usertest (`make demo test` as a non-root user in
#                       its own clone, once root's steps installed the packages); shell
#     --timeout SECS    per step (default 2400)
#     --rebuild-base    debootstrap again even if the base tarball exists
#     --keep            leave the root in place afterwards (mounts are always undone)
#     --no-host-ca      do not copy this host's local CA certificates into the root (see below)
#
# Needs root, debootstrap (installed when missing), network to deb.debian.org and PyPI.
# Paths: root /tmp/fresh-root, base /tmp/fresh-base.tar, log /tmp/fresh-<time>.log
# (override with FRESH_ROOT, FRESH_BASE, FRESH_LOG).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
ref=HEAD
overlays=()
cuda=0
steps=demo,test
step_timeout=2400
rebuild=0
keep=0
host_ca=1
ROOT=${FRESH_ROOT:-/tmp/fresh-root}
BASE=${FRESH_BASE:-/tmp/fresh-base.tar}
LOG=${FRESH_LOG:-/tmp/fresh-$(date -u +%Y%m%d-%H%M%S).log}
MIRROR=${FRESH_MIRROR:-http://deb.debian.org/debian}

while [ $# -gt 0 ]; do
    case $1 in
        --repo) repo=$(cd "$2" && pwd); shift 2 ;;
        --ref) ref=$2; shift 2 ;;
        --overlay) overlays+=("$2"); shift 2 ;;
        --cuda) cuda=1; shift ;;
        --steps) steps=$2; shift 2 ;;
        --timeout) step_timeout=$2; shift 2 ;;
        --rebuild-base) rebuild=1; shift ;;
        --keep) keep=1; shift ;;
        --no-host-ca) host_ca=0; shift ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "fresh-debian: unknown option $1" >&2; exit 2 ;;
    esac
done

if [ "$(id -u)" -ne 0 ]; then
    echo "fresh-debian: needs root (debootstrap, chroot, mount)" >&2
    exit 2
fi
# The root is rm -rf'ed below: refuse anything that is not a dedicated folder under /tmp.
case $ROOT in
    /tmp/?*) ;;
    *) echo "fresh-debian: FRESH_ROOT must be under /tmp (got $ROOT)" >&2; exit 2 ;;
esac

exec > >(tee -a "$LOG") 2>&1
say() { printf '\n=== [%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# Mounts are made private so nothing mounted under the root can propagate back to the host's
# /dev or /proc; teardown unmounts deepest first and never rm -rf's through a live mount.
mounted=()
mount_in() { # mount_in TARGET ARGS...
    local target=$1; shift
    mkdir -p "$target"
    mount "$@" "$target"
    mount --make-rprivate "$target"
    mounted+=("$target")
}
umount_all() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
        umount -l "${mounted[i]}" 2>/dev/null || true
    done
    mounted=()
}
still_mounted() { grep -q " ${ROOT}[/ ]" /proc/self/mounts; }
remove_root() {
    if [ -d "$ROOT" ]; then
        # Leftovers from an interrupted run: unmount anything under the root first.
        grep -o " ${ROOT}[^ ]*" /proc/self/mounts | sort -r | while read -r m; do umount -l "$m" || true; done
        if still_mounted; then
            echo "fresh-debian: $ROOT still has mounts; not removing it" >&2
            exit 1
        fi
        rm -rf --one-file-system "$ROOT"
    fi
}
cleanup() {
    umount_all
    if [ "$keep" = 0 ] && ! still_mounted; then rm -rf --one-file-system "$ROOT"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "fresh Debian 12 run: repo $repo ref $ref, log $LOG"
commit=$(git -C "$repo" rev-parse "$ref")
git -C "$repo" log -1 --format='commit %H%n%an, %ad%n%s' "$commit"

# ---- base root (once) ------------------------------------------------------------------------
if [ "$rebuild" = 1 ] || [ ! -s "$BASE" ]; then
    command -v debootstrap >/dev/null || { apt-get update -qq; apt-get install -y -qq debootstrap; }
    say "debootstrap --variant=minbase bookworm (the smallest Debian 12; a CI container image is the same)"
    tmp=$ROOT.base
    case $tmp in /tmp/?*) rm -rf --one-file-system "$tmp" ;; esac
    t0=$(date +%s)
    debootstrap --variant=minbase bookworm "$tmp" "$MIRROR"
    # What a real install's sources.list has: updates and security too.
    cat >"$tmp/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
    rm -rf "$tmp"/var/cache/apt/archives/*.deb
    tar -C "$tmp" -cf "$BASE.part" . && mv "$BASE.part" "$BASE"
    rm -rf --one-file-system "$tmp"
    echo "base root built in $(($(date +%s) - t0)) s: $BASE ($(du -h "$BASE" | cut -f1))"
fi

# ---- pristine copy + clean clone ----------------------------------------------------------------
say "unpacking $BASE into $ROOT"
remove_root
mkdir -p "$ROOT"
tar -C "$ROOT" -xf "$BASE"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
# This host's network may pass HTTPS through a proxy whose CA only the host trusts (local CAs in
# /usr/local/share/ca-certificates). Hand them to the root the way an admin would: ca-certificates'
# postinst (when deps.sh installs it) adds them to the bundle pip and curl use. That is the
# network, not the project: a fresh machine on an open network needs nothing of the sort.
if [ "$host_ca" = 1 ] && ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    mkdir -p "$ROOT/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
    echo "host's local CA certificates copied in: $(cd /usr/local/share/ca-certificates && ls *.crt | tr '\n' ' ')"
fi

# clone_to DIR: a clean clone of the commit under test, plus the overlays.
clone_to() {
    git clone -q --no-hardlinks "$repo" "$ROOT$1"
    git -C "$ROOT$1" -c advice.detachedHead=false checkout -q "$commit"
    local f
    for f in ${overlays[@]+"${overlays[@]}"}; do
        if [ -d "$repo/$f" ]; then
            mkdir -p "$ROOT$1/$f"
            cp -a "$repo/$f/." "$ROOT$1/$f/"
        else
            mkdir -p "$(dirname "$ROOT$1/$f")"
            cp -a "$repo/$f" "$ROOT$1/$f"
        fi
    done
}
src=/root/moed
say "git clone $repo @ ${commit:0:12} -> $ROOT$src"
clone_to "$src"
for f in ${overlays[@]+"${overlays[@]}"}; do
    echo "overlay from working tree: $f ($(git -C "$repo" diff --stat HEAD -- "$f" | tail -n 1))"
done

mount_in "$ROOT/proc" -t proc proc
mount_in "$ROOT/sys" -t sysfs sysfs
mount_in "$ROOT/dev" --bind /dev
mount_in "$ROOT/dev/pts" --bind /dev/pts
# Its own /dev/shm (tmpfs), so memfd/shm users see a normal one and nothing leaks to the host's.
mount_in "$ROOT/dev/shm" -t tmpfs -o mode=1777 tmpfs
if [ "$cuda" = 1 ]; then
    for d in /usr/local/cuda-*; do
        [ -d "$d" ] || continue
        mount_in "$ROOT$d" --bind "$d"
        mount -o remount,bind,ro "$ROOT$d"
    done
    [ -L /usr/local/cuda ] && cp -a /usr/local/cuda "$ROOT/usr/local/cuda"
    # The toolkit's installer registers its libraries with ld.so; do as this host did.
    for c in /etc/ld.so.conf.d/*cuda*; do [ -f "$c" ] && cp "$c" "$ROOT/etc/ld.so.conf.d/"; done
    chroot "$ROOT" ldconfig
    echo "CUDA toolkit bound read-only: $(ls -d "$ROOT"/usr/local/cuda* | sed "s|$ROOT||" | tr '\n' ' ')"
fi

# A clean login environment: nothing from this shell leaks in (no PATH additions, no venv, no CC).
# as_user USER CMD...: the same for another user of the root (HOME /home/USER).
in_root() {
    chroot "$ROOT" /usr/bin/env -i HOME=/root USER=root LOGNAME=root SHELL=/bin/bash TERM=dumb \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
}
as_user() {
    local u=$1; shift
    chroot --userspec="$u:$u" "$ROOT" /usr/bin/env -i HOME="/home/$u" USER="$u" LOGNAME="$u" \
        SHELL=/bin/bash TERM=dumb PATH=/usr/local/bin:/usr/bin:/bin "$@"
}

in_root dpkg-query -W -f='${Package}\n' | sort >"$LOG.pkgs-before"
say "fresh root: $(wc -l <"$LOG.pkgs-before") packages; make present: $(in_root sh -c 'command -v make || echo no')"

# The README's commands start with `make`, which a minimal Debian lacks: the one thing a new user
# installs by hand (docs/install.md says so). Everything else must come from `make`'s own deps step.
say "prerequisite: apt-get install make"
in_root sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends make >/dev/null'
in_root dpkg-query -W -f='${Package}\n' | sort >"$LOG.pkgs-make"

fuzz_cmd=$(cat <<'EOF'
make fuzz || exit 1
for f in build/fuzz/fuzz_*; do
    seeds=tests/fuzz-corpus/${f##*/fuzz_}
    [ -d "$seeds" ] || seeds=
    work=$(mktemp -d)
    rc=0
    "$f" -max_total_time=10 -max_len=16384 "$work" $seeds >"$work.log" 2>&1 || rc=$?
    echo "== $f ${seeds:-(no seeds)}: exit $rc; $(grep -E '^Done [0-9]+ runs' "$work.log" | tail -n 1)"
    [ "$rc" = 0 ] || { tail -n 40 "$work.log"; exit 1; }
    rm -rf "$work" "$work.log"
done
EOF
)
results=()
IFS=, read -r -a step_list <<<"$steps"
for step in "${step_list[@]}"; do
    runner=(in_root)
    case $step in
        demo|test) cmd="cd $src && make $step" ;;
        # Build the libFuzzer targets, then run each for a few seconds on its seeds: proves the
        # clang runtime deps.sh installs links and runs, not that the code is bug-free.
        fuzz) cmd="cd $src && $fuzz_cmd" ;;
        ci) cmd="cd $src && .ci/run" ;;
        install) cmd="cd $src && make install DESTDIR=/tmp/moed-install && find /tmp/moed-install -type f" ;;
        # `make demo` and `make test` as an ordinary user in their own clone, once root has installed the
        # packages (docs/install.md: `sudo make deps`, then build and test as yourself).
        usertest)
            if ! in_root id tester >/dev/null 2>&1; then in_root useradd -m -s /bin/bash tester; fi
            clone_to /home/tester/moed
            in_root chown -R tester:tester /home/tester/moed
            runner=(as_user tester)
            cmd="cd /home/tester/moed && make demo && make test" ;;
        shell) cmd="cd $src && exec bash -i" ;;
        *) echo "fresh-debian: unknown step $step" >&2; exit 2 ;;
    esac
    first=${cmd%%$'\n'*}
    [ "$first" = "$cmd" ] || first="$first ..."
    say "step $step: $first (timeout ${step_timeout}s)"
    t0=$(date +%s)
    set +e
    if [ "$step" = shell ]; then
        in_root bash -c "$cmd" </dev/tty >/dev/tty 2>&1
    else
        "${runner[@]}" timeout --kill-after=30 "$step_timeout" bash -c "$cmd" </dev/null
    fi
    rc=$?
    set -e
    dt=$(($(date +%s) - t0))
    say "step $step: exit $rc after ${dt}s"
    results+=("$step: exit $rc, $((dt / 60))m$((dt % 60))s")
done

# Anything the steps left running (a daemon or worker a test forgot to stop) shows up here: its
# /proc/PID/root is the fresh root. Listed as a finding, then stopped so the root can go.
leftover=()
for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$ROOT" ] && leftover+=("${p#/proc/}")
done
if [ ${#leftover[@]} -gt 0 ]; then
    say "processes still running in the root after the steps (a leak):"
    for pid in "${leftover[@]}"; do
        echo "  $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)"
    done
    kill -KILL "${leftover[@]}" 2>/dev/null || true
fi

in_root dpkg-query -W -f='${Package}\n' | sort >"$LOG.pkgs-after"
say "summary for ${commit:0:12}"
echo "packages deps.sh installed (directly or as dependencies): $(comm -13 "$LOG.pkgs-make" "$LOG.pkgs-after" | wc -l)"
comm -13 "$LOG.pkgs-make" "$LOG.pkgs-after" | tr '\n' ' ' | fold -s -w 100
echo
echo "processes left running by the steps: ${#leftover[@]}"
if [ -x "$ROOT$src/build/venv/bin/python" ]; then
    # tests/py/requirements.txt is unpinned: record what PyPI gave this run.
    echo "venv (tests/py): $(in_root "$src/build/venv/bin/python" -m pip freeze 2>/dev/null |
        grep -iE '^(pytest|numpy|gguf|openai)==' | tr '\n' ' ')"
fi
for r in "${results[@]}"; do echo "  $r"; done
rm -f "$LOG.pkgs-before" "$LOG.pkgs-make" "$LOG.pkgs-after"
for r in "${results[@]}"; do case $r in *"exit 0,"*) ;; *) exit 1 ;; esac; done

#!/usr/bin/env bash
# Runs every test that needs no GPU: the C unit/integration tests (one binary, forked per test),
# then the Python suites under tests/py/ (real daemon, openai SDK, cross-checks with gguf).
# Ends with one line "N passed, N failed" for the whole run.
set -uo pipefail
cd "$(dirname "$0")/.."

MOE_BIN=${MOE_BIN:-bin}
TEST_BIN=${MOE_TEST_BIN:-build/tests/moe-tests}
export MOE_BIN
jobs=${MOE_TEST_JOBS:-$(nproc)}

total_pass=0
total_fail=0
total_skip=0

log=$(mktemp)
"$TEST_BIN" -j "$jobs" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" | tail -n 1)
if [ -n "$line" ]; then
    total_pass=$((total_pass + $(echo "$line" | sed -E 's/^([0-9]+) passed.*/\1/')))
    total_fail=$((total_fail + $(echo "$line" | sed -E 's/^[0-9]+ passed, ([0-9]+) failed.*/\1/')))
    if echo "$line" | grep -q skipped; then
        total_skip=$((total_skip + $(echo "$line" | sed -E 's/.* ([0-9]+) skipped.*/\1/')))
    fi
elif [ "$rc" -ne 0 ]; then
    total_fail=$((total_fail + 1))
fi
rm -f "$log"

if [ -d tests/py ] && ls tests/py/test_*.py >/dev/null 2>&1 && [ $# -eq 0 ]; then
    venv=build/venv
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || /usr/bin/python3 -m venv "$venv"
    fi
    "$venv/bin/pip" install -q --disable-pip-version-check -r tests/py/requirements.txt
    log=$(mktemp)
    "$venv/bin/python" -m pytest -q tests/py 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    p=$(grep -oE '[0-9]+ passed' "$log" | tail -n 1 | grep -oE '[0-9]+' || true)
    f=$(grep -oE '[0-9]+ (failed|error)' "$log" | awk '{s+=$1} END {print s+0}')
    total_pass=$((total_pass + ${p:-0}))
    total_fail=$((total_fail + ${f:-0}))
    if [ "$rc" -ne 0 ] && [ "${f:-0}" -eq 0 ]; then total_fail=$((total_fail + 1)); fi
    rm -f "$log"
fi

echo
if [ "$total_skip" -gt 0 ]; then
    echo "$total_pass passed, $total_fail failed, $total_skip skipped"
else
    echo "$total_pass passed, $total_fail failed"
fi
[ "$total_fail" -eq 0 ]

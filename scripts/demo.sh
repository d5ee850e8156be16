#!/usr/bin/env bash
# The README's main job (`make demo`): start moed on the bundled model with a socket in a temp
# dir, wait until it is ready, ask one chat completion over the Unix socket, print the answer,
# stop the daemon (SIGTERM) and clean up.
#
#   MOE_BIN=bin scripts/demo.sh [PROMPT]
#   MOED_DEMO_MODEL=path.gguf overrides the model.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${MOE_BIN:-bin}
MODEL=${MOED_DEMO_MODEL:-tests/golden/models/tiny-qwen3moe-Q8_0.gguf}
PROMPT=${1:-In the beginning God}
MAX_TOKENS=${MOED_DEMO_TOKENS:-48}

for p in moed moed-worker moectl; do
    if [ ! -x "$BIN/$p" ]; then
        echo "demo: $BIN/$p is missing; run 'make' first" >&2
        exit 1
    fi
done
if [ ! -f "$MODEL" ]; then
    echo "demo: model $MODEL not found" >&2
    exit 1
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/moed-demo.XXXXXX")
sock="$dir/moed.sock"
log="$dir/moed.log"
pid=
cleanup() {
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -rf "$dir"
}
trap cleanup EXIT INT TERM

echo "== starting moed on $MODEL (socket $sock)"
"$BIN/moed" --model "$MODEL" --socket "$sock" --state-dir "$dir/state" \
    --devices cpu --workers 1 --worker-bin "$BIN/moed-worker" >"$log" 2>&1 &
pid=$!

# /health answers 200 once every worker is ready.
ready=0
for _ in $(seq 1 600); do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "demo: moed exited during startup:" >&2
        cat "$log" >&2
        exit 1
    fi
    code=$(curl -s -o /dev/null -w '%{http_code}' --unix-socket "$sock" http://moed/health 2>/dev/null || true)
    if [ "$code" = 200 ]; then ready=1; break; fi
    sleep 0.1
done
if [ "$ready" != 1 ]; then
    echo "demo: moed did not become ready in 60 s; its log:" >&2
    tail -n 30 "$log" >&2
    exit 1
fi
echo "== moed is ready"
"$BIN/moectl" --socket "$sock" status | head -n 3 || true

body=$(PROMPT="$PROMPT" MAX_TOKENS="$MAX_TOKENS" python3 -c '
import json, os
print(json.dumps({"messages": [{"role": "user", "content": os.environ["PROMPT"]}],
                  "max_tokens": int(os.environ["MAX_TOKENS"]), "temperature": 0}))')
echo "== POST /v1/chat/completions: $PROMPT"
resp=$(curl -s --unix-socket "$sock" -H 'Content-Type: application/json' -d "$body" \
    http://moed/v1/chat/completions)
answer=$(printf '%s' "$resp" | python3 -c '
import json, sys
r = json.load(sys.stdin)
if "error" in r:
    sys.exit("demo: moed answered an error: " + r["error"]["message"])
print(r["choices"][0]["message"]["content"])
u = r["usage"]
print("[%d prompt tokens, %d generated, finish: %s]" % (u["prompt_tokens"], u["completion_tokens"],
      r["choices"][0]["finish_reason"]))
')
echo "== answer:"
printf '%s\n' "$answer"

echo "== streaming the same with moectl generate:"
"$BIN/moectl" --socket "$sock" generate -n 24 --temp 0 "$PROMPT"

echo "== stopping moed (SIGTERM)"
kill -TERM "$pid"
wait "$pid" && rc=0 || rc=$?
pid=
if [ "$rc" != 0 ]; then
    echo "demo: moed exited with $rc" >&2
    tail -n 20 "$log" >&2
    exit 1
fi
echo "== done"

#!/usr/bin/env bash
# The README's main job (`make demo`): start moed on the bundled model with a socket in a temp
# dir, wait until it is ready, ask one chat completion over the Unix socket, print the answer,
# stop the daemon (SIGTERM) and clean up.
#
#   MOE_BIN=bin scripts/demo.sh [PROMPT]
#   MOED_DEMO_MODEL=path.gguf overrides the model; MOED_DEMO_DEVICES the devices (default auto:
#   the GPUs moed-worker --list-devices reports, else the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${MOE_BIN:-bin}
MODEL=${MOED_DEMO_MODEL:-models/kjv-demo-F16.gguf}
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

# http METHOD PATH [BODY]: one request over the Unix socket; prints the status line's code, then
# the body. python3 is enough (curl is installed too, for the README's examples).
http() {
    SOCK="$sock" python3 - "$@" <<'PY'
import os, socket, sys
method, path = sys.argv[1], sys.argv[2]
body = sys.argv[3].encode() if len(sys.argv) > 3 else b""
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["SOCK"])
s.sendall(f"{method} {path} HTTP/1.1\r\nHost: moed\r\nContent-Type: application/json\r\n"
          f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
head, _, rest = data.partition(b"\r\n\r\n")
print(head.split()[1].decode())
sys.stdout.write(rest.decode("utf-8", "replace"))
PY
}

echo "== starting moed on $MODEL (socket $sock)"
"$BIN/moed" --model "$MODEL" --socket "$sock" --state-dir "$dir/state" \
    --devices "${MOED_DEMO_DEVICES:-auto}" --workers 1 --worker-bin "$BIN/moed-worker" >"$log" 2>&1 &
pid=$!

# /health answers 200 once every worker is ready.
ready=0
for _ in $(seq 1 600); do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "demo: moed exited during startup:" >&2
        cat "$log" >&2
        exit 1
    fi
    code=$(http GET /health 2>/dev/null | head -n 1 || true)
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
grep -m1 "ready on" "$log" | sed 's/^.*worker/worker/' || true

# The bundled model is a small qwen3moe trained on the King James Bible (tools/train-demo): it
# continues text, it was never taught to chat, so the request is a plain completion.
body=$(PROMPT="$PROMPT" MAX_TOKENS="$MAX_TOKENS" python3 -c '
import json, os
print(json.dumps({"prompt": os.environ["PROMPT"], "max_tokens": int(os.environ["MAX_TOKENS"]),
                  "temperature": 0.7, "seed": 7, "repetition_penalty": 1.15}))')
echo "== POST /v1/completions: $PROMPT"
resp=$(http POST /v1/completions "$body" | tail -n +2)
answer=$(printf '%s' "$resp" | python3 -c '
import json, sys
r = json.load(sys.stdin)
if "error" in r:
    sys.exit("demo: moed answered an error: " + r["error"]["message"])
print(r["choices"][0]["text"])
u = r["usage"]
print("[%d prompt tokens, %d generated, finish: %s]" % (u["prompt_tokens"], u["completion_tokens"],
      r["choices"][0]["finish_reason"]))
')
echo "== answer:"
printf '%s%s\n' "$PROMPT" "$answer"

echo "== greedy, streamed by moectl generate:"
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

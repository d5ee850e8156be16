#!/usr/bin/env python3
"""Time to first token on turn N of a chat, with the worker's prefix reuse and without it.

    build/venv/bin/python bench/bench_prefix.py [--model M.gguf] [--turns 10] [--ctx 2048]
                                                 [--devices cpu] [--words 40]

Starts moed (one worker, one sequence slot) and holds a chat of --turns turns: each user message
is --words words of fixed text, each answer 32 greedy tokens, streamed; the time to the first
content chunk is the TTFT. Turn N's prompt then goes to a fresh daemon, where nothing is cached.
Prints both, with usage.prompt_tokens_details.cached_tokens of the cached turn.
"""
import argparse
import json
import pathlib
import signal
import subprocess
import tempfile
import time

try:  # openai >= 3 is built on httpx2 (same API)
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = ("and the lord spake unto moses saying speak unto the children of israel that they "
         "bring me an offering of every man that giveth it willingly with his heart").split()


def start(model, ctx, devices, tmp):
    sock = pathlib.Path(tmp) / "moed.sock"
    log = open(pathlib.Path(tmp) / "moed.log", "ab")
    p = subprocess.Popen([str(ROOT / "bin/moed"), "--model", str(model), "--socket", str(sock),
                          "--state-dir", str(pathlib.Path(tmp) / "state"), "--devices", devices,
                          "--workers", "1", "--parallel", "1", "--ctx", str(ctx)],
                         stdout=log, stderr=log)
    c = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://moed",
                     timeout=600)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if c.get("/health").status_code == 200:
                return p, c
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit("moed did not become ready")


def turn(c, messages):
    body = {"messages": messages, "max_tokens": 32, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.time()
    ttft, text, usage = None, [], None
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if ch.get("usage"):
                usage = ch["usage"]
            for choice in ch.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.time() - t0
                    text.append(piece)
    return ttft, "".join(text), usage


def stop(p):
    p.send_signal(signal.SIGTERM)
    p.wait(60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models/kjv-demo-F16.gguf"))
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--words", type=int, default=40)
    a = ap.parse_args()
    msgs = [{"role": "system", "content": "Answer in the words of the King James Bible."}]
    with tempfile.TemporaryDirectory(prefix="moed-bench-") as tmp:
        p, c = start(a.model, a.ctx, a.devices, tmp)
        try:
            for t in range(a.turns):
                words = [WORDS[(t * 7 + i) % len(WORDS)] for i in range(a.words)]
                msgs.append({"role": "user", "content": " ".join(words)})
                ttft, text, usage = turn(c, msgs)
                cached = (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens")
                print(f"turn {t + 1:2d}: prompt {usage['prompt_tokens']:5d} tokens, cached "
                      f"{cached:5d}, TTFT {1e3 * ttft:8.1f} ms", flush=True)
                if t + 1 < a.turns:
                    msgs.append({"role": "assistant", "content": text})
            last = (usage["prompt_tokens"], cached, ttft)
        finally:
            stop(p)
    with tempfile.TemporaryDirectory(prefix="moed-bench-") as tmp:
        p, c = start(a.model, a.ctx, a.devices, tmp)
        try:
            ttft0, _, usage0 = turn(c, msgs)
        finally:
            stop(p)
    print(f"\n| turn {a.turns} | prompt tokens | cached | TTFT ms |\n|---|---|---|---|")
    print(f"| with prefix reuse | {last[0]} | {last[1]} | {1e3 * last[2]:.1f} |")
    print(f"| fresh daemon | {usage0['prompt_tokens']} | "
          f"{usage0['prompt_tokens_details']['cached_tokens']} | {1e3 * ttft0:.1f} |")


if __name__ == "__main__":
    main()

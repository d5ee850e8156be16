#!/usr/bin/env python3
"""Several workers against one, through the daemon: aggregate decode throughput at several
numbers of concurrent sequences, the RAM the shared expert store takes (Pss), and each GPU
worker's expert hit rate.

    bench/bench_workers.py MODEL --devices 0 --devices 0,1 [--expert-residency 60%]
                           [--concurrency 1,16,64] [--gen 64] [--prompt-words 32]
                           [--parallel N] [--ctx N] [--bin DIR] [--arg=--flag=value]...
                           [--json FILE]

For each --devices list it starts `moed --devices LIST` (each worker with --parallel sequences,
default the largest concurrency, so that one worker can take them all), waits until every
worker is ready, sends a warm-up round, then for each concurrency C sends C streamed greedy
completions at once (distinct prompts of about --prompt-words words, `ignore_eos`, max_tokens
--gen) over the Unix socket and times them:

* aggregate decode tok/s: the sum over the C requests of (tokens - 1) / (last token - first
  token), what the sequences decode together once their prompts are in (a request whose text
  came in one read, on a model too small to time, is left out and the sum scaled to C);
* end to end tok/s: all completion tokens over the time from the first request sent to the
  last answer done;
* the scheduler's spread: how many of the C requests each worker took.

After the runs: the Rss and Pss of the store's memfd mappings (`/memfd:moe-store`) in the
daemon and in every worker (/proc/PID/smaps), their sums, and the store's size; the experts are
in RAM once when the Pss over all processes adds up to at most the store's size, whatever the
number of workers (private copies would add up to one store per process). Then each offloading
GPU worker's expert hits and misses (/admin/placement). The table goes to stdout (markdown),
everything to --json.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

WORDS = ("the of and to in that is was he for it with as his on be at by this had not are but "
         "from or have an they which one you were her all she there would their we him been has "
         "when who will more no if out so said what up its about into than them can only other "
         "new some could time these two may then do first any my now such like our over man me "
         "even most made after also did many before must through back years where much your way "
         "well down should because each just those people how too little state good very make "
         "world still own see men work long get here between both life being under never day "
         "same another know while last might us great old year off come since against go came "
         "right used take three").split()


def http(sock, method, path, body=None, timeout=600):
    """One request, Connection: close; returns (status, body text)."""
    data = json.dumps(body).encode() if body is not None else b""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(sock)
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: moed\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    out = b""
    while True:
        c = s.recv(65536)
        if not c:
            break
        out += c
    s.close()
    head, _, rest = out.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        rest = Dechunker().feed(rest)
    return int(head.split()[1]), rest.decode("utf-8", "replace")


class Dechunker:
    """Incremental HTTP chunked-transfer decoding: feed() the bytes after the headers as they
    come, get the payload bytes they complete."""

    def __init__(self):
        self.buf = b""
        self.left = 0  # payload bytes of the current chunk still to come
        self.done = False

    def feed(self, b):
        self.buf += b
        out = b""
        while not self.done:
            if self.left:
                take = self.buf[:self.left]
                out += take
                self.buf = self.buf[len(take):]
                self.left -= len(take)
                if self.left:
                    break
                self.buf = self.buf[2:] if len(self.buf) >= 2 else self.buf  # the chunk's CRLF
                continue
            line, sep, rest = self.buf.partition(b"\r\n")
            if not sep:
                break
            if not line:  # a CRLF that ended the last chunk, split from it
                self.buf = rest
                continue
            self.buf = rest
            self.left = int(line.split(b";")[0], 16)
            if self.left == 0:
                self.done = True
        return out


def stream_completion(sock, body, res):
    """A streamed completion; res gets the times of its first and last events that carry text,
    the completion tokens (usage) and the status."""
    data = json.dumps(body).encode()
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(900)
    s.connect(sock)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: moed\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    head = b""
    chunked = None
    dech = Dechunker()
    payload = b""
    first = last = None
    tokens = 0
    status = 0
    while True:
        c = s.recv(65536)
        if not c:
            break
        now = time.perf_counter()
        if chunked is None:
            head += c
            if b"\r\n\r\n" not in head:
                continue
            head, _, c = head.partition(b"\r\n\r\n")
            status = int(head.split()[1])
            chunked = b"chunked" in head.lower()
        payload += dech.feed(c) if chunked else c
        while b"\n\n" in payload:
            ev, _, payload = payload.partition(b"\n\n")
            for line in ev.split(b"\n"):
                if not line.startswith(b"data: {"):
                    continue
                j = json.loads(line[6:])
                if any(ch.get("text") for ch in j.get("choices", [])):
                    first = now if first is None else first
                    last = now
                if j.get("usage"):
                    tokens = j["usage"]["completion_tokens"]
    s.close()
    res["status"] = status
    if status != 200:
        res["error"] = (payload or head)[:500].decode("utf-8", "replace")
    res["tokens"], res["first"], res["last"] = tokens, first, last


def prompt(i, words):
    """A distinct prompt of about `words` words (request i)."""
    return " ".join(WORDS[(i * 7919 + k * 104729) % len(WORDS)] for k in range(words)) + f" {i}."


def store_smaps(pid):
    """(Rss, Pss) in KiB of the store's memfd mappings in process pid."""
    rss = pss = 0
    inside = False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    inside = "/memfd:moe-store" in line
                elif inside and line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif inside and line.startswith("Pss:"):
                    pss += int(line.split()[1])
    except OSError:
        return None
    return rss, pss


class Daemon:
    def __init__(self, a, devices, tmp):
        self.sock = os.path.join(tmp, "moed.sock")
        self.log = os.path.join(tmp, "moed.log")
        args = [os.path.join(a.bin, "moed"), "--model", a.model, "--socket", self.sock,
                "--state-dir", os.path.join(tmp, "state"), "--devices", devices,
                "--worker-bin", os.path.join(a.bin, "moed-worker"),
                "--parallel", str(a.parallel or max(a.concurrency))]
        if devices == "cpu":
            args += ["--workers", "1"]
        if a.ctx:
            args += ["--ctx", str(a.ctx)]
        if a.expert_residency:
            args += ["--expert-residency", a.expert_residency]
        args += a.arg
        self.logf = open(self.log, "w")
        self.proc = subprocess.Popen(args, stdout=self.logf, stderr=subprocess.STDOUT)
        deadline = time.time() + a.ready_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"moed --devices {devices} exited:\n" + open(self.log).read()[-3000:])
            try:
                st, body = http(self.sock, "GET", "/health", timeout=5)
                if st == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        sys.exit(f"moed --devices {devices} not ready in {a.ready_timeout} s:\n" +
                 open(self.log).read()[-3000:])

    def get(self, path):
        st, body = http(self.sock, "GET", path)
        if st != 200:
            raise RuntimeError(f"GET {path}: {st} {body[:300]}")
        return json.loads(body)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()


def run_round(d, a, n, base):
    reqs = [{"res": {}, "body": {"prompt": prompt(base + i, a.prompt_words), "max_tokens": a.gen,
                                 "temperature": 0, "ignore_eos": True, "stream": True,
                                 "stream_options": {"include_usage": True}}}
            for i in range(n)]
    before = {w["index"]: w["tokens_generated"] for w in d.get("/admin/status")["workers"]}
    t0 = time.perf_counter()
    th = [threading.Thread(target=stream_completion, args=(d.sock, r["body"], r["res"]))
          for r in reqs]
    for t in th:
        t.start()
    for t in th:
        t.join()
    t1 = time.perf_counter()
    res = [r["res"] for r in reqs]
    bad = [r for r in res if r.get("status") != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} of {n} requests failed: {bad[0].get('error', bad[0])}")
    tokens = sum(r["tokens"] for r in res)
    # A request whose text all came in one read (a tiny model) has no decode time to measure.
    timed = [r for r in res if r["tokens"] > 1 and r["first"] is not None and r["last"] > r["first"]]
    decode = sum((r["tokens"] - 1) / (r["last"] - r["first"]) for r in timed) * n / len(timed) \
        if timed else None
    after = {w["index"]: w["tokens_generated"] for w in d.get("/admin/status")["workers"]}
    spread = [after[i] - before.get(i, 0) for i in sorted(after)]
    return {"concurrency": n, "tokens": tokens, "seconds": t1 - t0,
            "end_to_end_tok_s": tokens / (t1 - t0), "decode_tok_s": decode, "timed": len(timed),
            "tokens_per_worker": spread}


def fmt(x, spec=".1f", unit=""):
    return "-" if x is None else format(x, spec) + unit


def measure(a, devices):
    out = {"devices": devices, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        d = Daemon(a, devices, tmp)
        try:
            st = d.get("/admin/status")
            out["workers"] = [{"index": w["index"], "device": w["device"], "pid": w["pid"]}
                              for w in st["workers"]]
            out["store_bytes"] = st["store"]["bytes"]
            out["expert_bytes"] = st["store"]["expert_bytes"]
            # Warm-up: every batch size's graphs and caches, outside the timing.
            run_round(d, a, max(a.concurrency), 1 << 20)
            for i, n in enumerate(a.concurrency):
                r = run_round(d, a, n, 1000 * (i + 1))
                out["rounds"].append(r)
                print(f"  {devices}: {n} sequences: decode {fmt(r['decode_tok_s'])} tok/s, end to "
                      f"end {r['end_to_end_tok_s']:.1f}, tokens per worker {r['tokens_per_worker']}",
                      file=sys.stderr)
            procs = [("moed", d.proc.pid)] + [(f"worker {w['index']} ({w['device']})", w["pid"])
                                               for w in d.get("/admin/status")["workers"]]
            mem = []
            for name, pid in procs:
                sm = store_smaps(pid)
                if sm:
                    mem.append({"process": name, "pid": pid, "rss_kib": sm[0], "pss_kib": sm[1]})
            out["store_memory"] = mem
            out["store_pss_kib"] = sum(m["pss_kib"] for m in mem)
            out["store_rss_max_kib"] = max((m["rss_kib"] for m in mem), default=0)
            pl = d.get("/admin/placement")
            out["hit_rates"] = []
            for w in pl.get("workers", []):
                h, m = w.get("expert_hits") or 0, w.get("expert_misses") or 0
                out["hit_rates"].append({"worker": w["worker"], "device": w["device"],
                                         "offload": w.get("offload", False), "hits": h,
                                         "misses": m, "hit_rate": h / (h + m) if h + m else None})
        finally:
            d.stop()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--devices", action="append", required=True,
                   help="a --devices list for moed (repeat: each is measured; the first is the base)")
    p.add_argument("--expert-residency")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--parallel", type=int, default=0)
    p.add_argument("--ctx", type=int, default=0)
    p.add_argument("--bin", default=os.environ.get("MOE_BIN", "bin"))
    p.add_argument("--arg", action="append", default=[],
                   help="one more moed argument (--arg=--vram-budget=20G)")
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--json")
    a = p.parse_args()
    a.concurrency = [int(x) for x in a.concurrency.split(",")]
    if a.gen < 2 or min(a.concurrency) < 1:
        sys.exit("--gen must be at least 2 and every concurrency at least 1")
    results = [measure(a, dv) for dv in a.devices]
    base = {r["concurrency"]: r for r in results[0]["rounds"]}
    print("| devices | sequences | decode tok/s | vs " + results[0]["devices"] +
          " | end to end tok/s | tokens per worker |")
    print("|---|---|---|---|---|---|")
    for res in results:
        for r in res["rounds"]:
            b = base.get(r["concurrency"])
            ratio = r["decode_tok_s"] / b["decode_tok_s"] \
                if b and b["decode_tok_s"] and r["decode_tok_s"] else None
            r["vs_base"] = ratio
            print(f"| {res['devices']} | {r['concurrency']} | {fmt(r['decode_tok_s'])} | "
                  f"{fmt(ratio, '.2f', 'x')} | {r['end_to_end_tok_s']:.1f} | "
                  f"{' / '.join(str(x) for x in r['tokens_per_worker'])} |")
    print()
    print("| devices | store MiB | Pss of the store, all processes, MiB | largest Rss MiB | "
          "per process Pss MiB | expert hit rate per GPU worker |")
    print("|---|---|---|---|---|---|")
    for res in results:
        per = ", ".join(f"{m['process']} {m['pss_kib'] / 1024:.0f}" for m in res["store_memory"])
        hr = ", ".join(f"worker {h['worker']} {100 * h['hit_rate']:.1f}%"
                       for h in res["hit_rates"] if h["offload"] and h["hit_rate"] is not None)
        print(f"| {res['devices']} | {res['store_bytes'] / 2**20:.0f} | "
              f"{res['store_pss_kib'] / 1024:.0f} | {res['store_rss_max_kib'] / 1024:.0f} | "
              f"{per} | {hr or '-'} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The daemon path of expert offload on a GPU machine, end to end: moed with one CUDA worker
fully resident, then the same requests with --expert-residency (the worker registers the shared
store with CUDA and reads misses from it); greedy answers must be equal. With --profile-interval 1
the daemon saves the routing profile and pushes a placement to the worker while it serves, which
re-pins its hot experts live; the answers must stay equal after that. Prints what /metrics and
`moectl placement` report. Last, one daemon with a CPU worker and a GPU worker (--devices cpu,0)
serves concurrent clients; every answer must be the CPU-only or the GPU-only daemon's answer to
that prompt (the two backends agree to rounding, so they may part at a near tie).

    tools/device/offload-daemon.py BIN MODEL [RESIDENCY]
"""
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from bench_workers import http  # noqa: E402  (one request over the daemon's Unix socket)

BIN, MODEL = sys.argv[1], sys.argv[2]
RES = sys.argv[3] if len(sys.argv) > 3 else "40%"
PROMPTS = ["In the beginning God", "And the LORD said unto Moses", "Blessed are the",
           "The LORD is my shepherd", "And it came to pass", "For God so loved"]


def start(d, extra, devices=None):
    sock = os.path.join(d, "moed.sock")
    log = open(os.path.join(d, "moed.log"), "w")
    p = subprocess.Popen([f"{BIN}/moed", "--model", MODEL, "--socket", sock, "--state-dir",
                          os.path.join(d, "state"), "--devices", devices or os.environ.get("DEVICES", "0"),
                          "--worker-bin", f"{BIN}/moed-worker", "--profile-interval", "1"] + extra,
                         stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        if p.poll() is not None:
            sys.exit("moed exited:\n" + open(log.name).read())
        try:
            if http(sock, "GET", "/health")[0] == 200:
                return p, sock, log.name
        except OSError:
            pass
        time.sleep(0.1)
    sys.exit("moed not ready in 60 s:\n" + open(log.name).read()[-3000:])


def answers(sock, n=48):
    out = []
    for pr in PROMPTS:
        code, body = http(sock, "POST", "/v1/completions",
                          {"prompt": pr, "max_tokens": n, "temperature": 0})
        if code != 200:
            sys.exit(f"HTTP {code}: {body}")
        out.append(json.loads(body)["choices"][0]["text"])
    return out


def stop(p):
    p.terminate()
    p.wait(30)


fails = 0
with tempfile.TemporaryDirectory() as d:
    p, sock, log = start(d, [])
    ref = answers(sock)
    stop(p)
with tempfile.TemporaryDirectory() as d:
    p, sock, log = start(d, ["--expert-residency", RES])
    got = answers(sock)
    print("residency %s, cold start: %d of %d answers equal the resident run"
          % (RES, sum(a == b for a, b in zip(got, ref)), len(ref)))
    fails += got != ref
    # More traffic, then time for profile saves and the placement push.
    for _ in range(3):
        answers(sock, 24)
    time.sleep(4)
    got = answers(sock)
    print("after live re-pinning: %d of %d answers equal" % (sum(a == b for a, b in zip(got, ref)),
                                                             len(ref)))
    fails += got != ref
    code, metrics = http(sock, "GET", "/metrics")
    for line in metrics.splitlines():
        if line.startswith("moed_worker_expert") and "layer=" not in line:
            print("  " + line)
    r = subprocess.run([f"{BIN}/moectl", "--socket", sock, "placement"], capture_output=True,
                       text=True)
    print("moectl placement (exit %d):\n%s%s" % (r.returncode, r.stdout[-2500:], r.stderr[-500:]))
    stop(p)
    for line in open(log):
        if "ready on" in line or "placement" in line.lower() or "re-pin" in line:
            print("  log: " + line.rstrip()[:300])
with tempfile.TemporaryDirectory() as d:
    p, sock, log = start(d, [], "cpu")
    ref_cpu = answers(sock)
    stop(p)
print("cpu-only and gpu-only daemons: %d of %d answers equal" % (
    sum(a == b for a, b in zip(ref_cpu, ref)), len(ref)))
with tempfile.TemporaryDirectory() as d:
    p, sock, log = start(d, ["--parallel", "2"], "cpu,0")
    import concurrent.futures as cf
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(4 * len(PROMPTS))]

    def one(pr):
        code, body = http(sock, "POST", "/v1/completions",
                          {"prompt": pr, "max_tokens": 48, "temperature": 0})
        return code, json.loads(body)["choices"][0]["text"] if code == 200 else body

    with cf.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(one, jobs))
    bad = 0
    for pr, (code, text) in zip(jobs, got):
        i = PROMPTS.index(pr)
        if code != 200 or text not in (ref[i], ref_cpu[i]):
            bad += 1
            print("  mixed: %r -> %s %r" % (pr, code, text[:80]))
    code, status = http(sock, "GET", "/admin/status")
    ws = json.loads(status).get("workers", [])
    desc = ", ".join("%s %s (%s tokens)" % (w.get("device"), w.get("state"),
                                            w.get("tokens_generated")) for w in ws)
    print("cpu,0 daemon (workers: %s): %d concurrent requests, %d answers not from either "
          "backend" % (desc, len(jobs), bad))
    fails += bad > 0 or sorted(w.get("device") for w in ws) != ["cpu", "cuda:0"] or \
        any(w.get("state") != "ready" or not w.get("tokens_generated") for w in ws)
    stop(p)
print("offload-daemon: %s" % ("ok" if not fails else "FAILED"))
sys.exit(1 if fails else 0)

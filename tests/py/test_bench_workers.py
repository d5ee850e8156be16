"""bench/bench_workers.py (several workers against one, through the daemon) on the golden tiny
model with CPU workers: every round's tokens are counted and spread over the workers, and the
shared expert store is in RAM once whatever the number of workers (the Pss of its mappings over
all processes adds up to one copy)."""
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(os.environ.get("MOE_BIN", ROOT / "bin"))
if not BIN.is_absolute():
    BIN = ROOT / BIN
MODEL = ROOT / "tests/golden/models/tiny-qwen3moe-Q8_0.gguf"


def test_bench_workers_counts_tokens_and_the_store_once(tmp_path):
    out = tmp_path / "bench.json"
    gen, conc = 6, [1, 4]
    p = subprocess.run([sys.executable, str(ROOT / "bench/bench_workers.py"), str(MODEL),
                        "--devices", "cpu", "--devices", "cpu,cpu", "--devices", "cpu,cpu,cpu",
                        "--concurrency", ",".join(map(str, conc)), "--gen", str(gen),
                        "--prompt-words", "12", "--bin", str(BIN), "--ready-timeout", "60",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| cpu,cpu | 4 |" in p.stdout
    res = json.loads(out.read_text())
    assert [r["devices"] for r in res] == ["cpu", "cpu,cpu", "cpu,cpu,cpu"]
    pss = []
    for n_workers, r in enumerate(res, start=1):
        assert len(r["workers"]) == n_workers
        assert [x["concurrency"] for x in r["rounds"]] == conc
        for rd in r["rounds"]:
            # ignore_eos: every request runs to max_tokens
            assert rd["tokens"] == rd["concurrency"] * gen
            assert sum(rd["tokens_per_worker"]) == rd["tokens"]
            assert len(rd["tokens_per_worker"]) == n_workers
            assert rd["end_to_end_tok_s"] > 0
        # 4 sequences over several workers: the scheduler spreads them (most free slots first)
        assert all(t > 0 for t in r["rounds"][1]["tokens_per_worker"])
        mem = r["store_memory"]
        assert len(mem) == 1 + n_workers  # the daemon and each worker map the store
        assert all(m["rss_kib"] > 0 for m in mem)
        rss = max(m["rss_kib"] for m in mem)
        assert rss * 1024 <= r["store_bytes"]
        # One copy: the proportional shares add up to what one process maps, not to one per
        # process (private copies would give (1 + n_workers) times that).
        assert r["store_pss_kib"] <= rss * 1.05 + 64, mem
        pss.append(r["store_pss_kib"])
    assert max(pss) <= min(pss) * 1.1 + 64, pss

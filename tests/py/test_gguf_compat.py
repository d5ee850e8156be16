"""Files written by `moectl mkmodel` are standard GGUF: the official `gguf` package reads them the
same way our reader does, their blocks dequantize to the intended values, and a float64 forward
pass over them stays finite with skewed routing.

Runs on the tiny preset only (a few seconds). Needs MOE_BIN (tests/run.sh sets it)."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("MOE_BIN", ROOT / "bin"))
if not BIN.is_absolute():
    BIN = ROOT / BIN
MOECTL = BIN / "moectl"
VOCAB = ROOT / "tests/golden/tokenizer/qwen3-vocab.gguf"
GOLDEN = ROOT / "tests/golden/models"
QUANTS = {"f16": "F16", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
BIAS_CHANNEL = 4.0  # MK_BIAS_CHANNEL_VALUE in cli/mkmodel.h


def mkmodel(out, *args):
    subprocess.run([str(MOECTL), "mkmodel", "--quiet", "--preset", "tiny", "--vocab", str(VOCAB),
                    *args, "-o", str(out)], check=True, cwd=ROOT)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mkmodel")
    return {q: mkmodel(d / f"tiny-{q}.gguf", "--quant", q, "--seed", "3") for q in QUANTS}


def field_value(f):
    """A GGUFReader field as a Python value (scalars, strings, arrays)."""
    t = f.types
    if t[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if t[0] == gguf.GGUFValueType.ARRAY:
        if t[1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    return f.parts[f.data[0]].tolist()[0]


def kvs(reader):
    return {k: field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def inspect_json(path):
    out = subprocess.run([str(MOECTL), "--json", "inspect", str(path)], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout
    return json.loads(out)


@pytest.mark.parametrize("quant", list(QUANTS))
def test_gguf_package_reads_what_our_reader_reads(models, quant):
    r = gguf.GGUFReader(models[quant])
    kv = kvs(r)
    ours = inspect_json(models[quant])
    hp = ours["hparams"]
    assert ours["gguf_version"] == 3 == field_value(r.fields["GGUF.version"])
    assert ours["architecture"] == kv["general.architecture"] == "qwen3moe"
    assert ours["name"] == kv["general.name"]
    assert ours["n_tensors"] == len(r.tensors) == 3 + 12 * 3
    a = "qwen3moe."
    assert hp["n_layer"] == kv[a + "block_count"] == 3
    assert hp["n_embd"] == kv[a + "embedding_length"] == 256
    assert hp["n_head"] == kv[a + "attention.head_count"] == 4
    assert hp["n_head_kv"] == kv[a + "attention.head_count_kv"] == 2
    assert hp["head_dim"] == kv[a + "attention.key_length"] == 64
    assert hp["n_expert"] == kv[a + "expert_count"] == 16
    assert hp["n_expert_used"] == kv[a + "expert_used_count"] == 4
    assert hp["expert_ff"] == kv[a + "expert_feed_forward_length"] == 128
    assert hp["n_ctx_train"] == kv[a + "context_length"]
    assert hp["n_vocab"] == len(kv["tokenizer.ggml.tokens"]) == 4160
    assert hp["rms_eps"] == pytest.approx(kv[a + "attention.layer_norm_rms_epsilon"])
    assert hp["rope_base"] == pytest.approx(kv[a + "rope.freq_base"])
    assert kv["general.alignment"] == 32
    assert kv["general.file_type"] == {"f16": 1, "q8_0": 7, "q4_k_m": 15}[quant]
    assert kv["moed.synthetic.seed"] == 3

    # Tensor counts and bytes by type agree with our reader's.
    by_type = {}
    for t in r.tensors:
        e = by_type.setdefault(t.tensor_type.name.lower(), [0, 0])
        e[0] += 1
        e[1] += int(t.n_bytes)
    theirs = {k: v for k, v in by_type.items()}
    mine = {k.lower(): [v["count"], v["bytes"]] for k, v in ours["tensor_types"].items()}
    assert theirs == mine
    # Expert types per layer agree.
    for l, layer in enumerate(ours["layers"]):
        for part in ("gate", "up", "down"):
            t = next(t for t in r.tensors if t.name == f"blk.{l}.ffn_{part}_exps.weight")
            assert t.tensor_type.name.lower() == layer[part].lower()

    # Every tensor's name, shape and type are those of the golden file llama.cpp made.
    g = gguf.GGUFReader(GOLDEN / f"tiny-qwen3moe-{QUANTS[quant]}.gguf")
    gt = {t.name: (t.shape.tolist(), t.tensor_type) for t in g.tensors}
    assert {t.name: (t.shape.tolist(), t.tensor_type) for t in r.tensors} == gt
    # Offsets are aligned and the data of each tensor fits before the next.
    offs = sorted((int(t.data_offset), int(t.n_bytes)) for t in r.tensors)
    for (o, n), (o2, _) in zip(offs, offs[1:]):
        assert o % 32 == 0 and o + n <= o2


def test_vocabulary_keys_equal_golden(models):
    ours = kvs(gguf.GGUFReader(models["q8_0"]))
    gold = kvs(gguf.GGUFReader(GOLDEN / "tiny-qwen3moe-F16.gguf"))
    for k, v in gold.items():
        if k.startswith("tokenizer."):
            assert ours[k] == v, k


def dequant(t):
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)


@pytest.mark.parametrize("quant,name,gtype", [
    ("q8_0", "blk.1.ffn_up_exps.weight", "Q8_0"),
    ("q8_0", "token_embd.weight", "Q8_0"),
    ("q4_k_m", "blk.0.ffn_gate_exps.weight", "Q4_K"),
    ("q4_k_m", "token_embd.weight", "Q4_K"),
    ("q4_k_m", "output.weight", "Q6_K"),
    ("q4_k_m", "blk.0.ffn_down_exps.weight", "Q5_0"),
    ("q4_k_m", "blk.2.ffn_down_exps.weight", "Q8_0"),
])
def test_blocks_dequantize_to_intended_values(models, quant, name, gtype):
    r = gguf.GGUFReader(models[quant])
    t = next(t for t in r.tensors if t.name == name)
    assert t.tensor_type.name == gtype
    y = dequant(t)
    assert np.isfinite(y).all()
    n_embd, n_layer = 256, 3
    s_out = min(0.5, 1 / np.sqrt(2 * n_layer))
    if name == "token_embd.weight":
        assert np.abs(y[:, 0] - BIAS_CHANNEL).max() < 0.05
        body, want = y[:, 1:], 1.0
    elif name == "output.weight":
        body, want = y, 3 / np.sqrt(n_embd)
    elif "ffn_down" in name:
        assert (y[:, 0, :] == 0).all()  # output channel 0 of every expert is never written
        body, want = y[:, 1:, :], s_out / np.sqrt(128)
    else:
        body, want = y, 1 / np.sqrt(n_embd)
    assert abs(body.mean()) < 0.05 * want
    assert body.std() == pytest.approx(want, rel=0.04)
    # Block scales vary like real ones: per-row deviations spread, but not wildly.
    rows = body.reshape(-1, body.shape[-1]).std(axis=1)
    assert 0.6 < rows.min() / want and rows.max() / want < 1.5


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def forward(path, toks):
    """float64 qwen3moe forward over the dequantized weights (docs: FORMATS.md)."""
    r = gguf.GGUFReader(path)
    kv = kvs(r)
    T = {t.name: dequant(t) for t in r.tensors}
    a = "qwen3moe."
    L, H, Hk = kv[a + "block_count"], kv[a + "attention.head_count"], kv[a + "attention.head_count_kv"]
    hd, eps = kv[a + "attention.key_length"], kv[a + "attention.layer_norm_rms_epsilon"]
    ne, k, base = kv[a + "expert_count"], kv[a + "expert_used_count"], kv[a + "rope.freq_base"]
    n = len(toks)
    h = T["token_embd.weight"][toks]
    ang = np.arange(n)[:, None] * base ** (-np.arange(hd // 2) * 2 / hd)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

    counts, h_rms = [], []
    for l in range(L):
        p = f"blk.{l}."
        x = rms(h, T[p + "attn_norm.weight"], eps)
        q = rope(rms((x @ T[p + "attn_q.weight"].T).reshape(n, H, hd), T[p + "attn_q_norm.weight"], eps))
        kk = rope(rms((x @ T[p + "attn_k.weight"].T).reshape(n, Hk, hd), T[p + "attn_k_norm.weight"], eps))
        v = (x @ T[p + "attn_v.weight"].T).reshape(n, Hk, hd)
        o = np.zeros((n, H, hd))
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for hh in range(H):
            s = q[:, hh] @ kk[:, hh // (H // Hk)].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, hh // (H // Hk)]
        h = h + o.reshape(n, H * hd) @ T[p + "attn_output.weight"].T
        x = rms(h, T[p + "ffn_norm.weight"], eps)
        lg = x @ T[p + "ffn_gate_inp.weight"].T
        pr = np.exp(lg - lg.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        top = np.argsort(-pr, -1)[:, :k]
        G, U, D = T[p + "ffn_gate_exps.weight"], T[p + "ffn_up_exps.weight"], T[p + "ffn_down_exps.weight"]
        out = np.zeros_like(h)
        for t in range(n):
            w = pr[t, top[t]] / pr[t, top[t]].sum()
            for e, we in zip(top[t], w):
                g, u = G[e] @ x[t], U[e] @ x[t]
                out[t] += we * (D[e] @ (g / (1 + np.exp(-g)) * u))
        h = h + out
        counts.append(np.bincount(top.ravel(), minlength=ne))
        h_rms.append(np.sqrt((h * h).mean()))
    logits = rms(h, T["output_norm.weight"], eps) @ T["output.weight"].T
    return logits, h_rms, counts


@pytest.mark.parametrize("quant", ["f16", "q4_k_m"])
def test_forward_is_finite_and_routing_skewed(models, quant):
    toks = np.random.default_rng(0).integers(0, 4096, 96)
    logits, h_rms, counts = forward(models[quant], toks)
    assert np.isfinite(logits).all()
    assert 1.0 < logits.std() < 6.0, logits.std()  # sensible magnitude
    assert all(0.7 < v < 2.0 for v in h_rms), h_rms  # activations stay O(1) through the layers
    for c in counts:
        c = np.sort(c)[::-1]
        assert c[:4].sum() / c.sum() > 0.55, c  # most used quarter takes well over half


def test_router_skew_zero_is_not_skewed(tmp_path):
    path = mkmodel(tmp_path / "flat.gguf", "--quant", "f16", "--router-skew", "0")
    r = gguf.GGUFReader(path)
    for l in range(3):
        w = next(t for t in r.tensors if t.name == f"blk.{l}.ffn_gate_inp.weight")
        assert (np.asarray(w.data)[:, 0] == 0).all()

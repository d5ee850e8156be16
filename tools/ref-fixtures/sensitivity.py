#!/usr/bin/env python3
"""How far typical specialisation bugs land from the committed references.

For each fixture in tests/fixtures/hf, runs transformers' Qwen3MoeForCausalLM on the stored
weights with one deliberate mistake at a time (the kind an engine tuned to the golden model
could make) and prints the relative L2 distance of its logits from the stored reference, next to
the threshold the C test applies. A mistake far above the threshold is one the test catches.
Output is a Markdown table (docs/parity.md quotes it).

    /tmp/tvenv/bin/python tools/ref-fixtures/sensitivity.py [--fixtures tests/fixtures/hf]
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as qm  # noqa: E402


def norm_style_rope(q, k, cos, sin, unsqueeze_dim=1):
    """RoPE on adjacent pairs (2i, 2i+1), llama's NORM style, instead of NEOX's (i, i+d/2)."""
    half = cos.shape[-1] // 2
    c = torch.repeat_interleave(cos[..., :half], 2, dim=-1).unsqueeze(unsqueeze_dim)
    s = torch.repeat_interleave(sin[..., :half], 2, dim=-1).unsqueeze(unsqueeze_dim)

    def rot(x):
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return q * c + rot(q) * s, k * c + rot(k) * s


def tiled_repeat_kv(x, n_rep):
    """Query head h reads KV head h % n_kv instead of h / (n_head / n_kv)."""
    return x if n_rep == 1 else x.repeat(1, n_rep, 1, 1)


def windowed_eager(window):
    base = qm.eager_attention_forward

    def fn(module, q, k, v, mask, scaling, **kw):
        n = q.shape[-2]
        i = torch.arange(n)
        far = (i[:, None] - i[None, :]) >= window
        extra = torch.zeros(n, n, dtype=q.dtype).masked_fill(far, float("-inf"))
        mask = extra if mask is None else mask + extra
        return base(module, q, k, v, mask, scaling, **kw)
    return fn


# Each mutation: (label, applies(fx), prepare(model, fx) -> undo callable).
def set_attr_all(model, cls, attr, value):
    mods = [m for m in model.modules() if isinstance(m, cls)]
    old = [getattr(m, attr) for m in mods]
    for m in mods:
        setattr(m, attr, value(m) if callable(value) else value)
    return lambda: [setattr(m, attr, o) for m, o in zip(mods, old)]


def patch_module(name, value):
    old = getattr(qm, name)
    setattr(qm, name, value)
    return lambda: setattr(qm, name, old)


def qk_norm_ones(model, fx):
    saved = []
    for layer in model.model.layers:
        for n in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            saved.append((n, n.weight.detach().clone()))
            with torch.no_grad():
                n.weight.fill_(1.0)

    def undo():
        with torch.no_grad():
            for n, w in saved:
                n.weight.copy_(w)
    return undo


def rope_base(value):
    def prep(model, fx):
        rp = model.config.rope_parameters
        old = rp["rope_theta"]
        rp["rope_theta"] = value
        return lambda: rp.__setitem__("rope_theta", old)
    return prep


MUTATIONS = [
    ("RoPE on adjacent pairs (NORM) instead of NEOX", lambda fx: True,
     lambda m, fx: patch_module("apply_rotary_pos_emb", norm_style_rope)),
    ("rope base 1e6 hard-coded", lambda fx: fx["rope_base"] != 1e6, rope_base(1e6)),
    ("rope base 1e4 hard-coded", lambda fx: fx["rope_base"] != 1e4, rope_base(1e4)),
    ("top-k weights not renormalised", lambda fx: True,
     lambda m, fx: set_attr_all(m, qm.Qwen3MoeTopKRouter, "norm_topk_prob", False)),
    ("top-k fixed at 4 (the golden model's)", lambda fx: fx["n_expert_used"] != 4,
     lambda m, fx: set_attr_all(m, qm.Qwen3MoeTopKRouter, "top_k", min(4, fx["n_expert"]))),
    ("top-k one less than the file says", lambda fx: fx["n_expert_used"] > 1,
     lambda m, fx: set_attr_all(m, qm.Qwen3MoeTopKRouter, "top_k", fx["n_expert_used"] - 1)),
    ("GQA: query head h reads KV head h % n_kv", lambda fx: fx["n_head"] != fx["n_head_kv"],
     lambda m, fx: patch_module("repeat_kv", tiled_repeat_kv)),
    ("q/k norm weights ignored", lambda fx: True, qk_norm_ones),
    ("rms eps 1e-6 hard-coded", lambda fx: fx["rms_eps"] != 1e-6,
     lambda m, fx: set_attr_all(m, qm.Qwen3MoeRMSNorm, "variance_epsilon", 1e-6)),
    ("attention limited to the last 512 positions", lambda fx: fx["n_prompt"] > 512,
     lambda m, fx: patch_module("eager_attention_forward", windowed_eager(512))),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="tests/fixtures/hf")
    ap.add_argument("--only", help="just this fixture")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    names = sorted(f[:-5] for f in os.listdir(a.fixtures) if f.endswith(".json"))
    names = [n for n in names if not a.only or n == a.only]
    print("| fixture | mistake | rel-L2 | threshold | top-1 |")
    print("|---|---|---|---|---|")
    for name in names:
        meta = json.load(open(os.path.join(a.fixtures, name + ".json")))
        fx = meta["fixture"]
        thr = 3e-2 if meta["quantized"] else 2e-3
        ref = np.fromfile(os.path.join(a.fixtures, meta["logits"]), dtype="<f4")
        ref = ref.reshape(len(meta["positions"]), meta["n_vocab"]).astype(np.float64)
        stored, _ = mf.read_gguf(os.path.join(a.fixtures, meta["gguf"]))
        with mf.Float64Patches():
            model = mf.load_hf(fx, stored, "eager")
            base, _ = mf.forward(model, meta["prompt_tokens"])
            rows = [("none (transformers as is, eager attention)", base)]
            for label, applies, prep in MUTATIONS:
                if not applies(fx):
                    continue
                undo = prep(model, fx)
                try:
                    out, _ = mf.forward(model, meta["prompt_tokens"])
                finally:
                    undo()
                rows.append((label, out))
        for label, out in rows:
            sel = out[meta["positions"]]
            top1 = float(np.mean(np.argmax(sel, -1) == np.argmax(ref, -1)))
            print("| %s | %s | %.2e | %.0e | %.0f%% |" % (name, label, mf.rel_l2(sel, ref), thr,
                                                         100 * top1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

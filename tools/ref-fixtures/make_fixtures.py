#!/usr/bin/env python3
"""Parity fixtures from Hugging Face transformers' own Qwen3-MoE implementation.

For each fixture below this script
  1. draws random weights (fixed seed) for a small qwen3moe model of an unusual shape;
  2. writes them as a standard qwen3moe GGUF with gguf's GGUFWriter (F16 or F32), or writes an
     F32 GGUF and turns it into the committed file with `moectl quantize` (quantized fixtures);
  3. reads the committed GGUF back, dequantizes every tensor exactly as stored
     (gguf.quants.dequantize), and loads those values into transformers' Qwen3MoeForCausalLM;
  4. runs transformers' forward in float64 on the prompt and stores the logits of the chosen
     positions as little-endian float32, plus a JSON describing the fixture.

The C test tests/test_parity_hf.c compares moed's engine against these files. See README.md in
this folder for how to run it and docs/parity.md for what the fixtures cover.
"""
import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

import gguf
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType
from gguf.quants import dequantize

import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

# Each fixture catches a way of specialising to the golden model's shape (head_dim 64 =
# n_embd/n_head, 16 experts top-4, prompts < 200 tokens, F16/Q8_0/Q4_K_M files).
FIXTURES = [
    {
        # head_dim 128 with n_head*head_dim (512) != n_embd (128); 32 experts, top-8; GQA 2;
        # an 832-token prompt; F16 weights; untied output head.
        "name": "hd128-e32-long",
        "seed": 101,
        "n_layer": 2, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "head_dim": 128,
        "n_expert": 32, "n_expert_used": 8, "expert_ff": 16, "n_vocab": 512,
        "rope_base": 1e6, "rms_eps": 1e-6, "tied": False,
        "storage": "f16", "n_prompt": 832, "position_stride": 4,
    },
    {
        # Only Q5_K and Q6_K blocks (moectl quantize q5_k_m of an F32 file); every row 256
        # wide; GQA ratio 4 with head_dim 32; tied head (token_embd stored as Q6_K).
        "name": "q5k-q6k-gqa4",
        "seed": 202,
        "n_layer": 2, "n_embd": 256, "n_head": 8, "n_head_kv": 2, "head_dim": 32,
        "n_expert": 4, "n_expert_used": 2, "expert_ff": 256, "n_vocab": 512,
        "rope_base": 1e6, "rms_eps": 1e-6, "tied": True,
        "storage": "q5_k_m", "n_prompt": 160, "position_stride": 1,
    },
    {
        # No GQA (n_head_kv = n_head), rope base 10000, eps 1e-5, odd sizes that are not
        # multiples of any SIMD width (n_embd 72, head_dim 24, expert_ff 40), 6 experts top-3,
        # 3 layers, F32 weights, tied head. Embeddings as small as real models' (std 0.01), so
        # that the first RMSNorm's eps matters and a hard-coded eps shows.
        "name": "nogqa-odd-f32",
        "seed": 303,
        "n_layer": 3, "n_embd": 72, "n_head": 3, "n_head_kv": 3, "head_dim": 24,
        "n_expert": 6, "n_expert_used": 3, "expert_ff": 40, "n_vocab": 512,
        "rope_base": 1e4, "rms_eps": 1e-5, "tied": True, "embd_std": 0.01,
        "storage": "f32", "n_prompt": 96, "position_stride": 1,
    },
]


# Smallest accepted gap between the k-th and (k+1)-th router logit (see router_margin).
MIN_ROUTER_MARGIN = 1e-4
MAX_ATTEMPTS = 40

# ---- weights ------------------------------------------------------------------------------------

def make_weights(fx):
    """Random weights in GGUF numpy order (reversed ggml ne), float64.

    Scales keep activations O(1) through every layer and give logits of a few units; norm
    weights are random (not 1) so that a forward pass that skips a norm weight is caught;
    q/k norm weights are larger so that attention is not uniform."""
    rng = np.random.default_rng(fx["seed"])
    E, H, Hkv, hd = fx["n_embd"], fx["n_head"], fx["n_head_kv"], fx["head_dim"]
    X, F, V = fx["n_expert"], fx["expert_ff"], fx["n_vocab"]
    n = lambda shape, std: rng.standard_normal(shape) * std
    w = {}
    if fx["tied"]:
        w["token_embd.weight"] = n((V, E), fx.get("embd_std", 3.0 / math.sqrt(E)))
    else:
        w["token_embd.weight"] = n((V, E), 1.0)
        w["output.weight"] = n((V, E), 3.0 / math.sqrt(E))
    w["output_norm.weight"] = 1.0 + n((E,), 0.1)
    res = min(0.5, 1.0 / math.sqrt(2 * fx["n_layer"]))
    for l in range(fx["n_layer"]):
        p = "blk.%d." % l
        w[p + "attn_norm.weight"] = 1.0 + n((E,), 0.1)
        w[p + "attn_q.weight"] = n((H * hd, E), 1.0 / math.sqrt(E))
        w[p + "attn_k.weight"] = n((Hkv * hd, E), 1.0 / math.sqrt(E))
        w[p + "attn_v.weight"] = n((Hkv * hd, E), 1.0 / math.sqrt(E))
        w[p + "attn_output.weight"] = n((E, H * hd), res / math.sqrt(H * hd))
        w[p + "attn_q_norm.weight"] = 1.5 + n((hd,), 0.3)
        w[p + "attn_k_norm.weight"] = 1.5 + n((hd,), 0.3)
        w[p + "ffn_norm.weight"] = 1.0 + n((E,), 0.1)
        w[p + "ffn_gate_inp.weight"] = n((X, E), 2.0 / math.sqrt(E))
        w[p + "ffn_gate_exps.weight"] = n((X, F, E), 1.0 / math.sqrt(E))
        w[p + "ffn_up_exps.weight"] = n((X, F, E), 1.0 / math.sqrt(E))
        w[p + "ffn_down_exps.weight"] = n((X, E, F), 2.0 * res / math.sqrt(F))
    return w


def make_prompt(fx, attempt):
    """Random token ids; attempt > 0 draws another prompt for the same weights."""
    rng = np.random.default_rng([fx["seed"], attempt])
    return rng.integers(0, fx["n_vocab"], size=fx["n_prompt"]).tolist()


def write_gguf(path, fx, weights, storage):
    """Standard qwen3moe GGUF: F32 norms and router; matrices as `storage` (f16 or f32)."""
    wr = GGUFWriter(path, arch="qwen3moe")
    wr.add_name("moed-hf-fixture-" + fx["name"])
    wr.add_context_length(4096)
    wr.add_embedding_length(fx["n_embd"])
    wr.add_block_count(fx["n_layer"])
    wr.add_feed_forward_length(4 * fx["n_embd"])
    wr.add_head_count(fx["n_head"])
    wr.add_head_count_kv(fx["n_head_kv"])
    wr.add_key_length(fx["head_dim"])
    wr.add_value_length(fx["head_dim"])
    wr.add_rope_freq_base(fx["rope_base"])
    wr.add_layer_norm_rms_eps(fx["rms_eps"])
    wr.add_expert_count(fx["n_expert"])
    wr.add_expert_used_count(fx["n_expert_used"])
    wr.add_expert_feed_forward_length(fx["expert_ff"])
    wr.add_file_type(1 if storage == "f16" else 0)
    for name, a in weights.items():
        keep_f32 = a.ndim == 1 or "ffn_gate_inp" in name
        dt = np.float16 if storage == "f16" and not keep_f32 else np.float32
        wr.add_tensor(name, np.ascontiguousarray(a.astype(dt)))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def read_gguf(path):
    """Every tensor of a GGUF, dequantized exactly as stored, as float64 in numpy order."""
    r = GGUFReader(path)
    out, types = {}, {}
    for t in r.tensors:
        a = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        out[t.name] = a.reshape(shape)
        types[t.name] = t.tensor_type.name
    return out, types


# ---- transformers model -------------------------------------------------------------------------

def hf_config(fx):
    return Qwen3MoeConfig(
        vocab_size=fx["n_vocab"], hidden_size=fx["n_embd"], intermediate_size=4 * fx["n_embd"],
        num_hidden_layers=fx["n_layer"], num_attention_heads=fx["n_head"],
        num_key_value_heads=fx["n_head_kv"], head_dim=fx["head_dim"], hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=fx["rms_eps"],
        tie_word_embeddings=fx["tied"],
        rope_parameters={"rope_type": "default", "rope_theta": fx["rope_base"]},
        attention_bias=False, decoder_sparse_step=1, moe_intermediate_size=fx["expert_ff"],
        num_experts_per_tok=fx["n_expert_used"], num_experts=fx["n_expert"],
        norm_topk_prob=True, mlp_only_layers=[])


def load_hf(fx, w, attn):
    """transformers' Qwen3MoeForCausalLM holding the GGUF's weights (HF <- GGUF names)."""
    cfg = hf_config(fx)
    cfg._attn_implementation = attn
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float64).eval()
    T = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    sd = {"model.embed_tokens.weight": T(w["token_embd.weight"]),
          "model.norm.weight": T(w["output_norm.weight"])}
    if not fx["tied"]:
        sd["lm_head.weight"] = T(w["output.weight"])
    F = fx["expert_ff"]
    for l in range(fx["n_layer"]):
        p, q = "blk.%d." % l, "model.layers.%d." % l
        sd[q + "input_layernorm.weight"] = T(w[p + "attn_norm.weight"])
        sd[q + "self_attn.q_proj.weight"] = T(w[p + "attn_q.weight"])
        sd[q + "self_attn.k_proj.weight"] = T(w[p + "attn_k.weight"])
        sd[q + "self_attn.v_proj.weight"] = T(w[p + "attn_v.weight"])
        sd[q + "self_attn.o_proj.weight"] = T(w[p + "attn_output.weight"])
        sd[q + "self_attn.q_norm.weight"] = T(w[p + "attn_q_norm.weight"])
        sd[q + "self_attn.k_norm.weight"] = T(w[p + "attn_k_norm.weight"])
        sd[q + "post_attention_layernorm.weight"] = T(w[p + "ffn_norm.weight"])
        sd[q + "mlp.gate.weight"] = T(w[p + "ffn_gate_inp.weight"])
        # transformers packs gate and up as one [n_expert, 2*ff, n_embd] tensor, gate first.
        gu = np.concatenate([w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"]], axis=1)
        assert gu.shape[1] == 2 * F
        sd[q + "mlp.experts.gate_up_proj"] = T(gu)
        sd[q + "mlp.experts.down_proj"] = T(w[p + "ffn_down_exps.weight"])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed_missing = {"lm_head.weight"} if fx["tied"] else set()
    assert set(missing) <= allowed_missing and not unexpected, (missing, unexpected)
    if fx["tied"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


class Float64Patches:
    """transformers computes a few steps in float32 even in a float64 model (RMSNorm upcasts to
    float32, the router softmax and the RoPE angles are float32, eager attention's softmax is
    float32). Inside this context those steps run in the model's dtype with the same formulas,
    so the reference is float64 end to end. The unpatched model is run too and its distance
    recorded, to show the patches change nothing but rounding."""

    def __enter__(self):
        self.saved = (qm.Qwen3MoeRMSNorm.forward, qm.Qwen3MoeTopKRouter.forward,
                      qm.Qwen3MoeRotaryEmbedding.forward)

        def rms_forward(self, x):
            var = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

        def router_forward(self, x):
            x = x.reshape(-1, self.hidden_dim)
            logits = torch.nn.functional.linear(x, self.weight)
            probs = torch.softmax(logits, dim=-1)
            top_v, top_i = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                top_v = top_v / top_v.sum(dim=-1, keepdim=True)
            return logits, top_v, top_i

        def rope_forward(self, x, position_ids):
            cfg = self.config
            dim = cfg.head_dim
            base = cfg.rope_parameters["rope_theta"]
            inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            freqs = position_ids[..., None].to(torch.float64) * inv
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        qm.Qwen3MoeRMSNorm.forward = rms_forward
        qm.Qwen3MoeTopKRouter.forward = router_forward
        qm.Qwen3MoeRotaryEmbedding.forward = rope_forward
        return self

    def __exit__(self, *exc):
        (qm.Qwen3MoeRMSNorm.forward, qm.Qwen3MoeTopKRouter.forward,
         qm.Qwen3MoeRotaryEmbedding.forward) = self.saved
        return False


def forward(model, prompt):
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_router_logits=True)
    return out.logits[0].numpy(), [r.numpy() for r in out.router_logits]


def router_margin(router_logits, k):
    """Smallest gap between the k-th and (k+1)-th router logit over all tokens and layers: how
    far the reference is from a routing tie that float32 rounding could flip."""
    m = math.inf
    for r in router_logits:
        s = np.sort(r, axis=-1)[:, ::-1]
        if s.shape[1] > k:
            m = min(m, float(np.min(s[:, k - 1] - s[:, k])))
    return m


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


# ---- main ---------------------------------------------------------------------------------------

def build(fx, outdir, moectl, tmp):
    name = fx["name"]
    weights = make_weights(fx)
    gguf_path = os.path.join(outdir, name + ".gguf")
    if fx["storage"] in ("f16", "f32"):
        write_gguf(gguf_path, fx, weights, fx["storage"])
    else:
        src = os.path.join(tmp, name + ".f32.gguf")
        write_gguf(src, fx, weights, "f32")
        subprocess.run([moectl, "quantize", "--threads", "1", src, gguf_path, fx["storage"]],
                       check=True)
    stored, types = read_gguf(gguf_path)
    if fx["storage"] == "q5_k_m":
        bad = {n: t for n, t in types.items() if t not in ("Q5_K", "Q6_K", "F32")}
        assert not bad, "not a Q5_K/Q6_K-only file: %s" % bad
        assert any(t == "Q6_K" for t in types.values()) and any(t == "Q5_K" for t in types.values())

    # A routing decision this close to a tie could go either way in a float32 engine; draw
    # another prompt rather than ship a fixture that tests rounding luck.
    with Float64Patches():
        model = load_hf(fx, stored, "sdpa")
        for attempt in range(MAX_ATTEMPTS):
            prompt = make_prompt(fx, attempt)
            logits, routers = forward(model, prompt)
            margin = router_margin(routers, fx["n_expert_used"])
            if margin > MIN_ROUTER_MARGIN:
                break
            print("%s: prompt %d has router margin %.2e, drawing another" % (name, attempt, margin))
        else:
            raise SystemExit("%s: no prompt with router margin > %g in %d attempts" %
                             (name, MIN_ROUTER_MARGIN, MAX_ATTEMPTS))
    stock = load_hf(fx, stored, "eager")
    stock_logits, _ = forward(stock, prompt)

    n = len(prompt)
    stride = fx["position_stride"]
    # Every stride-th position, and always the last eight (where attention spans the most).
    positions = sorted(set(range(0, n, stride)) | set(range(max(0, n - 8), n)))
    sel = logits[positions]
    srt = np.sort(sel, axis=-1)
    top_gap = float(np.min(srt[:, -1] - srt[:, -2]))
    logits_path = os.path.join(outdir, name + ".logits.f32")
    sel.astype("<f4").tofile(logits_path)

    counts = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    meta = {
        "name": name,
        "gguf": name + ".gguf",
        "gguf_sha256": sha256(gguf_path),
        "logits": name + ".logits.f32",
        "logits_layout": "little-endian float32 [len(positions)][n_vocab]",
        "n_vocab": fx["n_vocab"],
        "n_prompt": n,
        "prompt_attempt": attempt,
        "prompt_tokens": [int(t) for t in prompt],
        "positions": positions,
        "quantized": fx["storage"] not in ("f16", "f32"),
        "storage": fx["storage"],
        "tensor_types": counts,
        "fixture": fx,
        "hf_config": json.loads(hf_config(fx).to_json_string()),
        "checks": {
            "min_router_margin": margin,
            "min_top1_top2_gap": top_gap,
            "stock_transformers_rel_l2": rel_l2(stock_logits[positions], sel),
        },
        "made_with": {
            "transformers": transformers.__version__, "torch": torch.__version__,
            "gguf": getattr(gguf, "__version__", "?"), "numpy": np.__version__,
        },
    }
    with open(os.path.join(outdir, name + ".json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print("%-16s %-7s n_prompt %4d stored %4d  router margin %.2e  top1 gap %.2e  "
          "stock-vs-f64 %.1e  %s" % (name, fx["storage"], n, len(positions), margin, top_gap,
                                     meta["checks"]["stock_transformers_rel_l2"], counts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures/hf", help="output folder")
    ap.add_argument("--moectl", default="bin/moectl", help="moectl binary (for quantize)")
    ap.add_argument("--only", help="build just this fixture")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        for fx in FIXTURES:
            if not a.only or a.only == fx["name"]:
                build(fx, a.out, a.moectl, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Checks a qwen3moe Q4_K_M / Q5_K_M file's per-tensor block types against llama-quantize's rule
(llama_tensor_get_type_impl in llama.cpp's src/llama-quant.cpp, as read for docs/ggml-check.md):

* 1-D tensors and ffn_gate_inp stay F32 (not quantized);
* output.weight: Q6_K;
* attn_v and ffn_down(_exps) of layer i: Q6_K when use_more_bits(i, n_layer), else the base type;
* everything else (token_embd included): the base type (Q4_K or Q5_K);
* rows that the chosen K-quant cannot hold fall back: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0.
The n_expert == 8 (Mixtral) and 70B special cases do not apply to qwen3moe.

    mix_rule.py FILE.gguf q4_k_m|q5_k_m     prints mismatches and a summary; exit 1 on mismatch
Reads only the header, so it works on --no-data (sparse) files."""
import os
import struct
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mutants import parse  # noqa: E402

NAMES = {0: "f32", 1: "f16", 6: "q5_0", 7: "q5_1", 8: "q8_0", 12: "q4_K", 13: "q5_K", 14: "q6_K"}
FALLBACK = {12: 6, 13: 7, 14: 8}


def use_more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def main():
    path, mix = sys.argv[1], sys.argv[2]
    base = {"q4_k_m": 12, "q5_k_m": 13}[mix]
    with open(path, "rb") as f:
        data = f.read(256 << 20)  # the header of a 235B layout is ~8 MiB
    kvs, tensors = parse(data)
    (n_layer,) = struct.unpack_from("<I", data, kvs["qwen3moe.block_count"][2])
    bad, counts = 0, {}
    for name, (_, type_off, ne) in tensors.items():
        (t,) = struct.unpack_from("<i", data, type_off)
        counts[NAMES.get(t, str(t))] = counts.get(NAMES.get(t, str(t)), 0) + 1
        n_dims, ne0 = len(ne), ne[0]
        if n_dims == 1 or "ffn_gate_inp" in name:
            want = 0
        elif name == "output.weight":
            want = 14
        elif name.startswith("blk.") and ("attn_v." in name or "ffn_down" in name) and \
                use_more_bits(int(name.split(".")[1]), n_layer):
            want = 14
        else:
            want = base
        if ne0 % 256 and want in FALLBACK:
            want = FALLBACK[want]
        if t != want:
            bad += 1
            print("mismatch: %s is %s, llama-quantize %s gives %s" %
                  (name, NAMES.get(t, t), mix, NAMES.get(want, want)))
    summary = ", ".join("%d %s" % (v, k) for k, v in sorted(counts.items()))
    print("%s  %s: %d tensors (%s), %d differ from llama-quantize's %s rule" %
          ("PASS" if bad == 0 else "FAIL", path, len(tensors), summary, bad, mix))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

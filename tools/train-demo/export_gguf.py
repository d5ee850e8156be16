#!/usr/bin/env python3
"""Writes the trained demo model (weights.npz from train.py) as GGUF, F16 and Q8_0.

    python3 export_gguf.py --run RUNDIR --vocab tests/golden/models/tiny-qwen3moe-F16.gguf \
        --out models/kjv-demo

The tokenizer keys (the first 4096 Qwen3 BPE tokens, their merges, the 26 added tokens, the
chat template) are copied from --vocab, the vocabulary the corpus was tokenized with. F16 files
keep norms and the router in F32 (as llama.cpp writes them); Q8_0 files likewise.
"""
import argparse
import json
from pathlib import Path

import gguf
import numpy as np

ARCH = "qwen3moe"


def copy_tokenizer(reader, w):
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        t = field.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(name, val, t, sub_type=sub)
        elif t == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(field.parts[field.data[0]]).decode("utf-8"), t)
        else:
            w.add_key_value(name, field.parts[field.data[0]].tolist()[0], t)


def write(path, weights, cfg, reader, qtype, name):
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if qtype == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_block_count(cfg["n_layer"])
    w.add_context_length(cfg["n_ctx"])
    w.add_embedding_length(cfg["n_embd"])
    w.add_feed_forward_length(cfg["expert_ff"] * cfg["n_expert_used"])
    w.add_head_count(cfg["n_head"])
    w.add_head_count_kv(cfg["n_head_kv"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_eps"])
    w.add_rope_freq_base(cfg["rope_base"])
    w.add_expert_count(cfg["n_expert"])
    w.add_expert_used_count(cfg["n_expert_used"])
    w.add_expert_feed_forward_length(cfg["expert_ff"])
    copy_tokenizer(reader, w)
    for tname in sorted(weights, key=order):
        a = np.ascontiguousarray(weights[tname].astype(np.float32))
        if a.ndim == 1 or tname.endswith("ffn_gate_inp.weight"):
            w.add_tensor(tname, a)
        elif qtype == "f16":
            w.add_tensor(tname, a.astype(np.float16))
        else:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(tname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def order(name):
    # token_embd, then layers in order, then output_norm (as llama.cpp's converters do).
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="train.py output folder")
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--out", required=True, help="output path prefix")
    ap.add_argument("--name", default="moed-kjv-demo")
    a = ap.parse_args()
    run = Path(a.run)
    cfg = json.loads((run / "config.json").read_text())
    weights = dict(np.load(run / "weights.npz"))
    reader = gguf.GGUFReader(a.vocab)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if n_vocab != cfg["n_vocab"]:
        raise SystemExit(f"vocabulary has {n_vocab} tokens, model {cfg['n_vocab']}")
    for q in ("f16", "q8_0"):
        path = Path(f"{a.out}-{q.upper()}.gguf")
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path, weights, cfg, reader, q, a.name)
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Trains the demo qwen3moe model on the KJV token stream (tokenized by `moectl tokenize`).

    python3 train.py --data DIR --out OUT [--steps N] [--seed S]

DIR holds train.ids, heldout.ids and passage.ids (space-separated token ids, as moectl prints
them). OUT receives: weights.npz (float32, GGUF tensor names), config.json, log.txt, eval.json
(held-out perplexity of the F16-rounded model), passage.logits.f32 (reference logits for the
parity test), trace-calib.u8 / trace-heldout.u8 (routing traces [token][layer][k]).
"""
import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from model import Config, Qwen3MoE


def load_ids(path):
    return np.array(Path(path).read_text().split(), dtype=np.int64)


def windows(ids, n_ctx):
    for s in range(0, len(ids) - 1, n_ctx):
        w = ids[s:s + n_ctx]
        if len(w) >= 2:
            yield w


@torch.no_grad()
def evaluate(model, ids, n_ctx, dev, trace=None):
    """Mean NLL over non-overlapping n_ctx windows; position t predicts token t+1."""
    nll, n = 0.0, 0
    for w in windows(ids, n_ctx):
        x = torch.tensor(w, device=dev)[None]
        logits, _ = model(x, trace)
        lp = torch.log_softmax(logits[0, :-1].double(), -1)
        nll -= lp.gather(1, x[0, 1:, None]).sum().item()
        n += len(w) - 1
    return nll / n, n


def export_weights(model, c):
    t = {"token_embd.weight": model.tok, "output_norm.weight": model.out_norm}
    for i, L in enumerate(model.layers):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": L.attn_norm, p + "attn_q.weight": L.wq,
                  p + "attn_k.weight": L.wk, p + "attn_v.weight": L.wv,
                  p + "attn_output.weight": L.wo, p + "attn_q_norm.weight": L.q_norm,
                  p + "attn_k_norm.weight": L.k_norm, p + "ffn_norm.weight": L.ffn_norm,
                  p + "ffn_gate_inp.weight": L.router, p + "ffn_gate_exps.weight": L.gate,
                  p + "ffn_up_exps.weight": L.up, p + "ffn_down_exps.weight": L.down})
    return {k: v.detach().float().cpu().numpy() for k, v in t.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--aux", type=float, default=0.01, help="load-balancing loss weight")
    ap.add_argument("--seed", type=int, default=20261129)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(a.data)
    train_ids, held_ids, passage = (load_ids(data / f) for f in ("train.ids", "heldout.ids", "passage.ids"))

    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    c = Config()
    model = Qwen3MoE(c).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), fused=dev == "cuda")
    warm = 100

    def lr_at(s):
        if s < warm:
            return a.lr * (s + 1) / warm
        q = (s - warm) / max(1, a.steps - warm)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * q)))

    tr = torch.tensor(train_ids, device=dev)
    rng = torch.Generator(device=dev).manual_seed(a.seed)
    log = open(out / "log.txt", "w")
    t0 = time.time()
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        starts = torch.randint(0, len(tr) - a.seq - 1, (a.batch,), device=dev, generator=rng)
        idx = starts[:, None] + torch.arange(a.seq + 1, device=dev)[None]
        batch = tr[idx]
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            logits, aux = model(batch[:, :-1])
            ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, c.n_vocab),
                                                   batch[:, 1:].reshape(-1))
            loss = ce + a.aux * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == a.steps - 1:
            msg = f"step {step} ce {ce.item():.4f} aux {aux.item():.4f} lr {lr_at(step):.2e} {time.time() - t0:.1f}s"
            if step % 500 == 0 or step == a.steps - 1:
                # A quick look at held-out loss (first 8 windows, bf16) to watch for overfitting.
                model.eval()
                with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                    hn, _ = evaluate(model, held_ids[: 8 * c.n_ctx], c.n_ctx, dev)
                model.train()
                msg += f" heldout-ce {hn:.4f}"
            print(msg, flush=True)
            log.write(msg + "\n")
    train_s = time.time() - t0

    # Evaluate exactly what the F16 GGUF holds, in float32 without TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model.round_to_stored()
    model.eval()
    trace_h, trace_c = [], []
    nll_h, n_h = evaluate(model, held_ids, c.n_ctx, dev, trace_h)
    calib = train_ids[: 16 * c.n_ctx]
    nll_c, n_c = evaluate(model, calib, c.n_ctx, dev, trace_c)

    def pack(tr):
        # per window: n_layer tensors [T, k] -> [T, n_layer, k]
        rows = []
        for w in range(0, len(tr), c.n_layer):
            rows.append(torch.stack(tr[w:w + c.n_layer], 1))
        return torch.cat(rows).to(torch.uint8).cpu().numpy()

    pack(trace_h).tofile(out / "trace-heldout.u8")
    pack(trace_c).tofile(out / "trace-calib.u8")
    with torch.no_grad():
        logits, _ = model(torch.tensor(passage, device=dev)[None])
    logits[0].float().cpu().numpy().astype("<f4").tofile(out / "passage.logits.f32")
    np.savez(out / "weights.npz", **export_weights(model, c))
    ev = {"heldout_tokens": n_h, "heldout_nll": nll_h, "heldout_ppl": math.exp(nll_h),
          "calib_tokens": n_c, "calib_ppl": math.exp(nll_c), "train_seconds": train_s,
          "steps": a.steps, "batch": a.batch, "seq": a.seq, "lr": a.lr, "aux": a.aux,
          "seed": a.seed, "torch": torch.__version__,
          "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
          "n_params": sum(p.numel() for p in model.parameters())}
    (out / "config.json").write_text(json.dumps(c.to_dict(), indent=1))
    (out / "eval.json").write_text(json.dumps(ev, indent=1))
    print(json.dumps(ev, indent=1))


if __name__ == "__main__":
    main()

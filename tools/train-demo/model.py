"""qwen3moe in PyTorch, written from moed's docs/formats.md math so that its logits and moed's
agree: RMSNorm, per-head q/k RMSNorm, NEOX RoPE, causal GQA, softmax router -> top-k ->
renormalised weights, SwiGLU experts, output tied to the token embedding.

Tensor shapes follow GGUF's ggml order reversed (torch row-major), so export is a plain copy:
torch (out, in) == ggml {in, out}; experts (n_expert, ff, n_embd) == ggml {n_embd, ff, n_expert}.
"""
import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    n_vocab: int = 4160
    n_layer: int = 4
    n_embd: int = 192
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64        # n_head * head_dim != n_embd on purpose
    n_expert: int = 32
    n_expert_used: int = 4
    expert_ff: int = 32
    rope_base: float = 1e6
    rms_eps: float = 1e-6
    n_ctx: int = 512

    def to_dict(self):
        return asdict(self)


def rmsnorm(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_neox(x, pos, base):
    """x: [B, H, T, hd]; rotates pairs (i, i + hd/2) by pos * base^(-2i/hd)."""
    hd = x.shape[-1]
    half = hd // 2
    inv = base ** (-torch.arange(0, half, device=x.device, dtype=torch.float64) * 2.0 / hd)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]          # [T, half]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Layer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        E, H, Hk, hd = c.n_embd, c.n_head, c.n_head_kv, c.head_dim
        self.attn_norm = nn.Parameter(torch.ones(E))
        self.wq = nn.Parameter(torch.randn(H * hd, E) / math.sqrt(E))
        self.wk = nn.Parameter(torch.randn(Hk * hd, E) / math.sqrt(E))
        self.wv = nn.Parameter(torch.randn(Hk * hd, E) / math.sqrt(E))
        self.wo = nn.Parameter(torch.randn(E, H * hd) / math.sqrt(H * hd) / math.sqrt(2 * c.n_layer))
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.ffn_norm = nn.Parameter(torch.ones(E))
        self.router = nn.Parameter(torch.randn(c.n_expert, E) * 0.02)
        self.gate = nn.Parameter(torch.randn(c.n_expert, c.expert_ff, E) / math.sqrt(E))
        self.up = nn.Parameter(torch.randn(c.n_expert, c.expert_ff, E) / math.sqrt(E))
        self.down = nn.Parameter(torch.randn(c.n_expert, E, c.expert_ff) / math.sqrt(c.expert_ff) / math.sqrt(2 * c.n_layer))

    def forward(self, h, pos, trace=None):
        c = self.c
        B, T, E = h.shape
        x = rmsnorm(h, self.attn_norm, c.rms_eps)
        q = (x @ self.wq.t()).view(B, T, c.n_head, c.head_dim)
        k = (x @ self.wk.t()).view(B, T, c.n_head_kv, c.head_dim)
        v = (x @ self.wv.t()).view(B, T, c.n_head_kv, c.head_dim)
        q = rmsnorm(q, self.q_norm, c.rms_eps).transpose(1, 2)
        k = rmsnorm(k, self.k_norm, c.rms_eps).transpose(1, 2)
        v = v.transpose(1, 2)
        q, k = rope_neox(q, pos, c.rope_base), rope_neox(k, pos, c.rope_base)
        rep = c.n_head // c.n_head_kv   # q head h reads kv head h // rep
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(c.head_dim))
        h = h + a.transpose(1, 2).reshape(B, T, -1) @ self.wo.t()

        x = rmsnorm(h, self.ffn_norm, c.rms_eps).reshape(B * T, E)
        logits = x.float() @ self.router.float().t()
        p = logits.softmax(-1)
        topv, topi = p.topk(c.n_expert_used, dim=-1)
        w = (topv / topv.sum(-1, keepdim=True)).to(x.dtype)
        if trace is not None:
            trace.append(topi.detach())
        out = torch.zeros_like(x)
        for e in range(c.n_expert):
            rows, slot = (topi == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = x[rows]
            ye = (F.silu(xe @ self.gate[e].t()) * (xe @ self.up[e].t())) @ self.down[e].t()
            out.index_add_(0, rows, ye * w[rows, slot, None])
        h = h + out.view(B, T, E)
        # Switch-style load balancing: n_expert * sum_i f_i * P_i (1.0 when perfectly balanced).
        f = torch.zeros(c.n_expert, device=x.device).index_add_(
            0, topi.reshape(-1), torch.ones(topi.numel(), device=x.device)) / topi.numel()
        aux = c.n_expert * (f * p.mean(0)).sum()
        return h, aux


class Qwen3MoE(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.tok = nn.Parameter(torch.randn(c.n_vocab, c.n_embd) * 0.02)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layer))
        self.out_norm = nn.Parameter(torch.ones(c.n_embd))

    def forward(self, ids, trace=None):
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        h = self.tok[ids]
        aux = 0.0
        for layer in self.layers:
            h, a = layer(h, pos, trace)
            aux = aux + a
        h = rmsnorm(h, self.out_norm, self.c.rms_eps)
        return h @ self.tok.t(), aux / self.c.n_layer

    def round_to_stored(self):
        """Rounds the weights that GGUF stores as F16 to F16 (norms and router stay F32), so that
        this model computes what the exported F16 file holds."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2 and not name.endswith("router"):
                    p.copy_(p.half().float())

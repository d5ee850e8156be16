/* The contract between the model loop (worker/qwen3moe.c) and a compute backend (worker/cpu/,
 * worker/cuda/). Private to the worker: the engine (worker/engine.h) is the public face.
 *
 * A backend owns the weights as it needs them (the CPU reads the mapping in place, CUDA uploads
 * to VRAM), the KV cache, the activation buffers of one step, the routing state and the routing
 * counters. The model loop drives it with coarse ops between begin() and end():
 *
 *     begin(step)                    inputs of this step: tokens, positions, sequences, RoPE
 *     embed(H)                       H[t] = token_embd[token[t]]
 *     for each layer l:
 *       rmsnorm(l, ATTN_NORM, H, X)
 *       matmul(l, {Q→Q, K→K, V→V}, X)
 *       qk_rope_kv(l)                per-head norm of Q and K, RoPE, K and V into the cache
 *       attention(l)                 ATT = softmax(Q·Kᵀ/√d)·V over the token's own positions
 *       matmul(l, {O→H}, ATT, +=)    the output projection added into the residual
 *       rmsnorm(l, FFN_NORM, H, X)
 *       matmul(l, {ROUTER→RL}, X)
 *       route(l)                     softmax, top-k, renormalise, group, count
 *       experts(l)                   H += Σ_j w_j · down_j(silu(gate_j·X) ⊙ up_j·X)
 *     (or, instead of the loop, layers() when the backend fuses this step's layers)
 *     head()                         logits of the selected rows: output(out_norm(H[row])),
 *                                    then, when the step samples, each row's next token drawn
 *                                    by its sequence's sampler (sampler())
 *     end(out, tokens)               the step has run; logits or sampled tokens copied out
 *     (or, for a sampling step, submit() now and collect(tokens) later: decode ahead)
 *
 * No op takes a host-side, data-dependent argument: tokens, positions, sequences and the rows
 * that want logits are inputs of begin(), copied into the backend's own buffers; everything an op
 * needs beyond its layer, weight and buffer ids it reads from there. So the sequence of ops of
 * one step shape (n tokens, n_out logit rows) is always the same and a backend may record it
 * once and replay it (CUDA graphs). Sizes are static per step shape: n, n_out.
 *
 * Arithmetic rules every backend keeps: activations, the KV cache (unless the backend stores it
 * in f16 on request) and accumulations are float; the expert combine is done per token in the
 * token's top-k order (j = 0..k-1) whatever the grouping, which is what makes results
 * independent of where an expert lives and of which other tokens share the step. */
#ifndef MOE_BACKEND_H
#define MOE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store/model.h"
#include "worker/sampler.h"

struct moe_offload_stats;
struct moe_expert_src;
struct moe_offload_layer;

/* Dimensions and options a backend is built for (filled by worker/engine.c). */
struct moe_dims {
    int64_t E, H, Hkv, hd, hdv;        /* n_embd, heads, kv heads, head dims (k, v) */
    int64_t qdim, kdim, vdim, odim;    /* H·hd, Hkv·hd, Hkv·hdv, H·hdv */
    int64_t nexp, kuse, ff, V, L;      /* experts, experts per token, expert ff, vocab, layers */
    float eps;                         /* RMSNorm epsilon */
    bool norm_topk;                    /* renormalise the top-k weights */
    uint32_t n_ctx, n_seq, n_batch;    /* positions per sequence, sequences, tokens per step */
    int n_threads;                     /* CPU: 0 = all cores */
    int device;                        /* CUDA: device index */
    bool kv_f32;                       /* CUDA: keep the KV cache in f32 (default f16) */
    uint64_t vram_budget;              /* CUDA offload: see struct moe_engine_opts */
    double expert_residency;
    int32_t cache_slots;
    const uint64_t *expert_counts;
    bool host_register;
    bool no_prefetch;
    const struct moe_expert_src *expert_src; /* CPU: experts found per layer (engine.h) */
    bool record_routes;                /* steps may ask for their chosen experts (route_record) */
};

/* Activation buffers, each with room for n_batch rows. */
enum moe_buf {
    MOE_BUF_H,       /* [n][E] residual stream */
    MOE_BUF_X,       /* [n][E] normed input of a block */
    MOE_BUF_Q,       /* [n][qdim] */
    MOE_BUF_K,       /* [n][kdim] */
    MOE_BUF_V,       /* [n][vdim] */
    MOE_BUF_ATT,     /* [n][odim] attention output */
    MOE_BUF_RL,      /* [n][nexp] router logits */
    MOE_BUF_SEL_W,   /* [n][kuse] routing weights of the chosen experts (after route) */
    MOE_BUF_SEL_E,   /* [n][kuse] chosen experts as int32 (after route) */
    MOE_BUF_COUNT
};

/* Weights: per layer (l >= 0) or of the whole model (l = -1). */
enum moe_wid {
    MOE_W_ATTN_NORM,
    MOE_W_Q,
    MOE_W_K,
    MOE_W_V,
    MOE_W_Q_NORM,
    MOE_W_K_NORM,
    MOE_W_O,
    MOE_W_FFN_NORM,
    MOE_W_ROUTER,
    MOE_W_EMBD,       /* l = -1 */
    MOE_W_OUT_NORM,   /* l = -1 */
    MOE_W_OUTPUT,     /* l = -1 */
};

/* One product of a matmul op: dst (+)= W · src for every token of the step. */
struct moe_mm {
    enum moe_wid w;
    enum moe_buf dst;
};

/* Inputs of one step (host memory, read during begin() only). */
struct moe_step {
    int64_t n;                 /* tokens, 1..n_batch */
    const int32_t *token;      /* [n] */
    const int32_t *pos;        /* [n] */
    const int32_t *seq;        /* [n] */
    const float *rope;         /* [n][hd/2][2] cos, sin of pos·θ_i (computed by the engine) */
    int64_t n_out;             /* rows that want logits, 0..n */
    const int32_t *out_row;    /* [n_out] token indices, increasing */
    bool sample;               /* sample the n_out rows (at most one per sequence) */
    bool record;               /* keep every layer's chosen experts for route_record (only with
                                * d->record_routes; the engine sets it for steps holding prompt
                                * tokens whose routing signature is wanted) */
    /* [n] or NULL (only for a backend with submit(), only while the step before this one is
     * submitted and not yet collected, and that step sampled): prev[t] >= 0 makes token t the
     * token that step drew for its sampled row prev[t] (token[t] is then ignored; a row that
     * drew nothing, -1, gives token 0: the caller drops what follows from it); -1: token[t]. */
    const int32_t *prev;
};

struct moe_backend;

struct moe_backend_vt {
    const char *name;
    /* 1 when the backend computes with weights of this type. */
    int (*supports)(uint32_t type);
    /* Builds a backend for model m (shapes already checked by the engine). The backend writes
     * back what it resolves (n_threads). */
    int (*init)(struct moe_backend **out, const struct moe_model *m, struct moe_dims *d,
                char *err, size_t errlen);
    void (*free)(struct moe_backend *b);

    int (*begin)(struct moe_backend *b, const struct moe_step *st);
    int (*embed)(struct moe_backend *b, enum moe_buf dst);
    int (*rmsnorm)(struct moe_backend *b, int l, enum moe_wid w, enum moe_buf src,
                   enum moe_buf dst);
    int (*matmul)(struct moe_backend *b, int l, const struct moe_mm *mm, int n_mm,
                  enum moe_buf src, bool accumulate);
    int (*qk_rope_kv)(struct moe_backend *b, int l);
    int (*attention)(struct moe_backend *b, int l);
    int (*route)(struct moe_backend *b, int l);
    int (*experts)(struct moe_backend *b, int l);
    int (*head)(struct moe_backend *b);
    /* Runs (or finishes) the step; logits of the n_out rows go to out[n_out][V] (out may be
     * NULL when n_out is 0 or the step samples), sampled tokens to tokens[n_out] (-1: nothing
     * could be sampled) when the step samples. */
    int (*end)(struct moe_backend *b, float *out, int32_t *tokens);

    /* Sets sequence seq's sampler (outside a step): parameters, a reseeded generator and the
     * penalty history (e.g. the prompt). Sampled tokens are added to the history by the step. */
    int (*sampler)(struct moe_backend *b, int32_t seq, const struct moe_sampler_params *p,
                   const int32_t *history, size_t n_history);
    /* Copies positions 0..n-1 of sequence src's KV cache (every layer) to sequence dst, outside
     * a step; the bits are the same, so dst continues exactly as src would. */
    int (*kv_copy)(struct moe_backend *b, int32_t src, int32_t dst, uint32_t n);

    /* Routing counts since init, [L][nexp], copied to dst. */
    int (*routing_counts)(struct moe_backend *b, uint64_t *dst);
    /* Testing and debugging: rows [0, n) of a buffer, as float (int32 for SEL_E). Outside a
     * step. */
    int (*read_buf)(struct moe_backend *b, enum moe_buf buf, int64_t n, void *dst);
    int (*write_buf)(struct moe_backend *b, enum moe_buf buf, int64_t n, const void *src);
    /* Message of the last failure, "" when none. */
    const char *(*errmsg)(const struct moe_backend *b);
    /* Bytes of device memory the backend holds (0 on the CPU) and a one-line description. */
    void (*info)(const struct moe_backend *b, uint64_t *device_bytes, char *desc, size_t len);
    /* Expert offload counters (NULL: the backend keeps every expert where it computes). */
    int (*offload_stats)(struct moe_backend *b, struct moe_offload_stats *s,
                         struct moe_offload_layer *per_layer);
    /* Re-pins the hot experts by routing counts [L][nexp] between steps, copying at most
     * max_loads experts; *pending: experts still to copy (call again). NULL: no offload. */
    int (*set_hot)(struct moe_backend *b, const uint64_t *counts, uint32_t max_loads,
                   uint32_t *pending);
    /* Optional: every layer of the step at once, between embed() and head(), with the floats
     * of the per-layer op sequence bit for bit (CUDA: one persistent kernel for one-token
     * steps). Returns 1 when it ran them (the model loop then skips the per-layer ops), 0 when
     * this step goes op by op, < 0 on failure. NULL: always op by op. */
    int (*layers)(struct moe_backend *b);
    /* Optional (needed for moe_engine_opts.record_routes): after end() of a step begun with
     * st->record, that step's chosen experts, each layer's MOE_BUF_SEL_E once its routing is
     * final, as int32 [L][n][kuse] into dst. A step that records runs op by op (no layers()).
     * Steps that do not record cost nothing more. */
    int (*route_record)(struct moe_backend *b, int32_t *dst);
    /* Optional: the experts with a pinned device slot as [L][nexp] bits, LSB first (every expert
     * of a layer held whole in device memory). Between steps. Returns 1 with the bits written
     * when some experts live outside device memory, 0 (bits untouched) when none do, or < 0.
     * NULL: every expert is where the backend computes. */
    int (*hot_experts)(struct moe_backend *b, uint8_t *bits);
    /* Optional, both or neither (decode ahead): submit() instead of end() for a step that
     * samples and wants no logits queues it and returns before it has run, so that the host
     * prepares the next step (begin() may come while one step is submitted, not two: the
     * engine's queue holds MOE_ENGINE_AHEAD steps); collect() waits for the oldest submitted
     * step and copies its sampled tokens out (n_out of them, as end() would). A step's floats
     * are those of end(). Outside a step, only collect() may come while a step is submitted. */
    int (*submit)(struct moe_backend *b);
    int (*collect)(struct moe_backend *b, int32_t *tokens);
    /* Optional (outside a step): sequence seq's logit bias, val[i] added to logit tok[i] of every
     * row the sequence samples, in list order, before its penalties and its draw (as the
     * worker's host sampling adds logit_bias); n = 0 clears it, and so does sampler(). At most
     * MOE_BACKEND_MAX_BIAS entries, tokens distinct and in the vocabulary (the engine checks).
     * Logits copied out of a sampling step are the biased ones where the backend applies the
     * bias in place (CUDA), as they are the penalised ones there. */
    int (*bias)(struct moe_backend *b, int32_t seq, const int32_t *tok, const float *val,
                size_t n);
};

#define MOE_BACKEND_MAX_BIAS 2048

/* Every backend struct starts with this. */
struct moe_backend {
    const struct moe_backend_vt *vt;
};

extern const struct moe_backend_vt moe_backend_cpu;
#ifdef MOE_HAVE_CUDA
extern const struct moe_backend_vt moe_backend_cuda;
#endif

/* Row width of a buffer, in elements. */
static inline int64_t moe_buf_width(const struct moe_dims *d, enum moe_buf b)
{
    switch (b) {
    case MOE_BUF_H: case MOE_BUF_X: return d->E;
    case MOE_BUF_Q: return d->qdim;
    case MOE_BUF_K: return d->kdim;
    case MOE_BUF_V: return d->vdim;
    case MOE_BUF_ATT: return d->odim;
    case MOE_BUF_RL: return d->nexp;
    case MOE_BUF_SEL_W: case MOE_BUF_SEL_E: return d->kuse;
    case MOE_BUF_COUNT: break;
    }
    return 0;
}

/* The weight a (layer, id) pair names, or NULL. */
static inline const struct moe_tensor *moe_weight(const struct moe_model *m, int l,
                                                  enum moe_wid w)
{
    if (l < 0) {
        switch (w) {
        case MOE_W_EMBD: return &m->token_embd;
        case MOE_W_OUT_NORM: return &m->output_norm;
        case MOE_W_OUTPUT: return &m->output;
        default: return NULL;
        }
    }
    if ((uint32_t)l >= m->hp.n_layer)
        return NULL;
    const struct moe_layer *ly = &m->layers[l];
    switch (w) {
    case MOE_W_ATTN_NORM: return &ly->attn_norm;
    case MOE_W_Q: return &ly->attn_q;
    case MOE_W_K: return &ly->attn_k;
    case MOE_W_V: return &ly->attn_v;
    case MOE_W_Q_NORM: return &ly->attn_q_norm;
    case MOE_W_K_NORM: return &ly->attn_k_norm;
    case MOE_W_O: return &ly->attn_output;
    case MOE_W_FFN_NORM: return &ly->ffn_norm;
    case MOE_W_ROUTER: return &ly->ffn_gate_inp;
    default: return NULL;
    }
}

/* The engine's backend and dimensions (tests drive single ops through them). */
struct moe_engine;
struct moe_backend *moe_engine_backend(struct moe_engine *e);
const struct moe_dims *moe_engine_dims(const struct moe_engine *e);

/* The model loop (worker/qwen3moe.c): one step of the batch described by st, from begin() to
 * end(out, tokens), or with submit (a sampling step, vt->submit set) to submit(). */
int moe_qwen3moe_step(struct moe_backend *b, const struct moe_dims *d, const struct moe_step *st,
                      float *out, int32_t *tokens, bool submit);

#endif

/* The CUDA backend's small kernels: embedding, RMSNorm, q/k-norm + RoPE + KV store, attention,
 * routing, argmax. Internal to worker/cuda/; each launch function checks its launch and returns
 * 0 or MOE_EBACKEND. Everything a kernel needs beyond its pointers and static sizes is read from
 * device memory, so the launches can be captured in a CUDA graph. */
#ifndef MOE_CUDA_OPS_CUH
#define MOE_CUDA_OPS_CUH

#include <stdint.h>

#include <cuda_runtime.h>

/* out[t] = row token[t] of the embedding table (any computable type), for t < n; where d_prev
 * (NULL: nowhere) has prev[t] >= 0, the token is d_prev_tok[prev[t]] instead (a token sampled by
 * the step before, on the device), 0 when that is outside 0..V-1 (nothing was drawn). */
int moe_cuda_embed(uint32_t type, const void *d_table, int64_t E, const int32_t *d_token,
                   const int32_t *d_prev, const int32_t *d_prev_tok, int64_t V, int64_t n,
                   float *d_out, int64_t ldo, cudaStream_t s);

/* Logit biases of n_rows logits rows (V floats each, in place): row r, sampled by state row
 * d_rowmap[r], gets d_val[s·cap + i] added at d_tok[s·cap + i] for i < d_n[s] (s = its state
 * row). Each row's tokens are distinct, so every addition is the one a sequential pass makes. */
int moe_cuda_logit_bias(float *d_logits, int64_t V, int64_t n_rows, const int32_t *d_rowmap,
                        const int32_t *d_tok, const float *d_val, const int32_t *d_n, int64_t cap,
                        cudaStream_t s);

/* y[t] = x[row[t]] · rsqrt(mean(x²) + eps) · w for t < n (row NULL: row[t] = t). */
int moe_cuda_rmsnorm(const float *d_x, int64_t ldx, const int32_t *d_row, const float *d_w,
                     int64_t width, float eps, int64_t n, float *d_y, int64_t ldy, cudaStream_t s);

/* KV cache geometry: [L][n_seq][Hkv][n_ctx][hd] (f16 or f32). wide: the decode attention reads
 * an f16 cache's rows in 8- or 16-byte loads where the key and value heads are 32·EL wide
 * (attn_split_body; by default, MOE_CUDA_ATT_WIDE=0 turns it off). */
struct moe_cuda_kv {
    void *k, *v;
    bool f32, wide;
    int64_t n_seq, n_ctx, Hkv, hd, hdv;
};

/* Per-head RMSNorm (q_norm, k_norm weights) and NEOX RoPE of q [n][H·hd] and k [n][Hkv·hd] in
 * place with rope [n][hd/2][2], then k and v [n][Hkv·hdv] stored at (layer, seq[t], pos[t]). */
int moe_cuda_qk_rope_kv(float *d_q, int64_t ldq, float *d_k, int64_t ldk, const float *d_v,
                        int64_t ldv, const float *d_qn,
                        const float *d_kn, const float *d_rope, const int32_t *d_pos,
                        const int32_t *d_seq, const struct moe_cuda_kv *kv, int layer, int64_t H,
                        float eps, int64_t n, cudaStream_t s);

/* Causal attention of n tokens: out[t][h·hdv..] = softmax(q·K/√hd) V over positions 0..pos[t] of
 * sequence seq[t] (flash-decoding). A token's positions are cut into at most ATT_MAX_SPLITS
 * splits by its length alone; n_blocks (1..ATT_MAX_SPLITS) blocks per (token, head) share them,
 * so the result does not depend on n_blocks or on the other tokens. n_blocks 0: no split (one
 * block per (token, head) over all its positions; prompt steps, no partials). Partial results go to
 * d_part ([n][H][ATT_MAX_SPLITS][hdv + 2] floats, used by tokens with more than one split),
 * merged by the block that completes the last split; d_done: [n][H] counters, zero before the
 * first launch (each launch leaves them zero). */
#define ATT_MAX_SPLITS 64
int moe_cuda_attention(const float *d_q, int64_t ldq, const int32_t *d_pos, const int32_t *d_seq,
                       const struct moe_cuda_kv *kv, int layer, int64_t H, int64_t n, int n_blocks,
                       float *d_part, unsigned *d_done, float *d_out, int64_t ldo, cudaStream_t s);

/* Blocks of the decode attention kernel (with rope: moe_cuda_attention_rope's) an SM holds at
 * once for this cache's shape (0 on an error): how many splits a step can take in one wave. */
int moe_cuda_attention_blocks_per_sm(const struct moe_cuda_kv *kv, bool rope);

/* moe_cuda_attention (n_blocks >= 1) with moe_cuda_qk_rope_kv done inside, for steps whose
 * tokens are of distinct sequences (each reads only the cache positions before its own): the
 * same floats as the two launches, the same q, k rows and cache cells left behind. d_kdone:
 * [n][Hkv] counters, zero before the first launch (each launch leaves them zero). */
int moe_cuda_attention_rope(float *d_q, int64_t ldq, float *d_k, int64_t ldk, const float *d_v,
                            int64_t ldv, const float *d_qn, const float *d_kn,
                            const float *d_rope, const int32_t *d_pos, const int32_t *d_seq,
                            const struct moe_cuda_kv *kv, int layer, int64_t H, float eps,
                            int64_t n, int n_blocks, float *d_part, unsigned *d_done,
                            unsigned *d_kdone, float *d_out, int64_t ldo, cudaStream_t s);

/* Router: for each token, softmax over logits [n][nexp], top-k (lowest index wins ties; NaN never
 * wins unless nothing else is left), optional renormalisation; sel_e/sel_w [n][k]; counts[nexp]
 * (this layer's) incremented. */
int moe_cuda_route(const float *d_logits, int64_t ldl, int64_t nexp, int k, bool norm_topk, int64_t n,
                   int32_t *d_sel_e, float *d_sel_w, unsigned long long *d_counts,
                   cudaStream_t s);

/* tok[t] = argmax of logits[t][V] (lowest index on ties, NaN never wins; -1 when all are NaN). */
int moe_cuda_argmax(const float *d_logits, int64_t V, int64_t n, int32_t *d_tok, cudaStream_t s);

/* Partial-result floats of an attention launch of n tokens. */
static inline int64_t moe_cuda_attention_part_floats(int64_t n, int64_t H, int64_t hdv)
{
    return n * H * (int64_t)ATT_MAX_SPLITS * (hdv + 2);
}

#endif

/* The CUDA backend's small kernels (see ops.cuh). */
#include "worker/cuda/ops.cuh"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <mutex>

#include <cuda_fp16.h>

extern "C" {
#include "store/err.h"
#include "store/ggml_type.h"
}
#include "worker/cuda/cuda_check.cuh"
#include "worker/cuda/env_opts.h"
#include "worker/cuda/dequant.cuh"
#include "worker/cuda/launch.cuh"
#include "worker/cuda/ops_dev.cuh"

static __device__ vi block_argmax(vi x, float *redv, int *redi)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        vi y = {__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.i, o)};
        if (better(y, x))
            x = y;
    }
    __syncthreads();
    if (lane == 0) {
        redv[w] = x.v;
        redi[w] = x.i;
    }
    __syncthreads();
    x = lane < nw ? vi{redv[lane], redi[lane]} : vi{0.0f, -1};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        vi y = {__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.i, o)};
        if (better(y, x))
            x = y;
    }
    return x;
}

/* ---------------------------------------------------------------- embedding */

/* One block per token, an element per thread at a time (deq_elem: moe_dequantize's floats). */
static __global__ void embed_kernel(uint32_t type, const uint8_t *__restrict__ table,
                                    size_t row_bytes, int64_t E,
                                    const int32_t *__restrict__ token,
                                    const int32_t *__restrict__ prev,
                                    const int32_t *__restrict__ prev_tok, int64_t V, int64_t ldo,
                                    float *__restrict__ out)
{
    pdl_wait();
    pdl_trigger();
    const int64_t t = blockIdx.x;
    int64_t id = token[t];
    if (prev && prev[t] >= 0) {
        id = prev_tok[prev[t]];
        if (id < 0 || id >= V)
            id = 0;
    }
    const uint8_t *row = table + (size_t)id * row_bytes;
    for (int64_t i = threadIdx.x; i < E; i += blockDim.x)
        out[t * ldo + i] = deq_elem(type, row, i);
}

int moe_cuda_embed(uint32_t type, const void *d_table, int64_t E, const int32_t *d_token,
                   const int32_t *d_prev, const int32_t *d_prev_tok, int64_t V, int64_t n,
                   float *d_out, int64_t ldo, cudaStream_t s)
{
    const struct moe_type_info *ti = moe_type_get(type);
    if (!ti || !ti->compute || ti->blck > 256 || E % ti->blck)
        return MOE_EUNSUPPORTED;
    MOE_CUDA_TRY(moe_launch(embed_kernel, dim3((unsigned)n), dim3(512), 0, s, type,
                            (const uint8_t *)d_table, moe_row_bytes(type, E), E, d_token, d_prev,
                            d_prev_tok, V, ldo, d_out));
    return 0;
}

static __global__ void logit_bias_kernel(float *__restrict__ logits, int64_t V,
                                         const int32_t *__restrict__ rowmap,
                                         const int32_t *__restrict__ tok,
                                         const float *__restrict__ val,
                                         const int32_t *__restrict__ n, int64_t cap)
{
    pdl_wait();
    pdl_trigger();
    const int64_t r = blockIdx.x, s = rowmap[r];
    float *row = logits + r * V;
    for (int64_t i = threadIdx.x; i < n[s]; i += blockDim.x) {
        const int32_t t = tok[s * cap + i];
        if (t >= 0 && t < V)
            row[t] += val[s * cap + i];
    }
}

int moe_cuda_logit_bias(float *d_logits, int64_t V, int64_t n_rows, const int32_t *d_rowmap,
                        const int32_t *d_tok, const float *d_val, const int32_t *d_n, int64_t cap,
                        cudaStream_t s)
{
    if (n_rows <= 0)
        return 0;
    MOE_CUDA_TRY(moe_launch(logit_bias_kernel, dim3((unsigned)n_rows), dim3(128), 0, s, d_logits,
                            V, d_rowmap, d_tok, d_val, d_n, cap));
    return 0;
}

/* launch.cuh: whether the launches of the step being built take programmatic dependent launch
 * (set by the backend at each step's begin). */
int moe_pdl_step_on = 0;

/* launch.cuh: MOE_CUDA_NORM_EARLY for the step being built. */
int moe_norm_early_step = 0;

/* launch.cuh: MOE_CUDA_CARVEOUT, read once (-1: unset), and the kernels already given it. */
int moe_carveout_pct(void)
{
    static int pct = -2;
    if (pct == -2)
        pct = (int)moe_env_int("MOE_CUDA_CARVEOUT", 0, 100, -1);
    return pct;
}

cudaError_t moe_carveout_apply(const void *fn)
{
    static std::mutex mu;
    static const void *done[512];
    static int n_done;
    std::lock_guard<std::mutex> g(mu);
    for (int i = 0; i < n_done; i++)
        if (done[i] == fn)
            return cudaSuccess;
    const cudaError_t e =
        cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, moe_carveout_pct());
    if (e == cudaSuccess && n_done < (int)(sizeof done / sizeof done[0]))
        done[n_done++] = fn;
    return e;
}

/* ---------------------------------------------------------------- RMSNorm */

static __global__ void rmsnorm_kernel(const float *__restrict__ x, int64_t ldx,
                                      const int32_t *__restrict__ row,
                                      const float *__restrict__ w, int64_t width, float eps,
                                      float *__restrict__ y, int64_t ldy, int w_early)
{
    if (w_early)
        prefetch_span(w, sizeof(float) * (size_t)width, threadIdx.x, blockDim.x, w_early);
    pdl_wait();
    pdl_trigger();
    __shared__ float sc_s;
    const int64_t t = blockIdx.x, src = row ? row[t] : t;
    const float *xr = x + src * ldx;
    if (threadIdx.x < 32) {
        const float ss = row_ss_warp(xr, width);
        if (threadIdx.x == 0)
            sc_s = rms_scale(ss, width, eps);
    }
    __syncthreads();
    const float sc = sc_s;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x)
        y[t * ldy + i] = xr[i] * sc * w[i];
}

int moe_cuda_rmsnorm(const float *d_x, int64_t ldx, const int32_t *d_row, const float *d_w,
                     int64_t width, float eps, int64_t n, float *d_y, int64_t ldy, cudaStream_t s)
{
    if (n <= 0)
        return 0;
    /* One warp sums the squares (in the order the fused kernel uses too), then every thread
     * scales a few elements. */
    const int64_t th = width >= 2048 ? 512 : 256;
    MOE_CUDA_TRY(moe_launch(rmsnorm_kernel, dim3((unsigned)n), dim3((unsigned)th), 0, s, d_x, ldx,
                            d_row, d_w, width, eps, d_y, ldy, moe_norm_early_step));
    return 0;
}

/* ---------------------------------------------------------------- q/k norm, RoPE, KV store */

/* One warp per head: H query heads, then Hkv key heads (which also store v). */
template <bool F32>
static __global__ void qk_rope_kv_kernel(float *__restrict__ q, int64_t ldq,
                                         float *__restrict__ k, int64_t ldk,
                                         const float *__restrict__ v, int64_t ldv,
                                         const float *__restrict__ qn,
                                         const float *__restrict__ kn,
                                         const float *__restrict__ rope,
                                         const int32_t *__restrict__ pos,
                                         const int32_t *__restrict__ seq, moe_cuda_kv kv,
                                         int layer, int64_t H, float eps)
{
    /* Shared memory: the warps' rows, then the norm weights of q and k and the token's angles,
     * copied before the wait (weights, and a step input that no kernel writes). */
    extern __shared__ float sm[];
    const int64_t hd = kv.hd, t = blockIdx.x;
    float *cq = sm + (size_t)ATT_WARPS * hd, *ck = cq + hd, *cc = ck + hd;
    for (int64_t i = threadIdx.x; i < hd; i += blockDim.x) {
        cq[i] = qn[i];
        ck[i] = kn[i];
        cc[i] = rope[t * hd + i];
    }
    pdl_wait();
    pdl_trigger();
    __syncthreads();
    const int w = threadIdx.x >> 5;
    const int64_t hi = (int64_t)blockIdx.y * ATT_WARPS + w;
    if (hi >= H + kv.Hkv)
        return;
    qk_rope_kv_warp<F32>(q, ldq, k, ldk, v, ldv, cq, ck, rope, pos, seq, kv, layer, H, eps, t, hi,
                         sm + (size_t)w * hd, cc);
}

int moe_cuda_qk_rope_kv(float *d_q, int64_t ldq, float *d_k, int64_t ldk, const float *d_v,
                        int64_t ldv, const float *d_qn,
                        const float *d_kn, const float *d_rope, const int32_t *d_pos,
                        const int32_t *d_seq, const struct moe_cuda_kv *kv, int layer, int64_t H,
                        float eps, int64_t n, cudaStream_t s)
{
    if (n <= 0)
        return 0;
    dim3 g((unsigned)n, (unsigned)((H + kv->Hkv + ATT_WARPS - 1) / ATT_WARPS));
    size_t smem = sizeof(float) * (size_t)((ATT_WARPS + 3) * kv->hd);
    MOE_CUDA_TRY(moe_launch(kv->f32 ? qk_rope_kv_kernel<true> : qk_rope_kv_kernel<false>, g,
                            dim3(32 * ATT_WARPS), smem, s, d_q, ldq, d_k, ldk, d_v, ldv, d_qn, d_kn,
                            d_rope, d_pos, d_seq, *kv, layer, H, eps));
    return 0;
}

/* ---------------------------------------------------------------- attention */

/* Decode attention (flash-decoding): one block of ATT_WARPS warps per (head, token, split group);
 * the body (ops_dev.cuh) says how positions are split and merged. ROPE: the q/k-norm + RoPE + KV
 * store of the step done inside (moe_cuda_attention_rope). */
template <bool F32, int EL, bool ROPE, bool WIDE>
static __global__ void __launch_bounds__(32 * ATT_WARPS, EL <= 4 && !ROPE ? 8 : 1)
attn_split_kernel(const float *__restrict__ q, int64_t ldq, const int32_t *__restrict__ pos,
                  const int32_t *__restrict__ seq, moe_cuda_kv kv, int layer, int64_t H,
                  float scale, int split, float *__restrict__ part, unsigned *__restrict__ done,
                  float *__restrict__ out, int64_t ldo, att_rope_dev rp)
{
    pdl_wait();
    pdl_trigger();
    __shared__ att_smem sm;
    extern __shared__ float sm_acc[]; /* [ATT_WARPS][hdv], with ROPE [ATT_WARPS][rp.rowf] */
    attn_split_body<F32, EL, att_sync_block, ROPE, WIDE>(
        q, ldq, pos, seq, kv, layer, H, scale, split, part, done, out, ldo, blockIdx.x, blockIdx.y,
        (int)blockIdx.z, (int)gridDim.z, (int)threadIdx.x, &sm, sm_acc, att_sync_block(), &rp);
}

template <bool F32, bool ROPE, bool WIDE>
static cudaError_t launch_attn(int el, dim3 g, size_t smem, cudaStream_t s, const float *d_q,
                               int64_t ldq, const int32_t *d_pos, const int32_t *d_seq,
                               const struct moe_cuda_kv *kv, int layer, int64_t H, float scale,
                               int split, float *d_part, unsigned *d_done, float *d_out,
                               int64_t ldo, const att_rope_dev &rp)
{
#define ATT_ARGS g, dim3(32 * ATT_WARPS), smem, s, d_q, ldq, d_pos, d_seq, *kv, layer, H, scale, \
                 split, d_part, d_done, d_out, ldo, rp
    return el <= 1   ? moe_launch(attn_split_kernel<F32, 1, ROPE, WIDE>, ATT_ARGS)
           : el <= 2 ? moe_launch(attn_split_kernel<F32, 2, ROPE, WIDE>, ATT_ARGS)
           : el <= 4 ? moe_launch(attn_split_kernel<F32, 4, ROPE, WIDE>, ATT_ARGS)
           : el <= 8 ? moe_launch(attn_split_kernel<F32, 8, ROPE, WIDE>, ATT_ARGS)
                     : moe_launch(attn_split_kernel<F32, MAXD_LANE, ROPE, WIDE>, ATT_ARGS);
#undef ATT_ARGS
}

/* A decode attention launch's head elements a lane holds (el: the lane width of the kernel
 * instance it takes, 1, 2, 4, 8 or MAXD_LANE) and its dynamic shared memory, with the folded
 * RoPE (rope) or without: what the launch takes and what its occupancy is asked for. */
static void attn_shape(const struct moe_cuda_kv *kv, bool rope, int *el, size_t *smem)
{
    const int64_t wd = kv->hd > kv->hdv ? kv->hd : kv->hdv;
    const int need = (int)((wd + 31) / 32);
    *el = need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : need <= 8 ? 8 : MAXD_LANE;
    *smem = sizeof(float) * (size_t)(ATT_WARPS * (rope ? wd : kv->hdv));
}

static int attention(const float *d_q, int64_t ldq, const int32_t *d_pos, const int32_t *d_seq,
                     const struct moe_cuda_kv *kv, int layer, int64_t H, int64_t n, int n_blocks,
                     float *d_part, unsigned *d_done, float *d_out, int64_t ldo,
                     const att_rope_dev *rp, cudaStream_t s)
{
    if (n <= 0)
        return 0;
    if (kv->hd > 32 * MAXD_LANE || kv->hdv > 32 * MAXD_LANE || n_blocks < 0 ||
        n_blocks > ATT_MAX_SPLITS || n > 65535)
        return -EINVAL;
    const float scale = (float)(1.0 / sqrt((double)kv->hd));
    const int split = n_blocks > 0;
    dim3 g((unsigned)H, (unsigned)n, (unsigned)(split ? n_blocks : 1));
    int el;
    size_t smem;
    attn_shape(kv, rp != NULL, &el, &smem);
    const att_rope_dev none = {}, &r = rp ? *rp : none;
    const bool wide = att_wide_ok(*kv, el);
#define ATT_CALL(F32, ROPE, WIDE)                                                                  \
    launch_attn<F32, ROPE, WIDE>(el, g, smem, s, d_q, ldq, d_pos, d_seq, kv, layer, H, scale,      \
                                 split, d_part, d_done, d_out, ldo, r)
    const cudaError_t e = kv->f32 ? (rp ? ATT_CALL(true, true, false)
                                         : ATT_CALL(true, false, false))
                          : wide    ? (rp ? ATT_CALL(false, true, true)
                                          : ATT_CALL(false, false, true))
                                    : (rp ? ATT_CALL(false, true, false)
                                          : ATT_CALL(false, false, false));
#undef ATT_CALL
    MOE_CUDA_TRY(e);
    return 0;
}

template <bool F32, bool ROPE, bool WIDE> static int attn_occupancy(int el, size_t smem)
{
    int nb = 0;
#define OCC(E)                                                                                     \
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, attn_split_kernel<F32, E, ROPE, WIDE>,      \
                                                  32 * ATT_WARPS, smem)
    const cudaError_t e = el <= 1   ? OCC(1)
                          : el <= 2 ? OCC(2)
                          : el <= 4 ? OCC(4)
                          : el <= 8 ? OCC(8)
                                    : OCC(MAXD_LANE);
#undef OCC
    return e == cudaSuccess ? nb : 0;
}

int moe_cuda_attention_blocks_per_sm(const struct moe_cuda_kv *kv, bool rope)
{
    int el;
    size_t smem;
    attn_shape(kv, rope, &el, &smem);
    if (kv->f32)
        return rope ? attn_occupancy<true, true, false>(el, smem)
                    : attn_occupancy<true, false, false>(el, smem);
    if (att_wide_ok(*kv, el))
        return rope ? attn_occupancy<false, true, true>(el, smem)
                    : attn_occupancy<false, false, true>(el, smem);
    return rope ? attn_occupancy<false, true, false>(el, smem)
                : attn_occupancy<false, false, false>(el, smem);
}

int moe_cuda_attention(const float *d_q, int64_t ldq, const int32_t *d_pos, const int32_t *d_seq,
                       const struct moe_cuda_kv *kv, int layer, int64_t H, int64_t n, int n_blocks,
                       float *d_part, unsigned *d_done, float *d_out, int64_t ldo, cudaStream_t s)
{
    return attention(d_q, ldq, d_pos, d_seq, kv, layer, H, n, n_blocks, d_part, d_done, d_out,
                     ldo, NULL, s);
}

int moe_cuda_attention_rope(float *d_q, int64_t ldq, float *d_k, int64_t ldk, const float *d_v,
                            int64_t ldv, const float *d_qn, const float *d_kn,
                            const float *d_rope, const int32_t *d_pos, const int32_t *d_seq,
                            const struct moe_cuda_kv *kv, int layer, int64_t H, float eps,
                            int64_t n, int n_blocks, float *d_part, unsigned *d_done,
                            unsigned *d_kdone, float *d_out, int64_t ldo, cudaStream_t s)
{
    if (n_blocks < 1 || kv->Hkv < 1 || H % kv->Hkv != 0 || kv->hd % 2 != 0)
        return -EINVAL;
    const att_rope_dev rp = {d_q,  d_k,  ldk,    d_v,     ldv,
                             d_qn, d_kn, d_rope, eps,     d_kdone,
                             kv->hd > kv->hdv ? kv->hd : kv->hdv};
    return attention(d_q, ldq, d_pos, d_seq, kv, layer, H, n, n_blocks, d_part, d_done, d_out,
                     ldo, &rp, s);
}

/* ---------------------------------------------------------------- routing */

/* One warp per token (route_warp, ops_dev.cuh). */
static __global__ void route_kernel(const float *__restrict__ logits, int64_t ldl, int64_t n,
                                    int64_t nexp, int k, bool norm_topk,
                                    int32_t *__restrict__ sel_e,
                                    float *__restrict__ sel_w,
                                    unsigned long long *__restrict__ counts)
{
    pdl_wait();
    pdl_trigger();
    extern __shared__ float pr[]; /* [ROUTE_WARPS][nexp] */
    const int w = threadIdx.x >> 5;
    const int64_t t = (int64_t)blockIdx.x * ROUTE_WARPS + w;
    if (t >= n)
        return;
    route_warp(logits + t * ldl, (int)nexp, k, norm_topk, sel_e + t * k, sel_w + t * k, counts,
               pr + (size_t)w * nexp);
}

int moe_cuda_route(const float *d_logits, int64_t ldl, int64_t nexp, int k, bool norm_topk, int64_t n,
                   int32_t *d_sel_e, float *d_sel_w, unsigned long long *d_counts,
                   cudaStream_t s)
{
    if (n <= 0)
        return 0;
    if (nexp > 8192 || k < 1 || k > nexp || n > 65535)
        return -EINVAL;
    dim3 g((unsigned)((n + ROUTE_WARPS - 1) / ROUTE_WARPS));
    const size_t smem = sizeof(float) * ROUTE_WARPS * (size_t)nexp;
    if (smem > 48 * 1024)
        MOE_CUDA_TRY(cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          (int)smem));
    MOE_CUDA_TRY(moe_launch(route_kernel, g, dim3(32 * ROUTE_WARPS), smem, s, d_logits, ldl, n, nexp,
                            k, norm_topk, d_sel_e, d_sel_w, d_counts));
    return 0;
}

/* ---------------------------------------------------------------- argmax */

static __global__ void argmax_kernel(const float *__restrict__ logits, int64_t V,
                                     int32_t *__restrict__ tok)
{
    pdl_wait();
    pdl_trigger();
    __shared__ float redv[32];
    __shared__ int redi[32];
    const float *r = logits + (int64_t)blockIdx.x * V;
    vi best = {0.0f, -1};
    for (int64_t x = threadIdx.x; x < V; x += blockDim.x) {
        float v = r[x];
        if (!(v > -INFINITY))
            continue; /* NaN and -inf never win */
        vi c = {v, (int)x};
        if (better(c, best))
            best = c;
    }
    best = block_argmax(best, redv, redi);
    if (threadIdx.x == 0)
        tok[blockIdx.x] = best.i;
}

int moe_cuda_argmax(const float *d_logits, int64_t V, int64_t n, int32_t *d_tok, cudaStream_t s)
{
    if (n <= 0)
        return 0;
    MOE_CUDA_TRY(moe_launch(argmax_kernel, dim3((unsigned)n), dim3(1024), 0, s, d_logits, V,
                            d_tok));
    return 0;
}

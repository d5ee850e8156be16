/* The CUDA backend's small kernels (see ops.cuh). */
#include "worker/cuda/ops.cuh"

#include <errno.h>
#include <math.h>

#include <cuda_fp16.h>

extern "C" {
#include "store/err.h"
#include "store/ggml_type.h"
}
#include "worker/cuda/cuda_check.cuh"
#include "worker/cuda/dequant.cuh"
#include "worker/cuda/launch.cuh"

/* Elements a lane holds of one head vector: head dims up to 32 · MAXD_LANE. */
#define MAXD_LANE 16
#define ATT_WARPS 4
#define ATT_ILP 4
#define ROUTE_WARPS 4

static __device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it. */
static __device__ float block_sum(float v, float *red)
{
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0)
        red[w] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.0f;
    return warp_sum(v);
}

/* (value, index) argmax where a candidate is valid when idx >= 0. better(): valid beats invalid,
 * the larger value wins, the lower index wins ties. */
struct vi {
    float v;
    int i;
};

static __device__ __forceinline__ bool better(vi a, vi b)
{
    if (a.i < 0)
        return false;
    if (b.i < 0)
        return true;
    return a.v > b.v || (a.v == b.v && a.i < b.i);
}

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

static __global__ void embed_kernel(uint32_t type, const uint8_t *__restrict__ table,
                                    size_t row_bytes, int blck, int64_t nb,
                                    const int32_t *__restrict__ token, int64_t ldo,
                                    float *__restrict__ out)
{
    pdl_trigger();
    pdl_wait();
    const int64_t t = blockIdx.x;
    const uint8_t *row = table + (size_t)token[t] * row_bytes;
    float y[256];
    for (int64_t bi = threadIdx.x; bi < nb; bi += blockDim.x) {
        deq_block(type, row, bi, y);
        for (int i = 0; i < blck; i++)
            out[t * ldo + bi * blck + i] = y[i];
    }
}

int moe_cuda_embed(uint32_t type, const void *d_table, int64_t E, const int32_t *d_token,
                   int64_t n, float *d_out, int64_t ldo, cudaStream_t s)
{
    const struct moe_type_info *ti = moe_type_get(type);
    if (!ti || !ti->compute || ti->blck > 256 || E % ti->blck)
        return MOE_EUNSUPPORTED;
    MOE_CUDA_TRY(moe_launch(embed_kernel, dim3((unsigned)n), dim3(128), 0, s, type,
                            (const uint8_t *)d_table, moe_row_bytes(type, E), (int)ti->blck,
                            E / ti->blck, d_token, ldo, d_out));
    return 0;
}

/* ---------------------------------------------------------------- RMSNorm */

static __global__ void rmsnorm_kernel(const float *__restrict__ x, int64_t ldx,
                                      const int32_t *__restrict__ row,
                                      const float *__restrict__ w, int64_t width, float eps,
                                      float *__restrict__ y, int64_t ldy)
{
    pdl_trigger();
    pdl_wait();
    __shared__ float red[32];
    const int64_t t = blockIdx.x, src = row ? row[t] : t;
    const float *xr = x + src * ldx;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x)
        ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float sc = 1.0f / sqrtf(ss / (float)width + eps);
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x)
        y[t * ldy + i] = xr[i] * sc * w[i];
}

int moe_cuda_rmsnorm(const float *d_x, int64_t ldx, const int32_t *d_row, const float *d_w,
                     int64_t width, float eps, int64_t n, float *d_y, int64_t ldy, cudaStream_t s)
{
    if (n <= 0)
        return 0;
    /* One element or two per thread: the row is read in one round trip. */
    int64_t th = (width / 2 + 31) / 32 * 32;
    th = th < 64 ? 64 : th > 1024 ? 1024 : th;
    MOE_CUDA_TRY(moe_launch(rmsnorm_kernel, dim3((unsigned)n), dim3((unsigned)th), 0, s, d_x, ldx,
                            d_row, d_w, width, eps, d_y, ldy));
    return 0;
}

/* ---------------------------------------------------------------- q/k norm, RoPE, KV store */

template <bool F32>
static __device__ __forceinline__ void kv_put(void *base, size_t idx, float v)
{
    if constexpr (F32)
        ((float *)base)[idx] = v;
    else
        ((__half *)base)[idx] = __float2half_rn(v);
}

template <bool F32>
static __device__ __forceinline__ float kv_get(const void *base, size_t idx)
{
    if constexpr (F32)
        return ((const float *)base)[idx];
    else
        return __half2float(((const __half *)base)[idx]);
}

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
    pdl_trigger();
    pdl_wait();
    extern __shared__ float sm[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t t = blockIdx.x, hi = (int64_t)blockIdx.y * ATT_WARPS + w;
    const int64_t hd = kv.hd, half = hd / 2;
    if (hi >= H + kv.Hkv)
        return;
    const bool isq = hi < H;
    float *vec = isq ? q + t * ldq + hi * hd : k + t * ldk + (hi - H) * hd;
    const float *nw = isq ? qn : kn;
    float *row = sm + (size_t)w * hd;
    float ss = 0.0f;
    for (int64_t i = lane; i < hd; i += 32) {
        float x = vec[i];
        row[i] = x;
        ss += x * x;
    }
    ss = warp_sum(ss);
    const float sc = 1.0f / sqrtf(ss / (float)hd + eps);
    __syncwarp();
    const float *cs = rope + t * hd;
    size_t cell = 0;
    if (!isq) {
        const int64_t kvh = hi - H;
        cell = ((((size_t)layer * kv.n_seq + (size_t)seq[t]) * kv.Hkv + (size_t)kvh) * kv.n_ctx +
                (size_t)pos[t]);
    }
    for (int64_t i = lane; i < half; i += 32) {
        float a = row[i] * sc * nw[i], b = row[i + half] * sc * nw[i + half];
        float c = cs[2 * i], sn = cs[2 * i + 1];
        float o0 = a * c - b * sn, o1 = a * sn + b * c;
        vec[i] = o0;
        vec[i + half] = o1;
        if (!isq) {
            kv_put<F32>(kv.k, cell * hd + i, o0);
            kv_put<F32>(kv.k, cell * hd + i + half, o1);
        }
    }
    if (!isq) {
        const float *vr = v + t * ldv + (hi - H) * kv.hdv;
        for (int64_t i = lane; i < kv.hdv; i += 32)
            kv_put<F32>(kv.v, cell * kv.hdv + i, vr[i]);
    }
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
    size_t smem = sizeof(float) * (size_t)(ATT_WARPS * kv->hd);
    MOE_CUDA_TRY(moe_launch(kv->f32 ? qk_rope_kv_kernel<true> : qk_rope_kv_kernel<false>, g,
                            dim3(32 * ATT_WARPS), smem, s, d_q, ldq, d_k, ldk, d_v, ldv, d_qn, d_kn,
                            d_rope, d_pos, d_seq, *kv, layer, H, eps));
    return 0;
}

/* ---------------------------------------------------------------- attention */

/* Decode attention (flash-decoding). A token's positions 0..len-1 are cut into splits of C
 * positions, C = max(ATT_CHUNK, ceil(len / ATT_MAX_SPLITS)): the cut depends on len alone, never
 * on the step. Block (head, token, z) computes splits z, z + Z, ... (Z = gridDim.z, chosen by
 * the caller from the step's size to fill the GPU): each warp walks every ATT_WARPS-th group of
 * ATT_ILP positions of the split with an online softmax (running max m, sum l, unnormalised
 * output in registers, a lane holding elements lane + 32·i; the values of a group are loaded with
 * its keys, before the scores are known), the warps are merged into the split's partial result
 * ([hdv] unnormalised, m, l). The block that completes the last split of a (token, head) (a
 * counter per pair, reset by that block for the next step) merges the partials in split order.
 * A token with one split writes its output directly. Every float operation of a token is the same
 * whatever Z and whatever else is in the step. */
#define ATT_CHUNK 32
template <bool F32, int EL>
static __global__ void __launch_bounds__(32 * ATT_WARPS)
attn_split_kernel(const float *__restrict__ q, int64_t ldq, const int32_t *__restrict__ pos,
                  const int32_t *__restrict__ seq, moe_cuda_kv kv, int layer, int64_t H,
                  float scale, int split, float *__restrict__ part, unsigned *__restrict__ done,
                  float *__restrict__ out, int64_t ldo)
{
    pdl_trigger();
    pdl_wait();
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS], sm_w[ATT_MAX_SPLITS], sm_gl;
    __shared__ bool last;
    extern __shared__ float sm_acc[]; /* [ATT_WARPS][hdv] */
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t h = blockIdx.x, t = blockIdx.y;
    const int Z = (int)gridDim.z;
    const int64_t hd = kv.hd, hdv = kv.hdv, group = H / kv.Hkv, kvh = h / group;
    const int64_t len = (int64_t)pos[t] + 1;
    int64_t C = (len + ATT_MAX_SPLITS - 1) / ATT_MAX_SPLITS;
    if (C < ATT_CHUNK)
        C = ATT_CHUNK;
    if (!split)
        C = len; /* one split: prompt steps, which have blocks enough */
    const int ns = (int)((len + C - 1) / C);
    if ((int)blockIdx.z >= ns)
        return;
    const size_t row0 = (((size_t)layer * kv.n_seq + (size_t)seq[t]) * kv.Hkv + (size_t)kvh) *
                        kv.n_ctx;
    float qv[EL];
#pragma unroll
    for (int i = 0; i < EL; i++) {
        int64_t e = lane + 32 * i;
        qv[i] = e < hd ? q[t * ldq + h * hd + e] * scale : 0.0f;
    }
    float *pp = part + (t * H + h) * ATT_MAX_SPLITS * (hdv + 2);
    int mine = 0;
    for (int sp = (int)blockIdx.z; sp < ns; sp += Z, mine++) {
        const int64_t p0 = (int64_t)sp * C, p1 = p0 + C < len ? p0 + C : len;
        float acc[EL];
#pragma unroll
        for (int i = 0; i < EL; i++)
            acc[i] = 0.0f;
        float m = -INFINITY, l = 0.0f;
        for (int64_t pb = p0 + (int64_t)w * ATT_ILP; pb < p1; pb += ATT_WARPS * ATT_ILP) {
            float sd[ATT_ILP], vv[ATT_ILP][EL];
#pragma unroll
            for (int c = 0; c < ATT_ILP; c++) {
                const int64_t p = pb + c < p1 ? pb + c : pb;
                const size_t kr = (row0 + (size_t)p) * hd, vr = (row0 + (size_t)p) * hdv;
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < EL; i++) {
                    int64_t e = lane + 32 * i;
                    if (e < hd)
                        d += qv[i] * kv_get<F32>(kv.k, kr + e);
                    vv[c][i] = e < hdv ? kv_get<F32>(kv.v, vr + e) : 0.0f;
                }
                sd[c] = d;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int c = 0; c < ATT_ILP; c++)
                    sd[c] += __shfl_xor_sync(0xffffffffu, sd[c], o);
            float mn = m;
#pragma unroll
            for (int c = 0; c < ATT_ILP; c++)
                if (pb + c < p1)
                    mn = fmaxf(mn, sd[c]);
            const float corr = __expf(m - mn);
            float pe[ATT_ILP];
#pragma unroll
            for (int c = 0; c < ATT_ILP; c++)
                pe[c] = pb + c < p1 ? __expf(sd[c] - mn) : 0.0f;
            l *= corr;
#pragma unroll
            for (int c = 0; c < ATT_ILP; c++)
                l += pe[c];
#pragma unroll
            for (int i = 0; i < EL; i++) {
                float a = acc[i] * corr;
#pragma unroll
                for (int c = 0; c < ATT_ILP; c++)
                    a += pe[c] * vv[c][i];
                acc[i] = a;
            }
            m = mn;
        }
        __syncthreads(); /* the previous split's merge is done with the shared arrays */
        if (lane == 0) {
            sm_m[w] = m;
            sm_l[w] = l;
        }
#pragma unroll
        for (int i = 0; i < EL; i++) {
            int64_t e = lane + 32 * i;
            if (e < hdv)
                sm_acc[w * hdv + e] = acc[i];
        }
        __syncthreads();
        float M = -INFINITY;
        for (int j = 0; j < ATT_WARPS; j++)
            M = fmaxf(M, sm_m[j]);
        float L = 0.0f;
        for (int j = 0; j < ATT_WARPS; j++)
            if (sm_m[j] != -INFINITY)
                L += sm_l[j] * __expf(sm_m[j] - M);
        if (ns == 1) {
            const float inv = 1.0f / L;
            for (int64_t e = threadIdx.x; e < hdv; e += blockDim.x) {
                float o = 0.0f;
                for (int j = 0; j < ATT_WARPS; j++)
                    if (sm_m[j] != -INFINITY)
                        o += sm_acc[j * hdv + e] * __expf(sm_m[j] - M);
                out[t * ldo + h * hdv + e] = o * inv;
            }
            return;
        }
        float *ps = pp + sp * (hdv + 2);
        for (int64_t e = threadIdx.x; e < hdv; e += blockDim.x) {
            float o = 0.0f;
            for (int j = 0; j < ATT_WARPS; j++)
                if (sm_m[j] != -INFINITY)
                    o += sm_acc[j * hdv + e] * __expf(sm_m[j] - M);
            ps[e] = o;
        }
        if (threadIdx.x == 0) {
            ps[hdv] = M;
            ps[hdv + 1] = L;
        }
    }
    /* Publish the partials, then count this block's splits in. */
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned prev = atomicAdd(&done[t * H + h], (unsigned)mine);
        last = prev + (unsigned)mine == (unsigned)ns;
    }
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    /* The merge: split weights by one warp (ns <= ATT_MAX_SPLITS = 64), then every output
     * element summed over the splits in split order. */
    if (w == 0) {
        float ms[ATT_MAX_SPLITS / 32], ls[ATT_MAX_SPLITS / 32];
        float gm = -INFINITY;
#pragma unroll
        for (int i = 0; i < ATT_MAX_SPLITS / 32; i++) {
            const int s2 = lane + 32 * i;
            ms[i] = s2 < ns ? __ldcg(pp + s2 * (hdv + 2) + hdv) : -INFINITY;
            ls[i] = s2 < ns ? __ldcg(pp + s2 * (hdv + 2) + hdv + 1) : 0.0f;
            gm = fmaxf(gm, ms[i]);
        }
        gm = warp_max(gm);
        float gl = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAX_SPLITS / 32; i++) {
            const int s2 = lane + 32 * i;
            const float wt = ms[i] != -INFINITY ? __expf(ms[i] - gm) : 0.0f;
            if (s2 < ns)
                sm_w[s2] = wt;
            gl += ls[i] * wt;
        }
        gl = warp_sum(gl);
        if (lane == 0)
            sm_gl = gl;
    }
    __syncthreads();
    const float inv = 1.0f / sm_gl;
    for (int64_t e = threadIdx.x; e < hdv; e += blockDim.x) {
        float o = 0.0f;
        int s2 = 0;
        for (; s2 + 8 <= ns; s2 += 8) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                v[j] = __ldcg(pp + (s2 + j) * (hdv + 2) + e);
#pragma unroll
            for (int j = 0; j < 8; j++)
                o += v[j] * sm_w[s2 + j];
        }
        for (; s2 < ns; s2++)
            o += __ldcg(pp + s2 * (hdv + 2) + e) * sm_w[s2];
        out[t * ldo + h * hdv + e] = o * inv;
    }
    if (threadIdx.x == 0)
        done[t * H + h] = 0;
}

template <bool F32>
static cudaError_t launch_attn(int el, dim3 g, size_t smem, cudaStream_t s, const float *d_q,
                               int64_t ldq, const int32_t *d_pos, const int32_t *d_seq,
                               const struct moe_cuda_kv *kv, int layer, int64_t H, float scale,
                               int split, float *d_part, unsigned *d_done, float *d_out,
                               int64_t ldo)
{
#define ATT_ARGS g, dim3(32 * ATT_WARPS), smem, s, d_q, ldq, d_pos, d_seq, *kv, layer, H, scale, \
                 split, d_part, d_done, d_out, ldo
    return el <= 1   ? moe_launch(attn_split_kernel<F32, 1>, ATT_ARGS)
           : el <= 2 ? moe_launch(attn_split_kernel<F32, 2>, ATT_ARGS)
           : el <= 4 ? moe_launch(attn_split_kernel<F32, 4>, ATT_ARGS)
           : el <= 8 ? moe_launch(attn_split_kernel<F32, 8>, ATT_ARGS)
                     : moe_launch(attn_split_kernel<F32, MAXD_LANE>, ATT_ARGS);
#undef ATT_ARGS
}

int moe_cuda_attention(const float *d_q, int64_t ldq, const int32_t *d_pos, const int32_t *d_seq,
                       const struct moe_cuda_kv *kv, int layer, int64_t H, int64_t n, int n_blocks,
                       float *d_part, unsigned *d_done, float *d_out, int64_t ldo, cudaStream_t s)
{
    if (n <= 0)
        return 0;
    if (kv->hd > 32 * MAXD_LANE || kv->hdv > 32 * MAXD_LANE || n_blocks < 0 ||
        n_blocks > ATT_MAX_SPLITS || n > 65535)
        return -EINVAL;
    const float scale = (float)(1.0 / sqrt((double)kv->hd));
    const int split = n_blocks > 0;
    dim3 g((unsigned)H, (unsigned)n, (unsigned)(split ? n_blocks : 1));
    size_t smem = sizeof(float) * (size_t)(ATT_WARPS * kv->hdv);
    const int64_t wd = kv->hd > kv->hdv ? kv->hd : kv->hdv;
    const int el = (int)((wd + 31) / 32);
    MOE_CUDA_TRY(kv->f32 ? launch_attn<true>(el, g, smem, s, d_q, ldq, d_pos, d_seq, kv, layer, H,
                                             scale, split, d_part, d_done, d_out, ldo)
                         : launch_attn<false>(el, g, smem, s, d_q, ldq, d_pos, d_seq, kv, layer, H,
                                              scale, split, d_part, d_done, d_out, ldo));
    return 0;
}

/* ---------------------------------------------------------------- routing */

/* One warp per token (experts in shared memory, lane i holding experts i, i+32, ...). The CPU's
 * rule for the top-k scan (lowest index first): the best is replaced by a larger probability, or
 * whenever the best so far is NaN. So among the untaken experts a non-NaN maximum (lowest index
 * on ties) wins; when all are NaN, the last one. Sums in double, as on the CPU. */
static __global__ void route_kernel(const float *__restrict__ logits, int64_t ldl, int64_t n,
                                    int64_t nexp, int k, bool norm_topk,
                                    int32_t *__restrict__ sel_e,
                                    float *__restrict__ sel_w,
                                    unsigned long long *__restrict__ counts)
{
    pdl_trigger();
    pdl_wait();
    extern __shared__ float pr[]; /* [ROUTE_WARPS][nexp] */
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int64_t t = (int64_t)blockIdx.x * ROUTE_WARPS + w;
    if (t >= n)
        return;
    float *p = pr + (size_t)w * nexp;
    const float *r = logits + t * ldl;
    const int ne = (int)nexp;
    /* The row into shared memory, its loads issued together. */
#pragma unroll 8
    for (int x = lane; x < ne; x += 32)
        p[x] = r[x];
    __syncwarp();
    float mx = -INFINITY;
    for (int x = lane; x < ne; x += 32)
        mx = fmaxf(mx, p[x]);
    mx = warp_max(mx);
    double z = 0.0;
    for (int x = lane; x < ne; x += 32) {
        float e = expf(p[x] - mx);
        p[x] = e;
        z += e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        z += __shfl_xor_sync(0xffffffffu, z, o);
    for (int x = lane; x < ne; x += 32)
        p[x] = (float)(p[x] / z);
    __syncwarp();
    /* Taken experts are marked in shared memory by setting their probability to a sentinel
     * that no softmax output equals (-1); the chosen values are kept in lane registers. */
    double wsum = 0.0;
    float chosen_w = 0.0f;
    int chosen_e = 0;
    for (int j = 0; j < k; j++) {
        vi best = {0.0f, -1};
        int last_nan = -1;
        for (int x = lane; x < ne; x += 32) {
            float v = p[x];
            if (v == -1.0f)
                continue;
            if (isnan(v)) {
                last_nan = (int)x;
                continue;
            }
            vi c = {v, (int)x};
            if (better(c, best))
                best = c;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            vi y = {__shfl_xor_sync(0xffffffffu, best.v, o), __shfl_xor_sync(0xffffffffu, best.i, o)};
            if (better(y, best))
                best = y;
            last_nan = max(last_nan, __shfl_xor_sync(0xffffffffu, last_nan, o));
        }
        if (best.i < 0) {
            best.i = last_nan;
            best.v = p[last_nan];
        }
        __syncwarp();
        if (lane == 0)
            p[best.i] = -1.0f;
        if (lane == (j & 31)) {
            chosen_w = best.v;
            chosen_e = best.i;
        }
        if (lane == 0)
            atomicAdd(&counts[best.i], 1ull);
        __syncwarp();
        wsum += best.v;
        if ((j & 31) == 31 || j == k - 1) {
            /* Lanes 0..(j & 31) hold choices j & ~31 .. j. */
            int base = j & ~31;
            if (lane <= (j & 31)) {
                sel_e[t * k + base + lane] = chosen_e;
                sel_w[t * k + base + lane] = chosen_w;
            }
        }
    }
    __syncwarp();
    if (norm_topk && wsum > 0.0)
        for (int j = lane; j < k; j += 32)
            sel_w[t * k + j] = (float)(sel_w[t * k + j] / wsum);
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
    pdl_trigger();
    pdl_wait();
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

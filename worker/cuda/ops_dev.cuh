/* Device bodies of the small ops (ops.cu): RMSNorm's sum of squares, q/k-norm + RoPE + KV store,
 * decode attention, routing. The per-op kernels of ops.cu and the fused decode kernel (fused.cu)
 * both call these, so a value is computed with the same float operations whichever runs it:
 * what keeps the fused step bit-identical to the op-by-op one. A body takes the indices a
 * kernel would read from blockIdx (and, where a body spans several warps, its thread index in
 * its group and the barrier of the group), never the launch geometry. */
#ifndef MOE_CUDA_OPS_DEV_CUH
#define MOE_CUDA_OPS_DEV_CUH

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cuda_fp16.h>

#include "worker/cuda/argmax_dev.cuh"
#include "worker/cuda/launch.cuh"
#include "worker/cuda/ops.cuh"

/* Elements a lane holds of one head vector: head dims up to 32 · MAXD_LANE. */
#define MAXD_LANE 16
#define ATT_WARPS 4
#ifndef MOE_ATT_ILP
#define MOE_ATT_ILP 4
#endif
#define ATT_ILP MOE_ATT_ILP
#ifndef MOE_ATT_CHUNK
#define MOE_ATT_CHUNK 32
#endif
#define ATT_CHUNK MOE_ATT_CHUNK
/* Splits' values a thread of the merge loads at a time (attn_split_body). */
#define ATT_MERGE_V 8
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


/* ---------------------------------------------------------------- RMSNorm */

/* ss + the squares of four elements, one after the other. */
static __device__ __forceinline__ float ss_add4(float ss, float4 v)
{
    ss += v.x * v.x;
    ss += v.y * v.y;
    ss += v.z * v.z;
    ss += v.w * v.w;
    return ss;
}

/* Σ x[i]² over a row, by one warp in a fixed order (lane-strided, four elements at a time when
 * the row allows 16-byte loads, then a shuffle tree); every lane gets it. */
static __device__ __forceinline__ float row_ss_warp(const float *x, int64_t width)
{
    const int lane = threadIdx.x & 31;
    float ss = 0.0f;
    if (width % 4 == 0 && ((uintptr_t)x & 15) == 0) {
        const float4 *x4 = (const float4 *)x;
        const int64_t n4 = width / 4;
#pragma unroll 8
        for (int64_t i = lane; i < n4; i += 32)
            ss = ss_add4(ss, x4[i]);
    } else {
#pragma unroll 8
        for (int64_t i = lane; i < width; i += 32)
            ss += x[i] * x[i];
    }
    return warp_sum(ss);
}

/* The scale of a row: 1 / sqrt(mean(x²) + eps). */
static __device__ __forceinline__ float rms_scale(float ss, int64_t width, float eps)
{
    return 1.0f / sqrtf(ss / (float)width + eps);
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

/* EL consecutive elements of an f16 cache from base[idx] (idx a multiple of EL, base 16-byte
 * aligned), in loads of up to 16 bytes: a lane's share of a head row when the head is 32·EL wide
 * (attn_split_body's wide loads, which float32 caches do not take). */
template <int EL>
static __device__ __forceinline__ void kv_get_el(const void *base, size_t idx, float (&o)[EL])
{
    const __half *p = (const __half *)base + idx;
    if constexpr (EL % 8 == 0) {
#pragma unroll
        for (int j = 0; j < EL; j += 8) {
            const uint4 u = *(const uint4 *)(p + j);
            const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float2 f = __half22float2(*(const __half2 *)&w[k]);
                o[j + 2 * k] = f.x;
                o[j + 2 * k + 1] = f.y;
            }
        }
    } else if constexpr (EL == 4) {
        const uint2 u = *(const uint2 *)p;
        const float2 a = __half22float2(*(const __half2 *)&u.x),
                     b = __half22float2(*(const __half2 *)&u.y);
        o[0] = a.x;
        o[1] = a.y;
        o[2] = b.x;
        o[3] = b.y;
    } else if constexpr (EL == 2) {
        const float2 a = __half22float2(*(const __half2 *)p);
        o[0] = a.x;
        o[1] = a.y;
    } else {
#pragma unroll
        for (int j = 0; j < EL; j++)
            o[j] = __half2float(p[j]);
    }
}

/* One NEOX RoPE pair of a normalised head: x0, x1 (elements i and i + hd/2) scaled by sc and
 * their norm weights g0, g1, rotated by (c, sn). */
static __device__ __forceinline__ void rope_pair(float x0, float x1, float sc, float g0, float g1,
                                                 float c, float sn, float *o0, float *o1)
{
    const float a = x0 * sc * g0, b = x1 * sc * g1;
    *o0 = a * c - b * sn;
    *o1 = a * sn + b * c;
}

/* One head by one warp: y = NEOX RoPE(RMSNorm(src)·nw) with angles cs ([hd/2][2]); put(i, y[i],
 * i + hd/2, y[i + hd/2]) for i < hd/2. row: hd floats of this warp's shared memory (src may be
 * where put writes). Every float operation is the same wherever the head goes (q or k, the
 * standalone kernel or the fused step). */
template <bool CG = false, class Put>
static __device__ __forceinline__ void rope_head_warp(const float *src, const float *nw,
                                                      const float *cs, int64_t hd, float eps,
                                                      float *row, Put put)
{
    const int lane = threadIdx.x & 31;
    const int64_t half = hd / 2;
    float ss = 0.0f;
    for (int64_t i = lane; i < hd; i += 32) {
        float x = CG ? __ldcg(src + i) : src[i];
        row[i] = x;
        ss += x * x;
    }
    ss = warp_sum(ss);
    const float sc = 1.0f / sqrtf(ss / (float)hd + eps);
    __syncwarp();
    for (int64_t i = lane; i < half; i += 32) {
        float o0, o1;
        rope_pair(row[i], row[i + half], sc, nw[i], nw[i + half], cs[2 * i], cs[2 * i + 1], &o0,
                  &o1);
        put(i, o0, i + half, o1);
    }
    __syncwarp();
}

/* The KV cache cell of (layer, sequence, kv head, position). */
static __device__ __forceinline__ size_t kv_cell(const moe_cuda_kv &kv, int layer, int32_t seq,
                                                 int64_t kvh, int32_t pos)
{
    return (((size_t)layer * kv.n_seq + (size_t)seq) * kv.Hkv + (size_t)kvh) * kv.n_ctx +
           (size_t)pos;
}

/* Head hi of token t, by one warp: query heads 0..H-1, then key heads (which also store v).
 * row: hd floats of shared memory for this warp. CG: q, k and v are read past L1 (other
 * multiprocessors wrote them in the same launch). */
template <bool F32, bool CG = false>
static __device__ __forceinline__ void qk_rope_kv_warp(float *q, int64_t ldq, float *k, int64_t ldk,
                                                       const float *v, int64_t ldv,
                                                       const float *qn, const float *kn,
                                                       const float *rope, const int32_t *pos,
                                                       const int32_t *seq, const moe_cuda_kv &kv,
                                                       int layer, int64_t H, float eps, int64_t t,
                                                       int64_t hi, float *row,
                                                       const float *cs_row = nullptr)
{
    const int64_t hd = kv.hd;
    const bool isq = hi < H;
    float *vec = isq ? q + t * ldq + hi * hd : k + t * ldk + (hi - H) * hd;
    const float *cs = cs_row ? cs_row : rope + t * hd;
    if (isq) {
        rope_head_warp<CG>(vec, qn, cs, hd, eps, row, [&](int64_t i, float o0, int64_t j, float o1) {
            vec[i] = o0;
            vec[j] = o1;
        });
        return;
    }
    const int64_t kvh = hi - H;
    const size_t cell = kv_cell(kv, layer, seq[t], kvh, pos[t]);
    rope_head_warp<CG>(vec, kn, cs, hd, eps, row, [&](int64_t i, float o0, int64_t j, float o1) {
        vec[i] = o0;
        vec[j] = o1;
        kv_put<F32>(kv.k, cell * hd + i, o0);
        kv_put<F32>(kv.k, cell * hd + j, o1);
    });
    const int lane = threadIdx.x & 31;
    const float *vr = v + t * ldv + kvh * kv.hdv;
    for (int64_t i = lane; i < kv.hdv; i += 32)
        kv_put<F32>(kv.v, cell * kv.hdv + i, CG ? __ldcg(vr + i) : vr[i]);
    __syncwarp();
}

/* ---------------------------------------------------------------- attention */

/* Barriers of a group of ATT_WARPS warps: a whole block, or one of the halves of a block of
 * 2·ATT_WARPS warps (named barriers 1 and 2). */
struct att_sync_block {
    __device__ __forceinline__ void operator()() const { __syncthreads(); }
};
struct att_sync_named {
    int id;
    __device__ __forceinline__ void operator()() const
    {
        asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(32 * ATT_WARPS) : "memory");
    }
};

/* The shared memory of one attention group. */
struct att_smem {
    float m[ATT_WARPS], l[ATT_WARPS];
    int last;
};

/* The q/k-norm + RoPE + KV store of a one-token step, done inside its attention
 * (attn_split_body with ROPE): q and k are the q/k/v product's raw rows (q: the body's q), v its v
 * rows; qn, kn the norm weights, rope the angles; kdone [n][Hkv] counters (zero between
 * launches); rowf: floats of a warp's row in the body's acc (at least hd and hdv). */
struct att_rope_dev {
    float *q, *k;
    int64_t ldk;
    const float *v;
    int64_t ldv;
    const float *qn, *kn, *rope;
    float eps;
    unsigned *kdone;
    int64_t rowf;
};
static_assert(ATT_WARPS >= 2, "the folded RoPE takes a warp of the last split's group for k");

/* What the folded q/k-norm + RoPE leaves in the q and k rows, as the standalone kernel does.
 * attn_rope_store_q: head h's rotated q, by warp 0 of the group that finishes the head (every
 * group of the head has read the raw row by then). attn_rope_store_k: the k head's, by the last
 * of the H/Hkv k warps of its kv head to count itself in (each counts after it has read the raw
 * row). */
template <int EL>
static __device__ __forceinline__ void attn_rope_store_q(const att_rope_dev *rp, int64_t ldq,
                                                         int64_t hd, int64_t t, int64_t h,
                                                         int lane, const float (&qr)[EL])
{
#pragma unroll
    for (int i = 0; i < EL; i++) {
        const int64_t e = lane + 32 * i;
        if (e < hd)
            rp->q[t * ldq + h * hd + e] = qr[i];
    }
}

template <int EL>
static __device__ __forceinline__ void attn_rope_store_k(const att_rope_dev *rp,
                                                         const moe_cuda_kv &kv, int64_t t,
                                                         int64_t kvh, int64_t group, int lane,
                                                         const float (&kr)[EL])
{
    unsigned prev = 0;
    if (lane == 0) {
        __threadfence();
        prev = atomicAdd(&rp->kdone[t * kv.Hkv + kvh], 1u);
    }
    prev = __shfl_sync(0xffffffffu, prev, 0);
    if (prev + 1 != (unsigned)group)
        return;
#pragma unroll
    for (int i = 0; i < EL; i++) {
        const int64_t e = lane + 32 * i;
        if (e < kv.hd)
            rp->k[t * rp->ldk + kvh * kv.hd + e] = kr[i];
    }
    if (lane == 0)
        rp->kdone[t * kv.Hkv + kvh] = 0;
}

/* The positions of a token's split (attn_split_body): len positions cut into splits of
 * max(ATT_CHUNK, ceil(len / ATT_MAX_SPLITS)), or one split (split 0). */
static __device__ __forceinline__ int64_t attn_split_len(int64_t len, int split)
{
    int64_t C = (len + ATT_MAX_SPLITS - 1) / ATT_MAX_SPLITS;
    if (C < ATT_CHUNK)
        C = ATT_CHUNK;
    return split ? C : len;
}

/* Whether the decode attention of lane width EL reads cache kv with the wide loads: an f16
 * cache with kv.wide whose key and value heads are both 32·EL wide. */
static __host__ __device__ __forceinline__ bool att_wide_ok(const moe_cuda_kv &kv, int el)
{
    return !kv.f32 && kv.wide && kv.hd == 32 * (int64_t)el && kv.hdv == 32 * (int64_t)el;
}

/* Decode attention (flash-decoding) of head h, token t, split group z of Z, by ATT_WARPS warps
 * (tid: the thread's index in the group, 0..32·ATT_WARPS-1; sync: the group's barrier;
 * acc: ATT_WARPS·hdv floats of shared memory). A token's positions 0..len-1 are cut into splits
 * of C positions, C = max(ATT_CHUNK, ceil(len / ATT_MAX_SPLITS)): the cut depends on len alone,
 * never on the step. The group computes splits z, z + Z, ...: each warp walks every
 * ATT_WARPS-th group of ATT_ILP positions of the split with an online softmax (running max m,
 * sum l, unnormalised output in registers; the values of a group are loaded with its keys, before
 * the scores are known), the warps are merged into the
 * split's partial result ([hdv] unnormalised, m, l). The group that completes the last split of
 * a (token, head) (a counter per pair, reset by that group for the next step) merges the
 * partials in split order. A token with one split writes its output directly. Every float
 * operation of a token is the same whatever Z and whatever else is in the step. split 0: the
 * whole range is one split (prompt steps).
 * A lane holds head elements lane + 32·i, each key and value element loaded on its own; with
 * kv.wide (the default), an f16 cache whose key and value heads are both 32·EL wide, elements
 * lane·EL .. lane·EL + EL - 1 instead, their keys and values in 8- or 16-byte loads at a 32-bit
 * offset (fewer instructions a position; the dot products add the same terms in another order).
 * Each walk is its own instance (WIDE), so neither carries the other's code; att_wide_ok says
 * which one a cache takes. Positions and split bounds are ints: a context stays below 2^31
 * positions. */
template <bool F32, int EL, class Sync, bool ROPE = false, bool WIDE = false>
static __device__ __forceinline__ void
attn_split_body(const float *q, int64_t ldq, const int32_t *pos, const int32_t *seq,
                const moe_cuda_kv &kv, int layer, int64_t H, float scale, int split, float *part,
                unsigned *done, float *out, int64_t ldo, int64_t h, int64_t t, int z, int Z,
                int tid, att_smem *sm, float *sm_acc, Sync sync,
                const att_rope_dev *rp = nullptr)
{
    constexpr int NT = 32 * ATT_WARPS;
    const int lane = tid & 31, w = tid >> 5;
    const int64_t hd = kv.hd, hdv = kv.hdv;
    const int group = (int)H / (int)kv.Hkv, kvh = (int)h / group;
    const int len = pos[t] + 1, C = (int)attn_split_len(len, split);
    const int ns = (len + C - 1) / C;
    if (z >= ns)
        return;
    /* WIDE: the caller checked att_wide_ok. */
    static_assert(!(WIDE && F32), "the wide loads read f16 caches");
    /* The head element of a lane's i-th register. */
    const auto el_of = [&](int i) -> int64_t {
        return WIDE ? (int64_t)lane * EL + i : lane + 32 * i;
    };
    const size_t row0 = (((size_t)layer * kv.n_seq + (size_t)seq[t]) * kv.Hkv + (size_t)kvh) *
                        kv.n_ctx;
    float qv[EL], qr[EL] = {}, kr[EL] = {};
    bool kwarp = false;
    if constexpr (ROPE) {
        /* Every warp normalises and rotates the token's q head itself (rope_head_warp: the
         * standalone kernel's floats) into its row of acc. In the group with the last split, the
         * one that holds position pos[t], the last warp does the k head instead and stores the
         * position's k and v into the cache before any warp reads it; it takes q from warp 0. */
        const bool lastb = (ns - 1) % Z == z;
        kwarp = lastb && w == ATT_WARPS - 1;
        float *row = sm_acc + (size_t)w * rp->rowf;
        const float *cs = rp->rope + t * hd;
        if (!kwarp) {
            rope_head_warp(q + t * ldq + h * hd, rp->qn, cs, hd, rp->eps, row,
                           [&](int64_t i, float o0, int64_t j, float o1) {
                               row[i] = o0;
                               row[j] = o1;
                           });
        } else {
            const size_t cell = kv_cell(kv, layer, seq[t], kvh, pos[t]);
            rope_head_warp(rp->k + t * rp->ldk + kvh * hd, rp->kn, cs, hd, rp->eps, row,
                           [&](int64_t i, float o0, int64_t j, float o1) {
                               row[i] = o0;
                               row[j] = o1;
                               kv_put<F32>(kv.k, cell * hd + i, o0);
                               kv_put<F32>(kv.k, cell * hd + j, o1);
                           });
            const float *vr = rp->v + t * rp->ldv + kvh * hdv;
            for (int64_t i = lane; i < hdv; i += 32)
                kv_put<F32>(kv.v, cell * hdv + i, vr[i]);
#pragma unroll
            for (int i = 0; i < EL; i++) {
                const int64_t e = lane + 32 * i;
                kr[i] = e < hd ? row[e] : 0.0f;
            }
        }
        if (lastb)
            sync(); /* the position's k and v, and warp 0's q, are visible to the group */
        const float *qrow = sm_acc + (size_t)(kwarp ? 0 : w) * rp->rowf;
#pragma unroll
        for (int i = 0; i < EL; i++) {
            const int64_t e = lane + 32 * i, ev = el_of(i);
            qr[i] = e < hd ? qrow[e] : 0.0f;
            qv[i] = ev < hd ? qrow[ev] * scale : 0.0f;
        }
    } else {
#pragma unroll
        for (int i = 0; i < EL; i++) {
            const int64_t e = el_of(i);
            qv[i] = e < hd ? q[t * ldq + h * hd + e] * scale : 0.0f;
        }
    }
    float *pp = part + (t * H + h) * ATT_MAX_SPLITS * (hdv + 2);
    /* The lane's first element of position 0's key and value rows (the wide layout). */
    const size_t kl = row0 * hd + (size_t)lane * EL, vl = row0 * hdv + (size_t)lane * EL;
    int mine = 0;
    for (int sp = z; sp < ns; sp += Z, mine++) {
        const int p0 = sp * C, p1 = p0 + C < len ? p0 + C : len;
        float acc[EL];
#pragma unroll
        for (int i = 0; i < EL; i++)
            acc[i] = 0.0f;
        float m = -INFINITY, l = 0.0f;
        for (int pb = p0 + w * ATT_ILP; pb < p1; pb += ATT_WARPS * ATT_ILP) {
            float sd[ATT_ILP], vv[ATT_ILP][EL];
            if constexpr (WIDE) {
#pragma unroll
                for (int c = 0; c < ATT_ILP; c++) {
                    const unsigned p = (unsigned)(pb + c < p1 ? pb + c : pb);
                    float kf[EL];
                    kv_get_el<EL>(kv.k, kl + p * (unsigned)hd, kf);
                    kv_get_el<EL>(kv.v, vl + p * (unsigned)hdv, vv[c]);
                    float d = 0.0f;
#pragma unroll
                    for (int i = 0; i < EL; i++)
                        d += qv[i] * kf[i];
                    sd[c] = d;
                }
            } else {
#pragma unroll
                for (int c = 0; c < ATT_ILP; c++) {
                    const int p = pb + c < p1 ? pb + c : pb;
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
        sync(); /* the previous split's merge is done with the shared arrays */
        if (lane == 0) {
            sm->m[w] = m;
            sm->l[w] = l;
        }
#pragma unroll
        for (int i = 0; i < EL; i++) {
            const int64_t e = el_of(i);
            if (e < hdv)
                sm_acc[w * hdv + e] = acc[i];
        }
        sync();
        float M = -INFINITY;
        for (int j = 0; j < ATT_WARPS; j++)
            M = fmaxf(M, sm->m[j]);
        float L = 0.0f;
        for (int j = 0; j < ATT_WARPS; j++)
            if (sm->m[j] != -INFINITY)
                L += sm->l[j] * __expf(sm->m[j] - M);
        if (ns == 1) {
            const float inv = 1.0f / L;
            for (int64_t e = tid; e < hdv; e += NT) {
                float o = 0.0f;
                for (int j = 0; j < ATT_WARPS; j++)
                    if (sm->m[j] != -INFINITY)
                        o += sm_acc[j * hdv + e] * __expf(sm->m[j] - M);
                out[t * ldo + h * hdv + e] = o * inv;
            }
            if constexpr (ROPE) {
                if (kwarp)
                    attn_rope_store_k(rp, kv, t, kvh, group, lane, kr);
                else if (w == 0)
                    attn_rope_store_q(rp, ldq, hd, t, h, lane, qr);
            }
            sync(); /* the shared arrays are free for the group's next use */
            return;
        }
        float *ps = pp + sp * (hdv + 2);
        for (int64_t e = tid; e < hdv; e += NT) {
            float o = 0.0f;
            for (int j = 0; j < ATT_WARPS; j++)
                if (sm->m[j] != -INFINITY)
                    o += sm_acc[j * hdv + e] * __expf(sm->m[j] - M);
            ps[e] = o;
        }
        if (tid == 0) {
            ps[hdv] = M;
            ps[hdv + 1] = L;
        }
    }
    /* Publish the partials, then count this group's splits in: the group's barrier orders its
     * stores before thread 0's count, a release at GPU scope (cumulative over what the barrier
     * made it observe), and the count is an acquire for the group that completes it, whose
     * barrier below passes that on to its other threads. */
    sync();
    if (tid == 0) {
        unsigned prev = atomic_add_acq_rel_gpu(&done[t * H + h], (unsigned)mine);
        sm->last = prev + (unsigned)mine == (unsigned)ns;
    }
    if constexpr (ROPE)
        if (kwarp)
            attn_rope_store_k(rp, kv, t, kvh, group, lane, kr);
    sync();
    if (!sm->last)
        return;
    if constexpr (ROPE)
        if (w == 0)
            attn_rope_store_q(rp, ldq, hd, t, h, lane, qr);
    /* The merge, by every warp on its own (no barrier): the split weights and their sum (lane i
     * holds splits i and i + 32: ns <= ATT_MAX_SPLITS = 64), then each output element summed
     * over the splits in split order, split s's weight taken from lane s % 32. The values of a
     * thread's first ATT_MERGE_V splits are loaded with the weights' inputs, in one round trip. */
    static_assert(ATT_MAX_SPLITS == 64, "two splits a lane");
    const size_t pst = (size_t)hdv + 2;
    float v0[ATT_MERGE_V];
#pragma unroll
    for (int j = 0; j < ATT_MERGE_V; j++)
        v0[j] = tid < hdv && j < ns ? __ldcg(pp + j * pst + tid) : 0.0f;
    float ms[2], ls[2], wt[2];
    float gm = -INFINITY;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int s2 = lane + 32 * i;
        ms[i] = s2 < ns ? __ldcg(pp + s2 * pst + hdv) : -INFINITY;
        ls[i] = s2 < ns ? __ldcg(pp + s2 * pst + hdv + 1) : 0.0f;
        gm = fmaxf(gm, ms[i]);
    }
    gm = warp_max(gm);
    float gl = 0.0f;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        wt[i] = ms[i] != -INFINITY ? __expf(ms[i] - gm) : 0.0f;
        gl += ls[i] * wt[i];
    }
    gl = warp_sum(gl);
    const float inv = 1.0f / gl;
    /* Every lane of a warp takes the same trips (the shuffles), the elements past hdv none of the
     * loads. */
    const auto add = [&](float &o, int s0, const float(&v)[ATT_MERGE_V]) {
#pragma unroll
        for (int j = 0; j < ATT_MERGE_V; j++) {
            const int s2 = s0 + j;
            if (s2 < ns)
                o += v[j] * __shfl_sync(0xffffffffu, s2 < 32 ? wt[0] : wt[1], s2 & 31);
        }
    };
    for (int64_t eb = 0; eb < hdv; eb += NT) {
        const int64_t e = eb + tid;
        float o = 0.0f;
        int s0 = 0;
        if (eb == 0) {
            add(o, 0, v0);
            s0 = ATT_MERGE_V;
        }
        for (; s0 < ns; s0 += ATT_MERGE_V) {
            float v[ATT_MERGE_V];
#pragma unroll
            for (int j = 0; j < ATT_MERGE_V; j++)
                v[j] = e < hdv && s0 + j < ns ? __ldcg(pp + (s0 + j) * pst + e) : 0.0f;
            add(o, s0, v);
        }
        if (e < hdv)
            out[t * ldo + h * hdv + e] = o * inv;
    }
    if (tid == 0)
        done[t * H + h] = 0;
    sync(); /* the shared arrays are free for the group's next use */
}

/* ---------------------------------------------------------------- routing */

/* One warp routes one token: logits row r (nexp values) → sel_e / sel_w [k] (any memory this
 * warp may write; renormalised in place), counts[e] incremented for each choice when counts is
 * not NULL.
 * p: nexp floats of shared memory. The CPU's rule for the top-k scan (lowest index first): the
 * best is replaced by a larger probability, or whenever the best so far is NaN. So among the
 * untaken experts a non-NaN maximum (lowest index on ties) wins; when all are NaN, the last one.
 * Sums in double, as on the CPU. */
/* The warp's choice from each lane's best untaken probability (best.i < 0: none) and its last NaN
 * (-1: none): probabilities are >= +0 or NaN (never negative), so for the valid ones the float
 * bits order as the values; the largest bits, then the lowest index among the lanes that hold
 * them (two warp reductions). When every lane has only NaNs left, the highest NaN index, its
 * value from nan_value(index) (called by the whole warp). */
template <class NanValue>
static __device__ __forceinline__ vi warp_pick(vi best, int last_nan, NanValue nan_value)
{
    const unsigned key = best.i >= 0 ? __float_as_uint(best.v) + 1u : 0u;
    const unsigned mk = __reduce_max_sync(0xffffffffu, key);
    if (mk) {
        best.i = (int)__reduce_min_sync(0xffffffffu, key == mk ? (unsigned)best.i : ~0u);
        best.v = __uint_as_float(mk - 1u);
    } else {
        best.i = (int)__reduce_max_sync(0xffffffffu, (unsigned)(last_nan + 1)) - 1;
        best.v = nan_value(best.i);
    }
    return best;
}

/* The softmax of route_warp: logits row r into p as probabilities. */
static __device__ __forceinline__ void route_softmax_warp(const float *r, int ne, float *p)
{
    const int lane = threadIdx.x & 31;
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
}

/* The end of a warp's top-k once all k choices are stored in sel_e / sel_w as they were picked:
 * the weights renormalised by their double sum wsum (norm_topk), then the counters, all choices
 * at once (integer adds, so their order does not matter, and one round trip instead of one per
 * choice). */
static __device__ __forceinline__ void route_finish_warp(int k, bool norm_topk, double wsum,
                                                         int32_t *sel_e, float *sel_w,
                                                         unsigned long long *counts)
{
    const int lane = threadIdx.x & 31;
    __syncwarp();
    if (norm_topk && wsum > 0.0)
        for (int j = lane; j < k; j += 32)
            sel_w[j] = (float)(sel_w[j] / wsum);
    if (counts)
        for (int j = lane; j < k; j += 32)
            atomicAdd(&counts[sel_e[j]], 1ull);
    __syncwarp();
}

/* The top-k of route_warp over the probabilities p (route_softmax_warp), which it consumes. */
static __device__ __forceinline__ void route_topk_warp(int ne, int k, bool norm_topk,
                                                       int32_t *sel_e, float *sel_w,
                                                       unsigned long long *counts, float *p)
{
    const int lane = threadIdx.x & 31;
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
        best = warp_pick(best, last_nan, [&](int i) { return p[i]; });
        __syncwarp();
        if (lane == 0)
            p[best.i] = -1.0f;
        if (lane == (j & 31)) {
            chosen_w = best.v;
            chosen_e = best.i;
        }
        __syncwarp();
        wsum += best.v;
        if ((j & 31) == 31 || j == k - 1) {
            /* Lanes 0..(j & 31) hold choices j & ~31 .. j. */
            int base = j & ~31;
            if (lane <= (j & 31)) {
                sel_e[base + lane] = chosen_e;
                sel_w[base + lane] = chosen_w;
            }
        }
    }
    route_finish_warp(k, norm_topk, wsum, sel_e, sel_w, counts);
}

/* Shared floats one routing warp needs when it also keeps its k choices there (p, then sel_e and
 * sel_w). */
static __host__ __device__ __forceinline__ int route_smem_floats(int nexp, int k)
{
    return (nexp + 2 * k + 3) & ~3;
}

/* The host builds of these helpers (tests/test_route_host.cu) take no unrolling pragma. */
#ifdef __CUDA_ARCH__
#define ROUTE_UNROLL _Pragma("unroll")
#else
#define ROUTE_UNROLL
#endif

/* The top-k of route_warp_reg as a merge of the lanes' sorted lists. A lane's probability p of
 * expert idx as a key that orders as the CPU's scan prefers (moe_topk_argmax: the largest first,
 * the lowest index on ties; NaNs after every number, the highest index first; taken or absent,
 * marked -1, last): (the bits of p + 1, 0xffff − idx) for a number (probabilities are >= +0, so
 * their bits order as their values), idx + 1 for a NaN, 0 for -1. */
static __host__ __device__ __forceinline__ unsigned long long route_key(float p, int idx)
{
    uint32_t bits;
    memcpy(&bits, &p, sizeof bits);
    return p == -1.0f ? 0ull
           : p != p   ? (unsigned long long)(idx + 1)
                      : (unsigned long long)(bits + 1u) << 32 | (unsigned)(0xffff - idx);
}

/* A lane's R keys sorted, the largest first (odd-even transposition). */
template <int R> static __host__ __device__ __forceinline__ void route_sort_keys(unsigned long long *key)
{
ROUTE_UNROLL
    for (int r = 0; r < R; r++)
ROUTE_UNROLL
        for (int i = r & 1; i + 1 < R; i += 2) {
            const unsigned long long a = key[i], b = key[i + 1];
            key[i] = a > b ? a : b;
            key[i + 1] = a > b ? b : a;
        }
}

/* A round's choice from the warp's largest head number mk (the high words' maximum) and lm, the
 * largest low word among the heads whose high word is mk: the lowest index among the largest
 * numbers; when no lane has a number left (mk 0), the highest NaN index (-1: nothing left). */
static __host__ __device__ __forceinline__ int route_head_index(unsigned mk, unsigned lm)
{
    return mk ? 0xffff - (int)lm : (int)lm - 1;
}

/* The winner's list advances. */
template <int R> static __host__ __device__ __forceinline__ void route_pop(unsigned long long *key)
{
ROUTE_UNROLL
    for (int i = 0; i + 1 < R; i++)
        key[i] = key[i + 1];
    key[R - 1] = 0ull;
}

/* The default of route_warp's after_loads: nothing. */
struct route_no_hook {
    __device__ void operator()() const {}
};

/* route_warp for nexp <= 32·R with the probabilities in registers (lane l holds experts l, l + 32,
 * ...): the same choices and floats as route_softmax_warp + route_topk_warp, without shared
 * memory, and for k <= 32 without reading back what it wrote. after_loads() runs once the row's
 * loads are issued (before their values are used): a caller's own loads put in flight there
 * queue behind them. */
template <int R, class Hook = route_no_hook>
static __device__ __forceinline__ void route_warp_reg(const float *r, int ne, int k, bool norm_topk,
                                                      int32_t *sel_e, float *sel_w,
                                                      unsigned long long *counts,
                                                      const Hook &after_loads = Hook{})
{
    const int lane = threadIdx.x & 31;
    float v[R];
#pragma unroll
    for (int i = 0; i < R; i++)
        v[i] = lane + 32 * i < ne ? r[lane + 32 * i] : 0.0f;
    after_loads();
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < R; i++)
        if (lane + 32 * i < ne)
            mx = fmaxf(mx, v[i]);
    mx = warp_max(mx);
    double z = 0.0;
#pragma unroll
    for (int i = 0; i < R; i++)
        if (lane + 32 * i < ne) {
            const float e = expf(v[i] - mx);
            v[i] = e;
            z += e;
        }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        z += __shfl_xor_sync(0xffffffffu, z, o);
    /* Taken experts (and the slots past ne) hold -1, which no probability equals. */
#pragma unroll
    for (int i = 0; i < R; i++)
        v[i] = lane + 32 * i < ne ? (float)(v[i] / z) : -1.0f;
    /* The top-k as a merge of the lanes' sorted lists (route_key): each lane orders its R
     * probabilities once, so that its head is what a scan of its untaken ones would offer, and
     * each round takes the warp's choice among the heads and advances the winner's list. The
     * same choices and weights as k rounds of scanning, in a shorter chain. */
    unsigned long long key[R];
#pragma unroll
    for (int i = 0; i < R; i++)
        key[i] = route_key(v[i], lane + 32 * i);
    route_sort_keys<R>(key);
    double wsum = 0.0;
    float chosen_w = 0.0f;
    int chosen_e = 0;
    for (int j = 0; j < k; j++) {
        const unsigned hk = (unsigned)(key[0] >> 32), lo = (unsigned)key[0];
        const unsigned mk = __reduce_max_sync(0xffffffffu, hk);
        /* With mk 0 every head's high word is 0 too, so lm is then the largest low word. */
        const unsigned lm = __reduce_max_sync(0xffffffffu, hk == mk ? lo : 0u);
        vi best;
        best.i = route_head_index(mk, lm);
        if (mk) {
            best.v = __uint_as_float(mk - 1u);
        } else {
            float mine = 0.0f;
#pragma unroll
            for (int i = 0; i < R; i++)
                if (lane + 32 * i == best.i)
                    mine = v[i];
            best.v = __shfl_sync(0xffffffffu, mine, best.i & 31);
        }
        if (best.i >= 0 && lane == (best.i & 31))
            route_pop<R>(key);
        if (lane == (j & 31)) {
            chosen_w = best.v;
            chosen_e = best.i;
        }
        wsum += best.v;
        if (k > 32 && (j & 31) == 31 && j != k - 1) {
            /* More than 32 choices: lanes 0..31 hold choices j - 31 .. j, stored as they are
             * and renormalised below. */
            sel_e[(j & ~31) + lane] = chosen_e;
            sel_w[(j & ~31) + lane] = chosen_w;
        }
    }
    const int base = (k - 1) & ~31;
    if (lane <= ((k - 1) & 31)) {
        sel_e[base + lane] = chosen_e;
        sel_w[base + lane] = k <= 32 && norm_topk && wsum > 0.0 ? (float)(chosen_w / wsum)
                                                                : chosen_w;
        if (k <= 32 && counts)
            atomicAdd(&counts[chosen_e], 1ull);
    }
    if (k > 32)
        route_finish_warp(k, norm_topk, wsum, sel_e, sel_w, counts);
    __syncwarp();
}

/* p: shared memory for nexp floats, used only when nexp > 256 (registers hold fewer).
 * after_loads: as route_warp_reg's (at the start for more than 256 experts). */
template <class Hook = route_no_hook>
static __device__ __forceinline__ void route_warp(const float *r, int ne, int k, bool norm_topk,
                                                  int32_t *sel_e, float *sel_w,
                                                  unsigned long long *counts, float *p,
                                                  const Hook &after_loads = Hook{})
{
    if (ne <= 128) {
        route_warp_reg<4>(r, ne, k, norm_topk, sel_e, sel_w, counts, after_loads);
    } else if (ne <= 256) {
        route_warp_reg<8>(r, ne, k, norm_topk, sel_e, sel_w, counts, after_loads);
    } else {
        after_loads();
        route_softmax_warp(r, ne, p);
        route_topk_warp(ne, k, norm_topk, sel_e, sel_w, counts, p);
    }
}

#endif

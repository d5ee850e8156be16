/* Causal attention of prompt-sized steps on tensor cores (see attn_mma.cuh, docs/cuda.md).
 *
 * One thread block takes 64 consecutive tokens of the step and one query head; each of its four
 * warps owns 16 of the tokens. The warp's queries are rounded to f16 once, into mma A fragments
 * (16 × D). Keys and values come in tiles of 64 positions, staged in shared memory by the whole
 * block; per tile a warp computes S = Q·Kᵀ (16 × 64, m16n8k16 mma with f32 sums), masks it
 * (a key counts for a token when it belongs to the token's sequence and is not after it), updates
 * the running row maxima and sums (online softmax in the exp2 domain), rounds P to f16 in
 * registers, where the S fragment layout is already the A fragment layout of P·V, and adds P·V
 * (V fragments by ldmatrix.trans) to its f32 output fragments. The end divides by the row sums.
 *
 * The tokens of a block may belong to several sequences (prompt chunks share steps): the block
 * walks the sequences it holds, in order of first appearance, and for each the key tiles from 0
 * to the largest position it holds of it. Tiles start at multiples of 64 whatever the step, a
 * tile with no key for a token leaves that token's state bit for bit unchanged (its scores are
 * -inf, its probabilities 0, its rescale factor 1), and each output row is its own sums, so a
 * token's result does not depend on the other tokens of the step or on how a prompt is cut into
 * steps. Positions past the largest one of a sequence are staged as zeros, so stale cache bytes
 * never meet the products. */
#include "worker/cuda/attn_mma.cuh"

#include <errno.h>
#include <math.h>

#include <cuda_fp16.h>

extern "C" {
#include "store/err.h"
}
#include "worker/cuda/cuda_check.cuh"
#include "worker/cuda/launch.cuh"

#define AM_ROWS 64  /* tokens per block */
#define AM_KEYS 64  /* positions per key tile */
#define AM_WARPS 4
/* Halves of padding per staged row: the 8 rows a fragment load reads lie in distinct banks. */
#define AM_PAD 8

static __device__ __forceinline__ uint32_t pack_half2(float lo, float hi)
{
    __half2 h = __floats2half2_rn(lo, hi);
    return *(uint32_t *)&h;
}

static __device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], const uint32_t b[2])
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

static __device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const __half *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((uint32_t)__cvta_generic_to_shared(p))
                 : "memory");
}

template <int D>
static __global__ void __launch_bounds__(32 * AM_WARPS)
attn_mma_kernel(const float *__restrict__ q, int64_t ldq, const int32_t *__restrict__ pos,
                const int32_t *__restrict__ seq, moe_cuda_kv kv, int layer, int64_t H, int64_t n,
                float scale_log2, float *__restrict__ out, int64_t ldo)
{
    constexpr int LD = D + AM_PAD, KS = D / 16, NT = D / 8, CH = D / 8;
    extern __shared__ __align__(16) unsigned char am_smem[];
    __half *Ks = (__half *)am_smem, *Vs = Ks + AM_KEYS * LD;
    __shared__ int32_t r_seq[AM_ROWS], r_pos[AM_ROWS], d_seq[AM_ROWS], d_max[AM_ROWS];
    __shared__ int n_d;

    pdl_wait();
    pdl_trigger();
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, c = lane & 3;
    const int64_t t0 = (int64_t)blockIdx.x * AM_ROWS, h = blockIdx.y;
    const int64_t kvh = h / (H / kv.Hkv);
    if (tid < AM_ROWS) {
        const int64_t t = t0 + tid;
        r_seq[tid] = t < n ? seq[t] : -1;
        r_pos[tid] = t < n ? pos[t] : -1;
    }
    __syncthreads();
    if (tid == 0) {
        /* The sequences of the block's tokens, in order of first appearance, with the largest
         * position of each. */
        int nd = 0;
        for (int r = 0; r < AM_ROWS; r++) {
            if (r_seq[r] < 0)
                continue;
            int j = 0;
            while (j < nd && d_seq[j] != r_seq[r])
                j++;
            if (j == nd) {
                d_seq[nd] = r_seq[r];
                d_max[nd++] = r_pos[r];
            } else if (r_pos[r] > d_max[j]) {
                d_max[j] = r_pos[r];
            }
        }
        n_d = nd;
    }
    /* This lane's two rows (g and g + 8 of the warp's 16) and their queries as A fragments. */
    const int ra = w * 16 + g, rb = ra + 8;
    uint32_t qa[KS][4];
    {
        const int64_t ta = t0 + ra, tb = t0 + rb;
        const float *qra = q + ta * ldq + h * D, *qrb = q + tb * ldq + h * D;
        const bool va = ta < n, vb = tb < n;
#pragma unroll
        for (int k = 0; k < KS; k++) {
            const int d0 = 16 * k + 2 * c;
            float2 x0 = va ? *(const float2 *)(qra + d0) : make_float2(0.f, 0.f);
            float2 x1 = vb ? *(const float2 *)(qrb + d0) : make_float2(0.f, 0.f);
            float2 x2 = va ? *(const float2 *)(qra + d0 + 8) : make_float2(0.f, 0.f);
            float2 x3 = vb ? *(const float2 *)(qrb + d0 + 8) : make_float2(0.f, 0.f);
            qa[k][0] = pack_half2(x0.x, x0.y);
            qa[k][1] = pack_half2(x1.x, x1.y);
            qa[k][2] = pack_half2(x2.x, x2.y);
            qa[k][3] = pack_half2(x3.x, x3.y);
        }
    }
    float o[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
        o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    __syncthreads();
    const int nd = n_d;
    const __half *kc = (const __half *)kv.k, *vc = (const __half *)kv.v;
    for (int di = 0; di < nd; di++) {
        const int32_t sq = d_seq[di], kmax = d_max[di];
        const int32_t pa = r_seq[ra] == sq ? r_pos[ra] : -1, pb = r_seq[rb] == sq ? r_pos[rb] : -1;
        /* The warp's last position of this sequence (-1: none of its tokens is in it). */
        int32_t wmax = max(pa, pb);
#pragma unroll
        for (int x = 16; x > 0; x >>= 1)
            wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, x));
        const size_t row0 = (((size_t)layer * kv.n_seq + (size_t)sq) * kv.Hkv + (size_t)kvh) *
                            kv.n_ctx;
        for (int32_t kb = 0; kb <= kmax; kb += AM_KEYS) {
            __syncthreads(); /* the previous tile is consumed */
            for (int i = tid; i < AM_KEYS * CH; i += 32 * AM_WARPS) {
                const int r = i / CH, ch = i % CH;
                const int32_t p = kb + r;
                uint4 kx = make_uint4(0, 0, 0, 0), vx = make_uint4(0, 0, 0, 0);
                if (p <= kmax) {
                    kx = *(const uint4 *)(kc + (row0 + (size_t)p) * D + ch * 8);
                    vx = *(const uint4 *)(vc + (row0 + (size_t)p) * D + ch * 8);
                }
                *(uint4 *)(Ks + r * LD + ch * 8) = kx;
                *(uint4 *)(Vs + r * LD + ch * 8) = vx;
            }
            __syncthreads();
            if (wmax < kb)
                continue; /* no token of this warp sees this tile: its state stays as it is */
            /* S = Q·Kᵀ: 8 tiles of 8 keys. */
            float s[AM_KEYS / 8][4];
#pragma unroll
            for (int j = 0; j < AM_KEYS / 8; j++) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
                const __half *kr = Ks + (8 * j + g) * LD + 2 * c;
#pragma unroll
                for (int k = 0; k < KS; k++) {
                    uint32_t b[2] = {*(const uint32_t *)(kr + 16 * k),
                                     *(const uint32_t *)(kr + 16 * k + 8)};
                    mma16816(s[j], qa[k], b);
                }
            }
            /* Mask, scale to the exp2 domain, row maxima. */
            float mx[2] = {m[0], m[1]};
#pragma unroll
            for (int j = 0; j < AM_KEYS / 8; j++) {
                const int32_t p0 = kb + 8 * j + 2 * c;
                s[j][0] = p0 <= pa ? s[j][0] * scale_log2 : -INFINITY;
                s[j][1] = p0 + 1 <= pa ? s[j][1] * scale_log2 : -INFINITY;
                s[j][2] = p0 <= pb ? s[j][2] * scale_log2 : -INFINITY;
                s[j][3] = p0 + 1 <= pb ? s[j][3] * scale_log2 : -INFINITY;
                mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
                mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
            }
#pragma unroll
            for (int x = 1; x < 4; x <<= 1) {
                mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], x));
                mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], x));
            }
            /* A row with no key yet keeps max -inf; its probabilities are exp2(-inf) = 0. */
            const float ua = mx[0] == -INFINITY ? 0.0f : mx[0];
            const float ub = mx[1] == -INFINITY ? 0.0f : mx[1];
            const float ca = exp2f(m[0] - ua), cb = exp2f(m[1] - ub);
            m[0] = mx[0];
            m[1] = mx[1];
            float sa = 0.0f, sb = 0.0f;
            uint32_t pf[AM_KEYS / 16][4];
#pragma unroll
            for (int j = 0; j < AM_KEYS / 8; j++) {
                const float e0 = exp2f(s[j][0] - ua), e1 = exp2f(s[j][1] - ua);
                const float e2 = exp2f(s[j][2] - ub), e3 = exp2f(s[j][3] - ub);
                sa += e0 + e1;
                sb += e2 + e3;
                pf[j / 2][(j & 1) * 2 + 0] = pack_half2(e0, e1);
                pf[j / 2][(j & 1) * 2 + 1] = pack_half2(e2, e3);
            }
            l[0] = l[0] * ca + sa;
            l[1] = l[1] * cb + sb;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                o[j][0] *= ca;
                o[j][1] *= ca;
                o[j][2] *= cb;
                o[j][3] *= cb;
            }
            /* O += P·V: per 16 keys, V fragments of two 8-wide output tiles per ldmatrix. */
#pragma unroll
            for (int k = 0; k < AM_KEYS / 16; k++) {
                const int mi = lane >> 3, rr = lane & 7;
                const __half *vr = Vs + (16 * k + (mi & 1) * 8 + rr) * LD + (mi >> 1) * 8;
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    uint32_t r4[4];
                    ldsm_x4_trans(r4, vr + 8 * j);
                    uint32_t b0[2] = {r4[0], r4[1]}, b1[2] = {r4[2], r4[3]};
                    mma16816(o[j], pf[k], b0);
                    mma16816(o[j + 1], pf[k], b1);
                }
            }
        }
    }
    /* The row sums over the four lanes of a row, then the normalised output. */
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
        l[0] += __shfl_xor_sync(0xffffffffu, l[0], x);
        l[1] += __shfl_xor_sync(0xffffffffu, l[1], x);
    }
    const int64_t ta = t0 + ra, tb = t0 + rb;
    const float ia = l[0] > 0.0f ? 1.0f / l[0] : 0.0f, ib = l[1] > 0.0f ? 1.0f / l[1] : 0.0f;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int d0 = 8 * j + 2 * c;
        if (ta < n)
            *(float2 *)(out + ta * ldo + h * D + d0) = make_float2(o[j][0] * ia, o[j][1] * ia);
        if (tb < n)
            *(float2 *)(out + tb * ldo + h * D + d0) = make_float2(o[j][2] * ib, o[j][3] * ib);
    }
}

bool moe_cuda_attention_mma_supported(const struct moe_cuda_kv *kv)
{
    return kv && !kv->f32 && kv->hd == kv->hdv && (kv->hd == 64 || kv->hd == 128);
}

template <int D>
static cudaError_t launch_mma(const float *d_q, int64_t ldq, const int32_t *d_pos,
                              const int32_t *d_seq, const struct moe_cuda_kv *kv, int layer,
                              int64_t H, int64_t n, float scale_log2, float *d_out, int64_t ldo,
                              cudaStream_t s)
{
    constexpr size_t smem = sizeof(__half) * 2 * AM_KEYS * (D + AM_PAD);
    static_assert(smem <= 48 * 1024, "the K and V tiles fit the default dynamic shared memory");
    dim3 grid((unsigned)((n + AM_ROWS - 1) / AM_ROWS), (unsigned)H);
    return moe_launch(attn_mma_kernel<D>, grid, dim3(32 * AM_WARPS), smem, s, d_q, ldq, d_pos,
                      d_seq, *kv, layer, H, n, scale_log2, d_out, ldo);
}

int moe_cuda_attention_mma(const float *d_q, int64_t ldq, const int32_t *d_pos,
                           const int32_t *d_seq, const struct moe_cuda_kv *kv, int layer,
                           int64_t H, int64_t n, float *d_out, int64_t ldo, cudaStream_t s)
{
    if (n <= 0)
        return 0;
    if (!moe_cuda_attention_mma_supported(kv) || !d_q || !d_pos || !d_seq || !d_out ||
        kv->Hkv <= 0 || H % kv->Hkv != 0 || H > 65535 || ldq % 2 != 0 || ldo % 2 != 0 ||
        ((uintptr_t)d_q & 7) || ((uintptr_t)d_out & 7) || ((uintptr_t)kv->k & 15) ||
        ((uintptr_t)kv->v & 15))
        return -EINVAL;
    const float scale_log2 = (float)(1.0 / sqrt((double)kv->hd) * 1.4426950408889634);
    cudaError_t e = kv->hd == 64
                        ? launch_mma<64>(d_q, ldq, d_pos, d_seq, kv, layer, H, n, scale_log2,
                                         d_out, ldo, s)
                        : launch_mma<128>(d_q, ldq, d_pos, d_seq, kv, layer, H, n, scale_log2,
                                          d_out, ldo, s);
    MOE_CUDA_TRY(e);
    return 0;
}

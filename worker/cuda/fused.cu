/* The fused decode step (see fused.cuh).
 *
 * A one-token step is latency-bound: every op reads a few megabytes at most, and as separate
 * kernels each pays a launch, a ramp-up and a drain, with its first loads issued only once the
 * kernel before has finished. Here one kernel of FUSED_THREADS-thread blocks, all resident, walks
 * the layers; between phases the blocks meet at a grid barrier (one counter, an atomic add per
 * block and an acquire spin). Per layer:
 *
 *   A  attention RMSNorm       blocks with a slice of X: one warp sums the squares, the block
 *                              writes its slice                                       | barrier
 *   B  q, k, v mat-vecs        warps take row groups of the three matrices            | barrier
 *   C  q/k-norm, RoPE, KV      one warp per head                                      | barrier
 *   D  attention               two groups of ATT_WARPS warps per block take (head, split
 *                              group) pairs; the group completing a head's last split merges
 *                              it                                                     | barrier
 *   E  o mat-vec += residual                                                          | barrier
 *   F  FFN RMSNorm (+ G)       router from shared memory when its rows are float32: each block
 *                              with router rows normalises the row into shared memory itself
 *   G  router mat-vec                                                                 | barrier
 *   H  routing + gate/up       every block routes the token itself (the same warp code, so the
 *                              same choices), block 0 also counts and stores them; warps take
 *                              (expert, row group) pairs                              | barrier
 *   I  down + combine + residual, one block per 16 rows                                | barrier
 *
 * Before a barrier a block prefetches into L2 the weight rows it reads next (the next phase's
 * dense rows; in H the down rows of the chosen experts), so the next phase's first loads are L2
 * hits. Activations are read with ordinary loads (never the read-only path): every barrier's
 * acquire makes the other blocks' writes visible. */
#include "worker/cuda/fused.cuh"

#include <errno.h>

extern "C" {
#include "store/err.h"
#include "store/ggml_type.h"
}
#include "worker/cuda/cuda_check.cuh"
#include "worker/cuda/experts_dev.cuh"
#include "worker/cuda/launch.cuh"
#include "worker/cuda/mv_warp.cuh"
#include "worker/cuda/ops_dev.cuh"

#define FUSED_WARPS 8
#define FUSED_THREADS (32 * FUSED_WARPS)
#define FUSED_KMAX 64        /* experts per token */

/* A block's shared memory before the phases' scratch: the token's choices, the norm scale, the
 * chosen experts' weight pointers, and the layer's parameters (this layer's and the next's). */
struct fused_shared {
    int32_t sel_e[FUSED_KMAX], iota[FUSED_KMAX];
    float sel_w[FUSED_KMAX];
    float sc;
    const uint8_t *gate[FUSED_KMAX], *up[FUSED_KMAX], *down[FUSED_KMAX];
    moe_fused_layer ly[2];
};
#define FUSED_SCRATCH0 ((sizeof(fused_shared) + 15) / 16 * 4) /* floats */

static_assert(FUSED_WARPS == 2 * ATT_WARPS, "two attention groups per block");
static_assert(FUSED_WARPS >= DOWN_WARPS, "down_block takes one warp per expert in turn");

/* The kinds the fused kernel computes (the quantized types and the plain types' vector forms). */
#define FUSED_KINDS(X) MOE_QDOT_TYPES(X) X(KIND_F32_V) X(KIND_F16_V) X(KIND_BF16_V)

static __device__ __forceinline__ uint64_t global_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

/* The grid barrier: bar[0] counts arrivals (never reset within a launch), bar[FUSED_FLAG] (its
 * own cache line) holds the number of barriers completed. Each block's thread 0 publishes the
 * block's writes (fence), arrives; the last arrival of barrier k releases the flag to k, the
 * others spin on the flag (reads only, away from the arrivals' line) and acquire. */
#define FUSED_FLAG 32
static_assert(MOE_FUSED_BAR_WORDS > FUSED_FLAG, "the barrier's flag line");
static __device__ __forceinline__ void grid_sync(unsigned *bar, unsigned *k)
{
    __syncthreads();
    *k += 1;
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned old = atomicAdd(bar, 1u);
        if (old + 1 == *k * gridDim.x) {
            __threadfence();
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + FUSED_FLAG), "r"(*k)
                         : "memory");
        } else {
            unsigned v;
            for (;;) {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];"
                             : "=r"(v)
                             : "l"(bar + FUSED_FLAG)
                             : "memory");
                if ((int)(v - *k) >= 0)
                    break;
            }
        }
        __threadfence();
    }
    __syncthreads();
}

/* ---------------------------------------------------------------- mat-vec phases */

template <int K>
static __device__ __forceinline__ void mv_item(const moe_fused_mat &m, int64_t item,
                                               const float *x, bool accumulate)
{
    constexpr int RW = rows_per_warp<K>();
    const int64_t row = item * RW;
    const bool has2 = RW == 2 && row + 1 < m.rows;
    const uint8_t *w0 = m.w + (size_t)row * m.row_bytes;
    const float *xt[1] = {x};
    float acc[1][RW];
    mv_warp<K, 1>(w0, has2 ? m.row_bytes : 0, m.block_bytes, m.nu, xt, acc);
    if ((threadIdx.x & 31) == 0) {
        if (accumulate) {
            m.y[row] += acc[0][0];
            if (RW == 2 && has2)
                m.y[row + 1] += acc[0][RW - 1];
        } else {
            m.y[row] = acc[0][0];
            if (RW == 2 && has2)
                m.y[row + 1] = acc[0][RW - 1];
        }
    }
}

static __device__ __noinline__ void mv_dispatch(const moe_fused_mat &m, int64_t item,
                                                   const float *x, bool accumulate)
{
    switch (m.kind) {
#define CASE(T) case T: mv_item<T>(m, item, x, accumulate); break;
    FUSED_KINDS(CASE)
#undef CASE
    }
}

/* Two items of one quantized matrix by one warp, their four rows' loads in flight together. */
template <int K>
static __device__ __forceinline__ void mv_pair_item(const moe_fused_mat &m, int64_t i1, int64_t i2,
                                                    const float *x, bool accumulate)
{
    const int64_t r[2] = {i1 * 2, i2 * 2};
    const uint8_t *rowp[4];
    UNROLL
    for (int q = 0; q < 2; q++) {
        rowp[2 * q] = m.w + (size_t)r[q] * m.row_bytes;
        rowp[2 * q + 1] = rowp[2 * q] + (r[q] + 1 < m.rows ? m.row_bytes : 0);
    }
    float acc[4];
    row_dots<K, 4>(rowp, m.block_bytes, m.nu, x, acc); /* each row as mv_warp computes it */
    if ((threadIdx.x & 31) == 0)
        UNROLL
        for (int q = 0; q < 2; q++)
            UNROLL
            for (int j = 0; j < 2; j++)
                if (j == 0 || r[q] + 1 < m.rows) {
                    if (accumulate)
                        m.y[r[q] + j] += acc[2 * q + j];
                    else
                        m.y[r[q] + j] = acc[2 * q + j];
                }
}

/* 1 when it took the pair (a quantized kind), 0 when the items go one by one. */
static __device__ __noinline__ int mv_pair(const moe_fused_mat &m, int64_t i1, int64_t i2,
                                           const float *x, bool accumulate)
{
    switch (m.kind) {
#define CASE(T) case T: mv_pair_item<T>(m, i1, i2, x, accumulate); return 1;
    MOE_QDOT_TYPES(CASE)
#undef CASE
    }
    return 0;
}

/* The matrix of item it among m[0..n) (items numbered across them in order): advances g and
 * base (its first item) from where the last, smaller it left them; false past the end. */
static __device__ __forceinline__ bool item_matrix(const moe_fused_mat *m, int n, int64_t it,
                                                   int *g, int64_t *base)
{
    while (*g < n && it >= *base + m[*g].items)
        *base += m[(*g)++].items;
    return *g < n;
}

/* Items it = first, first + stride, ... of the matrices m[0..n) in order; where a warp has two
 * items of one quantized matrix it computes them together. */
static __device__ __forceinline__ void mv_phase(const moe_fused_mat *m, int n, const float *x,
                                                bool accumulate, int64_t first, int64_t stride)
{
    int64_t base = 0;
    int g = 0;
    for (int64_t it = first; item_matrix(m, n, it, &g, &base); it += stride) {
        const int64_t it2 = it + stride;
        if (it2 < base + m[g].items && mv_pair(m[g], it - base, it2 - base, x, accumulate)) {
            it = it2;
            continue;
        }
        mv_dispatch(m[g], it - base, x, accumulate);
    }
}

/* The L2 prefetch of what mv_phase(m, n, first, stride) will read. */
static __device__ __forceinline__ void mv_prefetch(const moe_fused_mat *m, int n, int64_t first,
                                                   int64_t stride)
{
    const int lane = threadIdx.x & 31;
    int64_t base = 0;
    int g = 0;
    for (int64_t it = first; item_matrix(m, n, it, &g, &base); it += stride) {
        const int rw = m[g].rows_per_item;
        const int64_t row = (it - base) * rw;
        const int64_t nr = row + rw <= m[g].rows ? rw : m[g].rows - row;
        const uint8_t *p = m[g].w + (size_t)row * m[g].row_bytes;
        const size_t bytes = (size_t)nr * m[g].row_bytes;
        for (size_t off = (size_t)lane * 128; off < bytes; off += 32 * 128)
            prefetch_l2(p + off);
    }
}

/* ---------------------------------------------------------------- expert phases */

static __device__ __forceinline__ void gate_up_dispatch(const moe_fused_layer &ly, int64_t ff,
                                                        const uint8_t *g, const uint8_t *u,
                                                        const float *x, int64_t r0, float *out)
{
    switch (ly.gu_kind) {
#define CASE(T)                                                                             \
    case T:                                                                                 \
        gate_up_warp<T, 0>(g, u, ly.gu_row_bytes, ly.gu_block_bytes, ly.gu_nu, ff, x, r0, out); \
        break;
    FUSED_KINDS(CASE)
#undef CASE
    }
}

/* down: the chosen experts' down matrices (a table indexed by choice), the choices 0..k-1 in
 * order (iota), so down_block reads the same rows as through the layer's table. */
static __device__ __forceinline__ void down_dispatch(const moe_fused_layer &ly, int64_t E,
                                                     const float *act, int64_t ldact, int kuse,
                                                     const uint8_t *const *down,
                                                     const int32_t *iota, const float *sel_w,
                                                     float *h, int64_t r0, float *part)
{
    switch (ly.down_kind) {
#define CASE(T)                                                                             \
    case T:                                                                                 \
        down_block<T>(down, ly.down_row_bytes, ly.down_block_bytes, ly.down_nu, E, act, ldact,  \
                      kuse, iota, sel_w, h, r0, part);                                      \
        break;
    FUSED_KINDS(CASE)
#undef CASE
    }
}

/* The layer's parameters into shared memory, word by word (the block's threads). */
static __device__ __forceinline__ void load_layer(moe_fused_layer *dst, const moe_fused_layer *src)
{
    const uint32_t *s = (const uint32_t *)src;
    uint32_t *d = (uint32_t *)dst;
    for (unsigned i = threadIdx.x; i < sizeof(moe_fused_layer) / 4; i += blockDim.x)
        d[i] = s[i];
}

/* ---------------------------------------------------------------- the kernel */

/* The RMSNorm scale of h (one warp sums, the block gets it). */
static __device__ __forceinline__ float norm_scale(const float *h, int64_t E, float eps,
                                                   float *sc_s)
{
    if (threadIdx.x < 32) {
        const float ss = row_ss_warp(h, E);
        if (threadIdx.x == 0)
            *sc_s = rms_scale(ss, E, eps);
    }
    __syncthreads();
    return *sc_s;
}

/* X = RMSNorm(H) · w over this block's slices (blocks vb < xblocks, FUSED_THREADS elements a
 * slice, slices gridDim.x apart). */
static __device__ __forceinline__ void norm_slices(const moe_fused_args &a, const float *w,
                                                   int64_t vb, int64_t xblocks, float *sc_s)
{
    if (vb >= xblocks)
        return;
    const float sc = norm_scale(a.h, a.E, a.eps, sc_s);
    for (int64_t i = vb * FUSED_THREADS + threadIdx.x; i < a.E;
         i += (int64_t)gridDim.x * FUSED_THREADS)
        a.x[i] = a.h[i] * sc * w[i];
}

/* With a.timing, block 0's clock into a.timing[i]. */
static __device__ __forceinline__ void stamp(const moe_fused_args &a, size_t i)
{
    if (a.timing && blockIdx.x == 0 && threadIdx.x == 0)
        a.timing[i] = global_ns();
}

template <int EL>
static __device__ __forceinline__ void attention_phase(const moe_fused_args &a, int l,
                                                       float *scratch, int64_t vb0)
{
    const int half = (int)(threadIdx.x >> 5) / ATT_WARPS;
    const int64_t hdv = a.kv.hdv;
    att_smem *sm = (att_smem *)scratch + half;
    float *acc = scratch + 2 * ((sizeof(att_smem) + 15) / 16 * 4) + half * ATT_WARPS * hdv;
    const int64_t nvb = a.H * a.att_z;
    const bool wide = att_wide_ok(a.kv, EL);
    for (int64_t vb = vb0 * 2 + half; vb < nvb; vb += 2 * (int64_t)gridDim.x) {
#define ATT_BODY(WIDE)                                                                             \
    attn_split_body<false, EL, att_sync_named, false, WIDE>(                                       \
        a.q, a.H * a.kv.hd, a.pos, a.seq, a.kv, l, a.H, a.att_scale, 1, a.part, a.att_done, a.att, \
        a.H * hdv, vb % a.H, 0, (int)(vb / a.H), a.att_z, (int)(threadIdx.x & 127), sm, acc,       \
        att_sync_named{1 + half})
        if (wide)
            ATT_BODY(true);
        else
            ATT_BODY(false);
#undef ATT_BODY
    }
}

/* This block's place in an order of the blocks by (rank on its SM, SM): the blocks count
 * themselves in per SM id (cnt[slots], zero at launch), meet at a barrier, then each counts the
 * blocks before it. A permutation of 0..gridDim.x-1 whatever the placement. SM ids need not be
 * contiguous (%nsmid bounds them, and may exceed the SM count); when they do not fit the array,
 * every block keeps its launch order (the same decision in all blocks, so the barrier count
 * stays uniform). */
static __device__ __forceinline__ int64_t spread_index(unsigned *cnt, int slots, unsigned *bar,
                                                       unsigned *k)
{
    unsigned nsmid;
    asm("mov.u32 %0, %%nsmid;" : "=r"(nsmid));
    if (nsmid > (unsigned)slots)
        return blockIdx.x;
    __shared__ unsigned rank_s, smid_s;
    __shared__ int64_t idx_s;
    if (threadIdx.x == 0) {
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        smid_s = smid;
        rank_s = atomicAdd(&cnt[smid], 1u);
    }
    grid_sync(bar, k);
    if (threadIdx.x < 32) {
        const unsigned rank = rank_s, me = smid_s;
        int64_t before = 0;
        for (unsigned sm = threadIdx.x; sm < nsmid; sm += 32) {
            const unsigned c = *(volatile unsigned *)&cnt[sm];
            before += c < rank ? c : rank;
            before += sm < me && c > rank;
        }
        for (int o = 16; o > 0; o >>= 1)
            before += __shfl_xor_sync(0xffffffffu, before, o);
        if (threadIdx.x == 0)
            idx_s = before;
    }
    __syncthreads();
    return idx_s;
}

/* MINB: blocks per SM the registers are sized for (1: up to 255 registers a thread). */
template <int MINB>
static __global__ void __launch_bounds__(FUSED_THREADS, MINB) fused_decode_kernel(const moe_fused_args a)
{
    extern __shared__ float4 smem4[];
    float *const sm = (float *)smem4;
    fused_shared *const fs = (fused_shared *)sm;
    int32_t *const sel_e_s = fs->sel_e;
    float *const sel_w_s = fs->sel_w;
    float *const sc_s = &fs->sc;
    float *const scratch = sm + FUSED_SCRATCH0;
    const int warp = (int)(threadIdx.x >> 5);
    unsigned target = 0; /* barriers passed */
    /* Work goes by a block order that visits every SM before any SM's second block (vb0), so a
     * phase with fewer work items than blocks spreads them over the SMs. */
    const int64_t vb0 = spread_index(a.bar + MOE_FUSED_BAR_WORDS, a.sm_slots, a.bar, &target);
    const int64_t gw = vb0 * FUSED_WARPS + warp;
    const int64_t GW = (int64_t)gridDim.x * FUSED_WARPS;
    const int64_t E = a.E, ff = a.ff;
    const int kuse = a.kuse;
    /* With a.timing: block 0 stamps the end of every phase (the barrier after it). */
#define SYNC(ph)                                                                            \
    do {                                                                                    \
        grid_sync(a.bar, &target);                                                          \
        stamp(a, (size_t)l * FUSED_NPH + (ph));                                             \
    } while (0)
    stamp(a, (size_t)a.L * FUSED_NPH);
    /* Blocks that write a slice of X (FUSED_THREADS elements each). */
    const int64_t xblocks = (E + FUSED_THREADS - 1) / FUSED_THREADS;
    if ((int)threadIdx.x < kuse)
        fs->iota[threadIdx.x] = (int32_t)threadIdx.x;
    if (a.L > 0) {
        load_layer(&fs->ly[0], &a.layers[0]);
        if (a.prefetch)
            mv_prefetch(a.layers[0].qkv, 3, gw, GW);
    }
    __syncthreads();
    for (int l = 0; l < a.L; l++) {
        const moe_fused_layer &ly = fs->ly[l & 1];
        /* A: X = RMSNorm(H) · attn_norm. */
        norm_slices(a, ly.attn_norm, vb0, xblocks, sc_s);
        SYNC(FUSED_PH_NORM1);
        /* B: q, k, v. */
        mv_phase(ly.qkv, 3, a.x, false, gw, GW);
        SYNC(FUSED_PH_QKV);
        /* C: per-head norm, RoPE, K and V into the cache. */
        for (int64_t hi = gw; hi < a.H + a.kv.Hkv; hi += GW)
            qk_rope_kv_warp<false>(a.q, a.H * a.kv.hd, a.k, a.kv.Hkv * a.kv.hd, a.v,
                                   a.kv.Hkv * a.kv.hdv, ly.q_norm, ly.k_norm, a.rope, a.pos,
                                   a.seq, a.kv, l, a.H, a.eps, 0, hi, scratch + warp * a.kv.hd);
        SYNC(FUSED_PH_ROPE);
        /* D: attention. */
        switch (a.el) {
        case 1: attention_phase<1>(a, l, scratch, vb0); break;
        case 2: attention_phase<2>(a, l, scratch, vb0); break;
        default: attention_phase<4>(a, l, scratch, vb0); break;
        }
        if (a.prefetch)
            mv_prefetch(&ly.o, 1, gw, GW);
        SYNC(FUSED_PH_ATTN);
        /* E: H += O · ATT. */
        mv_phase(&ly.o, 1, a.att, true, gw, GW);
        if (a.prefetch)
            mv_prefetch(&ly.router, 1, gw, GW);
        SYNC(FUSED_PH_O);
        /* F, G: X = RMSNorm(H) · ffn_norm, router logits. */
        if (a.router_smem) {
            const int64_t rblocks = (ly.router.items + FUSED_WARPS - 1) / FUSED_WARPS;
            const int64_t nrb = rblocks < (int64_t)gridDim.x ? rblocks : (int64_t)gridDim.x;
            if (vb0 < xblocks || vb0 < nrb) {
                const float sc = norm_scale(a.h, E, a.eps, sc_s);
                for (int64_t i = threadIdx.x; i < E; i += FUSED_THREADS) {
                    const float y = a.h[i] * sc * ly.ffn_norm[i];
                    scratch[i] = y;
                    if ((int64_t)((i / FUSED_THREADS) % gridDim.x) == vb0)
                        a.x[i] = y;
                }
                __syncthreads();
                if (vb0 < nrb)
                    mv_phase(&ly.router, 1, scratch, false, vb0 * FUSED_WARPS + warp,
                             nrb * FUSED_WARPS);
            }
        } else {
            norm_slices(a, ly.ffn_norm, vb0, xblocks, sc_s);
            SYNC(FUSED_PH_NORM2);
            mv_phase(&ly.router, 1, a.x, false, gw, GW);
        }
        SYNC(FUSED_PH_ROUTER);
        /* H: routing (every block), gate/up. */
        if (warp == 0) {
            route_warp(a.rl, (int)a.nexp, kuse, a.norm_topk, sel_e_s, sel_w_s,
                       blockIdx.x == 0 ? ly.counts : NULL, scratch);
            stamp(a, (size_t)l * FUSED_NPH + FUSED_PH_SOFTMAX);
        }
        __syncthreads();
        if ((int)threadIdx.x < kuse) {
            const int e = sel_e_s[threadIdx.x];
            fs->gate[threadIdx.x] = ly.gate[e];
            fs->up[threadIdx.x] = ly.up[e];
            fs->down[threadIdx.x] = ly.down[e];
            if (blockIdx.x == 0) {
                a.sel_e[threadIdx.x] = e;
                a.sel_w[threadIdx.x] = sel_w_s[threadIdx.x];
            }
        }
        __syncthreads();
        stamp(a, (size_t)l * FUSED_NPH + FUSED_PH_ROUTE);
        {
            const int64_t groups = (ff + GU_ROWS - 1) / GU_ROWS, ldact = a.ld_act;
            for (int64_t it = gw; it < groups * kuse; it += GW) {
                const int j = (int)(it % kuse);
                gate_up_dispatch(ly, ff, fs->gate[j], fs->up[j], a.x, (it / kuse) * GU_ROWS,
                                 a.act + j * ldact);
            }
        }
        const int64_t dblocks = (E + DOWN_ROWS - 1) / DOWN_ROWS;
        if (a.prefetch)
            for (int64_t vb = vb0; vb < dblocks; vb += gridDim.x) {
                const int64_t r0 = vb * DOWN_ROWS;
                const int64_t nr = r0 + DOWN_ROWS <= E ? DOWN_ROWS : E - r0;
                const size_t bytes = (size_t)nr * ly.down_row_bytes;
                for (int j = 0; j < kuse; j++) {
                    const uint8_t *p = fs->down[j] + (size_t)r0 * ly.down_row_bytes;
                    for (size_t off = (size_t)threadIdx.x * 128; off < bytes;
                         off += FUSED_THREADS * 128)
                        prefetch_l2(p + off);
                }
            }
        SYNC(FUSED_PH_GATE_UP);
        /* I: down, the combine in top-k order, the residual. */
        {
            for (int64_t vb = vb0; vb < dblocks; vb += gridDim.x)
                down_dispatch(ly, E, a.act, a.ld_act, kuse, fs->down, fs->iota, sel_w_s, a.h,
                              vb * DOWN_ROWS, scratch);
        }
        if (l + 1 < a.L) {
            load_layer(&fs->ly[(l + 1) & 1], &a.layers[l + 1]);
            if (a.prefetch)
                mv_prefetch(a.layers[l + 1].qkv, 3, gw, GW);
        }
        SYNC(FUSED_PH_DOWN);
        /* Measuring the barrier alone (MOE_CUDA_FUSED_SPARE). */
        for (int i = 0; i < a.spare_barriers; i++)
            grid_sync(a.bar, &target);
        if (a.spare_barriers)
            stamp(a, (size_t)l * FUSED_NPH + FUSED_PH_SPARE);
    }
#undef SYNC
}

/* ---------------------------------------------------------------- host side */

template <int K> static int geom(int64_t n, struct moe_fused_geom *g)
{
    constexpr int PB = unit_shape<K>::per_block, BL = unit_shape<K>::blck;
    if (n % BL)
        return 0;
    const int64_t nb = n / BL;
    g->kind = K;
    g->row_bytes = moe_row_bytes(kind_type(K), n);
    g->block_bytes = (unsigned)(g->row_bytes / (size_t)nb);
    g->nu = (int)(nb * PB);
    g->rows_per_item = rows_per_warp<K>();
    return nb * PB <= 0x7fffffff;
}

/* geom for the kinds the fused step walks (FUSED_KINDS); 0 for the plain types' one-element
 * kinds (rows that are not 16-byte aligned), which it does not. */
template <int K> static int geom_of(int64_t n, struct moe_fused_geom *g)
{
    if constexpr (K == MOE_TYPE_F32 || K == MOE_TYPE_F16 || K == MOE_TYPE_BF16)
        return 0;
    else
        return geom<K>(n, g);
}

int moe_cuda_fused_geom(uint32_t type, int64_t n, struct moe_fused_geom *g)
{
    if (n <= 0)
        return 0;
    switch (type) {
#define CALL(T) return geom_of<T>(n, g);
#define CASE(T) case T: CALL(T)
    MOE_QDOT_TYPES(CASE)
    MOE_PLAIN_KINDS(CALL, moe_row_bytes(type, n) % 16 == 0)
#undef CASE
#undef CALL
    default: return 0;
    }
}

int moe_cuda_fused_kind_f32v(void)
{
    return KIND_F32_V;
}

static size_t fused_smem(int64_t E, int64_t hd, int64_t nexp, int kuse)
{
    size_t need = (size_t)E;                                    /* normed row (router) */
    const size_t rope = (size_t)FUSED_WARPS * (size_t)hd;        /* per-warp head rows */
    const size_t att = 2 * ((sizeof(att_smem) + 15) / 16 * 4) + 2 * ATT_WARPS * (size_t)hd;
    const size_t part = (size_t)kuse * DOWN_ROWS;
    need = need > rope ? need : rope;
    need = need > att ? need : att;
    need = need > (size_t)nexp ? need : (size_t)nexp;
    need = need > part ? need : part;
    return sizeof(float) * (FUSED_SCRATCH0 + need);
}

template <int MINB> static void *kernel_of()
{
    return (void *)fused_decode_kernel<MINB>;
}

int moe_cuda_fused_config(int64_t E, int64_t hd, int64_t nexp, int kuse, int max_per_sm,
                          int *blocks_per_sm, size_t *smem)
{
    const void *k = max_per_sm >= 2 ? kernel_of<2>() : kernel_of<1>();
    *blocks_per_sm = 0;
    *smem = 0;
    if (kuse < 1 || kuse > FUSED_KMAX || hd < 1 || hd > 128 || E < 1 || nexp < kuse)
        return 0;
    const size_t sm = fused_smem(E, hd, nexp, kuse);
    if (sm > 48 * 1024) {
        if (sm > 200 * 1024)
            return 0;
        MOE_CUDA_TRY(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          (int)sm));
    }
    int nb = 0;
    MOE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k, FUSED_THREADS, sm));
    *blocks_per_sm = nb < max_per_sm ? nb : max_per_sm;
    *smem = sm;
    return 0;
}

int moe_cuda_fused_launch(const struct moe_fused_args *a, int blocks, int per_sm, size_t smem,
                          bool coop, cudaStream_t s)
{
    if (blocks < 1 || a->sm_slots < 1 || a->kuse < 1 || a->kuse > FUSED_KMAX || a->att_z < 1 ||
        a->att_z > ATT_MAX_SPLITS)
        return -EINVAL;
    const size_t bar_bytes = sizeof(unsigned) * (MOE_FUSED_BAR_WORDS + (size_t)a->sm_slots);
    MOE_CUDA_TRY(cudaMemsetAsync(a->bar, 0, bar_bytes, s));
    cudaLaunchAttribute at;
    at.id = cudaLaunchAttributeCooperative;
    at.val.cooperative = 1;
    const dim3 g((unsigned)blocks), th(FUSED_THREADS);
    MOE_CUDA_TRY(per_sm >= 2
                     ? moe_launch_with(fused_decode_kernel<2>, g, th, smem, s, coop ? &at : NULL, *a)
                     : moe_launch_with(fused_decode_kernel<1>, g, th, smem, s, coop ? &at : NULL, *a));
    return 0;
}

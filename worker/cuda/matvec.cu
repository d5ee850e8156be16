/* CUDA quantized matrix-vector product (see matvec.h).
 *
 * Four rows per thread block: one warp per row for the plain types, one warp per two rows for
 * the quantized ones at one token a block and per four at more (see mv_rw). A row is cut into
 * "units", the piece of one block that one thread decodes (8 to 32 elements); lane i takes
 * units i, i+32, ..., so the 32 lanes of a warp read consecutive bytes of the row and each load
 * instruction is coalesced. Where the block layout keeps the quant bytes 16-byte aligned (Q4_K,
 * Q5_K, plain types on aligned rows) a thread reads its unit with one 16-byte load; the
 * 34/18/22/210-byte blocks (Q8_0, Q4_0, Q5_0, Q6_K) are only 2-byte aligned inside a row, so
 * those read 16-bit words. x comes through the read-only cache in float4 loads (it is 3-16 KB
 * and shared by every row).
 *
 * Codes become floats exactly (byte_f), are multiplied into per-sub-block float sums, and the
 * sums are scaled: for Q4_K/Q5_K d·sc·Σq·x − dmin·m·Σx, for the others d·Σq·x. The lane sums are
 * added by a shuffle tree. This is the reference's function (dequantize, then dot) with a
 * different float summation order; tests/gpu/test_cuda_matvec.c holds it to 1e-5 of Σ|w·x|.
 *
 * The same kernel reads VRAM or host-mapped memory: for mapped memory every byte crosses PCIe
 * once, which is what the design's "compute a missing expert from the host store" wants.
 * docs/cuda.md has the measurements and what limits each type. */
#include "worker/cuda/matvec.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

/* The store headers are plain C without extern "C" guards of their own. */
extern "C" {
#include "store/err.h"
#include "store/ggml_type.h"
}
#include "worker/cuda/cuda_check.cuh"
#include "worker/cuda/env_opts.h"
#include "worker/cuda/launch.cuh"
#include "worker/cuda/mv_tc_dev.cuh"
#include "worker/cuda/mv_warp.cuh"
#include "worker/cuda/ops_dev.cuh"

#define ROWS_PER_BLOCK 4
#define THREADS (32 * ROWS_PER_BLOCK)

/* Rows a warp walks for the quantized kinds (their x loads shared by the rows): 2 for one token
 * a block, 4 for more (measured on an H100: 2 against 4 at one token, 310 against 301-305 tok/s;
 * 4 against 2 for 2 tokens a block, +5% at 4 sequences, +9% at 16, +10% at 64;
 * docs/benchmarks.md), and 4 in the one-token launch that applies the RMSNorm on the way (its
 * warps read the input and the norm's weight for every row group, so sharing them pays there:
 * +1% at batch 1, H100). MOE_MV_RW / MOE_MV_RW_T / MOE_MV_RW_NORM (2 or 4) set them in a build
 * for measurements. The plain types keep one (rows_per_warp). A row's floats are the same
 * whatever the count. */
#ifndef MOE_MV_RW
#define MOE_MV_RW 2
#endif
#ifndef MOE_MV_RW_T
#define MOE_MV_RW_T 4
#endif
#ifndef MOE_MV_RW_NORM
#define MOE_MV_RW_NORM 4
#endif
static_assert((MOE_MV_RW == 2 || MOE_MV_RW == 4) && (MOE_MV_RW_T == 2 || MOE_MV_RW_T == 4) &&
                  (MOE_MV_RW_NORM == 2 || MOE_MV_RW_NORM == 4),
              "MOE_MV_RW, MOE_MV_RW_T and MOE_MV_RW_NORM are 2 or 4");
/* The TOK_T-token walk (mv_rows_tile) holds each row's converted codes, chain results and
 * sums for every token: 2 rows a warp. */
#ifndef MOE_MV_RW_TOK
#define MOE_MV_RW_TOK 2
#endif
template <int K, int T, bool NORM = false> __host__ __device__ constexpr int mv_rw()
{
    return rows_per_warp<K>() == 1 ? 1
           : NORM                 ? MOE_MV_RW_NORM
           : T == 1               ? MOE_MV_RW
           : T == TOK_T           ? MOE_MV_RW_TOK
                                  : MOE_MV_RW_T;
}

/* Up to three matrices of one row length, in one launch (q, k and v of a layer), of one weight
 * type or of two (the first nseg1 segments of kind K, the others of kind K2: a layer whose v is
 * Q6_K and q, k Q4_K): segment g takes grid blocks [blk0, blk0 + its blocks). */
struct mv_seg {
    const uint8_t *w;
    float *y;
    int64_t ldy, rows;
    unsigned blk0;
    unsigned block_bytes;
    size_t row_bytes;
    int nu;
};

/* The input's width (floats) of a segment of kind K: its units a row, as whole blocks. */
template <int K>
static __device__ __forceinline__ int64_t seg_width(const mv_seg &sg)
{
    return (int64_t)sg.nu / unit_shape<K>::per_block * unit_shape<K>::blck;
}

/* The q/k-norm + RoPE + KV store done by a NORM launch (moe_mv_rope): segment g's row r is in
 * head hbase[g] + r / hw[g] (v rows count for their kv head, whose k rows are in another
 * segment). */
struct mv_rope_dev {
    float *q, *k;
    const float *v;
    const float *qn, *kn, *rope;
    const int32_t *pos, *seq;
    moe_cuda_kv kv;
    int layer;
    int64_t H;
    float eps;
    unsigned *cnt;
    int64_t hbase[3], hw[3];
};

struct mv_args {
    mv_seg seg[3];
    int nseg, nseg1;
    const float *x;
    int64_t ldx;
    int accumulate;
    /* NORM kernels: x is the RMSNorm's source row, g its weight; dst gets the normalised row. */
    const float *g;
    float eps;
    float *dst;
    int rope_on; /* NORM kernels: rp below */
    mv_rope_dev rp;
    /* Rows per block: ROWS_PER_BLOCK; in preloading launches MOE_CUDA_MV_RPB (8 or 16, up to
     * PRELOAD_RPB) for measurements. */
    int rpb;
    /* One-token K-quant walks of a launch of at most PRELOAD_ROWS rows: load every unit of a
     * lane's rows first when they fit its registers (MOE_CUDA_MV_PRELOAD=0: the unrolled walk
     * with L2 prefetches, for measurements; the floats are the same). stage (MOE_CUDA_MV_STAGE=1,
     * for measurements): the input row (and with the RMSNorm its weight) copied into the
     * launch's dynamic shared memory with cp.async, stage_off floats in (after the RoPE tail's
     * rows). On an H100 staging and 16 rows a block made o 6.2 us and q/k/v 8.8 us against 6.0
     * and 8.0 without (docs/benchmarks.md). */
    int preload, stage;
    unsigned stage_off;
    int g_early; /* NORM kernels: moe_norm_early_step (launch.cuh) */
};

/* An output head's 151936 rows are many waves of blocks, each better off with fewer registers
 * (the Q6_K head preloaded: 141 against 105 us on an H100). */
#define PRELOAD_ROWS 16384
/* Launches of this many rows or more are taken for an output head's. */
#define MV_HEAD_ROWS 32768
#define PRELOAD_RPB 16

/* After a warp of a NORM launch with rope_on has stored its rows [row, row + RW) of segment gi:
 * its rows are counted for their heads, and the warp whose count completes a head does the
 * head's q/k-norm, RoPE and KV store (qk_rope_kv_warp, reading what the other warps stored past
 * L1), then zeroes the head's counter for the next launch. The stores are ordered before the
 * count and the count before the reads by fences, as in the attention's merge. */
template <int RW>
static __device__ __forceinline__ void mv_rope_tail(const mv_args &a, int gi, int64_t row,
                                                    int64_t rows)
{
    const mv_rope_dev &p = a.rp;
    const int lane = threadIdx.x & 31;
    int own0 = -1, own1 = -1;
    if (lane == 0) {
        __threadfence();
        const int64_t end = row + RW < rows ? row + RW : rows, hw = p.hw[gi];
        for (int64_t r = row; r < end;) {
            const int64_t h = r / hw, he = (h + 1) * hw < end ? (h + 1) * hw : end;
            const int hh = (int)(p.hbase[gi] + h);
            const unsigned c = (unsigned)(he - r);
            const unsigned total = (unsigned)(hh < p.H ? p.kv.hd : p.kv.hd + p.kv.hdv);
            if (atomicAdd(&p.cnt[hh], c) + c == total) {
                if (own0 < 0)
                    own0 = hh;
                else
                    own1 = hh;
            }
            r = he;
        }
    }
    own0 = __shfl_sync(0xffffffffu, own0, 0);
    own1 = __shfl_sync(0xffffffffu, own1, 0);
    extern __shared__ float mv_sm[];
    float *rs = mv_sm + (size_t)(threadIdx.x >> 5) * p.kv.hd;
    UNROLL
    for (int i = 0; i < 2; i++) {
        const int hh = i ? own1 : own0;
        if (hh < 0)
            continue;
        if (lane == 0)
            p.cnt[hh] = 0;
        __threadfence();
        if (p.kv.f32)
            qk_rope_kv_warp<true, true>(p.q, 0, p.k, 0, p.v, 0, p.qn, p.kn, p.rope, p.pos, p.seq,
                                        p.kv, p.layer, p.H, p.eps, 0, hh, rs);
        else
            qk_rope_kv_warp<false, true>(p.q, 0, p.k, 0, p.v, 0, p.qn, p.kn, p.rope, p.pos,
                                         p.seq, p.kv, p.layer, p.H, p.eps, 0, hh, rs);
    }
}

/* rows_preloaded_dots when the launch loaded its units first (pre, possible for the kind:
 * PRE); false when the caller walks the rows itself. */
template <int K, int RW, int UPL, bool PRE, class XL>
static __device__ __forceinline__ bool preloaded_dots(bool pre,
                                                      const typename unit_raw<K>::type (*raw)[RW],
                                                      int nu, const float *x, float *acc,
                                                      const XL &xin)
{
    if constexpr (PRE)
        if (pre) {
            rows_preloaded_dots<K, RW, UPL, XL>(raw, nu, x, acc, xin);
            return true;
        }
    return false;
}

/* Lane 0 of a warp stores (or adds) its rows' results for the step's tokens t0 + i < n_tok. */
template <int T, int RW>
static __device__ __forceinline__ void mv_store(const mv_args &a, const mv_seg &sg, int64_t row,
                                                int64_t t0, int64_t n_tok, const float (*acc)[RW])
{
    if ((threadIdx.x & 31) != 0)
        return;
    UNROLL
    for (int i = 0; i < T; i++) {
        if (t0 + i >= n_tok)
            break;
        float *y = sg.y + (t0 + i) * sg.ldy;
        UNROLL
        for (int r = 0; r < RW; r++) {
            if (row + r >= sg.rows)
                break;
            if (a.accumulate)
                y[row + r] += acc[i][r];
            else
                y[row + r] = acc[i][r];
        }
    }
}

/* Each block of threads takes a.rpb rows of T tokens (blockIdx.y picks the group of T), each
 * warp RW consecutive rows. A lane loads and decodes its units of the weights once and
 * multiplies them into all T tokens, with the same float operations per (row, token) as for one
 * token, so a token's result does not depend on how many others share the launch. With only a
 * few tens of warps resident per SM, one unit per lane at a time is not enough bytes in flight to
 * cover HBM latency, hence two (two rows, or one row unrolled twice). Before waiting for the
 * previous kernel, each warp prefetches its rows into L2, or (PRELOAD, one token, a K-quant)
 * loads all of its units' bytes into registers (rows_preload): with programmatic dependent launch
 * those loads overlap the kernel before. */
template <int K, int T, bool NORM, bool PRELOAD>
static __device__ __forceinline__ void mv_rows(const mv_args &a, const mv_seg &sg, int gi,
                                               int64_t n_tok)
{
    constexpr int RW = mv_rw<K, T, NORM>();
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)(blockIdx.x - sg.blk0) * a.rpb + (threadIdx.x >> 5) * RW;
    const bool live = row < sg.rows;
    /* The warp's rows; those past the matrix walk its first again (their results are not
     * stored). */
    const uint8_t *rowp[RW];
    UNROLL
    for (int r = 0; r < RW; r++)
        rowp[r] = sg.w +
                  (size_t)(live && row + r < sg.rows ? row + r : live ? row : 0) * sg.row_bytes;
    /* One token of a K-quant whose rows a lane's registers hold (the layer's dense matrices of
     * a 2048-4096 wide model): every unit's bytes loaded here, before the wait and the
     * RMSNorm's sum of squares. Otherwise the rows are prefetched into L2. */
    constexpr bool PRE = PRELOAD && T == 1 && preload_kind<K, NORM>() && !q8_rows<K, RW>();
    constexpr int UPL = PRE ? preload_upl<K, RW>() : 1;
    const bool pre = PRE && sg.nu <= 32 * UPL;
    typename unit_raw<K>::type raw[UPL][RW];
    if constexpr (PRE)
        if (pre && live)
            rows_preload<K, RW, UPL>(rowp, sg.block_bytes, sg.nu, raw);
    if (live && !pre)
        for (size_t off = (size_t)lane * 128; off < sg.row_bytes; off += 32 * 128) {
            UNROLL
            for (int r = 0; r < RW; r++)
                if (r == 0 || row + r < sg.rows)
                    prefetch_l2(rowp[r] + off);
        }
    pdl_wait();
    pdl_trigger();
    /* The preloading launches copy the input row (and the RMSNorm's weight) into shared memory
     * with cp.async while the weights are in flight: one round trip for all of it, instead of
     * one per unit once the weights are in (the block's warps read them from there). */
    const float *x0 = a.x, *g0 = a.g;
    if constexpr (PRE)
        if (pre && a.stage) {
            extern __shared__ float mv_sm[];
            float *xs = mv_sm + a.stage_off;
            const int64_t w4 = seg_width<K>(sg) / 4;
            for (int64_t i = threadIdx.x; i < w4; i += blockDim.x) {
                cp_async16(xs + 4 * i, a.x + 4 * i);
                if constexpr (NORM)
                    cp_async16(xs + 4 * (w4 + i), a.g + 4 * i);
            }
            cp_async_wait_all();
            __syncthreads();
            x0 = xs;
            if constexpr (NORM)
                g0 = xs + 4 * w4;
        }
    float sc = 0.0f;
    if constexpr (NORM) {
        /* Every warp computes the scale (no block barrier); the first warps of the grid also
         * store the normalised row, 128 elements each (a.x is the one token's source row). */
        const int64_t width = seg_width<K>(sg);
        sc = rms_scale(row_ss_warp(x0, width), width, a.eps);
        const int64_t nwarp = (int64_t)gridDim.x * (blockDim.x >> 5);
        for (int64_t c = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
             c * 128 < width; c += nwarp)
            for (int64_t i = c * 128 + lane; i < (c + 1) * 128 && i < width; i += 32)
                a.dst[i] = a.x[i] * sc * a.g[i];
    }
    if (!live)
        return;
    const int64_t t0 = (int64_t)blockIdx.y * T;
    float acc[T][RW];
    const float *xt[T];
    UNROLL
    for (int i = 0; i < T; i++)
        xt[i] = x0 + (t0 + i < n_tok ? t0 + i : t0) * a.ldx;
    if constexpr (NORM) {
        const XNorm xn = {x0, g0, sc};
        if (!preloaded_dots<K, RW, UPL, PRE>(pre, raw, sg.nu, xt[0], acc[0], xn))
            row_dots_multi_x<K, RW, 1, XNorm>(rowp, sg.block_bytes, sg.nu, xt, acc, &xn);
    } else if (!preloaded_dots<K, RW, UPL, PRE>(pre, raw, sg.nu, xt[0], acc[0], XPlain())) {
        row_dots_multi<K, RW, T>(rowp, sg.block_bytes, sg.nu, xt, acc);
    }
    mv_store<T, RW>(a, sg, row, t0, n_tok, acc);
    if constexpr (NORM)
        if (a.rope_on)
            mv_rope_tail<RW>(a, gi, row, sg.rows);
}

/* The TOK_T-token walk (MOE_CUDA_MV_TOK): a block of TILE_RPB rows (RW a warp) walks its rows a
 * slice of TILE_COLS columns at a time; the block first copies the slice's inputs of the step's
 * tokens into shared memory (XPad's padded layout), and every warp reads them from there, so the
 * inputs come from L2 once per block and slice instead of once per warp (16 tokens of a 2048-wide
 * input are 128 KB, more than L1 keeps beside the rows). Slices of 1024 columns are 32 Q4_K /
 * Q5_K or 64 Q6_K units, so each lane walks its units in the one-token walk's order
 * (row_units_tok) and, after the same shuffle tree, every (row, token) gets that walk's floats.
 * Every thread takes part in the copies and barriers; warps past the matrix compute nothing. */
constexpr int TILE_COLS = MOE_TOK_COLS;
constexpr int TILE_PITCH = TILE_COLS + TILE_COLS / 16; /* floats a token, padding included */
constexpr int TILE_RPB = 8;
constexpr size_t TILE_SMEM = sizeof(float) * TOK_T * TILE_PITCH;

template <int K>
static __device__ __forceinline__ void mv_rows_tile(const mv_args &a, const mv_seg &sg,
                                                    int64_t n_tok)
{
    constexpr int RW = mv_rw<K, TOK_T>(), PB = unit_shape<K>::per_block,
                  BL = unit_shape<K>::blck;
    static_assert(TILE_COLS % (32 * BL / PB) == 0, "whole unit steps a slice");
    extern __shared__ float mv_sm[];
    /* The warp's rows, as mv_rows takes them (written out again there: a shared helper changed
     * the registers of mv_rows' other instances). */
    const int64_t row = (int64_t)(blockIdx.x - sg.blk0) * a.rpb + (threadIdx.x >> 5) * RW;
    const bool live = row < sg.rows;
    const uint8_t *rowp[RW];
    UNROLL
    for (int r = 0; r < RW; r++)
        rowp[r] = sg.w +
                  (size_t)(live && row + r < sg.rows ? row + r : live ? row : 0) * sg.row_bytes;
    if (live)
        for (size_t off = (size_t)(threadIdx.x & 31) * 128; off < sg.row_bytes; off += 32 * 128) {
            UNROLL
            for (int r = 0; r < RW; r++)
                if (r == 0 || row + r < sg.rows)
                    prefetch_l2(rowp[r] + off);
        }
    pdl_wait();
    pdl_trigger();
    const int64_t t0 = (int64_t)blockIdx.y * TOK_T;
    const int nt = (int)(n_tok - t0 < TOK_T ? n_tok - t0 : TOK_T);
    const int64_t width = (int64_t)sg.nu / PB * BL;
    const XPad xp = {mv_sm};
    const uint32_t mg = code_magic();
    float acc[TOK_T][RW];
    zero_acc<TOK_T, RW>(acc);
    for (int64_t c0 = 0; c0 < width; c0 += TILE_COLS) {
        const int cw = (int)(width - c0 < TILE_COLS ? width - c0 : TILE_COLS), q4 = cw / 4;
        for (int e = threadIdx.x; e < nt * q4; e += blockDim.x) {
            const int i = e / q4, c = 4 * (e - i * q4);
            cp_async16(mv_sm + XPad::at((int64_t)i * TILE_COLS + c),
                       a.x + (t0 + i) * a.ldx + c0 + c);
        }
        cp_async_wait_all();
        __syncthreads();
        if (live)
            row_units_tok<K, RW, TOK_T, XPad>(rowp, sg.block_bytes, (int)(c0 / BL * PB),
                                              (int)((c0 + cw) / BL * PB), mv_sm, c0, TILE_COLS,
                                              nt, mg, acc, xp);
        __syncthreads();
    }
    if (!live)
        return;
    warp_sum_acc<TOK_T, RW>(acc);
    mv_store<TOK_T, RW>(a, sg, row, t0, n_tok, acc);
}

/* K2 == K: one weight type. Otherwise both kinds must take the same rows per warp (one block
 * size). */
template <int K, int K2, int T, bool NORM = false, bool PRE = false>
static __device__ __forceinline__ void mv_segments(const mv_args &a, int64_t n_tok)
{
    static_assert(!NORM || T == 1, "the RMSNorm is fused for one token");
    static_assert(mv_rw<K, T, NORM>() == mv_rw<K2, T, NORM>(), "one block size");
    /* MOE_CUDA_NORM_EARLY: the RMSNorm's weight (the input's width, the same for every
     * segment) fetched first, while nothing else holds registers. */
    if constexpr (NORM)
        if (a.g_early)
            prefetch_span(a.g, sizeof(float) * (size_t)seg_width<K>(a.seg[0]), threadIdx.x & 31,
                          32, a.g_early);
    int g = 0;
    while (g + 1 < a.nseg && blockIdx.x >= a.seg[g + 1].blk0)
        g++;
    if constexpr (T == TOK_T) {
        if (K == K2 || g < a.nseg1)
            mv_rows_tile<K>(a, a.seg[g], n_tok);
        else
            mv_rows_tile<K2>(a, a.seg[g], n_tok);
    } else if (K == K2 || g < a.nseg1) {
        mv_rows<K, T, NORM, PRE>(a, a.seg[g], g, n_tok);
    } else {
        mv_rows<K2, T, NORM, PRE>(a, a.seg[g], g, n_tok);
    }
}

template <int K, int K2, int T, bool NORM = false, bool PRE = false>
static __global__ void __launch_bounds__(PRE ? 32 * PRELOAD_RPB / 2 : THREADS)
matvec_kernel(const mv_args a, int64_t n_tok)
{
    mv_segments<K, K2, T, NORM, PRE>(a, n_tok);
}

/* The TOK_T-token walk (mv_rows_tile) of kinds K and K2, held to 168 registers a thread (3
 * blocks of THREADS an SM by the bound, 12 warps; their shared memory, 3 × 68 KB, fits the
 * SM's): without the bound it takes 255 and spills. */
#ifndef MOE_MV_TOK_MINB
#define MOE_MV_TOK_MINB 3
#endif
template <int K, int K2>
static __global__ void __launch_bounds__(THREADS, MOE_MV_TOK_MINB)
matvec_tok_kernel(const mv_args a, int64_t n_tok)
{
    mv_segments<K, K2, TOK_T, false, false>(a, n_tok);
}

/* One token, float32 rows of at most 32·F32N_UNITS 16-byte units (a router: 128 rows of 2048),
 * the RMSNorm on the way: one warp per row and one warp per block, so the rows spread over all
 * SMs, and every load a lane makes (its units of the row, of the input and of the norm's weight)
 * issued at once, the row's before the wait for the previous kernel. The general NORM walk
 * (mv_rows) takes a round trip for the sum of squares, another for the normalised row's store,
 * and two for the row with eight units in flight, all of that on 32 blocks: 6.1 µs for a
 * 1 MB router on an H100. The floats are mv_rows' (the sum of squares of row_ss_warp, the
 * normalised inputs of XNorm, the units' products of unit_dot, in the same order, and the same
 * shuffle tree), so the routing does not depend on which launch computes it. The warp of row 0
 * stores the normalised row. */
constexpr int F32N_UNITS = 16;

/* A lane's units of a float32 row of n4 units (units lane, lane + 32, ...; zeros past n4), all
 * loads issued together. */
static __device__ __forceinline__ void f32_units(const float4 *__restrict__ p, int n4,
                                                 float4 (&v)[F32N_UNITS])
{
    const int lane = threadIdx.x & 31;
    UNROLL
    for (int k = 0; k < F32N_UNITS; k++) {
        const int u = lane + 32 * k;
        v[k] = u < n4 ? p[u] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

/* SK (Q4_K or Q6_K; 0: none): blocks rows .. rows + n4/64 - 1 also stage the normalised row for
 * the tensor-core products of that type, block rows + sb its 256-float block sb (tc_stage_items'
 * items of the block, from the row in shared memory), into st: xs [nsb][64] uint4, then sxs
 * [nsb][4] uint2, then the exponent (int); the same floats as a block's own staging of the
 * stored row (tc_stage_raw), since every block normalises the row alike. */
template <int SK, bool GE = false>
static __global__ void __launch_bounds__(32)
f32_norm_rows_kernel(const float4 *__restrict__ w, int n4, const float4 *__restrict__ x,
                     const float4 *__restrict__ g, float eps, float *__restrict__ y,
                     float4 *__restrict__ dst, int rows, uint4 *__restrict__ st)
{
    const int lane = threadIdx.x;
    const int64_t row = blockIdx.x;
    const bool stage = SK != 0 && (int)blockIdx.x >= rows;
    float4 wv[F32N_UNITS], xv[F32N_UNITS], gv[F32N_UNITS];
    if (!stage)
        f32_units(w + row * n4, n4, wv);
    if constexpr (GE) /* MOE_CUDA_NORM_EARLY */
        f32_units(g, n4, gv);
    pdl_wait();
    pdl_trigger();
    f32_units(x, n4, xv);
    if constexpr (!GE)
        f32_units(g, n4, gv);
    float ss = 0.0f;
    UNROLL
    for (int k = 0; k < F32N_UNITS; k++)
        if (lane + 32 * k < n4)
            ss = ss_add4(ss, xv[k]);
    const float sc = rms_scale(warp_sum(ss), (int64_t)n4 * 4, eps);
    if constexpr (SK != 0) {
        if (stage) {
            __shared__ float4 xr[32 * F32N_UNITS];
            UNROLL
            for (int k = 0; k < F32N_UNITS; k++)
                if (lane + 32 * k < n4)
                    xr[lane + 32 * k] = xnorm4(xv[k], sc, gv[k]);
            __syncwarp();
            const unsigned m = __reduce_max_sync(
                0xffffffffu, tc_amax_part((const float *)xr, (int64_t)n4 * 4, lane, 32));
            const int nsb = n4 / 64, sb = (int)blockIdx.x - rows, e = tc_scale_exp(__uint_as_float(m));
            const float s2 = ldexpf(1.0f, -e);
            tc_stage_block_lane<SK>(tc_row_ld{(const float *)xr}, s2, sb, lane, st,
                                    (uint2 *)(st + (size_t)nsb * 64));
            if (sb == 0 && lane == 0)
                *(int *)(st + tc_staged_row_exp(nsb)) = e;
            return;
        }
    }
    float acc = 0.0f;
    UNROLL
    for (int k = 0; k < F32N_UNITS; k++) {
        const int u = lane + 32 * k;
        if (u < n4) {
            const float4 xn = xnorm4(xv[k], sc, gv[k]);
            acc += f32v_dot(wv[k], xn);
            if (row == 0)
                dst[u] = xn;
        }
    }
    UNROLL
    for (int o = 16; o > 0; o >>= 1)
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0)
        y[row] = acc;
}

/* The instance of f32_norm_rows_kernel<SK> a launch takes: the norm weight loaded before the
 * wait with MOE_CUDA_NORM_EARLY (launch.cuh). */
template <int SK>
static auto f32_norm_rows_for()
{
    return moe_norm_early_step ? f32_norm_rows_kernel<SK, true> : f32_norm_rows_kernel<SK, false>;
}

/* The same rows without the RMSNorm, for a decode step's tokens (a router at 2-64 sequences):
 * one warp per row and per block, TT tokens a block (blockIdx.y picks the group), the row's
 * units loaded once before the wait, then each token's inputs all at once. Per token the floats
 * of the general walk (unit_dot's products in unit order, the shuffle tree), so of the NORM
 * kernel above for the same normalised row. The general walk took 8.9 us a 16-token step on an
 * H100: 32 blocks, each lane's 16 units one after the other. */
template <int TT>
static __global__ void __launch_bounds__(32)
f32_rows_kernel(const float4 *__restrict__ w, int n4, const float *__restrict__ x, int64_t ldx,
                int64_t n_tok, float *__restrict__ y, int64_t ldy, int accumulate)
{
    const int lane = threadIdx.x;
    const int64_t row = blockIdx.x;
    float4 wv[F32N_UNITS];
    f32_units(w + row * n4, n4, wv);
    pdl_wait();
    pdl_trigger();
    UNROLL
    for (int i = 0; i < TT; i++) {
        const int64_t t = (int64_t)blockIdx.y * TT + i;
        if (t >= n_tok)
            break;
        float4 xv[F32N_UNITS];
        f32_units((const float4 *)(x + t * ldx), n4, xv);
        float acc = 0.0f;
        UNROLL
        for (int k = 0; k < F32N_UNITS; k++)
            if (lane + 32 * k < n4)
                acc += f32v_dot(wv[k], xv[k]);
        UNROLL
        for (int o = 16; o > 0; o >>= 1)
            acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) {
            float *yr = y + t * ldy + row;
            *yr = accumulate ? *yr + acc : acc;
        }
    }
}

/* Whether the float32 row kernels take a launch (MOE_CUDA_F32_ROWS=0 keeps the general walk,
 * for measurements): one float32 matrix of at most PRELOAD_ROWS 16-byte aligned rows, short
 * enough, with the RMSNorm (one token) or of at most 64 tokens without it (the decode steps:
 * prompt chunks keep the walk, whose blocks of 4 rows share their inputs through L1). */
static bool f32_rows(uint32_t type, const struct moe_mv_job *jobs, int n_jobs, int64_t n,
                     int64_t n_tok, bool vec, const struct moe_mv_rope *rope)
{
    static int on = -1;
    if (on < 0)
        on = moe_env_on("MOE_CUDA_F32_ROWS");
    return on && type == MOE_TYPE_F32 && n_jobs == 1 && vec && !rope && n % 4 == 0 &&
           n / 4 <= 32 * F32N_UNITS && jobs[0].rows <= PRELOAD_ROWS && n_tok <= 64;
}

/* jobs[0..n1) of kind K, the rest of kind K2 (n1 == n_jobs when one type). */
template <int K, int K2 = K>
static int launch(const struct moe_mv_job *jobs, int n_jobs, int n1, int64_t n, const float *x,
                  int64_t ldx, int64_t n_tok, int accumulate, cudaStream_t s,
                  const float *g = NULL, float eps = 0.0f, float *dst = NULL,
                  const struct moe_mv_rope *rope = NULL)
{
    mv_args a = {};
    if (n_tok > 65535 || (rope && (!dst || n_tok != 1)))
        return -EINVAL;
    size_t smem = 0;
    if (rope) {
        /* Each job one of q, k, v, every one of them once, of whole heads. */
        const moe_cuda_kv &kv = *rope->kv;
        if (n_jobs != 3 || kv.hd < 4 || kv.hd % 4 != 0 || kv.hdv < 4 || kv.hdv % 4 != 0 ||
            !rope->cnt || rope->H < 1 || kv.Hkv < 1 || rope->H % kv.Hkv != 0)
            return -EINVAL;
        mv_rope_dev &p = a.rp;
        p = {rope->q, rope->k, rope->v, rope->qn, rope->kn, rope->rope, rope->pos, rope->seq, kv,
             rope->layer, rope->H, rope->eps, rope->cnt, {0, 0, 0}, {0, 0, 0}};
        int seen = 0;
        for (int j = 0; j < n_jobs; j++) {
            const int which = jobs[j].y == rope->q ? 0 : jobs[j].y == rope->k ? 1
                              : jobs[j].y == rope->v ? 2 : -1;
            const int64_t want = which == 0 ? rope->H * kv.hd : which == 1 ? kv.Hkv * kv.hd
                                                                            : kv.Hkv * kv.hdv;
            if (which < 0 || (seen & (1 << which)) || jobs[j].rows != want)
                return -EINVAL;
            seen |= 1 << which;
            p.hbase[j] = which == 0 ? 0 : rope->H;
            p.hw[j] = which == 2 ? kv.hdv : kv.hd;
        }
        a.rope_on = 1;
    }
    static int preload = -1, stage = -1, rpb = -1;
    if (preload < 0) {
        preload = moe_env_on("MOE_CUDA_MV_PRELOAD");
        stage = moe_env_is1("MOE_CUDA_MV_STAGE");
        const int r = (int)moe_env_int("MOE_CUDA_MV_RPB", 1, 64, ROWS_PER_BLOCK);
        rpb = r == 8 || r == 16 ? r : ROWS_PER_BLOCK;
    }
    /* Preloading: one token, both kinds able to, a launch of few enough rows. */
    int64_t total_rows = 0;
    for (int j = 0; j < n_jobs; j++)
        total_rows += jobs[j].rows;
    const bool pre = preload && n_tok == 1 && total_rows <= PRELOAD_ROWS &&
                     (dst ? preload_kind<K, true>() && preload_kind<K2, true>()
                          : preload_kind<K, false>() && preload_kind<K2, false>());
    const int rw = dst ? mv_rw<K, 1, true>() : n_tok == 1 ? mv_rw<K, 1>() : mv_rw<K, 2>();
    /* MOE_CUDA_MV_TMAX (below). */
    static int tmax = -1;
    if (tmax < 0) {
        const int x = (int)moe_env_int("MOE_CUDA_MV_TMAX", 0, 1 << 20, 0);
        tmax = x >= 8 ? 8 : x >= 4 ? 4 : x >= 2 ? 2 : x >= 1 ? 1 : 0;
    }
    /* MOE_CUDA_MV_TOK=1: Q4_K, Q5_K and Q6_K launches of TOK_T tokens or more take the walk that
     * converts each weight once for TOK_T tokens in blocks of TILE_RPB rows (mv_rows_tile; the
     * same floats); dense: only those below 32768 rows (not an output head). */
    static int tok = -1;
    if (tok < 0) {
        const char *v = getenv("MOE_CUDA_MV_TOK");
        tok = v && !strcmp(v, "1") ? 2 : v && !strcmp(v, "dense") ? 1 : 0;
    }
    const bool tile = tok_kind<K>() && tok_kind<K2>() && !dst && tok && !tmax &&
                      n_tok >= TOK_T && (tok == 2 || total_rows < MV_HEAD_ROWS);
    a.rpb = tile ? TILE_RPB : pre ? rpb : ROWS_PER_BLOCK;
    if (rope)
        smem = sizeof(float) * (size_t)rope->kv->hd * (size_t)(a.rpb / rw);
    /* The staged row (and norm weight) fit the 48 KB a launch may take without opting in. */
    a.preload = pre;
    const size_t staged = sizeof(float) * (size_t)n * (dst ? 2 : 1);
    a.stage = pre && stage && n % 4 == 0 && smem + staged <= 48 * 1024;
    a.stage_off = (unsigned)(smem / sizeof(float));
    if (a.stage)
        smem += staged;
    a.x = x;
    a.ldx = ldx;
    a.accumulate = accumulate;
    a.g = g;
    a.g_early = g ? moe_norm_early_step : 0;
    a.eps = eps;
    a.dst = dst;
    a.nseg = n_jobs;
    a.nseg1 = n1;
    int64_t blocks = 0;
    for (int j = 0; j < n_jobs; j++) {
        const int kind = j < n1 ? K : K2;
        const int64_t BL = j < n1 ? (int64_t)unit_shape<K>::blck : (int64_t)unit_shape<K2>::blck;
        const int64_t PB =
            j < n1 ? (int64_t)unit_shape<K>::per_block : (int64_t)unit_shape<K2>::per_block;
        const int64_t nb = n / BL;
        const size_t rb = moe_row_bytes(kind_type(kind), n);
        if (nb * PB > 0x7fffffff)
            return -EINVAL;
        a.seg[j] = {(const uint8_t *)jobs[j].w, jobs[j].y, jobs[j].ldy, jobs[j].rows,
                    (unsigned)blocks, (unsigned)(rb / (size_t)nb), rb, (int)(nb * PB)};
        blocks += (jobs[j].rows + a.rpb - 1) / a.rpb;
    }
    if (blocks == 0)
        return 0;
    if (blocks > 0x7fffffff)
        return -EINVAL;
    /* Tokens per block: weights decoded once for up to 2 tokens below 16 and up to 4 from 16
     * (MOE_CUDA_MV_TMAX, 1/2/4/8, sets one bound for all; a token's floats are the same
     * whatever T is). More tokens per block share the decoding but take more registers (95 a
     * thread at 2, 188 at 8 for Q4_K), so fewer warps hide the loads: 4 measured 2.4% slower
     * than 2 at 4 sequences and 2.8-3.9% faster at 16 and 64 (docs/benchmarks.md). */
    /* A matrix of 32768 rows or more (an output head) is decoded once per token group and the
     * 4-token kernels hold 235-254 registers a thread: from 8 tokens it takes 8 a block (the
     * Q6_K head of a 151936-token vocabulary at 16 sequences: 873 -> 623 us on an H100). */
    const int64_t bound = tmax                                                ? tmax
                          : n_tok >= 8 && total_rows >= MV_HEAD_ROWS          ? 8
                          : n_tok >= 16                                      ? 4
                                                                             : 2;
    const int64_t nt = n_tok < bound ? n_tok : bound;
    const int T = nt >= 8 ? 8 : nt >= 4 ? 4 : nt >= 2 ? 2 : 1;
    if constexpr (tok_kind<K>() && tok_kind<K2>())
        if (tile) {
            constexpr int rwt = mv_rw<K, TOK_T>();
            static_assert(TILE_RPB % rwt == 0 && 32 * TILE_RPB / rwt == THREADS,
                          "whole warps a block, THREADS of them");
            static bool smem_set = false;
            if (!smem_set) {
                MOE_CUDA_TRY(cudaFuncSetAttribute(matvec_tok_kernel<K, K2>,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  (int)TILE_SMEM));
                /* All of L1 that may be shared memory, so that 3 blocks fit an SM. */
                MOE_CUDA_TRY(cudaFuncSetAttribute(matvec_tok_kernel<K, K2>,
                                                  cudaFuncAttributePreferredSharedMemoryCarveout,
                                                  (int)cudaSharedmemCarveoutMaxShared));
                smem_set = true;
            }
            dim3 gt((unsigned)blocks, (unsigned)((n_tok + TOK_T - 1) / TOK_T)),
                tt((unsigned)(32 * a.rpb / rwt));
            MOE_CUDA_TRY(moe_launch(matvec_tok_kernel<K, K2>, gt, tt, TILE_SMEM, s, a, n_tok));
            return 0;
        }
    dim3 gr((unsigned)blocks, (unsigned)((n_tok + T - 1) / T)), th((unsigned)(32 * a.rpb / rw));
    if constexpr (preload_kind<K, true>() && preload_kind<K2, true>())
        if (pre && dst) {
            MOE_CUDA_TRY(
                moe_launch(matvec_kernel<K, K2, 1, true, true>, gr, th, smem, s, a, n_tok));
            return 0;
        }
    if constexpr (preload_kind<K, false>() && preload_kind<K2, false>())
        if (pre && !dst) {
            MOE_CUDA_TRY(
                moe_launch(matvec_kernel<K, K2, 1, false, true>, gr, th, smem, s, a, n_tok));
            return 0;
        }
    cudaError_t e = dst      ? moe_launch(matvec_kernel<K, K2, 1, true>, gr, th, smem, s, a, n_tok)
                    : T == 8 ? moe_launch(matvec_kernel<K, K2, 8>, gr, th, 0, s, a, n_tok)
                    : T == 4 ? moe_launch(matvec_kernel<K, K2, 4>, gr, th, 0, s, a, n_tok)
                    : T == 2 ? moe_launch(matvec_kernel<K, K2, 2>, gr, th, 0, s, a, n_tok)
                             : moe_launch(matvec_kernel<K, K2, 1>, gr, th, 0, s, a, n_tok);
    MOE_CUDA_TRY(e);
    return 0;
}

extern "C" int moe_cuda_q8_rows(void)
{
    return MOE_Q8_ROWS;
}

extern "C" int moe_cuda_matvec_supported(uint32_t type)
{
    return moe_qdot_supported(type);
}

static int aligned(const void *p, uintptr_t a)
{
    return ((uintptr_t)p & (a - 1)) == 0;
}

extern "C" int moe_cuda_matvec(uint32_t type, const void *d_w, int64_t n, int64_t rows,
                               const float *d_x, float *d_y, cudaStream_t s)
{
    return moe_cuda_matvec_tok(type, d_w, n, rows, d_x, n, 1, d_y, rows, 0, s);
}

extern "C" int moe_cuda_matvec_tok(uint32_t type, const void *d_w, int64_t n, int64_t rows,
                                   const float *d_x, int64_t ldx, int64_t n_tok, float *d_y,
                                   int64_t ldy, int accumulate, cudaStream_t s)
{
    struct moe_mv_job j = {d_w, rows, d_y, ldy};
    return moe_cuda_matvec_multi(type, &j, 1, n, d_x, ldx, n_tok, accumulate, s);
}

/* The checks of a job list: jobs[0..n1) of type t1, the rest of t2. */
static int check_jobs(uint32_t t1, uint32_t t2, const struct moe_mv_job *jobs, int n_jobs, int n1,
                      int64_t n, const float *d_x, int64_t ldx, int64_t n_tok, bool *vec)
{
    if (!moe_cuda_matvec_supported(t1) || !moe_cuda_matvec_supported(t2))
        return MOE_EUNSUPPORTED;
    if (n <= 0 || n % moe_type_get(t1)->blck != 0 || n % moe_type_get(t2)->blck != 0 ||
        n_jobs < 1 || n_jobs > 3 || n1 < 1 || n1 > n_jobs || n_tok < 0 || !d_x ||
        !aligned(d_x, 16) || ldx < n || ldx % 4 != 0)
        return -EINVAL;
    *vec = true;
    for (int j = 0; j < n_jobs; j++) {
        const uint32_t type = j < n1 ? t1 : t2;
        const uintptr_t need = type == MOE_TYPE_Q4_K || type == MOE_TYPE_Q5_K ? 16
                               : type == MOE_TYPE_F32                          ? 4
                                                                               : 2;
        if (!jobs[j].w || !jobs[j].y || jobs[j].rows < 0 || jobs[j].ldy < jobs[j].rows ||
            !aligned(jobs[j].w, need))
            return -EINVAL;
        *vec = *vec && aligned(jobs[j].w, 16) && moe_row_bytes(type, n) % 16 == 0;
    }
    return 0;
}

static int matvec_multi(uint32_t type, const struct moe_mv_job *jobs, int n_jobs, int64_t n,
                        const float *d_x, int64_t ldx, int64_t n_tok, int accumulate,
                        cudaStream_t s, const float *g, float eps, float *dst,
                        const struct moe_mv_rope *rope = NULL)
{
    bool vec;
    const int rc = check_jobs(type, type, jobs, n_jobs, n_jobs, n, d_x, ldx, n_tok, &vec);
    if (rc || n_tok == 0)
        return rc;
    if (f32_rows(type, jobs, n_jobs, n, n_tok, vec, rope)) {
        if (jobs[0].rows == 0)
            return 0;
        const struct moe_mv_job &j = jobs[0];
        const int n4 = (int)(n / 4);
        if (dst) {
            MOE_CUDA_TRY(moe_launch(f32_norm_rows_for<0>(), dim3((unsigned)j.rows), dim3(32), 0,
                                    s, (const float4 *)j.w, n4, (const float4 *)d_x,
                                    (const float4 *)g, eps, j.y, (float4 *)dst, (int)j.rows,
                                    (uint4 *)NULL));
            return 0;
        }
        const int tt = n_tok >= 16 ? 4 : n_tok >= 2 ? 2 : 1;
        const dim3 gr((unsigned)j.rows, (unsigned)((n_tok + tt - 1) / tt));
        const float4 *w4 = (const float4 *)j.w;
        MOE_CUDA_TRY(tt == 4   ? moe_launch(f32_rows_kernel<4>, gr, dim3(32), 0, s, w4, n4, d_x,
                                            ldx, n_tok, j.y, j.ldy, accumulate)
                     : tt == 2 ? moe_launch(f32_rows_kernel<2>, gr, dim3(32), 0, s, w4, n4, d_x,
                                            ldx, n_tok, j.y, j.ldy, accumulate)
                               : moe_launch(f32_rows_kernel<1>, gr, dim3(32), 0, s, w4, n4, d_x,
                                            ldx, n_tok, j.y, j.ldy, accumulate));
        return 0;
    }
#define ARGS jobs, n_jobs, n_jobs, n, d_x, ldx, n_tok, accumulate, s, g, eps, dst, rope
    /* The plain types read 16 bytes at a time when every row starts 16-byte aligned. */
    switch (type) {
#define CALL(T) return launch<T>(ARGS);
#define CASE(T) case T: CALL(T)
    MOE_PLAIN_KINDS(CALL, vec)
    MOE_QDOT_TYPES(CASE)
#undef CASE
#undef CALL
    }
#undef ARGS
    return MOE_EUNSUPPORTED;
}

/* The pairs of types with a two-type kernel: the K-quant mixes of the _M files (q and k in
 * Q4_K or Q5_K, v in Q6_K on half the layers). */
#define MV_MIXED_PAIRS(X) X(MOE_TYPE_Q4_K, MOE_TYPE_Q6_K) X(MOE_TYPE_Q5_K, MOE_TYPE_Q6_K)

extern "C" int moe_cuda_matvec_mixed_supported(uint32_t t1, uint32_t t2)
{
#define PAIR(A, B) if (t1 == A && t2 == B) return 1;
    MV_MIXED_PAIRS(PAIR)
#undef PAIR
    return 0;
}

extern "C" int moe_cuda_matvec_mixed(uint32_t t1, uint32_t t2, const struct moe_mv_job *jobs,
                                     int n_jobs, int n1, int64_t n, const float *d_x, int64_t ldx,
                                     int64_t n_tok, int accumulate, const float *d_g, float eps,
                                     float *d_dst, const struct moe_mv_rope *rope, cudaStream_t s)
{
    if (!moe_cuda_matvec_mixed_supported(t1, t2))
        return MOE_EUNSUPPORTED;
    bool vec;
    const int rc = check_jobs(t1, t2, jobs, n_jobs, n1, n, d_x, ldx, n_tok, &vec);
    if (rc || n_tok == 0)
        return rc;
    if (d_dst && (!d_g || !aligned(d_g, 16) || !aligned(d_dst, 16) || n % 4 != 0 ||
                  n_tok != 1 || accumulate))
        return -EINVAL;
#define PAIR(A, B)                                                                          \
    if (t1 == A && t2 == B)                                                                 \
        return launch<A, B>(jobs, n_jobs, n1, n, d_x, d_dst ? n : ldx, n_tok, accumulate, s, \
                            d_dst ? d_g : NULL, eps, d_dst, d_dst ? rope : NULL);
    MV_MIXED_PAIRS(PAIR)
#undef PAIR
    return MOE_EUNSUPPORTED;
}

extern "C" int moe_cuda_matvec_multi(uint32_t type, const struct moe_mv_job *jobs, int n_jobs,
                                     int64_t n, const float *d_x, int64_t ldx, int64_t n_tok,
                                     int accumulate, cudaStream_t s)
{
    return matvec_multi(type, jobs, n_jobs, n, d_x, ldx, n_tok, accumulate, s, NULL, 0.0f, NULL);
}

extern "C" size_t moe_cuda_router_staged_bytes(int64_t n)
{
    return sizeof(uint4) * (tc_staged_row_exp((int)(n / 256)) + 1);
}

extern "C" int moe_cuda_router_norm_staged(const struct moe_mv_job *job, int64_t n,
                                           const float *d_src, const float *d_g, float eps,
                                           float *d_dst, uint32_t stage_type, void *d_st,
                                           cudaStream_t s)
{
    bool vec;
    int rc = check_jobs(MOE_TYPE_F32, MOE_TYPE_F32, job, 1, 1, n, d_src, n, 1, &vec);
    if (rc)
        return rc;
    if (!d_g || !d_dst || !d_st || !aligned(d_g, 16) || !aligned(d_dst, 16) ||
        !aligned(d_st, 16) || n % 256 != 0 || !f32_rows(MOE_TYPE_F32, job, 1, n, 1, vec, NULL) ||
        job->rows < 1 || job->rows > 32767 ||
        (stage_type != MOE_TYPE_Q4_K && stage_type != MOE_TYPE_Q6_K))
        return -EINVAL;
    const auto kernel = stage_type == MOE_TYPE_Q4_K ? f32_norm_rows_for<MOE_TYPE_Q4_K>()
                                                    : f32_norm_rows_for<MOE_TYPE_Q6_K>();
    MOE_CUDA_TRY(moe_launch(kernel, dim3((unsigned)(job->rows + n / 256)), dim3(32), 0, s,
                            (const float4 *)job->w, (int)(n / 4), (const float4 *)d_src,
                            (const float4 *)d_g, eps, job->y, (float4 *)d_dst, (int)job->rows,
                            (uint4 *)d_st));
    return 0;
}

extern "C" int moe_cuda_matvec_multi_norm(uint32_t type, const struct moe_mv_job *jobs,
                                          int n_jobs, int64_t n, const float *d_src,
                                          const float *d_g, float eps, float *d_dst,
                                          const struct moe_mv_rope *rope, cudaStream_t s)
{
    if (!d_g || !d_dst || !aligned(d_g, 16) || !aligned(d_dst, 16) || n % 4 != 0)
        return -EINVAL;
    return matvec_multi(type, jobs, n_jobs, n, d_src, n, 1, 0, s, d_g, eps, d_dst, rope);
}

/* Grouped expert kernels (see experts.cuh).
 *
 * Gate/up: one block per (16 rows, slot); a warp computes 4 rows of gate and the same rows of up
 * (8 rows of the same type walked together, as the mat-vec walks two rows of one matrix), so
 * the SwiGLU is applied in registers and only act is written. When gate and up differ in type,
 * each is computed by its own pass into scratch and the SwiGLU is a third small kernel.
 *
 * Down: one block per (16 rows, token) with one warp per chosen expert (warps loop when k is
 * above 8): each warp completes its expert's dot products for the 16 rows, then one thread per
 * row weights and adds them in the token's top-k order and adds the sum into the residual: the
 * fixed-order combine of the CPU backend, fused. */
#include "worker/cuda/experts.cuh"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "store/err.h"
#include "store/ggml_type.h"
}
#include "worker/cuda/cuda_check.cuh"
#include "worker/cuda/env_opts.h"
#include "worker/cuda/launch.cuh"
#include "worker/cuda/ops_dev.cuh"
#include "worker/cuda/qdot.cuh"
#include "worker/cuda/smem.cuh"

#include "worker/cuda/experts_dev.cuh"
#include "worker/cuda/mv_tc.h"
#include "worker/cuda/mv_tc_dev.cuh"
#include "worker/cuda/offload_dev.cuh"

/* Entry e of a pointer table; fresh: one that a block of this launch may have changed
 * (resolve_walk), read past L1. */
static __device__ __forceinline__ const uint8_t *tab_ptr(const uint8_t *const *tab, int e,
                                                         bool fresh)
{
    return fresh ? (const uint8_t *)__ldcg((const unsigned long long *)(tab + e)) : tab[e];
}

/* The lookup of a gate/up launch that resolves its own layer (struct moe_cuda_gu_resolve), by
 * the whole block after the routing: sel, the block's choices (kuse, shared memory), e its
 * expert, wsm the walk's shared memory. Returns whether the block must read its expert's table
 * entries and copy sources afresh (a block that waited for the walk, or made it). */
static __device__ bool gu_resolve(const moe_cuda_gu_resolve &rs, const int32_t *sel, int kuse,
                                  int e, int32_t *wsm)
{
    __shared__ unsigned long long s_epoch;
    __shared__ int s_first, s_fresh;
    volatile unsigned long long *sync = rs.sync;
    if (threadIdx.x == 0) {
        const unsigned long long t = atomicAdd(rs.sync, 1ull);
        const unsigned long long G = (unsigned long long)gridDim.x * gridDim.y;
        s_epoch = t / G + 1;
        s_first = t % G == 0;
    }
    __syncthreads();
    const unsigned long long ep = s_epoch;
    if (s_first) {
        const struct moe_cuda_off_layer L = *rs.off;
        if (!resolve_fast(L, sel, kuse, rs.fl)) {
            /* A miss (nothing changed yet): the step's other blocks are told before the walk
             * changes the state. */
            if (threadIdx.x == 0) {
                sync[1] = ep;
                __threadfence();
            }
            __syncthreads();
            resolve_walk(L, sel, kuse, rs.fl, 0, wsm);
        }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0)
            sync[2] = ep;
        return true;
    }
    if (threadIdx.x == 0) {
        /* The expert had a slot before the step (read before the walk's notice): its tables and
         * bytes stay for the step (the walk never evicts a chosen expert). Else wait. */
        const int32_t s = __ldcg(rs.off->slot_of + e);
        __threadfence();
        const int wait = s < 0 || sync[1] == ep;
        if (wait)
            while (sync[2] < ep)
                __nanosleep(64);
        __threadfence();
        s_fresh = wait;
    }
    __syncthreads();
    return s_fresh;
}

/* The expert of the block's slot: with rt.rl every warp first routes the slot's token itself
 * (route_warp on the router's logits, into its own shared memory at rsm: sel_e is not read), and
 * warp 0 of the token's first block (x 0, slot t·k) also stores the choices in rt.sel_e /
 * rt.sel_w for the down kernel and counts them: the routing of the step without a launch of its
 * own. With rs.off the block then resolves the layer's choices (gu_resolve; every thread of the
 * block must call this), and *fresh says whether the tables must be read afresh. */
template <class Hook = route_no_hook>
static __device__ __forceinline__ int gu_expert(const moe_cuda_route_in &rt,
                                                const moe_cuda_gu_resolve &rs,
                                                const int32_t *__restrict__ sel_e, int kuse,
                                                int64_t slot, float *rsm, bool *fresh,
                                                const Hook &after_loads = Hook{})
{
    int e;
    if (rt.rl) {
        const int lane = threadIdx.x & 31;
        const int64_t t = slot / kuse;
        float *p = rsm + (threadIdx.x >> 5) * route_smem_floats(rt.nexp, kuse);
        int32_t *se = (int32_t *)(p + rt.nexp);
        float *sw = p + rt.nexp + kuse;
        const bool writer = blockIdx.x == 0 && slot % kuse == 0 && threadIdx.x < 32;
        route_warp(rt.rl + t * rt.ldl, rt.nexp, kuse, rt.norm_topk, se, sw,
                   writer ? rt.counts : NULL, p, after_loads);
        if (writer)
            for (int j = lane; j < kuse; j += 32) {
                rt.sel_e[t * kuse + j] = se[j];
                rt.sel_w[t * kuse + j] = sw[j];
            }
        e = se[slot % kuse];
    } else {
        e = sel_e[slot];
        after_loads();
    }
    *fresh = false;
    if (rs.off) /* warp 0's choices; the walk's memory after every warp's routing */
        *fresh = gu_resolve(rs, (const int32_t *)(rsm + rt.nexp), kuse, e,
                           (int32_t *)(rsm + GU_WARPS * route_smem_floats(rt.nexp, kuse)));
    return e;
}

/* mode 0: act = silu(gate)·up (gate, up same type K); mode 1: out = W·x for table a only.
 * fa, fb (or NULL): the fill sources of tables a and b (warp_fill_rows): each warp first copies
 * the rows it reads of an expert whose copies the layer's resolve left to this kernel. The
 * routing and the resolve in the launch: gu_expert. Dynamic shared memory: GU_WARPS ·
 * route_smem_floats(nexp, k) floats, then with rs.off the walk's (moe_cuda_resolve_smem). */
template <int K, int MODE>
static __global__ void __launch_bounds__(32 * GU_WARPS)
gate_up_kernel(const uint8_t *const *__restrict__ ga, const uint8_t *const *__restrict__ ua,
               size_t row_bytes, unsigned block_bytes, int nu, int64_t ff,
               const float *__restrict__ x, int64_t ldx, int kuse,
               const int32_t *__restrict__ sel_e, float *__restrict__ out, int64_t ldo,
               const uint8_t *__restrict__ etype, int want, const moe_cuda_route_in rt,
               const uint8_t *const *__restrict__ fa, const uint8_t *const *__restrict__ fb,
               const moe_cuda_gu_resolve rs)
{
    pdl_wait();
    pdl_trigger();
    extern __shared__ float rsm[];
    const int64_t r0 = ((int64_t)blockIdx.x * GU_WARPS + (threadIdx.x >> 5)) * GU_ROWS;
    if (r0 >= ff && !rs.off) /* with rs.off every thread takes part in the lookup */
        return;
    const int64_t slot = blockIdx.y;
    bool fresh;
    const int e = gu_expert(rt, rs, sel_e, kuse, slot, rsm, &fresh);
    if (r0 >= ff)
        return;
    if (etype && etype[e] != want)
        return; /* another pass computes this expert (a layer of mixed types) */
    const uint8_t *g = tab_ptr(ga, e, fresh);
    const uint8_t *u = MODE != 0 ? g : tab_ptr(ua, e, fresh);
    if (fa && (!rs.off || fresh)) {
        const int64_t rows = ff - r0 < GU_ROWS ? ff - r0 : GU_ROWS;
        warp_fill_rows(g, tab_ptr(fa, e, fresh), r0, rows, row_bytes);
        if (MODE == 0)
            warp_fill_rows(u, tab_ptr(fb, e, fresh), r0, rows, row_bytes);
    }
    gate_up_warp<K, MODE>(g, u, row_bytes, block_bytes, nu, ff, x + (slot / kuse) * ldx, r0,
                          out + slot * ldo);
}

/* Gate and up of the one-token gu_tc_tile (ONE) through one copy of the walk's code (1, the
 * default) or two (0), a build-time setting with the same floats either way. */
#ifndef MOE_GU_ONE_COPY
#define MOE_GU_ONE_COPY 1
#endif

/* Where gu_tc_tile<K, 1, false, false, true> reads the row's raw copy: after the staging and the
 * warps' sums in its shared memory sm. */
static __device__ __forceinline__ float *gu_raw_area(uint4 *sm, int nsb)
{
    return (float *)((float4 *)(sm + (size_t)nsb * 66) + 2 * GU_WARPS * 32);
}

/* The 16-row tile rt0 of one expert's gate g and up u (Q4_K or Q6_K) on tensor cores for NT
 * staged columns: xr[c] the input rows of columns c < nt (the others repeat the last), o[c] their
 * act rows; sm: shared memory for the staging (tc_stage_bytes(NT, nsb)) and the warps' sums (2 ·
 * GU_WARPS · 32 float4). Warp w takes blocks w, w + GU_WARPS, ... and the warps' sums are added in
 * warp order, so a column's floats depend on the row length only, not on NT or the other columns.
 * ST: the inputs come staged once per step in st (moe_cuda_tc_stage), column c reading token
 * tok[c]'s, and sm holds the sums only (the same floats: the same staging functions). The whole
 * block calls it; it ends with a barrier. RAW (one token, its own row): the caller has put the
 * row's copy into gu_raw_area in flight (tc_raw_copy), and it is staged from there, or
 * (staged_exp) it has put the row's staged form into xs and sxs in flight, whose exponent is
 * at staged_exp. ONE: the block of a one-token launch (gate and up of Q4_K through one copy of
 * the code, below). */
template <int K, int NT, bool ST = false, bool AS = false, bool RAW = false, bool ONE = false>
static __device__ __forceinline__ void gu_tc_tile(const uint8_t *g, const uint8_t *u,
                                                  size_t row_bytes, int nsb, int64_t ff,
                                                  int64_t rt0, const float *const *xr,
                                                  float *const *o, int nt, uint4 *sm,
                                                  const tc_staged &st = tc_staged{},
                                                  const int64_t *tok = nullptr,
                                                  const int *staged_exp = nullptr)
{
    __shared__ unsigned s_amax[NT];
    __shared__ int s_exp[NT];
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, g8 = lane >> 2, t = lane & 3;
    const int64_t row0 = rt0 + g8 < ff ? rt0 + g8 : ff - 1;
    const int64_t row1 = rt0 + g8 + 8 < ff ? rt0 + g8 + 8 : ff - 1;
    using TK = tc_kind<K>;
    const size_t BB = TK::block_bytes;
    /* AS: g and u hold the tile's rows only (row rt0 first), copied by cp_async16 calls of this
     * block that are still in flight: they are waited for after the staging. */
    const int64_t rbase = AS ? rt0 : 0;
    const uint8_t *g0 = g + (size_t)(row0 - rbase) * row_bytes;
    const uint8_t *g1 = g + (size_t)(row1 - rbase) * row_bytes;
    const uint8_t *u0 = u + (size_t)(row0 - rbase) * row_bytes;
    const uint8_t *u1 = u + (size_t)(row1 - rbase) * row_bytes;
    typename TK::raw rg = {}, ru = {};
    static_assert(!RAW || (NT == 1 && !ST && !AS), "the raw copy stages one token's own row");
    /* RAW: the caller has put the row's copy into gu_raw_area in flight (tc_raw_copy), ahead
     * of the weights' loads; it is staged from there (tc_stage_raw). */
    float *raw = RAW ? gu_raw_area(sm, nsb) : nullptr;
    if (!AS && wi < nsb) {
        rg = TK::load(g0 + (size_t)wi * BB, g1 + (size_t)wi * BB, t);
        ru = TK::load(u0 + (size_t)wi * BB, u1 + (size_t)wi * BB, t);
    }
    uint4 *xs = sm;
    uint2 *sxs = (uint2 *)(xs + (size_t)NT * nsb * 64);
    float4 *red = ST ? (float4 *)sm : (float4 *)(xs + (size_t)NT * nsb * 66); /* [2][GU_WARPS][32] */
    int gx = g8 & (NT - 1);
    if constexpr (ST) {
        /* The lane's column: its token's staged row (tc_rows reads column 0 of it). */
        xs = st.xs + (size_t)tok[gx] * nsb * 64;
        sxs = st.sxs + (size_t)tok[gx] * nsb * 4;
        gx = 0;
        if (threadIdx.x < NT)
            s_exp[threadIdx.x] = st.exp[tok[threadIdx.x]];
        __syncthreads();
    } else if constexpr (RAW) {
        if (staged_exp) {
            /* The caller copied the row staged by the router launch into xs and sxs. */
            if (threadIdx.x == 0)
                s_exp[0] = __ldcg(staged_exp);
            cp_async_wait_all();
            __syncthreads();
        } else {
            tc_stage_raw<K>(raw, nsb, xs, sxs, s_exp, s_amax);
        }
    } else {
        tc_stage<NT, K>(xr, nsb, xs, sxs, s_exp, s_amax);
    }
    if constexpr (AS) {
        cp_async_wait_all();
        __syncthreads();
        if (wi < nsb) {
            rg = TK::load(g0 + (size_t)wi * BB, g1 + (size_t)wi * BB, t);
            ru = TK::load(u0 + (size_t)wi * BB, u1 + (size_t)wi * BB, t);
        }
    }
    if constexpr (ONE && MOE_GU_ONE_COPY && K == MOE_TYPE_Q4_K) {
        /* Gate, then up, through one copy of the walk's code (a loop that is not unrolled), and
         * each block's products through tc_block_rolled: a one-token launch (ONE) runs each
         * instruction of it a few times per warp only, and its warps wait for the instructions'
         * fetches, so less code is fewer of those waits. The same operations, so the same
         * floats. (Q6_K keeps two copies: its raw bytes take too many registers to be selected
         * between; so do the kernels of grouped steps, which run their code over many tokens
         * and measured slower with one.) */
#pragma unroll 1
        for (int m = 0; m < 2; m++) {
            float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tc_rows<K, true>(m ? u0 : g0, m ? u1 : g1, t, wi, GU_WARPS, nsb, m ? ru : rg, xs,
                             sxs, gx, a);
            red[(m * GU_WARPS + wi) * 32 + lane] = make_float4(a[0], a[1], a[2], a[3]);
        }
    } else {
        float ag[4] = {0.0f, 0.0f, 0.0f, 0.0f}, au[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        tc_rows<K>(g0, g1, t, wi, GU_WARPS, nsb, rg, xs, sxs, gx, ag);
        tc_rows<K>(u0, u1, t, wi, GU_WARPS, nsb, ru, xs, sxs, gx, au);
        red[wi * 32 + lane] = make_float4(ag[0], ag[1], ag[2], ag[3]);
        red[(GU_WARPS + wi) * 32 + lane] = make_float4(au[0], au[1], au[2], au[3]);
    }
    __syncthreads();
    if (wi == 0) {
        float4 sg = red[lane], su = red[GU_WARPS * 32 + lane];
        for (int k = 1; k < GU_WARPS; k++) {
            const float4 vg = red[k * 32 + lane], vu = red[(GU_WARPS + k) * 32 + lane];
            sg.x += vg.x, sg.y += vg.y, sg.z += vg.z, sg.w += vg.w;
            su.x += vu.x, su.y += vu.y, su.z += vu.z, su.w += vu.w;
        }
        const float G[4] = {sg.x, sg.y, sg.z, sg.w}, U[4] = {su.x, su.y, su.z, su.w};
        UNROLL
        for (int j = 0; j < 2; j++) {
            const int col = 2 * t + j; /* C columns 2t, 2t+1: rows g8 (G[j]), g8 + 8 (G[2+j]) */
            if (col >= NT || col >= nt)
                continue;
            const float back = ldexpf(1.0f, s_exp[col]);
            if (rt0 + g8 < ff)
                o[col][rt0 + g8] = silu_f(G[j] * back) * (U[j] * back);
            if (rt0 + g8 + 8 < ff)
                o[col][rt0 + g8 + 8] = silu_f(G[2 + j] * back) * (U[2 + j] * back);
        }
    }
    __syncthreads(); /* the staging area is free for the block's next use */
}

/* Gate/up of Q4_K or Q6_K experts on tensor cores (mv_tc_dev.cuh), one token per block: the
 * same grid, prologue and shared memory as gate_up_kernel<K, 0> (gu_expert), then gu_tc_tile with
 * the slot's input staged after that shared memory (tc_off floats in, 16-byte aligned). AS (no
 * fills, no resolve): the block first puts copies of its tile's gate and up rows in flight into
 * shared memory at byte w_off (2 · TC_ROWS rows), all at once and without registers, and reads
 * them from there after the staging: one round trip to memory for the tile instead of one per
 * block of the walk, and the same bytes, so the same floats. */
template <int K, bool AS = false, bool SX = false>
static __global__ void __launch_bounds__(32 * GU_WARPS, 3)
gate_up_tc_kernel(const uint8_t *const *__restrict__ ga, const uint8_t *const *__restrict__ ua,
                  size_t row_bytes, int nsb, int64_t ff, const float *__restrict__ x, int64_t ldx,
                  int kuse, const int32_t *__restrict__ sel_e, float *__restrict__ out,
                  int64_t ldo, const moe_cuda_route_in rt, const uint8_t *const *__restrict__ fa,
                  const uint8_t *const *__restrict__ fb, const moe_cuda_gu_resolve rs,
                  size_t tc_off, size_t w_off)
{
    pdl_wait();
    pdl_trigger();
    extern __shared__ float rsm[];
    const int wi = threadIdx.x >> 5;
    const int64_t rt0 = (int64_t)blockIdx.x * TC_ROWS, slot = blockIdx.y;
    /* The row's copy put in flight during the routing, behind the logits' loads (gu_tc_tile's
     * RAW), or its staged form where the router launch made it (rt.staged: one token). */
    static_assert(!SX || !AS, "the staged row goes where a block stages its own");
    const auto copy_row = [&]() {
        if constexpr (SX)
            block_copy_async((uint8_t *)(rsm + tc_off), (const uint8_t *)rt.staged,
                             tc_stage_bytes(1, nsb));
        else if constexpr (!AS)
            tc_raw_copy(gu_raw_area((uint4 *)(rsm + tc_off), nsb), x + (slot / kuse) * ldx,
                        (int64_t)nsb * 256, threadIdx.x, blockDim.x);
    };
    bool fresh;
    const int e = gu_expert(rt, rs, sel_e, kuse, slot, rsm, &fresh, copy_row);
    const uint8_t *g = tab_ptr(ga, e, fresh);
    const uint8_t *u = tab_ptr(ua, e, fresh);
    if (fa && (!rs.off || fresh)) {
        /* Each warp copies 4 of the tile's rows, as gate_up_kernel's warps do; every warp reads
         * every row after the barrier. */
        const int64_t r0 = rt0 + 4 * wi, rows = ff - r0 < 4 ? ff - r0 : 4;
        warp_fill_rows(g, tab_ptr(fa, e, fresh), r0, rows, row_bytes);
        warp_fill_rows(u, tab_ptr(fb, e, fresh), r0, rows, row_bytes);
        __syncthreads();
    }
    if constexpr (AS) {
        uint8_t *wg = (uint8_t *)rsm + w_off, *wu = wg + TC_ROWS * row_bytes;
        const int64_t nr = ff - rt0 < TC_ROWS ? ff - rt0 : TC_ROWS;
        block_copy_async(wg, g + (size_t)rt0 * row_bytes, (size_t)nr * row_bytes);
        block_copy_async(wu, u + (size_t)rt0 * row_bytes, (size_t)nr * row_bytes);
        g = wg;
        u = wu;
    }
    const float *xr[1] = {x + (slot / kuse) * ldx};
    float *o[1] = {out + slot * ldo};
    gu_tc_tile<K, 1, false, AS, !AS, true>(
        g, u, row_bytes, nsb, ff, rt0, xr, o, 1, (uint4 *)(rsm + tc_off), tc_staged{}, nullptr,
        SX ? (const int *)((const uint4 *)rt.staged + tc_staged_row_exp(nsb)) : nullptr);
}

int moe_cuda_expert_tc_env(void)
{
    const char *v = getenv("MOE_CUDA_TC");
    const int mask = !v || !*v || !strcmp(v, "1") ? MOE_CUDA_TC_GATE_UP | MOE_CUDA_TC_DOWN
                     : !strcmp(v, "gu")           ? MOE_CUDA_TC_GATE_UP
                     : !strcmp(v, "down")         ? MOE_CUDA_TC_DOWN
                     : !strcmp(v, "dense")        ? MOE_CUDA_TC_DENSE | MOE_CUDA_TC_HEAD
                     : !strcmp(v, "layers")       ? MOE_CUDA_TC_ANY
                     : !strcmp(v, "o")            ? MOE_CUDA_TC_GATE_UP | MOE_CUDA_TC_DOWN |
                                                        MOE_CUDA_TC_O
                     : !strcmp(v, "all")          ? MOE_CUDA_TC_ANY | MOE_CUDA_TC_HEAD
                                                  : 0;
    const int cap = (int)moe_env_int("MOE_CUDA_DOWN_TC_WARPS", 0, 15, 0);
    const char *as = getenv("MOE_CUDA_TC_ASYNC");
    const int async = !as || !*as              ? MOE_CUDA_TC_ASYNC_GROUPED
                      : !strcmp(as, "1")        ? MOE_CUDA_TC_ASYNC_ANY
                      : !strcmp(as, "grouped")  ? MOE_CUDA_TC_ASYNC_GROUPED
                                                : 0;
    const char *ws = getenv("MOE_CUDA_DOWN_WS");
    const int wsb = !ws || !*ws          ? MOE_CUDA_TC_DOWN_WS
                    : !strcmp(ws, "all") ? MOE_CUDA_TC_DOWN_WS_ALL
                    : !strcmp(ws, "0")   ? 0
                                         : MOE_CUDA_TC_DOWN_WS;
    return mask | cap << 8 | async | wsb;
}

bool moe_cuda_expert_tc(int tc, uint32_t type)
{
    return moe_cuda_matvec_tc_supported(type) &&
           (tc & (MOE_CUDA_TC_GATE_UP | MOE_CUDA_TC_DOWN)) != 0;
}

static __global__ void swiglu_kernel(const float *__restrict__ g, const float *__restrict__ u,
                                     float *__restrict__ act, int64_t count)
{
    pdl_wait();
    pdl_trigger();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count)
        act[i] = silu_f(g[i]) * u[i];
}


/* DOWN_ROWS rows of one token per block (down_block, experts_dev.cuh). */
template <int K>
static __global__ void __launch_bounds__(32 * DOWN_WARPS)
down_kernel(const uint8_t *const *__restrict__ da, size_t row_bytes, unsigned block_bytes, int nu,
            int64_t E, const float *__restrict__ act, int64_t ldact, int kuse,
            const int32_t *__restrict__ sel_e, const float *__restrict__ sel_w,
            float *__restrict__ h, int64_t ldh, const uint8_t *const *__restrict__ fill)
{
    pdl_wait();
    pdl_trigger();
    extern __shared__ float part[]; /* [kuse][DOWN_ROWS] */
    const int64_t t = blockIdx.y;
    down_block<K>(da, row_bytes, block_bytes, nu, E, act + t * kuse * ldact, ldact, kuse,
                  sel_e + t * kuse, sel_w + t * kuse, h + t * ldh, (int64_t)blockIdx.x * DOWN_ROWS,
                  part, fill);
}

/* The floats of a down warp's own area after part: the raw copy of its act row and, with its
 * tile's rows copied too (WS, row_bytes > 0), TC_ROWS rows. */
static __host__ __device__ __forceinline__ size_t down_ws_floats(int nsb, size_t row_bytes)
{
    return (size_t)tc_raw_floats((int64_t)nsb * 256) + TC_ROWS * row_bytes / sizeof(float);
}

/* Down of Q4_K or Q6_K experts on tensor cores, TC_ROWS rows of one token per block: warp j
 * takes the token's choices j, j + warps, ... (its input staged by itself, tc_stage_warp, scaled
 * by that input's own power of two) over the 16-row tile and the whole row, then one thread per
 * row weights and adds the choices in top-k order into h, as down_block does. Dynamic shared
 * memory: per warp a staging area (tc_stage_bytes(1, nsb)), then part [kuse][TC_ROWS] floats,
 * then with RAW per warp the raw copy of its act row, and with WS its choice's TC_ROWS rows
 * (down_ws_floats each).
 * fill (or NULL): as down_kernel's, each warp copies the rows it reads first. */
template <int K, bool AS = false, bool RAW = false, bool WS = false>
static __global__ void __launch_bounds__(32 * DOWN_WARPS)
down_tc_kernel(const uint8_t *const *__restrict__ da, size_t row_bytes, int nsb, int64_t E,
               const float *__restrict__ act, int64_t ldact, int kuse,
               const int32_t *__restrict__ sel_e, const float *__restrict__ sel_w,
               float *__restrict__ h, int64_t ldh, const uint8_t *const *__restrict__ fill)
{
    pdl_wait();
    pdl_trigger();
    extern __shared__ uint4 dsm[];
    const int w = threadIdx.x >> 5, nw = blockDim.x >> 5, lane = threadIdx.x & 31;
    const int g8 = lane >> 2, t = lane & 3;
    const int64_t tok = blockIdx.y, r0 = (int64_t)blockIdx.x * TC_ROWS;
    uint4 *xs = dsm + (size_t)w * nsb * 66;
    uint2 *sxs = (uint2 *)(xs + (size_t)nsb * 64);
    float *part = (float *)(dsm + (size_t)nw * nsb * 66);
    const int32_t *se = sel_e + tok * kuse;
    const float *sw = sel_w + tok * kuse;
    combine_w cw;
    if (threadIdx.x < TC_ROWS)
        cw.load(sw, kuse);
    const int64_t row0 = r0 + g8 < E ? r0 + g8 : E - 1, row1 = r0 + g8 + 8 < E ? r0 + g8 + 8 : E - 1;
    /* AS (no fills): the tile's rows of every choice are first copied into shared memory after
     * part (kuse · TC_ROWS rows, choice j's from row r0 on), all at once and without registers,
     * and read from there: one round trip to memory instead of one per block of the walk, the
     * same bytes and so the same floats. */
    uint8_t *wrows = (uint8_t *)(part + (size_t)kuse * TC_ROWS);
    if constexpr (AS) {
        const int64_t nr = E - r0 < TC_ROWS ? E - r0 : TC_ROWS;
        for (int j = 0; j < kuse; j++)
            block_copy_async(wrows + (size_t)j * TC_ROWS * row_bytes,
                             da[se[j]] + (size_t)r0 * row_bytes, (size_t)nr * row_bytes);
        cp_async_wait_all();
        __syncthreads();
    }
    for (int j = w; j < kuse; j += nw) {
        /* RAW: the act row copied into the warp's area after part first, ahead of the
         * weights' loads and of the expert's lookup (tc_stage_warp_raw). */
        static_assert(!WS || (RAW && !AS), "the tile's copy goes after the act row's");
        float *xraw = (float *)(part + (size_t)kuse * TC_ROWS) +
                      (size_t)w * down_ws_floats(nsb, WS ? row_bytes : 0);
        if constexpr (RAW)
            tc_raw_copy(xraw, act + (tok * kuse + j) * ldact, (int64_t)nsb * 256, lane, 32);
        const uint8_t *base = AS ? wrows + (size_t)j * TC_ROWS * row_bytes : da[se[j]];
        if (!AS && fill)
            warp_fill_rows(base, fill[se[j]], r0, E - r0 < TC_ROWS ? E - r0 : TC_ROWS, row_bytes);
        const int64_t rb0 = AS || WS ? r0 : 0;
        typename tc_kind<K>::raw raw;
        int ex;
        if constexpr (WS) {
            /* The tile's rows of this choice copied after the act row (two groups): the staging
             * waits for the row only, the walk then reads the rows from shared memory. */
            uint8_t *wt = (uint8_t *)(xraw + tc_raw_floats(nsb * 256));
            cp_async_commit();
            copy_async(wt, base + (size_t)r0 * row_bytes,
                       (size_t)(E - r0 < TC_ROWS ? E - r0 : TC_ROWS) * row_bytes, lane, 32);
            cp_async_commit();
            base = wt;
            ex = tc_stage_warp_raw<K, 1>(xraw, nsb, xs, sxs);
            cp_async_wait_group<0>();
            __syncwarp();
        }
        const uint8_t *p0 = base + (size_t)(row0 - rb0) * row_bytes;
        const uint8_t *p1 = base + (size_t)(row1 - rb0) * row_bytes;
        raw = tc_kind<K>::load(p0, p1, t);
        if constexpr (!WS)
            ex = RAW ? tc_stage_warp_raw<K>(xraw, nsb, xs, sxs)
                     : tc_stage_warp<K>(act + (tok * kuse + j) * ldact, nsb, xs, sxs);
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        tc_rows<K>(p0, p1, t, 0, 1, nsb, raw, xs, sxs, 0, acc);
        const float back = ldexpf(1.0f, ex);
        if (t == 0) {
            part[j * TC_ROWS + g8] = acc[0] * back;
            part[j * TC_ROWS + g8 + 8] = acc[2] * back;
        }
        __syncwarp(); /* the staging area is the warp's next choice's */
    }
    __syncthreads();
    if (threadIdx.x < TC_ROWS && r0 + threadIdx.x < E)
        h[tok * ldh + r0 + threadIdx.x] += cw.sum(sw, kuse, part, TC_ROWS, threadIdx.x);
}

/* ---------------------------------------------------------------- grouped by expert */

/* h[t] += Σ_j sel_w[t][j] · dout[pos(t·k + j)], j in order: the combine of expert outputs stored
 * in grouped (expert-major) order. */
static __global__ void combine_pos_kernel(const float *__restrict__ dout, int64_t ldd, int64_t E,
                                          int kuse, const float *__restrict__ sel_w,
                                          const int32_t *__restrict__ slot_pos,
                                          float *__restrict__ h, int64_t ldh)
{
    pdl_wait();
    pdl_trigger();
    const int64_t t = blockIdx.y;
    for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < E;
         r += (int64_t)gridDim.x * blockDim.x) {
        float tot = 0.0f;
        for (int j = 0; j < kuse; j++)
            tot += sel_w[t * kuse + j] * dout[(int64_t)slot_pos[t * kuse + j] * ldd + r];
        h[t * ldh + r] += tot;
    }
}

/* One block: the step's slots grouped by expert. counts by shared-memory atomics (their values
 * do not depend on the order), offsets by a block scan, and each expert's slots listed in slot
 * order by one thread walking all slots, so the grouping is deterministic. */
static __global__ void __launch_bounds__(1024)
group_kernel(const int32_t *__restrict__ sel_e, int n_slots, int nexp, int kuse,
             int32_t *__restrict__ ex_off, int32_t *__restrict__ slot_list,
             int32_t *__restrict__ act_list, int32_t *__restrict__ n_active,
             int32_t *__restrict__ slot_tok, int32_t *__restrict__ slot_pos)
{
    pdl_wait();
    pdl_trigger();
    extern __shared__ int32_t sh[]; /* cnt[nexp], off[nexp], act[nexp] */
    int32_t *cnt = sh, *off = sh + nexp, *aix = sh + 2 * nexp;
    __shared__ int32_t wsum[2][32];
    for (int e = threadIdx.x; e < nexp; e += blockDim.x)
        cnt[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x)
        atomicAdd(&cnt[sel_e[s]], 1);
    __syncthreads();
    /* Exclusive scans of cnt and of (cnt > 0), chunk per thread, then across the block. */
    const int C = (nexp + blockDim.x - 1) / blockDim.x, e0 = threadIdx.x * C;
    int32_t a = 0, f = 0;
    for (int e = e0; e < e0 + C && e < nexp; e++) {
        a += cnt[e];
        f += cnt[e] > 0;
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int32_t ia = a, iff = f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int32_t ya = __shfl_up_sync(0xffffffffu, ia, o), yf = __shfl_up_sync(0xffffffffu, iff, o);
        if (lane >= o) {
            ia += ya;
            iff += yf;
        }
    }
    if (lane == 31) {
        wsum[0][w] = ia;
        wsum[1][w] = iff;
    }
    __syncthreads();
    if (w == 0) {
        int32_t va = lane < (int)(blockDim.x >> 5) ? wsum[0][lane] : 0;
        int32_t vf = lane < (int)(blockDim.x >> 5) ? wsum[1][lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int32_t ya = __shfl_up_sync(0xffffffffu, va, o), yf = __shfl_up_sync(0xffffffffu, vf, o);
            if (lane >= o) {
                va += ya;
                vf += yf;
            }
        }
        wsum[0][lane] = va;
        wsum[1][lane] = vf;
    }
    __syncthreads();
    int32_t ra = ia - a + (w ? wsum[0][w - 1] : 0), rf = iff - f + (w ? wsum[1][w - 1] : 0);
    for (int e = e0; e < e0 + C && e < nexp; e++) {
        off[e] = ra;
        aix[e] = rf;
        ra += cnt[e];
        rf += cnt[e] > 0;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nexp; e += blockDim.x) {
        ex_off[e] = off[e];
        if (cnt[e])
            act_list[aix[e]] = e;
    }
    if (threadIdx.x == 0) {
        ex_off[nexp] = n_slots;
        *n_active = aix[nexp - 1] + (cnt[nexp - 1] > 0);
    }
    __syncthreads(); /* off[] was read above; from here it is each expert's cursor */
    /* Each expert's slots in slot order: warp w owns experts w, w + nw, ... (off[e] is its
     * cursor) and walks the slots 32 at a time; a ballot ranks the lanes that chose e. */
    const int nw = (int)(blockDim.x >> 5);
    for (int s0 = 0; s0 < n_slots; s0 += 32) {
        const int s = s0 + lane;
        const int32_t ev = s < n_slots ? sel_e[s] : -1;
        for (int e = w; e < nexp; e += nw) {
            const unsigned m = __ballot_sync(0xffffffffu, ev == e);
            if (!m)
                continue;
            if (ev == e) {
                const int32_t pos = off[e] + __popc(m & ((1u << lane) - 1u));
                slot_list[pos] = s;
                if (slot_tok) {
                    slot_tok[pos] = s / kuse;
                    slot_pos[s] = pos;
                }
            }
            __syncwarp();
            if (lane == 0)
                off[e] += __popc(m);
            __syncwarp();
        }
    }
}

/* The slots slot_list[i..i+T) and their input rows: row slot / per of x (per: the slots of a
 * token for the gate/up input, 1 for the per-slot down input). */
template <int T>
static __device__ __forceinline__ void chunk_inputs(const int32_t *slot_list, int32_t i,
                                                    const float *x, int64_t ldx, int per,
                                                    int32_t *slot, const float **xs)
{
#pragma unroll
    for (int c = 0; c < T; c++) {
        slot[c] = slot_list[i + c];
        xs[c] = x + (int64_t)(slot[c] / per) * ldx;
    }
}

/* T slots slot_list[i..i+T) of one expert through GUG_ROWS rows of gate and up (rowp: gate row,
 * up row, alternating): act = silu(gate·x)·(up·x) of each slot. */
template <int K, int T>
static __device__ __forceinline__ void gu_chunk(const uint8_t *const *rowp, unsigned block_bytes,
                                                int nu, int64_t ff, const float *x, int64_t ldx,
                                                int kuse, const int32_t *slot_list, int32_t i,
                                                int64_t r0, float *out, int64_t ldo)
{
    const int lane = threadIdx.x & 31;
    int32_t slot[T];
    const float *xs[T];
    chunk_inputs<T>(slot_list, i, x, ldx, kuse, slot, xs);
    float acc[T][2 * GUG_ROWS];
    row_dots_multi<K, 2 * GUG_ROWS, T>(rowp, block_bytes, nu, xs, acc);
#pragma unroll
    for (int c = 0; c < T; c++)
#pragma unroll
        for (int r = 0; r < GUG_ROWS; r++)
            if (lane == r && r0 + r < ff)
                out[(int64_t)slot[c] * ldo + r0 + r] = silu_f(acc[c][2 * r]) * acc[c][2 * r + 1];
}

/* Gate/up grouped: one block per (16 rows, active expert), looping over the expert's slots
 * GROUP_T at a time (the last ones 2 or 1 at a time); the weights come from HBM once per step
 * and are decoded once per chunk of slots. Same arithmetic per slot as gate_up_kernel. */
template <int K>
static __global__ void __launch_bounds__(32 * GU_WARPS)
gate_up_grouped_kernel(const uint8_t *const *__restrict__ ga, const uint8_t *const *__restrict__ ua,
                       size_t row_bytes, unsigned block_bytes, int nu, int64_t ff,
                       const float *__restrict__ x, int64_t ldx, int kuse,
                       const int32_t *__restrict__ ex_off, const int32_t *__restrict__ slot_list,
                       const int32_t *__restrict__ act_list, const int32_t *__restrict__ n_active,
                       float *__restrict__ out, int64_t ldo)
{
    pdl_wait();
    pdl_trigger();
    if ((int)blockIdx.y >= *n_active)
        return;
    const int64_t r0 = ((int64_t)blockIdx.x * GU_WARPS + (threadIdx.x >> 5)) * GUG_ROWS;
    if (r0 >= ff)
        return;
    const int e = act_list[blockIdx.y];
    const uint8_t *rowp[2 * GUG_ROWS];
#pragma unroll
    for (int r = 0; r < GUG_ROWS; r++) {
        const int64_t row = r0 + r < ff ? r0 + r : r0;
        rowp[2 * r] = ga[e] + (size_t)row * row_bytes;
        rowp[2 * r + 1] = ua[e] + (size_t)row * row_bytes;
    }
    const int32_t s0 = ex_off[e], s1 = ex_off[e + 1];
    /* Slots GROUP_T at a time, the last ones 2 or 1 at a time (a chunk of T decodes each weight
     * once for T slots, with each slot's float operations those of one). */
    for (int32_t i = s0; i < s1;) {
        const int32_t rem = s1 - i;
        if (rem >= GROUP_T) {
            gu_chunk<K, GROUP_T>(rowp, block_bytes, nu, ff, x, ldx, kuse, slot_list, i, r0, out, ldo);
            i += GROUP_T;
        } else if (rem >= 2) {
            gu_chunk<K, 2>(rowp, block_bytes, nu, ff, x, ldx, kuse, slot_list, i, r0, out, ldo);
            i += 2;
        } else {
            gu_chunk<K, 1>(rowp, block_bytes, nu, ff, x, ldx, kuse, slot_list, i, r0, out, ldo);
            i += 1;
        }
    }
}

/* Blocks an SM the grouped tensor-core kernels are compiled for (launch bounds; build-time
 * switches for measurements, e.g. CUDA_ARCH="... -DMOE_DG_TC_MINB_Q6=3"). As built (ptxas,
 * sm_90, NT 8 with staged inputs and tiles copied first): Q4_K gate/up 147 registers (3 blocks
 * of 4 warps), Q4_K down 152 (3), Q6_K down 251 (2). MOE_DG_TC_MINB_Q6=3 makes Q6_K down 168
 * with 84 bytes spilled, MOE_GU_TC_MINB_Q4=4 Q4_K gate/up 122 and MOE_DG_TC_MINB_Q4=4 Q4_K down
 * 128, neither spilling: with all three, 16 and 64 sequences 9% slower on an H100
 * (docs/benchmarks.md "The layers' decode products on tensor cores"), so the defaults stay. */
#ifndef MOE_DG_TC_MINB_Q6
#define MOE_DG_TC_MINB_Q6 1
#endif
#ifndef MOE_DG_TC_MINB_Q4
#define MOE_DG_TC_MINB_Q4 1
#endif
#ifndef MOE_GU_TC_MINB_Q4
#define MOE_GU_TC_MINB_Q4 3
#endif
/* Gate/up grouped on tensor cores: one block per (16-row tile, active expert), the expert's slots
 * NT at a time as the columns of gu_tc_tile (the same floats per slot as gate_up_tc_kernel). ST:
 * the step's inputs staged once in st (moe_cuda_tc_stage). AS (with ST): the tile's gate and up
 * rows are first copied into shared memory after the warps' sums (as gate_up_tc_kernel's). */
template <int K, int NT, bool ST = false, bool AS = false>
static __global__ void __launch_bounds__(32 * GU_WARPS, K == MOE_TYPE_Q4_K ? MOE_GU_TC_MINB_Q4 : 3)
gate_up_grouped_tc_kernel(const uint8_t *const *__restrict__ ga,
                          const uint8_t *const *__restrict__ ua, size_t row_bytes, int nsb,
                          int64_t ff, const float *__restrict__ x, int64_t ldx, int kuse,
                          const int32_t *__restrict__ ex_off, const int32_t *__restrict__ slot_list,
                          const int32_t *__restrict__ act_list,
                          const int32_t *__restrict__ n_active, float *__restrict__ out,
                          int64_t ldo, const tc_staged st)
{
    static_assert(!AS || ST, "tiles copied first with staged inputs only");
    pdl_wait();
    pdl_trigger();
    extern __shared__ uint4 gsm[];
    if ((int)blockIdx.y >= *n_active)
        return;
    const int e = act_list[blockIdx.y];
    const int32_t s0 = ex_off[e], s1 = ex_off[e + 1];
    const uint8_t *g = ga[e], *u = ua[e];
    if constexpr (AS) {
        const int64_t rt0 = (int64_t)blockIdx.x * TC_ROWS;
        const int64_t nr = ff - rt0 < TC_ROWS ? ff - rt0 : TC_ROWS;
        uint8_t *wg = (uint8_t *)(gsm + 2 * GU_WARPS * 32), *wu = wg + TC_ROWS * row_bytes;
        block_copy_async(wg, g + (size_t)rt0 * row_bytes, (size_t)nr * row_bytes);
        block_copy_async(wu, u + (size_t)rt0 * row_bytes, (size_t)nr * row_bytes);
        g = wg;
        u = wu;
    }
    for (int32_t i = s0; i < s1; i += NT) {
        const int nt = s1 - i < NT ? s1 - i : NT;
        const float *xr[NT];
        float *o[NT];
        int64_t tok[NT];
        UNROLL
        for (int c = 0; c < NT; c++) {
            const int32_t slot = slot_list[i + (c < nt ? c : nt - 1)];
            tok[c] = slot / kuse;
            xr[c] = x + tok[c] * ldx;
            o[c] = out + (int64_t)slot * ldo;
        }
        gu_tc_tile<K, NT, ST, AS>(g, u, row_bytes, nsb, ff, (int64_t)blockIdx.x * TC_ROWS, xr, o,
                                  nt, gsm, st, tok);
    }
}

/* Down grouped on tensor cores: one block per (DG_TC_WARPS 16-row tiles, active expert), warp w
 * its own tile over the whole row, the expert's slots NT at a time staged for the block; dout
 * gets each slot's rows (the same floats as down_tc_kernel's part, before the combine). ST: the
 * act rows come staged once per step in st (moe_cuda_tc_stage, by slot), and the block stages
 * nothing (the same floats: the same staging functions). */
#define DG_TC_WARPS 4
template <int K, int NT, bool ST = false, bool AS = false>
static __global__ void __launch_bounds__(32 * DG_TC_WARPS, K == MOE_TYPE_Q6_K ? MOE_DG_TC_MINB_Q6 : MOE_DG_TC_MINB_Q4)
down_grouped_tc_kernel(const uint8_t *const *__restrict__ da, size_t row_bytes, int nsb, int64_t E,
                       const float *__restrict__ act, int64_t ldact,
                       const int32_t *__restrict__ ex_off, const int32_t *__restrict__ slot_list,
                       const int32_t *__restrict__ act_list, const int32_t *__restrict__ n_active,
                       float *__restrict__ dout, int64_t ldd, const tc_staged st)
{
    static_assert(!AS || ST, "tiles copied first with staged inputs only");
    pdl_wait();
    pdl_trigger();
    extern __shared__ uint4 gsm[];
    __shared__ unsigned s_amax[NT];
    __shared__ int s_exp[NT];
    if ((int)blockIdx.y >= *n_active)
        return;
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, g8 = lane >> 2, t = lane & 3;
    const int e = act_list[blockIdx.y];
    const int32_t s0 = ex_off[e], s1 = ex_off[e + 1];
    const int64_t rt0 = ((int64_t)blockIdx.x * DG_TC_WARPS + wi) * TC_ROWS;
    const int64_t row0 = rt0 + g8 < E ? rt0 + g8 : E - 1, row1 = rt0 + g8 + 8 < E ? rt0 + g8 + 8 : E - 1;
    const uint8_t *p0 = da[e] + (size_t)row0 * row_bytes, *p1 = da[e] + (size_t)row1 * row_bytes;
    if constexpr (AS) {
        /* The block's rows (its warps' tiles) copied into shared memory first, at once and
         * without registers (with staged inputs gsm holds nothing else): the same bytes. */
        const int64_t rb0 = (int64_t)blockIdx.x * DG_TC_WARPS * TC_ROWS;
        const int64_t nr = E - rb0 < DG_TC_WARPS * TC_ROWS ? E - rb0 : DG_TC_WARPS * TC_ROWS;
        uint8_t *w = (uint8_t *)gsm;
        block_copy_async(w, da[e] + (size_t)rb0 * row_bytes, (size_t)nr * row_bytes);
        cp_async_wait_all();
        __syncthreads();
        p0 = w + (size_t)(row0 - rb0) * row_bytes;
        p1 = w + (size_t)(row1 - rb0) * row_bytes;
    }
    for (int32_t i = s0; i < s1; i += NT) {
        const int nt = s1 - i < NT ? s1 - i : NT;
        const typename tc_kind<K>::raw raw = tc_kind<K>::load(p0, p1, t);
        const float *xr[NT];
        int32_t slot[NT];
        UNROLL
        for (int c = 0; c < NT; c++) {
            slot[c] = slot_list[i + (c < nt ? c : nt - 1)];
            xr[c] = act + (int64_t)slot[c] * ldact;
        }
        const uint4 *xs;
        const uint2 *sxs;
        int gx = g8 & (NT - 1);
        int ex[2];
        if constexpr (ST) {
            /* The lane's column: its slot's staged row (tc_rows reads column 0 of it); the
             * exponents of its two output columns straight from st. */
            xs = st.xs + (size_t)slot[gx] * nsb * 64;
            sxs = st.sxs + (size_t)slot[gx] * nsb * 4;
            gx = 0;
            ex[0] = st.exp[slot[(2 * t) & (NT - 1)]];
            ex[1] = st.exp[slot[(2 * t + 1) & (NT - 1)]];
        } else {
            uint4 *bx = gsm;
            uint2 *bs = (uint2 *)(bx + (size_t)NT * nsb * 64);
            tc_stage<NT, K>(xr, nsb, bx, bs, s_exp, s_amax);
            xs = bx;
            sxs = bs;
            ex[0] = s_exp[(2 * t) & (NT - 1)];
            ex[1] = s_exp[(2 * t + 1) & (NT - 1)];
        }
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        tc_rows<K>(p0, p1, t, 0, 1, nsb, raw, xs, sxs, gx, acc);
        UNROLL
        for (int j = 0; j < 2; j++) {
            const int col = 2 * t + j;
            if (col >= NT || col >= nt)
                continue;
            const float back = ldexpf(1.0f, ex[j]);
            float *d = dout + (int64_t)slot[col] * ldd;
            if (rt0 + g8 < E)
                d[rt0 + g8] = acc[j] * back;
            if (rt0 + g8 + 8 < E)
                d[rt0 + g8 + 8] = acc[2 + j] * back;
        }
        if constexpr (!ST)
            __syncthreads(); /* the staging area is the next chunk's */
    }
}

/* T slots slot_list[i..i+T) of one expert through its down rows rr .. rr+R-1 (rowp) into dout. */
template <int K, int T, int R>
static __device__ __forceinline__ void down_chunk(const uint8_t *const *rowp, unsigned block_bytes,
                                                  int nu, int64_t E, const float *act,
                                                  int64_t ldact, const int32_t *slot_list,
                                                  int32_t i, int64_t rr, float *dout, int64_t ldd)
{
    const int lane = threadIdx.x & 31;
    int32_t slot[T];
    const float *xs[T];
    chunk_inputs<T>(slot_list, i, act, ldact, 1, slot, xs);
    float acc[T][R];
    row_dots_multi<K, R, T>(rowp, block_bytes, nu, xs, acc);
#pragma unroll
    for (int c = 0; c < T; c++)
#pragma unroll
        for (int r = 0; r < R; r++)
            if (lane == r && rr + r < E)
                dout[(int64_t)slot[c] * ldd + rr + r] = acc[c][r];
}

/* Down grouped: one block per (16 rows, active expert), warps taking (chunk of slots, 4 rows)
 * items in turn; dout[slot] gets the expert's output rows (same arithmetic as down_kernel's
 * per-expert dots). */
template <int K>
static __global__ void __launch_bounds__(32 * DOWN_WARPS)
down_grouped_kernel(const uint8_t *const *__restrict__ da, size_t row_bytes, unsigned block_bytes,
                    int nu, int64_t E, const float *__restrict__ act, int64_t ldact,
                    const int32_t *__restrict__ ex_off, const int32_t *__restrict__ slot_list,
                    const int32_t *__restrict__ act_list, const int32_t *__restrict__ n_active,
                    float *__restrict__ dout, int64_t ldd, const uint8_t *__restrict__ etype,
                    int want)
{
    pdl_wait();
    pdl_trigger();
    if ((int)blockIdx.y >= *n_active)
        return;
    if (etype && etype[act_list[blockIdx.y]] != want)
        return;
    constexpr int HALF = DOWNG_ROWS / 4; /* rows per pass */
    const int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int64_t r0 = (int64_t)blockIdx.x * DOWNG_ROWS;
    const int e = act_list[blockIdx.y];
    const uint8_t *base = da[e];
    const int32_t s0 = ex_off[e], s1 = ex_off[e + 1];
    /* Items (chunk of up to GROUP_T slots, pass of HALF rows) over the warps, so an expert with
     * few slots still keeps several warps busy; a chunk of 3 goes as 2 + 1. */
    constexpr int PASSES = DOWNG_ROWS / HALF;
    const int32_t nchunks = (s1 - s0 + GROUP_T - 1) / GROUP_T;
    for (int32_t it = w; it < nchunks * PASSES; it += nw) {
        const int hf = (int)(it % PASSES);
        const int32_t i0 = s0 + (it / PASSES) * GROUP_T;
        const int32_t i1 = i0 + GROUP_T < s1 ? i0 + GROUP_T : s1;
        const uint8_t *rowp[HALF];
#pragma unroll
        for (int r = 0; r < HALF; r++) {
            const int64_t row = r0 + hf * HALF + r;
            rowp[r] = base + (size_t)(row < E ? row : r0) * row_bytes;
        }
        const int64_t rr = r0 + hf * HALF;
        for (int32_t i = i0; i < i1;) {
            const int32_t rem = i1 - i;
            if (rem >= GROUP_T) {
                down_chunk<K, GROUP_T, HALF>(rowp, block_bytes, nu, E, act, ldact, slot_list, i, rr,
                                             dout, ldd);
                i += GROUP_T;
            } else if (rem >= 2) {
                down_chunk<K, 2, HALF>(rowp, block_bytes, nu, E, act, ldact, slot_list, i, rr, dout,
                                       ldd);
                i += 2;
            } else {
                down_chunk<K, 1, HALF>(rowp, block_bytes, nu, E, act, ldact, slot_list, i, rr, dout,
                                       ldd);
                i += 1;
            }
        }
    }
}

/* h[t] += Σ_j sel_w[t][j] · dout[t·k + j], j in order (the combine of down_kernel). */
static __global__ void combine_kernel(const float *__restrict__ dout, int64_t ldd, int64_t E,
                                      int kuse, const float *__restrict__ sel_w,
                                      float *__restrict__ h, int64_t ldh)
{
    pdl_wait();
    pdl_trigger();
    const int64_t t = blockIdx.y;
    for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < E;
         r += (int64_t)gridDim.x * blockDim.x) {
        float tot = 0.0f;
        for (int j = 0; j < kuse; j++)
            tot += sel_w[t * kuse + j] * dout[(t * kuse + j) * ldd + r];
        h[t * ldh + r] += tot;
    }
}

/* Expert rows are 16-byte aligned when the row length allows it (the backend aligns every
 * expert to 256 bytes), so the plain types use their vector kinds then. */
#define PLAIN_CASES(CASE, type, n) MOE_PLAIN_KINDS(CASE, moe_row_bytes(type, n) % 16 == 0)

/* The dynamic shared memory a launch may take on the current device (moe_smem_optin; the default
 * 48 KiB where that cannot be read). */
static size_t smem_room()
{
    const int v = moe_smem_optin();
    return v > 0 ? (size_t)v : 48 * 1024;
}

template <int K> static unsigned blk_bytes(int64_t n, size_t *row_bytes, int *nu)
{
    *row_bytes = moe_row_bytes(kind_type(K), n);
    const int64_t nb = n / unit_shape<K>::blck;
    *nu = (int)(nb * unit_shape<K>::per_block);
    return (unsigned)(*row_bytes / (size_t)nb);
}

template <int K, int MODE>
static int launch_gate_up(const void *const *a, const void *const *b, int64_t n, int64_t ff,
                          const float *x, int64_t ldx, int64_t n_tok, int kuse,
                          const int32_t *sel_e, float *out, int64_t ldo, const uint8_t *etype,
                          const moe_cuda_route_in &rt, const void *const *fa,
                          const void *const *fb, const moe_cuda_gu_resolve &rs, int tc,
                          cudaStream_t s)
{
    size_t rb;
    int nu;
    unsigned bb = blk_bytes<K>(n, &rb, &nu);
    const int64_t per = GU_ROWS * GU_WARPS;
    dim3 g((unsigned)((ff + per - 1) / per), (unsigned)(n_tok * kuse));
    size_t smem = rt.rl ? sizeof(float) * GU_WARPS * (size_t)route_smem_floats(rt.nexp, kuse) : 0;
    if (rs.off)
        smem += moe_cuda_resolve_smem(rs.nexp, rs.slots);
    if (smem > 48 * 1024)
        return -EINVAL;
    if constexpr (tc_takes<K>() && MODE == 0) {
        const size_t tc_off = (smem / sizeof(float) + 3) & ~(size_t)3;
        /* The staging, the warps' sums, then the row's raw copy (gu_tc_tile's RAW). */
        const size_t tc_smem = tc_off * sizeof(float) + tc_stage_bytes(1, (int)(n / 256)) +
                               2 * GU_WARPS * 32 * sizeof(float4) +
                               sizeof(float) * (size_t)tc_raw_floats(n);
        /* Past 48 KiB (rows of about 8700 and more) the shared memory is raised rather than
         * leaving tensor cores, which would make one-token steps differ from grouped ones. */
        if ((tc & MOE_CUDA_TC_GATE_UP) && !etype && n % 256 == 0 && tc_smem <= smem_room()) {
            /* The tile's rows copied into shared memory at once (MOE_CUDA_TC_ASYNC) where
             * nothing is filled or resolved in the launch and the device gives the room. */
            const size_t w_off = (tc_smem + 15) & ~(size_t)15;
            const size_t as_smem = w_off + 2 * (size_t)TC_ROWS * rb;
            const bool as = (tc & MOE_CUDA_TC_ASYNC) && !fa && !fb && !rs.off &&
                            as_smem <= smem_room();
            /* One token whose row the router launch staged (rt.staged): copied, not staged. */
            const bool sx = !as && rt.rl && rt.staged && rt.staged_type == kind_type(K) &&
                            n_tok == 1;
            MOE_CUDA_TRY((as   ? moe_raise_smem<gate_up_tc_kernel<K, true>>(as_smem)
                          : sx ? moe_raise_smem<gate_up_tc_kernel<K, false, true>>(tc_smem)
                               : moe_raise_smem<gate_up_tc_kernel<K>>(tc_smem)));
            MOE_CUDA_TRY(moe_launch(as   ? gate_up_tc_kernel<K, true>
                                    : sx ? gate_up_tc_kernel<K, false, true>
                                         : gate_up_tc_kernel<K>,
                                    g,
                                    dim3(32 * GU_WARPS), as ? as_smem : tc_smem, s,
                                    (const uint8_t *const *)a, (const uint8_t *const *)b, rb,
                                    (int)(n / 256), ff, x, ldx, kuse, sel_e, out, ldo, rt,
                                    (const uint8_t *const *)fa, (const uint8_t *const *)fb, rs,
                                    tc_off, as ? w_off : (size_t)0));
            return 0;
        }
    }
    MOE_CUDA_TRY(moe_launch(gate_up_kernel<K, MODE>, g, dim3(32 * GU_WARPS), smem, s,
                            (const uint8_t *const *)a, (const uint8_t *const *)b, rb, bb, nu, ff, x,
                            ldx, kuse, sel_e, out, ldo, etype, (int)kind_type(K), rt,
                            (const uint8_t *const *)fa, (const uint8_t *const *)fb, rs));
    return 0;
}

template <int MODE>
static int gate_up_dispatch(uint32_t type, const void *const *a, const void *const *b, int64_t n,
                            int64_t ff, const float *x, int64_t ldx, int64_t n_tok, int kuse,
                            const int32_t *sel_e, float *out, int64_t ldo, cudaStream_t s,
                            const uint8_t *etype = NULL, const moe_cuda_route_in &rt = {},
                            const void *const *fa = NULL, const void *const *fb = NULL,
                            const moe_cuda_gu_resolve &rs = {}, int tc = 0)
{
#define CALL(T) return launch_gate_up<T, MODE>(a, b, n, ff, x, ldx, n_tok, kuse, sel_e, out, ldo, etype, rt, fa, fb, rs, tc, s);
#define CASE(T) case T: CALL(T)
    switch (type) {
    MOE_QDOT_TYPES(CASE)
    PLAIN_CASES(CALL, type, n)
    }
#undef CASE
#undef CALL
    return MOE_EUNSUPPORTED;
}

int moe_cuda_expert_gate_up(uint32_t gate_type, uint32_t up_type, const void *const *d_gate,
                            const void *const *d_up, int64_t n, int64_t ff, const float *d_x,
                            int64_t ldx, int64_t n_tok, int kuse, const int32_t *d_sel_e,
                            float *d_act, int64_t ldact, float *d_scratch,
                            const struct moe_cuda_route_in *route, const void *const *d_fill,
                            int64_t nexp, const struct moe_cuda_gu_resolve *resolve, int tc,
                            cudaStream_t s)
{
    if (!moe_qdot_supported(gate_type) || !moe_qdot_supported(up_type))
        return MOE_EUNSUPPORTED;
    if (n_tok <= 0 || kuse <= 0 || n_tok * kuse > 65535)
        return -EINVAL;
    if (route && (gate_type != up_type || route->nexp < kuse ||
                  (route->staged && (n_tok != 1 || ((uintptr_t)route->staged & 15) != 0))))
        return -EINVAL;
    if (d_fill && nexp <= 0)
        return -EINVAL;
    if (resolve && (!route || !d_fill || !resolve->off || !resolve->fl || !resolve->sync ||
                    resolve->nexp != nexp || kuse > MOE_OFF_FAST_MAX || kuse > 32 * GU_WARPS))
        return -EINVAL;
    const void *const *fg = d_fill, *const *fu = d_fill ? d_fill + nexp : NULL;
    if (gate_type == up_type)
        return gate_up_dispatch<0>(gate_type, d_gate, d_up, n, ff, d_x, ldx, n_tok, kuse,
                                   d_sel_e, d_act, ldact, s, NULL,
                                   route ? *route : moe_cuda_route_in{}, fg, fu,
                                   resolve ? *resolve : moe_cuda_gu_resolve{}, tc);
    /* Mixed types: gate into scratch[0], up into scratch[1] (same row stride as act), then the
     * SwiGLU over whole rows (the padding of a row included, which nothing reads). */
    const int64_t count = n_tok * kuse * ldact;
    float *g = d_scratch, *u = d_scratch + count;
    int rc = gate_up_dispatch<1>(gate_type, d_gate, NULL, n, ff, d_x, ldx, n_tok, kuse, d_sel_e,
                                 g, ldact, s, NULL, {}, fg);
    if (!rc)
        rc = gate_up_dispatch<1>(up_type, d_up, NULL, n, ff, d_x, ldx, n_tok, kuse, d_sel_e, u,
                                 ldact, s, NULL, {}, fu);
    if (rc)
        return rc;
    return moe_cuda_expert_swiglu(g, u, d_act, count, s);
}

template <int K>
static int launch_down(const void *const *d, int64_t ff, int64_t E, const float *act,
                       int64_t ldact, int64_t n_tok, int kuse, const int32_t *sel_e,
                       const float *sel_w, float *h, int64_t ldh, const void *const *fill,
                       int tc, cudaStream_t s)
{
    size_t rb;
    int nu;
    unsigned bb = blk_bytes<K>(ff, &rb, &nu);
    const int warps = kuse < DOWN_WARPS ? kuse : DOWN_WARPS;
    if constexpr (tc_takes<K>()) {
        /* Each warp stages its choice's act row in its own area: as many warps as fit 48 KiB
         * (a choice's floats are the same whichever warp takes it, so a long row, e.g. 1536 of
         * a 235B-shape model, takes fewer warps instead of leaving tensor cores, which would
         * make one-token steps differ from grouped ones). MOE_CUDA_TC_DOWN_WARPS(tc) caps them
         * (tests). */
        const int cap = MOE_CUDA_TC_DOWN_WARPS(tc) ? MOE_CUDA_TC_DOWN_WARPS(tc) : DOWN_WARPS;
        const size_t stage = tc_stage_bytes(1, (int)(ff / 256));
        const size_t part = sizeof(float) * TC_ROWS * (size_t)kuse;
        int tw = warps < cap ? warps : cap;
        while (tw > 1 && (size_t)tw * stage + part > 48 * 1024)
            tw--;
        tw = tw < 1 ? 1 : tw;
        const size_t smem = (size_t)tw * stage + part;
        /* Every choice's rows of the tile copied into shared memory first (MOE_CUDA_TC_ASYNC,
         * as for gate/up) where nothing is filled and the device gives the room. */
        const size_t as_smem = ((smem + 15) & ~(size_t)15) + (size_t)kuse * TC_ROWS * rb;
        /* Without the copies first, each warp's act row goes to shared memory first (RAW)
         * where the room allows. */
        const size_t raw_smem = smem + (size_t)tw * sizeof(float) * down_ws_floats((int)(ff / 256), 0);
        const size_t ws_smem = smem + (size_t)tw * sizeof(float) * down_ws_floats((int)(ff / 256), rb);
        if ((tc & MOE_CUDA_TC_DOWN) && ff % 256 == 0 && smem <= 48 * 1024) {
            const bool as = (tc & MOE_CUDA_TC_ASYNC) && !fill && as_smem <= smem_room();
            const bool raw = !as && raw_smem <= smem_room();
            /* One token's down copies its choices' tiles too (WS, MOE_CUDA_TC_DOWN_WS); steps
             * of more tokens keep their blocks' smaller shared memory (more blocks an SM). */
            const bool ws = raw && !fill && n_tok == 1 && ws_smem <= smem_room() &&
                            ((tc & MOE_CUDA_TC_DOWN_WS_ALL) ||
                             ((tc & MOE_CUDA_TC_DOWN_WS) && K == MOE_TYPE_Q6_K));
            if (as)
                MOE_CUDA_TRY((moe_raise_smem<down_tc_kernel<K, true>>(as_smem)));
            if (ws)
                MOE_CUDA_TRY((moe_raise_smem<down_tc_kernel<K, false, true, true>>(ws_smem)));
            else if (raw)
                MOE_CUDA_TRY((moe_raise_smem<down_tc_kernel<K, false, true>>(raw_smem)));
            dim3 g((unsigned)((E + TC_ROWS - 1) / TC_ROWS), (unsigned)n_tok);
            MOE_CUDA_TRY(moe_launch(as    ? down_tc_kernel<K, true>
                                    : ws  ? down_tc_kernel<K, false, true, true>
                                    : raw ? down_tc_kernel<K, false, true>
                                          : down_tc_kernel<K>,
                                    g, dim3(32 * tw),
                                    as ? as_smem : ws ? ws_smem : raw ? raw_smem : smem, s,
                                    (const uint8_t *const *)d, rb, (int)(ff / 256), E, act, ldact,
                                    kuse, sel_e, sel_w, h, ldh, (const uint8_t *const *)fill));
            return 0;
        }
    }
    dim3 g((unsigned)((E + DOWN_ROWS - 1) / DOWN_ROWS), (unsigned)n_tok);
    MOE_CUDA_TRY(moe_launch(down_kernel<K>, g, dim3(32 * (warps < 1 ? 1 : warps)),
                            sizeof(float) * DOWN_ROWS * (size_t)kuse,
                            s, (const uint8_t *const *)d, rb, bb, nu, E, act, ldact, kuse, sel_e,
                            sel_w, h, ldh, (const uint8_t *const *)fill));
    return 0;
}

int moe_cuda_expert_down(uint32_t type, const void *const *d_down, int64_t ff, int64_t E,
                         const float *d_act, int64_t ldact, int64_t n_tok, int kuse,
                         const int32_t *d_sel_e, const float *d_sel_w, float *d_h, int64_t ldh,
                         const void *const *d_fill, int tc, cudaStream_t s)
{
    if (!moe_qdot_supported(type))
        return MOE_EUNSUPPORTED;
    if (n_tok <= 0 || kuse <= 0 || n_tok > 65535)
        return -EINVAL;
#define CALL(T) return launch_down<T>(d_down, ff, E, d_act, ldact, n_tok, kuse, d_sel_e, d_sel_w, d_h, ldh, d_fill, tc, s);
#define CASE(T) case T: CALL(T)
    switch (type) {
    MOE_QDOT_TYPES(CASE)
    PLAIN_CASES(CALL, type, ff)
    }
#undef CASE
#undef CALL
    return MOE_EUNSUPPORTED;
}

int moe_cuda_expert_group(const int32_t *d_sel_e, int64_t n_slots, int64_t nexp, int kuse,
                          struct moe_cuda_groups *g, cudaStream_t s)
{
    if (n_slots <= 0 || n_slots > 0x7fffffff || nexp <= 0 || nexp > 8192)
        return -EINVAL;
    const size_t smem = sizeof(int32_t) * 3 * (size_t)nexp;
    if (smem > 48 * 1024)
        MOE_CUDA_TRY(cudaFuncSetAttribute(group_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          (int)smem));
    if (kuse <= 0)
        return -EINVAL;
    MOE_CUDA_TRY(moe_launch(group_kernel, dim3(1), dim3(1024), smem, s, d_sel_e, (int)n_slots,
                            (int)nexp, kuse, g->ex_off, g->slot_list, g->act_list, g->n_active,
                            g->slot_tok, g->slot_pos));
    return 0;
}

template <int K>
static int launch_gate_up_grouped(const void *const *a, const void *const *b, int64_t n,
                                  int64_t ff, const float *x, int64_t ldx, int kuse,
                                  const struct moe_cuda_groups *gr, int max_active, float *out,
                                  int64_t ldo, int tc, void *ws, size_t ws_bytes, int64_t n_tok,
                                  cudaStream_t s)
{
    size_t rb;
    int nu;
    unsigned bb = blk_bytes<K>(n, &rb, &nu);
    if constexpr (tc_takes<K>()) {
        if ((tc & MOE_CUDA_TC_GATE_UP) && n % 256 == 0) {
            const int nsb = (int)(n / 256);
            const dim3 g((unsigned)((ff + TC_ROWS - 1) / TC_ROWS), (unsigned)max_active);
            const size_t red = 2 * GU_WARPS * 32 * sizeof(float4);
            /* Inputs staged once for the step where a workspace holds them: 8 slots a pass. */
            if (ws && n_tok > 0 && ws_bytes >= moe_cuda_matvec_tc_ws_bytes(n, n_tok)) {
                const int rc = moe_cuda_tc_stage(K, x, ldx, n, n_tok, ws, ws_bytes, s);
                if (rc)
                    return rc;
                const size_t as_smem = red + 2 * (size_t)TC_ROWS * rb;
                const bool as = (tc & MOE_CUDA_TC_ASYNC_GROUPED) && as_smem <= smem_room();
                if (as)
                    MOE_CUDA_TRY((moe_raise_smem<gate_up_grouped_tc_kernel<K, 8, true, true>>(as_smem)));
                MOE_CUDA_TRY(moe_launch(as ? gate_up_grouped_tc_kernel<K, 8, true, true>
                                           : gate_up_grouped_tc_kernel<K, 8, true>,
                                        g, dim3(32 * GU_WARPS), as ? as_smem : red, s,
                                        (const uint8_t *const *)a,
                                        (const uint8_t *const *)b, rb, nsb, ff, x, ldx, kuse,
                                        (const int32_t *)gr->ex_off, (const int32_t *)gr->slot_list,
                                        (const int32_t *)gr->act_list,
                                        (const int32_t *)gr->n_active, out, ldo,
                                        tc_ws_split(ws, nsb, n_tok)));
                return 0;
            }
#define GUG_TC(NT)                                                                                \
    if (tc_stage_bytes(NT, nsb) + red <= 48 * 1024) {                                             \
        MOE_CUDA_TRY(moe_launch(gate_up_grouped_tc_kernel<K, NT>, g, dim3(32 * GU_WARPS),         \
                                tc_stage_bytes(NT, nsb) + red, s, (const uint8_t *const *)a,      \
                                (const uint8_t *const *)b, rb, nsb, ff, x, ldx, kuse,             \
                                (const int32_t *)gr->ex_off, (const int32_t *)gr->slot_list,      \
                                (const int32_t *)gr->act_list, (const int32_t *)gr->n_active,     \
                                out, ldo, tc_staged{}));                                          \
        return 0;                                                                                 \
    }
            GUG_TC(4)
            GUG_TC(2)
            GUG_TC(1)
#undef GUG_TC
        }
    }
    const int64_t per = GUG_ROWS * GU_WARPS;
    dim3 g((unsigned)((ff + per - 1) / per), (unsigned)max_active);
    MOE_CUDA_TRY(moe_launch(gate_up_grouped_kernel<K>, g, dim3(32 * GU_WARPS), 0, s,
                            (const uint8_t *const *)a, (const uint8_t *const *)b, rb, bb, nu, ff, x,
                            ldx, kuse, (const int32_t *)gr->ex_off, (const int32_t *)gr->slot_list,
                            (const int32_t *)gr->act_list, (const int32_t *)gr->n_active, out, ldo));
    return 0;
}

template <int K>
static int launch_down_grouped(const void *const *d, int64_t ff, int64_t E, const float *act,
                               int64_t ldact, const struct moe_cuda_groups *gr, int max_active,
                               float *dout, int64_t ldd, const uint8_t *etype, int tc,
                               void *ws, size_t ws_bytes, int64_t n_slots, cudaStream_t s)
{
    size_t rb;
    int nu;
    unsigned bb = blk_bytes<K>(ff, &rb, &nu);
    if constexpr (tc_takes<K>()) {
        if ((tc & MOE_CUDA_TC_DOWN) && ff % 256 == 0) {
            const int nsb = (int)(ff / 256);
            const int64_t per = DG_TC_WARPS * TC_ROWS;
            const dim3 g((unsigned)((E + per - 1) / per), (unsigned)max_active);
            /* The act rows staged once for the step where a workspace holds them: 8 slots a
             * pass, nothing staged per block. */
            if (!etype && ws && n_slots > 0 && ldact % 4 == 0 && ((uintptr_t)act & 15) == 0 &&
                ws_bytes >= moe_cuda_matvec_tc_ws_bytes(ff, n_slots)) {
                const int rc = moe_cuda_tc_stage(kind_type(K), act, ldact, ff, n_slots, ws,
                                                 ws_bytes, s);
                if (rc)
                    return rc;
                const size_t as_smem = (size_t)DG_TC_WARPS * TC_ROWS * rb;
                const bool as = (tc & MOE_CUDA_TC_ASYNC_GROUPED) && as_smem <= smem_room();
                if (as)
                    MOE_CUDA_TRY((moe_raise_smem<down_grouped_tc_kernel<K, 8, true, true>>(as_smem)));
                MOE_CUDA_TRY(moe_launch(as ? down_grouped_tc_kernel<K, 8, true, true>
                                           : down_grouped_tc_kernel<K, 8, true>,
                                        g, dim3(32 * DG_TC_WARPS), as ? as_smem : 0, s,
                                        (const uint8_t *const *)d,
                                        rb, nsb, E, act, ldact, (const int32_t *)gr->ex_off,
                                        (const int32_t *)gr->slot_list,
                                        (const int32_t *)gr->act_list,
                                        (const int32_t *)gr->n_active, dout, ldd,
                                        tc_ws_split(ws, nsb, n_slots)));
                return 0;
            }
#define DG_TC(NT)                                                                                 \
    if (tc_stage_bytes(NT, nsb) <= 48 * 1024) {                                                   \
        MOE_CUDA_TRY(moe_launch(down_grouped_tc_kernel<K, NT>, g, dim3(32 * DG_TC_WARPS),         \
                                tc_stage_bytes(NT, nsb), s, (const uint8_t *const *)d, rb, nsb,   \
                                E, act, ldact, (const int32_t *)gr->ex_off,                       \
                                (const int32_t *)gr->slot_list, (const int32_t *)gr->act_list,    \
                                (const int32_t *)gr->n_active, dout, ldd, tc_staged{}));          \
        return 0;                                                                                 \
    }
            if (!etype) {
                DG_TC(8)
                DG_TC(4)
                DG_TC(1)
            }
#undef DG_TC
        }
    }
    dim3 g((unsigned)((E + DOWNG_ROWS - 1) / DOWNG_ROWS), (unsigned)max_active);
    MOE_CUDA_TRY(moe_launch(down_grouped_kernel<K>, g, dim3(32 * DOWN_WARPS), 0, s,
                            (const uint8_t *const *)d, rb, bb, nu, E, act, ldact,
                            (const int32_t *)gr->ex_off, (const int32_t *)gr->slot_list,
                            (const int32_t *)gr->act_list, (const int32_t *)gr->n_active, dout,
                            ldd, etype, (int)kind_type(K)));
    return 0;
}

/* The grouped down projection for one weight type (etype: only the experts of that type, or
 * NULL for all). */
static int down_grouped_dispatch(uint32_t type, const void *const *d_down, int64_t ff, int64_t E,
                                 const float *d_act, int64_t ldact, const struct moe_cuda_groups *g,
                                 int max_active, float *d_dout, int64_t ldd, const uint8_t *etype,
                                 int tc, void *ws, size_t ws_bytes, int64_t n_slots,
                                 cudaStream_t s)
{
#define CALL(T) return launch_down_grouped<T>(d_down, ff, E, d_act, ldact, g, max_active, d_dout, ldd, etype, tc, ws, ws_bytes, n_slots, s);
#define CASE(T) case T: CALL(T)
    switch (type) {
    MOE_QDOT_TYPES(CASE)
    PLAIN_CASES(CALL, type, ff)
    }
#undef CASE
#undef CALL
    return MOE_EUNSUPPORTED;
}

/* h[t] += sum over its kuse slots of weight * dout[slot]. */
static int launch_combine(const float *d_dout, int64_t ldd, int64_t E, int64_t n_tok, int kuse,
                          const float *d_sel_w, float *d_h, int64_t ldh, cudaStream_t s)
{
    unsigned gx = (unsigned)((E + 255) / 256);
    MOE_CUDA_TRY(moe_launch(combine_kernel, dim3(gx, (unsigned)n_tok), dim3(256), 0, s, d_dout, ldd,
                            E, kuse, d_sel_w, d_h, ldh));
    return 0;
}

int moe_cuda_expert_gate_up_grouped(uint32_t type, const void *const *d_gate,
                                    const void *const *d_up, int64_t n, int64_t ff,
                                    const float *d_x, int64_t ldx, int kuse,
                                    const struct moe_cuda_groups *g, int max_active, float *d_act,
                                    int64_t ldact, int tc, void *d_ws, size_t ws_bytes,
                                    int64_t n_tok, cudaStream_t s)
{
    if (max_active <= 0 || max_active > 65535)
        return -EINVAL;
#define CALL(T) return launch_gate_up_grouped<T>(d_gate, d_up, n, ff, d_x, ldx, kuse, g, max_active, d_act, ldact, tc, d_ws, ws_bytes, n_tok, s);
#define CASE(T) case T: CALL(T)
    switch (type) {
    MOE_QDOT_TYPES(CASE)
    PLAIN_CASES(CALL, type, n)
    }
#undef CASE
#undef CALL
    return MOE_EUNSUPPORTED;
}

int moe_cuda_expert_down_grouped(uint32_t type, const void *const *d_down, int64_t ff, int64_t E,
                                 const float *d_act, int64_t ldact, const struct moe_cuda_groups *g,
                                 int max_active, int64_t n_tok, int kuse, const float *d_sel_w,
                                 float *d_dout, int64_t ldd, float *d_h, int64_t ldh, int tc,
                                 void *d_ws, size_t ws_bytes, cudaStream_t s)
{
    if (max_active <= 0 || max_active > 65535 || n_tok <= 0 || n_tok > 65535)
        return -EINVAL;
    int rc = down_grouped_dispatch(type, d_down, ff, E, d_act, ldact, g, max_active, d_dout, ldd,
                                   NULL, tc, d_ws, ws_bytes, n_tok * kuse, s);
    if (rc)
        return rc;
    return launch_combine(d_dout, ldd, E, n_tok, kuse, d_sel_w, d_h, ldh, s);
}

int moe_cuda_expert_mixed(const struct moe_cuda_mixed *mx, int64_t n, int64_t ff, int64_t E,
                          const float *d_x, int64_t ldx, int64_t n_tok, int kuse,
                          const int32_t *d_sel_e, const float *d_sel_w,
                          const struct moe_cuda_groups *g, float *d_act, int64_t ldact,
                          float *d_scratch, float *d_dout, int64_t ldd, float *d_h, int64_t ldh,
                          cudaStream_t s)
{
    const int64_t slots = n_tok * kuse;
    if (n_tok <= 0 || kuse <= 0 || slots > 65535)
        return -EINVAL;
    int rc = moe_cuda_expert_group(d_sel_e, slots, mx->nexp, kuse, (struct moe_cuda_groups *)g, s);
    if (rc)
        return rc;
    const int64_t count = slots * ldact;
    float *gb = d_scratch, *ub = d_scratch + count;
    for (int i = 0; i < mx->n_types[0] && !rc; i++)
        rc = gate_up_dispatch<1>(mx->types[0][i], mx->gate, NULL, n, ff, d_x, ldx, n_tok, kuse,
                                 d_sel_e, gb, ldact, s, mx->etype[0]);
    for (int i = 0; i < mx->n_types[1] && !rc; i++)
        rc = gate_up_dispatch<1>(mx->types[1][i], mx->up, NULL, n, ff, d_x, ldx, n_tok, kuse,
                                 d_sel_e, ub, ldact, s, mx->etype[1]);
    if (rc)
        return rc;
    if ((rc = moe_cuda_expert_swiglu(gb, ub, d_act, count, s)))
        return rc;
    const int max_active = (int)(slots < mx->nexp ? slots : mx->nexp);
    for (int i = 0; i < mx->n_types[2] && !rc; i++)
        rc = down_grouped_dispatch(mx->types[2][i], mx->down, ff, E, d_act, ldact, g, max_active,
                                   d_dout, ldd, mx->etype[2], 0, NULL, 0, 0, s);
    if (rc)
        return rc;
    return launch_combine(d_dout, ldd, E, n_tok, kuse, d_sel_w, d_h, ldh, s);
}

int moe_cuda_expert_swiglu(const float *d_g, const float *d_u, float *d_act, int64_t count,
                           cudaStream_t s)
{
    if (count <= 0)
        return 0;
    MOE_CUDA_TRY(moe_launch(swiglu_kernel, dim3((unsigned)((count + 255) / 256)), dim3(256), 0, s,
                            d_g, d_u, d_act, count));
    return 0;
}

int moe_cuda_expert_combine_pos(const float *d_dout, int64_t ldd, int64_t E, int64_t n_tok,
                                int kuse, const float *d_sel_w, const int32_t *d_slot_pos,
                                float *d_h, int64_t ldh, cudaStream_t s)
{
    if (n_tok <= 0 || n_tok > 65535)
        return -EINVAL;
    unsigned gx = (unsigned)((E + 255) / 256);
    MOE_CUDA_TRY(moe_launch(combine_pos_kernel, dim3(gx, (unsigned)n_tok), dim3(256), 0, s, d_dout,
                            ldd, E, kuse, d_sel_w, d_slot_pos, d_h, ldh));
    return 0;
}

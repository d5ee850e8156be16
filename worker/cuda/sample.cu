/* Token sampling on the device (see sample.h for the contract, docs/cuda.md for the design).
 *
 * One thread block of 1024 threads per row. The row's logits are read from global memory (L2
 * after the first pass) as often as the path needs; shared memory holds 4096-bin histograms and
 * a sort buffer of list_cap candidates. The chain, per row:
 *
 *   1. Penalties: the window (last n ring entries) is sorted in shared memory, so each distinct
 *      id is penalised once, by the thread at the start of its run, with the run length as its
 *      count; logits change in place with the CPU's float operations.
 *   2. Pass 1 over the row: max, the lowest-id argmax, the candidate count (logits > -inf, which
 *      excludes NaN), optionally the log-sum-exp for logprobs, and, when top-k is on, the first
 *      digit histogram. Greedy rows stop here.
 *   3. Every ranking uses one total order, the CPU's: higher logit first, lower id on ties. It is
 *      encoded as a 64-bit key K = orderable(logit) << 32 | (n_vocab - 1 - id), so "rank
 *      higher" is "K larger", keys are distinct, and any prefix of the order is {K >= bound}.
 *      Sets are found by radix refinement over K: 12-, 12- and 8-bit digits of the logit, then
 *      12-bit digits of the id part; each level histograms (counts, and masses where weights
 *      matter) the elements sharing the digits fixed so far and keeps the bin where the running
 *      count or mass, taken from the top, reaches the target.
 *   4. Fast path (tier A) for top-k <= list_cap, or top-p alone with a nucleus that fits: the
 *      candidates that can matter are compacted into shared memory and sorted (bitonic); top-p,
 *      min-p and the draw then run on the sorted list exactly as the CPU's loops do, with block
 *      scans for the cumulative sums. For top-p alone, the list is a prefix whose float-estimated
 *      mass exceeds top_p (+1e-4); the exact double cumulative sum then has to reach top_p inside
 *      it, or the row takes tier B.
 *   5. Exact path (tier B) for everything bigger: each step (top-k bound, nucleus bound, draw) is
 *      a refinement with exact double weights over the whole row, ending in a sorted list of the
 *      one bin that contains the boundary.
 *   6. No truncation that sorts (no top-k, no top-p), tier C: the CPU draws in id order, so each
 *      thread takes a contiguous id range, a block scan orders the ranges, and the thread whose
 *      range crosses u·z walks it again. A row whose parameters make every draw tier C and no
 *      penalty changes its logits has its first pass and its weights' sums spread over 64 blocks
 *      first (scan_kernel, csum_kernel: per segment, the sums of 256 sub-ranges added in order);
 *      a kernel of its own then finds the segment, the sub-range inside it (its sums recomputed
 *      and added in the same order, so the crossing is sure to fall inside) and walks that
 *      sub-range (tier_c_seg). Top-k rows of k <= 64 without penalties find their top k from
 *      scan_kernel's segment maxima in a kernel of their own (sample_row_topk).
 *   7. Top-p rows without top-k (and whose penalties, if any, penalty_kernel applied first)
 *      can take tier B's refinements spread over
 *      the GPU (MOE_CUDA_SPREAD_TOPP, checked on the host only so far): each level's histogram
 *      built by NSEG blocks a row into global memory, its bin chosen by one block, the final bin
 *      compacted by NSEG blocks and sorted and scanned by one; the nucleus bound, then the draw
 *      (tp_* kernels; sample_dev.cuh "top-p rows spread over the GPU").
 *
 * The per-row algorithm is written once, as __host__ __device__ templates over an "executor"
 * (each / single / reductions / scans / shared atomics), in worker/cuda/sample_dev.cuh. The
 * kernels instantiate it with DevExec; tests/test_sample_host.cu instantiates it with an
 * executor that runs the 1024 threads of a phase one after another and compares it with
 * worker/sampler.c without a GPU.
 * Rules that make both valid: code between two executor calls is block-uniform (every thread
 * computes the same values); per-thread data that outlives a phase lives in shared arrays
 * indexed by thread; a uniform value computed by some threads reaches all through a reduction. */
#include "worker/cuda/sample.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

extern "C" {
#include "store/err.h"
}
#include "worker/cuda/cuda_check.cuh"
#include "worker/cuda/env_opts.h"
#include "worker/cuda/sample_dev.cuh"

namespace moe_sample {

/* The first pass of a greedy row spread over the GPU: block (g, r) scans segment g of logits
 * row r (NSEG segments of whole float4s) and stores its ScanPart; a row's result is the same
 * whatever the segments (a maximum, the lowest index holding it, a count). */
__global__ void __launch_bounds__(SCAN_NT) scan_kernel(const float *logits, uint32_t nv,
                                                       ScanPart *part)
{
    const float *lg = logits + (size_t)blockIdx.y * nv;
    uint32_t i0, i1;
    seg_range(nv, blockIdx.x, &i0, &i1);
    float bv = -INFINITY;
    int bi = -1, c = 0;
    const auto see = [&](uint32_t i, float l) { first_pass_see(l, i, &bv, &bi, &c); };
    if (((uintptr_t)lg & 15) == 0) {
        /* Each thread's float4s in ascending order, so its first maximum is its lowest index. */
        uint32_t i = i0 + 4 * threadIdx.x;
        for (; i + 3 < i1; i += 4 * SCAN_NT) {
            const float4 v = *(const float4 *)(lg + i);
            see(i, v.x);
            see(i + 1, v.y);
            see(i + 2, v.z);
            see(i + 3, v.w);
        }
        for (; i < i1; i++)
            see(i, lg[i]);
    } else {
        for (uint32_t i = i0 + threadIdx.x; i < i1; i += SCAN_NT)
            see(i, lg[i]);
    }
    __shared__ vi sb[SCAN_NT / 32];
    __shared__ int sc[SCAN_NT / 32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    vi best = {bv, bi};
    for (int o = 16; o > 0; o >>= 1) {
        const vi y = {__shfl_xor_sync(0xffffffffu, best.v, o),
                      __shfl_xor_sync(0xffffffffu, best.i, o)};
        c += __shfl_xor_sync(0xffffffffu, c, o);
        if (better(y, best))
            best = y;
    }
    if (lane == 0) {
        sb[w] = best;
        sc[w] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < SCAN_NT / 32; k++) {
            if (better(sb[k], best))
                best = sb[k];
            c += sc[k];
        }
        part[(size_t)blockIdx.y * NSEG + blockIdx.x] = ScanPart{best.v, best.i, (uint32_t)c};
    }
}

/* The weights' sums of tier-C rows (csum_row, read through the row map) spread over the GPU:
 * block (g, r) sums segment g of logits row r, a thread a contiguous sub-range (csub_sum), the
 * SCAN_NT sums then added in thread order by one thread (tier_c_seg repeats exactly this). The
 * row's maximum and candidate count come from scan_kernel's segments, as the sample kernel takes
 * them, so the weights are the ones it would compute. Other rows are left alone. */
__global__ void __launch_bounds__(SCAN_NT)
csum_kernel(const float *logits, uint32_t nv, const ScanPart *part, const int32_t *rowmap,
            const moe_cuda_sample_row *params, CSum *out)
{
    const uint32_t row = blockIdx.y, g = blockIdx.x;
    const moe_cuda_sample_row p = params[rowmap ? (uint32_t)rowmap[row] : row];
    if (!csum_row(p))
        return;
    __shared__ float sM;
    __shared__ uint32_t sN;
    __shared__ double sv[SCAN_NT];
    __shared__ int sl[SCAN_NT];
    const ScanPart *pr = part + (size_t)row * NSEG;
    if (threadIdx.x < 32) {
        float m = -INFINITY;
        uint32_t c = 0;
        for (uint32_t k = threadIdx.x; k < NSEG; k += 32) {
            m = fmaxf(m, pr[k].bv);
            c += pr[k].c;
        }
        for (int o = 16; o > 0; o >>= 1) {
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            c += __shfl_xor_sync(0xffffffffu, c, o);
        }
        if (threadIdx.x == 0) {
            sM = m;
            sN = c;
        }
    }
    __syncthreads();
    const float M = sM;
    const uint32_t ncand = sN;
    const float cut = tier_c_cut(p, M, ncand);
    const WCtx wt = {M, (double)p.temperature};
    const float *lg = logits + (size_t)row * nv;
    uint32_t i0, i1;
    seg_range(nv, g, &i0, &i1);
    int last;
    sv[threadIdx.x] = csub_sum(lg, i0, i1, (int)threadIdx.x, cut, wt, &last);
    sl[threadIdx.x] = last;
    __syncthreads();
    if (threadIdx.x == 0)
        out[(size_t)row * NSEG + g] = csum_add(sv, sl);
}

template <bool LP> __global__ void __launch_bounds__(NT, 1) sample_kernel(Args a)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    DevExec x;
    x.sh = smem_carve(smem_raw, a.list_cap, pow2ceil(a.hist_cap));
    sample_row<DevExec, LP>(x, a, blockIdx.x);
}

/* Rows drawn by a kernel of their own (whose registers stay out of sample_kernel's), one block
 * each. TOPK: top-k rows whose logits no penalty changes (topk_row), before sample_kernel;
 * kdone[row] says whether this kernel drew the row (sample_row_topk) or left it to
 * sample_kernel. Else: the rows that csum_kernel summed (row_cseg), after sample_kernel, which
 * leaves them. */
template <bool TOPK> __global__ void __launch_bounds__(NT, 1) sample_spread_kernel(Args a)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t row = blockIdx.x;
    const uint32_t sr = state_row(a, row);
    const moe_cuda_sample_row p = a.params[sr];
    const moe_cuda_sample_state st = a.state[sr];
    uint32_t wn;
    const bool pen = row_pen_due(a, p, st, &wn);
    const bool mine = TOPK ? topk_row(p) && !pen : row_cseg(a, p, pen);
    bool done = false;
    if (mine) {
        DevExec x;
        x.sh = smem_carve(smem_raw, a.list_cap, pow2ceil(a.hist_cap));
        const float *lg = a.logits + (size_t)row * a.n_vocab;
        if (TOPK)
            done = sample_row_topk(x, a, p, st, row, sr, lg);
        else
            sample_row_cseg(x, a, p, st, row, sr, lg);
    }
    if (TOPK && threadIdx.x == 0)
        a.kdone[row] = done;
}

/* Every row's penalties applied to its logits before the other passes (pen_row), so that the
 * spread passes see the penalised logits; the kernels after it are told (Args::pen_done). */
__global__ void __launch_bounds__(NT, 1) penalty_kernel(Args a)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    DevExec x;
    x.sh = smem_carve(smem_raw, a.list_cap, pow2ceil(a.hist_cap));
    pen_row(x, a, blockIdx.x);
}

/* The spread top-p rows (topp_row; sample_dev.cuh "top-p rows spread over the GPU"), in their
 * launch order: tp_init_kernel (a thread a row), then for each phase TP_LEVELS pairs of
 * tp_hist_kernel and tp_pick_kernel, tp_collect_kernel and tp_final_kernel; a launch leaves the
 * rows that are not at its step. */
__global__ void tp_init_kernel(Args a, uint32_t n_rows, int write_kdone)
{
    const uint32_t row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < n_rows)
        tp_init_row(a, row, write_kdone != 0);
}

/* Block (g, r): segment g's elements of row r's current bin into the histogram of level lv,
 * first in shared memory, then added to the row's global bins. */
__global__ void __launch_bounds__(SCAN_NT) tp_hist_kernel(Args a, int lv)
{
    const uint32_t row = blockIdx.y;
    const TpRow r = a.tp[row];
    if (!r.live || r.lev != lv)
        return;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    double *ms = (double *)smem_raw;
    uint32_t *cs = (uint32_t *)(ms + HB);
    const uint32_t B = 1u << a.lev.width[lv];
    for (uint32_t b = threadIdx.x; b < B; b += SCAN_NT) {
        ms[b] = 0.0;
        cs[b] = 0;
    }
    __syncthreads();
    tp_seg_elems(a, row, r, lv, blockIdx.x, threadIdx.x, SCAN_NT,
                 [&](uint32_t, float, uint32_t d, double w) {
                     atomicAdd(&cs[d], 1u);
                     atomicAdd(&ms[d], w);
                 });
    __syncthreads();
    uint32_t *gc = a.tph_c + (size_t)row * HB;
    double *gm = a.tph_m + (size_t)row * HB;
    for (uint32_t b = threadIdx.x; b < B; b += SCAN_NT)
        if (cs[b]) {
            atomicAdd(&gc[b], cs[b]);
            atomicAdd(&gm[b], ms[b]);
        }
}

__global__ void __launch_bounds__(NT, 1) tp_pick_kernel(Args a, int lv)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    DevExec x;
    x.sh = smem_carve(smem_raw, a.list_cap, pow2ceil(a.hist_cap));
    tp_pick(x, a, blockIdx.x, lv);
}

/* Block (g, r): segment g's elements of row r's final bin appended to the row's list. */
__global__ void __launch_bounds__(SCAN_NT) tp_collect_kernel(Args a)
{
    const uint32_t row = blockIdx.y;
    const TpRow r = a.tp[row];
    if (!r.live || r.lev != -1)
        return;
    uint64_t *gl = a.tpl + (size_t)row * a.list_cap;
    tp_seg_elems(a, row, r, -1, blockIdx.x, threadIdx.x, SCAN_NT,
                 [&](uint32_t i, float l, uint32_t, double) {
                     const uint32_t j = atomicAdd(&a.tp[row].list_n, 1u);
                     if (j < a.list_cap)
                         gl[j] = key(l, i, a.n_vocab);
                 });
}

__global__ void __launch_bounds__(NT, 1) tp_final_kernel(Args a)
{
    extern __shared__ __align__(16) unsigned char smem_raw[];
    DevExec x;
    x.sh = smem_carve(smem_raw, a.list_cap, pow2ceil(a.hist_cap));
    tp_final(x, a, blockIdx.x);
}

/* Row setup by value: kernel arguments are copied when the launch is enqueued, so the host's
 * buffers are free on return (a cudaMemcpyAsync from pageable memory promises less). */
struct RowInit {
    moe_cuda_sample_row p;
    moe_cuda_sample_state st;
};

constexpr uint32_t HIST_CHUNK = 512; /* tokens per set_history launch (2 KB of arguments) */

struct HistChunk {
    int32_t tok[HIST_CHUNK];
    uint32_t off, n;      /* ring slots [off, off + n) of the row */
    int32_t head, len;    /* written with the last chunk (last != 0) */
    int last;
};

HD void row_init_apply(moe_cuda_sample_row *params, moe_cuda_sample_state *state, uint32_t row,
                       const RowInit &v)
{
    params[row] = v.p;
    state[row] = v.st;
}

HD void hist_chunk_apply(int32_t *ring, moe_cuda_sample_state *state, uint32_t row, uint32_t cap,
                         const HistChunk &c, uint32_t t, uint32_t nt)
{
    for (uint32_t i = t; i < c.n; i += nt)
        ring[(size_t)row * cap + c.off + i] = c.tok[i];
    if (c.last && t == 0) {
        state[row].hist_head = c.head;
        state[row].hist_len = c.len;
    }
}

__global__ void set_row_kernel(moe_cuda_sample_row *params, moe_cuda_sample_state *state,
                               uint32_t row, RowInit v)
{
    if (threadIdx.x == 0)
        row_init_apply(params, state, row, v);
}

__global__ void set_hist_kernel(int32_t *ring, moe_cuda_sample_state *state, uint32_t row,
                                uint32_t cap, HistChunk c)
{
    hist_chunk_apply(ring, state, row, cap, c, threadIdx.x, blockDim.x);
}


/* The last hist_cap ids of tokens[0..n) that are inside the vocabulary, oldest first. */
static size_t history_tail(const int32_t *tokens, size_t n, uint32_t n_vocab, uint32_t hist_cap,
                           int32_t *out)
{
    size_t k = 0;
    for (size_t i = n; i-- > 0 && k < hist_cap;)
        if (tokens[i] >= 0 && (uint32_t)tokens[i] < n_vocab)
            k++;
    size_t j = k;
    for (size_t i = n; i-- > 0 && j > 0;)
        if (tokens[i] >= 0 && (uint32_t)tokens[i] < n_vocab)
            out[--j] = tokens[i];
    return k;
}

} /* namespace moe_sample */

using namespace moe_sample;

struct moe_cuda_sampler {
    uint32_t max_rows, n_vocab, hist_cap, list_cap;
    size_t smem;
    Levels lev;
    moe_cuda_sample_row *d_params;
    moe_cuda_sample_state *d_state;
    int32_t *d_ring;
    ScanPart *d_part; /* [max_rows][NSEG] */
    CSum *d_csum;     /* [max_rows][NSEG] */
    uint8_t *d_kdone; /* [max_rows] */
    TpRow *d_tp;      /* [max_rows] */
    uint32_t *d_tph_c; /* [max_rows][HB], zero between uses */
    double *d_tph_m;  /* [max_rows][HB], zero between uses */
    uint64_t *d_tpl;  /* [max_rows][list_cap] */
    uint8_t *plain;   /* [max_rows], host: moe_cuda_sampler_row_spread's mask of the row */
};

/* The passes spread over the GPU that a row with these parameters can take: its kind,
 * MOE_CUDA_SPREAD_GREEDY (greedy: scan_kernel), MOE_CUDA_SPREAD_TIER_C (csum_row: scan_kernel
 * and csum_kernel), MOE_CUDA_SPREAD_TOPK (topk_row) or MOE_CUDA_SPREAD_TOPP (topp_row), or 0;
 * with MOE_CUDA_SPREAD_PENALTY added when a penalty can change its logits (penalty_kernel must
 * apply them first; the kernels also skip penalties whose window holds no token yet, so this is
 * the conservative side of their test). */
static int spread_mask(const moe_cuda_sample_row &r)
{
    const bool pen = !(r.penalty_last_n == 0 || (r.repeat_penalty == 1.0f &&
                                                 r.presence_penalty == 0.0f &&
                                                 r.frequency_penalty == 0.0f));
    const int kind = !(r.temperature > 0.0f) ? MOE_CUDA_SPREAD_GREEDY
                     : csum_row(r)          ? MOE_CUDA_SPREAD_TIER_C
                     : topk_row(r)          ? MOE_CUDA_SPREAD_TOPK
                     : topp_row(r)          ? MOE_CUDA_SPREAD_TOPP
                                            : 0;
    return kind && pen ? kind | MOE_CUDA_SPREAD_PENALTY : kind;
}

extern "C" void moe_cuda_sampler_free(struct moe_cuda_sampler *s)
{
    if (!s)
        return;
    cudaFree(s->d_params);
    cudaFree(s->d_state);
    cudaFree(s->d_ring);
    cudaFree(s->d_part);
    cudaFree(s->d_csum);
    cudaFree(s->d_kdone);
    cudaFree(s->d_tp);
    cudaFree(s->d_tph_c);
    cudaFree(s->d_tph_m);
    cudaFree(s->d_tpl);
    free(s->plain);
    free(s);
}

static int sampler_alloc(struct moe_cuda_sampler *s)
{
    MOE_CUDA_TRY(cudaMalloc((void **)&s->d_params, sizeof *s->d_params * s->max_rows));
    MOE_CUDA_TRY(cudaMalloc((void **)&s->d_state, sizeof *s->d_state * s->max_rows));
    MOE_CUDA_TRY(cudaMalloc((void **)&s->d_part, sizeof *s->d_part * s->max_rows * NSEG));
    MOE_CUDA_TRY(cudaMalloc((void **)&s->d_csum, sizeof *s->d_csum * s->max_rows * NSEG));
    MOE_CUDA_TRY(cudaMalloc((void **)&s->d_kdone, s->max_rows));
    MOE_CUDA_TRY(cudaMalloc((void **)&s->d_tp, sizeof *s->d_tp * s->max_rows));
    MOE_CUDA_TRY(cudaMalloc((void **)&s->d_tph_c, sizeof *s->d_tph_c * s->max_rows * HB));
    MOE_CUDA_TRY(cudaMalloc((void **)&s->d_tph_m, sizeof *s->d_tph_m * s->max_rows * HB));
    MOE_CUDA_TRY(cudaMalloc((void **)&s->d_tpl, sizeof *s->d_tpl * s->max_rows * s->list_cap));
    MOE_CUDA_TRY(cudaMemset(s->d_tph_c, 0, sizeof *s->d_tph_c * s->max_rows * HB));
    MOE_CUDA_TRY(cudaMemset(s->d_tph_m, 0, sizeof *s->d_tph_m * s->max_rows * HB));
    if (s->hist_cap)
        MOE_CUDA_TRY(cudaMalloc((void **)&s->d_ring,
                                sizeof *s->d_ring * (size_t)s->max_rows * s->hist_cap));
    MOE_CUDA_TRY(cudaFuncSetAttribute(sample_kernel<false>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s->smem));
    MOE_CUDA_TRY(cudaFuncSetAttribute(sample_kernel<true>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s->smem));
    MOE_CUDA_TRY(cudaFuncSetAttribute(sample_spread_kernel<false>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s->smem));
    MOE_CUDA_TRY(cudaFuncSetAttribute(sample_spread_kernel<true>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s->smem));
    MOE_CUDA_TRY(cudaFuncSetAttribute(penalty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)s->smem));
    MOE_CUDA_TRY(cudaFuncSetAttribute(tp_pick_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)s->smem));
    MOE_CUDA_TRY(cudaFuncSetAttribute(tp_final_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)s->smem));
    struct moe_sampler_params dp;
    moe_sampler_defaults(&dp);
    moe_cuda_sample_row row;
    if (fill_row(&dp, s->hist_cap > 64 ? s->hist_cap : 64, &row, NULL, 0))
        return MOE_EINTERNAL;
    if (s->hist_cap < 64)
        row.penalty_last_n = (int32_t)s->hist_cap; /* the defaults' penalties are off anyway */
    moe_cuda_sample_row *rows = (moe_cuda_sample_row *)malloc(sizeof *rows * s->max_rows);
    moe_cuda_sample_state *sts = (moe_cuda_sample_state *)calloc(s->max_rows, sizeof *sts);
    s->plain = (uint8_t *)malloc(s->max_rows);
    if (!rows || !sts || !s->plain) {
        free(rows);
        free(sts);
        return -ENOMEM;
    }
    for (uint32_t r = 0; r < s->max_rows; r++) {
        rows[r] = row;
        s->plain[r] = (uint8_t)spread_mask(row);
        rng_seed(dp.seed, sts[r].rng);
    }
    cudaError_t e1 = cudaMemcpy(s->d_params, rows, sizeof *rows * s->max_rows,
                                cudaMemcpyHostToDevice);
    cudaError_t e2 = cudaMemcpy(s->d_state, sts, sizeof *sts * s->max_rows,
                                cudaMemcpyHostToDevice);
    free(rows);
    free(sts);
    MOE_CUDA_TRY(e1);
    MOE_CUDA_TRY(e2);
    MOE_CUDA_TRY(cudaDeviceSynchronize());
    return 0;
}

extern "C" int moe_cuda_sampler_init(struct moe_cuda_sampler **out, uint32_t max_rows,
                                     uint32_t n_vocab, uint32_t hist_cap, uint32_t list_cap,
                                     char *err, size_t errlen)
{
    *out = NULL;
    if (max_rows == 0 || max_rows > 0x7fffffffu)
        return moe_fail(err, errlen, -EINVAL, "cuda sampler: max_rows must be 1..2^31-1");
    if (n_vocab == 0 || n_vocab > MAX_VOCAB)
        return moe_fail(err, errlen, MOE_ERANGE, "cuda sampler: n_vocab %u outside 1..%u",
                        (unsigned)n_vocab, (unsigned)MAX_VOCAB);
    if (hist_cap > MAX_HIST_CAP)
        return moe_fail(err, errlen, MOE_ERANGE, "cuda sampler: hist_cap %u above %u",
                        (unsigned)hist_cap, (unsigned)MAX_HIST_CAP);
    if (list_cap == 0)
        list_cap = DEFAULT_LIST_CAP;
    if (list_cap > MAX_LIST_CAP)
        return moe_fail(err, errlen, MOE_ERANGE, "cuda sampler: list_cap %u above %u",
                        (unsigned)list_cap, (unsigned)MAX_LIST_CAP);
    list_cap = pow2ceil_host(list_cap);
    size_t off[16];
    const size_t smem = smem_layout(list_cap, pow2ceil_host(hist_cap), off);
    int dev = 0, optin = 0;
    MOE_CUDA_TRY(cudaGetDevice(&dev));
    MOE_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (smem > (size_t)optin)
        return moe_fail(err, errlen, MOE_ERANGE,
                        "cuda sampler: %zu bytes of shared memory needed, the device has %d",
                        smem, optin);
    struct moe_cuda_sampler *s = (struct moe_cuda_sampler *)calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    s->max_rows = max_rows;
    s->n_vocab = n_vocab;
    s->hist_cap = hist_cap;
    s->list_cap = list_cap;
    s->smem = smem;
    s->lev = make_levels(n_vocab);
    int rc = sampler_alloc(s);
    if (rc) {
        moe_cuda_sampler_free(s);
        return rc == -ENOMEM ? rc : moe_fail(err, errlen, rc, "cuda sampler: %s", moe_strerror(rc));
    }
    *out = s;
    return 0;
}

extern "C" int moe_cuda_sampler_set_row(struct moe_cuda_sampler *s, uint32_t row,
                                        const struct moe_sampler_params *p, cudaStream_t st,
                                        char *err, size_t errlen)
{
    if (row >= s->max_rows)
        return moe_fail(err, errlen, -EINVAL, "cuda sampler: row %u of %u", (unsigned)row,
                        (unsigned)s->max_rows);
    moe_cuda_sample_row r;
    int rc = fill_row(p, s->hist_cap, &r, err, errlen);
    if (rc)
        return rc;
    RowInit v;
    memset(&v, 0, sizeof v);
    v.p = r;
    rng_seed(p->seed, v.st.rng);
    set_row_kernel<<<1, 32, 0, st>>>(s->d_params, s->d_state, row, v);
    MOE_CUDA_TRY(cudaGetLastError());
    s->plain[row] = (uint8_t)spread_mask(r);
    return 0;
}

extern "C" int moe_cuda_sampler_row_spread(const struct moe_cuda_sampler *s, uint32_t row)
{
    return row < s->max_rows ? s->plain[row] : 0;
}

extern "C" int moe_cuda_sampler_set_history(struct moe_cuda_sampler *s, uint32_t row,
                                            const int32_t *tokens, size_t n, cudaStream_t st)
{
    if (row >= s->max_rows || (n && !tokens))
        return -EINVAL;
    int32_t *tail = NULL;
    size_t k = 0;
    if (s->hist_cap) {
        tail = (int32_t *)malloc(sizeof *tail * s->hist_cap);
        if (!tail)
            return -ENOMEM;
        k = history_tail(tokens, n, s->n_vocab, s->hist_cap, tail);
    }
    /* Chunks of the ring in order; the last one (possibly empty) sets head and length. */
    size_t off = 0;
    cudaError_t e = cudaSuccess;
    do {
        HistChunk c;
        memset(&c, 0, sizeof c);
        c.off = (uint32_t)off;
        c.n = (uint32_t)(k - off < HIST_CHUNK ? k - off : HIST_CHUNK);
        if (c.n)
            memcpy(c.tok, tail + off, sizeof *tail * c.n);
        off += c.n;
        c.last = off == k;
        c.head = s->hist_cap ? (int32_t)(k % s->hist_cap) : 0;
        c.len = (int32_t)k;
        set_hist_kernel<<<1, 256, 0, st>>>(s->d_ring, s->d_state, row, s->hist_cap, c);
        e = cudaGetLastError();
    } while (e == cudaSuccess && off < k);
    free(tail);
    MOE_CUDA_TRY(e);
    return 0;
}

extern "C" int moe_cuda_sample(struct moe_cuda_sampler *s, float *d_logits, uint32_t n_rows,
                               int32_t *d_tokens, float *d_logprobs, int accept, cudaStream_t st)
{
    return moe_cuda_sample_rows(s, d_logits, n_rows, NULL, d_tokens, d_logprobs, accept,
                                MOE_CUDA_SPREAD_ALL, st);
}

extern "C" int moe_cuda_sample_rows(struct moe_cuda_sampler *s, float *d_logits, uint32_t n_rows,
                                    const int32_t *d_rowmap, int32_t *d_tokens,
                                    float *d_logprobs, int accept, int spread,
                                    cudaStream_t st)
{
    if (n_rows > s->max_rows || !d_logits || !d_tokens || ((uintptr_t)d_logits & 3) ||
        ((uintptr_t)d_tokens & 3) || ((uintptr_t)d_logprobs & 3))
        return -EINVAL;
    if (n_rows == 0)
        return 0;
    Args a = launch_args(d_logits, d_rowmap, d_tokens, d_logprobs, s->d_params, s->d_state,
                         s->d_ring, s->n_vocab, s->hist_cap, s->list_cap, accept != 0, s->lev);
    /* Rows without logprobs: the first pass spread over the GPU for the greedy ones, those
     * drawn in id order at a temperature (whose weights' sums are spread too) and top-k rows of
     * k <= 64 (the others scan their row themselves), when the caller says there may be such
     * rows (spread, a mask of moe_cuda_sampler_row_spread's). MOE_SAMPLE_SCAN=0: every row scans
     * itself. */
    static int scan_env = -1;
    if (scan_env < 0)
        scan_env = moe_env_on("MOE_SAMPLE_SCAN");
    const bool csum = (spread & MOE_CUDA_SPREAD_TIER_C) != 0;
    const bool topk = (spread & MOE_CUDA_SPREAD_TOPK) != 0;
    const bool topp = (spread & MOE_CUDA_SPREAD_TOPP) != 0;
    if (!d_logprobs && (csum || topk || topp || (spread & MOE_CUDA_SPREAD_GREEDY)) && scan_env) {
        if (spread & MOE_CUDA_SPREAD_PENALTY) {
            penalty_kernel<<<n_rows, NT, s->smem, st>>>(a);
            MOE_CUDA_TRY(cudaGetLastError());
            a.pen_done = 1;
        }
        scan_kernel<<<dim3(NSEG, n_rows), SCAN_NT, 0, st>>>(d_logits, s->n_vocab, s->d_part);
        MOE_CUDA_TRY(cudaGetLastError());
        a.part = s->d_part;
        if (csum) {
            csum_kernel<<<dim3(NSEG, n_rows), SCAN_NT, 0, st>>>(d_logits, s->n_vocab, s->d_part,
                                                                d_rowmap, s->d_params, s->d_csum);
            MOE_CUDA_TRY(cudaGetLastError());
            a.csum = s->d_csum;
        }
    }
    if (a.part && topk) {
        a.kdone = s->d_kdone;
        sample_spread_kernel<true><<<n_rows, NT, s->smem, st>>>(a);
        MOE_CUDA_TRY(cudaGetLastError());
    }
    if (a.part && topp) {
        a.tp = s->d_tp;
        a.tph_c = s->d_tph_c;
        a.tph_m = s->d_tph_m;
        a.tpl = s->d_tpl;
        const int kd_written = a.kdone != NULL; /* by the top-k kernel, for every row */
        a.kdone = s->d_kdone;
        tp_init_kernel<<<(n_rows + 63) / 64, 64, 0, st>>>(a, n_rows, !kd_written);
        MOE_CUDA_TRY(cudaGetLastError());
        for (int ph = 0; ph < 2; ph++) {
            for (int lv = 0; lv < TP_LEVELS; lv++) {
                tp_hist_kernel<<<dim3(NSEG, n_rows), SCAN_NT, TP_HIST_SMEM, st>>>(a, lv);
                MOE_CUDA_TRY(cudaGetLastError());
                tp_pick_kernel<<<n_rows, NT, s->smem, st>>>(a, lv);
                MOE_CUDA_TRY(cudaGetLastError());
            }
            tp_collect_kernel<<<dim3(NSEG, n_rows), SCAN_NT, 0, st>>>(a);
            MOE_CUDA_TRY(cudaGetLastError());
            tp_final_kernel<<<n_rows, NT, s->smem, st>>>(a);
            MOE_CUDA_TRY(cudaGetLastError());
        }
    }
    if (d_logprobs)
        sample_kernel<true><<<n_rows, NT, s->smem, st>>>(a);
    else
        sample_kernel<false><<<n_rows, NT, s->smem, st>>>(a);
    MOE_CUDA_TRY(cudaGetLastError());
    if (a.csum) {
        sample_spread_kernel<false><<<n_rows, NT, s->smem, st>>>(a);
        MOE_CUDA_TRY(cudaGetLastError());
    }
    return 0;
}

extern "C" int moe_cuda_sampler_rng_state(struct moe_cuda_sampler *s, uint32_t row,
                                          uint64_t state[4], cudaStream_t st)
{
    if (row >= s->max_rows)
        return -EINVAL;
    moe_cuda_sample_state h;
    MOE_CUDA_TRY(cudaMemcpyAsync(&h, s->d_state + row, sizeof h, cudaMemcpyDeviceToHost, st));
    MOE_CUDA_TRY(cudaStreamSynchronize(st));
    memcpy(state, h.rng, sizeof h.rng);
    return 0;
}

extern "C" int moe_cuda_sampler_history(struct moe_cuda_sampler *s, uint32_t row, int32_t *out,
                                        size_t cap, cudaStream_t st)
{
    if (row >= s->max_rows)
        return -EINVAL;
    moe_cuda_sample_state h;
    MOE_CUDA_TRY(cudaMemcpyAsync(&h, s->d_state + row, sizeof h, cudaMemcpyDeviceToHost, st));
    MOE_CUDA_TRY(cudaStreamSynchronize(st));
    if (!s->hist_cap || h.hist_len <= 0)
        return 0;
    int32_t *ring = (int32_t *)malloc(sizeof *ring * s->hist_cap);
    if (!ring)
        return -ENOMEM;
    cudaError_t e = cudaMemcpyAsync(ring, s->d_ring + (size_t)row * s->hist_cap,
                                    sizeof *ring * s->hist_cap, cudaMemcpyDeviceToHost, st);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(st);
    if (e != cudaSuccess) {
        free(ring);
        MOE_CUDA_TRY(e);
    }
    const uint32_t len = (uint32_t)h.hist_len;
    const uint32_t start = ((uint32_t)h.hist_head + s->hist_cap - len) % s->hist_cap;
    for (uint32_t i = 0; i < len && i < cap; i++)
        out[i] = ring[(start + i) % s->hist_cap];
    free(ring);
    return (int)len;
}

/* The tensor-core mat-vec (see mv_tc.h; the fragment scheme is in mv_tc.cuh, the device parts
 * shared with the expert kernels in mv_tc_dev.cuh).
 *
 * One block of W = min(8, blocks per row) warps takes one tile of 16 rows for up to NT tokens
 * (NT = 1, 2, 4 or 8; blockIdx.y picks the token group): warp w takes the row's Q4_K blocks w,
 * w + W, ..., and the warps' sums are added in warp order at the end, so the floats depend on the
 * row length only, never on n_tok. Before that the block stages its tokens' inputs in shared
 * memory in fragment order (mv_tc.cuh: tc_stage4, tc_stage_sums), scaled per token by the power
 * of two of tc_scale_exp; each warp has loaded its first block's bytes before the staging, so
 * those loads are in flight while it runs (one token: after the copy of its row into shared
 * memory, which the staging then reads). */
#include "worker/cuda/mv_tc.h"

#include "worker/cuda/matvec.h"

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
#include "worker/cuda/mv_tc_dev.cuh"
#include "worker/cuda/ops_dev.cuh"
#include "worker/cuda/smem.cuh"

#define TC_MAX_WARPS 8
/* Shared memory for the staged inputs of a launch's token group, at most. */
#define TC_STAGE_MAX (64 * 1024)

/* The matrices of a launch (at most 3, one type and row length, the same inputs): job j's tiles
 * are blockIdx.x in [tile0[j], tile0[j+1]). */
struct tc_jobs {
    const uint8_t *w[3];
    int64_t rows[3], ldy[3], tile0[4];
    float *y[3];
    int n;
};

/* One block per token: its row of x staged into the workspace as a tile's tc_stage would. */
template <int K>
static __global__ void __launch_bounds__(128)
mv_tc_stage_kernel(const float *__restrict__ x, int64_t ldx, int nsb, tc_staged st)
{
    __shared__ unsigned s_amax[1];
    __shared__ int s_exp[1];
    pdl_wait();
    pdl_trigger();
    const int64_t r = blockIdx.x;
    const float *xr[1] = {x + r * ldx};
    tc_stage<1, K>(xr, nsb, st.xs + (size_t)r * nsb * 64, st.sxs + (size_t)r * nsb * 4, s_exp,
                   s_amax);
    if (threadIdx.x == 0)
        st.exp[r] = s_exp[0];
}

/* The staging launch: n_tok rows of x into st, one block per token. */
template <int K>
static int tc_stage_launch(const float *x, int64_t ldx, int nsb, int64_t n_tok, const tc_staged &st,
                           cudaStream_t s)
{
    MOE_CUDA_TRY(moe_launch(mv_tc_stage_kernel<K>, dim3((unsigned)n_tok), dim3(128), 0, s, x, ldx,
                            nsb, st));
    return 0;
}

/* The RMSNorm a one-token launch applies to its row on the way (moe_cuda_matvec_tc_norm): the
 * norm's weight w, eps, and where block 0 stores the normalised row (or NULL). */
struct tc_norm {
    const float *w;
    float eps;
    float *out;
};

/* The RMSNorm of rmsnorm_kernel (ops.cu) on the raw copy of a row (tc_raw_copy, not yet waited
 * for), then tc_stage_raw's staging of the normalised row. Every warp sums the squares itself in
 * row_ss_warp's order (lane l: float4s l, l + 32, ..., four loads in flight), so no warp waits
 * for another's sum; each thread then writes x · scale · w of its float4s over the copy of the
 * norm's weight (wn, padded like the raw copy, copied by the block before its wait: the raw copy
 * is still being read by other warps' sums) and takes their largest magnitude for the staging's
 * exponent. The same floats as the RMSNorm kernel's output staged by tc_stage_raw, so a token's
 * products do not depend on whether its norm was folded. store: also write the normalised row
 * to nm.out. */
template <int K>
static __device__ __forceinline__ void tc_norm_stage_raw(const float *raw, float *wn, int nsb,
                                                         const tc_norm &nm, bool store, uint4 *xs,
                                                         uint2 *sxs, int *s_exp, unsigned *s_amax)
{
    const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31;
    const int64_t n = (int64_t)nsb * 256, n4 = n / 4;
    const tc_raw_ld ld{raw};
    if (tid == 0)
        *s_amax = 0;
    cp_async_wait_all();
    __syncthreads();
    float ss = 0.0f;
    int64_t q = lane;
    for (; q + 96 < n4; q += 128) {
        const float4 a = ld((int)(4 * q)), b = ld((int)(4 * (q + 32)));
        const float4 c = ld((int)(4 * (q + 64))), d = ld((int)(4 * (q + 96)));
        ss = ss_add4(ss, a);
        ss = ss_add4(ss, b);
        ss = ss_add4(ss, c);
        ss = ss_add4(ss, d);
    }
    for (; q < n4; q += 32)
        ss = ss_add4(ss, ld((int)(4 * q)));
    const float sc = rms_scale(warp_sum(ss), n, nm.eps);
    unsigned m = 0;
    for (int64_t k = tid; k < n4; k += nthr) {
        float4 *p = (float4 *)(wn + 4 * (k + (k >> 3)));
        const float4 v = ld((int)(4 * k)), g = *p;
        const float4 y = make_float4(v.x * sc * g.x, v.y * sc * g.y, v.z * sc * g.z,
                                     v.w * sc * g.w);
        *p = y;
        if (store)
            ((float4 *)nm.out)[k] = y;
        m = max(max(m, abs_bits(y.x)), max(abs_bits(y.y), max(abs_bits(y.z), abs_bits(y.w))));
    }
    tc_stage_block_from<K>(tc_raw_ld{wn}, m, nsb, xs, sxs, s_exp, s_amax);
}

/* ST: the inputs come staged in st (else the block stages them in shared memory). NORM (one
 * token, not staged): x is the RMSNorm's source row, normalised by the block on the way
 * (tc_norm_stage_raw); the weights' first loads are then issued before the wait (pre is ignored).
 * pre: a one-token launch issues its weights' first loads before the wait too (else after the
 * copy of its row). */
template <int NT, int K, bool ST, bool NORM = false>
static __global__ void __launch_bounds__(32 * TC_MAX_WARPS)
mv_tc_kernel(const tc_jobs J, size_t row_bytes, int nsb, const float *__restrict__ x, int64_t ldx,
             int64_t n_tok, int accumulate, const tc_staged st, const tc_norm nm, int pre)
{
    extern __shared__ uint4 sm[];
    __shared__ unsigned s_amax[NT];
    __shared__ int s_exp_sm[NT];
    const size_t stage_u4 = ST ? 0 : (size_t)NT * nsb * 66;
    uint4 *xs = sm;                                      /* [NT][nsb][16 mma][4 t] */
    uint2 *sxs = (uint2 *)(sm + (size_t)NT * nsb * 64);  /* [NT][nsb][4 t] */
    float4 *red = (float4 *)(sm + stage_u4);             /* [warps][32] */
    const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, wi = tid >> 5;
    const int nw = nthr >> 5, g = lane >> 2, t = lane & 3;
    const int64_t t0 = (int64_t)blockIdx.y * NT;
    int j = 0;
    while (j + 1 < J.n && (int64_t)blockIdx.x >= J.tile0[j + 1])
        j++;
    const uint8_t *w = J.w[j];
    const int64_t rows = J.rows[j], ldy = J.ldy[j];
    float *y = J.y[j];
    const int64_t row0 = ((int64_t)blockIdx.x - J.tile0[j]) * TC_ROWS + g, row1 = row0 + 8;
    const uint8_t *p0 = w + (size_t)(row0 < rows ? row0 : rows - 1) * row_bytes;
    const uint8_t *p1 = w + (size_t)(row1 < rows ? row1 : rows - 1) * row_bytes;
    const size_t BB = tc_kind<K>::block_bytes;
    typename tc_kind<K>::raw raw = {};
    /* One token staged by the block: its row is copied into shared memory after the warps' sums
     * first (tc_raw_copy; after the wait, x being the previous kernel's output), ahead of the
     * weights' loads, and staged from there (tc_stage_raw). */
    constexpr bool RAW = NT == 1 && !ST;
    static_assert(!NORM || RAW, "the norm on the way takes one token staged by the block");
    float *xraw = (float *)(red + nw * 32);
    float *wn = xraw + tc_raw_floats((int64_t)nsb * 256); /* NORM: the norm's weight */
    const bool early = !RAW || NORM || pre;
    if constexpr (NORM)
        tc_raw_copy(wn, nm.w, (int64_t)nsb * 256, tid, nthr);
    if (early && wi < nsb)
        raw = tc_kind<K>::load(p0 + (size_t)wi * BB, p1 + (size_t)wi * BB, t);
    pdl_wait(); /* x is the previous kernel's output; the weights are not */
    pdl_trigger();
    if constexpr (RAW) {
        tc_raw_copy(xraw, x + t0 * ldx, (int64_t)nsb * 256, tid, nthr);
        if (!early && wi < nsb)
            raw = tc_kind<K>::load(p0 + (size_t)wi * BB, p1 + (size_t)wi * BB, t);
    }

    const int *s_exp = s_exp_sm;
    int gx = g & (NT - 1);
    if constexpr (ST) {
        /* The step's staged rows; a column past the last token reads the last one. */
        xs = st.xs + (size_t)t0 * nsb * 64;
        sxs = st.sxs + (size_t)t0 * nsb * 4;
        s_exp = st.exp + t0;
        if (t0 + gx >= n_tok)
            gx = (int)(n_tok - 1 - t0);
    } else if constexpr (RAW) {
        if constexpr (NORM)
            tc_norm_stage_raw<K>(xraw, wn, nsb, nm, nm.out && blockIdx.x == 0, xs, sxs, s_exp_sm,
                                 s_amax);
        else
            tc_stage_raw<K>(xraw, nsb, xs, sxs, s_exp_sm, s_amax);
    } else {
        const float *xr[NT];
        UNROLL
        for (int c = 0; c < NT; c++)
            xr[c] = x + (t0 + c < n_tok ? t0 + c : n_tok - 1) * ldx;
        tc_stage<NT, K>(xr, nsb, xs, sxs, s_exp_sm, s_amax);
    }

    /* The warp's blocks. Column g reads token g % NT (the columns past NT repeat a staged token;
     * their results are not stored). */
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    tc_rows<K>(p0, p1, t, wi, nw, nsb, raw, xs, sxs, gx, acc);
    red[wi * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    if (wi != 0)
        return;
    float4 s = red[lane];
    for (int k = 1; k < nw; k++) {
        const float4 v = red[k * 32 + lane];
        s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
    const float o[4] = {s.x, s.y, s.z, s.w};
    UNROLL
    for (int c = 0; c < 2; c++) {
        const int col = 2 * t + c;
        if (col >= NT || t0 + col >= n_tok)
            continue;
        const float back = ldexpf(1.0f, s_exp[col]);
        float *yr = y + (t0 + col) * ldy;
        if (row0 < rows)
            yr[row0] = accumulate ? yr[row0] + o[c] * back : o[c] * back;
        if (row1 < rows)
            yr[row1] = accumulate ? yr[row1] + o[2 + c] * back : o[2 + c] * back;
    }
}

extern "C" int moe_cuda_matvec_tc_supported(uint32_t type)
{
    return type == MOE_TYPE_Q4_K || type == MOE_TYPE_Q6_K;
}

/* Tokens per launch column group: a power of two up to TC_COLS whose staging fits. */
static int tc_cols(int64_t n_tok, int nsb)
{
    int nt = 1;
    while (nt < TC_COLS && nt < n_tok && (size_t)(2 * nt) * nsb * 64 * 16 <= TC_STAGE_MAX)
        nt *= 2;
    return nt;
}

/* Whether one-token launches issue their weights' first loads before the wait (the pre
 * argument of mv_tc_kernel): MOE_CUDA_TC_PRE=0 turns it off, read once per process. */
static int tc_pre(void)
{
    static const int pre = moe_env_on("MOE_CUDA_TC_PRE");
    return pre;
}

template <int NT, int K>
static int tc_launch(const tc_jobs &J, size_t rb, int nsb, const float *x, int64_t ldx,
                     int64_t n_tok, int accumulate, void *ws, cudaStream_t s)
{
    const int warps = nsb < TC_MAX_WARPS ? nsb : TC_MAX_WARPS;
    const dim3 grid((unsigned)J.tile0[J.n], (unsigned)((n_tok + NT - 1) / NT));
    if (ws) {
        const tc_staged st = tc_ws_split(ws, nsb, n_tok);
        const int rc = tc_stage_launch<K>(x, ldx, nsb, n_tok, st, s);
        if (rc)
            return rc;
        MOE_CUDA_TRY(moe_launch(mv_tc_kernel<NT, K, true>, grid, dim3(32 * warps),
                                (size_t)warps * 32 * sizeof(uint4), s, J, rb, nsb, x, ldx, n_tok,
                                accumulate, st, tc_norm{}, 0));
        return 0;
    }
    const size_t smem = ((size_t)NT * nsb * 66 + (size_t)warps * 32) * sizeof(uint4) +
                        (NT == 1 ? sizeof(float) * (size_t)tc_raw_floats((int64_t)nsb * 256) : 0);
    MOE_CUDA_TRY((moe_raise_smem<mv_tc_kernel<NT, K, false>>(smem)));
    MOE_CUDA_TRY(moe_launch(mv_tc_kernel<NT, K, false>, grid, dim3(32 * warps), smem, s, J, rb,
                            nsb, x, ldx, n_tok, accumulate, tc_staged{}, tc_norm{},
                            NT == 1 ? tc_pre() : 0));
    return 0;
}

/* One token, normalised by every block on the way (mv_tc_kernel's NORM). */
template <int K>
static int tc_launch_norm(const tc_jobs &J, size_t rb, int nsb, const float *src,
                          const tc_norm &nm, cudaStream_t s)
{
    const int warps = nsb < TC_MAX_WARPS ? nsb : TC_MAX_WARPS;
    const size_t smem = ((size_t)nsb * 66 + (size_t)warps * 32) * sizeof(uint4) +
                        sizeof(float) * 2 * (size_t)tc_raw_floats((int64_t)nsb * 256);
    if (smem > 200 * 1024)
        return -EINVAL;
    MOE_CUDA_TRY((moe_raise_smem<mv_tc_kernel<1, K, false, true>>(smem)));
    MOE_CUDA_TRY(moe_launch(mv_tc_kernel<1, K, false, true>, dim3((unsigned)J.tile0[J.n], 1),
                            dim3(32 * warps), smem, s, J, rb, nsb, src, (int64_t)nsb * 256,
                            (int64_t)1, 0, tc_staged{}, nm, 1));
    return 0;
}

/* The launch's table of jobs[0..n_jobs) (n_jobs 1 to 3): -EINVAL for a job without weights or
 * output, negative rows, ldy < rows, weights not 16-byte aligned, or more tiles than a grid. */
static int tc_jobs_make(const struct moe_mv_job *jobs, int n_jobs, tc_jobs *J)
{
    *J = tc_jobs{};
    J->n = n_jobs;
    for (int j = 0; j < n_jobs; j++) {
        const struct moe_mv_job *jb = &jobs[j];
        if (!jb->w || !jb->y || jb->rows < 0 || jb->ldy < jb->rows || ((uintptr_t)jb->w & 15) != 0)
            return -EINVAL;
        J->w[j] = (const uint8_t *)jb->w;
        J->rows[j] = jb->rows;
        J->y[j] = jb->y;
        J->ldy[j] = jb->ldy;
        J->tile0[j + 1] = J->tile0[j] + (jb->rows + TC_ROWS - 1) / TC_ROWS;
    }
    return J->tile0[n_jobs] > 0x7fffffffLL ? -EINVAL : 0;
}

extern "C" size_t moe_cuda_matvec_tc_ws_bytes(int64_t n, int64_t n_tok)
{
    if (n <= 0 || n_tok <= 0)
        return 0;
    const size_t nsb = (size_t)(n + 255) / 256;
    return (size_t)n_tok * (nsb * (64 * sizeof(uint4) + 4 * sizeof(uint2)) + sizeof(int));
}

extern "C" int moe_cuda_tc_stage(uint32_t type, const float *d_x, int64_t ldx, int64_t n,
                                 int64_t n_tok, void *d_ws, size_t ws_bytes, cudaStream_t s)
{
    if (!moe_cuda_matvec_tc_supported(type))
        return MOE_EUNSUPPORTED;
    if (n <= 0 || n % 256 != 0 || n / 256 > 0x7fff || n_tok < 0 || n_tok > 0x7fffffffLL ||
        !d_x || ((uintptr_t)d_x & 15) != 0 || ldx < n || ldx % 4 != 0 || !d_ws ||
        ((uintptr_t)d_ws & 15) != 0 || ws_bytes < moe_cuda_matvec_tc_ws_bytes(n, n_tok))
        return -EINVAL;
    if (n_tok == 0)
        return 0;
    const int nsb = (int)(n / 256);
    const tc_staged st = tc_ws_split(d_ws, nsb, n_tok);
    return type == MOE_TYPE_Q6_K ? tc_stage_launch<MOE_TYPE_Q6_K>(d_x, ldx, nsb, n_tok, st, s)
                                 : tc_stage_launch<MOE_TYPE_Q4_K>(d_x, ldx, nsb, n_tok, st, s);
}

extern "C" int moe_cuda_matvec_tc_multi_ws(uint32_t type, const struct moe_mv_job *jobs,
                                           int n_jobs, int64_t n, const float *d_x, int64_t ldx,
                                           int64_t n_tok, int accumulate, void *d_ws,
                                           size_t ws_bytes, cudaStream_t s)
{
    if (!moe_cuda_matvec_tc_supported(type))
        return MOE_EUNSUPPORTED;
    if (n <= 0 || n % 256 != 0 || n / 256 > 0x7fff || n_tok < 0 || !d_x || !jobs ||
        n_jobs < 1 || n_jobs > 3 || ((uintptr_t)d_x & 15) != 0 || ldx < n || ldx % 4 != 0 ||
        n_tok > 65535LL * TC_COLS || ((uintptr_t)d_ws & 15) != 0 ||
        (d_ws && ws_bytes < moe_cuda_matvec_tc_ws_bytes(n, n_tok)) || (d_ws && n_tok > 0x7fffffffLL))
        return -EINVAL;
    tc_jobs J;
    if (tc_jobs_make(jobs, n_jobs, &J))
        return -EINVAL;
    if (J.tile0[n_jobs] == 0 || n_tok == 0)
        return 0;
    const int nsb = (int)(n / 256);
    if ((size_t)nsb * 64 * 16 > TC_STAGE_MAX)
        return -EINVAL; /* rows over 16384 elements */
    const size_t rb = moe_row_bytes(type, n);
#define TC_CASES(K)                                                                          \
    switch (tc_cols(n_tok, nsb)) {                                                           \
    case 8: return tc_launch<8, K>(J, rb, nsb, d_x, ldx, n_tok, accumulate, d_ws, s);        \
    case 4: return tc_launch<4, K>(J, rb, nsb, d_x, ldx, n_tok, accumulate, d_ws, s);        \
    case 2: return tc_launch<2, K>(J, rb, nsb, d_x, ldx, n_tok, accumulate, d_ws, s);        \
    default: return tc_launch<1, K>(J, rb, nsb, d_x, ldx, n_tok, accumulate, d_ws, s);       \
    }
    if (type == MOE_TYPE_Q6_K)
        TC_CASES(MOE_TYPE_Q6_K)
    TC_CASES(MOE_TYPE_Q4_K)
#undef TC_CASES
}

extern "C" int moe_cuda_matvec_tc_norm(uint32_t type, const struct moe_mv_job *jobs, int n_jobs,
                                       int64_t n, const float *d_src, const float *d_g, float eps,
                                       float *d_dst, cudaStream_t s)
{
    if (!moe_cuda_matvec_tc_supported(type))
        return MOE_EUNSUPPORTED;
    if (n <= 0 || n % 256 != 0 || n / 256 > 0x7fff || !d_src || !d_g || !jobs || n_jobs < 1 ||
        n_jobs > 3 || ((uintptr_t)d_src & 15) != 0 || ((uintptr_t)d_g & 15) != 0 ||
        ((uintptr_t)d_dst & 15) != 0)
        return -EINVAL;
    tc_jobs J;
    if (tc_jobs_make(jobs, n_jobs, &J))
        return -EINVAL;
    if (J.tile0[n_jobs] == 0)
        return 0;
    const int nsb = (int)(n / 256);
    const size_t rb = moe_row_bytes(type, n);
    const tc_norm nm = {d_g, eps, d_dst};
    return type == MOE_TYPE_Q6_K ? tc_launch_norm<MOE_TYPE_Q6_K>(J, rb, nsb, d_src, nm, s)
                                 : tc_launch_norm<MOE_TYPE_Q4_K>(J, rb, nsb, d_src, nm, s);
}

extern "C" int moe_cuda_matvec_tc_multi(uint32_t type, const struct moe_mv_job *jobs, int n_jobs,
                                        int64_t n, const float *d_x, int64_t ldx, int64_t n_tok,
                                        int accumulate, cudaStream_t s)
{
    return moe_cuda_matvec_tc_multi_ws(type, jobs, n_jobs, n, d_x, ldx, n_tok, accumulate, NULL,
                                       0, s);
}

extern "C" int moe_cuda_matvec_tc_ws(uint32_t type, const void *d_w, int64_t n, int64_t rows,
                                     const float *d_x, int64_t ldx, int64_t n_tok, float *d_y,
                                     int64_t ldy, void *d_ws, size_t ws_bytes, cudaStream_t s)
{
    const struct moe_mv_job job = {d_w, rows, d_y, ldy}; /* checked by the multi form */
    return moe_cuda_matvec_tc_multi_ws(type, &job, 1, n, d_x, ldx, n_tok, 0, d_ws, ws_bytes, s);
}

extern "C" int moe_cuda_matvec_tc(uint32_t type, const void *d_w, int64_t n, int64_t rows,
                                  const float *d_x, int64_t ldx, int64_t n_tok, float *d_y,
                                  int64_t ldy, cudaStream_t s)
{
    return moe_cuda_matvec_tc_ws(type, d_w, n, rows, d_x, ldx, n_tok, d_y, ldy, NULL, 0, s);
}

/* Device bodies of the per-token expert kernels (experts.cu): shared by those kernels and the
 * fused decode kernel (fused.cu), so an expert's products are the same floats whichever runs
 * them. */
#ifndef MOE_CUDA_EXPERTS_DEV_CUH
#define MOE_CUDA_EXPERTS_DEV_CUH

#include "worker/cuda/mv_warp.cuh"

static __device__ __forceinline__ float silu_f(float g)
{
    return g / (1.0f + expf(-g));
}

/* Rows per warp and warps per block of the expert kernels. A warp walks GU_ROWS rows of gate and
 * the same rows of up (2·GU_ROWS dot products sharing each x load), so every lane has several
 * independent loads in flight; a layer's gate/up for one token is one wave of blocks. */
#ifndef GU_ROWS /* a build for measurements may set it */
#define GU_ROWS 4
#endif
#define GU_WARPS 4
/* Slots of one expert taken together by the grouped kernels (weights decoded once for them). */
#define GROUP_T 4
/* Rows per warp in the grouped gate/up (fewer than GU_ROWS: GROUP_T inputs share registers). */
#define GUG_ROWS 2

/* DOWN_ROWS rows of one token per block, one warp per expert (j = warp, warp + DOWN_WARPS, ...),
 * in two passes of DOWN_ROWS/2 rows. At one token 8 rows give 256 blocks for a 2048-wide model
 * (two per SM on an H200): measured 275 -> 307 tok/s against 16 rows (docs/benchmarks.md). */
#define DOWN_WARPS 8
#ifndef DOWN_ROWS /* a build for measurements may set it (a multiple of 4) */
#define DOWN_ROWS 8
#endif
/* Rows per block of the grouped down kernel (passes of DOWNG_ROWS/4 rows over the warps). */
#ifndef DOWNG_ROWS
#define DOWNG_ROWS 16
#endif

/* One warp: rows r0 .. r0+GU_ROWS-1 of gate (table a's expert at ga) and of up (ua), with input x;
 * out[r] = silu(gate·x)·(up·x) (mode 0; gate and up of type K) or gate·x (mode 1). */
template <int K, int MODE>
static __device__ __forceinline__ void gate_up_warp(const uint8_t *ga, const uint8_t *ua,
                                                    size_t row_bytes, unsigned block_bytes, int nu,
                                                    int64_t ff, const float *x, int64_t r0,
                                                    float *out)
{
    constexpr int M = MODE == 0 ? 2 : 1; /* matrices */
    const uint8_t *rowp[M * GU_ROWS];
    const uint8_t *base[2] = {ga, ua};
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++) {
        const int64_t row = r0 + r < ff ? r0 + r : r0; /* past the end: recompute r0, unstored */
#pragma unroll
        for (int m = 0; m < M; m++)
            rowp[M * r + m] = base[m] + (size_t)row * row_bytes;
    }
    float acc[M * GU_ROWS];
    row_dots<K, M * GU_ROWS>(rowp, block_bytes, nu, x, acc);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++)
        if (lane == r && r0 + r < ff)
            out[r0 + r] = MODE == 0 ? silu_f(acc[2 * r]) * acc[2 * r + 1] : acc[r];
}

/* One block (its warps: one per chosen expert, j = warp, warp + warps, ...): rows r0 ..
 * r0+DOWN_ROWS-1 of one token's down products (act: the token's k input rows, ldact apart;
 * sel_e, sel_w: its k choices), then one thread per row weights and adds them in the token's
 * top-k order and adds the sum into h (the token's residual row): the fixed-order combine of the
 * CPU backend, fused. part: k·DOWN_ROWS floats of shared memory. */
template <int K>
static __device__ __forceinline__ void down_block(const uint8_t *const *da, size_t row_bytes,
                                                  unsigned block_bytes, int nu, int64_t E,
                                                  const float *act, int64_t ldact, int kuse,
                                                  const int32_t *sel_e, const float *sel_w,
                                                  float *h, int64_t r0, float *part)
{
    constexpr int HALF = DOWN_ROWS / 2;
    const int w = threadIdx.x >> 5, nw = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (int j = w; j < kuse; j += nw) {
        const uint8_t *base = da[sel_e[j]];
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const uint8_t *rowp[HALF];
#pragma unroll
            for (int r = 0; r < HALF; r++) {
                const int64_t row = r0 + hf * HALF + r;
                rowp[r] = base + (size_t)(row < E ? row : r0) * row_bytes;
            }
            float acc[HALF];
            row_dots<K, HALF>(rowp, block_bytes, nu, act + j * ldact, acc);
#pragma unroll
            for (int r = 0; r < HALF; r++)
                if (lane == r)
                    part[j * DOWN_ROWS + hf * HALF + r] = acc[r];
        }
    }
    __syncthreads();
    if (threadIdx.x < DOWN_ROWS && r0 + threadIdx.x < E) {
        float tot = 0.0f;
        for (int j = 0; j < kuse; j++)
            tot += sel_w[j] * part[j * DOWN_ROWS + threadIdx.x];
        h[r0 + threadIdx.x] += tot;
    }
    __syncthreads(); /* part is free for the block's next use */
}

#endif

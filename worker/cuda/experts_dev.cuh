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

/* One warp copies n bytes from src (host memory mapped for the GPU) to dst (a VRAM slot): the
 * copies of an expert that a layer's resolve left to the expert kernels (docs/offload.md, "Inside
 * the step"), each warp the rows it is about to read. 16-byte words when both ends and n allow
 * it, eight loads in flight per lane before their stores; the warp's later reads of dst see the
 * bytes (__syncwarp orders its lanes' memory accesses). */
static __device__ __forceinline__ void warp_fill(uint8_t *dst, const uint8_t *src, size_t n)
{
    const int lane = threadIdx.x & 31;
    if ((((uintptr_t)dst | (uintptr_t)src | n) & 15) == 0) {
        const uint4 *s4 = (const uint4 *)src;
        uint4 *d4 = (uint4 *)dst;
        const size_t n16 = n / 16;
        size_t i = (size_t)lane;
        for (; i + 7 * 32 < n16; i += 8 * 32) {
            uint4 v[8];
#pragma unroll
            for (int u = 0; u < 8; u++)
                v[u] = s4[i + 32 * u];
#pragma unroll
            for (int u = 0; u < 8; u++)
                d4[i + 32 * u] = v[u];
        }
        for (; i < n16; i += 32)
            d4[i] = s4[i];
    } else {
        for (size_t i = (size_t)lane; i < n; i += 32)
            dst[i] = src[i];
    }
    __syncwarp();
}

/* A warp's rows r0 .. r0+rows-1 (rows of row_bytes) of one matrix copied from fill to at, when
 * fill is set (the copies left to the expert kernels). */
static __device__ __forceinline__ void warp_fill_rows(const uint8_t *at, const uint8_t *fill,
                                                      int64_t r0, int64_t rows, size_t row_bytes)
{
    if (!fill || rows <= 0)
        return;
    const size_t off = (size_t)r0 * row_bytes;
    warp_fill((uint8_t *)at + off, fill + off, (size_t)rows * row_bytes);
}

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

/* A token's k combine weights, loaded by the threads that add the experts' rows before the
 * products, so that the sum after the block's barrier does not wait for them: up to 8 in
 * registers (more are read where they are added). The sum is the same floats either way: the
 * products added in top-k order into a sum that starts at 0. */
struct combine_w {
    float w[8];
    __device__ __forceinline__ void load(const float *sel_w, int k)
    {
#pragma unroll
        for (int j = 0; j < 8; j++)
            w[j] = j < k ? sel_w[j] : 0.0f;
    }
    /* Σ_j sel_w[j] · part[j·stride + r], j = 0..k-1 in order. */
    __device__ __forceinline__ float sum(const float *sel_w, int k, const float *part, int stride,
                                         int r) const
    {
        float tot = 0.0f;
        if (k <= 8) {
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (j < k)
                    tot += w[j] * part[j * stride + r];
        } else {
            for (int j = 0; j < k; j++)
                tot += sel_w[j] * part[j * stride + r];
        }
        return tot;
    }
};

/* One block (its warps: one per chosen expert, j = warp, warp + warps, ...): rows r0 ..
 * r0+DOWN_ROWS-1 of one token's down products (act: the token's k input rows, ldact apart;
 * sel_e, sel_w: its k choices), then one thread per row weights and adds them in the token's
 * top-k order and adds the sum into h (the token's residual row): the fixed-order combine of the
 * CPU backend, fused. part: k·DOWN_ROWS floats of shared memory. dfill (or NULL): the down
 * table's fill sources (warp_fill_rows). */
template <int K>
static __device__ __forceinline__ void down_block(const uint8_t *const *da, size_t row_bytes,
                                                  unsigned block_bytes, int nu, int64_t E,
                                                  const float *act, int64_t ldact, int kuse,
                                                  const int32_t *sel_e, const float *sel_w,
                                                  float *h, int64_t r0, float *part,
                                                  const uint8_t *const *dfill = nullptr)
{
    constexpr int HALF = DOWN_ROWS / 2;
    const int w = threadIdx.x >> 5, nw = blockDim.x >> 5, lane = threadIdx.x & 31;
    combine_w cw;
    if (threadIdx.x < DOWN_ROWS)
        cw.load(sel_w, kuse);
    for (int j = w; j < kuse; j += nw) {
        const uint8_t *base = da[sel_e[j]];
        if (dfill)
            warp_fill_rows(base, dfill[sel_e[j]], r0, E - r0 < DOWN_ROWS ? E - r0 : DOWN_ROWS,
                           row_bytes);
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
    if (threadIdx.x < DOWN_ROWS && r0 + threadIdx.x < E)
        h[r0 + threadIdx.x] += cw.sum(sel_w, kuse, part, DOWN_ROWS, threadIdx.x);
    __syncthreads(); /* part is free for the block's next use */
}

#endif

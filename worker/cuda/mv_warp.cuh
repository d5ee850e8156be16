/* The dot products of a warp's rows (mat-vec, experts, the fused step): every kernel that
 * multiplies weight rows walks them with these, so a row's result is the same floats whichever
 * kernel computes it. */
#ifndef MOE_CUDA_MV_WARP_CUH
#define MOE_CUDA_MV_WARP_CUH

#include "worker/cuda/qdot.cuh"

/* RW rows' dot products with T inputs x[i], complete in every lane: the weights are loaded and
 * decoded once for all T (the compiler shares them between the unrolled calls), with the same
 * float operations per (row, input) as for one input. The plain types' decoders take one row at
 * a time, so their rows are walked one after the other. */
template <int K, int RW, int T>
static __device__ __forceinline__ void row_dots_multi(const uint8_t *const *rowp,
                                                      unsigned block_bytes, int nu,
                                                      const float *const *x, float (*acc)[RW])
{
    constexpr int PB = unit_shape<K>::per_block, BL = unit_shape<K>::blck;
    if constexpr (rows_per_warp<K>() == 1 && RW > 1) {
        UNROLL
        for (int r = 0; r < RW; r++) {
            float a1[T][1];
            row_dots_multi<K, 1, T>(rowp + r, block_bytes, nu, x, a1);
            UNROLL
            for (int i = 0; i < T; i++)
                acc[i][r] = a1[i][0];
        }
    } else {
        const int lane = threadIdx.x & 31;
        UNROLL
        for (int i = 0; i < T; i++)
            UNROLL
            for (int r = 0; r < RW; r++)
                acc[i][r] = 0.0f;
#pragma unroll(RW >= 2 || T > 1 ? 1 : 2)
        for (int u = lane; u < nu; u += 32) {
            const unsigned bi = (unsigned)u / PB;
            const uint8_t *bs[RW];
            UNROLL
            for (int r = 0; r < RW; r++)
                bs[r] = rowp[r] + (size_t)bi * block_bytes;
            UNROLL
            for (int i = 0; i < T; i++)
                unit_dot<K, RW>(bs, (int)((unsigned)u % PB), x[i] + (size_t)bi * BL, acc[i]);
        }
        UNROLL
        for (int i = 0; i < T; i++)
            UNROLL
            for (int r = 0; r < RW; r++)
                UNROLL
                for (int o = 16; o > 0; o >>= 1)
                    acc[i][r] += __shfl_xor_sync(0xffffffffu, acc[i][r], o);
    }
}

template <int K, int RW>
static __device__ __forceinline__ void row_dots(const uint8_t *const *rowp, unsigned block_bytes,
                                                int nu, const float *__restrict__ x, float *acc)
{
    float a1[1][RW];
    const float *xs[1] = {x};
    row_dots_multi<K, RW, 1>(rowp, block_bytes, nu, xs, a1);
    UNROLL
    for (int r = 0; r < RW; r++)
        acc[r] = a1[0][r];
}

/* One warp's rows of a mat-vec (see matvec.cu): the RW = rows_per_warp<K>() rows at w0 and
 * w0 + rs (rs 0: one row, computed twice) against T inputs xt[i]; acc[i][r] complete in every
 * lane. With one token and one row per warp the loop is unrolled twice, so that each lane has two
 * units' loads in flight; two rows or several tokens already do that. */
template <int K, int T>
static __device__ __forceinline__ void mv_warp(const uint8_t *w0, size_t rs, unsigned block_bytes,
                                               int nu, const float *const *xt,
                                               float (*acc)[rows_per_warp<K>()])
{
    constexpr int RW = rows_per_warp<K>();
    const uint8_t *rowp[RW];
    UNROLL
    for (int r = 0; r < RW; r++)
        rowp[r] = w0 + r * rs;
    row_dots_multi<K, RW, T>(rowp, block_bytes, nu, xt, acc);
}

#endif

/* The dot products of a warp's rows (mat-vec, experts, the fused step): every kernel that
 * multiplies weight rows walks them with these, so a row's result is the same floats whichever
 * kernel computes it. */
#ifndef MOE_CUDA_MV_WARP_CUH
#define MOE_CUDA_MV_WARP_CUH

#include <type_traits>

#include "worker/cuda/qdot.cuh"

/* How many of a lane's units the row walk unrolls (so their loads can be in flight together):
 * MOE_MV_UNROLL when defined (a build for measurements), else two for one row and one input,
 * and MOE_MV_UNROLL_PLAIN (default 8) for one row of a plain type (F32, F16, BF16) and one
 * input: a lane's unit is 16 bytes there, so a 2048-wide F32 row (a router) is 16 units a lane,
 * 8 round trips to memory two at a time. Q6_K rows at one token, however many a warp walks:
 * MOE_MV_UNROLL_Q6K (default 2), since a Q6_K unit is 16 weights (a 2048-wide row is 4 units
 * a lane, twice the Q4_K walk's round trips); on an H100 the q/k/v launch with a Q6_K v went
 * from 14.4 to 12.8 µs and the Q6_K output head from 113 to 105 µs (4: 179 µs). The order of
 * the sums is the same whatever the unrolling. */
#ifndef MOE_MV_UNROLL_PLAIN
#define MOE_MV_UNROLL_PLAIN 8
#endif
#ifndef MOE_MV_UNROLL_Q6K
#define MOE_MV_UNROLL_Q6K 2
#endif
#ifdef MOE_MV_UNROLL
#define MV_UNROLL(K, RW, T, PLAIN) (MOE_MV_UNROLL)
#else
#define MV_UNROLL(K, RW, T, PLAIN)                                                                 \
    ((K) == MOE_TYPE_Q6_K && (T) == 1 ? MOE_MV_UNROLL_Q6K                                          \
     : (RW) >= 2 || (T) > 1           ? 1                                                          \
     : (PLAIN)                        ? MOE_MV_UNROLL_PLAIN                                        \
                                      : 2)
#endif

/* RW rows' dot products with T inputs x[i], complete in every lane: the weights are loaded and
 * decoded once for all T (the compiler shares them between the unrolled calls), with the same
 * float operations per (row, input) as for one input. The plain types' decoders take one row at
 * a time, so their rows are walked one after the other. */
template <int K, int RW, int T, class XL>
static __device__ __forceinline__ void row_dots_multi_x(const uint8_t *const *rowp,
                                                        unsigned block_bytes, int nu,
                                                        const float *const *x, float (*acc)[RW],
                                                        const XL *xin)
{
    constexpr int PB = unit_shape<K>::per_block, BL = unit_shape<K>::blck;
    if constexpr (rows_per_warp<K>() == 1 && RW > 1) {
        UNROLL
        for (int r = 0; r < RW; r++) {
            float a1[T][1];
            row_dots_multi_x<K, 1, T, XL>(rowp + r, block_bytes, nu, x, a1, xin);
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
        constexpr int UNR = MV_UNROLL(K, RW, T, rows_per_warp<K>() == 1);
#pragma unroll(UNR)
        for (int u = lane; u < nu; u += 32) {
            const unsigned bi = (unsigned)u / PB;
            const uint8_t *bs[RW];
            UNROLL
            for (int r = 0; r < RW; r++)
                bs[r] = rowp[r] + (size_t)bi * block_bytes;
            UNROLL
            for (int i = 0; i < T; i++)
                if constexpr (q8_rows<K, RW>())
                    unit_dot_q8<K, RW, XL>(bs, (int)((unsigned)u % PB), x[i] + (size_t)bi * BL,
                                           acc[i], xin[i]);
                else
                    unit_dot<K, RW, XL>(bs, (int)((unsigned)u % PB), x[i] + (size_t)bi * BL,
                                        acc[i], xin[i]);
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

/* row_dots_multi_x with the inputs read as they are. */
template <int K, int RW, int T>
static __device__ __forceinline__ void row_dots_multi(const uint8_t *const *rowp,
                                                      unsigned block_bytes, int nu,
                                                      const float *const *x, float (*acc)[RW])
{
    XPlain xin[T];
    row_dots_multi_x<K, RW, T, XPlain>(rowp, block_bytes, nu, x, acc, xin);
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
template <int K, int T, class XL = XPlain>
static __device__ __forceinline__ void mv_warp(const uint8_t *w0, size_t rs, unsigned block_bytes,
                                               int nu, const float *const *xt,
                                               float (*acc)[rows_per_warp<K>()],
                                               const XL *xin = nullptr)
{
    constexpr int RW = rows_per_warp<K>();
    const uint8_t *rowp[RW];
    UNROLL
    for (int r = 0; r < RW; r++)
        rowp[r] = w0 + r * rs;
    if constexpr (std::is_same<XL, XPlain>::value)
        row_dots_multi<K, RW, T>(rowp, block_bytes, nu, xt, acc);
    else
        row_dots_multi_x<K, RW, T, XL>(rowp, block_bytes, nu, xt, acc, xin);
}

#endif

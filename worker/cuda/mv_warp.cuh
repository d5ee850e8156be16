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

/* A lane's (token, row) partial sums set to zero before a walk. */
template <int T, int RW> static __device__ __forceinline__ void zero_acc(float (*acc)[RW])
{
    UNROLL
    for (int i = 0; i < T; i++)
        UNROLL
        for (int r = 0; r < RW; r++)
            acc[i][r] = 0.0f;
}

/* Every lane's partial sums of a warp's (token, row) products added over the warp, by one
 * shuffle tree (complete in every lane). */
template <int T, int RW> static __device__ __forceinline__ void warp_sum_acc(float (*acc)[RW])
{
    UNROLL
    for (int i = 0; i < T; i++)
        UNROLL
        for (int r = 0; r < RW; r++)
            UNROLL
            for (int o = 16; o > 0; o >>= 1)
                acc[i][r] += __shfl_xor_sync(0xffffffffu, acc[i][r], o);
}

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
        zero_acc<T, RW>(acc);
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
        warp_sum_acc<T, RW>(acc);
    }
}

/* One token of a K-quant row walk with every unit's bytes loaded first (mv_rows): the raw bytes
 * of a unit of each kind, the kinds that have them (not Q6_K with the RMSNorm on the way: its
 * loads and the norm's spilled, and q/k/v with a Q6_K v went from 12.8 to 14.9 us on an H100),
 * and how many units a lane holds for RW rows (Q6_K's take 5-8 registers, Q4_K's 8, Q5_K's
 * 12). */
template <int K> struct unit_raw {
    using type = kq_raw;
};
template <> struct unit_raw<MOE_TYPE_Q6_K> {
    using type = q6k_raw;
};
template <int K, bool NORM> __host__ __device__ constexpr bool preload_kind()
{
    return K == MOE_TYPE_Q4_K || K == MOE_TYPE_Q5_K || (K == MOE_TYPE_Q6_K && !NORM);
}
template <int K, int RW> __host__ __device__ constexpr int preload_upl()
{
    return (K == MOE_TYPE_Q6_K ? 16 : 8) / RW < 4 ? (K == MOE_TYPE_Q6_K ? 16 : 8) / RW : 4;
}

/* A lane's k-th unit of a row of nu units (unit lane + 32k): its block and its index in the
 * block; false past the row. */
template <int K>
static __device__ __forceinline__ bool lane_unit(int k, int nu, unsigned *bi, int *t)
{
    const int u = (int)(threadIdx.x & 31) + 32 * k;
    *bi = (unsigned)u / unit_shape<K>::per_block;
    *t = (int)((unsigned)u % unit_shape<K>::per_block);
    return u < nu;
}

/* The bytes of units lane, lane + 32, ... (UPL of them, those below nu) of RW rows, all loads
 * issued before any arithmetic: a row of up to 32·UPL units costs one memory round trip
 * instead of one per unrolled step of row_dots_multi_x. */
template <int K, int RW, int UPL>
static __device__ __forceinline__ void rows_preload(const uint8_t *const *rowp,
                                                    unsigned block_bytes, int nu,
                                                    typename unit_raw<K>::type (*raw)[RW])
{
    UNROLL
    for (int k = 0; k < UPL; k++) {
        unsigned bi;
        int t;
        if (!lane_unit<K>(k, nu, &bi, &t))
            break;
        UNROLL
        for (int r = 0; r < RW; r++) {
            const uint8_t *b = rowp[r] + (size_t)bi * block_bytes;
            if constexpr (K == MOE_TYPE_Q6_K)
                q6k_unit_load(b, t, &raw[k][r]);
            else
                kq_unit_load<K>(b, t, &raw[k][r]);
        }
    }
}

/* row_dots_multi_x at one input over bytes rows_preload loaded: the same units in the same
 * order, the same products (kq_unit_sum, q6k_unit_sum) and the same shuffle tree, so the same
 * floats. */
template <int K, int RW, int UPL, class XL>
static __device__ __forceinline__ void rows_preloaded_dots(
    const typename unit_raw<K>::type (*raw)[RW], int nu, const float *x, float *acc, const XL &xin)
{
    UNROLL
    for (int r = 0; r < RW; r++)
        acc[r] = 0.0f;
    UNROLL
    for (int k = 0; k < UPL; k++) {
        unsigned bi;
        int t;
        if (!lane_unit<K>(k, nu, &bi, &t))
            break;
        const float *xb = x + (size_t)bi * unit_shape<K>::blck;
        if constexpr (K == MOE_TYPE_Q6_K) {
            float xs[16], sx[4];
            q6k_unit_xs(xin, xb, t, xs, sx);
            const uint32_t mg = code_magic();
            UNROLL
            for (int r = 0; r < RW; r++)
                acc[r] += q6k_unit_sum(raw[k][r], xs, sx, mg);
        } else {
            float xl[16], xh[16], sxl, sxh;
            kq_unit_x(xin, xb, t, xl, xh, &sxl, &sxh);
            UNROLL
            for (int r = 0; r < RW; r++)
                acc[r] += kq_unit_sum<K>(raw[k][r], t, xl, xh, sxl, sxh);
        }
    }
    UNROLL
    for (int r = 0; r < RW; r++)
        UNROLL
        for (int o = 16; o > 0; o >>= 1)
            acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
}

/* Steps of TOK_T tokens of Q4_K, Q5_K and Q6_K rows (MOE_CUDA_MV_TOK): a lane converts each unit's
 * codes to floats once and multiplies them into every token (tok_unit_dots), where
 * row_dots_multi_x converts them again for each token. Units [u0, u1) of the warp's rows: lane
 * l takes u0 + l, u0 + l + 32, ... (u0 a multiple of 32, so that slices of a row walked one
 * after another give each lane its units in the one-token walk's order; with the same shuffle
 * tree after the last, the same floats per (row, token)). Token i's input of column c is at
 * xs + (c − c0) + i·ldx, read through xin; tokens from nt on read token 0's (their results are
 * not stored). */
#define TOK_T 16

template <int K, int RW, int T, class XL>
static __device__ __forceinline__ void row_units_tok(const uint8_t *const *rowp,
                                                     unsigned block_bytes, int u0, int u1,
                                                     const float *xs, int64_t c0, int64_t ldx,
                                                     int nt, uint32_t mg, float (*acc)[RW],
                                                     const XL &xin)
{
    constexpr int PB = unit_shape<K>::per_block, BL = unit_shape<K>::blck;
    for (int u = u0 + (int)(threadIdx.x & 31); u < u1; u += 32) {
        const unsigned bi = (unsigned)u / PB;
        const uint8_t *bs[RW];
        UNROLL
        for (int r = 0; r < RW; r++)
            bs[r] = rowp[r] + (size_t)bi * block_bytes;
        tok_unit_dots<K, RW, T, XL>(bs, (int)((unsigned)u % PB), xs + ((int64_t)bi * BL - c0),
                                    ldx, nt, mg, acc, xin);
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

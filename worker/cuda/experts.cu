/* Grouped expert kernels (see experts.cuh).
 *
 * Gate/up: one block per (4 rows, slot); a warp computes one row of gate and the same row of up
 * (two rows of the same type walked together, as the mat-vec walks two rows of one matrix), so
 * the SwiGLU is applied in registers and only act is written. When gate and up differ in type,
 * each is computed by its own pass into scratch and the SwiGLU is a third small kernel.
 *
 * Down: one block per (two rows, token) with one warp per chosen expert (warps loop when k is
 * above 32): each warp completes its expert's dot products for the two rows, then one thread
 * weights and adds them in the token's top-k order and adds the sum into the residual: the
 * fixed-order combine of the CPU backend, fused. */
#include "worker/cuda/experts.cuh"

#include <errno.h>

extern "C" {
#include "store/err.h"
#include "store/ggml_type.h"
}
#include "worker/cuda/cuda_check.cuh"
#include "worker/cuda/launch.cuh"
#include "worker/cuda/qdot.cuh"

#define EX_WARPS 4

static __device__ __forceinline__ float silu_f(float g)
{
    return g / (1.0f + expf(-g));
}

template <int K, int RW>
static __device__ __forceinline__ void row_dots_n(const uint8_t *const *rowp, unsigned block_bytes,
                                                  int nu, const float *__restrict__ x, float *acc)
{
    constexpr int PB = unit_shape<K>::per_block, BL = unit_shape<K>::blck;
    const int lane = threadIdx.x & 31;
    UNROLL
    for (int r = 0; r < RW; r++)
        acc[r] = 0.0f;
#pragma unroll(3 - RW)
    for (int u = lane; u < nu; u += 32) {
        const unsigned bi = (unsigned)u / PB;
        const uint8_t *bs[RW];
        UNROLL
        for (int r = 0; r < RW; r++)
            bs[r] = rowp[r] + (size_t)bi * block_bytes;
        unit_dot<K, RW>(bs, (int)((unsigned)u % PB), x + (size_t)bi * BL, acc);
    }
    UNROLL
    for (int r = 0; r < RW; r++)
        UNROLL
        for (int o = 16; o > 0; o >>= 1)
            acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
}

/* RW rows' dot products with x, complete in every lane. The plain types' decoders take one row
 * at a time, so their rows are walked one after the other. */
template <int K, int RW>
static __device__ __forceinline__ void row_dots(const uint8_t *const *rowp, unsigned block_bytes,
                                                int nu, const float *__restrict__ x, float *acc)
{
    if constexpr (rows_per_warp<K>() == 1 && RW > 1) {
        UNROLL
        for (int r = 0; r < RW; r++)
            row_dots_n<K, 1>(rowp + r, block_bytes, nu, x, acc + r);
    } else {
        row_dots_n<K, RW>(rowp, block_bytes, nu, x, acc);
    }
}

/* mode 0: act = silu(gate)·up (gate, up same type K); mode 1: out = W·x for table a only. */
template <int K, int MODE>
static __global__ void __launch_bounds__(32 * EX_WARPS)
gate_up_kernel(const uint8_t *const *__restrict__ ga, const uint8_t *const *__restrict__ ua,
               size_t row_bytes, unsigned block_bytes, int nu, int64_t ff,
               const float *__restrict__ x, int64_t ldx, int kuse,
               const int32_t *__restrict__ sel_e, float *__restrict__ out, int64_t ldo)
{
    pdl_trigger();
    pdl_wait();
    const int64_t row = (int64_t)blockIdx.x * EX_WARPS + (threadIdx.x >> 5);
    if (row >= ff)
        return;
    const int64_t slot = blockIdx.y;
    const int e = sel_e[slot];
    const float *xt = x + (slot / kuse) * ldx;
    if constexpr (MODE == 0) {
        const uint8_t *rowp[2] = {ga[e] + (size_t)row * row_bytes, ua[e] + (size_t)row * row_bytes};
        float acc[2];
        row_dots<K, 2>(rowp, block_bytes, nu, xt, acc);
        if ((threadIdx.x & 31) == 0)
            out[slot * ldo + row] = silu_f(acc[0]) * acc[1];
    } else {
        const uint8_t *rowp[1] = {ga[e] + (size_t)row * row_bytes};
        float acc[1];
        row_dots<K, 1>(rowp, block_bytes, nu, xt, acc);
        if ((threadIdx.x & 31) == 0)
            out[slot * ldo + row] = acc[0];
    }
}

static __global__ void swiglu_kernel(const float *__restrict__ g, const float *__restrict__ u,
                                     float *__restrict__ act, int64_t count)
{
    pdl_trigger();
    pdl_wait();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count)
        act[i] = silu_f(g[i]) * u[i];
}


/* Two rows of one token per block, one warp per expert (j = warp, warp + nwarps, ...). */
template <int K>
static __global__ void __launch_bounds__(1024)
down_kernel(const uint8_t *const *__restrict__ da, size_t row_bytes, unsigned block_bytes, int nu,
            int64_t E, const float *__restrict__ act, int64_t ldact, int kuse,
            const int32_t *__restrict__ sel_e, const float *__restrict__ sel_w,
            float *__restrict__ h, int64_t ldh)
{
    pdl_trigger();
    pdl_wait();
    extern __shared__ float part[]; /* [kuse][2] */
    const int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int64_t row = (int64_t)blockIdx.x * 2;
    const int64_t t = blockIdx.y;
    const bool has2 = row + 1 < E;
    for (int j = w; j < kuse; j += nw) {
        const int64_t slot = t * kuse + j;
        const uint8_t *base = da[sel_e[slot]] + (size_t)row * row_bytes;
        const uint8_t *rowp[2] = {base, has2 ? base + row_bytes : base};
        float acc[2];
        row_dots<K, 2>(rowp, block_bytes, nu, act + slot * ldact, acc);
        if ((threadIdx.x & 31) == 0) {
            part[2 * j] = acc[0];
            part[2 * j + 1] = acc[1];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float tot0 = 0.0f, tot1 = 0.0f;
        for (int j = 0; j < kuse; j++) {
            const float wj = sel_w[t * kuse + j];
            tot0 += wj * part[2 * j];
            tot1 += wj * part[2 * j + 1];
        }
        h[t * ldh + row] += tot0;
        if (has2)
            h[t * ldh + row + 1] += tot1;
    }
}

static bool qtype(uint32_t t)
{
    switch (t) {
#define CASE(T) case T:
    MOE_QDOT_TYPES(CASE)
#undef CASE
    case MOE_TYPE_F32: case MOE_TYPE_F16: case MOE_TYPE_BF16:
        return true;
    default:
        return false;
    }
}

/* The stored type of a kind (the vector kinds read plain types 16 bytes at a time). */
static constexpr uint32_t base_type(int K)
{
    return K == KIND_F32_V ? MOE_TYPE_F32 : K == KIND_F16_V ? MOE_TYPE_F16
                                          : K == KIND_BF16_V ? MOE_TYPE_BF16 : (uint32_t)K;
}

/* Expert rows are 16-byte aligned when the row length allows it (the backend aligns every
 * expert to 256 bytes), so the plain types use their vector kinds then. */
#define PLAIN_CASES(CASE, type, n)                                                          \
    case MOE_TYPE_F32: if (moe_row_bytes(type, n) % 16 == 0) CASE(KIND_F32_V) else CASE(MOE_TYPE_F32) \
    case MOE_TYPE_F16: if (moe_row_bytes(type, n) % 16 == 0) CASE(KIND_F16_V) else CASE(MOE_TYPE_F16) \
    case MOE_TYPE_BF16: if (moe_row_bytes(type, n) % 16 == 0) CASE(KIND_BF16_V) else CASE(MOE_TYPE_BF16)

template <int K> static unsigned blk_bytes(int64_t n, size_t *row_bytes, int *nu)
{
    *row_bytes = moe_row_bytes(base_type(K), n);
    const int64_t nb = n / unit_shape<K>::blck;
    *nu = (int)(nb * unit_shape<K>::per_block);
    return (unsigned)(*row_bytes / (size_t)nb);
}

template <int K, int MODE>
static int launch_gate_up(const void *const *a, const void *const *b, int64_t n, int64_t ff,
                          const float *x, int64_t ldx, int64_t n_tok, int kuse,
                          const int32_t *sel_e, float *out, int64_t ldo, cudaStream_t s)
{
    size_t rb;
    int nu;
    unsigned bb = blk_bytes<K>(n, &rb, &nu);
    dim3 g((unsigned)((ff + EX_WARPS - 1) / EX_WARPS), (unsigned)(n_tok * kuse));
    MOE_CUDA_TRY(moe_launch(gate_up_kernel<K, MODE>, g, dim3(32 * EX_WARPS), 0, s,
                            (const uint8_t *const *)a, (const uint8_t *const *)b, rb, bb, nu, ff, x,
                            ldx, kuse, sel_e, out, ldo));
    return 0;
}

template <int MODE>
static int gate_up_dispatch(uint32_t type, const void *const *a, const void *const *b, int64_t n,
                            int64_t ff, const float *x, int64_t ldx, int64_t n_tok, int kuse,
                            const int32_t *sel_e, float *out, int64_t ldo, cudaStream_t s)
{
#define CALL(T) return launch_gate_up<T, MODE>(a, b, n, ff, x, ldx, n_tok, kuse, sel_e, out, ldo, s);
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
                            float *d_act, int64_t ldact, float *d_scratch, cudaStream_t s)
{
    if (!qtype(gate_type) || !qtype(up_type))
        return MOE_EUNSUPPORTED;
    if (n_tok <= 0 || kuse <= 0 || n_tok * kuse > 65535)
        return -EINVAL;
    if (gate_type == up_type)
        return gate_up_dispatch<0>(gate_type, d_gate, d_up, n, ff, d_x, ldx, n_tok, kuse,
                                   d_sel_e, d_act, ldact, s);
    /* Mixed types: gate into scratch[0], up into scratch[1] (same row stride as act), then the
     * SwiGLU over whole rows (the padding of a row included, which nothing reads). */
    const int64_t count = n_tok * kuse * ldact;
    float *g = d_scratch, *u = d_scratch + count;
    int rc = gate_up_dispatch<1>(gate_type, d_gate, NULL, n, ff, d_x, ldx, n_tok, kuse, d_sel_e,
                                 g, ldact, s);
    if (!rc)
        rc = gate_up_dispatch<1>(up_type, d_up, NULL, n, ff, d_x, ldx, n_tok, kuse, d_sel_e, u,
                                 ldact, s);
    if (rc)
        return rc;
    MOE_CUDA_TRY(moe_launch(swiglu_kernel, dim3((unsigned)((count + 255) / 256)), dim3(256), 0, s,
                            (const float *)g, (const float *)u, d_act, count));
    return 0;
}

template <int K>
static int launch_down(const void *const *d, int64_t ff, int64_t E, const float *act,
                       int64_t ldact, int64_t n_tok, int kuse, const int32_t *sel_e,
                       const float *sel_w, float *h, int64_t ldh, cudaStream_t s)
{
    size_t rb;
    int nu;
    unsigned bb = blk_bytes<K>(ff, &rb, &nu);
    dim3 g((unsigned)((E + 1) / 2), (unsigned)n_tok);
    const int warps = kuse < 32 ? kuse : 32;
    MOE_CUDA_TRY(moe_launch(down_kernel<K>, g, dim3(32 * warps), sizeof(float) * 2 * (size_t)kuse,
                            s, (const uint8_t *const *)d, rb, bb, nu, E, act, ldact, kuse, sel_e,
                            sel_w, h, ldh));
    return 0;
}

int moe_cuda_expert_down(uint32_t type, const void *const *d_down, int64_t ff, int64_t E,
                         const float *d_act, int64_t ldact, int64_t n_tok, int kuse,
                         const int32_t *d_sel_e, const float *d_sel_w, float *d_h, int64_t ldh,
                         cudaStream_t s)
{
    if (!qtype(type))
        return MOE_EUNSUPPORTED;
    if (n_tok <= 0 || kuse <= 0 || n_tok > 65535)
        return -EINVAL;
#define CALL(T) return launch_down<T>(d_down, ff, E, d_act, ldact, n_tok, kuse, d_sel_e, d_sel_w, d_h, ldh, s);
#define CASE(T) case T: CALL(T)
    switch (type) {
    MOE_QDOT_TYPES(CASE)
    PLAIN_CASES(CALL, type, ff)
    }
#undef CASE
#undef CALL
    return MOE_EUNSUPPORTED;
}

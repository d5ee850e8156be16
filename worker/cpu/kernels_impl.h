/* Internal to worker/cpu: the SIMD kernel variants that kernels.c dispatches to.
 *
 * Each variant computes exactly what the portable path computes (moe_dequantize() followed by a
 * float dot product), only with a different summation order. */
#ifndef MOE_CPU_KERNELS_IMPL_H
#define MOE_CPU_KERNELS_IMPL_H

#include <stdint.h>

#if defined(__x86_64__)
#define MOE_KERNELS_X86 1

/* True when the CPU has AVX2, FMA and F16C (checked once). */
int moe_kernels_have_avx2(void);

/* A row dot product: n elements of one stored row (n a multiple of the block size) with x. */
typedef float (*moe_dot_fn)(const void *row, const float *x, int64_t n);

/* The AVX2 dot product for `type`, or NULL when the AVX2 path does not handle it. */
moe_dot_fn moe_dot_fn_avx2(uint32_t type);

/* Dot products of nr float rows (row stride ldw floats) with x[n]: out[i] = dot(W[i], x).
 * nr is 1..4. Used by the matmul path after decoding a tile of weight rows. */
void moe_dot_rows_f32_avx2(const float *W, int64_t ldw, int nr, const float *x, int64_t n,
                           float *out);

/* out[t * 4 + r] = dot(W row r, X row t) for 4 float rows W (stride ldw) and 3 token rows X
 * (stride ldx), n elements each. The matmul micro-kernel. */
void moe_gemm_4x3_f32_avx2(const float *W, int64_t ldw, const float *X, int64_t ldx, int64_t n,
                           float *out);

/* Decodes n elements of `type` into dst; returns 0 when the AVX2 decoder does not handle it. */
int moe_decode_avx2(uint32_t type, const void *src, float *dst, int64_t n);
#endif

#endif

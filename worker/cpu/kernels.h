/* CPU compute kernels: quantized dot products and matrix products, SIMD where the CPU has it.
 *
 * Weights stay in their stored block format and are decoded on the fly. Activations are float32.
 * All functions are single-threaded; the caller splits rows across threads (worker/cpu/pool.h).
 * Results match moe_dequantize() followed by a float dot product to float32 rounding. A type
 * without compute support (a caller bug: model loading rejects those) yields NaN results. */
#ifndef MOE_CPU_KERNELS_H
#define MOE_CPU_KERNELS_H

#include <stdint.h>

/* Dot product of one stored row (n elements of `type`) with x[n]. */
float moe_vec_dot(uint32_t type, const void *row, const float *x, int64_t n);

/* y[r] = dot(W row r, x) for rows r in [r0, r1). W is [rows][n] in `type`; row stride is
 * moe_row_bytes(type, n). */
void moe_matvec(uint32_t type, const void *W, int64_t n, const float *x, float *y,
                int64_t r0, int64_t r1);

/* Y[t][r] = dot(W row r, X[t]) for t in [0, n_tok), r in [r0, r1). X is [n_tok][n] with row
 * stride ldx floats, Y is [n_tok][ldy]. Each weight row is decoded once per block of 64 tokens
 * (once for all tokens up to 64), so prefill costs about one decode per 64 tokens. */
void moe_matmul(uint32_t type, const void *W, int64_t n, const float *X, int64_t ldx,
                int64_t n_tok, float *Y, int64_t ldy, int64_t r0, int64_t r1);

/* The k largest of r[0..n) by repeated arg-max, into out[0..k) best first: ties go to the lower
 * index; NaN never beats a number, but a pick is always made (with only NaNs left, the last of
 * them), the CUDA routing's rule. taken: n bytes, zero on entry and on return; 0 < k <= n. */
void moe_topk_argmax(const float *r, int64_t n, int64_t k, uint8_t *taken, int32_t *out);

/* Testing aid: when on != 0, every kernel takes the portable scalar path even where the CPU has
 * SIMD support, so the two paths can be checked against each other. Process-wide; set it
 * before starting work. */
void moe_kernels_force_scalar(int on);

/* Returns 1 when the kernels currently dispatch to a SIMD path (AVX2+FMA+F16C), else 0. */
int moe_kernels_simd(void);

#endif

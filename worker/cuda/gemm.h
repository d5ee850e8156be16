/* CUDA matrix products for prompt processing (prefill): many tokens against one weight matrix,
 * or against a set of expert matrices, on tensor cores.
 *
 * Weights stay in their stored ggml block format (docs/kernels.md) and are decoded on the fly into
 * f16 tiles; activations are float32 in memory and rounded to f16 on their way into the tensor
 * cores; products are summed in float32. So the result is the CPU moe_matmul's up to f16 rounding
 * of both operands: tests/gpu/test_cuda_gemm.c checks every element within 2e-3 of Σ|w·x| (in
 * practice it is about 1e-4). Activations beyond the f16 range (|x| > 65504) become ±inf.
 * Sums are never split across thread blocks, so results are bit-identical from run to run.
 * docs/cuda.md describes the kernels. */
#ifndef MOE_CUDA_GEMM_H
#define MOE_CUDA_GEMM_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Returns 1 when the moe_cuda_gemm functions compute with `type` (F32, F16, BF16, Q8_0, Q4_0,
 * Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), else 0. */
int moe_cuda_gemm_supported(uint32_t type);

/* Y[t][r] = Σ_i W[r][i]·X[t][i] for t in [0, n_tok), r in [0, rows); with accumulate != 0,
 * Y[t][r] += that sum instead. Enqueued on stream s; nothing waits for it.
 *
 * d_w: [rows][n] in `type`, row stride moe_row_bytes(type, n), in device-accessible memory,
 *      4-byte aligned (2 for F16/BF16). Q4_K/Q5_K rows read 16 bytes at a time when d_w and
 *      the row stride are 16-byte aligned, F32/F16/BF16 rows likewise.
 * d_x: X[t][i] at d_x[t·ldx + i], ldx >= n; float4 loads when d_x is 16-byte aligned and ldx a
 *      multiple of 4, else float loads.
 * d_y: Y[t][r] at d_y[t·ldy + r], ldy >= rows. Every element of the [n_tok][rows] block is
 *      written (read first with accumulate); nothing else is touched.
 *
 * Returns 0 (also when rows or n_tok is 0: nothing is launched); MOE_EUNSUPPORTED for other
 * types; -EINVAL for n <= 0, n > 2^30 or not a multiple of the block size, negative counts,
 * rows >= 2^31, n_tok > 2·10^6, strides too small, NULL or misaligned pointers (d_x and d_y
 * must be 4-byte aligned); MOE_EBACKEND when the launch fails (the CUDA error is printed).
 * Faults while the kernel runs surface at the caller's next synchronisation. */
int moe_cuda_gemm(uint32_t type, const void *d_w, int64_t n, int64_t rows, const float *d_x,
                  int64_t ldx, int64_t n_tok, float *d_y, int64_t ldy, int accumulate,
                  cudaStream_t s);

/* Grouped product for a mixture-of-experts layer: n_group weight matrices of the same type and
 * shape ([rows][n], as above), each matrix g found at d_wtab[g] (a DEVICE array of device
 * pointers; each matrix 4-byte aligned as above).
 *
 * Slots s in [d_off[g], d_off[g+1]) belong to group g. d_off: device int32 [n_group + 1],
 * d_off[0] = 0, nondecreasing, d_off[n_group] <= max_slots (values are clamped to
 * [0, max_slots], so a bad table cannot make the kernel write outside Y's max_slots rows).
 * The input of slot s is X row d_xrow[s] (d_xrow: device int32 [max_slots], each entry a valid
 * row of X), or X row s when d_xrow is NULL. The output of slot s is Y row s:
 * Y[s][r] = Σ_i W_g[r][i]·X[xrow(s)][i]. Rows of Y for slots past d_off[n_group] are not touched.
 *
 * The counts are read on the device only: the launch shape depends on n_group, rows, n and
 * max_slots, never on the contents of d_off, so the call can be captured in a CUDA graph once
 * and replayed for every step. Make one call of each type and shape outside a capture first:
 * it loads the kernel and sets its shared-memory limit, which a capture may not allow. Returns as moe_cuda_gemm (0 without launching anything when
 * n_group, rows or max_slots is 0; -EINVAL also for n_group > 16384 or max_slots > 10^6). */
int moe_cuda_gemm_grouped(uint32_t type, const void *const *d_wtab, int64_t n, int64_t rows,
                          int n_group, const int32_t *d_off, const int32_t *d_xrow,
                          const float *d_x, int64_t ldx, float *d_y, int64_t ldy,
                          int64_t max_slots, cudaStream_t s);

/* Testing and tuning aid: tile shape used by the calls above. -1 (the default) chooses from the
 * problem shape; 0..3 force one of the shapes rows × tokens 128×128, 128×64, 64×64, 128×32
 * (docs/cuda.md). Process-wide; returns the previous setting, or -EINVAL for other values. */
int moe_cuda_gemm_force_tile(int tile);

#ifdef __cplusplus
}
#endif

#endif

/* The tensor-core mat-vec: y[t] = W·x[t] for a few tokens, with the weights decoded into mma
 * fragments instead of floats (worker/cuda/mv_tc.cuh has the scheme, docs/cuda.md "Expert
 * products on tensor cores" the design). The backend's expert kernels use its device parts; this
 * stand-alone form is what the GPU tests hold to the CPU and what bench_cuda_mv_tc times against
 * moe_cuda_matvec_tok. Its products carry about 22 bits of x (two f16 parts), so it is held to the
 * float walk's tolerance: tests/gpu/test_cuda_mv_tc.c checks every element within 1e-5 of the
 * row's Σ|w·x| of the CPU result. */
#ifndef MOE_CUDA_MV_TC_H
#define MOE_CUDA_MV_TC_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 for the types it decodes (Q4_K, Q6_K). */
int moe_cuda_matvec_tc_supported(uint32_t type);

/* y[t][r] = dot(W row r, x[t]) for r < rows, t < n_tok (at most 65535·8). d_w: [rows][n] of
 * `type` in device memory, 16-byte aligned; n a multiple of 256; x rows ldx floats apart (ldx a
 * multiple of 4, >= n, d_x 16-byte aligned); y rows ldy apart. Each token's result is the same
 * floats whatever n_tok is and whichever tokens share its launch. Returns 0, MOE_EUNSUPPORTED,
 * -EINVAL or MOE_EBACKEND (as moe_cuda_matvec). */
int moe_cuda_matvec_tc(uint32_t type, const void *d_w, int64_t n, int64_t rows, const float *d_x,
                       int64_t ldx, int64_t n_tok, float *d_y, int64_t ldy, cudaStream_t s);

struct moe_mv_job; /* worker/cuda/matvec.h */

/* Up to three matrices of one type and row length over the same inputs in one launch (q, k, v),
 * y (+)= W·x with accumulate: moe_cuda_matvec_multi's contract, on tensor cores. Each job's w
 * 16-byte aligned. */
int moe_cuda_matvec_tc_multi(uint32_t type, const struct moe_mv_job *jobs, int n_jobs, int64_t n,
                             const float *d_x, int64_t ldx, int64_t n_tok, int accumulate,
                             cudaStream_t s);

/* The same products with the inputs staged once: a launch of its own converts each token's row
 * into fragments in d_ws (16-byte aligned, at least moe_cuda_matvec_tc_ws_bytes(n, n_tok)), and
 * every tile reads its columns from there instead of staging them in shared memory itself. The
 * floats are the same bits as without (the same staging functions and order). d_ws NULL: the
 * forms above. */
size_t moe_cuda_matvec_tc_ws_bytes(int64_t n, int64_t n_tok);
int moe_cuda_matvec_tc_multi_ws(uint32_t type, const struct moe_mv_job *jobs, int n_jobs,
                                int64_t n, const float *d_x, int64_t ldx, int64_t n_tok,
                                int accumulate, void *d_ws, size_t ws_bytes, cudaStream_t s);
int moe_cuda_matvec_tc_ws(uint32_t type, const void *d_w, int64_t n, int64_t rows,
                          const float *d_x, int64_t ldx, int64_t n_tok, float *d_y, int64_t ldy,
                          void *d_ws, size_t ws_bytes, cudaStream_t s);

/* One token with the RMSNorm on the way: y_j = W_j · (d_src · scale · d_g) for up to three
 * matrices of one type and row length n, each block normalising the row itself as the RMSNorm
 * kernel (moe_cuda_rmsnorm) does, so that every product is the floats moe_cuda_matvec_tc_multi
 * gives on that kernel's output; d_dst (or NULL) receives the normalised row. d_src, d_g and
 * d_dst 16-byte aligned. -EINVAL where the block's shared memory would not fit the row. */
int moe_cuda_matvec_tc_norm(uint32_t type, const struct moe_mv_job *jobs, int n_jobs, int64_t n,
                            const float *d_src, const float *d_g, float eps, float *d_dst,
                            cudaStream_t s);
/* The staging launch alone: n_tok rows of x (n inputs each) converted for products with `type`
 * weights into d_ws, as the forms above do before their tiles (the layout of tc_ws_split in
 * worker/cuda/mv_tc_dev.cuh), for the expert kernels to read. */
int moe_cuda_tc_stage(uint32_t type, const float *d_x, int64_t ldx, int64_t n, int64_t n_tok,
                      void *d_ws, size_t ws_bytes, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif

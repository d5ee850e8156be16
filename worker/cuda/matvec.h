/* CUDA quantized matrix-vector product: the GPU twin of worker/cpu/kernels.h's moe_matvec.
 *
 * Weights stay in their stored ggml block format (docs/kernels.md) and are decoded on the fly;
 * activations and accumulation are float32. The result equals moe_matvec's up to float rounding
 * (the summation order differs): tests/gpu/test_cuda_matvec.c checks every element against it
 * within 1e-5 of the row's sum of |w·x|. */
#ifndef MOE_CUDA_MATVEC_H
#define MOE_CUDA_MATVEC_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Returns 1 when moe_cuda_matvec computes with `type` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
 * Q5_1, Q4_K, Q5_K, Q6_K), else 0. */
int moe_cuda_matvec_supported(uint32_t type);

/* y[r] = dot(W row r, x) for r in [0, rows), enqueued on stream s (nothing waits for it).
 *
 * d_w: [rows][n] in `type`, row stride moe_row_bytes(type, n); a device pointer to VRAM or to
 *      host memory mapped into the device (cudaHostAlloc(..., cudaHostAllocMapped) or
 *      cudaHostRegister(..., cudaHostRegisterMapped), then cudaHostGetDevicePointer).
 *      Alignment: 16 bytes for Q4_K and Q5_K (GGUF data is 32-aligned), 4 for F32, 2 otherwise;
 *      F32/F16/BF16 rows take 16-byte loads when rows are 16-byte aligned.
 * d_x: [n] float, device-accessible, 16-byte aligned.   d_y: [rows] float, device-accessible.
 *
 * Returns 0 (also for rows == 0, launching nothing); MOE_EUNSUPPORTED for other types; -EINVAL
 * for n <= 0, n not a multiple of the block size, rows < 0, NULL or misaligned pointers;
 * MOE_EBACKEND when the launch fails (the CUDA error is printed with device and file:line).
 * Errors raised while the kernel runs (a bad pointer) surface at the caller's next
 * synchronisation, as with any CUDA launch. */
int moe_cuda_matvec(uint32_t type, const void *d_w, int64_t n, int64_t rows, const float *d_x,
                    float *d_y, cudaStream_t s);

/* The same for n_tok tokens: y[t][r] = dot(W row r, x[t]) (accumulate: +=) for t < n_tok
 * (at most 65535); x rows ldx floats apart (a multiple of 4, >= n), y rows ldy apart. The weights
 * are re-read per token (through L2 for matrices that fit), so this is the decode path; each
 * token's result is the same whatever n_tok is. */
int moe_cuda_matvec_tok(uint32_t type, const void *d_w, int64_t n, int64_t rows,
                        const float *d_x, int64_t ldx, int64_t n_tok, float *d_y, int64_t ldy,
                        int accumulate, cudaStream_t s);

/* One matrix of a multi-matrix launch: y[t][r] (+)= dot(W row r, x[t]) for r < rows. */
struct moe_mv_job {
    const void *w;
    int64_t rows;
    float *y;
    int64_t ldy;
};

/* Up to three matrices of the same type and row length n over the same input rows, in one
 * launch (q, k, v). Other rules as moe_cuda_matvec_tok. */
int moe_cuda_matvec_multi(uint32_t type, const struct moe_mv_job *jobs, int n_jobs, int64_t n,
                          const float *d_x, int64_t ldx, int64_t n_tok, int accumulate,
                          cudaStream_t s);

/* MOE_Q8_ROWS of this build (worker/cuda/qdot.cuh): 0 when every product is in float, else the
 * row count from which the expert kernels use int8 activations for the K-quants and Q8_0. */
int moe_cuda_q8_rows(void);

struct moe_cuda_kv;

/* The q/k-norm, RoPE and KV store of a one-token step (moe_cuda_qk_rope_kv's work) done by the
 * q/k/v launch that applies the RMSNorm: every job's y is q, k or v (rows of H or Hkv heads of
 * kv->hd, v of kv->hdv; hd and hdv multiples of 4). The warp whose rows complete a head (a
 * counter per head, q heads then kv heads, a kv head counting its k and v rows) does that head
 * with moe_cuda_qk_rope_kv's code, so q, k and the cache get the same floats; the counters are
 * left at zero for the next launch. */
struct moe_mv_rope {
    float *q, *k;
    const float *v;
    const float *qn, *kn, *rope; /* q/k norm weights, the token's angles [hd/2][2] */
    const int32_t *pos, *seq;    /* device: the token's position and sequence */
    const struct moe_cuda_kv *kv;
    int layer;
    int64_t H;
    float eps;
    unsigned *cnt; /* [H + Hkv], zero */
};

/* moe_cuda_matvec_multi for one token whose input is RMSNorm(src)·g, computed on the way (each
 * warp sums src's squares itself, in the order of the RMSNorm kernel): the products and the
 * normalised row stored in d_dst are the floats of an RMSNorm launch followed by the mat-vec, one
 * launch fewer. src, g, dst: n floats each, 16-byte aligned (-EINVAL otherwise). rope (or NULL):
 * the q/k-norm + RoPE + KV store done in the same launch (above); -EINVAL where a job is not
 * one of its q, k, v or the head sizes do not suit. */
int moe_cuda_matvec_multi_norm(uint32_t type, const struct moe_mv_job *jobs, int n_jobs, int64_t n,
                               const float *d_src, const float *d_g, float eps, float *d_dst,
                               const struct moe_mv_rope *rope, cudaStream_t s);

/* The one-token router of a layer with its RMSNorm on the way (moe_cuda_matvec_multi_norm of
 * one float32 job: the same floats into job->y and d_dst), and in the same launch the normalised
 * row staged for the tensor-core products of stage_type (Q4_K or Q6_K) into d_st
 * (moe_cuda_router_staged_bytes(n): fragments, sub-block sums, then the exponent, an int; the
 * layout of tc_staged_row_exp in mv_tc.cuh), as a block of those
 * products would stage it from d_dst. -EINVAL where the shapes or alignments do not fit its
 * kernel (the caller then launches the plain router). */
int moe_cuda_router_norm_staged(const struct moe_mv_job *job, int64_t n, const float *d_src,
                                const float *d_g, float eps, float *d_dst, uint32_t stage_type,
                                void *d_st, cudaStream_t s);
size_t moe_cuda_router_staged_bytes(int64_t n);

/* moe_cuda_matvec_multi (d_dst NULL) or moe_cuda_matvec_multi_norm (d_dst, d_g, rope: one
 * token, x is the RMSNorm's source) for matrices of two weight types in one launch: jobs[0..n1) of type
 * t1, the others of t2, each product the floats of its type's launch. MOE_EUNSUPPORTED for a pair
 * without a kernel (moe_cuda_matvec_mixed_supported; the caller then launches per type). */
int moe_cuda_matvec_mixed_supported(uint32_t t1, uint32_t t2);
int moe_cuda_matvec_mixed(uint32_t t1, uint32_t t2, const struct moe_mv_job *jobs, int n_jobs,
                          int n1, int64_t n, const float *d_x, int64_t ldx, int64_t n_tok,
                          int accumulate, const float *d_g, float eps, float *d_dst,
                          const struct moe_mv_rope *rope, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif

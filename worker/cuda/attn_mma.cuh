/* Causal attention of prompt-sized steps on tensor cores (flash attention; see attn_mma.cu). The
 * same contract as moe_cuda_attention with n_split = 1, for f16 KV caches whose key and value
 * heads have the same width, a multiple of 16 the kernel is built for
 * (moe_cuda_attention_mma_supported). */
#ifndef MOE_CUDA_ATTN_MMA_CUH
#define MOE_CUDA_ATTN_MMA_CUH

#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "worker/cuda/ops.cuh"

/* Whether moe_cuda_attention_mma takes this cache geometry. */
bool moe_cuda_attention_mma_supported(const struct moe_cuda_kv *kv);

/* out[t][h·hd..] = softmax(q·K/√hd) V over positions 0..pos[t] of sequence seq[t], for t < n;
 * q and out float, K and V the layer's f16 cache. Any mix of sequences in the step; a token's
 * result does not depend on the other tokens of the step. 0, -EINVAL or MOE_EBACKEND. */
int moe_cuda_attention_mma(const float *d_q, int64_t ldq, const int32_t *d_pos,
                           const int32_t *d_seq, const struct moe_cuda_kv *kv, int layer,
                           int64_t H, int64_t n, float *d_out, int64_t ldo, cudaStream_t s);

#endif

/* Quantized block formats: reference dequantization and quantization, scalar C.
 *
 * Layouts are ggml's (docs/formats.md). These are the reference implementations that the fast
 * kernels (worker/cpu/kernels.h, worker/cuda/) are tested against, and what moectl mkmodel uses to
 * write files. */
#ifndef MOE_QUANT_H
#define MOE_QUANT_H

#include <stddef.h>
#include <stdint.h>

/* IEEE half and bfloat16 conversions (round to nearest even). */
float moe_f16_to_f32(uint16_t h);
uint16_t moe_f32_to_f16(float f);
float moe_bf16_to_f32(uint16_t h);
uint16_t moe_f32_to_bf16(float f);

/* Dequantizes n elements (a multiple of the type's block size) from src into dst.
 * Returns 0, or MOE_EUNSUPPORTED for types without compute support. */
int moe_dequantize(uint32_t type, const void *src, float *dst, int64_t n);

/* Quantizes n elements (a multiple of the block size) of src into dst (moe_row_bytes(type, n)
 * bytes). Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K.
 * Deterministic. Returns 0 or MOE_EUNSUPPORTED. */
int moe_quantize(uint32_t type, const float *src, void *dst, int64_t n);

#endif

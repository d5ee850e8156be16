/* Dequantization of single elements on the device, for the few places that need floats rather
 * than dot products (token embedding rows). The same arithmetic as store/quant.c's reference
 * decoders, so the floats are identical to moe_dequantize's (tests/test_dequant_host.cu). */
#ifndef MOE_CUDA_DEQUANT_CUH
#define MOE_CUDA_DEQUANT_CUH

#include <stdint.h>
#include <string.h>

#include <cuda_fp16.h>

extern "C" {
#include "store/blocks.h"
#include "store/ggml_type.h"
}

/* Byte offset of a block field and a block's size (store/blocks.h). */
#define DQ_OFF(T, f) offsetof(struct moe_block_##T, f)
#define DQ_SIZE(T) sizeof(struct moe_block_##T)

#define DQ_HD __host__ __device__ __forceinline__

static DQ_HD float ld_f16(const uint8_t *p)
{
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

static DQ_HD uint32_t ld_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static DQ_HD void kq_scale_min(const uint8_t *s, int j, int *sc, int *m)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static DQ_HD float ld_bf16(const uint8_t *p)
{
    uint32_t u = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Element i of a row of `type` (one element per thread: a row spreads over a block). */
static DQ_HD float deq_elem(uint32_t type, const uint8_t *row, int64_t i)
{
    switch (type) {
    case MOE_TYPE_F32: return ((const float *)row)[i];
    case MOE_TYPE_F16: return ld_f16(row + 2 * i);
    case MOE_TYPE_BF16: return ld_bf16(row + 2 * i);
    default: break;
    }
    const int j = (int)(i % 256);
    if (type == MOE_TYPE_Q4_K || type == MOE_TYPE_Q5_K) {
        const uint8_t *b = row + (type == MOE_TYPE_Q4_K ? DQ_SIZE(q4_k) : DQ_SIZE(q5_k)) * (i / 256);
        const bool q4 = type == MOE_TYPE_Q4_K;
        const float d = ld_f16(b + (q4 ? DQ_OFF(q4_k, d) : DQ_OFF(q5_k, d)));
        const float dmin = ld_f16(b + (q4 ? DQ_OFF(q4_k, dmin) : DQ_OFF(q5_k, dmin)));
        const uint8_t *s = b + (q4 ? DQ_OFF(q4_k, scales) : DQ_OFF(q5_k, scales));
        const uint8_t *q = b + (q4 ? DQ_OFF(q4_k, qs) : DQ_OFF(q5_k, qs));
        const int c = j / 64, hi = (j / 32) & 1, l = j % 32;
        int sc, m;
        kq_scale_min(s, 2 * c + hi, &sc, &m);
        const float d0 = d * (float)sc, n0 = dmin * (float)m;
        const uint8_t qb = q[32 * c + l];
        int v = hi ? qb >> 4 : qb & 15;
        if (!q4 && (b[DQ_OFF(q5_k, qh) + l] & (uint8_t)(1u << (2 * c + hi))))
            v += 16;
        return d0 * (float)v - n0;
    }
    if (type == MOE_TYPE_Q6_K) {
        const uint8_t *b = row + DQ_SIZE(q6_k) * (i / 256);
        const int half = j / 128, qt = (j / 32) & 3, l = j % 32;
        const uint8_t *ql = b + DQ_OFF(q6_k, ql) + 64 * half, *qh = b + DQ_OFF(q6_k, qh) + 32 * half;
        const int8_t *sc = (const int8_t *)(b + DQ_OFF(q6_k, scales)) + 8 * half;
        const float d = ld_f16(b + DQ_OFF(q6_k, d));
        const uint8_t lb = ql[l + 32 * (qt & 1)];
        const int q = ((qt < 2 ? lb & 15 : lb >> 4) | ((qh[l] >> (2 * qt)) & 3) << 4) - 32;
        return d * (float)sc[l / 16 + 2 * qt] * (float)q;
    }
    const int k = (int)(i % 32), jj = k % 16;
    switch (type) {
    case MOE_TYPE_Q4_0: {
        const uint8_t *b = row + DQ_SIZE(q4_0) * (i / 32), *qs = b + DQ_OFF(q4_0, qs);
        const int v = k < 16 ? qs[jj] & 15 : qs[jj] >> 4;
        return (float)(v - 8) * ld_f16(b + DQ_OFF(q4_0, d));
    }
    case MOE_TYPE_Q4_1: {
        const uint8_t *b = row + DQ_SIZE(q4_1) * (i / 32), *qs = b + DQ_OFF(q4_1, qs);
        const int v = k < 16 ? qs[jj] & 15 : qs[jj] >> 4;
        return (float)v * ld_f16(b + DQ_OFF(q4_1, d)) + ld_f16(b + DQ_OFF(q4_1, m));
    }
    case MOE_TYPE_Q5_0: {
        const uint8_t *b = row + DQ_SIZE(q5_0) * (i / 32), *qs = b + DQ_OFF(q5_0, qs);
        const uint32_t qh = ld_u32(b + DQ_OFF(q5_0, qh));
        const int v = (k < 16 ? qs[jj] & 15 : qs[jj] >> 4) | (int)((qh >> k) & 1) << 4;
        return (float)(v - 16) * ld_f16(b + DQ_OFF(q5_0, d));
    }
    case MOE_TYPE_Q5_1: {
        const uint8_t *b = row + DQ_SIZE(q5_1) * (i / 32), *qs = b + DQ_OFF(q5_1, qs);
        const uint32_t qh = ld_u32(b + DQ_OFF(q5_1, qh));
        const int v = (k < 16 ? qs[jj] & 15 : qs[jj] >> 4) | (int)((qh >> k) & 1) << 4;
        return (float)v * ld_f16(b + DQ_OFF(q5_1, d)) + ld_f16(b + DQ_OFF(q5_1, m));
    }
    case MOE_TYPE_Q8_0: {
        const uint8_t *b = row + DQ_SIZE(q8_0) * (i / 32);
        return (float)((const int8_t *)(b + DQ_OFF(q8_0, qs)))[k] * ld_f16(b + DQ_OFF(q8_0, d));
    }
    default: return 0.0f;
    }
}

#undef DQ_HD
#endif

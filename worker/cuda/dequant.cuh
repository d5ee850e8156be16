/* Whole-block dequantization on the device, for the few places that need floats rather than
 * dot products (token embedding rows). The same arithmetic as store/quant.c's reference decoders,
 * so the floats are identical to moe_dequantize's. */
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

/* ---- dequantization ------------------------------------------------------------------------- */

static DQ_HD void deq_q4_0(const uint8_t *b, float *y)
{
    float d = ld_f16(b + DQ_OFF(q4_0, d));
    const uint8_t *qs = b + DQ_OFF(q4_0, qs);
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 15) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static DQ_HD void deq_q4_1(const uint8_t *b, float *y)
{
    float d = ld_f16(b + DQ_OFF(q4_1, d)), m = ld_f16(b + DQ_OFF(q4_1, m));
    const uint8_t *qs = b + DQ_OFF(q4_1, qs);
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 15) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static DQ_HD void deq_q5_0(const uint8_t *b, float *y)
{
    float d = ld_f16(b + DQ_OFF(q5_0, d));
    uint32_t qh = ld_u32(b + DQ_OFF(q5_0, qh));
    const uint8_t *qs = b + DQ_OFF(q5_0, qs);
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
        int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        y[j] = (float)(lo - 16) * d;
        y[j + 16] = (float)(hi - 16) * d;
    }
}

static DQ_HD void deq_q5_1(const uint8_t *b, float *y)
{
    float d = ld_f16(b + DQ_OFF(q5_1, d)), m = ld_f16(b + DQ_OFF(q5_1, m));
    uint32_t qh = ld_u32(b + DQ_OFF(q5_1, qh));
    const uint8_t *qs = b + DQ_OFF(q5_1, qs);
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
        int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        y[j] = (float)lo * d + m;
        y[j + 16] = (float)hi * d + m;
    }
}

static DQ_HD void deq_q8_0(const uint8_t *b, float *y)
{
    float d = ld_f16(b + DQ_OFF(q8_0, d));
    const int8_t *qs = (const int8_t *)(b + DQ_OFF(q8_0, qs));
    for (int j = 0; j < 32; j++)
        y[j] = (float)qs[j] * d;
}

static DQ_HD void deq_q4_k(const uint8_t *b, float *y)
{
    float d = ld_f16(b + DQ_OFF(q4_k, d)), dmin = ld_f16(b + DQ_OFF(q4_k, dmin));
    const uint8_t *s = b + DQ_OFF(q4_k, scales), *q = b + DQ_OFF(q4_k, qs);
    for (int c = 0; c < 4; c++, q += 32, y += 64) {
        int sc0, m0, sc1, m1;
        kq_scale_min(s, 2 * c, &sc0, &m0);
        kq_scale_min(s, 2 * c + 1, &sc1, &m1);
        float d0 = d * (float)sc0, n0 = dmin * (float)m0;
        float d1 = d * (float)sc1, n1 = dmin * (float)m1;
        for (int l = 0; l < 32; l++) {
            y[l] = d0 * (float)(q[l] & 15) - n0;
            y[l + 32] = d1 * (float)(q[l] >> 4) - n1;
        }
    }
}

static DQ_HD void deq_q5_k(const uint8_t *b, float *y)
{
    float d = ld_f16(b + DQ_OFF(q5_k, d)), dmin = ld_f16(b + DQ_OFF(q5_k, dmin));
    const uint8_t *s = b + DQ_OFF(q5_k, scales), *qh = b + DQ_OFF(q5_k, qh);
    const uint8_t *q = b + DQ_OFF(q5_k, qs);
    for (int c = 0; c < 4; c++, q += 32, y += 64) {
        int sc0, m0, sc1, m1;
        kq_scale_min(s, 2 * c, &sc0, &m0);
        kq_scale_min(s, 2 * c + 1, &sc1, &m1);
        float d0 = d * (float)sc0, n0 = dmin * (float)m0;
        float d1 = d * (float)sc1, n1 = dmin * (float)m1;
        uint8_t u0 = (uint8_t)(1u << (2 * c)), u1 = (uint8_t)(2u << (2 * c));
        for (int l = 0; l < 32; l++) {
            int lo = (q[l] & 15) + ((qh[l] & u0) ? 16 : 0);
            int hi = (q[l] >> 4) + ((qh[l] & u1) ? 16 : 0);
            y[l] = d0 * (float)lo - n0;
            y[l + 32] = d1 * (float)hi - n1;
        }
    }
}

static DQ_HD void deq_q6_k(const uint8_t *b, float *y)
{
    const uint8_t *ql = b + DQ_OFF(q6_k, ql), *qh = b + DQ_OFF(q6_k, qh);
    const int8_t *sc = (const int8_t *)(b + DQ_OFF(q6_k, scales));
    float d = ld_f16(b + DQ_OFF(q6_k, d));
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4) - 32;
            int q2 = ((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32;
            int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
            int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
    }
}


static __host__ __device__ __forceinline__ float ld_bf16(const uint8_t *p)
{
    uint32_t u = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Decodes block bi of a row of `type` into y (blck floats). */
static __host__ __device__ __forceinline__ void deq_block(uint32_t type, const uint8_t *row, int64_t bi, float *y)
{
    switch (type) {
    case MOE_TYPE_F32: y[0] = ((const float *)row)[bi]; break;
    case MOE_TYPE_F16: y[0] = ld_f16(row + 2 * bi); break;
    case MOE_TYPE_BF16: y[0] = ld_bf16(row + 2 * bi); break;
    case MOE_TYPE_Q4_0: deq_q4_0(row + DQ_SIZE(q4_0) * bi, y); break;
    case MOE_TYPE_Q4_1: deq_q4_1(row + DQ_SIZE(q4_1) * bi, y); break;
    case MOE_TYPE_Q5_0: deq_q5_0(row + DQ_SIZE(q5_0) * bi, y); break;
    case MOE_TYPE_Q5_1: deq_q5_1(row + DQ_SIZE(q5_1) * bi, y); break;
    case MOE_TYPE_Q8_0: deq_q8_0(row + DQ_SIZE(q8_0) * bi, y); break;
    case MOE_TYPE_Q4_K: deq_q4_k(row + DQ_SIZE(q4_k) * bi, y); break;
    case MOE_TYPE_Q5_K: deq_q5_k(row + DQ_SIZE(q5_k) * bi, y); break;
    case MOE_TYPE_Q6_K: deq_q6_k(row + DQ_SIZE(q6_k) * bi, y); break;
    default: break;
    }
}

#undef DQ_HD
#endif

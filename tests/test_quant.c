/* Block formats: hand-built blocks with known values for every type, quantize→dequantize error
 * bounds on random data, half/bfloat16 conversion edge cases, and the golden llama.cpp files. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "store/blocks.h"
#include "store/err.h"
#include "store/ggml_type.h"
#include "store/gguf.h"
#include "store/quant.h"
#include "tests/harness.h"

static uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void put16(uint8_t *p, uint16_t h)
{
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

/* Roughly normal (sum of uniforms), like trained weights. */
static float rng_normal(void)
{
    float s = 0;
    for (int i = 0; i < 4; i++)
        s += (float)moe_test_rng_u32() / 4294967296.0f;
    return (s - 2.0f) * 1.7320508f;
}

/* ---- half / bfloat16 ------------------------------------------------------------------------ */

TEST(quant_f16_edge_cases)
{
    CHECK_EQ(moe_f32_to_f16(0.0f), 0x0000);
    CHECK_EQ(moe_f32_to_f16(-0.0f), 0x8000);
    CHECK_EQ(moe_f32_to_f16(1.0f), 0x3c00);
    CHECK_EQ(moe_f32_to_f16(-2.0f), 0xc000);
    CHECK_EQ(moe_f32_to_f16(65504.0f), 0x7bff);
    CHECK_EQ(moe_f32_to_f16(65519.99f), 0x7bff);   /* just below the halfway point */
    CHECK_EQ(moe_f32_to_f16(65520.0f), 0x7c00);    /* tie, rounds to even = infinity */
    CHECK_EQ(moe_f32_to_f16(1e10f), 0x7c00);
    CHECK_EQ(moe_f32_to_f16(-INFINITY), 0xfc00);
    CHECK_EQ(moe_f32_to_f16(INFINITY), 0x7c00);
    uint16_t nan = moe_f32_to_f16(NAN);
    CHECK((nan & 0x7c00) == 0x7c00 && (nan & 0x3ff) != 0);
    /* A signalling NaN whose payload sits only in the low bits must not become infinity. */
    uint16_t snan = moe_f32_to_f16(u2f(0x7f800001u));
    CHECK((snan & 0x7c00) == 0x7c00 && (snan & 0x3ff) != 0);
    /* Ties to even in the normal range: 1 + 2^-11 is halfway between 1 and 1 + 2^-10. */
    CHECK_EQ(moe_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
    CHECK_EQ(moe_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);
    CHECK_EQ(moe_f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
    /* Subnormals. */
    CHECK_EQ(moe_f32_to_f16(0x1p-14f), 0x0400);         /* smallest normal */
    CHECK_EQ(moe_f32_to_f16(0x1p-24f), 0x0001);         /* smallest subnormal */
    CHECK_EQ(moe_f32_to_f16(0x1p-25f), 0x0000);         /* tie -> even (zero) */
    CHECK_EQ(moe_f32_to_f16(-0x1p-25f), 0x8000);
    CHECK_EQ(moe_f32_to_f16(0x1.000002p-25f), 0x0001);  /* just above the tie */
    CHECK_EQ(moe_f32_to_f16(3 * 0x1p-25f), 0x0002);     /* 1.5 ulp: tie -> even */
    CHECK_EQ(moe_f32_to_f16(5 * 0x1p-25f), 0x0002);     /* 2.5 ulp: tie -> even */
    CHECK_EQ(moe_f32_to_f16(0x1p-14f - 0x1p-25f), 0x0400); /* rounds up into the normals */
    CHECK_EQ(moe_f32_to_f16(1e-30f), 0x0000);

    CHECK(moe_f16_to_f32(0x0001) == 0x1p-24f);
    CHECK(moe_f16_to_f32(0x03ff) == 1023 * 0x1p-24f);
    CHECK(moe_f16_to_f32(0x8001) == -0x1p-24f);
    CHECK(moe_f16_to_f32(0x7bff) == 65504.0f);
    CHECK(moe_f16_to_f32(0x3555) == 0x1.554p-2f);
    CHECK(isinf(moe_f16_to_f32(0x7c00)) && moe_f16_to_f32(0x7c00) > 0);
    CHECK(isinf(moe_f16_to_f32(0xfc00)) && moe_f16_to_f32(0xfc00) < 0);
    CHECK(isnan(moe_f16_to_f32(0x7e00)));
    CHECK(isnan(moe_f16_to_f32(0x7c01)));
    CHECK(f2u(moe_f16_to_f32(0x8000)) == 0x80000000u);
}

/* Every half value survives half -> float -> half, and float -> half picks the nearest half:
 * checked against the neighbours for a sweep of floats. */
TEST(quant_f16_exhaustive)
{
    for (uint32_t h = 0; h < 65536; h++) {
        float f = moe_f16_to_f32((uint16_t)h);
        if (isnan(f)) {
            CHECK(isnan(moe_f16_to_f32(moe_f32_to_f16(f))));
            continue;
        }
        CHECK_MSG(moe_f32_to_f16(f) == h, "half 0x%04x -> %g -> 0x%04x", h, f, moe_f32_to_f16(f));
    }
    moe_test_rng_seed(7);
    for (int i = 0; i < 200000; i++) {
        /* Floats across the half range, including subnormals. */
        float f = ldexpf((float)moe_test_rng_u32() / 4294967296.0f + 0.5f, (int)(moe_test_rng_u32() % 44) - 28);
        if (moe_test_rng_u32() & 1)
            f = -f;
        uint16_t h = moe_f32_to_f16(f);
        double v = moe_f16_to_f32(h);
        if (isinf(v))
            continue;
        double err = fabs(v - f);
        double lo = moe_f16_to_f32((uint16_t)(h - 1)), hi = moe_f16_to_f32((uint16_t)(h + 1));
        if ((h & 0x7fff) != 0)
            CHECK_MSG(err <= fabs(lo - f), "%a -> 0x%04x not nearest", f, h);
        if ((h & 0x7fff) != 0x7bff)
            CHECK_MSG(err <= fabs(hi - f), "%a -> 0x%04x not nearest", f, h);
    }
}

TEST(quant_bf16_edge_cases)
{
    CHECK_EQ(moe_f32_to_bf16(1.0f), 0x3f80);
    CHECK_EQ(moe_f32_to_bf16(-1.0f), 0xbf80);
    CHECK_EQ(moe_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);       /* tie -> even */
    CHECK_EQ(moe_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);   /* tie -> even (up) */
    CHECK_EQ(moe_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
    CHECK_EQ(moe_f32_to_bf16(u2f(0x7f7fffffu)), 0x7f80);    /* FLT_MAX rounds to infinity */
    CHECK_EQ(moe_f32_to_bf16(INFINITY), 0x7f80);
    CHECK_EQ(moe_f32_to_bf16(-INFINITY), 0xff80);
    CHECK_EQ(moe_f32_to_bf16(u2f(0x00000001u)), 0x0000);   /* tiny subnormal -> 0 */
    CHECK_EQ(moe_f32_to_bf16(u2f(0x00018000u)), 0x0002);   /* subnormal tie -> even */
    CHECK_EQ(moe_f32_to_bf16(-0.0f), 0x8000);
    uint16_t snan = moe_f32_to_bf16(u2f(0x7f800001u));      /* would truncate to infinity */
    CHECK((snan & 0x7f80) == 0x7f80 && (snan & 0x7f) != 0);
    CHECK(isnan(moe_bf16_to_f32(moe_f32_to_bf16(NAN))));
    CHECK(moe_bf16_to_f32(0x4049) == 3.140625f);
    CHECK(moe_bf16_to_f32(0x0001) == u2f(0x00010000u));
    for (uint32_t h = 0; h < 65536; h++) {
        float f = moe_bf16_to_f32((uint16_t)h);
        if (isnan(f))
            CHECK(isnan(moe_bf16_to_f32(moe_f32_to_bf16(f))));
        else
            CHECK_EQ(moe_f32_to_bf16(f), h);
    }
}

/* ---- hand-built blocks ---------------------------------------------------------------------- */

static void check_deq(uint32_t type, const void *blk, int64_t n, const float *expect)
{
    float y[512];
    CHECK_EQ(moe_dequantize(type, blk, y, n), 0);
    for (int64_t i = 0; i < n; i++)
        CHECK_MSG(y[i] == expect[i], "%s element %lld: got %g, expected %g",
                  moe_type_get(type)->name, (long long)i, y[i], expect[i]);
}

TEST(quant_block_plain_types)
{
    float f[4] = {1.5f, -2.0f, 0.0f, 65504.0f}, y[4], e[4];
    CHECK_EQ(moe_dequantize(MOE_TYPE_F32, f, y, 4), 0);
    CHECK(memcmp(f, y, sizeof f) == 0);
    uint8_t h[8];
    put16(h, 0x3e00);     /* 1.5 */
    put16(h + 2, 0xc000); /* -2 */
    put16(h + 4, 0x0001); /* 2^-24 */
    put16(h + 6, 0x7bff); /* 65504 */
    e[0] = 1.5f, e[1] = -2.0f, e[2] = 0x1p-24f, e[3] = 65504.0f;
    check_deq(MOE_TYPE_F16, h, 4, e);
    put16(h, 0x3fc0);     /* 1.5 */
    put16(h + 2, 0xc000); /* -2 */
    put16(h + 4, 0x4049); /* 3.140625 */
    put16(h + 6, 0xc2f7); /* -123.5 */
    e[0] = 1.5f, e[1] = -2.0f, e[2] = 3.140625f, e[3] = -123.5f;
    check_deq(MOE_TYPE_BF16, h, 4, e);
}

TEST(quant_block_q4_0_q4_1)
{
    uint8_t b[20];
    float e[32];
    put16(b, 0x3800); /* d = 0.5 */
    for (int j = 0; j < 16; j++)
        b[2 + j] = (uint8_t)(j | (15 - j) << 4);
    for (int j = 0; j < 16; j++) {
        e[j] = (float)(j - 8) * 0.5f;
        e[j + 16] = (float)(7 - j) * 0.5f;
    }
    check_deq(MOE_TYPE_Q4_0, b, 32, e);
    CHECK(e[0] == -4.0f && e[16] == 3.5f);

    put16(b, 0x3800);     /* d = 0.5 */
    put16(b + 2, 0xbc00); /* m = -1 */
    for (int j = 0; j < 16; j++)
        b[4 + j] = (uint8_t)(j | (15 - j) << 4);
    for (int j = 0; j < 16; j++) {
        e[j] = (float)j * 0.5f - 1.0f;
        e[j + 16] = (float)(15 - j) * 0.5f - 1.0f;
    }
    check_deq(MOE_TYPE_Q4_1, b, 32, e);
    CHECK(e[16] == 6.5f);
}

/* The 5th bit of element j is bit j of qh (bit j+16 for the high nibbles). */
TEST(quant_block_q5_0_q5_1)
{
    uint8_t b[24];
    float e[32];
    const uint32_t qh = 0xA5C3F00Fu;
    put16(b, 0x3c00); /* d = 1 */
    b[2] = 0x0F, b[3] = 0xF0, b[4] = 0xC3, b[5] = 0xA5; /* qh little-endian */
    for (int j = 0; j < 16; j++)
        b[6 + j] = (uint8_t)(j | (15 - j) << 4);
    for (int j = 0; j < 16; j++) {
        e[j] = (float)((j | (int)((qh >> j) & 1) << 4) - 16);
        e[j + 16] = (float)(((15 - j) | (int)((qh >> (j + 16)) & 1) << 4) - 16);
    }
    CHECK(e[0] == 0.0f && e[4] == -12.0f && e[16] == 15.0f && e[17] == 14.0f && e[20] == -5.0f);
    check_deq(MOE_TYPE_Q5_0, b, 32, e);

    put16(b, 0x3800);     /* d = 0.5 */
    put16(b + 2, 0x3c00); /* m = 1 */
    b[4] = 0x0F, b[5] = 0xF0, b[6] = 0xC3, b[7] = 0xA5;
    for (int j = 0; j < 16; j++)
        b[8 + j] = (uint8_t)(j | (15 - j) << 4);
    for (int j = 0; j < 16; j++) {
        e[j] = (float)(j | (int)((qh >> j) & 1) << 4) * 0.5f + 1.0f;
        e[j + 16] = (float)((15 - j) | (int)((qh >> (j + 16)) & 1) << 4) * 0.5f + 1.0f;
    }
    CHECK(e[0] == 9.0f && e[31] == 9.0f && e[30] == 1.5f);
    check_deq(MOE_TYPE_Q5_1, b, 32, e);
}

TEST(quant_block_q8_0)
{
    uint8_t b[34];
    float e[32];
    put16(b, 0x3400); /* d = 0.25 */
    for (int j = 0; j < 32; j++) {
        b[2 + j] = (uint8_t)(j * 8 - 128);
        e[j] = (float)(j * 8 - 128) * 0.25f;
    }
    CHECK(e[0] == -32.0f && e[31] == 30.0f);
    check_deq(MOE_TYPE_Q8_0, b, 32, e);
}

/* Scales and mins of the 8 sub-blocks used by the Q4_K/Q5_K blocks below, and their packed
 * bytes, worked out by hand: for j<4 the low 6 bits of s[j] / s[j+4]; for j>=4 a nibble of s[j+4]
 * plus the top two bits of s[j-4] / s[j]. */
static const int kq_sc[8] = {1, 2, 3, 63, 40, 17, 5, 33};
static const int kq_m[8] = {0, 7, 63, 1, 50, 9, 2, 60};
static const uint8_t kq_packed[12] = {129, 66, 3, 191, 192, 7, 63, 193, 40, 145, 37, 193};

TEST(quant_block_q4_k)
{
    uint8_t b[144];
    float e[256];
    put16(b, 0x3c00);     /* d = 1 */
    put16(b + 2, 0x3800); /* dmin = 0.5 */
    memcpy(b + 4, kq_packed, 12);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            b[16 + 32 * c + l] = (uint8_t)(((l + c) & 15) | ((3 * l + c) & 15) << 4);
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            e[64 * c + l] = (float)(kq_sc[2 * c] * ((l + c) & 15)) - 0.5f * (float)kq_m[2 * c];
            e[64 * c + 32 + l] =
                (float)(kq_sc[2 * c + 1] * ((3 * l + c) & 15)) - 0.5f * (float)kq_m[2 * c + 1];
        }
    }
    CHECK(e[32] == -3.5f);        /* sub-block 1: scale 2, min 7, code 0 */
    CHECK(e[128 + 5] == 255.0f);  /* sub-block 4: 40 * 7 - 0.5 * 50 */
    CHECK(e[192 + 32 + 1] == 33.0f * 6 - 30.0f); /* sub-block 7 */
    check_deq(MOE_TYPE_Q4_K, b, 256, e);
}

TEST(quant_block_q5_k)
{
    uint8_t b[176];
    float e[256];
    put16(b, 0x3800);     /* d = 0.5 */
    put16(b + 2, 0x3c00); /* dmin = 1 */
    memcpy(b + 4, kq_packed, 12);
    for (int l = 0; l < 32; l++)
        b[16 + l] = (uint8_t)(l * 37 + 11);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            b[48 + 32 * c + l] = (uint8_t)(((l + c) & 15) | ((3 * l + c) & 15) << 4);
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            uint8_t qh = (uint8_t)(l * 37 + 11);
            int lo = ((l + c) & 15) + (((qh >> (2 * c)) & 1) ? 16 : 0);
            int hi = ((3 * l + c) & 15) + (((qh >> (2 * c + 1)) & 1) ? 16 : 0);
            e[64 * c + l] = 0.5f * (float)(kq_sc[2 * c] * lo) - (float)kq_m[2 * c];
            e[64 * c + 32 + l] = 0.5f * (float)(kq_sc[2 * c + 1] * hi) - (float)kq_m[2 * c + 1];
        }
    }
    /* qh[0] = 11 = 0b1011: bits 0, 1, 3 set. */
    CHECK(e[0] == 0.5f * 16 - 0.0f);              /* c0 low half: +16 */
    CHECK(e[32] == 0.5f * 2 * 16 - 7.0f);         /* c0 high half: +16 */
    CHECK(e[64] == 0.5f * 3 * 1 - 63.0f);         /* c1 low: bit 2 clear, code 1 */
    CHECK(e[96] == 0.5f * 63 * (1 + 16) - 1.0f);  /* c1 high: bit 3 set */
    check_deq(MOE_TYPE_Q5_K, b, 256, e);
}

/* Q6_K checked with an index-driven reading of the layout: element i = 128h + 32g + l takes its
 * low 4 bits from ql[64h + l + 32(g&1)] (low nibble for g<2, high for g>=2), its top 2 bits
 * from bits 2g..2g+1 of qh[32h + l], and its scale from scales[8h + l/16 + 2g]. */
TEST(quant_block_q6_k)
{
    uint8_t b[210];
    float e[256];
    for (int i = 0; i < 128; i++)
        b[i] = (uint8_t)(i * 29 + 3);
    for (int i = 0; i < 64; i++)
        b[128 + i] = (uint8_t)(i * 53 + 17);
    static const int8_t sc[16] = {1, -2, 3, -4, 5, -6, 7, -8, 127, -128, 0, 64, -1, 33, -77, 2};
    memcpy(b + 192, sc, 16);
    put16(b + 208, 0x3800); /* d = 0.5 */
    for (int i = 0; i < 256; i++) {
        int h = i / 128, g = (i % 128) / 32, l = i % 32;
        uint8_t qlb = b[64 * h + l + 32 * (g & 1)];
        int lo = g < 2 ? (qlb & 15) : (qlb >> 4);
        int hi = (b[128 + 32 * h + l] >> (2 * g)) & 3;
        e[i] = 0.5f * (float)sc[8 * h + l / 16 + 2 * g] * (float)((lo | hi << 4) - 32);
    }
    /* Element 0: ql[0] = 3, qh[0] = 17 -> bits 0..1 = 1: q = 3 + 16 - 32 = -13, scale 1. */
    CHECK(e[0] == 0.5f * 1 * -13);
    check_deq(MOE_TYPE_Q6_K, b, 256, e);
}

/* store/blocks.h's structs against the type table the reader and row sizes use. */
TEST(quant_block_structs_match_type_table)
{
    static const struct {
        uint32_t type;
        size_t size, blck;
    } blocks[] = {
        {MOE_TYPE_Q4_0, sizeof(struct moe_block_q4_0), MOE_QK},
        {MOE_TYPE_Q4_1, sizeof(struct moe_block_q4_1), MOE_QK},
        {MOE_TYPE_Q5_0, sizeof(struct moe_block_q5_0), MOE_QK},
        {MOE_TYPE_Q5_1, sizeof(struct moe_block_q5_1), MOE_QK},
        {MOE_TYPE_Q8_0, sizeof(struct moe_block_q8_0), MOE_QK},
        {MOE_TYPE_Q2_K, sizeof(struct moe_block_q2_k), MOE_QK_K},
        {MOE_TYPE_Q3_K, sizeof(struct moe_block_q3_k), MOE_QK_K},
        {MOE_TYPE_Q4_K, sizeof(struct moe_block_q4_k), MOE_QK_K},
        {MOE_TYPE_Q5_K, sizeof(struct moe_block_q5_k), MOE_QK_K},
        {MOE_TYPE_Q6_K, sizeof(struct moe_block_q6_k), MOE_QK_K},
    };
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++) {
        const struct moe_type_info *t = moe_type_get(blocks[i].type);
        CHECK(t != NULL);
        CHECK_MSG(t->size == blocks[i].size && t->blck == blocks[i].blck,
                  "%s: table %u bytes / %u elements, struct %zu / %zu", t->name, t->size, t->blck,
                  blocks[i].size, blocks[i].blck);
    }
}

TEST(quant_rejects_unsupported)
{
    float x[256] = {0}, y[256];
    uint8_t b[512] = {0};
    CHECK_EQ(moe_dequantize(MOE_TYPE_Q2_K, b, y, 256), MOE_EUNSUPPORTED);
    CHECK_EQ(moe_dequantize(MOE_TYPE_MXFP4, b, y, 32), MOE_EUNSUPPORTED);
    CHECK_EQ(moe_dequantize(4, b, y, 32), MOE_EUNSUPPORTED);
    CHECK_EQ(moe_dequantize(1000, b, y, 32), MOE_EUNSUPPORTED);
    CHECK_EQ(moe_quantize(MOE_TYPE_Q8_K, x, b, 256), MOE_EUNSUPPORTED);
    CHECK_EQ(moe_quantize(MOE_TYPE_IQ4_NL, x, b, 32), MOE_EUNSUPPORTED);
    CHECK_EQ(moe_quantize(5, x, b, 32), MOE_EUNSUPPORTED);
    /* n must be a whole number of blocks. */
    CHECK_EQ(moe_quantize(MOE_TYPE_Q4_K, x, b, 100), MOE_EUNSUPPORTED);
    CHECK_EQ(moe_dequantize(MOE_TYPE_Q8_0, b, y, 33), MOE_EUNSUPPORTED);
}

/* ---- quantize -> dequantize ----------------------------------------------------------------- */

static const uint32_t all_types[] = {
    MOE_TYPE_F32, MOE_TYPE_F16, MOE_TYPE_BF16, MOE_TYPE_Q4_0, MOE_TYPE_Q4_1, MOE_TYPE_Q5_0,
    MOE_TYPE_Q5_1, MOE_TYPE_Q8_0, MOE_TYPE_Q4_K, MOE_TYPE_Q5_K, MOE_TYPE_Q6_K,
};

/* Relative RMS error bounds measured on roughly normal data (mean of 4 uniforms), with some
 * headroom; the measured values are in docs/kernels.md. */
static double rt_bound(uint32_t type)
{
    switch (type) {
    case MOE_TYPE_F32: return 0;
    case MOE_TYPE_F16: return 4e-4;
    case MOE_TYPE_BF16: return 3e-3;
    case MOE_TYPE_Q8_0: return 0.008;
    case MOE_TYPE_Q6_K: return 0.025;
    case MOE_TYPE_Q5_0: return 0.06;
    case MOE_TYPE_Q5_1: return 0.05;
    case MOE_TYPE_Q5_K: return 0.045;
    case MOE_TYPE_Q4_0: return 0.12;
    case MOE_TYPE_Q4_1: return 0.10;
    case MOE_TYPE_Q4_K: return 0.09;
    }
    return 0;
}

static double roundtrip_err(uint32_t type, const float *x, int64_t n, int print)
{
    size_t rb = moe_row_bytes(type, n);
    uint8_t *q = malloc(rb), *q2 = malloc(rb);
    float *y = malloc((size_t)n * sizeof *y);
    double se = 0, sx = 0;
    CHECK(q && q2 && y);
    CHECK_EQ(moe_quantize(type, x, q, n), 0);
    CHECK_EQ(moe_quantize(type, x, q2, n), 0);
    CHECK(memcmp(q, q2, rb) == 0); /* deterministic */
    CHECK_EQ(moe_dequantize(type, q, y, n), 0);
    for (int64_t i = 0; i < n; i++) {
        se += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
        sx += (double)x[i] * x[i];
    }
    if (print)
        printf("%-5s rel rms error %.5f\n", moe_type_get(type)->name, sqrt(se / sx));
    free(q), free(q2), free(y);
    return sqrt(se / sx);
}

TEST(quant_roundtrip_error_bounds)
{
    const int64_t n = 256 * 64;
    float *x = malloc(n * sizeof *x);
    CHECK(x);
    moe_test_rng_seed(42);
    /* Rows with different magnitudes, and a few outliers as real weights have. */
    for (int64_t i = 0; i < n; i++)
        x[i] = rng_normal() * (0.01f + (float)(i / 1024) * 0.1f) * ((moe_test_rng_u32() % 97) ? 1 : 4);
    for (size_t t = 0; t < sizeof all_types / sizeof all_types[0]; t++) {
        double e = roundtrip_err(all_types[t], x, n, 1);
        CHECK_MSG(e <= rt_bound(all_types[t]), "%s: rel error %.5f > %.5f",
                  moe_type_get(all_types[t])->name, e, rt_bound(all_types[t]));
    }
    free(x);
}

/* The K-quant search must beat the naive fit (step = range / nmax, min = block minimum, codes by
 * rounding), which is what it exists for. */
TEST(quant_kquant_search_beats_naive)
{
    float x[256], y[256];
    double se_fit = 0, se_naive = 0;
    uint8_t b[256];
    moe_test_rng_seed(3);
    for (int rep = 0; rep < 50; rep++) {
        for (int i = 0; i < 256; i++)
            x[i] = rng_normal();
        CHECK_EQ(moe_quantize(MOE_TYPE_Q4_K, x, b, 256), 0);
        CHECK_EQ(moe_dequantize(MOE_TYPE_Q4_K, b, y, 256), 0);
        for (int j = 0; j < 8; j++) {
            float mn = x[32 * j], mx = x[32 * j];
            for (int i = 0; i < 32; i++) {
                mn = fminf(mn, x[32 * j + i]);
                mx = fmaxf(mx, x[32 * j + i]);
            }
            float d = (mx - mn) / 15;
            for (int i = 0; i < 32; i++) {
                float v = x[32 * j + i];
                float r = mn + d * roundf((v - mn) / d) - v;
                se_naive += r * r;
                se_fit += (y[32 * j + i] - v) * (y[32 * j + i] - v);
            }
        }
    }
    /* The fit also pays for 6-bit scales and half-precision headers and still wins. */
    CHECK_MSG(se_fit < se_naive * 0.95, "fit %g naive %g", se_fit, se_naive);
}

TEST(quant_zero_and_constant_blocks)
{
    float x[256], y[256];
    uint8_t b[256 * 4]; /* F32 is the largest encoding */
    for (size_t t = 0; t < sizeof all_types / sizeof all_types[0]; t++) {
        uint32_t type = all_types[t];
        memset(x, 0, sizeof x);
        CHECK_EQ(moe_quantize(type, x, b, 256), 0);
        CHECK_EQ(moe_dequantize(type, b, y, 256), 0);
        for (int i = 0; i < 256; i++)
            CHECK_MSG(y[i] == 0.0f, "%s: zero block gives %g", moe_type_get(type)->name, y[i]);
        for (int i = 0; i < 256; i++)
            x[i] = -0.75f;
        CHECK_EQ(moe_quantize(type, x, b, 256), 0);
        CHECK_EQ(moe_dequantize(type, b, y, 256), 0);
        for (int i = 0; i < 256; i++)
            CHECK_MSG(fabsf(y[i] + 0.75f) < 0.75f * 0.02f, "%s: constant block gives %g",
                      moe_type_get(type)->name, y[i]);
    }
}

/* ---- golden files --------------------------------------------------------------------------- */

/* The layouts on real data: every tensor of the golden Q8_0 and Q4_K_M files (made by llama.cpp)
 * decodes to within its type's quantization error of the same tensor in the F16 file. A wrong
 * bit position or scale packing gives errors near 100%. Our own quantizer, run on the F16 data,
 * must do about as well as llama-quantize did. Per type, the errors are summed over all tensors
 * of that type. */
static void golden_compare(const char *path, int *n_types_seen)
{
    char err[256];
    struct gguf_file *ref = NULL, *q = NULL;
    double se[MOE_TYPE_COUNT] = {0}, se_ours[MOE_TYPE_COUNT] = {0}, sx[MOE_TYPE_COUNT] = {0};
    int r = gguf_open(&ref, "tests/golden/models/tiny-qwen3moe-F16.gguf", err, sizeof err);
    CHECK_MSG(r == 0, "F16 golden: %s", err);
    r = gguf_open(&q, path, err, sizeof err);
    CHECK_MSG(r == 0, "%s: %s", path, err);
    for (uint64_t i = 0; i < q->n_tensors; i++) {
        const struct gguf_tensor *t = &q->tensors[i];
        const struct gguf_tensor *f = gguf_find_tensor(ref, t->name);
        CHECK_MSG(f != NULL, "%s missing from the F16 file", t->name);
        int64_t n = 1;
        for (uint32_t d = 0; d < t->n_dims; d++)
            n *= t->ne[d];
        float *a = malloc((size_t)n * sizeof *a), *b = malloc((size_t)n * sizeof *b);
        float *c = malloc((size_t)n * sizeof *c);
        void *blk = malloc(moe_row_bytes(t->type, t->ne[0]) * (size_t)(n / t->ne[0]));
        CHECK(a && b && c && blk);
        CHECK_EQ(moe_dequantize(t->type, t->data, a, n), 0);
        CHECK_EQ(moe_dequantize(f->type, f->data, b, n), 0);
        CHECK_EQ(moe_quantize(t->type, b, blk, n), 0);
        CHECK_EQ(moe_dequantize(t->type, blk, c, n), 0);
        for (int64_t k = 0; k < n; k++) {
            se[t->type] += ((double)a[k] - b[k]) * ((double)a[k] - b[k]);
            se_ours[t->type] += ((double)c[k] - b[k]) * ((double)c[k] - b[k]);
            sx[t->type] += (double)b[k] * b[k];
        }
        free(a), free(b), free(c), free(blk);
    }
    for (uint32_t ty = 0; ty < MOE_TYPE_COUNT; ty++) {
        if (sx[ty] == 0)
            continue;
        double e = sqrt(se[ty] / sx[ty]), eo = sqrt(se_ours[ty] / sx[ty]);
        printf("%s %-5s llama.cpp %.5f ours %.5f\n", path, moe_type_get(ty)->name, e, eo);
        if (ty == MOE_TYPE_F32 || ty == MOE_TYPE_F16) {
            CHECK_MSG(e == 0, "%s: %s tensors differ from the F16 file", path, moe_type_get(ty)->name);
            continue;
        }
        (*n_types_seen)++;
        CHECK_MSG(e < 1.3 * rt_bound(ty), "%s: %s decodes %.4f away from F16", path,
                  moe_type_get(ty)->name, e);
        CHECK_MSG(eo < 1.15 * e, "%s: our %s quantizer %.5f vs llama.cpp %.5f", path,
                  moe_type_get(ty)->name, eo, e);
    }
    gguf_close(q);
    gguf_close(ref);
}

TEST(quant_golden_files_match_f16)
{
    int seen = 0;
    golden_compare("tests/golden/models/tiny-qwen3moe-Q8_0.gguf", &seen);
    golden_compare("tests/golden/models/tiny-qwen3moe-Q4_K_M.gguf", &seen);
    CHECK(seen >= 4); /* q8_0; q4_K, q6_K, q5_0 and/or q8_0 */
}

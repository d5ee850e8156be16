/* AVX2 + FMA + F16C kernel variants, selected at run time by kernels.c.
 *
 * The build uses no -march flag, so every function that uses these instructions carries the
 * target attribute and is only called after moe_kernels_have_avx2() said yes.
 *
 * Each block type has one block function that turns the block into 8-wide float vectors of
 * weights (the same arithmetic as moe_dequantize(), up to an FMA's single rounding) and hands
 * each vector to a sink: either multiply-accumulate against x (the dot product), or store (the
 * decoder for matmul). The block functions are forced inline with a constant sink, so the dot
 * product never touches memory for the weights. */
#include "worker/cpu/kernels_impl.h"

#if defined(MOE_KERNELS_X86)

#include <cpuid.h>
#include <immintrin.h>
#include <string.h>

#include "store/blocks.h"
#include "store/ggml_type.h"

#define AVX2 __attribute__((target("avx2,fma,f16c")))
/* Block loops are fully unrolled so the accumulator index in put() is a constant and the
 * accumulators stay in registers. */
#define UNROLL _Pragma("GCC unroll 8")
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* __builtin_cpu_supports() covers AVX2 and FMA (including the OS saving YMM state), but not every
 * compiler knows "f16c", so that bit comes from CPUID leaf 1 (ECX bit 29) directly. */
int moe_kernels_have_avx2(void)
{
    /* Computed once; racing first callers compute the same value (relaxed atomics keep that
     * well-defined). */
    static int have = -1;
    int h = __atomic_load_n(&have, __ATOMIC_RELAXED);
    if (h < 0) {
        unsigned a, b, c, d;
        __builtin_cpu_init();
        int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
        h = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
        __atomic_store_n(&have, h, __ATOMIC_RELAXED);
    }
    return h;
}

AVX2_INLINE float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A half-precision block field (d, m, dmin) to float. */
AVX2_INLINE float h2f(uint16_t h)
{
    return _cvtsh_ss(h);
}

/* An element of an F16 row, wherever it sits. */
AVX2_INLINE float half(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return h2f(h);
}

/* 8 bytes -> 8 int32 lanes, unsigned / signed. */
AVX2_INLINE __m256i u8x8(const uint8_t *p)
{
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

AVX2_INLINE __m256i i8x8(const int8_t *p)
{
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

AVX2_INLINE __m256 tof(__m256i v)
{
    return _mm256_cvtepi32_ps(v);
}

/* The sink. dst != NULL: store the 8 weights at dst + off. Otherwise accumulate w * x[off..]. */
struct sink {
    const float *x;
    float *dst;
    __m256 acc[4];
};

AVX2_INLINE void put(struct sink *s, int a, int64_t off, __m256 w)
{
    if (s->dst)
        _mm256_storeu_ps(s->dst + off, w);
    else
        s->acc[a] = _mm256_fmadd_ps(w, _mm256_loadu_ps(s->x + off), s->acc[a]);
}

/* 5th bits of 8 consecutive elements j0..j0+7 from a 32-bit qh: 16 where set, else 0. */
AVX2_INLINE __m256i q5_high(uint32_t qh, int j0)
{
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i v = _mm256_and_si256(_mm256_set1_epi32((int)((qh >> j0) & 0xff)), bits);
    return _mm256_and_si256(_mm256_cmpeq_epi32(v, bits), _mm256_set1_epi32(16));
}

/* ---- 32-element blocks ---------------------------------------------------------------------- */

AVX2_INLINE void blk_q4_0(const void *blk, struct sink *s, int64_t o)
{
    const struct moe_block_q4_0 *b = blk;
    const __m256 d = _mm256_set1_ps(h2f(b->d));
    const __m256i m15 = _mm256_set1_epi32(15), e8 = _mm256_set1_epi32(8);
    UNROLL
    for (int k = 0; k < 2; k++) {
        __m256i v = u8x8(b->qs + 8 * k);
        __m256i lo = _mm256_sub_epi32(_mm256_and_si256(v, m15), e8);
        __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(v, 4), e8);
        put(s, 2 * k, o + 8 * k, _mm256_mul_ps(tof(lo), d));
        put(s, 2 * k + 1, o + 16 + 8 * k, _mm256_mul_ps(tof(hi), d));
    }
}

AVX2_INLINE void blk_q4_1(const void *blk, struct sink *s, int64_t o)
{
    const struct moe_block_q4_1 *b = blk;
    const __m256 d = _mm256_set1_ps(h2f(b->d)), m = _mm256_set1_ps(h2f(b->m));
    const __m256i m15 = _mm256_set1_epi32(15);
    UNROLL
    for (int k = 0; k < 2; k++) {
        __m256i v = u8x8(b->qs + 8 * k);
        put(s, 2 * k, o + 8 * k, _mm256_fmadd_ps(tof(_mm256_and_si256(v, m15)), d, m));
        put(s, 2 * k + 1, o + 16 + 8 * k, _mm256_fmadd_ps(tof(_mm256_srli_epi32(v, 4)), d, m));
    }
}

AVX2_INLINE void blk_q5_0(const void *blk, struct sink *s, int64_t o)
{
    const struct moe_block_q5_0 *b = blk;
    const __m256 d = _mm256_set1_ps(h2f(b->d));
    const __m256i m15 = _mm256_set1_epi32(15), e16 = _mm256_set1_epi32(16);
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    UNROLL
    for (int k = 0; k < 2; k++) {
        __m256i v = u8x8(b->qs + 8 * k);
        __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m15), q5_high(qh, 8 * k));
        __m256i hi = _mm256_or_si256(_mm256_srli_epi32(v, 4), q5_high(qh, 16 + 8 * k));
        put(s, 2 * k, o + 8 * k, _mm256_mul_ps(tof(_mm256_sub_epi32(lo, e16)), d));
        put(s, 2 * k + 1, o + 16 + 8 * k, _mm256_mul_ps(tof(_mm256_sub_epi32(hi, e16)), d));
    }
}

AVX2_INLINE void blk_q5_1(const void *blk, struct sink *s, int64_t o)
{
    const struct moe_block_q5_1 *b = blk;
    const __m256 d = _mm256_set1_ps(h2f(b->d)), m = _mm256_set1_ps(h2f(b->m));
    const __m256i m15 = _mm256_set1_epi32(15);
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    UNROLL
    for (int k = 0; k < 2; k++) {
        __m256i v = u8x8(b->qs + 8 * k);
        __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m15), q5_high(qh, 8 * k));
        __m256i hi = _mm256_or_si256(_mm256_srli_epi32(v, 4), q5_high(qh, 16 + 8 * k));
        put(s, 2 * k, o + 8 * k, _mm256_fmadd_ps(tof(lo), d, m));
        put(s, 2 * k + 1, o + 16 + 8 * k, _mm256_fmadd_ps(tof(hi), d, m));
    }
}

AVX2_INLINE void blk_q8_0(const void *blk, struct sink *s, int64_t o)
{
    const struct moe_block_q8_0 *b = blk;
    const __m256 d = _mm256_set1_ps(h2f(b->d));
    UNROLL
    for (int k = 0; k < 4; k++)
        put(s, k, o + 8 * k, _mm256_mul_ps(tof(i8x8(b->qs + 8 * k)), d));
}

/* ---- 256-element K-quant blocks ------------------------------------------------------------- */

/* The 6-bit scales and mins of the 8 sub-blocks (layout in docs/kernels.md). */
AVX2_INLINE void kq_unpack(const uint8_t *sc, float d, float dmin, float *ds, float *dm)
{
    UNROLL
    for (int j = 0; j < 4; j++) {
        ds[j] = d * (float)(sc[j] & 63);
        dm[j] = -(dmin * (float)(sc[j + 4] & 63));
        ds[j + 4] = d * (float)((sc[j + 8] & 15) | ((sc[j] >> 6) << 4));
        dm[j + 4] = -(dmin * (float)((sc[j + 8] >> 4) | ((sc[j + 4] >> 6) << 4)));
    }
}

AVX2_INLINE void blk_q4_k(const void *blk, struct sink *s, int64_t o)
{
    const struct moe_block_q4_k *b = blk;
    float ds[8], dm[8];
    const __m256i m15 = _mm256_set1_epi32(15);
    kq_unpack(b->scales, h2f(b->d), h2f(b->dmin), ds, dm);
    const uint8_t *q = b->qs;
    UNROLL
    for (int c = 0; c < 4; c++, q += 32, o += 64) {
        const __m256 d0 = _mm256_set1_ps(ds[2 * c]), m0 = _mm256_set1_ps(dm[2 * c]);
        const __m256 d1 = _mm256_set1_ps(ds[2 * c + 1]), m1 = _mm256_set1_ps(dm[2 * c + 1]);
        UNROLL
        for (int k = 0; k < 4; k++) {
            __m256i v = u8x8(q + 8 * k);
            __m256 lo = tof(_mm256_and_si256(v, m15)), hi = tof(_mm256_srli_epi32(v, 4));
            put(s, 2 * (k & 1), o + 8 * k, _mm256_fmadd_ps(lo, d0, m0));
            put(s, 2 * (k & 1) + 1, o + 32 + 8 * k, _mm256_fmadd_ps(hi, d1, m1));
        }
    }
}

AVX2_INLINE void blk_q5_k(const void *blk, struct sink *s, int64_t o)
{
    const struct moe_block_q5_k *b = blk;
    float ds[8], dm[8];
    const __m256i m15 = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
    kq_unpack(b->scales, h2f(b->d), h2f(b->dmin), ds, dm);
    const uint8_t *qh = b->qh, *q = b->qs;
    UNROLL
    for (int c = 0; c < 4; c++, q += 32, o += 64) {
        const __m256 d0 = _mm256_set1_ps(ds[2 * c]), m0 = _mm256_set1_ps(dm[2 * c]);
        const __m256 d1 = _mm256_set1_ps(ds[2 * c + 1]), m1 = _mm256_set1_ps(dm[2 * c + 1]);
        const __m128i sh0 = _mm_cvtsi32_si128(2 * c), sh1 = _mm_cvtsi32_si128(2 * c + 1);
        UNROLL
        for (int k = 0; k < 4; k++) {
            __m256i v = u8x8(q + 8 * k), h = u8x8(qh + 8 * k);
            __m256i h0 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, sh0), one), 4);
            __m256i h1 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, sh1), one), 4);
            __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m15), h0);
            __m256i hi = _mm256_or_si256(_mm256_srli_epi32(v, 4), h1);
            put(s, 2 * (k & 1), o + 8 * k, _mm256_fmadd_ps(tof(lo), d0, m0));
            put(s, 2 * (k & 1) + 1, o + 32 + 8 * k, _mm256_fmadd_ps(tof(hi), d1, m1));
        }
    }
}

/* Q6_K: per 128-value half, 32-value group g takes its low 4 bits from ql[l + 32(g&1)] (low
 * nibble for g<2, high for g>=2) and its top 2 bits from bits 2g..2g+1 of qh[l]. */
AVX2_INLINE void blk_q6_k(const void *blk, struct sink *s, int64_t o)
{
    const struct moe_block_q6_k *b = blk;
    const float d = h2f(b->d);
    float ds[16], dm[16];
    const __m256i m15 = _mm256_set1_epi32(15), m48 = _mm256_set1_epi32(48);
    const uint8_t *ql = b->ql, *qh = b->qh;
    /* (q − 32)·d·sc is computed as q·(d·sc) − 32·(d·sc): one FMA instead of a subtract and a
     * multiply. */
    UNROLL
    for (int i = 0; i < 16; i++) {
        ds[i] = d * (float)b->scales[i];
        dm[i] = -32.0f * ds[i];
    }
    UNROLL
    for (int h = 0; h < 2; h++, ql += 64, qh += 32, o += 128) {
        UNROLL
        for (int k = 0; k < 4; k++) {
            const int is = 8 * h + k / 2;
            __m256i a = u8x8(ql + 8 * k), c = u8x8(ql + 32 + 8 * k), hb = u8x8(qh + 8 * k);
            /* Bits 2g..2g+1 of qh moved straight to bits 4..5. */
            __m256i q1 = _mm256_or_si256(_mm256_and_si256(a, m15),
                                         _mm256_and_si256(_mm256_slli_epi32(hb, 4), m48));
            __m256i q2 = _mm256_or_si256(_mm256_and_si256(c, m15),
                                         _mm256_and_si256(_mm256_slli_epi32(hb, 2), m48));
            __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_and_si256(hb, m48));
            __m256i q4 = _mm256_or_si256(_mm256_srli_epi32(c, 4),
                                         _mm256_and_si256(_mm256_srli_epi32(hb, 2), m48));
            put(s, 0, o + 8 * k,
                _mm256_fmadd_ps(tof(q1), _mm256_broadcast_ss(ds + is), _mm256_broadcast_ss(dm + is)));
            put(s, 1, o + 32 + 8 * k,
                _mm256_fmadd_ps(tof(q2), _mm256_broadcast_ss(ds + is + 2),
                                _mm256_broadcast_ss(dm + is + 2)));
            put(s, 2, o + 64 + 8 * k,
                _mm256_fmadd_ps(tof(q3), _mm256_broadcast_ss(ds + is + 4),
                                _mm256_broadcast_ss(dm + is + 4)));
            put(s, 3, o + 96 + 8 * k,
                _mm256_fmadd_ps(tof(q4), _mm256_broadcast_ss(ds + is + 6),
                                _mm256_broadcast_ss(dm + is + 6)));
        }
    }
}

/* ---- row drivers ---------------------------------------------------------------------------- */

/* One driver per block type, so each gets its own copy of the inlined block function. */
#define ROW_FNS(name, blk, BLCK)                                                           \
    static AVX2 float dot_##name(const uint8_t *row, const float *x, int64_t n)          \
    {                                                                                    \
        const __m256 z = _mm256_setzero_ps();                                            \
        struct sink s = {x, NULL, {z, z, z, z}};                                         \
        for (int64_t i = 0; i < n / (BLCK); i++)                                         \
            blk(row + (size_t)i * sizeof(struct moe_block_##name), &s, i * (BLCK));      \
        return hsum(_mm256_add_ps(_mm256_add_ps(s.acc[0], s.acc[1]),                     \
                                  _mm256_add_ps(s.acc[2], s.acc[3])));                   \
    }                                                                                    \
    static AVX2 void dec_##name(const uint8_t *row, float *dst, int64_t n)               \
    {                                                                                    \
        const __m256 z = _mm256_setzero_ps();                                            \
        struct sink s = {NULL, dst, {z, z, z, z}};                                       \
        for (int64_t i = 0; i < n / (BLCK); i++)                                         \
            blk(row + (size_t)i * sizeof(struct moe_block_##name), &s, i * (BLCK));      \
    }

ROW_FNS(q4_0, blk_q4_0, MOE_QK)
ROW_FNS(q4_1, blk_q4_1, MOE_QK)
ROW_FNS(q5_0, blk_q5_0, MOE_QK)
ROW_FNS(q5_1, blk_q5_1, MOE_QK)
ROW_FNS(q8_0, blk_q8_0, MOE_QK)
ROW_FNS(q4_k, blk_q4_k, MOE_QK_K)
ROW_FNS(q5_k, blk_q5_k, MOE_QK_K)
ROW_FNS(q6_k, blk_q6_k, MOE_QK_K)

static AVX2 float dot_f32(const float *w, const float *x, int64_t n)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    float sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++)
        sum += w[i] * x[i];
    return sum;
}

AVX2_INLINE __m256 ld_f16x8(const uint8_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

AVX2_INLINE __m256 ld_bf16x8(const uint8_t *p)
{
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

static AVX2 float bf16_scalar(const uint8_t *p)
{
    uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* F16 and BF16 rows differ only in how 8 values (ld8) or one (ld1) widen to f32, so one body
 * serves both; a macro rather than a loader argument keeps the loads inlined. */
#define HALF_KERNELS(name, ld8, ld1)                                                          \
    static AVX2 float dot_##name(const uint8_t *w, const float *x, int64_t n)                \
    {                                                                                        \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                          \
        int64_t i = 0;                                                                       \
        for (; i + 32 <= n; i += 32) {                                                       \
            a0 = _mm256_fmadd_ps(ld8(w + 2 * i), _mm256_loadu_ps(x + i), a0);               \
            a1 = _mm256_fmadd_ps(ld8(w + 2 * i + 16), _mm256_loadu_ps(x + i + 8), a1);      \
            a2 = _mm256_fmadd_ps(ld8(w + 2 * i + 32), _mm256_loadu_ps(x + i + 16), a2);     \
            a3 = _mm256_fmadd_ps(ld8(w + 2 * i + 48), _mm256_loadu_ps(x + i + 24), a3);     \
        }                                                                                    \
        for (; i + 8 <= n; i += 8)                                                           \
            a0 = _mm256_fmadd_ps(ld8(w + 2 * i), _mm256_loadu_ps(x + i), a0);               \
        float sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));       \
        for (; i < n; i++)                                                                   \
            sum += ld1(w + 2 * i) * x[i];                                                    \
        return sum;                                                                          \
    }                                                                                        \
                                                                                             \
    static AVX2 void dec_##name(const uint8_t *w, float *dst, int64_t n)                     \
    {                                                                                        \
        int64_t i = 0;                                                                       \
        for (; i + 8 <= n; i += 8)                                                           \
            _mm256_storeu_ps(dst + i, ld8(w + 2 * i));                                       \
        for (; i < n; i++)                                                                   \
            dst[i] = ld1(w + 2 * i);                                                         \
    }
HALF_KERNELS(f16, ld_f16x8, half)
HALF_KERNELS(bf16, ld_bf16x8, bf16_scalar)

static AVX2 float dot_f32_row(const void *row, const float *x, int64_t n)
{
    return dot_f32(row, x, n);
}

#define DOT_FN(name)                                                                         \
    static AVX2 float dotv_##name(const void *row, const float *x, int64_t n)               \
    {                                                                                        \
        return dot_##name(row, x, n);                                                        \
    }
DOT_FN(f16)
DOT_FN(bf16)
DOT_FN(q4_0)
DOT_FN(q4_1)
DOT_FN(q5_0)
DOT_FN(q5_1)
DOT_FN(q8_0)
DOT_FN(q4_k)
DOT_FN(q5_k)
DOT_FN(q6_k)

moe_dot_fn moe_dot_fn_avx2(uint32_t type)
{
    switch (type) {
    case MOE_TYPE_F32: return dot_f32_row;
    case MOE_TYPE_F16: return dotv_f16;
    case MOE_TYPE_BF16: return dotv_bf16;
    case MOE_TYPE_Q4_0: return dotv_q4_0;
    case MOE_TYPE_Q4_1: return dotv_q4_1;
    case MOE_TYPE_Q5_0: return dotv_q5_0;
    case MOE_TYPE_Q5_1: return dotv_q5_1;
    case MOE_TYPE_Q8_0: return dotv_q8_0;
    case MOE_TYPE_Q4_K: return dotv_q4_k;
    case MOE_TYPE_Q5_K: return dotv_q5_k;
    case MOE_TYPE_Q6_K: return dotv_q6_k;
    }
    return NULL;
}

int moe_decode_avx2(uint32_t type, const void *src, float *dst, int64_t n)
{
    const uint8_t *w = src;
    switch (type) {
    case MOE_TYPE_F32: memcpy(dst, src, (size_t)n * sizeof(float)); return 1;
    case MOE_TYPE_F16: dec_f16(w, dst, n); return 1;
    case MOE_TYPE_BF16: dec_bf16(w, dst, n); return 1;
    case MOE_TYPE_Q4_0: dec_q4_0(w, dst, n); return 1;
    case MOE_TYPE_Q4_1: dec_q4_1(w, dst, n); return 1;
    case MOE_TYPE_Q5_0: dec_q5_0(w, dst, n); return 1;
    case MOE_TYPE_Q5_1: dec_q5_1(w, dst, n); return 1;
    case MOE_TYPE_Q8_0: dec_q8_0(w, dst, n); return 1;
    case MOE_TYPE_Q4_K: dec_q4_k(w, dst, n); return 1;
    case MOE_TYPE_Q5_K: dec_q5_k(w, dst, n); return 1;
    case MOE_TYPE_Q6_K: dec_q6_k(w, dst, n); return 1;
    }
    return 0;
}

/* Up to 4 decoded rows against one x: each x vector is loaded once for all rows. */
AVX2 void moe_dot_rows_f32_avx2(const float *W, int64_t ldw, int nr, const float *x, int64_t n,
                                float *out)
{
    if (nr != 4) {
        for (int i = 0; i < nr; i++)
            out[i] = dot_f32(W + i * ldw, x, n);
        return;
    }
    const float *w0 = W, *w1 = W + ldw, *w2 = W + 2 * ldw, *w3 = W + 3 * ldw;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), x0, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), x0, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), x0, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), x0, a3);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i + 8), x1, b0);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i + 8), x1, b1);
        b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i + 8), x1, b2);
        b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i + 8), x1, b3);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 x0 = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), x0, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), x0, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), x0, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), x0, a3);
    }
    out[0] = hsum(_mm256_add_ps(a0, b0));
    out[1] = hsum(_mm256_add_ps(a1, b1));
    out[2] = hsum(_mm256_add_ps(a2, b2));
    out[3] = hsum(_mm256_add_ps(a3, b3));
    for (; i < n; i++) {
        out[0] += w0[i] * x[i];
        out[1] += w1[i] * x[i];
        out[2] += w2[i] * x[i];
        out[3] += w3[i] * x[i];
    }
}

/* The matmul micro-kernel: 4 decoded rows (stride ldw) times 3 tokens (stride ldx) over n
 * elements, 12 accumulators in registers, so each weight and activation vector loaded feeds 3 or
 * 4 FMAs and the loop runs at FMA throughput. Results go to out[token * 4 + row]. */
AVX2 void moe_gemm_4x3_f32_avx2(const float *W, int64_t ldw, const float *X, int64_t ldx,
                                int64_t n, float *out)
{
    const float *w0 = W, *w1 = W + ldw, *w2 = W + 2 * ldw, *w3 = W + 3 * ldw;
    const float *x0 = X, *x1 = X + ldx, *x2 = X + 2 * ldx;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
    __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    __m256 c20 = c00, c21 = c00, c22 = c00, c23 = c00;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a0 = _mm256_loadu_ps(x0 + i), a1 = _mm256_loadu_ps(x1 + i);
        __m256 a2 = _mm256_loadu_ps(x2 + i), w;
        w = _mm256_loadu_ps(w0 + i);
        c00 = _mm256_fmadd_ps(w, a0, c00);
        c10 = _mm256_fmadd_ps(w, a1, c10);
        c20 = _mm256_fmadd_ps(w, a2, c20);
        w = _mm256_loadu_ps(w1 + i);
        c01 = _mm256_fmadd_ps(w, a0, c01);
        c11 = _mm256_fmadd_ps(w, a1, c11);
        c21 = _mm256_fmadd_ps(w, a2, c21);
        w = _mm256_loadu_ps(w2 + i);
        c02 = _mm256_fmadd_ps(w, a0, c02);
        c12 = _mm256_fmadd_ps(w, a1, c12);
        c22 = _mm256_fmadd_ps(w, a2, c22);
        w = _mm256_loadu_ps(w3 + i);
        c03 = _mm256_fmadd_ps(w, a0, c03);
        c13 = _mm256_fmadd_ps(w, a1, c13);
        c23 = _mm256_fmadd_ps(w, a2, c23);
    }
    out[0] = hsum(c00), out[1] = hsum(c01), out[2] = hsum(c02), out[3] = hsum(c03);
    out[4] = hsum(c10), out[5] = hsum(c11), out[6] = hsum(c12), out[7] = hsum(c13);
    out[8] = hsum(c20), out[9] = hsum(c21), out[10] = hsum(c22), out[11] = hsum(c23);
    for (; i < n; i++) {
        for (int r = 0; r < 4; r++) {
            float wv = W[r * ldw + i];
            out[r] += wv * x0[i];
            out[4 + r] += wv * x1[i];
            out[8 + r] += wv * x2[i];
        }
    }
}

#endif

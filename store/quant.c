/* Quantized block formats: reference (scalar) dequantization and quantization.
 *
 * The layouts are ggml's, defined in store/blocks.h (docs/kernels.md has the formulas).
 * Everything here is written for clarity first: the SIMD kernels in worker/cpu/ are tested
 * against these functions, and moectl mkmodel uses the quantizers to write model files, so
 * determinism matters more than speed. Quantizers never read uninitialised memory and never divide by zero: an all-zero block
 * quantizes to an all-zero block. */
#include "store/quant.h"

#include <math.h>
#include <string.h>

#include "store/blocks.h"
#include "store/err.h"
#include "store/ggml_type.h"

/* ---- half and bfloat16 ---------------------------------------------------------------------- */

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float moe_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t e = (h >> 10) & 0x1f;
    uint32_t m = h & 0x3ff;

    if (e == 0) {
        /* Zero or subnormal: m * 2^-24 is exact in float32. */
        float v = (float)m * 0x1p-24f;
        return bits_f32(f32_bits(v) | sign);
    }
    if (e == 31)
        return bits_f32(sign | 0x7f800000u | (m << 13));
    return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

uint16_t moe_f32_to_f16(float f)
{
    uint32_t x = f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7fffffff;
    uint32_t r, rem;

    if (ax > 0x7f800000u) /* NaN: keep it a (quiet) NaN, keep the top payload bits */
        return (uint16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff));
    if (ax >= 0x477ff000u) /* >= 65520 rounds to infinity (65504 is the largest half) */
        return (uint16_t)(sign | 0x7c00);
    if (ax < 0x38800000u) {
        /* Below the smallest normal half (2^-14): a subnormal result, m * 2^-24. Exactly 2^-25
         * is a tie between 0 and the smallest subnormal and goes to the even one, 0. */
        if (ax <= 0x33000000u)
            return (uint16_t)sign;
        uint32_t e = ax >> 23;
        uint32_t m = (ax & 0x7fffff) | 0x800000;
        uint32_t shift = 126 - e; /* 14..24 */
        uint32_t half = 1u << (shift - 1);
        r = m >> shift;
        rem = m & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1)))
            r++; /* may carry into the exponent: 0x400 is the smallest normal, as it should be */
        return (uint16_t)(sign | r);
    }
    /* Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits. A carry
     * out of the mantissa correctly bumps the exponent. */
    r = (ax - 0x38000000u) >> 13;
    rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1)))
        r++;
    return (uint16_t)(sign | r);
}

float moe_bf16_to_f32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

uint16_t moe_f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000u) /* NaN: truncating could make it infinity; force quiet */
        return (uint16_t)((x >> 16) | 0x40);
    /* Round to nearest even; overflow past the largest bf16 lands on infinity by itself. */
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

/* ---- little helpers ------------------------------------------------------------------------- */

static float ld_f16(const uint8_t *p)
{
    return moe_f16_to_f32((uint16_t)(p[0] | (p[1] << 8)));
}

static void st_f16(uint8_t *p, float v)
{
    uint16_t h = moe_f32_to_f16(v);
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

/* Round half away from zero, independent of the FPU rounding mode, without a libm call (this is
 * the quantizers' inner loop). Out-of-range values and NaN saturate instead of being undefined. */
static int near_int(float v)
{
    if (!(v >= -1e9f))
        v = -1e9f;
    if (!(v <= 1e9f))
        v = 1e9f;
    return (int)(v >= 0 ? v + 0.5f : v - 0.5f);
}

static int clampi(int v, int lo, int hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block. Sub-blocks 0..3 keep theirs
 * in the low 6 bits of s[j] and s[j+4]; 4..7 split theirs between a nibble of s[j+4] and the top
 * two bits of s[j-4] (scale) and s[j] (min). */
static void kq_scale_min(const uint8_t *s, int j, int *sc, int *m)
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

static void deq_q4_0(const void *blk, float *y)
{
    const struct moe_block_q4_0 *b = blk;
    float d = moe_f16_to_f32(b->d);
    const uint8_t *qs = b->qs;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 15) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void deq_q4_1(const void *blk, float *y)
{
    const struct moe_block_q4_1 *b = blk;
    float d = moe_f16_to_f32(b->d), m = moe_f16_to_f32(b->m);
    const uint8_t *qs = b->qs;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 15) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

/* The Q5_0/Q5_1 qh bytes as the little-endian u32 they are. */
static uint32_t ld_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void st_u32(uint8_t *p, uint32_t v)
{
    for (int k = 0; k < 4; k++)
        p[k] = (uint8_t)(v >> (8 * k));
}

static void deq_q5_0(const void *blk, float *y)
{
    const struct moe_block_q5_0 *b = blk;
    float d = moe_f16_to_f32(b->d);
    uint32_t qh = ld_u32(b->qh);
    const uint8_t *qs = b->qs;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
        int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        y[j] = (float)(lo - 16) * d;
        y[j + 16] = (float)(hi - 16) * d;
    }
}

static void deq_q5_1(const void *blk, float *y)
{
    const struct moe_block_q5_1 *b = blk;
    float d = moe_f16_to_f32(b->d), m = moe_f16_to_f32(b->m);
    uint32_t qh = ld_u32(b->qh);
    const uint8_t *qs = b->qs;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
        int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        y[j] = (float)lo * d + m;
        y[j + 16] = (float)hi * d + m;
    }
}

static void deq_q8_0(const void *blk, float *y)
{
    const struct moe_block_q8_0 *b = blk;
    float d = moe_f16_to_f32(b->d);
    const int8_t *qs = b->qs;
    for (int j = 0; j < 32; j++)
        y[j] = (float)qs[j] * d;
}

static void deq_q4_k(const void *blk, float *y)
{
    const struct moe_block_q4_k *b = blk;
    float d = moe_f16_to_f32(b->d), dmin = moe_f16_to_f32(b->dmin);
    const uint8_t *s = b->scales, *q = b->qs;
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

static void deq_q5_k(const void *blk, float *y)
{
    const struct moe_block_q5_k *b = blk;
    float d = moe_f16_to_f32(b->d), dmin = moe_f16_to_f32(b->dmin);
    const uint8_t *s = b->scales, *qh = b->qh, *q = b->qs;
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

static void deq_q6_k(const void *blk, float *y)
{
    const struct moe_block_q6_k *b = blk;
    const uint8_t *ql = b->ql, *qh = b->qh;
    const int8_t *sc = b->scales;
    float d = moe_f16_to_f32(b->d);
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

/* ---- quantization: 32-element blocks -------------------------------------------------------- */

/* Q4_0/Q5_0 map the value of largest magnitude onto the extreme code -8 (-16), so that value is
 * exact and the asymmetric code range is used on the side that needs it. */
static void q_sym(const float *x, float *d_out, float *id_out, int nhalf)
{
    float amax = 0, vmax = 0;
    for (int j = 0; j < 32; j++) {
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            vmax = x[j];
        }
    }
    float d = vmax / (float)-nhalf;
    d = moe_f16_to_f32(moe_f32_to_f16(d)); /* quantize against the scale that is stored */
    *d_out = d;
    *id_out = d != 0 ? 1.0f / d : 0;
}

static void qnt_q4_0(const float *x, void *blk)
{
    struct moe_block_q4_0 *b = blk;
    float d, id;
    q_sym(x, &d, &id, 8);
    b->d = moe_f32_to_f16(d);
    for (int j = 0; j < 16; j++) {
        int lo = clampi(near_int(x[j] * id) + 8, 0, 15);
        int hi = clampi(near_int(x[j + 16] * id) + 8, 0, 15);
        b->qs[j] = (uint8_t)(lo | hi << 4);
    }
}

static void qnt_q5_0(const float *x, void *blk)
{
    struct moe_block_q5_0 *b = blk;
    float d, id;
    uint32_t qh = 0;
    q_sym(x, &d, &id, 16);
    b->d = moe_f32_to_f16(d);
    for (int j = 0; j < 16; j++) {
        int lo = clampi(near_int(x[j] * id) + 16, 0, 31);
        int hi = clampi(near_int(x[j + 16] * id) + 16, 0, 31);
        b->qs[j] = (uint8_t)((lo & 15) | (hi & 15) << 4);
        qh |= (uint32_t)(lo >> 4) << j | (uint32_t)(hi >> 4) << (j + 16);
    }
    st_u32(b->qh, qh);
}

/* Q4_1/Q5_1: min and step from the block's range; codes are rounded against the stored (half
 * precision) min and step so that rounding the header does not shift every value. */
static void q_affine(const float *x, int nmax, float *d_out, float *m_out)
{
    float mn = x[0], mx = x[0];
    for (int j = 1; j < 32; j++) {
        mn = x[j] < mn ? x[j] : mn;
        mx = x[j] > mx ? x[j] : mx;
    }
    *m_out = moe_f16_to_f32(moe_f32_to_f16(mn));
    *d_out = moe_f16_to_f32(moe_f32_to_f16((mx - mn) / (float)nmax));
}

static void qnt_q4_1(const float *x, void *blk)
{
    struct moe_block_q4_1 *b = blk;
    float d, m;
    q_affine(x, 15, &d, &m);
    float id = d != 0 ? 1.0f / d : 0;
    b->d = moe_f32_to_f16(d);
    b->m = moe_f32_to_f16(m);
    for (int j = 0; j < 16; j++) {
        int lo = clampi(near_int((x[j] - m) * id), 0, 15);
        int hi = clampi(near_int((x[j + 16] - m) * id), 0, 15);
        b->qs[j] = (uint8_t)(lo | hi << 4);
    }
}

static void qnt_q5_1(const float *x, void *blk)
{
    struct moe_block_q5_1 *b = blk;
    float d, m;
    uint32_t qh = 0;
    q_affine(x, 31, &d, &m);
    float id = d != 0 ? 1.0f / d : 0;
    b->d = moe_f32_to_f16(d);
    b->m = moe_f32_to_f16(m);
    for (int j = 0; j < 16; j++) {
        int lo = clampi(near_int((x[j] - m) * id), 0, 31);
        int hi = clampi(near_int((x[j + 16] - m) * id), 0, 31);
        b->qs[j] = (uint8_t)((lo & 15) | (hi & 15) << 4);
        qh |= (uint32_t)(lo >> 4) << j | (uint32_t)(hi >> 4) << (j + 16);
    }
    st_u32(b->qh, qh);
}

static void qnt_q8_0(const float *x, void *blk)
{
    struct moe_block_q8_0 *b = blk;
    float amax = 0;
    for (int j = 0; j < 32; j++)
        amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    float d = moe_f16_to_f32(moe_f32_to_f16(amax / 127.0f));
    float id = d != 0 ? 1.0f / d : 0;
    b->d = moe_f32_to_f16(d);
    for (int j = 0; j < 32; j++)
        b->qs[j] = (int8_t)clampi(near_int(x[j] * id), -127, 127);
}

/* ---- quantization: K-quants ----------------------------------------------------------------- */

/* Fits x[0..n) ≈ a·q − b with integer codes q in [0, nmax] and b ≥ 0 (the stored min is
 * subtracted and unsigned), minimising the squared error. Tries a fan of candidate steps around
 * (max − min)/nmax; for each it rounds the codes and then solves the 2x2 least-squares problem
 * for (a, b) given those codes, which is what makes the search pay off: the best step is rarely the
 * naive range/nmax. The error of each candidate comes from the sums alone (the residual of a
 * least-squares fit), so each candidate costs one pass over x. */
/* n is at most 32 (one sub-block). */
static void fit_affine(const float *x, int n, int nmax, float *a_out, float *b_out)
{
    float mn = x[0], mx = x[0];
    double sx = 0, sxx = 0;
    for (int i = 0; i < n; i++) {
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
        sx += x[i];
        sxx += (double)x[i] * x[i];
    }
    if (mn > 0)
        mn = 0; /* b = -min must not go negative */
    *a_out = (mx - mn) / (float)nmax;
    *b_out = -mn;
    if (mx <= mn)
        return;
    /* The candidate loop is written to vectorise: codes first (x − mn ≥ 0, so adding 0.5 and
     * truncating rounds), then integer sums, then Σqx in four partial sums. */
    float xs[32];
    for (int i = 0; i < n; i++)
        xs[i] = x[i] - mn;
    double best_err = INFINITY;
    for (int step = -6; step <= 14; step++) {
        float iscale = ((float)nmax + 0.1f * (float)step) / (mx - mn);
        int q[32], sq = 0, sqq = 0;
        float p[4] = {0, 0, 0, 0};
        for (int i = 0; i < n; i++) {
            int v = (int)(xs[i] * iscale + 0.5f);
            q[i] = v < nmax ? v : nmax;
        }
        for (int i = 0; i < n; i++) {
            sq += q[i];
            sqq += q[i] * q[i];
        }
        for (int i = 0; i < n; i += 4)
            for (int k = 0; k < 4; k++)
                p[k] += (float)q[i + k] * x[i + k];
        double sqx = (double)((p[0] + p[1]) + (p[2] + p[3]));
        /* Least squares for x ≈ a·q + c (c = −b): the normal equations. */
        double det = (double)n * sqq - (double)sq * sq;
        double a, c, err;
        if (det <= 0)
            continue; /* all codes equal: this step says nothing about the slope */
        a = ((double)n * sqx - (double)sq * sx) / det;
        c = ((double)sqq * sx - (double)sq * sqx) / det;
        if (c > 0) { /* the min must stay ≤ 0: refit the step alone with c = 0 */
            c = 0;
            a = sqx / sqq;
        }
        if (a <= 0)
            continue;
        err = sxx - 2 * a * sqx - 2 * c * sx + a * a * sqq + 2 * a * c * sq + (double)n * c * c;
        if (err < best_err) {
            best_err = err;
            *a_out = (float)a;
            *b_out = (float)-c;
        }
    }
}

/* Packs the 6-bit scales and mins of the 8 sub-blocks the way kq_scale_min() reads them. */
static void kq_pack_scales(const int *sc, const int *m, uint8_t *s)
{
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        s[j + 4] = (uint8_t)((m[j] & 63) | ((m[j + 4] >> 4) << 6));
        s[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
    }
}

/* Shared by Q4_K (nmax 15) and Q5_K (nmax 31): per sub-block fit, then the 8 steps and 8 mins are
 * themselves quantized to 6 bits against the block's d and dmin, and the codes are recomputed
 * against the final (stored) step and min of each sub-block. *d_h and *dmin_h receive the
 * block's d and dmin (half bits), scales its 12 packed scale bytes, L the codes. */
static void kq_quantize(const float *x, int nmax, uint16_t *d_h, uint16_t *dmin_h,
                        uint8_t *scales, int *L)
{
    float a[8], bmin[8], amax = 0, bmax = 0;
    for (int j = 0; j < 8; j++) {
        fit_affine(x + 32 * j, 32, nmax, &a[j], &bmin[j]);
        amax = a[j] > amax ? a[j] : amax;
        bmax = bmin[j] > bmax ? bmin[j] : bmax;
    }
    float d = moe_f16_to_f32(moe_f32_to_f16(amax / 63.0f));
    float dmin = moe_f16_to_f32(moe_f32_to_f16(bmax / 63.0f));
    int sc[8], m[8];
    for (int j = 0; j < 8; j++) {
        sc[j] = d > 0 ? clampi(near_int(a[j] / d), 0, 63) : 0;
        m[j] = dmin > 0 ? clampi(near_int(bmin[j] / dmin), 0, 63) : 0;
    }
    *d_h = moe_f32_to_f16(d);
    *dmin_h = moe_f32_to_f16(dmin);
    kq_pack_scales(sc, m, scales);
    for (int j = 0; j < 8; j++) {
        float step = d * (float)sc[j], off = dmin * (float)m[j];
        for (int i = 0; i < 32; i++)
            L[32 * j + i] = step > 0 ? clampi(near_int((x[32 * j + i] + off) / step), 0, nmax) : 0;
    }
}

static void qnt_q4_k(const float *x, void *blk)
{
    struct moe_block_q4_k *b = blk;
    int L[256];
    uint16_t d, dmin;
    kq_quantize(x, 15, &d, &dmin, b->scales, L);
    b->d = d;
    b->dmin = dmin;
    uint8_t *q = b->qs;
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            q[32 * c + l] = (uint8_t)(L[64 * c + l] | L[64 * c + 32 + l] << 4);
}

static void qnt_q5_k(const float *x, void *blk)
{
    struct moe_block_q5_k *b = blk;
    int L[256];
    uint16_t d, dmin;
    kq_quantize(x, 31, &d, &dmin, b->scales, L);
    b->d = d;
    b->dmin = dmin;
    uint8_t *qh = b->qh, *q = b->qs;
    memset(qh, 0, sizeof b->qh);
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            int lo = L[64 * c + l], hi = L[64 * c + 32 + l];
            q[32 * c + l] = (uint8_t)((lo & 15) | (hi & 15) << 4);
            qh[l] |= (uint8_t)(((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
        }
    }
}

/* Fits x[0..16) ≈ s·q with q in [−32, 31] and a signed step s, minimising the squared error.
 * The sign lets the extreme value use the longer negative side of the code range. Candidates
 * map the value of largest magnitude to around −32; each is refined by the least-squares step
 * for its codes, whose error is Σx² − (Σqx)²/Σq², so the best candidate maximises that ratio. */
static float fit_signed16(const float *x)
{
    float amax = 0, vmax = 0;
    for (int i = 0; i < 16; i++) {
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            vmax = x[i];
        }
    }
    if (amax == 0)
        return 0;
    float best_s = vmax / -32.0f;
    double best = -1;
    for (int step = -9; step <= 9; step++) {
        float iscale = -(32.0f + 0.1f * (float)step) / vmax;
        int q[16], sqq = 0;
        float p[4] = {0, 0, 0, 0};
        /* |x·iscale| < 33 (x is bounded by vmax), so offsetting by 32.5 and truncating rounds
         * without overflow; the integer clamp keeps the loop branch-free so it vectorises. */
        for (int i = 0; i < 16; i++) {
            int v = (int)(x[i] * iscale + 32.5f) - 32;
            v = v < -32 ? -32 : v;
            q[i] = v > 31 ? 31 : v;
        }
        for (int i = 0; i < 16; i++)
            sqq += q[i] * q[i];
        for (int i = 0; i < 16; i += 4)
            for (int k = 0; k < 4; k++)
                p[k] += (float)q[i + k] * x[i + k];
        double sqx = (double)((p[0] + p[1]) + (p[2] + p[3]));
        if (sqq == 0)
            continue;
        if (sqx * sqx / sqq > best) {
            best = sqx * sqx / sqq;
            best_s = (float)(sqx / sqq);
        }
    }
    return best_s;
}

static void qnt_q6_k(const float *x, void *blk)
{
    struct moe_block_q6_k *b = blk;
    float s[16], smax = 0, svmax = 0;
    for (int j = 0; j < 16; j++) {
        s[j] = fit_signed16(x + 16 * j);
        if (fabsf(s[j]) > smax) {
            smax = fabsf(s[j]);
            svmax = s[j];
        }
    }
    /* The 16 steps become int8 multiples of d; the largest maps to −128 for the same reason the
     * codes are signed. */
    float d = moe_f16_to_f32(moe_f32_to_f16(svmax / -128.0f));
    int8_t *scales = b->scales;
    int L[256];
    for (int j = 0; j < 16; j++) {
        int sc = d != 0 ? clampi(near_int(s[j] / d), -128, 127) : 0;
        scales[j] = (int8_t)sc;
        float step = d * (float)sc;
        for (int i = 0; i < 16; i++)
            L[16 * j + i] = step != 0 ? clampi(near_int(x[16 * j + i] / step), -32, 31) + 32 : 32;
    }
    b->d = moe_f32_to_f16(d);
    uint8_t *ql = b->ql, *qh = b->qh;
    for (int half = 0; half < 2; half++, ql += 64, qh += 32) {
        const int *Lh = L + 128 * half;
        for (int l = 0; l < 32; l++) {
            int q1 = Lh[l], q2 = Lh[l + 32], q3 = Lh[l + 64], q4 = Lh[l + 96];
            ql[l] = (uint8_t)((q1 & 15) | (q3 & 15) << 4);
            ql[l + 32] = (uint8_t)((q2 & 15) | (q4 & 15) << 4);
            qh[l] = (uint8_t)((q1 >> 4) | (q2 >> 4) << 2 | (q3 >> 4) << 4 | (q4 >> 4) << 6);
        }
    }
}

/* ---- dispatch ------------------------------------------------------------------------------ */

/* One row per block type: its reference decoder and encoder side by side, so a new type cannot
 * be added to one direction and forgotten in the other. */
struct block_codec {
    uint32_t type;
    void (*deq)(const void *b, float *y);
    void (*qnt)(const float *x, void *b);
};

static const struct block_codec CODECS[] = {
    {MOE_TYPE_Q4_0, deq_q4_0, qnt_q4_0}, {MOE_TYPE_Q4_1, deq_q4_1, qnt_q4_1},
    {MOE_TYPE_Q5_0, deq_q5_0, qnt_q5_0}, {MOE_TYPE_Q5_1, deq_q5_1, qnt_q5_1},
    {MOE_TYPE_Q8_0, deq_q8_0, qnt_q8_0}, {MOE_TYPE_Q4_K, deq_q4_k, qnt_q4_k},
    {MOE_TYPE_Q5_K, deq_q5_k, qnt_q5_k}, {MOE_TYPE_Q6_K, deq_q6_k, qnt_q6_k},
};

static const struct block_codec *codec_find(uint32_t type)
{
    for (size_t i = 0; i < sizeof CODECS / sizeof CODECS[0]; i++)
        if (CODECS[i].type == type)
            return &CODECS[i];
    return NULL;
}

int moe_dequantize(uint32_t type, const void *src, float *dst, int64_t n)
{
    const struct moe_type_info *t = moe_type_get(type);
    const uint8_t *p = src;

    if (!t || !t->compute || n < 0 || n % t->blck)
        return MOE_EUNSUPPORTED;
    switch (type) {
    case MOE_TYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return 0;
    case MOE_TYPE_F16:
        for (int64_t i = 0; i < n; i++)
            dst[i] = ld_f16(p + 2 * i);
        return 0;
    case MOE_TYPE_BF16:
        for (int64_t i = 0; i < n; i++)
            dst[i] = moe_bf16_to_f32((uint16_t)(p[2 * i] | (p[2 * i + 1] << 8)));
        return 0;
    }
    const struct block_codec *c = codec_find(type);
    if (!c)
        return MOE_EUNSUPPORTED;
    for (int64_t i = 0; i < n / t->blck; i++)
        c->deq(p + (size_t)i * t->size, dst + i * t->blck);
    return 0;
}

int moe_quantize(uint32_t type, const float *src, void *dst, int64_t n)
{
    const struct moe_type_info *t = moe_type_get(type);
    uint8_t *p = dst;

    if (!t || !t->compute || n < 0 || n % t->blck)
        return MOE_EUNSUPPORTED;
    switch (type) {
    case MOE_TYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return 0;
    case MOE_TYPE_F16:
        for (int64_t i = 0; i < n; i++)
            st_f16(p + 2 * i, src[i]);
        return 0;
    case MOE_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = moe_f32_to_bf16(src[i]);
            p[2 * i] = (uint8_t)(h & 0xff);
            p[2 * i + 1] = (uint8_t)(h >> 8);
        }
        return 0;
    }
    const struct block_codec *c = codec_find(type);
    if (!c)
        return MOE_EUNSUPPORTED;
    for (int64_t i = 0; i < n / t->blck; i++)
        c->qnt(src + i * t->blck, p + (size_t)i * t->size);
    return 0;
}

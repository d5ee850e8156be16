/* Random weight blocks for moectl mkmodel, written directly in their ggml block formats.
 *
 * Quantizing float tensors would take minutes for the real-shape presets, so quantized blocks
 * are generated as their stored parts: quantized levels drawn from a discretized normal
 * distribution and block/sub-block scales chosen so that the dequantized values have the
 * tensor's intended standard deviation (with some per-block variation, as real blocks have).
 * Every generation block draws from its own counter-based stream, seeded by (tensor key, block
 * index), so the bytes never depend on how blocks are spread over threads. */
#include <math.h>
#include <string.h>

#include "cli/mkmodel.h"
#include "store/blocks.h"
#include "store/err.h"
#include "store/ggml_type.h"
#include "store/quant.h"

/* z quantiles of the standard normal at (i + 0.5) / 65536: a uniform 16-bit draw becomes a
 * normal sample by one lookup. */
static float zt16[65536];

/* Discretized normal levels indexed by one random byte, with their mean and deviation. */
struct level_table {
    int8_t v[256];
    float mean, std;
};
static struct level_table t_q4;  /* Q4_K nibbles, 0..15 centred near 7.5 */
static struct level_table t_q5;  /* Q5_0 levels minus 16, -16..15 */
static struct level_table t_q6;  /* Q6_K levels minus 32, -32..31 */
static struct level_table t_q8;  /* Q8_0 levels, -127..127 */
/* Two Q4_K nibbles per 16-bit draw: low byte picks the low nibble, high byte the high one. */
static uint8_t t_q4_pair[65536];

static double norm_cdf(double z)
{
    return 0.5 * erfc(-z / sqrt(2.0));
}

static void level_table_init(struct level_table *t, double centre, double spread, int lo, int hi)
{
    double s = 0, s2 = 0;
    for (int i = 0; i < 256; i++) {
        double x = floor(centre + 0.5 + zt16[i * 256 + 128] * spread);
        int v = x < lo ? lo : x > hi ? hi : (int)x;
        t->v[i] = (int8_t)v;
        s += v;
        s2 += (double)v * v;
    }
    t->mean = (float)(s / 256);
    t->std = (float)sqrt(s2 / 256 - (s / 256) * (s / 256));
}

void mk_tables_init(void)
{
    /* Newton's method on the CDF, sweeping outwards from the median so that each quantile
     * starts from its neighbour's and converges in a few steps. */
    double z = 0;
    for (int i = 32768; i < 65536; i++) {
        double p = (i + 0.5) / 65536;
        for (int it = 0; it < 6; it++) {
            double pdf = exp(-0.5 * z * z) / sqrt(2 * M_PI);
            double step = (norm_cdf(z) - p) / pdf;
            z -= step;
            if (fabs(step) < 1e-12)
                break;
        }
        zt16[i] = (float)z;
        zt16[65535 - i] = (float)-z;
    }
    level_table_init(&t_q4, 7.5, 2.7, 0, 15);
    level_table_init(&t_q5, 0, 5.5, -16, 15);
    level_table_init(&t_q6, 0, 10, -32, 31);
    level_table_init(&t_q8, 0, 36, -127, 127);
    for (int i = 0; i < 65536; i++)
        t_q4_pair[i] = (uint8_t)(t_q4.v[i & 255] | t_q4.v[i >> 8] << 4);
}

/* A splitmix64 stream. */
struct rng {
    uint64_t s;
};

static inline uint64_t rng_next(struct rng *r)
{
    return mk_mix64(r->s += 0x9e3779b97f4a7c15ull);
}

/* Uniform in [0, 1). */
static inline float rng_unit(struct rng *r)
{
    return (float)(rng_next(r) >> 40) * (1.0f / 16777216.0f);
}

/* A multiplicative wobble for block and sub-block scales, uniform in [lo, hi] up to a factor
 * that makes its mean square 1, so that it spreads the scales without inflating the
 * tensor's deviation. */
static inline float jitter(struct rng *r, float lo, float hi)
{
    float rms = sqrtf((lo * lo + lo * hi + hi * hi) / 3);
    return (lo + (hi - lo) * rng_unit(r)) / rms;
}

/* n must be a multiple of 8 (every caller's is). */
static inline void rng_bytes(struct rng *r, uint8_t *out, size_t n)
{
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = rng_next(r);
        memcpy(out + i, &v, 8);
    }
}

static inline void put_f16(uint8_t *p, float v)
{
    uint16_t h = moe_f32_to_f16(v);
    memcpy(p, &h, 2);
}

static inline float f16_round(float v)
{
    return moe_f16_to_f32(moe_f32_to_f16(v));
}

static inline int clampi(int v, int lo, int hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/* Round half away from zero; inline (lrintf is a libm call) and exact enough for levels and
 * scales, whose values stay far below 2^23. */
static inline int iround(float x)
{
    return (int)(x >= 0 ? x + 0.5f : x - 0.5f);
}

/* In a block whose scale was raised to hold the pinned value, shrinks the other levels of that
 * scale group (around `centre`) by `ratio` so that they keep the tensor's deviation. */
static void narrow_levels(int *q, int n, float centre, float ratio, int lo, int hi)
{
    if (ratio >= 1)
        return;
    for (int i = 1; i < n; i++)
        q[i] = clampi(iround(centre + (q[i] - centre) * ratio), lo, hi);
}

/* Float samples: 32 per generation block. pin: element 0 gets `pinv`. */
static void gen_float(struct rng *r, const struct mk_tensor *t, uint64_t row, bool pin, float *y)
{
    uint16_t u[32];
    rng_bytes(r, (uint8_t *)u, sizeof u);
    for (int i = 0; i < 32; i++) {
        float z = zt16[u[i]];
        switch (t->kind) {
        case MK_KIND_NORM: y[i] = 1.0f + 0.1f * z; break;
        default: y[i] = t->sigma * z; break;
        }
    }
    if (!pin)
        return;
    if (t->kind == MK_KIND_ROUTER)
        y[0] = t->bias[row % (uint64_t)t->ne[1]];
    else if (t->kind == MK_KIND_NORM)
        y[0] = 1.0f; /* the bias channel reaches the router unscaled in every layer */
    else
        y[0] = MK_BIAS_CHANNEL_VALUE;
}

static void gen_q8_0(struct rng *r, float sigma, bool pin, struct moe_block_q8_0 *b)
{
    const float c = MK_BIAS_CHANNEL_VALUE;
    const float d_nom = sigma * jitter(r, 0.85f, 1.15f) / t_q8.std;
    float d = d_nom;
    if (pin && d < c / 127)
        d = c / 127;
    b->d = moe_f32_to_f16(d);
    uint8_t u[32];
    int q[32];
    rng_bytes(r, u, 32);
    for (int i = 0; i < 32; i++)
        q[i] = t_q8.v[u[i]];
    if (pin) {
        q[0] = clampi(iround(c / f16_round(d)), -127, 127);
        narrow_levels(q, 32, 0, d_nom / d, -127, 127);
    }
    for (int i = 0; i < 32; i++)
        b->qs[i] = (int8_t)q[i];
}

static void gen_q5_0(struct rng *r, float sigma, bool pin, struct moe_block_q5_0 *b)
{
    const float c = MK_BIAS_CHANNEL_VALUE;
    const float d_nom = sigma * jitter(r, 0.85f, 1.15f) / t_q5.std;
    float d = d_nom;
    if (pin && d < c / 15)
        d = c / 15;
    b->d = moe_f32_to_f16(d);
    uint8_t u[32];
    int q[32];
    rng_bytes(r, u, 32);
    for (int i = 0; i < 32; i++)
        q[i] = t_q5.v[u[i]] + 16;
    if (pin) {
        q[0] = 16 + clampi(iround(c / f16_round(d)), -16, 15);
        narrow_levels(q, 32, 16, d_nom / d, 0, 31);
    }
    /* Element j's fifth bit is bit j of qh; j < 16 sit in low nibbles, j >= 16 in high ones. */
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        b->qs[j] = (uint8_t)((q[j] & 15) | ((q[j + 16] & 15) << 4));
        qh |= (uint32_t)((q[j] >> 4) & 1) << j;
        qh |= (uint32_t)((q[j + 16] >> 4) & 1) << (j + 16);
    }
    memcpy(b->qh, &qh, 4);
}

/* Q4_K: d, dmin, 8 six-bit (scale, min) pairs, 256 nibbles. Sub-block j of 32 values is
 * y = d*sc[j]*q - dmin*m[j]; m[j] is chosen to centre the nibbles' mean on zero. */
static void gen_q4_k(struct rng *r, float sigma, bool pin, struct moe_block_q4_k *b)
{
    const float c = MK_BIAS_CHANNEL_VALUE;
    const float sc_nom = 48;
    float d = sigma * jitter(r, 0.9f, 1.1f) / (t_q4.std * sc_nom);
    /* The pinned value sits at nibble 15 of sub-block 0 with the largest scale. */
    float d_pin = c / (63 * (15 - t_q4.mean));
    if (pin && d < d_pin)
        d = d_pin;
    d = f16_round(d);
    float dmin = f16_round(8 * d);
    int sc[8], m[8];
    for (int j = 0; j < 8; j++) {
        if (pin && j == 0)
            sc[j] = 63;
        else
            sc[j] = clampi(iround(sigma * jitter(r, 0.75f, 1.3f) / (d * t_q4.std)), 1, 63);
        m[j] = dmin > 0 ? clampi(iround(sc[j] * t_q4.mean * d / dmin), 0, 63) : 0;
    }
    b->d = moe_f32_to_f16(d);
    b->dmin = moe_f32_to_f16(dmin);
    uint8_t *s = b->scales;
    memset(s, 0, sizeof b->scales);
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)sc[j];
        s[j + 4] = (uint8_t)m[j];
    }
    for (int j = 4; j < 8; j++) {
        s[j + 4] = (uint8_t)((sc[j] & 15) | ((m[j] & 15) << 4));
        s[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
        s[j] |= (uint8_t)((m[j] >> 4) << 6);
    }
    /* Byte l of chunk c holds value 64c+l (low nibble, sub-block 2c) and 64c+32+l (high). */
    uint16_t u[128];
    rng_bytes(r, (uint8_t *)u, sizeof u);
    uint8_t *qs = b->qs;
    for (int i = 0; i < 128; i++)
        qs[i] = t_q4_pair[u[i]];
    if (pin) {
        /* Sub-block 0 is the low nibbles of qs[0..31]; element 0 is qs[0]'s. */
        int q[32];
        for (int l = 0; l < 32; l++)
            q[l] = qs[l] & 15;
        q[0] = clampi(iround((c + dmin * m[0]) / (d * sc[0])), 0, 15);
        narrow_levels(q, 32, t_q4.mean, sigma / (d * t_q4.std * sc[0]), 0, 15);
        for (int l = 0; l < 32; l++)
            qs[l] = (uint8_t)((qs[l] & 0xf0) | q[l]);
    }
}

/* Q6_K: ql[128], qh[64], 16 int8 scales, d. Element i is d*sc[i/16]*(q-32). */
static void gen_q6_k(struct rng *r, float sigma, bool pin, struct moe_block_q6_k *b)
{
    const float c = MK_BIAS_CHANNEL_VALUE;
    const float sc_nom = 64;
    float d = sigma * jitter(r, 0.9f, 1.1f) / (t_q6.std * sc_nom);
    if (pin && d < c / (127 * 31))
        d = c / (127 * 31);
    d = f16_round(d);
    int8_t sc[16];
    for (int j = 0; j < 16; j++) {
        if (pin && j == 0) /* the pinned value at level 31, as exactly as the scale allows */
            sc[j] = (int8_t)clampi(iround(c / (d * 31)), 1, 127);
        else
            sc[j] = (int8_t)clampi(iround(sigma * jitter(r, 0.75f, 1.3f) / (d * t_q6.std)),
                                   1, 127);
    }
    uint8_t u[256];
    int q[256];
    rng_bytes(r, u, 256);
    for (int i = 0; i < 256; i++)
        q[i] = t_q6.v[u[i]] + 32;
    if (pin) {
        q[0] = 32 + clampi(iround(c / (d * sc[0])), -32, 31);
        narrow_levels(q, 16, 32, sigma / (d * t_q6.std * sc[0]), 0, 63);
    }
    /* Per 128-value half, quarters k = 0..3 of 32 values: k = 0, 1 in the low nibbles of
     * ql[0..31] and ql[32..63], k = 2, 3 in their high nibbles; top two bits at bit 2k of qh. */
    uint8_t *ql = b->ql, *qh = b->qh;
    for (int h = 0; h < 2; h++) {
        const int *x = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            ql[64 * h + l] = (uint8_t)((x[l] & 15) | (x[l + 64] & 15) << 4);
            ql[64 * h + l + 32] = (uint8_t)((x[l + 32] & 15) | (x[l + 96] & 15) << 4);
            qh[32 * h + l] = (uint8_t)(x[l] >> 4 | (x[l + 32] >> 4) << 2 | (x[l + 64] >> 4) << 4 |
                                       (x[l + 96] >> 4) << 6);
        }
    }
    memcpy(b->scales, sc, sizeof b->scales);
    b->d = moe_f32_to_f16(d);
}

int mk_tensor_prepare(struct mk_tensor *t)
{
    const struct moe_type_info *ti = moe_type_get(t->type);
    if (!ti)
        return MOE_EUNSUPPORTED;
    switch (t->type) {
    case MOE_TYPE_F32:
    case MOE_TYPE_F16:
        t->gblk = 32;
        t->gbytes = 32 * ti->size;
        break;
    case MOE_TYPE_Q8_0:
    case MOE_TYPE_Q5_0:
    case MOE_TYPE_Q4_K:
    case MOE_TYPE_Q6_K:
        t->gblk = ti->blck;
        t->gbytes = ti->size;
        break;
    default:
        return MOE_EUNSUPPORTED;
    }
    if (t->ne[0] % t->gblk)
        return MOE_EFORMAT;
    t->n_gblocks = (uint64_t)t->ne[0] / t->gblk * (uint64_t)t->ne[1] * (uint64_t)t->ne[2];
    return 0;
}

void mk_gen_blocks(const struct mk_tensor *t, uint64_t b0, uint64_t n, uint8_t *out)
{
    const uint64_t per_row = (uint64_t)t->ne[0] / t->gblk;
    for (uint64_t b = b0; b < b0 + n; b++, out += t->gbytes) {
        uint64_t row = b / per_row;
        bool first = b % per_row == 0;
        if (t->zero_row0 && row % (uint64_t)t->ne[1] == 0) {
            memset(out, 0, t->gbytes);
            continue;
        }
        struct rng r = {mk_mix64(t->key + b)};
        bool pin = first && (t->pin0 || t->kind != MK_KIND_WEIGHT);
        switch (t->type) {
        case MOE_TYPE_F32: {
            float y[32];
            gen_float(&r, t, row, pin, y);
            memcpy(out, y, sizeof y);
            break;
        }
        case MOE_TYPE_F16: {
            float y[32];
            gen_float(&r, t, row, pin, y);
            for (int i = 0; i < 32; i++)
                put_f16(out + 2 * i, y[i]);
            break;
        }
        case MOE_TYPE_Q8_0: gen_q8_0(&r, t->sigma, pin, (struct moe_block_q8_0 *)out); break;
        case MOE_TYPE_Q5_0: gen_q5_0(&r, t->sigma, pin, (struct moe_block_q5_0 *)out); break;
        case MOE_TYPE_Q4_K: gen_q4_k(&r, t->sigma, pin, (struct moe_block_q4_k *)out); break;
        case MOE_TYPE_Q6_K: gen_q6_k(&r, t->sigma, pin, (struct moe_block_q6_k *)out); break;
        default: memset(out, 0, t->gbytes); break;
        }
    }
}

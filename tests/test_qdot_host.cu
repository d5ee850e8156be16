/* The CUDA dot-product decoders (worker/cuda/qdot.cuh) run on the host: they are
 * __host__ __device__, so CI, which has nvcc but no GPU, checks their logic. For every type the
 * CUDA kernels decode, a row walked unit by unit (as a warp's lanes walk it) against the store's
 * reference decoder (moe_dequantize) and a double dot product; several rows at once against one
 * at a time (the kernels promise the same floats per row); RMSNorm applied on the way (XNorm)
 * against a normalised copy of x. The device-only paths (byte permutes, vector loads) are checked
 * on the GPU by tests/gpu/test_cuda_matvec.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "worker/cuda/qdot.cuh"

extern "C" {
#include "store/quant.h"
#include "tests/harness.h"
}

/* Uniform in [-0.5, 0.5), from the harness's generator. */
static float rnd(void)
{
    return (float)moe_test_rng_u32() / 4294967296.0f - 0.5f;
}

/* Row r of a [rows][n] matrix of type kind_type(K), made from random floats. */
static uint8_t *make_rows(uint32_t type, int64_t rows, int64_t n)
{
    const size_t rb = moe_row_bytes(type, n);
    uint8_t *w = (uint8_t *)malloc(rb * (size_t)rows);
    float *f = (float *)malloc(sizeof(float) * (size_t)n);
    CHECK(w && f);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++)
            f[i] = rnd() * (0.05f + 0.02f * (float)((i / 32 + r) % 4));
        CHECK_EQ(moe_quantize(type, f, w + rb * (size_t)r, n), 0);
    }
    free(f);
    return w;
}

/* Σ over the units of RW rows of unit_dot<K, RW, XL>, in a warp's order: lane l's units l, l+32,
 * ... summed per lane, then the lanes' sums added in a shuffle tree's pattern. */
template <int K, int RW, class XL, bool Q8 = false>
static void walk(const uint8_t *const *rows, int64_t n, const float *x, const XL &xin, float *out)
{
    if constexpr (rows_per_warp<K>() == 1 && RW > 1) {
        /* The plain types' decoders take one row at a time (so does row_dots_multi). */
        for (int r = 0; r < RW; r++)
            walk<K, 1, XL>(&rows[r], n, x, xin, &out[r]);
        return;
    }
    constexpr int PB = unit_shape<K>::per_block, BL = unit_shape<K>::blck;
    const size_t rb = moe_row_bytes(kind_type(K), n);
    const int64_t nb = n / BL, nu = nb * PB;
    const unsigned bb = (unsigned)(rb / (size_t)nb);
    float lane[32][RW];
    for (int l = 0; l < 32; l++) {
        for (int r = 0; r < RW; r++)
            lane[l][r] = 0.0f;
        for (int64_t u = l; u < nu; u += 32) {
            const uint8_t *bs[RW];
            for (int r = 0; r < RW; r++)
                bs[r] = rows[r] + (size_t)(u / PB) * bb;
            if constexpr (Q8)
                unit_dot_q8<K, RW, XL>(bs, (int)(u % PB), x + (u / PB) * BL, lane[l], xin);
            else
                unit_dot<K, RW, XL>(bs, (int)(u % PB), x + (u / PB) * BL, lane[l], xin);
        }
    }
    for (int r = 0; r < RW; r++) {
        float v[32];
        for (int l = 0; l < 32; l++)
            v[l] = lane[l][r];
        for (int o = 16; o > 0; o >>= 1) {
            float t[32];
            for (int l = 0; l < 32; l++)
                t[l] = v[l] + v[l ^ o];
            memcpy(v, t, sizeof v);
        }
        out[r] = v[0];
    }
}

/* The reference: row decoded by moe_dequantize (into d, n floats), its dot with x in double;
 * *mag gets Σ|w·x|, the error scale. */
static double ref_dot(uint32_t type, const uint8_t *row, int64_t n, const float *x, float *d,
                      double *mag)
{
    CHECK_EQ(moe_dequantize(type, row, d, n), 0);
    double ref = 0.0, m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        ref += (double)d[i] * x[i];
        m += fabs((double)d[i] * x[i]);
    }
    *mag = m;
    return ref;
}

template <int K>
static void check_kind(const char *name)
{
    const uint32_t type = kind_type(K);
    constexpr int RW = 4;
    static const int64_t ns[] = {256, 768, 2048};
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
        const int64_t n = ns[ni];
        const size_t rb = moe_row_bytes(type, n);
        uint8_t *w = make_rows(type, RW, n);
        float *x = (float *)malloc(sizeof(float) * (size_t)n);
        float *g = (float *)malloc(sizeof(float) * (size_t)n);
        float *xn = (float *)malloc(sizeof(float) * (size_t)n);
        float *d = (float *)malloc(sizeof(float) * (size_t)n);
        CHECK(x && g && xn && d);
        for (int64_t i = 0; i < n; i++) {
            x[i] = 4.0f * rnd();
            g[i] = 1.0f + rnd();
        }
        const float sc = 0.37f;
        for (int64_t i = 0; i < n; i++)
            xn[i] = x[i] * sc * g[i];
        const uint8_t *rows[RW];
        for (int r = 0; r < RW; r++)
            rows[r] = w + rb * (size_t)r;
        float together[RW], norm[RW];
        walk<K, RW, XPlain>(rows, n, x, XPlain(), together);
        const XNorm xnorm = {x, g, sc};
        walk<K, RW, XNorm>(rows, n, x, xnorm, norm);
        for (int r = 0; r < RW; r++) {
            double mag;
            const double ref = ref_dot(type, rows[r], n, x, d, &mag);
            float one[1], onen[1];
            walk<K, 1, XPlain>(&rows[r], n, x, XPlain(), one);
            walk<K, 1, XPlain>(&rows[r], n, xn, XPlain(), onen);
            CHECK_MSG(fabs((double)one[0] - ref) <= 1e-5 * mag,
                      "%s n=%lld row %d: %.9g, reference %.9g (Σ|w·x| %.4g)", name, (long long)n, r,
                      (double)one[0], ref, mag);
            CHECK_MSG(memcmp(&one[0], &together[r], sizeof(float)) == 0,
                      "%s n=%lld row %d: %.9g alone, %.9g with %d rows", name, (long long)n, r,
                      (double)one[0], (double)together[r], RW);
            CHECK_MSG(memcmp(&onen[0], &norm[r], sizeof(float)) == 0,
                      "%s n=%lld row %d: %.9g on normalised x, %.9g normalised on the way", name,
                      (long long)n, r, (double)onen[0], (double)norm[r]);
        }
        free(w), free(x), free(g), free(xn), free(d);
    }
}

TEST(qdot_host_decoders_match_the_reference)
{
    moe_test_rng_seed(11);
    check_kind<MOE_TYPE_F32>("f32");
    check_kind<KIND_F32_V>("f32 (16-byte)");
    check_kind<MOE_TYPE_F16>("f16");
    check_kind<KIND_F16_V>("f16 (16-byte)");
    check_kind<MOE_TYPE_BF16>("bf16");
    check_kind<KIND_BF16_V>("bf16 (16-byte)");
    check_kind<MOE_TYPE_Q8_0>("q8_0");
    check_kind<MOE_TYPE_Q4_0>("q4_0");
    check_kind<MOE_TYPE_Q5_0>("q5_0");
    check_kind<MOE_TYPE_Q4_1>("q4_1");
    check_kind<MOE_TYPE_Q5_1>("q5_1");
    check_kind<MOE_TYPE_Q4_K>("q4_K");
    check_kind<MOE_TYPE_Q5_K>("q5_K");
    check_kind<MOE_TYPE_Q6_K>("q6_K");
}

/* The TOK_T-token walk's units (tok_unit_dots) give every (row, token) the floats of the one-token
 * walk (unit_dot), bit for bit: lanes emulated as in walk(), 16 tokens of 2 rows, all tokens
 * valid and only 5 of them (the others read token 0's), rows of 256, 768, 2048 and 2560; the
 * inputs read as they are, and as the GPU kernel reads them (mv_rows_tile): slices of
 * MOE_TOK_COLS columns staged in XPad's padded layout (everything else poisoned with NaN),
 * each lane walking its units of one slice after the other. */
template <int K> static void check_tok(const char *name)
{
    const uint32_t type = kind_type(K);
    constexpr int RW = 2, T = 16, PB = unit_shape<K>::per_block, BL = unit_shape<K>::blck;
    static const int64_t ns[] = {256, 768, 2048, 2560};
    constexpr int64_t SC = MOE_TOK_COLS, PITCH = SC + SC / 16;
    float *sb = (float *)malloc(sizeof(float) * (size_t)(T * PITCH));
    CHECK(sb);
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
        const int64_t n = ns[ni], ldx = n + 4, nb = n / BL, nu = nb * PB;
        const size_t rb = moe_row_bytes(type, n);
        const unsigned bb = (unsigned)(rb / (size_t)nb);
        uint8_t *w = make_rows(type, RW, n);
        float *x = (float *)malloc(sizeof(float) * (size_t)(ldx * T));
        CHECK(w && x);
        for (int64_t i = 0; i < ldx * T; i++)
            x[i] = 4.0f * rnd();
        const uint8_t *rows[RW] = {w, w + rb};
        /* Each emulated lane's units u0 + l, u0 + l + 32, ... below u1, as row_units_tok walks
         * them: token i's input of column c at xs + (c - c0) + i·xld, read through xin. */
        const auto lane_units = [&](float (*lane)[T][RW], int64_t u0, int64_t u1,
                                    const float *xs, int64_t c0, int64_t xld, int nt,
                                    const auto &xin) {
            for (int l = 0; l < 32; l++)
                for (int64_t u = u0 + l; u < u1; u += 32) {
                    const uint8_t *bs[RW] = {rows[0] + (size_t)(u / PB) * bb,
                                             rows[1] + (size_t)(u / PB) * bb};
                    tok_unit_dots<K, RW, T>(bs, (int)(u % PB), xs + ((u / PB) * BL - c0), xld,
                                            nt, code_magic(), lane[l], xin);
                }
        };
        for (int tiled = 0; tiled < 2; tiled++) {
            for (int nt : {T, 5}) {
                float lane[32][T][RW] = {};
                if (!tiled) {
                    lane_units(lane, 0, nu, x, 0, ldx, nt, XPlain());
                } else {
                    const XPad xp = {sb};
                    for (int64_t c0 = 0; c0 < n; c0 += SC) {
                        const int64_t cw = n - c0 < SC ? n - c0 : SC;
                        for (int64_t j = 0; j < T * PITCH; j++)
                            sb[j] = NAN;
                        for (int i = 0; i < nt; i++)
                            for (int64_t c = 0; c < cw; c++)
                                sb[XPad::at(i * SC + c)] = x[i * ldx + c0 + c];
                        lane_units(lane, c0 / BL * PB, (c0 + cw) / BL * PB, sb, c0, SC, nt, xp);
                    }
                }
                for (int i = 0; i < T; i++) {
                    float one[RW];
                    walk<K, RW, XPlain>(rows, n, x + (i < nt ? i : 0) * ldx, XPlain(), one);
                    for (int r = 0; r < RW; r++) {
                        float v[32];
                        for (int l = 0; l < 32; l++)
                            v[l] = lane[l][i][r];
                        for (int o = 16; o > 0; o >>= 1) {
                            float t[32];
                            for (int l = 0; l < 32; l++)
                                t[l] = v[l] + v[l ^ o];
                            memcpy(v, t, sizeof v);
                        }
                        CHECK_MSG(memcmp(&v[0], &one[r], sizeof(float)) == 0,
                                  "%s n=%lld nt=%d%s token %d row %d: %.9g by the 16-token walk, "
                                  "%.9g by one token's", name, (long long)n, nt,
                                  tiled ? " (staged slices)" : "", i, r, (double)v[0],
                                  (double)one[r]);
                    }
                }
            }
        }
        free(w), free(x);
    }
    free(sb);
}

TEST(qdot_host_tok_walk_equals_one_token)
{
    moe_test_rng_seed(12);
    check_tok<MOE_TYPE_Q4_K>("q4_K");
    check_tok<MOE_TYPE_Q5_K>("q5_K");
    check_tok<MOE_TYPE_Q6_K>("q6_K");
}

/* The group of element i whose activations share one int8 scale in unit_dot_q8: the unit's 8
 * (Q8_0) or 16 values (a Q4_K/Q5_K unit's low or high half; a Q6_K unit's four runs of four, 32
 * apart). */
template <int K> static int64_t q8_group(int64_t i)
{
    if constexpr (K == MOE_TYPE_Q8_0)
        return i / 8;
    else if constexpr (K == MOE_TYPE_Q6_K) {
        const int64_t j = i % 256, h = j / 128, l = j % 32;
        return (i / 256) * 16 + h * 8 + l / 4;
    } else
        return i / 16;
}

/* x rounded as unit_dot_q8 rounds it: per group, round(x·127/max|x|)·max|x|/127. */
template <int K> static void q8_round(const float *x, int64_t n, float *xr)
{
    const int64_t ng = q8_group<K>(n - 1) + 1;
    float *amax = (float *)calloc((size_t)ng, sizeof(float));
    CHECK(amax);
    for (int64_t i = 0; i < n; i++)
        amax[q8_group<K>(i)] = fmaxf(amax[q8_group<K>(i)], fabsf(x[i]));
    for (int64_t i = 0; i < n; i++) {
        const float a = amax[q8_group<K>(i)];
        xr[i] = a > 0.0f ? nearbyintf(x[i] * (127.0f / a)) * (a * (1.0f / 127.0f)) : 0.0f;
    }
    free(amax);
}

/* The int8-activation decode (MOE_Q8_ROWS builds): the reference's dot product with x rounded as
 * the decoder rounds it, within 2e-5 of Σ|w·x| (only the float order differs: so the rounding is
 * the only error, the K-quant mins included), within 1% of the exact reference (the worst seen
 * is printed), and several rows at once give each row's floats alone. */
template <int K>
static void check_q8(const char *name)
{
    const uint32_t type = kind_type(K);
    constexpr int RW = 4;
    double worst = 0.0;
    for (int64_t n : {256, 768, 2048, 4096}) {
        const size_t rb = moe_row_bytes(type, n);
        uint8_t *w = make_rows(type, RW, n);
        float *x = (float *)malloc(sizeof(float) * (size_t)n);
        float *d = (float *)malloc(sizeof(float) * (size_t)n);
        float *xr = (float *)malloc(sizeof(float) * (size_t)n);
        CHECK(x && d && xr);
        for (int64_t i = 0; i < n; i++)
            x[i] = 4.0f * rnd() * (i % 7 == 0 ? 8.0f : 1.0f); /* some outliers per group */
        q8_round<K>(x, n, xr);
        const uint8_t *rows[RW];
        for (int r = 0; r < RW; r++)
            rows[r] = w + rb * (size_t)r;
        float together[RW];
        walk<K, RW, XPlain, true>(rows, n, x, XPlain(), together);
        for (int r = 0; r < RW; r++) {
            double mag;
            const double ref = ref_dot(type, rows[r], n, x, d, &mag);
            float one[1];
            walk<K, 1, XPlain, true>(&rows[r], n, x, XPlain(), one);
            const double e = fabs((double)one[0] - ref) / mag;
            worst = e > worst ? e : worst;
            CHECK_MSG(e <= 1e-2, "%s n=%lld row %d (int8 x): %.9g, reference %.9g (Σ|w·x| %.4g)",
                      name, (long long)n, r, (double)one[0], ref, mag);
            double mag_r;
            const double ref_r = ref_dot(type, rows[r], n, xr, d, &mag_r);
            CHECK_MSG(fabs((double)one[0] - ref_r) <= 2e-5 * mag,
                      "%s n=%lld row %d (int8 x): %.9g, reference with x rounded alike %.9g "
                      "(Σ|w·x| %.4g)", name, (long long)n, r, (double)one[0], ref_r, mag);
            CHECK_MSG(memcmp(&one[0], &together[r], sizeof(float)) == 0,
                      "%s n=%lld row %d (int8 x): %.9g alone, %.9g with %d rows", name,
                      (long long)n, r, (double)one[0], (double)together[r], RW);
        }
        /* A NaN in x reaches the product, as in the float path. */
        x[n / 3] = NAN;
        float nanv[1];
        walk<K, 1, XPlain, true>(&rows[0], n, x, XPlain(), nanv);
        CHECK_MSG(isnan(nanv[0]), "%s n=%lld: a NaN in x gave %.9g", name, (long long)n,
                  (double)nanv[0]);
        free(w), free(x), free(d), free(xr);
    }
    printf("  %-6s int8 activations: worst error %.2e of Σ|w·x|\n", name, worst);
}

TEST(qdot_host_int8_activations)
{
    moe_test_rng_seed(12);
    check_q8<MOE_TYPE_Q8_0>("q8_0");
    check_q8<MOE_TYPE_Q4_K>("q4_K");
    check_q8<MOE_TYPE_Q5_K>("q5_K");
    check_q8<MOE_TYPE_Q6_K>("q6_K");
}

/* The K-quant scale decoder against the layout spelled out byte by byte (docs/kernels.md): every
 * sub-block j's 6-bit scale and min, for random scale bytes. */
TEST(qdot_host_k_quant_scales)
{
    moe_test_rng_seed(13);
    for (int it = 0; it < 200000; it++) {
        uint8_t b[12];
        for (int i = 0; i < 12; i++)
            b[i] = (uint8_t)(it < 256 ? it : moe_test_rng_u32() >> 24);
        uint32_t s[3];
        memcpy(s, b, sizeof s);
        for (int c = 0; c < 4; c++) {
            float d0, n0, d1, n1;
            kq_scales(s[0], s[1], s[2], c, 1.0f, 1.0f, &d0, &n0, &d1, &n1);
            const float got[4] = {d0, n0, d1, n1};
            for (int i = 0; i < 2; i++) {
                const int j = 2 * c + i;
                int sc, m;
                if (j < 4) {
                    sc = b[j] & 63;
                    m = b[j + 4] & 63;
                } else {
                    sc = (b[j + 4] & 15) | (b[j - 4] >> 6) << 4;
                    m = (b[j + 4] >> 4) | (b[j] >> 6) << 4;
                }
                CHECK_MSG(got[2 * i] == (float)sc && got[2 * i + 1] == (float)m,
                          "sub-block %d: scale %g min %g, layout says %d %d", j,
                          (double)got[2 * i], (double)got[2 * i + 1], sc, m);
            }
        }
    }
}

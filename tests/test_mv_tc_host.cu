/* The fragment scheme of the tensor-core mat-vec (worker/cuda/mv_tc.cuh) on the host: a warp's
 * 32 lanes build their A (weights as sc·q), B (inputs as two f16 parts) and mins fragments with
 * the kernel's own __host__ __device__ functions, the mma instructions are emulated from the PTX
 * fragment layouts (m16n8k16 and m16n8k8, f16 inputs, sums in double), and each row's result
 * d·C − dmin·C_min (Q4_K; Q6_K: Σ over the scale groups of d·sc·C) must equal a double dot
 * product of the dequantised row within 1e-6 of Σ|w·x|.
 * A weight or input placed in the wrong fragment slot, a wrong scale or a wrong k order fails it.
 * The GPU test (tests/gpu/test_cuda_mv_tc.c) checks the kernel itself against the CPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "worker/cuda/mv_tc.cuh"

extern "C" {
#include "store/quant.h"
#include "tests/harness.h"
}

static float rnd(void)
{
    return (float)moe_test_rng_u32() / 4294967296.0f - 0.5f;
}

/* The f16 halves of a fragment register as doubles. */
static void halves(uint32_t v, double *lo, double *hi)
{
    *lo = tc_lo_f(v);
    *hi = tc_hi_f(v);
}

/* nt tokens of n random inputs, token c of magnitude mag[c] at x + c·stride, and each one's scale
 * exponent (its largest input lands in [512, 1024) after 2^-s). */
static void random_tokens(float *x, int stride, int n, int nt, const float *mag, int *sexp)
{
    for (int c = 0; c < nt; c++) {
        float amax = 0.0f;
        for (int i = 0; i < n; i++) {
            x[c * stride + i] = rnd() * 2.0f * mag[c];
            amax = fmaxf(amax, fabsf(x[c * stride + i]));
        }
        sexp[c] = tc_scale_exp(amax);
        CHECK(ldexpf(amax, -sexp[c]) < 1024.0f && ldexpf(amax, -sexp[c]) >= 512.0f);
    }
}

/* B's entries (k = 2t, 2t+1, 2t+8, 2t+9 of column g) from one staged unit, its two parts added:
 * b0 = {hi, lo}(x0, x2), b1 = {hi, lo}(x1, x3). */
static void b_entries(uint4 xb, double (*B)[8], int t, int g)
{
    double p, q, r, s;
    halves(xb.x, &p, &q);
    halves(xb.z, &r, &s);
    B[2 * t][g] = p + r, B[2 * t + 1][g] = q + s;
    halves(xb.y, &p, &q);
    halves(xb.w, &r, &s);
    B[2 * t + 8][g] = p + r, B[2 * t + 9][g] = q + s;
}

/* got against the double dot product of the dequantised row d with x (n elements), within 1e-6
 * of Σ|w·x|; nt, r, c name the case. */
static void check_dot(const float *d, const float *x, int64_t n, double got, int nt, int r, int c)
{
    double ref = 0.0, abs_sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        ref += (double)d[i] * x[i];
        abs_sum += fabs((double)d[i] * x[i]);
    }
    CHECK_MSG(fabs(got - ref) <= 1e-6 * abs_sum,
              "nt %d row %d token %d: %.9g against %.9g (Σ|w·x| %.3g)", nt, r, c, got, ref,
              abs_sum);
}

/* One Q4_K block (sb) of a 16-row tile for NT tokens, as one warp computes it; out[r][c]. */
static void tile_block(const uint8_t *const *rows, int sb, const float (*x)[256], int nt,
                       int sexp[8], double out[16][8])
{
    const size_t BB = sizeof(struct moe_block_q4_k);
    /* Staged inputs: xs[c][m][t] and the sub-block sums' pairs sxs[c][t], as the kernel stages. */
    static uint4 xs[8][16][4];
    static uint2 sxs[8][4];
    for (int c = 0; c < nt; c++) {
        const float sc = ldexpf(1.0f, -sexp[c]);
        for (int m = 0; m < 16; m++)
            for (int t = 0; t < 4; t++) {
                const float *v = x[c] + tc_q4k_base(m, t);
                xs[c][m][t] = tc_stage4(v[0] * sc, v[1] * sc, v[2] * sc, v[3] * sc);
            }
        for (int t = 0; t < 4; t++) {
            float s0 = 0.0f, s1 = 0.0f;
            for (int i = 0; i < 32; i++) {
                s0 += x[c][64 * t + i] * sc;
                s1 += x[c][64 * t + 32 + i] * sc;
            }
            sxs[c][t] = tc_stage_sums(s0, s1);
        }
    }
    double A[16][16][16] = {}; /* [mma][row][k] */
    double B[16][16][8] = {};  /* [mma][k][col], both parts added (the two mma share A) */
    double Am[16][8] = {}, Bm[8][8] = {};
    double dd[16], dmin[16];
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane >> 2, t = lane & 3, gx = g & (nt - 1);
        const uint8_t *b0 = rows[g] + (size_t)sb * BB, *b1 = rows[g + 8] + (size_t)sb * BB;
        uint4 h0, h1;
        memcpy(&h0, b0, 16);
        memcpy(&h1, b1, 16);
        const tc_q4k_row k0 = tc_q4k_consts(h0, t), k1 = tc_q4k_consts(h1, t);
        dd[g] = k0.d, dmin[g] = k0.dmin, dd[g + 8] = k1.d, dmin[g + 8] = k1.dmin;
        uint32_t wa[8], wb[8];
        memcpy(wa, b0 + OFF(q4_k, qs) + 32 * t, 32);
        memcpy(wb, b1 + OFF(q4_k, qs) + 32 * t, 32);
        for (int i = 0; i < 8; i++) {
            uint32_t l0a, l1a, h0a, h1a, l0b, l1b, h0b, h1b;
            tc_q4k_word(wa[i], k0, &l0a, &l1a, &h0a, &h1a);
            tc_q4k_word(wb[i], k1, &l0b, &l1b, &h0b, &h1b);
            const uint32_t a[2][4] = {{l0a, l0b, l1a, l1b}, {h0a, h0b, h1a, h1b}};
            for (int hl = 0; hl < 2; hl++) {
                const int m = 2 * i + hl;
                /* m16n8k16 A: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..). */
                halves(a[hl][0], &A[m][g][2 * t], &A[m][g][2 * t + 1]);
                halves(a[hl][1], &A[m][g + 8][2 * t], &A[m][g + 8][2 * t + 1]);
                halves(a[hl][2], &A[m][g][2 * t + 8], &A[m][g][2 * t + 9]);
                halves(a[hl][3], &A[m][g + 8][2 * t + 8], &A[m][g + 8][2 * t + 9]);
                /* B: b0 (k 2t..2t+1, column g), b1 (k 2t+8..2t+9). */
                b_entries(xs[gx][m][t], B[m], t, g);
            }
        }
        /* m16n8k8 of the mins: a0 (g, 2t..2t+1), a1 (g+8, 2t..); b0 (k 2t..2t+1, column g). */
        halves(k0.am, &Am[g][2 * t], &Am[g][2 * t + 1]);
        halves(k1.am, &Am[g + 8][2 * t], &Am[g + 8][2 * t + 1]);
        double p, q, r, s;
        halves(sxs[gx][t].x, &p, &q);
        halves(sxs[gx][t].y, &r, &s);
        Bm[2 * t][g] = p + r, Bm[2 * t + 1][g] = q + s;
    }
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < nt; c++) {
            double C = 0.0, M = 0.0;
            for (int m = 0; m < 16; m++)
                for (int k = 0; k < 16; k++)
                    C += A[m][r][k] * B[m][k][c];
            for (int k = 0; k < 8; k++)
                M += Am[r][k] * Bm[k][c];
            out[r][c] = (dd[r] * C - dmin[r] * M) * ldexp(1.0, sexp[c]);
        }
}

TEST(mv_tc_host_fragments_give_the_dot_products)
{
    moe_test_rng_seed(77);
    const int64_t n = 512; /* two blocks */
    const size_t rb = moe_row_bytes(MOE_TYPE_Q4_K, n);
    uint8_t *w = (uint8_t *)malloc(rb * 16);
    float f[512], d[512];
    CHECK(w);
    for (int r = 0; r < 16; r++) {
        for (int i = 0; i < n; i++)
            f[i] = rnd() * (0.02f + 0.03f * (float)((i / 32 + r) % 5)) + (r == 3 ? 0.05f : 0.0f);
        CHECK_EQ(moe_quantize(MOE_TYPE_Q4_K, f, w + rb * r, n), 0);
    }
    const uint8_t *rows[16];
    for (int r = 0; r < 16; r++)
        rows[r] = w + rb * r;
    static const float mag[8] = {1.0f, 1e-3f, 5e3f, 0.02f, 300.0f, 1e-6f, 1.0f, 40.0f};
    for (int nt = 1; nt <= 8; nt *= 2) {
        static float x[8][512];
        int sexp[8];
        random_tokens(&x[0][0], 512, (int)n, nt, mag, sexp);
        double tot[16][8] = {};
        for (int sb = 0; sb < 2; sb++) {
            float xb[8][256];
            for (int c = 0; c < nt; c++)
                memcpy(xb[c], x[c] + 256 * sb, sizeof xb[c]);
            double out[16][8];
            tile_block(rows, sb, xb, nt, sexp, out);
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < nt; c++)
                    tot[r][c] += out[r][c];
        }
        for (int r = 0; r < 16; r++) {
            CHECK_EQ(moe_dequantize(MOE_TYPE_Q4_K, rows[r], d, n), 0);
            for (int c = 0; c < nt; c++)
                check_dot(d, x[c], n, tot[r][c], nt, r, c);
        }
    }
    free(w);
}

/* Q6_K: one block of a 16-row tile for NT tokens, each scale group one emulated mma whose C is
 * scaled by d·sc of its row, against a double dot product of the dequantised rows. */
TEST(mv_tc_host_q6k_fragments_give_the_dot_products)
{
    moe_test_rng_seed(78);
    const int64_t n = 256;
    const size_t rb = moe_row_bytes(MOE_TYPE_Q6_K, n);
    uint8_t *w = (uint8_t *)malloc(rb * 16);
    float f[256], d[256];
    CHECK(w);
    for (int r = 0; r < 16; r++) {
        for (int i = 0; i < n; i++)
            f[i] = rnd() * (0.02f + 0.03f * (float)((i / 16 + r) % 7)) - (r == 5 ? 0.04f : 0.0f);
        CHECK_EQ(moe_quantize(MOE_TYPE_Q6_K, f, w + rb * r, n), 0);
    }
    static const float mag[8] = {1.0f, 2e-3f, 7e3f, 0.5f, 30.0f, 1e-5f, 1.0f, 100.0f};
    for (int nt = 1; nt <= 8; nt *= 2) {
        float x[8][256];
        int sexp[8];
        random_tokens(&x[0][0], 256, (int)n, nt, mag, sexp);
        /* Per group: A [16][16], B [16][8] (both parts), the rows' d·sc. */
        static double A[16][16][16], B[16][16][8], S[16][16];
        for (int lane = 0; lane < 32; lane++) {
            const int g = lane >> 2, t = lane & 3, gx = g & (nt - 1);
            for (int half = 0; half < 2; half++) {
                const int row = g + 8 * half;
                for (int hh = 0; hh < 2; hh++)
                    for (int lh = 0; lh < 2; lh++) {
                        const int u = 8 * hh + 4 * lh + t;
                        q6k_raw raw;
                        q6k_unit_load(w + rb * row, u, &raw);
                        uint32_t q[4];
                        q6k_unit_decode(raw, q);
                        for (int j = 0; j < 4; j++) {
                            const int grp = 8 * hh + 2 * j + lh;
                            CHECK_EQ(tc_q6k_unit(grp, t), u);
                            uint32_t lo, hi;
                            tc_q6k_word(q[j], &lo, &hi);
                            halves(lo, &A[grp][row][2 * t], &A[grp][row][2 * t + 1]);
                            halves(hi, &A[grp][row][2 * t + 8], &A[grp][row][2 * t + 9]);
                            S[grp][row] = (double)h2f(raw.d) * raw.sc[j];
                            const float sc = ldexpf(1.0f, -sexp[gx]);
                            const float *v = x[gx] + tc_q6k_base(grp, t);
                            b_entries(tc_stage4(v[0] * sc, v[1] * sc, v[2] * sc, v[3] * sc),
                                      B[grp], t, g);
                        }
                    }
            }
        }
        for (int r = 0; r < 16; r++) {
            CHECK_EQ(moe_dequantize(MOE_TYPE_Q6_K, w + rb * r, d, n), 0);
            for (int c = 0; c < nt; c++) {
                double got = 0.0;
                for (int grp = 0; grp < 16; grp++) {
                    double C = 0.0;
                    for (int k = 0; k < 16; k++)
                        C += A[grp][r][k] * B[grp][k][c];
                    got += S[grp][r] * C;
                }
                check_dot(d, x[c], n, got * ldexp(1.0, sexp[c]), nt, r, c);
            }
        }
    }
    free(w);
}

/* The staging the kernels run (tc_stage_frag, tc_stage_sum: item r of a row is block r/64, mma
 * or scale group (r/4) % 16, lane r % 4, which is where tc_block and tc_block6 read it) holds the
 * units the fragment tests above place: for every item of a 3-block row, Q4_K and Q6_K, and the
 * sub-block sums of each (block, lane), the same bits. */
TEST(mv_tc_host_staging_layout)
{
    moe_test_rng_seed(79);
    float x[768];
    for (int i = 0; i < 768; i++)
        x[i] = rnd() * 700.0f;
    const float sc = 0.5f;
    for (int r = 0; r < 3 * 64; r++) {
        const int sb = r / 64, m = (r / 4) % 16, t = r % 4;
        const float *v4 = x + 256 * sb + tc_q4k_base(m, t), *v6 = x + 256 * sb + tc_q6k_base(m, t);
        const uint4 a = tc_stage_frag<MOE_TYPE_Q4_K>(x, r, sc),
                    b = tc_stage4(v4[0] * sc, v4[1] * sc, v4[2] * sc, v4[3] * sc);
        const uint4 c = tc_stage_frag<MOE_TYPE_Q6_K>(x, r, sc),
                    d = tc_stage4(v6[0] * sc, v6[1] * sc, v6[2] * sc, v6[3] * sc);
        CHECK_MSG(!memcmp(&a, &b, sizeof a), "Q4_K item %d", r);
        CHECK_MSG(!memcmp(&c, &d, sizeof c), "Q6_K item %d", r);
    }
    for (int r = 0; r < 3 * 4; r++) {
        const int sb = r / 4, t = r % 4;
        float s0 = 0.0f, s1 = 0.0f;
        for (int i = 0; i < 32; i += 4) {
            const float *a = x + 256 * sb + 64 * t + i, *b = a + 32;
            s0 += a[0] * sc + a[1] * sc + a[2] * sc + a[3] * sc;
            s1 += b[0] * sc + b[1] * sc + b[2] * sc + b[3] * sc;
        }
        const uint2 got = tc_stage_sum(x, r, sc), want = tc_stage_sums(s0, s1);
        CHECK_MSG(got.x == want.x && got.y == want.y, "sums item %d", r);
        /* The sums are of sub-blocks 2t and 2t+1, the ones lane t's mins multiply. */
        double e0 = 0.0, e1 = 0.0, a0 = 0.0, a1 = 0.0;
        for (int i = 0; i < 32; i++) {
            e0 += x[256 * sb + 32 * (2 * t) + i] * sc;
            e1 += x[256 * sb + 32 * (2 * t + 1) + i] * sc;
            a0 += fabs(x[256 * sb + 32 * (2 * t) + i] * sc);
            a1 += fabs(x[256 * sb + 32 * (2 * t + 1) + i] * sc);
        }
        double h0, h1, l0, l1;
        halves(got.x, &h0, &h1);
        halves(got.y, &l0, &l1);
        CHECK(fabs(h0 + l0 - e0) <= 1e-6 * a0 && fabs(h1 + l1 - e1) <= 1e-6 * a1);
    }
}

/* A row staged one 256-float block per warp (tc_stage_block_lane, the router launch's staging
 * for gate/up) writes every item of tc_stage_items once and with its bits: each block's 32
 * lanes, over a 2048-float row, Q4_K and Q6_K, into arrays poisoned first; and the row's layout
 * puts the exponent right after a block's own staging (tc_stage_bytes). */
TEST(mv_tc_host_staging_by_blocks_equals_the_row_staging)
{
    moe_test_rng_seed(83);
    enum { NSB = 8, N = 256 * NSB };
    static float x[N];
    for (int i = 0; i < N; i++)
        x[i] = rnd() * 90.0f;
    const float sc = 0.125f;
    const tc_row_ld ld{x};
    static uint4 xs[NSB * 64], ws[NSB * 64];
    static uint2 sxs[NSB * 4], wsx[NSB * 4];
    for (int q = 0; q < 2; q++) {
        memset(xs, 0xa5, sizeof xs);
        memset(sxs, 0xa5, sizeof sxs);
        memset(ws, 0x5a, sizeof ws);
        memset(wsx, 0x5a, sizeof wsx);
        for (int sb = 0; sb < NSB; sb++)
            for (int lane = 0; lane < 32; lane++) {
                if (q == 0)
                    tc_stage_block_lane<MOE_TYPE_Q4_K>(ld, sc, sb, lane, xs, sxs);
                else
                    tc_stage_block_lane<MOE_TYPE_Q6_K>(ld, sc, sb, lane, xs, sxs);
            }
        for (int u = 0; u < NSB * 64; u++)
            ws[u] = q == 0 ? tc_stage_frag<MOE_TYPE_Q4_K>(x, u, sc)
                           : tc_stage_frag<MOE_TYPE_Q6_K>(x, u, sc);
        for (int u = 0; q == 0 && u < NSB * 4; u++)
            wsx[u] = tc_stage_sum(x, u, sc);
        CHECK_MSG(!memcmp(xs, ws, sizeof xs), "%s fragments", q ? "Q6_K" : "Q4_K");
        if (q == 0)
            CHECK(!memcmp(sxs, wsx, sizeof sxs));
        else
            for (int u = 0; u < NSB * 4; u++) /* Q6_K takes no sums: none written */
                CHECK(sxs[u].x == 0xa5a5a5a5u && sxs[u].y == 0xa5a5a5a5u);
    }
    CHECK_EQ(tc_staged_row_exp(NSB) * sizeof(uint4),
             (size_t)NSB * (64 * sizeof(uint4) + 4 * sizeof(uint2)));
}

/* The scale exponent: the largest input lands in [512, 1024) after 2^-s, and the extremes stay
 * finite both ways. */
TEST(mv_tc_host_scale_exponent)
{
    CHECK_EQ(tc_scale_exp(0.0f), 0);
    CHECK_EQ(tc_scale_exp(INFINITY), 0);
    CHECK_EQ(tc_scale_exp(NAN), 0);
    CHECK_EQ(tc_scale_exp(512.0f), 0);
    CHECK_EQ(tc_scale_exp(1023.9f), 0);
    CHECK_EQ(tc_scale_exp(1024.0f), 1);
    CHECK_EQ(tc_scale_exp(1.0f), -9);
    CHECK_EQ(tc_scale_exp(1.0e38f), 117);
    CHECK_EQ(tc_scale_exp(1e-40f), -120);
    CHECK(isfinite(ldexpf(1.0f, 120)) && isfinite(ldexpf(1.0f, 117)));
}

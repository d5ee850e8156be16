/* CPU kernels against the reference: moe_vec_dot vs moe_dequantize + a double dot product for
 * every type and several sizes, matvec/matmul vs vec_dot with row ranges and strides, and the
 * SIMD and scalar paths against each other. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "store/ggml_type.h"
#include "store/quant.h"
#include "tests/harness.h"
#include "worker/cpu/kernels.h"

static float rng_f(void)
{
    return (float)moe_test_rng_u32() / 2147483648.0f - 1.0f;
}

static const uint32_t all_types[] = {
    MOE_TYPE_F32, MOE_TYPE_F16, MOE_TYPE_BF16, MOE_TYPE_Q4_0, MOE_TYPE_Q4_1, MOE_TYPE_Q5_0,
    MOE_TYPE_Q5_1, MOE_TYPE_Q8_0, MOE_TYPE_Q4_K, MOE_TYPE_Q5_K, MOE_TYPE_Q6_K,
};
#define N_TYPES (sizeof all_types / sizeof all_types[0])

/* Sizes in blocks: one block, odd counts, and counts that straddle the kernels' internal chunk
 * sizes (512 and 1024 elements) and SIMD unroll widths. */
static const int64_t block_counts_32[] = {1, 3, 16, 33, 64, 129};
static const int64_t block_counts_256[] = {1, 3, 4, 9, 17};
static const int64_t elem_counts_1[] = {1, 7, 8, 33, 64, 1000, 4099};

static int64_t sizes_for(uint32_t type, int64_t *out)
{
    uint32_t blck = moe_type_get(type)->blck;
    const int64_t *src = blck == 1 ? elem_counts_1
                         : blck == 32 ? block_counts_32 : block_counts_256;
    int64_t k = blck == 1 ? 7 : blck == 32 ? 6 : 5;
    for (int64_t i = 0; i < k; i++)
        out[i] = src[i] * blck;
    return k;
}

/* Random weights of roughly the magnitude real layers have, quantized into `type`; rows with a
 * mix of scales so blocks differ. */
static uint8_t *make_weights(uint32_t type, int64_t rows, int64_t n)
{
    size_t rb = moe_row_bytes(type, n);
    uint8_t *w = malloc(rb * (size_t)rows);
    float *tmp = malloc((size_t)n * sizeof *tmp);
    CHECK(w && tmp);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++)
            tmp[i] = rng_f() * (0.02f + 0.05f * (float)((i / 32 + r) % 5));
        CHECK_EQ(moe_quantize(type, tmp, w + rb * (size_t)r, n), 0);
    }
    free(tmp);
    return w;
}

static float *make_x(int64_t n)
{
    float *x = malloc((size_t)n * sizeof *x);
    CHECK(x);
    for (int64_t i = 0; i < n; i++)
        x[i] = rng_f() * 2.0f;
    return x;
}

/* The reference: exact decode, then the dot product in double. *abs_sum receives Σ|w_i x_i|,
 * which scales the tolerance: float32 accumulation of n terms is accurate to a small multiple of
 * eps · Σ|terms|. */
static double ref_dot(uint32_t type, const void *row, const float *x, int64_t n, double *abs_sum)
{
    float *w = malloc((size_t)n * sizeof *w);
    double s = 0, a = 0;
    CHECK(w);
    CHECK_EQ(moe_dequantize(type, row, w, n), 0);
    for (int64_t i = 0; i < n; i++) {
        s += (double)w[i] * x[i];
        a += fabs((double)w[i] * x[i]);
    }
    free(w);
    *abs_sum = a;
    return s;
}

static void check_close(double got, double want, double abs_sum, const char *what, uint32_t type,
                        int64_t n)
{
    double tol = 1e-5 * abs_sum + 1e-30;
    CHECK_MSG(fabs(got - want) <= tol, "%s %s n=%lld: %.9g vs %.9g (tol %.3g)", what,
              moe_type_get(type)->name, (long long)n, got, want, tol);
}

static void vec_dot_all(int scalar)
{
    moe_kernels_force_scalar(scalar);
    moe_test_rng_seed(11 + (uint64_t)scalar);
    for (size_t t = 0; t < N_TYPES; t++) {
        uint32_t type = all_types[t];
        int64_t sizes[8];
        int64_t ns = sizes_for(type, sizes);
        for (int64_t s = 0; s < ns; s++) {
            int64_t n = sizes[s];
            uint8_t *w = make_weights(type, 2, n);
            float *x = make_x(n);
            for (int r = 0; r < 2; r++) {
                const uint8_t *row = w + (size_t)r * moe_row_bytes(type, n);
                double a, want = ref_dot(type, row, x, n, &a);
                check_close(moe_vec_dot(type, row, x, n), want, a, "vec_dot", type, n);
            }
            free(w), free(x);
        }
    }
    moe_kernels_force_scalar(0);
}

TEST(kernels_vec_dot_scalar)
{
    vec_dot_all(1);
}

TEST(kernels_vec_dot_simd)
{
    if (!moe_kernels_simd())
        moe_test_skip("no SIMD path on this CPU");
    vec_dot_all(0);
}

/* The SIMD and scalar paths agree with each other on the same data (both within float rounding
 * of the reference, so within twice the tolerance of each other). */
TEST(kernels_simd_matches_scalar)
{
    if (!moe_kernels_simd())
        moe_test_skip("no SIMD path on this CPU");
    moe_test_rng_seed(5);
    for (size_t t = 0; t < N_TYPES; t++) {
        uint32_t type = all_types[t];
        int64_t n = moe_type_get(type)->blck == 256 ? 2048 : 1024;
        uint8_t *w = make_weights(type, 1, n);
        float *x = make_x(n);
        double a, want;
        want = ref_dot(type, w, x, n, &a);
        moe_kernels_force_scalar(1);
        float s = moe_vec_dot(type, w, x, n);
        moe_kernels_force_scalar(0);
        float v = moe_vec_dot(type, w, x, n);
        check_close(s, want, a, "scalar", type, n);
        check_close(v, want, a, "simd", type, n);
        check_close(v, s, 2 * a, "simd-vs-scalar", type, n);
        free(w), free(x);
    }
}

/* Blocks of random bytes (random codes, scales, high bits and mins) through both paths; header
 * fields are set to finite halves so the sums stay finite. */
TEST(kernels_random_bytes)
{
    static const struct { uint32_t type; int hdr[4]; } hdrs[] = {
        {MOE_TYPE_Q4_0, {0, -1}}, {MOE_TYPE_Q4_1, {0, 2, -1}}, {MOE_TYPE_Q5_0, {0, -1}},
        {MOE_TYPE_Q5_1, {0, 2, -1}}, {MOE_TYPE_Q8_0, {0, -1}}, {MOE_TYPE_Q4_K, {0, 2, -1}},
        {MOE_TYPE_Q5_K, {0, 2, -1}}, {MOE_TYPE_Q6_K, {208, -1}},
    };
    moe_test_rng_seed(99);
    for (size_t h = 0; h < sizeof hdrs / sizeof hdrs[0]; h++) {
        uint32_t type = hdrs[h].type;
        const struct moe_type_info *ti = moe_type_get(type);
        int64_t n = ti->blck * 8;
        size_t rb = moe_row_bytes(type, n);
        uint8_t *w = malloc(rb);
        CHECK(w);
        for (size_t i = 0; i < rb; i++)
            w[i] = (uint8_t)moe_test_rng_u32();
        for (int64_t b = 0; b < n / ti->blck; b++)
            for (int k = 0; hdrs[h].hdr[k] >= 0; k++) {
                uint16_t half = moe_f32_to_f16(rng_f() * 0.01f);
                w[b * ti->size + hdrs[h].hdr[k]] = (uint8_t)half;
                w[b * ti->size + hdrs[h].hdr[k] + 1] = (uint8_t)(half >> 8);
            }
        float *x = make_x(n);
        double a, want = ref_dot(type, w, x, n, &a);
        moe_kernels_force_scalar(1);
        check_close(moe_vec_dot(type, w, x, n), want, a, "scalar", type, n);
        moe_kernels_force_scalar(0);
        check_close(moe_vec_dot(type, w, x, n), want, a, "default", type, n);
        free(w), free(x);
    }
}

static void matvec_all(int scalar)
{
    const int64_t rows = 37, r0 = 5, r1 = 30;
    const float poison = -12345.0f;
    moe_kernels_force_scalar(scalar);
    moe_test_rng_seed(21);
    for (size_t t = 0; t < N_TYPES; t++) {
        uint32_t type = all_types[t];
        uint32_t blck = moe_type_get(type)->blck;
        int64_t n = blck == 256 ? 2304 : blck == 32 ? 1088 : 1031;
        size_t rb = moe_row_bytes(type, n);
        uint8_t *w = make_weights(type, rows, n);
        float *x = make_x(n), y[37];
        for (int64_t r = 0; r < rows; r++)
            y[r] = poison;
        moe_matvec(type, w, n, x, y, r0, r1);
        for (int64_t r = 0; r < rows; r++) {
            if (r < r0 || r >= r1) {
                CHECK_MSG(y[r] == poison, "%s: matvec wrote row %lld outside [%lld,%lld)",
                          moe_type_get(type)->name, (long long)r, (long long)r0, (long long)r1);
                continue;
            }
            double a, want = ref_dot(type, w + rb * (size_t)r, x, n, &a);
            check_close(y[r], want, a, "matvec", type, n);
            check_close(y[r], moe_vec_dot(type, w + rb * (size_t)r, x, n), 2 * a, "matvec-vs-dot",
                        type, n);
        }
        free(w), free(x);
    }
    moe_kernels_force_scalar(0);
}

TEST(kernels_matvec_scalar)
{
    matvec_all(1);
}

TEST(kernels_matvec_simd)
{
    matvec_all(0);
}

/* matmul with strided X and Y, a row range, and token counts on both sides of the switch to
 * the decode-once path and past one token block (64); everything outside the written rectangle
 * stays untouched. */
static void matmul_all(int scalar)
{
    const int64_t rows = 41, r0 = 3, r1 = 38, ldy = 45;
    const float poison = 7777.0f;
    static const int64_t toks[] = {1, 2, 3, 8, 67};
    const int64_t max_tok = 67;
    moe_kernels_force_scalar(scalar);
    moe_test_rng_seed(31);
    for (size_t t = 0; t < N_TYPES; t++) {
        uint32_t type = all_types[t];
        uint32_t blck = moe_type_get(type)->blck;
        int64_t n = blck == 256 ? 1280 : blck == 32 ? 1056 : 1029;
        int64_t ldx = n + 3;
        size_t rb = moe_row_bytes(type, n);
        uint8_t *w = make_weights(type, rows, n);
        float *X = make_x(ldx * max_tok);
        float *Y = malloc(sizeof(float) * ldy * max_tok);
        CHECK(Y);
        for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++) {
            int64_t nt = toks[k];
            for (int64_t i = 0; i < ldy * max_tok; i++)
                Y[i] = poison;
            moe_matmul(type, w, n, X, ldx, nt, Y, ldy, r0, r1);
            for (int64_t tk = 0; tk < max_tok; tk++) {
                for (int64_t r = 0; r < ldy; r++) {
                    float got = Y[tk * ldy + r];
                    if (tk >= nt || r < r0 || r >= r1) {
                        CHECK_MSG(got == poison, "%s n_tok=%lld: wrote Y[%lld][%lld]",
                                  moe_type_get(type)->name, (long long)nt, (long long)tk,
                                  (long long)r);
                        continue;
                    }
                    double a, want = ref_dot(type, w + rb * (size_t)r, X + tk * ldx, n, &a);
                    check_close(got, want, a, "matmul", type, n);
                }
            }
        }
        free(w), free(X), free(Y);
    }
    moe_kernels_force_scalar(0);
}

TEST(kernels_matmul_scalar)
{
    matmul_all(1);
}

TEST(kernels_matmul_simd)
{
    matmul_all(0);
}

TEST(kernels_unsupported_type_gives_nan)
{
    uint8_t w[84 * 2] = {0};
    float x[256] = {0}, y[2] = {0, 0};
    CHECK(isnan(moe_vec_dot(MOE_TYPE_Q2_K, w, x, 256)));
    moe_matvec(MOE_TYPE_Q2_K, w, 256, x, y, 0, 1);
    CHECK(isnan(y[0]) && y[1] == 0);
}

/* Zero-length rows give zero dot products (and matmul still writes its rectangle). */
TEST(kernels_empty_rows)
{
    float x[4] = {1, 2, 3, 4}, Y[6] = {9, 9, 9, 9, 9, 9};
    uint8_t w[4] = {0};
    CHECK(moe_vec_dot(MOE_TYPE_Q4_K, w, x, 0) == 0.0f);
    moe_matmul(MOE_TYPE_F16, w, 0, x, 0, 3, Y, 2, 0, 1);
    CHECK(Y[0] == 0 && Y[2] == 0 && Y[4] == 0);
    CHECK(Y[1] == 9 && Y[3] == 9 && Y[5] == 9);
}

/* The routing's top-k rule, shared by the CPU routing, its layer-ahead guess and the prediction
 * study: best first, ties to the lower index, NaN never beats a number, a pick always made (the
 * last NaN when only NaNs are left), the taken marks cleared again. */
TEST(kernels_topk_argmax_rule)
{
    const float r[8] = {0.5f, NAN, 0.7f, 0.7f, -1.0f, NAN, 0.1f, 0.7f};
    uint8_t taken[8] = {0};
    int32_t out[8];
    moe_topk_argmax(r, 8, 8, taken, out);
    const int32_t want[8] = {2, 3, 7, 0, 6, 4, 5, 1};
    for (int i = 0; i < 8; i++)
        CHECK_EQ(out[i], want[i]);
    for (int i = 0; i < 8; i++)
        CHECK_EQ(taken[i], 0);
    moe_topk_argmax(r, 8, 2, taken, out);
    CHECK_EQ(out[0], 2);
    CHECK_EQ(out[1], 3);
    const float all_nan[3] = {NAN, NAN, NAN};
    moe_topk_argmax(all_nan, 3, 2, taken, out);
    CHECK_EQ(out[0], 2);
    CHECK_EQ(out[1], 1);
    const float inf[3] = {-INFINITY, INFINITY, -INFINITY};
    moe_topk_argmax(inf, 3, 3, taken, out);
    CHECK_EQ(out[0], 1);
    CHECK_EQ(out[1], 0);
    CHECK_EQ(out[2], 2);
}

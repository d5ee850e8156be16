/* worker/cuda/mv_tc.cu, the tensor-core mat-vec, against the CPU path: Q4_K and Q6_K weights made by
 * moe_quantize, several shapes (rows not a multiple of the 16-row tile, rows shorter than the
 * eight warps of a block, 1 to 17 tokens so that a launch has partial token groups), each token's
 * inputs of its own magnitude (1e-4 to 1e4: the power-of-two scaling of the f16 parts). Every
 * element within 1e-5 of the row's Σ|w·x| of moe_matvec's result, y poisoned with NaN first; a
 * token's result the same bits whatever n_tok is and whichever tokens share its launch, and
 * whether the block or a launch of its own stages the inputs (moe_cuda_matvec_tc_ws); two runs
 * bit-identical. Without a GPU every test skips. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "store/err.h"
#include "store/ggml_type.h"
#include "store/quant.h"
#include "tests/gpu/gpu_test.h"
#include "tests/harness.h"
#include "worker/cpu/kernels.h"
#include "worker/cuda/matvec.h"
#include "worker/cuda/mv_tc.h"

/* Token t's input scale: a spread of magnitudes. */
static float tok_scale(int64_t t)
{
    static const float sc[] = {1.0f, 1e-4f, 3e3f, 0.01f, 1e4f, 7.0f};
    return sc[t % 6];
}

static void check_shape(uint32_t type, const uint8_t *w, int64_t n, int64_t rows, cudaStream_t st)
{
    static const int64_t toks[] = {1, 2, 3, 8, 9, 17};
    const int64_t max_tok = 17;
    const size_t rb = moe_row_bytes(type, n), wb = rb * (size_t)rows;
    float *x = malloc(sizeof(float) * (size_t)(n * max_tok));
    float *ycpu = malloc(sizeof(float) * (size_t)(rows * max_tok));
    float *y = malloc(sizeof(float) * (size_t)(rows * max_tok));
    float *y1 = malloc(sizeof(float) * (size_t)(rows * max_tok)); /* each token alone */
    float *d = malloc(sizeof(float) * (size_t)n);
    double *as = malloc(sizeof(double) * (size_t)(rows * max_tok));
    CHECK(x && ycpu && y && y1 && d && as);
    for (int64_t t = 0; t < max_tok; t++) {
        for (int64_t i = 0; i < n; i++)
            x[t * n + i] = rng_f() * 2.0f * tok_scale(t);
        moe_matvec(type, w, n, x + t * n, ycpu + t * rows, 0, rows);
    }
    for (int64_t r = 0; r < rows; r++) {
        CHECK_EQ(moe_dequantize(type, w + rb * (size_t)r, d, n), 0);
        for (int64_t t = 0; t < max_tok; t++) {
            double a = 0.0;
            for (int64_t i = 0; i < n; i++)
                a += fabs((double)d[i] * x[t * n + i]);
            as[t * rows + r] = a;
        }
    }
    uint8_t *dw;
    float *dx, *dy;
    CU(cudaMalloc((void **)&dw, wb));
    CU(cudaMalloc((void **)&dx, sizeof(float) * (size_t)(n * max_tok)));
    CU(cudaMalloc((void **)&dy, sizeof(float) * (size_t)(rows * max_tok)));
    CU(cudaMemcpyAsync(dw, w, wb, cudaMemcpyHostToDevice, st));
    CU(cudaMemcpyAsync(dx, x, sizeof(float) * (size_t)(n * max_tok), cudaMemcpyHostToDevice, st));
    const size_t ws_bytes = moe_cuda_matvec_tc_ws_bytes(n, max_tok);
    void *dws;
    CU(cudaMalloc(&dws, ws_bytes));

    /* Each token alone first: the reference bits for the batched launches. */
    for (int64_t t = 0; t < max_tok; t++) {
        CU(cudaMemsetAsync(dy, 0xff, sizeof(float) * (size_t)rows, st));
        int rc = moe_cuda_matvec_tc(type, dw, n, rows, dx + t * n, n, 1, dy, rows, st);
        CHECK_MSG(rc == 0, "n=%lld rows=%lld: %s", (long long)n, (long long)rows,
                  moe_strerror(rc));
        CU(cudaMemcpyAsync(y1 + t * rows, dy, sizeof(float) * (size_t)rows,
                           cudaMemcpyDeviceToHost, st));
    }
    CU(cudaStreamSynchronize(st));
    for (int64_t t = 0; t < max_tok; t++)
        for (int64_t r = 0; r < rows; r++) {
            const size_t k = (size_t)(t * rows + r);
            CHECK_MSG(fabs((double)y1[k] - (double)ycpu[k]) <= 1e-5 * as[k],
                      "%s n=%lld rows=%lld token %lld (scale %g) row %lld: gpu %.9g cpu %.9g "
                      "(tol %.3g)", moe_type_get(type)->name, (long long)n, (long long)rows,
                      (long long)t,
                      (double)tok_scale(t), (long long)r, (double)y1[k], (double)ycpu[k],
                      1e-5 * as[k]);
        }
    for (size_t i = 0; i < sizeof toks / sizeof toks[0]; i++) {
        const int64_t nt = toks[i];
        /* Runs 0 and 1 stage the inputs in each block, run 2 once into a workspace. */
        for (int run = 0; run < 3; run++) {
            CU(cudaMemsetAsync(dy, 0xff, sizeof(float) * (size_t)(rows * max_tok), st));
            if (run == 2)
                CU(cudaMemsetAsync(dws, 0xff, ws_bytes, st));
            int rc = run < 2 ? moe_cuda_matvec_tc(type, dw, n, rows, dx, n, nt, dy, rows, st)
                             : moe_cuda_matvec_tc_ws(type, dw, n, rows, dx, n, nt, dy, rows, dws,
                                                     ws_bytes, st);
            CHECK_EQ(rc, 0);
            CU(cudaMemcpyAsync(y, dy, sizeof(float) * (size_t)(rows * max_tok),
                               cudaMemcpyDeviceToHost, st));
            CU(cudaStreamSynchronize(st));
            CHECK_MSG(floats_differing(y, y1, (size_t)(rows * nt)) == 0,
                      "n=%lld rows=%lld n_tok=%lld run %d: %zu floats differ from the tokens "
                      "alone", (long long)n, (long long)rows, (long long)nt, run,
                      floats_differing(y, y1, (size_t)(rows * nt)));
            /* Nothing past the last token is written. */
            for (int64_t k = rows * nt; k < rows * max_tok; k++)
                CHECK_MSG(isnan(y[k]), "n=%lld rows=%lld n_tok=%lld: y[%lld] written past the "
                          "tokens", (long long)n, (long long)rows, (long long)nt, (long long)k);
        }
    }
    CU(cudaFree(dw));
    CU(cudaFree(dx));
    CU(cudaFree(dy));
    CU(cudaFree(dws));
    free(x);
    free(ycpu);
    free(y);
    free(y1);
    free(d);
    free(as);
}

static void check_type(uint32_t type, uint64_t seed)
{
    static const int64_t ns[] = {256, 768, 2048, 4096};
    static const int64_t rowss[] = {1, 16, 131, 768};
    need_gpu();
    moe_test_rng_seed(seed);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        uint8_t *w = make_weights(type, 768, ns[i]);
        for (size_t k = 0; k < sizeof rowss / sizeof rowss[0]; k++)
            check_shape(type, w, ns[i], rowss[k], st);
        free(w);
    }
    CU(cudaStreamDestroy(st));
}

TEST(cuda_mv_tc_q4_k_equals_the_cpu) { check_type(MOE_TYPE_Q4_K, 211); }
TEST(cuda_mv_tc_q6_k_equals_the_cpu) { check_type(MOE_TYPE_Q6_K, 213); }

/* moe_cuda_matvec_tc_multi: three matrices of one type (rows not multiples of the tile) over the
 * same inputs in one launch, adding into y: each y equals its initial value plus the single
 * matrix's launch, bit for bit, for 1, 5 and 9 tokens. */
static void check_multi(uint32_t type, uint64_t seed)
{
    need_gpu();
    moe_test_rng_seed(seed);
    const int64_t n = 512, nt_max = 9, rows[3] = {131, 16, 40};
    float *x = malloc(sizeof(float) * (size_t)(n * nt_max)), *dx;
    CHECK(x);
    for (int64_t i = 0; i < n * nt_max; i++)
        x[i] = rng_f() * 3.0f;
    CU(cudaMalloc((void **)&dx, sizeof(float) * (size_t)(n * nt_max)));
    CU(cudaMemcpy(dx, x, sizeof(float) * (size_t)(n * nt_max), cudaMemcpyHostToDevice));
    uint8_t *w[3], *dw[3];
    float *y0[3], *y1[3], *ym[3], *dy[3];
    struct moe_mv_job jobs[3];
    for (int j = 0; j < 3; j++) {
        const size_t wb = moe_row_bytes(type, n) * (size_t)rows[j];
        const size_t yb = sizeof(float) * (size_t)(rows[j] * nt_max);
        w[j] = make_weights(type, rows[j], n);
        y0[j] = malloc(yb), y1[j] = malloc(yb), ym[j] = malloc(yb);
        CHECK(y0[j] && y1[j] && ym[j]);
        for (int64_t i = 0; i < rows[j] * nt_max; i++)
            y0[j][i] = rng_f();
        CU(cudaMalloc((void **)&dw[j], wb));
        CU(cudaMalloc((void **)&dy[j], yb));
        CU(cudaMemcpy(dw[j], w[j], wb, cudaMemcpyHostToDevice));
        jobs[j] = (struct moe_mv_job){dw[j], rows[j], dy[j], rows[j]};
    }
    static const int64_t toks[] = {1, 5, 9};
    for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++) {
        const int64_t nt = toks[k];
        for (int j = 0; j < 3; j++) {
            CU(cudaMemset(dy[j], 0xff, sizeof(float) * (size_t)(rows[j] * nt_max)));
            CHECK_EQ(moe_cuda_matvec_tc(type, dw[j], n, rows[j], dx, n, nt, dy[j], rows[j], 0), 0);
            CU(cudaMemcpy(y1[j], dy[j], sizeof(float) * (size_t)(rows[j] * nt),
                          cudaMemcpyDeviceToHost));
            CU(cudaMemcpy(dy[j], y0[j], sizeof(float) * (size_t)(rows[j] * nt_max),
                          cudaMemcpyHostToDevice));
        }
        CHECK_EQ(moe_cuda_matvec_tc_multi(type, jobs, 3, n, dx, n, nt, 1, 0), 0);
        for (int j = 0; j < 3; j++) {
            CU(cudaMemcpy(ym[j], dy[j], sizeof(float) * (size_t)(rows[j] * nt_max),
                          cudaMemcpyDeviceToHost));
            size_t bad = 0;
            for (int64_t i = 0; i < rows[j] * nt_max; i++) {
                const float want = i < rows[j] * nt ? y0[j][i] + y1[j][i] : y0[j][i];
                bad += memcmp(&want, &ym[j][i], sizeof want) != 0;
            }
            CHECK_MSG(bad == 0, "%s job %d, %lld tokens: %zu floats differ",
                      moe_type_get(type)->name, j, (long long)nt, bad);
        }
    }
    for (int j = 0; j < 3; j++) {
        CU(cudaFree(dw[j]));
        CU(cudaFree(dy[j]));
        free(w[j]), free(y0[j]), free(y1[j]), free(ym[j]);
    }
    CU(cudaFree(dx));
    free(x);
}

TEST(cuda_mv_tc_multi_accumulates_each_matrix)
{
    check_multi(MOE_TYPE_Q4_K, 214);
    check_multi(MOE_TYPE_Q6_K, 215);
}

/* moe_cuda_matvec_tc_norm: one token with the RMSNorm on the way. The normalised row it stores
 * is the host's x · rsqrt(mean(x²) + eps) · g within 1e-6 of each element, and its products are
 * moe_cuda_matvec_tc_multi's on that stored row bit for bit (without a row to store too): each
 * block normalises the row itself, so every block must reach the same floats. Rows of 256, 2048
 * (8 warps a tile) and 4096 (16 blocks a row), three matrices of rows not multiple of the tile. */
static void check_norm(uint32_t type, uint64_t seed)
{
    need_gpu();
    moe_test_rng_seed(seed);
    static const int64_t ns[] = {256, 2048, 4096};
    const int64_t rows[3] = {131, 16, 40};
    const float eps = 1e-6f;
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        const int64_t n = ns[k];
        float *x = malloc(sizeof(float) * (size_t)n), *g = malloc(sizeof(float) * (size_t)n);
        float *xn = malloc(sizeof(float) * (size_t)n);
        CHECK(x && g && xn);
        for (int64_t i = 0; i < n; i++) {
            x[i] = rng_f() * (i % 97 == 0 ? 40.0f : 3.0f);
            g[i] = 0.5f + rng_f();
        }
        float *dx, *dg, *dn;
        CU(cudaMalloc((void **)&dx, sizeof(float) * (size_t)n));
        CU(cudaMalloc((void **)&dg, sizeof(float) * (size_t)n));
        CU(cudaMalloc((void **)&dn, sizeof(float) * (size_t)n));
        CU(cudaMemcpy(dx, x, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice));
        CU(cudaMemcpy(dg, g, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice));
        CU(cudaMemset(dn, 0xff, sizeof(float) * (size_t)n));
        uint8_t *w[3], *dw[3];
        float *dy[3], *dy2[3], *ya[3], *yb[3];
        struct moe_mv_job jobs[3], jobs2[3];
        for (int j = 0; j < 3; j++) {
            const size_t wb = moe_row_bytes(type, n) * (size_t)rows[j];
            w[j] = make_weights(type, rows[j], n);
            ya[j] = malloc(sizeof(float) * (size_t)rows[j]);
            yb[j] = malloc(sizeof(float) * (size_t)rows[j]);
            CHECK(ya[j] && yb[j]);
            CU(cudaMalloc((void **)&dw[j], wb));
            CU(cudaMalloc((void **)&dy[j], sizeof(float) * (size_t)rows[j]));
            CU(cudaMalloc((void **)&dy2[j], sizeof(float) * (size_t)rows[j]));
            CU(cudaMemcpy(dw[j], w[j], wb, cudaMemcpyHostToDevice));
            CU(cudaMemset(dy[j], 0xff, sizeof(float) * (size_t)rows[j]));
            CU(cudaMemset(dy2[j], 0xff, sizeof(float) * (size_t)rows[j]));
            jobs[j] = (struct moe_mv_job){dw[j], rows[j], dy[j], rows[j]};
            jobs2[j] = (struct moe_mv_job){dw[j], rows[j], dy2[j], rows[j]};
        }
        CHECK_EQ(moe_cuda_matvec_tc_norm(type, jobs, 3, n, dx, dg, eps, dn, 0), 0);
        CU(cudaMemcpy(xn, dn, sizeof(float) * (size_t)n, cudaMemcpyDeviceToHost));
        double ss = 0;
        for (int64_t i = 0; i < n; i++)
            ss += (double)x[i] * x[i];
        const double sc = 1.0 / sqrt(ss / (double)n + eps);
        size_t far = 0;
        for (int64_t i = 0; i < n; i++) {
            const double want = x[i] * sc * g[i];
            far += !(fabs(xn[i] - want) <= 1e-6 * fabs(want) + 1e-30);
        }
        CHECK_MSG(far == 0, "%s n=%lld: %zu normalised elements off", moe_type_get(type)->name,
                  (long long)n, far);
        CHECK_EQ(moe_cuda_matvec_tc_multi(type, jobs2, 3, n, dn, n, 1, 0, 0), 0);
        for (int j = 0; j < 3; j++) {
            CU(cudaMemcpy(ya[j], dy[j], sizeof(float) * (size_t)rows[j], cudaMemcpyDeviceToHost));
            CU(cudaMemcpy(yb[j], dy2[j], sizeof(float) * (size_t)rows[j],
                          cudaMemcpyDeviceToHost));
            CHECK_MSG(memcmp(ya[j], yb[j], sizeof(float) * (size_t)rows[j]) == 0,
                      "%s n=%lld job %d: products differ from the stored row's",
                      moe_type_get(type)->name, (long long)n, j);
            CU(cudaMemset(dy[j], 0xff, sizeof(float) * (size_t)rows[j]));
        }
        CHECK_EQ(moe_cuda_matvec_tc_norm(type, jobs, 3, n, dx, dg, eps, NULL, 0), 0);
        for (int j = 0; j < 3; j++) {
            CU(cudaMemcpy(ya[j], dy[j], sizeof(float) * (size_t)rows[j], cudaMemcpyDeviceToHost));
            CHECK(memcmp(ya[j], yb[j], sizeof(float) * (size_t)rows[j]) == 0);
        }
        /* Misaligned rows are refused (the backend then launches the RMSNorm first). */
        CHECK_EQ(moe_cuda_matvec_tc_norm(type, jobs, 3, n, dx + 1, dg, eps, dn, 0), -EINVAL);
        for (int j = 0; j < 3; j++) {
            CU(cudaFree(dw[j]));
            CU(cudaFree(dy[j]));
            CU(cudaFree(dy2[j]));
            free(w[j]), free(ya[j]), free(yb[j]);
        }
        CU(cudaFree(dx));
        CU(cudaFree(dg));
        CU(cudaFree(dn));
        free(x), free(g), free(xn);
    }
}

TEST(cuda_mv_tc_norm_equals_the_normalised_row)
{
    check_norm(MOE_TYPE_Q4_K, 216);
    check_norm(MOE_TYPE_Q6_K, 217);
}

/* Non-finite inputs give a non-finite result, as the float walk does, and do not spoil the
 * tokens beside them. */
TEST(cuda_mv_tc_non_finite_inputs)
{
    need_gpu();
    moe_test_rng_seed(212);
    const int64_t n = 512, rows = 32, nt = 3;
    uint8_t *w = make_weights(MOE_TYPE_Q4_K, rows, n);
    float x[3 * 512], y[3 * 32], yc[32];
    for (int64_t i = 0; i < nt * n; i++)
        x[i] = rng_f();
    x[n + 17] = NAN;
    x[2 * n + 300] = INFINITY;
    uint8_t *dw;
    float *dx, *dy;
    const size_t wb = moe_row_bytes(MOE_TYPE_Q4_K, n) * rows;
    CU(cudaMalloc((void **)&dw, wb));
    CU(cudaMalloc((void **)&dx, sizeof x));
    CU(cudaMalloc((void **)&dy, sizeof y));
    CU(cudaMemcpy(dw, w, wb, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dx, x, sizeof x, cudaMemcpyHostToDevice));
    CHECK_EQ(moe_cuda_matvec_tc(MOE_TYPE_Q4_K, dw, n, rows, dx, n, nt, dy, rows, 0), 0);
    CU(cudaMemcpy(y, dy, sizeof y, cudaMemcpyDeviceToHost));
    moe_matvec(MOE_TYPE_Q4_K, w, n, x, yc, 0, rows);
    for (int64_t r = 0; r < rows; r++) {
        CHECK(isfinite(y[r]));
        CHECK(fabs((double)y[r] - (double)yc[r]) <= 1e-3);
        CHECK(!isfinite(y[rows + r]));
    }
    CU(cudaFree(dw));
    CU(cudaFree(dx));
    CU(cudaFree(dy));
    free(w);
}

TEST(cuda_mv_tc_rejects_bad_arguments)
{
    need_gpu();
    float *dx, *dy;
    uint8_t *dw;
    CU(cudaMalloc((void **)&dw, 1 << 20));
    CU(cudaMalloc((void **)&dx, 1 << 16));
    CU(cudaMalloc((void **)&dy, 1 << 16));
    CHECK_EQ(moe_cuda_matvec_tc(MOE_TYPE_Q5_K, dw, 256, 16, dx, 256, 1, dy, 16, 0),
             MOE_EUNSUPPORTED);
    CHECK_EQ(moe_cuda_matvec_tc(MOE_TYPE_Q4_K, dw, 100, 16, dx, 256, 1, dy, 16, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec_tc(MOE_TYPE_Q4_K, dw, 256, 16, dx, 255, 1, dy, 16, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec_tc(MOE_TYPE_Q4_K, dw + 4, 256, 16, dx, 256, 1, dy, 16, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec_tc(MOE_TYPE_Q4_K, dw, 256, 16, dx, 256, 1, dy, 15, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec_tc(MOE_TYPE_Q4_K, NULL, 256, 16, dx, 256, 1, dy, 16, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec_tc(MOE_TYPE_Q4_K, dw, 256, 0, dx, 256, 1, dy, 16, 0), 0);
    /* A workspace too small for the tokens, or misaligned. */
    const size_t ws = moe_cuda_matvec_tc_ws_bytes(256, 2);
    CHECK(ws > moe_cuda_matvec_tc_ws_bytes(256, 1));
    CHECK_EQ(moe_cuda_matvec_tc_ws(MOE_TYPE_Q4_K, dw, 256, 16, dx, 256, 2, dy, 16, dx, ws - 1, 0),
             -EINVAL);
    CHECK_EQ(moe_cuda_matvec_tc_ws(MOE_TYPE_Q4_K, dw, 256, 16, dx, 256, 2, dy, 16,
                                   (uint8_t *)dy + 4, ws, 0),
             -EINVAL);
    CU(cudaFree(dw));
    CU(cudaFree(dx));
    CU(cudaFree(dy));
}

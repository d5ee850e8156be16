/* worker/cuda/matvec.cu against the CPU path: for every type the CUDA kernel supports, several
 * shapes, weights made by moe_quantize from random floats, y from the GPU compared with
 * moe_matvec's y element by element within 1e-5 of the row's Σ|w·x| (only the float summation
 * order differs). Weights are read from VRAM, from cudaHostRegister'ed host memory and from
 * cudaHostAlloc'ed host memory, both mapped into the device. y is poisoned with NaN before every
 * launch, so an element the kernel never wrote fails, and each VRAM case runs twice and must give
 * bit-identical results (a difference would mean a race). Without a GPU every test skips. */
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


/* Every type with a CUDA mat-vec kernel. */
static const uint32_t TYPES[] = {MOE_TYPE_F32,  MOE_TYPE_F16,  MOE_TYPE_BF16, MOE_TYPE_Q8_0,
                                 MOE_TYPE_Q4_0, MOE_TYPE_Q5_0, MOE_TYPE_Q4_1, MOE_TYPE_Q5_1,
                                 MOE_TYPE_Q4_K, MOE_TYPE_Q5_K, MOE_TYPE_Q6_K};
#define N_TYPES (sizeof TYPES / sizeof TYPES[0])

enum mem_kind { MEM_VRAM, MEM_REGISTERED, MEM_HOSTALLOC };
static const char *mem_name[] = {"vram", "host-registered", "host-alloc"};




/* Σ|w_i x_i| of each row, from the reference decoder, in double: the error scale. */
static double *abs_sums(uint32_t type, const uint8_t *w, int64_t rows, int64_t n, const float *x)
{
    size_t rb = moe_row_bytes(type, n);
    double *s = malloc((size_t)rows * sizeof *s);
    float *d = malloc((size_t)n * sizeof *d);
    CHECK(s && d);
    for (int64_t r = 0; r < rows; r++) {
        CHECK_EQ(moe_dequantize(type, w + rb * (size_t)r, d, n), 0);
        double a = 0;
        for (int64_t i = 0; i < n; i++)
            a += fabs((double)d[i] * x[i]);
        s[r] = a;
    }
    free(d);
    return s;
}

/* One launch over `rows` rows of w with W placed in `mem`; y compared with the CPU result. */
static void check_case(uint32_t type, const uint8_t *w, int64_t n, int64_t rows, enum mem_kind mem,
                       cudaStream_t st)
{
    const char *tn = moe_type_get(type)->name;
    size_t wbytes = moe_row_bytes(type, n) * (size_t)rows;
    float *x = malloc((size_t)n * sizeof *x);
    float *ycpu = malloc((size_t)rows * sizeof *ycpu);
    float *ygpu = malloc((size_t)rows * sizeof *ygpu);
    float *ygpu2 = malloc((size_t)rows * sizeof *ygpu2);
    CHECK(x && ycpu && ygpu && ygpu2);
    for (int64_t i = 0; i < n; i++)
        x[i] = rng_f() * 2.0f;
    moe_matvec(type, w, n, x, ycpu, 0, rows);
    double *as = abs_sums(type, w, rows, n, x);

    void *dw = NULL, *host = NULL;
    float *dx = NULL, *dy = NULL;
    CU(cudaMalloc((void **)&dx, (size_t)n * sizeof *dx));
    CU(cudaMalloc((void **)&dy, (size_t)rows * sizeof *dy));
    /* Copies go on the kernel's stream: a cudaMemcpy from pageable memory may return before the
     * data lands, and a non-blocking stream does not wait for the legacy default stream. */
    CU(cudaMemcpyAsync(dx, x, (size_t)n * sizeof *dx, cudaMemcpyHostToDevice, st));
    if (mem == MEM_VRAM) {
        CU(cudaMalloc(&dw, wbytes));
        CU(cudaMemcpyAsync(dw, w, wbytes, cudaMemcpyHostToDevice, st));
    } else if (mem == MEM_REGISTERED) {
        /* What the worker does with the mmap'ed model file: register ordinary host pages. */
        CHECK_EQ(posix_memalign(&host, 4096, wbytes), 0);
        memcpy(host, w, wbytes);
        CU(cudaHostRegister(host, wbytes, cudaHostRegisterMapped));
        CU(cudaHostGetDevicePointer(&dw, host, 0));
    } else {
        CU(cudaHostAlloc(&host, wbytes, cudaHostAllocMapped));
        memcpy(host, w, wbytes);
        CU(cudaHostGetDevicePointer(&dw, host, 0));
    }

    int runs = mem == MEM_VRAM ? 2 : 1;
    for (int run = 0; run < runs; run++) {
        float *out = run ? ygpu2 : ygpu;
        CU(cudaMemsetAsync(dy, 0xff, (size_t)rows * sizeof *dy, st)); /* all-ones bits: NaN */
        int rc = moe_cuda_matvec(type, dw, n, rows, dx, dy, st);
        CHECK_MSG(rc == 0, "%s n=%lld rows=%lld: %s", tn, (long long)n, (long long)rows,
                  moe_strerror(rc));
        CU(cudaMemcpyAsync(out, dy, (size_t)rows * sizeof *dy, cudaMemcpyDeviceToHost, st));
        CU(cudaStreamSynchronize(st));
    }
    for (int64_t r = 0; r < rows; r++) {
        double tol = 1e-5 * as[r];
        CHECK_MSG(isfinite(ygpu[r]), "%s n=%lld rows=%lld %s: y[%lld] not written (%g)", tn,
                  (long long)n, (long long)rows, mem_name[mem], (long long)r, (double)ygpu[r]);
        CHECK_MSG(fabs((double)ygpu[r] - (double)ycpu[r]) <= tol,
                  "%s n=%lld rows=%lld %s: y[%lld] gpu %.9g cpu %.9g (tol %.3g)", tn, (long long)n,
                  (long long)rows, mem_name[mem], (long long)r, (double)ygpu[r], (double)ycpu[r],
                  tol);
    }
    if (runs == 2)
        CHECK_MSG(memcmp(ygpu, ygpu2, (size_t)rows * sizeof *ygpu) == 0,
                  "%s n=%lld rows=%lld: two runs differ", tn, (long long)n, (long long)rows);

    if (mem == MEM_VRAM) {
        CU(cudaFree(dw));
    } else if (mem == MEM_REGISTERED) {
        CU(cudaHostUnregister(host));
        free(host);
    } else {
        CU(cudaFreeHost(host));
    }
    CU(cudaFree(dx));
    CU(cudaFree(dy));
    free(as);
    free(x);
    free(ycpu);
    free(ygpu);
    free(ygpu2);
}

/* Every target shape (n 256..4096, rows 1..2048, rows not a multiple of the 4 rows a
 * thread block takes), plus a short row that leaves most lanes idle and, for the plain types, a
 * row length whose rows are not 16-byte aligned (the kernel's scalar path). Weights for the
 * largest row count are made once per n; smaller cases use the first rows. */
static void check_type(uint32_t type, uint64_t seed)
{
    static const int64_t ns[] = {256, 768, 2048, 4096};
    static const int64_t rowss[] = {1, 7, 128, 131, 2048};
    need_gpu();
    moe_test_rng_seed(seed);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    uint32_t blck = moe_type_get(type)->blck;
    int64_t extra = blck == 1 ? 100 : blck == 32 ? 96 : 0;
    for (size_t i = 0; i < sizeof ns / sizeof ns[0] + (extra ? 1 : 0); i++) {
        int64_t n = i < sizeof ns / sizeof ns[0] ? ns[i] : extra;
        uint8_t *w = make_weights(type, 2048, n);
        for (size_t k = 0; k < sizeof rowss / sizeof rowss[0]; k++) {
            check_case(type, w, n, rowss[k], MEM_VRAM, st);
            check_case(type, w, n, rowss[k], MEM_REGISTERED, st);
        }
        if (n == 2048)
            check_case(type, w, n, 131, MEM_HOSTALLOC, st);
        free(w);
    }
    CU(cudaStreamDestroy(st));
}

/* A token's y does not depend on how many tokens share the launch: every (row, token) of an
 * n_tok launch equals, bit for bit, that token's one-token launch, for token counts that take
 * each per-block token bound (1, 2, 4 and 8 a block, and the remainders), on a short matrix and
 * on one of 32768+ rows (an output head's: 8 tokens a block from 8). With MOE_CUDA_MV_TOK=1 the
 * 16- and 17-token launches of Q4_K, Q5_K and Q6_K rows take the 16-token walk. */
static void check_tokens(uint32_t type, uint64_t seed)
{
    static const int64_t ntoks[] = {2, 3, 5, 8, 9, 16, 17};
    /* Rows of 256 (one block: most lanes idle) and of 2048 (several units a lane). */
    static const int64_t rowss[] = {131, 32771, 67}, ns[] = {256, 256, 2048};
    const int64_t NT = 17;
    need_gpu();
    moe_test_rng_seed(seed);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (size_t k = 0; k < sizeof rowss / sizeof rowss[0]; k++) {
        const int64_t rows = rowss[k], n = ns[k];
        uint8_t *w = make_weights(type, rows, n);
        const size_t wbytes = moe_row_bytes(type, n) * (size_t)rows;
        float *x = malloc(sizeof(float) * (size_t)(n * NT));
        float *y1 = malloc(sizeof(float) * (size_t)(rows * NT));
        float *yn = malloc(sizeof(float) * (size_t)(rows * NT));
        CHECK(w && x && y1 && yn);
        for (int64_t i = 0; i < n * NT; i++)
            x[i] = rng_f() * 2.0f;
        void *dw;
        float *dx, *dy;
        CU(cudaMalloc(&dw, wbytes));
        CU(cudaMalloc((void **)&dx, sizeof(float) * (size_t)(n * NT)));
        CU(cudaMalloc((void **)&dy, sizeof(float) * (size_t)(rows * NT)));
        CU(cudaMemcpyAsync(dw, w, wbytes, cudaMemcpyHostToDevice, st));
        CU(cudaMemcpyAsync(dx, x, sizeof(float) * (size_t)(n * NT), cudaMemcpyHostToDevice, st));
        for (int64_t t = 0; t < NT; t++)
            CHECK_EQ(moe_cuda_matvec_tok(type, dw, n, rows, dx + t * n, n, 1, dy + t * rows, rows,
                                         0, st),
                     0);
        CU(cudaMemcpyAsync(y1, dy, sizeof(float) * (size_t)(rows * NT), cudaMemcpyDeviceToHost,
                           st));
        CU(cudaStreamSynchronize(st));
        for (size_t j = 0; j < sizeof ntoks / sizeof ntoks[0]; j++) {
            const int64_t nt = ntoks[j];
            CU(cudaMemsetAsync(dy, 0xff, sizeof(float) * (size_t)(rows * NT), st));
            CHECK_EQ(moe_cuda_matvec_tok(type, dw, n, rows, dx, n, nt, dy, rows, 0, st), 0);
            CU(cudaMemcpyAsync(yn, dy, sizeof(float) * (size_t)(rows * nt),
                               cudaMemcpyDeviceToHost, st));
            CU(cudaStreamSynchronize(st));
            size_t differ = 0;
            for (int64_t i = 0; i < rows * nt; i++)
                differ += memcmp(&yn[i], &y1[i], sizeof(float)) != 0;
            CHECK_MSG(differ == 0, "%s rows=%lld n_tok=%lld: %zu of %lld floats differ from "
                      "one-token launches", moe_type_get(type)->name, (long long)rows,
                      (long long)nt, differ, (long long)(rows * nt));
        }
        CU(cudaFree(dw));
        CU(cudaFree(dx));
        CU(cudaFree(dy));
        free(w), free(x), free(y1), free(yn);
    }
    CU(cudaStreamDestroy(st));
}

TEST(cuda_matvec_tokens_equal_one_at_a_time)
{
    for (size_t i = 0; i < N_TYPES; i++)
        check_tokens(TYPES[i], 200 + i);
}

TEST(cuda_matvec_f32) { check_type(MOE_TYPE_F32, 101); }
TEST(cuda_matvec_f16) { check_type(MOE_TYPE_F16, 102); }
TEST(cuda_matvec_bf16) { check_type(MOE_TYPE_BF16, 103); }
TEST(cuda_matvec_q8_0) { check_type(MOE_TYPE_Q8_0, 104); }
TEST(cuda_matvec_q4_0) { check_type(MOE_TYPE_Q4_0, 105); }
TEST(cuda_matvec_q5_0) { check_type(MOE_TYPE_Q5_0, 106); }
TEST(cuda_matvec_q4_1) { check_type(MOE_TYPE_Q4_1, 110); }
TEST(cuda_matvec_q5_1) { check_type(MOE_TYPE_Q5_1, 111); }
TEST(cuda_matvec_q4_k) { check_type(MOE_TYPE_Q4_K, 107); }
TEST(cuda_matvec_q5_k) { check_type(MOE_TYPE_Q5_K, 108); }
TEST(cuda_matvec_q6_k) { check_type(MOE_TYPE_Q6_K, 109); }

/* A random RMSNorm source row and norm weight of n elements, and the normalised row the CPU
 * makes of them (sum of squares in double). */
static void norm_input(int64_t n, float eps, float **src, float **g, float **xn)
{
    *src = malloc(sizeof(float) * (size_t)n);
    *g = malloc(sizeof(float) * (size_t)n);
    *xn = malloc(sizeof(float) * (size_t)n);
    CHECK(*src && *g && *xn);
    double ss = 0.0;
    for (int64_t k = 0; k < n; k++) {
        (*src)[k] = rng_f() * 3.0f;
        (*g)[k] = 0.5f + rng_f();
        ss += (double)(*src)[k] * (*src)[k];
    }
    const float sc = (float)(1.0 / sqrt(ss / (double)n + eps));
    for (int64_t k = 0; k < n; k++)
        (*xn)[k] = (*src)[k] * sc * (*g)[k];
}

/* moe_cuda_matvec_multi_norm: the input is RMSNorm(src)·g, made on the way. Against the CPU: the
 * normalised row (double sums) within 1e-5 relative, y within 1e-5 of Σ|w·x| + the row's share
 * of that difference; two jobs (q and k style) in one launch, y and dst poisoned first. */
static void check_norm_type(uint32_t type, uint64_t seed)
{
    static const int64_t ns[] = {256, 2048};
    const int64_t rows = 131, r0 = 100;
    const float eps = 1e-6f;
    need_gpu();
    moe_test_rng_seed(seed);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const char *tn = moe_type_get(type)->name;
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        const int64_t n = ns[i];
        uint8_t *w = make_weights(type, rows, n);
        float *src, *g, *xn;
        norm_input(n, eps, &src, &g, &xn);
        float *dn = malloc(sizeof(float) * (size_t)n);
        float *ycpu = malloc(sizeof(float) * (size_t)rows), *ygpu = malloc(sizeof(float) * (size_t)rows);
        CHECK(dn && ycpu && ygpu);
        moe_matvec(type, w, n, xn, ycpu, 0, rows);
        double *as = abs_sums(type, w, rows, n, xn);
        uint8_t *dw;
        float *dsrc, *dg, *ddst, *dy;
        const size_t wb = moe_row_bytes(type, n) * (size_t)rows;
        CU(cudaMalloc((void **)&dw, wb));
        CU(cudaMalloc((void **)&dsrc, sizeof(float) * (size_t)n));
        CU(cudaMalloc((void **)&dg, sizeof(float) * (size_t)n));
        CU(cudaMalloc((void **)&ddst, sizeof(float) * (size_t)n));
        CU(cudaMalloc((void **)&dy, sizeof(float) * (size_t)rows));
        CU(cudaMemcpyAsync(dw, w, wb, cudaMemcpyHostToDevice, st));
        CU(cudaMemcpyAsync(dsrc, src, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice, st));
        CU(cudaMemcpyAsync(dg, g, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice, st));
        CU(cudaMemsetAsync(ddst, 0xff, sizeof(float) * (size_t)n, st));
        CU(cudaMemsetAsync(dy, 0xff, sizeof(float) * (size_t)rows, st));
        const struct moe_mv_job jobs[2] = {
            {dw, r0, dy, r0},
            {dw + moe_row_bytes(type, n) * (size_t)r0, rows - r0, dy + r0, rows - r0}};
        const int rc = moe_cuda_matvec_multi_norm(type, jobs, 2, n, dsrc, dg, eps, ddst, NULL, st);
        CHECK_MSG(rc == 0, "%s n=%lld: %s", tn, (long long)n, moe_strerror(rc));
        CU(cudaMemcpyAsync(ygpu, dy, sizeof(float) * (size_t)rows, cudaMemcpyDeviceToHost, st));
        CU(cudaMemcpyAsync(dn, ddst, sizeof(float) * (size_t)n, cudaMemcpyDeviceToHost, st));
        CU(cudaStreamSynchronize(st));
        for (int64_t k = 0; k < n; k++)
            CHECK_MSG(fabs((double)dn[k] - xn[k]) <= 1e-5 * fabs((double)xn[k]) + 1e-30,
                      "%s n=%lld: normalised x[%lld] gpu %.9g cpu %.9g", tn, (long long)n,
                      (long long)k, (double)dn[k], (double)xn[k]);
        for (int64_t r = 0; r < rows; r++)
            CHECK_MSG(fabs((double)ygpu[r] - ycpu[r]) <= 2e-5 * as[r],
                      "%s n=%lld: y[%lld] gpu %.9g cpu %.9g", tn, (long long)n, (long long)r,
                      (double)ygpu[r], (double)ycpu[r]);
        /* Misaligned g or dst: refused, so the caller can fall back. */
        CHECK_EQ(moe_cuda_matvec_multi_norm(type, jobs, 2, n, dsrc, dg + 1, eps, ddst, NULL, st), -EINVAL);
        CHECK_EQ(moe_cuda_matvec_multi_norm(type, jobs, 2, n, dsrc, dg, eps, ddst + 1, NULL, st), -EINVAL);
        CU(cudaFree(dw));
        CU(cudaFree(dsrc));
        CU(cudaFree(dg));
        CU(cudaFree(ddst));
        CU(cudaFree(dy));
        free(w), free(src), free(g), free(xn), free(dn), free(ycpu), free(ygpu), free(as);
    }
    CU(cudaStreamDestroy(st));
}

TEST(cuda_matvec_norm_all_types)
{
    for (size_t i = 0; i < N_TYPES; i++)
        check_norm_type(TYPES[i], 500 + i);
}

/* A one-matrix float32 NORM launch (a router; rows up to 2048 wide take a kernel of their own)
 * gives the floats of the general walk bit for bit: its normalised row those of a two-matrix
 * NORM launch (the general walk), its y those of the two-matrix launch and, for each of 3
 * tokens, those of a 3-token plain launch over the normalised row (a decode step of several
 * sequences; up to 2048 wide the plain rows' own kernel); and y within the CPU's tolerance.
 * Widths below, at and above the kernels' bound, a ragged one, rows few and many. */
TEST(cuda_matvec_norm_f32_one_matrix_equals_general_walk)
{
    static const int64_t ns[] = {64, 1000, 2048, 2052}, rowss[] = {128, 5};
    const float eps = 1e-6f;
    need_gpu();
    moe_test_rng_seed(9001);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
        for (size_t ri = 0; ri < sizeof rowss / sizeof rowss[0]; ri++) {
            const int64_t n = ns[ni], rows = rowss[ri], r0 = rows / 2 + 1, T = 3;
            uint8_t *w = make_weights(MOE_TYPE_F32, rows, n);
            float *src, *g, *xn;
            norm_input(n, eps, &src, &g, &xn);
            float *ycpu = malloc(sizeof(float) * (size_t)rows);
            float *da = malloc(sizeof(float) * (size_t)n), *db = malloc(sizeof(float) * (size_t)n);
            float *ya = malloc(sizeof(float) * (size_t)rows), *yb = malloc(sizeof(float) * (size_t)rows);
            float *yc = malloc(sizeof(float) * (size_t)(rows * T));
            CHECK(ycpu && da && db && ya && yb && yc);
            moe_matvec(MOE_TYPE_F32, w, n, xn, ycpu, 0, rows);
            double *as = abs_sums(MOE_TYPE_F32, w, rows, n, xn);
            const size_t wb = moe_row_bytes(MOE_TYPE_F32, n) * (size_t)rows;
            uint8_t *dw;
            float *dsrc, *dg, *dda, *ddb, *dya, *dyb, *dx3, *dyc;
            CU(cudaMalloc((void **)&dw, wb));
            CU(cudaMalloc((void **)&dsrc, sizeof(float) * (size_t)n));
            CU(cudaMalloc((void **)&dg, sizeof(float) * (size_t)n));
            CU(cudaMalloc((void **)&dda, sizeof(float) * (size_t)n));
            CU(cudaMalloc((void **)&ddb, sizeof(float) * (size_t)n));
            CU(cudaMalloc((void **)&dya, sizeof(float) * (size_t)rows));
            CU(cudaMalloc((void **)&dyb, sizeof(float) * (size_t)rows));
            CU(cudaMalloc((void **)&dx3, sizeof(float) * (size_t)(n * T)));
            CU(cudaMalloc((void **)&dyc, sizeof(float) * (size_t)(rows * T)));
            CU(cudaMemcpyAsync(dw, w, wb, cudaMemcpyHostToDevice, st));
            CU(cudaMemcpyAsync(dsrc, src, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice, st));
            CU(cudaMemcpyAsync(dg, g, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice, st));
            CU(cudaMemsetAsync(dda, 0xff, sizeof(float) * (size_t)n, st));
            CU(cudaMemsetAsync(ddb, 0xff, sizeof(float) * (size_t)n, st));
            CU(cudaMemsetAsync(dya, 0xff, sizeof(float) * (size_t)rows, st));
            CU(cudaMemsetAsync(dyb, 0xff, sizeof(float) * (size_t)rows, st));
            CU(cudaMemsetAsync(dyc, 0xff, sizeof(float) * (size_t)(rows * T), st));
            const struct moe_mv_job one = {dw, rows, dya, rows};
            const struct moe_mv_job two[2] = {
                {dw, r0, dyb, r0},
                {dw + moe_row_bytes(MOE_TYPE_F32, n) * (size_t)r0, rows - r0, dyb + r0, rows - r0}};
            int rc = moe_cuda_matvec_multi_norm(MOE_TYPE_F32, &one, 1, n, dsrc, dg, eps, dda, NULL, st);
            CHECK_MSG(rc == 0, "n=%lld rows=%lld: %s", (long long)n, (long long)rows, moe_strerror(rc));
            rc = moe_cuda_matvec_multi_norm(MOE_TYPE_F32, two, 2, n, dsrc, dg, eps, ddb, NULL, st);
            CHECK_MSG(rc == 0, "n=%lld rows=%lld: %s", (long long)n, (long long)rows, moe_strerror(rc));
            for (int64_t t = 0; t < T; t++)
                CU(cudaMemcpyAsync(dx3 + t * n, dda, sizeof(float) * (size_t)n,
                                   cudaMemcpyDeviceToDevice, st));
            rc = moe_cuda_matvec_tok(MOE_TYPE_F32, dw, n, rows, dx3, n, T, dyc, rows, 0, st);
            CHECK_MSG(rc == 0, "n=%lld rows=%lld: %s", (long long)n, (long long)rows, moe_strerror(rc));
            CU(cudaMemcpyAsync(da, dda, sizeof(float) * (size_t)n, cudaMemcpyDeviceToHost, st));
            CU(cudaMemcpyAsync(db, ddb, sizeof(float) * (size_t)n, cudaMemcpyDeviceToHost, st));
            CU(cudaMemcpyAsync(ya, dya, sizeof(float) * (size_t)rows, cudaMemcpyDeviceToHost, st));
            CU(cudaMemcpyAsync(yb, dyb, sizeof(float) * (size_t)rows, cudaMemcpyDeviceToHost, st));
            CU(cudaMemcpyAsync(yc, dyc, sizeof(float) * (size_t)(rows * T), cudaMemcpyDeviceToHost, st));
            CU(cudaStreamSynchronize(st));
            CHECK_MSG(memcmp(da, db, sizeof(float) * (size_t)n) == 0,
                      "n=%lld rows=%lld: normalised rows differ", (long long)n, (long long)rows);
            for (int64_t r = 0; r < rows; r++) {
                CHECK_MSG(memcmp(&ya[r], &yb[r], sizeof(float)) == 0,
                          "n=%lld rows=%lld: y[%lld] one matrix %.9g, two %.9g", (long long)n,
                          (long long)rows, (long long)r, (double)ya[r], (double)yb[r]);
                for (int64_t t = 0; t < T; t++)
                    CHECK_MSG(memcmp(&ya[r], &yc[t * rows + r], sizeof(float)) == 0,
                              "n=%lld rows=%lld: y[%lld] norm launch %.9g, token %lld of %lld %.9g",
                              (long long)n, (long long)rows, (long long)r, (double)ya[r],
                              (long long)t, (long long)T, (double)yc[t * rows + r]);
                CHECK_MSG(fabs((double)ya[r] - ycpu[r]) <= 2e-5 * as[r],
                          "n=%lld: y[%lld] gpu %.9g cpu %.9g", (long long)n, (long long)r,
                          (double)ya[r], (double)ycpu[r]);
            }
            CU(cudaFree(dw));
            CU(cudaFree(dsrc));
            CU(cudaFree(dg));
            CU(cudaFree(dda));
            CU(cudaFree(ddb));
            CU(cudaFree(dya));
            CU(cudaFree(dyb));
            CU(cudaFree(dx3));
            CU(cudaFree(dyc));
            free(w), free(src), free(g), free(xn), free(ycpu), free(da), free(db), free(ya);
            free(yb), free(yc), free(as);
        }
    CU(cudaStreamDestroy(st));
}

/* Types without a CUDA kernel, bad shapes and misaligned pointers are error returns, and rows=0
 * launches nothing (y keeps its contents). */
TEST(cuda_matvec_rejects_bad_arguments)
{
    need_gpu();
    const int64_t n = 256;
    uint8_t *dw;
    float *dx, *dy, y[4];
    CU(cudaMalloc((void **)&dw, 1 << 16));
    CU(cudaMalloc((void **)&dx, 4096 * sizeof(float)));
    CU(cudaMalloc((void **)&dy, 4 * sizeof(float)));
    CU(cudaMemset(dx, 0, 4096 * sizeof(float)));
    CU(cudaMemset(dy, 0x7f, 4 * sizeof(float)));

    static const uint32_t unsupported[] = {MOE_TYPE_Q2_K,
                                           MOE_TYPE_Q3_K, MOE_TYPE_IQ4_NL, MOE_TYPE_MXFP4, 4, 999};
    for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++) {
        CHECK_EQ(moe_cuda_matvec_supported(unsupported[i]), 0);
        CHECK_EQ(moe_cuda_matvec(unsupported[i], dw, n, 4, dx, dy, 0), MOE_EUNSUPPORTED);
    }
    CHECK_EQ(moe_cuda_matvec_supported(MOE_TYPE_Q4_K), 1);
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_Q4_0, dw, 100, 4, dx, dy, 0), -EINVAL); /* 100 % 32 */
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_Q6_K, dw, 128, 4, dx, dy, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_F16, dw, 0, 4, dx, dy, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_F16, dw, n, -1, dx, dy, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_F16, NULL, n, 4, dx, dy, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_F16, dw, n, 4, NULL, dy, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_F16, dw, n, 4, dx, NULL, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_F16, dw, n, 4, dx + 1, dy, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_Q4_K, dw + 8, n, 4, dx, dy, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_F32, dw + 2, n, 4, dx, dy, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_Q8_0, dw + 1, n, 4, dx, dy, 0), -EINVAL);
    CHECK_EQ(moe_cuda_matvec(MOE_TYPE_Q8_0, dw, n, 0, dx, dy, 0), 0);
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(y, dy, sizeof y, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 4; i++) {
        uint32_t bits;
        memcpy(&bits, &y[i], sizeof bits);
        CHECK_EQ(bits, 0x7f7f7f7fu);
    }
    CU(cudaFree(dw));
    CU(cudaFree(dx));
    CU(cudaFree(dy));
}

/* moe_cuda_matvec_mixed: matrices of two types in one launch give, bit for bit, the products of
 * one launch per type, plain (1, 3 and 8 tokens) and with the RMSNorm on the way (one token,
 * the normalised row too); a pair without a kernel is refused. */
static void check_mixed_pair(uint32_t t1, uint32_t t2, uint64_t seed)
{
    static const int64_t ns[] = {256, 2048};
    static const int64_t toks[] = {1, 3, 8};
    const int64_t r1a = 100, r1b = 31, r2 = 45, T = 8;
    const float eps = 1e-6f;
    need_gpu();
    moe_test_rng_seed(seed);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        const int64_t n = ns[i], rows = r1a + r1b + r2;
        uint8_t *w1 = make_weights(t1, r1a + r1b, n), *w2 = make_weights(t2, r2, n);
        const size_t b1 = moe_row_bytes(t1, n) * (size_t)(r1a + r1b);
        const size_t b2 = moe_row_bytes(t2, n) * (size_t)r2;
        float *x = malloc(sizeof(float) * (size_t)(T * n)), *g = malloc(sizeof(float) * (size_t)n);
        float *ya = malloc(sizeof(float) * (size_t)(T * rows));
        float *yb = malloc(sizeof(float) * (size_t)(T * rows));
        float *da = malloc(sizeof(float) * (size_t)n), *db = malloc(sizeof(float) * (size_t)n);
        CHECK(x && g && ya && yb && da && db);
        for (int64_t k = 0; k < T * n; k++)
            x[k] = rng_f() * 2.0f;
        for (int64_t k = 0; k < n; k++)
            g[k] = 0.5f + rng_f();
        uint8_t *dw1, *dw2;
        float *dx, *dg, *dy, *dd;
        CU(cudaMalloc((void **)&dw1, b1));
        CU(cudaMalloc((void **)&dw2, b2));
        CU(cudaMalloc((void **)&dx, sizeof(float) * (size_t)(T * n)));
        CU(cudaMalloc((void **)&dg, sizeof(float) * (size_t)n));
        CU(cudaMalloc((void **)&dy, sizeof(float) * (size_t)(T * rows)));
        CU(cudaMalloc((void **)&dd, sizeof(float) * (size_t)n));
        CU(cudaMemcpyAsync(dw1, w1, b1, cudaMemcpyHostToDevice, st));
        CU(cudaMemcpyAsync(dw2, w2, b2, cudaMemcpyHostToDevice, st));
        CU(cudaMemcpyAsync(dx, x, sizeof(float) * (size_t)(T * n), cudaMemcpyHostToDevice, st));
        CU(cudaMemcpyAsync(dg, g, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice, st));
        /* y rows: [q (r1a) | v (r2) | k (r1b)], so the segments are not in output order. */
        const struct moe_mv_job jobs[3] = {
            {dw1, r1a, dy, rows},
            {dw1 + moe_row_bytes(t1, n) * (size_t)r1a, r1b, dy + r1a + r2, rows},
            {dw2, r2, dy + r1a, rows}};
        for (int norm = 0; norm < 2; norm++)
            for (size_t ti = 0; ti < (norm ? 1 : sizeof toks / sizeof toks[0]); ti++) {
                const int64_t nt = toks[ti];
                for (int pass = 0; pass < 2; pass++) {
                    CU(cudaMemsetAsync(dy, 0xff, sizeof(float) * (size_t)(T * rows), st));
                    CU(cudaMemsetAsync(dd, 0xff, sizeof(float) * (size_t)n, st));
                    int rc;
                    if (pass == 0 && norm)
                        rc = moe_cuda_matvec_mixed(t1, t2, jobs, 3, 2, n, dx, n, 1, 0, dg, eps,
                                                   dd, NULL, st);
                    else if (pass == 0)
                        rc = moe_cuda_matvec_mixed(t1, t2, jobs, 3, 2, n, dx, n, nt, 0, NULL,
                                                   0.0f, NULL, NULL, st);
                    else if (norm) {
                        rc = moe_cuda_matvec_multi_norm(t1, jobs, 2, n, dx, dg, eps, dd, NULL, st);
                        if (rc == 0)
                            rc = moe_cuda_matvec_multi_norm(t2, jobs + 2, 1, n, dx, dg, eps, dd,
                                                            NULL, st);
                    } else {
                        rc = moe_cuda_matvec_multi(t1, jobs, 2, n, dx, n, nt, 0, st);
                        if (rc == 0)
                            rc = moe_cuda_matvec_multi(t2, jobs + 2, 1, n, dx, n, nt, 0, st);
                    }
                    CHECK_MSG(rc == 0, "%s+%s n=%lld: %s", moe_type_get(t1)->name,
                              moe_type_get(t2)->name, (long long)n, moe_strerror(rc));
                    CU(cudaMemcpyAsync(pass ? yb : ya, dy, sizeof(float) * (size_t)(nt * rows),
                                       cudaMemcpyDeviceToHost, st));
                    CU(cudaMemcpyAsync(pass ? db : da, dd, sizeof(float) * (size_t)n,
                                       cudaMemcpyDeviceToHost, st));
                    CU(cudaStreamSynchronize(st));
                }
                for (int64_t k = 0; k < nt * rows; k++)
                    CHECK_MSG(!isnan(ya[k]) && memcmp(&ya[k], &yb[k], sizeof(float)) == 0,
                              "%s+%s n=%lld, %lld tokens, norm %d: y[%lld] %.9g vs %.9g",
                              moe_type_get(t1)->name, moe_type_get(t2)->name, (long long)n,
                              (long long)nt, norm, (long long)k, (double)ya[k], (double)yb[k]);
                if (norm)
                    CHECK(memcmp(da, db, sizeof(float) * (size_t)n) == 0);
            }
        CHECK_EQ(moe_cuda_matvec_mixed(MOE_TYPE_Q8_0, MOE_TYPE_F16, jobs, 3, 2, n, dx, n, 1, 0,
                                       NULL, 0.0f, NULL, NULL, st),
                 MOE_EUNSUPPORTED);
        CU(cudaFree(dw1));
        CU(cudaFree(dw2));
        CU(cudaFree(dx));
        CU(cudaFree(dg));
        CU(cudaFree(dy));
        CU(cudaFree(dd));
        free(w1), free(w2), free(x), free(g), free(ya), free(yb), free(da), free(db);
    }
    CU(cudaStreamDestroy(st));
}

TEST(cuda_matvec_two_types_in_one_launch)
{
    check_mixed_pair(MOE_TYPE_Q4_K, MOE_TYPE_Q6_K, 600);
    check_mixed_pair(MOE_TYPE_Q5_K, MOE_TYPE_Q6_K, 601);
}

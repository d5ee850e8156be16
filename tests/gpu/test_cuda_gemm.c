/* worker/cuda/gemm.cu against the CPU path: for every type the CUDA products support, weights made
 * by moe_quantize from random floats, Y from the GPU compared with moe_matmul's Y element by element
 * within 2e-3 of Σ|w·x| (the error scale, from the reference decoder in double: the GPU rounds
 * weights and activations to f16 on their way into the tensor cores). Y is poisoned with NaN
 * before every launch, so an element the kernel never wrote fails, and elements it must not write
 * (row padding of ldy, slots past the grouped total) must keep the poison bits. Every case runs
 * twice and must give bit-identical results. Weights sit at the end of their allocation, so a read
 * past them shows under compute-sanitizer. Without a GPU every test skips. */
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
#include "worker/cuda/gemm.h"


#define TOL 2e-3
#define POISON 0xffffffffu




static float *dequant_rows(uint32_t type, const uint8_t *w, int64_t rows, int64_t n)
{
    size_t rb = moe_row_bytes(type, n);
    float *d = malloc((size_t)(rows * n) * sizeof *d);
    CHECK(d);
    for (int64_t r = 0; r < rows; r++)
        CHECK_EQ(moe_dequantize(type, w + rb * (size_t)r, d + r * n, n), 0);
    return d;
}

/* Σ_i |wd[r][i]·x[i]| in double: the error scale of output (x, r). */
static double abs_dot(const float *wd_row, const float *x, int64_t n)
{
    double a = 0;
    for (int64_t i = 0; i < n; i++)
        a += fabs((double)wd_row[i] * x[i]);
    return a;
}

static int is_poison(float v)
{
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    return b == POISON;
}

/* Device copy of `bytes` bytes placed `off` bytes into an allocation that ends right after them. */
static void *dev_copy_end(const void *src, size_t bytes, size_t off, void **base, cudaStream_t st)
{
    CU(cudaMalloc(base, bytes + off));
    uint8_t *d = (uint8_t *)*base + off;
    CU(cudaMemcpyAsync(d, src, bytes, cudaMemcpyHostToDevice, st));
    return d;
}

struct dense_opts {
    int tile;            /* -1: automatic */
    int64_t ldx_extra, ldy_extra;
    int x_misalign;      /* X one float past a 16-byte boundary: the float-load path */
    int accumulate;
    size_t w_off;        /* weights this many bytes past a 256-byte boundary */
    int row_step;        /* check every row_step-th row only (large cases) */
};

/* One dense product of the first `rows` rows of w against n_tok random tokens. */
static void check_dense(uint32_t type, const uint8_t *w, const float *wd, int64_t n, int64_t rows,
                        int64_t n_tok, struct dense_opts o, cudaStream_t st)
{
    const char *tn = moe_type_get(type)->name;
    const int64_t ldx = n + o.ldx_extra, ldy = rows + o.ldy_extra;
    const size_t wbytes = moe_row_bytes(type, n) * (size_t)rows;
    const size_t xn = (size_t)(ldx * n_tok), yn = (size_t)(ldy * n_tok);
    float *x = malloc(xn * sizeof *x), *y0 = malloc(yn * sizeof *y0);
    float *ycpu = malloc(yn * sizeof *ycpu), *g1 = malloc(yn * sizeof *g1), *g2 = malloc(yn * sizeof *g2);
    CHECK(x && y0 && ycpu && g1 && g2);
    for (size_t i = 0; i < xn; i++)
        x[i] = rng_f() * 2.0f;
    for (size_t i = 0; i < yn; i++) {
        float v = rng_f();
        uint32_t p = POISON;
        if (!o.accumulate)
            memcpy(&v, &p, sizeof v);
        y0[i] = v;
    }
    moe_matmul(type, w, n, x, ldx, n_tok, ycpu, ldy, 0, rows);

    void *wbase, *xbase;
    float *dy;
    const void *dw = dev_copy_end(w, wbytes, 256 + o.w_off, &wbase, st);
    CU(cudaMalloc(&xbase, (xn + 4) * sizeof(float)));
    float *dx = (float *)xbase + (o.x_misalign ? 1 : 0);
    CU(cudaMemcpyAsync(dx, x, xn * sizeof *x, cudaMemcpyHostToDevice, st));
    CU(cudaMalloc((void **)&dy, yn * sizeof *dy));
    int prev = moe_cuda_gemm_force_tile(o.tile);
    for (int run = 0; run < 2; run++) {
        float *out = run ? g2 : g1;
        CU(cudaMemcpyAsync(dy, y0, yn * sizeof *dy, cudaMemcpyHostToDevice, st));
        int rc = moe_cuda_gemm(type, dw, n, rows, dx, ldx, n_tok, dy, ldy, o.accumulate, st);
        CHECK_MSG(rc == 0, "%s n=%lld rows=%lld tok=%lld: %s", tn, (long long)n, (long long)rows,
                  (long long)n_tok, moe_strerror(rc));
        CU(cudaMemcpyAsync(out, dy, yn * sizeof *dy, cudaMemcpyDeviceToHost, st));
        CU(cudaStreamSynchronize(st));
    }
    moe_cuda_gemm_force_tile(prev);

    const int step = o.row_step > 0 ? o.row_step : 1;
    for (int64_t t = 0; t < n_tok; t++) {
        for (int64_t r = 0; r < ldy; r++) {
            const size_t i = (size_t)(t * ldy + r);
            if (r >= rows) {
                CHECK_MSG(memcmp(&g1[i], &y0[i], sizeof *g1) == 0,
                          "%s n=%lld rows=%lld tok=%lld: padding y[%lld][%lld] written", tn,
                          (long long)n, (long long)rows, (long long)n_tok, (long long)t, (long long)r);
                continue;
            }
            if (r % step != 0)
                continue;
            const double want = (double)ycpu[i] + (o.accumulate ? (double)y0[i] : 0.0);
            const double tol = TOL * abs_dot(wd + r * n, x + t * ldx, n) + 1e-30;
            CHECK_MSG(isfinite(g1[i]) && fabs((double)g1[i] - want) <= tol,
                      "%s n=%lld rows=%lld tok=%lld tile=%d: y[%lld][%lld] gpu %.9g cpu %.9g (tol %.3g)",
                      tn, (long long)n, (long long)rows, (long long)n_tok, o.tile, (long long)t,
                      (long long)r, (double)g1[i], want, tol);
        }
    }
    CHECK_MSG(memcmp(g1, g2, yn * sizeof *g1) == 0, "%s n=%lld rows=%lld tok=%lld: two runs differ",
              tn, (long long)n, (long long)rows, (long long)n_tok);
    CU(cudaFree(wbase));
    CU(cudaFree(xbase));
    CU(cudaFree(dy));
    free(x);
    free(y0);
    free(ycpu);
    free(g1);
    free(g2);
}

/* Grouped product: n_group random matrices, counts[g] slots each (the rest of max_slots unused),
 * inputs gathered from n_x rows of X through a random d_xrow (or slot s reads row s). */
struct grouped_case {
    uint32_t type;
    int64_t n, rows;
    int n_group;
    const int *counts;
    int64_t max_slots;
    int gather;
    int64_t n_x;
    int tile;
    int slot_step; /* check every slot_step-th slot only (large cases) */
    int pooled;    /* build each matrix from rows drawn out of one pool of 256 (large cases) */
};

/* A matrix whose rows are random picks from a pool of quantized rows: distinct matrices for many
 * groups without quantizing every row. */
static uint8_t *pooled_weights(const uint8_t *pool, uint32_t type, int64_t rows, int64_t n)
{
    const size_t rb = moe_row_bytes(type, n);
    uint8_t *w = malloc(rb * (size_t)rows);
    CHECK(w);
    for (int64_t r = 0; r < rows; r++)
        memcpy(w + rb * (size_t)r, pool + rb * (moe_test_rng_u32() % 256), rb);
    return w;
}

struct grouped_dev {
    void *wmem, *tab, *off, *xrow, *x, *y;
};

static void check_grouped(const struct grouped_case *c, cudaStream_t st)
{
    const char *tn = moe_type_get(c->type)->name;
    const int G = c->n_group;
    const int64_t n = c->n, rows = c->rows, ldx = n + 3, ldy = rows + 2;
    const size_t rb = moe_row_bytes(c->type, n), wb = rb * (size_t)rows;
    const size_t wstride = (wb + 255) / 256 * 256;
    int32_t *off = malloc((size_t)(G + 1) * sizeof *off);
    CHECK(off);
    off[0] = 0;
    for (int g = 0; g < G; g++)
        off[g + 1] = off[g] + c->counts[g];
    const int64_t total = off[G], n_x = c->gather ? c->n_x : c->max_slots;
    CHECK(total <= c->max_slots);

    uint8_t **w = malloc((size_t)G * sizeof *w);
    uint8_t *pool = c->pooled ? make_weights(c->type, 256, n) : NULL;
    float *x = malloc((size_t)(n_x * ldx) * sizeof *x);
    int32_t *xrow = malloc((size_t)c->max_slots * sizeof *xrow);
    const size_t yn = (size_t)(c->max_slots * ldy);
    float *y0 = malloc(yn * sizeof *y0), *g1 = malloc(yn * sizeof *g1), *g2 = malloc(yn * sizeof *g2);
    float *xg = malloc((size_t)(c->max_slots * n) * sizeof *xg);
    float *yc = malloc((size_t)(c->max_slots * rows) * sizeof *yc);
    CHECK(w && x && xrow && y0 && g1 && g2 && xg && yc);
    for (int g = 0; g < G; g++) {
        /* Only groups with slots need real weights. */
        w[g] = c->counts[g] == 0 ? NULL
               : pool            ? pooled_weights(pool, c->type, rows, n)
                                 : make_weights(c->type, rows, n);
    }
    for (int64_t i = 0; i < n_x * ldx; i++)
        x[i] = rng_f() * 2.0f;
    for (int64_t s = 0; s < c->max_slots; s++)
        xrow[s] = (int32_t)(moe_test_rng_u32() % (uint32_t)n_x);
    for (size_t i = 0; i < yn; i++) {
        uint32_t p = POISON;
        memcpy(&y0[i], &p, sizeof p);
    }

    struct grouped_dev d;
    CU(cudaMalloc(&d.wmem, wstride * (size_t)G));
    void **tab = malloc((size_t)G * sizeof *tab);
    CHECK(tab);
    for (int g = 0; g < G; g++) {
        tab[g] = (uint8_t *)d.wmem + wstride * (size_t)g;
        if (w[g])
            CU(cudaMemcpyAsync(tab[g], w[g], wb, cudaMemcpyHostToDevice, st));
        else
            CU(cudaMemsetAsync(tab[g], 0, wb, st));
    }
    CU(cudaMalloc(&d.tab, (size_t)G * sizeof(void *)));
    CU(cudaMalloc(&d.off, (size_t)(G + 1) * sizeof(int32_t)));
    CU(cudaMalloc(&d.xrow, (size_t)c->max_slots * sizeof(int32_t)));
    CU(cudaMalloc(&d.x, (size_t)(n_x * ldx) * sizeof(float)));
    CU(cudaMalloc(&d.y, yn * sizeof(float)));
    CU(cudaMemcpyAsync(d.tab, tab, (size_t)G * sizeof(void *), cudaMemcpyHostToDevice, st));
    CU(cudaMemcpyAsync(d.off, off, (size_t)(G + 1) * sizeof(int32_t), cudaMemcpyHostToDevice, st));
    CU(cudaMemcpyAsync(d.xrow, xrow, (size_t)c->max_slots * sizeof(int32_t), cudaMemcpyHostToDevice, st));
    CU(cudaMemcpyAsync(d.x, x, (size_t)(n_x * ldx) * sizeof(float), cudaMemcpyHostToDevice, st));

    int prev = moe_cuda_gemm_force_tile(c->tile);
    for (int run = 0; run < 2; run++) {
        float *out = run ? g2 : g1;
        CU(cudaMemcpyAsync(d.y, y0, yn * sizeof(float), cudaMemcpyHostToDevice, st));
        int rc = moe_cuda_gemm_grouped(c->type, (const void *const *)d.tab, n, rows, G,
                                       (const int32_t *)d.off,
                                       c->gather ? (const int32_t *)d.xrow : NULL,
                                       (const float *)d.x, ldx, (float *)d.y, ldy, c->max_slots, st);
        CHECK_MSG(rc == 0, "%s grouped: %s", tn, moe_strerror(rc));
        CU(cudaMemcpyAsync(out, d.y, yn * sizeof(float), cudaMemcpyDeviceToHost, st));
        CU(cudaStreamSynchronize(st));
    }
    moe_cuda_gemm_force_tile(prev);

    /* CPU reference, group by group, on the gathered inputs. */
    for (int g = 0; g < G; g++) {
        const int64_t cnt = off[g + 1] - off[g];
        if (cnt == 0)
            continue;
        for (int64_t k = 0; k < cnt; k++) {
            const int64_t s = off[g] + k, xr = c->gather ? xrow[s] : s;
            memcpy(xg + k * n, x + xr * ldx, (size_t)n * sizeof *xg);
        }
        moe_matmul(c->type, w[g], n, xg, n, cnt, yc + (int64_t)off[g] * rows, rows, 0, rows);
    }
    const int step = c->slot_step > 0 ? c->slot_step : 1;
    for (int g = 0; g < G; g++) {
        if (off[g + 1] == off[g])
            continue;
        float *wd = dequant_rows(c->type, w[g], rows, n);
        for (int64_t s = off[g]; s < off[g + 1]; s++) {
            if ((s - off[g]) % step != 0 && s != off[g + 1] - 1)
                continue;
            const float *xs = x + (c->gather ? xrow[s] : s) * ldx;
            for (int64_t r = 0; r < rows; r++) {
                const double got = g1[s * ldy + r], want = yc[s * rows + r];
                const double tol = TOL * abs_dot(wd + r * n, xs, n) + 1e-30;
                CHECK_MSG(isfinite(got) && fabs(got - want) <= tol,
                          "%s grouped groups=%d total=%lld tile=%d: group %d slot %lld row %lld: gpu "
                          "%.9g cpu %.9g (tol %.3g)", tn, G, (long long)total, c->tile, g,
                          (long long)s, (long long)r, got, want, tol);
            }
        }
        free(wd);
    }
    for (int64_t s = 0; s < c->max_slots; s++)
        for (int64_t r = 0; r < ldy; r++)
            if (s >= total || r >= rows)
                CHECK_MSG(is_poison(g1[s * ldy + r]), "%s grouped: y[%lld][%lld] written (total %lld)",
                          tn, (long long)s, (long long)r, (long long)total);
    CHECK_MSG(memcmp(g1, g2, yn * sizeof *g1) == 0, "%s grouped: two runs differ", tn);

    CU(cudaFree(d.wmem));
    CU(cudaFree(d.tab));
    CU(cudaFree(d.off));
    CU(cudaFree(d.xrow));
    CU(cudaFree(d.x));
    CU(cudaFree(d.y));
    for (int g = 0; g < G; g++)
        free(w[g]);
    free(w);
    free(pool);
    free(tab);
    free(off);
    free(x);
    free(xrow);
    free(y0);
    free(g1);
    free(g2);
    free(xg);
    free(yc);
}

/* Per type: two row lengths (for the 32-blocks one with a half k-tile at the end, for the plain
 * types one that is not a multiple of 8), token counts 1, 7, 64, 100 and 513, row counts that are
 * not multiples of any tile, every tile shape forced once, strided and misaligned X, accumulate,
 * weights only 4- (F16/BF16: 2-) byte aligned; then grouped products with empty groups, one group
 * holding most slots, a gather and unused slots. */
static void check_type(uint32_t type, uint64_t seed)
{
    need_gpu();
    moe_test_rng_seed(seed);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const uint32_t blck = moe_type_get(type)->blck;
    const int64_t ns[2] = {blck == 1 ? 100 : blck == 32 ? 96 : 256,
                           blck == 1 ? 264 : blck == 32 ? 544 : 768};
    const size_t mis = type == MOE_TYPE_F16 || type == MOE_TYPE_BF16 ? 2 : 4;
    for (int k = 0; k < 2; k++) {
        const int64_t n = ns[k], wrows = 300;
        uint8_t *w = make_weights(type, wrows, n);
        float *wd = dequant_rows(type, w, wrows, n);
        const struct dense_opts plain = {-1, 0, 0, 0, 0, 0, 1};
        check_dense(type, w, wd, n, 131, 1, plain, st);
        for (int tile = 0; tile < 4; tile++) {
            struct dense_opts o = plain;
            o.tile = tile;
            check_dense(type, w, wd, n, 77, 7, o, st);
        }
        check_dense(type, w, wd, n, 300, 64, plain, st);
        const struct dense_opts strided = {-1, 5, 3, 1, 1, 0, 1};
        check_dense(type, w, wd, n, 131, 100, strided, st);
        check_dense(type, w, wd, n, 200, 513, plain, st);
        struct dense_opts offset = plain;
        offset.w_off = mis;
        offset.tile = k;
        check_dense(type, w, wd, n, 131, 70, offset, st);
        free(w);
        free(wd);
    }
    static const int counts_a[] = {0, 5, 0, 40, 1, 0, 70};
    static const int counts_b[] = {0, 0, 150, 0};
    const struct grouped_case ga = {type, ns[0], 131, 7, counts_a, 140, 1, 37, -1, 1, 0};
    const struct grouped_case gb = {type, ns[1], 70, 4, counts_b, 150, 0, 0, -1, 1, 0};
    check_grouped(&ga, st);
    check_grouped(&gb, st);
    for (int tile = 0; tile < 4; tile++) {
        struct grouped_case gt = ga;
        gt.tile = tile;
        check_grouped(&gt, st);
    }
    CU(cudaStreamDestroy(st));
}

TEST_TIMEOUT(cuda_gemm_f32, 300) { check_type(MOE_TYPE_F32, 201); }
TEST_TIMEOUT(cuda_gemm_f16, 300) { check_type(MOE_TYPE_F16, 202); }
TEST_TIMEOUT(cuda_gemm_bf16, 300) { check_type(MOE_TYPE_BF16, 203); }
TEST_TIMEOUT(cuda_gemm_q8_0, 300) { check_type(MOE_TYPE_Q8_0, 204); }
TEST_TIMEOUT(cuda_gemm_q4_0, 300) { check_type(MOE_TYPE_Q4_0, 205); }
TEST_TIMEOUT(cuda_gemm_q4_1, 300) { check_type(MOE_TYPE_Q4_1, 206); }
TEST_TIMEOUT(cuda_gemm_q5_0, 300) { check_type(MOE_TYPE_Q5_0, 207); }
TEST_TIMEOUT(cuda_gemm_q5_1, 300) { check_type(MOE_TYPE_Q5_1, 208); }
TEST_TIMEOUT(cuda_gemm_q4_k, 300) { check_type(MOE_TYPE_Q4_K, 209); }
TEST_TIMEOUT(cuda_gemm_q5_k, 300) { check_type(MOE_TYPE_Q5_K, 210); }
TEST_TIMEOUT(cuda_gemm_q6_k, 300) { check_type(MOE_TYPE_Q6_K, 211); }

/* More groups than a thread block has threads (the in-block prefix sum walks them in chunks),
 * most of them empty, every tile shape. */
TEST_TIMEOUT(cuda_gemm_grouped_many_groups, 300)
{
    need_gpu();
    moe_test_rng_seed(212);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    enum { G = 300 };
    static int counts[G];
    for (int g = 0; g < G; g++)
        counts[g] = g % 7 == 3 ? (int)(moe_test_rng_u32() % 9) : 0;
    counts[G - 1] = 33;
    for (int tile = -1; tile < 4; tile++) {
        const struct grouped_case c = {MOE_TYPE_Q4_K, 256, 40, G, counts, 700, 1, 50, tile, 1, 0};
        check_grouped(&c, st);
    }
    const struct grouped_case c6 = {MOE_TYPE_Q6_K, 256, 40, G, counts, 700, 1, 50, -1, 1, 0};
    check_grouped(&c6, st);
    CU(cudaStreamDestroy(st));
}

/* The shapes of a Qwen3-30B-A3B layer at a 512-token prefill: dense 4096×2048 and 512×2048, and
 * 128 experts (gate/up 768×2048, down 2048×768) with 512 tokens × top-8 routed at random. Only
 * some rows/slots are compared (the CPU reference is the slow part). */
TEST_TIMEOUT(cuda_gemm_model_shapes, 600)
{
    need_gpu();
    moe_test_rng_seed(213);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    static const uint32_t types[] = {MOE_TYPE_Q4_K, MOE_TYPE_Q6_K, MOE_TYPE_Q8_0};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        uint8_t *w = make_weights(types[t], 4096, 2048);
        float *wd = dequant_rows(types[t], w, 4096, 2048);
        const struct dense_opts big = {-1, 0, 0, 0, 0, 0, 37};
        check_dense(types[t], w, wd, 2048, 4096, 512, big, st);
        check_dense(types[t], w, wd, 2048, 512, 512, big, st);
        free(w);
        free(wd);
    }
    enum { E = 128, TOK = 512, TOPK = 8 };
    static int counts[E];
    memset(counts, 0, sizeof counts);
    for (int k = 0; k < TOK; k++) {
        int chosen[TOPK];
        for (int j = 0; j < TOPK; j++) {
            int e, dup;
            do {
                e = (int)(moe_test_rng_u32() % E);
                dup = 0;
                for (int i = 0; i < j; i++)
                    dup |= chosen[i] == e;
            } while (dup);
            chosen[j] = e;
            counts[e]++;
        }
    }
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const struct grouped_case up = {types[t], 2048, 768, E, counts, TOK * TOPK, 1, TOK, -1, 9, 1};
        const struct grouped_case down = {types[t], 768, 2048, E, counts, TOK * TOPK, 0, 0, -1, 9, 1};
        check_grouped(&up, st);
        check_grouped(&down, st);
    }
    CU(cudaStreamDestroy(st));
}

/* The grouped call captured once in a CUDA graph gives the right answer for new counts on every
 * replay: the launch shape never depends on d_off. */
TEST(cuda_gemm_grouped_graph_replay)
{
    need_gpu();
    moe_test_rng_seed(214);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const uint32_t type = MOE_TYPE_Q4_K;
    enum { G = 6, ROWS = 96, MAXS = 120 };
    const int64_t n = 512, ldx = n, ldy = ROWS;
    const size_t rb = moe_row_bytes(type, n), wb = rb * ROWS;
    uint8_t *w[G];
    void *tab[G], *dw, *dtab;
    int32_t *doff;
    float *dx, *dy;
    CU(cudaMalloc(&dw, wb * G));
    for (int g = 0; g < G; g++) {
        w[g] = make_weights(type, ROWS, n);
        tab[g] = (uint8_t *)dw + wb * (size_t)g;
        CU(cudaMemcpyAsync(tab[g], w[g], wb, cudaMemcpyHostToDevice, st));
    }
    float *x = malloc((size_t)(MAXS * n) * sizeof *x), *y = malloc((size_t)(MAXS * ROWS) * sizeof *y);
    float *yc = malloc((size_t)(MAXS * ROWS) * sizeof *yc);
    CHECK(x && y && yc);
    for (int64_t i = 0; i < MAXS * n; i++)
        x[i] = rng_f();
    CU(cudaMalloc(&dtab, sizeof tab));
    CU(cudaMalloc((void **)&doff, (G + 1) * sizeof(int32_t)));
    CU(cudaMalloc((void **)&dx, (size_t)(MAXS * n) * sizeof(float)));
    CU(cudaMalloc((void **)&dy, (size_t)(MAXS * ROWS) * sizeof(float)));
    CU(cudaMemcpyAsync(dtab, tab, sizeof tab, cudaMemcpyHostToDevice, st));
    CU(cudaMemcpyAsync(dx, x, (size_t)(MAXS * n) * sizeof(float), cudaMemcpyHostToDevice, st));

    /* A first call outside the capture loads the kernel and sets its smem limit, as a worker
     * does before capturing its graphs (all groups empty: every block leaves at once). */
    CU(cudaMemsetAsync(doff, 0, (G + 1) * sizeof(int32_t), st));
    CHECK_EQ(moe_cuda_gemm_grouped(type, (const void *const *)dtab, n, ROWS, G, doff, NULL, dx, ldx,
                                   dy, ldy, MAXS, st),
             0);
    CU(cudaStreamSynchronize(st));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    CHECK_EQ(moe_cuda_gemm_grouped(type, (const void *const *)dtab, n, ROWS, G, doff, NULL, dx, ldx,
                                   dy, ldy, MAXS, st),
             0);
    CU(cudaStreamEndCapture(st, &graph));
    CU(cudaGraphInstantiate(&exec, graph, 0));

    static const int steps[3][G] = {{10, 0, 3, 0, 50, 1}, {0, 0, 0, 0, 0, 120}, {1, 2, 3, 4, 5, 6}};
    for (int k = 0; k < 3; k++) {
        int32_t off[G + 1] = {0};
        for (int g = 0; g < G; g++)
            off[g + 1] = off[g] + steps[k][g];
        CU(cudaMemcpyAsync(doff, off, sizeof off, cudaMemcpyHostToDevice, st));
        CU(cudaMemsetAsync(dy, 0xff, (size_t)(MAXS * ROWS) * sizeof(float), st));
        CU(cudaGraphLaunch(exec, st));
        CU(cudaMemcpyAsync(y, dy, (size_t)(MAXS * ROWS) * sizeof(float), cudaMemcpyDeviceToHost, st));
        CU(cudaStreamSynchronize(st));
        for (int g = 0; g < G; g++)
            if (steps[k][g])
                moe_matmul(type, w[g], n, x + (int64_t)off[g] * n, n, steps[k][g],
                           yc + (int64_t)off[g] * ROWS, ROWS, 0, ROWS);
        for (int64_t s = 0; s < MAXS; s++)
            for (int64_t r = 0; r < ROWS; r++) {
                const float got = y[s * ROWS + r];
                if (s >= off[G]) {
                    CHECK_MSG(is_poison(got), "step %d: slot %lld written", k, (long long)s);
                    continue;
                }
                const float want = yc[s * ROWS + r];
                CHECK_MSG(fabsf(got - want) <= 2e-3f * (fabsf(want) + 1.0f),
                          "step %d: slot %lld row %lld: %g vs %g", k, (long long)s, (long long)r,
                          (double)got, (double)want);
            }
    }
    CU(cudaGraphExecDestroy(exec));
    CU(cudaGraphDestroy(graph));
    for (int g = 0; g < G; g++)
        free(w[g]);
    free(x);
    free(y);
    free(yc);
    CU(cudaFree(dw));
    CU(cudaFree(dtab));
    CU(cudaFree(doff));
    CU(cudaFree(dx));
    CU(cudaFree(dy));
    CU(cudaStreamDestroy(st));
}

/* Types without a kernel, bad shapes, strides and pointers are error returns; empty products
 * launch nothing (y keeps its contents). */
TEST(cuda_gemm_rejects_bad_arguments)
{
    need_gpu();
    const int64_t n = 256;
    uint8_t *dw;
    float *dx, *dy, y[4];
    int32_t *doff;
    void **dtab;
    CU(cudaMalloc((void **)&dw, 1 << 16));
    CU(cudaMalloc((void **)&dx, 4096 * sizeof(float)));
    CU(cudaMalloc((void **)&dy, 4 * sizeof(float)));
    CU(cudaMalloc((void **)&doff, 16 * sizeof(int32_t)));
    CU(cudaMalloc((void **)&dtab, 4 * sizeof(void *)));
    CU(cudaMemset(dy, 0x7f, 4 * sizeof(float)));
    CU(cudaMemset(doff, 0, 16 * sizeof(int32_t)));

    static const uint32_t unsupported[] = {MOE_TYPE_Q2_K, MOE_TYPE_Q3_K, MOE_TYPE_Q8_1,
                                           MOE_TYPE_IQ4_NL, MOE_TYPE_MXFP4, 4, 999};
    for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++) {
        CHECK_EQ(moe_cuda_gemm_supported(unsupported[i]), 0);
        CHECK_EQ(moe_cuda_gemm(unsupported[i], dw, n, 4, dx, n, 1, dy, 4, 0, 0), MOE_EUNSUPPORTED);
        CHECK_EQ(moe_cuda_gemm_grouped(unsupported[i], (const void *const *)dtab, n, 4, 1, doff,
                                       NULL, dx, n, dy, 4, 1, 0),
                 MOE_EUNSUPPORTED);
    }
    CHECK_EQ(moe_cuda_gemm_supported(MOE_TYPE_Q4_1), 1);
    CHECK_EQ(moe_cuda_gemm_supported(MOE_TYPE_Q5_1), 1);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_Q4_0, dw, 100, 4, dx, 100, 1, dy, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_Q6_K, dw, 128, 4, dx, 128, 1, dy, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_F16, dw, 0, 4, dx, 1, 1, dy, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_F16, dw, n, -1, dx, n, 1, dy, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_F16, dw, n, 4, dx, n, -1, dy, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_F16, dw, n, 4, dx, n - 1, 1, dy, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_F16, dw, n, 4, dx, n, 1, dy, 3, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_F16, NULL, n, 4, dx, n, 1, dy, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_F16, dw, n, 4, NULL, n, 1, dy, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_F16, dw, n, 4, dx, n, 1, NULL, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_F16, dw + 1, n, 4, dx, n, 1, dy, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_Q8_0, dw + 2, n, 4, dx, n, 1, dy, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_Q4_K, dw + 2, n, 4, dx, n, 1, dy, 4, 0, 0), -EINVAL);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_F32, dw, n, 4, (const float *)((uint8_t *)dx + 2), n, 1, dy, 4,
                           0, 0),
             -EINVAL);
    CHECK_EQ(moe_cuda_gemm_grouped(MOE_TYPE_Q4_K, (const void *const *)dtab, n, 4, -1, doff, NULL,
                                   dx, n, dy, 4, 1, 0),
             -EINVAL);
    CHECK_EQ(moe_cuda_gemm_grouped(MOE_TYPE_Q4_K, (const void *const *)dtab, n, 4, 1, doff, NULL,
                                   dx, n, dy, 4, -1, 0),
             -EINVAL);
    CHECK_EQ(moe_cuda_gemm_grouped(MOE_TYPE_Q4_K, NULL, n, 4, 1, doff, NULL, dx, n, dy, 4, 1, 0),
             -EINVAL);
    CHECK_EQ(moe_cuda_gemm_grouped(MOE_TYPE_Q4_K, (const void *const *)dtab, n, 4, 1, NULL, NULL,
                                   dx, n, dy, 4, 1, 0),
             -EINVAL);
    CHECK_EQ(moe_cuda_gemm_force_tile(7), -EINVAL);
    CHECK_EQ(moe_cuda_gemm_force_tile(-1), -1);
    /* Empty products: nothing launched, nothing written. */
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_Q8_0, dw, n, 0, dx, n, 1, dy, 4, 0, 0), 0);
    CHECK_EQ(moe_cuda_gemm(MOE_TYPE_Q8_0, dw, n, 4, dx, n, 0, dy, 4, 0, 0), 0);
    CHECK_EQ(moe_cuda_gemm_grouped(MOE_TYPE_Q8_0, (const void *const *)dtab, n, 4, 0, doff, NULL,
                                   dx, n, dy, 4, 1, 0),
             0);
    CHECK_EQ(moe_cuda_gemm_grouped(MOE_TYPE_Q8_0, (const void *const *)dtab, n, 4, 1, doff, NULL,
                                   dx, n, dy, 4, 0, 0),
             0);
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
    CU(cudaFree(doff));
    CU(cudaFree(dtab));
}

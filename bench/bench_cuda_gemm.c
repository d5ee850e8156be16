/* Benchmark of worker/cuda/gemm.cu: prefill matrix products on tensor cores.
 *
 * Dense: Y[n_tok][rows] = X[n_tok][n] · W[rows][n]ᵀ for the attention/dense shapes of a
 * Qwen3-30B-A3B-sized model (4096×2048, 2048×4096, 512×2048) at 512..4096 tokens. Grouped: the
 * expert layers, 128 experts of gate/up 768×2048 and down 2048×768, with 512 tokens × top-8 routed
 * at random (4096 slots). Numbers per case: median µs per call, TFLOP/s-equivalent (2·rows·n per
 * token or slot), GB/s of weight bytes (each used matrix counted once). By default the automatic
 * tile choice is timed and then every forced tile shape (moe_cuda_gemm_force_tile), so the choice
 * can be tuned: the fastest is marked with '*'.
 *
 * Method: random quantized rows (64 distinct, repeated), copies of the weights rotated so that at
 * least 256 MiB is read between two uses of one copy (L2 is 60 MB), warm-up first, CUDA events
 * around each call, the median of the calls in about `secs` seconds (at least 5).
 *
 *   build/bench/bench_cuda_gemm [seconds per case, default 0.2] [type] [shape substring] [auto]
 *
 * e.g. `bench_cuda_gemm 0.05 q4_K expert` for the expert layers only; a fourth argument "auto"
 * times the automatic choice only (for ncu). */
#include <stdio.h>

#ifndef MOE_HAVE_CUDA
int main(void)
{
    printf("bench_cuda_gemm: built without CUDA (no nvcc at build time); nothing to measure\n");
    return 0;
}
#else

#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "store/ggml_type.h"
#include "store/quant.h"
#include "worker/cuda/gemm.h"

#define BENCH_NAME "bench_cuda_gemm"
#include "bench/bench_cuda.h"


#define ROTATE_BYTES (256u << 20)
#define DISTINCT_ROWS 64
#define MAX_RUNS 2000
#define N_TILES 4

struct dense_shape {
    const char *name;
    int64_t rows, n;
};

static const struct dense_shape dense_shapes[] = {
    {"dense 4096x2048", 4096, 2048},
    {"dense 2048x4096", 2048, 4096},
    {"dense 512x2048", 512, 2048},
};
static const int64_t token_counts[] = {512, 1024, 2048, 4096};

static const struct dense_shape expert_shapes[] = {
    {"expert gate/up", 768, 2048},
    {"expert down", 2048, 768},
};
enum { EXPERTS = 128, ROUTED_TOKENS = 512, TOP_K = 8, SLOTS = ROUTED_TOKENS * TOP_K };

static const uint32_t types[] = {MOE_TYPE_Q4_K, MOE_TYPE_Q6_K, MOE_TYPE_Q8_0, MOE_TYPE_F16,
                                 MOE_TYPE_Q5_K, MOE_TYPE_Q4_0, MOE_TYPE_BF16};

static uint32_t rng_u32(void)
{
    return (uint32_t)(bench_rng_next() >> 32);
}


static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* One call of the case; `copy` picks the rotated weight copy. */
struct bench_case {
    int grouped;
    uint32_t type;
    int64_t rows, n, n_tok;
    const uint8_t *dw;        /* dense: copies of W, `wbytes` apart */
    size_t wbytes;
    int64_t copies;
    void **dtab;              /* grouped: one device table of EXPERTS pointers per copy */
    const int32_t *doff, *dxrow;
    const float *dx;
    float *dy;
};

static void call(const struct bench_case *c, int64_t copy, cudaStream_t st)
{
    int rc;
    if (c->grouped)
        rc = moe_cuda_gemm_grouped(c->type, (const void *const *)(c->dtab + copy * EXPERTS), c->n,
                                   c->rows, EXPERTS, c->doff, c->dxrow, c->dx, c->n, c->dy, c->rows,
                                   SLOTS, st);
    else
        rc = moe_cuda_gemm(c->type, c->dw + c->wbytes * (size_t)copy, c->n, c->rows, c->dx, c->n,
                           c->n_tok, c->dy, c->rows, 0, st);
    if (rc != 0) {
        fprintf(stderr, "bench_cuda_gemm: call failed (%s): %d\n", moe_type_get(c->type)->name, rc);
        exit(1);
    }
}

/* Median µs per call over about `secs` seconds, each call between two events. */
static double time_case(const struct bench_case *c, double secs, cudaStream_t st)
{
    static cudaEvent_t ev[MAX_RUNS + 1];
    static int have_events;
    static float ms[MAX_RUNS];
    if (!have_events) {
        for (int i = 0; i <= MAX_RUNS; i++)
            CU(cudaEventCreate(&ev[i]));
        have_events = 1;
    }
    for (int i = 0; i < 3; i++) /* warm-up, module load */
        call(c, i % c->copies, st);
    CU(cudaEventRecord(ev[0], st));
    call(c, 3 % c->copies, st);
    CU(cudaEventRecord(ev[1], st));
    CU(cudaEventSynchronize(ev[1]));
    float first;
    CU(cudaEventElapsedTime(&first, ev[0], ev[1]));
    int runs = (int)(secs * 1e3 / (first > 1e-3f ? first : 1e-3f));
    runs = runs < 5 ? 5 : runs > MAX_RUNS ? MAX_RUNS : runs;
    CU(cudaEventRecord(ev[0], st));
    for (int i = 0; i < runs; i++) {
        call(c, (4 + i) % c->copies, st);
        CU(cudaEventRecord(ev[i + 1], st));
    }
    CU(cudaEventSynchronize(ev[runs]));
    for (int i = 0; i < runs; i++)
        CU(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
    qsort(ms, (size_t)runs, sizeof ms[0], cmp_float);
    CU(cudaGetLastError());
    return (double)ms[runs / 2] * 1e3;
}

/* Fills `bytes` of host memory with rows of `type`: DISTINCT_ROWS random quantized rows, repeated. */
static void fill_rows(uint8_t *h, uint32_t type, int64_t n, size_t bytes, float *tmp)
{
    const size_t rb = moe_row_bytes(type, n);
    const size_t rows = bytes / rb;
    for (size_t r = 0; r < DISTINCT_ROWS && r < rows; r++) {
        for (int64_t i = 0; i < n; i++)
            tmp[i] = bench_rng_f() * (0.02f + 0.05f * (float)((i / 32 + (int64_t)r) % 5));
        if (moe_quantize(type, tmp, h + rb * r, n) != 0)
            exit(1);
    }
    for (size_t r = DISTINCT_ROWS; r < rows; r++)
        memcpy(h + rb * r, h + rb * (r % DISTINCT_ROWS), rb);
}

/* Times the automatic choice and every forced tile; prints one line. */
static void run_case(const char *label, const struct bench_case *c, double flops, double wbytes,
                     double secs, int auto_only, cudaStream_t st)
{
    double us[N_TILES + 1];
    int best = 0;
    for (int t = -1; t < (auto_only ? 0 : N_TILES); t++) {
        moe_cuda_gemm_force_tile(t);
        us[t + 1] = time_case(c, secs, st);
        if (t >= 0 && (best == 0 || us[t + 1] < us[best]))
            best = t + 1;
    }
    moe_cuda_gemm_force_tile(-1);
    printf("%-16s %-5s %6lld | %9.1f %7.1f %7.0f |", label, moe_type_get(c->type)->name,
           (long long)(c->grouped ? SLOTS : c->n_tok), us[0], flops / (us[0] * 1e-6) / 1e12,
           wbytes / (us[0] * 1e-6) / 1e9);
    if (!auto_only)
        for (int t = 0; t < N_TILES; t++)
            printf(" %8.1f%c", us[t + 1], t + 1 == best ? '*' : ' ');
    printf("\n");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 0.2;
    const char *type_filter = argc > 2 ? argv[2] : NULL, *shape_filter = argc > 3 ? argv[3] : NULL;
    int auto_only = argc > 4 && strcmp(argv[4], "auto") == 0;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("bench_cuda_gemm: no CUDA device; nothing to measure\n");
        return 0;
    }
    CU(cudaSetDevice(0));
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    int rt = 0, drv = 0;
    CU(cudaRuntimeGetVersion(&rt));
    CU(cudaDriverGetVersion(&drv));
    printf("device: %s, %d SMs, L2 %d MB, %.1f GiB, runtime %d, driver %d\n", prop.name,
           prop.multiProcessorCount, prop.l2CacheSize >> 20,
           (double)prop.totalGlobalMem / (1 << 30), rt, drv);
    printf("timing: CUDA events per call, median over >= %.2f s per case after warm-up; weight "
           "copies rotated so >= %u MiB is read between reuses\n", secs, ROTATE_BYTES >> 20);
    printf("tiles (rows x tokens): 0 = 128x128, 1 = 128x64, 2 = 64x64, 3 = 128x32; '*' = fastest\n\n");
    printf("%-16s %-5s %6s | %9s %7s %7s | %9s %9s %9s %9s\n", "shape", "type", "tokens",
           "auto us", "TFLOP/s", "GB/s", "tile 0", "tile 1", "tile 2", "tile 3");

    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    float *tmp = malloc(8192 * sizeof(float));
    if (!tmp)
        return 1;

    /* Activations and outputs big enough for every case. */
    const size_t xfloats = 4096 * 4096, yfloats = 4096 * 4096;
    float *hx = malloc(xfloats * sizeof(float)), *dx, *dy;
    if (!hx)
        return 1;
    for (size_t i = 0; i < xfloats; i++)
        hx[i] = bench_rng_f();
    CU(cudaMalloc((void **)&dx, xfloats * sizeof(float)));
    CU(cudaMalloc((void **)&dy, yfloats * sizeof(float)));
    CU(cudaMemcpy(dx, hx, xfloats * sizeof(float), cudaMemcpyHostToDevice));

    for (size_t s = 0; s < sizeof dense_shapes / sizeof dense_shapes[0]; s++) {
        const struct dense_shape *sh = &dense_shapes[s];
        if (shape_filter && !strstr(sh->name, shape_filter))
            continue;
        for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
            const uint32_t type = types[t];
            if (type_filter && strcmp(type_filter, moe_type_get(type)->name) != 0)
                continue;
            const size_t wbytes = moe_row_bytes(type, sh->n) * (size_t)sh->rows;
            int64_t copies = (int64_t)((ROTATE_BYTES + wbytes - 1) / wbytes);
            copies = copies < 1 ? 1 : copies;
            uint8_t *hw = malloc(wbytes * (size_t)copies), *dw;
            if (!hw)
                return 1;
            fill_rows(hw, type, sh->n, wbytes * (size_t)copies, tmp);
            CU(cudaMalloc((void **)&dw, wbytes * (size_t)copies));
            CU(cudaMemcpy(dw, hw, wbytes * (size_t)copies, cudaMemcpyHostToDevice));
            free(hw);
            for (size_t k = 0; k < sizeof token_counts / sizeof token_counts[0]; k++) {
                const struct bench_case c = {0, type, sh->rows, sh->n, token_counts[k], dw, wbytes,
                                             copies, NULL, NULL, NULL, dx, dy};
                run_case(sh->name, &c, 2.0 * (double)sh->rows * (double)sh->n * (double)token_counts[k],
                         (double)wbytes, secs, auto_only, st);
            }
            CU(cudaFree(dw));
        }
    }

    /* Expert layers: 512 tokens, each routed to 8 distinct experts at random. */
    int32_t off[EXPERTS + 1], xrow[SLOTS];
    int counts[EXPERTS] = {0}, expert_of[SLOTS];
    for (int k = 0; k < ROUTED_TOKENS; k++) {
        int chosen[TOP_K];
        for (int j = 0; j < TOP_K; j++) {
            int e, dup;
            do {
                e = (int)(rng_u32() % EXPERTS);
                dup = 0;
                for (int i = 0; i < j; i++)
                    dup |= chosen[i] == e;
            } while (dup);
            chosen[j] = e;
            expert_of[k * TOP_K + j] = e;
            counts[e]++;
        }
    }
    off[0] = 0;
    int used = 0, minc = SLOTS, maxc = 0;
    for (int e = 0; e < EXPERTS; e++) {
        off[e + 1] = off[e] + counts[e];
        used += counts[e] > 0;
        minc = counts[e] < minc ? counts[e] : minc;
        maxc = counts[e] > maxc ? counts[e] : maxc;
    }
    int fill[EXPERTS];
    memcpy(fill, off, sizeof fill);
    for (int s = 0; s < SLOTS; s++)
        xrow[fill[expert_of[s]]++] = s / TOP_K; /* slots sorted by expert, each reading its token */
    int32_t *doff, *dxrow;
    CU(cudaMalloc((void **)&doff, sizeof off));
    CU(cudaMalloc((void **)&dxrow, sizeof xrow));
    CU(cudaMemcpy(doff, off, sizeof off, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dxrow, xrow, sizeof xrow, cudaMemcpyHostToDevice));
    printf("\nexperts: %d, %d used, slots per expert %d..%d (mean %.1f)\n", EXPERTS, used,
           minc, maxc, (double)SLOTS / EXPERTS);
    for (size_t s = 0; s < sizeof expert_shapes / sizeof expert_shapes[0]; s++) {
        const struct dense_shape *sh = &expert_shapes[s];
        if (shape_filter && !strstr(sh->name, shape_filter))
            continue;
        const int gate_up = sh->n == 2048;
        for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
            const uint32_t type = types[t];
            if (type_filter && strcmp(type_filter, moe_type_get(type)->name) != 0)
                continue;
            const size_t mbytes = moe_row_bytes(type, sh->n) * (size_t)sh->rows;
            const size_t lbytes = mbytes * EXPERTS;
            int64_t copies = (int64_t)((ROTATE_BYTES + lbytes - 1) / lbytes);
            copies = copies < 1 ? 1 : copies;
            uint8_t *hw = malloc(lbytes), *dw;
            void **tab = malloc(sizeof(void *) * EXPERTS * (size_t)copies), **dtab;
            if (!hw || !tab)
                return 1;
            fill_rows(hw, type, sh->n, lbytes, tmp);
            CU(cudaMalloc((void **)&dw, lbytes * (size_t)copies));
            for (int64_t c = 0; c < copies; c++)
                CU(cudaMemcpy(dw + lbytes * (size_t)c, hw, lbytes, cudaMemcpyHostToDevice));
            for (int64_t c = 0; c < copies; c++)
                for (int e = 0; e < EXPERTS; e++)
                    tab[c * EXPERTS + e] = dw + lbytes * (size_t)c + mbytes * (size_t)e;
            CU(cudaMalloc((void **)&dtab, sizeof(void *) * EXPERTS * (size_t)copies));
            CU(cudaMemcpy(dtab, tab, sizeof(void *) * EXPERTS * (size_t)copies,
                          cudaMemcpyHostToDevice));
            /* gate/up read the routed tokens' rows through d_xrow; down reads one row per slot. */
            const struct bench_case c = {1, type, sh->rows, sh->n, SLOTS, NULL, 0, copies, dtab,
                                         doff, gate_up ? dxrow : NULL, dx, dy};
            run_case(sh->name, &c, 2.0 * (double)sh->rows * (double)sh->n * SLOTS,
                     (double)mbytes * used, secs, auto_only, st);
            CU(cudaFree(dw));
            CU(cudaFree(dtab));
            free(hw);
            free(tab);
        }
    }
    CU(cudaFree(doff));
    CU(cudaFree(dxrow));
    CU(cudaFree(dx));
    CU(cudaFree(dy));
    CU(cudaStreamDestroy(st));
    free(hx);
    free(tmp);
    return 0;
}
#endif

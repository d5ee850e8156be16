/* Benchmark of the tensor-core mat-vec (worker/cuda/mv_tc.cu; its inputs staged in every block,
 * and staged once by a launch of their own) against the float walk (moe_cuda_matvec_tok) on Q4_K
 * and Q6_K weights of the Qwen3-30B-A3B shapes, for 1 to 16 tokens: the microseconds of one
 * launch replayed from a CUDA graph, and the weight bytes over that time.
 *
 * Shapes: a layer's eight chosen experts' gate and up rows as one matrix (12288 × 2048, the bytes
 * one decode step's gate/up reads), q (4096 × 2048), o (2048 × 4096) and one expert's down (2048 ×
 * 768). Copies of each matrix are rotated so that more than 256 MiB is read between two reads of
 * one copy (L2 would otherwise serve them). Both kernels are checked against each other on the
 * first launch of each case (within 1e-5 of the row's Σ|w·x|, which the GPU tests hold each to
 * against the CPU).
 *
 *   build/bench/bench_cuda_mv_tc [seconds per case, default 0.1] */
#include <stdio.h>

#ifndef MOE_HAVE_CUDA
int main(void)
{
    printf("bench_cuda_mv_tc: built without CUDA (no nvcc at build time); nothing to measure\n");
    return 0;
}
#else

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "store/ggml_type.h"
#include "store/quant.h"
#include "worker/cuda/matvec.h"
#include "worker/cuda/mv_tc.h"

#define BENCH_NAME "bench_cuda_mv_tc"
#include "bench/bench_cuda.h"

#define ROTATE_BYTES (256u << 20)
#define MAX_TOK 16

struct shape {
    const char *name;
    uint32_t type;
    int64_t rows, n;
};

static const struct shape shapes[] = {
    {"8 experts gate+up", MOE_TYPE_Q4_K, 12288, 2048},
    {"q", MOE_TYPE_Q4_K, 4096, 2048},
    {"o", MOE_TYPE_Q4_K, 2048, 4096},
    {"expert down", MOE_TYPE_Q4_K, 2048, 768},
    {"expert down q6_K", MOE_TYPE_Q6_K, 2048, 768},
    {"8 experts down q6_K", MOE_TYPE_Q6_K, 2048 * 8, 768},
};

/* The workspace of the tensor-core launches with the inputs staged once (tc 2). */
static void *ws;
static size_t ws_bytes;

/* tc: 0 the float walk, 1 tensor cores (inputs staged in each block), 2 tensor cores with the
 * inputs staged once by a launch of their own. */
static int launch(int tc, const uint8_t *w, const struct shape *sh, const float *dx, int64_t nt,
                  float *dy, cudaStream_t st)
{
    if (tc)
        return moe_cuda_matvec_tc_ws(sh->type, w, sh->n, sh->rows, dx, sh->n, nt, dy, sh->rows,
                                     tc == 2 ? ws : NULL, tc == 2 ? ws_bytes : 0, st);
    return moe_cuda_matvec_tok(sh->type, w, sh->n, sh->rows, dx, sh->n, nt, dy, sh->rows, 0,
                               st);
}

static void launches(int tc, const uint8_t *w, size_t bytes, int64_t copies, int64_t first,
                     int count, const struct shape *sh, const float *dx, int64_t nt, float *dy,
                     cudaStream_t st)
{
    for (int i = 0; i < count; i++) {
        const uint8_t *wi = w + bytes * (size_t)((first + i) % copies);
        int rc = launch(tc, wi, sh, dx, nt, dy, st);
        if (rc != 0) {
            fprintf(stderr, BENCH_NAME ": launch failed (%s, %lld tokens): %d\n", sh->name,
                    (long long)nt, rc);
            exit(1);
        }
    }
}

/* Microseconds per launch, from a graph of 64 launches replayed for about `secs`. */
static double time_case(int tc, const uint8_t *w, size_t bytes, int64_t copies,
                        const struct shape *sh, const float *dx, int64_t nt, float *dy,
                        cudaStream_t st, double secs)
{
    enum { G = 64 };
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    launches(tc, w, bytes, copies, 0, G, sh, dx, nt, dy, st);
    CU(cudaStreamEndCapture(st, &graph));
    CU(cudaGraphInstantiate(&exec, graph, 0));
    CU(cudaGraphLaunch(exec, st)); /* warm-up */
    CU(cudaEventRecord(e0, st));
    CU(cudaGraphLaunch(exec, st));
    CU(cudaEventRecord(e1, st));
    const double once = elapsed_ms(e0, e1);
    int reps = (int)(secs * 1e3 / (once > 1e-3 ? once : 1e-3));
    reps = reps < 3 ? 3 : reps > 2000 ? 2000 : reps;
    /* Median of five timed groups of replays. */
    double t[5];
    for (int k = 0; k < 5; k++) {
        CU(cudaEventRecord(e0, st));
        for (int r = 0; r < (reps + 4) / 5; r++)
            CU(cudaGraphLaunch(exec, st));
        CU(cudaEventRecord(e1, st));
        t[k] = elapsed_ms(e0, e1) * 1e3 / ((double)((reps + 4) / 5) * G);
    }
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            if (t[j] < t[i]) {
                double s = t[i];
                t[i] = t[j];
                t[j] = s;
            }
    CU(cudaGetLastError());
    CU(cudaGraphExecDestroy(exec));
    CU(cudaGraphDestroy(graph));
    CU(cudaEventDestroy(e0));
    CU(cudaEventDestroy(e1));
    return t[2];
}

/* The kernels' results on copy 0 against the float walk's: the largest |a − b| / Σ|w·x| over
 * every row, token and tensor-core form (Σ from the dequantised rows, in double); *staged_diff
 * counts the floats where the two tensor-core forms differ (none should). */
static double cross_check(const uint8_t *hw, const uint8_t *dw, const struct shape *sh,
                          const float *hx, const float *dx, int64_t nt, float *dy,
                          cudaStream_t st, size_t *staged_diff)
{
    const size_t ny = (size_t)sh->rows * (size_t)nt, rb = moe_row_bytes(sh->type, sh->n);
    float *a = malloc(ny * sizeof *a), *b = malloc(ny * sizeof *b), *c = malloc(ny * sizeof *c);
    float *d = malloc(sizeof(float) * sh->n);
    if (!a || !b || !c || !d)
        exit(1);
    for (int tc = 0; tc < 3; tc++) {
        CU(cudaMemsetAsync(dy, 0xff, ny * sizeof(float), st));
        if (launch(tc, dw, sh, dx, nt, dy, st) != 0)
            exit(1);
        CU(cudaMemcpyAsync(tc == 0 ? a : tc == 1 ? b : c, dy, ny * sizeof(float),
                           cudaMemcpyDeviceToHost, st));
    }
    CU(cudaStreamSynchronize(st));
    *staged_diff = 0;
    for (size_t k = 0; k < ny; k++)
        *staged_diff += memcmp(&b[k], &c[k], sizeof(float)) != 0;
    double worst = 0.0;
    for (int64_t r = 0; r < sh->rows; r++) {
        moe_dequantize(sh->type, hw + rb * (size_t)r, d, sh->n);
        for (int64_t t = 0; t < nt; t++) {
            double s = 0.0;
            for (int64_t i = 0; i < sh->n; i++)
                s += fabs((double)d[i] * hx[t * sh->n + i]);
            const size_t k = (size_t)t * sh->rows + (size_t)r;
            double e = fabs((double)a[k] - (double)b[k]) / (s > 0 ? s : 1.0);
            if (!(e <= worst))
                worst = isnan(e) ? INFINITY : e;
        }
    }
    free(a);
    free(b);
    free(c);
    free(d);
    return worst;
}

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 0.1;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf(BENCH_NAME ": no CUDA device; nothing to measure\n");
        return 0;
    }
    CU(cudaSetDevice(0));
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    float *dx, *dy, *hx = malloc(sizeof(float) * MAX_TOK * 4096);
    CU(cudaMalloc((void **)&dx, sizeof(float) * MAX_TOK * 4096));
    CU(cudaMalloc((void **)&dy, sizeof(float) * MAX_TOK * 16384));
    ws_bytes = moe_cuda_matvec_tc_ws_bytes(4096, MAX_TOK);
    CU(cudaMalloc(&ws, ws_bytes));
    printf("%-20s %4s %10s %10s %10s %10s %10s %8s %8s %10s\n", "shape", "tok", "float us",
           "tc us", "staged us", "float GB/s", "tc GB/s", "ratio", "staged", "max diff");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const struct shape *sh = &shapes[s];
        const size_t bytes = moe_row_bytes(sh->type, sh->n) * (size_t)sh->rows;
        const int64_t copies = (ROTATE_BYTES + bytes - 1) / bytes;
        uint8_t *hw = malloc(bytes), *dw;
        float *row = malloc(sizeof(float) * sh->n);
        if (!hw || !row)
            return 1;
        for (int64_t r = 0; r < sh->rows; r++) {
            const float sc = 0.02f * (1.0f + (float)(r % 7));
            for (int64_t i = 0; i < sh->n; i++)
                row[i] = bench_rng_f() * sc;
            moe_quantize(sh->type, row, hw + moe_row_bytes(sh->type, sh->n) * (size_t)r, sh->n);
        }
        CU(cudaMalloc((void **)&dw, bytes * (size_t)copies));
        for (int64_t c = 0; c < copies; c++)
            CU(cudaMemcpy(dw + bytes * (size_t)c, hw, bytes, cudaMemcpyHostToDevice));
        for (int64_t i = 0; i < MAX_TOK * sh->n; i++)
            hx[i] = bench_rng_f() * 2.0f;
        CU(cudaMemcpy(dx, hx, sizeof(float) * MAX_TOK * sh->n, cudaMemcpyHostToDevice));
        static const int64_t toks[] = {1, 2, 4, 8, 16};
        for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++) {
            const int64_t nt = toks[k];
            size_t sdiff = 0;
            const double diff = cross_check(hw, dw, sh, hx, dx, nt, dy, st, &sdiff);
            const double uf = time_case(0, dw, bytes, copies, sh, dx, nt, dy, st, secs);
            const double ut = time_case(1, dw, bytes, copies, sh, dx, nt, dy, st, secs);
            const double us = time_case(2, dw, bytes, copies, sh, dx, nt, dy, st, secs);
            printf("%-20s %4lld %10.2f %10.2f %10.2f %10.0f %10.0f %8.2f %8.2f %10.2e%s\n",
                   sh->name, (long long)nt, uf, ut, us, bytes / uf / 1e3, bytes / ut / 1e3,
                   uf / ut, uf / us, diff, sdiff ? " STAGED DIFFERS" : "");
            fflush(stdout);
        }
        CU(cudaFree(dw));
        free(hw);
        free(row);
    }
    return 0;
}

#endif

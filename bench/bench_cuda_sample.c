/* Benchmark of worker/cuda/sample.cu: µs per moe_cuda_sample launch for 1 and 16 rows of 151936
 * logits (Qwen3's vocabulary), by sampling configuration and logit distribution.
 *
 * Method: the logits are generated once and copied to the device before each column of each
 * case; launches repeat on them (penalties, when on, keep changing the few history entries,
 * which does not change the work). "stream": back-to-back
 * launches timed with CUDA events; "graph": the same launch captured once and replayed. The
 * first launches are warm-up. Distributions: "llm" (a few dominant logits over a wide tail, like
 * a language model's: small nuclei) and "flat" (N(0, 1): top-p 0.95 keeps ~90% of the
 * vocabulary, the worst case for the sort-free exact path).
 *
 * Columns: every pass this configuration can spread over the GPU (back-to-back launches, then a
 * graph), and a graph with only the greedy scan spread (the one-block passes otherwise).
 *
 *   build/bench/bench_cuda_sample [seconds per case, default 0.1] [config substring] [llm|flat] */
#include <stdio.h>

#ifndef MOE_HAVE_CUDA
int main(void)
{
    printf("bench_cuda_sample: built without CUDA (no nvcc at build time); nothing to measure\n");
    return 0;
}
#else

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "store/err.h"
#include "worker/cuda/sample.h"
#include "worker/sampler.h"

#define BENCH_NAME "bench_cuda_sample"
#include "bench/bench_cuda.h"


#define NV 151936u

static double unit(void)
{
    return ((double)(bench_rng_next() >> 11) + 0.5) * 0x1.0p-53;
}

static double normal(void)
{
    return sqrt(-2.0 * log(unit())) * cos(6.283185307179586 * unit());
}

struct config {
    const char *name;
    float t;
    int32_t k;
    float top_p, min_p, rep;
};

static const struct config configs[] = {
    {"greedy", 0.0f, 0, 1.0f, 0.0f, 1.0f},
    {"greedy+penalty", 0.0f, 0, 1.0f, 0.0f, 1.3f},
    {"top-k 40, top-p 0.95, min-p 0.05 (defaults)", 0.8f, 40, 0.95f, 0.05f, 1.0f},
    {"top-k 40", 0.8f, 40, 1.0f, 0.0f, 1.0f},
    {"top-k 20, top-p 0.8", 0.7f, 20, 0.8f, 0.0f, 1.0f},
    {"top-k 40 + repeat penalty", 0.8f, 40, 1.0f, 0.0f, 1.3f},
    {"top-p 0.95", 1.0f, 0, 0.95f, 0.0f, 1.0f},
    {"min-p 0.05", 1.0f, 0, 1.0f, 0.05f, 1.0f},
    {"temperature only", 1.0f, 0, 1.0f, 0.0f, 1.0f},
    {"temperature + min-p 0.05", 0.8f, 0, 1.0f, 0.05f, 1.0f},
};

static double time_case(struct moe_cuda_sampler *g, float *d_logits, uint32_t rows,
                        int32_t *d_tok, cudaStream_t st, double secs, int graph, int spread)
{
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    cudaGraphExec_t exec = NULL;
    cudaGraph_t gr = NULL;
    if (graph) {
        CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        if (moe_cuda_sample_rows(g, d_logits, rows, NULL, d_tok, NULL, 1, spread, st))
            exit(1);
        CU(cudaStreamEndCapture(st, &gr));
        CU(cudaGraphInstantiate(&exec, gr, 0));
    }
    int n = 10;
    double us = 0.0;
    for (;;) {
        CU(cudaEventRecord(e0, st));
        for (int i = 0; i < n; i++) {
            if (graph)
                CU(cudaGraphLaunch(exec, st));
            else if (moe_cuda_sample_rows(g, d_logits, rows, NULL, d_tok, NULL, 1, spread, st))
                exit(1);
        }
        CU(cudaEventRecord(e1, st));
        CU(cudaEventSynchronize(e1));
        float ms;
        CU(cudaEventElapsedTime(&ms, e0, e1));
        us = 1000.0 * ms / n;
        if (ms >= 1000.0 * secs || n >= 1 << 20)
            break;
        n *= 4;
    }
    if (graph) {
        CU(cudaGraphExecDestroy(exec));
        CU(cudaGraphDestroy(gr));
    }
    CU(cudaEventDestroy(e0));
    CU(cudaEventDestroy(e1));
    return us;
}

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 0.1;
    const char *filter = argc > 2 ? argv[2] : NULL;
    const char *only_dist = argc > 3 ? argv[3] : NULL;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("bench_cuda_sample: no CUDA device\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    const uint32_t max_rows = 16;
    /* The logits of each distribution, kept on the host too: every case starts from them (the
     * penalised cases change their device copy in place). */
    float *h[2] = {malloc(sizeof(float) * NV * max_rows), malloc(sizeof(float) * NV * max_rows)};
    if (!h[0] || !h[1])
        return 1;
    float *d_logits[2];
    int32_t *d_tok;
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (int dist = 0; dist < 2; dist++) {
        for (size_t i = 0; i < (size_t)NV * max_rows; i++)
            h[dist][i] =
                dist == 0 ? (float)(4.0 * normal() - 2.0 - 6.0 * log(unit())) : (float)normal();
        CU(cudaMalloc((void **)&d_logits[dist], sizeof(float) * NV * max_rows));
    }
    CU(cudaMalloc((void **)&d_tok, sizeof(int32_t) * max_rows));
    char err[256];
    struct moe_cuda_sampler *g;
    int rc = moe_cuda_sampler_init(&g, max_rows, NV, 256, 0, err, sizeof err);
    if (rc) {
        fprintf(stderr, "moe_cuda_sampler_init: %s\n", err);
        return 1;
    }
    int32_t hist[64];
    for (int i = 0; i < 64; i++)
        hist[i] = (int32_t)(unit() * NV);
    printf("%-46s %-5s %5s %10s %10s %12s\n", "config", "dist", "rows", "stream us", "graph us",
           "greedy-only");
    for (size_t c = 0; c < sizeof configs / sizeof configs[0]; c++) {
        if (filter && !strstr(configs[c].name, filter))
            continue;
        for (int dist = 0; dist < 2; dist++) {
            if (only_dist && strcmp(only_dist, dist ? "flat" : "llm"))
                continue;
            if (configs[c].t <= 0.0f && dist == 1)
                continue; /* greedy does not depend on the distribution */
            for (uint32_t rows = 1; rows <= max_rows; rows *= 16) {
                struct moe_sampler_params p;
                moe_sampler_defaults(&p);
                p.temperature = configs[c].t;
                p.top_k = configs[c].k;
                p.top_p = configs[c].top_p;
                p.min_p = configs[c].min_p;
                p.repeat_penalty = configs[c].rep;
                for (uint32_t r = 0; r < rows; r++) {
                    p.seed = 1000 + r;
                    if (moe_cuda_sampler_set_row(g, r, &p, st, err, sizeof err) ||
                        moe_cuda_sampler_set_history(g, r, hist, 64, st)) {
                        fprintf(stderr, "set_row: %s\n", err);
                        return 1;
                    }
                }
                int spread = moe_cuda_sampler_row_spread(g, 0);
                double us[3];
                const int sp[3] = {spread, spread, spread & MOE_CUDA_SPREAD_GREEDY};
                for (int k = 0; k < 3; k++) {
                    CU(cudaMemcpy(d_logits[dist], h[dist], sizeof(float) * NV * max_rows,
                                  cudaMemcpyHostToDevice));
                    us[k] = time_case(g, d_logits[dist], rows, d_tok, st, secs, k > 0, sp[k]);
                }
                const double us_s = us[0], us_g = us[1], us_1 = us[2];
                printf("%-46s %-5s %5u %10.1f %10.1f %12.1f\n", configs[c].name,
                       dist ? "flat" : "llm", rows, us_s, us_g, us_1);
                fflush(stdout);
            }
        }
    }
    moe_cuda_sampler_free(g);
    CU(cudaFree(d_logits[0]));
    CU(cudaFree(d_logits[1]));
    CU(cudaFree(d_tok));
    CU(cudaStreamDestroy(st));
    free(h[0]);
    free(h[1]);
    return 0;
}
#endif

/* Benchmark of worker/cuda/matvec.cu: GB/s of weight bytes read by moe_cuda_matvec, per type,
 * for a Qwen3-30B-A3B expert (gate/up: 768 rows × 2048, down: 2048 rows × 768) and for the output
 * head (151936 rows × 2048), with the weights in VRAM and in host-mapped memory.
 *
 * Method (docs/cuda.md): the weights are random quantized rows, several copies rotated so that
 * more than 256 MiB is read between two reads of one copy (L2 is 60 MB and would otherwise serve
 * the small shapes); warm-up first; CUDA events around many launches. Three numbers per case:
 * back-to-back launches on a stream (what a naive worker gets), the same launches replayed from a
 * CUDA graph (what the one-graph-per-step design gets), and the graph form reading host-mapped
 * weights over PCIe. The ceilings are measured in the same run: a device-to-device copy
 * (bytes read + written) and a pinned host-to-device copy.
 *
 *   build/bench/bench_cuda_matvec [seconds per case, default 0.15] [type] [shape substring]
 *
 * The filters pick one case, e.g. to look at it under ncu: `bench_cuda_matvec 0.01 q4_K head`. */
#include <stdio.h>

#ifndef MOE_HAVE_CUDA
int main(void)
{
    printf("bench_cuda_matvec: built without CUDA (no nvcc at build time); nothing to measure\n");
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

#define BENCH_NAME "bench_cuda_matvec"
#include "bench/bench_cuda.h"


#define ROTATE_BYTES (256u << 20)
#define DISTINCT_ROWS 64

struct shape {
    const char *name;
    int64_t rows, n;
};

static const struct shape shapes[] = {
    {"expert gate/up", 768, 2048},
    {"expert down", 2048, 768},
    {"output head", 151936, 2048},
};

static const uint32_t types[] = {MOE_TYPE_F32, MOE_TYPE_F16, MOE_TYPE_BF16, MOE_TYPE_Q8_0,
                                 MOE_TYPE_Q6_K, MOE_TYPE_Q5_K, MOE_TYPE_Q5_0, MOE_TYPE_Q4_K,
                                 MOE_TYPE_Q4_0};


static int64_t copies_for(size_t bytes)
{
    int64_t k = (int64_t)((ROTATE_BYTES + bytes - 1) / bytes);
    return k < 1 ? 1 : k;
}

/* Enqueues `count` launches starting at copy `first`, rotating through the copies. */
static void launches(uint32_t type, const uint8_t *w, size_t bytes, int64_t copies, int64_t first,
                     int count, const struct shape *sh, const float *dx, float *dy, cudaStream_t st)
{
    for (int i = 0; i < count; i++) {
        const uint8_t *wi = w + bytes * (size_t)((first + i) % copies);
        int rc = moe_cuda_matvec(type, wi, sh->n, sh->rows, dx, dy, st);
        if (rc != 0) {
            fprintf(stderr, "bench_cuda_matvec: moe_cuda_matvec(%s) failed: %d\n",
                    moe_type_get(type)->name, rc);
            exit(1);
        }
    }
}

/* Microseconds per launch: calibrate on a few launches, then time about `secs` seconds. With
 * use_graph, a graph of up to 64 launches is captured once and replayed. */
static double time_case(uint32_t type, const uint8_t *w, size_t bytes, int64_t copies,
                        const struct shape *sh, const float *dx, float *dy, cudaStream_t st,
                        double secs, int use_graph)
{
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    launches(type, w, bytes, copies, 0, 3, sh, dx, dy, st); /* warm-up, module load */
    CU(cudaEventRecord(e0, st));
    launches(type, w, bytes, copies, 3, 5, sh, dx, dy, st);
    CU(cudaEventRecord(e1, st));
    double per_ms = elapsed_ms(e0, e1) / 5.0;
    int iters = (int)(secs * 1e3 / (per_ms > 1e-4 ? per_ms : 1e-4));
    iters = iters < 5 ? 5 : iters > 50000 ? 50000 : iters;
    double us;
    if (!use_graph) {
        CU(cudaEventRecord(e0, st));
        launches(type, w, bytes, copies, 8, iters, sh, dx, dy, st);
        CU(cudaEventRecord(e1, st));
        us = elapsed_ms(e0, e1) * 1e3 / iters;
    } else {
        int g = iters < 64 ? iters : 64, reps = (iters + g - 1) / g;
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        launches(type, w, bytes, copies, 8, g, sh, dx, dy, st);
        CU(cudaStreamEndCapture(st, &graph));
        CU(cudaGraphInstantiate(&exec, graph, 0));
        CU(cudaGraphLaunch(exec, st)); /* warm-up */
        CU(cudaEventRecord(e0, st));
        for (int r = 0; r < reps; r++)
            CU(cudaGraphLaunch(exec, st));
        CU(cudaEventRecord(e1, st));
        us = elapsed_ms(e0, e1) * 1e3 / ((double)reps * g);
        CU(cudaGraphExecDestroy(exec));
        CU(cudaGraphDestroy(graph));
    }
    CU(cudaGetLastError());
    CU(cudaEventDestroy(e0));
    CU(cudaEventDestroy(e1));
    return us;
}

/* GB/s of a copy of `bytes`, counting what is read plus what is written for device-to-device
 * and what crosses PCIe for host-to-device. */
static double copy_gbs(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                       cudaStream_t st)
{
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    CU(cudaMemcpyAsync(dst, src, bytes, kind, st));
    CU(cudaEventRecord(e0, st));
    for (int i = 0; i < 5; i++)
        CU(cudaMemcpyAsync(dst, src, bytes, kind, st));
    CU(cudaEventRecord(e1, st));
    double s = elapsed_ms(e0, e1) / 5.0 / 1e3;
    CU(cudaEventDestroy(e0));
    CU(cudaEventDestroy(e1));
    return (kind == cudaMemcpyDeviceToDevice ? 2.0 : 1.0) * (double)bytes / s / 1e9;
}

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 0.15;
    const char *type_filter = argc > 2 ? argv[2] : NULL, *shape_filter = argc > 3 ? argv[3] : NULL;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("bench_cuda_matvec: no CUDA device; nothing to measure\n");
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

    /* One device region and one mapped host region hold the rotated copies of every case. */
    size_t region = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
            size_t b = moe_row_bytes(types[t], shapes[s].n) * (size_t)shapes[s].rows;
            size_t need = b * (size_t)copies_for(b);
            region = need > region ? need : region;
        }
    uint8_t *dw, *hw, *hw_dev;
    float *dx, *dy;
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CU(cudaMalloc((void **)&dw, region));
    CU(cudaHostAlloc((void **)&hw, region, cudaHostAllocMapped));
    CU(cudaHostGetDevicePointer((void **)&hw_dev, hw, 0));
    CU(cudaMalloc((void **)&dx, 4096 * sizeof(float)));
    CU(cudaMalloc((void **)&dy, 151936 * sizeof(float)));

    memset(hw, 0x5a, region);
    uint8_t *dw2;
    size_t cbytes = region / 2;
    CU(cudaMalloc((void **)&dw2, cbytes));
    double d2d = copy_gbs(dw2, dw, cbytes, cudaMemcpyDeviceToDevice, st);
    double h2d = copy_gbs(dw, hw, region, cudaMemcpyHostToDevice, st);
    CU(cudaFree(dw2));
    printf("ceilings: device copy %.0f GB/s (read + write, %.0f MB), pinned host->device copy "
           "%.1f GB/s (%.0f MB)\n", d2d, cbytes / 1e6, h2d, region / 1e6);
    printf("timing: CUDA events, >= %.2f s per case after warm-up; copies rotated so >= %u MiB "
           "is read between reuses\n\n", secs, ROTATE_BYTES >> 20);

    printf("%-15s %-5s %8s %6s | %9s %7s | %9s %7s %5s | %9s %6s %5s\n", "shape", "type", "MB",
           "copies", "stream us", "GB/s", "graph us", "GB/s", "%cpy", "mapped us", "GB/s",
           "%h2d");
    float *xh = malloc(4096 * sizeof(float));
    float *tmp = malloc(4096 * sizeof(float));
    if (!xh || !tmp)
        return 1;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const struct shape *sh = &shapes[s];
        if (shape_filter && !strstr(sh->name, shape_filter))
            continue;
        for (int64_t i = 0; i < sh->n; i++)
            xh[i] = bench_rng_f();
        CU(cudaMemcpy(dx, xh, (size_t)sh->n * sizeof(float), cudaMemcpyHostToDevice));
        for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
            uint32_t type = types[t];
            if (type_filter && strcmp(type_filter, moe_type_get(type)->name) != 0)
                continue;
            size_t rb = moe_row_bytes(type, sh->n), bytes = rb * (size_t)sh->rows;
            int64_t copies = copies_for(bytes), total_rows = copies * sh->rows;
            /* DISTINCT_ROWS random quantized rows, repeated: quantizing 300 M elements would
             * take longer than the whole benchmark, and repetition does not help any cache. */
            for (int64_t r = 0; r < DISTINCT_ROWS; r++) {
                for (int64_t i = 0; i < sh->n; i++)
                    tmp[i] = bench_rng_f() * (0.02f + 0.05f * (float)((i / 32 + r) % 5));
                if (moe_quantize(type, tmp, hw + rb * (size_t)r, sh->n) != 0)
                    return 1;
            }
            for (int64_t r = DISTINCT_ROWS; r < total_rows; r++)
                memcpy(hw + rb * (size_t)r, hw + rb * (size_t)(r % DISTINCT_ROWS), rb);
            CU(cudaMemcpy(dw, hw, bytes * (size_t)copies, cudaMemcpyHostToDevice));
            CU(cudaDeviceSynchronize()); /* the timed stream does not wait for the copies */

            double us_s = time_case(type, dw, bytes, copies, sh, dx, dy, st, secs, 0);
            double us_g = time_case(type, dw, bytes, copies, sh, dx, dy, st, secs, 1);
            double us_h = time_case(type, hw_dev, bytes, copies, sh, dx, dy, st, secs, 1);
            double gb = (double)bytes / 1e9;
            printf("%-15s %-5s %8.2f %6lld | %9.2f %7.0f | %9.2f %7.0f %4.0f%% | %9.1f %6.1f "
                   "%4.0f%%\n", sh->name, moe_type_get(type)->name, bytes / 1e6,
                   (long long)copies, us_s, gb / (us_s * 1e-6), us_g, gb / (us_g * 1e-6),
                   100.0 * gb / (us_g * 1e-6) / d2d, us_h, gb / (us_h * 1e-6),
                   100.0 * gb / (us_h * 1e-6) / h2d);
        }
    }
    free(xh);
    free(tmp);
    CU(cudaFree(dw));
    CU(cudaFreeHost(hw));
    CU(cudaFree(dx));
    CU(cudaFree(dy));
    CU(cudaStreamDestroy(st));
    return 0;
}
#endif

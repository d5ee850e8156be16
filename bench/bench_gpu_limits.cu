/* What the GPU itself costs a decode step, apart from moed's kernels: the price of a kernel node in
 * a CUDA graph, of a grid barrier inside one persistent kernel, and how fast a burst of weight
 * bytes of a decode kernel's size can come from HBM, contiguous or scattered like a layer's
 * chosen experts. These are the floors the step's launches are measured against
 * (docs/benchmarks.md, "What the GPU allows a decode step").
 *
 *   build/bench/bench_gpu_limits [repetitions, default 200]
 *
 * Method: every number is the median of `repetitions` timed runs. Nodes: a graph of 336 kernels
 * (48 layers × 7, a one-token step's count) replayed, µs per node, for an empty kernel of one
 * warp, an empty kernel of 2 blocks an SM, and a kernel of 2 blocks an SM whose every warp does
 * one dependent load round trip. Barriers: one kernel of 1 or 2 blocks an SM (a cooperative
 * launch) crossing 336 grid barriers (an arrival counter and a release flag, the fused step's
 * form). Reads: L2 is flushed (a 256 MiB buffer written) before each timed read; the read
 * kernel keeps 8 of a thread's 16-byte loads in flight, and its time is taken inside the kernel
 * (first block's start to last block's end, %globaltimer) and by events around it. The scattered
 * reads take 16 pieces of 864 KiB (8 experts' gate and up of a 30B-A3B Q4_K layer) at random
 * expert slots of a 16 GiB arena, against the same bytes side by side. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#define BENCH_NAME "bench_gpu_limits"
#include "bench/bench_cuda.h"

#define NODES 336

static __device__ __forceinline__ uint64_t now_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

static __global__ void k_empty(int *sink)
{
    if (threadIdx.x == 1024)
        *sink = 1;
}

/* One dependent round trip per warp: an index load, then the load it names. */
static __global__ void k_roundtrip(const uint32_t *idx, const float *buf, float *out)
{
    const unsigned w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const uint32_t i = __ldcg(idx + (w & 1023));
    const float v = __ldcg(buf + ((i + threadIdx.x) & ((1u << 20) - 1)));
    if (v == 12345.0f)
        out[w] = v;
}

/* Arrival counter bar[0], release flag bar[32]: the fused step's grid barrier. */
static __device__ __forceinline__ void grid_sync(unsigned *bar, unsigned k)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned old = atomicAdd(bar, 1u);
        if (old + 1 == k * gridDim.x) {
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + 32), "r"(k)
                         : "memory");
        } else {
            unsigned v;
            do
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];"
                             : "=r"(v)
                             : "l"(bar + 32)
                             : "memory");
            while ((int)(v - k) < 0);
        }
    }
    __syncthreads();
}

static __global__ void k_barriers(unsigned *bar, int n)
{
    for (int k = 1; k <= n; k++)
        grid_sync(bar, (unsigned)k);
}

/* Reads the pieces [off[p], off[p] + len) of base, 8 loads of 16 bytes in flight a thread;
 * span[0] = min start, span[1] = max end (ns). */
static __global__ void k_read(const uint8_t *base, const uint64_t *off, int pieces, uint64_t len,
                              unsigned long long *span, float *sink)
{
    const uint64_t t0 = now_ns();
    const uint64_t per = len / 16, total = per * (uint64_t)pieces;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    float4 acc = make_float4(0, 0, 0, 0);
    for (uint64_t u = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += 8 * stride) {
        float4 v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const uint64_t uj = u + j * stride;
            if (uj < total) {
                const uint64_t p = uj / per, q = uj % per;
                v[j] = __ldcs((const float4 *)(base + off[p]) + q);
            } else {
                v[j] = make_float4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            acc.x += v[j].x;
            acc.y += v[j].y;
            acc.z += v[j].z;
            acc.w += v[j].w;
        }
    }
    if (acc.x + acc.y + acc.z + acc.w == 1.2345e30f)
        *sink = acc.x;
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicMin(span, (unsigned long long)t0);
        atomicMax(span + 1, (unsigned long long)now_ns());
    }
}

static __global__ void k_flush(float4 *buf, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        buf[i] = make_float4((float)i, 0, 0, 0);
}

static int cmp_f(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

static float median(float *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_f);
    return v[n / 2];
}

int main(int argc, char **argv)
{
    const int reps = argc > 1 ? atoi(argv[1]) : 200;
    if (reps < 3) {
        fprintf(stderr, BENCH_NAME ": repetitions must be at least 3\n");
        return 2;
    }
    cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    printf("device: %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    float *times = (float *)malloc(sizeof(float) * (size_t)reps);

    /* ---- graph nodes */
    int *sink;
    float *fsink, *rbuf, *rout;
    uint32_t *ridx;
    CU(cudaMalloc(&sink, 64));
    CU(cudaMalloc(&fsink, 64));
    CU(cudaMalloc(&rbuf, sizeof(float) << 20));
    CU(cudaMalloc(&rout, sizeof(float) << 20));
    CU(cudaMalloc(&ridx, sizeof(uint32_t) * 1024));
    CU(cudaMemset(rbuf, 0, sizeof(float) << 20));
    {
        uint32_t h[1024];
        for (int i = 0; i < 1024; i++)
            h[i] = (uint32_t)(bench_rng_next() >> 40) * 32u;
        CU(cudaMemcpy(ridx, h, sizeof h, cudaMemcpyHostToDevice));
    }
    const char *node_names[3] = {"empty kernel, 1 warp", "empty kernel, 2 blocks/SM x 128",
                                 "one round trip a warp, 2 blocks/SM x 128"};
    for (int kind = 0; kind < 3; kind++) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < NODES; i++) {
            if (kind == 0)
                k_empty<<<1, 32, 0, st>>>(sink);
            else if (kind == 1)
                k_empty<<<2 * sms, 128, 0, st>>>(sink);
            else
                k_roundtrip<<<2 * sms, 128, 0, st>>>(ridx, rbuf, rout);
        }
        CU(cudaGetLastError());
        CU(cudaStreamEndCapture(st, &g));
        CU(cudaGraphInstantiate(&ge, g, 0));
        for (int w = 0; w < 3; w++)
            CU(cudaGraphLaunch(ge, st));
        for (int r = 0; r < reps; r++) {
            CU(cudaEventRecord(e0, st));
            CU(cudaGraphLaunch(ge, st));
            CU(cudaEventRecord(e1, st));
            times[r] = elapsed_ms(e0, e1) * 1000.0f / NODES;
        }
        printf("graph of %d nodes, %-42s %6.2f us a node\n", NODES, node_names[kind],
               median(times, reps));
        CU(cudaGraphExecDestroy(ge));
        CU(cudaGraphDestroy(g));
    }

    /* ---- grid barriers */
    unsigned *bar;
    CU(cudaMalloc(&bar, 4096));
    for (int bps = 1; bps <= 2; bps++) {
        int fit = 0;
        CU(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, k_barriers, 256, 0));
        if (fit < bps)
            continue;
        int n = NODES;
        void *args[] = {&bar, &n};
        for (int r = -2; r < reps; r++) {
            CU(cudaMemsetAsync(bar, 0, 4096, st));
            CU(cudaEventRecord(e0, st));
            CU(cudaLaunchCooperativeKernel((void *)k_barriers, dim3(bps * sms), dim3(256), args, 0,
                                           st));
            CU(cudaEventRecord(e1, st));
            const float us = elapsed_ms(e0, e1) * 1000.0f / NODES;
            if (r >= 0)
                times[r] = us;
        }
        printf("grid barrier, %d blocks (%d an SM) x 256, %d in one kernel: %6.2f us a barrier\n",
               bps * sms, bps, NODES, median(times, reps));
    }

    /* ---- reads */
    const size_t flush_bytes = (size_t)256 << 20;
    float4 *flush;
    CU(cudaMalloc(&flush, flush_bytes));
    size_t free_b = 0, total_b = 0;
    CU(cudaMemGetInfo(&free_b, &total_b));
    size_t arena = (size_t)16 << 30;
    while (arena > ((size_t)1 << 30) && arena + ((size_t)2 << 30) > free_b)
        arena >>= 1;
    uint8_t *big;
    CU(cudaMalloc(&big, arena));
    CU(cudaMemset(big, 0, arena));
    uint64_t *doff;
    unsigned long long *dspan;
    CU(cudaMalloc(&doff, sizeof(uint64_t) * 64));
    CU(cudaMalloc(&dspan, sizeof(unsigned long long) * 2));
    float *ktimes = (float *)malloc(sizeof(float) * (size_t)reps);

    struct readcase {
        char name[64];
        int pieces;
        uint64_t len;
        uint64_t off[64];
    } cases[16];
    int nc = 0;
    const uint64_t mib = 1 << 20;
    const uint64_t sizes[] = {1, 2, 4, 8, 14, 32, 128, 1024};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        struct readcase *c = &cases[nc++];
        snprintf(c->name, sizeof c->name, "contiguous %llu MiB", (unsigned long long)sizes[i]);
        c->pieces = 1;
        c->len = sizes[i] * mib;
        c->off[0] = 0;
    }
    /* A layer's chosen experts: 8 experts × (gate, up), each 768 rows of 2048 Q4_K weights
     * (884,736 bytes), experts 2.65 MB apart in a layer's arena, the layer anywhere in 16 GiB. */
    const uint64_t piece = 884736, expert_bytes = 3 * piece + 2048 * 432;
    {
        struct readcase *c = &cases[nc++];
        snprintf(c->name, sizeof c->name, "16 x 864 KiB side by side");
        c->pieces = 16;
        c->len = piece;
        for (int p = 0; p < 16; p++)
            c->off[p] = (uint64_t)p * piece;
        c = &cases[nc++];
        snprintf(c->name, sizeof c->name, "16 x 864 KiB, 8 experts of one layer");
        c->pieces = 16;
        c->len = piece;
        const uint64_t layer0 = (arena / 2 / (1 << 21)) * (1 << 21);
        for (int e = 0; e < 8; e++) {
            const uint64_t ex = (uint64_t)(e * 16 + (int)(bench_rng_next() % 16));
            c->off[2 * e] = layer0 + ex * expert_bytes;
            c->off[2 * e + 1] = layer0 + ex * expert_bytes + piece;
        }
        c = &cases[nc++];
        snprintf(c->name, sizeof c->name, "16 x 864 KiB anywhere in %llu GiB",
                 (unsigned long long)(arena >> 30));
        c->pieces = 16;
        c->len = piece;
        for (int p = 0; p < 16; p++)
            c->off[p] = (bench_rng_next() % ((arena - piece) >> 8)) << 8;
    }
    const int grids[2] = {4 * sms, 8 * sms};
    for (int ci = 0; ci < nc; ci++) {
        struct readcase *c = &cases[ci];
        CU(cudaMemcpy(doff, c->off, sizeof(uint64_t) * (size_t)c->pieces,
                      cudaMemcpyHostToDevice));
        const double bytes = (double)c->len * c->pieces;
        for (int gi = 0; gi < 2; gi++) {
            for (int r = -2; r < reps; r++) {
                unsigned long long h[2] = {~0ull, 0};
                CU(cudaMemcpyAsync(dspan, h, sizeof h, cudaMemcpyHostToDevice, st));
                k_flush<<<4 * sms, 256, 0, st>>>(flush, flush_bytes / 16);
                CU(cudaEventRecord(e0, st));
                k_read<<<grids[gi], 256, 0, st>>>(big, doff, c->pieces, c->len, dspan, fsink);
                CU(cudaEventRecord(e1, st));
                const float us = elapsed_ms(e0, e1) * 1000.0f;
                CU(cudaMemcpy(h, dspan, sizeof h, cudaMemcpyDeviceToHost));
                if (r >= 0) {
                    times[r] = us;
                    ktimes[r] = (float)(h[1] - h[0]) / 1000.0f;
                }
            }
            const float ev = median(times, reps), kin = median(ktimes, reps);
            printf("read %-40s grid %4d x 256: %8.2f us in kernel (%6.0f GB/s), %8.2f us by "
                   "events (%6.0f GB/s)\n",
                   c->name, grids[gi], kin, bytes / kin / 1e3, ev, bytes / ev / 1e3);
        }
    }
    CU(cudaDeviceSynchronize());
    printf("done\n");
    return 0;
}

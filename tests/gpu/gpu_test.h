/* Shared by the GPU tests: CUDA call checks, the skip without a GPU, random quantized weights. */
#ifndef MOE_TESTS_GPU_TEST_H
#define MOE_TESTS_GPU_TEST_H

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>

#include <cuda_runtime_api.h>

#include "store/ggml_type.h"
#include "store/quant.h"
#include "tests/harness.h"

#define CU(call)                                                                            \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        CHECK_MSG(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));              \
    } while (0)

/* GPU tests share the device (they may run in parallel, -j); the few that measure its memory as
 * a whole must run alone. A lock file held for the test's life (each test is a process of its
 * own): shared by every GPU test, exclusive for those. */
static inline void gpu_lock(int how)
{
    const int fd = open("/tmp/moe-gpu-tests.lock", O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd >= 0)
        while (flock(fd, how) != 0 && errno == EINTR)
            ;
}

static inline void gpu_select(void)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0)
        moe_test_skip("no CUDA device (%s)", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    CU(cudaSetDevice(0));
}

/* Skips the test without a usable CUDA device; else selects device 0. */
static inline void need_gpu(void)
{
    gpu_select();
    gpu_lock(LOCK_SH);
}

/* need_gpu for a test that measures the device's memory in use: no other GPU test runs with it. */
static inline void need_gpu_alone(void)
{
    gpu_select();
    gpu_lock(LOCK_EX);
}

/* How many of the n floats of a and b differ in their bits. */
static inline size_t floats_differing(const float *a, const float *b, size_t n)
{
    size_t d = 0;
    for (size_t i = 0; i < n; i++)
        d += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return d;
}

/* Uniform in [-1, 1). */
static inline float rng_f(void)
{
    return (float)moe_test_rng_u32() / 2147483648.0f - 1.0f;
}

/* Random weights of roughly real layers' magnitude with a mix of scales across blocks and rows,
 * quantized row by row. */
static inline uint8_t *make_weights(uint32_t type, int64_t rows, int64_t n)
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

#endif

/* CUDA device discovery (see probe.h). */
#include "worker/cuda/probe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

extern "C" {
#include "store/err.h"
}
#include "worker/cuda/cuda_check.cuh"

#define PROBE_THREADS 32
#define PROBE_SALT 0x9e3779b9u

/* Every thread writes a value only it computes, so matching output proves the kernel ran. */
static __host__ __device__ unsigned probe_value(unsigned i)
{
    return (i * 2654435761u) ^ PROBE_SALT;
}

static __global__ void probe_kernel(unsigned *out)
{
    out[threadIdx.x] = probe_value(threadIdx.x);
}

/* Runs probe_kernel on the current device into d_out ([PROBE_THREADS]) and checks the result. */
static int run_probe_kernel(unsigned *d_out, char *why, size_t len)
{
    unsigned h[PROBE_THREADS];
    probe_kernel<<<1, PROBE_THREADS>>>(d_out);
    /* Peek, not get: the launch error stays for the caller to describe. */
    MOE_CUDA_TRY(cudaPeekAtLastError());
    MOE_CUDA_TRY(cudaMemcpy(h, d_out, sizeof h, cudaMemcpyDeviceToHost));
    for (unsigned i = 0; i < PROBE_THREADS; i++)
        if (h[i] != probe_value(i)) {
            snprintf(why, len, "the probe kernel ran but thread %u wrote %08x, not %08x", i, h[i],
                     probe_value(i));
            return MOE_EINTERNAL;
        }
    return 0;
}

static int probe(int index, char *info, size_t info_len, char *why, size_t why_len)
{
    cudaDeviceProp p;
    MOE_CUDA_TRY(cudaGetDeviceProperties(&p, index));
    snprintf(info, info_len, "%s, %llu MiB, compute capability %d.%d", p.name,
             (unsigned long long)(p.totalGlobalMem >> 20), p.major, p.minor);
    MOE_CUDA_TRY(cudaSetDevice(index));
    unsigned *d = NULL;
    MOE_CUDA_TRY(cudaMalloc((void **)&d, PROBE_THREADS * sizeof *d));
    int rc = run_probe_kernel(d, why, why_len);
    cudaError_t e = cudaFree(d);
    if (e != cudaSuccess) {
        moe_cuda_report(e, "cudaFree(d)", __FILE__, __LINE__);
        if (rc == 0)
            rc = MOE_EBACKEND;
    }
    return rc;
}

extern "C" int moe_cuda_device_count(char *why, size_t len)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (why && len)
        why[0] = 0;
    if (e == cudaSuccess)
        return n;
    /* No driver or no device is an answer, not a failure: say why without the error report. */
    if (e != cudaErrorNoDevice && e != cudaErrorInsufficientDriver)
        moe_cuda_report(e, "cudaGetDeviceCount(&n)", __FILE__, __LINE__);
    if (why && len)
        snprintf(why, len, "%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
    (void)cudaGetLastError(); /* reset the runtime's last error: this one is handled */
    return 0;
}

/* The compute capabilities this build has GPU code for ("9.0", "8.0, 9.0"), from nvcc's
 * __CUDA_ARCH_LIST__ (the -gencode targets of CUDA_ARCH in the Makefile). */
#define PROBE_STR2(x) #x
#define PROBE_STR(x) PROBE_STR2(x)
static void built_archs(char *out, size_t len)
{
#ifdef __CUDA_ARCH_LIST__
    const char *list = PROBE_STR(__CUDA_ARCH_LIST__);
#else
    const char *list = "";
#endif
    size_t k = 0;
    out[0] = 0;
    for (const char *p = list; *p && k + 8 < len;) {
        char *end;
        const long a = strtol(p, &end, 10);
        if (end == p)
            break;
        k += (size_t)snprintf(out + k, len - k, "%s%ld.%ld", k ? ", " : "", a / 100, a % 100 / 10);
        p = *end == ',' ? end + 1 : end;
    }
}

extern "C" int moe_cuda_probe(int index, char *desc, size_t len)
{
    char info[384] = "", why[384] = "";
    int rc = probe(index, info, sizeof info, why, sizeof why);
    if (rc == MOE_EBACKEND && !why[0]) {
        /* MOE_CUDA_TRY printed the failing call; the runtime still holds its error. */
        cudaError_t e = cudaGetLastError();
        snprintf(why, sizeof why, "%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorUnsupportedPtxVersion) {
            char archs[64];
            built_archs(archs, sizeof archs);
            const size_t k = strlen(why);
            snprintf(why + k, sizeof why - k,
                     "; this build has GPU code for compute capability %s (CUDA_ARCH in the "
                     "Makefile, docs/install.md)",
                     archs[0] ? archs : "none");
        }
    }
    if (rc == 0)
        snprintf(desc, len, "%s", info);
    else if (info[0])
        snprintf(desc, len, "%s: %s", info, why);
    else
        snprintf(desc, len, "%s", why);
    return rc == 0;
}

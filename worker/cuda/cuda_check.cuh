/* Checking CUDA runtime calls.
 *
 * Every CUDA call in worker/cuda/ goes through MOE_CUDA_TRY, which on failure prints the device,
 * the call and file:line to stderr and returns MOE_EBACKEND from the calling function. A CUDA
 * error usually leaves the context unusable, so callers treat MOE_EBACKEND as the end of the
 * worker (the daemon restarts it), but nothing here aborts: that decision is the caller's. */
#ifndef MOE_CUDA_CHECK_CUH
#define MOE_CUDA_CHECK_CUH

#include <cuda_runtime.h>
#include <stdio.h>

extern "C" {
#include "store/err.h"
}

static inline void moe_cuda_report(cudaError_t e, const char *call, const char *file, int line)
{
    int dev = -1;
    /* cudaGetDevice does not touch the sticky error state, so it is safe to ask after a failure. */
    if (cudaGetDevice(&dev) != cudaSuccess)
        dev = -1;
    fprintf(stderr, "moed: CUDA error on device %d: %s: %s (%s) at %s:%d\n", dev, call,
            cudaGetErrorString(e), cudaGetErrorName(e), file, line);
}

#define MOE_CUDA_TRY(call)                                                                 \
    do {                                                                                   \
        cudaError_t moe_e_ = (call);                                                       \
        if (moe_e_ != cudaSuccess) {                                                       \
            moe_cuda_report(moe_e_, #call, __FILE__, __LINE__);                            \
            return MOE_EBACKEND;                                                           \
        }                                                                                  \
    } while (0)

#endif

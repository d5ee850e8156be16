/* What the kernels' __host__ __device__ code shares: HD (a function a host build runs too, so
 * that the host tests can single-step it) and the float bit casts, by intrinsic on the device and
 * by memcpy on the host. */
#ifndef MOE_CUDA_HD_CUH
#define MOE_CUDA_HD_CUH

#include <stdint.h>
#include <string.h>

#include <cuda_runtime.h>

#define HD __host__ __device__ __forceinline__

static HD uint32_t hd_f2u(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

static HD float hd_u2f(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

#endif

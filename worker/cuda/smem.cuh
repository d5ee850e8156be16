/* Dynamic shared memory past the default 48 KiB: what the device allows a block, and the
 * per-kernel opt-in that launches beyond 48 KiB need first. Host code; thread-safe. */
#ifndef MOE_CUDA_SMEM_CUH
#define MOE_CUDA_SMEM_CUH

#include <stddef.h>

#include <atomic>

#include <cuda_runtime.h>

/* The current device's shared memory a block may opt in to (227 KiB on Hopper, 99 KiB on
 * 8.6/8.9), read once per device (0..63); 0 when it cannot be read. */
static inline int moe_smem_optin()
{
    static std::atomic<int> cached[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();
        return 0;
    }
    int v = cached[dev].load(std::memory_order_relaxed);
    if (v <= 0) {
        if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess) {
            (void)cudaGetLastError();
            return 0;
        }
        cached[dev].store(v, std::memory_order_relaxed);
    }
    return v;
}

/* Lets KERNEL take smem bytes of dynamic shared memory on the current device: beyond 48 KiB the
 * attribute is raised first, once per kernel, device (0..63) and size (only ever upwards), so
 * that launches captured into a graph after a first one make no attribute calls. */
template <auto KERNEL> static cudaError_t moe_raise_smem(size_t smem)
{
    static std::atomic<size_t> raised[64];
    if (smem <= 48 * 1024)
        return cudaSuccess;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess)
        return e;
    const bool known = dev >= 0 && dev < 64;
    if (known && raised[dev].load(std::memory_order_relaxed) >= smem)
        return cudaSuccess;
    e = cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess && known)
        raised[dev].store(smem, std::memory_order_relaxed);
    return e;
}

#endif

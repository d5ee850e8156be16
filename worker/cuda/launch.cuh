/* Kernel launches with programmatic dependent launch (Hopper): every kernel of a step is launched
 * with the programmatic-stream-serialization attribute, waits in pdl_wait() for its predecessor
 * to complete before it touches activations, then calls pdl_trigger() (its successor may be
 * scheduled now: so only one kernel waits ahead, instead of a chain of them holding SM slots).
 * What a kernel may do before the wait is read weights, which no kernel writes; the mat-vec
 * kernels prefetch their rows into L2 there. Under stream capture the attribute becomes a
 * programmatic edge of the graph, so a step's kernels overlap their launch and prologue with the
 * tail of the kernel before. One-token steps take it (the backend sets moe_pdl_step_on per
 * step): their dense mat-vecs load all their weights before the wait, so those loads overlap the
 * kernel before (docs/cuda.md); MOE_CUDA_PDL=0 or 1 forces it off or on for every step. */
#ifndef MOE_CUDA_LAUNCH_CUH
#define MOE_CUDA_LAUNCH_CUH

#include <stdlib.h>

#include <cuda_runtime.h>

static __device__ __forceinline__ void pdl_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

static __device__ __forceinline__ void pdl_trigger()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

static __device__ __forceinline__ void prefetch_l2(const void *p)
{
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

static __device__ __forceinline__ void prefetch_l1(const void *p)
{
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

/* The 128-byte lines of [p, p + bytes) prefetched by threads i, i + nt, ... of a group of nt:
 * into L1 (how 1) or L2 (how 2). */
static __device__ __forceinline__ void prefetch_span(const void *p, size_t bytes, int i, int nt,
                                                     int how)
{
    for (size_t off = (size_t)i * 128; off < bytes; off += (size_t)nt * 128) {
        if (how == 1)
            prefetch_l1((const char *)p + off);
        else
            prefetch_l2((const char *)p + off);
    }
}

/* *p += v at GPU scope as a release and an acquire (atom.acq_rel.gpu); returns the old value.
 * After a block barrier, one thread's count publishes the whole block's earlier stores (the
 * release is cumulative over what the barrier ordered before it), and the thread that reads the
 * final count sees every counted block's stores, as does its block after the next barrier: the
 * ordering a __threadfence() by every thread gives, with one acquire-release operation instead
 * of a sequentially consistent fence per thread. */
static __device__ __forceinline__ unsigned atomic_add_acq_rel_gpu(unsigned *p, unsigned v)
{
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
                 : "=r"(old)
                 : "l"(p), "r"(v)
                 : "memory");
    return old;
}

/* Set by the backend before a step's launches (one-token steps: on, see moe_pdl_enabled). */
extern int moe_pdl_step_on;

/* MOE_CUDA_NORM_EARLY (read by the backend at init and set here at each step's begin, so that a
 * captured launch keeps its engine's setting): 1 or 2 fetch an RMSNorm's weight before the wait
 * for the previous kernel, since no kernel writes it (the one-token NORM mat-vecs and the output
 * RMSNorm prefetch it into L1 (1) or L2 (2); the float32 router kernel loads it into registers
 * with either); 0 (the default) reads it after the wait. The same floats either way. */
extern int moe_norm_early_step;

/* Whether a launch made now takes the attribute: MOE_CUDA_PDL=1 or 0 forces it either way;
 * otherwise the backend's choice for the step. */
static inline bool moe_pdl_enabled()
{
    static int env = -2;
    if (env == -2) {
        const char *v = getenv("MOE_CUDA_PDL");
        env = v && *v ? v[0] != '0' : -1;
    }
    return env >= 0 ? env != 0 : moe_pdl_step_on != 0;
}

/* MOE_CUDA_CARVEOUT=N (0..100): every kernel launched here prefers N% of the SM's unified L1 and
 * shared memory as shared memory (cudaFuncAttributePreferredSharedMemoryCarveout, set once per
 * kernel at its first launch), so that consecutive kernels ask for the same split; unset (-1),
 * the driver picks each kernel's split. ops.cu holds both. */
int moe_carveout_pct(void);
cudaError_t moe_carveout_apply(const void *fn);

/* A launch with one attribute, or none (at NULL). */
template <typename... KArgs, typename... Args>
static inline cudaError_t moe_launch_with(void (*kernel)(KArgs...), dim3 grid, dim3 block,
                                          size_t smem, cudaStream_t s, cudaLaunchAttribute *at,
                                          Args... args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = at;
    cfg.numAttrs = at ? 1 : 0;
    if (moe_carveout_pct() >= 0) {
        const cudaError_t e = moe_carveout_apply((const void *)kernel);
        if (e != cudaSuccess)
            return e;
    }
    return cudaLaunchKernelEx(&cfg, kernel, ((KArgs)args)...);
}

template <typename... KArgs, typename... Args>
static inline cudaError_t moe_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                     cudaStream_t s, Args... args)
{
    cudaLaunchAttribute at;
    at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at.val.programmaticStreamSerializationAllowed = 1;
    return moe_launch_with(kernel, grid, block, smem, s, moe_pdl_enabled() ? &at : NULL, args...);
}

#endif

/* Shared by the CUDA micro-benchmarks: the error check and the generator of their inputs.
 * Define BENCH_NAME (the program's name, for messages) before including. */
#ifndef MOE_BENCH_BENCH_CUDA_H
#define MOE_BENCH_BENCH_CUDA_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#define CU(call)                                                                            \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess) {                                                            \
            fprintf(stderr, BENCH_NAME ": %s: %s at %s:%d\n", #call, cudaGetErrorString(e_), \
                    __FILE__, __LINE__);                                                    \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

/* xorshift64*, a fixed seed: every run measures the same inputs. */
static uint64_t bench_rng_state = 0x9e3779b97f4a7c15ull;

static inline uint64_t bench_rng_next(void)
{
    bench_rng_state ^= bench_rng_state >> 12;
    bench_rng_state ^= bench_rng_state << 25;
    bench_rng_state ^= bench_rng_state >> 27;
    return bench_rng_state * 2685821657736338717ull;
}

/* Uniform in [-1, 1) on a grid of 2^-23. */
static inline float bench_rng_f(void)
{
    return (float)(bench_rng_next() >> 40) / 8388608.0f - 1.0f;
}

/* Milliseconds between two recorded events (waits for the second). */
static inline float elapsed_ms(cudaEvent_t a, cudaEvent_t b)
{
    float ms;
    CU(cudaEventSynchronize(b));
    CU(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

#endif

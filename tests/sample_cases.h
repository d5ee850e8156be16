/* The sampler tests' logits and parameter sets, shared by the GPU test
 * (tests/gpu/test_cuda_sample.c) and the host test of the same algorithm
 * (tests/test_sample_host.cu). Include after tests/harness.h (moe_test_rng_u32). */
#ifndef MOE_TESTS_SAMPLE_CASES_H
#define MOE_TESTS_SAMPLE_CASES_H

#include <math.h>
#include <stdint.h>

static float unit_f(void)
{
    return ((float)(moe_test_rng_u32() >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

static float normal_f(void)
{
    float u = unit_f(), v = unit_f();
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

enum gen {
    G_GAUSS1, G_GAUSS3, G_GAUSS8, G_QUANT, G_PEAK, G_FLAT, G_LLM, G_SPARSE_INF, G_NAN,
    G_ALLINF, G_EQUAL, G_ZEROS, G_PINF, N_GEN
};
static const char *gen_name[N_GEN] = {"gauss1", "gauss3", "gauss8", "quant", "peak", "flat", "llm",
                                      "sparse-inf", "nan", "all-inf", "equal", "zeros", "+inf"};

static void make_logits(int g, float *l, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        float v = normal_f();
        switch (g) {
        case G_GAUSS3: v *= 3.0f; break;
        case G_GAUSS8: v *= 8.0f; break;
        case G_QUANT: v = roundf(v * 3.0f) * 0.5f; break;
        case G_PEAK: v *= 2.0f; break;
        case G_FLAT: v *= 0.05f; break;
        case G_LLM: v = 4.0f * v - 2.0f - 6.0f * logf(unit_f()); break;
        case G_SPARSE_INF: v = unit_f() < 0.5f ? -INFINITY : 2.0f * v; break;
        case G_NAN: v = unit_f() < 0.05f ? NAN : unit_f() < 0.05f ? -INFINITY : 2.0f * v; break;
        case G_ALLINF: v = unit_f() < 0.5f ? -INFINITY : NAN; break;
        case G_EQUAL: v = 1.5f; break;
        case G_ZEROS: v = unit_f() < 0.4f ? -0.0f : unit_f() < 0.5f ? 0.0f : -unit_f(); break;
        case G_PINF: v *= 2.0f; break;
        default: break;
        }
        l[i] = v;
    }
    if (g == G_PEAK && n > 3) {
        l[moe_test_rng_u32() % n] += 15.0f;
        l[moe_test_rng_u32() % n] += 12.0f;
    }
    if (g == G_PINF && n > 3) {
        l[moe_test_rng_u32() % n] = INFINITY;
        l[moe_test_rng_u32() % n] = INFINITY;
    }
}

struct combo {
    const char *name;
    float t;
    int32_t k;
    float top_p, min_p, rep, pres, freq;
    int32_t last_n;
};

static const struct combo combos[] = {
    {"greedy", 0.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"greedy+pen", 0.0f, 40, 0.9f, 0.05f, 1.3f, 0.4f, 0.2f, 64},
    {"defaults", 0.8f, 40, 0.95f, 0.05f, 1.0f, 0.0f, 0.0f, 64},
    {"temperature", 1.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"hot", 1.7f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"min-p", 0.7f, 0, 1.0f, 0.1f, 1.0f, 0.0f, 0.0f, 64},
    {"top-k 1", 1.0f, 1, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"top-k 40", 1.0f, 40, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"top-k 300 p", 0.9f, 300, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"top-k 10000 p", 1.0f, 10000, 0.7f, 0.02f, 1.0f, 0.0f, 0.0f, 64},
    {"top-p 0.95", 1.0f, 0, 0.95f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"top-p 0.5", 0.6f, 0, 0.5f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"top-p 0.9999", 1.0f, 0, 0.9999f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"top-p min-p", 1.2f, 0, 0.9f, 0.05f, 1.0f, 0.0f, 0.0f, 64},
    {"penalties", 0.9f, 40, 0.95f, 0.0f, 1.5f, 0.5f, 0.3f, 32},
    {"penalties all", 1.0f, 0, 0.9f, 0.0f, 1.2f, 0.5f, 0.3f, -1},
};
#define N_COMBO (sizeof combos / sizeof combos[0])

#endif

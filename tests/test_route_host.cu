/* The CUDA routing's top-k (worker/cuda/ops_dev.cuh, route_warp_reg) on the host: a warp's 32
 * lanes build their keys with the kernel's own route_key, sort them with route_sort_keys, and
 * each round's two warp reductions are emulated by loops over the lanes before route_head_index
 * and route_pop, as the kernel does them. The choices, in order, must be the CPU's
 * (moe_topk_argmax) on rows made to break a wrong order: ties, NaNs among numbers, rows of NaNs
 * only, zeros, fewer experts than lanes, more than 128 (eight keys a lane).
 * The GPU test (tests/gpu/test_cuda_backend.c, cuda_route_ties_and_nans_match_cpu) checks the
 * kernel itself against the CPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "worker/cuda/ops_dev.cuh"

extern "C" {
#include "tests/harness.h"
#include "worker/cpu/kernels.h"
}

/* route_warp_reg's top-k of the probabilities p[0..ne) (ne <= 32·R), emulated. */
template <int R> static void merge_topk(const float *p, int ne, int k, int32_t *out)
{
    unsigned long long key[32][R];
    for (int lane = 0; lane < 32; lane++) {
        for (int i = 0; i < R; i++) {
            const int idx = lane + 32 * i;
            key[lane][i] = route_key(idx < ne ? p[idx] : -1.0f, idx);
        }
        route_sort_keys<R>(key[lane]);
    }
    for (int j = 0; j < k; j++) {
        unsigned mk = 0, lm = 0;
        for (int lane = 0; lane < 32; lane++)
            mk = (unsigned)(key[lane][0] >> 32) > mk ? (unsigned)(key[lane][0] >> 32) : mk;
        for (int lane = 0; lane < 32; lane++) {
            const unsigned hk = (unsigned)(key[lane][0] >> 32), lo = (unsigned)key[lane][0];
            const unsigned c = hk == mk ? lo : 0u;
            lm = c > lm ? c : lm;
        }
        const int bi = route_head_index(mk, lm);
        out[j] = bi;
        if (bi >= 0)
            route_pop<R>(key[bi & 31]);
    }
}

static float prob(int pattern, int i, int ne)
{
    const uint32_t r = moe_test_rng_u32();
    switch (pattern) {
    case 0: return (float)(r % 1000000) / 1e6f;          /* mostly distinct */
    case 1: return (float)(r % 4) * 0.125f;              /* many ties, zeros among them */
    case 2: return r % 10 == 0 ? NAN : (float)(r % 5) * 0.1f; /* a few NaNs */
    case 3: return r % 2 ? NAN : (float)(r % 3) * 0.25f; /* half NaN */
    case 4: return NAN;                                  /* all NaN */
    case 5: return i < ne - 3 ? NAN : 0.5f;              /* numbers only at the end */
    case 6: return 0.0f;                                 /* all zero */
    case 7: return i == 0 ? NAN : 1.0f / (float)(1 + (int)(r % 7)); /* NaN first, ties */
    default: return (r & 1) ? 1.0f : 1e-30f;             /* two values, one tiny */
    }
}

TEST(route_host_merge_equals_the_cpu_scan)
{
    static const int nes[] = {1, 2, 7, 31, 32, 33, 64, 100, 128, 129, 160, 255, 256};
    float p[256];
    uint8_t taken[256];
    int32_t want[64], got[64];
    moe_test_rng_seed(17);
    long rows = 0;
    for (size_t a = 0; a < sizeof nes / sizeof nes[0]; a++) {
        const int ne = nes[a];
        const int ks[] = {1, 2, 8, ne < 32 ? ne : 32, ne < 64 ? ne : 64};
        for (int pattern = 0; pattern < 9; pattern++)
            for (int rep = 0; rep < 20; rep++)
                for (size_t b = 0; b < sizeof ks / sizeof ks[0]; b++) {
                    const int k = ks[b] < ne ? ks[b] : ne;
                    for (int i = 0; i < ne; i++)
                        p[i] = prob(pattern, i, ne);
                    memset(taken, 0, sizeof taken);
                    moe_topk_argmax(p, ne, k, taken, want);
                    if (ne <= 128)
                        merge_topk<4>(p, ne, k, got);
                    else
                        merge_topk<8>(p, ne, k, got);
                    for (int j = 0; j < k; j++)
                        CHECK_MSG(got[j] == want[j],
                                  "%d experts, top-%d, pattern %d: choice %d is %d, the CPU's %d",
                                  ne, k, pattern, j, got[j], want[j]);
                    rows++;
                }
    }
    CHECK(rows > 1000);
}

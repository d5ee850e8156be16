/* The CUDA element decoder (worker/cuda/dequant.cuh: deq_elem, which the embedding kernel runs)
 * on the host: it is __host__ __device__, so CI, which has nvcc but no GPU, checks it. Every
 * element of rows of every type moed computes with (moe_type_info's compute: the embedding takes
 * them all, so a type added there without a decoder here fails), made from random floats of several
 * magnitudes, against the store's decoder (moe_dequantize) bit for bit; the quantised bytes are
 * also randomised outright (scales, mins and high bits the quantiser would not write). */
#include <stdlib.h>
#include <string.h>

#include "worker/cuda/dequant.cuh"

extern "C" {
#include "store/ggml_type.h"
#include "store/quant.h"
#include "tests/harness.h"
}

static float rnd(void)
{
    return (float)moe_test_rng_u32() / 4294967296.0f - 0.5f;
}

TEST(dequant_host_elements_equal_the_store_decoder)
{
    const int64_t n = 768; /* three 256-blocks, 24 32-blocks */
    moe_test_rng_seed(29);
    float *f = (float *)malloc(sizeof(float) * n), *ref = (float *)malloc(sizeof(float) * n);
    CHECK(f && ref);
    long checked = 0;
    int ntypes = 0;
    for (uint32_t type = 0; type < MOE_TYPE_COUNT; type++) {
        const struct moe_type_info *ti = moe_type_get(type);
        if (!ti || !ti->compute)
            continue;
        ntypes++;
        const size_t rb = moe_row_bytes(type, n);
        uint8_t *row = (uint8_t *)malloc(rb);
        CHECK(row);
        for (int rep = 0; rep < 40; rep++) {
            const float mag = rep % 4 == 0 ? 1e-3f : rep % 4 == 1 ? 1.0f : rep % 4 == 2 ? 30.0f : 4e3f;
            for (int64_t i = 0; i < n; i++)
                f[i] = rnd() * mag * (1.0f + (float)((i / 32) % 5));
            CHECK_EQ(moe_quantize(type, f, row, n), 0);
            if (rep >= 30 && ti->blck > 1)
                for (size_t b = 0; b < rb; b++) /* any bytes: NaN scales too (both NaN counts as equal) */
                    row[b] = (uint8_t)moe_test_rng_u32();
            CHECK_EQ(moe_dequantize(type, row, ref, n), 0);
            for (int64_t i = 0; i < n; i++) {
                const float got = deq_elem(type, row, i);
                if (ref[i] != ref[i] && got != got)
                    continue; /* both NaN (random half scales) */
                CHECK_MSG(memcmp(&got, &ref[i], sizeof got) == 0,
                          "type %u rep %d element %lld: %.9g, the store's %.9g", type, rep,
                          (long long)i, got, ref[i]);
                checked++;
            }
        }
        free(row);
    }
    CHECK(ntypes >= 11);
    CHECK(checked > 300000);
    free(f);
    free(ref);
}

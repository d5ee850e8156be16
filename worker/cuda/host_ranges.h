/* Host memory registered with CUDA in chunks (worker/cuda/backend.cu): the chunks the weights'
 * page ranges are cut into. Plain C, shared with the host test that checks it
 * (tests/test_offload_resolve.c).
 *
 * A tensor must lie in one registration: the device addresses of two registrations are not
 * contiguous, and a copy whose source crosses from one to the next fails. So chunks end only
 * where no tensor goes on, and tensors that share a page share a chunk. */
#ifndef MOE_CUDA_HOST_RANGES_H
#define MOE_CUDA_HOST_RANGES_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

struct reg_range {
    uintptr_t a, b;
};

static inline int moe_reg_range_cmp(const void *x, const void *y)
{
    const struct reg_range *p = (const struct reg_range *)x, *q = (const struct reg_range *)y;
    return p->a < q->a ? -1 : p->a > q->a;
}

/* Sorts r[0..n) (page-aligned ranges, one per tensor, which may overlap) and rewrites its head
 * with the chunks to register, returning their count. Overlapping ranges go into one chunk;
 * ranges less than `gap` bytes apart are joined (the holes of one mapping); a chunk grows past
 * its size limit (first_step for the first chunk, step after it) only by ranges that overlap
 * it. */
static inline size_t moe_reg_plan(struct reg_range *r, size_t n, uintptr_t first_step,
                                  uintptr_t step, uintptr_t gap)
{
    qsort(r, n, sizeof *r, moe_reg_range_cmp);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (k) {
            struct reg_range *c = &r[k - 1];
            const uintptr_t lim = k == 1 ? first_step : step;
            const int overlaps = r[i].a < c->b;
            const int joins = r[i].a <= c->b + gap && r[i].b - c->a <= lim;
            if (overlaps || joins) {
                if (r[i].b > c->b)
                    c->b = r[i].b;
                continue;
            }
        }
        r[k++] = r[i];
    }
    return k;
}

#endif

/* kernel-trace: the GPU's own start and end time of every kernel a program runs, graph nodes
 * included, through CUPTI's activity records, loaded into any CUDA program by the driver:
 *
 *   cc -O2 -shared -fPIC -o libkernel-trace.so tools/device/kernel-trace.c \
 *      -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcupti
 *   CUDA_INJECTION64_PATH=$PWD/libkernel-trace.so MOE_TRACE_OUT=trace.txt \
 *      build/bench/bench_engine MODEL --device cuda:0 --prompt 512 --gen 128 --batches "" --long 0
 *
 * At exit it groups the kernels by the launch they came from (a graph launch's nodes share its
 * correlation id), takes the launches of the most common large node count (a decode step's
 * graph), and writes: the mean step (first start to last end), the sum of kernel times and of
 * the gaps between them; per kernel name the count per step, mean time and mean gap before it,
 * its grid, registers and shared memory a block, and the SM's L1/shared memory split the driver
 * ran it with (by CUDA's documentation, a launch whose split differs from the last one's may be
 * preceded by a device-side synchronization); and per node position the mean start, time, gap
 * and split (MOE_TRACE_OUT, default stderr). Times are the GPU's timestamps (ns), so the gaps
 * are what the device spends between dependent kernels.
 * A development tool: nothing in moed links it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cupti.h>

struct rec {
    uint64_t start, end;
    uint32_t corr;
    int32_t grid, block;
    uint16_t regs;
    uint32_t smem, smem_cfg; /* the block's static + dynamic shared memory; the SM's split */
    const char *name;
};

static struct rec *recs;
static size_t n_recs, cap_recs;

/* Names interned: CUPTI's strings are copied once. */
static char **names;
static size_t n_names;

static const char *intern(const char *s)
{
    if (!s)
        s = "?";
    for (size_t i = 0; i < n_names; i++)
        if (!strcmp(names[i], s))
            return names[i];
    char **nn = realloc(names, sizeof *names * (n_names + 1));
    if (!nn)
        return "?";
    names = nn;
    names[n_names] = strdup(s);
    return names[n_names] ? names[n_names++] : "?";
}

#define BUF_BYTES (8u << 20)

static void CUPTIAPI buf_requested(uint8_t **buf, size_t *size, size_t *max_records)
{
    *buf = aligned_alloc(8, BUF_BYTES);
    *size = *buf ? BUF_BYTES : 0;
    *max_records = 0;
}

static void CUPTIAPI buf_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                   size_t valid)
{
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *r = NULL;
    while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && r->kind != CUPTI_ACTIVITY_KIND_KERNEL)
            continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
        if (n_recs == cap_recs) {
            size_t nc = cap_recs ? cap_recs * 2 : 65536;
            struct rec *nr = realloc(recs, sizeof *recs * nc);
            if (!nr)
                break;
            recs = nr;
            cap_recs = nc;
        }
        recs[n_recs++] = (struct rec){k->start, k->end, k->correlationId,
                                      k->gridX * k->gridY * k->gridZ,
                                      k->blockX * k->blockY * k->blockZ, k->registersPerThread,
                                      (uint32_t)(k->staticSharedMemory + k->dynamicSharedMemory),
                                      k->sharedMemoryExecuted, intern(k->name)};
    }
    free(buf);
}

static int cmp_rec(const void *a, const void *b)
{
    const struct rec *x = a, *y = b;
    if (x->corr != y->corr)
        return x->corr < y->corr ? -1 : 1;
    return x->start < y->start ? -1 : x->start > y->start;
}

static void report(void)
{
    cuptiActivityFlushAll(1);
    const char *path = getenv("MOE_TRACE_OUT");
    FILE *f = path && *path ? fopen(path, "w") : stderr;
    if (!f)
        f = stderr;
    qsort(recs, n_recs, sizeof *recs, cmp_rec);
    /* Launches (runs of one correlation id) and the most common node count above 16. */
    size_t best_n = 0, best_count = 0;
    size_t *counts = calloc(1 << 16, sizeof *counts);
    for (size_t i = 0; counts && i < n_recs;) {
        size_t j = i;
        while (j < n_recs && recs[j].corr == recs[i].corr)
            j++;
        const size_t n = j - i;
        if (n > 16 && n < (1 << 16) && ++counts[n] >= best_count) {
            if (counts[n] > best_count || n > best_n)
                best_n = n;
            best_count = counts[n];
        }
        i = j;
    }
    free(counts);
    fprintf(f, "kernel-trace: %zu kernels; %zu launches of %zu nodes\n", n_recs, best_count,
            best_n);
    if (!best_n) {
        if (f != stderr)
            fclose(f);
        return;
    }
    double *pos_start = calloc(best_n, sizeof(double)), *pos_dur = calloc(best_n, sizeof(double)),
           *pos_gap = calloc(best_n, sizeof(double));
    const struct rec **pos_rec = calloc(best_n, sizeof *pos_rec);
    double span = 0, busy = 0, gaps = 0;
    size_t steps = 0;
    for (size_t i = 0; i < n_recs;) {
        size_t j = i;
        while (j < n_recs && recs[j].corr == recs[i].corr)
            j++;
        if (j - i == best_n && pos_start) {
            /* Skip the first two launches of the graph (warm-up). */
            if (++steps > 2) {
                const uint64_t t0 = recs[i].start;
                uint64_t last_end = t0;
                for (size_t p = 0; p < best_n; p++) {
                    const struct rec *r = &recs[i + p];
                    pos_start[p] += (double)(r->start - t0);
                    pos_dur[p] += (double)(r->end - r->start);
                    const double g = p ? (double)r->start - (double)last_end : 0.0;
                    pos_gap[p] += g;
                    busy += (double)(r->end - r->start);
                    gaps += g;
                    if (r->end > last_end)
                        last_end = r->end;
                    pos_rec[p] = r;
                }
                span += (double)(last_end - t0);
            }
        }
        i = j;
    }
    const double ns = steps > 2 ? (double)(steps - 2) : 1.0;
    fprintf(f,
            "step (first start to last end): %.1f us; kernels %.1f us; gaps between them %.1f us "
            "(%.2f us a node); %zu steps averaged\n",
            span / ns / 1e3, busy / ns / 1e3, gaps / ns / 1e3, gaps / ns / 1e3 / (double)best_n,
            steps > 2 ? steps - 2 : 0);
    fprintf(f, "\nper kernel: count a step, mean us, mean gap before (us), grid x block, regs, "
               "shared memory a block / the SM's shared memory split (KiB)\n");
    for (size_t a = 0; a < best_n; a++) {
        int first = pos_rec[a] != NULL;
        for (size_t b = 0; first && b < a; b++)
            first = !(pos_rec[b] && pos_rec[b]->name == pos_rec[a]->name);
        if (!first)
            continue;
        size_t c = 0;
        double d = 0, g = 0;
        for (size_t b = a; b < best_n; b++)
            if (pos_rec[b] && pos_rec[b]->name == pos_rec[a]->name) {
                c++;
                d += pos_dur[b];
                g += pos_gap[b];
            }
        fprintf(f, "%4zu %9.2f %7.2f %8d x %-4d %3u %6.1f/%-5.1f  %.150s\n", c,
                d / (double)c / ns / 1e3, g / (double)c / ns / 1e3, pos_rec[a]->grid,
                pos_rec[a]->block, (unsigned)pos_rec[a]->regs, pos_rec[a]->smem / 1024.0,
                pos_rec[a]->smem_cfg / 1024.0, pos_rec[a]->name);
    }
    fprintf(f, "\nper node: index, start us, us, gap us, the SM's shared memory split (KiB), name\n");
    for (size_t p = 0; p < best_n; p++)
        if (pos_rec[p])
            fprintf(f, "%4zu %9.2f %8.2f %7.2f %5.1f  %.100s\n", p, pos_start[p] / ns / 1e3,
                    pos_dur[p] / ns / 1e3, pos_gap[p] / ns / 1e3, pos_rec[p]->smem_cfg / 1024.0,
                    pos_rec[p]->name);
    if (f != stderr)
        fclose(f);
}

int InitializeInjection(void)
{
    if (cuptiActivityRegisterCallbacks(buf_requested, buf_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "kernel-trace: CUPTI would not record kernels\n");
        return 0;
    }
    atexit(report);
    return 1;
}

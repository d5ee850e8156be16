/* The CUDA sampler's per-row algorithm (worker/cuda/sample_dev.cuh) on the host: an executor
 * that runs the 1024 threads of each phase one after another (in forward or reverse order, so
 * that an order dependence inside a phase shows), shared memory poisoned before every row, and
 * the launches of moe_cuda_sample_rows emulated in their order: the first pass over 64 segments
 * (scan_kernel), the tier-C weights' sums per segment (csum_kernel's csub_sum and csum_add), the
 * top-k rows' kernel (sample_row_topk), the main kernel (sample_row) and the tier-C rows' kernel
 * (sample_row_cseg). Checked against worker/sampler.c in lockstep (each row's CPU sampler seeded
 * alike): greedy and empty rows exactly, seeded draws but for a rounding of a boundary (the sums
 * run in another order), the penalised logits bit for bit, every generator state equal at the
 * end; and the spread passes against none, draw for draw. Vocabularies of 33 to 151936 logits;
 * the GPU test's logits and parameter sets (tests/sample_cases.h) and a few more at the top-k
 * kernel's bounds; a sort list of 8 entries that sends top-k rows back to the main kernel and
 * rows through the exact tier B. The GPU tests (tests/gpu/test_cuda_sample.c) check the kernels
 * themselves. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The templates are instantiated with HostExec, whose methods are host code: their device
 * instantiations are never called. */
#pragma nv_diag_suppress 20011
#pragma nv_diag_suppress 20014
#include "worker/cuda/sample_dev.cuh"

extern "C" {
#include "tests/harness.h"
}
#include "tests/sample_cases.h"

using namespace moe_sample;

/* One block, thread by thread. */
struct HostExec {
    Smem sh;
    bool rev = false;
    long fails = 0;
    int T(int i) const { return rev ? NT - 1 - i : i; }
    template <class F> void each(F f)
    {
        for (int i = 0; i < NT; i++)
            f(T(i));
    }
    template <class F> void single(F f) { f(); }
    void sync() {}
    template <class F> double sum_d(F f)
    {
        double v = 0.0;
        for (int t = 0; t < NT; t++)
            v += f(t);
        return v;
    }
    template <class F> long long sum_l(F f)
    {
        long long v = 0;
        for (int i = 0; i < NT; i++)
            v += f(T(i));
        return v;
    }
    template <class F> long long max_l(F f)
    {
        long long v = LLONG_MIN;
        for (int i = 0; i < NT; i++) {
            const long long y = f(T(i));
            v = y > v ? y : v;
        }
        return v;
    }
    template <class F> long long min_l(F f)
    {
        long long v = LLONG_MAX;
        for (int i = 0; i < NT; i++) {
            const long long y = f(T(i));
            v = y < v ? y : v;
        }
        return v;
    }
    template <class F> float max_f(F f)
    {
        float v = -INFINITY;
        for (int i = 0; i < NT; i++)
            v = fmaxf(v, f(T(i)));
        return v;
    }
    template <class F> double scan_d(F f, double *excl)
    {
        double run = 0.0;
        for (int t = 0; t < NT; t++) {
            const double v = f(t);
            excl[t] = run;
            run += v;
        }
        return run;
    }
    template <class F> long long scan_l(F f, long long *excl)
    {
        long long run = 0;
        for (int t = 0; t < NT; t++) {
            const long long v = f(t);
            excl[t] = run;
            run += v;
        }
        return run;
    }
    void atomic_add(uint32_t *p, uint32_t v) { *p += v; }
    void atomic_add(float *p, float v) { *p += v; }
    void atomic_add(double *p, double v) { *p += v; }
    uint32_t atomic_inc(uint32_t *p) { return (*p)++; }
    void check(bool ok, int line)
    {
        if (!ok && fails++ < 5)
            fprintf(stderr, "  sample_dev.cuh check failed at line %d\n", line);
    }
    void note(int) {}
};

/* One emulated launch of moe_cuda_sample_rows over rows 0..n-1 (no row map, no logprobs,
 * accepting the tokens): the kernels in their order, each row's block run by x. */
struct Emu {
    uint32_t nv, rows, hist_cap, list_cap;
    moe_cuda_sample_row *params;
    moe_cuda_sample_state *state;
    int32_t *ring;
    unsigned char *smem;
    size_t smem_bytes;
    ScanPart *part;
    CSum *csum;
    uint8_t *kdone;
    TpRow *tp;
    uint32_t *tph_c;
    double *tph_m;
    uint64_t *tpl;
    /* rows drawn by the top-k kernel, by the tier-C rows' kernel, by the top-p chain */
    long n_topk, n_cseg, n_topp;
};

static void emu_init(Emu *e, uint32_t nv, uint32_t rows, uint32_t hist_cap, uint32_t list_cap)
{
    e->nv = nv;
    e->rows = rows;
    e->hist_cap = hist_cap;
    e->list_cap = pow2ceil_host(list_cap);
    size_t off[16];
    e->smem_bytes = smem_layout(e->list_cap, pow2ceil_host(hist_cap), off);
    e->smem = (unsigned char *)aligned_alloc(16, (e->smem_bytes + 15) & ~(size_t)15);
    e->params = (moe_cuda_sample_row *)calloc(rows, sizeof *e->params);
    e->state = (moe_cuda_sample_state *)calloc(rows, sizeof *e->state);
    e->ring = (int32_t *)calloc((size_t)rows * (hist_cap ? hist_cap : 1), sizeof *e->ring);
    e->part = (ScanPart *)calloc((size_t)rows * NSEG, sizeof *e->part);
    e->csum = (CSum *)calloc((size_t)rows * NSEG, sizeof *e->csum);
    e->kdone = (uint8_t *)calloc(rows, 1);
    e->tp = (TpRow *)calloc(rows, sizeof *e->tp);
    e->tph_c = (uint32_t *)calloc((size_t)rows * HB, sizeof *e->tph_c);
    e->tph_m = (double *)calloc((size_t)rows * HB, sizeof *e->tph_m);
    e->tpl = (uint64_t *)calloc((size_t)rows * e->list_cap, sizeof *e->tpl);
    e->n_topk = e->n_cseg = e->n_topp = 0;
}

static void emu_free(Emu *e)
{
    free(e->smem);
    free(e->params);
    free(e->state);
    free(e->ring);
    free(e->part);
    free(e->csum);
    free(e->kdone);
    free(e->tp);
    free(e->tph_c);
    free(e->tph_m);
    free(e->tpl);
}

static HostExec block(Emu *e, bool rev)
{
    memset(e->smem, 0xa5, e->smem_bytes); /* poisoned: a read before a write shows */
    HostExec x;
    x.sh = smem_carve(e->smem, e->list_cap, pow2ceil_host(e->hist_cap));
    x.rev = rev;
    return x;
}

/* spread: the MOE_CUDA_SPREAD_* passes to take. Returns the executor checks that failed. */
static long emu_sample(Emu *e, float *lg, int spread, int32_t *tok, bool rev)
{
    Args a = launch_args(lg, NULL, tok, NULL, e->params, e->state, e->ring, e->nv, e->hist_cap,
                         e->list_cap, true, make_levels(e->nv));
    long fails = 0;
    if (spread & MOE_CUDA_SPREAD_PENALTY) {
        /* penalty_kernel */
        for (uint32_t r = 0; r < e->rows; r++) {
            HostExec x = block(e, rev);
            pen_row(x, a, r);
            fails += x.fails;
        }
        a.pen_done = 1;
    }
    if (spread) {
        /* scan_kernel: a segment's maximum, the lowest index holding it, its count. */
        for (uint32_t r = 0; r < e->rows; r++)
            for (uint32_t g = 0; g < NSEG; g++) {
                uint32_t i0, i1;
                seg_range(e->nv, g, &i0, &i1);
                float bv = -INFINITY;
                int bi = -1, c = 0;
                for (uint32_t i = i0; i < i1; i++)
                    first_pass_see(lg[(size_t)r * e->nv + i], i, &bv, &bi, &c);
                e->part[(size_t)r * NSEG + g] = ScanPart{bv, bi, (uint32_t)c};
            }
        a.part = e->part;
    }
    if (spread & MOE_CUDA_SPREAD_TIER_C) {
        /* csum_kernel, line for line. */
        for (uint32_t r = 0; r < e->rows; r++) {
            const moe_cuda_sample_row &p = e->params[r];
            if (!csum_row(p))
                continue;
            uint32_t ncand;
            const float M = parts_max(e->part + (size_t)r * NSEG, &ncand);
            const float cut = tier_c_cut(p, M, ncand);
            const WCtx wt = {M, (double)p.temperature};
            for (uint32_t g = 0; g < NSEG; g++) {
                uint32_t i0, i1;
                seg_range(e->nv, g, &i0, &i1);
                double v[SCAN_NT];
                int last[SCAN_NT];
                for (int t = 0; t < SCAN_NT; t++)
                    v[t] = csub_sum(lg + (size_t)r * e->nv, i0, i1, t, cut, wt, &last[t]);
                e->csum[(size_t)r * NSEG + g] = csum_add(v, last);
            }
        }
        a.csum = e->csum;
    }
    if (spread & MOE_CUDA_SPREAD_TOPK) {
        a.kdone = e->kdone;
        for (uint32_t r = 0; r < e->rows; r++) {
            const moe_cuda_sample_row p = e->params[r];
            const moe_cuda_sample_state st = e->state[r];
            uint32_t wn;
            bool done = false;
            if (topk_row(p) && !row_pen_due(a, p, st, &wn)) {
                HostExec x = block(e, rev);
                done = sample_row_topk(x, a, p, st, r, r, lg + (size_t)r * e->nv);
                fails += x.fails;
            }
            e->kdone[r] = done;
            e->n_topk += done;
        }
    }
    if (spread & MOE_CUDA_SPREAD_TOPP) {
        /* The top-p chain, launch by launch. */
        const bool kd_written = a.kdone != NULL;
        a.kdone = e->kdone;
        a.tp = e->tp;
        a.tph_c = e->tph_c;
        a.tph_m = e->tph_m;
        a.tpl = e->tpl;
        for (uint32_t r = 0; r < e->rows; r++)
            tp_init_row(a, r, !kd_written);
        for (int ph = 0; ph < 2; ph++) {
            for (int lv = 0; lv < TP_LEVELS; lv++) {
                /* tp_hist_kernel: each element of the bin added to the row's bins (here in
                 * index order, on the GPU in any) */
                for (uint32_t r = 0; r < e->rows; r++) {
                    const TpRow tr = e->tp[r];
                    if (!tr.live || tr.lev != lv)
                        continue;
                    for (uint32_t g = 0; g < NSEG; g++)
                        tp_seg_elems(a, r, tr, lv, g, 0, 1,
                                     [&](uint32_t, float, uint32_t d, double w) {
                                         e->tph_c[(size_t)r * HB + d]++;
                                         e->tph_m[(size_t)r * HB + d] += w;
                                     });
                }
                for (uint32_t r = 0; r < e->rows; r++) {
                    HostExec x = block(e, rev);
                    tp_pick(x, a, r, lv);
                    fails += x.fails;
                }
            }
            /* tp_collect_kernel: the bin's keys appended (segments backward when rev: the GPU's
             * order is any, the list is sorted after) */
            for (uint32_t r = 0; r < e->rows; r++) {
                const TpRow tr = e->tp[r];
                if (!tr.live || tr.lev != -1)
                    continue;
                for (uint32_t k = 0; k < NSEG; k++)
                    tp_seg_elems(a, r, tr, -1, rev ? NSEG - 1 - k : k, 0, 1,
                                 [&](uint32_t i, float l, uint32_t, double) {
                                     const uint32_t j = e->tp[r].list_n++;
                                     if (j < e->list_cap)
                                         e->tpl[(size_t)r * e->list_cap + j] = key(l, i, e->nv);
                                 });
            }
            for (uint32_t r = 0; r < e->rows; r++) {
                HostExec x = block(e, rev);
                tp_final(x, a, r);
                fails += x.fails;
            }
        }
        for (uint32_t r = 0; r < e->rows; r++)
            e->n_topp += e->kdone[r] && topp_row(e->params[r]);
        for (size_t i = 0; i < (size_t)e->rows * HB; i++)
            if (e->tph_c[i] || e->tph_m[i] != 0.0)
                fails++; /* the histograms are zero between uses */
    }
    for (uint32_t r = 0; r < e->rows; r++) {
        HostExec x = block(e, rev);
        sample_row<HostExec, false>(x, a, r);
        fails += x.fails;
    }
    if (a.csum)
        for (uint32_t r = 0; r < e->rows; r++) {
            const moe_cuda_sample_row p = e->params[r];
            const moe_cuda_sample_state st = e->state[r];
            uint32_t wn;
            if (!row_cseg(a, p, row_pen_due(a, p, st, &wn)))
                continue;
            HostExec x = block(e, rev);
            sample_row_cseg(x, a, p, st, r, r, lg + (size_t)r * e->nv);
            fails += x.fails;
            e->n_cseg++;
        }
    return fails;
}

/* Beside the GPU test's parameter sets: the bounds of the top-k kernel's rows (k 64 and 65, a
 * small k with min-p), a top-k with top-p, a temperature with penalties. */
static const struct combo extra[] = {
    {"top-k 20 p", 0.6f, 20, 0.95f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"top-k 64", 1.0f, 64, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"top-k 65", 1.0f, 65, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f, 64},
    {"top-k 7 min-p", 1.3f, 7, 1.0f, 0.2f, 1.0f, 0.0f, 0.0f, 64},
    {"temperature+pen", 1.0f, 0, 1.0f, 0.0f, 1.2f, 0.5f, 0.3f, 48},
};
#define N_EXTRA (sizeof extra / sizeof extra[0])
#define N_PSET (N_COMBO + N_EXTRA)

static const struct combo *pset(uint32_t r)
{
    return r < N_COMBO ? &combos[r] : &extra[r - N_COMBO];
}

/* rows = N_PSET, each row its parameter set; steps of fresh logits per row. */
static void run_vocab(uint32_t nv, int steps, uint32_t list_cap, bool rev, long *draws,
                      long *differ, long *differ_spread, long *n_topk, long *n_cseg,
                      long *n_topp, long *pen_differ)
{
    /* hist above the steps: a whole-history window stays within the ring */
    const uint32_t rows = (uint32_t)N_PSET, hist = 256;
    Emu e[2];
    struct moe_sampler *cpu[N_PSET];
    for (int k = 0; k < 2; k++) {
        emu_init(&e[k], nv, rows, hist, list_cap);
        for (uint32_t r = 0; r < rows; r++) {
            struct moe_sampler_params sp;
            moe_sampler_defaults(&sp);
            sp.temperature = pset(r)->t;
            sp.top_k = pset(r)->k;
            sp.top_p = pset(r)->top_p;
            sp.min_p = pset(r)->min_p;
            sp.repeat_penalty = pset(r)->rep;
            sp.presence_penalty = pset(r)->pres;
            sp.frequency_penalty = pset(r)->freq;
            sp.penalty_last_n = pset(r)->last_n;
            sp.seed = 777 + r;
            char err[128];
            CHECK_EQ(fill_row(&sp, hist, &e[k].params[r], err, sizeof err), 0);
            rng_seed(sp.seed, e[k].state[r].rng);
            if (k == 0)
                CHECK_EQ(moe_sampler_init(&cpu[r], &sp, nv, err, sizeof err), 0);
        }
    }
    float *l0 = (float *)malloc(sizeof(float) * rows * nv);
    float *l1 = (float *)malloc(sizeof(float) * rows * nv);
    float *l2 = (float *)malloc(sizeof(float) * rows * nv);
    float *pen = (float *)malloc(sizeof(float) * nv);
    int32_t t0[N_PSET], t1[N_PSET];
    CHECK(l0 && l1 && l2 && pen);
    for (int s = 0; s < steps; s++) {
        for (uint32_t r = 0; r < rows; r++) {
            int g = (int)((r + (uint32_t)s) % N_GEN);
            /* A +inf row's token is the device's own (below), so the histories, and with them
             * the penalties, would part from the CPU's. */
            if (g == G_PINF && pset(r)->rep != 1.0f)
                g = G_LLM;
            make_logits(g, l0 + (size_t)r * nv, nv);
        }
        memcpy(l1, l0, sizeof(float) * rows * nv);
        memcpy(l2, l0, sizeof(float) * rows * nv);
        CHECK_EQ(emu_sample(&e[0], l1, MOE_CUDA_SPREAD_ALL, t0, rev), 0);
        CHECK_EQ(emu_sample(&e[1], l2, 0, t1, !rev), 0);
        for (uint32_t r = 0; r < rows; r++) {
            const float *row = l0 + (size_t)r * nv;
            /* The logits the emulated kernels left in place are the CPU's penalised ones. */
            memcpy(pen, row, sizeof(float) * nv);
            moe_sampler_apply_penalties(cpu[r], pen);
            *pen_differ += memcmp(pen, l1 + (size_t)r * nv, sizeof(float) * nv) != 0;
            const int32_t c = moe_sampler_sample(cpu[r], row);
            moe_sampler_accept(cpu[r], c);
            int32_t pinf = -1; /* the lowest +inf id */
            for (uint32_t i = 0; i < nv && pinf < 0; i++)
                if (row[i] == INFINITY)
                    pinf = (int32_t)i;
            const bool exact = !(pset(r)->t > 0.0f) || c < 0;
            if (pinf >= 0 && !exact) {
                /* The CPU's arithmetic degenerates on +inf (inf - inf); the device draws the
                 * lowest +inf id (docs/cuda.md). */
                CHECK_MSG(t0[r] == pinf && t1[r] == pinf, "nv=%u %s: +inf row gave %d / %d, "
                          "want %d", nv, pset(r)->name, t0[r], t1[r], pinf);
                continue;
            }
            if (exact)
                CHECK_MSG(t0[r] == c, "nv=%u step %d %s: %d, cpu %d", nv, s, pset(r)->name,
                          t0[r], c);
            else
                ++*draws;
            *differ += t0[r] != c;
            if (t0[r] != c && getenv("SAMPLE_HOST_DEBUG"))
                printf("  nv=%u step %d %s: %d, cpu %d, one-block %d\n", nv, s, pset(r)->name,
                       t0[r], c, t1[r]);
            *differ_spread += t0[r] != t1[r];
        }
    }
    for (uint32_t r = 0; r < rows; r++) {
        uint64_t st[4];
        moe_sampler_rng_state(cpu[r], st);
        CHECK_MSG(memcmp(st, e[0].state[r].rng, sizeof st) == 0, "nv=%u %s: generator", nv,
                  pset(r)->name);
        CHECK(memcmp(e[0].state[r].rng, e[1].state[r].rng, sizeof st) == 0);
        moe_sampler_free(cpu[r]);
    }
    *n_topk += e[0].n_topk;
    *n_cseg += e[0].n_cseg;
    *n_topp += e[0].n_topp;
    free(l0);
    free(l1);
    free(l2);
    free(pen);
    emu_free(&e[0]);
    emu_free(&e[1]);
}

TEST_TIMEOUT(sample_host_spread_passes_match_the_cpu, 300)
{
    moe_test_rng_seed(4242);
    static const struct {
        uint32_t nv;
        int steps;
        uint32_t list_cap;
    } cfg[] = {{33, 150, 8192}, {1000, 60, 8192}, {4097, 24, 8192}, {1000, 40, 8},
               {151936, 4, 8192}};
    long draws = 0, differ = 0, differ_spread = 0, n_topk = 0, n_cseg = 0, n_topp = 0,
         pen_differ = 0;
    for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; i++)
        run_vocab(cfg[i].nv, cfg[i].steps, cfg[i].list_cap, i % 2 == 1, &draws, &differ,
                  &differ_spread, &n_topk, &n_cseg, &n_topp, &pen_differ);
    printf("  %ld seeded draws (%ld rows by the top-k kernel, %ld by the tier-C one, %ld by the "
           "top-p chain): %ld differ from the CPU's, %ld between spread and one-block passes\n",
           draws, n_topk, n_cseg, n_topp, differ, differ_spread);
    CHECK_EQ(pen_differ, 0);
    CHECK(draws > 2000);
    CHECK(n_topk > 500);
    CHECK(n_cseg > 500);
    CHECK(n_topp > 300);
    CHECK(differ * 1000 <= draws);
    CHECK(differ_spread * 1000 <= draws);
}

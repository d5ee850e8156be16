/* Expert offload on CUDA (docs/offload.md): at any residency, with or without the cache, with a
 * placement from routing counts or without, the logits are byte-identical to the fully resident
 * run, and so are sampled tokens; the VRAM budget holds. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/units.h"
#include "tests/engine_test.h"
#include "tests/gpu/gpu_test.h"
#include "worker/cuda/offload_resolve.h"

static const char *const MODELS[] = {
    GOLDEN "/models/tiny-qwen3moe-Q4_K_M.gguf",
    "tests/fixtures/hf/q5k-q6k-gqa4.gguf",
    "tests/fixtures/hf/hd128-e32-long.gguf",
    "models/kjv-demo-F16.gguf",
};
#define N_MODELS (sizeof MODELS / sizeof MODELS[0])

struct config {
    const char *name;
    double residency;
    int32_t cache_slots;
    bool counts;            /* hot set from routing counts of a first run */
    bool no_prefetch;
    const char *stage;      /* MOE_CUDA_STAGE for the engine (NULL: auto) */
    bool stage_dma;         /* MOE_CUDA_STAGE_DMA=1: direct steps stage by the copy engines */
    bool fill_launch;       /* MOE_CUDA_FILL_FOLD=0: decode copies by the fill kernel */
    const char *ahead;      /* MOE_CUDA_PREFETCH_AHEAD: predictions that many layers ahead */
    const char *pf_threads; /* MOE_CUDA_PREFETCH_THREADS (NULL: the default) */
    const char *pf_split;   /* MOE_CUDA_PREFETCH_SPLIT (NULL: unset) */
};

static const struct config CONFIGS[] = {
    {"60%", 0.6, 0, false, false, NULL, false, false, NULL, NULL, NULL},
    {"30%", 0.3, 0, false, false, NULL, false, false, NULL, NULL, NULL},
    {"30% cache off", 0.3, -1, false, false, NULL, false, false, NULL, NULL, NULL},
    {"30% one cache slot", 0.3, 1, false, false, NULL, false, false, NULL, NULL, NULL},
    {"60% from counts", 0.6, 0, true, false, NULL, false, false, NULL, NULL, NULL},
    {"30% from counts", 0.3, 0, true, false, NULL, false, false, NULL, NULL, NULL},
    {"30% no prefetch", 0.3, 0, false, true, NULL, false, false, NULL, NULL, NULL},
    {"60% counts, no prefetch", 0.6, 0, true, true, NULL, false, false, NULL, NULL, NULL},
    {"one token's experts", 1e-9, 0, false, false, NULL, false, false, NULL, NULL, NULL},
    {"30% no staging", 0.3, 0, false, false, "0", false, false, NULL, NULL, NULL},
    {"30% staging of 1", 0.3, 0, false, false, "1", false, false, NULL, NULL, NULL},
    {"60% counts, staging of all", 0.6, 0, true, false, "100000", false, false, NULL, NULL, NULL},
    {"60% counts, staging by DMA", 0.6, 0, true, false, "100000", true, false, NULL, NULL, NULL},
    {"30%, fill kernel", 0.3, 0, false, false, NULL, false, true, NULL, NULL, NULL},
    {"60% counts, fill kernel", 0.6, 0, true, false, NULL, false, true, NULL, NULL, NULL},
    {"30% one layer ahead", 0.3, 0, false, false, NULL, false, false, "1", NULL, NULL},
    {"60% counts, one layer ahead", 0.6, 0, true, false, NULL, false, false, "1", NULL, NULL},
    {"30%, 64-thread prefetch copies", 0.3, 0, false, false, NULL, false, false, NULL, "64",
     NULL},
    {"60% counts, 128-thread prefetch copies", 0.6, 0, true, false, NULL, false, false, NULL,
     "128", NULL},
    {"30% two layers ahead", 0.3, 0, false, false, NULL, false, false, "2", NULL, NULL},
    {"60% counts, two layers ahead", 0.6, 0, true, false, NULL, false, false, "2", NULL, NULL},
    {"30%, copies after each prediction", 0.3, 0, false, false, NULL, false, false, NULL,
     NULL, "0"},
    {"60% counts, one ahead, copies after each prediction", 0.6, 0, true, false, NULL, false,
     false, "1", NULL, "0"},
};
#define N_CONFIGS (sizeof CONFIGS / sizeof CONFIGS[0])

enum { N_SEQ = 3, PROMPT = 90, DECODE = 12, N_BATCH = 72 };

/* The workload: sequence 0's prompt in chunks of N_BATCH (a direct step and a recorded one, both
 * staged where the engine stages prompts),
 * then DECODE steps of all N_SEQ sequences (graphs; sequences 1 and 2 start with one token),
 * logits of every step appended to *out; then sampled steps (temperature 0.8, seeded), tokens
 * appended to *tok. Returns the number of logit rows. */
static size_t run(struct moe_engine *e, const struct moe_model *m, float *out, int32_t *tok)
{
    const int64_t V = m->hp.n_vocab;
    int32_t t[N_BATCH], pos[N_BATCH], sq[N_BATCH];
    size_t rows = 0;
    for (int off = 0; off < PROMPT; off += N_BATCH) {
        int n = PROMPT - off < N_BATCH ? PROMPT - off : N_BATCH;
        for (int i = 0; i < n; i++) {
            t[i] = (int32_t)(((off + i) * 7919 + 13) % V);
            pos[i] = off + i;
            sq[i] = 0;
        }
        struct moe_batch b = {.n = (uint32_t)n, .token = t, .pos = pos, .seq = sq};
        CHECK_MSG(moe_engine_forward(e, &b, out + rows * V) == 0, "%s", moe_engine_errmsg(e));
        rows += (size_t)n;
    }
    int32_t p[N_SEQ] = {PROMPT, 0, 0};
    for (int s = 0; s < DECODE; s++) {
        for (int i = 0; i < N_SEQ; i++) {
            t[i] = (int32_t)((s * 31 + i * 577 + 5) % V);
            pos[i] = p[i]++;
            sq[i] = i;
        }
        struct moe_batch b = {.n = N_SEQ, .token = t, .pos = pos, .seq = sq};
        CHECK_MSG(moe_engine_forward(e, &b, out + rows * V) == 0, "%s", moe_engine_errmsg(e));
        rows += N_SEQ;
    }
    struct moe_sampler_params sp;
    moe_sampler_defaults(&sp);
    sp.temperature = 0.8f;
    for (int i = 0; i < N_SEQ; i++) {
        sp.seed = 1000 + (uint64_t)i;
        CHECK_EQ(moe_engine_seq_sampler(e, i, &sp, NULL, 0), 0);
    }
    int32_t cur[N_SEQ] = {1, 2, 3};
    for (int s = 0; s < DECODE; s++) {
        for (int i = 0; i < N_SEQ; i++) {
            pos[i] = p[i]++;
            sq[i] = i;
        }
        struct moe_batch b = {.n = N_SEQ, .token = cur, .pos = pos, .seq = sq};
        CHECK_MSG(moe_engine_forward_sample(e, &b, tok + s * N_SEQ) == 0, "%s",
                  moe_engine_errmsg(e));
        memcpy(cur, tok + s * N_SEQ, sizeof cur);
    }
    return rows;
}

static struct moe_engine *engine(const struct moe_model *m, const struct config *c,
                                 const uint64_t *counts, uint64_t budget)
{
    struct moe_engine_opts o = {.n_ctx = PROMPT + 2 * DECODE + 8, .n_seq = N_SEQ,
                                .n_batch = N_BATCH, .device = "cuda:0", .vram_budget = budget};
    if (c) {
        o.expert_residency = c->residency;
        o.cache_slots = c->cache_slots;
        o.expert_counts = c->counts ? counts : NULL;
        o.no_prefetch = c->no_prefetch;
    }
    /* Staging is read at init. */
    if (c && c->stage)
        setenv("MOE_CUDA_STAGE", c->stage, 1);
    if (c && c->stage_dma)
        setenv("MOE_CUDA_STAGE_DMA", "1", 1);
    if (c && c->fill_launch)
        setenv("MOE_CUDA_FILL_FOLD", "0", 1);
    if (c && c->ahead)
        setenv("MOE_CUDA_PREFETCH_AHEAD", c->ahead, 1);
    if (c && c->pf_threads)
        setenv("MOE_CUDA_PREFETCH_THREADS", c->pf_threads, 1);
    if (c && c->pf_split)
        setenv("MOE_CUDA_PREFETCH_SPLIT", c->pf_split, 1);
    struct moe_engine *e = NULL;
    char err[512] = "";
    const int rc = moe_engine_init(&e, m, &o, err, sizeof err);
    unsetenv("MOE_CUDA_STAGE");
    unsetenv("MOE_CUDA_STAGE_DMA");
    unsetenv("MOE_CUDA_FILL_FOLD");
    unsetenv("MOE_CUDA_PREFETCH_AHEAD");
    unsetenv("MOE_CUDA_PREFETCH_THREADS");
    unsetenv("MOE_CUDA_PREFETCH_SPLIT");
    CHECK_MSG(rc == 0, "%s", err);
    return e;
}

TEST_TIMEOUT(cuda_offload_is_exact, 600)
{
    need_gpu();
    for (size_t mi = 0; mi < N_MODELS; mi++) {
        struct test_model tm;
        test_model_open(&tm, MODELS[mi]);
        const struct moe_model *m = &tm.m;
        const int64_t V = m->hp.n_vocab, L = m->hp.n_layer, E = m->hp.n_expert;
        const size_t cap = (size_t)(PROMPT + 2 * DECODE * N_SEQ) * (size_t)V;
        float *ref = malloc(sizeof(float) * cap), *got = malloc(sizeof(float) * cap);
        int32_t ref_tok[DECODE * N_SEQ], got_tok[DECODE * N_SEQ];
        uint64_t *counts = calloc((size_t)(L * E), sizeof *counts);
        CHECK(ref && got && counts);

        struct moe_engine *e = engine(m, NULL, NULL, 0);
        const size_t rows = run(e, m, ref, ref_tok);
        CHECK_EQ(moe_engine_routing_counts(e, counts), 0);
        struct moe_offload_stats os;
        CHECK_EQ(moe_engine_offload_stats(e, &os, NULL), 0);
        CHECK(!os.active);
        moe_engine_free(e);

        for (size_t ci = 0; ci < N_CONFIGS; ci++) {
            const struct config *c = &CONFIGS[ci];
            e = engine(m, c, counts, 0);
            memset(got, 0xff, sizeof(float) * cap);
            CHECK_EQ(run(e, m, got, got_tok), rows);
            struct moe_offload_layer *pl = calloc((size_t)L, sizeof *pl);
            CHECK(pl != NULL);
            CHECK_EQ(moe_engine_offload_stats(e, &os, pl), 0);
            struct moe_engine_info info;
            moe_engine_info(e, &info);
            size_t diff = floats_differing(got, ref, rows * (size_t)V);
            const uint64_t looked = os.hits + os.misses;
            printf("  %-34s %-20s layer 0: slots %u (%u hot): %llu hits, %llu misses, %.2f MiB filled, "
                   "%llu from host, %llu prefetched (%llu chosen, %llu evicted unchosen), %llu staged in buffers of %u (%llu read); %zu of %zu logits differ\n",
                   MODELS[mi] + (strrchr(MODELS[mi], '/') - MODELS[mi]) + 1, c->name, pl[0].slots,
                   pl[0].hot, (unsigned long long)os.hits, (unsigned long long)os.misses,
                   (double)os.fill_bytes / (1 << 20), (unsigned long long)os.direct,
                   (unsigned long long)os.prefetched, (unsigned long long)os.prefetch_used,
                   (unsigned long long)os.prefetch_wasted, (unsigned long long)os.staged,
                   os.stage_experts,
                   (unsigned long long)os.stage_reads, diff,
                   rows * (size_t)V);
            if (ci == 0 || c->ahead || c->pf_split)
                printf("    %s\n", info.desc);
            /* The description names the prefetch's options wherever the link check left the
             * prefetch on (and its distance where the model is deep enough for it). */
            const bool pf_on = !c->no_prefetch && !strstr(info.desc, "copies lose");
            {
                /* three layers ahead by default */
                static const char *const dist[] = {"one layer", "two layers", "three layers"};
                const int a = c->ahead ? atoi(c->ahead) : 3;
                char want[64];
                snprintf(want, sizeof want, "prefetch %s ahead", dist[a - 1]);
                if (pf_on && L > a && (c->ahead || ci == 0))
                    CHECK_MSG(strstr(info.desc, want) != NULL, "%s: %s", want, info.desc);
            }
            if (pf_on)
                CHECK_MSG((strstr(info.desc, "copies after each prediction") != NULL) ==
                              (c->pf_split && !strcmp(c->pf_split, "0")),
                          "%s", info.desc);
            CHECK_EQ(diff, (size_t)0);
            CHECK(memcmp(got_tok, ref_tok, sizeof ref_tok) == 0);
            /* Every layer looks up its chosen experts once per step. */
            CHECK(looked > 0);
            CHECK(os.active); /* every configuration here keeps some experts out of VRAM */
            {
                CHECK(os.misses > 0);
                CHECK(os.expert_vram_bytes < os.expert_bytes);
                /* A miss is filled into a slot, read from a staging buffer or read from
                 * host memory. */
                CHECK(os.direct + os.stage_reads <= os.misses);
                if (c->stage && !strcmp(c->stage, "0"))
                    CHECK_EQ(os.stage_experts, 0u);
                if (c->stage && strcmp(c->stage, "0"))
                    CHECK(os.stage_experts > 0);
                if (os.stage_experts)
                    CHECK(os.staged > 0 && os.stage_reads > 0); /* both prompt chunks stage */
                else
                    CHECK_EQ(os.staged, (uint64_t)0);
                CHECK(os.stage_reads <= os.staged);
                if (c->cache_slots < 0) {
                    CHECK_EQ(os.fill_bytes, (uint64_t)0);
                    CHECK_EQ(os.direct + os.stage_reads, os.misses);
                } else {
                    CHECK(os.fill_bytes > 0);
                }
                for (int64_t l = 0; l < L; l++)
                    if (pl[l].slots < (uint32_t)E)
                        CHECK(pl[l].hits + pl[l].misses > 0);
                /* A prefetched expert is chosen by its layer, evicted first, or still waits. */
                CHECK(os.prefetch_used + os.prefetch_wasted <= os.prefetched);
                CHECK(os.prefetch_used <= os.hits);
                if (c->no_prefetch)
                    CHECK_EQ(os.prefetch_used + os.prefetch_wasted, (uint64_t)0);
                else if (c->residency >= 0.6 && os.prefetched >= 20)
                    CHECK_MSG(os.prefetch_used > 0, "%llu prefetched, none chosen",
                              (unsigned long long)os.prefetched);
            }
            if (c->counts) {
                /* Live re-pinning by the counts, a few experts per call, then the same workload
                 * again: still the resident run's bytes. */
                uint32_t pending = 1;
                int calls = 0;
                while (pending && calls < 10000) {
                    CHECK_MSG(moe_engine_set_hot(e, counts, 3, &pending) == 0, "%s",
                              moe_engine_errmsg(e));
                    calls++;
                }
                CHECK_EQ(pending, 0u);
                CHECK_EQ(moe_engine_offload_stats(e, &os, pl), 0);
                /* Each offloaded layer now pins its most-routed experts, as many as the cache
                 * rule with a profile leaves (none where S <= 2k). */
                uint32_t hot = 0, want_hot = 0;
                for (int64_t l = 0; l < L; l++) {
                    hot += pl[l].hot;
                    if (pl[l].slots >= (uint32_t)E)
                        continue;
                    int64_t routed = 0;
                    for (int64_t x = 0; x < E; x++)
                        routed += counts[l * E + x] != 0;
                    int64_t p = pl[l].slots - moe_off_cache_slots(pl[l].slots, E,
                                                                  m->hp.n_expert_used,
                                                                  c->cache_slots, 1);
                    p = routed < p ? routed : p;
                    CHECK_MSG(pl[l].hot == (uint32_t)p, "layer %lld: %u pinned, want %lld",
                              (long long)l, pl[l].hot, (long long)p);
                    want_hot += (uint32_t)p;
                }
                CHECK_EQ(hot, want_hot);
                for (int i = 0; i < N_SEQ; i++)
                    moe_engine_seq_clear(e, i);
                memset(got, 0xff, sizeof(float) * cap);
                CHECK_EQ(run(e, m, got, got_tok), rows);
                diff = floats_differing(got, ref, rows * (size_t)V);
                printf("    re-pinned in %d calls (%u hot): %zu logits differ\n", calls, hot, diff);
                CHECK_EQ(diff, (size_t)0);
                CHECK(memcmp(got_tok, ref_tok, sizeof ref_tok) == 0);
            }
            free(pl);
            moe_engine_free(e);
        }
        free(ref);
        free(got);
        free(counts);
        test_model_close(&tm);
    }
}

/* A link whose copies lose to reading in place (simulated: the fill path paced to 0.2 GB/s)
 * pins every slot and turns prefetch and staging off, so the worker runs as with the cache off;
 * with the check off the cache stays on and its paced copies still give the resident bytes. */
TEST_TIMEOUT(cuda_offload_slow_link_pins_every_slot, 300)
{
    need_gpu();
    static const char *const models[] = {GOLDEN "/models/tiny-qwen3moe-Q4_K_M.gguf",
                                         "tests/fixtures/hf/hd128-e32-long.gguf"};
    for (size_t mi = 0; mi < 2; mi++) {
        struct test_model tm;
        test_model_open(&tm, models[mi]);
        const struct moe_model *m = &tm.m;
        const int64_t V = m->hp.n_vocab;
        const size_t cap = (size_t)(PROMPT + 2 * DECODE * N_SEQ) * (size_t)V;
        float *ref = malloc(sizeof(float) * cap), *got = malloc(sizeof(float) * cap);
        int32_t ref_tok[DECODE * N_SEQ], got_tok[DECODE * N_SEQ];
        CHECK(ref && got);
        struct moe_engine *e = engine(m, NULL, NULL, 0);
        const size_t rows = run(e, m, ref, ref_tok);
        moe_engine_free(e);
        const struct config c30 = {"30%", 0.3, 0, false, false, NULL, false, false, NULL, NULL,
                                   NULL};
        for (int check = 1; check >= 0; check--) {
            setenv("MOE_CUDA_LINK_GBPS", "0.2", 1);
            if (!check)
                setenv("MOE_CUDA_LINK_CHECK", "0", 1);
            e = engine(m, &c30, NULL, 0);
            unsetenv("MOE_CUDA_LINK_GBPS");
            unsetenv("MOE_CUDA_LINK_CHECK");
            memset(got, 0xff, sizeof(float) * cap);
            CHECK_EQ(run(e, m, got, got_tok), rows);
            struct moe_offload_stats os;
            CHECK_EQ(moe_engine_offload_stats(e, &os, NULL), 0);
            struct moe_engine_info info;
            moe_engine_info(e, &info);
            size_t diff = floats_differing(got, ref, rows * (size_t)V);
            printf("  %-34s check %s: %llu misses, %.2f MiB filled, %llu from host, %llu prefetched, "
                   "%llu staged; %zu logits differ\n    %s\n",
                   strrchr(models[mi], '/') + 1, check ? "on " : "off",
                   (unsigned long long)os.misses, (double)os.fill_bytes / (1 << 20),
                   (unsigned long long)os.direct, (unsigned long long)os.prefetched,
                   (unsigned long long)os.staged, diff, info.desc);
            CHECK_EQ(diff, (size_t)0);
            CHECK(memcmp(got_tok, ref_tok, sizeof ref_tok) == 0);
            CHECK(os.misses > 0);
            if (check) {
                CHECK(strstr(info.desc, "copies lose") != NULL);
                CHECK_EQ(os.fill_bytes, (uint64_t)0);
                CHECK_EQ(os.prefetched, (uint64_t)0);
                CHECK_EQ(os.staged, (uint64_t)0);
                CHECK_EQ(os.direct, os.misses);
            } else {
                CHECK(strstr(info.desc, "copies lose") == NULL);
                CHECK(os.fill_bytes > 0);
            }
            moe_engine_free(e);
        }
        free(ref);
        free(got);
        test_model_close(&tm);
    }
}

/* A budget holds: with room for everything nothing is offloaded; with a residency under it the
 * device memory in use after a workload stays within it; one too small fails naming the
 * minimum. Offload needs a GPU. (Sizes near the tiny model's are below the allocation
 * granularity of the device; the 30B-shape model's budgets are measured in bench_offload.) */
TEST_TIMEOUT(cuda_offload_budget, 300)
{
    need_gpu_alone(); /* the budget counts the whole device */
    struct test_model tm;
    test_model_open(&tm, "models/kjv-demo-F16.gguf");
    const struct moe_model *m = &tm.m;
    const int64_t V = m->hp.n_vocab;
    struct moe_engine *e = engine(m, NULL, NULL, 0);
    struct moe_engine_info full;
    moe_engine_info(e, &full);
    moe_engine_free(e);

    const uint64_t budget = full.device_bytes + MOE_OFFLOAD_RESERVE + (32u << 20);
    e = engine(m, NULL, NULL, budget);
    struct moe_offload_stats os;
    CHECK_EQ(moe_engine_offload_stats(e, &os, NULL), 0);
    CHECK(!os.active);
    CHECK_EQ(os.budget, budget);
    moe_engine_free(e);

    const struct config half = {"50%", 0.5, 0, false, false, NULL, false, false, NULL, NULL,
                                NULL};
    e = engine(m, &half, NULL, budget);
    float *out = malloc(sizeof(float) * (size_t)(PROMPT + 2 * DECODE * N_SEQ) * (size_t)V);
    int32_t tok[DECODE * N_SEQ];
    CHECK(out != NULL);
    run(e, m, out, tok);
    CHECK_EQ(moe_engine_offload_stats(e, &os, NULL), 0);
    printf("  full run %.1f MiB; budget %.1f MiB at 50%%: %.1f MiB in use after the run, experts "
           "%.2f of %.2f MiB\n", (double)full.device_bytes / (1 << 20),
           (double)budget / (1 << 20), (double)os.device_bytes_now / (1 << 20),
           (double)os.expert_vram_bytes / (1 << 20), (double)os.expert_bytes / (1 << 20));
    CHECK(os.active);
    /* Device-wide, like the budget itself (another GPU test does not run meanwhile). */
    CHECK_MSG(os.device_bytes_now <= budget,
              "%.1f MiB in use on the device over the %.1f MiB budget (other processes count)",
              (double)os.device_bytes_now / (1 << 20), (double)budget / (1 << 20));
    CHECK(os.expert_vram_bytes < os.expert_bytes);
    free(out);
    moe_engine_free(e);

    struct moe_engine_opts o = {.n_ctx = 64, .n_seq = 1, .n_batch = 16, .device = "cuda:0",
                                .vram_budget = 64u << 20};
    char err[512] = "";
    CHECK(moe_engine_init(&e, m, &o, err, sizeof err) != 0);
    printf("  64 MiB: %s\n", err);
    CHECK(strstr(err, "the minimum is") != NULL);

    /* auto: the device's memory minus the margin; this model fits whole. */
    o.vram_budget = MOE_VRAM_AUTO;
    CHECK_MSG(moe_engine_init(&e, m, &o, err, sizeof err) == 0, "%s", err);
    CHECK_EQ(moe_engine_offload_stats(e, &os, NULL), 0);
    printf("  auto: a budget of %.2f GiB\n", (double)os.budget / (1 << 30));
    CHECK(os.budget > 0 && os.budget != MOE_VRAM_AUTO && !os.active);
    moe_engine_free(e);

    o.vram_budget = 0;
    o.expert_residency = 0.5;
    o.device = "cpu";
    CHECK(moe_engine_init(&e, m, &o, err, sizeof err) != 0);
    CHECK(strstr(err, "CUDA") != NULL);
    test_model_close(&tm);
}

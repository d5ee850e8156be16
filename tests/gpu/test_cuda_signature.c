/* Routing signatures and the pinned-expert bitmap on CUDA: a prompt's signature (each layer's
 * chosen experts copied on the device after its expert op, in recorded graphs and direct
 * launches, one-token steps included) equals what the routing counters gained over it, and
 * recording changes no logit; the bitmap holds each offloaded layer's pinned experts. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/workload.h"
#include "tests/engine_test.h"
#include "tests/gpu/gpu_test.h"

static const char *const MODELS[] = {
    GOLDEN "/models/tiny-qwen3moe-Q4_K_M.gguf",
    "models/kjv-demo-F16.gguf",
};

enum { PROMPT = 90, N_BATCH = 72 };

static struct moe_engine *sig_engine(const struct moe_model *m, double residency, bool record)
{
    /* Made-up routing counts, so that an offloaded layer pins some of its slots. */
    const size_t n = (size_t)m->hp.n_layer * m->hp.n_expert;
    uint64_t *counts = malloc(sizeof *counts * n);
    CHECK(counts);
    for (size_t i = 0; i < n; i++)
        counts[i] = (i * 2654435761u) % 1000;
    struct moe_engine_opts o = {.n_ctx = 256, .n_seq = 2, .n_batch = N_BATCH, .device = "cuda:0",
                                .expert_residency = residency, .record_routes = record,
                                .expert_counts = residency > 0 ? counts : NULL};
    struct moe_engine *e = NULL;
    char err[512] = "";
    CHECK_MSG(moe_engine_init(&e, m, &o, err, sizeof err) == 0, "%s", err);
    free(counts);
    return e;
}

/* Tokens [0, n) of sequence 0 from pos0 in one batch, every token into sig (NULL: not
 * recorded); the logits of every token to out. */
static void step(struct moe_engine *e, int32_t pos0, const int32_t *tok, int n, uint32_t *sig,
                 float *out)
{
    int32_t pos[N_BATCH], sq[N_BATCH] = {0};
    uint32_t *sp[N_BATCH];
    for (int i = 0; i < n; i++) {
        pos[i] = pos0 + i;
        sp[i] = sig;
    }
    struct moe_batch b = {.n = (uint32_t)n, .token = tok, .pos = pos, .seq = sq,
                          .sig = sig ? (uint32_t *const *)sp : NULL};
    CHECK_MSG(moe_engine_forward(e, &b, out) == 0, "%s", moe_engine_errmsg(e));
}

/* The prompt in a direct step (72 tokens) and a recorded one (18), then a one-token step (the
 * fused path's shape) and a decode token without a signature; twice, so that the second round
 * replays the graphs the first recorded. */
static void rounds(struct moe_engine *e, const struct moe_model *m, bool record, float *out)
{
    const int64_t V = m->hp.n_vocab;
    const size_t n = (size_t)m->hp.n_layer * m->hp.n_expert;
    uint64_t *before = calloc(n, 8), *after = calloc(n, 8);
    uint32_t *sig = calloc(n, 4);
    int32_t tok[PROMPT + 2];
    CHECK(before && after && sig);
    for (int i = 0; i < PROMPT + 2; i++)
        tok[i] = (int32_t)((i * 7919 + 13) % V);
    size_t rows = 0;
    for (int r = 0; r < 2; r++) {
        moe_engine_seq_clear(e, 0);
        CHECK_EQ(moe_engine_routing_counts(e, before), 0);
        memset(sig, 0, n * 4);
        step(e, 0, tok, N_BATCH, record ? sig : NULL, out + rows * V);
        rows += N_BATCH;
        step(e, N_BATCH, tok + N_BATCH, PROMPT - N_BATCH, record ? sig : NULL, out + rows * V);
        rows += PROMPT - N_BATCH;
        step(e, PROMPT, tok + PROMPT, 1, record ? sig : NULL, out + rows * V);
        rows += 1;
        CHECK_EQ(moe_engine_routing_counts(e, after), 0);
        for (size_t i = 0; record && i < n; i++)
            CHECK_MSG((uint64_t)sig[i] == after[i] - before[i], "round %d, [%zu]: %u, counters %llu",
                      r, i, sig[i], (unsigned long long)(after[i] - before[i]));
        step(e, PROMPT + 1, tok + PROMPT + 1, 1, NULL, out + rows * V);
        rows += 1;
    }
    free(before), free(after), free(sig);
}

TEST_TIMEOUT(cuda_route_signature_equals_the_routing_counts, 300)
{
    need_gpu();
    static const double residency[] = {0.0, 0.5, 0.3};
    for (size_t mi = 0; mi < sizeof MODELS / sizeof MODELS[0]; mi++) {
        struct test_model tm;
        test_model_open(&tm, MODELS[mi]);
        const size_t rows = 2 * (PROMPT + 2), V = tm.m.hp.n_vocab;
        float *a = malloc(sizeof(float) * rows * V), *b = malloc(sizeof(float) * rows * V);
        CHECK(a && b);
        for (size_t ri = 0; ri < sizeof residency / sizeof residency[0]; ri++) {
            struct moe_engine *e = sig_engine(&tm.m, residency[ri], false);
            rounds(e, &tm.m, false, a);
            moe_engine_free(e);
            e = sig_engine(&tm.m, residency[ri], true);
            rounds(e, &tm.m, true, b);
            moe_engine_free(e);
            CHECK_MSG(floats_differing(a, b, rows * V) == 0, "%s at %g: recording changed logits",
                      MODELS[mi], residency[ri]);
        }
        free(a), free(b);
        test_model_close(&tm);
    }
}

/* The bitmap: every expert of a layer held whole, the pinned ones of an offloaded layer (as
 * many as its pinned slots), none without offload (returns 0); after a live re-pinning by other
 * counts, the experts the daemon's plan expects a worker to pin from them (moe_wl_pinned_by). */
TEST_TIMEOUT(cuda_hot_experts_are_the_pinned_slots, 300)
{
    need_gpu();
    struct test_model tm;
    test_model_open(&tm, "models/kjv-demo-F16.gguf");
    const uint32_t L = tm.m.hp.n_layer, E = tm.m.hp.n_expert;
    uint8_t *bits = calloc(((size_t)L * E + 7) / 8, 1);
    struct moe_offload_layer *pl = calloc(L, sizeof *pl);
    CHECK(bits && pl);
    struct moe_engine *e = sig_engine(&tm.m, 0.0, false);
    CHECK_EQ(moe_engine_hot_experts(e, bits), 0);
    moe_engine_free(e);
    e = sig_engine(&tm.m, 0.5, false);
    struct moe_offload_stats st;
    CHECK_EQ(moe_engine_offload_stats(e, &st, pl), 0);
    CHECK(st.active);
    CHECK_EQ(moe_engine_hot_experts(e, bits), 1);
    uint32_t pinned = 0;
    for (uint32_t l = 0; l < L; l++) {
        uint32_t n = 0;
        for (uint32_t x = 0; x < E; x++)
            n += (bits[((size_t)l * E + x) / 8] >> (((size_t)l * E + x) % 8)) & 1;
        CHECK_EQ(n, pl[l].slots >= E ? E : pl[l].hot);
        pinned += pl[l].slots < E ? pl[l].hot : 0;
    }
    CHECK(pinned > 0);
    const size_t n = (size_t)L * E;
    uint64_t *c2 = malloc(sizeof *c2 * n);
    uint8_t *want = calloc((n + 7) / 8, 1);
    uint32_t *slots = malloc(sizeof *slots * L);
    CHECK(c2 && want && slots);
    for (size_t i = 0; i < n; i++)
        c2[i] = (i * 40503u) % 997 + 1;
    uint32_t pending = 0;
    for (int guard = 0; guard < 100; guard++) {
        CHECK_MSG(moe_engine_set_hot(e, c2, 8, &pending) == 0, "%s", moe_engine_errmsg(e));
        if (!pending)
            break;
    }
    CHECK_EQ(pending, 0);
    CHECK_EQ(moe_engine_offload_stats(e, &st, pl), 0);
    for (uint32_t l = 0; l < L; l++)
        slots[l] = pl[l].slots >= E ? E : pl[l].hot;
    moe_wl_pinned_by(L, E, slots, c2, want);
    CHECK_EQ(moe_engine_hot_experts(e, bits), 1);
    CHECK(memcmp(bits, want, (n + 7) / 8) == 0);
    free(c2), free(want), free(slots);
    moe_engine_free(e);
    free(bits), free(pl);
    test_model_close(&tm);
}

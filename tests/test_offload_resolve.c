/* The expert cache's per-step bookkeeping (worker/cuda/offload_resolve.h, the body of the CUDA
 * resolve kernel), run on the host over random routing: the state stays consistent, pinned
 * experts and this step's experts are never evicted, a miss always gets a slot when one is free,
 * the tables point where the state says, and the slots, filled by the queued copies, hold the
 * bytes of the expert they say they hold. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "tests/harness.h"
#include "worker/cuda/host_ranges.h"
#include "worker/cuda/offload_resolve.h"

struct sim {
    struct moe_cuda_off_layer L;
    int32_t *slot_of, *slot_exp, hand;
    uint8_t *ref, *pinned, *base, *hostmem;
    const void **host, **tab[3];
    uint32_t *bytes;
    struct moe_cuda_fill_list *fl;
    unsigned long long stats[MOE_OFF_NSTATS];
};

/* nexp experts of varying size (parts up to 700 bytes), S slots of which `hot` pinned; the
 * first S experts start in the slots (as init places them). */
static void sim_init(struct sim *m, int32_t nexp, int32_t S, int32_t hot)
{
    memset(m, 0, sizeof *m);
    m->slot_of = malloc(sizeof(int32_t) * (size_t)nexp);
    m->slot_exp = malloc(sizeof(int32_t) * (size_t)S + 4);
    m->ref = calloc((size_t)S + 1, 1);
    m->pinned = calloc((size_t)S + 1, 1);
    m->host = malloc(sizeof(void *) * 3 * (size_t)nexp);
    m->bytes = malloc(sizeof(uint32_t) * 3 * (size_t)nexp);
    for (int p = 0; p < 3; p++)
        m->tab[p] = malloc(sizeof(void *) * (size_t)nexp);
    m->fl = malloc(sizeof *m->fl + sizeof(struct moe_cuda_fill) * 3 * (size_t)(S + 1));
    const uint32_t part_max = 704;
    m->L.part_off[0] = 0;
    m->L.part_off[1] = part_max;
    m->L.part_off[2] = 2 * part_max;
    m->L.slot_bytes = 3 * part_max;
    m->base = malloc((size_t)S * m->L.slot_bytes + 1);
    m->hostmem = malloc((size_t)nexp * 3 * part_max);
    CHECK(m->slot_of && m->slot_exp && m->ref && m->pinned && m->host && m->bytes && m->fl &&
          m->base && m->hostmem && m->tab[0] && m->tab[1] && m->tab[2]);
    for (size_t i = 0; i < (size_t)nexp * 3 * part_max; i++)
        m->hostmem[i] = (uint8_t)moe_test_rng_u32();
    memset(m->base, 0xee, (size_t)S * m->L.slot_bytes);
    for (int32_t e = 0; e < nexp; e++)
        for (int p = 0; p < 3; p++) {
            m->bytes[p * nexp + e] = 100 + moe_test_rng_u32() % (part_max - 100);
            m->host[p * nexp + e] = m->hostmem + ((size_t)e * 3 + (size_t)p) * part_max;
        }
    for (int32_t s = 0; s < S; s++) {
        m->slot_exp[s] = s;
        m->pinned[s] = s < hot;
    }
    for (int32_t e = 0; e < nexp; e++) {
        m->slot_of[e] = e < S ? e : MOE_OFF_HOST;
        for (int p = 0; p < 3; p++) {
            uint8_t *dst = m->base + (size_t)e * m->L.slot_bytes + m->L.part_off[p];
            if (e < S)
                memcpy(dst, m->host[p * nexp + e], m->bytes[p * nexp + e]);
            m->tab[p][e] = e < S ? dst : m->host[p * nexp + e];
        }
    }
    m->hand = hot < S ? hot : 0;
    m->L.nexp = nexp;
    m->L.slots = S;
    m->L.base = m->base;
    m->L.host = m->host;
    m->L.bytes = m->bytes;
    for (int p = 0; p < 3; p++)
        m->L.tab[p] = m->tab[p];
}

static void sim_free(struct sim *m)
{
    free(m->slot_of), free(m->slot_exp), free(m->ref), free(m->pinned), free(m->host);
    free(m->bytes), free(m->fl), free(m->base), free(m->hostmem);
    for (int p = 0; p < 3; p++)
        free(m->tab[p]);
}

/* What the fill kernel does, chunk by chunk. */
static void sim_fill(struct sim *m)
{
    uint32_t chunks = 0;
    for (int32_t j = 0; j < m->fl->n; j++) {
        const struct moe_cuda_fill *f = &m->fl->job[j];
        CHECK_EQ(f->chunk0, chunks);
        chunks += (f->bytes + MOE_OFF_CHUNK - 1) / MOE_OFF_CHUNK;
        memcpy(f->dst, f->src, f->bytes);
    }
    CHECK_EQ((uint32_t)m->fl->n_chunks, chunks);
}

static void check_state(const struct sim *m)
{
    const int32_t ne = m->L.nexp, S = m->L.slots;
    for (int32_t s = 0; s < S; s++) {
        const int32_t e = m->slot_exp[s];
        if (e >= 0)
            CHECK_EQ(m->slot_of[e], s);
    }
    for (int32_t e = 0; e < ne; e++) {
        const int32_t s = m->slot_of[e];
        for (int p = 0; p < 3; p++) {
            if (s >= 0) {
                CHECK_EQ(m->slot_exp[s], e);
                const uint8_t *at = m->base + (size_t)s * m->L.slot_bytes + m->L.part_off[p];
                CHECK(m->tab[p][e] == at);
                CHECK(memcmp(at, m->host[p * ne + e], m->bytes[p * ne + e]) == 0);
            } else {
                CHECK_EQ(s, MOE_OFF_HOST);
                CHECK(m->tab[p][e] == m->host[p * ne + e]);
            }
        }
    }
}

/* A copy of a sim's cache state (prefetch flags too, when L.pf is set), clock hand, counters and
 * tables, to run a step twice from the same state and compare the two results. */
struct sim_snap {
    int32_t *slot_of, *slot_exp, hand;
    uint8_t *ref, *pf;
    const void **tab;
    unsigned long long stats[MOE_OFF_NSTATS];
};

static void sim_snap_init(struct sim_snap *c, const struct sim *m)
{
    const size_t ne = (size_t)m->L.nexp, S = (size_t)m->L.slots;
    c->slot_of = malloc(sizeof(int32_t) * ne);
    c->slot_exp = malloc(sizeof(int32_t) * S + 4);
    c->ref = malloc(S + 1);
    c->pf = malloc(S + 1);
    c->tab = malloc(sizeof(void *) * 3 * ne);
    CHECK(c->slot_of && c->slot_exp && c->ref && c->pf && c->tab);
}

static void sim_snap_free(struct sim_snap *c)
{
    free(c->slot_of), free(c->slot_exp), free(c->ref), free(c->pf), free(c->tab);
}

static void sim_snap_take(struct sim_snap *c, const struct sim *m)
{
    const size_t ne = (size_t)m->L.nexp, S = (size_t)m->L.slots;
    memcpy(c->slot_of, m->slot_of, sizeof(int32_t) * ne);
    memcpy(c->slot_exp, m->slot_exp, sizeof(int32_t) * S);
    memcpy(c->ref, m->ref, S);
    if (m->L.pf)
        memcpy(c->pf, m->L.pf, S);
    c->hand = m->hand;
    memcpy(c->stats, m->stats, sizeof c->stats);
    for (int p = 0; p < 3; p++)
        memcpy(c->tab + (size_t)p * ne, m->tab[p], sizeof(void *) * ne);
}

static void sim_snap_put(const struct sim_snap *c, struct sim *m)
{
    const size_t ne = (size_t)m->L.nexp, S = (size_t)m->L.slots;
    memcpy(m->slot_of, c->slot_of, sizeof(int32_t) * ne);
    memcpy(m->slot_exp, c->slot_exp, sizeof(int32_t) * S);
    memcpy(m->ref, c->ref, S);
    if (m->L.pf)
        memcpy(m->L.pf, c->pf, S);
    m->hand = c->hand;
    memcpy(m->stats, c->stats, sizeof c->stats);
    for (int p = 0; p < 3; p++)
        memcpy(m->tab[p], c->tab + (size_t)p * ne, sizeof(void *) * ne);
}

/* The sim holds what the snapshot holds. */
static void sim_snap_check(const struct sim_snap *c, const struct sim *m)
{
    const size_t ne = (size_t)m->L.nexp, S = (size_t)m->L.slots;
    CHECK(memcmp(c->slot_of, m->slot_of, sizeof(int32_t) * ne) == 0);
    CHECK(memcmp(c->slot_exp, m->slot_exp, sizeof(int32_t) * S) == 0);
    CHECK(memcmp(c->ref, m->ref, S) == 0);
    if (m->L.pf)
        CHECK(memcmp(c->pf, m->L.pf, S) == 0);
    CHECK_EQ(c->hand, m->hand);
    CHECK(memcmp(c->stats, m->stats, sizeof c->stats) == 0);
    for (int p = 0; p < 3; p++)
        CHECK(memcmp(c->tab + (size_t)p * ne, m->tab[p], sizeof(void *) * ne) == 0);
}

/* need[] cleared, then k random choices marked (some may repeat): uniform when skew is 0; else
 * r·r/ne for a uniform r (low ids more often), always when skew is 1, otherwise unless a draw
 * of 0..skew-1 gives 0. */
static void random_need(uint8_t *need, int32_t ne, int32_t k, uint32_t skew)
{
    memset(need, 0, (size_t)ne);
    for (int32_t i = 0; i < k; i++) {
        const uint32_t r = moe_test_rng_u32() % (uint32_t)ne;
        const bool sk = skew == 1 || (skew > 1 && moe_test_rng_u32() % skew);
        need[sk ? r * r / (uint32_t)ne : r] = 1;
    }
}

TEST(offload_resolve_keeps_the_cache_consistent)
{
    static const int32_t shapes[][4] = {
        /* nexp, slots, pinned, chosen per step (up to) */
        {16, 6, 2, 4}, {16, 4, 0, 4}, {16, 4, 4, 4}, {16, 5, 4, 8}, {128, 77, 19, 8},
        {128, 32, 0, 64}, {128, 127, 0, 40}, {32, 8, 7, 16}, {8, 1, 0, 3},
    };
    moe_test_rng_seed(20261201);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int32_t ne = shapes[si][0], S = shapes[si][1], hot = shapes[si][2],
                      kmax = shapes[si][3];
        struct sim m;
        sim_init(&m, ne, S, hot);
        check_state(&m);
        int32_t *pinned_exp = malloc(sizeof(int32_t) * (size_t)S + 4);
        int32_t *before = malloc(sizeof(int32_t) * (size_t)ne);
        uint8_t *need = malloc((size_t)ne);
        CHECK(pinned_exp && before && need);
        memcpy(pinned_exp, m.slot_exp, sizeof(int32_t) * (size_t)S);
        unsigned long long fills = 0;
        for (int step = 0; step < 400; step++) {
            /* Skewed choices: low expert ids more often, some steps wide (a prompt chunk). */
            random_need(need, ne, 1 + (int32_t)(moe_test_rng_u32() % (uint32_t)kmax), 3);
            int32_t uniq = 0, had_slot = 0, free_unpinned = 0;
            for (int32_t e = 0; e < ne; e++) {
                uniq += need[e];
                had_slot += need[e] && m.slot_of[e] >= 0;
            }
            for (int32_t s = 0; s < S; s++)
                free_unpinned += !m.pinned[s] && (m.slot_exp[s] < 0 || !need[m.slot_exp[s]]);
            memcpy(before, m.slot_of, sizeof(int32_t) * (size_t)ne);
            unsigned long long st0[MOE_OFF_NSTATS];
            memcpy(st0, m.stats, sizeof st0);
            moe_off_resolve(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl,
                            m.stats);
            sim_fill(&m);
            check_state(&m);
            const unsigned long long hits = m.stats[MOE_OFF_HITS] - st0[MOE_OFF_HITS],
                                     misses = m.stats[MOE_OFF_MISSES] - st0[MOE_OFF_MISSES],
                                     direct = m.stats[MOE_OFF_DIRECT] - st0[MOE_OFF_DIRECT];
            CHECK_EQ(hits + misses, (unsigned long long)uniq);
            CHECK_EQ(hits, (unsigned long long)had_slot);
            CHECK_EQ((unsigned long long)m.fl->n, 3 * (misses - direct));
            /* A miss finds a slot whenever an unpinned slot not used by this step exists: all
             * misses are placed, or every such slot was taken by one of them. */
            const unsigned long long placed = misses - direct;
            CHECK(direct == 0 || placed == (unsigned long long)free_unpinned);
            fills += placed;
            for (int32_t e = 0; e < ne; e++)
                if (need[e] && before[e] >= 0)
                    CHECK_EQ(m.slot_of[e], before[e]); /* this step's experts stay put */
            for (int32_t s = 0; s < hot; s++)
                CHECK_EQ(m.slot_exp[s], pinned_exp[s]); /* hot experts never move */
            CHECK(m.hand >= 0 && (S == 0 || m.hand < S));
        }
        CHECK_EQ(m.stats[MOE_OFF_FILL_BYTES] > 0, fills > 0);
        CHECK(hot < S || fills == 0);
        CHECK_MSG(m.stats[MOE_OFF_MISSES] > 0, "shape %zu: %llu hits, no misses", si,
                  m.stats[MOE_OFF_HITS]);
        free(pinned_exp), free(before), free(need);
        sim_free(&m);
    }
}

/* With L.fsrc (the expert kernels copying as they go, instead of the fill kernel): a layer's own
 * resolve lists, for each expert whose copies it queued, exactly those copies' sources, and
 * nothing else; copying by that list alone (source to the tables' destinations) leaves the
 * slots as the fill kernel would. A prefetch lists nothing (its copies stay the fill's). */
TEST(offload_resolve_lists_the_copies_the_expert_kernels_make)
{
    static const int32_t shapes[][4] = {{16, 6, 2, 4}, {128, 77, 19, 8}, {32, 8, 7, 16}};
    moe_test_rng_seed(20261202);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int32_t ne = shapes[si][0], S = shapes[si][1], hot = shapes[si][2],
                      kmax = shapes[si][3];
        struct sim m;
        sim_init(&m, ne, S, hot);
        const void **fsrc = calloc(3 * (size_t)ne, sizeof(void *));
        uint8_t *need = malloc((size_t)ne);
        CHECK(fsrc && need);
        m.L.fsrc = fsrc;
        unsigned long long listed = 0;
        for (int step = 0; step < 300; step++) {
            random_need(need, ne, 1 + (int32_t)(moe_test_rng_u32() % (uint32_t)kmax), 0);
            const int prefetch = step % 4 == 3;
            memset(fsrc, 0, 3 * (size_t)ne * sizeof(void *)); /* what the resolve kernel does */
            moe_off_resolve_mode(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand,
                                 m.fl, m.stats, prefetch);
            int32_t nlisted = 0;
            for (int32_t e = 0; e < ne; e++)
                for (int p = 0; p < 3; p++) {
                    const void *src = fsrc[p * ne + e];
                    if (!src)
                        continue;
                    CHECK(!prefetch);
                    CHECK(need[e] && m.slot_of[e] >= 0);
                    CHECK(src == m.host[p * ne + e]);
                    nlisted++;
                    /* The kernel's copy: from the listed source to where the table points. */
                    memcpy((void *)m.tab[p][e], src, m.bytes[p * ne + e]);
                }
            if (prefetch)
                sim_fill(&m); /* a prefetch's copies are the fill kernel's */
            else
                CHECK_EQ(nlisted, m.fl->n); /* one listed source per queued copy */
            listed += (unsigned long long)nlisted;
            check_state(&m);
        }
        CHECK_MSG(listed > 0, "shape %zu: no copies listed", si);
        free(fsrc), free(need);
        sim_free(&m);
    }
}

/* The resolve kernel's order (offload_resolve.h): every hit first, in any order (here from the
 * last expert down), then the misses in expert order, gives the state, copies and counters of
 * moe_off_resolve_mode's single walk. */
TEST(offload_resolve_hits_first_equal_the_walk)
{
    static const int32_t shapes[][4] = {{16, 6, 2, 6}, {128, 77, 19, 8}, {128, 32, 0, 64},
                                        {32, 8, 7, 16}, {8, 1, 0, 3}};
    moe_test_rng_seed(4242);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int32_t ne = shapes[si][0], S = shapes[si][1], hot = shapes[si][2],
                      kmax = shapes[si][3];
        struct sim m;
        sim_init(&m, ne, S, hot);
        const size_t flb = sizeof *m.fl + sizeof(struct moe_cuda_fill) * 3 * (size_t)(S + 1);
        uint8_t *need = malloc((size_t)ne), *pf = calloc((size_t)S + 1, 1);
        struct moe_cuda_fill_list *fa = malloc(flb);
        CHECK(need && fa && pf);
        m.L.pf = pf;
        struct sim_snap before, walked;
        sim_snap_init(&before, &m);
        sim_snap_init(&walked, &m);
        for (int step = 0; step < 300; step++) {
            random_need(need, ne, 1 + (int32_t)(moe_test_rng_u32() % (uint32_t)kmax), 2);
            const int prefetch = step % 5 == 4;
            /* The state before, kept to run the step twice. */
            sim_snap_take(&before, &m);
            moe_off_resolve_mode(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand,
                                 m.fl, m.stats, prefetch);
            memcpy(fa, m.fl, flb);
            sim_snap_take(&walked, &m);
            /* Again from the same state, hits first. */
            sim_snap_put(&before, &m);
            struct moe_off_walk w;
            moe_off_walk_begin(&m.L, &m.hand, &w);
            for (int32_t e = ne - 1; e >= 0; e--)
                moe_off_count_hit(&m.L, e, moe_off_hit(e, need, m.slot_of, m.ref, m.L.pf, prefetch),
                                  &w);
            for (int32_t e = 0; e < ne; e++)
                if (need[e] && m.slot_of[e] < 0)
                    moe_off_miss(&m.L, e, need, m.slot_of, m.slot_exp, m.ref, m.pinned, m.L.pf,
                                 m.fl, prefetch, &w);
            moe_off_walk_end(&m.L, &w, &m.hand, m.fl, m.stats, prefetch);
            sim_snap_check(&walked, &m);
            CHECK_EQ(fa->n, m.fl->n);
            CHECK_EQ(fa->n_chunks, m.fl->n_chunks);
            CHECK(memcmp(fa->job, m.fl->job, sizeof(struct moe_cuda_fill) * (size_t)fa->n) == 0);
            sim_fill(&m);
            check_state(&m);
        }
        sim_snap_free(&before);
        sim_snap_free(&walked);
        free(need), free(fa), free(pf);
        sim_free(&m);
    }
}

/* The resolve kernel's fast path (moe_off_fast_hit / moe_off_fast_end, a step whose chosen
 * experts all have a slot, repeats among the choices, prefetched experts among them) leaves the
 * state, the counters and the copies list as the walk does, and the chosen experts' copy
 * sources cleared. Steps with a miss run the walk, so the state evolves as it does in a run. */
TEST(offload_resolve_fast_path_equals_the_walk)
{
    static const int32_t shapes[][4] = {{128, 96, 40, 8}, {128, 77, 19, 16}, {16, 12, 0, 4},
                                        {64, 64, 8, 8}};
    moe_test_rng_seed(77);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int32_t ne = shapes[si][0], S = shapes[si][1], hot = shapes[si][2],
                      kmax = shapes[si][3];
        struct sim m;
        sim_init(&m, ne, S, hot);
        uint8_t *pf = calloc((size_t)S, 1), *need = malloc((size_t)ne);
        const void **fsrc = malloc(sizeof(void *) * 3 * (size_t)ne);
        int32_t *sel = malloc(sizeof(int32_t) * (size_t)kmax);
        CHECK(pf && need && fsrc && sel);
        m.L.pf = pf;
        struct sim_snap before, fast;
        sim_snap_init(&before, &m);
        sim_snap_init(&fast, &m);
        int fast_steps = 0, with_pf = 0;
        for (int step = 0; step < 400; step++) {
            const int32_t k = 1 + (int32_t)(moe_test_rng_u32() % (uint32_t)kmax);
            /* Mostly experts that have a slot, so that most steps hit throughout. */
            memset(need, 0, (size_t)(uint32_t)ne);
            for (int32_t i = 0; i < k; i++) {
                int32_t e = (int32_t)(moe_test_rng_u32() % (uint32_t)ne);
                if (moe_test_rng_u32() % 8 && S > 0)
                    e = m.slot_exp[moe_test_rng_u32() % (uint32_t)S];
                sel[i] = e < 0 ? 0 : e;
                need[sel[i]] = 1;
            }
            if (step % 7 == 3) { /* a prediction places experts ahead (pf flags) */
                uint8_t *pn = malloc((size_t)ne);
                CHECK(pn);
                random_need(pn, ne, kmax, 0);
                m.L.fsrc = NULL;
                moe_off_resolve_mode(&m.L, pn, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand,
                                     m.fl, m.stats, 1);
                sim_fill(&m);
                free(pn);
            }
            bool all_hit = true;
            for (int32_t i = 0; i < k; i++)
                all_hit = all_hit && m.slot_of[sel[i]] >= 0;
            sim_snap_take(&before, &m);
            if (all_hit) {
                fast_steps++;
                for (int32_t i = 0; i < 3 * ne; i++)
                    fsrc[i] = &m; /* stale sources of an earlier step */
                m.L.fsrc = fsrc;
                struct moe_off_walk w;
                memset(&w, 0, sizeof w);
                for (int32_t i = 0; i < k; i++) {
                    bool first = true;
                    for (int32_t j = 0; j < i; j++)
                        first = first && sel[j] != sel[i];
                    if (first)
                        moe_off_fast_hit(&m.L, sel[i], m.slot_of[sel[i]], m.ref, pf, &w);
                }
                with_pf += w.pf_used > 0;
                moe_off_fast_end(&w, m.fl, m.stats);
                for (int32_t i = 0; i < k; i++)
                    for (int p = 0; p < 3; p++)
                        CHECK(fsrc[p * ne + sel[i]] == NULL);
                const int fl_n = m.fl->n, fl_c = m.fl->n_chunks;
                sim_snap_take(&fast, &m);
                CHECK(memcmp(before.slot_exp, m.slot_exp, sizeof(int32_t) * (size_t)S) == 0);
                CHECK_EQ(m.hand, before.hand);
                /* The walk from the same state. */
                sim_snap_put(&before, &m);
                for (int32_t i = 0; i < 3 * ne; i++)
                    fsrc[i] = NULL;
                m.fl->n = -1;
                moe_off_resolve_mode(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand,
                                     m.fl, m.stats, 0);
                sim_snap_check(&fast, &m);
                CHECK_EQ(m.fl->n, fl_n);
                CHECK_EQ(m.fl->n_chunks, fl_c);
                for (int32_t i = 0; i < 3 * ne; i++)
                    CHECK(fsrc[i] == NULL); /* nothing to copy */
            } else {
                m.L.fsrc = NULL;
                moe_off_resolve_mode(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand,
                                     m.fl, m.stats, 0);
                sim_fill(&m);
            }
            check_state(&m);
        }
        CHECK(fast_steps > 100);
        if (S < ne)
            CHECK(with_pf > 0);
        m.L.fsrc = NULL;
        m.L.pf = NULL;
        sim_snap_free(&before);
        sim_snap_free(&fast);
        free(pf), free(need), free(fsrc), free(sel);
        sim_free(&m);
    }
}

/* Prefetch accounting (L.pf): a prefetched expert that its layer's own lookup then finds is
 * used once (with its bytes); one evicted before that is wasted; a prediction finding it again
 * counts nothing. Over random traffic, every prefetched expert ends up used, wasted or still
 * waiting in its slot. */
TEST(offload_prefetch_used_and_wasted_are_counted)
{
    moe_test_rng_seed(77);
    struct sim m;
    sim_init(&m, 8, 2, 0); /* experts 0 and 1 cached in the two slots */
    uint8_t pf[3] = {0}, need[8] = {0};
    m.L.pf = pf;
    need[5] = 1;
    moe_off_resolve_mode(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl,
                         m.stats, 1); /* predicted: 5 copied ahead */
    sim_fill(&m);
    CHECK_EQ(m.stats[MOE_OFF_PREFETCH], 1ull);
    CHECK(m.slot_of[5] >= 0 && pf[m.slot_of[5]] == 1);
    moe_off_resolve_mode(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl,
                         m.stats, 1); /* predicted again: nothing counted */
    CHECK_EQ(m.stats[MOE_OFF_PF_USED], 0ull);
    moe_off_resolve(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl, m.stats);
    CHECK_EQ(m.stats[MOE_OFF_PF_USED], 1ull);
    CHECK_EQ(m.stats[MOE_OFF_PF_USED_BYTES], (unsigned long long)(m.bytes[5] + m.bytes[8 + 5] +
                                                                  m.bytes[16 + 5]));
    CHECK_EQ(m.stats[MOE_OFF_HITS], 1ull);
    moe_off_resolve(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl, m.stats);
    CHECK_EQ(m.stats[MOE_OFF_PF_USED], 1ull); /* once */
    /* Predicted 6, then two steps choosing others evict it unused. */
    memset(need, 0, sizeof need);
    need[6] = 1;
    moe_off_resolve_mode(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl,
                         m.stats, 1);
    sim_fill(&m);
    CHECK(m.slot_of[6] >= 0);
    memset(need, 0, sizeof need);
    need[2] = need[3] = 1;
    moe_off_resolve(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl, m.stats);
    sim_fill(&m);
    CHECK_EQ(m.slot_of[6], MOE_OFF_HOST);
    CHECK_EQ(m.stats[MOE_OFF_PF_WASTED], 1ull);
    check_state(&m);
    sim_free(&m);

    static const int32_t shapes[][3] = {{16, 6, 2}, {128, 40, 8}, {32, 8, 0}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int32_t ne = shapes[si][0], S = shapes[si][1], hot = shapes[si][2];
        sim_init(&m, ne, S, hot);
        uint8_t *fl = calloc((size_t)S + 1, 1), *nd = malloc((size_t)ne);
        CHECK(fl && nd);
        m.L.pf = fl;
        for (int step = 0; step < 400; step++) {
            random_need(nd, ne, 4, 1);
            moe_off_resolve_mode(&m.L, nd, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl,
                                 m.stats, step % 2 == 0);
            sim_fill(&m);
            unsigned long long waiting = 0;
            for (int32_t sl = 0; sl < S; sl++)
                waiting += fl[sl];
            CHECK_EQ(m.stats[MOE_OFF_PF_USED] + m.stats[MOE_OFF_PF_WASTED] + waiting,
                     m.stats[MOE_OFF_PREFETCH]);
        }
        CHECK(m.stats[MOE_OFF_PF_USED] > 0);
        CHECK(hot == S || m.stats[MOE_OFF_PF_WASTED] > 0);
        check_state(&m);
        free(fl), free(nd);
        sim_free(&m);
    }
}

/* The clock gives recently used experts a second chance: with one cold expert among the
 * cached ones, a miss evicts the cold one. */
TEST(offload_resolve_evicts_the_unreferenced_slot)
{
    struct sim m;
    moe_test_rng_seed(7);
    sim_init(&m, 8, 3, 0); /* experts 0, 1, 2 cached */
    uint8_t need[8] = {0};
    need[0] = need[1] = 1; /* hits: both get their reference bit */
    moe_off_resolve(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl, m.stats);
    CHECK_EQ(m.fl->n, 0);
    memset(need, 0, sizeof need);
    need[5] = 1; /* a miss: 0 and 1 were referenced, 2 was not */
    moe_off_resolve(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl, m.stats);
    sim_fill(&m);
    CHECK_EQ(m.slot_of[2], MOE_OFF_HOST);
    CHECK_EQ(m.slot_of[5], 2);
    CHECK(m.slot_of[0] == 0 && m.slot_of[1] == 1);
    check_state(&m);
    CHECK_EQ(m.stats[MOE_OFF_HITS], 2ull);
    CHECK_EQ(m.stats[MOE_OFF_MISSES], 1ull);
    sim_free(&m);
}

/* Re-pinning between steps: the wanted experts end up pinned in slots (all at once, or over
 * several calls when the loads per call are limited), nothing else stays pinned, the moves are
 * the ones needed, and the state stays consistent with the tables and slot contents once the
 * caller has carried the moves out. */
TEST(offload_repin_pins_the_wanted_experts)
{
    moe_test_rng_seed(99);
    static const int32_t shapes[][3] = {{16, 6, 2}, {16, 6, 0}, {128, 77, 19}, {32, 8, 8},
                                        {8, 1, 1}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int32_t ne = shapes[si][0], S = shapes[si][1], hot = shapes[si][2];
        struct sim m;
        sim_init(&m, ne, S, hot);
        int32_t *want = malloc(sizeof(int32_t) * (size_t)(ne + 4));
        uint8_t *scratch = malloc((size_t)ne), *need = calloc((size_t)ne, 1);
        struct moe_off_load *loads = malloc(sizeof *loads * (size_t)(S + 1));
        CHECK(want && scratch && need && loads);
        for (int round = 0; round < 60; round++) {
            /* Some cache traffic first, so that slots hold assorted experts. */
            for (int step = 0; step < 5; step++) {
                memset(need, 0, (size_t)(uint32_t)ne);
                for (int i = 0; i < 3; i++)
                    need[moe_test_rng_u32() % (uint32_t)ne] = 1;
                moe_off_resolve(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand,
                                m.fl, m.stats);
                sim_fill(&m);
            }
            /* A wanted list with a duplicate and an id out of range. */
            int32_t nw = (int32_t)(moe_test_rng_u32() % (uint32_t)(S + 2));
            for (int32_t i = 0; i < nw; i++)
                want[i] = (int32_t)(moe_test_rng_u32() % (uint32_t)ne);
            want[nw++] = ne + 3;
            if (nw > 1)
                want[nw++] = want[0];
            const int32_t max_loads = round % 3 == 0 ? 1 : 1 << 20;
            int32_t pending, calls = 0;
            do {
                int32_t nl = 0;
                pending = moe_off_repin(ne, S, m.slot_of, m.slot_exp, m.pinned, m.ref, want, nw,
                                        max_loads, loads, &nl, scratch);
                CHECK(nl <= max_loads);
                for (int32_t i = 0; i < nl; i++) { /* what the backend does for each move */
                    const struct moe_off_load *ld = &loads[i];
                    CHECK(ld->s >= 0 && ld->s < S && m.slot_of[ld->x] == ld->s);
                    for (int p = 0; p < 3; p++) {
                        uint8_t *at = m.base + (size_t)ld->s * m.L.slot_bytes + m.L.part_off[p];
                        if (ld->old >= 0)
                            m.tab[p][ld->old] = m.host[p * ne + ld->old];
                        memcpy(at, m.host[p * ne + ld->x], m.bytes[p * ne + ld->x]);
                        m.tab[p][ld->x] = at;
                    }
                }
                check_state(&m);
                CHECK(++calls < 1000);
            } while (pending);
            /* Exactly the first `slots` distinct valid wanted experts are pinned. */
            memset(need, 0, (size_t)(uint32_t)ne);
            int32_t distinct = 0;
            for (int32_t i = 0; i < nw && distinct < S; i++)
                if (want[i] >= 0 && want[i] < ne && !need[want[i]]) {
                    need[want[i]] = 1;
                    distinct++;
                }
            int32_t n_pinned = 0;
            for (int32_t s = 0; s < S; s++)
                if (m.pinned[s]) {
                    n_pinned++;
                    CHECK(m.slot_exp[s] >= 0 && need[m.slot_exp[s]]);
                }
            CHECK_EQ(n_pinned, distinct);
            for (int32_t x = 0; x < ne; x++)
                if (need[x])
                    CHECK(m.slot_of[x] >= 0 && m.pinned[m.slot_of[x]]);
            /* Pinned experts survive later cache traffic. */
            for (int step = 0; step < 5; step++) {
                memset(need, 0, (size_t)(uint32_t)ne);
                for (int i = 0; i < 3; i++)
                    need[moe_test_rng_u32() % (uint32_t)ne] = 1;
                int32_t before[256];
                for (int32_t s = 0; s < S; s++)
                    before[s] = m.pinned[s] ? m.slot_exp[s] : -2;
                moe_off_resolve(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand,
                                m.fl, m.stats);
                sim_fill(&m);
                for (int32_t s = 0; s < S; s++)
                    if (before[s] != -2)
                        CHECK_EQ(m.slot_exp[s], before[s]);
            }
            check_state(&m);
        }
        free(want), free(scratch), free(need), free(loads);
        sim_free(&m);
    }
}

/* The cache rule: a setting wins (capped at S), no ring with -1, every slot cache without a
 * profile, with one a quarter of S but at least 2k. */
TEST(offload_cache_rule)
{
    CHECK_EQ(moe_off_cache_slots(38, 128, 8, 0, 1), 16);
    CHECK_EQ(moe_off_cache_slots(100, 128, 8, 0, 1), 25);
    CHECK_EQ(moe_off_cache_slots(9, 16, 4, 0, 1), 8);
    CHECK_EQ(moe_off_cache_slots(6, 16, 4, 0, 1), 6);
    CHECK_EQ(moe_off_cache_slots(6, 16, 4, 0, 0), 6);
    CHECK_EQ(moe_off_cache_slots(77, 128, 8, 0, 0), 77);
    CHECK_EQ(moe_off_cache_slots(77, 128, 8, -1, 1), 0);
    CHECK_EQ(moe_off_cache_slots(77, 128, 8, 3, 0), 3);
    CHECK_EQ(moe_off_cache_slots(2, 128, 8, 3, 1), 2);
    CHECK_EQ(moe_off_cache_slots(5, 4, 8, 0, 1), 5); /* k above the expert count */
}

/* The registration chunks (worker/cuda/host_ranges.h) over random tensor layouts: every tensor
 * lies inside exactly one chunk, chunks are page-aligned, disjoint and sorted, and none is
 * larger than its limit unless one tensor alone is. */
TEST(offload_registration_chunks_keep_tensors_whole)
{
    moe_test_rng_seed(77);
    const uintptr_t pg = 4096, first = 64 * pg, step = 256 * pg, gap = 16 * pg;
    enum { N = 700 };
    static uintptr_t ta[N], tb[N];
    static struct reg_range r[N];
    for (int round = 0; round < 40; round++) {
        uintptr_t at = 1u << 20;
        for (int i = 0; i < N; i++) {
            at += moe_test_rng_u32() % 5 == 0 ? moe_test_rng_u32() % (40 * pg) : moe_test_rng_u32() % 64;
            const uintptr_t len = 1 + (moe_test_rng_u32() % 9 == 0 ? moe_test_rng_u32() % (300 * pg)
                                                                   : moe_test_rng_u32() % (3 * pg));
            ta[i] = at;
            tb[i] = at + len;
            at += len;
        }
        for (int i = 0; i < N; i++) { /* shuffled, as the caller may add them */
            int j = (int)(moe_test_rng_u32() % N);
            uintptr_t x = ta[i], y = tb[i];
            ta[i] = ta[j], tb[i] = tb[j], ta[j] = x, tb[j] = y;
        }
        for (int i = 0; i < N; i++)
            r[i] = (struct reg_range){ta[i] & ~(pg - 1), (tb[i] + pg - 1) & ~(pg - 1)};
        const size_t k = moe_reg_plan(r, N, first, step, gap);
        CHECK(k >= 1 && k <= N);
        for (size_t c = 0; c < k; c++) {
            CHECK(r[c].a % pg == 0 && r[c].b % pg == 0 && r[c].a < r[c].b);
            if (c)
                CHECK(r[c].a >= r[c - 1].b);
        }
        for (int i = 0; i < N; i++) {
            int in = 0;
            for (size_t c = 0; c < k; c++)
                in += ta[i] >= r[c].a && tb[i] <= r[c].b;
            CHECK_EQ(in, 1);
        }
        /* A chunk over its limit holds a tensor that overlaps the part past the limit. */
        for (size_t c = 0; c < k; c++) {
            const uintptr_t lim = c == 0 ? first : step;
            if (r[c].b - r[c].a <= lim)
                continue;
            int big = 0;
            for (int i = 0; i < N && !big; i++)
                big = ta[i] >= r[c].a && tb[i] <= r[c].b && tb[i] > r[c].a + lim;
            CHECK(big);
        }
    }
}

/* Prefetch mode: predicted experts are placed and copied like misses, but nothing counts as a
 * hit, miss or direct read; the layer's own resolve then finds them (hits, nothing to copy). A
 * prediction with no free slot is dropped, not read from host. */
TEST(offload_prefetch_places_without_counting)
{
    struct sim m;
    moe_test_rng_seed(11);
    sim_init(&m, 16, 4, 1); /* experts 0..3 in slots, 0 pinned */
    uint8_t need[16] = {0};
    need[0] = need[7] = need[9] = 1;
    moe_off_resolve_mode(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl,
                         m.stats, 1);
    sim_fill(&m);
    check_state(&m);
    CHECK(m.slot_of[7] >= 0 && m.slot_of[9] >= 0 && m.slot_of[0] == 0);
    CHECK_EQ(m.stats[MOE_OFF_HITS] + m.stats[MOE_OFF_MISSES] + m.stats[MOE_OFF_DIRECT], 0ull);
    CHECK_EQ(m.stats[MOE_OFF_PREFETCH], 2ull);
    CHECK_EQ(m.stats[MOE_OFF_PREFETCH_BYTES],
             (unsigned long long)(m.bytes[7] + m.bytes[16 + 7] + m.bytes[32 + 7] + m.bytes[9] +
                                  m.bytes[16 + 9] + m.bytes[32 + 9]));
    CHECK_EQ(m.stats[MOE_OFF_FILL_BYTES], 0ull);
    moe_off_resolve(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl, m.stats);
    CHECK_EQ(m.fl->n, 0);
    CHECK_EQ(m.stats[MOE_OFF_HITS], 3ull);
    CHECK_EQ(m.stats[MOE_OFF_MISSES], 0ull);
    /* Four predicted misses for three unpinned slots: three placed, one dropped. */
    memset(need, 0, sizeof need);
    need[10] = need[11] = need[12] = need[13] = 1;
    const unsigned long long placed = m.stats[MOE_OFF_PREFETCH];
    moe_off_resolve_mode(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl,
                         m.stats, 1);
    sim_fill(&m);
    check_state(&m);
    CHECK_EQ(m.stats[MOE_OFF_PREFETCH] - placed, 3ull);
    CHECK_EQ(m.stats[MOE_OFF_DIRECT] + m.stats[MOE_OFF_MISSES], 0ull);
    CHECK_EQ(m.slot_of[0], 0); /* pinned */
    sim_free(&m);
}

/* A decode-like step through the cache: three random experts resolved and filled. */
static void decode_step(struct sim *m, uint8_t *need)
{
    memset(need, 0, (uint32_t)m->L.nexp);
    for (int i = 0; i < 3; i++)
        need[moe_test_rng_u32() % (uint32_t)m->L.nexp] = 1;
    moe_off_resolve(&m->L, need, m->slot_of, m->slot_exp, m->ref, m->pinned, &m->hand, m->fl,
                    m->stats);
    sim_fill(m);
}

/* Prompt staging: the first `cap` experts without a slot are copied into the staging buffer in
 * expert order and the tables point there; the slots and the cache state are not touched; the
 * end counts every lookup once and gives the host copies back to the tables. */
TEST(offload_stage_copies_and_restores)
{
    static const int32_t shapes[][3] = {
        /* nexp, slots, cap */
        {16, 6, 10}, {16, 6, 4}, {16, 6, 0}, {128, 77, 51}, {128, 77, 20}, {8, 1, 7}, {32, 32, 4},
    };
    moe_test_rng_seed(20261202);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int32_t ne = shapes[si][0], S = shapes[si][1], cap = shapes[si][2];
        const size_t nn = (uint32_t)ne;
        struct sim m;
        sim_init(&m, ne, S, S / 2);
        free(m.fl);
        m.fl = malloc(sizeof *m.fl + sizeof(struct moe_cuda_fill) * 3 * (size_t)(cap + S + 1));
        uint8_t *stage = malloc((size_t)(cap + 1) * m.L.slot_bytes);
        uint8_t *need = malloc(nn), *ref0 = malloc((size_t)S + 1);
        int32_t *slot0 = malloc(sizeof(int32_t) * (size_t)ne);
        CHECK(m.fl && stage && need && ref0 && slot0);
        /* Some cache traffic first, so that slots hold other experts than at init. */
        for (int step = 0; step < 20; step++)
            decode_step(&m, need);
        check_state(&m);
        for (int step = 0; step < 30; step++) {
            memcpy(slot0, m.slot_of, sizeof(int32_t) * (size_t)ne);
            memset(stage, 0xee, (size_t)(cap + 1) * m.L.slot_bytes);
            unsigned long long st0[MOE_OFF_NSTATS];
            memcpy(st0, m.stats, sizeof st0);
            const int32_t staged = moe_off_stage(&m.L, m.slot_of, stage, cap, m.fl, m.stats);
            sim_fill(&m);
            int32_t unslotted = 0;
            for (int32_t e = 0; e < ne; e++)
                unslotted += m.slot_of[e] < 0;
            CHECK_EQ(staged, unslotted < cap ? unslotted : cap);
            CHECK_EQ(m.stats[MOE_OFF_STAGED] - st0[MOE_OFF_STAGED], (unsigned long long)staged);
            unsigned long long bytes = 0;
            int32_t j = 0;
            for (int32_t e = 0; e < ne; e++) {
                CHECK_EQ(m.slot_of[e], slot0[e]);
                for (int p = 0; p < 3; p++) {
                    const void *want;
                    if (m.slot_of[e] >= 0)
                        want = m.base + (size_t)m.slot_of[e] * m.L.slot_bytes + m.L.part_off[p];
                    else if (j < cap)
                        want = stage + (size_t)j * m.L.slot_bytes + m.L.part_off[p];
                    else
                        want = m.host[p * ne + e];
                    CHECK(m.tab[p][e] == want);
                    /* Whatever the table says holds the expert's bytes. */
                    CHECK(memcmp(m.tab[p][e], m.host[p * ne + e], m.bytes[p * ne + e]) == 0);
                    if (m.slot_of[e] < 0 && j < cap)
                        bytes += m.bytes[p * ne + e];
                }
                j += m.slot_of[e] < 0;
            }
            CHECK_EQ(m.stats[MOE_OFF_STAGE_BYTES] - st0[MOE_OFF_STAGE_BYTES], bytes);
            /* The step's choices: a prompt chunk's, most experts. */
            memset(need, 0, nn);
            int32_t want_hits = 0, want_miss = 0, want_direct = 0;
            j = 0;
            for (int32_t e = 0; e < ne; e++) {
                need[e] = moe_test_rng_u32() % 4 != 0;
                if (m.slot_of[e] >= 0) {
                    want_hits += need[e];
                } else {
                    want_miss += need[e];
                    want_direct += need[e] && j >= cap;
                    j++;
                }
            }
            memcpy(ref0, m.ref, (size_t)S);
            moe_off_stage_end(&m.L, need, m.slot_of, m.ref, cap, m.stats);
            CHECK_EQ(m.stats[MOE_OFF_HITS] - st0[MOE_OFF_HITS], (unsigned long long)want_hits);
            CHECK_EQ(m.stats[MOE_OFF_MISSES] - st0[MOE_OFF_MISSES], (unsigned long long)want_miss);
            CHECK_EQ(m.stats[MOE_OFF_DIRECT] - st0[MOE_OFF_DIRECT], (unsigned long long)want_direct);
            CHECK_EQ(m.stats[MOE_OFF_STAGE_READS] - st0[MOE_OFF_STAGE_READS],
                     (unsigned long long)(want_miss - want_direct));
            CHECK_EQ(m.stats[MOE_OFF_FILL_BYTES], st0[MOE_OFF_FILL_BYTES]);
            for (int32_t s = 0; s < S; s++) {
                const int32_t e = m.slot_exp[s];
                CHECK_EQ(m.ref[s], e >= 0 && need[e] ? 1 : ref0[s]);
            }
            check_state(&m); /* every table back at its slot or host copy */
            /* And the cache goes on working between staged steps. */
            decode_step(&m, need);
            check_state(&m);
        }
        free(stage), free(need), free(ref0), free(slot0);
        sim_free(&m);
    }
}

/* A tiered store's borrow (moe_off_pool_list / lend / return, the resolve kernel's request and
 * the pool_done kernel): the chosen experts without a slot are asked for in expert order; lent
 * addresses reach the host and kernel tables, then the walk copies from them; after the layer
 * they are dropped, and an expert the walk placed keeps its slot. A failed request lends
 * placeholders inside the slots and places nothing. */
TEST(offload_pool_borrow_lends_and_returns)
{
    moe_test_rng_seed(21);
    for (int c = 0; c < 200; c++) {
        const int32_t nexp = 8 + (int32_t)(moe_test_rng_u32() % 40);
        const int32_t S = 2 + (int32_t)(moe_test_rng_u32() % (uint32_t)(nexp - 3));
        const int32_t hot = (int32_t)(moe_test_rng_u32() % (uint32_t)S);
        struct sim m;
        sim_init(&m, nexp, S, hot);
        /* With a tiered store no expert has an address of its own outside the slots. */
        uint8_t *pool = malloc((size_t)nexp * 3 * 704);
        CHECK(pool);
        for (int32_t e = 0; e < nexp; e++)
            for (int p = 0; p < 3; p++) {
                m.host[p * nexp + e] = NULL;
                if (m.slot_of[e] < 0)
                    m.tab[p][e] = NULL;
            }
        uint8_t *need = calloc((size_t)nexp, 1);
        int32_t *list = malloc(sizeof(int32_t) * (size_t)nexp);
        uint64_t *ptr = malloc(sizeof(uint64_t) * 3 * (size_t)nexp);
        CHECK(need && list && ptr);
        for (int32_t e = 0; e < nexp; e++)
            need[e] = moe_test_rng_u32() % 3 == 0;
        const int32_t n = moe_off_pool_list(need, m.slot_of, nexp, list);
        int32_t want = 0;
        for (int32_t e = 0; e < nexp; e++)
            if (need[e] && m.slot_of[e] < 0) {
                CHECK(want < n && list[want] == e);
                want++;
            }
        CHECK_EQ(n, want);
        const bool fail = c % 5 == 0;
        for (int32_t i = 0; i < n; i++)
            for (int p = 0; p < 3; p++) {
                /* The pool's copy of the expert: the same bytes the simulation's host had. */
                uint8_t *at = pool + ((size_t)list[i] * 3 + (size_t)p) * 704;
                memcpy(at, m.hostmem + ((size_t)list[i] * 3 + (size_t)p) * 704, 704);
                ptr[3 * i + p] = (uint64_t)(uintptr_t)at;
            }
        /* Two "threads" lend the entries between them, as the kernel's block does. */
        moe_off_pool_lend(&m.L, list, n, fail ? NULL : ptr, need, 0, 2);
        moe_off_pool_lend(&m.L, list, n, fail ? NULL : ptr, need, 1, 2);
        for (int32_t i = 0; i < n; i++)
            for (int p = 0; p < 3; p++) {
                const void *v = fail ? (const void *)(m.base + m.L.part_off[p])
                                     : (const void *)(uintptr_t)ptr[3 * i + p];
                CHECK(m.host[p * nexp + list[i]] == v && m.tab[p][list[i]] == v);
                CHECK_EQ(need[list[i]], fail ? 0 : 1);
            }
        moe_off_resolve(&m.L, need, m.slot_of, m.slot_exp, m.ref, m.pinned, &m.hand, m.fl,
                        m.stats);
        sim_fill(&m);
        /* Placed experts hold their bytes; the lent ones read in place point at the pool. */
        for (int32_t i = 0; i < n && !fail; i++) {
            const int32_t e = list[i], s = m.slot_of[e];
            for (int p = 0; p < 3; p++) {
                const uint8_t *want_b = m.hostmem + ((size_t)e * 3 + (size_t)p) * 704;
                if (s >= 0)
                    CHECK(memcmp(m.base + (size_t)s * m.L.slot_bytes + m.L.part_off[p], want_b,
                                 m.bytes[p * nexp + e]) == 0);
                else
                    CHECK(m.tab[p][e] == (const void *)(uintptr_t)ptr[3 * i + p]);
            }
        }
        for (int32_t i = 0; i < n && fail; i++)
            CHECK(m.slot_of[list[i]] < 0); /* nothing placed from a failed request */
        moe_off_pool_return(&m.L, list, n, m.slot_of, 0, 1);
        for (int32_t i = 0; i < n; i++) {
            const int32_t e = list[i], s = m.slot_of[e];
            for (int p = 0; p < 3; p++) {
                CHECK(m.host[p * nexp + e] == NULL);
                if (s >= 0)
                    CHECK(m.tab[p][e] == m.base + (size_t)s * m.L.slot_bytes + m.L.part_off[p]);
                else
                    CHECK(m.tab[p][e] == NULL);
            }
        }
        free(need), free(list), free(ptr), free(pool);
        sim_free(&m);
    }
}

/* A tiered store's read-ahead hint (moe_off_hint_list): the predicted experts without a slot,
 * each once, in the order first predicted; out-of-range ids skipped. */
TEST(offload_pool_hint_lists_predicted_experts_without_a_slot)
{
    const int32_t nexp = 8;
    const int32_t slot_of[8] = {0, -1, 2, -1, -1, 1, -1, -1};
    const int32_t sel[10] = {3, 0, 3, 7, -1, 9, 1, 2, 7, 6};
    uint8_t seen[8] = {0};
    int32_t list[8];
    const int32_t n = moe_off_hint_list(sel, 10, slot_of, nexp, seen, list);
    CHECK_EQ(n, 4);
    CHECK(list[0] == 3 && list[1] == 7 && list[2] == 1 && list[3] == 6);
    uint8_t none[8] = {0};
    CHECK_EQ(moe_off_hint_list(sel, 0, slot_of, nexp, none, list), 0);
}

/* Placement of hot experts: hand-made routing counts with known best answers. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/placement.h"
#include "tests/harness.h"

static uint32_t hot_count(const struct moe_placement *p, uint32_t l)
{
    uint32_t n = 0;
    for (uint32_t e = 0; e < p->n_expert; e++)
        n += p->hot[(size_t)l * p->n_expert + e];
    return n;
}

static uint64_t used_bytes(const struct moe_placement *p, const uint64_t *bytes)
{
    uint64_t b = 0;
    for (uint32_t l = 0; l < p->n_layer; l++)
        b += hot_count(p, l) * bytes[l];
    return b;
}

/* Layer 0 is skewed like a trained router (half of its experts take 80% of the routings), layer 1
 * is flat. With room for 12 of the 32 experts and a floor of 2, the skewed layer must get more
 * slots, and its hot set must be its most used experts; the flat layer keeps at least the floor. */
TEST(placement_skewed_layer_gets_more)
{
    enum { L = 2, E = 16, K = 2 };
    uint64_t counts[L * E], bytes[L] = {1000, 1000};
    for (int e = 0; e < E; e++) {
        /* Popular ids are spread out so that "most used" is not simply "lowest id". */
        counts[e] = (e * 5) % 16 < 8 ? 10000 + (uint64_t)e : 2500; /* layer 0: skewed */
        counts[E + e] = 6250 + (uint64_t)(e % 3);                   /* layer 1: flat */
    }
    struct moe_placement p;
    char err[256];
    CHECK_EQ(moe_placement_compute(&p, L, E, K, bytes, counts, 12 * 1000, err, sizeof err), 0);
    CHECK_EQ(p.floor, K);
    CHECK(p.n_hot[0] > p.n_hot[1]);
    CHECK_EQ(p.n_hot[0], 8);
    CHECK(p.n_hot[1] >= K);
    CHECK_EQ(p.n_hot[0] + p.n_hot[1], 12);
    CHECK_EQ(hot_count(&p, 0), p.n_hot[0]);
    CHECK_EQ(hot_count(&p, 1), p.n_hot[1]);
    CHECK(p.bytes_used <= 12 * 1000);
    CHECK_EQ(p.bytes_used, used_bytes(&p, bytes));
    /* Within each layer every hot expert outranks every cold one. */
    for (int l = 0; l < L; l++)
        for (int a = 0; a < E; a++)
            for (int b = 0; b < E; b++)
                if (p.hot[l * E + a] && !p.hot[l * E + b])
                    CHECK(counts[l * E + a] >= counts[l * E + b]);
    /* Hit rates are the hot share of each layer's routings. */
    for (int l = 0; l < L; l++) {
        double tot = 0, hot = 0;
        for (int e = 0; e < E; e++) {
            tot += (double)counts[l * E + e];
            if (p.hot[l * E + e])
                hot += (double)counts[l * E + e];
        }
        CHECK_NEAR(p.hit_rate[l], hot / tot, 1e-12);
    }
    CHECK(p.hit_rate[0] > 0.79);
    moe_placement_free(&p);
}

/* The objective is hits, not skew: a very skewed layer (Zipf, exponent 2) has its head captured
 * by a few slots, after which the flat layer's experts are worth more. Whatever the split, the
 * sum of hit rates must be the best of all splits that keep the floor (checked by brute force). */
TEST(placement_maximises_expected_hits)
{
    enum { L = 2, E = 16, K = 2 };
    uint64_t counts[L * E], bytes[L] = {1000, 1000};
    for (int e = 0; e < E; e++) {
        counts[e] = 100000 / (uint64_t)((e + 1) * (e + 1));
        counts[E + e] = 1000;
    }
    double tot0 = 0;
    for (int e = 0; e < E; e++)
        tot0 += (double)counts[e];
    for (int slots = 0; slots <= 2 * E; slots++) {
        struct moe_placement p;
        char err[256];
        CHECK_EQ(moe_placement_compute(&p, L, E, K, bytes, counts, (uint64_t)slots * 1000, err,
                                       sizeof err), 0);
        CHECK_EQ(p.n_hot[0] + p.n_hot[1], slots);
        double best = 0;
        for (int n0 = 0; n0 <= slots && n0 <= E; n0++) {
            int n1 = slots - n0;
            int fl = slots / 2 < K ? slots / 2 : K;
            if (n1 > E || n0 < fl || n1 < fl)
                continue;
            double h0 = 0;
            for (int e = 0; e < n0; e++)
                h0 += (double)counts[e] / tot0;
            double h = h0 + (double)n1 / E;
            if (h > best)
                best = h;
        }
        CHECK_NEAR(p.hit_rate[0] + p.hit_rate[1], best, 1e-9);
        moe_placement_free(&p);
    }
}

/* A layer with almost no traffic still gets the floor (min(top-k, what fits uniformly)). */
TEST(placement_floor_holds)
{
    enum { L = 4, E = 32, K = 4 };
    uint64_t counts[L * E], bytes[L] = {300, 500, 700, 300};
    for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++)
            counts[l * E + e] = l == 2 ? (e == 0) : (uint64_t)(1000000 >> (e < 20 ? e : 20));
    uint64_t per = 300 + 500 + 700 + 300;
    struct moe_placement p;
    char err[256];
    /* Budget for the full floor plus a lot more: layer 2 is worthless beyond its first expert. */
    CHECK_EQ(moe_placement_compute(&p, L, E, K, bytes, counts, per * 10, err, sizeof err), 0);
    CHECK_EQ(p.floor, K);
    for (int l = 0; l < L; l++)
        CHECK(p.n_hot[l] >= K);
    CHECK(p.hot[2 * E + 0]); /* layer 2's only used expert */
    CHECK(p.bytes_used <= per * 10);
    moe_placement_free(&p);
    /* Budget for only 2 slots everywhere: floor = 2, not top-k. */
    CHECK_EQ(moe_placement_compute(&p, L, E, K, bytes, counts, per * 2 + 299, err, sizeof err), 0);
    CHECK_EQ(p.floor, 2);
    for (int l = 0; l < L; l++)
        CHECK(p.n_hot[l] >= 2);
    CHECK(p.bytes_used <= per * 2 + 299);
    moe_placement_free(&p);
    /* Budget too small for one expert in every layer: floor 0, greedy takes what fits. */
    CHECK_EQ(moe_placement_compute(&p, L, E, K, bytes, counts, 650, err, sizeof err), 0);
    CHECK_EQ(p.floor, 0);
    CHECK(p.bytes_used <= 650);
    CHECK(p.bytes_used >= 600); /* two 300-byte experts of layers 0 and 3 fit */
    moe_placement_free(&p);
}

/* Random shapes, counts and budgets: the budget is never exceeded and the result is greedy-
 * maximal (no cold expert of any layer would still fit in what is left). */
TEST(placement_budget_never_exceeded)
{
    srand(12345);
    for (int iter = 0; iter < 300; iter++) {
        uint32_t L = 1 + (uint32_t)(rand() % 6), E = 1 + (uint32_t)(rand() % 40);
        uint32_t K = 1 + (uint32_t)(rand() % 8);
        uint64_t *bytes = malloc(L * sizeof *bytes), *counts = malloc((size_t)L * E * 8);
        uint64_t all = 0;
        for (uint32_t l = 0; l < L; l++) {
            bytes[l] = 1 + (uint64_t)(rand() % 5000);
            all += bytes[l] * E;
        }
        for (size_t i = 0; i < (size_t)L * E; i++)
            counts[i] = rand() % 4 ? (uint64_t)(rand() % 100000) : 0;
        uint64_t budget = (uint64_t)rand() % (all + all / 4 + 1);
        struct moe_placement p;
        char err[256];
        CHECK_EQ(moe_placement_compute(&p, L, E, K, bytes, iter % 5 ? counts : NULL, budget, err,
                                       sizeof err), 0);
        uint64_t used = used_bytes(&p, bytes);
        CHECK(used <= budget);
        CHECK_EQ(used, p.bytes_used);
        for (uint32_t l = 0; l < L; l++) {
            CHECK_EQ(hot_count(&p, l), p.n_hot[l]);
            CHECK(p.n_hot[l] >= p.floor);
            if (p.n_hot[l] < E)
                CHECK(bytes[l] > budget - used);
            CHECK(p.hit_rate[l] >= 0 && p.hit_rate[l] <= 1.0);
        }
        moe_placement_free(&p);
        free(bytes);
        free(counts);
    }
}

TEST(placement_zero_and_full_budget)
{
    enum { L = 3, E = 8, K = 2 };
    uint64_t counts[L * E], bytes[L] = {100, 200, 300};
    for (int i = 0; i < L * E; i++)
        counts[i] = (uint64_t)(i * 7 % 11);
    struct moe_placement p;
    char err[256];
    CHECK_EQ(moe_placement_compute(&p, L, E, K, bytes, counts, 0, err, sizeof err), 0);
    for (int i = 0; i < L * E; i++)
        CHECK(!p.hot[i]);
    for (int l = 0; l < L; l++) {
        CHECK_EQ(p.n_hot[l], 0);
        CHECK_NEAR(p.hit_rate[l], 0.0, 0);
    }
    CHECK_EQ(p.bytes_used, 0);
    moe_placement_free(&p);

    uint64_t all = (100 + 200 + 300) * E;
    for (int extra = 0; extra < 2; extra++) {
        CHECK_EQ(moe_placement_compute(&p, L, E, K, bytes, extra ? NULL : counts,
                                       all + (uint64_t)extra * 12345, err, sizeof err), 0);
        for (int i = 0; i < L * E; i++)
            CHECK(p.hot[i]);
        for (int l = 0; l < L; l++)
            CHECK_NEAR(p.hit_rate[l], 1.0, 1e-12);
        CHECK_EQ(p.bytes_used, all);
        moe_placement_free(&p);
    }
}

/* No profile: the same number of slots per layer (layer sizes differ), lowest ids first; the
 * leftover goes to the lower layers one slot each. */
TEST(placement_uniform_without_profile)
{
    enum { L = 3, E = 10, K = 2 };
    uint64_t bytes[L] = {100, 250, 400};
    struct moe_placement p;
    char err[256];
    CHECK_EQ(moe_placement_compute(&p, L, E, K, bytes, NULL, 750 * 5 + 100 + 250, err,
                                   sizeof err), 0);
    CHECK_EQ(p.n_hot[0], 6);
    CHECK_EQ(p.n_hot[1], 6);
    CHECK_EQ(p.n_hot[2], 5);
    for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++)
            CHECK_EQ(p.hot[l * E + e], e < (int)p.n_hot[l]);
    CHECK_NEAR(p.hit_rate[2], 0.5, 1e-12);
    moe_placement_free(&p);
    /* A zero expert size or zero dims are refused with a message. */
    uint64_t bad[L] = {100, 0, 1};
    CHECK_EQ(moe_placement_compute(&p, L, E, K, bad, NULL, 1000, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "layer 1") != NULL);
    CHECK_EQ(moe_placement_compute(&p, 0, E, K, bytes, NULL, 1000, err, sizeof err), MOE_ERANGE);
}

/* The held-out score: rankings from the profile and from the older window, scored on the newer
 * one; full layers are skipped. */
TEST(placement_heldout_scores_on_unseen_traffic)
{
    enum { L = 2, E = 4 };
    const uint32_t slots[L] = {2, 4}; /* layer 1 holds every expert: skipped */
    const uint64_t profile[L * E] = {9, 8, 1, 0, /* */ 1, 1, 1, 1};
    const uint64_t older[L * E] = {0, 1, 7, 9, /* */ 5, 5, 5, 5};
    const uint64_t newer[L * E] = {1, 1, 4, 4, /* */ 100, 0, 0, 0};
    double cur, fr;
    CHECK_EQ(moe_placement_heldout(L, E, slots, profile, older, newer, &cur, &fr), 0);
    CHECK(fabs(cur - 0.2) < 1e-12); /* experts 0, 1: 2 of 10 */
    CHECK(fabs(fr - 0.8) < 1e-12);  /* experts 3, 2: 8 of 10 */
    const uint32_t all[L] = {4, 4};
    CHECK_EQ(moe_placement_heldout(L, E, all, profile, older, newer, &cur, &fr), 0);
    CHECK(cur == 1.0 && fr == 1.0);
}

/* Drift: traffic that moves to other experts turns the placement to the recent windows after
 * two windows; when the profile catches up, back to the profile. Bursts shorter than a window
 * are only counted. */
TEST(placement_drift_follows_a_new_workload)
{
    enum { L = 3, E = 16, K = 2 };
    const uint32_t slots[L] = {4, 4, 4};
    uint64_t profile[L * E] = {0}, delta[L * E];
    for (int l = 0; l < L; l++)
        for (int x = 0; x < 4; x++)
            profile[l * E + x] = 1000; /* the profile: experts 0..3 */
    struct moe_drift d;
    CHECK_EQ(moe_drift_init(&d, L, E, 100, 0.05), 0);
    /* Traffic of 10 tokens per report on experts `base`..base+3 of every layer. */
#define TRAFFIC(base)                                                                      \
    do {                                                                                   \
        memset(delta, 0, sizeof delta);                                                    \
        for (int l = 0; l < L; l++)                                                        \
            for (int t = 0; t < 10 * K; t++)                                               \
                delta[l * E + (base) + t % 4]++;                                           \
    } while (0)
    TRAFFIC(0);
    for (int i = 0; i < 30; i++)
        CHECK_EQ(moe_drift_add(&d, delta, 10, profile, slots), 0);
    CHECK(d.checks > 0 && !d.drifting);
    CHECK(fabs(d.current - 1.0) < 1e-12 && fabs(d.fresh - 1.0) < 1e-12);
    CHECK(moe_drift_counts(&d) == NULL);
    /* A new workload on experts 8..11. */
    TRAFFIC(8);
    int changed = 0, reports = 0;
    while (!changed && reports < 100) {
        changed = moe_drift_add(&d, delta, 10, profile, slots);
        CHECK(changed >= 0);
        reports++;
    }
    CHECK_EQ(changed, 1);
    CHECK(d.drifting);
    CHECK_MSG(reports <= 20, "%d reports", reports); /* within two windows */
    CHECK(d.fresh - d.current > 0.05);
    const uint64_t *rc = moe_drift_counts(&d);
    CHECK(rc != NULL && rc[8] > 0 && rc[0] == 0);
    /* The profile learns the new workload: the placement goes back to it. */
    for (int l = 0; l < L; l++)
        for (int x = 0; x < 4; x++) {
            profile[l * E + x] = 0;
            profile[l * E + 8 + x] = 5000;
        }
    changed = 0;
    for (reports = 0; !changed && reports < 100; reports++)
        changed = moe_drift_add(&d, delta, 10, profile, slots);
    CHECK_EQ(changed, 1);
    CHECK(!d.drifting && moe_drift_counts(&d) == NULL);
    CHECK_EQ(d.changes, 2ull);
    moe_drift_free(&d);
#undef TRAFFIC
}

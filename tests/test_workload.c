/* Workloads (store/workload.h): keys, the bounded table and its decay, coverage, and the plans of
 * complementary hot sets on made-up routing with known best answers. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/workload.h"
#include "tests/harness.h"

enum { L = 2, E = 16, N = L * E };

/* A signature of `tokens` tokens that choose experts [first, first + k) in every layer. */
static void sig_of(uint32_t *sig, uint32_t first, uint32_t k, uint32_t tokens)
{
    memset(sig, 0, sizeof *sig * N);
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t x = first; x < first + k; x++)
            sig[l * E + (x % E)] = tokens;
}

/* moe_wl_learn of sig for key (served by worker), its counts added into profile as well. */
static void learn(struct moe_wl_table *t, uint64_t key, uint32_t worker, const uint32_t *sig,
                  uint32_t tokens, uint64_t *profile)
{
    CHECK_EQ(moe_wl_learn(t, key, worker, sig, tokens), 0);
    for (size_t x = 0; x < N; x++)
        profile[x] += sig[x];
}

static void set_bit(uint8_t *b, size_t i)
{
    b[i / 8] |= (uint8_t)(1u << (i % 8));
}

static bool has_bit(const uint8_t *b, size_t i)
{
    return (b[i / 8] >> (i % 8)) & 1;
}

TEST(workload_key_is_the_prompt_head)
{
    int32_t a[40], b[40];
    for (int i = 0; i < 40; i++)
        a[i] = b[i] = i * 7 + 1;
    CHECK_EQ(moe_wl_key(a, 31), 0);
    CHECK(moe_wl_key(a, 32) != 0);
    CHECK_EQ(moe_wl_key(a, 32), moe_wl_key(a, 40));
    b[35] = 5; /* past the head: same key */
    CHECK_EQ(moe_wl_key(a, 40), moe_wl_key(b, 40));
    b[31] = 5;
    CHECK(moe_wl_key(a, 40) != moe_wl_key(b, 40));
}

/* Learning: the typical request is the decayed mean of the signatures, traffic decays over the
 * table's keyed requests, each worker's share is kept, and a full table forgets the key used
 * least recently (a lookup counts as a use). */
TEST(workload_table_learns_decays_and_forgets)
{
    struct moe_wl_table t;
    CHECK_EQ(moe_wl_init(&t, L, E, 2, 2), 0);
    uint32_t sig[N];
    sig_of(sig, 0, 4, 10);
    CHECK_EQ(moe_wl_learn(&t, 0, 0, sig, 10), MOE_ERANGE);
    CHECK_EQ(moe_wl_learn(&t, 7, 2, sig, 10), MOE_ERANGE);
    CHECK_EQ(moe_wl_learn(&t, 7, 0, sig, 10), 0);
    CHECK_EQ(moe_wl_learn(&t, 7, 1, sig, 10), 0);
    const struct moe_wl_entry *e = moe_wl_find(&t, 7);
    CHECK(e);
    CHECK_EQ(e->requests, 2);
    CHECK_EQ(e->tokens, 20);
    CHECK_NEAR(e->hist[0] / e->n, 10.0, 1e-9);
    CHECK_NEAR(e->hist[5] / e->n, 0.0, 1e-9);
    CHECK(e->served[0] > 0 && e->served[1] > e->served[0]); /* the older one decayed */
    CHECK(e->traffic > 1.99 && e->traffic < 2.0);
    /* A request without evaluated tokens is traffic only. */
    CHECK_EQ(moe_wl_learn(&t, 7, 0, NULL, 0), 0);
    CHECK_EQ(e->requests, 3);
    CHECK_NEAR(e->hist[0] / e->n, 10.0, 1e-9);
    sig_of(sig, 4, 4, 3);
    CHECK_EQ(moe_wl_learn(&t, 9, 1, sig, 3), 0);
    CHECK(moe_wl_find(&t, 7)); /* 7 is now the most recently used */
    CHECK_EQ(moe_wl_learn(&t, 11, 1, sig, 3), 0);
    CHECK_EQ(t.n, 2);
    CHECK_EQ(t.evictions, 1);
    CHECK(moe_wl_find(&t, 7));
    CHECK(!moe_wl_find(&t, 9));
    CHECK(moe_wl_find(&t, 11));
    CHECK_NEAR(moe_wl_traffic(&t), moe_wl_find(&t, 7)->traffic + moe_wl_find(&t, 11)->traffic,
               1e-12);
    moe_wl_free(&t);
}

/* Coverage: the share of the typical request's routings that the set's experts serve, over the
 * layers the set does not hold whole; unknown (-1) without a routing. */
TEST(workload_coverage)
{
    struct moe_wl_table t;
    CHECK_EQ(moe_wl_init(&t, L, E, 1, 4), 0);
    uint32_t sig[N];
    sig_of(sig, 0, 4, 5);
    CHECK_EQ(moe_wl_learn(&t, 3, 0, NULL, 0), 0);
    CHECK_EQ(moe_wl_coverage(&t, moe_wl_find(&t, 3), (uint8_t[4]){0}), -1.0);
    CHECK_EQ(moe_wl_coverage(&t, NULL, (uint8_t[4]){0}), -1.0);
    CHECK_EQ(moe_wl_learn(&t, 3, 0, sig, 5), 0);
    const struct moe_wl_entry *e = moe_wl_find(&t, 3);
    uint8_t hot[4] = {0};
    CHECK_NEAR(moe_wl_coverage(&t, e, hot), 0.0, 1e-12);
    set_bit(hot, 0), set_bit(hot, 1), set_bit(hot, 9); /* layer 0: 2 of the 4 experts */
    set_bit(hot, E + 2);                               /* layer 1: 1 of 4 */
    CHECK_NEAR(moe_wl_coverage(&t, e, hot), 3.0 / 8.0, 1e-12);
    memset(hot + 2, 0xff, 2); /* layer 1 held whole: only layer 0 counts */
    CHECK_NEAR(moe_wl_coverage(&t, e, hot), 2.0 / 4.0, 1e-12);
    memset(hot, 0xff, 4);
    CHECK_NEAR(moe_wl_coverage(&t, e, hot), 1.0, 1e-12);
    moe_wl_free(&t);
}

/* The worker's pinning rule: most counted first, ties to the lower id, zero counts never. */
TEST(workload_pinned_by_follows_the_worker_rule)
{
    uint64_t c[N] = {0};
    c[3] = 5, c[7] = 9, c[1] = 5, c[12] = 1;
    c[E + 0] = 1;
    const uint32_t slots[L] = {3, E};
    uint8_t hot[4];
    moe_wl_pinned_by(L, E, slots, c, hot);
    for (uint32_t x = 0; x < E; x++)
        CHECK_EQ(has_bit(hot, x), x == 7 || x == 1 || x == 3);
    for (uint32_t x = 0; x < E; x++)
        CHECK(has_bit(hot, E + x));
    const uint32_t two[L] = {2, 2};
    moe_wl_pinned_by(L, E, two, c, hot);
    CHECK(has_bit(hot, 7) && has_bit(hot, 1) && !has_bit(hot, 3));
    CHECK(has_bit(hot, E) && !has_bit(hot, E + 1)); /* one nonzero count: one pinned */
}

/* Two workers pinning 4 of 16 experts per layer and two applications each using 4 experts of
 * its own: identical sets from the merged profile serve half of either's routings; complementary
 * sets, each application with one worker, serve all, with the traffic balanced. */
static void learn_two_workloads(struct moe_wl_table *t, uint64_t *profile, int n_each)
{
    uint32_t sig[N];
    for (int i = 0; i < n_each; i++)
        for (int a = 0; a < 2; a++) {
            sig_of(sig, a ? 8 : 0, 4, 20);
            if (i % 2) /* a little spread: one token to a third expert */
                sig[a ? 12 : 4] += 1;
            learn(t, a ? 0xb : 0xa, (uint32_t)(i % 2), sig, 20, profile);
        }
}

static void hot_identical(uint8_t hot[2][4], const uint64_t *profile)
{
    const uint32_t slots[L] = {4, 4};
    moe_wl_pinned_by(L, E, slots, profile, hot[0]);
    memcpy(hot[1], hot[0], 4);
}

TEST(workload_plan_complementary_sets)
{
    struct moe_wl_table t;
    CHECK_EQ(moe_wl_init(&t, L, E, 2, 8), 0);
    uint64_t profile[N] = {0};
    learn_two_workloads(&t, profile, 20);
    /* The profile ranks expert 0..3 and 8..11 equal: its top 4 is half of each. */
    uint8_t hot[2][4];
    hot_identical(hot, profile);
    const uint8_t *hp[2] = {hot[0], hot[1]};
    struct moe_wl_plan p;
    CHECK_EQ(moe_wl_plan(&p, &t, 2, NULL, hp, profile), 0);
    CHECK_MSG(p.active, "%s", p.why);
    CHECK_EQ(p.n_keys, 2);
    CHECK_NEAR(p.hit_identical, 0.5, 0.05);
    CHECK(p.hit_complementary > 0.95);
    CHECK_NEAR(p.load[0], 0.5, 0.01);
    CHECK_NEAR(p.load[1], 0.5, 0.01);
    /* Each key wholly on one worker, a different one each. */
    int owner[2];
    for (int k = 0; k < 2; k++) {
        const double *a = p.assign + k * 2;
        CHECK(a[0] == 0 || a[1] == 0);
        owner[k] = a[0] > 0 ? 0 : 1;
    }
    CHECK(owner[0] != owner[1]);
    /* The counts pin the key's experts, and experts no key chose still follow the profile. */
    const uint32_t slots[L] = {4, 4};
    for (int k = 0; k < 2; k++) {
        uint8_t pin[4];
        moe_wl_pinned_by(L, E, slots, p.counts[owner[k]], pin);
        const uint32_t first = p.key[k] == 0xa ? 0 : 8;
        for (uint32_t x = first; x < first + 4; x++)
            CHECK(has_bit(pin, x) && has_bit(pin, E + x));
        CHECK(p.counts[owner[k]][first == 0 ? 8 : 0] > 0); /* the other key's, via the profile */
        CHECK_EQ(p.counts[owner[k]][14], 0);               /* nobody's */
    }
    /* Deterministic. */
    struct moe_wl_plan q;
    CHECK_EQ(moe_wl_plan(&q, &t, 2, NULL, hp, profile), 0);
    for (int w = 0; w < 2; w++)
        CHECK(memcmp(p.counts[w], q.counts[w], sizeof(uint64_t) * N) == 0);
    moe_wl_plan_free(&q);
    /* Once the workers pin what the plan gave them, the next plan keeps each key where it is
     * (its worker covers it best), whatever served it. */
    uint8_t now[2][4];
    moe_wl_pinned_by(L, E, slots, p.counts[0], now[0]);
    moe_wl_pinned_by(L, E, slots, p.counts[1], now[1]);
    const uint8_t *np[2] = {now[0], now[1]};
    CHECK_EQ(moe_wl_plan(&q, &t, 2, NULL, np, profile), 0);
    for (int k = 0; k < 2; k++)
        CHECK(q.assign[k * 2 + owner[k]] > 0 && q.assign[k * 2 + 1 - owner[k]] == 0);
    CHECK(q.hit_complementary > 0.95);
    moe_wl_plan_free(&q);
    moe_wl_plan_free(&p);
    moe_wl_free(&t);
}

/* No plan with one worker, too few keyed requests, or one key; the hit rates are still given. */
TEST(workload_plan_needs_two_workers_and_keyed_traffic)
{
    struct moe_wl_table t;
    CHECK_EQ(moe_wl_init(&t, L, E, 2, 8), 0);
    uint64_t profile[N] = {0};
    uint8_t hot[2][4];
    struct moe_wl_plan p;
    learn_two_workloads(&t, profile, 4); /* 8 requests */
    hot_identical(hot, profile);
    const uint8_t *hp[2] = {hot[0], hot[1]};
    CHECK_EQ(moe_wl_plan(&p, &t, 2, NULL, hp, profile), 0);
    CHECK(!p.active && strstr(p.why, "keyed requests"));
    CHECK_NEAR(p.hit_complementary, p.hit_identical, 1e-12);
    CHECK(!p.counts);
    moe_wl_plan_free(&p);
    learn_two_workloads(&t, profile, 20);
    CHECK_EQ(moe_wl_plan(&p, &t, 1, NULL, hp, profile), 0);
    CHECK(!p.active && strstr(p.why, "two GPU workers"));
    moe_wl_plan_free(&p);
    CHECK_EQ(moe_wl_plan(&p, &t, 3, NULL, (const uint8_t *const[3]){hot[0], hot[1], hot[1]}, profile),
             MOE_ERANGE);
    moe_wl_free(&t);

    CHECK_EQ(moe_wl_init(&t, L, E, 2, 8), 0);
    uint32_t sig[N];
    sig_of(sig, 0, 4, 20);
    for (int i = 0; i < 60; i++)
        CHECK_EQ(moe_wl_learn(&t, 0xa, 0, sig, 20), 0);
    CHECK_EQ(moe_wl_plan(&p, &t, 2, NULL, hp, profile), 0);
    CHECK(!p.active && strstr(p.why, "two keys"));
    moe_wl_plan_free(&p);
    moe_wl_free(&t);
}

/* Heavy keys first, and no worker takes much more than its share: one key of 70% and three of
 * 10% over two workers leave neither above 0.55 + an eighth of a share; four equal keys go two
 * and two. Keys whose coverage ties go to the worker that served them. */
TEST(workload_plan_balances_the_traffic)
{
    struct moe_wl_table t;
    CHECK_EQ(moe_wl_init(&t, L, E, 2, 8), 0);
    uint64_t profile[N] = {0};
    uint32_t sig[N];
    for (int i = 0; i < 100; i++) {
        const int k = i % 10 < 7 ? 0 : i % 10 - 6; /* 70, 10, 10, 10 */
        sig_of(sig, (uint32_t)(4 * k), 4, 8);
        learn(&t, 0x100 + (uint64_t)k, 1, sig, 8, profile);
    }
    uint8_t hot[2][4];
    hot_identical(hot, profile);
    const uint8_t *hp[2] = {hot[0], hot[1]};
    struct moe_wl_plan p;
    CHECK_EQ(moe_wl_plan(&p, &t, 2, NULL, hp, profile), 0);
    CHECK_MSG(p.active, "%s", p.why);
    CHECK_EQ(p.n_keys, 4);
    CHECK_EQ(p.key[0], 0x100);
    CHECK(p.key_share[0] > 0.6);
    for (int w = 0; w < 2; w++)
        CHECK_MSG(p.load[w] <= 0.55 + 0.5 / 8 + 1e-9, "worker %d takes %.3f", w, p.load[w]);
    CHECK_NEAR(p.load[0] + p.load[1], 1.0, 1e-9);
    /* The heavy key went first to the worker that served it (coverage ties). */
    CHECK(p.assign[1] >= p.assign[0]);
    /* Worker 0 takes the heavy key's overflow and the light keys: it pins the heavy key's
     * experts, which serve more of its traffic; no worse than identical sets. */
    CHECK(p.hit_complementary >= p.hit_identical - 1e-9);
    moe_wl_plan_free(&p);
    moe_wl_free(&t);

    CHECK_EQ(moe_wl_init(&t, L, E, 2, 8), 0);
    memset(profile, 0, sizeof profile);
    for (int i = 0; i < 80; i++) {
        const int k = i % 4;
        sig_of(sig, (uint32_t)(4 * k), 4, 8);
        learn(&t, 0x200 + (uint64_t)k, (uint32_t)(k % 2), sig, 8, profile);
    }
    hot_identical(hot, profile);
    CHECK_EQ(moe_wl_plan(&p, &t, 2, NULL, hp, profile), 0);
    CHECK(p.active);
    CHECK_NEAR(p.load[0], 0.5, 0.01);
    CHECK_NEAR(p.load[1], 0.5, 0.01);
    for (uint32_t k = 0; k < p.n_keys; k++) {
        const uint32_t served_by = (uint32_t)((p.key[k] - 0x200) % 2);
        CHECK_NEAR(p.assign[k * 2 + served_by], p.key_share[k], 1e-9);
    }
    moe_wl_plan_free(&p);
    moe_wl_free(&t);
}

/* A plan over some of the table's workers (ids: their indexes in the table): a key's worker is
 * found through them. */
TEST(workload_plan_over_some_workers)
{
    struct moe_wl_table t;
    CHECK_EQ(moe_wl_init(&t, L, E, 3, 8), 0);
    uint64_t profile[N] = {0};
    uint32_t sig[N];
    for (int i = 0; i < 40; i++) {
        const int k = i % 2;
        sig_of(sig, (uint32_t)(8 * k), 4, 8);
        /* key 0x300 served by table worker 2, key 0x301 by table worker 0 */
        learn(&t, 0x300 + (uint64_t)k, k ? 0 : 2, sig, 8, profile);
    }
    uint8_t hot[2][4];
    hot_identical(hot, profile);
    const uint8_t *hp[2] = {hot[0], hot[1]};
    const uint32_t ids[2] = {2, 0};
    struct moe_wl_plan p;
    CHECK_EQ(moe_wl_plan(&p, &t, 2, (const uint32_t[2]){2, 3}, hp, profile), MOE_ERANGE);
    CHECK_EQ(moe_wl_plan(&p, &t, 2, ids, hp, profile), 0);
    CHECK_MSG(p.active, "%s", p.why);
    for (uint32_t k = 0; k < p.n_keys; k++) {
        const uint32_t want = p.key[k] == 0x300 ? 0 : 1; /* plan worker of table worker 2, 0 */
        CHECK_NEAR(p.assign[k * 2 + want], p.key_share[k], 1e-9);
    }
    moe_wl_plan_free(&p);
    moe_wl_free(&t);
}

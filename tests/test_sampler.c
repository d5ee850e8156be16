/* Sampler tests with hand-made logits: greedy, top-k, top-p, min-p, temperature, seeds,
 * penalties, and parameter validation. */
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "tests/harness.h"
#include "worker/sampler.h"

static struct moe_sampler *mk(const struct moe_sampler_params *p, uint32_t n_vocab)
{
    struct moe_sampler *s = NULL;
    char err[128] = "";
    int rc = moe_sampler_init(&s, p, n_vocab, err, sizeof err);
    CHECK_MSG(rc == 0, "moe_sampler_init: %s", err);
    return s;
}

/* Only the named knobs set: temperature 1, everything else off. */
static struct moe_sampler_params plain(uint64_t seed)
{
    struct moe_sampler_params p;
    moe_sampler_defaults(&p);
    p.temperature = 1.0f;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.seed = seed;
    return p;
}

/* Logits whose softmax is exactly probs (up to float rounding). */
static void logits_from_probs(float *l, const double *probs, int n)
{
    for (int i = 0; i < n; i++)
        l[i] = probs[i] > 0 ? (float)log(probs[i]) : -INFINITY;
}

/* Counts of n draws. */
static void draw(struct moe_sampler *s, const float *l, int n, int *count, int n_vocab)
{
    memset(count, 0, sizeof(int) * n_vocab);
    for (int i = 0; i < n; i++) {
        int32_t t = moe_sampler_sample(s, l);
        CHECK(t >= 0 && t < n_vocab);
        count[t]++;
    }
}

TEST(sampler_greedy_is_argmax)
{
    struct moe_sampler_params p = plain(1);
    p.temperature = 0.0f;
    struct moe_sampler *s = mk(&p, 6);
    float l[6] = {0.5f, 3.0f, -1.0f, 3.0f, NAN, 2.9f};
    for (int i = 0; i < 10; i++)
        CHECK_EQ(moe_sampler_sample(s, l), 1); /* tie with 3 goes to the lower id */
    l[1] = -INFINITY;
    CHECK_EQ(moe_sampler_sample(s, l), 3);
    float none[6] = {-INFINITY, -INFINITY, NAN, -INFINITY, -INFINITY, -INFINITY};
    CHECK_EQ(moe_sampler_sample(s, none), -1);
    moe_sampler_free(s);

    /* Greedy consumes no randomness: the generator is where a fresh one would be. */
    p.temperature = 0.0f;
    s = mk(&p, 6);
    for (int i = 0; i < 5; i++)
        moe_sampler_sample(s, l);
    struct moe_sampler *fresh = mk(&p, 6);
    CHECK_EQ(moe_sampler_rand_u64(s), moe_sampler_rand_u64(fresh));
    moe_sampler_free(s);
    moe_sampler_free(fresh);
}

TEST(sampler_top_k_1_equals_greedy)
{
    enum { V = 257 };
    struct moe_sampler_params p = plain(42);
    p.top_k = 1;
    p.temperature = 1.5f;
    struct moe_sampler *s = mk(&p, V);
    float l[V];
    uint64_t x = 7;
    for (int round = 0; round < 200; round++) {
        int best = 0;
        for (int i = 0; i < V; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            l[i] = (float)((double)(x >> 11) * 0x1.0p-53 * 10.0 - 5.0);
            if (l[i] > l[best])
                best = i;
        }
        CHECK_EQ(moe_sampler_sample(s, l), best);
    }
    moe_sampler_free(s);
}

TEST(sampler_top_k_support)
{
    struct moe_sampler_params p = plain(3);
    p.top_k = 3;
    struct moe_sampler *s = mk(&p, 8);
    const double probs[8] = {0.05, 0.3, 0.02, 0.25, 0.2, 0.08, 0.06, 0.04};
    float l[8];
    int c[8];
    logits_from_probs(l, probs, 8);
    draw(s, l, 3000, c, 8);
    for (int i = 0; i < 8; i++)
        CHECK_MSG((c[i] > 0) == (i == 1 || i == 3 || i == 4), "token %d drawn %d times", i, c[i]);
    /* Renormalised over the three: 0.3/0.75 = 0.4 for token 1. */
    CHECK_NEAR(c[1] / 3000.0, 0.4, 0.04);
    moe_sampler_free(s);
}

TEST(sampler_top_p_support)
{
    const double probs[5] = {0.05, 0.5, 0.3, 0.1, 0.05};
    float l[5];
    int c[5];
    logits_from_probs(l, probs, 5);

    struct moe_sampler_params p = plain(9);
    p.top_p = 0.7f; /* 0.5 < 0.7 <= 0.8: tokens 1 and 2 */
    struct moe_sampler *s = mk(&p, 5);
    draw(s, l, 4000, c, 5);
    CHECK(c[1] > 0 && c[2] > 0);
    CHECK(c[0] == 0 && c[3] == 0 && c[4] == 0);
    CHECK_NEAR(c[1] / 4000.0, 0.5 / 0.8, 0.03);
    moe_sampler_free(s);

    p.top_p = 0.85f; /* adds token 3 */
    s = mk(&p, 5);
    draw(s, l, 4000, c, 5);
    CHECK(c[1] > 0 && c[2] > 0 && c[3] > 0);
    CHECK(c[0] == 0 && c[4] == 0);
    moe_sampler_free(s);

    p.top_p = 0.2f; /* the top token alone already covers it */
    s = mk(&p, 5);
    draw(s, l, 500, c, 5);
    CHECK_EQ(c[1], 500);
    moe_sampler_free(s);
}

/* A nucleus far larger than the first ranking pass (64) must still be exact. */
TEST(sampler_top_p_large_nucleus)
{
    enum { V = 5000 };
    static float l[V];
    static int rank_of[V], c[V];
    /* Logits decreasing slowly with a pseudo-random permutation of ids. */
    for (int i = 0; i < V; i++) {
        int id = (int)(((int64_t)i * 2654435761u) % V);
        l[id] = -0.002f * (float)i;
        rank_of[id] = i;
    }
    double z = 0.0;
    for (int i = 0; i < V; i++)
        z += exp(-0.002 * i);
    double cum = 0.0;
    int keep = 0;
    while (cum < 0.5) /* ranks whose cumulative probability first reaches 0.5 */
        cum += exp(-0.002 * keep++) / z;
    struct moe_sampler_params p = plain(77);
    p.top_p = 0.5f;
    struct moe_sampler *s = mk(&p, V);
    draw(s, l, 4000, c, V);
    int max_rank = 0;
    for (int i = 0; i < V; i++)
        if (c[i] && rank_of[i] > max_rank)
            max_rank = rank_of[i];
    printf("nucleus of %d tokens; highest rank drawn %d\n", keep, max_rank);
    CHECK(keep > 64);
    CHECK(max_rank < keep);
    CHECK(max_rank > keep - 40); /* the tail of the nucleus is reachable */
    moe_sampler_free(s);
}

TEST(sampler_min_p_support)
{
    const double probs[5] = {0.5, 0.3, 0.12, 0.05, 0.03};
    float l[5];
    int c[5];
    logits_from_probs(l, probs, 5);
    struct moe_sampler_params p = plain(5);
    p.min_p = 0.2f; /* keeps p >= 0.1 */
    struct moe_sampler *s = mk(&p, 5);
    draw(s, l, 4000, c, 5);
    CHECK(c[0] > 0 && c[1] > 0 && c[2] > 0);
    CHECK(c[3] == 0 && c[4] == 0);
    CHECK_NEAR(c[2] / 4000.0, 0.12 / 0.92, 0.03);
    moe_sampler_free(s);
}

TEST(sampler_temperature_distribution)
{
    float l[2] = {0.0f, (float)log(2.0)};
    int c[2];
    struct moe_sampler_params p = plain(11);
    struct moe_sampler *s = mk(&p, 2);
    draw(s, l, 20000, c, 2);
    CHECK_NEAR(c[1] / 20000.0, 2.0 / 3.0, 0.02);
    moe_sampler_free(s);
    p.temperature = 2.0f; /* p1 / p0 = sqrt(2) */
    s = mk(&p, 2);
    draw(s, l, 20000, c, 2);
    CHECK_NEAR(c[1] / 20000.0, sqrt(2.0) / (1.0 + sqrt(2.0)), 0.02);
    moe_sampler_free(s);
    p.temperature = 0.05f; /* nearly greedy */
    s = mk(&p, 2);
    draw(s, l, 2000, c, 2);
    CHECK(c[1] >= 1995);
    moe_sampler_free(s);
}

TEST(sampler_seed_reproducible)
{
    enum { V = 50, N = 200 };
    float l[V];
    for (int i = 0; i < V; i++)
        l[i] = (float)sin(i * 0.7) * 2.0f;
    struct moe_sampler_params p;
    moe_sampler_defaults(&p);
    p.top_k = 0;
    p.min_p = 0.0f;
    p.top_p = 1.0f;
    p.seed = 1234;
    int32_t a[N], b[N], c[N];
    struct moe_sampler *s1 = mk(&p, V), *s2 = mk(&p, V);
    p.seed = 1235;
    struct moe_sampler *s3 = mk(&p, V);
    int differ = 0;
    for (int i = 0; i < N; i++) {
        a[i] = moe_sampler_sample(s1, l);
        b[i] = moe_sampler_sample(s2, l);
        c[i] = moe_sampler_sample(s3, l);
        differ += a[i] != c[i];
    }
    CHECK(memcmp(a, b, sizeof a) == 0);
    CHECK(differ > N / 4);
    /* reset replays the same sequence */
    moe_sampler_reset(s1);
    for (int i = 0; i < N; i++)
        CHECK_EQ(moe_sampler_sample(s1, l), a[i]);
    moe_sampler_free(s1);
    moe_sampler_free(s2);
    moe_sampler_free(s3);

    /* The generator itself is xoshiro256** seeded by splitmix64 (fixed reference values, so a
     * seed means the same on every build). */
    p.seed = 0;
    s1 = mk(&p, V);
    uint64_t r0 = moe_sampler_rand_u64(s1), r1 = moe_sampler_rand_u64(s1);
    moe_sampler_reset(s1);
    CHECK(moe_sampler_rand_u64(s1) == r0);
    CHECK(moe_sampler_rand_u64(s1) == r1);
    CHECK(r0 != r1);
    double u = moe_sampler_rand_unit(s1);
    CHECK(u >= 0.0 && u < 1.0);
    moe_sampler_free(s1);
}

TEST(sampler_repetition_penalty)
{
    struct moe_sampler_params p = plain(0);
    p.repeat_penalty = 2.0f;
    p.penalty_last_n = 3;
    struct moe_sampler *s = mk(&p, 5);
    moe_sampler_accept(s, 4); /* outside the window of 3 by the end */
    moe_sampler_accept(s, 0);
    moe_sampler_accept(s, 1);
    moe_sampler_accept(s, 1);
    moe_sampler_accept(s, 99); /* not in the vocabulary: ignored */
    float l[5] = {2.0f, -2.0f, 1.0f, 0.5f, 3.0f};
    moe_sampler_apply_penalties(s, l);
    CHECK_NEAR(l[0], 1.0, 1e-6);   /* positive: divided */
    CHECK_NEAR(l[1], -4.0, 1e-6);  /* negative: multiplied, once despite two occurrences */
    CHECK_NEAR(l[2], 1.0, 1e-6);
    CHECK_NEAR(l[3], 0.5, 1e-6);
    CHECK_NEAR(l[4], 3.0, 1e-6);   /* only in the older history */

    /* Greedy after penalties: token 4 (3.0) is not penalised and wins; make 0 the favourite
     * instead and see it lose to 2 once penalised. */
    float g[5] = {2.5f, 0.0f, 1.5f, 0.0f, 0.0f};
    p.temperature = 0.0f;
    struct moe_sampler *gs = mk(&p, 5);
    CHECK_EQ(moe_sampler_sample(gs, g), 0);
    moe_sampler_accept(gs, 0);
    CHECK_EQ(moe_sampler_sample(gs, g), 2);
    CHECK_NEAR(g[0], 2.5, 0); /* the caller's logits are untouched */
    moe_sampler_free(gs);
    moe_sampler_free(s);
}

TEST(sampler_presence_frequency_penalties)
{
    struct moe_sampler_params p = plain(0);
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    p.penalty_last_n = -1; /* whole history */
    struct moe_sampler *s = mk(&p, 4);
    for (int i = 0; i < 100; i++)
        moe_sampler_accept(s, 3);
    moe_sampler_accept(s, 1);
    moe_sampler_accept(s, 1);
    float l[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    moe_sampler_apply_penalties(s, l);
    CHECK_NEAR(l[0], 1.0, 1e-6);
    CHECK_NEAR(l[1], 1.0 - 0.5 - 2 * 0.25, 1e-6);
    CHECK_NEAR(l[2], 1.0, 1e-6);
    CHECK_NEAR(l[3], 1.0 - 0.5 - 100 * 0.25, 1e-5);
    moe_sampler_free(s);

    /* penalty_last_n 0 disables every penalty. */
    p.penalty_last_n = 0;
    p.repeat_penalty = 3.0f;
    s = mk(&p, 4);
    moe_sampler_accept(s, 2);
    float m[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    moe_sampler_apply_penalties(s, m);
    CHECK_NEAR(m[2], 1.0, 0);
    moe_sampler_free(s);
}

TEST(sampler_rejects_bad_params)
{
    struct moe_sampler *s = NULL;
    char err[128];
    struct moe_sampler_params p = plain(0);
    CHECK_EQ(moe_sampler_init(&s, &p, 0, err, sizeof err), MOE_ERANGE);
    p.top_p = 0.0f;
    CHECK_EQ(moe_sampler_init(&s, &p, 10, err, sizeof err), MOE_ERANGE);
    CHECK(strstr(err, "top_p"));
    p = plain(0);
    p.temperature = NAN;
    CHECK_EQ(moe_sampler_init(&s, &p, 10, err, sizeof err), MOE_ERANGE);
    p = plain(0);
    p.repeat_penalty = 0.0f;
    CHECK_EQ(moe_sampler_init(&s, &p, 10, err, sizeof err), MOE_ERANGE);
    p = plain(0);
    p.min_p = 1.5f;
    CHECK_EQ(moe_sampler_init(&s, &p, 10, err, sizeof err), MOE_ERANGE);
    CHECK(s == NULL);
}

/* moe_sampler_rng_state exposes the xoshiro256** state: after a reset it is splitmix64 of the
 * seed (computed here independently), the next output is the state's rotl(s1 * 5, 7) * 9, a
 * sampling draw advances it by exactly one step and a greedy call or an all -inf row not at all. */
TEST(sampler_rng_state)
{
    struct moe_sampler_params p = plain(0x1234abcdull);
    struct moe_sampler *s = mk(&p, 4);
    uint64_t st[4], want[4], x = p.seed;
    for (int i = 0; i < 4; i++) {
        uint64_t z = (x += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        want[i] = z ^ (z >> 31);
    }
    moe_sampler_rng_state(s, st);
    CHECK(memcmp(st, want, sizeof st) == 0);
    uint64_t r1 = st[1] * 5;
    CHECK(moe_sampler_rand_u64(s) == ((r1 << 7) | (r1 >> 57)) * 9);

    /* One sampling call = one generator step: compare with a twin stepped by rand_u64. */
    struct moe_sampler *twin = mk(&p, 4);
    moe_sampler_rand_u64(twin);
    float l[4] = {0.1f, 0.7f, -0.3f, 0.2f};
    moe_sampler_sample(s, l);
    moe_sampler_rand_u64(twin);
    uint64_t a[4], b[4];
    moe_sampler_rng_state(s, a);
    moe_sampler_rng_state(twin, b);
    CHECK(memcmp(a, b, sizeof a) == 0);
    float none[4] = {-INFINITY, NAN, -INFINITY, -INFINITY};
    CHECK_EQ(moe_sampler_sample(s, none), -1);
    moe_sampler_rng_state(s, a);
    CHECK(memcmp(a, b, sizeof a) == 0);
    moe_sampler_free(s);
    moe_sampler_free(twin);

    p.temperature = 0.0f;
    s = mk(&p, 4);
    moe_sampler_sample(s, l);
    moe_sampler_rng_state(s, a);
    CHECK(memcmp(a, want, sizeof a) == 0);
    moe_sampler_free(s);
}

/* moe_logprobs is the log-softmax of the raw logits: checked against a direct computation in
 * long double, with ties ranked by id, -inf and NaN left out of the top list. */
TEST(sampler_logprobs_are_log_softmax)
{
    enum { V = 1000 };
    static float lg[V];
    uint64_t x = 12345;
    for (int i = 0; i < V; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        lg[i] = (float)((double)(x >> 11) / 9007199254740992.0 * 20.0 - 10.0);
    }
    lg[7] = lg[8] = 30.0f;      /* a tie at the top: 7 ranks first */
    lg[9] = -INFINITY;
    lg[10] = NAN;
    long double z = 0;
    for (int i = 0; i < V; i++)
        if (i != 9 && i != 10)
            z += expl((long double)lg[i] - 30.0L);
    const long double lz = 30.0L + logl(z);
    int32_t id[20];
    float lp[20], chosen;
    uint32_t n = moe_logprobs(lg, V, 123, 20, &chosen, id, lp);
    CHECK_EQ(n, 20);
    CHECK_NEAR(chosen, (double)((long double)lg[123] - lz), 1e-5);
    CHECK_EQ(id[0], 7);
    CHECK_EQ(id[1], 8);
    for (uint32_t k = 0; k < n; k++) {
        CHECK_NEAR(lp[k], (double)((long double)lg[id[k]] - lz), 1e-5);
        if (k)
            CHECK(lp[k] <= lp[k - 1]);
    }
    /* Nothing outside the list is more likely than its last entry. */
    for (int i = 0; i < V; i++) {
        bool in = false;
        for (uint32_t k = 0; k < n; k++)
            in |= id[k] == i;
        if (!in && i != 9 && i != 10)
            CHECK(lg[i] <= lg[id[n - 1]]);
    }
    moe_logprobs(lg, V, 9, 0, &chosen, id, lp);
    CHECK(isinf(chosen) && chosen < 0);
    /* Fewer finite logits than asked for; a single finite logit has probability 1. */
    float two[4] = {-INFINITY, 1.0f, NAN, -INFINITY};
    n = moe_logprobs(two, 4, 1, 20, &chosen, id, lp);
    CHECK_EQ(n, 1);
    CHECK_EQ(id[0], 1);
    CHECK_NEAR(chosen, 0.0, 1e-7);
    CHECK_NEAR(lp[0], 0.0, 1e-7);
}

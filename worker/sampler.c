/* Token sampler (see sampler.h for the chain and its semantics). */
#include "worker/sampler.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"

struct cand {
    int32_t id;
    float logit;
};

struct moe_sampler {
    struct moe_sampler_params p;
    uint32_t n_vocab;
    uint64_t rng[4];

    int32_t *hist;      /* accepted tokens, oldest first */
    size_t n_hist, cap_hist;

    float *work;        /* [n_vocab] penalised logits */
    uint32_t *count;    /* [n_vocab] scratch for penalties, all zero between calls */
    struct cand *cand;  /* [n_vocab] */
    struct cand *heap;  /* [n_vocab] scratch for partial selection */
};

void moe_sampler_defaults(struct moe_sampler_params *p)
{
    *p = (struct moe_sampler_params){
        .temperature = 0.8f,
        .top_k = 40,
        .top_p = 0.95f,
        .min_p = 0.05f,
        .repeat_penalty = 1.0f,
        .presence_penalty = 0.0f,
        .frequency_penalty = 0.0f,
        .penalty_last_n = 64,
        .seed = 0,
    };
}

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t moe_sampler_rand_u64(struct moe_sampler *s)
{
    uint64_t *r = s->rng;
    uint64_t result = rotl(r[1] * 5, 7) * 9;
    uint64_t t = r[1] << 17;
    r[2] ^= r[0];
    r[3] ^= r[1];
    r[1] ^= r[2];
    r[0] ^= r[3];
    r[2] ^= t;
    r[3] = rotl(r[3], 45);
    return result;
}

double moe_sampler_rand_unit(struct moe_sampler *s)
{
    return (double)(moe_sampler_rand_u64(s) >> 11) * 0x1.0p-53;
}

void moe_sampler_rng_state(const struct moe_sampler *s, uint64_t state[4])
{
    memcpy(state, s->rng, sizeof s->rng);
}

void moe_sampler_reset(struct moe_sampler *s)
{
    uint64_t x = s->p.seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = splitmix64(&x);
    s->n_hist = 0;
}

int moe_sampler_params_check(const struct moe_sampler_params *p, char *err, size_t errlen)
{
    if (isnan(p->temperature) || isnan(p->top_p) || isnan(p->min_p) || isnan(p->repeat_penalty) ||
        isnan(p->presence_penalty) || isnan(p->frequency_penalty))
        return moe_fail(err, errlen, MOE_ERANGE, "sampler: a parameter is NaN");
    if (!(p->top_p > 0.0f))
        return moe_fail(err, errlen, MOE_ERANGE, "sampler: top_p must be > 0 (got %g)",
                        (double)p->top_p);
    if (p->min_p < 0.0f || p->min_p > 1.0f)
        return moe_fail(err, errlen, MOE_ERANGE, "sampler: min_p must be in [0, 1] (got %g)",
                        (double)p->min_p);
    if (!(p->repeat_penalty > 0.0f) || isinf(p->repeat_penalty))
        return moe_fail(err, errlen, MOE_ERANGE, "sampler: repeat_penalty must be > 0 (got %g)",
                        (double)p->repeat_penalty);
    if (isinf(p->presence_penalty) || isinf(p->frequency_penalty) || isinf(p->temperature))
        return moe_fail(err, errlen, MOE_ERANGE, "sampler: a parameter is infinite");
    return 0;
}

int moe_sampler_init(struct moe_sampler **out, const struct moe_sampler_params *p,
                     uint32_t n_vocab, char *err, size_t errlen)
{
    if (n_vocab == 0)
        return moe_fail(err, errlen, MOE_ERANGE, "sampler: empty vocabulary");
    int rc = moe_sampler_params_check(p, err, errlen);
    if (rc)
        return rc;

    struct moe_sampler *s = calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    s->p = *p;
    s->n_vocab = n_vocab;
    s->work = malloc(sizeof *s->work * n_vocab);
    s->count = calloc(n_vocab, sizeof *s->count);
    s->cand = malloc(sizeof *s->cand * n_vocab);
    s->heap = malloc(sizeof *s->heap * n_vocab);
    if (!s->work || !s->count || !s->cand || !s->heap) {
        moe_sampler_free(s);
        return -ENOMEM;
    }
    moe_sampler_reset(s);
    *out = s;
    return 0;
}

void moe_sampler_free(struct moe_sampler *s)
{
    if (!s)
        return;
    free(s->hist);
    free(s->work);
    free(s->count);
    free(s->cand);
    free(s->heap);
    free(s);
}

void moe_sampler_accept(struct moe_sampler *s, int32_t token)
{
    if (token < 0 || (uint32_t)token >= s->n_vocab)
        return;
    /* A bounded window only needs its last entries; keep at most twice the window so the
     * history does not grow without limit over long generations. */
    if (s->p.penalty_last_n >= 0 && s->n_hist >= 2 * (size_t)s->p.penalty_last_n + 16) {
        size_t keep = (size_t)s->p.penalty_last_n;
        memmove(s->hist, s->hist + s->n_hist - keep, keep * sizeof *s->hist);
        s->n_hist = keep;
    }
    if (s->n_hist == s->cap_hist) {
        size_t cap = s->cap_hist ? s->cap_hist * 2 : 256;
        int32_t *h = realloc(s->hist, cap * sizeof *h);
        if (!h)
            return; /* Penalties then miss this token; sampling itself still works. */
        s->hist = h;
        s->cap_hist = cap;
    }
    s->hist[s->n_hist++] = token;
}

void moe_sampler_apply_penalties(struct moe_sampler *s, float *logits)
{
    const struct moe_sampler_params *p = &s->p;
    if (p->penalty_last_n == 0 || s->n_hist == 0)
        return;
    if (p->repeat_penalty == 1.0f && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f)
        return;
    size_t n = s->n_hist;
    if (p->penalty_last_n > 0 && (size_t)p->penalty_last_n < n)
        n = (size_t)p->penalty_last_n;
    const int32_t *w = s->hist + s->n_hist - n;

    for (size_t i = 0; i < n; i++)
        s->count[w[i]]++;
    for (size_t i = 0; i < n; i++) {
        int32_t id = w[i];
        uint32_t c = s->count[id];
        if (c == 0)
            continue; /* already handled: each distinct token is penalised once */
        float l = logits[id];
        if (p->repeat_penalty != 1.0f)
            l = l > 0.0f ? l / p->repeat_penalty : l * p->repeat_penalty;
        l -= p->presence_penalty + p->frequency_penalty * (float)c;
        logits[id] = l;
        s->count[id] = 0;
    }
}

/* Total order used for every ranking: higher logit first, lower id first on ties, so results do
 * not depend on the sort algorithm. */
static inline int cand_before(const struct cand *a, const struct cand *b)
{
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static int cand_cmp(const void *x, const void *y)
{
    const struct cand *a = x, *b = y;
    return cand_before(a, b) ? -1 : cand_before(b, a) ? 1 : 0;
}

static void heap_sift_down(struct cand *h, size_t n, size_t i)
{
    /* Min-heap under cand_before: the root is the candidate ranked last. */
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && cand_before(&h[m], &h[l]))
            m = l;
        if (r < n && cand_before(&h[m], &h[r]))
            m = r;
        if (m == i)
            return;
        struct cand t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* Reorders c[0..n) so that its first k entries are the k best, sorted (O(n log k)). */
static void select_top(struct cand *c, size_t n, size_t k, struct cand *heap)
{
    if (k >= n) {
        qsort(c, n, sizeof *c, cand_cmp);
        return;
    }
    memcpy(heap, c, k * sizeof *c);
    for (size_t i = k / 2; i-- > 0;)
        heap_sift_down(heap, k, i);
    for (size_t i = k; i < n; i++) {
        if (cand_before(&c[i], &heap[0])) {
            heap[0] = c[i];
            heap_sift_down(heap, k, 0);
        }
    }
    /* The root is the k-th best; under a total order exactly k entries rank at or above it.
     * Partition them to the front (the rest stay in the array for a later, wider pass). */
    struct cand kth = heap[0];
    size_t front = 0;
    for (size_t i = 0; i < n; i++) {
        if (c[i].id == kth.id || cand_before(&c[i], &kth)) {
            struct cand t = c[front];
            c[front++] = c[i];
            c[i] = t;
        }
    }
    qsort(c, k, sizeof *c, cand_cmp);
}

static float cand_max(const struct cand *c, size_t n)
{
    float m = -INFINITY;
    for (size_t i = 0; i < n; i++)
        if (c[i].logit > m)
            m = c[i].logit;
    return m;
}

int32_t moe_sampler_sample(struct moe_sampler *s, const float *logits)
{
    const struct moe_sampler_params *p = &s->p;
    float *w = s->work;
    memcpy(w, logits, sizeof *w * s->n_vocab);
    moe_sampler_apply_penalties(s, w);

    if (!(p->temperature > 0.0f)) {
        int32_t best = -1;
        for (uint32_t i = 0; i < s->n_vocab; i++)
            if (w[i] > -INFINITY && (best < 0 || w[i] > w[best]))
                best = (int32_t)i;
        return best;
    }

    struct cand *c = s->cand;
    size_t n = 0;
    for (uint32_t i = 0; i < s->n_vocab; i++)
        if (w[i] > -INFINITY) /* false for NaN too */
            c[n++] = (struct cand){(int32_t)i, w[i]};
    if (n == 0)
        return -1;

    int sorted = 0;
    if (p->top_k > 0 && (size_t)p->top_k < n) {
        select_top(c, n, (size_t)p->top_k, s->heap);
        n = (size_t)p->top_k;
        sorted = 1;
    }

    if (p->top_p < 1.0f && n > 1) {
        float mx = cand_max(c, n);
        double z = 0.0;
        for (size_t i = 0; i < n; i++)
            z += exp((double)(c[i].logit - mx));
        /* The nucleus is usually small: rank a growing prefix instead of sorting everything. */
        size_t m = sorted ? n : (n < 64 ? n : 64);
        for (;;) {
            if (!sorted || m < n)
                select_top(c, n, m, s->heap);
            double cum = 0.0;
            size_t keep = 0;
            for (size_t i = 0; i < m; i++) {
                cum += exp((double)(c[i].logit - mx)) / z;
                keep = i + 1;
                if (cum >= (double)p->top_p)
                    break;
            }
            if (cum >= (double)p->top_p || m == n) {
                n = keep;
                break;
            }
            m = m * 8 < n / 4 ? m * 8 : n; /* past a quarter, one full sort is cheaper */
        }
        sorted = 1;
    }

    if (p->min_p > 0.0f && n > 1) {
        float mx = cand_max(c, n);
        /* p_i >= min_p * p_max  <=>  logit_i >= max + ln(min_p). */
        float cut = mx + logf(p->min_p);
        size_t k = 0;
        for (size_t i = 0; i < n; i++)
            if (c[i].logit >= cut)
                c[k++] = c[i];
        n = k;
    }

    float mx = cand_max(c, n);
    double z = 0.0;
    for (size_t i = 0; i < n; i++)
        z += exp((double)(c[i].logit - mx) / (double)p->temperature);
    double u = moe_sampler_rand_unit(s) * z, cum = 0.0;
    for (size_t i = 0; i < n; i++) {
        cum += exp((double)(c[i].logit - mx) / (double)p->temperature);
        if (u < cum)
            return c[i].id;
    }
    return c[n - 1].id; /* rounding left u just above the total */
}

uint32_t moe_logprobs(const float *logits, uint32_t n_vocab, int32_t token, uint32_t n_top,
                      float *chosen_lp, int32_t *top_id, float *top_lp)
{
    float mx = -INFINITY;
    for (uint32_t i = 0; i < n_vocab; i++)
        if (logits[i] > mx)
            mx = logits[i];
    double z = 0.0;
    if (mx > -INFINITY)
        for (uint32_t i = 0; i < n_vocab; i++)
            if (logits[i] > -INFINITY)
                z += exp((double)logits[i] - (double)mx);
    const double lz = mx > -INFINITY ? (double)mx + log(z) : 0.0;
    float lt = token >= 0 && (uint32_t)token < n_vocab ? logits[token] : -INFINITY;
    *chosen_lp = lt > -INFINITY && mx > -INFINITY ? (float)((double)lt - lz) : -INFINITY;
    /* The best n_top by insertion into a short sorted list: ranked as the sampler ranks. */
    uint32_t k = 0;
    for (uint32_t i = 0; i < n_vocab && n_top; i++) {
        float l = logits[i];
        if (!(l > -INFINITY))
            continue;
        if (k == n_top && !(l > top_lp[k - 1]))
            continue; /* ties keep the lower id already held */
        uint32_t at = k < n_top ? k++ : k - 1;
        while (at > 0 && l > top_lp[at - 1]) {
            top_lp[at] = top_lp[at - 1];
            top_id[at] = top_id[at - 1];
            at--;
        }
        top_lp[at] = l;
        top_id[at] = (int32_t)i;
    }
    for (uint32_t i = 0; i < k; i++)
        top_lp[i] = (float)((double)top_lp[i] - lz);
    return k;
}

/* Workloads and complementary hot sets (see workload.h for the rules). */
#include "store/workload.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "store/err.h"

/* Coverages within this of the best count as equal when a plan places a key. */
#define WL_COVER_MARGIN 0.02
/* Traffic below this is none (floating leftovers of splits). */
#define WL_EPS 1e-9

static bool bit(const uint8_t *b, size_t i)
{
    return (b[i / 8] >> (i % 8)) & 1;
}

int moe_wl_init(struct moe_wl_table *t, uint32_t n_layer, uint32_t n_expert, uint32_t n_workers,
                uint32_t cap)
{
    memset(t, 0, sizeof *t);
    if (!n_layer || !n_expert || !n_workers || n_workers > MOE_WL_MAX_WORKERS || !cap)
        return MOE_ERANGE;
    t->e = calloc(cap, sizeof *t->e);
    if (!t->e)
        return -ENOMEM;
    t->n_layer = n_layer;
    t->n_expert = n_expert;
    t->n_workers = n_workers;
    t->cap = cap;
    return 0;
}

static void entry_free(struct moe_wl_entry *e)
{
    free(e->hist);
    free(e->served);
    memset(e, 0, sizeof *e);
}

void moe_wl_free(struct moe_wl_table *t)
{
    for (uint32_t i = 0; t->e && i < t->n; i++)
        entry_free(&t->e[i]);
    free(t->e);
    memset(t, 0, sizeof *t);
}

uint64_t moe_wl_key(const int32_t *prompt, uint32_t n)
{
    if (n < MOE_WL_KEY_TOKENS)
        return 0;
    const uint64_t h = XXH3_64bits_withSeed(prompt, MOE_WL_KEY_TOKENS * sizeof *prompt,
                                            0x6d6f652d776c6b79ull);
    return h ? h : 1;
}

static struct moe_wl_entry *find(struct moe_wl_table *t, uint64_t key)
{
    for (uint32_t i = 0; i < t->n; i++)
        if (t->e[i].key == key) {
            t->e[i].used = ++t->clock;
            return &t->e[i];
        }
    return NULL;
}

const struct moe_wl_entry *moe_wl_find(struct moe_wl_table *t, uint64_t key)
{
    return key ? find(t, key) : NULL;
}

int moe_wl_learn(struct moe_wl_table *t, uint64_t key, uint32_t worker, const uint32_t *sig,
                 uint32_t tokens)
{
    if (!key || worker >= t->n_workers)
        return MOE_ERANGE;
    const size_t n = (size_t)t->n_layer * t->n_expert;
    struct moe_wl_entry *e = find(t, key);
    if (!e) {
        double *hist = calloc(n, sizeof *hist), *served = calloc(t->n_workers, sizeof *served);
        if (!hist || !served) {
            free(hist);
            free(served);
            return -ENOMEM;
        }
        if (t->n < t->cap) {
            e = &t->e[t->n++];
        } else {
            e = &t->e[0];
            for (uint32_t i = 1; i < t->n; i++)
                if (t->e[i].used < e->used)
                    e = &t->e[i];
            entry_free(e);
            t->evictions++;
        }
        e->key = key;
        e->hist = hist;
        e->served = served;
        e->used = ++t->clock;
    }
    /* Every key's traffic decays by one keyed request; this key gains it. */
    const double td = exp2(-1.0 / MOE_WL_TRAFFIC_HALF_LIFE);
    for (uint32_t i = 0; i < t->n; i++) {
        t->e[i].traffic *= td;
        for (uint32_t w = 0; w < t->n_workers; w++)
            t->e[i].served[w] *= td;
    }
    e->traffic += 1.0;
    e->served[worker] += 1.0;
    e->requests++;
    e->tokens += tokens;
    t->requests++;
    if (tokens && sig) {
        const double hd = exp2(-1.0 / MOE_WL_HALF_LIFE);
        for (size_t i = 0; i < n; i++)
            e->hist[i] = e->hist[i] * hd + sig[i];
        e->n = e->n * hd + 1.0;
    }
    return 0;
}

double moe_wl_traffic(const struct moe_wl_table *t)
{
    double s = 0;
    for (uint32_t i = 0; i < t->n; i++)
        s += t->e[i].traffic;
    return s;
}

/* Coverage of routing m ([L][E]) by a hot set given as bits (or as bytes when hb is set). */
static double cover(uint32_t L, uint32_t E, const double *m, const uint8_t *hot, bool bytes)
{
    double all = 0, hit = 0;
    for (uint32_t l = 0; l < L; l++) {
        const size_t o = (size_t)l * E;
        double la = 0, lh = 0;
        uint32_t nh = 0;
        for (uint32_t x = 0; x < E; x++) {
            const bool h = bytes ? hot[o + x] != 0 : bit(hot, o + x);
            la += m[o + x];
            lh += h ? m[o + x] : 0;
            nh += h;
        }
        if (nh == E)
            continue; /* held whole: every routing is a hit, whatever the placement */
        all += la;
        hit += lh;
    }
    return all > 0 ? hit / all : 1.0;
}

double moe_wl_coverage(const struct moe_wl_table *t, const struct moe_wl_entry *e,
                       const uint8_t *hot)
{
    if (!e || !(e->n > 0))
        return -1.0;
    return cover(t->n_layer, t->n_expert, e->hist, hot, false);
}

/* ---------------------------------------------------------------------------------------------
 * Plans */

struct rank {
    double v;
    uint32_t id;
};

static int cmp_rank(const void *a, const void *b)
{
    const struct rank *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* Per layer, the slots[l] experts of highest nonzero value (ties to the lower id), as bytes;
 * every expert where slots[l] >= E. */
static void top_by(uint32_t L, uint32_t E, const uint32_t *slots, const double *v, uint8_t *hot,
                   struct rank *tmp)
{
    for (uint32_t l = 0; l < L; l++) {
        const size_t o = (size_t)l * E;
        if (slots[l] >= E) {
            memset(hot + o, 1, E);
            continue;
        }
        memset(hot + o, 0, E);
        uint32_t nz = 0;
        for (uint32_t x = 0; x < E; x++)
            if (v[o + x] > 0)
                tmp[nz++] = (struct rank){v[o + x], x};
        qsort(tmp, nz, sizeof *tmp, cmp_rank);
        for (uint32_t i = 0; i < nz && i < slots[l]; i++)
            hot[o + tmp[i].id] = 1;
    }
}

void moe_wl_pinned_by(uint32_t n_layer, uint32_t n_expert, const uint32_t *slots,
                      const uint64_t *counts, uint8_t *hot)
{
    const size_t n = (size_t)n_layer * n_expert;
    double *v = calloc(n, sizeof *v);
    uint8_t *b = calloc(n, 1);
    struct rank *tmp = malloc(sizeof *tmp * n_expert);
    memset(hot, 0, (n + 7) / 8);
    if (v && b && tmp) {
        for (size_t i = 0; i < n; i++)
            v[i] = (double)counts[i];
        top_by(n_layer, n_expert, slots, v, b, tmp);
        for (size_t i = 0; i < n; i++)
            if (b[i])
                hot[i / 8] |= (uint8_t)(1u << (i % 8));
    }
    free(v);
    free(b);
    free(tmp);
}

void moe_wl_plan_free(struct moe_wl_plan *p)
{
    for (uint32_t w = 0; p->counts && w < p->n_workers; w++)
        free(p->counts[w]);
    free(p->counts);
    free(p->load);
    free(p->key);
    free(p->key_share);
    free(p->assign);
    memset(p, 0, sizeof *p);
}

/* Scratch of one plan. */
struct planner {
    uint32_t L, E, W;
    size_t n;
    const uint32_t *ids;      /* [W] each worker's index in the table, or NULL: w */
    uint32_t *slots;          /* [W][L] pinned experts per layer */
    double **mean;            /* [K][n] each planned key's typical request (hist / n) */
    double **wc;              /* [W][n] each worker's planned counts */
    uint8_t **hot;            /* [W][n] the experts those counts pin */
    double *cov;              /* [K][W] coverage of each key by each worker's pinned experts now */
    struct rank *tmp;         /* [E] */
};

static void planner_free(struct planner *pl, uint32_t K)
{
    for (uint32_t k = 0; pl->mean && k < K; k++)
        free(pl->mean[k]);
    for (uint32_t w = 0; w < pl->W; w++) {
        if (pl->wc)
            free(pl->wc[w]);
        if (pl->hot)
            free(pl->hot[w]);
    }
    free(pl->mean);
    free(pl->wc);
    free(pl->hot);
    free(pl->slots);
    free(pl->cov);
    free(pl->tmp);
}

/* Keys to plan: those with MOE_WL_KEY_FLOOR of the traffic and a routing, heaviest first (ties
 * to the lower key). Returns how many, their entries in *order. */
static uint32_t plan_keys(const struct moe_wl_table *t, const struct moe_wl_entry **order,
                          double total)
{
    uint32_t K = 0;
    for (uint32_t i = 0; i < t->n; i++) {
        const struct moe_wl_entry *e = &t->e[i];
        if (!(e->n > 0) || e->traffic < MOE_WL_KEY_FLOOR * total)
            continue;
        uint32_t j = K++;
        while (j > 0 && (order[j - 1]->traffic < e->traffic ||
                         (order[j - 1]->traffic == e->traffic && order[j - 1]->key > e->key))) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = e;
    }
    return K;
}

/* Where key k's next part goes: among the workers with room for it (at least a quarter of a
 * share, or all that is left of the key), the best coverage now (within WL_COVER_MARGIN: the one
 * that served most of its requests, then the least loaded, then the lowest index); with no
 * room anywhere, the least loaded. */
static uint32_t place_key(const struct planner *pl, const struct moe_wl_entry *e, uint32_t k,
                          const double *load, double cap, double share, double left)
{
    const double need = left < share / 4 ? left : share / 4;
    double best_cov = -1;
    for (uint32_t w = 0; w < pl->W; w++)
        if (cap - load[w] >= need - WL_EPS && pl->cov[(size_t)k * pl->W + w] > best_cov)
            best_cov = pl->cov[(size_t)k * pl->W + w];
    int32_t best = -1;
    for (uint32_t w = 0; w < pl->W; w++) {
        if (cap - load[w] < need - WL_EPS)
            continue;
        if (pl->cov[(size_t)k * pl->W + w] < best_cov - WL_COVER_MARGIN)
            continue;
        const double sw = e->served[pl->ids ? pl->ids[w] : w];
        const double sb = best < 0 ? 0 : e->served[pl->ids ? pl->ids[best] : (uint32_t)best];
        if (best < 0 || sw > sb || (sw == sb && load[w] < load[best]))
            best = (int32_t)w;
    }
    if (best >= 0)
        return (uint32_t)best;
    uint32_t least = 0;
    for (uint32_t w = 1; w < pl->W; w++)
        if (load[w] < load[least])
            least = w;
    return least;
}

int moe_wl_plan(struct moe_wl_plan *out, const struct moe_wl_table *t, uint32_t n_workers,
                const uint32_t *ids, const uint8_t *const *hot, const uint64_t *by)
{
    memset(out, 0, sizeof *out);
    if (!n_workers || n_workers > MOE_WL_MAX_WORKERS || n_workers > t->n_workers)
        return MOE_ERANGE;
    for (uint32_t w = 0; ids && w < n_workers; w++)
        if (ids[w] >= t->n_workers)
            return MOE_ERANGE;
    const uint32_t L = t->n_layer, E = t->n_expert, W = n_workers;
    const size_t n = (size_t)L * E;
    struct planner pl = {.L = L, .E = E, .W = W, .n = n, .ids = ids};
    const struct moe_wl_entry **order = calloc(t->n ? t->n : 1, sizeof *order);
    const double total = moe_wl_traffic(t);
    const uint32_t K = order ? plan_keys(t, order, total) : 0;
    out->n_workers = W;
    out->n_layer = L;
    out->n_expert = E;
    out->load = calloc(W, sizeof *out->load);
    out->key = calloc(K ? K : 1, sizeof *out->key);
    out->key_share = calloc(K ? K : 1, sizeof *out->key_share);
    out->assign = calloc((size_t)(K ? K : 1) * W, sizeof *out->assign);
    pl.slots = calloc((size_t)W * L, sizeof *pl.slots);
    pl.mean = calloc(K ? K : 1, sizeof *pl.mean);
    pl.wc = calloc(W, sizeof *pl.wc);
    pl.hot = calloc(W, sizeof *pl.hot);
    pl.cov = calloc((size_t)(K ? K : 1) * W, sizeof *pl.cov);
    pl.tmp = calloc(E, sizeof *pl.tmp);
    int rc = order && out->load && out->key && out->key_share && out->assign && pl.slots &&
                     pl.mean && pl.wc && pl.hot && pl.cov && pl.tmp
                 ? 0
                 : -ENOMEM;
    for (uint32_t w = 0; !rc && w < W; w++) {
        pl.wc[w] = calloc(n, sizeof *pl.wc[w]);
        pl.hot[w] = malloc(n);
        if (!pl.wc[w] || !pl.hot[w])
            rc = -ENOMEM;
    }
    for (uint32_t k = 0; !rc && k < K; k++) {
        if (!(pl.mean[k] = malloc(sizeof *pl.mean[k] * n))) {
            rc = -ENOMEM;
            break;
        }
        for (size_t i = 0; i < n; i++)
            pl.mean[k][i] = order[k]->hist[i] / order[k]->n;
    }
    if (rc)
        goto done;

    /* Each worker's pinned experts per layer, and how well its pinned experts serve each key. */
    double planned = 0;
    for (uint32_t k = 0; k < K; k++)
        planned += order[k]->traffic;
    for (uint32_t w = 0; w < W; w++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t x = 0; x < E; x++)
                pl.slots[(size_t)w * L + l] += bit(hot[w], (size_t)l * E + x);
    for (uint32_t k = 0; k < K; k++) {
        out->key[k] = order[k]->key;
        out->key_share[k] = planned > 0 ? order[k]->traffic / planned : 0;
        for (uint32_t w = 0; w < W; w++)
            pl.cov[(size_t)k * W + w] = cover(L, E, pl.mean[k], hot[w], false);
    }
    out->n_keys = K;

    /* The identical placement: every worker pins its share of `by`, requests spread evenly. */
    double *byd = malloc(sizeof *byd * n);
    if (!byd) {
        rc = -ENOMEM;
        goto done;
    }
    for (size_t i = 0; i < n; i++)
        byd[i] = by ? (double)by[i] : 0;
    double hit_id = 0;
    for (uint32_t w = 0; w < W; w++) {
        top_by(L, E, pl.slots + (size_t)w * L, byd, pl.hot[w], pl.tmp);
        for (uint32_t k = 0; k < K; k++)
            hit_id += out->key_share[k] * cover(L, E, pl.mean[k], pl.hot[w], true) / W;
    }
    out->hit_identical = K ? hit_id : 0;

    uint32_t strong = 0;
    for (uint32_t k = 0; k < K; k++)
        strong += order[k]->traffic >= MOE_WL_MIN_SHARE * total;
    if (W < 2)
        snprintf(out->why, sizeof out->why, "fewer than two GPU workers offload");
    else if (t->requests < MOE_WL_MIN_REQUESTS)
        snprintf(out->why, sizeof out->why, "%llu keyed requests learned (%d needed)",
                 (unsigned long long)t->requests, MOE_WL_MIN_REQUESTS);
    else if (strong < 2)
        snprintf(out->why, sizeof out->why, "fewer than two keys with %.0f%% of the traffic",
                 100 * MOE_WL_MIN_SHARE);
    if (out->why[0]) {
        out->hit_complementary = out->hit_identical;
        free(byd);
        goto done;
    }

    /* Each worker starts from a small weight of the profile, scaled to its share of the keys'
     * routings in each layer, so that experts no key has seen keep the profile's order. */
    const double share = 1.0 / W, cap = share * (1.0 + MOE_WL_SLACK);
    for (uint32_t l = 0; l < L; l++) {
        const size_t o = (size_t)l * E;
        double mass = 0, pmass = 0;
        for (uint32_t k = 0; k < K; k++)
            for (uint32_t x = 0; x < E; x++)
                mass += out->key_share[k] * pl.mean[k][o + x];
        for (uint32_t x = 0; x < E; x++)
            pmass += byd[o + x];
        if (!(pmass > 0))
            continue;
        for (uint32_t w = 0; w < W; w++)
            for (uint32_t x = 0; x < E; x++)
                pl.wc[w][o + x] = MOE_WL_PROFILE_WEIGHT * share * mass * byd[o + x] / pmass;
    }
    free(byd);
    for (uint32_t k = 0; k < K; k++) {
        double left = out->key_share[k];
        while (left > WL_EPS) {
            const uint32_t w = place_key(&pl, order[k], k, out->load, cap, share, left);
            double give = cap - out->load[w];
            /* The rest where it fits, where nothing has room, or where what would be left is
             * under an eighth of a share (no slivers). */
            if (give > left || give < share / 4 - WL_EPS || left - give < share / 8)
                give = left;
            out->assign[(size_t)k * W + w] += give;
            out->load[w] += give;
            left -= give;
            for (size_t i = 0; i < n; i++)
                pl.wc[w][i] += give * pl.mean[k][i];
        }
    }

    /* The counts, scaled to integers (the largest about 2^32), and the sets they pin. */
    double mx = 0;
    for (uint32_t w = 0; w < W; w++)
        for (size_t i = 0; i < n; i++)
            mx = pl.wc[w][i] > mx ? pl.wc[w][i] : mx;
    const double scale = mx > 0 ? 4294967296.0 / mx : 0;
    if (!(out->counts = calloc(W, sizeof *out->counts))) {
        rc = -ENOMEM;
        goto done;
    }
    for (uint32_t w = 0; w < W; w++) {
        if (!(out->counts[w] = malloc(sizeof *out->counts[w] * n))) {
            rc = -ENOMEM;
            goto done;
        }
        for (size_t i = 0; i < n; i++) {
            out->counts[w][i] = (uint64_t)llround(pl.wc[w][i] * scale);
            pl.wc[w][i] = (double)out->counts[w][i];
        }
        top_by(L, E, pl.slots + (size_t)w * L, pl.wc[w], pl.hot[w], pl.tmp);
    }
    double hit_c = 0;
    for (uint32_t k = 0; k < K; k++)
        for (uint32_t w = 0; w < W; w++)
            if (out->assign[(size_t)k * W + w] > 0)
                hit_c += out->assign[(size_t)k * W + w] * cover(L, E, pl.mean[k], pl.hot[w], true);
    out->hit_complementary = hit_c;
    out->active = true;
done:
    planner_free(&pl, K);
    free(order);
    if (rc)
        moe_wl_plan_free(out);
    return rc;
}

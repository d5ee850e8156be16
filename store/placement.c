/* Placement of hot experts under a byte budget (see placement.h for the rule). */
#include "store/placement.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"

struct sort_ctx_item {
    uint64_t count;
    uint32_t id;
};

static int cmp_item(const void *a, const void *b)
{
    const struct sort_ctx_item *x = a, *y = b;
    if (x->count != y->count)
        return x->count > y->count ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

void moe_placement_free(struct moe_placement *p)
{
    if (!p)
        return;
    free(p->hot);
    free(p->n_hot);
    free(p->hit_rate);
    memset(p, 0, sizeof *p);
}

int moe_placement_compute(struct moe_placement *out, uint32_t n_layer, uint32_t n_expert,
                          uint32_t n_expert_used, const uint64_t *expert_bytes,
                          const uint64_t *counts, uint64_t budget, char *err, size_t errlen)
{
    int rc = 0;
    struct moe_placement p;
    uint32_t *order = NULL;      /* [n_layer][n_expert]: experts by decreasing count */
    double *share = NULL;        /* [n_layer][n_expert]: share of the layer's routings, by rank */
    bool *active = NULL;
    struct sort_ctx_item *tmp = NULL;
    memset(&p, 0, sizeof p);
    if (err && errlen)
        err[0] = '\0';
    if (n_layer == 0 || n_expert == 0)
        return moe_fail(err, errlen, MOE_ERANGE, "placement: %u layers x %u experts", n_layer,
                        n_expert);
    for (uint32_t l = 0; l < n_layer; l++)
        if (expert_bytes[l] == 0)
            return moe_fail(err, errlen, MOE_ERANGE, "placement: layer %u: expert size is 0", l);

    size_t n = (size_t)n_layer * n_expert;
    p.n_layer = n_layer;
    p.n_expert = n_expert;
    p.hot = calloc(n, 1);
    p.n_hot = calloc(n_layer, sizeof *p.n_hot);
    p.hit_rate = calloc(n_layer, sizeof *p.hit_rate);
    order = malloc(n * sizeof *order);
    share = malloc(n * sizeof *share);
    active = malloc(n_layer * sizeof *active);
    tmp = malloc(n_expert * sizeof *tmp);
    if (!p.hot || !p.n_hot || !p.hit_rate || !order || !share || !active || !tmp) {
        rc = moe_fail(err, errlen, -ENOMEM, "placement: out of memory");
        goto fail;
    }

    for (uint32_t l = 0; l < n_layer; l++) {
        uint64_t total = 0;
        for (uint32_t e = 0; e < n_expert; e++) {
            uint64_t c = counts ? counts[(size_t)l * n_expert + e] : 0;
            tmp[e] = (struct sort_ctx_item){c, e};
            total = c > UINT64_MAX - total ? UINT64_MAX : total + c;
        }
        qsort(tmp, n_expert, sizeof *tmp, cmp_item);
        for (uint32_t i = 0; i < n_expert; i++) {
            order[(size_t)l * n_expert + i] = tmp[i].id;
            share[(size_t)l * n_expert + i] =
                total ? (double)tmp[i].count / (double)total : 1.0 / n_expert;
        }
        active[l] = true;
    }

    /* Step 1: the floor, the same number of slots in every layer. */
    uint64_t per_slot = 0; /* bytes of one slot in every layer */
    bool per_slot_overflow = false;
    for (uint32_t l = 0; l < n_layer; l++) {
        if (expert_bytes[l] > UINT64_MAX - per_slot)
            per_slot_overflow = true;
        else
            per_slot += expert_bytes[l];
    }
    uint64_t f = per_slot_overflow ? 0 : budget / per_slot;
    if (f > n_expert_used)
        f = n_expert_used;
    if (f > n_expert)
        f = n_expert;
    uint64_t left = budget - f * (per_slot_overflow ? 0 : per_slot);
    p.floor = (uint32_t)f;
    for (uint32_t l = 0; l < n_layer; l++)
        for (uint32_t i = 0; i < f; i++)
            p.hot[(size_t)l * n_expert + order[(size_t)l * n_expert + i]] = 1;
    for (uint32_t l = 0; l < n_layer; l++)
        p.n_hot[l] = (uint32_t)f;

    /* Step 2: greedy by share per byte (slots only, when there is no profile). */
    for (;;) {
        int best = -1;
        double best_v = 0;
        for (uint32_t l = 0; l < n_layer; l++) {
            if (!active[l] || p.n_hot[l] == n_expert)
                continue;
            double v = counts ? share[(size_t)l * n_expert + p.n_hot[l]] / (double)expert_bytes[l]
                              : 1.0;
            if (best < 0 || v > best_v || (v == best_v && p.n_hot[l] < p.n_hot[best])) {
                best = (int)l;
                best_v = v;
            }
        }
        if (best < 0)
            break;
        if (expert_bytes[best] > left) {
            active[best] = false;
            continue;
        }
        left -= expert_bytes[best];
        uint32_t e = order[(size_t)best * n_expert + p.n_hot[best]];
        p.hot[(size_t)best * n_expert + e] = 1;
        p.n_hot[best]++;
    }

    for (uint32_t l = 0; l < n_layer; l++) {
        double h = 0;
        for (uint32_t i = 0; i < p.n_hot[l]; i++)
            h += share[(size_t)l * n_expert + i];
        p.hit_rate[l] = h > 1.0 ? 1.0 : h;
        p.bytes_used += (uint64_t)p.n_hot[l] * expert_bytes[l];
    }
    MOE_ASSERT(p.bytes_used <= budget);
    *out = p;
    rc = 0;
fail:
    if (rc)
        moe_placement_free(&p);
    free(order);
    free(share);
    free(active);
    free(tmp);
    return rc;
}

/* Layer l's top-k experts by c (ties: lower id) into mark[n_expert] (1 = in). */
static void top_k(const uint64_t *c, uint32_t n_expert, uint32_t k, uint8_t *mark, uint32_t *order)
{
    for (uint32_t x = 0; x < n_expert; x++) {
        order[x] = x;
        mark[x] = 0;
    }
    for (uint32_t i = 1; i < n_expert; i++) { /* insertion, stable: equal counts keep id order */
        uint32_t v = order[i], j = i;
        while (j > 0 && c[order[j - 1]] < c[v]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = v;
    }
    for (uint32_t i = 0; i < k && i < n_expert; i++)
        mark[order[i]] = 1;
}

int moe_placement_heldout(uint32_t n_layer, uint32_t n_expert, const uint32_t *slots,
                          const uint64_t *profile, const uint64_t *older, const uint64_t *newer,
                          double *current, double *fresh)
{
    uint8_t *a = malloc(n_expert ? n_expert : 1), *b = malloc(n_expert ? n_expert : 1);
    uint32_t *order = malloc(sizeof *order * (n_expert ? n_expert : 1));
    if (!a || !b || !order) {
        free(a), free(b), free(order);
        return -ENOMEM;
    }
    double tot = 0, cur = 0, fr = 0;
    for (uint32_t l = 0; l < n_layer; l++) {
        if (slots[l] >= n_expert)
            continue;
        const size_t o = (size_t)l * n_expert;
        top_k(profile + o, n_expert, slots[l], a, order);
        top_k(older + o, n_expert, slots[l], b, order);
        for (uint32_t x = 0; x < n_expert; x++) {
            const double v = (double)newer[o + x];
            tot += v;
            cur += a[x] ? v : 0;
            fr += b[x] ? v : 0;
        }
    }
    free(a), free(b), free(order);
    *current = tot > 0 ? cur / tot : 1.0;
    *fresh = tot > 0 ? fr / tot : 1.0;
    return 0;
}

int moe_drift_init(struct moe_drift *d, uint32_t n_layer, uint32_t n_expert, uint64_t window,
                   double margin)
{
    memset(d, 0, sizeof *d);
    const size_t n = (size_t)n_layer * n_expert;
    d->n_layer = n_layer;
    d->n_expert = n_expert;
    d->window = window ? window : 1;
    d->margin = margin;
    d->win[0] = calloc(n ? n : 1, sizeof(uint64_t));
    d->win[1] = calloc(n ? n : 1, sizeof(uint64_t));
    d->recent = calloc(n ? n : 1, sizeof(uint64_t));
    if (!d->win[0] || !d->win[1] || !d->recent) {
        moe_drift_free(d);
        return -ENOMEM;
    }
    return 0;
}

void moe_drift_free(struct moe_drift *d)
{
    free(d->win[0]);
    free(d->win[1]);
    free(d->recent);
    d->win[0] = d->win[1] = d->recent = NULL;
}

int moe_drift_add(struct moe_drift *d, const uint64_t *counts, uint64_t n_tokens,
                  const uint64_t *profile, const uint32_t *slots)
{
    const size_t n = (size_t)d->n_layer * d->n_expert;
    for (size_t i = 0; i < n; i++)
        d->win[1][i] += counts[i];
    d->tokens[1] += n_tokens;
    if (d->tokens[1] < d->window)
        return 0;
    int changed = 0;
    if (d->tokens[0] && slots && profile) {
        double cur, fr;
        int rc = moe_placement_heldout(d->n_layer, d->n_expert, slots, profile, d->win[0],
                                       d->win[1], &cur, &fr);
        if (rc)
            return rc;
        d->current = cur;
        d->fresh = fr;
        d->checks++;
        const bool was = d->drifting;
        if (!was && fr - cur > d->margin)
            d->drifting = true;
        else if (was && fr - cur < d->margin / 4)
            d->drifting = false;
        for (size_t i = 0; i < n; i++)
            d->recent[i] = d->win[0][i] + d->win[1][i];
        if (was != d->drifting) {
            d->changes++;
            changed = 1;
        }
    }
    uint64_t *t = d->win[0];
    d->win[0] = d->win[1];
    d->win[1] = t;
    memset(d->win[1], 0, sizeof(uint64_t) * n);
    d->tokens[0] = d->tokens[1];
    d->tokens[1] = 0;
    return changed;
}

const uint64_t *moe_drift_counts(const struct moe_drift *d)
{
    return d->drifting ? d->recent : NULL;
}

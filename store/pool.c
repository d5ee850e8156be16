/* The shared slot table of a tiered store (see pool.h). */
#include "store/pool.h"

#include <string.h>
#include <time.h>

#include <xxhash.h>

static uint64_t align8(uint64_t x)
{
    return (x + 7) & ~(uint64_t)7;
}

uint64_t moe_pool_table_bytes(uint32_t n_layer, uint32_t n_expert, uint32_t n_slots,
                              uint32_t n_workers)
{
    uint64_t at = sizeof(struct moe_pool_head);
    at = align8(at + (uint64_t)n_layer * n_expert * sizeof(int32_t));
    at += (uint64_t)n_slots * sizeof(struct moe_pool_slot);
    at += (uint64_t)n_slots * n_workers * sizeof(uint32_t);
    return at;
}

void moe_pool_bind(struct moe_pool *p, void *table, uint8_t *slots_base, uint64_t slots_off)
{
    uint8_t *t = table;
    struct moe_pool_head *h = table;
    memset(p, 0, sizeof *p);
    p->head = h;
    p->n_slots = h->n_slots;
    p->n_workers = h->n_workers;
    p->n_layer = h->n_layer;
    p->n_expert = h->n_expert;
    p->quota = h->quota;
    p->slot_bytes = h->slot_bytes;
    uint64_t at = sizeof *h;
    p->where = (_Atomic int32_t *)(t + at);
    at = align8(at + (uint64_t)h->n_layer * h->n_expert * sizeof(int32_t));
    p->slot = (struct moe_pool_slot *)(t + at);
    at += (uint64_t)h->n_slots * sizeof(struct moe_pool_slot);
    p->refs = (_Atomic uint32_t *)(t + at);
    p->slots_base = slots_base;
    p->slots_off = slots_off;
}

void moe_pool_init_table(void *table, uint32_t n_layer, uint32_t n_expert, uint32_t n_slots,
                         uint32_t n_workers, uint64_t slot_bytes)
{
    struct moe_pool_head *h = table;
    memset(h, 0, sizeof *h);
    h->n_slots = n_slots;
    h->n_workers = n_workers;
    h->n_layer = n_layer;
    h->n_expert = n_expert;
    h->slot_bytes = slot_bytes;
    h->quota = n_workers ? n_slots / n_workers : n_slots;
    struct moe_pool p;
    moe_pool_bind(&p, table, NULL, 0);
    for (uint64_t b = 0; b < (uint64_t)n_layer * n_expert; b++)
        atomic_init(&p.where[b], MOE_POOL_NONE);
    for (uint32_t s = 0; s < n_slots; s++) {
        atomic_init(&p.slot[s].blob, MOE_POOL_NONE);
        atomic_init(&p.slot[s].gen, 0);
        atomic_init(&p.slot[s].used, 0);
        p.slot[s].reserved = 0;
        p.slot[s].hash = 0;
    }
    for (uint64_t i = 0; i < (uint64_t)n_slots * n_workers; i++)
        atomic_init(&p.refs[i], 0);
}

uint64_t moe_pool_slot_hash(const struct moe_pool *p, int32_t slot, uint64_t n)
{
    return XXH3_64bits(p->slots_base + (uint64_t)slot * p->slot_bytes, n);
}

uint64_t moe_pool_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

int32_t moe_pool_pin(struct moe_pool *p, uint32_t w, uint32_t blob)
{
    int32_t s = atomic_load(&p->where[blob]);
    if (s < 0 || (uint32_t)s >= p->n_slots)
        return -1;
    _Atomic uint32_t *r = &p->refs[(uint64_t)s * p->n_workers + w];
    atomic_fetch_add(r, 1);
    /* The pin is visible before we look again: an eviction that started before it shows here. */
    if (atomic_load(&p->slot[s].blob) != (int32_t)blob) {
        atomic_fetch_sub(r, 1);
        return -1;
    }
    atomic_store_explicit(&p->slot[s].used, moe_pool_now_ms(), memory_order_relaxed);
    return s;
}

void moe_pool_unpin(struct moe_pool *p, uint32_t w, int32_t slot)
{
    atomic_fetch_sub(&p->refs[(uint64_t)slot * p->n_workers + w], 1);
}

bool moe_pool_holds(struct moe_pool *p, int32_t slot, uint32_t blob)
{
    return slot >= 0 && (uint32_t)slot < p->n_slots &&
           atomic_load(&p->slot[slot].blob) == (int32_t)blob;
}

uint64_t moe_pool_slot_refs(struct moe_pool *p, int32_t slot)
{
    uint64_t n = 0;
    for (uint32_t w = 0; w < p->n_workers; w++)
        n += atomic_load(&p->refs[(uint64_t)slot * p->n_workers + w]);
    return n;
}

/* The best candidate not in skip[0..n_skip) (and unpinned, with check_refs): -2 an empty slot
 * (its index in *empty), -1 none. */
static int32_t best_score(struct moe_pool *p, const uint32_t *bonus, const int32_t *skip,
                          int n_skip, bool check_refs, int32_t *empty)
{
    int32_t best = -1;
    uint64_t best_score = UINT64_MAX;
    for (uint32_t s = 0; s < p->n_slots; s++) {
        int32_t b = atomic_load(&p->slot[s].blob);
        if (b == MOE_POOL_NONE) {
            *empty = (int32_t)s;
            return -2;
        }
        if (b < 0 || (check_refs && moe_pool_slot_refs(p, (int32_t)s)))
            continue;
        bool skipped = false;
        for (int i = 0; i < n_skip && !skipped; i++)
            skipped = skip[i] == (int32_t)s;
        if (skipped)
            continue;
        uint64_t score = atomic_load_explicit(&p->slot[s].used, memory_order_relaxed) +
                         (bonus ? bonus[b] : 0);
        if (score < best_score) {
            best_score = score;
            best = (int32_t)s;
        }
    }
    return best;
}

int32_t moe_pool_victim(struct moe_pool *p, const uint32_t *bonus)
{
    /* Pins are short and refresh `used`, so the oldest slots are rarely pinned: rank first, check
     * pins of the best few; skipping a pinned one and ranking again keeps the full scan's answer. */
    enum { TRIES = 8 };
    int32_t skip[TRIES], empty = -1;
    for (int n = 0; n < TRIES; n++) {
        int32_t s = best_score(p, bonus, skip, n, false, &empty);
        if (s == -2)
            return empty;
        if (s < 0)
            return -1;
        if (moe_pool_slot_refs(p, s) == 0)
            return s;
        skip[n] = s;
    }
    /* Many of the oldest are pinned: the full scan, pins checked for every slot. */
    int32_t s = best_score(p, bonus, NULL, 0, true, &empty);
    return s == -2 ? empty : s;
}

bool moe_pool_claim(struct moe_pool *p, int32_t slot)
{
    struct moe_pool_slot *sl = &p->slot[slot];
    int32_t old = atomic_load(&sl->blob);
    if (old == MOE_POOL_LOADING)
        return false;
    atomic_store(&sl->blob, MOE_POOL_LOADING);
    if (moe_pool_slot_refs(p, slot) != 0) {
        atomic_store(&sl->blob, old); /* someone pinned it before seeing LOADING */
        return false;
    }
    if (old >= 0)
        atomic_store(&p->where[old], MOE_POOL_NONE);
    return true;
}

void moe_pool_publish(struct moe_pool *p, int32_t slot, uint32_t blob, uint32_t w)
{
    struct moe_pool_slot *sl = &p->slot[slot];
    if (w < p->n_workers)
        atomic_fetch_add(&p->refs[(uint64_t)slot * p->n_workers + w], 1);
    atomic_fetch_add(&sl->gen, 1);
    atomic_store_explicit(&sl->used, moe_pool_now_ms(), memory_order_relaxed);
    /* The data was written before this store; a reader that sees the blob sees the data. */
    atomic_store(&sl->blob, (int32_t)blob);
    atomic_store(&p->where[blob], slot);
}

void moe_pool_release_claim(struct moe_pool *p, int32_t slot)
{
    atomic_store(&p->slot[slot].blob, MOE_POOL_NONE);
}

bool moe_pool_pin_for(struct moe_pool *p, int32_t slot, uint32_t blob, uint32_t w)
{
    if (!moe_pool_holds(p, slot, blob) || w >= p->n_workers)
        return false;
    atomic_fetch_add(&p->refs[(uint64_t)slot * p->n_workers + w], 1);
    return true;
}

uint64_t moe_pool_reclaim(struct moe_pool *p, uint32_t w)
{
    uint64_t n = 0;
    if (w >= p->n_workers)
        return 0;
    for (uint32_t s = 0; s < p->n_slots; s++)
        n += atomic_exchange(&p->refs[(uint64_t)s * p->n_workers + w], 0);
    return n;
}

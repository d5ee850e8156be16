/* The worker's side of a tiered store (see tier.h). */
#include "worker/tier.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/io.h"
#include "store/pool.h"

enum { ANS_NONE = 0, ANS_WAIT, ANS_OK, ANS_FAIL };

struct wtier {
    struct moe_expert_src src;
    struct moe_pool *pool;
    struct moe_store *store;
    const struct moe_model *m;
    uint32_t worker, n_expert;
    wtier_request_fn request;
    void *user;
    int32_t *held;             /* compute thread: [n_expert] slot pinned for the current part */
    int32_t *got;              /* compute thread: [n_expert] scratch of tier_acquire / release */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* under mu */
    uint8_t *ans;              /* [n_layer * n_expert] */
    int32_t *ans_slot;
    int ans_code;
    char ans_msg[200];
    bool aborted;
    bool verify;               /* compute thread: check blob hashes (wtier_set_verify) */
    int32_t torn_slot;         /* compute thread: a slot whose bytes changed under a pin, or -1 */
    uint64_t *part_off;        /* [n_layer][3] (the device backends' view of the blob layout) */
    _Atomic uint64_t hits, misses, waits, wait_us, prefetches;
};

static void fill_view(struct wtier *t, int layer, int32_t expert, int32_t slot,
                      struct moe_expert *v)
{
    const struct moe_store_layer *L = moe_store_layer(t->store, (uint32_t)layer);
    const uint8_t *blob = t->pool->slots_base + (uint64_t)slot * t->pool->slot_bytes;
    *v = t->m->layers[layer].experts[expert];
    v->gate.data = blob + L->off[0];
    v->up.data = blob + L->off[1];
    v->down.data = blob + L->off[2];
}

/* Does pinned slot s hold the bytes the daemon hashed for (layer's) blob? */
static bool slot_intact(struct wtier *t, int layer, int32_t s)
{
    const struct moe_store_layer *L = moe_store_layer(t->store, (uint32_t)layer);
    return moe_pool_slot_hash(t->pool, s, L->blob_bytes) == t->pool->slot[s].hash;
}

/* Waits for the answers to blobs base + ids[i] marked ANS_WAIT whose slots[i] is -1 (their
 * requests sent), filling slots[]; an error (the first) in err. Under no lock. */
static int wait_answers(struct wtier *t, int layer, const int32_t *ids, int n, int32_t *slots,
                        char *err, size_t errlen)
{
    const uint32_t base = (uint32_t)layer * t->n_expert;
    int rc = 0;
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < n; i++) {
        if (slots[i] >= 0)
            continue;
        uint32_t b = base + (uint32_t)ids[i];
        while (t->ans[b] == ANS_WAIT && !t->aborted)
            pthread_cond_wait(&t->cv, &t->mu);
        if (t->ans[b] == ANS_OK) {
            slots[i] = t->ans_slot[b];
        } else if (!rc) {
            rc = t->ans[b] == ANS_FAIL ? (t->ans_code ? t->ans_code : MOE_EINTERNAL) : MOE_ECANCELED;
            moe_fail(err, errlen, rc, "expert (%d, %d): %s", layer, ids[i],
                     t->ans[b] == ANS_FAIL ? t->ans_msg : "the daemon connection is gone");
        }
        if (t->ans[b] != ANS_WAIT)
            t->ans[b] = ANS_NONE;
    }
    for (int i = 0; i < n; i++)
        if (t->ans[base + (uint32_t)ids[i]] == ANS_WAIT)
            t->ans[base + (uint32_t)ids[i]] = ANS_NONE;
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* The expert source's pin (engine.h): pins kept by slot, not in held[], so that a device
 * backend can hold several layers' pins at once (tier_acquire keeps them in held[]). After an
 * abort, answers still on their way are dropped by wtier_ready (ANS_NONE). */
static int tier_pin(void *user, int layer, const int32_t *ids, int n, int how, int32_t *slots,
                    char *err, size_t errlen)
{
    struct wtier *t = user;
    const uint32_t base = (uint32_t)layer * t->n_expert;
    int missing = 0;
    for (int i = 0; i < n; i++) {
        slots[i] = moe_pool_pin(t->pool, t->worker, base + (uint32_t)ids[i]);
        missing += slots[i] < 0;
    }
    atomic_fetch_add_explicit(&t->hits, (uint64_t)(n - missing), memory_order_relaxed);
    int rc = 0;
    if (missing && how == MOE_PIN_READAHEAD) {
        for (int i = 0; i < n; i++)
            if (slots[i] < 0) {
                t->request(t->user, (uint32_t)layer, (uint32_t)ids[i], true);
                atomic_fetch_add_explicit(&t->prefetches, 1, memory_order_relaxed);
            }
    } else if (missing && how == MOE_PIN_WAIT) {
        atomic_fetch_add_explicit(&t->misses, (uint64_t)missing, memory_order_relaxed);
        atomic_fetch_add_explicit(&t->waits, 1, memory_order_relaxed);
        const double t0 = moe_now_s();
        pthread_mutex_lock(&t->mu);
        for (int i = 0; i < n; i++)
            if (slots[i] < 0)
                t->ans[base + (uint32_t)ids[i]] = ANS_WAIT;
        pthread_mutex_unlock(&t->mu);
        for (int i = 0; i < n; i++)
            if (slots[i] < 0)
                t->request(t->user, (uint32_t)layer, (uint32_t)ids[i], false);
        rc = wait_answers(t, layer, ids, n, slots, err, errlen);
        atomic_fetch_add_explicit(&t->wait_us, (uint64_t)((moe_now_s() - t0) * 1e6),
                                  memory_order_relaxed);
    }
    for (int i = 0; !rc && t->verify && i < n; i++)
        if (slots[i] >= 0 && (t->torn_slot >= 0 || !slot_intact(t, layer, slots[i]))) {
            const int32_t s = t->torn_slot >= 0 ? t->torn_slot : slots[i];
            rc = moe_fail(err, errlen, MOE_EINTERNAL, "expert pool slot %d: its bytes do not match "
                          "the hash of the blob it holds%s", s,
                          t->torn_slot >= 0 ? " (changed while pinned)" : "");
            t->torn_slot = -1;
        }
    if (rc)
        for (int i = 0; i < n; i++)
            if (slots[i] >= 0) {
                moe_pool_unpin(t->pool, t->worker, slots[i]);
                slots[i] = -1;
            }
    return rc;
}

static void tier_unpin(void *user, int layer, const int32_t *slots, int n)
{
    struct wtier *t = user;
    for (int i = 0; i < n; i++) {
        if (slots[i] < 0)
            continue;
        if (t->verify && !slot_intact(t, layer, slots[i]))
            t->torn_slot = slots[i]; /* reported by the next pin or acquire */
        moe_pool_unpin(t->pool, t->worker, slots[i]);
    }
}

/* The CPU backend's acquire: tier_pin (waiting), the slots kept in held[] for the release. */
static int tier_acquire(void *user, int layer, const int32_t *ids, int n, struct moe_expert *views,
                        char *err, size_t errlen)
{
    struct wtier *t = user;
    int32_t *got = t->got;
    const int rc = tier_pin(t, layer, ids, n, MOE_PIN_WAIT, got, err, errlen);
    if (rc)
        return rc;
    for (int i = 0; i < n; i++) {
        t->held[ids[i]] = got[i];
        fill_view(t, layer, ids[i], got[i], &views[i]);
    }
    return 0;
}

static void tier_release(void *user, int layer, const int32_t *ids, int n)
{
    struct wtier *t = user;
    int32_t *got = t->got;
    for (int i = 0; i < n; i++) {
        got[i] = t->held[ids[i]];
        t->held[ids[i]] = -1;
    }
    tier_unpin(t, layer, got, n);
}

static void tier_prefetch(void *user, int layer, const int32_t *ids, int n)
{
    struct wtier *t = user;
    uint32_t base = (uint32_t)layer * t->n_expert;
    for (int i = 0; i < n; i++)
        if (atomic_load_explicit(&t->pool->where[base + (uint32_t)ids[i]], memory_order_relaxed) <
            0) {
            t->request(t->user, (uint32_t)layer, (uint32_t)ids[i], true);
            atomic_fetch_add_explicit(&t->prefetches, 1, memory_order_relaxed);
        }
}

int wtier_new(struct wtier **out, struct moe_store *s, const struct moe_model *m, uint32_t worker,
              wtier_request_fn request, void *user, char *err, size_t errlen)
{
    struct moe_pool *p = moe_store_pool(s);
    if (!p)
        return moe_fail(err, errlen, MOE_EINTERNAL, "tiered store: the store has no pool");
    if (worker >= p->n_workers)
        return moe_fail(err, errlen, MOE_ERANGE, "tiered store: worker %u, the slot table has room "
                        "for %u", worker, p->n_workers);
    struct wtier *t = calloc(1, sizeof *t);
    size_t nb = (size_t)m->hp.n_layer * m->hp.n_expert;
    if (!t || !(t->held = malloc(sizeof *t->held * m->hp.n_expert)) ||
        !(t->got = malloc(sizeof *t->got * m->hp.n_expert)) ||
        !(t->part_off = malloc(sizeof *t->part_off * 3 * m->hp.n_layer)) || !(t->ans = calloc(nb, 1)) ||
        !(t->ans_slot = calloc(nb, sizeof *t->ans_slot))) {
        wtier_free(t);
        return moe_fail(err, errlen, -ENOMEM, "tiered store: out of memory");
    }
    for (uint32_t x = 0; x < m->hp.n_expert; x++)
        t->held[x] = -1;
    t->torn_slot = -1;
    t->pool = p;
    t->store = s;
    t->m = m;
    t->worker = worker;
    t->n_expert = m->hp.n_expert;
    t->request = request;
    t->user = user;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    t->src.acquire = tier_acquire;
    t->src.release = tier_release;
    t->src.prefetch = tier_prefetch;
    t->src.max_pinned = (int)p->quota;
    t->src.user = t;
    for (uint32_t l = 0; l < m->hp.n_layer; l++) {
        const struct moe_store_layer *L = moe_store_layer(s, l);
        for (int k = 0; k < 3; k++)
            t->part_off[3 * l + (uint32_t)k] = L->off[k];
    }
    t->src.pin = tier_pin;
    t->src.unpin = tier_unpin;
    t->src.slots_base = p->slots_base;
    t->src.slot_bytes = p->slot_bytes;
    t->src.n_slots = p->n_slots;
    t->src.part_off = t->part_off;
    *out = t;
    return 0;
}

void wtier_free(struct wtier *t)
{
    if (!t)
        return;
    if (t->pool) {
        pthread_mutex_destroy(&t->mu);
        pthread_cond_destroy(&t->cv);
    }
    free(t->held);
    free(t->got);
    free(t->part_off);
    free(t->ans);
    free(t->ans_slot);
    free(t);
}

void wtier_set_verify(struct wtier *t, bool on)
{
    t->verify = on;
}

const struct moe_expert_src *wtier_source(struct wtier *t)
{
    return &t->src;
}

int wtier_ready(struct wtier *t, uint32_t layer, uint32_t expert, uint64_t offset, uint64_t size,
                int code, const char *msg, char *err, size_t errlen)
{
    struct moe_pool *p = t->pool;
    uint32_t b = layer * t->n_expert + expert;
    int32_t slot = -1;
    if (code == 0) {
        const struct moe_store_layer *L = moe_store_layer(t->store, layer);
        if (offset < p->slots_off || (offset - p->slots_off) % p->slot_bytes ||
            (offset - p->slots_off) / p->slot_bytes >= p->n_slots || !L || size != L->blob_bytes)
            return moe_fail(err, errlen, MOE_ERANGE, "expert_ready (%u, %u): offset %" PRIu64
                            " size %" PRIu64 " is not a slot of this store's pool", layer, expert,
                            offset, size);
        slot = (int32_t)((offset - p->slots_off) / p->slot_bytes);
        if (!moe_pool_holds(p, slot, b))
            return moe_fail(err, errlen, MOE_ERANGE, "expert_ready (%u, %u): slot %d holds another "
                            "blob", layer, expert, slot);
    }
    pthread_mutex_lock(&t->mu);
    bool waited = t->ans[b] == ANS_WAIT;
    if (waited) {
        t->ans[b] = code ? ANS_FAIL : ANS_OK;
        t->ans_slot[b] = slot;
        if (code) {
            t->ans_code = code;
            snprintf(t->ans_msg, sizeof t->ans_msg, "%s", msg && msg[0] ? msg : moe_strerror(code));
        }
        pthread_cond_broadcast(&t->cv);
    }
    pthread_mutex_unlock(&t->mu);
    if (!waited && code == 0)
        moe_pool_unpin(p, t->worker, slot); /* given up on (abort): drop the pin it came with */
    if (!waited && code == 0 && !t->aborted)
        return moe_fail(err, errlen, MOE_EFORMAT, "expert_ready (%u, %u) that was not asked for",
                        layer, expert);
    return 0;
}

void wtier_abort(struct wtier *t)
{
    pthread_mutex_lock(&t->mu);
    t->aborted = true;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

void wtier_stats(struct wtier *t, struct wtier_stats *out)
{
    out->hits = atomic_load(&t->hits);
    out->misses = atomic_load(&t->misses);
    out->waits = atomic_load(&t->waits);
    out->wait_us = atomic_load(&t->wait_us);
    out->prefetches = atomic_load(&t->prefetches);
}

/* The worker's side of a tiered store (docs/store.md): the engine's expert source. Experts in
 * the pool are pinned straight from the shared slot table; the others are asked for with an
 * ExpertRequest and the compute thread waits for the ExpertReady that says where the daemon put
 * them (already pinned for this worker). Pins are dropped when the layer is done. */
#ifndef MOE_WORKER_TIER_H
#define MOE_WORKER_TIER_H

#include <stdbool.h>
#include <stdint.h>

#include "store/expert_store.h"
#include "store/model.h"
#include "worker/engine.h"

struct wtier;

/* Sends an ExpertRequest (from the compute thread; the caller queues it for the event loop).
 * prefetch: a read-ahead the daemon may drop, with no answer. */
typedef void (*wtier_request_fn)(void *user, uint32_t layer, uint32_t expert, bool prefetch);

struct wtier_stats {
    uint64_t hits;        /* chosen experts found in the pool */
    uint64_t misses;      /* chosen experts asked for */
    uint64_t waits;       /* expert parts that had to wait for the daemon */
    uint64_t wait_us;     /* time spent waiting, cumulative */
    uint64_t prefetches;  /* read-aheads asked for (predicted experts not in the pool) */
};

/* s must be a tiered store (moe_store_pool(s) != NULL); worker is this worker's index. */
int wtier_new(struct wtier **out, struct moe_store *s, const struct moe_model *m, uint32_t worker,
              wtier_request_fn request, void *user, char *err, size_t errlen);
void wtier_free(struct wtier *t);
/* Checks every pinned blob against the hash the daemon wrote with it, when pinned and again when
 * let go (MOED_POOL_VERIFY=1 in the worker's environment): a mismatch fails the step. */
void wtier_set_verify(struct wtier *t, bool on);
const struct moe_expert_src *wtier_source(struct wtier *t);

/* Event loop: an ExpertReady arrived. Returns 0, or an error (a bad frame: an offset that is
 * not a slot, an answer nobody asked for) with a message in err. */
int wtier_ready(struct wtier *t, uint32_t layer, uint32_t expert, uint64_t offset, uint64_t size,
                int code, const char *msg, char *err, size_t errlen);
/* The connection is gone: waits end with an error, from now on too. */
void wtier_abort(struct wtier *t);
void wtier_stats(struct wtier *t, struct wtier_stats *out);

#endif

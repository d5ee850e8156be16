/* Workloads: what the daemon learns of the requests of each application from their routing
 * signatures, and the complementary hot sets it plans from that for several GPU workers.
 *
 * The workload key of a prompt is a hash of its first MOE_WL_KEY_TOKENS tokens. Requests of one
 * application share their head: the chat template's opening and the system prompt, or a
 * completion client's fixed instructions; 32 tokens hold the template's fixed part (5 to 10
 * tokens in the common templates) and enough of the system prompt to tell applications apart,
 * while a longer key would split one application's requests by what follows its system prompt
 * (a short system prompt runs into the user's text). It is also the first block of the
 * scheduler's prefix affinity, so the requests of one key share that block's KV cache. A prompt
 * shorter than the key has none and is not learned from.
 *
 * The table holds, per key, the decayed sum of the signatures of its finished requests (each a
 * [n_layer][n_expert] count of the experts its evaluated prompt tokens chose) and how many
 * requests that sum holds, so hist / n is the routing of a typical request; the key's traffic, a
 * count of its requests decayed over the table's keyed requests (its share of recent traffic);
 * and per worker, how many of its recent requests that worker served. It keeps at most `cap`
 * keys and forgets the least recently used (learned from or looked up) first.
 *
 * A plan (moe_wl_plan) gives each of several GPU workers its own routing counts, from which the
 * worker pins its most-routed experts (its pinned slots per layer are what its hot bitmap
 * says): keys by decreasing traffic go to the worker whose pinned experts now serve the key's
 * routing best (coverage, moe_wl_coverage; within WL_COVER_MARGIN, to the worker that served
 * most of its requests, then the least loaded, then the lowest index), as long as that worker
 * takes no more than its share of the keyed traffic (plus MOE_WL_SLACK); a key heavier than
 * the room left is split over several workers (no part under an eighth of a share, so a worker
 * may take that much more). A worker's counts are the sum of its keys'
 * typical routings weighted by the traffic it takes, plus a MOE_WL_PROFILE_WEIGHT share of the
 * global profile, so that experts no key has seen keep the profile's order. */
#ifndef MOE_WORKLOAD_H
#define MOE_WORKLOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MOE_WL_KEY_TOKENS 32
#define MOE_WL_HALF_LIFE 64        /* a key's routing: half its weight after this many requests */
#define MOE_WL_TRAFFIC_HALF_LIFE 512 /* traffic: half after this many keyed requests in all */
#define MOE_WL_MAX_WORKERS 64

/* A plan needs this many keyed requests learned, and two keys with at least this share each. */
#define MOE_WL_MIN_REQUESTS 32
#define MOE_WL_MIN_SHARE 0.05
/* Keys below this share of the traffic are left out of a plan (the profile covers them). */
#define MOE_WL_KEY_FLOOR 0.005
#define MOE_WL_SLACK 0.10          /* a worker takes at most (1 + slack) x its share */
#define MOE_WL_PROFILE_WEIGHT 0.05 /* the global profile's weight in a worker's counts */

struct moe_wl_entry {
    uint64_t key;
    double *hist;              /* [n_layer][n_expert] decayed sum of signatures */
    double n;                  /* decayed number of signatures in hist */
    double traffic;            /* decayed requests (decayed over the table's keyed requests) */
    double *served;            /* [n_workers] decayed requests each worker served */
    uint64_t requests, tokens; /* signatures learned and their evaluated prompt tokens, in all */
    uint64_t used;             /* table clock at the last use */
};

struct moe_wl_table {
    uint32_t n_layer, n_expert, n_workers, cap;
    struct moe_wl_entry *e;    /* [n] used of [cap] */
    uint32_t n;
    uint64_t clock;
    uint64_t requests;         /* keyed signatures learned, in all */
    uint64_t evictions;
};

/* Returns 0, MOE_ERANGE (a zero dimension, cap 0, more than MOE_WL_MAX_WORKERS workers) or
 * -ENOMEM. Entries allocate their arrays when they are first learned. */
int moe_wl_init(struct moe_wl_table *t, uint32_t n_layer, uint32_t n_expert, uint32_t n_workers,
                uint32_t cap);
void moe_wl_free(struct moe_wl_table *t);

/* The workload key of a prompt of n tokens; 0 when it is shorter than MOE_WL_KEY_TOKENS. */
uint64_t moe_wl_key(const int32_t *prompt, uint32_t n);

/* Learns a finished request of key `key` (nonzero) served by worker `worker`: its signature
 * sig[n_layer * n_expert] over `tokens` evaluated prompt tokens. A new key takes a free entry or
 * the least recently used one. A signature of no token only counts as traffic. Returns 0,
 * MOE_ERANGE (key 0, worker out of range) or -ENOMEM. */
int moe_wl_learn(struct moe_wl_table *t, uint64_t key, uint32_t worker, const uint32_t *sig,
                 uint32_t tokens);

/* The entry of key (and marks it used), or NULL. */
const struct moe_wl_entry *moe_wl_find(struct moe_wl_table *t, uint64_t key);

/* Share of the entry's routings (its typical request's, over the layers the bitmap does not
 * hold whole) that experts set in hot ([n_layer][n_expert] bits, LSB first) serve: 0..1; 1 when
 * every layer is held whole; -1 when the entry holds no routing yet. */
double moe_wl_coverage(const struct moe_wl_table *t, const struct moe_wl_entry *e,
                       const uint8_t *hot);

/* The sum of every entry's traffic (the recent keyed requests). */
double moe_wl_traffic(const struct moe_wl_table *t);

struct moe_wl_plan {
    uint32_t n_workers, n_layer, n_expert;
    bool active;               /* complementary counts planned (else: why) */
    char why[96];
    uint64_t **counts;         /* [n_workers][n_layer * n_expert] to send each worker */
    double *load;              /* [n_workers] share of the planned keyed traffic it takes */
    uint32_t n_keys;           /* keys planned, heaviest first */
    uint64_t *key;             /* [n_keys] */
    double *key_share;         /* [n_keys] share of the keyed traffic */
    double *assign;            /* [n_keys][n_workers] share of the keyed traffic the key sends
                                * to each worker (a key's row adds up to its key_share) */
    /* Expected share of the planned keys' routings that pinned experts serve: each worker
     * pinning as many per layer as now, identical sets from `by` (the counts the workers would
     * otherwise all get) with requests spread evenly over the workers, against the planned
     * sets with each key's requests sent as assigned. */
    double hit_identical, hit_complementary;
};

/* Plans complementary counts for n_workers GPU workers whose pinned experts are hot[w]
 * ([n_layer][n_expert] bits each; a worker's pinned count per layer is what the plan gives it)
 * and whose index in the table (moe_wl_learn's worker) is ids[w] (NULL: w), from the table and
 * the global counts `by` ([n_layer][n_expert], NULL: none). Not active (no
 * counts, why says so) with fewer than two workers, fewer than MOE_WL_MIN_REQUESTS keyed
 * requests learned, or fewer than two keys with MOE_WL_MIN_SHARE of the traffic; the expected
 * hit rates are computed whenever there are keys. Deterministic: the same table and inputs give
 * the same plan. Returns 0, MOE_ERANGE (workers or ids out of range) or -ENOMEM; *out is then
 * freed. */
int moe_wl_plan(struct moe_wl_plan *out, const struct moe_wl_table *t, uint32_t n_workers,
                const uint32_t *ids, const uint8_t *const *hot, const uint64_t *by);
void moe_wl_plan_free(struct moe_wl_plan *p);

/* The experts a worker pins from routing counts: per layer, as many as slots[l] of those with a
 * nonzero count, most counted first, ties to the lower id (the worker's own rule,
 * moe_engine_set_hot); every expert where slots[l] >= n_expert. Into hot as bits. */
void moe_wl_pinned_by(uint32_t n_layer, uint32_t n_expert, const uint32_t *slots,
                      const uint64_t *counts, uint8_t *hot);

#endif

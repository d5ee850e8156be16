/* The daemon's side of the tiered store (docs/store.md, "Tiered store"): answers ExpertRequest
 * by reading the blob from the GGUF file on the libuv thread pool into a free pool slot, then
 * publishing it in the shared slot table and answering ExpertReady. Everything but the reads runs
 * on the daemon's loop. */
#ifndef MOED_TIER_H
#define MOED_TIER_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "store/expert_store.h"
#include "store/model.h"

struct moed_tier;

/* Where a blob ended up, for worker `worker`: the slot's store offset and the blob's size (the
 * slot is pinned for that worker), or code != 0 and a message. */
typedef void (*moed_tier_answer_fn)(void *user, uint32_t worker, uint32_t layer, uint32_t expert,
                                    uint64_t offset, uint64_t size, int code, const char *msg);

struct moed_tier_opts {
    uv_loop_t *loop;
    struct moe_store *store;        /* a tiered store (moe_store_pool() != NULL) */
    const struct moe_model *model;  /* the daemon's model of the file (m->gguf set) */
    const char *path;               /* the GGUF, opened again for the reads */
    /* Routing counts [n_layer][n_expert] for the victim choice, or NULL; may be NULL. */
    const uint64_t *(*counts)(void *user);
    moed_tier_answer_fn answer;
    void *user;
    uint32_t prefetch_max;          /* read-aheads in flight at most; 0: prefetches dropped */
    int io;                         /* MOED_TIER_IO_*: how blobs are read from the file */
};

/* Blob reads: O_DIRECT where the file system takes it, else buffered (then each read blob is
 * dropped from the page cache); or either one always (direct: refused at start where the file
 * system does not take it). */
enum { MOED_TIER_IO_AUTO, MOED_TIER_IO_DIRECT, MOED_TIER_IO_BUFFERED };

struct moed_tier_stats {
    uint32_t slots, n_blobs, resident;
    uint64_t pinned;          /* pins the workers hold now */
    uint64_t slot_bytes;
    uint64_t requests;        /* ExpertRequests received */
    uint64_t merged;          /* requests that joined a read already under way */
    uint64_t reads;           /* blobs read from the file */
    uint64_t read_bytes;      /* bytes read from the file */
    uint64_t read_errors;     /* reads that failed (their requests got an error) */
    uint64_t evictions;       /* blobs dropped from a slot for another */
    uint64_t no_slot;         /* times a request waited because every slot was pinned */
    uint64_t reclaimed;       /* pins dropped for workers that died */
    double read_seconds;      /* time spent in reads, summed */
    double read_p50_ms, read_p99_ms; /* read latency (upper bounds of power-of-two buckets) */
    uint64_t prefetch_requests; /* read-aheads asked for */
    uint64_t prefetch_reads;    /* ... read (the rest: present, under way, or dropped) */
    uint64_t prefetch_dropped;  /* ... dropped: prefetch_max under way, or no slot free */
    uint64_t prefetch_used;     /* demand requests that joined a read-ahead under way */
};

int moed_tier_new(struct moed_tier **out, const struct moed_tier_opts *o, char *err,
                  size_t errlen);
/* "direct" or "buffered": how this tier reads; *why (when not NULL): why O_DIRECT was not taken
 * ("" when it was or was not tried). */
const char *moed_tier_io(const struct moed_tier *t, const char **why);
/* An ExpertRequest from worker `worker` (layer and expert already range-checked). A prefetch
 * is read ahead (into a slot chosen as for a demand read) when fewer than prefetch_max
 * read-aheads are under way and a slot is free, else dropped; it is never answered. */
void moed_tier_request(struct moed_tier *t, uint32_t worker, uint32_t layer, uint32_t expert,
                       bool prefetch);
/* Worker `worker` is gone (its process was reaped): its pins are dropped, its requests
 * forgotten. */
void moed_tier_worker_gone(struct moed_tier *t, uint32_t worker);
void moed_tier_stats(const struct moed_tier *t, struct moed_tier_stats *out);
/* Reads still running: call after the loop has run them out. */
void moed_tier_free(struct moed_tier *t);

/* The fill order of a pool of n_slots: blobs (layer * n_expert + expert) by routing count, most
 * used first, ties (and a missing profile) spread evenly over the layers (expert rank, then
 * layer). Writes min(n_slots, n_layer * n_expert) entries to out. */
uint32_t moed_tier_fill_order(const uint64_t *counts, uint32_t n_layer, uint32_t n_expert,
                              uint32_t n_slots, uint32_t *out);

#endif

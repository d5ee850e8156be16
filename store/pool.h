/* The expert pool of a tiered store: a fixed number of blob slots in the memfd and a slot table
 * that the daemon and every worker share (docs/store.md, "Tiered store").
 *
 * The table lives in its own page-aligned region of the memfd, mapped read-write by everyone
 * (the slots themselves are read-only in the workers). All fields that change are C11 atomics
 * on that shared mapping:
 *
 *   where[layer * n_expert + expert]   slot holding the blob, or MOE_POOL_NONE
 *   slot[s].blob                       blob held by slot s, MOE_POOL_NONE (empty) or
 *                                      MOE_POOL_LOADING (being written by the daemon)
 *   slot[s].gen                        bumped each time the slot gets another blob
 *   slot[s].used                       CLOCK_MONOTONIC ms of the last pin (recency for eviction)
 *   slot[s].hash                       XXH3-64 of the slot's first blob_bytes, set with the blob
 *   refs[s * n_workers + w]            pins of worker w on slot s
 *
 * Only the daemon changes where[] and slot[].blob; a worker only changes its own refs column
 * and the used stamps. A worker pins a slot by incrementing its ref and then re-reading
 * slot.blob; the daemon evicts by storing LOADING into slot.blob and then reading every ref.
 * Both sides use sequentially consistent operations, so at least one of them sees the other:
 * either the worker sees that its blob left (and unpins), or the daemon sees the pin (and puts
 * the blob back). A slot with a pin is therefore never rewritten. */
#ifndef MOE_POOL_H
#define MOE_POOL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define MOE_POOL_NONE (-1)
#define MOE_POOL_LOADING (-2)
#define MOE_POOL_MAX_WORKERS 64u

/* First bytes of the table region. */
struct moe_pool_head {
    uint32_t n_slots;
    uint32_t n_workers;       /* columns of refs[]: worker indexes 0..n_workers-1 */
    uint32_t n_layer;
    uint32_t n_expert;
    uint64_t slot_bytes;      /* bytes from one slot to the next (4 KiB multiple) */
    uint32_t quota;           /* slots one worker may pin at once (n_slots / n_workers) */
    uint32_t reserved0;
    uint64_t reserved[4];
};

struct moe_pool_slot {
    _Atomic int32_t blob;
    uint32_t reserved;
    _Atomic uint64_t gen;
    _Atomic uint64_t used;
    uint64_t hash;            /* XXH3-64 of the blob's bytes, written before the blob is published */
};

/* One process's view of a pool (pointers into its mappings). */
struct moe_pool {
    struct moe_pool_head *head;
    _Atomic int32_t *where;
    struct moe_pool_slot *slot;
    _Atomic uint32_t *refs;
    uint8_t *slots_base;      /* slot 0's first byte; slot s at slots_base + s * slot_bytes */
    uint64_t slots_off;       /* the same as a store offset */
    uint32_t n_slots, n_workers, n_layer, n_expert, quota;
    uint64_t slot_bytes;
};

/* Bytes of the table for these dimensions (before page rounding). */
uint64_t moe_pool_table_bytes(uint32_t n_layer, uint32_t n_expert, uint32_t n_slots,
                              uint32_t n_workers);

/* Points p's fields into a mapped table (head already filled). */
void moe_pool_bind(struct moe_pool *p, void *table, uint8_t *slots_base, uint64_t slots_off);

/* Writes a fresh table: every slot empty, every blob absent, no refs. */
void moe_pool_init_table(void *table, uint32_t n_layer, uint32_t n_expert, uint32_t n_slots,
                         uint32_t n_workers, uint64_t slot_bytes);

/* Worker: pins blob's slot for worker w. Returns the slot, or -1 when the blob is not (or no
 * longer) in the pool; then nothing is pinned. */
int32_t moe_pool_pin(struct moe_pool *p, uint32_t w, uint32_t blob);
void moe_pool_unpin(struct moe_pool *p, uint32_t w, int32_t slot);
/* Worker: the slot an ExpertReady named holds blob (the daemon pinned it for us). */
bool moe_pool_holds(struct moe_pool *p, int32_t slot, uint32_t blob);
/* Pins of slot s by every worker. */
uint64_t moe_pool_slot_refs(struct moe_pool *p, int32_t slot);

/* Daemon: the slot to load a new blob into: the first empty one, else the unpinned one holding a
 * blob with the smallest used + bonus[blob] (ms; bonus may be NULL), the first in slot order on
 * ties; -1 when every slot is loading or pinned. Scores are ranked first and pins checked only
 * for the best candidates, so a choice costs O(slots + workers) unless the oldest slots are
 * pinned (then up to O(slots × workers), with the same answer). Nothing is claimed. */
int32_t moe_pool_victim(struct moe_pool *p, const uint32_t *bonus);

/* Daemon: takes slot s for a new blob: marks it LOADING and unlinks its old blob, unless some
 * worker pins it (then it is left as it was and false is returned). */
bool moe_pool_claim(struct moe_pool *p, int32_t slot);
/* XXH3-64 of slot s's first n bytes (what slot.hash holds for a blob of n bytes). */
uint64_t moe_pool_slot_hash(const struct moe_pool *p, int32_t slot, uint64_t n);

/* Daemon: slot s (claimed, data written, hash set) now holds blob; pins it for worker w first when
 * w < n_workers (the pin the ExpertReady hands over). */
void moe_pool_publish(struct moe_pool *p, int32_t slot, uint32_t blob, uint32_t w);
/* Daemon: gives a claimed slot back empty (the read failed). */
void moe_pool_release_claim(struct moe_pool *p, int32_t slot);
/* Daemon: pins slot s (which holds a blob) for worker w, when a request crossed the blob's
 * arrival. Returns false if the slot no longer holds a blob. */
bool moe_pool_pin_for(struct moe_pool *p, int32_t slot, uint32_t blob, uint32_t w);
/* Daemon: drops every pin of worker w (it is gone). Returns the pins dropped. */
uint64_t moe_pool_reclaim(struct moe_pool *p, uint32_t w);

/* Milliseconds of CLOCK_MONOTONIC, for slot.used. */
uint64_t moe_pool_now_ms(void);

#endif

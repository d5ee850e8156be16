/* The expert cache's bookkeeping for one layer and one step, shared by the resolve kernel
 * (worker/cuda/offload.cu, run by one thread on shared-memory copies of the state) and the host
 * tests that check it (tests/test_offload_resolve.c). Plain C; the structs are those of
 * worker/cuda/offload.cuh. */
#ifndef MOE_CUDA_OFFLOAD_RESOLVE_H
#define MOE_CUDA_OFFLOAD_RESOLVE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define MOE_OFF_HD __host__ __device__
#else
#define MOE_OFF_HD
#endif

/* slot_of value of an expert without a slot. */
#define MOE_OFF_HOST (-1)

/* Counters per layer (stats[]). */
enum { MOE_OFF_HITS, MOE_OFF_MISSES, MOE_OFF_FILL_BYTES, MOE_OFF_DIRECT, MOE_OFF_DIRECT_BYTES,
       MOE_OFF_PREFETCH, MOE_OFF_PREFETCH_BYTES, MOE_OFF_STAGED, MOE_OFF_STAGE_BYTES,
       MOE_OFF_STAGE_READS,
       /* prefetched experts the layer then chose (their bytes), and those evicted unchosen */
       MOE_OFF_PF_USED, MOE_OFF_PF_USED_BYTES, MOE_OFF_PF_WASTED, MOE_OFF_NSTATS };

/* Tiered store (docs/offload.md, "A tiered store"): the channel through which a layer's resolve
 * asks the worker for the pool slots of its chosen experts that have no VRAM slot. It lives in
 * mapped host memory: the header, then ids[nexp] (int32) and ptr[nexp][3] (uint64, device
 * addresses of gate, up and down), moe_off_chan_bytes(nexp) in all. */
struct moe_off_chan {
    volatile uint32_t req;      /* device: request number, written after layer, n and ids */
    volatile uint32_t ans;      /* host: = req once ptr and status are written */
    volatile uint32_t done;     /* device: the latest request whose layer has run (its pins may go) */
    volatile int32_t status;    /* host: 0, or no addresses (the step fails) */
    volatile uint32_t timeouts; /* device: requests given up on (no answer in MOE_OFF_CHAN_WAIT_NS) */
    volatile int32_t layer, n;
    uint32_t pad[9];
};
#define MOE_OFF_CHAN_WAIT_NS 120000000000ull

/* Tiered store: the experts layer-ahead prediction expects of a layer and that have no VRAM slot,
 * for the worker to have the daemon read ahead those not in the pool (a hint: the latest
 * overwrites the last; the worker drops one it read while it changed). Mapped host memory: the
 * header, then ids[nexp]. */
struct moe_off_hint {
    volatile uint32_t seq;      /* device: 0 while layer, n and ids are written, then the
                                 * hint's number (never 0) */
    volatile int32_t layer, n;
    uint32_t pad[13];
};

static inline MOE_OFF_HD size_t moe_off_hint_bytes(int32_t nexp)
{
    return sizeof(struct moe_off_hint) + 4 * (size_t)nexp;
}

static inline MOE_OFF_HD size_t moe_off_chan_bytes(int32_t nexp)
{
    return sizeof(struct moe_off_chan) + 4 * (size_t)((nexp + 1) & ~1) + 24 * (size_t)nexp;
}
static inline MOE_OFF_HD volatile int32_t *moe_off_chan_ids(struct moe_off_chan *c)
{
    return (volatile int32_t *)(c + 1);
}
static inline MOE_OFF_HD volatile uint64_t *moe_off_chan_ptr(struct moe_off_chan *c, int32_t nexp)
{
    return (volatile uint64_t *)((uint8_t *)(c + 1) + 4 * (size_t)((nexp + 1) & ~1));
}

/* One layer's offload state, in device memory. */
struct moe_cuda_off_layer {
    int32_t nexp, slots;
    int32_t layer;
    uint32_t part_off[3];          /* gate, up, down inside a slot */
    uint64_t slot_bytes;
    uint8_t *base;                 /* [slots][slot_bytes] in VRAM */
    int32_t *slot_of;              /* [nexp]: a slot or MOE_OFF_HOST */
    int32_t *slot_exp;             /* [slots]: the expert a slot holds, -1 none */
    uint8_t *pinned;               /* [slots]: 1 = hot, never evicted */
    uint8_t *ref;                  /* [slots]: clock reference bits */
    uint8_t *pf;                   /* [slots] or NULL: 1 while the slot holds a prefetched expert
                                    * that no lookup of the layer's own has found yet */
    int32_t *hand;                 /* [1]: clock hand */
    const void **host;             /* [3][nexp]: device addresses of the host copies (with a
                                    * tiered store NULL, but for the experts a request borrowed
                                    * from the pool until the layer's pool_done) */
    const uint32_t *bytes;         /* [3][nexp] */
    const void **tab[3];           /* the layer's gate, up and down tables the kernels read */
    const void **fsrc;             /* [3][nexp] or NULL: for each expert whose copies a layer's
                                    * own resolve queued, their sources (the host copies), else
                                    * NULL; the expert kernels that copy as they go read it
                                    * (moe_off_resolve_mode) */
    unsigned long long *stats;     /* [MOE_OFF_NSTATS] */
    struct moe_off_chan *chan;     /* tiered store: the request channel; NULL: none */
    uint32_t *chan_seq;            /* [1]: the last request number (shared by the layers) */
    int32_t *borrow;               /* [nexp]: the experts this layer's request borrowed */
    int32_t *n_borrow;             /* [1] */
    struct moe_off_hint *hint;     /* tiered store: the read-ahead hint (shared by the layers) */
    uint32_t *hint_seq;            /* [1]: the last hint's number */
};

/* A copy from host memory into a slot. */
struct moe_cuda_fill {
    const uint8_t *src;
    uint8_t *dst;
    uint32_t bytes;
    uint32_t chunk0;               /* first chunk of this copy in the step's list */
};
struct moe_cuda_fill_list {
    int32_t n, n_chunks;
    struct moe_cuda_fill job[1];   /* [3 * slots] */
};
#define MOE_OFF_CHUNK 16384u

/* The 16 KiB chunks of copy j. */
static inline MOE_OFF_HD int32_t moe_off_fill_chunks(const struct moe_cuda_fill *j)
{
    return (int32_t)((j->bytes + MOE_OFF_CHUNK - 1) / MOE_OFF_CHUNK);
}

/* Queues the three copies of expert e into the slot-sized area `at` (gate, up, down at the
 * layer's part offsets) as jobs *nj.. of fl and points the layer's tables there. Returns the
 * bytes queued. */
static inline MOE_OFF_HD unsigned long long moe_off_queue(const struct moe_cuda_off_layer *L,
                                                          int32_t e, uint8_t *at,
                                                          struct moe_cuda_fill_list *fl,
                                                          int32_t *nj, uint32_t *chunks)
{
    const int32_t ne = L->nexp;
    unsigned long long bytes = 0;
    for (int p = 0; p < 3; p++) {
        struct moe_cuda_fill j;
        j.src = (const uint8_t *)L->host[p * ne + e];
        j.dst = at + L->part_off[p];
        j.bytes = L->bytes[p * ne + e];
        j.chunk0 = *chunks;
        *chunks += (uint32_t)moe_off_fill_chunks(&j);
        bytes += j.bytes;
        fl->job[(*nj)++] = j;
        L->tab[p][e] = at + L->part_off[p];
    }
    return bytes;
}

/* A resolve in two parts: moe_off_hit for every chosen expert, in any order (the kernel runs
 * them in parallel), then moe_off_miss for the others in expert order, then moe_off_walk_end.
 * That is the walk of moe_off_resolve_mode step for step: a miss's clock search passes over the
 * slots of this step's experts without touching their bits, so where the hits' bits are set in
 * the walk does not matter. */
struct moe_off_walk {
    int32_t h, nj;
    uint32_t chunks;
    unsigned long long hits, misses, fill, direct, direct_bytes, placed;
    unsigned long long pf_used, pf_used_bytes, pf_wasted;
};

static inline MOE_OFF_HD void moe_off_walk_begin(const struct moe_cuda_off_layer *L,
                                                 const int32_t *hand, struct moe_off_walk *w)
{
    w->h = L->slots ? *hand : 0;
    w->nj = 0;
    w->chunks = 0;
    w->hits = w->misses = w->fill = w->direct = w->direct_bytes = w->placed = 0;
    w->pf_used = w->pf_used_bytes = w->pf_wasted = 0;
}

/* Chosen expert e, when it has a slot: its reference bit set; returns 1 (a hit), 2 when the
 * hit is a layer's own lookup finding a prefetched expert first (pf: L->pf or a copy of it; its
 * flag cleared), else 0. */
static inline MOE_OFF_HD int moe_off_hit(int32_t e, const uint8_t *need, const int32_t *slot_of,
                                         uint8_t *ref, uint8_t *pf, int prefetch)
{
    if (!need[e] || slot_of[e] < 0)
        return 0;
    const int32_t s = slot_of[e];
    ref[s] = 1;
    if (pf && pf[s] && !prefetch) {
        pf[s] = 0;
        return 2;
    }
    return 1;
}

/* The bytes of expert e (its three parts). */
static inline MOE_OFF_HD unsigned long long moe_off_expert_bytes(const struct moe_cuda_off_layer *L,
                                                                 int32_t e)
{
    return (unsigned long long)L->bytes[e] + L->bytes[L->nexp + e] + L->bytes[2 * L->nexp + e];
}

/* Adds moe_off_hit's result r for expert e to the walk's counters. */
static inline MOE_OFF_HD void moe_off_count_hit(const struct moe_cuda_off_layer *L, int32_t e,
                                                int r, struct moe_off_walk *w)
{
    if (r == 0)
        return;
    w->hits++;
    if (r == 2) {
        w->pf_used++;
        w->pf_used_bytes += moe_off_expert_bytes(L, e);
    }
}

/* A layer's own resolve when every chosen expert has a slot: for each distinct chosen expert e
 * in slot s, what the walk does to it (reference bit set, a prefetched expert's flag cleared and
 * counted as used, a hit counted) and its copy sources cleared (the expert kernels read only the
 * chosen experts' entries); then moe_off_fast_end. The state and counters are those
 * moe_off_resolve_mode leaves for that step: no slot changes hands and the hand stays. */
static inline MOE_OFF_HD void moe_off_fast_hit(const struct moe_cuda_off_layer *L, int32_t e,
                                               int32_t s, uint8_t *ref, uint8_t *pf,
                                               struct moe_off_walk *w)
{
    ref[s] = 1;
    if (pf && pf[s]) {
        pf[s] = 0;
        w->pf_used++;
        w->pf_used_bytes += moe_off_expert_bytes(L, e);
    }
    w->hits++;
    if (L->fsrc)
        for (int p = 0; p < 3; p++)
            L->fsrc[p * L->nexp + e] = 0;
}

/* The counters of a resolve made of moe_off_fast_hit calls (w: their sums), and an empty list
 * of copies. */
static inline MOE_OFF_HD void moe_off_fast_end(const struct moe_off_walk *w,
                                               struct moe_cuda_fill_list *fl,
                                               unsigned long long *stats)
{
    fl->n = 0;
    fl->n_chunks = 0;
    stats[MOE_OFF_HITS] += w->hits;
    stats[MOE_OFF_PF_USED] += w->pf_used;
    stats[MOE_OFF_PF_USED_BYTES] += w->pf_used_bytes;
}

/* Chosen expert e without a slot (a miss): the clock's victim for it, or a read from host. */
static inline MOE_OFF_HD void moe_off_miss(const struct moe_cuda_off_layer *L, int32_t e,
                                           const uint8_t *need, int32_t *slot_of,
                                           int32_t *slot_exp, uint8_t *ref,
                                           const uint8_t *pinned, uint8_t *pf,
                                           struct moe_cuda_fill_list *fl, int prefetch,
                                           struct moe_off_walk *w)
{
    const int32_t S = L->slots, ne = L->nexp;
    w->misses++;
    int32_t victim = -1;
    for (int32_t t = 0; t < 2 * S + 1; t++) {
        const int32_t c = w->h;
        w->h = w->h + 1 == S ? 0 : w->h + 1;
        const int32_t x = slot_exp[c];
        if (pinned[c] || (x >= 0 && need[x]))
            continue; /* hot, or read by this step */
        if (ref[c]) {
            ref[c] = 0;
            continue;
        }
        victim = c;
        break;
    }
    if (victim < 0) {
        /* Every unpinned slot holds an expert of this step: read this one from host. */
        if (prefetch)
            return;
        w->direct++;
        w->direct_bytes += moe_off_expert_bytes(L, e);
        return;
    }
    const int32_t old = slot_exp[victim];
    if (old >= 0) {
        slot_of[old] = MOE_OFF_HOST;
        for (int p = 0; p < 3; p++)
            L->tab[p][old] = L->host[p * ne + old];
    }
    slot_exp[victim] = e;
    slot_of[e] = victim;
    ref[victim] = 1;
    if (pf) {
        w->pf_wasted += pf[victim]; /* a prefetched expert evicted before any lookup found it */
        pf[victim] = prefetch ? 1 : 0;
    }
    w->placed++;
    w->fill += moe_off_queue(L, e, L->base + (size_t)victim * L->slot_bytes, fl, &w->nj,
                             &w->chunks);
    if (L->fsrc && !prefetch)
        for (int p = 0; p < 3; p++)
            L->fsrc[p * ne + e] = L->host[p * ne + e];
}

static inline MOE_OFF_HD void moe_off_walk_end(const struct moe_cuda_off_layer *L,
                                               const struct moe_off_walk *w, int32_t *hand,
                                               struct moe_cuda_fill_list *fl,
                                               unsigned long long *stats, int prefetch)
{
    fl->n = w->nj;
    fl->n_chunks = (int32_t)w->chunks;
    if (L->slots)
        *hand = w->h;
    stats[MOE_OFF_PF_WASTED] += w->pf_wasted;
    if (prefetch) {
        stats[MOE_OFF_PREFETCH] += w->placed;
        stats[MOE_OFF_PREFETCH_BYTES] += w->fill;
        return;
    }
    stats[MOE_OFF_PF_USED] += w->pf_used;
    stats[MOE_OFF_PF_USED_BYTES] += w->pf_used_bytes;
    stats[MOE_OFF_HITS] += w->hits;
    stats[MOE_OFF_MISSES] += w->misses;
    stats[MOE_OFF_FILL_BYTES] += w->fill;
    stats[MOE_OFF_DIRECT] += w->direct;
    stats[MOE_OFF_DIRECT_BYTES] += w->direct_bytes;
}

/* Walks the experts marked in need[nexp] in expert order. slot_of, slot_exp, ref and pinned
 * are the layer's state (L's arrays or copies of them); *hand the clock hand. A chosen expert
 * with a slot is a hit (reference bit set). A miss takes the first slot the hand reaches that is
 * not pinned, not holding an expert of this step, and whose reference bit is clear (clearing the
 * bits it passes): the old expert's tables go back to its host copy, the new one's to the slot,
 * and its three copies are queued in fl (and, with L->fsrc and not a prefetch, their sources
 * set there: L->fsrc's entries must be NULL on entry). With no such slot it is read from host
 * memory. Adds to stats[MOE_OFF_NSTATS]; with L->pf, also which prefetched experts the layer's
 * own lookups found (used) and which were evicted first (wasted).
 *
 * prefetch: need[] is a prediction for a layer that has not routed yet (layer-ahead prefetch):
 * the same walk places the predicted experts, but nothing counts as a hit, miss or direct read
 * (the layer's own resolve counts those when it runs); the copies are counted as prefetched. */
static inline MOE_OFF_HD void moe_off_resolve_mode(const struct moe_cuda_off_layer *L,
                                                   const uint8_t *need, int32_t *slot_of,
                                                   int32_t *slot_exp, uint8_t *ref,
                                                   const uint8_t *pinned, int32_t *hand,
                                                   struct moe_cuda_fill_list *fl,
                                                   unsigned long long *stats, int prefetch)
{
    struct moe_off_walk w;
    moe_off_walk_begin(L, hand, &w);
    for (int32_t e = 0; e < L->nexp; e++) {
        const int r = moe_off_hit(e, need, slot_of, ref, L->pf, prefetch);
        moe_off_count_hit(L, e, r, &w);
        if (!r && need[e])
            moe_off_miss(L, e, need, slot_of, slot_exp, ref, pinned, L->pf, fl, prefetch, &w);
    }
    moe_off_walk_end(L, &w, hand, fl, stats, prefetch);
}

/* The layer's own lookup (not a prefetch). */
static inline MOE_OFF_HD void moe_off_resolve(const struct moe_cuda_off_layer *L,
                                              const uint8_t *need, int32_t *slot_of,
                                              int32_t *slot_exp, uint8_t *ref,
                                              const uint8_t *pinned, int32_t *hand,
                                              struct moe_cuda_fill_list *fl,
                                              unsigned long long *stats)
{
    moe_off_resolve_mode(L, need, slot_of, slot_exp, ref, pinned, hand, fl, stats, 0);
}

/* Prompt staging (steps that touch most of a layer's experts): before the layer runs, the
 * first `cap` experts without a slot, in expert order, are copied into a staging buffer (expert
 * j of it at stage + j·slot_bytes) by the copies queued in fl, and the layer's tables point
 * there; the slots and the cache state are not touched. moe_off_stage_end, after the layer's
 * expert kernels, counts the step's lookups and points the tables back at the host copies.
 * Returns the number of experts staged. */
static inline MOE_OFF_HD int32_t moe_off_stage(const struct moe_cuda_off_layer *L,
                                               const int32_t *slot_of, uint8_t *stage,
                                               int32_t cap, struct moe_cuda_fill_list *fl,
                                               unsigned long long *stats)
{
    const int32_t ne = L->nexp;
    int32_t j = 0, nj = 0;
    uint32_t chunks = 0;
    unsigned long long bytes = 0;
    for (int32_t e = 0; e < ne && j < cap; e++) {
        if (slot_of[e] >= 0)
            continue;
        bytes += moe_off_queue(L, e, stage + (size_t)j * L->slot_bytes, fl, &nj, &chunks);
        j++;
    }
    fl->n = nj;
    fl->n_chunks = (int32_t)chunks;
    stats[MOE_OFF_STAGED] += (unsigned long long)j;
    stats[MOE_OFF_STAGE_BYTES] += bytes;
    return j;
}

/* After a staged layer's expert kernels: the experts marked in need[] were hits (with a slot;
 * reference bit set) or misses; a miss among the first `cap` experts without a slot was read
 * from the staging buffer (MOE_OFF_STAGE_READS), one beyond them from host memory (direct). Every expert without a slot gets its host copy back in the
 * tables. */
static inline MOE_OFF_HD void moe_off_stage_end(const struct moe_cuda_off_layer *L,
                                                const uint8_t *need, const int32_t *slot_of,
                                                uint8_t *ref, int32_t cap,
                                                unsigned long long *stats)
{
    const int32_t ne = L->nexp;
    unsigned long long hits = 0, misses = 0, direct = 0, direct_bytes = 0, reads = 0;
    int32_t j = 0;
    for (int32_t e = 0; e < ne; e++) {
        const int32_t s = slot_of[e];
        if (s >= 0) {
            if (need[e]) {
                hits++;
                ref[s] = 1;
            }
            continue;
        }
        if (need[e]) {
            misses++;
            if (j >= cap) {
                direct++;
                direct_bytes += moe_off_expert_bytes(L, e);
            } else {
                reads++;
            }
        }
        j++;
        for (int p = 0; p < 3; p++)
            L->tab[p][e] = L->host[p * ne + e];
    }
    stats[MOE_OFF_HITS] += hits;
    stats[MOE_OFF_MISSES] += misses;
    stats[MOE_OFF_DIRECT] += direct;
    stats[MOE_OFF_DIRECT_BYTES] += direct_bytes;
    stats[MOE_OFF_STAGE_READS] += reads;
}

/* Tiered store: the chosen experts (need[]) without a slot, in expert order, into list[];
 * returns their count: what a layer's resolve asks the worker to lend from the pool. */
static inline MOE_OFF_HD int32_t moe_off_pool_list(const uint8_t *need, const int32_t *slot_of,
                                                   int32_t nexp, int32_t *list)
{
    int32_t n = 0;
    for (int32_t e = 0; e < nexp; e++)
        if (need[e] && slot_of[e] < 0)
            list[n++] = e;
    return n;
}

/* Tiered store: the predicted experts sel[0..n_sel) (ids out of range skipped) that have no
 * slot, each once, in the order first predicted, into list[]; seen[nexp] zeroed on entry, left
 * marked. Returns their count: the read-ahead hint of a layer. */
static inline MOE_OFF_HD int32_t moe_off_hint_list(const int32_t *sel, int64_t n_sel,
                                                   const int32_t *slot_of, int32_t nexp,
                                                   uint8_t *seen, int32_t *list)
{
    int32_t n = 0;
    for (int64_t i = 0; i < n_sel; i++) {
        const int32_t e = sel[i];
        if (e < 0 || e >= nexp || seen[e])
            continue;
        seen[e] = 1;
        if (slot_of[e] < 0)
            list[n++] = e;
    }
    return n;
}

/* Tiered store, once the request for list[0..n) is answered: expert list[i] is read at
 * ptr[3i + p] (gate, up, down). ptr NULL (the request failed; the step will too): it is read
 * from a placeholder inside the layer's slots instead, so that no kernel faults, and it drops
 * out of need[] (the walk places nothing from it). i0, di: the entries this thread does (the
 * kernel spreads them over its block). */
static inline MOE_OFF_HD void moe_off_pool_lend(const struct moe_cuda_off_layer *L,
                                                const int32_t *list, int32_t n,
                                                const volatile uint64_t *ptr, uint8_t *need,
                                                int32_t i0, int32_t di)
{
    const int32_t ne = L->nexp;
    for (int32_t i = i0; i < n; i += di) {
        const int32_t e = list[i];
        for (int p = 0; p < 3; p++) {
            const void *v = ptr ? (const void *)(uintptr_t)ptr[3 * i + p]
                                : (const void *)(L->base + L->part_off[p]);
            L->host[p * ne + e] = v;
            L->tab[p][e] = v;
        }
        if (!ptr)
            need[e] = 0;
    }
}

/* Tiered store, after the layer's expert kernels: the addresses lent for list[0..n) are
 * dropped (their pins go); an expert the resolve placed in a slot keeps its slot's tables. */
static inline MOE_OFF_HD void moe_off_pool_return(const struct moe_cuda_off_layer *L,
                                                  const int32_t *list, int32_t n,
                                                  const int32_t *slot_of, int32_t i0, int32_t di)
{
    const int32_t ne = L->nexp;
    for (int32_t i = i0; i < n; i += di) {
        const int32_t e = list[i];
        for (int p = 0; p < 3; p++) {
            L->host[p * ne + e] = (const void *)0;
            if (slot_of[e] < 0)
                L->tab[p][e] = (const void *)0;
        }
    }
}

/* Experts a prompt staging buffer holds when S of a layer's nexp experts have a slot: the
 * others, with both buffers at most an eighth of the slots' bytes (sum_slot: one slot of every
 * layer; max_slot: the largest slot). */
static inline MOE_OFF_HD int64_t moe_off_stage_auto(int64_t nexp, int64_t S, uint64_t sum_slot,
                                                    uint64_t max_slot)
{
    if (S >= nexp || !max_slot)
        return 0;
    const int64_t cap = (int64_t)((uint64_t)S * sum_slot / (16 * max_slot));
    return nexp - S < cap ? nexp - S : cap;
}

/* Slots per layer *S and staging experts per buffer *P under `avail` bytes for both (what a VRAM
 * budget leaves after everything else): as many slots as fit (at most nexp), then room for the
 * two buffers out of them unless that leaves fewer than kmin slots (then no staging).
 * fixed_P >= 0 sets P instead of moe_off_stage_auto. *S < kmin: the budget is too small. */
static inline MOE_OFF_HD void moe_off_budget_split(int64_t nexp, int64_t kmin, uint64_t avail,
                                                   uint64_t sum_slot, uint64_t max_slot,
                                                   int64_t fixed_P, int64_t *S, int64_t *P)
{
    int64_t s0 = sum_slot ? (int64_t)(avail / sum_slot) : nexp;
    s0 = s0 > nexp ? nexp : s0;
    int64_t p = fixed_P >= 0 ? fixed_P : moe_off_stage_auto(nexp, s0, sum_slot, max_slot);
    const uint64_t sb = 2 * (uint64_t)p * max_slot;
    const int64_t s1 = sum_slot ? (int64_t)((avail - (avail < sb ? avail : sb)) / sum_slot) : nexp;
    if (s0 < nexp && p && s1 >= kmin) {
        const int64_t p1 = fixed_P >= 0 ? fixed_P : moe_off_stage_auto(nexp, s1, sum_slot, max_slot);
        *S = s1;
        *P = p1 < p ? p1 : p;
    } else {
        *S = s0;
        *P = 0;
    }
}

/* Unpinned slots (the cache ring) of a layer with S slots, nexp experts and k chosen per token.
 * opt: the --cache-slots setting (-1 no ring, 0 auto, N). Auto: without a profile every slot is
 * cache; with one a quarter of them, but at least 2k (a step's misses and the next step's), so a
 * layer with S <= 2k slots keeps no pinned expert. */
static inline MOE_OFF_HD int64_t moe_off_cache_slots(int64_t S, int64_t nexp, int64_t k,
                                                     int32_t opt, int profile)
{
    const int64_t kmin = k < nexp ? k : nexp;
    if (opt < 0)
        return 0;
    if (opt > 0)
        return opt < S ? opt : S;
    if (!profile)
        return S;
    const int64_t q = S / 4 > 2 * kmin ? S / 4 : 2 * kmin;
    return q < S ? q : S;
}

/* A move the caller carries out for moe_off_repin: expert x into slot s, evicting `old` (-1:
 * the slot was empty). */
struct moe_off_load {
    int32_t x, s, old;
};

/* Re-pins a layer between steps. want[0..n_want) are the experts to pin, most wanted first
 * (duplicates and ids out of range are skipped; at most `slots` are taken). Pinned slots whose
 * expert is not wanted are unpinned (they become cache); wanted experts already in a slot are
 * pinned where they are; the others are loaded, at most max_loads of them, into unpinned slots
 * (empty ones first, then ones whose reference bit is clear, then any). Updates slot_of,
 * slot_exp, pinned and ref, and appends the moves to loads[*n_loads] (the caller copies the
 * bytes and repoints the tables). scratch: [nexp] bytes. Returns the wanted experts left
 * without a slot (because of max_loads): call again after the next step. */
static inline int32_t moe_off_repin(int32_t nexp, int32_t slots, int32_t *slot_of,
                                    int32_t *slot_exp, uint8_t *pinned, uint8_t *ref,
                                    const int32_t *want, int32_t n_want, int32_t max_loads,
                                    struct moe_off_load *loads, int32_t *n_loads,
                                    uint8_t *scratch)
{
    for (int32_t x = 0; x < nexp; x++)
        scratch[x] = 0;
    int32_t taken = 0;
    for (int32_t i = 0; i < n_want && taken < slots; i++) {
        const int32_t x = want[i];
        if (x >= 0 && x < nexp && !scratch[x]) {
            scratch[x] = 1;
            taken++;
        }
    }
    for (int32_t s = 0; s < slots; s++)
        if (pinned[s] && (slot_exp[s] < 0 || !scratch[slot_exp[s]]))
            pinned[s] = 0;
    for (int32_t x = 0; x < nexp; x++)
        if (scratch[x] && slot_of[x] >= 0)
            pinned[slot_of[x]] = 1;
    int32_t pending = 0, done = 0;
    for (int32_t i = 0; i < n_want; i++) {
        const int32_t x = want[i];
        if (x < 0 || x >= nexp || scratch[x] != 1 || slot_of[x] >= 0)
            continue;
        scratch[x] = 2; /* handled (a duplicate later in want is skipped) */
        if (done == max_loads) {
            pending++;
            continue;
        }
        int32_t v = -1;
        for (int pass = 0; pass < 3 && v < 0; pass++)
            for (int32_t s = 0; s < slots && v < 0; s++)
                if (!pinned[s] && (pass == 2 || (pass == 0 ? slot_exp[s] < 0 : !ref[s])))
                    v = s;
        if (v < 0) {
            pending++;
            continue;
        }
        const int32_t old = slot_exp[v];
        if (old >= 0)
            slot_of[old] = MOE_OFF_HOST;
        slot_exp[v] = x;
        slot_of[x] = v;
        pinned[v] = 1;
        ref[v] = 1;
        loads[(*n_loads)++] = (struct moe_off_load){x, v, old};
        done++;
    }
    return pending;
}

#endif

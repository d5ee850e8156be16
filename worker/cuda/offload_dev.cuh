/* Device bodies of the expert offload's resolve (offload.cu), shared with the gate/up kernel
 * that resolves its own layer (experts.cu). */
#ifndef MOE_CUDA_OFFLOAD_DEV_CUH
#define MOE_CUDA_OFFLOAD_DEV_CUH

#include "worker/cuda/offload.cuh"

/* The dynamic shared memory of resolve_walk for a layer of nexp experts and `slots` slots. */
static inline __host__ __device__ size_t moe_cuda_resolve_smem(int32_t nexp, int32_t slots)
{
    return (size_t)(2 * nexp + slots + (nexp + 31) / 32) * sizeof(int32_t) +
           (size_t)(nexp + 3 * slots);
}

/* need[e] = 1 for each of the n_sel chosen experts (ids out of range ignored), by the whole
 * block; need[] was zeroed before the block's barrier. */
static __device__ void mark_need(uint8_t *need, const int32_t *sel_e, int n_sel, int32_t nexp)
{
    for (int i = threadIdx.x; i < n_sel; i += blockDim.x) {
        const int32_t e = sel_e[i];
        if (e >= 0 && e < nexp)
            need[e] = 1;
    }
    __syncthreads();
}

static __device__ __forceinline__ uint64_t global_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* A tiered store's request (offload_resolve.h, struct moe_off_chan), by the whole block: the
 * chosen experts without a slot (list, shared memory) written to the channel, thread 0 waits for
 * the worker's answer (at most MOE_OFF_CHAN_WAIT_NS), then their addresses are lent to the
 * layer's tables (moe_off_pool_lend; without an answer, placeholders, and the step fails on the
 * host). */
static __device__ void pool_borrow(const struct moe_cuda_off_layer &L, uint8_t *need,
                                   const int32_t *slot_of, int32_t *list)
{
    __shared__ int32_t s_n, s_ok;
    struct moe_off_chan *c = L.chan;
    if (threadIdx.x == 0)
        s_n = moe_off_pool_list(need, slot_of, L.nexp, list);
    __syncthreads();
    const int32_t n = s_n;
    if (n == 0)
        return;
    volatile int32_t *ids = moe_off_chan_ids(c);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        ids[i] = list[i];
        L.borrow[i] = list[i];
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t seq = *L.chan_seq + 1;
        *L.chan_seq = seq;
        *L.n_borrow = n;
        c->layer = L.layer;
        c->n = n;
        __threadfence_system();
        c->req = seq;
        const uint64_t t0 = global_ns();
        int ok = 1;
        while (c->ans != seq) {
            if (global_ns() - t0 > MOE_OFF_CHAN_WAIT_NS) {
                ok = 0;
                c->timeouts = c->timeouts + 1;
                break;
            }
            __nanosleep(256);
        }
        __threadfence_system();
        s_ok = ok && c->status == 0;
    }
    __syncthreads();
    moe_off_pool_lend(&L, list, n, s_ok ? moe_off_chan_ptr(c, L.nexp) : NULL, need,
                      (int32_t)threadIdx.x, (int32_t)blockDim.x);
    __syncthreads();
}

/* The sum of a block's threads' hit counters (in shared memory; zeroed before a barrier, then
 * block_hits_add by each thread, then after a barrier block_hits_get). */
struct block_hits {
    unsigned hits, used;
    unsigned long long used_bytes;
};

static __device__ void block_hits_zero(struct block_hits *h)
{
    h->hits = h->used = 0;
    h->used_bytes = 0;
}

static __device__ void block_hits_add(struct block_hits *h, const struct moe_off_walk &mine)
{
    if (mine.hits)
        atomicAdd(&h->hits, (unsigned)mine.hits);
    if (mine.pf_used) {
        atomicAdd(&h->used, (unsigned)mine.pf_used);
        atomicAdd(&h->used_bytes, mine.pf_used_bytes);
    }
}

static __device__ void block_hits_get(const struct block_hits *h, struct moe_off_walk *w)
{
    w->hits = h->hits;
    w->pf_used = h->used;
    w->pf_used_bytes = h->used_bytes;
}


/* The fast resolve of offload_resolve_kernel, by the whole block: each thread looks up one
 * chosen expert's slot; when one has none, false (nothing changed). Else the first of each
 * distinct expert's threads applies moe_off_fast_hit, thread 0 the counters. */
static __device__ bool resolve_fast(const struct moe_cuda_off_layer &L, const int32_t *sel_e,
                                    int n_sel, struct moe_cuda_fill_list *fl)
{
    __shared__ struct block_hits f;
    if (threadIdx.x == 0)
        block_hits_zero(&f);
    int32_t e = -1, s = -1;
    if ((int)threadIdx.x < n_sel) {
        e = sel_e[threadIdx.x];
        if (e >= 0 && e < L.nexp)
            s = __ldcg(L.slot_of + e);
        else
            e = -1;
    }
    if (__syncthreads_or(e >= 0 && s < 0)) /* a miss: the walk */
        return false;
    bool first = e >= 0;
    for (int j = 0; first && j < (int)threadIdx.x; j++)
        first = sel_e[j] != e;
    if (first) {
        struct moe_off_walk w = {};
        moe_off_fast_hit(&L, e, s, L.ref, L.pf, &w);
        block_hits_add(&f, w);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        struct moe_off_walk w = {};
        block_hits_get(&f, &w);
        moe_off_fast_end(&w, fl, L.stats);
    }
    return true;
}

/* The walk of a resolve by the whole block (the state read into shared memory sm, of
 * moe_cuda_resolve_smem bytes; the hits by every thread, the misses by thread 0 in expert order;
 * the state written back), the tiered store's request first where the layer has one. */
static __device__ void resolve_walk(const struct moe_cuda_off_layer &L, const int32_t *sel_e,
                                    int n_sel, struct moe_cuda_fill_list *fl, int prefetch,
                                    int32_t *sm)
{
    const int S = L.slots;
    const int nmask = (L.nexp + 31) / 32;
    int32_t *s_slot = sm, *s_exp = sm + L.nexp, *s_list = s_exp + S;
    uint32_t *s_miss = (uint32_t *)(s_list + L.nexp); /* [nmask]: the misses, a bit each */
    uint8_t *s_need = (uint8_t *)(s_miss + nmask), *s_ref = s_need + L.nexp, *s_pin = s_ref + S;
    uint8_t *s_pf = s_pin + S;
    __shared__ struct block_hits bh;
    for (int i = threadIdx.x; i < L.nexp; i += blockDim.x) {
        s_slot[i] = L.slot_of[i];
        s_need[i] = 0;
    }
    for (int i = threadIdx.x; i < S; i += blockDim.x) {
        s_exp[i] = L.slot_exp[i];
        s_ref[i] = L.ref[i];
        s_pin[i] = L.pinned[i];
        s_pf[i] = L.pf ? L.pf[i] : 0;
    }
    if (L.fsrc && !prefetch) /* the walk lists this step's copies afresh */
        for (int i = threadIdx.x; i < 3 * L.nexp; i += blockDim.x)
            L.fsrc[i] = nullptr;
    __syncthreads();
    mark_need(s_need, sel_e, n_sel, L.nexp);
    if (L.chan && !prefetch)
        pool_borrow(L, s_need, s_slot, s_list);
    /* The walk of moe_off_resolve_mode in its two parts (offload_resolve.h): the hits by every
     * thread, then the misses by thread 0 in expert order. */
    for (int i = threadIdx.x; i < nmask; i += blockDim.x)
        s_miss[i] = 0;
    if (threadIdx.x == 0)
        block_hits_zero(&bh);
    __syncthreads();
    uint8_t *pf = L.pf ? s_pf : nullptr;
    struct moe_off_walk mine = {}; /* this thread's hits */
    for (int e = threadIdx.x; e < L.nexp; e += blockDim.x) {
        const int r = moe_off_hit(e, s_need, s_slot, s_ref, pf, prefetch);
        moe_off_count_hit(&L, e, r, &mine);
        if (!r && s_need[e])
            atomicOr(&s_miss[e >> 5], 1u << (e & 31));
    }
    block_hits_add(&bh, mine);
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t hand = S ? *L.hand : 0;
        struct moe_off_walk w;
        moe_off_walk_begin(&L, &hand, &w);
        block_hits_get(&bh, &w);
        for (int i = 0; i < nmask; i++)
            for (uint32_t m = s_miss[i]; m; m &= m - 1)
                moe_off_miss(&L, i * 32 + __ffs((int)m) - 1, s_need, s_slot, s_exp, s_ref,
                             s_pin, pf, fl, prefetch, &w);
        moe_off_walk_end(&L, &w, &hand, fl, L.stats, prefetch);
        if (S)
            *L.hand = hand;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < L.nexp; i += blockDim.x)
        L.slot_of[i] = s_slot[i];
    for (int i = threadIdx.x; i < S; i += blockDim.x) {
        L.slot_exp[i] = s_exp[i];
        L.ref[i] = s_ref[i];
        if (L.pf)
            L.pf[i] = s_pf[i];
    }
}


#endif

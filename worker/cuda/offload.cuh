/* Expert offload on the device (docs/offload.md): per layer, S equal VRAM slots, each holding
 * one expert or none; a pinned slot (a hot expert) is never evicted, the others are the cache.
 * Experts without a slot are read from host memory mapped for the GPU. Inside a step, before a
 * layer's experts run, moe_cuda_offload_resolve looks up the experts the router chose, gives each
 * chosen expert without a slot an unpinned slot whose expert this step does not use (clock),
 * points the layer's expert tables at it and queues its bytes; moe_cuda_offload_fill copies them
 * from host memory into the slots. A chosen expert for which no slot is free is computed
 * straight from host memory. Whichever way, the expert kernels read the same bytes, so the
 * output does not depend on residency. */
#ifndef MOE_CUDA_OFFLOAD_CUH
#define MOE_CUDA_OFFLOAD_CUH

#include <stdint.h>

#include <cuda_runtime.h>

/* slot_of value of an expert without a slot. */
#define MOE_OFF_HOST (-1)

/* Counters per layer (stats[]). */
enum { MOE_OFF_HITS, MOE_OFF_MISSES, MOE_OFF_FILL_BYTES, MOE_OFF_DIRECT, MOE_OFF_DIRECT_BYTES,
       MOE_OFF_NSTATS };

/* One layer's offload state, in device memory. */
struct moe_cuda_off_layer {
    int32_t nexp, slots;
    uint32_t part_off[3];          /* gate, up, down inside a slot */
    uint64_t slot_bytes;
    uint8_t *base;                 /* [slots][slot_bytes] in VRAM */
    int32_t *slot_of;              /* [nexp]: a slot or MOE_OFF_HOST */
    int32_t *slot_exp;             /* [slots]: the expert a slot holds, -1 none */
    uint8_t *pinned;               /* [slots]: 1 = hot, never evicted */
    uint8_t *ref;                  /* [slots]: clock reference bits */
    int32_t *hand;                 /* [1]: clock hand */
    const void *const *host;       /* [3][nexp]: device addresses of the host copies */
    const uint32_t *bytes;         /* [3][nexp] */
    const void **tab[3];           /* the layer's gate, up and down tables the kernels read */
    unsigned long long *stats;     /* [MOE_OFF_NSTATS] */
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

/* Bytes of a fill list for layers of up to max_slots slots. */
size_t moe_cuda_fill_list_bytes(int32_t max_slots);

/* Resolves the n_sel chosen experts of sel_e for the layer *d_layer (device memory; nexp and
 * slots are its values, needed here for the launch shape), writing the copies to *d_fill. */
int moe_cuda_offload_resolve(const struct moe_cuda_off_layer *d_layer, int32_t nexp,
                             int32_t slots, const int32_t *sel_e, int64_t n_sel,
                             struct moe_cuda_fill_list *d_fill, cudaStream_t s);
/* Runs the copies of *d_fill on `blocks` blocks. */
int moe_cuda_offload_fill(const struct moe_cuda_fill_list *d_fill, int blocks, cudaStream_t s);

#endif

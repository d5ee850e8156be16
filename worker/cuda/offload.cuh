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

#include "worker/cuda/offload_resolve.h"

/* Bytes of a fill list for layers of up to max_slots slots. */
size_t moe_cuda_fill_list_bytes(int32_t max_slots);

/* The routing a resolve can do first (decode steps of up to MOE_OFF_ROUTE_MAX tokens, layers of
 * up to 256 experts): the route kernel's (moe_cuda_route) top-k of rl's n rows of nexp logits
 * into sel_e / sel_w, counted in counts. */
#define MOE_OFF_ROUTE_MAX 8
/* The most choices a resolve's short way takes (one thread each; resolve_fast). */
#define MOE_OFF_FAST_MAX 64
struct moe_cuda_off_route {
    const float *rl;
    int64_t ldl;
    int n, k, nexp;
    bool norm_topk;
    int32_t *sel_e;
    float *sel_w;
    unsigned long long *counts;
};

/* Resolves the n_sel chosen experts of sel_e for the layer *d_layer (device memory; nexp and
 * slots are its values, needed here for the launch shape), writing the copies to *d_fill.
 * prefetch: sel_e is a prediction for a layer that has not routed yet (moe_off_resolve_mode).
 * rt (or NULL): the routing that writes sel_e, done first in the same launch. With a tiered
 * store's channel (the layer's chan), the chosen experts without a slot are borrowed from the
 * pool first (offload_resolve.h, struct moe_off_chan). fast: a layer's own resolve (no channel,
 * at most MOE_OFF_FAST_MAX choices) whose chosen experts all have a slot touches only their
 * entries (moe_off_fast_hit), with the walk's result. */
int moe_cuda_offload_resolve(const struct moe_cuda_off_layer *d_layer, int32_t nexp,
                             int32_t slots, const int32_t *sel_e, int64_t n_sel,
                             struct moe_cuda_fill_list *d_fill, bool prefetch,
                             const struct moe_cuda_off_route *rt, bool fast, cudaStream_t s);
/* Tiered store, on the prefetch's stream: the n_sel predicted experts sel of layer *d_layer
 * that have no VRAM slot written to the layer's hint (moe_off_hint_list), for the worker to
 * have them read ahead. */
int moe_cuda_offload_pool_hint(const struct moe_cuda_off_layer *d_layer, int32_t nexp,
                               const int32_t *sel, int64_t n_sel, cudaStream_t s);
/* After the expert kernels of a layer with a tiered store's channel: what its resolve borrowed
 * is given back (moe_off_pool_return) and the worker told (the channel's done). */
int moe_cuda_offload_pool_done(const struct moe_cuda_off_layer *d_layer, cudaStream_t s);
/* y[t][i] = x[t][i] * scale[i] for n rows of E (the prefetch's input: layer l's normed MoE input
 * re-weighted by layer l+1's norm over layer l's). */
int moe_cuda_scale_rows(const float *d_x, int64_t ldx, const float *d_scale, int64_t E, int64_t n,
                        float *d_y, int64_t ldy, cudaStream_t s);
/* Prompt staging (moe_off_stage): the first `cap` experts of layer *d_layer without a slot
 * into the staging buffer `stage`, the copies written to *d_fill (run them with
 * moe_cuda_offload_fill), the tables pointed at the buffer. */
int moe_cuda_offload_stage(const struct moe_cuda_off_layer *d_layer, int32_t nexp, uint8_t *stage,
                           int32_t cap, struct moe_cuda_fill_list *d_fill, cudaStream_t s);
/* After the staged layer's expert kernels (moe_off_stage_end): the lookups of the n_sel chosen
 * experts sel_e counted, the tables pointed back at the host copies. n_sel 0: only the
 * tables (a staging whose layer never ran). */
int moe_cuda_offload_stage_end(const struct moe_cuda_off_layer *d_layer, int32_t nexp,
                               const int32_t *sel_e, int64_t n_sel, int32_t cap, cudaStream_t s);
/* Runs the copies of *d_fill on `blocks` blocks; link_gbps > 0 paces them to at most that many
 * GB/s (a simulated slow link: MOE_CUDA_LINK_GBPS), 0 runs them as fast as they go. */
int moe_cuda_offload_fill(const struct moe_cuda_fill_list *d_fill, int blocks, float link_gbps,
                          cudaStream_t s);
/* The same with `threads` (256, 128 or 64; -EINVAL otherwise) threads a block, each with a
 * 16 KiB chunk's share of loads in flight (4, 8 or 16): the same bytes in flight per block,
 * fewer registers and warps taken from the kernels beside it. */
int moe_cuda_offload_fill_nt(const struct moe_cuda_fill_list *d_fill, int blocks, int threads,
                             float link_gbps, cudaStream_t s);
/* Measures the two ways an expert outside VRAM reaches the GPU over `bytes` of host memory
 * mapped at d_src: copied into VRAM (d_dst, as many bytes) by the fill kernel (paced as
 * moe_cuda_offload_fill), and read in place by a kernel as the expert kernels read it; GB/s of
 * each into *fill_gbps and *read_gbps. Synchronises s. */
int moe_cuda_link_probe(const uint8_t *d_src, size_t bytes, uint8_t *d_dst, int blocks,
                        float link_gbps, double *fill_gbps, double *read_gbps, cudaStream_t s);

#endif

/* Expert offload kernels (see offload.cuh). */
#include <errno.h>
#include <stdlib.h>

#include "worker/cuda/cuda_check.cuh"
#include "worker/cuda/offload.cuh"
#include "worker/cuda/offload_dev.cuh"
#include "worker/cuda/ops_dev.cuh"

size_t moe_cuda_fill_list_bytes(int32_t max_slots)
{
    const int32_t n = 3 * (max_slots > 0 ? max_slots : 1);
    return sizeof(struct moe_cuda_fill_list) + sizeof(struct moe_cuda_fill) * (size_t)(n - 1);
}

/* One block. The layer's state is read into shared memory, thread 0 walks the chosen experts in
 * expert order (deterministic), and the state is written back; a layer's own resolve also lists
 * its copies' sources in L.fsrc (cleared first) for expert kernels that copy as they go. With
 * rt.rl, warp w first routes token w (route_warp, as the route kernel does). With a tiered
 * store's channel (L.chan, and not a prefetch), the chosen experts without a slot are asked for
 * first (pool_borrow). fast: a layer's own resolve whose chosen experts all have a slot (and
 * at most MOE_OFF_FAST_MAX of them) only touches their entries (resolve_fast), not the whole
 * state. */
__global__ void offload_resolve_kernel(const struct moe_cuda_off_layer *__restrict__ lp,
                                       const int32_t *sel_e, int n_sel,
                                       struct moe_cuda_fill_list *__restrict__ fl,
                                       int prefetch, struct moe_cuda_off_route rt, int fast)
{
    if (rt.rl) {
        const int w = (int)(threadIdx.x >> 5);
        if (w < rt.n)
            route_warp(rt.rl + (int64_t)w * rt.ldl, rt.nexp, rt.k, rt.norm_topk,
                       rt.sel_e + (int64_t)w * rt.k, rt.sel_w + (int64_t)w * rt.k, rt.counts,
                       nullptr);
    }
    const struct moe_cuda_off_layer L = *lp;
    if (fast && !prefetch && !L.chan && n_sel <= MOE_OFF_FAST_MAX && n_sel <= (int)blockDim.x) {
        if (rt.rl)
            __syncthreads(); /* the routing's choices written */
        if (resolve_fast(L, sel_e, n_sel, fl))
            return;
    }
    extern __shared__ int32_t sm[];
    resolve_walk(L, sel_e, n_sel, fl, prefetch, sm);
}

/* After a tiered store's layer ran (moe_off_pool_return): its lent addresses dropped, and the
 * worker told that the request's pins may go. */
__global__ void offload_pool_done_kernel(const struct moe_cuda_off_layer *__restrict__ lp)
{
    const struct moe_cuda_off_layer L = *lp;
    const int32_t n = *L.n_borrow;
    if (n == 0)
        return;
    moe_off_pool_return(&L, L.borrow, n, L.slot_of, (int32_t)threadIdx.x, (int32_t)blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        *L.n_borrow = 0;
        __threadfence_system();
        L.chan->done = *L.chan_seq;
    }
}


/* Grid-stride over the chunks of every copy; 16-byte loads where source and destination allow
 * (the store's slices are 64-byte aligned, slots 256), bytes otherwise. ns_per_chunk > 0 (a
 * simulated slow link, MOE_CUDA_LINK_GBPS): chunk c is not done before (c + 1) * ns_per_chunk
 * after the block started, so the copies run at most at that rate. NT threads a block, each with
 * a 16 KiB chunk's share of loads in flight before its stores (ILP = 1024 / NT): 256 threads
 * with 4 each by default, or thin blocks (64 threads with 16 each) that leave room for three
 * blocks of the per-token gate/up beside them on an SM (MOE_CUDA_PREFETCH_THREADS). */
template <int NT>
static __device__ void fill_chunks(const struct moe_cuda_fill_list *__restrict__ fl, int first,
                                   int stride, double ns_per_chunk)
{
    constexpr int ILP = (int)(MOE_OFF_CHUNK / 16) / NT;
    static_assert(ILP >= 1 && ILP * NT * 16 == MOE_OFF_CHUNK, "a chunk's loads spread over the block");
    const int nc = fl->n_chunks, nj = fl->n;
    const uint64_t t0 = ns_per_chunk > 0 ? global_ns() : 0;
    for (int c = first; c < nc; c += stride) {
        if (ns_per_chunk > 0) {
            if (threadIdx.x == 0)
                while ((double)(global_ns() - t0) < (double)(c + 1) * ns_per_chunk)
                    __nanosleep(1000);
            __syncthreads();
        }
        int lo = 0, hi = nj - 1;
        while (lo < hi) { /* the last copy whose first chunk is <= c */
            const int mid = (lo + hi + 1) / 2;
            if ((int)fl->job[mid].chunk0 <= c)
                lo = mid;
            else
                hi = mid - 1;
        }
        const struct moe_cuda_fill j = fl->job[lo];
        const size_t off = (size_t)(c - (int)j.chunk0) * MOE_OFF_CHUNK;
        const size_t end = off + MOE_OFF_CHUNK < j.bytes ? off + MOE_OFF_CHUNK : j.bytes;
        const uint8_t *src = j.src + off;
        uint8_t *dst = j.dst + off;
        const size_t n = end - off;
        if ((((uintptr_t)src | (uintptr_t)dst) & 15) == 0) {
            const size_t n16 = n / 16;
            const uint4 *s4 = (const uint4 *)src;
            uint4 *d4 = (uint4 *)dst;
            /* ILP loads in flight per thread before the stores. */
            size_t i = threadIdx.x;
            for (; i + (size_t)(ILP - 1) * NT < n16; i += (size_t)ILP * NT) {
                uint4 v[ILP];
#pragma unroll
                for (int u = 0; u < ILP; u++)
                    v[u] = s4[i + (size_t)u * NT];
#pragma unroll
                for (int u = 0; u < ILP; u++)
                    d4[i + (size_t)u * NT] = v[u];
            }
            for (; i < n16; i += NT)
                d4[i] = s4[i];
            for (size_t k = n16 * 16 + threadIdx.x; k < n; k += NT)
                dst[k] = src[k];
        } else {
            for (size_t k = threadIdx.x; k < n; k += NT)
                dst[k] = src[k];
        }
    }
}

template <int NT>
__global__ void __launch_bounds__(NT) offload_fill_kernel(const struct moe_cuda_fill_list *__restrict__ fl,
                                                          double ns_per_chunk)
{
    fill_chunks<NT>(fl, (int)blockIdx.x, (int)gridDim.x, ns_per_chunk);
}

int moe_cuda_offload_resolve(const struct moe_cuda_off_layer *d_layer, int32_t nexp,
                             int32_t slots, const int32_t *sel_e, int64_t n_sel,
                             struct moe_cuda_fill_list *d_fill, bool prefetch,
                             const struct moe_cuda_off_route *rt, bool fast, cudaStream_t s)
{
    if (nexp <= 0 || slots < 0 || slots > nexp || n_sel < 0 || n_sel > (1 << 24))
        return -EINVAL;
    struct moe_cuda_off_route r = {};
    if (rt) {
        if (!rt->rl || rt->n < 1 || rt->n > MOE_OFF_ROUTE_MAX || rt->k < 1 || rt->k > rt->nexp ||
            rt->nexp != nexp || nexp > 256 || (int64_t)rt->n * rt->k != n_sel ||
            rt->sel_e != sel_e)
            return -EINVAL;
        r = *rt;
    }
    const size_t smem = moe_cuda_resolve_smem(nexp, slots);
    offload_resolve_kernel<<<1, 256, smem, s>>>(d_layer, sel_e, (int)n_sel, d_fill, prefetch, r,
                                                 fast);
    MOE_CUDA_TRY(cudaGetLastError());
    return 0;
}

/* One block: the hint of moe_off_hint_list written to *L.hint and its number bumped. */
__global__ void offload_pool_hint_kernel(const struct moe_cuda_off_layer *__restrict__ lp,
                                         const int32_t *__restrict__ sel, int n_sel)
{
    const struct moe_cuda_off_layer L = *lp;
    extern __shared__ int32_t hm[];
    int32_t *list = hm;
    uint8_t *seen = (uint8_t *)(hm + L.nexp);
    for (int i = threadIdx.x; i < L.nexp; i += blockDim.x)
        seen[i] = 0;
    __syncthreads();
    __shared__ int32_t s_n;
    if (threadIdx.x == 0)
        s_n = moe_off_hint_list(sel, n_sel, L.slot_of, L.nexp, seen, list);
    __syncthreads();
    const int32_t n = s_n;
    if (n == 0)
        return;
    /* seq 0 while the hint is written: the worker drops one it read meanwhile. */
    if (threadIdx.x == 0) {
        L.hint->seq = 0;
        __threadfence_system();
    }
    __syncthreads();
    volatile int32_t *ids = (volatile int32_t *)(L.hint + 1);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        ids[i] = list[i];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        L.hint->layer = L.layer;
        L.hint->n = n;
        __threadfence_system();
        const uint32_t seq = *L.hint_seq + 1;
        *L.hint_seq = seq;
        L.hint->seq = seq;
    }
}

int moe_cuda_offload_pool_hint(const struct moe_cuda_off_layer *d_layer, int32_t nexp,
                               const int32_t *sel, int64_t n_sel, cudaStream_t s)
{
    if (nexp <= 0 || n_sel < 0 || n_sel > (1 << 24))
        return -EINVAL;
    const size_t smem = (size_t)nexp * sizeof(int32_t) + (size_t)nexp;
    offload_pool_hint_kernel<<<1, 128, smem, s>>>(d_layer, sel, (int)n_sel);
    MOE_CUDA_TRY(cudaGetLastError());
    return 0;
}

int moe_cuda_offload_pool_done(const struct moe_cuda_off_layer *d_layer, cudaStream_t s)
{
    offload_pool_done_kernel<<<1, 128, 0, s>>>(d_layer);
    MOE_CUDA_TRY(cudaGetLastError());
    return 0;
}

/* One block, thread 0 walks (the order of the staging buffer is the experts' order). */
__global__ void offload_stage_kernel(const struct moe_cuda_off_layer *__restrict__ lp,
                                     uint8_t *stage, int32_t cap,
                                     struct moe_cuda_fill_list *__restrict__ fl)
{
    if (threadIdx.x != 0)
        return;
    const struct moe_cuda_off_layer L = *lp;
    moe_off_stage(&L, L.slot_of, stage, cap, fl, L.stats);
}

__global__ void offload_stage_end_kernel(const struct moe_cuda_off_layer *__restrict__ lp,
                                         const int32_t *__restrict__ sel_e, int n_sel,
                                         int32_t cap)
{
    const struct moe_cuda_off_layer L = *lp;
    extern __shared__ uint8_t s_need[];
    for (int i = threadIdx.x; i < L.nexp; i += blockDim.x)
        s_need[i] = 0;
    __syncthreads();
    mark_need(s_need, sel_e, n_sel, L.nexp);
    if (threadIdx.x == 0) /* n_sel 0: nothing needed, so only the tables change */
        moe_off_stage_end(&L, s_need, L.slot_of, L.ref, cap, L.stats);
}

int moe_cuda_offload_stage(const struct moe_cuda_off_layer *d_layer, int32_t nexp, uint8_t *stage,
                           int32_t cap, struct moe_cuda_fill_list *d_fill, cudaStream_t s)
{
    if (nexp <= 0 || cap < 0 || !stage)
        return -EINVAL;
    offload_stage_kernel<<<1, 1, 0, s>>>(d_layer, stage, cap, d_fill);
    MOE_CUDA_TRY(cudaGetLastError());
    return 0;
}

int moe_cuda_offload_stage_end(const struct moe_cuda_off_layer *d_layer, int32_t nexp,
                               const int32_t *sel_e, int64_t n_sel, int32_t cap, cudaStream_t s)
{
    if (nexp <= 0 || cap < 0 || n_sel < 0 || n_sel > (1 << 24))
        return -EINVAL;
    offload_stage_end_kernel<<<1, 256, (size_t)nexp, s>>>(d_layer, sel_e, (int)n_sel, cap);
    MOE_CUDA_TRY(cudaGetLastError());
    return 0;
}

static double ns_per_chunk(float link_gbps)
{
    return link_gbps > 0 ? (double)MOE_OFF_CHUNK / (double)link_gbps : 0.0;
}

int moe_cuda_offload_fill(const struct moe_cuda_fill_list *d_fill, int blocks, float link_gbps,
                          cudaStream_t s)
{
    return moe_cuda_offload_fill_nt(d_fill, blocks, 256, link_gbps, s);
}

int moe_cuda_offload_fill_nt(const struct moe_cuda_fill_list *d_fill, int blocks, int threads,
                             float link_gbps, cudaStream_t s)
{
    if (blocks <= 0)
        return -EINVAL;
    const double ns = ns_per_chunk(link_gbps);
    if (threads == 256)
        offload_fill_kernel<256><<<blocks, 256, 0, s>>>(d_fill, ns);
    else if (threads == 128)
        offload_fill_kernel<128><<<blocks, 128, 0, s>>>(d_fill, ns);
    else if (threads == 64)
        offload_fill_kernel<64><<<blocks, 64, 0, s>>>(d_fill, ns);
    else
        return -EINVAL;
    MOE_CUDA_TRY(cudaGetLastError());
    return 0;
}

/* What an expert kernel reading its weights from host memory does to the link: 16-byte loads
 * over [src, src + bytes), summed so that they are not dropped. */
__global__ void __launch_bounds__(256) link_read_kernel(const uint4 *__restrict__ src, size_t n16,
                                                        unsigned *__restrict__ out)
{
    unsigned acc = 0;
    for (size_t i = (size_t)blockIdx.x * 256 + threadIdx.x; i < n16; i += (size_t)gridDim.x * 256) {
        const uint4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) /* practically never; keeps the loads */
        out[blockIdx.x] = acc;
}

int moe_cuda_link_probe(const uint8_t *d_src, size_t bytes, uint8_t *d_dst, int blocks,
                        float link_gbps, double *fill_gbps, double *read_gbps, cudaStream_t s)
{
    bytes &= ~(size_t)15;
    if (!d_src || !d_dst || bytes < MOE_OFF_CHUNK || blocks <= 0)
        return -EINVAL;
    const uint32_t per = 1u << 24; /* jobs of 16 MiB */
    const int32_t nj = (int32_t)((bytes + per - 1) / per);
    const size_t lb = sizeof(struct moe_cuda_fill_list) + sizeof(struct moe_cuda_fill) * (size_t)nj;
    struct moe_cuda_fill_list *h = (struct moe_cuda_fill_list *)calloc(1, lb);
    if (!h)
        return -ENOMEM;
    uint32_t chunks = 0;
    for (int32_t j = 0; j < nj; j++) {
        const size_t off = (size_t)j * per;
        struct moe_cuda_fill *f = &h->job[j];
        f->src = d_src + off;
        f->dst = d_dst + off;
        f->bytes = (uint32_t)(bytes - off < per ? bytes - off : per);
        f->chunk0 = chunks;
        chunks += (uint32_t)moe_off_fill_chunks(f);
    }
    h->n = nj;
    h->n_chunks = (int32_t)chunks;
    struct moe_cuda_fill_list *d = NULL;
    unsigned *d_out = NULL;
    cudaEvent_t e[3] = {};
    cudaError_t ce = cudaMalloc((void **)&d, lb);
    if (ce == cudaSuccess)
        ce = cudaMalloc((void **)&d_out, sizeof(unsigned) * (size_t)blocks);
    for (int i = 0; i < 3 && ce == cudaSuccess; i++)
        ce = cudaEventCreate(&e[i]);
    if (ce == cudaSuccess)
        ce = cudaMemcpyAsync(d, h, lb, cudaMemcpyHostToDevice, s);
    /* Each measured once after a warm-up run. */
    for (int rep = 0; rep < 2 && ce == cudaSuccess; rep++) {
        cudaEventRecord(e[0], s);
        offload_fill_kernel<256><<<blocks, 256, 0, s>>>(d, ns_per_chunk(link_gbps));
        cudaEventRecord(e[1], s);
        link_read_kernel<<<blocks, 256, 0, s>>>((const uint4 *)d_src, bytes / 16, d_out);
        cudaEventRecord(e[2], s);
        ce = cudaEventSynchronize(e[2]);
    }
    float ms_fill = 0, ms_read = 0;
    if (ce == cudaSuccess)
        ce = cudaEventElapsedTime(&ms_fill, e[0], e[1]);
    if (ce == cudaSuccess)
        ce = cudaEventElapsedTime(&ms_read, e[1], e[2]);
    for (int i = 0; i < 3; i++)
        if (e[i])
            cudaEventDestroy(e[i]);
    cudaFree(d);
    cudaFree(d_out);
    free(h);
    MOE_CUDA_TRY(ce);
    *fill_gbps = ms_fill > 0 ? (double)bytes / (ms_fill * 1e6) : 0;
    *read_gbps = ms_read > 0 ? (double)bytes / (ms_read * 1e6) : 0;
    return 0;
}

__global__ void scale_rows_kernel(const float *__restrict__ x, int64_t ldx,
                                  const float *__restrict__ scale, int64_t E,
                                  float *__restrict__ y, int64_t ldy)
{
    const int64_t t = blockIdx.y;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < E;
         i += (int64_t)gridDim.x * blockDim.x)
        y[t * ldy + i] = x[t * ldx + i] * scale[i];
}

int moe_cuda_scale_rows(const float *d_x, int64_t ldx, const float *d_scale, int64_t E, int64_t n,
                        float *d_y, int64_t ldy, cudaStream_t s)
{
    if (E <= 0 || n <= 0 || n > 65535)
        return -EINVAL;
    const unsigned bx = (unsigned)((E + 255) / 256 < 8 ? (E + 255) / 256 : 8);
    scale_rows_kernel<<<dim3(bx, (unsigned)n), 256, 0, s>>>(d_x, ldx, d_scale, E, d_y, ldy);
    MOE_CUDA_TRY(cudaGetLastError());
    return 0;
}

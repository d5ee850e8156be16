/* The fused decode step: every layer of a one-token step in one persistent kernel (fused.cu).
 * Internal to the CUDA backend. Blocks stay resident for the whole step and meet at grid-wide
 * barriers between the phases of a layer; each phase runs the same device bodies as the per-op
 * kernels (mv_warp.cuh, ops_dev.cuh, experts_dev.cuh), so the step's floats are those of the
 * op-by-op step, bit for bit. */
#ifndef MOE_CUDA_FUSED_CUH
#define MOE_CUDA_FUSED_CUH

#include <stdbool.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "worker/cuda/ops.cuh"

/* One matrix of a mat-vec phase: y (=, or += when accumulating) W · x for `rows` rows. kind:
 * the stored type, or one of the 16-byte vector kinds of the plain types (qdot.cuh); items: row
 * groups a warp takes (rows / rows_per_item, rounded up). */
struct moe_fused_mat {
    const uint8_t *w;
    float *y;
    int64_t rows, items;
    size_t row_bytes;
    unsigned block_bytes;
    int nu, kind, rows_per_item;
};

struct moe_fused_layer {
    struct moe_fused_mat qkv[3], o, router;
    const float *attn_norm, *ffn_norm, *q_norm, *k_norm;
    const uint8_t *const *gate, *const *up, *const *down; /* device tables [nexp] */
    size_t gu_row_bytes, down_row_bytes;
    unsigned gu_block_bytes, down_block_bytes;
    int gu_nu, down_nu, gu_kind, down_kind;
    unsigned long long *counts; /* [nexp] */
};

struct moe_fused_args {
    const struct moe_fused_layer *layers; /* device [L] */
    int L;
    float *h, *x, *q, *k, *v, *att, *rl, *sel_w, *act;
    int64_t ld_act;         /* floats between the expert slots' rows of act */
    int32_t *sel_e;
    struct moe_cuda_kv kv;
    const float *rope;
    const int32_t *pos, *seq;
    float *part;
    unsigned *att_done;
    int att_z, el;          /* attention split groups per head; head-vector floats per lane */
    int64_t E, H, nexp, ff;
    int kuse;
    float eps, att_scale;
    bool norm_topk;
    bool router_smem;       /* the router reads the normed input from shared memory */
    bool prefetch;          /* weights of the next phase prefetched into L2 before a barrier */
    unsigned *bar;          /* [MOE_FUSED_BAR_WORDS + sm_slots] the grid barrier and per-SM-id
                             * block counts, zeroed at launch */
    int sm_slots;           /* SM ids the counts have room for (MOE_FUSED_SM_SLOTS) */
    int spare_barriers;     /* extra barriers after each layer (measuring the barrier) */
    uint64_t *timing;       /* NULL, or [L][FUSED_NPH] end of each phase (ns, %globaltimer) and
                             * [L·FUSED_NPH] the start */
};

/* The phases of a layer (timing): the router phase only ends on its own when the router does
 * not read from shared memory. */
enum {
    FUSED_PH_NORM1, FUSED_PH_QKV, FUSED_PH_ROPE, FUSED_PH_ATTN, FUSED_PH_O, FUSED_PH_NORM2,
    FUSED_PH_ROUTER, FUSED_PH_SOFTMAX, FUSED_PH_ROUTE, FUSED_PH_GATE_UP, FUSED_PH_DOWN, FUSED_PH_SPARE, FUSED_NPH
};

#define MOE_FUSED_BAR_WORDS 64
#define MOE_FUSED_SM_SLOTS 1024

/* How the fused kernel walks the rows of a weight: kind, bytes per row and per block, units per
 * row, rows per warp item. */
struct moe_fused_geom {
    int kind, nu, rows_per_item;
    size_t row_bytes;
    unsigned block_bytes;
};

/* 1 (and g filled) when the fused kernel computes weights of this type with rows of n elements
 * (the plain types need 16-byte rows), 0 when not. */
int moe_cuda_fused_geom(uint32_t type, int64_t n, struct moe_fused_geom *g);

/* The kind of float32 rows read 16 bytes at a time (a router the kernel reads from shared memory). */
int moe_cuda_fused_kind_f32v(void);

/* Blocks of the fused kernel per SM (occupancy, capped at max_per_sm: 1 or 2, the variant whose
 * registers are sized for that many) and the dynamic shared memory it needs; 0 blocks: it cannot
 * run. */
int moe_cuda_fused_config(int64_t E, int64_t hd, int64_t nexp, int kuse, int max_per_sm,
                          int *blocks_per_sm, size_t *smem);

/* Enqueues the step (the barrier counter zeroed first) on s with `blocks` blocks of the per_sm
 * variant, every one of which must be resident at once (cooperative launch when coop). */
int moe_cuda_fused_launch(const struct moe_fused_args *a, int blocks, int per_sm, size_t smem,
                          bool coop, cudaStream_t s);

#endif

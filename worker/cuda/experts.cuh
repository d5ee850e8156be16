/* Grouped expert kernels: all k selected experts of every token of a step in one launch each,
 * through device tables of expert weight pointers (ptr[expert] for one layer). Internal to the
 * CUDA backend. */
#ifndef MOE_CUDA_EXPERTS_CUH
#define MOE_CUDA_EXPERTS_CUH

#include <stdint.h>

#include <cuda_runtime.h>

/* The routing that moe_cuda_expert_gate_up may do itself (moe_cuda_route's arguments): the
 * router's logits rl (rows ldl apart, nexp each), and where the choices and their counts go. */
struct moe_cuda_route_in {
    const float *rl;
    int64_t ldl;
    int nexp;
    bool norm_topk;
    int32_t *sel_e;
    float *sel_w;
    unsigned long long *counts;
    /* Or NULL: the one token's input row staged for the tensor-core gate/up of its type by the
     * router launch (moe_cuda_router_norm_staged), which a one-token gate/up of that type on
     * tensor cores copies instead of staging the row itself (the same floats). */
    const void *staged;
    uint32_t staged_type;
};

/* A gate/up launch that resolves its layer's choices itself (a one-token step of an offloaded
 * layer, with the routing in the launch and the copies made by the expert kernels): the layer's
 * offload state (device memory), the walk's copies list, and the layer's three sync words
 * (zeroed at start, used by no other launch; the launch's grid must be the same at every step):
 * the blocks' tickets, the step whose walk changes the state, the step whose resolve is done.
 * The first block of a step resolves (offload_dev.cuh: resolve_fast, else resolve_walk); a
 * block whose expert already had a slot goes on without waiting, the others wait for it. */
struct moe_cuda_off_layer;
struct moe_cuda_fill_list;
struct moe_cuda_gu_resolve {
    const struct moe_cuda_off_layer *off;
    struct moe_cuda_fill_list *fl;
    unsigned long long *sync;
    int32_t nexp, slots;
};

/* act[s][r] = silu(gate_e · x[t]) · (up_e · x[t]) for every slot s = t·k + j, e = sel_e[s],
 * t < n_tok, r < ff (x rows ldx floats apart, act rows ldact, both multiples of 4). gate and up:
 * [ff][n] of one type each, tables of device pointers. route: NULL, or the step's routing done
 * in the same launch (gate and up of one type): sel_e is then ignored, route->sel_e / sel_w /
 * counts get what moe_cuda_route would have written. d_fill (or NULL): [3][nexp] fill sources
 * of an offloaded layer (struct moe_cuda_off_layer's fsrc): where an expert's entry is set, its
 * gate and up rows are copied from there to where the tables point before they are read.
 * resolve (or NULL; with route and d_fill): the layer's lookup of its choices in the same
 * launch (struct moe_cuda_gu_resolve), instead of moe_cuda_offload_resolve before it. */
int moe_cuda_expert_gate_up(uint32_t gate_type, uint32_t up_type, const void *const *d_gate,
                            const void *const *d_up, int64_t n, int64_t ff, const float *d_x,
                            int64_t ldx, int64_t n_tok, int kuse, const int32_t *d_sel_e,
                            float *d_act, int64_t ldact, float *d_scratch,
                            const struct moe_cuda_route_in *route, const void *const *d_fill,
                            int64_t nexp, const struct moe_cuda_gu_resolve *resolve, int tc,
                            cudaStream_t s);

/* Expert products on tensor cores (worker/cuda/mv_tc_dev.cuh): the tc argument of the expert
 * kernels below, a mask of MOE_CUDA_TC_GATE_UP and MOE_CUDA_TC_DOWN. Q4_K and Q6_K experts whose
 * rows are whole blocks of 256 are then multiplied as f16 fragments with two-part inputs (about
 * 22 bits of each input, against 24 for the float walk); other types keep the float walk. A
 * slot's floats are the same whatever the batch and the path (per slot or grouped). */
#define MOE_CUDA_TC_GATE_UP 1
#define MOE_CUDA_TC_DOWN 2
/* Not an expert kernel's: the backend's decode mat-vecs of the layers (moe_cuda_matvec_tc_multi;
 * one token: moe_cuda_matvec_tc_norm where an RMSNorm is pending) and, with MOE_CUDA_TC_HEAD,
 * the output head. */
#define MOE_CUDA_TC_DENSE 4
#define MOE_CUDA_TC_HEAD (1 << 16)
/* The attention output's product alone of the layers' decode mat-vecs (MOE_CUDA_TC_DENSE takes
 * them all). */
#define MOE_CUDA_TC_O (1 << 17)
#define MOE_CUDA_TC_ANY (MOE_CUDA_TC_GATE_UP | MOE_CUDA_TC_DOWN | MOE_CUDA_TC_DENSE)
/* Bits 8-11 of tc: at most that many warps in the per-token down kernel on tensor cores (0: as
 * many as fit; the floats are the same either way). From MOE_CUDA_DOWN_TC_WARPS, for tests. */
#define MOE_CUDA_TC_DOWN_WARPS(tc) (((tc) >> 8) & 15)
/* The gate/up and down on tensor cores copy their tile's rows into shared memory at once
 * (cp.async) before reading them (the same floats): MOE_CUDA_TC_ASYNC in the per-token kernels
 * (launches without fills or a resolve), MOE_CUDA_TC_ASYNC_GROUPED in the kernels of steps
 * grouped by expert. The grouped ones by default (+1.6% at 16 sequences, +1.4% at 64 on an
 * H100); the per-token ones lose 3% at batch 1, so they are opt-in. */
#define MOE_CUDA_TC_ASYNC (1 << 12)
#define MOE_CUDA_TC_ASYNC_GROUPED (1 << 13)
#define MOE_CUDA_TC_ASYNC_ANY (MOE_CUDA_TC_ASYNC | MOE_CUDA_TC_ASYNC_GROUPED)
/* The one-token down on tensor cores copies each choice's tile rows into its warp's shared
 * memory too (the same floats): MOE_CUDA_TC_DOWN_WS for Q6_K (2-byte-aligned blocks, read as
 * many small pieces, which shared memory serves faster than the global load queue: +0.5 to
 * 1.4% at batch 1 on an H100), MOE_CUDA_TC_DOWN_WS_ALL for every type. */
#define MOE_CUDA_TC_DOWN_WS (1 << 14)
#define MOE_CUDA_TC_DOWN_WS_ALL (1 << 15)

/* The mask that MOE_CUDA_TC asks for (read at each call): unset (the default) or "1" the expert
 * gate/up and down, "down" expert down, "gu" gate/up, "dense" the decode mat-vecs and head,
 * "layers" the expert products and the layers' decode mat-vecs (not the head), "o" the expert
 * products and the attention output's, "all" everything, "0" none (the float walk
 * everywhere); with MOE_CUDA_DOWN_TC_WARPS=N (1-15) in bits 8-11, MOE_CUDA_TC_ASYNC: unset the grouped kernels' bit, "1" both bits, "0"
 * neither, and MOE_CUDA_DOWN_WS: unset MOE_CUDA_TC_DOWN_WS, "all" MOE_CUDA_TC_DOWN_WS_ALL, "0"
 * neither. */
int moe_cuda_expert_tc_env(void);

/* Whether tc (a mask) puts experts of `type` on tensor cores. */
bool moe_cuda_expert_tc(int tc, uint32_t type);

/* h[t][r] += Σ_j sel_w[t·k+j] · (down_e · act[t·k+j]) for r < E, summed over j = 0..k-1 in that
 * order (after each expert's dot product is complete), then added to h once. d_fill (or NULL):
 * the down part of the fill sources (fsrc + 2·nexp), as for gate/up. */
int moe_cuda_expert_down(uint32_t type, const void *const *d_down, int64_t ff, int64_t E,
                         const float *d_act, int64_t ldact, int64_t n_tok, int kuse,
                         const int32_t *d_sel_e, const float *d_sel_w, float *d_h, int64_t ldh,
                         const void *const *d_fill, int tc, cudaStream_t s);

/* The step's expert slots grouped by expert (device buffers, filled by moe_cuda_expert_group):
 * the slots of expert e are slot_list[ex_off[e] .. ex_off[e+1]), in slot order; act_list[0 ..
 * *n_active) are the experts with at least one slot, in increasing order. */
struct moe_cuda_groups {
    int32_t *ex_off;     /* [nexp + 1] */
    int32_t *slot_list;  /* [n_slots] */
    int32_t *act_list;   /* [nexp] */
    int32_t *n_active;   /* [1] */
    int32_t *slot_tok;   /* [n_slots] token of grouped position i (NULL: not filled) */
    int32_t *slot_pos;   /* [n_slots] grouped position of slot s */
};

int moe_cuda_expert_group(const int32_t *d_sel_e, int64_t n_slots, int64_t nexp, int kuse,
                          struct moe_cuda_groups *g, cudaStream_t s);

/* act[i] = silu(g[i]) · u[i] for i < count. */
int moe_cuda_expert_swiglu(const float *d_g, const float *d_u, float *d_act, int64_t count,
                           cudaStream_t s);

/* h[t] += Σ_j sel_w[t][j] · dout[slot_pos[t·k + j]] in top-k order (outputs in grouped order). */
int moe_cuda_expert_combine_pos(const float *d_dout, int64_t ldd, int64_t E, int64_t n_tok,
                                int kuse, const float *d_sel_w, const int32_t *d_slot_pos,
                                float *d_h, int64_t ldh, cudaStream_t s);

/* Gate/up by expert (gate and up of one type): each active expert's rows are read from memory
 * once for all its slots. max_active: min(nexp, n_slots), the grid's bound. Same results as
 * moe_cuda_expert_gate_up, bit for bit. With gate/up on tensor cores and d_ws (16-byte aligned,
 * at least moe_cuda_matvec_tc_ws_bytes(n, n_tok) bytes; NULL: none), the step's n_tok input rows
 * are staged once there (moe_cuda_tc_stage) instead of in every block: the same bits. */
int moe_cuda_expert_gate_up_grouped(uint32_t type, const void *const *d_gate,
                                    const void *const *d_up, int64_t n, int64_t ff,
                                    const float *d_x, int64_t ldx, int kuse,
                                    const struct moe_cuda_groups *g, int max_active, float *d_act,
                                    int64_t ldact, int tc, void *d_ws, size_t ws_bytes,
                                    int64_t n_tok, cudaStream_t s);

/* Down by expert into dout [slot][E] (rows ldd apart), then h[t] += Σ_j sel_w · dout in the
 * token's top-k order. Same results as moe_cuda_expert_down, bit for bit. With down on tensor
 * cores and d_ws holding moe_cuda_matvec_tc_ws_bytes(ff, n_tok · kuse), the act rows are staged
 * once into it (moe_cuda_tc_stage) instead of per block: the same bits. */
int moe_cuda_expert_down_grouped(uint32_t type, const void *const *d_down, int64_t ff, int64_t E,
                                 const float *d_act, int64_t ldact, const struct moe_cuda_groups *g,
                                 int max_active, int64_t n_tok, int kuse, const float *d_sel_w,
                                 float *d_dout, int64_t ldd, float *d_h, int64_t ldh, int tc,
                                 void *d_ws, size_t ws_bytes, cudaStream_t s);

/* A layer whose experts are not all of one type per matrix (files that repack experts): per
 * matrix a device table of each expert's type and the distinct types. Each type gets a pass that
 * skips the other experts; the results are the per-type kernels' own. */
struct moe_cuda_mixed {
    const void *const *gate, *const *up, *const *down; /* device pointer tables [nexp] */
    const uint8_t *etype[3];                           /* device [nexp]: gate, up, down types */
    uint32_t types[3][16];
    int n_types[3];
    int64_t nexp;
};

int moe_cuda_expert_mixed(const struct moe_cuda_mixed *mx, int64_t n, int64_t ff, int64_t E,
                          const float *d_x, int64_t ldx, int64_t n_tok, int kuse,
                          const int32_t *d_sel_e, const float *d_sel_w,
                          const struct moe_cuda_groups *g, float *d_act, int64_t ldact,
                          float *d_scratch, float *d_dout, int64_t ldd, float *d_h, int64_t ldh,
                          cudaStream_t s);

#endif

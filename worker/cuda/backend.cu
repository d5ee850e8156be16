/* The CUDA backend (see worker/backend.h and docs/cuda.md).
 *
 * Init uploads every weight into one VRAM arena (norm weights as float32, everything else in
 * its stored block format, each tensor and each expert 256-byte aligned), builds per-layer device
 * tables of expert pointers, and allocates the KV cache (f16 unless kv_f32) and the step buffers.
 *
 * A step: begin() copies the step's inputs (tokens, positions, sequences, RoPE angles, logit rows)
 * from pinned staging into device buffers, then either replays a CUDA graph recorded for this step
 * shape (n, n_out), or starts recording one (steps of up to MOE_CUDA_GRAPH_MAX tokens), or, for
 * larger steps, launches directly. The ops enqueue kernels on one stream; none waits for the
 * device. end() launches the graph, copies the logits back and synchronises: the step's only
 * host synchronisation. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

extern "C" {
#include "store/err.h"
#include "store/ggml_type.h"
#include "store/placement.h"
#include "store/quant.h"
#include "store/units.h"
#include "worker/backend.h"
#include "worker/engine.h"
}
#include "worker/cuda/launch.cuh"
#include "worker/cuda/cuda_check.cuh"
#include "worker/cuda/experts.cuh"
#include "worker/cuda/mv_tc.h"
#include "worker/cuda/attn_mma.cuh"
#include "worker/cuda/fused.cuh"
#include "worker/cuda/gemm.h"
#include "worker/cuda/matvec.h"
#include "worker/cuda/ops.cuh"
#include "worker/cuda/env_opts.h"
#include "worker/cuda/host_ranges.h"
#include "worker/cuda/offload.cuh"
#include "worker/cuda/sample.h"

/* Steps of at most this many tokens are recorded as CUDA graphs (decode batches, small prompt
 * chunks); larger ones launch directly. */
#define MOE_CUDA_GRAPH_MAX 64
/* Steps of more tokens than this do not prefetch (their layers choose most experts anyway). */
#define PF_MAX_N 8
#define PF_AHEAD_MAX 3
/* Experts predicted per token beyond the n_expert_used a layer chooses. */
#define PF_EXTRA 0
/* Steps with at least this many slots per expert on average group their slots by expert (each
 * active expert's rows read and decoded once for its slots). Below, each slot reads its
 * expert's rows itself. With the float walk (docs/benchmarks.md) grouping gains 28% at 64
 * decoding sequences (4 slots per expert) and loses at 16 (1 slot per expert); with down on
 * tensor cores, grouping from 1 slot per expert is the fastest at 16 sequences too. Both give the
 * same floats. MOE_CUDA_GROUP_MIN overrides either. */
#define MOE_CUDA_GROUP_MIN 2
#define MOE_CUDA_GROUP_MIN_TC 1
/* With gate/up on tensor cores too and the inputs staged once per step (the default), from 0.15
 * slots per expert (3 sequences of a 128-expert, top-8 model): grouped, 4 sequences measured
 * 643-650 against 584-591 tok/s per slot, 3 sequences 514-516 against 488, 2 sequences 421-422
 * against 428 (H100, docs/benchmarks.md). */
#define MOE_CUDA_GROUP_MIN_TC_GU 0.15
/* Logit rows computed per pass of the output head. */
#define LOGIT_ROWS 64
/* Penalty windows up to this many tokens (penalty_last_n; "whole history" keeps this many). */
#define SAMPLER_HISTORY 1024

enum { MODE_DIRECT, MODE_CAPTURE, MODE_REPLAY };

struct reg_range;

struct cuda_graph {
    int64_t n, n_out;
    bool sample;
    int spread;              /* the sampler's spread passes (moe_cuda_sample_rows) */
    bool stage;              /* recorded with prompt staging */
    bool record;             /* with the copies of each layer's choices (route_record) */
    bool bias;               /* with the logit bias launch (some sampled row has a bias) */
    cudaGraphExec_t exec;
    int n_ev;                /* profiling: the event nodes recorded in it, and their names */
    const char **ev_name;
};

struct cuda_layer {
    const void *w[MOE_W_ROUTER + 1]; /* matrices (Q, K, V, O, ROUTER) in VRAM */
    uint32_t type[MOE_W_ROUTER + 1];
    float *attn_norm, *ffn_norm, *q_norm, *k_norm;
    const void **gate, **up, **down; /* device tables [nexp] */
    uint32_t gate_type, up_type, down_type;
    bool mixed;                      /* experts of several types in one matrix */
    struct moe_cuda_mixed mx;
    /* Expert slots (offload.cuh): slots [0, hot) pinned, the rest the cache; experts without a
     * slot are read from host memory. */
    int32_t slots, hot;
    uint32_t part_off[3];            /* gate, up, down inside a slot */
    uint64_t slot_bytes;
    uint8_t *base;                   /* [slots][slot_bytes] */
    int32_t *plan;                   /* host [nexp]: the expert's first slot or MOE_OFF_HOST */
    const void **host[3];            /* host [nexp]: device addresses of the host copies */
};

/* A tiered store's answered request: the pool slots pinned for it (cuda_backend.pp). */
#define POOL_PINS 4
struct pool_pins {
    uint32_t req;
    int32_t layer, n;
    int32_t *slots;                  /* [nexp] */
};

/* Profiling (MOE_CUDA_PROFILE): time and launches of one op name. */
struct prof_op {
    const char *name;
    double ms;
    long count;
};

/* The step inputs' ints (struct cuda_backend's d_in) for nb tokens, the RoPE table 256 bytes
 * aligned after them. */
#define IN_INTS(nb) ((6 * (size_t)(nb) + 63) & ~(size_t)63)

struct cuda_backend {
    struct moe_backend base;
    const struct moe_model *m;
    struct moe_dims d;
    int dev;
    cudaStream_t st;

    uint8_t *arena;
    size_t arena_size, arena_used;
    struct cuda_layer *layers;
    const void *embd, *output;
    float *out_norm;

    struct moe_cuda_kv kv;
    float *buf[MOE_BUF_COUNT];
    int64_t ld[MOE_BUF_COUNT];
    float *act, *scratch, *part, *xo, *logits;
    int64_t ld_act;
    int32_t *d_in;                   /* [6][nb]: token, pos, seq, out_row, sampler row, prev
                                      * (moe_step.prev, -1 where none); then d_rope (IN_INTS):
                                      * one copy a step uploads both */
    struct moe_cuda_sampler *smp;    /* rows = sequences; created by the first sampler() */
    int32_t *d_tok, *h_tok;          /* [nb] sampled tokens; h_tok [3][nb]: end()'s, then the
                                      * queued steps' (submit) */
    /* Decode ahead (cuda_submit): up to two steps queued, oldest at q_head; each with the event
     * after its tokens' copy (q_sync: it ran at submit, its tokens are there) and its rows. */
    cudaEvent_t q_ev[2];
    bool q_sync[2];
    /* Logit biases (cuda_bias): [n_seq][MOE_BACKEND_MAX_BIAS] tokens and values and [n_seq]
     * counts on the device (allocated by the first bias), the counts mirrored here; bias_step:
     * a row this step samples has one (a launch before the draws adds them). */
    int32_t *d_btok, *d_bn, *h_bn;
    float *d_bval;
    bool bias_step;
    int64_t q_n[2];
    int q_head, q_len;
    /* Routing signatures (d.record_routes): a recording step's choices, [L][n][kuse], each layer's
     * MOE_BUF_SEL_E copied on the device once its expert op has routed, then to the host with
     * the step's results. */
    int32_t *d_route_hist, *h_route_hist;
    bool record;                     /* this step records */
    bool sample;
    int spread;                      /* the sampled rows' moe_cuda_sampler_row_spread, or-ed,
                                      * of the kinds spread_allow lets through */
    int spread_allow;                /* MOE_SAMPLE_SPREAD: the default, all, greedy or 0 */
    float *d_rope;                   /* [nb][hd], inside d_in's allocation */
    unsigned long long *counts;      /* [L][nexp] */
    int32_t *h_in;                   /* pinned staging (h_rope after it, as on the device): one of
                                      * the two in h_in_base, in turn, so that a step's inputs
                                      * are written while the queued one's copy may still wait */
    float *h_rope;
    int32_t *h_in_base;
    int in_par;
    float *h_logits;                 /* pinned [LOGIT_ROWS][V] */

    unsigned *att_done;              /* [nb][H] split counters of the attention */
    struct moe_cuda_groups groups;   /* slots by expert, for steps of several tokens */
    float *dout;                     /* [nb·k][ld_dout] expert outputs before the combine */
    int64_t ld_dout;
    int64_t n, n_out;
    int sms;
    int att_bps_plain, att_bps_rope; /* decode attention blocks an SM: MOE_CUDA_ATT_BPS, or what
                                      * an SM holds of each attention kernel */
    int mode;
    bool capturing, head_chunked, use_graphs, use_gemm, use_flash;
    double group_min;                /* MOE_CUDA_GROUP_MIN, 0: by layer (group_min()) */
    int tc;                          /* expert products on tensor cores (experts.cuh), from
                                        MOE_CUDA_TC at init */
    bool tc_ws1;                     /* MOE_CUDA_TC_WS1=1: one-token dense products on tensor
                                        cores read their input staged by a launch of its own */
    void *tc_ws;                     /* products on tensor cores (unless MOE_CUDA_TC_STAGED=0):
                                      * inputs staged once per launch here (the dense products;
                                      * the expert gate/up and down of steps grouped by expert) */
    size_t tc_ws_bytes;
    bool route_fold;                 /* routing inside gate/up (route_folds); MOE_CUDA_ROUTE_FOLD=0
                                      * keeps its own launch */
    int route_pending;               /* the layer whose routing the expert op does; -1: none */
    bool gu_staged;                  /* (MOE_CUDA_GU_STAGED=0: not) a one-token router launch also
                                      * stages its normalised row for the layer's gate/up on
                                      * tensor cores (router_staged) */
    void *d_xst;                     /* that staged row (moe_cuda_router_staged_bytes) */
    int xst_l;                       /* the layer whose row d_xst holds in this step; -1: none */
    bool norm_fold;                  /* RMSNorm inside the next mat-vec; MOE_CUDA_NORM_FOLD=0: not */
    bool norm_pending;               /* an RMSNorm the next op does (or launches first) */
    bool att_rope;                   /* MOE_CUDA_ATT_ROPE=1: at one token, the q/k-norm + RoPE +
                                      * KV store inside the attention launch */
    bool rope_pending;               /* that op left for the attention of layer pr_l */
    int pr_l;
    bool rope_fold;                  /* q/k-norm + RoPE + KV store inside the q/k/v launch of a
                                      * one-token step (MOE_CUDA_ROPE_FOLD=1; default: its own
                                      * launch) */
    unsigned *rope_cnt;              /* [H + Hkv] head counters of that launch (zero between) */
    bool qkv_pending;                /* a q/k/v product (pq_*) the next op does or launches first */
    int pq_l;
    struct moe_mm pq_mm[3];
    enum moe_buf pq_src;
    bool rope_done;                  /* the last matmul_now did the rope it was given */
    int mixed_mv;                    /* q/k/v of two weight types in one launch (matmul_mixed):
                                      * -1 in steps of more than one token (one-token steps
                                      * launch each type: the first's rows preloaded with the
                                      * RMSNorm on the way, the second's preloaded from the
                                      * stored normalised row); MOE_CUDA_MIXED_MV=1 or 0:
                                      * every step or none */
    /* One-token q/k/v of two weight types launched per type: with qkv_branch (the default;
     * MOE_CUDA_QKV_BRANCH=0 launches them one after the other) the second type's launch (v in
     * Q6_K on half the layers of a Q4_K_M file) runs on a stream of its own beside the first's,
     * from the RMSNorm's source (it normalises on the way and stores its copy of the normalised
     * row in br_norm, which nothing reads), and the step's next op waits for both. The same
     * floats as the serial launches; 30B shape at batch 1 on an H100 +1.0-1.5%
     * (docs/benchmarks.md). */
    bool qkv_branch;
    int qkv_branch_from; /* MOE_CUDA_QKV_BRANCH_FROM=L: layers before L launch them serially */
    int norm_early;      /* MOE_CUDA_NORM_EARLY (launch.cuh) */
    long branch_pdl_edges;           /* how many such edges the captures made */
    bool branch_pdl;                 /* MOE_CUDA_BRANCH_PDL=1: in a captured one-token step the
                                      * branch's launch takes a programmatic edge from the kernel
                                      * it forks after (qkv_branch) */
    cudaStream_t st_b;
    cudaEvent_t ev_bfork, ev_bjoin;
    float *br_norm; /* [E] */
    int pn_l;
    enum moe_wid pn_w;
    enum moe_buf pn_src, pn_dst;
    /* MOE_CUDA_PROFILE=1: an event before every kernel (event nodes in the graphs), time per
     * op name printed at free (a development aid; run it with MOE_CUDA_NO_PDL=1). */
    bool profile, profile_steps;     /* MOE_CUDA_PROFILE=steps: each prompt step printed too */
    /* MOE_CUDA_STEP_TIMES=1: each sampled one-token step's time on the device, from its inputs'
     * copy to its tokens' (events [0]/[1] at alternate steps' starts, [2] at the end), and the
     * time from one such step's start to the next's; summed, printed at the end. */
    bool step_times, st_open, st_prev;
    cudaEvent_t st_ev[3];
    int st_cur;
    long st_n, st_np;
    double st_busy_ms, st_period_ms;
    cudaEvent_t ev[64 * 16];
    const char *ev_name[64 * 16];
    int n_ev;
    struct prof_op prof[32];
    int n_prof;
    double prof_steps;
    struct cuda_graph graphs[2 * MOE_CUDA_GRAPH_MAX];
    int n_graphs;

    uint64_t dev_bytes;
    /* Expert offload (offload.cuh). */
    uint8_t *xarena;                 /* expert slots of every layer */
    size_t xarena_size;
    bool offload;                    /* some expert lives outside VRAM */
    struct moe_cuda_off_layer *d_off;  /* [L] device */
    uint8_t *d_offmem;               /* the arrays the structs point to */
    uint8_t *h_offmem;               /* host mirror of d_offmem (re-pinning) */
    size_t offmem_bytes;
    struct moe_cuda_off_layer *h_off; /* [L] host copy of d_off (device addresses) */
    unsigned long long *d_offstats;  /* [L][MOE_OFF_NSTATS] */
    struct moe_cuda_fill_list *d_fill;
    int fill_blocks;
    /* [L][3][nexp] device: each layer's fill sources (struct moe_cuda_off_layer's fsrc); NULL
     * when the fill kernel makes every copy. With them, a decode step whose expert kernels take
     * one launch per slot leaves a layer's copies to those kernels (each warp copies the rows it
     * is about to read) instead of launching the fill kernel first: MOE_CUDA_FILL_FOLD=0 keeps
     * the fill launch; a paced link (MOE_CUDA_LINK_GBPS) keeps it too. */
    const void **d_fsrc;
    /* Layer-ahead prefetch (decode steps of up to PF_MAX_N tokens): at layer l, a second stream
     * applies layer t's router (t = l + pf_ahead) to layer l's MoE input and places the
     * predicted experts in t's cache slots, and copies them there, while the layers before t
     * compute; layer t waits for its copies before its own resolve. With pf_split (the
     * default; MOE_CUDA_PREFETCH_SPLIT=0 turns it off) the copies run on a third stream, where
     * the fill of t waits only for t's prediction and the fills before it, not for later
     * predictions; without it they follow each prediction on the second stream.
     * ev_fork[l] / ev_read[l] / ev_pred[t] / ev_join[t] order the streams. */
    bool pf;
    bool pf_split;
    cudaStream_t st2, st3;
    cudaEvent_t *ev_fork, *ev_read, *ev_pred, *ev_join; /* [L]; ev_pred NULL without pf_split */
    bool *pf_pending;                /* [L]: a prefetch for this layer joins at its resolve */
    bool resolve_route;              /* offloaded decode layers route in the resolve's launch */
    int pf_read;                     /* a prefetch forked at this layer may still read MOE_BUF_X:
                                      * the next write of it waits for ev_read; -1 none */
    float *pf_rl, *pf_w;             /* [PF_MAX_N][nexp], [PF_MAX_N][pf_k] */
    int32_t *pf_sel;                 /* [PF_MAX_N][pf_k] */
    int pf_k;                        /* experts predicted per token: kuse + MOE_CUDA_PREFETCH_EXTRA */
    float *pf_x;                     /* [PF_MAX_N][E]: the input re-weighted for layer t */
    int pf_ahead;                    /* layers ahead: 3 by default (from 4 layers: at layer l the
                                      * prediction is for l+3, and layer 0 also predicts 1 and
                                      * 2); MOE_CUDA_PREFETCH_AHEAD=1..PF_AHEAD_MAX */
    float *pf_scale[PF_AHEAD_MAX];   /* [a-1]: [L-a][E]: ffn_norm[l+a] / ffn_norm[l] (0 where
                                      * the latter is 0) */
    unsigned long long *pf_counts;   /* [nexp], unread */
    uint8_t *d_pf_fill;              /* [L] fill lists of pf_fill_stride bytes: layer t's
                                      * prefetch copies (one per layer, so that a prediction
                                      * never writes a list a fill still reads) */
    size_t pf_fill_stride;
    int pf_blocks;
    int pf_threads;                  /* threads a prefetch copy block (MOE_CUDA_PREFETCH_THREADS:
                                      * 256, 128 or 64; 256 by default) */
    /* Prompt staging (steps of at least stage_min_n tokens; offload.cuh): two buffers of
     * stage_cap experts after the slots in xarena. At layer l the second stream copies the next
     * offloaded layer's experts without a slot into the other buffer while layer l computes
     * (ev_sfork, ev_sjoin[buffer]); the layer reads them there instead of from host memory. */
    int32_t stage_cap;               /* experts a buffer holds; 0: no staging */
    uint64_t stage_bytes;            /* bytes of one buffer */
    uint8_t *stage[2];
    struct moe_cuda_fill_list *d_stage_fill[2];
    cudaEvent_t ev_sfork, ev_sjoin[2];
    int8_t *stage_buf;               /* [L]: the buffer a layer is staged in this step, -1 none */
    int stage_next;                  /* the buffer the next staging takes */
    bool stage_step;                 /* this step stages */
    int64_t stage_min_n;
    int stage_blocks;
    bool stage_dma;                  /* direct steps stage by the copy engines (MOE_CUDA_STAGE_DMA) */
    /* The link (link_check): the fill path's and the in-place reads' GB/s measured at start;
     * link_gbps > 0 paces the fill path (MOE_CUDA_LINK_GBPS, a simulated slow link). */
    float link_gbps;
    double link_fill_gbps, link_read_gbps;
    bool link_slow;                  /* copies lose to reading in place: cache, prefetch, staging off */
    uint64_t expert_bytes, expert_vram;
    struct reg_range *xregs;         /* host ranges registered for the GPU to read */
    size_t n_xregs;
    uint8_t *xpinned;                /* or, where registration is refused, a pinned copy */
    char xhow[160];
    /* A tiered store (d.expert_src with a pool of slots, docs/offload.md): experts without a
     * VRAM slot have no fixed host address. A layer's resolve asks for its chosen ones through
     * the channel (mapped host memory), and pool_service, a thread of the backend, pins them in
     * the pool (waiting for the daemon to read those not in it) and answers with their device
     * addresses; the layer's pool_done kernel says when the pins may go. */
    const struct moe_expert_src *xsrc;
    struct moe_off_chan *h_chan, *d_chan;
    struct moe_off_hint *h_hint, *d_hint; /* read-ahead hints (the prefetch's predictions) */
    uint32_t *d_chan_seq;            /* [2]: the channel's last request, the hint's last number */
    uint32_t hint_seen;              /* pool_service: the last hint read */
    bool resolve_fast;               /* a resolve whose choices all hit skips the walk
                                      * (MOE_CUDA_RESOLVE_FAST=0: never) */
    unsigned long long *d_gusync;    /* [L][3] or NULL: struct moe_cuda_gu_resolve's sync words;
                                      * set when one-token steps resolve in the gate/up launch
                                      * (MOE_CUDA_RESOLVE_IN_GU=0: a resolve launch) */
    int32_t *d_borrow;               /* [L][nexp] lent experts, then [L] their counts */
    const uint8_t **slot_dev;        /* [n_slots]: device address of each pool slot */
    uint64_t pool_probe_bytes;       /* registered bytes from slot 0 on (the link check) */
    pthread_mutex_t pool_mu;
    pthread_cond_t svc_cv;
    bool pool_mu_ok;
    pthread_t svc;
    bool svc_started;
    bool svc_stop, svc_active;       /* under pool_mu */
    struct pool_pins pp[POOL_PINS];  /* under pool_mu: the pins of answered requests, oldest first */
    int pp_head, pp_n;
    int32_t *pp_ids;                 /* [nexp]: the request being served */
    int pool_rc;                     /* under pool_mu: the first failed request of the step */
    char pool_msg[256];
    uint32_t pool_timeouts;          /* the channel's timeouts already reported */
    int32_t pool_empty;              /* slots left empty at start (their expert not in the pool) */
    const void **tab;                /* init: a layer's expert table before its upload */
    size_t nodes_b1;                 /* kernels in the graph of a 1-token sampling step */
    /* The fused decode step (fused.cuh): one-token steps run every layer in one kernel. */
    bool fused, fused_coop;
    struct moe_fused_args fargs;     /* the step's pointers (fixed for the backend's life) */
    struct moe_fused_layer *d_fused; /* device [L] */
    unsigned *fused_bar;
    int fused_blocks, fused_per_sm;
    size_t fused_smem;
    uint64_t *fused_timing, *h_fused_timing; /* MOE_CUDA_FUSED_TIMING: [L·FUSED_NPH + 1] */
    double fused_ph_ns[FUSED_NPH];
    long fused_steps;
    char fused_why[96];              /* why a one-token step runs op by op ("" when fused) */
    char desc[1024];
    char errmsg[256];
};

static int cu_err(struct cuda_backend *b, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int cu_err(struct cuda_backend *b, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->errmsg, sizeof b->errmsg, fmt, ap);
    va_end(ap);
    return code;
}

/* A CUDA call in an op: on failure the message names the device and the call. */
#define CU(b, call)                                                                         \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess)                                                              \
            return cu_err(b, MOE_EBACKEND, "cuda:%d: %s: %s", (b)->dev, #call,              \
                          cudaGetErrorString(e_));                                          \
    } while (0)

/* A launch helper's result (its own CUDA errors are already printed with file:line). */
#define LAUNCH(b, what, call)                                                               \
    do {                                                                                    \
        int rc_ = (call);                                                                   \
        if (rc_)                                                                            \
            return cu_err(b, rc_ == MOE_EBACKEND ? MOE_EBACKEND : rc_, "cuda:%d: %s: %s",   \
                          (b)->dev, what, moe_strerror(rc_));                               \
    } while (0)

/* An internal step whose error message is already set. */
#define TRY_CU(call)                                                                        \
    do {                                                                                    \
        int rc_ = (call);                                                                   \
        if (rc_)                                                                            \
            return rc_;                                                                     \
    } while (0)

static int cuda_supports(uint32_t type)
{
    return moe_cuda_matvec_supported(type);
}

static size_t align256(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

static int64_t pad4(int64_t x)
{
    return (x + 3) & ~(int64_t)3;
}

/* Arena placement: pass 0 only counts, pass 1 copies. */
static void *place(struct cuda_backend *b, const void *src, size_t bytes, int pass, int *rc)
{
    size_t off = b->arena_used;
    b->arena_used += align256(bytes);
    if (pass == 0 || *rc)
        return NULL;
    void *dst = b->arena + off;
    cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        *rc = cu_err(b, MOE_EBACKEND, "cuda:%d: uploading %zu bytes: %s", b->dev, bytes,
                     cudaGetErrorString(e));
        return NULL;
    }
    return dst;
}

static float *place_norm(struct cuda_backend *b, const struct moe_tensor *t, int64_t n, int pass,
                         int *rc)
{
    if (pass == 0) {
        b->arena_used += align256(sizeof(float) * (size_t)n);
        return NULL;
    }
    float *tmp = (float *)malloc(sizeof(float) * (size_t)n);
    if (!tmp) {
        *rc = -ENOMEM;
        return NULL;
    }
    int d = moe_dequantize(t->type, t->data, tmp, n);
    if (d && !*rc)
        *rc = cu_err(b, d, "cannot dequantize a norm weight");
    float *p = (float *)place(b, tmp, sizeof(float) * (size_t)n, pass, rc);
    free(tmp);
    return p;
}

static const void **place_table(struct cuda_backend *b, const void **host, int pass, int *rc)
{
    return (const void **)place(b, host, sizeof(void *) * (size_t)b->d.nexp, pass, rc);
}

/* An expert's gate (which 0), up (1) or down (2) as its layer's plan says: copied into its slot,
 * or left in host memory (the device address of that copy). */
static const void *expert_upload(struct cuda_backend *b, int l, int which, int x,
                                 const struct moe_tensor *t, int *rc)
{
    struct cuda_layer *cl = &b->layers[l];
    const int32_t at = cl->plan[x];
    if (at == MOE_OFF_HOST)
        return cl->host[which][x];
    uint8_t *dst = cl->base + (size_t)at * cl->slot_bytes + cl->part_off[which];
    if (*rc || b->xsrc)
        return *rc ? NULL : dst; /* a tiered store's slots: pool_fill_slots */
    cudaError_t e = cudaMemcpy(dst, t->data, t->nbytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        *rc = cu_err(b, MOE_EBACKEND, "cuda:%d: uploading blk.%d expert %d: %s", b->dev, l, x,
                     cudaGetErrorString(e));
        return NULL;
    }
    return dst;
}

/* Weights into the arena (both passes walk the same order; experts only in pass 1, into the
 * expert arena or left in host memory). */
static int upload(struct cuda_backend *b, int pass, const void **tab)
{
    const struct moe_model *m = b->m;
    const struct moe_dims *d = &b->d;
    int rc = 0;
    b->arena_used = 0;
    b->embd = place(b, m->token_embd.data, m->token_embd.nbytes, pass, &rc);
    if (m->output.data == m->token_embd.data)
        b->output = b->embd;
    else
        b->output = place(b, m->output.data, m->output.nbytes, pass, &rc);
    b->out_norm = place_norm(b, &m->output_norm, d->E, pass, &rc);
    for (int l = 0; l < (int)d->L && !rc; l++) {
        const struct moe_layer *ly = &m->layers[l];
        struct cuda_layer *cl = &b->layers[l];
        static const enum moe_wid mats[] = {MOE_W_Q, MOE_W_K, MOE_W_V, MOE_W_O, MOE_W_ROUTER};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
            const struct moe_tensor *t = moe_weight(m, l, mats[i]);
            cl->w[mats[i]] = place(b, t->data, t->nbytes, pass, &rc);
            cl->type[mats[i]] = t->type;
        }
        cl->attn_norm = place_norm(b, &ly->attn_norm, d->E, pass, &rc);
        cl->ffn_norm = place_norm(b, &ly->ffn_norm, d->E, pass, &rc);
        cl->q_norm = place_norm(b, &ly->attn_q_norm, d->hd, pass, &rc);
        cl->k_norm = place_norm(b, &ly->attn_k_norm, d->hd, pass, &rc);
        cl->gate_type = ly->experts[0].gate.type;
        cl->up_type = ly->experts[0].up.type;
        cl->down_type = ly->experts[0].down.type;
        cl->mixed = false;
        for (int x = 0; x < (int)d->nexp; x++) {
            const struct moe_expert *ex = &ly->experts[x];
            if (ex->gate.type != cl->gate_type || ex->up.type != cl->up_type ||
                ex->down.type != cl->down_type)
                cl->mixed = true;
        }
        for (int which = 0; which < 3; which++) {
            uint8_t *et = cl->mixed ? (uint8_t *)malloc((size_t)d->nexp) : NULL;
            if (cl->mixed && !et && !rc)
                rc = -ENOMEM;
            int nt = 0;
            for (int x = 0; x < (int)d->nexp; x++) {
                const struct moe_expert *ex = &ly->experts[x];
                const struct moe_tensor *t = which == 0 ? &ex->gate : which == 1 ? &ex->up
                                                                                : &ex->down;
                tab[x] = pass == 0 ? NULL : expert_upload(b, l, which, x, t, &rc);
                if (!et)
                    continue;
                et[x] = (uint8_t)t->type;
                int k = 0;
                while (k < nt && cl->mx.types[which][k] != t->type)
                    k++;
                if (k == nt && nt < 16)
                    cl->mx.types[which][nt++] = t->type;
                else if (k == nt && !rc)
                    rc = cu_err(b, MOE_EUNSUPPORTED, "blk.%d: experts of more than 16 types", l);
            }
            const void **dt = place_table(b, tab, pass, &rc);
            if (which == 0)
                cl->gate = dt;
            else if (which == 1)
                cl->up = dt;
            else
                cl->down = dt;
            if (et) {
                cl->mx.etype[which] = (const uint8_t *)place(b, et, (size_t)d->nexp, pass, &rc);
                cl->mx.n_types[which] = nt;
                free(et);
            }
        }
        if (cl->mixed) {
            cl->mx.gate = cl->gate;
            cl->mx.up = cl->up;
            cl->mx.down = cl->down;
            cl->mx.nexp = d->nexp;
        }
    }
    return rc;
}

/* Host ranges of the weights, page-aligned, registered with CUDA (read-only) for the upload so
 * that the copies run at pinned speed; unregistered after it. A range CUDA refuses (a
 * locked-memory limit, say) is simply copied unpinned. Opt-in (MOE_CUDA_REGISTER=1) until it is
 * measured with a full-size store: plain copies were (17.3 GiB in about 3.6 s of init). The
 * chunks are planned by host_ranges.h. */
static size_t register_ranges(struct reg_range *r, size_t n, unsigned flags,
                              struct reg_range **out, bool *all, double min_gbps);

static void add_range(struct reg_range *r, size_t *n, const struct moe_tensor *t)
{
    if (!t->data || !t->nbytes)
        return;
    const uintptr_t pg = 4096;
    r[*n].a = (uintptr_t)t->data & ~(pg - 1);
    r[*n].b = ((uintptr_t)t->data + t->nbytes + pg - 1) & ~(pg - 1);
    (*n)++;
}

/* Registers the weights' host ranges; returns the registered chunks (to unregister) in *out. */
static size_t register_weights(const struct moe_model *m, const struct moe_dims *d,
                               struct reg_range **out)
{
    *out = NULL;
    size_t cap = 3 + (size_t)d->L * (9 + 3 * (size_t)d->nexp), n = 0;
    struct reg_range *r = (struct reg_range *)malloc(sizeof *r * cap);
    if (!r)
        return 0;
    add_range(r, &n, &m->token_embd);
    add_range(r, &n, &m->output);
    for (int l = 0; l < (int)d->L; l++) {
        const struct moe_layer *ly = &m->layers[l];
        static const enum moe_wid mats[] = {MOE_W_Q, MOE_W_K, MOE_W_V, MOE_W_O, MOE_W_ROUTER};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++)
            add_range(r, &n, moe_weight(m, l, mats[i]));
        for (int x = 0; x < (int)d->nexp; x++) {
            add_range(r, &n, &ly->experts[x].gate);
            add_range(r, &n, &ly->experts[x].up);
            add_range(r, &n, &ly->experts[x].down);
        }
    }
    size_t nc = register_ranges(r, n, cudaHostRegisterReadOnly, out, NULL, 0);
    free(r);
    return nc;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Registers the ranges r[n] (r is reused) with CUDA in chunks of about 1 GiB (the first of 64
 * MiB), none of which cuts a tensor (host_ranges.h); returns the chunks CUDA accepted in *out.
 * *all (if not NULL): whether every chunk was accepted. min_gbps > 0: gives up (*all false) once
 * the registration runs slower than that (pinning file-backed pages can crawl). */
static size_t register_ranges(struct reg_range *r, size_t n, unsigned flags,
                              struct reg_range **out, bool *all, double min_gbps)
{
    const double t0 = now_s();
    double done = 0;
    *out = NULL;
    if (all)
        *all = true;
    const size_t k = moe_reg_plan(r, n, (uintptr_t)64 << 20, (uintptr_t)1 << 30,
                                  (uintptr_t)64 << 20);
    size_t nc = 0;
    struct reg_range *ch = (struct reg_range *)malloc(sizeof *ch * (k ? k : 1));
    if (!ch) {
        if (all)
            *all = false;
        return 0;
    }
    for (size_t i = 0; i < k; i++) {
        if (min_gbps > 0 && done > 0 && done / (now_s() - t0) < min_gbps * 1e9) {
            if (all)
                *all = false;
            break;
        }
        done += (double)(r[i].b - r[i].a);
        if (cudaHostRegister((void *)r[i].a, r[i].b - r[i].a, flags) != cudaSuccess) {
            cudaGetLastError();
            if (all)
                *all = false;
            continue;
        }
        ch[nc++] = r[i];
    }
    *out = ch;
    return nc;
}

static void unregister_weights(struct reg_range *ch, size_t n)
{
    for (size_t i = 0; i < n; i++)
        cudaHostUnregister((void *)ch[i].a);
    free(ch);
}

static const struct moe_tensor *expert_part(const struct moe_expert *ex, int p)
{
    return p == 0 ? &ex->gate : p == 1 ? &ex->up : &ex->down;
}

/* The cache rule of offload_resolve.h with this engine's settings. */
static int64_t cache_slots_for(const struct moe_dims *d, int64_t S, bool profile)
{
    return moe_off_cache_slots(S, d->nexp, d->kuse, d->cache_slots, profile);
}

/* Experts a prompt staging buffer holds when S of nexp experts per layer have a slot
 * (moe_off_stage_auto); MOE_CUDA_STAGE=N sets it (0: no staging). The setting, or -1 for auto. */
static int64_t stage_setting(int64_t nexp)
{
    const long long v = moe_env_int("MOE_CUDA_STAGE", 0, LLONG_MAX, -1);
    return v < 0 ? v : v < nexp ? v : nexp;
}

static int64_t stage_experts(int64_t nexp, int64_t S, uint64_t sum_slot, uint64_t max_slot)
{
    const int64_t fixed = stage_setting(nexp);
    return fixed >= 0 ? fixed : moe_off_stage_auto(nexp, S, sum_slot, max_slot);
}

/* Slots per layer from the budget or the residency, how many of them are pinned (hot), and
 * which experts take them (most-routed first when counts are given). `used`: device bytes in use
 * before the expert slots (context, dense weights, KV cache, buffers). */
static int plan_experts(struct cuda_backend *b, uint64_t used, char *err, size_t errlen)
{
    const struct moe_model *m = b->m;
    const struct moe_dims *d = &b->d;
    const int64_t nexp = d->nexp, kmin = d->kuse < nexp ? d->kuse : nexp;
    uint64_t sum_slot = 0, max_slot = 0;
    b->expert_bytes = 0;
    for (int l = 0; l < (int)d->L; l++) {
        struct cuda_layer *cl = &b->layers[l];
        for (int64_t x = 0; x < nexp; x++)
            for (int p = 0; p < 3; p++)
                b->expert_bytes += expert_part(&m->layers[l].experts[x], p)->nbytes;
        cl->slot_bytes = moe_model_expert_slot(m, (uint32_t)l, cl->part_off);
        sum_slot += cl->slot_bytes;
        max_slot = cl->slot_bytes > max_slot ? cl->slot_bytes : max_slot;
    }
    int64_t S = nexp;
    if (d->expert_residency > 0.0) {
        S = llround(d->expert_residency * (double)nexp);
        S = S < kmin ? kmin : S > nexp ? nexp : S;
    }
    /* With a tiered store every layer keeps at least one expert out of VRAM, so that every
     * layer resolves (a slot whose expert is not in the pool at start stays empty); and no
     * prompt staging (its copies would need the pool's pins of a whole layer ahead). */
    const int64_t smax = b->xsrc && nexp > kmin ? nexp - 1 : nexp;
    S = S > smax ? smax : S;
    int64_t P = b->xsrc ? 0 : stage_experts(nexp, S, sum_slot, max_slot); /* staging buffer, experts */
    if (d->vram_budget) {
        const uint64_t fixed = used + MOE_OFFLOAD_RESERVE;
        const uint64_t avail = d->vram_budget > fixed ? d->vram_budget - fixed : 0;
        if (d->expert_residency <= 0.0) {
            /* Room for the staging buffers too, unless that leaves less than one token's. */
            moe_off_budget_split(nexp, kmin, avail, sum_slot, max_slot,
                                 b->xsrc ? 0 : stage_setting(nexp), &S, &P);
            S = S > smax ? smax : S;
        } else {
            const uint64_t used_slots = (uint64_t)S * sum_slot;
            if (used_slots + 2 * P * max_slot > avail)
                P = used_slots < avail ? (int64_t)((avail - used_slots) / (2 * max_slot)) : 0;
        }
        if (S < kmin || (uint64_t)S * sum_slot > avail)
            return moe_fail(err, errlen, MOE_ERANGE,
                            "cuda:%d: a VRAM budget of %.2f GiB is too small%s: the context, dense "
                            "weights, KV cache and buffers take %.2f GiB and %lld experts per "
                            "layer (one token's) %.2f GiB more; the minimum is %.2f GiB",
                            b->dev, (double)d->vram_budget / (1 << 30),
                            d->expert_residency > 0.0 ? " for that expert residency" : "",
                            (double)fixed / (1 << 30), (long long)kmin,
                            (double)((uint64_t)kmin * sum_slot) / (1 << 30),
                            (double)(fixed + (uint64_t)kmin * sum_slot) / (1 << 30));
    }
    /* Slots per layer: S everywhere; with a profile the same bytes are split over the layers by
     * expected hits per byte (store/placement.c), at least one token's experts in each. */
    int64_t *order = (int64_t *)malloc(sizeof *order * (size_t)nexp);
    int64_t *Sl = (int64_t *)malloc(sizeof *Sl * (size_t)d->L);
    uint64_t *eb = (uint64_t *)malloc(sizeof *eb * (size_t)d->L);
    if (!order || !Sl || !eb) {
        free(order);
        free(Sl);
        free(eb);
        return -ENOMEM;
    }
    for (int l = 0; l < (int)d->L; l++) {
        Sl[l] = S;
        eb[l] = b->layers[l].slot_bytes;
    }
    struct moe_placement pl;
    char perr[128];
    if (S < nexp && d->expert_counts &&
        moe_placement_compute(&pl, (uint32_t)d->L, (uint32_t)nexp, (uint32_t)d->kuse, eb,
                              d->expert_counts, (uint64_t)S * sum_slot, perr, sizeof perr) == 0) {
        for (int l = 0; l < (int)d->L; l++) {
            Sl[l] = pl.n_hot[l] < (uint32_t)kmin ? kmin : (int64_t)pl.n_hot[l];
            Sl[l] = Sl[l] > smax ? smax : Sl[l];
        }
        moe_placement_free(&pl);
    }
    free(eb);
    b->offload = false;
    for (int l = 0; l < (int)d->L; l++)
        b->offload |= Sl[l] < nexp;
    b->xarena_size = 0;
    for (int l = 0; l < (int)d->L; l++) {
        struct cuda_layer *cl = &b->layers[l];
        cl->plan = (int32_t *)malloc(sizeof(int32_t) * (size_t)nexp);
        for (int p = 0; p < 3; p++)
            cl->host[p] = (const void **)calloc((size_t)nexp, sizeof(void *));
        if (!cl->plan || !cl->host[0] || !cl->host[1] || !cl->host[2]) {
            free(order);
            free(Sl);
            return -ENOMEM;
        }
        const int64_t Sx = Sl[l];
        const int64_t cache = Sx < nexp ? cache_slots_for(d, Sx, d->expert_counts != NULL) : 0;
        cl->slots = (int32_t)Sx;
        cl->hot = (int32_t)(Sx - cache);
        /* Most-routed first (stable: equal counts keep expert order). */
        const uint64_t *c = d->expert_counts ? d->expert_counts + (size_t)l * nexp : NULL;
        for (int64_t x = 0; x < nexp; x++)
            order[x] = x;
        if (c)
            for (int64_t i = 1; i < nexp; i++) {
                int64_t v = order[i], j = i;
                while (j > 0 && c[order[j - 1]] < c[v]) {
                    order[j] = order[j - 1];
                    j--;
                }
                order[j] = v;
            }
        for (int64_t i = 0; i < nexp; i++)
            cl->plan[order[i]] = i < Sx ? (int32_t)i : MOE_OFF_HOST;
        b->xarena_size += (size_t)Sx * cl->slot_bytes;
    }
    free(order);
    free(Sl);
    b->expert_vram = b->xarena_size;
    b->stage_cap = b->offload ? (int32_t)P : 0;
    b->stage_bytes = (uint64_t)b->stage_cap * max_slot;
    if (b->stage_cap)
        b->xarena_size += 256 + 2 * b->stage_bytes; /* from a 256-byte boundary */
    return 0;
}


/* A tiered store: the pool's slots registered with CUDA (in chunks cut only between slots) and
 * each slot's device address. The experts have no fixed host address (host[] stays NULL). */
static int map_pool(struct cuda_backend *b, char *err, size_t errlen)
{
    const struct moe_expert_src *x = b->xsrc;
    const size_t n = x->n_slots;
    struct reg_range *r = (struct reg_range *)malloc(sizeof *r * (n ? n : 1));
    b->slot_dev = (const uint8_t **)calloc(n ? n : 1, sizeof *b->slot_dev);
    if (!r || !b->slot_dev) {
        free(r);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        r[i].a = (uintptr_t)x->slots_base + i * x->slot_bytes;
        r[i].b = r[i].a + x->slot_bytes;
    }
    bool all = false;
    b->n_xregs = register_ranges(r, n, cudaHostRegisterMapped | cudaHostRegisterReadOnly |
                                           cudaHostRegisterPortable, &b->xregs, &all, 0);
    free(r);
    if (!all || !n)
        return moe_fail(err, errlen, MOE_EBACKEND, "cuda:%d: cannot register the tiered store's "
                        "%zu expert slots (%.2f GiB) with CUDA for the GPU to read", b->dev, n,
                        (double)n * (double)x->slot_bytes / (1 << 30));
    for (size_t i = 0; i < n; i++) {
        void *dp = NULL;
        if (cudaHostGetDevicePointer(&dp, (void *)(x->slots_base + i * x->slot_bytes), 0) !=
                cudaSuccess ||
            ((uintptr_t)dp & 255))
            return moe_fail(err, errlen, MOE_EBACKEND, "cuda:%d: the tiered store's slot %zu has "
                            "no device address the kernels can use", b->dev, i);
        b->slot_dev[i] = (const uint8_t *)dp;
    }
    /* The chunk holding slot 0 (the lowest address: the plan sorts), for the link probe. */
    b->pool_probe_bytes = (uint64_t)(b->xregs[0].b - b->xregs[0].a);
    snprintf(b->xhow, sizeof b->xhow, "read from the tiered store's pool (%zu slots; missing "
             "experts asked of the daemon)", n);
    return 0;
}

/* Device addresses of the host copies of every expert (with offload any expert may be read from
 * host memory: re-pinning can unpin a hot one, which the cache may then evict): the host memory
 * registered with CUDA where it can be, else a pinned copy. */
static int map_host_experts(struct cuda_backend *b, char *err, size_t errlen)
{
    if (b->xsrc)
        return map_pool(b, err, errlen);
    const struct moe_model *m = b->m;
    const struct moe_dims *d = &b->d;
    size_t n = 0, cap = (size_t)d->L * 3 * (size_t)d->nexp, copy_bytes = 0;
    struct reg_range *r = (struct reg_range *)malloc(sizeof *r * (cap ? cap : 1));
    if (!r)
        return -ENOMEM;
    for (int l = 0; l < (int)d->L; l++)
        for (int64_t x = 0; x < d->nexp; x++)
            for (int p = 0; p < 3; p++) {
                const struct moe_tensor *t = expert_part(&m->layers[l].experts[x], p);
                add_range(r, &n, t);
                copy_bytes += (t->nbytes + 63) & ~(size_t)63;
            }
    bool all = false;
    /* Shared memory (the daemon's store) is registered: the GPU reads the one copy in RAM.
     * Below 2 GB/s a pinned copy is faster to make than the registration. File mappings are
     * copied: registering a file's pages waits for their writeback, which after the file was
     * written can take minutes. MOE_CUDA_HOST_REGISTER=0 copies in every case. */
    const bool try_reg = d->host_register && moe_env_on("MOE_CUDA_HOST_REGISTER");
    const double t_reg = now_s();
    if (try_reg)
        b->n_xregs = register_ranges(r, n, cudaHostRegisterMapped | cudaHostRegisterReadOnly |
                                               cudaHostRegisterPortable, &b->xregs, &all, 2.0);
    const double reg_s = now_s() - t_reg;
    free(r);
    bool ok = all;
    for (int l = 0; l < (int)d->L && ok; l++)
        for (int64_t x = 0; x < d->nexp && ok; x++)
            for (int p = 0; p < 3 && ok; p++) {
                const struct moe_tensor *t = expert_part(&m->layers[l].experts[x], p);
                void *dp = NULL;
                ok = cudaHostGetDevicePointer(&dp, (void *)t->data, 0) == cudaSuccess &&
                     ((uintptr_t)dp & 15) == 0;
                b->layers[l].host[p][x] = dp;
            }
    if (ok) {
        snprintf(b->xhow, sizeof b->xhow, "read from the mapped host store");
        return 0;
    }
    /* Registration refused (a locked-memory limit) or a misaligned tensor: one pinned copy. */
    cudaGetLastError();
    unregister_weights(b->xregs, b->n_xregs);
    b->xregs = NULL;
    b->n_xregs = 0;
    cudaError_t e = cudaHostAlloc((void **)&b->xpinned, copy_bytes ? copy_bytes : 64,
                                  cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess)
        return moe_fail(err, errlen, MOE_EBACKEND,
                        "cuda:%d: cannot map the experts outside VRAM for the GPU (%.2f GiB of "
                        "pinned memory: %s)", b->dev, (double)copy_bytes / (1 << 30),
                        cudaGetErrorString(e));
    uint8_t *base = NULL;
    if ((e = cudaHostGetDevicePointer((void **)&base, b->xpinned, 0)) != cudaSuccess)
        return moe_fail(err, errlen, MOE_EBACKEND, "cuda:%d: cudaHostGetDevicePointer: %s",
                        b->dev, cudaGetErrorString(e));
    size_t off = 0;
    for (int l = 0; l < (int)d->L; l++)
        for (int64_t x = 0; x < d->nexp; x++)
            for (int p = 0; p < 3; p++) {
                const struct moe_tensor *t = expert_part(&m->layers[l].experts[x], p);
                memcpy(b->xpinned + off, t->data, t->nbytes);
                b->layers[l].host[p][x] = base + off;
                off += (t->nbytes + 63) & ~(size_t)63;
            }
    if (!try_reg)
        snprintf(b->xhow, sizeof b->xhow, "read from a pinned copy");
    else
        snprintf(b->xhow, sizeof b->xhow, "read from a pinned copy (registering the store %s)",
                 all ? "gave a misaligned address" : reg_s > 0.5 ? "was too slow" : "was refused");
    return 0;
}

/* Tiered store: expert x of layer l copied into VRAM at dst (its parts at the layer's
 * part_off[]) from the pool slot pinned for the copy. how: MOE_PIN_PRESENT (not in the pool:
 * *got false, nothing copied) or MOE_PIN_WAIT. */
static int pool_copy_expert(struct cuda_backend *b, int l, int32_t x, uint8_t *dst, int how,
                            bool *got)
{
    const struct moe_expert_src *xs = b->xsrc;
    const struct cuda_layer *cl = &b->layers[l];
    int32_t slot = -1;
    char msg[256] = "";
    *got = false;
    pthread_mutex_lock(&b->pool_mu);
    int rc = xs->pin(xs->user, l, &x, 1, how, &slot, msg, sizeof msg);
    if (rc) {
        rc = cu_err(b, rc, "cuda:%d: blk.%d expert %d from the tiered store: %s", b->dev, l, x,
                    msg);
    } else if (slot >= 0) {
        const uint8_t *src = xs->slots_base + (uint64_t)slot * xs->slot_bytes;
        const uint64_t *po = xs->part_off + 3 * (size_t)l;
        cudaError_t e = cudaSuccess;
        for (int p = 0; p < 3 && e == cudaSuccess; p++)
            e = cudaMemcpy(dst + cl->part_off[p], src + po[p],
                           expert_part(&b->m->layers[l].experts[x], p)->nbytes,
                           cudaMemcpyHostToDevice);
        xs->unpin(xs->user, l, &slot, 1);
        if (e != cudaSuccess)
            rc = cu_err(b, MOE_EBACKEND, "cuda:%d: copying blk.%d expert %d from the tiered "
                        "store: %s", b->dev, l, x, cudaGetErrorString(e));
        *got = e == cudaSuccess;
    }
    pthread_mutex_unlock(&b->pool_mu);
    return rc;
}

/* Under pool_mu: the pins of answered requests up to request `done` let go (all: every one;
 * the GPU must be done with them). */
static void pool_release(struct cuda_backend *b, uint32_t done, bool all)
{
    while (b->pp_n > 0) {
        struct pool_pins *p = &b->pp[b->pp_head];
        if (!all && (int32_t)(done - p->req) < 0)
            break;
        b->xsrc->unpin(b->xsrc->user, p->layer, p->slots, p->n);
        b->pp_head = (b->pp_head + 1) % POOL_PINS;
        b->pp_n--;
    }
}

/* Under pool_mu: request r of the channel answered, its experts pinned (waiting for the daemon
 * for those not in the pool) and their device addresses written; a request that fails (the
 * daemon's error, a malformed request) is answered with status 1 and its message kept for the
 * step's end. */
static void pool_serve(struct cuda_backend *b, uint32_t r)
{
    struct moe_off_chan *c = b->h_chan;
    const struct moe_expert_src *xs = b->xsrc;
    const int32_t ne = (int32_t)b->d.nexp, layer = c->layer, n = c->n;
    volatile int32_t *ids = moe_off_chan_ids(c);
    volatile uint64_t *ptr = moe_off_chan_ptr(c, ne);
    char msg[256] = "";
    int rc = 0;
    if (layer < 0 || layer >= (int32_t)b->d.L || n < 1 || n > ne || b->pp_n == POOL_PINS)
        rc = moe_fail(msg, sizeof msg, MOE_EINTERNAL, "a malformed pool request (layer %d, %d "
                      "experts, %d unanswered)", layer, n, b->pp_n);
    for (int32_t i = 0; !rc && i < n; i++) {
        b->pp_ids[i] = ids[i];
        if (b->pp_ids[i] < 0 || b->pp_ids[i] >= ne)
            rc = moe_fail(msg, sizeof msg, MOE_EINTERNAL, "a pool request for expert %d",
                          b->pp_ids[i]);
    }
    struct pool_pins *p = &b->pp[(b->pp_head + b->pp_n) % POOL_PINS];
    if (!rc)
        rc = xs->pin(xs->user, layer, b->pp_ids, n, MOE_PIN_WAIT, p->slots, msg, sizeof msg);
    if (!rc) {
        const uint64_t *po = xs->part_off + 3 * (size_t)layer;
        for (int32_t i = 0; i < n; i++) {
            const int32_t sl = p->slots[i];
            for (int q = 0; q < 3; q++)
                ptr[3 * i + q] = sl >= 0 && (uint32_t)sl < xs->n_slots
                                     ? (uint64_t)(uintptr_t)(b->slot_dev[sl] + po[q])
                                     : 0;
            if (sl < 0 || (uint32_t)sl >= xs->n_slots)
                rc = moe_fail(msg, sizeof msg, MOE_EINTERNAL, "pool slot %d of %u", sl,
                              xs->n_slots);
        }
        if (rc)
            xs->unpin(xs->user, layer, p->slots, n);
    }
    if (!rc) {
        p->req = r;
        p->layer = layer;
        p->n = n;
        b->pp_n++;
    } else if (!b->pool_rc) {
        b->pool_rc = rc;
        snprintf(b->pool_msg, sizeof b->pool_msg, "%s", msg[0] ? msg : moe_strerror(rc));
    }
    c->status = rc ? 1 : 0;
    __sync_synchronize();
    c->ans = r;
}

/* Under pool_mu: the latest read-ahead hint passed to the expert source's prefetch (which asks
 * the daemon to read those not in the pool, never waiting); one that changed while it was read
 * is dropped. */
static void pool_read_ahead(struct cuda_backend *b)
{
    struct moe_off_hint *h = b->h_hint;
    const int32_t ne = (int32_t)b->d.nexp;
    const uint32_t seq = h->seq;
    if (seq == 0)
        return; /* being written (the kernel clears seq first) */
    __sync_synchronize();
    const int32_t layer = h->layer, n = h->n;
    volatile int32_t *ids = (volatile int32_t *)(h + 1);
    int32_t k = 0;
    for (int32_t i = 0; n <= ne && i < n; i++) {
        const int32_t e = ids[i];
        if (e >= 0 && e < ne)
            b->pp_ids[k++] = e;
    }
    __sync_synchronize();
    b->hint_seen = seq;
    if (h->seq != seq || layer < 0 || layer >= (int32_t)b->d.L || !k || !b->xsrc->prefetch)
        return;
    b->xsrc->prefetch(b->xsrc->user, layer, b->pp_ids, k);
}

/* A service thread's look that found nothing new (*idle: such looks in a row): it spins while
 * the device may be waiting for it; a step that never reaches its end (it failed on the host)
 * leaves the thread active, so after a long idle spell it yields, then sleeps between looks. */
static void service_idle(unsigned *idle)
{
    if (++*idle < 1024) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    } else if (*idle < 1024 + 100000) {
        sched_yield();
    } else {
        const struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
}

/* The thread that answers the channel while a step runs (cuda_begin to cuda_end): new requests
 * served, the pins of layers that ran let go. */
static void *pool_service(void *arg)
{
    struct cuda_backend *b = (struct cuda_backend *)arg;
    struct moe_off_chan *c = b->h_chan;
    uint32_t seen = c->req;
    unsigned idle = 0;
    pthread_mutex_lock(&b->pool_mu);
    while (!b->svc_stop) {
        if (!b->svc_active) {
            pthread_cond_wait(&b->svc_cv, &b->pool_mu);
            idle = 0;
            continue;
        }
        const uint32_t r = c->req;
        __sync_synchronize();
        /* done is written before the next request: read after it, it lets the last layer's
         * pins go before the next layer's are taken (at most one layer's pins at a time). */
        if (b->pp_n)
            pool_release(b, c->done, false);
        if (r != seen) {
            seen = r;
            pool_serve(b, r);
            idle = 0;
            continue;
        }
        if (b->h_hint->seq != b->hint_seen) {
            pool_read_ahead(b);
            idle = 0;
            continue;
        }
        pthread_mutex_unlock(&b->pool_mu);
        service_idle(&idle);
        pthread_mutex_lock(&b->pool_mu);
    }
    pthread_mutex_unlock(&b->pool_mu);
    return NULL;
}

/* The channel, its device counters and the service thread (after offload_state). */
static int pool_start(struct cuda_backend *b, char *err, size_t errlen)
{
    const size_t L = (size_t)b->d.L, ne = (size_t)b->d.nexp;
    cudaError_t e = cudaHostAlloc((void **)&b->h_chan, moe_off_chan_bytes((int32_t)ne),
                                  cudaHostAllocMapped | cudaHostAllocPortable);
    if (e == cudaSuccess) {
        memset((void *)b->h_chan, 0, moe_off_chan_bytes((int32_t)ne));
        e = cudaHostGetDevicePointer((void **)&b->d_chan, b->h_chan, 0);
    }
    if (e == cudaSuccess)
        e = cudaHostAlloc((void **)&b->h_hint, moe_off_hint_bytes((int32_t)ne),
                          cudaHostAllocMapped | cudaHostAllocPortable);
    if (e == cudaSuccess) {
        memset((void *)b->h_hint, 0, moe_off_hint_bytes((int32_t)ne));
        e = cudaHostGetDevicePointer((void **)&b->d_hint, b->h_hint, 0);
    }
    if (e == cudaSuccess)
        e = cudaMalloc((void **)&b->d_chan_seq, 2 * sizeof(uint32_t));
    if (e == cudaSuccess)
        e = cudaMemset(b->d_chan_seq, 0, 2 * sizeof(uint32_t));
    if (e == cudaSuccess)
        e = cudaMalloc((void **)&b->d_borrow, sizeof(int32_t) * (L * ne + L));
    if (e == cudaSuccess)
        e = cudaMemset(b->d_borrow, 0, sizeof(int32_t) * (L * ne + L));
    if (e != cudaSuccess)
        return moe_fail(err, errlen, MOE_EBACKEND, "cuda:%d: the tiered store's channel: %s",
                        b->dev, cudaGetErrorString(e));
    b->pp_ids = (int32_t *)malloc(sizeof(int32_t) * ne);
    for (int i = 0; i < POOL_PINS; i++)
        b->pp[i].slots = (int32_t *)malloc(sizeof(int32_t) * ne);
    for (int i = 0; i < POOL_PINS; i++)
        if (!b->pp[i].slots)
            return -ENOMEM;
    if (!b->pp_ids)
        return -ENOMEM;
    const int rc = pthread_create(&b->svc, NULL, pool_service, b);
    if (rc)
        return moe_fail(err, errlen, MOE_EBACKEND, "cuda:%d: the tiered store's thread: %s",
                        b->dev, strerror(rc));
    b->svc_started = true;
    return 0;
}

/* Under pool_mu, with the GPU done with the step: every pin let go, and what failed the step
 * taken (its first failed request into *prc and msg, when msg is given; whether a layer gave
 * up waiting into *timed_out) and cleared, so that it is counted once. */
static void pool_settle(struct cuda_backend *b, int *prc, char *msg, size_t msglen,
                        bool *timed_out)
{
    pool_release(b, 0, true);
    *prc = b->pool_rc;
    if (msg)
        snprintf(msg, msglen, "%s", b->pool_msg);
    b->pool_rc = 0;
    b->pool_msg[0] = 0;
    const uint32_t to = b->h_chan->timeouts;
    *timed_out = to != b->pool_timeouts;
    b->pool_timeouts = to;
}

/* A step starts (cuda_begin): the service answers from now on. */
static void pool_step_begin(struct cuda_backend *b)
{
    if (!b->svc_started)
        return;
    pthread_mutex_lock(&b->pool_mu);
    if (b->svc_active) {
        /* The last step failed on the host before its end: once the GPU is done with it, its
         * pins go and its errors are not this step's. */
        pthread_mutex_unlock(&b->pool_mu);
        cudaStreamSynchronize(b->st);
        pthread_mutex_lock(&b->pool_mu);
        int prc;
        bool timed_out;
        pool_settle(b, &prc, NULL, 0, &timed_out); /* not this step's */
    }
    b->svc_active = true;
    pthread_cond_signal(&b->svc_cv);
    pthread_mutex_unlock(&b->pool_mu);
}

/* The step is over (cuda_end, rc its result): every pin let go (after the stream, if the step
 * failed on its way), and a failed request or one the GPU gave up waiting for fails it. */
static int pool_step_end(struct cuda_backend *b, int rc)
{
    if (!b->svc_started)
        return rc;
    if (rc)
        cudaStreamSynchronize(b->st);
    pthread_mutex_lock(&b->pool_mu);
    int prc;
    char msg[256];
    bool timed_out;
    pool_settle(b, &prc, msg, sizeof msg, &timed_out);
    b->svc_active = false;
    pthread_mutex_unlock(&b->pool_mu);
    if (rc)
        return rc;
    if (prc)
        return cu_err(b, prc, "cuda:%d: %s", b->dev, msg);
    if (timed_out)
        return cu_err(b, -ETIMEDOUT, "cuda:%d: a layer waited %.0f s for experts from the "
                      "tiered store and gave up", b->dev, MOE_OFF_CHAN_WAIT_NS / 1e9);
    return 0;
}

static void pool_stop(struct cuda_backend *b)
{
    if (b->svc_started) {
        pthread_mutex_lock(&b->pool_mu);
        b->svc_stop = true;
        pthread_cond_signal(&b->svc_cv);
        pthread_mutex_unlock(&b->pool_mu);
        pthread_join(b->svc, NULL);
        b->svc_started = false;
        pool_release(b, 0, true);
    }
    if (b->h_chan)
        cudaFreeHost((void *)b->h_chan);
    if (b->h_hint)
        cudaFreeHost((void *)b->h_hint);
    cudaFree(b->d_chan_seq);
    cudaFree(b->d_borrow);
    free(b->pp_ids);
    for (int i = 0; i < POOL_PINS; i++)
        free(b->pp[i].slots);
    free((void *)b->slot_dev);
    if (b->pool_mu_ok) {
        pthread_mutex_destroy(&b->pool_mu);
        pthread_cond_destroy(&b->svc_cv);
        b->pool_mu_ok = false;
    }
}

/* Tiered store, at start: the planned slots filled from the pool. The daemon cannot be asked
 * yet (the worker's connection starts after the engine), so a slot whose expert is not in the
 * pool stays empty: the cache fills it on demand, a re-pinning later pins it. */
static int pool_fill_slots(struct cuda_backend *b)
{
    const int64_t ne = b->d.nexp;
    for (int l = 0; l < (int)b->d.L; l++) {
        struct cuda_layer *cl = &b->layers[l];
        const void **tabs[3] = {cl->gate, cl->up, cl->down};
        for (int32_t x = 0; x < (int32_t)ne; x++) {
            if (cl->plan[x] == MOE_OFF_HOST)
                continue;
            bool got = false;
            int rc = pool_copy_expert(b, l, x, cl->base + (size_t)cl->plan[x] * cl->slot_bytes,
                                      MOE_PIN_PRESENT, &got);
            if (rc)
                return rc;
            if (got)
                continue;
            cl->plan[x] = MOE_OFF_HOST; /* the slot stays empty; the tables say "no address" */
            b->pool_empty++;
            const void *none = NULL;
            for (int p = 0; p < 3; p++)
                CU(b, cudaMemcpy((void *)(tabs[p] + x), &none, sizeof none, cudaMemcpyHostToDevice));
        }
    }
    return 0;
}

/* Measures, before the cache is set up, how fast the two ways of reaching an expert outside
 * VRAM run on this link: copying it into VRAM (the fill path of the cache, the prefetch and the
 * staging) and reading it in place. When copies run at less than half the speed of reads (a
 * link or host path that penalises them; MOE_CUDA_LINK_GBPS simulates one), a copied expert
 * costs more than two reads, which the cache would rarely win back: every slot is pinned and
 * prefetch and staging are off, so the worker runs as fast as with the cache off.
 * MOE_CUDA_LINK_CHECK=0 keeps the cache whatever the measurement. */
static int link_check(struct cuda_backend *b, char *err, size_t errlen)
{
    const char *lg = getenv("MOE_CUDA_LINK_GBPS");
    b->link_gbps = lg && atof(lg) > 0 ? (float)atof(lg) : 0.0f;
    const struct moe_tensor *g0 = &b->m->layers[0].experts[0].gate;
    size_t bytes = (size_t)b->d.nexp * g0->nbytes;
    bytes = bytes < ((size_t)32 << 20) ? bytes : ((size_t)32 << 20);
    /* A tiered store's experts have no fixed address: the pool's first registered chunk. */
    const uint8_t *src = b->xsrc ? b->slot_dev[0] : (const uint8_t *)b->layers[0].host[0][0];
    if (b->xsrc)
        bytes = bytes < b->pool_probe_bytes ? bytes : (size_t)b->pool_probe_bytes;
    if (bytes < MOE_OFF_CHUNK || !src)
        return 0;
    /* Into the staging buffers when they are large enough (not in use yet: no memory beyond
     * the budget's split), else a buffer of its own out of the reserve. */
    uint8_t *dst = NULL;
    const bool own = !(b->stage_cap && 2 * b->stage_bytes >= ((uint64_t)1 << 20));
    if (!own) {
        dst = b->stage[0];
        bytes = bytes < 2 * b->stage_bytes ? bytes : (size_t)(2 * b->stage_bytes);
    } else {
        cudaError_t ce = cudaMalloc((void **)&dst, bytes);
        if (ce != cudaSuccess)
            return moe_fail(err, errlen, MOE_EBACKEND, "cuda:%d: link check: %s", b->dev,
                            cudaGetErrorString(ce));
    }
    /* The best of three of each (another process on the GPU, or the first touch of the
     * mapping, only ever slows one down: a single probe misjudged a small model's link now and
     * then while the GPU tests ran two at a time). */
    int rc = 0;
    b->link_fill_gbps = b->link_read_gbps = 0;
    for (int i = 0; i < 3 && !rc; i++) {
        double f = 0, r = 0;
        rc = moe_cuda_link_probe(src, bytes, dst, 2 * b->sms, b->link_gbps, &f, &r, b->st);
        b->link_fill_gbps = f > b->link_fill_gbps ? f : b->link_fill_gbps;
        b->link_read_gbps = r > b->link_read_gbps ? r : b->link_read_gbps;
    }
    if (own)
        cudaFree(dst);
    if (rc)
        return moe_fail(err, errlen, MOE_EBACKEND, "cuda:%d: link check failed", b->dev);
    const char *lc = getenv("MOE_CUDA_LINK_CHECK");
    /* Over a small model's few experts both kernels take about their launch time: a
     * difference under 50 us is no evidence. */
    const double t_fill = b->link_fill_gbps > 0 ? (double)bytes / (b->link_fill_gbps * 1e9) : 0,
                 t_read = b->link_read_gbps > 0 ? (double)bytes / (b->link_read_gbps * 1e9) : 0;
    b->link_slow = !(lc && !strcmp(lc, "0")) && b->link_fill_gbps < 0.5 * b->link_read_gbps &&
                   t_fill - t_read > 50e-6;
    if (b->link_slow) {
        for (int64_t l = 0; l < b->d.L; l++)
            b->layers[l].hot = b->layers[l].slots;
        b->stage_cap = 0;
    }
    return 0;
}

/* The per-layer device state of the offload (after upload pass 1 filled the tables). */
static int offload_state(struct cuda_backend *b, char *err, size_t errlen)
{
    const int lrc = link_check(b, err, errlen);
    if (lrc)
        return lrc;
    const struct moe_dims *d = &b->d;
    const size_t L = (size_t)d->L, ne = (size_t)d->nexp;
    size_t bytes = 0;
    int32_t max_slots = 0;
    for (size_t l = 0; l < L; l++) {
        const size_t S = (size_t)b->layers[l].slots;
        bytes += align256(sizeof(int32_t) * (ne + S + 1)) + align256(3 * S + 1) +
                 align256(3 * ne * sizeof(void *)) + align256(3 * ne * sizeof(uint32_t));
        max_slots = b->layers[l].slots > max_slots ? b->layers[l].slots : max_slots;
    }
    uint8_t *h = (uint8_t *)calloc(1, bytes);
    struct moe_cuda_off_layer *hl = (struct moe_cuda_off_layer *)calloc(L, sizeof *hl);
#define OFF_TRY(call)                                                                       \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess) {                                                            \
            free(h);                                                                        \
            free(hl);                                                                       \
            return moe_fail(err, errlen, MOE_EBACKEND, "cuda:%d: %s: %s", b->dev, #call,    \
                            cudaGetErrorString(e_));                                        \
        }                                                                                   \
    } while (0)
    if (!h || !hl) {
        free(h);
        free(hl);
        return -ENOMEM;
    }
    OFF_TRY(cudaMalloc((void **)&b->d_offmem, bytes));
    OFF_TRY(cudaMalloc((void **)&b->d_off, sizeof *hl * L));
    OFF_TRY(cudaMalloc((void **)&b->d_offstats, sizeof(unsigned long long) * L * MOE_OFF_NSTATS));
    OFF_TRY(cudaMemset(b->d_offstats, 0, sizeof(unsigned long long) * L * MOE_OFF_NSTATS));
    OFF_TRY(cudaMalloc((void **)&b->d_fill, moe_cuda_fill_list_bytes(max_slots)));
    OFF_TRY(cudaMemset(b->d_fill, 0, moe_cuda_fill_list_bytes(max_slots)));
    if (moe_env_on("MOE_CUDA_FILL_FOLD") && b->link_gbps <= 0) {
        OFF_TRY(cudaMalloc((void **)&b->d_fsrc, sizeof(void *) * 3 * ne * L));
        OFF_TRY(cudaMemset(b->d_fsrc, 0, sizeof(void *) * 3 * ne * L));
    }
    /* With a tiered store the layer-ahead prediction copies nothing (that would need pool pins
     * on the second stream): its experts without a VRAM slot go to the worker as a read-ahead
     * hint (pool_read_ahead). */
    b->pf = !d->no_prefetch && moe_env_on("MOE_CUDA_PREFETCH") && !b->link_slow;
    b->resolve_fast = moe_env_on("MOE_CUDA_RESOLVE_FAST");
    if (b->resolve_fast && moe_env_on("MOE_CUDA_RESOLVE_IN_GU") && !b->xsrc) {
        OFF_TRY(cudaMalloc((void **)&b->d_gusync, sizeof(unsigned long long) * 3 * L));
        OFF_TRY(cudaMemset(b->d_gusync, 0, sizeof(unsigned long long) * 3 * L));
    }
    if (b->pf) {
        /* The copies on a stream of their own (60% residency 0.72x -> 0.77x of resident, 12.7
         * GiB +6.6% on an H200; docs/benchmarks.md); a tiered store's prediction copies
         * nothing. MOE_CUDA_PREFETCH_SPLIT=0: the copies after each prediction on its stream. */
        b->pf_split = moe_env_on("MOE_CUDA_PREFETCH_SPLIT") && !b->xsrc;
        b->ev_fork = (cudaEvent_t *)calloc(L, sizeof(cudaEvent_t));
        b->ev_read = (cudaEvent_t *)calloc(L, sizeof(cudaEvent_t));
        b->ev_join = (cudaEvent_t *)calloc(L, sizeof(cudaEvent_t));
        /* ev_pred only where the copies have their own stream. */
        if (b->pf_split)
            b->ev_pred = (cudaEvent_t *)calloc(L, sizeof(cudaEvent_t));
        b->pf_pending = (bool *)calloc(L, sizeof(bool));
        if (!b->ev_fork || !b->ev_read || !b->ev_join || (b->pf_split && !b->ev_pred) ||
            !b->pf_pending) {
            free(h);
            free(hl);
            return -ENOMEM;
        }
        OFF_TRY(cudaStreamCreateWithFlags(&b->st2, cudaStreamNonBlocking));
        if (b->pf_split)
            OFF_TRY(cudaStreamCreateWithFlags(&b->st3, cudaStreamNonBlocking));
        for (size_t l = 0; l < L; l++) {
            OFF_TRY(cudaEventCreateWithFlags(&b->ev_fork[l], cudaEventDisableTiming));
            OFF_TRY(cudaEventCreateWithFlags(&b->ev_read[l], cudaEventDisableTiming));
            OFF_TRY(cudaEventCreateWithFlags(&b->ev_join[l], cudaEventDisableTiming));
            if (b->ev_pred)
                OFF_TRY(cudaEventCreateWithFlags(&b->ev_pred[l], cudaEventDisableTiming));
        }
        /* MOE_CUDA_PREFETCH_EXTRA=N: N more (or, negative, fewer: only the likeliest) experts
         * predicted per token than the layer chooses; at least one. */
        const int64_t extra = moe_env_int("MOE_CUDA_PREFETCH_EXTRA", -4096, 4096, PF_EXTRA);
        const int64_t want = d->kuse + extra < 1 ? 1 : d->kuse + extra;
        b->pf_k = (int)(want < d->nexp ? want : d->nexp);
        OFF_TRY(cudaMalloc((void **)&b->pf_rl, sizeof(float) * PF_MAX_N * ne));
        OFF_TRY(cudaMalloc((void **)&b->pf_w, sizeof(float) * PF_MAX_N * (size_t)b->pf_k));
        OFF_TRY(cudaMalloc((void **)&b->pf_sel, sizeof(int32_t) * PF_MAX_N * (size_t)b->pf_k));
        OFF_TRY(cudaMalloc((void **)&b->pf_x, sizeof(float) * PF_MAX_N * (size_t)pad4(d->E)));
        /* Three layers ahead by default: the copies get three layers' time to cross the link
         * (with 10 copy blocks on 132 SMs, 60% residency 232.5 -> 241-243 tok/s on an H200
         * against two ahead on 16 blocks; docs/benchmarks.md). */
        const int ahead = (int)moe_env_int("MOE_CUDA_PREFETCH_AHEAD", 1, PF_AHEAD_MAX, 3);
        b->pf_ahead = ahead < (int)L ? ahead : (int)L - 1 > 1 ? (int)L - 1 : 1;
        if (L > 1) {
            const size_t E = (size_t)d->E;
            float *sc = (float *)malloc(sizeof(float) * E * (L - 1)),
                  *w = (float *)malloc(sizeof(float) * E * L);
            int drc = sc && w ? 0 : -ENOMEM;
            for (size_t l = 0; l < L && !drc; l++)
                drc = moe_dequantize(b->m->layers[l].ffn_norm.type, b->m->layers[l].ffn_norm.data,
                                     w + l * E, (int64_t)E);
            cudaError_t ce = cudaSuccess;
            /* ffn_norm[l+a] / ffn_norm[l] for a = 1 .. pf_ahead. */
            for (size_t a = 1; a <= (size_t)b->pf_ahead && !drc && ce == cudaSuccess; a++) {
                for (size_t l = 0; l + a < L; l++)
                    for (size_t i = 0; i < E; i++)
                        sc[l * E + i] =
                            w[l * E + i] != 0.0f ? w[(l + a) * E + i] / w[l * E + i] : 0.0f;
                float **dst = &b->pf_scale[a - 1];
                if ((ce = cudaMalloc((void **)dst, sizeof(float) * E * (L - a))) == cudaSuccess)
                    ce = cudaMemcpy(*dst, sc, sizeof(float) * E * (L - a), cudaMemcpyHostToDevice);
            }
            free(sc);
            free(w);
            if (drc) {
                free(h);
                free(hl);
                return moe_fail(err, errlen, drc, "cuda:%d: prefetch: reading the ffn norms", b->dev);
            }
            OFF_TRY(ce);
        }
        OFF_TRY(cudaMalloc((void **)&b->pf_counts, sizeof(unsigned long long) * ne));
        b->pf_fill_stride = (moe_cuda_fill_list_bytes(max_slots) + 15) & ~(size_t)15;
        OFF_TRY(cudaMalloc((void **)&b->d_pf_fill, b->pf_fill_stride * L));
        OFF_TRY(cudaMemset(b->d_pf_fill, 0, b->pf_fill_stride * L));
        /* A thirteenth of the SMs (10 of 132), at least 8: with the copies on their own stream
         * fewer blocks carry the link's bytes and leave the step more room (16 and 24 measured
         * slower, docs/benchmarks.md). */
        const int pb = (int)moe_env_int("MOE_CUDA_PREFETCH_BLOCKS", 0, 1 << 20, 0);
        b->pf_blocks = pb > 0 ? pb : b->sms / 13 > 8 ? b->sms / 13 : 8;
        /* Thinner copy blocks keep the same bytes in flight with fewer registers: 64 threads
         * take 5120 registers where 256 take 10240, more than the 7168 a multiprocessor has
         * left beside three blocks of the per-token gate/up (the grid of a one-token step fills
         * 2.9 a multiprocessor), so a 256-thread copy block beside it can push one of those into
         * a second wave. Measured slower (docs/benchmarks.md), so opt-in. */
        const int pt = (int)moe_env_int("MOE_CUDA_PREFETCH_THREADS", 64, 256, 256);
        b->pf_threads = pt == 64 || pt == 128 ? pt : 256;
    }
    if (b->stage_cap) {
        b->stage_buf = (int8_t *)malloc(L);
        if (!b->stage_buf) {
            free(h);
            free(hl);
            return -ENOMEM;
        }
        memset(b->stage_buf, -1, L);
        if (!b->st2)
            OFF_TRY(cudaStreamCreateWithFlags(&b->st2, cudaStreamNonBlocking));
        OFF_TRY(cudaEventCreateWithFlags(&b->ev_sfork, cudaEventDisableTiming));
        for (int i = 0; i < 2; i++) {
            OFF_TRY(cudaEventCreateWithFlags(&b->ev_sjoin[i], cudaEventDisableTiming));
            OFF_TRY(cudaMalloc((void **)&b->d_stage_fill[i], moe_cuda_fill_list_bytes(b->stage_cap)));
            OFF_TRY(cudaMemset(b->d_stage_fill[i], 0, moe_cuda_fill_list_bytes(b->stage_cap)));
        }
        /* MOE_CUDA_STAGE_DMA=1: a direct step's staging copies by the copy engines
         * (cudaMemcpyAsync) instead of the fill kernel; not on a paced link. */
        b->stage_dma = moe_env_is1("MOE_CUDA_STAGE_DMA") && b->link_gbps <= 0;
        /* A quarter of the SMs: the copies are bound by the link, and the layer computing
         * meanwhile keeps the rest (docs/benchmarks.md: 33 blocks 1.4x faster prompts than 132
         * or 264 on the H200). */
        const int sb = (int)moe_env_int("MOE_CUDA_STAGE_BLOCKS", 0, 1 << 20, 0);
        b->stage_blocks = sb > 0 ? sb : b->sms / 4 > 8 ? b->sms / 4 : 8;
        /* Steps whose choices cover the experts about twice over (and never a prefetching
         * one); MOE_CUDA_STAGE_MIN_N sets it. */
        const int64_t kk = d->kuse > 0 ? d->kuse : 1;
        const int64_t sn = moe_env_int("MOE_CUDA_STAGE_MIN_N", 0, INT64_MAX, 0);
        b->stage_min_n = sn > 0 ? sn : (2 * (int64_t)ne + kk - 1) / kk;
        if (b->stage_min_n <= PF_MAX_N)
            b->stage_min_n = PF_MAX_N + 1;
    }
    size_t off = 0;
    for (size_t l = 0; l < L; l++) {
        struct cuda_layer *cl = &b->layers[l];
        const size_t S = (size_t)cl->slots;
        struct moe_cuda_off_layer *o = &hl[l];
        o->nexp = (int32_t)ne;
        o->slots = cl->slots;
        o->layer = (int32_t)l;
        memcpy(o->part_off, cl->part_off, sizeof o->part_off);
        o->slot_bytes = cl->slot_bytes;
        o->base = cl->base;
        int32_t *slot_of = (int32_t *)(h + off), *slot_exp = slot_of + ne, *hand = slot_exp + S;
        o->slot_of = (int32_t *)(b->d_offmem + off);
        o->slot_exp = o->slot_of + ne;
        o->hand = o->slot_exp + S;
        off += align256(sizeof(int32_t) * (ne + S + 1));
        uint8_t *pinned = h + off;
        o->pinned = b->d_offmem + off;
        o->ref = o->pinned + S;
        o->pf = o->ref + S; /* zero: no slot holds a prefetched expert yet */
        off += align256(3 * S + 1);
        const void **host = (const void **)(h + off);
        o->host = (const void **)(b->d_offmem + off);
        off += align256(3 * ne * sizeof(void *));
        uint32_t *by = (uint32_t *)(h + off);
        o->bytes = (const uint32_t *)(b->d_offmem + off);
        off += align256(3 * ne * sizeof(uint32_t));
        for (size_t r = 0; r < S; r++)
            slot_exp[r] = -1;
        *hand = cl->hot < cl->slots ? cl->hot : 0;
        for (size_t x = 0; x < ne; x++) {
            slot_of[x] = cl->plan[x];
            if (cl->plan[x] >= 0)
                slot_exp[cl->plan[x]] = (int32_t)x;
            for (int p = 0; p < 3; p++) {
                host[p * ne + x] = cl->host[p][x];
                by[p * ne + x] = (uint32_t)expert_part(&b->m->layers[l].experts[x], p)->nbytes;
            }
        }
        /* The first `hot` slots are pinned, those left empty (a tiered store's expert not in
         * the pool at start) excepted: they are cache. */
        int32_t hot = 0;
        for (size_t r = 0; r < S; r++) {
            pinned[r] = r < (size_t)cl->hot && slot_exp[r] >= 0;
            hot += pinned[r];
        }
        cl->hot = hot;
        if (b->xsrc) {
            o->chan = b->d_chan;
            o->chan_seq = b->d_chan_seq;
            o->hint = b->d_hint;
            o->hint_seq = b->d_chan_seq + 1;
            o->borrow = b->d_borrow + l * ne;
            o->n_borrow = b->d_borrow + L * ne + l;
        }
        o->tab[0] = cl->gate;
        o->tab[1] = cl->up;
        o->tab[2] = cl->down;
        o->fsrc = b->d_fsrc ? b->d_fsrc + l * 3 * ne : NULL;
        o->stats = b->d_offstats + l * MOE_OFF_NSTATS;
    }
    OFF_TRY(cudaMemcpy(b->d_offmem, h, bytes, cudaMemcpyHostToDevice));
    OFF_TRY(cudaMemcpy(b->d_off, hl, sizeof *hl * L, cudaMemcpyHostToDevice));
#undef OFF_TRY
    b->h_offmem = h; /* host mirrors, for re-pinning between steps */
    b->offmem_bytes = bytes;
    b->h_off = hl;
    b->fill_blocks = 2 * b->sms;
    return 0;
}

static void cuda_free(struct moe_backend *bb);

/* MOE_CUDA_VERBOSE=1: init's phases with their times, on stderr. */
static void phase(const char *what)
{
    static double t0 = -1;
    static int on = -1;
    if (on < 0)
        on = getenv("MOE_CUDA_VERBOSE") && strcmp(getenv("MOE_CUDA_VERBOSE"), "0");
    if (!on)
        return;
    const double t = now_s();
    if (t0 < 0)
        t0 = t;
    fprintf(stderr, "cuda init: %8.3f s %s\n", t - t0, what);
}

/* The fused step's per-layer parameters into fl[L]; 1, with b->fused_why saying why, when a
 * layer does not fit the fused kernel. *router_smem: whether every router is float32 with
 * 16-byte rows (read from shared memory). */
static int fused_table(struct cuda_backend *b, struct moe_fused_layer *fl, bool *router_smem)
{
    const struct moe_dims *d = &b->d;
#define NOT_FUSED(...)                                                                      \
    do {                                                                                    \
        snprintf(b->fused_why, sizeof b->fused_why, __VA_ARGS__);                           \
        return 1;                                                                           \
    } while (0)
    *router_smem = true;
    for (int l = 0; l < (int)d->L; l++) {
        const struct cuda_layer *cl = &b->layers[l];
        struct moe_fused_layer *f = &fl[l];
        if (cl->mixed || cl->gate_type != cl->up_type) {
            NOT_FUSED("blk.%d: experts of several types", l);
        }
        if (moe_cuda_expert_tc(b->tc, cl->gate_type) || moe_cuda_expert_tc(b->tc, cl->down_type))
            NOT_FUSED("blk.%d: expert products on tensor cores", l);
        struct {
            enum moe_wid w;
            struct moe_fused_mat *m;
            enum moe_buf y;
        } mats[] = {{MOE_W_Q, &f->qkv[0], MOE_BUF_Q}, {MOE_W_K, &f->qkv[1], MOE_BUF_K},
                    {MOE_W_V, &f->qkv[2], MOE_BUF_V}, {MOE_W_O, &f->o, MOE_BUF_H},
                    {MOE_W_ROUTER, &f->router, MOE_BUF_RL}};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
            const struct moe_tensor *t = moe_weight(b->m, l, mats[i].w);
            struct moe_fused_geom g;
            if (!t || !cl->w[mats[i].w] || !moe_cuda_fused_geom(t->type, t->ne[0], &g)) {
                NOT_FUSED("blk.%d: a %s matrix", l, t ? moe_type_get(t->type)->name : "missing");
            }
            struct moe_fused_mat *m = mats[i].m;
            m->w = (const uint8_t *)cl->w[mats[i].w];
            m->y = b->buf[mats[i].y];
            m->rows = t->ne[1];
            m->items = (t->ne[1] + g.rows_per_item - 1) / g.rows_per_item;
            m->row_bytes = g.row_bytes;
            m->block_bytes = g.block_bytes;
            m->nu = g.nu;
            m->kind = g.kind;
            m->rows_per_item = g.rows_per_item;
        }
        struct moe_fused_geom gu, dn;
        if (!moe_cuda_fused_geom(cl->gate_type, d->E, &gu) ||
            !moe_cuda_fused_geom(cl->down_type, d->ff, &dn)) {
            NOT_FUSED("blk.%d: experts of type %s/%s", l, moe_type_get(cl->gate_type)->name,
                      moe_type_get(cl->down_type)->name);
        }
        *router_smem = *router_smem && f->router.kind == moe_cuda_fused_kind_f32v();
        f->attn_norm = cl->attn_norm;
        f->ffn_norm = cl->ffn_norm;
        f->q_norm = cl->q_norm;
        f->k_norm = cl->k_norm;
        f->gate = (const uint8_t *const *)cl->gate;
        f->up = (const uint8_t *const *)cl->up;
        f->down = (const uint8_t *const *)cl->down;
        f->gu_row_bytes = gu.row_bytes;
        f->gu_block_bytes = gu.block_bytes;
        f->gu_nu = gu.nu;
        f->gu_kind = gu.kind;
        f->down_row_bytes = dn.row_bytes;
        f->down_block_bytes = dn.block_bytes;
        f->down_nu = dn.nu;
        f->down_kind = dn.kind;
        f->counts = b->counts + (size_t)l * d->nexp;
    }
    return 0;
#undef NOT_FUSED
}

/* The fused decode step (fused.cuh), with MOE_CUDA_FUSED=1 (on the H200 it is still slower than
 * the per-op graph: docs/benchmarks.md), when the model and the configuration allow it: every
 * expert in VRAM, an f16 KV cache, head dims up to 128, experts of one type per matrix with gate
 * and up alike, every matrix of a kind the kernel computes. Otherwise one-token steps run op by
 * op and fused_why says why. A captured launch of no layers must run first (a device or driver
 * that refuses the launch keeps the per-op step).
 * MOE_CUDA_FUSED_BPS=1 runs one block per SM (registers for 255 a thread) instead of two;
 * MOE_CUDA_FUSED_PREFETCH=0 drops the L2 prefetches; MOE_CUDA_FUSED_TIMING=1 prints the time of
 * every phase at exit. */
static int fused_setup(struct cuda_backend *b)
{
    const struct moe_dims *d = &b->d;
    const char *env = getenv("MOE_CUDA_FUSED");
#define NOT_FUSED(...)                                                                      \
    do {                                                                                    \
        snprintf(b->fused_why, sizeof b->fused_why, __VA_ARGS__);                           \
        return 0;                                                                           \
    } while (0)
    if (!env || strcmp(env, "1"))
        NOT_FUSED(b->tc & (MOE_CUDA_TC_GATE_UP | MOE_CUDA_TC_DOWN)
                      ? "MOE_CUDA_FUSED=1 with MOE_CUDA_TC=0 fuses it"
                      : "MOE_CUDA_FUSED=1 fuses it");
    if (b->offload)
        NOT_FUSED("experts outside VRAM");
    if (b->tc & MOE_CUDA_TC_DENSE)
        NOT_FUSED("decode mat-vecs on tensor cores");
    if (d->kv_f32)
        NOT_FUSED("f32 KV cache");
    if (d->hd != d->hdv || d->hd > 128 || d->hd % 2 || d->H % d->Hkv)
        NOT_FUSED("head dims %lld/%lld", (long long)d->hd, (long long)d->hdv);
    struct moe_fused_layer *fl =
        (struct moe_fused_layer *)calloc((size_t)d->L, sizeof(struct moe_fused_layer));
    if (!fl)
        return -ENOMEM;
    bool router_smem;
    if (fused_table(b, fl, &router_smem)) {
        free(fl);
        return 0;
    }
    int per_sm = 0;
    size_t smem = 0;
    if (moe_cuda_fused_config(d->E, d->hd, d->nexp, (int)d->kuse, (int)moe_env_int("MOE_CUDA_FUSED_BPS", 1, 2, 2),
                              &per_sm, &smem) ||
        per_sm < 1) {
        free(fl);
        cudaGetLastError();
        NOT_FUSED("the fused kernel does not fit an SM");
    }
    cudaError_t e = cudaMalloc((void **)&b->d_fused, sizeof *fl * (size_t)d->L);
    if (e == cudaSuccess)
        e = cudaMemcpy(b->d_fused, fl, sizeof *fl * (size_t)d->L, cudaMemcpyHostToDevice);
    free(fl);
    if (e == cudaSuccess)
        e = cudaMalloc((void **)&b->fused_bar,
                       sizeof(unsigned) * (MOE_FUSED_BAR_WORDS + MOE_FUSED_SM_SLOTS));
    if (e != cudaSuccess)
        return cu_err(b, MOE_EBACKEND, "cuda:%d: fused step tables: %s", b->dev,
                      cudaGetErrorString(e));
    b->fused_per_sm = per_sm;
    b->fused_blocks = per_sm * b->sms;
    b->fused_smem = smem;
    struct moe_fused_args *a = &b->fargs;
    a->layers = b->d_fused;
    a->L = (int)d->L;
    a->h = b->buf[MOE_BUF_H];
    a->x = b->buf[MOE_BUF_X];
    a->q = b->buf[MOE_BUF_Q];
    a->k = b->buf[MOE_BUF_K];
    a->v = b->buf[MOE_BUF_V];
    a->att = b->buf[MOE_BUF_ATT];
    a->rl = b->buf[MOE_BUF_RL];
    a->sel_w = b->buf[MOE_BUF_SEL_W];
    a->sel_e = (int32_t *)b->buf[MOE_BUF_SEL_E];
    a->act = b->act;
    a->ld_act = b->ld_act;
    a->kv = b->kv;
    a->rope = b->d_rope;
    a->pos = b->d_in + d->n_batch;  /* D_POS, D_SEQ */
    a->seq = b->d_in + 2 * d->n_batch;
    a->part = b->part;
    a->att_done = b->att_done;
    /* As many split groups per head as leave every attention group of the grid one (head,
     * split group) pair: one round. */
    const int64_t z = 2 * (int64_t)b->fused_blocks / d->H;
    a->att_z = z < 1 ? 1 : z > ATT_MAX_SPLITS ? ATT_MAX_SPLITS : (int)z;
    a->el = d->hd <= 32 ? 1 : d->hd <= 64 ? 2 : 4;
    a->E = d->E;
    a->H = d->H;
    a->nexp = d->nexp;
    a->ff = d->ff;
    a->kuse = (int)d->kuse;
    a->eps = d->eps;
    a->att_scale = (float)(1.0 / sqrt((double)d->hd));
    a->norm_topk = d->norm_topk;
    a->router_smem = router_smem;
    a->prefetch = moe_env_on("MOE_CUDA_FUSED_PREFETCH");
    a->bar = b->fused_bar;
    a->sm_slots = MOE_FUSED_SM_SLOTS;
    a->spare_barriers = (int)moe_env_int("MOE_CUDA_FUSED_SPARE", 0, 1 << 20, 0);
    a->timing = NULL;
    /* The probe: a captured launch of no layers, cooperative where the device offers it. */
    int coop = 0;
    cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, b->dev);
    struct moe_fused_args probe = *a;
    probe.L = 0;
    for (int attempt = coop ? 0 : 1; attempt < 2; attempt++) {
        b->fused_coop = attempt == 0;
        cudaGraph_t g = NULL;
        cudaGraphExec_t x = NULL;
        e = cudaStreamBeginCapture(b->st, cudaStreamCaptureModeThreadLocal);
        int lrc = e == cudaSuccess ? moe_cuda_fused_launch(&probe, b->fused_blocks, per_sm, smem,
                                                          b->fused_coop, b->st)
                                   : MOE_EBACKEND;
        cudaError_t ec = cudaStreamEndCapture(b->st, &g);
        if (lrc == 0 && ec == cudaSuccess && g)
            ec = cudaGraphInstantiate(&x, g, 0);
        if (lrc == 0 && ec == cudaSuccess && x)
            ec = cudaGraphLaunch(x, b->st);
        if (lrc == 0 && ec == cudaSuccess)
            ec = cudaStreamSynchronize(b->st);
        if (x)
            cudaGraphExecDestroy(x);
        if (g)
            cudaGraphDestroy(g);
        cudaGetLastError();
        if (lrc == 0 && ec == cudaSuccess) {
            const char *tm = getenv("MOE_CUDA_FUSED_TIMING");
            if (tm && strcmp(tm, "0")) {
                const size_t n = (size_t)d->L * FUSED_NPH + 1;
                if (cudaMalloc((void **)&b->fused_timing, sizeof(uint64_t) * n) == cudaSuccess &&
                    cudaMemset(b->fused_timing, 0, sizeof(uint64_t) * n) == cudaSuccess &&
                    cudaMallocHost((void **)&b->h_fused_timing, sizeof(uint64_t) * n) ==
                        cudaSuccess)
                    a->timing = b->fused_timing;
                cudaGetLastError();
            }
            b->fused = true;
            b->fused_why[0] = 0;
            return 0;
        }
    }
    NOT_FUSED("the fused kernel did not launch");
#undef NOT_FUSED
}

static int cuda_init(struct moe_backend **out, const struct moe_model *m, struct moe_dims *d,
                     char *err, size_t errlen)
{
    struct cuda_backend *b = (struct cuda_backend *)calloc(1, sizeof *b);
    if (!b)
        return -ENOMEM;
    b->base.vt = &moe_backend_cuda;
    b->m = m;
    b->d = *d;
    b->dev = d->device;
    b->use_graphs = getenv("MOE_CUDA_NO_GRAPHS") == NULL;
    b->use_gemm = moe_env_on("MOE_CUDA_GEMM");
    b->use_flash = moe_env_on("MOE_CUDA_FLASH");
    b->profile = getenv("MOE_CUDA_PROFILE") != NULL;
    b->step_times = moe_env_is1("MOE_CUDA_STEP_TIMES");
    b->profile_steps = b->profile && !strcmp(getenv("MOE_CUDA_PROFILE"), "steps");
    b->group_min = getenv("MOE_CUDA_GROUP_MIN") ? atof(getenv("MOE_CUDA_GROUP_MIN")) : 0.0;
    if (!(b->group_min > 0.0)) /* negative, NaN or not a number */
        b->group_min = 0.0;
    b->tc = moe_cuda_expert_tc_env();
    {
        /* Engines of MOE_CUDA_TC_SEQ sequences or more (8 unless set; 0: never) also run the
         * layers' dense decode products on tensor cores unless MOE_CUDA_TC says otherwise: at
         * every batch size of the engine, so that a sequence's floats stay independent of its
         * batch. On an H100: 8 sequences +8.5%, 16 +10%, 64 +24%; 1 and 4 sequences -6% and
         * -3% (docs/benchmarks.md "The layers' decode products on tensor cores"). */
        const char *tcv = getenv("MOE_CUDA_TC");
        const long long min_seq = moe_env_int("MOE_CUDA_TC_SEQ", LLONG_MIN, LLONG_MAX, 8);
        if ((!tcv || !*tcv) && min_seq > 0 && (long long)d->n_seq >= min_seq)
            b->tc |= MOE_CUDA_TC_DENSE;
    }
    b->route_fold = moe_env_on("MOE_CUDA_ROUTE_FOLD");
    b->norm_fold = moe_env_on("MOE_CUDA_NORM_FOLD");
    {
        /* The sampler's passes spread over the GPU, for every row that can take them (greedy,
         * a temperature alone, a top-k of at most 64, top-p without top-k, each with or without
         * penalties: one row at a temperature 32 against 89 us, the defaults 35 against 53,
         * top-p 0.95 alone 160 against 865 on flat logits, H100, docs/benchmarks.md).
         * MOE_SAMPLE_SPREAD=greedy spreads greedy rows only, 0 none (the same draws, for
         * measurements); all is the default. */
        const char *v = getenv("MOE_SAMPLE_SPREAD");
        b->spread_allow = v && !strcmp(v, "greedy") ? MOE_CUDA_SPREAD_GREEDY
                          : v && !strcmp(v, "0")    ? 0
                          : v && !strcmp(v, "all")  ? MOE_CUDA_SPREAD_ALL
                                                    : MOE_CUDA_SPREAD_DEFAULT;
    }
    /* Opt-in: measured 1.5% slower at batch 1 than its own launch (H200, docs/benchmarks.md). */
    b->rope_fold = moe_env_is1("MOE_CUDA_ROPE_FOLD");
    b->att_rope = moe_env_is1("MOE_CUDA_ATT_ROPE");
    const char *mixed_mv = getenv("MOE_CUDA_MIXED_MV");
    b->mixed_mv = mixed_mv && *mixed_mv ? strcmp(mixed_mv, "0") != 0 : -1;
    b->qkv_branch = moe_env_on("MOE_CUDA_QKV_BRANCH");
    b->qkv_branch_from = (int)moe_env_int("MOE_CUDA_QKV_BRANCH_FROM", 0, INT32_MAX, 0);
    b->norm_early = (int)moe_env_int("MOE_CUDA_NORM_EARLY", 0, 2, 0);
    b->branch_pdl = moe_env_is1("MOE_CUDA_BRANCH_PDL");
    b->resolve_route = moe_env_on("MOE_CUDA_RESOLVE_ROUTE");
    b->gu_staged = moe_env_on("MOE_CUDA_GU_STAGED");
    b->xst_l = -1;
    b->route_pending = -1;
    b->pf_read = -1;
    int rc = 0;
    int count = 0;
    cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0) {
        rc = moe_fail(err, errlen, MOE_EBACKEND, "cuda:%d: no usable CUDA device (%s)", b->dev,
                      ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices");
        goto fail;
    }
    if (b->dev >= count) {
        rc = moe_fail(err, errlen, MOE_ERANGE, "cuda:%d: only %d CUDA device(s)", b->dev, count);
        goto fail;
    }
    if (d->expert_src) {
        /* A tiered store (docs/offload.md): a layer's request may take all its experts. */
        b->xsrc = d->expert_src;
        pthread_mutex_init(&b->pool_mu, NULL);
        pthread_cond_init(&b->svc_cv, NULL);
        b->pool_mu_ok = true;
        if (b->xsrc->max_pinned < (int)d->nexp || !b->xsrc->n_slots) {
            rc = moe_fail(err, errlen, MOE_ERANGE, "cuda:%d: a GPU worker needs a tiered store "
                          "whose pool lets it pin one layer's experts at once (%lld); its share "
                          "is %d slots: give --ram-budget at least %lld slots per worker",
                          b->dev, (long long)d->nexp, b->xsrc->max_pinned, (long long)d->nexp);
            goto fail;
        }
    }
    if ((int64_t)d->n_batch * d->kuse > 65535) {
        rc = moe_fail(err, errlen, MOE_ERANGE,
                      "cuda:%d: n_batch %u x %lld experts per token is over the 65535 expert slots "
                      "of a step", b->dev, d->n_batch, (long long)d->kuse);
        goto fail;
    }
    if (d->hd > 512 || d->hdv > 512) {
        rc = moe_fail(err, errlen, MOE_EUNSUPPORTED, "cuda:%d: head dim %lld > 512", b->dev,
                      (long long)d->hd);
        goto fail;
    }
#define INIT_TRY(call)                                                                      \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess) {                                                            \
            rc = moe_fail(err, errlen, MOE_EBACKEND, "cuda:%d: %s: %s", b->dev, #call,      \
                          cudaGetErrorString(e_));                                          \
            goto fail;                                                                      \
        }                                                                                   \
    } while (0)
    {
        INIT_TRY(cudaSetDevice(b->dev));
        INIT_TRY(cudaFree(0));
        cudaDeviceProp prop;
        INIT_TRY(cudaGetDeviceProperties(&prop, b->dev));
        if (b->d.vram_budget == MOE_VRAM_AUTO) {
            /* The device's memory (what every process holds counts, as for any budget) minus a
             * margin for the driver and for others. */
            size_t fr = 0, tot = 0;
            INIT_TRY(cudaMemGetInfo(&fr, &tot));
            const uint64_t margin = (uint64_t)tot / 32 > (512ull << 20) ? (uint64_t)tot / 32
                                                                       : 512ull << 20;
            b->d.vram_budget = (uint64_t)tot > margin ? (uint64_t)tot - margin : 1;
            d->vram_budget = b->d.vram_budget;
        }
        INIT_TRY(cudaStreamCreateWithFlags(&b->st, cudaStreamNonBlocking));

        b->layers = (struct cuda_layer *)calloc((size_t)d->L, sizeof *b->layers);
        const void **tab = (const void **)calloc((size_t)d->nexp, sizeof *tab);
        if (!b->layers || !tab) {
            free(tab);
            rc = -ENOMEM;
            goto fail;
        }
        b->tab = tab;
        upload(b, 0, tab);
        b->arena_size = b->arena_used;
        /* KV cache. */
        b->kv.f32 = d->kv_f32;
        b->kv.wide = moe_env_on("MOE_CUDA_ATT_WIDE");
        b->kv.n_seq = d->n_seq;
        b->kv.n_ctx = d->n_ctx;
        b->kv.Hkv = d->Hkv;
        b->kv.hd = d->hd;
        b->kv.hdv = d->hdv;
        size_t cells = (size_t)d->L * d->n_seq * d->Hkv * d->n_ctx, es = d->kv_f32 ? 4 : 2;
        ce = cudaMalloc(&b->kv.k, cells * (size_t)d->hd * es);
        if (ce == cudaSuccess)
            ce = cudaMalloc(&b->kv.v, cells * (size_t)d->hdv * es);
        if (ce != cudaSuccess) {
            rc = moe_fail(err, errlen, MOE_EBACKEND,
                          "cuda:%d: cannot allocate the KV cache (%u x %u positions, %.2f GiB): %s",
                          b->dev, d->n_seq, d->n_ctx,
                          (double)cells * (double)(d->hd + d->hdv) * (double)es / (1 << 30),
                          cudaGetErrorString(ce));
            goto fail;
        }

        /* Step buffers. */
        const size_t nb = d->n_batch, ns = nb * (size_t)d->kuse;
        for (int i = 0; i < MOE_BUF_COUNT; i++) {
            /* Rows that feed a mat-vec start 16-byte aligned. */
            int64_t w = moe_buf_width(d, (enum moe_buf)i);
            b->ld[i] = i == MOE_BUF_SEL_E || i == MOE_BUF_SEL_W ? w : pad4(w);
            INIT_TRY(cudaMalloc((void **)&b->buf[i], sizeof(float) * nb * (size_t)b->ld[i]));
        }
        b->ld_act = pad4(d->ff);
        INIT_TRY(cudaMalloc((void **)&b->act, sizeof(float) * ns * (size_t)b->ld_act));
        INIT_TRY(cudaMalloc((void **)&b->scratch, 2 * sizeof(float) * ns * (size_t)b->ld_act));
        /* Attention partials for decode-sized steps (the only ones that split). */
        b->sms = prop.multiProcessorCount;
        const int att_bps = (int)moe_env_int("MOE_CUDA_ATT_BPS", 0, 64, 0);
        if (att_bps < 1 || att_bps > 64) {
            /* A step's splits in one wave: as many blocks as the SMs hold at once (8 an SM on
             * an H100 for a head of 128 in f16: 33 splits a head at one token against 17 at 4
             * an SM, the default before, where the groups of splits beyond the 17th ran two
             * splits one after the other; docs/benchmarks.md). */
            const int plain = moe_cuda_attention_blocks_per_sm(&b->kv, false);
            const int rope = moe_cuda_attention_blocks_per_sm(&b->kv, true);
            b->att_bps_plain = plain > 0 ? plain : 4;
            b->att_bps_rope = rope > 0 ? rope : 4;
        } else {
            b->att_bps_plain = b->att_bps_rope = att_bps;
        }
        const int64_t nsplit_tok = nb < MOE_CUDA_GRAPH_MAX ? (int64_t)nb : MOE_CUDA_GRAPH_MAX;
        INIT_TRY(cudaMalloc((void **)&b->part,
                            sizeof(float) * (size_t)moe_cuda_attention_part_floats(
                                                nsplit_tok, d->H, d->hdv)));
        INIT_TRY(cudaMalloc((void **)&b->xo, sizeof(float) * nb * (size_t)pad4(d->E)));
        INIT_TRY(cudaMalloc((void **)&b->att_done, sizeof(unsigned) * nb * (size_t)d->H));
        INIT_TRY(cudaMalloc((void **)&b->groups.ex_off, sizeof(int32_t) * (size_t)(d->nexp + 1)));
        INIT_TRY(cudaMalloc((void **)&b->groups.slot_list, sizeof(int32_t) * ns));
        INIT_TRY(cudaMalloc((void **)&b->groups.act_list, sizeof(int32_t) * (size_t)d->nexp));
        INIT_TRY(cudaMalloc((void **)&b->groups.n_active, sizeof(int32_t)));
        INIT_TRY(cudaMalloc((void **)&b->groups.slot_tok, sizeof(int32_t) * ns));
        INIT_TRY(cudaMalloc((void **)&b->groups.slot_pos, sizeof(int32_t) * ns));
        b->ld_dout = pad4(d->E);
        INIT_TRY(cudaMalloc((void **)&b->dout, sizeof(float) * ns * (size_t)b->ld_dout));
        INIT_TRY(cudaMemset(b->att_done, 0, sizeof(unsigned) * nb * (size_t)d->H));
        INIT_TRY(cudaMalloc((void **)&b->rope_cnt, sizeof(unsigned) * (size_t)(d->H + d->Hkv)));
        INIT_TRY(cudaMemset(b->rope_cnt, 0, sizeof(unsigned) * (size_t)(d->H + d->Hkv)));
        if (b->qkv_branch) {
            INIT_TRY(cudaStreamCreateWithFlags(&b->st_b, cudaStreamNonBlocking));
            INIT_TRY(cudaEventCreateWithFlags(&b->ev_bfork, cudaEventDisableTiming));
            INIT_TRY(cudaEventCreateWithFlags(&b->ev_bjoin, cudaEventDisableTiming));
            INIT_TRY(cudaMalloc((void **)&b->br_norm, sizeof(float) * (size_t)pad4(d->E)));
        }
        int64_t lrows = nb < LOGIT_ROWS ? (int64_t)nb : LOGIT_ROWS;
        INIT_TRY(cudaMalloc((void **)&b->logits, sizeof(float) * (size_t)(lrows * d->V)));
        INIT_TRY(cudaMalloc((void **)&b->d_in,
                            sizeof(int32_t) * IN_INTS(nb) + sizeof(float) * nb * (size_t)d->hd));
        b->d_rope = (float *)(b->d_in + IN_INTS(nb));
        INIT_TRY(cudaMalloc((void **)&b->d_tok, sizeof(int32_t) * nb));
        INIT_TRY(cudaMallocHost((void **)&b->h_tok, sizeof(int32_t) * 3 * nb));
        for (int i = 0; i < 2; i++)
            INIT_TRY(cudaEventCreateWithFlags(&b->q_ev[i], cudaEventDisableTiming));
        if (d->record_routes) {
            INIT_TRY(cudaMalloc((void **)&b->d_route_hist, sizeof(int32_t) * (size_t)d->L * ns));
            INIT_TRY(cudaMallocHost((void **)&b->h_route_hist, sizeof(int32_t) * (size_t)d->L * ns));
        }
        if (b->gu_staged && d->E % 256 == 0)
            INIT_TRY(cudaMalloc(&b->d_xst, moe_cuda_router_staged_bytes(d->E)));
        b->tc_ws1 = moe_env_is1("MOE_CUDA_TC_WS1");
        if ((b->tc & MOE_CUDA_TC_ANY) && moe_env_on("MOE_CUDA_TC_STAGED")) {
            /* Decode steps (up to MOE_CUDA_GRAPH_MAX tokens) and head passes (LOGIT_ROWS
             * rows) of the longest dense input (the experts' input is n_embd wide), and the
             * act rows of a grouped step's down (kuse slots a token, n_ff_exp wide). */
            const int64_t nmax = d->E > d->H * d->hd ? d->E : d->H * d->hd;
            const int64_t rows = MOE_CUDA_GRAPH_MAX > LOGIT_ROWS ? MOE_CUDA_GRAPH_MAX : LOGIT_ROWS;
            const int64_t nr = (int64_t)nb < rows ? (int64_t)nb : rows;
            const int64_t ndec = (int64_t)nb < MOE_CUDA_GRAPH_MAX ? (int64_t)nb : MOE_CUDA_GRAPH_MAX;
            const size_t dense = moe_cuda_matvec_tc_ws_bytes(nmax, nr);
            const size_t down = moe_cuda_matvec_tc_ws_bytes(d->ff, ndec * d->kuse);
            b->tc_ws_bytes = dense > down ? dense : down;
            INIT_TRY(cudaMalloc(&b->tc_ws, b->tc_ws_bytes));
        }
        INIT_TRY(cudaMalloc((void **)&b->counts,
                            sizeof(unsigned long long) * (size_t)(d->L * d->nexp)));
        INIT_TRY(cudaMemset(b->counts, 0, sizeof(unsigned long long) * (size_t)(d->L * d->nexp)));
        INIT_TRY(cudaMallocHost((void **)&b->h_in_base,
                                2 * (sizeof(int32_t) * IN_INTS(nb) + sizeof(float) * nb * (size_t)d->hd)));
        b->h_in = b->h_in_base;
        b->h_rope = (float *)(b->h_in + IN_INTS(nb));
        INIT_TRY(cudaMallocHost((void **)&b->h_logits, sizeof(float) * (size_t)(lrows * d->V)));
        /* The sampler now, so that the expert slots are sized with it in place. */
        if ((rc = moe_cuda_sampler_init(&b->smp, d->n_seq, (uint32_t)d->V, SAMPLER_HISTORY, 0,
                                        err, errlen)))
            goto fail;

        /* Expert slots from what is left of the budget, then the weights. */
        {
            size_t fr0 = 0, tot0 = 0;
            INIT_TRY(cudaDeviceSynchronize());
            INIT_TRY(cudaMemGetInfo(&fr0, &tot0));
            if ((rc = plan_experts(b, (uint64_t)(tot0 - fr0) + b->arena_size, err, errlen)))
                goto fail;
        }
        ce = cudaMalloc((void **)&b->xarena, b->xarena_size ? b->xarena_size : 256);
        if (ce != cudaSuccess) {
            rc = moe_fail(err, errlen, MOE_EBACKEND,
                          "cuda:%d: cannot allocate %.2f GiB for the experts: %s", b->dev,
                          (double)b->xarena_size / (1 << 30), cudaGetErrorString(ce));
            goto fail;
        }
        {
            size_t at = 0;
            for (int l = 0; l < (int)d->L; l++) {
                b->layers[l].base = b->xarena + at;
                at += (size_t)b->layers[l].slots * b->layers[l].slot_bytes;
            }
            if (b->stage_cap) {
                at = (at + 255) & ~(size_t)255;
                b->stage[0] = b->xarena + at;
                b->stage[1] = b->xarena + at + b->stage_bytes;
            }
        }
        phase("expert slots planned");
        if (b->offload && (rc = map_host_experts(b, err, errlen)))
            goto fail;
        phase(b->offload ? b->xhow : "no offload");
        ce = cudaMalloc((void **)&b->arena, b->arena_size);
        if (ce != cudaSuccess) {
            rc = moe_fail(err, errlen, MOE_EBACKEND,
                          "cuda:%d: cannot allocate %.2f GiB for the weights: %s", b->dev,
                          (double)b->arena_size / (1 << 30), cudaGetErrorString(ce));
            goto fail;
        }
        {
            /* Registering the store for the upload (MOE_CUDA_REGISTER=1) would overlap the
             * offload's mapping; with offload the upload copies unregistered. */
            struct reg_range *regs = NULL;
            const char *reg = getenv("MOE_CUDA_REGISTER");
            size_t n_regs = reg && strcmp(reg, "0") && !b->offload ? register_weights(m, d, &regs)
                                                                    : 0;
            rc = upload(b, 1, b->tab);
            unregister_weights(regs, n_regs);
            free(b->tab);
            b->tab = NULL;
            if (rc) {
                moe_fail(err, errlen, rc, "%s", b->errmsg);
                goto fail;
            }
        }
        phase("weights uploaded");
        if (b->xsrc && (rc = pool_fill_slots(b))) {
            moe_fail(err, errlen, rc, "%s", b->errmsg);
            goto fail;
        }
        if (b->pool_empty) {
            const size_t k = strlen(b->xhow);
            snprintf(b->xhow + k, sizeof b->xhow - k, ", %d VRAM slots empty at start",
                     (int)b->pool_empty);
        }
        if (b->xsrc && (rc = pool_start(b, err, errlen)))
            goto fail;
        if (b->offload && (rc = offload_state(b, err, errlen)))
            goto fail;
        if ((rc = fused_setup(b))) {
            moe_fail(err, errlen, rc, "%s", b->errmsg);
            goto fail;
        }
        if (b->profile)
            for (int i = 0; i < (int)(sizeof b->ev / sizeof b->ev[0]); i++)
                INIT_TRY(cudaEventCreate(&b->ev[i]));
        for (int i = 0; b->step_times && i < 3; i++)
            INIT_TRY(cudaEventCreate(&b->st_ev[i]));
        INIT_TRY(cudaDeviceSynchronize());

        size_t fr = 0, tot = 0;
        INIT_TRY(cudaMemGetInfo(&fr, &tot));
        b->dev_bytes = (uint64_t)(tot - fr);
        char name[96];
        snprintf(name, sizeof name, "%.95s", prop.name);
        snprintf(b->desc, sizeof b->desc,
                 "%s, %d SMs, cc %d.%d, %.1f GiB weights, %.1f of %.1f GiB in use, KV %s", name,
                 prop.multiProcessorCount, prop.major, prop.minor,
                 (double)b->arena_size / (1 << 30), (double)(tot - fr) / (1 << 30),
                 (double)tot / (1 << 30), d->kv_f32 ? "f32" : "f16");
        {
            size_t k = strlen(b->desc);
            if (b->fused)
                snprintf(b->desc + k, sizeof b->desc - k, ", fused decode step (%d blocks)",
                         b->fused_blocks);
            else
                snprintf(b->desc + k, sizeof b->desc - k, ", decode op by op (%s)", b->fused_why);
            if (b->tc & MOE_CUDA_TC_ANY) {
                k = strlen(b->desc);
                snprintf(b->desc + k, sizeof b->desc - k,
                         ", Q4_K/Q6_K products on tensor cores:%s%s%s%s%s",
                         b->tc & MOE_CUDA_TC_GATE_UP ? " expert gate/up" : "",
                         b->tc & MOE_CUDA_TC_DOWN ? " expert down" : "",
                         b->tc & MOE_CUDA_TC_DENSE ? " decode mat-vecs"
                         : b->tc & MOE_CUDA_TC_O   ? " attention output"
                                                   : "",
                         b->tc & MOE_CUDA_TC_HEAD ? " head" : "",
                         b->tc_ws ? " (inputs staged once)" : "");
            }
            if (b->d_xst) {
                k = strlen(b->desc);
                snprintf(b->desc + k, sizeof b->desc - k,
                         ", one-token gate/up input staged by the router launch");
            }
#if defined(MOE_Q8_ROWS) && MOE_Q8_ROWS > 0
            k = strlen(b->desc);
            snprintf(b->desc + k, sizeof b->desc - k,
                     ", int8 activations in row walks of %d+ rows (MOE_Q8_ROWS)", MOE_Q8_ROWS);
#endif
        }
        if (b->offload) {
            int32_t smin = INT32_MAX, smax = 0, hot = 0;
            for (int l = 0; l < (int)d->L; l++) {
                smin = b->layers[l].slots < smin ? b->layers[l].slots : smin;
                smax = b->layers[l].slots > smax ? b->layers[l].slots : smax;
                hot += b->layers[l].hot;
            }
            size_t k = strlen(b->desc);
            char range[32];
            if (smin == smax)
                snprintf(range, sizeof range, "%d", smin);
            else
                snprintf(range, sizeof range, "%d..%d", smin, smax);
            char vram[32], all[32], stg[192] = "";
            int sk = 0;
            if (b->stage_cap)
                sk = snprintf(stg, sizeof stg, ", prompts of %lld+ tokens staged (2 x %d experts)",
                              (long long)b->stage_min_n, (int)b->stage_cap);
            if (sk >= 0 && (size_t)sk < sizeof stg)
                snprintf(stg + sk, sizeof stg - (size_t)sk,
                         ", link %.1f GB/s copied, %.1f read in place%s", b->link_fill_gbps,
                         b->link_read_gbps,
                         b->link_slow ? ": copies lose, cache, prefetch and staging off" : "");
            static const char *const ahead[PF_AHEAD_MAX] = {"one layer", "two layers",
                                                             "three layers"};
            char pfd[96] = "";
            if (b->pf && b->xsrc)
                snprintf(pfd, sizeof pfd, ", layer-ahead read-ahead hints");
            else if (b->pf)
                snprintf(pfd, sizeof pfd, ", prefetch %s ahead%s", ahead[b->pf_ahead - 1],
                         b->pf_split ? "" : " (copies after each prediction)");
            snprintf(b->desc + k, sizeof b->desc - k,
                     ", experts %s of %s in VRAM (%s of %lld slots per layer, %d pinned in all), "
                     "the rest %s%s%s",
                     moe_fmt_size(vram, sizeof vram, b->expert_vram),
                     moe_fmt_size(all, sizeof all, b->expert_bytes), range, (long long)d->nexp,
                     hot, b->xhow, pfd, stg);
        }
        if (d->vram_budget && b->dev_bytes > d->vram_budget) {
            rc = moe_fail(err, errlen, MOE_ERANGE,
                          "cuda:%d: %.2f GiB in use after init, over the VRAM budget of %.2f GiB",
                          b->dev, (double)b->dev_bytes / (1 << 30),
                          (double)d->vram_budget / (1 << 30));
            goto fail;
        }
    }
#undef INIT_TRY
    *out = &b->base;
    return 0;

fail:
    cuda_free(&b->base);
    return rc;
}

/* Whatever the prefetch's and staging's streams (second, third) still have queued is done. */
static void side_streams_wait(struct cuda_backend *b)
{
    if (b->st2)
        cudaStreamSynchronize(b->st2);
    if (b->st3)
        cudaStreamSynchronize(b->st3);
    if (b->st_b)
        cudaStreamSynchronize(b->st_b);
}

static void cuda_free(struct moe_backend *bb)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    if (!b)
        return;
    if (b->st)
        cudaStreamSynchronize(b->st);
    side_streams_wait(b);
    pool_stop(b);
    if (b->profile && b->prof_steps > 0) {
        double tot = 0;
        for (int i = 0; i < b->n_prof; i++)
            tot += b->prof[i].ms;
        fprintf(stderr, "cuda profile: %.0f steps, %.3f ms per step\n", b->prof_steps,
                tot / b->prof_steps);
        for (int i = 0; i < b->n_prof; i++)
            fprintf(stderr, "  %-12s %8.3f ms/step %6.1f%% %8.2f us/launch\n", b->prof[i].name,
                    b->prof[i].ms / b->prof_steps, 100 * b->prof[i].ms / tot,
                    1e3 * b->prof[i].ms / (double)b->prof[i].count);
    }
    if (b->profile && b->ev[0])
        for (int i = 0; i < (int)(sizeof b->ev / sizeof b->ev[0]); i++)
            cudaEventDestroy(b->ev[i]);
    if (b->step_times && b->st_n > 0)
        fprintf(stderr,
                "cuda:%d step times: %ld sampled one-token steps, %.1f us each on the device "
                "(inputs' copy to tokens'), %.1f us from one's start to the next's\n",
                b->dev, b->st_n, 1e3 * b->st_busy_ms / (double)b->st_n,
                b->st_np ? 1e3 * b->st_period_ms / (double)b->st_np : 0.0);
    for (int i = 0; b->step_times && i < 3; i++)
        if (b->st_ev[i])
            cudaEventDestroy(b->st_ev[i]);
    if (b->fused_steps > 0) {
        static const char *const ph[FUSED_NPH] = {"norm", "q/k/v", "qk-rope-kv", "attention",
                                                  "o", "ffn norm", "router", "routing", "expert pointers", "gate/up",
                                                  "down", "spare barriers"};
        double tot = 0;
        for (int i = 0; i < FUSED_NPH; i++)
            tot += b->fused_ph_ns[i];
        fprintf(stderr, "cuda fused step: %ld steps, %d blocks, %.1f us per step in the layers\n",
                b->fused_steps, b->fused_blocks, tot / 1e3 / (double)b->fused_steps);
        for (int i = 0; i < FUSED_NPH; i++)
            fprintf(stderr, "  %-14s %8.2f us/layer %5.1f%%\n", ph[i],
                    b->fused_ph_ns[i] / 1e3 / (double)b->fused_steps / (double)b->d.L,
                    tot > 0 ? 100 * b->fused_ph_ns[i] / tot : 0.0);
    }
    cudaFree(b->d_fused);
    cudaFree(b->fused_bar);
    cudaFree(b->fused_timing);
    cudaFreeHost(b->h_fused_timing);
    if (b->capturing) {
        cudaGraph_t g;
        if (cudaStreamEndCapture(b->st, &g) == cudaSuccess)
            cudaGraphDestroy(g);
    }
    for (int i = 0; i < b->n_graphs; i++) {
        cudaGraphExecDestroy(b->graphs[i].exec);
        free(b->graphs[i].ev_name);
    }
    if (b->st)
        cudaStreamSynchronize(b->st);
    cudaFree(b->arena);
    cudaFree(b->xarena);
    cudaFree(b->d_off);
    cudaFree(b->d_offmem);
    free(b->h_offmem);
    free(b->h_off);
    cudaFree(b->d_offstats);
    cudaFree(b->d_fill);
    cudaFree((void *)b->d_fsrc);
    cudaFree(b->d_gusync);
    for (int i = 0; i < 2; i++) {
        cudaFree(b->d_stage_fill[i]);
        if (b->ev_sjoin[i])
            cudaEventDestroy(b->ev_sjoin[i]);
    }
    if (b->ev_sfork)
        cudaEventDestroy(b->ev_sfork);
    free(b->stage_buf);
    for (int64_t l = 0; b->ev_fork && l < b->d.L; l++) {
        if (b->ev_fork[l])
            cudaEventDestroy(b->ev_fork[l]);
        if (b->ev_read[l])
            cudaEventDestroy(b->ev_read[l]);
        if (b->ev_join[l])
            cudaEventDestroy(b->ev_join[l]);
        if (b->ev_pred && b->ev_pred[l])
            cudaEventDestroy(b->ev_pred[l]);
    }
    free(b->ev_fork);
    free(b->ev_read);
    free(b->ev_join);
    free(b->ev_pred);
    free(b->pf_pending);
    cudaFree(b->d_xst);
    if (b->st2)
        cudaStreamDestroy(b->st2);
    if (b->st3)
        cudaStreamDestroy(b->st3);
    cudaFree(b->pf_rl);
    cudaFree(b->pf_w);
    cudaFree(b->pf_sel);
    cudaFree(b->pf_counts);
    cudaFree(b->pf_x);
    for (int a = 0; a < PF_AHEAD_MAX; a++)
        cudaFree(b->pf_scale[a]);
    cudaFree(b->d_pf_fill);
    unregister_weights(b->xregs, b->n_xregs);
    cudaFreeHost(b->xpinned);
    free(b->tab);
    for (int l = 0; b->layers && l < (int)b->d.L; l++) {
        free(b->layers[l].plan);
        for (int p = 0; p < 3; p++)
            free(b->layers[l].host[p]);
    }
    cudaFree(b->kv.k);
    cudaFree(b->kv.v);
    for (int i = 0; i < MOE_BUF_COUNT; i++)
        cudaFree(b->buf[i]);
    cudaFree(b->act);
    cudaFree(b->scratch);
    cudaFree(b->part);
    cudaFree(b->xo);
    cudaFree(b->att_done);
    cudaFree(b->rope_cnt);
    cudaFree(b->br_norm);
    if (b->ev_bfork)
        cudaEventDestroy(b->ev_bfork);
    if (b->ev_bjoin)
        cudaEventDestroy(b->ev_bjoin);
    if (b->st_b)
        cudaStreamDestroy(b->st_b);
    cudaFree(b->groups.ex_off);
    cudaFree(b->groups.slot_list);
    cudaFree(b->groups.act_list);
    cudaFree(b->groups.n_active);
    cudaFree(b->groups.slot_tok);
    cudaFree(b->groups.slot_pos);
    cudaFree(b->dout);
    cudaFree(b->logits);
    cudaFree(b->d_in);
    cudaFree(b->d_tok);
    cudaFreeHost(b->h_tok);
    cudaFree(b->d_route_hist);
    cudaFreeHost(b->h_route_hist);
    moe_cuda_sampler_free(b->smp);
    cudaFree(b->tc_ws);
    cudaFree(b->counts);
    cudaFreeHost(b->h_in_base);
    cudaFree(b->d_btok);
    cudaFree(b->d_bval);
    cudaFree(b->d_bn);
    free(b->h_bn);
    for (int i = 0; i < 2; i++)
        if (b->q_ev[i])
            cudaEventDestroy(b->q_ev[i]);
    cudaFreeHost(b->h_logits);
    if (b->st)
        cudaStreamDestroy(b->st);
    free(b->layers);
    free(b);
}

/* ---------------------------------------------------------------- steps */

static void mark(struct cuda_backend *b, const char *name)
{
    if (!b->profile || b->n_ev >= (int)(sizeof b->ev / sizeof b->ev[0]))
        return;
    /* Captured records must be external to become event nodes the replays record. */
    if (cudaEventRecordWithFlags(b->ev[b->n_ev], b->st,
                                 b->mode == MODE_CAPTURE ? cudaEventRecordExternal
                                                         : cudaEventRecordDefault) != cudaSuccess) {
        (void)cudaGetLastError(); /* the profile misses a mark; the step goes on */
        return;
    }
    b->ev_name[b->n_ev++] = name;
}

/* Adds ms to the op called name in tab (at most 32 ops). */
static void prof_add(struct prof_op *tab, int *n, const char *name, double ms)
{
    int k = 0;
    while (k < *n && strcmp(tab[k].name, name))
        k++;
    if (k == *n && *n < 32)
        tab[(*n)++] = {name, 0, 0};
    if (k < 32) {
        tab[k].ms += ms;
        tab[k].count++;
    }
}

static void prof_collect(struct cuda_backend *b)
{
    if (!b->profile || b->n_ev < 2)
        return;
    cudaEventSynchronize(b->ev[b->n_ev - 1]);
    /* With MOE_CUDA_PROFILE=steps, each prompt-sized step's own breakdown as well. */
    const bool each = b->profile_steps && b->n > MOE_CUDA_GRAPH_MAX;
    struct prof_op st[32];
    int nst = 0;
    double tot = 0;
    for (int i = 0; i + 1 < b->n_ev; i++) {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, b->ev[i], b->ev[i + 1]) != cudaSuccess) {
            (void)cudaGetLastError(); /* not to be mistaken for a kernel's error later */
            ms = 0;
        }
        prof_add(b->prof, &b->n_prof, b->ev_name[i], ms);
        if (each) {
            prof_add(st, &nst, b->ev_name[i], ms);
            tot += ms;
        }
    }
    if (each) {
        fprintf(stderr, "cuda profile: step of %lld tokens, %.3f ms:", (long long)b->n, tot);
        for (int k = 0; k < nst; k++)
            fprintf(stderr, " %s %.3f", st[k].name, st[k].ms);
        fprintf(stderr, "\n");
    }
    b->prof_steps += 1;
    b->n_ev = 0;
}


#define D_TOKEN(b) ((b)->d_in)
#define D_POS(b) ((b)->d_in + (b)->d.n_batch)
#define D_SEQ(b) ((b)->d_in + 2 * (b)->d.n_batch)
#define D_OUTROW(b) ((b)->d_in + 3 * (b)->d.n_batch)
#define D_SMPROW(b) ((b)->d_in + 4 * (b)->d.n_batch)
#define D_PREV(b) ((b)->d_in + 5 * (b)->d.n_batch)

/* Ends a recording left open by a failed step. */
static void abandon_capture(struct cuda_backend *b)
{
    if (!b->capturing)
        return;
    cudaGraph_t g;
    if (cudaStreamEndCapture(b->st, &g) == cudaSuccess)
        cudaGraphDestroy(g);
    cudaGetLastError();
    b->capturing = false;
}

static int cuda_begin(struct moe_backend *bb, const struct moe_step *st)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    abandon_capture(b);
    b->errmsg[0] = 0;
    const size_t nb = b->d.n_batch;
    if (st->n < 1 || st->n > (int64_t)nb || st->n_out < 0 || st->n_out > st->n)
        return cu_err(b, MOE_ERANGE, "step of %lld tokens, %lld outputs", (long long)st->n,
                      (long long)st->n_out);
    if (st->record && !b->d_route_hist)
        return cu_err(b, MOE_ERANGE, "a step records its routing, but record_routes is off");
    b->n = st->n;
    b->n_out = st->n_out;
    b->record = st->record;
    b->head_chunked = false;
    /* Programmatic dependent launch for one-token steps (launch.cuh). */
    moe_pdl_step_on = st->n == 1;
    moe_norm_early_step = b->norm_early;
    pool_step_begin(b);
    b->route_pending = -1;
    b->xst_l = -1;
    b->norm_pending = false;
    b->qkv_pending = false;
    b->rope_pending = false;
    b->pf_read = -1;
    for (int64_t l = 0; b->pf_pending && l < b->d.L; l++)
        b->pf_pending[l] = false;
    /* Layers a failed step staged without reaching them get their tables back, after whatever
     * that step left queued on the second stream (a staging kernel there would write them
     * again). */
    bool open_stage = false;
    for (int64_t l = 0; b->stage_buf && l < b->d.L; l++)
        open_stage |= b->stage_buf[l] >= 0;
    if (open_stage && b->st2)
        CU(b, cudaStreamSynchronize(b->st2));
    for (int64_t l = 0; open_stage && l < b->d.L; l++)
        if (b->stage_buf[l] >= 0) {
            b->stage_buf[l] = -1;
            LAUNCH(b, "prompt staging end",
                   moe_cuda_offload_stage_end(b->d_off + l, (int32_t)b->d.nexp, NULL, 0,
                                              b->stage_cap, b->st));
        }
    /* Prompt-like steps only: at least two tokens per sequence on average. A decode batch (one
     * token of each of its sequences) keeps the cache, whose ring carries experts over from
     * one step to the next. */
    b->stage_step = false;
    if (b->stage_cap > 0 && st->n >= b->stage_min_n) {
        int64_t nseq = 0;
        for (int64_t i = 0; i < st->n; i++) {
            bool seen = false;
            for (int64_t j = 0; j < i && !seen; j++)
                seen = st->seq[j] == st->seq[i];
            nseq += !seen;
            if (2 * nseq > st->n)
                break;
        }
        b->stage_step = 2 * nseq <= st->n;
    }
    b->stage_next = 0;
    /* Inputs: staged in pinned memory, one copy each, in the staging buffer the step before did
     * not use (a queued step's copy may not have run yet; the one before it has). */
    size_t n = (size_t)st->n;
    b->in_par ^= 1;
    b->h_in = b->h_in_base + (size_t)b->in_par * (IN_INTS(nb) + nb * (size_t)b->d.hd);
    b->h_rope = (float *)(b->h_in + IN_INTS(nb));
    if (st->prev && b->q_len == 0)
        return cu_err(b, MOE_ERANGE, "a step takes sampled tokens, but no step is queued");
    if (st->prev)
        memcpy(b->h_in + 5 * nb, st->prev, sizeof(int32_t) * n);
    else
        memset(b->h_in + 5 * nb, 0xff, sizeof(int32_t) * n);
    memcpy(b->h_in, st->token, sizeof(int32_t) * n);
    memcpy(b->h_in + nb, st->pos, sizeof(int32_t) * n);
    memcpy(b->h_in + 2 * nb, st->seq, sizeof(int32_t) * n);
    if (st->n_out)
        memcpy(b->h_in + 3 * nb, st->out_row, sizeof(int32_t) * (size_t)st->n_out);
    b->sample = st->sample;
    b->spread = 0;
    b->bias_step = false;
    if (st->sample) {
        if (!b->smp || st->n_out > (int64_t)b->d.n_seq)
            return cu_err(b, MOE_ERANGE, "sampling without samplers or %lld rows",
                          (long long)st->n_out);
        for (int64_t i = 0; i < st->n_out; i++) {
            b->h_in[4 * nb + i] = st->seq[st->out_row[i]];
            b->bias_step |= b->h_bn && b->h_bn[st->seq[st->out_row[i]]] > 0;
            int m = moe_cuda_sampler_row_spread(b->smp, (uint32_t)b->h_in[4 * nb + i]);
            if ((m & MOE_CUDA_SPREAD_PENALTY) && !(b->spread_allow & MOE_CUDA_SPREAD_PENALTY))
                m = 0; /* its penalties are applied in the one-block pass: no spread pass */
            b->spread |= m & b->spread_allow;
        }
    }
    memcpy(b->h_rope, st->rope, sizeof(float) * n * (size_t)b->d.hd);
    b->n_ev = 0;
    b->st_open = b->step_times && st->n == 1 && st->sample;
    if (b->st_open)
        CU(b, cudaEventRecord(b->st_ev[b->st_cur], b->st));
    else
        b->st_prev = false;
    mark(b, "inputs");
    CU(b, cudaMemcpyAsync(b->d_in, b->h_in,
                          sizeof(int32_t) * IN_INTS(nb) + sizeof(float) * n * (size_t)b->d.hd,
                          cudaMemcpyHostToDevice, b->st));
    b->mode = MODE_DIRECT;
    if (b->use_graphs && st->n <= MOE_CUDA_GRAPH_MAX && st->n_out <= LOGIT_ROWS) {
        for (int i = 0; i < b->n_graphs; i++)
            if (b->graphs[i].n == st->n && b->graphs[i].n_out == st->n_out &&
                b->graphs[i].sample == st->sample && b->graphs[i].spread == b->spread &&
                b->graphs[i].stage == b->stage_step && b->graphs[i].record == st->record &&
                b->graphs[i].bias == b->bias_step) {
                b->mode = MODE_REPLAY;
                return 0;
            }
        if (b->n_graphs < (int)(sizeof b->graphs / sizeof b->graphs[0])) {
            CU(b, cudaStreamBeginCapture(b->st, cudaStreamCaptureModeThreadLocal));
            b->capturing = true;
            b->mode = MODE_CAPTURE;
        }
    }
    if (b->mode == MODE_DIRECT && b->stage_step && b->stage_dma) {
        /* Staging by the copy engines reads the layers' slots on the host: their state now
         * (a staging step changes none of it). */
        CU(b, cudaMemcpyAsync(b->h_offmem, b->d_offmem, b->offmem_bytes, cudaMemcpyDeviceToHost,
                              b->st));
        CU(b, cudaStreamSynchronize(b->st));
    }
    return 0;
}

#define SKIP_IF_REPLAY(b)                                                                   \
    do {                                                                                    \
        if ((b)->mode == MODE_REPLAY)                                                       \
            return 0;                                                                       \
        mark(b, __func__ + 5);                                                              \
    } while (0)

static int flush_pending(struct cuda_backend *b);

static int cuda_embed(struct moe_backend *bb, enum moe_buf dst)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    SKIP_IF_REPLAY(b);
    TRY_CU(flush_pending(b));
    LAUNCH(b, "embed", moe_cuda_embed(b->m->token_embd.type, b->embd, b->d.E, D_TOKEN(b),
                                      D_PREV(b), b->d_tok, b->d.V, b->n, b->buf[dst], b->ld[dst],
                                      b->st));
    return 0;
}

static const float *norm_weight(struct cuda_backend *b, int l, enum moe_wid w)
{
    if (l < 0)
        return w == MOE_W_OUT_NORM ? b->out_norm : NULL;
    if (l >= (int)b->d.L)
        return NULL;
    return w == MOE_W_ATTN_NORM ? b->layers[l].attn_norm
           : w == MOE_W_FFN_NORM ? b->layers[l].ffn_norm
                                 : NULL;
}

/* Before a kernel writes buffer dst: a prefetch still reading MOE_BUF_X (forked at pf_read)
 * is waited for. Only then, not before the layer's own expert kernels, which leave it alone. */
static int before_write(struct cuda_backend *b, enum moe_buf dst)
{
    if (dst != MOE_BUF_X || b->pf_read < 0)
        return 0;
    CU(b, cudaStreamWaitEvent(b->st, b->ev_read[b->pf_read], 0));
    b->pf_read = -1;
    return 0;
}

static int launch_rmsnorm(struct cuda_backend *b, int l, enum moe_wid w, enum moe_buf src,
                          enum moe_buf dst)
{
    TRY_CU(before_write(b, dst));
    LAUNCH(b, "rmsnorm", moe_cuda_rmsnorm(b->buf[src], b->ld[src], NULL, norm_weight(b, l, w),
                                          b->d.E, b->d.eps, b->n, b->buf[dst], b->ld[dst],
                                          b->st));
    return 0;
}

static int launch_route(struct cuda_backend *b, int l);

/* The RMSNorm left pending by cuda_rmsnorm, launched now. */
static int flush_norm(struct cuda_backend *b)
{
    if (!b->norm_pending)
        return 0;
    b->norm_pending = false;
    return b->mode == MODE_REPLAY ? 0 : launch_rmsnorm(b, b->pn_l, b->pn_w, b->pn_src, b->pn_dst);
}

/* A routing left to the expert op (route_pending) done now by its own kernel: something other
 * than that op is about to read or replace the choices. */
static int route_now(struct cuda_backend *b)
{
    const int l = b->route_pending;
    b->route_pending = -1;
    return l >= 0 && b->mode != MODE_REPLAY ? launch_route(b, l) : 0;
}

static int matmul_now(struct cuda_backend *b, int l, const struct moe_mm *mm, int n_mm,
                      enum moe_buf src, bool accumulate, const struct moe_mv_rope *rope);

/* The q/k/v product left pending by cuda_matmul, launched now without the q/k-norm and RoPE. */
static int flush_qkv(struct cuda_backend *b)
{
    if (!b->qkv_pending)
        return 0;
    b->qkv_pending = false;
    return b->mode == MODE_REPLAY ? 0 : matmul_now(b, b->pq_l, b->pq_mm, 3, b->pq_src, false, NULL);
}

static int launch_qk_rope_kv(struct cuda_backend *b, int l)
{
    const struct cuda_layer *cl = &b->layers[l];
    LAUNCH(b, "qk_rope_kv",
           moe_cuda_qk_rope_kv(b->buf[MOE_BUF_Q], b->ld[MOE_BUF_Q], b->buf[MOE_BUF_K],
                               b->ld[MOE_BUF_K], b->buf[MOE_BUF_V], b->ld[MOE_BUF_V], cl->q_norm,
                               cl->k_norm, b->d_rope, D_POS(b), D_SEQ(b), &b->kv, l, b->d.H,
                               b->d.eps, b->n, b->st));
    return 0;
}

static int flush_rope(struct cuda_backend *b)
{
    if (!b->rope_pending)
        return 0;
    b->rope_pending = false;
    return b->mode == MODE_REPLAY ? 0 : launch_qk_rope_kv(b, b->pr_l);
}

/* Whatever an op left for the next one, launched before an op that does not take it over. */
static int flush_pending(struct cuda_backend *b)
{
    int rc = flush_qkv(b);
    if (!rc)
        rc = flush_norm(b);
    if (!rc)
        rc = flush_rope(b);
    return rc ? rc : route_now(b);
}

static int cuda_rmsnorm(struct moe_backend *bb, int l, enum moe_wid w, enum moe_buf src,
                        enum moe_buf dst)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    SKIP_IF_REPLAY(b);
    TRY_CU(flush_pending(b));
    const float *nw = norm_weight(b, l, w);
    if (!nw || moe_buf_width(&b->d, src) != b->d.E || moe_buf_width(&b->d, dst) != b->d.E)
        return cu_err(b, MOE_ERANGE, "rmsnorm: bad weight %d or buffers", (int)w);
    if (b->norm_fold && b->n == 1 && src != dst) {
        /* Left to the next op: a mat-vec reading dst applies it on the way (cuda_matmul);
         * anything else launches it first (flush_pending). */
        b->norm_pending = true;
        b->pn_l = l;
        b->pn_w = w;
        b->pn_src = src;
        b->pn_dst = dst;
        return 0;
    }
    return launch_rmsnorm(b, l, w, src, dst);
}

/* Steps longer than a graph-recorded one (prompt chunks) multiply on tensor cores: the weights
 * decoded to f16 tiles, the activations rounded to f16, sums in float32 (worker/cuda/gemm.h);
 * float32 weights (routers, F32 files) keep the float mat-vecs, whose precision f16 tiles would
 * lose. MOE_CUDA_GEMM=0 keeps prompts on the mat-vecs too. Decode steps always use the
 * mat-vecs. */
static bool use_gemm(const struct cuda_backend *b, uint32_t type)
{
    return b->use_gemm && b->n > MOE_CUDA_GRAPH_MAX && type != MOE_TYPE_F32 &&
           moe_cuda_gemm_supported(type);
}

/* Whether a dense matrix (its type, row length n, VRAM copy w) can go to the tensor-core
 * mat-vec: a type it takes, rows of whole 256-blocks, 16-byte aligned. */
static bool tc_matrix(uint32_t type, int64_t n, const void *w)
{
    return moe_cuda_matvec_tc_supported(type) && n % 256 == 0 && w && ((uintptr_t)w & 15) == 0;
}

/* Whether the decode products of layer l listed in mm run on tensor cores: the layers' dense
 * products under MOE_CUDA_TC_DENSE, the attention output alone under MOE_CUDA_TC_O; every weight
 * a tc_matrix, in a step that is not a prompt's (those take the GEMM). */
static bool tc_dense(const struct cuda_backend *b, int l, const struct moe_mm *mm, int n_mm)
{
    const bool o = n_mm == 1 && mm[0].w == MOE_W_O;
    if (!((b->tc & MOE_CUDA_TC_DENSE) || (o && (b->tc & MOE_CUDA_TC_O))) ||
        b->n > MOE_CUDA_GRAPH_MAX)
        return false;
    for (int i = 0; i < n_mm; i++) {
        const struct moe_tensor *W = moe_weight(b->m, l, mm[i].w);
        if (!W || mm[i].w > MOE_W_ROUTER || use_gemm(b, W->type) ||
            !tc_matrix(W->type, W->ne[0], b->layers[l].w[mm[i].w]))
            return false;
    }
    return true;
}

/* Whether product m of layer l (weight W) fits the op: a dense weight of the layer, uploaded,
 * from src's width to its destination's. */
static bool mm_fits(const struct cuda_backend *b, int l, const struct moe_mm *m, enum moe_buf src,
                    const struct moe_tensor *W)
{
    return W && m->w <= MOE_W_ROUTER && b->layers[l].w[m->w] &&
           W->ne[0] == moe_buf_width(&b->d, src) && W->ne[1] == moe_buf_width(&b->d, m->dst);
}

static struct moe_mv_job mm_job(const struct cuda_backend *b, int l, const struct moe_mm *m,
                                const struct moe_tensor *W)
{
    return (struct moe_mv_job){b->layers[l].w[m->w], W->ne[1], b->buf[m->dst], b->ld[m->dst]};
}

/* cuda_matmul's products of two weight types in one launch (fold: with the pending RMSNorm):
 * 0 when done, 1 when the products are not of exactly two types with a kernel for the pair
 * (nothing launched), < 0 on an error. */
static int matmul_mixed(struct cuda_backend *b, int l, const struct moe_mm *mm, int n_mm,
                        enum moe_buf src, bool accumulate, bool fold,
                        const struct moe_mv_rope *rope)
{
    const struct moe_tensor *W[3];
    uint32_t t1 = 0, t2 = 0;
    for (int j = 0; j < n_mm; j++) {
        W[j] = moe_weight(b->m, l, mm[j].w);
        if (!mm_fits(b, l, &mm[j], src, W[j]))
            return 1; /* the per-type path reports it */
        if (j == 0)
            t1 = W[j]->type;
        else if (W[j]->type != t1 && t2 == 0)
            t2 = W[j]->type;
        else if (W[j]->type != t1 && W[j]->type != t2)
            return 1;
    }
    if (t2 == 0)
        return 1;
    if (!moe_cuda_matvec_mixed_supported(t1, t2)) {
        const uint32_t t = t1;
        t1 = t2, t2 = t;
        if (!moe_cuda_matvec_mixed_supported(t1, t2))
            return 1;
    }
    struct moe_mv_job jobs[3];
    int nj = 0, n1 = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int j = 0; j < n_mm; j++)
            if (W[j]->type == (pass ? t2 : t1))
                jobs[nj++] = mm_job(b, l, &mm[j], W[j]);
        if (pass == 0)
            n1 = nj;
    }
    const int64_t n = W[0]->ne[0];
    int rc;
    if (fold) {
        TRY_CU(before_write(b, b->pn_dst));
        rc = -EINVAL;
        if (rope && nj == 3) {
            rc = moe_cuda_matvec_mixed(t1, t2, jobs, nj, n1, n, b->buf[b->pn_src], n, 1, 0,
                                       norm_weight(b, b->pn_l, b->pn_w), b->d.eps,
                                       b->buf[b->pn_dst], rope, b->st);
            b->rope_done = rc == 0;
        }
        if (rc == -EINVAL)
            rc = moe_cuda_matvec_mixed(t1, t2, jobs, nj, n1, n, b->buf[b->pn_src], n, 1, 0,
                                       norm_weight(b, b->pn_l, b->pn_w), b->d.eps,
                                       b->buf[b->pn_dst], NULL, b->st);
        if (rc == -EINVAL)
            return 1; /* misaligned: the per-type path launches the RMSNorm first */
        if (rc == 0)
            b->norm_pending = false;
    } else {
        rc = moe_cuda_matvec_mixed(t1, t2, jobs, nj, n1, n, b->buf[src], b->ld[src], b->n,
                                   accumulate, NULL, 0.0f, NULL, NULL, b->st);
        if (rc == -EINVAL)
            return 1;
    }
    LAUNCH(b, !fold          ? "matmul (two types)"
              : b->rope_done ? "rmsnorm + matmul (two types) + qk_rope_kv"
                             : "rmsnorm + matmul (two types)",
           rc);
    return 0;
}

/* qkv_branch: the products of mm of one weight type other than t (all of them, or nothing when
 * there are two such types), launched on st_b from the pending RMSNorm's source, forked from st
 * before the launch of t's products applies that RMSNorm on st; they are marked done, and
 * *joined tells matmul_now to have st wait for the branch after its launches. One-token steps
 * only (so never a prompt's tensor-core products). */
static int qkv_branch(struct cuda_backend *b, int l, const struct moe_mm *mm, int n_mm, bool *done,
                      uint32_t t, bool tc, bool *joined)
{
    struct moe_mv_job jobs[3];
    int idx[3], nj = 0;
    const struct moe_tensor *W2 = NULL;
    for (int i = 0; i < n_mm; i++) {
        const struct moe_tensor *Wi = moe_weight(b->m, l, mm[i].w);
        if (done[i] || !Wi || Wi->type == t)
            continue;
        if ((W2 && Wi->type != W2->type) || !mm_fits(b, l, &mm[i], b->pn_dst, Wi))
            return 0; /* the per-type launches take them (and report what does not fit) */
        W2 = Wi;
        idx[nj] = i;
        jobs[nj++] = mm_job(b, l, &mm[i], Wi);
    }
    if (!nj)
        return 0;
    CU(b, cudaEventRecord(b->ev_bfork, b->st));
    CU(b, cudaStreamWaitEvent(b->st_b, b->ev_bfork, 0));
    if (b->branch_pdl && b->capturing && moe_pdl_enabled()) {
        /* The fork's edge from the kernel before it made programmatic, as an edge between
         * consecutive launches of one stream is: the branch's kernel may start (and load its
         * weights) while that kernel runs, and waits for it in pdl_wait(). */
        enum cudaStreamCaptureStatus cs;
        const cudaGraphNode_t *deps = NULL;
        const cudaGraphEdgeData *ed = NULL;
        size_t nd = 0;
        CU(b, cudaStreamGetCaptureInfo(b->st_b, &cs, NULL, NULL, &deps, &ed, &nd));
        enum cudaGraphNodeType ty;
        if (cs == cudaStreamCaptureStatusActive && nd == 1 &&
            cudaGraphNodeGetType(deps[0], &ty) == cudaSuccess && ty == cudaGraphNodeTypeKernel) {
            cudaGraphNode_t n0 = deps[0];
            cudaGraphEdgeData e;
            memset(&e, 0, sizeof e);
            e.from_port = cudaGraphKernelNodePortProgrammatic;
            e.type = cudaGraphDependencyTypeProgrammatic;
            CU(b, cudaStreamUpdateCaptureDependencies(b->st_b, &n0, &e, 1,
                                                      cudaStreamSetCaptureDependencies));
            b->branch_pdl_edges++;
        }
    }
    const int rc =
        tc ? moe_cuda_matvec_tc_norm(W2->type, jobs, nj, W2->ne[0], b->buf[b->pn_src],
                                     norm_weight(b, b->pn_l, b->pn_w), b->d.eps, NULL, b->st_b)
           : moe_cuda_matvec_multi_norm(W2->type, jobs, nj, W2->ne[0], b->buf[b->pn_src],
                                        norm_weight(b, b->pn_l, b->pn_w), b->d.eps, b->br_norm,
                                        NULL, b->st_b);
    /* Joined back whatever happened: a capture ends only with every stream it took in joined. */
    CU(b, cudaEventRecord(b->ev_bjoin, b->st_b));
    *joined = true;
    if (rc == -EINVAL)
        return 0; /* misaligned: launched after the normalised row is stored, as without */
    LAUNCH(b, "rmsnorm + matmul (branch)", rc);
    for (int k = 0; k < nj; k++)
        done[idx[k]] = true;
    return 0;
}

static bool route_folds(const struct cuda_backend *b, int l);

/* The one-token router of layer l (weight W, job) with its pending RMSNorm, launched so that it
 * also stages the normalised row for the layer's gate/up on tensor cores (gu_staged; a layer
 * whose routing is done in its gate/up launch, route_folds): *rc 0 when launched, -EINVAL when
 * not (the caller's launch then does it). */
static int router_staged(struct cuda_backend *b, int l, const struct moe_tensor *W,
                         const struct moe_mv_job *job, int *rc)
{
    *rc = -EINVAL;
    const struct cuda_layer *cl = &b->layers[l];
    if (!b->gu_staged || !b->d_xst || W->type != MOE_TYPE_F32 || !route_folds(b, l) ||
        !moe_cuda_expert_tc(b->tc & MOE_CUDA_TC_GATE_UP, cl->gate_type) || W->ne[0] != b->d.E)
        return 0;
    *rc = moe_cuda_router_norm_staged(job, W->ne[0], b->buf[b->pn_src],
                                      norm_weight(b, l, b->pn_w), b->d.eps, b->buf[b->pn_dst],
                                      cl->gate_type, b->d_xst, b->st);
    if (*rc == -EINVAL)
        return 0;
    LAUNCH(b, "rmsnorm + router (+ gate/up's input staged)", *rc);
    b->xst_l = l;
    return 0;
}

/* The products of cuda_matmul, launched now; rope (or NULL): the q/k-norm + RoPE + KV store of
 * the layer done by the launch that applies a pending RMSNorm where it can (b->rope_done says
 * whether it did). */
static int matmul_now(struct cuda_backend *b, int l, const struct moe_mm *mm, int n_mm,
                      enum moe_buf src, bool accumulate, const struct moe_mv_rope *rope)
{
    b->rope_done = false;
    mark(b, n_mm == 3 ? "qkv" : mm[0].w == MOE_W_O ? "o" : "router");
    /* A pending RMSNorm into src goes into the first launch (cuda_rmsnorm): the float walk's or
     * the tensor cores' (one token staged by every block, moe_cuda_matvec_tc_norm). */
    const bool tcd = tc_dense(b, l, mm, n_mm);
    bool fold = b->norm_pending && src == b->pn_dst && !accumulate && b->n == 1;
    if (!fold)
        TRY_CU(flush_pending(b));
    else
        TRY_CU(route_now(b));
    const float *x = b->buf[src];
    const int64_t ldx = b->ld[src];
    if (n_mm > 1 && (b->mixed_mv > 0 || (b->mixed_mv < 0 && b->n > 1)) &&
        b->n <= MOE_CUDA_GRAPH_MAX && !tcd) {
        /* Two weight types (v in Q6_K, q and k in Q4_K on half the layers of a Q4_K_M file):
         * one launch for both when there is a kernel for the pair. */
        const int rc = matmul_mixed(b, l, mm, n_mm, src, accumulate, fold, rope);
        if (rc <= 0)
            return rc;
    }
    /* One launch per weight type (q, k and v usually share theirs). */
    bool done[3] = {false, false, false}, joined = false;
    for (int j = 0; j < n_mm; j++) {
        if (done[j])
            continue;
        const struct moe_tensor *W = moe_weight(b->m, l, mm[j].w);
        struct moe_mv_job jobs[3];
        int nj = 0;
        for (int i = j; i < n_mm; i++) {
            const struct moe_tensor *Wi = moe_weight(b->m, l, mm[i].w);
            if (done[i] || !Wi || Wi->type != W->type)
                continue;
            if (!mm_fits(b, l, &mm[i], src, Wi))
                return cu_err(b, MOE_ERANGE, "matmul: weight %d of layer %d does not fit",
                              (int)mm[i].w, l);
            jobs[nj++] = mm_job(b, l, &mm[i], Wi);
            done[i] = true;
        }
        if (!W || nj == 0)
            return cu_err(b, MOE_ERANGE, "matmul: weight %d of layer %d", (int)mm[j].w, l);
        if (use_gemm(b, W->type)) {
            /* Prompt steps: tensor-core products, one per matrix. */
            for (int i = 0; i < nj; i++)
                LAUNCH(b, "matmul (tensor cores)",
                       moe_cuda_gemm(W->type, jobs[i].w, W->ne[0], jobs[i].rows, x, ldx, b->n,
                                     jobs[i].y, jobs[i].ldy, accumulate, b->st));
            continue;
        }
        if (fold) {
            fold = false;
            b->norm_pending = false;
            TRY_CU(before_write(b, b->pn_dst));
            if (b->qkv_branch && l >= b->qkv_branch_from && b->n == 1 && nj < n_mm)
                TRY_CU(qkv_branch(b, l, mm, n_mm, done, W->type, tcd, &joined));
            int rc = -EINVAL;
            if (!tcd && nj == 1 && n_mm == 1 && mm[0].w == MOE_W_ROUTER)
                TRY_CU(router_staged(b, l, W, &jobs[0], &rc));
            if (rc == 0)
                continue;
            if (tcd) {
                /* The types after this one (when not on the branch) read the normalised row
                 * this launch stores. */
                rc = moe_cuda_matvec_tc_norm(W->type, jobs, nj, W->ne[0], b->buf[b->pn_src],
                                             norm_weight(b, b->pn_l, b->pn_w), b->d.eps,
                                             b->buf[b->pn_dst], b->st);
            } else {
                if (rope && nj == 3) {
                    rc = moe_cuda_matvec_multi_norm(W->type, jobs, nj, W->ne[0],
                                                    b->buf[b->pn_src],
                                                    norm_weight(b, b->pn_l, b->pn_w), b->d.eps,
                                                    b->buf[b->pn_dst], rope, b->st);
                    b->rope_done = rc == 0;
                }
                if (rc == -EINVAL)
                    rc = moe_cuda_matvec_multi_norm(W->type, jobs, nj, W->ne[0],
                                                    b->buf[b->pn_src],
                                                    norm_weight(b, b->pn_l, b->pn_w), b->d.eps,
                                                    b->buf[b->pn_dst], NULL, b->st);
            }
            if (rc == 0)
                continue;
            if (rc != -EINVAL)
                LAUNCH(b, "rmsnorm + matmul", rc);
            TRY_CU(launch_rmsnorm(b, b->pn_l, b->pn_w, b->pn_src, b->pn_dst)); /* misaligned */
        }
        if (tcd) {
            /* One token: each block stages its row itself (no staging launch). */
            void *ws = b->n > 1 || b->tc_ws1 ? b->tc_ws : NULL;
            LAUNCH(b, "matmul (tensor cores)",
                   moe_cuda_matvec_tc_multi_ws(W->type, jobs, nj, W->ne[0], x, ldx, b->n,
                                               accumulate, ws, b->tc_ws_bytes, b->st));
            continue;
        }
        LAUNCH(b, "matmul",
               moe_cuda_matvec_multi(W->type, jobs, nj, W->ne[0], x, ldx, b->n, accumulate,
                                     b->st));
    }
    if (joined)
        CU(b, cudaStreamWaitEvent(b->st, b->ev_bjoin, 0));
    return 0;
}

static int cuda_matmul(struct moe_backend *bb, int l, const struct moe_mm *mm, int n_mm,
                       enum moe_buf src, bool accumulate)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    if (b->mode == MODE_REPLAY)
        return 0;
    if (l < 0 || l >= (int)b->d.L || n_mm < 1 || n_mm > 3)
        return cu_err(b, MOE_ERANGE, "matmul: layer %d, %d products", l, n_mm);
    /* A one-token q/k/v product that applies a pending RMSNorm is left pending in turn: if the
     * next op is the layer's q/k-norm + RoPE + KV store, one launch does all three
     * (cuda_qk_rope_kv); anything else launches it first (flush_pending). */
    if (b->rope_fold && n_mm == 3 && b->n == 1 && !accumulate && b->norm_pending &&
        src == b->pn_dst && mm[0].w == MOE_W_Q && mm[0].dst == MOE_BUF_Q &&
        mm[1].w == MOE_W_K && mm[1].dst == MOE_BUF_K && mm[2].w == MOE_W_V &&
        mm[2].dst == MOE_BUF_V && !tc_dense(b, l, mm, n_mm)) {
        TRY_CU(flush_qkv(b));
        TRY_CU(route_now(b));
        b->qkv_pending = true;
        b->pq_l = l;
        memcpy(b->pq_mm, mm, sizeof b->pq_mm);
        b->pq_src = src;
        return 0;
    }
    return matmul_now(b, l, mm, n_mm, src, accumulate, NULL);
}

static int cuda_qk_rope_kv(struct moe_backend *bb, int l)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    SKIP_IF_REPLAY(b);
    if (l < 0 || l >= (int)b->d.L)
        return cu_err(b, MOE_ERANGE, "qk_rope_kv: layer %d", l);
    const struct cuda_layer *cl = &b->layers[l];
    if (b->qkv_pending && b->pq_l == l) {
        const struct moe_mv_rope rope = {
            b->buf[MOE_BUF_Q], b->buf[MOE_BUF_K], b->buf[MOE_BUF_V], cl->q_norm, cl->k_norm,
            b->d_rope,         D_POS(b),          D_SEQ(b),          &b->kv,     l,
            b->d.H,            b->d.eps,          b->rope_cnt};
        b->qkv_pending = false;
        TRY_CU(matmul_now(b, l, b->pq_mm, 3, b->pq_src, false, &rope));
        if (b->rope_done)
            return 0;
    }
    TRY_CU(flush_pending(b));
    if (b->att_rope && b->n == 1) {
        /* Left to the layer's attention, which does it inside its launch (one token: no other
         * token reads the cache cell it writes); anything else launches it first
         * (flush_pending). */
        b->rope_pending = true;
        b->pr_l = l;
        return 0;
    }
    return launch_qk_rope_kv(b, l);
}

static int cuda_attention(struct moe_backend *bb, int l)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    SKIP_IF_REPLAY(b);
    /* A q/k-norm + RoPE + KV store left pending by the layer's qk_rope_kv is done here (its
     * qk_rope_kv launched everything else pending); the other launches below launch what is
     * pending first. */
    const bool fold = b->rope_pending && b->pr_l == l;
    /* Decode-sized steps split each token's positions (by its length alone), with blocks enough
     * for what an SM holds at once (MOE_CUDA_ATT_BPS sets it); prompt chunks have blocks enough
     * unsplit. */
    int split = 0;
    if (b->n <= MOE_CUDA_GRAPH_MAX) {
        const int64_t bps = fold ? b->att_bps_rope : b->att_bps_plain;
        const int64_t want = bps * b->sms / (b->d.H * b->n);
        split = want < 1 ? 1 : want > ATT_MAX_SPLITS ? ATT_MAX_SPLITS : (int)want;
    }
    if (b->n > MOE_CUDA_GRAPH_MAX && b->use_flash && moe_cuda_attention_mma_supported(&b->kv)) {
        /* Prompt steps: tensor cores (worker/cuda/attn_mma.cu). */
        TRY_CU(flush_pending(b));
        LAUNCH(b, "attention (tensor cores)",
               moe_cuda_attention_mma(b->buf[MOE_BUF_Q], b->ld[MOE_BUF_Q], D_POS(b), D_SEQ(b),
                                      &b->kv, l, b->d.H, b->n, b->buf[MOE_BUF_ATT],
                                      b->ld[MOE_BUF_ATT], b->st));
        return 0;
    }
    if (fold && split > 0) {
        const struct cuda_layer *cl = &b->layers[l];
        b->rope_pending = false;
        LAUNCH(b, "attention + q/k-norm, RoPE, KV",
               moe_cuda_attention_rope(
                   b->buf[MOE_BUF_Q], b->ld[MOE_BUF_Q], b->buf[MOE_BUF_K], b->ld[MOE_BUF_K],
                   b->buf[MOE_BUF_V], b->ld[MOE_BUF_V], cl->q_norm, cl->k_norm, b->d_rope,
                   D_POS(b), D_SEQ(b), &b->kv, l, b->d.H, b->d.eps, b->n, split, b->part,
                   b->att_done, b->rope_cnt + b->d.H, b->buf[MOE_BUF_ATT], b->ld[MOE_BUF_ATT],
                   b->st));
        return 0;
    }
    TRY_CU(flush_pending(b));
    LAUNCH(b, "attention",
           moe_cuda_attention(b->buf[MOE_BUF_Q], b->ld[MOE_BUF_Q], D_POS(b), D_SEQ(b), &b->kv, l,
                              b->d.H, b->n, split, b->part, b->att_done, b->buf[MOE_BUF_ATT],
                              b->ld[MOE_BUF_ATT], b->st));
    return 0;
}

/* Slots per expert, on average, from which layer cl's decode steps group their slots by expert. */
static double group_min(const struct cuda_backend *b, const struct cuda_layer *cl)
{
    if (b->group_min > 0)
        return b->group_min;
    const bool down = moe_cuda_expert_tc(b->tc & MOE_CUDA_TC_DOWN, cl->down_type);
    const bool gu = b->tc_ws && moe_cuda_expert_tc(b->tc & MOE_CUDA_TC_GATE_UP, cl->gate_type);
    return down && gu ? MOE_CUDA_GROUP_MIN_TC_GU : down ? MOE_CUDA_GROUP_MIN_TC : MOE_CUDA_GROUP_MIN;
}

/* Whether layer l's expert op takes the per-slot path with the routing done in its gate/up
 * launch (moe_cuda_expert_gate_up with a route): all of the layer's experts in VRAM (nothing to
 * resolve in between), gate and up of one type, a step too small for grouping. */
static bool route_folds(const struct cuda_backend *b, int l)
{
    const struct cuda_layer *cl = &b->layers[l];
    const int64_t k = b->d.kuse;
    /* One token only: with several, every gate/up block would route its token again (measured
     * slower from 4 sequences up). */
    if (!b->route_fold || b->n != 1 || cl->slots < b->d.nexp || cl->mixed ||
        cl->gate_type != cl->up_type)
        return false;
    return k < group_min(b, cl) * (double)b->d.nexp;
}

static int launch_route(struct cuda_backend *b, int l)
{
    LAUNCH(b, "route",
           moe_cuda_route(b->buf[MOE_BUF_RL], b->ld[MOE_BUF_RL], b->d.nexp, (int)b->d.kuse,
                          b->d.norm_topk, b->n, (int32_t *)b->buf[MOE_BUF_SEL_E],
                          b->buf[MOE_BUF_SEL_W], b->counts + (size_t)l * b->d.nexp, b->st));
    return 0;
}

/* Whether the resolve of offloaded layer l routes first, in its own launch (a decode step of up
 * to MOE_OFF_ROUTE_MAX tokens; MOE_CUDA_RESOLVE_ROUTE=0 keeps the route kernel). */
static bool route_in_resolve(const struct cuda_backend *b, int l)
{
    return b->resolve_route && b->layers[l].slots < b->d.nexp && !b->stage_step &&
           b->n <= MOE_OFF_ROUTE_MAX && b->d.nexp <= 256;
}

static int cuda_route(struct moe_backend *bb, int l)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    SKIP_IF_REPLAY(b);
    TRY_CU(flush_pending(b));
    if (route_folds(b, l) || route_in_resolve(b, l)) {
        b->route_pending = l; /* cuda_experts routes in its gate/up or resolve launch */
        return 0;
    }
    return launch_route(b, l);
}

/* Whether layer t gets a prefetch this step: it has cache slots, and the step is small. */
static bool prefetches(const struct cuda_backend *b, int t)
{
    if (!b->pf || t <= 0 || t >= (int)b->d.L || b->n > PF_MAX_N)
        return false;
    const struct cuda_layer *cl = &b->layers[t];
    return cl->slots < b->d.nexp && (cl->hot < cl->slots || b->xsrc) && cl->w[MOE_W_ROUTER] &&
           !use_gemm(b, cl->type[MOE_W_ROUTER]);
}

/* On the second stream, after ev_fork[l] (waited for by the first prefetch of layer l): layer
 * t's router (t = l + 1 .. l + pf_ahead) applied to layer l's MoE input re-weighted for layer t
 * (MOE_BUF_X; ev_read[l] once it is read), its top-k, and those experts placed in layer t's
 * cache slots; their copies on the third stream after that (pf_split) or on the second;
 * ev_join[t] at the end. */
static int prefetch(struct cuda_backend *b, int l, int t, bool first)
{
    const struct cuda_layer *ct = &b->layers[t];
    const struct moe_tensor *R = moe_weight(b->m, t, MOE_W_ROUTER);
    const int k = b->pf_k;
    const int64_t E = b->d.E, ldx = pad4(E);
    const float *scale = b->pf_scale[t - l - 1] + (size_t)l * E;
    if (first)
        CU(b, cudaStreamWaitEvent(b->st2, b->ev_fork[l], 0));
    LAUNCH(b, "prefetch input",
           moe_cuda_scale_rows(b->buf[MOE_BUF_X], b->ld[MOE_BUF_X], scale, E, b->n, b->pf_x, ldx,
                               b->st2));
    CU(b, cudaEventRecord(b->ev_read[l], b->st2));
    struct moe_mv_job job = {ct->w[MOE_W_ROUTER], R->ne[1], b->pf_rl, b->d.nexp};
    LAUNCH(b, "prefetch router",
           moe_cuda_matvec_multi(R->type, &job, 1, R->ne[0], b->pf_x, ldx, b->n, false, b->st2));
    LAUNCH(b, "prefetch route",
           moe_cuda_route(b->pf_rl, b->d.nexp, b->d.nexp, k, b->d.norm_topk, b->n, b->pf_sel,
                          b->pf_w, b->pf_counts, b->st2));
    cudaStream_t cs = b->st2;
    if (b->xsrc) {
        LAUNCH(b, "read-ahead hint",
               moe_cuda_offload_pool_hint(b->d_off + t, (int32_t)b->d.nexp, b->pf_sel, b->n * k,
                                          b->st2));
    } else {
        struct moe_cuda_fill_list *fl =
            (struct moe_cuda_fill_list *)(b->d_pf_fill + (size_t)t * b->pf_fill_stride);
        LAUNCH(b, "prefetch residency",
               moe_cuda_offload_resolve(b->d_off + t, (int32_t)b->d.nexp, ct->slots, b->pf_sel,
                                        b->n * k, fl, true, NULL, false, b->st2));
        if (b->pf_split) {
            CU(b, cudaEventRecord(b->ev_pred[t], b->st2));
            CU(b, cudaStreamWaitEvent(b->st3, b->ev_pred[t], 0));
            cs = b->st3;
        }
        LAUNCH(b, "prefetch fill",
               moe_cuda_offload_fill_nt(fl, b->pf_blocks, b->pf_threads, b->link_gbps, cs));
    }
    CU(b, cudaEventRecord(b->ev_join[t], cs));
    b->pf_pending[t] = true;
    return 0;
}

static int expert_kernels(struct cuda_backend *b, int l, bool fold, const void *const *fill,
                          const struct moe_cuda_gu_resolve *rs);
/* The kernels that compute a layer's experts in a step (expert_kernels). */
enum expert_path { XP_MIXED, XP_GEMM, XP_GROUPED, XP_PER_SLOT };
static enum expert_path expert_path(const struct cuda_backend *b, const struct cuda_layer *cl);

/* Where h_offmem, the host mirror of the offload state, holds what `dev` points to in
 * d_offmem. */
static void *host_view(const struct cuda_backend *b, const void *dev)
{
    return b->h_offmem + ((const uint8_t *)dev - b->d_offmem);
}

/* The next layer after l with experts outside VRAM, or -1. */
static int next_offloaded(const struct cuda_backend *b, int l)
{
    for (int t = l + 1; t < (int)b->d.L; t++)
        if (b->layers[t].slots < b->d.nexp)
            return t;
    return -1;
}

/* Layer t's experts without a slot copied into the next staging buffer on stream s, the
 * layer's tables pointed there; on the second stream, ev_sjoin of the buffer at the end. */
static int stage_layer(struct cuda_backend *b, int t, cudaStream_t s)
{
    const int j = b->stage_next;
    b->stage_next ^= 1;
    b->stage_buf[t] = (int8_t)j;
    LAUNCH(b, "prompt staging",
           moe_cuda_offload_stage(b->d_off + t, (int32_t)b->d.nexp, b->stage[j], b->stage_cap,
                                  b->d_stage_fill[j], s));
    if (b->stage_dma && b->mode == MODE_DIRECT) {
        /* The same copies by the copy engines: the experts without a slot in the host mirror
         * of the layer's state (begin() fetched it), in expert order, as moe_off_stage
         * queues them. */
        const struct cuda_layer *cl = &b->layers[t];
        const int32_t *slot_of = (const int32_t *)host_view(b, b->h_off[t].slot_of);
        int32_t k = 0;
        for (int64_t x = 0; x < b->d.nexp && k < b->stage_cap; x++) {
            if (slot_of[x] >= 0)
                continue;
            uint8_t *at = b->stage[j] + (size_t)k * cl->slot_bytes;
            for (int p = 0; p < 3; p++)
                CU(b, cudaMemcpyAsync(at + cl->part_off[p], cl->host[p][x],
                                      expert_part(&b->m->layers[t].experts[x], p)->nbytes,
                                      cudaMemcpyDefault, s));
            k++;
        }
    } else {
        LAUNCH(b, "prompt staging copies",
               moe_cuda_offload_fill(b->d_stage_fill[j], b->stage_blocks, b->link_gbps, s));
    }
    if (s != b->st)
        CU(b, cudaEventRecord(b->ev_sjoin[j], s));
    return 0;
}

/* A staging step's layer l: its experts staged (now, or joined from the second stream, where
 * the next offloaded layer's staging starts, into the other buffer, while this layer computes),
 * the expert kernels, then the lookups counted and the tables restored. */
static int staged_experts(struct cuda_backend *b, int l, bool fold)
{
    mark(b, "staging");
    const bool ahead = b->stage_buf[l] >= 0; /* issued on the second stream */
    if (!ahead)
        TRY_CU(stage_layer(b, l, b->st));
    const int t = next_offloaded(b, l);
    if (t >= 0) {
        /* Fork after every earlier layer's reads of the other buffer. */
        CU(b, cudaEventRecord(b->ev_sfork, b->st));
        CU(b, cudaStreamWaitEvent(b->st2, b->ev_sfork, 0));
        TRY_CU(stage_layer(b, t, b->st2));
    }
    if (ahead)
        CU(b, cudaStreamWaitEvent(b->st, b->ev_sjoin[b->stage_buf[l]], 0));
    TRY_CU(expert_kernels(b, l, fold, NULL, NULL));
    LAUNCH(b, "prompt staging end",
           moe_cuda_offload_stage_end(b->d_off + l, (int32_t)b->d.nexp,
                                      (const int32_t *)b->buf[MOE_BUF_SEL_E], b->n * b->d.kuse,
                                      b->stage_cap, b->st));
    b->stage_buf[l] = -1;
    return 0;
}

static int experts_op(struct cuda_backend *b, int l);

/* The layer's expert op, then, in a step that records, its choices (final now: routed by the
 * route kernel or inside the op's own launches) copied into the step's history. */
static int cuda_experts(struct moe_backend *bb, int l)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    SKIP_IF_REPLAY(b);
    TRY_CU(experts_op(b, l));
    if (b->record) {
        const size_t nk = (size_t)(b->n * b->d.kuse);
        CU(b, cudaMemcpyAsync(b->d_route_hist + (size_t)l * nk, b->buf[MOE_BUF_SEL_E],
                              sizeof(int32_t) * nk, cudaMemcpyDeviceToDevice, b->st));
    }
    return 0;
}

static int experts_op(struct cuda_backend *b, int l)
{
    TRY_CU(flush_norm(b));
    const struct cuda_layer *cl = &b->layers[l];
    /* The routing left to this op: in the resolve's launch (offloaded layers), else in the
     * gate/up launch (fold); one-token steps of an offloaded layer (without a tiered store)
     * route and resolve in the gate/up launch (gu_resolve). */
    const bool gu_res = b->d_gusync && b->route_pending == l && cl->slots < b->d.nexp &&
                        !b->stage_step && b->n == 1 && b->d_fsrc &&
                        b->d.kuse <= MOE_OFF_FAST_MAX && cl->gate_type == cl->up_type &&
                        expert_path(b, cl) == XP_PER_SLOT;
    const bool in_resolve =
        b->route_pending == l && cl->slots < b->d.nexp && !b->stage_step && !gu_res;
    const bool fold = b->route_pending == l && !in_resolve;
    if (b->route_pending == l)
        b->route_pending = -1;
    else
        TRY_CU(route_now(b));
    const int k = (int)b->d.kuse;
    const int32_t *sel_e = (const int32_t *)b->buf[MOE_BUF_SEL_E];
    /* The layers whose experts are predicted at this one: pf_ahead layers ahead (and from
     * layer 0 also the layers before that). */
    int pf_t[PF_AHEAD_MAX], npf = 0;
    for (int a = l == 0 ? 1 : b->pf_ahead; a <= b->pf_ahead; a++)
        if (prefetches(b, l + a))
            pf_t[npf++] = l + a;
    const bool pf_next = npf > 0;
    const void *const *fill = NULL;
    struct moe_cuda_gu_resolve rs = {};
    if (pf_next)
        CU(b, cudaEventRecord(b->ev_fork[l], b->st));
    if (cl->slots < b->d.nexp && b->stage_step)
        return staged_experts(b, l, fold);
    if (cl->slots < b->d.nexp) {
        /* Experts outside VRAM: resolve this step's choices against the slots, fill misses. */
        mark(b, "offload");
        if (b->pf_pending && b->pf_pending[l]) {
            CU(b, cudaStreamWaitEvent(b->st, b->ev_join[l], 0));
            b->pf_pending[l] = false;
        }
        struct moe_cuda_off_route rt = {b->buf[MOE_BUF_RL], b->ld[MOE_BUF_RL], (int)b->n, k,
                                        (int)b->d.nexp, b->d.norm_topk,
                                        (int32_t *)b->buf[MOE_BUF_SEL_E], b->buf[MOE_BUF_SEL_W],
                                        b->counts + (size_t)l * b->d.nexp};
        if (gu_res)
            rs = (struct moe_cuda_gu_resolve){b->d_off + l, b->d_fill, b->d_gusync + 3 * l,
                                              (int32_t)b->d.nexp, cl->slots};
        else
            LAUNCH(b, "expert residency",
                   moe_cuda_offload_resolve(b->d_off + l, (int32_t)b->d.nexp, cl->slots, sel_e,
                                            b->n * k, b->d_fill, false, in_resolve ? &rt : NULL,
                                            b->resolve_fast, b->st));
        /* The resolve inside gate/up needs the kernels' copy sources even where every slot is
         * pinned (it clears them for the choices). */
        if (gu_res || cl->hot < cl->slots) {
            if (b->d_fsrc && expert_path(b, cl) == XP_PER_SLOT)
                fill = b->d_fsrc + (size_t)l * 3 * (size_t)b->d.nexp; /* the kernels copy */
            else
                LAUNCH(b, "expert fill",
                       moe_cuda_offload_fill(b->d_fill, b->fill_blocks, b->link_gbps, b->st));
        }
    }
    for (int i = 0; i < npf; i++) {
        const int prc = prefetch(b, l, pf_t[i], i == 0);
        if (prc)
            return prc;
        b->pf_read = l; /* the next write of MOE_BUF_X waits for its read (before_write) */
    }
    TRY_CU(expert_kernels(b, l, fold, fill, gu_res ? &rs : NULL));
    if (b->xsrc && cl->slots < b->d.nexp)
        LAUNCH(b, "pool done", moe_cuda_offload_pool_done(b->d_off + l, b->st));
    return 0;
}

/* Which kernels compute layer cl's experts in this step: a layer of mixed types has its own;
 * a prompt step on tensor cores; enough slots per expert to group them; else one launch per
 * slot. */
static enum expert_path expert_path(const struct cuda_backend *b, const struct cuda_layer *cl)
{
    if (cl->mixed)
        return XP_MIXED;
    if (use_gemm(b, cl->gate_type) && use_gemm(b, cl->up_type) && use_gemm(b, cl->down_type))
        return XP_GEMM;
    if ((double)(b->n * (int64_t)b->d.kuse) >= group_min(b, cl) * (double)b->d.nexp &&
        cl->gate_type == cl->up_type)
        return XP_GROUPED;
    return XP_PER_SLOT;
}

/* Layer l's expert kernels over the step's routing (MOE_BUF_SEL_E / SEL_W): gate/up with
 * SwiGLU, down, the combine and the residual, by whichever path fits the step and the types.
 * fill (or NULL): the layer's fill sources ([3][nexp]), for the per-slot kernels to make the
 * copies the layer's resolve queued (the path must be XP_PER_SLOT). */
static int expert_kernels(struct cuda_backend *b, int l, bool fold, const void *const *fill,
                          const struct moe_cuda_gu_resolve *rs)
{
    const struct cuda_layer *cl = &b->layers[l];
    const int k = (int)b->d.kuse;
    const int32_t *sel_e = (const int32_t *)b->buf[MOE_BUF_SEL_E];
    const enum expert_path path = expert_path(b, cl);
    /* Tiles copied into shared memory first only where every expert of the layer is in VRAM
     * (no reads from host memory, no copies into slots beside them). */
    const int tc = cl->slots < b->d.nexp ? b->tc & ~(MOE_CUDA_TC_ASYNC_ANY | MOE_CUDA_TC_DOWN_WS |
                                                      MOE_CUDA_TC_DOWN_WS_ALL)
                                         : b->tc;
    if (path == XP_MIXED) {
        mark(b, "mixed");
        LAUNCH(b, "experts (mixed types)",
               moe_cuda_expert_mixed(&cl->mx, b->d.E, b->d.ff, b->d.E, b->buf[MOE_BUF_X],
                                     b->ld[MOE_BUF_X], b->n, k, sel_e, b->buf[MOE_BUF_SEL_W],
                                     &b->groups, b->act, b->ld_act, b->scratch, b->dout,
                                     b->ld_dout, b->buf[MOE_BUF_H], b->ld[MOE_BUF_H], b->st));
        return 0;
    }
    if (path == XP_GEMM) {
        /* Prompt steps: slots grouped by expert, each expert's products on tensor cores over
         * its slots (outputs in grouped order), then the combine in each token's order. */
        const int64_t slots = b->n * k;
        const int64_t cnt = slots * b->ld_act;
        float *G = b->scratch, *U = b->scratch + cnt;
        mark(b, "group");
        LAUNCH(b, "expert grouping",
               moe_cuda_expert_group(sel_e, slots, b->d.nexp, k, &b->groups, b->st));
        mark(b, "gate_up");
        LAUNCH(b, "expert gate (tensor cores)",
               moe_cuda_gemm_grouped(cl->gate_type, cl->gate, b->d.E, b->d.ff, (int)b->d.nexp,
                                     b->groups.ex_off, b->groups.slot_tok, b->buf[MOE_BUF_X],
                                     b->ld[MOE_BUF_X], G, b->ld_act, slots, b->st));
        LAUNCH(b, "expert up (tensor cores)",
               moe_cuda_gemm_grouped(cl->up_type, cl->up, b->d.E, b->d.ff, (int)b->d.nexp,
                                     b->groups.ex_off, b->groups.slot_tok, b->buf[MOE_BUF_X],
                                     b->ld[MOE_BUF_X], U, b->ld_act, slots, b->st));
        LAUNCH(b, "swiglu", moe_cuda_expert_swiglu(G, U, b->act, cnt, b->st));
        mark(b, "down");
        LAUNCH(b, "expert down (tensor cores)",
               moe_cuda_gemm_grouped(cl->down_type, cl->down, b->d.ff, b->d.E, (int)b->d.nexp,
                                     b->groups.ex_off, NULL, b->act, b->ld_act, b->dout,
                                     b->ld_dout, slots, b->st));
        LAUNCH(b, "expert combine",
               moe_cuda_expert_combine_pos(b->dout, b->ld_dout, b->d.E, b->n, k,
                                           b->buf[MOE_BUF_SEL_W], b->groups.slot_pos,
                                           b->buf[MOE_BUF_H], b->ld[MOE_BUF_H], b->st));
        return 0;
    }
    if (path == XP_GROUPED) {
        /* Many tokens (prompts): slots grouped by expert, each active expert's weights read and
         * decoded once for several of its slots. */
        const int64_t slots = b->n * k;
        const int max_active = (int)(slots < b->d.nexp ? slots : b->d.nexp);
        mark(b, "group");
        LAUNCH(b, "expert grouping",
               moe_cuda_expert_group(sel_e, slots, b->d.nexp, k, &b->groups, b->st));
        mark(b, "gate_up");
        LAUNCH(b, "expert gate/up",
               moe_cuda_expert_gate_up_grouped(cl->gate_type, cl->gate, cl->up, b->d.E, b->d.ff,
                                               b->buf[MOE_BUF_X], b->ld[MOE_BUF_X], k, &b->groups,
                                               max_active, b->act, b->ld_act, tc, b->tc_ws,
                                               b->tc_ws_bytes, b->n, b->st));
        mark(b, "down");
        LAUNCH(b, "expert down",
               moe_cuda_expert_down_grouped(cl->down_type, cl->down, b->d.ff, b->d.E, b->act,
                                            b->ld_act, &b->groups, max_active, b->n, k,
                                            b->buf[MOE_BUF_SEL_W], b->dout, b->ld_dout,
                                            b->buf[MOE_BUF_H], b->ld[MOE_BUF_H], tc, b->tc_ws,
                                            b->tc_ws_bytes, b->st));
        return 0;
    }
    const struct moe_cuda_route_in rt = {b->buf[MOE_BUF_RL],
                                         b->ld[MOE_BUF_RL],
                                         (int)b->d.nexp,
                                         b->d.norm_topk,
                                         (int32_t *)b->buf[MOE_BUF_SEL_E],
                                         b->buf[MOE_BUF_SEL_W],
                                         b->counts + (size_t)l * b->d.nexp,
                                         fold && b->xst_l == l && !fill && !rs ? b->d_xst : NULL,
                                         cl->gate_type};
    mark(b, "gate_up");
    LAUNCH(b, rs ? "route + expert residency + gate/up" : fold ? "route + expert gate/up" : "expert gate/up",
           moe_cuda_expert_gate_up(cl->gate_type, cl->up_type, cl->gate, cl->up, b->d.E, b->d.ff,
                                   b->buf[MOE_BUF_X], b->ld[MOE_BUF_X], b->n, k, sel_e, b->act,
                                   b->ld_act, b->scratch, fold ? &rt : NULL, fill, b->d.nexp,
                                   rs, tc, b->st));
    mark(b, "down");
    LAUNCH(b, "expert down",
           moe_cuda_expert_down(cl->down_type, cl->down, b->d.ff, b->d.E, b->act, b->ld_act, b->n,
                                k, sel_e, b->buf[MOE_BUF_SEL_W], b->buf[MOE_BUF_H],
                                b->ld[MOE_BUF_H], fill ? fill + 2 * b->d.nexp : NULL, tc,
                                b->st));
    return 0;
}

/* Every layer of a one-token step in the fused kernel (fused.cuh), when fused_setup() found
 * the model and configuration fit for it. */
static int cuda_layers(struct moe_backend *bb)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    TRY_CU(flush_pending(b));
    if (!b->fused || b->n != 1 || b->record)
        return 0;
    if (b->mode == MODE_REPLAY)
        return 1;
    mark(b, "layers");
    LAUNCH(b, "fused layers",
           moe_cuda_fused_launch(&b->fargs, b->fused_blocks, b->fused_per_sm, b->fused_smem,
                                 b->fused_coop, b->st));
    return 1;
}

/* MOE_CUDA_FUSED_TIMING: the phase stamps of the step that just ran, added up (the step has
 * synchronised). */
static void fused_collect(struct cuda_backend *b)
{
    if (!b->fused_timing || b->n != 1)
        return;
    const size_t n = (size_t)b->d.L * FUSED_NPH + 1;
    if (cudaMemcpy(b->h_fused_timing, b->fused_timing, sizeof(uint64_t) * n,
                   cudaMemcpyDeviceToHost) != cudaSuccess)
        return;
    uint64_t prev = b->h_fused_timing[n - 1];
    for (int64_t l = 0; l < b->d.L; l++)
        for (int p = 0; p < FUSED_NPH; p++) {
            const uint64_t t = b->h_fused_timing[l * FUSED_NPH + p];
            if (!t)
                continue; /* a phase that ends with the next one */
            b->fused_ph_ns[p] += (double)(t - prev);
            prev = t;
        }
    b->fused_steps++;
}

/* Output norm and head for rows [r0, r0+cnt) of out_row into b->logits. */
static int head_rows(struct cuda_backend *b, int64_t r0, int64_t cnt)
{
    const int64_t ldxo = pad4(b->d.E);
    LAUNCH(b, "output norm",
           moe_cuda_rmsnorm(b->buf[MOE_BUF_H], b->ld[MOE_BUF_H], D_OUTROW(b) + r0, b->out_norm,
                            b->d.E, b->d.eps, cnt, b->xo, ldxo, b->st));
    if ((b->tc & MOE_CUDA_TC_HEAD) && tc_matrix(b->m->output.type, b->d.E, b->output)) {
        LAUNCH(b, "output (tensor cores)",
               moe_cuda_matvec_tc_ws(b->m->output.type, b->output, b->d.E, b->d.V, b->xo, ldxo,
                                     cnt, b->logits, b->d.V, b->tc_ws, b->tc_ws_bytes, b->st));
        return 0;
    }
    LAUNCH(b, "output",
           moe_cuda_matvec_tok(b->m->output.type, b->output, b->d.E, b->d.V, b->xo, ldxo, cnt,
                               b->logits, b->d.V, 0, b->st));
    return 0;
}

static int cuda_head(struct moe_backend *bb)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    SKIP_IF_REPLAY(b);
    TRY_CU(flush_pending(b));
    if (b->n_out == 0)
        return 0;
    if (b->n_out > LOGIT_ROWS && !b->sample) {
        b->head_chunked = true; /* done pass by pass in end(), each copied out */
        return 0;
    }
    /* Sampled steps of more rows than the logits buffer holds (direct launches only) go pass by
     * pass here: each pass's draws finish before the next pass reuses the buffer (one stream). */
    for (int64_t r0 = 0; r0 < b->n_out; r0 += LOGIT_ROWS) {
        const int64_t cnt = b->n_out - r0 < LOGIT_ROWS ? b->n_out - r0 : LOGIT_ROWS;
        int rc = head_rows(b, r0, cnt);
        if (rc || !b->sample)
            return rc;
        if (b->bias_step)
            LAUNCH(b, "logit bias",
                   moe_cuda_logit_bias(b->logits, b->d.V, cnt, D_SMPROW(b) + r0, b->d_btok,
                                       b->d_bval, b->d_bn, MOE_BACKEND_MAX_BIAS, b->st));
        mark(b, "sample");
        LAUNCH(b, "sample",
               moe_cuda_sample_rows(b->smp, b->logits, (uint32_t)cnt, D_SMPROW(b) + r0,
                                    b->d_tok + r0, NULL, 1, b->spread, b->st));
    }
    return 0;
}

static int end_step(struct cuda_backend *b, float *out, int32_t *tokens, int qslot);

static int cuda_end(struct moe_backend *bb, float *out, int32_t *tokens)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    const int rc = end_step(b, out, tokens, -1);
    /* A step that failed on its way may have left prefetch copies queued: they end before the
     * next step's resolves can give their slots away. */
    if (rc)
        side_streams_wait(b);
    return pool_step_end(b, rc);
}

/* qslot >= 0 (cuda_submit): the step's tokens are copied into the queue's slot qslot and the
 * step is left running. */
static int end_step(struct cuda_backend *b, float *out, int32_t *tokens, int qslot)
{
    if (b->mode != MODE_REPLAY)
        mark(b, "end");
    TRY_CU(flush_pending(b));
    if (b->mode != MODE_REPLAY)
        TRY_CU(before_write(b, MOE_BUF_X)); /* every fork joined before the capture ends */
    if (b->mode == MODE_CAPTURE) {
        cudaGraph_t g;
        b->capturing = false;
        CU(b, cudaStreamEndCapture(b->st, &g));
        if (b->n == 1 && b->n_out == 1 && !b->record) {
            size_t nn = 0;
            if (cudaGraphGetNodes(g, NULL, &nn) == cudaSuccess)
                b->nodes_b1 = nn;
        }
        cudaGraphExec_t exec;
        cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
        cudaGraphDestroy(g);
        if (e != cudaSuccess)
            return cu_err(b, MOE_EBACKEND, "cuda:%d: cudaGraphInstantiate: %s", b->dev,
                          cudaGetErrorString(e));
        struct cuda_graph cg = {b->n,      b->n_out,    b->sample, b->spread, b->stage_step,
                                b->record, b->bias_step, exec,    0,         NULL};
        if (b->profile && (cg.ev_name = (const char **)malloc(sizeof(char *) * (size_t)b->n_ev))) {
            cg.n_ev = b->n_ev;
            memcpy(cg.ev_name, b->ev_name, sizeof(char *) * (size_t)b->n_ev);
        }
        b->graphs[b->n_graphs++] = cg;
        b->mode = MODE_REPLAY;
    }
    if (b->mode == MODE_REPLAY) {
        cudaGraphExec_t exec = NULL;
        for (int i = 0; i < b->n_graphs; i++)
            if (b->graphs[i].n == b->n && b->graphs[i].n_out == b->n_out &&
                b->graphs[i].sample == b->sample && b->graphs[i].spread == b->spread &&
                b->graphs[i].stage == b->stage_step && b->graphs[i].record == b->record &&
                b->graphs[i].bias == b->bias_step) {
                exec = b->graphs[i].exec;
                b->n_ev = b->graphs[i].n_ev;
                if (b->n_ev)
                    memcpy(b->ev_name, b->graphs[i].ev_name, sizeof(char *) * (size_t)b->n_ev);
            }
        CU(b, cudaGraphLaunch(exec, b->st));
    }
    if (b->record)
        CU(b, cudaMemcpyAsync(b->h_route_hist, b->d_route_hist,
                              sizeof(int32_t) * (size_t)(b->d.L * b->n * b->d.kuse),
                              cudaMemcpyDeviceToHost, b->st));
    if (b->sample) {
        /* Only the tokens come back (logits too if asked: after the penalties). */
        if (!tokens && qslot < 0)
            return cu_err(b, MOE_ERANGE, "end: sampling but no token array");
        int32_t *ht = b->h_tok + (size_t)(qslot + 1) * b->d.n_batch;
        CU(b, cudaMemcpyAsync(ht, b->d_tok, sizeof(int32_t) * (size_t)b->n_out,
                              cudaMemcpyDeviceToHost, b->st));
        if (qslot >= 0) {
            CU(b, cudaEventRecord(b->q_ev[qslot], b->st));
            b->st_open = b->st_prev = false; /* no step times between queued steps */
            return 0;
        }
        if (out && b->n_out > LOGIT_ROWS)
            return cu_err(b, MOE_ERANGE, "end: logits of more than %d sampled rows", LOGIT_ROWS);
        if (out)
            CU(b, cudaMemcpyAsync(b->h_logits, b->logits,
                                  sizeof(float) * (size_t)b->d.V * (size_t)b->n_out,
                                  cudaMemcpyDeviceToHost, b->st));
        if (b->st_open)
            CU(b, cudaEventRecord(b->st_ev[2], b->st));
        CU(b, cudaStreamSynchronize(b->st));
        if (b->st_open) {
            float ms = 0.0f;
            if (cudaEventElapsedTime(&ms, b->st_ev[b->st_cur], b->st_ev[2]) == cudaSuccess) {
                b->st_busy_ms += ms;
                b->st_n++;
            }
            if (b->st_prev &&
                cudaEventElapsedTime(&ms, b->st_ev[b->st_cur ^ 1], b->st_ev[b->st_cur]) ==
                    cudaSuccess) {
                b->st_period_ms += ms;
                b->st_np++;
            }
            b->st_prev = true;
            b->st_cur ^= 1;
            b->st_open = false;
        }
        memcpy(tokens, b->h_tok, sizeof(int32_t) * (size_t)b->n_out);
        if (out)
            memcpy(out, b->h_logits, sizeof(float) * (size_t)b->d.V * (size_t)b->n_out);
        prof_collect(b);
        fused_collect(b);
        return 0;
    }
    if (b->n_out && !out)
        return cu_err(b, MOE_ERANGE, "end: %lld logit rows but no output array",
                      (long long)b->n_out);
    const size_t V = (size_t)b->d.V;
    for (int64_t r0 = 0; r0 < b->n_out; r0 += LOGIT_ROWS) {
        int64_t cnt = b->n_out - r0 < LOGIT_ROWS ? b->n_out - r0 : LOGIT_ROWS;
        if (b->head_chunked) {
            int rc = head_rows(b, r0, cnt);
            if (rc)
                return rc;
        }
        CU(b, cudaMemcpyAsync(b->h_logits, b->logits, sizeof(float) * V * (size_t)cnt,
                              cudaMemcpyDeviceToHost, b->st));
        CU(b, cudaStreamSynchronize(b->st));
        memcpy(out + (size_t)r0 * V, b->h_logits, sizeof(float) * V * (size_t)cnt);
    }
    CU(b, cudaStreamSynchronize(b->st));
    prof_collect(b);
    fused_collect(b);
    return 0;
}


/* Decode ahead (backend.h): a sampling step without logits, graph or direct launches, left
 * running with its tokens' copy and an event after it queued; steps that need the host at
 * their end (an expert pool's service, profiling, recorded routes) run to their end here
 * instead, and collect returns what they drew. */
static int cuda_submit(struct moe_backend *bb)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    if (b->q_len >= 2)
        return cu_err(b, MOE_ERANGE, "submit: two steps are queued already");
    const int qs = (b->q_head + b->q_len) % 2;
    const bool run_here = !b->sample || b->record || b->n_out > LOGIT_ROWS || b->head_chunked ||
                          b->svc_started || b->profile || b->fused_timing;
    int rc;
    if (run_here) {
        rc = cuda_end(bb, NULL, b->h_tok + (size_t)(qs + 1) * b->d.n_batch);
    } else {
        rc = end_step(b, NULL, NULL, qs);
        if (rc)
            side_streams_wait(b);
        rc = pool_step_end(b, rc);
    }
    if (rc)
        return rc;
    b->q_sync[qs] = run_here;
    b->q_n[qs] = b->n_out;
    b->q_len++;
    return 0;
}

static int cuda_collect(struct moe_backend *bb, int32_t *tokens)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    if (b->q_len == 0)
        return cu_err(b, MOE_ERANGE, "collect: no queued step");
    const int qs = b->q_head;
    b->q_head = (b->q_head + 1) % 2;
    b->q_len--;
    if (!b->q_sync[qs]) {
        const cudaError_t e = cudaEventSynchronize(b->q_ev[qs]);
        if (e != cudaSuccess) {
            b->q_len = 0; /* what came after it is lost with it */
            return cu_err(b, MOE_EBACKEND, "cuda:%d: a queued step: %s", b->dev,
                          cudaGetErrorString(e));
        }
    }
    memcpy(tokens, b->h_tok + (size_t)(qs + 1) * b->d.n_batch, sizeof(int32_t) * (size_t)b->q_n[qs]);
    return 0;
}

static int cuda_bias(struct moe_backend *bb, int32_t seq, const int32_t *tok, const float *val,
                     size_t n)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    if (seq < 0 || (uint32_t)seq >= b->d.n_seq || n > MOE_BACKEND_MAX_BIAS)
        return cu_err(b, MOE_ERANGE, "bias: sequence %d, %zu entries", seq, n);
    if (!b->h_bn) {
        if (n == 0)
            return 0; /* nothing set anywhere yet */
        const size_t ns = b->d.n_seq, cap = MOE_BACKEND_MAX_BIAS;
        if (!b->d_btok)
            CU(b, cudaMalloc((void **)&b->d_btok, sizeof(int32_t) * ns * cap));
        if (!b->d_bval)
            CU(b, cudaMalloc((void **)&b->d_bval, sizeof(float) * ns * cap));
        if (!b->d_bn)
            CU(b, cudaMalloc((void **)&b->d_bn, sizeof(int32_t) * ns));
        CU(b, cudaMemsetAsync(b->d_bn, 0, sizeof(int32_t) * ns, b->st));
        if (!(b->h_bn = (int32_t *)calloc(ns, sizeof *b->h_bn)))
            return cu_err(b, -ENOMEM, "bias: out of memory");
    }
    const size_t off = (size_t)seq * MOE_BACKEND_MAX_BIAS;
    const int32_t cnt = (int32_t)n;
    if (n) {
        CU(b, cudaMemcpyAsync(b->d_btok + off, tok, sizeof(int32_t) * n, cudaMemcpyHostToDevice,
                              b->st));
        CU(b, cudaMemcpyAsync(b->d_bval + off, val, sizeof(float) * n, cudaMemcpyHostToDevice,
                              b->st));
    }
    CU(b, cudaMemcpyAsync(b->d_bn + seq, &cnt, sizeof cnt, cudaMemcpyHostToDevice, b->st));
    CU(b, cudaStreamSynchronize(b->st)); /* the host arrays may go on return */
    b->h_bn[seq] = cnt;
    return 0;
}

static int cuda_kv_copy(struct moe_backend *bb, int32_t src, int32_t dst, uint32_t n)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    if (src < 0 || dst < 0 || (uint32_t)src >= b->d.n_seq || (uint32_t)dst >= b->d.n_seq ||
        n > b->d.n_ctx)
        return cu_err(b, MOE_ERANGE, "kv copy: sequences %d -> %d, %u positions", src, dst, n);
    if (src == dst || n == 0)
        return 0;
    /* Per layer, the Hkv rows of positions 0..n-1 of each sequence, n_ctx positions apart. */
    const size_t es = b->kv.f32 ? 4 : 2;
    const struct { void *base; int64_t w; } parts[2] = {{b->kv.k, b->d.hd}, {b->kv.v, b->d.hdv}};
    for (int i = 0; i < 2; i++) {
        const size_t pitch = (size_t)b->d.n_ctx * (size_t)parts[i].w * es;
        for (int l = 0; l < (int)b->d.L; l++) {
            const size_t o_src = (((size_t)l * b->d.n_seq + (size_t)src) * (size_t)b->d.Hkv) * pitch;
            const size_t o_dst = (((size_t)l * b->d.n_seq + (size_t)dst) * (size_t)b->d.Hkv) * pitch;
            CU(b, cudaMemcpy2DAsync((uint8_t *)parts[i].base + o_dst, pitch,
                                    (const uint8_t *)parts[i].base + o_src, pitch,
                                    (size_t)n * (size_t)parts[i].w * es, (size_t)b->d.Hkv,
                                    cudaMemcpyDeviceToDevice, b->st));
        }
    }
    return 0;
}

static int cuda_sampler(struct moe_backend *bb, int32_t seq, const struct moe_sampler_params *p,
                        const int32_t *history, size_t n_history)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    if (seq < 0 || (uint32_t)seq >= b->d.n_seq)
        return cu_err(b, MOE_ERANGE, "sampler: sequence %d", seq);
    int rc;
    if (!b->smp &&
        (rc = moe_cuda_sampler_init(&b->smp, b->d.n_seq, (uint32_t)b->d.V, SAMPLER_HISTORY, 0,
                                    b->errmsg, sizeof b->errmsg)))
        return rc;
    if ((rc = moe_cuda_sampler_set_row(b->smp, (uint32_t)seq, p, b->st, b->errmsg,
                                       sizeof b->errmsg)))
        return rc;
    if ((rc = moe_cuda_sampler_set_history(b->smp, (uint32_t)seq, history, n_history, b->st)))
        return cu_err(b, rc, "cuda:%d: sampler history: %s", b->dev, moe_strerror(rc));
    return 0;
}

static int cuda_routing_counts(struct moe_backend *bb, uint64_t *dst)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    static_assert(sizeof(unsigned long long) == sizeof(uint64_t), "counter width");
    CU(b, cudaStreamSynchronize(b->st));
    CU(b, cudaMemcpy(dst, b->counts, sizeof(uint64_t) * (size_t)(b->d.L * b->d.nexp),
                     cudaMemcpyDeviceToHost));
    return 0;
}

static int cuda_route_record(struct moe_backend *bb, int32_t *dst)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    if (!b->record)
        return cu_err(b, MOE_ERANGE, "route_record: the last step did not record");
    /* end() synchronised after the copy to the host. */
    memcpy(dst, b->h_route_hist, sizeof(int32_t) * (size_t)(b->d.L * b->n * b->d.kuse));
    return 0;
}

/* The pinned experts from the host mirror of the offload state: pinned slots change only in
 * init and set_hot (the device's resolve never pins nor evicts a pinned slot), both of which
 * leave the mirror as the device has it. */
static int cuda_hot_experts(struct moe_backend *bb, uint8_t *bits)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    if (!b->offload)
        return 0;
    const int64_t ne = b->d.nexp;
    memset(bits, 0, (size_t)(b->d.L * ne + 7) / 8);
    for (int64_t l = 0; l < b->d.L; l++) {
        const struct cuda_layer *cl = &b->layers[l];
        if (cl->slots >= ne) {
            for (int64_t x = 0; x < ne; x++)
                bits[(l * ne + x) / 8] |= (uint8_t)(1u << ((l * ne + x) % 8));
            continue;
        }
        const int32_t *slot_exp = (const int32_t *)host_view(b, b->h_off[l].slot_exp);
        const uint8_t *pinned = (const uint8_t *)host_view(b, b->h_off[l].pinned);
        for (int32_t sl = 0; sl < cl->slots; sl++)
            if (pinned[sl] && slot_exp[sl] >= 0 && slot_exp[sl] < ne) {
                const int64_t i = l * ne + slot_exp[sl];
                bits[i / 8] |= (uint8_t)(1u << (i % 8));
            }
    }
    return 1;
}

static int cuda_read_buf(struct moe_backend *bb, enum moe_buf buf, int64_t n, void *dst)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    if ((int)buf < 0 || buf >= MOE_BUF_COUNT || n < 0 || n > (int64_t)b->d.n_batch)
        return cu_err(b, MOE_ERANGE, "read_buf: bad buffer or row count");
    TRY_CU(flush_pending(b));

    int64_t w = moe_buf_width(&b->d, buf);
    CU(b, cudaMemcpy2DAsync(dst, sizeof(float) * (size_t)w, b->buf[buf],
                            sizeof(float) * (size_t)b->ld[buf], sizeof(float) * (size_t)w,
                            (size_t)n, cudaMemcpyDeviceToHost, b->st));
    CU(b, cudaStreamSynchronize(b->st));
    return 0;
}

static int cuda_write_buf(struct moe_backend *bb, enum moe_buf buf, int64_t n, const void *src)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    if ((int)buf < 0 || buf >= MOE_BUF_COUNT || n < 0 || n > (int64_t)b->d.n_batch)
        return cu_err(b, MOE_ERANGE, "write_buf: bad buffer or row count");
    TRY_CU(flush_pending(b));
    TRY_CU(before_write(b, buf));

    int64_t w = moe_buf_width(&b->d, buf);
    CU(b, cudaMemcpy2DAsync(b->buf[buf], sizeof(float) * (size_t)b->ld[buf], src,
                            sizeof(float) * (size_t)w, sizeof(float) * (size_t)w, (size_t)n,
                            cudaMemcpyHostToDevice, b->st));
    CU(b, cudaStreamSynchronize(b->st));
    return 0;
}

static const char *cuda_errmsg(const struct moe_backend *bb)
{
    return ((const struct cuda_backend *)bb)->errmsg;
}

static void cuda_info(const struct moe_backend *bb, uint64_t *device_bytes, char *desc, size_t len)
{
    const struct cuda_backend *b = (const struct cuda_backend *)bb;
    *device_bytes = b->dev_bytes;
    if (b->nodes_b1)
        snprintf(desc, len, "%s, %zu graph nodes per 1-token step%s", b->desc, b->nodes_b1,
                 b->branch_pdl_edges ? " (branches forked by programmatic edges)" : "");
    else
        snprintf(desc, len, "%s", b->desc);
}

/* Re-pins every offloaded layer between steps: its pinned slots go to its most-routed experts by
 * counts ([L][nexp]; experts never routed are not pinned), as many as the cache rule with a
 * profile leaves pinned. The state is read back and changed by moe_off_repin for every layer
 * first; with a tiered store every expert to load is then asked for at once (read ahead, so the
 * daemon's reads overlap); then the moved experts are copied into their slots, the tables
 * repointed and the state written back. At most max_loads experts are copied per call; *pending
 * says how many wait for the next call. An expert a tiered store cannot give undoes its load and
 * the later ones (each slot keeps the expert it held, as cache; the error is returned and the
 * state stays consistent). A CUDA error is MOE_EBACKEND: the device state is not to be trusted
 * (the worker stops). */
struct repin_load {
    int32_t l;
    struct moe_off_load ld;
};

/* Undoes loads[from..n) of the host mirror's state, last first. */
static void repin_undo(struct cuda_backend *b, const struct repin_load *loads, int32_t from,
                       int32_t n)
{
    for (int32_t j = n - 1; j >= from; j--) {
        const struct moe_cuda_off_layer *o = &b->h_off[loads[j].l];
        const struct moe_off_load *u = &loads[j].ld;
        int32_t *slot_of = (int32_t *)host_view(b, o->slot_of),
                *slot_exp = (int32_t *)host_view(b, o->slot_exp);
        uint8_t *pinned = (uint8_t *)host_view(b, o->pinned);
        slot_of[u->x] = MOE_OFF_HOST;
        slot_exp[u->s] = u->old;
        if (u->old >= 0)
            slot_of[u->old] = u->s;
        pinned[u->s] = 0;
    }
}

static int cuda_set_hot(struct moe_backend *bb, const uint64_t *counts, uint32_t max_loads,
                        uint32_t *pending)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    const struct moe_dims *d = &b->d;
    const int64_t ne = d->nexp;
    *pending = 0;
    if (!b->offload)
        return 0;
    CU(b, cudaStreamSynchronize(b->st));
    CU(b, cudaMemcpy(b->h_offmem, b->d_offmem, b->offmem_bytes, cudaMemcpyDeviceToHost));
    const int32_t cap = (int32_t)(max_loads < (uint32_t)INT32_MAX ? max_loads : INT32_MAX);
    const size_t ncap = (size_t)(cap < (int64_t)d->L * ne ? cap : (int64_t)d->L * ne);
    int32_t *want = (int32_t *)malloc(sizeof(int32_t) * (size_t)ne);
    uint8_t *scratch = (uint8_t *)malloc((size_t)ne);
    struct moe_off_load *ll = (struct moe_off_load *)malloc(sizeof *ll * (size_t)ne);
    struct repin_load *loads = (struct repin_load *)malloc(sizeof *loads * (ncap ? ncap : 1));
    int32_t *ids = (int32_t *)malloc(sizeof(int32_t) * (ncap ? ncap : 1));
    int rc = 0;
    if (!want || !scratch || !ll || !loads || !ids)
        rc = -ENOMEM;
    int32_t left = cap, n = 0;
    /* Plan: every layer's moves, in the host mirror. */
    for (int l = 0; l < (int)d->L && !rc; l++) {
        struct cuda_layer *cl = &b->layers[l];
        const struct moe_cuda_off_layer *o = &b->h_off[l];
        if (cl->slots >= ne)
            continue;
        /* On a link where copies lose (link_check) every slot stays pinned. */
        const int64_t P = cl->slots - (b->link_slow ? 0 : cache_slots_for(d, cl->slots, true));
        const uint64_t *c = counts + (size_t)l * ne;
        int32_t nw = 0;
        for (int64_t x = 0; x < ne; x++) { /* insertion by count, stable */
            if (!c[x])
                continue;
            int32_t j = nw++;
            while (j > 0 && c[want[j - 1]] < c[x]) {
                want[j] = want[j - 1];
                j--;
            }
            want[j] = (int32_t)x;
        }
        if (nw > P)
            nw = (int32_t)P;
        int32_t *slot_of = (int32_t *)host_view(b, o->slot_of),
                *slot_exp = (int32_t *)host_view(b, o->slot_exp);
        uint8_t *pinned = (uint8_t *)host_view(b, o->pinned), *ref = (uint8_t *)host_view(b, o->ref);
        int32_t nl = 0;
        *pending += (uint32_t)moe_off_repin((int32_t)ne, cl->slots, slot_of, slot_exp, pinned, ref,
                                            want, nw, left, ll, &nl, scratch);
        left -= nl;
        for (int32_t i = 0; i < nl; i++)
            loads[n++] = (struct repin_load){l, ll[i]};
    }
    /* A tiered store: every expert to load asked for now, layer by layer, without waiting. */
    if (!rc && b->xsrc && b->xsrc->prefetch) {
        pthread_mutex_lock(&b->pool_mu);
        for (int32_t i = 0; i < n;) {
            int32_t k = 0, j = i;
            for (; j < n && loads[j].l == loads[i].l; j++)
                ids[k++] = loads[j].ld.x;
            b->xsrc->prefetch(b->xsrc->user, loads[i].l, ids, k);
            i = j;
        }
        pthread_mutex_unlock(&b->pool_mu);
    }
    /* Copy: each moved expert into its slot, the tables repointed. */
    bool pool_failed = false; /* a tiered store's expert could not be had: the rest undone */
    for (int32_t i = 0; i < n && !rc; i++) {
        const int l = loads[i].l;
        struct cuda_layer *cl = &b->layers[l];
        const struct moe_off_load *ld = &loads[i].ld;
        const struct moe_expert *ex = &b->m->layers[l].experts[ld->x];
        ((uint8_t *)host_view(b, b->h_off[l].pf))[ld->s] = 0; /* a loaded slot holds no prefetch */
        bool got = true;
        /* A tiered store's expert comes from the pool (asked of the daemon when it is not
         * there: between steps, the worker's connection runs). */
        if (b->xsrc && (rc = pool_copy_expert(b, l, ld->x,
                                              cl->base + (size_t)ld->s * cl->slot_bytes,
                                              MOE_PIN_WAIT, &got)) != 0) {
            if (rc != MOE_EBACKEND) {
                /* Nothing of this load and the later ones reached the device. */
                repin_undo(b, loads, i, n);
                *pending += (uint32_t)(n - i);
                pool_failed = true;
            }
            break;
        }
        const void **tabs[3] = {cl->gate, cl->up, cl->down};
        for (int p = 0; p < 3 && !rc; p++) {
            const struct moe_tensor *t = expert_part(ex, p);
            uint8_t *at = cl->base + (size_t)ld->s * cl->slot_bytes + cl->part_off[p];
            const void *old_ptr = ld->old >= 0 ? cl->host[p][ld->old] : NULL;
            cudaError_t e = b->xsrc ? cudaSuccess
                                    : cudaMemcpy(at, t->data, t->nbytes, cudaMemcpyHostToDevice);
            if (e == cudaSuccess && ld->old >= 0)
                e = cudaMemcpy((void *)(tabs[p] + ld->old), &old_ptr, sizeof old_ptr,
                               cudaMemcpyHostToDevice);
            const void *new_ptr = at;
            if (e == cudaSuccess)
                e = cudaMemcpy((void *)(tabs[p] + ld->x), &new_ptr, sizeof new_ptr,
                               cudaMemcpyHostToDevice);
            if (e != cudaSuccess)
                rc = cu_err(b, MOE_EBACKEND, "cuda:%d: re-pinning blk.%d expert %d: %s",
                            b->dev, l, ld->x, cudaGetErrorString(e));
        }
    }
    for (int l = 0; l < (int)d->L && (!rc || pool_failed); l++) {
        struct cuda_layer *cl = &b->layers[l];
        if (cl->slots >= ne)
            continue;
        const struct moe_cuda_off_layer *o = &b->h_off[l];
        const int32_t *slot_exp = (const int32_t *)host_view(b, o->slot_exp);
        uint8_t *pinned = (uint8_t *)host_view(b, o->pinned);
        int32_t hot = 0;
        for (int32_t sl = 0; sl < cl->slots; sl++) {
            if (d->cache_slots < 0 && slot_exp[sl] >= 0)
                pinned[sl] = 1; /* no cache: every filled slot stays pinned */
            hot += pinned[sl] != 0;
        }
        cl->hot = hot;
    }
    free(want);
    free(scratch);
    free(ll);
    free(loads);
    free(ids);
    if (rc && !pool_failed)
        return rc;
    CU(b, cudaMemcpy(b->d_offmem, b->h_offmem, b->offmem_bytes, cudaMemcpyHostToDevice));
    return rc;
}

static int cuda_offload_stats(struct moe_backend *bb, struct moe_offload_stats *s,
                              struct moe_offload_layer *per_layer)
{
    struct cuda_backend *b = (struct cuda_backend *)bb;
    const size_t L = (size_t)b->d.L;
    s->active = b->offload;
    s->expert_bytes = b->expert_bytes;
    s->expert_vram_bytes = b->expert_vram;
    s->budget = b->d.vram_budget;
    s->stage_experts = (uint32_t)b->stage_cap;
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess)
        s->device_bytes_now = (uint64_t)(tot - fr);
    unsigned long long *st = NULL;
    if (b->offload) {
        st = (unsigned long long *)calloc(L * MOE_OFF_NSTATS, sizeof *st);
        if (!st)
            return -ENOMEM;
        cudaError_t e = cudaStreamSynchronize(b->st);
        if (e == cudaSuccess)
            e = cudaMemcpy(st, b->d_offstats, sizeof *st * L * MOE_OFF_NSTATS,
                           cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) {
            free(st);
            return cu_err(b, MOE_EBACKEND, "cuda:%d: reading the offload counters: %s", b->dev,
                          cudaGetErrorString(e));
        }
    }
    for (size_t l = 0; l < L; l++) {
        const unsigned long long *c = st ? st + l * MOE_OFF_NSTATS : NULL;
        struct moe_offload_layer x = {};
        x.slots = (uint32_t)b->layers[l].slots;
        x.hot = (uint32_t)b->layers[l].hot;
        if (c) {
            x.hits = c[MOE_OFF_HITS];
            x.misses = c[MOE_OFF_MISSES];
            x.fill_bytes = c[MOE_OFF_FILL_BYTES];
            x.direct = c[MOE_OFF_DIRECT];
            s->direct_bytes += c[MOE_OFF_DIRECT_BYTES];
            s->prefetched += c[MOE_OFF_PREFETCH];
            s->prefetch_bytes += c[MOE_OFF_PREFETCH_BYTES];
            s->staged += c[MOE_OFF_STAGED];
            s->stage_bytes += c[MOE_OFF_STAGE_BYTES];
            s->stage_reads += c[MOE_OFF_STAGE_READS];
            s->prefetch_used += c[MOE_OFF_PF_USED];
            s->prefetch_used_bytes += c[MOE_OFF_PF_USED_BYTES];
            s->prefetch_wasted += c[MOE_OFF_PF_WASTED];
        }
        s->hits += x.hits;
        s->misses += x.misses;
        s->fill_bytes += x.fill_bytes;
        s->direct += x.direct;
        if (per_layer)
            per_layer[l] = x;
    }
    free(st);
    return 0;
}

extern "C" const struct moe_backend_vt moe_backend_cuda = {
    "cuda",
    cuda_supports,
    cuda_init,
    cuda_free,
    cuda_begin,
    cuda_embed,
    cuda_rmsnorm,
    cuda_matmul,
    cuda_qk_rope_kv,
    cuda_attention,
    cuda_route,
    cuda_experts,
    cuda_head,
    cuda_end,
    cuda_sampler,
    cuda_kv_copy,
    cuda_routing_counts,
    cuda_read_buf,
    cuda_write_buf,
    cuda_errmsg,
    cuda_info,
    cuda_offload_stats,
    cuda_set_hot,
    cuda_layers,
    cuda_route_record,
    cuda_hot_experts,
    cuda_submit,
    cuda_collect,
    cuda_bias,
};

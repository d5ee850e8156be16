/* The model forward pass, backend-neutral entry points.
 *
 * An engine owns the KV cache for up to n_seq concurrent sequences and all scratch memory.
 * One call of moe_engine_forward() evaluates a batch of tokens that may mix sequences and
 * positions (prefill of one prompt, or one decode token for each of several sequences). */
#ifndef MOE_ENGINE_H
#define MOE_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store/model.h"
#include "worker/sampler.h"

struct moe_engine;

/* Where the CPU backend finds routed experts whose place in memory changes (a tiered store,
 * docs/store.md). Between a layer's routing and its expert products the backend asks for the
 * experts the router chose, at most max_pinned at a time, computes with them and gives them
 * back; the results are the same as with fixed views. */
/* What moe_expert_src.pin does with an expert that is not in the pool. */
enum {
    MOE_PIN_PRESENT,   /* nothing: slot -1 (never blocks, sends nothing) */
    MOE_PIN_READAHEAD, /* slot -1 and a read-ahead asked for (never blocks) */
    MOE_PIN_WAIT,      /* asked for and waited for (may block on a disk read) */
};

struct moe_expert_src {
    /* Makes experts ids[0..n) of layer l readable and fills views[i] (gate/up/down with the
     * model's types and shapes). May block (a disk read). Returns 0 or an error that fails the
     * step, with a message in err. */
    int (*acquire)(void *user, int layer, const int32_t *ids, int n, struct moe_expert *views,
                   char *err, size_t errlen);
    /* Layer l is done with them. */
    void (*release)(void *user, int layer, const int32_t *ids, int n);
    /* Optional: the experts the next layer will probably choose (its router applied to this
     * layer's input), so that they can be read ahead. Never blocks. */
    void (*prefetch)(void *user, int layer, const int32_t *ids, int n);
    int max_pinned;      /* >= 1 */
    void *user;
    /* Device backends (CUDA), which read pinned experts in place from the pool's slots; NULL
     * where the source has no pool of slots. pin: the slots of experts ids[0..n) of layer l,
     * pinned for this worker, into slots[i]; those not in the pool: `how` (MOE_PIN_*). Returns
     * 0 or an error that fails the step, with a message in err; on an error nothing stays
     * pinned. unpin: lets go of slots[0..n) (-1 entries skipped); layer is the one they were
     * pinned for. Both may be called from any one thread at a time. */
    int (*pin)(void *user, int layer, const int32_t *ids, int n, int how, int32_t *slots,
               char *err, size_t errlen);
    void (*unpin)(void *user, int layer, const int32_t *slots, int n);
    const uint8_t *slots_base;  /* slot s at slots_base + s * slot_bytes (the worker's mapping) */
    uint64_t slot_bytes;
    uint32_t n_slots;
    const uint64_t *part_off;   /* [n_layer][3]: gate, up and down inside a layer's blob */
};

struct moe_engine_opts {
    uint32_t n_ctx;      /* KV cache positions per sequence */
    uint32_t n_seq;      /* concurrent sequences */
    uint32_t n_batch;    /* most tokens per step (longer batches are split) */
    int n_threads;       /* CPU threads; 0: all cores */
    const char *device;  /* "cpu" (NULL: cpu) or "cuda:K" */
    bool kv_f32;         /* CUDA: float32 KV cache instead of f16 */
    /* CUDA expert offload (docs/offload.md). Experts that do not get a VRAM slot are read from
     * host memory inside the step, so the output does not depend on these settings. */
    uint64_t vram_budget;          /* device bytes the engine may hold in all; 0: no budget;
                                    * MOE_VRAM_AUTO (store/units.h): the device's memory minus a
                                    * margin (max(512 MiB, 1/32 of it)) */
    double expert_residency;       /* share (0, 1] of each layer's experts given VRAM slots;
                                    * 0: as vram_budget allows (all without a budget) */
    int32_t cache_slots;           /* cache ring slots per layer; 0: auto; -1: no ring */
    const uint64_t *expert_counts; /* [n_layer][n_expert] routing counts the hot set follows
                                    * (most-used first; read by init only); NULL: expert order */
    bool host_register;            /* the experts live in shared memory (the daemon's store) that
                                    * the GPU may map; else experts outside VRAM are read from a
                                    * pinned copy */
    bool no_prefetch;              /* no layer-ahead prefetch of predicted experts */
    const struct moe_expert_src *expert_src; /* NULL: the model's views are fixed; CUDA needs
                                              * its pin / unpin (a pool of slots) */
    bool record_routes;            /* batches may ask for routing signatures (moe_batch.sig) */
};

struct moe_batch {
    uint32_t n;
    const int32_t *token;      /* [n] */
    const int32_t *pos;        /* [n] position within its sequence */
    const int32_t *seq;        /* [n] sequence slot, < n_seq */
    const uint8_t *logits;     /* [n] nonzero: write logits for this token; NULL: all tokens */
    /* Routing signatures (needs opts.record_routes): [n] or NULL; sig[i] NULL, or an
     * [n_layer][n_expert] array to which token i adds one for each expert it chooses in each
     * layer. Several tokens may share an array (a sequence's prompt chunk). A step holding no
     * such token records nothing, so decode steps cost nothing more. */
    uint32_t *const *sig;
};

int moe_engine_init(struct moe_engine **out, const struct moe_model *m,
                    const struct moe_engine_opts *o, char *err, size_t errlen);
void moe_engine_free(struct moe_engine *e);

/* Evaluates the batch. Logits of the selected tokens are written in batch order to
 * out[k][n_vocab]. A token at pos p sees positions 0..p of its own sequence (earlier positions
 * must have been evaluated before or earlier in the same batch). Returns 0 or an error. */
int moe_engine_forward(struct moe_engine *e, const struct moe_batch *b, float *out);

/* Sampling inside the engine (on the GPU for a CUDA engine, so that a step returns token ids
 * only). Sets sequence seq's sampler: parameters, a generator seeded from p->seed and the
 * penalty history (e.g. the prompt's tokens). Call it again to reset. Returns 0 or an error
 * (bad parameters; on CUDA, penalty_last_n above 1024). */
int moe_engine_seq_sampler(struct moe_engine *e, int32_t seq, const struct moe_sampler_params *p,
                           const int32_t *history, size_t n_history);

/* Sets sequence seq's logit bias (after moe_engine_seq_sampler, which clears it): val[i] is
 * added to logit tok[i] of each row the sequence samples, before its penalties and its draw, as
 * a host sampler given the biased logits would see them. At most MOE_ENGINE_MAX_BIAS entries,
 * tokens distinct and in the vocabulary, values finite; n = 0 clears it. Returns 0, MOE_ERANGE
 * (nothing changed) or MOE_EUNSUPPORTED (the backend samples without it). */
#define MOE_ENGINE_MAX_BIAS 2048
int moe_engine_seq_bias(struct moe_engine *e, int32_t seq, const int32_t *tok, const float *val,
                        size_t n);

/* Like moe_engine_forward, but instead of logits each selected token's next token is drawn by
 * its sequence's sampler, written to tokens[k] in batch order (-1: every logit was NaN or
 * -inf) and added to the sampler's history. At most one selected token per sequence, each with
 * a sampler set; b->logits NULL selects every token (so then one token per sequence). */
int moe_engine_forward_sample(struct moe_engine *e, const struct moe_batch *b, int32_t *tokens);

/* Decode ahead: a sampling step queued before the tokens of the step before it are back, so
 * that the host's turn between steps (reading the tokens, sending them, building the next
 * batch) overlaps the device's work. A batch token MOE_ENGINE_TOKEN_NEXT stands for the token
 * that the engine's last step (forward_sample or submit_sample, nothing in between) drew for
 * that token's sequence, at the position after the drawing row's. */
#define MOE_ENGINE_AHEAD 2
#define MOE_ENGINE_TOKEN_NEXT (-2)

/* Queues a step as moe_engine_forward_sample would run it (at most n_batch tokens, no routing
 * signatures); its tokens come from moe_engine_collect. At most MOE_ENGINE_AHEAD steps are
 * queued. A backend that cannot queue (the CPU) runs the step here and collect returns its
 * tokens. The step's floats are forward_sample's. Returns 0 or an error (nothing queued). */
int moe_engine_submit_sample(struct moe_engine *e, const struct moe_batch *b);
/* Waits for the oldest queued step: its sampled tokens in batch order into tokens, their count
 * into *n (either may be NULL to drop them). Returns 0 or an error: nothing queued, or a device
 * failure (every queued step is then dropped). */
int moe_engine_collect(struct moe_engine *e, int32_t *tokens, uint32_t *n);
/* Steps queued and not yet collected. forward, forward_sample, seq_sampler, seq_copy and
 * set_hot refuse to run while any is. */
int moe_engine_queued(const struct moe_engine *e);

/* Forgets a sequence's cached positions. */
void moe_engine_seq_clear(struct moe_engine *e, int32_t seq);
/* Keeps only a sequence's first n cached positions (a shared prefix to continue from); the next
 * token of the sequence is then at position min(n, what it held). */
void moe_engine_seq_keep(struct moe_engine *e, int32_t seq, uint32_t n);

/* Copies sequence src's first n cached positions (at most what it holds) into sequence dst,
 * which then holds exactly those n: a shared prompt prefix evaluated once. Returns 0 or an error
 * (bad sequences or n, a device failure). */
int moe_engine_seq_copy(struct moe_engine *e, int32_t src, int32_t dst, uint32_t n);

/* Cumulative routing counts since init, [n_layer][n_expert] (one count per token and chosen
 * expert), copied to dst. Returns 0 or an error (a device failure). */
int moe_engine_routing_counts(struct moe_engine *e, uint64_t *dst);

/* The experts with a pinned device slot, [n_layer][n_expert] bits (LSB first; every expert of a
 * layer held whole), into bits (ceil(n_layer*n_expert/8) bytes). Returns 1 with the bits written
 * when the engine offloads experts, 0 (bits untouched) when every expert is where it computes,
 * or an error. Between steps. */
int moe_engine_hot_experts(struct moe_engine *e, uint8_t *bits);

/* Message for the last error of moe_engine_forward() ("batch[3]: position 9 of sequence 0
 * follows a gap (next is 5)"); "" when none. */
const char *moe_engine_errmsg(const struct moe_engine *e);

/* Options with defaults filled in (n_ctx 0 -> min(n_ctx_train, 4096), n_seq 0 -> 1,
 * n_batch 0 -> 512, n_threads 0 -> online CPUs as resolved by the pool, device -> the resolved
 * name such as "cpu" or "cuda:0"). */
const struct moe_engine_opts *moe_engine_get_opts(const struct moe_engine *e);

/* Positions held for a sequence (the next position to evaluate), or -1 for a bad slot. */
int32_t moe_engine_seq_len(const struct moe_engine *e, int32_t seq);

/* What the engine runs on. */
struct moe_engine_info {
    char device[32];           /* "cpu", "cuda:0" */
    char desc[1024];           /* "NVIDIA H200, 132 SMs, ..." */
    uint64_t device_bytes;     /* device memory held (CUDA: peak use incl. the context) */
    uint64_t kv_bytes;         /* the KV cache for n_seq x n_ctx positions */
};
void moe_engine_info(const struct moe_engine *e, struct moe_engine_info *info);

/* Device memory a VRAM budget keeps free at init for what is allocated later (CUDA graphs). */
#define MOE_OFFLOAD_RESERVE ((uint64_t)64 << 20)

/* Expert residency and the expert cache, per layer and in all (zero without offload). */
struct moe_offload_layer {
    uint32_t slots;                /* experts with a VRAM slot: hot + ring */
    uint32_t hot;                  /* slots never evicted */
    uint64_t hits, misses;         /* chosen experts found in VRAM / not (one per step) */
    uint64_t fill_bytes;           /* bytes copied from host memory into ring slots */
    uint64_t direct;               /* misses computed from host memory (no free ring slot) */
};
struct moe_offload_stats {
    bool active;                   /* some experts are outside VRAM */
    uint64_t expert_bytes;         /* all experts */
    uint64_t expert_vram_bytes;    /* the slots */
    uint64_t hits, misses, fill_bytes, direct, direct_bytes;
    uint64_t prefetched, prefetch_bytes; /* experts copied ahead into cache slots, their bytes */
    uint64_t prefetch_used;        /* prefetched experts that their layer then chose */
    uint64_t prefetch_used_bytes;  /* their bytes */
    uint64_t prefetch_wasted;      /* prefetched experts evicted before their layer chose them */
    uint64_t staged, stage_bytes;  /* experts copied into the prompt staging buffers, their bytes */
    uint64_t stage_reads;          /* misses read from a staging buffer (neither filled nor direct) */
    uint32_t stage_experts;        /* experts a prompt staging buffer holds (two buffers); 0: none */
    uint64_t budget;               /* vram_budget, 0 for none */
    uint64_t device_bytes_now;     /* device memory in use now (CUDA: incl. the context) */
};
/* Fills *s and, when per_layer is not NULL, per_layer[n_layer]. Returns 0 or an error. */
int moe_engine_offload_stats(struct moe_engine *e, struct moe_offload_stats *s,
                             struct moe_offload_layer *per_layer);

/* Between steps: pins each offloaded layer's most-routed experts by counts [n_layer][n_expert]
 * (a learned profile) in VRAM slots, live, copying at most max_loads experts in this call;
 * *pending (may be NULL) gets how many still wait, for a later call. The output stays the same;
 * only hits change. A no-op without offload. Returns 0 or an error. */
int moe_engine_set_hot(struct moe_engine *e, const uint64_t *counts, uint32_t max_loads,
                       uint32_t *pending);

#endif

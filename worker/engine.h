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

struct moe_engine_opts {
    uint32_t n_ctx;      /* KV cache positions per sequence */
    uint32_t n_seq;      /* concurrent sequences */
    uint32_t n_batch;    /* most tokens per step (longer batches are split) */
    int n_threads;       /* CPU threads; 0: all cores */
    const char *device;  /* "cpu" (NULL: cpu) or "cuda:K" */
    bool kv_f32;         /* CUDA: float32 KV cache instead of f16 */
};

struct moe_batch {
    uint32_t n;
    const int32_t *token;      /* [n] */
    const int32_t *pos;        /* [n] position within its sequence */
    const int32_t *seq;        /* [n] sequence slot, < n_seq */
    const uint8_t *logits;     /* [n] nonzero: write logits for this token; NULL: all tokens */
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

/* Like moe_engine_forward, but instead of logits each selected token's next token is drawn by
 * its sequence's sampler, written to tokens[k] in batch order (-1: every logit was NaN or
 * -inf) and added to the sampler's history. At most one selected token per sequence, each with
 * a sampler set; b->logits NULL selects every token (so then one token per sequence). */
int moe_engine_forward_sample(struct moe_engine *e, const struct moe_batch *b, int32_t *tokens);

/* Forgets a sequence's cached positions. */
void moe_engine_seq_clear(struct moe_engine *e, int32_t seq);

/* Cumulative routing counts since init, [n_layer][n_expert] (one count per token and chosen
 * expert), copied to dst. Returns 0 or an error (a device failure). */
int moe_engine_routing_counts(struct moe_engine *e, uint64_t *dst);

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
    char desc[160];            /* "NVIDIA H200, 132 SMs, ..." */
    uint64_t device_bytes;     /* device memory held (CUDA: peak use incl. the context) */
    uint64_t kv_bytes;         /* the KV cache for n_seq x n_ctx positions */
};
void moe_engine_info(const struct moe_engine *e, struct moe_engine_info *info);

#endif

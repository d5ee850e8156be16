/* Token sampling on the device: the GPU twin of worker/sampler.h, so that a decode step can end
 * with token ids instead of a [rows][n_vocab] logits copy to the host.
 *
 * Semantics are moe_sampler_sample's (see worker/sampler.h for the chain): penalties over the
 * row's history -> top-k -> top-p -> min-p -> temperature -> a draw from the row's xoshiro256**
 * generator, seeded through splitmix64 exactly like moe_sampler_reset and advanced by one step
 * per sampled token (none for greedy rows and for rows whose logits are all NaN / -inf).
 * Greedy (temperature <= 0) is the argmax after penalties, lowest id on ties; NaN never wins;
 * a row with no finite or +inf logit gives -1. Candidate sets, orders and tie-breaks are the
 * CPU's; the sums of probabilities are computed in double like the CPU's but in another order,
 * so a draw can differ only when the uniform number or top_p falls within rounding of a
 * cumulative boundary (tests/gpu/test_cuda_sample.c counts such cases). One deviation: in a
 * sampling row that holds +inf logits the CPU's arithmetic degenerates (inf - inf); the device
 * returns the lowest-id +inf token there (still consuming one draw).
 *
 * State lives on the device: per-row parameters, generator state and a ring of the last
 * `hist_cap` accepted tokens (the penalty window). moe_cuda_sample can append each row's sampled
 * token to its ring itself, so nothing crosses PCIe between decode steps but the tokens. The
 * launch shape depends only on n_rows and n_vocab and nothing inside synchronises with the host,
 * so the call can be captured in a CUDA graph and replayed with the same pointers.
 * docs/cuda.md ("Sampling on the device") describes the algorithm and its cost. */
#ifndef MOE_CUDA_SAMPLE_H
#define MOE_CUDA_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "worker/sampler.h"

/* One row's parameters as the kernel reads them (a device array of max_rows of these).
 * moe_cuda_sampler_set_row fills it from struct moe_sampler_params. */
struct moe_cuda_sample_row {
    float temperature;       /* <= 0: greedy */
    int32_t top_k;           /* <= 0: off */
    float top_p;             /* >= 1: off */
    float min_p;             /* <= 0: off */
    float log_min_p;         /* logf(min_p) from the host's libm, so the cut is the CPU's */
    float repeat_penalty;    /* 1: off */
    float presence_penalty;  /* 0: off */
    float frequency_penalty; /* 0: off */
    int32_t penalty_last_n;  /* window; 0: none; < 0: the whole ring */
    int32_t reserved;
};

/* One row's mutable state (a device array of max_rows of these). */
struct moe_cuda_sample_state {
    uint64_t rng[4];   /* xoshiro256** state, as moe_sampler_rng_state reports it */
    int32_t hist_head; /* next ring slot to write */
    int32_t hist_len;  /* valid entries, <= hist_cap */
};

struct moe_cuda_sampler;

/* Allocates the state for up to max_rows rows of n_vocab logits on the current device.
 * hist_cap: ring entries per row (the largest penalty window; 0: no penalties possible).
 * list_cap: candidates the kernel sorts in shared memory (rounded up to a power of two; 0 picks
 *           the default, 8192); larger candidate sets take the slower exact path. Tests pass small
 *           values to exercise that path.
 * Every row starts with moe_sampler_defaults' parameters, seed 0 and an empty history.
 * Returns 0, -EINVAL or MOE_ERANGE (sizes; message in err), MOE_EBACKEND (CUDA). Synchronous. */
int moe_cuda_sampler_init(struct moe_cuda_sampler **out, uint32_t max_rows, uint32_t n_vocab,
                          uint32_t hist_cap, uint32_t list_cap, char *err, size_t errlen);
void moe_cuda_sampler_free(struct moe_cuda_sampler *s);

/* Sets row's parameters (validated like moe_sampler_init; penalty_last_n must be <= hist_cap),
 * seeds its generator from p->seed like moe_sampler_reset and empties its history. Enqueued on
 * stream `st` (a small kernel that takes the values as arguments: nothing to keep alive).
 * Returns 0, MOE_ERANGE (message in err), -EINVAL (row out of range), MOE_EBACKEND. */
int moe_cuda_sampler_set_row(struct moe_cuda_sampler *s, uint32_t row,
                             const struct moe_sampler_params *p, cudaStream_t st, char *err,
                             size_t errlen);

/* Replaces row's history by tokens[0..n) as if each had been passed to moe_sampler_accept
 * (ids outside the vocabulary are skipped; only the last hist_cap are kept), e.g. the prompt.
 * The generator is untouched. Enqueued on st as kernels taking up to 512 tokens each as
 * arguments; tokens may be reused on return. Returns 0, -EINVAL, -ENOMEM, MOE_EBACKEND. */
int moe_cuda_sampler_set_history(struct moe_cuda_sampler *s, uint32_t row, const int32_t *tokens,
                                 size_t n, cudaStream_t st);

/* Samples rows 0..n_rows-1: row r reads d_logits[r][n_vocab] (penalties are applied to it in
 * place: only the entries of history tokens change) and writes d_tokens[r] (-1: nothing to
 * sample) and, if d_logprobs is not NULL, d_logprobs[r]: the log-probability of the token under
 * the penalised logits at temperature 1 over the whole vocabulary (-inf for -1). With accept
 * != 0 each sampled token (>= 0) is appended to its row's history, as the worker does with
 * moe_sampler_accept. Device pointers; d_logits 4-byte aligned (16 for the vector loads).
 * Only enqueues work on st. Returns 0 (also for n_rows 0), -EINVAL, MOE_EBACKEND. */
int moe_cuda_sample(struct moe_cuda_sampler *s, float *d_logits, uint32_t n_rows,
                    int32_t *d_tokens, float *d_logprobs, int accept, cudaStream_t st);

/* The same with logits row r sampled by state row d_rowmap[r] (a device array of n_rows distinct
 * rows below max_rows; NULL: row r), e.g. a decode step's rows mapped to their sequences.
 * spread: a mask of the rows' moe_cuda_sampler_row_spread (0 when none of the launch's rows is
 * such a row saves the launches it would take): greedy rows whose logits no penalty changes
 * (MOE_CUDA_SPREAD_GREEDY) first take a pass over their row spread over many blocks, and rows
 * drawn in id order at a temperature (MOE_CUDA_SPREAD_TIER_C) also have their weights summed
 * that way; top-k rows of k <= 64 (MOE_CUDA_SPREAD_TOPK) find their top k from that pass's
 * segments instead of a radix refinement. moe_cuda_sample spreads what it can. The draws are those of the one-block passes
 * (the sums of tier-C weights add the same terms in another order). */
#define MOE_CUDA_SPREAD_GREEDY 1
#define MOE_CUDA_SPREAD_TIER_C 2
#define MOE_CUDA_SPREAD_TOPK 4
/* Top-p without top-k (MOE_CUDA_SPREAD_TOPP): tier B's refinements (the nucleus, then
 * the draw) with each level's histogram built by many blocks a row. */
#define MOE_CUDA_SPREAD_TOPP 8
/* With MOE_CUDA_SPREAD_PENALTY the rows' penalties are applied to their logits by a kernel of
 * their own first (penalty_kernel), so that rows with penalties take the spread passes of their
 * kind too; moe_cuda_sampler_row_spread adds it to such a row's kind (a caller that leaves it
 * out of its mask leaves such rows to the one-block passes). */
#define MOE_CUDA_SPREAD_PENALTY 16
#define MOE_CUDA_SPREAD_ALL 31
/* What the backend spreads unless told otherwise: every pass (all of them checked on the GPU
 * against the one-block passes, docs/cuda.md). */
#define MOE_CUDA_SPREAD_DEFAULT MOE_CUDA_SPREAD_ALL
int moe_cuda_sample_rows(struct moe_cuda_sampler *s, float *d_logits, uint32_t n_rows,
                         const int32_t *d_rowmap, int32_t *d_tokens, float *d_logprobs, int accept,
                         int spread, cudaStream_t st);

/* Which passes of row's draws can be spread over the GPU, by its parameters
 * (moe_cuda_sampler_set_row, else the defaults): MOE_CUDA_SPREAD_GREEDY (temperature 0),
 * MOE_CUDA_SPREAD_TIER_C (a temperature without top-k or top-p), MOE_CUDA_SPREAD_TOPK (a
 * temperature and 1 <= top_k <= 64), MOE_CUDA_SPREAD_TOPP (a temperature and top-p without
 * top-k), with MOE_CUDA_SPREAD_PENALTY added when a penalty can change its logits; 0 for other
 * parameters or a row out of range. A caller that does not pass MOE_CUDA_SPREAD_PENALTY to
 * moe_cuda_sample_rows should leave out the rows that have it. Host-side, no CUDA call. */
int moe_cuda_sampler_row_spread(const struct moe_cuda_sampler *s, uint32_t row);

/* Test and debugging helpers; both synchronise with st. Copies row's generator state to
 * state[4]. Copies up to cap of row's history tokens, oldest first, to out and returns how many
 * the row holds (or a negative error). */
int moe_cuda_sampler_rng_state(struct moe_cuda_sampler *s, uint32_t row, uint64_t state[4],
                               cudaStream_t st);
int moe_cuda_sampler_history(struct moe_cuda_sampler *s, uint32_t row, int32_t *out, size_t cap,
                             cudaStream_t st);

#ifdef __cplusplus
}
#endif

#endif

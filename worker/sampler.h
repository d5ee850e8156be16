/* Token sampler: penalties, truncation (top-k, top-p, min-p), temperature, seeded draw.
 *
 * The chain follows llama.cpp's default order so that results are comparable:
 *   penalties (repetition, then presence/frequency) -> top-k -> top-p -> min-p -> temperature ->
 *   draw.
 * top-p and min-p therefore see the probabilities at temperature 1, as in llama.cpp.
 * temperature <= 0 is greedy: the argmax after penalties (lowest id on ties); no random number
 * is consumed.
 *
 * Penalties look at the last `penalty_last_n` tokens passed to moe_sampler_accept() (the caller
 * decides whether prompt tokens count; moed-worker feeds them, like llama.cpp):
 *   repetition (llama.cpp / CTRL): logit > 0 ? logit / r : logit * r, once per distinct token;
 *   presence and frequency (OpenAI): logit -= presence * (count > 0) + frequency * count.
 *
 * Randomness: xoshiro256** seeded through splitmix64, so a seed gives the same tokens on every
 * machine for the same logits. */
#ifndef MOE_SAMPLER_H
#define MOE_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

struct moe_sampler_params {
    float temperature;        /* <= 0: greedy */
    int32_t top_k;            /* <= 0: off */
    float top_p;              /* >= 1: off */
    float min_p;              /* <= 0: off */
    float repeat_penalty;     /* 1: off */
    float presence_penalty;   /* 0: off */
    float frequency_penalty;  /* 0: off */
    int32_t penalty_last_n;   /* window for all penalties; 0: none; < 0: whole history */
    uint64_t seed;
};

/* Defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, penalties off (last_n 64),
 * seed 0 (llama.cpp's defaults, except the seed). */
void moe_sampler_defaults(struct moe_sampler_params *p);

struct moe_sampler;

/* The ranges moe_sampler_init (and the device sampler) accept: no NaN or infinity, top_p > 0,
 * min_p in [0, 1], repeat_penalty > 0. Returns 0 or MOE_ERANGE (message in err). */
int moe_sampler_params_check(const struct moe_sampler_params *p, char *err, size_t errlen);

/* Creates a sampler for a vocabulary of n_vocab logits. Returns 0, -ENOMEM, or MOE_ERANGE
 * (n_vocab 0, NaN or negative parameters, top_p <= 0, penalties <= 0) with a message. */
int moe_sampler_init(struct moe_sampler **out, const struct moe_sampler_params *p,
                     uint32_t n_vocab, char *err, size_t errlen);
void moe_sampler_free(struct moe_sampler *s);

/* Forgets the history and reseeds with the configured seed. */
void moe_sampler_reset(struct moe_sampler *s);

/* Records a token for the penalties (ids outside the vocabulary are ignored). */
void moe_sampler_accept(struct moe_sampler *s, int32_t token);

/* Applies the penalties of the current history to logits[n_vocab] in place. */
void moe_sampler_apply_penalties(struct moe_sampler *s, float *logits);

/* Picks the next token from logits[n_vocab] (not modified). Does not call accept. Returns the
 * token id, or -1 if every logit is NaN / -inf. */
int32_t moe_sampler_sample(struct moe_sampler *s, const float *logits);

/* Log-probabilities of the raw logits[n_vocab] (log-softmax; NaN counts as -inf): *chosen_lp
 * gets token's, top_id/top_lp[n_top] the n_top most likely tokens' (most likely first, lower id
 * first on ties; fewer when fewer are finite). Returns how many top entries were written. */
uint32_t moe_logprobs(const float *logits, uint32_t n_vocab, int32_t token, uint32_t n_top,
                      float *chosen_lp, int32_t *top_id, float *top_lp);

/* The PRNG, exposed for tests: next 64 random bits / a double uniform in [0, 1). */
uint64_t moe_sampler_rand_u64(struct moe_sampler *s);
double moe_sampler_rand_unit(struct moe_sampler *s);

/* Copies the PRNG's xoshiro256** state (s[0..3]) to state, so that another implementation of
 * the sampler (worker/cuda/sample.h) can be checked to advance it identically. */
void moe_sampler_rng_state(const struct moe_sampler *s, uint64_t state[4]);

#endif

/* Continuous batching: the worker's compute-thread scheduler.
 *
 * A batcher holds up to n_seq running sequences (one engine KV slot each) and a FIFO of jobs
 * waiting for a slot. Each step admits waiting jobs into free slots, builds one forward batch
 * (one decode token for every running sequence first, then prompt chunks of newly admitted
 * ones, up to n_batch tokens; while anything decodes, prompts go in bites of
 * max(64, n_batch / 4) tokens), runs the engine, and samples one token per finished row.
 * What happens to a job is reported through a sink (worker/ipc.c turns it into frames).
 *
 * Prefix reuse: a slot keeps the KV cache of the last job it ran (its prompt and the tokens it
 * generated). A new job goes to the free slot whose kept tokens share the longest prefix with
 * its prompt (else an empty slot, else the one unused longest), continues after that prefix, and
 * reports how many prompt tokens it did not have to evaluate (n_cached). At least one prompt
 * token is always evaluated, for its logits.
 *
 * Jobs that ask for logprobs or a logit_bias need the step's logits on the host: they are
 * sampled by a host sampler of their own (worker/sampler.h, primed with the prompt as the
 * engine's is) from moe_engine_forward()'s logits, the others by the engine's sampler through
 * moe_engine_forward_sample(). A step serves one kind; while both kinds are running, steps
 * alternate between them. The CPU engine samples with the same code, so a job's tokens do not
 * depend on which path it takes, and a CPU worker (cfg.host_sample_all) takes the host path for
 * every job.
 *
 * Routing signatures (cfg.signatures): the prompt tokens a job evaluates carry its signature
 * array in the batch (moe_batch.sig), so the engine counts the experts they choose; decode
 * tokens carry none, and a step of decode tokens only records nothing. sink.done hands it over.
 *
 * A job with prompt logprobs has its prompt evaluated in chunks of at most MOE_BATCHER_PROMPT_ROWS
 * tokens with the logits of every row (one such chunk per step).
 *
 * Every call runs on the compute thread; the batcher has no locks of its own. All engine calls
 * of the worker's serving path are in batcher.c. */
#ifndef MOE_WORKER_BATCHER_H
#define MOE_WORKER_BATCHER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/ipc.h"
#include "store/grammar.h"
#include "worker/engine.h"
#include "worker/sampler.h"

/* A generation request. The submitter fills the first block (and sets slot to -1); once handed
 * to moe_batcher_add() the job belongs to the batcher. */
struct moe_job {
    uint64_t id;
    int32_t *prompt;
    uint32_t n_prompt;
    uint32_t max_tokens;
    struct moe_sampler_params sp;
    int32_t eog[MOE_IPC_MAX_EOG];
    uint32_t n_eog;
    bool logprobs;             /* report each token's logprob and the n_top most likely */
    uint32_t n_top;            /* <= MOE_IPC_MAX_TOP_LOGPROBS */
    bool prompt_logprobs;      /* and each prompt token's after the first (sink.prompt_lp); the
                                * whole prompt is evaluated (no prefix reuse) */
    int32_t *bias_tok;         /* [n_bias] logit_bias (owned), added before sampling */
    float *bias_val;
    uint32_t n_bias;
    /* Constrained sampling (store/grammar.h): the job's grammar and its state (both owned) and
     * the vocabulary's bytes (shared, outliving the job). Each step allows only the tokens the
     * grammar can take; the job ends (STOP) when the grammar cannot go on. */
    struct moe_grammar *grammar;
    struct moe_grammar_state *gram;
    const struct moe_token_bytes *tb;
    int gram_fail;             /* batcher only: 1 a grammar limit, 2 no token allowed */
    struct moe_job *next;
    /* batcher only */
    int32_t slot;
    uint32_t n_past; /* positions evaluated for this sequence */
    uint32_t n_cached; /* prompt positions taken from a kept KV cache (its slot's or a copy) */
    /* A prompt prefix another slot is evaluating (n > 1 choices, a shared system prompt): the
     * job waits for slot share_slot's job share_id to hold share_n positions, then copies them
     * (moe_engine_seq_copy) instead of evaluating them again. share_slot -1: none. */
    int32_t share_slot;
    uint64_t share_id;
    uint32_t share_n;
    uint32_t n_gen;
    int32_t last;    /* last sampled token: evaluated at n_past in the next step */
    bool bias_dev;   /* its logit_bias is applied by the engine's sampler (moe_engine_seq_bias) */
    bool ahead_open; /* its row in the newest queued step (decode ahead) takes the token a step
                      * still queued draws: position n_past - 1's token is not known yet */
    struct moe_sampler *hs; /* host sampler: jobs with logprobs or logit_bias (see below) */
    uint32_t *sig;   /* cfg.signatures: [n_layer][n_expert] routing of its evaluated prompt */
};

/* A vocabulary for grammar masks: token i's bytes (none for control tokens that are not
 * end-of-generation: never allowed) and the trie built from them. */
struct moe_token_bytes {
    uint32_t n;
    char **tok;
    uint32_t *len;
    struct moe_grammar_vocab *trie;
};

struct gguf_file;
/* The vocabulary of a GGUF's tokenizer as grammars see it (the tokenizer is loaded for this and
 * let go): each token's bytes, none for control tokens that do not end generation, and the trie
 * of them. NULL with err on failure. */
struct moe_token_bytes *moe_token_bytes_new(const struct gguf_file *f, char *err, size_t errlen);
void moe_token_bytes_free(struct moe_token_bytes *tb);

/* Frees a job and what it owns (NULL is fine). */
void moe_job_free(struct moe_job *j);

enum moe_finish { MOE_FINISH_STOP, MOE_FINISH_LENGTH };

/* A sampled token's log-probability and the most likely tokens' (jobs with logprobs). */
struct moe_token_lp {
    float logprob;
    uint32_t n_top;
    int32_t top_id[MOE_IPC_MAX_TOP_LOGPROBS];
    float top_lp[MOE_IPC_MAX_TOP_LOGPROBS];
};

/* Totals since the batcher started, and the state at a routing report. */
struct moe_batcher_report {
    const uint64_t *delta;     /* [n_layer * n_expert] routing counts since the last report */
    uint64_t n_tokens;         /* positions evaluated since the last report */
    uint64_t tokens_generated, prompt_tokens;
    uint32_t running;
    double tokens_per_s;       /* generated tokens per second since the last report */
};

/* Where results go. Called on the compute thread, from moe_batcher_step/_report. */
struct moe_batcher_sink {
    void *user;
    /* lp: NULL unless the job asked for logprobs. */
    void (*token)(void *user, uint64_t id, int32_t token, const struct moe_token_lp *lp);
    /* sig: with cfg.signatures, the job's routing signature ([n_layer][n_expert]: how many of
     * the prompt tokens it evaluated, n_prompt - n_cached, chose each expert in each layer), valid
     * during the call; else NULL. */
    void (*done)(void *user, uint64_t id, enum moe_finish reason, uint32_t n_prompt,
                 uint32_t n_gen, uint32_t n_cached, const uint32_t *sig);
    /* Jobs with prompt_logprobs: prompt token `token` at position pos (>= 1) and its logprobs
     * given the positions before, in order, before the job's first token. */
    void (*prompt_lp)(void *user, uint64_t id, uint32_t pos, int32_t token,
                      const struct moe_token_lp *lp);
    /* The job ended with an error; id 0: the batcher itself failed. */
    void (*error)(void *user, uint64_t id, int code, const char *msg);
    /* Returns 0 when the report was taken; otherwise its counts stay pending and go out with
     * the next one. */
    int (*report)(void *user, const struct moe_batcher_report *r);
};

#define MOE_BATCHER_PROMPT_ROWS 32
/* The shortest prompt prefix a job copies from another running job's slot rather than
 * evaluating it itself. */
#define MOE_BATCHER_SHARE_MIN 16

struct moe_batcher_cfg {
    struct moe_engine *eng;
    uint32_t n_vocab, n_layer, n_expert, n_ctx, n_seq, n_batch;
    bool host_sample_all;      /* every job is sampled on the host (a CPU engine samples on the
                                * host anyway: no alternating steps) */
    bool signatures;           /* each job's routing signature goes with its done (the engine
                                * was made with record_routes) */
};

struct moe_batcher;

/* Returns 0 or -ENOMEM. */
int moe_batcher_init(struct moe_batcher **out, const struct moe_batcher_cfg *cfg,
                     const struct moe_batcher_sink *sink);
/* Drops every running and waiting job without reporting them. */
void moe_batcher_free(struct moe_batcher *b);

/* Appends a job to the waiting FIFO. */
void moe_batcher_add(struct moe_batcher *b, struct moe_job *j);
/* Ends job `id` (running or waiting) without reporting it; unknown ids are ignored. */
void moe_batcher_cancel(struct moe_batcher *b, uint64_t id);
/* Fails every running job with code and msg (reported through sink.error): the engine's state
 * can no longer be trusted. Waiting jobs stay. */
void moe_batcher_fail_running(struct moe_batcher *b, int code, const char *msg);
/* true while any job is running or waiting. */
bool moe_batcher_busy(const struct moe_batcher *b);

/* Admits waiting jobs into free slots, then runs one forward step over the running ones.
 * Returns 0, or the engine error that ends the worker (MOE_EBACKEND); after any forward error
 * every running job has failed (reported through sink.error). */
int moe_batcher_step(struct moe_batcher *b);

/* Reports routing counts and totals once a second (force: now), unless nothing happened. */
void moe_batcher_report(struct moe_batcher *b, bool force);

#endif

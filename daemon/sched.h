/* The daemon's scheduler: queues generation requests and spreads them over workers.
 *
 * Everything here runs on the daemon's one libuv loop; callbacks are called from that loop.
 * The API layer (daemon/api.c) tokenizes, applies chat templates, handles stop strings and
 * detokenization; the scheduler deals only in token ids. */
#ifndef MOED_SCHED_H
#define MOED_SCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sched;
struct sched_req;

struct sched_sampling {
    float temperature;        /* 0: greedy */
    float top_p;              /* 1: off */
    int32_t top_k;            /* 0: off */
    float min_p;              /* 0: off */
    float repetition_penalty; /* 1: off */
    float presence_penalty;   /* 0: off */
    float frequency_penalty;  /* 0: off */
    uint64_t seed;
    bool has_seed;            /* false: the worker picks a random seed */
    /* logit_bias: bias_val[i] added to the logit of bias_tok[i] (distinct ids); copied by
     * sched_submit. */
    const int32_t *bias_tok;
    const float *bias_val;
    uint32_t n_bias;
    bool logprobs;            /* each token comes with its logprob (sched_req_logprob) */
    uint32_t top_logprobs;    /* and the most likely tokens', at most SCHED_MAX_TOP_LOGPROBS */
    bool prompt_logprobs;     /* with logprobs: the prompt's too (cb.on_prompt_logprob) */
    const char *grammar;      /* GBNF the output must follow (validated); NULL: none. Copied by
                               * sched_submit. */
    bool ignore_eos;          /* the end-of-generation tokens do not end it (the worker is given
                               * none; the API also bans them with logit_bias) */
};

#define SCHED_MAX_TOP_LOGPROBS 20
#define SCHED_MAX_BIAS 1024       /* logit_bias entries */

/* A generated token's log-probability (log-softmax of the raw logits) and the most likely
 * tokens' (most likely first). */
struct sched_logprob {
    float logprob;
    uint32_t n_top;
    int32_t top_id[SCHED_MAX_TOP_LOGPROBS];
    float top_lp[SCHED_MAX_TOP_LOGPROBS];
};

enum sched_finish { SCHED_FINISH_STOP = 0, SCHED_FINISH_LENGTH = 1 };

struct sched_cb {
    /* One generated token (already sampled; not yet checked for stop strings by the API). */
    void (*on_token)(struct sched_req *r, void *user, int32_t token);
    /* Generation ended normally: end-of-generation token or max_tokens reached. */
    void (*on_done)(struct sched_req *r, void *user, enum sched_finish why, uint32_t n_prompt,
                    uint32_t n_gen);
    /* Generation failed (worker died after streaming, no worker, overload...). http_status is the
     * status the API should use (500, 503, 400) when nothing was sent yet. */
    void (*on_error)(struct sched_req *r, void *user, int http_status, const char *message);
    /* sampling.prompt_logprobs: prompt token `token` at pos (1..n_prompt-1) and its logprobs,
     * before the first on_token (a retry on another worker sends them again from pos 1). */
    void (*on_prompt_logprob)(struct sched_req *r, void *user, uint32_t pos, int32_t token,
                              const struct sched_logprob *lp);
};

struct sched_params {
    const int32_t *prompt;    /* copied */
    uint32_t n_prompt;
    uint32_t max_tokens;
    struct sched_sampling sampling;
    struct sched_cb cb;
    void *user;
};

/* In on_done: how many of the prompt's tokens the worker continued from a kept KV cache
 * (prefix reuse) instead of evaluating them. */
uint32_t sched_req_cached(const struct sched_req *r);

/* In on_token, for a request with sampling.logprobs: the token's logprobs; else NULL. */
const struct sched_logprob *sched_req_logprob(const struct sched_req *r);

/* Queues a request. Returns a handle valid until one of on_done/on_error has been called or
 * sched_cancel() returned; NULL (with *http_status and msg set) when it cannot be queued
 * (queue full: 503; prompt longer than the context: 400). */
struct sched_req *sched_submit(struct sched *s, const struct sched_params *p, int *http_status,
                               char *msg, size_t msglen);

/* Stops a request (client went away, stop string matched). No callback is called after this
 * returns; the worker slot is freed. */
void sched_cancel(struct sched *s, struct sched_req *r);

/* Counters for /metrics and /admin/status. */
struct sched_stats {
    uint32_t queued, running;
    uint32_t workers_ready, workers_total;
    uint64_t requests_total, requests_failed;
    uint64_t prompt_tokens_total, gen_tokens_total;
};
void sched_get_stats(const struct sched *s, struct sched_stats *out);

/* Worker w's decode tokens per second per sequence as the scheduler measured it (the moving
 * average it places requests by); 0 when not measured since the worker got ready. */
double sched_worker_rate(const struct sched *s, uint32_t w);

/* A sequence slot of a ready worker, as the scheduler sees it: a worker's running requests take
 * its first slots in the order they were sent (the worker's own slot numbers are not known). */
struct sched_slot {
    uint32_t worker, n_ctx;
    uint64_t id;              /* the request running there; 0: idle */
    uint32_t n_prompt, n_gen, max_tokens;
};
/* Writes up to cap slots, worker by worker; returns how many there are. */
size_t sched_slots(const struct sched *s, struct sched_slot *out, size_t cap);

/* The workload table the routing signatures of finished requests teach (store/workload.h), or
 * NULL when the scheduler has none (the model's shape not given). */
struct moe_wl_table;
struct moe_wl_table *sched_workloads(struct sched *s);

/* The end-of-generation tokens the workers are given to stop at (*n of them), as configured. */
const int32_t *sched_eog(const struct sched *s, uint32_t *n);

/* The experts worker w pins as its last Metrics said ([n_layer][n_expert] bits), or NULL. */
const uint8_t *sched_worker_hot_bits(const struct sched *s, uint32_t w);

#endif

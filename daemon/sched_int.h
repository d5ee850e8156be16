/* Between the scheduler (daemon/sched.c) and the supervisor (daemon/supervisor.c); nobody else
 * includes this. The supervisor owns processes and connections and reports what its workers say;
 * the scheduler owns requests: the queue, which worker runs what, and the API's callbacks. */
#ifndef MOED_SCHED_INT_H
#define MOED_SCHED_INT_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "daemon/sched.h"
#include "daemon/supervisor.h"

struct sched_config {
    uint32_t n_workers;
    uint32_t n_ctx;           /* prompts longer than this are refused (400) */
    uint32_t queue_max;
    uint32_t queue_wait_ms;
    const int32_t *eog;       /* copied */
    uint32_t n_eog;
    /* The model's shape, for the workload table (store/workload.h) that routing signatures
     * teach and that places requests by the experts they use; 0: no table. */
    uint32_t n_layer, n_expert;
};

/* Returns 0 or -ENOMEM. */
int sched_create(struct sched **out, uv_loop_t *loop, struct moed_workers *ws,
                 const struct sched_config *cfg);
/* Frees requests still held without calling their callbacks; the timer must be closed first. */
void sched_destroy(struct sched *s);
/* Closes the scheduler's timer; cb(user) when it is closed. */
void sched_close(struct sched *s, void (*cb)(void *user), void *user);

/* Events from the supervisor. */
void sched_worker_ready(struct sched *s, uint32_t w, uint32_t n_seq, uint32_t n_ctx);
/* The worker is gone: its requests are re-queued (no token sent yet) or failed. */
void sched_worker_lost(struct sched *s, uint32_t w, const char *why);
/* lp: the token's logprobs (NULL: none sent). */
void sched_worker_token(struct sched *s, uint32_t w, uint64_t id, int32_t token,
                        const struct sched_logprob *lp);
void sched_worker_prompt_logprob(struct sched *s, uint32_t w, uint64_t id, uint32_t pos,
                                 int32_t token, const struct sched_logprob *lp);
/* sig: the request's routing signature (n_sig = n_layer * n_expert counts, validated), or
 * n_sig 0. */
void sched_worker_done(struct sched *s, uint32_t w, uint64_t id, int finish_reason,
                       uint32_t n_prompt, uint32_t n_gen, uint32_t n_cached, const uint32_t *sig,
                       size_t n_sig);
/* The experts worker w pins ([n_layer][n_expert] bits, nbytes of them; copied), from its
 * Metrics; NULL or a size that does not fit the model: none (a CPU worker, or not known). */
void sched_worker_hot(struct sched *s, uint32_t w, const uint8_t *bits, size_t nbytes);
void sched_worker_error(struct sched *s, uint32_t w, uint64_t id, int code, const char *msg);

/* Stops accepting (503) and fails every queued request with 503 and msg. */
void sched_drain(struct sched *s, const char *msg);
/* Fails every running request with status and msg (and cancels it on its worker). */
void sched_abort_running(struct sched *s, int status, const char *msg);
uint32_t sched_n_running(const struct sched *s);
uint32_t sched_n_running_on(const struct sched *s, uint32_t w);
/* Called whenever the number of running requests drops to zero (used while draining). */
void sched_set_idle_cb(struct sched *s, void (*cb)(void *user), void *user);

/* What the scheduler knows of a ready worker when it places a request (sched_pick). */
struct sched_cand {
    bool free;          /* it has a free sequence slot */
    uint32_t affinity;  /* leading blocks of the prompt it was sent before (prefix affinity) */
    uint32_t n_free;    /* free sequence slots */
    double rate;        /* measured decode tokens/s of one of its sequences (moving average over
                         * its recent tokens, at the load it had); 0: not measured yet */
    uint64_t last_sent; /* dispatch counter value of its last request; 0: none */
    double coverage;    /* expected share of the request's routed experts pinned there (its
                         * workload's typical routing against the worker's pinned experts,
                         * moe_wl_coverage), 0..1; < 0: unknown (no workload entry for the
                         * request, or the worker pins nothing it reported) */
};

/* Coverages within this of the best among the candidates count as equal. */
#define SCHED_COVERAGE_MARGIN 0.05

/* Prefix affinity of at most this many blocks does not outrank coverage: it is the workload
 * key's own tokens (a shared system prompt's first block), whose reuse saves one block of
 * prefill, while a worker pinning the workload's experts saves host reads on every token. */
#define SCHED_WEAK_AFFINITY 1

/* Workers whose measured rates are within this factor of the fastest count as equally fast:
 * wide enough for equal workers measured on a loaded machine, narrow against a CPU worker
 * beside a GPU one (10x and more). */
#define SCHED_SPEED_BAND 4.0

/* The worker for a request among c[0..n), or -1 when none has a free slot. Among the free ones,
 * only the fast ones: a measured rate within SCHED_SPEED_BAND of the fastest (a GPU worker
 * before a CPU worker of the same daemon while it has slots), or not measured yet. Among those
 * the longest prefix affinity of more than SCHED_WEAK_AFFINITY blocks (a worker keeps the cache
 * of the conversation it ran, which saves more than any placement); then, of those, the ones
 * whose coverage is unknown or within SCHED_COVERAGE_MARGIN of the best known (the worker
 * pinning the request's experts); then the longest affinity; then a worker not measured yet (so
 * that each gets measured); then the most free slots; then the one unused longest (so that
 * conversations spread over equal workers and keep their caches). */
int32_t sched_pick(const struct sched_cand *c, uint32_t n);

/* Calls into the supervisor (daemon/supervisor.c). Return 0 or an error when the worker's
 * connection is gone (the supervisor then reports the worker lost). */
int moed_workers_send_submit(struct moed_workers *ws, uint32_t w, uint64_t id, const int32_t *prompt,
                             uint32_t n_prompt, uint32_t max_tokens,
                             const struct sched_sampling *sp, const int32_t *eog, uint32_t n_eog);
int moed_workers_send_cancel(struct moed_workers *ws, uint32_t w, uint64_t id);

#endif

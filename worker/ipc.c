/* The worker's daemon-spawned mode: the libuv loop on the main thread owns the IPC socket, the
 * compute thread feeds the batcher (worker/batcher.c) and ships what it reports back to the
 * loop. See worker/ipc.h. */
#include "worker/ipc.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <uv.h>

#include "proto/ipc.h"
#include "store/err.h"
#include "store/expert_store.h"
#include "store/gguf.h"
#include "store/io.h"
#include "store/model.h"
#include "store/tokenizer.h"
#include "worker/batcher.h"
#include "worker/engine.h"
#include "worker/sampler.h"
#include "worker/tier.h"

#define HELLO_TIMEOUT_MS 60000
/* The daemon keeps at most n_seq requests on a worker; a little backlog beyond that is allowed
 * (a Submit may cross a Done on the wire), a lot of it is a daemon bug. */
#define BACKLOG_FACTOR 4

enum wev_kind { EV_TOKEN, EV_DONE, EV_ERROR, EV_STATS, EV_EXIT, EV_XREQ };

/* Something for the main thread to send (or, for EV_EXIT, to act on). */
struct wevent {
    enum wev_kind kind;
    uint64_t id;
    int32_t token;
    bool has_lp;                      /* EV_TOKEN: lp is set */
    bool prompt;                      /* EV_TOKEN: a prompt position's logprobs */
    uint32_t prompt_pos;
    struct moe_token_lp lp;
    int reason;
    uint32_t n_prompt, n_gen, n_cached;
    int code;
    char msg[256];
    uint64_t *counts; /* EV_STATS: [n_layer*n_expert] deltas */
    uint32_t *sig;    /* EV_DONE: the routing signature [n_layer*n_expert], or NULL */
    uint8_t *hot;     /* EV_STATS: the pinned experts' bitmap (offloading GPU workers), or NULL */
    uint64_t n_tokens;
    uint64_t tokens_generated, prompt_tokens;
    uint32_t running;
    double tokens_per_s;
    uint64_t expert_hits, expert_misses;
    struct moe_offload_stats os;      /* EV_STATS: the expert cache (os.active: with layers) */
    struct moe_offload_layer *layers; /* [n_layer] or NULL */
    struct wtier_stats ts;            /* EV_STATS: the tiered store's counters */
    uint32_t layer, expert;           /* EV_XREQ */
    bool prefetch;                    /* EV_XREQ: a read-ahead */
    struct wevent *next;
};

struct worker {
    uv_loop_t loop;
    uv_async_t async;
    struct moe_ipc_conn *conn;
    pthread_t thread;
    bool thread_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* inbox: main -> compute, under mu; a job belongs to the compute thread once it is there */
    struct moe_job *in_head, *in_tail;
    uint64_t *cancels;
    size_t n_cancels, cap_cancels;
    bool stop, drain;
    uint64_t *place_in;            /* the last SetPlacement's counts, not yet taken; under mu */
    /* compute thread only: counts being applied, and whether experts remain to copy */
    uint64_t *place_counts;
    bool place_pending;
    int place_fatal;               /* compute thread: re-pinning failed on the device (MOE_EBACKEND) */
    char place_msg[256];
    /* outbox: compute -> main, under mu */
    struct wevent *out_head, *out_tail;
    /* main thread only */
    uint64_t *live;
    size_t n_live, cap_live;
    int exit_code;
    /* model and engine */
    struct gguf_file *gguf;
    struct moe_model model;
    bool model_ok;
    struct moe_store *store;
    struct wtier *tier;           /* tiered store: where pooled experts are found */
    struct moe_engine *eng;
    struct moe_token_bytes *tb;    /* the vocabulary's bytes for grammars, made on first use */
    uint32_t n_vocab, n_layer, n_expert, n_ctx, n_seq, n_batch;
    uint32_t index;
    bool signatures;              /* hello.route_signatures: Done carries each request's */
    _Atomic uint64_t steps;       /* forward steps the compute thread completed */
    uv_timer_t hb_timer;          /* the Heartbeat, every second */
};

/* ---------------------------------------------------------------------------------------------
 * Queues */

static void post(struct worker *w, struct wevent *ev)
{
    pthread_mutex_lock(&w->mu);
    if (w->out_tail)
        w->out_tail->next = ev;
    else
        w->out_head = ev;
    w->out_tail = ev;
    pthread_mutex_unlock(&w->mu);
    uv_async_send(&w->async);
}

static struct wevent *ev_new(enum wev_kind k, uint64_t id)
{
    struct wevent *ev = calloc(1, sizeof *ev);
    if (ev) {
        ev->kind = k;
        ev->id = id;
    }
    return ev;
}

static void ev_free(struct wevent *ev)
{
    free(ev->counts);
    free(ev->sig);
    free(ev->hot);
    free(ev->layers);
    free(ev);
}

static void post_error(struct worker *w, uint64_t id, int code, const char *msg)
{
    struct wevent *ev = ev_new(EV_ERROR, id);
    if (!ev)
        return;
    ev->code = code;
    snprintf(ev->msg, sizeof ev->msg, "%s", msg);
    post(w, ev);
}

/* ---------------------------------------------------------------------------------------------
 * Compute thread: the batcher's sink turns what it reports into events for the loop */

static void sink_token(void *user, uint64_t id, int32_t token, const struct moe_token_lp *lp)
{
    struct wevent *ev = ev_new(EV_TOKEN, id);
    if (ev) {
        ev->token = token;
        if (lp) {
            ev->has_lp = true;
            ev->lp = *lp;
        }
        post(user, ev);
    }
}

static void sink_prompt_lp(void *user, uint64_t id, uint32_t pos, int32_t token,
                           const struct moe_token_lp *lp)
{
    struct wevent *ev = ev_new(EV_TOKEN, id);
    if (ev) {
        ev->token = token;
        ev->has_lp = true;
        ev->lp = *lp;
        ev->prompt = true;
        ev->prompt_pos = pos;
        post(user, ev);
    }
}

static void sink_done(void *user, uint64_t id, enum moe_finish reason, uint32_t n_prompt,
                      uint32_t n_gen, uint32_t n_cached, const uint32_t *sig)
{
    struct worker *w = user;
    struct wevent *ev = ev_new(EV_DONE, id);
    if (ev) {
        ev->reason = reason == MOE_FINISH_STOP ? MOED__FINISH_REASON__FINISH_STOP
                                               : MOED__FINISH_REASON__FINISH_LENGTH;
        ev->n_prompt = n_prompt;
        ev->n_gen = n_gen;
        ev->n_cached = n_cached;
        /* Without memory for the copy the Done goes without it (the daemon learns less). */
        const size_t n = (size_t)w->n_layer * w->n_expert;
        if (sig && (ev->sig = malloc(sizeof *ev->sig * n)))
            memcpy(ev->sig, sig, sizeof *ev->sig * n);
        post(user, ev);
    }
}

static void sink_error(void *user, uint64_t id, int code, const char *msg)
{
    post_error(user, id, code, msg);
}

/* Live re-pinning (GPU workers with offload): the newest SetPlacement's counts, applied between
 * steps a few experts at a time so that no pause is longer than about a step. */
#define REPIN_LOADS_PER_REPORT 32

static void apply_placement(struct worker *w)
{
    pthread_mutex_lock(&w->mu);
    uint64_t *in = w->place_in;
    w->place_in = NULL;
    pthread_mutex_unlock(&w->mu);
    if (in) {
        free(w->place_counts);
        w->place_counts = in;
        w->place_pending = true;
    }
    if (!w->place_counts || !w->place_pending || w->place_fatal)
        return;
    uint32_t pending = 0;
    const int rc = moe_engine_set_hot(w->eng, w->place_counts, REPIN_LOADS_PER_REPORT, &pending);
    if (rc == MOE_EBACKEND) {
        /* The device failed mid-way: its tables and slots may disagree, so the worker stops
         * (the compute loop fails its sequences) and the daemon starts another. */
        snprintf(w->place_msg, sizeof w->place_msg, "%s", moe_engine_errmsg(w->eng));
        moe_ipc_log(MOE_LOG_ERROR, "%s", w->place_msg);
        w->place_fatal = rc;
        pending = 0;
    } else if (rc) {
        /* Nothing of the failed loads reached the device (a tiered store could not give an
         * expert): the placement is tried again with the next report. */
        moe_ipc_log(MOE_LOG_WARN, "%s", moe_engine_errmsg(w->eng));
    }
    w->place_pending = pending > 0;
}

static int sink_report(void *user, const struct moe_batcher_report *r)
{
    struct worker *w = user;
    apply_placement(w);
    size_t n = (size_t)w->n_layer * w->n_expert;
    struct wevent *ev = ev_new(EV_STATS, 0);
    uint64_t *copy = malloc(n * sizeof *copy);
    if (!ev || !copy) {
        free(ev);
        free(copy);
        return -ENOMEM;
    }
    memcpy(copy, r->delta, n * sizeof *copy);
    ev->counts = copy;
    ev->n_tokens = r->n_tokens;
    ev->tokens_generated = r->tokens_generated;
    ev->prompt_tokens = r->prompt_tokens;
    ev->running = r->running;
    ev->tokens_per_s = r->tokens_per_s;
    /* The device expert cache's counters (zero without offload); between steps, here. */
    ev->layers = calloc(w->n_layer, sizeof *ev->layers);
    if (ev->layers && moe_engine_offload_stats(w->eng, &ev->os, ev->layers) == 0) {
        ev->expert_hits = ev->os.hits;
        ev->expert_misses = ev->os.misses;
    }
    if (!ev->os.active) {
        free(ev->layers);
        ev->layers = NULL;
    }
    /* Which experts it pins, so that the daemon can send each request where its experts are. */
    if (ev->os.active && (ev->hot = calloc(((size_t)w->n_layer * w->n_expert + 7) / 8, 1)) &&
        moe_engine_hot_experts(w->eng, ev->hot) != 1) {
        free(ev->hot);
        ev->hot = NULL;
    }
    if (w->tier)
        wtier_stats(w->tier, &ev->ts);
    post(w, ev);
    return 0;
}

/* Compute thread: an expert the step needs is not in the pool; the loop sends the request. */
static void tier_request(void *user, uint32_t layer, uint32_t expert, bool prefetch)
{
    struct worker *w = user;
    struct wevent *ev = ev_new(EV_XREQ, atomic_load(&w->steps));
    if (!ev) {
        /* Without the request the step would wait forever: exit instead (the daemon restarts
         * the worker and retries its requests). */
        moe_ipc_log(MOE_LOG_ERROR, "out of memory asking for expert (%u, %u)", layer, expert);
        abort();
    }
    ev->layer = layer;
    ev->expert = expert;
    ev->prefetch = prefetch;
    post(w, ev);
}

static void *compute_main(void *arg)
{
    struct worker *w = arg;
    struct moe_batcher *b = NULL;
    struct moe_batcher_cfg cfg = {.eng = w->eng, .n_vocab = w->n_vocab, .n_layer = w->n_layer,
                                  .n_expert = w->n_expert, .n_ctx = w->n_ctx, .n_seq = w->n_seq,
                                  .n_batch = w->n_batch,
                                  .host_sample_all = !strcmp(moe_engine_get_opts(w->eng)->device, "cpu"),
                                  .signatures = w->signatures};
    struct moe_batcher_sink sink = {.user = w, .token = sink_token, .prompt_lp = sink_prompt_lp,
                                    .done = sink_done, .error = sink_error, .report = sink_report};
    int fatal = moe_batcher_init(&b, &cfg, &sink);
    if (fatal) {
        post_error(w, 0, fatal, "out of memory for the compute loop");
        goto out;
    }

    for (;;) {
        pthread_mutex_lock(&w->mu);
        for (;;) {
            bool work = w->in_head || w->n_cancels || moe_batcher_busy(b);
            if (w->stop || work)
                break;
            pthread_mutex_unlock(&w->mu);
            moe_batcher_report(b, true); /* going idle: flush what the last requests routed */
            pthread_mutex_lock(&w->mu);
            if (w->stop || w->in_head || w->n_cancels || w->place_fatal)
                break;
            pthread_cond_wait(&w->cv, &w->mu);
        }
        struct moe_job *in = w->in_head;
        w->in_head = w->in_tail = NULL;
        size_t n_cancels = w->n_cancels;
        uint64_t *cancels = NULL;
        if (n_cancels) {
            cancels = malloc(n_cancels * sizeof *cancels);
            if (cancels)
                memcpy(cancels, w->cancels, n_cancels * sizeof *cancels);
            w->n_cancels = 0;
        }
        bool stop = w->stop, drain = w->drain;
        pthread_mutex_unlock(&w->mu);

        while (in) {
            struct moe_job *j = in;
            in = j->next;
            moe_batcher_add(b, j);
        }
        for (size_t i = 0; cancels && i < n_cancels; i++)
            moe_batcher_cancel(b, cancels[i]);
        free(cancels);
        if (stop && !drain)
            break;
        if (stop && !moe_batcher_busy(b))
            break;
        if (w->place_fatal) { /* re-pinning failed on the device (apply_placement) */
            fatal = w->place_fatal;
            moe_batcher_fail_running(b, fatal, w->place_msg);
            break;
        }
        fatal = moe_batcher_step(b);
        atomic_fetch_add(&w->steps, 1);
        if (fatal)
            break;
        moe_batcher_report(b, false);
    }
    moe_batcher_report(b, true);
out:
    /* Whatever is left was cancelled by the daemon (or the socket is gone): drop it quietly. */
    moe_batcher_free(b);
    struct wevent *ev = ev_new(EV_EXIT, 0);
    if (ev) {
        ev->code = fatal;
        post(w, ev);
    } else {
        uv_async_send(&w->async);
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Main thread: socket side */

static bool live_has(struct worker *w, uint64_t id, size_t *at)
{
    for (size_t i = 0; i < w->n_live; i++)
        if (w->live[i] == id) {
            if (at)
                *at = i;
            return true;
        }
    return false;
}

static void live_del(struct worker *w, uint64_t id)
{
    size_t i;
    if (live_has(w, id, &i))
        w->live[i] = w->live[--w->n_live];
}

static void tell_compute_stop(struct worker *w, bool drain)
{
    pthread_mutex_lock(&w->mu);
    /* A stop without drain wins over an earlier drain, never the other way round. */
    w->drain = w->stop ? w->drain && drain : drain;
    w->stop = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static void fill_sampling(struct moe_sampler_params *sp, const Moed__Sampling *p)
{
    moe_sampler_defaults(sp);
    sp->temperature = 0;
    sp->top_k = 0;
    sp->top_p = 1;
    sp->min_p = 0;
    sp->repeat_penalty = 1;
    sp->presence_penalty = 0;
    sp->frequency_penalty = 0;
    uint64_t seed = 0;
    if (getrandom(&seed, sizeof seed, 0) != (ssize_t)sizeof seed)
        seed = (uint64_t)time(NULL) ^ (uint64_t)getpid() << 32;
    sp->seed = seed;
    if (!p)
        return;
    sp->temperature = p->temperature;
    sp->top_k = p->top_k;
    sp->top_p = p->top_p > 0 && p->top_p < 1 ? p->top_p : 1;
    sp->min_p = p->min_p;
    sp->repeat_penalty = p->repetition_penalty > 0 ? p->repetition_penalty : 1;
    sp->presence_penalty = p->presence_penalty;
    sp->frequency_penalty = p->frequency_penalty;
    if (p->has_seed)
        sp->seed = p->seed;
}

/* The vocabulary as grammars see it, made on first use. */
static const struct moe_token_bytes *token_bytes(struct worker *w, char *err, size_t errlen)
{
    if (!w->tb)
        w->tb = moe_token_bytes_new(w->gguf, err, errlen);
    return w->tb;
}

static int on_submit(struct worker *w, const Moed__Submit *s, char *err, size_t errlen)
{
    if (live_has(w, s->id, NULL))
        return moe_fail(err, errlen, MOE_ERANGE, "submit.id %" PRIu64 " is already running", s->id);
    if (w->n_live >= (size_t)w->n_seq * BACKLOG_FACTOR)
        return moe_fail(err, errlen, MOE_ERANGE, "%zu requests already on a worker with %u slots",
                        w->n_live, w->n_seq);
    struct moe_job *j = calloc(1, sizeof *j);
    if (!j)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    j->prompt = malloc(s->n_prompt * sizeof *j->prompt);
    if (!j->prompt) {
        free(j);
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    }
    if (w->n_live == w->cap_live) {
        size_t cap = w->cap_live ? w->cap_live * 2 : 64;
        uint64_t *l = realloc(w->live, cap * sizeof *l);
        if (!l) {
            moe_job_free(j);
            return moe_fail(err, errlen, -ENOMEM, "out of memory");
        }
        w->live = l;
        w->cap_live = cap;
    }
    w->live[w->n_live++] = s->id;
    j->id = s->id;
    memcpy(j->prompt, s->prompt, s->n_prompt * sizeof *j->prompt);
    j->n_prompt = (uint32_t)s->n_prompt;
    j->max_tokens = s->max_tokens;
    j->n_eog = (uint32_t)s->n_eog;
    if (s->n_eog)
        memcpy(j->eog, s->eog, s->n_eog * sizeof *j->eog);
    fill_sampling(&j->sp, s->sampling);
    j->logprobs = s->logprobs;
    j->n_top = s->top_logprobs;
    j->prompt_logprobs = s->prompt_logprobs;
    const Moed__Sampling *sm = s->sampling;
    if (sm && sm->n_bias_token) {
        j->bias_tok = malloc(sm->n_bias_token * sizeof *j->bias_tok);
        j->bias_val = malloc(sm->n_bias_token * sizeof *j->bias_val);
        if (!j->bias_tok || !j->bias_val) {
            w->n_live--;
            moe_job_free(j);
            return moe_fail(err, errlen, -ENOMEM, "out of memory");
        }
        memcpy(j->bias_tok, sm->bias_token, sm->n_bias_token * sizeof *j->bias_tok);
        memcpy(j->bias_val, sm->bias_value, sm->n_bias_token * sizeof *j->bias_val);
        j->n_bias = (uint32_t)sm->n_bias_token;
    }
    if (sm && sm->grammar && sm->grammar[0]) {
        char gerr[256];
        const struct moe_token_bytes *tb = token_bytes(w, gerr, sizeof gerr);
        if (tb && (j->grammar = moe_grammar_parse(sm->grammar, strlen(sm->grammar), gerr,
                                                  sizeof gerr)))
            j->gram = moe_grammar_state_new(j->grammar, gerr, sizeof gerr);
        if (!j->gram) {
            /* This request fails (the daemon checked the grammar, so a limit of this worker
             * or memory); the connection and the other requests go on. */
            char msg[300];
            snprintf(msg, sizeof msg, "grammar: %s", gerr);
            moe_job_free(j);
            post_error(w, s->id, MOE_EFORMAT, msg);
            return 0;
        }
        j->tb = tb;
    }
    j->slot = -1;
    pthread_mutex_lock(&w->mu);
    if (w->in_tail)
        w->in_tail->next = j;
    else
        w->in_head = j;
    w->in_tail = j;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return 0;
}

static int on_cancel(struct worker *w, uint64_t id)
{
    if (!live_has(w, id, NULL))
        return 0; /* already finished: its Done crossed the Cancel on the wire */
    live_del(w, id);
    int rc = 0;
    pthread_mutex_lock(&w->mu);
    if (w->n_cancels == w->cap_cancels) {
        size_t cap = w->cap_cancels ? w->cap_cancels * 2 : 16;
        uint64_t *p = realloc(w->cancels, cap * sizeof *p);
        if (!p)
            rc = -ENOMEM;
        else {
            w->cancels = p;
            w->cap_cancels = cap;
        }
    }
    if (rc == 0) {
        w->cancels[w->n_cancels++] = id;
        pthread_cond_signal(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return rc;
}

static int on_msg(struct moe_ipc_conn *conn, void *user, const Moed__Envelope *env, char *err,
                  size_t errlen)
{
    struct worker *w = user;
    (void)conn;
    switch (env->msg_case) {
    case MOED__ENVELOPE__MSG_SUBMIT:
        return on_submit(w, env->submit, err, errlen);
    case MOED__ENVELOPE__MSG_CANCEL:
        return on_cancel(w, env->cancel->id);
    case MOED__ENVELOPE__MSG_SET_PLACEMENT:
        /* The CPU backend reads every expert from the store; a GPU worker with offload re-pins
         * its most-routed experts by the counts, between steps (apply_placement). */
        if (env->set_placement->n_counts == (size_t)w->n_layer * w->n_expert &&
            env->set_placement->n_counts) {
            uint64_t *c = malloc(sizeof *c * env->set_placement->n_counts);
            if (c) {
                memcpy(c, env->set_placement->counts, sizeof *c * env->set_placement->n_counts);
                pthread_mutex_lock(&w->mu);
                free(w->place_in);
                w->place_in = c;
                pthread_mutex_unlock(&w->mu);
            }
        }
        moe_ipc_log(MOE_LOG_DEBUG, "placement received (%zu counts)",
                    env->set_placement->n_counts);
        return 0;
    case MOED__ENVELOPE__MSG_EXPERT_READY: {
        const Moed__ExpertReady *x = env->expert_ready;
        if (!w->tier)
            return moe_fail(err, errlen, MOE_EFORMAT, "expert_ready for (%u, %u), but this "
                            "worker's store holds every expert", x->layer, x->expert);
        return wtier_ready(w->tier, x->layer, x->expert, x->offset, x->size, x->code, x->error,
                           err, errlen);
    }
    case MOED__ENVELOPE__MSG_SHUTDOWN:
        moe_ipc_log(MOE_LOG_INFO, "shutdown requested (%s)", env->shutdown->drain ? "drain" : "now");
        tell_compute_stop(w, env->shutdown->drain);
        return 0;
    case MOED__ENVELOPE__MSG_HELLO:
        return moe_fail(err, errlen, MOE_EFORMAT, "a second hello");
    default:
        return moe_fail(err, errlen, MOE_EFORMAT, "unexpected %s", moe_ipc_msg_name(env->msg_case));
    }
}

static void on_close(struct moe_ipc_conn *conn, void *user, int reason, const char *msg)
{
    struct worker *w = user;
    (void)conn;
    w->conn = NULL;
    if (reason != 0 && reason != UV_EOF)
        w->exit_code = 1;
    else if (reason == UV_EOF)
        moe_ipc_log(MOE_LOG_INFO, "the daemon closed the connection: %s", msg);
    /* Nobody is left to read what the compute thread would produce. */
    if (w->tier)
        wtier_abort(w->tier);
    tell_compute_stop(w, false);
}

static void send_event(struct worker *w, struct wevent *ev)
{
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    switch (ev->kind) {
    case EV_TOKEN: {
        Moed__Token t = MOED__TOKEN__INIT;
        t.id = ev->id;
        t.token = ev->token;
        if (ev->has_lp) {
            t.has_logprob = true;
            t.logprob = ev->lp.logprob;
            t.n_top_token = t.n_top_logprob = ev->lp.n_top;
            t.top_token = ev->lp.top_id;
            t.top_logprob = ev->lp.top_lp;
        }
        t.prompt = ev->prompt;
        t.prompt_pos = ev->prompt_pos;
        env.msg_case = MOED__ENVELOPE__MSG_TOKEN;
        env.token = &t;
        if (live_has(w, ev->id, NULL))
            moe_ipc_conn_send(w->conn, &env);
        return;
    }
    case EV_DONE: {
        Moed__Done d = MOED__DONE__INIT;
        d.id = ev->id;
        d.reason = ev->reason;
        d.n_prompt = ev->n_prompt;
        d.n_gen = ev->n_gen;
        d.n_cached = ev->n_cached;
        if (ev->sig) {
            d.signature = ev->sig;
            d.n_signature = (size_t)w->n_layer * w->n_expert;
        }
        env.msg_case = MOED__ENVELOPE__MSG_DONE;
        env.done = &d;
        if (live_has(w, ev->id, NULL))
            moe_ipc_conn_send(w->conn, &env);
        live_del(w, ev->id);
        return;
    }
    case EV_ERROR: {
        Moed__Error e = MOED__ERROR__INIT;
        e.id = ev->id;
        e.code = ev->code;
        e.message = ev->msg;
        env.msg_case = MOED__ENVELOPE__MSG_ERROR;
        env.error = &e;
        if (ev->id == 0 || live_has(w, ev->id, NULL))
            moe_ipc_conn_send(w->conn, &env);
        live_del(w, ev->id);
        return;
    }
    case EV_STATS: {
        Moed__RoutingStats rs = MOED__ROUTING_STATS__INIT;
        rs.n_layer = w->n_layer;
        rs.n_expert = w->n_expert;
        rs.counts = ev->counts;
        rs.n_counts = (size_t)w->n_layer * w->n_expert;
        rs.n_tokens = ev->n_tokens;
        env.msg_case = MOED__ENVELOPE__MSG_ROUTING_STATS;
        env.routing_stats = &rs;
        moe_ipc_conn_send(w->conn, &env);
        Moed__Metrics m = MOED__METRICS__INIT;
        m.tokens_generated = ev->tokens_generated;
        m.prompt_tokens = ev->prompt_tokens;
        m.running = ev->running;
        m.decode_tokens_per_s = ev->tokens_per_s;
        m.expert_hits = ev->expert_hits;
        m.expert_misses = ev->expert_misses;
        m.pool_hits = ev->ts.hits;
        m.pool_misses = ev->ts.misses;
        m.pool_waits = ev->ts.waits;
        m.pool_wait_us = ev->ts.wait_us;
        m.pool_prefetches = ev->ts.prefetches;
        if (ev->hot) {
            m.hot.data = ev->hot;
            m.hot.len = ((size_t)w->n_layer * w->n_expert + 7) / 8;
        }
        uint32_t *u32 = NULL;
        uint64_t *u64 = NULL;
        if (ev->layers && (u32 = malloc(sizeof *u32 * 2 * w->n_layer)) &&
            (u64 = malloc(sizeof *u64 * 2 * w->n_layer))) {
            m.expert_vram_bytes = ev->os.expert_vram_bytes;
            m.expert_bytes = ev->os.expert_bytes;
            /* Cache fills and prompt staging: every copy from host memory into VRAM. */
            m.expert_fill_bytes = ev->os.fill_bytes + ev->os.stage_bytes;
            m.expert_direct = ev->os.direct;
            m.expert_direct_bytes = ev->os.direct_bytes;
            m.expert_prefetched = ev->os.prefetched;
            m.expert_prefetch_bytes = ev->os.prefetch_bytes;
            m.expert_prefetch_used = ev->os.prefetch_used;
            m.expert_prefetch_wasted = ev->os.prefetch_wasted;
            for (uint32_t l = 0; l < w->n_layer; l++) {
                u32[l] = ev->layers[l].slots;
                u32[w->n_layer + l] = ev->layers[l].hot;
                u64[l] = ev->layers[l].hits;
                u64[w->n_layer + l] = ev->layers[l].misses;
            }
            m.layer_slots = u32;
            m.layer_hot = u32 + w->n_layer;
            m.layer_hits = u64;
            m.layer_misses = u64 + w->n_layer;
            m.n_layer_slots = m.n_layer_hot = m.n_layer_hits = m.n_layer_misses = w->n_layer;
        }
        env.msg_case = MOED__ENVELOPE__MSG_METRICS;
        env.metrics = &m;
        moe_ipc_conn_send(w->conn, &env);
        free(u32);
        free(u64);
        return;
    }
    case EV_XREQ: {
        Moed__ExpertRequest x = MOED__EXPERT_REQUEST__INIT;
        x.layer = ev->layer;
        x.expert = ev->expert;
        x.step = ev->id;
        x.prefetch = ev->prefetch;
        env.msg_case = MOED__ENVELOPE__MSG_EXPERT_REQUEST;
        env.expert_request = &x;
        moe_ipc_conn_send(w->conn, &env);
        return;
    }
    case EV_EXIT:
        return;
    }
}

static void async_closed(uv_handle_t *h)
{
    (void)h;
}

static void on_async(uv_async_t *a)
{
    struct worker *w = a->data;
    pthread_mutex_lock(&w->mu);
    struct wevent *ev = w->out_head;
    w->out_head = w->out_tail = NULL;
    pthread_mutex_unlock(&w->mu);
    bool exit_now = false;
    while (ev) {
        struct wevent *next = ev->next;
        if (ev->kind == EV_EXIT) {
            exit_now = true;
            if (ev->code)
                w->exit_code = 1;
        } else if (w->conn) {
            send_event(w, ev);
        }
        ev_free(ev);
        ev = next;
    }
    if (exit_now) {
        /* The compute thread posted its last event; wait until it has returned from
         * uv_async_send before the handle goes away. */
        pthread_join(w->thread, NULL);
        w->thread_started = false;
        if (w->conn)
            moe_ipc_conn_close(w->conn, true);
        uv_timer_stop(&w->hb_timer);
        uv_close((uv_handle_t *)&w->hb_timer, NULL);
        uv_close((uv_handle_t *)&w->async, async_closed);
    }
}

/* Proof of life for the daemon, sent from the event loop with the compute thread's progress. */
static void on_heartbeat(uv_timer_t *t)
{
    struct worker *w = t->data;
    if (!w->conn)
        return;
    Moed__Heartbeat h = MOED__HEARTBEAT__INIT;
    h.steps = atomic_load(&w->steps);
    h.running = (uint32_t)w->n_live;
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    env.msg_case = MOED__ENVELOPE__MSG_HEARTBEAT;
    env.heartbeat = &h;
    moe_ipc_conn_send(w->conn, &env);
}

/* ---------------------------------------------------------------------------------------------
 * Start-up */

static uint64_t rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, res = 0;
    if (!f)
        return 0;
    if (fscanf(f, "%llu %llu", &size, &res) != 2)
        res = 0;
    fclose(f);
    return res * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* Opens the model named in the Hello (weights from the store when a memfd came with it) and
 * the engine. */
static int load(struct worker *w, const Moed__Hello *h, int store_fd, char *err, size_t errlen)
{
    int rc;
    if (h->store_size && store_fd < 0)
        return moe_fail(err, errlen, MOE_EFORMAT, "hello announces a %" PRIu64 " byte store but no "
                        "descriptor came with it", h->store_size);
    if ((rc = gguf_open(&w->gguf, h->model_path, err, errlen)))
        return rc;
    if ((rc = moe_model_from_gguf(&w->model, w->gguf, err, errlen)))
        return rc;
    w->model_ok = true;
    const struct moe_hparams *hp = &w->model.hp;
    if ((h->n_vocab && h->n_vocab != hp->n_vocab) || (h->n_layer && h->n_layer != hp->n_layer) ||
        (h->n_expert && h->n_expert != hp->n_expert))
        return moe_fail(err, errlen, MOE_ERANGE, "%s has %u tokens, %u layers, %u experts; the daemon "
                        "expects %u, %u, %u", h->model_path, hp->n_vocab, hp->n_layer, hp->n_expert,
                        h->n_vocab, h->n_layer, h->n_expert);
    if (h->store_fingerprint && h->store_fingerprint != w->model.fingerprint)
        return moe_fail(err, errlen, MOE_ERANGE, "the store was built from another model "
                        "(fingerprint %016" PRIx64 ", %s has %016" PRIx64 ")", h->store_fingerprint,
                        h->model_path, w->model.fingerprint);
    if (store_fd >= 0 && (rc = moe_store_open_model(&w->store, store_fd, &w->model, err, errlen)))
        return rc;
    const char *dev = h->device[0] ? h->device : "cpu";
    if (w->store && moe_store_pool(w->store)) {
        if ((rc = wtier_new(&w->tier, w->store, &w->model, h->worker_index, tier_request, w, err,
                            errlen)))
            return rc;
        const char *verify = getenv("MOED_POOL_VERIFY");
        wtier_set_verify(w->tier, verify && verify[0] && strcmp(verify, "0") != 0);
    }
    w->n_vocab = hp->n_vocab;
    w->n_layer = hp->n_layer;
    w->n_expert = hp->n_expert;
    w->n_ctx = h->n_ctx;
    w->n_seq = h->n_seq;
    w->n_batch = h->n_batch ? h->n_batch : 512;
    if (w->n_batch < w->n_seq)
        w->n_batch = w->n_seq;
    w->signatures = h->route_signatures;
    struct moe_engine_opts eo = {.n_ctx = w->n_ctx, .n_seq = w->n_seq, .n_batch = w->n_batch,
                                 .n_threads = h->n_threads,
                                 .device = dev,
                                 .expert_src = w->tier ? wtier_source(w->tier) : NULL,
                                 .record_routes = h->route_signatures};
    if (!strncmp(eo.device, "cuda", 4)) {
        /* Expert offload: the budget and residency apply to GPU workers; the hot set follows
         * the daemon's profile when it sent one of the model's shape. */
        eo.vram_budget = h->vram_budget;
        eo.expert_residency = h->expert_residency;
        eo.cache_slots = h->cache_slots;
        eo.host_register = store_fd >= 0;
        if (h->n_expert_counts == (size_t)hp->n_layer * hp->n_expert)
            eo.expert_counts = h->expert_counts;
        else if (h->n_expert_counts)
            moe_ipc_log(MOE_LOG_WARN, "ignoring %zu profile counts (the model has %u x %u experts)",
                        h->n_expert_counts, hp->n_layer, hp->n_expert);
    }
    return moe_engine_init(&w->eng, &w->model, &eo, err, errlen);
}

static void send_ready(struct worker *w)
{
    Moed__Ready r = MOED__READY__INIT;
    r.protocol_version = MOE_IPC_PROTOCOL_VERSION;
    r.n_seq = w->n_seq;
    r.n_ctx = w->n_ctx;
    r.n_vocab = w->n_vocab;
    r.n_layer = w->n_layer;
    r.n_expert = w->n_expert;
    r.weights_bytes = w->model.bytes_dense + w->model.bytes_experts;
    r.ram_used = rss_bytes();
    struct moe_engine_info info;
    moe_engine_info(w->eng, &info);
    r.vram_used = info.device_bytes;
    r.kv_bytes = info.kv_bytes;
    r.model_fingerprint = w->model.fingerprint;
    r.pid = (int32_t)getpid();
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    env.msg_case = MOED__ENVELOPE__MSG_READY;
    env.ready = &r;
    moe_ipc_conn_send(w->conn, &env);
}

/* Sends an Error with id 0 on the raw socket, for failures before the loop runs. */
static void send_fatal(int fd, int code, const char *msg)
{
    Moed__Error e = MOED__ERROR__INIT;
    e.id = 0;
    e.code = code;
    e.message = (char *)msg;
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    env.msg_case = MOED__ENVELOPE__MSG_ERROR;
    env.error = &e;
    char err[128];
    moe_ipc_send_with_fd(fd, &env, -1, 0, err, sizeof err);
}

static void worker_free(struct worker *w)
{
    moe_engine_free(w->eng);
    moe_token_bytes_free(w->tb);
    wtier_free(w->tier);
    moe_store_close(w->store);
    if (w->model_ok)
        moe_model_free(&w->model);
    gguf_close(w->gguf);
    while (w->in_head) {
        struct moe_job *j = w->in_head;
        w->in_head = j->next;
        moe_job_free(j);
    }
    while (w->out_head) {
        struct wevent *ev = w->out_head;
        w->out_head = ev->next;
        ev_free(ev);
    }
    free(w->cancels);
    free(w->live);
    free(w->place_in);
    free(w->place_counts);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
}

int moe_worker_ipc_main(int fd, const char *argv0)
{
    char prog[64], err[512];
    const char *base = argv0 ? strrchr(argv0, '/') : NULL;
    snprintf(prog, sizeof prog, "%s[%d]", base ? base + 1 : argv0 ? argv0 : "moed-worker",
             (int)getpid());
    moe_ipc_log_init(prog, getenv("MOED_WORKER_DEBUG") ? MOE_LOG_DEBUG : MOE_LOG_INFO);
    signal(SIGPIPE, SIG_IGN);
    /* The daemon owns a worker's lifetime (it drains, then closes the socket or sends SIGTERM):
     * Ctrl-C in a terminal reaches the whole process group, and must not kill running streams. */
    signal(SIGINT, SIG_IGN);

    struct worker wk = {0}, *w = &wk;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    Moed__Envelope *hello = NULL;
    int store_fd = -1, rc, loop_ok = 0;

    rc = moe_ipc_recv_with_fd(fd, 0, HELLO_TIMEOUT_MS, &hello, &store_fd, err, sizeof err);
    if (rc == 0)
        rc = moe_ipc_validate(hello, MOE_IPC_FROM_DAEMON, NULL, err, sizeof err);
    if (rc == 0 && hello->msg_case != MOED__ENVELOPE__MSG_HELLO)
        rc = moe_fail(err, sizeof err, MOE_EFORMAT, "the first frame is a %s, not a hello",
                      moe_ipc_msg_name(hello->msg_case));
    if (rc) {
        if (rc == UV_EOF) {
            moe_ipc_log(MOE_LOG_INFO, "%s", err);
            close(fd);
            worker_free(w);
            return 0;
        }
        moe_ipc_log(MOE_LOG_ERROR, "rejected the first frame: %s; closing the connection", err);
        goto fail;
    }
    w->index = hello->hello->worker_index;
    rc = load(w, hello->hello, store_fd, err, sizeof err);
    if (rc) {
        moe_ipc_log(MOE_LOG_ERROR, "cannot start: %s", err);
        send_fatal(fd, rc, err);
        goto fail;
    }
    if (store_fd >= 0)
        close(store_fd); /* the store holds its own duplicate */
    store_fd = -1;
    struct moe_engine_info info;
    moe_engine_info(w->eng, &info);
    moe_ipc_log(MOE_LOG_INFO, "worker %u ready on %s (%s): %s, %u x %u positions, %s", w->index,
                info.device, info.desc, hello->hello->model_path, w->n_seq, w->n_ctx,
                w->store ? "weights from the shared store" : "weights mapped from the file");
    moe_ipc_free(hello);
    hello = NULL;

    if ((rc = uv_loop_init(&w->loop))) {
        moe_ipc_log(MOE_LOG_ERROR, "uv_loop_init: %s", uv_strerror(rc));
        goto fail;
    }
    loop_ok = 1;
    if ((rc = uv_async_init(&w->loop, &w->async, on_async))) {
        moe_ipc_log(MOE_LOG_ERROR, "uv_async_init: %s", uv_strerror(rc));
        goto fail;
    }
    w->async.data = w;
    struct moe_ipc_limits lim = {.n_vocab = w->n_vocab, .n_layer = w->n_layer,
                                 .n_expert = w->n_expert, .n_ctx = w->n_ctx};
    struct moe_ipc_conn_cb cb = {.on_msg = on_msg, .on_close = on_close};
    rc = moe_ipc_conn_open(&w->conn, &w->loop, fd, MOE_IPC_FROM_DAEMON, &lim, 0, "daemon connection",
                           &cb, w, err, sizeof err);
    fd = -1; /* owned (or closed) by the connection now */
    if (rc) {
        moe_ipc_log(MOE_LOG_ERROR, "%s", err);
        uv_close((uv_handle_t *)&w->async, async_closed);
        uv_run(&w->loop, UV_RUN_DEFAULT);
        goto fail;
    }
    send_ready(w);
    uv_timer_init(&w->loop, &w->hb_timer);
    w->hb_timer.data = w;
    uv_timer_start(&w->hb_timer, on_heartbeat, 1000, 1000);
    if ((rc = pthread_create(&w->thread, NULL, compute_main, w))) {
        moe_ipc_log(MOE_LOG_ERROR, "cannot start the compute thread: %s", strerror(rc));
        moe_ipc_conn_close(w->conn, false);
        uv_close((uv_handle_t *)&w->hb_timer, NULL);
        uv_close((uv_handle_t *)&w->async, async_closed);
        uv_run(&w->loop, UV_RUN_DEFAULT);
        goto fail;
    }
    w->thread_started = true;
    uv_run(&w->loop, UV_RUN_DEFAULT);
    MOE_ASSERT(!w->thread_started);
    uv_loop_close(&w->loop);
    rc = w->exit_code;
    worker_free(w);
    moe_ipc_log(MOE_LOG_INFO, "exiting (status %d)", rc);
    return rc;

fail:
    moe_ipc_free(hello);
    if (store_fd >= 0)
        close(store_fd);
    if (fd >= 0)
        close(fd);
    if (loop_ok)
        uv_loop_close(&w->loop);
    worker_free(w);
    return 1;
}

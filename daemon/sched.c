/* The scheduler: a bounded FIFO of requests, dispatched to the Ready worker with the most free
 * sequence slots. Implements daemon/sched.h; the supervisor feeds it through daemon/sched_int.h.
 *
 * Lifetime rules the code relies on: a request is in exactly one place (the queue, or one
 * worker's list) until its final callback; it is unlinked and the counters updated before any
 * callback runs, so that callbacks may submit or cancel other requests; a request whose final
 * callback is running is marked `finishing` and sched_cancel() ignores it. */
#include "daemon/sched_int.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "proto/ipc.h"
#include "store/err.h"
#include "store/workload.h"

#define MAX_ATTEMPTS 3       /* dispatches of one request before a worker crash fails it */
#define QUEUE_TICK_MS 1000

struct rlist {
    struct sched_req *head, *tail;
};

struct sched_req {
    uint64_t id;
    int32_t *prompt;
    uint32_t n_prompt;
    uint32_t max_tokens;
    struct sched_sampling sampling;
    struct sched_cb cb;
    void *user;
    int32_t worker;          /* -1 while queued */
    uint32_t n_gen;
    uint32_t n_cached;       /* from the worker's Done: prompt tokens it continued from cache */
    int32_t *bias_tok;       /* sampling.bias_* point here */
    char *grammar;           /* and sampling.grammar */
    float *bias_val;
    const struct sched_logprob *lp; /* during on_token */
    uint32_t attempts;
    uint64_t queued_at;      /* uv_now() when (re)queued */
    uint64_t last_tok_ns;    /* uv_hrtime() of its last token; 0: none yet */
    uint64_t key;            /* workload key of its prompt (moe_wl_key); 0: none */
    bool finishing;
    struct sched_req *prev, *next;
};

/* Prefix affinity: a worker keeps the KV cache of the prompts it ran (worker/batcher.h), so a
 * request goes to the worker that last saw the longest block-aligned prefix of its prompt.
 * Prompts are summarised as chained hashes of AFF_BLOCK-token blocks; each worker remembers the
 * last AFF_CAP block hashes it was sent. */
#define AFF_BLOCK 32
#define AFF_CAP 1024
#define AFF_MAX_BLOCKS 256
_Static_assert(SCHED_WEAK_AFFINITY * AFF_BLOCK >= MOE_WL_KEY_TOKENS,
               "an affinity that only repeats the workload key's tokens is weak (sched_pick)");
/* Workload keys the scheduler learns routing for (store/workload.h); the least recently used
 * goes when a new one comes. */
#define SCHED_WL_KEYS 64

struct wstate {
    bool ready;
    uint32_t n_seq, n_ctx, running;
    struct rlist reqs;
    uint64_t aff[AFF_CAP];   /* ring of block hashes of prompts sent here */
    uint32_t aff_n, aff_pos;
    uint64_t last_sent;      /* dispatch counter value of its last request; 0: none */
    double gap_s;            /* seconds between a sequence's tokens, moving average; 0: none */
    uint32_t n_gaps;         /* gaps measured (the scheduler weighs the rate from SCHED_MIN_GAPS) */
    uint8_t *hot;            /* the experts it pins ([n_layer][n_expert] bits); NULL: none known */
};

/* A worker's decode tokens/s per sequence (1 / its mean gap); 0: not measured. */
static double wrate(const struct wstate *w)
{
    return w->gap_s > 0.0 ? 1.0 / w->gap_s : 0.0;
}

/* Gaps a worker's rate rests on before the scheduler weighs it: the first tokens of a fresh
 * worker (page faults, cold caches) and a handful of sub-millisecond gaps are noise. */
#define SCHED_MIN_GAPS 64

struct sched {
    uv_loop_t *loop;
    uv_timer_t timer;
    struct moed_workers *ws;
    struct sched_config cfg;
    int32_t *eog;
    struct wstate *w;
    struct sched_cand *cand; /* [n_workers], pick_worker's view of them */
    struct rlist queue;
    uint32_t n_queued, n_running;
    uint64_t next_id;
    bool draining;
    bool dispatching;
    uint64_t sent;           /* requests dispatched, for the workers' last_sent */
    char drain_msg[128];
    struct sched_stats st;
    struct moe_wl_table wl;  /* workloads (cfg.n_layer, n_expert); wl.e NULL: none */
    size_t hot_bytes;        /* a hot bitmap's size */
    void (*idle_cb)(void *user);
    void *idle_user;
    void (*close_cb)(void *user);
    void *close_user;
};

static void list_remove(struct rlist *l, struct sched_req *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        l->head = r->next;
    if (r->next)
        r->next->prev = r->prev;
    else
        l->tail = r->prev;
    r->prev = r->next = NULL;
}

static void list_push_back(struct rlist *l, struct sched_req *r)
{
    r->next = NULL;
    r->prev = l->tail;
    if (l->tail)
        l->tail->next = r;
    else
        l->head = r;
    l->tail = r;
}

static void list_push_front(struct rlist *l, struct sched_req *r)
{
    r->prev = NULL;
    r->next = l->head;
    if (l->head)
        l->head->prev = r;
    else
        l->tail = r;
    l->head = r;
}

static void req_free(struct sched_req *r)
{
    free(r->prompt);
    free(r->bias_tok);
    free(r->bias_val);
    free(r->grammar);
    free(r);
}

/* Unlinks r from wherever it is and fixes the counters. */
static void req_detach(struct sched *s, struct sched_req *r)
{
    if (r->worker < 0) {
        list_remove(&s->queue, r);
        s->n_queued--;
    } else {
        struct wstate *w = &s->w[r->worker];
        list_remove(&w->reqs, r);
        w->running--;
        s->n_running--;
        r->worker = -1;
    }
}

/* Final callback for a detached request, then free. */
static void req_fail(struct sched *s, struct sched_req *r, int status, const char *msg)
{
    r->finishing = true;
    s->st.requests_failed++;
    if (r->cb.on_error)
        r->cb.on_error(r, r->user, status, msg);
    req_free(r);
}

static void check_idle(struct sched *s)
{
    if (s->n_running == 0 && s->idle_cb)
        s->idle_cb(s->idle_user);
}

/* Chained hashes of the prompt's whole blocks; returns how many (at most AFF_MAX_BLOCKS). */
static uint32_t block_hashes(const int32_t *p, uint32_t n, uint64_t *h)
{
    uint32_t nb = n / AFF_BLOCK;
    if (nb > AFF_MAX_BLOCKS)
        nb = AFF_MAX_BLOCKS;
    uint64_t prev = 0x9e3779b97f4a7c15ull;
    for (uint32_t k = 0; k < nb; k++)
        h[k] = prev = XXH3_64bits_withSeed(p + (size_t)k * AFF_BLOCK, AFF_BLOCK * sizeof *p, prev);
    return nb;
}

static bool aff_has(const struct wstate *w, uint64_t h)
{
    for (uint32_t i = 0; i < w->aff_n; i++)
        if (w->aff[i] == h)
            return true;
    return false;
}

/* A free worker whose rate is measured within SCHED_SPEED_BAND of the fastest, or not yet. */
static bool fast_free(const struct sched_cand *c, double fastest)
{
    return c->free && !(c->rate > 0.0 && c->rate * SCHED_SPEED_BAND < fastest);
}

/* A candidate's affinity where it outranks coverage (SCHED_WEAK_AFFINITY), else 0. */
static uint32_t strong_affinity(const struct sched_cand *c)
{
    return c->affinity > SCHED_WEAK_AFFINITY ? c->affinity : 0;
}

int32_t sched_pick(const struct sched_cand *c, uint32_t n)
{
    double fastest = 0.0;
    for (uint32_t i = 0; i < n; i++)
        if (c[i].free && c[i].rate > fastest)
            fastest = c[i].rate;
    /* The longest strong affinity among the fast free workers, and the best coverage known
     * among those: the rest is tie-breaking. */
    uint32_t aff = 0;
    for (uint32_t i = 0; i < n; i++)
        if (fast_free(&c[i], fastest) && strong_affinity(&c[i]) > aff)
            aff = strong_affinity(&c[i]);
    double cover = -1.0;
    for (uint32_t i = 0; i < n; i++)
        if (fast_free(&c[i], fastest) && strong_affinity(&c[i]) == aff && c[i].coverage > cover)
            cover = c[i].coverage;
    int32_t best = -1;
    for (uint32_t i = 0; i < n; i++) {
        if (!fast_free(&c[i], fastest) || strong_affinity(&c[i]) < aff ||
            (c[i].coverage >= 0.0 && c[i].coverage < cover - SCHED_COVERAGE_MARGIN))
            continue;
        bool take = best < 0 || c[i].affinity > c[best].affinity;
        if (!take && c[i].affinity == c[best].affinity) {
            const bool ui = c[i].rate <= 0.0, ub = c[best].rate <= 0.0;
            take = (ui && !ub) ||
                   (ui == ub && (c[i].n_free > c[best].n_free ||
                                 (c[i].n_free == c[best].n_free &&
                                  c[i].last_sent < c[best].last_sent)));
        }
        if (take)
            best = (int32_t)i;
    }
    return best;
}

/* The worker for request r (sched_pick on what the scheduler knows of each). */
static int32_t pick_worker(struct sched *s, const struct sched_req *r, const uint64_t *h,
                           uint32_t nb)
{
    struct sched_cand *cv = s->cand;
    const struct moe_wl_entry *we = s->wl.e ? moe_wl_find(&s->wl, r->key) : NULL;
    for (uint32_t i = 0; i < s->cfg.n_workers; i++) {
        const struct wstate *w = &s->w[i];
        uint32_t k = 0;
        const bool free = w->ready && w->running < w->n_seq;
        while (free && k < nb && aff_has(w, h[k]))
            k++;
        cv[i] = (struct sched_cand){free, k, free ? w->n_seq - w->running : 0,
                                    w->n_gaps >= SCHED_MIN_GAPS ? wrate(w) : 0.0, w->last_sent,
                                    free && we && w->hot ? moe_wl_coverage(&s->wl, we, w->hot)
                                                         : -1.0};
    }
    return sched_pick(cv, s->cfg.n_workers);
}

static void aff_add(struct sched *s, struct wstate *w, const uint64_t *h, uint32_t nb)
{
    for (uint32_t k = 0; k < nb; k++) {
        if (aff_has(w, h[k]))
            continue;
        w->aff[w->aff_pos] = h[k];
        w->aff_pos = (w->aff_pos + 1) % AFF_CAP;
        if (w->aff_n < AFF_CAP)
            w->aff_n++;
    }
    w->last_sent = ++s->sent;
}

static void dispatch(struct sched *s)
{
    if (s->dispatching)
        return;
    s->dispatching = true;
    uint64_t h[AFF_MAX_BLOCKS];
    while (s->queue.head) {
        struct sched_req *r = s->queue.head;
        const uint32_t nb = block_hashes(r->prompt, r->n_prompt, h);
        int32_t best = pick_worker(s, r, h, nb);
        if (best < 0)
            break;
        int rc = moed_workers_send_submit(s->ws, (uint32_t)best, r->id, r->prompt, r->n_prompt,
                                          r->max_tokens, &r->sampling, s->eog,
                                          r->sampling.ignore_eos ? 0 : s->cfg.n_eog);
        /* moed_workers_start bounds n_ctx so that any prompt sched_submit accepts fits a frame. */
        MOE_ASSERT(rc != MOE_ETOOBIG);
        if (rc) {
            /* The connection is going away; the supervisor reports the worker lost. */
            s->w[best].ready = false;
            continue;
        }
        list_remove(&s->queue, r);
        s->n_queued--;
        r->worker = best;
        r->attempts++;
        aff_add(s, &s->w[best], h, nb);
        list_push_back(&s->w[best].reqs, r);
        s->w[best].running++;
        s->n_running++;
    }
    s->dispatching = false;
}

static uint32_t n_ready(const struct sched *s)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < s->cfg.n_workers; i++)
        n += s->w[i].ready;
    return n;
}

/* Requests must never wait forever: when no worker has been ready for queue_wait_ms (every
 * worker keeps crashing, the model does not load), queued requests are failed. */
static void on_tick(uv_timer_t *t)
{
    struct sched *s = t->data;
    if (!s->queue.head || n_ready(s) > 0)
        return;
    uint64_t now = uv_now(s->loop);
    struct sched_req *r = s->queue.head;
    while (r) {
        struct sched_req *next = r->next;
        if (now - r->queued_at >= s->cfg.queue_wait_ms) {
            req_detach(s, r);
            char msg[160];
            snprintf(msg, sizeof msg, "no worker is available (waited %.1f s; workers are restarting)",
                     (double)(now - r->queued_at) / 1000.0);
            req_fail(s, r, 503, msg);
        }
        r = next;
    }
}

int sched_create(struct sched **out, uv_loop_t *loop, struct moed_workers *ws,
                 const struct sched_config *cfg)
{
    struct sched *s = calloc(1, sizeof *s);
    if (!s)
        return -ENOMEM;
    s->loop = loop;
    s->ws = ws;
    s->cfg = *cfg;
    s->next_id = 1;
    s->w = calloc(cfg->n_workers, sizeof *s->w);
    s->cand = calloc(cfg->n_workers, sizeof *s->cand);
    if (cfg->n_eog) {
        s->eog = malloc(cfg->n_eog * sizeof *s->eog);
        if (s->eog)
            memcpy(s->eog, cfg->eog, cfg->n_eog * sizeof *s->eog);
    }
    if (!s->w || !s->cand || (cfg->n_eog && !s->eog)) {
        free(s->w);
        free(s->cand);
        free(s->eog);
        free(s);
        return -ENOMEM;
    }
    s->cfg.eog = s->eog;
    /* The workload table: keys seen in requests, with what their signatures taught. */
    if (cfg->n_layer && cfg->n_expert && cfg->n_workers <= MOE_WL_MAX_WORKERS) {
        int rc = moe_wl_init(&s->wl, cfg->n_layer, cfg->n_expert, cfg->n_workers, SCHED_WL_KEYS);
        if (rc) {
            sched_destroy(s);
            return rc == -ENOMEM ? rc : -EINVAL;
        }
        s->hot_bytes = ((size_t)cfg->n_layer * cfg->n_expert + 7) / 8;
    }
    uv_timer_init(loop, &s->timer);
    s->timer.data = s;
    uv_timer_start(&s->timer, on_tick, QUEUE_TICK_MS, QUEUE_TICK_MS);
    uv_unref((uv_handle_t *)&s->timer);
    *out = s;
    return 0;
}

static void timer_closed(uv_handle_t *h)
{
    struct sched *s = h->data;
    if (s->close_cb)
        s->close_cb(s->close_user);
}

void sched_close(struct sched *s, void (*cb)(void *user), void *user)
{
    s->close_cb = cb;
    s->close_user = user;
    uv_close((uv_handle_t *)&s->timer, timer_closed);
}

void sched_destroy(struct sched *s)
{
    if (!s)
        return;
    while (s->queue.head) {
        struct sched_req *r = s->queue.head;
        list_remove(&s->queue, r);
        req_free(r);
    }
    for (uint32_t i = 0; i < s->cfg.n_workers; i++)
        while (s->w[i].reqs.head) {
            struct sched_req *r = s->w[i].reqs.head;
            list_remove(&s->w[i].reqs, r);
            req_free(r);
        }
    for (uint32_t i = 0; s->w && i < s->cfg.n_workers; i++)
        free(s->w[i].hot);
    moe_wl_free(&s->wl);
    free(s->w);
    free(s->cand);
    free(s->eog);
    free(s);
}

struct sched_req *sched_submit(struct sched *s, const struct sched_params *p, int *http_status,
                               char *msg, size_t msglen)
{
    int status = 0;
    if (s->draining) {
        status = 503;
        snprintf(msg, msglen, "%s", s->drain_msg);
    } else if (p->n_prompt == 0) {
        status = 400;
        snprintf(msg, msglen, "the prompt is empty");
    } else if (p->n_prompt > s->cfg.n_ctx) {
        status = 400;
        snprintf(msg, msglen, "the prompt has %u tokens; the context holds %u", p->n_prompt,
                 s->cfg.n_ctx);
    } else if (p->max_tokens == 0 || p->max_tokens > MOE_IPC_MAX_CTX) {
        status = 400;
        snprintf(msg, msglen, "max_tokens %u is outside 1..%u", p->max_tokens, MOE_IPC_MAX_CTX);
    } else if (s->n_queued >= s->cfg.queue_max) {
        status = 503;
        snprintf(msg, msglen, "the server is overloaded: %u requests are waiting", s->n_queued);
    }
    if (status) {
        if (http_status)
            *http_status = status;
        return NULL;
    }
    struct sched_req *r = calloc(1, sizeof *r);
    if (r)
        r->prompt = malloc(p->n_prompt * sizeof *r->prompt);
    if (r && p->sampling.n_bias) {
        r->bias_tok = malloc(p->sampling.n_bias * sizeof *r->bias_tok);
        r->bias_val = malloc(p->sampling.n_bias * sizeof *r->bias_val);
    }
    if (r && p->sampling.grammar)
        r->grammar = strdup(p->sampling.grammar);
    if (!r || !r->prompt || (p->sampling.n_bias && (!r->bias_tok || !r->bias_val)) ||
        (p->sampling.grammar && !r->grammar)) {
        if (r)
            req_free(r);
        if (http_status)
            *http_status = 503;
        snprintf(msg, msglen, "out of memory");
        return NULL;
    }
    memcpy(r->prompt, p->prompt, p->n_prompt * sizeof *r->prompt);
    r->id = s->next_id++;
    r->n_prompt = p->n_prompt;
    r->max_tokens = p->max_tokens;
    r->sampling = p->sampling;
    if (p->sampling.n_bias) {
        memcpy(r->bias_tok, p->sampling.bias_tok, p->sampling.n_bias * sizeof *r->bias_tok);
        memcpy(r->bias_val, p->sampling.bias_val, p->sampling.n_bias * sizeof *r->bias_val);
    }
    r->sampling.bias_tok = r->bias_tok;
    r->sampling.bias_val = r->bias_val;
    r->sampling.grammar = r->grammar;
    r->cb = p->cb;
    r->user = p->user;
    r->worker = -1;
    r->key = moe_wl_key(r->prompt, r->n_prompt);
    r->queued_at = uv_now(s->loop);
    list_push_back(&s->queue, r);
    s->n_queued++;
    s->st.requests_total++;
    dispatch(s);
    return r;
}

void sched_cancel(struct sched *s, struct sched_req *r)
{
    if (!r || r->finishing)
        return;
    int32_t w = r->worker;
    req_detach(s, r);
    if (w >= 0)
        moed_workers_send_cancel(s->ws, (uint32_t)w, r->id);
    req_free(r);
    if (w >= 0) {
        dispatch(s);
        check_idle(s);
    }
}

double sched_worker_rate(const struct sched *s, uint32_t w)
{
    return s && w < s->cfg.n_workers ? wrate(&s->w[w]) : 0.0;
}

void sched_get_stats(const struct sched *s, struct sched_stats *out)
{
    *out = s->st;
    out->queued = s->n_queued;
    out->running = s->n_running;
    out->workers_ready = n_ready(s);
    out->workers_total = s->cfg.n_workers;
}

size_t sched_slots(const struct sched *s, struct sched_slot *out, size_t cap)
{
    size_t n = 0;
    for (uint32_t w = 0; w < s->cfg.n_workers; w++) {
        const struct wstate *ws = &s->w[w];
        if (!ws->ready)
            continue;
        const struct sched_req *r = ws->reqs.head;
        for (uint32_t k = 0; k < ws->n_seq; k++, n++) {
            if (n >= cap)
                continue;
            out[n] = (struct sched_slot){.worker = w, .n_ctx = ws->n_ctx};
            if (r) {
                out[n].id = r->id;
                out[n].n_prompt = r->n_prompt;
                out[n].n_gen = r->n_gen;
                out[n].max_tokens = r->max_tokens;
                r = r->next;
            }
        }
    }
    return n;
}

void sched_worker_ready(struct sched *s, uint32_t w, uint32_t n_seq, uint32_t n_ctx)
{
    if (w >= s->cfg.n_workers)
        return;
    s->w[w].ready = true;
    s->w[w].n_seq = n_seq;
    s->w[w].n_ctx = n_ctx;
    s->w[w].gap_s = 0.0; /* measured again (a restarted worker may run elsewhere) */
    s->w[w].n_gaps = 0;
    dispatch(s);
}

static struct sched_req *find(struct sched *s, uint32_t w, uint64_t id)
{
    if (w >= s->cfg.n_workers)
        return NULL;
    for (struct sched_req *r = s->w[w].reqs.head; r; r = r->next)
        if (r->id == id)
            return r;
    return NULL;
}

void sched_worker_lost(struct sched *s, uint32_t w, const char *why)
{
    if (w >= s->cfg.n_workers)
        return;
    struct wstate *ws = &s->w[w];
    ws->ready = false;
    ws->aff_n = ws->aff_pos = 0; /* a new process keeps no cache */
    free(ws->hot);               /* nor its pinned experts */
    ws->hot = NULL;
    /* Take the whole list first: callbacks below may submit or cancel other requests. */
    struct rlist lost = ws->reqs;
    ws->reqs.head = ws->reqs.tail = NULL;
    struct rlist retry = {0};
    uint32_t n = 0;
    for (struct sched_req *r = lost.head; r; r = r->next)
        n++, r->worker = -1;
    ws->running = 0;
    s->n_running -= n;
    while (lost.head) {
        struct sched_req *r = lost.head;
        list_remove(&lost, r);
        if (r->n_gen == 0 && r->attempts < MAX_ATTEMPTS && !s->draining) {
            list_push_back(&retry, r);
            continue;
        }
        char msg[320];
        int status;
        if (r->n_gen > 0) {
            status = 500;
            snprintf(msg, sizeof msg, "worker %u failed during generation after %u tokens: %s", w,
                     r->n_gen, why);
        } else {
            status = 503;
            snprintf(msg, sizeof msg, "worker %u failed before generating (attempt %u of %u): %s", w,
                     r->attempts, MAX_ATTEMPTS, why);
        }
        req_fail(s, r, status, msg);
    }
    /* Re-queued requests go first, in their original order: they have waited longest. */
    while (retry.tail) {
        struct sched_req *r = retry.tail;
        list_remove(&retry, r);
        r->queued_at = uv_now(s->loop);
        r->last_tok_ns = 0;
        list_push_front(&s->queue, r);
        s->n_queued++;
    }
    dispatch(s);
    check_idle(s);
}

void sched_worker_token(struct sched *s, uint32_t w, uint64_t id, int32_t token,
                        const struct sched_logprob *lp)
{
    struct sched_req *r = find(s, w, id);
    if (!r)
        return; /* cancelled while the token was on the wire */
    /* The worker's decode rate per sequence from the gaps between a request's tokens (the first
     * token's wait is the prompt's, not counted): a moving average of the gaps, not of their
     * inverses, so that tokens that arrive together in one read (a gap near 0) and the longer
     * gap before them average out instead of counting as a burst of speed. */
    const uint64_t now = uv_hrtime();
    if (r->last_tok_ns && now >= r->last_tok_ns) {
        const double dt = (double)(now - r->last_tok_ns) * 1e-9;
        struct wstate *ws = &s->w[w];
        /* The mean of the first SCHED_MIN_GAPS gaps, then a moving average. */
        const uint32_t k = ws->n_gaps < SCHED_MIN_GAPS ? ++ws->n_gaps : SCHED_MIN_GAPS + 1;
        ws->gap_s += (dt - ws->gap_s) * (k <= SCHED_MIN_GAPS ? 1.0 / k : 0.05);
    }
    r->last_tok_ns = now;
    r->n_gen++;
    s->st.gen_tokens_total++;
    r->lp = lp;
    if (r->cb.on_token)
        r->cb.on_token(r, r->user, token); /* may cancel r: do not touch it afterwards */
}

void sched_worker_prompt_logprob(struct sched *s, uint32_t w, uint64_t id, uint32_t pos,
                                 int32_t token, const struct sched_logprob *lp)
{
    struct sched_req *r = find(s, w, id);
    if (!r || !r->sampling.prompt_logprobs || pos >= r->n_prompt || !lp)
        return;
    if (r->cb.on_prompt_logprob)
        r->cb.on_prompt_logprob(r, r->user, pos, token, lp);
}

const struct sched_logprob *sched_req_logprob(const struct sched_req *r)
{
    return r->sampling.logprobs ? r->lp : NULL;
}

void sched_worker_done(struct sched *s, uint32_t w, uint64_t id, int finish_reason,
                       uint32_t n_prompt, uint32_t n_gen, uint32_t n_cached, const uint32_t *sig,
                       size_t n_sig)
{
    struct sched_req *r = find(s, w, id);
    if (!r)
        return;
    req_detach(s, r);
    /* What its prompt routed teaches its workload's entry (the table is bounded: a new key may
     * push out the one unused longest). */
    if (s->wl.e && r->key && n_sig == (size_t)s->wl.n_layer * s->wl.n_expert &&
        n_cached <= n_prompt)
        moe_wl_learn(&s->wl, r->key, w, sig, n_prompt - n_cached);
    r->n_cached = n_cached;
    s->st.prompt_tokens_total += n_prompt;
    r->finishing = true;
    if (r->cb.on_done)
        r->cb.on_done(r, r->user, finish_reason == 1 ? SCHED_FINISH_LENGTH : SCHED_FINISH_STOP,
                      n_prompt, n_gen);
    req_free(r);
    dispatch(s);
    check_idle(s);
}

void sched_worker_hot(struct sched *s, uint32_t w, const uint8_t *bits, size_t nbytes)
{
    if (w >= s->cfg.n_workers)
        return;
    struct wstate *ws = &s->w[w];
    if (!bits || !s->hot_bytes || nbytes != s->hot_bytes) {
        free(ws->hot);
        ws->hot = NULL;
        return;
    }
    if (!ws->hot && !(ws->hot = malloc(nbytes)))
        return; /* placed as if it pinned nothing */
    memcpy(ws->hot, bits, nbytes);
}

const uint8_t *sched_worker_hot_bits(const struct sched *s, uint32_t w)
{
    return w < s->cfg.n_workers ? s->w[w].hot : NULL;
}

const int32_t *sched_eog(const struct sched *s, uint32_t *n)
{
    *n = s->cfg.n_eog;
    return s->eog;
}

struct moe_wl_table *sched_workloads(struct sched *s)
{
    return s->wl.e ? &s->wl : NULL;
}

uint32_t sched_req_cached(const struct sched_req *r)
{
    return r->n_cached;
}

void sched_worker_error(struct sched *s, uint32_t w, uint64_t id, int code, const char *msg)
{
    struct sched_req *r = find(s, w, id);
    if (!r)
        return;
    req_detach(s, r);
    char m[320];
    snprintf(m, sizeof m, "worker %u: %s (%s)", w, msg && msg[0] ? msg : "request failed",
             moe_strerror(code));
    req_fail(s, r, 500, m);
    dispatch(s);
    check_idle(s);
}

void sched_drain(struct sched *s, const char *msg)
{
    s->draining = true;
    snprintf(s->drain_msg, sizeof s->drain_msg, "%s", msg);
    while (s->queue.head) {
        struct sched_req *r = s->queue.head;
        req_detach(s, r);
        req_fail(s, r, 503, msg);
    }
}

void sched_abort_running(struct sched *s, int status, const char *msg)
{
    for (uint32_t i = 0; i < s->cfg.n_workers; i++) {
        while (s->w[i].reqs.head) {
            struct sched_req *r = s->w[i].reqs.head;
            uint64_t id = r->id;
            req_detach(s, r);
            moed_workers_send_cancel(s->ws, i, id);
            req_fail(s, r, status, msg);
        }
    }
    check_idle(s);
}

uint32_t sched_n_running(const struct sched *s)
{
    return s->n_running;
}

uint32_t sched_n_running_on(const struct sched *s, uint32_t w)
{
    return w < s->cfg.n_workers ? s->w[w].running : 0;
}

void sched_set_idle_cb(struct sched *s, void (*cb)(void *user), void *user)
{
    s->idle_cb = cb;
    s->idle_user = user;
}

/* Worker supervisor: spawn, handshake, watch, restart, stop. See daemon/supervisor.h.
 *
 * A worker slot goes STARTING -> READY -> (dies) BACKOFF -> STARTING ..., or from BACKOFF to
 * FAILED when too many starts in a row ended before Ready. A death is noticed
 * either by the process exit callback or by the IPC connection closing (EOF, a malformed frame);
 * whichever comes first reports the slot's requests lost and makes sure the other follows (the
 * process is killed when its connection broke). The slot is restarted once both the process and
 * the connection are gone, after the backoff. */
#include "daemon/supervisor.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/devices.h"
#include "daemon/log.h"
#include "daemon/sched_int.h"
#include "proto/ipc.h"
#include "store/err.h"

#define BACKOFF_MIN_MS 100
#define BACKOFF_MAX_MS 10000
#define HEALTHY_RESET_MS 60000 /* a worker up this long resets the backoff */
#define KILL_AFTER_MS 5000     /* after Shutdown, SIGKILL a worker that has not exited */
#define EXIT_GRACE_MS 1000     /* after a worker hangs up, wait this long for its exit status */
#define MAX_INIT_FAILURES 5    /* default: starts in a row that end before Ready, then give up */

struct wslot {
    struct moed_workers *ws;
    uint32_t index;
    enum moed_worker_state state;
    uv_process_t proc;
    bool proc_running;       /* process started and its exit not seen yet */
    bool proc_handle_open;   /* uv_process_t needs closing */
    struct moe_ipc_conn *conn;
    uv_timer_t timer;        /* ready timeout / restart backoff / kill after shutdown */
    bool down_reported;      /* requests of this incarnation handed back to the scheduler */
    bool err_set;            /* info.last_error explains this incarnation's end */
    char grace_why[160];     /* why the connection ended, while waiting for the exit */
    bool restart_pending;    /* the backoff timer runs for the next incarnation */
    uint32_t fails;          /* consecutive failures, for the backoff */
    uint32_t init_fails;     /* consecutive incarnations that ended before Ready */
    uint64_t ready_at;       /* uv_now() at Ready; 0 when not ready */
    uint64_t last_msg_ms;    /* uv_now() of the last message */
    uint64_t progress_ms;    /* uv_now() when its steps last advanced (or it had nothing to do) */
    uint64_t hb_steps;       /* steps in the last Heartbeat */
    uint32_t hb_running;     /* requests in flight in the last Heartbeat */
    struct moed_worker_info info;
    struct moed_worker_offload off; /* arrays owned here; from the last Metrics */
    uint8_t *own_place;      /* its own placement (complementary hot sets), or NULL: the common */
    uint64_t *own_counts;
    struct errpipe *ep;      /* this incarnation's stderr, while open */
};

struct moed_workers {
    uv_loop_t *loop;
    struct moed_workers_opts o;
    char *model_path, *worker_bin;
    char (*devices)[32];
    struct moe_ipc_limits lim;
    struct wslot *slots;
    struct sched *sched;
    uint8_t *placement;
    size_t placement_len;
    uint64_t *placement_counts;      /* [n_layer][n_expert] or NULL */
    bool all_ready_once;
    bool stopping, shutdown_sent, stopped;
    uv_timer_t stop_timer;
    uv_timer_t wedge_timer;  /* every second: workers that went silent or stopped progressing */
    uint64_t silent_ms, stall_ms;
    uint32_t open_handles;   /* handles whose close callback has not run */
    void (*on_stopped)(void *user);
    void *stopped_user;
    bool sched_closed;
};

static void slot_spawn(struct wslot *w);
static void check_all_ready(struct moed_workers *ws);

/* Copies a message, cutting it to fit (gcc's -Wformat-truncation dislikes snprintf for this). */
static void copy_msg(char *dst, size_t n, const char *src)
{
    size_t len = strlen(src);
    if (len >= n)
        len = n - 1;
    memcpy(dst, src, len);
    dst[len] = 0;
}
static void maybe_stopped(struct moed_workers *ws);

static void set_state(struct wslot *w, enum moed_worker_state st)
{
    if (w->state == st)
        return;
    w->state = st;
    w->info.state = st;
    if (w->ws->o.on_worker_state)
        w->ws->o.on_worker_state(w->ws->o.user, w->index, st);
}

static void handle_closed(uv_handle_t *h)
{
    struct moed_workers *ws = h->data;
    ws->open_handles--;
    maybe_stopped(ws);
}

static void close_handle(struct moed_workers *ws, uv_handle_t *h)
{
    if (uv_is_closing(h))
        return;
    h->data = ws;
    ws->open_handles++;
    uv_close(h, handle_closed);
}

/* on_ready, the first time every worker has settled: Ready, or failed for good. */
static void check_all_ready(struct moed_workers *ws)
{
    if (ws->all_ready_once)
        return;
    uint32_t ready = 0;
    for (uint32_t i = 0; i < ws->o.n_workers; i++) {
        enum moed_worker_state st = ws->slots[i].state;
        if (st != MOED_WORKER_READY && st != MOED_WORKER_FAILED)
            return;
        ready += st == MOED_WORKER_READY;
    }
    if (!ready)
        return;
    ws->all_ready_once = true;
    if (ws->o.on_ready)
        ws->o.on_ready(ws->o.user);
}

/* ---------------------------------------------------------------------------------------------
 * Deaths and restarts */

static uint64_t backoff_ms(uint32_t fails)
{
    uint64_t d = BACKOFF_MIN_MS;
    for (uint32_t i = 1; i < fails && d < BACKOFF_MAX_MS; i++)
        d *= 2;
    return d < BACKOFF_MAX_MS ? d : BACKOFF_MAX_MS;
}

static void on_restart_timer(uv_timer_t *t)
{
    struct wslot *w = t->data;
    w->restart_pending = false;
    if (w->ws->stopping || w->proc_running || w->conn)
        return;
    slot_spawn(w);
}

/* Both the process and the connection are gone: schedule the next incarnation. */
static void maybe_restart(struct wslot *w)
{
    struct moed_workers *ws = w->ws;
    if (w->proc_running || w->conn)
        return;
    if (ws->stopping) {
        uv_timer_stop(&w->timer);
        w->restart_pending = false;
        set_state(w, MOED_WORKER_STOPPED);
        maybe_stopped(ws);
        return;
    }
    if (w->restart_pending)
        return;
    uint64_t now = uv_now(ws->loop);
    if (w->ready_at && now - w->ready_at >= HEALTHY_RESET_MS)
        w->fails = 0;
    w->init_fails = w->ready_at ? 0 : w->init_fails + 1;
    w->ready_at = 0;
    if (w->init_fails >= ws->o.max_init_failures) {
        moe_ipc_log(MOE_LOG_ERROR, "worker %u (%s): giving up after %u starts in a row that ended "
                    "before it was ready (last: %s); it stays failed until moed is restarted",
                    w->index, ws->devices[w->index], w->init_fails,
                    w->info.last_error[0] ? w->info.last_error : "it exited");
        set_state(w, MOED_WORKER_FAILED);
        check_all_ready(ws);
        return;
    }
    w->fails++;
    uint64_t d = backoff_ms(w->fails);
    set_state(w, MOED_WORKER_BACKOFF);
    w->restart_pending = true;
    moe_ipc_log(MOE_LOG_WARN, "worker %u: restarting in %" PRIu64 " ms (%s)", w->index, d,
                w->info.last_error[0] ? w->info.last_error : "it exited");
    uv_timer_start(&w->timer, on_restart_timer, d, 0);
}

/* The first sign of death: hand the requests back and make sure the rest of the worker follows. */
static void slot_down(struct wslot *w, const char *why)
{
    /* The first explanation of this incarnation's end is the useful one. */
    if (why && why[0] && !w->err_set) {
        copy_msg(w->info.last_error, sizeof w->info.last_error, why);
        w->err_set = true;
    }
    if (!w->down_reported) {
        w->down_reported = true;
        if (w->ws->sched)
            sched_worker_lost(w->ws->sched, w->index, w->info.last_error);
    }
    uv_timer_stop(&w->timer);
    if (w->conn)
        moe_ipc_conn_close(w->conn, false);
    if (w->proc_running)
        uv_process_kill(&w->proc, SIGKILL);
    maybe_restart(w);
}

/* A ready worker that sends nothing (not even its Heartbeat) for silent_ms is stopped or hung; one
 * whose compute steps do not advance for stall_ms while it has requests is wedged. Either is
 * killed: its requests go back to the scheduler (retried, or failed if they already streamed)
 * and it is restarted. */
static void on_wedge_timer(uv_timer_t *t)
{
    struct moed_workers *ws = t->data;
    uint64_t now = uv_now(ws->loop);
    for (uint32_t i = 0; i < ws->o.n_workers; i++) {
        struct wslot *w = &ws->slots[i];
        if (w->state != MOED_WORKER_READY || !w->conn)
            continue;
        char why[200];
        if (now - w->last_msg_ms > ws->silent_ms)
            snprintf(why, sizeof why, "worker %u (pid %d) sent nothing for %.1f s (stopped or hung); "
                     "killed", w->index, w->info.pid, (double)(now - w->last_msg_ms) / 1e3);
        else if (w->hb_running && now - w->progress_ms > ws->stall_ms)
            snprintf(why, sizeof why, "worker %u (pid %d) made no progress for %.1f s with %u "
                     "requests; killed", w->index, w->info.pid,
                     (double)(now - w->progress_ms) / 1e3, w->hb_running);
        else
            continue;
        moe_ipc_log(MOE_LOG_ERROR, "%s", why);
        slot_down(w, why);
    }
}

static void errpipe_finish(struct wslot *w);

static void on_exit_cb(uv_process_t *p, int64_t status, int term_signal)
{
    struct wslot *w = p->data;
    errpipe_finish(w); /* its last lines before the news of its end */
    char why[160];
    if (term_signal)
        snprintf(why, sizeof why, "worker %u (pid %d) was killed by signal %d", w->index,
                 w->info.pid, term_signal);
    else
        snprintf(why, sizeof why, "worker %u (pid %d) exited with status %d", w->index, w->info.pid,
                 (int)status);
    if (w->state == MOED_WORKER_STOPPING)
        moe_ipc_log(MOE_LOG_INFO, "%s", why);
    else
        moe_ipc_log(MOE_LOG_ERROR, "%s", why);
    w->proc_running = false;
    w->info.pid = 0;
    w->info.running = 0;
    w->proc_handle_open = false;
    /* Nothing of this process reads the store any more: what it pinned can go. */
    if (w->ws->o.on_worker_reaped)
        w->ws->o.on_worker_reaped(w->ws->o.user, w->index);
    close_handle(w->ws, (uv_handle_t *)&w->proc);
    slot_down(w, why);
}

/* ---------------------------------------------------------------------------------------------
 * Messages from a worker */

static void send_placement(struct wslot *w)
{
    struct moed_workers *ws = w->ws;
    const uint8_t *bits = w->own_place ? w->own_place : ws->placement;
    const uint64_t *counts = w->own_place ? w->own_counts : ws->placement_counts;
    if (!bits || !w->conn)
        return;
    Moed__SetPlacement p = MOED__SET_PLACEMENT__INIT;
    p.n_layer = ws->lim.n_layer;
    p.n_expert = ws->lim.n_expert;
    p.hot.data = (uint8_t *)bits;
    p.hot.len = ws->placement_len;
    if (counts) {
        p.counts = (uint64_t *)counts;
        p.n_counts = (size_t)ws->lim.n_layer * ws->lim.n_expert;
    }
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    env.msg_case = MOED__ENVELOPE__MSG_SET_PLACEMENT;
    env.set_placement = &p;
    moe_ipc_conn_send(w->conn, &env);
}

static int on_ready_msg(struct wslot *w, const Moed__Ready *r, char *err, size_t errlen)
{
    struct moed_workers *ws = w->ws;
    if (w->state != MOED_WORKER_STARTING)
        return moe_fail(err, errlen, MOE_EFORMAT, "a second ready");
    if (r->n_ctx < ws->o.n_ctx)
        return moe_fail(err, errlen, MOE_ERANGE, "ready.n_ctx %u is less than the %u asked for",
                        r->n_ctx, ws->o.n_ctx);
    if (!ws->lim.n_vocab) {
        /* The first Ready teaches the shape when the caller did not give it. */
        ws->lim.n_vocab = r->n_vocab;
        ws->lim.n_layer = r->n_layer;
        ws->lim.n_expert = r->n_expert;
        for (uint32_t i = 0; i < ws->o.n_workers; i++)
            if (ws->slots[i].conn)
                moe_ipc_conn_set_limits(ws->slots[i].conn, &ws->lim);
    }
    uv_timer_stop(&w->timer);
    w->info.n_seq = r->n_seq;
    w->info.n_ctx = r->n_ctx;
    w->info.weights_bytes = r->weights_bytes;
    w->info.kv_bytes = r->kv_bytes;
    w->info.vram_used = r->vram_used;
    w->info.ram_used = r->ram_used;
    w->ready_at = uv_now(ws->loop);
    w->last_msg_ms = w->progress_ms = w->ready_at;
    w->hb_steps = 0;
    w->hb_running = 0;
    set_state(w, MOED_WORKER_READY);
    moe_ipc_log(MOE_LOG_INFO, "worker %u ready (pid %d): %u sequences x %u positions, weights %.1f MiB, "
                "KV %.1f MiB, RSS %.1f MiB", w->index, w->info.pid, r->n_seq, r->n_ctx,
                r->weights_bytes / 1048576.0, r->kv_bytes / 1048576.0, r->ram_used / 1048576.0);
    send_placement(w);
    if (ws->sched)
        sched_worker_ready(ws->sched, w->index, r->n_seq, r->n_ctx);
    check_all_ready(ws);
    return 0;
}


/* A worker's expert residency from its Metrics: per-layer arrays only when all four have the
 * model's layer count (anything else clears them). */
static void off_clear(struct moed_worker_offload *o)
{
    free((void *)o->slots);
    free((void *)o->hits);
    memset(o, 0, sizeof *o);
}

static void set_offload(struct wslot *w, const Moed__Metrics *m)
{
    struct moed_worker_offload *o = &w->off;
    const size_t L = w->ws->lim.n_layer;
    off_clear(o);
    if (!m->expert_vram_bytes || !L || m->n_layer_slots != L || m->n_layer_hot != L ||
        m->n_layer_hits != L || m->n_layer_misses != L)
        return;
    uint32_t *u32 = malloc(sizeof *u32 * 2 * L);
    uint64_t *u64 = malloc(sizeof *u64 * 2 * L);
    if (!u32 || !u64) {
        free(u32);
        free(u64);
        return;
    }
    memcpy(u32, m->layer_slots, sizeof *u32 * L);
    memcpy(u32 + L, m->layer_hot, sizeof *u32 * L);
    memcpy(u64, m->layer_hits, sizeof *u64 * L);
    memcpy(u64 + L, m->layer_misses, sizeof *u64 * L);
    o->active = true;
    o->n_layer = (uint32_t)L;
    o->expert_vram_bytes = m->expert_vram_bytes;
    o->expert_bytes = m->expert_bytes;
    o->fill_bytes = m->expert_fill_bytes;
    o->direct = m->expert_direct;
    o->direct_bytes = m->expert_direct_bytes;
    o->prefetched = m->expert_prefetched;
    o->prefetch_bytes = m->expert_prefetch_bytes;
    o->prefetch_used = m->expert_prefetch_used;
    o->prefetch_wasted = m->expert_prefetch_wasted;
    o->slots = u32;
    o->hot = u32 + L;
    o->hits = u64;
    o->misses = u64 + L;
}

_Static_assert(SCHED_MAX_TOP_LOGPROBS == MOE_IPC_MAX_TOP_LOGPROBS && SCHED_MAX_BIAS == MOE_IPC_MAX_BIAS,
               "the scheduler's bounds are the protocol's");

/* A Token's logprobs (validated: top lists of equal length, at most the maximum), or NULL. */
static const struct sched_logprob *token_logprob(const Moed__Token *t, struct sched_logprob *lp)
{
    if (!t->has_logprob)
        return NULL;
    lp->logprob = t->logprob;
    lp->n_top = (uint32_t)t->n_top_token;
    if (t->n_top_token) { /* an empty repeated field's pointer is NULL: no memcpy from it */
        memcpy(lp->top_id, t->top_token, t->n_top_token * sizeof *lp->top_id);
        memcpy(lp->top_lp, t->top_logprob, t->n_top_token * sizeof *lp->top_lp);
    }
    return lp;
}

static int on_msg(struct moe_ipc_conn *c, void *user, const Moed__Envelope *env, char *err,
                  size_t errlen)
{
    struct wslot *w = user;
    struct moed_workers *ws = w->ws;
    (void)c;
    w->last_msg_ms = uv_now(ws->loop);
    if (env->msg_case != MOED__ENVELOPE__MSG_READY && env->msg_case != MOED__ENVELOPE__MSG_ERROR &&
        w->state != MOED_WORKER_READY && w->state != MOED_WORKER_STOPPING)
        return moe_fail(err, errlen, MOE_EFORMAT, "%s before ready", moe_ipc_msg_name(env->msg_case));
    switch (env->msg_case) {
    case MOED__ENVELOPE__MSG_READY:
        return on_ready_msg(w, env->ready, err, errlen);
    case MOED__ENVELOPE__MSG_TOKEN: {
        struct sched_logprob lp;
        w->info.tokens_generated += !env->token->prompt;
        if (ws->sched && env->token->prompt)
            sched_worker_prompt_logprob(ws->sched, w->index, env->token->id, env->token->prompt_pos,
                                        env->token->token, token_logprob(env->token, &lp));
        else if (ws->sched)
            sched_worker_token(ws->sched, w->index, env->token->id, env->token->token,
                               token_logprob(env->token, &lp));
        return 0;
    }
    case MOED__ENVELOPE__MSG_DONE:
        if (ws->sched)
            sched_worker_done(ws->sched, w->index, env->done->id, env->done->reason,
                              env->done->n_prompt, env->done->n_gen, env->done->n_cached,
                              env->done->signature, env->done->n_signature);
        return 0;
    case MOED__ENVELOPE__MSG_ERROR:
        if (env->error->id == 0) {
            moe_ipc_log(MOE_LOG_ERROR, "worker %u: %s", w->index, env->error->message);
            if (!w->err_set) {
                snprintf(w->info.last_error, sizeof w->info.last_error, "worker %u: %s", w->index,
                         env->error->message);
                w->err_set = true;
            }
            return 0;
        }
        moe_ipc_log(MOE_LOG_WARN, "worker %u: request %" PRIu64 " failed: %s", w->index,
                    env->error->id, env->error->message);
        if (ws->sched)
            sched_worker_error(ws->sched, w->index, env->error->id, env->error->code,
                               env->error->message);
        return 0;
    case MOED__ENVELOPE__MSG_ROUTING_STATS: {
        const Moed__RoutingStats *rs = env->routing_stats;
        if (ws->o.on_routing)
            ws->o.on_routing(ws->o.user, w->index, rs->counts, rs->n_layer, rs->n_expert,
                             rs->n_tokens);
        return 0;
    }
    case MOED__ENVELOPE__MSG_METRICS:
        w->info.tokens_generated = env->metrics->tokens_generated;
        w->info.prompt_tokens = env->metrics->prompt_tokens;
        w->info.tokens_per_s = env->metrics->decode_tokens_per_s;
        w->info.expert_hits = env->metrics->expert_hits;
        w->info.expert_misses = env->metrics->expert_misses;
        w->info.pool_hits = env->metrics->pool_hits;
        w->info.pool_misses = env->metrics->pool_misses;
        w->info.pool_waits = env->metrics->pool_waits;
        w->info.pool_wait_us = env->metrics->pool_wait_us;
        if (env->metrics->vram_used)
            w->info.vram_used = env->metrics->vram_used;
        set_offload(w, env->metrics);
        if (ws->sched)
            sched_worker_hot(ws->sched, w->index, env->metrics->hot.len ? env->metrics->hot.data : NULL,
                             env->metrics->hot.len);
        return 0;
    case MOED__ENVELOPE__MSG_HEARTBEAT:
        if (env->heartbeat->steps != w->hb_steps || env->heartbeat->running == 0)
            w->progress_ms = w->last_msg_ms;
        w->hb_steps = env->heartbeat->steps;
        w->hb_running = env->heartbeat->running;
        return 0;
    case MOED__ENVELOPE__MSG_EXPERT_REQUEST:
        if (!ws->o.on_expert_request)
            return moe_fail(err, errlen, MOE_EUNSUPPORTED, "expert_request: every expert is in "
                            "the store (no --ram-budget)");
        ws->o.on_expert_request(ws->o.user, w->index, env->expert_request->layer,
                                env->expert_request->expert, env->expert_request->step,
                                env->expert_request->prefetch);
        return 0;
    default:
        return moe_fail(err, errlen, MOE_EFORMAT, "unexpected %s", moe_ipc_msg_name(env->msg_case));
    }
}

static void on_exit_grace(uv_timer_t *t)
{
    struct wslot *w = t->data;
    char why[200];
    snprintf(why, sizeof why, "%s and did not exit", w->grace_why);
    slot_down(w, why);
}

static void on_conn_close(struct moe_ipc_conn *c, void *user, int reason, const char *msg)
{
    struct wslot *w = user;
    (void)c;
    w->conn = NULL;
    char why[320];
    if (reason == 0) {
        why[0] = 0;
    } else if (reason == UV_EOF) {
        snprintf(why, sizeof why, "worker %u closed its connection", w->index);
    } else {
        snprintf(why, sizeof why, "worker %u: %s", w->index, msg);
    }
    if (w->state == MOED_WORKER_STOPPING) {
        maybe_restart(w); /* i.e. mark stopped once the process is gone too */
        return;
    }
    if ((reason == UV_EOF || reason == UV_ECONNRESET) && w->proc_running && !w->down_reported) {
        /* The peer hung up: it is most likely dying. Its exit status explains more than the
         * EOF does, so give the exit callback a moment to report it first. */
        copy_msg(w->grace_why, sizeof w->grace_why, why);
        uv_timer_start(&w->timer, on_exit_grace, EXIT_GRACE_MS, 0);
        return;
    }
    slot_down(w, why);
}

/* ---------------------------------------------------------------------------------------------
 * Spawning */

static void on_ready_timeout(uv_timer_t *t)
{
    struct wslot *w = t->data;
    if (w->state != MOED_WORKER_STARTING)
        return;
    char why[160];
    snprintf(why, sizeof why, "worker %u was not ready after %u ms", w->index,
             w->ws->o.ready_timeout_ms);
    moe_ipc_log(MOE_LOG_ERROR, "%s; killing it", why);
    slot_down(w, why);
}

/* A worker's stderr, read by the daemon and written to its log line by line ("worker N: ..."),
 * at the level the worker gave the line, so that with --log-file or under journald worker
 * messages land where the daemon's do, with its timestamps. One per incarnation; it closes itself
 * at EOF (the worker exited) and frees itself in the close callback. */
struct errpipe {
    uv_pipe_t pipe;
    uint32_t index;
    struct errpipe **owner;  /* the slot's pointer to it, cleared when it closes */
    size_t n;
    char buf[2048];
};

static void errpipe_closed(uv_handle_t *h)
{
    free(h->data);
}

static void errpipe_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    struct errpipe *p = h->data;
    (void)suggested;
    *buf = uv_buf_init(p->buf + p->n, (unsigned)(sizeof p->buf - 1 - p->n));
}

static void errpipe_line(const struct errpipe *p, char *line)
{
    static const struct {
        const char *tag;
        enum moe_ipc_log_level level;
    } tags[] = {{"error: ", MOE_LOG_ERROR}, {"warn: ", MOE_LOG_WARN}, {"warning: ", MOE_LOG_WARN},
                {"info: ", MOE_LOG_INFO}, {"debug: ", MOE_LOG_DEBUG}};
    enum moe_ipc_log_level level = MOE_LOG_INFO;
    char *msg = line;
    /* "moed-worker[PID]: " or "moed-worker: " (the pid is in the daemon's own lines). */
    if (!strncmp(msg, "moed-worker", 11)) {
        char *c = strstr(msg, ": ");
        if (c && (c == msg + 11 || (msg[11] == '[' && c[-1] == ']')))
            msg = c + 2;
    }
    for (size_t i = 0; i < sizeof tags / sizeof tags[0]; i++)
        if (!strncmp(msg, tags[i].tag, strlen(tags[i].tag))) {
            level = tags[i].level;
            msg += strlen(tags[i].tag);
            break;
        }
    if (*msg)
        moe_ipc_log(level, "worker %u: %s", p->index, msg);
}

static void errpipe_close(struct errpipe *p)
{
    if (p->n) {
        p->buf[p->n] = 0;
        errpipe_line(p, p->buf);
        p->n = 0;
    }
    if (p->owner)
        *p->owner = NULL;
    p->owner = NULL;
    if (!uv_is_closing((uv_handle_t *)&p->pipe))
        uv_close((uv_handle_t *)&p->pipe, errpipe_closed);
}

/* Logs the complete lines among the first n + nread bytes of the buffer. */
static void errpipe_take(struct errpipe *p, size_t nread)
{
    p->n += nread;
    size_t start = 0;
    for (size_t i = 0; i < p->n; i++)
        if (p->buf[i] == '\n') {
            p->buf[i] = 0;
            errpipe_line(p, p->buf + start);
            start = i + 1;
        }
    if (start == 0 && p->n >= sizeof p->buf - 1) { /* a line longer than the buffer */
        p->buf[p->n] = 0;
        errpipe_line(p, p->buf);
        start = p->n;
    }
    memmove(p->buf, p->buf + start, p->n - start);
    p->n -= start;
}

/* The worker exited: what it wrote is in the pipe now; read it all and close. */
static void errpipe_finish(struct wslot *w)
{
    struct errpipe *p = w->ep;
    if (!p)
        return;
    uv_os_fd_t fd;
    if (uv_fileno((uv_handle_t *)&p->pipe, &fd) == 0)
        for (;;) {
            ssize_t r = read(fd, p->buf + p->n, sizeof p->buf - 1 - p->n);
            if (r <= 0)
                break;
            errpipe_take(p, (size_t)r);
        }
    errpipe_close(p);
}

static void errpipe_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    struct errpipe *p = s->data;
    (void)buf;
    if (nread > 0) {
        errpipe_take(p, (size_t)nread);
        return;
    }
    if (nread < 0)
        errpipe_close(p);
}

static int slot_start(struct wslot *w, char *err, size_t errlen)
{
    struct moed_workers *ws = w->ws;
    int sv[2] = {-1, -1}, rc;
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return moe_fail(err, errlen, -errno, "socketpair: %s", strerror(errno));

    char *args[] = {ws->worker_bin, "--ipc-fd", "3", NULL};
    struct errpipe *ep = calloc(1, sizeof *ep);
    if (!ep || uv_pipe_init(ws->loop, &ep->pipe, 0)) {
        free(ep);
        close(sv[0]);
        close(sv[1]);
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    }
    ep->pipe.data = ep;
    ep->index = w->index;
    uv_stdio_container_t stdio[4];
    stdio[0].flags = UV_IGNORE;
    /* A worker's stdout is for standalone runs; here its stdout and stderr both go to the
     * daemon's log through the pipe. */
    stdio[1].flags = UV_INHERIT_FD;
    stdio[1].data.fd = 2;
    stdio[2].flags = (uv_stdio_flags)(UV_CREATE_PIPE | UV_WRITABLE_PIPE);
    stdio[2].data.stream = (uv_stream_t *)&ep->pipe;
    stdio[3].flags = UV_INHERIT_FD;
    stdio[3].data.fd = sv[1];
    uv_process_options_t po = {0};
    po.file = ws->worker_bin;
    po.args = args;
    po.exit_cb = on_exit_cb;
    po.stdio = stdio;
    po.stdio_count = 4;
    w->down_reported = false;
    w->err_set = false;
    rc = uv_spawn(ws->loop, &w->proc, &po);
    close(sv[1]);
    if (rc) {
        /* libuv still wants the handle closed after a failed spawn. */
        close(sv[0]);
        close_handle(ws, (uv_handle_t *)&w->proc);
        uv_close((uv_handle_t *)&ep->pipe, errpipe_closed);
        return moe_fail(err, errlen, rc, "cannot start %s: %s", ws->worker_bin, uv_strerror(rc));
    }
    w->ep = ep;
    ep->owner = &w->ep;
    if (uv_read_start((uv_stream_t *)&ep->pipe, errpipe_alloc, errpipe_read))
        errpipe_close(ep);
    w->proc.data = w;
    w->proc_running = true;
    w->proc_handle_open = true;
    w->info.pid = w->proc.pid;
    set_state(w, MOED_WORKER_STARTING);
    off_clear(&w->off); /* the new incarnation reports its own */
    /* Gauges of the last incarnation would be stale: its rate, its memory, its cache counters. */
    w->info.tokens_per_s = 0;
    w->info.vram_used = 0;
    w->info.expert_hits = w->info.expert_misses = 0;

    Moed__Hello h = MOED__HELLO__INIT;
    h.protocol_version = MOE_IPC_PROTOCOL_VERSION;
    h.model_path = ws->model_path;
    h.worker_index = w->index;
    h.device = ws->devices[w->index];
    h.n_ctx = ws->o.n_ctx;
    h.n_seq = ws->o.n_seq;
    h.n_batch = ws->o.n_batch;
    h.n_threads = ws->o.n_threads;
    if (h.n_threads == 0) {
        /* CPU workers share the cores instead of each spinning up one thread per core. */
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        h.n_threads = ncpu > (long)ws->o.n_workers ? (int32_t)(ncpu / (long)ws->o.n_workers) : 1;
    }
    h.store_size = ws->o.store_fd >= 0 ? ws->o.store_size : 0;
    h.store_fingerprint = ws->o.store_fingerprint;
    h.vram_budget = ws->o.vram_budget;
    const int gpu = devices_gpu_index(h.device);
    if (gpu >= 0 && ws->o.vram_budget_dev && ws->o.vram_budget_set && ws->o.vram_budget_set[gpu])
        h.vram_budget = ws->o.vram_budget_dev[gpu];
    h.expert_residency = ws->o.expert_residency;
    h.cache_slots = ws->o.cache_slots;
    h.route_signatures = ws->o.route_signatures;
    const uint64_t *pc = ws->o.profile_counts ? ws->o.profile_counts(ws->o.user) : NULL;
    if (pc) {
        h.expert_counts = (uint64_t *)pc;
        h.n_expert_counts = (size_t)ws->lim.n_layer * ws->lim.n_expert;
    }
    h.n_vocab = ws->lim.n_vocab;
    h.n_layer = ws->lim.n_layer;
    h.n_expert = ws->lim.n_expert;
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    env.msg_case = MOED__ENVELOPE__MSG_HELLO;
    env.hello = &h;
    /* The Hello goes out before libuv owns the socket: it carries the store descriptor, which a
     * uv_write cannot. The socket buffer holds it even if the child is slow to start. */
    rc = moe_ipc_send_with_fd(sv[0], &env, ws->o.store_fd, ws->o.max_frame, err, errlen);
    if (rc) {
        close(sv[0]);
        slot_down(w, err);
        return 0; /* the restart path takes it from here */
    }
    char name[32];
    snprintf(name, sizeof name, "worker %u", w->index);
    struct moe_ipc_conn_cb cb = {.on_msg = on_msg, .on_close = on_conn_close};
    rc = moe_ipc_conn_open(&w->conn, ws->loop, sv[0], MOE_IPC_FROM_WORKER, &ws->lim, ws->o.max_frame,
                           name, &cb, w, err, errlen);
    if (rc) {
        w->conn = NULL;
        slot_down(w, err);
        return 0;
    }
    uv_timer_start(&w->timer, on_ready_timeout, ws->o.ready_timeout_ms, 0);
    moe_ipc_log(MOE_LOG_INFO, "worker %u: started pid %d (%s)", w->index, w->info.pid,
                ws->devices[w->index]);
    return 0;
}

static void slot_spawn(struct wslot *w)
{
    char err[256];
    w->info.restarts++;
    if (slot_start(w, err, sizeof err) != 0) {
        moe_ipc_log(MOE_LOG_ERROR, "worker %u: %s", w->index, err);
        copy_msg(w->info.last_error, sizeof w->info.last_error, err);
        w->proc_running = false;
        w->conn = NULL;
        w->down_reported = w->err_set = true;
        maybe_restart(w);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Public API */

/* IPC and supervisor messages go to the daemon's log, with its timestamps and levels. */
_Static_assert((int)MOE_LOG_ERROR == (int)LOG_LEVEL_ERROR && (int)MOE_LOG_DEBUG == (int)LOG_LEVEL_DEBUG,
               "log levels differ");

static void log_sink(enum moe_ipc_log_level level, const char *msg)
{
    log_msg((enum log_level)level, "%s", msg);
}

int moed_worker_bin_path(const char *configured, char *out, size_t n, char *err, size_t errlen)
{
    if (configured) {
        if ((size_t)snprintf(out, n, "%s", configured) >= n)
            return moe_fail(err, errlen, -ENAMETOOLONG, "worker program path is too long");
        return 0;
    }
    char self[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len < 0)
        return moe_fail(err, errlen, -errno, "readlink /proc/self/exe: %s", strerror(errno));
    self[len] = 0;
    char *slash = strrchr(self, '/');
    if (slash)
        *slash = 0;
    if ((size_t)snprintf(out, n, "%s/moed-worker", slash ? self : ".") >= n)
        return moe_fail(err, errlen, -ENAMETOOLONG, "path of moed-worker is too long");
    return 0;
}

int moed_workers_start(uv_loop_t *loop, const struct moed_workers_opts *o,
                       struct moed_workers **out, char *err, size_t errlen)
{
    char bin[PATH_MAX];
    int rc;
    if (!o->model_path || !o->model_path[0])
        return moe_fail(err, errlen, -EINVAL, "no model path");
    if (o->n_workers < 1 || o->n_workers > 64)
        return moe_fail(err, errlen, -EINVAL, "%u workers (1..64 allowed)", o->n_workers);
    if (o->n_ctx < 1 || o->n_ctx > MOE_IPC_MAX_CTX || o->n_seq < 1 || o->n_seq > MOE_IPC_MAX_SEQ)
        return moe_fail(err, errlen, -EINVAL, "n_ctx %u / n_seq %u out of range", o->n_ctx, o->n_seq);
    /* A Submit holds up to n_ctx prompt ids of at most 5 bytes each, plus small fields. */
    uint64_t frame = o->max_frame ? o->max_frame : MOE_IPC_MAX_FRAME;
    if ((uint64_t)o->n_ctx * 5 + (uint64_t)MOE_IPC_MAX_EOG * 5 + 1024 > frame)
        return moe_fail(err, errlen, -EINVAL, "n_ctx %u does not fit the %llu byte IPC frame limit",
                        o->n_ctx, (unsigned long long)frame);
    if (o->n_eog > MOE_IPC_MAX_EOG)
        return moe_fail(err, errlen, -EINVAL, "%u eog tokens (at most %u)", o->n_eog, MOE_IPC_MAX_EOG);
    if ((rc = moed_worker_bin_path(o->worker_bin, bin, sizeof bin, err, errlen)))
        return rc;
    if (access(bin, X_OK) != 0)
        return moe_fail(err, errlen, -errno, "worker program %s: %s", bin, strerror(errno));

    moe_ipc_log_set_sink(log_sink);
    /* A worker that dies mid-write must give us EPIPE, not kill the daemon. */
    struct sigaction sa;
    if (sigaction(SIGPIPE, NULL, &sa) == 0 && sa.sa_handler == SIG_DFL)
        signal(SIGPIPE, SIG_IGN);

    struct moed_workers *ws = calloc(1, sizeof *ws);
    if (!ws)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    ws->loop = loop;
    ws->o = *o;
    if (!ws->o.queue_max)
        ws->o.queue_max = 256;
    if (!ws->o.queue_wait_ms)
        ws->o.queue_wait_ms = 30000;
    if (!ws->o.ready_timeout_ms)
        ws->o.ready_timeout_ms = 300000;
    if (!ws->o.max_init_failures)
        ws->o.max_init_failures = MAX_INIT_FAILURES;
    if (!ws->o.max_frame)
        ws->o.max_frame = MOE_IPC_MAX_FRAME;
    ws->o.eog = NULL;
    ws->lim.n_vocab = o->n_vocab;
    ws->lim.n_layer = o->n_layer;
    ws->lim.n_expert = o->n_expert;
    ws->lim.n_ctx = 0; /* prompts are checked by the scheduler; nothing from a worker carries one */
    ws->model_path = strdup(o->model_path);
    ws->worker_bin = strdup(bin);
    ws->devices = calloc(o->n_workers, sizeof *ws->devices);
    ws->slots = calloc(o->n_workers, sizeof *ws->slots);
    if (!ws->model_path || !ws->worker_bin || !ws->devices || !ws->slots) {
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
        goto fail;
    }
    for (uint32_t i = 0; i < o->n_workers; i++)
        snprintf(ws->devices[i], sizeof ws->devices[i], "%s",
                 o->devices && o->devices[i] ? o->devices[i] : "cpu");
    struct sched_config sc = {.n_workers = o->n_workers, .n_ctx = o->n_ctx,
                              .queue_max = ws->o.queue_max, .queue_wait_ms = ws->o.queue_wait_ms,
                              .eog = o->eog, .n_eog = o->n_eog, .n_layer = o->n_layer,
                              .n_expert = o->n_expert};
    if ((rc = sched_create(&ws->sched, loop, ws, &sc))) {
        moe_fail(err, errlen, rc, "out of memory");
        goto fail;
    }
    uv_timer_init(loop, &ws->stop_timer);
    ws->stop_timer.data = ws;
    /* The wedge limits: the options (moed's --worker-silent-timeout and --worker-stall-timeout);
     * MOED_WORKER_SILENT_MS and MOED_WORKER_STALL_MS in the environment win (millisecond limits
     * for tests). */
    const char *ev_silent = getenv("MOED_WORKER_SILENT_MS"), *ev_stall = getenv("MOED_WORKER_STALL_MS");
    ws->silent_ms = ev_silent && atoi(ev_silent) > 0 ? (uint64_t)atoi(ev_silent)
                    : o->silent_ms                   ? o->silent_ms
                                                     : 10000;
    ws->stall_ms = ev_stall && atoi(ev_stall) > 0 ? (uint64_t)atoi(ev_stall)
                   : o->stall_ms                  ? o->stall_ms
                                                  : 300000;
    uv_timer_init(loop, &ws->wedge_timer);
    ws->wedge_timer.data = ws;
    uv_timer_start(&ws->wedge_timer, on_wedge_timer, 1000, 1000);
    for (uint32_t i = 0; i < o->n_workers; i++) {
        struct wslot *w = &ws->slots[i];
        w->ws = ws;
        w->index = i;
        uv_timer_init(loop, &w->timer);
        w->timer.data = w;
        snprintf(w->info.device, sizeof w->info.device, "%s", ws->devices[i]);
    }
    for (uint32_t i = 0; i < o->n_workers; i++) {
        struct wslot *w = &ws->slots[i];
        char e2[256];
        if ((rc = slot_start(w, e2, sizeof e2))) {
            moe_ipc_log(MOE_LOG_ERROR, "worker %u: %s", i, e2);
            copy_msg(w->info.last_error, sizeof w->info.last_error, e2);
            w->down_reported = w->err_set = true;
            maybe_restart(w);
        }
    }
    *out = ws;
    return 0;
fail:
    free(ws->model_path);
    free(ws->worker_bin);
    free(ws->devices);
    free(ws->slots);
    free(ws);
    return rc;
}

struct sched *moed_workers_sched(struct moed_workers *ws)
{
    return ws->sched;
}

uint32_t moed_workers_ready(const struct moed_workers *ws, uint32_t *total)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < ws->o.n_workers; i++)
        n += ws->slots[i].state == MOED_WORKER_READY;
    if (total)
        *total = ws->o.n_workers;
    return n;
}

int moed_workers_offload(const struct moed_workers *ws, uint32_t i,
                         struct moed_worker_offload *out)
{
    if (i >= ws->o.n_workers)
        return -EINVAL;
    *out = ws->slots[i].off;
    return 0;
}

int moed_workers_info(const struct moed_workers *ws, uint32_t i, struct moed_worker_info *out)
{
    if (i >= ws->o.n_workers)
        return -EINVAL;
    *out = ws->slots[i].info;
    out->running = sched_n_running_on(ws->sched, i);
    return 0;
}

/* Copies a placement of the model's size into *bits and *cc (NULL counts: none), freeing what
 * they held. Returns 0, -EINVAL or -ENOMEM (nothing changed then). */
static int placement_copy(const struct moed_workers *ws, const uint8_t *bitmap, size_t nbytes,
                          const uint64_t *counts, uint8_t **bits, uint64_t **cc)
{
    if (!ws->lim.n_layer || !ws->lim.n_expert)
        return -EINVAL;
    if (nbytes != ((size_t)ws->lim.n_layer * ws->lim.n_expert + 7) / 8)
        return -EINVAL;
    const size_t nc = (size_t)ws->lim.n_layer * ws->lim.n_expert;
    uint8_t *copy = malloc(nbytes);
    uint64_t *ccopy = counts ? malloc(sizeof *ccopy * nc) : NULL;
    if (!copy || (counts && !ccopy)) {
        free(copy);
        free(ccopy);
        return -ENOMEM;
    }
    memcpy(copy, bitmap, nbytes);
    if (ccopy)
        memcpy(ccopy, counts, sizeof *ccopy * nc);
    free(*bits);
    free(*cc);
    *bits = copy;
    *cc = ccopy;
    return 0;
}

static void own_placement_clear(struct wslot *w)
{
    free(w->own_place);
    free(w->own_counts);
    w->own_place = NULL;
    w->own_counts = NULL;
}

int moed_workers_set_placement(struct moed_workers *ws, const uint8_t *bitmap, size_t nbytes,
                               const uint64_t *counts)
{
    const int rc = placement_copy(ws, bitmap, nbytes, counts, &ws->placement, &ws->placement_counts);
    if (rc)
        return rc;
    ws->placement_len = nbytes;
    for (uint32_t i = 0; i < ws->o.n_workers; i++) {
        own_placement_clear(&ws->slots[i]);
        if (ws->slots[i].state == MOED_WORKER_READY)
            send_placement(&ws->slots[i]);
    }
    return 0;
}

int moed_workers_set_placement_one(struct moed_workers *ws, uint32_t i, const uint8_t *bitmap,
                                   size_t nbytes, const uint64_t *counts)
{
    if (i >= ws->o.n_workers)
        return -EINVAL;
    struct wslot *w = &ws->slots[i];
    const int rc = placement_copy(ws, bitmap, nbytes, counts, &w->own_place, &w->own_counts);
    if (rc)
        return rc;
    ws->placement_len = nbytes;
    if (w->state == MOED_WORKER_READY)
        send_placement(w);
    return 0;
}

int moed_workers_send_submit(struct moed_workers *ws, uint32_t wi, uint64_t id, const int32_t *prompt,
                             uint32_t n_prompt, uint32_t max_tokens,
                             const struct sched_sampling *sp, const int32_t *eog, uint32_t n_eog)
{
    struct wslot *w = &ws->slots[wi];
    if (!w->conn || w->state != MOED_WORKER_READY)
        return -EPIPE;
    Moed__Sampling s = MOED__SAMPLING__INIT;
    s.temperature = sp->temperature;
    s.top_p = sp->top_p;
    s.top_k = sp->top_k;
    s.min_p = sp->min_p;
    s.repetition_penalty = sp->repetition_penalty;
    s.presence_penalty = sp->presence_penalty;
    s.frequency_penalty = sp->frequency_penalty;
    s.seed = sp->seed;
    s.has_seed = sp->has_seed;
    s.bias_token = (int32_t *)sp->bias_tok;
    s.bias_value = (float *)sp->bias_val;
    s.n_bias_token = s.n_bias_value = sp->n_bias;
    s.grammar = sp->grammar ? (char *)sp->grammar : (char *)"";
    Moed__Submit m = MOED__SUBMIT__INIT;
    m.id = id;
    m.prompt = (int32_t *)prompt;
    m.n_prompt = n_prompt;
    m.max_tokens = max_tokens;
    m.sampling = &s;
    m.eog = (int32_t *)eog;
    m.n_eog = n_eog;
    m.logprobs = sp->logprobs;
    m.top_logprobs = sp->top_logprobs;
    m.prompt_logprobs = sp->prompt_logprobs;
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    env.msg_case = MOED__ENVELOPE__MSG_SUBMIT;
    env.submit = &m;
    return moe_ipc_conn_send(w->conn, &env);
}

int moed_workers_send_cancel(struct moed_workers *ws, uint32_t wi, uint64_t id)
{
    struct wslot *w = &ws->slots[wi];
    if (!w->conn)
        return -EPIPE;
    Moed__Cancel c = MOED__CANCEL__INIT;
    c.id = id;
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    env.msg_case = MOED__ENVELOPE__MSG_CANCEL;
    env.cancel = &c;
    return moe_ipc_conn_send(w->conn, &env);
}

/* ---------------------------------------------------------------------------------------------
 * Stopping */

static void sched_closed_cb(void *user)
{
    struct moed_workers *ws = user;
    ws->sched_closed = true;
    maybe_stopped(ws);
}

static void maybe_stopped(struct moed_workers *ws)
{
    if (!ws->stopping || ws->stopped || !ws->shutdown_sent)
        return;
    for (uint32_t i = 0; i < ws->o.n_workers; i++) {
        struct wslot *w = &ws->slots[i];
        if (w->proc_running || w->conn)
            return;
    }
    /* Every worker is gone: close our own handles, then report. */
    if (!uv_is_closing((uv_handle_t *)&ws->stop_timer)) {
        for (uint32_t i = 0; i < ws->o.n_workers; i++) {
            close_handle(ws, (uv_handle_t *)&ws->slots[i].timer);
        }
        close_handle(ws, (uv_handle_t *)&ws->stop_timer);
        close_handle(ws, (uv_handle_t *)&ws->wedge_timer);
        sched_close(ws->sched, sched_closed_cb, ws);
        return;
    }
    if (ws->open_handles || !ws->sched_closed)
        return;
    ws->stopped = true;
    moe_ipc_log(MOE_LOG_INFO, "all workers stopped");
    if (ws->on_stopped)
        ws->on_stopped(ws->stopped_user);
}

static void on_kill_timer(uv_timer_t *t)
{
    struct moed_workers *ws = t->data;
    for (uint32_t i = 0; i < ws->o.n_workers; i++) {
        struct wslot *w = &ws->slots[i];
        if (w->proc_running) {
            moe_ipc_log(MOE_LOG_WARN, "worker %u did not exit after shutdown; killing it", i);
            uv_process_kill(&w->proc, SIGKILL);
        }
    }
}

static void shutdown_workers(struct moed_workers *ws)
{
    if (ws->shutdown_sent)
        return;
    ws->shutdown_sent = true;
    sched_set_idle_cb(ws->sched, NULL, NULL);
    uv_timer_stop(&ws->stop_timer);
    uv_timer_stop(&ws->wedge_timer);
    for (uint32_t i = 0; i < ws->o.n_workers; i++) {
        struct wslot *w = &ws->slots[i];
        uv_timer_stop(&w->timer);
        if (w->conn && w->state == MOED_WORKER_READY) {
            Moed__Shutdown sd = MOED__SHUTDOWN__INIT;
            sd.drain = false;
            Moed__Envelope env = MOED__ENVELOPE__INIT;
            env.msg_case = MOED__ENVELOPE__MSG_SHUTDOWN;
            env.shutdown = &sd;
            moe_ipc_conn_send(w->conn, &env);
            set_state(w, MOED_WORKER_STOPPING);
        } else if (w->proc_running || w->conn) {
            /* Not ready yet: it has nothing to finish. */
            set_state(w, MOED_WORKER_STOPPING);
            if (w->conn)
                moe_ipc_conn_close(w->conn, false);
            if (w->proc_running)
                uv_process_kill(&w->proc, SIGKILL);
        } else {
            set_state(w, MOED_WORKER_STOPPED);
        }
    }
    uv_timer_start(&ws->stop_timer, on_kill_timer, KILL_AFTER_MS, 0);
    maybe_stopped(ws);
}

static void on_idle(void *user)
{
    shutdown_workers(user);
}

static void on_drain_timeout(uv_timer_t *t)
{
    struct moed_workers *ws = t->data;
    sched_abort_running(ws->sched, 503, "the server is shutting down");
    shutdown_workers(ws);
}

void moed_workers_stop(struct moed_workers *ws, uint32_t timeout_ms,
                       void (*on_stopped)(void *user), void *user)
{
    if (ws->stopping)
        return;
    ws->stopping = true;
    ws->on_stopped = on_stopped;
    ws->stopped_user = user;
    moe_ipc_log(MOE_LOG_INFO, "stopping workers (%u requests running)", sched_n_running(ws->sched));
    sched_drain(ws->sched, "the server is shutting down");
    if (sched_n_running(ws->sched) == 0) {
        shutdown_workers(ws);
        return;
    }
    sched_set_idle_cb(ws->sched, on_idle, ws);
    uv_timer_start(&ws->stop_timer, on_drain_timeout, timeout_ms, 0);
}

void moed_workers_free(struct moed_workers *ws)
{
    if (!ws)
        return;
    if (!ws->stopped) {
        /* The loop will not run again, so handles cannot be closed: make sure no worker outlives
         * us and leave the memory to the process exit. */
        for (uint32_t i = 0; i < ws->o.n_workers; i++)
            if (ws->slots[i].proc_running)
                kill(ws->slots[i].proc.pid, SIGKILL);
        return;
    }
    sched_destroy(ws->sched);
    for (uint32_t i = 0; i < ws->o.n_workers; i++) {
        off_clear(&ws->slots[i].off);
        own_placement_clear(&ws->slots[i]);
        if (ws->slots[i].ep)
            errpipe_close(ws->slots[i].ep); /* no pointer into the slots may outlive them */
    }
    free(ws->placement);
    free(ws->placement_counts);
    free(ws->model_path);
    free(ws->worker_bin);
    free(ws->devices);
    free(ws->slots);
    free(ws);
}

int moed_workers_expert_ready(struct moed_workers *ws, uint32_t i, uint32_t layer, uint32_t expert,
                              uint64_t offset, uint64_t size, int code, const char *msg)
{
    if (i >= ws->o.n_workers)
        return -EINVAL;
    struct wslot *w = &ws->slots[i];
    if (!w->conn)
        return 0;
    Moed__ExpertReady r = MOED__EXPERT_READY__INIT;
    r.layer = layer;
    r.expert = expert;
    r.offset = offset;
    r.size = size;
    r.code = code;
    r.error = (char *)(msg ? msg : "");
    Moed__Envelope env = MOED__ENVELOPE__INIT;
    env.msg_case = MOED__ENVELOPE__MSG_EXPERT_READY;
    env.expert_ready = &r;
    return moe_ipc_conn_send(w->conn, &env);
}

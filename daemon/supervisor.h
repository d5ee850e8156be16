/* The daemon's worker supervisor: spawns moed-worker processes, talks to them over IPC, restarts
 * the ones that die, and owns the scheduler (daemon/sched.h) that spreads requests over them.
 *
 * Everything runs on the daemon's libuv loop; every callback below is called from that loop.
 *
 * Typical use in daemon/main.c:
 *
 *   struct moed_workers *w;
 *   struct moed_workers_opts o = { .model_path = path, .n_workers = 2, ... };
 *   if (moed_workers_start(loop, &o, &w, err, sizeof err) != 0) { log err; exit }
 *   struct sched *s = moed_workers_sched(w);       // hand to the API layer
 *   ... o.on_ready fires once every worker is Ready -> sd_notify("READY=1")
 *   ... SIGTERM: moed_workers_stop(w, 30000, on_stopped, ctx); in on_stopped: save the profile,
 *       moed_workers_free(w), uv_stop / close the loop.
 *
 * Worker deaths: a worker that exits or whose IPC connection breaks (EOF, malformed frame) is
 * restarted after a backoff that starts at 100 ms and doubles up to 10 s, and is reset once a
 * worker stayed healthy for a minute. Its in-flight requests that already streamed a token get
 * on_error (500); the others are re-queued and run on another (or the restarted) worker.
 *
 * A Ready worker sends a Heartbeat every second with its compute thread's step count. One that
 * sends nothing for silent_ms (stopped, or its event loop stuck), or whose steps stop advancing for
 * stall_ms while it has requests in flight (a wedged compute thread), is killed and handled as a
 * death: its clients get a retry or an error, never a hang, and /health reports the worker down.
 *
 * A worker that never gets Ready (it exits at start-up, e.g. because its device cannot be used,
 * or misses the ready timeout) is given up on after max_init_failures such starts in a row: it
 * goes to MOED_WORKER_FAILED and stays there. Once a worker was Ready, deaths count afresh. */
#ifndef MOED_SUPERVISOR_H
#define MOED_SUPERVISOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "daemon/sched.h"

struct moed_workers;

/* A worker's state, for /admin/status and logs. */
enum moed_worker_state {
    MOED_WORKER_STARTING = 0, /* spawned, Hello sent, waiting for Ready */
    MOED_WORKER_READY = 1,    /* serving requests */
    MOED_WORKER_BACKOFF = 2,  /* died; waiting to be restarted */
    MOED_WORKER_STOPPING = 3, /* Shutdown sent (daemon stopping) */
    MOED_WORKER_STOPPED = 4,  /* exited and not restarted (daemon stopping) */
    MOED_WORKER_FAILED = 5,   /* never got Ready, max_init_failures times in a row: given up */
};

struct moed_workers_opts {
    const char *model_path;       /* GGUF the workers serve (they open it when there is no store) */
    const char *worker_bin;       /* NULL: "moed-worker" next to /proc/self/exe */
    uint32_t n_workers;           /* >= 1 */
    const char *const *devices;   /* [n_workers] "cpu" / "cuda:K"; NULL: all "cpu" */

    uint32_t n_ctx;               /* KV positions per sequence (a prompt longer gets 400) */
    uint32_t n_seq;               /* concurrent sequences per worker */
    uint32_t n_batch;             /* most tokens per forward step; 0: worker default */
    int n_threads;                /* compute threads per worker; 0: all cores / n_workers */
    uint64_t vram_budget;         /* bytes, for GPU workers; 0: worker default */
    const uint64_t *vram_budget_dev; /* [64] or NULL: GPU K's own budget where */
    const bool *vram_budget_set;     /* [64] says so */
    double expert_residency;      /* GPU workers: share of experts in VRAM; 0: budget decides */
    int32_t cache_slots;          /* GPU workers: per-layer cache slots; 0 auto, -1 none */
    bool route_signatures;        /* every worker's Done carries its request's routing signature,
                                   * which teaches the scheduler's workload table (sched.h) */

    /* The expert store: a memfd passed to every worker with SCM_RIGHTS in its Hello frame.
     * store_fd < 0: no store; workers map model_path themselves. The fd stays owned by the
     * caller and must stay open until moed_workers_free(). */
    int store_fd;
    uint64_t store_size;
    uint64_t store_fingerprint;

    /* The model's shape: every frame from a worker is range-checked against it; a worker whose
     * Ready disagrees is treated as broken. Fill from moe_model hparams. */
    uint32_t n_vocab, n_layer, n_expert;

    const int32_t *eog;           /* end-of-generation token ids (copied), sent with each Submit */
    uint32_t n_eog;

    uint32_t queue_max;           /* requests waiting for a slot; more gets 503. 0: 256 */
    uint32_t queue_wait_ms;       /* a queued request fails with 503 after waiting this long while
                                   * no worker is ready; 0: 30000 */
    uint32_t ready_timeout_ms;    /* a worker not Ready after this is killed; 0: 300000 */
    uint32_t max_init_failures;   /* starts in a row that end before Ready, then give up; 0: 5 */
    uint32_t silent_ms;           /* a Ready worker silent this long (no Heartbeat) is killed;
                                     0: 10000 */
    uint32_t stall_ms;            /* ... or whose steps stop advancing this long with requests
                                     in flight; 0: 300000 */
    uint32_t max_frame;           /* IPC frame limit in bytes; 0: MOE_IPC_MAX_FRAME */

    /* Routing count deltas from a worker (merge them into the profile). counts is
     * [n_layer][n_expert], valid during the call. */
    void (*on_routing)(void *user, uint32_t worker, const uint64_t *counts, uint32_t n_layer,
                       uint32_t n_expert, uint64_t n_tokens);
    /* The routing counts a starting worker places its hot experts by, [n_layer][n_expert], or
     * NULL for none (a fresh profile); valid during the call. May be NULL. */
    const uint64_t *(*profile_counts)(void *user);
    /* Called once, the first time every worker is Ready or failed for good, with at least one
     * Ready (sd_notify READY=1). */
    void (*on_ready)(void *user);
    /* Tiered store: worker asks for expert (layer, expert) (in range); answer with
     * moed_workers_expert_ready (not for a prefetch: that one gets no answer). NULL: an ExpertRequest is a protocol violation. */
    void (*on_expert_request)(void *user, uint32_t worker, uint32_t layer, uint32_t expert,
                              uint64_t step, bool prefetch);
    /* Worker's process was reaped (before any restart): drop what it held. May be NULL. */
    void (*on_worker_reaped)(void *user, uint32_t worker);
    /* A worker changed state (logs, STATUS=, WATCHDOG decisions); may be NULL. */
    void (*on_worker_state)(void *user, uint32_t worker, enum moed_worker_state st);
    void *user;
};

/* Memory accounting and counters of one worker, from its Ready and Metrics frames. */
struct moed_worker_info {
    enum moed_worker_state state;
    int pid;                      /* 0 when not running */
    char device[32];
    uint32_t restarts;            /* times this slot was restarted */
    uint32_t running;             /* sequences in flight */
    uint32_t n_seq, n_ctx;
    uint64_t weights_bytes, kv_bytes, vram_used, ram_used;
    uint64_t tokens_generated, prompt_tokens;
    double tokens_per_s;          /* decode rate in the worker's last Metrics interval */
    uint64_t expert_hits, expert_misses; /* GPU expert cache lookups, cumulative */
    uint64_t pool_hits, pool_misses;     /* tiered store: experts found in / asked for */
    uint64_t pool_waits, pool_wait_us;   /* expert parts that waited for the daemon, time */
    char last_error[160];         /* why it last died or was rejected; "" when never */
};

/* A GPU worker's expert residency, as its last Metrics gave it (active false: none, or a CPU
 * worker). The arrays are [n_layer] and valid until the loop next runs. */
struct moed_worker_offload {
    bool active;
    uint32_t n_layer;
    uint64_t expert_vram_bytes, expert_bytes, fill_bytes, direct;
    uint64_t direct_bytes, prefetched, prefetch_bytes, prefetch_used, prefetch_wasted;
    const uint32_t *slots, *hot;
    const uint64_t *hits, *misses;
};
int moed_workers_offload(const struct moed_workers *ws, uint32_t i,
                         struct moed_worker_offload *out);

/* The worker program: `configured` when given, else moed-worker next to this executable.
 * Returns 0 or a negative errno with a message in err. */
int moed_worker_bin_path(const char *configured, char *out, size_t n, char *err, size_t errlen);

/* Spawns n_workers workers (fork+exec of worker_bin --ipc-fd 3) and returns at once; workers
 * become Ready asynchronously (on_ready). Ignores SIGPIPE if it still has its default action.
 * Requests may be submitted immediately: they wait in the queue. Returns 0, -EINVAL (bad
 * options, message in err), or a negative errno when worker_bin cannot be executed. */
int moed_workers_start(uv_loop_t *loop, const struct moed_workers_opts *o,
                       struct moed_workers **out, char *err, size_t errlen);

/* The scheduler to hand to the API layer; valid until moed_workers_free(). */
struct sched *moed_workers_sched(struct moed_workers *w);

/* Workers now Ready, out of the configured total. */
uint32_t moed_workers_ready(const struct moed_workers *w, uint32_t *total);

/* Fills *out for worker i (< n_workers). Returns 0 or -EINVAL. */
int moed_workers_info(const struct moed_workers *w, uint32_t i, struct moed_worker_info *out);

/* Sends a hot-expert bitmap ([n_layer][n_expert] bits, bit (l*n_expert+e) = hot, LSB first)
 * and the routing counts it came from ([n_layer][n_expert], or NULL) to every worker, and to
 * each restarted worker after its Ready. Copied. Returns 0, -EINVAL (size does not match the
 * model) or -ENOMEM. */
int moed_workers_set_placement(struct moed_workers *w, const uint8_t *bitmap, size_t nbytes,
                               const uint64_t *counts);

/* The same for worker i alone (complementary hot sets): it keeps its own placement, also across
 * restarts, until the next moed_workers_set_placement gives every worker the same again.
 * Returns 0, -EINVAL (i or the size does not fit) or -ENOMEM. */
int moed_workers_set_placement_one(struct moed_workers *w, uint32_t i, const uint8_t *bitmap,
                                   size_t nbytes, const uint64_t *counts);

/* Answers an ExpertRequest of worker i (see moed_tier_answer_fn). Dropped when the worker has
 * no connection. Returns 0 or -EINVAL. */
int moed_workers_expert_ready(struct moed_workers *w, uint32_t i, uint32_t layer, uint32_t expert,
                              uint64_t offset, uint64_t size, int code, const char *msg);

/* Drains and stops: new submits get 503, queued requests get on_error(503) right away, running
 * requests may finish for up to timeout_ms and are then ended with on_error(503); then every
 * worker gets Shutdown (and SIGKILL if it has not exited 5 s later). on_stopped is called once
 * every worker has exited and every handle is closed; then call moed_workers_free(). */
void moed_workers_stop(struct moed_workers *w, uint32_t timeout_ms,
                       void (*on_stopped)(void *user), void *user);

/* Frees everything. Call it after on_stopped (it may be called from inside on_stopped). Called
 * without a completed stop (the loop will not run again), it only SIGKILLs the workers and
 * leaves the memory to the process exit, since its handles cannot be closed without the loop. */
void moed_workers_free(struct moed_workers *w);

#endif

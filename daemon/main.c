/* moed: the host daemon. Opens and validates the model, builds the shared expert store, loads
 * the routing profile, starts the workers and serves the HTTP API on a Unix socket (and
 * optionally loopback TCP) until SIGTERM, then drains and exits 0.
 *
 * Startup order matters for systemd: everything that can fail because of bad input (config,
 * model file, tokenizer, state dir) is checked before the socket exists, so a broken setup exits
 * 1 with a clear message; READY=1 is sent only when every worker reported Ready. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <uv.h>

#include "daemon/api.h"
#include "daemon/jinja.h"
#include "daemon/config.h"
#include "daemon/devices.h"
#include "daemon/http.h"
#include "daemon/log.h"
#include "daemon/notify.h"
#include "daemon/supervisor.h"
#include "daemon/tier.h"
#include "daemon/workloads.h"
#include "proto/ipc.h"
#include "store/buf.h"
#include "store/err.h"
#include "store/expert_store.h"
#include "store/gguf.h"
#include "store/io.h"
#include "store/model.h"
#include "store/placement.h"
#include "store/units.h"
#include "store/profile.h"
#include "store/tokenizer.h"
#include "store/units.h"

#define MAX_DEVICES DEVICES_MAX
/* How long `moed-worker --list-devices` may take (it starts the CUDA runtime on every GPU). */
#define LIST_DEVICES_TIMEOUT_MS 20000
/* The placement's held-out check (store/placement.h): routing windows of this many tokens, and
 * the gain in hit rate a placement from recent traffic must show to be followed. */
#define DRIFT_WINDOW_TOKENS 4096
#define DRIFT_MARGIN 0.05

struct daemon {
    struct moed_config cfg;
    uv_loop_t *loop;
    struct gguf_file *gguf;
    struct moe_model model;
    bool model_ok;
    struct moe_tokenizer *tok;
    struct moe_store *store;
    int state_lock_fd;          /* flock'ed <state_dir>/moed.lock, +1 (0: none) */
    struct moe_profile_db *db;
    struct moe_profile profile;
    bool profile_dirty;
    struct moe_drift drift;          /* the placement's held-out check (store/placement.h) */
    struct moed_wl wl;               /* complementary hot sets over GPU workers (workloads.h) */
    struct moed_workers *workers;
    struct api *api;
    struct http_server *http;
    uint32_t n_ctx;
    char *devices[MAX_DEVICES];
    uint32_t n_workers;
    bool has_gpu;

    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t profile_timer, watchdog_timer;
    uint64_t watchdog_us;
    bool watchdog_starved;
    bool ready, stopping;
    int exit_code;
    double progress_last;
    /* The expert store is built on a thread-pool thread while the socket already answers
     * (503 "loading", with progress); workers start when it is done. */
    uv_work_t store_work;
    struct moe_store *store_built;
    int store_rc;
    char store_err[512];
    bool store_loading;
    atomic_bool store_cancel;
    /* Tiered store (--ram-budget below every expert): pool slots and their first blobs. */
    uint32_t pool_slots;
    uint32_t *pool_fill;
    uint32_t n_pool_fill;
    struct moed_tier *tier;
};

/* "2.8 MiB", "17.21 GiB": sizes in log lines. */
/* A whole text file of at most max bytes, NUL-terminated (malloc'ed), or NULL with err set. */
static char *read_text_file(const char *path, size_t max, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s", strerror(errno));
        return NULL;
    }
    char *buf = malloc(max + 2);
    size_t n = buf ? fread(buf, 1, max + 1, f) : 0;
    bool bad = !buf || ferror(f);
    fclose(f);
    if (bad || n > max) {
        snprintf(err, errlen, bad ? "cannot read it" : "longer than %zu bytes", max);
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    return buf;
}

static const char *human_bytes(uint64_t n, char *buf, size_t cap)
{
    if (n >= (1ull << 30))
        snprintf(buf, cap, "%.2f GiB", n / 1073741824.0);
    else if (n >= (1ull << 20))
        snprintf(buf, cap, "%.1f MiB", n / 1048576.0);
    else
        snprintf(buf, cap, "%.1f KiB", n / 1024.0);
    return buf;
}

/* ---- profile ---- */

static int profile_save(struct daemon *d)
{
    char err[256];
    int rc = moe_profile_save(d->db, &d->profile, err, sizeof err);
    if (rc)
        log_error("saving the routing profile: %s", err);
    else
        d->profile_dirty = false;
    return rc;
}

static void push_placement(struct daemon *d);

static void on_profile_timer(uv_timer_t *t)
{
    struct daemon *d = t->data;
    if (d->profile_dirty && profile_save(d) == 0)
        push_placement(d);
}

/* Expert slots per layer of the GPU worker with the fewest (NULL when none offloads): what the
 * drift check scores placements with. */
static const uint32_t *gpu_slots(struct daemon *d)
{
    const uint32_t *best = NULL;
    uint64_t least = UINT64_MAX;
    for (uint32_t i = 0; d->workers && i < d->n_workers; i++) {
        struct moed_worker_offload wo;
        if (moed_workers_offload(d->workers, i, &wo) == 0 && wo.active && wo.slots &&
            wo.n_layer == d->profile.n_layer && wo.expert_vram_bytes < least) {
            least = wo.expert_vram_bytes;
            best = wo.slots;
        }
    }
    return best;
}

static void on_routing(void *user, uint32_t worker, const uint64_t *counts, uint32_t n_layer,
                       uint32_t n_expert, uint64_t n_tokens)
{
    struct daemon *d = user;
    (void)worker;
    if (n_layer != d->profile.n_layer || n_expert != d->profile.n_expert)
        return;
    if (moe_profile_merge(&d->profile, counts, (size_t)n_layer * n_expert, n_tokens) == 0) {
        d->profile_dirty = true;
        moe_profile_decay(&d->profile, d->cfg.profile_half_life);
    }
    if (d->drift.win[0] && d->has_gpu) { /* only GPU workers place experts */
        const int ch = moe_drift_add(&d->drift, counts, n_tokens, d->profile.counts,
                                     gpu_slots(d));
        if (ch == 1) {
            log_info("placement: %s (held-out hit rate %.1f%% with the profile's placement, "
                     "%.1f%% with one from the %" PRIu64 " tokens before)",
                     d->drift.drifting ? "routing drifted, following recent traffic"
                                       : "the profile caught up with recent traffic, back to it",
                     100 * d->drift.current, 100 * d->drift.fresh, d->drift.window);
            push_placement(d);
        }
    }
    api_add_routing(d->api, counts, n_layer, n_expert, n_tokens);
}

/* ---- admin hooks ---- */

static const char *state_name(enum moed_worker_state s)
{
    switch (s) {
    case MOED_WORKER_STARTING: return "starting";
    case MOED_WORKER_READY: return "ready";
    case MOED_WORKER_BACKOFF: return "restarting";
    case MOED_WORKER_STOPPING: return "stopping";
    case MOED_WORKER_STOPPED: return "stopped";
    case MOED_WORKER_FAILED: return "failed";
    }
    return "?";
}

/* The tiered store's counters: the daemon's, and the workers' summed (tokens: prompt and
 * generated tokens the workers evaluated). */
static void pool_totals(struct daemon *d, struct moed_tier_stats *ts, uint64_t *hits,
                        uint64_t *misses, uint64_t *waits, uint64_t *wait_us, uint64_t *tokens)
{
    moed_tier_stats(d->tier, ts);
    *hits = *misses = *waits = *wait_us = *tokens = 0;
    for (uint32_t i = 0; d->workers && i < d->n_workers; i++) {
        struct moed_worker_info wi;
        if (moed_workers_info(d->workers, i, &wi) == 0) {
            *hits += wi.pool_hits;
            *misses += wi.pool_misses;
            *waits += wi.pool_waits;
            *wait_us += wi.pool_wait_us;
            *tokens += wi.tokens_generated + wi.prompt_tokens;
        }
    }
}

static int hook_status(void *user, char **json, char *err, size_t errlen)
{
    struct daemon *d = user;
    (void)err, (void)errlen;
    json_t *o = json_object();
    json_t *ws = json_array();
    for (uint32_t i = 0; d->workers && i < d->n_workers; i++) {
        struct moed_worker_info wi;
        if (moed_workers_info(d->workers, i, &wi))
            continue;
        json_t *w = json_object();
        json_object_set_new(w, "index", json_integer(i));
        json_object_set_new(w, "state", json_string(state_name(wi.state)));
        json_object_set_new(w, "pid", json_integer(wi.pid));
        json_object_set_new(w, "device", json_string(wi.device));
        json_object_set_new(w, "restarts", json_integer(wi.restarts));
        json_object_set_new(w, "running", json_integer(wi.running));
        json_object_set_new(w, "n_seq", json_integer(wi.n_seq));
        json_object_set_new(w, "n_ctx", json_integer(wi.n_ctx));
        json_object_set_new(w, "weights_bytes", json_integer((json_int_t)wi.weights_bytes));
        json_object_set_new(w, "kv_bytes", json_integer((json_int_t)wi.kv_bytes));
        json_object_set_new(w, "vram_used", json_integer((json_int_t)wi.vram_used));
        json_object_set_new(w, "ram_used", json_integer((json_int_t)wi.ram_used));
        json_object_set_new(w, "tokens_generated", json_integer((json_int_t)wi.tokens_generated));
        json_object_set_new(w, "tokens_per_second", json_real(wi.tokens_per_s));
        json_object_set_new(w, "sequence_tokens_per_second",
                            json_real(sched_worker_rate(moed_workers_sched(d->workers), i)));
        json_object_set_new(w, "last_error", json_string(wi.last_error));
        json_array_append_new(ws, w);
    }
    json_object_set_new(o, "workers", ws);
    if (d->store) {
        struct moe_store_info si;
        moe_store_get_info(d->store, &si);
        json_t *s = json_object();
        json_object_set_new(s, "bytes", json_integer((json_int_t)si.size));
        json_object_set_new(s, "dense_bytes", json_integer((json_int_t)si.dense_bytes));
        json_object_set_new(s, "expert_bytes", json_integer((json_int_t)si.expert_bytes));
        json_object_set_new(s, "load_seconds", json_real(si.seconds));
        json_object_set_new(s, "huge_page_bytes", json_integer((json_int_t)si.huge_bytes));
        if (d->tier) {
            struct moed_tier_stats ts;
            uint64_t hits, misses, waits, wait_us, tokens;
            pool_totals(d, &ts, &hits, &misses, &waits, &wait_us, &tokens);
            json_t *pl = json_object();
            json_object_set_new(pl, "slots", json_integer(ts.slots));
            json_object_set_new(pl, "slot_bytes", json_integer((json_int_t)ts.slot_bytes));
            json_object_set_new(pl, "resident", json_integer(ts.resident));
            json_object_set_new(pl, "pinned", json_integer((json_int_t)ts.pinned));
            json_object_set_new(pl, "experts", json_integer(ts.n_blobs));
            json_object_set_new(pl, "hits", json_integer((json_int_t)hits));
            json_object_set_new(pl, "misses", json_integer((json_int_t)misses));
            json_object_set_new(pl, "hit_rate", json_real(hits + misses ? (double)hits / (double)(hits + misses) : 1.0));
            json_object_set_new(pl, "waits", json_integer((json_int_t)waits));
            json_object_set_new(pl, "wait_seconds", json_real((double)wait_us / 1e6));
            json_object_set_new(pl, "waits_per_token", json_real(tokens ? (double)waits / (double)tokens : 0.0));
            json_object_set_new(pl, "requests", json_integer((json_int_t)ts.requests));
            json_object_set_new(pl, "merged", json_integer((json_int_t)ts.merged));
            json_object_set_new(pl, "reads", json_integer((json_int_t)ts.reads));
            json_object_set_new(pl, "read_bytes", json_integer((json_int_t)ts.read_bytes));
            json_object_set_new(pl, "read_errors", json_integer((json_int_t)ts.read_errors));
            json_object_set_new(pl, "io", json_string(moed_tier_io(d->tier, NULL)));
            json_object_set_new(pl, "read_seconds", json_real(ts.read_seconds));
            json_object_set_new(pl, "read_p50_ms", json_real(ts.read_p50_ms));
            json_object_set_new(pl, "read_p99_ms", json_real(ts.read_p99_ms));
            json_object_set_new(pl, "evictions", json_integer((json_int_t)ts.evictions));
            json_object_set_new(pl, "reclaimed", json_integer((json_int_t)ts.reclaimed));
            json_object_set_new(pl, "prefetch_requests", json_integer((json_int_t)ts.prefetch_requests));
            json_object_set_new(pl, "prefetch_reads", json_integer((json_int_t)ts.prefetch_reads));
            json_object_set_new(pl, "prefetch_dropped", json_integer((json_int_t)ts.prefetch_dropped));
            json_object_set_new(pl, "prefetch_used", json_integer((json_int_t)ts.prefetch_used));
            json_object_set_new(s, "pool", pl);
        }
        json_object_set_new(o, "store", s);
    }
    json_t *p = json_object();
    json_object_set_new(p, "tokens", json_integer((json_int_t)d->profile.tokens));
    json_object_set_new(p, "created", json_integer(d->profile.created));
    json_object_set_new(p, "updated", json_integer(d->profile.updated));
    json_object_set_new(p, "state_dir", json_string(d->cfg.state_dir));
    json_object_set_new(o, "profile", p);
    json_t *c = json_object();
    json_object_set_new(c, "socket", json_string(d->cfg.socket));
    json_object_set_new(c, "listen", d->cfg.listen ? json_string(d->cfg.listen) : json_null());
    json_object_set_new(c, "devices", json_string(d->cfg.devices));
    json_object_set_new(c, "workers", json_integer(d->n_workers));
    json_object_set_new(c, "parallel", json_integer(d->cfg.parallel));
    json_object_set_new(c, "vram_budget", d->cfg.vram_budget == MOE_VRAM_AUTO
                                              ? json_string("auto")
                                              : json_integer((json_int_t)d->cfg.vram_budget));
    json_object_set_new(o, "config", c);
    *json = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return *json ? 0 : -ENOMEM;
}

static int hook_profile_export(void *user, char **json, char *err, size_t errlen)
{
    struct daemon *d = user;
    return moe_profile_export_json(&d->profile, json, err, errlen);
}

static int hook_profile_import(void *user, const char *json, size_t len, char *err, size_t errlen)
{
    struct daemon *d = user;
    struct moe_profile p;
    int rc = moe_profile_import_json(&p, json, len, d->model.fingerprint, d->model.hp.n_layer,
                                     d->model.hp.n_expert, err, errlen);
    if (rc)
        return rc;
    struct moe_profile old = d->profile;
    d->profile = p;
    if ((rc = moe_profile_save(d->db, &d->profile, err, errlen)) != 0) {
        d->profile = old;
        moe_profile_free(&p);
        return rc;
    }
    moe_profile_free(&old);
    d->profile_dirty = false;
    log_info("routing profile imported (%" PRIu64 " tokens)", d->profile.tokens);
    return 0;
}

static int hook_profile_reset(void *user, char *err, size_t errlen)
{
    struct daemon *d = user;
    struct moe_profile p;
    int rc = moe_profile_init(&p, d->model.fingerprint, d->model.hp.n_layer, d->model.hp.n_expert);
    if (rc)
        return moe_fail(err, errlen, rc, "out of memory");
    rc = moe_profile_delete(d->db, d->model.fingerprint, err, errlen);
    if (rc && rc != MOE_ENOTFOUND) {
        moe_profile_free(&p);
        return rc;
    }
    moe_profile_free(&d->profile);
    d->profile = p;
    d->profile_dirty = false;
    log_info("routing profile reset");
    return 0;
}

/* The placement the current profile gives for the configured budget (or, without GPU workers,
 * for a budget of a quarter of the expert bytes, to show what would be hot). */
static int hook_placement(void *user, char **json, char *err, size_t errlen)
{
    struct daemon *d = user;
    uint32_t L = d->model.hp.n_layer, E = d->model.hp.n_expert;
    uint64_t *eb = calloc(L, sizeof *eb);
    if (!eb)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    for (uint32_t l = 0; l < L; l++)
        eb[l] = moe_model_expert_bytes(&d->model, l);
    uint64_t budget;
    const char *source;
    if (d->cfg.vram_budget != MOE_VRAM_AUTO && d->cfg.vram_budget > d->model.bytes_dense) {
        budget = d->cfg.vram_budget - d->model.bytes_dense;
        source = "vram-budget minus dense weights";
    } else {
        budget = d->model.bytes_experts / 4;
        source = "a quarter of the expert bytes (no --vram-budget)";
    }
    struct moe_placement pl;
    bool have_counts = d->profile.tokens > 0;
    int rc = moe_placement_compute(&pl, L, E, d->model.hp.n_expert_used, eb,
                                   have_counts ? d->profile.counts : NULL, budget, err, errlen);
    free(eb);
    if (rc)
        return rc;
    json_t *o = json_object();
    json_object_set_new(o, "budget_bytes", json_integer((json_int_t)budget));
    json_object_set_new(o, "budget_source", json_string(source));
    json_object_set_new(o, "bytes_used", json_integer((json_int_t)pl.bytes_used));
    json_object_set_new(o, "floor", json_integer(pl.floor));
    json_object_set_new(o, "profile_tokens", json_integer((json_int_t)d->profile.tokens));
    json_object_set_new(o, "n_layer", json_integer(L));
    json_object_set_new(o, "n_expert", json_integer(E));
    json_t *layers = json_array();
    for (uint32_t l = 0; l < L; l++) {
        json_t *lo = json_object();
        json_t *hot = json_array();
        for (uint32_t e = 0; e < E; e++)
            if (pl.hot[(size_t)l * E + e])
                json_array_append_new(hot, json_integer(e));
        json_object_set_new(lo, "layer", json_integer(l));
        json_object_set_new(lo, "n_hot", json_integer(pl.n_hot[l]));
        json_object_set_new(lo, "hit_rate", json_real(pl.hit_rate[l]));
        json_object_set_new(lo, "hot", hot);
        json_array_append_new(layers, lo);
    }
    json_object_set_new(o, "layers", layers);
    moe_placement_free(&pl);
    json_t *dr = json_object();
    json_object_set_new(dr, "window_tokens", json_integer((json_int_t)d->drift.window));
    json_object_set_new(dr, "checks", json_integer((json_int_t)d->drift.checks));
    json_object_set_new(dr, "drifting", json_boolean(d->drift.drifting));
    json_object_set_new(dr, "changes", json_integer((json_int_t)d->drift.changes));
    if (d->drift.checks) {
        json_object_set_new(dr, "heldout_hit_rate_profile", json_real(d->drift.current));
        json_object_set_new(dr, "heldout_hit_rate_recent", json_real(d->drift.fresh));
    }
    json_object_set_new(o, "drift", dr);
    /* What each GPU worker holds: slots and pinned slots per layer, hits and misses since it
     * started (from its last Metrics). */
    json_t *workers = json_array();
    for (uint32_t i = 0; d->workers && i < d->n_workers; i++) {
        struct moed_worker_info wi;
        struct moed_worker_offload wo;
        if (moed_workers_info(d->workers, i, &wi) || moed_workers_offload(d->workers, i, &wo))
            continue;
        json_t *w = json_object();
        json_object_set_new(w, "worker", json_integer(i));
        json_object_set_new(w, "device", json_string(wi.device));
        json_object_set_new(w, "offload", json_boolean(wo.active));
        json_object_set_new(w, "expert_hits", json_integer((json_int_t)wi.expert_hits));
        const int64_t hot = moed_wl_hot_experts(d->workers, i);
        json_object_set_new(w, "hot_experts", hot >= 0 ? json_integer(hot) : json_null());
        json_object_set_new(w, "expert_misses", json_integer((json_int_t)wi.expert_misses));
        if (wo.active) {
            json_object_set_new(w, "expert_vram_bytes", json_integer((json_int_t)wo.expert_vram_bytes));
            json_object_set_new(w, "expert_bytes", json_integer((json_int_t)wo.expert_bytes));
            json_object_set_new(w, "fill_bytes", json_integer((json_int_t)wo.fill_bytes));
            json_object_set_new(w, "direct", json_integer((json_int_t)wo.direct));
            json_object_set_new(w, "direct_bytes", json_integer((json_int_t)wo.direct_bytes));
            json_object_set_new(w, "prefetched", json_integer((json_int_t)wo.prefetched));
            json_object_set_new(w, "prefetch_bytes", json_integer((json_int_t)wo.prefetch_bytes));
            json_object_set_new(w, "prefetch_used", json_integer((json_int_t)wo.prefetch_used));
            json_object_set_new(w, "prefetch_wasted", json_integer((json_int_t)wo.prefetch_wasted));
            json_t *wl = json_array();
            for (uint32_t l = 0; l < wo.n_layer; l++) {
                json_t *lo = json_object();
                const uint64_t looked = wo.hits[l] + wo.misses[l];
                json_object_set_new(lo, "layer", json_integer(l));
                json_object_set_new(lo, "slots", json_integer(wo.slots[l]));
                json_object_set_new(lo, "hot", json_integer(wo.hot[l]));
                json_object_set_new(lo, "residency", json_real((double)wo.slots[l] / (double)E));
                json_object_set_new(lo, "hits", json_integer((json_int_t)wo.hits[l]));
                json_object_set_new(lo, "misses", json_integer((json_int_t)wo.misses[l]));
                json_object_set_new(lo, "hit_rate",
                                    looked ? json_real((double)wo.hits[l] / (double)looked)
                                           : json_null());
                json_array_append_new(wl, lo);
            }
            json_object_set_new(w, "layers", wl);
        }
        json_array_append_new(workers, w);
    }
    json_object_set_new(o, "workers", workers);
    if (d->workers) {
        json_t *wl = moed_wl_json(&d->wl, d->workers, d->n_workers);
        json_object_update(o, wl);
        json_decref(wl);
    }
    *json = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return *json ? 0 : moe_fail(err, errlen, -ENOMEM, "out of memory");
}

static int hook_metrics(void *user, char **text)
{
    struct daemon *d = user;
    size_t cap = 0, n = 0;
    char *b = NULL;
    int rc = 0;
    rc |= moe_buf_printf(&b, &n, &cap,
                          "# HELP moed_worker_up 1 when the worker is ready.\n# TYPE moed_worker_up gauge\n");
    struct moed_worker_info wi[MAX_DEVICES];
    uint32_t nw = 0;
    for (uint32_t i = 0; d->workers && i < d->n_workers && i < MAX_DEVICES; i++)
        if (moed_workers_info(d->workers, i, &wi[nw]) == 0)
            nw++;
    for (uint32_t i = 0; i < nw; i++)
        rc |= moe_buf_printf(&b, &n, &cap, "moed_worker_up{worker=\"%u\",device=\"%s\"} %d\n", i,
                              wi[i].device, wi[i].state == MOED_WORKER_READY);
    rc |= moe_buf_printf(&b, &n, &cap, "# HELP moed_worker_failed 1 when the worker never got "
                          "ready and is not restarted any more.\n# TYPE moed_worker_failed gauge\n");
    for (uint32_t i = 0; i < nw; i++)
        rc |= moe_buf_printf(&b, &n, &cap, "moed_worker_failed{worker=\"%u\",device=\"%s\"} %d\n", i,
                              wi[i].device, wi[i].state == MOED_WORKER_FAILED);
    rc |= moe_buf_printf(&b, &n, &cap, "# HELP moed_worker_restarts_total Times the worker was restarted.\n"
                          "# TYPE moed_worker_restarts_total counter\n");
    for (uint32_t i = 0; i < nw; i++)
        rc |= moe_buf_printf(&b, &n, &cap, "moed_worker_restarts_total{worker=\"%u\"} %u\n", i,
                              wi[i].restarts);
    rc |= moe_buf_printf(&b, &n, &cap, "# HELP moed_worker_tokens_per_second Decode tokens per second in the worker's last report.\n"
                          "# TYPE moed_worker_tokens_per_second gauge\n");
    for (uint32_t i = 0; i < nw; i++)
        rc |= moe_buf_printf(&b, &n, &cap, "moed_worker_tokens_per_second{worker=\"%u\"} %.3f\n",
                              i, wi[i].tokens_per_s);
    rc |= moe_buf_printf(&b, &n, &cap, "# HELP moed_worker_sequence_tokens_per_second Decode tokens per second of one of the worker's sequences, as the scheduler measures it to place requests (0: not measured yet).\n"
                          "# TYPE moed_worker_sequence_tokens_per_second gauge\n");
    for (uint32_t i = 0; i < nw; i++)
        rc |= moe_buf_printf(&b, &n, &cap,
                              "moed_worker_sequence_tokens_per_second{worker=\"%u\"} %.3f\n", i,
                              d->workers ? sched_worker_rate(moed_workers_sched(d->workers), i)
                                         : 0.0);
    rc |= moe_buf_printf(&b, &n, &cap, "# HELP moed_worker_vram_used_bytes Device memory the worker holds (0 on the CPU).\n"
                          "# TYPE moed_worker_vram_used_bytes gauge\n");
    for (uint32_t i = 0; i < nw; i++)
        rc |= moe_buf_printf(&b, &n, &cap, "moed_worker_vram_used_bytes{worker=\"%u\"} %" PRIu64 "\n",
                              i, wi[i].vram_used);
    rc |= moe_buf_printf(&b, &n, &cap, "# HELP moed_worker_expert_hits_total Chosen experts found "
                          "in VRAM (GPU workers).\n# TYPE moed_worker_expert_hits_total counter\n");
    for (uint32_t i = 0; i < nw; i++)
        rc |= moe_buf_printf(&b, &n, &cap, "moed_worker_expert_hits_total{worker=\"%u\"} %" PRIu64 "\n",
                              i, wi[i].expert_hits);
    rc |= moe_buf_printf(&b, &n, &cap, "# HELP moed_worker_expert_misses_total Chosen experts "
                          "read from host memory (GPU workers).\n# TYPE moed_worker_expert_misses_total counter\n");
    for (uint32_t i = 0; i < nw; i++)
        rc |= moe_buf_printf(&b, &n, &cap, "moed_worker_expert_misses_total{worker=\"%u\"} %" PRIu64 "\n",
                              i, wi[i].expert_misses);
    /* Per GPU worker with offload: bytes copied over PCIe, and hits and misses per layer. */
    struct moed_worker_offload wo[MAX_DEVICES];
    bool any_off = false;
    for (uint32_t i = 0; i < nw; i++) {
        if (moed_workers_offload(d->workers, i, &wo[i]))
            memset(&wo[i], 0, sizeof wo[i]);
        any_off |= wo[i].active;
    }
    if (any_off) {
        /* One family per counter of struct moed_worker_offload, a line per offloading worker. */
        static const struct {
            const char *name, *type, *help;
            size_t off;
        } fam[] = {
            {"expert_fill_bytes_total", "counter",
             "Expert bytes copied from host memory into VRAM (cache slots and prompt staging).",
             offsetof(struct moed_worker_offload, fill_bytes)},
            {"expert_direct_bytes_total", "counter", "Expert bytes the kernels read from host memory (no free slot).",
             offsetof(struct moed_worker_offload, direct_bytes)},
            {"expert_prefetched_total", "counter", "Experts copied into VRAM ahead of their layer (layer-ahead prefetch).",
             offsetof(struct moed_worker_offload, prefetched)},
            {"expert_prefetch_bytes_total", "counter", "Bytes of those.",
             offsetof(struct moed_worker_offload, prefetch_bytes)},
            {"expert_prefetch_used_total", "counter",
             "Prefetched experts that their layer then chose.",
             offsetof(struct moed_worker_offload, prefetch_used)},
            {"expert_prefetch_wasted_total", "counter",
             "Prefetched experts evicted before their layer chose them.",
             offsetof(struct moed_worker_offload, prefetch_wasted)},
            {"expert_vram_bytes", "gauge", "Expert slots in VRAM.",
             offsetof(struct moed_worker_offload, expert_vram_bytes)},
        };
        for (size_t f = 0; f < sizeof fam / sizeof fam[0]; f++) {
            rc |= moe_buf_printf(&b, &n, &cap, "# HELP moed_worker_%s %s\n# TYPE moed_worker_%s %s\n",
                                  fam[f].name, fam[f].help, fam[f].name, fam[f].type);
            for (uint32_t i = 0; i < nw; i++) {
                uint64_t v;
                memcpy(&v, (const char *)&wo[i] + fam[f].off, sizeof v);
                if (wo[i].active)
                    rc |= moe_buf_printf(&b, &n, &cap, "moed_worker_%s{worker=\"%u\"} %" PRIu64 "\n",
                                          fam[f].name, i, v);
            }
        }
        static const char *const what[2] = {"hits", "misses"};
        for (int k = 0; k < 2; k++) {
            rc |= moe_buf_printf(&b, &n, &cap, "# HELP moed_worker_layer_expert_%s_total Chosen experts %s "
                                  "per layer.\n# TYPE moed_worker_layer_expert_%s_total counter\n", what[k],
                                  k ? "not in VRAM" : "found in VRAM", what[k]);
            for (uint32_t i = 0; i < nw; i++)
                for (uint32_t l = 0; wo[i].active && l < wo[i].n_layer; l++)
                    rc |= moe_buf_printf(&b, &n, &cap,
                                          "moed_worker_layer_expert_%s_total{worker=\"%u\",layer=\"%u\"} %" PRIu64 "\n",
                                          what[k], i, l, k ? wo[i].misses[l] : wo[i].hits[l]);
        }
    }
    if (d->tier) {
        struct moed_tier_stats ts;
        uint64_t hits, misses, waits, wait_us, tokens;
        pool_totals(d, &ts, &hits, &misses, &waits, &wait_us, &tokens);
        (void)tokens;
        rc |= moe_buf_printf(&b, &n, &cap,
            "# HELP moed_pool_slots Expert slots of the tiered store's pool.\n# TYPE moed_pool_slots gauge\nmoed_pool_slots %u\n"
            "# HELP moed_pool_resident Pool slots holding an expert.\n# TYPE moed_pool_resident gauge\nmoed_pool_resident %u\n"
            "# HELP moed_pool_bytes Bytes of the pool's slots.\n# TYPE moed_pool_bytes gauge\nmoed_pool_bytes %" PRIu64 "\n"
            "# HELP moed_pool_hits_total Chosen experts the workers found in the pool.\n# TYPE moed_pool_hits_total counter\nmoed_pool_hits_total %" PRIu64 "\n"
            "# HELP moed_pool_misses_total Chosen experts the workers asked for.\n# TYPE moed_pool_misses_total counter\nmoed_pool_misses_total %" PRIu64 "\n"
            "# HELP moed_pool_hit_rate Share of chosen experts found in the pool.\n# TYPE moed_pool_hit_rate gauge\nmoed_pool_hit_rate %.6f\n"
            "# HELP moed_pool_waits_total Expert parts a worker step waited for.\n# TYPE moed_pool_waits_total counter\nmoed_pool_waits_total %" PRIu64 "\n"
            "# HELP moed_pool_wait_seconds_total Time worker steps waited for experts.\n# TYPE moed_pool_wait_seconds_total counter\nmoed_pool_wait_seconds_total %.6f\n"
            "# HELP moed_pool_disk_reads_total Expert blobs read from the model file.\n# TYPE moed_pool_disk_reads_total counter\nmoed_pool_disk_reads_total %" PRIu64 "\n"
            "# HELP moed_pool_disk_read_bytes_total Bytes read from the model file for the pool.\n# TYPE moed_pool_disk_read_bytes_total counter\nmoed_pool_disk_read_bytes_total %" PRIu64 "\n"
            "# HELP moed_pool_read_errors_total Blob reads that failed.\n# TYPE moed_pool_read_errors_total counter\nmoed_pool_read_errors_total %" PRIu64 "\n"
            "# HELP moed_pool_evictions_total Experts dropped from a slot for another.\n# TYPE moed_pool_evictions_total counter\nmoed_pool_evictions_total %" PRIu64 "\n"
            "# HELP moed_pool_merged_requests_total Requests that joined a read under way.\n# TYPE moed_pool_merged_requests_total counter\nmoed_pool_merged_requests_total %" PRIu64 "\n"
            "# HELP moed_pool_read_latency_seconds Blob read latency quantiles (power-of-two buckets).\n# TYPE moed_pool_read_latency_seconds gauge\n"
            "moed_pool_read_latency_seconds{quantile=\"0.5\"} %.6f\nmoed_pool_read_latency_seconds{quantile=\"0.99\"} %.6f\n"
            "# HELP moed_pool_prefetch_reads_total Read-aheads of predicted experts.\n# TYPE moed_pool_prefetch_reads_total counter\nmoed_pool_prefetch_reads_total %" PRIu64 "\n"
            "# HELP moed_pool_prefetch_used_total Requests that joined a read-ahead under way.\n# TYPE moed_pool_prefetch_used_total counter\nmoed_pool_prefetch_used_total %" PRIu64 "\n",
            ts.slots, ts.resident, ts.slot_bytes * ts.slots, hits, misses,
            hits + misses ? (double)hits / (double)(hits + misses) : 1.0, waits, (double)wait_us / 1e6,
            ts.reads, ts.read_bytes, ts.read_errors, ts.evictions, ts.merged, ts.read_p50_ms / 1e3,
            ts.read_p99_ms / 1e3, ts.prefetch_reads, ts.prefetch_used);
    }
    if (d->workers)
        rc |= moed_wl_metrics(&d->wl, d->workers, d->n_workers, &b, &n, &cap);
    rc |= moe_buf_printf(&b, &n, &cap, "# HELP moed_profile_tokens Tokens the routing profile has learned from.\n"
                          "# TYPE moed_profile_tokens gauge\nmoed_profile_tokens %" PRIu64 "\n",
                          d->profile.tokens);
    if (rc) {
        free(b);
        return -ENOMEM;
    }
    *text = b;
    return 0;
}

/* Sampling defaults, field by field: the configuration's (--temp, ...), else the model's
 * general.sampling.* (what its publisher recommends), else OpenAI's. */
static void set_sampling_defaults(struct daemon *d, struct api_opts *ao)
{
    const struct moed_config *c = &d->cfg;
    struct moe_sampling_hints h;
    moe_gguf_sampling_hints(d->gguf, &h);
    bool cfg = false, model = false;
#define PICK(dst, conf, conf_set, hint, hint_set, dflt)                                    \
    do {                                                                                   \
        if (conf_set) {                                                                    \
            dst = (conf);                                                                  \
            cfg = true;                                                                    \
        } else if (hint_set) {                                                             \
            dst = (hint);                                                                  \
            model = true;                                                                  \
        } else {                                                                           \
            dst = (dflt);                                                                  \
        }                                                                                  \
    } while (0)
    PICK(ao->sampling.temperature, (float)c->default_temp, !isnan(c->default_temp),
         (float)h.temperature, !isnan(h.temperature), 1.0f);
    PICK(ao->sampling.top_p, (float)c->default_top_p, !isnan(c->default_top_p), (float)h.top_p,
         !isnan(h.top_p), 1.0f);
    PICK(ao->sampling.min_p, (float)c->default_min_p, !isnan(c->default_min_p), (float)h.min_p,
         !isnan(h.min_p), 0.0f);
    PICK(ao->sampling.repetition_penalty, (float)c->default_repeat_penalty,
         !isnan(c->default_repeat_penalty), (float)h.repeat_penalty, !isnan(h.repeat_penalty),
         1.0f);
    PICK(ao->sampling.top_k, (int32_t)c->default_top_k, c->default_top_k != UINT32_MAX,
         (int32_t)h.top_k, h.top_k >= 0, 0);
#undef PICK
    ao->sampling.set = true;
    ao->sampling.source = cfg && model ? "configuration and the model's general.sampling"
                          : cfg        ? "configuration"
                          : model      ? "the model's general.sampling"
                                       : "OpenAI's defaults";
    if (cfg || model)
        log_info("sampling defaults (%s): temperature %g, top_p %g, top_k %d, min_p %g, "
                 "repetition penalty %g", ao->sampling.source, (double)ao->sampling.temperature,
                 (double)ao->sampling.top_p, (int)ao->sampling.top_k, (double)ao->sampling.min_p,
                 (double)ao->sampling.repetition_penalty);
}

/* ---- lifecycle ---- */

/* GPU workers pin their hot experts by the learned profile, live: after every worker is Ready
 * and after each profile save, the daemon sends the profile's counts (a worker re-pins its
 * most-routed experts within the slots it has) with the hot set store/placement.c picks for the
 * expert VRAM the smallest GPU worker holds. Nothing is sent without a profile. */
static void push_placement(struct daemon *d)
{
    if (!d->has_gpu || !d->workers || !d->profile.tokens)
        return;
    uint64_t slots_min = UINT64_MAX;
    for (uint32_t i = 0; i < d->n_workers; i++) {
        struct moed_worker_offload wo;
        if (moed_workers_offload(d->workers, i, &wo) == 0 && wo.active &&
            wo.expert_vram_bytes < slots_min)
            slots_min = wo.expert_vram_bytes;
    }
    if (slots_min == UINT64_MAX)
        return; /* no GPU worker offloads (yet: its first Metrics brings the numbers) */
    uint32_t L = d->model.hp.n_layer, E = d->model.hp.n_expert;
    uint64_t *eb = calloc(L, sizeof *eb);
    size_t nbytes = ((size_t)L * E + 7) / 8;
    uint8_t *bits = calloc(nbytes, 1);
    struct moe_placement pl;
    char err[256];
    if (!eb || !bits) {
        free(eb);
        free(bits);
        return;
    }
    for (uint32_t l = 0; l < L; l++)
        eb[l] = moe_model_expert_bytes(&d->model, l);
    const uint64_t *by = moe_drift_counts(&d->drift) ? moe_drift_counts(&d->drift)
                                                      : d->profile.counts;
    /* Two or more offloading GPU workers and enough keyed traffic: each its own hot set. */
    if (moed_wl_place(&d->wl, d->workers, d->n_workers, &d->model, by)) {
        free(eb);
        free(bits);
        return;
    }
    int rc = moe_placement_compute(&pl, L, E, d->model.hp.n_expert_used, eb, by, slots_min, err,
                                   sizeof err);
    free(eb);
    if (rc) {
        log_warn("placement: %s", err);
        free(bits);
        return;
    }
    uint64_t n_hot = 0;
    for (size_t i = 0; i < (size_t)L * E; i++)
        if (pl.hot[i]) {
            bits[i / 8] |= (uint8_t)(1u << (i % 8));
            n_hot++;
        }
    rc = moed_workers_set_placement(d->workers, bits, nbytes, by);
    log_debug("placement: %s sent to the GPU workers (%" PRIu64 " experts hot in %.2f GiB)%s",
              by == d->profile.counts ? "the profile" : "recent traffic (drift)", n_hot,
              pl.bytes_used / 1073741824.0, rc ? " (not sent: size mismatch)" : "");
    moe_placement_free(&pl);
    free(bits);
}

/* A starting GPU worker's hot set follows the profile learned so far. */
static const uint64_t *profile_counts(void *user)
{
    struct daemon *d = user;
    return d->profile.tokens > 0 ? d->profile.counts : NULL;
}

static void on_ready(void *user)
{
    struct daemon *d = user;
    d->ready = true;
    push_placement(d);
    api_set_ready(d->api, true);
    notify_ready();
    uint32_t total, ready = moed_workers_ready(d->workers, &total);
    log_info("ready: %u of %u worker(s) serving %s on %s%s%s", ready, total, d->cfg.model,
             d->cfg.socket, d->cfg.listen ? " and " : "", d->cfg.listen ? d->cfg.listen : "");
}

static void on_worker_state(void *user, uint32_t worker, enum moed_worker_state st)
{
    struct daemon *d = user;
    struct moed_worker_info wi;
    if (moed_workers_info(d->workers, worker, &wi) == 0 && st == MOED_WORKER_BACKOFF)
        log_warn("worker %u (%s) is down: %s; restarting", worker, wi.device, wi.last_error);
    else
        log_info("worker %u: %s", worker, state_name(st));
    uint32_t total, ready = moed_workers_ready(d->workers, &total);
    api_set_ready(d->api, d->ready && ready > 0);
    if (!d->stopping)
        notify_status("%u of %u workers ready", ready, total);
}

/* The watchdog is fed while the loop runs and some worker is alive: a daemon whose workers all
 * keep failing gets restarted by systemd. */
static void on_watchdog(uv_timer_t *t)
{
    struct daemon *d = t->data;
    bool healthy = !d->workers;
    for (uint32_t i = 0; d->workers && i < d->n_workers && !healthy; i++) {
        struct moed_worker_info wi;
        if (moed_workers_info(d->workers, i, &wi) == 0 &&
            (wi.state == MOED_WORKER_READY || wi.state == MOED_WORKER_STARTING ||
             wi.state == MOED_WORKER_STOPPING))
            healthy = true;
    }
    if (healthy || d->stopping) {
        notify_watchdog();
        d->watchdog_starved = false;
    } else if (!d->watchdog_starved) {
        d->watchdog_starved = true;
        log_warn("no healthy worker: not feeding the systemd watchdog");
    }
}

static void close_walk(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

static void on_workers_stopped(void *user)
{
    struct daemon *d = user;
    if (d->db)
        profile_save(d);
    api_free(d->api);
    d->api = NULL;
    http_server_close(d->http);
    d->http = NULL;
    moed_workers_free(d->workers);
    d->workers = NULL;
    log_info("stopped");
    uv_walk(d->loop, close_walk, NULL);
}

static void begin_stop(struct daemon *d, const char *why)
{
    if (d->stopping) {
        log_warn("%s again while stopping; still draining", why);
        return;
    }
    d->stopping = true;
    log_info("%s: draining (no new connections; in-flight requests may finish)", why);
    notify_stopping();
    api_set_draining(d->api, true);
    http_server_stop_listening(d->http);
    uv_timer_stop(&d->profile_timer);
    if (d->store_loading) {
        /* The store build stops at its next progress report; its completion finishes the stop. */
        atomic_store(&d->store_cancel, true);
        return;
    }
    if (d->workers)
        moed_workers_stop(d->workers, 30000, on_workers_stopped, d);
    else
        on_workers_stopped(d);
}

static void on_signal(uv_signal_t *s, int signum)
{
    struct daemon *d = s->data;
    if (signum == SIGHUP) {
        if (log_reopen() == 0)
            log_info("SIGHUP: log file reopened");
        return;
    }
    begin_stop(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* ---- startup ---- */

static int store_progress(uint64_t done, uint64_t total, void *user)
{
    struct daemon *d = user;
    double now = moe_now_s();
    if (d->progress_last == 0)
        d->progress_last = now;
    static double t0;
    if (t0 == 0)
        t0 = now;
    double el = now - t0;
    double gib = done / 1073741824.0, tot = total / 1073741824.0;
    double rate = el > 0 ? gib / el : 0;
    double eta = rate > 0 ? (tot - gib) / rate : 0;
    notify_status("loading experts: %.2f of %.2f GiB (%.1f GiB/s, ETA %.0f s)", gib, tot, rate, eta);
    notify_watchdog();
    if (d->api)
        api_set_loading(d->api, done, total);
    if (isatty(2)) {
        fprintf(stderr, "\rmoed: loading experts %6.2f / %.2f GiB  %5.1f GiB/s  ETA %3.0f s ", gib,
                tot, rate, eta);
        if (done == total)
            fputc('\n', stderr);
    }
    return atomic_load(&d->store_cancel) ? 1 : 0; /* SIGTERM while loading: stop building */
}

/* --devices auto: one worker per GPU that the worker program lists as usable (the daemon is
 * built without CUDA: what a worker can compute on is the worker's to say), else none (CPU).
 * Returns the number of GPU workers planned. */
static uint32_t plan_auto(struct daemon *d)
{
    char bin[PATH_MAX], err[PATH_MAX + 256];
    struct devices_found found;
    if (moed_worker_bin_path(d->cfg.worker_bin, bin, sizeof bin, err, sizeof err) ||
        devices_list(bin, LIST_DEVICES_TIMEOUT_MS, &found, err, sizeof err)) {
        log_warn("--devices auto: %s; serving on the CPU", err);
        return 0;
    }
    if (found.n_gpu == 0) {
        log_info("--devices auto: %s lists no usable GPU; serving on the CPU", bin);
        return 0;
    }
    uint32_t n = 0;
    for (uint32_t i = 0; i < found.n_gpu && n < MAX_DEVICES; i++) {
        char name[16];
        snprintf(name, sizeof name, "cuda:%d", found.gpu[i]);
        log_info("--devices auto: %s (%s)", name, found.desc[i]);
        d->devices[n++] = strdup(name);
    }
    d->has_gpu = true;
    return n;
}

/* --devices: "cpu" -> N cpu workers; "auto" -> what the worker lists (plan_auto); a list
 * ("0,1", "cpu,cuda:0") -> one worker per item. */
static int plan_workers(struct daemon *d, char *err, size_t errlen)
{
    const char *dev = d->cfg.devices;
    uint32_t n = 0;
    if (!strcmp(dev, "auto")) {
        n = plan_auto(d);
    } else if (strcmp(dev, "cpu")) {
        char names[DEVICES_MAX][16];
        int rc = devices_parse_list(dev, names, &n);
        if (rc)
            return moe_fail(err, errlen, rc, "--devices '%s': expected cpu, auto or a list of "
                            "devices like 0,1 or cpu,cuda:0", dev);
        if (n > MAX_DEVICES)
            return moe_fail(err, errlen, MOE_ERANGE, "--devices: too many devices");
        for (uint32_t i = 0; i < n; i++) {
            d->devices[i] = strdup(names[i]);
            d->has_gpu |= devices_gpu_index(names[i]) >= 0;
        }
    }
    if (n == 0) {
        uint32_t w = d->cfg.workers ? d->cfg.workers : 1;
        for (uint32_t i = 0; i < w && i < MAX_DEVICES; i++)
            d->devices[n++] = strdup("cpu");
    } else if (d->cfg.workers && d->cfg.workers != n) {
        log_warn("--workers %u ignored: one worker per listed device (%u)", d->cfg.workers, n);
    }
    for (uint32_t i = 0; i < n; i++)
        if (!d->devices[i])
            return moe_fail(err, errlen, -ENOMEM, "out of memory");
    d->n_workers = n;
    return 0;
}

static int mkdir_p(const char *path, mode_t mode)
{
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s", path) >= (int)sizeof tmp)
        return -ENAMETOOLONG;
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = 0;
        if (mkdir(tmp, mode) != 0 && errno != EEXIST)
            return -errno;
        *p = '/';
    }
    if (mkdir(tmp, mode) != 0 && errno != EEXIST)
        return -errno;
    return 0;
}

/* One daemon per state dir: an exclusive flock on <state_dir>/moed.lock, held (the fd stays open,
 * close-on-exec so workers do not inherit it) until the process exits. The file holds the pid of
 * the daemon that has it, for the message a second daemon prints. */
static int lock_state_dir(struct daemon *d, char *err, size_t errlen)
{
    const char *dir = d->cfg.state_dir;
    char path[PATH_MAX];
    if ((size_t)snprintf(path, sizeof path, "%s/moed.lock", dir) >= sizeof path)
        return moe_fail(err, errlen, -ENAMETOOLONG, "state dir %s: path too long", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0640);
    if (fd < 0)
        return moe_fail(err, errlen, -errno, "state dir %s: cannot open %s: %s", dir, path,
                        strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        if (e != EWOULDBLOCK) {
            close(fd);
            return moe_fail(err, errlen, -e, "state dir %s: cannot lock %s: %s", dir, path,
                            strerror(e));
        }
        char buf[32] = "";
        ssize_t k = pread(fd, buf, sizeof buf - 1, 0);
        close(fd);
        long pid = k > 0 ? strtol(buf, NULL, 10) : 0;
        char who[64] = "";
        if (pid > 0)
            snprintf(who, sizeof who, " (pid %ld)", pid);
        return moe_fail(err, errlen, -EBUSY,
                        "state dir %s is in use by another moed%s: is moed already running? "
                        "Each daemon needs its own --state-dir", dir, who);
    }
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, buf, (size_t)n, 0) != n)
        log_warn("state dir %s: cannot write the pid to %s: %s", dir, path, strerror(errno));
    d->state_lock_fd = fd + 1;
    return 0;
}

static const char *base_name(const char *path, char *out, size_t cap)
{
    const char *s = strrchr(path, '/');
    snprintf(out, cap, "%s", s ? s + 1 : path);
    char *dot = strstr(out, ".gguf");
    if (dot && dot[5] == 0)
        *dot = 0;
    return out;
}

/* ---- tiered store ---- */

static void on_expert_request(void *user, uint32_t worker, uint32_t layer, uint32_t expert,
                              uint64_t step, bool prefetch)
{
    struct daemon *d = user;
    (void)step;
    if (d->tier)
        moed_tier_request(d->tier, worker, layer, expert, prefetch);
}

static void on_worker_reaped(void *user, uint32_t worker)
{
    struct daemon *d = user;
    if (d->tier)
        moed_tier_worker_gone(d->tier, worker);
}

static void tier_answer(void *user, uint32_t worker, uint32_t layer, uint32_t expert,
                        uint64_t offset, uint64_t size, int code, const char *msg)
{
    struct daemon *d = user;
    if (d->workers)
        moed_workers_expert_ready(d->workers, worker, layer, expert, offset, size, code, msg);
}

/* --ram-budget: how many expert slots the store gets (0: every expert, a full store) and which
 * blobs fill them at start. */
static int plan_tier(struct daemon *d, char *err, size_t errlen)
{
    const char *v = d->cfg.ram_budget;
    const struct moe_hparams *hp = &d->model.hp;
    uint64_t all = (uint64_t)hp->n_layer * hp->n_expert, slots;
    if (!v)
        return 0;
    int rc = moe_store_budget_slots(&d->model, v, d->n_workers, &slots, err, errlen);
    if (rc || !slots)
        return rc; /* refused, or every expert fits: the full store */
    uint64_t slot = moe_store_slot_bytes(&d->model);
    char b1[32], b2[32];
    /* A GPU worker pins the experts one layer's step reads in place at once: its share of the
     * slots must hold a layer's experts (docs/offload.md). */
    for (uint32_t i = 0; i < d->n_workers; i++)
        if (strcmp(d->devices[i], "cpu") != 0 && slots / d->n_workers < hp->n_expert)
            return moe_fail(err, errlen, MOE_ERANGE, "--ram-budget %s keeps %" PRIu64 " of %"
                            PRIu64 " experts in RAM, %" PRIu64 " per worker; worker %u is %s, and "
                            "a GPU worker needs a share of at least one layer's experts (%u): "
                            "give at least %s", v, slots, all, slots / d->n_workers, i,
                            d->devices[i], hp->n_expert,
                            human_bytes((uint64_t)hp->n_expert * d->n_workers * slot, b2,
                                        sizeof b2));
    if (d->n_workers > MOE_POOL_MAX_WORKERS)
        return moe_fail(err, errlen, MOE_ERANGE, "--ram-budget: at most %u workers share a pool",
                        MOE_POOL_MAX_WORKERS);
    d->pool_slots = (uint32_t)slots;
    d->pool_fill = malloc(sizeof *d->pool_fill * slots);
    if (!d->pool_fill)
        return moe_fail(err, errlen, -ENOMEM, "out of memory");
    d->n_pool_fill = moed_tier_fill_order(d->profile.tokens ? d->profile.counts : NULL,
                                          hp->n_layer, hp->n_expert, d->pool_slots, d->pool_fill);
    log_info("--ram-budget %s: %u of %" PRIu64 " experts in RAM (%s), filled %s", v, d->pool_slots,
             all, human_bytes(slots * slot, b1, sizeof b1),
             d->profile.tokens ? "by the routing profile" : "evenly (no profile yet)");
    return 0;
}

static uint32_t gpu_workers(const struct daemon *d)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < d->n_workers; i++)
        n += devices_gpu_index(d->devices[i]) >= 0;
    return n;
}

/* Starts the workers once the store exists. Returns 0 or 1 (logged). */
static int start_workers(struct daemon *d)
{
    struct moed_config *c = &d->cfg;
    const struct moe_hparams *hp = &d->model.hp;
    uint32_t n_ctx = d->n_ctx;
    char err[512];
    int rc;
    /* Workers. */
    int32_t eog[64];
    uint32_t n_eog = 0;
    for (uint32_t id = 0; id < moe_tok_n_vocab(d->tok) && n_eog < 64; id++)
        if (moe_tok_is_eog(d->tok, (int32_t)id))
            eog[n_eog++] = (int32_t)id;
    struct moed_workers_opts wo = {
        .model_path = c->model,
        .worker_bin = c->worker_bin,
        .n_workers = d->n_workers,
        .devices = (const char *const *)d->devices,
        .n_ctx = n_ctx,
        .n_seq = c->parallel,
        .n_threads = (int)c->threads,
        .vram_budget = c->vram_budget,
        .vram_budget_dev = c->vram_budget_dev,
        .vram_budget_set = c->vram_budget_set,
        .expert_residency = c->expert_residency,
        .cache_slots = c->cache_slots,
        .route_signatures = c->route_signatures == CONFIG_ON ||
                            (c->route_signatures == CONFIG_AUTO && gpu_workers(d) >= 2),
        .profile_counts = profile_counts,
        .store_fd = moe_store_fd(d->store),
        .store_size = moe_store_size(d->store),
        .store_fingerprint = d->model.fingerprint,
        .n_vocab = hp->n_vocab,
        .n_layer = hp->n_layer,
        .n_expert = hp->n_expert,
        .eog = eog,
        .n_eog = n_eog,
        .queue_max = c->queue_max,
        .silent_ms = c->worker_silent_s * 1000u,
        .stall_ms = c->worker_stall_s * 1000u,
        .on_routing = on_routing,
        .on_expert_request = d->pool_slots ? on_expert_request : NULL,
        .on_worker_reaped = d->pool_slots ? on_worker_reaped : NULL,
        .on_ready = on_ready,
        .on_worker_state = on_worker_state,
        .user = d,
    };
    notify_status("starting %u worker(s)", d->n_workers);
    if ((rc = moed_workers_start(d->loop, &wo, &d->workers, err, sizeof err))) {
        log_error("workers: %s", err);
        return 1;
    }
    api_set_sched(d->api, moed_workers_sched(d->workers));

    return 0;
}

static void store_build(uv_work_t *w)
{
    struct daemon *d = w->data;
    if (d->pool_slots)
        d->store_rc = moe_store_create_pool(&d->store_built, &d->model, 0, d->pool_slots,
                                            d->n_workers, d->pool_fill, d->n_pool_fill,
                                            store_progress, d, d->store_err, sizeof d->store_err);
    else
        d->store_rc = moe_store_create(&d->store_built, &d->model, 0, store_progress, d,
                                       d->store_err, sizeof d->store_err);
}

static void store_done(uv_work_t *w, int status)
{
    struct daemon *d = w->data;
    d->store_loading = false;
    if (d->stopping) {
        moe_store_close(d->store_built);
        d->store_built = NULL;
        on_workers_stopped(d);
        return;
    }
    if (status || d->store_rc) {
        log_error("expert store: %s", status ? uv_strerror(status) : d->store_err);
        d->exit_code = 1;
        begin_stop(d, "expert store failed");
        return;
    }
    d->store = d->store_built;
    d->store_built = NULL;
    char hb1[32], hb2[32];
    struct moe_store_info si;
    moe_store_get_info(d->store, &si);
    log_info("expert store: %s in %.2f s (%d threads, %s on huge pages)",
             human_bytes(si.size, hb1, sizeof hb1), si.seconds, si.threads,
             human_bytes(si.huge_bytes, hb2, sizeof hb2));
    if (d->pool_slots) {
        char err[512];
        struct moed_tier_opts to = {.loop = d->loop, .store = d->store, .model = &d->model,
                                    .path = d->cfg.model, .counts = profile_counts,
                                    .prefetch_max = d->cfg.pool_prefetch,
                                    .io = d->cfg.pool_io, .answer = tier_answer, .user = d};
        if (moed_tier_new(&d->tier, &to, err, sizeof err)) {
            log_error("tiered store: %s", err);
            d->exit_code = 1;
            begin_stop(d, "tiered store failed");
            return;
        }
        const char *why = "";
        const char *io = moed_tier_io(d->tier, &why);
        log_info("tiered store: %u expert slots of %s, %u of %u experts loaded at start; misses "
                 "read %s%s%s%s",
                 si.pool_slots, human_bytes(si.pool_slot_bytes, hb1, sizeof hb1), d->n_pool_fill,
                 d->model.hp.n_layer * d->model.hp.n_expert,
                 !strcmp(io, "direct") ? "with O_DIRECT" : "buffered", why[0] ? " (O_DIRECT: " : "",
                 why, why[0] ? ")" : "");
    }
    if (start_workers(d)) {
        d->exit_code = 1;
        begin_stop(d, "workers failed to start");
    }
}

static int run(struct daemon *d, int argc, char **argv)
{
    char err[1024];
    bool help;
    int rc = config_init(&d->cfg);
    if (rc) {
        fprintf(stderr, "moed: out of memory\n");
        return 1;
    }
    if ((rc = config_parse_args(&d->cfg, argc, argv, &help, err, sizeof err))) {
        fprintf(stderr, "moed: %s\n", err);
        return rc == MOE_ENOTFOUND || rc == MOE_EFORMAT || rc == MOE_ERANGE ? 2 : 1;
    }
    if (help) {
        config_usage(stdout);
        return 0;
    }
    struct moed_config *c = &d->cfg;
    log_set_level(c->log_level);
    moe_ipc_log_init("moed", (enum moe_ipc_log_level)c->log_level);
    if (c->log_file && (rc = log_open_file(c->log_file, err, sizeof err))) {
        fprintf(stderr, "moed: %s\n", err);
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    d->watchdog_us = notify_init();

    /* Profiles live in the state dir; create it like systemd's StateDirectory= would, and take
     * it (and check the socket) before the slow steps, so that a second daemon on the same
     * state dir or socket exits at once without touching either. */
    if ((rc = mkdir_p(c->state_dir, 0750))) {
        log_error("state dir %s: %s", c->state_dir, strerror(-rc));
        return 1;
    }
    if ((rc = lock_state_dir(d, err, sizeof err))) {
        log_error("%s", err);
        return 1;
    }
    if ((rc = http_unix_socket_check(c->socket, err, sizeof err))) {
        log_error("%s", err);
        return 1;
    }

    /* The model: a bad file is reported and we exit 1 before anything else exists. */
    notify_status("opening %s", c->model);
    log_info("opening %s", c->model);
    if ((rc = gguf_open(&d->gguf, c->model, err, sizeof err))) {
        log_error("%s: %s", c->model, err);
        return 1;
    }
    if ((rc = moe_model_from_gguf(&d->model, d->gguf, err, sizeof err))) {
        log_error("%s: %s", c->model, err);
        return 1;
    }
    d->model_ok = true;
    if ((rc = moe_tok_load(&d->tok, d->gguf, err, sizeof err))) {
        log_error("%s: tokenizer: %s", c->model, err);
        return 1;
    }
    const struct moe_hparams *hp = &d->model.hp;
    uint32_t n_ctx = c->ctx;
    if (!n_ctx)
        n_ctx = hp->n_ctx_train && hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096;
    if (hp->n_ctx_train && n_ctx > hp->n_ctx_train)
        log_warn("--ctx %u is beyond the model's training context %u", n_ctx, hp->n_ctx_train);
    d->n_ctx = n_ctx;
    char hb1[32], hb2[32];
    log_info("model %s: %u layers, %u experts (top-%u), vocab %u, dense %s, experts %s, context %u",
             d->model.arch_name, hp->n_layer, hp->n_expert, hp->n_expert_used, hp->n_vocab,
             human_bytes(d->model.bytes_dense, hb1, sizeof hb1),
             human_bytes(d->model.bytes_experts, hb2, sizeof hb2), n_ctx);
    if ((rc = plan_workers(d, err, sizeof err))) {
        log_error("%s", err);
        return 2;
    }

    rc = moe_profile_db_open(&d->db, c->state_dir, err, sizeof err);
    if (rc == MOE_EFORMAT) {
        /* The database only holds learned counts: a damaged one is kept aside for inspection
         * and the daemon starts with an empty profile rather than failing for ever. The state
         * dir lock says no other daemon has it open. */
        char moved[PATH_MAX + 64], err2[PATH_MAX + 256];
        if ((rc = moe_profile_db_move_aside(c->state_dir, moved, sizeof moved, err2,
                                            sizeof err2))) {
            log_error("profile database in %s: %s; and %s", c->state_dir, err, err2);
            return 1;
        }
        log_warn("profile database in %s is damaged (%s); moved it to %s and starting with an "
                 "empty routing profile", c->state_dir, err, moved);
        rc = moe_profile_db_open(&d->db, c->state_dir, err, sizeof err);
    }
    if (rc) {
        log_error("profile database in %s: %s", c->state_dir, err);
        return 1;
    }
    rc = moe_profile_load(d->db, d->model.fingerprint, hp->n_layer, hp->n_expert, &d->profile, err,
                          sizeof err);
    if (rc == 0) {
        log_info("routing profile loaded: %" PRIu64 " tokens", d->profile.tokens);
    } else {
        if (rc != MOE_ENOTFOUND)
            log_warn("routing profile in %s unusable (%s); starting a new one", c->state_dir, err);
        if ((rc = moe_profile_init(&d->profile, d->model.fingerprint, hp->n_layer, hp->n_expert))) {
            log_error("profile: %s", moe_strerror(rc));
            return 1;
        }
    }
    if ((rc = moe_drift_init(&d->drift, hp->n_layer, hp->n_expert, DRIFT_WINDOW_TOKENS,
                             DRIFT_MARGIN))) {
        log_error("placement: %s", moe_strerror(rc));
        return 1;
    }
    if ((rc = plan_tier(d, err, sizeof err))) {
        log_error("%s", err);
        return 2;
    }

    d->loop = uv_default_loop();
    struct api_opts ao = {
        .tok = d->tok,
        .model = {.id = NULL, .arch = d->model.arch_name, .n_ctx = n_ctx, .n_vocab = hp->n_vocab,
                  .n_layer = hp->n_layer, .n_expert = hp->n_expert,
                  .n_expert_used = hp->n_expert_used, .fingerprint = d->model.fingerprint,
                  .bytes_dense = d->model.bytes_dense, .bytes_experts = d->model.bytes_experts,
                  .n_slots = d->n_workers * c->parallel},
        .admin_uid = geteuid(),
        .max_tokens_default = c->max_tokens_default,
        .api_key = c->api_key,
        .hooks = {hook_status, hook_profile_export, hook_profile_import, hook_profile_reset,
                  hook_placement, hook_metrics, d},
        .loop = d->loop,
    };
    char model_id[256];
    ao.model.id = c->model_alias ? c->model_alias : base_name(c->model, model_id, sizeof model_id);
    set_sampling_defaults(d, &ao);
    struct group gr, *grp = NULL;
    char grbuf[4096];
    if (c->admin_group && getgrnam_r(c->admin_group, &gr, grbuf, sizeof grbuf, &grp) == 0 && grp) {
        ao.admin_gid = grp->gr_gid;
        ao.have_admin_gid = true;
    } else if (c->admin_group && strcmp(c->admin_group, "moed") != 0) {
        log_warn("--admin-group %s: no such group; only root and uid %u may use /admin", c->admin_group,
                 (unsigned)geteuid());
    }
    char *tmpl = NULL;
    if (c->chat_template && !(tmpl = read_text_file(c->chat_template, JINJA_MAX_TEMPLATE, err, sizeof err))) {
        log_error("--chat-template %s: %s", c->chat_template, err);
        return 1;
    }
    ao.chat_template = tmpl;
    rc = api_new(&d->api, &ao, err, sizeof err);
    free(tmpl);
    if (rc) {
        log_error("%s", err);
        return 1;
    }
    log_info("chat template: %s", c->chat_template ? c->chat_template
                                  : moe_tok_chat_template(d->tok) ? "the model's" : "built-in ChatML");
    struct http_limits lim;
    http_limits_default(&lim);
    lim.max_body_bytes = c->max_body;
    /* All connections together hold at most this much of request bodies (then 503). */
    if (c->max_total_body)
        lim.max_total_body_bytes = (size_t)c->max_total_body;
    else if (lim.max_total_body_bytes < 4 * (size_t)c->max_body)
        lim.max_total_body_bytes = 4 * (size_t)c->max_body;
    lim.max_write_queue = (size_t)c->max_write_queue;
    lim.max_conns = c->max_conns;
    lim.admin_reserve = c->admin_reserve;
    lim.idle_timeout_ms = (uint64_t)c->idle_timeout_s * 1000;
    if ((rc = http_server_new(&d->http, d->loop, &lim, api_handle, d->api)) ||
        (rc = http_server_listen_unix(d->http, c->socket, err, sizeof err))) {
        log_error("%s", rc == -ENOMEM ? "out of memory" : err);
        return 1;
    }
    http_server_on_status(d->http, api_count_status, d->api);
    if (c->listen && (rc = http_server_listen_tcp(d->http, c->listen, err, sizeof err))) {
        log_error("%s", err);
        http_server_stop_listening(d->http);
        return 1;
    }
    if (c->listen)
        log_info("listening on %s and %s (tcp port %d)", c->socket, c->listen,
                 http_server_tcp_port(d->http));
    else
        log_info("listening on %s", c->socket);

    uv_signal_init(d->loop, &d->sig_term);
    uv_signal_init(d->loop, &d->sig_int);
    uv_signal_init(d->loop, &d->sig_hup);
    d->sig_term.data = d->sig_int.data = d->sig_hup.data = d;
    uv_signal_start(&d->sig_term, on_signal, SIGTERM);
    uv_signal_start(&d->sig_int, on_signal, SIGINT);
    uv_signal_start(&d->sig_hup, on_signal, SIGHUP);
    uv_timer_init(d->loop, &d->profile_timer);
    d->profile_timer.data = d;
    uint64_t pi = (uint64_t)c->profile_interval_s * 1000;
    uv_timer_start(&d->profile_timer, on_profile_timer, pi, pi);
    uv_timer_init(d->loop, &d->watchdog_timer);
    d->watchdog_timer.data = d;
    if (d->watchdog_us) {
        uint64_t ms = d->watchdog_us / 1000 ? d->watchdog_us / 1000 : 1;
        uv_timer_start(&d->watchdog_timer, on_watchdog, ms, ms);
    }


    /* The expert store: one copy of the weights in RAM for every worker, built on a thread while
     * the socket answers; the workers start when it is done (store_done). */
    notify_status("loading experts");
    d->store_loading = true;
    d->store_work.data = d;
    if ((rc = uv_queue_work(d->loop, &d->store_work, store_build, store_done))) {
        log_error("expert store: %s", uv_strerror(rc));
        return 1;
    }
    uv_run(d->loop, UV_RUN_DEFAULT);
    return d->exit_code;
}

static void cleanup(struct daemon *d)
{
    if (d->loop) {
        uv_walk(d->loop, close_walk, NULL);
        uv_run(d->loop, UV_RUN_DEFAULT);
        uv_loop_close(d->loop);
    }
    if (d->workers)
        moed_workers_free(d->workers);
    if (d->api)
        api_free(d->api);
    moe_profile_free(&d->profile);
    moe_drift_free(&d->drift);
    moed_wl_free(&d->wl);
    moe_profile_db_close(d->db);
    moed_tier_free(d->tier);
    free(d->pool_fill);
    moe_store_close(d->store);
    moe_tok_free(d->tok);
    if (d->model_ok)
        moe_model_free(&d->model);
    if (d->gguf)
        gguf_close(d->gguf);
    for (uint32_t i = 0; i < MAX_DEVICES; i++)
        free(d->devices[i]);
    if (d->state_lock_fd > 0)
        close(d->state_lock_fd - 1);
    config_free(&d->cfg);
}

int main(int argc, char **argv)
{
    static struct daemon d;
    int rc = run(&d, argc, argv);
    cleanup(&d);
    return rc;
}

/* Complementary hot sets on real routing: the bundled demo model serves several workloads (each
 * with a system prompt and texts of its own) through the worker's compute loop (the batcher with
 * routing signatures on, as a daemon-spawned worker runs it); the first half of each workload's requests teaches the workload table (store/workload.h) and
 * the routing profile, the second half is measured: the share of its routings (prompt tokens
 * evaluated and generated tokens) that pinned experts serve, at a given residency, with
 *   (a) identical hot sets from the profile on every GPU worker, requests spread evenly;
 *   (b) the complementary sets the daemon plans from the table, each request sent where the
 *       scheduler sends it (the worker holding its workload's prefix, else the best coverage).
 * Only pinned experts count (a GPU worker's cache adds hits to both).
 *
 *   build/bench/bench_workloads [--model models/kjv-demo-F16.gguf] [--residency 0.125,0.25,0.5]
 *       [--workers 2] [--requests 24] [--gen 16] [--threads N]
 *
 * Run from the repository's root (the workloads read its files). --requests: per workload (half
 * learned, half measured). Besides (a) and (b): each request served by a set pinned from its own
 * workload's learned routing alone (what one GPU per workload would reach), and the daemon's own
 * estimate from the table (moe_wl_plan). */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/io.h"
#include "store/workload.h"
#include "worker/batcher.h"
#include "worker/engine.h"
#include "worker/engine_load.h"

#define MAX_WL 3
#define MAX_REQ 256

/* The workloads, three applications of one server: scripture (the demo model's own held-out
 * books), questions on technical prose (this project's documentation) and on C code (its
 * sources). Each has a system prompt of its own; a request adds a few non-empty lines of its
 * texts, spread over them. */
static const struct {
    const char *name, *system;
    const char *files[4];
    uint32_t lines;
} WL[MAX_WL] = {
    {"scripture",
     "Thou art a reader of the scriptures. Continue the reading of the chapter that is given, "
     "verse by verse, in the words of the King James Bible.",
     {"tests/fixtures/demo/heldout.txt", NULL},
     2},
    {"documentation",
     "You are the assistant of an inference server's operators. Read the passage of its "
     "documentation below and explain it, settings and numbers included.",
     {"docs/gguf.md", "docs/kernels.md", "docs/tokenizer.md", NULL},
     2},
    {"C code",
     "You review C code for a server that runs language models. Read the lines of the source "
     "file below and say what they do and what could go wrong.",
     {"store/placement.c", "store/profile.c", "store/gguf.c", NULL},
     3},
};

struct req {
    int wl;
    int32_t *prompt;
    uint32_t n_prompt, n_cached;
    uint64_t key;
    uint32_t *sig;      /* [L][E] evaluated prompt tokens */
    uint64_t *routing;  /* [L][E] every evaluated token, generated ones included */
};

static struct {
    uint32_t L, E;
    struct req *cur;
    bool done;
} g;

static void die(const char *what)
{
    fprintf(stderr, "bench_workloads: %s\n", what);
    exit(1);
}

static void sink_token(void *user, uint64_t id, int32_t token, const struct moe_token_lp *lp)
{
    (void)user, (void)id, (void)token, (void)lp;
}

static void sink_done(void *user, uint64_t id, enum moe_finish reason, uint32_t n_prompt,
                      uint32_t n_gen, uint32_t n_cached, const uint32_t *sig)
{
    (void)user, (void)id, (void)reason, (void)n_prompt, (void)n_gen;
    g.cur->n_cached = n_cached;
    memcpy(g.cur->sig, sig, sizeof *sig * g.L * g.E);
    g.done = true;
}

static void sink_error(void *user, uint64_t id, int code, const char *msg)
{
    (void)user, (void)id, (void)code;
    die(msg);
}

static int sink_report(void *user, const struct moe_batcher_report *r)
{
    (void)user, (void)r;
    return 0;
}

/* The non-empty lines of a workload's files, in order. */
static char **lines_of(int wl, size_t *n)
{
    char **out = NULL;
    size_t cap = 0;
    *n = 0;
    for (int f = 0; WL[wl].files[f]; f++) {
        char *text = NULL;
        size_t len;
        if (moe_read_file(WL[wl].files[f], &text, &len))
            die("cannot read a workload's text (run from the repository's root)");
        for (char *p = text; *p;) {
            char *e = strchr(p, '\n');
            const size_t ln = e ? (size_t)(e - p) : strlen(p);
            if (ln > 0) {
                if (*n == cap && !(out = realloc(out, sizeof *out * (cap = cap ? 2 * cap : 256))))
                    die("out of memory");
                if (!(out[*n] = strndup(p, ln)))
                    die("out of memory");
                (*n)++;
            }
            p += ln + (e ? 1 : 0);
        }
        free(text);
    }
    return out;
}

static int32_t *tokens(const struct moe_tokenizer *tok, const char *s, size_t *n)
{
    int32_t *ids;
    if (moe_tok_encode(tok, s, strlen(s), false, &ids, n))
        die("tokenizing");
    return ids;
}

/* Share of routing r's choices, over layers not held whole, that the bits serve. */
static void served(uint32_t L, uint32_t E, const uint64_t *r, const uint8_t *hot, double *hit,
                   double *all)
{
    for (uint32_t l = 0; l < L; l++) {
        uint32_t nh = 0;
        for (uint32_t x = 0; x < E; x++)
            nh += (hot[((size_t)l * E + x) / 8] >> (((size_t)l * E + x) % 8)) & 1;
        if (nh == E)
            continue;
        for (uint32_t x = 0; x < E; x++) {
            const size_t i = (size_t)l * E + x;
            *all += (double)r[i];
            *hit += ((hot[i / 8] >> (i % 8)) & 1) ? (double)r[i] : 0;
        }
    }
}

int main(int argc, char **argv)
{
    const char *model = "models/kjv-demo-F16.gguf";
    const char *res_list = "0.125,0.25,0.5";
    uint32_t W = 2, per_wl = 24, gen = 16;
    int threads = 0;
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            die("every option takes a value");
        if (!strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "--residency"))
            res_list = v;
        else if (!strcmp(a, "--workers"))
            W = (uint32_t)atoi(v);
        else if (!strcmp(a, "--requests"))
            per_wl = (uint32_t)atoi(v);
        else if (!strcmp(a, "--gen"))
            gen = (uint32_t)atoi(v);
        else if (!strcmp(a, "--threads"))
            threads = atoi(v);
        else
            die("unknown option");
    }
    if (W < 2 || W > MOE_WL_MAX_WORKERS || per_wl < 2 || per_wl * MAX_WL > MAX_REQ || gen < 1)
        die("--workers 2..64, --requests 2..85, --gen >= 1");
    char err[512];
    struct moe_loaded lm = {0};
    if (moe_loaded_open(&lm, model, true, err, sizeof err))
        die(err);
    const struct moe_hparams *hp = &lm.model.hp;
    g.L = hp->n_layer;
    g.E = hp->n_expert;
    const size_t n = (size_t)g.L * g.E;

    /* The requests, interleaved over the workloads as traffic would come. */
    struct req *rq = calloc(MAX_REQ, sizeof *rq);
    uint32_t nr = 0;
    char **vs[MAX_WL];
    size_t nv[MAX_WL];
    for (int w = 0; w < MAX_WL; w++)
        if ((vs[w] = lines_of(w, &nv[w])), nv[w] < (size_t)per_wl * WL[w].lines)
            die("a workload's texts have too few lines");
    for (uint32_t i = 0; i < per_wl; i++)
        for (int w = 0; w < MAX_WL; w++) {
            char buf[16384];
            size_t o = (size_t)snprintf(buf, sizeof buf, "%s\n", WL[w].system);
            const size_t at = (size_t)i * (nv[w] / per_wl);
            for (uint32_t k = 0; k < WL[w].lines && o < sizeof buf; k++)
                o += (size_t)snprintf(buf + o, sizeof buf - o, "%.2000s\n", vs[w][at + k]);
            struct req *r = &rq[nr++];
            size_t np;
            r->wl = w;
            r->prompt = tokens(lm.tok, buf, &np);
            r->n_prompt = (uint32_t)np;
            r->key = moe_wl_key(r->prompt, r->n_prompt);
            r->sig = calloc(n, sizeof *r->sig);
            r->routing = calloc(n, sizeof *r->routing);
            if (!r->sig || !r->routing)
                die("out of memory");
            if (!r->key)
                die("a system prompt shorter than a workload key");
        }

    /* Through the worker's compute loop, one request at a time (its routing is then the
     * engine's counters' delta), with a slot per workload so that a system prompt stays cached
     * as on a worker serving several. */
    struct moe_engine_opts eo = {.n_ctx = 1024, .n_seq = MAX_WL, .n_batch = 512,
                                 .n_threads = threads, .record_routes = true};
    struct moe_engine *e = NULL;
    if (moe_engine_init(&e, &lm.model, &eo, err, sizeof err))
        die(err);
    struct moe_batcher *b = NULL;
    struct moe_batcher_cfg bc = {.eng = e, .n_vocab = hp->n_vocab, .n_layer = g.L,
                                 .n_expert = g.E, .n_ctx = 1024, .n_seq = MAX_WL, .n_batch = 512,
                                 .host_sample_all = true, .signatures = true};
    struct moe_batcher_sink sink = {.token = sink_token, .done = sink_done, .error = sink_error,
                                    .report = sink_report};
    if (moe_batcher_init(&b, &bc, &sink))
        die("batcher");
    uint64_t *c0 = calloc(n, sizeof *c0), *c1 = calloc(n, sizeof *c1);
    const double t0 = moe_now_s();
    uint64_t evaluated = 0;
    for (uint32_t i = 0; i < nr; i++) {
        struct moe_job *j = calloc(1, sizeof *j);
        if (!j || !(j->prompt = malloc(sizeof *j->prompt * rq[i].n_prompt)))
            die("out of memory");
        memcpy(j->prompt, rq[i].prompt, sizeof *j->prompt * rq[i].n_prompt);
        j->id = i + 1;
        j->n_prompt = rq[i].n_prompt;
        j->max_tokens = gen;
        j->slot = -1;
        moe_sampler_defaults(&j->sp);
        j->sp.temperature = 0.0f;
        g.cur = &rq[i];
        g.done = false;
        moe_engine_routing_counts(e, c0);
        moe_batcher_add(b, j);
        while (moe_batcher_busy(b))
            if (moe_batcher_step(b))
                die("step");
        if (!g.done)
            die("a request did not finish");
        moe_engine_routing_counts(e, c1);
        for (size_t x = 0; x < n; x++)
            rq[i].routing[x] = c1[x] - c0[x];
        evaluated += rq[i].n_prompt - rq[i].n_cached + gen;
    }
    const double secs = moe_now_s() - t0;
    moe_batcher_free(b);
    moe_engine_free(e);

    /* Learn from the first half of each workload's requests (interleaved: the first half of
     * the list). A workload's requests stay with the worker that got its first one (prefix
     * affinity); new workloads go round the workers. */
    const uint32_t n_learn = nr / 2;
    struct moe_wl_table t;
    if (moe_wl_init(&t, g.L, g.E, W, 64))
        die("table");
    uint64_t *profile = calloc(n, sizeof *profile), *own = calloc((size_t)MAX_WL * n, sizeof *own);
    uint32_t first_worker[MAX_WL], n_keys = 0;
    for (int w = 0; w < MAX_WL; w++)
        first_worker[w] = UINT32_MAX;
    for (uint32_t i = 0; i < n_learn; i++) {
        struct req *r = &rq[i];
        if (first_worker[r->wl] == UINT32_MAX)
            first_worker[r->wl] = n_keys++ % W;
        if (moe_wl_learn(&t, r->key, first_worker[r->wl], r->sig, r->n_prompt - r->n_cached))
            die("learn");
        for (size_t x = 0; x < n; x++) {
            profile[x] += r->routing[x];
            own[(size_t)r->wl * n + x] += r->routing[x];
        }
    }
    printf("bench_workloads: %s, %d workloads (%s, %s, %s) x %u requests (%u learned, %u "
           "measured), %u tokens generated each, %u GPU workers; served in %.1f s (%.0f tokens/s "
           "evaluated)\n",
           model, MAX_WL, WL[0].name, WL[1].name, WL[2].name, per_wl, per_wl / 2,
           per_wl - per_wl / 2, gen, W, secs, (double)evaluated / secs);
    printf("%-10s %-9s %-17s %-17s %-17s %-16s %s\n", "residency", "pinned", "identical",
           "complementary", "own workload's", "daemon's est.", "requests per worker");

    const size_t nb = (n + 7) / 8;
    uint8_t *hot_id = malloc(nb), **hot_c = calloc(W, sizeof *hot_c), *hot_own = malloc(MAX_WL * nb);
    uint32_t *slots = malloc(sizeof *slots * g.L);
    const uint8_t **hp_id = calloc(W, sizeof *hp_id);
    uint64_t *dec = malloc(sizeof *dec * n);
    for (uint32_t w = 0; w < W; w++)
        hot_c[w] = malloc(nb);
    for (const char *p = res_list; *p;) {
        char *end;
        const double res = strtod(p, &end);
        if (end == p || !(res > 0 && res <= 1))
            die("--residency: shares in (0, 1], comma-separated");
        p = *end == ',' ? end + 1 : end;
        uint32_t P = (uint32_t)lround(res * g.E);
        if (P < hp->n_expert_used)
            P = hp->n_expert_used;
        for (uint32_t l = 0; l < g.L; l++)
            slots[l] = P;
        moe_wl_pinned_by(g.L, g.E, slots, profile, hot_id);
        for (int w = 0; w < MAX_WL; w++)
            moe_wl_pinned_by(g.L, g.E, slots, own + (size_t)w * n, hot_own + (size_t)w * nb);
        for (uint32_t w = 0; w < W; w++)
            hp_id[w] = hot_id;
        struct moe_wl_plan pl;
        if (moe_wl_plan(&pl, &t, W, NULL, hp_id, profile))
            die("plan");
        if (!pl.active) {
            printf("%-10g no plan: %s\n", res, pl.why);
            moe_wl_plan_free(&pl);
            continue;
        }
        for (uint32_t w = 0; w < W; w++)
            moe_wl_pinned_by(g.L, g.E, slots, pl.counts[w], hot_c[w]);
        /* The measured half: identical sets serve every request alike; with complementary
         * sets a request goes to the worker holding its workload's prefix (the scheduler's
         * prefix affinity), else to the best coverage (ties: the least loaded). */
        double hi = 0, ai = 0, hc = 0, ac = 0, ho = 0, ao = 0, hid = 0, aid = 0, hcd = 0, acd = 0,
               hod = 0, aod = 0;
        uint32_t load[MOE_WL_MAX_WORKERS] = {0};
        for (uint32_t i = n_learn; i < nr; i++) {
            const struct req *r = &rq[i];
            const struct moe_wl_entry *en = moe_wl_find(&t, r->key);
            int32_t to = -1;
            for (uint32_t w = 0; en && w < W; w++)
                if (en->served[w] > 0 && (to < 0 || en->served[w] > en->served[to]))
                    to = (int32_t)w;
            if (to < 0) {
                double best = -2;
                for (uint32_t w = 0; w < W; w++) {
                    const double c = moe_wl_coverage(&t, en, hot_c[w]);
                    if (to < 0 || c > best + 0.05 || (fabs(c - best) <= 0.05 && load[w] < load[to])) {
                        best = c > best ? c : best;
                        to = (int32_t)w;
                    }
                }
            }
            load[to]++;
            for (size_t x = 0; x < n; x++)
                dec[x] = r->routing[x] - r->sig[x];
            served(g.L, g.E, r->routing, hot_id, &hi, &ai);
            served(g.L, g.E, r->routing, hot_c[to], &hc, &ac);
            served(g.L, g.E, r->routing, hot_own + (size_t)r->wl * nb, &ho, &ao);
            served(g.L, g.E, dec, hot_id, &hid, &aid);
            served(g.L, g.E, dec, hot_c[to], &hcd, &acd);
            served(g.L, g.E, dec, hot_own + (size_t)r->wl * nb, &hod, &aod);
        }
        char a[40], c[40], o[40], est[40], lw[128] = "";
        snprintf(a, sizeof a, "%.1f%% / %.1f%%", 100 * hi / ai, 100 * hid / aid);
        snprintf(c, sizeof c, "%.1f%% / %.1f%%", 100 * hc / ac, 100 * hcd / acd);
        snprintf(o, sizeof o, "%.1f%% / %.1f%%", 100 * ho / ao, 100 * hod / aod);
        snprintf(est, sizeof est, "%.1f%% -> %.1f%%", 100 * pl.hit_identical,
                 100 * pl.hit_complementary);
        for (uint32_t w = 0; w < W; w++)
            snprintf(lw + strlen(lw), sizeof lw - strlen(lw), "%s%u", w ? " / " : "", load[w]);
        char pin[24];
        snprintf(pin, sizeof pin, "%u of %u", P, g.E);
        printf("%-10g %-9s %-17s %-17s %-17s %-16s %s\n", res, pin, a, c, o, est, lw);
        moe_wl_plan_free(&pl);
    }
    for (uint32_t w = 0; w < W; w++)
        free(hot_c[w]);
    free(hot_c), free(hot_id), free(hot_own), free(hp_id), free(slots), free(dec);
    moe_wl_free(&t);
    for (uint32_t i = 0; i < nr; i++)
        free(rq[i].prompt), free(rq[i].sig), free(rq[i].routing);
    for (int w = 0; w < MAX_WL; w++) {
        for (size_t i = 0; i < nv[w]; i++)
            free(vs[w][i]);
        free(vs[w]);
    }
    free(rq), free(profile), free(own), free(c0), free(c1);
    moe_loaded_close(&lm);
    return 0;
}

/* Expert offload benchmark (docs/offload.md): decode and prompt speed at several expert
 * residencies or VRAM budgets, each against the fully resident run in the same process, with the
 * miss rate, the bytes copied over PCIe per token and the limit they set.
 *
 *   build/bench/bench_offload MODEL.gguf [--device cuda:0] [--prompt 512] [--gen 128]
 *                             [--residency 0.75,0.6,0.4,0.25] [--budgets 12.7G,10G]
 *                             [--calib 4] [--h2d-gbps 55] [--no-store] [--calibrated-only]
 *                             [--env VAR=VALUE[;VAR=VALUE...]]...
 *
 * The experts are served as the daemon serves them: from a shared-memory expert store
 * (store/expert_store.h) built once, which each engine registers with CUDA. --no-store keeps the
 * GGUF mapping instead (each engine then makes a pinned copy of the experts it may read from
 * host memory).
 *
 * Routing counts for the calibrated placements come from --calib prompts (their own random
 * tokens and greedy continuations) run fully resident first; every measured run then sees the
 * same held-out prompt, and since offload does not change the output, the same tokens and the
 * same routing. Modes per residency: "uniform" (no profile: every slot is cache), "calibrated"
 * (hot set from the counts, a quarter of the slots cache), "calibrated, no cache" (hot only,
 * misses read from host memory), "calibrated, no prefetch" (no layer-ahead prefetch); at 60%
 * also "uniform, no cache", "uniform, no prefetch", "calibrated, half cache" and "calibrated,
 * no staging" (prompt steps without the staging buffers: MOE_CUDA_STAGE=0). Budgets run
 * calibrated, with and without prefetch, and without staging. --calibrated-only: only
 * "calibrated" and "calibrated, no staging" at each residency and budget. Each --env adds a
 * "calibrated" run at each residency and budget with those environment variables set while its
 * engine starts (the CUDA backend reads its MOE_CUDA_* settings there), e.g. --env
 * MOE_CUDA_PREFETCH_EXTRA=-2: variants measured side by side with the default in one process.
 *
 * "PCIe MB/token" counts the whole held-out run's copies (the prompt's included) over the decoded
 * tokens; "decode PCIe MB/token" the decode steps' alone, and "x minimum" that against the
 * bytes the decode steps had to bring over: each miss's expert once (misses x the layer's expert
 * bytes) and each prefetched expert its layer then chose (a hit thanks to the prefetch). So the
 * ratio is 1 plus the prefetches that were wrong (evicted before their layer chose them, or
 * still waiting) over what was needed; "prefetch right" is the share of decode prefetches their
 * layer chose, and "prefetch recall" the share of what decode needed from outside VRAM (its
 * misses and its chosen prefetches) that the prediction brought ahead; "miss rate" counts the
 * prompt's lookups and the decode's, "decode miss rate" the decode's alone. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/expert_store.h"
#include "store/io.h"
#include "store/units.h"
#include "worker/engine.h"
#include "worker/engine_load.h"

static uint64_t rng;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static void die(struct moe_engine *e, const char *what)
{
    fprintf(stderr, "bench_offload: %s: %s\n", what, e ? moe_engine_errmsg(e) : "");
    exit(1);
}

/* Offload counters, totals and per layer (L of them), at one moment. */
struct snap {
    struct moe_offload_stats s;
    struct moe_offload_layer *pl;
};

static void snap_take(struct moe_engine *e, struct snap *x)
{
    if (moe_engine_offload_stats(e, &x->s, x->pl))
        die(e, "offload stats");
}

/* Bytes copied from host memory between two counter snapshots a and z: fills, direct reads,
 * prefetches and prompt staging. */
static uint64_t copied_bytes(const struct moe_offload_stats *a, const struct moe_offload_stats *z)
{
    return (z->fill_bytes - a->fill_bytes) + (z->direct_bytes - a->direct_bytes) +
           (z->prefetch_bytes - a->prefetch_bytes) + (z->stage_bytes - a->stage_bytes);
}

/* Prompt of n random tokens (from seed) on sequence 0, then g greedy tokens; seconds of each.
 * mid (may be NULL): the counters between the prompt and the first decoded token. */
static void generate(struct moe_engine *e, uint64_t seed, int64_t n, int64_t g, int64_t V,
                     double *t_prompt, double *t_gen, struct snap *mid)
{
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n), *pos = malloc(sizeof(int32_t) * (size_t)n),
            *sq = calloc((size_t)n, sizeof(int32_t));
    uint8_t *want = calloc((size_t)n, 1);
    if (!tok || !pos || !sq || !want)
        exit(1);
    rng = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        tok[i] = (int32_t)(rnd() % V);
        pos[i] = (int32_t)i;
    }
    want[n - 1] = 1;
    moe_engine_seq_clear(e, 0);
    struct moe_sampler_params sp;
    moe_sampler_defaults(&sp);
    sp.temperature = 0.0f;
    if (moe_engine_seq_sampler(e, 0, &sp, tok, (size_t)n))
        die(e, "sampler");
    int32_t cur;
    struct moe_batch b = {.n = (uint32_t)n, .token = tok, .pos = pos, .seq = sq, .logits = want};
    double t0 = moe_now_s();
    if (moe_engine_forward_sample(e, &b, &cur))
        die(e, "prompt");
    double t1 = moe_now_s();
    if (mid) {
        snap_take(e, mid);
        t1 = moe_now_s();
    }
    for (int64_t s = 0; s < g; s++) {
        int32_t p = (int32_t)(n + s), q = 0, nx;
        struct moe_batch d = {.n = 1, .token = &cur, .pos = &p, .seq = &q};
        if (moe_engine_forward_sample(e, &d, &nx))
            die(e, "decode");
        cur = nx >= 0 ? nx : 0;
    }
    double t2 = moe_now_s();
    if (t_prompt)
        *t_prompt = t1 - t0;
    if (t_gen)
        *t_gen = t2 - t1;
    free(tok), free(pos), free(sq), free(want);
}

/* Sets (on) or unsets (off) each VAR=VALUE of a ';'-separated list. */
static void env_apply(const char *list, bool on)
{
    for (const char *s = list; *s;) {
        const size_t k = strcspn(s, ";");
        char kv[256];
        snprintf(kv, sizeof kv, "%.*s", (int)(k < 255 ? k : 255), s);
        char *eq = strchr(kv, '=');
        if (eq && eq > kv) {
            *eq = 0;
            if (on)
                setenv(kv, eq + 1, 1);
            else
                unsetenv(kv);
        }
        s += k + (s[k] == ';');
    }
}

struct result {
    char name[128];
    double pp, tg, miss_rate, pcie_per_tok, prefetched, vram_gib, expert_gib;
    double dec_pcie_per_tok, min_per_tok; /* decode alone: copies and the minimum, bytes */
    double pf_right;                      /* decode: prefetched experts chosen / prefetched */
    double pf_recall;                     /* decode: chosen prefetches / (those + misses) */
    double dec_miss_rate;                 /* decode: misses / lookups */
};

int main(int argc, char **argv)
{
    const char *model = NULL, *device = "cuda:0", *res_list = "0.75,0.6,0.4,0.25",
               *budget_list = "";
    int64_t P = 512, G = 128, calib = 4;
    double h2d = 55.0;
    bool use_store = true, cal_only = false;
    const char *envs[8];
    int n_env = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--device") && v)
            device = v, i++;
        else if (!strcmp(a, "--prompt") && v)
            P = atoll(v), i++;
        else if (!strcmp(a, "--gen") && v)
            G = atoll(v), i++;
        else if (!strcmp(a, "--residency") && v)
            res_list = v, i++;
        else if (!strcmp(a, "--budgets") && v)
            budget_list = v, i++;
        else if (!strcmp(a, "--calib") && v)
            calib = atoll(v), i++;
        else if (!strcmp(a, "--h2d-gbps") && v)
            h2d = atof(v), i++;
        else if (!strcmp(a, "--no-store"))
            use_store = false;
        else if (!strcmp(a, "--calibrated-only"))
            cal_only = true;
        else if (!strcmp(a, "--env") && v && n_env < 8 && strchr(v, '='))
            envs[n_env++] = v, i++;
        else if (a[0] != '-')
            model = a;
        else {
            fprintf(stderr, "bench_offload: unknown argument %s\n", a);
            return 2;
        }
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!model || P < 1 || G < 1) {
        fprintf(stderr, "usage: bench_offload MODEL.gguf [--device D] [--prompt N] [--gen N] "
                        "[--residency 0.75,0.6] [--budgets 12.7G,10G] [--calib N] [--h2d-gbps X] "
                        "[--no-store] [--calibrated-only] [--env VAR=VALUE[;VAR=VALUE]]...\n");
        return 2;
    }
    char err[512];
    struct moe_loaded lm = {0};
    if (moe_loaded_open(&lm, model, false, err, sizeof err)) {
        fprintf(stderr, "bench_offload: %s\n", err);
        return 1;
    }
    struct moe_store *store = NULL, *view = NULL;
    if (use_store) {
        double ts = moe_now_s();
        if (moe_store_create(&store, &lm.model, 0, NULL, NULL, err, sizeof err) ||
            moe_store_open_model(&view, moe_store_fd(store), &lm.model, err, sizeof err)) {
            fprintf(stderr, "bench_offload: expert store: %s\n", err);
            return 1;
        }
        printf("expert store: %.2f GiB in %.1f s\n",
               (double)moe_store_size(store) / (1 << 30), moe_now_s() - ts);
    }
    const struct moe_model *m = &lm.model;
    const int64_t V = m->hp.n_vocab, L = m->hp.n_layer, E = m->hp.n_expert;
    uint64_t *counts = calloc((size_t)(L * E), sizeof *counts);
    struct result res[96];
    struct moe_offload_layer *pl_a = calloc((size_t)L, sizeof *pl_a),
                             *pl_m = calloc((size_t)L, sizeof *pl_m),
                             *pl_z = calloc((size_t)L, sizeof *pl_z);
    if (!counts || !pl_a || !pl_m || !pl_z) {
        free(counts), free(pl_a), free(pl_m), free(pl_z);
        return 1;
    }
    int nres = 0;
    double base_tg = 0;

    /* Configurations: resident first (also the calibration), then residencies x modes, then
     * budgets (calibrated). */
    struct cfg {
        double r;
        uint64_t budget;
        int mode; /* mode_name[] */
        int env;  /* envs[env - 1] set at init; 0: none */
    } cf[96];
    int nc = 0;
    cf[nc++] = (struct cfg){0, 0, 0, 0};
    for (const char *s = res_list; *s && nc < 80 - n_env;) {
        char tmp[32];
        size_t k = strcspn(s, ",");
        snprintf(tmp, sizeof tmp, "%.*s", (int)(k < 31 ? k : 31), s);
        double r;
        if (moe_parse_share(tmp, &r) == 0) {
            static const int modes[] = {0, 1, 2, 4};
            if (cal_only) {
                cf[nc++] = (struct cfg){r, 0, 1, 0};
                cf[nc++] = (struct cfg){r, 0, 7, 0};
            } else {
                for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++)
                    cf[nc++] = (struct cfg){r, 0, modes[i], 0};
            }
            if (r > 0.55 && r < 0.65 && !cal_only) {
                cf[nc++] = (struct cfg){r, 0, 3, 0};
                cf[nc++] = (struct cfg){r, 0, 5, 0};
                cf[nc++] = (struct cfg){r, 0, 6, 0};
                cf[nc++] = (struct cfg){r, 0, 7, 0};
            }
            for (int j = 0; j < n_env; j++)
                cf[nc++] = (struct cfg){r, 0, 1, j + 1};
        }
        s += k + (s[k] == ',');
    }
    for (const char *s = budget_list; *s && nc < 96 - 3 - n_env;) {
        char tmp[32];
        size_t k = strcspn(s, ",");
        snprintf(tmp, sizeof tmp, "%.*s", (int)(k < 31 ? k : 31), s);
        uint64_t bb;
        if (moe_parse_size(tmp, &bb) == 0 && bb) {
            cf[nc++] = (struct cfg){0, bb, 1, 0};
            if (!cal_only)
                cf[nc++] = (struct cfg){0, bb, 4, 0};
            cf[nc++] = (struct cfg){0, bb, 7, 0};
            for (int j = 0; j < n_env; j++)
                cf[nc++] = (struct cfg){0, bb, 1, j + 1};
        }
        s += k + (s[k] == ',');
    }
    static const char *const mode_name[] = {"uniform", "calibrated", "calibrated, no cache",
                                            "uniform, no cache", "calibrated, no prefetch",
                                            "uniform, no prefetch", "calibrated, half cache",
                                            "calibrated, no staging"};
    for (int ci = 0; ci < nc; ci++) {
        struct moe_engine_opts o = {.n_ctx = (uint32_t)(P + (G > 16 ? G : 16) + 8), .n_seq = 1, .n_batch = 512,
                                    .device = device, .expert_residency = cf[ci].r,
                                    .vram_budget = cf[ci].budget, .host_register = use_store};
        if (ci > 0) {
            const int md = cf[ci].mode;
            o.expert_counts = md == 1 || md == 2 || md == 4 || md == 6 || md == 7 ? counts : NULL;
            o.cache_slots = md == 2 || md == 3 ? -1 : 0;
            if (md == 6) /* half of each layer's slots as cache */
                o.cache_slots = (int32_t)(llround(cf[ci].r * (double)E) / 2);
            o.no_prefetch = md == 4 || md == 5;
        }
        struct moe_engine *e = NULL;
        fprintf(stderr, "bench_offload: configuration %d of %d\n", ci + 1, nc);
        double t0 = moe_now_s();
        if (ci > 0 && cf[ci].mode == 7)
            setenv("MOE_CUDA_STAGE", "0", 1); /* read at init */
        if (cf[ci].env)
            env_apply(envs[cf[ci].env - 1], true);
        const int irc = moe_engine_init(&e, m, &o, err, sizeof err);
        if (cf[ci].env)
            env_apply(envs[cf[ci].env - 1], false);
        if (ci > 0 && cf[ci].mode == 7)
            unsetenv("MOE_CUDA_STAGE");
        if (irc) {
            printf("%s: %s\n", mode_name[cf[ci].mode], err);
            continue;
        }
        double t_init = moe_now_s() - t0;
        if (ci == 0)
            for (int64_t c = 0; c < calib; c++)
                generate(e, 1000 + (uint64_t)c, P, G, V, NULL, NULL, NULL);
        if (ci == 0 && moe_engine_routing_counts(e, counts))
            die(e, "routing counts");
        /* Warm-up (records the graphs; warms the cache on a prompt of its own), then the
         * held-out prompt. */
        double tw0 = moe_now_s(), twp, twg;
        generate(e, 7, P, 16, V, &twp, &twg, NULL);
        fprintf(stderr, "bench_offload: init %.1f s, warm-up %.2f s (prompt %.2f s, 16 tokens %.2f s)\n",
                t_init, moe_now_s() - tw0, twp, twg);
        struct snap sa = {.pl = pl_a}, sm = {.pl = pl_m}, sz = {.pl = pl_z};
        snap_take(e, &sa);
        double tp, tg;
        generate(e, 42, P, G, V, &tp, &tg, &sm);
        snap_take(e, &sz);
        const struct moe_offload_stats a = sa.s, z = sz.s, mi = sm.s;
        struct moe_engine_info info;
        moe_engine_info(e, &info);
        struct result *r = &res[nres++];
        if (ci == 0)
            snprintf(r->name, sizeof r->name, "resident");
        else if (cf[ci].budget)
            snprintf(r->name, sizeof r->name, "budget %.1f GiB, %s",
                     (double)cf[ci].budget / (1 << 30), mode_name[cf[ci].mode]);
        else
            snprintf(r->name, sizeof r->name, "%.0f%%, %s", 100 * cf[ci].r,
                     mode_name[cf[ci].mode]);
        if (cf[ci].env) {
            const size_t nl = strlen(r->name);
            snprintf(r->name + nl, sizeof r->name - nl, ", %s", envs[cf[ci].env - 1]);
        }
        /* Lookups and bytes of the held-out run: prompt and decode together for the miss
         * rate; bytes per decoded token counts the whole run's copies over G tokens (an upper
         * bound: the prompt's copies are in it). */
        const double looked = (double)((z.hits - a.hits) + (z.misses - a.misses));
        r->pp = (double)P / tp;
        r->tg = (double)G / tg;
        r->miss_rate = looked > 0 ? (double)(z.misses - a.misses) / looked : 0;
        r->pcie_per_tok = (double)copied_bytes(&a, &z) / (double)G;
        r->prefetched = (double)(z.prefetched - a.prefetched) / (double)G;
        /* Decode alone: its copies per token, and the minimum, each decode miss's expert
         * crossing once (misses x the layer's expert bytes). */
        r->dec_pcie_per_tok = (double)copied_bytes(&mi, &z) / (double)G;
        double min_bytes = 0;
        for (int64_t l = 0; l < L; l++)
            min_bytes += (double)(sz.pl[l].misses - sm.pl[l].misses) *
                         (double)moe_model_expert_bytes(m, (uint32_t)l);
        min_bytes += (double)(z.prefetch_used_bytes - mi.prefetch_used_bytes);
        r->min_per_tok = min_bytes / (double)G;
        const double pf_dec = (double)(z.prefetched - mi.prefetched);
        r->pf_right = pf_dec > 0 ? (double)(z.prefetch_used - mi.prefetch_used) / pf_dec : -1;
        /* Recall: of the decode lookups that found their expert outside VRAM before the layer
         * ran (a miss) or brought in by the prediction (a chosen prefetch), the share the
         * prediction brought. */
        const double pf_used = (double)(z.prefetch_used - mi.prefetch_used);
        const double dmiss = (double)(z.misses - mi.misses);
        r->pf_recall = pf_dec > 0 && pf_used + dmiss > 0 ? pf_used / (pf_used + dmiss) : -1;
        const double dlooked = (double)(z.hits - mi.hits) + dmiss;
        r->dec_miss_rate = dlooked > 0 ? dmiss / dlooked : 0;
        r->vram_gib = (double)info.device_bytes / (1 << 30);
        r->expert_gib = (double)z.expert_vram_bytes / (1 << 30);
        if (ci == 0)
            base_tg = r->tg;
        printf("%-40s init %.1f s  pp%" PRId64 " %7.1f tok/s  decode %6.1f tok/s (%.2fx)  miss "
               "%.1f%%  PCIe %.1f MB/token  prefetched %.1f/token  VRAM %.2f GiB (experts %.2f)\n",
               r->name, t_init, P, r->pp, r->tg, r->tg / base_tg, 100 * r->miss_rate,
               r->pcie_per_tok / 1e6, r->prefetched, r->vram_gib, r->expert_gib);
        if (ci == 0 || ci == 1)
            printf("  %s\n", info.desc);
        fflush(stdout); /* each run's line kept if a time limit ends the benchmark */
        moe_engine_free(e);
    }
    printf("\n| configuration | VRAM GiB | experts GiB | pp%" PRId64 " tok/s | decode tok/s | "
           "vs resident | miss rate | PCIe MB/token | prefetched/token | PCIe limit tok/s | "
           "decode PCIe MB/token | x minimum | prefetch right | prefetch recall | decode miss "
           "rate |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n", P);
    for (int i = 0; i < nres; i++) {
        const struct result *r = &res[i];
        /* The limit: the resident time or a token's copies over the H2D rate, whichever is
         * longer. */
        const double t_res = 1.0 / base_tg, t_pcie = r->pcie_per_tok / (h2d * 1e9);
        const double lim = 1.0 / (t_res > t_pcie ? t_res : t_pcie);
        char xm[16] = "-", pr[16] = "-", rc[16] = "-";
        if (r->min_per_tok > 0)
            snprintf(xm, sizeof xm, "%.2f", r->dec_pcie_per_tok / r->min_per_tok);
        if (r->pf_right >= 0)
            snprintf(pr, sizeof pr, "%.1f%%", 100 * r->pf_right);
        if (r->pf_recall >= 0)
            snprintf(rc, sizeof rc, "%.1f%%", 100 * r->pf_recall);
        printf("| %s | %.2f | %.2f | %.1f | %.1f | %.2f | %.1f%% | %.1f | %.1f | %.0f | %.1f | %s "
               "| %s | %s | %.1f%% |\n",
               r->name, r->vram_gib, r->expert_gib, r->pp, r->tg, r->tg / base_tg,
               100 * r->miss_rate, r->pcie_per_tok / 1e6, r->prefetched, lim,
               r->dec_pcie_per_tok / 1e6, xm, pr, rc, 100 * r->dec_miss_rate);
    }
    free(counts);
    free(pl_a), free(pl_m), free(pl_z);
    moe_store_close(view);
    moe_store_close(store);
    moe_loaded_close(&lm);
    return 0;
}

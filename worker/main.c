/* moed-worker: the compute process.
 *
 * Standalone (tests, debugging, benchmarks; scripts rely on this exact interface):
 *   moed-worker --model M --prompt-file P [-n N] [--temp T] [--seed S] [--top-k K] [--top-p P]
 *               [--min-p P] [--repeat-penalty R] [--threads N] [--ctx N] [--device cpu|cuda:K]
 *               [--dump-logits F] [--json] [--routing-stats]
 * Daemon-spawned: moed-worker --ipc-fd N (worker/ipc.h).
 * moed-worker --list-devices: the devices this binary can compute on, one per line, the device
 * name first ("cpu", "cuda:K": what moed puts in the Hello), then a description. moed's
 * --devices auto plans its workers from it.
 *
 * Exit status: 0 success, 1 runtime failure (missing file, bad model, backend), 2 usage error. */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "store/buf.h"
#include "store/err.h"
#include "store/io.h"
#include "worker/cpu/kernels.h"
#include "store/units.h"
#include "worker/engine.h"
#include "worker/engine_load.h"
#include "worker/ipc.h"
#include "worker/sampler.h"
#ifdef MOE_HAVE_CUDA
#include "worker/cuda/probe.h"
#endif

#define DEFAULT_N_PREDICT 128

struct opts {
    const char *model, *prompt_file, *dump_logits, *device;
    int64_t n_predict;
    struct moe_sampler_params sp;
    bool has_seed;
    int threads;
    int64_t ctx, batch;
    bool json, routing_stats, list_devices, kv_f32;
    int ipc_fd;
    uint64_t vram_budget;
    double expert_residency;
    int32_t cache_slots;
    bool no_prefetch;
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moed-worker --model M --prompt-file P [options]\n"
            "       moed-worker --ipc-fd N            (started by moed)\n"
            "       moed-worker --list-devices        devices this binary computes on\n"
            "options:\n"
            "  -n N                  tokens to generate (default %d; 0: only evaluate the prompt)\n"
            "  --temp T              temperature (default 0: greedy)\n"
            "  --seed S              sampling seed (default: random, printed to stderr)\n"
            "  --top-k K             (default 40; 0 off)   --top-p P   (default 0.95; 1 off)\n"
            "  --min-p P             (default 0.05; 0 off)\n"
            "  --repeat-penalty R    (default 1: off)      --repeat-last-n N (default 64)\n"
            "  --presence-penalty X  --frequency-penalty X (default 0: off)\n"
            "  --threads N           compute threads (default: all cores)\n"
            "  --ctx N               context size (default: prompt + n)\n"
            "  --batch N             most tokens per forward step (default 512)\n"
            "  --kv-type f16|f32     KV cache element type on a GPU (default f16; the CPU keeps f32)\n"
            "  --device cpu|cuda:K   (default cpu)\n"
            "  --vram-budget SIZE    GPU: device memory in all, e.g. 12G or auto (the GPU's minus a\n"
            "                        margin); experts that do not fit\n"
            "                        are read from host memory (the output does not change)\n"
            "  --expert-residency P  GPU: share of each layer's experts in VRAM, e.g. 60%% or 0.6\n"
            "  --cache-slots N|auto|off  GPU: per-layer expert slots used as a cache (default auto)\n"
            "  --no-prefetch         GPU: no layer-ahead prefetch of the next layer's experts\n"
            "  --dump-logits F       write float32 [n_prompt][n_vocab] prompt logits to F\n"
            "  --json                print {\"prompt_tokens\", \"tokens\", \"text\"} on stdout\n"
            "  --routing-stats       print per-layer expert counts to stderr at the end\n",
            DEFAULT_N_PREDICT);
}

static int parse_i64(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "moed-worker: %s: '%s' is not an integer in %" PRId64 "..%" PRId64 "\n",
                opt, s, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_u64(const char *opt, const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    if (*s == '-') {
        fprintf(stderr, "moed-worker: %s: '%s' is not an unsigned integer\n", opt, s);
        return -1;
    }
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end) {
        fprintf(stderr, "moed-worker: %s: '%s' is not an unsigned integer\n", opt, s);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_f(const char *opt, const char *s, double lo, double hi, float *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || isnan(v) || v < lo || v > hi) {
        fprintf(stderr, "moed-worker: %s: '%s' is not a number in %g..%g\n", opt, s, lo, hi);
        return -1;
    }
    *out = (float)v;
    return 0;
}

/* Returns 0, 2 for a usage error, or -1 when --help was printed (exit 0). */
static int parse_args(int argc, char **argv, struct opts *o)
{
    memset(o, 0, sizeof *o);
    moe_sampler_defaults(&o->sp);
    o->sp.temperature = 0.0f;
    o->n_predict = DEFAULT_N_PREDICT;
    o->device = "cpu";
    o->ipc_fd = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return -1;
        }
        if (!strcmp(a, "--json")) {
            o->json = true;
            continue;
        }
        if (!strcmp(a, "--routing-stats")) {
            o->routing_stats = true;
            continue;
        }
        if (!strcmp(a, "--list-devices")) {
            o->list_devices = true;
            continue;
        }
        if (!strcmp(a, "--no-prefetch")) {
            o->no_prefetch = true;
            continue;
        }
        static const char *const with_value[] = {
            "--model", "-m", "--prompt-file", "-f", "-n", "--n-predict", "--temp", "--seed",
            "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n",
            "--presence-penalty", "--frequency-penalty", "--threads", "-t", "--ctx", "-c",
            "--batch", "-b", "--device", "--dump-logits", "--ipc-fd", "--kv-type",
            "--vram-budget", "--expert-residency", "--cache-slots",
        };
        bool known = false;
        for (size_t k = 0; k < sizeof with_value / sizeof *with_value; k++)
            known |= !strcmp(a, with_value[k]);
        if (!known) {
            fprintf(stderr, "moed-worker: unknown option '%s' (see --help)\n", a);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "moed-worker: option '%s' needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        int64_t n;
        int bad = 0;
        if (!strcmp(a, "--model") || !strcmp(a, "-m"))
            o->model = v;
        else if (!strcmp(a, "--prompt-file") || !strcmp(a, "-f"))
            o->prompt_file = v;
        else if (!strcmp(a, "--dump-logits"))
            o->dump_logits = v;
        else if (!strcmp(a, "--device"))
            o->device = v;
        else if (!strcmp(a, "--kv-type")) {
            if (strcmp(v, "f16") && strcmp(v, "f32")) {
                fprintf(stderr, "moed-worker: --kv-type: '%s' is not f16 or f32\n", v);
                return 2;
            }
            o->kv_f32 = !strcmp(v, "f32");
        }
        else if (!strcmp(a, "--vram-budget")) {
            if (!strcmp(v, "auto")) {
                o->vram_budget = MOE_VRAM_AUTO;
            } else if (moe_parse_size(v, &o->vram_budget) || o->vram_budget == 0) {
                fprintf(stderr, "moed-worker: --vram-budget: '%s' is not a size such as 12G, or "
                                "auto\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--expert-residency")) {
            if (moe_parse_share(v, &o->expert_residency)) {
                fprintf(stderr, "moed-worker: --expert-residency: '%s' is not a share in (0, 1] "
                                "such as 60%% or 0.6\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--cache-slots")) {
            if (!strcmp(v, "auto"))
                o->cache_slots = 0;
            else if (!strcmp(v, "off"))
                o->cache_slots = -1;
            else if ((bad = parse_i64(a, v, 1, 1 << 20, &n)) == 0)
                o->cache_slots = (int32_t)n;
        }
        else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict"))
            bad = parse_i64(a, v, 0, INT32_MAX, &o->n_predict);
        else if (!strcmp(a, "--temp"))
            bad = parse_f(a, v, 0.0, 1e6, &o->sp.temperature);
        else if (!strcmp(a, "--seed")) {
            bad = parse_u64(a, v, &o->sp.seed);
            o->has_seed = true;
        } else if (!strcmp(a, "--top-k")) {
            bad = parse_i64(a, v, 0, INT32_MAX, &n);
            o->sp.top_k = (int32_t)n;
        } else if (!strcmp(a, "--top-p"))
            bad = parse_f(a, v, 1e-9, 1.0, &o->sp.top_p);
        else if (!strcmp(a, "--min-p"))
            bad = parse_f(a, v, 0.0, 1.0, &o->sp.min_p);
        else if (!strcmp(a, "--repeat-penalty"))
            bad = parse_f(a, v, 1e-6, 1e6, &o->sp.repeat_penalty);
        else if (!strcmp(a, "--repeat-last-n")) {
            bad = parse_i64(a, v, -1, INT32_MAX, &n);
            o->sp.penalty_last_n = (int32_t)n;
        } else if (!strcmp(a, "--presence-penalty"))
            bad = parse_f(a, v, -1e6, 1e6, &o->sp.presence_penalty);
        else if (!strcmp(a, "--frequency-penalty"))
            bad = parse_f(a, v, -1e6, 1e6, &o->sp.frequency_penalty);
        else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            bad = parse_i64(a, v, 1, 1024, &n);
            o->threads = (int)n;
        } else if (!strcmp(a, "--ctx") || !strcmp(a, "-c"))
            bad = parse_i64(a, v, 1, 1 << 24, &o->ctx);
        else if (!strcmp(a, "--batch") || !strcmp(a, "-b"))
            bad = parse_i64(a, v, 1, 65536, &o->batch);
        else if (!strcmp(a, "--ipc-fd")) {
            bad = parse_i64(a, v, 0, INT32_MAX, &n);
            o->ipc_fd = (int)n;
        }
        if (bad)
            return 2;
    }
    if (o->ipc_fd >= 0 || o->list_devices)
        return 0;
    if (!o->model || !o->prompt_file) {
        fprintf(stderr, "moed-worker: --model and --prompt-file are required (see --help)\n");
        return 2;
    }
    if (!strcmp(o->device, "cpu"))
        return 0;
    if (!strncmp(o->device, "cuda", 4) && (o->device[4] == 0 || o->device[4] == ':'))
        return 0; /* checked after parsing so the message names the real reason */
    fprintf(stderr, "moed-worker: --device: '%s' is not cpu or cuda:K\n", o->device);
    return 2;
}

/* The generated text for the --json summary (a store/buf.h buffer); an allocation failure only
 * shortens it. */
struct sbuf {
    char *p;
    size_t n, cap;
};

static void print_routing_stats(const struct moe_model *m, const uint64_t *counts)
{
    uint32_t L = m->hp.n_layer, NE = m->hp.n_expert;
    uint64_t *sorted = malloc(sizeof *sorted * NE);
    if (!sorted)
        return;
    fprintf(stderr, "routing stats: per layer, expert counts (expert 0..%u), then the share of "
                    "routings taken by the most used quarter of experts\n", NE - 1);
    double share_sum = 0.0;
    for (uint32_t l = 0; l < L; l++) {
        const uint64_t *c = counts + (size_t)l * NE;
        uint64_t total = 0;
        fprintf(stderr, "layer %3u:", l);
        for (uint32_t x = 0; x < NE; x++) {
            fprintf(stderr, " %" PRIu64, c[x]);
            total += c[x];
            sorted[x] = c[x];
        }
        /* Partial selection sort of the top quarter is enough. */
        uint32_t q = (NE + 3) / 4;
        uint64_t top = 0;
        for (uint32_t i = 0; i < q; i++) {
            uint32_t best = i;
            for (uint32_t x = i + 1; x < NE; x++)
                if (sorted[x] > sorted[best])
                    best = x;
            uint64_t t = sorted[i];
            sorted[i] = sorted[best];
            sorted[best] = t;
            top += sorted[i];
        }
        double share = total ? (double)top / (double)total : 0.0;
        share_sum += share;
        fprintf(stderr, " | top %u/%u experts: %.1f%%\n", q, NE, 100.0 * share);
    }
    fprintf(stderr, "routing stats: mean top-quarter share %.1f%% over %u layers\n",
            L ? 100.0 * share_sum / L : 0.0, L);
    free(sorted);
}

static void json_put_ids(json_t *obj, const char *key, const int32_t *ids, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(a, json_integer(ids[i]));
    json_object_set_new(obj, key, a);
}

static int run_standalone(const struct opts *o)
{
    int status = 1, rc;
    char err[512];
    struct moe_loaded lm = {0};
    struct moe_engine *eng = NULL;
    struct moe_sampler *smp = NULL;
    char *text = NULL, *piece = NULL;
    int32_t *prompt = NULL, *gen = NULL;
    float *logits = NULL;
    FILE *dump = NULL;
    struct sbuf out = {0};
    size_t n_prompt = 0, n_gen = 0;
    struct opts oo = *o;

    size_t text_len = 0;
    int rrc = moe_read_file(o->prompt_file, &text, &text_len);
    if (rrc) {
        fprintf(stderr, "moed-worker: cannot read prompt file %s: %s\n", o->prompt_file,
                strerror(-rrc));
        goto done;
    }
    if ((rc = moe_loaded_open(&lm, o->model, true, err, sizeof err))) {
        fprintf(stderr, "moed-worker: %s\n", err);
        goto done;
    }
    const struct moe_model *m = &lm.model;
    uint32_t V = m->hp.n_vocab;
    if (moe_tok_n_vocab(lm.tok) > V) {
        fprintf(stderr, "moed-worker: %s: the vocabulary has %u tokens but the model only %u "
                        "logits\n", o->model, moe_tok_n_vocab(lm.tok), V);
        goto done;
    }
    fprintf(stderr, "moed-worker: loaded %s in %.2f s (%s, %u layers, %u experts, top-%u, "
                    "n_embd %u, vocab %u)\n", o->model, lm.load_s, m->arch_name, m->hp.n_layer,
            m->hp.n_expert, m->hp.n_expert_used, m->hp.n_embd, V);

    size_t n_tok = 0;
    rc = moe_tok_encode(lm.tok, text, text_len, true, &prompt, &n_tok);
    if (rc) {
        fprintf(stderr, "moed-worker: tokenizing %s: %s\n", o->prompt_file, moe_strerror(rc));
        goto done;
    }
    n_prompt = n_tok;
    if (n_prompt == 0) {
        fprintf(stderr, "moed-worker: %s: the prompt is empty (no tokens)\n", o->prompt_file);
        goto done;
    }
    if (oo.ctx == 0) {
        /* Room for the whole generation, but no more than the model was trained for (unless the
         * prompt alone needs more): generation stops cleanly when the context is full. */
        int64_t cap = m->hp.n_ctx_train ? (int64_t)m->hp.n_ctx_train : (1 << 24);
        if (cap < (int64_t)n_prompt)
            cap = (int64_t)n_prompt;
        oo.ctx = (int64_t)n_prompt + oo.n_predict;
        if (oo.ctx > cap)
            oo.ctx = cap;
    }
    if ((int64_t)n_prompt > oo.ctx) {
        fprintf(stderr, "moed-worker: the prompt has %zu tokens, more than the context (%" PRId64
                        ")\n", n_prompt, oo.ctx);
        goto done;
    }
    if (m->hp.n_ctx_train && oo.ctx > m->hp.n_ctx_train)
        fprintf(stderr, "moed-worker: warning: context %" PRId64 " exceeds the model's training "
                        "context %u\n", oo.ctx, m->hp.n_ctx_train);

    struct moe_engine_opts eo = {.n_ctx = (uint32_t)oo.ctx, .n_seq = 1,
                                 .n_batch = (uint32_t)(oo.batch ? oo.batch : 512),
                                 .n_threads = oo.threads, .device = o->device,
                                 .kv_f32 = o->kv_f32, .vram_budget = o->vram_budget,
                                 .expert_residency = o->expert_residency,
                                 .cache_slots = o->cache_slots, .no_prefetch = o->no_prefetch};
    if ((rc = moe_engine_init(&eng, m, &eo, err, sizeof err))) {
        fprintf(stderr, "moed-worker: %s\n", err);
        goto done;
    }
    {
        struct moe_engine_info info;
        moe_engine_info(eng, &info);
        fprintf(stderr, "moed-worker: computing on %s (%s)\n", info.device, info.desc);
    }
    uint32_t nb = moe_engine_get_opts(eng)->n_batch;
    if (!oo.has_seed) {
        if (getrandom(&oo.sp.seed, sizeof oo.sp.seed, 0) != sizeof oo.sp.seed)
            oo.sp.seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
        if (oo.sp.temperature > 0.0f)
            fprintf(stderr, "moed-worker: seed %" PRIu64 "\n", oo.sp.seed);
    }
    if ((rc = moe_sampler_init(&smp, &oo.sp, V, err, sizeof err))) {
        fprintf(stderr, "moed-worker: %s\n", err);
        goto done;
    }

    if (o->dump_logits && !(dump = fopen(o->dump_logits, "wb"))) {
        fprintf(stderr, "moed-worker: cannot create %s: %s\n", o->dump_logits, strerror(errno));
        goto done;
    }
    /* Logits for a whole chunk when dumping, else only for the prompt's last token. */
    size_t rows = dump ? nb : 1;
    logits = malloc(sizeof(float) * rows * V);
    int32_t *pos = malloc(sizeof(int32_t) * nb), *seq = calloc(nb, sizeof(int32_t));
    uint8_t *want = calloc(nb, 1);
    if (!logits || !pos || !seq || !want) {
        free(pos), free(seq), free(want);
        fprintf(stderr, "moed-worker: out of memory\n");
        goto done;
    }

    /* Without a logits dump the engine samples (on the GPU for --device cuda), so each step
     * returns one token id; the sampler's penalties see the prompt either way. */
    const bool dev_sample = !dump;
    int32_t next = -1;
    if (dev_sample && moe_engine_seq_sampler(eng, 0, &oo.sp, prompt, n_prompt)) {
        fprintf(stderr, "moed-worker: %s\n", moe_engine_errmsg(eng));
        free(pos), free(seq), free(want);
        goto done;
    }
    double t0 = moe_now_s();
    for (size_t off = 0; off < n_prompt; off += nb) {
        uint32_t n = (uint32_t)(n_prompt - off < nb ? n_prompt - off : nb);
        bool last_chunk = off + n == n_prompt;
        for (uint32_t i = 0; i < n; i++) {
            pos[i] = (int32_t)(off + i);
            want[i] = dump || off + i + 1 == n_prompt;
        }
        struct moe_batch b = {.n = n, .token = prompt + off, .pos = pos, .seq = seq, .logits = want};
        if (dev_sample)
            rc = last_chunk ? moe_engine_forward_sample(eng, &b, &next)
                            : moe_engine_forward(eng, &b, NULL);
        else
            rc = moe_engine_forward(eng, &b, logits);
        if (rc) {
            fprintf(stderr, "moed-worker: forward: %s\n", moe_engine_errmsg(eng));
            free(pos), free(seq), free(want);
            goto done;
        }
        if (dump && fwrite(logits, sizeof(float) * V, n, dump) != n) {
            fprintf(stderr, "moed-worker: writing %s: %s\n", o->dump_logits, strerror(errno));
            free(pos), free(seq), free(want);
            goto done;
        }
    }
    double t_prompt = moe_now_s() - t0;
    free(pos), free(seq), free(want);
    if (dump) {
        int bad = fclose(dump) != 0;
        dump = NULL;
        if (bad) {
            fprintf(stderr, "moed-worker: writing %s: %s\n", o->dump_logits, strerror(errno));
            goto done;
        }
    }
    fprintf(stderr, "moed-worker: prompt: %zu tokens in %.3f s (%.1f tok/s, %d threads)\n",
            n_prompt, t_prompt, t_prompt > 0 ? (double)n_prompt / t_prompt : 0.0,
            moe_engine_get_opts(eng)->n_threads);

    /* The last prompt token's logits are the last row written. */
    const float *last = o->dump_logits ? logits + (size_t)((n_prompt - 1) % nb) * V : logits;
    if (!dev_sample)
        for (size_t i = 0; i < n_prompt; i++)
            moe_sampler_accept(smp, prompt[i]);
    /* At most one token per free position, plus the one sampled from the last position. */
    int64_t max_gen = (int64_t)moe_engine_get_opts(eng)->n_ctx - (int64_t)n_prompt + 1;
    if (max_gen > oo.n_predict)
        max_gen = oo.n_predict;
    gen = malloc(sizeof *gen * (size_t)(max_gen > 0 ? max_gen : 1));
    if (!gen) {
        fprintf(stderr, "moed-worker: out of memory\n");
        goto done;
    }
    struct moe_detok dt;
    moe_detok_init(&dt);
    /* Enough for any token plus held bytes, even if every byte becomes U+FFFD (tokenizer.h). */
    size_t piece_cap = 3 * (moe_tok_max_piece(lm.tok) + 4) + 1;
    piece = malloc(piece_cap);
    if (!piece) {
        fprintf(stderr, "moed-worker: out of memory\n");
        goto done;
    }
    bool stream = !o->json;
    double t1 = moe_now_s();
    const char *stop_reason = "length";
    int64_t n_ctx = moe_engine_get_opts(eng)->n_ctx;
    /* With the engine sampling, step j (which reads generated token j at position n_prompt + j
     * - 1 and draws token j + 1) is queued before token j is back (moe_engine_submit_sample,
     * token j given as MOE_ENGINE_TOKEN_NEXT from j = 2 on), so the host's turn overlaps the
     * device's work; a step whose token is not wanted (after an end of generation) is collected
     * and dropped at the end. Reaching token j means step j - 1 was queued: the loop ends
     * wherever its condition below fails. */
    while ((int64_t)n_gen < oo.n_predict) {
        const int64_t j = (int64_t)n_gen + 1;
        int32_t tok = next;
        if (!dev_sample) {
            tok = moe_sampler_sample(smp, last);
        } else if (j > 1) {
            int32_t nt = MOE_ENGINE_TOKEN_NEXT, p = (int32_t)((int64_t)n_prompt + j - 1), s0 = 0;
            struct moe_batch b = {.n = 1, .token = &nt, .pos = &p, .seq = &s0};
            if ((j < oo.n_predict && (int64_t)n_prompt + j - 1 < n_ctx &&
                 (rc = moe_engine_submit_sample(eng, &b))) ||
                (rc = moe_engine_collect(eng, &tok, NULL))) {
                fprintf(stderr, "moed-worker: forward: %s\n", moe_engine_errmsg(eng));
                goto done;
            }
        }
        if (tok < 0) {
            fprintf(stderr, "moed-worker: every logit is NaN or -inf; stopping\n");
            stop_reason = "error";
            break;
        }
        gen[n_gen++] = tok;
        if (!dev_sample)
            moe_sampler_accept(smp, tok);
        if (moe_tok_is_eog(lm.tok, tok)) {
            stop_reason = "eog";
            break;
        }
        size_t k = moe_detok_push(&dt, lm.tok, tok, piece, piece_cap);
        (void)moe_buf_append(&out.p, &out.n, &out.cap, piece, k);
        if (stream) {
            fwrite(piece, 1, k, stdout);
            fflush(stdout);
        }
        if ((int64_t)n_gen >= oo.n_predict)
            break;
        int32_t p = (int32_t)(n_prompt + n_gen - 1);
        if (p >= n_ctx) {
            fprintf(stderr, "\nmoed-worker: context full (%" PRId64 " positions)\n", n_ctx);
            stop_reason = "context";
            break;
        }
        if (dev_sample && j > 1)
            continue; /* step j was queued before its token came back */
        int32_t s0 = 0;
        struct moe_batch b = {.n = 1, .token = &tok, .pos = &p, .seq = &s0, .logits = NULL};
        rc = dev_sample ? moe_engine_submit_sample(eng, &b) : moe_engine_forward(eng, &b, logits);
        if (rc) {
            fprintf(stderr, "moed-worker: forward: %s\n", moe_engine_errmsg(eng));
            goto done;
        }
        last = logits;
    }
    size_t fk = moe_detok_flush(&dt, piece, piece_cap);
    (void)moe_buf_append(&out.p, &out.n, &out.cap, piece, fk);
    double t_gen = moe_now_s() - t1;
    while (moe_engine_queued(eng) > 0)
        if ((rc = moe_engine_collect(eng, NULL, NULL))) {
            fprintf(stderr, "moed-worker: forward: %s\n", moe_engine_errmsg(eng));
            goto done;
        }
    if (stream) {
        fwrite(piece, 1, fk, stdout);
        if (n_gen)
            fputc('\n', stdout);
        fflush(stdout);
    }
    fprintf(stderr, "moed-worker: generated %zu tokens in %.3f s (%.1f tok/s), stop: %s\n", n_gen,
            t_gen, n_gen > 1 && t_gen > 0 ? (double)(n_gen - 1) / t_gen : 0.0, stop_reason);

    if (o->json) {
        json_t *j = json_object();
        json_put_ids(j, "prompt_tokens", prompt, n_prompt);
        json_put_ids(j, "tokens", gen, n_gen);
        json_t *s = json_stringn(out.p ? out.p : "", out.n);
        json_object_set_new(j, "text", s ? s : json_string(""));
        char *dumped = json_dumps(j, JSON_COMPACT | JSON_ENSURE_ASCII);
        json_decref(j);
        if (!dumped) {
            fprintf(stderr, "moed-worker: cannot encode the JSON output\n");
            goto done;
        }
        printf("%s\n", dumped);
        free(dumped);
        fflush(stdout);
    }
    {
        struct moe_offload_stats os;
        if (moe_engine_offload_stats(eng, &os, NULL) == 0 && os.active) {
            const uint64_t looked = os.hits + os.misses;
            char vram[32], all[32], fill[32], direct[32], pf[32], stg[32];
            fprintf(stderr,
                    "moed-worker: experts %s of %s in VRAM; %" PRIu64 " hits, %" PRIu64
                    " misses (%.1f%%), %s copied to VRAM, %" PRIu64 " read from host (%s), %" PRIu64
                    " prefetched (%s; %" PRIu64 " then chosen, %" PRIu64 " evicted unchosen), %" PRIu64
                    " staged for prompts (%s, %" PRIu64 " misses read there)\n",
                    moe_fmt_size(vram, sizeof vram, os.expert_vram_bytes),
                    moe_fmt_size(all, sizeof all, os.expert_bytes), os.hits, os.misses,
                    looked ? 100.0 * (double)os.misses / (double)looked : 0.0,
                    moe_fmt_size(fill, sizeof fill, os.fill_bytes), os.direct,
                    moe_fmt_size(direct, sizeof direct, os.direct_bytes), os.prefetched,
                    moe_fmt_size(pf, sizeof pf, os.prefetch_bytes), os.prefetch_used,
                    os.prefetch_wasted, os.staged,
                    moe_fmt_size(stg, sizeof stg, os.stage_bytes), os.stage_reads);
        }
    }
    if (o->routing_stats) {
        uint64_t *counts = calloc((size_t)m->hp.n_layer * m->hp.n_expert, sizeof *counts);
        if (counts && moe_engine_routing_counts(eng, counts) == 0)
            print_routing_stats(m, counts);
        free(counts);
    }
    status = 0;

done:
    if (dump)
        fclose(dump);
    free(out.p);
    free(piece);
    free(logits);
    free(gen);
    free(prompt);
    free(text);
    moe_sampler_free(smp);
    moe_engine_free(eng);
    moe_loaded_close(&lm);
    return status;
}

/* "Intel(R) Xeon(R) ..., 16 cores, AVX2+FMA+F16C kernels". */
static void cpu_description(char *out, size_t n)
{
    char model[160] = "", line[256];
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && !model[0] && fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) != 0 || !colon)
            continue;
        char *v = colon + 1;
        v += strspn(v, " \t");
        v[strcspn(v, "\n")] = 0;
        snprintf(model, sizeof model, "%s, ", v);
    }
    if (f)
        fclose(f);
    snprintf(out, n, "%s%ld cores, %s kernels", model, sysconf(_SC_NPROCESSORS_ONLN),
             moe_kernels_simd() ? "AVX2+FMA+F16C" : "portable");
}

/* --list-devices. A device that cannot be used is explained on stderr, not listed. */
static int list_devices(void)
{
    char desc[512];
    cpu_description(desc, sizeof desc);
    printf("cpu %s\n", desc);
#ifdef MOE_HAVE_CUDA
    int n = moe_cuda_device_count(desc, sizeof desc);
    if (n == 0 && desc[0])
        fprintf(stderr, "moed-worker: no CUDA device: %s\n", desc);
    for (int i = 0; i < n; i++) {
        if (moe_cuda_probe(i, desc, sizeof desc))
            printf("cuda:%d %s\n", i, desc);
        else
            fprintf(stderr, "moed-worker: cuda:%d cannot be used: %s\n", i, desc);
    }
#endif
    return fflush(stdout) == 0 && !ferror(stdout) ? 0 : 1;
}

int main(int argc, char **argv)
{
    struct opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc < 0)
        return 0;
    if (rc)
        return rc;
    if (o.list_devices)
        return list_devices();
    if (o.ipc_fd >= 0)
        return moe_worker_ipc_main(o.ipc_fd, argv[0]);
    return run_standalone(&o);
}

/* moectl mkmodel: writes a deterministic synthetic qwen3moe GGUF with random weights.
 *
 * The file is standard GGUF (llama.cpp loads it) with a real vocabulary and weights scaled so
 * that activations stay O(1) through every layer:
 *   token_embd ~ N(0, 1) with channel 0 fixed at MK_BIAS_CHANNEL_VALUE;
 *   attn_q/k/v, ffn_gate/up ~ N(0, 1/n_embd); attn_output, ffn_down ~ N(0, s^2/fan_in) with
 *   s = min(0.5, 1/sqrt(2 n_layer)), their row 0 zero so that channel 0 survives every layer;
 *   norms ~ 1 + N(0, 0.01); output ~ N(0, 9/n_embd), giving logits of a few units.
 * Routing is skewed like a trained model's: router row e holds -skew * ln(1 + rank_e) / c in
 * channel 0 (c = MK_BIAS_CHANNEL_VALUE), where rank_e is expert e's popularity rank in a
 * per-layer random order, so router logits carry a Zipf-like prior of exponent ~skew.
 *
 * Data is generated block by block from counter-based random streams by all threads and
 * written with large pwrites at the tensors' offsets, so the bytes do not depend on --threads. */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli/mkmodel.h"
#include "cli/moectl.h"
#include "store/err.h"
#include "store/ggml_type.h"
#include "store/gguf_write.h"
#include "store/io.h"

#define DEFAULT_VOCAB "tests/golden/tokenizer/qwen3-vocab.gguf"
#define CHUNK_BYTES (4u << 20)

struct preset {
    const char *name;
    uint32_t n_layer, n_embd, n_head, n_head_kv, head_dim;
    uint32_t n_expert, n_expert_used, expert_ff, n_ff, n_ctx;
    float rope_base, rms_eps;
    uint32_t vocab_regular; /* tokens kept from the vocabulary; 0 = all of it */
    float skew;             /* default --router-skew: the top quarter of experts takes ~70% */
};

static const struct preset presets[] = {
    {"tiny", 3, 256, 4, 2, 64, 16, 4, 128, 512, 4096, 1e6f, 1e-6f, 4096, 1.5f},
    {"qwen3-30b-a3b", 48, 2048, 32, 4, 128, 128, 8, 768, 6144, 40960, 1e6f, 1e-6f, 0, 0.6f},
    {"qwen3-235b-a22b", 94, 4096, 64, 4, 128, 128, 8, 1536, 12288, 40960, 1e6f, 1e-6f, 0, 0.6f},
};

enum quant { QUANT_F16, QUANT_Q8_0, QUANT_Q4_K_M };
static const char *const quant_names[] = {"f16", "q8_0", "q4_k_m"};
static const uint32_t quant_file_type[] = {1, 7, 15}; /* llama_ftype MOSTLY_F16/Q8_0/Q4_K_M */

struct opts {
    const struct preset *p;
    enum quant quant;
    uint64_t seed;
    float skew;
    const char *vocab;
    int threads;
    const char *out;
    bool quiet;
    bool no_data; /* metadata and file size only (a sparse file), to check layouts cheaply */
};

struct chunk {
    uint32_t tensor;
    uint64_t b0, n;
};

struct job {
    struct gguf_writer *w;
    struct mk_tensor *t;
    struct chunk *chunks;
    uint64_t n_chunks;
    atomic_uint_fast64_t next;
    atomic_uint_fast64_t bytes_done;
    atomic_int failed;
    pthread_mutex_t err_lock;
    int rc;          /* the first failure's code, under err_lock */
    char err[256];
};

/* Records the first failure of any worker; the others stop at their next chunk. */
static void job_fail(struct job *j, int rc, const char *msg)
{
    pthread_mutex_lock(&j->err_lock);
    if (!atomic_exchange(&j->failed, 1)) {
        j->rc = rc;
        snprintf(j->err, sizeof j->err, "%s", msg);
    }
    pthread_mutex_unlock(&j->err_lock);
}

/* llama.cpp's use_more_bits: the first and last eighth of the layers and every third between. */
static bool use_more_bits(int i, int n)
{
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

/* The llama-quantize fallback for rows a k-quant cannot hold. */
static uint32_t fit_type(uint32_t type, int64_t ne0)
{
    if (ne0 % moe_type_get(type)->blck == 0)
        return type;
    if (type == MOE_TYPE_Q4_K)
        type = MOE_TYPE_Q5_0;
    else if (type == MOE_TYPE_Q6_K)
        type = MOE_TYPE_Q8_0;
    return ne0 % moe_type_get(type)->blck == 0 ? type : MOE_TYPE_F16;
}

enum role { R_EMBD, R_OUTPUT, R_ATTN_QKO, R_ATTN_V, R_FFN_GATE_UP, R_FFN_DOWN };

static uint32_t weight_type(enum quant q, enum role r, int layer, int n_layer, int64_t ne0)
{
    uint32_t t;
    switch (q) {
    case QUANT_F16: return MOE_TYPE_F16;
    case QUANT_Q8_0: t = MOE_TYPE_Q8_0; break;
    default:
        if (r == R_OUTPUT)
            t = MOE_TYPE_Q6_K;
        else if ((r == R_ATTN_V || r == R_FFN_DOWN) && use_more_bits(layer, n_layer))
            t = MOE_TYPE_Q6_K;
        else
            t = MOE_TYPE_Q4_K;
        break;
    }
    return fit_type(t, ne0);
}

static uint64_t str_hash(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* Declares one tensor in the writer and the plan. */
static int plan_tensor(struct gguf_writer *w, struct mk_tensor *plan, uint32_t *n_plan,
                       const struct opts *o, const char *name, uint32_t n_dims, int64_t ne0,
                       int64_t ne1, int64_t ne2, uint32_t type, enum mk_kind kind, float sigma,
                       char *err, size_t errlen)
{
    struct mk_tensor *t = &plan[*n_plan];
    memset(t, 0, sizeof *t);
    int64_t ne[3] = {ne0, ne1, ne2};
    int rc = gguf_writer_add_tensor(w, name, n_dims, ne, type, &t->idx, err, errlen);
    if (rc)
        return rc;
    t->type = type;
    t->ne[0] = ne0;
    t->ne[1] = n_dims > 1 ? ne1 : 1;
    t->ne[2] = n_dims > 2 ? ne2 : 1;
    t->kind = kind;
    t->sigma = sigma;
    t->key = mk_mix64(o->seed * 0x9e3779b97f4a7c15ull ^ str_hash(name));
    if (mk_tensor_prepare(t))
        return moe_fail(err, errlen, MOE_EUNSUPPORTED, "%s: cannot generate type %s", name,
                        moe_type_get(type)->name);
    (*n_plan)++;
    return 0;
}

/* Per-layer router bias: -skew * ln(1 + rank) / c, ranks a seeded permutation of the experts. */
static void router_bias(const struct opts *o, uint32_t layer, float *bias)
{
    uint32_t n = o->p->n_expert;
    uint32_t perm[1024];
    MOE_ASSERT(n >= 1 && n <= 1024);
    for (uint32_t i = 0; i < n; i++)
        perm[i] = i;
    uint64_t s = mk_mix64(o->seed ^ (0x5157454e524f5554ull + layer));
    for (uint32_t i = n - 1; i > 0; i--) {
        s = mk_mix64(s + 0x9e3779b97f4a7c15ull);
        uint32_t j = (uint32_t)(s % (i + 1));
        uint32_t x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
    /* perm[rank] = expert */
    for (uint32_t r = 0; r < n; r++)
        bias[perm[r]] = -o->skew * logf(1.0f + (float)r) / MK_BIAS_CHANNEL_VALUE;
}

#define TRY(x)            \
    do {                  \
        if ((rc = (x)))   \
            goto fail;    \
    } while (0)

static int add_metadata(struct gguf_writer *w, const struct opts *o, uint32_t *n_vocab,
                        char *err, size_t errlen)
{
    const struct preset *p = o->p;
    char name[96];
    int rc;
    snprintf(name, sizeof name, "moed-synthetic-%s", p->name);
    TRY(gguf_writer_add_str(w, "general.architecture", "qwen3moe", 8, err, errlen));
    TRY(gguf_writer_add_str(w, "general.name", name, strlen(name), err, errlen));
    TRY(gguf_writer_add_u32(w, "qwen3moe.context_length", p->n_ctx, err, errlen));
    TRY(gguf_writer_add_u32(w, "qwen3moe.embedding_length", p->n_embd, err, errlen));
    TRY(gguf_writer_add_u32(w, "qwen3moe.block_count", p->n_layer, err, errlen));
    TRY(gguf_writer_add_u32(w, "qwen3moe.feed_forward_length", p->n_ff, err, errlen));
    TRY(gguf_writer_add_u32(w, "qwen3moe.attention.head_count", p->n_head, err, errlen));
    TRY(gguf_writer_add_u32(w, "qwen3moe.attention.head_count_kv", p->n_head_kv, err, errlen));
    TRY(gguf_writer_add_u32(w, "qwen3moe.attention.key_length", p->head_dim, err, errlen));
    TRY(gguf_writer_add_u32(w, "qwen3moe.attention.value_length", p->head_dim, err, errlen));
    TRY(gguf_writer_add_f32(w, "qwen3moe.rope.freq_base", p->rope_base, err, errlen));
    TRY(gguf_writer_add_f32(w, "qwen3moe.attention.layer_norm_rms_epsilon", p->rms_eps, err,
                            errlen));
    TRY(gguf_writer_add_u32(w, "qwen3moe.expert_count", p->n_expert, err, errlen));
    TRY(gguf_writer_add_u32(w, "qwen3moe.expert_used_count", p->n_expert_used, err, errlen));
    TRY(gguf_writer_add_u32(w, "qwen3moe.expert_feed_forward_length", p->expert_ff, err,
                            errlen));
    TRY(mk_vocab_add(w, o->vocab, p->vocab_regular, n_vocab, err, errlen));
    TRY(gguf_writer_add_u32(w, "general.quantization_version", 2, err, errlen));
    TRY(gguf_writer_add_u32(w, "general.file_type", quant_file_type[o->quant], err, errlen));
    TRY(gguf_writer_set_alignment(w, 32, err, errlen));
    /* How the file was made, so that it can be made again. */
    TRY(gguf_writer_add_str(w, "moed.synthetic.preset", p->name, strlen(p->name), err, errlen));
    TRY(gguf_writer_add_u64(w, "moed.synthetic.seed", o->seed, err, errlen));
    TRY(gguf_writer_add_f32(w, "moed.synthetic.router_skew", o->skew, err, errlen));
    return 0;
fail:
    return rc;
}

/* Declares every tensor; plan must hold 3 + 12 * n_layer entries, biases n_layer * n_expert. */
static int add_tensors(struct gguf_writer *w, const struct opts *o, uint32_t n_vocab,
                       struct mk_tensor *plan, uint32_t *n_plan, float *biases,
                       char *err, size_t errlen)
{
    const struct preset *p = o->p;
    const int64_t E = p->n_embd, L = p->n_layer, X = p->n_expert, F = p->expert_ff;
    const int64_t q_dim = (int64_t)p->n_head * p->head_dim, kv_dim = (int64_t)p->n_head_kv * p->head_dim;
    const float s_in = 1.0f / sqrtf((float)E);
    const float s_out = fminf(0.5f, 1.0f / sqrtf(2.0f * (float)L));
    const enum quant q = o->quant;
    const uint32_t F32 = MOE_TYPE_F32;
    char name[GGUF_NAME_MAX];
    int rc;

    TRY(plan_tensor(w, plan, n_plan, o, "token_embd.weight", 2, E, n_vocab, 1,
                    weight_type(q, R_EMBD, 0, (int)L, E), MK_KIND_WEIGHT, 1.0f, err, errlen));
    plan[*n_plan - 1].pin0 = true;
    TRY(plan_tensor(w, plan, n_plan, o, "output_norm.weight", 1, E, 1, 1, F32, MK_KIND_NORM, 0,
                    err, errlen));
    TRY(plan_tensor(w, plan, n_plan, o, "output.weight", 2, E, n_vocab, 1,
                    weight_type(q, R_OUTPUT, 0, (int)L, E), MK_KIND_WEIGHT, 3 * s_in, err,
                    errlen));
    for (int l = 0; l < (int)L; l++) {
#define T(suffix, nd, a, b, c, type, kind, sigma)                                          \
    do {                                                                                   \
        snprintf(name, sizeof name, "blk.%d.%s.weight", l, suffix);                       \
        TRY(plan_tensor(w, plan, n_plan, o, name, nd, a, b, c, type, kind, sigma, err,    \
                        errlen));                                                          \
    } while (0)
#define WT(role, ne0) weight_type(q, role, l, (int)L, ne0)
        T("attn_norm", 1, E, 1, 1, F32, MK_KIND_NORM, 0);
        T("attn_q", 2, E, q_dim, 1, WT(R_ATTN_QKO, E), MK_KIND_WEIGHT, s_in);
        T("attn_k", 2, E, kv_dim, 1, WT(R_ATTN_QKO, E), MK_KIND_WEIGHT, s_in);
        T("attn_v", 2, E, kv_dim, 1, WT(R_ATTN_V, E), MK_KIND_WEIGHT, s_in);
        T("attn_output", 2, q_dim, E, 1, WT(R_ATTN_QKO, q_dim), MK_KIND_WEIGHT,
          s_out / sqrtf((float)q_dim));
        plan[*n_plan - 1].zero_row0 = true;
        T("attn_q_norm", 1, p->head_dim, 1, 1, F32, MK_KIND_NORM, 0);
        T("attn_k_norm", 1, p->head_dim, 1, 1, F32, MK_KIND_NORM, 0);
        T("ffn_norm", 1, E, 1, 1, F32, MK_KIND_NORM, 0);
        float *bias = biases + (size_t)l * X;
        router_bias(o, (uint32_t)l, bias);
        T("ffn_gate_inp", 2, E, X, 1, F32, MK_KIND_ROUTER, s_in);
        plan[*n_plan - 1].bias = bias;
        T("ffn_gate_exps", 3, E, F, X, WT(R_FFN_GATE_UP, E), MK_KIND_WEIGHT, s_in);
        T("ffn_up_exps", 3, E, F, X, WT(R_FFN_GATE_UP, E), MK_KIND_WEIGHT, s_in);
        T("ffn_down_exps", 3, F, E, X, WT(R_FFN_DOWN, F), MK_KIND_WEIGHT,
          s_out / sqrtf((float)F));
        plan[*n_plan - 1].zero_row0 = true;
#undef WT
#undef T
    }
    return 0;
fail:
    return rc;
}

static void *worker(void *arg)
{
    struct job *j = arg;
    uint8_t *buf = malloc(CHUNK_BYTES);
    char err[256];
    if (!buf) {
        job_fail(j, -ENOMEM, "out of memory");
        return NULL;
    }
    for (;;) {
        uint64_t c = atomic_fetch_add(&j->next, 1);
        if (c >= j->n_chunks || atomic_load(&j->failed))
            break;
        const struct chunk *ch = &j->chunks[c];
        const struct mk_tensor *t = &j->t[ch->tensor];
        mk_gen_blocks(t, ch->b0, ch->n, buf);
        size_t n = (size_t)(ch->n * t->gbytes);
        int rc = gguf_writer_pwrite(j->w, t->idx, ch->b0 * t->gbytes, buf, n, err, sizeof err);
        if (rc) {
            job_fail(j, rc, err);
            break;
        }
        atomic_fetch_add(&j->bytes_done, n);
    }
    free(buf);
    return NULL;
}

/* Splits every tensor into chunks of at most CHUNK_BYTES (whole generation blocks). */
static int make_chunks(struct mk_tensor *t, uint32_t n_t, struct chunk **out, uint64_t *n_out)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < n_t; i++) {
        uint64_t per = CHUNK_BYTES / t[i].gbytes;
        n += (t[i].n_gblocks + per - 1) / per;
    }
    struct chunk *c = malloc(n * sizeof *c);
    if (!c)
        return -ENOMEM;
    uint64_t k = 0;
    for (uint32_t i = 0; i < n_t; i++) {
        uint64_t per = CHUNK_BYTES / t[i].gbytes;
        for (uint64_t b = 0; b < t[i].n_gblocks; b += per)
            c[k++] = (struct chunk){i, b, t[i].n_gblocks - b < per ? t[i].n_gblocks - b : per};
    }
    *out = c;
    *n_out = n;
    return 0;
}

static int run(const struct opts *o, char *err, size_t errlen)
{
    const struct preset *p = o->p;
    struct gguf_writer *w = NULL;
    uint32_t n_plan = 0, n_vocab = 0;
    struct mk_tensor *plan = calloc(3 + 12 * (size_t)p->n_layer, sizeof *plan);
    float *biases = calloc((size_t)p->n_layer * p->n_expert, sizeof *biases);
    struct chunk *chunks = NULL;
    uint64_t n_chunks = 0;
    pthread_t *tids = NULL;
    int n_started = 0, rc;
    bool created = false;
    struct job job;

    memset(&job, 0, sizeof job);
    pthread_mutex_init(&job.err_lock, NULL);
    if (!plan || !biases) {
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
        goto fail;
    }
    mk_tables_init();
    if ((rc = gguf_writer_new(&w))) {
        rc = moe_fail(err, errlen, rc, "out of memory");
        goto fail;
    }
    TRY(add_metadata(w, o, &n_vocab, err, errlen));
    TRY(add_tensors(w, o, n_vocab, plan, &n_plan, biases, err, errlen));
    TRY(gguf_writer_layout(w, err, errlen));
    if ((rc = make_chunks(plan, n_plan, &chunks, &n_chunks))) {
        rc = moe_fail(err, errlen, rc, "out of memory");
        goto fail;
    }
    double t0 = moe_now_s();
    TRY(gguf_writer_create(w, o->out, err, errlen));
    created = true;

    job.w = w;
    job.t = plan;
    job.chunks = chunks;
    job.n_chunks = o->no_data ? 0 : n_chunks;
    int nt = o->threads;
    tids = calloc((size_t)nt, sizeof *tids);
    if (!tids) {
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
        goto fail;
    }
    for (; n_started < nt; n_started++)
        if (pthread_create(&tids[n_started], NULL, worker, &job))
            break;
    if (n_started == 0) {
        rc = moe_fail(err, errlen, -EAGAIN, "cannot start any thread");
        goto fail;
    }
    uint64_t total = 0;
    for (uint32_t i = 0; i < job.n_chunks; i++)
        total += chunks[i].n * plan[chunks[i].tensor].gbytes;
    bool tty = !o->quiet && isatty(2);
    while (tty) {
        uint64_t done = atomic_load(&job.bytes_done);
        if (done >= total || atomic_load(&job.failed))
            break;
        double dt = moe_now_s() - t0;
        fprintf(stderr, "\rmkmodel: %5.1f%%  %.2f / %.2f GiB  %.2f GiB/s ", 100.0 * done / total,
                done / 1073741824.0, total / 1073741824.0, dt > 0 ? done / dt / 1073741824.0 : 0);
        usleep(200000);
    }
    for (int i = 0; i < n_started; i++)
        pthread_join(tids[i], NULL);
    n_started = 0;
    if (tty)
        fprintf(stderr, "\r%70s\r", "");
    if (atomic_load(&job.failed)) {
        rc = moe_fail(err, errlen, job.rc, "%s: %s", o->out, job.err);
        goto fail;
    }
    TRY(gguf_writer_finish(w, false, err, errlen));
    double dt = moe_now_s() - t0;
    uint64_t size = gguf_writer_file_size(w);
    if (!o->quiet && o->no_data)
        fprintf(stderr, "mkmodel: wrote %s: %s %s, %u tensors, vocab %u, %.3f GiB, metadata only\n",
                o->out, p->name, quant_names[o->quant], n_plan, n_vocab, size / 1073741824.0);
    else if (!o->quiet)
        fprintf(stderr,
                "mkmodel: wrote %s: %s %s, %u tensors, vocab %u, %.3f GiB in %.2f s "
                "(%.2f GiB/s, %d threads)\n",
                o->out, p->name, quant_names[o->quant], n_plan, n_vocab, size / 1073741824.0, dt,
                dt > 0 ? size / dt / 1073741824.0 : 0.0, nt);
    rc = 0;
fail:
    for (int i = 0; i < n_started; i++)
        pthread_join(tids[i], NULL);
    /* A partial model must not look like a model; never remove anything but a regular file. */
    struct stat st;
    if (rc && created && stat(o->out, &st) == 0 && S_ISREG(st.st_mode))
        unlink(o->out);
    pthread_mutex_destroy(&job.err_lock);
    gguf_writer_free(w);
    free(tids);
    free(chunks);
    free(biases);
    free(plan);
    return rc;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moectl mkmodel --preset tiny|qwen3-30b-a3b|qwen3-235b-a22b\n"
            "                      [--quant f16|q8_0|q4_k_m] [--seed S] [--router-skew X]\n"
            "                      [--vocab FILE.gguf] [--threads N] [--quiet] [--no-data]\n"
            "                      -o OUT.gguf\n"
            "Writes a deterministic synthetic qwen3moe model with random weights.\n"
            "  --quant        block types, as llama-quantize mixes them (default f16)\n"
            "  --seed         random seed (default 1); same seed, same bytes\n"
            "  --router-skew  Zipf exponent of expert popularity in router logits (default:\n"
            "                 tiny 1.5, real shapes 0.6, so the top quarter of experts takes\n"
            "                 ~70%% of the routings; 0 = no preference)\n"
            "  --vocab        GGUF to take the vocabulary from (default %s)\n"
            "  --threads      generator threads (default: all cores); does not change the bytes\n"
            "  --no-data      write the metadata and size the file but leave the tensor data\n"
            "                 unwritten (a sparse file of zeros): checks layouts in a second\n",
            DEFAULT_VOCAB);
}

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (!isdigit((unsigned char)*s) || errno || end == s || *end)
        return -1;
    *out = v;
    return 0;
}

static int cmd_mkmodel(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"preset", required_argument, NULL, 'p'}, {"quant", required_argument, NULL, 'q'},
        {"seed", required_argument, NULL, 's'},   {"router-skew", required_argument, NULL, 'k'},
        {"vocab", required_argument, NULL, 'v'},  {"threads", required_argument, NULL, 't'},
        {"output", required_argument, NULL, 'o'}, {"quiet", no_argument, NULL, 'Q'},
        {"no-data", no_argument, NULL, 'N'},      {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    static const char default_vocab[] = DEFAULT_VOCAB;
    struct opts o = {.quant = QUANT_F16, .seed = 1, .skew = -1, .vocab = default_vocab};
    long nproc = sysconf(_SC_NPROCESSORS_ONLN);
    o.threads = nproc > 0 ? (int)nproc : 1;
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "o:h", longopts, NULL)) != -1) {
        uint64_t v;
        char *end;
        switch (c) {
        case 'p':
            o.p = NULL;
            for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
                if (!strcmp(optarg, presets[i].name))
                    o.p = &presets[i];
            if (!o.p) {
                fprintf(stderr, "mkmodel: unknown preset '%s'\n", optarg);
                return 2;
            }
            break;
        case 'q': {
            int found = -1;
            for (int i = 0; i < 3; i++)
                if (!strcasecmp(optarg, quant_names[i]))
                    found = i;
            if (found < 0) {
                fprintf(stderr, "mkmodel: unknown quant '%s' (f16, q8_0, q4_k_m)\n", optarg);
                return 2;
            }
            o.quant = (enum quant)found;
            break;
        }
        case 's':
            if (parse_u64(optarg, &v)) {
                fprintf(stderr, "mkmodel: bad --seed '%s'\n", optarg);
                return 2;
            }
            o.seed = v;
            break;
        case 'k':
            errno = 0;
            o.skew = strtof(optarg, &end);
            if (errno || end == optarg || *end || !isfinite(o.skew) || o.skew < 0 || o.skew > 100) {
                fprintf(stderr, "mkmodel: bad --router-skew '%s' (0..100)\n", optarg);
                return 2;
            }
            break;
        case 'v': o.vocab = optarg; break;
        case 't':
            if (parse_u64(optarg, &v) || v < 1 || v > 1024) {
                fprintf(stderr, "mkmodel: bad --threads '%s' (1..1024)\n", optarg);
                return 2;
            }
            o.threads = (int)v;
            break;
        case 'o': o.out = optarg; break;
        case 'Q': o.quiet = true; break;
        case 'N': o.no_data = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind < argc || !o.p || !o.out) {
        if (optind < argc)
            fprintf(stderr, "mkmodel: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }
    if (o.skew < 0)
        o.skew = o.p->skew;
    if (o.vocab == default_vocab && access(o.vocab, R_OK) != 0) {
        fprintf(stderr, "mkmodel: no vocabulary at %s (run from the repository root or pass "
                        "--vocab FILE.gguf)\n", o.vocab);
        return 1;
    }
    char err[512];
    int rc = run(&o, err, sizeof err);
    if (rc) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return 1;
    }
    return 0;
}

MOECTL_COMMAND(mkmodel, "--preset P -o OUT.gguf  write a synthetic qwen3moe model", cmd_mkmodel)

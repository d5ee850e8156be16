/* moectl quantize: rewrites a GGUF model with other block types, as llama-quantize does.
 *
 *   moectl quantize [--threads N] [--allow-requantize] IN.gguf OUT.gguf TYPE
 *
 * TYPE f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k converts every weight
 * matrix to that type (llama-quantize --pure); q4_k_m and q5_k_m are llama-quantize's mixes:
 * Q6_K for the output head (the embedding when the head is tied) and for attn_v and ffn_down in
 * the layers use_more_bits() picks, the base type elsewhere. In every mode 1-D tensors (norms)
 * and the router (ffn_gate_inp) are stored as F32: they are tiny and the router decides which
 * experts run, so rounding there changes more than its size suggests. A matrix whose rows do not
 * fill whole blocks of the chosen type falls back as llama.cpp does (Q4_K -> Q5_0,
 * Q5_K -> Q5_1, Q6_K -> Q8_0), and to F16 when even that does not fit.
 *
 * All KVs are copied in order; general.file_type (llama_ftype) and general.quantization_version
 * are set. Tensors keep their order and shapes. Work is split into row chunks that all threads
 * take from one counter; each chunk is dequantized to f32, quantized with moe_quantize() and
 * written with pwrite at its final offset, so the bytes do not depend on --threads. The file is
 * written as OUT.tmp.PID and renamed to OUT when complete (a failed run leaves an existing OUT
 * as it was); on a terminal a percentage shows the progress. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli/moectl.h"
#include "store/err.h"
#include "store/ggml_type.h"
#include "store/gguf.h"
#include "store/gguf_write.h"
#include "store/io.h"
#include "store/quant.h"

/* Elements per work chunk: big enough to amortise a pwrite, small enough to spread a single
 * large tensor over every thread. */
#define CHUNK_ELEMS (1u << 20)

struct qtarget {
    const char *name;
    uint32_t base;      /* enum moe_type */
    bool mix;           /* llama-quantize's _M mix on top of base */
    uint32_t file_type; /* llama_ftype written to general.file_type */
};

/* llama_ftype values: ALL_F32 0, MOSTLY_F16 1, Q4_0 2, Q4_1 3, Q8_0 7, Q5_0 8, Q5_1 9,
 * Q4_K_S 14, Q4_K_M 15, Q5_K_S 16, Q5_K_M 17, Q6_K 18, BF16 32. Pure Q4_K/Q5_K files are
 * labelled with the nearest ftype (the _S variants). */
static const struct qtarget targets[] = {
    {"f32", MOE_TYPE_F32, false, 0},     {"f16", MOE_TYPE_F16, false, 1},
    {"bf16", MOE_TYPE_BF16, false, 32},  {"q8_0", MOE_TYPE_Q8_0, false, 7},
    {"q4_0", MOE_TYPE_Q4_0, false, 2},   {"q4_1", MOE_TYPE_Q4_1, false, 3},
    {"q5_0", MOE_TYPE_Q5_0, false, 8},   {"q5_1", MOE_TYPE_Q5_1, false, 9},
    {"q4_k", MOE_TYPE_Q4_K, false, 14},  {"q5_k", MOE_TYPE_Q5_K, false, 16},
    {"q6_k", MOE_TYPE_Q6_K, false, 18},  {"q4_k_m", MOE_TYPE_Q4_K, true, 15},
    {"q5_k_m", MOE_TYPE_Q5_K, true, 17},
};
#define N_TARGETS (sizeof targets / sizeof targets[0])

struct qopts {
    const char *in, *out;
    const struct qtarget *target;
    int threads;
    bool allow_requantize;
};

/* One output tensor: where its bytes come from and what they become. */
struct qtensor {
    const struct gguf_tensor *src;
    uint32_t type;      /* destination type */
    uint64_t idx;       /* writer index */
    int64_t ne0, rows;  /* row length and row count (all dims above 0 flattened) */
    size_t src_row, dst_row; /* bytes per row */
};

struct qchunk {
    uint32_t t;
    int64_t row0, n;
};

struct qjob {
    struct gguf_writer *w;
    struct qtensor *t;
    struct qchunk *chunks;
    uint64_t n_chunks;
    atomic_uint_fast64_t next;
    atomic_uint_fast64_t done;    /* chunks converted, for the progress line */
    atomic_int failed;
    pthread_mutex_t lock;
    char err[512];
};

static bool is_float_type(uint32_t t)
{
    return t == MOE_TYPE_F32 || t == MOE_TYPE_F16 || t == MOE_TYPE_BF16;
}

/* llama.cpp's choice of which layers get more bits in the _M mixes: the first and last eighth,
 * and every third layer in between. */
static bool use_more_bits(int64_t i, int64_t n)
{
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

/* Layer number of a "blk.N...." tensor, or -1. */
static int64_t layer_of(const char *name)
{
    if (strncmp(name, "blk.", 4) != 0)
        return -1;
    char *end;
    long v = strtol(name + 4, &end, 10);
    return end != name + 4 && *end == '.' && v >= 0 ? v : -1;
}

/* The type a K-quant falls back to when a row does not fill whole 256-element blocks. */
static uint32_t fallback_type(uint32_t t)
{
    switch (t) {
    case MOE_TYPE_Q4_K: return MOE_TYPE_Q5_0;
    case MOE_TYPE_Q5_K: return MOE_TYPE_Q5_1;
    case MOE_TYPE_Q6_K: return MOE_TYPE_Q8_0;
    default: return MOE_TYPE_F16;
    }
}

struct plan_ctx {
    const struct qtarget *target;
    bool has_output;
    int64_t n_attn_v, i_attn_v;
    int64_t n_layer;
};

static uint32_t choose_type(struct plan_ctx *pc, const struct gguf_tensor *t)
{
    const struct moe_type_info *ti = moe_type_get(t->type);
    /* Integer and other non-computable tensors are carried over unchanged. */
    if (!ti->compute)
        return t->type;
    if (t->n_dims < 2 || strstr(t->name, "ffn_gate_inp"))
        return MOE_TYPE_F32;
    size_t len = strlen(t->name);
    if (len < 6 || strcmp(t->name + len - 6, "weight") != 0)
        return t->type;

    uint32_t type = pc->target->base;
    if (pc->target->mix) {
        bool is_attn_v = strstr(t->name, "attn_v.weight") != NULL;
        if (!strcmp(t->name, "output.weight") ||
            (!pc->has_output && !strcmp(t->name, "token_embd.weight")))
            type = MOE_TYPE_Q6_K;
        else if (is_attn_v && use_more_bits(pc->i_attn_v, pc->n_attn_v))
            type = MOE_TYPE_Q6_K;
        else if (strstr(t->name, "ffn_down") && layer_of(t->name) >= 0 &&
                 use_more_bits(layer_of(t->name), pc->n_layer))
            type = MOE_TYPE_Q6_K;
        if (is_attn_v)
            pc->i_attn_v++;
    }
    for (int tries = 0; tries < 2 && t->ne[0] % moe_type_get(type)->blck != 0; tries++)
        type = fallback_type(type);
    if (t->ne[0] % moe_type_get(type)->blck != 0)
        type = MOE_TYPE_F16;
    return type;
}

/* Copies the source KVs in order, replacing general.file_type, general.quantization_version and
 * general.alignment with this file's values. */
static int plan_kvs(struct gguf_writer *w, const struct gguf_file *f, const struct qtarget *tg,
                    bool quantized, char *err, size_t errlen)
{
    int rc;
    for (uint64_t i = 0; i < f->n_kv; i++) {
        const struct gguf_kv *kv = &f->kv[i];
        if (!strcmp(kv->key, "general.alignment"))
            rc = gguf_writer_set_alignment(w, f->alignment, err, errlen);
        else if (!strcmp(kv->key, "general.file_type"))
            rc = gguf_writer_add_u32(w, kv->key, tg->file_type, err, errlen);
        else if (!strcmp(kv->key, "general.quantization_version"))
            rc = quantized ? gguf_writer_add_u32(w, kv->key, 2, err, errlen) : 0;
        else
            rc = gguf_writer_copy_kv(w, kv, NULL, err, errlen);
        if (rc)
            return rc;
    }
    if (!gguf_writer_has_kv(w, "general.file_type") &&
        (rc = gguf_writer_add_u32(w, "general.file_type", tg->file_type, err, errlen)))
        return rc;
    if (quantized && !gguf_writer_has_kv(w, "general.quantization_version") &&
        (rc = gguf_writer_add_u32(w, "general.quantization_version", 2, err, errlen)))
        return rc;
    return 0;
}

/* Decides every tensor's type and checks that the conversion is possible before any byte is
 * written. */
static int plan_tensors(const struct gguf_file *f, const struct qopts *o, struct qtensor *qt,
                        bool *quantized, char *err, size_t errlen)
{
    struct plan_ctx pc = {.target = o->target};
    pc.has_output = gguf_find_tensor(f, "output.weight") != NULL;
    int64_t n_ffn_down = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        pc.n_attn_v += strstr(f->tensors[i].name, "attn_v.weight") != NULL;
        n_ffn_down += strstr(f->tensors[i].name, "ffn_down") != NULL;
    }
    /* The layer count from the metadata, else the number of ffn_down tensors. */
    pc.n_layer = n_ffn_down;
    const struct gguf_kv *arch = gguf_find_kv(f, "general.architecture");
    if (arch && arch->type == GGUF_STRING && arch->v.str.len < 64) {
        char key[128];
        uint32_t nl;
        snprintf(key, sizeof key, "%.*s.block_count", (int)arch->v.str.len, arch->v.str.p);
        if (gguf_get_u32(f, key, &nl, NULL, 0) == 0 && nl > 0)
            pc.n_layer = nl;
    }

    *quantized = false;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const struct gguf_tensor *t = &f->tensors[i];
        struct qtensor *q = &qt[i];
        q->src = t;
        q->type = choose_type(&pc, t);
        q->ne0 = t->ne[0];
        q->rows = t->ne[1] * t->ne[2] * t->ne[3];
        q->src_row = moe_row_bytes(t->type, q->ne0);
        q->dst_row = moe_row_bytes(q->type, q->ne0);
        if (!is_float_type(q->type))
            *quantized = *quantized || moe_type_get(q->type)->compute;
        if (q->type == t->type)
            continue;
        const struct moe_type_info *si = moe_type_get(t->type);
        if (!si->compute)
            return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                            "tensor '%s' has type %s, which moed cannot convert", t->name,
                            si->name);
        if (!is_float_type(t->type) && !o->allow_requantize && !is_float_type(q->type))
            return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                            "tensor '%s' is already quantized (%s); requantizing loses more "
                            "than quantizing the original once (use --allow-requantize to do "
                            "it anyway)", t->name, si->name);
    }
    return 0;
}

static int convert_chunk(struct qjob *j, const struct qchunk *c, char *err, size_t errlen)
{
    const struct qtensor *q = &j->t[c->t];
    const uint8_t *src = (const uint8_t *)q->src->data + (size_t)c->row0 * q->src_row;
    size_t out_bytes = (size_t)c->n * q->dst_row;
    if (q->type == q->src->type)
        return gguf_writer_pwrite(j->w, q->idx, (uint64_t)c->row0 * q->dst_row, src, out_bytes,
                                  err, errlen);
    int64_t n = c->n * q->ne0;
    float *x = malloc((size_t)n * sizeof *x);
    void *out = malloc(out_bytes);
    int rc = -ENOMEM;
    if (!x || !out) {
        moe_fail(err, errlen, rc, "out of memory converting '%s'", q->src->name);
        goto done;
    }
    if ((rc = moe_dequantize(q->src->type, src, x, n)) ||
        (rc = moe_quantize(q->type, x, out, n))) {
        moe_fail(err, errlen, rc, "tensor '%s': cannot convert %s to %s", q->src->name,
                 moe_type_get(q->src->type)->name, moe_type_get(q->type)->name);
        goto done;
    }
    rc = gguf_writer_pwrite(j->w, q->idx, (uint64_t)c->row0 * q->dst_row, out, out_bytes, err,
                            errlen);
done:
    free(x);
    free(out);
    return rc;
}

static void *worker(void *arg)
{
    struct qjob *j = arg;
    char err[512];
    for (;;) {
        uint64_t k = atomic_fetch_add(&j->next, 1);
        if (k >= j->n_chunks || atomic_load(&j->failed))
            break;
        int rc = convert_chunk(j, &j->chunks[k], err, sizeof err);
        atomic_fetch_add(&j->done, 1);
        if (rc) {
            pthread_mutex_lock(&j->lock);
            if (!atomic_load(&j->failed))
                snprintf(j->err, sizeof j->err, "%s", err);
            atomic_store(&j->failed, rc);
            pthread_mutex_unlock(&j->lock);
            break;
        }
    }
    return NULL;
}

static int make_chunks(struct qtensor *qt, uint64_t n_t, struct qchunk **out, uint64_t *n_out)
{
    uint64_t n = 0;
    for (int pass = 0; pass < 2; pass++) {
        n = 0;
        for (uint64_t i = 0; i < n_t; i++) {
            int64_t per = qt[i].ne0 >= CHUNK_ELEMS ? 1 : CHUNK_ELEMS / qt[i].ne0;
            for (int64_t r = 0; r < qt[i].rows; r += per, n++)
                if (pass == 1)
                    (*out)[n] = (struct qchunk){(uint32_t)i, r,
                                                r + per <= qt[i].rows ? per : qt[i].rows - r};
        }
        if (pass == 0 && !(*out = malloc((n ? n : 1) * sizeof **out)))
            return -ENOMEM;
    }
    *n_out = n;
    return 0;
}

/* True when a and b name the same existing file: writing the output would truncate the input
 * under its own mapping. */
static bool same_file(const char *a, const char *b)
{
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

static int run(const struct qopts *o, char *err, size_t errlen)
{
    struct gguf_file *f = NULL;
    struct gguf_writer *w = NULL;
    struct qtensor *qt = NULL;
    struct qchunk *chunks = NULL;
    pthread_t *tids = NULL;
    int n_started = 0, rc;
    bool created = false, quantized;
    char tmp[4200] = "";
    double t0 = moe_now_s();
    struct qjob job = {0};
    pthread_mutex_init(&job.lock, NULL);

    if (same_file(o->in, o->out)) {
        rc = moe_fail(err, errlen, -EINVAL, "output %s is the input file", o->out);
        goto fail;
    }
    if ((rc = gguf_open(&f, o->in, err, errlen)))
        goto fail;
    if (f->n_tensors == 0) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "%s holds no tensors", o->in);
        goto fail;
    }
    qt = calloc(f->n_tensors, sizeof *qt);
    if (!qt) {
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
        goto fail;
    }
    if ((rc = plan_tensors(f, o, qt, &quantized, err, errlen)))
        goto fail;
    if ((rc = gguf_writer_new(&w))) {
        moe_fail(err, errlen, rc, "out of memory");
        goto fail;
    }
    if ((rc = plan_kvs(w, f, o->target, quantized, err, errlen)))
        goto fail;
    for (uint64_t i = 0; i < f->n_tensors; i++)
        if ((rc = gguf_writer_add_tensor(w, qt[i].src->name, qt[i].src->n_dims, qt[i].src->ne,
                                         qt[i].type, &qt[i].idx, err, errlen)))
            goto fail;
    if ((rc = gguf_writer_layout(w, err, errlen)))
        goto fail;
    if ((rc = make_chunks(qt, f->n_tensors, &chunks, &job.n_chunks))) {
        moe_fail(err, errlen, rc, "out of memory");
        goto fail;
    }
    /* Written next to the output under a temporary name and renamed at the end, so that OUT is
     * either the old file or the whole new one. */
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", o->out, (long)getpid());
    if ((rc = gguf_writer_create(w, tmp, err, errlen)))
        goto fail;
    created = true;

    job.w = w;
    job.t = qt;
    job.chunks = chunks;
    int n_threads = o->threads;
    if ((uint64_t)n_threads > job.n_chunks)
        n_threads = job.n_chunks ? (int)job.n_chunks : 1;
    tids = calloc((size_t)n_threads, sizeof *tids);
    if (!tids) {
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory");
        goto fail;
    }
    for (; n_started < n_threads; n_started++)
        if (pthread_create(&tids[n_started], NULL, worker, &job))
            break;
    if (n_started == 0) {
        rc = moe_fail(err, errlen, -EAGAIN, "cannot start a thread");
        goto fail;
    }
    /* Progress on a terminal, about twice a second. */
    const bool tty = isatty(STDERR_FILENO);
    while (tty && atomic_load(&job.done) < job.n_chunks && !atomic_load(&job.failed)) {
        fprintf(stderr, "\rquantize: %5.1f%%",
                100.0 * (double)atomic_load(&job.done) / (double)job.n_chunks);
        usleep(500000);
    }
    for (int i = 0; i < n_started; i++)
        pthread_join(tids[i], NULL);
    n_started = 0;
    if (tty)
        fprintf(stderr, "\r                \r");
    if ((rc = atomic_load(&job.failed))) {
        snprintf(err, errlen, "%s", job.err);
        goto fail;
    }
    if ((rc = gguf_writer_finish(w, false, err, errlen)))
        goto fail;
    if (rename(tmp, o->out) != 0) {
        rc = moe_fail(err, errlen, -errno, "cannot rename %s to %s: %s", tmp, o->out,
                      strerror(errno));
        goto fail;
    }
    created = false;

    uint64_t count[MOE_TYPE_COUNT] = {0};
    for (uint64_t i = 0; i < f->n_tensors; i++)
        count[qt[i].type]++;
    fprintf(stderr, "quantize: %s (%.2f MiB) -> %s (%.2f MiB), %s:", o->in,
            (double)f->size / (1 << 20), o->out,
            (double)gguf_writer_file_size(w) / (1 << 20), o->target->name);
    for (uint32_t t = 0; t < MOE_TYPE_COUNT; t++)
        if (count[t])
            fprintf(stderr, " %" PRIu64 " %s", count[t], moe_type_get(t)->name);
    fprintf(stderr, "; %.2f s, %d threads\n", moe_now_s() - t0, n_threads);
    rc = 0;
    goto done;
fail:
    if (created)
        unlink(tmp);
done:
    for (int i = 0; i < n_started; i++)
        pthread_join(tids[i], NULL);
    free(tids);
    free(chunks);
    gguf_writer_free(w);
    free(qt);
    if (f)
        gguf_close(f);
    pthread_mutex_destroy(&job.lock);
    return rc;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moectl quantize [--threads N] [--allow-requantize] IN.gguf OUT.gguf TYPE\n"
            "Writes IN with its weight matrices converted to TYPE:\n"
            "  f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q4_k q5_k q6_k  every matrix in that type\n"
            "  q4_k_m q5_k_m   llama-quantize's mixes (Q6_K for the head and for attn_v and\n"
            "                  ffn_down in some layers)\n"
            "Norms and the router (ffn_gate_inp) stay F32; rows that do not fill whole blocks\n"
            "fall back to Q5_0/Q5_1/Q8_0 (K types) or F16.\n"
            "  --threads N          worker threads (default: all cores); the bytes do not depend\n"
            "                       on it\n"
            "  --allow-requantize   accept already-quantized input tensors\n");
}

static int cmd_quantize(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"threads", required_argument, NULL, 't'},
        {"allow-requantize", no_argument, NULL, 'r'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    struct qopts o = {0};
    long nproc = sysconf(_SC_NPROCESSORS_ONLN);
    o.threads = nproc > 0 ? (int)nproc : 1;
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "t:h", longopts, NULL)) != -1) {
        switch (c) {
        case 't': {
            char *end;
            errno = 0;
            long v = strtol(optarg, &end, 10);
            if (errno || end == optarg || *end || v < 1 || v > 1024) {
                fprintf(stderr, "quantize: bad --threads '%s' (1..1024)\n", optarg);
                return 2;
            }
            o.threads = (int)v;
            break;
        }
        case 'r': o.allow_requantize = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (argc - optind != 3) {
        fprintf(stderr, "quantize: expected IN.gguf OUT.gguf TYPE, got %d argument%s\n",
                argc - optind, argc - optind == 1 ? "" : "s");
        usage(stderr);
        return 2;
    }
    o.in = argv[optind];
    o.out = argv[optind + 1];
    for (size_t i = 0; i < N_TARGETS; i++)
        if (!strcasecmp(argv[optind + 2], targets[i].name))
            o.target = &targets[i];
    if (!o.target) {
        fprintf(stderr, "quantize: unknown type '%s'\n", argv[optind + 2]);
        usage(stderr);
        return 2;
    }
    char err[512] = "";
    int rc = run(&o, err, sizeof err);
    if (rc) {
        fprintf(stderr, "quantize: %s\n", err[0] ? err : moe_strerror(rc));
        return 1;
    }
    return 0;
}

MOECTL_COMMAND(quantize, "IN OUT TYPE  convert a GGUF model to other block types", cmd_quantize)

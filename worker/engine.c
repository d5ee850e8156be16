/* qwen3moe forward pass on the CPU (see engine.h; the math is in docs/engine.md and FORMATS.md).
 *
 * One forward call runs the batch layer by layer, all tokens at once, as a fixed sequence of
 * steps that a GPU backend can mirror one kernel each: rmsnorm, q/k/v projections, per-head norm
 * + RoPE + KV store, attention, output projection + residual, rmsnorm, router, top-k, grouped
 * expert gate/up, expert down, weighted combine + residual, and finally the output head for the
 * tokens that want logits.
 *
 * Every step is a parallel region of the thread pool. Each output value is computed by exactly
 * one thread with the same kernel call regardless of how rows are split, so the result does not
 * depend on the thread count. Weights stay in their stored format; activations, the KV cache and
 * all accumulations are float32 (norm and softmax sums in double). */
#include "worker/engine.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/ggml_type.h"
#include "store/quant.h"
#include "worker/cpu/kernels.h"
#include "worker/cpu/pool.h"

#define ENG_DEFAULT_CTX 4096
#define ENG_DEFAULT_BATCH 512
/* Rows per task in the expert regions: enough work per task to amortise the dispatch, small
 * enough that a handful of active experts still spreads over many threads. */
#define ENG_EXPERT_ROWS 32

struct eng_norms {
    float *attn;   /* [n_embd] */
    float *q;      /* [head_dim] */
    float *k;      /* [head_dim] */
    float *ffn;    /* [n_embd] */
};

struct moe_engine {
    const struct moe_model *m;
    struct moe_engine_opts o;
    struct moe_pool *pool;
    int nth;

    /* Dimensions, as int64 to keep index arithmetic free of overflow. */
    int64_t E, H, Hkv, hd, hdv, qdim, kdim, vdim, odim, nexp, kuse, ff, V, L;

    float *norm_mem;              /* every norm weight as float32 */
    struct eng_norms *norms;      /* [n_layer] */
    float *out_norm;              /* [n_embd] */
    double *inv_freq;             /* [head_dim/2] base^(-2i/hd) */

    float *kc;                    /* [n_layer][n_seq][n_head_kv][n_ctx][head_dim] */
    float *vc;                    /* [n_layer][n_seq][n_head_kv][n_ctx][head_dim_v] */
    int32_t *filled;              /* [n_seq] positions 0..filled-1 are valid */
    uint64_t *routing;            /* [n_layer][n_expert] */

    /* Scratch for one chunk of at most n_batch tokens. */
    float *h;                     /* [nb][E] residual stream */
    float *x;                     /* [nb][E] normed input of the current block */
    float *q;                     /* [nb][qdim] */
    float *k;                     /* [nb][kdim] */
    float *v;                     /* [nb][vdim] */
    float *att;                   /* [nb][odim] */
    float *tmp;                   /* [nb][E] */
    float *rl;                    /* [nb][nexp] router logits */
    float *rope_cs;               /* [nb][hd/2][2] cos, sin */
    int32_t *sel_e;               /* [nb][kuse] chosen experts */
    float *sel_w;                 /* [nb][kuse] their weights */
    int32_t *sel_slot;            /* [nb][kuse] slot of each choice in the grouped buffers */
    int32_t *slot_tok;            /* [nb*kuse] token of each slot, grouped by expert */
    int32_t *ex_off;              /* [nexp+1] first slot of each expert */
    int32_t *ex_fill;             /* [nexp] */
    uint8_t *taken;               /* [nexp] all zero between tokens */
    float *xg;                    /* [nb*kuse][E] expert inputs, grouped */
    float *act;                   /* [nb*kuse][ff] silu(gate) * up */
    float *gbuf, *ubuf;           /* [nb*kuse][ff] */
    float *dout;                  /* [nb*kuse][E] */
    float *scores;                /* [nth][n_ctx] */
    int64_t *rows;                /* [nb] tokens that want logits */
    int32_t *task;                /* expert tasks: [2 * n_expert * ceil(max(ff,E)/rows)] */
    void (*attn_values)(float *o, const float *w, const float *V, int64_t np, int64_t hdv);
    char errmsg[256];
};

static void attn_values_plain(float *o, const float *w, const float *V, int64_t np, int64_t hdv);
#if defined(__x86_64__) && defined(__GNUC__)
#define ENG_HAVE_AVX2_PATH 1
static void attn_values_avx2(float *o, const float *w, const float *V, int64_t np, int64_t hdv);
#endif

static int eng_err(struct moe_engine *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int eng_err(struct moe_engine *e, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->errmsg, sizeof e->errmsg, fmt, ap);
    va_end(ap);
    return code;
}

const char *moe_engine_errmsg(const struct moe_engine *e)
{
    return e->errmsg;
}

/* ---------------------------------------------------------------- checks and setup */

static int check_tensor(const struct moe_tensor *t, int64_t ne0, int64_t ne1, const char *what,
                        int layer, char *err, size_t errlen)
{
    char name[64];
    if (layer >= 0)
        snprintf(name, sizeof name, "blk.%d.%s", layer, what);
    else
        snprintf(name, sizeof name, "%s", what);
    if (!t->data)
        return moe_fail(err, errlen, MOE_ENOTFOUND, "%s: no data", name);
    const struct moe_type_info *ti = moe_type_get(t->type);
    if (!ti || !ti->compute)
        return moe_fail(err, errlen, MOE_EUNSUPPORTED, "%s: type %s cannot be computed", name,
                        ti ? ti->name : "?");
    if (t->ne[0] != ne0 || t->ne[1] != ne1)
        return moe_fail(err, errlen, MOE_EFORMAT, "%s: shape {%lld, %lld}, expected {%lld, %lld}",
                        name, (long long)t->ne[0], (long long)t->ne[1], (long long)ne0,
                        (long long)ne1);
    if (ne0 % ti->blck != 0)
        return moe_fail(err, errlen, MOE_EFORMAT, "%s: row of %lld is not a multiple of %u", name,
                        (long long)ne0, ti->blck);
    return 0;
}

static int load_norm(float *dst, const struct moe_tensor *t, int64_t n, const char *what,
                     int layer, char *err, size_t errlen)
{
    int rc = check_tensor(t, n, 1, what, layer, err, errlen);
    if (rc)
        return rc;
    rc = moe_dequantize(t->type, t->data, dst, n);
    if (rc)
        return moe_fail(err, errlen, rc, "%s (layer %d): cannot dequantize", what, layer);
    return 0;
}

static void *xcalloc(size_t n, size_t size, int *bad)
{
    if (n == 0)
        n = 1;
    void *p = calloc(n, size);
    if (!p)
        *bad = 1;
    return p;
}

int moe_engine_init(struct moe_engine **out, const struct moe_model *m,
                    const struct moe_engine_opts *o, char *err, size_t errlen)
{
    const struct moe_hparams *hp = &m->hp;
    int rc = 0;

    if (m->arch != MOE_ARCH_QWEN3MOE)
        return moe_fail(err, errlen, MOE_EUNSUPPORTED, "engine: architecture '%s' is not supported",
                        m->arch_name);
    if (!hp->n_layer || !hp->n_embd || !hp->n_head || !hp->n_head_kv || !hp->head_dim ||
        !hp->head_dim_v || !hp->n_expert || !hp->n_expert_used || !hp->expert_ff || !hp->n_vocab)
        return moe_fail(err, errlen, MOE_ERANGE, "engine: a model dimension is zero");
    if (hp->n_head % hp->n_head_kv)
        return moe_fail(err, errlen, MOE_ERANGE, "engine: n_head %u is not a multiple of n_head_kv %u",
                        hp->n_head, hp->n_head_kv);
    if (hp->head_dim % 2)
        return moe_fail(err, errlen, MOE_ERANGE, "engine: head_dim %u is odd (RoPE needs pairs)",
                        hp->head_dim);
    if (hp->n_expert_used > hp->n_expert)
        return moe_fail(err, errlen, MOE_ERANGE, "engine: expert_used_count %u > expert_count %u",
                        hp->n_expert_used, hp->n_expert);
    if (!(hp->rope_base > 0.0f) || !(hp->rms_eps >= 0.0f))
        return moe_fail(err, errlen, MOE_ERANGE, "engine: bad rope base or rms epsilon");

    struct moe_engine *e = calloc(1, sizeof *e);
    if (!e)
        return -ENOMEM;
    e->m = m;
    e->o = *o;
    if (e->o.n_ctx == 0)
        e->o.n_ctx = hp->n_ctx_train && hp->n_ctx_train < ENG_DEFAULT_CTX ? hp->n_ctx_train
                                                                          : ENG_DEFAULT_CTX;
    if (e->o.n_seq == 0)
        e->o.n_seq = 1;
    if (e->o.n_batch == 0)
        e->o.n_batch = ENG_DEFAULT_BATCH;
    if (e->o.n_ctx > (1u << 24) || e->o.n_seq > 4096 || e->o.n_batch > 65536) {
        rc = moe_fail(err, errlen, MOE_ERANGE, "engine: n_ctx %u, n_seq %u or n_batch %u too large",
                      e->o.n_ctx, e->o.n_seq, e->o.n_batch);
        goto fail;
    }

    e->E = hp->n_embd;
    e->H = hp->n_head;
    e->Hkv = hp->n_head_kv;
    e->hd = hp->head_dim;
    e->hdv = hp->head_dim_v;
    e->qdim = e->H * e->hd;
    e->kdim = e->Hkv * e->hd;
    e->vdim = e->Hkv * e->hdv;
    e->odim = e->H * e->hdv;
    e->nexp = hp->n_expert;
    e->kuse = hp->n_expert_used;
    e->ff = hp->expert_ff;
    e->V = hp->n_vocab;
    e->L = hp->n_layer;

    /* Shapes: model.c checks them too, but the engine indexes with them, so it checks what it
     * relies on. */
    if ((rc = check_tensor(&m->token_embd, e->E, e->V, "token_embd", -1, err, errlen)) ||
        (rc = check_tensor(&m->output, e->E, e->V, "output", -1, err, errlen)))
        goto fail;
    for (int l = 0; l < (int)e->L; l++) {
        const struct moe_layer *ly = &m->layers[l];
        if ((rc = check_tensor(&ly->attn_q, e->E, e->qdim, "attn_q", l, err, errlen)) ||
            (rc = check_tensor(&ly->attn_k, e->E, e->kdim, "attn_k", l, err, errlen)) ||
            (rc = check_tensor(&ly->attn_v, e->E, e->vdim, "attn_v", l, err, errlen)) ||
            (rc = check_tensor(&ly->attn_output, e->odim, e->E, "attn_output", l, err, errlen)) ||
            (rc = check_tensor(&ly->ffn_gate_inp, e->E, e->nexp, "ffn_gate_inp", l, err, errlen)))
            goto fail;
        if (!ly->experts) {
            rc = moe_fail(err, errlen, MOE_ENOTFOUND, "blk.%d: no expert views", l);
            goto fail;
        }
        for (int x = 0; x < (int)e->nexp; x++) {
            const struct moe_expert *ex = &ly->experts[x];
            if ((rc = check_tensor(&ex->gate, e->E, e->ff, "ffn_gate_exps", l, err, errlen)) ||
                (rc = check_tensor(&ex->up, e->E, e->ff, "ffn_up_exps", l, err, errlen)) ||
                (rc = check_tensor(&ex->down, e->ff, e->E, "ffn_down_exps", l, err, errlen)))
                goto fail;
        }
    }

    int bad = 0;
    size_t per_layer = (size_t)(2 * e->E + 2 * e->hd);
    e->norm_mem = xcalloc(per_layer * (size_t)e->L + (size_t)e->E, sizeof(float), &bad);
    e->norms = xcalloc((size_t)e->L, sizeof *e->norms, &bad);
    e->inv_freq = xcalloc((size_t)e->hd / 2, sizeof(double), &bad);
    if (bad) {
        rc = -ENOMEM;
        goto fail;
    }
    for (int l = 0; l < (int)e->L; l++) {
        const struct moe_layer *ly = &m->layers[l];
        struct eng_norms *n = &e->norms[l];
        n->attn = e->norm_mem + per_layer * (size_t)l;
        n->ffn = n->attn + e->E;
        n->q = n->ffn + e->E;
        n->k = n->q + e->hd;
        if ((rc = load_norm(n->attn, &ly->attn_norm, e->E, "attn_norm", l, err, errlen)) ||
            (rc = load_norm(n->ffn, &ly->ffn_norm, e->E, "ffn_norm", l, err, errlen)) ||
            (rc = load_norm(n->q, &ly->attn_q_norm, e->hd, "attn_q_norm", l, err, errlen)) ||
            (rc = load_norm(n->k, &ly->attn_k_norm, e->hd, "attn_k_norm", l, err, errlen)))
            goto fail;
    }
    e->out_norm = e->norm_mem + per_layer * (size_t)e->L;
    if ((rc = load_norm(e->out_norm, &m->output_norm, e->E, "output_norm", -1, err, errlen)))
        goto fail;
    for (int64_t i = 0; i < e->hd / 2; i++)
        e->inv_freq[i] = pow((double)hp->rope_base, -2.0 * (double)i / (double)e->hd);

    /* The KV cache is calloc'ed: large allocations come from mmap, so pages are only committed
     * as positions are written. */
    size_t cells = (size_t)e->L * e->o.n_seq * e->o.n_ctx;
    e->kc = xcalloc(cells, (size_t)e->kdim * sizeof(float), &bad);
    e->vc = xcalloc(cells, (size_t)e->vdim * sizeof(float), &bad);
    e->filled = xcalloc(e->o.n_seq, sizeof *e->filled, &bad);
    e->routing = xcalloc((size_t)(e->L * e->nexp), sizeof *e->routing, &bad);
    if (bad) {
        rc = moe_fail(err, errlen, -ENOMEM, "engine: cannot allocate the KV cache (%u x %u positions)",
                      e->o.n_seq, e->o.n_ctx);
        goto fail;
    }

    rc = moe_pool_init(&e->pool, o->n_threads);
    if (rc) {
        moe_fail(err, errlen, rc, "engine: cannot start threads: %s", moe_strerror(rc));
        goto fail;
    }
    e->nth = moe_pool_size(e->pool);
    e->attn_values = attn_values_plain;
#ifdef ENG_HAVE_AVX2_PATH
    if (__builtin_cpu_supports("avx2"))
        e->attn_values = attn_values_avx2;
#endif
    e->o.n_threads = e->nth;

    size_t nb = e->o.n_batch, ns = nb * (size_t)e->kuse;
    int64_t maxrows = e->ff > e->E ? e->ff : e->E;
    e->h = xcalloc(nb * e->E, sizeof(float), &bad);
    e->x = xcalloc(nb * e->E, sizeof(float), &bad);
    e->q = xcalloc(nb * e->qdim, sizeof(float), &bad);
    e->k = xcalloc(nb * e->kdim, sizeof(float), &bad);
    e->v = xcalloc(nb * e->vdim, sizeof(float), &bad);
    e->att = xcalloc(nb * e->odim, sizeof(float), &bad);
    e->tmp = xcalloc(nb * e->E, sizeof(float), &bad);
    e->rl = xcalloc(nb * e->nexp, sizeof(float), &bad);
    e->rope_cs = xcalloc(nb * e->hd, sizeof(float), &bad);
    e->sel_e = xcalloc(ns, sizeof(int32_t), &bad);
    e->sel_w = xcalloc(ns, sizeof(float), &bad);
    e->sel_slot = xcalloc(ns, sizeof(int32_t), &bad);
    e->slot_tok = xcalloc(ns, sizeof(int32_t), &bad);
    e->ex_off = xcalloc(e->nexp + 1, sizeof(int32_t), &bad);
    e->ex_fill = xcalloc(e->nexp, sizeof(int32_t), &bad);
    e->taken = xcalloc(e->nexp, 1, &bad);
    e->xg = xcalloc(ns * e->E, sizeof(float), &bad);
    e->act = xcalloc(ns * e->ff, sizeof(float), &bad);
    e->gbuf = xcalloc(ns * e->ff, sizeof(float), &bad);
    e->ubuf = xcalloc(ns * e->ff, sizeof(float), &bad);
    e->dout = xcalloc(ns * e->E, sizeof(float), &bad);
    e->scores = xcalloc((size_t)e->nth * e->o.n_ctx, sizeof(float), &bad);
    e->rows = xcalloc(nb, sizeof(int64_t), &bad);
    e->task = xcalloc(2 * (size_t)e->nexp * (size_t)((maxrows + ENG_EXPERT_ROWS - 1) / ENG_EXPERT_ROWS),
                      sizeof(int32_t), &bad);
    if (bad) {
        rc = moe_fail(err, errlen, -ENOMEM, "engine: cannot allocate scratch for n_batch %u",
                      e->o.n_batch);
        goto fail;
    }
    *out = e;
    return 0;

fail:
    moe_engine_free(e);
    return rc;
}

void moe_engine_free(struct moe_engine *e)
{
    if (!e)
        return;
    moe_pool_free(e->pool);
    free(e->norm_mem);
    free(e->norms);
    free(e->inv_freq);
    free(e->kc);
    free(e->vc);
    free(e->filled);
    free(e->routing);
    free(e->h);
    free(e->x);
    free(e->q);
    free(e->k);
    free(e->v);
    free(e->att);
    free(e->tmp);
    free(e->rl);
    free(e->rope_cs);
    free(e->sel_e);
    free(e->sel_w);
    free(e->sel_slot);
    free(e->slot_tok);
    free(e->ex_off);
    free(e->ex_fill);
    free(e->taken);
    free(e->xg);
    free(e->act);
    free(e->gbuf);
    free(e->ubuf);
    free(e->dout);
    free(e->scores);
    free(e->rows);
    free(e->task);
    free(e);
}

void moe_engine_seq_clear(struct moe_engine *e, int32_t seq)
{
    if (seq >= 0 && (uint32_t)seq < e->o.n_seq)
        e->filled[seq] = 0;
}

const uint64_t *moe_engine_routing_counts(const struct moe_engine *e)
{
    return e->routing;
}

const struct moe_engine_opts *moe_engine_get_opts(const struct moe_engine *e)
{
    return &e->o;
}

int32_t moe_engine_seq_len(const struct moe_engine *e, int32_t seq)
{
    if (seq < 0 || (uint32_t)seq >= e->o.n_seq)
        return -1;
    return e->filled[seq];
}

/* ---------------------------------------------------------------- small math */

/* First cache row of (layer, sequence, kv head); positions follow contiguously. */
static inline size_t kv_row(const struct moe_engine *e, int l, int32_t seq, int64_t kvh)
{
    return (((size_t)l * e->o.n_seq + (size_t)seq) * (size_t)e->Hkv + (size_t)kvh) * e->o.n_ctx;
}

static void rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps)
{
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float s = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    for (int64_t i = 0; i < n; i++)
        y[i] = x[i] * s * w[i];
}

/* o[hdv] = sum over p < np of w[p] * V[p][hdv]. Eight lanes at a time with GCC vector types
 * (there is no reduction to reorder, so any lane width gives the same floats). Compiled twice:
 * plain, and with AVX2 for CPUs that have it, chosen once at engine init (a function pointer, not
 * an ifunc, so sanitizer builds keep working). */
typedef float eng_v8 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) void attn_values_body(float *o, const float *w,
                                                                   const float *V, int64_t np,
                                                                   int64_t hdv)
{
    int64_t nv = hdv / 8;
    for (int64_t i = 0; i < hdv; i++)
        o[i] = 0.0f;
    for (int64_t p = 0; p < np; p++) {
        const float *vp = V + p * hdv;
        float wp = w[p];
        for (int64_t b = 0; b < nv; b++) {
            eng_v8 acc, v;
            memcpy(&acc, o + 8 * b, sizeof acc);
            memcpy(&v, vp + 8 * b, sizeof v);
            acc += wp * v;
            memcpy(o + 8 * b, &acc, sizeof acc);
        }
        for (int64_t i = 8 * nv; i < hdv; i++)
            o[i] += wp * vp[i];
    }
}

static void attn_values_plain(float *o, const float *w, const float *V, int64_t np, int64_t hdv)
{
    attn_values_body(o, w, V, np, hdv);
}

#ifdef ENG_HAVE_AVX2_PATH
__attribute__((target("avx2"))) static void attn_values_avx2(float *o, const float *w,
                                                              const float *V, int64_t np,
                                                              int64_t hdv)
{
    attn_values_body(o, w, V, np, hdv);
}
#endif

static inline float silu(float x)
{
    return x / (1.0f + expf(-x));
}

/* ---------------------------------------------------------------- parallel regions */

/* Below about this many multiply-adds a region runs on the caller alone: waking helpers would
 * cost more than it saves (tiny models, single-token steps of small layers). */
#define ENG_SERIAL_MACS (1 << 16)

static void par_for(struct moe_engine *e, int64_t n_tasks, double macs, moe_pool_task_fn fn,
                    void *ctx)
{
    if (macs < ENG_SERIAL_MACS) {
        for (int64_t i = 0; i < n_tasks; i++)
            fn(ctx, i, 0);
        return;
    }
    moe_pool_for(e->pool, n_tasks, fn, ctx);
}

/* Several independent matrix products over the same tokens; each task is a block of rows of
 * one product. */
struct mm_job {
    const struct moe_tensor *W;
    const float *X;
    int64_t ldx;
    float *Y;
    int64_t ldy;
};

#define MM_MAX_JOBS 3

struct mm_ctx {
    const struct mm_job *jobs;
    int n_jobs;
    int64_t n_tok;
    int64_t rows_per_task[MM_MAX_JOBS];
    int64_t first_task[MM_MAX_JOBS + 1];
};

static void mm_task(void *arg, int64_t task, int ith)
{
    const struct mm_ctx *c = arg;
    (void)ith;
    int j = 0;
    while (task >= c->first_task[j + 1])
        j++;
    const struct mm_job *jb = &c->jobs[j];
    int64_t r0 = (task - c->first_task[j]) * c->rows_per_task[j];
    int64_t r1 = r0 + c->rows_per_task[j] < jb->W->ne[1] ? r0 + c->rows_per_task[j] : jb->W->ne[1];
    if (c->n_tok == 1)
        moe_matvec(jb->W->type, jb->W->data, jb->W->ne[0], jb->X, jb->Y, r0, r1);
    else
        moe_matmul(jb->W->type, jb->W->data, jb->W->ne[0], jb->X, jb->ldx, c->n_tok, jb->Y,
                   jb->ldy, r0, r1);
}

static void par_matmul(struct moe_engine *e, const struct mm_job *jobs, int n_jobs, int64_t n_tok)
{
    struct mm_ctx c = {.jobs = jobs, .n_jobs = n_jobs, .n_tok = n_tok};
    double macs = 0;
    for (int j = 0; j < n_jobs; j++)
        macs += (double)jobs[j].W->ne[0] * (double)jobs[j].W->ne[1] * (double)n_tok;
    c.first_task[0] = 0;
    for (int j = 0; j < n_jobs; j++) {
        int64_t rows = jobs[j].W->ne[1];
        /* About four tasks per thread for balance, at least 16 rows each; the split does not
         * change any result (each row is one kernel call). */
        int64_t per = macs < ENG_SERIAL_MACS ? rows : (rows + 4 * e->nth - 1) / (4 * e->nth);
        if (per < 16)
            per = 16;
        per = (per + 3) / 4 * 4;
        c.rows_per_task[j] = per;
        c.first_task[j + 1] = c.first_task[j] + (rows + per - 1) / per;
    }
    par_for(e, c.first_task[n_jobs], macs, mm_task, &c);
}

/* The batch chunk being evaluated. */
struct fwd {
    struct moe_engine *e;
    int l;
    int64_t n;
    const int32_t *token, *pos, *seq;
};

static void attn_norm_task(void *arg, int64_t t, int ith)
{
    struct fwd *f = arg;
    struct moe_engine *e = f->e;
    (void)ith;
    rmsnorm(e->x + t * e->E, e->h + t * e->E, e->norms[f->l].attn, e->E, e->m->hp.rms_eps);
}

static void rope(float *x, const float *cs, int64_t hd)
{
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        float c = cs[2 * i], s = cs[2 * i + 1];
        float a = x[i], b = x[i + half];
        x[i] = a * c - b * s;
        x[i + half] = a * s + b * c;
    }
}

/* Per-head RMSNorm of q and k, RoPE, and the store of k and v into the cache. */
static void qk_task(void *arg, int64_t t, int ith)
{
    struct fwd *f = arg;
    struct moe_engine *e = f->e;
    const struct eng_norms *nw = &e->norms[f->l];
    float eps = e->m->hp.rms_eps;
    (void)ith;
    const float *cs = e->rope_cs + t * e->hd;
    float *q = e->q + t * e->qdim, *k = e->k + t * e->kdim;
    for (int64_t h = 0; h < e->H; h++) {
        rmsnorm(q + h * e->hd, q + h * e->hd, nw->q, e->hd, eps);
        rope(q + h * e->hd, cs, e->hd);
    }
    for (int64_t h = 0; h < e->Hkv; h++) {
        rmsnorm(k + h * e->hd, k + h * e->hd, nw->k, e->hd, eps);
        rope(k + h * e->hd, cs, e->hd);
    }
    for (int64_t h = 0; h < e->Hkv; h++) {
        size_t row = kv_row(e, f->l, f->seq[t], h) + (size_t)f->pos[t];
        memcpy(e->kc + row * e->hd, k + h * e->hd, sizeof(float) * e->hd);
        memcpy(e->vc + row * e->hdv, e->v + t * e->vdim + h * e->hdv, sizeof(float) * e->hdv);
    }
}

/* Causal attention, one (token, head) pair per task. Scores are a matrix-vector product over the
 * head's contiguous K rows (the kernels' SIMD F32 path); values are summed with attn_values. */
static void attn_task(void *arg, int64_t task, int ith)
{
    struct fwd *f = arg;
    struct moe_engine *e = f->e;
    float *sc = e->scores + (size_t)ith * e->o.n_ctx;
    const int64_t group = e->H / e->Hkv;
    const float scale = (float)(1.0 / sqrt((double)e->hd));
    int64_t t = task / e->H, h = task % e->H, kvh = h / group;
    int64_t np = (int64_t)f->pos[t] + 1;
    size_t row = kv_row(e, f->l, f->seq[t], kvh);
    const float *q = e->q + t * e->qdim + h * e->hd;
    moe_matvec(MOE_TYPE_F32, e->kc + row * e->hd, e->hd, q, sc, 0, np);
    float mx = -INFINITY;
    for (int64_t p = 0; p < np; p++) {
        sc[p] *= scale;
        if (sc[p] > mx)
            mx = sc[p];
    }
    double z = 0.0;
    for (int64_t p = 0; p < np; p++) {
        sc[p] = expf(sc[p] - mx);
        z += sc[p];
    }
    float inv = (float)(1.0 / z);
    for (int64_t p = 0; p < np; p++)
        sc[p] *= inv;
    e->attn_values(e->att + t * e->odim + h * e->hdv, sc, e->vc + row * e->hdv, np, e->hdv);
}

/* Multiply-adds of the attention region (scores and weighted values). */
static double attn_macs(const struct fwd *f)
{
    double sum = 0;
    for (int64_t t = 0; t < f->n; t++)
        sum += (double)f->pos[t] + 1;
    return sum * (double)f->e->H * (double)(f->e->hd + f->e->hdv);
}

/* h += attention output; x = rmsnorm(h) for the MoE block. */
static void attn_resid_task(void *arg, int64_t t, int ith)
{
    struct fwd *f = arg;
    struct moe_engine *e = f->e;
    (void)ith;
    float *h = e->h + t * e->E;
    const float *o = e->tmp + t * e->E;
    for (int64_t i = 0; i < e->E; i++)
        h[i] += o[i];
    rmsnorm(e->x + t * e->E, h, e->norms[f->l].ffn, e->E, e->m->hp.rms_eps);
}

/* Copies each token's normed input into its expert slots. */
static void gather_task(void *arg, int64_t s, int ith)
{
    struct fwd *f = arg;
    struct moe_engine *e = f->e;
    (void)ith;
    memcpy(e->xg + s * e->E, e->x + (int64_t)e->slot_tok[s] * e->E, sizeof(float) * e->E);
}

/* Expert tasks: e->task holds (expert, first row) pairs. Gate and up for rows [r0, r0+R) of one
 * expert, for all of its tokens, followed by the SwiGLU of exactly those rows. */
static void expert_up_task(void *arg, int64_t i, int ith)
{
    struct fwd *f = arg;
    struct moe_engine *e = f->e;
    (void)ith;
    int x = e->task[2 * i];
    int64_t r0 = e->task[2 * i + 1];
    int64_t r1 = r0 + ENG_EXPERT_ROWS < e->ff ? r0 + ENG_EXPERT_ROWS : e->ff;
    const struct moe_expert *ex = &e->m->layers[f->l].experts[x];
    int64_t s0 = e->ex_off[x], cnt = e->ex_off[x + 1] - s0;
    const float *X = e->xg + s0 * e->E;
    float *G = e->gbuf + s0 * e->ff, *U = e->ubuf + s0 * e->ff;
    if (cnt == 1) {
        moe_matvec(ex->gate.type, ex->gate.data, e->E, X, G, r0, r1);
        moe_matvec(ex->up.type, ex->up.data, e->E, X, U, r0, r1);
    } else {
        moe_matmul(ex->gate.type, ex->gate.data, e->E, X, e->E, cnt, G, e->ff, r0, r1);
        moe_matmul(ex->up.type, ex->up.data, e->E, X, e->E, cnt, U, e->ff, r0, r1);
    }
    for (int64_t s = 0; s < cnt; s++) {
        float *A = e->act + (s0 + s) * e->ff;
        const float *g = G + s * e->ff, *u = U + s * e->ff;
        for (int64_t r = r0; r < r1; r++)
            A[r] = silu(g[r]) * u[r];
    }
}

static void expert_down_task(void *arg, int64_t i, int ith)
{
    struct fwd *f = arg;
    struct moe_engine *e = f->e;
    (void)ith;
    int x = e->task[2 * i];
    int64_t r0 = e->task[2 * i + 1];
    int64_t r1 = r0 + ENG_EXPERT_ROWS < e->E ? r0 + ENG_EXPERT_ROWS : e->E;
    const struct moe_expert *ex = &e->m->layers[f->l].experts[x];
    int64_t s0 = e->ex_off[x], cnt = e->ex_off[x + 1] - s0;
    const float *A = e->act + s0 * e->ff;
    float *D = e->dout + s0 * e->E;
    if (cnt == 1)
        moe_matvec(ex->down.type, ex->down.data, e->ff, A, D, r0, r1);
    else
        moe_matmul(ex->down.type, ex->down.data, e->ff, A, e->ff, cnt, D, e->E, r0, r1);
}

/* h += sum of the chosen experts' outputs, in the token's top-k order (fixed, so the sum does
 * not depend on how tokens were grouped). */
static void combine_task(void *arg, int64_t t, int ith)
{
    struct fwd *f = arg;
    struct moe_engine *e = f->e;
    (void)ith;
    float *h = e->h + t * e->E, *acc = e->tmp + t * e->E;
    for (int64_t i = 0; i < e->E; i++)
        acc[i] = 0.0f;
    for (int64_t j = 0; j < e->kuse; j++) {
        float w = e->sel_w[t * e->kuse + j];
        const float *d = e->dout + (int64_t)e->sel_slot[t * e->kuse + j] * e->E;
        for (int64_t i = 0; i < e->E; i++)
            acc[i] += w * d[i];
    }
    for (int64_t i = 0; i < e->E; i++)
        h[i] += acc[i];
}

/* Router: softmax over all experts, top-k (lowest index wins ties), optional renormalisation,
 * then slots grouped by expert. Serial: n * n_expert work, tiny next to the matrix products. */
static void route(struct fwd *f)
{
    struct moe_engine *e = f->e;
    const int64_t n = f->n, K = e->kuse, NE = e->nexp;
    uint64_t *counts = e->routing + (size_t)f->l * NE;
    memset(e->ex_fill, 0, sizeof(int32_t) * NE);
    for (int64_t t = 0; t < n; t++) {
        float *r = e->rl + t * NE;
        float mx = -INFINITY;
        for (int64_t x = 0; x < NE; x++)
            if (r[x] > mx)
                mx = r[x];
        double z = 0.0;
        for (int64_t x = 0; x < NE; x++) {
            r[x] = expf(r[x] - mx);
            z += r[x];
        }
        for (int64_t x = 0; x < NE; x++)
            r[x] = (float)(r[x] / z);
        int32_t *se = e->sel_e + t * K;
        float *sw = e->sel_w + t * K;
        double sum = 0.0;
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t x = 0; x < NE; x++)
                /* NaN probabilities never win, but a choice is always made. */
                if (!e->taken[x] && (best < 0 || r[x] > r[best] || isnan(r[best])))
                    best = x;
            e->taken[best] = 1;
            se[j] = (int32_t)best;
            sw[j] = r[best];
            sum += r[best];
            e->ex_fill[best]++;
            counts[best]++;
        }
        for (int64_t j = 0; j < K; j++)
            e->taken[se[j]] = 0;
        if (e->m->hp.norm_topk && sum > 0.0)
            for (int64_t j = 0; j < K; j++)
                sw[j] = (float)(sw[j] / sum);
    }
    e->ex_off[0] = 0;
    for (int64_t x = 0; x < NE; x++) {
        e->ex_off[x + 1] = e->ex_off[x] + e->ex_fill[x];
        e->ex_fill[x] = 0;
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < K; j++) {
            int32_t x = e->sel_e[t * K + j];
            int32_t s = e->ex_off[x] + e->ex_fill[x]++;
            e->slot_tok[s] = (int32_t)t;
            e->sel_slot[t * K + j] = s;
        }
}

static int make_tasks(struct moe_engine *e, int64_t rows)
{
    int nt = 0;
    for (int64_t x = 0; x < e->nexp; x++) {
        if (e->ex_off[x + 1] == e->ex_off[x])
            continue;
        for (int64_t r = 0; r < rows; r += ENG_EXPERT_ROWS) {
            e->task[2 * nt] = (int32_t)x;
            e->task[2 * nt + 1] = (int32_t)r;
            nt++;
        }
    }
    return nt;
}

struct head_ctx {
    struct moe_engine *e;
    const int64_t *rows;  /* batch indices of the tokens that want logits */
    int64_t n;
    float *xo;            /* [n][E] */
};

static void head_norm_task(void *arg, int64_t i, int ith)
{
    struct head_ctx *c = arg;
    struct moe_engine *e = c->e;
    (void)ith;
    rmsnorm(c->xo + i * e->E, e->h + c->rows[i] * e->E, e->out_norm, e->E, e->m->hp.rms_eps);
}

/* Evaluates n <= n_batch tokens (already validated) and writes logits for the selected ones. */
static int forward_chunk(struct moe_engine *e, const struct moe_batch *b, uint32_t off, int64_t n,
                         float *out, int64_t *n_out)
{
    const struct moe_model *m = e->m;
    struct fwd f = {.e = e, .n = n, .token = b->token + off, .pos = b->pos + off, .seq = b->seq + off};
    size_t erow = moe_row_bytes(m->token_embd.type, e->E);

    for (int64_t t = 0; t < n; t++) {
        const uint8_t *row = (const uint8_t *)m->token_embd.data + (size_t)f.token[t] * erow;
        int rc = moe_dequantize(m->token_embd.type, row, e->h + t * e->E, e->E);
        if (rc)
            return eng_err(e, rc, "token_embd: cannot dequantize type %u", m->token_embd.type);
        for (int64_t i = 0; i < e->hd / 2; i++) {
            double th = (double)f.pos[t] * e->inv_freq[i];
            e->rope_cs[t * e->hd + 2 * i] = (float)cos(th);
            e->rope_cs[t * e->hd + 2 * i + 1] = (float)sin(th);
        }
    }

    for (int l = 0; l < (int)e->L; l++) {
        const struct moe_layer *ly = &m->layers[l];
        f.l = l;
        par_for(e, n, n * e->E, attn_norm_task, &f);
        struct mm_job qkv[3] = {
            {&ly->attn_q, e->x, e->E, e->q, e->qdim},
            {&ly->attn_k, e->x, e->E, e->k, e->kdim},
            {&ly->attn_v, e->x, e->E, e->v, e->vdim},
        };
        par_matmul(e, qkv, 3, n);
        par_for(e, n, n * (e->qdim + e->kdim) * 4, qk_task, &f);
        par_for(e, n * e->H, attn_macs(&f), attn_task, &f);
        struct mm_job wo = {&ly->attn_output, e->att, e->odim, e->tmp, e->E};
        par_matmul(e, &wo, 1, n);
        par_for(e, n, n * e->E * 2, attn_resid_task, &f);

        struct mm_job router = {&ly->ffn_gate_inp, e->x, e->E, e->rl, e->nexp};
        par_matmul(e, &router, 1, n);
        route(&f);
        par_for(e, n * e->kuse, n * e->kuse * e->E / 4, gather_task, &f);
        par_for(e, make_tasks(e, e->ff), 2.0 * n * e->kuse * e->E * e->ff, expert_up_task, &f);
        par_for(e, make_tasks(e, e->E), 1.0 * n * e->kuse * e->E * e->ff, expert_down_task, &f);
        par_for(e, n, n * e->kuse * e->E, combine_task, &f);
    }

    /* Output head for the selected tokens only; x and q are free now and serve as scratch. */
    int64_t *rows = e->rows, k = 0;
    for (int64_t t = 0; t < n; t++)
        if (out && (!b->logits || b->logits[off + t]))
            rows[k++] = t;
    *n_out = k;
    if (k == 0)
        return 0;
    struct head_ctx hc = {e, rows, k, e->x};
    par_for(e, k, k * e->E, head_norm_task, &hc);
    struct mm_job head = {&m->output, e->x, e->E, out, e->V};
    par_matmul(e, &head, 1, k);
    return 0;
}

int moe_engine_forward(struct moe_engine *e, const struct moe_batch *b, float *out)
{
    if (b->n == 0)
        return 0;
    if (!b->token || !b->pos || !b->seq)
        return eng_err(e, MOE_ERANGE, "batch: token, pos and seq are required");

    /* Validate the whole batch before touching any state, so a bad batch changes nothing. */
    int32_t *fill = malloc(sizeof *fill * e->o.n_seq);
    if (!fill)
        return eng_err(e, -ENOMEM, "out of memory");
    memcpy(fill, e->filled, sizeof *fill * e->o.n_seq);
    int rc = 0;
    for (uint32_t i = 0; i < b->n && rc == 0; i++) {
        int32_t tok = b->token[i], pos = b->pos[i], seq = b->seq[i];
        if (tok < 0 || (int64_t)tok >= e->V)
            rc = eng_err(e, MOE_ERANGE, "batch[%u]: token %d outside the vocabulary (%lld)", i, tok,
                         (long long)e->V);
        else if (seq < 0 || (uint32_t)seq >= e->o.n_seq)
            rc = eng_err(e, MOE_ERANGE, "batch[%u]: sequence %d outside 0..%u", i, seq,
                         e->o.n_seq - 1);
        else if (pos < 0 || (uint32_t)pos >= e->o.n_ctx)
            rc = eng_err(e, MOE_ERANGE, "batch[%u]: position %d outside the context (%u)", i, pos,
                         e->o.n_ctx);
        else if (pos > fill[seq])
            rc = eng_err(e, MOE_ERANGE,
                         "batch[%u]: position %d of sequence %d follows a gap (next is %d)", i, pos,
                         seq, fill[seq]);
        else
            fill[seq] = pos + 1;
    }
    if (rc) {
        free(fill);
        return rc;
    }
    memcpy(e->filled, fill, sizeof *fill * e->o.n_seq);
    free(fill);

    int64_t written = 0;
    for (uint32_t off = 0; off < b->n; off += e->o.n_batch) {
        int64_t n = b->n - off < e->o.n_batch ? b->n - off : e->o.n_batch, k = 0;
        rc = forward_chunk(e, b, off, n, out ? out + written * e->V : NULL, &k);
        if (rc)
            return rc;
        written += k;
    }
    return 0;
}

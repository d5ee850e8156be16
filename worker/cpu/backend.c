/* The CPU backend (see worker/backend.h): every op is a parallel region of the thread pool.
 *
 * Each output value is computed by exactly one thread with the same kernel call regardless of
 * how rows are split, so the result does not depend on the thread count. Weights stay in their
 * stored format and are read from the mapping in place; activations, the KV cache and all
 * accumulations are float32 (norm and softmax sums in double). Routing groups the step's tokens
 * by expert on the host, so each active expert's weights are decoded once per step. */
#include "worker/backend.h"
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
#include "worker/cpu/pstudy.h"

/* Rows per task in the expert regions: enough work per task to amortise the dispatch, small
 * enough that a handful of active experts still spreads over many threads. */
#define ENG_EXPERT_ROWS 32

struct eng_norms {
    float *attn;   /* [n_embd] */
    float *q;      /* [head_dim] */
    float *k;      /* [head_dim] */
    float *ffn;    /* [n_embd] */
};

struct cpu_backend {
    struct moe_backend base;
    const struct moe_model *m;
    struct moe_dims d;
    struct moe_pool *pool;
    int nth;

    /* Dimensions, as int64 to keep index arithmetic free of overflow. */
    int64_t E, H, Hkv, hd, hdv, qdim, kdim, vdim, odim, nexp, kuse, ff, V, L;

    float *norm_mem;              /* every norm weight as float32 */
    struct eng_norms *norms;      /* [n_layer] */
    float *out_norm;              /* [n_embd] */

    float *kc;                    /* [n_layer][n_seq][n_head_kv][n_ctx][head_dim] */
    float *vc;                    /* [n_layer][n_seq][n_head_kv][n_ctx][head_dim_v] */
    uint64_t *routing;            /* [n_layer][n_expert] */
    int32_t *route_hist;          /* [n_layer][n][kuse] a recording step's choices (d.record_routes) */
    bool record;                  /* this step records (st->record) */

    /* The step: inputs copied by begin(). */
    int64_t n, n_out;
    int32_t *token, *pos, *seq;   /* [nb] */
    int32_t *out_row;             /* [nb] */
    float *rope_cs;               /* [nb][hd/2][2] cos, sin */
    bool head_pending, sample;

    struct moe_sampler **smp;     /* [n_seq], NULL until sampler() */
    struct cpu_bias {             /* [n_seq] logit bias (bias()), NULL / 0 when none */
        int32_t *tok;
        float *val;
        size_t n;
    } *bias;
    float *slog;                  /* [n_seq][V] logits of sampled rows, allocated on first use */

    /* Scratch for one step of at most n_batch tokens. */
    float *buf[MOE_BUF_COUNT];    /* the contract's buffers (SEL_E holds int32) */
    float *tmp;                   /* [nb][max(E, qdim, kdim, vdim, nexp)] accumulate staging */
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
    float *xo;                    /* [nb][E] normed rows for the head */
    int32_t *task;                /* expert tasks: [2 * n_expert * ceil(max(ff,E)/rows)] */
    struct moe_expert *xv;        /* [nexp] views from the expert source (d.expert_src) */
    struct moe_expert *xtmp;      /* [nexp] what the source filled in */
    int32_t *xids;                /* [nexp] the layer's chosen experts */
    int32_t *xpred;               /* [nexp] the next layer's predicted experts */
    uint8_t *xmark;               /* [nexp] all zero outside predict_next */
    uint8_t *xsel;                /* [nexp] 1: in the part being computed */
    struct moe_pstudy *ps;        /* MOE_CPU_PREDICT_STUDY=1: the predictors measured, else NULL */
    float *ps_x, *ps_lg;          /* [E], [nexp] its scratch */
    void (*attn_values)(float *o, const float *w, const float *V, int64_t np, int64_t hdv);
    char errmsg[256];
};

static void attn_values_plain(float *o, const float *w, const float *V, int64_t np, int64_t hdv);
#if defined(__x86_64__) && defined(__GNUC__)
#define ENG_HAVE_AVX2_PATH 1
static void attn_values_avx2(float *o, const float *w, const float *V, int64_t np, int64_t hdv);
#endif

static int cpu_err(struct cpu_backend *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int cpu_err(struct cpu_backend *e, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->errmsg, sizeof e->errmsg, fmt, ap);
    va_end(ap);
    return code;
}

static int cpu_supports(uint32_t type)
{
    const struct moe_type_info *ti = moe_type_get(type);
    return ti && ti->compute;
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

static int load_norm(float *dst, const struct moe_tensor *t, int64_t n, const char *what,
                     int layer, char *err, size_t errlen)
{
    int rc = moe_dequantize(t->type, t->data, dst, n);
    if (rc)
        return moe_fail(err, errlen, rc, "%s (layer %d): cannot dequantize", what, layer);
    return 0;
}

static void cpu_free(struct moe_backend *b);

static int cpu_init(struct moe_backend **out, const struct moe_model *m, struct moe_dims *d,
                    char *err, size_t errlen)
{
    int rc = 0, bad = 0;
    struct cpu_backend *e = calloc(1, sizeof *e);
    if (!e)
        return -ENOMEM;
    e->base.vt = &moe_backend_cpu;
    e->m = m;
    e->d = *d;
    e->E = d->E;
    e->H = d->H;
    e->Hkv = d->Hkv;
    e->hd = d->hd;
    e->hdv = d->hdv;
    e->qdim = d->qdim;
    e->kdim = d->kdim;
    e->vdim = d->vdim;
    e->odim = d->odim;
    e->nexp = d->nexp;
    e->kuse = d->kuse;
    e->ff = d->ff;
    e->V = d->V;
    e->L = d->L;

    size_t per_layer = (size_t)(2 * e->E + 2 * e->hd);
    e->norm_mem = xcalloc(per_layer * (size_t)e->L + (size_t)e->E, sizeof(float), &bad);
    e->norms = xcalloc((size_t)e->L, sizeof *e->norms, &bad);
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

    /* The KV cache is calloc'ed: large allocations come from mmap, so pages are only committed
     * as positions are written. */
    size_t cells = (size_t)e->L * d->n_seq * d->n_ctx;
    e->kc = xcalloc(cells, (size_t)e->kdim * sizeof(float), &bad);
    e->vc = xcalloc(cells, (size_t)e->vdim * sizeof(float), &bad);
    e->routing = xcalloc((size_t)(e->L * e->nexp), sizeof *e->routing, &bad);
    if (d->record_routes)
        e->route_hist = xcalloc((size_t)e->L * d->n_batch * (size_t)e->kuse, sizeof(int32_t), &bad);
    if (bad) {
        rc = moe_fail(err, errlen, -ENOMEM, "engine: cannot allocate the KV cache (%u x %u positions)",
                      d->n_seq, d->n_ctx);
        goto fail;
    }

    rc = moe_pool_init(&e->pool, d->n_threads);
    if (rc) {
        moe_fail(err, errlen, rc, "engine: cannot start threads: %s", moe_strerror(rc));
        goto fail;
    }
    e->nth = moe_pool_size(e->pool);
    e->d.n_threads = d->n_threads = e->nth;
    e->attn_values = attn_values_plain;
#ifdef ENG_HAVE_AVX2_PATH
    if (__builtin_cpu_supports("avx2"))
        e->attn_values = attn_values_avx2;
#endif

    size_t nb = d->n_batch, ns = nb * (size_t)e->kuse;
    int64_t maxrows = e->ff > e->E ? e->ff : e->E;
    int64_t wtmp = e->E;
    for (int bi = 0; bi < MOE_BUF_COUNT; bi++) {
        int64_t w = moe_buf_width(d, (enum moe_buf)bi);
        e->buf[bi] = xcalloc(nb * (size_t)w, sizeof(float), &bad);
        if (w > wtmp)
            wtmp = w;
    }
    e->tmp = xcalloc(nb * (size_t)wtmp, sizeof(float), &bad);
    e->token = xcalloc(nb, sizeof(int32_t), &bad);
    e->pos = xcalloc(nb, sizeof(int32_t), &bad);
    e->seq = xcalloc(nb, sizeof(int32_t), &bad);
    e->out_row = xcalloc(nb, sizeof(int32_t), &bad);
    e->rope_cs = xcalloc(nb * e->hd, sizeof(float), &bad);
    e->sel_slot = xcalloc(ns, sizeof(int32_t), &bad);
    e->slot_tok = xcalloc(ns, sizeof(int32_t), &bad);
    e->ex_off = xcalloc(e->nexp + 1, sizeof(int32_t), &bad);
    e->ex_fill = xcalloc(e->nexp, sizeof(int32_t), &bad);
    if (d->expert_src) {
        e->xv = xcalloc(e->nexp, sizeof *e->xv, &bad);
        e->xtmp = xcalloc(e->nexp, sizeof *e->xtmp, &bad);
        e->xids = xcalloc(e->nexp, sizeof *e->xids, &bad);
        e->xpred = xcalloc(e->nexp, sizeof *e->xpred, &bad);
        e->xmark = xcalloc(e->nexp, 1, &bad);
        e->xsel = xcalloc(e->nexp, 1, &bad);
    }
    e->taken = xcalloc(e->nexp, 1, &bad);
    const char *study = getenv("MOE_CPU_PREDICT_STUDY");
    if (study && !strcmp(study, "1")) {
        e->ps = xcalloc(1, sizeof *e->ps, &bad);
        e->ps_x = xcalloc(e->E, sizeof(float), &bad);
        e->ps_lg = xcalloc(e->nexp, sizeof(float), &bad);
        if (e->ps && moe_pstudy_init(e->ps, (int)e->L, (int)e->nexp, (int)e->kuse)) {
            free(e->ps);
            e->ps = NULL;
            bad = 1;
        }
    }
    e->xg = xcalloc(ns * e->E, sizeof(float), &bad);
    e->act = xcalloc(ns * e->ff, sizeof(float), &bad);
    e->gbuf = xcalloc(ns * e->ff, sizeof(float), &bad);
    e->ubuf = xcalloc(ns * e->ff, sizeof(float), &bad);
    e->dout = xcalloc(ns * e->E, sizeof(float), &bad);
    e->scores = xcalloc((size_t)e->nth * d->n_ctx, sizeof(float), &bad);
    e->xo = xcalloc(nb * e->E, sizeof(float), &bad);
    e->smp = xcalloc(d->n_seq, sizeof *e->smp, &bad);
    e->task = xcalloc(2 * (size_t)e->nexp * (size_t)((maxrows + ENG_EXPERT_ROWS - 1) / ENG_EXPERT_ROWS),
                      sizeof(int32_t), &bad);
    if (bad) {
        rc = moe_fail(err, errlen, -ENOMEM, "engine: cannot allocate scratch for n_batch %u",
                      d->n_batch);
        goto fail;
    }
    *out = &e->base;
    return 0;

fail:
    cpu_free(&e->base);
    return rc;
}

static void cpu_free(struct moe_backend *b)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    if (!e)
        return;
    moe_pool_free(e->pool);
    free(e->route_hist);
    free(e->norm_mem);
    free(e->norms);
    free(e->kc);
    free(e->vc);
    free(e->routing);
    for (int i = 0; i < MOE_BUF_COUNT; i++)
        free(e->buf[i]);
    free(e->tmp);
    free(e->token);
    free(e->pos);
    free(e->seq);
    free(e->out_row);
    free(e->rope_cs);
    free(e->sel_slot);
    free(e->slot_tok);
    free(e->ex_off);
    free(e->ex_fill);
    free(e->xv);
    free(e->xtmp);
    free(e->xids);
    free(e->xpred);
    free(e->xmark);
    free(e->xsel);
    if (e->ps) {
        moe_pstudy_report(e->ps, stderr);
        moe_pstudy_free(e->ps);
        free(e->ps);
    }
    free(e->ps_x);
    free(e->ps_lg);
    free(e->taken);
    free(e->xg);
    free(e->act);
    free(e->gbuf);
    free(e->ubuf);
    free(e->dout);
    free(e->scores);
    free(e->xo);
    free(e->task);
    for (uint32_t i = 0; e->smp && i < e->d.n_seq; i++)
        moe_sampler_free(e->smp[i]);
    free(e->smp);
    for (uint32_t i = 0; e->bias && i < e->d.n_seq; i++) {
        free(e->bias[i].tok);
        free(e->bias[i].val);
    }
    free(e->bias);
    free(e->slog);
    free(e);
}

/* ---------------------------------------------------------------- small math */

/* First cache row of (layer, sequence, kv head); positions follow contiguously. */
static inline size_t kv_row(const struct cpu_backend *e, int l, int32_t seq, int64_t kvh)
{
    return (((size_t)l * e->d.n_seq + (size_t)seq) * (size_t)e->Hkv + (size_t)kvh) * e->d.n_ctx;
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

static void par_for(struct cpu_backend *e, int64_t n_tasks, double macs, moe_pool_task_fn fn,
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

static void par_matmul(struct cpu_backend *e, const struct mm_job *jobs, int n_jobs, int64_t n_tok)
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

/* ---------------------------------------------------------------- ops */

#define BUF(e, id) ((e)->buf[id])

static int cpu_begin(struct moe_backend *b, const struct moe_step *st)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    if (st->n < 1 || st->n > e->d.n_batch || st->n_out < 0 || st->n_out > st->n)
        return cpu_err(e, MOE_ERANGE, "step of %lld tokens, %lld outputs", (long long)st->n,
                       (long long)st->n_out);
    e->n = st->n;
    e->n_out = st->n_out;
    e->sample = st->sample;
    if (st->record && !e->route_hist)
        return cpu_err(e, MOE_ERANGE, "a step records its routing, but record_routes is off");
    e->record = st->record;
    memcpy(e->token, st->token, sizeof(int32_t) * (size_t)st->n);
    memcpy(e->pos, st->pos, sizeof(int32_t) * (size_t)st->n);
    memcpy(e->seq, st->seq, sizeof(int32_t) * (size_t)st->n);
    memcpy(e->rope_cs, st->rope, sizeof(float) * (size_t)(st->n * e->hd));
    if (st->n_out)
        memcpy(e->out_row, st->out_row, sizeof(int32_t) * (size_t)st->n_out);
    e->head_pending = false;
    e->errmsg[0] = 0;
    return 0;
}

static int cpu_embed(struct moe_backend *b, enum moe_buf dst)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    const struct moe_tensor *t = &e->m->token_embd;
    size_t erow = moe_row_bytes(t->type, e->E);
    for (int64_t i = 0; i < e->n; i++) {
        const uint8_t *row = (const uint8_t *)t->data + (size_t)e->token[i] * erow;
        int rc = moe_dequantize(t->type, row, BUF(e, dst) + i * e->E, e->E);
        if (rc)
            return cpu_err(e, rc, "token_embd: cannot dequantize type %u", t->type);
    }
    return 0;
}

struct norm_ctx {
    struct cpu_backend *e;
    const float *w, *src;
    float *dst;
    int64_t width;
};

static void norm_task(void *arg, int64_t t, int ith)
{
    struct norm_ctx *c = arg;
    (void)ith;
    rmsnorm(c->dst + t * c->width, c->src + t * c->width, c->w, c->width, c->e->d.eps);
}

static const float *norm_weight(struct cpu_backend *e, int l, enum moe_wid w)
{
    if (l < 0)
        return w == MOE_W_OUT_NORM ? e->out_norm : NULL;
    switch (w) {
    case MOE_W_ATTN_NORM: return e->norms[l].attn;
    case MOE_W_FFN_NORM: return e->norms[l].ffn;
    default: return NULL;
    }
}

static int cpu_rmsnorm(struct moe_backend *b, int l, enum moe_wid w, enum moe_buf src,
                       enum moe_buf dst)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    const float *nw = norm_weight(e, l, w);
    if (!nw || moe_buf_width(&e->d, src) != e->E || moe_buf_width(&e->d, dst) != e->E)
        return cpu_err(e, MOE_ERANGE, "rmsnorm: bad weight %d or buffers", (int)w);
    struct norm_ctx c = {e, nw, BUF(e, src), BUF(e, dst), e->E};
    par_for(e, e->n, e->n * e->E, norm_task, &c);
    return 0;
}

static int cpu_matmul(struct moe_backend *b, int l, const struct moe_mm *mm, int n_mm,
                      enum moe_buf src, bool accumulate)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    struct mm_job jobs[MM_MAX_JOBS];
    if (n_mm < 1 || n_mm > MM_MAX_JOBS || (accumulate && n_mm != 1))
        return cpu_err(e, MOE_ERANGE, "matmul: %d products", n_mm);
    for (int j = 0; j < n_mm; j++) {
        const struct moe_tensor *W = moe_weight(e->m, l, mm[j].w);
        if (!W || W->ne[0] != moe_buf_width(&e->d, src) ||
            W->ne[1] != moe_buf_width(&e->d, mm[j].dst))
            return cpu_err(e, MOE_ERANGE, "matmul: weight %d of layer %d does not fit", (int)mm[j].w,
                           l);
        jobs[j] = (struct mm_job){W, BUF(e, src), W->ne[0], accumulate ? e->tmp : BUF(e, mm[j].dst),
                                  W->ne[1]};
    }
    par_matmul(e, jobs, n_mm, e->n);
    if (accumulate) {
        float *y = BUF(e, mm[0].dst);
        const float *t = e->tmp;
        int64_t cnt = e->n * jobs[0].ldy;
        for (int64_t i = 0; i < cnt; i++)
            y[i] += t[i];
    }
    return 0;
}

struct fwd {
    struct cpu_backend *e;
    int l;
    const struct moe_expert *xv;  /* the layer's expert views */
};

/* Per-head RMSNorm of q and k, RoPE, and the store of k and v into the cache. */
static void qk_task(void *arg, int64_t t, int ith)
{
    struct fwd *f = arg;
    struct cpu_backend *e = f->e;
    const struct eng_norms *nw = &e->norms[f->l];
    float eps = e->d.eps;
    (void)ith;
    const float *cs = e->rope_cs + t * e->hd;
    float *q = BUF(e, MOE_BUF_Q) + t * e->qdim, *k = BUF(e, MOE_BUF_K) + t * e->kdim;
    for (int64_t h = 0; h < e->H; h++) {
        rmsnorm(q + h * e->hd, q + h * e->hd, nw->q, e->hd, eps);
        rope(q + h * e->hd, cs, e->hd);
    }
    for (int64_t h = 0; h < e->Hkv; h++) {
        rmsnorm(k + h * e->hd, k + h * e->hd, nw->k, e->hd, eps);
        rope(k + h * e->hd, cs, e->hd);
    }
    for (int64_t h = 0; h < e->Hkv; h++) {
        size_t row = kv_row(e, f->l, e->seq[t], h) + (size_t)e->pos[t];
        memcpy(e->kc + row * e->hd, k + h * e->hd, sizeof(float) * e->hd);
        memcpy(e->vc + row * e->hdv, BUF(e, MOE_BUF_V) + t * e->vdim + h * e->hdv,
               sizeof(float) * e->hdv);
    }
}

static int cpu_qk_rope_kv(struct moe_backend *b, int l)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    struct fwd f = {e, l, NULL};
    par_for(e, e->n, e->n * (e->qdim + e->kdim) * 4, qk_task, &f);
    return 0;
}

/* Causal attention, one (token, head) pair per task. Scores are a matrix-vector product over the
 * head's contiguous K rows (the kernels' SIMD F32 path); values are summed with attn_values. */
static void attn_task(void *arg, int64_t task, int ith)
{
    struct fwd *f = arg;
    struct cpu_backend *e = f->e;
    float *sc = e->scores + (size_t)ith * e->d.n_ctx;
    const int64_t group = e->H / e->Hkv;
    const float scale = (float)(1.0 / sqrt((double)e->hd));
    int64_t t = task / e->H, h = task % e->H, kvh = h / group;
    int64_t np = (int64_t)e->pos[t] + 1;
    size_t row = kv_row(e, f->l, e->seq[t], kvh);
    const float *q = BUF(e, MOE_BUF_Q) + t * e->qdim + h * e->hd;
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
    e->attn_values(BUF(e, MOE_BUF_ATT) + t * e->odim + h * e->hdv, sc, e->vc + row * e->hdv, np,
                   e->hdv);
}

static int cpu_attention(struct moe_backend *b, int l)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    struct fwd f = {e, l, NULL};
    double macs = 0;
    for (int64_t t = 0; t < e->n; t++)
        macs += (double)e->pos[t] + 1;
    macs *= (double)e->H * (double)(e->hd + e->hdv);
    par_for(e, e->n * e->H, macs, attn_task, &f);
    return 0;
}

/* Router: softmax over all experts, top-k (lowest index wins ties), optional renormalisation,
 * then slots grouped by expert. Serial: n * n_expert work, tiny next to the matrix products. */
static int cpu_route(struct moe_backend *b, int l)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    const int64_t n = e->n, K = e->kuse, NE = e->nexp;
    uint64_t *counts = e->routing + (size_t)l * NE;
    int32_t *sel_e = (int32_t *)BUF(e, MOE_BUF_SEL_E);
    float *sel_w = BUF(e, MOE_BUF_SEL_W);
    memset(e->ex_fill, 0, sizeof(int32_t) * NE);
    for (int64_t t = 0; t < n; t++) {
        float *r = BUF(e, MOE_BUF_RL) + t * NE;
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
        int32_t *se = sel_e + t * K;
        float *sw = sel_w + t * K;
        double sum = 0.0;
        /* NaN probabilities never win, but a choice is always made. */
        moe_topk_argmax(r, NE, K, e->taken, se);
        for (int64_t j = 0; j < K; j++) {
            sw[j] = r[se[j]];
            sum += r[se[j]];
            e->ex_fill[se[j]]++;
            counts[se[j]]++;
        }
        if (e->d.norm_topk && sum > 0.0)
            for (int64_t j = 0; j < K; j++)
                sw[j] = (float)(sw[j] / sum);
    }
    if (e->ps && n == 1)
        moe_pstudy_actual(e->ps, l, sel_e);
    e->ex_off[0] = 0;
    for (int64_t x = 0; x < NE; x++) {
        e->ex_off[x + 1] = e->ex_off[x] + e->ex_fill[x];
        e->ex_fill[x] = 0;
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t j = 0; j < K; j++) {
            int32_t x = sel_e[t * K + j];
            int32_t s = e->ex_off[x] + e->ex_fill[x]++;
            e->slot_tok[s] = (int32_t)t;
            e->sel_slot[t * K + j] = s;
        }
    if (e->record)
        memcpy(e->route_hist + (size_t)l * (size_t)(n * K), sel_e, sizeof(int32_t) * (size_t)(n * K));
    return 0;
}

/* Copies each token's normed input into its expert slots. */
static void gather_task(void *arg, int64_t s, int ith)
{
    struct fwd *f = arg;
    struct cpu_backend *e = f->e;
    (void)ith;
    memcpy(e->xg + s * e->E, BUF(e, MOE_BUF_X) + (int64_t)e->slot_tok[s] * e->E,
           sizeof(float) * e->E);
}

/* Expert tasks: e->task holds (expert, first row) pairs. Gate and up for rows [r0, r0+R) of one
 * expert, for all of its tokens, followed by the SwiGLU of exactly those rows. */
static void expert_up_task(void *arg, int64_t i, int ith)
{
    struct fwd *f = arg;
    struct cpu_backend *e = f->e;
    (void)ith;
    int x = e->task[2 * i];
    int64_t r0 = e->task[2 * i + 1];
    int64_t r1 = r0 + ENG_EXPERT_ROWS < e->ff ? r0 + ENG_EXPERT_ROWS : e->ff;
    const struct moe_expert *ex = &f->xv[x];
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
    struct cpu_backend *e = f->e;
    (void)ith;
    int x = e->task[2 * i];
    int64_t r0 = e->task[2 * i + 1];
    int64_t r1 = r0 + ENG_EXPERT_ROWS < e->E ? r0 + ENG_EXPERT_ROWS : e->E;
    const struct moe_expert *ex = &f->xv[x];
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
    struct cpu_backend *e = f->e;
    (void)ith;
    float *h = BUF(e, MOE_BUF_H) + t * e->E, *acc = e->tmp + t * e->E;
    const float *sel_w = BUF(e, MOE_BUF_SEL_W);
    for (int64_t i = 0; i < e->E; i++)
        acc[i] = 0.0f;
    for (int64_t j = 0; j < e->kuse; j++) {
        float w = sel_w[t * e->kuse + j];
        const float *d = e->dout + (int64_t)e->sel_slot[t * e->kuse + j] * e->E;
        for (int64_t i = 0; i < e->E; i++)
            acc[i] += w * d[i];
    }
    for (int64_t i = 0; i < e->E; i++)
        h[i] += acc[i];
}

/* Tasks for the experts with tokens (and, with sel, only those marked in it). */
static int make_tasks(struct cpu_backend *e, int64_t rows, const uint8_t *sel)
{
    int nt = 0;
    for (int64_t x = 0; x < e->nexp; x++) {
        if (e->ex_off[x + 1] == e->ex_off[x] || (sel && !sel[x]))
            continue;
        for (int64_t r = 0; r < rows; r += ENG_EXPERT_ROWS) {
            e->task[2 * nt] = (int32_t)x;
            e->task[2 * nt + 1] = (int32_t)r;
            nt++;
        }
    }
    return nt;
}

/* The experts layer l+1 will probably choose: its router applied to layer l's normed input
 * (the residual stream changes little from one layer to the next), top-k per token. The router
 * logits buffer is free again once route(l) has run. Handed to the source to read ahead. */
static void predict_next(struct cpu_backend *e, int l)
{
    static const struct moe_mm router = {MOE_W_ROUTER, MOE_BUF_RL};
    if (cpu_matmul(&e->base, l + 1, &router, 1, MOE_BUF_X, false))
        return;
    int nx = 0;
    for (int64_t t = 0; t < e->n; t++) {
        const float *r = BUF(e, MOE_BUF_RL) + t * e->nexp;
        int32_t pick[64];
        int64_t k = e->kuse < 64 ? e->kuse : 64;
        moe_topk_argmax(r, e->nexp, k, e->taken, pick);
        for (int64_t j = 0; j < k; j++) {
            if (!e->xmark[pick[j]]) {
                e->xmark[pick[j]] = 1;
                e->xpred[nx++] = (int32_t)pick[j];
            }
        }
    }
    for (int i = 0; i < nx; i++)
        e->xmark[e->xpred[i]] = 0;
    e->d.expert_src->prefetch(e->d.expert_src->user, l + 1, e->xpred, nx);
}

/* Experts from a source whose views move: the chosen experts in parts of at most max_pinned,
 * each part acquired, computed and released; the combine runs once all parts are done, so the
 * sums are the same as in one pass. */
static int experts_from_source(struct cpu_backend *e, struct fwd *f)
{
    const struct moe_expert_src *src = e->d.expert_src;
    int nx = 0;
    for (int64_t x = 0; x < e->nexp; x++)
        if (e->ex_off[x + 1] > e->ex_off[x])
            e->xids[nx++] = (int32_t)x;
    double macs = 1.0 * e->n * e->kuse * e->E * e->ff;
    for (int at = 0; at < nx; at += src->max_pinned) {
        int np = nx - at < src->max_pinned ? nx - at : src->max_pinned;
        int rc = src->acquire(src->user, f->l, e->xids + at, np, e->xtmp, e->errmsg,
                              sizeof e->errmsg);
        if (rc)
            return rc;
        for (int i = 0; i < np; i++) {
            e->xv[e->xids[at + i]] = e->xtmp[i];
            e->xsel[e->xids[at + i]] = 1;
        }
        f->xv = e->xv;
        /* Read-ahead for the next layer once this layer's first part is pinned. */
        if (at == 0 && src->prefetch && f->l + 1 < e->L)
            predict_next(e, f->l);
        par_for(e, make_tasks(e, e->ff, e->xsel), 2.0 * macs, expert_up_task, f);
        par_for(e, make_tasks(e, e->E, e->xsel), macs, expert_down_task, f);
        for (int i = 0; i < np; i++)
            e->xsel[e->xids[at + i]] = 0;
        src->release(src->user, f->l, e->xids + at, np);
    }
    return 0;
}

/* MOE_CPU_PREDICT_STUDY: layer l's router over the row x (logits into e->ps_lg), by the
 * matmul the router op uses. */
static void ps_logits(struct cpu_backend *e, int l, const float *x)
{
    const struct moe_tensor *W = moe_weight(e->m, l, MOE_W_ROUTER);
    const struct mm_job job = {W, x, e->E, e->ps_lg, e->nexp};
    par_matmul(e, &job, 1, 1);
}

/* MOE_CPU_PREDICT_STUDY: x re-weighted for layer t's norm, x·(g_t / g_l), into e->ps_x; 0 where
 * g_l is 0 (x is 0 there too), as the GPU prefetch's scale has it. */
static void ps_reweight(struct cpu_backend *e, const float *x, const float *gl, const float *gt)
{
    for (int64_t i = 0; i < e->E; i++)
        e->ps_x[i] = gl[i] != 0.0f ? x[i] * (gt[i] / gl[i]) : 0.0f;
}

/* MOE_CPU_PREDICT_STUDY, one-token steps: layer l+1's experts guessed from layer l's MoE input
 * (before = true: as is and re-weighted by the norms, and layer l+2's re-weighted) or from the
 * residual after layer l's experts (before = false). */
static void ps_guess(struct cpu_backend *e, int l, bool before)
{
    if (!e->ps || e->n != 1 || l + 1 >= e->L)
        return;
    const float *g0 = e->norms[l].ffn, *g1 = e->norms[l + 1].ffn;
    if (before) {
        const float *x = BUF(e, MOE_BUF_X);
        ps_logits(e, l + 1, x);
        moe_pstudy_predict(e->ps, l + 1, MOE_PS_X, e->ps_lg);
        if (l + 2 < e->L) {
            ps_reweight(e, x, g0, e->norms[l + 2].ffn);
            ps_logits(e, l + 2, e->ps_x);
            moe_pstudy_predict(e->ps, l + 2, MOE_PS_XW2, e->ps_lg);
        }
        ps_reweight(e, x, g0, g1);
    } else {
        rmsnorm(e->ps_x, BUF(e, MOE_BUF_H), g1, e->E, e->d.eps);
    }
    ps_logits(e, l + 1, e->ps_x);
    moe_pstudy_predict(e->ps, l + 1, before ? MOE_PS_XW : MOE_PS_POST, e->ps_lg);
}

static int cpu_experts(struct moe_backend *b, int l)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    struct fwd f = {e, l, e->m->layers[l].experts};
    int64_t n = e->n;
    ps_guess(e, l, true);
    par_for(e, n * e->kuse, n * e->kuse * e->E / 4, gather_task, &f);
    if (e->d.expert_src) {
        int rc = experts_from_source(e, &f);
        if (rc)
            return rc;
    } else {
        par_for(e, make_tasks(e, e->ff, NULL), 2.0 * n * e->kuse * e->E * e->ff, expert_up_task,
                &f);
        par_for(e, make_tasks(e, e->E, NULL), 1.0 * n * e->kuse * e->E * e->ff, expert_down_task,
                &f);
    }
    par_for(e, n, n * e->kuse * e->E, combine_task, &f);
    ps_guess(e, l, false);
    return 0;
}

struct head_ctx {
    struct cpu_backend *e;
};

static void head_norm_task(void *arg, int64_t i, int ith)
{
    struct head_ctx *c = arg;
    struct cpu_backend *e = c->e;
    (void)ith;
    rmsnorm(e->xo + i * e->E, BUF(e, MOE_BUF_H) + (int64_t)e->out_row[i] * e->E, e->out_norm,
            e->E, e->d.eps);
}

/* The normed rows now; the output product in end(), straight into the caller's array. */
static int cpu_head(struct moe_backend *b)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    if (e->n_out == 0)
        return 0;
    struct head_ctx hc = {e};
    par_for(e, e->n_out, e->n_out * e->E, head_norm_task, &hc);
    e->head_pending = true;
    return 0;
}

static int cpu_end(struct moe_backend *b, float *out, int32_t *tokens)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    if (!e->head_pending)
        return 0;
    e->head_pending = false;
    if (!e->sample) {
        if (!out)
            return cpu_err(e, MOE_ERANGE, "end: %lld logit rows but no output array",
                           (long long)e->n_out);
        struct mm_job head = {&e->m->output, e->xo, e->E, out, e->V};
        par_matmul(e, &head, 1, e->n_out);
        return 0;
    }
    /* Sampling: the logits go to scratch (one row per sequence at most) and are drawn from by
     * the sequence's sampler (its penalties apply to a copy); the token joins its history. */
    if (!tokens || e->n_out > e->d.n_seq)
        return cpu_err(e, MOE_ERANGE, "end: sampling %lld rows", (long long)e->n_out);
    if (!e->slog && !(e->slog = malloc(sizeof(float) * (size_t)e->d.n_seq * (size_t)e->V)))
        return cpu_err(e, -ENOMEM, "out of memory for sampled logits");
    struct mm_job head = {&e->m->output, e->xo, e->E, e->slog, e->V};
    par_matmul(e, &head, 1, e->n_out);
    for (int64_t i = 0; i < e->n_out; i++) {
        float *lg = e->slog + i * e->V;
        if (out)
            memcpy(out + i * e->V, lg, sizeof(float) * (size_t)e->V);
        struct moe_sampler *sm = e->smp[e->seq[e->out_row[i]]];
        if (!sm)
            return cpu_err(e, MOE_ERANGE, "sequence %d has no sampler", e->seq[e->out_row[i]]);
        const struct cpu_bias *bs = e->bias ? &e->bias[e->seq[e->out_row[i]]] : NULL;
        for (size_t k = 0; bs && k < bs->n; k++)
            lg[bs->tok[k]] += bs->val[k];
        tokens[i] = moe_sampler_sample(sm, lg);
        if (tokens[i] >= 0)
            moe_sampler_accept(sm, tokens[i]);
    }
    return 0;
}

static int cpu_sampler(struct moe_backend *b, int32_t seq, const struct moe_sampler_params *p,
                       const int32_t *history, size_t n_history)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    if (seq < 0 || (uint32_t)seq >= e->d.n_seq)
        return cpu_err(e, MOE_ERANGE, "sampler: sequence %d", seq);
    struct moe_sampler *sm = NULL;
    int rc = moe_sampler_init(&sm, p, (uint32_t)e->V, e->errmsg, sizeof e->errmsg);
    if (rc)
        return rc;
    for (size_t i = 0; i < n_history; i++)
        moe_sampler_accept(sm, history[i]);
    moe_sampler_free(e->smp[seq]);
    e->smp[seq] = sm;
    return 0;
}

static int cpu_bias(struct moe_backend *b, int32_t seq, const int32_t *tok, const float *val,
                    size_t n)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    if (seq < 0 || (uint32_t)seq >= e->d.n_seq || n > MOE_BACKEND_MAX_BIAS)
        return cpu_err(e, MOE_ERANGE, "bias: sequence %d, %zu entries", seq, n);
    if (!e->bias && !(e->bias = calloc(e->d.n_seq, sizeof *e->bias)))
        return cpu_err(e, -ENOMEM, "out of memory for a logit bias");
    struct cpu_bias *bs = &e->bias[seq];
    int32_t *t = n ? malloc(sizeof *t * n) : NULL;
    float *v = n ? malloc(sizeof *v * n) : NULL;
    if (n && (!t || !v)) {
        free(t);
        free(v);
        return cpu_err(e, -ENOMEM, "out of memory for a logit bias");
    }
    for (size_t i = 0; i < n; i++) {
        if (tok[i] < 0 || tok[i] >= e->V) {
            free(t);
            free(v);
            return cpu_err(e, MOE_ERANGE, "bias: token %d", tok[i]);
        }
        t[i] = tok[i];
        v[i] = val[i];
    }
    free(bs->tok);
    free(bs->val);
    bs->tok = t;
    bs->val = v;
    bs->n = n;
    return 0;
}

static int cpu_kv_copy(struct moe_backend *b, int32_t src, int32_t dst, uint32_t n)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    if (src < 0 || dst < 0 || (uint32_t)src >= e->d.n_seq || (uint32_t)dst >= e->d.n_seq ||
        n > e->d.n_ctx)
        return cpu_err(e, MOE_ERANGE, "kv copy: sequences %d -> %d, %u positions", src, dst, n);
    if (src == dst || n == 0)
        return 0;
    for (int l = 0; l < (int)e->L; l++)
        for (int64_t h = 0; h < e->Hkv; h++) {
            memcpy(e->kc + kv_row(e, l, dst, h) * (size_t)e->hd,
                   e->kc + kv_row(e, l, src, h) * (size_t)e->hd, sizeof(float) * n * (size_t)e->hd);
            memcpy(e->vc + kv_row(e, l, dst, h) * (size_t)e->hdv,
                   e->vc + kv_row(e, l, src, h) * (size_t)e->hdv,
                   sizeof(float) * n * (size_t)e->hdv);
        }
    return 0;
}

static int cpu_routing_counts(struct moe_backend *b, uint64_t *dst)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    memcpy(dst, e->routing, sizeof(uint64_t) * (size_t)(e->L * e->nexp));
    return 0;
}

static int cpu_route_record(struct moe_backend *b, int32_t *dst)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    if (!e->record)
        return cpu_err(e, MOE_ERANGE, "route_record: the last step did not record");
    memcpy(dst, e->route_hist, sizeof(int32_t) * (size_t)(e->L * e->n * e->kuse));
    return 0;
}

static int cpu_read_buf(struct moe_backend *b, enum moe_buf buf, int64_t n, void *dst)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    if ((int)buf < 0 || buf >= MOE_BUF_COUNT || n < 0 || n > e->d.n_batch)
        return cpu_err(e, MOE_ERANGE, "read_buf: bad buffer or row count");
    memcpy(dst, BUF(e, buf), sizeof(float) * (size_t)(n * moe_buf_width(&e->d, buf)));
    return 0;
}

static int cpu_write_buf(struct moe_backend *b, enum moe_buf buf, int64_t n, const void *src)
{
    struct cpu_backend *e = (struct cpu_backend *)b;
    if ((int)buf < 0 || buf >= MOE_BUF_COUNT || n < 0 || n > e->d.n_batch)
        return cpu_err(e, MOE_ERANGE, "write_buf: bad buffer or row count");
    memcpy(BUF(e, buf), src, sizeof(float) * (size_t)(n * moe_buf_width(&e->d, buf)));
    return 0;
}

static const char *cpu_errmsg(const struct moe_backend *b)
{
    return ((const struct cpu_backend *)b)->errmsg;
}

static void cpu_info(const struct moe_backend *b, uint64_t *device_bytes, char *desc, size_t len)
{
    const struct cpu_backend *e = (const struct cpu_backend *)b;
    *device_bytes = 0;
    snprintf(desc, len, "cpu, %d threads%s", e->nth,
             moe_kernels_simd() ? ", AVX2+FMA+F16C" : ", portable kernels");
}

const struct moe_backend_vt moe_backend_cpu = {
    .name = "cpu",
    .supports = cpu_supports,
    .init = cpu_init,
    .free = cpu_free,
    .begin = cpu_begin,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .qk_rope_kv = cpu_qk_rope_kv,
    .attention = cpu_attention,
    .route = cpu_route,
    .experts = cpu_experts,
    .head = cpu_head,
    .end = cpu_end,
    .sampler = cpu_sampler,
    .bias = cpu_bias,
    .kv_copy = cpu_kv_copy,
    .routing_counts = cpu_routing_counts,
    .read_buf = cpu_read_buf,
    .write_buf = cpu_write_buf,
    .errmsg = cpu_errmsg,
    .info = cpu_info,
    .route_record = cpu_route_record,
};

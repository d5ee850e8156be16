/* The engine (see engine.h): backend-neutral parts of the forward pass.
 *
 * Here: options and their defaults, the model's shape checks against what the chosen backend
 * can compute, batch validation, the bookkeeping of each sequence's positions, the split of a
 * batch into steps of at most n_batch tokens, and the RoPE angles of each step (computed here
 * once, in double, so every backend reads the same floats). The layer loop is in qwen3moe.c, the
 * compute in the backends (backend.h). */
#include "worker/engine.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/ggml_type.h"
#include "worker/backend.h"

#define ENG_DEFAULT_CTX 4096
#define ENG_DEFAULT_BATCH 512

struct moe_engine {
    const struct moe_model *m;
    struct moe_engine_opts o;
    struct moe_dims d;
    struct moe_backend *b;
    char device[32];              /* resolved: "cpu", "cuda:0" */
    double *inv_freq;             /* [head_dim/2] base^(-2i/hd) */
    int32_t *filled;              /* [n_seq] positions 0..filled-1 are valid */
    float *rope;                  /* [n_batch][hd/2][2] */
    int32_t *out_row;             /* [n_batch] */
    int32_t *fill;                /* [n_seq] validation scratch */
    uint8_t *has_sampler;         /* [n_seq] */
    uint8_t *seen;                /* [n_seq] validation scratch */
    int32_t *route_sel;           /* [L][n_batch][kuse] a recorded step's choices (record_routes) */
    /* MOE_ENGINE_TOKEN_NEXT: each backend step gets a number (gen); a sequence whose row the
     * step numbered last_gen[seq] sampled: that row's index among the step's sampled rows, its
     * position, and its token once known (last_known). Valid while last_gen[seq] == gen. */
    uint64_t gen;
    uint64_t *last_gen;           /* [n_seq] */
    int32_t *last_row, *last_pos, *last_tok; /* [n_seq] */
    uint8_t *last_known;          /* [n_seq] */
    int32_t *tok_in, *prev_in;    /* [n_batch] a step's resolved tokens, its prev (backend.h) */
    /* Decode ahead: queued steps, oldest at q_head; a step the backend queued (q_dev) or one
     * that ran here, whose tokens are in q_tok. */
    int q_head, q_len;
    struct eng_queued {
        uint64_t gen;
        uint32_t n_out;
        bool dev;
        int32_t *tok;             /* [n_batch] */
    } q[MOE_ENGINE_AHEAD];
    char errmsg[256];
};

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

static int check_tensor(const struct moe_backend_vt *vt, const struct moe_tensor *t, int64_t ne0,
                        int64_t ne1, const char *what, int layer, char *err, size_t errlen)
{
    char name[64];
    if (layer >= 0)
        snprintf(name, sizeof name, "blk.%d.%s", layer, what);
    else
        snprintf(name, sizeof name, "%s", what);
    if (!t->data)
        return moe_fail(err, errlen, MOE_ENOTFOUND, "%s: no data", name);
    const struct moe_type_info *ti = moe_type_get(t->type);
    if (!ti || !ti->compute || !vt->supports(t->type))
        return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                        "%s: type %s is not supported by the %s backend", name,
                        ti ? ti->name : "?", vt->name);
    if (t->ne[0] != ne0 || t->ne[1] != ne1)
        return moe_fail(err, errlen, MOE_EFORMAT, "%s: shape {%lld, %lld}, expected {%lld, %lld}",
                        name, (long long)t->ne[0], (long long)t->ne[1], (long long)ne0,
                        (long long)ne1);
    if (ne0 % ti->blck != 0)
        return moe_fail(err, errlen, MOE_EFORMAT, "%s: row of %lld is not a multiple of %u", name,
                        (long long)ne0, ti->blck);
    return 0;
}

/* Shapes: model.c checks them too, but the backends index with them, so the engine checks what
 * they rely on, and that the backend computes every type. */
static int check_model(const struct moe_backend_vt *vt, const struct moe_model *m,
                       const struct moe_dims *d, char *err, size_t errlen)
{
    int rc;
    if ((rc = check_tensor(vt, &m->token_embd, d->E, d->V, "token_embd", -1, err, errlen)) ||
        (rc = check_tensor(vt, &m->output, d->E, d->V, "output", -1, err, errlen)) ||
        (rc = check_tensor(vt, &m->output_norm, d->E, 1, "output_norm", -1, err, errlen)))
        return rc;
    for (int l = 0; l < (int)d->L; l++) {
        const struct moe_layer *ly = &m->layers[l];
        if ((rc = check_tensor(vt, &ly->attn_norm, d->E, 1, "attn_norm", l, err, errlen)) ||
            (rc = check_tensor(vt, &ly->ffn_norm, d->E, 1, "ffn_norm", l, err, errlen)) ||
            (rc = check_tensor(vt, &ly->attn_q_norm, d->hd, 1, "attn_q_norm", l, err, errlen)) ||
            (rc = check_tensor(vt, &ly->attn_k_norm, d->hd, 1, "attn_k_norm", l, err, errlen)) ||
            (rc = check_tensor(vt, &ly->attn_q, d->E, d->qdim, "attn_q", l, err, errlen)) ||
            (rc = check_tensor(vt, &ly->attn_k, d->E, d->kdim, "attn_k", l, err, errlen)) ||
            (rc = check_tensor(vt, &ly->attn_v, d->E, d->vdim, "attn_v", l, err, errlen)) ||
            (rc = check_tensor(vt, &ly->attn_output, d->odim, d->E, "attn_output", l, err,
                               errlen)) ||
            (rc = check_tensor(vt, &ly->ffn_gate_inp, d->E, d->nexp, "ffn_gate_inp", l, err,
                               errlen)))
            return rc;
        if (!ly->experts)
            return moe_fail(err, errlen, MOE_ENOTFOUND, "blk.%d: no expert views", l);
        for (int x = 0; x < (int)d->nexp; x++) {
            const struct moe_expert *ex = &ly->experts[x];
            if ((rc = check_tensor(vt, &ex->gate, d->E, d->ff, "ffn_gate_exps", l, err, errlen)) ||
                (rc = check_tensor(vt, &ex->up, d->E, d->ff, "ffn_up_exps", l, err, errlen)) ||
                (rc = check_tensor(vt, &ex->down, d->ff, d->E, "ffn_down_exps", l, err, errlen)))
                return rc;
        }
    }
    return 0;
}

/* "cpu" or "cuda[:K]" to a backend and device index. */
static int pick_backend(const char *dev, const struct moe_backend_vt **vt, int *index, char *err,
                        size_t errlen)
{
    if (!dev || !*dev || !strcmp(dev, "cpu")) {
        *vt = &moe_backend_cpu;
        *index = 0;
        return 0;
    }
    if (!strncmp(dev, "cuda", 4) && (dev[4] == 0 || dev[4] == ':')) {
        long k = 0;
        if (dev[4] == ':') {
            char *end;
            errno = 0;
            k = strtol(dev + 5, &end, 10);
            if (errno || end == dev + 5 || *end || k < 0 || k > 255)
                return moe_fail(err, errlen, MOE_ERANGE, "device '%s': expected cuda:K", dev);
        }
#ifdef MOE_HAVE_CUDA
        *vt = &moe_backend_cuda;
        *index = (int)k;
        return 0;
#else
        return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                        "device '%s': this build has no CUDA backend (built without nvcc)", dev);
#endif
    }
    return moe_fail(err, errlen, MOE_ERANGE, "device '%s': expected cpu or cuda:K", dev);
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

    const struct moe_backend_vt *vt = NULL;
    int dev_index = 0;
    if ((rc = pick_backend(o->device, &vt, &dev_index, err, errlen)))
        return rc;

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
    if (vt == &moe_backend_cpu)
        snprintf(e->device, sizeof e->device, "cpu");
    else
        snprintf(e->device, sizeof e->device, "cuda:%d", dev_index);
    e->o.device = e->device;

    struct moe_dims *d = &e->d;
    d->E = hp->n_embd;
    d->H = hp->n_head;
    d->Hkv = hp->n_head_kv;
    d->hd = hp->head_dim;
    d->hdv = hp->head_dim_v;
    d->qdim = d->H * d->hd;
    d->kdim = d->Hkv * d->hd;
    d->vdim = d->Hkv * d->hdv;
    d->odim = d->H * d->hdv;
    d->nexp = hp->n_expert;
    d->kuse = hp->n_expert_used;
    d->ff = hp->expert_ff;
    d->V = hp->n_vocab;
    d->L = hp->n_layer;
    d->eps = hp->rms_eps;
    d->norm_topk = hp->norm_topk;
    d->n_ctx = e->o.n_ctx;
    d->n_seq = e->o.n_seq;
    d->n_batch = e->o.n_batch;
    d->n_threads = o->n_threads;
    d->device = dev_index;
    d->kv_f32 = o->kv_f32;
    d->vram_budget = o->vram_budget;
    d->expert_residency = o->expert_residency;
    d->cache_slots = o->cache_slots;
    d->expert_counts = o->expert_counts;
    d->host_register = o->host_register;
    d->no_prefetch = o->no_prefetch;
    d->expert_src = o->expert_src;
    d->record_routes = o->record_routes;
    if (o->record_routes && !vt->route_record) {
        rc = moe_fail(err, errlen, MOE_EUNSUPPORTED,
                      "engine: the %s backend cannot record routing signatures", vt->name);
        goto fail;
    }
    if (!(o->expert_residency >= 0.0 && o->expert_residency <= 1.0) || o->cache_slots < -1 ||
        (int64_t)o->cache_slots > d->nexp) {
        rc = moe_fail(err, errlen, MOE_ERANGE,
                      "engine: expert residency %g outside (0, 1] or cache slots %d outside "
                      "-1..%lld", o->expert_residency, o->cache_slots, (long long)d->nexp);
        goto fail;
    }
    if (o->expert_src && (o->expert_src->max_pinned < 1 || !o->expert_src->acquire ||
                          !o->expert_src->release ||
                          (vt != &moe_backend_cpu &&
                           (!o->expert_src->pin || !o->expert_src->unpin ||
                            !o->expert_src->slots_base || !o->expert_src->part_off)))) {
        rc = moe_fail(err, errlen, MOE_EUNSUPPORTED,
                      "engine: experts from a tiered store need the CPU backend or a pool of "
                      "slots the device can read (got %s)", e->device);
        goto fail;
    }
    if ((o->vram_budget || o->expert_residency > 0.0) && !vt->offload_stats) {
        rc = moe_fail(err, errlen, MOE_EUNSUPPORTED,
                      "engine: a VRAM budget or expert residency needs a CUDA device (got %s)",
                      e->device);
        goto fail;
    }

    if ((rc = check_model(vt, m, d, err, errlen)))
        goto fail;

    e->inv_freq = calloc((size_t)d->hd / 2, sizeof(double));
    e->filled = calloc(e->o.n_seq, sizeof *e->filled);
    e->fill = calloc(e->o.n_seq, sizeof *e->fill);
    e->rope = calloc((size_t)e->o.n_batch * (size_t)d->hd, sizeof(float));
    e->out_row = calloc(e->o.n_batch, sizeof *e->out_row);
    e->has_sampler = calloc(e->o.n_seq, 1);
    e->seen = calloc(e->o.n_seq, 1);
    e->last_gen = calloc(e->o.n_seq, sizeof *e->last_gen);
    e->last_row = calloc(e->o.n_seq, sizeof *e->last_row);
    e->last_pos = calloc(e->o.n_seq, sizeof *e->last_pos);
    e->last_tok = calloc(e->o.n_seq, sizeof *e->last_tok);
    e->last_known = calloc(e->o.n_seq, 1);
    e->tok_in = calloc(e->o.n_batch, sizeof *e->tok_in);
    e->prev_in = calloc(e->o.n_batch, sizeof *e->prev_in);
    bool q_ok = true;
    for (int i = 0; i < MOE_ENGINE_AHEAD; i++)
        q_ok &= (e->q[i].tok = calloc(e->o.n_batch, sizeof *e->q[i].tok)) != NULL;
    if (o->record_routes)
        e->route_sel = calloc((size_t)d->L * e->o.n_batch * (size_t)d->kuse, sizeof *e->route_sel);
    if (!e->inv_freq || !e->filled || !e->fill || !e->rope || !e->out_row || !e->has_sampler ||
        !e->seen || !e->last_gen || !e->last_row || !e->last_pos || !e->last_tok ||
        !e->last_known || !e->tok_in || !e->prev_in || !q_ok ||
        (o->record_routes && !e->route_sel)) {
        rc = -ENOMEM;
        goto fail;
    }
    for (int64_t i = 0; i < d->hd / 2; i++)
        e->inv_freq[i] = pow((double)hp->rope_base, -2.0 * (double)i / (double)d->hd);

    if ((rc = vt->init(&e->b, m, d, err, errlen)))
        goto fail;
    d->expert_counts = e->o.expert_counts = NULL; /* read by init only */
    e->o.n_threads = d->n_threads;
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
    if (e->b)
        e->b->vt->free(e->b);
    free(e->inv_freq);
    free(e->filled);
    free(e->fill);
    free(e->rope);
    free(e->out_row);
    free(e->has_sampler);
    free(e->seen);
    free(e->route_sel);
    free(e->last_gen);
    free(e->last_row);
    free(e->last_pos);
    free(e->last_tok);
    free(e->last_known);
    free(e->tok_in);
    free(e->prev_in);
    for (int i = 0; i < MOE_ENGINE_AHEAD; i++)
        free(e->q[i].tok);
    free(e);
}

int moe_engine_seq_sampler(struct moe_engine *e, int32_t seq, const struct moe_sampler_params *p,
                           const int32_t *history, size_t n_history)
{
    if (seq < 0 || (uint32_t)seq >= e->o.n_seq)
        return eng_err(e, MOE_ERANGE, "sampler: sequence %d outside 0..%u", seq, e->o.n_seq - 1);
    if (e->q_len)
        return eng_err(e, MOE_ERANGE, "sampler: %d queued steps are not collected", e->q_len);
    e->last_gen[seq] = 0;
    int rc = e->b->vt->sampler(e->b, seq, p, history, n_history);
    if (!rc && e->b->vt->bias)
        rc = e->b->vt->bias(e->b, seq, NULL, NULL, 0);
    if (rc)
        return eng_err(e, rc, "sampler: %s", e->b->vt->errmsg(e->b));
    e->has_sampler[seq] = 1;
    return 0;
}

static int cmp_i32(const void *a, const void *b)
{
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int moe_engine_seq_bias(struct moe_engine *e, int32_t seq, const int32_t *tok, const float *val,
                        size_t n)
{
    _Static_assert(MOE_ENGINE_MAX_BIAS <= MOE_BACKEND_MAX_BIAS, "the backends hold the list");
    if (seq < 0 || (uint32_t)seq >= e->o.n_seq)
        return eng_err(e, MOE_ERANGE, "bias: sequence %d outside 0..%u", seq, e->o.n_seq - 1);
    if (!e->b->vt->bias)
        return eng_err(e, MOE_EUNSUPPORTED, "bias: the %s backend samples without one",
                       e->b->vt->name);
    if (e->q_len)
        return eng_err(e, MOE_ERANGE, "bias: %d queued steps are not collected", e->q_len);
    if (n > MOE_ENGINE_MAX_BIAS || (n && (!tok || !val)))
        return eng_err(e, MOE_ERANGE, "bias: %zu entries (at most %d)", n, MOE_ENGINE_MAX_BIAS);
    for (size_t i = 0; i < n; i++)
        if (tok[i] < 0 || (int64_t)tok[i] >= e->d.V || !isfinite(val[i]))
            return eng_err(e, MOE_ERANGE, "bias[%zu]: token %d (n_vocab %lld), value %g", i,
                           tok[i], (long long)e->d.V, (double)val[i]);
    if (n > 1) {
        int32_t *s = malloc(sizeof *s * n);
        if (!s)
            return eng_err(e, -ENOMEM, "bias: out of memory");
        memcpy(s, tok, sizeof *s * n);
        qsort(s, n, sizeof *s, cmp_i32);
        int32_t dup = -1;
        for (size_t i = 1; i < n && dup < 0; i++)
            if (s[i] == s[i - 1])
                dup = s[i];
        free(s);
        if (dup >= 0)
            return eng_err(e, MOE_ERANGE, "bias: token %d is listed twice", dup);
    }
    int rc = e->b->vt->bias(e->b, seq, tok, val, n);
    if (rc)
        return eng_err(e, rc, "bias: %s", e->b->vt->errmsg(e->b));
    return 0;
}

void moe_engine_seq_clear(struct moe_engine *e, int32_t seq)
{
    if (seq >= 0 && (uint32_t)seq < e->o.n_seq) {
        e->filled[seq] = 0;
        e->last_gen[seq] = 0;
    }
}

void moe_engine_seq_keep(struct moe_engine *e, int32_t seq, uint32_t n)
{
    if (seq >= 0 && (uint32_t)seq < e->o.n_seq && n < (uint32_t)e->filled[seq]) {
        e->filled[seq] = (int32_t)n;
        e->last_gen[seq] = 0;
    }
}

int moe_engine_seq_copy(struct moe_engine *e, int32_t src, int32_t dst, uint32_t n)
{
    if (src < 0 || dst < 0 || (uint32_t)src >= e->o.n_seq || (uint32_t)dst >= e->o.n_seq)
        return eng_err(e, MOE_ERANGE, "seq copy: sequences %d -> %d outside 0..%u", src, dst,
                       e->o.n_seq - 1);
    if (n > (uint32_t)e->filled[src])
        return eng_err(e, MOE_ERANGE, "seq copy: %u positions, sequence %d holds %d", n, src,
                       e->filled[src]);
    if (e->q_len)
        return eng_err(e, MOE_ERANGE, "seq copy: %d queued steps are not collected", e->q_len);
    if (src == dst)
        return 0;
    e->last_gen[dst] = 0;
    int rc = e->b->vt->kv_copy(e->b, src, dst, n);
    if (rc)
        return eng_err(e, rc, "seq copy: %s", e->b->vt->errmsg(e->b));
    e->filled[dst] = (int32_t)n;
    return 0;
}

int moe_engine_routing_counts(struct moe_engine *e, uint64_t *dst)
{
    int rc = e->b->vt->routing_counts(e->b, dst);
    if (rc)
        return eng_err(e, rc, "routing counts: %s", e->b->vt->errmsg(e->b));
    return 0;
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

void moe_engine_info(const struct moe_engine *e, struct moe_engine_info *info)
{
    memset(info, 0, sizeof *info);
    snprintf(info->device, sizeof info->device, "%s", e->device);
    e->b->vt->info(e->b, &info->device_bytes, info->desc, sizeof info->desc);
    /* float32 on the CPU; f16 on CUDA unless kv_f32. */
    uint64_t es = e->b->vt == &moe_backend_cpu || e->d.kv_f32 ? 4 : 2;
    info->kv_bytes = (uint64_t)e->d.L * e->d.n_seq * e->d.n_ctx *
                     (uint64_t)(e->d.kdim + e->d.vdim) * es;
}

int moe_engine_offload_stats(struct moe_engine *e, struct moe_offload_stats *s,
                             struct moe_offload_layer *per_layer)
{
    memset(s, 0, sizeof *s);
    if (per_layer)
        memset(per_layer, 0, sizeof *per_layer * (size_t)e->d.L);
    if (!e->b->vt->offload_stats)
        return 0;
    int rc = e->b->vt->offload_stats(e->b, s, per_layer);
    if (rc)
        return eng_err(e, rc, "offload stats: %s", e->b->vt->errmsg(e->b));
    return 0;
}

int moe_engine_set_hot(struct moe_engine *e, const uint64_t *counts, uint32_t max_loads,
                       uint32_t *pending)
{
    uint32_t left = 0;
    if (e->q_len)
        return eng_err(e, MOE_ERANGE, "re-pinning experts: %d queued steps are not collected",
                       e->q_len);
    int rc = e->b->vt->set_hot ? e->b->vt->set_hot(e->b, counts, max_loads, &left) : 0;
    if (pending)
        *pending = left;
    if (rc)
        return eng_err(e, rc, "re-pinning experts: %s", e->b->vt->errmsg(e->b));
    return 0;
}

int moe_engine_hot_experts(struct moe_engine *e, uint8_t *bits)
{
    if (!e->b->vt->hot_experts)
        return 0;
    int rc = e->b->vt->hot_experts(e->b, bits);
    if (rc < 0)
        return eng_err(e, rc, "hot experts: %s", e->b->vt->errmsg(e->b));
    return rc;
}

struct moe_backend *moe_engine_backend(struct moe_engine *e)
{
    return e->b;
}

const struct moe_dims *moe_engine_dims(const struct moe_engine *e)
{
    return &e->d;
}

/* ---------------------------------------------------------------- forward */

/* A recorded step's choices ([L][n][kuse] in route_sel) counted into each token's signature. */
static int add_signatures(struct moe_engine *e, uint32_t *const *sig, int64_t n)
{
    const int64_t K = e->d.kuse, NE = e->d.nexp;
    for (int64_t l = 0; l < e->d.L; l++)
        for (int64_t t = 0; t < n; t++) {
            if (!sig[t])
                continue;
            const int32_t *sel = e->route_sel + (l * n + t) * K;
            for (int64_t j = 0; j < K; j++) {
                if (sel[j] < 0 || sel[j] >= NE)
                    return eng_err(e, MOE_EBACKEND, "%s backend: blk.%lld chose expert %d of %lld",
                                   e->b->vt->name, (long long)l, sel[j], (long long)NE);
                sig[t][l * NE + sel[j]]++;
            }
        }
    return 0;
}

/* One step of n <= n_batch tokens (already validated; tok: their ids, MOE_ENGINE_TOKEN_NEXT
 * resolved; prev: backend.h's, or NULL). submit: queue it in the backend (vt->submit). */
static int forward_step(struct moe_engine *e, const struct moe_batch *b, uint32_t off, int64_t n,
                        const int32_t *tok, const int32_t *prev, float *out, int32_t *tokens,
                        bool submit, int64_t *n_out)
{
    const int64_t half = e->d.hd / 2;
    for (int64_t t = 0; t < n; t++) {
        double p = (double)b->pos[off + t];
        float *cs = e->rope + t * e->d.hd;
        for (int64_t i = 0; i < half; i++) {
            double th = p * e->inv_freq[i];
            cs[2 * i] = (float)cos(th);
            cs[2 * i + 1] = (float)sin(th);
        }
    }
    const bool sample = tokens || submit;
    int64_t k = 0;
    for (int64_t t = 0; t < n; t++)
        if ((out || sample) && (!b->logits || b->logits[off + t]))
            e->out_row[k++] = (int32_t)t;
    *n_out = k;
    uint32_t *const *sig = b->sig ? b->sig + off : NULL;
    bool record = false;
    for (int64_t t = 0; sig && t < n && !record; t++)
        record = sig[t] != NULL;
    struct moe_step st = {.n = n, .token = tok, .pos = b->pos + off, .seq = b->seq + off,
                          .rope = e->rope, .n_out = k, .out_row = e->out_row, .sample = sample,
                          .record = record, .prev = prev};
    e->gen++; /* the tokens the step before drew are no longer "the last step's" */
    int rc = moe_qwen3moe_step(e->b, &e->d, &st, out, tokens, submit);
    if (!rc && record)
        rc = e->b->vt->route_record(e->b, e->route_sel);
    if (rc)
        return eng_err(e, rc, "%s backend: %s", e->b->vt->name, e->b->vt->errmsg(e->b));
    for (int64_t r = 0; sample && r < k; r++) {
        const int32_t seq = b->seq[off + e->out_row[r]];
        e->last_gen[seq] = e->gen;
        e->last_row[seq] = (int32_t)r;
        e->last_pos[seq] = b->pos[off + e->out_row[r]];
        e->last_known[seq] = tokens != NULL;
        e->last_tok[seq] = tokens ? tokens[r] : -1;
    }
    return record ? add_signatures(e, sig, n) : 0;
}

/* mode: logits (out), sampled tokens (tokens), or a queued sampling step (submit). */
static int forward(struct moe_engine *e, const struct moe_batch *b, float *out, int32_t *tokens,
                   bool submit)
{
    if (b->n == 0)
        return 0;
    if (!b->token || !b->pos || !b->seq)
        return eng_err(e, MOE_ERANGE, "batch: token, pos and seq are required");
    if (b->sig && !e->o.record_routes)
        return eng_err(e, MOE_ERANGE, "batch: routing signatures need the record_routes option");
    if (!submit && e->q_len)
        return eng_err(e, MOE_ERANGE, "batch: %d queued steps are not collected", e->q_len);
    if (submit && e->q_len >= MOE_ENGINE_AHEAD)
        return eng_err(e, MOE_ERANGE, "batch: %d steps are queued already", e->q_len);
    if (submit && (b->n > e->o.n_batch || b->sig))
        return eng_err(e, MOE_ERANGE, "batch: a queued step takes at most %u tokens and no "
                       "routing signatures", e->o.n_batch);

    /* Validate the whole batch before touching any state, so a bad batch changes nothing. */
    int32_t *fill = e->fill;
    memcpy(fill, e->filled, sizeof *fill * e->o.n_seq);
    bool any_prev = false, any_next = false;
    for (uint32_t i = 0; i < b->n; i++) {
        int32_t tok = b->token[i], pos = b->pos[i], seq = b->seq[i];
        if (seq < 0 || (uint32_t)seq >= e->o.n_seq)
            return eng_err(e, MOE_ERANGE, "batch[%u]: sequence %d outside 0..%u", i, seq,
                           e->o.n_seq - 1);
        if (tok == MOE_ENGINE_TOKEN_NEXT) {
            if (b->n > e->o.n_batch)
                return eng_err(e, MOE_ERANGE, "batch[%u]: the last step's token in a batch of "
                               "more than %u tokens", i, e->o.n_batch);
            if (e->last_gen[seq] == 0 || e->last_gen[seq] != e->gen)
                return eng_err(e, MOE_ERANGE, "batch[%u]: the last step drew no token for "
                               "sequence %d", i, seq);
            if (pos != e->last_pos[seq] + 1)
                return eng_err(e, MOE_ERANGE, "batch[%u]: the last step's token of sequence %d "
                               "goes at position %d, not %d", i, seq, e->last_pos[seq] + 1, pos);
            if (e->last_known[seq] && e->last_tok[seq] < 0)
                return eng_err(e, MOE_ERANGE, "batch[%u]: the last step drew nothing for "
                               "sequence %d", i, seq);
            any_next = true;
            any_prev |= !e->last_known[seq];
        } else if (tok < 0 || (int64_t)tok >= e->d.V) {
            return eng_err(e, MOE_ERANGE, "batch[%u]: token %d outside the vocabulary (%lld)", i,
                           tok, (long long)e->d.V);
        }
        if (pos < 0 || (uint32_t)pos >= e->o.n_ctx)
            return eng_err(e, MOE_ERANGE, "batch[%u]: position %d outside the context (%u)", i,
                           pos, e->o.n_ctx);
        if (pos > fill[seq])
            return eng_err(e, MOE_ERANGE,
                           "batch[%u]: position %d of sequence %d follows a gap (next is %d)", i,
                           pos, seq, fill[seq]);
        fill[seq] = pos + 1;
    }
    if (tokens || submit) {
        /* Sampled rows: one per sequence per step, each sequence with a sampler. */
        uint8_t *seen = e->seen;
        for (uint32_t off = 0; off < b->n; off += e->o.n_batch) {
            memset(seen, 0, e->o.n_seq);
            uint32_t end = b->n - off < e->o.n_batch ? b->n : off + e->o.n_batch;
            for (uint32_t i = off; i < end; i++) {
                if (b->logits && !b->logits[i])
                    continue;
                int32_t seq = b->seq[i];
                if (!e->has_sampler[seq])
                    return eng_err(e, MOE_ERANGE, "batch[%u]: sequence %d has no sampler", i, seq);
                if (seen[seq]++)
                    return eng_err(e, MOE_ERANGE,
                                   "batch[%u]: a second sampled token of sequence %d in one step",
                                   i, seq);
            }
        }
    }
    memcpy(e->filled, fill, sizeof *fill * e->o.n_seq);

    /* The last step's tokens: known here (its tokens came back), or drawn on the device by a
     * step still queued there (prev). */
    const int32_t *tok = b->token;
    if (any_next) {
        for (uint32_t i = 0; i < b->n; i++) {
            const int32_t seq = b->seq[i];
            const bool next = b->token[i] == MOE_ENGINE_TOKEN_NEXT;
            e->tok_in[i] = !next ? b->token[i] : e->last_known[seq] ? e->last_tok[seq] : 0;
            e->prev_in[i] = next && !e->last_known[seq] ? e->last_row[seq] : -1;
        }
        tok = e->tok_in;
    }
    if (submit) {
        struct eng_queued *q = &e->q[(e->q_head + e->q_len) % MOE_ENGINE_AHEAD];
        const bool dev = e->b->vt->submit != NULL;
        int64_t k = 0;
        int rc = forward_step(e, b, 0, b->n, tok, any_prev ? e->prev_in : NULL, NULL,
                              dev ? NULL : q->tok, dev, &k);
        if (rc)
            return rc;
        q->gen = e->gen;
        q->n_out = (uint32_t)k;
        q->dev = dev;
        e->q_len++;
        return 0;
    }
    int64_t written = 0;
    for (uint32_t off = 0; off < b->n; off += e->o.n_batch) {
        int64_t n = b->n - off < e->o.n_batch ? b->n - off : e->o.n_batch, k = 0;
        int rc = forward_step(e, b, off, n, tok + off, NULL, out ? out + written * e->d.V : NULL,
                              tokens ? tokens + written : NULL, false, &k);
        if (rc)
            return rc;
        written += k;
    }
    return 0;
}

int moe_engine_forward(struct moe_engine *e, const struct moe_batch *b, float *out)
{
    return forward(e, b, out, NULL, false);
}

int moe_engine_forward_sample(struct moe_engine *e, const struct moe_batch *b, int32_t *tokens)
{
    if (!tokens)
        return eng_err(e, MOE_ERANGE, "forward_sample: no token array");
    return forward(e, b, NULL, tokens, false);
}

int moe_engine_submit_sample(struct moe_engine *e, const struct moe_batch *b)
{
    if (b->n == 0)
        return eng_err(e, MOE_ERANGE, "submit: an empty batch");
    return forward(e, b, NULL, NULL, true);
}

int moe_engine_collect(struct moe_engine *e, int32_t *tokens, uint32_t *n)
{
    if (n)
        *n = 0;
    if (e->q_len == 0)
        return eng_err(e, MOE_ERANGE, "collect: no queued step");
    struct eng_queued *q = &e->q[e->q_head];
    if (q->dev) {
        int rc = e->b->vt->collect(e->b, q->tok);
        if (rc) {
            /* What else is queued went after a failed step: drop it all. */
            e->q_len = 0;
            e->q_head = 0;
            e->gen++;
            return eng_err(e, rc, "%s backend: %s", e->b->vt->name, e->b->vt->errmsg(e->b));
        }
        /* The sequences whose last drawn token this was now know it. */
        for (uint32_t s = 0; s < e->o.n_seq; s++)
            if (e->last_gen[s] == q->gen && !e->last_known[s]) {
                e->last_known[s] = 1;
                e->last_tok[s] = q->tok[e->last_row[s]];
            }
    }
    if (tokens)
        memcpy(tokens, q->tok, sizeof *tokens * q->n_out);
    if (n)
        *n = q->n_out;
    e->q_head = (e->q_head + 1) % MOE_ENGINE_AHEAD;
    e->q_len--;
    return 0;
}

int moe_engine_queued(const struct moe_engine *e)
{
    return e->q_len;
}

/* Model description for qwen3moe: hyperparameters from the GGUF metadata, every tensor found,
 * its shape and type checked, and views (including per-expert views into the 3-D expert
 * tensors) pointing into the file mapping.
 *
 * Everything a forward pass relies on is checked here once, so that the engine can trust the
 * description: shapes match the hyperparameters, types can be computed, norms are f32, and the
 * hyperparameters are in ranges that cannot overflow the engine's size arithmetic. */
#include "store/model.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/ggml_type.h"

/* Generous upper bounds: far above any released MoE model, low enough that products of them
 * (n_head * head_dim, n_layer * n_expert ...) stay far from overflow. */
#define MAX_LAYER 1024
#define MAX_EMBD 65536
#define MAX_HEAD 1024
#define MAX_HEAD_DIM 1024
#define MAX_EXPERT 4096
#define MAX_FF (1u << 20)
#define MAX_VOCAB (1u << 24)

struct hp_spec {
    const char *key;       /* after "<arch>." */
    uint32_t *dst;
    bool required;
    uint32_t min, max;
};

static int get_u32_key(const struct gguf_file *f, const char *arch, const struct hp_spec *s,
                       char *err, size_t errlen)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, s->key);
    int rc = gguf_get_u32(f, key, s->dst, err, errlen);
    if (rc == MOE_ENOTFOUND && !s->required)
        return 0; /* keep the default already in *dst */
    if (rc == MOE_ENOTFOUND)
        return moe_fail(err, errlen, MOE_ENOTFOUND, "required key '%s' is missing", key);
    if (rc)
        return rc;
    if (*s->dst < s->min || *s->dst > s->max)
        return moe_fail(err, errlen, MOE_ERANGE, "key '%s': %" PRIu32 " is not in %" PRIu32
                        "..%" PRIu32, key, *s->dst, s->min, s->max);
    return 0;
}

static int get_f32_key(const struct gguf_file *f, const char *arch, const char *name, float *dst,
                       bool required, double lo, double hi, char *err, size_t errlen)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, name);
    int rc = gguf_get_f32(f, key, dst, err, errlen);
    if (rc == MOE_ENOTFOUND && !required)
        return 0;
    if (rc == MOE_ENOTFOUND)
        return moe_fail(err, errlen, MOE_ENOTFOUND, "required key '%s' is missing", key);
    if (rc)
        return rc;
    if (!isfinite(*dst) || *dst <= lo || *dst > hi)
        return moe_fail(err, errlen, MOE_ERANGE, "key '%s': %g is not in (%g, %g]", key,
                        (double)*dst, lo, hi);
    return 0;
}

static int read_hparams(struct moe_hparams *hp, const struct gguf_file *f, const char *arch,
                        char *err, size_t errlen)
{
    int rc;
    /* Optional keys get llama.cpp's defaults: head_count_kv = head_count, key_length =
     * n_embd / n_head, value_length = key_length, rope.freq_base = 10000. */
    hp->n_ff = 0;
    struct hp_spec first[] = {
        {"block_count", &hp->n_layer, true, 1, MAX_LAYER},
        {"context_length", &hp->n_ctx_train, true, 1, UINT32_MAX},
        {"embedding_length", &hp->n_embd, true, 1, MAX_EMBD},
        {"feed_forward_length", &hp->n_ff, false, 0, UINT32_MAX},
        {"attention.head_count", &hp->n_head, true, 1, MAX_HEAD},
        {"expert_count", &hp->n_expert, true, 1, MAX_EXPERT},
        {"expert_feed_forward_length", &hp->expert_ff, true, 1, MAX_FF},
    };
    for (size_t i = 0; i < sizeof first / sizeof first[0]; i++)
        if ((rc = get_u32_key(f, arch, &first[i], err, errlen)))
            return rc;
    hp->n_head_kv = hp->n_head;
    hp->head_dim = hp->n_embd / hp->n_head;
    struct hp_spec second[] = {
        {"attention.head_count_kv", &hp->n_head_kv, false, 1, hp->n_head},
        {"attention.key_length", &hp->head_dim, false, 2, MAX_HEAD_DIM},
        {"expert_used_count", &hp->n_expert_used, true, 1, hp->n_expert},
    };
    for (size_t i = 0; i < sizeof second / sizeof second[0]; i++)
        if ((rc = get_u32_key(f, arch, &second[i], err, errlen)))
            return rc;
    hp->head_dim_v = hp->head_dim;
    struct hp_spec vlen = {"attention.value_length", &hp->head_dim_v, false, 1, MAX_HEAD_DIM};
    if ((rc = get_u32_key(f, arch, &vlen, err, errlen)))
        return rc;

    if (hp->n_head % hp->n_head_kv != 0)
        return moe_fail(err, errlen, MOE_ERANGE,
                        "key '%s.attention.head_count' (%" PRIu32 ") is not a multiple of "
                        "'%s.attention.head_count_kv' (%" PRIu32 ")",
                        arch, hp->n_head, arch, hp->n_head_kv);
    if (hp->head_dim < 2 || hp->head_dim > MAX_HEAD_DIM)
        return moe_fail(err, errlen, MOE_ERANGE,
                        "head dimension %" PRIu32 " (key '%s.attention.key_length', or n_embd / "
                        "n_head when absent) is not in 2..%d", hp->head_dim, arch, MAX_HEAD_DIM);
    if (hp->head_dim % 2 != 0)
        return moe_fail(err, errlen, MOE_ERANGE,
                        "key '%s.attention.key_length': head dimension %" PRIu32
                        " must be even (RoPE rotates pairs)", arch, hp->head_dim);
    if (hp->head_dim_v != hp->head_dim)
        return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                        "key '%s.attention.value_length' (%" PRIu32 ") differs from "
                        "'%s.attention.key_length' (%" PRIu32 "); %s needs them equal",
                        arch, hp->head_dim_v, arch, hp->head_dim, arch);

    hp->rope_base = 10000.0f;
    if ((rc = get_f32_key(f, arch, "rope.freq_base", &hp->rope_base, false, 0, 1e12, err, errlen)))
        return rc;
    if ((rc = get_f32_key(f, arch, "attention.layer_norm_rms_epsilon", &hp->rms_eps, true, 0, 1,
                          err, errlen)))
        return rc;

    /* qwen3moe renormalises the top-k weights; a file may say otherwise explicitly. */
    hp->norm_topk = true;
    char key[128];
    snprintf(key, sizeof key, "%s.expert_weights_norm", arch);
    rc = gguf_get_bool(f, key, &hp->norm_topk, err, errlen);
    if (rc && rc != MOE_ENOTFOUND)
        return rc;
    return 0;
}

/* Finds a tensor and checks its shape (ggml order; unused dimensions 1) and type. */
static int get_tensor(const struct gguf_file *f, const char *name, int64_t ne0, int64_t ne1,
                      int64_t ne2, bool need_f32, const struct gguf_tensor **out, char *err,
                      size_t errlen)
{
    const struct gguf_tensor *t = gguf_find_tensor(f, name);
    *out = t;
    if (!t)
        return moe_fail(err, errlen, MOE_ENOTFOUND, "tensor '%s' is missing", name);
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != 1)
        return moe_fail(err, errlen, MOE_EFORMAT,
                        "tensor '%s' has shape {%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64
                        "}, expected {%" PRId64 ", %" PRId64 ", %" PRId64 ", 1}",
                        name, t->ne[0], t->ne[1], t->ne[2], t->ne[3], ne0, ne1, ne2);
    const struct moe_type_info *ti = moe_type_get(t->type);
    if (need_f32 && t->type != MOE_TYPE_F32)
        return moe_fail(err, errlen, MOE_EUNSUPPORTED, "tensor '%s' has type %s; it must be f32",
                        name, ti->name);
    if (!ti->compute)
        return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                        "tensor '%s' has type %s, which moed cannot compute with", name, ti->name);
    return 0;
}

static struct moe_tensor view(const struct gguf_tensor *t)
{
    return (struct moe_tensor){t->data, t->type, {t->ne[0], t->ne[1]}, (size_t)t->nbytes};
}

/* Tensor lookup with the layer number substituted into a "blk.%u." name. */
static int layer_tensor(const struct gguf_file *f, uint32_t l, const char *sfx, int64_t ne0,
                        int64_t ne1, int64_t ne2, bool need_f32, const struct gguf_tensor **out,
                        char *err, size_t errlen)
{
    char name[GGUF_NAME_MAX + 16];
    snprintf(name, sizeof name, "blk.%" PRIu32 ".%s.weight", l, sfx);
    return get_tensor(f, name, ne0, ne1, ne2, need_f32, out, err, errlen);
}

static int load_layer(struct moe_model *m, const struct gguf_file *f, uint32_t l, char *err,
                      size_t errlen)
{
    const struct moe_hparams *hp = &m->hp;
    struct moe_layer *L = &m->layers[l];
    const struct gguf_tensor *t, *ex[3];
    int64_t E = hp->n_embd, hd = hp->head_dim, H = hp->n_head, Hkv = hp->n_head_kv;
    int64_t X = hp->n_expert, F = hp->expert_ff;
    int rc;
    struct {
        const char *sfx;
        int64_t ne0, ne1;
        bool f32;
        struct moe_tensor *dst;
    } dense[] = {
        {"attn_norm", E, 1, true, &L->attn_norm},
        {"attn_q", E, hd * H, false, &L->attn_q},
        {"attn_k", E, hd * Hkv, false, &L->attn_k},
        {"attn_v", E, hd * Hkv, false, &L->attn_v},
        {"attn_output", hd * H, E, false, &L->attn_output},
        {"attn_q_norm", hd, 1, true, &L->attn_q_norm},
        {"attn_k_norm", hd, 1, true, &L->attn_k_norm},
        {"ffn_norm", E, 1, true, &L->ffn_norm},
        {"ffn_gate_inp", E, X, false, &L->ffn_gate_inp},
    };
    for (size_t i = 0; i < sizeof dense / sizeof dense[0]; i++) {
        rc = layer_tensor(f, l, dense[i].sfx, dense[i].ne0, dense[i].ne1, 1, dense[i].f32, &t,
                          err, errlen);
        if (rc)
            return rc;
        *dense[i].dst = view(t);
        m->bytes_dense += t->nbytes;
    }
    if ((rc = layer_tensor(f, l, "ffn_gate_exps", E, F, X, false, &ex[0], err, errlen)) ||
        (rc = layer_tensor(f, l, "ffn_up_exps", E, F, X, false, &ex[1], err, errlen)) ||
        (rc = layer_tensor(f, l, "ffn_down_exps", F, E, X, false, &ex[2], err, errlen)))
        return rc;
    L->experts = calloc((size_t)X, sizeof *L->experts);
    if (!L->experts)
        return moe_fail(err, errlen, -ENOMEM, "out of memory for %" PRId64 " experts", X);
    for (int k = 0; k < 3; k++) {
        /* Expert e is the e-th {ne0, ne1} matrix: nbytes / n_expert bytes at e * that. */
        size_t nb2 = (size_t)(ex[k]->nbytes / (uint64_t)X);
        for (int64_t e = 0; e < X; e++) {
            struct moe_expert *x = &L->experts[e];
            struct moe_tensor *dst = k == 0 ? &x->gate : k == 1 ? &x->up : &x->down;
            *dst = (struct moe_tensor){(const uint8_t *)ex[k]->data + (size_t)e * nb2,
                                       ex[k]->type, {ex[k]->ne[0], ex[k]->ne[1]}, nb2};
        }
        m->bytes_experts += ex[k]->nbytes;
    }
    return 0;
}

int moe_model_from_gguf(struct moe_model *m, const struct gguf_file *f, char *err, size_t errlen)
{
    int rc;
    memset(m, 0, sizeof *m);
    if (err && errlen)
        err[0] = '\0';
    struct gguf_str a;
    rc = gguf_get_str(f, "general.architecture", &a, err, errlen);
    if (rc == MOE_ENOTFOUND)
        return moe_fail(err, errlen, MOE_EFORMAT,
                        "key 'general.architecture' is missing (not a model file?)");
    if (rc)
        return rc;
    if (a.len != strlen("qwen3moe") || memcmp(a.p, "qwen3moe", a.len) != 0)
        return moe_fail(err, errlen, MOE_EUNSUPPORTED,
                        "architecture '%.*s' is not supported (moed serves: qwen3moe)",
                        (int)(a.len > 64 ? 64 : a.len), a.p);
    if (f->n_tensors == 0)
        return moe_fail(err, errlen, MOE_EFORMAT,
                        "the file holds no tensors (a vocabulary-only GGUF?), not a model");
    m->arch = MOE_ARCH_QWEN3MOE;
    snprintf(m->arch_name, sizeof m->arch_name, "qwen3moe");
    struct moe_hparams *hp = &m->hp;
    if ((rc = read_hparams(hp, f, m->arch_name, err, errlen)))
        goto fail;

    const struct gguf_tensor *t;
    int64_t E = hp->n_embd;
    t = gguf_find_tensor(f, "token_embd.weight");
    if (!t) {
        rc = moe_fail(err, errlen, MOE_ENOTFOUND, "tensor 'token_embd.weight' is missing");
        goto fail;
    }
    if (t->ne[1] < 1 || t->ne[1] > MAX_VOCAB) {
        rc = moe_fail(err, errlen, MOE_EFORMAT, "tensor 'token_embd.weight': vocabulary size %"
                      PRId64 " (ne[1]) is not in 1..%u", t->ne[1], MAX_VOCAB);
        goto fail;
    }
    hp->n_vocab = (uint32_t)t->ne[1];
    int64_t V = hp->n_vocab;
    if ((rc = get_tensor(f, "token_embd.weight", E, V, 1, false, &t, err, errlen)))
        goto fail;
    m->token_embd = view(t);
    m->bytes_dense += t->nbytes;
    if ((rc = get_tensor(f, "output_norm.weight", E, 1, 1, true, &t, err, errlen)))
        goto fail;
    m->output_norm = view(t);
    m->bytes_dense += t->nbytes;
    /* output.weight is optional: without it the head is tied to the embedding. */
    if (gguf_find_tensor(f, "output.weight")) {
        if ((rc = get_tensor(f, "output.weight", E, V, 1, false, &t, err, errlen)))
            goto fail;
        m->output = view(t);
        m->bytes_dense += t->nbytes;
    } else {
        m->output = m->token_embd;
    }

    m->layers = calloc(hp->n_layer, sizeof *m->layers);
    if (!m->layers) {
        rc = moe_fail(err, errlen, -ENOMEM, "out of memory for %" PRIu32 " layers", hp->n_layer);
        goto fail;
    }
    for (uint32_t l = 0; l < hp->n_layer; l++)
        if ((rc = load_layer(m, f, l, err, errlen)))
            goto fail;
    m->fingerprint = gguf_fingerprint(f);
    m->gguf = f;
    return 0;
fail:
    moe_model_free(m);
    return rc;
}

int moe_model_expert_slice(const struct moe_model *m, uint32_t layer, uint32_t expert,
                           struct moe_expert_slice *out)
{
    if (!m->gguf || !m->layers)
        return MOE_EINTERNAL; /* offsets only exist for a model described from a GGUF */
    if (layer >= m->hp.n_layer || expert >= m->hp.n_expert)
        return MOE_ERANGE;
    const struct moe_expert *x = &m->layers[layer].experts[expert];
    const struct moe_tensor *mt[3] = {&x->gate, &x->up, &x->down};
    for (int k = 0; k < 3; k++) {
        out->off[k] = (uint64_t)((const uint8_t *)mt[k]->data - m->gguf->base);
        out->size[k] = mt[k]->nbytes;
        out->type[k] = mt[k]->type;
    }
    return 0;
}

uint64_t moe_model_expert_bytes(const struct moe_model *m, uint32_t layer)
{
    if (!m->layers || layer >= m->hp.n_layer)
        return 0;
    const struct moe_expert *x = &m->layers[layer].experts[0];
    return (uint64_t)x->gate.nbytes + x->up.nbytes + x->down.nbytes;
}

uint64_t moe_model_expert_slot(const struct moe_model *m, uint32_t layer, uint32_t part_off[3])
{
    if (!m->layers || layer >= m->hp.n_layer)
        return 0;
    uint64_t mx[3] = {0, 0, 0};
    for (uint32_t x = 0; x < m->hp.n_expert; x++) {
        const struct moe_expert *e = &m->layers[layer].experts[x];
        const uint64_t nb[3] = {e->gate.nbytes, e->up.nbytes, e->down.nbytes};
        for (int p = 0; p < 3; p++)
            mx[p] = nb[p] > mx[p] ? nb[p] : mx[p];
    }
    uint64_t off = 0;
    for (int p = 0; p < 3; p++) {
        if (part_off)
            part_off[p] = (uint32_t)off;
        off += (mx[p] + 255) & ~(uint64_t)255;
    }
    return off;
}

void moe_model_free(struct moe_model *m)
{
    if (m->layers)
        for (uint32_t l = 0; l < m->hp.n_layer; l++)
            free(m->layers[l].experts);
    free(m->layers);
    memset(m, 0, sizeof *m);
}

/* A numeric KV of any type as a double; false when absent or not a number. */
static bool kv_number(const struct gguf_file *f, const char *key, double *out)
{
    const struct gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv)
        return false;
    switch (kv->type) {
    case GGUF_U8: case GGUF_U16: case GGUF_U32: case GGUF_U64:
        *out = (double)kv->v.u64;
        return true;
    case GGUF_I8: case GGUF_I16: case GGUF_I32: case GGUF_I64:
        *out = (double)kv->v.i64;
        return true;
    case GGUF_F32: case GGUF_F64:
        *out = kv->v.f64;
        return isfinite(*out);
    default:
        return false;
    }
}

void moe_gguf_sampling_hints(const struct gguf_file *f, struct moe_sampling_hints *out)
{
    double v;
    out->temperature = out->top_p = out->min_p = out->repeat_penalty = NAN;
    out->top_k = out->penalty_last_n = -1;
    if (kv_number(f, "general.sampling.temp", &v) && v >= 0 && v <= 100)
        out->temperature = v;
    if (kv_number(f, "general.sampling.top_p", &v) && v > 0 && v <= 1)
        out->top_p = v;
    if (kv_number(f, "general.sampling.min_p", &v) && v >= 0 && v <= 1)
        out->min_p = v;
    if (kv_number(f, "general.sampling.penalty_repeat", &v) && v > 0 && v <= 100)
        out->repeat_penalty = v;
    if (kv_number(f, "general.sampling.top_k", &v) && v >= 0 && v <= (double)INT32_MAX &&
        v == (double)(int64_t)v)
        out->top_k = (int64_t)v;
    if (kv_number(f, "general.sampling.penalty_last_n", &v) && v >= -1 && v <= (double)INT32_MAX &&
        v == (double)(int64_t)v)
        out->penalty_last_n = (int64_t)v;
}

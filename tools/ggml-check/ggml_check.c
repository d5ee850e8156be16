/* ggml-check: cross-checks moed's GGUF reader and block formats against ggml itself.
 *
 *   ggml_check [--meta-only] [--show-kv] [--ref SRC] [--mix OTHER] [--max-lines N] FILE.gguf...
 *   ggml_check --quant [--seed S] [--rows N]       compare the quantizers on random data
 *   ggml_check --types                              compare the type tables
 *
 * For a file: ggml's gguf_init_from_file (no_alloc=false, so ggml reads the data section into a
 * ggml context, unless --meta-only) and our gguf_open must agree on the header, every KV (key,
 * type, value), every tensor (name, type, shape, offset, size, bytes); every tensor dequantized
 * with ggml's to_float and with moe_dequantize must give bit-identical floats; the file must have
 * every key, key type and tensor shape that llama.cpp's loader demands for qwen3moe (its
 * llama-model.cpp, llama-model-loader.cpp and llama-vocab.cpp, as read for docs/ggml-check.md);
 * and moe_model_from_gguf / moe_tok_load must accept it with what ggml's KVs say. --ref SRC
 * compares the file with what llama-quantize (no imatrix) would make of SRC; --mix OTHER lists
 * tensors whose block type differs from OTHER's.
 *
 * Output: per file FAIL/WARN/note lines, then "PASS|FAIL  FILE  (counts)" and a verdicts line.
 * Exit status: 0 when everything passed, 1 when anything failed, 2 on usage errors. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/ggml_type.h"
#include "store/gguf.h"
#include "store/model.h"
#include "store/quant.h"
#include "store/tokenizer.h"
#include "tools/ggml-check/ggml_side.h"

struct opts {
    bool meta_only;
    int max_lines;   /* detail lines per check before "... and N more" */
    uint64_t seed;
    int64_t rows;
    const char *ref; /* --ref SRC: requantize SRC's tensors with ggml into this file's types */
    const char *mix; /* --mix OTHER: list tensors whose type differs from OTHER's */
    bool show_kv;    /* --show-kv: print every KV as ggml reads it */
};

/* Findings of one file (or one test run). Detail lines beyond max_lines per check are counted,
 * not printed, so a systematic difference does not drown the report. */
struct report {
    int fails;
    int notes;
    int warns;
    int shown;       /* lines shown for the current check */
    int hidden;      /* lines suppressed for the current check */
    int max_lines;
};

static void check_begin(struct report *r)
{
    r->shown = 0;
    r->hidden = 0;
}

static void check_end(struct report *r)
{
    if (r->hidden)
        printf("    ... and %d more like this\n", r->hidden);
    r->shown = r->hidden = 0;
}

static void vline(struct report *r, const char *tag, const char *fmt, va_list ap)
{
    if (r->shown >= r->max_lines) {
        r->hidden++;
        return;
    }
    r->shown++;
    printf("  %s ", tag);
    vprintf(fmt, ap);
    putchar('\n');
}

__attribute__((format(printf, 2, 3))) static void fail(struct report *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    r->fails++;
    vline(r, "FAIL", fmt, ap);
    va_end(ap);
}

/* A difference that is real but not a failure of the stated criteria (edge cases). */
__attribute__((format(printf, 2, 3))) static void warn(struct report *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    r->warns++;
    vline(r, "WARN", fmt, ap);
    va_end(ap);
}

__attribute__((format(printf, 2, 3))) static void note(struct report *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    r->notes++;
    vline(r, "note", fmt, ap);
    va_end(ap);
}

static double sq_err(const float *x, const float *y, int64_t n, double *ref);

/* ggml type ids used below (the same numbers as enum moe_type). */
enum { GGML_F32_ID = 0, GGML_F16_ID = 1, GGML_BF16_ID = 30 };

/* GGUF value type ids, the same numbers in ggml and in store/gguf.h. */
static size_t vtype_size(uint32_t t)
{
    switch (t) {
    case GGUF_U8: case GGUF_I8: case GGUF_BOOL: return 1;
    case GGUF_U16: case GGUF_I16: return 2;
    case GGUF_U32: case GGUF_I32: case GGUF_F32: return 4;
    case GGUF_U64: case GGUF_I64: case GGUF_F64: return 8;
    default: return 0;
    }
}

/* Our scalar KV encoded back to its little-endian bytes, to compare with ggml's storage. */
static void our_scalar_bytes(const struct gguf_kv *kv, uint8_t out[8])
{
    memset(out, 0, 8);
    switch (kv->type) {
    case GGUF_U8: case GGUF_U16: case GGUF_U32: case GGUF_U64: case GGUF_BOOL:
        memcpy(out, &kv->v.u64, vtype_size(kv->type)); /* little-endian host */
        break;
    case GGUF_I8: case GGUF_I16: case GGUF_I32: case GGUF_I64:
        memcpy(out, &kv->v.i64, vtype_size(kv->type));
        break;
    case GGUF_F32: {
        float f = (float)kv->v.f64;
        memcpy(out, &f, 4);
        break;
    }
    case GGUF_F64:
        memcpy(out, &kv->v.f64, 8);
        break;
    default:
        break;
    }
}

static bool str_eq(const char *g, const struct gguf_str *s)
{
    return g && strlen(g) == s->len && memcmp(g, s->p, (size_t)s->len) == 0;
}

static void compare_header(struct report *r, const struct gx_file *g, const struct gguf_file *f)
{
    check_begin(r);
    if (gx_version(g) != f->version)
        fail(r, "version: ggml %u, ours %u", gx_version(g), f->version);
    if (gx_alignment(g) != f->alignment)
        fail(r, "alignment: ggml %zu, ours %u", gx_alignment(g), f->alignment);
    /* ggml pads the data offset only when there are tensors (vocab-only files end at the KVs). */
    if (f->n_tensors && gx_data_offset(g) != f->data_offset)
        fail(r, "data section offset: ggml %zu, ours %" PRIu64, gx_data_offset(g), f->data_offset);
    if ((uint64_t)gx_n_kv(g) != f->n_kv)
        fail(r, "KV count: ggml %" PRId64 ", ours %" PRIu64, gx_n_kv(g), f->n_kv);
    if ((uint64_t)gx_n_tensors(g) != f->n_tensors)
        fail(r, "tensor count: ggml %" PRId64 ", ours %" PRIu64, gx_n_tensors(g), f->n_tensors);
    check_end(r);
}

static void compare_kvs(struct report *r, const struct gx_file *g, const struct gguf_file *f)
{
    check_begin(r);
    uint64_t n = f->n_kv < (uint64_t)gx_n_kv(g) ? f->n_kv : (uint64_t)gx_n_kv(g);
    for (uint64_t i = 0; i < n; i++) {
        const struct gguf_kv *kv = &f->kv[i];
        const char *gkey = gx_kv_key(g, (int64_t)i);
        if (strcmp(gkey, kv->key) != 0) {
            fail(r, "KV %" PRIu64 ": ggml key '%s', ours '%s'", i, gkey, kv->key);
            continue;
        }
        int gt = gx_kv_type(g, (int64_t)i);
        if ((uint32_t)gt != kv->type) {
            fail(r, "KV %s: ggml type %s, ours %s", kv->key, gx_kv_type_name(gt),
                 gguf_vtype_name(kv->type));
            continue;
        }
        if (kv->type == GGUF_STRING) {
            if (!str_eq(gx_kv_str(g, (int64_t)i), &kv->v.str))
                fail(r, "KV %s: string values differ", kv->key);
        } else if (kv->type == GGUF_ARRAY) {
            int gat = gx_kv_arr_type(g, (int64_t)i);
            size_t gn = gx_kv_arr_n(g, (int64_t)i);
            if ((uint32_t)gat != kv->v.arr.type || gn != kv->v.arr.n) {
                fail(r, "KV %s: ggml array of %zu %s, ours of %" PRIu64 " %s", kv->key, gn,
                     gx_kv_type_name(gat), kv->v.arr.n, gguf_vtype_name(kv->v.arr.type));
                continue;
            }
            if (kv->v.arr.type == GGUF_STRING) {
                for (uint64_t j = 0; j < kv->v.arr.n; j++)
                    if (!str_eq(gx_kv_arr_str(g, (int64_t)i, (size_t)j), &kv->v.arr.strs[j])) {
                        fail(r, "KV %s[%" PRIu64 "]: string values differ", kv->key, j);
                        break;
                    }
            } else if (kv->v.arr.n &&
                       memcmp(gx_kv_data(g, (int64_t)i), kv->v.arr.data,
                              (size_t)kv->v.arr.n * vtype_size(kv->v.arr.type)) != 0) {
                fail(r, "KV %s: array values differ", kv->key);
            }
        } else {
            uint8_t ours[8];
            our_scalar_bytes(kv, ours);
            size_t sz = vtype_size(kv->type);
            const uint8_t *gb = gx_kv_data(g, (int64_t)i);
            /* ggml keeps a BOOL as one byte; any nonzero byte is true for both readers. */
            bool same = kv->type == GGUF_BOOL ? (gb[0] != 0) == (ours[0] != 0)
                                              : memcmp(gb, ours, sz) == 0;
            if (!same)
                fail(r, "KV %s: scalar values differ", kv->key);
        }
    }
    check_end(r);
}

/* Tensor infos and, when ggml read the data section, the bytes themselves. */
static void compare_tensors(struct report *r, const struct gx_file *g, const struct gguf_file *f,
                            bool have_gdata, uint64_t *bytes_same)
{
    check_begin(r);
    uint64_t gn = (uint64_t)gx_n_tensors(g);
    uint64_t n = f->n_tensors < gn ? f->n_tensors : gn;
    for (uint64_t i = 0; i < n; i++) {
        const struct gguf_tensor *t = &f->tensors[i];
        const char *gname = gx_tensor_name(g, (int64_t)i);
        if (strcmp(gname, t->name) != 0) {
            fail(r, "tensor %" PRIu64 ": ggml name '%s', ours '%s'", i, gname, t->name);
            continue;
        }
        int64_t ne[4];
        gx_tensor_ne(g, (int64_t)i, ne);
        if (memcmp(ne, t->ne, sizeof ne) != 0)
            fail(r, "%s: ggml ne {%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 "}, ours {%" PRId64
                 ",%" PRId64 ",%" PRId64 ",%" PRId64 "}", t->name, ne[0], ne[1], ne[2], ne[3],
                 t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
        if ((uint32_t)gx_tensor_type(g, (int64_t)i) != t->type)
            fail(r, "%s: ggml type %d, ours %u", t->name, gx_tensor_type(g, (int64_t)i), t->type);
        if (gx_tensor_offset(g, (int64_t)i) != t->offset)
            fail(r, "%s: ggml offset %zu, ours %" PRIu64, t->name, gx_tensor_offset(g, (int64_t)i),
                 t->offset);
        if (gx_tensor_size(g, (int64_t)i) != t->nbytes)
            fail(r, "%s: ggml size %zu, ours %" PRIu64, t->name, gx_tensor_size(g, (int64_t)i),
                 t->nbytes);
        if ((const uint8_t *)t->data != f->base + f->data_offset + t->offset)
            fail(r, "%s: our data pointer is not data_offset + offset", t->name);
        if (have_gdata) {
            const void *gd = gx_tensor_data(g, (int64_t)i);
            if (!gd)
                fail(r, "%s: ggml context has no data for it", t->name);
            else if (memcmp(gd, t->data, (size_t)t->nbytes) != 0)
                fail(r, "%s: bytes ggml read differ from our mapping", t->name);
            else
                *bytes_same += t->nbytes;
        }
    }
    check_end(r);
}

/* Where element idx of a tensor lies, for messages: [expert][row][col]. */
static void where(const struct gguf_tensor *t, uint64_t idx, char *buf, size_t len)
{
    uint64_t col = idx % (uint64_t)t->ne[0], row = idx / (uint64_t)t->ne[0];
    uint64_t r1 = row % (uint64_t)t->ne[1], e = row / (uint64_t)t->ne[1];
    snprintf(buf, len, "[%" PRIu64 "][%" PRIu64 "][%" PRIu64 "]", e, r1, col);
}

/* Compares two float arrays bit for bit. Returns the mismatch count; *max_diff and *at get the
 * largest absolute difference and its index (NaN against non-NaN counts as infinite). */
static uint64_t float_diff(const float *a, const float *b, uint64_t n, double *max_diff,
                           uint64_t *at)
{
    uint64_t bad = 0;
    *max_diff = 0;
    *at = 0;
    for (uint64_t i = 0; i < n; i++) {
        if (memcmp(&a[i], &b[i], sizeof(float)) == 0)
            continue;
        bad++;
        double d = (isnan(a[i]) || isnan(b[i])) ? INFINITY : fabs((double)a[i] - (double)b[i]);
        if (bad == 1 || d > *max_diff) {
            *max_diff = d;
            *at = i;
        }
    }
    return bad;
}

struct deq_stats {
    uint64_t tensors, elements, bad_tensors;
    uint64_t per_type[64];
};

static void compare_dequant(struct report *r, const struct gguf_file *f, struct deq_stats *st)
{
    check_begin(r);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const struct gguf_tensor *t = &f->tensors[i];
        uint64_t n = (uint64_t)t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        float *a = malloc((n ? n : 1) * sizeof *a), *b = malloc((n ? n : 1) * sizeof *b);
        if (!a || !b) {
            fail(r, "%s: out of memory for %" PRIu64 " floats", t->name, n);
            free(a);
            free(b);
            continue;
        }
        int grc = gx_dequantize((int)t->type, t->data, a, (int64_t)n);
        int orc = moe_dequantize(t->type, t->data, b, (int64_t)n);
        if (grc || orc) {
            fail(r, "%s: type %u: dequantize unsupported by %s%s", t->name, t->type,
                 grc ? "ggml " : "", orc ? "moed" : "");
        } else {
            double md;
            uint64_t at;
            uint64_t bad = float_diff(a, b, n, &md, &at);
            st->tensors++;
            st->elements += n;
            if (t->type < 64)
                st->per_type[t->type]++;
            if (bad) {
                char w[96];
                where(t, at, w, sizeof w);
                st->bad_tensors++;
                fail(r, "%s (%s): %" PRIu64 " of %" PRIu64 " floats differ from ggml's to_float; "
                     "max |diff| %.9g at %s (ggml %.9g, ours %.9g)", t->name,
                     moe_type_get(t->type)->name, bad, n, md, w, a[at], b[at]);
            }
        }
        free(a);
        free(b);
    }
    check_end(r);
}

/* ---- llama.cpp's demands for LLM_ARCH_QWEN3MOE --------------------------------------------- */

/* llama_model_loader::get_key throws "key X has wrong type T but expected type U" unless the
 * stored type is exactly the one the C++ variable maps to (u32 for counts, f32 for floats, bool,
 * string); get_key_or_arr also accepts an array of i32/u32/f32. */
static int64_t want_kv(struct report *r, const struct gx_file *g, const char *key, int type,
                       bool or_arr, bool required, const char *if_absent)
{
    int64_t i = gx_find_kv(g, key);
    if (i < 0) {
        if (required)
            fail(r, "llama.cpp: required key %s (%s) is missing", key, gx_kv_type_name(type));
        else if (if_absent)
            note(r, "llama.cpp: optional key %s is absent: %s", key, if_absent);
        return -1;
    }
    int t = gx_kv_type(g, i);
    if (t == type)
        return i;
    if (or_arr && t == GGUF_ARRAY) {
        int at = gx_kv_arr_type(g, i);
        if (at == GGUF_I32 || at == GGUF_U32 || at == GGUF_F32)
            return i;
    }
    fail(r, "llama.cpp: key %s has type %s%s%s, llama.cpp requires %s", key, gx_kv_type_name(t),
         t == GGUF_ARRAY ? " of " : "",
         t == GGUF_ARRAY ? gx_kv_type_name(gx_kv_arr_type(g, i)) : "",
         gx_kv_type_name(type));
    return -2;
}

static uint32_t kv_u32(const struct gx_file *g, int64_t i, uint32_t dflt)
{
    if (i < 0)
        return dflt;
    if (gx_kv_type(g, i) == GGUF_ARRAY) /* per-layer array: the first layer's value */
        return gx_kv_arr_type(g, i) == GGUF_F32 ? (uint32_t) * (const float *)gx_kv_data(g, i)
                                                : *(const uint32_t *)gx_kv_data(g, i);
    return *(const uint32_t *)gx_kv_data(g, i);
}

static float kv_f32(const struct gx_file *g, int64_t i, float dflt)
{
    return i < 0 ? dflt : *(const float *)gx_kv_data(g, i);
}

struct hp {
    uint32_t n_ctx, n_embd, n_layer, n_ff, n_head, n_head_kv, head_k, head_v, n_rot;
    uint32_t n_expert, n_expert_used, n_ff_exp, n_vocab;
    float eps, rope_base;
};

static void check_llama_hparams(struct report *r, const struct gx_file *g, struct hp *h)
{
    char k[128];
#define KEY(s) (snprintf(k, sizeof k, "qwen3moe.%s", s), k)
    memset(h, 0, sizeof *h);
    int64_t i;
    want_kv(r, g, "general.name", GGUF_STRING, false, false, NULL);
    want_kv(r, g, "general.alignment", GGUF_U32, false, false, NULL);
    want_kv(r, g, "general.file_type", GGUF_U32, false, false, NULL);
    want_kv(r, g, "general.quantization_version", GGUF_U32, false, false, NULL);
    i = want_kv(r, g, KEY("context_length"), GGUF_U32, false, true, NULL);
    h->n_ctx = kv_u32(g, i, 0);
    i = want_kv(r, g, KEY("embedding_length"), GGUF_U32, false, true, NULL);
    h->n_embd = kv_u32(g, i, 0);
    i = want_kv(r, g, KEY("block_count"), GGUF_U32, false, true, NULL);
    h->n_layer = kv_u32(g, i, 0);
    i = want_kv(r, g, KEY("expert_count"), GGUF_U32, false, true, NULL);
    h->n_expert = kv_u32(g, i, 0);
    i = want_kv(r, g, KEY("expert_used_count"), GGUF_U32, false, true, NULL);
    h->n_expert_used = kv_u32(g, i, 0);
    i = want_kv(r, g, KEY("feed_forward_length"), GGUF_U32, true, false,
                "n_ff = 0 (only used when expert_feed_forward_length is absent)");
    h->n_ff = kv_u32(g, i, 0);
    i = want_kv(r, g, KEY("attention.head_count"), GGUF_U32, true, true, NULL);
    h->n_head = kv_u32(g, i, 0);
    i = want_kv(r, g, KEY("attention.head_count_kv"), GGUF_U32, true, false,
                "n_head_kv defaults to n_head");
    h->n_head_kv = kv_u32(g, i, h->n_head);
    uint32_t dflt_head = h->n_head ? h->n_embd / h->n_head : 0;
    i = want_kv(r, g, KEY("attention.key_length"), GGUF_U32, false, false,
                "head_dim_k defaults to n_embd/n_head");
    h->head_k = kv_u32(g, i, dflt_head);
    i = want_kv(r, g, KEY("attention.value_length"), GGUF_U32, false, false,
                "head_dim_v defaults to n_embd/n_head");
    h->head_v = kv_u32(g, i, dflt_head);
    i = want_kv(r, g, KEY("rope.dimension_count"), GGUF_U32, false, false, NULL);
    h->n_rot = kv_u32(g, i, h->head_k);
    /* Optional for llama.cpp, but without it llama.cpp silently uses 10000 and computes
     * another model than Qwen3 (1e6): treated as a failure. */
    i = want_kv(r, g, KEY("rope.freq_base"), GGUF_F32, false, false, NULL);
    if (i == -1)
        fail(r, "qwen3moe.rope.freq_base is absent: llama.cpp would silently use 10000");
    h->rope_base = kv_f32(g, i, 10000.0f);
    i = want_kv(r, g, KEY("attention.layer_norm_rms_epsilon"), GGUF_F32, false, true, NULL);
    h->eps = kv_f32(g, i, 0);
    i = want_kv(r, g, KEY("expert_feed_forward_length"), GGUF_U32, false, false,
                "llama.cpp falls back to feed_forward_length / expert_used_count");
    h->n_ff_exp = i >= 0 ? kv_u32(g, i, 0) : (h->n_expert_used ? h->n_ff / h->n_expert_used : 0);
    want_kv(r, g, KEY("rope.scaling.type"), GGUF_STRING, false, false, NULL);
    want_kv(r, g, KEY("rope.scaling.factor"), GGUF_F32, false, false, NULL);
#undef KEY

    /* Per-layer arrays must have n_layer entries (get_key_or_arr throws otherwise). */
    static const char *const arr_keys[] = {"qwen3moe.feed_forward_length",
                                           "qwen3moe.attention.head_count",
                                           "qwen3moe.attention.head_count_kv"};
    for (size_t a = 0; a < sizeof arr_keys / sizeof *arr_keys; a++) {
        int64_t j = gx_find_kv(g, arr_keys[a]);
        if (j >= 0 && gx_kv_type(g, j) == GGUF_ARRAY && gx_kv_arr_n(g, j) != h->n_layer)
            fail(r, "llama.cpp: %s has %zu entries, n_layer is %u", arr_keys[a],
                 gx_kv_arr_n(g, j), h->n_layer);
    }
    if (h->n_layer == 0 || h->n_layer > 512)
        fail(r, "llama.cpp: block_count %u not in 1..512 (LLAMA_MAX_LAYERS)", h->n_layer);
    if (h->n_expert == 0 || h->n_expert > 512)
        fail(r, "llama.cpp: expert_count %u not in 1..512 (LLAMA_MAX_EXPERTS; 'n_expert must be "
             "> 0 for QWEN3MOE')", h->n_expert);
    if (h->n_expert_used == 0 || h->n_expert_used > h->n_expert)
        fail(r, "llama.cpp: expert_used_count %u not in 1..expert_count", h->n_expert_used);
    if (h->n_head == 0)
        fail(r, "llama.cpp: head_count 0 (no attention)");
    if (h->head_k != h->head_v || h->head_k != h->n_rot)
        fail(r, "llama.cpp: qwen3moe graph asserts head_dim_k == head_dim_v == n_rot; file gives "
             "%u, %u, %u", h->head_k, h->head_v, h->n_rot);
    if (!(h->eps > 0))
        fail(r, "llama.cpp: layer_norm_rms_epsilon %g is not positive", (double)h->eps);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static bool is_token_id_key(const char *key)
{
    size_t n = strlen(key), k = strlen("_token_id");
    return !strncmp(key, "tokenizer.ggml.", 15) && n > k && !strcmp(key + n - k, "_token_id");
}

static void check_llama_vocab(struct report *r, const struct gx_file *g, struct hp *h)
{
    int64_t i = want_kv(r, g, "tokenizer.ggml.model", GGUF_STRING, false, true, NULL);
    if (i >= 0 && strcmp(gx_kv_str(g, i), "gpt2") != 0)
        note(r, "tokenizer.ggml.model is '%s', Qwen3 uses 'gpt2'", gx_kv_str(g, i));
    i = want_kv(r, g, "tokenizer.ggml.pre", GGUF_STRING, false, false,
                "llama.cpp warns and uses the 'default' pre-tokenizer: wrong tokenization");
    if (i >= 0 && strcmp(gx_kv_str(g, i), "qwen2") != 0)
        fail(r, "tokenizer.ggml.pre is '%s'; llama.cpp maps Qwen3 to 'qwen2'", gx_kv_str(g, i));
    int64_t tok = gx_find_kv(g, "tokenizer.ggml.tokens");
    if (tok < 0 || gx_kv_type(g, tok) != GGUF_ARRAY || gx_kv_arr_type(g, tok) != GGUF_STRING) {
        fail(r, "llama.cpp: tokenizer.ggml.tokens must be an array of strings ('cannot find "
             "tokenizer vocab in model file')");
        return;
    }
    size_t n_tok = gx_kv_arr_n(g, tok);
    h->n_vocab = (uint32_t)n_tok;
    for (size_t j = 0; j < n_tok; j++)
        if (!gx_kv_arr_str(g, tok, j)[0]) {
            note(r, "token %zu is empty (llama.cpp renames it [EMPTY_%zu])", j, j);
            break;
        }
    /* llama-vocab.cpp maps text -> id and then asserts id_to_token.size() ==
     * token_to_id.size(): one duplicated token string aborts the whole load. */
    const char **sorted = malloc((n_tok ? n_tok : 1) * sizeof *sorted);
    if (sorted) {
        for (size_t j = 0; j < n_tok; j++)
            sorted[j] = gx_kv_arr_str(g, tok, j);
        qsort(sorted, n_tok, sizeof *sorted, cmp_str);
        for (size_t j = 1; j < n_tok; j++)
            if (!strcmp(sorted[j - 1], sorted[j])) {
                fail(r, "token text '%s' appears twice: llama.cpp aborts (GGML_ASSERT "
                     "id_to_token.size() == token_to_id.size())", sorted[j]);
                break;
            }
        free(sorted);
    }
    /* llama-vocab.cpp reads token_type through gguf_get_arr_data as const int *, scores as
     * const float *: any other element type is silently misread. */
    i = gx_find_kv(g, "tokenizer.ggml.token_type");
    if (i < 0) {
        note(r, "tokenizer.ggml.token_type absent: every token is NORMAL, special tokens lose "
             "their CONTROL type");
    } else if (gx_kv_type(g, i) != GGUF_ARRAY || gx_kv_arr_type(g, i) != GGUF_I32) {
        fail(r, "tokenizer.ggml.token_type must be an i32 array (llama.cpp reads it as int *)");
    } else if (gx_kv_arr_n(g, i) < n_tok) {
        fail(r, "tokenizer.ggml.token_type has %zu entries for %zu tokens", gx_kv_arr_n(g, i),
             n_tok);
    } else {
        const int32_t *tt = gx_kv_data(g, i);
        for (size_t j = 0; j < n_tok; j++)
            if (tt[j] < 0 || tt[j] > 6) {
                fail(r, "token_type[%zu] = %d is not a llama_token_type (0..6)", j, tt[j]);
                break;
            }
    }
    i = gx_find_kv(g, "tokenizer.ggml.scores");
    if (i >= 0 && (gx_kv_type(g, i) != GGUF_ARRAY || gx_kv_arr_type(g, i) != GGUF_F32 ||
                   gx_kv_arr_n(g, i) < n_tok))
        fail(r, "tokenizer.ggml.scores must be an f32 array with one entry per token");
    i = gx_find_kv(g, "tokenizer.ggml.merges");
    if (i < 0 || gx_kv_type(g, i) != GGUF_ARRAY || gx_kv_arr_type(g, i) != GGUF_STRING) {
        fail(r, "llama.cpp: tokenizer.ggml.merges must be an array of strings for gpt2 "
             "('cannot find tokenizer merges in model file')");
    } else {
        size_t nm = gx_kv_arr_n(g, i);
        for (size_t j = 0; j < nm; j++) {
            const char *m = gx_kv_arr_str(g, i, j);
            if (!m[0] || !strchr(m + 1, ' ')) {
                fail(r, "merge %zu '%s' has no separating space after its first byte", j, m);
                break;
            }
        }
    }
    for (int64_t j = 0; j < gx_n_kv(g); j++) {
        const char *key = gx_kv_key(g, j);
        if (is_token_id_key(key)) {
            if (gx_kv_type(g, j) != GGUF_U32)
                fail(r, "llama.cpp: %s has type %s, llama.cpp requires u32", key,
                     gx_kv_type_name(gx_kv_type(g, j)));
            else if (*(const uint32_t *)gx_kv_data(g, j) >= n_tok)
                fail(r, "%s = %u is not a token id (< %zu); llama.cpp ignores it", key,
                     *(const uint32_t *)gx_kv_data(g, j), n_tok);
        } else if (!strcmp(key, "tokenizer.ggml.add_bos_token") ||
                   !strcmp(key, "tokenizer.ggml.add_eos_token") ||
                   !strcmp(key, "tokenizer.ggml.add_sep_token") ||
                   !strcmp(key, "tokenizer.ggml.add_space_prefix") ||
                   !strcmp(key, "tokenizer.ggml.remove_extra_whitespaces")) {
            if (gx_kv_type(g, j) != GGUF_BOOL)
                fail(r, "llama.cpp: %s has type %s, llama.cpp requires bool", key,
                     gx_kv_type_name(gx_kv_type(g, j)));
        } else if (!strcmp(key, "tokenizer.chat_template") && gx_kv_type(g, j) != GGUF_STRING) {
            fail(r, "tokenizer.chat_template has type %s, must be a string",
                 gx_kv_type_name(gx_kv_type(g, j)));
        }
    }
    if (gx_find_kv(g, "tokenizer.ggml.eos_token_id") < 0)
        note(r, "tokenizer.ggml.eos_token_id absent: llama.cpp generation never stops on EOS");
}

/* The tensors create_tensor() asks for, with the exact shapes it checks (all 4 dims; dims past
 * the listed ones must be 1), and llama.cpp's rule that the file has no tensor it did not ask
 * for ("wrong number of tensors"). */
static void check_llama_tensors(struct report *r, const struct gx_file *g, const struct hp *h)
{
    struct want {
        char name[64];
        int64_t ne[4];
        bool optional;
        bool seen;
    };
    size_t cap = 3 + 12 * (size_t)h->n_layer, n = 0;
    struct want *w = calloc(cap, sizeof *w);
    if (!w) {
        fail(r, "out of memory");
        return;
    }
#define ADD(opt, a, b, c, ...)                                                                     \
    do {                                                                                           \
        snprintf(w[n].name, sizeof w[n].name, __VA_ARGS__);                                       \
        w[n].ne[0] = (a), w[n].ne[1] = (b), w[n].ne[2] = (c), w[n].ne[3] = 1;                     \
        w[n].optional = (opt);                                                                     \
        n++;                                                                                       \
    } while (0)
    const int64_t E = h->n_embd, V = h->n_vocab, X = h->n_expert, F = h->n_ff_exp;
    const int64_t qd = (int64_t)h->head_k * h->n_head, kd = (int64_t)h->head_k * h->n_head_kv;
    const int64_t vd = (int64_t)h->head_v * h->n_head_kv;
    ADD(false, E, V, 1, "token_embd.weight");
    ADD(false, E, 1, 1, "output_norm.weight");
    ADD(true, E, V, 1, "output.weight");
    for (uint32_t l = 0; l < h->n_layer; l++) {
        ADD(false, E, 1, 1, "blk.%u.attn_norm.weight", l);
        ADD(false, E, qd, 1, "blk.%u.attn_q.weight", l);
        ADD(false, E, kd, 1, "blk.%u.attn_k.weight", l);
        ADD(false, E, vd, 1, "blk.%u.attn_v.weight", l);
        ADD(false, qd, E, 1, "blk.%u.attn_output.weight", l);
        ADD(false, h->head_k, 1, 1, "blk.%u.attn_k_norm.weight", l);
        ADD(false, h->head_k, 1, 1, "blk.%u.attn_q_norm.weight", l);
        ADD(false, E, 1, 1, "blk.%u.ffn_norm.weight", l);
        ADD(false, E, X, 1, "blk.%u.ffn_gate_inp.weight", l);
        ADD(false, E, F, X, "blk.%u.ffn_gate_exps.weight", l);
        ADD(false, F, E, X, "blk.%u.ffn_down_exps.weight", l);
        ADD(false, E, F, X, "blk.%u.ffn_up_exps.weight", l);
    }
#undef ADD

    for (int64_t i = 0; i < gx_n_tensors(g); i++) {
        const char *name = gx_tensor_name(g, i);
        struct want *m = NULL;
        for (size_t j = 0; j < n && !m; j++)
            if (!strcmp(w[j].name, name))
                m = &w[j];
        if (!m) {
            fail(r, "llama.cpp: tensor %s is not one qwen3moe loads ('wrong number of tensors')",
                 name);
            continue;
        }
        m->seen = true;
        int64_t ne[4];
        gx_tensor_ne(g, i, ne);
        if (memcmp(ne, m->ne, sizeof ne) != 0)
            fail(r, "llama.cpp: %s has shape {%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64
                 "}, expected {%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "}", name, ne[0],
                 ne[1], ne[2], ne[3], m->ne[0], m->ne[1], m->ne[2], m->ne[3]);
        /* weight_buft_supported(): llama.cpp refuses a weight no backend can multiply with;
         * on the CPU that is every block type plus F32/F16/BF16, not the plain integer types. */
        const char *tname;
        int64_t tblck;
        size_t tsize;
        bool tquant;
        int ty = gx_tensor_type(g, i);
        if (!gx_type_info(ty, &tname, &tblck, &tsize, &tquant) ||
            !(tquant || ty == GGML_F32_ID || ty == GGML_F16_ID || ty == GGML_BF16_ID))
            fail(r, "llama.cpp: %s has type %d (%s), which ggml cannot mat-mul", name, ty,
                 tquant || tblck ? tname : "?");
        size_t len = strlen(name);
        bool is_norm = len > 12 && !strcmp(name + len - 12, "_norm.weight");
        if (is_norm && gx_tensor_type(g, i) != 0)
            note(r, "%s is type %d, not F32 (llama.cpp converters keep norms F32)", name,
                 gx_tensor_type(g, i));
    }
    for (size_t j = 0; j < n; j++)
        if (!w[j].seen && !w[j].optional)
            fail(r, "llama.cpp: required tensor %s is missing", w[j].name);
    free(w);
}

/* Our tokenizer must build from the same vocabulary, with the token count, control types and
 * special ids llama.cpp reads from it. */
static void check_our_tokenizer(struct report *r, const struct gx_file *g,
                                const struct gguf_file *f)
{
    struct moe_tokenizer *t = NULL;
    char err[512];
    int64_t tok = gx_find_kv(g, "tokenizer.ggml.tokens");
    if (tok < 0)
        return;
    int rc = moe_tok_load(&t, f, err, sizeof err);
    if (rc) {
        fail(r, "moe_tok_load: %s (%s)", err, moe_strerror(rc));
        return;
    }
    size_t n = gx_kv_arr_n(g, tok);
    if (moe_tok_n_vocab(t) != n)
        fail(r, "moe_tok_n_vocab %u, tokenizer.ggml.tokens has %zu", moe_tok_n_vocab(t), n);
    static const char *const ids[] = {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"};
    for (int k = 0; k < 2; k++) {
        int64_t i = gx_find_kv(g, ids[k]);
        int32_t ours = k ? moe_tok_bos(t) : moe_tok_eos(t);
        int64_t want = -1;
        if (i >= 0 && gx_kv_type(g, i) == GGUF_U32)
            want = *(const uint32_t *)gx_kv_data(g, i);
        if (ours != want)
            fail(r, "moe_tok %s = %d, the file says %" PRId64, k ? "bos" : "eos", ours, want);
    }
    int64_t tt = gx_find_kv(g, "tokenizer.ggml.token_type");
    if (tt >= 0 && gx_kv_arr_type(g, tt) == GGUF_I32 && gx_kv_arr_n(g, tt) >= n) {
        const int32_t *ty = gx_kv_data(g, tt);
        /* CONTROL (3) tokens must be control and NORMAL (1) ones must not; USER_DEFINED (4)
         * may be either: llama.cpp itself promotes <|fim_prefix|> and friends to control. */
        for (size_t j = 0; j < n; j++)
            if ((ty[j] == 3 && !moe_tok_is_control(t, (int32_t)j)) ||
                (ty[j] == 1 && moe_tok_is_control(t, (int32_t)j))) {
                fail(r, "token %zu: token_type %d but moe_tok_is_control says %d", j, ty[j],
                     moe_tok_is_control(t, (int32_t)j));
                break;
            }
    }
    moe_tok_free(t);
}

/* Our model description must agree with what llama.cpp derives from the same KVs. */
static void check_our_model(struct report *r, const struct gguf_file *f, const struct hp *h)
{
    struct moe_model m;
    char err[512];
    memset(&m, 0, sizeof m);
    int rc = moe_model_from_gguf(&m, f, err, sizeof err);
    if (rc) {
        fail(r, "moe_model_from_gguf: %s (%s)", err, moe_strerror(rc));
        return;
    }
    const struct moe_hparams *p = &m.hp;
#define SAME(ours, theirs)                                                                         \
    do {                                                                                           \
        if ((double)(ours) != (double)(theirs))                                                    \
            fail(r, "moe_model %s = %.9g, llama.cpp's view %.9g", #ours, (double)(ours),          \
                 (double)(theirs));                                                                \
    } while (0)
    SAME(p->n_layer, h->n_layer);
    SAME(p->n_embd, h->n_embd);
    SAME(p->n_head, h->n_head);
    SAME(p->n_head_kv, h->n_head_kv);
    SAME(p->head_dim, h->head_k);
    SAME(p->head_dim_v, h->head_v);
    SAME(p->n_expert, h->n_expert);
    SAME(p->n_expert_used, h->n_expert_used);
    SAME(p->expert_ff, h->n_ff_exp);
    SAME(p->n_vocab, h->n_vocab);
    SAME(p->rms_eps, h->eps);
    SAME(p->rope_base, h->rope_base);
    SAME(p->n_ctx_train, h->n_ctx);
#undef SAME
    moe_model_free(&m);
}

/* ---- against llama-quantize ----------------------------------------------------------------- */

/* What llama-quantize (no imatrix) would have written: every tensor of src dequantized by ggml
 * and quantized by ggml_quantize_chunk into the type this file chose for it. Reports, per block
 * type, how many blocks are byte-identical and the error of both encodings against src. */
static void compare_requant(struct report *r, const struct gguf_file *f, const char *src_path)
{
    struct gguf_file *src = NULL;
    char err[512];
    check_begin(r);
    int rc = gguf_open(&src, src_path, err, sizeof err);
    if (rc) {
        fail(r, "--ref %s: %s", src_path, err);
        check_end(r);
        return;
    }
    struct { uint64_t blocks, same; double eo, eg, ref; int tensors; } by[64];
    memset(by, 0, sizeof by);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const struct gguf_tensor *t = &f->tensors[i];
        const struct gguf_tensor *s = gguf_find_tensor(src, t->name);
        uint64_t n = (uint64_t)t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        if (!s || memcmp(s->ne, t->ne, sizeof t->ne) != 0) {
            fail(r, "--ref: %s missing from %s or shaped differently", t->name, src_path);
            continue;
        }
        const struct moe_type_info *ti = moe_type_get(t->type);
        float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
        uint8_t *q = malloc(t->nbytes ? t->nbytes : 1);
        if (!x || !y || !q || gx_dequantize((int)s->type, s->data, x, (int64_t)n) ||
            t->type >= 64) {
            fail(r, "--ref: %s: cannot dequantize the source", t->name);
            goto next;
        }
        size_t nb = gx_quantize((int)t->type, x, q, (int64_t)(n / t->ne[0]), t->ne[0]);
        if (nb != t->nbytes) {
            fail(r, "--ref: %s: ggml wrote %zu bytes, the file holds %" PRIu64, t->name, nb,
                 t->nbytes);
            goto next;
        }
        uint64_t nblk = n / ti->blck;
        by[t->type].tensors++;
        by[t->type].blocks += nblk;
        for (uint64_t b = 0; b < nblk; b++)
            by[t->type].same += !memcmp(q + b * ti->size, (const uint8_t *)t->data + b * ti->size,
                                        ti->size);
        double sref;
        gx_dequantize((int)t->type, q, y, (int64_t)n);
        by[t->type].eg += sq_err(x, y, (int64_t)n, &sref);
        gx_dequantize((int)t->type, t->data, y, (int64_t)n);
        by[t->type].eo += sq_err(x, y, (int64_t)n, &sref);
        by[t->type].ref += sref;
    next:
        free(x);
        free(y);
        free(q);
    }
    check_end(r);
    for (int t = 0; t < 64; t++) {
        if (!by[t].tensors)
            continue;
        double eg = sqrt(by[t].eg / by[t].ref), eo = sqrt(by[t].eo / by[t].ref);
        printf("  vs llama-quantize: %-5s %3d tensors: %6.2f%% blocks byte-identical; rel. RMS err "
               "vs source: ggml %.5f, this file %.5f (file/ggml %.4f)\n",
               moe_type_get((uint32_t)t)->name,
               by[t].tensors, 100.0 * by[t].same / by[t].blocks, eg, eo,
               eg > 0 ? eo / eg : (eo > 0 ? INFINITY : 1.0));
        if (eg > 0 && eo > eg * 1.03)
            fail(r, "--ref: %s tensors: this file's error is %.1f%% above llama-quantize's",
                 moe_type_get((uint32_t)t)->name, 100 * (eo / eg - 1));
    }
    gguf_close(src);
}

/* Which tensors got another block type than in OTHER (e.g. a llama-quantize output). */
static void compare_mix(struct report *r, const struct gguf_file *f, const char *other_path)
{
    struct gguf_file *o = NULL;
    char err[512];
    int same = 0, diff = 0;
    check_begin(r);
    int rc = gguf_open(&o, other_path, err, sizeof err);
    if (rc) {
        fail(r, "--mix %s: %s", other_path, err);
        check_end(r);
        return;
    }
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const struct gguf_tensor *t = &f->tensors[i];
        const struct gguf_tensor *u = gguf_find_tensor(o, t->name);
        if (!u) {
            note(r, "--mix: %s not in %s", t->name, other_path);
        } else if (u->type != t->type) {
            diff++;
            note(r, "--mix: %s is %s here, %s in %s", t->name, moe_type_get(t->type)->name,
                 moe_type_get(u->type)->name, other_path);
        } else {
            same++;
        }
    }
    check_end(r);
    printf("  type mix vs %s: %d tensors same type, %d differ\n", other_path, same, diff);
    gguf_close(o);
}

/* Every KV as ggml's loader sees it: the evidence for "llama.cpp gets the types it requires". */
static void show_kvs(const struct gx_file *g)
{
    for (int64_t i = 0; i < gx_n_kv(g); i++) {
        int t = gx_kv_type(g, i);
        printf("    kv %-45s %-6s", gx_kv_key(g, i), gx_kv_type_name(t));
        if (t == GGUF_ARRAY) {
            int at = gx_kv_arr_type(g, i);
            size_t n = gx_kv_arr_n(g, i);
            printf(" of %zu %s", n, gx_kv_type_name(at));
            if (n && at == GGUF_STRING)
                printf(": '%.24s', ...", gx_kv_arr_str(g, i, 0));
            else if (n && at == GGUF_I32)
                printf(": %d, ...", *(const int32_t *)gx_kv_data(g, i));
        } else if (t == GGUF_STRING) {
            const char *v = gx_kv_str(g, i);
            printf(" '");
            for (size_t k = 0; v[k] && k < 40; k++)
                putchar((unsigned char)v[k] < 32 ? ' ' : v[k]);
            printf("'%s", strlen(v) > 40 ? "..." : "");
        } else {
            const void *d = gx_kv_data(g, i);
            switch (t) {
            case GGUF_U32: printf(" %u", *(const uint32_t *)d); break;
            case GGUF_I32: printf(" %d", *(const int32_t *)d); break;
            case GGUF_U64: printf(" %" PRIu64, *(const uint64_t *)d); break;
            case GGUF_F32: printf(" %g", (double)*(const float *)d); break;
            case GGUF_BOOL: printf(" %s", *(const int8_t *)d ? "true" : "false"); break;
            default: break;
            }
        }
        putchar('\n');
    }
}

static int check_file(const char *path, const struct opts *o)
{
    struct report r = {.max_lines = o->max_lines};
    struct gx_file *g = NULL;
    struct gguf_file *f = NULL;
    char gerr[2300], oerr[512];
    bool have_gdata = false;
    uint64_t bytes_same = 0;
    struct deq_stats ds;
    struct hp h;
    int stage[4]; /* failures counted after: reader parity, dequantize, llama.cpp, moe_model */
    memset(&ds, 0, sizeof ds);
    memset(&h, 0, sizeof h);

    printf("== %s\n", path);
    check_begin(&r);
    if (gx_open(&g, path, !o->meta_only, gerr, sizeof gerr) == 0) {
        have_gdata = !o->meta_only;
    } else {
        fail(&r, "ggml: %s", gerr);
        /* Distinguish a bad header from a data section ggml cannot read. */
        if (!o->meta_only && gx_open(&g, path, false, gerr, sizeof gerr) == 0)
            note(&r, "ggml reads the header and tensor infos with no_alloc=true");
    }
    int rc = gguf_open(&f, path, oerr, sizeof oerr);
    if (rc)
        fail(&r, "gguf_open (ours): %s (%s)", oerr, moe_strerror(rc));
    check_end(&r);
    for (int k = 0; k < 4; k++)
        stage[k] = k == 2 ? -1 : r.fails;
    if (!g || !f)
        goto done;

    if (o->show_kv)
        show_kvs(g);
    compare_header(&r, g, f);
    compare_kvs(&r, g, f);
    compare_tensors(&r, g, f, have_gdata, &bytes_same);
    stage[0] = r.fails;
    if (!o->meta_only)
        compare_dequant(&r, f, &ds);
    stage[1] = r.fails;

    int64_t ai = gx_find_kv(g, "general.architecture");
    const char *arch = ai >= 0 ? gx_kv_str(g, ai) : NULL;
    check_begin(&r);
    if (!arch) {
        fail(&r, "llama.cpp: general.architecture must be a string");
    } else if (strcmp(arch, "qwen3moe") != 0) {
        note(&r, "architecture '%s': qwen3moe checks skipped", arch);
    } else if (f->n_tensors == 0) {
        /* llama.cpp loads a vocab-only file (vocab_only=true) without reading any hparams. */
        check_llama_vocab(&r, g, &h);
        check_end(&r);
        stage[2] = r.fails;
        check_our_tokenizer(&r, g, f);
    } else {
        check_llama_hparams(&r, g, &h);
        check_llama_vocab(&r, g, &h);
        check_end(&r);
        if (h.n_vocab == 0) { /* no vocabulary (already a failure): check shapes against the file */
            const struct gguf_tensor *te = gguf_find_tensor(f, "token_embd.weight");
            h.n_vocab = te ? (uint32_t)te->ne[1] : 0;
        }
        check_llama_tensors(&r, g, &h);
        check_end(&r);
        stage[2] = r.fails;
        check_our_model(&r, f, &h);
        check_our_tokenizer(&r, g, f);
    }
    check_end(&r);
    if (stage[2] < 0)
        stage[2] = r.fails;
    stage[3] = r.fails;
    if (o->ref)
        compare_requant(&r, f, o->ref);
    if (o->mix)
        compare_mix(&r, f, o->mix);

done:
    bool ran = g && f;
    printf("%s  %s  (%s; ggml: %s; KVs %" PRIu64 ", tensors %" PRIu64 ", bytes equal %.1f MiB, "
           "dequantized %" PRIu64 " tensors / %.2f M floats, %" PRIu64 " differ; %d notes)\n",
           r.fails ? "FAIL" : "PASS", path, o->meta_only ? "metadata only" : "with data",
           have_gdata ? "no_alloc=false" : "no_alloc=true", f ? f->n_kv : 0,
           f ? f->n_tensors : 0, bytes_same / 1048576.0, ds.tensors, ds.elements / 1e6,
           ds.bad_tensors, r.notes);
    /* One verdict per question, for the results table in docs/ggml-check.md. */
    printf("      verdicts: readers-agree=%s dequant=%s llama.cpp-qwen3moe=%s moe_model+tok=%s "
           "extra=%s\n", stage[0] ? "FAIL" : "ok",
           !ran || o->meta_only ? "n/a" : stage[1] > stage[0] ? "FAIL" : "ok",
           !ran ? "n/a" : stage[2] > stage[1] ? "FAIL" : "ok",
           !ran ? "n/a" : stage[3] > stage[2] ? "FAIL" : "ok",
           !ran || !(o->ref || o->mix) ? "n/a" : r.fails > stage[3] ? "FAIL" : "ok");
    if (ds.tensors) {
        printf("      types:");
        for (int t = 0; t < 64; t++)
            if (ds.per_type[t])
                printf(" %s×%" PRIu64, moe_type_get((uint32_t)t)->name, ds.per_type[t]);
        printf("\n");
    }
    gx_close(g);
    if (f)
        gguf_close(f);
    return r.fails ? 1 : 0;
}

/* ---- type tables ---------------------------------------------------------------------------- */

static int check_types(void)
{
    struct report r = {.max_lines = 100};
    int n = gx_type_count() > MOE_TYPE_COUNT ? gx_type_count() : MOE_TYPE_COUNT;
    int same = 0;
    printf("== type tables (ggml GGML_TYPE_COUNT %d, ours MOE_TYPE_COUNT %d)\n", gx_type_count(),
           MOE_TYPE_COUNT);
    check_begin(&r);
    for (int t = 0; t < n; t++) {
        const char *gname;
        int64_t blck;
        size_t size;
        bool quant;
        bool g = gx_type_info(t, &gname, &blck, &size, &quant);
        const struct moe_type_info *m = moe_type_get((uint32_t)t);
        if (!g && !m)
            continue;
        if (g && !m) {
            note(&r, "type %d (%s) exists in ggml, not in store/ggml_type.c: our reader rejects it",
                 t, gname);
        } else if (!g && m) {
            fail(&r, "type %d (%s) in store/ggml_type.c does not exist in ggml", t, m->name);
        } else if (strcmp(gname, m->name) || blck != (int64_t)m->blck || size != m->size) {
            fail(&r, "type %d: ggml %s %" PRId64 "/%zu, ours %s %u/%u", t, gname, blck, size,
                 m->name, m->blck, m->size);
        } else {
            same++;
        }
    }
    check_end(&r);
    printf("%s  type tables: %d ids agree (name, block elements, block bytes), %d notes\n",
           r.fails ? "FAIL" : "PASS", same, r.notes);
    return r.fails ? 1 : 0;
}

/* ---- quantizers ------------------------------------------------------------------------------ */

static uint64_t rng_state;

static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_unif(void) { return ((rng_next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

static double rng_gauss(void)
{
    return sqrt(-2.0 * log(rng_unif())) * cos(6.283185307179586 * rng_unif());
}

enum dist { D_GAUSS, D_OUTLIERS, D_WEIGHTS, D_UNIFORM, D_POSITIVE, D_EDGE, D_COUNT };
static const char *const dist_names[D_COUNT] = {
    "N(0,1)", "N(0,1)+1% x10", "N(0,0.02)", "U(-1,1)", "U(0,1)", "edge rows"};

/* Edge rows: the cases where a quantizer's choices (zero scale, sign of the extreme value,
 * fp16 overflow and underflow of the scale) are most likely to differ. */
static const char *const edge_names[12] = {
    "zeros", "all 1", "all -3", "sparse spikes 7", "N(0,1e-6)", "N(0,1e-9)", "N(0,4e3)",
    "alternating +-1", "U(-1,0)", "half blocks zero", "integers -8..7", "N(0,1) + -100 spikes"};

static void edge_row(int k, float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        double v;
        switch (k % 12) {
        case 0: v = 0; break;
        case 1: v = 1.0; break;
        case 2: v = -3.0; break;
        case 3: v = i % 97 == 5 ? 7.0 : 0.0; break;
        case 4: v = 1e-6 * rng_gauss(); break;
        case 5: v = 1e-9 * rng_gauss(); break;
        case 6: v = 4e3 * rng_gauss(); break; /* |x| stays below the f16 maximum */
        case 7: v = (i & 1) ? 1.0 : -1.0; break;
        case 8: v = -rng_unif(); break;
        case 9: v = i % 32 < 16 ? rng_gauss() : 0.0; break;
        case 10: v = (double)(i % 16) - 8.0; break; /* exactly representable in Q4_0 */
        default: v = i % 256 == 0 ? -100.0 : rng_gauss(); break;
        }
        x[i] = (float)v;
    }
}

static void fill(enum dist d, float *x, int64_t rows, int64_t n)
{
    for (int64_t r = 0; r < rows; r++) {
        float *y = x + r * n;
        if (d == D_EDGE) {
            edge_row((int)r, y, n);
            continue;
        }
        for (int64_t i = 0; i < n; i++) {
            double v;
            switch (d) {
            case D_GAUSS: v = rng_gauss(); break;
            case D_OUTLIERS: v = rng_gauss() * (rng_unif() < 0.01 ? 10.0 : 1.0); break;
            case D_WEIGHTS: v = 0.02 * rng_gauss(); break;
            case D_UNIFORM: v = 2.0 * rng_unif() - 1.0; break;
            default: v = rng_unif(); break;
            }
            y[i] = (float)v;
        }
    }
}

static double sq_err(const float *x, const float *y, int64_t n, double *ref)
{
    double e = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)y[i] - x[i];
        e += d * d;
        s += (double)x[i] * x[i];
    }
    *ref = s;
    return e;
}

static int run_quant(const struct opts *o)
{
    static const uint32_t types[] = {MOE_TYPE_Q8_0, MOE_TYPE_Q4_0, MOE_TYPE_Q5_0, MOE_TYPE_Q4_K,
                                     MOE_TYPE_Q5_K, MOE_TYPE_Q6_K, MOE_TYPE_Q4_1, MOE_TYPE_Q5_1,
                                     MOE_TYPE_F16,  MOE_TYPE_BF16};
    const int64_t rows = o->rows, n = 4096, total = rows * n;
    struct report r = {.max_lines = 200};
    float *x = malloc(total * sizeof *x), *yg = malloc(total * sizeof *yg);
    float *yo = malloc(total * sizeof *yo), *z = malloc(total * sizeof *z);
    uint8_t *qg = malloc(total * 4), *qo = malloc(total * 4);
    if (!x || !yg || !yo || !z || !qg || !qo) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    printf("== quantizers: ggml_quantize_chunk (no imatrix) vs moe_quantize, %" PRId64
           " rows x %" PRId64 ", seed %" PRIu64 "\n", rows, n, o->seed);
    printf("| type | data | rel. RMS err ggml | rel. RMS err ours | ours/ggml | identical blocks "
           "| cross-dequant |\n|---|---|---|---|---|---|---|\n");
    check_begin(&r);
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
        uint32_t t = types[ti];
        const struct moe_type_info *info = moe_type_get(t);
        size_t row_bytes = moe_row_bytes(t, n);
        for (int d = 0; d < D_COUNT; d++) {
            rng_state = o->seed * 1000003u + (uint64_t)d;
            fill((enum dist)d, x, rows, n);
            size_t gb = gx_quantize((int)t, x, qg, rows, n);
            if (gb != row_bytes * rows) {
                fail(&r, "%s: ggml wrote %zu bytes, expected %zu", info->name, gb,
                     row_bytes * rows);
                continue;
            }
            for (int64_t i = 0; i < rows; i++)
                moe_quantize(t, x + i * n, qo + i * row_bytes, n);
            uint64_t nblk = (uint64_t)total / info->blck, same_blk = 0;
            for (uint64_t b = 0; b < nblk; b++)
                same_blk += !memcmp(qg + b * info->size, qo + b * info->size, info->size);
            /* Error of each encoding, both decoded by ggml. */
            gx_dequantize((int)t, qg, yg, total);
            gx_dequantize((int)t, qo, yo, total);
            /* Cross-decoding: our decoder on both encodings must equal ggml's bit for bit. */
            double md;
            uint64_t at, bad = 0;
            moe_dequantize(t, qg, z, total);
            bad += float_diff(yg, z, (uint64_t)total, &md, &at);
            moe_dequantize(t, qo, z, total);
            bad += float_diff(yo, z, (uint64_t)total, &md, &at);
            if (bad)
                fail(&r, "%s %s: moe_dequantize differs from ggml to_float on %" PRIu64 " floats",
                     info->name, dist_names[d], bad);
            bool nonfinite = false;
            for (int64_t i = 0; i < total; i++)
                if (!isfinite(yo[i]) && isfinite(yg[i]))
                    nonfinite = true;
            if (nonfinite)
                fail(&r, "%s %s: our encoding decodes to NaN/Inf where ggml's does not", info->name,
                     dist_names[d]);
            if (d == D_EDGE) {
                /* Per row, so that one hard case is visible on its own. */
                for (int64_t i = 0; i < rows && i < 12; i++) {
                    double s, eg = sq_err(x + i * n, yg + i * n, n, &s);
                    double eo = sq_err(x + i * n, yo + i * n, n, &s);
                    bool same = !memcmp(qg + i * row_bytes, qo + i * row_bytes, row_bytes);
                    double rg = s > 0 ? sqrt(eg / s) : sqrt(eg / n);
                    double ro = s > 0 ? sqrt(eo / s) : sqrt(eo / n);
                    if (ro > rg * 1.03 + 1e-12)
                        warn(&r, "%s edge row %" PRId64 " (%s): our error %.4g > ggml's %.4g",
                             info->name, i, edge_names[i], ro, rg);
                    else if (!same)
                        note(&r, "%s edge row %" PRId64 " (%s): bytes differ (error ours %.4g, "
                             "ggml %.4g)", info->name, i, edge_names[i], ro, rg);
                }
            }
            double s, eg = sq_err(x, yg, total, &s), eo = sq_err(x, yo, total, &s);
            double rg = sqrt(eg / s), ro = sqrt(eo / s);
            double ratio = rg > 0 ? ro / rg : (ro > 0 ? INFINITY : 1.0);
            printf("| %s | %s | %.5f | %.5f | %.4f | %.2f%% | %s |\n", info->name, dist_names[d],
                   rg, ro, ratio, 100.0 * same_blk / nblk, bad ? "DIFFERS" : "bit-exact");
            if (d != D_EDGE && ratio > 1.03)
                fail(&r, "%s %s: our error is %.1f%% above ggml's", info->name, dist_names[d],
                     100 * (ratio - 1));
        }
    }
    check_end(&r);

    /* Random block bytes (finite fp16/bf16 fields) through both decoders. */
    printf("\n== dequantize random blocks: ggml to_float vs moe_dequantize\n");
    check_begin(&r);
    static const uint32_t dtypes[] = {MOE_TYPE_F16, MOE_TYPE_BF16, MOE_TYPE_Q4_0, MOE_TYPE_Q4_1,
                                      MOE_TYPE_Q5_0, MOE_TYPE_Q5_1, MOE_TYPE_Q8_0, MOE_TYPE_Q4_K,
                                      MOE_TYPE_Q5_K, MOE_TYPE_Q6_K};
    for (size_t ti = 0; ti < sizeof dtypes / sizeof *dtypes; ti++) {
        uint32_t t = dtypes[ti];
        const struct moe_type_info *info = moe_type_get(t);
        uint64_t nblk = (uint64_t)total / info->blck;
        rng_state = o->seed ^ (0xb10c5ull + t);
        for (uint64_t i = 0; i < nblk * info->size; i++)
            qo[i] = (uint8_t)rng_next();
        /* Finite half fields: their byte offsets in each block. */
        int hoff[2] = {-1, -1};
        switch (t) {
        case MOE_TYPE_Q4_0: case MOE_TYPE_Q5_0: case MOE_TYPE_Q8_0: hoff[0] = 0; break;
        case MOE_TYPE_Q4_1: case MOE_TYPE_Q5_1: case MOE_TYPE_Q4_K: case MOE_TYPE_Q5_K:
            hoff[0] = 0, hoff[1] = 2; break;
        case MOE_TYPE_Q6_K: hoff[0] = 208; break;
        default: break;
        }
        for (uint64_t b = 0; b < nblk; b++) {
            uint8_t *blk = qo + b * info->size;
            if (t == MOE_TYPE_F16 || t == MOE_TYPE_BF16) {
                uint16_t h;
                memcpy(&h, blk, 2);
                if (t == MOE_TYPE_F16)
                    h = (uint16_t)((h & 0x83ff) | ((rng_next() % 31) << 10));
                else
                    h = (uint16_t)((h & 0x807f) | ((rng_next() % 255) << 7));
                memcpy(blk, &h, 2);
            }
            for (int k = 0; k < 2; k++)
                if (hoff[k] >= 0) {
                    uint16_t h;
                    memcpy(&h, blk + hoff[k], 2);
                    h = (uint16_t)((h & 0x83ff) | ((rng_next() % 31) << 10));
                    memcpy(blk + hoff[k], &h, 2);
                }
        }
        gx_dequantize((int)t, qo, yg, total);
        moe_dequantize(t, qo, yo, total);
        double md;
        uint64_t at, bad = float_diff(yg, yo, (uint64_t)total, &md, &at);
        if (bad)
            fail(&r, "%s: %" PRIu64 " of %" PRId64 " floats differ, max |diff| %.9g at block "
                 "%" PRIu64 " element %" PRIu64 " (ggml %.9g, ours %.9g)", info->name, bad, total,
                 md, at / info->blck, at % info->blck, yg[at], yo[at]);
        else
            printf("  %s: %" PRIu64 " random blocks, all %" PRId64 " floats bit-identical\n",
                   info->name, nblk, total);
    }
    /* The comparison itself must see a one-ulp change, or every "bit-identical" above is void. */
    memcpy(yo, yg, 64 * sizeof *yo);
    {
        uint32_t bits;
        memcpy(&bits, &yo[17], 4);
        bits ^= 1;
        memcpy(&yo[17], &bits, 4);
        double md;
        uint64_t at;
        if (float_diff(yg, yo, 64, &md, &at) != 1 || at != 17)
            fail(&r, "self-test: float_diff missed a one-ulp change");
        else
            printf("  self-test: a one-ulp change in one float is detected\n");
    }
    check_end(&r);
    printf("%s  quantizers (%d failures, %d edge-case warnings, %d notes)\n",
           r.fails ? "FAIL" : "PASS", r.fails, r.warns, r.notes);
    free(x);
    free(yg);
    free(yo);
    free(z);
    free(qg);
    free(qo);
    return r.fails ? 1 : 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: ggml_check [--meta-only] [--max-lines N] [--ref SRC] [--mix OTHER]\n"
               "                  [--show-kv] FILE.gguf...\n"
               "       ggml_check --quant [--seed S] [--rows N]\n"
               "       ggml_check --types\n");
}

int main(int argc, char **argv)
{
    struct opts o = {.max_lines = 8, .seed = 1, .rows = 64};
    bool quant = false, types = false;
    int failed = 0, n_files = 0;
    char **files = calloc((size_t)argc, sizeof *files);
    if (!files)
        return 2;
    /* Options may come before or after the files; they apply to every file. */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--meta-only")) {
            o.meta_only = true;
        } else if (!strcmp(argv[i], "--quant")) {
            quant = true;
        } else if (!strcmp(argv[i], "--types")) {
            types = true;
        } else if (!strcmp(argv[i], "--show-kv")) {
            o.show_kv = true;
        } else if (!strcmp(argv[i], "--ref") && i + 1 < argc) {
            o.ref = argv[++i];
        } else if (!strcmp(argv[i], "--mix") && i + 1 < argc) {
            o.mix = argv[++i];
        } else if (!strcmp(argv[i], "--max-lines") && i + 1 < argc) {
            o.max_lines = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
            o.seed = strtoull(argv[++i], NULL, 10);
        } else if (!strcmp(argv[i], "--rows") && i + 1 < argc) {
            o.rows = strtoll(argv[++i], NULL, 10);
            if (o.rows < 12 || o.rows > 4096) {
                fprintf(stderr, "ggml_check: --rows must be in 12..4096\n");
                free(files);
                return 2;
            }
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            free(files);
            return 0;
        } else if (argv[i][0] == '-') {
            usage(stderr);
            free(files);
            return 2;
        } else {
            files[n_files++] = argv[i];
        }
    }
    if (!types && !quant && !n_files) {
        usage(stderr);
        free(files);
        return 2;
    }
    if (types)
        failed |= check_types();
    if (quant)
        failed |= run_quant(&o);
    for (int i = 0; i < n_files; i++)
        failed |= check_file(files[i], &o);
    free(files);
    return failed ? 1 : 0;
}

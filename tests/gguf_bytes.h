/* A tiny in-test builder for GGUF bytes, so that every malformed-file test generates its own
 * input (nothing binary is committed) and the model tests can build qwen3moe files of any shape.
 *
 *   struct gb b = {0};
 *   gb_header(&b, 3, n_tensors, n_kv);
 *   gb_kv_str(&b, "general.architecture", "qwen3moe");
 *   ...
 *   gguf_open_mem(&f, b.p, b.n, err, sizeof err);
 *   gb_free(&b);
 *
 * gb_model() writes a complete, valid qwen3moe file; struct gb_model_opts lets a test drop a
 * tensor, change one tensor's shape or type, change the architecture or a hyperparameter. All
 * functions are static so that each test file gets its own copy. Allocation failures abort: this
 * is test code. */
#ifndef MOE_TESTS_GGUF_BYTES_H
#define MOE_TESTS_GGUF_BYTES_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/gguf.h"

struct gb {
    uint8_t *p;
    size_t n, cap;
};

static inline void gb_bytes(struct gb *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n)
            cap *= 2;
        b->p = realloc(b->p, cap);
        if (!b->p)
            abort();
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, src, n);
    b->n += n;
}

static inline void gb_free(struct gb *b)
{
    free(b->p);
    *b = (struct gb){0};
}

static inline void gb_u8(struct gb *b, uint8_t v) { gb_bytes(b, &v, 1); }
static inline void gb_u32(struct gb *b, uint32_t v) { gb_bytes(b, &v, 4); }
static inline void gb_i32(struct gb *b, int32_t v) { gb_bytes(b, &v, 4); }
static inline void gb_u64(struct gb *b, uint64_t v) { gb_bytes(b, &v, 8); }
static inline void gb_i64(struct gb *b, int64_t v) { gb_bytes(b, &v, 8); }
static inline void gb_f32(struct gb *b, float v) { gb_bytes(b, &v, 4); }

static inline void gb_zeros(struct gb *b, size_t n)
{
    static const uint8_t z[256];
    while (n) {
        size_t k = n < sizeof z ? n : sizeof z;
        gb_bytes(b, z, k);
        n -= k;
    }
}

static inline void gb_pad(struct gb *b, size_t align)
{
    gb_zeros(b, (align - b->n % align) % align);
}

/* A GGUF string: u64 length + bytes. */
static inline void gb_str(struct gb *b, const char *s)
{
    gb_u64(b, strlen(s));
    gb_bytes(b, s, strlen(s));
}

static inline void gb_header(struct gb *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    gb_bytes(b, "GGUF", 4);
    gb_u32(b, version);
    gb_u64(b, n_tensors);
    gb_u64(b, n_kv);
}

/* Key and type; the caller appends the value. */
static inline void gb_key(struct gb *b, const char *key, uint32_t type)
{
    gb_str(b, key);
    gb_u32(b, type);
}

static inline void gb_kv_u32(struct gb *b, const char *key, uint32_t v)
{
    gb_key(b, key, GGUF_U32);
    gb_u32(b, v);
}

static inline void gb_kv_f32(struct gb *b, const char *key, float v)
{
    gb_key(b, key, GGUF_F32);
    gb_f32(b, v);
}

static inline void gb_kv_str(struct gb *b, const char *key, const char *v)
{
    gb_key(b, key, GGUF_STRING);
    gb_str(b, v);
}

/* Array header; the caller appends n elements. */
static inline void gb_arr(struct gb *b, const char *key, uint32_t elem_type, uint64_t n)
{
    gb_key(b, key, GGUF_ARRAY);
    gb_u32(b, elem_type);
    gb_u64(b, n);
}

/* How many KVs gb_kv_all_scalars() writes. */
#define GB_N_ALL_SCALARS 12

/* One KV of every non-array value type, keyed by the type's name ("u8" ... "f64"), each holding an
 * edge value: u8 200, i8 -128, u16 65535, i16 -32768, u32 4000000000, i32 -5, f32 0.25, bool true,
 * str "hello", u64 UINT64_MAX, i64 INT64_MIN, f64 1e300. The getter tests and the fuzz seed
 * corpus both start from this set. */
static inline void gb_kv_all_scalars(struct gb *b)
{
    gb_key(b, "u8", GGUF_U8), gb_u8(b, 200);
    gb_key(b, "i8", GGUF_I8), gb_u8(b, 0x80);
    gb_key(b, "u16", GGUF_U16), gb_bytes(b, "\xff\xff", 2);
    gb_key(b, "i16", GGUF_I16), gb_bytes(b, "\x00\x80", 2);
    gb_kv_u32(b, "u32", 4000000000u);
    gb_key(b, "i32", GGUF_I32), gb_i32(b, -5);
    gb_kv_f32(b, "f32", 0.25f);
    gb_key(b, "bool", GGUF_BOOL), gb_u8(b, 1);
    gb_kv_str(b, "str", "hello");
    gb_key(b, "u64", GGUF_U64), gb_u64(b, UINT64_MAX);
    gb_key(b, "i64", GGUF_I64), gb_i64(b, INT64_MIN);
    double big = 1e300;
    gb_key(b, "f64", GGUF_F64), gb_bytes(b, &big, 8);
}

static inline void gb_tensor(struct gb *b, const char *name, uint32_t n_dims, const int64_t *ne,
                             uint32_t type, uint64_t offset)
{
    gb_str(b, name);
    gb_u32(b, n_dims);
    for (uint32_t i = 0; i < n_dims; i++)
        gb_i64(b, ne[i]);
    gb_u32(b, type);
    gb_u64(b, offset);
}

/* ---- complete qwen3moe files -------------------------------------------------------------- */

struct gb_model_opts {
    const char *arch;        /* default "qwen3moe" */
    uint32_t version;        /* default 3 */
    uint32_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_expert, n_expert_used, expert_ff;
    uint32_t n_vocab;        /* rows of token_embd (and of output) */
    uint32_t wtype;          /* ggml type of the 2-D/3-D weights (default 0 = f32) */
    int tied;                /* leave out output.weight */
    int with_vocab;          /* write a tokenizer.ggml.tokens array of n_vocab strings */
    const char *skip_tensor; /* leave this tensor out */
    const char *skip_key;    /* leave this key out (full name) */
    const char *odd_tensor;  /* give this tensor odd_ne / odd_type instead */
    int64_t odd_ne[4];
    uint32_t odd_n_dims, odd_type;
    const char *odd_key;     /* write this u32 key with odd_val instead of its real value */
    uint32_t odd_val;
};

/* Fills unset fields with a small valid shape. */
static inline void gb_model_defaults(struct gb_model_opts *o)
{
    if (!o->arch) o->arch = "qwen3moe";
    if (!o->version) o->version = 3;
    if (!o->n_layer) o->n_layer = 2;
    if (!o->n_embd) o->n_embd = 32;
    if (!o->n_head) o->n_head = 2;
    if (!o->n_head_kv) o->n_head_kv = 1;
    if (!o->head_dim) o->head_dim = 8;
    if (!o->n_expert) o->n_expert = 4;
    if (!o->n_expert_used) o->n_expert_used = 2;
    if (!o->expert_ff) o->expert_ff = 16;
    if (!o->n_vocab) o->n_vocab = 40;
}

struct gb_tinfo {
    char name[64];
    uint32_t n_dims, type;
    int64_t ne[4];
};

static inline int gb_model_tensors(const struct gb_model_opts *o, struct gb_tinfo *t, int max)
{
    int n = 0;
    uint32_t E = o->n_embd, hd = o->head_dim, H = o->n_head, Hkv = o->n_head_kv;
    uint32_t X = o->n_expert, F = o->expert_ff, V = o->n_vocab, W = o->wtype;
#define GB_T(nm, nd, t0, a, b2, c) \
    do { if (n < max) { t[n] = (struct gb_tinfo){"", nd, t0, {a, b2, c, 1}}; \
         snprintf(t[n].name, sizeof t[n].name, "%s", nm); n++; } } while (0)
    GB_T("token_embd.weight", 2, W, E, V, 1);
    GB_T("output_norm.weight", 1, 0, E, 1, 1);
    if (!o->tied)
        GB_T("output.weight", 2, W, E, V, 1);
    for (uint32_t l = 0; l < o->n_layer; l++) {
        char nm[64];
#define GB_L(sfx, nd, t0, a, b2, c) \
        do { snprintf(nm, sizeof nm, "blk.%u." sfx, l); GB_T(nm, nd, t0, a, b2, c); } while (0)
        GB_L("attn_norm.weight", 1, 0, E, 1, 1);
        GB_L("attn_q.weight", 2, W, E, hd * H, 1);
        GB_L("attn_k.weight", 2, W, E, hd * Hkv, 1);
        GB_L("attn_v.weight", 2, W, E, hd * Hkv, 1);
        GB_L("attn_output.weight", 2, W, hd * H, E, 1);
        GB_L("attn_q_norm.weight", 1, 0, hd, 1, 1);
        GB_L("attn_k_norm.weight", 1, 0, hd, 1, 1);
        GB_L("ffn_norm.weight", 1, 0, E, 1, 1);
        GB_L("ffn_gate_inp.weight", 2, 0, E, X, 1);
        GB_L("ffn_gate_exps.weight", 3, W, E, F, X);
        GB_L("ffn_up_exps.weight", 3, W, E, F, X);
        GB_L("ffn_down_exps.weight", 3, W, F, E, X);
#undef GB_L
    }
#undef GB_T
    int out = 0;
    for (int i = 0; i < n && i < max; i++) {
        if (o->skip_tensor && !strcmp(t[i].name, o->skip_tensor))
            continue;
        if (o->odd_tensor && !strcmp(t[i].name, o->odd_tensor)) {
            t[i].n_dims = o->odd_n_dims ? o->odd_n_dims : t[i].n_dims;
            t[i].type = o->odd_type ? o->odd_type : t[i].type;
            for (int d = 0; d < 4; d++)
                t[i].ne[d] = o->odd_ne[d] ? o->odd_ne[d] : (d < (int)t[i].n_dims ? t[i].ne[d] : 1);
        }
        t[out++] = t[i];
    }
    return out;
}

static inline uint64_t gb_tinfo_bytes(const struct gb_tinfo *t)
{
    /* Test files only use f32 (4), f16 (2) and q8_0 (34 bytes per 32) weights. */
    uint64_t n = (uint64_t)t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
    return t->type == 0 ? n * 4 : t->type == 1 ? n * 2 : t->type == 8 ? n / 32 * 34 : n * 4;
}

/* Writes a whole qwen3moe GGUF into b (which should be empty). */
static inline void gb_model(struct gb *b, struct gb_model_opts o)
{
    gb_model_defaults(&o);
    struct gb_tinfo t[3 + 12 * 64];
    int nt = gb_model_tensors(&o, t, (int)(sizeof t / sizeof t[0]));
    struct { const char *k; uint32_t v; } u32s[] = {
        {"block_count", o.n_layer}, {"context_length", 256}, {"embedding_length", o.n_embd},
        {"feed_forward_length", 4 * o.n_embd}, {"attention.head_count", o.n_head},
        {"attention.head_count_kv", o.n_head_kv}, {"attention.key_length", o.head_dim},
        {"attention.value_length", o.head_dim}, {"expert_count", o.n_expert},
        {"expert_used_count", o.n_expert_used},
        {"expert_feed_forward_length", o.expert_ff},
    };
    int n_u32 = (int)(sizeof u32s / sizeof u32s[0]);
    char key[128];
    int nkv = 0;
    struct gb kv = {0};
    gb_kv_str(&kv, "general.architecture", o.arch), nkv++;
    for (int i = 0; i < n_u32; i++) {
        snprintf(key, sizeof key, "%s.%s", o.arch, u32s[i].k);
        if (o.skip_key && !strcmp(key, o.skip_key))
            continue;
        gb_kv_u32(&kv, key, o.odd_key && !strcmp(key, o.odd_key) ? o.odd_val : u32s[i].v), nkv++;
    }
    const char *fkeys[] = {"rope.freq_base", "attention.layer_norm_rms_epsilon"};
    const float fvals[] = {1e6f, 1e-6f};
    for (int i = 0; i < 2; i++) {
        snprintf(key, sizeof key, "%s.%s", o.arch, fkeys[i]);
        if (o.skip_key && !strcmp(key, o.skip_key))
            continue;
        gb_kv_f32(&kv, key, fvals[i]), nkv++;
    }
    if (o.with_vocab) {
        gb_kv_str(&kv, "tokenizer.ggml.model", "gpt2"), nkv++;
        gb_arr(&kv, "tokenizer.ggml.tokens", GGUF_STRING, o.n_vocab), nkv++;
        for (uint32_t i = 0; i < o.n_vocab; i++) {
            char tok[16];
            snprintf(tok, sizeof tok, "t%u", i);
            gb_str(&kv, tok);
        }
        gb_arr(&kv, "tokenizer.ggml.token_type", GGUF_I32, o.n_vocab), nkv++;
        for (uint32_t i = 0; i < o.n_vocab; i++)
            gb_i32(&kv, 1);
    }
    gb_header(b, o.version, (uint64_t)nt, (uint64_t)nkv);
    gb_bytes(b, kv.p, kv.n);
    gb_free(&kv);
    uint64_t off = 0;
    for (int i = 0; i < nt; i++) {
        gb_tensor(b, t[i].name, t[i].n_dims, t[i].ne, t[i].type, off);
        off += (gb_tinfo_bytes(&t[i]) + 31) / 32 * 32;
    }
    gb_pad(b, 32);
    for (int i = 0; i < nt; i++) {
        uint64_t nb = gb_tinfo_bytes(&t[i]);
        /* Each tensor's bytes hold its index + 1 so that views into the data can be told apart. */
        size_t start = b->n;
        gb_zeros(b, nb);
        memset(b->p + start, i + 1, nb);
        gb_pad(b, 32);
    }
}

#endif

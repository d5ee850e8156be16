/* libFuzzer target for the GGUF reader and the model description.
 *
 * Any input must give either a clean error or a file whose every field can be read: on success
 * this touches every KV through the typed getters and array accessors, every tensor's first and
 * last data byte (ASan catches a view outside the buffer), and describes the model. The input is
 * copied into an exact-size heap buffer so that ASan sees reads past its end. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "store/err.h"
#include "store/gguf.h"
#include "store/model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile uint64_t sink;

static void touch_kvs(const struct gguf_file *f)
{
    char err[256];
    for (uint64_t i = 0; i < f->n_kv; i++) {
        const struct gguf_kv *kv = &f->kv[i];
        if (gguf_find_kv(f, kv->key) != kv)
            abort(); /* every key must be found, and be unique */
        uint32_t u32;
        uint64_t u64;
        int64_t i64;
        float f32;
        bool b;
        struct gguf_str s;
        const struct gguf_kv *arr;
        sink += (uint64_t)gguf_get_u32(f, kv->key, &u32, err, sizeof err);
        sink += (uint64_t)gguf_get_u64(f, kv->key, &u64, err, sizeof err);
        sink += (uint64_t)gguf_get_i64(f, kv->key, &i64, err, sizeof err);
        sink += (uint64_t)gguf_get_f32(f, kv->key, &f32, err, sizeof err);
        sink += (uint64_t)gguf_get_bool(f, kv->key, &b, err, sizeof err);
        if (gguf_get_str(f, kv->key, &s, err, sizeof err) == 0 && s.len)
            sink += (uint8_t)s.p[s.len - 1];
        if (kv->type != GGUF_ARRAY)
            continue;
        if (gguf_get_arr(f, kv->key, kv->v.arr.type, &arr, err, sizeof err) != 0)
            abort();
        for (uint64_t j = 0; j < arr->v.arr.n; j++) {
            uint32_t t = arr->v.arr.type;
            if (t == GGUF_STRING) {
                const struct gguf_str *e = &arr->v.arr.strs[j];
                if (e->len)
                    sink += (uint8_t)e->p[0] + (uint8_t)e->p[e->len - 1];
            } else if (t == GGUF_F32 || t == GGUF_F64) {
                sink += (uint64_t)(gguf_arr_f64(arr, j) != 0);
            } else {
                sink += (uint64_t)gguf_arr_i64(arr, j) + (uint64_t)(gguf_arr_f64(arr, j) != 0);
            }
        }
    }
}

static void touch_tensors(const struct gguf_file *f)
{
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const struct gguf_tensor *t = &f->tensors[i];
        if (gguf_find_tensor(f, t->name) != t)
            abort();
        if (t->nbytes) {
            const uint8_t *p = t->data;
            sink += p[0] + p[t->nbytes - 1];
        }
    }
}

static void touch_model(const struct gguf_file *f)
{
    char err[256];
    struct moe_model m;
    if (moe_model_from_gguf(&m, f, err, sizeof err) != 0)
        return;
    for (uint32_t l = 0; l < m.hp.n_layer; l++) {
        sink += moe_model_expert_bytes(&m, l);
        for (uint32_t e = 0; e < m.hp.n_expert; e++) {
            struct moe_expert_slice s;
            if (moe_model_expert_slice(&m, l, e, &s) != 0)
                abort();
            for (int k = 0; k < 3; k++) {
                if (s.size[k] == 0 || s.off[k] + s.size[k] > f->size)
                    abort();
                sink += f->base[s.off[k]] + f->base[s.off[k] + s.size[k] - 1];
            }
        }
    }
    moe_model_free(&m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy)
        return 0;
    memcpy(copy, data, size);
    char err[512];
    struct gguf_file *f = NULL;
    int rc = gguf_open_mem(&f, copy, size, err, sizeof err);
    if (rc == 0) {
        touch_kvs(f);
        touch_tensors(f);
        sink += gguf_fingerprint(f);
        touch_model(f);
        gguf_close(f);
    } else if (f != NULL || err[0] == '\0') {
        abort(); /* an error must leave no file and say why */
    }
    free(copy);
    return 0;
}

#ifdef FUZZ_GGUF_GEN_CORPUS
/* Seed corpus generator (not part of the fuzzer):
 *   cc -DFUZZ_GGUF_GEN_CORPUS -I. -D_GNU_SOURCE -o /tmp/gen tests/fuzz_gguf.c store/gguf.c \
 *      store/model.c store/err.c store/ggml_type.c -lxxhash -lm && /tmp/gen tests/fuzz-corpus/gguf
 * Small qwen3moe-shaped files (a few KiB) and variants that reach the other branches. */
#include <stdio.h>

#include "store/ggml_type.h"
#include "tests/gguf_bytes.h"

static void save(const char *dir, const char *name, struct gb *b)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp || fwrite(b->p, 1, b->n, fp) != b->n || fclose(fp) != 0) {
        perror(path);
        exit(1);
    }
    /* Every seed except the deliberately broken ones must open. */
    char err[256];
    struct gguf_file *f;
    int rc = gguf_open_mem(&f, b->p, b->n, err, sizeof err);
    printf("%-24s %6zu bytes  %s\n", name, b->n, rc ? err : "ok");
    if (!rc)
        gguf_close(f);
    gb_free(b);
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : ".";
    struct gb b = {0};
    struct gb_model_opts tiny = {.n_layer = 1, .n_embd = 16, .n_head = 2, .n_head_kv = 1,
                                 .head_dim = 8, .n_expert = 4, .n_expert_used = 2,
                                 .expert_ff = 8, .n_vocab = 16, .wtype = MOE_TYPE_F16,
                                 .with_vocab = 1};
    gb_model(&b, tiny);
    save(dir, "tiny-f16.gguf", &b);

    struct gb_model_opts v2 = tiny;
    v2.version = 2;
    v2.tied = 1;
    v2.with_vocab = 0;
    gb_model(&b, v2);
    save(dir, "tiny-v2-tied.gguf", &b);

    struct gb_model_opts q8 = tiny;
    q8.n_embd = 32;
    q8.head_dim = 16;
    q8.wtype = MOE_TYPE_Q8_0;
    q8.expert_ff = 32; /* rows of ffn_down_exps must hold whole q8_0 blocks */
    q8.n_expert = 2;
    q8.with_vocab = 0;
    gb_model(&b, q8);
    save(dir, "tiny-q8_0.gguf", &b);

    struct gb_model_opts two = tiny;
    two.n_layer = 2;
    two.n_embd = 8;
    two.head_dim = 4;
    two.expert_ff = 4;
    two.n_vocab = 8;
    two.arch = "qwen3moe";
    gb_model(&b, two);
    save(dir, "tiny-2layer.gguf", &b);

    /* Vocab-only file: string arrays and an i32 array, no tensors. */
    gb_header(&b, 3, 0, 6);
    gb_kv_str(&b, "general.architecture", "qwen3moe");
    gb_kv_str(&b, "tokenizer.ggml.model", "gpt2");
    gb_arr(&b, "tokenizer.ggml.tokens", GGUF_STRING, 6);
    const char *toks[] = {"a", "b", "ab", "\xc4\xa0", "<|im_end|>", ""};
    for (int i = 0; i < 6; i++)
        gb_str(&b, toks[i]);
    gb_arr(&b, "tokenizer.ggml.token_type", GGUF_I32, 6);
    for (int i = 0; i < 6; i++)
        gb_i32(&b, i == 4 ? 3 : 1);
    gb_arr(&b, "tokenizer.ggml.merges", GGUF_STRING, 1);
    gb_str(&b, "a b");
    gb_key(&b, "tokenizer.ggml.add_bos_token", GGUF_BOOL);
    gb_u8(&b, 0);
    save(dir, "vocab-only.gguf", &b);

    /* Every value type, and an array of each fixed-size type. */
    gb_header(&b, 3, 0, GB_N_ALL_SCALARS + 12);
    gb_kv_all_scalars(&b);
    const uint32_t ats[] = {GGUF_U8, GGUF_I8, GGUF_U16, GGUF_I16, GGUF_U32, GGUF_I32,
                            GGUF_F32, GGUF_BOOL, GGUF_U64, GGUF_I64, GGUF_F64, GGUF_STRING};
    for (int i = 0; i < 12; i++) {
        char key[16];
        snprintf(key, sizeof key, "a%d", i);
        gb_arr(&b, key, ats[i], 2);
        if (ats[i] == GGUF_STRING) {
            gb_str(&b, "x");
            gb_str(&b, "yz");
        } else {
            uint32_t sz = gguf_vtype_size(ats[i]);
            gb_zeros(&b, sz);
            gb_u8(&b, 1);
            gb_zeros(&b, sz - 1);
        }
    }
    save(dir, "all-types.gguf", &b);

    /* Alignment 64, tensors out of order, an empty tensor, a 4-D tensor. */
    int64_t ne1[1] = {16}, ne0[2] = {0, 3}, ne4[4] = {2, 2, 2, 2};
    gb_header(&b, 3, 3, 1);
    gb_kv_u32(&b, "general.alignment", 64);
    gb_tensor(&b, "late", 1, ne1, MOE_TYPE_F32, 64);
    gb_tensor(&b, "empty", 2, ne0, MOE_TYPE_Q4_K, 0);
    gb_tensor(&b, "cube", 4, ne4, MOE_TYPE_F16, 0);
    gb_pad(&b, 64);
    gb_zeros(&b, 128);
    save(dir, "align64.gguf", &b);
    return 0;
}
#endif
